"""Blockwise attention with an online softmax (the flash form), with the flash backward.

Same signature and semantics as :func:`attnref.dot_product_attention` plus ``block_q`` and
``block_k``. Queries are processed in tiles of ``block_q`` rows (``lax.map``) and, for each, the
keys in tiles of ``block_k`` (``lax.scan``) with a running max ``m``, running sum ``l`` and
accumulator ``a`` (Milakov & Gimelshein 2018; Dao et al. 2022)::

    m' = max(m, max_j s_ij),   l' = e^{m - m'} l + sum_j e^{s_ij - m'},
    a' = e^{m - m'} a + sum_j e^{s_ij - m'} v_j,            o_i = a / l,  lse_i = m + log l

``T`` and ``S`` need not be multiples of the block sizes: the last tile is padded and its padding
is never allowed. Only ``O(block_q * block_k)`` logits exist at a time, so the temporary memory
grows linearly in ``T`` (the naive form's grows as ``T * S``).

The backward is a ``jax.custom_vjp`` that saves ``o`` and ``lse`` and recomputes every tile's
probabilities ``p_ij = exp(s_ij - lse_i)`` (FlashAttention's backward)::

    D_i = do_i . o_i,   ds_ij = p_ij (do_i . v_j - D_i + dlse_i),
    dv_j = sum_i p_ij do_i,   dk_j = scale sum_i ds'_ij q_i,   dq_i = scale sum_j ds'_ij k_j,
    dbias_ij = ds_ij,   ds' = ds (1 - tanh^2(raw / c)) with softcap c (ds' = ds without)

so ``lse`` is differentiable too. There are no gradients with respect to ``scale``, the masks,
lengths or segment ids. Forward-mode differentiation (``jax.jvp``) is not defined for a
``custom_vjp``.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float, Int

from attnref._src.core.checks import float64_scoped
from attnref._src.core.nonfinite import finite_bias, finite_part, poison_rows
from attnref._src.formulations.kernel import (
    HIGHEST,
    Alignment,
    KernelInputs,
    KernelSpec,
    MaskedRows,
    bad_operands,
    finish,
    grouped,
    logits_transform,
    naive,
    prepare,
    reads_bad,
    require_lengths_in_range,
    structural_allowed,
)


def _pad_axis(a: Array, axis: int, size: int, value: Any = 0) -> Array:
    """Pad ``axis`` to ``size``; an axis of size 1 broadcasts and is never padded as data.

    (A real axis of length 1 needs no padding either: its tile size is ``min(block, 1) = 1``.)
    """
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


class _Tiles:
    """Padded inputs of one call and the per-tile computation shared by forward and backward."""

    def __init__(self, spec: KernelSpec, x: KernelInputs, bq: int, bk: int) -> None:
        self.spec, self.x, self.bq, self.bk = spec, x, bq, bk
        self.nq, self.nk = -(-spec.t // bq), -(-spec.s // bk)
        tp, sp = self.nq * bq, self.nk * bk
        cd = spec.compute_dtype
        # The finite parts of the operands (``attnref._src.core.nonfinite``), once for every tile.
        self.q = _pad_axis(finite_part(x.q.astype(cd)), 1, tp)
        self.k = _pad_axis(finite_part(x.k.astype(cd)), 1, sp)
        self.v = _pad_axis(finite_part(x.v.astype(cd)), 1, sp)
        self.bad_q, bad_kv, bias_bad = bad_operands(x)
        self.bad_kv = _pad_axis(bad_kv, 1, sp, False)
        self.bias_bad = None if bias_bad is None else _pad_axis(_pad_axis(bias_bad, 2, tp), 3, sp)
        bias = None if x.bias is None else finite_bias(x.bias)
        self.bias = None if bias is None else _pad_axis(_pad_axis(bias, 2, tp), 3, sp)
        self.mask = None if x.mask is None else _pad_axis(_pad_axis(x.mask, 2, tp), 3, sp)
        self.q_seg = None if x.q_seg is None else _pad_axis(x.q_seg, 1, tp, -1)
        self.kv_seg = None if x.kv_seg is None else _pad_axis(x.kv_seg, 1, sp, -2)

    def q_rows(self, a: Array, i: Array, axis: int = 1) -> Array:
        return _slice(a, axis, i * self.bq, self.bq)

    def k_rows(self, a: Array, j: Array, axis: int = 1) -> Array:
        return _slice(a, axis, j * self.bk, self.bk)

    def tile(self, i: Array, j: Array, find_dirty: bool = False) -> dict[str, Any]:
        """Allowed pairs, operands (the finite parts of the inputs) and logits of query tile
        ``i`` and key tile ``j``; ``find_dirty`` adds the tile's rows that read a non-finite
        key, value or bias entry (``attnref._src.core.nonfinite``)."""
        spec, x = self.spec, self.x
        q_idx = i * self.bq + jnp.arange(self.bq)
        k_idx = j * self.bk + jnp.arange(self.bk)
        q_seg = None if self.q_seg is None else self.q_rows(self.q_seg, i)
        kv_seg = None if self.kv_seg is None else self.k_rows(self.kv_seg, j)
        allowed = structural_allowed(spec, x, q_idx, k_idx, q_seg, kv_seg)[:, None]
        bias = None
        if self.mask is not None:
            allowed &= self.k_rows(self.q_rows(self.mask, i, 2), j, 3)
        if self.bias is not None:
            bias = self.k_rows(self.q_rows(self.bias, i, 2), j, 3)
            allowed &= bias != -jnp.inf
        allowed = jnp.broadcast_to(allowed, (spec.b, spec.n, self.bq, self.bk))
        ops = {
            "q": self.q_rows(self.q, i),
            "k": self.k_rows(self.k, j),
            "v": self.k_rows(self.v, j),
        }
        qg = ops["q"].reshape(spec.b, self.bq, spec.k, spec.group, spec.h)
        raw = jnp.einsum("btkgh,bskh->bkgts", qg, ops["k"], precision=HIGHEST)
        raw = raw.reshape(spec.b, spec.n, self.bq, self.bk) * x.scale
        s = logits_transform(spec, raw)
        if bias is not None:
            s = s + bias
        reads = None
        if find_dirty:
            bias_bad = None
            if self.bias_bad is not None:
                bias_bad = self.k_rows(self.q_rows(self.bias_bad, i, 2), j, 3)
            reads = reads_bad(spec, allowed, self.k_rows(self.bad_kv, j), bias_bad)
        return dict(allowed=allowed, raw=raw, s=s, reads=reads, **ops)

    def merge_q(self, a: Array, axis: int) -> Array:
        """``[nq, ..., bq, ...]`` (tiles first, rows at ``axis + 1``) -> ``[..., T, ...]``."""
        a = jnp.moveaxis(a, 0, axis)
        shape = (*a.shape[:axis], self.nq * self.bq, *a.shape[axis + 2 :])
        return jax.lax.slice_in_dim(a.reshape(shape), 0, self.spec.t, axis=axis)

    def merge_k(self, a: Array, axis: int) -> Array:
        a = jnp.moveaxis(a, 0, axis)
        shape = (*a.shape[:axis], self.nk * self.bk, *a.shape[axis + 2 :])
        return jax.lax.slice_in_dim(a.reshape(shape), 0, self.spec.s, axis=axis)


def _forward(tiles: _Tiles) -> tuple[Array, Array, Array, Array]:
    """Online softmax: ``o [B, T, N, H_v]`` (compute dtype), ``lse [B, T, N]``, live rows and
    dirty rows (rows that read a non-finite value)."""
    spec, cd = tiles.spec, tiles.spec.compute_dtype

    def q_block(i: Array) -> tuple[Array, Array, Array, Array]:
        def step(carry: tuple[Array, Array, Array, Array], j: Array) -> tuple[Any, None]:
            m, run_sum, acc, dirty = carry
            t = tiles.tile(i, j, find_dirty=True)
            allowed, s = t["allowed"], t["s"]
            m_new = jnp.maximum(m, jnp.max(jnp.where(allowed, s, -jnp.inf), axis=-1))
            shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            p = jnp.where(allowed, jnp.exp(jnp.where(allowed, s - shift[..., None], 0.0)), 0.0)
            alpha = jnp.exp(m - shift)  # 0 while nothing has been seen (m = -inf)
            pv = jnp.einsum("bkgts,bskh->bkgth", grouped(p, spec), t["v"], precision=HIGHEST)
            acc = alpha[..., None] * acc + pv.reshape(acc.shape)
            dirty = jnp.logical_or(dirty, t["reads"])
            return (m_new, alpha * run_sum + jnp.sum(p, axis=-1), acc, dirty), None

        init = (
            jnp.full((spec.b, spec.n, tiles.bq), -jnp.inf, cd),
            jnp.zeros((spec.b, spec.n, tiles.bq), cd),
            jnp.zeros((spec.b, spec.n, tiles.bq, spec.h_v), cd),
            jnp.zeros((spec.b, spec.n, tiles.bq), bool),
        )
        (m, run_sum, acc, dirty), _ = jax.lax.scan(step, init, jnp.arange(tiles.nk))
        return m, run_sum, acc, dirty

    m, run_sum, acc, dirty = jax.lax.map(q_block, jnp.arange(tiles.nq))
    m, run_sum, acc = tiles.merge_q(m, 2), tiles.merge_q(run_sum, 2), tiles.merge_q(acc, 2)
    dirty = tiles.merge_q(dirty, 2)
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

    def grads(i: Array, j: Array) -> tuple[dict[str, Array], Array, Array, Array]:
        t = tiles.tile(i, j)
        lse_t = tiles.q_rows(rows["lse"], i, 2)[..., None]
        p = jnp.where(t["allowed"], jnp.exp(jnp.where(t["allowed"], t["s"] - lse_t, 0.0)), 0.0)
        do_t = tiles.q_rows(do_p, i)  # [B, bq, N, H_v]
        dog = do_t.reshape(spec.b, tiles.bq, spec.k, spec.group, spec.h_v)
        dp = jnp.einsum("btkgh,bskh->bkgts", dog, t["v"], precision=HIGHEST)
        dp = dp.reshape(p.shape)
        corr = tiles.q_rows(rows["dlse"], i, 2) - tiles.q_rows(rows["delta"], i, 2)
        ds = p * (dp + corr[..., None])
        ds_raw = ds
        if spec.softcap is not None:
            th = jnp.tanh(t["raw"] / spec.softcap)
            ds_raw = ds * (1.0 - th * th)
        return t, p, ds, ds_raw * tiles.x.scale

    def kv_block(j: Array) -> tuple[Array, Array]:
        def step(carry: tuple[Array, Array], i: Array) -> tuple[Any, None]:
            dk, dv = carry
            t, p, _, ds_raw = grads(i, j)
            do_t = tiles.q_rows(do_p, i).reshape(spec.b, tiles.bq, spec.k, spec.group, spec.h_v)
            dv = dv + jnp.einsum("bkgts,btkgh->bskh", grouped(p, spec), do_t, precision=HIGHEST)
            qg = t["q"].reshape(spec.b, tiles.bq, spec.k, spec.group, spec.h)
            dk = dk + jnp.einsum("bkgts,btkgh->bskh", grouped(ds_raw, spec), qg, precision=HIGHEST)
            return (dk, dv), None

        init = (
            jnp.zeros((spec.b, tiles.bk, spec.k, spec.h), cd),
            jnp.zeros((spec.b, tiles.bk, spec.k, spec.h_v), cd),
        )
        (dk, dv), _ = jax.lax.scan(step, init, jnp.arange(tiles.nq))
        return dk, dv

    def q_block(i: Array) -> tuple[Array, Array | None]:
        def step(dq: Array, j: Array) -> tuple[Array, Array | None]:
            t, _, ds, ds_raw = grads(i, j)
            g = jnp.einsum("bkgts,bskh->btkgh", grouped(ds_raw, spec), t["k"], precision=HIGHEST)
            return dq + g.reshape(dq.shape), (ds if tiles.x.bias is not None else None)

        init = jnp.zeros((spec.b, tiles.bq, spec.n, spec.h), cd)
        return jax.lax.scan(step, init, jnp.arange(tiles.nk))

    dk, dv = jax.lax.map(kv_block, jnp.arange(tiles.nk))
    dq, ds = jax.lax.map(q_block, jnp.arange(tiles.nq))
    dq, dk, dv = tiles.merge_q(dq, 1), tiles.merge_k(dk, 1), tiles.merge_k(dv, 1)
    dbias = None
    if ds is not None:  # [nq, nk, B, N, bq, bk] -> [B, N, T, S]
        full = jnp.transpose(ds, (2, 3, 0, 4, 1, 5))
        full = full.reshape(spec.b, spec.n, tiles.nq * tiles.bq, tiles.nk * tiles.bk)
        dbias = full[:, :, : spec.t, : spec.s]
    return dq, dk, dv, dbias


def _uniform_rows_grad(spec: KernelSpec, x: KernelInputs, do: Array, live: Array) -> Array:
    """Gradient of the ``"uniform"`` rows ``mean_j v_j`` with respect to ``v [B, S, K, H_v]``."""
    valid = jnp.arange(spec.t)[None, :] < (spec.t if x.q_lens is None else x.q_lens[:, None])
    dead = jnp.logical_and(~live, valid[..., None])  # [B, T, N]
    g = jnp.sum(jnp.where(dead[..., None], do, 0.0), axis=1)  # [B, N, H_v]
    g = jnp.sum(g.reshape(spec.b, spec.k, spec.group, spec.h_v), axis=2) / spec.s
    return jnp.broadcast_to(g[:, None], (spec.b, spec.s, spec.k, spec.h_v))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _flash(spec: KernelSpec, bq: int, bk: int, x: KernelInputs) -> tuple[Array, Array]:
    return _flash_fwd(spec, bq, bk, x)[0]


def _flash_fwd(
    spec: KernelSpec, bq: int, bk: int, x: KernelInputs
) -> tuple[tuple[Array, Array], tuple[KernelInputs, Array, Array, Array, Array]]:
    """The online softmax on finite operands; the rows that read a non-finite value are NaN
    (``attnref._src.core.nonfinite``); the residuals are the finite path's."""
    o, lse, live, dirty = _forward(_Tiles(spec, x, bq, bk))
    o_out, lse_in = poison_rows(dirty, (o, lse))
    out, lse_out = finish(spec, x, o_out, lse_in, live)
    # The backward differentiates the finite path; dirty rows have no gradient.
    return (out, lse_out), (x, o, lse, live, dirty)


def _flash_bwd(
    spec: KernelSpec, bq: int, bk: int, res: Any, cts: tuple[Array, Array]
) -> tuple[KernelInputs]:
    x, o, lse, live, dirty = res
    do, dlse = cts
    do = jnp.where(dirty[..., None], 0.0, do)
    dlse = jnp.where(dirty, 0.0, dlse)
    if x.q_lens is not None:  # query padding rows are constants (0, -inf)
        valid = (jnp.arange(spec.t)[None, :] < x.q_lens[:, None])[..., None]
        do = jnp.where(valid[..., None], do, 0.0)
        dlse = jnp.where(valid, dlse, 0.0)
    dq, dk, dv, dbias = _backward(_Tiles(spec, x, bq, bk), o, lse, do, dlse)
    if spec.masked_rows == "uniform":
        dv = dv + _uniform_rows_grad(spec, x, do.astype(spec.compute_dtype), live)
    db = None
    if x.bias is not None and dbias is not None:
        axes = tuple(a for a in range(4) if x.bias.shape[a] == 1)
        db = jnp.sum(dbias, axis=axes, keepdims=True).astype(x.bias.dtype)
    grads = KernelInputs(
        q=dq.astype(x.q.dtype),
        k=dk.astype(x.k.dtype),
        v=dv.astype(x.v.dtype),
        bias=db,
        mask=None,
        q_lens=None,
        kv_lens=None,
        q_seg=None,
        kv_seg=None,
        scale=jnp.zeros_like(x.scale),
    )
    return (grads,)


_flash.defvjp(_flash_fwd, _flash_bwd)


@float64_scoped
def blockwise_dot_product_attention(
    query: Float[ArrayLike, "B T N H"],
    key: Float[ArrayLike, "B S K H"],
    value: Float[ArrayLike, "B S K H_v"],
    bias: Float[ArrayLike, "#B #N #T #S"] | None = None,
    mask: Bool[ArrayLike, "#B #N #T #S"] | None = None,
    *,
    block_q: int = 128,
    block_k: int = 128,
    scale: float | ArrayLike | None = None,
    is_causal: bool = False,
    query_seq_lengths: Int[ArrayLike, " B"] | None = None,
    key_value_seq_lengths: Int[ArrayLike, " B"] | None = None,
    local_window_size: int | tuple[int | None, int | None] | None = None,
    segment_ids: Any = None,
    softcap: float | None = None,
    causal_alignment: Alignment = "top_left",
    masked_rows: MaskedRows = "zeros",
    return_lse: bool = False,
) -> Any:
    """Flash-form attention: tiles of ``block_q`` queries x ``block_k`` keys, online softmax.

    Equal to :func:`attnref.dot_product_attention` with the same arguments (rounding aside);
    the backward recomputes tiles from the saved ``lse`` (see the module docstring).

    Args:
        query: ``[B, T, N, H]``, floating.
        key: ``[B, S, K, H]``, the dtype of ``query``; ``N`` must be a multiple of ``K``.
        value: ``[B, S, K, H_v]``, the dtype of ``query``.
        bias: Floating, rank 4, broadcastable to ``[B, N, T, S]``, added after the softcap
            (``-inf`` masks the pair); ``None`` (default) adds nothing.
        mask: Boolean, rank 4, broadcastable to ``[B, N, T, S]``, ``True`` = may attend;
            ``None`` (default) allows every pair.
        block_q: Queries per tile, a positive int (default 128; capped at ``T``).
        block_k: Keys per tile, a positive int (default 128; capped at ``S``).
        scale: The logit scale; ``None`` (default) means ``1/sqrt(H)``.
        is_causal: If ``True``, query ``i`` reads keys ``j <= p_i`` only (``p_i`` placed by
            ``causal_alignment``).
        query_seq_lengths: Integer ``[B]`` in ``[0, T]``: rows at or beyond the length are
            padding (output 0, ``lse = -inf``); ``None`` (default) means every row is real.
        key_value_seq_lengths: Integer ``[B]`` in ``[0, S]``: keys at or beyond the length are
            never read; ``None`` (default) means all ``S`` keys.
        local_window_size: ``w`` or ``(left, right)`` (ints >= 0, ``None`` = unbounded side):
            query ``i`` reads keys in ``[p_i - left, p_i + right]``; ``None`` (default): no
            window.
        segment_ids: One ``[B, T]`` int array (needs ``T == S``) or a pair
            ``(query_segment_ids [B, T], key_value_segment_ids [B, S])``; a query attends only
            to keys of its own segment. ``None`` (default): one segment.
        softcap: A positive finite Python number ``c``: logits become ``c tanh(s / c)`` before
            the bias; ``None`` (default): no cap.
        causal_alignment: ``"top_left"`` (default, ``p_i = i``) or ``"bottom_right"``
            (``p_i = i + S_b - T_b`` with the actual lengths).
        masked_rows: What a fully masked query row returns: ``"zeros"`` (default), ``"uniform"``
            (the mean of ``value`` over all ``S`` keys) or ``"nan"``.
        return_lse: If ``True``, also return the log-sum-exp of each row's allowed logits.

    Returns:
        ``o [B, T, N, H_v]`` in the dtype of ``query``, or ``(o, lse)`` with ``lse [B, T, N]``
        when ``return_lse`` (both differentiable, by the flash backward).

    Raises:
        ValueError: If ``block_q`` or ``block_k`` is not a positive int, or for any argument
            :func:`attnref.dot_product_attention` refuses with ``ValueError`` (shapes, option
            values, concrete lengths out of range).
        TypeError: For the dtype and type errors of :func:`attnref.dot_product_attention`
            (non-floating ``query``, mixed dtypes, non-boolean ``mask``, non-integer lengths or
            segment ids, a non-bool ``is_causal``).
    """
    for name, b in (("block_q", block_q), ("block_k", block_k)):
        if not isinstance(b, int) or isinstance(b, bool) or b < 1:
            raise ValueError(f"{name} must be a positive int, got {b!r}")
    spec, x = prepare(
        query,
        key,
        value,
        bias,
        mask,
        scale=scale,
        is_causal=is_causal,
        query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths,
        local_window_size=local_window_size,
        segment_ids=segment_ids,
        softcap=softcap,
        causal_alignment=causal_alignment,
        masked_rows=masked_rows,
    )
    require_lengths_in_range(spec, x)
    if spec.t == 0 or spec.s == 0:  # nothing to tile: no query, or every row fully masked
        out, lse = naive(spec, x)
        return (out, lse) if return_lse else out
    bq, bk = min(block_q, spec.t), min(block_k, spec.s)
    out, lse = _flash(spec, max(bq, 1), max(bk, 1), x)
    return (out, lse) if return_lse else out
