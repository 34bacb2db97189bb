"""Multi-head linear attention: per-head projections, a kernel-level form, the output mixing.

Row vectors, batch dims lead: ``x_q [..., T_q, d_model]``, ``x_kv [..., T_k, d_model]``. Query
head ``i`` reads key/value head ``i // G`` (``G = H / K``): ``q_i = x_q W_Q[i] + b_Q[i]``,
``k_i = x_kv W_K[i // G] + b_K[i // G]``, ``v_i = x_kv W_V[i // G] + b_V[i // G]``; the
kernel-level form (:mod:`attnref._src.formulations.linear.kernel`, whose docstring states the denominator
policy and the forms) gives ``z_i``, and ``y = sum_i z_i W_O[i] + b_O``. The messages form
``linear_messages_attention`` mixes ``X_kv W_M[i]`` with the normalised linear weights instead.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float, Real

from attnref._src.core.checks import check_tokens, float64_scoped
from attnref._src.core.common import HIGHEST, add_output_bias, project, project_kv, residual_or
from attnref._src.core.params import AttentionParams
from attnref._src.formulations.feature_maps import FeatureMapLike, check_feature_map
from attnref._src.formulations.linear.common import (
    UNGUARDED,
    EpsPolicy,
    causal_pairs,
    check_policy,
    check_qkv,
    features,
    guarded_rows,
    normalize,
)
from attnref._src.formulations.linear.kernel import (
    linear_associative,
    linear_chunked,
    linear_prefix_sum,
    linear_quadratic,
    linear_recurrent,
)
from attnref._src.formulations.merged import compute_messages

KERNEL_FORMS = {
    "quadratic": linear_quadratic,
    "associative": linear_associative,
    "prefix_sum": linear_prefix_sum,
    "recurrent": linear_recurrent,
    "chunked": linear_chunked,
}


def multihead(
    form: str,
    params: AttentionParams,
    x_q: ArrayLike,
    x_kv: ArrayLike | None,
    key_mask: ArrayLike | None,
    residual: bool,
    **kwargs: Any,
) -> Array:
    check_feature_map(kwargs.get("feature_map"))
    x_kv = x_q if x_kv is None else x_kv
    check_tokens(params, x_q, x_kv)
    xq, xkv = jnp.asarray(x_q), jnp.asarray(x_kv)

    g = params.group_size
    kernel = UNGUARDED[KERNEL_FORMS[form].__name__]  # the guard is applied once, on the rows

    def heads(y: Array) -> Array:
        return jnp.swapaxes(y, -3, -2)  # [..., H, T, d] -> [..., T, H, d]

    def compute(xq: Array, xkv: Array) -> Array:
        q = heads(project(xq, params.w_q, params.b_q))
        k = heads(project_kv(xkv, params.w_k, params.b_k, g))  # K/V head i // G for query head i
        v = heads(project_kv(xkv, params.w_v, params.b_v, g))
        z = kernel(q, k, v, key_mask=key_mask, **kwargs)  # [..., T_q, H, d_v]
        y = jnp.einsum("...qhv,hvd->...qd", z, params.w_o, precision=HIGHEST)
        return residual_or(add_output_bias(y, params), xq, residual)

    return guarded_rows(compute, xq, xkv, key_mask, kwargs["causal"], residual)


@float64_scoped
def linear_quadratic_attention(
    params: AttentionParams,
    x_q: Float[ArrayLike, "... T_q d_model"],
    x_kv: Float[ArrayLike, "... T_k d_model"] | None = None,
    *,
    feature_map: FeatureMapLike,
    causal: bool = False,
    key_mask: Bool[ArrayLike, "... T_k"] | None = None,
    eps: Real[ArrayLike, ""] = 0.0,
    eps_policy: EpsPolicy = "add",
    residual: bool = False,
) -> Float[Array, "... T_q d_model"]:
    """Multi-head linear attention, quadratic form.

    Kernel level: ``A = phi(Q) phi(K)^T`` (masked), ``Y = (A V) / (A 1)``.

    Per query head ``q_i = x W_Q[i] + b_Q[i]``, ``k_i = x W_K[i // G] + b_K[i // G]``,
    ``v_i = x W_V[i // G] + b_V[i // G]`` (``G = H / K``), then :func:`linear_quadratic` on the
    kernel level, then ``y = sum_i z_i W_O[i] + b_O``. Row vectors, batch dims lead.

    Args:
        params: per-head weights (:class:`attnref.AttentionParams`).
        x_q: query tokens ``[..., T_q, d_model]``.
        x_kv: key/value tokens ``[..., T_k, d_model]``; ``None`` means ``x_q`` (self-attention).
        feature_map: the kernel's feature map ``phi`` (:mod:`attnref.linear`).
        causal: query ``t`` reads keys ``s <= t`` only (needs ``T_q == T_k``); default
            ``False``.
        key_mask: ``True`` = key may be read, ``[..., T_k]`` (exactly the batch dims of
            ``x_q``); ``None`` (default) allows every key.
        eps: the denominator's regulariser, a scalar ``>= 0`` (default 0: the exact ratio).
        eps_policy: ``"add"`` (default, ``den + eps``) or ``"clamp"`` (``max(den, eps)``).
        residual: return ``x_q + y`` instead of ``y``.

    Returns:
        The block output ``[..., T_q, d_model]``, the dtype of ``x_q``; a query with no allowed
        key gets ``b_O`` (zero without biases).

    Raises:
        ValueError: If ``params`` is malformed, ``x_q``/``x_kv`` are not ``[..., T, d_model]``
            with one batch shape, ``key_mask`` is not ``[..., T_k]``, ``eps`` is negative or not
            a scalar, ``eps_policy`` is unknown, or ``causal`` with ``T_q != T_k``.
        TypeError: If ``x_q``, ``x_kv`` and ``params`` mix dtypes, ``causal`` is not a Python
            bool, ``key_mask`` is not boolean, or ``feature_map`` is not a called feature map.
    """
    return multihead(
        "quadratic",
        params,
        x_q,
        x_kv,
        key_mask,
        residual,
        feature_map=feature_map,
        causal=causal,
        eps=eps,
        eps_policy=eps_policy,
    )


@float64_scoped
def linear_associative_attention(
    params: AttentionParams,
    x_q: Float[ArrayLike, "... T_q d_model"],
    x_kv: Float[ArrayLike, "... T_k d_model"] | None = None,
    *,
    feature_map: FeatureMapLike,
    causal: bool = False,
    key_mask: Bool[ArrayLike, "... T_k"] | None = None,
    eps: Real[ArrayLike, ""] = 0.0,
    eps_policy: EpsPolicy = "add",
    residual: bool = False,
) -> Float[Array, "... T_q d_model"]:
    """Multi-head linear attention, associative form.

    Kernel level: ``phi(Q) (phi(K)^T V) / (phi(Q) (phi(K)^T 1))`` (non-causal only).

    Per query head ``q_i = x W_Q[i] + b_Q[i]``, ``k_i = x W_K[i // G] + b_K[i // G]``,
    ``v_i = x W_V[i // G] + b_V[i // G]`` (``G = H / K``), then :func:`linear_associative` on the
    kernel level, then ``y = sum_i z_i W_O[i] + b_O``. Row vectors, batch dims lead.

    Args:
        params: per-head weights (:class:`attnref.AttentionParams`).
        x_q: query tokens ``[..., T_q, d_model]``.
        x_kv: key/value tokens ``[..., T_k, d_model]``; ``None`` means ``x_q`` (self-attention).
        feature_map: the kernel's feature map ``phi`` (:mod:`attnref.linear`).
        causal: must be ``False`` (the default): the associative form is non-causal.
        key_mask: ``True`` = key may be read, ``[..., T_k]`` (exactly the batch dims of
            ``x_q``); ``None`` (default) allows every key.
        eps: the denominator's regulariser, a scalar ``>= 0`` (default 0: the exact ratio).
        eps_policy: ``"add"`` (default, ``den + eps``) or ``"clamp"`` (``max(den, eps)``).
        residual: return ``x_q + y`` instead of ``y``.

    Returns:
        The block output ``[..., T_q, d_model]``, the dtype of ``x_q``; a query with no allowed
        key gets ``b_O`` (zero without biases).

    Raises:
        ValueError: If ``params`` is malformed, ``x_q``/``x_kv`` are not ``[..., T, d_model]``
            with one batch shape, ``key_mask`` is not ``[..., T_k]``, ``eps`` is negative or not
            a scalar, ``eps_policy`` is unknown, or ``causal=True``.
        TypeError: If ``x_q``, ``x_kv`` and ``params`` mix dtypes, ``causal`` is not a Python
            bool, ``key_mask`` is not boolean, or ``feature_map`` is not a called feature map.
    """
    return multihead(
        "associative",
        params,
        x_q,
        x_kv,
        key_mask,
        residual,
        feature_map=feature_map,
        causal=causal,
        eps=eps,
        eps_policy=eps_policy,
    )


@float64_scoped
def linear_prefix_sum_attention(
    params: AttentionParams,
    x_q: Float[ArrayLike, "... T_q d_model"],
    x_kv: Float[ArrayLike, "... T_k d_model"] | None = None,
    *,
    feature_map: FeatureMapLike,
    causal: bool = True,
    key_mask: Bool[ArrayLike, "... T_k"] | None = None,
    eps: Real[ArrayLike, ""] = 0.0,
    eps_policy: EpsPolicy = "add",
    residual: bool = False,
) -> Float[Array, "... T_q d_model"]:
    """Multi-head linear attention, prefix_sum form.

    Kernel level: running sums ``S_t = sum_{s<=t} phi(k_s) v_s^T`` (causal only).

    Per query head ``q_i = x W_Q[i] + b_Q[i]``, ``k_i = x W_K[i // G] + b_K[i // G]``,
    ``v_i = x W_V[i // G] + b_V[i // G]`` (``G = H / K``), then :func:`linear_prefix_sum` on the
    kernel level, then ``y = sum_i z_i W_O[i] + b_O``. Row vectors, batch dims lead.

    Args:
        params: per-head weights (:class:`attnref.AttentionParams`).
        x_q: query tokens ``[..., T_q, d_model]``.
        x_kv: key/value tokens ``[..., T_k, d_model]``; ``None`` means ``x_q`` (self-attention).
        feature_map: the kernel's feature map ``phi`` (:mod:`attnref.linear`).
        causal: must be ``True`` (the default): query ``t`` reads keys ``s <= t`` only
            (needs ``T_q == T_k``).
        key_mask: ``True`` = key may be read, ``[..., T_k]`` (exactly the batch dims of
            ``x_q``); ``None`` (default) allows every key.
        eps: the denominator's regulariser, a scalar ``>= 0`` (default 0: the exact ratio).
        eps_policy: ``"add"`` (default, ``den + eps``) or ``"clamp"`` (``max(den, eps)``).
        residual: return ``x_q + y`` instead of ``y``.

    Returns:
        The block output ``[..., T_q, d_model]``, the dtype of ``x_q``; a query with no allowed
        key gets ``b_O`` (zero without biases).

    Raises:
        ValueError: If ``params`` is malformed, ``x_q``/``x_kv`` are not ``[..., T, d_model]``
            with one batch shape, ``key_mask`` is not ``[..., T_k]``, ``eps`` is negative or not
            a scalar, ``eps_policy`` is unknown, ``causal=False``, or ``T_q != T_k``.
        TypeError: If ``x_q``, ``x_kv`` and ``params`` mix dtypes, ``causal`` is not a Python
            bool, ``key_mask`` is not boolean, or ``feature_map`` is not a called feature map.
    """
    return multihead(
        "prefix_sum",
        params,
        x_q,
        x_kv,
        key_mask,
        residual,
        feature_map=feature_map,
        causal=causal,
        eps=eps,
        eps_policy=eps_policy,
    )


@float64_scoped
def linear_recurrent_attention(
    params: AttentionParams,
    x_q: Float[ArrayLike, "... T_q d_model"],
    x_kv: Float[ArrayLike, "... T_k d_model"] | None = None,
    *,
    feature_map: FeatureMapLike,
    causal: bool = True,
    key_mask: Bool[ArrayLike, "... T_k"] | None = None,
    eps: Real[ArrayLike, ""] = 0.0,
    eps_policy: EpsPolicy = "add",
    residual: bool = False,
) -> Float[Array, "... T_q d_model"]:
    """Multi-head linear attention, recurrent form.

    Kernel level: the state recurrence ``S_t = S_{t-1} + phi(k_t) v_t^T`` under ``lax.scan``
    (causal only).

    Per query head ``q_i = x W_Q[i] + b_Q[i]``, ``k_i = x W_K[i // G] + b_K[i // G]``,
    ``v_i = x W_V[i // G] + b_V[i // G]`` (``G = H / K``), then :func:`linear_recurrent` on the
    kernel level, then ``y = sum_i z_i W_O[i] + b_O``. Row vectors, batch dims lead.

    Args:
        params: per-head weights (:class:`attnref.AttentionParams`).
        x_q: query tokens ``[..., T_q, d_model]``.
        x_kv: key/value tokens ``[..., T_k, d_model]``; ``None`` means ``x_q`` (self-attention).
        feature_map: the kernel's feature map ``phi`` (:mod:`attnref.linear`).
        causal: must be ``True`` (the default): query ``t`` reads keys ``s <= t`` only
            (needs ``T_q == T_k``).
        key_mask: ``True`` = key may be read, ``[..., T_k]`` (exactly the batch dims of
            ``x_q``); ``None`` (default) allows every key.
        eps: the denominator's regulariser, a scalar ``>= 0`` (default 0: the exact ratio).
        eps_policy: ``"add"`` (default, ``den + eps``) or ``"clamp"`` (``max(den, eps)``).
        residual: return ``x_q + y`` instead of ``y``.

    Returns:
        The block output ``[..., T_q, d_model]``, the dtype of ``x_q``; a query with no allowed
        key gets ``b_O`` (zero without biases).

    Raises:
        ValueError: If ``params`` is malformed, ``x_q``/``x_kv`` are not ``[..., T, d_model]``
            with one batch shape, ``key_mask`` is not ``[..., T_k]``, ``eps`` is negative or not
            a scalar, ``eps_policy`` is unknown, ``causal=False``, or ``T_q != T_k``.
        TypeError: If ``x_q``, ``x_kv`` and ``params`` mix dtypes, ``causal`` is not a Python
            bool, ``key_mask`` is not boolean, or ``feature_map`` is not a called feature map.
    """
    return multihead(
        "recurrent",
        params,
        x_q,
        x_kv,
        key_mask,
        residual,
        feature_map=feature_map,
        causal=causal,
        eps=eps,
        eps_policy=eps_policy,
    )


@float64_scoped
def linear_chunked_attention(
    params: AttentionParams,
    x_q: Float[ArrayLike, "... T_q d_model"],
    x_kv: Float[ArrayLike, "... T_k d_model"] | None = None,
    *,
    feature_map: FeatureMapLike,
    causal: bool = True,
    key_mask: Bool[ArrayLike, "... T_k"] | None = None,
    eps: Real[ArrayLike, ""] = 0.0,
    eps_policy: EpsPolicy = "add",
    residual: bool = False,
    chunk_size: int = 16,
) -> Float[Array, "... T_q d_model"]:
    """Multi-head linear attention, chunked form.

    Kernel level: quadratic inside chunks of ``chunk_size`` tokens plus a carried state
    (causal only).

    Per query head ``q_i = x W_Q[i] + b_Q[i]``, ``k_i = x W_K[i // G] + b_K[i // G]``,
    ``v_i = x W_V[i // G] + b_V[i // G]`` (``G = H / K``), then :func:`linear_chunked` on the
    kernel level, then ``y = sum_i z_i W_O[i] + b_O``. Row vectors, batch dims lead.

    Args:
        params: per-head weights (:class:`attnref.AttentionParams`).
        x_q: query tokens ``[..., T_q, d_model]``.
        x_kv: key/value tokens ``[..., T_k, d_model]``; ``None`` means ``x_q`` (self-attention).
        feature_map: the kernel's feature map ``phi`` (:mod:`attnref.linear`).
        causal: must be ``True`` (the default): query ``t`` reads keys ``s <= t`` only
            (needs ``T_q == T_k``).
        key_mask: ``True`` = key may be read, ``[..., T_k]`` (exactly the batch dims of
            ``x_q``); ``None`` (default) allows every key.
        eps: the denominator's regulariser, a scalar ``>= 0`` (default 0: the exact ratio).
        eps_policy: ``"add"`` (default, ``den + eps``) or ``"clamp"`` (``max(den, eps)``).
        residual: return ``x_q + y`` instead of ``y``.
        chunk_size: tokens per chunk, a positive int (default 16; static).

    Returns:
        The block output ``[..., T_q, d_model]``, the dtype of ``x_q``; a query with no allowed
        key gets ``b_O`` (zero without biases).

    Raises:
        ValueError: If ``params`` is malformed, ``x_q``/``x_kv`` are not ``[..., T, d_model]``
            with one batch shape, ``key_mask`` is not ``[..., T_k]``, ``eps`` is negative or not
            a scalar, ``eps_policy`` is unknown, ``causal=False``, ``T_q != T_k``, or
            ``chunk_size`` is not a positive int.
        TypeError: If ``x_q``, ``x_kv`` and ``params`` mix dtypes, ``causal`` is not a Python
            bool, ``key_mask`` is not boolean, or ``feature_map`` is not a called feature map.
    """
    return multihead(
        "chunked",
        params,
        x_q,
        x_kv,
        key_mask,
        residual,
        feature_map=feature_map,
        causal=causal,
        eps=eps,
        eps_policy=eps_policy,
        chunk_size=chunk_size,
    )


@float64_scoped
def linear_messages_attention(
    params: AttentionParams,
    x_q: Float[ArrayLike, "... T_q d_model"],
    x_kv: Float[ArrayLike, "... T_k d_model"] | None = None,
    *,
    feature_map: FeatureMapLike,
    causal: bool = False,
    key_mask: Bool[ArrayLike, "... T_k"] | None = None,
    eps: Real[ArrayLike, ""] = 0.0,
    eps_policy: EpsPolicy = "add",
    residual: bool = False,
) -> Float[Array, "... T_q d_model"]:
    """Messages form: ``sum_i A_i (X_kv W_M[i] + b_V[i // G] W_O[i]) + b_O`` with the normalised
    linear attention matrix ``A_i = rownorm(phi(Q_i) phi(K_i)^T)`` (masked), ``K_i`` projected
    by key/value head ``i // G``.

    Args:
        params: per-head weights (:class:`attnref.AttentionParams`).
        x_q: query tokens ``[..., T_q, d_model]``.
        x_kv: key/value tokens ``[..., T_k, d_model]``; ``None`` means ``x_q`` (self-attention).
        feature_map: the kernel's feature map ``phi`` (:mod:`attnref.linear`).
        causal: query ``t`` reads keys ``s <= t`` only (needs ``T_q == T_k``); default
            ``False``.
        key_mask: ``True`` = key may be read, ``[..., T_k]`` (exactly the batch dims of
            ``x_q``); ``None`` (default) allows every key.
        eps: the denominator's regulariser, a scalar ``>= 0`` (default 0: the exact ratio).
        eps_policy: ``"add"`` (default, ``den + eps``) or ``"clamp"`` (``max(den, eps)``).
        residual: return ``x_q + y`` instead of ``y``.

    Returns:
        The block output ``[..., T_q, d_model]``, the dtype of ``x_q``; a query with no allowed
        key gets ``b_O`` (zero without biases).

    Raises:
        ValueError: If ``params`` is malformed, ``x_q``/``x_kv`` are not ``[..., T, d_model]``
            with one batch shape, ``key_mask`` is not ``[..., T_k]``, ``eps`` is negative or not
            a scalar, ``eps_policy`` is unknown, or ``causal`` with ``T_q != T_k``.
        TypeError: If ``x_q``, ``x_kv`` and ``params`` mix dtypes, ``causal`` is not a Python
            bool, ``key_mask`` is not boolean, or ``feature_map`` is not a called feature map.
    """
    check_feature_map(feature_map)
    x_kv = x_q if x_kv is None else x_kv
    check_tokens(params, x_q, x_kv)  # validates params too
    g = params.group_size

    def compute(xq: Array, xkv: Array) -> Array:
        q = jnp.swapaxes(project(xq, params.w_q, params.b_q), -3, -2)
        k = jnp.swapaxes(project_kv(xkv, params.w_k, params.b_k, g), -3, -2)
        check_qkv(q, k, k, key_mask, causal)
        check_policy(eps, eps_policy)
        km = None if key_mask is None else jnp.asarray(key_mask)
        fq, fk, c = features(feature_map, q, k, km)
        a = jnp.einsum("...qhm,...khm->...hqk", fq, fk, precision=HIGHEST)
        if causal:
            a = jnp.where(causal_pairs(a.shape[-1]), a, jnp.zeros_like(a))
        den = jnp.sum(a, axis=-1)  # [..., H, T_q]
        c = None if c is None else jnp.swapaxes(c, -1, -2)  # [..., H, T_q], as den
        a = normalize(a, den, eps, eps_policy, c)  # row-normalised, zero rows where den = 0
        msgs = compute_messages(params, xkv)  # X_kv W_M[i] + b_V[i // G] W_O[i]
        y = jnp.sum(jnp.einsum("...hqk,...hkd->...hqd", a, msgs, precision=HIGHEST), axis=-3)
        return residual_or(add_output_bias(y, params), xq, residual)

    xq, xkv = jnp.asarray(x_q), jnp.asarray(x_kv)
    return guarded_rows(compute, xq, xkv, key_mask, causal, residual)


# ----------------------------------------------------------------------------- the linear family
