"""Weight-level bounds (steps 1 to 3 of :mod:`attnref.tolerance`), their local error terms,
FlashAttention's comparative rule, and the helpers the weight-level bounds share. NumPy only.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from attnref.oracle._core import Params, group_size, head_weights, tokens, unpack
from attnref.oracle._doc import WEIGHT, doc, retemplate, signed, weight_call

from ._rounding import C_EXP, K_S, K_Y, gamma, is_16bit, unit_roundoff

# ----------------------------------------------------------------------------- shared helpers

# Raised by every weight-level bound (a RoPE bound's and a gradient's own cases included).
BOUND_RAISES = {
    "ValueError": "``params`` lacks a weight or has inconsistent heads (``w_k``/``w_v`` heads do "
    "not divide ``w_q``'s); for RoPE, ``d_k`` is odd or the convention unknown; for a gradient, "
    "``d_y`` is not of the output's shape."
}


def bound_options(*, residual: bool = False, dtype: Any = np.float32) -> None:
    """The options of a block's bound: a template for :func:`attnref.oracle._doc.signed`."""


# Those of a block's gradient bound: float64 by default.
grad_bound_options = retemplate(bound_options, dtype=np.float64)


def read_params(params: Any) -> Params:
    """The parameters as float64, key/value heads repeated to one per query head (``i // G``)."""
    w = unpack(params)
    kv_of = np.arange(head_weights(w)[0].shape[0]) // group_size(w)
    for name in ("w_k", "w_v", "b_k", "b_v"):
        a = w[name]
        if a is not None:
            w[name] = a[kv_of]
    return w


def hom(x: np.ndarray) -> np.ndarray:
    """Homogeneous coordinates ``x~ = [x, 1]`` on the last axis."""
    return np.concatenate([x, np.ones((*x.shape[:-1], 1))], axis=-1)


def project_heads(
    x: np.ndarray, wt: np.ndarray, b: np.ndarray | None, layout: str = "hte"
) -> np.ndarray:
    """``x W[i] + b[i]`` per head: ``[..., H, T, d]`` (``layout="hte"``) or ``[..., T, H, d]``."""
    y = np.einsum(f"...td,hde->...{layout}", x, wt)
    if b is None:
        return y
    return y + (b[:, None, :] if layout == "hte" else b)


def abs_heads(
    x: np.ndarray, wt: np.ndarray, b: np.ndarray | None, layout: str = "hte"
) -> np.ndarray:
    """``|x~||W~[i]|`` per head (``|W~| = |[W; b]|``, a zero row without bias), the magnitude
    of :func:`project_heads` (same ``layout``)."""
    bias = np.zeros((wt.shape[0], 1, wt.shape[2])) if b is None else b[:, None, :]
    w_abs = np.abs(np.concatenate([wt, bias], axis=1))
    return np.einsum(f"...td,hde->...{layout}", np.abs(hom(x)), w_abs)


def value_magnitude(xkv: np.ndarray, w: dict[str, np.ndarray | None]) -> np.ndarray:
    """``G_hj = |x~_j||W~_V[h]||W_O[h]|``, ``[..., H, T_k, d_model]``."""
    _, _, w_v, w_o = head_weights(w)
    return np.einsum("...hkv,hvd->...hkd", abs_heads(xkv, w_v, w["b_v"]), np.abs(w_o))


class Softmax(NamedTuple):
    """The masked max-subtracted softmax over the last axis (float64)."""

    top: np.ndarray  # max_j s_ij over allowed keys, 0 where none is finite, [..., 1]
    live: np.ndarray  # whether that max is finite, [..., 1]
    e: np.ndarray  # exp(s_ij - top) at allowed keys, exact 0 elsewhere (no exp evaluated there)
    total: np.ndarray  # sum_j e_ij, [..., 1]
    weights: np.ndarray  # e / total, all zero in rows without allowed keys
    spread: np.ndarray  # |s_ij - top| at allowed keys, 0 elsewhere: the max subtraction's size


def softmax(logits: np.ndarray, allowed: np.ndarray) -> Softmax:
    """``p_ij = exp(s_ij - max_j s_ij) / sum_j exp(s_ij - max_j s_ij)`` over the allowed ``j``."""
    top = np.max(np.where(allowed, logits, -np.inf), axis=-1, keepdims=True)
    live = np.isfinite(top)
    top = np.where(live, top, 0.0)
    e = np.where(allowed, np.exp(np.where(allowed, logits - top, 0.0)), 0.0)
    total = e.sum(axis=-1, keepdims=True)
    weights = e / np.where(total > 0, total, 1.0)
    spread = np.where(allowed, np.abs(logits - top), 0.0)
    return Softmax(top, live, e, total, weights, spread)


class _Problem(NamedTuple):
    """A weight-level problem in float64, as every weight-level bound reads it."""

    w: Params  # read_params
    xq: np.ndarray
    xkv: np.ndarray
    scale: float
    bias: np.ndarray  # the finite part of the logit bias, [..., 1, T_q, T_k] (zeros if none)
    keep: np.ndarray  # mask & (bias != -inf), [..., 1, T_q, T_k]
    dims: tuple[int, int, int, int, int]  # (H, d_model, d_k, d_v, T_k)


def read_weights(params: Any) -> tuple[Params, int]:
    """:func:`read_params` and ``d_k`` (raises on missing or inconsistent parameters)."""
    w = read_params(params)
    return w, head_weights(w)[0].shape[2]


def read_problem(
    w: Params, x_q: Any, x_kv: Any, *, mask: Any, bias: Any, scale: float | None
) -> _Problem:
    """The inputs as float64, the scale, the finite logit bias and the allowed pairs."""
    w_q, _, w_v, _ = head_weights(w)
    h, d_model, d_k = w_q.shape
    xq, xkv = tokens(x_q, x_kv)
    t_q, t_k = xq.shape[-2], xkv.shape[-2]
    full = (*xq.shape[:-2], t_q, t_k)
    s = 1.0 / math.sqrt(d_k) if scale is None else float(scale)
    b_arr = np.zeros(full) if bias is None else np.broadcast_to(np.asarray(bias, np.float64), full)
    m_arr = np.ones(full, bool) if mask is None else np.broadcast_to(np.asarray(mask, bool), full)
    finite_bias = np.where(np.isneginf(b_arr), 0.0, b_arr)[..., None, :, :]
    keep = (m_arr & ~np.isneginf(b_arr))[..., None, :, :]
    return _Problem(w, xq, xkv, s, finite_bias, keep, (h, d_model, d_k, w_v.shape[2], t_k))


def problem_softmax(p: _Problem, q: np.ndarray, k: np.ndarray) -> tuple[np.ndarray, Softmax]:
    """The allowed pairs and the softmax of ``s = scale q k^T + bias``, ``[..., H, T_q, T_k]``."""
    logits = np.einsum("...hqd,...hkd->...hqk", q, k) * p.scale + p.bias
    allowed = np.broadcast_to(p.keep, logits.shape)
    return allowed, softmax(logits, allowed)


def logit_magnitude(p: _Problem) -> np.ndarray:
    """``|scale| |x~_q||W~_Q||W~_K|^T|x~_kv|^T`` ``[..., H, T_q, T_k]`` (``Ls`` less ``|bias|``)."""
    w_q, w_k, _, _ = head_weights(p.w)
    qa, ka = abs_heads(p.xq, w_q, p.w["b_q"]), abs_heads(p.xkv, w_k, p.w["b_k"])
    return abs(p.scale) * np.einsum("...hqd,...hkd->...hqk", qa, ka)


def plain_softmax(p: _Problem) -> tuple[np.ndarray, Softmax]:
    """:func:`problem_softmax` of the projected heads (no RoPE)."""
    w_q, w_k, _, _ = head_weights(p.w)
    q, k = project_heads(p.xq, w_q, p.w["b_q"]), project_heads(p.xkv, w_k, p.w["b_k"])
    return problem_softmax(p, q, k)


# ----------------------------------------------------------------------------- the arithmetic


def _chain_sizes(dims: tuple[int, int, int, int, int]) -> tuple[int, int, int]:
    """``(N_s, N_y, T_k)`` (steps 1 and 3) of ``dims = (H, d_model, d_k, d_v, T_k)``."""
    h, d_model, d_k, d_v, t_k = dims
    return 2 * (d_model + 1) + d_k + 2, t_k + d_model + d_v + h + 2, t_k


def chain_terms(
    dtype: Any, n_s: int, n_y: int, t_k: int, model16: bool = False
) -> tuple[float, float, float, float]:
    """``(g_s, u_sub, g_soft, g_y)``: ``(gamma_{N_s}, u, gamma_{T_k + 2 + 2 C_EXP}, gamma_{N_y})``
    with every operation in ``dtype``'s ``u``, or with ``model16`` for a 16-bit ``dtype`` the
    float32-accumulation model (see the module docstring)."""
    u = unit_roundoff(dtype)
    if model16 and is_16bit(dtype):
        u32 = unit_roundoff(np.float32)
        g_s = K_S * u + gamma(n_s, u32)
        g_soft = 4 * u + gamma(t_k + 2 + 2 * C_EXP, u32)
        g_y = K_Y * u + gamma(t_k, u) + gamma(n_y, u32)
        return g_s, u, g_soft, g_y
    return gamma(n_s, u), u, gamma(t_k + 2 + 2 * C_EXP, u), gamma(n_y, u)


def summed_bound(
    dtype: Any,
    sizes: tuple[int, int, int],
    logit_error: Callable[[float, float], np.ndarray],
    allowed: np.ndarray,
    mixed: np.ndarray,
    b_o: np.ndarray | None = None,
    residual: np.ndarray | None = None,
    model16: bool = False,
) -> Any:
    """Steps 2 and 3 from the logit errors ``err = logit_error(g_s, u) [..., H, T_q, T_k]``,
    summed over ``dtype``'s ``u`` and float64's (:func:`chain_terms` of ``sizes = (N_s, N_y,
    T_k)``): ``sum_h (rho_hi + g_y) mixed_hi + g_y |b_O| (+ u |residual|)``, ``rho_hi = exp(2
    max_j err_hij) - 1 + g_soft`` over allowed keys."""
    bound: Any = 0.0
    for dt in (dtype, np.float64):
        g_s, u, g_soft, g_y = chain_terms(dt, *sizes, model16=model16)
        e_row = np.where(allowed, logit_error(g_s, u), 0.0).max(axis=-1)  # [..., H, T_q]
        with np.errstate(over="ignore"):
            rho = np.expm1(2.0 * e_row) + g_soft
        term = np.einsum("...hq,...hqd->...qd", rho + g_y, mixed)
        bound = bound + (term if b_o is None else term + g_y * np.abs(b_o))
        if residual is not None:
            bound = bound + u * np.abs(residual)
    return bound


# ----------------------------------------------------------------------------- public bounds


@doc(WEIGHT, BOUND_RAISES)
@signed(weight_call, bound_options)
def attention_error_bound(call: dict[str, Any]) -> np.ndarray:
    """Componentwise bound on ``|attention in dtype - float64 oracle|``, ``[..., T_q, d_model]``:
    steps 1 to 3 of the :mod:`attnref.tolerance` docstring summed over ``dtype``'s ``u`` and
    float64's (16-bit: the float32-accumulation model), inputs as the formulation received them.

    Returns:
        The bound, float64 ``[..., T_q, d_model]``, non-negative (``inf`` where the model gives no
        bound).
    """
    params, x_q, x_kv, mask, bias, scale, residual, dtype = call.values()
    w, _ = read_weights(params)
    p = read_problem(w, x_q, x_kv, mask=mask, bias=bias, scale=scale)
    _, _, w_v, w_o = head_weights(w)
    allowed, sm = plain_softmax(p)
    ls = logit_magnitude(p) + np.abs(p.bias)
    mixed = np.einsum("...hqk,...hkd->...hqd", sm.weights, value_magnitude(p.xkv, w))

    def logit_error(g_s: float, u: float) -> np.ndarray:
        return g_s * ls + u * sm.spread

    sizes = _chain_sizes(p.dims)
    bound = summed_bound(dtype, sizes, logit_error, allowed, mixed, w["b_o"], model16=True)
    if residual:
        vo = np.einsum("...hkv,hvd->...hkd", project_heads(p.xkv, w_v, w["b_v"]), w_o)
        y = np.einsum("...hqk,...hkd->...qd", sm.weights, vo)
        bound = bound + unit_roundoff(dtype) * np.abs(p.xq + y)
    return bound


@doc(WEIGHT, BOUND_RAISES)
def attention_local_errors(
    params: Any,
    x_q: Any,
    x_kv: Any = None,
    *,
    mask: Any = None,
    scale: float | None = None,
    dtype: Any = np.float32,
) -> dict[str, Any]:
    """The local error terms of :func:`attention_error_bound` (steps 1 to 3), unpropagated, for
    a caller that propagates them itself (e.g. a float64 Jacobian through a model,
    ``tests/test_bert.py``); each ``dtype``'s share plus float64's; no bias (masking by ``mask``).

    Returns:
        ``{"logits": gamma_{N_s} Ls + u |s - max s|`` ``[..., H, T_q, T_k]`` (0 at masked keys),
        ``"weights": gamma_{T_k + 2 + 2 C_EXP}`` (relative, a float), ``"output": gamma_{N_y}
        (sum_h sum_j p_hij G_hj + |b_O|)`` ``[..., T_q, d_model]}``.
    """
    w, _ = read_weights(params)
    p = read_problem(w, x_q, x_kv, mask=mask, bias=None, scale=scale)
    allowed, sm = plain_softmax(p)
    ls = logit_magnitude(p)
    mixed = np.einsum("...hqk,...hkd->...qd", sm.weights, value_magnitude(p.xkv, w))
    if w["b_o"] is not None:
        mixed = mixed + np.abs(w["b_o"])
    out: dict[str, Any] = {"logits": 0.0, "weights": 0.0, "output": 0.0}
    for dt in (dtype, np.float64):
        g_s, u, g_soft, g_y = chain_terms(dt, *_chain_sizes(p.dims), model16=True)
        out["logits"] = out["logits"] + np.where(allowed, g_s * ls + u * sm.spread, 0.0)
        out["weights"] = out["weights"] + g_soft
        out["output"] = out["output"] + g_y * mixed
    return out


def comparative_bound(
    reference_error: float, magnitude: float, dtype: Any, *, factor: float = 2.0, n: int = 1
) -> float:
    """FlashAttention's rule: allowed error ``= factor * reference_error + gamma_n(u) * magnitude``
    (the ``gamma_n`` floor for a reference that happens to be almost exact).

    Args:
        reference_error: ``max |R - oracle_64|`` of the same-precision reference ``R``.
        magnitude: the output scale ``M`` (e.g. ``max |oracle_64|``).
        dtype: the format, giving ``u``.
        factor: multiplier of the reference's error (FlashAttention: 2).
        n: roundings in the floor ``gamma_n(u) M`` (``K_Y`` for weight-level outputs).

    Returns:
        The allowed max error, a float.

    Raises:
        ValueError: ``dtype`` is not a floating-point dtype.
    """
    return factor * reference_error + gamma(n, unit_roundoff(dtype)) * magnitude
