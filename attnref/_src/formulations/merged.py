"""Merged-matrix formulations: scores x messages and patterns x messages.

Row convention. With ``W_M[i] = W_V[g] W_O[i]`` and ``W_P[i] = W_Q[i] W_K[g]^T`` (both
``d_model x d_model``, one per query head ``i``, ``g = i // G`` its key/value head, ``G = H / K``;
``g = i`` for ordinary multi-head params), the block output is ``sum_i A_i M_i + b_O`` where

* messages ``M_i = X_kv W_M[i] + 1 (b_V[g] W_O[i])`` (what each key token sends through head i);
* patterns ``P_i = X_q W_P[i] + 1 (b_Q[i] W_K[g]^T)`` (what each query looks for in model space),
  logits ``P_i X_kv^T / sqrt(d_k)``. The terms of ``q.k`` that involve ``b_K`` are constant along
  each query row and cancel in the softmax, so ``b_K`` does not appear.

Query heads that share a key/value head share ``W_V`` and ``W_K`` but not ``W_M`` or ``W_P``.

A key or value a query may not read never reaches that query's output or gradients, whatever it
holds: both forms run through :meth:`attnref._src.core.common.Prepared.guarded`.

Seeds: "Refactoring the Attention Equations: Patterns and Messages" (2025-02-19) and
"Reframing Attention: A Matrix Decomposition Perspective" (2025-02-18).
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float

from attnref._src.core import cost as _cost
from attnref._src.core.checks import check_tokens, float64_scoped
from attnref._src.core.common import HIGHEST, Prepared, add_output_bias, prepare_rows, residual_or
from attnref._src.core.params import AttentionParams, repeat_heads, w_m_unchecked, w_p_unchecked
from attnref._src.core.registry import HIDDEN_MESSAGES, REFACTOR, Formulation, register
from attnref._src.core.softmax import masked_softmax
from attnref._src.formulations.standard import weights


def compute_messages(params: AttentionParams, x_kv: Array) -> Float[Array, "... H T_k d_model"]:
    m = jnp.einsum("...td,hde->...hte", x_kv, w_m_unchecked(params), precision=HIGHEST)
    if params.b_v is not None:
        b_v = repeat_heads(params.b_v, params.group_size)  # [H, d_v]: b_V[i // G]
        m = m + jnp.einsum("hv,hvd->hd", b_v, params.w_o, precision=HIGHEST)[:, None, :]
    return m


def compute_patterns(params: AttentionParams, x_q: Array) -> Float[Array, "... H T_q d_model"]:
    p = jnp.einsum("...td,hde->...hte", x_q, w_p_unchecked(params), precision=HIGHEST)
    if params.b_q is not None:
        w_k = repeat_heads(params.w_k, params.group_size)  # [H, d_model, d_k]: W_K[i // G]
        p = p + jnp.einsum("hk,hdk->hd", params.b_q, w_k, precision=HIGHEST)[:, None, :]
    return p


@float64_scoped
def messages(
    params: AttentionParams, x: Float[ArrayLike, "... T d_model"]
) -> Float[Array, "... H T d_model"]:
    """Per-head messages ``M_i = X W_M[i] + b_V[i // G] W_O[i]`` (one row per sending token).

    Args:
        params: Per-head weights (:class:`attnref.AttentionParams`); ``W_M[i] = W_V[i // G]
            W_O[i]`` (:func:`attnref.interp.w_m`).
        x: The sending (key/value) tokens, row vectors ``[..., T, d_model]``, the dtype of
            ``params``.

    Returns:
        ``M_i`` for every query head, ``[..., H, T, d_model]``: row ``j`` is what token ``j``
        sends through head ``i`` (before the attention weights and ``b_O``).

    Raises:
        ValueError: If ``params`` is malformed or ``x`` is not ``[..., T, d_model]``.
        TypeError: If ``x`` and ``params`` have different dtypes.
    """
    check_tokens(params, x, x)
    return compute_messages(params, jnp.asarray(x))


@float64_scoped
def patterns(
    params: AttentionParams, x: Float[ArrayLike, "... T d_model"]
) -> Float[Array, "... H T d_model"]:
    """Per-head patterns ``P_i = X W_P[i] + b_Q[i] W_K[i // G]^T`` (one per querying token).

    Args:
        params: Per-head weights (:class:`attnref.AttentionParams`); ``W_P[i] = W_Q[i]
            W_K[i // G]^T`` (:func:`attnref.interp.w_p`).
        x: The querying tokens, row vectors ``[..., T, d_model]``, the dtype of ``params``.

    Returns:
        ``P_i`` for every query head, ``[..., H, T, d_model]``: row ``t`` is what token ``t``
        looks for in model space; the unscaled logits are ``P_i X_kv^T`` (``b_K`` cancels in the
        softmax and is not included).

    Raises:
        ValueError: If ``params`` is malformed or ``x`` is not ``[..., T, d_model]``.
        TypeError: If ``x`` and ``params`` have different dtypes.
    """
    check_tokens(params, x, x)  # validates params too
    return compute_patterns(params, jnp.asarray(x))


def _mix(a: Array, m: Array, params: AttentionParams) -> Array:
    per_head = jnp.einsum("...hqk,...hkd->...hqd", a, m, precision=HIGHEST)
    return add_output_bias(jnp.sum(per_head, axis=-3), params)


@float64_scoped
def scores_messages_attention(
    params: AttentionParams,
    x_q: Float[ArrayLike, "... T_q d_model"],
    x_kv: Float[ArrayLike, "... T_k d_model"] | None = None,
    *,
    mask: Bool[ArrayLike, "... #T_q #T_k"] | None = None,
    bias: Float[ArrayLike, "... #T_q #T_k"] | None = None,
    scale: float | None = None,
    residual: bool = False,
) -> Float[Array, "... T_q d_model"]:
    """``sum_i softmax(Q_i K_i^T / sqrt(d_k)) (X_kv W_M[i]) + b_O``: scores times messages.

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
        y = _mix(weights(p, params), compute_messages(params, p.x_kv), params)
        return residual_or(y, p.x_q, residual)

    return prepare_rows(params, x_q, x_kv, mask, bias, scale).guarded(compute, residual)


@float64_scoped
def patterns_messages_attention(
    params: AttentionParams,
    x_q: Float[ArrayLike, "... T_q d_model"],
    x_kv: Float[ArrayLike, "... T_k d_model"] | None = None,
    *,
    mask: Bool[ArrayLike, "... #T_q #T_k"] | None = None,
    bias: Float[ArrayLike, "... #T_q #T_k"] | None = None,
    scale: float | None = None,
    residual: bool = False,
) -> Float[Array, "... T_q d_model"]:
    """``sum_i softmax((X_q W_P[i]) X_kv^T / sqrt(d_k)) (X_kv W_M[i]) + b_O``.

    The scale stays ``1/sqrt(d_k)`` although the patterns live in ``d_model`` space.

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
        pat = compute_patterns(params, p.x_q)
        logits = jnp.einsum("...hqd,...kd->...hqk", pat, p.x_kv, precision=HIGHEST)
        a = masked_softmax(p.add_bias(logits * p.scale), p.head_mask())
        y = _mix(a, compute_messages(params, p.x_kv), params)
        return residual_or(y, p.x_q, residual)

    return prepare_rows(params, x_q, x_kv, mask, bias, scale).guarded(compute, residual)


# ----------------------------------------------------------------------------- registry entries


def scores_messages_cost(d: _cost.Dims) -> _cost.Cost:
    b, h, tq, tk = d.batch, d.heads, d.t_q, d.t_k
    pq, pk, _ = _cost.projections(d)
    logits = b * h * tq * tk
    mm_m, el_m = _cost.messages(d)
    mm_x, el_x = _cost.mix(d)
    mm = pq + pk + 2 * logits * d.d_k + mm_m + mm_x
    el = (
        _cost.softmax_elementwise(d)
        + el_m
        + el_x
        + _cost.bias_adds(d, b * tq * h * d.d_k, b * tk * h * d.d_k, 0, 0)
    )
    tensors = [
        b * h * tq * d.d_k,
        b * h * tk * d.d_k,
        *_cost.softmax_tensors(d, logits),
        *_cost.message_tensors(d),
    ]
    return _cost.finish(d, mm, el, logits, tensors)


def patterns_messages_cost(d: _cost.Dims) -> _cost.Cost:
    b, h, dm, tq, tk = d.batch, d.heads, d.d_model, d.t_q, d.t_k
    logits = b * h * tq * tk
    mm_p = (
        2 * h * dm * d.d_k * dm + 2 * b * tq * dm * h * dm + (2 * h * d.d_k * dm if d.bias else 0)
    )
    mm_m, el_m = _cost.messages(d)
    mm_x, el_x = _cost.mix(d)
    mm = mm_p + 2 * logits * dm + mm_m + mm_x
    el = _cost.softmax_elementwise(d) + el_m + el_x + (b * h * tq * dm if d.bias else 0)
    tensors = [
        h * dm * dm,
        b * h * tq * dm,
        b * h * tq * dm,
        *_cost.softmax_tensors(d, logits),
        *_cost.message_tensors(d),
    ]
    return _cost.finish(d, mm, el, logits, tensors)


register(
    Formulation(
        id="scores_messages",
        title="Scores x messages (W_M = W_V W_O)",
        equation=(
            r"\sum_{i=1}^{H} \mathrm{softmax}\!\Big(\frac{Q_i K_i^\top}{\sqrt{d_k}}\Big)\,M_i"
            r" + b_O,\quad M_i = X_{kv} W_{M,i} + \mathbf{1}\, b_{V,i} W_{O,i},"
            r"\quad W_{M,i} = W_{V,i} W_{O,i}"
        ),
        convention="row",
        citation="Messages: " + HIDDEN_MESSAGES + ", which introduces them; " + REFACTOR,
        apply=scores_messages_attention,
        native=scores_messages_attention,
        summary="Value and output projections merged into a d_model x d_model message matrix.",
        cost=(
            "FLOPs O(H d_model^2 d_v) to form W_M, O(H T_k d_model^2) for messages, "
            "O(H T_q T_k d_model) to mix; memory O(H T_k d_model + H T_q T_k). Mixing costs "
            "d_model / d_v times the concat form's."
        ),
        cost_model=scores_messages_cost,
    )
)

register(
    Formulation(
        id="patterns_messages",
        title="Patterns x messages (W_P = W_Q W_K^T)",
        equation=(
            r"\sum_{i=1}^{H} \mathrm{softmax}\!\Big(\frac{P_i X_{kv}^\top}{\sqrt{d_k}}\Big)"
            r"\,M_i + b_O,"
            r"\quad P_i = X_q W_{P,i} + \mathbf{1}\, b_{Q,i} W_{K,i}^\top,"
            r"\quad W_{P,i} = W_{Q,i} W_{K,i}^\top"
        ),
        convention="row",
        citation=REFACTOR,
        apply=patterns_messages_attention,
        native=patterns_messages_attention,
        summary="Query and key projections merged into a pattern matrix; scale stays 1/sqrt(d_k).",
        cost=(
            "FLOPs O(H d_model^2 (d_k + d_v)) to form W_P and W_M, O(H (T_q + T_k) d_model^2) "
            "for patterns and messages, O(H T_q T_k d_model) for logits and mixing; memory "
            "O(H (T_q + T_k) d_model + H T_q T_k)."
        ),
        cost_model=patterns_messages_cost,
    )
)
