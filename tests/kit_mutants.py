"""Broken attention kernels for ``tests/test_kit_mutants.py``: one per single-device property of
the conformance kit (:data:`attnref.testing.PROPERTIES`), each wrong in a way that only that
property sees (issue 22, "Planted bugs that survive": a property that stops looking, e.g. ignores
its drawn mask shape, must turn a test red).

Every mutant is :func:`softmax_attention`, a plain jnp kernel with attnref's semantics (fully
masked rows ``"zeros"``, top-left causal alignment) and jax.nn's keywords (``mask``, ``bias``,
``scale``, ``is_causal``; attnref's ``return_lse``), with one defect; unbroken, it passes every
property, which the passing half of each test shows eight properties at a time. That is all the
features of :data:`FEATURES` need (no ``cross``: then every bucket but the MQA one has batch 2,
see ``batch1_drops_mask``).

:data:`MUTANTS` maps each property to its mutant and the extra ``check_attention`` arguments of
both the call that must fail (that property alone) and the call that must pass (every other
property).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

# The features every mutant is checked with: all nine properties run (none is skipped), and the
# masks property's kinds are causal, random, bias, alibi and neg_inf_bias.
FEATURES = ("mask", "bias", "causal", "gqa", "lse", "grad")

_sg = jax.lax.stop_gradient


def _future(t: int, s: int) -> Any:
    """``[T, S]``: key ``j`` is in the future of query ``i`` (top-left alignment)."""
    return jnp.arange(s)[None, :] > jnp.arange(t)[:, None]


def softmax_attention(
    query: Any,
    key: Any,
    value: Any,
    bias: Any = None,
    mask: Any = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    return_lse: bool = False,
    masked_rows: str = "zeros",
    max_floor: float | None = None,
) -> Any:
    """The mutants' base: a plain jnp kernel with jax.nn's keywords (mask, bias, scale, top-left
    causal, GQA) and attnref's ``return_lse``; a row with no allowed key gives zeros (attnref's
    default) or, with ``masked_rows="uniform"``, the mean of ``v`` (jax.nn's), and ``lse =
    -inf``. The row max is subtracted before ``exp`` (with ``max_floor``: the larger of the row
    max and ``max_floor``). Cheap to trace (the kit jits each mutant per option set and shape),
    and unbroken it passes every property."""
    _, t, n, h = query.shape
    s, kh = key.shape[1], key.shape[2]
    k = jnp.repeat(key, n // kh, axis=2)
    v = jnp.repeat(value, n // kh, axis=2)
    sc = 1.0 / math.sqrt(h) if scale is None else scale
    logits = jnp.einsum("btnh,bsnh->bnts", query, k, precision="highest") * sc
    allowed = jnp.ones((1, 1, t, s), bool)
    if bias is not None:
        logits = logits + bias
        allowed = allowed & (bias != -jnp.inf)
    if mask is not None:
        allowed = allowed & mask
    if is_causal:
        allowed = allowed & ~_future(t, s)
    allowed = jnp.broadcast_to(allowed, logits.shape)
    top = jnp.max(jnp.where(allowed, logits, -jnp.inf), axis=-1, keepdims=True)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    if max_floor is not None:
        top = jnp.maximum(top, max_floor)
    top = _sg(top)
    e = jnp.where(allowed, jnp.exp(jnp.where(allowed, logits - top, 0.0)), 0.0)
    denom = jnp.sum(e, axis=-1, keepdims=True)
    p = e / jnp.where(denom > 0, denom, 1.0)
    if masked_rows == "uniform":  # a row with no allowed key: the mean of v over every key
        p = jnp.where(denom > 0, p, 1.0 / s)
    out = jnp.einsum("bnts,bsnh->btnh", p, v, precision="highest").astype(query.dtype)
    if not return_lse:
        return out
    lse = (top + jnp.log(denom))[..., 0]  # log 0 = -inf for a row with no key
    return out, jnp.swapaxes(lse, 1, 2).astype(query.dtype)


_base = softmax_attention


# ----------------------------------------------------------------------------- oracle


def float64_in_float32(
    query: Any,
    key: Any,
    value: Any,
    bias: Any = None,
    mask: Any = None,
    *,
    return_lse: bool = False,
    **kw: Any,
) -> Any:
    """oracle: float64 inputs are computed in float32 and cast back (a kernel whose compute dtype
    is float32 whatever the input); only ``oracle`` runs every requested dtype, the other
    properties run float32 alone, where this kernel is the base's."""
    dtype = query.dtype
    if dtype == jnp.float64:
        query, key, value = (x.astype(jnp.float32) for x in (query, key, value))
        bias = None if bias is None else bias.astype(jnp.float32)
    out = _base(query, key, value, bias, mask, return_lse=return_lse, **kw)
    if return_lse:
        return out[0].astype(dtype), out[1].astype(dtype)
    return out.astype(dtype)


# ----------------------------------------------------------------------------- masks


def bias_row0_only(
    query: Any,
    key: Any,
    value: Any,
    bias: Any = None,
    mask: Any = None,
    *,
    return_lse: bool = False,
    **kw: Any,
) -> Any:
    """masks: a bias that broadcasts over the query axis (``[.., 1, S]``, a key-padding bias) is
    materialised for query row 0 only (rows 1.. get no bias, ``-inf`` entries included); only
    the masks property draws a bias's broadcast shape (and runs ``[1, 1, 1, S]`` first), every
    other bias of the kit has a full query axis."""
    t = query.shape[1]
    if bias is not None and bias.shape[2] == 1 and t > 1:
        full = jnp.broadcast_to(bias, (*bias.shape[:2], t, bias.shape[3]))
        bias = full.at[:, :, 1:, :].set(0.0)
    return _base(query, key, value, bias, mask, return_lse=return_lse, **kw)


# ----------------------------------------------------------------------------- causality


def backward_masks_future_with_minus_60(
    query: Any,
    key: Any,
    value: Any,
    bias: Any = None,
    mask: Any = None,
    *,
    is_causal: bool = False,
    return_lse: bool = False,
    **kw: Any,
) -> Any:
    """causality: the forward is the base's (exactly); the backward of a causal call masks the
    future keys with a finite logit offset of -60 instead of ``-inf`` (weights ``~e^-60``, not 0),
    so the gradient of row ``t`` with respect to future keys and values is of order ``1e-27``, not
    exactly 0 (at future_key_scale 1000, far more). Only causality demands exact zeros there:
    gradients' bound absorbs ``1e-27``, and every forward is exact."""
    out = _base(query, key, value, bias, mask, is_causal=is_causal, return_lse=return_lse, **kw)
    if not is_causal:
        return out
    o, lse = out if return_lse else (out, None)
    t, s = query.shape[1], key.shape[1]
    offset = jnp.where(_future(t, s), -60.0, 0.0).astype(query.dtype)[None, None]
    leaky_bias = offset if bias is None else bias + offset
    leaky = _base(query, key, value, leaky_bias, mask, **kw)  # gradients only
    o = _sg(o) + (leaky - _sg(leaky))  # the value is o exactly (x - x == 0)
    return (o, lse) if return_lse else o


# ----------------------------------------------------------------------------- gqa


def mqa_folded_causal(
    query: Any,
    key: Any,
    value: Any,
    bias: Any = None,
    mask: Any = None,
    *,
    is_causal: bool = False,
    return_lse: bool = False,
    **kw: Any,
) -> Any:
    """gqa: a multi-query fast path (one K/V head) folds the N query heads into the query axis
    (``[B, T, N, H]`` -> ``[B, T N, 1, H]``, exact for plain attention) and then applies the causal
    mask to the folded row index ``t N + n`` instead of ``t``; only the gqa property runs an MQA
    problem with ``is_causal`` (oracle's MQA bucket has no mask, the masked properties' buckets
    have two K/V heads)."""
    b, t, n, h = query.shape
    folded = key.shape[2] == 1 and n > 1 and bias is None and mask is None and not return_lse
    if not folded:
        return _base(
            query, key, value, bias, mask, is_causal=is_causal, return_lse=return_lse, **kw
        )
    out = _base(query.reshape(b, t * n, 1, h), key, value, is_causal=is_causal, **kw)
    return out.reshape(b, t, n, value.shape[-1])


# ----------------------------------------------------------------------------- lse


def lse_base2(
    query: Any,
    key: Any,
    value: Any,
    bias: Any = None,
    mask: Any = None,
    *,
    return_lse: bool = False,
    **kw: Any,
) -> Any:
    """lse: the output is right, the lse is returned in base 2 (``log2 sum 2^(s log2 e)``, the
    Triton kernels' internal form, never converted back to natural log); only the lse property
    asks for the lse."""
    out = _base(query, key, value, bias, mask, return_lse=return_lse, **kw)
    if return_lse:
        return out[0], out[1] / math.log(2.0)
    return out


def lse_without_mask(
    query: Any,
    key: Any,
    value: Any,
    bias: Any = None,
    mask: Any = None,
    *,
    return_lse: bool = False,
    **kw: Any,
) -> Any:
    """lse, under a boolean mask: the output is the base's, the lse is taken over every key, the
    masked ones too. Unmasked, causal and biased calls are the base's, so only an lse property
    that draws a mask kind sees it."""
    out = _base(query, key, value, bias, mask, return_lse=return_lse, **kw)
    if return_lse and mask is not None:
        return out[0], _base(query, key, value, bias, None, return_lse=True, **kw)[1]
    return out


# ----------------------------------------------------------------------------- batch_independence


def batch1_drops_mask(
    query: Any,
    key: Any,
    value: Any,
    bias: Any = None,
    mask: Any = None,
    *,
    return_lse: bool = False,
    **kw: Any,
) -> Any:
    """batch_independence: a batch-1 fast path (the single-sequence, decode-style call) drops the
    ``mask`` and ``bias`` arguments; only batch_independence runs a batch of 1 with a mask or a
    bias (each element alone), the kit's other batch-1 buckets (oracle's and gqa's MQA one) have
    none, and ``is_causal`` is kept."""
    if query.shape[0] == 1:
        bias = mask = None
    return _base(query, key, value, bias, mask, return_lse=return_lse, **kw)


# ----------------------------------------------------------------------------- fully_masked_rows


def key_padding_rows_uniform(
    query: Any,
    key: Any,
    value: Any,
    bias: Any = None,
    mask: Any = None,
    *,
    return_lse: bool = False,
    **kw: Any,
) -> Any:
    """fully_masked_rows: a key-padding fast path (a mask that broadcasts over the query axis,
    ``[.., 1, S]``) gives a row with no allowed key jax.nn's meaning (the mean of ``v``) instead
    of the declared zeros; only fully_masked_rows builds a row with no allowed key, and only in
    its drawn mask shape (its default, ``[B, 1, T, S]``, takes the right path)."""
    if mask is not None and mask.shape[2] == 1:
        kw["masked_rows"] = "uniform"
    return _base(query, key, value, bias, mask, return_lse=return_lse, **kw)


# ----------------------------------------------------------------------------- gradients


def dq_dk_without_scale(
    query: Any,
    key: Any,
    value: Any,
    bias: Any = None,
    mask: Any = None,
    *,
    return_lse: bool = False,
    **kw: Any,
) -> Any:
    """gradients: the forward is the base's (bit for bit), the backward forgets the logit scale in
    ``dq`` and ``dk`` (both ``1 / scale`` = ``sqrt(H)`` times too large); only the gradients
    property compares gradients with the oracle (causality checks that future gradients are
    exactly 0, which they stay)."""
    scale = kw.get("scale")
    c = math.sqrt(query.shape[-1]) if scale is None else 1.0 / scale

    def unscaled(x: Any) -> Any:  # value x, gradient c times
        return _sg(x) + c * (x - _sg(x))

    return _base(unscaled(query), unscaled(key), value, bias, mask, return_lse=return_lse, **kw)


def masked_dv_leak(
    query: Any,
    key: Any,
    value: Any,
    bias: Any = None,
    mask: Any = None,
    *,
    return_lse: bool = False,
    **kw: Any,
) -> Any:
    """gradients, under a boolean mask: the forward is the base's (bit for bit); the backward
    gives every masked (query, key) pair the weight ``1e-3`` in ``dv`` instead of 0 (``dv_s +=
    1e-3 sum_t g_t`` over the queries that may not read key ``s``). Unmasked and causal calls
    are the base's, so only a gradients property that draws a mask kind sees it."""
    if mask is None or return_lse:
        return _base(query, key, value, bias, mask, return_lse=return_lse, **kw)
    n, kh = query.shape[2], key.shape[2]

    @jax.custom_vjp
    def attend(q: Any, k: Any, v: Any, bias: Any, mask: Any) -> Any:
        return _base(q, k, v, bias, mask, **kw)

    def fwd(q: Any, k: Any, v: Any, bias: Any, mask: Any) -> tuple[Any, Any]:
        out, pull = jax.vjp(lambda a, b, c: _base(a, b, c, bias, mask, **kw), q, k, v)
        return out, (pull, mask, k.shape)

    def bwd(res: Any, g: Any) -> tuple[Any, ...]:
        pull, mask, (b, s, _, _) = res
        dq, dk, dv = pull(g)
        blocked = ~jnp.broadcast_to(mask, (b, n, g.shape[1], s))
        extra = jnp.einsum("bnts,btnh->bsnh", blocked.astype(g.dtype), g)  # per query head
        extra = extra.reshape(b, s, kh, n // kh, -1).sum(3)  # summed over each K/V head's group
        return dq, dk, dv + 1e-3 * extra, None, None

    attend.defvjp(fwd, bwd)
    return attend(query, key, value, bias, mask)


# ----------------------------------------------------------------------------- extreme_logits


def row_max_floor_zero(
    query: Any,
    key: Any,
    value: Any,
    bias: Any = None,
    mask: Any = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    return_lse: bool = False,
) -> Any:
    """extreme_logits: the running row max starts at 0 instead of ``-inf`` (``m = max(0, max_j
    s_ij)``): right while every row has a logit above about -80; a row whose logits all lie far
    below 0 loses its smaller weights to underflow, or all of them (0 / 0). Only extreme_logits
    draws such rows: causality scales the future keys by 1000, but every row also reads unscaled
    past keys, whose logits are of order 1."""
    return softmax_attention(
        query,
        key,
        value,
        bias,
        mask,
        scale=scale,
        is_causal=is_causal,
        return_lse=return_lse,
        max_floor=0.0,
    )


# property -> (mutant, extra check_attention arguments of both calls)
MUTANTS: dict[str, tuple[Any, dict[str, Any]]] = {
    "oracle": (float64_in_float32, {"dtypes": ("float32", "float64")}),
    "masks": (bias_row0_only, {}),
    "causality": (backward_masks_future_with_minus_60, {}),
    "gqa": (mqa_folded_causal, {}),
    "lse": (lse_base2, {}),
    "batch_independence": (batch1_drops_mask, {}),
    "fully_masked_rows": (key_padding_rows_uniform, {}),
    "gradients": (dq_dk_without_scale, {}),
    "extreme_logits": (row_max_floor_zero, {}),
}
