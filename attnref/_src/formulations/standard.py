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

import dataclasses

import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float

from attnref._src.core import cost as _cost
from attnref._src.core.checks import float64_scoped
from attnref._src.core.common import (
    HIGHEST,
    Prepared,
    add_output_bias,
    prepare_rows,
    project,
    project_kv,
    residual_or,
)
from attnref._src.core.params import AttentionParams
from attnref._src.core.registry import HIDDEN_MESSAGES, REFACTOR, Formulation, register
from attnref._src.core.softmax import masked_softmax


def logits(p: Prepared, params: AttentionParams) -> Float[Array, "... H T_q T_k"]:
    """``scale q_i . k_j + bias`` per query head, before masking."""
    q = project(p.x_q, params.w_q, params.b_q)
    k = project_kv(p.x_kv, params.w_k, params.b_k, params.group_size)
    return p.add_bias(jnp.einsum("...hqd,...hkd->...hqk", q, k, precision=HIGHEST) * p.scale)


def weights(p: Prepared, params: AttentionParams) -> Float[Array, "... H T_q T_k"]:
    return masked_softmax(logits(p, params), p.head_mask())


def _heads(p: Prepared, params: AttentionParams) -> Float[Array, "... H T_q d_v"]:
    v = project_kv(p.x_kv, params.w_v, params.b_v, params.group_size)
    return jnp.einsum("...hqk,...hkv->...hqv", weights(p, params), v, precision=HIGHEST)


def _head_outputs(p: Prepared, params: AttentionParams) -> Float[Array, "... H T_q d_model"]:
    return jnp.einsum("...hqv,hvd->...hqd", _heads(p, params), params.w_o, precision=HIGHEST)


@float64_scoped
def attention_weights(
    params: AttentionParams,
    x_q: Float[ArrayLike, "... T_q d_model"],
    x_kv: Float[ArrayLike, "... T_k d_model"] | None = None,
    *,
    mask: Bool[ArrayLike, "... #T_q #T_k"] | None = None,
    bias: Float[ArrayLike, "... #T_q #T_k"] | None = None,
    scale: float | None = None,
) -> Float[Array, "... H T_q T_k"]:
    """Row-stochastic scores ``A_i = softmax(Q_i K_i^T * scale + bias, mask)`` per query head.

    Fully masked rows are all zeros.

    Args:
        params: Per-head weights (:class:`attnref.AttentionParams`), ``w_q [H, d_model, d_k]``,
            ``w_k [K, d_model, d_k]`` with ``K`` dividing ``H`` (grouped-query heads allowed).
        x_q: Query tokens, row vectors ``[..., T_q, d_model]``, the dtype of ``params``.
        x_kv: Key/value tokens ``[..., T_k, d_model]`` with the batch shape of ``x_q``;
            ``None`` (default) means ``x_q`` (self-attention).
        mask: Boolean, broadcastable to ``[..., T_q, T_k]``, ``True`` = may attend; ``None``
            (default) allows every pair.
        bias: Floating additive bias, broadcastable to ``[..., T_q, T_k]``, added to the scaled
            logits (``-inf`` masks like ``False``); cast to the dtype of ``x_q``.
        scale: The logit scale; ``None`` (default) means ``1/sqrt(d_k)``.

    Returns:
        The attention weights ``[..., H, T_q, T_k]`` (one row per query, summing to 1 over the
        keys, or all zeros for a fully masked row).

    Raises:
        ValueError: If ``params`` is malformed, ``x_q``/``x_kv`` have rank < 2, the wrong
            ``d_model`` or different batch shapes, ``mask``/``bias`` do not broadcast to
            ``[..., T_q, T_k]``, or ``scale`` is not a scalar.
        TypeError: If ``x_q``, ``x_kv`` and ``params`` mix dtypes, ``mask`` is not boolean,
            ``bias`` is not floating, or ``scale`` is not a real number.
    """
    p = prepare_rows(params, x_q, x_kv, mask, bias, scale)
    return p.guarded(lambda v: weights(v, params), heads=True)


@float64_scoped
def head_outputs(
    params: AttentionParams,
    x_q: Float[ArrayLike, "... T_q d_model"],
    x_kv: Float[ArrayLike, "... T_k d_model"] | None = None,
    *,
    mask: Bool[ArrayLike, "... #T_q #T_k"] | None = None,
    bias: Float[ArrayLike, "... #T_q #T_k"] | None = None,
    scale: float | None = None,
) -> Float[Array, "... H T_q d_model"]:
    """Per-head outputs in model space, ``o_i = head_i W_O[i]`` (no ``b_O``).

    ``sum_i o_i + b_O`` is the block output.

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

    Returns:
        ``o_i`` for every query head, ``[..., H, T_q, d_model]``; a fully masked query row is
        zero in every head.

    Raises:
        ValueError: If ``params`` is malformed, ``x_q``/``x_kv`` have rank < 2, the wrong
            ``d_model`` or different batch shapes, ``mask``/``bias`` do not broadcast to
            ``[..., T_q, T_k]``, or ``scale`` is not a scalar.
        TypeError: If ``x_q``, ``x_kv`` and ``params`` mix dtypes, ``mask`` is not boolean,
            ``bias`` is not floating, or ``scale`` is not a real number.
    """
    p = prepare_rows(params, x_q, x_kv, mask, bias, scale)
    return p.guarded(lambda v: _head_outputs(v, params), heads=True)


@float64_scoped
def concat_attention(
    params: AttentionParams,
    x_q: Float[ArrayLike, "... T_q d_model"],
    x_kv: Float[ArrayLike, "... T_k d_model"] | None = None,
    *,
    mask: Bool[ArrayLike, "... #T_q #T_k"] | None = None,
    bias: Float[ArrayLike, "... #T_q #T_k"] | None = None,
    scale: float | None = None,
    residual: bool = False,
) -> Float[Array, "... T_q d_model"]:
    """``MultiHead = Concat(head_1, ..., head_H) W_O + b_O`` (Vaswani et al. 2017).

    ``W_O`` is the stacked ``[H * d_v, d_model]`` matrix; ``residual=True`` returns
    ``x_q + MultiHead``.

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

    def compute(p: Prepared) -> Array:
        z = _heads(p, params)
        h, d_v = params.num_heads, params.d_v
        concat = jnp.swapaxes(z, -3, -2).reshape(*p.batch_shape, p.t_q, h * d_v)
        w_o = jnp.asarray(params.w_o).reshape(h * d_v, params.d_model)
        y = add_output_bias(jnp.matmul(concat, w_o, precision=HIGHEST), params)
        return residual_or(y, p.x_q, residual)

    return prepare_rows(params, x_q, x_kv, mask, bias, scale).guarded(compute, residual)


@float64_scoped
def per_head_sum_attention(
    params: AttentionParams,
    x_q: Float[ArrayLike, "... T_q d_model"],
    x_kv: Float[ArrayLike, "... T_k d_model"] | None = None,
    *,
    mask: Bool[ArrayLike, "... #T_q #T_k"] | None = None,
    bias: Float[ArrayLike, "... #T_q #T_k"] | None = None,
    scale: float | None = None,
    residual: bool = False,
) -> Float[Array, "... T_q d_model"]:
    """``MultiHead = sum_i head_i W_O[i] + b_O``: ``W_O`` split by head, the concat now a sum.

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

    def compute(p: Prepared) -> Array:
        y = add_output_bias(jnp.sum(_head_outputs(p, params), axis=-3), params)
        return residual_or(y, p.x_q, residual)

    return prepare_rows(params, x_q, x_kv, mask, bias, scale).guarded(compute, residual)


# ----------------------------------------------------------------------------- registry entries

VASWANI = "Vaswani et al. (2017), Attention Is All You Need, NeurIPS."


def concat_cost(d: _cost.Dims) -> _cost.Cost:
    b, h, dm, tq, tk = d.batch, d.heads, d.d_model, d.t_q, d.t_k
    pq, pk, pv = _cost.projections(d)
    logits = b * h * tq * tk
    mm = pq + pk + pv + 2 * logits * (d.d_k + d.d_v) + 2 * b * tq * h * d.d_v * dm
    el = _cost.softmax_elementwise(d) + _cost.bias_adds(
        d, b * tq * h * d.d_k, b * tk * h * d.d_k, b * tk * h * d.d_v, b * tq * dm
    )
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
