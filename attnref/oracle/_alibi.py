"""Oracle twin of ALiBi (Press et al. 2022): slopes and the distance bias in float64 NumPy.

The bias follows FlashAttention's ``alibi_slopes``: slopes per head ``[N]`` or per batch element
and head ``[B, N]``, and a query position ``p_i = i + offset_b`` on the key axis, where under
``"bottom_right"`` the offset comes from each sequence's actual lengths, ``S_b - T_b``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from ._checks import check_alignment, check_ints, dtype_of, is_floating, is_integer, shape_of


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


def check_alibi(
    slopes: Any,
    t: Any,
    s: Any,
    causal_alignment: Any,
    query_seq_lengths: Any,
    key_value_seq_lengths: Any,
    check: Callable[..., Any] = check_ints,
) -> tuple[int | None, Any, Any]:
    """The checks of an ALiBi bias (JAX and oracle alike); returns ``(B or None, q_len,
    kv_len)``, the lengths checked (and converted) by ``check(name, x, shape, upper)``."""
    check_alignment(causal_alignment)
    for name, size in (("t", t), ("s", s)):
        if not isinstance(size, (int, np.integer)) or isinstance(size, bool) or size < 0:
            raise ValueError(f"{name} must be an int >= 0, got {size!r}")
    if np.ndim(slopes) not in (1, 2):
        raise ValueError(f"slopes must have shape [N] or [B, N], got shape {shape_of(slopes)}")
    dt = dtype_of(slopes)
    if not (is_floating(dt) or is_integer(dt)):
        raise TypeError(f"slopes must be real, got dtype {dt}")
    lengths = (
        ("query_seq_lengths", query_seq_lengths, t),
        ("key_value_seq_lengths", key_value_seq_lengths, s),
    )
    # the batch size B the arguments agree on (None: nothing is per batch element)
    shape = shape_of(slopes)
    sources = [(f"slopes [B, N] = {shape}", shape[0])] if len(shape) == 2 else []
    for name, lens, _ in lengths:
        if lens is None:
            continue
        if np.ndim(lens) != 1:
            raise ValueError(f"{name} must have shape [B], got shape {shape_of(lens)}")
        sources.append((f"{name} [B] = {shape_of(lens)}", shape_of(lens)[0]))
    if any(size != sources[0][1] for _, size in sources):
        raise ValueError(
            "the batch size B disagrees between " + " and ".join(text for text, _ in sources)
        )
    b = sources[0][1] if sources else None
    q_len, kv_len = (check(name, lens, (b or 0,), upper) for name, lens, upper in lengths)
    return b, q_len, kv_len


def alibi_bias(
    slopes: Any,
    t: int,
    s: int,
    *,
    causal_alignment: str = "top_left",
    query_seq_lengths: Any = None,
    key_value_seq_lengths: Any = None,
) -> np.ndarray:
    """``bias[b, n, i, j] = -slopes[b, n] * |i + offset_b - j|`` in float64.

    FlashAttention's ``-alibi_slope * |i + seqlen_k - seqlen_q - j|`` under ``"bottom_right"``;
    a slope ``[N]`` is shared by every batch element.

    Args:
        slopes: Slopes per head ``[N]``, or per batch element and head ``[B, N]``; real.
        t: The number of queries ``T``, an int ``>= 0``.
        s: The number of keys ``S``, an int ``>= 0``.
        causal_alignment: ``"top_left"`` (default, ``offset = 0``) or ``"bottom_right"``
            (``offset = S_b - T_b``, the last valid query on the last valid key).
        query_seq_lengths: Optional integer ``[B]`` in ``[0, t]`` (as for the kernel).
        key_value_seq_lengths: Optional integer ``[B]`` in ``[0, s]`` (as for the kernel).

    Returns:
        float64 bias ``[1, N, T, S]`` when nothing is per batch element, else ``[B, N, T, S]``
        (slopes ``[B, N]`` or any lengths given).

    Raises:
        ValueError: If ``causal_alignment`` is unknown, ``t``/``s`` are not ints ``>= 0``,
            ``slopes`` is not ``[N]`` or ``[B, N]``, a lengths array is not ``[B]``, the batch
            sizes disagree, or a length is out of range.
        TypeError: If ``slopes`` is not real or a lengths array is not integer.
    """
    b, q_len, kv_len = check_alibi(
        slopes, t, s, causal_alignment, query_seq_lengths, key_value_seq_lengths
    )

    m = np.asarray(slopes, dtype=np.float64)
    m = m[None] if m.ndim == 1 else m  # [B or 1, N]
    rows = 1 if b is None else b
    offset = np.zeros(rows, dtype=np.int64)  # offset_b, [B or 1]
    if causal_alignment == "bottom_right":
        t_b = np.full(rows, t) if q_len is None else q_len
        s_b = np.full(rows, s) if kv_len is None else kv_len
        offset = s_b - t_b
    positions = np.arange(t)[None, :, None] + offset[:, None, None]  # p_i = i + offset_b
    distance = np.abs(positions - np.arange(s)[None, None, :]).astype(np.float64)  # [B or 1, T, S]
    # one product per entry, -m[b, n] * |p_i - j|, as FlashAttention writes it
    return -m[:, :, None, None] * distance[:, None]
