"""KV-cached decoding: a cache pytree, chunked appends, ring buffers and ``lax.scan`` generation.

Kernel level (``q, k, v`` as ``[B, L, H, d]``): :func:`kv_cache_init`, :func:`kv_cache_append`,
:func:`cached_attention` (append a chunk, then attend) and :func:`cache_attend` (read only).
Weight level (``params`` and row-vector tokens ``[B, L, d_model]``): :func:`init_cache`,
:func:`step` (one chunk), :func:`scan` (token by token under ``lax.scan``), :func:`generate`,
and :func:`decode_attention` (the multi-head row form of a whole sequence, decoded).
Paged KV cache (vLLM / FlashInfer layout): :func:`paged_attention`, :func:`paged_kv_append`
(write a chunk through the page table) and the cost model :func:`paged_cost` (``docs/paged.md``).
"""

from attnref._src.formulations.decode import (
    cache_attend,
    cached_attention,
    generate,
    kv_cache_append,
    scan,
    step,
)
from attnref._src.formulations.decode_cache import KVCache, init_cache, kv_cache_init
from attnref._src.formulations.kernel_forms import decode_attention
from attnref._src.formulations.paged import (
    PagedCost,
    paged_attention,
    paged_cost,
    paged_kv_append,
)

__all__ = [
    "KVCache",
    "PagedCost",
    "cache_attend",
    "cached_attention",
    "decode_attention",
    "generate",
    "init_cache",
    "kv_cache_append",
    "kv_cache_init",
    "paged_attention",
    "paged_cost",
    "paged_kv_append",
    "scan",
    "step",
]
