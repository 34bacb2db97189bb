"""Hypothesis strategies for attention problems, at the kernel level and at the weight level.

A kernel author writes property tests with these instead of hand-picking shapes::

    from hypothesis import given
    from attnref import strategies as ast

    @given(problem=ast.kernel_problems(ast.configs(dtypes=("float32",))))
    def test_my_kernel(problem):
        out = my_kernel(problem.q, problem.k, problem.v, **problem.options)
        ref, _ = problem.oracle()
        attnref.testing.assert_attention_close(
            out, ref, dtype=problem.config.dtype, bound=problem.bound()[0]
        )

Design rules:

* **Shapes from buckets.** A config (``batch, T, S, N, K, H, H_v, d_model``, dtype) is drawn from a
  short tuple of buckets, so a jitted function is compiled once per bucket and dtype, not once per
  example: :data:`BUCKETS` (power-of-two head dims, every attention shape class),
  :data:`KERNEL_BUCKETS` (odd head dims) and :data:`WEIGHT_BUCKETS` (zero, one and two leading
  batch dims, for the weight level). Buckets are ordered small to large, so Hypothesis shrinks
  towards the smallest.
* **No degenerate fill.** Arrays come from NumPy's seeded PCG64 generator (the seed is a labelled
  draw), standard normal, rounded once to the tested dtype; the oracle sees the rounded values.
  Identical rows (every key equal, or every query equal) are a special case drawn on purpose with
  the label ``"identical rows"``, never an accident of shrinking.
* **Every draw is labelled** (``draw(..., label=...)``) and summarised with ``hypothesis.note``.
* **Every broadcastable shape.** A boolean mask and an additive bias may have any of the 16
  shapes :data:`BROADCAST_SHAPES` (each axis of ``[B, N, T, S]`` full or 1; rank 4 only, as
  :func:`jax.nn.dot_product_attention` and :func:`attnref.dot_product_attention` require).
  :func:`kernel_problems` draws the mask's and the bias's shape separately (labelled draws,
  :func:`broadcast_shapes`), one pair per example: a shape changes the compiled program, so an
  example costs at most one new compilation per mask kind, and the shapes shrink towards the
  full ``"BNTS"``, so a shrunk example shows the least broadcasting that still fails.
* **Mask kinds** (:data:`MASK_KINDS`): ``none``, ``causal``, ``padding`` (sequence lengths),
  ``random`` (boolean mask, every row keeps a key), ``bias``, ``alibi``, ``neg_inf_bias`` (a bias
  with ``-inf`` entries, every row keeps a finite one), ``window``, ``segments`` (segment ids),
  ``softcap``, ``fully_masked_row`` (a boolean mask with one row entirely False) and ``combined``
  (causal, padding, a random mask and a bias together). :data:`KIND_FEATURES` names the feature of
  :func:`attnref.testing.check_attention` each kind needs. One builder, :func:`make_options`,
  makes every kind's arrays, at the kernel level and (rendered to a full ``[..., T, S]`` mask and
  bias) at the weight level; ``empty_rows=True`` lets masks, lengths, segment ids and ``-inf``
  biases leave a query row with no key by accident, as well as on purpose.
* **Option mixes.** :func:`mixed_kernel_problems` draws one of the static option profiles
  :data:`STATIC_PROFILES` (causal alignment, windows, softcap, the masked-rows policy) with up to
  three of the array kinds :data:`ARRAY_KINDS` at once.

Kernel problems use the layout of :func:`attnref.dot_product_attention` (``q [B, T, N, H]``,
``k [B, S, K, H]``, ``v [B, S, K, H_v]``); weight-level problems the multi-head layout of
:func:`attnref.oracle.attention` (``x_q [B, T, d_model]``, ``x_kv [B, S, d_model]``, parameters
from :func:`attnref.init_params`, GQA through ``num_kv_heads``).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
from hypothesis import note
from hypothesis import strategies as st

from attnref import oracle, tolerance
from attnref._src.kernel import STATIC_OPTIONS
from attnref._src.params import AttentionParams, init_params

if TYPE_CHECKING:
    from hypothesis.strategies import DrawFn
else:
    # Hypothesis's ``DrawFn`` is a Protocol that ``isinstance`` cannot check; to the runtime
    # checks (jaxtyping's import hook with beartype in the test suite) it is any callable.
    DrawFn = Callable[..., Any]

__all__ = [
    "ARRAY_KINDS",
    "BIAS_SHAPE_KINDS",
    "BROADCAST_SHAPES",
    "BUCKETS",
    "IDENTICAL",
    "KERNEL_BUCKETS",
    "KIND_FEATURES",
    "MASK_KINDS",
    "MASK_SHAPE_KINDS",
    "STATIC_OPTIONS",
    "STATIC_PROFILES",
    "WEIGHT_BUCKETS",
    "WEIGHT_KINDS",
    "AttentionProblem",
    "Config",
    "KernelProblem",
    "attention_problems",
    "broadcast_shape",
    "broadcast_shapes",
    "configs",
    "kernel_inputs",
    "kernel_problems",
    "make_attention_problem",
    "make_kernel_problem",
    "make_options",
    "mask_kinds",
    "mixed_kernel_problems",
    "segment_ids",
    "seq_lengths",
]


@dataclasses.dataclass(frozen=True)
class Config:
    """Sizes and dtype of one attention problem.

    ``batch`` examples, ``t`` queries, ``s`` keys, ``n`` query heads, ``k`` key/value heads
    (``n % k == 0``; query head ``i`` reads K/V head ``i // (n // k)``), head dims ``h`` (queries
    and keys; ``d_k`` at the weight level) and ``h_v`` (values; ``d_v``), model width ``d_model``.
    At the weight level ``batch`` may be a tuple of leading batch dims (``()``: none); the kernel
    level takes one batch axis, an ``int``.

    Attributes:
        batch: The batch size (kernel level) or a tuple of leading batch dims (weight level).
        t: The number of queries ``T``.
        s: The number of keys ``S``.
        n: The number of query heads ``N``.
        k: The number of key/value heads ``K`` (``n % k == 0``).
        h: The query/key head dim ``H`` (``d_k``).
        h_v: The value head dim ``H_v`` (``d_v``).
        d_model: The model width (weight level).
        dtype: The dtype name (default ``"float32"``).
    """

    batch: int | tuple[int, ...]
    t: int
    s: int
    n: int
    k: int
    h: int
    h_v: int
    d_model: int
    dtype: str = "float32"

    @property
    def batch_shape(self) -> tuple[int, ...]:
        """The leading batch dims: ``(batch,)`` for an ``int``, else ``batch`` itself."""
        return (self.batch,) if isinstance(self.batch, int) else tuple(self.batch)

    @property
    def group(self) -> int:
        """Query heads per K/V head."""
        return self.n // self.k

    @property
    def d_k(self) -> int:
        """``h``, the weight level's name for it."""
        return self.h

    @property
    def d_v(self) -> int:
        """``h_v``, the weight level's name for it."""
        return self.h_v

    @property
    def is_cross(self) -> bool:
        """Whether ``T != S`` (cross-attention shapes)."""
        return self.t != self.s

    @property
    def is_gqa(self) -> bool:
        """Whether ``N != K`` (grouped- or multi-query heads)."""
        return self.n != self.k

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        """Hypothesis (IPython's pretty printer) shows the short ``repr``, not every array."""
        printer.text(repr(self))

    def __repr__(self) -> str:
        return (
            f"Config(batch={self.batch}, t={self.t}, s={self.s}, n={self.n}, k={self.k}, "
            f"h={self.h}, h_v={self.h_v}, d_model={self.d_model}, dtype={self.dtype!r})"
        )


# Small to large: Hypothesis shrinks towards the first bucket. Head dims are powers of two, so the
# default scale 1/sqrt(H) is exact in every dtype.
BUCKETS: tuple[Config, ...] = (
    Config(batch=1, t=4, s=4, n=2, k=2, h=4, h_v=4, d_model=8),  # self-attention, MHA
    Config(batch=2, t=6, s=6, n=2, k=2, h=8, h_v=8, d_model=16),  # self-attention, batch 2
    Config(batch=2, t=3, s=5, n=2, k=2, h=4, h_v=4, d_model=8),  # cross-attention, T < S
    Config(batch=1, t=5, s=3, n=2, k=2, h=4, h_v=4, d_model=8),  # cross-attention, T > S
    Config(batch=1, t=4, s=4, n=4, k=2, h=4, h_v=4, d_model=8),  # GQA, N = 2K
    Config(batch=2, t=4, s=6, n=4, k=1, h=4, h_v=4, d_model=8),  # MQA, N = 4K, cross
    Config(batch=2, t=4, s=4, n=8, k=2, h=4, h_v=4, d_model=8),  # GQA, N = 4K
    Config(batch=2, t=5, s=7, n=4, k=2, h=4, h_v=2, d_model=8),  # GQA, cross, H_v != H
)
# Kernel level, head dims that are not powers of two (the scale 1/sqrt(H) is rounded): draw with
# configs(buckets=KERNEL_BUCKETS, value_dim_differs=True).
KERNEL_BUCKETS: tuple[Config, ...] = (
    Config(batch=2, t=5, s=7, n=4, k=2, h=3, h_v=2, d_model=8),  # GQA, T != S, H_v != H
    Config(batch=1, t=6, s=6, n=2, k=2, h=4, h_v=4, d_model=8),  # MHA, self-attention shape
    Config(batch=2, t=4, s=4, n=3, k=1, h=2, h_v=3, d_model=8),  # MQA, H_v > H
)
# Weight level (multi-head MHA, d_k != d_v): zero, one and two leading batch dims; draw with
# configs(buckets=WEIGHT_BUCKETS, value_dim_differs=True).
WEIGHT_BUCKETS: tuple[Config, ...] = (
    Config(batch=(), t=4, s=4, n=1, k=1, h=2, h_v=3, d_model=4),  # no batch dims, one head
    Config(batch=(2,), t=5, s=7, n=2, k=2, h=4, h_v=3, d_model=8),  # cross-attention
    Config(batch=(2, 2), t=4, s=4, n=3, k=3, h=2, h_v=5, d_model=6),  # two batch dims
)

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

# The check_attention features (attnref.testing.FEATURES) each mask kind needs.
KIND_FEATURES: dict[str, tuple[str, ...]] = {
    "none": (),
    "causal": ("causal",),
    "padding": ("seq_lengths",),
    "random": ("mask",),
    "bias": ("bias",),
    "alibi": ("bias",),
    "neg_inf_bias": ("bias",),
    "window": ("window",),
    "segments": ("segment_ids",),
    "softcap": ("softcap",),
    "fully_masked_row": ("mask",),
    "combined": ("causal", "seq_lengths", "mask", "bias"),
}

IDENTICAL = ("none", "keys", "queries")  # the "identical rows" special case

# The kinds that are arrays (or an array pair), which mixed_kernel_problems combines (at most one
# of bias, alibi and neg_inf_bias per problem).
ARRAY_KINDS = ("random", "bias", "alibi", "neg_inf_bias", "padding", "segments")

# Static option profiles of attnref.dot_product_attention (masked_rows and causal_alignment set a
# KernelProblem's semantics): each compiles once per bucket and dtype.
STATIC_PROFILES: tuple[dict[str, Any], ...] = (
    dict(),
    dict(is_causal=True, masked_rows="uniform"),
    dict(is_causal=True, causal_alignment="bottom_right", local_window_size=(2, 0)),
    dict(local_window_size=(1, 1), softcap=2.0, masked_rows="nan"),
    dict(is_causal=True, causal_alignment="bottom_right", softcap=3.0, masked_rows="uniform"),
    dict(local_window_size=(None, 1), causal_alignment="bottom_right"),
)

# Every rank-4 shape that broadcasts to [B, N, T, S]: each axis full (its letter) or 1, ordered by
# the number of broadcast axes (full first, "1111" last), so Hypothesis shrinks towards "BNTS".
# "B11S" is the usual key-padding mask, "111S" a mask or bias shared by every batch element.
BROADCAST_SHAPES: tuple[str, ...] = tuple(
    sorted(
        (
            "".join(full if keep else "1" for full, keep in zip("BNTS", keeps, strict=True))
            for keeps in itertools.product((True, False), repeat=4)
        ),
        key=lambda pattern: pattern.count("1"),
    )
)
# The mask kinds that take a boolean mask / an additive bias of a drawn broadcast shape, and the
# shape each has when none is given (``make_options(..., mask_shape=None)``).
MASK_SHAPE_KINDS: dict[str, str] = {
    "random": "BNTS",
    "fully_masked_row": "B1TS",
    "combined": "B1TS",
}
BIAS_SHAPE_KINDS: dict[str, str] = {"bias": "1NTS", "neg_inf_bias": "BNTS", "combined": "1NTS"}


def broadcast_shape(config: Config, pattern: str) -> tuple[int, int, int, int]:
    """The array shape of a :data:`BROADCAST_SHAPES` ``pattern`` for ``config``:
    ``broadcast_shape(c, "B11S") == (c.batch, 1, 1, c.s)``.

    Args:
        config: The problem's sizes (an ``int`` batch).
        pattern: One of :data:`BROADCAST_SHAPES`, e.g. ``"B11S"``.

    Returns:
        The rank-4 shape, broadcastable to ``[B, N, T, S]``.

    Raises:
        ValueError: If ``pattern`` is not in :data:`BROADCAST_SHAPES` or ``config.batch`` is not
            an int.
    """
    if pattern not in BROADCAST_SHAPES:
        raise ValueError(
            f"pattern must be one of BROADCAST_SHAPES (each of 'BNTS' or '1'), got {pattern!r}"
        )
    _check_kernel_batch(config)
    full = {"B": config.batch, "N": config.n, "T": config.t, "S": config.s}
    return tuple(full.get(ch, 1) for ch in pattern)  # type: ignore[return-value]


def _check_kernel_batch(config: Config) -> None:
    if not isinstance(config.batch, (int, np.integer)):
        raise ValueError(
            f"kernel-level problems take one batch axis (an int batch), got batch={config.batch!r}"
        )


def broadcast_shapes(patterns: tuple[str, ...] = BROADCAST_SHAPES) -> st.SearchStrategy[str]:
    """A broadcast pattern from ``patterns`` (default: all 16 of :data:`BROADCAST_SHAPES`),
    shrinking towards the first; turn it into a shape with :func:`broadcast_shape`.

    Args:
        patterns: A non-empty subset of :data:`BROADCAST_SHAPES`, in shrinking order.

    Returns:
        A strategy of pattern strings.

    Raises:
        ValueError: If ``patterns`` is empty or has a pattern not in :data:`BROADCAST_SHAPES`.
    """
    bad = [p for p in patterns if p not in BROADCAST_SHAPES]
    if bad or not patterns:
        raise ValueError(f"patterns must be a non-empty subset of BROADCAST_SHAPES, got {bad}")
    return st.sampled_from(tuple(patterns))


def _filter_buckets(
    buckets: tuple[Config, ...], cross: bool, gqa: bool, value_dim_differs: bool
) -> tuple[Config, ...]:
    out = tuple(
        b
        for b in buckets
        if (cross or not b.is_cross)
        and (gqa or not b.is_gqa)
        and (value_dim_differs or b.h == b.h_v)
    )
    if not out:
        raise ValueError("no bucket satisfies the requested cross / gqa / value_dim constraints")
    return out


@st.composite
def configs(
    draw: DrawFn,
    *,
    buckets: tuple[Config, ...] = BUCKETS,
    dtypes: tuple[str, ...] = ("float32",),
    cross: bool = True,
    gqa: bool = True,
    value_dim_differs: bool = False,
) -> Config:
    """A :class:`Config` from ``buckets`` (only ``T == S`` unless ``cross``; only ``N == K``
    unless ``gqa``; only ``H_v == H`` unless ``value_dim_differs``) and a dtype from ``dtypes``.

    Args:
        buckets: The configs to draw from, small to large (default :data:`BUCKETS`).
        dtypes: Dtype names to draw from (default ``("float32",)``).
        cross: Allow ``T != S`` (default ``True``).
        gqa: Allow ``N != K`` (default ``True``).
        value_dim_differs: Allow ``H_v != H`` (default ``False``).

    Returns:
        A strategy of :class:`Config` (the bucket and the dtype are labelled draws).

    Raises:
        ValueError: If no bucket satisfies the constraints (when the strategy is drawn from).
    """
    pool = _filter_buckets(tuple(buckets), cross, gqa, value_dim_differs)
    bucket = draw(st.sampled_from(pool), label="bucket")
    dtype = draw(st.sampled_from(tuple(dtypes)), label="dtype")
    return dataclasses.replace(bucket, dtype=str(np.dtype(dtype)))


_configs = configs  # the strategy, for functions whose ``configs`` parameter shadows it


def kernel_inputs(
    config: Config, seed: int, *, identical: str = "none", scale: float = 1.0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``q [B, T, N, H]``, ``k [B, S, K, H]``, ``v [B, S, K, H_v]``: standard normal from PCG64
    ``seed`` times ``scale``, rounded to ``config.dtype``. ``identical="keys"`` repeats key row 0
    over every key position (the softmax is then uniform); ``"queries"`` repeats query row 0.

    Args:
        config: The problem's sizes and dtype (an ``int`` batch).
        seed: The PCG64 seed.
        identical: ``"none"`` (default), ``"keys"`` or ``"queries"`` (:data:`IDENTICAL`).
        scale: Multiplies ``q`` and ``k`` (default 1).

    Returns:
        ``(q, k, v)`` as NumPy arrays of ``config.dtype``.

    Raises:
        ValueError: If ``identical`` is unknown or ``config.batch`` is not an int.
    """
    if identical not in IDENTICAL:
        raise ValueError(f"identical must be one of {IDENTICAL}, got {identical!r}")
    _check_kernel_batch(config)
    c = config
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((c.batch, c.t, c.n, c.h)) * scale
    k = rng.standard_normal((c.batch, c.s, c.k, c.h)) * scale
    v = rng.standard_normal((c.batch, c.s, c.k, c.h_v))
    if identical == "keys":
        k[:] = k[:, :1]
    elif identical == "queries":
        q[:] = q[:, :1]
    dt = np.dtype(c.dtype)
    return q.astype(dt), k.astype(dt), v.astype(dt)


def _lengths(rng: np.random.Generator, b: int, n: int, low: int = 1) -> np.ndarray:
    return rng.integers(low, n + 1, size=b).astype(np.int32)


def _segments(rng: np.random.Generator, c: Config) -> tuple[np.ndarray, np.ndarray]:
    """Sorted (packed) segment ids with every query's segment present among the keys."""
    q_seg = np.sort(rng.integers(0, 3, size=(c.batch, c.t)), axis=1).astype(np.int32)
    kv_seg = np.zeros((c.batch, c.s), np.int32)
    for b in range(c.batch):
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
    **{kind: (kind,) for kind in MASK_KINDS},
    "none": (),
    "combined": ("causal", "padding", "random", "bias"),
}
_BIAS_PARTS = ("bias", "alibi", "neg_inf_bias")


def _build(
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
    """The one mask-kind builder: kernel options for a set of parts, drawn from ``rng`` in a
    fixed order (boolean mask, lengths, bias, segment ids), so a kind's arrays do not depend on
    which other parts come with it."""
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
        out["query_seq_lengths"] = _lengths(rng, c.batch, c.t, low)
        out["key_value_seq_lengths"] = _lengths(rng, c.batch, c.s, low)
    if "key_padding" in parts:
        out["key_value_seq_lengths"] = _lengths(rng, c.batch, c.s, low)
    if mask is not None:
        out["mask"] = mask
    if "bias" in parts:
        out["bias"] = rng.standard_normal(b_shape).astype(dt)
    if "alibi" in parts:
        slopes = oracle.alibi_slopes(c.n)
        bias = oracle.alibi_bias(slopes, c.t, c.s, causal_alignment=causal_alignment)
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
            q_seg, kv_seg = (
                np.sort(rng.integers(0, 3, size=(c.batch, n)), axis=1).astype(np.int32)
                for n in (c.t, c.s)
            )
            out["segment_ids"] = (q_seg, kv_seg)
        else:
            q_seg, kv_seg = _segments(rng, c)
            out["segment_ids"] = q_seg if c.t == c.s else (q_seg, kv_seg)
    if "softcap" in parts:
        out["softcap"] = 2.0
    return out


def _kinds(kind: str | tuple[str, ...]) -> tuple[str, ...]:
    kinds = (kind,) if isinstance(kind, str) else tuple(kind)
    bad = [k for k in kinds if k not in MASK_KINDS]
    if bad:
        raise ValueError(f"kind must be one of {MASK_KINDS} (or a tuple of them), got {bad}")
    return kinds


def _kind_name(kinds: tuple[str, ...]) -> str:
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
    """Keyword options of :func:`attnref.dot_product_attention` for one mask kind (or several).

    NumPy arrays, seeded by ``seed`` and the kinds; the bias in ``config.dtype``. Each kind has
    fixed array shapes and static values, so a jitted kernel compiles one program per kind, bucket
    and broadcast shape. Unless ``empty_rows``, only ``fully_masked_row`` (and ``combined`` with
    ``bottom_right`` alignment) can leave a query row with no allowed key.

    Args:
        config: The problem's sizes and dtype (an ``int`` batch).
        kind: One of :data:`MASK_KINDS`, or a tuple of them to combine (at most one of ``bias``,
            ``alibi`` and ``neg_inf_bias``; ``()`` is ``"none"``).
        seed: The data seed.
        causal_alignment: The alignment ``alibi`` distances are measured in.
        mask_shape: A :data:`BROADCAST_SHAPES` pattern for the boolean mask of ``random``,
            ``fully_masked_row`` and ``combined`` (``None``: the kind's own,
            :data:`MASK_SHAPE_KINDS`); ignored by the other kinds.
        bias_shape: Likewise for the bias of ``bias``, ``neg_inf_bias`` and ``combined``
            (:data:`BIAS_SHAPE_KINDS`).
        empty_rows: Let the random mask, sequence lengths (``0`` allowed), segment ids (query and
            key packings independent) and ``-inf`` biases leave rows with no key by accident.

    Returns:
        A dict of keyword options (``mask``, ``bias``, ``is_causal``, sequence lengths,
        ``local_window_size``, ``segment_ids``, ``softcap``: those the kinds need).

    Raises:
        ValueError: If a kind is unknown, more than one bias kind is given, a shape pattern is
            not in :data:`BROADCAST_SHAPES`, or ``config.batch`` is not an int.
    """
    kinds = _kinds(kind)
    index = [MASK_KINDS.index(k) for k in kinds]
    rng = np.random.default_rng([seed, *index])
    parts = frozenset(p for k in kinds for p in _KIND_PARTS[k])
    default_mask = next((MASK_SHAPE_KINDS[k] for k in kinds if k in MASK_SHAPE_KINDS), "BNTS")
    default_bias = next((BIAS_SHAPE_KINDS[k] for k in kinds if k in BIAS_SHAPE_KINDS), "BNTS")
    return _build(
        rng,
        config,
        parts,
        np.dtype(config.dtype),
        mask_shape=mask_shape or default_mask,
        bias_shape=bias_shape or default_bias,
        causal_alignment=causal_alignment,
        empty_rows=empty_rows,
    )


def _describe(value: Any) -> str:
    if isinstance(value, np.ndarray):
        if value.ndim <= 1 and value.size <= 8:
            return repr(value.tolist())
        return f"{value.dtype}{list(value.shape)}"
    if isinstance(value, tuple) and all(isinstance(v, np.ndarray) for v in value):
        return "(" + ", ".join(_describe(v) for v in value) + ")"
    return repr(value)


@dataclasses.dataclass
class KernelProblem:
    """One kernel-level problem: inputs ``q, k, v``, the keyword ``options`` of
    :func:`attnref.dot_product_attention` (``bias``, ``mask``, ``is_causal``, sequence lengths,
    ``local_window_size``, ``segment_ids``, ``softcap``, ``scale``), its :class:`Config`, and the
    semantics the oracle is run with (``masked_rows``, ``causal_alignment``).

    Attributes:
        q: Queries ``[B, T, N, H]``.
        k: Keys ``[B, S, K, H]``.
        v: Values ``[B, S, K, H_v]``.
        options: Keyword options of :func:`attnref.dot_product_attention`.
        config: The sizes and dtype (:class:`Config`).
        kind: The mask kind (kinds joined by ``+`` for a mix).
        seed: The data seed.
        identical: The identical-rows case (:data:`IDENTICAL`).
        masked_rows: The masked-rows policy the oracle runs with.
        causal_alignment: The causal alignment the oracle runs with.
    """

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    options: dict[str, Any]
    config: Config
    kind: str = "none"
    seed: int = 0
    identical: str = "none"
    masked_rows: str = "zeros"
    causal_alignment: str = "top_left"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        """Hypothesis (IPython's pretty printer) shows the short ``repr``, not every array."""
        printer.text(repr(self))

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={_describe(v)}" for k, v in sorted(self.options.items()))
        extra = "" if self.identical == "none" else f", identical={self.identical!r}"
        return (
            f"KernelProblem({self.config!r}, kind={self.kind!r}, seed={self.seed}{extra}, "
            f"options={{{opts}}})"
        )

    @property
    def dtype(self) -> np.dtype[Any]:
        """The inputs' dtype, ``config.dtype``."""
        return np.dtype(self.config.dtype)

    def semantics(self) -> dict[str, str]:
        """``{"masked_rows": ..., "causal_alignment": ...}``, the oracle's semantics."""
        return {"masked_rows": self.masked_rows, "causal_alignment": self.causal_alignment}

    @property
    def kwargs(self) -> dict[str, Any]:
        """Every keyword argument of :func:`attnref.dot_product_attention` for the problem: the
        ``options``, and ``masked_rows`` / ``causal_alignment`` where they are not the defaults."""
        kw = dict(self.options)
        if self.masked_rows != "zeros":
            kw["masked_rows"] = self.masked_rows
        if self.causal_alignment != "top_left":
            kw["causal_alignment"] = self.causal_alignment
        return kw

    @property
    def static(self) -> dict[str, Any]:
        """The entries of :attr:`kwargs` that ``jax.jit`` takes as static
        (:data:`STATIC_OPTIONS`)."""
        return {k: v for k, v in self.kwargs.items() if k in STATIC_OPTIONS}

    def allowed(self) -> np.ndarray:
        """The allowed (query, key) pairs ``[B, N, T, S]``
        (:func:`attnref.oracle.kernel_allowed`)."""
        c = self.config
        kw = {k: v for k, v in self.options.items() if k not in ("softcap", "scale")}
        return oracle.kernel_allowed(
            (c.batch, c.n, c.t, c.s), causal_alignment=self.causal_alignment, **kw
        )

    def oracle(self) -> tuple[np.ndarray, np.ndarray]:
        """Float64 ``(out [B, T, N, H_v], lse [B, T, N])`` from
        :func:`attnref.oracle.dot_product_attention` with the problem's semantics."""
        out, lse = oracle.dot_product_attention(
            self.q,
            self.k,
            self.v,
            return_lse=True,
            masked_rows=self.masked_rows,
            causal_alignment=self.causal_alignment,
            **self.options,
        )
        return out, lse

    def bound(self, key_blocks: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Componentwise bounds on ``|out - oracle|`` and ``|lse - oracle lse|`` in the problem's
        dtype (:func:`attnref.tolerance.kernel_error_bound`; ``key_blocks=None`` is valid for any
        tiling of the keys)."""
        return tolerance.kernel_error_bound(
            self.q,
            self.k,
            self.v,
            self.allowed(),
            self.options.get("bias"),
            scale=self.options.get("scale"),
            softcap=self.options.get("softcap"),
            masked_rows=self.masked_rows,
            dtype=self.dtype,
            key_blocks=key_blocks,
        )

    def replace(self, **changes: Any) -> KernelProblem:
        """A copy with fields replaced; ``config`` follows the new array shapes and dtype."""
        new = dataclasses.replace(self, **changes)
        b, t, n, h = new.q.shape
        s, kh, h_v = new.k.shape[1], new.k.shape[2], new.v.shape[3]
        cfg = dataclasses.replace(
            new.config, batch=b, t=t, s=s, n=n, k=kh, h=h, h_v=h_v, dtype=str(new.q.dtype)
        )
        return dataclasses.replace(new, config=cfg)

    def batch_slice(self, b: int) -> KernelProblem:
        """Batch element ``b`` alone (every per-example option sliced with it)."""
        opts: dict[str, Any] = {}
        for key, val in self.options.items():
            if key in ("query_seq_lengths", "key_value_seq_lengths") or (
                key in ("mask", "bias") and np.shape(val)[0] > 1
            ):
                val = val[b : b + 1]
            elif key == "segment_ids":
                val = tuple(a[b : b + 1] for a in val) if isinstance(val, tuple) else val[b : b + 1]
            opts[key] = val
        sl = slice(b, b + 1)
        return self.replace(q=self.q[sl], k=self.k[sl], v=self.v[sl], options=opts)

    def astype(self, dtype: Any) -> KernelProblem:
        """The same problem with ``q, k, v`` (and a float bias) rounded to ``dtype``."""
        dt = np.dtype(dtype)
        opts = dict(self.options)
        if "bias" in opts:
            opts["bias"] = np.asarray(opts["bias"]).astype(dt)
        return self.replace(
            q=self.q.astype(dt), k=self.k.astype(dt), v=self.v.astype(dt), options=opts
        )


def _with_dtype(config: Config, dtype: Any) -> Config:
    return config if dtype is None else dataclasses.replace(config, dtype=str(np.dtype(dtype)))


def make_kernel_problem(
    config: Config,
    kind: str | tuple[str, ...] = "none",
    seed: int = 0,
    dtype: Any = None,
    *,
    identical: str = "none",
    scale: float = 1.0,
    masked_rows: str = "zeros",
    causal_alignment: str = "top_left",
    mask_shape: str | None = None,
    bias_shape: str | None = None,
    static: dict[str, Any] | None = None,
    empty_rows: bool = False,
) -> KernelProblem:
    """The deterministic kernel problem behind one draw of :func:`kernel_problems` (or of
    :func:`mixed_kernel_problems`, with ``static`` and several kinds).

    Args:
        config: Sizes and dtype (an ``int`` batch).
        kind: A mask kind of :data:`MASK_KINDS`, or a tuple of them (:func:`make_options`).
        seed: The data seed (inputs, :func:`kernel_inputs`, and the kinds' arrays).
        dtype: Overrides ``config.dtype`` when given.
        identical: The identical-rows special case (:data:`IDENTICAL`).
        scale: Multiplies ``q`` and ``k`` (larger logits); not the attention scale.
        masked_rows: The masked-rows policy the oracle runs with.
        causal_alignment: The causal alignment the oracle runs with.
        mask_shape: The boolean mask's broadcast pattern (:func:`make_options`).
        bias_shape: The bias's broadcast pattern (:func:`make_options`).
        static: Static options added to ``options`` (a :data:`STATIC_PROFILES` entry:
            ``is_causal``, ``local_window_size``, ``softcap``, ``scale``); its ``masked_rows`` and
            ``causal_alignment`` override the arguments of those names.
        empty_rows: Let the kinds' arrays leave rows with no key by accident
            (:func:`make_options`).

    Returns:
        A :class:`KernelProblem`.

    Raises:
        ValueError: If ``static`` has a non-static option (or ``return_lse``), or for the
            errors of :func:`make_options` and :func:`kernel_inputs`.
    """
    c = _with_dtype(config, dtype)
    extra = dict(static or {})
    masked_rows = extra.pop("masked_rows", masked_rows)
    causal_alignment = extra.pop("causal_alignment", causal_alignment)
    unknown = set(extra) - set(STATIC_OPTIONS) - {"return_lse"}
    if unknown or "return_lse" in extra:
        raise ValueError(f"static takes static options {STATIC_OPTIONS}, got {sorted(extra)}")
    kinds = _kinds(kind)
    q, k, v = kernel_inputs(c, seed, identical=identical, scale=scale)
    opts = make_options(
        c,
        kinds,
        seed,
        causal_alignment=causal_alignment,
        mask_shape=mask_shape,
        bias_shape=bias_shape,
        empty_rows=empty_rows,
    )
    opts.update(extra)
    name = kind if isinstance(kind, str) else _kind_name(kinds)
    return KernelProblem(q, k, v, opts, c, name, seed, identical, masked_rows, causal_alignment)


@st.composite
def kernel_problems(
    draw: DrawFn,
    configs: st.SearchStrategy[Config] | None = None,
    *,
    kinds: tuple[str, ...] = MASK_KINDS,
    identical_rows: bool = False,
    masked_rows: str = "zeros",
    causal_alignment: str = "top_left",
    mask_shapes: tuple[str, ...] | None = BROADCAST_SHAPES,
    bias_shapes: tuple[str, ...] | None = BROADCAST_SHAPES,
) -> KernelProblem:
    """A :class:`KernelProblem`: a config, a mask kind from ``kinds``, a data seed, (when
    ``identical_rows``) the identical-rows special case and, for a kind with a boolean mask or a
    bias, its broadcast shape from ``mask_shapes`` / ``bias_shapes`` (default: every one of
    :data:`BROADCAST_SHAPES`; ``None``: the kind's own fixed shape, one compiled program per
    bucket), each a labelled draw.

    Args:
        configs: A :class:`Config` strategy (default :func:`configs`; ``int`` batches).
        kinds: The mask kinds to draw from (default :data:`MASK_KINDS`).
        identical_rows: Draw the identical-rows special case one time in four (default
            ``False``).
        masked_rows: The masked-rows policy of every problem (default ``"zeros"``).
        causal_alignment: The causal alignment of every problem (default ``"top_left"``).
        mask_shapes: Broadcast patterns for the boolean mask, or ``None``.
        bias_shapes: Broadcast patterns for the bias, or ``None``.

    Returns:
        A strategy of :class:`KernelProblem` (:func:`make_kernel_problem`).
    """
    strategy = _configs() if configs is None else configs
    config = draw(strategy, label="config")
    kind = draw(mask_kinds(kinds=tuple(kinds)), label="mask kind")
    mask_shape = bias_shape = None
    if kind in MASK_SHAPE_KINDS and mask_shapes is not None:
        mask_shape = draw(broadcast_shapes(tuple(mask_shapes)), label="mask shape")
    if kind in BIAS_SHAPE_KINDS and bias_shapes is not None:
        bias_shape = draw(broadcast_shapes(tuple(bias_shapes)), label="bias shape")
    identical = "none"
    if identical_rows:
        # one draw in four is the special case, chosen on purpose (and shrinks towards "none")
        pick = draw(st.sampled_from(("none", "none", "keys", "queries")), label="identical rows")
        identical = pick
    seed = draw(st.integers(0, 2**32 - 1), label="data seed")
    shapes = "".join(
        f" {name}={value}"
        for name, value in (("mask_shape", mask_shape), ("bias_shape", bias_shape))
        if value is not None
    )
    note(f"config={config!r} kind={kind}{shapes} identical={identical} seed={seed}")
    return make_kernel_problem(
        config,
        kind,
        seed,
        identical=identical,
        masked_rows=masked_rows,
        causal_alignment=causal_alignment,
        mask_shape=mask_shape,
        bias_shape=bias_shape,
    )


@st.composite
def mixed_kernel_problems(
    draw: DrawFn,
    configs: st.SearchStrategy[Config] | None = None,
    *,
    profiles: tuple[dict[str, Any], ...] = STATIC_PROFILES,
    kinds: tuple[str, ...] = ARRAY_KINDS,
    max_kinds: int = 3,
    mask_shapes: tuple[str, ...] = BROADCAST_SHAPES,
    bias_shapes: tuple[str, ...] = BROADCAST_SHAPES,
) -> KernelProblem:
    """A :class:`KernelProblem` mixing a static option profile with several array kinds.

    Every draw is labelled: the config, a profile from ``profiles``, a set of up to ``max_kinds``
    kinds from ``kinds`` (one bias at most: ``neg_inf_bias`` wins over ``alibi``, ``alibi`` over
    ``bias``), the mask's and the bias's broadcast shapes, the data seed, and the sequence lengths
    (:func:`seq_lengths`) and segment ids (:func:`segment_ids`, independent packings of queries
    and keys) where drawn. Rows with no key come up by accident (``empty_rows=True`` of
    :func:`make_options`), under each profile's masked-rows policy.

    Args:
        configs: A :class:`Config` strategy (default :func:`configs`).
        profiles: Static option profiles (default :data:`STATIC_PROFILES`).
        kinds: The array kinds to mix, a subset of :data:`ARRAY_KINDS`.
        max_kinds: The most kinds in one problem.
        mask_shapes: The boolean mask's broadcast patterns (:data:`BROADCAST_SHAPES`).
        bias_shapes: The bias's broadcast patterns (``alibi`` has its own, ``[1, N, T, S]``).

    Returns:
        A strategy of :class:`KernelProblem` (``kind``: the kinds joined by ``+``).

    Raises:
        ValueError: If ``kinds`` is not a subset of :data:`ARRAY_KINDS` or ``profiles`` is
            empty (when the strategy is drawn from).
    """
    bad = [k for k in kinds if k not in ARRAY_KINDS]
    if bad or not profiles:
        raise ValueError(f"kinds must be a subset of ARRAY_KINDS and profiles non-empty: {bad}")
    strategy = _configs() if configs is None else configs
    config = draw(strategy, label="config")
    profile = draw(st.sampled_from(tuple(profiles)), label="static profile")
    chosen = draw(st.sets(st.sampled_from(tuple(kinds)), max_size=max_kinds), label="array kinds")
    if "neg_inf_bias" in chosen:
        chosen -= {"alibi", "bias"}
    elif "alibi" in chosen:
        chosen -= {"bias"}
    picked = tuple(k for k in ARRAY_KINDS if k in chosen)
    mask_shape = bias_shape = None
    if "random" in chosen:
        mask_shape = draw(broadcast_shapes(tuple(mask_shapes)), label="mask shape")
    if chosen & {"bias", "neg_inf_bias"}:
        bias_shape = draw(broadcast_shapes(tuple(bias_shapes)), label="bias shape")
    seed = draw(st.integers(0, 2**32 - 1), label="data seed")
    note(
        f"config={config!r} profile={profile} kinds={picked} mask_shape={mask_shape} "
        f"bias_shape={bias_shape} seed={seed}"
    )
    seeded = tuple(k for k in picked if k not in ("padding", "segments"))
    problem = make_kernel_problem(
        config,
        seeded,
        seed,
        static=profile,
        mask_shape=mask_shape,
        bias_shape=bias_shape,
        empty_rows=True,
    )
    c = config
    if "padding" in chosen:
        problem.options["query_seq_lengths"] = draw(
            seq_lengths(c.batch, c.t), label="query seq lengths"
        )
        problem.options["key_value_seq_lengths"] = draw(
            seq_lengths(c.batch, c.s), label="key/value seq lengths"
        )
    if "segments" in chosen:
        q_seg = draw(segment_ids(c.batch, c.t), label="query segment ids")
        kv_seg = draw(segment_ids(c.batch, c.s), label="key/value segment ids")
        problem.options["segment_ids"] = (q_seg, kv_seg)
    problem.kind = _kind_name(picked)
    return problem


def mask_kinds(
    features: tuple[str, ...] | None = None, *, kinds: tuple[str, ...] = MASK_KINDS
) -> st.SearchStrategy[str]:
    """A mask kind from ``kinds`` whose :data:`KIND_FEATURES` are all in ``features``.

    Args:
        features: :func:`attnref.testing.check_attention` features (``None``: every kind).
        kinds: The kinds to draw from, in shrinking order (default :data:`MASK_KINDS`; the
            weight level's are :data:`WEIGHT_KINDS`).

    Returns:
        A strategy of kind names.

    Raises:
        ValueError: If a kind is unknown, or no kind needs only ``features``.
    """
    unknown = [k for k in kinds if k not in KIND_FEATURES]
    if unknown:
        raise ValueError(f"unknown mask kinds {unknown}; known: {MASK_KINDS}")
    pool = tuple(k for k in kinds if features is None or set(KIND_FEATURES[k]) <= set(features))
    if not pool:
        raise ValueError(f"no kind of {tuple(kinds)} needs only the features {features}")
    return st.sampled_from(pool)


@st.composite
def seq_lengths(draw: DrawFn, batch: int, length: int, *, allow_empty: bool = True) -> np.ndarray:
    """Sequence lengths, one per batch element (labelled ``"seq lengths"``).

    Args:
        batch: The batch size.
        length: The largest length (``T`` or ``S``).
        allow_empty: Whether ``0`` may be drawn (a sequence with no token).

    Returns:
        A strategy of ``int32`` arrays ``[batch]`` in ``[0 or 1, length]``.
    """
    low = 0 if allow_empty else 1
    values = draw(
        st.lists(st.integers(low, length), min_size=batch, max_size=batch), label="seq lengths"
    )
    return np.asarray(values, np.int32)


@st.composite
def segment_ids(draw: DrawFn, batch: int, length: int, *, max_segments: int = 3) -> np.ndarray:
    """Packed segment ids, non-decreasing along each sequence (labelled ``"segment ids"``).

    Args:
        batch: The batch size.
        length: The sequence length (``T`` or ``S``).
        max_segments: Ids are drawn from ``[0, max_segments)``.

    Returns:
        A strategy of ``int32`` arrays ``[batch, length]``.
    """
    rows = draw(
        st.lists(
            st.lists(st.integers(0, max_segments - 1), min_size=length, max_size=length),
            min_size=batch,
            max_size=batch,
        ),
        label="segment ids",
    )
    return np.sort(np.asarray(rows, np.int32), axis=1)


# ----------------------------------------------------------------------------- weight level

WEIGHT_KINDS = ("none", "causal", "padding", "random", "bias", "fully_masked_row", "combined")
# The builder's parts of each weight-level kind: padding pads the keys only (the weight level has
# no query lengths; a masked query row is the fully_masked_row kind), combined has no random mask.
_WEIGHT_PARTS: dict[str, tuple[str, ...]] = {
    "none": (),
    "causal": ("causal",),
    "padding": ("key_padding",),
    "random": ("random",),
    "bias": ("bias",),
    "fully_masked_row": ("fully_masked_row",),
    "combined": ("causal", "key_padding", "bias"),
}


@dataclasses.dataclass
class AttentionProblem:
    """One weight-level problem: parameters (``num_kv_heads`` K/V heads), inputs
    ``x_q [*batch, T, d_model]`` and ``x_kv [*batch, S, d_model]``, a full boolean
    ``mask [*batch, T, S]`` and an additive ``bias [*batch, T, S]`` (full whatever the kind, so
    one compiled program serves every kind).

    Attributes:
        params: The parameters (:class:`attnref.AttentionParams`, ``config.k`` K/V heads).
        x_q: Query tokens ``[*batch, T, d_model]``.
        x_kv: Key/value tokens ``[*batch, S, d_model]`` (sometimes ``x_q`` itself).
        mask: Boolean ``[*batch, T, S]``, ``True`` = may attend.
        bias: Additive ``[*batch, T, S]`` (zeros for kinds without a bias).
        config: The sizes and dtype (:class:`Config`).
        kind: The mask kind (:data:`WEIGHT_KINDS`).
        seed: The data seed.
    """

    params: AttentionParams
    x_q: np.ndarray
    x_kv: np.ndarray
    mask: np.ndarray
    bias: np.ndarray
    config: Config
    kind: str = "none"
    seed: int = 0

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        """Hypothesis (IPython's pretty printer) shows the short ``repr``, not every array."""
        printer.text(repr(self))

    def __repr__(self) -> str:
        return f"AttentionProblem({self.config!r}, kind={self.kind!r}, seed={self.seed})"

    @property
    def dtype(self) -> np.dtype[Any]:
        """The problem's dtype, ``config.dtype``."""
        return np.dtype(self.config.dtype)

    def inputs(self) -> dict[str, np.ndarray]:
        """The ``mask`` and ``bias`` keyword arguments of every weight-level formulation."""
        return {"mask": self.mask, "bias": self.bias}

    def oracle(self) -> np.ndarray:
        """Float64 output ``[*batch, T, d_model]`` from :func:`attnref.oracle.attention`."""
        return oracle.attention(self.params, self.x_q, self.x_kv, mask=self.mask, bias=self.bias)

    def bound(self) -> np.ndarray:
        """Componentwise bound (:func:`attnref.tolerance.attention_error_bound`)."""
        return tolerance.attention_error_bound(
            self.params,
            self.x_q,
            self.x_kv,
            mask=self.mask,
            bias=self.bias,
            dtype=np.dtype(self.config.dtype),
        )

    def astype(self, dtype: Any) -> AttentionProblem:
        """The same problem with parameters, inputs and bias rounded to ``dtype``."""
        dt = np.dtype(dtype)
        return dataclasses.replace(
            self,
            params=self.params.astype(dt),
            x_q=self.x_q.astype(dt),
            x_kv=self.x_kv.astype(dt),
            bias=self.bias.astype(dt),
            config=dataclasses.replace(self.config, dtype=str(dt)),
        )


def make_attention_problem(
    config: Config,
    kind: str = "none",
    seed: int = 0,
    dtype: Any = None,
    *,
    param_bias: bool = True,
) -> AttentionProblem:
    """The deterministic weight-level problem behind one draw of :func:`attention_problems`.

    Parameters from :func:`attnref.init_params` (seeded by ``seed``, ``config.k`` K/V heads);
    inputs standard normal from PCG64 ``seed``, with ``x_kv`` the very ``x_q`` in about half the
    problems whose ``T == S`` (self-attention proper); the mask and bias from the kernel level's
    builder (:func:`make_options`), rendered full.

    Args:
        config: Sizes and dtype (``batch``: an ``int`` or a tuple of leading batch dims).
        kind: One of :data:`WEIGHT_KINDS` (``padding`` pads keys only).
        seed: The data seed.
        dtype: Overrides ``config.dtype`` when given.
        param_bias: Whether the parameters have biases.

    Returns:
        An :class:`AttentionProblem` in the dtype (its mask boolean).

    Raises:
        ValueError: If ``kind`` is not in :data:`WEIGHT_KINDS`, or the sizes are invalid for
            :func:`attnref.init_params`.
    """
    if kind not in WEIGHT_KINDS:
        raise ValueError(f"kind must be one of {WEIGHT_KINDS}, got {kind!r}")
    c = _with_dtype(config, dtype)
    rng = np.random.default_rng(seed)
    params = init_params(
        seed,
        d_model=c.d_model,
        num_heads=c.n,
        d_k=c.d_k,
        d_v=c.d_v,
        bias=param_bias,
        dtype=np.float64,
        num_kv_heads=c.k,
    )
    batch = c.batch_shape
    x_q = rng.standard_normal((*batch, c.t, c.d_model))
    shared = c.t == c.s and rng.random() < 0.5
    x_kv = x_q if shared else rng.standard_normal((*batch, c.s, c.d_model))
    # One head, the batch dims flattened: the builder's [B, 1, T, S] arrays, then [*batch, T, S].
    flat = dataclasses.replace(c, batch=math.prod(batch), n=1, k=1)
    opts = _build(
        rng,
        flat,
        frozenset(_WEIGHT_PARTS[kind]),
        np.dtype(np.float64),
        mask_shape="BNTS",
        bias_shape="BNTS",
        causal_alignment="top_left",
        empty_rows=False,
    )
    bias = opts.pop("bias", None)
    allowed = oracle.kernel_allowed((flat.batch, 1, c.t, c.s), **opts)
    mask = allowed[:, 0].reshape(*batch, c.t, c.s)
    bias = np.zeros(mask.shape) if bias is None else bias[:, 0].reshape(mask.shape)
    dt = np.dtype(c.dtype)
    return AttentionProblem(
        params.astype(dt), x_q.astype(dt), x_kv.astype(dt), mask, bias.astype(dt), c, kind, seed
    )


@st.composite
def attention_problems(
    draw: DrawFn,
    configs: st.SearchStrategy[Config] | None = None,
    *,
    kinds: tuple[str, ...] = WEIGHT_KINDS,
    param_bias: bool | None = None,
) -> AttentionProblem:
    """A weight-level :class:`AttentionProblem` (GQA when the config has ``k < n``).

    Config, mask kind, parameter biases and data seed are labelled draws.

    Args:
        configs: A :class:`Config` strategy (default :func:`configs`; the weight level's own
            buckets: ``configs(buckets=WEIGHT_BUCKETS, value_dim_differs=True)``).
        kinds: Mask kinds from :data:`WEIGHT_KINDS`.
        param_bias: Whether the parameters have biases (``None``: drawn).

    Returns:
        A strategy of :class:`AttentionProblem` (:func:`make_attention_problem`).
    """
    strategy = _configs() if configs is None else configs
    config = draw(strategy, label="config")
    kind = draw(mask_kinds(kinds=tuple(kinds)), label="mask kind")
    with_bias = draw(st.booleans(), label="parameter biases") if param_bias is None else param_bias
    seed = draw(st.integers(0, 2**31 - 1), label="data seed")
    note(f"config={config!r} kind={kind} parameter biases={with_bias} seed={seed}")
    return make_attention_problem(config, kind, seed, param_bias=with_bias)
