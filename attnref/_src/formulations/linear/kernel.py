"""Linear (kernel) attention in every form (Katharopoulos et al. 2020, "Transformers are RNNs").

Kernel level, heads second to last (``jax.nn.dot_product_attention``'s layout):
``q [..., T_q, H, d_k]``, ``k [..., T_k, H, d_k]``, ``v [..., T_k, H, d_v]``, output
``[..., T_q, H, d_v]``. With ``A_ij = phi(q_i).phi(k_j)`` over the allowed keys ``j``
(``key_mask`` True and, if ``causal``, ``j <= i``)::

    y_i = (sum_j A_ij v_j) / den_i,   den_i = sum_j A_ij

divided by ``den_i + eps`` (``eps_policy="add"``, default) or ``max(den_i, eps)`` (``"clamp"``);
zero where the adjusted denominator is exactly zero. Forms: quadratic, associative
(non-causal), causal prefix sums, recurrent (``lax.scan`` over ``(S_t, z_t)``) and chunked;
causal forms need ``T_q == T_k``. The eps policy, FAVOR+'s rescaled ``eps`` and the signed
maps' conditioning: ``docs/linear_attention.md``.
"""

from __future__ import annotations

import functools
import inspect
import math
import re
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Float, Real

from attnref._src.core.checks import HIGHEST
from attnref._src.core.entry import Level, public
from attnref._src.formulations.feature_maps import (
    FeatureMap,  # noqa: F401  (the docstrings' :class: roles resolve here)
    FeatureMapLike,
    check_feature_map,
)
from attnref._src.formulations.linear.common import (
    EpsPolicy,
    Form,
    KernelCall,
    Options,
    check_mode,
    check_policy,
    check_qkv,
    features,
    normalize,  # noqa: F401  (the docstring's :func: role resolves here)
    with_chunk_size,
)

Q = Float[Array, "... T_q H d_k"]
K = Float[Array, "... T_k H d_k"]
V = Float[Array, "... T_k H d_v"]


def quadratic(q: Q, k: K, v: V, o: Options) -> Float[Array, "... T_q H d_v"]:
    """``Y = (A V) / (A 1)`` with ``A = phi(Q) phi(K)^T``, masked to the allowed pairs."""
    fq, fk, c = o.features(q, k)  # phi(Q) [..., T_q, H, m], phi(K) [..., T_k, H, m]
    num, den = quadratic_parts(fq, fk, v, o.causal)  # A V, A 1
    return o.normalize(num, den, c)


def kernel_matrix(fq: Array, fk: Array, causal: bool) -> Float[Array, "... H T_q T_k"]:
    """``A = phi(Q) phi(K)^T`` per head, zero above the diagonal when ``causal``."""
    a = jnp.einsum("...qhm,...khm->...hqk", fq, fk, precision=HIGHEST)
    pairs = jnp.asarray(np.tril(np.ones((a.shape[-1],) * 2, bool)))  # j <= i
    return jnp.where(pairs, a, jnp.zeros_like(a)) if causal else a


def quadratic_parts(
    fq: Array, fk: Array, v: Array, causal: bool
) -> tuple[Float[Array, "... T_q H d_v"], Float[Array, "... T_q H"]]:
    a = kernel_matrix(fq, fk, causal)
    num = jnp.einsum("...hqk,...khv->...qhv", a, v, precision=HIGHEST)
    return num, jnp.swapaxes(jnp.sum(a, axis=-1), -1, -2)


def associative(q: Q, k: K, v: V, o: Options) -> Float[Array, "... T_q H d_v"]:
    """``Y = phi(Q) (phi(K)^T V) / (phi(Q) (phi(K)^T 1))``: keys and values summarised first."""
    fq, fk, c = o.features(q, k)
    s = jnp.einsum("...khm,...khv->...hmv", fk, v, precision=HIGHEST)  # phi(K)^T V [..., H, m, d_v]
    z = jnp.sum(fk, axis=-3)  #                                          phi(K)^T 1 [..., H, m]
    num = jnp.einsum("...qhm,...hmv->...qhv", fq, s, precision=HIGHEST)
    den = jnp.einsum("...qhm,...hm->...qh", fq, z, precision=HIGHEST)
    return o.normalize(num, den, c)


def prefix_sum(q: Q, k: K, v: V, o: Options) -> Float[Array, "... T H d_v"]:  # T_q = T_k = T
    """``S_t = sum_{j<=t} phi(k_j) v_j^T``, ``z_t = sum_{j<=t} phi(k_j)``,
    ``y_t = phi(q_t) S_t / (phi(q_t) z_t)``: every causal prefix at once."""
    fq, fk, c = o.features(q, k)
    kv = jnp.einsum("...thm,...thv->...thmv", fk, v, precision=HIGHEST)  # phi(k_t) v_t^T
    s = jnp.cumsum(kv, axis=-4)  #  S_t [..., T, H, m, d_v]
    z = jnp.cumsum(fk, axis=-3)  #  z_t [..., T, H, m]
    num = jnp.einsum("...thm,...thmv->...thv", fq, s, precision=HIGHEST)
    den = jnp.einsum("...thm,...thm->...th", fq, z, precision=HIGHEST)
    return o.normalize(num, den, c)


class LinearState(NamedTuple):
    """Recurrent state of causal linear attention.

    Attributes:
        s: ``S = sum_j phi(k_j) v_j^T`` over the keys appended so far, ``[..., H, m, d_v]``.
        z: ``z = sum_j phi(k_j)``, ``[..., H, m]``.
    """

    s: Array
    z: Array


def step(
    state: LinearState,
    o: Options,
    q_t: Float[Array, "... H d_k"],
    k_t: Float[Array, "... H d_k"],
    v_t: Float[Array, "... H d_v"],
    key_valid: Bool[Array, "..."] | None,
) -> tuple[LinearState, Float[Array, "... H d_v"]]:
    """``S_t = S_{t-1} + phi(k_t) v_t^T``, ``z_t = z_{t-1} + phi(k_t)``,
    ``y_t = phi(q_t) S_t / (phi(q_t) z_t)``; a key that is not valid is not appended."""
    fq, fk, c = features(o.feature_map, q_t, k_t, key_valid)
    s = state.s + jnp.einsum("...hm,...hv->...hmv", fk, v_t, precision=HIGHEST)
    z = state.z + fk
    num = jnp.einsum("...hm,...hmv->...hv", fq, s, precision=HIGHEST)
    den = jnp.einsum("...hm,...hm->...h", fq, z, precision=HIGHEST)
    return LinearState(s, z), o.normalize(num, den, c)


def recurrent(q: Q, k: K, v: V, o: Options) -> Float[Array, "... T H d_v"]:  # T_q = T_k = T
    """:func:`step` under ``lax.scan``, one token at a time, from the empty state."""
    km = jnp.ones(q.shape[:-2], bool) if o.key_mask is None else o.key_mask  # [..., T]
    xs = (*(jnp.moveaxis(a, -3, 0) for a in (q, k, v)), jnp.moveaxis(km, -1, 0))  # time-major
    _, ys = jax.lax.scan(lambda s, x: step(s, o, *x), empty_state(q, v, o), xs)
    return jnp.moveaxis(ys, 0, -3)


def empty_state(q: Q, v: V, o: Options) -> LinearState:
    *batch, _, h, d_k = q.shape
    m = o.feature_map.num_features(d_k)
    return linear_state_init(tuple(batch), h, m, v.shape[-1], q.dtype)


def chunked(q: Q, k: K, v: V, o: Options) -> Float[Array, "... T H d_v"]:  # T_q = T_k = T
    """Causal :func:`quadratic` inside each chunk of ``C`` tokens plus the state ``(S, z)`` of
    the chunks before, carried by ``lax.scan``. A last partial chunk is padded with masked keys
    and the padded queries are dropped."""
    t, c = q.shape[-3], o.chunk_size
    n = math.ceil(t / c)
    km = jnp.ones(q.shape[:-2], bool) if o.key_mask is None else o.key_mask  # [..., T]
    fq, fk, c_q = features(o.feature_map, q, k, km)

    def chunks(a: Array, axis: int) -> Array:  # [..., T, ...] -> [n, ..., c, ...]
        ax = axis % a.ndim
        a = jnp.pad(a, [(0, n * c - t) if i == ax else (0, 0) for i in range(a.ndim)])
        a = a.reshape(*a.shape[:ax], n, c, *a.shape[ax + 1 :])
        return jnp.moveaxis(a, ax, 0)

    def chunk_step(
        carry: LinearState, xs: tuple[Array, Array, Array, Array | None]
    ) -> tuple[LinearState, Array]:
        fq_c, fk_c, v_c, c_c = xs  # [..., c, H, m] twice, [..., c, H, d_v], [..., c, H] or None
        num, den = quadratic_parts(fq_c, fk_c, v_c, causal=True)
        num = num + jnp.einsum("...chm,...hmv->...chv", fq_c, carry.s, precision=HIGHEST)
        den = den + jnp.einsum("...chm,...hm->...ch", fq_c, carry.z, precision=HIGHEST)
        s = carry.s + jnp.einsum("...chm,...chv->...hmv", fk_c, v_c, precision=HIGHEST)
        z = carry.z + jnp.sum(fk_c, axis=-3)
        return LinearState(s, z), o.normalize(num, den, c_c)

    c_chunks = None if c_q is None else chunks(c_q, -2)  # None: c = 0, eps unchanged
    xs = (chunks(fq, -3), chunks(fk, -3), chunks(v, -3), c_chunks)
    _, ys = jax.lax.scan(chunk_step, empty_state(q, v, o), xs)
    ys = jnp.moveaxis(ys, 0, -4)  # [..., n, c, H, d_v]
    return ys.reshape(*ys.shape[:-4], n * c, *ys.shape[-2:])[..., :t, :, :]


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
    m = jax.eval_shape(lambda k: feature_map(k, "key"), k_t).shape[-1]
    if m != np.shape(state.z)[-1]:
        raise ValueError(
            f"the feature map gives {m} features; the state has {np.shape(state.z)[-1]}"
        )
    o = Options(feature_map, eps, eps_policy)
    return step(state, o, jnp.asarray(q_t), jnp.asarray(k_t), jnp.asarray(v_t), key_valid)


# ----------------------------------------------------------------------------- the kernel level
#
# ``form``, ``modes`` (the causal modes it takes) and ``causal``'s default (``modes[0]``) are bound
# by ``functools.partial``; the public signature is the rest of :func:`prepare_kernel`'s.


def prepare_kernel(
    form: Form,
    modes: tuple[bool, ...],
    q: Float[ArrayLike, "... T_q H d_k"],
    k: Float[ArrayLike, "... T_k H d_k"],
    v: Float[ArrayLike, "... T_k H d_v"],
    *,
    feature_map: FeatureMapLike,
    causal: bool,
    key_mask: Bool[ArrayLike, "... T_k"] | None = None,
    eps: Real[ArrayLike, ""] = 0.0,
    eps_policy: EpsPolicy = "add",
) -> KernelCall:
    """Validate a kernel-level call of ``form``: the one validation of the kernel level."""
    check_mode(form, modes, causal)
    check_qkv(q, k, v, key_mask, causal)
    check_policy(eps, eps_policy)
    check_feature_map(feature_map)
    km = None if key_mask is None else jnp.asarray(key_mask)
    o = Options(feature_map, eps, eps_policy, causal, km, form=form)
    return KernelCall(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), o)


CAUSAL_ARG = """
    causal: If ``True``, query ``i`` reads keys ``j <= i`` only (needs ``T_q == T_k``). The
        default is the form's: ``True`` for the causal forms (prefix sums, recurrent,
        chunked), which refuse ``False``; ``False`` for the others (the associative form
        refuses ``True``)."""
OPTION_ARGS = """
    feature_map: The feature map ``phi``, a called :class:`FeatureMap`
        (e.g. :func:`attnref.linear.elu_plus_one`).{causal}
    key_mask: Boolean ``[..., T_k]`` (exactly the batch dims of {x}), ``True`` = the key
        may be read; ``None`` (default) allows every key.
    eps: The denominator's regulariser, a scalar ``>= 0``; the default 0 is the exact ratio.
    eps_policy: ``"add"`` (default, divide by ``den + eps``) or ``"clamp"`` (by
        ``max(den, eps)``).{more}"""
CHUNK_ARG = """
    chunk_size: Tokens per chunk, a positive int (default 16; static under ``jax.jit``)."""
RAISES = """

Raises:
    ValueError: If {shapes}
        ``key_mask`` is not ``[..., T_k]``, ``eps`` is negative or not a scalar, ``eps_policy``
        is unknown, ``causal`` is a mode the form refuses or ``True`` with ``T_q != T_k``, or
        (chunked form) ``chunk_size`` is not a positive int.
    TypeError: If {dtypes} ``causal`` is not a Python bool,
        ``key_mask`` is not boolean, or ``feature_map`` is not a (called) feature map."""
KERNEL_ARGS = (
    """Args:
    q: Queries ``[..., T_q, H, d_k]`` (the ``jax.nn`` layout: heads second to last).
    k: Keys ``[..., T_k, H, d_k]``, the batch dims, heads and dtype of ``q``.
    v: Values ``[..., T_k, H, d_v]``, the dtype of ``q``."""
    + OPTION_ARGS.format(causal=CAUSAL_ARG, x="``q``", more="{chunk}")
    + RAISES.format(
        shapes="``q``/``k``/``v`` are not ``[..., T, H, d]`` with matching batch dims,\n"
        "        heads and ``d_k``,",
        dtypes="``q``/``k``/``v`` differ in dtype,",
    )
)


def kernel_form(form: Form, modes: tuple[bool, ...], summary: str) -> Callable[..., Array]:
    """The public kernel-level function ``linear_<form>``: validate, scope float64, guard."""
    causal_only = modes == (True,)  # then T_q == T_k = T
    prepare = with_chunk_size(prepare_kernel) if form is chunked else prepare_kernel
    bound: Any = functools.partial(prepare, form, modes, causal=modes[0])
    if causal_only:  # T_q and T_k written T in the annotations
        signature = inspect.signature(bound)
        params = signature.parameters.values()
        t_only = [p.replace(annotation=re.sub(r"\bT_[qk]\b", "T", p.annotation)) for p in params]
        bound.__signature__ = signature.replace(parameters=t_only)
    t = "T" if causal_only else "T_q"
    level = Level(bound, KERNEL_ARGS.format(chunk=CHUNK_ARG if form is chunked else ""))
    returns = (
        f"``y [..., {t}, H, d_v]`` in the dtype of ``q``; zero where the adjusted denominator\n"
        "    is exactly zero (e.g. no allowed key)."
    )
    return public(level, form, name=f"linear_{form.__name__}", summary=summary, returns=returns)


linear_quadratic = kernel_form(
    quadratic,
    (False, True),
    "Quadratic form: ``A = phi(Q) phi(K)^T`` (masked), ``Y = (A V) / (A 1)`` row-wise.",
)
linear_associative = kernel_form(
    associative,
    (False,),
    "Associative (non-causal) form: ``phi(Q) (phi(K)^T V) / (phi(Q) (phi(K)^T 1))``.",
)
linear_prefix_sum = kernel_form(
    prefix_sum,
    (True,),
    "Causal prefix sums: ``S_t = sum_{j<=t} phi(k_j) v_j^T``, ``z_t = sum_{j<=t} phi(k_j)``,\n"
    "``y_t = phi(q_t) S_t / (phi(q_t) z_t)`` (memory ``T m d_v`` per head).",
)
linear_recurrent = kernel_form(
    recurrent,
    (True,),
    "Recurrent form: :func:`linear_step` under ``lax.scan``, one token at a time.",
)
linear_chunked = kernel_form(
    chunked,
    (True,),
    "Chunked form: causal quadratic attention inside each chunk of ``chunk_size`` tokens plus\n"
    "the state ``(S, z)`` carried across chunks by ``lax.scan``. Any ``chunk_size >= 1``; a last\n"
    "partial chunk is padded with masked keys and the padded queries are dropped.",
)
