"""Oracle for multi-head latent attention (MLA; DeepSeek-AI 2024, DeepSeek-V2, arXiv:2405.04434,
section 2.1), NumPy only, float64.

From the paper's equations (9)-(19), independently of :mod:`attnref._src.formulations.mla`, in
ROW convention (the paper's ``W h_t`` is ``h_t W``). For batch element ``b``, query token ``t``,
key token ``j`` and head ``i``::

    c_t^Q     = h_t W_DQ                       (optional query compression; else c_t^Q = h_t)
    q_{t,i}^C = c_t^Q W_UQ[i]                  [d_nope]
    q_{t,i}^R = RoPE(c_t^Q W_QR[i], m_t)       [d_rope]   (per-head decoupled query)
    c_j^KV    = h_j W_DKV                      [d_c]      (the latent: what the cache holds)
    k_{j,i}^C = c_j^KV W_UK[i],  v_{j,i}^C = c_j^KV W_UV[i]
    k_j^R     = RoPE(h_j W_KR, n_j)            [d_rope]   (ONE rotated key part, shared by heads)
    q_{t,i} = [q_{t,i}^C; q_{t,i}^R],  k_{j,i} = [k_{j,i}^C; k_j^R]
    o_{t,i} = sum_j softmax_j(q_{t,i} . k_{j,i} * scale + bias_tj, mask) v_{j,i}^C
    y_t     = sum_i o_{t,i} W_O[i]

with ``scale = 1/sqrt(d_nope + d_rope)`` (the paper's ``1/sqrt(d_h + d_h^R)``, DeepSeek-V3's
``qk_head_dim ** -0.5``). Without RoPE (``w_kr = w_qr = None``) this is multi-head attention with
``W_Q[i] = W_DQ W_UQ[i]``, ``W_K[i] = W_DKV W_UK[i]``, ``W_V[i] = W_DKV W_UV[i]``. No RMSNorm on
the latents (the reference code's is elementwise: apply it to ``x`` first). Fully masked rows
output 0.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from ._checks import check_mask_and_bias, check_scale, dtype_of, is_floating, shape_of
from ._doc import retemplate, rope_call, signed
from ._rope import check_base, check_convention, read_positions, rope

# (field, shape text) of every MLA weight, in the dataclass's order; None-able ones last.
MLA_FIELDS = (
    ("w_dkv", "[d_model, d_c]"),
    ("w_uk", "[H, d_c, d_nope]"),
    ("w_uv", "[H, d_c, d_v]"),
    ("w_uq", "[H, d_q, d_nope] (d_q = d_cq with w_dq, else d_model)"),
    ("w_o", "[H, d_v, d_model]"),
    ("w_kr", "[d_model, d_rope] or None"),
    ("w_qr", "[H, d_q, d_rope] or None"),
    ("w_dq", "[d_model, d_cq] or None"),
)


class MLADims(NamedTuple):
    """The sizes of MLA parameters (``d_rope = 0`` without the RoPE part, ``d_cq = 0`` without
    query compression)."""

    heads: int
    d_model: int
    d_c: int
    d_nope: int
    d_rope: int
    d_v: int
    d_cq: int


def _get(params: Any, name: str) -> Any:
    try:
        return getattr(params, name)
    except AttributeError:
        raise TypeError(
            f"params must be MLA parameters (attnref.mla.MLAParams) with a field {name!r}, "
            f"got {type(params).__name__}"
        ) from None


def check_mla_params(params: Any) -> MLADims:
    """The shapes and dtypes of MLA parameters (traced arrays pass) as :class:`MLADims`."""
    w = {name: _get(params, name) for name, _ in MLA_FIELDS}
    shapes = {k: (None if v is None else shape_of(v)) for k, v in w.items()}
    want = dict(MLA_FIELDS)
    for name in ("w_dkv", "w_uk", "w_uv", "w_uq", "w_o"):
        if w[name] is None:
            raise ValueError(f"params.{name} is required ({want[name]}), got None")
    for name, s in shapes.items():
        rank = 2 if name in ("w_dkv", "w_kr", "w_dq") else 3
        if s is not None and len(s) != rank:
            raise ValueError(f"params.{name} must have shape {want[name]}, got shape {s}")
    d_model, d_c = shapes["w_dkv"]  # type: ignore[misc]
    heads, _, d_nope = shapes["w_uk"]  # type: ignore[misc]
    d_v = shapes["w_uv"][2]  # type: ignore[index]
    d_cq = 0 if shapes["w_dq"] is None else shapes["w_dq"][1]
    if shapes["w_dq"] is not None and shapes["w_dq"][0] != d_model:
        raise ValueError(
            f"params.w_dq must have shape [d_model={d_model}, d_cq], got {shapes['w_dq']}"
        )
    d_q = d_cq if shapes["w_dq"] is not None else d_model
    if (w["w_kr"] is None) != (w["w_qr"] is None):
        raise ValueError(
            "params.w_kr and params.w_qr go together (the decoupled RoPE key and query parts): "
            f"got w_kr shape {shapes['w_kr']}, w_qr shape {shapes['w_qr']}"
        )
    d_rope = 0 if shapes["w_kr"] is None else shapes["w_kr"][1]
    expected = {
        "w_uk": (heads, d_c, d_nope),
        "w_uv": (heads, d_c, d_v),
        "w_uq": (heads, d_q, d_nope),
        "w_o": (heads, d_v, d_model),
        "w_kr": (d_model, d_rope),
        "w_qr": (heads, d_q, d_rope),
    }
    for name, shape in expected.items():
        if shapes[name] is not None and shapes[name] != shape:
            raise ValueError(
                f"params.{name} must have shape {want[name]} = {list(shape)} (from w_dkv "
                f"{list(shapes['w_dkv'])}, w_uk {list(shapes['w_uk'])}, w_uv "  # type: ignore[arg-type]
                f"{list(shapes['w_uv'])}), got shape {shapes[name]}"  # type: ignore[arg-type]
            )
    if min(heads, d_model, d_c, d_nope, d_v) < 1 or (shapes["w_dq"] is not None and d_cq < 1):
        raise ValueError(f"MLA sizes must be positive, got shapes {shapes}")
    if d_rope and (d_rope % 2 or d_rope < 2):
        raise ValueError(f"RoPE needs an even d_rope, got params.w_kr shape {shapes['w_kr']}")
    dtypes = {name: dtype_of(v) for name, v in w.items() if v is not None}
    if len(set(dtypes.values())) != 1 or not is_floating(dtypes["w_dkv"]):
        raise TypeError(f"MLA weights must share one floating dtype, got {dtypes}")
    return MLADims(heads, d_model, d_c, d_nope, d_rope, d_v, d_cq)


def check_mla_tokens(
    dims: MLADims,
    dtype: Any,
    x_q: Any,
    x_kv: Any,
    kv_name: str = "x_kv",
    kv_width: int = 0,
    q_name: str = "x_q",
) -> tuple[tuple[int, ...], int, int]:
    """``x_q [..., T_q, d_model]`` and ``x_kv`` (``[..., T_k, kv_width]``, ``kv_width`` default
    ``d_model``) of the weights' dtype with equal batch shapes; ``(batch, T_q, T_k)``."""
    width = kv_width or dims.d_model
    for name, x, w in ((q_name, x_q, dims.d_model), (kv_name, x_kv, width)):
        s = shape_of(x)
        if len(s) < 2 or s[-1] != w:
            raise ValueError(f"{name} must have shape [..., T, {w}], got shape {s}")
        if dtype_of(x) != dtype:
            raise TypeError(
                f"{name} has dtype {dtype_of(x)} but the MLA weights are {dtype}; attnref does "
                "not mix dtypes, cast explicitly"
            )
    bq, bk = shape_of(x_q)[:-2], shape_of(x_kv)[:-2]
    if bq != bk:
        raise ValueError(
            f"{q_name} has batch shape {bq} (shape {shape_of(x_q)}) but {kv_name} has batch shape "
            f"{bk} (shape {shape_of(x_kv)}); batch dimensions must match exactly"
        )
    return bq, shape_of(x_q)[-2], shape_of(x_kv)[-2]


def mla_weights(params: Any) -> dict[str, Any]:
    """Every MLA weight (:data:`MLA_FIELDS`) in float64, ``None`` where absent."""
    get = {name: getattr(params, name) for name, _ in MLA_FIELDS}
    return {name: None if w is None else np.asarray(w, np.float64) for name, w in get.items()}


# The inputs of MLA (:func:`mla_attention` and its bound): RoPE's, with DeepSeek's convention.
mla_call = retemplate(rope_call, convention="interleaved")
# Those that give its queries, keys and values (:func:`mla_qkv`).
QKV = ("params", "x_q", "x_kv", "positions_q", "positions_kv", "base", "convention")


@signed(retemplate(mla_call, only=QKV))
def mla_qkv(call: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The decompressed per-head queries, keys and values of MLA in float64, in the kernel layout
    of ``attnref.oracle.dot_product_attention``: ``q [..., T_q, H, d_nope + d_rope]``,
    ``k [..., T_k, H, d_nope + d_rope]`` (``k_rope`` repeated for every head), ``v [..., T_k, H,
    d_v]`` (module docstring; ``convention`` default ``"interleaved"``, as DeepSeek's
    ``apply_rotary_emb``).

    Raises:
        ValueError, TypeError: As :func:`mla_attention`.
    """
    params, x_q, x_kv, positions_q, positions_kv, base, convention = call.values()
    dims = check_mla_params(params)
    check_convention(convention)
    check_base(base)
    x_kv = x_q if x_kv is None else x_kv
    batch, t_q, t_k = check_mla_tokens(dims, dtype_of(params.w_dkv), x_q, x_kv)
    pq = read_positions(positions_q, batch, t_q, "positions_q")
    pk = read_positions(positions_kv, batch, t_k, "positions_kv")
    f = mla_weights(params)
    xq, xkv = np.asarray(x_q, np.float64), np.asarray(x_kv, np.float64)
    c_q = xq if f["w_dq"] is None else xq @ f["w_dq"]  # c_t^Q          [..., T_q, d_q]
    q = np.einsum("...tc,icn->...tin", c_q, f["w_uq"])  # q^C             [..., T_q, H, d_nope]
    c_kv = xkv @ f["w_dkv"]  # c_j^KV                                     [..., T_k, d_c]
    k = np.einsum("...jc,icn->...jin", c_kv, f["w_uk"])  # k^C           [..., T_k, H, d_nope]
    v = np.einsum("...jc,icv->...jiv", c_kv, f["w_uv"])  # v^C           [..., T_k, H, d_v]
    if dims.d_rope:
        q_r = np.einsum("...tc,icr->...tir", c_q, f["w_qr"])  #          [..., T_q, H, d_rope]
        q_r = rope(q_r, pq, base=base, convention=convention)
        k_r = (xkv @ f["w_kr"])[..., None, :]  # one shared head         [..., T_k, 1, d_rope]
        k_r = rope(k_r, pk, base=base, convention=convention)
        q = np.concatenate([q, q_r], axis=-1)
        k = np.concatenate([k, np.broadcast_to(k_r, (*k.shape[:-1], dims.d_rope))], axis=-1)
    return q, k, v


def mla_problem(call: dict[str, Any]) -> tuple[Any, ...]:
    """``(q, k, v, mask, bias, scale)`` of an :func:`mla_call`, mask and bias broadcast."""
    q, k, v = mla_qkv(**{n: call[n] for n in QKV})
    batch, t_q, t_k = q.shape[:-3], q.shape[-3], k.shape[-3]
    m, b = check_mask_and_bias(call["mask"], call["bias"], (*batch, t_q, t_k), "(query, key)")
    s = check_scale(call["scale"])
    return q, k, v, m, b, 1.0 / math.sqrt(q.shape[-1]) if s is None else s


@signed(mla_call)
def mla_attention(call: dict[str, Any], *, residual: bool = False) -> np.ndarray:
    """Multi-head latent attention from the paper's equations, ``[..., T_q, d_model]`` in float64
    (module docstring): ``y_t = sum_i softmax_j(q_{t,i} . k_{j,i} * scale + bias, mask) v_{j,i}
    W_O[i]`` on the decompressed :func:`mla_qkv`; ``scale`` defaults to ``1/sqrt(d_nope +
    d_rope)``; ``mask``/``bias`` broadcast to ``[..., T_q, T_k]``; a fully masked row gives 0
    (``x_q`` with ``residual``).

    Raises:
        ValueError: Malformed parameters (the message names the field and both shapes), token
            shapes, batch shapes, positions, mask/bias shapes, ``base`` or ``convention``.
        TypeError: Mixed dtypes, a non-boolean mask, non-integer positions, non-real scale.
    """
    q, k, v, m, b, s = mla_problem(call)
    # A key or value that a query may not read never reaches it (whatever it holds): the sums
    # run over the allowed pairs only; a row that reads a non-finite value is NaN.
    bad_q, bad_k, bad_v = (~np.isfinite(a).all(-1) for a in (q, k, v))  # [..., T, H]
    q, k, v = (np.where(np.isfinite(a), a, 0.0) for a in (q, k, v))
    logits = np.einsum("...tid,...jid->...itj", q, k) * s  # [..., H, T_q, T_k]
    allowed = np.ones(logits.shape, bool)
    if m is not None:
        allowed &= m[..., None, :, :]
    if b is not None:
        allowed &= b[..., None, :, :] != -np.inf
        logits = logits + np.where(allowed, b[..., None, :, :], 0.0)
    top = np.max(np.where(allowed, logits, -np.inf), axis=-1, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)
    e = np.where(allowed, np.exp(np.where(allowed, logits - top, 0.0)), 0.0)
    total = e.sum(axis=-1, keepdims=True)
    p = e / np.where(total > 0, total, 1.0)  # zero rows where nothing is allowed
    o = np.einsum("...itj,...jiv->...itv", p, v)  # o_{t,i}              [..., H, T_q, d_v]
    kv_bad = np.swapaxes(bad_k | bad_v, -1, -2)[..., None, :]  #         [..., H, 1, T_k]
    dirty = (allowed & kv_bad).any(-1) | (np.swapaxes(bad_q, -1, -2) & allowed.any(-1))
    o = np.where(dirty[..., None], np.nan, o)
    y = np.einsum("...itv,ivd->...td", o, np.asarray(call["params"].w_o, np.float64))
    return np.asarray(call["x_q"], np.float64) + y if residual else y
