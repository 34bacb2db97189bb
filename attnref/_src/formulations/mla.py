"""Multi-head latent attention (MLA; DeepSeek-V2, arXiv:2405.04434, section 2.1) in two forms.

Row convention (``c = x W``), per-head weights per head (:class:`MLAParams`)::

    c^Q = x_q W_DQ (or x_q),   q_i = [c^Q W_UQ[i] ; RoPE(c^Q W_QR[i], m)]     [d_nope + d_rope]
    c^KV = x_kv W_DKV,         k^R = RoPE(x_kv W_KR, n)      (one rotated key part for all heads)
    cache = [c^KV ; k^R]                                                    [T_k, d_c + d_rope]

* ``mla`` (naive; DeepSeek-V3 ``inference/model.py``, ``attn_impl == "naive"``): decompress the
  cache into ``k_i = [c^KV W_UK[i] ; k^R]``, ``v_i = c^KV W_UV[i]``;
* ``mla_absorbed`` (``attn_impl == "absorb"``): ``q^C_i k^C_i^T = (q^C_i W_UK[i]^T) c^KV^T``, so
  the query absorbs ``W_UK[i]`` and attends to the cache itself, ``W_UV[i]`` applied after the
  mix (the RoPE part is not absorbed: ``R(m) R(n)^T`` sits between ``W_QR`` and ``W_KR``).

``scale = 1/sqrt(d_nope + d_rope)`` by default (the paper's ``1/sqrt(d_h + d_h^R)``).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float, Int

from attnref._src.core.checks import HIGHEST, device_array, float64_scoped
from attnref._src.core.common import Bias, Keys, Mask, Queries, residual_or
from attnref._src.core.entry import compiled, public
from attnref._src.formulations.mla_family import MLA_CACHE, MLA_ROWS, MLAParams
from attnref._src.formulations.rope import rotate, weights
from attnref._src.formulations.rope_family import Rotary, check_base, check_convention, rotary
from attnref.oracle._mla import check_mla_params, check_mla_tokens

Cache = Float[Array, "... T_k d_c_plus_d_rope"]

# ----------------------------------------------------------------------------- the two forms


def mla(
    p: MLAParams,
    x_q: Queries,
    x_kv: Keys,
    mask: Mask,
    bias: Bias,
    scale: Array,
    residual: bool,
    rot: Rotary,
) -> Float[Array, "... T_q d_model"]:
    """Naive MLA: ``y = sum_i softmax(q_i k_i^T scale + bias, mask) v_i W_O[i]`` with the
    decompressed ``k_i = [c^KV W_UK[i] ; k^R]``, ``v_i = c^KV W_UV[i]``."""
    return mla_naive(p, x_q, latent_cache(p, x_kv, rot), mask, bias, scale, residual, rot)


def mla_absorbed(
    p: MLAParams,
    x_q: Queries,
    x_kv: Keys,
    mask: Mask,
    bias: Bias,
    scale: Array,
    residual: bool,
    rot: Rotary,
) -> Float[Array, "... T_q d_model"]:
    """Absorbed MLA: ``y = sum_i (softmax([q^C_i W_UK[i]^T ; q^R_i] cache^T scale + bias, mask)
    c^KV) W_UV[i] W_O[i]``, attention against the cache ``[c^KV ; k^R]`` itself."""
    return mla_latent(p, x_q, latent_cache(p, x_kv, rot), mask, bias, scale, residual, rot)


def mla_naive(
    p: MLAParams,
    x_q: Queries,
    cache: Cache,
    mask: Mask,
    bias: Bias,
    scale: Array,
    residual: bool,
    rot: Rotary,
) -> Float[Array, "... T_q d_model"]:
    """The naive form on the cache: decompress every cached token into per-head keys and values."""
    q = queries(p, x_q, rot)  # q_i                              [..., H, T_q, d_nope + d_rope]
    d_c = p.dims.d_c
    c, k_r = cache[..., :d_c], cache[..., d_c:]  # c^KV [..., T_k, d_c], k^R [..., T_k, d_rope]
    k = jnp.einsum("...kc,hcn->...hkn", c, p.w_uk, precision=HIGHEST)  # k^C_i [.., H, T_k, d_nope]
    v = jnp.einsum("...kc,hcv->...hkv", c, p.w_uv, precision=HIGHEST)  # v_i   [.., H, T_k, d_v]
    if p.w_kr is not None:  # k_i = [k^C_i ; k^R]: the shared rotated part, repeated per head
        k_r = jnp.broadcast_to(k_r[..., None, :, :], (*k.shape[:-1], k_r.shape[-1]))
        k = jnp.concatenate([k, k_r], -1)  #                      [..., H, T_k, d_nope + d_rope]
    logits = jnp.einsum("...hqd,...hkd->...hqk", q, k, precision=HIGHEST)
    a = weights(logits, mask, bias, scale)  #                                 [..., H, T_q, T_k]
    o = jnp.einsum("...hqk,...hkv->...hqv", a, v, precision=HIGHEST)  # o_i   [.., H, T_q, d_v]
    y = jnp.einsum("...hqv,hvd->...qd", o, p.w_o, precision=HIGHEST)  # sum_i o_i W_O[i]
    return residual_or(y, x_q, residual)


def mla_latent(
    p: MLAParams,
    x_q: Queries,
    cache: Cache,
    mask: Mask,
    bias: Bias,
    scale: Array,
    residual: bool,
    rot: Rotary,
) -> Float[Array, "... T_q d_model"]:
    """The absorbed form on the cache: ``W_UK`` into the queries, ``W_UV`` after the mix."""
    d = p.dims
    q = queries(p, x_q, rot)  #                                      [..., H, T_q, d_nope + d_rope]
    q_c, q_r = q[..., : d.d_nope], q[..., d.d_nope :]
    q_lat = jnp.einsum("...hqn,hcn->...hqc", q_c, p.w_uk, precision=HIGHEST)  # [..., H, T_q, d_c]
    q_abs = jnp.concatenate([q_lat, q_r], -1) if d.d_rope else q_lat  # [..., H, T_q, d_c + d_rope]
    logits = jnp.einsum("...hqe,...ke->...hqk", q_abs, cache, precision=HIGHEST)  # vs the cache
    a = weights(logits, mask, bias, scale)  #                                     [..., H, T_q, T_k]
    z = jnp.einsum("...hqk,...kc->...hqc", a, cache[..., : d.d_c], precision=HIGHEST)  # latent mix
    o = jnp.einsum("...hqc,hcv->...hqv", z, p.w_uv, precision=HIGHEST)  # W_UV after the mix
    y = jnp.einsum("...hqv,hvd->...qd", o, p.w_o, precision=HIGHEST)  # sum_i o_i W_O[i]
    return residual_or(y, x_q, residual)


# ----------------------------------------------------------------------------- their pieces


def latent_cache(p: MLAParams, x_kv: Keys, rot: Rotary) -> Cache:
    """``[c^KV ; k^R] = [x W_DKV ; RoPE(x W_KR, n)]``: ``[..., T_k, d_c + d_rope]``."""
    c = jnp.einsum("...kd,dc->...kc", x_kv, p.w_dkv, precision=HIGHEST)
    if p.w_kr is None:
        return c
    k_r = jnp.einsum("...kd,dr->...kr", x_kv, p.w_kr, precision=HIGHEST)
    return jnp.concatenate([c, rotate(k_r, jnp.asarray(rot.pos_k), rot.base, rot.convention)], -1)


def queries(p: MLAParams, x_q: Queries, rot: Rotary) -> Float[Array, "... H T_q d_qk"]:
    """``q_i = [c^Q W_UQ[i] ; RoPE(c^Q W_QR[i], m)]``, ``c^Q = x_q W_DQ`` (or ``x_q``)."""
    c_q = x_q if p.w_dq is None else jnp.einsum("...qd,dc->...qc", x_q, p.w_dq, precision=HIGHEST)
    q = jnp.einsum("...qc,hcn->...hqn", c_q, p.w_uq, precision=HIGHEST)
    if p.w_qr is None:
        return q
    q_r = jnp.einsum("...qc,hcr->...hqr", c_q, p.w_qr, precision=HIGHEST)
    q_r = rotate(q_r, jnp.asarray(rot.pos_q)[..., None, :], rot.base, rot.convention)
    return jnp.concatenate([q, q_r], -1)


# ----------------------------------------------------------------------------- public functions

_SUMMARY = """Shapes ``x_q [..., T_q, d_model]``, ``x_kv [..., T_k, d_model]`` (default ``x_q``);
integer positions ``[..., T]`` or ``[T]`` (default ``arange(T)``); output ``[..., T_q, d_model]``.
``scale`` defaults to ``1/sqrt(d_nope + d_rope)``. Fully masked rows get zero weights (output 0).
A key a query may not read (mask, ``-inf`` bias) never reaches its output or gradients."""

mla_attention = public(
    MLA_ROWS,
    mla,
    name="mla_attention",
    summary=f"""Multi-head latent attention (DeepSeek-V2), the naive form.

``c^KV = x_kv W_DKV``; per-head keys ``k_i = [c^KV W_UK[i] ; RoPE(x_kv W_KR)]`` and values
``v_i = c^KV W_UV[i]`` are decompressed from the latent; queries
``q_i = [c^Q W_UQ[i] ; RoPE(c^Q W_QR[i])]`` (``c^Q = x_q W_DQ`` or ``x_q``);
``y = sum_i softmax(q_i k_i^T scale + bias, mask) v_i W_O[i]``.
{_SUMMARY}""",
    returns="The block output ``[..., T_q, d_model]``, the dtype of ``x_q``.",
)
mla_absorbed_attention = public(
    MLA_ROWS,
    mla_absorbed,
    name="mla_absorbed_attention",
    summary=f""":func:`mla_attention` with ``W_UK`` absorbed into the queries and ``W_UV`` into
the output, attending to the latent cache ``[c^KV ; k^R]`` (``d_c + d_rope`` numbers per token).

``logits_i = [q^C_i W_UK[i]^T ; q^R_i] [c^KV ; k^R]^T`` (the RoPE part is not absorbed),
``y = sum_i (softmax(logits_i scale + bias, mask) c^KV) W_UV[i] W_O[i]``.
{_SUMMARY}""",
    returns="The block output ``[..., T_q, d_model]``, the dtype of ``x_q``.",
)
mla_cache_attention = public(
    MLA_CACHE,
    mla_naive,
    name="mla_cache_attention",
    summary="""The naive form of :func:`mla_attention` on the latent cache (decoding): every
cached token ``[c^KV ; k^R]`` is decompressed into per-head keys and values.""",
    returns="The block output ``[..., T_q, d_model]``, the dtype of ``x_q``.",
)
mla_absorbed_cache_attention = public(
    MLA_CACHE,
    mla_latent,
    name="mla_absorbed_cache_attention",
    summary="""The absorbed form of :func:`mla_absorbed_attention` on the latent cache
(decoding): attention against ``[c^KV ; k^R]`` without decompressing it, as FlashMLA's kernel
computes it (an MQA over ``d_c + d_rope``-wide keys whose values are the first ``d_c``
columns).""",
    returns="The block output ``[..., T_q, d_model]``, the dtype of ``x_q``.",
)


@float64_scoped
def mla_latent_cache(
    params: MLAParams,
    x_kv: Float[ArrayLike, "... T_k d_model"],
    *,
    positions_kv: Int[ArrayLike, "... T_k"] | None = None,
    base: float = 10000.0,
    convention: str = "interleaved",
) -> Float[Array, "... T_k d_c_plus_d_rope"]:
    """The latent cache ``[c^KV ; k^R] = [x W_DKV ; RoPE(x W_KR, n)]``: all MLA keeps per token.

    Args:
        params: :class:`attnref.mla.MLAParams`.
        x_kv: Tokens ``[..., T_k, d_model]``, the dtype of ``params``.
        positions_kv: Integer positions ``[..., T_k]`` or ``[T_k]``; default ``arange(T_k)``.
        base: The RoPE frequency base (default 10000).
        convention: ``"interleaved"`` (default) or ``"rotate_half"``.

    Returns:
        The cache ``[..., T_k, d_c + d_rope]``, the dtype of ``x_kv``; a row is non-finite
        exactly where its token is.

    Raises:
        ValueError: Malformed ``params``, ``x_kv`` not ``[..., T_k, d_model]``, positions that do
            not broadcast, a bad ``base`` or ``convention``.
        TypeError: Mixed dtypes or non-integer positions.
    """
    conv, b = check_convention(convention), check_base(base)
    dims = check_mla_params(params)
    dtype = np.dtype(device_array(params.w_dkv).dtype)
    batch, _, t_k = check_mla_tokens(dims, dtype, x_kv, x_kv, q_name="x_kv")
    rot = rotary(None, positions_kv, batch, 0, t_k, b, conv)  # checks positions_kv
    return compiled(latent_cache, params, x_kv, rot)  # type: ignore[no-any-return]
