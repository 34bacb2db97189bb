"""The standard formulations: concatenated heads (Vaswani et al. 2017) and the per-head sum.

Row convention: ``x_q [..., T_q, d_model]``, ``x_kv [..., T_k, d_model]``, output
``[..., T_q, d_model]``. With grouped-query parameters (``K`` key/value heads, ``G = H / K``)
query head ``i`` reads key/value head ``i // G``, projected once per group.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jaxtyping import Array, Float

from attnref._src.core import cost as _cost
from attnref._src.core.checks import HIGHEST
from attnref._src.core.common import (
    BLOCK_RETURNS,
    ROW_PROBES,
    ROWS,
    Bias,
    Keys,
    Mask,
    Queries,
    add_output_bias,
    project,
    project_kv,
    residual_or,
)
from attnref._src.core.entry import public
from attnref._src.core.params import AttentionParams
from attnref._src.core.registry import HIDDEN_MESSAGES, REFACTOR, Formulation, register
from attnref._src.core.softmax import masked_softmax

Params = AttentionParams


def concat(
    params: Params, x_q: Queries, x_kv: Keys, mask: Mask, bias: Bias, scale: Array, residual: bool
) -> Float[Array, "... T_q d_model"]:
    """``MultiHead = Concat(head_1, ..., head_H) W_O + b_O``, ``W_O`` ``[H d_v, d_model]``."""
    z = heads(params, x_q, x_kv, mask, bias, scale)  # head_i              [..., H, T_q, d_v]
    h, d_v = params.num_heads, params.d_v
    concat = jnp.swapaxes(z, -3, -2).reshape(*z.shape[:-3], z.shape[-2], h * d_v)
    w_o = jnp.asarray(params.w_o).reshape(h * d_v, params.d_model)
    y = add_output_bias(jnp.matmul(concat, w_o, precision=HIGHEST), params)
    return residual_or(y, x_q, residual)


def per_head_sum(
    params: Params, x_q: Queries, x_kv: Keys, mask: Mask, bias: Bias, scale: Array, residual: bool
) -> Float[Array, "... T_q d_model"]:
    """``MultiHead = sum_i head_i W_O[i] + b_O``: ``W_O`` split by head, the concat a sum."""
    o = head_outputs_of(params, x_q, x_kv, mask, bias, scale)  # [..., H, T_q, d_model]
    return residual_or(add_output_bias(jnp.sum(o, axis=-3), params), x_q, residual)


def logits(
    params: Params, x_q: Queries, x_kv: Keys, bias: Bias, scale: Array
) -> Float[Array, "... H T_q T_k"]:
    """``scale Q_i K_i^T + bias`` per query head, before masking."""
    q = project(x_q, params.w_q, params.b_q)  #                 Q_i   [..., H, T_q, d_k]
    k = project_kv(x_kv, params.w_k, params.b_k, params.group_size)  # K_i [..., H, T_k, d_k]
    s = jnp.einsum("...hqd,...hkd->...hqk", q, k, precision=HIGHEST) * scale
    return s if bias is None else s + jnp.expand_dims(bias, -3)


def weights(
    params: Params, x_q: Queries, x_kv: Keys, mask: Mask, bias: Bias, scale: Array
) -> Float[Array, "... H T_q T_k"]:
    """``A_i = softmax(scale Q_i K_i^T + bias, mask)``; a fully masked row is all zeros."""
    head_mask = None if mask is None else jnp.expand_dims(mask, -3)
    return masked_softmax(logits(params, x_q, x_kv, bias, scale), head_mask)


def heads(
    params: Params, x_q: Queries, x_kv: Keys, mask: Mask, bias: Bias, scale: Array
) -> Float[Array, "... H T_q d_v"]:
    """``head_i = A_i V_i``."""
    v = project_kv(x_kv, params.w_v, params.b_v, params.group_size)  # V_i [..., H, T_k, d_v]
    a = weights(params, x_q, x_kv, mask, bias, scale)
    return jnp.einsum("...hqk,...hkv->...hqv", a, v, precision=HIGHEST)


def head_outputs_of(
    params: Params, x_q: Queries, x_kv: Keys, mask: Mask, bias: Bias, scale: Array
) -> Float[Array, "... H T_q d_model"]:
    """``o_i = head_i W_O[i]`` (no ``b_O``)."""
    z = heads(params, x_q, x_kv, mask, bias, scale)
    return jnp.einsum("...hqv,hvd->...hqd", z, params.w_o, precision=HIGHEST)


# ----------------------------------------------------------------------------- public functions

concat_attention = public(
    ROWS,
    concat,
    name="concat_attention",
    summary="``MultiHead = Concat(head_1, ..., head_H) W_O + b_O`` (Vaswani et al. 2017).",
    returns=BLOCK_RETURNS,
)
per_head_sum_attention = public(
    ROWS,
    per_head_sum,
    name="per_head_sum_attention",
    summary="``MultiHead = sum_i head_i W_O[i] + b_O``: ``W_O`` split by head, the concat a sum.",
    returns=BLOCK_RETURNS,
)
attention_weights = public(
    ROW_PROBES,
    weights,
    name="attention_weights",
    summary="Row-stochastic scores ``A_i = softmax(Q_i K_i^T * scale + bias, mask)`` per head.",
    returns="The weights ``[..., H, T_q, T_k]``, rows summing to 1 (all zeros when fully masked).",
    heads=True,
)
head_outputs = public(
    ROW_PROBES,
    head_outputs_of,
    name="head_outputs",
    summary="Per-head outputs in model space, ``o_i = head_i W_O[i]``; ``sum_i o_i + b_O`` is "
    "the block output.",
    returns="``o_i`` for every query head, ``[..., H, T_q, d_model]`` (zero on a fully masked\n"
    "    row).",
    heads=True,
)


# ----------------------------------------------------------------------------- registry entries

VASWANI = "Vaswani et al. (2017), Attention Is All You Need, NeurIPS."


def concat_cost(d: _cost.Dims) -> _cost.Cost:
    b, h, dm, tq, tk = d.batch, d.heads, d.d_model, d.t_q, d.t_k
    pq, pk, pv = _cost.projections(d)
    logits = b * h * tq * tk
    mm = pq + pk + pv + 2 * logits * (d.d_k + d.d_v) + 2 * b * tq * h * d.d_v * dm
    el = _cost.softmax_elementwise(d) + _cost.qkvo_bias_adds(d)
    qkv = [b * h * tq * d.d_k, b * h * tk * d.d_k, b * h * tk * d.d_v]
    tail = [b * h * tq * d.d_v, b * tq * h * d.d_v, b * tq * dm]  # heads, concat, y
    return _cost.finish(d, mm, el, logits, qkv + _cost.softmax_tensors(d, logits) + tail)


def per_head_sum_cost(d: _cost.Dims) -> _cost.Cost:
    c = concat_cost(d)
    head_sum = d.batch * (d.heads - 1) * d.t_q * d.d_model
    per_head = d.batch * d.heads * d.t_q * d.d_model * d.itemsize
    return dataclasses.replace(
        c,
        elementwise_flops=c.elementwise_flops + head_sum,
        intermediate_bytes=max(c.intermediate_bytes, per_head),
        workspace_bytes=c.workspace_bytes + per_head,
    )


register(
    Formulation(
        id="concat",
        title="Concatenated heads with one W_O",
        equation=(
            r"\mathrm{MultiHead}(X_q, X_{kv}) = \mathrm{Concat}(\mathrm{head}_1,\dots,"
            r"\mathrm{head}_H)\,W_O + b_O,\quad \mathrm{head}_i = \mathrm{softmax}\!\Big("
            r"\frac{Q_i K_i^\top}{\sqrt{d_k}}\Big) V_i"
        ),
        convention="row",
        citation=VASWANI,
        apply=concat_attention,
        native=concat_attention,
        summary="The textbook form: heads concatenated along features, one stacked output matrix.",
        cost=(
            "FLOPs O(H (T_q + T_k) d_model (d_k + d_v) + H T_q T_k (d_k + d_v)); "
            "memory O(H T_q T_k) for the weights."
        ),
        cost_model=concat_cost,
    )
)

register(
    Formulation(
        id="per_head_sum",
        title="Per-head sum of head_i W_O_i",
        equation=(
            r"\mathrm{MultiHead}(X_q, X_{kv}) = \sum_{i=1}^{H} \mathrm{head}_i\, W_{O,i} + b_O,"
            r"\quad \mathrm{head}_i = \mathrm{softmax}\!\Big(\frac{Q_i K_i^\top}{\sqrt{d_k}}"
            r"\Big) V_i"
        ),
        convention="row",
        citation=(
            VASWANI
            + " Split of W_O by head: "
            + HIDDEN_MESSAGES
            + ", which introduces it; "
            + REFACTOR
        ),
        apply=per_head_sum_attention,
        native=per_head_sum_attention,
        summary=(
            "W_O split into per-head blocks; each head writes to model space and the writes add."
        ),
        cost=(
            "As concat, plus O(H T_q d_v d_model) for per-head outputs held before the sum; "
            "memory O(H T_q T_k + H T_q d_model)."
        ),
        cost_model=per_head_sum_cost,
    )
)
