"""Rotary position embedding bounds: :func:`rope_map_error_bound` for the map and
:func:`rope_attention_error_bound` for attention with it (the angle errors ``e_p(m)`` of the module
docstring of :mod:`attnref.tolerance`). NumPy only, float64; the oracle's ``rope`` (NumPy only) is
imported when a bound is computed.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from attnref.oracle._core import Params, head_weights
from attnref.oracle._doc import WEIGHT, doc, rope_call, rope_map_call, signed

from ._core import (
    BOUND_RAISES,
    abs_heads,
    bound_options,
    problem_softmax,
    project_heads,
    read_problem,
    read_weights,
    summed_bound,
    value_magnitude,
)
from ._rounding import C_TRIG, gamma, unit_roundoff


def rope_angle_error(m_theta: np.ndarray, u: float, base: float) -> np.ndarray:
    """``e_p(m) = (gamma_2 + (|ln base| + 3) u64) |m| theta_p + C_TRIG u`` for ``m_theta =
    |m| theta_p``: the error of the computed ``cos``/``sin`` of ``m theta_p`` (module docstring)."""
    u64 = unit_roundoff(np.float64)
    return (gamma(2, u) + (abs(math.log(base)) + 3) * u64) * m_theta + C_TRIG * u


def _rope_planes(a: np.ndarray, convention: str) -> np.ndarray:
    """Per-plane pair sums ``a_i + a_j`` of the last axis: ``[..., d/2]`` (plane ``p`` order)."""
    h = a.shape[-1] // 2
    return a[..., :h] + a[..., h:] if convention == "rotate_half" else a[..., 0::2] + a[..., 1::2]


def rope_spread(per_plane: np.ndarray, convention: str) -> np.ndarray:
    """``[..., d/2] -> [..., d]``: each plane's value on both members of its pair."""
    if convention == "rotate_half":
        return np.concatenate([per_plane, per_plane], axis=-1)
    return np.repeat(per_plane, 2, axis=-1)


def pair_sum(a: np.ndarray, convention: str) -> np.ndarray:
    """``a J``: each component replaced by the sum over its RoPE pair."""
    return rope_spread(_rope_planes(a, convention), convention)


def rope_theta(d: int, base: float) -> np.ndarray:
    """``theta_p = base^(-2p/d)``, ``[d/2]``, in float64."""
    return np.power(float(base), -2.0 * np.arange(d // 2) / d)


def rotated_heads(
    x: np.ndarray, w: Params, name: str, pos: np.ndarray | None, base: float, convention: str
) -> np.ndarray:
    """``R(x W[h] + b[h])`` per head, ``[..., H, T, d]``, by the float64 oracle's RoPE (no
    rotation when ``pos`` is ``None``)."""
    from attnref.oracle import rope

    wt = w["w_" + name]
    assert wt is not None
    y = project_heads(x, wt, w["b_" + name], "the")
    return np.swapaxes(y if pos is None else rope(y, pos, base=base, convention=convention), -2, -3)


def check_rope(convention: str, d: int) -> None:
    if convention not in ("rotate_half", "interleaved"):
        raise ValueError(
            f"unknown RoPE convention {convention!r}; expected 'rotate_half' or 'interleaved'"
        )
    if d < 2 or d % 2:
        raise ValueError(f"RoPE needs a positive even head dimension, got {d}")


def rope_logit_error(
    qa: np.ndarray, ka: np.ndarray, pos_q: Any, pos_k: Any, convention: str, u: float, base: float
) -> np.ndarray:
    """``sum_p (e_p(m_i) + e_p(n_j)) 2 QP_ip KP_jp``, ``[..., H, T_q, T_k]``, from the magnitudes
    ``qa``, ``ka`` (``|x~||W~|``, ``[..., H, T, d]``)."""
    theta = rope_theta(qa.shape[-1], base)
    lead_q, lead_k = qa.shape[:-3] + qa.shape[-2:-1], ka.shape[:-3] + ka.shape[-2:-1]
    mq = np.abs(np.broadcast_to(pos_q, lead_q).astype(np.float64))[..., None, :, None]
    mk = np.abs(np.broadcast_to(pos_k, lead_k).astype(np.float64))[..., None, :, None]
    qp, kp = _rope_planes(qa, convention), _rope_planes(ka, convention)
    eq = rope_angle_error(mq * theta, u, base)  # [..., 1, T_q, d/2]
    ek = rope_angle_error(mk * theta, u, base)
    return 2 * (
        np.einsum("...qp,...kp->...qk", eq * qp, kp) + np.einsum("...qp,...kp->...qk", qp, ek * kp)
    )


@doc(
    WEIGHT,
    x="``[..., T, N, d]``, the layout of ``attnref.rope.apply_rope``, ``d`` even.",
    positions="Integer positions ``[..., T]`` or ``[T]``.",
)
@signed(rope_map_call)
def rope_map_error_bound(call: dict[str, Any], *, dtype: Any = np.float32) -> np.ndarray:
    """Componentwise bound on ``|rope(x) in dtype - float64 oracle|`` for ``x [..., T, N, d]``.

    ``(|a| + |b|) (e_p(m) + gamma_2)`` per rotated component of a pair ``(a, b)`` (module
    docstring), summed over ``dtype``'s ``u`` and float64's.

    Returns:
        The bound, float64, the shape of ``x``.

    Raises:
        ValueError: ``x`` has fewer than 3 axes, ``d`` is odd, or the convention is unknown.
    """
    x, positions, base, convention = call.values()
    xs = np.asarray(x, np.float64)
    if xs.ndim < 3:
        raise ValueError(f"x must have shape [..., T, N, d], got {xs.shape}")
    check_rope(convention, xs.shape[-1])
    pos = np.abs(np.broadcast_to(positions, xs.shape[:-2]).astype(np.float64))[..., None, None]
    mag = pair_sum(np.abs(xs), convention)
    m_theta = pos * rope_spread(rope_theta(xs.shape[-1], base), convention)
    total = np.zeros_like(xs)
    for dt in (dtype, np.float64):
        u = unit_roundoff(dt)
        total = total + mag * (rope_angle_error(m_theta, u, base) + gamma(2, u))
    return total


@doc(WEIGHT, BOUND_RAISES)
@signed(rope_call, bound_options)
def rope_attention_error_bound(call: dict[str, Any]) -> np.ndarray:
    """Componentwise bound on ``|RoPE attention in dtype - float64 oracle|``, ``[..., T_q,
    d_model]``, for every RoPE formulation: :func:`attention_error_bound` with the RoPE logit
    error of the :mod:`attnref.tolerance` docstring, plus the oracle's own error (16-bit: the
    worst-case expression in their ``u``, loose).

    Returns:
        The bound, float64 ``[..., T_q, d_model]``, non-negative (``inf`` where the model gives no
        bound).
    """
    residual, dtype = call.pop("residual"), call.pop("dtype")
    params, x_q, x_kv, positions_q, positions_kv, mask, bias, scale, base, convention = (
        call.values()
    )
    w, d_k = read_weights(params)
    check_rope(convention, d_k)
    p = read_problem(w, x_q, x_kv, mask=mask, bias=bias, scale=scale)
    w_q, w_k, w_v, w_o = head_weights(w)
    h, d_model, _, d_v, t_k = p.dims
    xq, xkv, s = p.xq, p.xkv, p.scale
    pos_q = np.arange(xq.shape[-2]) if positions_q is None else np.asarray(positions_q)
    pos_k = np.arange(t_k) if positions_kv is None else np.asarray(positions_kv)
    allowed, sm = problem_softmax(
        p,
        rotated_heads(xq, w, "q", pos_q, base, convention),
        rotated_heads(xkv, w, "k", pos_k, base, convention),
    )
    qa, ka = abs_heads(xq, w_q, w["b_q"]), abs_heads(xkv, w_k, w["b_k"])
    qj, kj = pair_sum(qa, convention), pair_sum(ka, convention)
    ls = abs(s) * np.einsum("...hqd,...hkd->...hqk", qj, kj) + np.abs(p.bias)
    mixed = np.einsum("...hqk,...hkd->...hqd", sm.weights, value_magnitude(xkv, w))
    resid = None
    if residual:  # one more rounding: x_q + y
        values = np.swapaxes(project_heads(xkv, w_v, w["b_v"], "the"), -2, -3)  # [..., H, T_k, d_v]
        y_exact = np.einsum("...hqk,...hkv,hvd->...qd", sm.weights, values, w_o)
        resid = xq + (y_exact if w["b_o"] is None else y_exact + w["b_o"])

    def logit_error(g_s: float, u: float) -> np.ndarray:
        angles = abs(s) * rope_logit_error(qa, ka, pos_q, pos_k, convention, u, base)
        return g_s * ls + angles + u * sm.spread

    sizes = (2 * (d_model + 3) + 2 * d_k + 2, t_k + d_model + d_v + h + 2, t_k)
    # 16-bit formats too: every operation in their own u
    return summed_bound(dtype, sizes, logit_error, allowed, mixed, w["b_o"], resid)
