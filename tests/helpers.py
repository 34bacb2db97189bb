"""Shared test glue: example budgets, the suite's weight-level strategy, the agreement checks.

Problems come from :mod:`attnref.strategies` (``ast``): its ``attention_problems``
over :data:`attnref.strategies.WEIGHT_BUCKETS` (zero, one and two batch dims; a few fixed shapes,
so jit caches are reused), or :func:`attnref.strategies.make_attention_problem` for one problem.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st

from attnref import strategies as ast
from attnref.testing import assert_within_bound


def scaled(fraction: float) -> settings:
    """A share of the active profile's ``max_examples`` (``dev`` 8, ``ci`` 8, ``thorough``
    300), for properties whose examples are expensive; ``thorough`` still scales them up."""
    return settings(max_examples=max(2, round(settings.default.max_examples * fraction)))


def problems(
    dtypes: tuple[str, ...] = ("float32", "float64"),
    kinds: tuple[str, ...] = ast.WEIGHT_KINDS,
    param_bias: bool | None = True,
    buckets: tuple[ast.Config, ...] = ast.WEIGHT_BUCKETS,
) -> st.SearchStrategy[ast.AttentionProblem]:
    """:func:`attnref.strategies.attention_problems` with the suite's buckets and dtypes."""
    configs = ast.configs(buckets=buckets, dtypes=dtypes, value_dim_differs=True)
    return ast.attention_problems(configs, kinds=kinds, param_bias=param_bias)


def expected(problem: ast.AttentionProblem) -> tuple[np.ndarray, np.ndarray]:
    """Oracle output and the derived bound for the problem's inputs."""
    return problem.oracle(), problem.bound()


def check_formulation(
    apply: Callable[..., Any], problem: ast.AttentionProblem, label: str
) -> np.ndarray:
    """Run ``apply`` on the problem; assert dtype, shape and agreement with the oracle."""
    p = problem
    y = np.asarray(apply(p.params, p.x_q, p.x_kv, **p.inputs()))
    assert y.dtype == p.dtype, f"{label}: computed in {y.dtype}, asked for {p.dtype}"
    ref, bound = expected(p)
    assert_within_bound(y, ref, bound, label=label)
    return y


def thorough() -> bool:
    """Whether the ``thorough`` Hypothesis profile is loaded (``tests/conftest.py``): a sweep runs
    in full there and on its end sizes in ``ci`` and ``dev``."""
    return settings.get_current_profile_name() == "thorough"
