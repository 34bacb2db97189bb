"""Gradient oracle of linear (kernel) attention: the vector-Jacobian product, analytic, NumPy only.

For one batch element and head, ``A_ij = phi(q_i).phi(k_j)`` over the allowed keys (row
vectors)::

    S_i = sum_j A_ij,   N_i = sum_j A_ij v_j,   y_i = N_i / D_i
    D_i = S_i + eps ("add")   or   max(S_i, eps) ("clamp")

the gradient of ``L = sum_i dy_i . y_i``, with ``c_i = 1`` where ``D_i`` follows ``S_i`` ("add";
"clamp" where ``S_i >= eps``, on a tie as Python's ``max``), else 0::

    dv_j       = sum_i A_ij dy_i / D_i
    dA_ij      = (dy_i . v_j - c_i dy_i . y_i) / D_i                    (allowed (i, j) only)
    dphi(q_i)  = sum_j dA_ij phi(k_j),     dphi(k_j) = sum_i dA_ij phi(q_i)
    dq_i       = J_phi(q_i)^T dphi(q_i),   dk_j      = J_phi(k_j)^T dphi(k_j)

(a row with ``D_i == 0`` passes nothing). Jacobians: ``elu + 1``: ``1`` for ``x > 0``, else
``exp(x)``; ``relu``: ``1`` for ``x > 0``, else 0 (as ``jax.grad(jax.nn.relu)(0.0)``); identity:
1; ``taylor2`` (``phi = [1, x~, vec(x~ x~^T)/sqrt 2]``, ``x~ = x / d^(1/4)``, ``g = [g_0, g_1,
G_2]``): ``dx = (g_1 + (G_2 + G_2^T) x~ / sqrt 2) / d^(1/4)``.

FAVOR+ (``phi_f(x) = m^(-1/2) exp(w_f.x~ - |x~|^2/2)``) is differentiated in log space, like its
forward: with ``W_ij = A_ij / D_i``, ``R_ijf = softmax_f(z_ijf)``, ``z_ijf = w_f.(q~_i + k~_j)``,
``E_ij = sum_f R_ijf w_f`` (``dA_ij / dq~_i = A_ij (E_ij - q~_i)``)::

    G_ij = (dy_i . v_j - c_i dy_i . y_i) W_ij   (= dA_ij A_ij)
    dq~_i = sum_j G_ij (E_ij - q~_i),   dk~_j = sum_i G_ij (E_ij - k~_j),   dv_j = sum_i W_ij dy_i

``method="definition"``: scalar loops; ``"fast"``: per (batch, head) by query blocks, as the fast
forward. A key no query reads passes nothing (its non-finite entries read as zeros); other inputs
are assumed finite.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from ._checks import check_flag, shape_of
from ._core import FIELDS, head_weights
from ._doc import (
    LINEAR,
    LINEAR_RAISES,
    block_options,
    doc,
    linear_options,
    linear_qkv,
    method_option,
    signed,
    weight_tokens,
)
from ._linear import (
    adjusted,
    allowed,
    blocks,
    check_options,
    favor_log_block,
    favor_log_kernel,
    favor_omega,
    features,
    key_mask_array,
    masked_matmul,
    multihead_inputs,
    precompute,
    project,
    ratio_parts,
)


class LinearGrads(NamedTuple):
    """Gradients of :func:`attnref.oracle.linear_attention` with respect to its inputs."""

    q: np.ndarray  # [..., T_q, H, d_k]
    k: np.ndarray  # [..., T_k, H, d_k]
    v: np.ndarray  # [..., T_k, H, d_v]


class LinearMultiheadGrads(NamedTuple):
    """Gradients of :func:`attnref.oracle.linear_multihead` (``params``: the fields present;
    ``x_kv`` ``None`` when the call had none, ``x_q`` then carrying both paths)."""

    params: dict[str, np.ndarray]
    x_q: np.ndarray
    x_kv: np.ndarray | None


# ----------------------------------------------------------------------------- feature maps


def feature_vjp(fm: Any, x: np.ndarray, g: np.ndarray) -> np.ndarray:
    """``J_phi(x)^T g [..., d]`` through the feature map of the last axis (not FAVOR+)."""
    name, d = fm.name, x.shape[-1]
    if name == "elu_plus_one":
        return g * np.where(x > 0, 1.0, np.exp(np.minimum(x, 0.0)))
    if name == "relu":
        return g * (x > 0)  # step, 0 at x = 0 (jax.nn.relu's convention)
    if name == "identity":
        return g.copy()
    if name != "taylor2":
        raise ValueError(f"no feature Jacobian for {name!r} (FAVOR+ goes with its kernel)")
    xs = x / d**0.25
    g2 = g[..., 1 + d :].reshape(*g.shape[:-1], d, d)
    sym = np.einsum("...ab,...b->...a", g2 + np.swapaxes(g2, -1, -2), xs)
    return (g[..., 1 : 1 + d] + sym / math.sqrt(2.0)) / d**0.25


def _favor_softmax_mean(w: np.ndarray, qs: np.ndarray, ks: np.ndarray) -> np.ndarray:
    """``E = sum_f R_f w_f`` with ``R = softmax_f(w_f.(q~ + k~))``, for one pair (``[d]``)."""
    z = (qs + ks) @ w.T
    r = np.exp(z - z.max())
    return (r / r.sum()) @ w


# ----------------------------------------------------------------------------- definition


def _vjp_definition_head(
    fm: Any, q: np.ndarray, k: np.ndarray, v: np.ndarray, dy: np.ndarray, km: np.ndarray, opt: Any
) -> tuple[np.ndarray, ...]:
    """``(y, dq, dk, dv)`` of one (batch, head): ``q [T_q, d]``, ``k [T_k, d]``, ``v``, ``dy``,
    one query and one key at a time."""
    causal, eps, eps_policy = opt
    t_q, t_k, d = q.shape[0], k.shape[0], q.shape[-1]
    y, dq = np.zeros((t_q, v.shape[-1])), np.zeros(q.shape)
    dk, dv = np.zeros(k.shape), np.zeros(v.shape)
    favor = fm.name == "favor_plus"
    if favor:
        w = favor_omega(fm, d)
        qs, ks = q / d**0.25, k / d**0.25
        dks = np.zeros(k.shape)
        log_eps = math.log(eps) if eps > 0 else -math.inf
    else:
        fk = features(fm, k, "key")
        dphik = np.zeros(fk.shape)
    for i in range(t_q):
        keys = [j for j in range(t_k) if km[j] and not (causal and j > i)]
        if favor:
            if not keys:
                continue
            ell = favor_log_kernel(fm, q[i], k)
            s = max(max(float(ell[j]) for j in keys), log_eps)
            a = {j: math.exp(float(ell[j]) - s) for j in keys}  # A_ij exp(-s)
            sink = math.exp(log_eps - s)
            total = sum(a.values())
            den = total + sink if eps_policy == "add" else max(total, sink)
            depends = eps_policy == "add" or total >= sink
        else:
            fq = features(fm, q[i], "query")
            a = {j: float(fq @ fk[j]) for j in keys}
            total = sum(a.values())
            den = total + eps if eps_policy == "add" else max(total, eps)
            depends = eps_policy == "add" or total >= eps
            if den == 0.0:
                continue
        for j in keys:
            y[i] += a[j] / den * v[j]
        dyy = float(dy[i] @ y[i]) if depends else 0.0
        dphiq, dqs = np.zeros(0 if favor else fk.shape[-1]), np.zeros(d)
        for j in keys:
            dv[j] += a[j] / den * dy[i]
            g = float(dy[i] @ v[j]) - dyy  # dA_ij D_i
            if favor:
                e = _favor_softmax_mean(w, qs[i], ks[j])
                big_g = g * a[j] / den  # dA_ij A_ij
                dqs += big_g * (e - qs[i])
                dks[j] += big_g * (e - ks[j])
            else:
                dphiq += g / den * fk[j]
                dphik[j] += g / den * fq
        dq[i] = dqs / d**0.25 if favor else feature_vjp(fm, q[i], dphiq)
    dk = dks / d**0.25 if favor else feature_vjp(fm, k, dphik)
    return y, dq, dk, dv


# ----------------------------------------------------------------------------- fast


def _vjp_fast_head(
    fm: Any, pre: Any, v: np.ndarray, dy: np.ndarray, km: np.ndarray, opt: Any, w: Any
) -> tuple[np.ndarray, ...]:
    """``(y, dq-part, dk-part, dv)`` of one (batch, head) by query blocks, the parts with respect
    to the features (FAVOR+: ``x~``); ``pre``: this head's :func:`precompute`, ``w`` FAVOR+'s
    ``omega``."""
    causal, eps, eps_policy = opt
    favor = w is not None
    qa, ka = pre[0], pre[1]  # features, or x~
    t_q, t_k = qa.shape[0], ka.shape[0]
    y, dv = np.zeros((t_q, v.shape[-1])), np.zeros(v.shape)
    dqa, dka = np.zeros(qa.shape), np.zeros(ka.shape)
    per_key = 3 * pre[2].shape[-1] + 6 if favor else 5
    for i0, i1, kk in blocks(t_q, t_k, per_key, causal):
        ok = allowed(km[:kk], i0, i1, causal)
        vals, dyb = v[:kk], dy[i0:i1]
        if favor:
            qw, kw, nq, nk = pre[2:]
            ell, r, total = favor_log_block(qw[i0:i1], kw[:kk], nq[i0:i1], nk[:kk])
            weights, den, depends = ratio_parts(ell, ok, eps, eps_policy)
            ratio = weights / den[:, None]  # W_ij = A_ij / D_i
        else:
            a = np.where(ok, qa[i0:i1] @ ka[:kk].T, 0.0)
            s = a.sum(axis=-1)
            adj = adjusted(s, eps, eps_policy)
            live = adj != 0
            inv = np.where(live, 1.0 / np.where(live, adj, 1.0), 0.0)
            ratio = a * inv[:, None]
            depends = np.full(s.shape, True) if eps_policy == "add" else s >= eps
        y[i0:i1] = masked_matmul(ratio, ok, vals)
        dyy = np.where(depends, np.sum(dyb * y[i0:i1], axis=-1), 0.0)
        g = np.where(ok, dyb @ vals.T - dyy[:, None], 0.0)  # dA_ij D_i
        dv[:kk] += ratio.T @ dyb
        if favor:
            big_g = g * ratio  # dA_ij A_ij
            r /= total[..., None]  # softmax over the features
            if not np.isfinite(r).all():
                r = np.where(ok[..., None], r, 0.0)
            gr_q = np.einsum("ij,ijf->if", big_g, r, optimize=True)
            gr_k = np.einsum("ij,ijf->jf", big_g, r, optimize=True)
            dqa[i0:i1] = gr_q @ w - qa[i0:i1] * big_g.sum(axis=1)[:, None]
            dka[:kk] += gr_k @ w - ka[:kk] * big_g.sum(axis=0)[:, None]
        else:
            da = g * inv[:, None]
            dqa[i0:i1] = masked_matmul(da, ok, ka[:kk])
            dka[:kk] += da.T @ qa[i0:i1]
    return y, dqa, dka, dv


# ----------------------------------------------------------------------------- public


def unread_keys(km: np.ndarray, causal: bool, t_q: int) -> np.ndarray:
    """``[..., T_k]``: keys no query reads (``key_mask`` False, or past the last query)."""
    return ~km | (np.arange(km.shape[-1]) >= t_q) if causal else ~km


def _vjp(
    fm: Any,
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    d_y: np.ndarray,
    km: np.ndarray,
    opt: tuple[bool, float, str],
    method: str,
) -> tuple[np.ndarray, LinearGrads]:
    """``(y, grads)`` for checked float64 inputs (``km`` boolean ``[..., T_k]``)."""
    *batch, t_q, n_heads, _ = q.shape
    # non-finite entries of keys no query reads as zeros (no 0 x NaN; their gradient is exactly 0)
    unread = unread_keys(km, opt[0], t_q)[..., None, None]  # against [..., T_k, H, d]
    k, v = (np.where(unread & ~np.isfinite(a), 0.0, a) for a in (k, v))
    y = np.zeros((*batch, t_q, n_heads, v.shape[-1]))
    dv = np.zeros(v.shape)
    pre, w = precompute(fm, q, k) if method == "fast" else ([q, k], None)
    dqa, dka = np.zeros(pre[0].shape), np.zeros(pre[1].shape)
    for idx in np.ndindex(*batch):
        for h in range(n_heads):
            args = (v[idx][:, h], d_y[idx][:, h], km[idx], opt)
            if method == "fast":
                out = _vjp_fast_head(fm, [a[idx][:, h] for a in pre], *args, w)
            else:
                out = _vjp_definition_head(fm, q[idx][:, h], k[idx][:, h], *args)
            y[idx][:, h], dqa[idx][:, h], dka[idx][:, h], dv[idx][:, h] = out
    if method == "fast":  # from the gradient with respect to the features (FAVOR+: x~) to x
        dqa, dka = (
            dxa / x.shape[-1] ** 0.25 if fm.name == "favor_plus" else feature_vjp(fm, x, dxa)
            for x, dxa in ((q, dqa), (k, dka))
        )
    return y, LinearGrads(dqa, dka, dv)


@doc(LINEAR, LINEAR_RAISES)
@signed(linear_qkv, linear_options, method_option, front=("d_y",))
def linear_attention_vjp(call: dict[str, Any], d_y: Any) -> LinearGrads:
    """Gradients of ``L = sum(d_y * linear_attention(q, k, v, ...))``, analytic, float64.

    Returns:
        :class:`LinearGrads` ``(q, k, v)``, float64, shaped as the inputs.
    """
    method = call.pop("method")
    q, k, v, fm, causal, key_mask, eps, eps_policy = call.values()
    causal = check_options(fm, causal, eps_policy, method)
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    want = (*q.shape[:-1], v.shape[-1])
    if shape_of(d_y) != want:
        raise ValueError(f"d_y has shape {shape_of(d_y)}; expected the output's shape {want}")
    d_y = np.asarray(d_y, dtype=np.float64)
    km = key_mask_array(key_mask, list(q.shape[:-3]), k.shape[-3])
    return _vjp(fm, q, k, v, d_y, km, (causal, eps, eps_policy), method)[1]


# ----------------------------------------------------------------------------- multi-head


def _project_back(
    x: np.ndarray, wt: np.ndarray, dh: np.ndarray, method: str
) -> tuple[np.ndarray, ...]:
    """``(dx, dW, db)`` of ``h = x W + b`` given ``dh [..., T, H, d]`` ("definition": one batch
    element, head and token at a time)."""
    if method == "fast":
        dw = np.einsum("...td,...the->hde", x, dh, optimize=True)
        dx = np.einsum("...the,hde->...td", dh, wt, optimize=True)
        return dx, dw, dh.sum(axis=tuple(range(dh.ndim - 2)))
    dx, dw, db = np.zeros(x.shape), np.zeros(wt.shape), np.zeros(wt.shape[::2])
    for idx in np.ndindex(*x.shape[:-2]):
        for h in range(wt.shape[0]):
            for t in range(x.shape[-2]):
                dw[h] += np.outer(x[idx][t], dh[idx][t, h])
                dx[idx][t] += wt[h] @ dh[idx][t, h]
                db[h] += dh[idx][t, h]
    return dx, dw, db


@doc(LINEAR, LINEAR_RAISES)
@signed(weight_tokens, linear_options, block_options, front=("d_y",))
def linear_multihead_vjp(call: dict[str, Any], *, d_y: Any) -> LinearMultiheadGrads:
    """Gradients of ``L = sum(d_y * linear_multihead(params, x_q, x_kv, ...))``, analytic, float64.

    With ``q = x_q W_Q[h] + b_Q[h]`` (and ``k``, ``v`` from ``x_kv`` with key/value head
    ``h // G``), ``z = linear_attention(q, k, v)`` and ``y = sum_h z_h W_O[h] + b_O``::

        dW_O[h] = sum_t z_th^T dy_t,  db_O = sum_t dy_t,  dz_th = dy_t W_O[h]^T
        (dq, dk, dv) = linear_attention_vjp(q, k, v, dz)
        dW_Q[h] = sum_t x_t^T dq_th,  db_Q[h] = sum_t dq_th,  dx_t = sum_h dq_th W_Q[h]^T

    (key/value gradients summed over their ``G`` query heads; ``dy`` into ``dx_q`` if residual).

    Returns:
        :class:`LinearMultiheadGrads` ``(params, x_q, x_kv)``.
    """
    residual, method = call.pop("residual"), call.pop("method")
    params, x_q, x_kv, fm, causal, key_mask, eps, eps_policy = call.values()
    causal = check_options(fm, causal, eps_policy, method)
    residual = check_flag("residual", residual)
    w, kv_of, xq, xkv = multihead_inputs(params, x_q, x_kv)
    if shape_of(d_y) != xq.shape:
        raise ValueError(f"d_y has shape {shape_of(d_y)}; expected the output's shape {xq.shape}")
    dy = np.asarray(d_y, dtype=np.float64)
    w_q, w_k, w_v, w_o = head_weights(w)
    n_kv = w_k.shape[0]
    group = w_q.shape[0] // n_kv
    km = key_mask_array(key_mask, list(xkv.shape[:-2]), xkv.shape[-2])
    if x_kv is not None:  # a token no query reads: read as zeros (its gradient is 0 either way)
        unread = unread_keys(km, causal, xq.shape[-2])[..., None]
        xkv = np.where(unread & ~np.isfinite(xkv), 0.0, xkv)
    q = project(xq, w_q, w["b_q"])
    k, v = project(xkv, w_k, w["b_k"]), project(xkv, w_v, w["b_v"])
    dz = _project_back_out(dy, w_o, method)
    opt = (causal, eps, eps_policy)
    z, g = _vjp(fm, q, k[..., kv_of, :], v[..., kv_of, :], dz, km, opt, method)
    batch_k = (*k.shape[:-2], n_kv, group)
    dk = g.k.reshape(*batch_k, -1).sum(axis=-2)  # query heads i = g G + r share head g
    dv = g.v.reshape(*batch_k, -1).sum(axis=-2)
    dx, out = {}, {}
    for name, x, wt, dh in (("q", xq, w_q, g.q), ("k", xkv, w_k, dk), ("v", xkv, w_v, dv)):
        dx[name], out["w_" + name], out["b_" + name] = _project_back(x, wt, dh, method)
    out["w_o"], out["b_o"] = _output_weights(z, dy, method)
    grads = {n: out[n] for n in FIELDS if n.startswith("w_") or w[n] is not None}
    dx_q = dx["q"] + dy if residual else dx["q"]
    if x_kv is None:
        return LinearMultiheadGrads(grads, dx_q + (dx["k"] + dx["v"]), None)
    return LinearMultiheadGrads(grads, dx_q, dx["k"] + dx["v"])


def _project_back_out(dy: np.ndarray, w_o: np.ndarray, method: str) -> np.ndarray:
    """``dz_th = dy_t W_O[h]^T``, ``[..., T_q, H, d_v]``."""
    if method == "fast":
        return np.einsum("...qd,hvd->...qhv", dy, w_o, optimize=True)
    dz = np.zeros((*dy.shape[:-1], w_o.shape[0], w_o.shape[1]))
    for idx in np.ndindex(*dy.shape[:-1]):
        for h in range(w_o.shape[0]):
            dz[idx][h] = w_o[h] @ dy[idx]
    return dz


def _output_weights(z: np.ndarray, dy: np.ndarray, method: str) -> tuple[np.ndarray, np.ndarray]:
    """``(dW_O, db_O)``: ``dW_O[h] = sum_t z_th^T dy_t`` and ``db_O = sum_t dy_t``."""
    if method == "fast":
        dwo = np.einsum("...qhv,...qd->hvd", z, dy, optimize=True)
        return dwo, dy.sum(axis=tuple(range(dy.ndim - 1)))
    dwo, dbo = np.zeros((z.shape[-2], z.shape[-1], dy.shape[-1])), np.zeros(dy.shape[-1])
    for idx in np.ndindex(*dy.shape[:-1]):
        dbo += dy[idx]
        for h in range(z.shape[-2]):
            dwo[h] += np.outer(z[idx][h], dy[idx])
    return dwo, dbo
