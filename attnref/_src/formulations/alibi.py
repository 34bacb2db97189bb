"""ALiBi (Press et al. 2022) as FlashAttention's ``alibi_slopes`` use it: per-head or per-(batch,
head) slopes and the linear distance bias they give, passed to the kernels as ``bias``."""

from __future__ import annotations

import math
from typing import Any

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float, Int

from attnref._src.core.checked import require
from attnref._src.core.checks import check_ints, in_x64_if_float64
from attnref._src.core.entry import compiled
from attnref._src.formulations.kernel_spec import Alignment
from attnref.oracle._alibi import check_alibi


def alibi(
    slopes: Float[Array, "Bm N"], offset: Int[Array, " Bo"], t: int, s: int
) -> Float[Array, "B N T S"]:
    """``bias[b, n, i, j] = -m[b, n] |i + offset[b] - j|`` (``Bm``, ``Bo`` are ``B`` or 1)."""
    p = jnp.arange(t)[None, :, None] + offset[:, None, None]  # p_i = i + offset_b  [Bo, T, 1]
    distance = jnp.abs(p - jnp.arange(s)[None, None, :]).astype(slopes.dtype)  # [Bo, T, S]
    return -slopes[:, :, None, None] * distance[:, None]  # [B, N, T, S]


def alibi_slopes(num_heads: int) -> np.ndarray:
    """ALiBi head slopes (Press et al. 2022): ``m_h = 2^(-8 h / n)``, ``h = 1..n``, for ``n`` a
    power of two; otherwise those of the closest lower power of two ``c`` followed by every other
    slope of ``2c`` (the paper's reference implementation).

    Args:
        num_heads: The number of query heads ``n``, a positive int.

    Returns:
        A NumPy float64 array ``[num_heads]``, one slope per head (for :func:`alibi_bias`).

    Raises:
        ValueError: If ``num_heads`` is not a positive int.
    """
    if not isinstance(num_heads, (int, np.integer)) or num_heads < 1:
        raise ValueError(f"num_heads must be a positive int, got {num_heads!r}")

    c = 2 ** math.floor(math.log2(num_heads))
    slopes = [2.0 ** (-8.0 * (i + 1) / c) for i in range(c)]
    # every other slope of 2c: i = 0, 2, ..., 2 (num_heads - c) - 2
    slopes += [2.0 ** (-8.0 * (i + 1) / (2 * c)) for i in range(0, 2 * (num_heads - c), 2)]
    return np.asarray(slopes, dtype=np.float64)


def alibi_bias(
    slopes: Float[ArrayLike, " N"] | Float[ArrayLike, "B N"],
    t: int,
    s: int,
    *,
    causal_alignment: Alignment = "top_left",
    query_seq_lengths: Int[ArrayLike, " B"] | None = None,
    key_value_seq_lengths: Int[ArrayLike, " B"] | None = None,
    dtype: Any = jnp.float32,
) -> Float[Array, "B N T S"]:
    """ALiBi bias ``bias[b, n, i, j] = -m[b, n] |p_i - j|``, ``p_i = i + offset_b``
    (FlashAttention's ``-alibi_slope * |i + seqlen_k - seqlen_q - j|`` under bottom-right
    alignment); under a causal mask the paper's ``m (j - p_i)``, the symmetric ``|.|`` extending
    it to non-causal attention. Pass it as ``bias`` with the same lengths and alignment.

    Args:
        slopes: Slopes per head ``[N]`` (:func:`alibi_slopes`), or per batch element and head
            ``[B, N]``.
        t: The number of queries ``T``.
        s: The number of keys ``S``.
        causal_alignment: ``"top_left"`` (default, ``offset = 0``) or ``"bottom_right"``
            (``offset = S_b - T_b`` from the lengths: the last valid query on the last valid key).
        query_seq_lengths: Optional integer ``[B]`` in ``[0, t]`` (``T_b``, default ``t``), as
            given to the kernel.
        key_value_seq_lengths: Optional integer ``[B]`` in ``[0, s]`` (``S_b``, default ``s``).
        dtype: The bias dtype (default float32).

    Returns:
        The bias of ``dtype``, ``[1, N, T, S]`` when nothing is per batch element, else
        ``[B, N, T, S]`` (slopes ``[B, N]`` or any lengths given): broadcastable to
        ``[B, N, T, S]`` for :func:`dot_product_attention`. Under ``jax.jit`` (lengths traced)
        a batch element with a length out of range gets a NaN bias, and
        :func:`attnref.checked` raises instead.

    Raises:
        ValueError: If ``causal_alignment`` is unknown, ``t``/``s`` are not ints ``>= 0``,
            ``slopes`` is not ``[N]`` or ``[B, N]``, a lengths array is not ``[B]``, the batch
            sizes disagree, or (concrete) lengths are out of range.
        TypeError: If ``slopes`` is not real, the lengths are not integer, or ``dtype`` is not
            a floating dtype.
    """
    _, q_len, kv_len = check_alibi(
        slopes, t, s, causal_alignment, query_seq_lengths, key_value_seq_lengths, check_ints
    )
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"dtype must be a floating dtype, got {dtype!r}")
    args = (slopes, t, s, causal_alignment, q_len, kv_len, dtype)
    return in_x64_if_float64(dtype, compiled, _bias, *args)


def _bias(
    slopes: Any, t: int, s: int, alignment: str, q_len: Any, kv_len: Any, dtype: Any
) -> Array:
    """:func:`alibi` on validated arguments; NaN for a batch element whose traced lengths are
    out of range (eager calls raised already)."""
    m = jnp.atleast_2d(jnp.asarray(slopes, dtype))  # [B or 1, N]
    rows = max([m.shape[0]] + [x.shape[0] for x in (q_len, kv_len) if x is not None])
    offset = jnp.zeros((rows,), jnp.int32)
    if alignment == "bottom_right":  # S_b - T_b
        offset += (s if kv_len is None else kv_len) - (t if q_len is None else q_len)
    bias = alibi(m, offset, t, s)
    if q_len is None and kv_len is None:
        return bias
    ok = jnp.ones((rows,), bool)
    for lens, upper in ((q_len, t), (kv_len, s)):
        if lens is not None:
            ok = ok & (lens >= 0) & (lens <= upper)
    require(
        ok,
        f"query_seq_lengths must lie in [0, t={t}] and key_value_seq_lengths in [0, s={s}]; "
        "batch element {b} is out of range",
        b=jnp.argmin(ok),
    )
    return jnp.where(ok[:, None, None, None], bias, jnp.asarray(jnp.nan, dtype))
