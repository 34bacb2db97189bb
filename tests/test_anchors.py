"""Anchors: every function of ``attnref.oracle`` against an outside truth.

The JAX code and the oracle are written independently, but both could share one mistaken
convention (RoPE's rotation direction, ALiBi's slopes for odd head counts, which key a causal
window keeps). So each oracle function is pinned here to values worked out by hand from the
published formulas (the arithmetic is in the comments) or to an outside implementation with the
same convention (``jax.nn.dot_product_attention``). ``ANCHORED`` lists the function each test
anchors; ``test_every_oracle_function_has_an_anchor`` fails for a new oracle function without
one. The table is in ``docs/tolerances.md`` ("Anchors").

Tolerance: the hand values are float64 literals of closed forms (``cos 1``, ``e^-1``,
``sigmoid(1/sqrt 2)``), each at most a few roundings from exact, and the oracle evaluates the same
closed forms in float64 with at most ``T + d + 10`` roundings on any chain here (``T, d <= 4``), so
``rtol = atol = 64 u_64 ~ 7e-15`` covers both with room (``gamma_32 ~ 3.6e-15``); a wrong
convention moves a value by ``> 1e-2``.
"""

from __future__ import annotations

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
    theta_0 = 1 and theta_1 = 0.01. Su et al. (2021), eq. 34, and the rotate-half form of
    GPT-NeoX / Hugging Face: x R = x cos + rotate_half(x) sin, rotate_half(x) = [-x_3, -x_4, x_1,
    x_2], i.e. pairs (x_p, x_{p + d/2}) rotated counter-clockwise: (a, b) -> (a cos - b sin,
    b cos + a sin). Interleaved (the paper's and Meta LLaMA's layout): pairs (x_{2p}, x_{2p+1})."""
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


def test_every_oracle_function_has_an_anchor():
    assert set(oracle.__all__) <= ANCHORED, sorted(set(oracle.__all__) - ANCHORED)
