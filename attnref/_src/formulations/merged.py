"""Merged-matrix formulations: scores x messages and patterns x messages.

Row convention. With ``W_M[i] = W_V[g] W_O[i]`` and ``W_P[i] = W_Q[i] W_K[g]^T`` (both
``d_model x d_model``, one per query head ``i``, ``g = i // G`` its key/value head, ``G = H / K``;
``g = i`` for ordinary multi-head params), the block output is ``sum_i A_i M_i + b_O`` where

* messages ``M_i = X_kv W_M[i] + 1 (b_V[g] W_O[i])`` (what each key token sends through head i);
* patterns ``P_i = X_q W_P[i] + 1 (b_Q[i] W_K[g]^T)`` (what each query looks for in model space),
  logits ``P_i X_kv^T / sqrt(d_k)``; ``b_K``'s terms are constant along a query row and cancel.

Seeds: "Refactoring the Attention Equations: Patterns and Messages" (2025-02-19) and
"Reframing Attention: A Matrix Decomposition Perspective" (2025-02-18).
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float

from attnref._src.core import cost as _cost
from attnref._src.core.checks import HIGHEST, check_tokens, device_array, float64_scoped
from attnref._src.core.common import BLOCK_RETURNS, ROWS, add_output_bias, residual_or
from attnref._src.core.entry import compiled, public
from attnref._src.core.params import AttentionParams, repeat_heads, w_m_unchecked, w_p_unchecked
from attnref._src.core.registry import HIDDEN_MESSAGES, REFACTOR, Formulation, register
from attnref._src.core.softmax import masked_softmax
from attnref._src.formulations.standard import Bias, Keys, Mask, Params, Queries, weights


def scores_messages(
    params: Params, x_q: Queries, x_kv: Keys, mask: Mask, bias: Bias, scale: Array, residual: bool
) -> Float[Array, "... T_q d_model"]:
    """``MultiHead = sum_i A_i M_i + b_O``, ``A_i = softmax(scale Q_i K_i^T + bias, mask)``."""
    a = weights(params, x_q, x_kv, mask, bias, scale)  # A_i         [..., H, T_q, T_k]
    m = compute_messages(params, x_kv)  # M_i                       [..., H, T_k, d_model]
    return residual_or(mix(a, m, params), x_q, residual)


def patterns_messages(
    params: Params, x_q: Queries, x_kv: Keys, mask: Mask, bias: Bias, scale: Array, residual: bool
) -> Float[Array, "... T_q d_model"]:
    """``MultiHead = sum_i softmax(scale P_i X_kv^T + bias, mask) M_i + b_O``."""
    p = compute_patterns(params, x_q)  # P_i                        [..., H, T_q, d_model]
    s = jnp.einsum("...hqd,...kd->...hqk", p, x_kv, precision=HIGHEST) * scale
    s = s if bias is None else s + jnp.expand_dims(bias, -3)  #       [..., H, T_q, T_k]
    a = masked_softmax(s, None if mask is None else jnp.expand_dims(mask, -3))
    return residual_or(mix(a, compute_messages(params, x_kv), params), x_q, residual)


def mix(a: Array, m: Array, params: AttentionParams) -> Float[Array, "... T_q d_model"]:
    """``sum_i A_i M_i + b_O``."""
    per_head = jnp.einsum("...hqk,...hkd->...hqd", a, m, precision=HIGHEST)
    return add_output_bias(jnp.sum(per_head, axis=-3), params)


def compute_messages(params: AttentionParams, x_kv: Array) -> Float[Array, "... H T_k d_model"]:
    """``M_i = X_kv W_M[i] + 1 (b_V[g] W_O[i])``."""
    m = jnp.einsum("...td,hde->...hte", x_kv, w_m_unchecked(params), precision=HIGHEST)
    vb = message_bias(params)
    return m if vb is None else m + vb[:, None, :]


def compute_patterns(params: AttentionParams, x_q: Array) -> Float[Array, "... H T_q d_model"]:
    """``P_i = X_q W_P[i] + 1 (b_Q[i] W_K[g]^T)``."""
    p = jnp.einsum("...td,hde->...hte", x_q, w_p_unchecked(params), precision=HIGHEST)
    qb = pattern_bias(params)
    return p if qb is None else p + qb[:, None, :]


def message_bias(params: AttentionParams) -> Float[Array, "H d_model"] | None:
    """``b_V[i // G] W_O[i]`` per query head (``None`` without ``b_V``)."""
    if params.b_v is None:
        return None
    b_v = repeat_heads(params.b_v, params.group_size)  # [H, d_v]: b_V[i // G]
    return jnp.einsum("hv,hvd->hd", b_v, params.w_o, precision=HIGHEST)


def pattern_bias(params: AttentionParams) -> Float[Array, "H d_model"] | None:
    """``b_Q[i] W_K[i // G]^T`` per query head (``None`` without ``b_Q``)."""
    if params.b_q is None:
        return None
    w_k = repeat_heads(params.w_k, params.group_size)  # [H, d_model, d_k]: W_K[i // G]
    return jnp.einsum("hk,hdk->hd", params.b_q, w_k, precision=HIGHEST)


# ----------------------------------------------------------------------------- public functions

_TOKENS_ARGS = """Args:
    params: Per-head weights (:class:`attnref.AttentionParams`); {merged}.
    x: The {who} tokens, row vectors ``[..., T, d_model]``, the dtype of ``params``.

Returns:
    {returns}

Raises:
    ValueError: If ``params`` is malformed or ``x`` is not ``[..., T, d_model]``.
    TypeError: If ``x`` and ``params`` have different dtypes.
"""


@float64_scoped
def messages(
    params: AttentionParams, x: Float[ArrayLike, "... T d_model"]
) -> Float[Array, "... H T d_model"]:
    check_tokens(params, x, x)
    return compiled(compute_messages, params, device_array(x))  # type: ignore[no-any-return]


@float64_scoped
def patterns(
    params: AttentionParams, x: Float[ArrayLike, "... T d_model"]
) -> Float[Array, "... H T d_model"]:
    check_tokens(params, x, x)  # validates params too
    return compiled(compute_patterns, params, device_array(x))  # type: ignore[no-any-return]


messages.__doc__ = (
    "Per-head messages ``M_i = X W_M[i] + b_V[i // G] W_O[i]`` (one row per sending token).\n\n"
    + _TOKENS_ARGS.format(
        merged="``W_M[i] = W_V[i // G] W_O[i]`` (:func:`attnref.interp.w_m`)",
        who="sending (key/value)",
        returns="``M_i`` for every query head, ``[..., H, T, d_model]``: row ``j`` is what token "
        "``j``\n    sends through head ``i`` (before the attention weights and ``b_O``).",
    )
)
patterns.__doc__ = (
    "Per-head patterns ``P_i = X W_P[i] + b_Q[i] W_K[i // G]^T`` (one per querying token).\n\n"
    + _TOKENS_ARGS.format(
        merged="``W_P[i] = W_Q[i] W_K[i // G]^T`` (:func:`attnref.interp.w_p`)",
        who="querying",
        returns="``P_i`` for every query head, ``[..., H, T, d_model]``: row ``t`` is what token "
        "``t``\n    looks for in model space; the unscaled logits are ``P_i X_kv^T`` (``b_K`` "
        "cancels in the\n    softmax and is not included).",
    )
)

scores_messages_attention = public(
    ROWS,
    scores_messages,
    name="scores_messages_attention",
    summary="``sum_i softmax(Q_i K_i^T / sqrt(d_k)) (X_kv W_M[i]) + b_O``: scores times messages.",
    returns=BLOCK_RETURNS,
)
patterns_messages_attention = public(
    ROWS,
    patterns_messages,
    name="patterns_messages_attention",
    summary="``sum_i softmax((X_q W_P[i]) X_kv^T / sqrt(d_k)) (X_kv W_M[i]) + b_O``.\n\n"
    "The scale stays ``1/sqrt(d_k)`` although the patterns live in ``d_model`` space.",
    returns=BLOCK_RETURNS,
)


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
