"""Multi-head (weight-level) forms of the kernel-era formulations: blockwise and cached decoding.

Both take the row-convention signature of the registry's softmax family, ``apply(params, x_q,
x_kv=None, *, mask=None, bias=None, scale=None, residual=False)`` with ``x [..., T, d_model]``,
project per head (``q = x W_Q + b_Q``; K/V heads shared by groups of query heads), run the
kernel in the layout of ``jax.nn.dot_product_attention``, and return
``sum_n o_n W_O[n] + b_O`` (``x_q +`` that in residual form).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float

from attnref._src.blockwise import blockwise_attention
from attnref._src.checks import float64_scoped
from attnref._src.common import HIGHEST, Prepared, add_output_bias, residual_or
from attnref._src.decode import cache_attend, kv_cache_append, mha_cache_init, mha_decode_scan
from attnref._src.params import AttentionParams


def _flat(p: Prepared) -> tuple[Array, Array, int]:
    b = math.prod(p.batch_shape)
    return p.x_q.reshape(b, p.t_q, -1), p.x_kv.reshape(b, p.t_k, -1), b


def _kernel_heads(x: Array, w: ArrayLike, b: ArrayLike | None) -> Array:
    y = jnp.einsum("btd,hde->bthe", x, jnp.asarray(w), precision=HIGHEST)
    return y if b is None else y + jnp.asarray(b)


def _pairs(p: Prepared, a: Array | None, b: int) -> Array | None:
    """``[..., T_q, T_k]`` mask or bias -> kernel ``[B, 1, T_q, T_k]``."""
    if a is None:
        return None
    return jnp.broadcast_to(a, (*p.batch_shape, p.t_q, p.t_k)).reshape(b, 1, p.t_q, p.t_k)


def _output(p: Prepared, params: AttentionParams, o: Array, residual: bool) -> Array:
    y = jnp.einsum("bthv,hvd->btd", o, jnp.asarray(params.w_o), precision=HIGHEST)
    y = add_output_bias(y.reshape(*p.batch_shape, p.t_q, -1), params)
    return residual_or(y, p.x_q, residual)


@float64_scoped
def blockwise_multihead(
    params: AttentionParams,
    x_q: Float[ArrayLike, "... T_q d_model"],
    x_kv: Float[ArrayLike, "... T_k d_model"] | None = None,
    *,
    mask: Bool[ArrayLike, "... T_q T_k"] | None = None,
    bias: Float[ArrayLike, "... T_q T_k"] | None = None,
    scale: float | None = None,
    residual: bool = False,
    block_q: int = 3,
    block_k: int = 2,
) -> Float[Array, "... T_q d_model"]:
    """Multi-head attention through :func:`attnref.blockwise_attention` (online softmax in
    ``block_q x block_k`` tiles; the small odd defaults exercise partial tiles)."""

    def compute(p: Prepared) -> Array:
        xq, xkv, b = _flat(p)
        o = blockwise_attention(
            _kernel_heads(xq, params.w_q, params.b_q),
            _kernel_heads(xkv, params.w_k, params.b_k),
            _kernel_heads(xkv, params.w_v, params.b_v),
            _pairs(p, p.bias, b),
            _pairs(p, p.mask, b),
            scale=scale,
            block_q=block_q,
            block_k=block_k,
        )
        return _output(p, params, o, residual)

    # Non-finite tokens a query may not read stay out of it and of every gradient (the
    # projections' backward would otherwise multiply them by zero).
    return Prepared(params, x_q, x_kv, mask, bias, scale).guarded(compute, residual)


@float64_scoped
def decode_multihead(
    params: AttentionParams,
    x_q: Float[ArrayLike, "... T d_model"],
    x_kv: Float[ArrayLike, "... T d_model"] | None = None,
    *,
    mask: Bool[ArrayLike, "... T T"] | None = None,
    bias: Float[ArrayLike, "... T T"] | None = None,
    scale: float | None = None,
    residual: bool = False,
    window: int | None = None,
) -> Float[Array, "... T d_model"]:
    """Causal attention computed by KV-cached decoding, one token per ``lax.scan`` step.

    Token ``t`` brings query ``x_q[t]`` and key/value ``x_kv[t]`` (default ``x_q``); it attends to
    the cached tokens ``j <= t`` with ``mask[t, j]`` and ``bias[t, j]``. Always causal; needs
    ``T_q == T_k``. With ``window = W`` the cache is a ring buffer of capacity ``W`` that wraps
    once ``T > W``, and token ``t`` attends to ``t - W < j <= t`` (sliding-window attention).
    """
    p = Prepared(params, x_q, x_kv, mask, bias, scale)
    if p.t_q != p.t_k:
        raise ValueError(
            f"decoding pairs query t with key t: x_q has T_q={p.t_q} tokens but x_kv has "
            f"T_k={p.t_k}"
        )
    xq, xkv, b = _flat(p)
    m, bi = _pairs(p, p.mask, b), _pairs(p, p.bias, b)
    cache = mha_cache_init(params, b, p.t_k if window is None else window, window=window)
    y, _ = mha_decode_scan(
        params,
        cache,
        xq,
        xs_kv=xkv,
        mask=None if m is None else m[:, 0],
        bias=None if bi is None else bi[:, 0],
        scale=scale,
    )
    y = y.reshape(*p.batch_shape, p.t_q, -1)
    return residual_or(y, p.x_q, residual)


@float64_scoped
def kv_cache_multihead(
    params: AttentionParams,
    x_q: Float[ArrayLike, "... T_q d_model"],
    x_kv: Float[ArrayLike, "... T_k d_model"] | None = None,
    *,
    mask: Bool[ArrayLike, "... T_q T_k"] | None = None,
    bias: Float[ArrayLike, "... T_q T_k"] | None = None,
    scale: float | None = None,
    residual: bool = False,
) -> Float[Array, "... T_q d_model"]:
    """Multi-head attention read from a KV cache: ``x_kv``'s keys and values are projected and
    appended (the prefill), then a ``lax.scan`` runs the queries one at a time against the cache
    with row ``t`` of ``mask`` and ``bias`` (by absolute key position).

    With a causal mask this is what incremental decoding computes (:func:`mha_decode_scan`
    appends one token per step instead; both are tested against the oracle).
    """
    return Prepared(params, x_q, x_kv, mask, bias, scale).guarded(
        lambda p: _kv_cache(p, params, scale, residual), residual
    )


def _kv_cache(p: Prepared, params: AttentionParams, scale: float | None, residual: bool) -> Array:
    xq, xkv, b = _flat(p)
    cache = mha_cache_init(params, b, p.t_k)
    cache = kv_cache_append(
        cache,
        _kernel_heads(xkv, params.w_k, params.b_k).astype(p.dtype),
        _kernel_heads(xkv, params.w_v, params.b_v).astype(p.dtype),
    )
    q = jnp.swapaxes(_kernel_heads(xq, params.w_q, params.b_q), 0, 1)  # [T_q, B, N, d_k]
    steps: dict[str, Array] = {"q": q}
    m, bi = _pairs(p, p.mask, b), _pairs(p, p.bias, b)
    if m is not None:
        steps["mask"] = jnp.swapaxes(m[:, 0], 0, 1)  # [T_q, B, T_k]
    if bi is not None:
        steps["bias"] = jnp.swapaxes(bi[:, 0], 0, 1)

    def step(_: None, inp: dict[str, Array]) -> tuple[None, Array]:
        row_mask = inp["mask"][:, None] if "mask" in inp else None
        row_bias = inp["bias"][:, None] if "bias" in inp else None
        out = cache_attend(cache, inp["q"][:, None], mask=row_mask, bias=row_bias, scale=scale)
        return None, out[:, 0]

    _, o = jax.lax.scan(step, None, steps)
    return _output(p, params, jnp.swapaxes(o, 0, 1), residual)
