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
_CACHED = jax.jit(attnref.decode.cached_attention)
_APPEND = jax.jit(attnref.decode.kv_cache_append)
_ATTEND = jax.jit(attnref.decode.cache_attend)
_DECODE_SCAN = jax.jit(attnref.decode.scan)
RINGS = ((2, 3), (3, 5))  # (window, capacity) pairs: window < capacity, both wrap within T tokens


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


def _feed(cache, q, k, v, chunks, mask=None, bias=None):
    """Feed the real tokens of ``q, k, v`` ``[B, T, ...]`` chunk by chunk (NaN in padding slots)
    through the jitted :func:`attnref.decode.cached_attention`; ``mask``/``bias`` ``[B, T, T]``
    are by
    (query token, absolute key position). Returns the outputs ``[B, T, N, H_v]`` per real token
    and the final cache."""
    dtype = q.dtype
    got = np.zeros((B, T, N, H_V))
    taken = np.zeros(B, int)
    for valid in chunks:
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
        rows = {}
        if mask is not None:  # a padding query's row is all True: it must still attend nothing
            rows["mask"] = np.where(
                valid[:, :, None], np.take_along_axis(mask, take[..., None], 1), True
            )
        if bias is not None:
            rows["bias"] = np.where(
                valid[:, :, None], np.take_along_axis(bias, take[..., None], 1), np.nan
            ).astype(dtype)
        out, cache = _CACHED(cache, cq, ck, cv, valid, **rows)
        out = np.asarray(out, np.float64)
        assert not np.any(np.isnan(out))
        for b in range(B):
            got[b, idx[b, valid[b]]] = out[b, valid[b]]
            assert np.all(out[b, ~valid[b]] == 0.0)
            taken[b] += int(valid[b].sum())
    np.testing.assert_array_equal(np.asarray(cache.lengths), np.full(B, T))
    return got, cache


@given(schedule=schedules())
@scaled(0.6)
def test_cached_decoding_equals_full_causal_attention(schedule):
    window, capacity, prefill, step, padding, dtype, seed = schedule
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, N, H)).astype(dtype)
    k = rng.standard_normal((B, T, K, H)).astype(dtype)
    v = rng.standard_normal((B, T, K, H_V)).astype(dtype)
    cache = attnref.decode.kv_cache_init(B, capacity, K, H, H_V, window=window, dtype=dtype)
    got, _ = _feed(cache, q, k, v, _chunks(prefill, step, padding, rng))
    window_kw = None if window is None else (window - 1, 0)
    ref = oracle.dot_product_attention(q, k, v, is_causal=True, local_window_size=window_kw)
    allowed = oracle.kernel_allowed((B, N, T, T), is_causal=True, local_window_size=window_kw)
    bound, _ = tolerance.kernel_error_bound(q, k, v, allowed, dtype=dtype, key_blocks=1)
    assert np.all(np.abs(got - ref) <= bound), np.max(np.abs(got - ref) - bound)


@st.composite
def ring_schedules(draw):
    """Ring buffers that wrap (T = 9 tokens, capacity <= 5), fed in chunks of one drawn length:
    2 (with left padding, 0 to 2 real tokens per step) or 6 (longer than the ring, which keeps
    only its last C tokens). One compile per (ring, chunk length)."""
    window, capacity = draw(st.sampled_from(RINGS), label="(window, capacity)")
    step = draw(st.sampled_from([2, 6]), label="chunk length")
    padding = draw(st.sampled_from(["none", "left"]), label="padding")
    seed = draw(st.integers(0, 2**31 - 1), label="seed")
    note(f"window={window} capacity={capacity} step={step} pad={padding}")
    return window, capacity, step, padding, seed


@given(schedule=ring_schedules())
@scaled(0.5)
def test_ring_buffer_with_mask_and_bias_after_wraparound(schedule):
    """A wrapped ring with a mask and a bias indexed by absolute key position equals the oracle
    with the same local window, ``local_window_size=(W - 1, 0)``, and the same mask and bias.
    The cached sum visits the same allowed keys in another order, with exact zeros for empty or
    disallowed slots, so the unblocked kernel bound (``key_blocks=1``) applies."""
    window, capacity, step, padding, seed = schedule
    rng = np.random.default_rng(seed)
    dtype = np.dtype(np.float32)
    q = rng.standard_normal((B, T, N, H)).astype(dtype)
    k = rng.standard_normal((B, T, K, H)).astype(dtype)
    v = rng.standard_normal((B, T, K, H_V)).astype(dtype)
    mask = rng.random((B, T, T)) < 0.75  # some rows lose every key of their window: zero rows
    bias = rng.standard_normal((B, T, T)).astype(dtype)
    cache = attnref.decode.kv_cache_init(B, capacity, K, H, H_V, window=window, dtype=dtype)
    got, cache = _feed(cache, q, k, v, _chunks(0, step, padding, rng), mask, bias)
    assert np.all(np.asarray(cache.positions) >= T - capacity)  # the ring did wrap
    kw = dict(is_causal=True, local_window_size=(window - 1, 0))
    ref = oracle.dot_product_attention(q, k, v, bias[:, None], mask[:, None], **kw)
    allowed = oracle.kernel_allowed((B, N, T, T), mask=mask[:, None], **kw)
    bound, _ = tolerance.kernel_error_bound(
        q, k, v, allowed, bias[:, None], dtype=dtype, key_blocks=1
    )
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
            cache = attnref.decode.init_cache(params, 2, 6)
            fn = self.variant(attnref.decode.scan)
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
    cache = attnref.decode.init_cache(params, 2, 7)
    gen = jax.jit(attnref.decode.generate, static_argnames=("steps", "next_input"))
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
        cache = attnref.decode.init_cache(params, 1, 5)
        return jnp.sum(jnp.sin(attnref.decode.scan(params, cache, xs)[0][:, t]))

    grad = jax.jit(jax.grad(y_t))  # t traced: one compile serves every t
    for t in (0, 2, 4):
        g = np.asarray(grad(xs, t))
        assert np.all(g[:, t + 1 :] == 0.0) and np.any(g[:, : t + 1] != 0.0)


def test_ring_buffer_wraps_around_and_keeps_positions():
    """After 7 one-token steps a 3-slot ring holds positions 4, 5, 6 in slots 1, 2, 0."""
    cache = attnref.decode.kv_cache_init(1, 3, 1, 2, window=3, dtype=jnp.float32)
    for t in range(7):
        x = np.full((1, 1, 1, 2), float(t), np.float32)
        _, cache = _CACHED(cache, x, x, x)
    np.testing.assert_array_equal(np.asarray(cache.positions), [[6, 4, 5]])
    np.testing.assert_array_equal(np.asarray(cache.k)[0, :, 0, 0], [6.0, 4.0, 5.0])


@pytest.mark.usefixtures("unchecked_annotations")  # checks attnref's own errors
def test_decode_errors():
    cache = attnref.decode.kv_cache_init(2, 4, 2, 3, dtype=jnp.float32)
    x = np.zeros((2, 5, 2, 3), np.float32)
    q = np.zeros((2, 5, 4, 3), np.float32)
    with pytest.raises(ValueError, match="capacity 4"):
        attnref.decode.cached_attention(cache, q, x, x)
    with pytest.raises(ValueError, match="no larger than capacity"):
        attnref.decode.kv_cache_init(2, 4, 2, 3, window=5)
    with pytest.raises(ValueError, match="key chunk"):
        attnref.decode.cached_attention(cache, q[:, :2], x[:, :2, :1], x[:, :2])
    with pytest.raises(ValueError, match="query chunk"):
        attnref.decode.cached_attention(cache, q[:, :2, :3], x[:, :2], x[:, :2])
    with pytest.raises(ValueError, match="valid"):
        attnref.decode.cached_attention(cache, q[:, :2], x[:, :2], x[:, :2], np.ones((2, 3), bool))
    with pytest.raises(ValueError, match="T_q"):
        attnref.decode.decode_attention(
            _params(np.float32), np.zeros((4, 8), np.float32), np.zeros((5, 8), np.float32)
        )


@given(ring=st.sampled_from(RINGS), seed=st.integers(0, 2**31 - 1))
@scaled(0.5)
def test_cache_attend_after_wraparound_with_mask_and_bias(ring, seed):
    """The ``kv_cache`` entry's path (append a whole sequence, then read it with
    ``cache_attend``) on a ring that wrapped: a query at position ``p`` whose window
    ``p - W < j <= p`` lies inside the ring's last ``C`` tokens equals the oracle row with
    ``local_window_size=(W - 1, 0)`` and the same mask and bias (unblocked kernel bound, as
    above); every other query needs an overwritten key and is a NaN row under ``jax.jit``."""
    window, capacity = ring
    rng = np.random.default_rng(seed)
    dtype = np.dtype(np.float32)
    q = rng.standard_normal((B, T, N, H)).astype(dtype)
    k = rng.standard_normal((B, T, K, H)).astype(dtype)
    v = rng.standard_normal((B, T, K, H_V)).astype(dtype)
    mask = rng.random((B, T, T)) < 0.75
    bias = rng.standard_normal((B, T, T)).astype(dtype)
    cache = attnref.decode.kv_cache_init(B, capacity, K, H, H_V, window=window, dtype=dtype)
    cache = _APPEND(cache, k, v)
    positions = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))
    got = np.asarray(_ATTEND(cache, q, query_positions=positions, mask=mask, bias=bias))
    answerable = np.arange(T) - window + 1 >= T - capacity  # window inside the ring's contents
    assert np.all(np.isnan(got[:, ~answerable])) and not np.any(np.isnan(got[:, answerable]))
    kw = dict(is_causal=True, local_window_size=(window - 1, 0))
    ref = oracle.dot_product_attention(q, k, v, bias[:, None], mask[:, None], **kw)
    allowed = oracle.kernel_allowed((B, N, T, T), mask=mask[:, None], **kw)
    bound, _ = tolerance.kernel_error_bound(
        q, k, v, allowed, bias[:, None], dtype=dtype, key_blocks=1
    )
    err = np.abs(got[:, answerable] - ref[:, answerable])
    assert np.all(err <= bound[:, answerable]), np.max(err - bound[:, answerable])


@given(ring=st.sampled_from(RINGS), seed=st.integers(0, 2**31 - 1))
@scaled(0.5)
def test_decode_scan_ring_buffer_with_mask_and_bias(ring, seed):
    """Multi-head decoding (:func:`attnref.decode.scan`, the scan behind
    ``decode_attention``) through a ring buffer that wraps, with a mask and a bias by absolute
    key position: equals ``oracle.attention`` with the causal band ``t - W < j <= t`` and the
    same mask and bias, within the derived weight-level bound (the bound of the problem with
    the combined mask; disallowed keys add exact zeros)."""
    window, capacity = ring
    rng = np.random.default_rng(seed)
    dtype = np.float64
    params = _params(dtype)
    steps = 7
    xs = rng.standard_normal((2, steps, 8))
    mask = rng.random((2, steps, steps)) < 0.75
    bias = rng.standard_normal((2, steps, steps))
    cache = attnref.decode.init_cache(params, 2, capacity, window=window)
    ys, cache = _DECODE_SCAN(params, cache, xs, mask=mask, bias=bias)
    assert np.all(np.asarray(cache.positions) >= steps - capacity)  # the ring did wrap
    t = np.arange(steps)
    band = (t[None, :] <= t[:, None]) & (t[:, None] - t[None, :] < window)
    full = band & mask
    ref = oracle.attention(params, xs, mask=full, bias=bias)
    bound = tolerance.attention_error_bound(params, xs, mask=full, bias=bias, dtype=dtype)
    assert_within_bound(ys, ref, bound, label=f"ring decode W={window} C={capacity}")


def test_decode_multihead_entry_with_a_wrapping_ring():
    """The registry's ``decode_attention`` with ``window=W < T``: its ring of capacity ``W``
    wraps, and the result equals ``oracle.attention`` with the band ``t - W < j <= t`` and the
    same mask and bias, within the derived weight-level bound (jit and no jit give the same
    compiled scan body, so one variant suffices here)."""
    rng = np.random.default_rng(5)
    params = _params(np.float64)
    steps, window = 7, 3
    xs = rng.standard_normal((2, steps, 8))
    mask = rng.random((2, steps, steps)) < 0.75
    bias = rng.standard_normal((2, steps, steps))
    y = attnref.decode.decode_attention(params, xs, mask=mask, bias=bias, window=window)
    t = np.arange(steps)
    full = (t[None, :] <= t[:, None]) & (t[:, None] - t[None, :] < window) & mask
    ref = oracle.attention(params, xs, mask=full, bias=bias)
    bound = tolerance.attention_error_bound(params, xs, mask=full, bias=bias, dtype=np.float64)
    assert_within_bound(y, ref, bound, label=f"decode_attention window={window}")


def _causal_inputs(dtype, steps=6):
    rng = np.random.default_rng(7)
    q = rng.standard_normal((B, steps, N, H)).astype(dtype)
    k = rng.standard_normal((B, steps, K, H)).astype(dtype)
    v = rng.standard_normal((B, steps, K, H_V)).astype(dtype)
    return q, k, v


def test_overflow_under_jit_gives_nan_rows_and_checked_mode_raises():
    """Issue 11: capacity 4, no window, 6 single-token steps. Under ``jax.jit`` tokens 0..4 are
    exact (token 4 still sees 0..3 in the cache and itself in the chunk) and token 5, which
    needs the overwritten token 0, is a NaN row; ``attnref.checked`` raises at the overflowing
    append (token 4), as eager code does."""
    dtype = np.dtype(np.float32)
    q, k, v = _causal_inputs(dtype)
    ref = oracle.dot_product_attention(q, k, v, is_causal=True)
    allowed = oracle.kernel_allowed((B, N, 6, 6), is_causal=True)
    bound, _ = tolerance.kernel_error_bound(q, k, v, allowed, dtype=dtype, key_blocks=1)
    cache = attnref.decode.kv_cache_init(B, 4, K, H, H_V, dtype=dtype)
    rows = []
    for t in range(6):
        out, cache = _CACHED(cache, q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1])
        rows.append(np.asarray(out, np.float64)[:, 0])
    got = np.stack(rows, axis=1)
    assert np.all(np.abs(got[:, :5] - ref[:, :5]) <= bound[:, :5])
    assert np.all(np.isnan(got[:, 5]))
    cache = attnref.decode.kv_cache_init(B, 4, K, H, H_V, dtype=dtype)
    for t in range(4):
        _, cache = _CACHED(cache, q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1])
    overflow = r"capacity 4 and window=None, but batch element 0 needs 5 slots \(positions 0\.\.4\)"
    for fn in (attnref.checked(_CACHED), attnref.decode.cached_attention):
        with pytest.raises(ValueError, match=overflow):  # checkify.JaxRuntimeError is one
            fn(cache, q[:, 4:5], k[:, 4:5], v[:, 4:5])


def test_an_eager_overflow_is_a_plain_value_error_with_the_whole_message():
    """An eager ``decode`` call runs as one program under ``checkify`` and raises its first
    failed check as a plain ``ValueError`` whose text is the check's message and nothing more
    (no ``checkify.JaxRuntimeError``, no "(`check` failed)" suffix)."""
    params = _params(np.float32)
    xs = np.random.default_rng(6).standard_normal((2, 6, 8)).astype(np.float32)
    with pytest.raises(ValueError) as exc:
        attnref.decode.scan(params, attnref.decode.init_cache(params, 2, 4), xs)
    assert type(exc.value) is ValueError
    assert str(exc.value) == (
        "KV cache overflow: the cache has capacity 4 and window=None, but batch element 0 "
        "needs 6 slots (positions 0..5); a cache without a window must hold the whole "
        "sequence: grow the cache or use a sliding window (ring buffer)"
    )


def test_multihead_overflow_under_jit_nan_rows_and_checked_mode():
    """``decode.scan`` and ``decode.generate`` with capacity 4, no window, 6 tokens: under
    ``jax.jit`` rows 0..4 equal causal attention and row 5 is NaN; checked and eager calls
    raise before the scan (``decode.generate`` checks ``lengths + steps`` with the same
    ``require``; its eager call stands for both)."""
    params = _params(np.float64)
    xs = np.random.default_rng(5).standard_normal((2, 6, 8))
    mask = np.tril(np.ones((6, 6), bool))
    ref = oracle.attention(params, xs, mask=mask)
    bound = tolerance.attention_error_bound(params, xs, mask=mask, dtype=np.float64)
    cache = attnref.decode.init_cache(params, 2, 4)
    ys, _ = _DECODE_SCAN(params, cache, xs)
    ys = np.asarray(ys)
    assert_within_bound(ys[:, :5], ref[:, :5], bound[:, :5], label="decode before overflow")
    assert np.all(np.isnan(ys[:, 5]))
    need = r"capacity 4 and window=None, but batch element 0 needs 6 slots"
    for fn in (attnref.checked(_DECODE_SCAN), attnref.decode.scan):
        with pytest.raises(ValueError, match=need):
            fn(params, cache, xs)
    gen = jax.jit(attnref.decode.generate, static_argnames=("steps", "next_input"))
    x0 = xs[:, 0]
    xs_g, ys, _ = gen(params, cache, x0, 6, _residual)
    xs_g, ys = np.asarray(xs_g)[:, :5], np.asarray(ys)
    ref = oracle.attention(params, xs_g, mask=mask[:5, :5])
    bound = tolerance.attention_error_bound(params, xs_g, mask=mask[:5, :5], dtype=np.float64)
    assert_within_bound(ys[:, :5], ref, bound, label="generate before overflow")
    assert np.all(np.isnan(ys[:, 5]))
    with pytest.raises(ValueError, match=need):  # checked before the scan, as in checked mode
        attnref.decode.generate(params, cache, x0, 6, _residual)


def _residual(x, y):
    return jnp.tanh(x + y)


def test_cache_attend_overflow_and_short_mask_are_nan_or_raise():
    """A cache without a window filled past its capacity under ``jax.jit`` (where the append
    cannot raise) keeps its last C tokens; ``attnref.checked`` raises at that append, and a read
    that needs a lost key raises eagerly. A ``mask``/``bias`` shorter than an attended absolute
    position (``P <= position``) is the same kind of value error: a NaN row under ``jax.jit``, a
    ``ValueError`` eagerly (checked mode goes through the same ``require``)."""
    dtype = np.dtype(np.float32)
    q, k, v = _causal_inputs(dtype, steps=T)
    cache = attnref.decode.kv_cache_init(B, 5, K, H, H_V, dtype=dtype)
    with pytest.raises(ValueError, match=r"capacity 5 and window=None, .* needs 9 slots"):
        attnref.checked(_APPEND)(cache, k, v)
    wrapped = _APPEND(cache, k, v)  # unchecked: keeps positions 4..8
    np.testing.assert_array_equal(np.sort(np.asarray(wrapped.positions)), [[4, 5, 6, 7, 8]] * B)
    positions = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))
    lost = r"query at position 0 \(batch element 0\) needs the keys at positions 0\.\.0 but the"
    with pytest.raises(ValueError, match=lost + r" cache \(capacity 5, window=None\) holds only 0"):
        attnref.decode.cache_attend(wrapped, q, query_positions=positions)
    # A ring (W=2, C=3) holding positions 6..8, read with a mask and bias one position short
    # (P = T - 1 = 8): row 7 (keys 6, 7) is answerable, row 8 attends position 8 >= P, and rows
    # 0..6 need a key the ring lost (row 6 needs position 5).
    ring = _APPEND(attnref.decode.kv_cache_init(B, 3, K, H, H_V, window=2, dtype=dtype), k, v)
    short = dict(mask=np.ones((B, T, T - 1), bool), bias=np.zeros((B, T, T - 1), dtype))
    got = np.asarray(_ATTEND(ring, q, query_positions=positions, **short))
    assert not np.any(np.isnan(got[:, 7])) and np.all(np.isnan(got[:, [0, 1, 2, 3, 4, 5, 6, 8]]))
    late = np.where(positions >= 7, positions, -1).astype(np.int32)  # rows 0..6: padding
    with pytest.raises(
        ValueError, match=r"P=8 absolute key positions, but the query at position 8"
    ):
        attnref.decode.cache_attend(
            ring, q, query_positions=late, **short
        )  # eager: concrete values


def test_mixed_dtypes_are_rejected_and_float64_computes_in_float64():
    """Defect 9: float64 inputs into a float32 cache raised no error and were rounded to
    float32. Now a mix raises ``TypeError`` naming both dtypes, and a float64 cache with
    float64 inputs computes in float64 even with x64 off (float64 bound, ~1e-15 relative; float32
    rounding would be ~1e-7 and fail it)."""
    q, k, v = _causal_inputs(np.float64, steps=3)
    cache32 = attnref.decode.kv_cache_init(B, 4, K, H, H_V, dtype=np.float32)
    with pytest.raises(TypeError, match="q has dtype float64 but the cache has dtype float32"):
        attnref.decode.cached_attention(cache32, q, k.astype(np.float32), v.astype(np.float32))
    with pytest.raises(TypeError, match="k has dtype float64 but the cache has dtype float32"):
        attnref.decode.kv_cache_append(cache32, k, v.astype(np.float32))
    with pytest.raises(TypeError, match=r"x has dtype float64 but params\.w_q has dtype float32"):
        attnref.decode.step(
            _params(np.float32), attnref.decode.init_cache(_params(np.float32), 2, 4), q[:, :, 0, :]
        )
    with jax.enable_x64(False):  # checked(jit(f)) scopes x64 like every attnref function
        cache64 = attnref.decode.kv_cache_init(B, 4, K, H, H_V, dtype=np.float64)
        out, cache64 = attnref.checked(_CACHED)(cache64, q, k, v)
        assert out.dtype == np.float64 and cache64.k.dtype == np.float64
    ref = oracle.dot_product_attention(q, k, v, is_causal=True)
    allowed = oracle.kernel_allowed((B, N, 3, 3), is_causal=True)
    bound, _ = tolerance.kernel_error_bound(q, k, v, allowed, dtype=np.float64, key_blocks=1)
    assert np.all(np.abs(np.asarray(out) - ref) <= bound)


def test_checked_refuses_traced_arguments():
    """A checked function raises, so it cannot run inside someone else's ``jax.jit``."""
    cache = attnref.decode.kv_cache_init(1, 2, 1, 1, dtype=np.float32)
    x = np.zeros((1, 1, 1, 1), np.float32)
    with pytest.raises(TypeError, match=r"checked\('cached_attention'\).*jax.jit\(fn\)"):
        jax.jit(attnref.checked(attnref.decode.cached_attention))(cache, x, x, x)
