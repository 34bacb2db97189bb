"""KV-cached decoding: a cache pytree, chunked appends, ring buffers, and ``lax.scan`` generation.

A :class:`KVCache` holds ``C`` slots per batch element (keys, values, each slot's absolute
position, ``-1`` = empty, and ``lengths [B]``); token ``p`` lives in slot ``p mod C``. A query at
position ``p`` reads ``j <= p`` (with ``window = W``, a ring buffer: ``p - W < j <= p``).
:func:`cached_attention` appends a chunk of ``L`` tokens (``valid [B, L]`` marks real ones,
numbered consecutively) and attends from its queries to the cache and the chunk: at every step
the output equals causal attention over each sequence's prefix. A query needs the keys
``max(0, p - W + 1) <= j <= p``; one the cache no longer holds (or a ``mask``/``bias`` too short)
raises ``ValueError`` eagerly, gives NaN rows under ``jax.jit`` and raises under
:func:`attnref.checked` (``docs/kernel.md``, "KV-cached decoding").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Float, Int

from attnref._src.core.checks import float64_scoped
from attnref._src.core.entry import checked_program
from attnref._src.core.params import AttentionParams
from attnref._src.formulations.decode_cache import (
    KVCache,
    by_position,
    check_chunk,
    check_multihead,
    check_query,
    check_valid,
    complete_rows,
    documented,
    require_room,
)
from attnref._src.formulations.kernel import dot_product_attention, kernel_heads, output_rows

# ----------------------------------------------------------------------------- the formulas


def append(
    cache: KVCache, k: Any, v: Any, pos: Int[Array, "B L"], lengths: Int[Array, " B"]
) -> KVCache:
    """The token at position ``p`` goes to slot ``p mod C`` (padding, and a chunk's tokens
    older than its last ``C``, are dropped: no slot is written twice)."""
    c = cache.capacity
    keep = jnp.logical_and(pos >= 0, pos >= lengths[:, None] - c)
    slot = jnp.where(keep, pos % c, c)  # out-of-range slot: dropped by the scatter
    write = jax.vmap(lambda buf, s, new: buf.at[s].set(new, mode="drop"))  # per batch row
    return KVCache(
        k=write(cache.k, slot, jnp.asarray(k)),
        v=write(cache.v, slot, jnp.asarray(v)),
        positions=write(cache.positions, slot, pos),
        lengths=lengths,
        window=cache.window,
    )


def cached_step(
    cache: KVCache,
    q: Float[Array, "B L N H"],
    k: Float[Array, "B L K H"],
    v: Float[Array, "B L K H_v"],
    valid: Bool[Array, "B L"],
    options: dict[str, Any],
) -> tuple[Float[Array, "B L N H_v"], KVCache]:
    """Append the chunk, then attend from its queries to the cache and the chunk: token ``j``
    is read by query ``i`` iff ``pos_j <= pos_i`` (and ``pos_i - pos_j < W`` in a ring);
    ``options``: ``mask``, ``bias``, ``scale``, ``softcap`` (:func:`attend`)."""
    q_pos, lengths = chunk_positions(cache, valid)
    require_room(cache, lengths - cache.lengths)
    keys = jnp.concatenate([cache.k, k], axis=1)  # [B, C + L, K, H]
    values = jnp.concatenate([cache.v, v], axis=1)
    k_pos = jnp.concatenate([cache.positions, q_pos], axis=1)
    kp = jnp.broadcast_to(k_pos[:, None, :], (*q_pos.shape, k_pos.shape[1]))
    allowed = causal(cache, q_pos, kp)
    ok = complete_rows(cache, q_pos, q_pos, k_pos, "cached_attention")
    out = attend(q, keys, values, kp, allowed, ok, q_pos, **options)
    return out, append(cache, k, v, q_pos, lengths)


def cache_read(
    cache: KVCache,
    q: Float[Array, "B L N H"],
    qp: Int[Array, "B L"] | None,
    options: dict[str, Any],
) -> Float[Array, "B L N H_v"]:
    """Attend from ``q`` to the filled slots only (with ``qp``: ``pos_j <= qp_i`` and the
    window), appending nothing (``options`` as :func:`cached_step`'s)."""
    b, c = cache.positions.shape
    kp = jnp.broadcast_to(cache.positions[:, None, :], (b, q.shape[1], c))
    allowed = kp >= 0
    last = jnp.broadcast_to(cache.lengths[:, None] - 1, (b, q.shape[1]))
    if qp is not None:
        allowed = causal(cache, qp, kp)
        ok = complete_rows(cache, qp, jnp.minimum(qp, last), cache.positions, "cache_attend")
    elif cache.window is None:  # every token so far is needed
        ok = complete_rows(cache, last, last, cache.positions, "cache_attend")
    else:
        ok = jnp.ones((b, q.shape[1]), bool)
    return attend(q, cache.k, cache.v, kp, allowed, ok, qp, **options)


def causal(cache: KVCache, q_pos: Int[Array, "B L"], kp: Int[Array, "B L S"]) -> Array:
    """Real query ``i`` reads real key ``j`` iff ``pos_j <= pos_i`` (and ``pos_i - pos_j < W``)."""
    qp = q_pos[:, :, None]
    allowed = (qp >= 0) & (kp >= 0) & (kp <= qp)
    return allowed if cache.window is None else allowed & (qp - kp < cache.window)


def attend(
    q: Float[Array, "B L N H"],
    keys: Float[Array, "B S K H"],
    values: Float[Array, "B S K H_v"],
    kp: Int[Array, "B L S"],
    allowed: Bool[Array, "B L S"],
    ok: Bool[Array, "B L"],
    q_pos: Int[Array, "B L"] | None,
    mask: Any,
    bias: Any,
    scale: float | None,
    softcap: float | None,
) -> Float[Array, "B L N H_v"]:
    """``o_i = softmax_j(scale q_i . k_j + bias_i[pos_j]) v_j`` over the ``allowed`` keys with
    ``mask_i[pos_j]`` (``mask``/``bias`` ``[B, L, P]`` read at the keys' absolute positions
    ``kp``); NaN on the rows that are not ``ok`` (a needed key lost, a position past ``P``)."""
    structural = allowed
    if mask is not None:
        m, ok_m = by_position("mask", mask, kp, structural, q_pos)
        allowed, ok = allowed & m, ok & ok_m
    key_bias = None
    if bias is not None:
        bv, ok_b = by_position("bias", bias, kp, structural, q_pos)
        key_bias, ok = jnp.where(allowed, bv, 0.0)[:, None], ok & ok_b
    out = dot_product_attention(
        q, keys, values, key_bias, allowed[:, None], scale=scale, softcap=softcap
    )
    return jnp.where(ok[:, :, None, None], out, jnp.asarray(jnp.nan, out.dtype))


def chunk_positions(
    cache: KVCache, valid: Bool[Array, "B L"]
) -> tuple[Int[Array, "B L"], Int[Array, " B"]]:
    """Absolute positions of the chunk's real tokens (``-1`` for padding), and new lengths:
    real tokens are numbered consecutively from ``lengths``."""
    rank = jnp.cumsum(valid.astype(jnp.int32), axis=1) - 1
    pos = jnp.where(valid, cache.lengths[:, None] + rank, -1)
    return pos, cache.lengths + jnp.sum(valid, axis=1, dtype=jnp.int32)


# ----------------------------------------------------------------------------- kernel level


@documented(
    "cache k v valid",
    "    The updated :class:`KVCache` (``lengths`` advanced by the real tokens of each row).",
    """    ValueError: If ``k``/``v`` do not match the cache's ``[B, *, K, H]``/``H_v``, ``valid``
        is not ``[B, L]``, or (eagerly) a cache without a window overflows.
    TypeError: If ``k``/``v`` do not have the cache's dtype, or ``valid`` is not boolean.""",
)
@float64_scoped
@checked_program
def kv_cache_append(
    cache: KVCache,
    k: Float[ArrayLike, "B L K H"],
    v: Float[ArrayLike, "B L K H_v"],
    valid: Bool[ArrayLike, "B L"] | None = None,
) -> KVCache:
    """Write the chunk's real tokens to slots ``position mod C`` (a ring keeps its last ``C``);
    under plain ``jax.jit`` an overflow wraps and a later read needing a lost key is NaN."""
    valid = check_chunk(cache, k, v, valid)
    pos, lengths = chunk_positions(cache, valid)
    require_room(cache, lengths - cache.lengths)
    return append(cache, k, v, pos, lengths)


@documented(
    "cache q k v valid mask bias scale softcap",
    """    ``(o, cache)``: the chunk's output ``o [B, L, N, H_v]`` (zero rows for padding tokens)
    and the updated :class:`KVCache`.""",
    """    ValueError: If a chunk's shape does not match the cache, ``valid`` is not
        ``[B, L]``, ``mask``/``bias`` are not ``[B, L, P]``, or, eagerly, the cache
        overflows or ``P`` is too short for an attended position; or for the errors of
        :func:`attnref.dot_product_attention` (e.g. a bad ``softcap``).
    TypeError: If ``q``/``k``/``v`` do not have the cache's dtype, or ``valid`` is not
        boolean.""",
)
@float64_scoped
@checked_program
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
    and ``mask_i[pos_j]``, ``s_ij = scale q_i . k_j``; kernel layout ``[B, L, N, H]``. A mask
    written for the full sequence applies unchanged; the value errors are NaN rows under plain
    ``jax.jit`` and ``checkify.JaxRuntimeError`` under :func:`attnref.checked`."""
    valid = check_chunk(cache, k, v, valid, q, mask, bias)
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    options = dict(mask=mask, bias=bias, scale=scale, softcap=softcap)
    return cached_step(cache, q, k, v, valid, options)


@documented(
    "cache q query_positions mask bias scale softcap",
    "    ``o [B, L, N, H_v]``; a query with no readable key gets a zero row.",
    """    ValueError: If ``q`` is not ``[B, L, N, H]`` for the cache, ``query_positions`` is not
        an integer ``[B, L]`` array, ``mask``/``bias`` are not ``[B, L, P]``, or, eagerly, a
        needed key was overwritten or ``P`` is too short; or for the errors of
        :func:`attnref.dot_product_attention` (e.g. ``N`` not a multiple of ``K``).
    TypeError: If ``q`` does not have the cache's dtype.""",
    own="""
    cache: A filled cache (:class:`KVCache`); it is not modified.
    query_positions: Integer ``[B, L]``, each query's absolute position (``-1`` = padding
        query, zero output); ``None`` (default): no causal rule, every filled slot (within
        the ring buffer) is read.
    mask: Boolean ``[B, L, P]`` by absolute key position, ``True`` = may attend; ``None``
        (default) allows every candidate key.""",
)
@float64_scoped
@checked_program
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
    """Attend from queries to the cached tokens only, appending nothing (the encoder-decoder
    pattern): ``o_i = softmax_j(scale q_i . k_j + bias_i[pos_j]) v_j`` over filled slots ``j``.
    A query at ``p`` needs the keys ``max(0, p - W + 1) <= j <= min(p, lengths - 1)`` (all
    ``lengths`` tokens without ``query_positions`` or window); a row missing one is an error as
    in :func:`cached_attention`."""
    qp = check_query(cache, q, query_positions, mask, bias)
    options = dict(mask=mask, bias=bias, scale=scale, softcap=softcap)
    return cache_read(cache, jnp.asarray(q), qp, options)


# ----------------------------------------------------------------------------- weight level


@documented(
    "params cache x valid x_kv mask bias scale",
    """    ``(y, cache)``: the block output ``y [B, L, d_model]`` (zero rows for padding tokens,
    no residual) and the updated :class:`KVCache`.""",
    """    ValueError: If ``params`` is malformed, ``x`` is not ``[B, L, d_model]``, ``x_kv`` does
        not have the shape of ``x``, or for the errors of :func:`cached_attention`.
    TypeError: If ``params``, ``cache``, ``x`` and ``x_kv`` do not share one dtype, or
        ``valid`` is not boolean.""",
    own="""
    x: The chunk's tokens, row vectors ``[B, L, d_model]`` (``L = 1``: one decoding step).
    x_kv: The chunk's key/value tokens ``[B, L, d_model]``; ``None`` (default) means ``x``.""",
)
@float64_scoped
@checked_program
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
    """Multi-head decoding step: project the chunk (``q = x W_Q + b_Q``; ``k``, ``v`` from
    ``x_kv`` with the K/V heads of ``params``), append ``k, v``, attend as
    :func:`cached_attention` and return ``sum_n o_n W_O[n] + b_O``."""
    d_model = check_multihead(params, cache, x=x, x_kv=x_kv)
    x = jnp.asarray(x)
    if x.ndim != 3 or x.shape[-1] != d_model:
        raise ValueError(f"x has shape {x.shape}; expected [B, L, d_model={d_model}]")
    x_kv = x if x_kv is None else jnp.asarray(x_kv)
    if x_kv.shape != x.shape:
        raise ValueError(f"x_kv has shape {x_kv.shape}; expected the shape of x, {x.shape}")
    q = kernel_heads(x, params.w_q, params.b_q)
    k = kernel_heads(x_kv, params.w_k, params.b_k)
    v = kernel_heads(x_kv, params.w_v, params.b_v)
    o, cache = cached_attention(cache, q, k, v, valid, mask=mask, bias=bias, scale=scale)
    y = output_rows(params, o, x, False)
    if valid is not None:
        y = jnp.where(jnp.asarray(valid)[..., None], y, 0.0)
    return y, cache


@documented(
    "params cache xs valid xs_kv mask bias scale",
    """    ``(ys, cache)``: the outputs ``[B, T, d_model]`` (zero rows for padding) and the final
    :class:`KVCache`.""",
    """    ValueError: If ``xs`` is not rank 3, ``valid`` is not ``[B, T]``, (eagerly) the cache
        would overflow, or for the errors of :func:`step`.
    TypeError: If ``params``, ``cache``, ``xs`` and ``xs_kv`` do not share one dtype, or
        ``valid`` is not boolean.""",
    own="""
    xs: The tokens, row vectors ``[B, T, d_model]``, fed one per step.
    valid: Boolean ``[B, T]``, ``True`` = a real token; ``None`` (default): all real.
    xs_kv: The tokens' keys/values ``[B, T, d_model]``; ``None`` (default) means ``xs``.
    mask: Boolean ``[B, T, P]``, row ``t`` for token ``t``, by absolute key position;
        ``None`` (default): causal (and window) only.
    bias: ``[B, T, P]`` like ``mask``, added to the logits; ``None`` (default): none.""",
)
@float64_scoped
@checked_program
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
    """Feed ``xs`` one token at a time through :func:`step` with ``lax.scan``. A cache without
    a window must hold ``lengths + (real tokens of xs)``, checked before the scan."""
    check_multihead(params, cache, xs=xs, xs_kv=xs_kv)
    xs = jnp.asarray(xs)
    if xs.ndim != 3:
        raise ValueError(f"xs has shape {xs.shape}; expected [B, T, d_model]")
    valid_a = check_valid(valid, xs.shape[:2], f"[B, T] = {xs.shape[:2]}")
    require_room(cache, jnp.sum(valid_a, axis=1, dtype=jnp.int32))
    given = {"x": xs, "x_kv": xs_kv, "valid": valid_a, "mask": mask, "bias": bias}
    steps = {name: jnp.swapaxes(jnp.asarray(a), 0, 1) for name, a in given.items() if a is not None}

    def body(c: KVCache, inp: dict[str, Array]) -> tuple[KVCache, Array]:  # step's arguments
        y, c = step(params, c, scale=scale, **{name: a[:, None] for name, a in inp.items()})
        return c, y[:, 0]

    cache, ys = jax.lax.scan(body, cache, steps)
    return jnp.swapaxes(ys, 0, 1), cache


@documented(
    "params cache x0 steps next_input scale",
    """    ``(xs, ys, cache)``: the inputs ``[B, steps, d_model]``, the outputs
    ``[B, steps, d_model]`` and the final :class:`KVCache`.""",
    """    ValueError: If ``steps`` is not a non-negative int, ``params`` is malformed, or
        (eagerly) the cache would overflow.
    TypeError: If ``params``, ``cache`` and ``x0`` do not share one dtype.""",
    own="""
    x0: The first input token ``[B, d_model]``, the dtype of ``params``.
    steps: The number of steps, a non-negative int (static under ``jax.jit``).
    next_input: ``next_input(x_t, y_t) -> x_{t+1}``, both ``[B, d_model]``.""",
)
@float64_scoped
@checked_program
def generate(
    params: AttentionParams,
    cache: KVCache,
    x0: Float[ArrayLike, "B d_model"],
    steps: int,
    next_input: Callable[[Array, Array], Array],
    *,
    scale: float | None = None,
) -> tuple[Float[Array, "B steps d_model"], Float[Array, "B steps d_model"], KVCache]:
    """Autoregressive generation with ``lax.scan``: ``y_t = step(x_t)``, then
    ``x_{t+1} = next_input(x_t, y_t)``. A cache without a window must hold ``lengths + steps``
    tokens (under plain ``jax.jit`` what is generated from a NaN row is NaN)."""
    check_multihead(params, cache, x0=x0)
    if not isinstance(steps, (int, np.integer)) or steps < 0:
        raise ValueError(f"steps must be a non-negative int (static under jax.jit), got {steps!r}")
    require_room(cache, jnp.full(cache.lengths.shape, steps, jnp.int32))

    def body(carry: tuple[KVCache, Array], _: Any) -> tuple[tuple[KVCache, Array], Any]:
        c, x_t = carry
        y, c = step(params, c, x_t[:, None], scale=scale)
        return (c, next_input(x_t, y[:, 0])), (x_t, y[:, 0])

    (cache, _), (xs, ys) = jax.lax.scan(body, (cache, jnp.asarray(x0)), None, length=steps)
    return jnp.swapaxes(xs, 0, 1), jnp.swapaxes(ys, 0, 1), cache
