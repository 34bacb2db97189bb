"""Converters between attnref's per-head weights and the fused layouts of Flax, PyTorch and HF
(``docs/conventions.md``). Each ``to_*`` validates ``params`` and takes multi-head params only
(``K == H``; convert :func:`repeat_kv_heads` of grouped ones, else ``ValueError``); each
``from_*`` returns multi-head :class:`AttentionParams` of NumPy arrays (``KeyError`` for a
missing entry).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from attnref._src.core.checks import BIAS_FIELDS, check_params
from attnref._src.core.params import AttentionParams


def _require_mha(params: AttentionParams, layout: str) -> None:
    """Fused layouts store one K/V head per query head; refuse grouped/multi-query params."""
    check_params(params)
    if params.num_kv_heads != params.num_heads:
        raise ValueError(
            f"{layout} has no grouped-query layout: params have num_heads={params.num_heads} "
            f"but num_kv_heads={params.num_kv_heads} (params.w_k has shape "
            f"{tuple(np.shape(params.w_k))}); convert attnref.interop.repeat_kv_heads(params), the "
            "equivalent multi-head parameters, instead"
        )


def _require(d: Mapping[str, Any], key: str, layout: str) -> np.ndarray:
    if key not in d:
        raise KeyError(f"{layout} weights are missing {key!r}; got keys {sorted(d)}")
    return np.asarray(d[key])


def to_flax(params: AttentionParams) -> dict[str, dict[str, np.ndarray]]:
    """Flax ``MultiHeadDotProductAttention`` params (``DenseGeneral`` kernels):
    ``query/key/value``: ``kernel [d_model, H, d_head]``, ``bias [H, d_head]``; ``out``:
    ``kernel [H, d_v, d_model]``, ``bias [d_model]``, as NumPy; a ``"bias"`` entry only where
    ``params`` has that bias."""
    _require_mha(params, "Flax MultiHeadDotProductAttention")
    out: dict[str, dict[str, np.ndarray]] = {}
    for name, w, b in (
        ("query", params.w_q, params.b_q),
        ("key", params.w_k, params.b_k),
        ("value", params.w_v, params.b_v),
        ("out", params.w_o, params.b_o),
    ):
        w = np.asarray(w)
        out[name] = {"kernel": w if name == "out" else np.transpose(w, (1, 0, 2))}
        if b is not None:
            out[name]["bias"] = np.asarray(b)
    return out


def from_flax(tree: Mapping[str, Mapping[str, Any]]) -> AttentionParams:
    """Inverse of :func:`to_flax`: ``tree`` (Flax's nested ``params`` dict for the module) has
    ``"query"``, ``"key"``, ``"value"``, ``"out"``, each with a rank-3 ``"kernel"`` (else
    ``ValueError``) and an optional ``"bias"`` (``None`` when missing)."""
    names = ("query", "key", "value", "out")
    for key in names:
        if key not in tree:
            raise KeyError(f"Flax attention params are missing {key!r}; got keys {sorted(tree)}")

    def kernel(name: str) -> np.ndarray:
        k = _require(tree[name], "kernel", f"Flax {name}")
        if k.ndim != 3:
            raise ValueError(f"Flax {name}.kernel must have rank 3, got shape {k.shape}")
        return k if name == "out" else np.transpose(k, (1, 0, 2))

    def bias(name: str) -> np.ndarray | None:
        return np.asarray(tree[name]["bias"]) if "bias" in tree[name] else None

    return AttentionParams(*map(kernel, names), *map(bias, names))


def _heads_to_out_in(w: Any) -> np.ndarray:
    """``[H, d_in, d_head] -> [H*d_head, d_in]`` (PyTorch's (out, in), head-major out rows)."""
    h, d_in, d_head = np.shape(w)
    return np.transpose(np.asarray(w), (0, 2, 1)).reshape(h * d_head, d_in)


def _out_in_to_heads(w: np.ndarray, num_heads: int, name: str) -> np.ndarray:
    out, d_in = w.shape
    if out % num_heads:
        raise ValueError(f"{name} has {out} output rows, not divisible by num_heads={num_heads}")
    return np.transpose(w.reshape(num_heads, out // num_heads, d_in), (0, 2, 1))


def _linears(params: AttentionParams) -> dict[str, np.ndarray]:
    """``nn.Linear``'s layout by field name: weights ``(out, in)`` (``W_O [H, d_v, d_model] ->
    [d_model, H d_v]``), biases flat. A layout that stores all biases or none gets explicit zeros
    for the absent ones: the function is unchanged (a zero bias adds nothing), only the
    None-ness is lost."""
    sd = {n: _heads_to_out_in(getattr(params, n)) for n in ("w_q", "w_k", "w_v")}
    sd["w_o"] = np.transpose(np.asarray(params.w_o).reshape(-1, params.d_model))
    if params.has_bias:
        h, d_model, d_k, d_v = params.num_heads, params.d_model, params.d_k, params.d_v
        shapes = ((h, d_k), (h, d_k), (h, d_v), (d_model,))  # b_q, b_k, b_v, b_o
        for n, shape in zip(BIAS_FIELDS, shapes, strict=True):
            b = getattr(params, n)
            sd[n] = (np.zeros(shape, params.dtype) if b is None else np.asarray(b)).reshape(-1)
    return sd


def to_torch_mha(params: AttentionParams) -> dict[str, np.ndarray]:
    """PyTorch ``nn.MultiheadAttention`` state dict, NumPy, (out, in): ``{"in_proj_weight":
    [3E, E], "out_proj.weight": [E, E]}`` (``E = d_model``), plus ``"in_proj_bias" [3E]`` and
    ``"out_proj.bias" [E]`` when any bias is present (absent ones written as zeros: PyTorch has
    all biases or none). The packed layout needs ``d_k == d_v == d_model / H``, else
    ``ValueError``."""
    _require_mha(params, "PyTorch nn.MultiheadAttention")
    h, d_model, d_k, d_v = params.num_heads, params.d_model, params.d_k, params.d_v
    if not (d_k == d_v and h * d_k == d_model):
        raise ValueError(
            "nn.MultiheadAttention packs q, k, v with head_dim = embed_dim / num_heads; got "
            f"H={h}, d_model={d_model}, d_k={d_k}, d_v={d_v}"
        )
    lin = _linears(params)
    sd = {"in_proj_weight": np.concatenate([lin["w_q"], lin["w_k"], lin["w_v"]])}
    sd["out_proj.weight"] = lin["w_o"]
    if params.has_bias:
        sd["in_proj_bias"] = np.concatenate([lin["b_q"], lin["b_k"], lin["b_v"]])
        sd["out_proj.bias"] = lin["b_o"]
    return sd


def from_torch_mha(state_dict: Mapping[str, Any], num_heads: int) -> AttentionParams:
    """Inverse of :func:`to_torch_mha` (``d_k = d_v = E / H``): ``state_dict`` holds
    ``in_proj_weight [3E, E]``, ``out_proj.weight [E, E]`` and optionally ``in_proj_bias [3E]``
    with ``out_proj.bias [E]`` (biases only then); ``num_heads``, not recorded there, must
    divide ``E`` (else ``ValueError``, as for an ``in_proj_weight`` that is not ``[3E, E]``)."""
    w_in = _require(state_dict, "in_proj_weight", "nn.MultiheadAttention")
    w_out = _require(state_dict, "out_proj.weight", "nn.MultiheadAttention")
    if w_in.ndim != 2 or w_in.shape[0] != 3 * w_in.shape[1]:
        raise ValueError(f"in_proj_weight must have shape [3E, E], got {w_in.shape}")
    e = w_in.shape[1]
    wq, wk, wv = (_out_in_to_heads(w, num_heads, "in_proj_weight") for w in np.split(w_in, 3))
    w_o = np.transpose(w_out).reshape(num_heads, e // num_heads, e)
    if "in_proj_bias" not in state_dict:
        return AttentionParams(wq, wk, wv, w_o)
    b_in = np.asarray(state_dict["in_proj_bias"])
    b_q, b_k, b_v = (b_in[i * e : (i + 1) * e].reshape(num_heads, -1) for i in range(3))
    b_o = _require(state_dict, "out_proj.bias", "nn.MultiheadAttention")
    return AttentionParams(wq, wk, wv, w_o, b_q, b_k, b_v, b_o)


_HF_MODULES = {"q": "self.query", "k": "self.key", "v": "self.value", "o": "output.dense"}
_HF_KEYS = {  # w_q: self.query.weight, ..., b_o: output.dense.bias
    f"{kind}_{x}": f"{module}.{'weight' if kind == 'w' else 'bias'}"
    for kind in "wb"
    for x, module in _HF_MODULES.items()
}


def to_hf_bert(params: AttentionParams, prefix: str = "") -> dict[str, np.ndarray]:
    """Hugging Face BERT attention weights: ``{prefix}self.query.weight [H*d_k, d_model]`` etc.

    ``nn.Linear`` stores ``(out, in)``; heads are contiguous blocks of the out features (BERT's
    ``view(..., H, d_head)``). ``output.dense.weight`` is ``[d_model, H*d_v]``. Absent biases are
    written as zeros when any bias is present. ``prefix`` is prepended to every key (e.g.
    ``"encoder.layer.0.attention."``)."""
    _require_mha(params, "Hugging Face BERT attention")
    return {prefix + _HF_KEYS[n]: a for n, a in _linears(params).items()}


def from_hf_bert(
    state_dict: Mapping[str, Any], num_heads: int, prefix: str = ""
) -> AttentionParams:
    """Inverse of :func:`to_hf_bert` (e.g. ``prefix="encoder.layer.0.attention."``): the biases
    are read when ``{prefix}self.query.bias`` is present; ``num_heads``, not recorded in the
    weights, must divide each projection's output rows (else ``ValueError``)."""

    def get(name: str) -> np.ndarray:
        return _require(state_dict, prefix + _HF_KEYS[name], "Hugging Face BERT")

    w_q, w_k, w_v = (
        _out_in_to_heads(get(n), num_heads, prefix + _HF_KEYS[n]) for n in ("w_q", "w_k", "w_v")
    )
    dense = get("w_o")
    w_o = np.transpose(dense).reshape(num_heads, dense.shape[1] // num_heads, dense.shape[0])
    if prefix + _HF_KEYS["b_q"] not in state_dict:
        return AttentionParams(w_q, w_k, w_v, w_o)
    b_q, b_k, b_v = (get(n).reshape(num_heads, -1) for n in ("b_q", "b_k", "b_v"))
    return AttentionParams(w_q, w_k, w_v, w_o, b_q, b_k, b_v, get("b_o"))
