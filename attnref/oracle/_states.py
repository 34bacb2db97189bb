"""Oracle twin of the attention state algebra: merging states ``(o, lse)`` in float64 NumPy.

For one query row and allowed keys ``A``, ``lse_A = log sum_{j in A} e^{s_j}`` and ``o_A = sum_{j
in A} e^{s_j - lse_A} v_j``. For disjoint ``A_1, ..., A_P``, grouping the sum by piece gives::

    lse = log sum_p e^{lse_p}                  computed as  m + log sum_p e^{lse_p - m}
    o   = sum_p e^{lse_p - lse} o_p            (pi_p = e^{lse_p - lse}: the pieces' shares)

with ``m = max_p lse_p`` (Milakov & Gimelshein 2018), written in the shares form, independently
of :mod:`attnref._src.formulations.states`, whose semantics it shares: an empty state (``lse =
-inf``) is the identity (its ``o`` never read); a NaN or ``+inf`` ``lse`` makes the result NaN, a
NaN ``o`` of a live state the merged ``o``; an all-empty row is empty, its ``o`` 0 or NaN by
``masked_rows`` (``"uniform"`` is refused); any floating input is read exactly into float64.

The gradient (:func:`merge_states_vjp`), by hand: ``d pi_p / d lse_q = pi_p ([p = q] - pi_q)``
and ``d L / d lse_p = pi_p`` give::

    d o_p   = pi_p g_o
    d lse_p = pi_p (g_o . (o_p - o) + g_lse)

and 0 for an empty state and for every state of an all-empty row. Refusals as the JAX twins'.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._checks import check_axis, dtype_of, is_floating, shape_of
from ._doc import MERGE_RAISES, STACK_RAISES, STATES, doc

STATE_POLICIES = ("zeros", "nan")


def check_state_policy(masked_rows: Any) -> None:
    """``masked_rows`` of a merge: ``"zeros"`` or ``"nan"``."""
    if not isinstance(masked_rows, str) or masked_rows not in STATE_POLICIES:
        raise ValueError(
            f"masked_rows must be one of {STATE_POLICIES} for a merge of states, got "
            f"{masked_rows!r} ('uniform' is the mean of the values over all keys, which the "
            "states do not carry: fill those rows after the merge)"
        )


def check_state(name: str, o: Any, lse: Any) -> None:
    """``o [..., H_v]`` and ``lse [...]`` floating, ``lse``'s shape ``o``'s without the last."""
    o_shape, l_shape = shape_of(o), shape_of(lse)
    if len(o_shape) < 1:
        raise ValueError(f"o_{name} must have rank >= 1 ([..., H_v]), got shape {o_shape}")
    if l_shape != o_shape[:-1]:
        raise ValueError(
            f"lse_{name} has shape {l_shape}; expected {o_shape[:-1]} (the shape of o_{name} "
            f"{o_shape} without its last axis)"
        )
    for label, x in ((f"o_{name}", o), (f"lse_{name}", lse)):
        if not is_floating(dtype_of(x)):
            raise TypeError(f"{label} must be floating, got dtype {dtype_of(x)}")


def check_merge(o_a: Any, lse_a: Any, o_b: Any, lse_b: Any, masked_rows: Any) -> None:
    """The checks of a two-state merge (shapes and dtypes only: the JAX twin calls them too)."""
    check_state_policy(masked_rows)
    check_state("a", o_a, lse_a)
    check_state("b", o_b, lse_b)
    if shape_of(o_a) != shape_of(o_b):
        raise ValueError(
            f"o_a has shape {shape_of(o_a)} but o_b has {shape_of(o_b)}; they must agree"
        )


def check_stack(o: Any, lse: Any, axis: Any, masked_rows: Any) -> int:
    """The checks of a stacked merge; returns ``axis`` non-negative."""
    check_state_policy(masked_rows)
    check_state("stack", o, lse)
    return check_axis(axis, shape_of(lse))


def _stacked(o_a: Any, lse_a: Any, o_b: Any, lse_b: Any) -> tuple[np.ndarray, np.ndarray]:
    """Two states stacked on the merge axis: ``o [..., 2, H_v]``, ``lse [..., 2]`` (float64)."""
    o = np.stack([np.asarray(o_a, np.float64), np.asarray(o_b, np.float64)], axis=-2)
    return o, np.stack([np.asarray(lse_a, np.float64), np.asarray(lse_b, np.float64)], axis=-1)


def _merge_last(o: np.ndarray, lse: np.ndarray, masked_rows: str) -> tuple[np.ndarray, np.ndarray]:
    """The merge of ``P`` states stacked on the last axis of ``lse [..., P]`` and the
    second-to-last of ``o [..., P, H_v]`` (float64)."""
    live = np.isfinite(lse)  # the states that take part (-inf: empty, never read)
    poisoned = np.isnan(lse).any(axis=-1) | np.isposinf(lse).any(axis=-1)
    some = live.any(axis=-1)
    empty = ~some & ~poisoned
    top = np.where(some, np.where(live, lse, -np.inf).max(axis=-1, initial=-np.inf), 0.0)
    with np.errstate(under="ignore"):
        e = np.where(live, np.exp(np.where(live, lse - top[..., None], 0.0)), 0.0)
    total = e.sum(axis=-1)
    merged_lse = top + np.log(np.where(some, total, 1.0))
    with np.errstate(under="ignore"):
        share = np.where(live, np.exp(np.where(live, lse - merged_lse[..., None], 0.0)), 0.0)
    # o = sum_p pi_p o_p over the live states only (an empty state's o is never read)
    terms = np.where(live[..., None], share[..., None] * np.where(live[..., None], o, 0.0), 0.0)
    merged_o = terms.sum(axis=-2)
    fill = 0.0 if masked_rows == "zeros" else np.nan
    merged_o = np.where(empty[..., None], fill, np.where(poisoned[..., None], np.nan, merged_o))
    merged_lse = np.where(empty, -np.inf, np.where(poisoned, np.nan, merged_lse))
    return merged_o, merged_lse


def _merge_last_vjp(
    o: np.ndarray, lse: np.ndarray, g_o: np.ndarray, g_lse: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """``(d o [..., P, H_v], d lse [..., P])`` of the merge of the ``P`` states on the last axis
    of ``lse [..., P]`` for cotangents ``g_o [..., H_v]``, ``g_lse [...]`` (float64)."""
    live = np.isfinite(lse)
    poisoned = np.isnan(lse).any(axis=-1) | np.isposinf(lse).any(axis=-1)
    merged_o, merged_lse = _merge_last(o, lse, "zeros")
    finite = np.isfinite(merged_lse)
    use = live & finite[..., None]  # a live state of a row that is not empty
    shift = np.where(
        use, np.where(use, lse, 0.0) - np.where(finite, merged_lse, 0.0)[..., None], 0.0
    )
    with np.errstate(under="ignore"):
        share = np.where(use, np.exp(shift), 0.0)
    oo = np.where(use[..., None], o, 0.0)  # an empty state's o (NaN allowed) is never read
    dev = np.where(use, ((oo - merged_o[..., None, :]) * g_o[..., None, :]).sum(axis=-1), 0.0)
    d_o = share[..., None] * g_o[..., None, :]
    d_lse = share * (dev + g_lse[..., None])
    d_o = np.where(poisoned[..., None, None], np.nan, d_o)
    d_lse = np.where(poisoned[..., None], np.nan, d_lse)
    return d_o, d_lse


@doc(STATES, MERGE_RAISES)
def merge_states(
    o_a: Any, lse_a: Any, o_b: Any, lse_b: Any, *, masked_rows: str = "zeros"
) -> tuple[np.ndarray, np.ndarray]:
    """The state of ``A u B`` from the states of disjoint key sets ``A`` and ``B``, in float64.

    ``lse = log(e^{lse_a} + e^{lse_b})``, ``o = e^{lse_a - lse} o_a + e^{lse_b - lse} o_b``
    (module docstring: the empty state is the identity, NaN and ``+inf`` poison the row).

    Returns:
        ``(o [..., H_v], lse [...])`` in float64.
    """
    check_merge(o_a, lse_a, o_b, lse_b, masked_rows)
    return _merge_last(*_stacked(o_a, lse_a, o_b, lse_b), masked_rows)


@doc(STATES)
def merge_states_vjp(
    o_a: Any, lse_a: Any, o_b: Any, lse_b: Any, g_o: Any, g_lse: Any
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The gradient of ``<g_o, o> + <g_lse, lse>`` of :func:`merge_states` with respect to both
    states, float64, by hand (module docstring): 0 for an empty state and an all-empty row; NaN
    where a NaN or ``+inf`` ``lse`` (or, for ``d lse``, a live NaN ``o``) is read.

    Returns:
        ``(d o_a, d lse_a, d o_b, d lse_b)`` in float64, the shapes of the inputs.

    Raises:
        ValueError: If a ``lse`` does not have the shape of its ``o`` without the last axis, or
            the states' or the cotangents' shapes differ from ``o_a``'s and ``lse_a``'s.
        TypeError: If an input is not floating.
    """
    check_merge(o_a, lse_a, o_b, lse_b, "zeros")
    for name, x, like, want in (
        ("g_o", g_o, "o_a", shape_of(o_a)),
        ("g_lse", g_lse, "lse_a", shape_of(lse_a)),
    ):
        if shape_of(x) != want:
            raise ValueError(
                f"{like} has shape {want} but {name} has {shape_of(x)}; they must agree"
            )
        if not is_floating(dtype_of(x)):
            raise TypeError(f"{name} must be floating, got dtype {dtype_of(x)}")
    o, lse = _stacked(o_a, lse_a, o_b, lse_b)
    d_o, d_lse = _merge_last_vjp(o, lse, np.asarray(g_o, np.float64), np.asarray(g_lse, np.float64))
    return d_o[..., 0, :], d_lse[..., 0], d_o[..., 1, :], d_lse[..., 1]


@doc(STATES, STACK_RAISES)
def merge_state_stack(
    o: Any, lse: Any, *, axis: int = 0, masked_rows: str = "zeros"
) -> tuple[np.ndarray, np.ndarray]:
    """The state of the union of ``P`` disjoint key sets, their states stacked along ``axis``,
    in float64: ``lse = log sum_p e^{lse_p}``, ``o = sum_p e^{lse_p - lse} o_p``.

    Returns:
        ``(o, lse)`` with ``axis`` removed, in float64.
    """
    ax = check_stack(o, lse, axis, masked_rows)
    lse64 = np.moveaxis(np.asarray(lse, np.float64), ax, -1)
    o64 = np.moveaxis(np.asarray(o, np.float64), ax, -2)
    return _merge_last(o64, lse64, masked_rows)
