"""What a query may not read never reaches its output or its gradients, whatever it holds.

A contraction ``sum_j p_ij v_j`` evaluates ``0 * v_j`` for every key ``j`` that query ``i`` may
not attend to, and IEEE arithmetic makes ``0 * NaN = 0 * inf = NaN``: one poisoned key or value
(padding, a masked slot, a future token) would reach every row, in the forward pass and through
the backward's ``ds_ij k_j`` and ``p_ij do_i`` products. attnref computes each output in two parts:

* the *differentiable* path runs on the finite parts of the inputs (:func:`finite_part`:
  non-finite entries read as 0, with an identity derivative); it is exact for every *clean* row,
  one whose query and allowed keys, values and biases are all finite;
* a *dirty* row (one that may read a non-finite value: its own query, an allowed key, value or
  bias entry) is NaN, with no gradient (:func:`poison_rows`); the definition's value there is
  non-finite too (NaN, or ``+-inf`` when an infinite value is read with a positive weight).

So clean rows (and their gradients) are bit for bit what they would be if the non-finite values
were not there at all, and no row is ever a plausible finite number computed from a value it may
not read.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool


@jax.custom_jvp
def finite_part(x: Array) -> Array:
    """``x`` with NaN and ``+-inf`` entries read as 0; its derivative is the identity."""
    return jnp.where(jnp.isfinite(x), x, jnp.zeros_like(x))


@finite_part.defjvp
def _finite_part_jvp(primals: tuple[Array], tangents: tuple[Array]) -> tuple[Array, Array]:
    (x,), (dx,) = primals, tangents
    return finite_part(x), dx


def nonfinite_rows(x: Array, axis: int = -1) -> Array:
    """True where a row (reduced over ``axis``) holds a NaN or an infinity."""
    return jnp.any(~jnp.isfinite(x), axis=axis)


def poison_rows(dirty: Array, values: Any) -> Any:
    """NaN on the ``dirty`` rows of every leaf of ``values``, unchanged elsewhere.

    A row that reads a non-finite value is non-finite by definition (the float64 oracle gives
    NaN, or ``+-inf`` where an infinite value is read with a positive weight); attnref returns
    NaN there, uniformly, and no gradient (``where`` sends a zero cotangent to those rows). No
    ``lax.cond`` and no second pass: the compiled program, and so its XLA cost, is the finite
    path plus one reduction. Leaves have ``dirty``'s shape plus trailing axes.
    """

    def poison(d: Array) -> Array:
        mask = dirty.reshape(dirty.shape + (1,) * (d.ndim - dirty.ndim))
        return jnp.where(mask, jnp.asarray(jnp.nan, d.dtype), d)

    return jax.tree_util.tree_map(poison, values)


# ----------------------------------------------------------------------------- the weight level
#
# At the weight level every formulation is a function of the token rows ``x_q [..., T_q, d]``,
# ``x_kv [..., T_k, d]`` and the bias ``[..., T_q, T_k]``; the projections mix features, not
# tokens, so a non-finite token row poisons exactly the projected rows of that token. Query row
# ``i`` is *dirty* (:func:`reads_nonfinite`) when it reads a non-finite value through an allowed
# pair; :func:`attnref._src.core.entry.guard` evaluates the formulation once, on the finite
# parts (differentiable, exact for clean rows), and poisons the dirty rows with NaN.


def finite_bias(bias: Array | None) -> Array | None:
    """``bias`` with NaN and ``+inf`` read as 0 (identity derivative elsewhere); ``-inf`` kept.

    ``-inf`` is a masking bias (the pair is not allowed), so it must survive; NaN and ``+inf``
    only matter at allowed pairs, whose rows are dirty and so NaN.
    """
    if bias is None:
        return None
    bad = jnp.logical_or(jnp.isnan(bias), bias == jnp.inf)
    return jnp.where(bad, jnp.zeros_like(bias), bias)


def allowed_pairs(
    mask: Array | None, bias: Array | None, shape: tuple[int, ...]
) -> Bool[Array, "..."]:
    """``mask AND bias != -inf`` broadcast to ``shape`` (all True without mask and bias)."""
    allowed = jnp.ones(shape, bool)
    if mask is not None:
        allowed = jnp.logical_and(allowed, mask)
    if bias is not None:
        allowed = jnp.logical_and(allowed, bias != -jnp.inf)
    return allowed


def reads_nonfinite(
    allowed: Bool[Array, "... T_q T_k"],
    query_bad: Bool[Array, "... T_q"],
    key_bad: Bool[Array, "... T_k"],
    bias: Array | None = None,
    residual: bool = False,
) -> Bool[Array, "... T_q"]:
    """Dirty query rows: ``dirty_i = (query_bad_i AND (residual OR any_j allowed_ij)) OR
    any_j (allowed_ij AND key_bad_j) OR any_j (allowed_ij AND bias_ij in {NaN, +inf})``.

    ``query_bad`` / ``key_bad`` say which query / key-value rows hold a non-finite entry; all
    arguments broadcast against each other (batch and head axes in front).
    """
    live = jnp.any(allowed, axis=-1)
    own = query_bad if residual else jnp.logical_and(query_bad, live)
    reads = jnp.any(jnp.logical_and(allowed, key_bad[..., None, :]), axis=-1)
    dirty = jnp.logical_or(own, reads)
    if bias is not None:
        bad_bias = jnp.logical_and(allowed, ~jnp.isfinite(bias))  # -inf is never allowed
        dirty = jnp.logical_or(dirty, jnp.any(bad_bias, axis=-1))
    return dirty
