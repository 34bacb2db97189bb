"""Linear (kernel) attention in every form (Katharopoulos et al. 2020, "Transformers are RNNs").

Kernel level, heads on the second-to-last axis (the layout of ``jax.nn.dot_product_attention``):
``q [..., T_q, H, d_k]``, ``k [..., T_k, H, d_k]``, ``v [..., T_k, H, d_v]``, output
``[..., T_q, H, d_v]``.
With ``A_ij = phi(q_i).phi(k_j)`` over the allowed keys ``j`` (``key_mask`` True and, if
``causal``, ``j <= i``)::

    y_i = (sum_j A_ij v_j) / den_i,   den_i = sum_j A_ij

**Denominator policy** (one rule for every form and the oracle): ``eps_policy="add"`` (default)
divides by ``den_i + eps``, as fast-transformers' ``LinearAttention`` does (``eps = 1e-6`` there);
``eps_policy="clamp"`` divides by ``max(den_i, eps)``. ``den_i`` is the sum of the *defined*
``A_ij``: FAVOR+'s stabilised features carry a per-query factor ``exp(-c_i)``, and ``eps`` is
rescaled by the same factor (:func:`normalize`), so ``eps`` means the same under every map.
The default ``eps = 0`` is the exact ratio; as ``eps -> 0`` both policies converge to it, with
relative error ``eps / den_i`` for ``add``.
Wherever the adjusted denominator is exactly zero (no allowed key, or exact cancellation with a
signed map) the output is zero, never NaN, and the gradient is finite. With a signed map
(``identity``) the denominator can be close to zero with keys present: the ratio is then
ill-conditioned and grows like ``1 / den_i``; attnref reproduces that exactly rather than hiding
it (see ``docs/formulations/linear_*.md``).

Forms: quadratic (materialise ``A``), associative (``phi(Q) (phi(K)^T V)``, non-causal), causal
prefix sums, recurrent (``lax.scan`` over the state ``(S_t, z_t)``), chunked (quadratic inside
chunks plus the carried state). Causal forms need ``T_q == T_k`` (self-attention, aligned).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Float, Real

from attnref._src.core.checks import float64_scoped
from attnref._src.core.common import HIGHEST
from attnref._src.formulations.feature_maps import (  # FeatureMap: the docstrings' :class: roles resolve here
    FeatureMap,  # noqa: F401
    FeatureMapLike,
    check_feature_map,
)
from attnref._src.formulations.linear.common import (
    EpsPolicy,
    causal_pairs,
    check_policy,
    check_qkv,
    features,
    guarded_kernel,
    normalize,
    query,
)

# ----------------------------------------------------------------------------- kernel level


def quadratic_parts(
    fq: Array, fk: Array, v: Array, causal: bool
) -> tuple[Float[Array, "... T_q H d_v"], Float[Array, "... T_q H"]]:
    a = jnp.einsum("...qhm,...khm->...hqk", fq, fk, precision=HIGHEST)
    if causal:
        a = jnp.where(causal_pairs(a.shape[-1]), a, jnp.zeros_like(a))
    num = jnp.einsum("...hqk,...khv->...qhv", a, v, precision=HIGHEST)
    return num, jnp.swapaxes(jnp.sum(a, axis=-1), -1, -2)


@float64_scoped
@guarded_kernel
def linear_quadratic(
    q: Float[ArrayLike, "... T_q H d_k"],
    k: Float[ArrayLike, "... T_k H d_k"],
    v: Float[ArrayLike, "... T_k H d_v"],
    *,
    feature_map: FeatureMapLike,
    causal: bool = False,
    key_mask: Bool[ArrayLike, "... T_k"] | None = None,
    eps: Real[ArrayLike, ""] = 0.0,
    eps_policy: EpsPolicy = "add",
) -> Float[Array, "... T_q H d_v"]:
    """Quadratic form: ``A = phi(Q) phi(K)^T`` (masked), ``Y = (A V) / (A 1)`` row-wise.

    Args:
        q: Queries ``[..., T_q, H, d_k]`` (the ``jax.nn`` layout: heads second to last).
        k: Keys ``[..., T_k, H, d_k]``, the batch dims, heads and dtype of ``q``.
        v: Values ``[..., T_k, H, d_v]``, the dtype of ``q``.
        feature_map: The feature map ``phi``, a called :class:`FeatureMap`
            (e.g. :func:`attnref.linear.elu_plus_one`).
        causal: If ``True``, query ``i`` reads keys ``j <= i`` only (needs ``T_q == T_k``);
            default ``False``.
        key_mask: Boolean ``[..., T_k]`` (exactly the batch dims of ``q``), ``True`` = the key
            may be read; ``None`` (default) allows every key.
        eps: The denominator's regulariser, a scalar ``>= 0``; the default 0 is the exact ratio.
        eps_policy: ``"add"`` (default, divide by ``den + eps``) or ``"clamp"`` (by
            ``max(den, eps)``).

    Returns:
        ``y [..., T_q, H, d_v]`` in the dtype of ``q``; zero where the adjusted denominator is
        exactly zero (e.g. no allowed key).

    Raises:
        ValueError: If ``q``/``k``/``v`` are not ``[..., T, H, d]`` with matching batch dims,
            heads and ``d_k``, ``key_mask`` is not ``[..., T_k]``, ``eps`` is negative or not a
            scalar, ``eps_policy`` is unknown, or ``causal`` with ``T_q != T_k``.
        TypeError: If ``causal`` is not a Python bool, ``q``/``k``/``v`` differ in dtype,
            ``key_mask`` is not boolean, or ``feature_map`` is not a (called) feature map.
    """
    check_qkv(q, k, v, key_mask, causal)
    check_policy(eps, eps_policy)
    km = None if key_mask is None else jnp.asarray(key_mask)
    fq, fk, c = features(feature_map, jnp.asarray(q), jnp.asarray(k), km)
    num, den = quadratic_parts(fq, fk, jnp.asarray(v), causal)
    return normalize(num, den, eps, eps_policy, c)


@float64_scoped
@guarded_kernel
def linear_associative(
    q: Float[ArrayLike, "... T_q H d_k"],
    k: Float[ArrayLike, "... T_k H d_k"],
    v: Float[ArrayLike, "... T_k H d_v"],
    *,
    feature_map: FeatureMapLike,
    causal: bool = False,
    key_mask: Bool[ArrayLike, "... T_k"] | None = None,
    eps: Real[ArrayLike, ""] = 0.0,
    eps_policy: EpsPolicy = "add",
) -> Float[Array, "... T_q H d_v"]:
    """Associative (non-causal) form: ``phi(Q) (phi(K)^T V) / (phi(Q) (phi(K)^T 1))``.

    Args:
        q: Queries ``[..., T_q, H, d_k]`` (the ``jax.nn`` layout: heads second to last).
        k: Keys ``[..., T_k, H, d_k]``, the batch dims, heads and dtype of ``q``.
        v: Values ``[..., T_k, H, d_v]``, the dtype of ``q``.
        feature_map: The feature map ``phi``, a called :class:`FeatureMap`
            (e.g. :func:`attnref.linear.elu_plus_one`).
        causal: Must be ``False`` (the default): this form is non-causal.
        key_mask: Boolean ``[..., T_k]`` (exactly the batch dims of ``q``), ``True`` = the key
            may be read; ``None`` (default) allows every key.
        eps: The denominator's regulariser, a scalar ``>= 0``; the default 0 is the exact ratio.
        eps_policy: ``"add"`` (default, divide by ``den + eps``) or ``"clamp"`` (by
            ``max(den, eps)``).

    Returns:
        ``y [..., T_q, H, d_v]`` in the dtype of ``q``; zero where the adjusted denominator is
        exactly zero (e.g. no allowed key).

    Raises:
        ValueError: If ``q``/``k``/``v`` are not ``[..., T, H, d]`` with matching batch dims,
            heads and ``d_k``, ``key_mask`` is not ``[..., T_k]``, ``eps`` is negative or not a
            scalar, ``eps_policy`` is unknown, or ``causal=True``.
        TypeError: If ``causal`` is not a Python bool, ``q``/``k``/``v`` differ in dtype,
            ``key_mask`` is not boolean, or ``feature_map`` is not a (called) feature map.
    """
    if isinstance(causal, (bool, np.bool_)) and causal:  # a non-bool: TypeError in _check_qkv
        raise ValueError(
            "linear_associative is non-causal; use linear_prefix_sum, "
            "linear_recurrent or linear_chunked for causal attention"
        )
    check_qkv(q, k, v, key_mask, causal)
    check_policy(eps, eps_policy)
    km = None if key_mask is None else jnp.asarray(key_mask)
    fq, fk, c = features(feature_map, jnp.asarray(q), jnp.asarray(k), km)
    s = jnp.einsum("...khm,...khv->...hmv", fk, jnp.asarray(v), precision=HIGHEST)
    z = jnp.sum(fk, axis=-3)
    num = jnp.einsum("...qhm,...hmv->...qhv", fq, s, precision=HIGHEST)
    den = jnp.einsum("...qhm,...hm->...qh", fq, z, precision=HIGHEST)
    return normalize(num, den, eps, eps_policy, c)


def require_causal(name: str, causal: bool) -> None:
    if isinstance(causal, (bool, np.bool_)) and not causal:  # a non-bool: TypeError (_check_qkv)
        raise ValueError(
            f"{name} is a causal form (causal=True); use linear_associative or "
            "linear_quadratic for non-causal attention"
        )


@float64_scoped
@guarded_kernel
def linear_prefix_sum(
    q: Float[ArrayLike, "... T H d_k"],
    k: Float[ArrayLike, "... T H d_k"],
    v: Float[ArrayLike, "... T H d_v"],
    *,
    feature_map: FeatureMapLike,
    causal: bool = True,
    key_mask: Bool[ArrayLike, "... T"] | None = None,
    eps: Real[ArrayLike, ""] = 0.0,
    eps_policy: EpsPolicy = "add",
) -> Float[Array, "... T H d_v"]:
    """Causal prefix sums: ``S_t = sum_{j<=t} phi(k_j) v_j^T``, ``z_t = sum_{j<=t} phi(k_j)``,
    ``y_t = phi(q_t) S_t / (phi(q_t) z_t)`` (memory ``T m d_v`` per head).

    Args:
        q: Queries ``[..., T, H, d_k]`` (the ``jax.nn`` layout: heads second to last).
        k: Keys ``[..., T, H, d_k]``, the batch dims, heads and dtype of ``q``.
        v: Values ``[..., T, H, d_v]``, the dtype of ``q``.
        feature_map: The feature map ``phi``, a called :class:`FeatureMap`
            (e.g. :func:`attnref.linear.elu_plus_one`).
        causal: Must be ``True`` (the default): ``linear_prefix_sum`` is a causal form.
        key_mask: Boolean ``[..., T]`` (exactly the batch dims of ``q``), ``True`` = the key
            may be read; ``None`` (default) allows every key.
        eps: The denominator's regulariser, a scalar ``>= 0``; the default 0 is the exact ratio.
        eps_policy: ``"add"`` (default, divide by ``den + eps``) or ``"clamp"`` (by
            ``max(den, eps)``).

    Returns:
        ``y [..., T, H, d_v]`` in the dtype of ``q``; zero where the adjusted denominator is
        exactly zero (e.g. no allowed key).

    Raises:
        ValueError: If ``q``/``k``/``v`` are not ``[..., T, H, d]`` with matching batch dims,
            heads and ``d_k``, ``key_mask`` is not ``[..., T_k]``, ``eps`` is negative or not a
            scalar, ``eps_policy`` is unknown, ``causal=False``, or ``T_q != T_k``.
        TypeError: If ``causal`` is not a Python bool, ``q``/``k``/``v`` differ in dtype,
            ``key_mask`` is not boolean, or ``feature_map`` is not a (called) feature map.
    """
    require_causal("linear_prefix_sum", causal)
    check_qkv(q, k, v, key_mask, causal)
    check_policy(eps, eps_policy)
    km = None if key_mask is None else jnp.asarray(key_mask)
    fq, fk, c = features(feature_map, jnp.asarray(q), jnp.asarray(k), km)
    kv = jnp.einsum("...thm,...thv->...thmv", fk, jnp.asarray(v), precision=HIGHEST)
    s = jnp.cumsum(kv, axis=-4)
    z = jnp.cumsum(fk, axis=-3)
    num = jnp.einsum("...thm,...thmv->...thv", fq, s, precision=HIGHEST)
    den = jnp.einsum("...thm,...thm->...th", fq, z, precision=HIGHEST)
    return normalize(num, den, eps, eps_policy, c)


class LinearState(NamedTuple):
    """Recurrent state of causal linear attention: ``S [..., H, m, d_v]``, ``z [..., H, m]``.

    Attributes:
        s: ``S = sum_j phi(k_j) v_j^T`` over the keys appended so far, ``[..., H, m, d_v]``
            (``m`` features).
        z: ``z = sum_j phi(k_j)``, ``[..., H, m]``.
    """

    s: Array
    z: Array


def linear_state_init(
    batch_shape: tuple[int, ...], num_heads: int, num_features: int, d_v: int, dtype: Any
) -> LinearState:
    """The empty state ``(0, 0)``: constant memory, whatever the sequence length.

    Args:
        batch_shape: The leading batch dims ``...`` (a tuple, possibly empty).
        num_heads: The number of heads ``H``.
        num_features: The feature count ``m`` (``feature_map.num_features(d_k)``).
        d_v: The value head dim.
        dtype: The state's dtype.

    Returns:
        A :class:`LinearState` of zeros, ``s [..., H, m, d_v]`` and ``z [..., H, m]``.
    """
    return LinearState(
        jnp.zeros((*batch_shape, num_heads, num_features, d_v), dtype),
        jnp.zeros((*batch_shape, num_heads, num_features), dtype),
    )


def linear_step(
    state: LinearState,
    q_t: Float[Array, "... H d_k"],
    k_t: Float[Array, "... H d_k"],
    v_t: Float[Array, "... H d_v"],
    *,
    feature_map: FeatureMapLike,
    key_valid: Bool[Array, "..."] | None = None,
    eps: Real[ArrayLike, ""] = 0.0,
    eps_policy: EpsPolicy = "add",
) -> tuple[LinearState, Float[Array, "... H d_v"]]:
    """One decoding step (the RNN view): ``S += phi(k_t) v_t^T``, ``z += phi(k_t)``, read out.

    ``key_valid`` (per batch element) skips the append for padding positions.

    Args:
        state: The state before this token (:class:`LinearState`), ``s [..., H, m, d_v]``,
            ``z [..., H, m]``.
        q_t: This token's queries ``[..., H, d_k]``.
        k_t: This token's keys ``[..., H, d_k]``.
        v_t: This token's values ``[..., H, d_v]``.
        feature_map: The feature map ``phi``, a called :class:`FeatureMap` giving ``m``
            features.
        key_valid: Boolean ``[...]`` (batch dims), ``False`` = padding: ``k_t``, ``v_t`` are
            not appended; ``None`` (default) appends every element.
        eps: The denominator's regulariser, a scalar ``>= 0`` (default 0, the exact ratio).
        eps_policy: ``"add"`` (default, ``den + eps``) or ``"clamp"`` (``max(den, eps)``).

    Returns:
        ``(state, y_t)``: the updated :class:`LinearState` and the output ``y_t [..., H, d_v]``
        (zero where the adjusted denominator is exactly zero).

    Raises:
        ValueError: If ``q_t``/``k_t``/``v_t`` do not match the state's ``[..., H]``, ``v_t``
            or the feature count does not match the state, ``eps`` is negative or not a
            scalar, or ``eps_policy`` is unknown.
        TypeError: If ``feature_map`` is not a (called) feature map.
    """
    check_feature_map(feature_map)
    lead = tuple(np.shape(state.z))[:-1]  # batch dims + H
    for name, a in (("q_t", q_t), ("k_t", k_t), ("v_t", v_t)):
        if tuple(np.shape(a))[:-1] != lead:
            raise ValueError(
                f"{name} has shape {tuple(np.shape(a))}; the state expects "
                f"[..., H] = {lead} before the feature axis"
            )
    if np.shape(v_t)[-1] != np.shape(state.s)[-1]:
        raise ValueError(f"v_t has d_v={np.shape(v_t)[-1]}; the state has {np.shape(state.s)[-1]}")
    check_policy(eps, eps_policy)
    (fq, c), fk = query(feature_map, jnp.asarray(q_t)), feature_map(k_t, "key")
    if fk.shape[-1] != np.shape(state.z)[-1]:
        raise ValueError(
            f"the feature map gives {fk.shape[-1]} features; the state has {np.shape(state.z)[-1]}"
        )
    if key_valid is not None:
        fk = jnp.where(key_valid[..., None, None], fk, jnp.zeros_like(fk))
    s = state.s + jnp.einsum("...hm,...hv->...hmv", fk, v_t, precision=HIGHEST)
    z = state.z + fk
    num = jnp.einsum("...hm,...hmv->...hv", fq, s, precision=HIGHEST)
    den = jnp.einsum("...hm,...hm->...h", fq, z, precision=HIGHEST)
    return LinearState(s, z), normalize(num, den, eps, eps_policy, c)


@float64_scoped
@guarded_kernel
def linear_recurrent(
    q: Float[ArrayLike, "... T H d_k"],
    k: Float[ArrayLike, "... T H d_k"],
    v: Float[ArrayLike, "... T H d_v"],
    *,
    feature_map: FeatureMapLike,
    causal: bool = True,
    key_mask: Bool[ArrayLike, "... T"] | None = None,
    eps: Real[ArrayLike, ""] = 0.0,
    eps_policy: EpsPolicy = "add",
) -> Float[Array, "... T H d_v"]:
    """Recurrent form: :func:`linear_step` under ``lax.scan``, one token at a time.

    Args:
        q: Queries ``[..., T, H, d_k]`` (the ``jax.nn`` layout: heads second to last).
        k: Keys ``[..., T, H, d_k]``, the batch dims, heads and dtype of ``q``.
        v: Values ``[..., T, H, d_v]``, the dtype of ``q``.
        feature_map: The feature map ``phi``, a called :class:`FeatureMap`
            (e.g. :func:`attnref.linear.elu_plus_one`).
        causal: Must be ``True`` (the default): ``linear_recurrent`` is a causal form.
        key_mask: Boolean ``[..., T]`` (exactly the batch dims of ``q``), ``True`` = the key
            may be read; ``None`` (default) allows every key.
        eps: The denominator's regulariser, a scalar ``>= 0``; the default 0 is the exact ratio.
        eps_policy: ``"add"`` (default, divide by ``den + eps``) or ``"clamp"`` (by
            ``max(den, eps)``).

    Returns:
        ``y [..., T, H, d_v]`` in the dtype of ``q``; zero where the adjusted denominator is
        exactly zero (e.g. no allowed key).

    Raises:
        ValueError: If ``q``/``k``/``v`` are not ``[..., T, H, d]`` with matching batch dims,
            heads and ``d_k``, ``key_mask`` is not ``[..., T_k]``, ``eps`` is negative or not a
            scalar, ``eps_policy`` is unknown, ``causal=False``, or ``T_q != T_k``.
        TypeError: If ``causal`` is not a Python bool, ``q``/``k``/``v`` differ in dtype,
            ``key_mask`` is not boolean, or ``feature_map`` is not a (called) feature map.
    """
    require_causal("linear_recurrent", causal)
    check_qkv(q, k, v, key_mask, causal)
    check_policy(eps, eps_policy)
    check_feature_map(feature_map)
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    *batch, _, h, d_k = q.shape
    m = feature_map.num_features(d_k)
    km = jnp.ones((*batch, q.shape[-3]), bool) if key_mask is None else jnp.asarray(key_mask)
    state = linear_state_init(tuple(batch), h, m, v.shape[-1], q.dtype)

    def step(carry: LinearState, xs: tuple[Array, ...]) -> tuple[LinearState, Array]:
        q_t, k_t, v_t, valid = xs
        return linear_step(
            carry,
            q_t,
            k_t,
            v_t,
            feature_map=feature_map,
            key_valid=valid,
            eps=eps,
            eps_policy=eps_policy,
        )

    def time_major(a: Array, axis: int) -> Array:
        return jnp.moveaxis(a, axis, 0)

    xs = (time_major(q, -3), time_major(k, -3), time_major(v, -3), time_major(km, -1))
    _, ys = jax.lax.scan(step, state, xs)
    return jnp.moveaxis(ys, 0, -3)


@float64_scoped
@guarded_kernel
def linear_chunked(
    q: Float[ArrayLike, "... T H d_k"],
    k: Float[ArrayLike, "... T H d_k"],
    v: Float[ArrayLike, "... T H d_v"],
    *,
    feature_map: FeatureMapLike,
    causal: bool = True,
    key_mask: Bool[ArrayLike, "... T"] | None = None,
    eps: Real[ArrayLike, ""] = 0.0,
    eps_policy: EpsPolicy = "add",
    chunk_size: int = 16,
) -> Float[Array, "... T H d_v"]:
    """Chunked form: causal quadratic attention inside each chunk of ``chunk_size`` tokens plus
    the state ``(S, z)`` carried across chunks by ``lax.scan``. Any ``chunk_size >= 1``; a last
    partial chunk is padded with masked keys and the padded queries are dropped.

    Args:
        q: Queries ``[..., T, H, d_k]`` (the ``jax.nn`` layout: heads second to last).
        k: Keys ``[..., T, H, d_k]``, the batch dims, heads and dtype of ``q``.
        v: Values ``[..., T, H, d_v]``, the dtype of ``q``.
        feature_map: The feature map ``phi``, a called :class:`FeatureMap`
            (e.g. :func:`attnref.linear.elu_plus_one`).
        causal: Must be ``True`` (the default): ``linear_chunked`` is a causal form.
        key_mask: Boolean ``[..., T]`` (exactly the batch dims of ``q``), ``True`` = the key
            may be read; ``None`` (default) allows every key.
        eps: The denominator's regulariser, a scalar ``>= 0``; the default 0 is the exact ratio.
        eps_policy: ``"add"`` (default, divide by ``den + eps``) or ``"clamp"`` (by
            ``max(den, eps)``).
        chunk_size: Tokens per chunk, a positive int (default 16; static under ``jax.jit``).

    Returns:
        ``y [..., T, H, d_v]`` in the dtype of ``q``; zero where the adjusted denominator is
        exactly zero (e.g. no allowed key).

    Raises:
        ValueError: If ``q``/``k``/``v`` are not ``[..., T, H, d]`` with matching batch dims,
            heads and ``d_k``, ``key_mask`` is not ``[..., T_k]``, ``eps`` is negative or not a
            scalar, ``eps_policy`` is unknown, ``causal=False``, ``T_q != T_k``, or
            ``chunk_size`` is not a positive int.
        TypeError: If ``causal`` is not a Python bool, ``q``/``k``/``v`` differ in dtype,
            ``key_mask`` is not boolean, or ``feature_map`` is not a (called) feature map.
    """
    require_causal("linear_chunked", causal)
    t, _ = check_qkv(q, k, v, key_mask, causal)
    check_policy(eps, eps_policy)
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    *batch, _, h, d_k = q.shape
    c = chunk_size
    n = math.ceil(t / c)
    pad = n * c - t
    km = jnp.ones((*batch, t), bool) if key_mask is None else jnp.asarray(key_mask)
    fq, fk, c_q = features(feature_map, q, k, km)

    def chunks(a: Array, axis: int) -> Array:
        widths = [(0, 0)] * a.ndim
        widths[axis % a.ndim] = (0, pad)
        a = jnp.pad(a, widths)
        ax = axis % a.ndim
        a = a.reshape(*a.shape[:ax], n, c, *a.shape[ax + 1 :])
        return jnp.moveaxis(a, ax, 0)  # [n, ..., c, ...]

    m = feature_map.num_features(d_k)
    state = linear_state_init(tuple(batch), h, m, v.shape[-1], q.dtype)

    def step(
        carry: LinearState, xs: tuple[Array, Array, Array, Array | None]
    ) -> tuple[LinearState, Array]:
        fq_c, fk_c, v_c, c_c = xs  # [..., c, H, m] twice, [..., c, H, d_v], [..., c, H] or None
        num, den = quadratic_parts(fq_c, fk_c, v_c, causal=True)
        num = num + jnp.einsum("...chm,...hmv->...chv", fq_c, carry.s, precision=HIGHEST)
        den = den + jnp.einsum("...chm,...hm->...ch", fq_c, carry.z, precision=HIGHEST)
        s = carry.s + jnp.einsum("...chm,...chv->...hmv", fk_c, v_c, precision=HIGHEST)
        z = carry.z + jnp.sum(fk_c, axis=-3)
        return LinearState(s, z), normalize(num, den, eps, eps_policy, c_c)

    c_chunks = None if c_q is None else chunks(c_q, -2)  # None: c = 0, eps unchanged
    xs = (chunks(fq, -3), chunks(fk, -3), chunks(v, -3), c_chunks)
    _, ys = jax.lax.scan(step, state, xs)
    ys = jnp.moveaxis(ys, 0, -4)  # [..., n, c, H, d_v]
    ys = ys.reshape(*ys.shape[:-4], n * c, *ys.shape[-2:])
    return ys[..., :t, :, :]


# ----------------------------------------------------------------------------- multi-head level
