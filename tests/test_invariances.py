"""Symmetries that every formulation must respect, checked in float64 against derived bounds."""

from __future__ import annotations

import dataclasses

import chex
import jax
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

import attnref
from attnref import oracle, tolerance
from attnref import strategies as ast
from attnref.testing import assert_within_bound

from .helpers import scaled

BUCKETS = ast.WEIGHT_BUCKETS

FORMS = attnref.formulations("softmax")
SEEDS = st.integers(0, 2**31 - 1)


def _bound(p, **kw):
    return tolerance.attention_error_bound(
        p.params, p.x_q, p.x_kv, dtype=np.float64, **p.inputs(), **kw
    )


def _run(f, p, params=None, **kw):
    return np.asarray(
        jax.jit(f.apply)(
            p.params if params is None else params, p.x_q, p.x_kv, **{**p.inputs(), **kw}
        )
    )


def _random_invertible(rng, n):
    """A well-conditioned random matrix: orthogonal times a diagonal in [0.5, 2]."""
    q, _ = np.linalg.qr(rng.standard_normal((n, n)))
    return q * rng.uniform(0.5, 2.0, size=n)


@scaled(0.3)
@given(seed=SEEDS, bucket=st.sampled_from(BUCKETS[1:]), kind=st.sampled_from(("none", "combined")))
def test_head_permutation(seed, bucket, kind):
    p = ast.make_attention_problem(bucket, kind, seed, np.float64)
    perm = np.random.default_rng(seed).permutation(bucket.n)
    permuted = dataclasses.replace(
        p.params,
        **{
            k: None if getattr(p.params, k) is None else getattr(p.params, k)[perm]
            for k in ("w_q", "w_k", "w_v", "w_o", "b_q", "b_k", "b_v")
        },
    )
    for f in FORMS:
        assert_within_bound(_run(f, p, permuted), _run(f, p), 2 * _bound(p), label=f.id)


@scaled(0.3)
@given(seed=SEEDS, bucket=st.sampled_from(BUCKETS), kind=st.sampled_from(("none", "causal")))
def test_gauge_symmetries(seed, bucket, kind):
    """W_Q G, W_K G^-T and W_V G', G'^-1 W_O leave outputs, W_P and W_M unchanged.

    The gauged weights are float64 numbers, so their exact outputs differ from the original's by a
    tiny defect delta (rounding of W G and of the computed inverse). With each formulation within
    its derived bound of its exact value, and the oracle within its own bound of the same exact
    values, ``|F(gauged) - F(orig)| <= 2 (bound_orig + bound_gauged) + |oracle(gauged) -
    oracle(orig)|``.
    """
    p = ast.make_attention_problem(bucket, kind, seed, np.float64)
    rng = np.random.default_rng(seed)
    g = np.stack([_random_invertible(rng, bucket.d_k) for _ in range(bucket.n)])
    gv = np.stack([_random_invertible(rng, bucket.d_v) for _ in range(bucket.n)])
    g_inv, gv_inv = np.linalg.inv(g), np.linalg.inv(gv)
    w = p.params
    gauged = dataclasses.replace(
        w,
        w_q=w.w_q @ g,
        b_q=np.einsum("hk,hkl->hl", w.b_q, g),
        w_k=w.w_k @ g_inv.transpose(0, 2, 1),
        b_k=np.einsum("hk,hlk->hl", w.b_k, g_inv),
        w_v=w.w_v @ gv,
        b_v=np.einsum("hv,hvu->hu", w.b_v, gv),
        w_o=gv_inv @ w.w_o,
    )
    b_orig, b_gauged = (
        _bound(p),
        tolerance.attention_error_bound(gauged, p.x_q, p.x_kv, dtype=np.float64, **p.inputs()),
    )
    delta = np.abs(
        oracle.attention(gauged, p.x_q, p.x_kv, **p.inputs())
        - oracle.attention(p.params, p.x_q, p.x_kv, **p.inputs())
    )
    for f in FORMS:
        assert_within_bound(
            _run(f, p, gauged), _run(f, p), 2 * (b_orig + b_gauged) + delta, label=f.id
        )

    # Merged matrices: W_P' = (W_Q G)(W_K G^-T)^T. Each side is a product chain with error at most
    # gamma_n |A_1|...|A_k| (n = sum of inner dims, Higham eq. 3.13); the computed inverse leaves
    # the defect R = G inv(G) - I, measured here, contributing |W_Q||R||W_K^T|.
    u = 2.0**-53
    for i in range(bucket.n):
        for name, merged, a, gi, ginv, b, d in (
            ("W_P", attnref.interp.w_p, w.w_q[i], g[i], g_inv[i], w.w_k[i].T, bucket.d_k),
            ("W_M", attnref.interp.w_m, w.w_v[i], gv[i], gv_inv[i], w.w_o[i], bucket.d_v),
        ):
            chain = np.abs(a) @ np.abs(gi) @ np.abs(ginv) @ np.abs(b)
            defect = np.abs(gi @ ginv - np.eye(d)) + tolerance.gamma(d, u) * np.abs(gi) @ np.abs(
                ginv
            )
            tol = (
                tolerance.gamma(3 * d, u) * chain
                + tolerance.gamma(d, u) * np.abs(a) @ np.abs(b)
                + np.abs(a) @ defect @ np.abs(b)
            )
            got, want = np.asarray(merged(gauged))[i], np.asarray(merged(w))[i]
            assert_within_bound(got, want, tol, label=f"{name} head {i}")


@scaled(0.3)
@given(seed=SEEDS, bucket=st.sampled_from(BUCKETS), kind=st.sampled_from(("none", "random")))
def test_row_constant_added_to_logits(seed, bucket, kind):
    """Adding c_i to every logit of query row i (through bias) changes nothing."""
    p = ast.make_attention_problem(bucket, kind, seed, np.float64)
    c = np.random.default_rng(seed).standard_normal((*bucket.batch, bucket.t, 1)) * 3
    shifted = p.bias + c
    bound = _bound(p) + tolerance.attention_error_bound(
        p.params, p.x_q, p.x_kv, dtype=np.float64, mask=p.mask, bias=shifted
    )
    for f in FORMS:
        assert_within_bound(_run(f, p, bias=shifted), _run(f, p), bound, label=f.id)


@scaled(0.3)
@given(seed=SEEDS, bucket=st.sampled_from(BUCKETS), kind=st.sampled_from(("none", "combined")))
def test_key_bias_has_no_effect(seed, bucket, kind):
    p = ast.make_attention_problem(bucket, kind, seed, np.float64)
    other = dataclasses.replace(p.params, b_k=p.params.b_k * 0 + 5.0)
    bound = _bound(p) + tolerance.attention_error_bound(
        other, p.x_q, p.x_kv, dtype=np.float64, **p.inputs()
    )
    for f in FORMS:
        assert_within_bound(_run(f, p, other), _run(f, p), bound, label=f.id)


@scaled(0.3)
@given(seed=SEEDS, bucket=st.sampled_from((BUCKETS[0], BUCKETS[2])))
def test_token_permutation_equivariance(seed, bucket):
    """Self-attention without a mask: permuting tokens permutes output rows."""
    p = ast.make_attention_problem(bucket, "none", seed, np.float64)
    perm = np.random.default_rng(seed).permutation(bucket.t)
    x = p.x_q
    xp = x[..., perm, :]
    bound = tolerance.attention_error_bound(p.params, x, x, dtype=np.float64, **p.inputs())
    for f in FORMS:
        y = np.asarray(jax.jit(f.apply)(p.params, x, x, **p.inputs()))
        yp = np.asarray(jax.jit(f.apply)(p.params, xp, xp, **p.inputs()))
        assert_within_bound(yp, y[..., perm, :], 2 * bound[..., perm, :], label=f.id)


class FullyMaskedRowTest(chex.TestCase):
    # Under jit only (suite time): each formulation runs the same code eagerly in the eager
    # agreement property of tests/test_formulations.py, which draws every mask kind.
    @chex.variants(with_jit=True)
    def test_fully_masked_rows_output_b_o(self):
        """One documented meaning: zero weights, so the output is exactly b_O (0 without biases)."""
        for with_bias in (True, False):
            p = ast.make_attention_problem(
                BUCKETS[1], "fully_masked_row", 4, np.float64, param_bias=with_bias
            )
            dead = ~p.mask.any(axis=-1)
            assert dead.any()
            b_o = 0.0 if p.params.b_o is None else p.params.b_o
            for f in FORMS:
                y = np.asarray(self.variant(f.apply)(p.params, p.x_q, p.x_kv, **p.inputs()))
                np.testing.assert_array_equal(
                    y[dead], np.broadcast_to(b_o, y[dead].shape), err_msg=f.id
                )

    @chex.variants(with_jit=True)
    def test_minus_inf_bias_masks_like_false(self):
        p = ast.make_attention_problem(BUCKETS[1], "random", 6, np.float64)
        as_bias = np.where(p.mask, p.bias, -np.inf)
        everything = np.ones_like(p.mask)
        for f in FORMS:
            a = np.asarray(
                self.variant(f.apply)(p.params, p.x_q, p.x_kv, mask=everything, bias=as_bias)
            )
            b = np.asarray(self.variant(f.apply)(p.params, p.x_q, p.x_kv, **p.inputs()))
            assert_within_bound(a, b, 2 * _bound(p), label=f.id)
