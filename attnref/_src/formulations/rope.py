"""Rotary position embedding (RoPE; Su et al. 2024, RoFormer) and the relative-pattern view.

A feature pair ``(a, b)`` at integer position ``m`` turns by ``m theta_p``, ``theta_p =
base^(-2p/d)``; pairs are ``(x_p, x_{p + d/2})`` (``"rotate_half"``: GPT-NeoX, Hugging Face
Llama) or ``(x_{2p}, x_{2p+1})`` (``"interleaved"``: RoFormer, GPT-J, Meta's Llama). For row
vectors ``rope(q, m) = q R(m)`` and ``R(m) R(n)^T = R(m - n)``, so ``rope(q, m) . rope(k, n) =
q R(m - n) k^T``: the logits depend only on ``pos_q - pos_k``. Multi-head (row convention):
``y = sum_n softmax(rope(q_n, pos_q) rope(k_{g(n)}, pos_k)^T scale + bias, mask) V_{g(n)} W_O[n]
+ b_O``, ``g(n) = n // (H / K)``. The angle dtype (float64 for float64 inputs, else float32)
and the two layouts' permutation are in ``docs/rope.md``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float, Int

from attnref._src.core.checks import (
    HIGHEST,
    check_params,
    device_array,
    float64_scoped,
    in_x64_if_float64,
    shape_of,
)
from attnref._src.core.common import (
    BLOCK_RETURNS,
    Bias,
    Keys,
    Mask,
    Queries,
    add_output_bias,
    homogeneous,
    homogeneous_weights,
    project,
    project_kv,
    residual_or,
)
from attnref._src.core.entry import compiled, public
from attnref._src.core.params import AttentionParams, repeat_heads
from attnref._src.core.registry import REFACTOR, Formulation, register
from attnref._src.core.softmax import masked_softmax
from attnref._src.formulations.rope_family import (
    FREQUENCY_ARGS,
    KERNEL_ARGS,
    PATTERN_ARGS,
    ROFORMER,
    ROPE,
    ROPE_ROWS,
    ROTATION_ARGS,
    Rotary,
    check_base,
    check_convention,
    check_head_dim,
    check_integer,
    check_kernel_layout,
    rope_cost,
    rope_patterns_cost,
    with_args,
)

# ----------------------------------------------------------------------------- rotary attention


def rotate(
    x: Float[Array, "... d"], positions: Int[ArrayLike, "..."], base: float, convention: str
) -> Float[Array, "... d"]:
    """``(a, b) -> (a cos(m theta_p) - b sin(m theta_p), a sin(m theta_p) + b cos(m theta_p))``
    on the last axis of ``x``; ``positions`` (``m``) broadcasts to ``x.shape[:-1]``."""
    c, s = cos_sin(positions, x.shape[-1], base, x.dtype)
    a, b = split(x, convention)
    return merge(a * c - b * s, a * s + b * c, convention)


def rope(
    params: AttentionParams,
    x_q: Queries,
    x_kv: Keys,
    mask: Mask,
    bias: Bias,
    scale: Array,
    residual: bool,
    rot: Rotary,
) -> Float[Array, "... T_q d_model"]:
    """``y = sum_n softmax(rope(q_n, m) rope(k_n, n)^T scale + bias, mask) V_n W_O[n] + b_O``:
    the logits depend on the positions only through ``m - n`` (``rot``: positions, base, pairs)."""
    pos_q = jnp.asarray(rot.pos_q)[..., None, :]  # a head axis: broadcasts to [..., H, T_q]
    pos_k = jnp.asarray(rot.pos_k)[..., None, :]
    q = rotate(project(x_q, params.w_q, params.b_q), pos_q, rot.base, rot.convention)
    k = rotate(project(x_kv, params.w_k, params.b_k), pos_k, rot.base, rot.convention)
    k = repeat_heads(k, params.group_size, axis=-3)  #                    K_n  [..., H, T_k, d_k]
    v = project_kv(x_kv, params.w_v, params.b_v, params.group_size)  #    V_n  [..., H, T_k, d_v]
    logits = jnp.einsum("...hqd,...hkd->...hqk", q, k, precision=HIGHEST)
    return residual_or(mix(params, weights(logits, mask, bias, scale), v), x_q, residual)


# ----------------------------------------------------------------------------- its pieces


def cos_sin(
    positions: Int[ArrayLike, "..."], head_dim: int, base: float, dtype: Any
) -> tuple[Array, Array]:
    """``cos, sin`` of ``m theta_p`` (``positions.shape + (head_dim/2,)``), evaluated in the
    angle dtype, then rounded to ``dtype``."""
    adt = angle_dtype(dtype)
    angle = jnp.asarray(positions).astype(adt)[..., None] * theta(head_dim, base, adt)
    return jnp.cos(angle).astype(dtype), jnp.sin(angle).astype(dtype)


def theta(head_dim: int, base: float, dtype: Any) -> Float[Array, " half"]:
    """``theta_p = base^(-2p/d)`` in float64 (NumPy), rounded once to ``dtype``."""
    p = np.arange(head_dim // 2, dtype=np.float64)
    return device_array(np.power(base, -2.0 * p / head_dim).astype(dtype))


def angle_dtype(dtype: Any) -> np.dtype[Any]:
    """float64 for float64 inputs, float32 for every other dtype."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


def split(x: Array, convention: str) -> tuple[Array, Array]:
    """The two members ``(a_p, b_p)`` of every pair, each ``[..., d/2]``."""
    half = x.shape[-1] // 2
    if convention == "rotate_half":
        return x[..., :half], x[..., half:]
    return x[..., 0::2], x[..., 1::2]


def merge(a: Array, b: Array, convention: str) -> Array:
    """Inverse of :func:`split`."""
    if convention == "rotate_half":
        return jnp.concatenate([a, b], axis=-1)
    return jnp.stack([a, b], axis=-1).reshape(*a.shape[:-1], 2 * a.shape[-1])


def weights(logits: Array, mask: Mask, bias: Bias, scale: Array) -> Float[Array, "... H T_q T_k"]:
    """``softmax(logits scale + bias, mask)`` per head (``mask``/``bias`` ``[..., T_q, T_k]``)."""
    logits = logits * scale
    logits = logits if bias is None else logits + jnp.expand_dims(bias, -3)
    return masked_softmax(logits, None if mask is None else jnp.expand_dims(mask, -3))


def mix(params: AttentionParams, a: Array, v: Array) -> Array:
    """``sum_n A_n V_n W_O[n] + b_O`` for weights ``[..., H, T_q, T_k]``, values ``[..., H, T_k,
    d_v]``."""
    z = jnp.einsum("...hqk,...hkv->...hqv", a, v, precision=HIGHEST)
    y = jnp.einsum("...hqv,hvd->...qd", z, params.w_o, precision=HIGHEST)
    return add_output_bias(y, params)


# ----------------------------------------------------------------------------- the relative view


def rope_patterns(
    params: AttentionParams,
    x_q: Queries,
    x_kv: Keys,
    mask: Mask,
    bias: Bias,
    scale: Array,
    residual: bool,
    rot: Rotary,
) -> Float[Array, "... T_q d_model"]:
    """``logits_nij = x~_i W~_P(pos_i - pos_j)_n x~_j^T scale + bias_ij`` with
    ``W~_P(delta)_n = W~_Q[n] R(delta) W~_K[g]^T``, ``M_n = x~_kv W~_V[g] W_O[n]`` and
    ``y = sum_n softmax(logits_n, mask) M_n + b_O``."""
    g, d1 = params.group_size, params.d_model + 1
    wq = homogeneous_weights(params.w_q, params.b_q)  # W~ = [W; b]             [H, D1, d_k]
    wk = repeat_heads(homogeneous_weights(params.w_k, params.b_k), g)
    wv = repeat_heads(homogeneous_weights(params.w_v, params.b_v), g)
    u, inv = distinct_offsets(rot.pos_q, rot.pos_k)
    w_pat = pattern_matrices(wq, wk, u, params.d_k, rot.base, rot.convention)  # [H, U, D1, D1]
    shape = (*x_q.shape[:-2], params.num_heads, x_q.shape[-2], x_kv.shape[-2], d1, d1)
    gathered = jnp.broadcast_to(jnp.moveaxis(w_pat[:, inv], 0, -5), shape)  # W~_P per (i, j)
    w_msg = jnp.einsum("hav,hvd->had", wv, params.w_o, precision=HIGHEST)  # [H, D1, d_model]
    xq, xkv = homogeneous(x_q), homogeneous(x_kv)
    logits = jnp.einsum("...qa,...hqkab,...kb->...hqk", xq, gathered, xkv, precision=HIGHEST)
    a = weights(logits, mask, bias, scale)
    m = jnp.einsum("...ka,had->...hkd", xkv, w_msg, precision=HIGHEST)  # M_n [..., H, T_k, d_model]
    y = jnp.sum(jnp.einsum("...hqk,...hkd->...hqd", a, m, precision=HIGHEST), -3)
    return residual_or(add_output_bias(y, params), x_q, residual)


def pattern_matrices(
    wq: Array, wk: Array, deltas: Array, head_dim: int, base: float, convention: str
) -> Array:
    """``W_P(delta)_n = W_Q[n] R(delta) W_K[n]^T`` for every head and delta: ``[H, U, d, d]``."""
    r = rotation(deltas, head_dim, base, convention, wq.dtype)
    return jnp.einsum("hak,ukl,hbl->huab", wq, r, wk, precision=HIGHEST)


def rotation(delta: Array, head_dim: int, base: float, convention: str, dtype: Any) -> Array:
    """``R(delta) [..., d, d]`` for row vectors: ``R[i, i] = R[j, j] = c``, ``R[i, j] = s``,
    ``R[j, i] = -s`` for every pair ``p = (i, j)``, ``c, s = cos, sin(delta theta_p)``."""
    c, s = cos_sin(delta, head_dim, base, dtype)
    half = head_dim // 2
    p = np.arange(half)
    i, j = (p, p + half) if convention == "rotate_half" else (2 * p, 2 * p + 1)
    # Constant 0/+-1 patterns per plane: cos on (i, i) and (j, j), sin on (i, j), -sin on (j, i).
    # Every entry of R gets one non-zero term, so the sum over planes is exact.
    cos_pat, sin_pat = np.zeros((2, half, head_dim, head_dim))
    cos_pat[p, i, i] = cos_pat[p, j, j] = 1.0
    sin_pat[p, i, j], sin_pat[p, j, i] = 1.0, -1.0
    terms = c[..., None, None] * cos_pat.astype(dtype) + s[..., None, None] * sin_pat.astype(dtype)
    return jnp.sum(terms, axis=-3)


def distinct_offsets(pos_q: Any, pos_k: Any) -> tuple[Array, Array]:
    """Offsets ``u [U]`` and the index of ``pos_q[i] - pos_k[j]`` in ``u`` (``[..., T_q, T_k]``):
    the distinct offsets for concrete positions (NumPy, static), one per ``(i, j)`` for traced
    ones (no static-size deduplication)."""
    try:
        cq, ck = np.asarray(pos_q), np.asarray(pos_k)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        deltas = jnp.asarray(pos_q)[..., :, None] - jnp.asarray(pos_k)[..., None, :]
        return deltas.ravel(), jnp.arange(deltas.size).reshape(deltas.shape)
    deltas = cq[..., :, None].astype(np.int64) - ck[..., None, :]
    u, inv = np.unique(deltas, return_inverse=True)
    return jnp.asarray(u), jnp.asarray(inv.reshape(deltas.shape))


# ----------------------------------------------------------------------------- the complex form


def rotate_complex(x: Array, positions: Array, base: float, convention: str) -> Array:
    """RoPE as ``z_p exp(i m theta_p)`` with ``z_p = a_p + i b_p`` (complex arithmetic)."""
    adt = angle_dtype(x.dtype)
    cdt = np.complex128 if adt == np.float64 else np.complex64
    angle = jnp.asarray(positions).astype(adt)[..., None] * theta(x.shape[-1], base, adt)
    rot = jnp.exp(1j * angle.astype(cdt))
    a, b = split(x.astype(adt), convention)
    z = jax.lax.complex(a, b) * rot
    return merge(jnp.real(z), jnp.imag(z), convention).astype(x.dtype)


# ----------------------------------------------------------------------------- public functions


@with_args(FREQUENCY_ARGS, "``theta [head_dim / 2]`` of ``dtype``.")
def rope_frequencies(
    head_dim: int, base: float = 10000.0, *, dtype: Any = np.float32
) -> Float[Array, " half"]:
    """Frequencies ``theta_p = base^(-2p/head_dim)``, ``p = 0 .. head_dim/2 - 1``, evaluated
    in float64 and rounded once to ``dtype`` (float64 works with x64 off)."""
    d, b = check_head_dim(head_dim), check_base(base)
    return in_x64_if_float64(dtype, theta, d, b, np.dtype(dtype))


@with_args(KERNEL_ARGS, "The rotated ``x``, same shape and dtype.")
@float64_scoped
def apply_rope(
    x: Float[ArrayLike, "... T N head_dim"],
    positions: Int[ArrayLike, "... T"],
    *,
    base: float = 10000.0,
    convention: str = "rotate_half",
) -> Float[Array, "... T N head_dim"]:
    """Rotary position embedding of ``x [..., T, N, head_dim]`` (the layout of
    ``jax.nn.dot_product_attention``), positions shared by all heads: every pair ``(a, b)``
    (per ``convention``, module docstring) at position ``m`` becomes ``(a cos(m theta_p) -
    b sin(m theta_p), a sin(m theta_p) + b cos(m theta_p))``, ``theta_p =
    base^(-2p/head_dim)``; angles in float32 (float64 for float64 ``x``)."""
    conv = check_kernel_layout(x, positions, convention)
    return compiled(rotate_heads, rotate, x, positions, check_base(base), conv)  # type: ignore[no-any-return]


@with_args(
    KERNEL_ARGS,
    "The rotated ``x``, same shape and dtype (equal to :func:`apply_rope` up to rounding).",
)
@float64_scoped
def apply_rope_complex(
    x: Float[ArrayLike, "... T N head_dim"],
    positions: Int[ArrayLike, "... T"],
    *,
    base: float = 10000.0,
    convention: str = "rotate_half",
) -> Float[Array, "... T N head_dim"]:
    """:func:`apply_rope` as complex multiplication (a second computation): pair ``p`` is
    ``z_p = a_p + i b_p`` times ``exp(i m theta_p)``, in complex64 (complex128 for float64
    ``x``), rounded to ``x``'s dtype."""
    conv = check_kernel_layout(x, positions, convention)
    return compiled(rotate_heads, rotate_complex, x, positions, check_base(base), conv)  # type: ignore[no-any-return]


def rotate_heads(
    rotation: Callable[..., Array], x: Array, positions: Array, base: float, convention: str
) -> Array:
    """``rotation`` (:func:`rotate` or :func:`rotate_complex`) of ``x [..., T, N, head_dim]``,
    ``positions [..., T]`` shared by the heads."""
    return rotation(x, jnp.asarray(positions)[..., None], base, convention)


@with_args(ROTATION_ARGS, "``R(delta)`` ``[..., head_dim, head_dim]`` of ``dtype``.")
def rope_rotation(
    delta: Int[ArrayLike, "..."],
    head_dim: int,
    *,
    base: float = 10000.0,
    convention: str = "rotate_half",
    dtype: Any = np.float32,
) -> Float[Array, "... head_dim head_dim"]:
    """The block rotation ``R(delta)`` (``[..., head_dim, head_dim]``) for ROW vectors:
    ``rope(q, m) = q R(m)``; for pair ``p = (i, j)`` (per ``convention``) and ``c, s = cos,
    sin(delta theta_p)``, ``R[i, i] = R[j, j] = c``, ``R[i, j] = s``, ``R[j, i] = -s``, zero
    elsewhere. ``R`` is orthogonal and ``R(m) R(n)^T = R(m - n)``, so ``(q R(m)) . (k R(n)) =
    q R(m - n) k^T``. Entries in ``dtype`` (angles in float32, or float64 for float64)."""
    conv = check_convention(convention)
    d, b = check_head_dim(head_dim), check_base(base)
    check_integer("delta", delta)
    delta_a = device_array(delta)
    return in_x64_if_float64(dtype, compiled, rotation, delta_a, d, b, conv, np.dtype(dtype))


@with_args(
    PATTERN_ARGS, "``W_P(delta)_n`` for every query head and offset, ``[H, D, d_model, d_model]``."
)
@float64_scoped
def rope_pattern_matrices(
    params: AttentionParams,
    deltas: Int[ArrayLike, " D"],
    *,
    base: float = 10000.0,
    convention: str = "rotate_half",
) -> Float[Array, "H D d_model d_model"]:
    """Relative pattern matrices ``W_P(delta)_n = W_Q[n] R(delta) W_K[g(n)]^T`` for integer
    ``deltas [D]`` (``delta = pos_q - pos_k``): the bias-free logit of ``x_i`` at ``m`` and
    ``x_j`` at ``n`` is ``x_i W_P(m - n) x_j^T scale`` (:func:`rope_patterns_attention` uses
    the homogeneous ``[W_Q; b_Q] R [W_K; b_K]^T``)."""
    conv = check_convention(convention)
    check_params(params)
    check_head_dim(params.d_k, "d_k (params.w_q.shape[2])")
    check_integer("deltas", deltas)
    if np.ndim(deltas) != 1:
        raise ValueError(f"deltas must have shape [D], got {shape_of(deltas)}")
    args = (params, device_array(deltas), check_base(base), conv)
    return compiled(params_pattern_matrices, *args)  # type: ignore[no-any-return]


def params_pattern_matrices(
    params: AttentionParams, deltas: Array, base: float, convention: str
) -> Array:
    """:func:`pattern_matrices` of ``params``' heads (K/V heads repeated per query head)."""
    wk = repeat_heads(jnp.asarray(params.w_k), params.group_size)
    return pattern_matrices(jnp.asarray(params.w_q), wk, deltas, params.d_k, base, convention)


rope_attention = public(
    ROPE_ROWS,
    rope,
    name="rope_attention",
    summary="""Multi-head attention with rotary position embedding on queries and keys.

``q_n = rope(x_q W_Q[n] + b_Q[n], pos_q)``, ``k_n = rope(x_kv W_K[g] + b_K[g], pos_k)`` with
``g = n // (H / K)`` (``K = W_K.shape[0]`` key heads; values likewise),
``y = sum_n softmax(q_n k_n^T scale + bias, mask) (x_kv W_V[g] + b_V[g]) W_O[n] + b_O``.
Shapes ``x_q [..., T_q, d_model]``, ``x_kv [..., T_k, d_model]`` (default ``x_q``); integer
positions ``[..., T]`` or ``[T]`` (default ``arange(T_q)``, ``arange(T_k)``); output
``[..., T_q, d_model]`` (``x_q +`` it if ``residual``). ``scale`` defaults to ``1/sqrt(d_k)``;
``d_k`` must be even. Fully masked rows get zero weights (output ``b_O``), as everywhere.
``base`` and ``convention`` are static. A key or value a query may not read (mask, ``-inf``
bias) never reaches that query's output or gradients, whatever it holds.""",
    returns=BLOCK_RETURNS,
)
rope_patterns_attention = public(
    ROPE_ROWS,
    rope_patterns,
    name="rope_patterns_attention",
    summary=""":func:`rope_attention` in the relative pattern view (a teaching / reference form).

With homogeneous coordinates ``x~ = [x, 1]``, ``W~_Q[n] = [W_Q[n]; b_Q[n]]`` and
``W~_K[n] = [W_K[g]; b_K[g]]`` (``(d_model + 1) x d_k``), every head has one pattern matrix
per offset, ``W~_P(delta)_n = W~_Q[n] R(delta) W~_K[n]^T`` (``(d_model + 1)^2``), and

    logits_nij = x~_i W~_P(pos_i - pos_j)_n x~_j^T * scale + bias_ij,
    M_n = x~_kv W~_V[g] W_O[n]  (messages, = X W_M[n] + b_V W_O[n] as in merged.py),
    y = sum_n softmax(logits_n, mask) M_n + b_O.

Unlike the position-free patterns form, ``b_K`` does not cancel here (the rotation between
``q`` and ``b_K`` varies along a query row), so both bias rows are kept. ``W~_P`` is computed
for the distinct offsets that occur (when the positions are concrete, as the defaults always
are; traced positions give one offset entry per ``(i, j)``) and gathered per ``(i, j)``:
memory ``O(H T_q T_k d_model^2)``, a reference form, not a fast one.""",
    returns=BLOCK_RETURNS,
)


# ----------------------------------------------------------------------------- registry entries

register(
    Formulation(
        id="rope",
        title="Rotary position embedding (rotate q and k)",
        equation=(
            r"s^{(h)}_{ij} = \frac{\big(q^{(h)}_i R(m_i)\big)\big(k^{(h)}_j R(n_j)\big)^\top}"
            r"{\sqrt{d_k}},\ h = 1, \dots, H,"
            r"\quad R(m) = \bigoplus_{p} \begin{pmatrix} \cos m\theta_p & \sin m\theta_p \\"
            r" -\sin m\theta_p & \cos m\theta_p \end{pmatrix},\ \theta_p = b^{-2p/d_k}"
        ),
        convention="row",
        citation=ROFORMER,
        apply=rope_attention,
        native=rope_attention,
        summary=(
            "Queries and keys rotated pairwise by position-dependent angles (rotate-half or "
            "interleaved pairs); values untouched."
        ),
        cost="As concat plus O(H (T_q + T_k) d_k) for the rotations; memory O(H T_q T_k).",
        cost_model=rope_cost,
        family=ROPE,
    )
)

register(
    Formulation(
        id="rope_patterns",
        title="RoPE as a relative-position pattern matrix",
        equation=(
            r"s^{(h)}_{ij} = \frac{\tilde x_i\, W_{P,h}(m_i - n_j)\, \tilde x_j^\top}{\sqrt{d_k}},"
            r"\quad W_{P,h}(\delta) = \tilde W_{Q,h}\, R(\delta)\, \tilde W_{K,h}^\top,"
            r"\quad \tilde x = [x, 1],\ \tilde W_{\cdot,h} = [W_{\cdot,h}; b_{\cdot,h}]"
        ),
        convention="row",
        citation=ROFORMER + " Pattern view: " + REFACTOR,
        apply=rope_patterns_attention,
        native=rope_patterns_attention,
        summary=(
            "The pattern matrix becomes a function of the offset m - n: one d_model x d_model "
            "W_P per distinct offset, gathered per (query, key) pair."
        ),
        cost=(
            "FLOPs O(H n_delta d_model^2 d_k) to form W_P(delta) for n_delta offsets, O(H T_q "
            "T_k d_model^2) for the logits; memory O(H T_q T_k d_model)."
        ),
        cost_model=rope_patterns_cost,
        family=ROPE,
    )
)
