"""Oracle for rotary position embedding (RoPE; Su et al. 2021), NumPy only, float64.

Written from the equations, independently of :mod:`attnref._src.rope` (no JAX is imported). For
an even head dimension ``d`` and pair ``p = 0 .. d/2 - 1`` with frequency
``theta_p = base ** (-2 p / d)``, a token at integer position ``m`` has its pair ``(a, b)``
replaced by::

    a' = a cos(m theta_p) - b sin(m theta_p)
    b' = a sin(m theta_p) + b cos(m theta_p)

where the pair is ``(x[p], x[p + d/2])`` for ``convention="rotate_half"`` (GPT-NeoX, Hugging Face
Llama) and ``(x[2p], x[2p + 1])`` for ``"interleaved"`` (RoFormer, GPT-J, Meta Llama).

Attention with RoPE, for batch index ``b``, head ``n`` and query ``t`` (row convention)::

    g   = n // (H / K)                      (K key/value heads shared by groups of query heads)
    q   = rope(x_q[b, t] W_Q[n] + b_Q[n], pos_q[b, t])
    k_j = rope(x_kv[b, j] W_K[g] + b_K[g], pos_kv[b, j])
    s_j = (q . k_j) * scale + bias[b, t, j]                 for allowed keys j
    p_j = exp(s_j - max s) / sum exp(s - max s)             (all zero if no key is allowed)
    y[b, t] += sum_j p_j (x_kv[b, j] W_V[g] + b_V[g]) W_O[n];   y[b, t] += b_O once
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ._checks import (
    check_base,
    check_convention,
    check_even_head_dim,
    check_positions,
    check_weight_level,
    dtype_of,
    is_floating,
    shape_of,
)
from ._core import _softmax_row, _unpack

__all__ = ["rope", "rope_attention"]


def _pairs(d: int, convention: str) -> list[tuple[int, int]]:
    if convention == "rotate_half":
        return [(p, p + d // 2) for p in range(d // 2)]
    return [(2 * p, 2 * p + 1) for p in range(d // 2)]


def _rotate_vector(v: np.ndarray, m: int, base: float, convention: str) -> np.ndarray:
    """RoPE of one vector ``v [d]`` at position ``m``, pair by pair."""
    d = v.shape[0]
    out = np.empty(d)
    for p, (i, j) in enumerate(_pairs(d, convention)):
        angle = float(m) * base ** (-2.0 * p / d)
        c, s = math.cos(angle), math.sin(angle)
        out[i] = v[i] * c - v[j] * s
        out[j] = v[i] * s + v[j] * c
    return out


def _positions(positions: Any, lead: tuple[int, ...], t: int, name: str) -> np.ndarray:
    """Integer positions broadcast to ``lead + (t,)``; ``None`` is ``arange(t)``."""
    if positions is None:
        return np.broadcast_to(np.arange(t), (*lead, t))
    return check_positions(name, positions, lead, t)


def rope(
    x: Any,
    positions: Any,
    *,
    base: float = 10000.0,
    convention: str = "rotate_half",
) -> np.ndarray:
    """RoPE of ``x [..., T, N, d]`` (tokens, heads, head dim) at integer ``positions [..., T]``
    (or ``[T]``), in float64, one vector at a time. Refuses what :func:`attnref.rope.apply_rope`
    refuses (same exception types).

    Args:
        x: ``[..., T, N, d]``, floating, ``d`` even.
        positions: Integer positions ``[..., T]`` or ``[T]``.
        base: The frequency base (default 10000), a positive finite Python number.
        convention: ``"rotate_half"`` (default) or ``"interleaved"``.

    Returns:
        The rotated ``x`` in float64, same shape.

    Raises:
        ValueError: If ``x`` has rank < 3 or an odd ``d``, ``positions`` do not broadcast to
            ``[..., T]``, ``base`` is not positive and finite, or ``convention`` is unknown.
        TypeError: If ``x`` is not floating, ``positions`` are not integers, or ``base`` is not
            a Python number.
    """
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
    out = np.empty_like(xs)
    for idx in np.ndindex(*lead, t):
        for n in range(n_heads):
            out[idx][n] = _rotate_vector(xs[idx][n], int(pos[idx]), float(base), convention)
    return out


def rope_attention(
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
) -> np.ndarray:
    """Multi-head attention with RoPE, ``[..., T_q, d_model]`` in float64 (see the module
    docstring); default positions ``arange(T_q)`` / ``arange(T_k)``; fully masked query rows
    give ``b_O``.

    Args:
        params: Per-head weights (:class:`attnref.AttentionParams` or a dict with its keys),
            ``d_k`` even.
        x_q: Query tokens ``[..., T_q, d_model]``, the dtype of ``params``.
        x_kv: Key/value tokens ``[..., T_k, d_model]``; ``None`` (default) means ``x_q``.
        positions_q: Integer ``[..., T_q]`` or ``[T_q]``; ``None`` (default): ``arange(T_q)``.
        positions_kv: Integer ``[..., T_k]`` or ``[T_k]``; ``None`` (default): ``arange(T_k)``.
        mask: Boolean, broadcastable to ``[..., T_q, T_k]``, ``True`` = may attend; ``None``
            (default) allows every pair.
        bias: Floating, broadcastable to ``[..., T_q, T_k]``, added to the scaled logits;
            ``None`` (default).
        scale: The logit scale; ``None`` (default) means ``1/sqrt(d_k)``.
        base: The frequency base (default 10000), a positive finite Python number.
        convention: ``"rotate_half"`` (default) or ``"interleaved"``.
        residual: If ``True``, return ``x_q + y`` (default ``False``).

    Returns:
        float64 block output ``[..., T_q, d_model]``.

    Raises:
        ValueError: For what :func:`attnref.rope.rope_attention` refuses with ``ValueError``
            (malformed params, odd ``d_k``, token, mask, bias or position shapes, ``base``,
            ``convention``).
        TypeError: For what it refuses with ``TypeError`` (mixed dtypes, non-boolean mask,
            non-integer positions, a non-number ``base``).
    """
    # Refuses what attnref.rope.rope_attention refuses, with the same exception types.
    check_convention(convention)
    check_base(base)
    batch, t_q, t_k, m, b, sc = check_weight_level(params, x_q, x_kv, mask, bias, scale)
    w = _unpack(params)
    w_q, w_k, w_v, w_o = w["w_q"], w["w_k"], w["w_v"], w["w_o"]
    assert w_q is not None and w_k is not None and w_v is not None and w_o is not None
    xq = np.asarray(x_q, dtype=np.float64)
    xkv = xq if x_kv is None else np.asarray(x_kv, dtype=np.float64)
    n_heads, d_model, d_k = w_q.shape
    check_even_head_dim(d_k, "d_k (params.w_q.shape[2])")
    kv_k, kv_v = w_k.shape[0], w_v.shape[0]
    pq = _positions(positions_q, batch, t_q, "positions_q")
    pk = _positions(positions_kv, batch, t_k, "positions_kv")
    s = 1.0 / math.sqrt(d_k) if sc is None else sc

    def head(name: str, i: int) -> tuple[np.ndarray, Any]:
        wt, bt = w["w_" + name], w["b_" + name]
        assert wt is not None
        return wt[i], (0.0 if bt is None else bt[i])

    y = np.zeros((*batch, t_q, d_model))
    for idx in np.ndindex(*batch):
        for n in range(n_heads):
            wk, bk = head("k", n // (n_heads // kv_k))
            wv, bv = head("v", n // (n_heads // kv_v))
            wq, bq = head("q", n)
            keys = [
                _rotate_vector(xkv[idx][j] @ wk + bk, int(pk[idx][j]), float(base), convention)
                for j in range(t_k)
            ]
            values = xkv[idx] @ wv + bv
            for t in range(t_q):
                q = _rotate_vector(xq[idx][t] @ wq + bq, int(pq[idx][t]), float(base), convention)
                scores = np.array([q @ keys[j] for j in range(t_k)]) * s
                allowed = np.ones(t_k, dtype=bool)
                if b is not None:
                    scores = scores + b[idx][t]
                    allowed &= b[idx][t] != -np.inf
                if m is not None:
                    allowed &= m[idx][t]
                p = _softmax_row(scores, allowed, lambda a: a)
                z = sum(
                    (p[j] * values[j] for j in range(t_k) if p[j] != 0.0), np.zeros(wv.shape[1])
                )
                y[idx][t] += z @ w_o[n]
    if w["b_o"] is not None:
        y = y + w["b_o"]
    if residual:
        y = y + xq
    return y
