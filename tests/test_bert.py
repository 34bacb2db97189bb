"""The pure-JAX BERT encoder (``attnref.models.bert``) on a tiny random model; no extra needed.

A NumPy forward pass written from Hugging Face's ``BertModel`` semantics (``nn.Linear`` (out, in)
weights, post-LN, erf GELU, mean pooling over the attention mask, L2 normalisation) is the
reference, run in float64 on the float32-rounded weights. Tolerance: a derived componentwise
first-order bound for the whole encoder (:func:`encoder_error_bound`; ``docs/tolerances.md``,
"The BERT encoder"): every intermediate's rounding error, carried to the output by the float64
Jacobian. The same NumPy pass run in float32 (another operation order) must meet it too.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import attnref
from attnref.models import (
    BertConfig,
    BertWeights,
    bert_from_state_dict,
    bert_hidden_states,
    layer_attention,
    make_encoder,
    require_models_extra,
    with_attention,
)
from attnref.testing import assert_within_bound
from attnref.tolerance import C_EXP, attention_local_errors, gamma, unit_roundoff

HIGHEST = jax.lax.Precision.HIGHEST  # full-precision matmuls, as attnref's own

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


def rounded_state_dict(seed: int) -> dict:
    """``random_state_dict(seed)`` rounded to float32 (held as float64): both the float32 encoder
    and the float64 reference then see the same weights, so only arithmetic error is compared."""
    return {
        k: np.asarray(v, np.float32).astype(np.float64) for k, v in random_state_dict(seed).items()
    }


# ------------------------------------------------------------------------------ the derived bound
# First-order running-error analysis of the whole encoder, componentwise (docs/tolerances.md,
# "BERT encoder"): if the float32 encoder rounds intermediate z_k with an error of at most e_k
# (given exact inputs to that operation), then to first order in u
#
#     |y_32 - y| <= sum_k |dy/dz_k| e_k      (|dy/dz_k| the float64 Jacobian, jax.jacrev)
#
# The old rule (FlashAttention's: 2 x the float32 NumPy pass's error + gamma_2(u) max|y|) misses
# the middle of this sum: its floor is one output rounding, but every intermediate's rounding is
# carried to the output by the layers after it, amplified by LayerNorm's 1/sigma, the GELU slope,
# the attention weights and the final 1/|pooled|. When the float32 NumPy pass is lucky its error
# does not stand in for those terms and the rule fails (0.2% of examples, up to 1.9x).
#
# Local errors e_k (u = 2^-24; gamma_n = n u / (1 - n u), Higham 2002, 3.1 and 3.5):
#   * +, -, *, /, sqrt, one rounding: u |z|; the embedding sum (a + b) + c is two sites;
#   * x @ W + b: gamma_n |x| @ |W| (n inner terms, any order), then u |z| for the bias add;
#   * mean of d terms: gamma_d mean|x| (d - 1 adds, one division); pooled sum of T rows:
#     gamma_{T-1} sum|h|; sum of d squares: gamma_{d-1} sum;
#   * LayerNorm's eps is rounded to float32 (u eps); rsqrt: C_RSQRT u |z|;
#   * GELU = 0.5 x erfc(t), t = x * fl(-1/sqrt 2): gamma_2 |t|. XLA's float32 erfc behaves as
#     erfc(t (1 + a)) (1 + b), |a| <= A_ERFC u, |b| <= C_ERFC u: the exponential of -t^2 amplifies
#     the rounding of t by 2 t^2 (t > 1) and 1 - erf cancels for t just below 1;
#   * attention (any softmax formulation): attnref.tolerance.attention_local_errors, the three
#     local terms of attention_error_bound's derivation (logits, weights, output), each a bound
#     for every formulation's operation order; here the float64 Jacobian propagates them through
#     the softmax instead of the worst-case factor exp(2 E) - 1.
# The float64 NumPy reference is bounded by the same sites in u_64 (its division by sqrt is one
# rounding more than a multiply by an exact 1/sqrt, covered by C_RSQRT >= 2; its GELU
# x/2 (1 + erf(x / sqrt 2)) has absolute error <= (C_EXP + 2) u_64 in the erfc term); that share is
# added (attention_local_errors includes it already). Second-order terms (u^2 times the
# amplification squared) are below 1e-6 of the bound here and are not counted.
C_RSQRT = 4  # XLA CPU float32 rsqrt: <= 2.8 u, measured exhaustively over [1, 4) (C_EXP's value)
C_ERFC = 16  # XLA CPU float32 erfc, relative part: <= 12.2 u (all floats in [0.25, 4)); 16 >= that
A_ERFC = 0.5  # ... argument part: erfc at t in [8, 9) is off by <= 67 u = 12 u + 0.42 u * 2 t^2
U32, U64 = unit_roundoff(np.float32), unit_roundoff(np.float64)


def _sited_encoder(delta, w: BertWeights, ids, mask, cfg: BertConfig):
    """The JAX encoder's operation sequence (``attnref.models.bert``) in float64. Each rounded
    intermediate ``z_k`` enters the rest of the computation as ``z_k + delta[k]`` (no
    perturbation when ``delta`` is None). Returns the output and ``(errs, values, attention
    inputs)`` with ``errs[k] = (float32 share, float64 share)`` of ``e_k`` (None for the attention
    sites, which the caller fills from ``attention_local_errors``)."""
    errs, values, attn_in = {}, {}, {}
    eps32 = float(np.float32(cfg.layer_norm_eps))

    def site(name, z, e32=None, e64=None):
        values[name], errs[name] = z, (e32, e64)
        return z if delta is None else z + delta[name]

    def rnd(name, z):  # one rounding
        return site(name, z, U32 * jnp.abs(z), U64 * jnp.abs(z))

    def dense(name, x, wt, b):
        n, mag = wt.shape[0], jnp.matmul(jnp.abs(x), jnp.abs(wt), precision=HIGHEST)
        z = site(
            name + ".mm",
            jnp.matmul(x, wt, precision=HIGHEST),
            gamma(n, U32) * mag,
            gamma(n, U64) * mag,
        )
        return rnd(name + ".bias", z + b)

    def mean(name, x):
        d, mag = x.shape[-1], jnp.mean(jnp.abs(x), -1, keepdims=True)
        return site(name, jnp.mean(x, -1, keepdims=True), gamma(d, U32) * mag, gamma(d, U64) * mag)

    def layer_norm(name, x, g, b):
        c = rnd(name + ".center", x - mean(name + ".mean", x))
        ve = mean(name + ".var", rnd(name + ".square", c * c)) + eps32
        ve = site(name + ".eps", ve, U32 * (ve + eps32), U64 * ve)
        r = jax.lax.rsqrt(ve)
        r = site(name + ".rsqrt", r, C_RSQRT * U32 * r, C_RSQRT * U64 * r)
        y = rnd(name + ".gamma", rnd(name + ".scale", c * r) * g)
        return rnd(name + ".beta", y + b)

    def gelu(name, x):
        t = x * (-1.0 / math.sqrt(2.0))
        t = site(
            name + ".arg",
            t,
            (gamma(2, U32) + A_ERFC * U32) * jnp.abs(t),
            gamma(2, U64) * jnp.abs(t),
        )
        ec = jax.scipy.special.erfc(t)
        ec = site(name + ".erfc", ec, C_ERFC * U32 * ec, (C_EXP + 2) * U64 * jnp.ones_like(ec))
        return rnd(name + ".mul", 0.5 * x * ec)

    def attention(p, x, prm, key_mask):
        def proj(wt, b):
            return jnp.einsum("btd,hde->bhte", x, wt, precision=HIGHEST) + b[None, :, None, :]

        q, k, v = proj(prm.w_q, prm.b_q), proj(prm.w_k, prm.b_k), proj(prm.w_v, prm.b_v)
        attn_in[p] = x
        s = jnp.einsum("bhqd,bhkd->bhqk", q, k, precision=HIGHEST) / math.sqrt(q.shape[-1])
        s = site(p + "logits", s)
        a = site(p + "weights", jax.nn.softmax(jnp.where(key_mask, s, -jnp.inf), axis=-1))
        y = jnp.einsum("bhqk,bhkv,hvd->bqd", a, v, prm.w_o, precision=HIGHEST) + prm.b_o
        return site(p + "output", y)

    t_len = ids.shape[-1]
    x = rnd("emb.add1", jnp.asarray(w.word)[ids] + jnp.asarray(w.position)[:t_len])
    h = layer_norm(
        "emb.ln", rnd("emb.add2", x + jnp.asarray(w.token_type)[0]), w.ln_gamma, w.ln_beta
    )
    key_mask = jnp.asarray(mask).astype(bool)[:, None, None, :]
    lw = w.layers
    for i, prm in enumerate(layer_attention(w)):
        p = f"layer{i}."
        r = rnd(p + "res1", h + attention(p + "attn.", h, prm, key_mask))
        h = layer_norm(p + "ln1", r, lw.ln1_gamma[i], lw.ln1_beta[i])
        m = gelu(p + "gelu", dense(p + "ff1", h, lw.w_1[i], lw.b_1[i]))
        r = rnd(p + "res2", h + dense(p + "ff2", m, lw.w_2[i], lw.b_2[i]))
        h = layer_norm(p + "ln2", r, lw.ln2_gamma[i], lw.ln2_beta[i])
    hm = h * jnp.asarray(mask, h.dtype)[..., None]  # exact: the mask is 0 or 1
    mag = jnp.sum(jnp.abs(hm), -2)
    s = site("pool.sum", jnp.sum(hm, -2), gamma(t_len - 1, U32) * mag, gamma(t_len - 1, U64) * mag)
    pooled = rnd("pool.div", s / jnp.sum(jnp.asarray(mask, h.dtype), -1)[:, None])
    sq = rnd("norm.square", pooled * pooled)
    ss, d = jnp.sum(sq, -1, keepdims=True), sq.shape[-1]
    ss = site("norm.sum", ss, gamma(d - 1, U32) * ss, gamma(d - 1, U64) * ss)
    out = rnd("out", pooled / rnd("norm.sqrt", jnp.sqrt(ss)))
    return out, (errs, values, attn_in)


@functools.partial(jax.jit, static_argnums=3)
def _jacobians(w: BertWeights, ids, mask, cfg: BertConfig):
    """``d out / d z_k`` for every site (``[B, d_model, *z_k.shape]``), its local errors, values
    and the attention inputs, all at the float64 trajectory."""
    _, (_, values, _) = _sited_encoder(None, w, ids, mask, cfg)
    zero = jax.tree_util.tree_map(jnp.zeros_like, values)
    return jax.jacrev(lambda dl: _sited_encoder(dl, w, ids, mask, cfg), has_aux=True)(zero)


def encoder_error_bound(
    weights: BertWeights, ids: np.ndarray, mask: np.ndarray, cfg: BertConfig, *, terms=False
):
    """Componentwise first-order bound ``[B, d_model]`` on ``|float32 encoder - float64 NumPy
    BERT|`` for ``weights`` exact in float32 (any softmax formulation); with ``terms=True`` also
    the per-site contributions ``{site: [B, d_model]}``."""
    w = weights.astype(np.float64)
    with jax.enable_x64(True):
        jac, (errs, values, attn_in) = _jacobians(w, jnp.asarray(ids), jnp.asarray(mask), cfg)
    key_mask = np.asarray(mask).astype(bool)[:, None, :]
    for i, prm in enumerate(layer_attention(w)):
        p = f"layer{i}.attn."
        loc = attention_local_errors(prm, np.asarray(attn_in[p]), mask=key_mask, dtype=np.float32)
        errs[p + "logits"] = (loc["logits"], 0.0)
        errs[p + "weights"] = (loc["weights"] * np.asarray(values[p + "weights"]), 0.0)
        errs[p + "output"] = (loc["output"], 0.0)
    contrib = {}
    for name, j in jac.items():
        j = np.abs(np.asarray(j)).reshape(*np.shape(j)[:2], -1)
        e = np.broadcast_to(
            np.asarray(errs[name][0]) + np.asarray(errs[name][1]), values[name].shape
        )
        contrib[name] = j @ e.reshape(-1)
    bound = sum(contrib.values())
    return (bound, contrib) if terms else bound


@given(seed=st.integers(0, 2**31 - 1), fid=st.sampled_from(attnref.ids("softmax")))
def test_encoder_matches_numpy_bert(seed, fid):
    sd = rounded_state_dict(seed)
    ids, mask = batch(seed)
    weights = bert_from_state_dict(sd, CFG)
    got = np.asarray(make_encoder(CFG, fid)(weights.astype(np.float32), ids, mask))
    assert got.dtype == np.float32
    ref64 = numpy_bert(sd, ids, mask, CFG, np.float64)
    bound = encoder_error_bound(weights, ids, mask, CFG)
    assert_within_bound(got, ref64, bound, label=fid)
    # The bound holds for any float32 evaluation order of these operations: the NumPy pass in
    # float32 (reference-style attention, division by sqrt, float64 erf) must meet it as well.
    ref32 = numpy_bert(sd, ids, mask, CFG, np.float32)
    assert_within_bound(ref32, ref64, bound, label="NumPy float32 BERT")
    got64 = np.asarray(make_encoder(CFG, "concat")(weights.astype(np.float64), ids, mask))
    assert got64.dtype == np.float64


def test_padding_does_not_change_embeddings_and_all_layers():
    sd = rounded_state_dict(3)
    w = bert_from_state_dict(sd, CFG).astype(np.float64)
    ids, mask = batch(3, b=2, t=5)
    pad_ids = np.concatenate([ids, np.zeros((2, 3), np.int32)], axis=1)
    pad_mask = np.concatenate([mask, np.zeros((2, 3), np.int32)], axis=1)
    enc = make_encoder(CFG)
    # Padded keys and pooled positions contribute exact zeros (zero weights, zero terms in every
    # sum), so the padded run must meet the derived bound of the unpadded batch against the
    # float64 NumPy BERT on the unpadded batch, as in test_encoder_matches_numpy_bert.
    padded = np.asarray(enc(w.astype(np.float32), pad_ids, pad_mask))
    ref64 = numpy_bert(sd, ids, mask, CFG, np.float64)
    assert_within_bound(padded, ref64, encoder_error_bound(w, ids, mask, CFG), label="padded")
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
    back = attnref.interop.to_hf_bert(layers[1], prefix="bert.encoder.layer.1.attention.")
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
