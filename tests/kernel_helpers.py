"""Kernel-level test glue: the suite's mixed-option strategy and the closeness check.

Problems come from :mod:`attnref.strategies` (``ast``): :func:`attnref.strategies.
mixed_kernel_problems` (a static option profile of :data:`attnref.strategies.STATIC_PROFILES`
with up to three array kinds, so jit caches are reused per profile) over
:data:`attnref.strategies.KERNEL_BUCKETS`, or :func:`attnref.strategies.make_kernel_problem`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import strategies as st

from attnref import strategies as ast
from attnref.testing import assert_ratio_within


def kproblems(
    dtypes: tuple[str, ...] = ("float32", "float64"),
    buckets: tuple[ast.Config, ...] = ast.KERNEL_BUCKETS,
    profiles: tuple[dict[str, Any], ...] = ast.STATIC_PROFILES,
) -> st.SearchStrategy[ast.KernelProblem]:
    """:func:`attnref.strategies.mixed_kernel_problems` with the suite's buckets and dtypes."""
    configs = ast.configs(buckets=buckets, dtypes=dtypes, value_dim_differs=True)
    return ast.mixed_kernel_problems(configs, profiles=profiles)


def expected(p: ast.KernelProblem, key_blocks: int | None = None) -> tuple[Any, Any, Any, Any]:
    """Oracle output and lse, and their derived bounds in the problem's dtype."""
    ref, ref_lse = p.oracle()
    bound, lse_bound = p.bound(key_blocks)
    return ref, ref_lse, bound, lse_bound


def assert_kernel_close(
    out: Any, lse: Any, problem: ast.KernelProblem, label: str, **kw: Any
) -> None:
    """``out`` and ``lse`` within their derived bounds of the oracle; NaN and ``-inf`` exactly
    where the oracle has them."""
    ref, ref_lse, bound, lse_bound = expected(problem, **kw)
    out = np.asarray(out, np.float64)
    lse = np.asarray(lse, np.float64)
    nan_ref = np.isnan(ref)
    np.testing.assert_array_equal(np.isnan(out), nan_ref, err_msg=f"{label}: NaN pattern")
    err = np.abs(np.where(nan_ref, 0.0, out - np.where(nan_ref, 0.0, ref)))
    assert_ratio_within(
        err,
        np.where(nan_ref, 0.0, bound),
        f"{label}: |out - oracle| = {{error:.3e}} > bound {{allowed:.3e}} at {{index}}",
    )
    inf_ref = np.isneginf(ref_lse)
    np.testing.assert_array_equal(np.isneginf(lse), inf_ref, err_msg=f"{label}: -inf lse")
    lerr = np.abs(np.where(inf_ref, 0.0, lse - np.where(inf_ref, 0.0, ref_lse)))
    assert_ratio_within(
        lerr,
        np.where(inf_ref, 0.0, lse_bound),
        f"{label}: lse error {{error:.3e}} exceeds its bound {{allowed:.3e}} at {{index}}",
    )
