"""Derived error bound for the weight-level gradient oracle (:func:`attnref.oracle.attention_vjp`,
:func:`attnref.oracle.rope_attention_vjp`). NumPy only, float64.

First order in ``dtype``'s ``u`` (every operation in that format, ``gamma_n = n u / (1 - n u)``,
Higham 2002, Lemma 3.1 and eq. 3.13), componentwise, for *one* computation from exact inputs: the
oracle's two float64 methods differ by at most twice the float64 bound.

**Model.** Every intermediate ``X`` of the backward (module docstring of
:mod:`attnref.oracle._weight_grad`) carries a magnitude ``M_X >= |X|`` and an error ``E_X``. A
stage ``C = sum_l a_l b_l`` over ``n`` leaves (any order and grouping) gives ``M_C = sum |a| M_b``,
``E_C = sum (E_a M_b + M_a E_b) + gamma_{n + extra} M_C`` (``extra``: further roundings on a
leaf's path). Magnitudes use homogeneous coordinates (``x~ = [x, 1]``, ``W~ = [W; b]``); ``P`` is
the float64 softmax (its own error is second order).

**Forward** (batch element, query head ``i``, key/value head ``g``):

1. ``Q = x~_q W~_Q[i]``, ``K``, ``V``: ``E = gamma_{d_model+1} M``. RoPE: ``M_Qr = J M_Q``,
   ``E_Qr = J E_Q + (e(m) + gamma_2) M_Qr`` (``J`` the pair sum, ``e_p(m)`` the ``cos``/``sin``
   error of :mod:`attnref.tolerance`).
2. ``S = scale Q K^T + bias``: ``E_S = |scale| (E_Q M_K^T + M_Q E_K^T) + gamma_{d_k + 2} Ls + u |S
   - max S|``, ``Ls = |scale| M_Q M_K^T + |bias|``.
3. ``P``: ``E_P = rho P``, ``rho = exp(2 max_j E_S) - 1 + gamma_{T_k + 2 + 2 C_EXP}``.
4. ``Z = P V``: ``E_Z = E_P M_V + P E_V + gamma_{T_k} P M_V``.

**Backward** (``A = |dY|``; ``dY`` and the weights exact):

5. ``dZ = dY W_O^T``: ``M = A |W_O|^T``, ``E = gamma_{d_model} M``.
6. ``dP = dZ V^T``: ``E_dP = E_dZ M_V^T + M_dZ E_V^T + gamma_{d_v} M_dP``.
7. ``dS = P (dP - c)``, ``c = sum_j P dP``: ``M_dS = P (M_dP + sum_j P M_dP)``, ``E_dS = E_P (M_dP
   + sum_j P M_dP) + P (E_dP + sum_j (E_P M_dP + P E_dP)) + gamma_{T_k + C_SOFTMAX_VJP} M_dS``:
   ``T_k - 1`` additions through ``c`` plus at most 5 roundings (3 in ``P (dP - c)``; 5 in JAX's
   reverse mode of ``e / sum e``, whose ratios carry ``P``'s ``rho``).
8. ``dbias = sum_i dS_i`` over the broadcast axes: ``n = H r`` (``r`` copies).
9. ``dQ = scale dS K``: ``gamma_{T_k + 1}``; then ``R^T`` as in stage 1.
10. ``dK_i = scale dS^T Q``, ``dV_i = P^T dZ``: ``gamma_{G T_q + 1}``, ``gamma_{G T_q}`` (a flat sum
    over a key/value group's queries); ``R^T`` for ``dK``.
11. Outputs, flat sums in any order: ``dW~_Q`` (``n = B T_q``), ``dW~_K``, ``dW~_V`` (``n = B G
    T_k``), ``dW_O``, ``db_O`` (``n = B T_q``), ``dX_kv`` (``n = H (d_k + d_v)``), ``dX_q`` (``n =
    H d_k``, +1 with the residual, ``+ H (d_k + d_v)`` when ``x_kv`` is ``x_q``).

This covers both oracle methods and the float64 reverse-mode gradient of
:func:`attnref.concat_attention`. ``inf`` where ``gamma_n`` is (``n u >= 1``).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from attnref.oracle._core import FIELDS, get_param, head_weights, tokens, unpack
from attnref.oracle._doc import WEIGHT, doc, rope_call, signed, weight_call
from attnref.oracle._weight_grad import AttentionGrads, sum_to_shape

from ._core import (
    BOUND_RAISES,
    abs_heads,
    grad_bound_options,
    hom,
    problem_softmax,
    read_problem,
    read_weights,
)
from ._rope import check_rope, pair_sum, rope_angle_error, rope_spread, rope_theta, rotated_heads
from ._rounding import C_EXP, gamma, unit_roundoff

C_SOFTMAX_VJP = 5  # roundings on the softmax VJP's longest leaf path besides its row sum


class _ME(NamedTuple):
    """A magnitude ``m >= |X|`` and an error bound ``e >= |fl(X) - X|`` (same shape)."""

    m: np.ndarray
    e: np.ndarray


def _ein(spec: str, *ops: np.ndarray) -> np.ndarray:
    return np.einsum(spec, *ops, optimize=True)


def _times(g: float, m: np.ndarray) -> np.ndarray:
    """``g * m``, with ``0`` where ``m == 0`` even when ``g`` is ``inf`` (an exact zero)."""
    with np.errstate(invalid="ignore", over="ignore"):
        return np.where(m > 0, g * m, 0.0)


def _product(spec: str, a: _ME, b: _ME, g: float) -> _ME:
    """``C = a (spec) b`` with ``gamma`` ``g`` for its own roundings: ``M_C = M_a M_b``,
    ``E_C = E_a M_b + M_a E_b + g M_C``."""
    m = _ein(spec, a.m, b.m)
    return _ME(m, _ein(spec, a.e, b.m) + _ein(spec, a.m, b.e) + _times(g, m))


def _exact(m: np.ndarray) -> _ME:
    return _ME(m, np.zeros_like(m))


class _Rope(NamedTuple):
    """RoPE of the bound: positions broadcast to ``[..., T_q]``, ``[..., T_k]``."""

    pos_q: np.ndarray
    pos_k: np.ndarray
    base: float
    convention: str


def _rope_error(pos: np.ndarray, d: int, r: _Rope, u: float) -> np.ndarray:
    """``e_p(m) + gamma_2`` for every component ``[..., 1, T, d]`` (stage 1)."""
    m_theta = np.abs(pos.astype(np.float64))[..., None] * rope_theta(d, r.base)
    e = rope_angle_error(m_theta, u, r.base) + gamma(2, u)
    return rope_spread(e, r.convention)[..., None, :, :]


def _turn(a: _ME, err: np.ndarray | None, convention: str) -> _ME:
    """A rotation (or its transpose) of a quantity: ``M' = J M``, ``E' = J E + err M'``."""
    if err is None:
        return a
    m = pair_sum(a.m, convention)
    return _ME(m, pair_sum(a.e, convention) + err * m)


def _bound(call: dict[str, Any], d_y: Any, rope: _Rope | None) -> AttentionGrads:
    """Stages 1 to 11 of the module docstring (``call``: the weight-level arguments)."""
    params, x_q, x_kv, mask, bias, scale, residual, dtype = (
        call[n] for n in ("params", "x_q", "x_kv", "mask", "bias", "scale", "residual", "dtype")
    )
    u = unit_roundoff(dtype)
    w, d_k = read_weights(params)  # key/value heads repeated to one per query head
    n_kv = head_weights(unpack(params))[1].shape[0]  # key/value heads as given
    p = read_problem(w, x_q, x_kv, mask=mask, bias=bias, scale=scale)
    w_q, w_k, w_v, w_o = head_weights(w)
    n_heads, d_model, _, d_v, t_k = p.dims
    t_q = p.xq.shape[-2]
    batch = p.xq.shape[:-2]
    n_b, group, s = math.prod(batch), n_heads // n_kv, abs(p.scale)
    dy = np.asarray(d_y, dtype=np.float64)
    if dy.shape != (*batch, t_q, d_model):
        raise ValueError(f"d_y has shape {dy.shape}; expected {(*batch, t_q, d_model)}")
    a_dy = np.abs(dy)

    # 1. projections (and RoPE)
    g_proj = gamma(d_model + 1, u)

    def projected(x: np.ndarray, name: str) -> _ME:
        wt = w["w_" + name]
        assert wt is not None
        m = abs_heads(x, wt, w["b_" + name])
        return _ME(m, _times(g_proj, m))

    err_q = None if rope is None else _rope_error(rope.pos_q, d_k, rope, u)
    err_k = None if rope is None else _rope_error(rope.pos_k, d_k, rope, u)
    conv = "rotate_half" if rope is None else rope.convention
    q = _turn(projected(p.xq, "q"), err_q, conv)
    k = _turn(projected(p.xkv, "k"), err_k, conv)
    v = projected(p.xkv, "v")

    # 2.-3. logits and weights
    pos_q, pos_k, base = (None, None, 0.0) if rope is None else rope[:3]
    allowed, sm = problem_softmax(
        p,
        rotated_heads(p.xq, w, "q", pos_q, base, conv),
        rotated_heads(p.xkv, w, "k", pos_k, base, conv),
    )
    pr = sm.weights
    ls = s * _ein("...hqd,...hkd->...hqk", q.m, k.m) + np.abs(p.bias)
    e_s = s * (_ein("...hqd,...hkd->...hqk", q.e, k.m) + _ein("...hqd,...hkd->...hqk", q.m, k.e))
    e_s = np.where(allowed, e_s + _times(gamma(d_k + 2, u), ls) + u * sm.spread, 0.0)
    e_row = np.max(e_s, axis=-1, keepdims=True, initial=0.0)
    with np.errstate(over="ignore"):
        rho = np.expm1(2.0 * e_row) + gamma(t_k + 2 + 2 * C_EXP, u)
    with np.errstate(invalid="ignore"):
        weights = _ME(pr, np.where(pr > 0, rho * pr, 0.0))

    # 4.-7. Z, dZ, dP, dS
    z = _product("...hqk,...hkv->...hqv", weights, v, gamma(t_k, u))
    dz_m = _ein("...qd,hvd->...hqv", a_dy, np.abs(w_o))
    dz = _ME(dz_m, _times(gamma(d_model, u), dz_m))
    dp = _product("...hqv,...hkv->...hqk", dz, v, gamma(d_v, u))
    c_m = np.sum(pr * dp.m, axis=-1, keepdims=True)
    c_e = np.sum(weights.e * dp.m + pr * dp.e, axis=-1, keepdims=True)
    ds_m = pr * (dp.m + c_m)
    ds_e = weights.e * (dp.m + c_m) + pr * (dp.e + c_e)
    ds = _ME(ds_m, ds_e + _times(gamma(t_k + C_SOFTMAX_VJP, u), ds_m))

    # 8. bias
    d_bias = None
    if bias is not None:
        shape = tuple(np.shape(bias))
        full = ds.m.sum(axis=-3)
        copies = n_heads * full.size // max(math.prod(shape), 1)
        b_m = sum_to_shape(full, shape)
        b_e = sum_to_shape(ds.e.sum(axis=-3), shape)
        d_bias = b_e + _times(gamma(copies, u), b_m)

    # 9.-10. dQ, dK, dV per query head
    dq = _product("...hqk,...hkd->...hqd", ds, k, gamma(t_k + 1, u))
    dq = _turn(_ME(s * dq.m, s * dq.e), err_q, conv)
    dk = _product("...hqk,...hqd->...hkd", ds, q, gamma(group * t_q + 1, u))
    dk = _turn(_ME(s * dk.m, s * dk.e), err_k, conv)
    dv = _product("...hqk,...hqv->...hkv", weights, dz, gamma(group * t_q, u))

    # 11. outputs
    xq_t, xkv_t = _exact(np.abs(hom(p.xq))), _exact(np.abs(hom(p.xkv)))
    g_q = _product("...qa,...hqe->hae", xq_t, dq, gamma(n_b * t_q, u))

    def kv_grad(d: _ME) -> np.ndarray:  # summed over each K/V head's G query heads: n = B G T_k
        m, e = _product("...ka,...hke->hae", xkv_t, d, 0.0)
        m, e = (a.reshape(n_kv, group, *a.shape[1:]).sum(axis=1) for a in (m, e))
        return e + _times(gamma(n_b * group * t_k, u), m)

    g_o = _product("...hqv,...qd->hvd", z, _exact(a_dy), gamma(n_b * t_q, u))
    grads = {
        "w_o": g_o.e,
        "b_o": _times(gamma(n_b * t_q, u), a_dy.sum(axis=tuple(range(a_dy.ndim - 1)))),
    }
    for name, e in (("q", g_q.e), ("k", kv_grad(dk)), ("v", kv_grad(dv))):
        grads["w_" + name], grads["b_" + name] = e[:, :d_model], e[:, d_model]
    x_from_q = _product("...hqe,hae->...qa", dq, _exact(np.abs(w_q)), 0.0)
    x_from_k = _product("...hke,hae->...ka", dk, _exact(np.abs(w_k)), 0.0)
    x_from_v = _product("...hkv,hav->...ka", dv, _exact(np.abs(w_v)), 0.0)
    kv_m, kv_e = x_from_k.m + x_from_v.m, x_from_k.e + x_from_v.e
    n_x, xq_m, xq_e = n_heads * d_k, x_from_q.m, x_from_q.e
    if residual:
        n_x, xq_m = n_x + 1, xq_m + a_dy
    shared = x_kv is None
    if shared:
        n_x, xq_m, xq_e = n_x + n_heads * (d_k + d_v), xq_m + kv_m, xq_e + kv_e
    bound_xq = xq_e + _times(gamma(n_x, u), xq_m)
    bound_xkv = None if shared else kv_e + _times(gamma(n_heads * (d_k + d_v), u), kv_m)
    params_out = {
        name: (grads[name] if get_param(params, name) is not None else None) for name in FIELDS
    }
    return AttentionGrads(params_out, bound_xq, bound_xkv, d_bias)


@doc(WEIGHT, BOUND_RAISES)
@signed(weight_call, grad_bound_options, front=("d_y",))
def attention_vjp_error_bound(call: dict[str, Any], *, d_y: Any) -> AttentionGrads:
    """Componentwise bound on the rounding error of one computation of
    :func:`attnref.oracle.attention_vjp` in ``dtype`` from exact inputs (module docstring).

    Returns:
        An :class:`attnref.oracle.AttentionGrads` of non-negative float64 bounds, each the shape
        of the gradient it bounds (``None`` where the gradient is ``None``).
    """
    return _bound(call, d_y, None)


@doc(WEIGHT, BOUND_RAISES)
@signed(rope_call, grad_bound_options, front=("d_y",))
def rope_attention_vjp_error_bound(call: dict[str, Any], *, d_y: Any) -> AttentionGrads:
    """Componentwise bound on the rounding error of one computation of
    :func:`attnref.oracle.rope_attention_vjp` in ``dtype`` (module docstring; the rotations add
    their ``cos``/``sin`` error ``e_p(m)`` and ``gamma_2`` in stages 1, 9 and 10).

    Returns:
        An :class:`attnref.oracle.AttentionGrads` of non-negative float64 bounds.
    """
    pos_q, pos_k = call.pop("positions_q"), call.pop("positions_kv")
    base, convention = call.pop("base"), call.pop("convention")
    _, d_k = read_weights(call["params"])
    check_rope(convention, d_k)
    xq, xkv = tokens(call["x_q"], call["x_kv"])
    batch, t_q, t_k = xq.shape[:-2], xq.shape[-2], xkv.shape[-2]
    pq = np.arange(t_q) if pos_q is None else np.asarray(pos_q)
    pk = np.arange(t_k) if pos_k is None else np.asarray(pos_k)
    pq, pk = np.broadcast_to(pq, (*batch, t_q)), np.broadcast_to(pk, (*batch, t_k))
    return _bound(call, d_y, _Rope(pq, pk, float(base), convention))
