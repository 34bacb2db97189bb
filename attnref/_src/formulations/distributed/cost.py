"""Per-device cost models of the distributed schemes (``<id>_cost(dims) -> Cost``, ``P =
dims.devices``; conventions in ``docs/cost.md``), and the causal load balance of the layouts
(:func:`useful_pairs`, :func:`load_balance`, :data:`CLOSED_FORMS`; ``docs/distributed.md``).
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction
from typing import Any

import numpy as np

from attnref._src.core import cost as _cost
from attnref._src.core.cost import Collective, Cost, Dims
from attnref._src.formulations.distributed.layout import LAYOUTS, padded_length, positions

# ----------------------------------------------------------------------------- per-device models
#
# For the row form with a full mask and bias (the worst case). The projections outside the
# shard_map are sharded by XLA behind a pad (contiguous) and replicated behind a gather.

# Elementwise ops per (query, key) pair of a piece, from the source: reachability (<, <, and,
# any), allowed set (3, and mask), kernel's allowed set (!= -inf, and, any), logits (12) and the
# non-finite reads (isnan, == inf, or, and, or, any).
PIECE_PER_PAIR = 4 + 4 + 3 + 12 + 6
# Per query row and head of a piece: the kernel's live/denominator/lse selects and the lse add
# (4), the dirty test (and, or) and the poisoning of lse (3); per output entry its poisoning (1).
PIECE_PER_ROW, PIECE_PER_ENTRY = 7, 1
# One merge_states, per row: max, isfinite, where, 2 x (where, -), +, where, 2 isneginf, minimum,
# where, +, 4 tests, 2 selects; per entry: 2 selects, 2 mul, add, divide, 2 selects.
MERGE_PER_ROW, MERGE_PER_ENTRY = 20, 8
# Moving a token array into or out of a layout (pad, gather; the partitioner's select and
# all-reduce add when it reshards a gather), per element.
LAYOUT_PER_ELEMENT = 3
# Per output row and head: finish's live test and policy selects, query padding, NaN for
# lengths out of range (6); per output entry: their selects and the cast (4).
FINISH_PER_ROW, FINISH_PER_ENTRY = 6, 4


def _padded(d: Dims, layout: str) -> tuple[int, int]:
    """``(T', S')``: the query and key lengths padded for ``layout`` over ``P`` devices."""
    return padded_length(d.t_q, d.devices, layout), padded_length(d.t_k, d.devices, layout)


def _projections(d: Dims, sharded: bool = False) -> int:
    """Matmul FLOPs of the four projections on one device: all tokens' or (``sharded``, behind
    the contiguous layout's padding) T'/P."""
    if sharded:
        t_pad, s_pad = _padded(d, "contiguous")
        d = dataclasses.replace(d, t_q=t_pad // d.devices, t_k=s_pad // d.devices)
    pq, pk, pv = _cost.projections(d)
    return pq + pk + pv + 2 * d.batch * d.t_q * d.heads * d.d_v * d.d_model


def _weight_level(d: Dims) -> int:
    """Elementwise work of the row form around the kernel, in full (a bound on any device's):
    the weight-level guard, the biases, the head sum and the operands' guard."""
    b, h = d.batch, d.heads
    operands = b * d.t_q * h * d.d_k + b * d.t_k * h * (d.d_k + d.d_v)
    return (
        _cost.weight_guard_elementwise(d)
        + _cost.GUARD_PER_OPERAND * operands
        + _cost.qkvo_bias_adds(d)
        + b * d.t_q * d.d_model * (h - 1)
    )


def _piece(d: Dims, heads: int, rows: int, keys: int) -> tuple[int, int, int]:
    """(matmul, elementwise, transcendentals without the lse's log) of one naive piece:
    ``rows`` queries against ``keys`` keys on ``heads`` heads."""
    b = d.batch
    logits = b * heads * rows * keys
    operands = b * heads * (rows * d.d_k + keys * (d.d_k + d.d_v))
    el = (
        PIECE_PER_PAIR * logits
        + PIECE_PER_ROW * b * heads * rows
        + PIECE_PER_ENTRY * b * heads * rows * d.d_v
        + _cost.GUARD_PER_OPERAND * operands
    )
    return 2 * logits * (d.d_k + d.d_v), el, logits


def _check_heads(d: Dims, scheme: str) -> None:
    if d.heads % d.devices:
        raise ValueError(
            f"{scheme} needs the {d.devices} devices to divide the heads, got heads={d.heads}"
        )


def _finish(d: Dims, rows: int) -> int:
    return FINISH_PER_ROW * rows + FINISH_PER_ENTRY * rows * d.d_v


def _laid_out(d: Dims, t_pad: int, s_pad: int) -> tuple[int, int, int]:
    """(q, k, v elements, mask and bias elements, elementwise work outside the shard_map) of a
    sequence layout."""
    b, h = d.batch, d.heads
    tokens = b * (t_pad * h * d.d_k + s_pad * h * (d.d_k + d.d_v))
    pairs = 2 * b * t_pad * d.t_k
    outside = LAYOUT_PER_ELEMENT * (tokens + pairs + b * t_pad * h * d.d_v)
    return tokens, pairs, _weight_level(d) + outside


def _tensors(d: Dims, *middle: int) -> list[int]:
    """The projections (replicated at most), ``middle``, the head outputs, the output twice."""
    b, h = d.batch, d.heads
    proj = b * d.t_q * h * max(d.d_k, d.d_v)
    return [proj, proj, proj, *middle, b * d.t_q * h * d.d_v, 2 * b * d.t_q * d.d_model]


def _ring(d: Dims, layout: str) -> Cost:
    """A ring over ``layout``: ``P`` steps of a piece (``c_q = T'/P`` queries against one
    ``c_k = S'/P`` chunk) and a merge, ``P - 1`` sends of the K/V chunk."""
    p, b, h = d.devices, d.batch, d.heads
    t_pad, s_pad = _padded(d, layout)
    cq, ck = t_pad // p, s_pad // p
    n = chunk_tiles(cq, ck)  # a step's piece in n x n tiles (ring.py's _state_fn)
    mm, el, logits = (n * n * x for x in _piece(d, h, cq // n, ck // n))
    rows = b * h * cq
    merge = MERGE_PER_ROW * rows + MERGE_PER_ENTRY * rows * d.d_v
    # The tiles' own reachability tests (4 per pair when tiled), and the n - 1 merges of each
    # query tile's key tiles before the step's merge.
    tiled = 0 if n == 1 else 4 * logits + (n - 1) * merge
    step_el = el + tiled + merge
    # exp of the logits; per row each key tile's log(denominator), the key tiles' merges and the
    # step's merge (two weights and log1p each), less one with one device: XLA folds the
    # weight of the merge's constant empty state (exp(-inf) = 0) when the single step is not in
    # a loop.
    step_tr = logits + n * rows + 3 * (n - 1) * rows + (2 if p == 1 else 3) * rows
    outside = _projections(d, layout == "contiguous")
    chunk_bytes = b * ck * h * (d.d_k + d.d_v) * d.itemsize
    tokens, pairs, el_outside = _laid_out(d, t_pad, s_pad)
    tensors = _tensors(
        d,
        tokens,
        pairs,
        2 * b * ck * h * (d.d_k + d.d_v),  # the chunk held and the chunk received
        8 * b * h * cq * ck,  # the pieces' logits, allowed sets, weights and temporaries
        4 * rows * (d.d_v + 1),  # the running and the piece's states, merged and finished
        b * t_pad * h * d.d_v,
    )
    return _cost.build(
        d,
        outside + p * mm,
        el_outside + p * step_el + _finish(d, rows),
        p * step_tr,
        tensors,
        max(b * h * (cq // n) * (ck // n), b * cq * h * d.d_v),
        loop_trips=p,
        per_trip_matmul_flops=mm if p > 1 else 0,
        per_trip_elementwise_flops=step_el if p > 1 else 0,
        per_trip_transcendentals=step_tr if p > 1 else 0,
        collectives=(Collective("collective-permute", chunk_bytes, p - 1, p),) if p > 1 else (),
    )


def ring_cost(d: Dims) -> Cost:
    """Ring attention (contiguous layout), per device: ``P`` pieces of ``c_q x c_k`` logits
    (``c = T'/P``, ``T'`` padded to a multiple of ``P``) and ``P`` merges; communication: the
    K/V chunk, ``B c_k K (d_k + d_v)`` numbers, sent to the next device ``P - 1`` times
    (``collective-permute``). The projections are sequence-sharded (``T'/P`` tokens each)."""
    return _ring(d, "contiguous")


def striped_cost(d: Dims) -> Cost:
    """Striped attention, per device: the ring's pieces, merges and ``P - 1`` K/V chunk sends
    (``B c_k K (d_k + d_v)`` numbers each); the projections run on all ``T`` tokens (the
    striped layout is a gather, which stops XLA's sharding propagation)."""
    return _ring(d, "striped")


def zigzag_cost(d: Dims) -> Cost:
    """Zigzag ring attention, per device: the ring's pieces, merges and ``P - 1`` K/V chunk
    sends, with ``T'``, ``S'`` padded to multiples of ``2P``; the projections run on all ``T``
    tokens (the zigzag layout is a gather)."""
    return _ring(d, "zigzag")


def _one_piece(
    d: Dims,
    piece: tuple[int, int, int],
    outside: tuple[int, int],
    tensors: list[int],
    collectives: tuple[Collective, ...],
    largest: int | None = None,
) -> Cost:
    """A scheme of one naive piece per device, ``piece = (heads, rows, keys)`` (:func:`_piece`),
    after the ``(matmul, elementwise)`` work ``outside`` it; ``tensors``: the others held besides
    the piece's logits and states; ``collectives``: none on one device; ``largest``: default the
    piece's logits."""
    mm, el, logits = _piece(d, *piece)
    heads, rows, keys = piece
    n = d.batch * heads * rows
    return _cost.build(
        d,
        outside[0] + mm,
        outside[1] + el + _finish(d, n),
        logits,  # the lse's log is dead in the row form (only o is returned)
        [*tensors, 8 * n * keys, 2 * n * (d.d_v + 1)],
        n * keys if largest is None else largest,
        collectives=collectives if d.devices > 1 else (),
    )


def all_gather_cost(d: Dims) -> Cost:
    """All-gather context parallelism (zigzag layout), per device: one piece of ``c_q = T'/P``
    queries against all ``S'`` keys (``T'``, ``S'`` padded to multiples of ``2P``);
    communication: one all-gather of ``K`` and one of ``V``, each device contributing its
    ``B S'/P K d`` shard and sending it to the ``P - 1`` others: ``(P - 1)/P`` of
    ``B S' K (d_k + d_v)`` numbers. The projections run on all ``T`` tokens."""
    p, b, h = d.devices, d.batch, d.heads
    t_pad, s_pad = _padded(d, "zigzag")
    tokens, pairs, el_outside = _laid_out(d, t_pad, s_pad)
    shard = b * (s_pad // p) * h * d.itemsize * (d.d_k + d.d_v)
    gathered = b * s_pad * h * (d.d_k + d.d_v)
    tensors = _tensors(d, tokens, pairs, gathered, b * t_pad * h * d.d_v)
    largest = max(b * h * (t_pad // p) * s_pad, b * s_pad * h * d.d_k)
    collectives = (Collective("all-gather", shard, 1, p),)
    piece = (h, t_pad // p, s_pad)
    return _one_piece(
        d, piece, (_projections(d), el_outside), tensors, largest=largest, collectives=collectives
    )


def ulysses_cost(d: Dims) -> Cost:
    """DeepSpeed-Ulysses, per device: full attention of ``H/P`` heads over ``T' x S'`` (padded
    to multiples of ``P``); communication: four all-to-alls (``q``, ``k``, ``v`` to the head
    split, ``o`` back), each on the device's ``B T'/P H d`` share, ``(P - 1)/P`` of which
    leaves the device (the lse's all-to-all is dead in the row form). The projections are
    sequence-sharded (the padding is a pad: sharding propagates)."""
    _check_heads(d, "Ulysses")
    p, b, h = d.devices, d.batch, d.heads
    t_pad, s_pad = _padded(d, "contiguous")
    share = b * h * d.itemsize // p
    sizes = (t_pad * d.d_k, s_pad * d.d_k, s_pad * d.d_v, t_pad * d.d_v)
    tokens = b * h * (t_pad * d.d_k + s_pad * (d.d_k + d.d_v) + t_pad * d.d_v)
    pairs = 2 * b * t_pad * s_pad
    outside = (_projections(d, True), _weight_level(d) + LAYOUT_PER_ELEMENT * (tokens + pairs))
    collectives = tuple(Collective("all-to-all", share * n, 1, p) for n in sizes)
    tensors = _tensors(d, 2 * tokens // p, pairs)
    return _one_piece(d, (h // p, t_pad, s_pad), outside, tensors, collectives=collectives)


def tensor_parallel_cost(d: Dims) -> Cost:
    """Tensor-parallel heads, per device: the projections, attention and ``o W_O`` of ``H/P``
    heads on every token (inside the shard_map); communication: one all-reduce (``psum``) of
    the partial block output, ``B T d_model`` numbers, ``2 (P - 1)/P`` of them sent by a ring
    all-reduce."""
    _check_heads(d, "tensor parallelism")
    p, out = d.devices, d.batch * d.t_q * d.d_model
    local = dataclasses.replace(d, heads=d.heads // p)
    collectives = (Collective("all-reduce", out * d.itemsize, 1, p),)
    outside, tensors = (_projections(local), _weight_level(d)), _tensors(local, out)
    return _one_piece(d, (d.heads // p, d.t_q, d.t_k), outside, tensors, collectives=collectives)


CLOSED_FORMS = """Under causal self-attention (top-left, `T = S`) query `i` has `i + 1` allowed
keys, so the device holding the later positions does more useful work. With `T` real tokens
padded to `T'` and `c = T' / P` positions per device, device `d` has
`sum_{i in positions[d], i < T} (i + 1)` allowed pairs, and `balance = max_d / mean_d` (1 is
perfect). When the padding is empty:

* contiguous (ring): device `d` holds `d c .. d c + c - 1`;
  `balance = ((2P - 1) c + 1) / (P c + 1) = 2 - 1/P - (P - 1) / (P (T + 1))`, which tends to
  `2 - 1/P`;
* zigzag (`2P` divides `T`, `h = T / 2P`): chunks `d` and `2P - 1 - d` together hold
  `h (T + 1)` pairs on every device: `balance = 1` exactly;
* striped: device `d` holds `d, d + P, ...`, `c (d + 1) + P c (c - 1) / 2` pairs;
  `balance = (T + P) / (T + 1) = 1 + (P - 1) / (T + 1)`.

Without causality every real query has `T` keys and the balance is the real-query count's."""


def useful_pairs(t: int, devices: int, layout: str, *, causal: bool = True) -> np.ndarray:
    """Allowed (query, key) pairs of each device under self-attention over ``t`` tokens.

    Args:
        t: The sequence length ``T = S`` (before padding), ``>= 0``.
        devices: The device count ``P >= 1``.
        layout: ``"contiguous"``, ``"striped"`` or ``"zigzag"`` (:mod:`._layout`).
        causal: Top-left causal (query ``i`` reads keys ``j <= i``; default) or every key.

    Returns:
        int64 ``[P]``: ``sum_{i in positions[d], i < t} (i + 1)`` (causal) or ``t`` per real
        query.

    Raises:
        ValueError: If ``t < 0``, ``devices < 1`` or ``layout`` is not a layout.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if t < 0 or devices < 1:
        raise ValueError(f"need t >= 0 and devices >= 1, got t={t}, devices={devices}")
    pos = positions(padded_length(t, devices, layout), devices, layout).astype(np.int64)
    keys = pos + 1 if causal else np.full_like(pos, t)
    return np.where(pos < t, keys, 0).sum(axis=1)


def useful_flops(t: int, devices: int, layout: str, *, causal: bool = True, **sizes: int) -> Any:
    """Useful attention FLOPs per device: ``2 B N (H + H_v)`` per allowed pair.

    Args:
        t, devices, layout, causal: As in :func:`useful_pairs`.
        **sizes: ``batch``, ``heads``, ``d_k``, ``d_v`` (default 1 each).

    Returns:
        int64 ``[P]``.
    """
    b, n = sizes.get("batch", 1), sizes.get("heads", 1)
    per_pair = 2 * b * n * (sizes.get("d_k", 1) + sizes.get("d_v", 1))
    return per_pair * useful_pairs(t, devices, layout, causal=causal)


def chunk_tiles(c_q: int, c_k: int) -> int:
    """Tiles per side of a ring step's ``c_q x c_k`` piece, each under a ``lax.cond``: 2 when both
    sides split evenly, else 1."""
    return 2 if c_q % 2 == 0 and c_k % 2 == 0 and min(c_q, c_k) >= 2 else 1


# A causal piece is split into up to MAX_TILES tiles a side, of at least MIN_TILE rows and keys.
MIN_TILE, MAX_TILES = 64, 16

# The kinds of tile in piece_tiles' table.
NEVER, SOMETIMES, ALWAYS = 0, 1, 2


def _fine_tiles(c_q: int, c_k: int) -> int:
    """The most tiles a side (a power of two <= :data:`MAX_TILES`) of at least :data:`MIN_TILE`."""
    n = 1
    while (
        2 * n <= MAX_TILES
        and c_q % (2 * n) == 0
        and c_k % (2 * n) == 0
        and min(c_q, c_k) >= 2 * n * MIN_TILE
    ):
        n *= 2
    return n


def _reach(
    t: int,
    s: int,
    devices: int,
    layout: str,
    n: int,
    offset: int,
    causal: bool,
    window: tuple[int | None, int | None] | None,
) -> np.ndarray:
    """``[P, n, P, n]``: whether query tile ``a`` of device ``d`` may read a key of tile ``b`` of
    device ``o``'s chunk, from the tiles' position ranges (``j - (i + offset)`` in ``[-left, 0]``
    causal, ``[-left, right]`` window). Exact for causality; a strided tile under a window may be
    reported reachable (computed, never wrongly skipped)."""
    big = np.iinfo(np.int64).max // 4
    tq = positions(padded_length(t, devices, layout), devices, layout).astype(np.int64)
    tk = positions(padded_length(s, devices, layout), devices, layout).astype(np.int64)
    q_tiles, k_tiles = tq.reshape(devices, n, -1), tk.reshape(devices, n, -1)
    real_q, real_k = q_tiles < t, k_tiles < s
    first_q = np.where(real_q, q_tiles, big).min(axis=2) + offset
    last_q = np.where(real_q, q_tiles, -big).max(axis=2) + offset
    first_k = np.where(real_k, k_tiles, big).min(axis=2)
    last_k = np.where(real_k, k_tiles, -big).max(axis=2)
    left, right = window or (None, None)
    hi = min(0 if causal else big, big if right is None else right)
    lo = -big if left is None else -left
    any_q, any_k = np.asarray(real_q.any(axis=2)), np.asarray(real_k.any(axis=2))
    both = any_q[:, :, None, None] & any_k[None, None, :, :]
    lowest = first_k[None, None, :, :] - last_q[:, :, None, None]  # min of j - (i + offset)
    highest = last_k[None, None, :, :] - first_q[:, :, None, None]
    return np.asarray(both & (lowest <= hi) & (highest >= lo))


def piece_tiles(
    t: int,
    s: int,
    devices: int,
    layout: str,
    offset: int | None = None,
    *,
    causal: bool = True,
    window: tuple[int | None, int | None] | None = None,
) -> np.ndarray:
    """How the ring computes a step's piece: its ``[n, n]`` tiles, each :data:`NEVER` reachable
    (not computed), :data:`SOMETIMES` (under a ``lax.cond`` on the step's positions) or
    :data:`ALWAYS` (unconditionally). With the position rules known from the shapes the piece is
    split finely (:data:`MIN_TILE`, :data:`MAX_TILES`) when no tile is :data:`SOMETIMES`, or some
    is :data:`NEVER` and at most ``2 n`` are :data:`SOMETIMES`; otherwise it is
    :func:`chunk_tiles` tiles a side, each :data:`SOMETIMES`.

    Args:
        t, s: The query and key lengths (before padding).
        devices: ``P``.
        layout: One of :data:`LAYOUTS`.
        offset: Key ``i + offset`` is query ``i``'s own position: 0 for top-left alignment,
            ``S - T`` for bottom-right; ``None`` when the rules are not known from the shapes.
        causal, window: The position rules (``window``: ``(left, right)``, either ``None``).

    Returns:
        int8 ``[n, n]``.
    """
    c_q = padded_length(t, devices, layout) // devices
    c_k = padded_length(s, devices, layout) // devices
    n = _fine_tiles(c_q, c_k)
    if offset is not None and (causal or window is not None) and n > 1:
        reach = _reach(t, s, devices, layout, n, offset, causal, window)
        some, every = reach.any(axis=(0, 2)), reach.all(axis=(0, 2))
        gated = int((some & ~every).sum())
        if gated == 0 or (not some.all() and gated <= 2 * n):
            return np.select([every, some], [ALWAYS, SOMETIMES], NEVER).astype(np.int8)
    n = chunk_tiles(c_q, c_k)
    return np.full((n, n), SOMETIMES, np.int8)


def ring_tiles_computed(t: int, devices: int, layout: str, *, causal: bool = True) -> np.ndarray:
    """The ring's computed tiles per device, of ``P n^2`` (``n``: :func:`piece_tiles`): a tile
    is computed when one of its real queries ``i`` may read one of its real keys ``j`` (``j <=
    i`` under top-left causality).

    Args:
        t, devices, layout, causal: As in :func:`useful_pairs` (self-attention, ``S = T``).

    Returns:
        int64 ``[P]``.
    """
    n = piece_tiles(t, t, devices, layout, 0 if causal else None).shape[0]
    reach = _reach(t, t, devices, layout, n, 0, causal, None)
    return reach.sum(axis=(1, 2, 3)).astype(np.int64)


def load_balance(t: int, devices: int, layout: str, *, causal: bool = True) -> Fraction:
    """``max / mean`` of :func:`useful_pairs` over devices, exactly (closed forms:
    :data:`CLOSED_FORMS`); 1 when no device has work (``t = 0``).

    Args:
        t, devices, layout, causal: As in :func:`useful_pairs`.

    Returns:
        The balance as a :class:`fractions.Fraction` (``>= 1``).
    """
    pairs = useful_pairs(t, devices, layout, causal=causal)
    total = int(pairs.sum())
    return Fraction(1) if total == 0 else Fraction(int(pairs.max()) * devices, total)
