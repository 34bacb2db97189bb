"""attnref: every equivalent formulation of multi-head attention, a float64 oracle, and proofs.

Conventions (see ``docs/conventions.md``): batch dims lead; row form ``[..., T, d_model]``; the
column form takes and returns ``[..., d_model, T]``; masks are boolean with ``True`` = may attend;
scale ``1/sqrt(d_k)``; a fully masked query row gets zero attention weights (output ``b_O``).
"""

from attnref import oracle, strategies, testing, tolerance
from attnref._src import catalog as _catalog  # noqa: F401  (registers the formulations)
from attnref._src.blockwise import blockwise_attention
from attnref._src.checked import checked
from attnref._src.column import column_attention, column_attention_rows
from attnref._src.composition import composition_baseline, composition_scores, top_aligned
from attnref._src.cost import Cost, Dims, XlaCounts, cost, hlo_dot_flops, xla_counts
from attnref._src.decode import (
    KVCache,
    cache_attend,
    cached_attention,
    kv_cache_append,
    kv_cache_init,
    mha_cache_init,
    mha_cached_attention,
    mha_decode_scan,
    mha_generate,
)
from attnref._src.feature_maps import (
    FeatureMap,
    elu_plus_one,
    favor_plus,
    identity_features,
    relu_features,
    taylor2,
)
from attnref._src.graph import edges_from_mask, graph_attention, graph_attention_rows
from attnref._src.kernel import alibi_bias, alibi_slopes, dot_product_attention
from attnref._src.kernel_forms import blockwise_multihead, decode_multihead, kv_cache_multihead
from attnref._src.linear import (
    LinearState,
    linear_associative,
    linear_associative_multihead,
    linear_chunked,
    linear_chunked_multihead,
    linear_messages_attention,
    linear_prefix_sum,
    linear_prefix_sum_multihead,
    linear_quadratic,
    linear_quadratic_multihead,
    linear_recurrent,
    linear_recurrent_multihead,
    linear_state_init,
    linear_step,
)
from attnref._src.masks import causal_mask, combine_masks, mask_to_bias, padding_mask
from attnref._src.merged import (
    messages,
    patterns,
    patterns_messages_attention,
    scores_messages_attention,
)
from attnref._src.params import (
    AttentionParams,
    from_flax,
    from_hf_bert,
    from_torch_mha,
    init_params,
    repeat_kv_heads,
    to_flax,
    to_hf_bert,
    to_torch_mha,
    w_a,
    w_i,
    w_m,
    w_p,
)
from attnref._src.probes import (
    AttentionProbes,
    attention_logits,
    attention_probes,
    residual_update,
)
from attnref._src.refactor import (
    FactoredSVD,
    Refactored,
    effective_rank,
    factored_svd,
    message_svd,
    param_count,
    pattern_svd,
    refactor,
    truncation_error,
)
from attnref._src.registry import Formulation, formulations, get, ids
from attnref._src.rope import (
    apply_rope,
    apply_rope_complex,
    rope_attention,
    rope_frequencies,
    rope_pattern_matrices,
    rope_patterns_attention,
    rope_rotation,
)
from attnref._src.soft_search import soft_search, soft_search_attention
from attnref._src.softmax import masked_softmax
from attnref._src.standard import (
    attention_weights,
    concat_attention,
    head_outputs,
    per_head_sum_attention,
)
from attnref.testing import check_attention

__version__ = "0.1.0"

__all__ = [
    "AttentionParams",
    "AttentionProbes",
    "Cost",
    "Dims",
    "FactoredSVD",
    "FeatureMap",
    "Formulation",
    "KVCache",
    "LinearState",
    "Refactored",
    "XlaCounts",
    "alibi_bias",
    "alibi_slopes",
    "apply_rope",
    "apply_rope_complex",
    "attention_logits",
    "attention_probes",
    "attention_weights",
    "blockwise_attention",
    "blockwise_multihead",
    "cache_attend",
    "cached_attention",
    "causal_mask",
    "check_attention",
    "checked",
    "column_attention",
    "column_attention_rows",
    "combine_masks",
    "composition_baseline",
    "composition_scores",
    "concat_attention",
    "cost",
    "decode_multihead",
    "dot_product_attention",
    "edges_from_mask",
    "effective_rank",
    "elu_plus_one",
    "factored_svd",
    "favor_plus",
    "formulations",
    "from_flax",
    "from_hf_bert",
    "from_torch_mha",
    "get",
    "graph_attention",
    "graph_attention_rows",
    "head_outputs",
    "hlo_dot_flops",
    "identity_features",
    "ids",
    "init_params",
    "kv_cache_append",
    "kv_cache_init",
    "kv_cache_multihead",
    "linear_associative",
    "linear_associative_multihead",
    "linear_chunked",
    "linear_chunked_multihead",
    "linear_messages_attention",
    "linear_prefix_sum",
    "linear_prefix_sum_multihead",
    "linear_quadratic",
    "linear_quadratic_multihead",
    "linear_recurrent",
    "linear_recurrent_multihead",
    "linear_state_init",
    "linear_step",
    "mask_to_bias",
    "masked_softmax",
    "message_svd",
    "messages",
    "mha_cache_init",
    "mha_cached_attention",
    "mha_decode_scan",
    "mha_generate",
    "oracle",
    "padding_mask",
    "param_count",
    "pattern_svd",
    "patterns",
    "patterns_messages_attention",
    "per_head_sum_attention",
    "refactor",
    "relu_features",
    "repeat_kv_heads",
    "residual_update",
    "rope_attention",
    "rope_frequencies",
    "rope_pattern_matrices",
    "rope_patterns_attention",
    "rope_rotation",
    "scores_messages_attention",
    "soft_search",
    "soft_search_attention",
    "strategies",
    "taylor2",
    "testing",
    "to_flax",
    "to_hf_bert",
    "to_torch_mha",
    "tolerance",
    "top_aligned",
    "truncation_error",
    "w_a",
    "w_i",
    "w_m",
    "w_p",
    "xla_counts",
]
