"""Blockwise attention with an online softmax (the flash form), with the flash backward.

:func:`attnref.dot_product_attention` plus ``block_q`` and ``block_k``: a ``lax.scan`` over the
scheduled pairs of ``block_q``-query and ``block_k``-key tiles, each query tile keeping a running
max ``m``, sum ``l`` and accumulator ``a`` (Milakov & Gimelshein 2018; Dao et al. 2022)::

    m' = max(m, max_j s_ij),   l' = e^{m - m'} l + sum_j e^{s_ij - m'},
    a' = e^{m - m'} a + sum_j e^{s_ij - m'} v_j,            o_i = a / l,  lse_i = m + log l

The last tile is padded (padding never allowed). In the static schedule (:func:`tile_schedule`)
a tile left fully masked by causality, the window or padding is never computed, and one fully
allowed (no mask, bias, lengths or segment ids) skips the mask arithmetic. Only ``O(block_q
block_k)`` logits exist at a time: temporary memory linear in ``T`` (the naive form's ``T S``).

The backward is a ``jax.custom_vjp`` that saves ``o`` and ``lse`` and recomputes every tile's
probabilities ``p_ij = exp(s_ij - lse_i)`` (FlashAttention's backward)::

    D_i = do_i . o_i,   ds_ij = p_ij (do_i . v_j - D_i + dlse_i),
    dv_j = sum_i p_ij do_i,   dk_j = scale sum_i ds'_ij q_i,   dq_i = scale sum_j ds'_ij k_j,
    dbias_ij = ds_ij,   ds' = ds (1 - tanh^2(raw / c)) with softcap c (ds' = ds without)

so ``lse`` is differentiable too (not ``scale``, masks, lengths or segment ids; no ``jax.jvp``
through a ``custom_vjp``). With dropout (``w_ij = keep_ij / (1 - p)``) the accumulator sums
``e^{s_ij - m'} w_ij v_j`` while ``l`` keeps the unscaled sum, and the backward's ``do_i . v_j``
and ``dv_j`` carry ``w_ij``. The finishing rules (sinks, masked rows, query padding) run after
the ``custom_vjp``, under autodiff.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from attnref._src.core.checks import HIGHEST
from attnref._src.core.nonfinite import poison_rows
from attnref._src.formulations.kernel import (
    KernelCall,
    KernelInputs,
    KernelSpec,
    Option,
    allowed_pairs,
    bad_operands,
    dropped,
    finite_inputs,
    grouped,
    kernel_public,
    naive,
    reads_bad,
    softcapped,
)


def _pad_axis(a: Array, axis: int, size: int, value: Any = 0) -> Array:
    """Pad ``axis`` to ``size``; a size-1 axis (broadcast, or a tile size of 1) is kept."""
    extra = size - a.shape[axis]
    if extra <= 0 or a.shape[axis] == 1:
        return a
    widths = [(0, 0)] * a.ndim
    widths[axis] = (0, extra)
    return jnp.pad(a, widths, constant_values=value)


def _slice(a: Array, axis: int, start: Array, size: int) -> Array:
    """A tile along ``axis``; axes of size 1 (broadcast masks and biases) are kept whole."""
    if a.shape[axis] == 1:
        return a
    return jax.lax.dynamic_slice_in_dim(a, start, size, axis=axis)


@dataclasses.dataclass(frozen=True)
class TileSchedule:
    """The ``(query tile, key tile)`` pairs of one blockwise call: ``edge`` (``int32 [P, 2]``,
    paying for the mask), ``full`` (allowed everywhere, no mask arithmetic) and the grid ``tiles =
    (n_q, n_k)``; pairs in neither list are fully masked and never computed."""

    edge: np.ndarray
    full: np.ndarray
    tiles: tuple[int, int]

    @property
    def skipped(self) -> int:
        """How many tiles are never computed."""
        return self.tiles[0] * self.tiles[1] - len(self.edge) - len(self.full)


def tile_schedule(
    t: int,
    s: int,
    block_q: int,
    block_k: int,
    *,
    is_causal: bool = False,
    window: tuple[int | None, int | None] | None = None,
    alignment: str = "top_left",
    sink_tokens: int = 0,
    dynamic: bool = False,
) -> TileSchedule:
    """The static schedule of a ``T x S`` call in ``block_q x block_k`` tiles: query ``i`` may
    read key ``j`` only if ``lo_i <= j <= hi_i`` or ``j < sink_tokens`` (``p_i = i``, or ``i + S
    - T`` bottom-right; ``hi_i = p_i`` causal, ``+ right`` with a window; ``lo_i = p_i - left``).
    A tile none of whose rows reaches a key is skipped; one whose every unpadded row reads every
    unpadded key is ``full``, unless ``dynamic`` (a mask, bias, lengths or segment ids)."""
    nq, nk = -(-t // block_q), -(-s // block_k)
    big = t + s + 1  # beyond every index: an unbounded side
    pos = np.arange(t)[:, None] + (0 if alignment == "top_left" else s - t)  # [T, 1]
    left, right = window or (None, None)
    reach = [0] if is_causal else []
    reach += [] if right is None else [right]
    hi = pos + min(reach) if reach else np.full_like(pos, big)
    lo = pos - left if left is not None else np.full_like(pos, -big)
    c0 = np.arange(nk)[None, :] * block_k  # [1, nk]: each key tile's first and last key
    c1 = np.minimum(c0 + block_k, s) - 1
    top = np.minimum(c1, hi)
    # A row reads a key of the tile: one in [max(c0, lo), top], or the sink token c0 <= top.
    reads = (c0 <= top) & ((np.maximum(c0, lo) <= top) | (c0 < sink_tokens))
    # A row reads every key of the tile: none past hi, and those below lo are sink tokens.
    every = (c1 <= hi) & ((c0 >= lo) | (np.minimum(c1, lo - 1) < sink_tokens))
    pad = np.zeros((nq * block_q - t, nk), bool)  # padded rows: no reads, never "every"
    reads = np.concatenate([reads, pad]).reshape(nq, block_q, nk).any(axis=1)
    every = np.concatenate([every, pad]).reshape(nq, block_q, nk).all(axis=1)
    every &= (c0 + block_k <= s) & (not dynamic)  # no padded key, nothing seen only at run time
    pairs = np.argwhere(reads).astype(np.int32)  # row-major: query tile, then key tile
    full = every[reads]
    return TileSchedule(pairs[~full], pairs[full], (nq, nk))


def _read(buffers: tuple[Array, ...], i: Array) -> tuple[Array, ...]:
    return tuple(jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False) for a in buffers)


def _write(buffers: tuple[Array, ...], i: Array, values: tuple[Array, ...]) -> tuple[Array, ...]:
    return tuple(
        jax.lax.dynamic_update_index_in_dim(a, v.astype(a.dtype), i, 0)
        for a, v in zip(buffers, values, strict=True)
    )


def _over_pairs(schedule: TileSchedule, step: Any, carry: Any) -> Any:
    """``step(full)(carry, (i, j))`` over the full pairs, then the edge pairs (skipping an empty
    list: each list is one ``lax.scan``)."""
    for full, pairs in ((True, schedule.full), (False, schedule.edge)):
        if len(pairs):
            carry, _ = jax.lax.scan(step(full), carry, jnp.asarray(pairs))
    return carry


class _Tiles:
    """Padded inputs of one call and the per-tile computation shared by forward and backward."""

    def __init__(self, spec: KernelSpec, inputs: KernelInputs, bq: int, bk: int) -> None:
        self.spec, self.inputs, self.bq, self.bk = spec, inputs, bq, bk
        self.nq, self.nk = -(-spec.t // bq), -(-spec.s // bk)
        tp, sp = self.nq * bq, self.nk * bk
        # The finite parts of the operands (``attnref._src.core.nonfinite``), once for every tile.
        finite = finite_inputs(spec, inputs)
        self.q, self.k, self.v = (
            _pad_axis(a, 1, n) for a, n in ((finite.q, tp), (finite.k, sp), (finite.v, sp))
        )
        self.bad_q, bad_kv, bias_bad = bad_operands(inputs)
        self.bad_kv = _pad_axis(bad_kv, 1, sp, False)
        self.bias_bad, self.bias, self.mask, self.keep = (
            None if a is None else _pad_axis(_pad_axis(a, 2, tp), 3, sp)
            for a in (bias_bad, finite.bias, inputs.mask, inputs.keep)
        )
        self.q_seg = None if inputs.q_seg is None else _pad_axis(inputs.q_seg, 1, tp, -1)
        self.kv_seg = None if inputs.kv_seg is None else _pad_axis(inputs.kv_seg, 1, sp, -2)
        # The call's schedule: the static band (none for bottom-right alignment under lengths,
        # whose offset ``S_b - T_b`` is known only at run time).
        lengths = inputs.q_lens is not None or inputs.kv_lens is not None
        static = spec.alignment == "top_left" or not lengths
        dynamic = lengths or any(
            a is not None for a in (inputs.mask, inputs.bias, inputs.q_seg, inputs.kv_seg)
        )
        self.schedule = tile_schedule(
            spec.t,
            spec.s,
            bq,
            bk,
            is_causal=spec.is_causal and static,
            window=spec.window if static else None,
            alignment=spec.alignment,
            sink_tokens=spec.sink_tokens,
            dynamic=dynamic,
        )

    def q_rows(self, a: Array, i: Array, axis: int = 1) -> Array:
        return _slice(a, axis, i * self.bq, self.bq)

    def k_rows(self, a: Array, j: Array, axis: int = 1) -> Array:
        return _slice(a, axis, j * self.bk, self.bk)

    def tile(self, i: Array, j: Array, full: bool, find_dirty: bool = False) -> dict[str, Any]:
        """Allowed pairs (``None`` in a ``full`` tile, which skips the mask arithmetic), operands
        (the finite parts of the inputs) and logits of query tile ``i`` and key tile ``j``;
        ``find_dirty`` adds the tile's rows that read a non-finite key, value or bias entry
        (``attnref._src.core.nonfinite``)."""
        spec = self.spec
        mask, bias, bias_bad, keep = (
            None if a is None else self.k_rows(self.q_rows(a, i, 2), j, 3)
            for a in (self.mask, self.bias, self.bias_bad, self.keep)
        )
        allowed = None
        if not full:
            idx = (i * self.bq + jnp.arange(self.bq), j * self.bk + jnp.arange(self.bk))
            q_seg = None if self.q_seg is None else self.q_rows(self.q_seg, i)
            kv_seg = None if self.kv_seg is None else self.k_rows(self.kv_seg, j)
            allowed = allowed_pairs(spec, self.inputs, *idx, q_seg, kv_seg, mask, bias, True)
            assert allowed is not None  # in_range: never None
            allowed = jnp.broadcast_to(allowed, (spec.b, spec.n, self.bq, self.bk))
        ops = {
            "q": self.q_rows(self.q, i),
            "k": self.k_rows(self.k, j),
            "v": self.k_rows(self.v, j),
        }
        qg = ops["q"].reshape(spec.b, self.bq, spec.k, spec.group, spec.h)
        raw = jnp.einsum("btkgh,bskh->bkgts", qg, ops["k"], precision=HIGHEST)
        raw = raw.reshape(spec.b, spec.n, self.bq, self.bk) * self.inputs.scale
        logits = softcapped(spec, raw)
        if bias is not None:
            logits = logits + bias
        reads = None
        if find_dirty:
            # a full tile reads each of its keys
            seen = jnp.ones((1, 1, 1, self.bk), bool) if allowed is None else allowed
            reads = reads_bad(spec, seen, self.k_rows(self.bad_kv, j), bias_bad)
        return dict(allowed=allowed, raw=raw, logits=logits, reads=reads, keep=keep, **ops)

    def exp(self, t: dict[str, Any], shift: Array) -> Array:
        """``e^{s_ij - shift_i}`` on the allowed pairs, 0 elsewhere (no select in a full tile)."""
        allowed = t["allowed"]
        if allowed is None:
            return jnp.exp(t["logits"] - shift[..., None])
        return jnp.where(
            allowed, jnp.exp(jnp.where(allowed, t["logits"] - shift[..., None], 0.0)), 0.0
        )

    def merge(self, a: Array, axis: int, keys: bool = False) -> Array:
        """``[n, ..., b, ...]`` (tiles first, rows at ``axis + 1``) -> ``[..., T, ...]`` (``S``
        for key tiles)."""
        a = jnp.moveaxis(a, 0, axis)
        shape = (*a.shape[:axis], a.shape[axis] * a.shape[axis + 1], *a.shape[axis + 2 :])
        size = self.spec.s if keys else self.spec.t
        return jax.lax.slice_in_dim(a.reshape(shape), 0, size, axis=axis)


def _forward(tiles: _Tiles) -> tuple[Array, Array, Array, Array]:
    """Online softmax: ``o [B, T, N, H_v]`` (compute dtype), ``lse [B, T, N]``, live rows and
    dirty rows (rows that read a non-finite value)."""
    spec, cd, bq = tiles.spec, tiles.spec.compute_dtype, tiles.bq

    def step(full: bool) -> Any:
        def body(state: tuple[Array, ...], ij: Array) -> tuple[tuple[Array, ...], None]:
            i, j = ij[0], ij[1]
            m, run_sum, acc, dirty = _read(state, i)  # query tile i's running state
            t = tiles.tile(i, j, full, find_dirty=True)
            logits = t["logits"] if full else jnp.where(t["allowed"], t["logits"], -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(logits, axis=-1))
            shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            e = tiles.exp(t, shift)
            alpha = jnp.exp(m - shift)  # 0 while nothing has been seen (m = -inf)
            ew = dropped(spec, e, t["keep"])  # the numerator's weights (the sum keeps e)
            ev = jnp.einsum("bkgts,bskh->bkgth", grouped(ew, spec), t["v"], precision=HIGHEST)
            new = (
                m_new,
                alpha * run_sum + jnp.sum(e, axis=-1),
                alpha[..., None] * acc + ev.reshape(acc.shape),
                jnp.logical_or(dirty, t["reads"]),
            )
            return _write(state, i, new), None

        return body

    rows = (tiles.nq, spec.b, spec.n, bq)
    init = (
        jnp.full(rows, -jnp.inf, cd),
        jnp.zeros(rows, cd),
        jnp.zeros((*rows, spec.h_v), cd),
        jnp.zeros(rows, bool),
    )
    m, run_sum, acc, dirty = _over_pairs(tiles.schedule, step, init)
    m, run_sum, acc, dirty = (tiles.merge(a, 2) for a in (m, run_sum, acc, dirty))
    live = run_sum > 0
    out = acc / jnp.where(live, run_sum, 1.0)[..., None]
    lse = jnp.where(live, m + jnp.log(jnp.where(live, run_sum, 1.0)), -jnp.inf)
    live = jnp.swapaxes(live, 1, 2)  # [B, T, N]
    # Dirty rows: an allowed key read a non-finite value, or the row's own query is non-finite.
    dirty = jnp.logical_or(jnp.swapaxes(dirty, 1, 2), jnp.logical_and(tiles.bad_q, live))
    return jnp.swapaxes(out, 1, 2), jnp.swapaxes(lse, 1, 2), live, dirty


def _backward(
    tiles: _Tiles, o: Array, lse: Array, do: Array, dlse: Array
) -> tuple[Array, Array, Array, Array | None]:
    """Flash backward: ``dq, dk, dv`` (compute dtype) and ``dbias`` as ``[B, N, T, S]``."""
    spec, cd = tiles.spec, tiles.spec.compute_dtype
    live = lse != -jnp.inf  # [B, T, N]
    do = jnp.where(live[..., None], do.astype(cd), 0.0)
    dlse = jnp.where(live, dlse.astype(cd), 0.0)
    delta = jnp.sum(do * jnp.where(live[..., None], o, 0.0), axis=-1)  # D_i
    lse0 = jnp.where(live, lse, 0.0)
    tp = tiles.nq * tiles.bq
    # Per-row quantities in [B, N, T] layout, padded to whole query tiles.
    rows = {
        name: _pad_axis(jnp.swapaxes(a, 1, 2), 2, tp)
        for name, a in (("lse", lse0), ("delta", delta), ("dlse", dlse))
    }
    do_p = _pad_axis(do, 1, tp)

    def step(full: bool) -> Any:
        def body(carry: tuple[Array, ...], ij: Array) -> tuple[tuple[Array, ...], None]:
            i, j = ij[0], ij[1]
            dq, dk, dv, ds_all = carry
            t = tiles.tile(i, j, full)
            probs = tiles.exp(t, tiles.q_rows(rows["lse"], i, 2))
            dog = tiles.q_rows(do_p, i).reshape(spec.b, tiles.bq, spec.k, spec.group, spec.h_v)
            dp = jnp.einsum("btkgh,bskh->bkgts", dog, t["v"], precision=HIGHEST)
            dp = dropped(spec, dp.reshape(probs.shape), t["keep"])  # dL/dp_ij: keep_ij/(1-p) dO.v
            corr = tiles.q_rows(rows["dlse"], i, 2) - tiles.q_rows(rows["delta"], i, 2)
            ds = probs * (dp + corr[..., None])
            ds_raw = ds
            if spec.softcap is not None:
                th = jnp.tanh(t["raw"] / spec.softcap)
                ds_raw = ds * (1.0 - th * th)
            ds_raw = ds_raw * tiles.inputs.scale
            probs = dropped(spec, probs, t["keep"])
            qg = t["q"].reshape(spec.b, tiles.bq, spec.k, spec.group, spec.h)
            g_v = jnp.einsum("bkgts,btkgh->bskh", grouped(probs, spec), dog, precision=HIGHEST)
            g_k = jnp.einsum("bkgts,btkgh->bskh", grouped(ds_raw, spec), qg, precision=HIGHEST)
            g_q = jnp.einsum("bkgts,bskh->btkgh", grouped(ds_raw, spec), t["k"], precision=HIGHEST)
            (dk_j, dv_j), (dq_i,) = _read((dk, dv), j), _read((dq,), i)
            dk, dv = _write((dk, dv), j, (dk_j + g_k, dv_j + g_v))
            (dq,) = _write((dq,), i, (dq_i + g_q.reshape(dq_i.shape),))
            if ds_all is not None:  # dbias: this tile's ds at (i, j)
                ds_i = jax.lax.dynamic_index_in_dim(ds_all, i, 0, keepdims=False)
                ds_all = _write((ds_all,), i, (_write((ds_i,), j, (ds,))[0],))[0]
            return (dq, dk, dv, ds_all), None

        return body

    init = (
        jnp.zeros((tiles.nq, spec.b, tiles.bq, spec.n, spec.h), cd),
        jnp.zeros((tiles.nk, spec.b, tiles.bk, spec.k, spec.h), cd),
        jnp.zeros((tiles.nk, spec.b, tiles.bk, spec.k, spec.h_v), cd),
        None
        if tiles.inputs.bias is None
        else jnp.zeros((tiles.nq, tiles.nk, spec.b, spec.n, tiles.bq, tiles.bk), cd),
    )
    dq, dk, dv, ds = _over_pairs(tiles.schedule, step, init)
    dq, dk, dv = tiles.merge(dq, 1), tiles.merge(dk, 1, True), tiles.merge(dv, 1, True)
    dbias = None
    if ds is not None:  # [nq, nk, B, N, bq, bk] -> [B, N, T, S]
        grid = jnp.transpose(ds, (2, 3, 0, 4, 1, 5))
        grid = grid.reshape(spec.b, spec.n, tiles.nq * tiles.bq, tiles.nk * tiles.bk)
        dbias = grid[:, :, : spec.t, : spec.s]
    return dq, dk, dv, dbias


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _flash(spec: KernelSpec, bq: int, bk: int, inputs: KernelInputs) -> tuple[Array, Array]:
    return _flash_fwd(spec, bq, bk, inputs)[0]


def _flash_fwd(
    spec: KernelSpec, bq: int, bk: int, inputs: KernelInputs
) -> tuple[tuple[Array, Array], tuple[KernelInputs, Array, Array, Array]]:
    """The online softmax on finite operands; the rows that read a non-finite value are NaN
    (``attnref._src.core.nonfinite``); the residuals are the finite path's."""
    o, lse, _live, dirty = _forward(_Tiles(spec, inputs, bq, bk))
    # The backward differentiates the finite path; dirty rows have no gradient.
    return poison_rows(dirty, (o, lse)), (inputs, o, lse, dirty)


def _flash_bwd(
    spec: KernelSpec, bq: int, bk: int, res: Any, cts: tuple[Array, Array]
) -> tuple[KernelInputs]:
    inputs, o, lse, dirty = res
    do, dlse = cts
    do, dlse = jnp.where(dirty[..., None], 0.0, do), jnp.where(dirty, 0.0, dlse)
    if inputs.q_lens is not None:  # query padding rows are constants (0, -inf)
        valid = (jnp.arange(spec.t)[None, :] < inputs.q_lens[:, None])[..., None]
        do, dlse = jnp.where(valid[..., None], do, 0.0), jnp.where(valid, dlse, 0.0)
    dq, dk, dv, dbias = _backward(_Tiles(spec, inputs, bq, bk), o, lse, do, dlse)
    db = None
    if inputs.bias is not None and dbias is not None:
        axes = tuple(a for a in range(4) if inputs.bias.shape[a] == 1)
        db = jnp.sum(dbias, axis=axes, keepdims=True).astype(inputs.bias.dtype)
    dq, dk, dv = (g.astype(a.dtype) for g, a in ((dq, inputs.q), (dk, inputs.k), (dv, inputs.v)))
    return (KernelInputs(dq, dk, dv, jnp.zeros_like(inputs.scale), db),)


_flash.defvjp(_flash_fwd, _flash_bwd)


def flash(call: KernelCall, block_q: int, block_k: int) -> tuple[Array, Array]:
    """The schedule: the online softmax over ``block_q x block_k`` tiles (:func:`_forward`)."""
    spec = call.spec
    if spec.t == 0 or spec.s == 0:  # nothing to tile: no query, or every row fully masked
        return naive(call)
    bq, bk = min(block_q, spec.t), min(block_k, spec.s)
    o, lse = _flash(spec, max(bq, 1), max(bk, 1), call.inputs)
    return call.finish(o, lse, ~jnp.isneginf(lse))


def blockwise_dot_flops(
    b: int, n: int, h: int, h_v: int, schedule: TileSchedule, block_q: int, block_k: int
) -> tuple[int, int]:
    """The dot FLOPs of one blockwise call (tile sizes capped at ``T``, ``S``), forward and
    backward, per computed tile and head: ``q k^T`` and ``e v``, ``2 bq bk (H + H_v)``; the
    backward's ``q k^T``, ``dO v^T``, ``dv``, ``dk``, ``dq``, ``2 bq bk (3 H + 2 H_v)``. Equal to
    XLA's executed dot FLOPs (:func:`attnref.costs.hlo_dot_flops` with ``executed=True``)."""
    tiles = len(schedule.edge) + len(schedule.full)
    per_tile = 2 * b * n * block_q * block_k
    return tiles * per_tile * (h + h_v), tiles * per_tile * (3 * h + 2 * h_v)


def check_blocks(block_q: Any, block_k: Any) -> None:
    """Both block sizes are positive ints (``ValueError`` otherwise)."""
    for name, b in (("block_q", block_q), ("block_k", block_k)):
        if not isinstance(b, int) or isinstance(b, bool) or b < 1:
            raise ValueError(f"{name} must be a positive int, got {b!r}")


blockwise_dot_product_attention = kernel_public(
    flash,
    name="blockwise_dot_product_attention",
    summary=(
        "Flash-form attention: tiles of ``block_q`` queries x ``block_k`` keys, online softmax.\n\n"
        "Equal to :func:`attnref.dot_product_attention` with the same arguments (rounding aside);\n"
        "the backward recomputes tiles from the saved ``lse`` (see the module docstring)."
    ),
    options=tuple(
        Option(name, 128, "int", f"{what} per tile, a positive int (default 128; capped at {cap}).")
        for name, what, cap in (("block_q", "Queries", "``T``"), ("block_k", "Keys", "``S``"))
    ),
    check=check_blocks,
    returns=" Both are differentiable, by the flash backward.",
    value_errors=", or ``block_q`` or ``block_k`` is not a positive int",
    formula=_forward,
)
