"""The one wrapper around every formulation: validation, float64 scoping, the non-finite guard.

A formulation is a pure function of validated, finite inputs. :func:`public` makes its public
function at every level::

    inputs = level.prepare(*args, **kwargs)        # validation: errors name argument and shape
    out = inputs.run(formula)                      # the formula, on the finite parts
    return poison_rows(inputs.dirty_rows(), out)   # NaN on rows that read a non-finite value

inside ``float64_scoped``, the last two lines as one program (:func:`compiled`). A function
whose value checks must raise in an eager call runs as one program under ``checkify``
(:func:`checked_program`).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any, Protocol, TypeVar, runtime_checkable

import jax
import numpy as np
from jax.experimental import checkify
from jaxtyping import Array

from attnref._src.core.checks import float64_scoped, is_traced
from attnref._src.core.nonfinite import poison_rows

F = TypeVar("F", bound=Callable[..., Any])


@runtime_checkable  # the suite's runtime type checks read the annotations
class Guardable(Protocol):
    """Validated inputs of one call (what a level's ``prepare`` returns)."""

    def run(self, formula: Callable[..., Any]) -> Any:
        """``formula`` on the finite parts of the inputs (non-finite entries read as 0)."""
        ...

    def dirty_rows(self) -> Array:
        """The output rows that read a non-finite value through an allowed pair."""
        ...


def guard(inputs: Guardable, formula: Callable[..., Any], heads: bool = False) -> Any:
    """The non-finite guard: ``formula`` on finite inputs, NaN on the dirty rows (``heads``:
    outputs ``[..., H, T_q, ...]``)."""
    dirty = inputs.dirty_rows()
    if heads:
        dirty = dirty[..., None, :]  # a size-1 head axis, broadcast by the selection
    return poison_rows(dirty, inputs.run(formula))


def traced(leaf: Any) -> bool:
    """Whether :func:`compiled` traces a leaf (arrays and NumPy scalars; the rest is static)."""
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic))


def compiled(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` as one compiled program: what a public function computes after validating.

    ``jax.jit`` with the array leaves traced and the rest static (an eager call compiles once per
    shapes and options; inlined inside a caller's trace); an unhashable static leaf calls ``fn``
    directly. Code that patches attnref at run time calls ``jax.clear_caches()``.
    """
    split = _split(args, {})
    return fn(*args) if split is None else _program(fn, *split[:3], *split[3])


# A call split for jax.jit: (tree, mask, static, dynamic), ``mask`` marking the traced leaves.
Split = tuple[Any, tuple[bool, ...], tuple[Any, ...], list[Any]]


def flatten_call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Split:
    """``(args, kwargs)`` flattened, array leaves traced and the rest static."""
    leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
    mask = tuple(traced(leaf) for leaf in leaves)
    static = tuple(None if t else leaf for t, leaf in zip(mask, leaves, strict=True))
    return tree, mask, static, [leaf for t, leaf in zip(mask, leaves, strict=True) if t]


def _split(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Split | None:
    """:func:`flatten_call`, or ``None`` where the static part is unhashable."""
    split = flatten_call(args, kwargs)
    try:
        hash(split[2])
    except TypeError:
        return None
    return split


def call_flat(fn: Callable[..., Any], tree: Any, mask: Any, static: Any, *dynamic: Any) -> Any:
    """``fn`` on a :func:`flatten_call` split, ``dynamic`` in place of the traced leaves."""
    it = iter(dynamic)
    leaves = [next(it) if t else leaf for t, leaf in zip(mask, static, strict=True)]
    args, kwargs = jax.tree_util.tree_unflatten(tree, leaves)
    return fn(*args, **kwargs)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3), inline=True)
def _program(fn: Callable[..., Any], tree: Any, mask: Any, static: Any, *dynamic: Any) -> Any:
    return call_flat(fn, tree, mask, static, *dynamic)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))  # not inlined: checkify keeps it whole
def _checked_program(
    fn: Callable[..., Any], tree: Any, mask: Any, static: Any, *dynamic: Any
) -> Any:
    return call_flat(fn, tree, mask, static, *dynamic)


# what checkify adds to a failed check's message
_CHECK_SUFFIX = " (`check` failed)"


def checked_program(fn: F) -> F:
    """``fn``, called eagerly, as one compiled program whose value checks still raise.

    ``fn``'s static checks run while it is traced; its value checks
    (:func:`~attnref._src.core.checked.require`) are traced into the program, and ``checkify``
    around one ``jax.jit`` returns the first that failed, raised as the ``ValueError`` that
    ``fn`` run op by op raises. Array leaves are traced, the rest static (as :func:`compiled`);
    under a caller's trace, or with an unhashable static leaf, ``fn`` runs as it is."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        split = _split(args, kwargs)
        if split is None or is_traced(*split[3]):
            return fn(*args, **kwargs)
        program = functools.partial(_checked_program, fn, *split[:3])
        err, out = checkify.checkify(program, errors=checkify.user_checks)(*split[3])
        message = err.get()
        if message is not None:
            raise ValueError(message.removesuffix(_CHECK_SUFFIX))
        return out

    return wrapper  # type: ignore[return-value]


@dataclasses.dataclass(frozen=True)
class Level:
    """One calling convention: ``prepare`` has the public signature and validates a call into
    :class:`Guardable` inputs; ``args`` is its Args and Raises text, written once."""

    prepare: Callable[..., Guardable]
    args: str


def public(
    level: Level,
    formula: Callable[..., Any],
    *,
    name: str,
    summary: str,
    returns: str,
    heads: bool = False,
    guarded: bool = True,
) -> Callable[..., Any]:
    """The public function ``name`` of ``formula`` at ``level``: validate, scope float64, guard
    (``level.prepare``'s signature; docstring ``summary``, the level's Args and ``returns``).
    ``guarded=False`` (the probes, which show what the block computes): no non-finite guard,
    ``formula(params, rows)`` on the validated rows."""

    def call(*args: Any, **kwargs: Any) -> Any:
        prepared: Any = level.prepare(*args, **kwargs)
        if not guarded:
            return compiled(formula, prepared.params, prepared)
        return compiled(guard, prepared, formula, heads)

    fn: Any = float64_scoped(call)
    del fn.__wrapped__  # the signature is the level's, not ``call``'s
    returned = inspect.signature(formula).return_annotation  # what the caller gets back
    if returned.isidentifier():  # a class (AttentionProbes): evaluated, so the docs link it
        returned = inspect.signature(formula, eval_str=True).return_annotation
    fn.__signature__ = inspect.signature(level.prepare).replace(return_annotation=returned)
    fn.__name__ = fn.__qualname__ = name
    fn.__module__ = formula.__module__
    fn.__doc__ = f"{summary}\n\n{level.args}\n\nReturns:\n    {returns}\n"
    fn.formula = formula
    return fn  # type: ignore[no-any-return]
