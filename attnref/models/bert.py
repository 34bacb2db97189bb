"""A small pure-JAX BERT encoder whose attention block is any registered attnref formulation.

The forward pass of Hugging Face's ``BertModel`` (Devlin et al. 2019) for inference, post-LN:

* embeddings ``x_0 = LN(E_word[t] + E_pos[p] + E_type[0])``;
* per layer ``l``: ``h = LN_1(x + Attn_l(x))`` with ``Attn_l`` the multi-head block (with its
  biases) of any softmax formulation of :func:`attnref.formulations`, keys masked by the padding
  mask; then ``x' = LN_2(h + GELU(h W_1 + b_1) W_2 + b_2)`` with the exact (erf) GELU;
* sentence embedding (sentence-transformers' ``Pooling(mean)`` then ``Normalize``): the mean of
  the last hidden states over the non-padding tokens, divided by its Euclidean norm.

LayerNorm is ``(x - mean) / sqrt(var + eps) * gamma + beta`` with the biased variance. The
``L`` layers are stacked on a leading axis and run by ``jax.lax.scan`` (one compiled layer).
NumPy and JAX only; reading files is in :mod:`attnref.models.minilm`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, no_type_check

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float, Int

from attnref._src.core.checks import float64_scoped
from attnref._src.core.common import HIGHEST
from attnref._src.core.convert import from_hf_bert
from attnref._src.core.family import SOFTMAX
from attnref._src.core.params import AttentionParams
from attnref._src.core.registry import get

__all__ = [
    "BertConfig",
    "BertLayers",
    "BertWeights",
    "bert_from_state_dict",
    "bert_hidden_states",
    "layer_attention",
    "make_encoder",
    "sentence_embeddings",
    "with_attention",
]


@dataclasses.dataclass(frozen=True)
class BertConfig:
    """Static sizes of a BERT encoder, hashable (a :func:`make_encoder` cache key and a static
    ``jax.jit`` argument).

    Attributes:
        num_layers: The number of layers ``L`` (Hugging Face ``num_hidden_layers``).
        num_heads: Attention heads per layer (``num_attention_heads``).
        d_model: The hidden size (``hidden_size``).
        d_ff: The feed-forward width (``intermediate_size``).
        vocab_size: The vocabulary size.
        max_positions: The longest sequence (``max_position_embeddings``).
        layer_norm_eps: LayerNorm's epsilon (default ``1e-12``).
    """

    num_layers: int
    num_heads: int
    d_model: int
    d_ff: int
    vocab_size: int
    max_positions: int
    layer_norm_eps: float = 1e-12

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> BertConfig:
        """From a parsed Hugging Face ``config.json``: ``ValueError`` unless ``hidden_act`` is
        ``"gelu"`` and the position embeddings are absolute, ``KeyError`` for a missing size."""
        act = config.get("hidden_act", "gelu")
        if act != "gelu":
            raise ValueError(f"only hidden_act='gelu' (erf GELU) is implemented, got {act!r}")
        if config.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError("only absolute position embeddings are implemented")
        return cls(
            num_layers=int(config["num_hidden_layers"]),
            num_heads=int(config["num_attention_heads"]),
            d_model=int(config["hidden_size"]),
            d_ff=int(config["intermediate_size"]),
            vocab_size=int(config["vocab_size"]),
            max_positions=int(config["max_position_embeddings"]),
            layer_norm_eps=float(config.get("layer_norm_eps", 1e-12)),
        )


# @no_type_check (here and on BertWeights): no runtime check of the fields (the suite's jaxtyping
# hook), since JAX rebuilds a pytree with any leaves (tree_map results, vmap axes, placeholders).
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
@no_type_check
class BertLayers:
    """Every layer's weights stacked on a leading ``[L, ...]`` axis (row convention).

    Attributes:
        attention: Stacked :class:`~attnref.AttentionParams` (``w_q [L, H, d_model, d_k]``, ...).
        ln1_gamma: Post-attention LayerNorm scale ``[L, d_model]``.
        ln1_beta: Post-attention LayerNorm shift ``[L, d_model]``.
        w_1: Feed-forward input weights ``[L, d_model, d_ff]``.
        b_1: Feed-forward input bias ``[L, d_ff]``.
        w_2: Feed-forward output weights ``[L, d_ff, d_model]``.
        b_2: Feed-forward output bias ``[L, d_model]``.
        ln2_gamma: Post-feed-forward LayerNorm scale ``[L, d_model]``.
        ln2_beta: Post-feed-forward LayerNorm shift ``[L, d_model]``.
    """

    attention: AttentionParams
    ln1_gamma: ArrayLike
    ln1_beta: ArrayLike
    w_1: ArrayLike
    b_1: ArrayLike
    w_2: ArrayLike
    b_2: ArrayLike
    ln2_gamma: ArrayLike
    ln2_beta: ArrayLike


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
@no_type_check
class BertWeights:
    """Embedding tables, the embedding LayerNorm and the stacked layers (a JAX pytree).

    Attributes:
        word: Word embeddings ``[vocab_size, d_model]``.
        position: Position embeddings ``[max_positions, d_model]``.
        token_type: Token-type embeddings ``[types, d_model]`` (row 0 is used).
        ln_gamma: Embedding LayerNorm scale ``[d_model]``.
        ln_beta: Embedding LayerNorm shift ``[d_model]``.
        layers: The stacked layers (:class:`BertLayers`).
    """

    word: ArrayLike
    position: ArrayLike
    token_type: ArrayLike
    ln_gamma: ArrayLike
    ln_beta: ArrayLike
    layers: BertLayers

    def astype(self, dtype: Any) -> BertWeights:
        """The same weights as NumPy arrays of ``dtype``."""
        return jax.tree_util.tree_map(lambda a: np.asarray(a).astype(dtype), self)


def bert_from_state_dict(
    state_dict: Mapping[str, Any], config: BertConfig, *, prefix: str = ""
) -> BertWeights:
    """A Hugging Face ``BertModel`` state dict (``nn.Linear`` ``(out, in)`` layout) as
    :class:`BertWeights`, NumPy arrays in the stored dtype; ``prefix`` is e.g. ``"bert."`` for
    checkpoints of task heads. Attention is read per layer by
    :func:`attnref.interop.from_hf_bert`, then stacked. ``KeyError`` for a missing weight,
    ``ValueError`` for a projection that does not split into ``num_heads`` heads.
    """

    def g(key: str) -> np.ndarray:
        if prefix + key not in state_dict:
            raise KeyError(
                f"BERT weights are missing {prefix + key!r} ({len(state_dict)} keys present)"
            )
        return np.asarray(state_dict[prefix + key])

    layers = []
    for i in range(config.num_layers):
        lp = f"encoder.layer.{i}."
        attn = from_hf_bert(state_dict, config.num_heads, prefix=f"{prefix}{lp}attention.")
        layers.append(
            BertLayers(
                attention=attn,
                ln1_gamma=g(lp + "attention.output.LayerNorm.weight"),
                ln1_beta=g(lp + "attention.output.LayerNorm.bias"),
                w_1=g(lp + "intermediate.dense.weight").T,
                b_1=g(lp + "intermediate.dense.bias"),
                w_2=g(lp + "output.dense.weight").T,
                b_2=g(lp + "output.dense.bias"),
                ln2_gamma=g(lp + "output.LayerNorm.weight"),
                ln2_beta=g(lp + "output.LayerNorm.bias"),
            )
        )
    stacked = jax.tree_util.tree_map(lambda *a: np.stack(a), *layers)
    return BertWeights(
        word=g("embeddings.word_embeddings.weight"),
        position=g("embeddings.position_embeddings.weight"),
        token_type=g("embeddings.token_type_embeddings.weight"),
        ln_gamma=g("embeddings.LayerNorm.weight"),
        ln_beta=g("embeddings.LayerNorm.bias"),
        layers=stacked,
    )


def layer_attention(weights: BertWeights) -> list[AttentionParams]:
    """The ``L`` layers' :class:`~attnref.AttentionParams` (unstacked), in layer order."""
    n = int(np.shape(weights.layers.attention.w_q)[0])
    return [jax.tree_util.tree_map(lambda a, i=i: a[i], weights.layers.attention) for i in range(n)]


def with_attention(weights: BertWeights, attention: Sequence[AttentionParams]) -> BertWeights:
    """``weights`` with every layer's attention block replaced (e.g. by refactored params):
    one :class:`~attnref.AttentionParams` per layer, in order, all of one structure (else
    ``ValueError`` while stacking), stacked as NumPy; the other weights are shared.
    """
    stacked = jax.tree_util.tree_map(lambda *a: np.stack([np.asarray(x) for x in a]), *attention)
    return dataclasses.replace(
        weights, layers=dataclasses.replace(weights.layers, attention=stacked)
    )


def _layer_norm(x: Array, gamma: ArrayLike, beta: ArrayLike, eps: float) -> Array:
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + jnp.asarray(eps, x.dtype)) * gamma + beta


def _dense(x: Array, w: ArrayLike, b: ArrayLike) -> Array:
    return jnp.matmul(x, w, precision=HIGHEST) + b


def bert_hidden_states(
    weights: BertWeights,
    input_ids: Int[ArrayLike, "B T"],
    attention_mask: Int[ArrayLike, "B T"],
    *,
    config: BertConfig,
    formulation: str = "concat",
    all_layers: bool = False,
) -> Float[Array, "B T d_model"] | Float[Array, "L1 B T d_model"]:
    """Last hidden states with the attention block of ``formulation``; padding keys
    (``attention_mask == 0``) are masked out for every query (padding positions still get
    unused hidden states).

    Args:
        weights: The model's :class:`BertWeights`.
        input_ids: Token ids ``[B, T]``.
        attention_mask: ``[B, T]``, nonzero for real tokens, 0 for padding.
        config: The model's sizes (:class:`BertConfig`).
        formulation: A softmax-family registry id (default ``"concat"``).
        all_layers: If ``True``, return every layer's input and the final output.

    Returns:
        ``[B, T, d_model]``, or with ``all_layers`` ``[L + 1, B, T, d_model]`` (entry ``l`` the
        input of layer ``l``, entry ``L`` the last output), in the weights' dtype.

    Raises:
        KeyError: If ``formulation`` is not registered.
        ValueError: If ``formulation`` is not in the softmax family, or ``T`` exceeds
            ``config.max_positions``.
    """
    f = get(formulation)
    if f.family is not SOFTMAX:
        raise ValueError(f"formulation {formulation!r} is {f.family!r}; BERT needs a softmax one")
    ids = jnp.asarray(input_ids)
    keep = jnp.asarray(attention_mask).astype(bool)
    t = ids.shape[-1]
    if t > config.max_positions:
        raise ValueError(f"sequence length {t} exceeds max_positions={config.max_positions}")
    eps = config.layer_norm_eps
    word = jnp.asarray(weights.word)
    x = word[ids] + jnp.asarray(weights.position)[:t] + jnp.asarray(weights.token_type)[0]
    x = _layer_norm(x, weights.ln_gamma, weights.ln_beta, eps)
    key_mask = keep[:, None, :]  # [B, 1, T_k]: broadcast over queries

    def layer(h: Array, lw: BertLayers) -> tuple[Array, Array]:
        a = f.apply(lw.attention, h, mask=key_mask)
        out = _layer_norm(h + a, lw.ln1_gamma, lw.ln1_beta, eps)
        m = jax.nn.gelu(_dense(out, lw.w_1, lw.b_1), approximate=False)
        out = _layer_norm(out + _dense(m, lw.w_2, lw.b_2), lw.ln2_gamma, lw.ln2_beta, eps)
        return out, h

    last, inputs = jax.lax.scan(layer, x, weights.layers)
    if all_layers:
        return jnp.concatenate([inputs, last[None]], axis=0)
    return last


def sentence_embeddings(
    weights: BertWeights,
    input_ids: Int[ArrayLike, "B T"],
    attention_mask: Int[ArrayLike, "B T"],
    *,
    config: BertConfig,
    formulation: str = "concat",
    normalize: bool = True,
) -> Float[Array, "B d_model"]:
    """Sentence embeddings ``[B, d_model]``: the last hidden states mean-pooled over
    ``attention_mask`` and, if ``normalize`` (default), divided by their Euclidean norm (the
    sentence-transformers ``Pooling(mean)`` + ``Normalize`` head). The other arguments and the
    errors are those of :func:`bert_hidden_states`.
    """
    h = bert_hidden_states(
        weights, input_ids, attention_mask, config=config, formulation=formulation
    )
    m = jnp.asarray(attention_mask).astype(h.dtype)[..., None]
    pooled = jnp.sum(h * m, axis=-2) / jnp.maximum(jnp.sum(m, axis=-2), 1e-9)
    if not normalize:
        return pooled
    norm = jnp.linalg.norm(pooled, axis=-1, keepdims=True)
    return pooled / jnp.maximum(norm, 1e-12)


@functools.lru_cache(maxsize=64)
def make_encoder(
    config: BertConfig, formulation: str = "concat", *, normalize: bool = True
) -> Callable[[BertWeights, ArrayLike, ArrayLike], Array]:
    """``jax.jit``-compiled ``encode(weights, input_ids, attention_mask) -> [B, d_model]``,
    :func:`sentence_embeddings` with these arguments (weights are an argument, so one compile
    serves any weights of these shapes; float64 weights run in float64 whatever the x64 flag).
    Cached per arguments; an unregistered ``formulation`` raises ``KeyError`` before compiling.
    """
    get(formulation)  # fail early on an unknown id
    options: dict[str, Any] = {"config": config, "formulation": formulation, "normalize": normalize}
    return float64_scoped(jax.jit(functools.partial(sentence_embeddings, **options)))
