"""ALiBi as FlashAttention uses it: slopes ``[N]`` or ``[B, N]``, and under ``"bottom_right"`` the
offset ``S_b - T_b`` from each sequence's actual lengths.

Anchor: FlashAttention's reference formula (Dao-AILab/flash-attention, tests/test_flash_attn.py,
``attn_bias_from_alibi_slopes``, as ``attention_ref`` uses it with query/key padding masks;
flash_attn/flash_attn_interface.py, ``flash_attn_func``'s docstring: "(-alibi_slope * |i +
seqlen_k - seqlen_q - j|) is added"), transcribed to NumPy below, independently of attnref's two
twins. Tolerances: exact where both sides compute the same single IEEE product; otherwise derived
next to each assertion (:mod:`attnref.tolerance`).
"""

from __future__ import annotations

from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import attnref
from attnref import oracle, tolerance
from attnref import strategies as ast

U32 = tolerance.unit_roundoff(np.float32)
U64 = tolerance.unit_roundoff(np.float64)
# (B, T, S): T < S (positive offsets) and T > S (negative offsets, rows with no causal key).
SHAPES = ((3, 5, 7), (2, 6, 4))
N_HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8
STATIC = ast.STATIC_OPTIONS
_ALIBI_STATIC = ("t", "s", "causal_alignment", "dtype")
_ALIBI = jax.jit(attnref.alibi_bias, static_argnames=_ALIBI_STATIC)


def fa_attn_bias_from_alibi_slopes(
    slopes: np.ndarray,
    seqlen_q: int,
    seqlen_k: int,
    query_padding_mask: np.ndarray | None = None,
    key_padding_mask: np.ndarray | None = None,
    causal: bool = False,
) -> np.ndarray:
    """NumPy transcription of FlashAttention's ``attn_bias_from_alibi_slopes``
    (Dao-AILab/flash-attention, tests/test_flash_attn.py), without ``key_leftpad`` (attnref has
    no left-padded cache). ``slopes [B, N]``; padding masks ``[B, T]``/``[B, S]``, True = valid."""
    slopes = slopes[:, :, None, None]  # "b h -> b h 1 1"
    if causal:
        return np.arange(-seqlen_k + 1, 1, dtype=np.float32) * slopes
    row_idx = np.arange(seqlen_q)[:, None]
    col_idx = np.arange(seqlen_k)
    sk = seqlen_k if key_padding_mask is None else key_padding_mask.sum(-1)[:, None, None, None]
    sq = seqlen_q if query_padding_mask is None else query_padding_mask.sum(-1)[:, None, None, None]
    relative_pos = np.abs(row_idx + sk - sq - col_idx)
    return -slopes * relative_pos.astype(slopes.dtype)


def _padding_mask(lengths: np.ndarray, size: int) -> np.ndarray:
    """FlashAttention's ``generate_random_padding_mask`` form: ``arange(size) < lengths``."""
    return np.arange(size)[None, :] < lengths[:, None]


@st.composite
def cases(draw: Any, shapes: tuple[tuple[int, int, int], ...] = SHAPES) -> dict[str, Any]:
    """One of :data:`SHAPES`, per-batch slopes (FlashAttention draws ``rand * 0.3``; wider here
    so a wrong offset moves the output) and ragged lengths in ``[0, T]`` / ``[0, S]``."""
    b, t, s = draw(st.sampled_from(shapes))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    return {
        "b": b,
        "t": t,
        "s": s,
        "slopes": rng.uniform(0.0, 1.0, (b, N_HEADS)),
        "q_len": rng.integers(0, t + 1, b).astype(np.int32),
        "kv_len": rng.integers(0, s + 1, b).astype(np.int32),
        "rng": rng,
    }


def _kw(c: dict[str, Any]) -> dict[str, Any]:
    return {
        "causal_alignment": "bottom_right",
        "query_seq_lengths": c["q_len"],
        "key_value_seq_lengths": c["kv_len"],
    }


# ----------------------------------------------------------------------------- the anchor


class AnchorTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @given(c=cases())
    def test_equals_flash_attention_reference(self, c):
        """Per-batch slopes and ragged lengths: both twins equal FlashAttention's non-causal
        formula with its padding masks, exactly in float64 (every side computes the one IEEE
        product ``-m * |i + S_b - T_b - j|`` of the same operands, the distance an exact
        integer); the float32 JAX bias within ``gamma_3(u32) |ref|`` (slope cast and product:
        two float32 roundings, plus the reference's one float64 rounding)."""
        ref = fa_attn_bias_from_alibi_slopes(
            c["slopes"],
            c["t"],
            c["s"],
            _padding_mask(c["q_len"], c["t"]),
            _padding_mask(c["kv_len"], c["s"]),
        )
        ours = oracle.alibi_bias(c["slopes"], c["t"], c["s"], **_kw(c))
        assert ours.shape == (c["b"], N_HEADS, c["t"], c["s"])
        np.testing.assert_array_equal(ours, ref)
        fn = self.variant(attnref.alibi_bias, static_argnames=_ALIBI_STATIC)
        got64 = fn(c["slopes"], c["t"], c["s"], dtype=jnp.float64, **_kw(c))
        assert got64.dtype == jnp.float64
        np.testing.assert_array_equal(np.asarray(got64), ref)
        got32 = fn(c["slopes"], c["t"], c["s"], dtype=jnp.float32, **_kw(c))
        assert got32.dtype == jnp.float32
        err = np.abs(np.asarray(got32, np.float64) - ref)
        assert np.all(err <= tolerance.gamma(3, U32) * np.abs(ref))


@pytest.mark.parametrize("twin", ["oracle", "jax"])
@pytest.mark.parametrize(("b", "t", "s"), SHAPES)
def test_without_lengths_and_shared_slopes(twin, b, t, s):
    """Without lengths, bottom_right is FlashAttention's fixed ``seqlen_k - seqlen_q`` and
    top_left its ``|i - j|`` (flash_attn_qkvpacked_func's docstring); slopes ``[N]`` give
    ``[1, N, T, S]`` (the call the strategies make, unchanged), ``[B, N]`` give ``[B, N, T, S]``.
    Exact (one product of the same operands)."""
    fn = oracle.alibi_bias if twin == "oracle" else _jax64
    slopes = np.random.default_rng(b * 100 + t).uniform(0.0, 1.0, (b, N_HEADS))
    ref = fa_attn_bias_from_alibi_slopes(slopes, t, s)
    shared = fn(slopes[0], t, s, causal_alignment="bottom_right")
    assert shared.shape == (1, N_HEADS, t, s)
    np.testing.assert_array_equal(np.asarray(shared)[0], ref[0])
    np.testing.assert_array_equal(
        np.asarray(fn(slopes, t, s, causal_alignment="bottom_right")), ref
    )
    top_left = np.asarray(fn(slopes, t, s))
    hand = -slopes[:, :, None, None] * np.abs(np.arange(t)[:, None] - np.arange(s))
    np.testing.assert_array_equal(top_left, hand)
    # lengths never move top_left's offset (as in the kernel), but give a batch axis
    lens = np.full(b, min(t, s) // 2, np.int32)
    with_lens = np.asarray(fn(slopes[0], t, s, query_seq_lengths=lens))
    assert with_lens.shape == (b, N_HEADS, t, s)
    np.testing.assert_array_equal(with_lens, np.broadcast_to(hand[:1], with_lens.shape))


def _jax64(slopes: Any, t: int, s: int, **kw: Any) -> Any:
    return _ALIBI(slopes, t, s, dtype=jnp.float64, **kw)


@given(c=cases())
def test_causal_branch_differs_by_a_row_constant(c):
    """FlashAttention's causal branch, ``m (j - (S - 1))``, drops the row's position: on every
    allowed key (``j <= p_i = i + S_b - T_b``), ``-m |p_i - j| = m (j - p_i)`` exceeds it by
    ``m (S - 1 - p_i)``, a constant per (batch, head, query) that softmax ignores. Dyadic
    slopes ``k / 64`` make every product exact, so the constant is checked exactly; the two
    attention outputs then agree within twice the float64 oracle's own bound."""
    slopes = np.floor(c["slopes"] * 64) / 64
    b, t, s = c["b"], c["t"], c["s"]
    fa = fa_attn_bias_from_alibi_slopes(slopes, t, s, causal=True)
    ours = oracle.alibi_bias(slopes, t, s, **_kw(c))
    lens = {"query_seq_lengths": c["q_len"], "key_value_seq_lengths": c["kv_len"]}
    allowed = oracle.kernel_allowed(
        (b, N_HEADS, t, s), is_causal=True, causal_alignment="bottom_right", **lens
    )
    p = np.arange(t)[None, :] + (c["kv_len"] - c["q_len"])[:, None]  # [B, T]
    constant = slopes[:, :, None] * (s - 1 - p)[:, None, :]  # [B, N, T]
    diff = ours - np.broadcast_to(fa, ours.shape)  # ours = FlashAttention's + constant
    np.testing.assert_array_equal(
        np.where(allowed, diff, 0.0), np.where(allowed, constant[..., None], 0.0)
    )
    rng = c["rng"]
    q = rng.standard_normal((b, t, N_HEADS, HEAD_DIM))
    k = rng.standard_normal((b, s, KV_HEADS, HEAD_DIM))
    v = rng.standard_normal((b, s, KV_HEADS, HEAD_DIM))
    opts = {"is_causal": True, "causal_alignment": "bottom_right", **lens}
    out_fa = oracle.dot_product_attention(q, k, v, bias=np.broadcast_to(fa, ours.shape), **opts)
    out = oracle.dot_product_attention(q, k, v, bias=ours, **opts)
    # each is within kernel_error_bound's float64 term of the exact (equal) result
    b_fa, _ = tolerance.kernel_call_error_bound(
        q, k, v, bias=np.broadcast_to(fa, ours.shape), dtype=np.float64, **opts
    )
    b_ours, _ = tolerance.kernel_call_error_bound(q, k, v, bias=ours, dtype=np.float64, **opts)
    assert np.all(np.abs(out_fa - out) <= b_fa + b_ours)


# ----------------------------------------------------------------------------- end to end


def _alibi_attention(q, k, v, slopes, q_len, kv_len, *, is_causal):
    """The per-batch ALiBi bias from the JAX helper, into the JAX kernel (same lengths)."""
    lens = {"query_seq_lengths": q_len, "key_value_seq_lengths": kv_len}
    bias = attnref.alibi_bias(
        slopes, q.shape[1], k.shape[1], causal_alignment="bottom_right", dtype=q.dtype, **lens
    )
    out, lse = attnref.dot_product_attention(
        q, k, v, bias=bias, is_causal=is_causal, causal_alignment="bottom_right",
        return_lse=True, **lens,
    )  # fmt: skip
    return out, lse, bias


def _qkv(c: dict[str, Any], dtype: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = c["rng"]
    b, t, s = c["b"], c["t"], c["s"]
    return (
        rng.standard_normal((b, t, N_HEADS, HEAD_DIM)).astype(dtype),
        rng.standard_normal((b, s, KV_HEADS, HEAD_DIM)).astype(dtype),
        rng.standard_normal((b, s, KV_HEADS, HEAD_DIM)).astype(dtype),
    )


E2E = {"c": cases(), "is_causal": st.booleans()}
# The gradient (one more compile per shape and flag) on the first shape only.
GRAD = {"c": cases(SHAPES[:1]), "is_causal": st.booleans()}
DTYPES = st.sampled_from([np.float32, np.float64])
# Eager (op by op) calls cost ~1 s each: the no-jit variants draw 2 examples.
EAGER = settings(max_examples=2)


class EndToEndTest(chex.TestCase):
    @chex.variants(with_jit=True)
    @given(dtype=DTYPES, **E2E)
    def test_kernel_with_alibi_matches_oracle(self, c, is_causal, dtype):
        self._check_kernel(c, is_causal, dtype)

    @chex.variants(without_jit=True)
    @EAGER
    @given(dtype=DTYPES, **E2E)
    def test_kernel_with_alibi_matches_oracle_eagerly(self, c, is_causal, dtype):
        self._check_kernel(c, is_causal, dtype)

    def _check_kernel(self, c, is_causal, dtype):
        """``dot_product_attention`` with the JAX per-batch ALiBi bias and ragged lengths
        (bottom_right) equals the float64 oracle with the oracle's bias.

        Bound: the kernel is within :func:`attnref.tolerance.kernel_call_error_bound` of the
        oracle given the kernel's own bias ``b'``; the oracle's bias ``b`` differs by ``d = b' -
        b`` (zero in float64, checked; exact to compute in float32, Sterbenz). A logit
        perturbation with ``E_i = max_{j allowed} |d_ij|`` moves each weight by at most
        ``p_ij (exp(2 E_i) - 1)``, so ``o_i`` by ``(exp(2 E_i) - 1) sum_j p_ij |v_j|`` and
        ``lse_i`` by ``E_i``; ``sum_j p_ij |v_j|`` is the oracle run on ``|v|``, plus its own
        float64 bound."""
        q, k, v = _qkv(c, dtype)
        fn = self.variant(_alibi_attention, static_argnames=("is_causal",))
        out, lse, bias_jax = fn(q, k, v, c["slopes"], c["q_len"], c["kv_len"], is_causal=is_causal)
        assert out.dtype == dtype
        bias = oracle.alibi_bias(c["slopes"], c["t"], c["s"], **_kw(c))
        opts = {"is_causal": is_causal, **_kw(c)}
        ref, ref_lse = oracle.dot_product_attention(q, k, v, bias=bias, return_lse=True, **opts)
        b_jax = np.asarray(bias_jax, np.float64)
        if dtype == np.float64:
            np.testing.assert_array_equal(b_jax, bias)
        bound, lse_bound = tolerance.kernel_call_error_bound(
            q, k, v, bias=b_jax, dtype=dtype, key_blocks=1, **opts
        )
        allowed = oracle.kernel_allowed((c["b"], N_HEADS, c["t"], c["s"]), **opts)
        e = np.max(np.where(allowed, np.abs(b_jax - bias), 0.0), axis=-1, initial=0.0)  # [B,N,T]
        e = np.swapaxes(e, 1, 2)  # [B, T, N]
        pv = oracle.dot_product_attention(q, k, np.abs(v), bias=bias, **opts)
        pv_bound, _ = tolerance.kernel_call_error_bound(
            q, k, np.abs(v), bias=bias, dtype=np.float64, **opts
        )
        bound = bound + np.expm1(2 * e)[..., None] * (pv + pv_bound)
        assert np.all(np.abs(np.asarray(out, np.float64) - ref) <= bound)
        lse = np.asarray(lse, np.float64)
        np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
        fin = np.isfinite(ref_lse)
        lerr = np.abs(np.where(fin, lse, 0.0) - np.where(fin, ref_lse, 0.0))
        assert np.all(lerr[fin] <= (lse_bound + e)[fin])

    @chex.variants(with_jit=True)
    @given(**GRAD)
    def test_gradient_wrt_slopes(self, c, is_causal):
        self._check_gradient(c, is_causal)

    @chex.variants(without_jit=True)
    @EAGER
    @given(**GRAD)
    def test_gradient_wrt_slopes_eagerly(self, c, is_causal):
        self._check_gradient(c, is_causal)

    def _check_gradient(self, c, is_causal):
        """``jax.grad`` reaches the per-batch slopes: ``dL/dm[b, n] = -sum_ij g_bnij |p_i - j|``
        with ``g`` the bias cotangent, here from the float64 gradient oracle
        (:func:`attnref.oracle.dot_product_attention_vjp`). Bound: ``sum_ij G_bnij d_ij`` (``G``:
        :func:`attnref.tolerance.kernel_grad_error_bound` of ``g``, ``d``: the exact distance)
        plus the two float64 sums of ``T S`` products, ``2 gamma_{TS+1} sum_ij (|g| + G) d``."""
        q, k, v = _qkv(c, np.float64)
        cot = c["rng"].standard_normal((*q.shape[:3], HEAD_DIM))

        def loss(slopes):
            out, _, _ = _alibi_attention(
                q, k, v, slopes, c["q_len"], c["kv_len"], is_causal=is_causal
            )
            return jnp.sum(out * cot)

        got = np.asarray(self.variant(jax.grad(loss))(jnp.asarray(c["slopes"])))
        assert got.shape == c["slopes"].shape and np.all(np.isfinite(got))
        bias = oracle.alibi_bias(c["slopes"], c["t"], c["s"], **_kw(c))
        opts = {"is_causal": is_causal, **_kw(c)}
        g = oracle.dot_product_attention_vjp(q, k, v, bias=bias, cotangent=cot, **opts).bias
        big_g = tolerance.kernel_grad_error_bound(
            q, k, v, bias=bias, cotangent=cot, dtype=np.float64, **opts
        ).bias
        d = oracle.alibi_bias(np.ones_like(c["slopes"]), c["t"], c["s"], **_kw(c)) * -1.0
        want = -np.sum(g * d, axis=(2, 3))
        n_terms = c["t"] * c["s"] + 1
        allowed = np.sum(big_g * d, axis=(2, 3)) + 2 * tolerance.gamma(n_terms, U64) * np.sum(
            (np.abs(g) + big_g) * d, axis=(2, 3)
        )
        assert np.all(np.abs(got - want) <= allowed)
        # it flows: some slope with a live query row has a non-zero gradient
        assert np.any(want != 0.0) == np.any(got != 0.0)


# ----------------------------------------------------------------------------- errors


def test_traced_lengths_out_of_range_give_nan_and_checked_raises():
    """Under ``jax.jit`` the lengths cannot be checked at trace time: the batch element whose
    length is out of range gets a NaN bias (never a plausible number), the others are exact;
    :func:`attnref.checked` raises, naming the argument."""
    slopes = np.array([[0.5, 0.25], [0.125, 1.0]])
    bad = jnp.array([3, 9], jnp.int32)
    got = np.asarray(_ALIBI(slopes, 5, 7, causal_alignment="bottom_right", query_seq_lengths=bad))
    assert np.all(np.isnan(got[1])) and not np.any(np.isnan(got[0]))
    ref = oracle.alibi_bias(
        slopes, 5, 7, causal_alignment="bottom_right", query_seq_lengths=np.array([3, 5])
    )
    np.testing.assert_array_equal(got[0], ref[0].astype(np.float32))
    with pytest.raises(ValueError, match="query_seq_lengths"):
        attnref.checked(_ALIBI)(
            slopes, 5, 7, causal_alignment="bottom_right", query_seq_lengths=bad
        )


BAD = [
    ({"slopes": np.ones((2, 3, 4))}, ValueError, r"slopes must have shape \[N\] or \[B, N\]"),
    ({"slopes": np.ones(())}, ValueError, r"slopes must have shape .* got shape \(\)"),
    ({"slopes": np.array([True, False])}, TypeError, "slopes must be real"),
    ({"query_seq_lengths": np.array([1, 2])}, ValueError, r"B disagrees .* \(3, 2\) .* \(2,\)"),
    (
        {"slopes": np.ones(2), "query_seq_lengths": [1], "key_value_seq_lengths": [1, 2]},
        ValueError,
        "B disagrees between query_seq_lengths",
    ),
    ({"query_seq_lengths": np.array([1, 2, 6])}, ValueError, r"query_seq_lengths .* \[0, 5\]"),
    ({"key_value_seq_lengths": np.array([-1, 2, 3])}, ValueError, r"\[0, 7\]"),
    ({"key_value_seq_lengths": np.ones((1, 3), int)}, ValueError, r"shape \[B\], got .*\(1, 3\)"),
    ({"query_seq_lengths": np.ones(3)}, TypeError, "query_seq_lengths must be integer"),
    ({"t": -1}, ValueError, "t must be an int >= 0"),
    ({"s": 2.5}, ValueError, "s must be an int >= 0"),
    ({"causal_alignment": "bottom-right"}, ValueError, "causal_alignment must be one of"),
]


@pytest.mark.parametrize("twin", ["oracle", "jax"])
@pytest.mark.parametrize(("change", "error", "match"), BAD)
@pytest.mark.usefixtures("unchecked_annotations")
def test_bad_arguments_raise_alike(twin, change, error, match):
    """Both twins refuse the same inputs with the same exception type, naming the argument
    and its shape or value (eagerly; under jit the shapes are checked at trace time)."""
    call = {"slopes": np.ones((3, 2)), "t": 5, "s": 7, "causal_alignment": "bottom_right"}
    call.update(change)
    fn = oracle.alibi_bias if twin == "oracle" else attnref.alibi_bias
    with pytest.raises(error, match=match):
        fn(call.pop("slopes"), call.pop("t"), call.pop("s"), **call)


@pytest.mark.usefixtures("unchecked_annotations")
def test_shapes_are_checked_under_jit_and_dtype_must_be_floating():
    with pytest.raises(ValueError, match="B disagrees"):
        _ALIBI(np.ones((3, 2)), 5, 7, query_seq_lengths=jnp.zeros(2, jnp.int32))
    with pytest.raises(TypeError, match="dtype must be a floating dtype"):
        attnref.alibi_bias(np.ones(2), 5, 7, dtype=jnp.int32)
