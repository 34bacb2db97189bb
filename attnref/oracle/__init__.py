"""The float64 NumPy oracle: attention from its definitions, written independently of the JAX code.

NumPy only (never JAX), sharing no code with the JAX formulations, so that agreement is evidence,
not tautology. Every function takes ``method="fast"`` (default: float64 BLAS streamed over query
blocks, extra memory ``O(block x S)``) or ``"definition"`` (one element at a time, the root of
trust); the ``*_vjp`` functions are the gradient oracles, from the analytic backward.

Modules: ``_core`` (weight level), ``_weight_grad`` (its gradients), ``_linear`` and
``_linear_grad`` (linear attention), ``_rope``, ``_mla`` (DeepSeek-V2 latent attention),
``_kernel`` (``dot_product_attention`` with every mask option; ``_kernel_call``, ``_kernel_fast``,
``_kernel_grad``), ``_alibi``, ``_states`` (``merge_states``, ``merge_state_stack`` and their
gradient), ``_paged`` (paged KV cache), ``_checks`` (every refusal, as the JAX twins refuse) and
``_doc`` (the shared Args text).
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
