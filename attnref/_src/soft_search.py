"""Per-query "soft search": one query vector at a time, in model space.

For one query token ``x_q`` (a row of length ``d_model``) and key tokens ``X_kv [T_k, d_model]``,
head ``i`` forms its pattern ``p_i = x_q W_P[i] + b_Q[i] W_K[g]^T``, scores every key by
``alpha_i = softmax(X_kv p_i^T / sqrt(d_k))`` and returns ``o = sum_i alpha_i M_i + b_O``
with ``M_i = X_kv W_M[i] + b_V[g] W_O[i]`` (``g = i // G`` the key/value head of query head ``i``;
``g = i`` for multi-head params). The batched form ``vmap``s this over queries and
batch dims. A key or value the query may not read (mask, ``-inf`` bias) never reaches its
output or gradients, whatever it holds (``attnref._src.nonfinite``). Seed: "Refactoring the
Attention Equations" (2025-02-19), single-query version.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float

from attnref._src.checks import check_params, check_scale, float64_scoped
from attnref._src.common import HIGHEST, Prepared, residual_or, scale_value
from attnref._src.nonfinite import (
    allowed_pairs,
    finite_bias,
    finite_part,
    guarded,
    nonfinite_rows,
    reads_nonfinite,
)
from attnref._src.params import AttentionParams, repeat_heads, w_m, w_p
from attnref._src.softmax import masked_softmax


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
    return w_p(params), w_m(params), qb, vb


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
    """One query: ``o = sum_i softmax(X_kv (x_q W_P[i])^T / sqrt(d_k)) M_i + b_O``."""
    _, d_model, d_k, _ = check_params(params)
    if jnp.ndim(x_q) != 1 or jnp.shape(x_q)[0] != d_model:
        raise ValueError(f"x_q must be one query of shape ({d_model},), got {jnp.shape(x_q)}")
    if jnp.ndim(x_kv) != 2 or jnp.shape(x_kv)[1] != d_model:
        raise ValueError(f"x_kv must have shape [T_k, {d_model}], got {jnp.shape(x_kv)}")
    t_k = jnp.shape(x_kv)[0]
    for name, arr in (("mask", mask), ("bias", bias)):
        if arr is not None and jnp.shape(arr) != (t_k,):
            raise ValueError(f"{name} must have shape ({t_k},) for one query, got {jnp.shape(arr)}")
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
    mask: Bool[ArrayLike, "... T_q T_k"] | None = None,
    bias: Float[ArrayLike, "... T_q T_k"] | None = None,
    scale: float | None = None,
    residual: bool = False,
) -> Float[Array, "... T_q d_model"]:
    """:func:`soft_search` ``vmap``-ed over queries and then over flattened batch dims."""
    prepared = Prepared(params, x_q, x_kv, mask, bias, scale)  # validates before _merged
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
