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
  short tuple of :data:`BUCKETS`, so a jitted function is compiled once per bucket and dtype, not
  once per example. Buckets are ordered small to large, so Hypothesis shrinks towards the smallest.
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
  :func:`attnref.testing.check_attention` each kind needs.

Kernel problems use the layout of :func:`attnref.dot_product_attention` (``q [B, T, N, H]``,
``k [B, S, K, H]``, ``v [B, S, K, H_v]``); weight-level problems the multi-head layout of
:func:`attnref.oracle.attention` (``x_q [B, T, d_model]``, ``x_kv [B, S, d_model]``, parameters
from :func:`attnref.init_params`, GQA through ``num_kv_heads``).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import numpy as np
from hypothesis import note
from hypothesis import strategies as st

from attnref import oracle, tolerance
from attnref._src.params import AttentionParams, init_params

__all__ = [
    "BIAS_SHAPE_KINDS",
    "BROADCAST_SHAPES",
    "BUCKETS",
    "IDENTICAL",
    "KIND_FEATURES",
    "MASK_KINDS",
    "MASK_SHAPE_KINDS",
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
    "segment_ids",
    "seq_lengths",
]


@dataclasses.dataclass(frozen=True)
class Config:
    """Sizes and dtype of one attention problem.

    ``batch`` examples, ``t`` queries, ``s`` keys, ``n`` query heads, ``k`` key/value heads
    (``n % k == 0``; query head ``i`` reads K/V head ``i // (n // k)``), head dims ``h`` (queries
    and keys; ``d_k`` at the weight level) and ``h_v`` (values; ``d_v``), model width ``d_model``.
    """

    batch: int
    t: int
    s: int
    n: int
    k: int
    h: int
    h_v: int
    d_model: int
    dtype: str = "float32"

    @property
    def group(self) -> int:
        """Query heads per K/V head."""
        return self.n // self.k

    @property
    def d_k(self) -> int:
        return self.h

    @property
    def d_v(self) -> int:
        return self.h_v

    @property
    def is_cross(self) -> bool:
        return self.t != self.s

    @property
    def is_gqa(self) -> bool:
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
    ``broadcast_shape(c, "B11S") == (c.batch, 1, 1, c.s)``."""
    if pattern not in BROADCAST_SHAPES:
        raise ValueError(
            f"pattern must be one of BROADCAST_SHAPES (each of 'BNTS' or '1'), got {pattern!r}"
        )
    full = {"B": config.batch, "N": config.n, "T": config.t, "S": config.s}
    return tuple(full.get(ch, 1) for ch in pattern)  # type: ignore[return-value]


def broadcast_shapes(patterns: tuple[str, ...] = BROADCAST_SHAPES) -> st.SearchStrategy[str]:
    """A broadcast pattern from ``patterns`` (default: all 16 of :data:`BROADCAST_SHAPES`),
    shrinking towards the first; turn it into a shape with :func:`broadcast_shape`."""
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
    draw: st.DrawFn,
    *,
    buckets: tuple[Config, ...] = BUCKETS,
    dtypes: tuple[str, ...] = ("float32",),
    cross: bool = True,
    gqa: bool = True,
    value_dim_differs: bool = False,
) -> Config:
    """A :class:`Config` from ``buckets`` (only ``T == S`` unless ``cross``; only ``N == K``
    unless ``gqa``; only ``H_v == H`` unless ``value_dim_differs``) and a dtype from ``dtypes``."""
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
    over every key position (the softmax is then uniform); ``"queries"`` repeats query row 0."""
    if identical not in IDENTICAL:
        raise ValueError(f"identical must be one of {IDENTICAL}, got {identical!r}")
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


def _random_mask(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    mask = rng.random(shape) < 0.6
    keep = rng.integers(0, shape[-1], size=shape[:-1])
    np.put_along_axis(mask, keep[..., None], True, axis=-1)  # every row keeps one key
    return mask


def make_options(
    config: Config,
    kind: str,
    seed: int,
    *,
    causal_alignment: str = "top_left",
    mask_shape: str | None = None,
    bias_shape: str | None = None,
) -> dict[str, Any]:
    """Keyword options of :func:`attnref.dot_product_attention` for one mask ``kind`` (NumPy
    arrays; the bias in ``config.dtype``). Only ``fully_masked_row`` (and ``combined`` with
    ``bottom_right`` alignment) can leave a query row with no allowed key.

    ``mask_shape`` / ``bias_shape``: a :data:`BROADCAST_SHAPES` pattern for the boolean mask of
    ``random``, ``fully_masked_row`` and ``combined`` and for the bias of ``bias``,
    ``neg_inf_bias`` and ``combined`` (``None``: the kind's own, :data:`MASK_SHAPE_KINDS`,
    :data:`BIAS_SHAPE_KINDS`); ignored by the other kinds.
    """
    if kind not in MASK_KINDS:
        raise ValueError(f"kind must be one of {MASK_KINDS}, got {kind!r}")
    c = config
    rng = np.random.default_rng([seed, MASK_KINDS.index(kind)])
    dt = np.dtype(c.dtype)
    m_shape = broadcast_shape(c, mask_shape or MASK_SHAPE_KINDS.get(kind, "BNTS"))
    b_shape = broadcast_shape(c, bias_shape or BIAS_SHAPE_KINDS.get(kind, "BNTS"))
    # Each kind has fixed array shapes and static values, so a jitted kernel compiles one
    # program per kind, bucket and drawn broadcast shape.
    if kind == "none":
        return {}
    if kind == "causal":
        return {"is_causal": True}
    if kind == "padding":
        return {
            "query_seq_lengths": _lengths(rng, c.batch, c.t),
            "key_value_seq_lengths": _lengths(rng, c.batch, c.s),
        }
    if kind == "random":  # every row keeps a key
        return {"mask": _random_mask(rng, m_shape)}
    if kind == "bias":
        return {"bias": rng.standard_normal(b_shape).astype(dt)}
    if kind == "alibi":
        slopes = oracle.alibi_slopes(c.n)
        bias = oracle.alibi_bias(slopes, c.t, c.s, causal_alignment=causal_alignment)
        return {"bias": bias.astype(dt)}
    if kind == "neg_inf_bias":  # every row keeps a finite entry
        bias = rng.standard_normal(b_shape)
        bias[rng.random(bias.shape) < 0.35] = -np.inf
        keep = rng.integers(0, b_shape[-1], size=bias.shape[:-1])
        np.put_along_axis(bias, keep[..., None], rng.standard_normal((*bias.shape[:-1], 1)), -1)
        return {"bias": bias.astype(dt)}
    if kind == "window":  # asymmetric, so swapped sides are caught
        return {"local_window_size": (2, 1)}
    if kind == "segments":
        q_seg, kv_seg = _segments(rng, c)
        return {"segment_ids": q_seg if c.t == c.s else (q_seg, kv_seg)}
    if kind == "softcap":
        return {"softcap": 2.0}
    if kind == "fully_masked_row":  # one (broadcast) row with no key
        mask = _random_mask(rng, m_shape)
        mask[int(rng.integers(m_shape[0])), :, int(rng.integers(m_shape[2])), :] = False
        return {"mask": mask}
    # combined: causal, padding, a random mask and a finite bias
    mask = _random_mask(rng, m_shape)
    mask[..., 0] = True  # key 0 is causal-visible to every query under top-left alignment
    return {
        "is_causal": True,
        "query_seq_lengths": _lengths(rng, c.batch, c.t),
        "key_value_seq_lengths": _lengths(rng, c.batch, c.s),
        "mask": mask,
        "bias": rng.standard_normal(b_shape).astype(dt),
    }


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
    semantics the oracle is run with (``masked_rows``, ``causal_alignment``)."""

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
        return np.dtype(self.config.dtype)

    def semantics(self) -> dict[str, str]:
        return {"masked_rows": self.masked_rows, "causal_alignment": self.causal_alignment}

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


def make_kernel_problem(
    config: Config,
    kind: str = "none",
    seed: int = 0,
    *,
    identical: str = "none",
    scale: float = 1.0,
    masked_rows: str = "zeros",
    causal_alignment: str = "top_left",
    mask_shape: str | None = None,
    bias_shape: str | None = None,
) -> KernelProblem:
    """The deterministic problem behind one draw of :func:`kernel_problems` (``mask_shape``,
    ``bias_shape``: broadcast patterns, :func:`make_options`)."""
    q, k, v = kernel_inputs(config, seed, identical=identical, scale=scale)
    opts = make_options(
        config,
        kind,
        seed,
        causal_alignment=causal_alignment,
        mask_shape=mask_shape,
        bias_shape=bias_shape,
    )
    return KernelProblem(
        q, k, v, opts, config, kind, seed, identical, masked_rows, causal_alignment
    )


@st.composite
def kernel_problems(
    draw: st.DrawFn,
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
    bucket), each a labelled draw."""
    strategy = _configs() if configs is None else configs
    config = draw(strategy, label="config")
    kind = draw(st.sampled_from(tuple(kinds)), label="mask kind")
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


def mask_kinds(features: tuple[str, ...] | None = None) -> st.SearchStrategy[str]:
    """A mask kind whose :data:`KIND_FEATURES` are all in ``features`` (every kind if ``None``)."""
    pool = tuple(
        k for k in MASK_KINDS if features is None or set(KIND_FEATURES[k]) <= set(features)
    )
    return st.sampled_from(pool)


@st.composite
def seq_lengths(
    draw: st.DrawFn, batch: int, length: int, *, allow_empty: bool = True
) -> np.ndarray:
    """Sequence lengths ``[batch]`` in ``[0 or 1, length]`` (labelled)."""
    low = 0 if allow_empty else 1
    values = draw(
        st.lists(st.integers(low, length), min_size=batch, max_size=batch), label="seq lengths"
    )
    return np.asarray(values, np.int32)


@st.composite
def segment_ids(draw: st.DrawFn, batch: int, length: int, *, max_segments: int = 3) -> np.ndarray:
    """Packed segment ids ``[batch, length]``: non-decreasing ids in ``[0, max_segments)``."""
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


@dataclasses.dataclass
class AttentionProblem:
    """One weight-level problem: parameters (``num_kv_heads`` K/V heads), inputs, a full boolean
    ``mask [B, T, S]`` and an additive ``bias [B, T, S]``."""

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

    def oracle(self) -> np.ndarray:
        """Float64 output ``[B, T, d_model]`` from :func:`attnref.oracle.attention`."""
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


def make_attention_problem(
    config: Config, kind: str = "none", seed: int = 0, *, param_bias: bool = True
) -> AttentionProblem:
    """The deterministic problem behind one draw of :func:`attention_problems`."""
    if kind not in WEIGHT_KINDS:
        raise ValueError(f"kind must be one of {WEIGHT_KINDS}, got {kind!r}")
    c = config
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
    x_q = rng.standard_normal((c.batch, c.t, c.d_model))
    x_kv = rng.standard_normal((c.batch, c.s, c.d_model))
    full = (c.batch, c.t, c.s)
    mask = np.ones(full, bool)
    bias = np.zeros(full)
    if kind in ("causal", "combined"):
        mask &= np.tril(np.ones((c.t, c.s), bool))
    if kind in ("padding", "combined"):
        lengths = rng.integers(1, c.s + 1, size=c.batch)
        mask &= (np.arange(c.s) < lengths[:, None])[:, None, :]
    if kind in ("random", "fully_masked_row"):
        mask &= rng.random(full) < 0.7
        mask[..., 0] = True
    if kind in ("bias", "combined"):
        bias = rng.standard_normal(full)
    if kind == "fully_masked_row":
        mask[:, int(rng.integers(c.t)), :] = False
    dt = np.dtype(c.dtype)
    return AttentionProblem(
        params.astype(dt), x_q.astype(dt), x_kv.astype(dt), mask, bias.astype(dt), c, kind, seed
    )


@st.composite
def attention_problems(
    draw: st.DrawFn,
    configs: st.SearchStrategy[Config] | None = None,
    *,
    kinds: tuple[str, ...] = WEIGHT_KINDS,
    param_bias: bool | None = None,
) -> AttentionProblem:
    """An :class:`AttentionProblem` (parameters from :func:`attnref.init_params`, GQA when the
    config has ``k < n``); config, mask kind, parameter biases and data seed are labelled draws."""
    strategy = _configs() if configs is None else configs
    config = draw(strategy, label="config")
    kind = draw(st.sampled_from(tuple(kinds)), label="mask kind")
    with_bias = draw(st.booleans(), label="parameter biases") if param_bias is None else param_bias
    seed = draw(st.integers(0, 2**31 - 1), label="data seed")
    note(f"config={config!r} kind={kind} parameter biases={with_bias} seed={seed}")
    return make_attention_problem(config, kind, seed, param_bias=with_bias)
