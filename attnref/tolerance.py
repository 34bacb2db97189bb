"""Derived error bounds for attention computed in a floating-point format (NumPy only).

A formulation run in a format with unit round-off ``u`` (``eps / 2``) is compared with the float64
oracle on the *same* inputs (already rounded to the format), so only arithmetic error is bounded.
The bound is first order in ``u`` and componentwise; its derivation (also in
``docs/tolerances.md``):

1. **Logits.** Every formulation computes ``s_ij = scale * x~_i W~_Q W~_K^T x~_j^T`` (tildes:
   homogeneous coordinates ``x~ = [x, 1]``, ``W~ = [W; b]``, which fold the biases in) as *some*
   parenthesisation of the same four factors, plus the scale multiply and the bias add. For a
   product of matrices computed in any order,
   ``|fl(A_1...A_k) - A_1...A_k| <= gamma_N |A_1|...|A_k|``
   with ``N`` the sum of the inner dimensions and ``gamma_n = n u / (1 - n u)`` (Higham 2002,
   eq. 3.13 and Lemma 3.3). So ``|ds_ij| <= gamma_{N_s} Ls_ij + u |s_ij - max_j s_ij|`` with
   ``N_s = 2 (d_model + 1) + d_k + 2`` and ``Ls = |scale| |x~_q||W~_Q||W~_K|^T|x~_kv|^T + |bias|``;
   the last term is the rounding of the max subtraction. (The patterns and column forms drop the
   row-constant ``b_K`` terms; softmax is invariant to them and the bound covers what remains.)
2. **Softmax.** Logit errors ``|ds_ij| <= E_i`` move each weight by a factor in
   ``[exp(-2 E_i), exp(2 E_i)]``; evaluating ``exp`` (assumed accurate to ``C_EXP = 4`` units of
   ``u``), the row sum of ``T_k`` terms and the division add ``gamma_{T_k + 2 + 2 C_EXP}``. Hence
   ``|dp_ij| <= rho_i p_ij`` with ``rho_i = exp(2 E_i) - 1 + gamma_{T_k + 10}``.
3. **Output.** ``y_i = sum_h sum_j p_hij x~_j W~_V[h] W_O[h] + b_O`` in any order is a product with
   inner dimensions ``T_k, d_model + 1, d_v`` summed over ``H`` heads plus one bias add:
   ``N_y = T_k + d_model + d_v + H + 2``. With ``G_hj = |x~_j||W~_V[h]||W_O[h]|``,
   ``|dy_i| <= sum_h (rho_hi + gamma_{N_y}) sum_j p_hij G_hj + gamma_{N_y} |b_O|``
   (and ``+ u |x_i + y_i|`` in residual form).

**16-bit formats** (float16, bfloat16). The worst-case ``gamma_n`` in the 16-bit ``u`` is vacuous
at ordinary sizes, so these use the model of how XLA evaluates them: dot products and ``jnp.sum``
accumulate in float32 (``gamma_n`` in float32's ``u``) and each stored intermediate is rounded once
to the 16-bit format. Counting stored intermediates over all formulations gives at most
``K_S = 8`` roundings on the logit chain and ``K_Y = 8`` on the output chain, each bounded by the
chain's absolute magnitude, plus one scatter-add segment sum of length ``T_k`` accumulated in the
16-bit format (the graph form). Softmax evaluation adds ``4 u`` for exp, sum and division.

**Grouped-query parameters** (``K < H`` key/value heads, query head ``i`` reading key/value
head ``i // G``) are bounded as their equivalent multi-head parameters (every K/V head repeated
for its ``G`` query heads): each formulation computes the same products per query head, whether a
key/value projection is computed once and shared or once per query head, so the error model is
unchanged.

**Rotary position embedding** (:func:`rope_attention_error_bound`). The angle ``m theta_p``
(``theta_p = base^(-2p/d)`` by ``pow`` in float64, rounded to the angle dtype, times the position)
is off by at most ``(gamma_2 + (|ln base| + 3) u64) |m| theta_p``, and ``cos``/``sin`` add
``C_TRIG = 4`` units of ``u``; as ``|cos(a + da) - cos(a)| <= |da|`` this bounds
``|c^ - cos|, |s^ - sin| <= e_p(m)``. A rotated pair ``(a c - b s, a s + b c)`` is then off by
``(|a| + |b|) (e_p(m) + gamma_2)`` (:func:`rope_map_error_bound`). In the logits, with ``QP_p``
the pair sum over plane ``p`` of ``Q = |x~_q||W~_Q|`` and ``QJ`` the pair sums spread back to both
members (so ``|rope(q)| <= QJ``), both the rotate-``q``-and-``k`` form and the relative form
``x~_i W~_Q R(m - n) W~_K^T x~_j^T`` satisfy
``|ds_ij| <= gamma_{N_s} Ls_ij + |scale| sum_p (e_p(m_i) + e_p(n_j)) 2 QP_ip KP_jp
+ u |s_ij - max_j s_ij|`` with ``N_s = 2 (d_model + 3) + 2 d_k + 2`` and
``Ls = |scale| QJ . KJ + |bias|``; softmax and output are as above (values are not rotated).

The float64 oracle's own error is the same bound with float64's ``u``; :func:`attention_error_bound`
returns the sum of both, so ``|actual - oracle| <= bound`` is a rigorous first-order test.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = [
    "attention_error_bound",
    "attention_local_errors",
    "comparative_bound",
    "gamma",
    "kernel_error_bound",
    "linear_error_bound",
    "linear_multihead_error_bound",
    "rope_attention_error_bound",
    "rope_map_error_bound",
    "unit_roundoff",
]

C_EXP = 4  # assumed accuracy of exp, in units of u (XLA's and NumPy's exp are within 1-2 ulp)
K_S = 8  # stored 16-bit intermediates on the logit chain (max over formulations)
K_Y = 8  # stored 16-bit intermediates on the output chain (max over formulations)


def unit_roundoff(dtype: Any) -> float:
    """``u = eps / 2`` of a floating dtype (works for ml_dtypes' bfloat16 too)."""
    try:
        eps = float(np.finfo(dtype).eps)
    except (TypeError, ValueError):  # pragma: no cover - exotic dtypes
        import ml_dtypes

        eps = float(ml_dtypes.finfo(dtype).eps)
    return eps / 2.0


def gamma(n: int, u: float) -> float:
    """``gamma_n = n u / (1 - n u)``; ``inf`` once ``n u >= 1`` (no bound)."""
    nu = n * u
    return math.inf if nu >= 1.0 else nu / (1.0 - nu)


def _is_16bit(dtype: Any) -> bool:
    return np.dtype(dtype).itemsize == 2


def _get(params: Any, name: str) -> np.ndarray | None:
    value = params.get(name) if isinstance(params, dict) else getattr(params, name, None)
    return None if value is None else np.asarray(value, dtype=np.float64)


_FIELDS = ("w_q", "w_k", "w_v", "w_o", "b_q", "b_k", "b_v", "b_o")


def _read_params(params: Any) -> dict[str, np.ndarray | None]:
    """The parameters as float64 arrays, key/value heads repeated to one per query head.

    ``w_k, w_v [K, ...]`` and ``b_k, b_v [K, d]`` become ``[H, ...]`` with entry ``i`` taken from
    key/value head ``i // G`` (``G = H / K``); multi-head parameters pass through unchanged.
    """
    w = {n: _get(params, n) for n in _FIELDS}
    w_q, w_k, w_v = w["w_q"], w["w_k"], w["w_v"]
    if w_q is None or w_k is None or w_v is None or w["w_o"] is None:
        raise ValueError("params must have w_q, w_k, w_v and w_o")
    h, kv = w_q.shape[0], w_k.shape[0]
    if kv < 1 or h % kv or w_v.shape[0] != kv:
        raise ValueError(
            f"params.w_q has {h} heads, params.w_k {kv} and params.w_v {w_v.shape[0]}; w_k and "
            "w_v need the same number of heads, and num_heads must be a multiple of it"
        )
    kv_of = np.arange(h) // (h // kv)
    for name in ("w_k", "w_v", "b_k", "b_v"):
        a = w[name]
        if a is not None:
            w[name] = a[kv_of]
    return w


def _homogeneous_abs(w: np.ndarray, b: np.ndarray | None) -> np.ndarray:
    """``|[W; b]|`` per head: ``[H, d_model + 1, d]`` (zero row when there is no bias)."""
    bias = np.zeros((w.shape[0], 1, w.shape[2])) if b is None else b[:, None, :]
    return np.abs(np.concatenate([w, bias], axis=1))


def _chain_terms(dtype: Any, n_s: int, n_y: int, t_k: int) -> tuple[float, float, float, float]:
    """``(g_s, u_sub, g_soft, g_y)`` for the dtype's arithmetic model (see the module docstring)."""
    u = unit_roundoff(dtype)
    if _is_16bit(dtype):
        u32 = unit_roundoff(np.float32)
        g_s = K_S * u + gamma(n_s, u32)
        g_soft = 4 * u + gamma(t_k + 2 + 2 * C_EXP, u32)
        g_y = K_Y * u + gamma(t_k, u) + gamma(n_y, u32)
        return g_s, u, g_soft, g_y
    return gamma(n_s, u), u, gamma(t_k + 2 + 2 * C_EXP, u), gamma(n_y, u)


def _bound_for(
    dtype: Any,
    *,
    ls: np.ndarray,
    logits: np.ndarray,
    allowed: np.ndarray,
    weights: np.ndarray,
    g_mag: np.ndarray,
    b_o: np.ndarray | None,
    dims: tuple[int, int, int, int, int],
) -> np.ndarray:
    h, d_model, d_k, d_v, t_k = dims
    n_s = 2 * (d_model + 1) + d_k + 2
    n_y = t_k + d_model + d_v + h + 2
    g_s, u, g_soft, g_y = _chain_terms(dtype, n_s, n_y, t_k)
    top = np.max(np.where(allowed, logits, -np.inf), axis=-1, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)
    sub = np.where(allowed, np.abs(logits - top), 0.0)
    err_s = np.where(allowed, g_s * ls + u * sub, 0.0)
    e_row = err_s.max(axis=-1)  # [..., H, T_q]
    with np.errstate(over="ignore"):
        rho = np.expm1(2.0 * e_row) + g_soft
    mixed = np.einsum("...hqk,...hkd->...hqd", weights, g_mag)  # sum_j p_hij G_hj
    bound = np.einsum("...hq,...hqd->...qd", rho + g_y, mixed)
    if b_o is not None:
        bound = bound + g_y * np.abs(b_o)
    return bound


def attention_error_bound(
    params: Any,
    x_q: Any,
    x_kv: Any = None,
    *,
    mask: Any = None,
    bias: Any = None,
    scale: float | None = None,
    residual: bool = False,
    dtype: Any = np.float32,
) -> np.ndarray:
    """Componentwise bound on ``|attention in dtype - float64 oracle|``, ``[..., T_q, d_model]``.

    ``params``, ``x_q``, ``x_kv``, ``mask`` and ``bias`` are the inputs exactly as the formulation
    received them (already in ``dtype``). The result includes the oracle's own float64 error.
    """
    w = _read_params(params)
    w_q, w_k, w_v, w_o = w["w_q"], w["w_k"], w["w_v"], w["w_o"]
    assert w_q is not None and w_k is not None and w_v is not None and w_o is not None
    h, d_model, d_k = w_q.shape
    d_v = w_v.shape[2]
    xq = np.asarray(x_q, dtype=np.float64)
    xkv = xq if x_kv is None else np.asarray(x_kv, dtype=np.float64)
    t_q, t_k = xq.shape[-2], xkv.shape[-2]
    full = (*xq.shape[:-2], t_q, t_k)
    s = 1.0 / math.sqrt(d_k) if scale is None else float(scale)

    b_arr = np.zeros(full) if bias is None else np.broadcast_to(np.asarray(bias, np.float64), full)
    m_arr = np.ones(full, bool) if mask is None else np.broadcast_to(np.asarray(mask, bool), full)
    finite_bias = np.where(np.isneginf(b_arr), 0.0, b_arr)
    q, k = _heads(xq, w_q, w["b_q"]), _heads(xkv, w_k, w["b_k"])
    logits = np.einsum("...hqd,...hkd->...hqk", q, k) * s + finite_bias[..., None, :, :]
    allowed = np.broadcast_to((m_arr & ~np.isneginf(b_arr))[..., None, :, :], logits.shape)

    top = np.max(np.where(allowed, logits, -np.inf), axis=-1, keepdims=True)
    shift = np.where(np.isfinite(top), top, 0.0)
    e = np.where(allowed, np.exp(np.where(allowed, logits - shift, 0.0)), 0.0)  # masked: no exp
    denom = e.sum(axis=-1, keepdims=True)
    weights = e / np.where(denom > 0, denom, 1.0)

    qa = np.einsum("...td,hde->...hte", np.abs(_hom(xq)), _homogeneous_abs(w_q, w["b_q"]))
    ka = np.einsum("...td,hde->...hte", np.abs(_hom(xkv)), _homogeneous_abs(w_k, w["b_k"]))
    ls = abs(s) * np.einsum("...hqd,...hkd->...hqk", qa, ka) + np.abs(finite_bias)[..., None, :, :]
    va = np.einsum("...td,hde->...hte", np.abs(_hom(xkv)), _homogeneous_abs(w_v, w["b_v"]))
    g_mag = np.einsum("...hkv,hvd->...hkd", va, np.abs(w_o))

    kwargs = dict(
        ls=ls,
        logits=logits,
        allowed=allowed,
        weights=weights,
        g_mag=g_mag,
        b_o=w["b_o"],
        dims=(h, d_model, d_k, d_v, t_k),
    )
    bound = _bound_for(dtype, **kwargs) + _bound_for(np.float64, **kwargs)  # type: ignore[arg-type]
    if residual:
        y = np.einsum(
            "...hqk,...hkd->...qd",
            weights,
            np.einsum("...hkv,hvd->...hkd", _heads(xkv, w_v, w["b_v"]), w_o),
        )
        bound = bound + unit_roundoff(dtype) * np.abs(xq + y)
    return bound


def attention_local_errors(
    params: Any,
    x_q: Any,
    x_kv: Any = None,
    *,
    mask: Any = None,
    scale: float | None = None,
    dtype: Any = np.float32,
) -> dict[str, Any]:
    """The three local error terms of :func:`attention_error_bound`'s derivation, unpropagated.

    For a caller that propagates them itself, e.g. with a float64 Jacobian through a whole model
    (``tests/test_bert.py``), where they give a tighter bound than ``rho`` (which assumes the worst
    sign and the row's largest logit error for every weight). First order, any formulation:

    * ``"logits"`` ``[..., H, T_q, T_k]``: ``|ds_ij| <= gamma_{N_s} Ls_ij + u |s_ij - max_j s_ij|``
      (step 1; zero at masked keys, which get exact zero weight);
    * ``"weights"`` (a float): the relative error ``gamma_{T_k + 2 + 2 C_EXP}`` that ``exp``, the
      row sum and the division add to each weight, on top of the logits' (step 2);
    * ``"output"`` ``[..., T_q, d_model]``: ``gamma_{N_y} (sum_h sum_j p_hij G_hj + |b_O|)``, the
      rounding of the weighted sum of values and the output projection given the weights (step 3).

    Each is the sum of ``dtype``'s share and the float64 oracle's (as in ``attention_error_bound``).
    No ``bias`` argument: the logit bias is zero (masking is by ``mask``).
    """
    w = _read_params(params)
    w_q, w_k, w_v, w_o = w["w_q"], w["w_k"], w["w_v"], w["w_o"]
    assert w_q is not None and w_k is not None and w_v is not None and w_o is not None
    h, d_model, d_k = w_q.shape
    d_v = w_v.shape[2]
    xq = np.asarray(x_q, dtype=np.float64)
    xkv = xq if x_kv is None else np.asarray(x_kv, dtype=np.float64)
    t_q, t_k = xq.shape[-2], xkv.shape[-2]
    full = (*xq.shape[:-2], t_q, t_k)
    s = 1.0 / math.sqrt(d_k) if scale is None else float(scale)

    m_arr = np.ones(full, bool) if mask is None else np.broadcast_to(np.asarray(mask, bool), full)
    q, k = _heads(xq, w_q, w["b_q"]), _heads(xkv, w_k, w["b_k"])
    logits = np.einsum("...hqd,...hkd->...hqk", q, k) * s
    allowed = np.broadcast_to(m_arr[..., None, :, :], logits.shape)
    top = np.max(np.where(allowed, logits, -np.inf), axis=-1, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)
    e = np.where(allowed, np.exp(logits - top), 0.0)
    denom = e.sum(axis=-1, keepdims=True)
    weights = e / np.where(denom > 0, denom, 1.0)
    qa = np.einsum("...td,hde->...hte", np.abs(_hom(xq)), _homogeneous_abs(w_q, w["b_q"]))
    ka = np.einsum("...td,hde->...hte", np.abs(_hom(xkv)), _homogeneous_abs(w_k, w["b_k"]))
    ls = abs(s) * np.einsum("...hqd,...hkd->...hqk", qa, ka)
    va = np.einsum("...td,hde->...hte", np.abs(_hom(xkv)), _homogeneous_abs(w_v, w["b_v"]))
    g_mag = np.einsum("...hkv,hvd->...hkd", va, np.abs(w_o))
    mixed = np.einsum("...hqk,...hkd->...qd", weights, g_mag)  # sum_h sum_j p_hij G_hj
    if w["b_o"] is not None:
        mixed = mixed + np.abs(w["b_o"])
    n_s = 2 * (d_model + 1) + d_k + 2
    n_y = t_k + d_model + d_v + h + 2
    out: dict[str, Any] = {"logits": 0.0, "weights": 0.0, "output": 0.0}
    for dt in (dtype, np.float64):
        g_s, u, g_soft, g_y = _chain_terms(dt, n_s, n_y, t_k)
        out["logits"] = out["logits"] + np.where(allowed, g_s * ls + u * np.abs(logits - top), 0.0)
        out["weights"] = out["weights"] + g_soft
        out["output"] = out["output"] + g_y * mixed
    return out


def comparative_bound(
    reference_error: float, magnitude: float, dtype: Any, *, factor: float = 2.0, n: int = 1
) -> float:
    """FlashAttention's rule: allowed error ``= factor * reference_error + gamma_n * magnitude``.

    ``reference_error`` is the max error of a same-precision reference (different operation
    order) against float64; ``gamma_n * magnitude`` is a rounding floor for the case where that
    reference happens to be almost exact. FlashAttention's tests use ``factor = 2``.
    """
    return factor * reference_error + gamma(n, unit_roundoff(dtype)) * magnitude


# ----------------------------------------------------------------------------- linear attention


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
        outer = (
            xs[..., :, None] * dxs[..., None, :]
            + dxs[..., :, None] * xs[..., None, :]
            + 3 * u * xs[..., :, None] * xs[..., None, :]
        ) / math.sqrt(2.0)
        lead = np.zeros((*x.shape[:-1], 1))
        return np.concatenate([lead, dxs, outer.reshape(*x.shape[:-1], d * d)], axis=-1)
    de = _favor_exponent_error(fm, xs, dxs, u, 2.0)
    rho = np.expm1(2 * de) + (C_EXP + 2) * u  # x2: a query's max carries the same error
    return rho * np.abs(phi)


def _max_float(dtype: Any) -> float:
    """The largest finite value of a floating dtype (ml_dtypes' bfloat16 too)."""
    try:
        return float(np.finfo(dtype).max)
    except (TypeError, ValueError):  # pragma: no cover - exotic dtypes
        import ml_dtypes

        return float(ml_dtypes.finfo(dtype).max)


def _favor_exponent_error(
    fm: Any, xs: np.ndarray, dxs: np.ndarray, u: float, factor: float
) -> np.ndarray:
    """Per feature ``[..., m]``: ``factor gamma_{d+6} mag + |dx~|.|w_i| + |x~|.|dx~|``, the error
    of the FAVOR+ exponent ``w_i.x~ -/+ |x~|^2/2 -/+ |w_i|^2/2`` (each part a sum of ``<= d + 3``
    terms) with ``mag`` the sum of the parts' magnitudes; ``dxs`` the error of ``x~``."""
    w = np.abs(np.asarray(fm.omega, dtype=np.float64))
    mag = xs @ w.T + 0.5 * np.sum(xs * xs, -1, keepdims=True) + 0.5 * np.sum(w * w, -1)
    return (
        factor * gamma(xs.shape[-1] + 6, u) * mag + dxs @ w.T + np.sum(xs * dxs, -1, keepdims=True)
    )


def _scaled_eps(
    fm: Any, q: np.ndarray, dq: np.ndarray, eps: float, dtype: Any
) -> tuple[np.ndarray, np.ndarray]:
    """``eps exp(-c_q)`` ``[..., T_q, H]``, the eps of the definition in the units of the
    stabilised features (``c_q = 0`` except FAVOR+, see ``oracle.query_log_scale``), and a bound
    on its relative evaluation error. The forms compute ``eps exp(min(-c, L))`` with ``c`` off by
    at most ``dc = max_i(gamma_{d+6} mag_i + |dq~|.|w_i|) + |q~|.|dq~|``: relative error
    ``expm1(dc) + (C_EXP + 2) u``. Where ``c < -L`` (``L = log(max float) / 2``) they also rescale
    ``num``, ``den`` and ``eps`` by ``exp(c + L)``: the eps term's error relative to the
    others grows by ``expm1(dc + u (|c| + L)) + (C_EXP + 1) u``, and ``num``, ``den`` take one
    rounding more (added by the caller)."""
    from attnref.oracle._core import query_log_scale

    c = query_log_scale(fm, q)
    eps_s = eps * np.exp(np.minimum(-c, 700.0))  # float64: exact unless |q~|^2 > ~1400
    if eps == 0 or fm.name != "favor_plus":
        return eps_s, np.zeros_like(c)
    u, d = unit_roundoff(dtype), q.shape[-1]
    xs = np.abs(q) / d**0.25
    dxs = 2 * u * xs + dq / d**0.25
    dc = np.max(_favor_exponent_error(fm, xs, dxs, u, 1.0), axis=-1)
    big = 0.5 * math.log(_max_float(dtype))
    # u |log eps|: the float64 oracle forms exp(log eps - s) (its share, with dtype float64)
    rel = np.expm1(dc + u * abs(math.log(eps))) + (C_EXP + 2) * u
    rescaled = c - dc < -big
    rel = rel + np.where(rescaled, np.expm1(dc + u * (np.abs(c) + big)) + (C_EXP + 1) * u, 0.0)
    return eps_s, rel


def _allowed_keys(q_shape: tuple[int, ...], t_k: int, key_mask: Any, causal: bool) -> np.ndarray:
    """``[..., H, T_q, T_k]``: key padding and, if causal, ``j <= i``."""
    *batch, t_q, heads, _ = q_shape
    km = np.ones((*batch, t_k), bool) if key_mask is None else np.asarray(key_mask, bool)
    allowed = np.broadcast_to(km[..., None, None, :], (*batch, heads, t_q, t_k))
    return allowed & np.tril(np.ones((t_q, t_k), bool)) if causal else allowed


def linear_error_bound(
    q: Any,
    k: Any,
    v: Any,
    *,
    feature_map: Any,
    causal: bool = False,
    key_mask: Any = None,
    eps: float = 0.0,
    eps_policy: str = "add",
    dtype: Any = np.float32,
    dq: Any = 0.0,
    dk: Any = 0.0,
    dv: Any = 0.0,
) -> np.ndarray:
    """Componentwise bound on ``|linear attention in dtype - oracle|``, ``[..., T_q, H, d_v]``.

    With ``A_ij = phi(q_i).phi(k_j)``, ``Abar_ij = |phi(q_i)|.|phi(k_j)|`` and ``E_ij`` the error
    of ``A_ij`` from the features (evaluation rounding and input errors ``dq, dk``)::

        |d num_i| <= sum_j (E_ij + g Abar_ij) |v_j| + Abar_ij dv_j,  g = gamma_{m + T_k + 2}
        |d D_i|   <= sum_j (E_ij + g Abar_ij) + u |D_i| + eps_i rho_i
        |d y_i|   <= (|d num_i| + |y_i| |d D_i|) / (|D_i| - |d D_i|) + u |y_i|

    ``D_i`` is the adjusted denominator in the units of the features as computed: for FAVOR+
    those carry a per-query factor ``exp(-c_i)``, so ``eps_i = eps exp(-c_i)`` with relative
    evaluation error ``rho_i`` (:func:`_scaled_eps`; ``g`` counts one rounding more there, for
    the rescaling where ``exp(-c_i)`` would overflow).

    Every form sums the same products ``phi(q_i)_f phi(k_j)_f v_j`` in some order (quadratic,
    associative, prefix sums, recurrence, chunks), so one bound covers them all. Where the
    denominator's error can reach its size (signed maps near cancellation) the bound is ``inf``:
    the ratio is then not determined by the arithmetic. Exactly-zero denominators with no
    possible error give exactly zero outputs and a zero bound. Includes the float64 oracle's error.
    """
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    dq, dk, dv = (
        np.broadcast_to(np.asarray(a, np.float64), b.shape) for a, b in ((dq, q), (dk, k), (dv, v))
    )
    t_q, t_k = q.shape[-3], k.shape[-3]
    allowed = _allowed_keys(q.shape, t_k, key_mask, causal)

    # Imported here so this module still loads (and stays JAX-free) on its own by file path.
    from attnref.oracle import features

    total = np.zeros((*v.shape[:-3], t_q, *v.shape[-2:]))
    for dt in (dtype, np.float64):
        u = unit_roundoff(dt)
        fq, fk = features(feature_map, q, "query"), features(feature_map, k, "key")
        eq = _abs_feature_error(feature_map, q, dq if dt is dtype else 0 * dq, fq, u)
        ek = _abs_feature_error(feature_map, k, dk if dt is dtype else 0 * dk, fk, u)
        a = np.where(allowed, np.einsum("...qhm,...khm->...hqk", fq, fk), 0.0)
        abar = np.where(allowed, np.einsum("...qhm,...khm->...hqk", np.abs(fq), np.abs(fk)), 0.0)
        err_a = np.where(
            allowed,
            np.einsum("...qhm,...khm->...hqk", eq, np.abs(fk))
            + np.einsum("...qhm,...khm->...hqk", np.abs(fq), ek),
            0.0,
        )
        eps_s, rho_eps = _scaled_eps(feature_map, q, dq if dt is dtype else 0 * dq, eps, dt)
        favor_eps = feature_map.name == "favor_plus" and eps > 0
        g = gamma(fq.shape[-1] + t_k + (3 if favor_eps else 2), u)
        absv = np.abs(v)
        dvv = dv if dt is dtype else 0 * dv
        e_tot = err_a + g * abar
        d_num = np.einsum("...hqk,...khv->...qhv", e_tot, absv) + np.einsum(
            "...hqk,...khv->...qhv", abar, dvv
        )
        den = np.swapaxes(a.sum(-1), -1, -2)  # [..., T_q, H]
        adj = den + eps_s if eps_policy == "add" else np.maximum(den, eps_s)
        d_den = np.swapaxes(e_tot.sum(-1), -1, -2) + u * np.abs(adj) + eps_s * rho_eps
        num = np.einsum("...hqk,...khv->...qhv", a, v)
        y = np.where((adj != 0)[..., None], num / np.where(adj == 0, 1.0, adj)[..., None], 0.0)
        room = np.abs(adj) - d_den
        with np.errstate(divide="ignore", invalid="ignore"):
            b = (d_num + np.abs(y) * d_den[..., None]) / room[..., None] + u * np.abs(y)
        exact_zero = (adj == 0) & (d_den == 0)
        b = np.where(exact_zero[..., None], 0.0, np.where((room > 0)[..., None], b, np.inf))
        total = total + b
    return total


def linear_multihead_error_bound(
    params: Any,
    x_q: Any,
    x_kv: Any = None,
    *,
    feature_map: Any,
    causal: bool = False,
    key_mask: Any = None,
    eps: float = 0.0,
    eps_policy: str = "add",
    residual: bool = False,
    dtype: Any = np.float32,
) -> np.ndarray:
    """Bound for multi-head linear attention ``[..., T_q, d_model]``: projection errors
    ``gamma_{d_model+1} |x~||W~|`` feed :func:`linear_error_bound`; the output projection adds
    ``sum_h dz_h |W_O[h]|`` and ``gamma_{n_y} (sum_h sum_j Abar_ij / |D_i| G_hj + |b_O|)`` with
    ``G = |x~||W~_V||W_O|`` (covering the messages order ``A (X W_M)`` too),
    ``n_y = m + T_k + d_model + d_v + H + 4``."""
    w = _read_params(params)
    xq = np.asarray(x_q, dtype=np.float64)
    xkv = xq if x_kv is None else np.asarray(x_kv, dtype=np.float64)
    u = unit_roundoff(dtype)
    d_model = xq.shape[-1]
    g_p = gamma(d_model + 1, u)

    def hom(x: np.ndarray) -> np.ndarray:
        return np.concatenate([x, np.ones((*x.shape[:-1], 1))], axis=-1)

    def heads(x: np.ndarray, name: str) -> tuple[np.ndarray, np.ndarray]:
        wt, b = w["w_" + name], w["b_" + name]
        assert wt is not None
        y = np.einsum("...td,hde->...the", x, wt) + (0.0 if b is None else b)
        mag = np.einsum("...td,hde->...the", np.abs(hom(x)), _homogeneous_abs(wt, b))
        return y, g_p * mag

    (q, dq), (k, dk), (v, dv) = heads(xq, "q"), heads(xkv, "k"), heads(xkv, "v")
    kw = dict(
        feature_map=feature_map, causal=causal, key_mask=key_mask, eps=eps, eps_policy=eps_policy
    )
    dz = linear_error_bound(q, k, v, dtype=dtype, dq=dq, dk=dk, dv=dv, **kw)  # type: ignore[arg-type]
    w_o = w["w_o"]
    assert w_o is not None and w["w_v"] is not None
    from attnref.oracle import features, linear_attention

    z = linear_attention(q, k, v, **kw)  # type: ignore[arg-type]
    fq, fk = features(feature_map, q, "query"), features(feature_map, k, "key")
    t_k = k.shape[-3]
    allowed = _allowed_keys(q.shape, t_k, key_mask, causal)
    abar = np.where(allowed, np.einsum("...qhm,...khm->...hqk", np.abs(fq), np.abs(fk)), 0.0)
    a = np.where(allowed, np.einsum("...qhm,...khm->...hqk", fq, fk), 0.0)
    den = a.sum(-1)
    eps_s = np.swapaxes(_scaled_eps(feature_map, q, 0 * q, eps, dtype)[0], -1, -2)  # [..., H, T_q]
    adj = np.abs(den + eps_s if eps_policy == "add" else np.maximum(den, eps_s))
    with np.errstate(divide="ignore", invalid="ignore"):
        pbar = np.where(adj[..., None] > 0, abar / adj[..., None], 0.0)
    g_mag = np.einsum(
        "...hkv,hvd->...hkd",
        np.einsum("...td,hde->...hte", np.abs(hom(xkv)), _homogeneous_abs(w["w_v"], w["b_v"])),
        np.abs(w_o),
    )
    n_y = fq.shape[-1] + t_k + d_model + v.shape[-1] + q.shape[-2] + 4
    bound = np.einsum("...qhv,hvd->...qd", dz, np.abs(w_o))
    bound = bound + gamma(n_y, u) * np.einsum("...hqk,...hkd->...qd", pbar, g_mag)
    if w["b_o"] is not None:
        bound = bound + gamma(n_y, u) * np.abs(w["b_o"])
    if residual:
        y = np.einsum("...qhv,hvd->...qd", z, w_o) + (0.0 if w["b_o"] is None else w["b_o"])
        bound = bound + u * np.abs(xq + y)
    return bound


# ----------------------------------------------------------------------------- kernel level


def kernel_error_bound(
    q: Any,
    k: Any,
    v: Any,
    allowed: Any,
    bias: Any = None,
    *,
    scale: float | None = None,
    softcap: float | None = None,
    masked_rows: str = "zeros",
    dtype: Any = np.float32,
    key_blocks: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Componentwise bounds on ``|o - o_oracle|`` ``[B, T, N, H_v]`` and ``|lse - lse_oracle|``
    ``[B, T, N]`` for kernel-level attention computed in ``dtype``.

    ``allowed [B, N, T, S]`` is the set of attended pairs (``attnref.oracle.kernel_allowed``).
    The derivation follows the weight-level bound (module docstring), with the kernel's inputs
    ``q, k, v`` exact:

    1. ``|ds_ij| <= gamma_{H+1} scale |q_i|.|k_j| + (C_EXP + 2) u |s~_ij| + u |s_ij| +
       u |s_ij - max_j s_ij|`` (dot product and scale; softcap's tanh, division and multiply,
       whose derivative is at most 1; the bias add; the max subtraction).
    2. Softmax: ``rho_i = exp(2 E_i) - 1 + gamma_{S + 2 + 2 C_EXP + 2 (C_EXP + 1)(n_b - 1)}``:
       the online form rescales each partial sum by ``exp(m - m')`` once per later key block
       (``n_b = key_blocks`` blocks; ``None`` assumes the worst, ``n_b = S``).
    3. Output: ``|do_i| <= (rho_i + gamma_S) sum_j p_ij |v_j|``; ``lse``:
       ``|d lse_i| <= E_i + delta_i / (1 - delta_i) + (C_EXP + 1) u |log l_i| + u |lse_i|``
       with ``delta_i = expm1(E_i) + gamma_{S + C_EXP + 2 (C_EXP + 1)(n_b - 1)}``.

    16-bit inputs are computed in float32 (the kernel promotes), so the float32 terms apply and
    the final cast adds ``u_16 |o|``. Fully masked rows are exact (0 or NaN) except under
    ``"uniform"``: ``gamma_{S+1} mean_j |v_j|``. Includes the float64 oracle's own error.
    """
    qa, ka, va = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    b_size, t, n_heads, h = qa.shape
    s, n_kv = ka.shape[1], ka.shape[2]
    group = n_heads // n_kv
    allowed = np.broadcast_to(np.asarray(allowed, bool), (b_size, n_heads, t, s))
    sc = 1.0 / math.sqrt(h) if scale is None else float(scale)
    kg = np.repeat(ka, group, axis=2)  # [B, S, N, H]
    vg = np.repeat(va, group, axis=2)
    raw = sc * np.einsum("btnh,bsnh->bnts", qa, kg)
    mag = abs(sc) * np.einsum("btnh,bsnh->bnts", np.abs(qa), np.abs(kg))
    capped = raw if softcap is None else softcap * np.tanh(raw / softcap)
    b_arr = (
        np.zeros_like(raw)
        if bias is None
        else np.broadcast_to(np.asarray(bias, np.float64), raw.shape)
    )
    logits = capped + np.where(np.isneginf(b_arr), 0.0, b_arr)
    top = np.max(np.where(allowed, logits, -np.inf), axis=-1, keepdims=True)
    live = np.isfinite(top)
    top = np.where(live, top, 0.0)
    e = np.where(allowed, np.exp(np.where(allowed, logits - top, 0.0)), 0.0)
    l_sum = e.sum(axis=-1, keepdims=True)
    p = e / np.where(live, l_sum, 1.0)
    o_mag = np.einsum("bnts,bsnh->btnh", p, np.abs(vg))
    o_ref = np.einsum("bnts,bsnh->btnh", p, vg)
    lse_ref = np.where(live, top + np.log(np.where(live, l_sum, 1.0)), 0.0)[..., 0]
    n_b = s if key_blocks is None else max(1, int(key_blocks))
    c = C_EXP

    def one(u: float) -> tuple[np.ndarray, np.ndarray]:
        err = gamma(h + 1, u) * mag + u * np.abs(logits) + u * np.abs(logits - top)
        if softcap is not None:
            err = err + (c + 2) * u * np.abs(capped)
        e_row = np.where(allowed, err, 0.0).max(axis=-1)  # [B, N, T]
        extra = 2 * (c + 1) * (n_b - 1)
        with np.errstate(over="ignore"):
            rho = np.expm1(2.0 * e_row) + gamma(s + 2 + 2 * c + extra, u)
            delta = np.expm1(e_row) + gamma(s + c + extra, u)
        out = np.einsum("bnt,btnh->btnh", rho + gamma(s, u), o_mag)
        with np.errstate(divide="ignore", invalid="ignore"):
            log_l = np.log(np.where(live, l_sum, 1.0))[..., 0]
            d_lse = e_row + np.where(delta < 1, delta / (1 - delta), np.inf)
        d_lse = d_lse + (c + 1) * u * np.abs(log_l) + u * np.abs(lse_ref)
        return out, np.swapaxes(np.where(live[..., 0], d_lse, 0.0), 1, 2)

    np_dtype = np.dtype(dtype)
    work = np.float32 if np_dtype.itemsize == 2 else np_dtype
    out_b, lse_b = one(unit_roundoff(work))
    out64, lse64 = one(unit_roundoff(np.float64))
    out_b, lse_b = out_b + out64, lse_b + lse64
    if masked_rows == "uniform":
        dead = np.swapaxes(~live[..., 0], 1, 2)[..., None]  # [B, T, N, 1]
        mean_abs = np.abs(vg).mean(axis=1)[:, None]  # [B, 1, N, H_v]
        g = gamma(s + 1, unit_roundoff(work)) + gamma(s + 1, unit_roundoff(np.float64))
        out_b = np.where(dead, g * mean_abs, out_b)
        o_ref = np.where(dead, vg.mean(axis=1)[:, None], o_ref)
    if np_dtype.itemsize == 2:
        out_b = out_b + unit_roundoff(np_dtype) * (np.abs(o_ref) + out_b)
    return out_b, lse_b


# ----------------------------------------------------------------------------- rotary embedding

C_TRIG = 4  # assumed accuracy of cos/sin in units of u (absolute: |cos|, |sin| <= 1)


def _rope_angle_error(m_theta: np.ndarray, u: float, base: float) -> np.ndarray:
    """``e_p(m) = (gamma_2 + (|ln base| + 3) u64) |m| theta_p + C_TRIG u`` for ``m_theta =
    |m| theta_p``: the error of the computed ``cos``/``sin`` of ``m theta_p`` (module docstring)."""
    u64 = unit_roundoff(np.float64)
    return (gamma(2, u) + (abs(math.log(base)) + 3) * u64) * m_theta + C_TRIG * u


def _rope_planes(a: np.ndarray, convention: str) -> np.ndarray:
    """Per-plane pair sums ``a_i + a_j`` of the last axis: ``[..., d/2]`` (plane ``p`` order)."""
    h = a.shape[-1] // 2
    return a[..., :h] + a[..., h:] if convention == "rotate_half" else a[..., 0::2] + a[..., 1::2]


def _rope_spread(per_plane: np.ndarray, convention: str) -> np.ndarray:
    """``[..., d/2] -> [..., d]``: each plane's value on both members of its pair."""
    if convention == "rotate_half":
        return np.concatenate([per_plane, per_plane], axis=-1)
    return np.repeat(per_plane, 2, axis=-1)


def _pair_sum(a: np.ndarray, convention: str) -> np.ndarray:
    """``a J``: each component replaced by the sum over its RoPE pair."""
    return _rope_spread(_rope_planes(a, convention), convention)


def _rope_theta(d: int, base: float) -> np.ndarray:
    """``theta_p = base^(-2p/d)``, ``[d/2]``, in float64."""
    return np.power(float(base), -2.0 * np.arange(d // 2) / d)


def _check_rope(convention: str, d: int) -> None:
    if convention not in ("rotate_half", "interleaved"):
        raise ValueError(
            f"unknown RoPE convention {convention!r}; expected 'rotate_half' or 'interleaved'"
        )
    if d < 2 or d % 2:
        raise ValueError(f"RoPE needs a positive even head dimension, got {d}")


def _rope_logit_error(
    qa: np.ndarray,
    ka: np.ndarray,
    pos_q: Any,
    pos_k: Any,
    convention: str,
    u: float,
    base: float,
) -> np.ndarray:
    """``sum_p (e_p(m_i) + e_p(n_j)) 2 QP_ip KP_jp``, ``[..., H, T_q, T_k]``: the angle errors of
    plane ``p`` times that plane's share of ``QJ . KJ`` (``QP``: the pair sums of ``qa``).

    ``qa [..., H, T_q, d]``, ``ka [..., H, T_k, d]`` are the magnitudes ``|x~||W~|``; positions
    broadcast to ``[..., T_q]`` and ``[..., T_k]``."""
    theta = _rope_theta(qa.shape[-1], base)
    lead_q, lead_k = qa.shape[:-3] + qa.shape[-2:-1], ka.shape[:-3] + ka.shape[-2:-1]
    mq = np.abs(np.broadcast_to(pos_q, lead_q).astype(np.float64))[..., None, :, None]
    mk = np.abs(np.broadcast_to(pos_k, lead_k).astype(np.float64))[..., None, :, None]
    qp, kp = _rope_planes(qa, convention), _rope_planes(ka, convention)
    eq = _rope_angle_error(mq * theta, u, base)  # [..., 1, T_q, d/2]
    ek = _rope_angle_error(mk * theta, u, base)
    return 2 * (
        np.einsum("...qp,...kp->...qk", eq * qp, kp) + np.einsum("...qp,...kp->...qk", qp, ek * kp)
    )


def rope_map_error_bound(
    x: Any,
    positions: Any,
    *,
    base: float = 10000.0,
    convention: str = "rotate_half",
    dtype: Any = np.float32,
) -> np.ndarray:
    """Componentwise bound on ``|rope(x) in dtype - float64 oracle|`` for ``x [..., T, N, d]``
    (the layout of :func:`attnref.apply_rope`) at integer ``positions [..., T]`` or ``[T]``.

    Each rotated component is off by at most ``(|a| + |b|) (e_p(m) + gamma_2)`` (module
    docstring); the float64 oracle's own error is included."""
    xs = np.asarray(x, np.float64)
    if xs.ndim < 3:
        raise ValueError(f"x must have shape [..., T, N, d], got {xs.shape}")
    _check_rope(convention, xs.shape[-1])
    pos = np.abs(np.broadcast_to(positions, xs.shape[:-2]).astype(np.float64))[..., None, None]
    mag = _pair_sum(np.abs(xs), convention)
    m_theta = pos * _rope_spread(_rope_theta(xs.shape[-1], base), convention)
    total = np.zeros_like(xs)
    for dt in (dtype, np.float64):
        u = unit_roundoff(dt)
        total = total + mag * (_rope_angle_error(m_theta, u, base) + gamma(2, u))
    return total


def _heads(x: np.ndarray, wt: np.ndarray, b: np.ndarray | None) -> np.ndarray:
    """``x W[i] + b[i]`` per head, ``[..., H, T, d]`` (float64)."""
    y = np.einsum("...td,hde->...hte", x, wt)
    return y if b is None else y + b[:, None, :]


def _hom(x: np.ndarray) -> np.ndarray:
    """Homogeneous coordinates ``x~ = [x, 1]`` on the last axis."""
    return np.concatenate([x, np.ones((*x.shape[:-1], 1))], axis=-1)


def rope_attention_error_bound(
    params: Any,
    x_q: Any,
    x_kv: Any = None,
    *,
    positions_q: Any = None,
    positions_kv: Any = None,
    mask: Any = None,
    bias: Any = None,
    scale: float | None = None,
    base: float = 10000.0,
    convention: str = "rotate_half",
    residual: bool = False,
    dtype: Any = np.float32,
) -> np.ndarray:
    """Componentwise bound on ``|RoPE attention in dtype - float64 oracle|``,
    ``[..., T_q, d_model]``, for every RoPE formulation (rotating ``q`` and ``k``, or the
    relative pattern matrices ``W~_Q R(m - n) W~_K^T``).

    Arguments as :func:`attnref.oracle.rope_attention` (positions default to ``arange(T_q)``,
    ``arange(T_k)``; key/value heads may be grouped), inputs exactly as the formulation received
    them. The derivation (module docstring, ``docs/tolerances.md``) adds the angle errors
    ``e_p`` to the logit bound of :func:`attention_error_bound`; the float64 oracle's own error is
    included. 16-bit formats get the same worst-case expression in their ``u`` (loose; the
    tests use :func:`comparative_bound` there)."""
    w = _read_params(params)
    w_q, w_k, w_v, w_o = w["w_q"], w["w_k"], w["w_v"], w["w_o"]
    assert w_q is not None and w_k is not None and w_v is not None and w_o is not None
    h, d_model, d_k = w_q.shape
    _check_rope(convention, d_k)
    d_v = w_v.shape[2]
    xq = np.asarray(x_q, np.float64)
    xkv = xq if x_kv is None else np.asarray(x_kv, np.float64)
    t_q, t_k = xq.shape[-2], xkv.shape[-2]
    pos_q = np.arange(t_q) if positions_q is None else np.asarray(positions_q)
    pos_k = np.arange(t_k) if positions_kv is None else np.asarray(positions_kv)
    full = (*xq.shape[:-2], t_q, t_k)
    s = 1.0 / math.sqrt(d_k) if scale is None else float(scale)
    b_arr = np.zeros(full) if bias is None else np.broadcast_to(np.asarray(bias, np.float64), full)
    finite_bias = np.where(np.isneginf(b_arr), 0.0, b_arr)[..., None, :, :]
    m_arr = np.ones(full, bool) if mask is None else np.broadcast_to(np.asarray(mask, bool), full)

    # Imported here so this module still loads (and stays JAX-free) on its own by file path.
    from attnref.oracle import rope

    def heads(x: np.ndarray, name: str) -> np.ndarray:  # x W + b per head, [..., T, H, d]
        wt, bt = w["w_" + name], w["b_" + name]
        assert wt is not None
        y = np.einsum("...td,hde->...the", x, wt)
        return y if bt is None else y + bt

    def rotated(x: np.ndarray, name: str, pos: np.ndarray) -> np.ndarray:  # [..., H, T, d]
        y = rope(heads(x, name), pos, base=base, convention=convention)
        return np.swapaxes(y, -2, -3)

    q, k = rotated(xq, "q", pos_q), rotated(xkv, "k", pos_k)
    logits = np.einsum("...hqd,...hkd->...hqk", q, k) * s + finite_bias
    allowed = np.broadcast_to((m_arr & ~np.isneginf(b_arr))[..., None, :, :], logits.shape)
    top = np.max(np.where(allowed, logits, -np.inf), axis=-1, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)
    e = np.where(allowed, np.exp(np.where(allowed, logits - top, 0.0)), 0.0)
    denom = e.sum(-1, keepdims=True)
    weights = e / np.where(denom > 0, denom, 1.0)
    sub = np.where(allowed, np.abs(logits - top), 0.0)

    qa = np.einsum("...td,hde->...hte", np.abs(_hom(xq)), _homogeneous_abs(w_q, w["b_q"]))
    ka = np.einsum("...td,hde->...hte", np.abs(_hom(xkv)), _homogeneous_abs(w_k, w["b_k"]))
    qj, kj = _pair_sum(qa, convention), _pair_sum(ka, convention)
    ls = abs(s) * np.einsum("...hqd,...hkd->...hqk", qj, kj) + np.abs(finite_bias)
    va = np.einsum("...td,hde->...hte", np.abs(_hom(xkv)), _homogeneous_abs(w_v, w["b_v"]))
    mixed = np.einsum(
        "...hqk,...hkd->...hqd", weights, np.einsum("...hkv,hvd->...hkd", va, np.abs(w_o))
    )
    values = np.swapaxes(heads(xkv, "v"), -2, -3)  # [..., H, T_k, d_v]
    y_exact = np.einsum("...hqk,...hkv,hvd->...qd", weights, values, w_o)
    if w["b_o"] is not None:
        y_exact = y_exact + w["b_o"]
    n_s = 2 * (d_model + 3) + 2 * d_k + 2
    n_y = t_k + d_model + d_v + h + 2
    bound = np.zeros_like(y_exact)
    for dt in (dtype, np.float64):
        u = unit_roundoff(dt)
        angles = abs(s) * _rope_logit_error(qa, ka, pos_q, pos_k, convention, u, base)
        err_row = np.where(allowed, gamma(n_s, u) * ls + angles + u * sub, 0.0).max(axis=-1)
        with np.errstate(over="ignore"):
            rho = np.expm1(2.0 * err_row) + gamma(t_k + 2 + 2 * C_EXP, u)
        g_y = gamma(n_y, u)
        bound = bound + np.einsum("...hq,...hqd->...qd", rho + g_y, mixed)
        if w["b_o"] is not None:
            bound = bound + g_y * np.abs(w["b_o"])
        if residual:  # one more rounding: x_q + y
            bound = bound + u * np.abs(xq + y_exact)
    return bound
