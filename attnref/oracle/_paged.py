"""Oracle twin of :func:`attnref.decode.paged_attention`: attention over a paged KV cache, float64.

From the definition (as vLLM's ``ref_single_query_cached_kv_attention`` reads its cache): token
``j < seq_lens[b]`` of sequence ``b`` is read from page ``block_table[b, j // page_size]`` at
offset ``j % page_size``, no other slot; the ``T`` queries are the sequence's last ``T`` tokens,
so the result is :func:`attnref.oracle.dot_product_attention` on the gathered keys with
``key_value_seq_lengths=seq_lens`` and ``causal_alignment="bottom_right"``. Refusals as the JAX
twin's (the layout, the options it sets, ``masked_rows="uniform"``, lengths and used table
entries out of range). NumPy only.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._checks import dtype_of, shape_of
from ._kernel import dot_product_attention

# The kernel options the paged layout sets itself.
OWN_OPTIONS = ("key_value_seq_lengths", "causal_alignment")


def check_paged_options(options: dict[str, Any], known: tuple[str, ...] | None = None) -> None:
    """The kernel options of a paged call: not those the layout sets (:data:`OWN_OPTIONS`), only
    ``known`` ones (when given), and not ``masked_rows="uniform"``."""
    for name in OWN_OPTIONS:
        if name in options:
            raise TypeError(
                f"paged_attention sets {name} itself (seq_lens, bottom-right positions); "
                f"do not pass {name}"
            )
    unknown = set(options) - set(options if known is None else known)
    if unknown:
        raise TypeError(f"paged_attention got unexpected keyword arguments {sorted(unknown)}")
    if options.get("masked_rows") == "uniform":
        raise ValueError(
            "masked_rows='uniform' is refused by paged_attention: the mean of value over all "
            "S slots would read unused slots and pages; use 'zeros' or 'nan'"
        )


def check_values(block_table: Any, seq_lens: Any, num_pages: int, page_size: int) -> None:
    """Concrete tables and lengths: raise ``ValueError`` naming the row and the value."""
    table, lens = np.asarray(block_table), np.asarray(seq_lens)
    s = table.shape[1] * page_size
    for b, length in enumerate(lens.tolist()):
        if not 0 <= length <= s:
            raise ValueError(
                f"seq_lens[{b}] = {length} is out of range: a sequence holds between 0 and "
                f"max_pages * page_size = {table.shape[1]} * {page_size} = {s} tokens"
            )
        used = -(-length // page_size)
        for p, page in enumerate(table[b, :used].tolist()):
            if not 0 <= page < num_pages:
                raise ValueError(
                    f"block_table[{b}, {p}] = {page} is out of range [0, num_pages={num_pages}) "
                    f"for batch row {b}, which reads page slot {p} (seq_lens[{b}] = {length}, "
                    f"page_size = {page_size}); a page table entry must name a page of k_pages"
                )


def check_layout(
    query: Any, k_pages: Any, v_pages: Any, block_table: Any, seq_lens: Any
) -> tuple[int, int]:
    """Shapes and dtypes of the paged arguments (the kernel checks the rest); returns
    ``(num_pages, page_size)``."""
    for name, x, layout in (
        ("query", query, "[B, T, N, H]"),
        ("k_pages", k_pages, "[num_pages, page_size, K, H]"),
        ("v_pages", v_pages, "[num_pages, page_size, K, H_v]"),
    ):
        if np.ndim(x) != 4:
            raise ValueError(f"{name} must have rank 4 ({layout}), got shape {shape_of(x)}")
    b, _, _, h = shape_of(query)
    num_pages, page_size, kh, hk = shape_of(k_pages)
    if shape_of(v_pages)[:3] != (num_pages, page_size, kh):
        raise ValueError(
            f"v_pages has shape {shape_of(v_pages)}; expected [num_pages={num_pages}, "
            f"page_size={page_size}, K={kh}, H_v] to match k_pages {shape_of(k_pages)}"
        )
    if hk != h:
        raise ValueError(
            f"k_pages has head dim {hk} (shape {shape_of(k_pages)}) but query has {h} "
            f"(shape {shape_of(query)})"
        )
    if page_size < 1:
        raise ValueError(f"k_pages has page_size 0 (shape {shape_of(k_pages)}); it must be >= 1")
    dtypes = {
        n: dtype_of(x) for n, x in (("query", query), ("k_pages", k_pages), ("v_pages", v_pages))
    }
    if len(set(dtypes.values())) != 1:
        raise TypeError(f"query, k_pages and v_pages must share one dtype, got {dtypes}")
    if np.ndim(block_table) != 2 or shape_of(block_table)[0] != b:
        raise ValueError(
            f"block_table has shape {shape_of(block_table)}; expected [B={b}, max_pages]"
        )
    if shape_of(seq_lens) != (b,):
        raise ValueError(f"seq_lens has shape {shape_of(seq_lens)}; expected [B={b}]")
    for name, x in (("block_table", block_table), ("seq_lens", seq_lens)):
        if not np.issubdtype(dtype_of(x), np.integer):
            raise TypeError(f"{name} must be integer, got dtype {dtype_of(x)}")
    if num_pages < 1 and shape_of(block_table)[1] > 0:
        raise ValueError(
            f"k_pages holds no page (shape {shape_of(k_pages)}) but block_table has "
            f"{shape_of(block_table)[1]} page slots per row"
        )
    return num_pages, page_size


def gather_pages(
    pages: Any, block_table: np.ndarray, seq_lens: np.ndarray, page_size: int
) -> np.ndarray:
    """``[B, max_pages page_size, K, d]``, float64: slot ``j < seq_lens[b]`` is
    ``pages[block_table[b, j // page_size], j % page_size]``; every other slot is 0 (unread)."""
    src = np.asarray(pages, np.float64)
    b, max_pages = block_table.shape
    out = np.zeros((b, max_pages * page_size, *src.shape[2:]))
    for row in range(b):
        for j in range(int(seq_lens[row])):
            out[row, j] = src[int(block_table[row, j // page_size]), j % page_size]
    return out


def paged_attention(
    query: Any,
    k_pages: Any,
    v_pages: Any,
    block_table: Any,
    seq_lens: Any,
    bias: Any = None,
    mask: Any = None,
    **options: Any,
) -> Any:
    """Float64 reference for :func:`attnref.decode.paged_attention` (same arguments, same
    refusals): ``dot_product_attention(q, K, V, bias, mask, key_value_seq_lengths=seq_lens,
    causal_alignment="bottom_right", **options)`` on the keys and values read through the page
    table (module docstring); ``options``: the kernel oracle's other keywords.

    Returns:
        float64 ``o [B, T, N, H_v]``, or ``(o, lse)`` with ``return_lse``.

    Raises:
        ValueError: For a bad layout, ``masked_rows="uniform"``, ``seq_lens`` out of range or a
            used table entry out of ``[0, num_pages)``; or the kernel oracle's value errors.
        TypeError: For mismatched dtypes, non-integer tables or lengths, an option the layout
            sets; or the kernel oracle's type errors.
    """
    check_paged_options(options)  # every refusal of the JAX twin
    num_pages, page_size = check_layout(query, k_pages, v_pages, block_table, seq_lens)
    check_values(block_table, seq_lens, num_pages, page_size)
    table, lens = np.asarray(block_table), np.asarray(seq_lens)
    keys, values = (gather_pages(pages, table, lens, page_size) for pages in (k_pages, v_pages))
    return dot_product_attention(
        np.asarray(query, np.float64),
        keys,
        values,
        bias,
        mask,
        key_value_seq_lengths=lens,
        causal_alignment="bottom_right",
        **options,
    )
