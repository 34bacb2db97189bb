"""PyTorch attention functions for the kit's ``torch`` signature (``tests/test_torch_signature.py``,
``scripts/clients.py``): torch's SDPA on its math backend, a hand-written kernel, and copies of it
each with one planted bug. Imports torch: import this module only where torch is installed.

Every function takes torch SDPA's arguments, ``q [B, N, T, H]``, ``k [B, K, S, H]``,
``v [B, K, S, H_v]``, ``attn_mask`` (boolean, ``True`` = may attend, or an additive float),
``is_causal`` (top-left), ``scale``, ``enable_gqa``, and returns ``[B, N, T, H_v]``.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def sdpa_math(q: Any, k: Any, v: Any, **kw: Any) -> Any:
    """``F.scaled_dot_product_attention`` on the math backend (the reference implementation)."""
    with sdpa_kernel([SDPBackend.MATH]):
        return F.scaled_dot_product_attention(q, k, v, **kw)


def sdpa_flash(q: Any, k: Any, v: Any, **kw: Any) -> Any:
    """``F.scaled_dot_product_attention`` on the flash backend (on the CPU: its C++ flash
    kernel, where this build has one)."""
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        return F.scaled_dot_product_attention(q, k, v, **kw)


def attention(
    q: Any,
    k: Any,
    v: Any,
    attn_mask: Any = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    bug: str | None = None,
) -> Any:
    """``softmax(q k^T * scale + mask) v`` row-wise, computed in float32 (float64 for float64
    inputs), the output cast to the input dtype; a row with no allowed key returns zeros (as
    torch's SDPA). ``bug`` plants one fault: ``"scale"`` (``1/H`` for ``1/sqrt(H)``),
    ``"causal"`` (the causal mask one key too wide: query ``i`` reads key ``i + 1``), or
    ``"grad"`` (the softmax's denominator detached: the output is right, its gradient wrong)."""
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    if enable_gqa:
        g = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    if scale is None:
        scale = 1 / (q.shape[-1] if bug == "scale" else math.sqrt(q.shape[-1]))
    s = (q.to(work) @ k.to(work).transpose(-1, -2)) * scale  # [B, N, T, S]
    t_len, s_len = s.shape[-2:]
    allowed = torch.ones(t_len, s_len, dtype=torch.bool)
    if is_causal:
        allowed = allowed.tril(1 if bug == "causal" else 0)
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        allowed = allowed & attn_mask
    elif attn_mask is not None:
        s = s + attn_mask.to(work)
    s = s.masked_fill(~allowed, -math.inf)
    m = s.amax(-1, keepdim=True).clamp_min(torch.finfo(work).min)  # finite in a row of -inf
    p = torch.exp(s - m)
    denom = p.sum(-1, keepdim=True)
    if bug == "grad":
        denom = denom.detach()
    out = (p @ v.to(work)) / torch.where(denom == 0, 1.0, denom)
    return out.to(q.dtype)


wrong_scale = functools.partial(attention, bug="scale")
causal_off_by_one = functools.partial(attention, bug="causal")
detached_denominator = functools.partial(attention, bug="grad")


def transposed_output(q: Any, k: Any, v: Any, **kw: Any) -> Any:
    """The right values in the kit's layout ``[B, T, N, H_v]`` instead of torch's."""
    return attention(q, k, v, **kw).transpose(1, 2)
