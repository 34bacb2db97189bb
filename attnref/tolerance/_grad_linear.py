"""A derived float64 error bound for the linear-attention gradient oracle
(:func:`attnref.oracle.linear_attention_vjp`, :func:`attnref.oracle.linear_multihead_vjp`).

NumPy only. Componentwise, first order in ``u = 2^-53`` (``gamma_n = n u / (1 - n u)``, Higham
2002, Lemma 3.1 and eq. 3.13), for either method of the oracle (spare roundings cover both
orders).

**Rule.** Every quantity ``x`` of the backward (module docstring of
``attnref.oracle._linear_grad``) carries ``E_x >= |fl(x) - x|``: a sum of ``n`` terms adds
``sum_k E_t_k + gamma_n sum_k |t_k|``; a product ``E_a |b| + |a| E_b``; a division by ``D``
(``E_D < |D|``) the relative ``r = E_D / (|D| - E_D) + u``; ``exp`` the relative ``expm1(E) +
C_EXP u``. Input errors (``dq, dk, dv, d_dy``; the projections' for multi-head) enter through the
maps' first *and second* derivatives (the Hessian term). Per (batch, head), ``Abar_ij =
|phi(q_i)|.|phi(k_j)|``, ``m`` features, every map but FAVOR+::

    E_A    = E_phi(q).|phi(k)| + |phi(q)|.E_phi(k) + gamma_m Abar
    E_S    = sum_j E_A + gamma_{T_k+2} sum_j |A|,      E_D = E_S + u |D|  (clamp: E_S or 0)
    E_y    = (sum_j E_A |v| + |A| E_v + gamma_{T_k+2} |A||v|) / |D| + |y| r
    E_g    = E_{dy.v} + c E_{dy.y} + u (|dy.v| + c |dy.y|),   E_{a.b} = E_a.|b| + |a|.E_b
             + gamma_{d_v} |a|.|b|
    E_dA   = (E_g + |g| r) / |D|
    E_dv   = sum_i (E_A |dy| + |A| E_dy + (r + gamma_{T_q+2}) |A||dy|) / |D|
    E_dphi(q_i) = sum_j E_dA |phi(k)| + |dA| E_phi(k) + gamma_{T_k+2} |dA||phi(k)|  (k: T_q)
    E_dq   = |J| E_dphi + E_J |dphi| + u |J||dphi|           (taylor2: its VJP, gamma_{2d+4})

with ``E_phi``, ``E_J`` each map's evaluation error (elu: ``C_EXP + 1`` units; taylor2: ``3 u``
for ``x~`` and each product) plus the input error times the largest slope nearby (elu:
``exp(min(x + dx, 0))`` bounds ``phi'`` and ``phi''``; relu is 0 below ``-dx`` and its step may
flip within ``|x| <= dx``). FAVOR+ (log space, ``z_ijf = w_f.(q~_i + k~_j)``)::

    E_z    = |w_f|.(E_q~ + E_k~) + gamma_{d+2} (|w_f|.|q~| + |w_f|.|k~| + |w_f|^2/2)
    E_ell  = max_f E_z + u (max_f |z - max z| + |lse| + log m) + C_EXP u + gamma_m
             + E_{|q~|^2/2} + E_{|k~|^2/2} + u log m + gamma_3 (|lse| + log m + |q~|^2/2 + |k~|^2/2)
    weights exp(ell - s): relative rho = expm1(E_ell + u |ell - s|) + C_EXP u (the common shift's
    error cancels in the ratio); eps's weight: expm1(u |log eps| + u |log eps - s|) + C_EXP u
    D: relative delta = max(max_j rho + gamma_{T_k+1}, rho_eps) (+ u for "add")
    W = A / D: relative omega = rho + delta / (1 - delta) + u
    R = softmax_f z: relative 2 (expm1(2 max_f E_z + u max_f |z - max z|) + C_EXP u) + gamma_{m+1}
    E_dq~_i = sum_j E_G (|R||w| + |q~_i|) + |G| (rho_R |R||w| + E_q~_i)
              + gamma_{T_k+m+3} sum_j |G| (|R||w| + |q~_i|)

(``|w_f|^2/2`` covers the stabilised features' exponents, as in
:func:`attnref.tolerance.linear_error_bound`).

**Undetermined rows.** Where ``|D_i| <= E_D`` or, for "clamp", ``|S_i - eps| <= E_S`` (where the
gradient jumps) the bound is ``inf`` for ``dq_i`` and every ``dk_j``, ``dv_j`` the row reads; rows
with ``D_i = 0`` and ``E_D = 0`` exactly have zero gradient and bound.

**Multi-head.** Projections carry ``gamma_{d_model+1} |x~||W~|``, ``dz = dy W_O^T`` carries
``gamma_{d_model} |dy||W_O|``; parameter gradients sum ``prod(batch) T`` positions
(``gamma_{prod(batch) T + 2}``), input gradients ``H d_k`` (``K (d_k + d_v)`` for ``x_kv``) terms
plus the residual and self-attention additions.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from attnref.oracle._core import get_param, head_weights, tokens, unpack
from attnref.oracle._doc import LINEAR, doc, linear_options, linear_qkv, signed, weight_tokens
from attnref.oracle._linear import check_options
from attnref.oracle._linear_grad import LinearGrads, LinearMultiheadGrads

from ._core import read_params
from ._linear import allowed_keys, projected_heads, taylor2_error
from ._rounding import C_EXP, gamma, unit_roundoff

U = unit_roundoff(np.float64)


def _g(n: int) -> float:
    """``gamma_n`` in float64."""
    return gamma(n, U)


def _bt(a: np.ndarray) -> np.ndarray:
    """Token-major ``[..., T, H, d]`` to head-major ``[..., H, T, d]`` and back."""
    return np.swapaxes(a, -3, -2)


# ----------------------------------------------------------------------------- feature maps


def _elementwise_leaves(name: str, x: np.ndarray, ex: np.ndarray) -> tuple[np.ndarray, ...]:
    """``(phi, E_phi, J, E_J)`` of an elementwise map at ``x`` known to ``ex``."""
    if name == "elu_plus_one":
        e = np.exp(np.minimum(x, 0.0))
        phi, jac = np.where(x > 0, x + 1.0, e), np.where(x > 0, 1.0, e)
        slope = np.exp(np.minimum(x + ex, 0.0))  # sup of |phi'| and |phi''| on [x - ex, x + ex]
        return phi, slope * ex + (C_EXP + 1) * U * phi, jac, slope * ex + C_EXP * U * jac
    if name == "relu":
        flips = (ex > 0) & (np.abs(x) <= ex)  # the step may change by 1 there
        e_phi = np.where(x + ex > 0, ex, 0.0)  # relu stays exactly 0 below -ex
        return np.maximum(x, 0.0), e_phi, (x > 0).astype(float), flips.astype(float)
    if name == "identity":
        return x, ex, np.ones(x.shape), np.zeros(x.shape)
    raise ValueError(f"unknown feature map {name!r}")


def _taylor2_leaves(x: np.ndarray, ex: np.ndarray) -> tuple[np.ndarray, ...]:
    """``(phi, E_phi, x~, E_x~)`` of taylor2 (``3 u`` for ``x~``, ``3 u`` more per product)."""
    d = x.shape[-1]
    xs = x / d**0.25
    exs = ex / d**0.25 + 3 * U * np.abs(xs)
    outer = xs[..., :, None] * xs[..., None, :] / math.sqrt(2.0)
    lead = x.shape[:-1]
    phi = np.concatenate([np.ones((*lead, 1)), xs, outer.reshape(*lead, d * d)], -1)
    e_phi = taylor2_error(np.abs(xs), exs, U)
    return phi, e_phi, xs, exs


def _taylor2_vjp(
    xs: np.ndarray, exs: np.ndarray, g: np.ndarray, eg: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """``(dx, E_dx)`` of ``dx = (g_1 + (G_2 + G_2^T) x~ / sqrt 2) / d^(1/4)``."""
    d = xs.shape[-1]
    g2 = g[..., 1 + d :].reshape(*g.shape[:-1], d, d)
    e2 = eg[..., 1 + d :].reshape(g2.shape)
    sym, a_sym = g2 + np.swapaxes(g2, -1, -2), np.abs(g2) + np.abs(np.swapaxes(g2, -1, -2))
    e_sym = e2 + np.swapaxes(e2, -1, -2)

    def mv(m: np.ndarray, x: np.ndarray) -> np.ndarray:
        return np.einsum("...ab,...b->...a", m, x)

    r2 = math.sqrt(2.0)
    dxs = g[..., 1 : 1 + d] + mv(sym, xs) / r2
    mag = np.abs(g[..., 1 : 1 + d]) + mv(a_sym, np.abs(xs)) / r2
    err = eg[..., 1 : 1 + d] + (mv(e_sym, np.abs(xs)) + mv(a_sym, exs)) / r2 + _g(2 * d + 4) * mag
    dx = dxs / d**0.25
    return dx, err / d**0.25 + 3 * U * np.abs(dx)


# ----------------------------------------------------------------------------- shared steps


def _dot_err(a: np.ndarray, ea: np.ndarray, b: np.ndarray, eb: np.ndarray, spec: str) -> Any:
    """``(a.b, E_a.|b| + |a|.E_b + gamma_{n+2} |a|.|b|)``, ``n`` the number of terms the einsum
    ``spec`` sums per output entry."""
    ins, out = spec.replace("...", "").split("->")
    size: dict[str, int] = {}
    for sub, x in zip(ins.split(","), (a, b), strict=True):
        size.update(zip(sub, x.shape[x.ndim - len(sub) :], strict=True))
    n = math.prod(k for c, k in size.items() if c not in out)
    ein = functools.partial(np.einsum, spec, optimize=True)
    err = ein(ea, np.abs(b)) + ein(np.abs(a), eb)
    return ein(a, b), err + _g(n + 2) * ein(np.abs(a), np.abs(b))


def _cotangent_terms(
    v: np.ndarray,
    ev: np.ndarray,
    dy: np.ndarray,
    edy: np.ndarray,
    y: np.ndarray,
    ey: np.ndarray,
    c: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """``g_ij = dy_i.v_j - c_i dy_i.y_i`` (``dA_ij D_i``) and its error, ``[..., T_q, T_k]``."""
    p, ep = _dot_err(dy, edy, v, ev, "...iv,...jv->...ij")
    qv, eqv = _dot_err(dy, edy, y, ey, "...iv,...iv->...i")
    g = p - (c * qv)[..., None]
    return g, ep + (c * eqv)[..., None] + U * (np.abs(p) + (c * np.abs(qv))[..., None])


def _denominator(
    s: np.ndarray, es: np.ndarray, eps: float, eps_policy: str, ulp: float
) -> tuple[np.ndarray, ...]:
    """``(D, E_D, c, live, bad)`` from ``S`` known to ``es`` (``bad``: undetermined rows; rows
    neither live nor bad have ``D = 0`` exactly)."""
    if eps_policy == "add":
        d = s + eps
        ed = es + ulp * np.abs(d)
        c = np.ones(s.shape)
        bad = np.zeros(s.shape, bool)
    else:
        d = np.maximum(s, eps)
        ed = np.where(s >= eps, es, 0.0)
        c = (s >= eps).astype(float)
        bad = (np.abs(s - eps) <= es) & (es > 0)
    zero = (d == 0) & (ed == 0)
    bad = bad | (~zero & (np.abs(d) <= ed))
    return d, ed, c, ~zero & ~bad, bad


# ----------------------------------------------------------------------------- kernel level


def _kernel_features(
    fm: Any, q: np.ndarray, eq: np.ndarray, k: np.ndarray, ek: np.ndarray, v: Any, opt: Any
) -> tuple[np.ndarray, ...]:
    """Head-major bound for every map but FAVOR+: ``(E_dq, E_dk, E_dv, y, E_y, dq, dk, dv, bad)``
    (``bad``: the undetermined rows)."""
    v, ev, dy, edy, allowed = v
    eps, eps_policy = opt
    taylor = fm.name == "taylor2"
    leaves = _taylor2_leaves if taylor else functools.partial(_elementwise_leaves, fm.name)
    (fq, efq, *lq), (fk, efk, *lk) = leaves(q, eq), leaves(k, ek)
    al = allowed.astype(float)
    t_k, m = k.shape[-2], fq.shape[-1]
    a = al * np.einsum("...im,...jm->...ij", fq, fk)
    abs_a = np.abs(a)
    e_a = al * (
        np.einsum("...im,...jm->...ij", efq, np.abs(fk))
        + np.einsum("...im,...jm->...ij", np.abs(fq), efk)
        + _g(m) * np.einsum("...im,...jm->...ij", np.abs(fq), np.abs(fk))
    )
    s = a.sum(-1)
    e_s = e_a.sum(-1) + _g(t_k + 2) * abs_a.sum(-1)
    d, ed, c, live, bad = _denominator(s, e_s, eps, eps_policy, U)
    d_abs = np.where(live, np.abs(d), 1.0)
    inv = np.where(live, 1.0 / d_abs, 0.0)
    r = np.where(live, ed / (d_abs - np.where(live, ed, 0.0)) + U, 0.0)
    signed_inv = np.where(live, 1.0 / np.where(live, d, 1.0), 0.0)
    num, e_n = _dot_err(a, e_a, v, ev, "...ij,...jv->...iv")
    y = num * signed_inv[..., None]
    e_y = e_n * inv[..., None] + np.abs(y) * r[..., None]
    g, e_g = _cotangent_terms(v, ev, dy, edy, y, e_y, c)
    da = al * g * signed_inv[..., None]
    e_da = al * (e_g + np.abs(g) * r[..., None]) * inv[..., None]
    e_w = (e_a + abs_a * r[..., None]) * inv[..., None]
    dv, e_dv = _dot_err(a * signed_inv[..., None], e_w, dy, edy, "...ij,...iv->...jv")
    dfq, e_dfq = _dot_err(da, e_da, fk, efk, "...ij,...jm->...im")
    dfk, e_dfk = _dot_err(da, e_da, fq, efq, "...ij,...im->...jm")

    def back(lx: list[np.ndarray], df: np.ndarray, e_df: np.ndarray) -> tuple[np.ndarray, ...]:
        lf, e_lf = lx  # taylor2: x~ and E_x~; else J and E_J
        if taylor:
            return _taylor2_vjp(lf, e_lf, df, e_df)
        dx = lf * df
        return dx, np.abs(lf) * e_df + e_lf * np.abs(df) + U * np.abs(dx)

    (dq, e_dq), (dk, e_dk) = back(lq, dfq, e_dfq), back(lk, dfk, e_dfk)
    return e_dq, e_dk, e_dv, y, e_y, dq, dk, dv, bad


def _favor_log_parts(
    w: np.ndarray, q: np.ndarray, eq: np.ndarray, k: np.ndarray, ek: np.ndarray
) -> tuple[np.ndarray, ...]:
    """``(ell, E_ell, R, rho_R, q~, E_q~, k~, E_k~)``: ``log A_ij`` and the feature softmax ``R``
    with their errors (module docstring)."""
    d, m = q.shape[-1], w.shape[0]
    aw = np.abs(w)
    qs, ks = q / d**0.25, k / d**0.25
    eqs, eks = eq / d**0.25 + 3 * U * np.abs(qs), ek / d**0.25 + 3 * U * np.abs(ks)
    z = (qs @ w.T)[..., :, None, :] + (ks @ w.T)[..., None, :, :]
    mag = (np.abs(qs) @ aw.T)[..., :, None, :] + (np.abs(ks) @ aw.T)[..., None, :, :]
    e_in = (eqs @ aw.T)[..., :, None, :] + (eks @ aw.T)[..., None, :, :]
    e_z = e_in + _g(d + 2) * (mag + 0.5 * np.sum(w * w, -1))
    top = z.max(-1)
    e = np.exp(z - top[..., None])
    total = e.sum(-1)
    lse = top + np.log(total)
    spread = np.max(top[..., None] - z, axis=-1)
    e_zmax = e_z.max(-1)
    log_m = math.log(m)
    e_lse = e_zmax + U * (spread + np.abs(lse) + log_m) + C_EXP * U + _g(m)
    nq, nk = 0.5 * np.sum(qs * qs, -1), 0.5 * np.sum(ks * ks, -1)
    e_nq = np.sum(np.abs(qs) * eqs, -1) + _g(d + 1) * nq
    e_nk = np.sum(np.abs(ks) * eks, -1) + _g(d + 1) * nk
    ell = lse - log_m - nq[..., :, None] - nk[..., None, :]
    e_ell = (
        e_lse
        + e_nq[..., :, None]
        + e_nk[..., None, :]
        + U * log_m
        + _g(3) * (np.abs(lse) + log_m + nq[..., :, None] + nk[..., None, :])
    )
    rho_r = 2 * (np.expm1(2 * e_zmax + U * spread) + C_EXP * U) + _g(m + 1)
    return ell, e_ell, e / total[..., None], rho_r, qs, eqs, ks, eks


def _kernel_favor(
    fm: Any, q: np.ndarray, eq: np.ndarray, k: np.ndarray, ek: np.ndarray, v: Any, opt: Any
) -> tuple[np.ndarray, ...]:
    """Head-major bound for FAVOR+ (log space), as :func:`_kernel_features`."""
    v, ev, dy, edy, allowed = v
    eps, eps_policy = opt
    w = np.asarray(fm.omega, dtype=np.float64)
    t_q, t_k, m = q.shape[-2], k.shape[-2], w.shape[0]
    ell, e_ell, r_soft, rho_r, qs, eqs, ks, eks = _favor_log_parts(w, q, eq, k, ek)
    live = allowed.any(-1)
    ell = np.where(allowed, ell, -np.inf)
    log_eps = math.log(eps) if eps > 0 else -math.inf
    s = np.where(live, np.maximum(ell.max(-1), log_eps), 0.0)
    gap = np.where(allowed, np.abs(ell - s[..., None]), 0.0)
    weights = np.where(allowed, np.exp(ell - s[..., None]), 0.0)
    rho = np.where(allowed, np.expm1(np.where(allowed, e_ell, 0.0) + U * gap) + C_EXP * U, 0.0)
    sink = np.exp(log_eps - s) if eps > 0 else np.zeros(s.shape)
    rho_s = np.expm1(U * abs(log_eps) + U * np.abs(log_eps - s)) + C_EXP * U if eps > 0 else 0.0
    total = weights.sum(-1)
    rho_tot = rho.max(-1, initial=0.0) + _g(t_k + 1)
    if eps_policy == "add":
        den, c = total + sink, np.ones(s.shape)
        delta = np.maximum(rho_tot, rho_s) + U
        bad = np.zeros(s.shape, bool)
    else:
        den, c = np.maximum(total, sink), (total >= sink).astype(float)
        delta = np.maximum(rho_tot, rho_s)
        bad = live & (np.abs(total - sink) <= rho_tot * total + rho_s * sink)
    ok = live & ~bad & (delta < 1)
    bad = bad | (live & ~ok)
    ratio = np.where(ok[..., None], weights / np.where(ok, den, 1.0)[..., None], 0.0)
    omega = rho + np.where(ok, delta / (1 - np.where(ok, delta, 0.0)), 0.0)[..., None] + U
    e_w = omega * ratio
    y, e_y = _dot_err(ratio, e_w, v, ev, "...ij,...jv->...iv")
    g, e_g = _cotangent_terms(v, ev, dy, edy, y, e_y, c)
    big_g = g * ratio
    e_big = e_g * ratio + np.abs(g) * (e_w + U * ratio)
    abs_g = np.abs(big_g)
    rw = r_soft @ w  # [..., T_q, T_k, d]
    rw_abs = r_soft @ np.abs(w)
    dqs = np.einsum("...ij,...ijd->...id", big_g, rw) - qs * big_g.sum(-1)[..., None]
    dks = np.einsum("...ij,...ijd->...jd", big_g, rw) - ks * big_g.sum(-2)[..., None]

    def err(axis: int, n: int, xs: np.ndarray, exs: np.ndarray) -> np.ndarray:
        spec = "...ij,...ijd->...id" if axis == -1 else "...ij,...ijd->...jd"
        weight = e_big + abs_g * (rho_r + _g(n + m + 3))
        return (
            np.einsum(spec, weight, rw_abs)
            + (e_big + _g(n + m + 3) * abs_g).sum(axis)[..., None] * np.abs(xs)
            + abs_g.sum(axis)[..., None] * exs
        )

    scale = q.shape[-1] ** 0.25
    dq, dk = dqs / scale, dks / scale
    e_dq = err(-1, t_k, qs, eqs) / scale + 3 * U * np.abs(dq)
    e_dk = err(-2, t_q, ks, eks) / scale + 3 * U * np.abs(dk)
    dv, e_dv = _dot_err(ratio, e_w, dy, edy, "...ij,...iv->...jv")
    return e_dq, e_dk, e_dv, y, e_y, dq, dk, dv, bad


def _kernel_bound(
    q: Any, k: Any, v: Any, d_y: Any, errors: tuple[Any, ...], options: tuple[Any, ...]
) -> tuple[np.ndarray, ...]:
    """Token-major ``(b_q, b_k, b_v, y, E_y, dq, dk, dv)`` for inputs known to ``errors``
    (``options``: the feature map, ``causal``, ``key_mask``, ``eps``, ``eps_policy``)."""
    fm, causal, key_mask, eps, eps_policy = options
    causal = check_options(fm, causal, eps_policy, "fast")
    q, k, v, dy = (np.asarray(a, dtype=np.float64) for a in (q, k, v, d_y))
    eq, ek, ev, edy = (
        np.broadcast_to(np.asarray(e, np.float64), a.shape)
        for e, a in zip(errors, (q, k, v, dy), strict=True)
    )
    allowed = allowed_keys(q.shape, k.shape[-3], key_mask, causal)
    rest = (_bt(v), _bt(ev), _bt(dy), _bt(edy), allowed)
    kernel = _kernel_favor if fm.name == "favor_plus" else _kernel_features
    e_dq, e_dk, e_dv, y, e_y, *grads, bad = kernel(
        fm, _bt(q), _bt(eq), _bt(k), _bt(ek), rest, (eps, eps_policy)
    )
    # inf for dq_i (and E_y_i) of an undetermined row and for the dk_j, dv_j it reads
    row, hit = bad[..., None], np.any(bad[..., :, None] & allowed, axis=-2)[..., None]
    bq, bk, bv = (np.where(m, np.inf, e) for m, e in ((row, e_dq), (hit, e_dk), (hit, e_dv)))
    return tuple(_bt(a) for a in (bq, bk, bv, y, np.where(row, np.inf, e_y), *grads))


@doc(LINEAR)
@signed(linear_qkv, linear_options, front=("d_y",))
def linear_attention_vjp_error_bound(
    call: dict[str, Any], d_y: Any, *, dq: Any = 0.0, dk: Any = 0.0, dv: Any = 0.0, d_dy: Any = 0.0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Componentwise bound on ``|linear_attention_vjp(...) - exact gradient|`` (module docstring).

    Returns:
        :class:`attnref.oracle.LinearGrads` ``(q, k, v)`` of float64 bounds shaped as the inputs,
        non-negative, ``inf`` where the gradient is not determined (near-cancelling
        denominators, the clamp's switch).

    Raises:
        TypeError: If ``feature_map`` is not a feature map, or ``causal`` is not a bool.
        ValueError: If ``eps_policy`` is unknown.
    """
    q, k, v, *options = call.values()
    return LinearGrads(*_kernel_bound(q, k, v, d_y, (dq, dk, dv, d_dy), tuple(options))[:3])


# ----------------------------------------------------------------------------- multi-head


def _fold(a: np.ndarray, n_kv: int) -> np.ndarray:
    """Sum token-major ``[..., T, H, d]`` over the ``G = H / K`` query heads of each K/V head."""
    return a.reshape(*a.shape[:-2], n_kv, a.shape[-2] // n_kv, a.shape[-1]).sum(-2)


def _param_bounds(
    x: np.ndarray, b: np.ndarray, g: np.ndarray, wt: np.ndarray, n_kv: int | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Bounds on ``(dW, db, dx)`` of ``h = x W + b`` with ``dh = g`` known to ``b``, and ``|dx|``'s
    magnitude; with ``n_kv``, ``g`` and ``b`` per query head are first summed over each K/V
    head's ``G`` (``gamma_{G+1}``) and ``W`` (repeated per query head) read once per K/V head."""
    if n_kv is not None:
        group = wt.shape[0] // n_kv
        b = _fold(b, n_kv) + _g(group + 1) * _fold(np.abs(g), n_kv)
        g, wt = _fold(g, n_kv), wt[::group]  # the first query head of each K/V group
    n_pos = math.prod(x.shape[:-1])
    ax = np.abs(x)
    dw = np.einsum("...td,...the->hde", ax, b, optimize=True) + _g(n_pos + 2) * np.einsum(
        "...td,...the->hde", ax, np.abs(g), optimize=True
    )
    axes = tuple(range(g.ndim - 2))
    db = b.sum(axis=axes) + _g(n_pos + 2) * np.abs(g).sum(axis=axes)
    n_dx = wt.shape[0] * wt.shape[2]
    mag = np.einsum("...the,hde->...td", np.abs(g), np.abs(wt))
    dx = np.einsum("...the,hde->...td", b, np.abs(wt)) + _g(n_dx + 2) * mag
    return dw, db, dx, mag


@doc(LINEAR)
@signed(weight_tokens, linear_options, front=("d_y",))
def linear_multihead_vjp_error_bound(
    call: dict[str, Any], *, d_y: Any, residual: bool = False
) -> Any:
    """Componentwise bound on ``|linear_multihead_vjp(...) - exact gradient|`` (module docstring,
    "Multi-head").

    Returns:
        :class:`attnref.oracle.LinearMultiheadGrads` of bounds: ``params`` a dict with one
        bound per field present, ``x_q``, and ``x_kv`` (``None`` when ``x_kv`` is ``None``).

    Raises:
        ValueError: If ``params`` lacks a weight or its heads do not group, or ``eps_policy`` is
            unknown.
        TypeError: If ``feature_map`` is not a feature map.
    """
    params, x_q, x_kv, *options = call.values()
    w = read_params(params)  # K/V heads repeated to one per query head
    w_q, w_k, w_v, w_o = head_weights(w)
    n_kv = head_weights(unpack(params))[1].shape[0]  # key/value heads as given
    xq, xkv = tokens(x_q, x_kv)
    dy = np.asarray(d_y, dtype=np.float64)
    d_model = xq.shape[-1]
    q, eq = projected_heads(xq, w, "q", _g(d_model + 1))
    k, ek = projected_heads(xkv, w, "k", _g(d_model + 1))
    v, ev = projected_heads(xkv, w, "v", _g(d_model + 1))
    dz = np.einsum("...qd,hvd->...qhv", dy, w_o)
    e_dz = _g(d_model + 2) * np.einsum("...qd,hvd->...qhv", np.abs(dy), np.abs(w_o))
    bq, bk, bv, z, e_z, gq, gk, gv = _kernel_bound(q, k, v, dz, (eq, ek, ev, e_dz), tuple(options))
    n_q = math.prod(xq.shape[:-1])
    out = {
        "w_o": np.einsum("...qhv,...qd->hvd", e_z, np.abs(dy), optimize=True)
        + _g(n_q + 2) * np.einsum("...qhv,...qd->hvd", np.abs(z), np.abs(dy), optimize=True),
        "b_o": _g(n_q + 2) * np.abs(dy).sum(axis=tuple(range(dy.ndim - 1))),
    }
    out["w_q"], out["b_q"], dxq, mag_q = _param_bounds(xq, bq, gq, w_q)
    out["w_k"], out["b_k"], dxk, mag_k = _param_bounds(xkv, bk, gk, w_k, n_kv)
    out["w_v"], out["b_v"], dxv, mag_v = _param_bounds(xkv, bv, gv, w_v, n_kv)
    grads = {n: _no_nan(b) for n, b in out.items() if get_param(params, n) is not None}
    dxkv = dxk + dxv + U * (mag_k + mag_v)
    if residual:
        dxq = dxq + U * (mag_q + np.abs(dy))
    if x_kv is None:
        bound_q = dxq + dxkv + U * (mag_q + np.abs(dy) + mag_k + mag_v)
        return LinearMultiheadGrads(grads, _no_nan(bound_q), None)
    return LinearMultiheadGrads(grads, _no_nan(dxq), _no_nan(dxkv))


def _no_nan(b: np.ndarray) -> np.ndarray:
    """``inf`` where an undetermined (``inf``) term met a zero magnitude (``0 * inf``)."""
    return np.where(np.isnan(b), np.inf, b)
