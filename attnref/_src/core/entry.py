"""The one wrapper around every formulation: validation, float64 scoping, the non-finite guard.

A formulation is a pure function of validated, finite inputs; it checks and guards nothing.
:func:`public` makes its public function, the same way at every level::

    inputs = level.prepare(*args, **kwargs)        # validation: errors name argument and shape
    out = inputs.run(formula)                      # the formula, on the finite parts
    return poison_rows(inputs.dirty_rows(), out)   # NaN on rows that read a non-finite value

inside :func:`~attnref._src.core.checks.float64_scoped`. A :class:`Level` declares a signature
once: its ``prepare`` (the signature and the validation) and its Args text. The row level
(:data:`ROWS`, :data:`ROW_PROBES`) is defined in :mod:`attnref._src.core.common`; the column,
kernel and linear levels live next to their formulations.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

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
        return guard(level.prepare(*args, **kwargs), formula, heads)

    fn: Any = float64_scoped(call)
    del fn.__wrapped__  # the signature is the level's, not ``call``'s
    returned = inspect.signature(formula).return_annotation  # what the caller gets back
    fn.__signature__ = inspect.signature(level.prepare).replace(return_annotation=returned)
    fn.__name__ = fn.__qualname__ = name
    fn.__module__ = formula.__module__
    fn.__doc__ = f"{summary}\n\n{level.args}\n\nReturns:\n    {returns}\n"
    fn.formula = formula
    return fn  # type: ignore[no-any-return]
