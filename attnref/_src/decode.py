"""KV-cached decoding: a cache pytree, chunked appends, ring buffers, and ``lax.scan`` generation.

A :class:`KVCache` holds ``C`` slots per batch element: keys ``[B, C, K, H]``, values
``[B, C, K, H_v]``, the absolute position stored in each slot (``-1`` = empty) and ``lengths
[B]``, the number of tokens seen. Token number ``p`` (its absolute position) lives in slot
``p mod C``. With ``window = W`` the cache is a ring buffer of the last tokens and a query at
position ``p`` attends to positions ``p - W < j <= p`` (the W most recent, itself included:
``local_window_size=(W - 1, 0)`` with ``is_causal``); without a window it attends to every
``j <= p`` and ``C`` must hold the whole sequence.

:func:`cached_attention` appends a chunk of ``L`` tokens (``L = 1`` is one decoding step; the
first call on an empty cache is the prefill) and attends from the chunk's queries to the cache
and the chunk. ``valid [B, L]`` marks real tokens: padding (left, right, or anywhere) is skipped
and real tokens are numbered consecutively, so left-padded and right-padded prompts give the same
cache and ragged batches advance independently. At every step the output equals full causal
attention over each sequence's prefix (the property the tests check).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Float, Int

from attnref._src.checks import check_params, enable_x64, float64_scoped, x64_enabled
from attnref._src.common import HIGHEST
from attnref._src.kernel import dot_product_attention
from attnref._src.params import AttentionParams


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Per-batch key/value slots with their absolute positions (a JAX pytree).

    ``window`` (static) makes it a ring buffer: only the last ``window`` positions are attended.
    """

    k: Float[Array, "B C K H"]
    v: Float[Array, "B C K H_v"]
    positions: Int[Array, "B C"]  # absolute position in each slot, -1 = empty
    lengths: Int[Array, " B"]  # tokens appended so far (the next token's position)
    window: int | None = dataclasses.field(default=None, metadata=dict(static=True))

    @property
    def capacity(self) -> int:
        return int(self.k.shape[1])


def kv_cache_init(
    batch: int,
    capacity: int,
    num_kv_heads: int,
    head_dim: int,
    head_dim_v: int | None = None,
    *,
    window: int | None = None,
    dtype: Any = jnp.float32,
) -> KVCache:
    """An empty cache. A ring buffer (``window`` given) needs ``capacity >= window``."""
    for name, val in (
        ("batch", batch),
        ("capacity", capacity),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
    ):
        if not isinstance(val, int) or val < 1:
            raise ValueError(f"{name} must be a positive int, got {val!r}")
    if window is not None and (not isinstance(window, int) or window < 1 or capacity < window):
        raise ValueError(
            f"window must be a positive int no larger than capacity={capacity}, got {window!r}"
        )
    h_v = head_dim if head_dim_v is None else head_dim_v
    if np.dtype(dtype) == np.float64 and not x64_enabled():
        with enable_x64():  # a float64 cache is float64, never silently float32
            return kv_cache_init(
                batch, capacity, num_kv_heads, head_dim, head_dim_v, window=window, dtype=dtype
            )
    return KVCache(
        k=jnp.zeros((batch, capacity, num_kv_heads, head_dim), dtype),
        v=jnp.zeros((batch, capacity, num_kv_heads, h_v), dtype),
        positions=jnp.full((batch, capacity), -1, jnp.int32),
        lengths=jnp.zeros((batch,), jnp.int32),
        window=window,
    )


def _chunk_positions(
    cache: KVCache, valid: Bool[Array, "B L"]
) -> tuple[Int[Array, "B L"], Int[Array, " B"]]:
    """Absolute positions of the chunk's real tokens (``-1`` for padding), and new lengths."""
    rank = jnp.cumsum(valid.astype(jnp.int32), axis=1) - 1
    pos = jnp.where(valid, cache.lengths[:, None] + rank, -1)
    return pos, cache.lengths + jnp.sum(valid, axis=1, dtype=jnp.int32)


def _check_chunk(cache: KVCache, k: Any, v: Any, valid: Any, q: Any = None) -> Array:
    b, c, kh, h = cache.k.shape
    h_v = cache.v.shape[-1]
    if np.ndim(k) != 4 or np.shape(k)[0] != b or np.shape(k)[2:] != (kh, h):
        raise ValueError(f"key chunk has shape {np.shape(k)}; expected [B={b}, L, K={kh}, H={h}]")
    if np.shape(v) != (*np.shape(k)[:3], h_v):
        raise ValueError(f"value chunk has shape {np.shape(v)}; expected {(*np.shape(k)[:3], h_v)}")
    length = np.shape(k)[1]
    if q is not None and (
        np.ndim(q) != 4
        or np.shape(q)[:2] != (b, length)
        or np.shape(q)[3] != h
        or np.shape(q)[2] % kh
    ):
        raise ValueError(
            f"query chunk has shape {np.shape(q)}; expected [B={b}, L={length}, N, "
            f"H={h}] with N a multiple of K={kh}"
        )
    if valid is None:
        return jnp.ones((b, length), bool)
    if np.shape(valid) != (b, length) or np.dtype(getattr(valid, "dtype", bool)) != np.bool_:
        raise ValueError(
            f"valid must be a boolean [B={b}, L={length}] array, got shape {np.shape(valid)}"
        )
    if cache.window is None and not isinstance(cache.lengths, jax.core.Tracer):
        need = int(np.max(np.asarray(cache.lengths) + np.sum(np.asarray(valid), axis=1)))
        if need > c:
            raise ValueError(
                f"the cache has capacity {c} but this append needs {need} slots; "
                "grow the cache or use a sliding window (ring buffer)"
            )
    return jnp.asarray(valid)


def kv_cache_append(
    cache: KVCache,
    k: Float[ArrayLike, "B L K H"],
    v: Float[ArrayLike, "B L K H_v"],
    valid: Bool[ArrayLike, "B L"] | None = None,
) -> KVCache:
    """Write the chunk's real tokens to slots ``position mod C``.

    In a ring buffer a chunk longer than the capacity keeps only its last ``C`` tokens, so no
    slot is written twice in one update.
    """
    valid_a = _check_chunk(cache, k, v, valid)
    pos, lengths = _chunk_positions(cache, valid_a)
    c = cache.capacity
    keep = jnp.logical_and(pos >= 0, pos >= lengths[:, None] - c)
    slot = jnp.where(keep, pos % c, c)  # out-of-range slot: dropped by the scatter

    def write(buf: Array, new: Array) -> Array:
        return jax.vmap(lambda b, s, n: b.at[s].set(n, mode="drop"))(buf, slot, new)

    return KVCache(
        k=write(cache.k, jnp.asarray(k, cache.k.dtype)),
        v=write(cache.v, jnp.asarray(v, cache.v.dtype)),
        positions=write(cache.positions, pos),
        lengths=lengths,
        window=cache.window,
    )


@float64_scoped
def cached_attention(
    cache: KVCache,
    q: Float[ArrayLike, "B L N H"],
    k: Float[ArrayLike, "B L K H"],
    v: Float[ArrayLike, "B L K H_v"],
    valid: Bool[ArrayLike, "B L"] | None = None,
    *,
    mask: Bool[ArrayLike, "B L P"] | None = None,
    bias: Float[ArrayLike, "B L P"] | None = None,
    scale: float | None = None,
    softcap: float | None = None,
) -> tuple[Float[Array, "B L N H_v"], KVCache]:
    """Append a chunk and attend from its queries: ``o_i = softmax_j(s_ij + bias_i[pos_j]) v_j``
    over cached and chunk tokens ``j`` with ``pos_j <= pos_i`` (and ``pos_i - pos_j < window``)
    and ``mask_i[pos_j]``.

    ``mask`` and ``bias`` (optional, ``[B, L, P]``) are indexed by the keys' *absolute*
    positions ``0..P-1`` (``P`` must exceed every position attended), so a mask or bias written
    for the full sequence applies unchanged to cached decoding. Returns the chunk's output (zero
    rows for padding tokens) and the updated cache.
    """
    valid_a = _check_chunk(cache, k, v, valid, q)
    q_pos, _ = _chunk_positions(cache, valid_a)
    keys = jnp.concatenate([cache.k, jnp.asarray(k, cache.k.dtype)], axis=1)
    values = jnp.concatenate([cache.v, jnp.asarray(v, cache.v.dtype)], axis=1)
    k_pos = jnp.concatenate([cache.positions, q_pos], axis=1)
    qp, kp = q_pos[:, :, None], k_pos[:, None, :]
    allowed = (qp >= 0) & (kp >= 0) & (kp <= qp)
    if cache.window is not None:
        allowed &= qp - kp < cache.window
    length = int(np.shape(q)[1])

    def by_position(name: str, a: Any) -> Array:
        if np.ndim(a) != 3 or np.shape(a)[:2] != (cache.k.shape[0], length):
            raise ValueError(
                f"{name} has shape {np.shape(a)}; expected [B, L={length}, P] "
                "indexed by absolute key position"
            )
        idx = jnp.broadcast_to(jnp.clip(kp, 0, np.shape(a)[2] - 1), allowed.shape)
        return jnp.take_along_axis(jnp.asarray(a), idx, axis=2)

    if mask is not None:
        allowed &= by_position("mask", mask)
    key_bias = None
    if bias is not None:
        key_bias = jnp.where(allowed, by_position("bias", bias), 0.0)[:, None]
    out = dot_product_attention(
        jnp.asarray(q, cache.k.dtype),
        keys,
        values,
        key_bias,
        allowed[:, None],
        scale=scale,
        softcap=softcap,
    )
    return out, kv_cache_append(cache, k, v, valid_a)


@float64_scoped
def cache_attend(
    cache: KVCache,
    q: Float[ArrayLike, "B L N H"],
    *,
    query_positions: Int[ArrayLike, "B L"] | None = None,
    mask: Bool[ArrayLike, "B L P"] | None = None,
    bias: Float[ArrayLike, "B L P"] | None = None,
    scale: float | None = None,
    softcap: float | None = None,
) -> Float[Array, "B L N H_v"]:
    """Attend from queries to the cached tokens only, without appending anything.

    Every filled slot is a candidate; ``query_positions`` (optional, ``-1`` = padding query)
    adds the causal rule ``pos_j <= pos_i`` (and the window), and ``mask``/``bias``
    (``[B, L, P]``, by absolute key position) select and shift keys. This is the
    encoder-decoder pattern: a prefilled cache read by queries one step at a time.
    """
    b, c = cache.positions.shape
    length = int(np.shape(q)[1])
    if np.ndim(q) != 4 or np.shape(q)[0] != b or np.shape(q)[3] != cache.k.shape[3]:
        raise ValueError(f"q has shape {np.shape(q)}; expected [B={b}, L, N, H={cache.k.shape[3]}]")
    kp = jnp.broadcast_to(cache.positions[:, None, :], (b, length, c))
    allowed = kp >= 0
    if query_positions is not None:
        qp = jnp.asarray(query_positions)[:, :, None]
        allowed &= (qp >= 0) & (kp <= qp)
        if cache.window is not None:
            allowed &= qp - kp < cache.window

    def by_position(name: str, a: Any) -> Array:
        if np.ndim(a) != 3 or np.shape(a)[:2] != (b, length):
            raise ValueError(
                f"{name} has shape {np.shape(a)}; expected [B={b}, L={length}, P] "
                "indexed by absolute key position"
            )
        return jnp.take_along_axis(jnp.asarray(a), jnp.clip(kp, 0, np.shape(a)[2] - 1), axis=2)

    if mask is not None:
        allowed &= by_position("mask", mask)
    key_bias = None
    if bias is not None:
        key_bias = jnp.where(allowed, by_position("bias", bias), 0.0)[:, None]
    return dot_product_attention(
        jnp.asarray(q, cache.k.dtype),
        cache.k,
        cache.v,
        key_bias,
        allowed[:, None],
        scale=scale,
        softcap=softcap,
    )


def _project(x: Array, w: Any, b: Any) -> Array:
    """``x W[h] + b[h]`` in kernel layout ``[B, L, heads, d]``."""
    y = jnp.einsum("bld,hde->blhe", x, jnp.asarray(w), precision=HIGHEST)
    return y if b is None else y + jnp.asarray(b)


@float64_scoped
def mha_cached_attention(
    params: AttentionParams,
    cache: KVCache,
    x: Float[ArrayLike, "B L d_model"],
    valid: Bool[ArrayLike, "B L"] | None = None,
    *,
    x_kv: Float[ArrayLike, "B L d_model"] | None = None,
    mask: Bool[ArrayLike, "B L P"] | None = None,
    bias: Float[ArrayLike, "B L P"] | None = None,
    scale: float | None = None,
) -> tuple[Float[Array, "B L d_model"], KVCache]:
    """Multi-head decoding step: project the chunk ``x`` (``q = x W_Q + b_Q``, ``k``, ``v`` with
    the K/V heads of ``params``), append ``k, v``, attend, and return ``sum_n o_n W_O[n] + b_O``.
    ``x_kv`` (default ``x``) gives the chunk's keys and values when they differ from its queries.
    ``mask``/``bias`` as in :func:`cached_attention` (indexed by absolute key position).
    """
    _, d_model, _, _ = check_params(params)
    x = jnp.asarray(x)
    if x.ndim != 3 or x.shape[-1] != d_model:
        raise ValueError(f"x has shape {x.shape}; expected [B, L, d_model={d_model}]")
    x_kv = x if x_kv is None else jnp.asarray(x_kv)
    if x_kv.shape != x.shape:
        raise ValueError(f"x_kv has shape {x_kv.shape}; expected the shape of x, {x.shape}")
    q = _project(x, params.w_q, params.b_q)
    k = _project(x_kv, params.w_k, params.b_k)
    v = _project(x_kv, params.w_v, params.b_v)
    o, cache = cached_attention(cache, q, k, v, valid, mask=mask, bias=bias, scale=scale)
    y = jnp.einsum("blhv,hvd->bld", o, jnp.asarray(params.w_o), precision=HIGHEST)
    if params.b_o is not None:
        y = y + jnp.asarray(params.b_o)
    if valid is not None:
        y = jnp.where(jnp.asarray(valid)[..., None], y, 0.0)
    return y, cache


def mha_cache_init(
    params: AttentionParams,
    batch: int,
    capacity: int,
    *,
    window: int | None = None,
) -> KVCache:
    """An empty cache shaped for ``params`` (its K/V heads, ``d_k``, ``d_v`` and dtype)."""
    kv_heads = int(np.shape(params.w_k)[0])
    return kv_cache_init(
        batch, capacity, kv_heads, params.d_k, params.d_v, window=window, dtype=params.dtype
    )


@float64_scoped
def mha_decode_scan(
    params: AttentionParams,
    cache: KVCache,
    xs: Float[ArrayLike, "B T d_model"],
    valid: Bool[ArrayLike, "B T"] | None = None,
    *,
    xs_kv: Float[ArrayLike, "B T d_model"] | None = None,
    mask: Bool[ArrayLike, "B T P"] | None = None,
    bias: Float[ArrayLike, "B T P"] | None = None,
    scale: float | None = None,
) -> tuple[Float[Array, "B T d_model"], KVCache]:
    """Feed ``xs`` one token at a time through :func:`mha_cached_attention` with ``lax.scan``;
    row ``t`` of ``mask``/``bias`` goes with token ``t`` (indexed by absolute key position);
    ``xs_kv`` (default ``xs``) supplies each token's keys and values."""
    xs = jnp.asarray(xs)
    steps = {"x": jnp.swapaxes(xs, 0, 1)}
    steps["x_kv"] = steps["x"] if xs_kv is None else jnp.swapaxes(jnp.asarray(xs_kv), 0, 1)
    steps["valid"] = jnp.swapaxes(
        jnp.ones(xs.shape[:2], bool) if valid is None else jnp.asarray(valid), 0, 1
    )
    if mask is not None:
        steps["mask"] = jnp.swapaxes(jnp.asarray(mask), 0, 1)
    if bias is not None:
        steps["bias"] = jnp.swapaxes(jnp.asarray(bias), 0, 1)

    def step(c: KVCache, inp: dict[str, Array]) -> tuple[KVCache, Array]:
        extra = {name: inp[name][:, None] for name in ("mask", "bias") if name in inp}
        y, c = mha_cached_attention(
            params,
            c,
            inp["x"][:, None],
            inp["valid"][:, None],
            x_kv=inp["x_kv"][:, None],
            scale=scale,
            **extra,
        )
        return c, y[:, 0]

    cache, ys = jax.lax.scan(step, cache, steps)
    return jnp.swapaxes(ys, 0, 1), cache


@float64_scoped
def mha_generate(
    params: AttentionParams,
    cache: KVCache,
    x0: Float[ArrayLike, "B d_model"],
    steps: int,
    next_input: Callable[[Array, Array], Array],
    *,
    scale: float | None = None,
) -> tuple[Float[Array, "B steps d_model"], Float[Array, "B steps d_model"], KVCache]:
    """Autoregressive generation with ``lax.scan``: ``y_t = attend(x_t)``, then
    ``x_{t+1} = next_input(x_t, y_t)`` (a residual update, a sampled embedding, ...).

    Returns the inputs ``x_0..x_{steps-1}``, the outputs ``y_t`` and the final cache.
    """

    def step(carry: tuple[KVCache, Array], _: Any) -> tuple[tuple[KVCache, Array], Any]:
        c, x_t = carry
        y, c = mha_cached_attention(params, c, x_t[:, None], scale=scale)
        return (c, next_input(x_t, y[:, 0])), (x_t, y[:, 0])

    (cache, _), (xs, ys) = jax.lax.scan(step, (cache, jnp.asarray(x0)), None, length=steps)
    return jnp.swapaxes(xs, 0, 1), jnp.swapaxes(ys, 0, 1), cache
