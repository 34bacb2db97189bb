"""Interpretability tools: merged matrices, probes, composition scores and low-rank refactoring.

Row vectors, per head ``i``: ``W_P[i] = W_Q[i] W_K[i]^T`` (pattern), ``W_M[i] = W_V[i] W_O[i]``
(message), and their transposes ``W_A = W_P^T``/``W_I = W_M^T`` in the column notation of
"Attention: All you need to know" (the QK and OV circuits of Elhage et al. 2021, "A Mathematical
Framework for Transformer Circuits", who write ``W_Q^T W_K`` and ``W_OV = W_O W_V``). See
``docs/probes.md`` and ``docs/refactor_minilm.md``.
"""

from attnref._src.core.params import w_a, w_i, w_m, w_p
from attnref._src.formulations.merged import messages, patterns
from attnref._src.interp.composition import composition_baseline, composition_scores, top_aligned
from attnref._src.interp.probes import (
    AttentionProbes,
    attention_logits,
    attention_probes,
    residual_update,
)
from attnref._src.interp.refactor import (
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

__all__ = [
    "AttentionProbes",
    "FactoredSVD",
    "Refactored",
    "attention_logits",
    "attention_probes",
    "composition_baseline",
    "composition_scores",
    "effective_rank",
    "factored_svd",
    "message_svd",
    "messages",
    "param_count",
    "pattern_svd",
    "patterns",
    "refactor",
    "residual_update",
    "top_aligned",
    "truncation_error",
    "w_a",
    "w_i",
    "w_m",
    "w_p",
]
