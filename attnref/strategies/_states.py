"""Attention states, merge trees and key partitions (package docstring)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from hypothesis import note
from hypothesis import strategies as st

from attnref import oracle, tolerance
from attnref.tolerance._states import as_dtype as as_dtype  # written once

from ._kernel import KernelProblem, kernel_problems
from ._shapes import DrawFn, ShortRepr

# (rows, H_v): the shape of lse and the value dim; few, so a jitted merge compiles few programs.
STATE_SHAPES: tuple[tuple[tuple[int, ...], int], ...] = (((4,), 3), ((2, 3, 2), 4))
STATE_DTYPES = ("float32", "float64", "bfloat16", "float16")
# How far apart the pieces' lse are: "tied" (equal, exact ties), "small" (N(0, 3)), "large"
# (consecutive differences in [89, 150]: exp overflows float32), "huge" (uniform in
# [-1e4, 1e4]: differences beyond 709 overflow float64 too).
SPREADS = ("tied", "small", "large", "huge")
CENTERS = (0.0, 1e4, -1e4)  # where the lse of a row sit (clipped to |lse| <= 1e4)
LAYOUTS = ("contiguous", "striped", "random")  # how keys are assigned to pieces

# A merge tree: a piece index, or a pair of trees (nested; typed one level deep for the runtime
# checks).
Tree = int | tuple[Any, Any]


@dataclasses.dataclass
class StateStack(ShortRepr):
    """``P`` states on axis 0: ``o [P, *rows, H_v]``, ``lse [P, *rows]`` (``-inf``: empty, ``o``
    NaN), their ``spread`` (:data:`SPREADS`), ``center`` (:data:`CENTERS`) and data ``seed``."""

    o: np.ndarray
    lse: np.ndarray
    spread: str = "small"
    center: float = 0.0
    seed: int = 0

    def __repr__(self) -> str:
        return (
            f"StateStack(P={self.pieces}, o={self.o.dtype}{list(self.o.shape)}, "
            f"lse={self.lse.dtype}, spread={self.spread!r}, center={self.center}, "
            f"seed={self.seed})"
        )

    @property
    def pieces(self) -> int:
        """``P``."""
        return int(self.lse.shape[0])

    @property
    def dtype(self) -> np.dtype[Any]:
        """``o``'s dtype."""
        return self.o.dtype

    @property
    def lse_dtype(self) -> np.dtype[Any]:
        """``lse``'s dtype."""
        return self.lse.dtype

    def state(self, p: int) -> tuple[np.ndarray, np.ndarray]:
        """State ``p``: ``(o[p], lse[p])``."""
        return self.o[p], self.lse[p]

    def oracle(self, masked_rows: str = "zeros") -> tuple[np.ndarray, np.ndarray]:
        """The float64 merge of all ``P`` states (:func:`attnref.oracle.merge_state_stack`)."""
        return oracle.merge_state_stack(self.o, self.lse, masked_rows=masked_rows)

    def bound(self, tree: str | int = "sequential") -> tuple[np.ndarray, np.ndarray]:
        """:func:`attnref.tolerance.merge_error_bound` of merging these states by ``tree``."""
        return tolerance.merge_error_bound(
            self.o, self.lse, dtype=self.dtype, lse_dtype=self.lse_dtype, tree=tree
        )

    def subset(self, pieces: Sequence[int]) -> StateStack:
        """The stack of the states ``pieces`` (in that order)."""
        idx = list(pieces)
        return dataclasses.replace(self, o=self.o[idx], lse=self.lse[idx])


def make_state_stack(
    pieces: int,
    rows: tuple[int, ...],
    h_v: int,
    seed: int,
    *,
    dtype: Any = "float32",
    lse_dtype: Any = None,
    spread: str = "small",
    center: float = 0.0,
    empty: float = 0.0,
    empty_row: bool = False,
    max_abs_lse: float = 1e4,
) -> StateStack:
    """The :class:`StateStack` behind one draw of :func:`attention_states`: ``pieces`` states,
    ``lse [*rows]``, ``o [*rows, h_v]`` PCG64 ``seed`` normal; ``lse`` = ``center`` + a row offset
    + the ``spread`` offsets (:data:`SPREADS`), clipped to ``max_abs_lse``; each state empty with
    probability ``empty`` (with ``empty_row``, row 0 in every state); ``o`` in ``dtype``, ``lse``
    in ``lse_dtype`` (default ``dtype``)."""
    if spread not in SPREADS:
        raise ValueError(f"spread must be one of {SPREADS}, got {spread!r}")
    rng = np.random.default_rng(seed)
    shape = (pieces, *rows)
    o = rng.standard_normal((*shape, h_v))
    base = center + rng.uniform(-5.0, 5.0, size=rows)
    if spread == "tied":
        offsets = np.zeros(shape)
    elif spread == "small":
        offsets = 3.0 * rng.standard_normal(shape)
    elif spread == "large":
        steps = np.cumsum(rng.uniform(89.0, 150.0, size=shape), axis=0)
        offsets = rng.permuted(steps - steps.mean(axis=0, keepdims=True), axis=0)
    else:
        offsets = rng.uniform(-max_abs_lse, max_abs_lse, size=shape) - base
    lse = np.clip(base + offsets, -max_abs_lse, max_abs_lse)
    gone = rng.random(shape) < empty
    if empty_row and len(rows) and pieces:
        gone[(slice(None),) + (0,) * len(rows)] = True
    lse, o = np.where(gone, -np.inf, lse), np.where(gone[..., None], np.nan, o)
    o_dt = as_dtype(dtype)
    l_dt = o_dt if lse_dtype is None else as_dtype(lse_dtype)
    return StateStack(o.astype(o_dt), lse.astype(l_dt), spread, float(center), int(seed))


@st.composite
def attention_states(
    draw: DrawFn,
    *,
    min_pieces: int = 1,
    max_pieces: int = 5,
    shapes: tuple[tuple[tuple[int, ...], int], ...] = STATE_SHAPES,
    dtypes: tuple[str, ...] = ("float32",),
    lse_dtypes: tuple[str, ...] | None = None,
    spreads: tuple[str, ...] = SPREADS,
    centers: tuple[float, ...] = CENTERS,
    empty: bool = True,
) -> StateStack:
    """A :class:`StateStack` (:func:`make_state_stack`), labelled draws of ``min_pieces`` to
    ``max_pieces`` states, a ``(rows, H_v)`` of ``shapes``, ``o``'s dtype of ``dtypes``,
    ``lse``'s of ``lse_dtypes`` (``None``: ``o``'s, or float32 one time in two for 16 bits), a
    spread, a center, empty states and rows (with ``empty``) and a seed."""
    pieces = draw(st.integers(min_pieces, max_pieces), label="pieces")
    rows, h_v = draw(st.sampled_from(tuple(shapes)), label="shape")
    dtype = draw(st.sampled_from(tuple(dtypes)), label="dtype")
    if lse_dtypes is not None:
        lse_dtype = draw(st.sampled_from(tuple(lse_dtypes)), label="lse dtype")
    elif as_dtype(dtype).itemsize == 2:
        lse_dtype = draw(st.sampled_from((dtype, "float32")), label="lse dtype")
    else:
        lse_dtype = dtype
    spread = draw(st.sampled_from(tuple(spreads)), label="spread")
    center = draw(st.sampled_from(tuple(centers)), label="center")
    p_empty, empty_row = 0.0, False
    if empty:
        p_empty = draw(st.sampled_from((0.0, 0.25, 0.5)), label="empty fraction")
        empty_row = draw(st.booleans(), label="empty row")
    seed = draw(st.integers(0, 2**32 - 1), label="data seed")
    note(
        f"pieces={pieces} rows={rows} h_v={h_v} dtype={dtype} lse_dtype={lse_dtype} "
        f"spread={spread} center={center} empty={p_empty} empty_row={empty_row} seed={seed}"
    )
    return make_state_stack(
        pieces,
        rows,
        h_v,
        seed,
        dtype=dtype,
        lse_dtype=lse_dtype,
        spread=spread,
        center=center,
        empty=p_empty,
        empty_row=empty_row,
    )


# ----------------------------------------------------------------------------- merge trees


def tree_leaves(tree: Tree) -> tuple[int, ...]:
    """The piece indices of ``tree``, left to right."""
    if isinstance(tree, tuple):
        return tree_leaves(tree[0]) + tree_leaves(tree[1])
    return (int(tree),)


def tree_depth(tree: Tree) -> int:
    """The number of merges on the longest path from a piece to the result (0 for one piece)."""
    if isinstance(tree, tuple):
        return 1 + max(tree_depth(tree[0]), tree_depth(tree[1]))
    return 0


def sequential_tree(order: Sequence[int]) -> Tree:
    """``(((o0, o1), o2), ...)``: one state after another (a ring); ``ValueError`` if empty."""
    if not len(order):
        raise ValueError("a merge tree needs at least one piece")
    tree: Tree = int(order[0])
    for p in order[1:]:
        tree = (tree, int(p))
    return tree


def balanced_tree(order: Sequence[int]) -> Tree:
    """Pairs, then pairs of pairs: depth ``ceil(log2 P)``; ``ValueError`` if empty."""
    if not len(order):
        raise ValueError("a merge tree needs at least one piece")
    if len(order) == 1:
        return int(order[0])
    half = (len(order) + 1) // 2
    return (balanced_tree(order[:half]), balanced_tree(order[half:]))


@st.composite
def merge_trees(draw: DrawFn, pieces: int) -> Tree:
    """A merge tree over ``range(pieces)`` (nested pairs): any order and grouping, shrinking
    towards the sequential tree in index order."""
    order = draw(st.permutations(range(pieces)), label="merge order")

    def group(leaves: Sequence[int]) -> Tree:
        if len(leaves) == 1:
            return int(leaves[0])
        cut = draw(st.integers(1, len(leaves) - 1).map(lambda k: len(leaves) - k))
        return (group(leaves[:cut]), group(leaves[cut:]))

    return group(list(order))


def apply_merge_tree(merge: Callable[..., Any], tree: Tree, o: Any, lse: Any) -> tuple[Any, Any]:
    """The states ``(o[p], lse[p])`` merged by ``tree`` with ``merge(o_a, lse_a, o_b, lse_b) ->
    (o, lse)`` (e.g. :func:`attnref.merge_states`)."""
    if isinstance(tree, tuple):
        o_a, l_a = apply_merge_tree(merge, tree[0], o, lse)
        o_b, l_b = apply_merge_tree(merge, tree[1], o, lse)
        out = merge(o_a, l_a, o_b, l_b)
        return out[0], out[1]
    return o[tree], lse[tree]


# ----------------------------------------------------------------------------- key partitions


@dataclasses.dataclass
class KeyPartition(ShortRepr):
    """A kernel ``problem`` whose keys are split into ``pieces`` by ``assignment`` (``[S]`` in
    ``[0, P)``, by ``layout``), and a merge ``tree``. Piece ``p`` is the call with the extra key
    mask ``assignment == p`` (every option keeps its meaning on global positions; a row with no
    key gets the empty state); merging the pieces by any tree gives the whole call's state."""

    problem: KernelProblem
    assignment: np.ndarray
    pieces: int
    tree: Tree
    layout: str = "contiguous"

    def __repr__(self) -> str:
        return (
            f"KeyPartition({self.problem!r}, pieces={self.pieces}, layout={self.layout!r}, "
            f"assignment={self.assignment.tolist()}, tree={self.tree!r})"
        )

    @property
    def depth(self) -> int:
        return tree_depth(self.tree)

    def piece_mask(self, p: int) -> np.ndarray:
        """Boolean ``[1, 1, 1, S]``: the keys of piece ``p``."""
        return (self.assignment == p)[None, None, None, :]

    def piece(self, p: int, masked_rows: str = "nan") -> KernelProblem:
        """The call on piece ``p``'s keys (``masked_rows="nan"``: a row without one is empty)."""
        opts = dict(self.problem.options)
        keep = self.piece_mask(p)
        opts["mask"] = keep if "mask" not in opts else np.logical_and(opts["mask"], keep)
        return dataclasses.replace(self.problem, options=opts, masked_rows=masked_rows)

    def oracle_states(self) -> tuple[np.ndarray, np.ndarray]:
        """The pieces' float64 oracle states: ``o [P, B, T, N, H_v]``, ``lse [P, B, T, N]``."""
        o, lse = zip(*(self.piece(p).oracle() for p in range(self.pieces)), strict=True)
        return np.stack(o), np.stack(lse)

    def piece_bounds(self, key_blocks: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Each piece's :func:`attnref.tolerance.kernel_call_error_bound`, stacked."""
        o, lse = zip(*(self.piece(p).bound(key_blocks) for p in range(self.pieces)), strict=True)
        return np.stack(o), np.stack(lse)

    def bound(
        self, tree: str | int | None = None, key_blocks: int | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """:func:`attnref.tolerance.pieces_error_bound` of ``(o, lse)`` against the whole call:
        pieces by a kernel in the problem's dtype (``lse`` float32 for 16 bits; ``key_blocks``
        per piece) merged by ``tree`` (default: :attr:`depth`)."""
        dt = self.problem.dtype
        return self.problem.apply(
            tolerance.pieces_error_bound,
            pieces=self.assignment,
            num_pieces=self.pieces,
            tree=self.depth if tree is None else tree,
            dtype=dt,
            state_dtype=dt,
            lse_dtype=np.float32 if dt.itemsize == 2 else dt,
            key_blocks=key_blocks,
        )


def make_key_partition(
    problem: KernelProblem,
    pieces: int,
    layout: str = "contiguous",
    seed: int = 0,
    tree: Tree | None = None,
) -> KeyPartition:
    """The :class:`KeyPartition` behind one draw of :func:`key_partitions`: ``pieces >= 1`` by
    ``layout`` ``"contiguous"``, ``"striped"`` (key ``j`` to ``j mod P``) or ``"random"`` (PCG64
    ``seed``), merged by ``tree`` (default sequential). ``ValueError`` for an unknown layout,
    ``pieces < 1``, a ``tree`` not over ``range(pieces)`` or ``masked_rows="uniform"``."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if not isinstance(pieces, (int, np.integer)) or pieces < 1:
        raise ValueError(f"pieces must be an int >= 1, got {pieces!r}")
    if problem.masked_rows not in ("zeros", "nan"):
        raise ValueError(
            f"a key partition's problem needs masked_rows 'zeros' or 'nan', got "
            f"{problem.masked_rows!r} (the mean over all keys is not a function of the states)"
        )
    s = problem.k.shape[1]
    if layout == "contiguous":
        assignment = (np.arange(s) * pieces) // max(s, 1)
    elif layout == "striped":
        assignment = np.arange(s) % pieces
    else:
        assignment = np.random.default_rng(seed).integers(0, pieces, size=s)
    tree = sequential_tree(range(pieces)) if tree is None else tree
    if sorted(tree_leaves(tree)) != list(range(pieces)):
        raise ValueError(f"tree must hold each of range({pieces}) once, got {tree!r}")
    return KeyPartition(problem, assignment.astype(np.int64), int(pieces), tree, layout)


@st.composite
def key_partitions(
    draw: DrawFn,
    problems: st.SearchStrategy[KernelProblem] | None = None,
    *,
    min_pieces: int = 1,
    max_pieces: int = 4,
    layouts: tuple[str, ...] = LAYOUTS,
) -> KeyPartition:
    """A :class:`KeyPartition` (:func:`make_key_partition`), labelled draws of a problem (default
    :func:`kernel_problems`), ``min_pieces`` to ``max_pieces`` pieces, a layout and a tree."""
    problem = draw(kernel_problems() if problems is None else problems, label="problem")
    pieces = draw(st.integers(min_pieces, max_pieces), label="pieces")
    layout = draw(st.sampled_from(tuple(layouts)), label="layout")
    seed = draw(st.integers(0, 2**32 - 1), label="layout seed") if layout == "random" else 0
    tree = draw(merge_trees(pieces), label="merge tree")
    note(f"pieces={pieces} layout={layout} seed={seed} tree={tree!r}")
    return make_key_partition(problem, pieces, layout, seed, tree)
