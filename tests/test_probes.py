"""Probes of one block: logits, scores, patterns, messages, per-head outputs, residual update.

Jit and no-jit via chex variants, float32 and float64. Outputs are checked against the float64
oracle with the derived bound of :func:`attnref.tolerance.attention_error_bound` (per head: the
bound of the one-head parameters without ``b_O``). Patterns, messages and logits are products of
three or four factors in homogeneous coordinates, so each entry is within ``gamma_N`` times the
same product of absolute values (Higham 2002, eq. 3.13), ``N`` the sum of the inner dimensions
plus the additions of biases and scale: those bounds are computed below.
"""

from __future__ import annotations

import dataclasses

import chex
import jax
import numpy as np
from hypothesis import given

import attnref
from attnref import oracle, tolerance
from attnref import strategies as ast
from attnref.interp import (
    AttentionProbes,
    attention_logits,
    attention_probes,
    residual_update,
)
from attnref.testing import assert_within_bound

from .helpers import problems, scaled

BUCKETS = ast.WEIGHT_BUCKETS
KINDS = ast.WEIGHT_KINDS


def _hom(x):
    return np.concatenate([x, np.ones((*x.shape[:-1], 1))], axis=-1)


def _wt(w, b):
    """``[W; b]`` per head (zero row without ``b``), float64."""
    w = np.asarray(w, np.float64)
    b = np.zeros((w.shape[0], w.shape[2])) if b is None else np.asarray(b, np.float64)
    return np.concatenate([w, b[:, None, :]], axis=1)


def _head(params, i):
    """Query head ``i`` alone (its key/value head), without ``b_O``."""
    g = i // params.group_size

    def pick(a, j):
        return None if a is None else np.asarray(a)[j : j + 1]

    return attnref.AttentionParams(
        pick(params.w_q, i),
        pick(params.w_k, g),
        pick(params.w_v, g),
        pick(params.w_o, i),
        pick(params.b_q, i),
        pick(params.b_k, g),
        pick(params.b_v, g),
        None,
    )


def check_probes(fn, problem):
    p = problem
    args = (p.params, p.x_q, p.x_kv)
    pr = fn(*args, **p.inputs())
    assert isinstance(pr, AttentionProbes)
    u = tolerance.unit_roundoff(p.dtype) + tolerance.unit_roundoff(np.float64)
    mha = attnref.interop.repeat_kv_heads(p.params.astype(np.float64))
    xq, xkv = np.asarray(p.x_q, np.float64), np.asarray(p.x_kv, np.float64)
    d_model, d_k, d_v = mha.d_model, mha.d_k, mha.d_v

    # Output, residual, per-head outputs: the derived attention bound.
    ref = oracle.attention(*args, **p.inputs())
    bound = tolerance.attention_error_bound(*args, dtype=p.dtype, **p.inputs())
    assert_within_bound(pr.output, ref, bound, label="output")
    ref_r = oracle.attention(*args, residual=True, **p.inputs())
    bound_r = tolerance.attention_error_bound(*args, residual=True, dtype=p.dtype, **p.inputs())
    assert_within_bound(pr.residual, ref_r, bound_r, label="residual")
    heads = oracle.head_outputs(*args, **p.inputs())
    for i in range(p.params.num_heads):
        hp = _head(p.params, i)
        b_i = tolerance.attention_error_bound(hp, p.x_q, p.x_kv, dtype=p.dtype, **p.inputs())
        assert_within_bound(pr.head_outputs[..., i, :, :], heads[..., i, :, :], b_i, label=f"o_{i}")

    # Logits: |d s| <= gamma_{2 (d_model + 1) + d_k + 2} |x~_q||W~_Q||W~_K|^T|x~_kv|^T scale
    # + u |bias| (the bias add).
    wq, wk = _wt(mha.w_q, mha.b_q), _wt(mha.w_k, mha.b_k)
    s = 1.0 / np.sqrt(d_k)
    q, k = (
        np.einsum("...td,hde->...hte", _hom(xq), wq),
        np.einsum("...td,hde->...hte", _hom(xkv), wk),
    )
    bias = np.asarray(p.bias, np.float64)[..., None, :, :]
    logits = s * np.einsum("...hqe,...hke->...hqk", q, k) + bias
    qa = np.einsum("...td,hde->...hte", np.abs(_hom(xq)), np.abs(wq))
    ka = np.einsum("...td,hde->...hte", np.abs(_hom(xkv)), np.abs(wk))
    mag = s * np.einsum("...hqe,...hke->...hqk", qa, ka) + np.abs(bias)
    allowed = np.broadcast_to(p.mask[..., None, :, :], logits.shape)
    got = np.asarray(pr.logits, np.float64)
    assert np.all(np.isneginf(got[~allowed]))
    n_s = 2 * (d_model + 1) + d_k + 2
    err_s = tolerance.gamma(n_s, u) * mag + u * np.abs(logits)
    assert_within_bound(got[allowed], logits[allowed], err_s[allowed], label="logits")

    # Scores: softmax of logits off by at most E_i per row moves each weight by a factor in
    # [exp(-2 E_i), exp(2 E_i)]; exp, the row sum and the division add gamma_{T_k + 10}
    # (docs/tolerances.md, step 2). Fully masked rows are exactly zero.
    e_row = np.where(allowed, err_s, 0.0).max(axis=-1, keepdims=True)
    rho = np.expm1(2 * e_row) + tolerance.gamma(logits.shape[-1] + 10, u)
    w_ref = oracle.attention_weights(*args, **p.inputs())
    assert_within_bound(pr.scores, w_ref, rho * w_ref, label="scores")

    # Patterns x~ [W_Q; b_Q] W_K^T and messages x~ [W_V; b_V] W_O.
    wk0, wo = np.asarray(mha.w_k, np.float64), np.asarray(mha.w_o, np.float64)
    for name, got_, x, left, right, n in (
        ("patterns", pr.patterns, xq, wq, np.swapaxes(wk0, -1, -2), d_model + d_k + 2),
        ("messages", pr.messages, xkv, _wt(mha.w_v, mha.b_v), wo, d_model + d_v + 2),
    ):
        exact = np.einsum("...td,hde,hef->...htf", _hom(x), left, right)
        size = np.einsum("...td,hde,hef->...htf", np.abs(_hom(x)), np.abs(left), np.abs(right))
        assert_within_bound(got_, exact, tolerance.gamma(n, u) * size * 2, label=name)

    return pr


class ProbesTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @scaled(0.5)
    @given(problem=problems(kinds=KINDS, param_bias=None))
    def test_probes_match_the_oracle(self, problem):
        check_probes(self.variant(attention_probes), problem)


def test_logits_and_residual_update_functions():
    p = ast.make_attention_problem(BUCKETS[1], "combined", seed=4, dtype=np.float64)
    pr = attention_probes(p.params, p.x_q, p.x_kv, **p.inputs())
    np.testing.assert_array_equal(
        np.asarray(attention_logits(p.params, p.x_q, p.x_kv, **p.inputs())), np.asarray(pr.logits)
    )
    np.testing.assert_array_equal(
        np.asarray(residual_update(p.params, p.x_q, p.x_kv, **p.inputs())),
        np.asarray(pr.residual),
    )
    for f in attnref.formulations("softmax"):
        y = f.apply(p.params, p.x_q, p.x_kv, residual=True, **p.inputs())
        bound = tolerance.attention_error_bound(
            p.params, p.x_q, p.x_kv, residual=True, dtype=np.float64, **p.inputs()
        )
        assert_within_bound(pr.residual, y, 2 * bound, label=f.id)


def test_probes_are_a_pytree_and_jit():
    p = ast.make_attention_problem(BUCKETS[2], "causal", seed=9, dtype=np.float32)
    pr = jax.jit(attention_probes)(p.params, p.x_q, p.x_kv, mask=p.mask)
    leaves = jax.tree_util.tree_leaves(pr)
    assert len(leaves) == len(dataclasses.fields(AttentionProbes))
    b = p.config
    assert pr.scores.shape == (*b.batch, b.n, b.t, b.s)
    assert pr.patterns.shape == (*b.batch, b.n, b.t, b.d_model)
    assert pr.messages.shape == (*b.batch, b.n, b.s, b.d_model)
    assert pr.head_outputs.shape == (*b.batch, b.n, b.t, b.d_model)
    assert all(leaf.dtype == np.float32 for leaf in leaves)
