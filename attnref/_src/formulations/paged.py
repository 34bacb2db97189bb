"""Attention over a paged KV cache (the vLLM / FlashInfer / FlashAttention ``block_table`` layout).

``query [B, T, N, H]``; pages ``k_pages [P, page_size, K, H]``, ``v_pages [P, page_size, K,
H_v]``; ``block_table [B, max_pages]`` lists each sequence's pages in order and ``seq_lens [B]``
counts its tokens, the ``T`` new queries' own keys included (vLLM's ``seq_lens``). The queries
are the last ``T`` tokens (bottom-right alignment: ``p_i = seq_lens[b] - T + i``). By
definition the result is the kernel on the gathered keys::

    K[b, j] = k_pages[block_table[b, j // page_size], j % page_size]   (j < S = max_pages page)
    o = dot_product_attention(q, K, V, key_value_seq_lengths=seq_lens,
                              causal_alignment="bottom_right")

Unused slots and table entries may hold anything (NaN, ``-1``): they are never read. A used
entry outside ``[0, P)`` or ``seq_lens[b]`` outside ``[0, S]`` raises ``ValueError`` eagerly,
gives NaN rows under ``jax.jit`` and raises under :func:`attnref.checked`. :func:`paged_kv_append`
writes new keys and values through the table; :func:`paged_cost` counts FLOPs and KV bytes
(``docs/paged.md``).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Float, Int

from attnref._src.core.checked import require
from attnref._src.core.checks import device_array, dtype_of, float64_scoped, is_traced, shape_of
from attnref._src.core.entry import Level, compiled, public
from attnref._src.formulations.kernel import dot_product_attention
from attnref.oracle._paged import OWN_OPTIONS, check_layout, check_paged_options, check_values

# ----------------------------------------------------------------------------- the formula


def paged(
    query: Float[Array, "B T N H"],
    k_pages: Float[Array, "P page K H"],
    v_pages: Float[Array, "P page K H_v"],
    block_table: Int[Array, "B max_pages"],
    seq_lens: Int[Array, " B"],
    bias: Any,
    mask: Any,
    options: dict[str, Any],
) -> Any:
    """``K[b, j] = k_pages[block_table[b, j // page], j % page]`` (and ``V``), then the kernel
    with ``key_value_seq_lengths=seq_lens`` and bottom-right positions: ``o`` or ``(o, lse)``."""
    b = block_table.shape[0]
    pages = jnp.clip(block_table, 0, k_pages.shape[0] - 1)  # unused entries: any page, never read
    k = k_pages[pages].reshape(b, -1, *k_pages.shape[2:])  #   K  [B, S = max_pages page, K, H]
    v = v_pages[pages].reshape(b, -1, *v_pages.shape[2:])  #   V  [B, S, K, H_v]
    return dot_product_attention(
        query,
        k,
        v,
        bias,
        mask,
        key_value_seq_lengths=seq_lens,
        causal_alignment="bottom_right",
        **options,
    )


def paged_append(
    k_pages: Float[Array, "P page K H"],
    v_pages: Float[Array, "P page K H_v"],
    block_table: Int[Array, "B max_pages"],
    seq_lens: Int[Array, " B"],
    k: Float[Array, "B T K H"],
    v: Float[Array, "B T K H_v"],
) -> tuple[Float[Array, "P page K H"], Float[Array, "P page K H_v"]]:
    """Token ``t`` of row ``b`` goes to position ``p = seq_lens[b] + t``: page
    ``block_table[b, p // page]``, slot ``p % page``; a page id outside ``[0, P)`` (or a
    position past the table) is dropped, never wrapped."""
    num_pages, page = k_pages.shape[:2]
    pos = seq_lens[:, None] + jnp.arange(k.shape[1])[None, :]  #            p  [B, T]
    slot = jnp.clip(pos // page, 0, block_table.shape[1] - 1)
    ids = jnp.take_along_axis(block_table, slot, axis=1)  #     block_table[b, p // page]  [B, T]
    inside = (ids >= 0) & (ids < num_pages) & (pos >= 0) & (pos < block_table.shape[1] * page)
    ids = jnp.where(inside, ids, num_pages)  # out of range: dropped by the scatter
    k_pages = k_pages.at[ids, pos % page].set(k, mode="drop")
    v_pages = v_pages.at[ids, pos % page].set(v, mode="drop")
    return k_pages, v_pages


# ----------------------------------------------------------------------------- the call


def bad_pages(
    block_table: Array, seq_lens: Array, num_pages: int, page_size: int
) -> Bool[Array, "B max_pages"]:
    """Used page slots (``p page_size < seq_lens[b]``) whose entry lies outside
    ``[0, num_pages)``."""
    used = jnp.arange(block_table.shape[1])[None, :] * page_size < seq_lens[:, None]
    return used & ((block_table < 0) | (block_table >= num_pages))


@jax.tree_util.register_dataclass  # a pytree: entry.compiled traces its arrays
@dataclasses.dataclass(frozen=True)
class PagedCall:
    """One validated call: the arrays, the kernel's options and the pool's ``(num_pages,
    page_size)``; which batch rows are valid is computed inside the compiled program."""

    args: tuple[Any, ...]  # query, k_pages, v_pages, block_table, seq_lens, bias, mask
    options: dict[str, Any]
    num_pages: int
    page_size: int

    def run(self, formula: Any) -> Any:
        """``formula(*args, options)``, ``seq_lens`` clamped to ``[0, S]`` for the gather only: a
        bad length's rows are NaN (:meth:`dirty_rows`), and the kernel never sees it."""
        args = list(self.args)
        args[4] = jnp.clip(args[4], 0, args[3].shape[1] * self.page_size)
        return formula(*args, self.options)

    def dirty_rows(self) -> Bool[Array, "B T N"]:
        """Every row of a batch element whose table or length is out of range (NaN); traced
        values are checked by :func:`require` (eager calls have raised in NumPy)."""
        table, lens = self.args[3], self.args[4]
        s = table.shape[1] * self.page_size
        bad = bad_pages(table, lens, self.num_pages, self.page_size)
        pages_ok, lens_ok = ~jnp.any(bad, axis=1), (lens >= 0) & (lens <= s)
        require(
            lens_ok,
            f"seq_lens must lie in [0, max_pages * page_size = {s}]; batch row {{b}} has "
            "seq_lens = {value}",
            b=jnp.argmin(lens_ok),
            value=lens[jnp.argmin(lens_ok)],
        )
        b = jnp.argmin(pages_ok)  # the first row with a bad used entry, and its page slot
        slot = jnp.argmax(bad[b])
        require(
            pages_ok,
            f"block_table entries of used pages must lie in [0, num_pages={self.num_pages}); "
            "batch row {b} reads page slot {slot}, whose entry is {value}",
            b=b,
            slot=slot,
            value=table[b, slot],
        )
        ok = jnp.logical_and(pages_ok, lens_ok)
        return jnp.broadcast_to(~ok[:, None, None], self.args[0].shape[:3])


def prepare_paged(
    query: Float[ArrayLike, "B T N H"],
    k_pages: Float[ArrayLike, "P page K H"],
    v_pages: Float[ArrayLike, "P page K H_v"],
    block_table: Int[ArrayLike, "B max_pages"],
    seq_lens: Int[ArrayLike, " B"],
    bias: Float[ArrayLike, "#B #N #T #S"] | None = None,
    mask: Bool[ArrayLike, "#B #N #T #S"] | None = None,
    **options: Any,
) -> PagedCall:
    """Validate a paged call (its signature is :data:`SIGNATURE`): the layout, the options the
    layout sets (refused), ``masked_rows="uniform"`` (refused: it would average every slot,
    unused ones included), and the table and lengths (eagerly, or by :func:`require`)."""
    check_paged_options(options, KERNEL_OPTIONS)
    num_pages, page_size = check_layout(query, k_pages, v_pages, block_table, seq_lens)
    if not is_traced(block_table, seq_lens):
        check_values(block_table, seq_lens, num_pages, page_size)
    table, lens = device_array(block_table, jnp.int32), device_array(seq_lens, jnp.int32)
    arrays = (device_array(query), device_array(k_pages), device_array(v_pages), table, lens)
    return PagedCall((*arrays, bias, mask), options, num_pages, page_size)


# The kernel's keyword options, read from its signature (so options added to the kernel, such
# as sinks, are forwarded here unchanged), minus those the paged layout sets.
_KERNEL_PARAMS = inspect.signature(dot_product_attention).parameters
KERNEL_OPTIONS = tuple(
    name
    for name, p in _KERNEL_PARAMS.items()
    if p.kind is p.KEYWORD_ONLY and name not in OWN_OPTIONS
)
_OWN = list(inspect.signature(prepare_paged).parameters.values())[:7]
SIGNATURE = inspect.Signature(
    [*_OWN, *(_KERNEL_PARAMS[name] for name in KERNEL_OPTIONS)], return_annotation="Any"
)
prepare_paged.__signature__ = SIGNATURE  # type: ignore[attr-defined]

PAGED_ARGS = """Args:
    query: ``[B, T, N, H]``, floating: the last ``T`` tokens of each sequence (``T = 1``:
        decoding; ``T > 1``: chunked prefill).
    k_pages: ``[num_pages, page_size, K, H]``, the dtype of ``query``; ``N`` a multiple of ``K``.
    v_pages: ``[num_pages, page_size, K, H_v]``, the dtype of ``query``.
    block_table: Integer ``[B, max_pages]``: sequence ``b``'s token ``j`` lives in page
        ``block_table[b, j // page_size]`` at offset ``j % page_size``. Entries of unused page
        slots (``p * page_size >= seq_lens[b]``) are never read and may be anything.
    seq_lens: Integer ``[B]`` in ``[0, max_pages * page_size]``: the tokens of each sequence,
        the ``T`` queries' own included (query ``i`` sits at position ``seq_lens[b] - T + i``).
    bias: Floating, rank 4, broadcastable to ``[B, N, T, S]`` (``S = max_pages * page_size``,
        indexed by absolute key position); ``None`` (default) adds nothing.
    mask: Boolean, rank 4, broadcastable to ``[B, N, T, S]``, ``True`` = may attend.
    **options: Every keyword option of :func:`attnref.dot_product_attention` (``scale``,
        ``is_causal``, ``local_window_size``, ``softcap``, ``masked_rows``, ``return_lse``,
        ...) but ``key_value_seq_lengths`` and ``causal_alignment``, which the layout sets;
        ``masked_rows="uniform"`` is refused (it would average unused slots).

Raises:
    ValueError: If the shapes disagree (``k_pages``/``v_pages`` not rank 4 or not matching,
        head dims, ``block_table`` not ``[B, max_pages]``, ``seq_lens`` not ``[B]``,
        ``page_size = 0``), ``masked_rows="uniform"``, or, eagerly, ``seq_lens[b]`` is out of
        range or a used ``block_table`` entry lies outside ``[0, num_pages)`` (the message names
        the row and the value); or for the errors of :func:`attnref.dot_product_attention`.
    TypeError: If the dtypes of ``query``, ``k_pages``, ``v_pages`` differ, ``block_table`` or
        ``seq_lens`` is not integer, ``key_value_seq_lengths`` or ``causal_alignment`` is
        passed, or an option is unknown; or for the type errors of the kernel."""

paged_attention = public(
    Level(prepare_paged, PAGED_ARGS),
    paged,
    name="paged_attention",
    summary=(
        "Attention of ``query`` over a paged KV cache: the kernel on the keys gathered through "
        "``block_table``.\n\n"
        "``o = dot_product_attention(q, K, V, key_value_seq_lengths=seq_lens, "
        'causal_alignment="bottom_right")``\nwith ``K[b, j] = k_pages[block_table[b, j // '
        "page_size], j % page_size]`` (module docstring of\n"
        "``attnref._src.formulations.paged`` and ``docs/paged.md``)."
    ),
    returns=(
        "``o [B, T, N, H_v]`` in the dtype of ``query``, or ``(o, lse)`` with ``lse [B, T, N]`` "
        "when\n    ``return_lse``; NaN on every row of a batch element whose used table entries "
        "or length\n    are out of range (under ``jax.jit``; :func:`attnref.checked` raises)."
    ),
)


# ----------------------------------------------------------------------------- appending


@float64_scoped
def paged_kv_append(
    k_pages: Float[ArrayLike, "P page K H"],
    v_pages: Float[ArrayLike, "P page K H_v"],
    block_table: Int[ArrayLike, "B max_pages"],
    seq_lens: Int[ArrayLike, " B"],
    k: Float[ArrayLike, "B T K H"],
    v: Float[ArrayLike, "B T K H_v"],
) -> tuple[Array, Array, Array]:
    """Write ``T`` new tokens per sequence through the page table, nothing else: token ``t`` of
    row ``b`` goes to position ``p = seq_lens[b] + t``, page ``block_table[b, p // page_size]``,
    slot ``p % page_size`` (as FlashAttention's ``flash_attn_with_kvcache`` at
    ``cache_seqlens``); rows whose tables name one page write it in an unspecified order.

    Args:
        k_pages: ``[num_pages, page_size, K, H]``, the key pool.
        v_pages: ``[num_pages, page_size, K, H_v]``, the value pool.
        block_table: Integer ``[B, max_pages]``.
        seq_lens: Integer ``[B]``: the tokens each sequence holds before the append.
        k: ``[B, T, K, H]``, the dtype of ``k_pages``: the new keys.
        v: ``[B, T, K, H_v]``, the dtype of ``k_pages``: the new values.

    Returns:
        ``(k_pages, v_pages, seq_lens + T)``. Under ``jax.jit`` a row whose chunk does not fit
        (``seq_lens[b] + T > max_pages * page_size``, ``seq_lens[b] < 0``) or whose written
        table entries lie outside ``[0, num_pages)`` writes nothing and gets the length ``-1``,
        which :func:`paged_attention` turns into NaN rows; under :func:`attnref.checked` it
        raises.

    Raises:
        ValueError: If the shapes disagree, or, eagerly, a chunk does not fit or a written table
            entry is out of range (the message names the row, the slot and the value).
        TypeError: If the dtypes differ or ``block_table``/``seq_lens`` are not integer.
    """
    t = check_chunk(k_pages, v_pages, block_table, seq_lens, k, v)
    num_pages, page_size = shape_of(k_pages)[:2]
    room = shape_of(block_table)[1] * page_size
    if not is_traced(block_table, seq_lens):
        for b, length in enumerate(np.asarray(seq_lens).tolist()):
            if not 0 <= length <= room - t:
                raise ValueError(
                    f"seq_lens[{b}] = {length}: a chunk of T={t} tokens does not fit (the table "
                    f"holds max_pages * page_size = {room} tokens per row)"
                )
        try:
            check_values(block_table, np.asarray(seq_lens) + t, num_pages, page_size)
        except ValueError as e:
            raise ValueError(f"paged_kv_append (seq_lens counted after the append): {e}") from None
    table, lens = device_array(block_table, jnp.int32), device_array(seq_lens, jnp.int32)
    arrays = (device_array(k_pages), device_array(v_pages), table, lens, device_array(k))
    return compiled(_append, *arrays, device_array(v), num_pages)  # type: ignore[no-any-return]


def _append(
    k_pages: Array,
    v_pages: Array,
    table: Array,
    lens: Array,
    k: Array,
    v: Array,
    num_pages: int,
) -> tuple[Array, Array, Array]:
    """:func:`paged_kv_append` on validated arrays; a row whose chunk does not fit (traced
    lengths: eager calls have raised) writes nothing and gets the length ``-1``."""
    page_size, t, room = k_pages.shape[1], k.shape[1], table.shape[1] * k_pages.shape[1]
    ok = ~jnp.any(bad_pages(table, lens + t, num_pages, page_size), axis=1)
    ok &= (lens >= 0) & (lens + t <= room)
    require(
        ok,
        f"paged_kv_append: batch row {{b}} cannot take {t} tokens (seq_lens = {{value}}, room "
        f"for {room}, pages in [0, {num_pages}))",
        b=jnp.argmin(ok),
        value=lens[jnp.argmin(ok)],
    )
    safe = jnp.where(ok, lens, -(t + room))  # every position < 0: dropped
    kp, vp = paged_append(k_pages, v_pages, table, safe, k, v)
    return kp, vp, jnp.where(ok, lens + t, -1)


def check_chunk(k_pages: Any, v_pages: Any, block_table: Any, seq_lens: Any, k: Any, v: Any) -> int:
    """Shapes and dtypes of an append; returns ``T``."""
    if np.ndim(k) != 4 or np.ndim(v) != 4:
        raise ValueError(
            f"k and v must be [B, T, K, H] and [B, T, K, H_v], got {shape_of(k)} and {shape_of(v)}"
        )
    b, t, kh, h = shape_of(k)
    query = np.zeros((b, t, kh, h), dtype_of(k))  # a stand-in with k's shape for check_layout
    check_layout(query, k_pages, v_pages, block_table, seq_lens)
    if shape_of(k)[2:] != shape_of(k_pages)[2:]:
        raise ValueError(f"k has shape {shape_of(k)}; expected [B, T, {shape_of(k_pages)[2:]}]")
    if shape_of(v) != (b, t, *shape_of(v_pages)[2:]):
        raise ValueError(f"v has shape {shape_of(v)}; expected [B={b}, T={t}, K, H_v] of v_pages")
    if dtype_of(v) != dtype_of(k):
        raise TypeError(f"k and v must share one dtype, got {dtype_of(k)} and {dtype_of(v)}")
    return t


# ----------------------------------------------------------------------------- cost


@dataclasses.dataclass(frozen=True)
class PagedCost:
    """Work and traffic of one paged call (``S = max_pages * page_size``, ``D = H + H_v``).

    Attributes:
        matmul_flops: ``2 B N T S D``: this reference's (the kernel on all ``S`` gathered
            slots; XLA's dot count, exactly).
        useful_flops: ``2 N T D sum_b seq_lens[b]``: a kernel that skips unread slots.
        kv_bytes_read: ``K D itemsize sum_b seq_lens[b]``: the slots the definition reads.
        page_bytes_read: ``page_size K D itemsize sum_b ceil(seq_lens[b] / page_size)``: whole
            pages, for a kernel that loads a page at a time.
        gathered_bytes: ``B S K D itemsize``: the contiguous copy this reference materialises.
        table_bytes: ``4 B (max_pages + 1)``: the int32 table and lengths.
    """

    matmul_flops: int
    useful_flops: int
    kv_bytes_read: int
    page_bytes_read: int
    gathered_bytes: int
    table_bytes: int


def paged_cost(
    *,
    batch: int,
    t: int,
    heads: int,
    kv_heads: int,
    d_k: int,
    d_v: int,
    page_size: int,
    max_pages: int,
    seq_lens: Any = None,
    itemsize: int = 4,
) -> PagedCost:
    """:class:`PagedCost` of a paged call; ``seq_lens`` (``[B]`` ints; ``None``: every sequence
    full, ``S`` tokens) sets the read counts."""
    s = max_pages * page_size
    lens = np.full(batch, s) if seq_lens is None else np.asarray(seq_lens, np.int64)
    d = d_k + d_v
    tokens = int(lens.sum())
    pages = int((-(-lens // page_size)).sum())
    return PagedCost(
        matmul_flops=2 * batch * heads * t * s * d,
        useful_flops=2 * heads * t * tokens * d,
        kv_bytes_read=tokens * kv_heads * d * itemsize,
        page_bytes_read=pages * page_size * kv_heads * d * itemsize,
        gathered_bytes=batch * s * kv_heads * d * itemsize,
        table_bytes=4 * batch * (max_pages + 1),
    )
