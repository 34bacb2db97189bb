"""ALiBi (Press et al. 2022): per-head slopes and the linear distance bias they give, passed to
the kernels as ``bias``."""

from __future__ import annotations

import math
from typing import Any

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float

from attnref._src.formulations.kernel_spec import CAUSAL_ALIGNMENTS, Alignment


def alibi_slopes(num_heads: int) -> np.ndarray:
    """ALiBi head slopes (Press et al. 2022), float64 ``[num_heads]``.

    For ``n`` a power of two, ``m_h = 2^(-8 h / n)``, ``h = 1..n``; otherwise the slopes of the
    closest lower power of two ``c`` followed by every other slope of ``2c`` (the paper's
    reference implementation).

    Args:
        num_heads: The number of query heads ``n``, a positive int.

    Returns:
        A NumPy float64 array ``[num_heads]``, one slope per head (for :func:`alibi_bias`).

    Raises:
        ValueError: If ``num_heads`` is not a positive int.
    """
    if not isinstance(num_heads, (int, np.integer)) or num_heads < 1:
        raise ValueError(f"num_heads must be a positive int, got {num_heads!r}")

    def power_of_two(n: int) -> list[float]:
        return [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]

    c = 2 ** math.floor(math.log2(num_heads))
    slopes = power_of_two(c)
    if c != num_heads:
        slopes += power_of_two(2 * c)[0::2][: num_heads - c]
    return np.asarray(slopes, dtype=np.float64)


def alibi_bias(
    slopes: Float[ArrayLike, " N"],
    t: int,
    s: int,
    *,
    causal_alignment: Alignment = "top_left",
    dtype: Any = jnp.float32,
) -> Float[Array, "1 N T S"]:
    """ALiBi bias ``-m_n |p_i - j|`` with ``p_i = i + offset`` (offset as ``causal_alignment``).

    Under a causal mask this is the paper's ``m_n (j - i)`` on every allowed key; the symmetric
    ``|.|`` extends it to non-causal attention, as FlashAttention does. Pass it as ``bias``.

    Args:
        slopes: Per-head slopes ``[N]`` (:func:`alibi_slopes`).
        t: The number of queries ``T``.
        s: The number of keys ``S``.
        causal_alignment: ``"top_left"`` (default, ``offset = 0``) or ``"bottom_right"``
            (``offset = s - t``, the last query on the last key).
        dtype: The bias dtype (default float32).

    Returns:
        The bias ``[1, N, T, S]`` of ``dtype``, broadcastable to ``[B, N, T, S]`` for
        :func:`dot_product_attention`.

    Raises:
        ValueError: If ``causal_alignment`` is not ``"top_left"`` or ``"bottom_right"``.
    """
    if causal_alignment not in CAUSAL_ALIGNMENTS:
        raise ValueError(
            f"causal_alignment must be one of {CAUSAL_ALIGNMENTS}, got {causal_alignment!r}"
        )
    offset = 0 if causal_alignment == "top_left" else s - t
    dist = jnp.abs(jnp.arange(t)[:, None] + offset - jnp.arange(s)[None, :]).astype(dtype)
    return (-jnp.asarray(slopes, dtype)[:, None, None] * dist)[None]
