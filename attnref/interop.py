"""Converters between attnref's per-head weights and the fused layouts of Flax, PyTorch and HF.

attnref stores per head ``w_q: [H, d_model, d_k]``, ``w_k: [K, d_model, d_k]``, ``w_v: [K,
d_model, d_v]``, ``w_o: [H, d_v, d_model]`` (row vectors, ``y = x W``). Flax's
``MultiHeadDotProductAttention`` uses ``DenseGeneral`` kernels ``[d_model, H, d_head]`` and
``[H, d_v, d_model]``; PyTorch's ``nn.MultiheadAttention`` and Hugging Face BERT store fused
``[out, in]`` matrices (``y = x W^T``). :func:`repeat_kv_heads` expands grouped
key/value heads (GQA) to one per query head.
"""

from attnref._src.core.convert import (
    from_flax,
    from_hf_bert,
    from_torch_mha,
    to_flax,
    to_hf_bert,
    to_torch_mha,
)
from attnref._src.core.params import repeat_kv_heads

__all__ = [
    "from_flax",
    "from_hf_bert",
    "from_torch_mha",
    "repeat_kv_heads",
    "to_flax",
    "to_hf_bert",
    "to_torch_mha",
]
