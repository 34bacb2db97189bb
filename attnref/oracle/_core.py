"""Oracle core: multi-head attention from its definition, per head and per query.

This module imports NumPy only (never JAX) and shares no code with the JAX formulations, so that
agreement between the two is evidence, not tautology. Everything is computed in float64.

For batch index ``b``, query head ``i`` and query ``t`` (row convention, Vaswani et al. 2017),
with ``g = i // G`` the key/value head of query head ``i``::

    q   = x_q[b, t] W_Q[i] + b_Q[i]
    s_j = (q . (x_kv[b, j] W_K[g] + b_K[g])) * scale + bias[b, t, j]   for allowed keys j
    p_j = exp(s_j - max_j s_j) / sum_j exp(s_j - max_j s_j)             (0 if no key is allowed)
    y[b, t] += sum_j p_j (x_kv[b, j] W_V[g] + b_V[g]) W_O[i]
    y[b, t] += b_O   (once)

``W_Q [H, d_model, d_k]`` and ``W_O [H, d_v, d_model]`` have one entry per query head;
``W_K [K, d_model, d_k]`` and ``W_V [K, d_model, d_v]`` (and ``b_K``, ``b_V``) one per key/value
head, ``H = K G``: consecutive query heads share a key/value head (grouped-query attention,
Ainslie et al. 2023; ``K = 1`` is multi-query attention, Shazeer 2019; ``K = H`` multi-head).

``scale`` defaults to ``1/sqrt(d_k)``. A key is allowed when ``mask`` is True and ``bias`` is not
``-inf``. A query with no allowed key contributes nothing from any head (its output is ``b_O``).

``emulate=dtype`` turns the oracle into a *same-precision reference*: every intermediate above is
rounded to ``dtype`` (arithmetic between roundings in float64), which is how a straightforward
implementation in that format behaves, with its own operation order. It is what the comparative
tolerance rule for 16-bit formats measures against (see :mod:`attnref.tolerance`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = [
    "attention",
    "attention_weights",
    "features",
    "head_outputs",
    "linear_attention",
    "linear_multihead",
]

_FIELDS = ("w_q", "w_k", "w_v", "w_o", "b_q", "b_k", "b_v", "b_o")


def _get(params: Any, name: str) -> np.ndarray | None:
    value = params.get(name) if isinstance(params, dict) else getattr(params, name, None)
    return None if value is None else np.asarray(value, dtype=np.float64)


def _unpack(params: Any) -> dict[str, np.ndarray | None]:
    out = {name: _get(params, name) for name in _FIELDS}
    for name in ("w_q", "w_k", "w_v", "w_o"):
        if out[name] is None:
            raise ValueError(f"params.{name} is required")
    return out


def _group_size(w: dict[str, np.ndarray | None]) -> int:
    """``G = H / K`` from ``w_q [H, ...]`` and ``w_k, w_v [K, ...]``; query head i reads i // G."""
    w_q, w_k, w_v = w["w_q"], w["w_k"], w["w_v"]
    assert w_q is not None and w_k is not None and w_v is not None
    n_heads, n_kv = w_q.shape[0], w_k.shape[0]
    if n_kv < 1 or n_heads % n_kv or w_v.shape[0] != n_kv:
        raise ValueError(
            f"params.w_q has {n_heads} heads, params.w_k {n_kv} and params.w_v {w_v.shape[0]}; "
            "w_k and w_v need the same number of heads, and num_heads must be a multiple of it"
        )
    return n_heads // n_kv


def _broadcast(arr: Any, shape: tuple[int, ...], dtype: Any) -> np.ndarray | None:
    if arr is None:
        return None
    a = np.asarray(arr)
    if np.broadcast_shapes(a.shape, shape) != shape:
        raise ValueError(f"mask/bias of shape {a.shape} does not broadcast to {shape}")
    return np.broadcast_to(a.astype(dtype), shape)


def _rounder(emulate: Any) -> Any:
    if emulate is None or np.dtype(emulate) == np.float64:
        return lambda a: a
    return lambda a: np.asarray(a).astype(emulate).astype(np.float64)


def _softmax_row(scores: np.ndarray, allowed: np.ndarray, rd: Any) -> np.ndarray:
    """Max-subtracted softmax over the allowed entries of one query row; zeros if none."""
    p = np.zeros_like(scores)
    if not allowed.any():
        return p
    top = np.max(scores[allowed])
    e = rd(np.exp(rd(scores[allowed] - top)))
    p[allowed] = rd(e / rd(np.sum(e)))
    return p


def _per_head_per_query(
    params: Any,
    x_q: Any,
    x_kv: Any,
    mask: Any,
    bias: Any,
    scale: float | None,
    emulate: Any = None,
) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray | None]]:
    """Return weights ``[..., H, T_q, T_k]`` and per-head outputs ``[..., H, T_q, d_model]``."""
    rd = _rounder(emulate)
    w = _unpack(params)
    group = _group_size(w)
    xq = np.asarray(x_q, dtype=np.float64)
    xkv = xq if x_kv is None else np.asarray(x_kv, dtype=np.float64)
    w_q, w_k, w_v, w_o = w["w_q"], w["w_k"], w["w_v"], w["w_o"]
    assert w_q is not None and w_k is not None and w_v is not None and w_o is not None
    n_heads, d_model, d_k = w_q.shape
    batch = xq.shape[:-2]
    t_q, t_k = xq.shape[-2], xkv.shape[-2]
    if xq.shape[-1] != d_model or xkv.shape[-1] != d_model or xkv.shape[:-2] != batch:
        raise ValueError(f"x_q {xq.shape} / x_kv {xkv.shape} do not match d_model={d_model}")
    s = 1.0 / math.sqrt(d_k) if scale is None else float(scale)
    full = (*batch, t_q, t_k)
    m = _broadcast(mask, full, bool)
    b = _broadcast(bias, full, np.float64)

    weights = np.zeros((*batch, n_heads, t_q, t_k))
    outs = np.zeros((*batch, n_heads, t_q, d_model))
    for idx in np.ndindex(*batch):
        for i in range(n_heads):
            g = i // group  # the key/value head that query head i reads
            keys = rd(rd(xkv[idx] @ w_k[g]) + (0.0 if w["b_k"] is None else w["b_k"][g]))
            values = rd(rd(xkv[idx] @ w_v[g]) + (0.0 if w["b_v"] is None else w["b_v"][g]))
            for t in range(t_q):
                q = rd(rd(xq[idx][t] @ w_q[i]) + (0.0 if w["b_q"] is None else w["b_q"][i]))
                scores = rd(rd(np.array([q @ keys[j] for j in range(t_k)])) * rd(s))
                allowed = np.ones(t_k, dtype=bool)
                if b is not None:
                    scores = rd(scores + b[idx][t])
                    allowed &= b[idx][t] != -np.inf
                if m is not None:
                    allowed &= m[idx][t]
                p = _softmax_row(scores, allowed, rd)
                weights[idx][i, t] = p
                z = np.zeros(values.shape[-1])
                for j in range(t_k):
                    if p[j] != 0.0:
                        z = rd(z + rd(p[j] * values[j]))
                outs[idx][i, t] = rd(z @ w_o[i])
    return weights, outs, w


def attention_weights(
    params: Any,
    x_q: Any,
    x_kv: Any = None,
    *,
    mask: Any = None,
    bias: Any = None,
    scale: float | None = None,
) -> np.ndarray:
    """Row-stochastic attention weights ``[..., H, T_q, T_k]`` (zero rows where fully masked)."""
    return _per_head_per_query(params, x_q, x_kv, mask, bias, scale)[0]


def head_outputs(
    params: Any,
    x_q: Any,
    x_kv: Any = None,
    *,
    mask: Any = None,
    bias: Any = None,
    scale: float | None = None,
) -> np.ndarray:
    """Per-head outputs in model space ``[..., H, T_q, d_model]`` (without ``b_O``)."""
    return _per_head_per_query(params, x_q, x_kv, mask, bias, scale)[1]


def attention(
    params: Any,
    x_q: Any,
    x_kv: Any = None,
    *,
    mask: Any = None,
    bias: Any = None,
    scale: float | None = None,
    residual: bool = False,
    emulate: Any = None,
) -> np.ndarray:
    """Multi-head attention output ``[..., T_q, d_model]`` in float64 (``x_q +`` it if residual).

    ``emulate``: round every intermediate to this dtype (a same-precision reference).
    """
    rd = _rounder(emulate)
    _, outs, w = _per_head_per_query(params, x_q, x_kv, mask, bias, scale, emulate)
    y = np.zeros(outs.shape[:-3] + outs.shape[-2:])
    for i in range(outs.shape[-3]):
        y = rd(y + outs[..., i, :, :])
    if w["b_o"] is not None:
        y = rd(y + w["b_o"])
    if residual:
        y = rd(y + np.asarray(x_q, dtype=np.float64))
    return y


# ----------------------------------------------------------------------------- linear attention


def features(fm: Any, x: Any, role: str) -> np.ndarray:
    """Features ``phi(x)`` of the last axis, float64, for a map given by ``fm.name`` (and
    ``fm.omega`` for FAVOR+), following the equations of ``attnref._src.feature_maps``."""
    x = np.asarray(x, dtype=np.float64)
    name, d = fm.name, x.shape[-1]
    if name == "elu_plus_one":
        return np.where(x > 0, x + 1.0, np.exp(np.minimum(x, 0.0)))
    if name == "relu":
        return np.maximum(x, 0.0)
    if name == "identity":
        return x.copy()
    xs = x / d**0.25
    if name == "taylor2":
        outer = np.einsum("...a,...b->...ab", xs, xs).reshape(*x.shape[:-1], d * d)
        return np.concatenate([np.ones((*x.shape[:-1], 1)), xs, outer / math.sqrt(2.0)], -1)
    if name != "favor_plus":
        raise ValueError(f"unknown feature map {name!r}")
    w = np.asarray(fm.omega, dtype=np.float64)
    m = w.shape[0]
    if role == "key":
        # exp(-|x~ - w_i|^2 / 2) / sqrt(m)
        diff = xs[..., None, :] - w
        return np.exp(-0.5 * np.sum(diff * diff, axis=-1)) / math.sqrt(m)
    expo = xs @ w.T + 0.5 * np.sum(w * w, axis=-1)
    return np.exp(expo - expo.max(axis=-1, keepdims=True)) / math.sqrt(m)


def linear_attention(
    q: Any,
    k: Any,
    v: Any,
    *,
    feature_map: Any,
    causal: bool = False,
    key_mask: Any = None,
    eps: float = 0.0,
    eps_policy: str = "add",
) -> np.ndarray:
    """Linear attention ``[..., T_q, H, d_v]`` from its definition, per head and per query::

    A_ij = phi(q_i) . phi(k_j)  for allowed j (key_mask, and j <= i when causal)
    y_i  = sum_j A_ij v_j / D_i,  D_i = sum_j A_ij + eps ("add") or max(sum_j A_ij, eps)
    y_i  = 0 where D_i == 0
    """
    fm = feature_map
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    *batch, t_q, n_heads, _ = q.shape
    t_k = k.shape[-3]
    km = np.ones((*batch, t_k), bool) if key_mask is None else np.asarray(key_mask, bool)
    out = np.zeros((*batch, t_q, n_heads, v.shape[-1]))
    for idx in np.ndindex(*batch):
        for h in range(n_heads):
            fk = features(fm, k[idx][:, h], "key")
            for i in range(t_q):
                fq = features(fm, q[idx][i, h], "query")
                num = np.zeros(v.shape[-1])
                den = 0.0
                for j in range(t_k):
                    if not km[idx][j] or (causal and j > i):
                        continue
                    a = float(fq @ fk[j])
                    num += a * v[idx][j, h]
                    den += a
                adj = den + eps if eps_policy == "add" else max(den, eps)
                if adj != 0.0:
                    out[idx][i, h] = num / adj
    return out


def linear_multihead(
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
) -> np.ndarray:
    """Multi-head linear attention: per-head projections (query head ``i`` reads key/value head
    ``i // G``), :func:`linear_attention`, then ``sum_i y_i W_O[i] + b_O`` (``x_q +`` that if
    residual)."""
    w = _unpack(params)
    group = _group_size(w)
    xq = np.asarray(x_q, dtype=np.float64)
    xkv = xq if x_kv is None else np.asarray(x_kv, dtype=np.float64)

    def heads(x: np.ndarray, name: str) -> np.ndarray:
        wt, b = w["w_" + name], w["b_" + name]
        assert wt is not None
        y = np.einsum("...td,hde->...the", x, wt)
        return y if b is None else y + b

    w_q = w["w_q"]
    assert w_q is not None
    kv_of = [i // group for i in range(w_q.shape[0])]  # key/value head of each query head
    z = linear_attention(
        heads(xq, "q"),
        heads(xkv, "k")[..., kv_of, :],
        heads(xkv, "v")[..., kv_of, :],
        feature_map=feature_map,
        causal=causal,
        key_mask=key_mask,
        eps=eps,
        eps_policy=eps_policy,
    )
    assert w["w_o"] is not None
    y = np.einsum("...qhv,hvd->...qd", z, w["w_o"])
    if w["b_o"] is not None:
        y = y + w["b_o"]
    return y + xq if residual else y
