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

from ._core import _broadcast, _softmax_row, _unpack

__all__ = ["rope", "rope_attention"]

_CONVENTIONS = ("rotate_half", "interleaved")


def _check(convention: str, d: int) -> None:
    if convention not in _CONVENTIONS:
        raise ValueError(f"unknown RoPE convention {convention!r}; expected one of {_CONVENTIONS}")
    if d % 2:
        raise ValueError(f"RoPE needs an even head dimension, got {d}")


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
    if positions is None:
        return np.broadcast_to(np.arange(t), (*lead, t))
    pos = np.asarray(positions)
    if not np.issubdtype(pos.dtype, np.integer):
        raise TypeError(f"{name} must be integer, got dtype {pos.dtype}")
    target = (*lead, t)
    try:
        ok = (
            pos.ndim >= 1
            and pos.shape[-1] == t
            and np.broadcast_shapes(pos.shape, target) == target
        )
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"{name} of shape {pos.shape} does not broadcast to {target}")
    return np.broadcast_to(pos, (*lead, t))


def rope(
    x: Any,
    positions: Any,
    *,
    base: float = 10000.0,
    convention: str = "rotate_half",
) -> np.ndarray:
    """RoPE of ``x [..., T, N, d]`` (tokens, heads, head dim) at integer ``positions [..., T]``
    (or ``[T]``), in float64, one vector at a time."""
    xs = np.asarray(x, dtype=np.float64)
    if xs.ndim < 3:
        raise ValueError(f"x must have shape [..., T, N, d], got {xs.shape}")
    _check(convention, xs.shape[-1])
    *lead, t, n_heads, _ = xs.shape
    pos = _positions(positions, tuple(lead), t, "positions")
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
    give ``b_O``."""
    w = _unpack(params)
    w_q, w_k, w_v, w_o = w["w_q"], w["w_k"], w["w_v"], w["w_o"]
    assert w_q is not None and w_k is not None and w_v is not None and w_o is not None
    xq = np.asarray(x_q, dtype=np.float64)
    xkv = xq if x_kv is None else np.asarray(x_kv, dtype=np.float64)
    n_heads, d_model, d_k = w_q.shape
    _check(convention, d_k)
    kv_k, kv_v = w_k.shape[0], w_v.shape[0]
    if n_heads % kv_k or n_heads % kv_v:
        raise ValueError(f"{kv_k} key / {kv_v} value heads must divide {n_heads} query heads")
    batch = xq.shape[:-2]
    t_q, t_k = xq.shape[-2], xkv.shape[-2]
    if xq.shape[-1] != d_model or xkv.shape[-1] != d_model or xkv.shape[:-2] != batch:
        raise ValueError(f"x_q {xq.shape} / x_kv {xkv.shape} do not match d_model={d_model}")
    pq = _positions(positions_q, batch, t_q, "positions_q")
    pk = _positions(positions_kv, batch, t_k, "positions_kv")
    s = 1.0 / math.sqrt(d_k) if scale is None else float(scale)
    full = (*batch, t_q, t_k)
    m = _broadcast(mask, full, bool)
    b = _broadcast(bias, full, np.float64)

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
