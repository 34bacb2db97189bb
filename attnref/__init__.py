"""attnref: every equivalent formulation of multi-head attention, a float64 oracle, and proofs.

Conventions (see ``docs/conventions.md``): batch dims lead; row form ``[..., T, d_model]``; the
column form takes and returns ``[..., d_model, T]``; masks are boolean with ``True`` = may attend;
scale ``1/sqrt(d_k)``; a fully masked query row gets zero attention weights (output ``b_O``).

The top level holds the softmax formulations (``<id>_attention(params, x_q, x_kv, ...)`` is the
multi-head row form of registry entry ``<id>``), the kernel level (``dot_product_attention`` and
its helpers) and the registry. The rest lives in namespaces: :mod:`attnref.linear`,
:mod:`attnref.rope`, :mod:`attnref.mla`, :mod:`attnref.decode`, :mod:`attnref.distributed`,
:mod:`attnref.interp`, :mod:`attnref.interop`, :mod:`attnref.costs`, :mod:`attnref.models`, the
NumPy layers :mod:`attnref.oracle` and :mod:`attnref.tolerance`, and the testing kit
:mod:`attnref.testing`, :mod:`attnref.strategies`, :mod:`attnref.conformance`.

Everything is imported on first use (PEP 562), so ``import attnref.oracle`` and
``import attnref.tolerance`` load NumPy only, and ``import attnref`` loads neither JAX nor
Hypothesis until a name that needs them is touched.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# Each export named once: the module that defines it -> its public names. Namespaces are
# submodules of attnref.
_EXPORTS = {
    "attnref._src.core.params": ("AttentionParams", "init_params"),
    "attnref._src.core.family": ("Family",),
    "attnref._src.core.registry": ("Formulation", "formulations", "get", "ids"),
    "attnref._src.core.softmax": ("masked_softmax",),
    "attnref._src.core.masks": ("causal_mask", "combine_masks", "mask_to_bias", "padding_mask"),
    "attnref._src.core.checked": ("checked",),
    "attnref._src.formulations.kernel": ("dot_product_attention",),
    "attnref._src.formulations.alibi": ("alibi_bias", "alibi_slopes"),
    "attnref._src.formulations.blockwise": ("blockwise_dot_product_attention",),
    "attnref._src.formulations.standard": (
        "attention_weights",
        "head_outputs",
        "concat_attention",
        "per_head_sum_attention",
    ),
    "attnref._src.formulations.merged": (
        "scores_messages_attention",
        "patterns_messages_attention",
    ),
    "attnref._src.formulations.column": ("column_attention", "column_form"),
    "attnref._src.formulations.soft_search": ("soft_search", "soft_search_attention"),
    "attnref._src.formulations.graph": (
        "graph_attention",
        "graph_message_passing",
        "edges_from_mask",
    ),
    "attnref._src.formulations.kernel_forms": ("blockwise_attention", "kv_cache_attention"),
    "attnref._src.formulations.state_merge": ("state_merge_attention",),
    "attnref._src.formulations.split_kv": (
        "split_kv_attention",
        "split_kv_dot_product_attention",
    ),
    "attnref._src.formulations.states": ("merge_states", "merge_state_stack"),
    "attnref.testing": ("check_attention",),
}
_NAMESPACES = (
    "conformance",
    "costs",
    "decode",
    "distributed",
    "interop",
    "interp",
    "linear",
    "mla",
    "models",
    "oracle",
    "pages",
    "report",
    "rope",
    "strategies",
    "testing",
    "tolerance",
)
_HOME = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(["__version__", *_HOME, *_NAMESPACES])


def __getattr__(name: str) -> Any:
    if name in _NAMESPACES:
        return importlib.import_module(f"attnref.{name}")
    if name in _HOME:
        value = getattr(importlib.import_module(_HOME[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'attnref' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
