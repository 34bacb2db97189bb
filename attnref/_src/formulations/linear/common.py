"""Linear attention's shared checks, denominator policy (:func:`normalize`) and non-finite
guards, used by the kernel-level and the multi-head forms."""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from attnref._src.core.nonfinite import finite_part, nonfinite_rows, poison_rows
from attnref._src.formulations.feature_maps import FeatureMap, FeatureMapLike, check_feature_map

EpsPolicy = Literal["add", "clamp"]
EPS_POLICIES = ("add", "clamp")


# ----------------------------------------------------------------------------- validation


def check_qkv(q: Any, k: Any, v: Any, key_mask: Any, causal: bool) -> tuple[int, int]:
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


def check_policy(eps: Any, eps_policy: str) -> None:
    if eps_policy not in EPS_POLICIES:
        raise ValueError(f"eps_policy must be one of {EPS_POLICIES}, got {eps_policy!r}")
    if np.ndim(eps) != 0:
        raise ValueError(f"eps must be a scalar, got shape {np.shape(eps)}")
    if isinstance(eps, (int, float)) and eps < 0:
        raise ValueError(
            f"eps must be >= 0, got {eps} (a negative eps can create zero "
            "denominators with positive feature maps)"
        )


def query(fm: FeatureMapLike, q: Array) -> tuple[Array, Array | None]:
    """Query features and their log factor ``c`` (``None`` where it is 0): ``phi~(q).phi~(k) =
    exp(-c) phi(q).phi(k)``. A custom (duck-typed) map's features are its ``phi`` itself."""
    if isinstance(fm, FeatureMap) and fm.name == "favor_plus":
        return fm.query_features(q)
    return fm(q, "query"), None  # c = 0


def features(
    fm: FeatureMapLike, q: Array, k: Array, key_mask: Array | None
) -> tuple[Array, Array, Array | None]:
    check_feature_map(fm)
    (fq, c), fk = query(fm, q), fm(k, "key")
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
        num, den, eps = defined_eps(num, den, eps, log_scale.astype(den.dtype))
    adj = den + eps if eps_policy == "add" else jnp.maximum(den, eps)
    zero = adj == 0
    return jnp.where(zero[..., None], 0.0, num / jnp.where(zero, 1.0, adj)[..., None])


@jax.jit  # one program (eagerly: one compile, not one per operation)
def defined_eps(num: Array, den: Array, eps: Array, c: Array) -> tuple[Array, Array, Array]:
    """``(num, den, eps exp(-c))`` times ``exp(min(c + L, 0))`` (where ``eps > 0``), the scaling
    of :func:`normalize`."""
    big = 0.5 * math.log(float(jnp.finfo(den.dtype).max))
    rescale = jnp.exp(jnp.where(eps > 0, jnp.minimum(c + big, 0.0), 0.0))
    return num * rescale[..., None], den * rescale, eps * jnp.exp(jnp.minimum(-c, big))


def causal_pairs(t: int) -> Array:
    return jnp.asarray(np.tril(np.ones((t, t), bool)))


# ----------------------------------------------------------------------------- non-finite guard
#
# A key a query may not read (``key_mask`` False, or ``j > i`` when causal) never reaches that
# query's output or gradients, whatever its key or value holds: the forms run on the finite parts
# of their inputs, and a query that does read a non-finite value (its own ``q`` with an allowed
# key, an allowed ``k`` or ``v``) is NaN, with no gradient (``attnref._src.core.nonfinite``).


def dirty_rows(
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


UNGUARDED: dict[str, Callable[..., Array]] = {}  # kernel form name -> its unguarded body


def finite_or_same(a: Any) -> Any:
    """The finite part of a floating array; anything else unchanged (left to validation)."""
    if hasattr(a, "dtype") and jnp.issubdtype(a.dtype, jnp.inexact):
        return finite_part(jnp.asarray(a))
    return a


def guarded_kernel(fn: Callable[..., Array]) -> Callable[..., Array]:
    """Wrap a kernel-level form ``fn(q, k, v, *, causal, key_mask, ...)`` with the non-finite
    guard: query ``i`` of head ``h`` is dirty when ``q[i, h]`` is non-finite and it has an allowed
    key, or some allowed ``j`` has a non-finite ``k[j, h]`` or ``v[j, h]``."""
    causal_default = inspect.signature(fn).parameters["causal"].default
    UNGUARDED[fn.__name__] = fn

    @functools.wraps(fn)
    def wrapper(q: Any, k: Any, v: Any, **kwargs: Any) -> Array:
        value = fn(finite_or_same(q), finite_or_same(k), finite_or_same(v), **kwargs)
        q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)  # validated by fn
        causal = kwargs.get("causal", causal_default)
        bad_kv = jnp.logical_or(nonfinite_rows(k), nonfinite_rows(v))  # [..., T_k, H]
        dirty = dirty_rows(nonfinite_rows(q), bad_kv, kwargs.get("key_mask"), causal, False, -2)
        return poison_rows(dirty, value)  # [..., T_q, H]

    return wrapper


def guarded_rows(
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
    dirty = dirty_rows(nonfinite_rows(xq), nonfinite_rows(xkv), key_mask, causal, residual, -1)
    return poison_rows(dirty, value)
