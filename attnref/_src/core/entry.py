"""The one wrapper around every formulation: validation, float64 scoping, the non-finite guard.

A formulation is a pure function of validated, finite inputs; it checks and guards nothing.
:func:`public` makes its public function, the same way at every level::

    inputs = level.prepare(*args, **kwargs)        # validation: errors name argument and shape
    out = inputs.run(formula)                      # the formula, on the finite parts
    return poison_rows(inputs.dirty_rows(), out)   # NaN on rows that read a non-finite value

inside :func:`~attnref._src.core.checks.float64_scoped`, the last two lines as one compiled
program (:func:`compiled`) when the inputs are a pytree. A :class:`Level` declares a signature
once: its ``prepare`` (the signature and the validation) and its Args text. The row level
(:data:`ROWS`, :data:`ROW_PROBES`) is defined in :mod:`attnref._src.core.common`; the column,
kernel and linear levels live next to their formulations.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import jax
import numpy as np
from jaxtyping import Array

from attnref._src.core.checks import float64_scoped
from attnref._src.core.nonfinite import poison_rows


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
    """The non-finite guard: ``formula`` on finite inputs, NaN on the dirty rows.

    What a query may not read then never reaches its output or gradients, whatever it holds
    (:mod:`attnref._src.core.nonfinite`). ``heads=True``: the outputs carry a head axis before
    the row axis (``[..., H, T_q, ...]``).
    """
    dirty = inputs.dirty_rows()
    if heads:
        dirty = dirty[..., None, :]  # a size-1 head axis, broadcast by the selection
    return poison_rows(dirty, inputs.run(formula))


def traced(leaf: Any) -> bool:
    """Whether :func:`compiled` traces a leaf: arrays and NumPy scalars. Python numbers (a
    caller's ``scale``), strings, dtypes, specs and functions stay static: the formula sees them
    exactly as an eager call does."""
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic))


def compiled(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` as one compiled program: what a public function computes after validating.

    ``jax.jit`` with the array leaves of ``args`` traced and every other leaf static (part of
    the program's key), so an eager call compiles one program per shapes and options, reused,
    instead of dispatching each operation on its own (dozens of small compilations). Inside a
    caller's trace (``jit``, ``grad``, ``vmap``) it is inlined: the caller's program is the same
    as without it. Validation, including :func:`~attnref._src.core.checked.require`'s eager
    value checks, runs before it, on the caller's concrete arrays. An unhashable static leaf
    falls back to calling ``fn`` directly. Programs are cached by ``fn`` and the static leaves:
    code that patches attnref's internals at run time (a mutation test) calls
    ``jax.clear_caches()`` before and after.
    """
    leaves, tree = jax.tree_util.tree_flatten(args)
    mask = tuple(traced(leaf) for leaf in leaves)
    static = tuple(None if t else leaf for t, leaf in zip(mask, leaves, strict=True))
    try:
        hash(static)
    except TypeError:
        return fn(*args)
    dynamic = [leaf for t, leaf in zip(mask, leaves, strict=True) if t]
    return _program(fn, tree, mask, static, *dynamic)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3), inline=True)
def _program(
    fn: Callable[..., Any],
    tree: Any,
    mask: tuple[bool, ...],
    static: tuple[Any, ...],
    *dynamic: Any,
) -> Any:
    it = iter(dynamic)
    leaves = [next(it) if t else leaf for t, leaf in zip(mask, static, strict=True)]
    return fn(*jax.tree_util.tree_unflatten(tree, leaves))


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
) -> Callable[..., Any]:
    """The public function ``name`` of ``formula`` at ``level``: validate, scope float64, guard.

    Its signature is ``level.prepare``'s with ``formula``'s return annotation; its docstring
    is ``summary``, the level's Args text and ``returns``.
    """

    def call(*args: Any, **kwargs: Any) -> Any:
        return compiled(guard, level.prepare(*args, **kwargs), formula, heads)

    fn: Any = float64_scoped(call)
    del fn.__wrapped__  # the signature is the level's, not ``call``'s
    returned = inspect.signature(formula).return_annotation  # what the caller gets back
    fn.__signature__ = inspect.signature(level.prepare).replace(return_annotation=returned)
    fn.__name__ = fn.__qualname__ = name
    fn.__module__ = formula.__module__
    fn.__doc__ = f"{summary}\n\n{level.args}\n\nReturns:\n    {returns}\n"
    fn.formula = formula
    return fn  # type: ignore[no-any-return]
