"""Kernel-level problems ``(q, k, v, options)`` drawn from a few shape buckets and option sets.

Static options (causal, alignment, window, softcap, policy) come from a short list of profiles, so
jit caches are reused; the array options (mask, bias, lengths, segment ids) vary freely. Every
draw is labelled with ``hypothesis.note``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from hypothesis import note
from hypothesis import strategies as st

from attnref import oracle, tolerance


@dataclasses.dataclass(frozen=True)
class KBucket:
    b: int
    t: int
    s: int
    n: int
    k: int
    h: int
    h_v: int


KBUCKETS = (
    KBucket(2, 5, 7, 4, 2, 3, 2),  # GQA, T != S, H_v != H
    KBucket(1, 6, 6, 2, 2, 4, 4),  # MHA, self-attention shape
    KBucket(2, 4, 4, 3, 1, 2, 3),  # MQA
)

# Static option profiles: each one compiles once per bucket and dtype.
PROFILES: tuple[dict[str, Any], ...] = (
    dict(),
    dict(is_causal=True, masked_rows="uniform"),
    dict(is_causal=True, causal_alignment="bottom_right", local_window_size=(2, 0)),
    dict(local_window_size=(1, 1), softcap=2.0, masked_rows="nan"),
    dict(is_causal=True, causal_alignment="bottom_right", softcap=3.0, masked_rows="uniform"),
    dict(local_window_size=(None, 1), causal_alignment="bottom_right"),
)
ARRAY_OPTIONS = ("mask", "bias", "alibi", "neg_inf_bias", "seq_lengths", "segments")


@dataclasses.dataclass
class KProblem:
    bucket: KBucket
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    kwargs: dict[str, Any]  # bias, mask and every keyword option
    dtype: np.dtype[Any]

    @property
    def static(self) -> dict[str, Any]:
        keys = ("is_causal", "causal_alignment", "local_window_size", "softcap", "masked_rows")
        return {k: v for k, v in self.kwargs.items() if k in keys}

    def allowed(self) -> np.ndarray:
        kw = {k: v for k, v in self.kwargs.items() if k not in ("softcap", "masked_rows", "scale")}
        b = self.bucket
        return oracle.kernel_allowed((b.b, b.n, b.t, b.s), **kw)

    def expected(self, key_blocks: int | None = None) -> tuple[Any, Any, Any, Any]:
        """Oracle output and lse, and their derived bounds in the problem's dtype."""
        ref, ref_lse = oracle.dot_product_attention(
            self.q, self.k, self.v, return_lse=True, **self.kwargs
        )
        bound, lse_bound = tolerance.kernel_error_bound(
            self.q,
            self.k,
            self.v,
            self.allowed(),
            self.kwargs.get("bias"),
            softcap=self.kwargs.get("softcap"),
            masked_rows=self.kwargs.get("masked_rows", "zeros"),
            dtype=self.dtype,
            key_blocks=key_blocks,
        )
        return ref, ref_lse, bound, lse_bound


# Every way a rank-4 mask or bias broadcasts to [B, N, T, S]: each axis full (1) or size 1 (0).
BROADCAST_PATTERNS = tuple(tuple((code >> (3 - a)) & 1 for a in range(4)) for code in range(16))


def broadcast_shape(bucket: KBucket, pattern: tuple[int, ...]) -> tuple[int, ...]:
    """The ``[B, N, T, S]`` shape with the axes marked 0 in ``pattern`` reduced to size 1."""
    full = (bucket.b, bucket.n, bucket.t, bucket.s)
    return tuple(d if keep else 1 for d, keep in zip(full, pattern, strict=True))


def make_kproblem(
    bucket: KBucket,
    profile: dict[str, Any],
    extras: tuple[str, ...],
    seed: int,
    dtype: Any,
    mask_pattern: tuple[int, ...] = (1, 1, 1, 1),
    bias_pattern: tuple[int, ...] = (0, 1, 1, 1),
) -> KProblem:
    """A problem with the given static ``profile`` and array ``extras``; the mask and bias
    have the broadcast shapes ``mask_pattern`` / ``bias_pattern`` (see ``broadcast_shape``)."""
    rng = np.random.default_rng(seed)
    b = bucket
    dt = np.dtype(dtype)
    q = rng.standard_normal((b.b, b.t, b.n, b.h)).astype(dt)
    k = rng.standard_normal((b.b, b.s, b.k, b.h)).astype(dt)
    v = rng.standard_normal((b.b, b.s, b.k, b.h_v)).astype(dt)
    kw: dict[str, Any] = dict(profile)
    if "mask" in extras:
        kw["mask"] = rng.random(broadcast_shape(b, mask_pattern)) < 0.7
    if "bias" in extras:
        kw["bias"] = rng.standard_normal(broadcast_shape(b, bias_pattern)).astype(dt)
    if "alibi" in extras:
        align = profile.get("causal_alignment", "top_left")
        kw["bias"] = oracle.alibi_bias(oracle.alibi_slopes(b.n), b.t, b.s, causal_alignment=align)
        kw["bias"] = kw["bias"].astype(dt)
    if "neg_inf_bias" in extras:
        bias = rng.standard_normal((b.b, 1, b.t, b.s))
        bias[rng.random(bias.shape) < 0.3] = -np.inf
        kw["bias"] = bias.astype(dt)
    if "seq_lengths" in extras:
        kw["query_seq_lengths"] = rng.integers(0, b.t + 1, size=b.b).astype(np.int32)
        kw["key_value_seq_lengths"] = rng.integers(0, b.s + 1, size=b.b).astype(np.int32)
    if "segments" in extras:
        q_seg = np.sort(rng.integers(0, 3, size=(b.b, b.t)), axis=1).astype(np.int32)
        kv_seg = np.sort(rng.integers(0, 3, size=(b.b, b.s)), axis=1).astype(np.int32)
        kw["segment_ids"] = (q_seg, kv_seg)
    return KProblem(b, q, k, v, kw, dt)


@st.composite
def kproblems(
    draw: st.DrawFn,
    dtypes: tuple[str, ...] = ("float32", "float64"),
    buckets: tuple[KBucket, ...] = KBUCKETS,
    profiles: tuple[dict[str, Any], ...] = PROFILES,
) -> KProblem:
    bucket = draw(st.sampled_from(buckets), label="bucket")
    profile = draw(st.sampled_from(profiles), label="static profile")
    extras = tuple(
        sorted(draw(st.sets(st.sampled_from(ARRAY_OPTIONS), max_size=3), label="array options"))
    )
    if "bias" in extras and ("alibi" in extras or "neg_inf_bias" in extras):
        extras = tuple(e for e in extras if e != "bias")
    if "alibi" in extras and "neg_inf_bias" in extras:
        extras = tuple(e for e in extras if e != "alibi")
    dtype = draw(st.sampled_from(dtypes), label="dtype")
    seed = draw(st.integers(0, 2**31 - 1), label="data seed")
    mask_pattern = draw(st.sampled_from(BROADCAST_PATTERNS), label="mask broadcast pattern")
    bias_pattern = draw(st.sampled_from(BROADCAST_PATTERNS), label="bias broadcast pattern")
    note(f"bucket={bucket} profile={profile} extras={extras} dtype={dtype} seed={seed}")
    return make_kproblem(bucket, profile, extras, seed, dtype, mask_pattern, bias_pattern)


def assert_kernel_close(out: Any, lse: Any, problem: KProblem, label: str, **kw: Any) -> None:
    """``out`` and ``lse`` within their derived bounds of the oracle; NaN and ``-inf`` exactly
    where the oracle has them."""
    ref, ref_lse, bound, lse_bound = problem.expected(**kw)
    out = np.asarray(out, np.float64)
    lse = np.asarray(lse, np.float64)
    nan_ref = np.isnan(ref)
    np.testing.assert_array_equal(np.isnan(out), nan_ref, err_msg=f"{label}: NaN pattern")
    err = np.abs(np.where(nan_ref, 0.0, out - np.where(nan_ref, 0.0, ref)))
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert np.all(err <= bound), (
        f"{label}: |out - oracle| = {err[worst]:.3e} > bound {bound[worst]:.3e} at {worst}"
    )
    inf_ref = np.isneginf(ref_lse)
    np.testing.assert_array_equal(np.isneginf(lse), inf_ref, err_msg=f"{label}: -inf lse")
    lerr = np.abs(np.where(inf_ref, 0.0, lse - np.where(inf_ref, 0.0, ref_lse)))
    assert np.all(lerr <= lse_bound), f"{label}: lse error {lerr.max():.3e} exceeds its bound"
