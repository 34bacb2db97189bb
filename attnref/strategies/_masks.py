"""Mask kinds (:data:`MASK_KINDS`) and the one builder of their arrays (:func:`make_options`),
with the sequence-length and segment-id strategies."""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import strategies as st

from attnref import oracle

from ._shapes import Config, DrawFn, broadcast_shape

MASK_KINDS = (
    "none",
    "causal",
    "padding",
    "random",
    "bias",
    "alibi",
    "neg_inf_bias",
    "window",
    "segments",
    "softcap",
    "fully_masked_row",
    "combined",
)
# The production options as kinds (learnable sinks, sink tokens under a window, a deterministic
# dropout): drawn where asked for, not by default (the distributed schemes refuse them).
PRODUCTION_KINDS = ("sinks", "sink_tokens", "dropout")

# The check_attention features (attnref.testing.FEATURES) each mask kind needs.
KIND_FEATURES: dict[str, tuple[str, ...]] = {
    "none": (),
    "causal": ("causal",),
    "padding": ("query_seq_lengths", "key_value_seq_lengths"),
    "random": ("mask",),
    "bias": ("bias",),
    "alibi": ("bias",),
    "neg_inf_bias": ("bias",),
    "window": ("window",),
    "segments": ("segment_ids",),
    "softcap": ("softcap",),
    "fully_masked_row": ("mask",),
    "combined": ("causal", "query_seq_lengths", "key_value_seq_lengths", "mask", "bias"),
    "sinks": ("sinks",),
    "sink_tokens": ("window", "sink_tokens"),
    "dropout": ("dropout",),
}

# The mask kinds that take a boolean mask / an additive bias of a drawn broadcast shape, and the
# shape each has when none is given (``make_options(..., mask_shape=None)``).
MASK_SHAPE_KINDS: dict[str, str] = {
    "random": "BNTS",
    "fully_masked_row": "B1TS",
    "combined": "B1TS",
}
BIAS_SHAPE_KINDS: dict[str, str] = {"bias": "1NTS", "neg_inf_bias": "BNTS", "combined": "1NTS"}


def _lengths(rng: np.random.Generator, b: int, n: int, low: int = 1) -> np.ndarray:
    return rng.integers(low, n + 1, size=b).astype(np.int32)


def _segments(rng: np.random.Generator, c: Config) -> tuple[np.ndarray, np.ndarray]:
    """Sorted (packed) segment ids with every query's segment present among the keys."""
    q_seg = np.sort(rng.integers(0, 3, size=(c.b, c.t)), axis=1).astype(np.int32)
    kv_seg = np.zeros((c.b, c.s), np.int32)
    for b in range(c.b):
        ids = np.unique(q_seg[b])
        if len(ids) > c.s:  # more segments than keys: merge the surplus into the last one
            q_seg[b] = np.minimum(q_seg[b], ids[c.s - 1])
            ids = ids[: c.s]
        fill = rng.choice(ids, size=c.s - len(ids))
        kv_seg[b] = np.sort(np.concatenate([ids, fill]))
    return q_seg, kv_seg


def _random_mask(rng: np.random.Generator, shape: tuple[int, ...], keep: bool) -> np.ndarray:
    mask = rng.random(shape) < 0.6
    if keep:  # every row keeps one key
        idx = rng.integers(0, shape[-1], size=shape[:-1])
        np.put_along_axis(mask, idx[..., None], True, axis=-1)
    return mask


# What each mask kind is made of. "key_padding" (key lengths only) is the weight level's padding.
_KIND_PARTS: dict[str, tuple[str, ...]] = {
    **{kind: (kind,) for kind in MASK_KINDS + PRODUCTION_KINDS},
    "none": (),
    "combined": ("causal", "padding", "random", "bias"),
}
_BIAS_PARTS = ("bias", "alibi", "neg_inf_bias")


def build(
    rng: np.random.Generator,
    c: Config,
    parts: frozenset[str],
    dt: np.dtype[Any],
    *,
    mask_shape: str,
    bias_shape: str,
    causal_alignment: str,
    empty_rows: bool,
) -> dict[str, Any]:
    """Kernel options for a set of parts, drawn from ``rng`` in a fixed order (a kind's arrays
    do not depend on the other parts)."""
    if len(parts & set(_BIAS_PARTS)) > 1:
        raise ValueError(f"at most one of {_BIAS_PARTS} per problem, got {sorted(parts)}")
    m_shape = broadcast_shape(c, mask_shape)
    b_shape = broadcast_shape(c, bias_shape)
    out: dict[str, Any] = {}
    if "causal" in parts:
        out["is_causal"] = True
    mask = None
    if "random" in parts or "fully_masked_row" in parts:
        mask = _random_mask(rng, m_shape, keep=not empty_rows)
        if "fully_masked_row" in parts:  # one (broadcast) row with no key
            mask[int(rng.integers(m_shape[0])), :, int(rng.integers(m_shape[2])), :] = False
        elif "causal" in parts and not empty_rows:
            mask[..., 0] = True  # key 0 is causal-visible to every query under top-left alignment
    low = 0 if empty_rows else 1
    if "padding" in parts:
        out["query_seq_lengths"] = _lengths(rng, c.b, c.t, low)
        out["key_value_seq_lengths"] = _lengths(rng, c.b, c.s, low)
    if "key_padding" in parts:
        out["key_value_seq_lengths"] = _lengths(rng, c.b, c.s, low)
    if mask is not None:
        out["mask"] = mask
    if "bias" in parts:
        out["bias"] = rng.standard_normal(b_shape).astype(dt)
    if "alibi" in parts:
        slopes = oracle.alibi_slopes(c.n)
        lengths: dict[str, Any] = {}
        if "padding" in parts:  # FlashAttention's per-(batch, head) slopes, actual lengths
            slopes = slopes[None] * (1.0 + np.arange(c.b))[:, None]
            lengths = {k: out[k] for k in ("query_seq_lengths", "key_value_seq_lengths")}
        bias = oracle.alibi_bias(slopes, c.t, c.s, causal_alignment=causal_alignment, **lengths)
        out["bias"] = bias.astype(dt)
    if "neg_inf_bias" in parts:
        bias = rng.standard_normal(b_shape)
        bias[rng.random(bias.shape) < 0.35] = -np.inf
        if not empty_rows:  # every row keeps a finite entry
            keep = rng.integers(0, b_shape[-1], size=bias.shape[:-1])
            finite = rng.standard_normal((*bias.shape[:-1], 1))
            np.put_along_axis(bias, keep[..., None], finite, -1)
        out["bias"] = bias.astype(dt)
    if "window" in parts:  # asymmetric, so swapped sides are caught
        out["local_window_size"] = (2, 1)
    if "segments" in parts:
        if empty_rows:  # independent packings: a query's segment may have no key
            out["segment_ids"] = tuple(
                np.sort(rng.integers(0, 3, size=(c.b, n)), axis=1).astype(np.int32)
                for n in (c.t, c.s)
            )
        else:
            q_seg, kv_seg = _segments(rng, c)
            out["segment_ids"] = q_seg if c.t == c.s else (q_seg, kv_seg)
    if "softcap" in parts:
        out["softcap"] = 2.0
    if "sinks" in parts:  # one logit per query head, on the scale of the logits
        out["sinks"] = (rng.standard_normal(c.n) * 2.0).astype(dt)
    if "sink_tokens" in parts:  # key 0 stays visible past the window's left edge
        out["local_window_size"], out["sink_tokens"] = (2, 1), 1
    if "dropout" in parts:  # keep about 70% of the weights, of the drawn mask shape
        out["dropout_mask"], out["dropout_rate"] = rng.random(m_shape) < 0.7, 0.25
    return out


def mask_kind_tuple(kind: str | tuple[str, ...]) -> tuple[str, ...]:
    kinds = (kind,) if isinstance(kind, str) else tuple(kind)
    bad = [k for k in kinds if k not in MASK_KINDS + PRODUCTION_KINDS]
    if bad:
        raise ValueError(
            f"kind must be one of {MASK_KINDS + PRODUCTION_KINDS} (or a tuple of them), got {bad}"
        )
    return kinds


def kind_name(kinds: tuple[str, ...]) -> str:
    return "+".join(kinds) or "none"


def make_options(
    config: Config,
    kind: str | tuple[str, ...],
    seed: int,
    *,
    causal_alignment: str = "top_left",
    mask_shape: str | None = None,
    bias_shape: str | None = None,
    empty_rows: bool = False,
) -> dict[str, Any]:
    """The keyword options of :func:`attnref.dot_product_attention` that one mask ``kind`` of
    :data:`MASK_KINDS` (or a tuple of them combined, at most one bias kind; ``()``: ``"none"``)
    needs: NumPy arrays seeded by ``seed`` and the kinds, the bias in ``config.dtype`` (an
    ``int`` batch), ``alibi`` distances in ``causal_alignment`` (with ``padding``,
    FlashAttention's per-(batch, head) slopes and actual lengths).

    A kind's shapes and static values are fixed (one compiled program per kind, bucket and
    broadcast shape): ``mask_shape`` / ``bias_shape`` are :data:`BROADCAST_SHAPES` patterns
    (``None``: :data:`MASK_SHAPE_KINDS` / :data:`BIAS_SHAPE_KINDS`). Only ``fully_masked_row``
    (and ``combined`` aligned ``bottom_right``) leaves a query row with no key, unless
    ``empty_rows``: then masks, lengths (0 allowed), segment ids and ``-inf`` biases may too.
    ``ValueError`` for an unknown kind or pattern, two bias kinds, or a tuple batch."""
    kinds = mask_kind_tuple(kind)
    index = [(MASK_KINDS + PRODUCTION_KINDS).index(k) for k in kinds]
    rng = np.random.default_rng([seed, *index])
    parts = frozenset(p for k in kinds for p in _KIND_PARTS[k])
    default_mask = next((MASK_SHAPE_KINDS[k] for k in kinds if k in MASK_SHAPE_KINDS), "BNTS")
    default_bias = next((BIAS_SHAPE_KINDS[k] for k in kinds if k in BIAS_SHAPE_KINDS), "BNTS")
    return build(
        rng,
        config,
        parts,
        np.dtype(config.dtype),
        mask_shape=mask_shape or default_mask,
        bias_shape=bias_shape or default_bias,
        causal_alignment=causal_alignment,
        empty_rows=empty_rows,
    )


def mask_kinds(
    features: tuple[str, ...] | None = None, *, kinds: tuple[str, ...] = MASK_KINDS
) -> st.SearchStrategy[str]:
    """A mask kind from ``kinds`` (shrinking in order) whose :data:`KIND_FEATURES` are all in
    ``features`` (``None``: any); ``ValueError`` for an unknown kind or none left."""
    unknown = [k for k in kinds if k not in KIND_FEATURES]
    if unknown:
        raise ValueError(f"unknown mask kinds {unknown}; known: {MASK_KINDS}")
    pool = tuple(k for k in kinds if features is None or set(KIND_FEATURES[k]) <= set(features))
    if not pool:
        raise ValueError(f"no kind of {tuple(kinds)} needs only the features {features}")
    return st.sampled_from(pool)


@st.composite
def seq_lengths(draw: DrawFn, batch: int, length: int, *, allow_empty: bool = True) -> np.ndarray:
    """Sequence lengths ``int32 [batch]`` in ``[0, length]`` (``[1, length]`` unless
    ``allow_empty``: 0 is a sequence with no token), labelled ``"seq lengths"``."""
    low = 0 if allow_empty else 1
    values = draw(
        st.lists(st.integers(low, length), min_size=batch, max_size=batch), label="seq lengths"
    )
    return np.asarray(values, np.int32)


@st.composite
def segment_ids(draw: DrawFn, batch: int, length: int, *, max_segments: int = 3) -> np.ndarray:
    """Packed segment ids ``int32 [batch, length]`` from ``[0, max_segments)``,
    non-decreasing along each sequence (labelled ``"segment ids"``)."""
    rows = draw(
        st.lists(
            st.lists(st.integers(0, max_segments - 1), min_size=length, max_size=length),
            min_size=batch,
            max_size=batch,
        ),
        label="segment ids",
    )
    return np.sort(np.asarray(rows, np.int32), axis=1)
