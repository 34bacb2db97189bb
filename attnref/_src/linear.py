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

import dataclasses
import functools
import inspect
import math
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Float, Real

from attnref import oracle, tolerance
from attnref._src import cost as _cost
from attnref._src.checks import check_tokens, float64_scoped
from attnref._src.common import HIGHEST, add_output_bias, project, project_kv, residual_or
from attnref._src.family import Example, ExampleProblem, Family
from attnref._src.feature_maps import (
    FeatureMap,
    FeatureMapLike,
    check_feature_map,
    feature_map_from_name,
)
from attnref._src.merged import _messages
from attnref._src.nonfinite import (
    finite_part,
    nonfinite_rows,
    poison_rows,
)
from attnref._src.params import AttentionParams
from attnref._src.registry import REFACTOR, Formulation, register

EpsPolicy = Literal["add", "clamp"]
EPS_POLICIES = ("add", "clamp")


# ----------------------------------------------------------------------------- validation


def _check_qkv(q: Any, k: Any, v: Any, key_mask: Any, causal: bool) -> tuple[int, int]:
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(
            f"causal must be a Python bool, got {type(causal).__name__}; under jax.jit mark it "
            "static: jax.jit(fn, static_argnames=('causal', 'eps_policy'))"
        )
    shapes = {n: tuple(np.shape(a)) for n, a in (("q", q), ("k", k), ("v", v))}
    for name, shape in shapes.items():
        if len(shape) < 3:
            raise ValueError(f"{name} must be [..., T, H, d], got shape {shape}")
    (*bq, t_q, h, d_k), (*bk, t_k, hk, dk2), (*bv, tv, hv, _) = shapes.values()
    if bq != bk or bq != bv:
        raise ValueError(f"batch dims differ: q {shapes['q']}, k {shapes['k']}, v {shapes['v']}")
    if (hk, dk2) != (h, d_k):
        raise ValueError(f"k has shape {shapes['k']}; expected [..., T_k, H={h}, d_k={d_k}]")
    if (tv, hv) != (t_k, h):
        raise ValueError(f"v has shape {shapes['v']}; expected [..., T_k={t_k}, H={h}, d_v]")
    dtypes = {n: jnp.asarray(a).dtype for n, a in (("q", q), ("k", k), ("v", v))}
    if len(set(dtypes.values())) != 1:
        raise TypeError(f"q, k, v must share one dtype, got {dtypes}")
    if key_mask is not None:
        km = tuple(np.shape(key_mask))
        if km != (*bq, t_k):
            raise ValueError(f"key_mask has shape {km}; expected [..., T_k] = {(*bq, t_k)}")
        if jnp.asarray(key_mask).dtype != jnp.bool_:
            raise TypeError(f"key_mask must be boolean, got {jnp.asarray(key_mask).dtype}")
    if causal and t_q != t_k:
        raise ValueError(f"causal linear attention needs T_q == T_k, got {t_q} and {t_k}")
    return t_q, t_k


def _check_policy(eps: Any, eps_policy: str) -> None:
    if eps_policy not in EPS_POLICIES:
        raise ValueError(f"eps_policy must be one of {EPS_POLICIES}, got {eps_policy!r}")
    if np.ndim(eps) != 0:
        raise ValueError(f"eps must be a scalar, got shape {np.shape(eps)}")
    if isinstance(eps, (int, float)) and eps < 0:
        raise ValueError(
            f"eps must be >= 0, got {eps} (a negative eps can create zero "
            "denominators with positive feature maps)"
        )


def _query(fm: FeatureMapLike, q: Array) -> tuple[Array, Array | None]:
    """Query features and their log factor ``c`` (``None`` where it is 0): ``phi~(q).phi~(k) =
    exp(-c) phi(q).phi(k)``. A custom (duck-typed) map's features are its ``phi`` itself."""
    if isinstance(fm, FeatureMap) and fm.name == "favor_plus":
        return fm.query_features(q)
    return fm(q, "query"), None  # c = 0


def _features(
    fm: FeatureMapLike, q: Array, k: Array, key_mask: Array | None
) -> tuple[Array, Array, Array | None]:
    check_feature_map(fm)
    (fq, c), fk = _query(fm, q), fm(k, "key")
    if key_mask is not None:  # padded keys contribute nothing (and cannot leak NaN through *0)
        fk = jnp.where(key_mask[..., None, None], fk, jnp.zeros_like(fk))
    return fq, fk, c


def normalize(
    num: Array, den: Array, eps: Any, eps_policy: str, log_scale: Array | None = None
) -> Array:
    """``num / adjusted(den)`` with the documented policy; exactly-zero denominators give 0.

    ``log_scale = c`` (shape of ``den``) says that ``num`` and ``den`` are ``exp(-c)`` times the
    defined ``N``, ``D`` (FAVOR+'s per-query stabilisation). Then::

        N / (D + eps)    = num / (den + eps exp(-c))          ("add")
        N / max(D, eps)  = num / max(den, eps exp(-c))        ("clamp")

    Where ``exp(-c)`` could overflow (``c < -L``, ``L = log(max float) / 2``, only when
    ``eps > 0``), ``num``, ``den`` and the eps term are all multiplied by ``exp(c + L) < 1``: the
    eps term becomes ``eps exp(L)``, finite, and the ratio is unchanged. Elsewhere the factor is
    exactly 1.
    """
    eps = jnp.asarray(eps, den.dtype)
    if log_scale is not None:
        num, den, eps = _defined_eps(num, den, eps, log_scale.astype(den.dtype))
    adj = den + eps if eps_policy == "add" else jnp.maximum(den, eps)
    zero = adj == 0
    return jnp.where(zero[..., None], 0.0, num / jnp.where(zero, 1.0, adj)[..., None])


@jax.jit  # one program (eagerly: one compile, not one per operation)
def _defined_eps(num: Array, den: Array, eps: Array, c: Array) -> tuple[Array, Array, Array]:
    """``(num, den, eps exp(-c))`` times ``exp(min(c + L, 0))`` (where ``eps > 0``), the scaling
    of :func:`normalize`."""
    big = 0.5 * math.log(float(jnp.finfo(den.dtype).max))
    rescale = jnp.exp(jnp.where(eps > 0, jnp.minimum(c + big, 0.0), 0.0))
    return num * rescale[..., None], den * rescale, eps * jnp.exp(jnp.minimum(-c, big))


def _causal(t: int) -> Array:
    return jnp.asarray(np.tril(np.ones((t, t), bool)))


# ----------------------------------------------------------------------------- non-finite guard
#
# A key a query may not read (``key_mask`` False, or ``j > i`` when causal) never reaches that
# query's output or gradients, whatever its key or value holds: the forms run on the finite parts
# of their inputs, and a query that does read a non-finite value (its own ``q`` with an allowed
# key, an allowed ``k`` or ``v``) is NaN, with no gradient (``attnref._src.nonfinite``).


def _dirty(
    bad_q: Array, bad_kv: Array, key_mask: Any, causal: bool, residual: bool, axis: int
) -> Array:
    """Dirty query rows in O(T): ``bad_q_i AND (residual OR live_i)`` or an allowed bad key.

    The allowed keys of query ``i`` are ``key_mask_j AND (j <= i if causal)``, so "some allowed
    key is bad" is an ``any`` over keys, or its running (prefix) version when causal; the
    token axis of ``bad_q``, ``bad_kv`` and ``key_mask`` is ``axis`` (no ``T x T`` array).
    """
    valid = jnp.ones_like(bad_kv) if key_mask is None else jnp.asarray(key_mask, bool)
    if axis != -1 and key_mask is not None:
        valid = jnp.expand_dims(valid, -1)
    valid = jnp.broadcast_to(valid, jnp.broadcast_shapes(valid.shape, bad_kv.shape))
    readable_bad = jnp.logical_and(valid, bad_kv)

    def seen(a: Array) -> Array:  # any over the keys each query may read
        if causal:
            return jnp.cumsum(a.astype(jnp.int32), axis=axis) > 0
        return jnp.any(a, axis=axis, keepdims=True)

    own = bad_q if residual else jnp.logical_and(bad_q, seen(valid))
    return jnp.logical_or(own, seen(readable_bad))


_UNGUARDED: dict[str, Callable[..., Array]] = {}  # kernel form name -> its unguarded body


def _finite_or_same(a: Any) -> Any:
    """The finite part of a floating array; anything else unchanged (left to validation)."""
    if hasattr(a, "dtype") and jnp.issubdtype(a.dtype, jnp.inexact):
        return finite_part(jnp.asarray(a))
    return a


def _guarded_kernel(fn: Callable[..., Array]) -> Callable[..., Array]:
    """Wrap a kernel-level form ``fn(q, k, v, *, causal, key_mask, ...)`` with the non-finite
    guard: query ``i`` of head ``h`` is dirty when ``q[i, h]`` is non-finite and it has an allowed
    key, or some allowed ``j`` has a non-finite ``k[j, h]`` or ``v[j, h]``."""
    causal_default = inspect.signature(fn).parameters["causal"].default
    _UNGUARDED[fn.__name__] = fn

    @functools.wraps(fn)
    def wrapper(q: Any, k: Any, v: Any, **kwargs: Any) -> Array:
        value = fn(_finite_or_same(q), _finite_or_same(k), _finite_or_same(v), **kwargs)
        q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)  # validated by fn
        causal = kwargs.get("causal", causal_default)
        bad_kv = jnp.logical_or(nonfinite_rows(k), nonfinite_rows(v))  # [..., T_k, H]
        dirty = _dirty(nonfinite_rows(q), bad_kv, kwargs.get("key_mask"), causal, False, -2)
        return poison_rows(dirty, value)  # [..., T_q, H]

    return wrapper


def _guarded_rows(
    compute: Callable[[Array, Array], Array],
    xq: Array,
    xkv: Array,
    key_mask: Any,
    causal: bool,
    residual: bool,
) -> Array:
    """The weight-level guard: ``compute(x_q, x_kv) -> [..., T_q, d_model]`` on the finite parts,
    NaN on the rows that read a non-finite token row (no gradient)."""
    value = compute(finite_part(xq), finite_part(xkv))  # first: it validates the arguments
    dirty = _dirty(nonfinite_rows(xq), nonfinite_rows(xkv), key_mask, causal, residual, -1)
    return poison_rows(dirty, value)


# ----------------------------------------------------------------------------- kernel level


def _quadratic_parts(
    fq: Array, fk: Array, v: Array, causal: bool
) -> tuple[Float[Array, "... T_q H d_v"], Float[Array, "... T_q H"]]:
    a = jnp.einsum("...qhm,...khm->...hqk", fq, fk, precision=HIGHEST)
    if causal:
        a = jnp.where(_causal(a.shape[-1]), a, jnp.zeros_like(a))
    num = jnp.einsum("...hqk,...khv->...qhv", a, v, precision=HIGHEST)
    return num, jnp.swapaxes(jnp.sum(a, axis=-1), -1, -2)


@float64_scoped
@_guarded_kernel
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
    _check_qkv(q, k, v, key_mask, causal)
    _check_policy(eps, eps_policy)
    km = None if key_mask is None else jnp.asarray(key_mask)
    fq, fk, c = _features(feature_map, jnp.asarray(q), jnp.asarray(k), km)
    num, den = _quadratic_parts(fq, fk, jnp.asarray(v), causal)
    return normalize(num, den, eps, eps_policy, c)


@float64_scoped
@_guarded_kernel
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
    _check_qkv(q, k, v, key_mask, causal)
    _check_policy(eps, eps_policy)
    km = None if key_mask is None else jnp.asarray(key_mask)
    fq, fk, c = _features(feature_map, jnp.asarray(q), jnp.asarray(k), km)
    s = jnp.einsum("...khm,...khv->...hmv", fk, jnp.asarray(v), precision=HIGHEST)
    z = jnp.sum(fk, axis=-3)
    num = jnp.einsum("...qhm,...hmv->...qhv", fq, s, precision=HIGHEST)
    den = jnp.einsum("...qhm,...hm->...qh", fq, z, precision=HIGHEST)
    return normalize(num, den, eps, eps_policy, c)


def _require_causal(name: str, causal: bool) -> None:
    if isinstance(causal, (bool, np.bool_)) and not causal:  # a non-bool: TypeError (_check_qkv)
        raise ValueError(
            f"{name} is a causal form (causal=True); use linear_associative or "
            "linear_quadratic for non-causal attention"
        )


@float64_scoped
@_guarded_kernel
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
    _require_causal("linear_prefix_sum", causal)
    _check_qkv(q, k, v, key_mask, causal)
    _check_policy(eps, eps_policy)
    km = None if key_mask is None else jnp.asarray(key_mask)
    fq, fk, c = _features(feature_map, jnp.asarray(q), jnp.asarray(k), km)
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
    _check_policy(eps, eps_policy)
    (fq, c), fk = _query(feature_map, jnp.asarray(q_t)), feature_map(k_t, "key")
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
@_guarded_kernel
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
    _require_causal("linear_recurrent", causal)
    _check_qkv(q, k, v, key_mask, causal)
    _check_policy(eps, eps_policy)
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
@_guarded_kernel
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
    _require_causal("linear_chunked", causal)
    t, _ = _check_qkv(q, k, v, key_mask, causal)
    _check_policy(eps, eps_policy)
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    *batch, _, h, d_k = q.shape
    c = chunk_size
    n = math.ceil(t / c)
    pad = n * c - t
    km = jnp.ones((*batch, t), bool) if key_mask is None else jnp.asarray(key_mask)
    fq, fk, c_q = _features(feature_map, q, k, km)

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
        num, den = _quadratic_parts(fq_c, fk_c, v_c, causal=True)
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

KERNEL_FORMS = {
    "quadratic": linear_quadratic,
    "associative": linear_associative,
    "prefix_sum": linear_prefix_sum,
    "recurrent": linear_recurrent,
    "chunked": linear_chunked,
}


def _multihead(
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
    kernel = _UNGUARDED[KERNEL_FORMS[form].__name__]  # the guard is applied once, on the rows

    def heads(y: Array) -> Array:
        return jnp.swapaxes(y, -3, -2)  # [..., H, T, d] -> [..., T, H, d]

    def compute(xq: Array, xkv: Array) -> Array:
        q = heads(project(xq, params.w_q, params.b_q))
        k = heads(project_kv(xkv, params.w_k, params.b_k, g))  # K/V head i // G for query head i
        v = heads(project_kv(xkv, params.w_v, params.b_v, g))
        z = kernel(q, k, v, key_mask=key_mask, **kwargs)  # [..., T_q, H, d_v]
        y = jnp.einsum("...qhv,hvd->...qd", z, params.w_o, precision=HIGHEST)
        return residual_or(add_output_bias(y, params), xq, residual)

    return _guarded_rows(compute, xq, xkv, key_mask, kwargs["causal"], residual)


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
    return _multihead(
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
    return _multihead(
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
    return _multihead(
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
    return _multihead(
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
    return _multihead(
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
        _check_qkv(q, k, k, key_mask, causal)
        _check_policy(eps, eps_policy)
        km = None if key_mask is None else jnp.asarray(key_mask)
        fq, fk, c = _features(feature_map, q, k, km)
        a = jnp.einsum("...qhm,...khm->...hqk", fq, fk, precision=HIGHEST)
        if causal:
            a = jnp.where(_causal(a.shape[-1]), a, jnp.zeros_like(a))
        den = jnp.sum(a, axis=-1)  # [..., H, T_q]
        c = None if c is None else jnp.swapaxes(c, -1, -2)  # [..., H, T_q], as den
        a = normalize(a, den, eps, eps_policy, c)  # row-normalised, zero rows where den = 0
        msgs = _messages(params, xkv)  # X_kv W_M[i] + b_V[i // G] W_O[i]
        y = jnp.sum(jnp.einsum("...hqk,...hkd->...hqd", a, msgs, precision=HIGHEST), axis=-3)
        return residual_or(add_output_bias(y, params), xq, residual)

    xq, xkv = jnp.asarray(x_q), jnp.asarray(x_kv)
    return _guarded_rows(compute, xq, xkv, key_mask, causal, residual)


# ----------------------------------------------------------------------------- the linear family


def _linear_required(problem: ExampleProblem) -> dict[str, Any]:
    """The feature map the problem names (FAVOR+ gets ``2 d_k`` orthogonal features)."""
    fm = feature_map_from_name(
        problem.feature_map, seed=problem.seed, d=problem.d_k, num_features=2 * problem.d_k
    )
    return {"feature_map": fm}


def _linear_example(problem: ExampleProblem, causal: bool) -> Example:
    """Causality is the ``causal`` flag, and a causal form is self-attention (``T_q == T_k``)."""
    note = f"{problem.feature_map}, {'causal' if causal else 'non-causal'}"
    return Example({**_linear_required(problem), "causal": causal}, causal, note)


LINEAR = Family(
    name="linear",
    oracle=oracle.linear_multihead,
    bound=tolerance.linear_multihead_error_bound,
    signature="apply(params, x_q, x_kv=None, *, feature_map, causal=..., key_mask=None, "
    "eps=0.0, eps_policy='add', residual=False)",
    note="Feature map $\\phi$ from `attnref.linear.elu_plus_one`, "
    "`attnref.linear.relu_features`, `attnref.linear.identity_features`, "
    "`attnref.linear.taylor2` or `attnref.linear.favor_plus`. Denominator policy: "
    "`eps_policy='add'` divides by $D_i + \\epsilon$ (fast-transformers), `'clamp'` by "
    "$\\max(D_i, \\epsilon)$; the default $\\epsilon = 0$ is the exact ratio, and an exactly "
    "zero adjusted denominator (no allowed key) gives a zero output. With the signed `identity` "
    "map the denominator can be near zero and the ratio grows like $1/D_i$; attnref reproduces "
    "that rather than hiding it (see [linear attention](../linear_attention.md)).",
    equation_symbols=("phi",),
    static_argnames=("causal", "eps_policy", "residual"),
    required_kwargs=_linear_required,
    example=_linear_example,
)


# ----------------------------------------------------------------------------- registry entries

KATHAROPOULOS = (
    "Katharopoulos et al. (2020), Transformers are RNNs: Fast Autoregressive Transformers with "
    "Linear Attention, ICML."
)
CHOROMANSKI = "Choromanski et al. (2021), Rethinking Attention with Performers, ICLR (FAVOR+)."
_LIN_EQ = (
    r"y_i = \frac{\sum_{j \in \mathcal{A}(i)} \phi(q_i)^\top \phi(k_j)\, v_j^\top}"
    r"{\sum_{j \in \mathcal{A}(i)} \phi(q_i)^\top \phi(k_j) + \epsilon}"
)


def linear_quadratic_cost(d: _cost.Dims) -> _cost.Cost:
    b, h, m = d.batch, d.heads, _cost._m(d)
    a = b * h * d.t_q * d.t_k
    outs = [b * d.t_q * h * d.d_v, b * d.t_q * h]
    return _cost._linear(d, 2 * a * (m + d.d_v), a * (2 if d.causal else 1), [a, a, *outs])


def linear_associative_cost(d: _cost.Dims) -> _cost.Cost:
    b, h, m = d.batch, d.heads, _cost._m(d)
    mm = 2 * b * h * m * d.d_v * d.t_k + 2 * b * d.t_q * h * m * (d.d_v + 1)
    outs = [b * h * m * d.d_v, b * h * m, b * d.t_q * h * d.d_v, b * d.t_q * h]
    return _cost._linear(d, mm, b * h * m * d.t_k, outs)


def linear_prefix_sum_cost(d: _cost.Dims) -> _cost.Cost:
    b, h, m, t = d.batch, d.heads, _cost._m(d), d.t_q
    states = b * t * h * m * (d.d_v + 1)
    log_t = max(1, math.ceil(math.log2(t)))
    # outer products (1 flop/element), cumsum (an associative scan: <= 2 log2(T) passes), and
    # the denominator phi(q).z, a contraction with no free dimension that XLA lowers to a
    # multiply and a reduction (2m - 1 elementwise flops), not a dot.
    el = b * t * h * m * d.d_v + 2 * log_t * states + b * t * h * (2 * m - 1)
    kv, zs = b * t * h * m * d.d_v, b * t * h * m
    tensors = [kv, kv, kv, zs, zs, zs, b * t * h * d.d_v, b * t * h]  # outer, scan temporaries
    return _cost._linear(d, 2 * b * t * h * m * d.d_v, el, tensors)


def linear_recurrent_cost(d: _cost.Dims) -> _cost.Cost:
    b, h, m, t = d.batch, d.heads, _cost._m(d), d.t_q
    mm_f, el_f, tr_f, _ = _cost._feature_cost(dataclasses.replace(d, t_q=1, t_k=1), 1)
    step_mm = 2 * b * h * m * d.d_v + 2 * mm_f  # read-out phi(q) S; features of q_t and k_t
    # state update (outer product, adds), phi(q).z (multiply + reduce), features, normalise
    step_el = (
        2 * b * h * m * d.d_v
        + 2 * b * h * m
        + b * h * (2 * m - 1)
        + 2 * el_f
        + _cost._normalize_el(dataclasses.replace(d, t_q=1))
    )
    mm_p, el_p = _cost._linear_proj(d)
    inputs, output = _cost._io(d)
    proj = [b * t * h * d.d_k, b * t * h * d.d_k, b * t * h * d.d_v]
    every = [
        *proj,
        *proj,
        *proj,
        b * t,
        b * h * m * d.d_v,
        b * h * m,
        b * t * h * d.d_v,
        b * t * h * d.d_v,
        b * t * d.d_model,
    ]  # + time-major copies, state, outputs
    return _cost.Cost(
        mm_p + t * step_mm,
        el_p + t * step_el + b * t * h * m + _cost.weight_guard_elementwise(d, pairs=False),
        t * (2 * tr_f + _cost._eps_exp(d, 1)),
        inputs,
        output,
        max(every) * d.itemsize,
        sum(every) * d.itemsize + inputs,
        loop_trips=t,
        per_trip_matmul_flops=step_mm,
        per_trip_elementwise_flops=step_el,
        per_trip_transcendentals=2 * tr_f + _cost._eps_exp(d, 1),
    )


def linear_chunked_cost(d: _cost.Dims) -> _cost.Cost:
    b, h, m, t, c = d.batch, d.heads, _cost._m(d), d.t_q, d.chunk
    n = math.ceil(t / c)
    a = b * h * c * c
    step_mm = 2 * a * (m + d.d_v) + 2 * b * c * h * m * (d.d_v + 1) + 2 * b * h * m * d.d_v * c
    step_el = (
        a * 2
        + 2 * b * h * m * (d.d_v + 1)
        + b * c * h * m
        + _cost._normalize_el(dataclasses.replace(d, t_q=c))
    )
    padded = b * n * c * h
    chunked = [padded * m, padded * m, padded * d.d_v] * 2  # padded, then chunk-major copies
    tensors = [*chunked, a, a, b * h * m * d.d_v, b * h * m, padded * d.d_v, padded * d.d_v]
    base = _cost._linear(dataclasses.replace(d, t_q=t, t_k=t), 0, 0, tensors)
    return dataclasses.replace(
        base,
        matmul_flops=base.matmul_flops + n * step_mm,
        elementwise_flops=base.elementwise_flops
        - _cost._normalize_el(d)
        + n * step_el
        + 2 * b * n * c * h * (m + d.d_v),  # padding to whole chunks
        # the eps rescaling runs inside the loop, on every (padded) chunk of queries
        transcendentals=base.transcendentals - _cost._eps_exp(d, t) + n * _cost._eps_exp(d, c),
        loop_trips=n,
        per_trip_matmul_flops=step_mm,
        per_trip_elementwise_flops=step_el,
        per_trip_transcendentals=_cost._eps_exp(d, c),
    )


def linear_messages_cost(d: _cost.Dims) -> _cost.Cost:
    b, h, m, dm = d.batch, d.heads, _cost._m(d), d.d_model
    a = b * h * d.t_q * d.t_k
    pq, pk, _ = _cost._projections(d)
    mmq, elq, trq, _ = _cost._feature_cost(d, d.t_q)
    mmk, elk, trk, _ = _cost._feature_cost(d, d.t_k)
    mm_m, el_m = _cost._messages(d)
    mm_x, el_x = _cost._mix(d)
    mm = pq + pk + mmq + mmk + 2 * a * m + mm_m + mm_x
    el = (
        elq
        + elk
        + a * (2 if d.causal else 1)
        + 4 * a
        + el_m
        + el_x
        + _cost._bias_adds(d, b * d.t_q * h * d.d_k, b * d.t_k * h * d.d_k, 0, 0)
        + b * d.t_k * h * m
        + _cost.weight_guard_elementwise(d, pairs=False)
    )
    inputs, output = _cost._io(d)
    every = [
        *_cost._linear_tensors(d),
        a,
        a,
        a,
        b * h * d.t_q,
        h * dm * dm,
        b * h * d.t_k * dm,
        b * h * d.t_k * dm,
        b * h * d.t_q * dm,
    ]  # A, masked, normalised; W_M, messages
    return _cost.Cost(
        mm,
        el,
        trq + trk + _cost._eps_exp(d, d.t_q),
        inputs,
        output,
        max(every) * d.itemsize,
        sum(every) * d.itemsize + inputs,
    )


register(
    Formulation(
        id="linear_quadratic",
        title="Linear attention, quadratic form",
        equation=(
            r"Y = \frac{(\phi(Q)\phi(K)^\top \odot M)\, V}"
            r"{(\phi(Q)\phi(K)^\top \odot M)\,\mathbf{1} + \epsilon},\quad " + _LIN_EQ
        ),
        convention="kernel",
        citation=KATHAROPOULOS + " Feature maps: " + CHOROMANSKI,
        apply=linear_quadratic_attention,
        native=linear_quadratic,
        summary=(
            "The T x T kernel matrix materialised, masked (causal and/or key padding), "
            "row-normalised."
        ),
        cost="FLOPs O(H T_q T_k (m + d_v)); memory O(H T_q T_k). m = number of features.",
        cost_model=linear_quadratic_cost,
        family=LINEAR,
        causal_modes=(False, True),
    )
)

register(
    Formulation(
        id="linear_associative",
        title="Linear attention, associative (non-causal) form",
        equation=(
            r"Y = \frac{\phi(Q)\,\big(\phi(K)^\top V\big)}"
            r"{\phi(Q)\,\big(\phi(K)^\top \mathbf{1}\big) + \epsilon}"
        ),
        convention="kernel",
        citation=KATHAROPOULOS,
        apply=linear_associative_attention,
        native=linear_associative,
        summary=(
            "Associativity turns O(T^2 d) into O(T m d_v): keys and values are summarised first."
        ),
        cost="FLOPs O(H (T_q + T_k) m d_v); memory O(H m d_v): linear in T.",
        cost_model=linear_associative_cost,
        family=LINEAR,
        causal_modes=(False,),
    )
)

register(
    Formulation(
        id="linear_prefix_sum",
        title="Linear attention, causal prefix sums",
        equation=(
            r"S_t = \sum_{j \le t} \phi(k_j) v_j^\top,\ z_t = \sum_{j \le t} \phi(k_j),"
            r"\quad y_t = \frac{\phi(q_t)^\top S_t}{\phi(q_t)^\top z_t + \epsilon}"
        ),
        convention="kernel",
        citation=KATHAROPOULOS,
        apply=linear_prefix_sum_attention,
        native=linear_prefix_sum,
        summary="Cumulative sums of phi(k) v^T and phi(k) give every causal prefix at once.",
        cost="FLOPs O(H T m d_v); memory O(H T m d_v) for the prefix states.",
        cost_model=linear_prefix_sum_cost,
        family=LINEAR,
        causal_modes=(True,),
    )
)

register(
    Formulation(
        id="linear_recurrent",
        title="Linear attention, recurrent (RNN) form",
        equation=(
            r"S_t = S_{t-1} + \phi(k_t) v_t^\top,\ z_t = z_{t-1} + \phi(k_t),"
            r"\quad y_t = \frac{\phi(q_t)^\top S_t}{\phi(q_t)^\top z_t + \epsilon}"
        ),
        convention="kernel",
        citation=KATHAROPOULOS,
        apply=linear_recurrent_attention,
        native=linear_recurrent,
        summary=(
            "A lax.scan over the constant-size state (S_t, z_t): the decoding view, "
            "O(m d_v) memory."
        ),
        cost=(
            "FLOPs O(H T m d_v) in T sequential steps; memory O(H m d_v), constant in T "
            "(the KV-cache analogue)."
        ),
        cost_model=linear_recurrent_cost,
        family=LINEAR,
        causal_modes=(True,),
    )
)

register(
    Formulation(
        id="linear_chunked",
        title="Linear attention, chunked form",
        equation=(
            r"y_t = \frac{\phi(q_t)^\top \big(S_{c-1} + \sum_{j \in c,\, j \le t} \phi(k_j)"
            r" v_j^\top\big)}{\phi(q_t)^\top \big(z_{c-1} + \sum_{j \in c,\, j \le t}"
            r" \phi(k_j)\big) + \epsilon},\ t \in \text{chunk } c"
        ),
        convention="kernel",
        citation=KATHAROPOULOS + " Chunkwise evaluation as in later linear-attention kernels.",
        apply=linear_chunked_attention,
        native=linear_chunked,
        summary=(
            "Quadratic inside each chunk, the state carried between chunks by lax.scan; "
            "any chunk size."
        ),
        cost=(
            "FLOPs O(H T (C (m + d_v) + m d_v)) for chunk size C, T / C sequential steps; "
            "memory O(H (C^2 + m d_v))."
        ),
        cost_model=linear_chunked_cost,
        family=LINEAR,
        causal_modes=(True,),
        static_argnames=(*LINEAR.static_argnames, "chunk_size"),
    )
)

register(
    Formulation(
        id="linear_messages",
        title="Linear attention, scores x messages",
        equation=(
            r"Y = \sum_{i=1}^{H} \mathrm{rownorm}\big(\phi(Q_i)\phi(K_i)^\top \odot M\big)\,"
            r" \big(X_{kv} W_{M,i}\big) + b_O"
        ),
        convention="row",
        citation=KATHAROPOULOS + " Messages view: " + REFACTOR,
        apply=linear_messages_attention,
        native=linear_messages_attention,
        summary="The normalised linear attention matrix of each head times its messages X W_M.",
        cost=(
            "FLOPs O(H T_q T_k (m + d_model) + H T_k d_model^2); "
            "memory O(H T_q T_k + H T_k d_model)."
        ),
        cost_model=linear_messages_cost,
        family=LINEAR,
        causal_modes=(False, True),
    )
)
