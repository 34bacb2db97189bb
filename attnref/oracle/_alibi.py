"""Oracle twin of ALiBi (Press et al. 2022): slopes and the distance bias in float64 NumPy."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ._checks import check_alignment, shape_of


def alibi_slopes(num_heads: int) -> np.ndarray:
    """Press et al. (2022): geometric slopes starting at ``2^(-8/n)`` with ratio ``2^(-8/n)``
    for ``n`` a power of two; otherwise those of the largest power of two ``c < n``, then the
    odd-indexed slopes of ``2c``.

    Args:
        num_heads: The number of heads ``n``, a positive int.

    Returns:
        float64 slopes ``[num_heads]``.

    Raises:
        ValueError: If ``num_heads`` is not a positive int.
    """
    if not isinstance(num_heads, (int, np.integer)) or num_heads < 1:
        raise ValueError(f"num_heads must be a positive int, got {num_heads!r}")

    def geometric(n: int) -> list[float]:
        start = 2.0 ** (-(2.0 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(num_heads).is_integer():
        return np.array(geometric(int(num_heads)))
    c = 2 ** math.floor(math.log2(num_heads))
    extra = geometric(2 * c)[0::2][: num_heads - c]
    return np.array(geometric(c) + extra)


def alibi_bias(slopes: Any, t: int, s: int, *, causal_alignment: str = "top_left") -> np.ndarray:
    """``bias[0, n, i, j] = -slopes[n] * |i + offset - j|`` in float64.

    Args:
        slopes: Per-head slopes ``[N]``.
        t: The number of queries ``T``, an int ``>= 0``.
        s: The number of keys ``S``, an int ``>= 0``.
        causal_alignment: ``"top_left"`` (default, ``offset = 0``) or ``"bottom_right"``
            (``offset = s - t``).

    Returns:
        float64 bias ``[1, N, T, S]``.

    Raises:
        ValueError: If ``causal_alignment`` is unknown, ``t``/``s`` are not ints ``>= 0``, or
            ``slopes`` is not 1-D.
    """
    check_alignment(causal_alignment)
    for name, size in (("t", t), ("s", s)):
        if not isinstance(size, (int, np.integer)) or isinstance(size, bool) or size < 0:
            raise ValueError(f"{name} must be an int >= 0, got {size!r}")
    if np.ndim(slopes) != 1:
        raise ValueError(f"slopes must have shape [N], got shape {shape_of(slopes)}")
    offset = 0 if causal_alignment == "top_left" else s - t
    distance = np.abs(np.arange(t)[:, None] + offset - np.arange(s)[None, :]).astype(np.float64)
    m = np.asarray(slopes, dtype=np.float64)
    # one product per entry, as -m * |i + offset - j| written entry by entry
    return (-m[:, None, None] * distance)[None]
