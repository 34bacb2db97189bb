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
holds: both forms run through :meth:`attnref._src.common.Prepared.guarded`.

Seeds: "Refactoring the Attention Equations: Patterns and Messages" (2025-02-19) and
"Reframing Attention: A Matrix Decomposition Perspective" (2025-02-18).
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float

from attnref._src.checks import check_params, check_tokens, float64_scoped
from attnref._src.common import HIGHEST, Prepared, add_output_bias, residual_or
from attnref._src.params import AttentionParams, repeat_heads, w_m, w_p
from attnref._src.softmax import masked_softmax
from attnref._src.standard import _weights


def _messages(params: AttentionParams, x_kv: Array) -> Float[Array, "... H T_k d_model"]:
    m = jnp.einsum("...td,hde->...hte", x_kv, w_m(params), precision=HIGHEST)
    if params.b_v is not None:
        b_v = repeat_heads(params.b_v, params.group_size)  # [H, d_v]: b_V[i // G]
        m = m + jnp.einsum("hv,hvd->hd", b_v, params.w_o, precision=HIGHEST)[:, None, :]
    return m


def _patterns(params: AttentionParams, x_q: Array) -> Float[Array, "... H T_q d_model"]:
    p = jnp.einsum("...td,hde->...hte", x_q, w_p(params), precision=HIGHEST)
    if params.b_q is not None:
        w_k = repeat_heads(params.w_k, params.group_size)  # [H, d_model, d_k]: W_K[i // G]
        p = p + jnp.einsum("hk,hdk->hd", params.b_q, w_k, precision=HIGHEST)[:, None, :]
    return p


@float64_scoped
def messages(
    params: AttentionParams, x: Float[ArrayLike, "... T d_model"]
) -> Float[Array, "... H T d_model"]:
    """Per-head messages ``M_i = X W_M[i] + b_V[i // G] W_O[i]`` (one row per sending token)."""
    check_tokens(params, x, x)
    return _messages(params, jnp.asarray(x))


@float64_scoped
def patterns(
    params: AttentionParams, x: Float[ArrayLike, "... T d_model"]
) -> Float[Array, "... H T d_model"]:
    """Per-head patterns ``P_i = X W_P[i] + b_Q[i] W_K[i // G]^T`` (one per querying token)."""
    check_params(params)
    check_tokens(params, x, x)
    return _patterns(params, jnp.asarray(x))


def _mix(a: Array, m: Array, params: AttentionParams) -> Array:
    per_head = jnp.einsum("...hqk,...hkd->...hqd", a, m, precision=HIGHEST)
    return add_output_bias(jnp.sum(per_head, axis=-3), params)


@float64_scoped
def scores_messages_attention(
    params: AttentionParams,
    x_q: Float[ArrayLike, "... T_q d_model"],
    x_kv: Float[ArrayLike, "... T_k d_model"] | None = None,
    *,
    mask: Bool[ArrayLike, "... T_q T_k"] | None = None,
    bias: Float[ArrayLike, "... T_q T_k"] | None = None,
    scale: float | None = None,
    residual: bool = False,
) -> Float[Array, "... T_q d_model"]:
    """``sum_i softmax(Q_i K_i^T / sqrt(d_k)) (X_kv W_M[i]) + b_O``: scores times messages."""

    def compute(p: Prepared) -> Array:
        y = _mix(_weights(p, params), _messages(params, p.x_kv), params)
        return residual_or(y, p.x_q, residual)

    return Prepared(params, x_q, x_kv, mask, bias, scale).guarded(compute, residual)


@float64_scoped
def patterns_messages_attention(
    params: AttentionParams,
    x_q: Float[ArrayLike, "... T_q d_model"],
    x_kv: Float[ArrayLike, "... T_k d_model"] | None = None,
    *,
    mask: Bool[ArrayLike, "... T_q T_k"] | None = None,
    bias: Float[ArrayLike, "... T_q T_k"] | None = None,
    scale: float | None = None,
    residual: bool = False,
) -> Float[Array, "... T_q d_model"]:
    """``sum_i softmax((X_q W_P[i]) X_kv^T / sqrt(d_k)) (X_kv W_M[i]) + b_O``.

    The scale stays ``1/sqrt(d_k)`` although the patterns live in ``d_model`` space.
    """

    def compute(p: Prepared) -> Array:
        pat = _patterns(params, p.x_q)
        logits = jnp.einsum("...hqd,...kd->...hqk", pat, p.x_kv, precision=HIGHEST)
        a = masked_softmax(p.add_bias(logits * p.scale), p.head_mask())
        y = _mix(a, _messages(params, p.x_kv), params)
        return residual_or(y, p.x_q, residual)

    return Prepared(params, x_q, x_kv, mask, bias, scale).guarded(compute, residual)
