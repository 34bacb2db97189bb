"""Oracle for rotary position embedding (RoPE; Su et al. 2024), NumPy only, float64.

For an even head dimension ``d``, pair ``p = 0 .. d/2 - 1``, ``theta_p = base ** (-2 p / d)``, a
token at integer position ``m`` has its pair ``(a, b)`` replaced by::

    a' = a cos(m theta_p) - b sin(m theta_p)
    b' = a sin(m theta_p) + b cos(m theta_p)

the pair being ``(x[p], x[p + d/2])`` (``"rotate_half"``: GPT-NeoX, Hugging Face Llama) or
``(x[2p], x[2p + 1])`` (``"interleaved"``: RoFormer, GPT-J, Meta Llama). Attention with RoPE is
:mod:`attnref.oracle._core`'s with ``q = rope(x_q W_Q[n] + b_Q[n], pos_q)`` and ``k_j =
rope(x_kv[j] W_K[g] + b_K[g], pos_kv[j])``, ``g = n // (H / K)``.

``method="definition"`` rotates one vector (and pair) at a time; ``"fast"`` rotates whole arrays
from ``cos``/``sin`` tables and runs the query-block path of :mod:`attnref.oracle._core`.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ._checks import (
    broadcasts,
    check_method,
    check_real_scalar,
    dtype_of,
    is_floating,
    is_integer,
    shape_of,
)
from ._core import (
    Fast,
    Rotation,
    Turn,
    definition_output,
    fast_output,
    fast_problem,
    head_weights,
    per_head_per_query,
)
from ._doc import (
    WEIGHT,
    WEIGHT_RAISES,
    block_options,
    doc,
    method_option,
    rope_call,
    rope_map_call,
    signed,
)

CONVENTIONS = ("rotate_half", "interleaved")


# ----------------------------------------------------------------------------- checks


def check_convention(convention: Any) -> str:
    """One of :data:`CONVENTIONS` (JAX and oracle alike)."""
    if not isinstance(convention, str) or convention not in CONVENTIONS:
        raise ValueError(
            f"unknown RoPE convention {convention!r}; expected one of {CONVENTIONS} "
            "('rotate_half': pairs (x_p, x_{p+d/2}); 'interleaved': pairs (x_2p, x_2p+1))"
        )
    return convention


def check_even_head_dim(d: int, name: str) -> None:
    """RoPE rotates pairs of features: ``d`` must be a positive even integer."""
    if d < 2 or d % 2:
        raise ValueError(f"RoPE needs an even head dimension, got {name} = {d}")


def check_base(base: Any) -> float:
    """A positive finite real ``base`` (``TypeError`` when it is not a number)."""
    try:
        b = check_real_scalar("base", base)
    except ValueError as err:
        raise TypeError(f"base must be a static Python number, got {base!r}") from err
    if not (math.isfinite(b) and b > 0.0):
        raise ValueError(f"base must be a positive finite number, got {base!r}")
    return b


def check_positions(name: str, positions: Any, lead: tuple[int, ...], t: int) -> np.ndarray:
    """Integer positions broadcasting to ``lead + (t,)`` without growing it; returns them
    broadcast (int64)."""
    dt = dtype_of(positions)
    if not is_integer(dt):
        raise TypeError(f"{name} must be integer, got dtype {dt}")
    shape = shape_of(positions)
    target = (*lead, t)
    if not (len(shape) >= 1 and shape[-1] == t and broadcasts(shape, target)):
        raise ValueError(f"{name} of shape {shape} does not broadcast to {target}")
    return np.broadcast_to(np.asarray(positions).astype(np.int64), target)


def rotate_vector(v: np.ndarray, m: int, base: float, convention: str) -> np.ndarray:
    """RoPE of one vector ``v [d]`` at position ``m``, pair by pair."""
    d = v.shape[0]
    out = np.empty(d)
    for p, (i, j) in enumerate(zip(*_pair_index(d, convention), strict=True)):
        angle = float(m) * base ** (-2.0 * p / d)
        c, s = math.cos(angle), math.sin(angle)
        out[i] = v[i] * c - v[j] * s
        out[j] = v[i] * s + v[j] * c
    return out


def turn(base: float, convention: str) -> Turn:
    """RoPE of one vector at an integer position (the definition path's rotation)."""
    return lambda v, m: rotate_vector(v, m, float(base), convention)


def read_positions(positions: Any, lead: tuple[int, ...], t: int, name: str) -> np.ndarray:
    """Integer positions broadcast to ``lead + (t,)``; ``None`` is ``arange(t)``."""
    if positions is None:
        return np.broadcast_to(np.arange(t), (*lead, t))
    return check_positions(name, positions, lead, t)


# ----------------------------------------------------------------------------- the fast path


def _pair_index(d: int, convention: str) -> tuple[np.ndarray, np.ndarray]:
    """The members ``(i_p, j_p)`` of every pair ``p`` as two index arrays ``[d/2]``."""
    p = np.arange(d // 2)
    return (p, p + d // 2) if convention == "rotate_half" else (2 * p, 2 * p + 1)


def _angles(positions: np.ndarray, d: int, base: float) -> np.ndarray:
    """``m theta_p``, ``theta_p = base ** (-2 p / d)``: ``positions [...]`` -> ``[..., d/2]``."""
    theta = np.power(float(base), -2.0 * np.arange(d // 2) / d)
    return np.asarray(positions, dtype=np.float64)[..., None] * theta


def _rotate(x: np.ndarray, angles: np.ndarray, convention: str) -> np.ndarray:
    """Every pair ``(a, b)`` of the last axis of ``x [..., d]`` turned by its angle:
    ``(a cos - b sin, a sin + b cos)``, with ``angles`` broadcasting to ``[..., d/2]``."""
    i, j = _pair_index(x.shape[-1], convention)
    c, s = np.cos(angles), np.sin(angles)
    a, b = x[..., i], x[..., j]
    out = np.empty(np.broadcast_shapes(x.shape, (*c.shape[:-1], x.shape[-1])))
    out[..., i] = a * c - b * s
    out[..., j] = a * s + b * c
    return out


def rotation(positions: np.ndarray, base: float, convention: str, sign: float = 1.0) -> Rotation:
    """The fast path's rotation of vectors ``[H, n, d]`` at ``positions[idx][rows]`` by ``sign m
    theta_p`` (``sign = -1``: ``R(m)^T = R(-m)``)."""

    def turn(idx: tuple[int, ...], rows: slice, v: np.ndarray) -> np.ndarray:
        angles = _angles(positions[idx][rows], v.shape[-1], base)
        return _rotate(v, -angles if sign < 0 else angles, convention)

    return turn


def rope_inputs(call: dict[str, Any]) -> tuple[Fast, np.ndarray, np.ndarray]:
    """The checks of :func:`rope_attention` (same order, same errors) and the problem for the
    fast path, with the positions broadcast to ``[*batch, T_q]`` and ``[*batch, T_k]``."""
    check_convention(call["convention"])
    check_base(call["base"])
    p = fast_problem(*(call[n] for n in ("params", "x_q", "x_kv", "mask", "bias", "scale")))
    check_even_head_dim(head_weights(p.w)[0].shape[2], "d_k (params.w_q.shape[2])")
    pq = read_positions(call["positions_q"], p.batch, p.xq.shape[-2], "positions_q")
    pk = read_positions(call["positions_kv"], p.batch, p.xkv.shape[-2], "positions_kv")
    return p, pq, pk


@doc(
    WEIGHT,
    x="``[..., T, N, d]`` (tokens, heads, head dim), floating, ``d`` even.",
    positions="Integer positions ``[..., T]`` or ``[T]``.",
)
@signed(rope_map_call, method_option)
def rope(call: dict[str, Any]) -> np.ndarray:
    """RoPE of ``x [..., T, N, d]`` at integer ``positions``, float64, with the refusals of
    :func:`attnref.rope.apply_rope`.

    Returns:
        The rotated ``x`` in float64, same shape.

    Raises:
        ValueError: If ``x`` has rank < 3 or an odd ``d``, ``positions`` do not broadcast to
            ``[..., T]``, ``base`` is not positive and finite, ``convention`` or ``method`` is
            unknown.
        TypeError: If ``x`` is not floating, ``positions`` are not integers, or ``base`` is not
            a Python number.
    """
    method = check_method(call.pop("method"))
    x, positions, base, convention = call.values()
    check_convention(convention)
    shape = shape_of(x)
    if len(shape) < 3:
        raise ValueError(f"x must have shape [..., T, N, d] (rank >= 3), got {shape}")
    if not is_floating(dtype_of(x)):
        raise TypeError(f"x must be floating, got dtype {dtype_of(x)}")
    check_even_head_dim(shape[-1], "head_dim (x.shape[-1])")
    *lead, t, n_heads, _ = shape
    pos = check_positions("positions", positions, tuple(lead), t)
    check_base(base)
    xs = np.asarray(x, dtype=np.float64)
    if method == "fast":
        return _rotate(xs, _angles(pos[..., None], shape[-1], base), convention)
    out = np.empty_like(xs)
    for idx in np.ndindex(*lead, t):
        for n in range(n_heads):
            out[idx][n] = rotate_vector(xs[idx][n], int(pos[idx]), float(base), convention)
    return out


@doc(WEIGHT, WEIGHT_RAISES)
@signed(rope_call, block_options)
def rope_attention(call: dict[str, Any]) -> np.ndarray:
    """Multi-head attention with RoPE, ``[..., T_q, d_model]``, float64 (module docstring), with
    the refusals of :func:`attnref.rope.rope_attention`.

    Returns:
        float64 block output ``[..., T_q, d_model]``.
    """
    residual, method = call.pop("residual"), call.pop("method")
    fast = check_method(method) == "fast"
    prob, pq, pk = rope_inputs(call)
    base, convention = call["base"], call["convention"]
    if fast:
        return fast_output(
            prob,
            rotate_q=rotation(pq, base, convention),
            rotate_k=rotation(pk, base, convention),
            residual=residual,
        )
    outs = per_head_per_query(prob, turn=turn(base, convention), pos=(pq, pk))[1]
    return definition_output(prob, outs, residual)
