"""Shared test helpers: bucketed problem strategies and the agreement checks.

Shapes come from a few fixed buckets so that jit caches are reused across examples; every draw
is labelled with ``hypothesis.note``. Inputs are drawn in float64 from a seeded generator (no
degenerate fills) and rounded once to the tested dtype; the oracle sees the rounded values.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
from hypothesis import note, settings
from hypothesis import strategies as st

import attnref
from attnref import oracle, tolerance
from attnref.testing import assert_within_bound


def scaled(fraction: float) -> settings:
    """A share of the active profile's ``max_examples`` (``dev`` 8, ``ci`` 8, ``thorough``
    300), for properties whose examples are expensive; ``thorough`` still scales them up."""
    return settings(max_examples=max(2, round(settings.default.max_examples * fraction)))


@dataclasses.dataclass(frozen=True)
class Bucket:
    batch: tuple[int, ...]
    t_q: int
    t_k: int
    heads: int
    d_model: int
    d_k: int
    d_v: int


BUCKETS = (
    Bucket((), 4, 4, 1, 4, 2, 3),  # no batch dims, one head
    Bucket((2,), 5, 7, 2, 8, 4, 3),  # cross-attention, T_q != T_k, d_k != d_v
    Bucket((2, 2), 4, 4, 3, 6, 2, 5),  # two batch dims, d_v > d_k
)
MASK_KINDS = ("none", "causal", "padding", "random", "bias", "combined", "fully_masked_row")


@dataclasses.dataclass
class Problem:
    bucket: Bucket
    params: attnref.AttentionParams
    x_q: np.ndarray
    x_kv: np.ndarray
    mask: np.ndarray  # always full [..., T_q, T_k] so one compile serves every mask kind
    bias: np.ndarray
    dtype: np.dtype[Any]
    kind: str

    def inputs(self) -> dict[str, Any]:
        return dict(mask=self.mask, bias=self.bias)


def make_problem(
    bucket: Bucket,
    kind: str,
    seed: int,
    dtype: Any,
    *,
    with_bias: bool = True,
    input_scale: float = 1.0,
) -> Problem:
    rng = np.random.default_rng(seed)
    b = bucket
    params = attnref.init_params(
        seed,
        d_model=b.d_model,
        num_heads=b.heads,
        d_k=b.d_k,
        d_v=b.d_v,
        bias=with_bias,
        dtype=np.float64,
    )
    x_q = rng.standard_normal((*b.batch, b.t_q, b.d_model)) * input_scale
    x_kv = (
        x_q
        if b.t_q == b.t_k and rng.random() < 0.5
        else rng.standard_normal((*b.batch, b.t_k, b.d_model)) * input_scale
    )
    full = (*b.batch, b.t_q, b.t_k)
    mask = np.ones(full, bool)
    bias = np.zeros(full)
    if kind in ("causal", "combined"):
        mask &= np.tril(np.ones((b.t_q, b.t_k), bool))
    if kind in ("padding", "combined"):
        lengths = rng.integers(1, b.t_k + 1, size=b.batch)
        mask &= (np.arange(b.t_k) < lengths[..., None])[..., None, :]
    if kind == "random":
        mask &= rng.random(full) < 0.7
    if kind in ("bias", "combined"):
        bias = rng.standard_normal(full)
    if kind == "fully_masked_row":
        mask &= rng.random(full) < 0.7
        mask[..., rng.integers(b.t_q), :] = False
    dt = np.dtype(dtype)
    return Problem(
        b, params.astype(dt), x_q.astype(dt), x_kv.astype(dt), mask, bias.astype(dt), dt, kind
    )


@st.composite
def problems(
    draw: st.DrawFn,
    dtypes: tuple[str, ...] = ("float32", "float64"),
    kinds: tuple[str, ...] = MASK_KINDS,
    with_bias: bool | None = True,
    buckets: tuple[Bucket, ...] = BUCKETS,
) -> Problem:
    bucket = draw(st.sampled_from(buckets), label="bucket")
    kind = draw(st.sampled_from(kinds), label="mask kind")
    dtype = draw(st.sampled_from(dtypes), label="dtype")
    bias_on = draw(st.booleans(), label="parameter biases") if with_bias is None else with_bias
    seed = draw(st.integers(0, 2**31 - 1), label="data seed")
    note(f"bucket={bucket} kind={kind} dtype={dtype} biases={bias_on} seed={seed}")
    return make_problem(bucket, kind, seed, dtype, with_bias=bias_on)


def expected(problem: Problem) -> tuple[np.ndarray, np.ndarray]:
    """Oracle output and the derived bound for the problem's inputs."""
    p = problem
    ref = oracle.attention(p.params, p.x_q, p.x_kv, **p.inputs())
    bound = tolerance.attention_error_bound(p.params, p.x_q, p.x_kv, dtype=p.dtype, **p.inputs())
    return ref, bound


def check_formulation(apply: Callable[..., Any], problem: Problem, label: str) -> np.ndarray:
    """Run ``apply`` on the problem; assert dtype, shape and agreement with the oracle."""
    p = problem
    y = np.asarray(apply(p.params, p.x_q, p.x_kv, **p.inputs()))
    assert y.dtype == p.dtype, f"{label}: computed in {y.dtype}, asked for {p.dtype}"
    ref, bound = expected(p)
    assert_within_bound(y, ref, bound, label=label)
    return y
