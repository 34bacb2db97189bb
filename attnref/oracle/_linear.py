"""Oracle of linear (kernel) attention: feature maps, ``linear_attention`` per head and query,
and the multi-head form. NumPy only, float64.

``method="definition"``: one batch element, head, query and key at a time (FAVOR+: in log space);
the root of trust. ``"fast"`` (default): per batch element and head, by query blocks (64 MiB
budget), each forming the *quadratic* ``A = phi(Q_blk) phi(K)^T`` (masked; causal blocks read
keys ``j < end of block``), then ``A V`` and ``A 1`` (FAVOR+: log-sum-exp over the features). The
associative ``phi(Q) (phi(K)^T V)`` sums the same products (same bound,
:func:`attnref.tolerance.linear_error_bound`), but only the quadratic form takes numerator and
denominator from the *same* rounded ``A_ij``, needs no prefix sums when causal, and leaves
masked entries exact zeros, as the definition does.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np

from ._checks import check_flag, check_method
from ._core import Params, group_size, head_weights, tokens, unpack
from ._doc import (
    LINEAR,
    LINEAR_OPTIONS,
    LINEAR_RAISES,
    block_options,
    doc,
    linear_options,
    linear_qkv,
    method_option,
    signed,
    weight_tokens,
)

_FACTORIES = ("elu_plus_one", "relu_features", "identity_features", "taylor2", "favor_plus")


def check_map(fm: Any) -> None:
    """A clear ``TypeError`` for a map factory passed uncalled (or anything without ``.name``)."""
    name = getattr(fm, "__name__", None)
    if callable(fm) and name in _FACTORIES and not hasattr(fm, "num_features"):
        raise TypeError(
            f"feature_map must be a feature map; got the factory function {name} itself: call it "
            f"({name}(...))"
        )
    if not isinstance(getattr(fm, "name", None), str):
        raise TypeError(f"feature_map must be a feature map with a name, got {type(fm).__name__}")


def check_options(fm: Any, causal: Any, eps_policy: Any, method: Any) -> bool:
    """The refusals of every linear-attention function (feature map, ``causal``, ``eps_policy``,
    ``method``, in that order); returns ``causal``."""
    check_map(fm)
    causal = check_flag("causal", causal)
    if eps_policy not in ("add", "clamp"):
        raise ValueError(f"eps_policy must be 'add' or 'clamp', got {eps_policy!r}")
    check_method(method)
    return causal


def project(x: np.ndarray, wt: np.ndarray, b: np.ndarray | None) -> np.ndarray:
    """``x W[i] + b[i]`` per head, ``[..., T, H, d]``."""
    y = np.einsum("...td,hde->...the", x, wt)
    return y if b is None else y + b


def multihead_inputs(
    params: Any, x_q: Any, x_kv: Any
) -> tuple[Params, list[int], np.ndarray, np.ndarray]:
    """The parameters, the key/value head of each query head, and the tokens in float64."""
    w = unpack(params)
    group = group_size(w)
    xq, xkv = tokens(x_q, x_kv)
    return w, [i // group for i in range(head_weights(w)[0].shape[0])], xq, xkv


def features(fm: Any, x: Any, role: str) -> np.ndarray:
    """Features ``phi(x)`` of the last axis, float64 (``attnref._src.formulations.feature_maps``'s
    equations); FAVOR+'s are the *stabilised* ones, ``exp(-c_q)`` times the defined kernel
    (:func:`query_log_scale`), which :func:`linear_attention` does not use.

    Args:
        fm: A feature map (:class:`attnref.linear.FeatureMap` or any object with ``name`` and,
            for FAVOR+, ``omega [m, d]``).
        x: Inputs ``[..., d]``.
        role: ``"query"`` or ``"key"`` (only FAVOR+ tells them apart).

    Returns:
        float64 features ``[..., m]``.

    Raises:
        TypeError: If ``fm`` is a factory passed uncalled or has no ``name``.
        ValueError: If ``fm.name`` is unknown.
    """
    check_map(fm)
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


def query_log_scale(fm: Any, x: Any) -> np.ndarray:
    """``c(x)`` with ``features(q).features(k) = exp(-c(q)) phi(q).phi(k)``, ``[...]``: for FAVOR+
    ``c = max_i(w_i.x~ + |w_i|^2/2) - |x~|^2/2``, for every other map 0."""
    check_map(fm)
    x = np.asarray(x, dtype=np.float64)
    if fm.name != "favor_plus":
        return np.zeros(x.shape[:-1])
    w = np.asarray(fm.omega, dtype=np.float64)
    _, xw, half_sq = favor_parts(w, x)
    return (xw + 0.5 * np.sum(w * w, axis=-1)).max(axis=-1) - half_sq


def favor_log_kernel(fm: Any, q: np.ndarray, k: np.ndarray) -> np.ndarray:
    """``log(phi(q).phi(k_j))`` for one query ``q [d]`` and keys ``k [T_k, d]``, from the
    definition ``phi(x)_i = m^(-1/2) exp(w_i.x~ - |x~|^2/2)``, ``x~ = x / d^(1/4)``::

        phi(q).phi(k) = (1/m) sum_i exp(w_i.(q~ + k~)) exp(-|q~|^2/2 - |k~|^2/2)

    with the sum over ``i`` as a log-sum-exp (no over- or underflow, no stabilising features)."""
    d = q.shape[-1]
    w = favor_omega(fm, d)
    qs, ks = q / d**0.25, k / d**0.25
    z = (qs + ks) @ w.T  # [T_k, m]
    top = z.max(axis=-1)
    lse = top + np.log(np.sum(np.exp(z - top[:, None]), axis=-1))
    return lse - math.log(w.shape[0]) - 0.5 * (qs @ qs) - 0.5 * np.sum(ks * ks, axis=-1)


def _ratio_from_logs(ell: np.ndarray, vals: np.ndarray, eps: float, eps_policy: str) -> np.ndarray:
    """``sum_j A_j v_j / (sum_j A_j + eps)`` (or ``/ max(...)``) from ``log A_j``, every term
    divided by ``exp(max(max_j log A_j, log eps))``."""
    if ell.size == 0:
        return np.zeros(vals.shape[-1])  # no allowed key: the numerator is 0
    log_eps = math.log(eps) if eps > 0 else -math.inf
    s = max(float(ell.max()), log_eps)
    weights = np.exp(ell - s)
    sink = math.exp(log_eps - s)  # eps exp(-s) <= 1
    den = weights.sum() + sink if eps_policy == "add" else max(weights.sum(), sink)
    return weights @ vals / den


# ----------------------------------------------------------------------------- the fast path

BUDGET_BYTES = 64 * 2**20  # float64 temporaries of one query block


def block_rows(t_q: int, per_row: int) -> int:
    """Query rows per block: ``per_row`` float64 temporaries a row within the 64 MiB budget
    (at least 1, at most ``T_q``)."""
    return max(1, min(t_q, BUDGET_BYTES // (8 * max(per_row, 1))))


def blocks(t_q: int, t_k: int, per_key: int, causal: bool) -> Iterator[tuple[int, int, int]]:
    """``(i0, i1, kk)``: query rows ``[i0, i1)`` and the keys ``[0, kk)`` any of them may read
    (``kk = min(i1, T_k)`` when causal), ``per_key`` temporaries per (query, key) pair."""
    step = block_rows(t_q, per_key * max(t_k, 1))
    for i0 in range(0, t_q, step):
        i1 = min(i0 + step, t_q)
        yield i0, i1, (min(i1, t_k) if causal else t_k)


def key_mask_array(key_mask: Any, batch: list[int], t_k: int) -> np.ndarray:
    """``key_mask`` as a boolean ``[..., T_k]`` (all True for ``None``)."""
    if key_mask is None:
        return np.ones((*batch, t_k), bool)
    return np.broadcast_to(np.asarray(key_mask, bool), (*batch, t_k))


def allowed(km: np.ndarray, i0: int, i1: int, causal: bool) -> np.ndarray:
    """``[i1 - i0, kk]``: key ``j`` may be read by query ``i`` (``km [kk]``; ``j <= i`` when
    causal)."""
    ok = np.broadcast_to(km, (i1 - i0, km.shape[-1]))
    if causal:
        ok = ok & (np.arange(km.shape[-1]) <= np.arange(i0, i1)[:, None])
    return ok


def masked_matmul(a: np.ndarray, ok: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``sum_j a_ij b_j`` over allowed ``j`` only (``a @ b`` unless ``b`` is not finite)."""
    if np.isfinite(b).all():
        return a @ b
    with np.errstate(invalid="ignore"):  # 0 * inf only at the entries the where discards
        return np.where(ok[..., None], a[..., None] * b, 0.0).sum(-2)


def adjusted(den: np.ndarray, eps: float, eps_policy: str) -> np.ndarray:
    """``D = den + eps`` ("add") or ``max(den, eps)`` ("clamp")."""
    return den + eps if eps_policy == "add" else np.maximum(den, eps)


def favor_omega(fm: Any, d: int) -> np.ndarray:
    """FAVOR+'s ``omega [m, d]`` in float64, refused (as the definition refuses it) unless its
    width is the inputs' ``d``."""
    w = np.asarray(fm.omega, dtype=np.float64)
    if w.shape[1] != d:
        raise ValueError(f"favor_plus omega has shape {w.shape}; inputs have d={d}")
    return w


def favor_parts(w: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per token: ``x~ = x / d^(1/4)``, ``x~ w^T [..., m]`` and ``|x~|^2 / 2``."""
    xs = x / x.shape[-1] ** 0.25
    return xs, xs @ w.T, 0.5 * np.sum(xs * xs, axis=-1)


def favor_log_block(
    qw: np.ndarray, kw: np.ndarray, nq: np.ndarray, nk: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`favor_log_kernel` for a block of queries; returns ``(ell, e, total)`` with ``e =
    exp(z - max_f z)``, ``total = sum_f e`` (``e / total``: the feature softmax)."""
    e = qw[:, None, :] + kw[None, :, :]
    top = e.max(axis=-1)
    np.subtract(e, top[..., None], out=e)
    np.exp(e, out=e)
    total = e.sum(axis=-1)
    ell = top + np.log(total) - math.log(qw.shape[-1]) - nq[:, None] - nk[None, :]
    return ell, e, total


def ratio_parts(
    ell: np.ndarray, ok: np.ndarray, eps: float, eps_policy: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`_ratio_from_logs` row-wise: ``(weights, den, depends)`` (``den`` 1 in rows without
    a key; ``depends``: whether ``D`` follows ``sum_j A_ij``, on a tie as Python's ``max``)."""
    log_eps = math.log(eps) if eps > 0 else -math.inf
    ell = np.where(ok, ell, -np.inf)
    live = ok.any(axis=-1)
    s = np.where(live, np.maximum(np.max(ell, axis=-1, initial=-np.inf), log_eps), 0.0)
    weights = np.exp(ell - s[:, None])
    sink = np.exp(log_eps - s)
    total = weights.sum(axis=-1)
    den = total + sink if eps_policy == "add" else np.maximum(total, sink)
    depends = np.full(total.shape, True) if eps_policy == "add" else total >= sink
    return weights, np.where(live, den, 1.0), depends


def precompute(fm: Any, q: np.ndarray, k: np.ndarray) -> tuple[list[np.ndarray], Any]:
    """Per token, every head at once: the features ``[phi(q), phi(k)]``, or for FAVOR+ ``[q~, k~,
    q~ w^T, k~ w^T, |q~|^2/2, |k~|^2/2]``; and FAVOR+'s ``w`` (else ``None``)."""
    if fm.name != "favor_plus":
        return [features(fm, q, "query"), features(fm, k, "key")], None
    w = favor_omega(fm, q.shape[-1])
    (qs, qw, nq), (ks, kw, nk) = favor_parts(w, q), favor_parts(w, k)
    return [qs, ks, qw, kw, nq, nk], w


def _linear_fast(
    fm: Any, q: Any, k: Any, v: Any, causal: bool, key_mask: Any, eps: float, eps_policy: str
) -> np.ndarray:
    """:func:`linear_attention` vectorised per (batch, head), streamed over query blocks (the
    quadratic form; FAVOR+ in log space, as the definition)."""
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    *batch, t_q, n_heads, _ = q.shape
    t_k, d_v = k.shape[-3], v.shape[-1]
    km = key_mask_array(key_mask, batch, t_k)
    read = km[..., None, None]  # a padded key is never read: zeros in its place change nothing
    k, v = np.where(read, k, 0.0), np.where(read, v, 0.0)
    out = np.zeros((*batch, t_q, n_heads, d_v))
    pre, w = precompute(fm, q, k)
    per_key = 3 if w is None else 2 * w.shape[0] + 4
    for idx in np.ndindex(*batch):
        for h in range(n_heads):
            vals, head = v[idx][:, h], [a[idx][:, h] for a in pre]
            extra = 0 if np.isfinite(vals).all() else d_v
            for i0, i1, kk in blocks(t_q, t_k, per_key + extra, causal):
                ok = allowed(km[idx][:kk], i0, i1, causal)
                if w is not None:
                    qw, kw, nq, nk = head[2:]
                    ell = favor_log_block(qw[i0:i1], kw[:kk], nq[i0:i1], nk[:kk])[0]
                    weights, den, _ = ratio_parts(ell, ok, eps, eps_policy)
                    out[idx][i0:i1, h] = masked_matmul(weights, ok, vals[:kk]) / den[:, None]
                    continue
                a = np.where(ok, head[0][i0:i1] @ head[1][:kk].T, 0.0)
                adj = adjusted(a.sum(axis=-1), eps, eps_policy)
                num = masked_matmul(a, ok, vals[:kk])  # y = 0 where D == 0
                out[idx][i0:i1, h] = np.where(
                    (adj == 0)[:, None], 0.0, num / np.where(adj == 0, 1.0, adj)[:, None]
                )
    return out


@doc(LINEAR)
@signed(linear_qkv, linear_options, method_option)
def linear_attention(call: dict[str, Any]) -> np.ndarray:
    """Linear attention ``[..., T_q, H, d_v]`` from its definition, per head and per query::

        A_ij = phi(q_i) . phi(k_j)  for allowed j (key_mask, and j <= i when causal)
        y_i  = sum_j A_ij v_j / D_i,  D_i = sum_j A_ij + eps ("add") or max(sum_j A_ij, eps)
        y_i  = 0 where D_i == 0

    FAVOR+ runs in log space from the definition (:func:`favor_log_kernel`): ``eps`` meets the
    defined ``A_ij``, whatever the JAX forms' stabilisation.

    Returns:
        float64 ``y [..., T_q, H, d_v]``.

    Raises:
        TypeError: If ``feature_map`` is not a (called) feature map, or ``causal`` is not a
            bool (a truthy ``1`` or ``"False"`` would silently read as causal).
        ValueError: If ``eps_policy`` or ``method`` is unknown. Shapes are not validated here.
    """
    method = call.pop("method")
    q, k, v, fm, causal, key_mask, eps, eps_policy = call.values()
    causal = check_options(fm, causal, eps_policy, method)
    if method == "fast":
        return _linear_fast(fm, q, k, v, causal, key_mask, eps, eps_policy)
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    *batch, t_q, n_heads, _ = q.shape
    t_k = k.shape[-3]
    km = key_mask_array(key_mask, batch, t_k)
    out = np.zeros((*batch, t_q, n_heads, v.shape[-1]))
    for idx in np.ndindex(*batch):
        for h in range(n_heads):
            if fm.name == "favor_plus":
                for i in range(t_q):
                    ok = km[idx] & (np.arange(t_k) <= i if causal else True)
                    ell = favor_log_kernel(fm, q[idx][i, h], k[idx][:, h])
                    out[idx][i, h] = _ratio_from_logs(ell[ok], v[idx][ok, h], eps, eps_policy)
                continue
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


@doc(LINEAR, LINEAR_RAISES)
@signed(weight_tokens, linear_options, block_options)
def linear_multihead(call: dict[str, Any]) -> np.ndarray:
    """Multi-head linear attention: per-head projections (key/value head ``i // G``),
    :func:`linear_attention`, then ``sum_i y_i W_O[i] + b_O`` (``x_q +`` that if residual).

    Returns:
        float64 block output ``[..., T_q, d_model]``.
    """
    residual, method = call.pop("residual"), check_method(call.pop("method"))
    w, kv_of, xq, xkv = multihead_inputs(call["params"], call["x_q"], call["x_kv"])
    w_q, w_k, w_v, w_o = head_weights(w)
    q = project(xq, w_q, w["b_q"])
    k, v = (project(xkv, wt, w[b])[..., kv_of, :] for wt, b in ((w_k, "b_k"), (w_v, "b_v")))
    options = {name: call[name] for name in LINEAR_OPTIONS}
    z = linear_attention(q, k, v, **options, method=method)
    y = np.einsum("...qhv,hvd->...qd", z, w_o)
    if w["b_o"] is not None:
        y = y + w["b_o"]
    return y + xq if residual else y
