"""Per-query "soft search": one query vector at a time, in model space.

For one query token ``x_q`` (a row of length ``d_model``) and key tokens ``X_kv [T_k, d_model]``,
head ``i`` forms its pattern ``p_i = x_q W_P[i] + b_Q[i] W_K[g]^T``, scores every key by
``alpha_i = softmax(X_kv p_i^T / sqrt(d_k))`` and returns ``o = sum_i alpha_i M_i + b_O``
with ``M_i = X_kv W_M[i] + b_V[g] W_O[i]`` (``g = i // G`` the key/value head of query head ``i``;
``g = i`` for multi-head params). The batched form ``vmap``s this over queries and
batch dims. A key or value the query may not read (mask, ``-inf`` bias) never reaches its
output or gradients, whatever it holds (``attnref._src.core.nonfinite``). Seed: "Refactoring the
Attention Equations" (2025-02-19), single-query version.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float

from attnref._src.core import cost as _cost
from attnref._src.core.checks import check_params, check_scale, float64_scoped
from attnref._src.core.common import HIGHEST, Prepared, prepare_rows, residual_or, scale_value
from attnref._src.core.nonfinite import (
    allowed_pairs,
    finite_bias,
    finite_part,
    guarded,
    nonfinite_rows,
    reads_nonfinite,
)
from attnref._src.core.params import AttentionParams, repeat_heads, w_m_unchecked, w_p_unchecked
from attnref._src.core.registry import Formulation, register
from attnref._src.core.softmax import masked_softmax
from attnref._src.formulations.merged import patterns_messages_cost


def _one_query(
    wp: Array,
    wm: Array,
    qb: Array | None,
    vb: Array | None,
    b_o: Array | None,
    x_q: Array,
    x_kv: Array,
    mask: Array,
    bias: Array,
    scale: Array,
) -> Array:
    p = jnp.einsum("d,hde->he", x_q, wp, precision=HIGHEST)
    if qb is not None:
        p = p + qb
    logits = jnp.einsum("he,ke->hk", p, x_kv, precision=HIGHEST) * scale + bias
    alpha = masked_softmax(logits, mask)
    m = jnp.einsum("kd,hde->hke", x_kv, wm, precision=HIGHEST)
    if vb is not None:
        m = m + vb[:, None, :]
    o = jnp.sum(jnp.einsum("hk,hke->he", alpha, m, precision=HIGHEST), axis=0)
    return o if b_o is None else o + b_o


def _merged(params: AttentionParams) -> tuple[Array, Array, Array | None, Array | None]:
    """``(W_P, W_M, b_Q[i] W_K[i // G]^T, b_V[i // G] W_O[i])``, all per query head."""
    g = params.group_size
    qb = (
        None
        if params.b_q is None
        else jnp.einsum("hk,hdk->hd", params.b_q, repeat_heads(params.w_k, g), precision=HIGHEST)
    )
    vb = (
        None
        if params.b_v is None
        else jnp.einsum("hv,hvd->hd", repeat_heads(params.b_v, g), params.w_o, precision=HIGHEST)
    )
    return w_p_unchecked(params), w_m_unchecked(params), qb, vb


@float64_scoped
def soft_search(
    params: AttentionParams,
    x_q: Float[ArrayLike, " d_model"],
    x_kv: Float[ArrayLike, "T_k d_model"],
    *,
    mask: Bool[ArrayLike, " T_k"] | None = None,
    bias: Float[ArrayLike, " T_k"] | None = None,
    scale: float | None = None,
) -> Float[Array, " d_model"]:
    """One query: ``o = sum_i softmax(X_kv (x_q W_P[i])^T / sqrt(d_k)) M_i + b_O``.

    Args:
        params: Per-head weights (:class:`attnref.AttentionParams`); ``W_P[i]`` and ``W_M[i]``
            (and the bias terms ``b_Q[i] W_K[g]^T``, ``b_V[g] W_O[i]``) are formed from them.
        x_q: One query token, a row vector ``[d_model]``, the dtype of ``params``.
        x_kv: The key/value tokens ``[T_k, d_model]`` (no batch dims), the dtype of ``x_q``.
        mask: Boolean ``[T_k]``, ``True`` = the query may read that key; ``None`` (default)
            allows every key.
        bias: Additive bias ``[T_k]`` on the scaled scores (``-inf`` masks like ``False``);
            cast to the dtype of ``x_q``.
        scale: The score scale; ``None`` (default) means ``1/sqrt(d_k)``.

    Returns:
        The query's block output ``o``, ``[d_model]``; ``b_O`` (zero without biases) when no key
        is allowed.

    Raises:
        ValueError: If ``params`` is malformed, ``x_q`` is not ``[d_model]``, ``x_kv`` is not
            ``[T_k, d_model]``, ``mask``/``bias`` are not ``[T_k]``, or ``scale`` is not a
            scalar.
        TypeError: If ``x_q``, ``x_kv`` and ``params`` do not share one dtype, ``mask`` is not
            boolean, ``bias`` is not floating, or ``scale`` is not a real number.
    """
    _, d_model, d_k, _ = check_params(params)
    if jnp.ndim(x_q) != 1 or jnp.shape(x_q)[0] != d_model:
        raise ValueError(f"x_q must be one query of shape ({d_model},), got {jnp.shape(x_q)}")
    if jnp.ndim(x_kv) != 2 or jnp.shape(x_kv)[1] != d_model:
        raise ValueError(f"x_kv must have shape [T_k, {d_model}], got {jnp.shape(x_kv)}")
    t_k = jnp.shape(x_kv)[0]
    for name, arr in (("mask", mask), ("bias", bias)):
        if arr is not None and jnp.shape(arr) != (t_k,):
            raise ValueError(f"{name} must have shape ({t_k},) for one query, got {jnp.shape(arr)}")
    mask_dt = None if mask is None else jnp.asarray(mask).dtype
    if mask_dt is not None and mask_dt != jnp.bool_:  # worded as prepare_rows words it
        raise TypeError(
            f"mask must be boolean (True = may attend), got dtype {mask_dt}; pass additive "
            "scores through bias instead"
        )
    bias_dt = None if bias is None else jnp.asarray(bias).dtype
    if bias_dt is not None and not jnp.issubdtype(bias_dt, jnp.floating):
        raise TypeError(f"bias must be floating, got dtype {bias_dt}")
    check_scale(scale)
    x_q, x_kv = jnp.asarray(x_q), jnp.asarray(x_kv)
    if x_q.dtype != x_kv.dtype or x_q.dtype != jnp.asarray(params.w_q).dtype:
        raise TypeError(f"x_q {x_q.dtype}, x_kv {x_kv.dtype} and params must share one dtype")
    m = jnp.ones((t_k,), bool) if mask is None else jnp.asarray(mask)
    b = jnp.zeros((t_k,), x_q.dtype) if bias is None else jnp.asarray(bias).astype(x_q.dtype)
    s = scale_value(d_k, scale, x_q.dtype)
    b_o = None if params.b_o is None else jnp.asarray(params.b_o)
    merged = _merged(params)
    allowed = allowed_pairs(m, b, (t_k,))[None]  # one query row: [1, T_k]
    bad_q, bad_kv = nonfinite_rows(x_q)[None], nonfinite_rows(x_kv)
    dirty = reads_nonfinite(allowed, bad_q, bad_kv, b[None])[0]

    def compute(xq: Array, xkv: Array, bq: Array) -> Array:
        return _one_query(*merged, b_o, xq, xkv, m, bq, s)

    clean = (finite_part(x_q), finite_part(x_kv), finite_bias(b))
    return guarded(compute, dirty, clean)


@float64_scoped
def soft_search_attention(
    params: AttentionParams,
    x_q: Float[ArrayLike, "... T_q d_model"],
    x_kv: Float[ArrayLike, "... T_k d_model"] | None = None,
    *,
    mask: Bool[ArrayLike, "... #T_q #T_k"] | None = None,
    bias: Float[ArrayLike, "... #T_q #T_k"] | None = None,
    scale: float | None = None,
    residual: bool = False,
) -> Float[Array, "... T_q d_model"]:
    """:func:`soft_search` ``vmap``-ed over queries and then over flattened batch dims.

    Args:
        params: Per-head weights (:class:`attnref.AttentionParams`); query head ``i`` reads
            key/value head ``i // G`` (``G = H / K``).
        x_q: Query tokens, row vectors ``[..., T_q, d_model]``, the dtype of ``params``.
        x_kv: Key/value tokens ``[..., T_k, d_model]`` with the batch shape of ``x_q``;
            ``None`` (default) means ``x_q`` (self-attention).
        mask: Boolean, broadcastable to ``[..., T_q, T_k]``, ``True`` = may attend; ``None``
            (default) allows every pair.
        bias: Floating additive bias, broadcastable to ``[..., T_q, T_k]``, added to the scaled
            logits (``-inf`` masks like ``False``); cast to the dtype of ``x_q``.
        scale: The logit scale; ``None`` (default) means ``1/sqrt(d_k)``.
        residual: If ``True``, return ``x_q + MultiHead`` (the residual-stream update).

    Returns:
        The block output ``[..., T_q, d_model]``, the dtype of ``x_q``; a fully masked query row
        is ``b_O`` (zero without biases).

    Raises:
        ValueError: If ``params`` is malformed, ``x_q``/``x_kv`` have rank < 2, the wrong
            ``d_model`` or different batch shapes, ``mask``/``bias`` do not broadcast to
            ``[..., T_q, T_k]``, or ``scale`` is not a scalar.
        TypeError: If ``x_q``, ``x_kv`` and ``params`` mix dtypes, ``mask`` is not boolean,
            ``bias`` is not floating, or ``scale`` is not a real number.
    """
    prepared = prepare_rows(params, x_q, x_kv, mask, bias, scale)  # validates before _merged
    b_o = None if params.b_o is None else jnp.asarray(params.b_o)
    merged = _merged(params)

    def compute(p: Prepared) -> Array:
        full = (*p.batch_shape, p.t_q, p.t_k)
        m = jnp.ones(full, bool) if p.mask is None else jnp.broadcast_to(p.mask, full)
        b = jnp.zeros(full, p.dtype) if p.bias is None else jnp.broadcast_to(p.bias, full)
        d = params.d_model
        xq = p.x_q.reshape(-1, p.t_q, d)
        xkv = p.x_kv.reshape(-1, p.t_k, d)
        m = m.reshape(-1, p.t_q, p.t_k)
        b = b.reshape(-1, p.t_q, p.t_k)

        def one(xq1: Array, xkv1: Array, m1: Array, b1: Array) -> Array:
            return _one_query(*merged, b_o, xq1, xkv1, m1, b1, p.scale)

        per_query = jax.vmap(one, in_axes=(0, None, 0, 0))
        y = jax.vmap(per_query)(xq, xkv, m, b).reshape(*p.batch_shape, p.t_q, d)
        return residual_or(y, p.x_q, residual)

    return prepared.guarded(compute, residual)


# ----------------------------------------------------------------------------- registry entry


def soft_search_cost(d: _cost.Dims) -> _cost.Cost:
    """vmap leaves query-independent work unbatched: the same counts as patterns x messages;
    the workspace adds the full mask and bias broadcasts and the flattened batch copies."""
    c = patterns_messages_cost(d)
    extra = (2 * d.batch * d.t_q * d.t_k + d.batch * (d.t_q + 2 * d.t_k) * d.d_model) * d.itemsize
    return dataclasses.replace(c, workspace_bytes=c.workspace_bytes + extra)


register(
    Formulation(
        id="soft_search",
        title="Per-query soft search",
        equation=(
            r"o = \sum_{i=1}^{H} \mathrm{softmax}\!\Big(\frac{X_{kv}\, p_i^\top}{\sqrt{d_k}}"
            r"\Big)^{\!\top} M_i + b_O,\quad p_i = x_q W_{P,i} + b_{Q,i} W_{K,i}^\top"
        ),
        convention="single-query",
        citation="Refactoring the Attention Equations: Patterns and Messages (2025-02-19), "
        "single-query version; search perspective of Attention: All you need to know (2025-03-29).",
        apply=soft_search_attention,
        native=soft_search,
        summary=(
            "One query vector at a time searches the keys with its pattern; vmapped over queries."
        ),
        cost=(
            "As patterns_messages: written one query at a time, but vmap leaves the "
            "query-independent work (W_P, W_M and the messages X_kv W_M) unbatched, so it is "
            "computed once (XLA's FLOP count equals patterns_messages'); memory "
            "O(H (T_q + T_k) d_model + H T_q T_k)"
        ),
        cost_model=soft_search_cost,
    )
)
