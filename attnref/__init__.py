"""attnref: every equivalent formulation of multi-head attention, a float64 oracle, and proofs.

Conventions (see ``docs/conventions.md``): batch dims lead; row form ``[..., T, d_model]``; the
column form takes and returns ``[..., d_model, T]``; masks are boolean with ``True`` = may attend;
scale ``1/sqrt(d_k)``; a fully masked query row gets zero attention weights (output ``b_O``).

The top level holds the softmax formulations (``<id>_attention(params, x_q, x_kv, ...)`` is the
multi-head row form of registry entry ``<id>``), the kernel level (``dot_product_attention`` and
its helpers) and the registry. The rest lives in namespaces: :mod:`attnref.linear`,
:mod:`attnref.rope`, :mod:`attnref.decode`, :mod:`attnref.distributed`,
:mod:`attnref.interp`, :mod:`attnref.interop`, :mod:`attnref.costs`, :mod:`attnref.models`,
and the NumPy layers :mod:`attnref.oracle` and
:mod:`attnref.tolerance`, and the testing kit :mod:`attnref.testing`,
:mod:`attnref.strategies`, :mod:`attnref.conformance`.

Everything is imported on first use (PEP 562), so ``import attnref.oracle`` and
``import attnref.tolerance`` load NumPy only, and ``import attnref`` loads neither JAX nor
Hypothesis until a name that needs them is touched.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_NAMESPACES = (
    "conformance",
    "costs",
    "decode",
    "distributed",
    "interop",
    "interp",
    "linear",
    "models",
    "oracle",
    "pages",
    "report",
    "rope",
    "strategies",
    "testing",
    "tolerance",
)

# name -> the module that defines it
_EXPORTS = {
    "AttentionParams": "attnref._src.params",
    "init_params": "attnref._src.params",
    "Family": "attnref._src.family",
    "Formulation": "attnref._src.registry",
    "formulations": "attnref._src.registry",
    "get": "attnref._src.registry",
    "ids": "attnref._src.registry",
    "dot_product_attention": "attnref._src.kernel",
    "alibi_bias": "attnref._src.kernel",
    "alibi_slopes": "attnref._src.kernel",
    "blockwise_dot_product_attention": "attnref._src.blockwise",
    "masked_softmax": "attnref._src.softmax",
    "causal_mask": "attnref._src.masks",
    "combine_masks": "attnref._src.masks",
    "mask_to_bias": "attnref._src.masks",
    "padding_mask": "attnref._src.masks",
    "checked": "attnref._src.checked",
    "attention_weights": "attnref._src.standard",
    "head_outputs": "attnref._src.standard",
    "concat_attention": "attnref._src.standard",
    "per_head_sum_attention": "attnref._src.standard",
    "scores_messages_attention": "attnref._src.merged",
    "patterns_messages_attention": "attnref._src.merged",
    "column_attention": "attnref._src.column",
    "column_form": "attnref._src.column",
    "soft_search": "attnref._src.soft_search",
    "soft_search_attention": "attnref._src.soft_search",
    "graph_attention": "attnref._src.graph",
    "graph_message_passing": "attnref._src.graph",
    "edges_from_mask": "attnref._src.graph",
    "blockwise_attention": "attnref._src.kernel_forms",
    "kv_cache_attention": "attnref._src.kernel_forms",
    "state_merge_attention": "attnref._src.state_merge",
    "split_kv_attention": "attnref._src.split_kv",
    "split_kv_dot_product_attention": "attnref._src.split_kv",
    "merge_states": "attnref._src.states",
    "merge_state_stack": "attnref._src.states",
    "check_attention": "attnref.testing",
}

# Old top-level names (before the namespaces): a clear error naming the new place.
_MOVED = {
    **{
        n: f"attnref.linear.{n}"
        for n in [
            "FeatureMap",
            "elu_plus_one",
            "favor_plus",
            "identity_features",
            "relu_features",
            "taylor2",
            "LinearState",
            "linear_state_init",
            "linear_step",
            "linear_quadratic",
            "linear_associative",
            "linear_prefix_sum",
            "linear_recurrent",
            "linear_chunked",
            "linear_messages_attention",
        ]
    },
    **{
        f"linear_{f}_multihead": f"attnref.linear.linear_{f}_attention"
        for f in ("quadratic", "associative", "prefix_sum", "recurrent", "chunked")
    },
    **{
        n: f"attnref.rope.{n}"
        for n in [
            "apply_rope",
            "apply_rope_complex",
            "rope_frequencies",
            "rope_rotation",
            "rope_pattern_matrices",
            "rope_attention",
            "rope_patterns_attention",
        ]
    },
    **{
        n: f"attnref.decode.{n}"
        for n in ["KVCache", "kv_cache_init", "kv_cache_append", "cache_attend", "cached_attention"]
    },
    "decode_multihead": "attnref.decode.decode_attention",
    "mha_cache_init": "attnref.decode.init_cache",
    "mha_cached_attention": "attnref.decode.step",
    "mha_decode_scan": "attnref.decode.scan",
    "mha_generate": "attnref.decode.generate",
    **{
        n: f"attnref.interp.{n}"
        for n in [
            "w_p",
            "w_m",
            "w_a",
            "w_i",
            "messages",
            "patterns",
            "attention_logits",
            "attention_probes",
            "AttentionProbes",
            "residual_update",
            "composition_scores",
            "composition_baseline",
            "top_aligned",
            "FactoredSVD",
            "Refactored",
            "factored_svd",
            "message_svd",
            "pattern_svd",
            "effective_rank",
            "truncation_error",
            "param_count",
            "refactor",
        ]
    },
    **{
        n: f"attnref.interop.{n}"
        for n in [
            "to_flax",
            "from_flax",
            "to_torch_mha",
            "from_torch_mha",
            "to_hf_bert",
            "from_hf_bert",
            "repeat_kv_heads",
        ]
    },
    **{
        n: f"attnref.costs.{n}"
        for n in ["Cost", "Dims", "XlaCounts", "cost", "hlo_dot_flops", "xla_counts"]
    },
    "column_attention_rows": "attnref.column_attention (the native column form is column_form)",
    "graph_attention_rows": "attnref.graph_attention (the edge-list form is graph_message_passing)",
    "blockwise_multihead": "attnref.blockwise_attention (the kernel level is "
    "blockwise_dot_product_attention)",
    "kv_cache_multihead": "attnref.kv_cache_attention",
}

__all__ = [
    "AttentionParams",
    "Family",
    "Formulation",
    "__version__",
    "alibi_bias",
    "alibi_slopes",
    "attention_weights",
    "blockwise_attention",
    "blockwise_dot_product_attention",
    "causal_mask",
    "check_attention",
    "checked",
    "column_attention",
    "column_form",
    "combine_masks",
    "concat_attention",
    "conformance",
    "costs",
    "decode",
    "distributed",
    "dot_product_attention",
    "edges_from_mask",
    "formulations",
    "get",
    "graph_attention",
    "graph_message_passing",
    "head_outputs",
    "ids",
    "init_params",
    "interop",
    "interp",
    "kv_cache_attention",
    "linear",
    "mask_to_bias",
    "masked_softmax",
    "merge_state_stack",
    "merge_states",
    "models",
    "oracle",
    "padding_mask",
    "pages",
    "patterns_messages_attention",
    "per_head_sum_attention",
    "report",
    "rope",
    "scores_messages_attention",
    "soft_search",
    "soft_search_attention",
    "split_kv_attention",
    "split_kv_dot_product_attention",
    "state_merge_attention",
    "strategies",
    "testing",
    "tolerance",
]


def __getattr__(name: str) -> Any:
    if name in _NAMESPACES:
        return importlib.import_module(f"attnref.{name}")
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    if name in _MOVED:
        raise AttributeError(f"attnref.{name} has moved: use {_MOVED[name]}")
    raise AttributeError(f"module 'attnref' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # what type checkers and editors see; at run time the names load lazily
    from attnref import (
        conformance,
        costs,
        decode,
        distributed,
        interop,
        interp,
        linear,
        models,
        oracle,
        pages,
        report,
        rope,
        strategies,
        testing,
        tolerance,
    )
    from attnref._src.blockwise import blockwise_dot_product_attention
    from attnref._src.checked import checked
    from attnref._src.column import column_attention, column_form
    from attnref._src.family import Family
    from attnref._src.graph import edges_from_mask, graph_attention, graph_message_passing
    from attnref._src.kernel import alibi_bias, alibi_slopes, dot_product_attention
    from attnref._src.kernel_forms import blockwise_attention, kv_cache_attention
    from attnref._src.masks import causal_mask, combine_masks, mask_to_bias, padding_mask
    from attnref._src.merged import patterns_messages_attention, scores_messages_attention
    from attnref._src.params import AttentionParams, init_params
    from attnref._src.registry import Formulation, formulations, get, ids
    from attnref._src.soft_search import soft_search, soft_search_attention
    from attnref._src.softmax import masked_softmax
    from attnref._src.split_kv import split_kv_attention, split_kv_dot_product_attention
    from attnref._src.standard import (
        attention_weights,
        concat_attention,
        head_outputs,
        per_head_sum_attention,
    )
    from attnref._src.state_merge import state_merge_attention
    from attnref._src.states import merge_state_stack, merge_states
    from attnref.testing import check_attention
