"""The formulation registry: one entry per formulation, read by the tests, the CLI and the docs.

Every entry's ``apply`` has the uniform row-convention signature
``apply(params, x_q, x_kv=None, *, mask=None, bias=None, scale=None, residual=False)`` returning
``[..., T_q, d_model]``; ``native`` is the formulation in its own convention (column vectors, one
query, an edge list), which ``apply`` adapts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, Literal

Convention = Literal["row", "column", "single-query", "graph"]


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


def formulations() -> tuple[Formulation, ...]:
    """All registered formulations, in registration order."""
    return tuple(_REGISTRY.values())


def ids() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def __iter__() -> Iterator[Formulation]:  # pragma: no cover - convenience
    return iter(_REGISTRY.values())
