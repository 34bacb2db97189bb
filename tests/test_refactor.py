"""Spectra from the factors and fuse-and-refactor (:mod:`attnref.interp`).

Properties (Hypothesis, bucketed shapes; jit and no-jit via chex variants):

* **exact reproduction**: refactoring at full rank (``r = min(d_k, d_model)``, ``d_v`` likewise)
  keeps the block's function, biases included (``b_K`` dropped, ``b_V`` folded or homogeneous,
  ``b_Q`` in homogeneous coordinates), for every mask kind the bias rule covers;
* **Eckart-Young**: the refactored merged matrices have Frobenius error equal to the
  root-sum-square of the dropped singular values, and no drawn rank-``r`` factor pair does better;
* **gauge freedom**: ``"sqrt"``, ``"left"`` and ``"right"`` give the same merged products and
  the same outputs at any rank;
* spectra from the factors equal the SVD of the formed matrices; parameter counts; errors.

**Tolerances** (derived, :mod:`attnref.tolerance`). The refactor is computed in float64 and its
factors are stored in the tested dtype, then a formulation runs on them. The output differs from
the original function by (a) the formulation's arithmetic on the stored factors, bounded by
``B = attention_error_bound(refactored params, inputs, dtype)``, and (b) the rounding of the
stored factors: one relative rounding of each of ``W~_Q', W_K'`` on the logit chain and of
``W~_V', W_O'`` on the output chain, i.e. two more factors ``(1 + delta)`` in products the bound
already counts with ``N_s, N_y >= 2`` roundings; at first order (the order of the whole bound)
this is at most ``B`` again. The float64 refactor's own backward error (Householder QR and SVD,
``O(u_64)`` normwise) is below both. Hence ``|y - oracle(original)| <= 2 B``.
"""

from __future__ import annotations

import dataclasses
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, note
from hypothesis import strategies as st

import attnref
from attnref import oracle, tolerance
from attnref import strategies as ast
from attnref.interp import (
    effective_rank,
    factored_svd,
    message_svd,
    param_count,
    pattern_svd,
    refactor,
    truncation_error,
)
from attnref.testing import assert_within_bound

from .helpers import scaled

# (bucket, num_kv_heads): MHA with d_k != d_v; batch dims and T_q != T_k; grouped-query; and
# d_k, d_v > d_model (the merged matrices' rank is then d_model, not d_k).
CASES = (
    (ast.Config(batch=(), t=4, s=4, n=2, k=2, h=4, h_v=3, d_model=8), 2),
    (ast.Config(batch=(2,), t=5, s=7, n=3, k=3, h=2, h_v=5, d_model=6), 3),
    (ast.Config(batch=(2,), t=4, s=4, n=4, k=4, h=3, h_v=3, d_model=8), 2),
    (ast.Config(batch=(), t=3, s=5, n=2, k=2, h=6, h_v=5, d_model=4), 2),
)
KINDS = ("none", "causal", "padding", "random", "bias", "combined")
SOFTMAX_IDS = attnref.ids("softmax")
U64 = tolerance.unit_roundoff(np.float64)


@dataclasses.dataclass
class Case:
    params: attnref.AttentionParams  # float64
    x_q: np.ndarray  # rounded to dtype
    x_kv: np.ndarray
    mask: np.ndarray
    bias: np.ndarray
    dtype: np.dtype
    bucket: ast.Config

    def inputs(self):
        return dict(mask=self.mask, bias=self.bias.astype(self.dtype))


def make_case(bucket, kv, kind, seed, dtype, with_bias=True, fully_masked=False):
    p = ast.make_attention_problem(
        bucket, "fully_masked_row" if fully_masked else kind, seed, np.float64
    )
    params = attnref.init_params(
        seed,
        d_model=bucket.d_model,
        num_heads=bucket.n,
        d_k=bucket.d_k,
        d_v=bucket.d_v,
        bias=with_bias,
        dtype=np.float64,
        num_kv_heads=kv,
    )
    dt = np.dtype(dtype)
    x_q = p.x_q.astype(dt)
    x_kv = p.x_kv.astype(dt)
    return Case(params, x_q, x_kv, p.mask, p.bias, dt, bucket)


@st.composite
def cases(draw, dtypes=("float32", "float64"), kinds=KINDS, fully_masked=False):
    bucket, kv = draw(st.sampled_from(CASES), label="bucket, num_kv_heads")
    kind = draw(st.sampled_from(kinds), label="mask kind")
    dtype = draw(st.sampled_from(dtypes), label="dtype")
    with_bias = draw(st.booleans(), label="parameter biases")
    seed = draw(st.integers(0, 2**31 - 1), label="seed")
    note(f"bucket={bucket} K={kv} kind={kind} dtype={dtype} biases={with_bias} seed={seed}")
    return make_case(bucket, kv, kind, seed, dtype, with_bias, fully_masked)


def full_ranks(params):
    return min(params.d_k, params.d_model), min(params.d_v, params.d_model)


def stored(params, dtype):
    return params.astype(dtype)


def _f64(*arrays):
    """The (already rounded) inputs in float64 for the float64 oracle: exact, and the oracle
    refuses mixed dtypes as the JAX twin does."""
    return tuple(np.asarray(a, np.float64) for a in arrays)


def check_close_to_original(apply, case, new_params, label):
    """``apply`` on the refactored factors (stored in the case's dtype) against the float64
    oracle of the *original* parameters on the same inputs: within ``2 B`` (module docstring)."""
    c = case
    p_dt = stored(new_params, c.dtype)
    y = np.asarray(apply(p_dt, c.x_q, c.x_kv, **c.inputs()))
    assert y.dtype == c.dtype, f"{label}: computed in {y.dtype}"
    ref = oracle.attention(c.params, *_f64(c.x_q, c.x_kv), **c.inputs())
    bound = tolerance.attention_error_bound(p_dt, c.x_q, c.x_kv, dtype=c.dtype, **c.inputs())
    assert_within_bound(y, ref, 2 * bound, label=label)
    return y


# ----------------------------------------------------------------------------- exact reproduction


def _full_rank_check(variant, case, fid, gauge, value_bias):
    r_qk, r_vo = full_ranks(case.params)
    out = refactor(case.params, r_qk, r_vo, gauge=gauge, value_bias=value_bias, dtype=np.float64)
    new = out.params
    assert new.b_k is None
    assert (new.b_q is None) == (case.params.b_q is None)
    assert new.d_k == r_qk and new.d_v == r_vo and new.num_kv_heads == new.num_heads
    check_close_to_original(
        variant(attnref.get(fid).apply), case, new, f"{fid} {gauge} {value_bias}"
    )


GAUGES = st.sampled_from(("sqrt", "left", "right"))
VALUE_BIAS = st.sampled_from(("fold", "homogeneous"))


class ExactReproductionTest(chex.TestCase):
    @chex.variants(with_jit=True)
    @scaled(1.0)
    @given(case=cases(), fid=st.sampled_from(SOFTMAX_IDS), gauge=GAUGES, value_bias=VALUE_BIAS)
    def test_full_rank_refactor_preserves_the_function(self, case, fid, gauge, value_bias):
        """At ``r = rank`` the block's function is kept, biases included (``b_K`` dropped,
        ``b_Q`` homogeneous, ``b_V`` folded or homogeneous); no fully masked rows here."""
        _full_rank_check(self.variant, case, fid, gauge, value_bias)

    @chex.variants(without_jit=True)
    @scaled(0.3)
    @given(
        case=cases(dtypes=("float32",)),
        fid=st.sampled_from(SOFTMAX_IDS),
        gauge=GAUGES,
        value_bias=VALUE_BIAS,
    )
    def test_full_rank_refactor_preserves_the_function_eagerly(self, case, fid, gauge, value_bias):
        """The same property without jit (fewer examples: eager runs compile per primitive)."""
        _full_rank_check(self.variant, case, fid, gauge, value_bias)

    @chex.variants(with_jit=True)
    @scaled(0.5)
    @given(case=cases(fully_masked=True), fid=st.sampled_from(SOFTMAX_IDS))
    def test_homogeneous_value_bias_is_exact_on_fully_masked_rows(self, case, fid):
        r_qk, r_vo = full_ranks(case.params)
        new = refactor(case.params, r_qk, r_vo, value_bias="homogeneous", dtype=np.float64)
        check_close_to_original(self.variant(attnref.get(fid).apply), case, new.params, fid)


def test_fold_changes_fully_masked_rows_by_the_folded_constant():
    """``value_bias="fold"`` is exact wherever a row has an allowed key; a fully masked row
    outputs ``b_O' = b_O + sum_i b_V[i // G] W_O[i]`` instead of ``b_O`` (documented)."""
    bucket, kv = CASES[2]
    c = make_case(bucket, kv, "none", 7, np.float64)
    mask = np.ones_like(c.mask)
    mask[..., 1, :] = False
    new = refactor(c.params, *full_ranks(c.params), dtype=np.float64).params
    y_old = oracle.attention(c.params, c.x_q, c.x_kv, mask=mask)
    y_new = oracle.attention(new, c.x_q, c.x_kv, mask=mask)
    mha = attnref.interop.repeat_kv_heads(c.params)
    shift = np.einsum("hv,hvd->d", mha.b_v, mha.w_o)
    row = y_old[..., 1, :]
    np.testing.assert_array_equal(row, np.broadcast_to(c.params.b_o, row.shape))
    expected = np.broadcast_to(c.params.b_o + shift, row.shape)
    bound = tolerance.attention_error_bound(new, c.x_q, c.x_kv, mask=mask, dtype=np.float64)
    assert_within_bound(y_new[..., 1, :], expected, bound[..., 1, :], label="fully masked row")
    keep = np.ones(y_old.shape[-2], bool)
    keep[1] = False
    assert_within_bound(y_new[..., keep, :], y_old[..., keep, :], 2 * bound[..., keep, :])


# ----------------------------------------------------------------------------- Eckart-Young


def merged_qk(params):
    """``W~_P = [W_Q; b_Q] W_K^T`` per query head, float64 NumPy ``[H, d_model + 1, d_model]``
    (zero last row without ``b_Q``)."""
    m = attnref.interop.repeat_kv_heads(params.astype(np.float64))
    b_q = np.zeros((m.num_heads, m.d_k)) if m.b_q is None else m.b_q
    wq = np.concatenate([m.w_q, b_q[:, None, :]], axis=1)
    return np.einsum("hmd,hnd->hmn", wq, m.w_k), wq, np.asarray(m.w_k)


def merged_vo(params):
    """``W~_M = [W_V; b_V] W_O`` per query head ``[H, d_model + 1, d_model]``."""
    m = attnref.interop.repeat_kv_heads(params.astype(np.float64))
    b_v = np.zeros((m.num_heads, m.d_v)) if m.b_v is None else m.b_v
    wv = np.concatenate([m.w_v, b_v[:, None, :]], axis=1)
    return np.einsum("hmd,hdn->hmn", wv, m.w_o), wv, np.swapaxes(m.w_o, -1, -2)


def frob_tol(a, b, inner):
    """Rounding allowance for ``||A B^T - W||_F`` computed in float64: each entry of ``A B^T``
    is within ``gamma_inner |A||B|^T`` (Higham eq. 3.13), the SVD that produced ``A, B`` is
    backward stable (normwise ``O(u)``, covered by the ``+ 2 d`` roundings of its QR, core and
    reconstruction products), and the norm itself adds ``gamma_2``."""
    mag = np.linalg.norm(np.einsum("hmd,hnd->hmn", np.abs(a), np.abs(b)), axis=(-2, -1))
    return tolerance.gamma(inner + 2 * a.shape[-1] + 4, U64) * 4 * mag


@scaled(1.0)
@given(
    case=cases(dtypes=("float64",), kinds=("none",)),
    frac=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**31 - 1),
)
def test_eckart_young_optimality(case, frac, seed):
    p = case.params
    r_full_qk, r_full_vo = full_ranks(p)
    r_qk = 1 + round(frac * (r_full_qk - 1))
    r_vo = 1 + round(frac * (r_full_vo - 1))
    note(f"ranks qk={r_qk} vo={r_vo}")
    out = refactor(p, r_qk, r_vo, value_bias="homogeneous", rescale=False, dtype=np.float64)
    rng = np.random.default_rng(seed)
    for side, w_of, r, s_all in (
        ("qk", merged_qk, r_qk, out.s_qk),
        ("vo", merged_vo, r_vo, out.s_vo),
    ):
        target, a0, b0 = w_of(p)
        approx, a_r, b_r = w_of(out.params)
        err = np.linalg.norm(approx - target, axis=(-2, -1))
        rss = np.sqrt(np.sum(np.asarray(s_all)[..., r:] ** 2, axis=-1))
        tol = frob_tol(a_r, b_r, a_r.shape[-1]) + frob_tol(a0, b0, a0.shape[-1])
        assert np.all(np.abs(err - rss) <= tol), (side, err, rss, tol)
        np.testing.assert_allclose(
            np.asarray(truncation_error(s_all, r)), rss, rtol=4 * U64 * s_all.shape[-1]
        )
        # Candidates: random pairs, the original factors' first r columns, the inner space
        # projected on r random directions, and the optimum plus a perturbation.
        h, d = a0.shape[0], a0.shape[-1]
        cands = [
            (rng.standard_normal(a_r.shape), rng.standard_normal(b_r.shape)),
            (a0[..., :r], b0[..., :r]),
        ]
        proj = rng.standard_normal((h, d, r))
        cands.append((a0 @ proj, b0 @ np.swapaxes(np.linalg.pinv(proj), -1, -2)))
        for scale in (1e-3, 1e-1):
            cands.append(
                (
                    a_r + scale * rng.standard_normal(a_r.shape) * np.abs(a_r).mean(),
                    b_r + scale * rng.standard_normal(b_r.shape) * np.abs(b_r).mean(),
                )
            )
        for i, (a, b) in enumerate(cands):
            cand_err = np.linalg.norm(np.einsum("hmd,hnd->hmn", a, b) - target, axis=(-2, -1))
            slack = frob_tol(np.abs(a), np.abs(b), a.shape[-1]) + tol
            assert np.all(cand_err >= err - slack), (side, i, cand_err, err)


def test_rescale_multiplies_the_query_side():
    """``rescale=True`` multiplies ``[W_Q'; b_Q']`` by ``sqrt(r / d_k)``, so the default scale
    ``1/sqrt(r)`` of the result gives the logits of the rank-r approximation at scale
    ``1/sqrt(d_k)``."""
    c = make_case(*CASES[0], "none", 3, np.float64)
    r = 2
    a = refactor(c.params, r, None, rescale=True, dtype=np.float64).params
    b = refactor(c.params, r, None, rescale=False, dtype=np.float64).params
    # a.w_q is b.w_q times a rounded sqrt(r / d_k): the division, the sqrt and the product round
    # once each on each side, at most 3 u relative between them (and the test's own product).
    np.testing.assert_allclose(
        a.w_q, b.w_q * math.sqrt(r / c.params.d_k), rtol=tolerance.gamma(6, U64)
    )
    d_k = c.params.d_k
    y_a = oracle.attention(a, c.x_q)
    y_b = oracle.attention(b, c.x_q, scale=1 / math.sqrt(d_k))
    bound = tolerance.attention_error_bound(a, c.x_q, dtype=np.float64)
    assert_within_bound(y_a, y_b, 2 * bound)


# ----------------------------------------------------------------------------- gauge freedom


def _gauge_check(variant, case, frac, fid):
    """At any rank the split of ``S_r`` between the factors changes the factors, not their
    products, so outputs agree: each is within ``2 B`` of the exact rank-r function."""
    p = case.params
    r_qk = 1 + round(frac * (full_ranks(p)[0] - 1))
    r_vo = 1 + round(frac * (full_ranks(p)[1] - 1))
    outs = {}
    apply = variant(attnref.get(fid).apply)
    exact = None
    for gauge in ("sqrt", "left", "right"):
        new = refactor(p, r_qk, r_vo, gauge=gauge, dtype=np.float64).params
        if exact is None:
            exact = oracle.attention(new, *_f64(case.x_q, case.x_kv), **case.inputs())
        p_dt = stored(new, case.dtype)
        y = np.asarray(apply(p_dt, case.x_q, case.x_kv, **case.inputs()))
        bound = tolerance.attention_error_bound(
            p_dt, case.x_q, case.x_kv, dtype=case.dtype, **case.inputs()
        )
        assert_within_bound(y, exact, 2 * bound, label=f"{fid} gauge={gauge}")
        outs[gauge] = (new, y)
    for merged in (merged_qk, merged_vo):
        w_sqrt, a0, b0 = merged(outs["sqrt"][0])
        for gauge in ("left", "right"):
            w, a, b = merged(outs[gauge][0])
            tol = frob_tol(a, b, a.shape[-1]) + frob_tol(a0, b0, a0.shape[-1])
            assert np.all(np.linalg.norm(w - w_sqrt, axis=(-2, -1)) <= tol), (merged, gauge)


class GaugeTest(chex.TestCase):
    @chex.variants(with_jit=True)
    @scaled(0.6)
    @given(case=cases(), frac=st.floats(0.0, 1.0), fid=st.sampled_from(SOFTMAX_IDS))
    def test_gauge_leaves_outputs_unchanged(self, case, frac, fid):
        _gauge_check(self.variant, case, frac, fid)

    @chex.variants(without_jit=True)
    @scaled(0.2)
    @given(
        case=cases(dtypes=("float64",)),
        frac=st.floats(0.0, 1.0),
        fid=st.sampled_from(SOFTMAX_IDS),
    )
    def test_gauge_leaves_outputs_unchanged_eagerly(self, case, frac, fid):
        _gauge_check(self.variant, case, frac, fid)

    def test_gauges_differ_in_the_factors(self):
        c = make_case(*CASES[0], "none", 5, np.float64)
        a = refactor(c.params, 2, 2, gauge="left", dtype=np.float64).params
        b = refactor(c.params, 2, 2, gauge="right", dtype=np.float64).params
        assert not np.allclose(a.w_k, b.w_k)
        # "left" puts S on the left factor: the right factors have orthonormal columns.
        # Householder QR and the SVD return factors orthonormal to O(m n u) (Higham 2002,
        # Thm 19.4; m = d_model + 1 rows, n = d_k columns), and the check's product adds gamma_m.
        m, n = c.params.d_model + 1, c.params.d_k
        np.testing.assert_allclose(
            np.swapaxes(a.w_k, -1, -2) @ a.w_k,
            np.broadcast_to(np.eye(2), (2, 2, 2)),
            atol=tolerance.gamma(4 * m * n + m, U64),
        )


# ----------------------------------------------------------------------------- spectra


@scaled(0.6)
@given(case=cases(dtypes=("float64",), kinds=("none",)), bias=st.booleans())
def test_spectra_from_factors_equal_formed_svd(case, bias):
    p = case.params
    for svd, (w, a, b) in (
        (pattern_svd(p, bias=bias), merged_qk(p)),
        (message_svd(p, bias=bias), merged_vo(p)),
    ):
        if svd.left.shape[1] == p.d_model:  # not augmented: no bias asked for, or none present
            w = w[:, :-1]
        ref = np.linalg.svd(w, compute_uv=False)[..., : svd.s.shape[-1]]
        tol = frob_tol(a, b, a.shape[-1])[:, None]
        assert np.all(np.abs(np.asarray(svd.s) - ref) <= tol)
        assert np.all(np.diff(np.asarray(svd.s), axis=-1) <= 0)
        recon = np.einsum("hmk,hk,hnk->hmn", svd.left, svd.s, svd.right)
        assert np.all(np.linalg.norm(recon - w, axis=(-2, -1)) <= tol[:, 0])


def test_spectra_never_form_the_big_matrix_and_float64_option():
    """Shapes of the factors' SVD are thin, and ``dtype=np.float64`` computes in float64 from
    float32 parameters."""
    p = attnref.init_params(0, d_model=64, num_heads=2, d_k=4, bias=True)
    s32 = pattern_svd(p, bias=True)
    s64 = pattern_svd(p, bias=True, dtype=np.float64)
    assert s32.left.shape == (2, 65, 4) and s32.right.shape == (2, 64, 4)
    assert s32.s.dtype == np.float32 and s64.s.dtype == np.float64
    u32 = tolerance.unit_roundoff(np.float32)
    gap = np.abs(np.asarray(s32.s, np.float64) - s64.s)
    assert np.all(gap <= tolerance.gamma(64 + 8 + 4, u32) * 4 * s64.s[..., :1])


def test_factored_svd_under_jit_matches_numpy():
    p = attnref.init_params(1, d_model=8, num_heads=3, d_k=3, dtype=np.float64)
    ref = pattern_svd(p)
    with jax.enable_x64(True):
        got = jax.jit(lambda a, b: factored_svd(a, b))(jnp.asarray(p.w_q), jnp.asarray(p.w_k))
        assert isinstance(got.s, jax.Array)
        # Two backward-stable float64 SVDs of the same factored product: by Weyl's inequality
        # each singular value moves by at most the backward error, O(m n u) ||W_P||_2 for the
        # QR-then-SVD route (m = d_model rows, n = d_k), on each side.
        m, n = p.d_model, p.d_k
        atol = 2 * tolerance.gamma(4 * m * n + m, U64) * float(ref.s.max())
        np.testing.assert_allclose(np.asarray(got.s), ref.s, rtol=0, atol=atol)


def test_effective_rank():
    s = np.array([[1.0, 1.0, 1.0, 0.0], [3.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    # exp(entropy): a normalisation, 4 logs and products, a sum and an exp, each within C_EXP
    # or one unit of u: gamma_{4 + 3 C_EXP} relative.
    rtol = tolerance.gamma(4 + 3 * tolerance.C_EXP, U64)
    np.testing.assert_allclose(np.asarray(effective_rank(s)), [3.0, 1.0, 0.0], rtol=rtol)
    e = np.asarray(effective_rank(np.array([2.0, 1.0, 0.1]), method="energy", threshold=0.9))
    assert e == 2  # 4 / 5.01 < 0.9 <= 5 / 5.01
    assert (
        np.asarray(effective_rank(np.array([2.0, 1.0, 0.1]), method="energy", threshold=1.0)) == 3
    )
    with pytest.raises(ValueError, match="threshold"):
        effective_rank(s, method="energy", threshold=0.0)


# ----------------------------------------------------------------------------- counts, errors


@given(
    bucket_kv=st.sampled_from(CASES),
    bias=st.booleans(),
    frac=st.floats(0.0, 1.0),
    value_bias=st.sampled_from(("fold", "homogeneous")),
    sides=st.sampled_from(("qk", "vo", "both")),
)
def test_parameter_counts(bucket_kv, bias, frac, value_bias, sides):
    bucket, kv = bucket_kv
    p = attnref.init_params(
        0,
        d_model=bucket.d_model,
        num_heads=bucket.n,
        d_k=bucket.d_k,
        d_v=bucket.d_v,
        bias=bias,
        num_kv_heads=kv,
    )
    h, d, d_k, d_v = p.num_heads, p.d_model, p.d_k, p.d_v
    r_qk = 1 + round(frac * (min(d_k, d) - 1)) if sides in ("qk", "both") else None
    r_vo = 1 + round(frac * (min(d_v, d) - 1)) if sides in ("vo", "both") else None
    out = refactor(p, r_qk, r_vo, value_bias=value_bias)
    assert out.count_before == param_count(p)
    # After refactoring anything, key/value heads are one per query head.
    k_q = r_qk if r_qk is not None else d_k
    qk = h * d * k_q * 2 + (h * k_q if bias else 0) + (h * d_k if bias and r_qk is None else 0)
    w_v_width = r_vo if r_vo is not None else d_v
    keeps_bv = bias and (r_vo is None or value_bias == "homogeneous")
    vo = 2 * h * d * w_v_width + (h * w_v_width if keeps_bv else 0) + (d if bias else 0)
    assert out.count_after == qk + vo, (out.count_after, qk + vo)
    assert param_count(out.params) == out.count_after
    if r_qk is not None:
        # Both are sqrt(sum of dropped s^2 / sum of s^2) from the same float32 singular values,
        # summed in possibly different orders: gamma_{2 d_k + 4}(u32) relative.
        u32 = tolerance.unit_roundoff(np.float32)
        np.testing.assert_allclose(
            out.error_qk,
            np.asarray(truncation_error(out.s_qk, r_qk, relative=True)),
            rtol=tolerance.gamma(2 * out.s_qk.shape[-1] + 4, u32),
        )


@pytest.mark.usefixtures("unchecked_annotations")  # checks attnref's own errors
def test_bad_arguments():
    p = attnref.init_params(0, d_model=8, num_heads=2, d_k=4)
    with pytest.raises(ValueError, match="rank_qk=5"):
        refactor(p, 5, None)
    with pytest.raises(ValueError, match="rank_vo=0"):
        refactor(p, None, 0)
    with pytest.raises(ValueError, match="gauge"):
        refactor(p, 2, 2, gauge="middle")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="value_bias"):
        refactor(p, 2, 2, value_bias="drop")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="rank_qk"):
        refactor(p, 2.0, None)  # type: ignore[arg-type]
    same = refactor(p, None, None)
    assert same.params is p and same.count_after == same.count_before
