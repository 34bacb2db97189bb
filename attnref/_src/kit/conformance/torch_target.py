"""The conformance kit's ``"torch"`` adapter, with the conventions of
:func:`torch.nn.functional.scaled_dot_product_attention`.

``fn(query, key, value, attn_mask=None, is_causal=False, scale=None, enable_gqa=False)``, CPU
tensors ``query [B, N, T, H]``, ``key [B, K, S, H]``, ``value [B, K, S, H_v]``, returning ``[B,
N, T, H_v]`` (or a tuple whose first item is). ``attn_mask`` is boolean (``True``: may attend)
or an additive float; the kit passes a mask, a bias or ``is_causal``, one at a time, each keyword
only when used (``enable_gqa=True`` when ``N != K``). Gradients by autograd; no lse.

The kit's NumPy ``[B, T, N, H]`` arrays are transposed to torch's layout and back; bfloat16 goes
through float32 both ways (torch cannot read ml_dtypes' bfloat16; nothing is rounded).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np

from attnref import strategies as ast

# The kit's options this adapter can pass (the others are features the signature refuses).
TORCH_OPTIONS = ("mask", "bias", "is_causal", "scale")


def require_torch() -> Any:
    """The ``torch`` module, or an ``ImportError`` saying how to install it."""
    try:
        import torch
    except ImportError as exc:
        raise ImportError(
            "signature 'torch' needs PyTorch, which is not installed: pip install 'attnref[torch]' "
            "(or pip install torch)"
        ) from exc
    return torch


def to_torch(x: Any, layout: bool = False) -> Any:
    """A NumPy array as a CPU tensor of its dtype; ``layout``: ``[B, T, N, H] -> [B, N, T, H]``."""
    torch = require_torch()
    a = np.asarray(x)
    if layout:
        a = np.transpose(a, (0, 2, 1, 3))
    if a.dtype == np.dtype(ml_dtypes.bfloat16):
        return torch.from_numpy(np.ascontiguousarray(a, np.float32)).to(torch.bfloat16)
    return torch.from_numpy(np.array(a, copy=True, order="C"))


def from_torch(t: Any, what: str) -> Any:
    """A tensor as a NumPy array; anything else as :func:`numpy.asarray` reads it."""
    torch = require_torch()
    if not isinstance(t, torch.Tensor):
        return np.asarray(t) if t is not None else t
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return np.asarray(t.float().numpy()).astype(ml_dtypes.bfloat16)
    if not (t.dtype.is_floating_point or t.dtype == torch.bool):
        raise AssertionError(f"fn returned a {t.dtype} tensor for its {what}; expected floats")
    return np.asarray(t.numpy())


def torch_kwargs(p: ast.KernelProblem) -> dict[str, Any]:
    """``fn``'s keyword arguments for ``p``, each only when used."""
    unknown = sorted(set(p.options) - set(TORCH_OPTIONS))
    given = [k for k in ("mask", "bias", "is_causal") if k in p.options]
    if unknown or len(given) > 1:  # the torch features draw no such problem
        raise ValueError(
            f"signature 'torch' passes one of mask, bias and is_causal, and no other option; "
            f"got options {sorted(p.options)}"
        )
    kw: dict[str, Any] = {}
    if "bias" in p.options:
        kw["attn_mask"] = to_torch(p.options["bias"])
    elif "mask" in p.options:
        kw["attn_mask"] = to_torch(np.asarray(p.options["mask"], bool))
    elif p.options.get("is_causal", False):
        kw["is_causal"] = True
    if "scale" in p.options:
        kw["scale"] = float(p.options["scale"])
    if p.config.n != p.config.k:
        kw["enable_gqa"] = True
    return kw


def _output(result: Any, p: ast.KernelProblem) -> Any:
    """``fn``'s output tensor (a tuple's first item), checked to be ``[B, N, T, H_v]``."""
    torch = require_torch()
    out = result[0] if isinstance(result, (tuple, list)) else result
    c = p.config
    want = (c.b, c.n, c.t, c.h_v)
    if not isinstance(out, torch.Tensor):
        raise AssertionError(
            f"fn returned {type(out).__name__}; expected a torch.Tensor [B, N, T, H_v] = {want}"
        )
    if tuple(out.shape) != want:
        raise AssertionError(
            f"fn returned its output with shape {tuple(out.shape)}; expected torch's layout "
            f"[B, N, T, H_v] = {want}"
        )
    return out


def torch_forward(fn: Callable[..., Any], p: ast.KernelProblem) -> np.ndarray:
    """``fn``'s output for ``p`` as NumPy ``[B, T, N, H_v]`` in its own dtype."""
    torch = require_torch()
    with torch.no_grad():
        out = _output(
            fn(to_torch(p.q, True), to_torch(p.k, True), to_torch(p.v, True), **torch_kwargs(p)), p
        )
    return np.transpose(from_torch(out, "output [B, N, T, H_v]"), (0, 2, 1, 3))


def torch_vjp(
    fn: Callable[..., Any], p: ast.KernelProblem, cotangent: np.ndarray
) -> tuple[np.ndarray, ...]:
    """Gradients of ``<fn(q, k, v), cotangent>`` by autograd, NumPy ``[B, T, N, H]`` (zeros for
    an unread input)."""
    leaves = [to_torch(x, True).requires_grad_(True) for x in (p.q, p.k, p.v)]
    out = _output(fn(*leaves, **torch_kwargs(p)), p)
    cot = to_torch(np.asarray(cotangent), True).to(out.dtype)
    out.backward(cot)
    grads = []
    for leaf in leaves:
        g = leaf.grad if leaf.grad is not None else leaf.detach() * 0
        grads.append(np.transpose(from_torch(g, "gradient"), (0, 2, 1, 3)))
    return tuple(grads)
