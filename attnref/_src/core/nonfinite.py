"""What a query may not read never reaches its output or its gradients, whatever it holds.

IEEE makes ``0 * NaN = NaN``, so one poisoned key or value would reach every row of ``p @ v``.
The differentiable path runs on the finite parts of the inputs (:func:`finite_part`), exact for
every clean row; a *dirty* row (one that reads a non-finite query, allowed key, value or bias) is
NaN with no gradient (:func:`poison_rows`), as the definition is non-finite there. See
``docs/kernel.md``.
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
    """NaN on the ``dirty`` rows of every leaf of ``values`` (``dirty``'s shape plus trailing
    axes), with no gradient there; unchanged elsewhere."""

    def poison(d: Array) -> Array:
        mask = dirty.reshape(dirty.shape + (1,) * (d.ndim - dirty.ndim))
        return jnp.where(mask, jnp.asarray(jnp.nan, d.dtype), d)

    return jax.tree_util.tree_map(poison, values)


# ----------------------------------------------------------------------------- the weight level
#
# The projections mix features, not tokens: a non-finite token row poisons exactly its own rows.


def finite_bias(bias: Array | None) -> Array | None:
    """``bias`` with NaN and ``+inf`` read as 0; ``-inf`` (a masking bias) kept."""
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
    any_j (allowed_ij AND key_bad_j) OR any_j (allowed_ij AND bias_ij in {NaN, +inf})``; all
    arguments broadcast against each other."""
    live = jnp.any(allowed, axis=-1)
    own = query_bad if residual else jnp.logical_and(query_bad, live)
    reads = jnp.any(jnp.logical_and(allowed, key_bad[..., None, :]), axis=-1)
    dirty = jnp.logical_or(own, reads)
    if bias is not None:
        bad_bias = jnp.logical_and(allowed, ~jnp.isfinite(bias))  # -inf is never allowed
        dirty = jnp.logical_or(dirty, jnp.any(bad_bias, axis=-1))
    return dirty
