"""One validated kernel call (:func:`parse`), and its allowed (query, key) pairs one block of query
rows at a time, by the rules of the definition (module docstring of :mod:`attnref.oracle._kernel`).
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Mapping
from typing import Any

import numpy as np

from ._checks import check_kernel, check_options, check_production
from ._doc import signed


@dataclasses.dataclass(frozen=True)
class KernelCall:
    """A validated kernel call: float64 ``q [B, T, N, H]``, ``k [B, S, K, H]``,
    ``v [B, S, K, H_v]``, and the options in the form the oracle reads them."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    scale: float
    softcap: float | None
    policy: str
    mask: np.ndarray | None  # broadcast view [B, N, T, S]
    bias: np.ndarray | None  # broadcast view [B, N, T, S], float64
    bias_shape: tuple[int, ...] | None  # the caller's own shape
    q_len: np.ndarray  # [B]
    kv_len: np.ndarray  # [B]
    seg_q: np.ndarray | None  # [B, T]
    seg_k: np.ndarray | None  # [B, S]
    left: int | None
    right: int | None
    bottom_right: bool
    causal: bool
    sink_tokens: int = 0  # the first keys, exempt from the window's left edge
    sinks: np.ndarray | None = None  # [N] float64: one sink logit per query head
    keep: np.ndarray | None = None  # broadcast view [B, N, T, S]: dropout's keep mask
    rate: float | None = None  # the dropout rate (with ``keep``)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """``(B, N, T, S)``."""
        b, t, n, _ = self.q.shape
        return b, n, t, self.k.shape[1]

    @property
    def group(self) -> int:
        """``G = N / K``: query head ``n`` reads key/value head ``n // G``."""
        return self.q.shape[2] // self.k.shape[2]


# The allowed-set options of a kernel call.
OPTIONS = (
    "is_causal",
    "query_seq_lengths",
    "key_value_seq_lengths",
    "local_window_size",
    "segment_ids",
    "causal_alignment",
    "sink_tokens",
)


def kernel_call(
    query: Any,
    key: Any,
    value: Any,
    bias: Any = None,
    mask: Any = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: Any = None,
    key_value_seq_lengths: Any = None,
    local_window_size: Any = None,
    segment_ids: Any = None,
    softcap: float | None = None,
    sinks: Any = None,
    sink_tokens: int = 0,
    dropout_mask: Any = None,
    dropout_rate: float | None = None,
    causal_alignment: str = "top_left",
    masked_rows: str = "zeros",
) -> None:
    """The arguments of :func:`attnref.dot_product_attention`, written once: the template of the
    kernel level's public functions (:func:`attnref.oracle._doc.signed`)."""


def pick(args: Mapping[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    """The arguments ``names`` out of a public function's ``locals()``."""
    return {name: args[name] for name in names}


@signed(kernel_call)
def parse(call: dict[str, Any]) -> KernelCall:
    """Validate a kernel call as :func:`attnref.dot_product_attention` does (same exception types,
    the argument named) and return it as a :class:`KernelCall`."""
    query, key, value, bias, mask = (call[n] for n in ("query", "key", "value", "bias", "mask"))
    shape, sc, cap, policy = check_kernel(
        query, key, value, **pick(call, ("scale", "softcap", "masked_rows"))
    )
    b, n, t, s = shape
    m, bs, q_lens, kv_lens, seg_q, seg_k, window, alignment, causal, n_sink = check_options(
        shape, bias, mask, pick(call, OPTIONS)
    )
    _, rate = check_production(
        shape, window, **pick(call, ("sinks", "dropout_mask", "dropout_rate"))
    )
    keep = None if call["dropout_mask"] is None else np.asarray(call["dropout_mask"], bool)
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (query, key, value))
    return KernelCall(
        q=q,
        k=k,
        v=v,
        scale=sc,
        softcap=cap,
        policy=policy,
        mask=m,
        bias=bs,
        bias_shape=None if bias is None else tuple(np.shape(bias)),
        q_len=np.full(b, t, np.int64) if q_lens is None else q_lens,
        kv_len=np.full(b, s, np.int64) if kv_lens is None else kv_lens,
        seg_q=seg_q,
        seg_k=seg_k,
        left=window[0],
        right=window[1],
        bottom_right=alignment == "bottom_right",
        causal=causal,
        sink_tokens=n_sink,
        sinks=None if call["sinks"] is None else np.asarray(call["sinks"], dtype=np.float64),
        keep=None if keep is None else np.broadcast_to(keep, (b, n, t, s)),
        rate=rate,
    )


def _offset(c: KernelCall, b: int) -> int:
    return int(c.kv_len[b]) - int(c.q_len[b]) if c.bottom_right else 0


def key_range(c: KernelCall, b: int, i0: int, i1: int) -> tuple[int, int]:
    """Keys ``[j0, j1)`` outside which no query row ``i0 .. i1 - 1`` of batch ``b`` has an allowed
    key (``j0 >= j1`` when there is none)."""
    off = _offset(c, b)
    j0, j1 = 0, int(c.kv_len[b])
    if c.causal:
        j1 = min(j1, i1 - 1 + off + 1)
    if c.right is not None:
        j1 = min(j1, i1 - 1 + off + c.right + 1)
    if c.left is not None and not c.sink_tokens:
        j0 = max(j0, i0 + off - c.left)
    return max(j0, 0), max(j1, 0)


def full_columns(c: KernelCall, b: int, i0: int, i1: int, j0: int, j1: int) -> int:
    """The first key of ``[j0, j1)`` that some query row ``i0 .. i1 - 1`` of batch ``b`` may not
    read (``j0`` unless only causality or a right window restricts the block: then every row reads
    the keys up to the first row's limit, and only the block's diagonal band needs a mask)."""
    index_only = c.mask is None and c.bias is None and c.seg_q is None and c.left is None
    if not index_only or i1 > c.q_len[b] or not (c.causal or c.right is not None):
        return j0
    limit = i0 + _offset(c, b) + (0 if c.causal else int(c.right or 0))  # row i0's last key
    if c.causal and c.right is not None:
        limit = i0 + _offset(c, b) + min(0, int(c.right))
    return int(min(max(j0, limit + 1), j1))


def allowed_rows(
    c: KernelCall, b: int, heads: slice, i0: int, i1: int, j0: int, j1: int
) -> np.ndarray | None:
    """Allowed pairs ``[n_heads, i1 - i0, j1 - j0]`` of batch ``b``, query heads ``heads``, query
    rows ``i0 .. i1 - 1`` and keys ``j0 .. j1 - 1``; ``None`` when every pair is allowed."""
    i = np.arange(i0, i1)[:, None]
    j = np.arange(j0, j1)[None, :]
    pos = i + _offset(c, b)
    parts: list[np.ndarray] = []  # each condition once, only where it can be False
    if i1 > c.q_len[b]:
        parts.append(np.broadcast_to(i < c.q_len[b], (i1 - i0, j1 - j0)))
    if j1 > c.kv_len[b]:
        parts.append(j < c.kv_len[b])
    if c.causal and j1 - 1 > i0 + _offset(c, b):
        parts.append(j <= pos)
    if c.left is not None:  # the first sink_tokens keys stay visible past the left edge
        parts.append((j >= pos - c.left) | (j < c.sink_tokens))
    if c.right is not None:
        parts.append(j <= pos + c.right)
    if c.seg_q is not None and c.seg_k is not None:
        parts.append(c.seg_q[b, i0:i1, None] == c.seg_k[b, None, j0:j1])
    if c.mask is not None:
        parts.append(c.mask[b, heads, i0:i1, j0:j1])
    if c.bias is not None:
        parts.append(c.bias[b, heads, i0:i1, j0:j1] != -np.inf)
    if not parts:
        return None
    ok = functools.reduce(operator.and_, parts)
    ok = np.broadcast_to(ok, np.broadcast_shapes(ok.shape, (i1 - i0, j1 - j0)))
    if ok.ndim == 2:
        if ok.all():
            return None
        n_heads = len(range(*heads.indices(c.shape[1])))
        ok = np.broadcast_to(ok, (n_heads, *ok.shape))
    return ok


def call_allowed(c: KernelCall) -> np.ndarray:
    """The call's allowed pairs ``[B, N, T, S]``, one batch element at a time."""
    b_size, _, t, s = c.shape
    out = np.ones(c.shape, bool)
    for b in range(b_size):
        ok = allowed_rows(c, b, slice(None), 0, t, 0, s)
        if ok is not None:
            out[b] = ok
    return out


def query_block(c: KernelCall, rows_per_head: int, budget: int = 64 << 20) -> int:
    """Query rows per block so that about ``rows_per_head`` arrays of ``[G, rows, S]`` float64
    temporaries fit in ``budget`` bytes (at least 1 row)."""
    _, _, _, s = c.shape
    per_row = max(1, c.group * s * 8 * rows_per_head)
    return max(1, budget // per_row)
