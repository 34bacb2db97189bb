"""Gradient oracle: the VJP of the weight-level attention oracle from the analytic backward
(never autodiff). NumPy only, float64.

For batch element ``b`` and query head ``i`` reading key/value head ``g = i // G`` (row
convention; ``R_m`` the RoPE rotation at position ``m``, the identity without RoPE)::

    Q_i = R(X_q W_Q[i] + b_Q[i])        K_i = R(X_kv W_K[g] + b_K[g])     V_i = X_kv W_V[g] + b_V[g]
    S_i = scale Q_i K_i^T + bias         P_i = softmax over the allowed keys of every row of S_i
    Y   = sum_i P_i V_i W_O[i] + b_O  (+ X_q if residual)

and a cotangent ``dY [T_q, d_model]``::

    dW_O[i] += (P_i V_i)^T dY             db_O += sum_t dY[t]
    dZ_i     = dY W_O[i]^T                                        [T_q, d_v]
    dV_i     = P_i^T dZ_i                                         [T_k, d_v]
    dP_i     = dZ_i V_i^T                                         [T_q, T_k]
    dS_i     = P_i * (dP_i - rowsum(P_i * dP_i))                  (zero where P_i is zero)
    dbias   += sum_i dS_i   (then summed over the axes ``bias`` was broadcast along)
    dQ_i     = R^T(scale dS_i K_i)        dK_i = R^T(scale dS_i^T Q_i)   (R^T(v) at m = R(v) at -m)
    dW_Q[i] += X_q^T dQ_i    db_Q[i] += colsum dQ_i    dX_q += dQ_i W_Q[i]^T
    dW_K[g] += X_kv^T dK_i   db_K[g] += colsum dK_i    dX_kv += dK_i W_K[g]^T
    dW_V[g] += X_kv^T dV_i   db_V[g] += colsum dV_i    dX_kv += dV_i W_V[g]^T
    dX_q += dY (residual);   dX_q += dX_kv when x_kv is None (self-attention: both paths)

A fully masked row has ``P = 0``, hence ``dS = 0``; ``mask`` and positions have no gradient. A
key/value token no query may read passes nothing (read as zeros, so a NaN there never reaches
``dW_K``, ``dW_V``, ``dx_kv``); other inputs are assumed finite. ``method="definition"``: one
element at a time; ``"fast"``: BLAS for every head, by query blocks (the budget of
:mod:`attnref.oracle._core`; ``dK``, ``dV`` kept per batch element).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from ._checks import check_cotangent, check_method, shape_of
from ._core import (
    FIELDS,
    Block,
    Fast,
    Rotation,
    Turn,
    allowed_pairs,
    each_block,
    fast_problem,
    head_weights,
    offset,
    row_weights,
    side_by_side,
    stacked_t,
)
from ._doc import WEIGHT, WEIGHT_RAISES, block_options, doc, rope_call, signed, weight_call
from ._rope import rope_inputs, rotation, turn

# float64 [H, block, T_k] arrays a backward block is budgeted for: the weights and dP (turned into
# dS in place) are kept, the rest is headroom for NumPy's temporaries and BLAS workspace
_GRAD_ARRAYS = 6


class AttentionGrads(NamedTuple):
    """Gradients of ``<d_y, attention(params, x_q, x_kv, bias=bias, ...)>``.

    Attributes:
        params: One entry per parameter field (``w_q, w_k, w_v, w_o, b_q, b_k, b_v, b_o``), the
            shape of that parameter; ``None`` for an absent bias.
        x_q: ``[..., T_q, d_model]`` (both paths when ``x_kv`` was ``None``).
        x_kv: ``[..., T_k, d_model]``, or ``None`` when ``x_kv`` was ``None``.
        bias: The shape of the ``bias`` argument (summed over its broadcast axes), or ``None``
            when no bias was given.
    """

    params: dict[str, np.ndarray | None]
    x_q: np.ndarray
    x_kv: np.ndarray | None
    bias: np.ndarray | None


# ----------------------------------------------------------------------------- shared


def _zero_grads(p: Fast) -> dict[str, np.ndarray]:
    """Zero accumulators of every field's shape (biases included, present or not)."""
    out = {}
    for name, w in zip(("q", "k", "v", "o"), head_weights(p.w), strict=True):
        out["w_" + name] = np.zeros(w.shape)
        out["b_" + name] = np.zeros(w.shape[2] if name == "o" else w.shape[::2])
    return out


def sum_to_shape(a: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Sum ``a`` over the axes along which an array of ``shape`` was broadcast to ``a.shape``."""
    a = a.sum(axis=tuple(range(a.ndim - len(shape))))
    axes = tuple(k for k, n in enumerate(shape) if n == 1 and a.shape[k] != 1)
    return a.sum(axis=axes, keepdims=True) if axes else a


# ----------------------------------------------------------------------------- definition


def _definition(
    p: Fast,
    dy: np.ndarray,
    turn: Turn | None = None,
    pos_q: np.ndarray | None = None,
    pos_k: np.ndarray | None = None,
) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray, np.ndarray]:
    """The backward one element at a time: ``(param grads, dX_q, dX_kv, dbias)`` before the
    residual and shared paths; ``turn(v, m)`` (RoPE) rotates one vector."""
    w_q, w_k, w_v, w_o = head_weights(p.w)
    n_heads, _, d_k = w_q.shape
    d_v = w_v.shape[2]
    t_q, t_k = p.xq.shape[-2], p.xkv.shape[-2]
    g = _zero_grads(p)
    dxq, dxkv = np.zeros(p.xq.shape), np.zeros(p.xkv.shape)
    d_bias = np.zeros((*p.batch, t_q, t_k))

    def rot(v: np.ndarray, pos: np.ndarray | None, idx: tuple[int, ...], t: int, sign: int):
        return v if turn is None or pos is None else turn(v, sign * int(pos[idx][t]))

    for idx in np.ndindex(*p.batch):
        xq, xkv, dyb = p.xq[idx], p.xkv[idx], dy[idx]
        for i in range(n_heads):
            kv = int(p.kv_of[i])  # the key/value head that query head i reads
            keys = np.zeros((t_k, d_k))
            for j in range(t_k):
                keys[j] = rot(xkv[j] @ w_k[kv] + offset(p.w, "b_k", kv), pos_k, idx, j, 1)
            values = xkv @ w_v[kv] + offset(p.w, "b_v", kv)
            d_keys, d_values = np.zeros((t_k, d_k)), np.zeros((t_k, d_v))
            for t in range(t_q):
                q = rot(xq[t] @ w_q[i] + offset(p.w, "b_q", i), pos_q, idx, t, 1)
                scores = np.array([q @ keys[j] for j in range(t_k)]) * p.scale
                pr = row_weights(p, idx, t, scores, lambda a: a)
                z = sum((pr[j] * values[j] for j in range(t_k)), np.zeros(d_v))
                g["w_o"][i] += np.outer(z, dyb[t])  # dW_O = Z^T dY
                dz = w_o[i] @ dyb[t]  # dZ = dY W_O^T
                dp = np.array([dz @ values[j] for j in range(t_k)])  # dP = dZ V^T
                c = sum((pr[j] * dp[j] for j in range(t_k)), 0.0)  # rowsum(P * dP)
                ds = pr * (dp - c)  # dS = P * (dP - rowsum(P * dP))
                d_bias[idx][t] += ds
                dq = p.scale * sum((ds[j] * keys[j] for j in range(t_k)), np.zeros(d_k))
                for j in range(t_k):
                    d_keys[j] += p.scale * ds[j] * q  # dK = scale dS^T Q
                    d_values[j] += pr[j] * dz  # dV = P^T dZ
                dq = rot(dq, pos_q, idx, t, -1)  # R^T
                g["w_q"][i] += np.outer(xq[t], dq)
                g["b_q"][i] += dq
                dxq[idx][t] += w_q[i] @ dq
            for j in range(t_k):
                dk = rot(d_keys[j], pos_k, idx, j, -1)
                g["w_k"][kv] += np.outer(xkv[j], dk)
                g["b_k"][kv] += dk
                g["w_v"][kv] += np.outer(xkv[j], d_values[j])
                g["b_v"][kv] += d_values[j]
                dxkv[idx][j] += w_k[kv] @ dk + w_v[kv] @ d_values[j]
        for t in range(t_q):
            g["b_o"] += dyb[t]
    return g, dxq, dxkv, d_bias


# ----------------------------------------------------------------------------- fast


def _bias_add(acc: np.ndarray, idx: tuple[int, ...], rows: slice, ds_sum: np.ndarray) -> None:
    """Add ``sum_i dS_i [n, T_k]`` of the query ``rows`` of batch element ``idx`` straight into
    ``acc``, the bias gradient in ``bias``'s own (broadcast) shape led by 1s to the batch rank, so
    it never needs ``[*batch, T_q, T_k]`` unless ``bias`` has that shape."""
    at = tuple(0 if n == 1 else i for n, i in zip(acc.shape, idx, strict=False))
    target = acc[at]  # [T_q or 1, T_k or 1], a view
    if target.shape[1] == 1:
        ds_sum = ds_sum.sum(axis=1, keepdims=True)
    if target.shape[0] == 1:
        target += ds_sum.sum(axis=0, keepdims=True)
    else:
        target[rows] += ds_sum


def _fast(
    p: Fast,
    dy: np.ndarray,
    bias_shape: tuple[int, ...] | None,
    rotations: tuple[Rotation, ...] | None = None,
) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray, np.ndarray | None]:
    """:func:`_definition` with BLAS by query blocks (``rotations = (R_q, R_k, R_q^T, R_k^T)``),
    the bias gradient in ``bias_shape``."""
    w_q, w_k, w_v, w_o = head_weights(p.w)
    (n_heads, _, d_k), (n_kv, _, d_v) = w_q.shape, w_v.shape
    t_k = p.xkv.shape[-2]
    g = _zero_grads(p)
    dxq, dxkv = np.zeros(p.xq.shape), np.zeros(p.xkv.shape)
    d_keys = np.zeros((*p.batch, n_heads, t_k, d_k))  # per query head, rotated coordinates
    d_values = np.zeros((*p.batch, n_heads, t_k, d_v))
    lead = (1,) * (len(p.batch) + 2 - len(bias_shape or ()))
    d_bias = None if bias_shape is None else np.zeros(lead + bias_shape)
    w_q_t = stacked_t(w_q)
    w_o_t = np.swapaxes(w_o, -1, -2)  # [H, d_model, d_v]
    rot_q, rot_k, back_q, back_k = (None,) * 4 if rotations is None else rotations

    def visit(blk: Block) -> None:
        idx, rows, pr = blk.idx, blk.rows, blk.weights
        dyb = dy[idx][rows]  # [n, d_model]
        z = np.matmul(pr, blk.values)  # [H, n, d_v]
        g["w_o"] += np.matmul(np.swapaxes(z, -1, -2), dyb)  # dW_O = Z^T dY
        dz = np.matmul(dyb, w_o_t)  # dZ = dY W_O^T, [H, n, d_v]
        d_values[idx] += np.matmul(np.swapaxes(pr, -1, -2), dz)  # dV = P^T dZ
        ds = np.matmul(dz, np.swapaxes(blk.values, -1, -2))  # dP = dZ V^T, [H, n, T_k]
        ds -= np.einsum("hnk,hnk->hn", pr, ds)[..., None]  # rowsum(P * dP), no temporary
        ds *= pr  # dS = P * (dP - rowsum(P * dP))
        if d_bias is not None:
            _bias_add(d_bias, idx, rows, ds.sum(axis=0))
        dk = np.matmul(np.swapaxes(ds, -1, -2), blk.q)
        dk *= p.scale
        d_keys[idx] += dk  # dK = scale dS^T Q
        dq = np.matmul(ds, blk.keys)
        dq *= p.scale  # dQ = scale dS K
        if back_q is not None:
            dq = back_q(idx, rows, dq)
        g["w_q"] += np.matmul(p.xq[idx][rows].T, dq)
        g["b_q"] += dq.sum(axis=1)
        dxq[idx][rows] += side_by_side(dq) @ w_q_t

    each_block(p, visit, rotate_q=rot_q, rotate_k=rot_k, arrays=_GRAD_ARRAYS)
    group = n_heads // n_kv
    w_kv_t = np.concatenate([stacked_t(w_k), stacked_t(w_v)])  # [K (d_k + d_v), d_model]
    for idx in np.ndindex(*p.batch):
        dk = d_keys[idx] if back_k is None else back_k(idx, slice(None), d_keys[idx])
        dk = dk.reshape(n_kv, group, t_k, d_k).sum(axis=1)  # shared heads: sum over the group
        dv = d_values[idx].reshape(n_kv, group, t_k, d_v).sum(axis=1)
        xt = p.xkv[idx].T
        g["w_k"] += np.matmul(xt, dk)
        g["b_k"] += dk.sum(axis=1)
        g["w_v"] += np.matmul(xt, dv)
        g["b_v"] += dv.sum(axis=1)
        dxkv[idx] = np.concatenate([side_by_side(dk), side_by_side(dv)], axis=1) @ w_kv_t
    g["b_o"] = dy.sum(axis=tuple(range(dy.ndim - 1)))
    return g, dxq, dxkv, None if d_bias is None else d_bias.reshape(bias_shape)


# ----------------------------------------------------------------------------- public


@doc(WEIGHT, WEIGHT_RAISES)
@signed(weight_call, block_options, front=("d_y",))
def attention_vjp(call: dict[str, Any], *, d_y: Any) -> AttentionGrads:
    """Gradients of ``sum(d_y * attention(params, x_q, x_kv, ...))`` with respect to every
    parameter, ``x_q``, ``x_kv`` and ``bias`` (module docstring), float64.

    Returns:
        :class:`AttentionGrads`.
    """
    return _vjp(call, d_y)


@doc(WEIGHT, WEIGHT_RAISES)
@signed(rope_call, block_options, front=("d_y",))
def rope_attention_vjp(call: dict[str, Any], *, d_y: Any) -> AttentionGrads:
    """:func:`attention_vjp` of :func:`attnref.oracle.rope_attention` (positions get no
    gradient).

    Returns:
        :class:`AttentionGrads`, as :func:`attention_vjp`.
    """
    return _vjp(call, d_y, rope=True)


def _vjp(call: dict[str, Any], d_y: Any, rope: bool = False) -> AttentionGrads:
    """Both gradient oracles of a public call (``rope``: of :func:`rope_attention`)."""
    residual, method = call.pop("residual"), call.pop("method")
    fast = check_method(method) == "fast"
    p, pq, pk = rope_inputs(call) if rope else (fast_problem(*call.values()), None, None)
    shared = call["x_kv"] is None
    if not shared and (allowed := allowed_pairs(p)) is not None:
        # the non-finite x_kv tokens no query may read, as zeros
        unread = ~allowed.any(axis=-2) & ~np.isfinite(p.xkv).all(axis=-1)  # [*batch, T_k]
        p = p._replace(xkv=np.where(unread[..., None], 0.0, p.xkv))
    want = (*p.batch, p.xq.shape[-2], head_weights(p.w)[3].shape[2])
    dy = check_cotangent("d_y", d_y, want, "the output's shape [..., T_q, d_model] = ")
    bias_shape = None if call["bias"] is None else shape_of(call["bias"])
    if fast:
        rotations = None
        if pq is not None and pk is not None:  # RoPE
            rotations = tuple(
                rotation(pos, call["base"], call["convention"], sign)
                for sign in (1.0, -1.0)
                for pos in (pq, pk)
            )
        g, dxq, dxkv, d_bias = _fast(p, dy, bias_shape, rotations)
    else:
        rot = turn(call["base"], call["convention"]) if rope else None
        g, dxq, dxkv, d_full = _definition(p, dy, rot, pq, pk)
        d_bias = None if bias_shape is None else sum_to_shape(d_full, bias_shape)
    if residual:
        dxq = dxq + dy
    if shared:
        dxq = dxq + dxkv
    params = {name: (g[name] if p.w[name] is not None else None) for name in FIELDS}
    return AttentionGrads(params, dxq, None if shared else dxkv, d_bias)
