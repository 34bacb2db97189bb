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

from ._checks import check_weight_level

__all__ = ["attention", "attention_weights", "head_outputs"]

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
    # Every bad input the JAX formulations refuse is refused here too (same exception types).
    batch, t_q, t_k, m, b, sc = check_weight_level(params, x_q, x_kv, mask, bias, scale)
    rd = _rounder(emulate)
    w = _unpack(params)
    group = _group_size(w)
    xq = np.asarray(x_q, dtype=np.float64)
    xkv = xq if x_kv is None else np.asarray(x_kv, dtype=np.float64)
    w_q, w_k, w_v, w_o = w["w_q"], w["w_k"], w["w_v"], w["w_o"]
    assert w_q is not None and w_k is not None and w_v is not None and w_o is not None
    n_heads, d_model, d_k = w_q.shape
    s = 1.0 / math.sqrt(d_k) if sc is None else sc

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
    """Row-stochastic attention weights ``[..., H, T_q, T_k]`` (zero rows where fully masked).

    Args:
        params: Per-head weights: an :class:`attnref.AttentionParams` or a dict with the same
            keys (``w_q [H, d_model, d_k]``, ``w_k [K, d_model, d_k]``, ...; read as float64).
        x_q: Query tokens, row vectors ``[..., T_q, d_model]``, the dtype of ``params``.
        x_kv: Key/value tokens ``[..., T_k, d_model]`` with the batch shape of ``x_q``;
            ``None`` (default) means ``x_q``.
        mask: Boolean, broadcastable to ``[..., T_q, T_k]``, ``True`` = may attend; ``None``
            (default) allows every pair.
        bias: Floating, broadcastable to ``[..., T_q, T_k]``, added to the scaled logits
            (``-inf`` masks like ``False``); ``None`` (default) adds nothing.
        scale: The logit scale; ``None`` (default) means ``1/sqrt(d_k)``.

    Returns:
        float64 weights ``[..., H, T_q, T_k]``.

    Raises:
        ValueError: For the inputs the JAX formulations refuse with ``ValueError`` (malformed
            ``params``, token ranks, ``d_model`` or batch shapes, a ``mask``/``bias`` that does
            not broadcast, a non-scalar ``scale``).
        TypeError: For those they refuse with ``TypeError`` (mixed dtypes, a non-boolean mask,
            a non-floating bias, a non-real scale).
    """
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
    """Per-head outputs in model space ``[..., H, T_q, d_model]`` (without ``b_O``).

    Args:
        params: Per-head weights: an :class:`attnref.AttentionParams` or a dict with the same
            keys (``w_q [H, d_model, d_k]``, ``w_k [K, d_model, d_k]``, ...; read as float64).
        x_q: Query tokens, row vectors ``[..., T_q, d_model]``, the dtype of ``params``.
        x_kv: Key/value tokens ``[..., T_k, d_model]`` with the batch shape of ``x_q``;
            ``None`` (default) means ``x_q``.
        mask: Boolean, broadcastable to ``[..., T_q, T_k]``, ``True`` = may attend; ``None``
            (default) allows every pair.
        bias: Floating, broadcastable to ``[..., T_q, T_k]``, added to the scaled logits
            (``-inf`` masks like ``False``); ``None`` (default) adds nothing.
        scale: The logit scale; ``None`` (default) means ``1/sqrt(d_k)``.

    Returns:
        float64 ``o_i = A_i V_i W_O[i]`` for every query head, ``[..., H, T_q, d_model]``.

    Raises:
        ValueError: For the inputs the JAX formulations refuse with ``ValueError`` (malformed
            ``params``, token ranks, ``d_model`` or batch shapes, a ``mask``/``bias`` that does
            not broadcast, a non-scalar ``scale``).
        TypeError: For those they refuse with ``TypeError`` (mixed dtypes, a non-boolean mask,
            a non-floating bias, a non-real scale).
    """
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

    Args:
        params: Per-head weights: an :class:`attnref.AttentionParams` or a dict with the same
            keys (``w_q [H, d_model, d_k]``, ``w_k [K, d_model, d_k]``, ...; read as float64).
        x_q: Query tokens, row vectors ``[..., T_q, d_model]``, the dtype of ``params``.
        x_kv: Key/value tokens ``[..., T_k, d_model]`` with the batch shape of ``x_q``;
            ``None`` (default) means ``x_q``.
        mask: Boolean, broadcastable to ``[..., T_q, T_k]``, ``True`` = may attend; ``None``
            (default) allows every pair.
        bias: Floating, broadcastable to ``[..., T_q, T_k]``, added to the scaled logits
            (``-inf`` masks like ``False``); ``None`` (default) adds nothing.
        scale: The logit scale; ``None`` (default) means ``1/sqrt(d_k)``.
        residual: If ``True``, return ``x_q + MultiHead`` (default ``False``).
        emulate: ``None`` (default; exact float64) or a dtype (e.g. ``np.float16``) to round
            every intermediate to.

    Returns:
        The block output ``[..., T_q, d_model]``, float64 (values rounded to ``emulate`` when
        given); a fully masked query row is ``b_O``.

    Raises:
        ValueError: For the inputs the JAX formulations refuse with ``ValueError`` (malformed
            ``params``, token ranks, ``d_model`` or batch shapes, a ``mask``/``bias`` that does
            not broadcast, a non-scalar ``scale``).
        TypeError: For those they refuse with ``TypeError`` (mixed dtypes, a non-boolean mask,
            a non-floating bias, a non-real scale).
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
