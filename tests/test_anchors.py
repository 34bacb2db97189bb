"""Anchors: every function of ``attnref.oracle`` against an outside truth.

The JAX code and the oracle are written independently, but both could share one mistaken
convention (RoPE's rotation direction, ALiBi's slopes for odd head counts, which key a causal
window keeps). So each oracle function is pinned here to values worked out by hand from the
published formulas (the arithmetic is in the comments) or to an outside implementation with the
same convention (``jax.nn.dot_product_attention``). ``ANCHORED`` lists the function each test
anchors; ``test_every_oracle_function_has_an_anchor`` fails for a new oracle function without
one; a result class of ``oracle.__all__`` (``KernelGrads``, ...) counts as anchored through an
anchored function annotated to return it. The gradient oracles (``*_vjp``) are pinned to the
chain rule worked by hand on one query and two keys, through both ``method``s, at ``GRAD_TOL``
(derived where it is defined). The table is in ``docs/tolerances.md`` ("Anchors").

Tolerance: the hand values are float64 literals of closed forms (``cos 1``, ``e^-1``,
``sigmoid(1/sqrt 2)``), each at most a few roundings from exact, and the oracle evaluates the same
closed forms in float64 with at most ``T + d + 10`` roundings on any chain here (``T, d <= 4``), so
``rtol = atol = 64 u_64 ~ 7e-15`` covers both with room (``gamma_32 ~ 3.6e-15``); a wrong
convention moves a value by ``> 1e-2``.
"""

from __future__ import annotations

import inspect
import math

import jax
import numpy as np

import attnref
from attnref import oracle, tolerance

TOL = dict(rtol=64 * 2.0**-53, atol=64 * 2.0**-53)
ANCHORED: set[str] = set()


def anchors(*names: str):
    """Register the oracle functions a test anchors."""
    ANCHORED.update(names)

    def wrap(fn):
        return fn

    return wrap


def _identity_params(num_heads: int = 1, d: int = 2, w_o_scale: float = 1.0, b_o=None):
    eye = np.broadcast_to(np.eye(d), (num_heads, d, d)).copy()
    return attnref.AttentionParams(eye, eye, eye, w_o_scale * eye, b_o=b_o)


# sigmoid(1/sqrt 2) = 1 / (1 + e^{-0.7071067811865476}) = 1 / 1.4930686913952398
A = 0.6697615493266569


@anchors("attention", "attention_weights", "head_outputs")
def test_softmax_attention_two_tokens_by_hand():
    """One head, W_Q = W_K = W_V = I (d = 2), x = [e_1, e_2]: q = k = v = x, scale 1/sqrt 2.
    Logits: s = I / sqrt 2, so row 0 is softmax([1/sqrt 2, 0]) = [a, 1 - a] with
    a = sigmoid(1/sqrt 2) = 0.66976..., and row 1 = [1 - a, a]. Output row i = sum_j p_ij v_j."""
    x = np.eye(2)
    p = _identity_params(w_o_scale=2.0, b_o=np.array([10.0, 20.0]))
    weights = np.array([[A, 1 - A], [1 - A, A]])
    np.testing.assert_allclose(oracle.attention_weights(p, x), weights[None], **TOL)
    # head_outputs: o = head W_O = 2 [[a, 1 - a], [1 - a, a]] (no b_O)
    np.testing.assert_allclose(oracle.head_outputs(p, x), 2 * weights[None], **TOL)
    # attention: sum_i o_i + b_O = [[2a + 10, 2(1 - a) + 20], [2(1 - a) + 10, 2a + 20]]
    y = np.array([[2 * A + 10, 2 * (1 - A) + 20], [2 * (1 - A) + 10, 2 * A + 20]])
    np.testing.assert_allclose(oracle.attention(p, x), y, **TOL)
    # causal mask: token 0 sees only itself -> weights [1, 0], output 2 e_1 + b_O = [12, 20]
    causal = np.tril(np.ones((2, 2), bool))
    np.testing.assert_allclose(oracle.attention(p, x, mask=causal)[0], [12.0, 20.0], **TOL)
    # residual: x + y
    np.testing.assert_allclose(oracle.attention(p, x, residual=True), x + y, **TOL)


@anchors("dot_product_attention")
def test_kernel_attention_by_hand_and_against_jax_nn():
    """The same two tokens at the kernel level [B, T, N, H]; then jax.nn.dot_product_attention
    (same layout, same default scale 1/sqrt(H), same causal and GQA conventions) on random
    inputs with no fully masked row (where the two policies differ by design)."""
    x = np.eye(2)[None, :, None, :]  # [1, 2, 1, 2]
    out = oracle.dot_product_attention(x, x, x)
    np.testing.assert_allclose(out[0, :, 0], [[A, 1 - A], [1 - A, A]], **TOL)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 5, 4, 3))
    k, v = rng.standard_normal((2, 6, 2, 3)), rng.standard_normal((2, 6, 2, 3))  # GQA: 2 groups
    for causal in (False, True):
        with jax.enable_x64(True):
            ref = np.asarray(jax.nn.dot_product_attention(q, k, v, is_causal=causal))
        # jax.nn computes the softmax in float32 even for float64 inputs ("Softmax is always
        # computed in float32", jax/_src/nn/functions.py), so the allowance is the derived
        # float32 kernel bound of docs/tolerances.md (it covers float32 logits and sums too).
        allowed = oracle.kernel_allowed((2, 4, 5, 6), is_causal=causal)  # [B, N, T, S]
        bound, _ = tolerance.kernel_error_bound(q, k, v, allowed, dtype=np.float32)
        got = oracle.dot_product_attention(q, k, v, is_causal=causal)
        assert np.all(np.abs(got - ref) <= bound), np.max(np.abs(got - ref) / bound)


@anchors("kernel_allowed")
def test_allowed_sets_by_hand():
    """jax.nn's definitions: causal keeps j <= i (top-left aligned); local_window_size=(L, R)
    keeps i - L <= j <= i + R; key_value_seq_lengths=n keeps j < n."""
    causal = oracle.kernel_allowed((1, 1, 3, 3), is_causal=True)[0, 0]
    np.testing.assert_array_equal(causal, [[1, 0, 0], [1, 1, 0], [1, 1, 1]])
    window = oracle.kernel_allowed((1, 1, 3, 3), local_window_size=(1, 0))[0, 0]
    np.testing.assert_array_equal(window, [[1, 0, 0], [1, 1, 0], [0, 1, 1]])
    lengths = oracle.kernel_allowed((1, 1, 2, 3), key_value_seq_lengths=np.array([2]))[0, 0]
    np.testing.assert_array_equal(lengths, [[1, 1, 0], [1, 1, 0]])
    # bottom-right alignment (FlashAttention): T = 2, S = 3, query i sits at key position i + 1
    br = oracle.kernel_allowed((1, 1, 2, 3), is_causal=True, causal_alignment="bottom_right")
    np.testing.assert_array_equal(br[0, 0], [[1, 1, 0], [1, 1, 1]])


@anchors("alibi_slopes")
def test_alibi_slopes_are_the_papers():
    """Press et al. (2022) and their reference ``get_slopes(n)``: for n a power of two the
    geometric sequence starting at 2^(-8/n) with ratio 2^(-8/n); otherwise get_slopes(c) for the
    largest power of two c < n, then get_slopes(2c)[0::2][: n - c]."""
    # n = 8: 2^-1 ... 2^-8
    np.testing.assert_allclose(oracle.alibi_slopes(8), [1 / 2**i for i in range(1, 9)], **TOL)
    # n = 3: c = 2 -> [2^-4, 2^-8]; get_slopes(4) = [2^-2, 2^-4, 2^-6, 2^-8], [0::2][:1] = [2^-2]
    np.testing.assert_allclose(oracle.alibi_slopes(3), [1 / 16, 1 / 256, 1 / 4], **TOL)
    # n = 6: c = 4 -> [2^-2, 2^-4, 2^-6, 2^-8]; get_slopes(8)[0::2][:2] = [2^-1, 2^-3]
    six = [1 / 4, 1 / 16, 1 / 64, 1 / 256, 1 / 2, 1 / 8]
    np.testing.assert_allclose(oracle.alibi_slopes(6), six, **TOL)
    # n = 12: c = 8 -> 2^-1 .. 2^-8; get_slopes(16) = 2^(-k/2), k = 1..16; [0::2][:4] is
    # k = 1, 3, 5, 7: 2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5
    twelve = [1 / 2**i for i in range(1, 9)] + [
        0.7071067811865476,
        0.3535533905932738,
        0.1767766952966369,
        0.08838834764831845,
    ]
    np.testing.assert_allclose(oracle.alibi_slopes(12), twelve, **TOL)


@anchors("alibi_bias")
def test_alibi_bias_by_hand():
    """bias[i, j] = -m |i + offset - j| (the paper's -m (i - j) on the causal part, symmetric
    off it); bottom-right alignment puts query i at key position i + S - T."""
    b = oracle.alibi_bias(np.array([0.5]), 3, 3)[0, 0]
    np.testing.assert_allclose(b, [[0, -0.5, -1], [-0.5, 0, -0.5], [-1, -0.5, 0]], **TOL)
    br = oracle.alibi_bias(np.array([0.5]), 2, 4, causal_alignment="bottom_right")[0, 0]
    # offset 2: query 0 at position 2 -> -0.5 [2, 1, 0, 1]; query 1 at 3 -> -0.5 [3, 2, 1, 0]
    np.testing.assert_allclose(br, [[-1, -0.5, 0, -0.5], [-1.5, -1, -0.5, 0]], **TOL)


# cos 1 = 0.5403023058681398, sin 1 = 0.8414709848078965,
# cos 0.01 = 0.9999500004166653, sin 0.01 = 0.009999833334166664
C1, S1, C2, S2 = math.cos(1.0), math.sin(1.0), math.cos(0.01), math.sin(0.01)


@anchors("rope")
def test_rope_rotation_direction_and_pairing_by_hand():
    """x = [1, 2, 3, 4] at position m = 1, base 10000, d = 4: theta_p = 10000^(-2p/4), so
    theta_0 = 1 and theta_1 = 0.01. Su et al. (2024; eq. 34 of arXiv:2104.09864), and the
    rotate-half form of GPT-NeoX / Hugging Face: x R = x cos + rotate_half(x) sin,
    rotate_half(x) = [-x_3, -x_4, x_1, x_2], i.e. pairs (x_p, x_{p + d/2}) rotated
    counter-clockwise: (a, b) -> (a cos - b sin, b cos + a sin). Interleaved (the paper's and Meta
    LLaMA's layout): pairs (x_{2p}, x_{2p+1})."""
    x = np.array([1.0, 2.0, 3.0, 4.0])[None, None, :]  # [T=1, N=1, d=4]
    rotate_half = [
        1 * C1 - 3 * S1,  # -1.9841106485555495
        2 * C2 - 4 * S2,  # 1.959900667496664
        3 * C1 + 1 * S1,  # 2.4623779024123156
        4 * C2 + 2 * S2,  # 4.019799668334994
    ]
    got = oracle.rope(x, np.array([1]), convention="rotate_half")[0, 0]
    np.testing.assert_allclose(got, rotate_half, **TOL)
    interleaved = [
        1 * C1 - 2 * S1,  # -1.1426396637476532
        2 * C1 + 1 * S1,  # 1.922075596544176
        3 * C2 - 4 * S2,  # 2.9598506679133294
        4 * C2 + 3 * S2,  # 4.029799501669161
    ]
    got = oracle.rope(x, np.array([1]), convention="interleaved")[0, 0]
    np.testing.assert_allclose(got, interleaved, **TOL)
    # position 0 is the identity
    np.testing.assert_allclose(oracle.rope(x, np.array([0]))[0, 0], x[0, 0], **TOL)


@anchors("rope_attention")
def test_rope_attention_two_tokens_by_hand():
    """One head, d = 2 (one plane, theta_0 = 1 for any base), W = I, x = [e_1, e_2] at positions
    [0, 1]. Rotated: q_0 = k_0 = e_1, q_1 = k_1 = e_2 R(1) = [-sin 1, cos 1]. Logits / sqrt 2:
    s_00 = s_11 = 1, s_01 = s_10 = e_1 . [-sin 1, cos 1] = -sin 1. Row 0 = softmax([1, -sin 1] /
    sqrt 2) = [r, 1 - r], r = sigmoid((1 + sin 1) / sqrt 2) = 0.7861909913235843 (the wrong
    rotation direction would give sigmoid((1 - sin 1) / sqrt 2) = 0.528); values are not
    rotated, so y_0 = [r, 1 - r], y_1 = [1 - r, r]."""
    r = 0.7861909913235843  # 1 / (1 + exp(-(1 + 0.8414709848078965) * 0.7071067811865476))
    y = oracle.rope_attention(_identity_params(), np.eye(2), positions_q=np.array([0, 1]))
    np.testing.assert_allclose(y, [[r, 1 - r], [1 - r, r]], **TOL)


E = math.exp(-1.0)  # 0.36787944117144233


@anchors("features")
def test_feature_maps_by_hand():
    """Katharopoulos et al. (2020): elu(x) + 1 = x + 1 for x > 0, e^x for x <= 0; relu."""
    x = np.array([1.0, -1.0, 0.0, 2.5])
    np.testing.assert_allclose(
        oracle.features(attnref.linear.elu_plus_one(), x, "query"), [2.0, E, 1.0, 3.5], **TOL
    )
    np.testing.assert_allclose(
        oracle.features(attnref.linear.relu_features(), x, "key"), [1.0, 0.0, 0.0, 2.5], **TOL
    )


@anchors("linear_attention")
def test_linear_attention_by_hand():
    """y_i = sum_j (phi(q_i).phi(k_j)) v_j / sum_j phi(q_i).phi(k_j), phi = elu + 1.
    q_0 = [1, 0] -> [2, 1]; q_1 = [0, -1] -> [1, e^-1]; k_0 = [0, 1] -> [1, 2]; k_1 = [1, 1] ->
    [2, 2]; v = [1, 4]. Query 0: kernel values 2 + 2 = 4 and 4 + 2 = 6, y_0 = (4 + 24) / 10 = 2.8.
    Query 1: 1 + 2/e and 2 + 2/e, y_1 = (9 + 10/e) / (3 + 4/e) = 2.835456567308396.
    Causal: y_0 = v_0 = 1 (one key), y_1 unchanged."""
    q = np.array([[1.0, 0.0], [0.0, -1.0]])[:, None, :]  # [T, H, d]
    k = np.array([[0.0, 1.0], [1.0, 1.0]])[:, None, :]
    v = np.array([[1.0], [4.0]])[:, None, :]
    fm = attnref.linear.elu_plus_one()
    y1 = 2.835456567308396
    got = oracle.linear_attention(q, k, v, feature_map=fm)[:, 0, 0]
    np.testing.assert_allclose(got, [2.8, y1], **TOL)
    got = oracle.linear_attention(q, k, v, feature_map=fm, causal=True)[:, 0, 0]
    np.testing.assert_allclose(got, [1.0, y1], **TOL)


@anchors("linear_multihead")
def test_linear_multihead_by_hand():
    """One head, W = I (d = 2), x = [[1, 0], [0, -1]]: q = k = v = x, phi(x_0) = [2, 1],
    phi(x_1) = [1, e^-1]. Kernel values: k(0, 0) = 5, k(0, 1) = k(1, 0) = 2 + e^-1,
    k(1, 1) = 1 + e^-2. y_0 = (5 x_0 + (2 + e^-1) x_1) / (7 + e^-1) = [0.6786..., -0.3213...];
    y_1 = ((2 + e^-1) x_0 + (1 + e^-2) x_1) / (3 + e^-1 + e^-2); causal y_0 = x_0."""
    x = np.array([[1.0, 0.0], [0.0, -1.0]])
    fm = attnref.linear.elu_plus_one()
    y0 = [0.6786213102321113, -0.3213786897678887]  # [5, -(2 + e^-1)] / (7 + e^-1)
    y1 = [0.6759161591419571, -0.3240838408580429]  # [2 + e^-1, -(1 + e^-2)] / (3 + e^-1 + e^-2)
    p = _identity_params()
    np.testing.assert_allclose(oracle.linear_multihead(p, x, feature_map=fm), [y0, y1], **TOL)
    got = oracle.linear_multihead(p, x, feature_map=fm, causal=True)
    np.testing.assert_allclose(got, [[1.0, 0.0], y1], **TOL)


# ----------------------------------------------------------------------------- gradient anchors
#
# Each gradient oracle against the chain rule worked by hand on one query and two allowed keys.
# For logits s = (s_0, s_1): p_0 = sigmoid(s_0 - s_1), p_1 = 1 - p_0, dp_0/ds_0 = p_0 p_1 =
# -dp_0/ds_1, and d lse / ds_j = p_j. So for L = g . (p_0 v_0 + p_1 v_1) + l lse (row vectors):
#     dL/ds_0 = p_0 p_1 g.(v_0 - v_1) + l p_0,   dL/ds_1 = p_0 p_1 g.(v_1 - v_0) + l p_1,
# the same as the oracles' dS_j = p_j (dP_j - sum_k p_k dP_k + l), dP_j = g.v_j. The logits below
# are (2 ln 3, ln 3), so p = (3/4, 1/4), p_0 p_1 = 3/16, lse = ln 12; every other number is a
# binary fraction (but RoPE's angle pi/2), so each expected value is a + b ln 3, a, b binary.
#
# GRAD_TOL: every gradient here is a chain of at most 32 float64 roundings (logits and softmax 8,
# dP and its p-weighted sum 4, dS 2, dq / dk 3, the RoPE rotation and its transpose 6, the
# projections 4, plus ln 3 and pi/2, each within an ulp as inputs) and every rounded intermediate
# has magnitude <= 8 (the largest |dP|, |x|, |W| here), scaled by at most 2 further down the chain;
# so |error| <= 32 * 8 * 2 u_64 = 512 u_64 ~ 5.7e-14 absolutely, whatever the value's own size (a
# wrong sign, transpose or rotation direction moves a value by >= 1/8). The oracles' own bounds
# (attnref.tolerance.*_vjp_error_bound) are the same first-order sums for general inputs.
GRAD_TOL = dict(rtol=0.0, atol=512 * 2.0**-53)
LN3 = math.log(3.0)  # 1.0986122886681098
METHODS = ("fast", "definition")


def _close(got, want) -> None:
    np.testing.assert_allclose(got, want, **GRAD_TOL)


@anchors("dot_product_attention_vjp")
def test_kernel_vjp_by_hand():
    """[B, T, N, H] = [1, 1, 1, 1]; three keys, the third masked out; scale 1; q = ln 3,
    k = (2, 1, 5), bias = (1/2, 1/2, 100) (a shift of the allowed logits, so p is unchanged; the
    masked key's 100 would win if it were read), v = (2, -2, 7). Logits s = (2 ln 3, ln 3) + 1/2,
    p = (3/4, 1/4), o = 3/2 - 1/2 = 1. Cotangents dO = g = 1 and d lse = l = 2.
    dS_0 = p_0 p_1 g (v_0 - v_1) + l p_0 = (3/16) 4 + 3/2 = 9/4; dS_1 = -3/4 + 1/2 = -1/4
    (the same as p_j (dP_j - D + l): D = g o = 1, 3/4 (2 - 1 + 2) and 1/4 (-2 - 1 + 2); without
    the lse term they would be +-3/4). Then dbias_j = dS_j; dv_j = p_j g = (3/4, 1/4);
    dq = scale sum_j dS_j k_j = 9/2 - 1/4 = 17/4; dk_j = scale dS_j q = (9/4 ln 3, -1/4 ln 3).
    The masked key gets exactly 0 in dk, dv and dbias (it is never read)."""
    q = np.full((1, 1, 1, 1), LN3)
    k = np.array([2.0, 1.0, 5.0]).reshape(1, 3, 1, 1)
    v = np.array([2.0, -2.0, 7.0]).reshape(1, 3, 1, 1)
    bias = np.array([0.5, 0.5, 100.0]).reshape(1, 1, 1, 3)
    mask = np.array([True, True, False]).reshape(1, 1, 1, 3)
    for method in METHODS:
        got = oracle.dot_product_attention_vjp(
            q,
            k,
            v,
            bias,
            mask,
            cotangent=np.ones((1, 1, 1, 1)),
            lse_cotangent=np.full((1, 1, 1), 2.0),
            scale=1.0,
            method=method,
        )
        assert type(got) is oracle.KernelGrads, method
        _close(got.query.ravel(), [17 / 4])
        _close(got.key.ravel()[:2], [9 / 4 * LN3, -1 / 4 * LN3])
        _close(got.value.ravel()[:2], [3 / 4, 1 / 4])
        assert got.bias is not None and got.bias.shape == bias.shape
        _close(got.bias.ravel()[:2], [9 / 4, -1 / 4])
        for masked in (got.key, got.value, got.bias):  # exactly zero, not merely small
            assert masked.ravel()[2] == 0.0, method


def _grad_params(w_q, w_k, w_v, w_o, biases: bool = True) -> attnref.AttentionParams:
    """One head with the given weights (``[d_model, d]`` each, ``w_o [d_v, d_model]``) and, if
    ``biases``, zero ``b_q, b_k, b_v, b_o`` (so their gradients are returned)."""
    ws = [np.asarray(w, dtype=np.float64)[None] for w in (w_q, w_k, w_v, w_o)]
    if not biases:
        return attnref.AttentionParams(*ws)
    zeros = [np.zeros((1, w.shape[2])) for w in ws[:3]] + [np.zeros(ws[3].shape[2])]
    return attnref.AttentionParams(*ws, *zeros)


@anchors("attention_vjp")
def test_attention_vjp_by_hand():
    """One head, d_model = 2, d_k = d_v = 1, scale 1, cross-attention of one query token
    x_q = [ln 3, 5] to x_kv = [[2, 2], [-1, 1]]. W_Q = [[1], [0]] (q = first coordinate),
    W_K = [[0], [1]] (k = second), W_V = [[1], [0]] (v = first), W_O = [[3, 1]], zero biases, and
    a zero bias [1, 2] on the logits. Then q = ln 3, k = (2, 1), v = (2, -1), logits
    (2 ln 3, ln 3), p = (3/4, 1/4), z = 3/2 - 1/4 = 5/4, y = z W_O. Cotangent dY = [1, -1]:
        dW_O = z^T dY = [[5/4, -5/4]],   db_O = dY = [1, -1],   dz = dY W_O^T = 3 - 1 = 2
        dv_j = p_j dz = (3/2, 1/2),   dW_V = X_kv^T dv = [[3 - 1/2], [3 + 1/2]] = [[5/2], [7/2]]
        dS_0 = p_0 p_1 dz (v_0 - v_1) = (3/16) 2 3 = 9/8 = dbias_0,   dS_1 = -9/8 = dbias_1
        dq = dS_0 k_0 + dS_1 k_1 = 9/8,   dW_Q = x_q^T dq = [[9/8 ln 3], [45/8]],   db_Q = 9/8
        dk_j = dS_j q = (9/8 ln 3, -9/8 ln 3),   dW_K = X_kv^T dk = [[27/8 ln 3], [9/8 ln 3]]
        db_K = dk_0 + dk_1 = 0,   db_V = dv_0 + dv_1 = 2
        dx_q = dq W_Q^T = [9/8, 0] (+ dY = [17/8, -1] with residual)
        dx_kv_j = dk_j W_K^T + dv_j W_V^T = [dv_j, dk_j] = [[3/2, 9/8 ln 3], [1/2, -9/8 ln 3]]."""
    p = _grad_params([[1.0], [0.0]], [[0.0], [1.0]], [[1.0], [0.0]], [[3.0, 1.0]])
    x_q, x_kv = np.array([[LN3, 5.0]]), np.array([[2.0, 2.0], [-1.0, 1.0]])
    want = {
        "w_o": [[[5 / 4, -5 / 4]]],
        "b_o": [1.0, -1.0],
        "w_v": [[[5 / 2], [7 / 2]]],
        "b_v": [[2.0]],
        "w_q": [[[9 / 8 * LN3], [45 / 8]]],
        "b_q": [[9 / 8]],
        "w_k": [[[27 / 8 * LN3], [9 / 8 * LN3]]],
        "b_k": [[0.0]],
    }
    dx_kv = [[3 / 2, 9 / 8 * LN3], [1 / 2, -9 / 8 * LN3]]
    for method in METHODS:
        for residual, dx_q in ((False, [[9 / 8, 0.0]]), (True, [[17 / 8, -1.0]])):
            got = oracle.attention_vjp(
                p,
                x_q,
                x_kv,
                d_y=np.array([[1.0, -1.0]]),
                bias=np.zeros((1, 2)),
                scale=1.0,
                residual=residual,
                method=method,
            )
            assert type(got) is oracle.AttentionGrads, method
            assert set(got.params) == set(want)
            for name, value in want.items():
                _close(got.params[name], value)
            _close(got.x_q, dx_q)
            _close(got.x_kv, dx_kv)
            _close(got.bias, [[9 / 8, -9 / 8]])


@anchors("rope_attention_vjp")
def test_rope_attention_vjp_rotation_transposed_by_hand():
    """One head, d_model = 2, d_k = 4 (rotate_half pairs (0, 2) and (1, 3)), scale 1, base
    4 / pi^2, so theta_1 = base^(-2/4) = pi/2 and position 1 turns pair 1 by a right angle:
    R(a, b) = (a cos - b sin, a sin + b cos) = (-b, a), and its transpose R^T(a, b) = (b, -a).
    W_Q = W_K put token (x_a, x_b) into pair 1 (components 1, 3); pair 0 stays 0. W_V = [[0], [1]]
    (v = x_b), W_O = [[1, 0]], no biases. Query x_q = [ln 3, 0] at position 0 (no rotation):
    q = (ln 3, 0). Keys x_kv = [[1, -2], [1, 1]] at positions (1, 0): k_0 = R(1, -2) = (2, 1),
    k_1 = (1, 1); logits (2 ln 3, ln 3), p = (3/4, 1/4); v = (-2, 1), z = -5/4. dY = [1, 0]:
        dz = 1, dW_O = z^T dY = [[-5/4, 0]], dv = p dz = (3/4, 1/4), dW_V = [[1], [-5/4]]
        dS_0 = p_0 p_1 dz (v_0 - v_1) = -9/16, dS_1 = 9/16
        dq = R_0^T (dS_0 k_0 + dS_1 k_1) = (-9/16, 0) (R at position 0 is the identity)
        dk_0 = R^T(dS_0 q) = R^T(-9/16 ln 3, 0) = (0, 9/16 ln 3)   (R instead: (0, -9/16 ln 3))
        dk_1 = dS_1 q = (9/16 ln 3, 0)
    in pair 1; so dW_Q[:, 1] = x_q^T (-9/16) (only entry [0, 1] = -9/16 ln 3), dW_K = X_kv^T dK:
    column 1 = x_kv1^T 9/16 ln 3 = 9/16 ln 3 [1, 1], column 3 = x_kv0^T 9/16 ln 3 = 9/16 ln 3
    [1, -2]; dx_q = [-9/16, 0]; dx_kv_j = (dk_j pair 1) + dv_j [0, 1] =
    [[0, 9/16 ln 3 + 3/4], [9/16 ln 3, 1/4]]."""
    w_qk = np.zeros((2, 4))
    w_qk[0, 1] = w_qk[1, 3] = 1.0
    p = _grad_params(w_qk, w_qk, [[0.0], [1.0]], [[1.0, 0.0]], biases=False)
    x_q, x_kv = np.array([[LN3, 0.0]]), np.array([[1.0, -2.0], [1.0, 1.0]])
    c = 9 / 16 * LN3
    d_w_q = np.zeros((1, 2, 4))
    d_w_q[0, 0, 1] = -c
    d_w_k = np.zeros((1, 2, 4))
    d_w_k[0, :, 1], d_w_k[0, :, 3] = [c, c], [c, -2 * c]
    for method in METHODS:
        got = oracle.rope_attention_vjp(
            p,
            x_q,
            x_kv,
            d_y=np.array([[1.0, 0.0]]),
            positions_q=np.array([0]),
            positions_kv=np.array([1, 0]),
            scale=1.0,
            base=4 / math.pi**2,
            method=method,
        )
        assert type(got) is oracle.AttentionGrads, method
        _close(got.params["w_o"], [[[-5 / 4, 0.0]]])
        _close(got.params["w_v"], [[[1.0], [-5 / 4]]])
        _close(got.params["w_q"], d_w_q)
        _close(got.params["w_k"], d_w_k)
        _close(got.x_q, [[-9 / 16, 0.0]])
        _close(got.x_kv, [[0.0, c + 3 / 4], [c, 1 / 4]])
        assert got.bias is None and got.params["b_q"] is None


@anchors("linear_attention_vjp")
def test_linear_attention_vjp_quotient_rule_by_hand():
    """Identity features, one head, d_k = 2, d_v = 1: y_i = sum_j A_ij v_j / S_i with
    A_ij = q_i . k_j and S_i = sum_j A_ij. Quotient rule: dy_i / dA_ij = (v_j - y_i) / S_i,
    dy_i / dv_j = A_ij / S_i; then dq_i = sum_j dA_ij k_j and dk_j = sum_i dA_ij q_i.
    q = (1, 1), k = [(1, 0), (0, 3)], v = (1, 5): A = (1, 3), S = 4, y = 16/4 = 4. With dy = 1:
    dA = ((1 - 4)/4, (5 - 4)/4) = (-3/4, 1/4); dq = (-3/4, 3/4); dk = [(-3/4, -3/4), (1/4, 1/4)];
    dv = (1/4, 3/4). Causal, with a query 0 = (2, 1) before it (dy = 1 too): query 0 reads key 0
    only, y_0 = v_0 whatever q_0 and k_0, so dq_0 = 0, dA_00 = (v_0 - y_0)/S_0 = 0 and dv_0 gains
    A_00 / S_0 = 1; query 1 is as above."""
    k = np.array([[1.0, 0.0], [0.0, 3.0]])[:, None, :]  # [T, H, d]
    v = np.array([[1.0], [5.0]])[:, None, :]
    fm = attnref.linear.identity_features()
    for method in METHODS:
        q = np.array([[1.0, 1.0]])[:, None, :]
        got = oracle.linear_attention_vjp(
            q, k, v, np.ones((1, 1, 1)), feature_map=fm, method=method
        )
        assert type(got) is oracle.LinearGrads, method
        _close(got.q[:, 0], [[-3 / 4, 3 / 4]])
        _close(got.k[:, 0], [[-3 / 4, -3 / 4], [1 / 4, 1 / 4]])
        _close(got.v[:, 0], [[1 / 4], [3 / 4]])
        q = np.array([[2.0, 1.0], [1.0, 1.0]])[:, None, :]
        got = oracle.linear_attention_vjp(
            q, k, v, np.ones((2, 1, 1)), feature_map=fm, causal=True, method=method
        )
        _close(got.q[:, 0], [[0.0, 0.0], [-3 / 4, 3 / 4]])
        _close(got.k[:, 0], [[-3 / 4, -3 / 4], [1 / 4, 1 / 4]])
        _close(got.v[:, 0], [[5 / 4], [3 / 4]])


@anchors("linear_multihead_vjp")
def test_linear_multihead_vjp_by_hand():
    """One head, identity features, d_model = d_k = 2, d_v = 1: W_Q = W_K = I, W_V = [[1], [1]],
    W_O = [[2, -1]], zero b_O. x_q = [[1, 1]], x_kv = [[1, 0], [0, 3]]: q = (1, 1),
    k = [(1, 0), (0, 3)], v = (1, 3), A = (1, 3), S = 4, z = (1 + 9)/4 = 5/2, y = z W_O.
    dY = [1, -1]:
        dW_O = z^T dY = [[5/2, -5/2]],   db_O = [1, -1],   dz = dY W_O^T = 2 + 1 = 3
        dA_j = dz (v_j - z) / S = 3 (-3/2, 1/2) / 4 = (-9/8, 3/8)      (quotient rule)
        dq = sum_j dA_j k_j = (-9/8, 9/8),   dk_j = dA_j q = [(-9/8, -9/8), (3/8, 3/8)]
        dv_j = A_j dz / S = (3/4, 9/4)
        dW_Q = x_q^T dq = [[-9/8, 9/8], [-9/8, 9/8]],  dW_K = X_kv^T dk = [[-9/8, -9/8], [9/8, 9/8]]
        dW_V = X_kv^T dv = [[3/4], [27/4]],   dx_q = dq W_Q^T = (-9/8, 9/8) (+ dY with residual)
        dx_kv_j = dk_j W_K^T + dv_j W_V^T = [(-9/8 + 3/4) (1, 1), (3/8 + 9/4) (1, 1)]
                = [(-3/8, -3/8), (21/8, 21/8)]."""
    eye = np.eye(2)
    p = attnref.AttentionParams(
        eye[None], eye[None], np.ones((1, 2, 1)), np.array([[[2.0, -1.0]]]), b_o=np.zeros(2)
    )
    x_q, x_kv = np.array([[1.0, 1.0]]), np.array([[1.0, 0.0], [0.0, 3.0]])
    fm = attnref.linear.identity_features()
    want = {
        "w_q": [[[-9 / 8, 9 / 8], [-9 / 8, 9 / 8]]],
        "w_k": [[[-9 / 8, -9 / 8], [9 / 8, 9 / 8]]],
        "w_v": [[[3 / 4], [27 / 4]]],
        "w_o": [[[5 / 2, -5 / 2]]],
        "b_o": [1.0, -1.0],
    }
    for method in METHODS:
        for residual, dx_q in ((False, [[-9 / 8, 9 / 8]]), (True, [[-1 / 8, 1 / 8]])):
            got = oracle.linear_multihead_vjp(
                p,
                x_q,
                x_kv,
                d_y=np.array([[1.0, -1.0]]),
                feature_map=fm,
                residual=residual,
                method=method,
            )
            assert type(got) is oracle.LinearMultiheadGrads, method
            assert set(got.params) == set(want)
            for name, value in want.items():
                _close(got.params[name], value)
            _close(got.x_q, dx_q)
            _close(got.x_kv, [[-3 / 8, -3 / 8], [21 / 8, 21 / 8]])


def _returned_classes(names: set[str]) -> set[str]:
    """The oracle classes some function in ``names`` is annotated to return."""
    out = set()
    for name in names:
        ret = inspect.signature(getattr(oracle, name), eval_str=True).return_annotation
        if inspect.isclass(ret) and getattr(oracle, ret.__name__, None) is ret:
            out.add(ret.__name__)
    return out


def test_every_oracle_function_has_an_anchor():
    """Functions are anchored by a test registered with :func:`anchors`. A class of
    ``oracle.__all__`` (the gradient results ``KernelGrads``, ``AttentionGrads``, ...) holds no
    arithmetic of its own: it counts as anchored when an anchored function is annotated to return
    it (that anchor checks the result's type and every field it reads by hand)."""
    anchored = ANCHORED | _returned_classes(ANCHORED & set(oracle.__all__))
    assert set(oracle.__all__) <= anchored, sorted(set(oracle.__all__) - anchored)


@anchors("merge_states", "merge_state_stack")
def test_merge_states_by_hand():
    """Logits 0, ln 2, ln 3 (weights 1, 2, 3), values 1, 2, 3: whole lse ln 6, o (1+4+9)/6 = 7/3.
    Pieces {0,1},{2}: lse ln 3, ln 3, o 5/3, 3; pieces {0},{1,2}: lse 0, ln 5, o 1, 13/5. An empty
    piece (lse -inf, o NaN) is the identity; two empty pieces give o = 0, lse = -inf."""
    splits = (((math.log(3), 5 / 3), (math.log(3), 3.0)), ((0.0, 1.0), (math.log(5), 13 / 5)))
    for (la, oa), (lb, ob) in splits:
        o, lse = oracle.merge_states(np.array([[oa]]), np.array([la]), [[ob]], np.array([lb]))
        _close(lse, [math.log(6)])
        _close(o, [[7 / 3]])
        stack = np.array([[[oa]], [[ob]], [[np.nan]]]), np.array([[la], [lb], [-np.inf]])
        o, lse = oracle.merge_state_stack(*stack)
        _close(lse, [math.log(6)])
        _close(o, [[7 / 3]])
    o, lse = oracle.merge_states([[np.nan]], np.array([-np.inf]), [[np.nan]], np.array([-np.inf]))
    assert o[0, 0] == 0 and np.isneginf(lse[0])


@anchors("merge_states_vjp")
def test_merge_states_vjp_by_hand():
    """``o = (e^{l_a} o_a + e^{l_b} o_b) / (e^{l_a} + e^{l_b})``, ``lse = log(e^{l_a} + e^{l_b})``
    differentiated by hand: ``do/do_p = pi_p``, ``do/dl_p = pi_p (o_p - o)``, ``dlse/dl_p =
    pi_p`` with ``pi_p = e^{l_p - lse}``. States ``l_a = 0, o_a = 1`` and ``l_b = ln 2, o_b = 4``:
    ``lse = ln 3``, ``pi = (1/3, 2/3)``, ``o = 1/3 + 8/3 = 3``. With cotangents ``g_o = 1``,
    ``g_lse = 1``: ``d o_a = 1/3``, ``d o_b = 2/3``, ``d l_a = 1/3 (1 - 3) + 1/3 = -1/3``,
    ``d l_b = 2/3 (4 - 3) + 2/3 = 4/3``. An empty ``B`` (``l_b = -inf``, ``o_b`` NaN) gets 0,
    and ``A`` gets ``d o_a = g_o``, ``d l_a = g_lse``."""
    one = np.array([1.0])
    d_oa, d_la, d_ob, d_lb = oracle.merge_states_vjp(
        np.array([[1.0]]),
        np.array([0.0]),
        np.array([[4.0]]),
        np.array([math.log(2)]),
        np.array([[1.0]]),
        one,
    )
    _close(d_oa, [[1 / 3]])
    _close(d_ob, [[2 / 3]])
    _close(d_la, [-1 / 3])
    _close(d_lb, [4 / 3])
    d_oa, d_la, d_ob, d_lb = oracle.merge_states_vjp(
        np.array([[1.0]]),
        np.array([0.0]),
        np.array([[np.nan]]),
        np.array([-np.inf]),
        np.array([[2.0]]),
        np.array([5.0]),
    )
    _close(d_oa, [[2.0]])
    _close(d_la, [5.0])
    assert d_ob[0, 0] == 0.0 and d_lb[0] == 0.0


@anchors("paged_attention")
def test_paged_attention_by_hand():
    """vLLM's reading rule (``ref_single_query_cached_kv_attention``: token ``j`` from block
    ``block_table[j // block_size]`` at offset ``j % block_size``) with page size 2, table
    ``[2, 0]`` and ``seq_lens = 3``: tokens 0, 1 in page 2, token 2 in page 0 slot 0; page 0
    slot 1 and page 1 are unused (NaN). ``H = 1``, ``q = 1``, keys ``0, ln 2, ln 3`` (weights
    1, 2, 3), values 1, 2, 3: ``o = (1 + 4 + 9) / 6 = 7/3``, ``lse = ln 6``. Chunked prefill,
    ``T = 2``, causal: the queries sit at positions 1 and 2 (the last two tokens, FlashAttention's
    bottom-right alignment): ``o = (1 + 4) / 3 = 5/3``, ``lse = ln 3``, then ``7/3``, ``ln 6``."""
    k_pages = np.full((3, 2, 1, 1), np.nan)
    v_pages = np.full((3, 2, 1, 1), np.nan)
    k_pages[2, :, 0, 0], k_pages[0, 0, 0, 0] = [0.0, math.log(2)], math.log(3)
    v_pages[2, :, 0, 0], v_pages[0, 0, 0, 0] = [1.0, 2.0], 3.0
    table, lens = np.array([[2, 0]]), np.array([3])
    o, lse = oracle.paged_attention(
        np.ones((1, 1, 1, 1)), k_pages, v_pages, table, lens, return_lse=True
    )
    _close(o[0, 0, 0], [7 / 3])
    _close(lse[0, 0], [math.log(6)])
    o, lse = oracle.paged_attention(
        np.ones((1, 2, 1, 1)), k_pages, v_pages, table, lens, is_causal=True, return_lse=True
    )
    _close(o[0, :, 0, 0], [5 / 3, 7 / 3])
    _close(lse[0, :, 0], [math.log(3), math.log(6)])


def _mla_by_hand(rope: bool):
    """One head, ``d_model = d_c = d_nope = d_v = 1``: ``x = (1, 2)``, ``W_DKV = 2`` so the
    latents are ``c = (2, 4)``, ``W_UK = W_UV = W_O = 1`` (keys and values ``(2, 4)``), ``W_UQ =
    ln 2 / 2`` (queries ``(ln 2 / 2, ln 2)``). With ``rope``, ``W_KR = (1, 0)`` and ``W_QR =
    (1, 0)``: the rotated parts are ``x_t (cos p_t, sin p_t)`` (one pair, frequency
    ``base^0 = 1``), so they add ``x_t x_j cos(p_t - p_j)`` to the logits."""
    from attnref.mla import MLAParams

    return MLAParams(
        w_dkv=np.array([[2.0]]),
        w_uk=np.array([[[1.0]]]),
        w_uv=np.array([[[1.0]]]),
        w_uq=np.array([[[math.log(2) / 2]]]),
        w_o=np.array([[[1.0]]]),
        w_kr=np.array([[1.0, 0.0]]) if rope else None,
        w_qr=np.array([[[1.0, 0.0]]]) if rope else None,
    )


@anchors("mla_qkv")
def test_mla_qkv_by_hand():
    """The decompressed q, k, v of :func:`_mla_by_hand` (``[T, H, d]``): ``q = (ln 2 / 2,
    ln 2)``, ``k = v = (2, 4)``; with the RoPE part, ``q`` and ``k`` gain ``x_t (cos t,
    sin t)`` after their ``d_nope`` part (the key part shared by every head)."""
    x = np.array([[1.0], [2.0]])
    q, k, v = oracle.mla_qkv(_mla_by_hand(False), x)
    _close(q[:, 0, 0], [math.log(2) / 2, math.log(2)])
    _close(k[:, 0, 0], [2.0, 4.0])
    _close(v[:, 0, 0], [2.0, 4.0])
    q, k, v = oracle.mla_qkv(_mla_by_hand(True), x)
    rot = np.array([[1.0, 0.0], [2 * math.cos(1.0), 2 * math.sin(1.0)]])
    _close(q[:, 0], np.column_stack([[math.log(2) / 2, math.log(2)], rot]))
    _close(k[:, 0], np.column_stack([[2.0, 4.0], rot]))


@anchors("mla_attention")
def test_mla_attention_by_hand():
    """:func:`_mla_by_hand` with ``scale = 1``: token 1's logits ``(ln 2, 2 ln 2)`` weigh the
    values ``(2, 4)`` by ``(2, 4) / 6``: ``y = 10 / 3``; token 2's ``(2 ln 2, 4 ln 2)`` by
    ``(4, 16) / 20``: ``y = 18 / 5``. Causal: token 1 reads only itself, ``y = 2``. With the
    RoPE part at positions 0 and 1, token 1 adds ``1 x 1 cos 0 = 1`` and ``1 x 2 cos 1`` to its
    two logits."""
    x = np.array([[1.0], [2.0]])
    y = oracle.mla_attention(_mla_by_hand(False), x, scale=1.0)
    _close(y[:, 0], [10 / 3, 18 / 5])
    causal = np.tril(np.ones((2, 2), bool))
    y = oracle.mla_attention(_mla_by_hand(False), x, scale=1.0, mask=causal)
    _close(y[:, 0], [2.0, 18 / 5])
    y = oracle.mla_attention(_mla_by_hand(True), x, scale=1.0)
    s = np.array([math.log(2) + 1.0, 2 * math.log(2) + 2 * math.cos(1.0)])
    w = np.exp(s - s.max())
    _close(y[0, 0], float(w @ [2.0, 4.0] / w.sum()))
