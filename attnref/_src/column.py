"""The column-vector form of Elhage et al. (2021), as written in "Attention: All you need to know".

Tokens are columns: ``X [..., d_model, T]``. Per head, ``A_i = X_kv^T W_A[i] X_q`` (``T_k x T_q``,
entry ``[j, i]`` scores key ``j`` for query ``i``), ``~A_i = softmax_col(A_i / sqrt(d_k))`` is
column-stochastic, and ``Y = sum_i W_I[i] X_kv ~A_i + b_O 1^T`` with ``W_A = W_K^T W_Q`` and
``W_I = W_O^T W_V`` in column convention (``W_A[i] = W_P[i]^T``, ``W_I[i] = W_M[i]^T``; with
grouped-query params query head ``i`` uses ``W_K``, ``W_V``, ``b_V`` of key/value head
``g = i // G``).
Masks and biases use the same transposed layout ``[..., T_k, T_q]`` (``M[j, i]``: query ``i``
may read key ``j``). Biases: ``b_Q`` adds ``X_kv^T (W_K[g] b_Q[i]) 1^T`` to the scores (``b_K``
cancels in the column softmax) and ``b_V`` adds ``(W_O[i]^T b_V[g]) 1^T`` to the updates.
A key column a query may not read (mask, ``-inf`` bias) never reaches that query's output column
or gradients, whatever it holds (``attnref._src.nonfinite``).
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float

from attnref._src.checks import check_mask_and_bias, check_scale, check_tokens, float64_scoped
from attnref._src.common import HIGHEST, residual_or, scale_value
from attnref._src.nonfinite import (
    allowed_pairs,
    finite_bias,
    finite_part,
    guarded,
    nonfinite_rows,
    reads_nonfinite,
)
from attnref._src.params import AttentionParams, repeat_heads, w_a, w_i
from attnref._src.softmax import masked_softmax


@float64_scoped
def column_attention(
    params: AttentionParams,
    x: Float[ArrayLike, "... d_model T_q"],
    x_kv: Float[ArrayLike, "... d_model T_k"] | None = None,
    *,
    mask: Bool[ArrayLike, "... T_k T_q"] | None = None,
    bias: Float[ArrayLike, "... T_k T_q"] | None = None,
    scale: float | None = None,
    residual: bool = False,
) -> Float[Array, "... d_model T_q"]:
    """``Y = sum_i W_I[i] X_kv softmax_col(X_kv^T W_A[i] X / sqrt(d_k)) + b_O`` (columns)."""
    x_kv = x if x_kv is None else x_kv
    batch, t_q, t_k = check_tokens(params, x, x_kv, layout="column", names=("x", "x_kv"))
    check_mask_and_bias(mask, bias, (*batch, t_k, t_q), axes="[..., T_k, T_q]")
    check_scale(scale)
    x, x_kv = jnp.asarray(x), jnp.asarray(x_kv)
    s = scale_value(params.d_k, scale, x.dtype)
    m = None if mask is None else jnp.swapaxes(jnp.asarray(mask), -1, -2)  # rows: [..., T_q, T_k]
    b = None if bias is None else jnp.asarray(bias).astype(x.dtype)
    b_rows = None if b is None else jnp.swapaxes(b, -1, -2)
    allowed = allowed_pairs(m, b_rows, (*batch, t_q, t_k))
    bad_q, bad_kv = nonfinite_rows(x, axis=-2), nonfinite_rows(x_kv, axis=-2)
    dirty = reads_nonfinite(allowed, bad_q, bad_kv, b_rows, residual)  # [..., T_q]

    def rows(xq: Array, xkv: Array, bq: Array | None) -> Array:  # [..., T_q, d_model]
        y = _column(params, xq, xkv, mask, bq, s, residual)
        return jnp.swapaxes(y, -1, -2)

    clean = (finite_part(x), finite_part(x_kv), finite_bias(b))
    return jnp.swapaxes(guarded(rows, dirty, clean), -1, -2)


def _column(
    params: AttentionParams,
    x: Array,
    x_kv: Array,
    mask: ArrayLike | None,
    bias: Array | None,
    s: Array,
    residual: bool,
) -> Float[Array, "... d_model T_q"]:
    """The body of :func:`column_attention` on validated arrays (no non-finite guard)."""
    wa_x = jnp.einsum("hde,...eq->...hdq", w_a(params), x, precision=HIGHEST)
    scores = jnp.einsum("...dk,...hdq->...hkq", x_kv, wa_x, precision=HIGHEST)
    if params.b_q is not None:
        w_k = repeat_heads(params.w_k, params.group_size)  # [H, d_model, d_k]: W_K[i // G]
        kb = jnp.einsum("hdk,hk->hd", w_k, params.b_q, precision=HIGHEST)
        scores = scores + jnp.einsum("...dk,hd->...hk", x_kv, kb, precision=HIGHEST)[..., None]
    scores = scores * s
    if bias is not None:
        scores = scores + jnp.expand_dims(bias, -3)
    head_mask = None if mask is None else jnp.expand_dims(jnp.asarray(mask), -3)
    a = masked_softmax(scores, head_mask, axis=-2)

    updates = jnp.einsum("hed,...dk->...hek", w_i(params), x_kv, precision=HIGHEST)
    if params.b_v is not None:
        b_v = repeat_heads(params.b_v, params.group_size)  # [H, d_v]: b_V[i // G]
        ob = jnp.einsum("hvd,hv->hd", params.w_o, b_v, precision=HIGHEST)
        updates = updates + ob[..., None]
    y = jnp.sum(jnp.einsum("...hek,...hkq->...heq", updates, a, precision=HIGHEST), axis=-3)
    if params.b_o is not None:
        y = y + jnp.asarray(params.b_o)[:, None]
    return residual_or(y, x, residual)


@float64_scoped
def column_attention_rows(
    params: AttentionParams,
    x_q: Float[ArrayLike, "... T_q d_model"],
    x_kv: Float[ArrayLike, "... T_k d_model"] | None = None,
    *,
    mask: Bool[ArrayLike, "... T_q T_k"] | None = None,
    bias: Float[ArrayLike, "... T_q T_k"] | None = None,
    scale: float | None = None,
    residual: bool = False,
) -> Float[Array, "... T_q d_model"]:
    """:func:`column_attention` behind the row-convention signature (transposes in and out)."""

    def t(a: ArrayLike | None) -> Array | None:
        return None if a is None else jnp.swapaxes(jnp.asarray(a), -1, -2)

    batch, t_q, t_k = check_tokens(params, x_q, x_q if x_kv is None else x_kv)
    check_mask_and_bias(mask, bias, (*batch, t_q, t_k))
    x_col = jnp.swapaxes(jnp.asarray(x_q), -1, -2)
    y = column_attention(
        params, x_col, t(x_kv), mask=t(mask), bias=t(bias), scale=scale, residual=residual
    )
    return jnp.swapaxes(y, -1, -2)
