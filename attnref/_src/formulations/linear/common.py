"""Linear attention's shared pieces: :class:`Options`, the validation, the denominator policy
(:func:`normalize`) and the two levels' validated inputs (:class:`KernelCall`, :class:`RowCall`)."""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool

from attnref._src.core.nonfinite import finite_part, nonfinite_rows
from attnref._src.core.params import AttentionParams
from attnref._src.formulations.feature_maps import FeatureMap, FeatureMapLike

EpsPolicy = Literal["add", "clamp"]
EPS_POLICIES = ("add", "clamp")
Form = Callable[..., Array]  # a kernel-level form: (q, k, v, o: Options) -> y


@jax.tree_util.register_dataclass  # a pytree: entry.compiled traces its arrays
@dataclasses.dataclass(frozen=True)
class Options:
    """The validated options of one call (``form``: the kernel-level form, ``None`` for the
    messages form)."""

    feature_map: FeatureMapLike
    eps: Any
    eps_policy: str
    causal: bool = False
    key_mask: Bool[Array, "... T_k"] | None = None
    chunk_size: int = 16
    form: Form | None = None

    def features(self, q: Array, k: Array) -> tuple[Array, Array, Array | None]:
        """:func:`features` with this call's map and key mask."""
        return features(self.feature_map, q, k, self.key_mask)

    def normalize(self, num: Array, den: Array, c: Array | None) -> Array:
        """:func:`normalize` by this call's policy."""
        return normalize(num, den, self.eps, self.eps_policy, c)


# ----------------------------------------------------------------------------- validation


def check_causal(causal: Any) -> None:
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(
            f"causal must be a Python bool, got {type(causal).__name__}; under jax.jit mark it "
            "static: jax.jit(fn, static_argnames=('causal', 'eps_policy'))"
        )


def check_mode(form: Form | None, modes: tuple[bool, ...], causal: Any) -> None:
    """Refuse a causal mode the form does not take (a non-bool is left to :func:`check_causal`)."""
    if form is None or not isinstance(causal, (bool, np.bool_)) or causal in modes:
        return
    name = f"linear_{form.__name__}"
    if causal:
        raise ValueError(
            f"{name} is non-causal; use linear_prefix_sum, "
            "linear_recurrent or linear_chunked for causal attention"
        )
    raise ValueError(
        f"{name} is a causal form (causal=True); use linear_associative or "
        "linear_quadratic for non-causal attention"
    )


def check_key_mask(key_mask: Any, batch: tuple[int, ...], t_q: int, t_k: int, causal: bool) -> None:
    if key_mask is not None:
        km = tuple(np.shape(key_mask))
        if km != (*batch, t_k):
            raise ValueError(f"key_mask has shape {km}; expected [..., T_k] = {(*batch, t_k)}")
        if jnp.asarray(key_mask).dtype != jnp.bool_:
            raise TypeError(f"key_mask must be boolean, got {jnp.asarray(key_mask).dtype}")
    if causal and t_q != t_k:
        raise ValueError(f"causal linear attention needs T_q == T_k, got {t_q} and {t_k}")


def check_qkv(q: Any, k: Any, v: Any, key_mask: Any, causal: bool) -> None:
    check_causal(causal)
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
    check_key_mask(key_mask, tuple(bq), t_q, t_k, causal)


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


def check_chunk_size(chunk_size: Any) -> None:
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")


# ----------------------------------------------------------------------------- features, policy


def features(
    fm: FeatureMapLike, q: Array, k: Array, key_mask: Array | None
) -> tuple[Array, Array, Array | None]:
    """``(phi~(q), phi~(k), c)``: the features (keys outside ``key_mask`` zeroed) and the query
    log factor ``c`` (``None`` where it is 0): ``phi~(q).phi~(k) = exp(-c) phi(q).phi(k)``."""
    if isinstance(fm, FeatureMap) and fm.name == "favor_plus":
        fq, c = fm.query_features(q)
    else:
        fq, c = fm(q, "query"), None  # c = 0
    fk = fm(k, "key")
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

    Where ``exp(-c)`` could overflow (``c < -L``, ``L = log(max float) / 2``), all three are
    multiplied by ``exp(c + L) < 1`` (:func:`defined_eps`): the ratio is unchanged.
    """
    eps = jnp.asarray(eps, den.dtype)
    if log_scale is not None:
        num, den, eps = defined_eps(num, den, eps, log_scale.astype(den.dtype))
    adj = den + eps if eps_policy == "add" else jnp.maximum(den, eps)
    zero = adj == 0
    return jnp.where(zero[..., None], 0.0, num / jnp.where(zero, 1.0, adj)[..., None])


@jax.jit  # one program (eagerly: one compile, not one per operation)
def defined_eps(num: Array, den: Array, eps: Array, c: Array) -> tuple[Array, Array, Array]:
    """``(num, den, eps exp(-c))`` times ``exp(min(c + L, 0))`` (where ``eps > 0``)."""
    big = 0.5 * math.log(float(jnp.finfo(den.dtype).max))
    rescale = jnp.exp(jnp.where(eps > 0, jnp.minimum(c + big, 0.0), 0.0))
    return num * rescale[..., None], den * rescale, eps * jnp.exp(jnp.minimum(-c, big))


# ----------------------------------------------------------------------------- non-finite guard
#
# The forms run on the finite parts; a query that reads a non-finite value is NaN (core/nonfinite).


def dirty_rows(
    bad_q: Array, bad_kv: Array, key_mask: Any, causal: bool, residual: bool, axis: int
) -> Array:
    """Dirty query rows in O(T): ``bad_q_i AND (residual OR live_i)`` or an allowed bad key (an
    ``any``, or a prefix ``any`` when causal, over the token axis ``axis``)."""
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


def finite_or_same(a: Array) -> Array:
    """The finite part of a floating array; anything else unchanged (left to validation)."""
    return finite_part(a) if jnp.issubdtype(a.dtype, jnp.inexact) else a


@jax.tree_util.register_dataclass  # a pytree: entry.compiled traces its arrays
@dataclasses.dataclass(frozen=True)
class KernelCall:
    """Validated kernel-level inputs ``q, k, v [..., T, H, d]``; ``run(form)`` is
    ``form(q, k, v, o)`` on the finite parts."""

    q: Array
    k: Array
    v: Array
    o: Options

    def run(self, form: Form) -> Array:
        return form(finite_or_same(self.q), finite_or_same(self.k), finite_or_same(self.v), self.o)

    def dirty_rows(self) -> Bool[Array, "... T_q H"]:
        bad_kv = jnp.logical_or(nonfinite_rows(self.k), nonfinite_rows(self.v))  # [..., T_k, H]
        o = self.o
        return dirty_rows(nonfinite_rows(self.q), bad_kv, o.key_mask, o.causal, False, -2)


@jax.tree_util.register_dataclass  # a pytree: entry.compiled traces its arrays
@dataclasses.dataclass(frozen=True)
class RowCall:
    """Validated multi-head inputs ``x_q [..., T_q, d_model]``, ``x_kv [..., T_k, d_model]``;
    ``run(formula)`` is ``formula(params, x_q, x_kv, o, residual)`` on the finite parts."""

    params: AttentionParams
    x_q: Array
    x_kv: Array
    o: Options
    residual: bool

    def run(self, formula: Callable[..., Array]) -> Array:
        xq, xkv = finite_part(self.x_q), finite_part(self.x_kv)
        return formula(self.params, xq, xkv, self.o, self.residual)

    def dirty_rows(self) -> Bool[Array, "... T_q"]:
        bad_q, bad_kv = nonfinite_rows(self.x_q), nonfinite_rows(self.x_kv)
        return dirty_rows(bad_q, bad_kv, self.o.key_mask, self.o.causal, self.residual, -1)


def with_chunk_size(prepare: Callable[..., Any]) -> Callable[..., Any]:
    """``prepare`` with the chunked form's keyword ``chunk_size: int = 16``, set on the options."""

    def prepare_chunked(*args: Any, chunk_size: int = 16, **kwargs: Any) -> KernelCall | RowCall:
        call = prepare(*args, **kwargs)
        check_chunk_size(chunk_size)
        return dataclasses.replace(call, o=dataclasses.replace(call.o, chunk_size=chunk_size))

    signature = inspect.signature(prepare)
    size = inspect.Parameter("chunk_size", inspect.Parameter.KEYWORD_ONLY, default=16)
    params = [*signature.parameters.values(), size.replace(annotation="int")]
    prepare_chunked.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
    return prepare_chunked
