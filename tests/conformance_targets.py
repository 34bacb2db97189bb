"""Small attention functions for ``tests/test_conformance.py`` and
``tests/test_conformance_cli.py``: targets for ``attnref check`` and the pytest plugin
(``tests.conformance_targets:good`` and so on).

``good`` is jax.nn's own XLA attention (it needs ``masked_rows="uniform"`` declared);
``wrong_scale`` is the same with the logits scaled by twice the right factor, which the
``oracle`` property catches; ``NOT_CALLABLE`` is a target that loads but cannot be called.

The other targets are :func:`attnref.dot_product_attention` with one deliberate defect each, the
defects of issue 11 that the kit once passed:

* ``mask_row0_only``: a mask that broadcasts over the query axis (``[.., 1, S]``, the usual
  key-padding mask) is applied to query row 0 only;
* ``padded_broadcast``: the pre-fix ``blockwise_dot_product_attention``: a mask or bias that
  broadcasts over the query axis is broadcast to ``[.., T, S]`` and rows ``1..`` are filled the
  way padding would be (``False``, ``-inf``), so they come out as if fully masked;
* ``lse_none``: returns ``(out, None)`` when the lse is asked for;
* ``all_nan``: NaN everywhere, of the right shape;
* ``wrong_shape``: the output in the ``[B, N, T, H_v]`` layout;
* ``raises``: raises from inside a helper (the report must show the traceback).

Tail-tile faults, the commonest bug of a real kernel: jax.nn's attention with one tiling fault
each, right at every length below its tile (so the small buckets, ``T, S <= 7``, never see it);
the default check draws tile-straddling lengths and must fail each:

* ``past_tile`` (= ``skip_key_tail_128``): when ``S`` is past one 128-key tile and not a multiple
  of 128, the keys of the last, partial tile are dropped (never visited);
* ``skip_key_tail_64``: the same with 64-key tiles;
* ``skip_query_tail_64``: when ``T`` is past one 64-query tile and not a multiple of 64, the rows
  of the last, partial query tile are never written (left at zero);
* ``drop_key_128``: when ``S > 128``, key 128, the first one past the first 128-key tile, is
  skipped (an off-by-one at the tile boundary).

Distributed kernels (``check_attention(fn, devices=...)``), written the way a user would, with
``jax.shard_map`` and ``jax.lax.ppermute`` directly: ring attention (K/V chunks rotated around the
mesh, each device's state ``(o, lse)`` merged with the next chunk's, Liu et al. 2023), forward
only, with causal masking by global positions, GQA, ``T != S`` and the lse. Lengths must be
multiples of ``P`` (``2P`` for zigzag): the kit draws such lengths.

* ``ring``: contiguous layout, the stable merge in float32 (correct);
* ``zigzag``: the zigzag layout (device ``d`` holds chunks ``d`` and ``2P - 1 - d`` of ``2P``), the
  same merge (correct);
* ``zigzag_misordered``: zigzag whose inverse layout puts the second halves back in device order
  instead of reversed: at ``P = 2`` chunks 2 and 3 trade places (right at ``P = 1``);
* ``ring_naive_merge``: the merge written ``lse + log(1 + exp(lse_b - lse))``, which overflows
  ``exp`` once a later chunk's lse exceeds the running one by 88 in float32 (EasyContext #14);
* ``ring_state_in_input_dtype``: the running output kept in the input dtype, so bfloat16 inputs
  round it to bfloat16 at every ring step and the error grows with ``P`` (ring-flash-attention
  #42; float32 inputs are unaffected);
* ``zigzag_padded_unmasked``: zigzag that accepts any length by padding ``T`` and ``S`` with
  zeros up to a multiple of ``2P`` and dropping the padded query rows, but forgets to mask the
  padded keys: each is a logit 0 with a zero value, so a non-causal row's weights are diluted
  (EasyContext #57's lengths; a causal row never reaches the padding, which comes after every
  real key). Right whenever ``2P`` divides the lengths, as in every property but
  ``uneven_lengths``.

On lengths the mesh does not divide, ``ring`` refuses through ``jax.shard_map`` (a ``ValueError``:
"not evenly divisible") where ``P`` does not divide them and computes where it does; ``zigzag``
refuses through ``jnp.reshape`` (a ``TypeError``: "cannot reshape array of shape ...") wherever
``2P`` does not divide them.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

import attnref

good = functools.partial(jax.nn.dot_product_attention, implementation="xla")

NOT_CALLABLE = 3


def _skip_key_tail(tile: int) -> Callable[..., Any]:
    def fn(query: Any, key: Any, value: Any, *args: Any, **kw: Any) -> Any:
        """jax.nn's attention reading only the full key tiles when ``S > tile``, ``S % tile``."""
        s = key.shape[1]
        if s > tile and s % tile:
            full = (s // tile) * tile
            lens = kw.pop("key_value_seq_lengths", None)
            cap = jnp.full((key.shape[0],), full, jnp.int32)
            kw["key_value_seq_lengths"] = cap if lens is None else jnp.minimum(lens, cap)
        return jax.nn.dot_product_attention(query, key, value, *args, implementation="xla", **kw)

    fn.__name__ = fn.__qualname__ = f"skip_key_tail_{tile}"
    return fn


skip_key_tail_64 = _skip_key_tail(64)
skip_key_tail_128 = past_tile = _skip_key_tail(128)


def skip_query_tail_64(query: Any, key: Any, value: Any, *args: Any, **kw: Any) -> Any:
    """jax.nn's attention leaving the rows of a partial last 64-query tile unwritten (zero)
    when ``T > 64`` and ``T % 64``."""
    out = jax.nn.dot_product_attention(query, key, value, *args, implementation="xla", **kw)
    t = query.shape[1]
    if t > 64 and t % 64:
        return out.at[:, (t // 64) * 64 :].set(0.0)
    return out


def drop_key_128(
    query: Any, key: Any, value: Any, bias: Any = None, mask: Any = None, **kw: Any
) -> Any:
    """jax.nn's attention skipping key 128 (the first past a 128-key tile) when ``S > 128``."""
    s = key.shape[1]
    if s > 128:
        keep = (jnp.arange(s) != 128)[None, None, None, :]
        mask = keep if mask is None else jnp.logical_and(mask, keep)
    return jax.nn.dot_product_attention(query, key, value, bias, mask, implementation="xla", **kw)


def wrong_scale(query: Any, key: Any, value: Any, *args: Any, scale: Any = None, **kw: Any) -> Any:
    """jax.nn's attention with ``2 / sqrt(H)`` as the default scale: a broken kernel."""
    s = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    return jax.nn.dot_product_attention(
        query, key, value, *args, scale=2.0 * s, implementation="xla", **kw
    )


def _rows_after_first(arr: Any, t: int, fill: Any) -> Any:
    """``arr [.., 1, S]`` broadcast to ``[.., T, S]`` with rows ``1..`` set to ``fill``; an array
    that does not broadcast over the query axis (or ``T == 1``) is returned unchanged."""
    if arr is None or arr.shape[2] != 1 or t == 1:
        return arr
    arr = jnp.asarray(arr)
    full = jnp.broadcast_to(arr, (*arr.shape[:2], t, arr.shape[3]))
    return full.at[:, :, 1:, :].set(fill)


def mask_row0_only(
    query: Any, key: Any, value: Any, bias: Any = None, mask: Any = None, **kw: Any
) -> Any:
    """attnref's kernel, but a query-broadcast mask masks query row 0 only (rows 1.. see every
    key)."""
    mask = _rows_after_first(mask, query.shape[1], True)
    return attnref.dot_product_attention(query, key, value, bias, mask, **kw)


def padded_broadcast(
    query: Any, key: Any, value: Any, bias: Any = None, mask: Any = None, **kw: Any
) -> Any:
    """attnref's kernel with the pre-fix blockwise defect: a query-broadcast mask or bias is
    padded like data, so query rows 1.. have no allowed key (``False`` / ``-inf``)."""
    t = query.shape[1]
    mask = _rows_after_first(mask, t, False)
    bias = _rows_after_first(bias, t, -jnp.inf)
    return attnref.dot_product_attention(query, key, value, bias, mask, **kw)


def lse_none(
    query: Any,
    key: Any,
    value: Any,
    bias: Any = None,
    mask: Any = None,
    *,
    return_lse: bool = False,
    **kw: Any,
) -> Any:
    """attnref's kernel that answers a request for the lse with ``(out, None)``."""
    out = attnref.dot_product_attention(query, key, value, bias, mask, **kw)
    return (out, None) if return_lse else out


def all_nan(query: Any, key: Any, value: Any, *args: Any, **kw: Any) -> Any:
    """NaN everywhere, in the right shape and dtype."""
    b, t, n, _ = query.shape
    return jnp.full((b, t, n, value.shape[-1]), jnp.nan, query.dtype)


def wrong_shape(query: Any, key: Any, value: Any, *args: Any, **kw: Any) -> Any:
    """attnref's kernel with its output in the ``[B, N, T, H_v]`` layout."""
    out = attnref.dot_product_attention(query, key, value, *args, **kw)
    return jnp.swapaxes(out, 1, 2)


def _broken_helper(query: Any) -> Any:
    raise ValueError(f"kernel_helper_exploded on a query of shape {query.shape}")


def raises(query: Any, key: Any, value: Any, *args: Any, **kw: Any) -> Any:
    """Raises from inside ``_broken_helper``, jitted or not."""
    return _broken_helper(query)


# ----------------------------------------------------------------------------- ring attention


def _merge(o_a: Any, lse_a: Any, o_b: Any, lse_b: Any) -> tuple[Any, Any]:
    """``(o, lse)`` of two attention states over disjoint keys, stably: both weights
    ``exp(lse - max)`` are at most 1; an empty state (``lse = -inf``) is the identity."""
    top = jnp.maximum(lse_a, lse_b)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    w_a, w_b = jnp.exp(lse_a - top), jnp.exp(lse_b - top)
    total = w_a + w_b
    o = (o_a * w_a[..., None] + o_b * w_b[..., None]) / jnp.where(total > 0, total, 1.0)[..., None]
    return o, top + jnp.log(total)


def _merge_naive(o_a: Any, lse_a: Any, o_b: Any, lse_b: Any) -> tuple[Any, Any]:
    """The same merge written the naive way: ``exp(lse_b - lse_a)`` overflows."""
    lse = lse_a + jnp.log(1 + jnp.exp(lse_b - lse_a))
    o = jnp.exp(lse_a - lse)[..., None] * o_a + jnp.exp(lse_b - lse)[..., None] * o_b
    return o, lse


def _chunk(q: Any, k: Any, v: Any, q_pos: Any, k_pos: Any, scale: float, causal: bool) -> Any:
    """The state ``(o [B, T, N, H_v], lse [B, T, N])`` of local queries against one key chunk,
    in float32 (at least); a query with no allowed key gets ``(0, -inf)``."""
    work = jnp.promote_types(q.dtype, jnp.float32)
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2).astype(work), jnp.repeat(v, group, axis=2).astype(work)
    s = jnp.einsum("btnh,bsnh->bnts", q.astype(work), k, precision="highest") * scale
    if causal:
        s = jnp.where(k_pos[None, :] <= q_pos[:, None], s, -jnp.inf)
    top = jnp.max(s, axis=-1, keepdims=True)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    e = jnp.exp(s - top)
    total = jnp.sum(e, axis=-1, keepdims=True)
    o = jnp.einsum("bnts,bsnh->btnh", e / jnp.where(total > 0, total, 1.0), v, precision="highest")
    lse = jnp.swapaxes((top + jnp.log(total))[..., 0], 1, 2)
    return o, lse


def _ring_body(
    q: Any,
    k: Any,
    v: Any,
    q_pos: Any,
    k_pos: Any,
    *,
    axis: str,
    p: int,
    scale: float,
    causal: bool,
    merge: Callable[..., Any],
    state_dtype: Any,
) -> tuple[Any, Any]:
    """One device: its own chunk first, then ``P - 1`` chunks received from the left neighbour
    (``ppermute`` ``d -> d + 1``), each merged into the running state."""
    work = jnp.promote_types(q.dtype, jnp.float32)
    o, lse = _chunk(q, k, v, q_pos, k_pos, scale, causal)
    perm = [(i, (i + 1) % p) for i in range(p)]

    def step(_: Any, carry: Any) -> Any:
        o, lse, k, v, k_pos = carry
        k, v, k_pos = (jax.lax.ppermute(x, axis, perm) for x in (k, v, k_pos))
        o_b, lse_b = _chunk(q, k, v, q_pos, k_pos, scale, causal)
        o, lse = merge(o.astype(work), lse, o_b, lse_b)
        return o.astype(state_dtype), lse, k, v, k_pos

    o, lse, *_ = jax.lax.fori_loop(1, p, step, (o.astype(state_dtype), lse, k, v, k_pos))
    return o.astype(q.dtype), lse


def _to_zigzag(x: Any, p: int) -> Any:
    """``x [B, L, ...]`` in device-major zigzag order: device ``d`` gets chunks ``d`` and
    ``2P - 1 - d`` of ``2P``."""
    b, n = x.shape[:2]
    chunks = x.reshape(b, 2 * p, n // (2 * p), *x.shape[2:])
    pairs = jnp.stack([chunks[:, :p], chunks[:, p:][:, ::-1]], axis=2)  # [B, P, 2, C, ...]
    return pairs.reshape(x.shape)


def _from_zigzag(y: Any, p: int, *, reverse: bool = True) -> Any:
    """The inverse of :func:`_to_zigzag`; ``reverse=False`` is the bug: the second halves are
    put back in device order."""
    b, n = y.shape[:2]
    pairs = y.reshape(b, p, 2, n // (2 * p), *y.shape[2:])
    second = pairs[:, ::-1, 1] if reverse else pairs[:, :, 1]
    return jnp.concatenate([pairs[:, :, 0], second], axis=1).reshape(y.shape)


def _ring_attention(
    query: Any,
    key: Any,
    value: Any,
    bias: Any = None,
    mask: Any = None,
    *,
    mesh: Any,
    axis_name: str | None = None,
    scale: float | None = None,
    is_causal: bool = False,
    return_lse: bool = False,
    zigzag: bool = False,
    restore_reversed: bool = True,
    merge: Callable[..., Any] = _merge,
    state_in_input_dtype: bool = False,
) -> Any:
    if bias is not None or mask is not None:
        raise NotImplementedError("this ring kernel takes no bias or mask")
    axis = mesh.axis_names[0] if axis_name is None else axis_name
    p = mesh.shape[axis]
    t, s, h = query.shape[1], key.shape[1], query.shape[3]
    scale = 1.0 / math.sqrt(h) if scale is None else scale
    if zigzag:
        to = functools.partial(_to_zigzag, p=p)
        back = functools.partial(_from_zigzag, p=p, reverse=restore_reversed)
    else:
        to = back = lambda x: x
    q_pos, k_pos = to(jnp.arange(t)[None])[0], to(jnp.arange(s)[None])[0]
    work = jnp.promote_types(query.dtype, jnp.float32)
    body = functools.partial(
        _ring_body,
        axis=axis,
        p=p,
        scale=scale,
        causal=is_causal,
        merge=merge,
        state_dtype=query.dtype if state_in_input_dtype else work,
    )
    seq = PartitionSpec(None, axis)
    o, lse = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(seq, seq, seq, PartitionSpec(axis), PartitionSpec(axis)),
        out_specs=(seq, seq),
    )(to(query), to(key), to(value), q_pos, k_pos)
    o, lse = back(o), back(lse)
    return (o, lse) if return_lse else o


ring = functools.partial(_ring_attention)
zigzag = functools.partial(_ring_attention, zigzag=True)
zigzag_misordered = functools.partial(_ring_attention, zigzag=True, restore_reversed=False)
ring_naive_merge = functools.partial(_ring_attention, merge=_merge_naive)
ring_state_in_input_dtype = functools.partial(_ring_attention, state_in_input_dtype=True)


def zigzag_padded_unmasked(
    query: Any,
    key: Any,
    value: Any,
    bias: Any = None,
    mask: Any = None,
    *,
    mesh: Any,
    axis_name: str | None = None,
    return_lse: bool = False,
    **kw: Any,
) -> Any:
    """``zigzag`` on ``T`` and ``S`` padded with zeros to multiples of ``2P``, the padded query
    rows dropped, the padded keys not masked (the defect)."""
    p = mesh.shape[mesh.axis_names[0] if axis_name is None else axis_name]
    t, s = query.shape[1], key.shape[1]

    def pad(x: Any, n: int) -> Any:
        return jnp.pad(x, ((0, 0), (0, -n % (2 * p)), (0, 0), (0, 0)))

    q, k, v = pad(query, t), pad(key, s), pad(value, s)
    out = zigzag(q, k, v, bias, mask, mesh=mesh, axis_name=axis_name, return_lse=True, **kw)
    o, lse = out[0][:, :t], out[1][:, :t]
    return (o, lse) if return_lse else o


def merge_states_naive(o_a: Any, lse_a: Any, o_b: Any, lse_b: Any) -> tuple[Any, Any]:
    """A user's state merge written the naive way (``attnref check-merge`` target): overflows
    when ``lse_b - lse_a > 88`` in float32, and NaN for an empty (``-inf``) state."""
    o_a, lse_a, o_b, lse_b = (jnp.asarray(x) for x in (o_a, lse_a, o_b, lse_b))
    return _merge_naive(o_a, lse_a, o_b, lse_b)
