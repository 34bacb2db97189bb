"""KV-cached decoding equals full causal attention at every step.

Drawn: prefill lengths, chunk sizes, ring-buffer windows (with wraparound), GQA, ragged batches
with left or right padding. The reference is the float64 oracle run on each sequence's real
tokens alone; tolerances are the derived kernel and weight-level bounds. Slots holding no token
and masked keys add exact zeros to the sums, so the bound of the unpadded problem applies.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, note
from hypothesis import strategies as st

import attnref
from attnref import oracle, tolerance
from attnref.testing import assert_within_bound

from .helpers import scaled

B, T, N, K, H, H_V = 2, 9, 4, 2, 3, 2
_CACHED = jax.jit(attnref.cached_attention)


@st.composite
def schedules(draw):
    """Chunks that cover T real tokens per sequence, with padding tokens mixed in."""
    window = draw(st.sampled_from([None, 2, 4]), label="window")
    capacity = T + 3 if window is None else window + draw(st.integers(0, 1), label="ring slack")
    prefill = draw(st.sampled_from([0, 3, 5]), label="prefill length")
    step = draw(st.sampled_from([1, 3]), label="chunk length")
    padding = draw(st.sampled_from(["none", "left", "right"]), label="padding")
    dtype = draw(st.sampled_from(["float32", "float64"]), label="dtype")
    seed = draw(st.integers(0, 2**31 - 1), label="seed")
    note(f"window={window} capacity={capacity} prefill={prefill} step={step} pad={padding}")
    return window, capacity, prefill, step, padding, np.dtype(dtype), seed


def _chunks(prefill, step, padding, rng):
    """Per chunk: a [B, L] validity mask. The prefill chunk is padded per sequence (ragged
    prompts); later chunks give each sequence a random number of real tokens."""
    done = np.zeros(B, int)
    out = []
    if prefill:
        real = rng.integers(1, prefill + 1, size=B) if padding != "none" else np.full(B, prefill)
        valid = np.zeros((B, prefill), bool)
        for b in range(B):
            if padding == "left":
                valid[b, prefill - real[b] :] = True
            else:
                valid[b, : real[b]] = True
        out.append(valid)
        done += real
    while np.any(done < T):
        valid = np.zeros((B, step), bool)
        for b in range(B):
            want = min(T - done[b], step)
            n = want if padding == "none" else int(rng.integers(0, want + 1))
            if padding == "left":
                valid[b, step - n :] = True
            else:
                valid[b, :n] = True
            done[b] += n
        out.append(valid)
    return out


@given(schedule=schedules())
@scaled(0.6)
def test_cached_decoding_equals_full_causal_attention(schedule):
    window, capacity, prefill, step, padding, dtype, seed = schedule
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, N, H)).astype(dtype)
    k = rng.standard_normal((B, T, K, H)).astype(dtype)
    v = rng.standard_normal((B, T, K, H_V)).astype(dtype)
    cache = attnref.kv_cache_init(B, capacity, K, H, H_V, window=window, dtype=dtype)
    got = np.zeros((B, T, N, H_V))
    taken = np.zeros(B, int)
    for valid in _chunks(prefill, step, padding, rng):
        length = valid.shape[1]
        idx = np.zeros((B, length), int)  # which real token each chunk slot carries
        for b in range(B):
            n = int(valid[b].sum())
            idx[b, valid[b]] = np.arange(taken[b], taken[b] + n)
        take = np.clip(idx, 0, T - 1)
        cq, ck, cv = (np.take_along_axis(a, take[:, :, None, None], 1) for a in (q, k, v))
        cq, ck, cv = (
            np.where(valid[:, :, None, None], a, np.nan).astype(dtype) for a in (cq, ck, cv)
        )  # padding tokens carry NaN: they must not leak
        out, cache = _CACHED(cache, cq, ck, cv, valid)
        out = np.asarray(out, np.float64)
        assert not np.any(np.isnan(out))
        for b in range(B):
            got[b, idx[b, valid[b]]] = out[b, valid[b]]
            assert np.all(out[b, ~valid[b]] == 0.0)
            taken[b] += int(valid[b].sum())
    np.testing.assert_array_equal(np.asarray(cache.lengths), np.full(B, T))
    window_kw = None if window is None else (window - 1, 0)
    ref = oracle.dot_product_attention(q, k, v, is_causal=True, local_window_size=window_kw)
    allowed = oracle.kernel_allowed((B, N, T, T), is_causal=True, local_window_size=window_kw)
    bound, _ = tolerance.kernel_error_bound(q, k, v, allowed, dtype=dtype, key_blocks=1)
    assert np.all(np.abs(got - ref) <= bound), np.max(np.abs(got - ref) - bound)


def _params(dtype, kv_heads=2):
    return attnref.init_params(
        3, d_model=8, num_heads=4, num_kv_heads=kv_heads, d_k=3, d_v=2, bias=True, dtype=dtype
    )


class MultiheadDecodeTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @pytest.mark.filterwarnings("ignore")
    def test_decode_scan_equals_causal_attention(self):
        """Project, append, attend, one token per ``lax.scan`` step, with GQA parameters and
        ragged right padding; each sequence equals causal attention over its real tokens."""
        for dtype in (np.float32, np.float64):
            params = _params(dtype)
            rng = np.random.default_rng(1)
            xs = rng.standard_normal((2, 6, 8)).astype(dtype)
            valid = np.arange(6)[None, :] < np.array([[6], [4]])
            cache = attnref.mha_cache_init(params, 2, 6)
            fn = self.variant(attnref.mha_decode_scan)
            ys, cache = fn(params, cache, xs, valid)
            for b, n in enumerate((6, 4)):
                mask = np.tril(np.ones((n, n), bool))
                ref = oracle.attention(params, xs[b, :n], mask=mask)
                bound = tolerance.attention_error_bound(params, xs[b, :n], mask=mask, dtype=dtype)
                assert_within_bound(np.asarray(ys)[b, :n], ref, bound, label=f"decode {b}")
                assert np.all(np.asarray(ys)[b, n:] == 0.0)


def test_generation_with_lax_scan():
    """``x_{t+1} = tanh(x_t + y_t)`` fed back for 7 steps from one prompt token: the outputs
    equal causal attention over the generated inputs, recomputed from scratch."""
    params = _params(np.float64, kv_heads=1)  # MQA
    x0 = np.random.default_rng(2).standard_normal((2, 8))
    cache = attnref.mha_cache_init(params, 2, 7)
    gen = jax.jit(attnref.mha_generate, static_argnames=("steps", "next_input"))
    xs, ys, cache = gen(params, cache, x0, 7, lambda x, y: jnp.tanh(x + y))
    xs, ys = np.asarray(xs), np.asarray(ys)
    np.testing.assert_array_equal(xs[:, 0], x0)
    mask = np.tril(np.ones((7, 7), bool))
    ref = oracle.attention(params, xs, mask=mask)
    bound = tolerance.attention_error_bound(params, xs, mask=mask, dtype=np.float64)
    assert_within_bound(ys, ref, bound, label="generate")
    np.testing.assert_array_equal(np.asarray(cache.lengths), [7, 7])


def test_decode_gradient_to_future_inputs_is_zero():
    params = _params(np.float64)
    xs = np.random.default_rng(4).standard_normal((1, 5, 8))

    def y_t(xs, t):
        cache = attnref.mha_cache_init(params, 1, 5)
        return jnp.sum(jnp.sin(attnref.mha_decode_scan(params, cache, xs)[0][:, t]))

    grad = jax.jit(jax.grad(y_t))  # t traced: one compile serves every t
    for t in (0, 2, 4):
        g = np.asarray(grad(xs, t))
        assert np.all(g[:, t + 1 :] == 0.0) and np.any(g[:, : t + 1] != 0.0)


def test_ring_buffer_wraps_around_and_keeps_positions():
    """After 7 one-token steps a 3-slot ring holds positions 4, 5, 6 in slots 1, 2, 0."""
    cache = attnref.kv_cache_init(1, 3, 1, 2, window=3, dtype=jnp.float32)
    for t in range(7):
        x = np.full((1, 1, 1, 2), float(t), np.float32)
        _, cache = _CACHED(cache, x, x, x)
    np.testing.assert_array_equal(np.asarray(cache.positions), [[6, 4, 5]])
    np.testing.assert_array_equal(np.asarray(cache.k)[0, :, 0, 0], [6.0, 4.0, 5.0])


def test_decode_errors():
    cache = attnref.kv_cache_init(2, 4, 2, 3, dtype=jnp.float32)
    x = np.zeros((2, 5, 2, 3), np.float32)
    q = np.zeros((2, 5, 4, 3), np.float32)
    with pytest.raises(ValueError, match="capacity 4"):
        attnref.cached_attention(cache, q, x, x)
    with pytest.raises(ValueError, match="no larger than capacity"):
        attnref.kv_cache_init(2, 4, 2, 3, window=5)
    with pytest.raises(ValueError, match="key chunk"):
        attnref.cached_attention(cache, q[:, :2], x[:, :2, :1], x[:, :2])
    with pytest.raises(ValueError, match="query chunk"):
        attnref.cached_attention(cache, q[:, :2, :3], x[:, :2], x[:, :2])
    with pytest.raises(ValueError, match="valid"):
        attnref.cached_attention(cache, q[:, :2], x[:, :2], x[:, :2], np.ones((2, 3), bool))
    with pytest.raises(ValueError, match="T_q"):
        attnref.decode_multihead(
            _params(np.float32), np.zeros((4, 8), np.float32), np.zeros((5, 8), np.float32)
        )
