"""The formulation registry: one entry per formulation, read by the tests, the CLI and the docs.

Every entry's ``apply`` takes its :class:`Family`'s row-convention signature and returns
``[..., T_q, d_model]``; ``native`` is the formulation in its own convention. A module registers
its formulations at its bottom; the registry imports :data:`FORMULATION_MODULES` on first read
and lists entries in that module order, then registration order.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Callable
from typing import Any, Literal

import jax

from attnref._src.core.family import SOFTMAX, Family

Convention = Literal["row", "column", "single-query", "graph", "kernel"]

# Citations that entries of several modules share.
REFACTOR = (
    "Refactoring the Attention Equations: Patterns and Messages (blog post, 2025-02-19); "
    "Reframing Attention: A Matrix Decomposition Perspective (blog post, 2025-02-18)."
)
# The post that introduces the per-head split of W_O and the messages M_i = X W_V[i] W_O[i].
HIDDEN_MESSAGES = "The Hidden Messages of Multi-Head Attention (blog post, 2025-02-17)"

# The modules that register formulations, in registry order.
FORMULATION_MODULES = (
    "attnref._src.formulations.standard",
    "attnref._src.formulations.merged",
    "attnref._src.formulations.column",
    "attnref._src.formulations.soft_search",
    "attnref._src.formulations.graph",
    "attnref._src.formulations.linear.multihead",
    "attnref._src.formulations.kernel_forms",
    "attnref._src.formulations.split_kv",
    "attnref._src.formulations.state_merge",
    "attnref._src.formulations.rope",
    "attnref._src.formulations.distributed.ring",
    "attnref._src.formulations.distributed.all_gather",
    "attnref._src.formulations.distributed.ulysses",
    "attnref._src.formulations.distributed.tensor_parallel",
)


@dataclasses.dataclass(frozen=True)
class Formulation:
    """A registered formulation of multi-head attention.

    Attributes:
        id: Stable, unique registry id (``[a-z_]+``); the multi-head row form is exported as
            ``<id>_attention`` where it is not ``native`` itself.
        title: One-line title of its page.
        equation: The formulation in LaTeX, display style.
        convention: How ``native`` takes tokens: ``"row"``, ``"column"``, ``"single-query"``,
            ``"graph"`` or ``"kernel"``.
        citation: Where the formulation comes from.
        apply: The multi-head row form, with the family's signature.
        native: The formulation in its own convention (may be ``apply`` itself).
        summary: One or two sentences for the page and ``attnref list``.
        cost: Asymptotic FLOPs and peak memory of this order of operations, in words.
        family: The :class:`Family` whose signature, oracle and bound apply (default softmax).
        causal_modes: The ``causal`` values ``apply`` takes, default first.
        static_argnames: ``jax.jit`` static arguments of ``apply`` (``None``: the family's).
        cost_model: ``<id>_cost(dims) -> Cost``, the analytic cost model.
        formula: The pure function its page shows (``None``: ``apply.formula``, else
            ``native``).
    """

    id: str
    title: str
    equation: str
    convention: Convention
    citation: str
    apply: Callable[..., Any]
    native: Callable[..., Any]
    summary: str
    cost: str
    family: Family = SOFTMAX
    causal_modes: tuple[bool, ...] = (False, True)
    static_argnames: tuple[str, ...] | None = None
    cost_model: Callable[[Any], Any] | None = None
    formula: Callable[..., Any] | None = None

    def __post_init__(self) -> None:
        if self.static_argnames is None:
            object.__setattr__(self, "static_argnames", self.family.static_argnames)
        if self.formula is None:
            formula = getattr(self.apply, "formula", None) or self.native
            object.__setattr__(self, "formula", getattr(formula, "formula", formula))

    def jit(self) -> Callable[..., Any]:
        """``jax.jit(apply)`` with this entry's static arguments."""
        return jax.jit(self.apply, static_argnames=self.static_argnames)


REGISTRY: dict[str, Formulation] = {}


def register(formulation: Formulation) -> Formulation:
    """Add ``formulation`` to the registry and return it; ``ValueError`` if its id is taken or its
    family's name is another family's."""
    if formulation.id in REGISTRY:
        raise ValueError(f"formulation id {formulation.id!r} is already registered")
    for other in REGISTRY.values():
        if other.family.name == formulation.family.name and other.family is not formulation.family:
            raise ValueError(f"another family is already registered as {other.family.name!r}")
    REGISTRY[formulation.id] = formulation
    return formulation


@functools.cache
def _load() -> None:
    """Import the modules that register the formulations (once; the registry is read lazily)."""
    for module in FORMULATION_MODULES:
        importlib.import_module(module)


def _rank(f: Formulation) -> int:
    module, modules = f.apply.__module__, FORMULATION_MODULES
    return modules.index(module) if module in modules else len(modules)


def get(formulation_id: str) -> Formulation:
    """The registered :class:`Formulation` with this id (e.g. ``"concat"``); ``KeyError``
    listing the known ids if there is none."""
    _load()
    if formulation_id not in REGISTRY:
        raise KeyError(f"unknown formulation {formulation_id!r}; known: {sorted(REGISTRY)}")
    return REGISTRY[formulation_id]


def formulations(family: Family | str | None = None) -> tuple[Formulation, ...]:
    """Registered formulations of ``family`` (a :class:`Family` or its name; ``None``: all), in
    the order of :data:`FORMULATION_MODULES`, then of registration."""
    _load()
    ordered = sorted(REGISTRY.values(), key=_rank)  # stable: registration order within a module
    name = getattr(family, "name", family)  # a Family's name, a name or None
    return tuple(f for f in ordered if name is None or f.family.name == name)


def families() -> tuple[Family, ...]:
    """The families of the registered formulations, in order of their first entry."""
    return tuple(dict.fromkeys(f.family for f in formulations()))


def ids(family: Family | str | None = None) -> tuple[str, ...]:
    """The ids of :func:`formulations` ``(family)``, in registry order."""
    return tuple(f.id for f in formulations(family))
