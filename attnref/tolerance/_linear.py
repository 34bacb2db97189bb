"""Linear-attention bounds: :func:`linear_error_bound` at the ``(q, k, v)`` level and
:func:`linear_multihead_error_bound` from ``params``, for every feature map and every form
(quadratic, associative, prefix sums, recurrence, chunks). NumPy only, float64.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from attnref.oracle._core import Params, head_weights, tokens
from attnref.oracle._doc import LINEAR, doc, linear_options, linear_qkv, signed, weight_tokens
from attnref.oracle._linear import features, linear_attention, query_log_scale

from ._core import abs_heads, bound_options, project_heads, read_params, value_magnitude
from ._rounding import C_EXP, gamma, max_float, unit_roundoff


def _abs_feature_error(
    fm: Any, x: np.ndarray, dx: np.ndarray, phi: np.ndarray, u: float
) -> np.ndarray:
    """Bound on ``|fl(phi(x + dx)) - phi(x)|`` per feature: evaluation rounding plus the input
    perturbation ``dx`` (absolute, per component) propagated through the map's derivative."""
    name, d = fm.name, x.shape[-1]
    if name == "elu_plus_one":  # elu via expm1 (C_EXP ulps) then +1 (one rounding); |phi'| <= 1
        return (C_EXP + 1) * u * np.maximum(np.abs(phi), np.abs(phi - 1.0)) + dx
    if name in ("relu", "identity"):  # exact evaluation, Lipschitz constant 1
        return dx.copy()
    xs = np.abs(x) / d**0.25
    dxs = 2 * u * xs + dx / d**0.25  # scaling by a rounded constant, then the input error
    if name == "taylor2":
        return taylor2_error(xs, dxs, u)
    de = _favor_exponent_error(fm, xs, dxs, u, 2.0)
    rho = np.expm1(2 * de) + (C_EXP + 2) * u  # x2: a query's max carries the same error
    return rho * np.abs(phi)


def taylor2_error(x: np.ndarray, ex: np.ndarray, u: float) -> np.ndarray:
    """taylor2's feature error ``[0, E_a, (E_a |x~_b| + |x~_a| E_b + 3 u |x~_a||x~_b|) / sqrt 2]``
    from ``x = |x~|`` known to ``ex`` (``3 u`` more per product)."""
    xa, xb, ea, eb = x[..., :, None], x[..., None, :], ex[..., :, None], ex[..., None, :]
    outer = (ea * xb + xa * eb + 3 * u * xa * xb) / math.sqrt(2.0)
    return np.concatenate([np.zeros((*x.shape[:-1], 1)), ex, outer.reshape(*x.shape[:-1], -1)], -1)


def _favor_exponent_error(
    fm: Any, xs: np.ndarray, dxs: np.ndarray, u: float, factor: float
) -> np.ndarray:
    """``factor gamma_{d+6} mag + |dx~|.|w_i| + |x~|.|dx~|`` per feature: the error of the FAVOR+
    exponent ``w_i.x~ -/+ |x~|^2/2 -/+ |w_i|^2/2`` (``mag``: its parts' magnitudes)."""
    w = np.abs(np.asarray(fm.omega, dtype=np.float64))
    mag = xs @ w.T + 0.5 * np.sum(xs * xs, -1, keepdims=True) + 0.5 * np.sum(w * w, -1)
    return (
        factor * gamma(xs.shape[-1] + 6, u) * mag + dxs @ w.T + np.sum(xs * dxs, -1, keepdims=True)
    )


def _scaled_eps(
    fm: Any, q: np.ndarray, dq: np.ndarray, eps: float, dtype: Any
) -> tuple[np.ndarray, np.ndarray]:
    """``eps exp(-c_q)`` (``eps`` in the stabilised features' units, ``oracle.query_log_scale``)
    and its relative error: ``c`` off by ``dc = max_i(gamma_{d+6} mag_i + |dq~|.|w_i|) +
    |q~|.|dq~|`` gives ``expm1(dc) + (C_EXP + 2) u``; where ``c < -L`` (``L = log(max float) /
    2``) the forms rescale by ``exp(c + L)``, adding ``expm1(dc + u (|c| + L)) + (C_EXP + 1) u``."""
    c = query_log_scale(fm, q)
    eps_s = eps * np.exp(np.minimum(-c, 700.0))  # float64: exact unless |q~|^2 > ~1400
    if eps == 0 or fm.name != "favor_plus":
        return eps_s, np.zeros_like(c)
    u, d = unit_roundoff(dtype), q.shape[-1]
    xs = np.abs(q) / d**0.25
    dxs = 2 * u * xs + dq / d**0.25
    dc = np.max(_favor_exponent_error(fm, xs, dxs, u, 1.0), axis=-1)
    big = 0.5 * math.log(max_float(dtype))
    # u |log eps|: the float64 oracle forms exp(log eps - s) (its share, with dtype float64)
    rel = np.expm1(dc + u * abs(math.log(eps))) + (C_EXP + 2) * u
    rescaled = c - dc < -big
    rel = rel + np.where(rescaled, np.expm1(dc + u * (np.abs(c) + big)) + (C_EXP + 1) * u, 0.0)
    return eps_s, rel


def projected_heads(x: np.ndarray, w: Params, name: str, g: float) -> tuple[np.ndarray, np.ndarray]:
    """Token-major heads ``x W[h] + b[h]`` and their projection error ``g |x~||W~[h]|``."""
    wt, b = w["w_" + name], w["b_" + name]
    assert wt is not None
    return project_heads(x, wt, b, "the"), g * abs_heads(x, wt, b, "the")


def _kernel_matrix(
    fm: Any, q: np.ndarray, k: np.ndarray, allowed: np.ndarray
) -> tuple[np.ndarray, ...]:
    """``(phi(q), phi(k), A, Abar)``, ``Abar_ij = |phi(q_i)|.|phi(k_j)|`` (head-major)."""
    fq, fk = features(fm, q, "query"), features(fm, k, "key")
    a = np.where(allowed, np.einsum("...qhm,...khm->...hqk", fq, fk), 0.0)
    abar = np.where(allowed, np.einsum("...qhm,...khm->...hqk", np.abs(fq), np.abs(fk)), 0.0)
    return fq, fk, a, abar


def allowed_keys(q_shape: tuple[int, ...], t_k: int, key_mask: Any, causal: bool) -> np.ndarray:
    """``[..., H, T_q, T_k]``: key padding and, if causal, ``j <= i``."""
    *batch, t_q, heads, _ = q_shape
    km = np.ones((*batch, t_k), bool) if key_mask is None else np.asarray(key_mask, bool)
    allowed = np.broadcast_to(km[..., None, None, :], (*batch, heads, t_q, t_k))
    return allowed & np.tril(np.ones((t_q, t_k), bool)) if causal else allowed


@doc(LINEAR, q="Queries ``[..., T_q, H, d]``, exactly as the formulation received them.")
@signed(linear_qkv, linear_options)
def linear_error_bound(
    call: dict[str, Any], *, dtype: Any = np.float32, dq: Any = 0.0, dk: Any = 0.0, dv: Any = 0.0
) -> np.ndarray:
    """Componentwise bound on ``|linear attention in dtype - oracle|``, ``[..., T_q, H, d_v]``.

    With ``A_ij = phi(q_i).phi(k_j)``, ``Abar_ij = |phi(q_i)|.|phi(k_j)|`` and ``E_ij`` the error
    of ``A_ij`` from the features (evaluation rounding and input errors ``dq, dk``)::

        |d num_i| <= sum_j (E_ij + g Abar_ij) |v_j| + Abar_ij dv_j,  g = gamma_{m + T_k + 2}
        |d D_i|   <= sum_j (E_ij + g Abar_ij) + u |D_i| + eps_i rho_i
        |d y_i|   <= (|d num_i| + |y_i| |d D_i|) / (|D_i| - |d D_i|) + u |y_i|

    ``eps_i = eps exp(-c_i)`` (FAVOR+'s per-query feature scale) with relative error ``rho_i``
    (:func:`_scaled_eps`; ``g`` counts its rescaling). Every form sums the same products
    ``phi(q_i)_f phi(k_j)_f v_j`` in some order, so one bound covers them all; ``inf`` where the
    denominator's error can reach its size; exact zero denominators give a zero bound. Includes
    the float64 oracle's error.

    Returns:
        The bound, float64 ``[..., T_q, H, d_v]``, non-negative (``inf`` where undetermined).

    Raises:
        TypeError: ``feature_map`` is not a feature map (the oracle's check).
    """
    q, k, v, feature_map, causal, key_mask, eps, eps_policy = call.values()
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    dq, dk, dv = (
        np.broadcast_to(np.asarray(a, np.float64), b.shape) for a, b in ((dq, q), (dk, k), (dv, v))
    )
    t_q, t_k = q.shape[-3], k.shape[-3]
    allowed = allowed_keys(q.shape, t_k, key_mask, causal)

    total = np.zeros((*v.shape[:-3], t_q, *v.shape[-2:]))
    fq, fk, a, abar = _kernel_matrix(feature_map, q, k, allowed)
    num = np.einsum("...hqk,...khv->...qhv", a, v)
    den = np.swapaxes(a.sum(-1), -1, -2)  # [..., T_q, H]
    favor_eps = feature_map.name == "favor_plus" and eps > 0
    for dt in (dtype, np.float64):
        u = unit_roundoff(dt)
        dq_, dk_, dv_ = (dq, dk, dv) if dt is dtype else (0 * dq, 0 * dk, 0 * dv)  # inputs: once
        eq = _abs_feature_error(feature_map, q, dq_, fq, u)
        ek = _abs_feature_error(feature_map, k, dk_, fk, u)
        err_a = np.where(
            allowed,
            np.einsum("...qhm,...khm->...hqk", eq, np.abs(fk))
            + np.einsum("...qhm,...khm->...hqk", np.abs(fq), ek),
            0.0,
        )
        eps_s, rho_eps = _scaled_eps(feature_map, q, dq_, eps, dt)
        e_tot = err_a + gamma(fq.shape[-1] + t_k + (3 if favor_eps else 2), u) * abar
        d_num = np.einsum("...hqk,...khv->...qhv", e_tot, np.abs(v))
        d_num += np.einsum("...hqk,...khv->...qhv", abar, dv_)
        adj = den + eps_s if eps_policy == "add" else np.maximum(den, eps_s)
        d_den = np.swapaxes(e_tot.sum(-1), -1, -2) + u * np.abs(adj) + eps_s * rho_eps
        y = np.where((adj != 0)[..., None], num / np.where(adj == 0, 1.0, adj)[..., None], 0.0)
        room = np.abs(adj) - d_den
        with np.errstate(divide="ignore", invalid="ignore"):
            b = (d_num + np.abs(y) * d_den[..., None]) / room[..., None] + u * np.abs(y)
        exact_zero = (adj == 0) & (d_den == 0)
        b = np.where(exact_zero[..., None], 0.0, np.where((room > 0)[..., None], b, np.inf))
        total = total + b
    return total


@doc(LINEAR)
@signed(weight_tokens, linear_options, bound_options)
def linear_multihead_error_bound(call: dict[str, Any]) -> np.ndarray:
    """Componentwise bound for multi-head linear attention, ``[..., T_q, d_model]``.

    ``|dy| <= sum_h dz_h |W_O[h]| + gamma_{n_y} (sum_h sum_j Abar_ij / |D_i| G_hj + |b_O|)``:
    projection errors ``gamma_{d_model+1} |x~||W~|`` feed :func:`linear_error_bound` (giving
    ``dz``); the output projection adds the rest, with ``G = |x~||W~_V||W_O|`` (covering the
    messages order ``A (X W_M)`` too) and ``n_y = m + T_k + d_model + d_v + H + 4``;
    ``+ u |x + y|`` if ``residual``.

    Returns:
        The bound, float64 ``[..., T_q, d_model]``, non-negative (``inf`` where undetermined).

    Raises:
        ValueError: ``params`` lacks a weight or has inconsistent heads, or an option the oracle's
            ``linear_attention`` refuses (e.g. an unknown ``eps_policy``).
        TypeError: ``feature_map`` is not a feature map.
    """
    residual, dtype = call.pop("residual"), call.pop("dtype")
    params, x_q, x_kv, feature_map, causal, key_mask, eps, eps_policy = call.values()
    w = read_params(params)
    xq, xkv = tokens(x_q, x_kv)
    u = unit_roundoff(dtype)
    d_model = xq.shape[-1]
    g_p = gamma(d_model + 1, u)
    q, dq = projected_heads(xq, w, "q", g_p)
    k, dk = projected_heads(xkv, w, "k", g_p)
    v, dv = projected_heads(xkv, w, "v", g_p)
    kw = dict(
        feature_map=feature_map, causal=causal, key_mask=key_mask, eps=eps, eps_policy=eps_policy
    )
    dz = linear_error_bound(q, k, v, dtype=dtype, dq=dq, dk=dk, dv=dv, **kw)  # type: ignore[arg-type]
    w_o = head_weights(w)[3]
    z = linear_attention(q, k, v, **kw)  # type: ignore[arg-type]
    t_k = k.shape[-3]
    fq, _, a, abar = _kernel_matrix(feature_map, q, k, allowed_keys(q.shape, t_k, key_mask, causal))
    den = a.sum(-1)
    eps_s = np.swapaxes(_scaled_eps(feature_map, q, 0 * q, eps, dtype)[0], -1, -2)  # [..., H, T_q]
    adj = np.abs(den + eps_s if eps_policy == "add" else np.maximum(den, eps_s))
    with np.errstate(divide="ignore", invalid="ignore"):
        pbar = np.where(adj[..., None] > 0, abar / adj[..., None], 0.0)
    g_mag = value_magnitude(xkv, w)
    n_y = fq.shape[-1] + t_k + d_model + v.shape[-1] + q.shape[-2] + 4
    bound = np.einsum("...qhv,hvd->...qd", dz, np.abs(w_o))
    bound = bound + gamma(n_y, u) * np.einsum("...hqk,...hkd->...qd", pbar, g_mag)
    if w["b_o"] is not None:
        bound = bound + gamma(n_y, u) * np.abs(w["b_o"])
    if residual:
        y = np.einsum("...qhv,hvd->...qd", z, w_o) + (0.0 if w["b_o"] is None else w["b_o"])
        bound = bound + u * np.abs(xq + y)
    return bound
