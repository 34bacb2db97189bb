"""Multi-head latent attention (DeepSeek-V2, arXiv:2405.04434): two forms and the latent cache.

``c^KV = x W_DKV`` is cached (with the shared rotated key part ``k^R = RoPE(x W_KR)``:
``d_c + d_rope`` numbers per token); :func:`mla_attention` decompresses it into per-head keys
``[c^KV W_UK[i] ; k^R]`` and values ``c^KV W_UV[i]``; :func:`mla_absorbed_attention` absorbs
``W_UK`` into the queries and ``W_UV`` into the output and attends to the cache itself. The
``*_cache_attention`` twins take the cache instead of tokens (decoding). The cost model counts
both forms' FLOPs and cache bytes. See ``docs/mla.md``.
"""

from attnref._src.formulations.mla import (
    mla_absorbed_attention,
    mla_absorbed_cache_attention,
    mla_attention,
    mla_cache_attention,
    mla_latent_cache,
)
from attnref._src.formulations.mla_family import (
    DEEPSEEK_DEFAULTS,
    MLACost,
    MLAParams,
    init_mla_params,
    mla_cost,
    mla_cost_table,
    mla_crossover,
    to_attention_params,
)

__all__ = [
    "DEEPSEEK_DEFAULTS",
    "MLACost",
    "MLAParams",
    "init_mla_params",
    "mla_absorbed_attention",
    "mla_absorbed_cache_attention",
    "mla_attention",
    "mla_cache_attention",
    "mla_cost",
    "mla_cost_table",
    "mla_crossover",
    "mla_latent_cache",
    "to_attention_params",
]
