"""The formulation registry: one entry per formulation, read by the tests, the CLI and the docs.

Every entry's ``apply`` takes the row-convention multi-head signature of its family and returns
``[..., T_q, d_model]``:

* ``family="softmax"``: ``apply(params, x_q, x_kv=None, *, mask=None, bias=None, scale=None,
  residual=False)``, checked against :func:`attnref.oracle.attention`;
* ``family="linear"``: ``apply(params, x_q, x_kv=None, *, feature_map, causal=...,
  key_mask=None, eps=0.0, eps_policy="add", residual=False)``, checked against
  :func:`attnref.oracle.linear_multihead`; ``causal_modes`` says which ``causal`` values it takes
  (the first is the default).

* ``family="rope"``: ``apply(params, x_q, x_kv=None, *, positions_q=None, positions_kv=None,
  mask=None, bias=None, scale=None, base=10000.0, convention="rotate_half", residual=False)``,
  checked against :func:`attnref.oracle.rope_attention` (rotary position embedding changes the
  function, so it has its own oracle).

``native`` is the formulation in its own convention (column vectors, one query, an edge list, or
the kernel level ``(q, k, v)`` for linear forms), which ``apply`` adapts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

import jax

Convention = Literal["row", "column", "single-query", "graph", "kernel"]
Family = Literal["softmax", "linear", "rope"]


@dataclasses.dataclass(frozen=True)
class Formulation:
    """A registered formulation of multi-head attention."""

    id: str
    title: str
    equation: str  # LaTeX, display style
    convention: Convention
    citation: str
    apply: Callable[..., Any]
    native: Callable[..., Any]
    summary: str
    cost: str  # asymptotic FLOPs and peak memory of this order of operations
    family: Family = "softmax"
    causal_modes: tuple[bool, ...] = (False, True)
    static_argnames: tuple[str, ...] = ("residual",)  # for jax.jit(apply, static_argnames=...)
    cost_model: Callable[[Any], Any] | None = None  # Dims -> Cost (attnref._src.cost)

    def jit(self) -> Callable[..., Any]:
        """``jax.jit(apply)`` with this entry's static arguments."""
        return jax.jit(self.apply, static_argnames=self.static_argnames)


_REGISTRY: dict[str, Formulation] = {}


def register(formulation: Formulation) -> Formulation:
    """Add a formulation; ids are stable and unique."""
    if formulation.id in _REGISTRY:
        raise ValueError(f"formulation id {formulation.id!r} is already registered")
    _REGISTRY[formulation.id] = formulation
    return formulation


def get(formulation_id: str) -> Formulation:
    """The formulation with this id (``KeyError`` lists the known ids)."""
    try:
        return _REGISTRY[formulation_id]
    except KeyError:
        raise KeyError(
            f"unknown formulation {formulation_id!r}; known: {sorted(_REGISTRY)}"
        ) from None


def formulations(family: Family | None = None) -> tuple[Formulation, ...]:
    """Registered formulations in registration order, optionally of one family."""
    return tuple(f for f in _REGISTRY.values() if family is None or f.family == family)


def ids(family: Family | None = None) -> tuple[str, ...]:
    """Registry ids, optionally of one family."""
    return tuple(f.id for f in formulations(family))
