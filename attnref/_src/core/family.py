"""Formulation families: the contract every member of a family shares (its ``apply``
signature, float64 oracle, derived bound, required keyword arguments, example call and page
paragraph), so callers use ``f.family.oracle(...)`` instead of branching on family names. The
softmax family is defined here; the others live next to their formulations.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import numpy as np

from attnref import oracle, tolerance


@runtime_checkable  # isinstance-checkable: the test suite checks annotations at runtime
class ExampleProblem(Protocol):
    """What :attr:`Family.example` and :attr:`Family.required_kwargs` read from a problem
    (``attnref.report.Problem`` has all of it)."""

    @property
    def t_q(self) -> int: ...
    @property
    def t_k(self) -> int: ...
    @property
    def d_k(self) -> int: ...
    @property
    def seed(self) -> int: ...
    @property
    def feature_map(self) -> str: ...  # the name of the linear family's feature map


@dataclasses.dataclass(frozen=True)
class Example:
    """One way to call a family member on an example problem.

    Attributes:
        kwargs: Keyword arguments for ``apply``, the family's oracle and its bound alike.
        self_attention: Whether the call needs ``x_kv = x_q`` (``T_k = T_q``).
        note: The setting in words, as the report's last column shows it.
    """

    kwargs: dict[str, Any]
    self_attention: bool
    note: str


def no_kwargs(problem: ExampleProblem) -> dict[str, Any]:
    """``required_kwargs`` of a family whose members need nothing beyond ``(params, x_q, x_kv)``."""
    return {}


def masked_example(problem: ExampleProblem, causal: bool) -> Example:
    """The softmax family's example: causality as a boolean mask, cross-attention allowed."""
    mask = np.tril(np.ones((problem.t_q, problem.t_k), bool)) if causal else None
    return Example({"mask": mask}, False, "causal mask" if causal else "no mask")


@dataclasses.dataclass(frozen=True, eq=False)
class Family:
    """A family of formulations: one ``apply`` signature, one oracle, one derived bound
    (families compare by identity).

    Attributes:
        name: Stable name (``"softmax"``, ``"linear"``, ``"rope"``), unique among families.
        oracle: The float64 NumPy reference (:mod:`attnref.oracle`), the members' signature.
        bound: The derived error bound (:mod:`attnref.tolerance`), the oracle's signature plus
            a keyword ``dtype``.
        signature: The members' ``apply`` signature as text, for the docs.
        note: The Markdown paragraph the generated pages show under **Convention**.
        equation_symbols: LaTeX symbols of the family's kernel; every member's equation shows
            at least one of them (``tests/test_registry.py`` checks it).
        static_argnames: The default ``jax.jit`` static arguments of a member's ``apply``.
        required_kwargs: ``required_kwargs(problem) -> dict``: what every call needs beyond
            ``(params, x_q, x_kv)`` (the linear family's ``feature_map``).
        example: ``example(problem, causal) -> Example``: a complete call on ``problem``.
    """

    name: str
    oracle: Callable[..., np.ndarray]
    bound: Callable[..., np.ndarray]
    signature: str
    note: str
    equation_symbols: tuple[str, ...]
    static_argnames: tuple[str, ...] = ("residual",)
    required_kwargs: Callable[[ExampleProblem], dict[str, Any]] = no_kwargs
    example: Callable[[ExampleProblem, bool], Example] = masked_example

    def __repr__(self) -> str:
        return (
            f"Family({self.name!r}, oracle={public_path(self.oracle)}, "
            f"bound={public_path(self.bound)})"
        )


def public_path(fn: Callable[..., Any]) -> str:
    """The public dotted name of a function of a private submodule
    (``attnref.oracle._core.attention`` -> ``attnref.oracle.attention``)."""
    return f"{fn.__module__.split('._')[0]}.{fn.__name__}"


SOFTMAX = Family(
    name="softmax",
    oracle=oracle.attention,
    bound=tolerance.attention_error_bound,
    signature="apply(params, x_q, x_kv=None, *, mask=None, bias=None, scale=None, residual=False)",
    note="Scale $1/\\sqrt{d_k}$ unless `scale=` is given. A fully masked query row gets zero "
    "attention weights, so the output there is $b_O$ (see [conventions](../conventions.md)).",
    equation_symbols=("softmax", "sigma"),
)
