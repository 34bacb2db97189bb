"""The pure-JAX BERT encoder (``attnref.models.bert``) on a tiny random model; no extra needed.

A NumPy forward pass written from Hugging Face's ``BertModel`` semantics (``nn.Linear`` (out, in)
weights, post-LN, erf GELU, mean pooling over the attention mask, L2 normalisation) is the
reference. Tolerance: FlashAttention's comparative rule (``attnref.testing.assert_comparative``):
the float32 JAX encoder's error against the float64 NumPy pass is at most twice the error of the
same NumPy pass run in float32 (a same-precision computation in a different order), plus
``gamma_2(u_32)`` times the output's magnitude.
"""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import attnref
from attnref.models import (
    BertConfig,
    bert_from_state_dict,
    bert_hidden_states,
    layer_attention,
    make_encoder,
    require_models_extra,
    with_attention,
)
from attnref.testing import assert_comparative

CFG = BertConfig(
    num_layers=2,
    num_heads=2,
    d_model=8,
    d_ff=16,
    vocab_size=20,
    max_positions=16,
    layer_norm_eps=1e-12,
)


def random_state_dict(seed: int, cfg: BertConfig = CFG, prefix: str = "") -> dict:
    rng = np.random.default_rng(seed)
    d, f = cfg.d_model, cfg.d_ff

    def n(*shape, s=0.3):
        return rng.standard_normal(shape) * s

    sd = {
        "embeddings.word_embeddings.weight": n(cfg.vocab_size, d, s=1.0),
        "embeddings.position_embeddings.weight": n(cfg.max_positions, d, s=0.5),
        "embeddings.token_type_embeddings.weight": n(2, d, s=0.5),
        "embeddings.LayerNorm.weight": 1 + n(d, s=0.1),
        "embeddings.LayerNorm.bias": n(d, s=0.1),
    }
    for i in range(cfg.num_layers):
        p = f"encoder.layer.{i}."
        for name in ("query", "key", "value"):
            sd[p + f"attention.self.{name}.weight"] = n(d, d)
            sd[p + f"attention.self.{name}.bias"] = n(d, s=0.1)
        sd[p + "attention.output.dense.weight"] = n(d, d)
        sd[p + "attention.output.dense.bias"] = n(d, s=0.1)
        sd[p + "attention.output.LayerNorm.weight"] = 1 + n(d, s=0.1)
        sd[p + "attention.output.LayerNorm.bias"] = n(d, s=0.1)
        sd[p + "intermediate.dense.weight"] = n(f, d)
        sd[p + "intermediate.dense.bias"] = n(f, s=0.1)
        sd[p + "output.dense.weight"] = n(d, f)
        sd[p + "output.dense.bias"] = n(d, s=0.1)
        sd[p + "output.LayerNorm.weight"] = 1 + n(d, s=0.1)
        sd[p + "output.LayerNorm.bias"] = n(d, s=0.1)
    return {prefix + k: v for k, v in sd.items()}


def numpy_bert(sd: dict, ids: np.ndarray, mask: np.ndarray, cfg: BertConfig, dtype) -> np.ndarray:
    """Hugging Face BertModel + sentence-transformers mean pooling and Normalize, in NumPy."""
    erf = np.vectorize(math.erf)

    def g(k):
        return np.asarray(sd[k], dtype)

    def ln(x, name):
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        return (x - mu) / np.sqrt(var + dtype(cfg.layer_norm_eps)) * g(name + ".weight") + g(
            name + ".bias"
        )

    def lin(x, name):
        return x @ g(name + ".weight").T + g(name + ".bias")

    b, t = ids.shape
    h = (
        g("embeddings.word_embeddings.weight")[ids]
        + g("embeddings.position_embeddings.weight")[:t]
        + g("embeddings.token_type_embeddings.weight")[0]
    )
    h = ln(h, "embeddings.LayerNorm")
    ext = np.where(mask[:, None, None, :] > 0, 0.0, -np.inf).astype(dtype)  # [B, 1, 1, T]
    hd = cfg.d_model // cfg.num_heads
    for i in range(cfg.num_layers):
        p = f"encoder.layer.{i}."

        def heads(x, name, p=p):
            return (
                lin(x, p + f"attention.self.{name}")
                .reshape(b, t, cfg.num_heads, hd)
                .transpose(0, 2, 1, 3)
            )

        q, k, v = heads(h, "query"), heads(h, "key"), heads(h, "value")
        s = q @ k.transpose(0, 1, 3, 2) / dtype(math.sqrt(hd)) + ext
        a = np.exp(s - s.max(-1, keepdims=True))
        a = a / a.sum(-1, keepdims=True)
        ctx = (a @ v).transpose(0, 2, 1, 3).reshape(b, t, cfg.d_model)
        h = ln(h + lin(ctx, p + "attention.output.dense"), p + "attention.output.LayerNorm")
        m = lin(h, p + "intermediate.dense")
        m = (m * 0.5 * (1.0 + erf(m / math.sqrt(2.0)))).astype(dtype)
        h = ln(h + lin(m, p + "output.dense"), p + "output.LayerNorm")
    w = mask[..., None].astype(dtype)
    pooled = (h * w).sum(1) / w.sum(1)
    return pooled / np.linalg.norm(pooled, axis=-1, keepdims=True)


def batch(seed: int, b: int = 3, t: int = 7) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, CFG.vocab_size, (b, t)).astype(np.int32)
    lengths = rng.integers(2, t + 1, b)
    lengths[0] = t
    mask = (np.arange(t) < lengths[:, None]).astype(np.int32)
    return np.where(mask > 0, ids, 0).astype(np.int32), mask


@given(seed=st.integers(0, 2**31 - 1), fid=st.sampled_from(attnref.ids("softmax")))
def test_encoder_matches_numpy_bert(seed, fid):
    sd = random_state_dict(seed)
    ids, mask = batch(seed)
    weights = bert_from_state_dict(sd, CFG)
    got = np.asarray(make_encoder(CFG, fid)(weights.astype(np.float32), ids, mask))
    assert got.dtype == np.float32
    ref64 = numpy_bert(sd, ids, mask, CFG, np.float64)
    ref32 = numpy_bert(sd, ids, mask, CFG, np.float32)
    assert_comparative(got, ref64, ref32, dtype=np.float32, label=fid)
    got64 = np.asarray(make_encoder(CFG, "concat")(weights.astype(np.float64), ids, mask))
    assert got64.dtype == np.float64


def test_padding_does_not_change_embeddings_and_all_layers():
    sd = random_state_dict(3)
    w = bert_from_state_dict(sd, CFG).astype(np.float64)
    ids, mask = batch(3, b=2, t=5)
    pad_ids = np.concatenate([ids, np.zeros((2, 3), np.int32)], axis=1)
    pad_mask = np.concatenate([mask, np.zeros((2, 3), np.int32)], axis=1)
    enc = make_encoder(CFG)
    # Padded keys and pooled positions contribute exact zeros, so the padded run must meet the
    # same rule as the unpadded one in test_encoder_matches_numpy_bert: FlashAttention's
    # comparative rule against the float64 NumPy BERT on the unpadded batch, with the float32
    # NumPy BERT as the same-precision reference.
    padded = np.asarray(enc(w.astype(np.float32), pad_ids, pad_mask))
    ref64 = numpy_bert(sd, ids, mask, CFG, np.float64)
    ref32 = numpy_bert(sd, ids, mask, CFG, np.float32)
    assert_comparative(padded, ref64, ref32, dtype=np.float32, label="padded batch")
    with jax.enable_x64(True):
        hs = np.asarray(bert_hidden_states(w, ids, mask, config=CFG, all_layers=True))
        last = np.asarray(bert_hidden_states(w, ids, mask, config=CFG))
    assert hs.shape == (CFG.num_layers + 1, 2, 5, CFG.d_model)
    np.testing.assert_array_equal(hs[-1], last)


def test_loader_prefix_layers_and_with_attention():
    sd = random_state_dict(5, prefix="bert.")
    w = bert_from_state_dict(sd, CFG, prefix="bert.")
    layers = layer_attention(w)
    assert len(layers) == CFG.num_layers
    back = attnref.to_hf_bert(layers[1], prefix="bert.encoder.layer.1.attention.")
    for key, value in back.items():
        np.testing.assert_array_equal(value, sd[key])
    swapped = with_attention(w, layers[::-1])
    np.testing.assert_array_equal(layer_attention(swapped)[0].w_q, layers[1].w_q)
    with pytest.raises(KeyError, match="missing"):
        bert_from_state_dict({}, CFG)


def test_config_and_errors():
    cfg = BertConfig.from_hf(
        dict(
            num_hidden_layers=6,
            num_attention_heads=12,
            hidden_size=384,
            intermediate_size=1536,
            vocab_size=30522,
            max_position_embeddings=512,
        )
    )
    assert cfg.layer_norm_eps == 1e-12
    with pytest.raises(ValueError, match="gelu"):
        BertConfig.from_hf(dict(hidden_act="relu"))
    with pytest.raises(KeyError, match="unknown formulation"):
        make_encoder(CFG, "no_such_form")
    w = bert_from_state_dict(random_state_dict(0), CFG)
    ids, mask = batch(0)
    with pytest.raises(ValueError, match="softmax"):
        bert_hidden_states(w, ids, mask, config=CFG, formulation=attnref.ids("linear")[0])


def test_missing_extra_names_the_extra():
    with pytest.raises(ImportError, match=r"attnref\[models\]"):
        require_models_extra("attnref_no_such_module_for_this_test")
