"""Probes: the model-space quantities of one attention block, for interpretation.

Row convention (``docs/conventions.md``). For query head ``i`` with key/value head
``g = i // G``:

* **logits** ``S_i = scale (X_q W_Q[i] + b_Q[i]) (X_kv W_K[g] + b_K[g])^T + bias`` (masked
  entries ``-inf``), and **scores** ``A_i = softmax(S_i)`` (fully masked rows all zero);
* **patterns** ``P_i = X_q W_P[i] + b_Q[i] W_K[g]^T``: what each query looks for, in model
  space; ``S_i = scale P_i X_kv^T + (terms constant along each row)``;
* **messages** ``M_i = X_kv W_M[i] + b_V[g] W_O[i]``: what each key token would send through head
  ``i`` if attended to;
* **per-head outputs** ``o_i = A_i M_i`` (in model space; ``sum_i o_i + b_O`` is the block
  output);
* the **residual update** ``x_q + sum_i o_i + b_O`` (the residual stream after the block).

Everything is a pure JAX function of static shapes (:func:`attention_probes` runs under
``jax.jit``); :func:`attnref.interp.patterns`, :func:`attnref.interp.messages`,
:func:`attnref.head_outputs` and :func:`attnref.attention_weights` give single quantities.

Seeds: "The Hidden Messages of Multi-Head Attention" (2025-02-17) names the per-head outputs and
messages; "Reframing Attention: A Matrix Decomposition Perspective" (2025-02-18) the patterns and
the residual update ``x' = x + sum_i alpha_i M_i``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, no_type_check

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from attnref._src.core.checks import HIGHEST
from attnref._src.core.common import ROW_PROBES, Prepared, add_output_bias
from attnref._src.core.entry import public
from attnref._src.core.params import AttentionParams
from attnref._src.core.softmax import allowed_entries, masked_softmax
from attnref._src.formulations.merged import compute_messages, compute_patterns
from attnref._src.formulations.standard import logits


def _probe(summary: str, returns: str) -> Callable[[Callable[..., Any]], Any]:
    """The public probe of ``fn(params, rows)`` at :data:`ROW_PROBES` (unguarded)."""
    return lambda fn: public(
        ROW_PROBES, fn, name=fn.__name__, summary=summary, returns=returns, guarded=False
    )


def _masked_logits(raw: Array, mask_h: Array | None) -> Array:
    """``raw`` with the entries outside the softmax (masked, or already ``-inf``) at ``-inf``."""
    allowed = allowed_entries(raw, mask_h)
    return jnp.where(allowed, raw, jnp.asarray(-jnp.inf, raw.dtype))


@_probe(
    "Pre-softmax logits ``scale q_i . k_j + bias`` per query head; masked entries ``-inf``.\n\n"
    "``softmax`` of a row gives :func:`attnref.attention_weights` (a row that is entirely\n"
    "``-inf`` has zero weights by attnref's convention).",
    "``S_i`` for every query head, ``[..., H, T_q, T_k]``: ``-inf`` where the mask is\n"
    "    ``False`` or the bias is ``-inf``.",
)
def attention_logits(params: AttentionParams, p: Prepared) -> Float[Array, "... H T_q T_k"]:
    return _masked_logits(logits(params, p.x_q, p.x_kv, p.bias, p.scale), p.head_mask())


# @no_type_check: no runtime check of the fields (the suite's jaxtyping hook), since JAX rebuilds
# a pytree with any leaves (tree_map results, vmap axes, placeholders).
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
@no_type_check
class AttentionProbes:
    """Every probe of one block on one input (a JAX pytree; shapes for ``x_q [..., T_q, d]``).

    Attributes:
        logits: ``S_i``, ``[..., H, T_q, T_k]`` (masked entries ``-inf``).
        scores: ``A_i = softmax(S_i)``, ``[..., H, T_q, T_k]`` (rows sum to 1 or are all zero).
        patterns: ``P_i``, ``[..., H, T_q, d_model]``.
        messages: ``M_i``, ``[..., H, T_k, d_model]``.
        head_outputs: ``o_i = A_i M_i``, ``[..., H, T_q, d_model]`` (no ``b_O``).
        output: ``sum_i o_i + b_O``, ``[..., T_q, d_model]``.
        residual: ``x_q + output``, ``[..., T_q, d_model]``.
    """

    logits: Array
    scores: Array
    patterns: Array
    messages: Array
    head_outputs: Array
    output: Array
    residual: Array


@_probe(
    "All probes of the block at once (see :class:`AttentionProbes`); ``jax.jit``-able.\n\n"
    "The scores come from the query-key logits, the per-head outputs from scores times messages\n"
    "(``o_i = A_i M_i``, the seeds' order), so ``sum_i o_i + b_O`` is the scores-messages\n"
    "formulation of the block output.",
    "An :class:`AttentionProbes` with every probe (shapes there).",
)
def attention_probes(params: AttentionParams, p: Prepared) -> AttentionProbes:
    raw = logits(params, p.x_q, p.x_kv, p.bias, p.scale)
    mask_h = p.head_mask()
    scores = masked_softmax(raw, mask_h)
    msgs = compute_messages(params, p.x_kv)
    pats = compute_patterns(params, p.x_q)
    per_head = jnp.einsum("...hqk,...hkd->...hqd", scores, msgs, precision=HIGHEST)
    output = add_output_bias(jnp.sum(per_head, axis=-3), params)
    return AttentionProbes(
        logits=_masked_logits(raw, mask_h),
        scores=scores,
        patterns=pats,
        messages=msgs,
        head_outputs=per_head,
        output=output,
        residual=p.x_q + output,
    )


@_probe(
    "``x_q + sum_i A_i M_i + b_O``: the residual stream after the block (seed notation\n"
    "``x' = x + sum_i alpha_i M_i``; ``b_O`` is added once). Equal to every formulation with\n"
    "``residual=True``.",
    "``x_q + output``, ``[..., T_q, d_model]``.",
)
def residual_update(params: AttentionParams, p: Prepared) -> Float[Array, "... T_q d_model"]:
    return attention_probes.formula(params, p).residual
