"""The float64 NumPy oracle: attention from its definitions, written independently of the JAX code.

This package imports NumPy only (never JAX) and shares no code with the JAX formulations, so that
agreement between the two is evidence, not tautology. Everything is computed in float64.

Every function takes ``method="fast"`` (the default: float64 BLAS, streamed over blocks of query
rows, extra memory ``O(block x S)``) or ``method="definition"`` (one element at a time, the root
of trust the fast path is tested against); the ``*_vjp`` functions are the gradient oracles,
from the analytic backward in both methods.

* :mod:`attnref.oracle._core`: multi-head attention at the weight level.
* :mod:`attnref.oracle._weight_grad`: its gradient oracle (``attention_vjp``,
  ``rope_attention_vjp``).
* :mod:`attnref.oracle._linear`, :mod:`attnref.oracle._linear_grad`: linear attention, its
  feature maps and its gradient oracles.
* :mod:`attnref.oracle._rope`: rotary position embedding and attention with it.
* :mod:`attnref.oracle._mla`: multi-head latent attention (DeepSeek-V2), from the paper.
* :mod:`attnref.oracle._kernel`: the kernel level ``dot_product_attention(q, k, v, ...)`` with
  every mask option (the definition), and the ALiBi helpers; :mod:`attnref.oracle._kernel_call`
  (one validated call, its allowed set by blocks), :mod:`attnref.oracle._kernel_fast` (the fast
  path), :mod:`attnref.oracle._kernel_grad` (``dot_product_attention_vjp``).
* :mod:`attnref.oracle._states`: the attention state algebra (``merge_states``,
  ``merge_state_stack``: the state ``(o, lse)`` of a union of disjoint key sets;
  ``merge_states_vjp``: its gradient, by hand).
* :mod:`attnref.oracle._paged`: attention over a paged KV cache (``paged_attention``: the
  kernel oracle on the keys read through the page table).
* :mod:`attnref.oracle._checks` (every refusal, as the JAX twins refuse) and
  :mod:`attnref.oracle._doc` (the Args text of the oracle and of :mod:`attnref.tolerance`,
  written once per calling convention and attached to each function).
"""

from __future__ import annotations

from ._alibi import alibi_bias, alibi_slopes
from ._core import attention, attention_weights, head_outputs
from ._kernel import dot_product_attention, kernel_allowed
from ._kernel_grad import KernelGrads, dot_product_attention_vjp
from ._linear import features, linear_attention, linear_multihead
from ._linear_grad import (
    LinearGrads,
    LinearMultiheadGrads,
    linear_attention_vjp,
    linear_multihead_vjp,
)
from ._mla import mla_attention, mla_qkv
from ._paged import paged_attention
from ._rope import rope, rope_attention
from ._states import merge_state_stack, merge_states, merge_states_vjp
from ._weight_grad import AttentionGrads, attention_vjp, rope_attention_vjp

__all__ = [
    "AttentionGrads",
    "KernelGrads",
    "LinearGrads",
    "LinearMultiheadGrads",
    "alibi_bias",
    "alibi_slopes",
    "attention",
    "attention_vjp",
    "attention_weights",
    "dot_product_attention",
    "dot_product_attention_vjp",
    "features",
    "head_outputs",
    "kernel_allowed",
    "linear_attention",
    "linear_attention_vjp",
    "linear_multihead",
    "linear_multihead_vjp",
    "merge_state_stack",
    "merge_states",
    "merge_states_vjp",
    "mla_attention",
    "mla_qkv",
    "paged_attention",
    "rope",
    "rope_attention",
    "rope_attention_vjp",
]
