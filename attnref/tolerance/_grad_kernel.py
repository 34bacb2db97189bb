"""The kernel level's gradient bound: :func:`kernel_grad_error_bound` on ``|g - g_oracle|`` for
the gradients of ``dot_product_attention`` in a format of unit round-off ``u``. NumPy, float64.

First order, componentwise, for any evaluation order of the backward of
:mod:`attnref.oracle._kernel_grad` (autodiff, or a flash backward recomputing ``p`` from the
lse); ``C = C_EXP``, ``mag`` the forward bound's magnitudes (:mod:`attnref.tolerance._kernel`):

1. Weights: ``|dp_ij| <= r_i p_ij``, ``r_i = max(rho_i, expm1(E_i + L_i) + gamma_{C+2})`` (the
   forward's softmax factor; ``p = exp(s - lse)`` with the lse off by ``L_i``).
2. ``dP_ij = dO_i . v_j``: ``e_dP = gamma_{H_v} |dO_i|.|v_j|``.
3. ``D_i``: the larger of ``|dO_i|.e_o + gamma_{H_v} |dO_i|.|o|_i`` (as ``dO_i . o_i``) and
   ``sum_j p_ij (r_i |dP_ij| + e_dP) + gamma_S sum_j p_ij |dP_ij|`` (as ``sum_j p_ij dP_ij``).
4. ``dS_ij = p_ij (dP_ij - D_i + dl_i)``, ``G = |dP| + |D| + |dl|``: ``e_dS = p_ij (r_i G_ij +
   e_dP + e_D + 3 u G_ij)``.
5. Softcap ``dX = dS f``, ``f = 1 - t^2``, ``t = tanh(x / c)``, ``e_x = gamma_{H+1} mag``: ``e_t =
   f e_x / c + (C + 1) u |t|``, ``e_f = 2 |t| e_t + 2 u``, ``e_dX = e_dS f + |dS| e_f + u |dX|``.
6. Sums: ``dq``: ``|scale| (e_dX |k| + gamma_{S+2} |dX| |k|)``; ``dk`` over the ``T G`` pairs of
   its K/V head: ``|scale| (e_dX^T |q| + gamma_{T G+2} |dX|^T |q|)``; ``dv``: ``(r p)^T |dO| +
   gamma_{T G+1} p^T |dO|``; bias over its ``m`` broadcast entries: ``sum e_dS + gamma_m sum
   |dS|``; ``masked_rows="uniform"`` adds ``gamma_{T G+2} sum |dO_i| / S`` to every ``dv_j``.

16-bit inputs run in float32 and the gradient is rounded once (``+ u_16 (|g| + bound)``). The
float64 oracle's own error is included: ``|g - g_oracle| <= bound`` is rigorous to first order.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from attnref.oracle._doc import KERNEL, KERNEL_RAISES, doc, signed
from attnref.oracle._kernel_call import allowed_rows, kernel_call, parse
from attnref.oracle._kernel_grad import KernelGrads, bias_add, cotangents, fast

from ._kernel import kernel_logits, logit_reach, row_terms
from ._rounding import C_EXP, gamma, is_16bit, unit_roundoff, work_units

__all__ = ["kernel_grad_error_bound"]


def _block(
    call: Any, b: int, i0: int, i1: int, ok: np.ndarray, kv: tuple[np.ndarray, ...], units: Any
) -> tuple[np.ndarray, ...]:
    """Bounds of query rows ``i0 .. i1 - 1`` of batch ``b`` per head (``ok [N, R, S]``; ``kv``:
    keys, values ``[N, S, d]`` and the cotangents ``d_o``, ``d_l``), summed over ``units``:
    ``(e_dq, e_dk, e_dv, e_dS, |dS|)``; sinks are appended as key ``S`` (value 0)."""
    kg, vg, d_o, d_l = kv
    d_o, d_l = d_o[b, i0:i1].transpose(1, 0, 2), d_l[b, i0:i1].T
    bias = None if call.bias is None else call.bias[b, :, i0:i1]
    q, sc, softcap, z = call.q[b, i0:i1].transpose(1, 0, 2), call.scale, call.softcap, call.sinks
    w = None  # dropout's keep / (1 - p)
    if call.keep is not None and call.rate is not None:
        keep = np.broadcast_to(call.keep[b, :, i0:i1], ok.shape)
        w = np.where(keep, 1.0 / (1.0 - call.rate), 0.0)
    n_dk, c = call.shape[2] * call.group, C_EXP
    if z is not None:
        col = np.broadcast_to(z[:, None, None], (len(z), q.shape[1], 1))
        kg, vg = (np.concatenate([a, np.zeros((a.shape[0], 1, a.shape[2]))], 1) for a in (kg, vg))
        ok = np.concatenate([ok, np.isfinite(col)], axis=-1)
        base = np.zeros((*ok.shape[:2], ok.shape[2] - 1)) if bias is None else bias
        bias = np.concatenate([np.broadcast_to(base, ok.shape[:2] + base.shape[2:]), col], -1)
        if w is not None:
            w = np.concatenate([w, np.ones(col.shape)], axis=-1)
    h, s_len, h_v = q.shape[-1], kg.shape[1], vg.shape[-1]
    # What no unit round-off changes, once: the logits, weights and the cotangents' products.
    lg = kernel_logits(q, kg.transpose(0, 2, 1), sc, softcap, bias, ok)
    raw, mag, p = lg.raw, lg.mag, lg.sm.weights
    abs_v, abs_do = np.abs(vg), np.abs(d_o)
    pw = p if w is None else p * w  # the weights of the values (dropout: kept, scaled)
    o_mag = pw @ abs_v  # [N, R, H_v]
    d_p = d_o @ vg.transpose(0, 2, 1)  # [N, R, S]
    dp_mag = abs_do @ abs_v.transpose(0, 2, 1)  # e_dp = gamma_{H_v} dp_mag (times w)
    if w is not None:  # dP_ij = w_ij dO_i . v_j: one more product
        d_p, dp_mag = w * d_p, w * dp_mag
    big_d = np.sum(p * d_p, axis=-1, keepdims=True)
    pd = p * np.abs(d_p)
    g_mag = np.abs(d_p) + np.abs(big_d) + np.abs(d_l)[..., None]
    d_s = p * (d_p - big_d + d_l[..., None])
    f = t = None
    d_x = d_s
    if softcap is not None:
        t = np.tanh(raw / softcap)
        f = 1.0 - t * t
        d_x = d_s * f
    # The bound is a sum over the units; every product below is linear in its u-dependent
    # factor, so the factors are summed first and each product is formed once.
    e_ds, e_dx, rp = np.zeros_like(p), np.zeros_like(p), np.zeros_like(p)  # rp: sum_u r_i p_ij
    g_q = g_k = g_v = 0.0
    reach = logit_reach(lg, ok, h, softcap)  # [N, R]
    for u in units:
        e_row, rho, l_err = row_terms(reach, h, s_len, s_len, u)  # any tiling: n_b = S
        with np.errstate(over="ignore"):
            r = np.maximum(rho, np.expm1(e_row + l_err) + gamma(c + 2, u))[..., None]
        e_o = (rho + gamma(s_len + (w is not None), u))[..., None] * o_mag
        e_dp = gamma(h_v, u) * dp_mag
        if w is not None:
            e_dp = e_dp + u * np.abs(d_p)
        e_d1 = (
            np.sum(abs_do * e_o, -1, keepdims=True)
            + gamma(h_v, u) * np.sum(abs_do * o_mag, -1)[..., None]
        )
        e_d2 = (
            np.sum(r * pd + p * e_dp, -1, keepdims=True) + gamma(s_len, u) * pd.sum(-1)[..., None]
        )
        e_d = np.maximum(e_d1, e_d2)
        e_ds_u = p * (r * g_mag + e_dp + e_d + 3 * u * g_mag)
        e_ds += e_ds_u
        if softcap is not None and f is not None and t is not None:
            e_t = f * gamma(h + 1, u) * mag / softcap + (c + 1) * u * np.abs(t)
            e_f = 2 * np.abs(t) * e_t + 2 * u
            e_dx += e_ds_u * f + np.abs(d_s) * e_f + u * np.abs(d_x)
        else:
            e_dx += e_ds_u
        rp += r * pw
        g_q += gamma(s_len + 2, u)
        g_k += gamma(n_dk + 2, u)
        g_v += gamma(n_dk + 1 + (w is not None), u)
    abs_k, abs_q, abs_dx = np.abs(kg), np.abs(q), np.abs(d_x)
    e_dq = abs(sc) * (e_dx @ abs_k + g_q * (abs_dx @ abs_k))
    e_dk = abs(sc) * (e_dx.transpose(0, 2, 1) @ abs_q + g_k * (abs_dx.transpose(0, 2, 1) @ abs_q))
    pt = pw.transpose(0, 2, 1)  # dv_j = sum_i p_ij w_ij dO_i
    e_dv = rp.transpose(0, 2, 1) @ abs_do + g_v * (pt @ abs_do)
    return e_dq, e_dk, e_dv, e_ds, np.abs(d_s)


@doc(KERNEL, KERNEL_RAISES)
@signed(kernel_call, front=("cotangent", "lse_cotangent"))
def kernel_grad_error_bound(
    call: dict[str, Any],
    *,
    cotangent: Any,
    lse_cotangent: Any = None,
    dtype: Any = None,
    budget: int = 128 << 20,
) -> Any:
    """Componentwise bounds on the error of the gradients of ``sum(cotangent * o) +
    sum(lse_cotangent * lse)`` computed in ``dtype`` (module docstring), by query blocks.

    Returns:
        :class:`attnref.oracle.KernelGrads` of float64 bounds, each the shape of its input
        (``bias`` ``None`` without a bias).
    """
    c = parse(**call)
    d_o, d_l = cotangents(c, cotangent, lse_cotangent)
    fmt = np.dtype(np.asarray(call["query"]).dtype if dtype is None else dtype)
    _, units = work_units(fmt)
    b_size, n_heads, t, s_len = c.shape
    grp, n_kv = c.group, c.k.shape[2]
    out = [np.zeros_like(c.q), np.zeros_like(c.k), np.zeros_like(c.v)]
    # the bias's and the sinks' (bound, sum |dS|) pairs
    db = None if c.bias_shape is None else np.zeros((2, *c.bias_shape))
    dz = None if c.sinks is None else np.zeros((2, n_heads))
    rows = max(1, budget // max(1, n_heads * s_len * 8 * 16))
    for b in range(b_size):
        kg, vg = (np.repeat(a[b], grp, axis=1).transpose(1, 0, 2) for a in (c.k, c.v))  # [N, S, H]
        dead = np.zeros((t, n_heads), bool)
        for i0 in range(0, int(c.q_len[b]), rows):
            i1 = min(i0 + rows, int(c.q_len[b]))
            ok = allowed_rows(c, b, slice(None), i0, i1, 0, s_len)
            ok = np.ones((n_heads, i1 - i0, s_len), bool) if ok is None else ok
            dead[i0:i1] = ~ok.any(axis=-1).T
            if c.sinks is not None:  # a row with a finite sink is alive
                dead[i0:i1] &= ~np.isfinite(c.sinks)[None, :]
            e_dq, e_dk, e_dv, e_ds, a_ds = _block(c, b, i0, i1, ok, (kg, vg, d_o, d_l), units)
            if dz is not None:  # the sink's column, then the keys'
                dz += np.stack([e_ds[..., s_len], a_ds[..., s_len]]).sum(axis=2)
                e_dk, e_dv = e_dk[:, :s_len], e_dv[:, :s_len]
                e_ds, a_ds = e_ds[..., :s_len], a_ds[..., :s_len]
            out[0][b, i0:i1] += e_dq.transpose(1, 0, 2)
            out[1][b] += e_dk.reshape(n_kv, grp, s_len, -1).sum(1).transpose(1, 0, 2)
            out[2][b] += e_dv.reshape(n_kv, grp, s_len, -1).sum(1).transpose(1, 0, 2)
            if db is not None:
                for acc, ds in zip(db, (e_ds, a_ds), strict=True):
                    bias_add(acc, ds, b, slice(None), slice(i0, i1), slice(0, s_len))
        if c.policy == "uniform" and c.sinks is None:
            dead_do = np.where(dead[..., None], np.abs(d_o[b]), 0.0).sum(0)  # [N, H_v]
            per_kv = dead_do.reshape(n_kv, grp, -1).sum(1)
            g = sum(gamma(t * grp + 2, u) for u in units)
            out[2][b] += g * per_kv[None] / max(s_len, 1)
    e_db = e_dz = None
    if db is not None:
        m = math.prod(c.shape) // max(1, math.prod(c.bias_shape or ()))  # entries per entry
        e_db = db[0] + sum(gamma(m, u) for u in units) * db[1]
    if dz is not None:  # dz_n sums its column over the B T rows
        e_dz = dz[0] + sum(gamma(b_size * t, u) for u in units) * dz[1]
    grads = KernelGrads(out[0], out[1], out[2], e_db, e_dz)
    if is_16bit(fmt):
        ref: Any = fast(c, d_o, d_l)  # the float64 gradients (their final rounding)
        u16 = unit_roundoff(fmt)
        final = [
            None if e is None else e + u16 * (np.abs(r) + e)
            for e, r in zip(grads, ref, strict=True)
        ]
        grads = KernelGrads(*final)  # type: ignore[arg-type]
    return grads
