"""The KV cache of :mod:`attnref._src.formulations.decode`: the pytree, its constructors, and
the checks of the decoding calls (value errors raise eagerly, NaN rows under ``jax.jit``)."""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Callable
from typing import Any, TypeVar, no_type_check

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from attnref._src.core.checked import require
from attnref._src.core.checks import check_params, dtype_of, in_x64_if_float64
from attnref._src.core.params import AttentionParams

F = TypeVar("F", bound=Callable[..., Any])


# @no_type_check: no runtime check of the fields (the suite's jaxtyping hook), since JAX rebuilds
# a pytree with any leaves (tree_map results, vmap axes, placeholders).
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
@no_type_check
class KVCache:
    """Per-batch key/value slots with their absolute positions (a JAX pytree); build one with
    :func:`kv_cache_init` (kernel level) or :func:`init_cache` (from params).

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
    positions: Int[Array, "B C"]
    lengths: Int[Array, " B"]
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
    """An empty cache.

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

    sizes = dict(batch=batch, capacity=capacity, num_kv_heads=num_kv_heads, head_dim=head_dim)
    sizes["head_dim_v"] = head_dim if head_dim_v is None else head_dim_v
    for name, val in sizes.items():
        if not is_int(val) or val < 1:
            raise ValueError(f"{name} must be a positive int, got {val!r}")
    batch, capacity, num_kv_heads, head_dim, h_v = (int(v) for v in sizes.values())
    if window is not None and (not is_int(window) or window < 1 or capacity < window):
        raise ValueError(
            f"window must be a positive int no larger than capacity={capacity}, got {window!r}"
        )

    def empty() -> KVCache:
        return KVCache(
            k=jnp.zeros((batch, capacity, num_kv_heads, head_dim), dtype),
            v=jnp.zeros((batch, capacity, num_kv_heads, h_v), dtype),
            positions=jnp.full((batch, capacity), -1, jnp.int32),
            lengths=jnp.zeros((batch,), jnp.int32),
            window=None if window is None else int(window),
        )

    # a float64 cache is float64, never silently float32
    return in_x64_if_float64(dtype, empty)


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
        An empty :class:`KVCache` ``[B, C, K, d_k]``/``[B, C, K, d_v]``, ``params``'s dtype.

    Raises:
        ValueError: As :func:`kv_cache_init` (sizes not positive ints, a bad ``window``).
    """
    kv_heads = int(np.shape(params.w_k)[0])
    return kv_cache_init(
        batch, capacity, kv_heads, params.d_k, params.d_v, window=window, dtype=params.dtype
    )


# ----------------------------------------------------------------------------- validation


def one_dtype(want: Any, owner: str, fix: str, **arrays: Any) -> None:
    """Every array (``None`` skipped) has dtype ``want``, that of ``owner``: attnref never mixes
    dtypes (``TypeError`` naming both, and ``fix``, formatted with ``name`` and ``dtype``)."""
    for name, a in arrays.items():
        if a is not None and dtype_of(a) != want:
            raise TypeError(
                f"{name} has dtype {dtype_of(a)} but {owner} has dtype {want}; "
                + fix.format(name=name, dtype=dtype_of(a))
            )


def check_dtypes(cache: KVCache, **arrays: Any) -> None:
    """The cache and every new array share one floating dtype."""
    one_dtype(dtype_of(cache.k), "cache.k", "a cache holds one dtype", **{"cache.v": cache.v})
    fix = "attnref does not mix dtypes: cast {name} explicitly or build the cache with "
    fix += "dtype={dtype}"
    one_dtype(dtype_of(cache.k), "the cache", fix, **arrays)


def check_valid(valid: Any, shape: tuple[int, ...], want: str) -> Array:
    """``valid`` (``None``: every token real) as a boolean array of ``shape``."""
    if valid is None:
        return jnp.ones(shape, bool)
    if np.shape(valid) != shape:
        raise ValueError(
            f"valid must be a boolean {want} array, got shape {np.shape(valid)} "
            f"and dtype {dtype_of(valid)}"
        )
    if dtype_of(valid) != np.bool_:
        raise TypeError(
            f"valid must be boolean (True = a real token), got dtype {dtype_of(valid)} "
            f"(shape {np.shape(valid)})"
        )
    return jnp.asarray(valid)


def check_chunk(
    cache: KVCache, k: Any, v: Any, valid: Any, q: Any = None, mask: Any = None, bias: Any = None
) -> Array:
    """Static checks of a chunk (shapes, dtypes); returns ``valid`` as a ``[B, L]`` array."""
    (b, _, kh, h), h_v = cache.k.shape, cache.v.shape[-1]
    ks, qs = np.shape(k), np.shape(q)
    if len(ks) != 4 or ks[0] != b or ks[2:] != (kh, h):
        raise ValueError(f"key chunk has shape {ks}; expected [B={b}, L, K={kh}, H={h}]")
    if np.shape(v) != (*ks[:3], h_v):
        raise ValueError(f"value chunk has shape {np.shape(v)}; expected {(*ks[:3], h_v)}")
    length = ks[1]
    if q is not None and (len(qs) != 4 or qs[:2] != (b, length) or qs[3] != h or qs[2] % kh):
        raise ValueError(
            f"query chunk has shape {qs}; expected [B={b}, L={length}, N, H={h}] with N a "
            f"multiple of K={kh}"
        )
    check_dtypes(cache, q=q, k=k, v=v)
    valid = check_valid(valid, (b, length), f"[B={b}, L={length}]")
    check_by_position(b, length, mask=mask, bias=bias)
    return valid


def check_query(
    cache: KVCache, q: Any, query_positions: Any, mask: Any = None, bias: Any = None
) -> Array | None:
    """Queries ``[B, L, N, H]`` of the cache's ``B``, ``H`` and dtype, their integer positions
    ``[B, L]`` (returned as int32; ``None`` stays ``None``), and ``mask``/``bias``."""
    b, h = cache.k.shape[0], cache.k.shape[3]
    if np.ndim(q) != 4 or np.shape(q)[0] != b or np.shape(q)[3] != h:
        raise ValueError(f"q has shape {np.shape(q)}; expected [B={b}, L, N, H={h}]")
    check_dtypes(cache, q=q)
    length, qp = np.shape(q)[1], query_positions
    if qp is not None and (
        np.shape(qp) != (b, length) or not np.issubdtype(dtype_of(qp), np.integer)
    ):
        raise ValueError(
            f"query_positions must be an integer [B={b}, L={length}] array, got shape "
            f"{np.shape(qp)} and dtype {dtype_of(qp)}"
        )
    check_by_position(b, length, mask=mask, bias=bias)
    return None if qp is None else jnp.asarray(qp, jnp.int32)


def check_by_position(b: int, length: int, **arrays: Any) -> None:
    """Each given ``mask``/``bias`` is ``[B, L, P]``, indexed by absolute key position."""
    for name, a in arrays.items():
        if a is not None and (np.ndim(a) != 3 or np.shape(a)[:2] != (b, length)):
            raise ValueError(
                f"{name} has shape {np.shape(a)}; expected [B={b}, L={length}, P] indexed by "
                "absolute key position"
            )


def check_multihead(params: AttentionParams, cache: KVCache, **xs: Any) -> int:
    """Parameters, cache and token inputs share one dtype; returns ``d_model``."""
    _, d_model, _, _ = check_params(params)
    p_dtype = dtype_of(params.w_q)
    fix = "attnref does not mix dtypes: build the cache with init_cache(params, ...)"
    one_dtype(p_dtype, "params.w_q", fix, **{"the cache": cache.k})
    one_dtype(p_dtype, "params.w_q", "attnref does not mix dtypes, cast explicitly", **xs)
    return d_model


# ----------------------------------------------------------------------------- value checks


def require_room(cache: KVCache, added: Any) -> None:
    """Without a window the cache must hold the whole sequence: ``lengths + added <= C``
    (:func:`~attnref._src.core.checked.require`; unchecked, reads of lost keys are NaN rows)."""
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


def complete_rows(
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


def by_position(
    name: str,
    a: Any,
    kp: Int[Array, "B L S"],
    attended: Bool[Array, "B L S"],
    q_pos: Int[Array, "B L"] | None,
) -> tuple[Array, Bool[Array, "B L"]]:
    """Gather ``a[b, i, kp[b, i, s]]`` (a ``[B, L, P]`` mask or bias by absolute key position)
    and, per query row, whether every attended position is ``< P`` (checked by ``require``)."""
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


# ----------------------------------------------------------------------------- Args text
#
# The Args text of the decoding functions, each argument written once; a function that words an
# argument differently (``cache_attend``'s mask, ``scan``'s per-token rows) gives its own entry.

_ARGS = """
    params: Per-head weights (:class:`attnref.AttentionParams`); the cache holds their ``K``
        key/value heads.
    cache: The cache (:class:`KVCache`, e.g. from :func:`init_cache`); ``K``, ``H``, ``H_v``
        and the dtype come from it.
    q: The chunk's queries ``[B, L, N, H]`` (``N`` a multiple of the cache's ``K`` heads), the
        cache's dtype.
    k: The chunk's keys ``[B, L, K, H]``, the cache's dtype.
    v: The chunk's values ``[B, L, K, H_v]``, the cache's dtype.
    valid: Boolean ``[B, L]``, ``True`` = a real token; padding is neither appended nor
        attended from (zero output rows), and real tokens are numbered consecutively.
        ``None`` (default) means every token is real.
    mask: Boolean ``[B, L, P]`` by absolute key position, ``True`` = may attend; ``None``
        (default): the causal (and window) rule only.
    bias: ``[B, L, P]`` by absolute key position, added to the (softcapped) logits; ``None``
        (default) adds nothing.
    scale: The logit scale; ``None`` (default) means ``1/sqrt(H)`` (``1/sqrt(d_k)`` at the
        weight level).
    softcap: A positive number ``c``: logits become ``c tanh(s / c)``; ``None`` (default):
        no cap.
"""


def entries(block: str) -> dict[str, str]:
    """``name -> entry`` of an Args block (an entry: its first line, indented by 4, and the
    rest, indented by 8)."""
    return {m[1]: m[0] for m in re.finditer(r"^ {4}(\w+):.*(?:\n {8}.*)*", block, re.MULTILINE)}


def documented(names: str, returns: str, raises: str, own: str = "") -> Callable[[F], F]:
    """Append Args (the entries ``names`` of the shared table, or of ``own`` where a function
    words one differently), Returns and Raises to a decoding function's docstring."""
    table = {**entries(_ARGS), **entries(own)}

    def attach(fn: F) -> F:
        args = "\n".join(table[name] for name in names.split())
        doc = inspect.cleandoc(fn.__doc__ or "")
        fn.__doc__ = f"{doc}\n\nArgs:\n{args}\n\nReturns:\n{returns}\n\nRaises:\n{raises}\n"
        return fn

    return attach
