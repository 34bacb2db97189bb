"""Problem sizes: :class:`Config`, the shape buckets (:data:`BUCKETS`, :data:`KERNEL_BUCKETS`,
:data:`WEIGHT_BUCKETS`), the mask/bias broadcast shapes (:data:`BROADCAST_SHAPES`) and the
:func:`configs` strategy."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
from hypothesis import strategies as st

if TYPE_CHECKING:
    from hypothesis.strategies import DrawFn
else:
    # a Protocol isinstance cannot check: to the runtime checks, any callable
    DrawFn = Callable[..., Any]


class ShortRepr:
    """Hypothesis (IPython's pretty printer) shows the short ``repr``, not every array."""

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(repr(self))


@dataclasses.dataclass(frozen=True)
class Config(ShortRepr):
    """Sizes and dtype of one problem: ``batch``, ``t`` queries ``T``, ``s`` keys ``S``, ``n``
    query heads ``N``, ``k`` K/V heads ``K`` (query head ``i`` reads ``i // (n // k)``), head dims
    ``h`` (``d_k``) and ``h_v`` (``d_v``), ``d_model`` and the dtype's name; ``batch`` is an
    ``int`` at the kernel level, a tuple of leading dims allowed at the weight level."""

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
        """The leading batch dims as a tuple."""
        return (self.batch,) if isinstance(self.batch, int) else tuple(self.batch)

    @property
    def b(self) -> int:
        """``batch`` as an ``int`` (``ValueError`` for a tuple)."""
        if not isinstance(self.batch, int):
            raise ValueError(f"the kernel level takes one batch axis (an int), got {self.batch}")
        return self.batch

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

# Tile-straddling lengths, where a kernel's last, partial tile is: for each tile size n, n - 1,
# n, n + 1, 3n/2 + 1 and 2n + 1; sorted, so a failure shrinks to the shortest.
TILE_SIZES: tuple[int, ...] = (16, 32, 64, 128, 256)
TILE_LENGTHS: tuple[int, ...] = tuple(
    sorted({m for n in TILE_SIZES for m in (n - 1, n, n + 1, n + n // 2 + 1, 2 * n + 1)})
)


@st.composite
def tile_configs(draw: DrawFn, base: Config, lengths: tuple[int, ...] = TILE_LENGTHS) -> Config:
    """``base`` with ``T`` from ``lengths`` and (when ``T != S``) ``S`` drawn apart, else ``S =
    T``: labelled draws ``"tile T"``, ``"tile S"``, shrinking towards the shortest."""
    t = draw(st.sampled_from(lengths), label="tile T")
    s = draw(st.sampled_from(lengths), label="tile S") if base.is_cross else t
    return dataclasses.replace(base, t=t, s=s)


# Every rank-4 shape broadcasting to [B, N, T, S] (each axis its letter or 1), fewest 1s first so
# Hypothesis shrinks towards "BNTS"; "B11S" is the key-padding mask.
BROADCAST_SHAPES: tuple[str, ...] = tuple(
    sorted(map("".join, itertools.product(*((a, "1") for a in "BNTS"))), key=lambda p: p.count("1"))
)


def broadcast_shape(config: Config, pattern: str) -> tuple[int, int, int, int]:
    """The shape of a :data:`BROADCAST_SHAPES` ``pattern``: ``broadcast_shape(c, "B11S") ==
    (c.batch, 1, 1, c.s)``; ``ValueError`` for an unknown pattern or a tuple batch."""
    if pattern not in BROADCAST_SHAPES:
        raise ValueError(
            f"pattern must be one of BROADCAST_SHAPES (each of 'BNTS' or '1'), got {pattern!r}"
        )
    check_kernel_batch(config)
    full = {"B": config.batch, "N": config.n, "T": config.t, "S": config.s}
    return tuple(full.get(ch, 1) for ch in pattern)  # type: ignore[return-value]


def check_kernel_batch(config: Config) -> None:
    if not isinstance(config.batch, (int, np.integer)):
        raise ValueError(
            f"kernel-level problems take one batch axis (an int batch), got batch={config.batch!r}"
        )


def broadcast_shapes(patterns: tuple[str, ...] = BROADCAST_SHAPES) -> st.SearchStrategy[str]:
    """A pattern from ``patterns`` (a non-empty subset of :data:`BROADCAST_SHAPES`, else
    ``ValueError``), shrinking in order."""
    bad = [p for p in patterns if p not in BROADCAST_SHAPES]
    if bad or not patterns:
        raise ValueError(f"patterns must be a non-empty subset of BROADCAST_SHAPES, got {bad}")
    return st.sampled_from(tuple(patterns))


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
    """A :class:`Config` from ``buckets`` with a dtype from ``dtypes`` (labelled draws): ``T ==
    S`` unless ``cross``, ``N == K`` unless ``gqa``, ``H_v == H`` unless ``value_dim_differs``
    (``ValueError`` when drawn if no bucket is left)."""
    pool = tuple(
        b
        for b in buckets
        if (cross or not b.is_cross)
        and (gqa or not b.is_gqa)
        and (value_dim_differs or b.h == b.h_v)
    )
    if not pool:
        raise ValueError("no bucket satisfies the requested cross / gqa / value_dim constraints")
    bucket = draw(st.sampled_from(pool), label="bucket")
    dtype = draw(st.sampled_from(tuple(dtypes)), label="dtype")
    return dataclasses.replace(bucket, dtype=str(np.dtype(dtype)))


configs_strategy = configs  # the strategy, for functions whose ``configs`` parameter shadows it


def with_dtype(config: Config, dtype: Any) -> Config:
    return config if dtype is None else dataclasses.replace(config, dtype=str(np.dtype(dtype)))
