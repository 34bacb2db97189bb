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

**Overflow and other value errors.** Two conditions depend on array values, not shapes: a cache
without a window that is asked to hold more than ``C`` tokens (the ring wraps and overwrites keys
that later queries need), and a ``mask``/``bias`` ``[B, L, P]`` too short for an attended absolute
position. Eagerly (concrete values) they raise ``ValueError``. Under ``jax.jit``, ``vmap`` or
``lax.scan`` they cannot be checked at trace time, so:

* unchecked (plain ``jax.jit``): every output row whose query would need a key the cache no
  longer holds, or a position past ``P``, is NaN (all ``H_v``, or ``d_model``, entries) -- never a
  silently wrong number. Rows that only need keys still present are exact; an overflowing
  append itself keeps the ring's last ``C`` tokens, and later reads turn rows into NaN;
* checked (:func:`attnref.checked`, built on ``jax.experimental.checkify``):
  ``attnref.checked(jax.jit(fn))(...)`` raises ``checkify.JaxRuntimeError`` (a ``ValueError``)
  naming the capacity, the window and the offending position, at the same append at which the
  eager code raises.

A query at position ``p`` *needs* the keys ``max(0, p - W + 1) <= j <= p`` (``W = inf`` without a
window); the masks do not enter this rule, so the check does not depend on mask values.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, no_type_check

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Float, Int

from attnref._src.core.checked import require
from attnref._src.core.checks import (
    HIGHEST,
    check_params,
    dtype_of,
    float64_scoped,
    in_x64_if_float64,
)
from attnref._src.core.params import AttentionParams
from attnref._src.formulations.kernel import dot_product_attention


# @no_type_check: no runtime check of the fields (the suite's jaxtyping hook), since JAX rebuilds
# a pytree with any leaves (tree_map results, vmap axes, placeholders).
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
@no_type_check
class KVCache:
    """Per-batch key/value slots with their absolute positions (a JAX pytree).

    ``window`` (static) makes it a ring buffer: only the last ``window`` positions are attended.
    Build one with :func:`kv_cache_init` (kernel level) or :func:`init_cache` (from params).

    Attributes:
        k: Cached keys ``[B, C, K, H]`` (``C`` slots; token at position ``p`` in slot
            ``p mod C``).
        v: Cached values ``[B, C, K, H_v]``, the dtype of ``k``.
        positions: int32 ``[B, C]``, the absolute position held by each slot (``-1`` = empty).
        lengths: int32 ``[B]``, the tokens appended so far (the next token's position).
        window: ``None`` (attend to every earlier position; ``C`` must hold the sequence) or
            ``W`` (a ring buffer: a query at ``p`` attends to ``p - W < j <= p``); static.
        capacity: The number of slots ``C`` (a property).
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
    """An empty cache. A ring buffer (``window`` given) needs ``capacity >= window``.

    Args:
        batch: The batch size ``B``, a positive int.
        capacity: The number of slots ``C``, a positive int.
        num_kv_heads: The number of key/value heads ``K``, a positive int.
        head_dim: The key head dim ``H``, a positive int.
        head_dim_v: The value head dim ``H_v``; ``None`` (default) means ``head_dim``.
        window: ``None`` (default: no window, the cache must hold the whole sequence) or a
            positive int ``W <= capacity`` (a ring buffer of the last ``W`` positions).
        dtype: The keys' and values' dtype (default float32); float64 gives a float64 cache
            even when x64 is off globally.

    Returns:
        A :class:`KVCache` with zero keys and values, every position ``-1`` and ``lengths`` 0.

    Raises:
        ValueError: If a size (``head_dim_v`` included; a Python or NumPy int) is not a
            positive int, or ``window`` is not a positive int no larger than ``capacity``.
    """

    def is_int(val: Any) -> bool:  # Python or NumPy ints (np.int64 sizes are valid), not bools
        return isinstance(val, (int, np.integer)) and not isinstance(val, bool)

    sizes = {
        "batch": batch,
        "capacity": capacity,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "head_dim_v": head_dim if head_dim_v is None else head_dim_v,
    }
    for name, val in sizes.items():
        if not is_int(val) or val < 1:
            raise ValueError(f"{name} must be a positive int, got {val!r}")
    batch, capacity, num_kv_heads, head_dim, h_v = (int(v) for v in sizes.values())
    if window is not None and (not is_int(window) or window < 1 or capacity < window):
        raise ValueError(
            f"window must be a positive int no larger than capacity={capacity}, got {window!r}"
        )
    window = None if window is None else int(window)

    def empty() -> KVCache:
        return KVCache(
            k=jnp.zeros((batch, capacity, num_kv_heads, head_dim), dtype),
            v=jnp.zeros((batch, capacity, num_kv_heads, h_v), dtype),
            positions=jnp.full((batch, capacity), -1, jnp.int32),
            lengths=jnp.zeros((batch,), jnp.int32),
            window=window,
        )

    # a float64 cache is float64, never silently float32
    return in_x64_if_float64(dtype, empty)


def _check_dtypes(cache: KVCache, **arrays: Any) -> None:
    """The cache and every new array share one floating dtype (attnref never mixes dtypes)."""
    want = dtype_of(cache.k)
    if dtype_of(cache.v) != want:
        raise TypeError(
            f"cache.v has dtype {dtype_of(cache.v)} but cache.k has dtype {want}; a cache holds one "
            "dtype"
        )
    for name, a in arrays.items():
        if a is not None and dtype_of(a) != want:
            raise TypeError(
                f"{name} has dtype {dtype_of(a)} but the cache has dtype {want}; attnref does not "
                f"mix dtypes: cast {name} explicitly or build the cache with dtype={dtype_of(a)}"
            )


def _chunk_positions(
    cache: KVCache, valid: Bool[Array, "B L"]
) -> tuple[Int[Array, "B L"], Int[Array, " B"]]:
    """Absolute positions of the chunk's real tokens (``-1`` for padding), and new lengths."""
    rank = jnp.cumsum(valid.astype(jnp.int32), axis=1) - 1
    pos = jnp.where(valid, cache.lengths[:, None] + rank, -1)
    return pos, cache.lengths + jnp.sum(valid, axis=1, dtype=jnp.int32)


def _check_chunk(cache: KVCache, k: Any, v: Any, valid: Any, q: Any = None) -> Array:
    """Static checks of a chunk (shapes, dtypes); returns ``valid`` as a ``[B, L]`` array."""
    b, _, kh, h = cache.k.shape
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
    _check_dtypes(cache, q=q, k=k, v=v)
    if valid is None:
        return jnp.ones((b, length), bool)
    if np.shape(valid) != (b, length):
        raise ValueError(
            f"valid must be a boolean [B={b}, L={length}] array, got shape {np.shape(valid)} "
            f"and dtype {dtype_of(valid)}"
        )
    if dtype_of(valid) != np.bool_:
        raise TypeError(
            f"valid must be boolean (True = a real token), got dtype {dtype_of(valid)} "
            f"(shape {np.shape(valid)})"
        )
    return jnp.asarray(valid)


def _require_room(cache: KVCache, added: Any) -> None:
    """Without a window the cache must hold the whole sequence: ``lengths + added <= C``.

    Eagerly a ``ValueError``; traced, a :func:`~attnref._src.core.checked.require` check (raised under
    :func:`attnref.checked`; unchecked, the reads that need lost keys return NaN rows).
    """
    if cache.window is not None:
        return
    c = cache.capacity
    need = cache.lengths + jnp.asarray(added, jnp.int32)
    first = jnp.argmax(need > c)
    require(
        need <= c,
        f"KV cache overflow: the cache has capacity {c} and window=None, but batch element "
        "{b} needs {need} slots (positions 0..{last}); a cache without a window must hold the "
        "whole sequence: grow the cache or use a sliding window (ring buffer)",
        b=first,
        need=need[first],
        last=need[first] - 1,
    )


def _complete_rows(
    cache: KVCache,
    q_pos: Int[Array, "B L"],
    hi: Int[Array, "B L"],
    k_pos: Int[Array, "B S"],
    what: str,
) -> Bool[Array, "B L"]:
    """Whether each query row sees every key it needs; a failed row is checked by ``require``.

    A query at ``p = q_pos`` needs the positions ``lo <= j <= hi`` with ``lo = max(0, p - W +
    1)`` (``0`` without a window) and ``hi`` the newest position that exists for it. Positions
    in ``k_pos`` are distinct (one slot per position, chunk positions after the cache's), so the
    row is complete iff ``#{j in k_pos : lo <= j <= hi} = hi - lo + 1``. Padding (``p < 0``) is
    complete.
    """
    lo = jnp.zeros_like(q_pos) if cache.window is None else jnp.maximum(q_pos - cache.window + 1, 0)
    need = jnp.maximum(hi - lo + 1, 0)
    kp = k_pos[:, None, :]
    have = jnp.sum((kp >= lo[..., None]) & (kp <= hi[..., None]), axis=-1, dtype=jnp.int32)
    ok = (q_pos < 0) | (have >= need)
    b, i = jnp.unravel_index(jnp.argmin(ok), ok.shape)
    require(
        ok,
        f"KV cache overflow in {what}: the query at position {{p}} (batch element {{b}}) needs "
        f"the keys at positions {{lo}}..{{hi}} but the cache (capacity {cache.capacity}, "
        f"window={cache.window}) holds only {{have}} of them; the others were overwritten when "
        "the ring wrapped. A cache without a window must hold the whole sequence: grow the cache "
        "or use a sliding window (ring buffer)",
        p=q_pos[b, i],
        b=b,
        lo=lo[b, i],
        hi=hi[b, i],
        have=have[b, i],
    )
    return ok


def _by_position(
    name: str,
    a: Any,
    kp: Int[Array, "B L S"],
    attended: Bool[Array, "B L S"],
    q_pos: Int[Array, "B L"] | None,
) -> tuple[Array, Bool[Array, "B L"]]:
    """Gather ``a[b, i, kp[b, i, s]]`` (a ``[B, L, P]`` mask or bias by absolute key position).

    Returns the gathered values and, per query row, whether every attended position is ``< P``
    (checked by ``require``; unchecked rows past ``P`` are the caller's NaN rows).
    """
    b, length = kp.shape[:2]
    if np.ndim(a) != 3 or np.shape(a)[:2] != (b, length):
        raise ValueError(
            f"{name} has shape {np.shape(a)}; expected [B={b}, L={length}, P] indexed by "
            "absolute key position"
        )
    p_len = int(np.shape(a)[2])
    beyond = attended & (kp >= p_len)
    ok = ~jnp.any(beyond, axis=-1)
    bi, i = jnp.unravel_index(jnp.argmin(ok), ok.shape)
    where = "" if q_pos is None else " at position {p}"
    require(
        ok,
        f"{name} has shape {tuple(np.shape(a))}, so P={p_len} absolute key positions, but the "
        f"query{where} (batch element {{b}}, chunk row {{i}}) attends the key at position {{j}}; "
        f"{name} must cover every attended position (P > position)",
        p=jnp.asarray(-1) if q_pos is None else q_pos[bi, i],
        b=bi,
        i=i,
        j=jnp.max(jnp.where(beyond[bi, i], kp[bi, i], -1)),
    )
    idx = jnp.clip(kp, 0, p_len - 1)
    return jnp.take_along_axis(jnp.asarray(a), idx, axis=2), ok


def _nan_rows(out: Array, ok: Bool[Array, "B L"]) -> Array:
    """Rows whose value could not be checked are NaN (unchecked traced mode)."""
    return jnp.where(ok[:, :, None, None], out, jnp.asarray(jnp.nan, out.dtype))


def _append(
    cache: KVCache, k: Any, v: Any, pos: Int[Array, "B L"], lengths: Int[Array, " B"]
) -> KVCache:
    c = cache.capacity
    keep = jnp.logical_and(pos >= 0, pos >= lengths[:, None] - c)
    slot = jnp.where(keep, pos % c, c)  # out-of-range slot: dropped by the scatter

    def write(buf: Array, new: Array) -> Array:
        return jax.vmap(lambda b, s, n: b.at[s].set(n, mode="drop"))(buf, slot, new)

    return KVCache(
        k=write(cache.k, jnp.asarray(k)),
        v=write(cache.v, jnp.asarray(v)),
        positions=write(cache.positions, pos),
        lengths=lengths,
        window=cache.window,
    )


@float64_scoped
def kv_cache_append(
    cache: KVCache,
    k: Float[ArrayLike, "B L K H"],
    v: Float[ArrayLike, "B L K H_v"],
    valid: Bool[ArrayLike, "B L"] | None = None,
) -> KVCache:
    """Write the chunk's real tokens to slots ``position mod C``.

    In a ring buffer a chunk longer than the capacity keeps only its last ``C`` tokens, so no
    slot is written twice in one update. ``k``/``v`` must have the cache's dtype (``TypeError``
    otherwise). Without a window, ``lengths + (real tokens) > C`` is an overflow: ``ValueError``
    eagerly, ``checkify.JaxRuntimeError`` under :func:`attnref.checked`; under plain ``jax.jit``
    the append wraps (keeping the last ``C`` tokens, positions recorded) and every later read
    that needs an overwritten key returns NaN rows.

    Args:
        cache: The cache to append to (:class:`KVCache`).
        k: The chunk's keys ``[B, L, K, H]``, the cache's dtype.
        v: The chunk's values ``[B, L, K, H_v]``, the cache's dtype.
        valid: Boolean ``[B, L]``, ``True`` = a real token; padding is skipped and real tokens
            are numbered consecutively. ``None`` (default) means every token is real.

    Returns:
        The updated :class:`KVCache` (``lengths`` advanced by the real tokens of each row).

    Raises:
        ValueError: If ``k``/``v`` do not match the cache's ``[B, *, K, H]``/``H_v``, ``valid``
            is not ``[B, L]``, or (eagerly) a cache without a window overflows.
        TypeError: If ``k``/``v`` do not have the cache's dtype, or ``valid`` is not boolean.
    """
    valid_a = _check_chunk(cache, k, v, valid)
    pos, lengths = _chunk_positions(cache, valid_a)
    _require_room(cache, lengths - cache.lengths)
    return _append(cache, k, v, pos, lengths)


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
    and ``mask_i[pos_j]``; kernel layout ``[B, L, N, H]`` (row convention, ``N`` a multiple of
    the cache's ``K`` heads), ``s_ij = scale q_i . k_j`` (default ``scale = 1/sqrt(H)``).

    ``mask`` and ``bias`` (optional, ``[B, L, P]``) are indexed by the keys' *absolute*
    positions ``0..P-1`` (``P`` must exceed every position attended), so a mask or bias written
    for the full sequence applies unchanged to cached decoding. ``q``, ``k``, ``v`` must have
    the cache's dtype (``TypeError`` naming both otherwise); float64 computes in float64.

    Value errors (a cache without a window overflowing, ``P`` too short): ``ValueError``
    eagerly; under plain ``jax.jit`` the affected output rows are NaN; under
    :func:`attnref.checked` a ``checkify.JaxRuntimeError`` naming capacity, window and position.

    Args:
        cache: The cache (:class:`KVCache`); ``K``, ``H``, ``H_v`` and the dtype come from it.
        q: The chunk's queries ``[B, L, N, H]``, ``N`` a multiple of ``K``.
        k: The chunk's keys ``[B, L, K, H]``.
        v: The chunk's values ``[B, L, K, H_v]``.
        valid: Boolean ``[B, L]``, ``True`` = a real token (padding is neither appended nor
            attended from); ``None`` (default) means every token is real.
        mask: Boolean ``[B, L, P]`` by absolute key position, ``True`` = may attend; ``None``
            (default): the causal (and window) rule only.
        bias: ``[B, L, P]`` by absolute key position, added to the (softcapped) logits;
            ``None`` (default) adds nothing.
        scale: The logit scale; ``None`` (default) means ``1/sqrt(H)``.
        softcap: A positive number ``c``: logits become ``c tanh(s / c)``; ``None`` (default):
            no cap.

    Returns:
        ``(o, cache)``: the chunk's output ``o [B, L, N, H_v]`` (zero rows for padding tokens)
        and the updated :class:`KVCache`.

    Raises:
        ValueError: If a chunk's shape does not match the cache, ``valid`` is not
            ``[B, L]``, ``mask``/``bias`` are not ``[B, L, P]``, or, eagerly, the cache
            overflows or ``P`` is too short for an attended position; or for the errors of
            :func:`attnref.dot_product_attention` (e.g. a bad ``softcap``).
        TypeError: If ``q``/``k``/``v`` do not have the cache's dtype, or ``valid`` is not
            boolean.
    """
    valid_a = _check_chunk(cache, k, v, valid, q)
    q_pos, lengths = _chunk_positions(cache, valid_a)
    _require_room(cache, lengths - cache.lengths)
    keys = jnp.concatenate([cache.k, jnp.asarray(k)], axis=1)
    values = jnp.concatenate([cache.v, jnp.asarray(v)], axis=1)
    k_pos = jnp.concatenate([cache.positions, q_pos], axis=1)
    qp, kp = q_pos[:, :, None], k_pos[:, None, :]
    allowed = (qp >= 0) & (kp >= 0) & (kp <= qp)
    if cache.window is not None:
        allowed &= qp - kp < cache.window
    ok = _complete_rows(cache, q_pos, q_pos, k_pos, "cached_attention")
    kp = jnp.broadcast_to(kp, allowed.shape)
    structural = allowed
    if mask is not None:
        m, ok_m = _by_position("mask", mask, kp, structural, q_pos)
        allowed &= m
        ok &= ok_m
    key_bias = None
    if bias is not None:
        bv, ok_b = _by_position("bias", bias, kp, structural, q_pos)
        key_bias = jnp.where(allowed, bv, 0.0)[:, None]
        ok &= ok_b
    out = dot_product_attention(
        jnp.asarray(q), keys, values, key_bias, allowed[:, None], scale=scale, softcap=softcap
    )
    return _nan_rows(out, ok), _append(cache, k, v, q_pos, lengths)


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
    """Attend from queries to the cached tokens only, without appending anything:
    ``o_i = softmax_j(scale q_i . k_j + bias_i[pos_j]) v_j`` over filled slots ``j``.

    Every filled slot is a candidate; ``query_positions`` (optional, ``-1`` = padding query)
    adds the causal rule ``pos_j <= pos_i`` (and the window), and ``mask``/``bias``
    (``[B, L, P]``, by absolute key position) select and shift keys. This is the
    encoder-decoder pattern: a prefilled cache read by queries one step at a time.

    A query at position ``p`` needs the keys ``max(0, p - W + 1) <= j <= min(p, lengths - 1)``;
    without ``query_positions`` a cache without a window needs all ``lengths`` tokens (a ring
    buffer is read as it is). A row whose needed keys were overwritten, or whose attended
    positions reach past ``P``, raises ``ValueError`` eagerly, is NaN under plain ``jax.jit``
    and raises ``checkify.JaxRuntimeError`` under :func:`attnref.checked`.

    Args:
        cache: A filled cache (:class:`KVCache`); it is not modified.
        q: The queries ``[B, L, N, H]`` (``N`` a multiple of the cache's ``K`` heads), the
            cache's dtype.
        query_positions: Integer ``[B, L]``, each query's absolute position (``-1`` = padding
            query, zero output); ``None`` (default): no causal rule, every filled slot (within
            the ring buffer) is read.
        mask: Boolean ``[B, L, P]`` by absolute key position, ``True`` = may attend; ``None``
            (default) allows every candidate key.
        bias: ``[B, L, P]`` by absolute key position, added to the logits; ``None`` (default)
            adds nothing.
        scale: The logit scale; ``None`` (default) means ``1/sqrt(H)``.
        softcap: A positive number ``c``: logits become ``c tanh(s / c)``; ``None`` (default):
            no cap.

    Returns:
        ``o [B, L, N, H_v]``; a query with no readable key gets a zero row.

    Raises:
        ValueError: If ``q`` is not ``[B, L, N, H]`` for the cache, ``query_positions`` is not
            an integer ``[B, L]`` array, ``mask``/``bias`` are not ``[B, L, P]``, or, eagerly, a
            needed key was overwritten or ``P`` is too short; or for the errors of
            :func:`attnref.dot_product_attention` (e.g. ``N`` not a multiple of ``K``).
        TypeError: If ``q`` does not have the cache's dtype.
    """
    b, c = cache.positions.shape
    if np.ndim(q) != 4 or np.shape(q)[0] != b or np.shape(q)[3] != cache.k.shape[3]:
        raise ValueError(f"q has shape {np.shape(q)}; expected [B={b}, L, N, H={cache.k.shape[3]}]")
    length = int(np.shape(q)[1])
    _check_dtypes(cache, q=q)
    kp = jnp.broadcast_to(cache.positions[:, None, :], (b, length, c))
    allowed = kp >= 0
    qp_arr: Array | None = None
    last = jnp.broadcast_to(cache.lengths[:, None] - 1, (b, length))
    if query_positions is not None:
        if np.shape(query_positions) != (b, length) or not np.issubdtype(
            dtype_of(query_positions), np.integer
        ):
            raise ValueError(
                f"query_positions must be an integer [B={b}, L={length}] array, got shape "
                f"{np.shape(query_positions)} and dtype {dtype_of(query_positions)}"
            )
        qp_arr = jnp.asarray(query_positions, jnp.int32)
        qp = qp_arr[:, :, None]
        allowed &= (qp >= 0) & (kp <= qp)
        if cache.window is not None:
            allowed &= qp - kp < cache.window
        ok = _complete_rows(
            cache, qp_arr, jnp.minimum(qp_arr, last), cache.positions, "cache_attend"
        )
    elif cache.window is None:  # every token so far is needed
        ok = _complete_rows(cache, last, last, cache.positions, "cache_attend")
    else:
        ok = jnp.ones((b, length), bool)
    structural = allowed
    if mask is not None:
        m, ok_m = _by_position("mask", mask, kp, structural, qp_arr)
        allowed &= m
        ok &= ok_m
    key_bias = None
    if bias is not None:
        bv, ok_b = _by_position("bias", bias, kp, structural, qp_arr)
        key_bias = jnp.where(allowed, bv, 0.0)[:, None]
        ok &= ok_b
    out = dot_product_attention(
        jnp.asarray(q), cache.k, cache.v, key_bias, allowed[:, None], scale=scale, softcap=softcap
    )
    return _nan_rows(out, ok)


def project(x: Array, w: Any, b: Any) -> Array:
    """``x W[h] + b[h]`` in kernel layout ``[B, L, heads, d]``."""
    y = jnp.einsum("bld,hde->blhe", x, jnp.asarray(w), precision=HIGHEST)
    return y if b is None else y + jnp.asarray(b)


def _check_multihead(params: AttentionParams, cache: KVCache, **xs: Any) -> int:
    """Parameters, cache and token inputs share one dtype; returns ``d_model``."""
    _, d_model, _, _ = check_params(params)
    p_dtype = dtype_of(params.w_q)
    if dtype_of(cache.k) != p_dtype:
        raise TypeError(
            f"the cache has dtype {dtype_of(cache.k)} but params.w_q has dtype {p_dtype}; attnref "
            "does not mix dtypes: build the cache with init_cache(params, ...)"
        )
    for name, x in xs.items():
        if x is not None and dtype_of(x) != p_dtype:
            raise TypeError(
                f"{name} has dtype {dtype_of(x)} but params.w_q has dtype {p_dtype}; attnref does "
                "not mix dtypes, cast explicitly"
            )
    return d_model


@float64_scoped
def step(
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
    ``mask``/``bias`` as in :func:`cached_attention` (indexed by absolute key position), and so
    are the value errors: a row that overflows the cache is NaN under plain ``jax.jit`` (all
    ``d_model`` entries) and raises under :func:`attnref.checked`. ``params``, ``cache`` and
    ``x`` share one dtype (``TypeError`` otherwise).

    Args:
        params: Per-head weights (:class:`attnref.AttentionParams`); the cache holds their
            ``K`` key/value heads.
        cache: The cache (:class:`KVCache`, e.g. from :func:`init_cache`).
        x: The chunk's tokens, row vectors ``[B, L, d_model]`` (``L = 1``: one decoding step).
        valid: Boolean ``[B, L]``, ``True`` = a real token; padding tokens are skipped and get
            zero output rows. ``None`` (default) means every token is real.
        x_kv: The chunk's key/value tokens ``[B, L, d_model]``; ``None`` (default) means ``x``.
        mask: Boolean ``[B, L, P]`` by absolute key position, ``True`` = may attend; ``None``
            (default): the causal (and window) rule only.
        bias: ``[B, L, P]`` by absolute key position, added to the logits; ``None`` (default)
            adds nothing.
        scale: The logit scale; ``None`` (default) means ``1/sqrt(d_k)``.

    Returns:
        ``(y, cache)``: the block output ``y [B, L, d_model]`` (zero rows for padding tokens,
        no residual) and the updated :class:`KVCache`.

    Raises:
        ValueError: If ``params`` is malformed, ``x`` is not ``[B, L, d_model]``, ``x_kv`` does
            not have the shape of ``x``, or for the errors of :func:`cached_attention`.
        TypeError: If ``params``, ``cache``, ``x`` and ``x_kv`` do not share one dtype, or
            ``valid`` is not boolean.
    """
    d_model = _check_multihead(params, cache, x=x, x_kv=x_kv)
    x = jnp.asarray(x)
    if x.ndim != 3 or x.shape[-1] != d_model:
        raise ValueError(f"x has shape {x.shape}; expected [B, L, d_model={d_model}]")
    x_kv = x if x_kv is None else jnp.asarray(x_kv)
    if x_kv.shape != x.shape:
        raise ValueError(f"x_kv has shape {x_kv.shape}; expected the shape of x, {x.shape}")
    q = project(x, params.w_q, params.b_q)
    k = project(x_kv, params.w_k, params.b_k)
    v = project(x_kv, params.w_v, params.b_v)
    o, cache = cached_attention(cache, q, k, v, valid, mask=mask, bias=bias, scale=scale)
    y = jnp.einsum("blhv,hvd->bld", o, jnp.asarray(params.w_o), precision=HIGHEST)
    if params.b_o is not None:
        y = y + jnp.asarray(params.b_o)
    if valid is not None:
        y = jnp.where(jnp.asarray(valid)[..., None], y, 0.0)
    return y, cache


def init_cache(
    params: AttentionParams,
    batch: int,
    capacity: int,
    *,
    window: int | None = None,
) -> KVCache:
    """An empty cache shaped for ``params`` (its K/V heads, ``d_k``, ``d_v`` and dtype).

    Args:
        params: Per-head weights (:class:`attnref.AttentionParams`).
        batch: The batch size ``B``, a positive int.
        capacity: The number of slots ``C``, a positive int.
        window: ``None`` (default: the cache must hold the whole sequence) or a positive int
            ``W <= capacity`` (a ring buffer of the last ``W`` positions).

    Returns:
        An empty :class:`KVCache` ``[B, C, K, d_k]``/``[B, C, K, d_v]`` in the dtype of
        ``params``.

    Raises:
        ValueError: As :func:`kv_cache_init` (sizes not positive ints, a bad ``window``).
    """
    kv_heads = int(np.shape(params.w_k)[0])
    return kv_cache_init(
        batch, capacity, kv_heads, params.d_k, params.d_v, window=window, dtype=params.dtype
    )


@float64_scoped
def scan(
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
    """Feed ``xs`` one token at a time through :func:`step` with ``lax.scan``;
    row ``t`` of ``mask``/``bias`` goes with token ``t`` (indexed by absolute key position);
    ``xs_kv`` (default ``xs``) supplies each token's keys and values.

    A cache without a window must hold ``lengths + (real tokens of xs)``: checked before the
    scan (``ValueError`` eagerly, ``checkify.JaxRuntimeError`` under :func:`attnref.checked`);
    under plain ``jax.jit`` the rows that need overwritten keys are NaN.

    Args:
        params: Per-head weights (:class:`attnref.AttentionParams`).
        cache: The cache to decode into (:class:`KVCache`, e.g. from :func:`init_cache`).
        xs: The tokens, row vectors ``[B, T, d_model]``, fed one per step.
        valid: Boolean ``[B, T]``, ``True`` = a real token; ``None`` (default): all real.
        xs_kv: The tokens' keys/values ``[B, T, d_model]``; ``None`` (default) means ``xs``.
        mask: Boolean ``[B, T, P]``, row ``t`` for token ``t``, by absolute key position;
            ``None`` (default): causal (and window) only.
        bias: ``[B, T, P]`` like ``mask``, added to the logits; ``None`` (default): none.
        scale: The logit scale; ``None`` (default) means ``1/sqrt(d_k)``.

    Returns:
        ``(ys, cache)``: the outputs ``[B, T, d_model]`` (zero rows for padding) and the final
        :class:`KVCache`.

    Raises:
        ValueError: If ``xs`` is not rank 3, ``valid`` is not ``[B, T]``, (eagerly) the cache
            would overflow, or for the errors of :func:`step`.
        TypeError: If ``params``, ``cache``, ``xs`` and ``xs_kv`` do not share one dtype, or
            ``valid`` is not boolean.
    """
    _check_multihead(params, cache, xs=xs, xs_kv=xs_kv)
    xs = jnp.asarray(xs)
    if xs.ndim != 3:
        raise ValueError(f"xs has shape {xs.shape}; expected [B, T, d_model]")
    steps = {"x": jnp.swapaxes(xs, 0, 1)}
    steps["x_kv"] = steps["x"] if xs_kv is None else jnp.swapaxes(jnp.asarray(xs_kv), 0, 1)
    if valid is not None and np.shape(valid) != xs.shape[:2]:
        raise ValueError(
            f"valid must be a boolean [B, T] = {xs.shape[:2]} array, got shape {np.shape(valid)} "
            f"and dtype {dtype_of(valid)}"
        )
    if valid is not None and dtype_of(valid) != np.bool_:
        raise TypeError(
            f"valid must be boolean (True = a real token), got dtype {dtype_of(valid)} "
            f"(shape {np.shape(valid)})"
        )
    valid_a = jnp.ones(xs.shape[:2], bool) if valid is None else jnp.asarray(valid)
    _require_room(cache, jnp.sum(valid_a, axis=1, dtype=jnp.int32))
    steps["valid"] = jnp.swapaxes(valid_a, 0, 1)
    if mask is not None:
        steps["mask"] = jnp.swapaxes(jnp.asarray(mask), 0, 1)
    if bias is not None:
        steps["bias"] = jnp.swapaxes(jnp.asarray(bias), 0, 1)

    def body(c: KVCache, inp: dict[str, Array]) -> tuple[KVCache, Array]:
        extra = {name: inp[name][:, None] for name in ("mask", "bias") if name in inp}
        y, c = step(
            params,
            c,
            inp["x"][:, None],
            inp["valid"][:, None],
            x_kv=inp["x_kv"][:, None],
            scale=scale,
            **extra,
        )
        return c, y[:, 0]

    cache, ys = jax.lax.scan(body, cache, steps)
    return jnp.swapaxes(ys, 0, 1), cache


@float64_scoped
def generate(
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

    Returns the inputs ``x_0..x_{steps-1}``, the outputs ``y_t`` and the final cache. A cache
    without a window must hold ``lengths + steps`` tokens: ``ValueError`` eagerly,
    ``checkify.JaxRuntimeError`` under :func:`attnref.checked`; under plain ``jax.jit`` the
    outputs that need overwritten keys are NaN (and so is everything generated from them).

    Args:
        params: Per-head weights (:class:`attnref.AttentionParams`).
        cache: The cache to decode into (:class:`KVCache`), e.g. prefilled by :func:`step`.
        x0: The first input token ``[B, d_model]``, the dtype of ``params``.
        steps: The number of steps, a non-negative int (static under ``jax.jit``).
        next_input: ``next_input(x_t, y_t) -> x_{t+1}``, both ``[B, d_model]``.
        scale: The logit scale; ``None`` (default) means ``1/sqrt(d_k)``.

    Returns:
        ``(xs, ys, cache)``: the inputs ``[B, steps, d_model]``, the outputs
        ``[B, steps, d_model]`` and the final :class:`KVCache`.

    Raises:
        ValueError: If ``steps`` is not a non-negative int, ``params`` is malformed, or
            (eagerly) the cache would overflow.
        TypeError: If ``params``, ``cache`` and ``x0`` do not share one dtype.
    """
    _check_multihead(params, cache, x0=x0)
    if not isinstance(steps, (int, np.integer)) or steps < 0:
        raise ValueError(f"steps must be a non-negative int (static under jax.jit), got {steps!r}")
    _require_room(cache, jnp.full(cache.lengths.shape, steps, jnp.int32))

    def body(carry: tuple[KVCache, Array], _: Any) -> tuple[tuple[KVCache, Array], Any]:
        c, x_t = carry
        y, c = step(params, c, x_t[:, None], scale=scale)
        return (c, next_input(x_t, y[:, 0])), (x_t, y[:, 0])

    (cache, _), (xs, ys) = jax.lax.scan(body, (cache, jnp.asarray(x0)), None, length=steps)
    return jnp.swapaxes(xs, 0, 1), jnp.swapaxes(ys, 0, 1), cache
