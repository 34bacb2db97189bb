"""Boolean attention masks (``True`` = the query may attend to the key) and additive biases.

Row convention: masks broadcast to ``[..., T_q, T_k]``, entry ``[i, j]`` for query ``i``, key
``j`` (the column form uses the transpose). A bias entry of ``-inf`` masks like ``False``; a
fully masked row gives zero weights (``docs/conventions.md``).
"""

from __future__ import annotations

import functools
from typing import Any

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Float, Int

from attnref._src.core.checks import device_array
from attnref._src.core.entry import compiled


def causal_mask(t_q: int, t_k: int | None = None) -> Bool[Array, "T_q T_k"]:
    """Top-left aligned causal mask (query 0 sees key 0, as ``jax.nn`` and PyTorch): query ``i``
    may attend to key ``j`` iff ``j <= i``.

    Args:
        t_q: The number of queries ``T_q``, positive.
        t_k: The number of keys ``T_k``, positive; ``None`` (default) means ``t_q``.

    Returns:
        A boolean mask ``[T_q, T_k]`` (lower-triangular), broadcastable to
        ``[..., T_q, T_k]``.

    Raises:
        ValueError: If ``t_q`` or ``t_k`` is less than 1.
    """
    t_k = t_q if t_k is None else t_k
    if t_q < 1 or t_k < 1:
        raise ValueError(f"causal_mask needs positive lengths, got t_q={t_q}, t_k={t_k}")
    return device_array(np.tril(np.ones((t_q, t_k), dtype=bool)))


def padding_mask(lengths: Int[ArrayLike, " B"], t_k: int) -> Bool[Array, "B 1 T_k"]:
    """Key-padding mask from per-batch valid lengths: key ``j`` is visible iff ``j < lengths[b]``.

    Args:
        lengths: Integer valid lengths ``[B]``, one per batch element.
        t_k: The number of keys ``T_k``.

    Returns:
        A boolean mask ``[B, 1, T_k]``, which broadcasts against ``[B, T_q, T_k]``.

    Raises:
        ValueError: If ``lengths`` is not 1-D.
        TypeError: If ``lengths`` is not integer.
    """
    lens = device_array(lengths)
    if lens.ndim != 1:
        raise ValueError(f"lengths must have shape [B], got shape {tuple(lens.shape)}")
    if not jnp.issubdtype(lens.dtype, jnp.integer):
        raise TypeError(f"lengths must be integers, got dtype {lens.dtype}")
    return compiled(_padding, lens, t_k)  # type: ignore[no-any-return]


def _padding(lengths: Int[Array, " B"], t_k: int) -> Bool[Array, "B 1 T_k"]:
    return (jnp.arange(t_k)[None, :] < lengths[:, None])[:, None, :]


def combine_masks(*masks: Bool[ArrayLike, "..."] | None) -> Bool[Array, "..."] | None:
    """Logical AND of masks (``None`` entries are ignored; all ``None`` gives ``None``).

    Args:
        *masks: Boolean masks (broadcast against each other) or ``None``.

    Returns:
        The broadcast AND of the given masks, or ``None`` when none is given.

    Raises:
        TypeError: If a mask is not boolean.
    """
    present = [device_array(m) for m in masks if m is not None]
    for m in present:
        if m.dtype != jnp.bool_:
            raise TypeError(f"combine_masks takes boolean masks, got dtype {m.dtype}")
    return compiled(_conjunction, present) if present else None  # type: ignore[no-any-return]


def _conjunction(masks: list[Array]) -> Array:
    return functools.reduce(jnp.logical_and, masks)


def mask_to_bias(mask: Bool[ArrayLike, "..."], dtype: object = jnp.float32) -> Float[Array, "..."]:
    """Additive form of a boolean mask: ``0`` where allowed, ``-inf`` where masked.

    Args:
        mask: A boolean mask, any shape, ``True`` = may attend.
        dtype: The bias dtype (default float32).

    Returns:
        A bias of ``mask``'s shape and ``dtype``, to pass as ``bias=``.

    Raises:
        TypeError: If ``mask`` is not boolean.
    """
    m = device_array(mask)
    if m.dtype != jnp.bool_:
        raise TypeError(f"mask must be boolean, got dtype {m.dtype}")
    return compiled(_additive, m, dtype)  # type: ignore[no-any-return]


def _additive(mask: Bool[Array, "..."], dtype: Any) -> Float[Array, "..."]:
    return jnp.where(mask, jnp.zeros((), dtype), jnp.full((), -jnp.inf, dtype))
