"""The bound of the attention state merge: :func:`merge_error_bound` for ``P`` states ``(o, lse)``
merged in a format, by a binary merge tree of depth ``D`` or one stacked ``P``-ary merge. NumPy
only, float64.

**Notation.** Pieces ``p = 1..P`` with exact states ``(o_p, lse_p)``; the merged state
``L = log sum_p e^{lse_p}``, ``o* = sum_p pi_p o_p`` with the shares ``pi_p = e^{lse_p - L}``
(``sum_p pi_p = 1``). Per row and component: ``V = max_p |o_p|`` and the range
``R = max_p o_p - min_p o_p`` over the live (finite-``lse``) pieces, ``Lmax = max_p |lse_p| +
ln P``, which bounds ``|lse|`` of every partial merge. The merge computes in ``u`` (float32's for
16-bit states, as :func:`attnref.merge_states` does) and stores each result in the states'
formats: ``r_o = u_16`` when ``o`` is 16-bit (else 0, the arithmetic already rounds to it), and
``r_l`` likewise for ``lse``. ``tiny`` is the smallest normal number of the working format (an
``exp`` that underflows, or is flushed to zero, is off by at most that much).

**One binary merge** ``m = max(lse_a, lse_b)``, ``w = exp(lse - m)``,
``lse = m + log1p(min(w_a, w_b))``, ``o = (w_a o_a + w_b o_b) / (w_a + w_b)``:

1. ``d = lse_s - m`` (the smaller state; ``d = 0`` for the larger) is rounded once:
   ``fl(d) = d (1 + delta)``, so ``w_s`` gets the relative error ``|d| u``, absolute
   ``|d| u e^{-|d|} <= u / e``: large differences cost nothing, because the weight they perturb
   is ``e^{-|d|}``. ``exp`` adds the relative error ``C_EXP u`` to each weight
   (:mod:`attnref.tolerance._rounding`).
2. A relative error ``eta`` in a child's weight is a shift of that child's ``lse`` by ``eta``.
   ``o`` is a convex combination, ``d o / d lse_c = pi_c (o_c - o)``, so shifts ``eps_p`` of the
   pieces' ``lse`` move ``o`` by at most ``max|eps| sum_p pi_p |o_p - o| <= max|eps| R / 2`` (the
   mean absolute deviation of numbers spread over a range ``R`` is at most ``R / 2``; by the
   mean value theorem this holds beyond first order). The ``|d| u`` shift of the smaller child
   moves ``o`` by ``pi_s |d| u |o_s - o| <= (u / e) R``.
3. The products, the sum, the total ``w_a + w_b`` and the division: 4 roundings,
   ``gamma_4 sum_c pi_c |o_c| <= gamma_4 V``; storing ``o`` adds ``r_o V``.
4. ``lse``: ``log1p`` of ``w_s`` (off by ``w_s (|d| + C_EXP) u <= (1/e + C_EXP) u``, and
   ``log1p`` is 1-Lipschitz on ``[0, 1]``), evaluated to ``C_EXP u`` relative
   (``<= C_EXP u ln 2``), the add ``u |lse|``, the store ``r_l |lse|``:
   ``l = (1/e + C_EXP + C_EXP ln 2) u + (u + r_l) Lmax + tiny``.

**Depth.** An input ``lse`` error ``lambda`` passes through a merge unamplified
(``logaddexp`` is 1-Lipschitz in the max norm), so after ``D`` levels ``|d lse| <= Lambda_0 +
D l``. An error in a node's stored ``lse`` (or weight) is a shift of every piece below it, so each
piece's ``lse`` is shifted by at most ``eps = Lambda_0 + D (C_EXP u + l)`` in all, and ``o``
moves by at most ``eps R / 2`` (step 2, whatever the tree). The steps 1 and 3 terms apply once
per node; the nodes of one level hold disjoint pieces whose shares sum to at most 1, so they add
``(u / e + tiny) R + (gamma_4 + r_o) V`` per level. An input ``o`` error ``e_p`` reaches the
result with the computed share of its piece, at most ``e^{2 eps'} pi_p`` (and at most 1), where
``eps' = eps + 2 D u Lmax`` also counts the ``|d| u`` shifts. Hence, for any binary tree of
depth ``D``::

    |d o|   <= [min(max_p e_p, e^{2 eps'} sum_p pi_p e_p) + D (gamma_4 + r_o) V'
                + min(R', eps R' / 2 + D (u / e + tiny) R')] (1 + r_o)^D
    |d lse| <= (Lambda_0 + D l) (1 + r_l)^D

with ``R' = R + 2 max_p e_p`` and ``V' = V + max_p e_p`` (the range and magnitude of the
computed pieces); a value off by ``delta`` and then stored is off by ``r |x| + (1 + r) delta``,
whence the ``(1 + r)^D`` factors. Every term grows **linearly in the depth**: ``D = P - 1``
for a sequential merge (a ring: an online softmax over ``P`` chunks), ``D = ceil(log2 P)`` for
a balanced tree.
Any order and grouping of ``P`` pieces is a binary tree of depth at most ``P - 1``, so
``tree="sequential"`` covers all of them. The ``D l`` term dominates at large ``|lse|``: the
spacing of float32 near ``1e4`` is ``1e-3``, and every stored partial ``lse`` is that far off.

**One stacked merge** (:func:`attnref.merge_state_stack`: ``w_p = exp(lse_p - m)``,
``lse = m + log sum_p w_p``, ``o = sum_p w_p o_p / sum_p w_p``): ``D = 1`` with the ``P``-ary
constants. The shifts ``|d_p| u`` total ``sum_p pi_p |d_p| u |o_p - o| <= c_P u R`` with
``c_P = min((P - 1) / e, ln P)`` (``pi_p <= e^{-|d_p|}``: each term is at most ``1 / e``, and
``sum_p pi_p |d_p| <= sum_p pi_p ln(1 / pi_p) <= ln P``); the arithmetic is ``gamma_{2P}``
(products, two sums of ``P`` terms, the division); ``lse`` is off by
``(c_P + C_EXP) u + gamma_{P-1} + C_EXP u ln P + (u + r_l) Lmax + (P - 1) tiny``.

The float64 oracle's own error (:func:`attnref.oracle.merge_state_stack`, the shares form
``o = sum_p e^{lse_p - L} o_p``: each share off by ``(|lse_p - L| + C_EXP) u`` relative plus
``L``'s error, the sum ``gamma_P``) is added, so ``|merged - oracle merge| <= bound`` is a
rigorous first-order test. Rows whose merge is empty (every ``lse = -inf``) or NaN (a NaN or
``+inf`` ``lse``) are exact and get 0.

**The gradient of one binary merge** (:func:`merge_grad_error_bound`). For cotangents ``g_o`` on
the merged ``o`` and ``g_l`` on the merged ``lse`` the exact VJP is ``d o_p = pi_p g_o`` and
``d lse_p = pi_p (g_o . (o_p - o) + g_l)``, ``p in {a, b}`` (the float64 oracle
``attnref.oracle._states.merge_states_vjp``, differentiated by hand). A backward pass (autodiff
of the merge above, or one written by hand) evaluates these as sums of terms, each a computed
share times a product of cotangent and ``o`` entries. Per row, with ``|g_o| . x = sum_h |g_o,h|
x_h`` and ``M_p = |g_l| + |g_o| . (|o_p| + |o| + delta_o)`` (the magnitude of ``d lse_p``'s
terms over ``pi_p``):

1. **Shares.** ``pi_p`` is computed as ``w_p / (w_a + w_b)`` with ``w_p = exp(fl(lse_p - m))``,
   or as ``exp(fl(lse_p - lse))`` from the computed ``lse``. Either way it is
   ``pi_p e^{theta_p}`` with ``|theta_p| <= theta_0 + |lse_p - L| u``, ``theta_0 = l + C_EXP u``:
   the computed ``lse`` is within ``l`` (step 4 of one merge), the subtraction rounds once
   (``|lse_p - L| u``; the weights form's ``|d_p| <= |lse_p - L|``), ``exp`` adds ``C_EXP u``,
   and the weights form's total and division, ``(2 + 1/e + C_EXP) u`` beyond its weight's
   ``(|d_p| + C_EXP) u``, are within ``l``'s ``(1/e + C_EXP + C_EXP ln 2) u`` plus the other
   ``C_EXP u`` since ``C_EXP ln 2 >= 2``. The relative error of a share is at most
   ``rho_p = e^{theta_0 + |lse_p - L| u} - 1`` (so ``pi_p |lse_p - L| u <= u / e``: a tiny share
   costs nothing).
2. **Rounding.** Every term passes through at most ``K = H_v + 12`` rounded operations: the dot
   product with ``g_o`` (``H_v``), the products with the share and the cotangent, the division
   by the total, the subtraction of ``g_o . o``, ``exp``'s and ``log1p``'s derivatives (a product
   and a division), and the sums of the direct, ``lse`` and shift paths into ``d lse_p``, with
   room: ``gamma_K`` relative to the term.
3. **The shift.** A backward that differentiates through the shift ``m = max(lse_a, lse_b)``
   (or any shift that is not a ``stop_gradient``) adds to the state the shift was taken from a
   sum of terms that is exactly 0: ``g_l`` and every term of both states' ``lse`` paths,
   ``|g_l| + sum_q pi_q M_q`` in magnitude, hence ``gamma_K |g_l| + sum_q pi_q (rho_q +
   gamma_K) M_q`` computed. Which state receives it depends on the implementation (both, halved,
   on a tie), so every live state is allowed it.
4. **The merged ``o``** a backward reads is the computed one (a kernel's backward reads its
   stored output, as FlashAttention's ``D = rowsum(dO * O)`` does), within the forward bound
   ``delta_o`` of one merge (:func:`merge_error_bound`): it moves ``d lse_p`` by
   ``pi_p |g_o| . delta_o`` directly and by ``|g_o| . delta_o`` through the shift.
5. **Underflow.** An ``exp`` or product that underflows (or is flushed to zero) is off by at
   most ``tiny``: ``4 tiny`` per term's magnitude covers the share's ``exp`` and division and
   the products.
6. **The store.** The gradients are returned in the states' formats: a 16-bit ``d o`` adds
   ``r_o`` of its value (``<= pi_p |g_o|``) plus ``r_o tiny_o`` (half the format's subnormal
   spacing), and likewise ``r_l`` for ``d lse`` (value ``<= pi_p M_p``).

Hence::

    |d(d o_p)|   <= (1 + r_o) [pi_p (rho_p + gamma_K) + 4 tiny] |g_o|
                    + r_o (pi_p |g_o| + tiny_o)
    |d(d lse_p)| <= (1 + r_l) [pi_p (rho_p + gamma_K) M_p + gamma_K |g_l|
                    + sum_q pi_q (rho_q + gamma_K) M_q + (1 + pi_p) |g_o| . delta_o
                    + 4 tiny (|g_l| + |g_o| . (V + |o| + delta_o))] + r_l (pi_p M_p + tiny_l)

plus the float64 oracle's own error (the same expression at ``u_64``, no store). An empty state
(``lse = -inf``) and every state of an empty row get 0: ``exp(-inf) = 0`` exactly, so a correct
backward gives exactly 0 there (never NaN from an empty state's NaN ``o``).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from attnref.oracle._checks import check_axis
from attnref.oracle._doc import STATES, doc

from ._rounding import C_EXP, finfo_of, gamma, is_16bit, unit_roundoff

TREES = ("sequential", "balanced", "stack")


def merge_depth(tree: str | int, pieces: int) -> int:
    """The depth ``D`` of the merge of ``pieces`` states (the number of merges on the longest
    path from a piece to the result).

    Args:
        tree: ``"sequential"`` (``P - 1``: one state after another, a ring), ``"balanced"``
            (``ceil(log2 P)``), ``"stack"`` (one ``P``-ary merge: 1) or an int, the depth of a
            binary merge tree (``ceil(log2 P) <= D <= P - 1``).
        pieces: ``P >= 0``.

    Returns:
        ``D`` (0 when ``P <= 1``: nothing is merged).

    Raises:
        ValueError: An unknown ``tree``, a negative ``pieces``, or an int depth that no binary
            tree over ``P`` pieces has.
        TypeError: ``tree`` neither a string nor an int.
    """
    if not isinstance(pieces, (int, np.integer)) or pieces < 0:
        raise ValueError(f"pieces must be an int >= 0, got {pieces!r}")
    low = math.ceil(math.log2(pieces)) if pieces > 1 else 0
    if isinstance(tree, str):
        if tree not in TREES:
            raise ValueError(f"tree must be one of {TREES} or an int depth, got {tree!r}")
        if tree == "sequential":
            return max(int(pieces) - 1, 0)
        return low if tree == "balanced" else min(1, low)
    if not isinstance(tree, (int, np.integer)) or isinstance(tree, (bool, np.bool_)):
        raise TypeError(f"tree must be one of {TREES} or an int depth, got {tree!r}")
    if not low <= tree <= max(int(pieces) - 1, 0):
        raise ValueError(
            f"a binary merge tree over {pieces} pieces has depth in [{low}, "
            f"{max(int(pieces) - 1, 0)}], got tree={tree}"
        )
    return int(tree)


def as_dtype(dtype: Any) -> np.dtype[Any]:
    """``np.dtype(dtype)``, with ml_dtypes' names (``"bfloat16"``) registered first."""
    try:
        return np.dtype(dtype)
    except TypeError:
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, str(dtype)))


def _live_stats(o: np.ndarray, lse: np.ndarray) -> dict[str, np.ndarray]:
    """Per row (pieces on the last axis of ``lse [..., P]``, ``o [..., P, H_v]``): shares,
    ``V``, ``R``, ``Lmax``, and the rows that are exact (empty or NaN)."""
    live = np.isfinite(lse)
    some = live.any(axis=-1)
    exact = ~some | np.isnan(lse).any(axis=-1) | np.isposinf(lse).any(axis=-1)
    top = np.where(some, np.where(live, lse, -np.inf).max(axis=-1, initial=-np.inf), 0.0)
    with np.errstate(under="ignore"):
        w = np.where(live, np.exp(np.where(live, lse - top[..., None], 0.0)), 0.0)
    total = np.where(exact, 1.0, w.sum(axis=-1))
    share = np.where(exact[..., None], 0.0, w / total[..., None])
    ol = live[..., None]
    v = np.where(ol, np.abs(np.where(ol, o, 0.0)), 0.0).max(axis=-2, initial=0.0)
    hi = np.where(ol, np.where(ol, o, 0.0), -np.inf).max(axis=-2, initial=-np.inf)
    lo = np.where(ol, np.where(ol, o, 0.0), np.inf).min(axis=-2, initial=np.inf)
    rng = np.where(exact[..., None], 0.0, hi - lo)
    l_abs = np.where(live, np.abs(np.where(live, lse, 0.0)), 0.0).max(axis=-1, initial=0.0)
    l_max = l_abs + math.log(max(lse.shape[-1], 1))
    bad_o = (ol & ~np.isfinite(o)).any(axis=-2)  # NaN or inf in a live piece's o: so is the result
    v, rng = np.where(bad_o, 0.0, v), np.where(bad_o, 0.0, rng)
    return {
        "live": live,
        "exact": exact,
        "bad_o": bad_o,
        "share": share,
        "V": v,
        "R": rng,
        "Lmax": l_max,
    }


def _errors(
    o_error: Any, lse_error: Any, o: np.ndarray, lse: np.ndarray, live: np.ndarray, ax: int
) -> tuple[np.ndarray, np.ndarray]:
    """The input errors moved like the states (pieces last), 0 for empty pieces."""
    eo = np.zeros(o.shape) if o_error is None else np.asarray(o_error, np.float64)
    el = np.zeros(lse.shape) if lse_error is None else np.asarray(lse_error, np.float64)
    for name, e, want in (("o_error", eo, o.shape), ("lse_error", el, lse.shape)):
        try:
            grows = np.broadcast_shapes(e.shape, want) != want
        except ValueError:
            grows = True
        if grows:
            raise ValueError(f"{name} has shape {e.shape}; expected {want} (or broadcastable)")
    eo = np.moveaxis(np.broadcast_to(eo, o.shape), ax, -2)
    el = np.moveaxis(np.broadcast_to(el, lse.shape), ax, -1)
    eo = np.where(live[..., None], eo, 0.0)
    el = np.where(live, el, 0.0)
    return eo, el


def _oracle_error(st: dict[str, np.ndarray], pieces: int) -> tuple[np.ndarray, np.ndarray]:
    """The float64 oracle's own error (shares form, module docstring): ``lse`` as the stacked
    merge; each share ``e^{lse_p - L}`` off by ``(|lse_p - L| + C_EXP) u + |d L|`` relative,
    where ``sum_p pi_p |lse_p - L| = sum_p pi_p ln(1 / pi_p) <= ln P``; the products and the sum
    ``gamma_P``."""
    u = unit_roundoff(np.float64)
    tiny = float(np.finfo(np.float64).tiny)
    ln_p = math.log(max(pieces, 1))
    c_p = min((pieces - 1) / math.e, ln_p) if pieces > 1 else 0.0
    d_lse = (
        (c_p + C_EXP) * u
        + gamma(max(pieces - 1, 0), u)
        + C_EXP * u * ln_p
        + u * st["Lmax"]
        + pieces * tiny
    )
    rel = d_lse + C_EXP * u + gamma(pieces, u) + u * ln_p + pieces * tiny
    return rel[..., None] * st["V"], d_lse


def merge_error_bound(
    o: Any,
    lse: Any,
    *,
    axis: int = 0,
    dtype: Any = np.float32,
    lse_dtype: Any = None,
    tree: str | int = "sequential",
    o_error: Any = None,
    lse_error: Any = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Componentwise bounds on ``|o - o_oracle|`` and ``|lse - lse_oracle|`` of the merge of
    ``P`` states, computed in ``dtype`` by a binary merge tree of depth ``D`` or one stacked
    merge: ``(Lambda_0 + D l) (1 + r_l)^D`` on ``lse`` and the ``|d o|`` of the module docstring
    ("Depth"; ``docs/states.md``), linear in the depth ``D`` (``P - 1`` sequential,
    ``ceil(log2 P)`` balanced), plus the float64 oracle's own error. With
    ``o_error``/``lse_error`` (``e_p``, ``Lambda_0 = max_p lambda_p``: bounds on how far each
    piece's state is from its exact state, e.g.
    :func:`attnref.tolerance.kernel_call_error_bound` of each piece's call) the result bounds
    the distance from the exact merged state, i.e. from attention over all keys: "computed piece
    by piece and merged vs the whole call".

    Args:
        o: The pieces' exact states' outputs, stacked along ``axis`` of ``lse``'s shape plus
            ``H_v`` (e.g. the oracle's states of each piece, or the states as the merge
            received them).
        lse: Their log-sum-exps (``-inf``: an empty piece, which adds nothing).
        axis: The stacking axis of ``lse``.
        dtype: The format of the states' ``o``; 16-bit states are merged in float32 and each
            merge's ``o`` is stored in ``dtype``.
        lse_dtype: The format of the states' ``lse`` (default ``dtype``).
        tree: ``"sequential"`` (default: depth ``P - 1``, valid for every binary order and
            grouping), ``"balanced"`` (``ceil(log2 P)``), ``"stack"`` (one stacked merge,
            :func:`attnref.merge_state_stack`) or an int, the depth of the binary tree used.
        o_error: Bounds on ``|o_p - exact|``, ``o``'s shape (or broadcastable); ``None``: 0.
        lse_error: Bounds on ``|lse_p - exact|``, ``lse``'s shape; ``None``: 0.

    Returns:
        ``(o_bound [..., H_v], lse_bound [...])`` with ``axis`` removed, float64, non-negative;
        0 on rows whose merge is empty or NaN and on components where a live piece's ``o`` is
        NaN or inf (the result is exactly ``-inf``, 0 or NaN there).

    Raises:
        ValueError: Mismatched shapes, an ``axis`` out of range, or a bad ``tree``
            (:func:`merge_depth`).
        TypeError: ``tree`` neither a string nor an int.
    """
    lse64 = np.asarray(lse, np.float64)
    o64 = np.asarray(o, np.float64)
    if o64.ndim < 1 or lse64.shape != o64.shape[:-1]:
        raise ValueError(
            f"lse has shape {lse64.shape}; expected {o64.shape[:-1]} (o's shape {o64.shape} "
            "without its last axis)"
        )
    ax = check_axis(axis, lse64.shape)
    pieces = lse64.shape[ax]
    depth = merge_depth(tree, pieces)
    stack = tree == "stack"
    ls, os_ = np.moveaxis(lse64, ax, -1), np.moveaxis(o64, ax, -2)
    st = _live_stats(os_, ls)
    eo, el = _errors(o_error, lse_error, o64, lse64, st["live"], ax)

    u, tiny, r_o, r_l = _formats(dtype, lse_dtype)

    e_max = eo.max(axis=-2, initial=0.0)
    lam0 = el.max(axis=-1, initial=0.0)
    rng = st["R"] + 2.0 * e_max
    mag = st["V"] + e_max
    if stack and pieces > 1:
        c_p = min((pieces - 1) / math.e, math.log(pieces))
        d_lse = (
            lam0
            + (c_p + C_EXP) * u
            + gamma(pieces - 1, u)
            + C_EXP * u * math.log(pieces)
            + (u + r_l) * st["Lmax"]
            + (pieces - 1) * tiny
        )
        eps = lam0 + C_EXP * u
        local_o = (gamma(2 * pieces, u) + r_o) * mag
        shift_o = (c_p * u + (pieces - 1) * tiny) * rng
    else:
        ell = _level_error(st, u, tiny, r_l)
        d_lse = lam0 + depth * ell
        eps = lam0 + depth * (C_EXP * u + ell)
        local_o = depth * (gamma(4, u) + r_o) * mag
        shift_o = depth * (u / math.e + tiny) * rng
    # the computed share of a piece is at most e^{2 (eps + D 2 Lmax u)} times its exact share
    # (every lse shift, and the |d| u shifts with |d| <= 2 Lmax, at most D of them)
    with np.errstate(over="ignore", invalid="ignore"):
        grow = np.exp(2.0 * (eps + depth * 2.0 * u * st["Lmax"]))[..., None]
        carried = np.minimum(e_max, grow * (st["share"][..., None] * eo).sum(axis=-2))
    weights = np.minimum(rng, eps[..., None] * rng / 2.0 + shift_o)
    if depth == 0:  # one piece (or none): nothing is merged, the inputs' errors are the result's
        weights = np.zeros_like(weights)
    # a value off by delta and then stored, fl(x) = x (1 + r), is off by r |x*| + (1 + r) delta:
    # the (1 + r) factor, once per stored level, keeps the bound rigorous beyond first order
    levels = max(depth, 1)
    d_o = (carried + local_o + weights) * (1.0 + r_o) ** levels
    d_lse = d_lse * (1.0 + r_l) ** levels
    ora_o, ora_l = _oracle_error(st, max(pieces, 1))
    d_o = d_o + ora_o
    d_lse = d_lse + ora_l
    exact = st["exact"]
    exact_o = exact[..., None] | st["bad_o"]
    return np.where(exact_o, 0.0, d_o), np.where(exact, 0.0, d_lse)


def _store_formats(dtype: Any, lse_dtype: Any) -> tuple[np.dtype[Any], np.dtype[Any]]:
    """The formats of the states' ``o`` and ``lse`` (``lse_dtype`` defaults to ``dtype``)."""
    o_fmt = as_dtype(dtype)
    return o_fmt, (o_fmt if lse_dtype is None else as_dtype(lse_dtype))


def _formats(dtype: Any, lse_dtype: Any) -> tuple[float, float, float, float]:
    """``(u, tiny, r_o, r_l)``: the working format's unit round-off and smallest normal (float32
    for 16-bit states) and the store round-offs of a 16-bit ``o`` and ``lse`` (else 0)."""
    o_fmt, l_fmt = _store_formats(dtype, lse_dtype)
    work = np.result_type(np.float32, *(np.float32 if is_16bit(f) else f for f in (o_fmt, l_fmt)))
    r_o = unit_roundoff(o_fmt) if is_16bit(o_fmt) else 0.0
    r_l = unit_roundoff(l_fmt) if is_16bit(l_fmt) else 0.0
    return unit_roundoff(work), float(finfo_of(work).tiny), r_o, r_l


def _level_error(st: dict[str, np.ndarray], u: float, tiny: float, r_l: float) -> np.ndarray:
    """``l = (1/e + C_EXP + C_EXP ln 2) u + (u + r_l) Lmax + tiny``: one merge level's ``lse``
    error (module docstring)."""
    return (1.0 / math.e + C_EXP + C_EXP * math.log(2.0)) * u + (u + r_l) * st["Lmax"] + tiny


def _grad_terms(
    st: dict[str, np.ndarray],
    m_p: np.ndarray,
    gap: np.ndarray,
    mag: np.ndarray,
    read_o: np.ndarray,
    g_abs: np.ndarray,
    g_l_abs: np.ndarray,
    u: float,
    tiny: float,
    r_l: float,
) -> tuple[np.ndarray, np.ndarray]:
    """Steps 1-5 of the gradient bound (module docstring), before the store: ``(e_o [..., P,
    H_v], e_lse [..., P])`` in a format of unit round-off ``u``, pieces on the last axis;
    ``gap = |lse_p - L|``, ``mag = |g_l| + |g_o| . (V + |o| + delta_o)``, ``read_o = |g_o| .
    delta_o``."""
    gam = gamma(g_abs.shape[-1] + 12, u)
    ell = _level_error(st, u, tiny, r_l)
    rho = np.expm1((ell + C_EXP * u)[..., None] + gap * u)
    pi = st["share"]
    shift = gam * g_l_abs + (pi * (rho + gam) * m_p).sum(axis=-1)
    e_o = (pi * (rho + gam) + 4.0 * tiny)[..., None] * g_abs[..., None, :]
    e_l = (
        pi * (rho + gam) * m_p
        + shift[..., None]
        + (1.0 + pi) * read_o[..., None]
        + 4.0 * tiny * mag[..., None]
    )
    return e_o, e_l


@doc(
    STATES,
    dtype="The format of the states' ``o`` (and of ``d o``); 16-bit states are merged in float32.",
    lse_dtype="The format of the states' ``lse`` (and of ``d lse``; default ``dtype``).",
)
def merge_grad_error_bound(
    o_a: Any,
    lse_a: Any,
    o_b: Any,
    lse_b: Any,
    g_o: Any,
    g_lse: Any,
    *,
    dtype: Any = np.float32,
    lse_dtype: Any = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Componentwise bounds on the error of the gradient of one binary merge computed in
    ``dtype``, against the exact VJP ``d o_p = pi_p g_o``, ``d lse_p = pi_p (g_o . (o_p - o) +
    g_lse)``: the bound "Hence" of the module docstring ("The gradient of one binary merge",
    ``K = H_v + 12``, ``delta_o`` the forward bound of one merge), plus the float64 oracle's own
    error.

    Returns:
        ``(bound of d o_a, of d lse_a, of d o_b, of d lse_b)``, float64, non-negative, the
        inputs' shapes; 0 for an empty state, on a row whose merge is empty or NaN, and for
        ``d lse`` on a row where a live state's ``o`` is not finite (the gradient is exact, or
        NaN, there).

    Raises:
        ValueError: If the shapes do not agree (every ``o`` and ``g_o`` one shape, every ``lse``
            and ``g_lse`` that shape without its last axis).
    """
    o = np.stack([np.asarray(o_a, np.float64), np.asarray(o_b, np.float64)])
    lse = np.stack([np.asarray(lse_a, np.float64), np.asarray(lse_b, np.float64)])
    g_abs, g_l_abs = np.abs(np.asarray(g_o, np.float64)), np.abs(np.asarray(g_lse, np.float64))
    if not (o.ndim >= 2 and lse.shape == o.shape[:-1] and g_abs.shape == o.shape[1:]) or (
        g_l_abs.shape != lse.shape[1:]
    ):
        raise ValueError(
            f"shapes o_a {np.shape(o_a)}, lse_a {np.shape(lse_a)}, o_b {np.shape(o_b)}, lse_b "
            f"{np.shape(lse_b)}, g_o {np.shape(g_o)}, g_lse {np.shape(g_lse)}: o_a, o_b and g_o "
            "must have one shape, and lse_a, lse_b and g_lse that shape without its last axis"
        )
    delta_o = merge_error_bound(o, lse, dtype=dtype, lse_dtype=lse_dtype, tree=1)[0]
    ls, os_ = np.moveaxis(lse, 0, -1), np.moveaxis(o, 0, -2)  # pieces last
    st = _live_stats(os_, ls)
    pi, live, exact = st["share"], st["live"], st["exact"]
    # |o_p| of the live states and |o| of the exact merge (0 in a component a live o_p holds
    # NaN or inf: the gradient is NaN there, and only d o, which does not read o, is compared)
    o_read = np.where(live[..., None] & ~st["bad_o"][..., None, :], os_, 0.0)
    o_live = np.abs(o_read)
    merged_abs = np.abs((pi[..., None] * o_read).sum(axis=-2))
    reach = merged_abs + delta_o  # a bound on |o| of the computed merge
    m_p = g_l_abs[..., None] + (g_abs[..., None, :] * (o_live + reach[..., None, :])).sum(axis=-1)
    mag = g_l_abs + (g_abs * (st["V"] + reach)).sum(axis=-1)
    read_o = (g_abs * delta_o).sum(axis=-1)
    top = np.where(live, ls, -np.inf).max(axis=-1)
    top = np.where(exact, 0.0, top)
    with np.errstate(under="ignore"):
        shifted = np.where(live, np.where(live, ls, 0.0) - top[..., None], 0.0)
        total = np.where(live, np.exp(shifted), 0.0).sum(axis=-1)
    big_l = top + np.log(np.where(exact, 1.0, total))
    gap = np.where(live, np.abs(np.where(live, ls, 0.0) - big_l[..., None]), 0.0)
    u, tiny, r_o, r_l = _formats(dtype, lse_dtype)
    args = (st, m_p, gap, mag, read_o, g_abs, g_l_abs)
    e_o, e_l = _grad_terms(*args, u, tiny, r_l)
    f_o, f_l = _grad_terms(*args, unit_roundoff(np.float64), float(np.finfo(np.float64).tiny), 0.0)
    tiny_o, tiny_l = (float(finfo_of(f).tiny) for f in _store_formats(dtype, lse_dtype))
    b_o = (1.0 + r_o) * e_o + r_o * (pi[..., None] * g_abs[..., None, :] + tiny_o) + f_o
    b_l = (1.0 + r_l) * e_l + r_l * (pi * m_p + tiny_l) + f_l
    off = ~live | exact[..., None]
    b_o = np.where(off[..., None], 0.0, b_o)
    bad_row = np.asarray(st["bad_o"].any(axis=-1))  # a live o not finite: d lse is NaN
    b_l = np.where(off | bad_row[..., None], 0.0, b_l)
    return b_o[..., 0, :], b_l[..., 0], b_o[..., 1, :], b_l[..., 1]
