"""The float64 gradient oracle of the kernel level: the VJP of ``dot_product_attention`` from its
analytic formulas, independent of any autodiff. NumPy only.

For one batch element, query head ``n`` (key/value head ``g = n // G``), query ``i`` and allowed
keys ``j`` (row convention), cotangents ``dO_i`` (output) and ``dl_i`` (lse)::

    x_ij = scale q_i . k_j,   s_ij = c tanh(x_ij / c) + bias_ij,   p_ij = softmax_j(s_ij)
    dv_j  += p_ij w_ij dO_i                     dP_ij = w_ij dO_i . v_j
    D_i    = sum_j p_ij dP_ij  (= dO_i . o_i)   dS_ij = p_ij (dP_ij - D_i + dl_i)
    dz_n  += p_iz (dl_i - D_i)                  (the sink, p_iz = exp(z_n - lse_i))
    dbias_ij = dS_ij          dX_ij = dS_ij (1 - tanh^2(x_ij / c))   (dX = dS without softcap)
    dq_i  += scale sum_j dX_ij k_j              dk_j += scale dX_ij q_i

``w_ij = keep_ij / (1 - rate)`` with dropout (else 1); sinks add ``exp(z_n)`` to the softmax
denominator. K/V head gradients sum over their ``G`` query heads; the bias gradient over its
broadcast axes. Rows with no allowed key and padding rows pass nothing, except under
``masked_rows="uniform"`` (every ``dv_j`` gains ``dO_i / S``); pairs not allowed pass nothing,
whatever their values; a non-finite logit or value in an allowed pair is refused
(``ValueError``). ``method="definition"``: one element at a time; ``"fast"``: BLAS over query
blocks (extra memory ``O(block x S)``).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from ._checks import check_cotangent, check_method
from ._doc import KERNEL, KERNEL_RAISES, doc, method_option, signed
from ._kernel import definition_logit, definition_rows
from ._kernel_call import KernelCall, kernel_call, parse, query_block
from ._kernel_fast import (
    block_live,
    dropout_weights,
    head_groups,
    logits_block,
    raw_logits,
    row_blocks,
)
from ._weight_grad import sum_to_shape


class KernelGrads(NamedTuple):
    """Gradients of a kernel call, each its input's shape (``None``: no bias, no sinks)."""

    query: np.ndarray
    key: np.ndarray
    value: np.ndarray
    bias: np.ndarray | None
    sinks: np.ndarray | None = None  # [N], with sinks


def cotangents(c: KernelCall, cotangent: Any, lse_cotangent: Any) -> tuple[np.ndarray, ...]:
    """``(dO [B, T, N, H_v], dl [B, T, N])`` as float64 (``dl`` 0 when ``None``)."""
    b, n, t, _ = c.shape
    d_o = check_cotangent("cotangent", cotangent, (b, t, n, c.v.shape[-1]))
    if lse_cotangent is None:
        return d_o, np.zeros((b, t, n))
    return d_o, check_cotangent("lse_cotangent", lse_cotangent, (b, t, n))


def _refuse_nonfinite(where: str) -> None:
    raise ValueError(
        f"the gradient is undefined: a non-finite {where} in an allowed (query, key) pair "
        "(masked pairs may hold anything)"
    )


def bias_add(
    acc: np.ndarray, ds: np.ndarray, b: int, heads: slice, rows: slice, keys: slice
) -> None:
    """``acc`` (the bias's own shape) += ``ds [heads, rows, keys]``, summed over the axes the
    bias broadcasts (its size-1 axes)."""
    index: list[Any] = [0 if acc.shape[0] == 1 else b]
    for axis, sl in enumerate((heads, rows, keys)):
        if acc.shape[axis + 1] == 1:
            ds = ds.sum(axis=axis, keepdims=True)
            sl = slice(0, 1)
        index.append(sl)
    acc[tuple(index)] += ds


def _dead_rows_uniform(c: KernelCall, d_o: np.ndarray, dead: np.ndarray, dv: np.ndarray) -> None:
    """``masked_rows="uniform"``: each dead (batch, query, head) adds ``dO / S`` to every value
    row of its key/value head. ``dead [B, T, N]``."""
    s = c.k.shape[1]
    per_head = np.where(dead[..., None], d_o, 0.0).sum(axis=1)  # [B, N, H_v]
    per_kv = per_head.reshape(per_head.shape[0], c.k.shape[2], c.group, -1).sum(axis=2)
    dv += per_kv[:, None] / s


def fast(c: KernelCall, d_o: np.ndarray, d_l: np.ndarray) -> KernelGrads:
    b_size, n_heads, t, _ = c.shape
    grp, h, h_v = c.group, c.q.shape[-1], c.v.shape[-1]
    dq, dk, dv = np.zeros_like(c.q), np.zeros_like(c.k), np.zeros_like(c.v)
    db = None if c.bias_shape is None else np.zeros(c.bias_shape)
    dz = None if c.sinks is None else np.zeros(n_heads)
    check_sinks(c)
    dead = np.zeros((b_size, t, n_heads), bool)
    rows = query_block(c, 4)
    for hg in head_groups(c):
        bad_v = ~np.isfinite(hg.v).all(axis=-1)  # [S]
        v0 = np.where(bad_v[:, None], 0.0, hg.v)
        k0 = np.where(np.isfinite(hg.kt), hg.kt, 0.0).T  # [S, H]
        for i0, i1, j0, j1 in row_blocks(c, hg.b, rows):
            s, ok = logits_block(c, hg, i0, i1, j0, j1)
            live = block_live(ok, s.shape)
            reads = live[..., None] if ok is None else ok
            if not np.isfinite(np.where(reads, s, 0.0)).all():
                _refuse_nonfinite("logit (q, k or bias)")
            if (reads & bad_v[j0:j1]).any():
                _refuse_nonfinite("value")
            z = None if c.sinks is None else c.sinks[hg.heads][:, None]  # [G, 1]
            top = s.max(axis=-1, initial=-np.inf)
            if z is not None:  # the sink: one more logit, no value
                top = np.maximum(top, z)
            alive = np.isfinite(top)  # a key or a sink to read
            top = np.where(alive, top, 0.0)
            e = np.exp(s - top[..., None])
            total = e.sum(axis=-1) + (0.0 if z is None else np.exp(z - top))
            total = np.where(alive, total, 1.0)
            p = np.where(alive[..., None], e / total[..., None], 0.0)
            m, n_k = grp * (i1 - i0), j1 - j0
            d_o_blk = d_o[hg.b, i0:i1, hg.heads].transpose(1, 0, 2).reshape(m, h_v)
            p2 = p.reshape(m, n_k)
            w2 = None if c.keep is None else dropout_weights(c, hg, i0, i1, j0, j1).reshape(m, n_k)
            dv[hg.b, j0:j1, hg.g] += (p2 if w2 is None else p2 * w2).T @ d_o_blk
            dp = d_o_blk @ v0[j0:j1].T  # dL/dp_ij = w_ij dO_i . v_j (w = 1 without dropout)
            if w2 is not None:
                dp = dp * w2
            big_d = np.sum(p2 * dp, axis=-1, keepdims=True)
            dl = d_l[hg.b, i0:i1, hg.heads].T.reshape(m, 1)
            ds = p2 * (dp - big_d + dl)
            if dz is not None and z is not None:  # dz_n = sum_i p_iz (dl_i - D_i)
                p_z = np.where(alive, np.exp(z - top) / total, 0.0).reshape(m, 1)
                dz[hg.heads] += (p_z * (dl - big_d)).reshape(grp, i1 - i0).sum(axis=1)
            if db is not None:
                blk = ds.reshape(grp, i1 - i0, n_k)
                bias_add(db, blk, hg.b, hg.heads, slice(i0, i1), slice(j0, j1))
            if c.softcap is not None:
                x = raw_logits(c, hg, i0, i1, j0, j1).reshape(m, n_k)
                ds = ds * (1.0 - np.tanh(x / c.softcap) ** 2)
            q_blk = c.q[hg.b, i0:i1, hg.heads].transpose(1, 0, 2).reshape(m, h)
            q_blk = np.where(live.reshape(m, 1), q_blk, 0.0)
            dq_blk = (c.scale * ds) @ k0[j0:j1]
            dq[hg.b, i0:i1, hg.heads] += dq_blk.reshape(grp, i1 - i0, h).transpose(1, 0, 2)
            dk[hg.b, j0:j1, hg.g] += c.scale * (ds.T @ q_blk)
            dead[hg.b, i0:i1, hg.heads] = ~live.T
    if c.policy == "uniform" and c.sinks is None:
        _dead_rows_uniform(c, d_o, dead, dv)
    return KernelGrads(dq, dk, dv, db, dz)


def check_sinks(c: KernelCall) -> None:
    """A NaN or ``+inf`` sink is read by every row of its head: no derivative (refused)."""
    if c.sinks is not None and (np.isnan(c.sinks) | np.isposinf(c.sinks)).any():
        _refuse_nonfinite("sink")


def _definition(
    c: KernelCall, d_o: np.ndarray, d_l: np.ndarray, call: dict[str, Any]
) -> KernelGrads:
    b_size, n_heads, t, _ = c.shape
    dq, dk, dv = np.zeros_like(c.q), np.zeros_like(c.k), np.zeros_like(c.v)
    full = np.zeros(c.shape)  # dbias per (b, n, i, j) before summing over broadcast axes
    dz = None if c.sinks is None else np.zeros(n_heads)
    check_sinks(c)
    dead = np.zeros((b_size, t, n_heads), bool)
    for b, n, g, i, keys, sink in definition_rows(c, call):
        if not keys and (sink is None or sink == -math.inf):
            dead[b, i, n] = True
            continue
        xs, ss = [], []
        for j in keys:
            x, sj = definition_logit(c, b, n, i, j)
            if not math.isfinite(sj):
                _refuse_nonfinite("logit (q, k or bias)")
            if not np.isfinite(c.v[b, j, g]).all():
                _refuse_nonfinite("value")
            xs.append(x)
            ss.append(sj)
        top = max([*ss, *([] if sink is None else [sink])])
        e = [math.exp(sj - top) for sj in ss]
        e_z = 0.0 if sink is None else math.exp(sink - top)  # the sink's weight
        total = sum(e) + e_z
        p = [ej / total for ej in e]
        ws = [1.0] * len(keys)  # dropout: w_ij = keep_ij / (1 - rate)
        if c.keep is not None and c.rate is not None:
            ws = [float(c.keep[b, n, i, j]) / (1.0 - c.rate) for j in keys]
        dps = [w * float(d_o[b, i, n] @ c.v[b, j, g]) for w, j in zip(ws, keys, strict=True)]
        big_d = sum(pj * dpj for pj, dpj in zip(p, dps, strict=True))
        if dz is not None:
            dz[n] += e_z / total * (float(d_l[b, i, n]) - big_d)
        for pj, dpj, w, x, j in zip(p, dps, ws, xs, keys, strict=True):
            ds = pj * (dpj - big_d + float(d_l[b, i, n]))
            full[b, n, i, j] = ds
            if c.softcap is not None:
                ds *= 1.0 - math.tanh(x / c.softcap) ** 2
            dv[b, j, g] += pj * w * d_o[b, i, n]
            dq[b, i, n] += c.scale * ds * c.k[b, j, g]
            dk[b, j, g] += c.scale * ds * c.q[b, i, n]
    if c.policy == "uniform" and c.sinks is None:
        _dead_rows_uniform(c, d_o, dead, dv)
    db = None if c.bias_shape is None else sum_to_shape(full, c.bias_shape)
    return KernelGrads(dq, dk, dv, db, dz)


@doc(KERNEL, KERNEL_RAISES)
@signed(kernel_call, method_option, front=("cotangent", "lse_cotangent"))
def dot_product_attention_vjp(
    call: dict[str, Any], *, cotangent: Any, lse_cotangent: Any = None
) -> KernelGrads:
    """Float64 VJP of :func:`attnref.oracle.dot_product_attention`: the gradients of
    ``sum(cotangent * o) + sum(lse_cotangent * lse)`` (module docstring), never by autodiff.

    Returns:
        :class:`KernelGrads` ``(query, key, value, bias)``, float64, each the shape of its
        input (``bias`` ``None`` without a bias).
    """
    method = check_method(call.pop("method"))
    c = parse(**call)
    d_o, d_l = cotangents(c, cotangent, lse_cotangent)
    if method == "fast":
        return fast(c, d_o, d_l)
    return _definition(c, d_o, d_l, call)
