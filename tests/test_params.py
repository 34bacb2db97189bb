"""Parameters: initialiser, merged matrices, and fused-layout converters.

Each converter gets (a) an exact round-trip test and (b) a semantic test: a NumPy forward pass
written from the framework's documented layout (Flax DenseGeneral kernels, PyTorch
nn.MultiheadAttention, Hugging Face BERT) on the converted weights equals the oracle on the
per-head weights. (b) catches a head-ordering or transpose mistake that a round trip cannot.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import attnref
from attnref import oracle, tolerance
from attnref.testing import assert_within_bound

from .helpers import scaled


def _softmax(s):
    e = np.exp(s - s.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def flax_forward(tree, x):
    """linen MultiHeadDotProductAttention: DenseGeneral q/k/v to [.., T, H, d], out over (H, d)."""
    q = np.einsum("td,dhk->thk", x, tree["query"]["kernel"]) + tree["query"].get("bias", 0)
    k = np.einsum("td,dhk->thk", x, tree["key"]["kernel"]) + tree["key"].get("bias", 0)
    v = np.einsum("td,dhk->thk", x, tree["value"]["kernel"]) + tree["value"].get("bias", 0)
    a = _softmax(np.einsum("qhd,khd->hqk", q / math.sqrt(q.shape[-1]), k))
    z = np.einsum("hqk,khv->qhv", a, v)
    return np.einsum("qhv,hve->qe", z, tree["out"]["kernel"]) + tree["out"].get("bias", 0)


def torch_forward(sd, x, num_heads):
    """nn.MultiheadAttention: packed in_proj (out, in), heads = contiguous blocks of E/H."""
    e = x.shape[-1]
    hd = e // num_heads
    w, b = sd["in_proj_weight"], sd.get("in_proj_bias", np.zeros(3 * e))
    q, k, v = (
        (x @ w[i * e : (i + 1) * e].T + b[i * e : (i + 1) * e]).reshape(-1, num_heads, hd)
        for i in range(3)
    )
    a = _softmax(np.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd))
    ctx = np.einsum("hqk,khd->qhd", a, v).reshape(-1, e)
    return ctx @ sd["out_proj.weight"].T + sd.get("out_proj.bias", 0)


def hf_forward(sd, x, num_heads, prefix):
    """BERT self-attention + output.dense, nn.Linear (out, in) weights, view(T, H, d_head)."""

    def lin(name):
        return x @ sd[f"{prefix}self.{name}.weight"].T + sd.get(f"{prefix}self.{name}.bias", 0)

    q, k, v = (lin(n).reshape(x.shape[0], num_heads, -1) for n in ("query", "key", "value"))
    a = _softmax(np.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1]))
    ctx = np.einsum("hqk,khd->qhd", a, v).reshape(x.shape[0], -1)
    return ctx @ sd[f"{prefix}output.dense.weight"].T + sd.get(f"{prefix}output.dense.bias", 0)


def _assert_same_params(a, b):
    for name in ("w_q", "w_k", "w_v", "w_o", "b_q", "b_k", "b_v", "b_o"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=name)


SHAPES = st.sampled_from([(8, 2, 4, 4), (6, 3, 2, 2), (8, 2, 4, 3), (5, 1, 3, 6)])


@scaled(1.0)
@given(shape=SHAPES, bias=st.booleans(), seed=st.integers(0, 1000))
def test_flax_round_trip_and_semantics(shape, bias, seed):
    d_model, h, d_k, d_v = shape
    p = attnref.init_params(
        seed, d_model=d_model, num_heads=h, d_k=d_k, d_v=d_v, bias=bias, dtype=np.float64
    )
    tree = attnref.interop.to_flax(p)
    _assert_same_params(attnref.interop.from_flax(tree), p)
    if d_k == d_v:  # Flax's module uses one head_dim for q, k and v
        x = np.random.default_rng(seed).standard_normal((4, d_model))
        bound = tolerance.attention_error_bound(p, x, dtype=np.float64)
        assert_within_bound(flax_forward(tree, x), oracle.attention(p, x), 2 * bound)


@scaled(1.0)
@given(shape=SHAPES, bias=st.booleans(), seed=st.integers(0, 1000))
def test_torch_mha_round_trip_and_semantics(shape, bias, seed):
    d_model, h, d_k, d_v = shape
    p = attnref.init_params(
        seed, d_model=d_model, num_heads=h, d_k=d_k, d_v=d_v, bias=bias, dtype=np.float64
    )
    if not (d_k == d_v and h * d_k == d_model):
        with pytest.raises(ValueError):
            attnref.interop.to_torch_mha(p)
        return
    sd = attnref.interop.to_torch_mha(p)
    assert sd["in_proj_weight"].shape == (3 * d_model, d_model)
    _assert_same_params(attnref.interop.from_torch_mha(sd, num_heads=h), p)
    x = np.random.default_rng(seed).standard_normal((4, d_model))
    bound = tolerance.attention_error_bound(p, x, dtype=np.float64)
    assert_within_bound(torch_forward(sd, x, h), oracle.attention(p, x), 2 * bound)


@scaled(1.0)
@given(shape=SHAPES, bias=st.booleans(), seed=st.integers(0, 1000))
def test_hf_bert_round_trip_and_semantics(shape, bias, seed):
    d_model, h, d_k, d_v = shape
    p = attnref.init_params(
        seed, d_model=d_model, num_heads=h, d_k=d_k, d_v=d_v, bias=bias, dtype=np.float64
    )
    prefix = "encoder.layer.0.attention."
    sd = attnref.interop.to_hf_bert(p, prefix=prefix)
    assert sd[prefix + "self.query.weight"].shape == (h * d_k, d_model)
    assert sd[prefix + "output.dense.weight"].shape == (d_model, h * d_v)
    _assert_same_params(attnref.interop.from_hf_bert(sd, num_heads=h, prefix=prefix), p)
    x = np.random.default_rng(seed).standard_normal((4, d_model))
    bound = tolerance.attention_error_bound(p, x, dtype=np.float64)
    assert_within_bound(hf_forward(sd, x, h, prefix), oracle.attention(p, x), 2 * bound)


def test_partial_biases_export_as_zeros():
    """Layouts with all-or-no biases write explicit zeros; the function is unchanged."""
    p = attnref.init_params(1, d_model=8, num_heads=2, d_k=4, bias=True, dtype=np.float64)
    partial = attnref.AttentionParams(p.w_q, p.w_k, p.w_v, p.w_o, b_q=p.b_q)
    back = attnref.interop.from_torch_mha(attnref.interop.to_torch_mha(partial), num_heads=2)
    np.testing.assert_array_equal(back.b_q, p.b_q)
    for name in ("b_k", "b_v", "b_o"):
        np.testing.assert_array_equal(getattr(back, name), 0.0)


@scaled(0.5)
@given(shape=SHAPES, seed=st.integers(0, 1000))
def test_merged_matrices(shape, seed):
    """W_P = W_Q W_K^T, W_M = W_V W_O per head (explicit loops); W_A = W_P^T, W_I = W_M^T."""
    d_model, h, d_k, d_v = shape
    p = attnref.init_params(seed, d_model=d_model, num_heads=h, d_k=d_k, d_v=d_v, dtype=np.float64)
    wp, wm = np.asarray(attnref.interp.w_p(p)), np.asarray(attnref.interp.w_m(p))
    assert wp.shape == wm.shape == (h, d_model, d_model)
    wa, wi = np.asarray(attnref.interp.w_a(p)), np.asarray(attnref.interp.w_i(p))
    for i in range(h):
        # |fl(A B) - A B| <= gamma_n |A||B| for each of the two computations being compared.
        tol_p = 2 * tolerance.gamma(d_k, 2.0**-53) * np.abs(p.w_q[i]) @ np.abs(p.w_k[i]).T
        tol_m = 2 * tolerance.gamma(d_v, 2.0**-53) * np.abs(p.w_v[i]) @ np.abs(p.w_o[i])
        assert_within_bound(wp[i], p.w_q[i] @ p.w_k[i].T, tol_p, label="W_P")
        assert_within_bound(wm[i], p.w_v[i] @ p.w_o[i], tol_m, label="W_M")
        assert_within_bound(wa[i], (p.w_q[i] @ p.w_k[i].T).T, tol_p.T, label="W_A = W_P^T")
        assert_within_bound(wi[i], (p.w_v[i] @ p.w_o[i]).T, tol_m.T, label="W_I = W_M^T")


def test_init_params_is_seeded_and_typed():
    a = attnref.init_params(3, d_model=6, num_heads=2, d_k=2, d_v=5, bias=True)
    b = attnref.init_params(3, d_model=6, num_heads=2, d_k=2, d_v=5, bias=True)
    _assert_same_params(a, b)
    assert a.w_q.dtype == np.float32 and a.w_v.shape == (2, 6, 5) and a.w_o.shape == (2, 5, 6)
    assert (a.num_heads, a.d_model, a.d_k, a.d_v, a.has_bias) == (2, 6, 2, 5, True)
    c = attnref.init_params(4, d_model=6, num_heads=2, d_k=2)
    assert not np.array_equal(a.w_q, c.w_q) and c.b_q is None and c.d_v == 2
