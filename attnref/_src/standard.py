"""The standard formulations: concatenated heads (Vaswani et al. 2017) and the per-head sum.

Row convention, shapes ``x_q [..., T_q, d_model]``, ``x_kv [..., T_k, d_model]``; output
``[..., T_q, d_model]``. ``head_i = softmax(Q_i K_i^T / sqrt(d_k) + bias, mask) V_i`` with
``K_i = X_kv W_K[i // G] + b_K[i // G]`` and ``V_i`` likewise: with grouped-query parameters
(``K`` key/value heads, ``G = H / K``) each key/value head is projected once and read by the ``G``
query heads of its group.

A key or value a query may not read (mask, ``-inf`` bias) never reaches that query's output or
gradients, whatever it holds (NaN, ``+-inf``): every public function runs through
:meth:`Prepared.guarded`; a row that does read a non-finite value gets its IEEE value (NaN).
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float

from attnref._src.checks import float64_scoped
from attnref._src.common import (
    HIGHEST,
    Prepared,
    add_output_bias,
    project,
    project_kv,
    residual_or,
)
from attnref._src.params import AttentionParams
from attnref._src.softmax import masked_softmax


def logits(p: Prepared, params: AttentionParams) -> Float[Array, "... H T_q T_k"]:
    """``scale q_i . k_j + bias`` per query head, before masking."""
    q = project(p.x_q, params.w_q, params.b_q)
    k = project_kv(p.x_kv, params.w_k, params.b_k, params.group_size)
    return p.add_bias(jnp.einsum("...hqd,...hkd->...hqk", q, k, precision=HIGHEST) * p.scale)


def _weights(p: Prepared, params: AttentionParams) -> Float[Array, "... H T_q T_k"]:
    return masked_softmax(logits(p, params), p.head_mask())


def _heads(p: Prepared, params: AttentionParams) -> Float[Array, "... H T_q d_v"]:
    v = project_kv(p.x_kv, params.w_v, params.b_v, params.group_size)
    return jnp.einsum("...hqk,...hkv->...hqv", _weights(p, params), v, precision=HIGHEST)


def _head_outputs(p: Prepared, params: AttentionParams) -> Float[Array, "... H T_q d_model"]:
    return jnp.einsum("...hqv,hvd->...hqd", _heads(p, params), params.w_o, precision=HIGHEST)


@float64_scoped
def attention_weights(
    params: AttentionParams,
    x_q: Float[ArrayLike, "... T_q d_model"],
    x_kv: Float[ArrayLike, "... T_k d_model"] | None = None,
    *,
    mask: Bool[ArrayLike, "... T_q T_k"] | None = None,
    bias: Float[ArrayLike, "... T_q T_k"] | None = None,
    scale: float | None = None,
) -> Float[Array, "... H T_q T_k"]:
    """Row-stochastic scores ``A_i = softmax(Q_i K_i^T * scale + bias, mask)`` per query head.

    Fully masked rows are all zeros.
    """
    p = Prepared(params, x_q, x_kv, mask, bias, scale)
    return p.guarded(lambda v: _weights(v, params), heads=True)


@float64_scoped
def head_outputs(
    params: AttentionParams,
    x_q: Float[ArrayLike, "... T_q d_model"],
    x_kv: Float[ArrayLike, "... T_k d_model"] | None = None,
    *,
    mask: Bool[ArrayLike, "... T_q T_k"] | None = None,
    bias: Float[ArrayLike, "... T_q T_k"] | None = None,
    scale: float | None = None,
) -> Float[Array, "... H T_q d_model"]:
    """Per-head outputs in model space, ``o_i = head_i W_O[i]`` (no ``b_O``).

    ``sum_i o_i + b_O`` is the block output.
    """
    p = Prepared(params, x_q, x_kv, mask, bias, scale)
    return p.guarded(lambda v: _head_outputs(v, params), heads=True)


@float64_scoped
def concat_attention(
    params: AttentionParams,
    x_q: Float[ArrayLike, "... T_q d_model"],
    x_kv: Float[ArrayLike, "... T_k d_model"] | None = None,
    *,
    mask: Bool[ArrayLike, "... T_q T_k"] | None = None,
    bias: Float[ArrayLike, "... T_q T_k"] | None = None,
    scale: float | None = None,
    residual: bool = False,
) -> Float[Array, "... T_q d_model"]:
    """``MultiHead = Concat(head_1, ..., head_H) W_O + b_O`` (Vaswani et al. 2017).

    ``W_O`` is the stacked ``[H * d_v, d_model]`` matrix; ``residual=True`` returns
    ``x_q + MultiHead``.
    """

    def compute(p: Prepared) -> Array:
        z = _heads(p, params)
        h, d_v = params.num_heads, params.d_v
        concat = jnp.swapaxes(z, -3, -2).reshape(*p.batch_shape, p.t_q, h * d_v)
        w_o = jnp.asarray(params.w_o).reshape(h * d_v, params.d_model)
        y = add_output_bias(jnp.matmul(concat, w_o, precision=HIGHEST), params)
        return residual_or(y, p.x_q, residual)

    return Prepared(params, x_q, x_kv, mask, bias, scale).guarded(compute, residual)


@float64_scoped
def per_head_sum_attention(
    params: AttentionParams,
    x_q: Float[ArrayLike, "... T_q d_model"],
    x_kv: Float[ArrayLike, "... T_k d_model"] | None = None,
    *,
    mask: Bool[ArrayLike, "... T_q T_k"] | None = None,
    bias: Float[ArrayLike, "... T_q T_k"] | None = None,
    scale: float | None = None,
    residual: bool = False,
) -> Float[Array, "... T_q d_model"]:
    """``MultiHead = sum_i head_i W_O[i] + b_O``: ``W_O`` split by head, the concat now a sum."""

    def compute(p: Prepared) -> Array:
        y = add_output_bias(jnp.sum(_head_outputs(p, params), axis=-3), params)
        return residual_or(y, p.x_q, residual)

    return Prepared(params, x_q, x_kv, mask, bias, scale).guarded(compute, residual)
