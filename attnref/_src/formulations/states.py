"""The attention state algebra: a partial result over a key subset is a state ``(o, lse)``.

For one query row and allowed keys ``A``: ``o_A = sum_{j in A} p_j v_j``, ``p_j = exp(s_j -
lse_A)``, ``lse_A = log sum_{j in A} exp(s_j)``. For disjoint ``A`` and ``B``::

    lse = log(exp(lse_A) + exp(lse_B))            = m + log(w_A + w_B)
    o   = (exp(lse_A) o_A + exp(lse_B) o_B) / exp(lse)   = (w_A o_A + w_B o_B) / (w_A + w_B)

with ``m = max(lse_A, lse_B)`` and ``w = exp(lse - m)``, so no ``exp`` overflows (the larger
weight is exactly 1) and the result is the state of ``A u B`` (Milakov & Gimelshein 2018; the
merge of Flash-Decoding's split-KV decoding, Dao et al. 2023, and of FlashInfer's
``merge_state``). The merge is commutative and associative, and the empty state ``lse = -inf``
(any ``o``) is its identity.

A NaN or ``+inf`` ``lse`` (a row that read a non-finite value) makes the merge NaN; an empty
state's ``o`` is never read (NaN included), and a finite-``lse`` state with NaN ``o`` stays NaN.
All states empty: ``lse = -inf`` and ``o`` per ``masked_rows``, ``"zeros"`` or ``"nan"``
(``"uniform"``, the mean over *all* keys, is not a function of the states: the caller fills it,
as :mod:`attnref.distributed` does).

Shapes: ``o [..., H_v]``, ``lse [...]``. Arithmetic in ``promote(o, lse, float32)`` (16-bit
states merge in float32, as kernels keep their accumulators); ``o`` and ``lse`` are returned in
their own dtypes.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float

from attnref._src.core.checks import dtype_of, float64_scoped
from attnref._src.core.entry import compiled
from attnref.oracle._doc import MERGE_RAISES, STACK_RAISES, STATES, doc
from attnref.oracle._states import check_merge, check_stack

BOTH_EMPTY = '``o`` of a row where both states are empty: ``"zeros"`` (default) or ``"nan"``.'


def _compute_dtype(*xs: Any) -> Any:
    return jnp.promote_types(jnp.result_type(*(dtype_of(x) for x in xs)), jnp.float32)


def _finish(
    o: Array, lse: Array, m: Array, masked_rows: str, o_dtype: Any, l_dtype: Any
) -> tuple[Array, Array]:
    """The empty (``m = -inf``) and poisoned (``m`` NaN or ``+inf``) rows, then the casts."""
    empty = jnp.isneginf(m)
    bad = ~(jnp.isfinite(m) | empty)
    fill = 0.0 if masked_rows == "zeros" else jnp.nan
    o = jnp.where(empty[..., None], fill, jnp.where(bad[..., None], jnp.nan, o))
    lse = jnp.where(empty, -jnp.inf, jnp.where(bad, jnp.nan, lse))
    return o.astype(o_dtype), lse.astype(l_dtype)


def merge_pair(o_a: Any, lse_a: Any, o_b: Any, lse_b: Any, masked_rows: str) -> tuple[Array, Array]:
    """:func:`merge_states` on validated inputs: ``m = max(lse_a, lse_b)``, ``w = exp(lse - m)``,
    ``lse = m + log1p(min(w_a, w_b))``, ``o = (w_a o_a + w_b o_b) / (w_a + w_b)``."""
    cd = _compute_dtype(o_a, lse_a, o_b, lse_b)
    la, lb = jnp.asarray(lse_a, cd), jnp.asarray(lse_b, cd)
    m = jnp.maximum(la, lb)  # NaN propagates
    ok = jnp.isfinite(m)
    m_safe = jnp.where(ok, m, 0.0)
    # exp(lse - m) with the empty state's -inf giving exactly 0 (and a zero derivative).
    wa, wb = (jnp.exp(jnp.where(ok, x, -jnp.inf) - m_safe) for x in (la, lb))
    total = wa + wb  # in [1, 2] on finite rows (the larger weight is exactly 1)
    total_safe = jnp.where(ok, total, 1.0)
    oa = jnp.where(jnp.isneginf(la)[..., None], 0.0, jnp.asarray(o_a, cd))
    ob = jnp.where(jnp.isneginf(lb)[..., None], 0.0, jnp.asarray(o_b, cd))
    o = (wa[..., None] * oa + wb[..., None] * ob) / total_safe[..., None]
    lse = m_safe + jnp.log1p(jnp.where(ok, jnp.minimum(wa, wb), 0.0))
    o_dtype, l_dtype = (
        jnp.result_type(dtype_of(a), dtype_of(b)) for a, b in ((o_a, o_b), (lse_a, lse_b))
    )
    return _finish(o, lse, m, masked_rows, o_dtype, l_dtype)


def merge_stack(o: Any, lse: Any, ax: int, masked_rows: str) -> tuple[Array, Array]:
    """:func:`merge_state_stack` on validated inputs (``ax`` non-negative): ``m = max_p lse_p``,
    ``w_p = exp(lse_p - m)``, ``lse = m + log(sum_p w_p)``, ``o = sum_p w_p o_p / sum_p w_p``."""
    cd = _compute_dtype(o, lse)
    ls, os_ = jnp.asarray(lse, cd), jnp.asarray(o, cd)
    if ls.shape[ax] == 0:
        m = jnp.full(ls.shape[:ax] + ls.shape[ax + 1 :], -jnp.inf, cd)
    else:
        m = jnp.max(ls, axis=ax)  # NaN propagates
    ok = jnp.isfinite(m)
    m_safe = jnp.where(ok, m, 0.0)
    ok_e, m_e = jnp.expand_dims(ok, ax), jnp.expand_dims(m_safe, ax)
    w = jnp.exp(jnp.where(ok_e, ls, -jnp.inf) - m_e)
    total = jnp.sum(w, axis=ax)  # >= 1 on finite rows
    total_safe = jnp.where(ok, total, 1.0)
    oo = jnp.where(jnp.isneginf(ls)[..., None], 0.0, os_)
    merged = jnp.sum(w[..., None] * oo, axis=ax) / total_safe[..., None]
    lse_out = m_safe + jnp.log(total_safe)
    return _finish(merged, lse_out, m, masked_rows, dtype_of(o), dtype_of(lse))


@float64_scoped
@doc(STATES, MERGE_RAISES, masked_rows=BOTH_EMPTY)
def merge_states(
    o_a: Float[ArrayLike, "*rows H_v"],
    lse_a: Float[ArrayLike, "*rows"],
    o_b: Float[ArrayLike, "*rows H_v"],
    lse_b: Float[ArrayLike, "*rows"],
    *,
    masked_rows: str = "zeros",
) -> tuple[Float[Array, "*rows H_v"], Float[Array, "*rows"]]:
    """The state of ``A u B`` from the states of disjoint key sets ``A`` and ``B``.

    ``lse = m + log1p(exp(-|lse_a - lse_b|))``, ``o = (w_a o_a + w_b o_b) / (w_a + w_b)`` with
    ``m = max(lse_a, lse_b)`` and ``w = exp(lse - m)``: stable for any finite ``lse`` (``|lse|``
    of 1e4 and beyond), with ``lse = -inf`` the identity (its ``o`` is never read).

    Returns:
        ``(o, lse)``: ``o`` in the dtype of ``o_a`` and ``o_b`` (promoted), ``lse`` in the dtype
        of ``lse_a`` and ``lse_b``; NaN where either ``lse`` is NaN or ``+inf``.
    """
    check_merge(o_a, lse_a, o_b, lse_b, masked_rows)
    return compiled(merge_pair, o_a, lse_a, o_b, lse_b, masked_rows)  # type: ignore[no-any-return]


@float64_scoped
@doc(STATES, STACK_RAISES)
def merge_state_stack(
    o: Float[ArrayLike, "*rows H_v"],
    lse: Float[ArrayLike, "*rows"],
    *,
    axis: int = 0,
    masked_rows: str = "zeros",
) -> tuple[Float[Array, "*merged H_v"], Float[Array, "*merged"]]:
    """The state of the union of ``P`` disjoint key sets, their states stacked along ``axis``.

    ``lse = m + log(sum_p w_p)``, ``o = sum_p w_p o_p / sum_p w_p`` with ``m = max_p lse_p`` and
    ``w_p = exp(lse_p - m)`` (the n-ary form of :func:`merge_states`, one pass, no overflow).

    Returns:
        ``(o, lse)`` with ``axis`` removed, in the dtypes of the inputs; NaN where any ``lse``
        is NaN or ``+inf``.
    """
    ax = check_stack(o, lse, axis, masked_rows)
    return compiled(merge_stack, o, lse, ax, masked_rows)  # type: ignore[no-any-return]
