"""The bound of the attention state merge (:func:`merge_error_bound`: ``P`` states ``(o, lse)``
merged in a format by a binary tree of depth ``D`` or one stacked merge) and of the gradient of
one merge (:func:`merge_grad_error_bound`). NumPy only, float64; full derivation in
``docs/states.md``.

**Notation.** Exact piece states ``(o_p, lse_p)``, merged ``L = log sum_p e^{lse_p}``,
``o* = sum_p pi_p o_p``, shares ``pi_p = e^{lse_p - L}``. Per row and component over the live
(finite-``lse``) pieces: ``V = max_p |o_p|``, ``R = max_p o_p - min_p o_p``, ``Lmax = max_p
|lse_p| + ln P``. Work in ``u`` (float32's for 16-bit states); ``r_o``/``r_l`` the store
round-offs of a 16-bit ``o``/``lse`` (else 0); ``tiny`` the working format's smallest normal.

**One binary merge** (``m = max(lse_a, lse_b)``, ``w = exp(lse - m)``, ``lse = m +
log1p(min(w_a, w_b))``, ``o = (w_a o_a + w_b o_b) / (w_a + w_b)``):

1. ``d = lse_s - m`` rounds once: ``w_s`` is off by ``|d| u e^{-|d|} <= u / e``; ``exp`` adds
   ``C_EXP u`` relative.
2. A relative weight error ``eta`` is an ``lse`` shift by ``eta``; ``d o / d lse_c = pi_c (o_c -
   o)``, so shifts ``eps_p`` move ``o`` by ``<= max|eps| R / 2`` (mean absolute deviation; by the
   mean value theorem beyond first order), and step 1's shift by ``(u / e) R``.
3. Products, sum, total and division: ``gamma_4 V``; storing ``o``: ``r_o V``.
4. ``lse``: ``l = (1/e + C_EXP + C_EXP ln 2) u + (u + r_l) Lmax + tiny`` (``log1p`` 1-Lipschitz
   on ``[0, 1]``, its evaluation, the add and the store).

**Depth.** ``logaddexp`` is 1-Lipschitz, so ``|d lse| <= Lambda_0 + D l``; a node's ``lse`` error
shifts every piece below it, in all ``eps = Lambda_0 + D (C_EXP u + l)``. Nodes of one level hold
disjoint pieces (shares sum to ``<= 1``), adding ``(u / e + tiny) R + (gamma_4 + r_o) V`` per
level; an input ``o`` error ``e_p`` arrives with its computed share ``<= e^{2 eps'} pi_p``,
``eps' = eps + 2 D u Lmax``. For any binary tree of depth ``D``::

    |d o|   <= [min(max_p e_p, e^{2 eps'} sum_p pi_p e_p) + D (gamma_4 + r_o) V'
                + min(R', eps R' / 2 + D (u / e + tiny) R')] (1 + r_o)^D
    |d lse| <= (Lambda_0 + D l) (1 + r_l)^D

with ``R' = R + 2 max_p e_p``, ``V' = V + max_p e_p`` (a stored value off by ``delta`` is off by
``r |x| + (1 + r) delta``: the ``(1 + r)^D``). Linear in ``D``: ``P - 1`` sequential (covers every
order and grouping), ``ceil(log2 P)`` balanced.

**One stacked merge** (:func:`attnref.merge_state_stack`): ``D = 1``, shifts ``c_P u R`` with
``c_P = min((P - 1) / e, ln P)`` (``sum_p pi_p |d_p| <= sum_p pi_p ln(1 / pi_p) <= ln P``),
arithmetic ``gamma_{2P}``, ``lse`` off by ``(c_P + C_EXP) u + gamma_{P-1} + C_EXP u ln P + (u +
r_l) Lmax + (P - 1) tiny``.

The float64 oracle's own error (shares form: each share off by ``(|lse_p - L| + C_EXP) u`` plus
``L``'s error, the sum ``gamma_P``) is added. Empty (all ``-inf``) or NaN rows are exact: 0.

**The gradient of one binary merge.** Exact VJP: ``d o_p = pi_p g_o``, ``d lse_p = pi_p (g_o .
(o_p - o) + g_l)``. With ``M_p = |g_l| + |g_o| . (|o_p| + |o| + delta_o)``:

1. **Shares** ``pi_p e^{theta_p}``, ``|theta_p| <= theta_0 + |lse_p - L| u``, ``theta_0 = l +
   C_EXP u`` (weights form or ``exp(lse_p - lse)``; ``C_EXP ln 2 >= 2`` covers the weights form's
   total and division): relative error ``rho_p = e^{theta_0 + |lse_p - L| u} - 1``.
2. **Rounding.** At most ``K = H_v + 12`` operations per term (the ``g_o`` dot product, products,
   division, subtraction, ``exp``/``log1p`` derivatives, the path sums): ``gamma_K`` relative.
3. **The shift.** Differentiating through ``m`` adds an exactly-zero sum of magnitude ``|g_l| +
   sum_q pi_q M_q`` to whichever state (implementation-defined), so every live state gets it.
4. **The merged ``o``** read by the backward is within ``delta_o`` (forward bound of one merge):
   ``pi_p |g_o| . delta_o`` directly, ``|g_o| . delta_o`` through the shift.
5. **Underflow**: ``4 tiny`` per term's magnitude. 6. **Store**: ``r_o``/``r_l`` of the value
   plus ``r tiny`` of the format.

Hence::

    |d(d o_p)|   <= (1 + r_o) [pi_p (rho_p + gamma_K) + 4 tiny] |g_o|
                    + r_o (pi_p |g_o| + tiny_o)
    |d(d lse_p)| <= (1 + r_l) [pi_p (rho_p + gamma_K) M_p + gamma_K |g_l|
                    + sum_q pi_q (rho_q + gamma_K) M_q + (1 + pi_p) |g_o| . delta_o
                    + 4 tiny (|g_l| + |g_o| . (V + |o| + delta_o))] + r_l (pi_p M_p + tiny_l)

plus the oracle's own error (same expression at ``u_64``, no store). Empty states and every state
of an empty row get 0 (``exp(-inf) = 0`` exactly).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from attnref.oracle._checks import broadcasts, check_axis
from attnref.oracle._doc import STATES, doc

from ._rounding import C_EXP, finfo_of, gamma, is_16bit, unit_roundoff

TREES = ("sequential", "balanced", "stack")


def merge_depth(tree: str | int, pieces: int) -> int:
    """The depth ``D`` of the merge of ``pieces`` states (merges on the longest path).

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
    low, high = (math.ceil(math.log2(pieces)) if pieces > 1 else 0), max(int(pieces) - 1, 0)
    if isinstance(tree, str):
        if tree not in TREES:
            raise ValueError(f"tree must be one of {TREES} or an int depth, got {tree!r}")
        return {"sequential": high, "balanced": low}.get(tree, min(1, low))
    if not isinstance(tree, (int, np.integer)) or isinstance(tree, (bool, np.bool_)):
        raise TypeError(f"tree must be one of {TREES} or an int depth, got {tree!r}")
    if not low <= tree <= high:
        raise ValueError(
            f"a binary merge tree over {pieces} pieces has depth in [{low}, {high}], "
            f"got tree={tree}"
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
    """Per row (``lse [..., P]``, ``o [..., P, H_v]``): shares, ``V``, ``R``, ``Lmax``, ..."""
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
    return dict(live=live, exact=exact, bad_o=bad_o, share=share, V=v, R=rng, Lmax=l_max)


def _errors(
    o_error: Any, lse_error: Any, o: np.ndarray, lse: np.ndarray, live: np.ndarray, ax: int
) -> tuple[np.ndarray, np.ndarray]:
    """The input errors moved like the states (pieces last), 0 for empty pieces."""
    eo = np.zeros(o.shape) if o_error is None else np.asarray(o_error, np.float64)
    el = np.zeros(lse.shape) if lse_error is None else np.asarray(lse_error, np.float64)
    for name, e, want in (("o_error", eo, o.shape), ("lse_error", el, lse.shape)):
        if not broadcasts(e.shape, want):
            raise ValueError(f"{name} has shape {e.shape}; expected {want} (or broadcastable)")
    eo = np.moveaxis(np.broadcast_to(eo, o.shape), ax, -2)
    el = np.moveaxis(np.broadcast_to(el, lse.shape), ax, -1)
    return np.where(live[..., None], eo, 0.0), np.where(live, el, 0.0)


def _c_p(pieces: int) -> float:
    """``c_P = min((P - 1) / e, ln P)`` (0 for one piece)."""
    return min((pieces - 1) / math.e, math.log(pieces)) if pieces > 1 else 0.0


def _stack_lse(lam0: Any, u: float, pieces: int, r_l: float, l_max: Any, tinies: float) -> Any:
    """A stacked merge's ``lse`` error (module docstring), ``tinies`` its underflows."""
    ln_p = math.log(max(pieces, 1))
    return (
        lam0
        + (_c_p(pieces) + C_EXP) * u
        + gamma(max(pieces - 1, 0), u)
        + C_EXP * u * ln_p
        + (u + r_l) * l_max
        + tinies
    )


def _oracle_error(st: dict[str, np.ndarray], pieces: int) -> tuple[np.ndarray, np.ndarray]:
    """The float64 oracle's own error (shares form, module docstring; ``sum_p pi_p |lse_p - L| <=
    ln P``)."""
    u, tiny = unit_roundoff(np.float64), float(np.finfo(np.float64).tiny)
    d_lse = _stack_lse(0.0, u, pieces, 0.0, st["Lmax"], pieces * tiny)
    rel = d_lse + C_EXP * u + gamma(pieces, u) + u * math.log(max(pieces, 1)) + pieces * tiny
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
    ``P`` states in ``dtype`` by a tree of depth ``D`` or one stacked merge (module docstring,
    "Depth"), plus the oracle's own error. With ``o_error``/``lse_error`` (each piece's distance
    from its exact state, e.g. :func:`attnref.tolerance.kernel_call_error_bound`) it bounds the
    distance from attention over all keys.

    Args:
        o: The pieces' states' outputs, ``lse``'s shape plus ``H_v``.
        lse: Their log-sum-exps (``-inf``: an empty piece, which adds nothing).
        axis: The stacking axis of ``lse``.
        dtype: The format of the states' ``o`` (16-bit: merged in float32, stored in ``dtype``).
        lse_dtype: The format of the states' ``lse`` (default ``dtype``).
        tree: ``"sequential"`` (depth ``P - 1``, valid for every binary order), ``"balanced"``,
            ``"stack"`` (:func:`attnref.merge_state_stack`) or an int depth (:func:`merge_depth`).
        o_error: Bounds on ``|o_p - exact|``, ``o``'s shape (or broadcastable); ``None``: 0.
        lse_error: Bounds on ``|lse_p - exact|``, ``lse``'s shape; ``None``: 0.

    Returns:
        ``(o_bound [..., H_v], lse_bound [...])`` without ``axis``, float64, non-negative; 0 where
        the result is exact or NaN (empty or NaN rows, a live piece's non-finite ``o``).

    Raises:
        ValueError: Mismatched shapes, an ``axis`` out of range, or a bad ``tree``
            (:func:`merge_depth`).
        TypeError: ``tree`` neither a string nor an int.
    """
    lse64, o64 = np.asarray(lse, np.float64), np.asarray(o, np.float64)
    if o64.ndim < 1 or lse64.shape != o64.shape[:-1]:
        raise ValueError(
            f"lse has shape {lse64.shape}; expected {o64.shape[:-1]} (o's shape {o64.shape} "
            "without its last axis)"
        )
    ax = check_axis(axis, lse64.shape)
    pieces = lse64.shape[ax]
    depth = merge_depth(tree, pieces)
    ls, os_ = np.moveaxis(lse64, ax, -1), np.moveaxis(o64, ax, -2)
    st = _live_stats(os_, ls)
    eo, el = _errors(o_error, lse_error, o64, lse64, st["live"], ax)

    u, tiny, r_o, r_l = _formats(dtype, lse_dtype)

    e_max, lam0 = eo.max(axis=-2, initial=0.0), el.max(axis=-1, initial=0.0)
    rng, mag = st["R"] + 2.0 * e_max, st["V"] + e_max
    if tree == "stack" and pieces > 1:
        d_lse = _stack_lse(lam0, u, pieces, r_l, st["Lmax"], (pieces - 1) * tiny)
        eps = lam0 + C_EXP * u
        local_o = (gamma(2 * pieces, u) + r_o) * mag
        shift_o = (_c_p(pieces) * u + (pieces - 1) * tiny) * rng
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
    exact_o = st["exact"][..., None] | st["bad_o"]
    return np.where(exact_o, 0.0, d_o + ora_o), np.where(st["exact"], 0.0, d_lse + ora_l)


def _store_formats(dtype: Any, lse_dtype: Any) -> tuple[np.dtype[Any], np.dtype[Any]]:
    """The formats of the states' ``o`` and ``lse`` (``lse_dtype`` defaults to ``dtype``)."""
    o_fmt = as_dtype(dtype)
    return o_fmt, (o_fmt if lse_dtype is None else as_dtype(lse_dtype))


def _formats(dtype: Any, lse_dtype: Any) -> tuple[float, float, float, float]:
    """``(u, tiny, r_o, r_l)``: the working format's (float32 for 16-bit) and the store's."""
    o_fmt, l_fmt = _store_formats(dtype, lse_dtype)
    work = np.result_type(np.float32, *(np.float32 if is_16bit(f) else f for f in (o_fmt, l_fmt)))
    r_o = unit_roundoff(o_fmt) if is_16bit(o_fmt) else 0.0
    r_l = unit_roundoff(l_fmt) if is_16bit(l_fmt) else 0.0
    return unit_roundoff(work), float(finfo_of(work).tiny), r_o, r_l


def _level_error(st: dict[str, np.ndarray], u: float, tiny: float, r_l: float) -> np.ndarray:
    """One merge level's ``lse`` error ``l`` (module docstring, step 4)."""
    return (1.0 / math.e + C_EXP + C_EXP * math.log(2.0)) * u + (u + r_l) * st["Lmax"] + tiny


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
    """Componentwise bounds on the error of the gradient of one binary merge in ``dtype``
    against the exact VJP (module docstring, "The gradient of one binary merge"), plus the
    float64 oracle's own error.

    Returns:
        ``(bound of d o_a, of d lse_a, of d o_b, of d lse_b)``, float64, non-negative, the
        inputs' shapes; 0 where the gradient is exact or NaN (empty states or rows; ``d lse``
        where a live ``o`` is not finite).

    Raises:
        ValueError: If the shapes do not agree (``o``s and ``g_o`` one shape, ``lse``s and
            ``g_lse`` that shape without its last axis).
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
    top = np.where(exact, 0.0, np.where(live, ls, -np.inf).max(axis=-1))
    with np.errstate(under="ignore"):
        shifted = np.where(live, np.where(live, ls, 0.0) - top[..., None], 0.0)
        total = np.where(live, np.exp(shifted), 0.0).sum(axis=-1)
    big_l = top + np.log(np.where(exact, 1.0, total))
    gap = np.where(live, np.abs(np.where(live, ls, 0.0) - big_l[..., None]), 0.0)

    def terms(u: float, tiny: float, r_l: float) -> tuple[np.ndarray, np.ndarray]:
        """Steps 1-5 before the store (``gap = |lse_p - L|``), pieces last."""
        gam = gamma(g_abs.shape[-1] + 12, u)
        rho = np.expm1((_level_error(st, u, tiny, r_l) + C_EXP * u)[..., None] + gap * u)
        shift = gam * g_l_abs + (pi * (rho + gam) * m_p).sum(axis=-1)
        e_o = (pi * (rho + gam) + 4.0 * tiny)[..., None] * g_abs[..., None, :]
        e_l = pi * (rho + gam) * m_p + shift[..., None] + (1.0 + pi) * read_o[..., None]
        return e_o, e_l + 4.0 * tiny * mag[..., None]

    u, tiny, r_o, r_l = _formats(dtype, lse_dtype)
    e_o, e_l = terms(u, tiny, r_l)
    f_o, f_l = terms(unit_roundoff(np.float64), float(np.finfo(np.float64).tiny), 0.0)
    tiny_o, tiny_l = (float(finfo_of(f).tiny) for f in _store_formats(dtype, lse_dtype))
    b_o = (1.0 + r_o) * e_o + r_o * (pi[..., None] * g_abs[..., None, :] + tiny_o) + f_o
    b_l = (1.0 + r_l) * e_l + r_l * (pi * m_p + tiny_l) + f_l
    off = ~live | exact[..., None]
    b_o = np.where(off[..., None], 0.0, b_o)
    bad_row = np.asarray(st["bad_o"].any(axis=-1))  # a live o not finite: d lse is NaN
    b_l = np.where(off | bad_row[..., None], 0.0, b_l)
    return b_o[..., 0, :], b_l[..., 0], b_o[..., 1, :], b_l[..., 1]
