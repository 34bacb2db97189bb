"""The masked, max-subtracted ("safe") softmax every formulation shares.

``softmax(s)_j = m_j exp(s_j - c) / sum_k m_k exp(s_k - c)`` with ``c`` the largest *allowed*
logit; entries with ``m_j = False`` or ``s_j = -inf`` are excluded. A slice with no allowed entry
returns all zeros (never NaN) and a finite, zero gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float

from attnref._src.core.entry import compiled


def allowed_entries(
    logits: Float[Array, "..."], mask: Bool[ArrayLike, "..."] | None
) -> Bool[Array, "..."]:
    """Entries that take part in the softmax: allowed by ``mask`` and not ``-inf``."""
    allowed = logits != -jnp.inf
    if mask is not None:
        allowed = jnp.logical_and(allowed, mask)
    return allowed


def masked_softmax(
    logits: Float[Array, "..."], mask: Bool[ArrayLike, "..."] | None = None, *, axis: int = -1
) -> Float[Array, "..."]:
    """Safe softmax along ``axis``; fully masked slices give zeros.

    ``axis=-1`` is the row-stochastic convention (rows are queries); ``axis=-2`` gives the
    column-stochastic matrix of the column form. Masked entries never enter ``exp``, so large or
    non-finite logits there cannot turn into NaN in the value or in the gradient.

    Args:
        logits: Floating logits, any shape; ``-inf`` entries are excluded like masked ones.
        mask: Boolean, broadcastable to ``logits``, ``True`` = the entry takes part; ``None``
            (default) allows every entry.
        axis: The axis to normalise over (default -1).

    Returns:
        Weights of ``logits``' shape: along ``axis`` they sum to 1 over the allowed entries, or
        are all zero where no entry is allowed.
    """
    return compiled(safe_softmax, logits, mask, axis)  # type: ignore[no-any-return]


def safe_softmax(logits: Array, mask: Array | None, axis: int) -> Array:
    """:func:`masked_softmax`: the largest allowed logit subtracted, masked entries never in
    ``exp``, a slice with no allowed entry all zeros."""
    allowed = allowed_entries(logits, mask)
    any_allowed = jnp.any(allowed, axis=axis, keepdims=True)
    top = jnp.max(jnp.where(allowed, logits, -jnp.inf), axis=axis, keepdims=True, initial=-jnp.inf)
    top = jax.lax.stop_gradient(jnp.where(any_allowed, top, jnp.zeros_like(top)))
    shifted = jnp.where(allowed, logits - top, jnp.zeros_like(logits))
    e = jnp.where(allowed, jnp.exp(shifted), jnp.zeros_like(logits))
    denom = jnp.sum(e, axis=axis, keepdims=True)
    return e / jnp.where(any_allowed, denom, jnp.ones_like(denom))
