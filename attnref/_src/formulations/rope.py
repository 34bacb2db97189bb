"""Rotary position embedding (RoPE; Su et al. 2024, RoFormer) and the relative-pattern view.

**Frequencies.** For an even head dimension ``d`` there are ``d/2`` planes with frequencies
``theta_p = base^(-2p/d)``, ``p = 0 .. d/2 - 1`` (``base = 10000`` in the paper).

**Rotation.** A feature pair ``(a, b)`` of a token at integer position ``m`` is rotated by the angle
``m theta_p``::

    (a, b) -> (a cos(m theta_p) - b sin(m theta_p),  a sin(m theta_p) + b cos(m theta_p))

Two layouts of the pairs are in use (``convention=``):

* ``"rotate_half"`` (GPT-NeoX, Hugging Face Llama): pair ``p`` is ``(x_p, x_{p + d/2})``.
* ``"interleaved"`` (the RoFormer paper, GPT-J, Meta's Llama reference): pair ``p`` is
  ``(x_{2p}, x_{2p+1})``.

They are the same map up to a fixed permutation of the head dimension: with
``P x = concat(x[0::2], x[1::2])``, ``rope_interleaved(x) = P^-1 rope_rotate_half(P x)``.

**Row convention and the relative offset.** For a row vector ``q``, ``rope(q, m) = q R(m)`` with
``R(m)`` the block rotation of :func:`rope_rotation`; ``R(m) R(n)^T = R(m - n)``, so

    rope(q, m) . rope(k, n) = q R(m) R(n)^T k^T = q R(m - n) k^T

and the logits depend on the positions only through ``delta = pos_q - pos_k`` (query minus key).

**Angle dtype.** ``theta_p`` is evaluated in float64 by NumPy (``head_dim`` and ``base`` are
static Python values) and rounded once to the *angle dtype*: float64 for float64 inputs, float32
for every other input dtype (float32, float16, bfloat16). Positions are converted to the angle
dtype (exact for ``|m| < 2^24`` in float32), the angle ``m theta_p`` and its cos/sin are computed
in the angle dtype, and cos/sin are then rounded to the input dtype, in which the rotation itself
is computed (as Hugging Face Llama does). float64 inputs compute in float64 even with x64 off.

**Multi-head attention** (row convention, shapes as in :mod:`attnref._src.formulations.standard`):
``q_n = rope(x_q W_Q[n] + b_Q[n], pos_q)``, ``k_n = rope(x_kv W_K[g(n)] + b_K[g(n)], pos_k)``,
``y = sum_n softmax(q_n k_n^T scale + bias, mask) (x_kv W_V[g(n)] + b_V[g(n)]) W_O[n] + b_O``.
Key/value heads may be shared (grouped-query attention): with ``K = W_K.shape[0]`` key heads
(and ``W_V.shape[0]`` value heads) dividing ``H``, query head ``n`` uses ``g(n) = n // (H / K)``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Float, Int

from attnref import oracle, tolerance
from attnref._src.core import cost as _cost
from attnref._src.core.checks import (
    HIGHEST,
    check_params,
    dtype_of,
    float64_scoped,
    in_x64_if_float64,
    shape_of,
)
from attnref._src.core.common import (
    Prepared,
    add_output_bias,
    homogeneous,
    homogeneous_weights,
    prepare_rows,
    project,
    project_kv,
    residual_or,
)
from attnref._src.core.family import Example, ExampleProblem, Family, masked_example
from attnref._src.core.params import AttentionParams, repeat_heads
from attnref._src.core.registry import REFACTOR, Formulation, register
from attnref._src.core.softmax import masked_softmax
from attnref._src.formulations.standard import concat_cost

__all__ = [
    "CONVENTIONS",
    "apply_rope",
    "apply_rope_complex",
    "rope_attention",
    "rope_frequencies",
    "rope_pattern_matrices",
    "rope_patterns_attention",
    "rope_rotation",
]

CONVENTIONS = ("rotate_half", "interleaved")


# ----------------------------------------------------------------------------- validation


def _check_convention(convention: Any) -> str:
    if convention not in CONVENTIONS:
        raise ValueError(
            f"unknown RoPE convention {convention!r}; expected one of {CONVENTIONS} "
            "('rotate_half': pairs (x_p, x_{p+d/2}); 'interleaved': pairs (x_2p, x_2p+1))"
        )
    return str(convention)


def _check_head_dim(head_dim: Any, name: str = "head_dim") -> int:
    d = int(head_dim)
    if d != head_dim or d < 2 or d % 2:
        raise ValueError(
            f"RoPE rotates pairs of features, so {name} must be a positive even integer; "
            f"got {name}={head_dim}"
        )
    return d


def _check_base(base: Any) -> float:
    try:
        b = float(base)
    except (jax.errors.ConcretizationTypeError, TypeError) as err:
        raise TypeError(f"base must be a static Python number, got {base!r}") from err
    if not (np.isfinite(b) and b > 0.0):
        raise ValueError(f"base must be a positive finite number, got {base!r}")
    return b


def _check_integer(name: str, a: Any) -> None:
    if not np.issubdtype(dtype_of(a), np.integer):
        raise TypeError(f"{name} must hold integer positions, got dtype {dtype_of(a)}")


def _check_positions(name: str, positions: Any, lead: tuple[int, ...], t: int) -> None:
    """``positions`` must be integer and broadcast to ``lead + (t,)`` without growing it."""
    _check_integer(name, positions)
    shape = shape_of(positions)
    target = (*lead, t)
    want = f"[T={t}] or a shape broadcasting to {list(target)}"
    if len(shape) < 1 or shape[-1] != t:
        raise ValueError(f"{name} has shape {shape}; expected {want}")
    try:
        ok = np.broadcast_shapes(shape, target) == target
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"{name} has shape {shape}, which does not broadcast to {want}")


def _angle_dtype(dtype: Any) -> np.dtype[Any]:
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


# ----------------------------------------------------------------------------- the map itself


def _theta(head_dim: int, base: float, dtype: Any) -> Float[Array, " half"]:
    """``theta_p = base^(-2p/d)`` in float64 (NumPy), rounded once to ``dtype``."""
    p = np.arange(head_dim // 2, dtype=np.float64)
    return jnp.asarray(np.power(base, -2.0 * p / head_dim).astype(dtype))


def rope_frequencies(
    head_dim: int, base: float = 10000.0, *, dtype: Any = np.float32
) -> Float[Array, " half"]:
    """Frequencies ``theta_p = base^(-2p/head_dim)``, ``p = 0 .. head_dim/2 - 1``; shape
    ``[head_dim / 2]``.

    Evaluated in float64 and rounded once to ``dtype`` (float32 by default; float64 works with
    x64 off). ``head_dim`` must be even (RoPE rotates pairs of features).

    Args:
        head_dim: The (even, positive) head dimension ``d``.
        base: The frequency base (default 10000, the paper's), a static positive finite number.
        dtype: The result dtype (default float32).

    Returns:
        ``theta [head_dim / 2]`` of ``dtype``.

    Raises:
        ValueError: If ``head_dim`` is not a positive even integer, or ``base`` is not positive
            and finite.
        TypeError: If ``base`` is not a static Python number.
    """
    d = _check_head_dim(head_dim)
    b = _check_base(base)
    return in_x64_if_float64(dtype, _theta, d, b, np.dtype(dtype))


def _cos_sin(
    positions: Int[Array, "..."], head_dim: int, base: float, dtype: Any
) -> tuple[Array, Array]:
    """``cos, sin`` of ``m theta_p``: shape ``positions.shape + (head_dim/2,)``, in ``dtype``.

    The angle and its cos/sin are evaluated in the angle dtype, then rounded to ``dtype``.
    """
    adt = _angle_dtype(dtype)
    angle = jnp.asarray(positions).astype(adt)[..., None] * _theta(head_dim, base, adt)
    return jnp.cos(angle).astype(dtype), jnp.sin(angle).astype(dtype)


def _split(x: Array, convention: str) -> tuple[Array, Array]:
    """The two members ``(a_p, b_p)`` of every pair, each ``[..., d/2]``."""
    half = x.shape[-1] // 2
    if convention == "rotate_half":
        return x[..., :half], x[..., half:]
    return x[..., 0::2], x[..., 1::2]


def _merge(a: Array, b: Array, convention: str) -> Array:
    """Inverse of :func:`_split`."""
    if convention == "rotate_half":
        return jnp.concatenate([a, b], axis=-1)
    return jnp.stack([a, b], axis=-1).reshape(*a.shape[:-1], 2 * a.shape[-1])


def _rotate(x: Array, positions: Array, base: float, convention: str) -> Array:
    """RoPE on the last axis of ``x``; ``positions`` broadcasts to ``x.shape[:-1]``."""
    c, s = _cos_sin(positions, x.shape[-1], base, x.dtype)
    a, b = _split(x, convention)
    return _merge(a * c - b * s, a * s + b * c, convention)


def _rotate_complex(x: Array, positions: Array, base: float, convention: str) -> Array:
    """RoPE as ``z_p exp(i m theta_p)`` with ``z_p = a_p + i b_p`` (complex arithmetic)."""
    adt = _angle_dtype(x.dtype)
    cdt = np.complex128 if adt == np.float64 else np.complex64
    angle = jnp.asarray(positions).astype(adt)[..., None] * _theta(x.shape[-1], base, adt)
    rot = jnp.exp(1j * angle.astype(cdt))
    a, b = _split(x.astype(adt), convention)
    z = jax.lax.complex(a, b) * rot
    return _merge(jnp.real(z), jnp.imag(z), convention).astype(x.dtype)


def _check_kernel_layout(x: Any, positions: Any, convention: Any) -> str:
    conv = _check_convention(convention)
    shape = shape_of(x)
    if len(shape) < 3:
        raise ValueError(f"x must have shape [..., T, N, head_dim] (rank >= 3), got {shape}")
    if not jnp.issubdtype(dtype_of(x), jnp.floating):
        raise TypeError(f"x must be floating, got dtype {dtype_of(x)}")
    _check_head_dim(shape[-1], "head_dim (x.shape[-1])")
    _check_positions("positions", positions, shape[:-3], shape[-3])
    return conv


@float64_scoped
def apply_rope(
    x: Float[ArrayLike, "... T N head_dim"],
    positions: Int[ArrayLike, "... T"],
    *,
    base: float = 10000.0,
    convention: str = "rotate_half",
) -> Float[Array, "... T N head_dim"]:
    """Rotary position embedding of ``x [..., T, N, head_dim]`` (tokens, heads, head dim, the
    layout of ``jax.nn.dot_product_attention``); ``positions`` are integers ``[..., T]`` or
    ``[T]`` (broadcast over the leading axes of ``x``, shared by all heads).

    Every pair ``(a, b)`` at position ``m`` becomes ``(a cos(m theta_p) - b sin(m theta_p),
    a sin(m theta_p) + b cos(m theta_p))``, ``theta_p = base^(-2p/head_dim)``, with pair ``p``
    ``(x_p, x_{p + head_dim/2})`` for ``convention="rotate_half"`` (GPT-NeoX, Hugging Face
    Llama) and ``(x_{2p}, x_{2p+1})`` for ``"interleaved"`` (RoFormer, GPT-J, Meta Llama).
    Angles are computed in float32 (float64 for float64 ``x``); see the module docstring.
    ``base`` and ``convention`` are static.

    Args:
        x: Queries or keys ``[..., T, N, head_dim]``, floating, ``head_dim`` even.
        positions: Integer positions ``[..., T]`` or ``[T]``, broadcasting to ``x.shape[:-2]``
            (shared by all heads).
        base: The frequency base (default 10000, the paper's), a static positive finite number.
        convention: ``"rotate_half"`` (default; pairs ``(x_p, x_{p + d/2})``) or
            ``"interleaved"`` (pairs ``(x_{2p}, x_{2p+1})``); static.

    Returns:
        The rotated ``x``, same shape and dtype.

    Raises:
        ValueError: If ``x`` has rank < 3 or an odd ``head_dim``, ``positions`` do not broadcast
            to ``[..., T]``, ``base`` is not positive and finite, or ``convention`` is unknown.
        TypeError: If ``x`` is not floating, ``positions`` are not integers, or ``base`` is not
            a static Python number.
    """
    conv = _check_kernel_layout(x, positions, convention)
    x = jnp.asarray(x)
    return _rotate(x, jnp.asarray(positions)[..., None], _check_base(base), conv)


@float64_scoped
def apply_rope_complex(
    x: Float[ArrayLike, "... T N head_dim"],
    positions: Int[ArrayLike, "... T"],
    *,
    base: float = 10000.0,
    convention: str = "rotate_half",
) -> Float[Array, "... T N head_dim"]:
    """The map of :func:`apply_rope` written as complex multiplication (a second computation).

    Pair ``p`` is read as ``z_p = a_p + i b_p`` and multiplied by ``exp(i m theta_p)``:
    ``Re``/``Im`` of ``z_p exp(i m theta_p)`` are the rotated pair. The arithmetic is in complex64
    (complex128 for float64 ``x``) and the result is rounded to ``x``'s dtype.

    Args:
        x: Queries or keys ``[..., T, N, head_dim]``, floating, ``head_dim`` even.
        positions: Integer positions ``[..., T]`` or ``[T]``, broadcasting to ``x.shape[:-2]``
            (shared by all heads).
        base: The frequency base (default 10000, the paper's), a static positive finite number.
        convention: ``"rotate_half"`` (default; pairs ``(x_p, x_{p + d/2})``) or
            ``"interleaved"`` (pairs ``(x_{2p}, x_{2p+1})``); static.

    Returns:
        The rotated ``x``, same shape and dtype (equal to :func:`apply_rope` up to rounding).

    Raises:
        ValueError: If ``x`` has rank < 3 or an odd ``head_dim``, ``positions`` do not broadcast
            to ``[..., T]``, ``base`` is not positive and finite, or ``convention`` is unknown.
        TypeError: If ``x`` is not floating, ``positions`` are not integers, or ``base`` is not
            a static Python number.
    """
    conv = _check_kernel_layout(x, positions, convention)
    x = jnp.asarray(x)
    return _rotate_complex(x, jnp.asarray(positions)[..., None], _check_base(base), conv)


def _pair_indices(head_dim: int, convention: str) -> tuple[np.ndarray, np.ndarray]:
    half = head_dim // 2
    if convention == "rotate_half":
        return np.arange(half), np.arange(half) + half
    return np.arange(0, head_dim, 2), np.arange(1, head_dim, 2)


def _rotation(delta: Array, head_dim: int, base: float, convention: str, dtype: Any) -> Array:
    c, s = _cos_sin(delta, head_dim, base, dtype)
    i, j = _pair_indices(head_dim, convention)
    p = np.arange(head_dim // 2)
    # Constant 0/+-1 patterns per plane: cos on (i, i) and (j, j), sin on (i, j), -sin on (j, i).
    # Every entry of R gets one non-zero term, so the sum over planes is exact.
    cos_pat = np.zeros((head_dim // 2, head_dim, head_dim))
    sin_pat = np.zeros((head_dim // 2, head_dim, head_dim))
    cos_pat[p, i, i] = cos_pat[p, j, j] = 1.0
    sin_pat[p, i, j], sin_pat[p, j, i] = 1.0, -1.0
    terms = c[..., None, None] * cos_pat.astype(dtype) + s[..., None, None] * sin_pat.astype(dtype)
    return jnp.sum(terms, axis=-3)


def rope_rotation(
    delta: Int[ArrayLike, "..."],
    head_dim: int,
    *,
    base: float = 10000.0,
    convention: str = "rotate_half",
    dtype: Any = np.float32,
) -> Float[Array, "... head_dim head_dim"]:
    """The block rotation ``R(delta)`` (``[..., head_dim, head_dim]``) for ROW vectors.

    For pair ``p = (i, j)`` (indices per ``convention``) and ``c, s = cos, sin(delta theta_p)``:
    ``R[i, i] = R[j, j] = c``, ``R[i, j] = s``, ``R[j, i] = -s``, zero elsewhere, so that
    ``rope(q, m) = q R(m)`` (:func:`apply_rope` on a row ``q``). ``R`` is orthogonal, ``R(0) = I``,
    ``R(a) R(b) = R(a + b)`` and ``R(n)^T = R(-n)``, hence

        (q R(m)) . (k R(n)) = q R(m) R(n)^T k^T = q R(m - n) k^T:

    the logits depend only on ``delta = m - n`` (query position minus key position). Entries are
    in ``dtype`` (angles in float32, or float64 for float64).

    Args:
        delta: Integer offsets, any shape ``[...]``.
        head_dim: The (even, positive) head dimension.
        base: The frequency base (default 10000, the paper's), a static positive finite number.
        convention: ``"rotate_half"`` (default; pairs ``(x_p, x_{p + d/2})``) or
            ``"interleaved"`` (pairs ``(x_{2p}, x_{2p+1})``); static.
        dtype: The entries' dtype (default float32).

    Returns:
        ``R(delta)`` ``[..., head_dim, head_dim]`` of ``dtype``.

    Raises:
        ValueError: If ``head_dim`` is not a positive even integer, ``base`` is not positive and
            finite, or ``convention`` is unknown.
        TypeError: If ``delta`` is not integer, or ``base`` is not a static Python number.
    """
    conv = _check_convention(convention)
    d = _check_head_dim(head_dim)
    b = _check_base(base)
    _check_integer("delta", delta)
    return in_x64_if_float64(dtype, _rotation, jnp.asarray(delta), d, b, conv, np.dtype(dtype))


# ----------------------------------------------------------------------------- multi-head forms


@dataclasses.dataclass(frozen=True)
class _RopeInputs:
    """Validated inputs of the multi-head RoPE forms (built by :func:`_prepare_rope`)."""

    p: Prepared
    pos_q: Any  # integer positions; NumPy arange(T) by default
    pos_k: Any
    base: float
    convention: str
    group_size: int  # G = H / K: query head n reads key/value head n // G


def _prepare_rope(
    params: AttentionParams,
    x_q: Any,
    x_kv: Any,
    positions_q: Any,
    positions_kv: Any,
    mask: Any,
    bias: Any,
    scale: Any,
    base: Any,
    convention: Any,
) -> _RopeInputs:
    """Validate a multi-head RoPE call once (:func:`prepare_rows`, then the RoPE options)."""
    conv = _check_convention(convention)
    b = _check_base(base)
    p = prepare_rows(params, x_q, x_kv, mask, bias, scale)
    _check_head_dim(params.d_k, "d_k (params.w_q.shape[2])")
    for name, pos, t in (
        ("positions_q", positions_q, p.t_q),
        ("positions_kv", positions_kv, p.t_k),
    ):
        if pos is not None:
            _check_positions(name, pos, p.batch_shape, t)
    # Default positions 0 .. T - 1 are NumPy constants, so the offsets stay static under jit.
    return _RopeInputs(
        p=p,
        pos_q=np.arange(p.t_q) if positions_q is None else positions_q,
        pos_k=np.arange(p.t_k) if positions_kv is None else positions_kv,
        base=b,
        convention=conv,
        group_size=params.group_size,
    )


def _mix(params: AttentionParams, a: Array, v: Array) -> Array:
    """``sum_n A_n V_n W_O[n] + b_O`` for weights ``[..., H, T_q, T_k]``, values ``[..., H, T_k,
    d_v]``."""
    z = jnp.einsum("...hqk,...hkv->...hqv", a, v, precision=HIGHEST)
    y = jnp.einsum("...hqv,hvd->...qd", z, params.w_o, precision=HIGHEST)
    return add_output_bias(y, params)


@float64_scoped
def rope_attention(
    params: AttentionParams,
    x_q: Float[ArrayLike, "... T_q d_model"],
    x_kv: Float[ArrayLike, "... T_k d_model"] | None = None,
    *,
    positions_q: Int[ArrayLike, "... T_q"] | None = None,
    positions_kv: Int[ArrayLike, "... T_k"] | None = None,
    mask: Bool[ArrayLike, "... #T_q #T_k"] | None = None,
    bias: Float[ArrayLike, "... #T_q #T_k"] | None = None,
    scale: float | None = None,
    base: float = 10000.0,
    convention: str = "rotate_half",
    residual: bool = False,
) -> Float[Array, "... T_q d_model"]:
    """Multi-head attention with rotary position embedding on queries and keys.

    ``q_n = rope(x_q W_Q[n] + b_Q[n], pos_q)``, ``k_n = rope(x_kv W_K[g] + b_K[g], pos_k)`` with
    ``g = n // (H / K)`` (``K = W_K.shape[0]`` key heads; values likewise),
    ``y = sum_n softmax(q_n k_n^T scale + bias, mask) (x_kv W_V[g] + b_V[g]) W_O[n] + b_O``.
    Shapes ``x_q [..., T_q, d_model]``, ``x_kv [..., T_k, d_model]`` (default ``x_q``); integer
    positions ``[..., T]`` or ``[T]`` (default ``arange(T_q)``, ``arange(T_k)``); output
    ``[..., T_q, d_model]`` (``x_q +`` it if ``residual``). ``scale`` defaults to ``1/sqrt(d_k)``;
    ``d_k`` must be even. Fully masked rows get zero weights (output ``b_O``), as everywhere.
    ``base`` and ``convention`` are static. A key or value a query may not read (mask, ``-inf``
    bias) never reaches that query's output or gradients, whatever it holds.

    Args:
        params: Per-head weights (:class:`attnref.AttentionParams`); query head ``i`` reads
            key/value head ``i // G`` (``G = H / K``).
        x_q: Query tokens, row vectors ``[..., T_q, d_model]``, the dtype of ``params``.
        x_kv: Key/value tokens ``[..., T_k, d_model]`` with the batch shape of ``x_q``;
            ``None`` (default) means ``x_q`` (self-attention).
        positions_q: Integer query positions ``[..., T_q]`` or ``[T_q]``; ``None`` (default)
            means ``arange(T_q)``.
        positions_kv: Integer key positions ``[..., T_k]`` or ``[T_k]``; ``None`` (default)
            means ``arange(T_k)``.
        mask: Boolean, broadcastable to ``[..., T_q, T_k]``, ``True`` = may attend; ``None``
            (default) allows every pair.
        bias: Floating additive bias, broadcastable to ``[..., T_q, T_k]``, added to the scaled
            logits (``-inf`` masks like ``False``); cast to the dtype of ``x_q``.
        scale: The logit scale; ``None`` (default) means ``1/sqrt(d_k)``.
        base: The frequency base (default 10000, the paper's), a static positive finite number.
        convention: ``"rotate_half"`` (default; pairs ``(x_p, x_{p + d/2})``) or
            ``"interleaved"`` (pairs ``(x_{2p}, x_{2p+1})``); static.
        residual: If ``True``, return ``x_q + MultiHead`` (the residual-stream update).

    Returns:
        The block output ``[..., T_q, d_model]``, the dtype of ``x_q``; a fully masked query row
        is ``b_O`` (zero without biases).

    Raises:
        ValueError: If ``params`` is malformed or ``d_k`` is odd, ``x_q``/``x_kv`` have rank
            < 2, the wrong ``d_model`` or different batch shapes, ``mask``/``bias``/positions do
            not broadcast to their shapes, ``scale`` is not a scalar, ``base`` is not positive
            and finite, or ``convention`` is unknown.
        TypeError: If ``x_q``, ``x_kv`` and ``params`` mix dtypes, ``mask`` is not boolean,
            ``bias`` is not floating, positions are not integers, ``scale`` is not a real
            number, or ``base`` is not a static Python number.
    """
    r = _prepare_rope(
        params, x_q, x_kv, positions_q, positions_kv, mask, bias, scale, base, convention
    )
    pos_q = jnp.asarray(r.pos_q)[..., None, :]  # a head axis: broadcasts to [..., H, T_q]
    pos_k = jnp.asarray(r.pos_k)[..., None, :]

    def compute(p: Prepared) -> Array:
        q = _rotate(project(p.x_q, params.w_q, params.b_q), pos_q, r.base, r.convention)
        k = _rotate(project(p.x_kv, params.w_k, params.b_k), pos_k, r.base, r.convention)
        k = repeat_heads(k, r.group_size, axis=-3)
        v = project_kv(p.x_kv, params.w_v, params.b_v, r.group_size)
        logits = jnp.einsum("...hqd,...hkd->...hqk", q, k, precision=HIGHEST) * p.scale
        a = masked_softmax(p.add_bias(logits), p.head_mask())
        return residual_or(_mix(params, a, v), p.x_q, residual)

    return r.p.guarded(compute, residual)


def _pattern_matrices(
    wq: Array, wk: Array, deltas: Array, head_dim: int, base: float, conv: str
) -> Array:
    """``W_Q[n] R(delta) W_K[n]^T`` for every head and delta: ``[H, U, d_in, d_in]``."""
    r = _rotation(deltas, head_dim, base, conv, wq.dtype)
    return jnp.einsum("hak,ukl,hbl->huab", wq, r, wk, precision=HIGHEST)


@float64_scoped
def rope_pattern_matrices(
    params: AttentionParams,
    deltas: Int[ArrayLike, " D"],
    *,
    base: float = 10000.0,
    convention: str = "rotate_half",
) -> Float[Array, "H D d_model d_model"]:
    """Relative pattern matrices ``W_P(delta)_n = W_Q[n] R(delta) W_K[g(n)]^T``:
    ``[H, D, d_model, d_model]`` for integer ``deltas [D]`` (``delta = pos_q - pos_k``).

    The logit of query row ``x_i`` at position ``m`` and key row ``x_j`` at position ``n``
    (without biases) is ``x_i W_P(m - n) x_j^T * scale``. The bias rows are *not* included here;
    :func:`rope_patterns_attention` uses the homogeneous ``[W_Q; b_Q] R [W_K; b_K]^T`` instead.

    Args:
        params: Per-head weights (:class:`attnref.AttentionParams`), ``d_k`` even; query head
            ``n`` uses key head ``g(n) = n // (H / K)``.
        deltas: Integer offsets ``[D]`` (query position minus key position).
        base: The frequency base (default 10000, the paper's), a static positive finite number.
        convention: ``"rotate_half"`` (default; pairs ``(x_p, x_{p + d/2})``) or
            ``"interleaved"`` (pairs ``(x_{2p}, x_{2p+1})``); static.

    Returns:
        ``W_P(delta)_n`` for every query head and offset, ``[H, D, d_model, d_model]``.

    Raises:
        ValueError: If ``params`` is malformed or ``d_k`` is odd, ``deltas`` is not 1-D,
            ``base`` is not positive and finite, or ``convention`` is unknown.
        TypeError: If ``deltas`` is not integer, or ``base`` is not a static Python number.
    """
    conv = _check_convention(convention)
    check_params(params)
    _check_head_dim(params.d_k, "d_k (params.w_q.shape[2])")
    _check_integer("deltas", deltas)
    if np.ndim(deltas) != 1:
        raise ValueError(f"deltas must have shape [D], got {shape_of(deltas)}")
    wk = repeat_heads(jnp.asarray(params.w_k), params.group_size)
    wq = jnp.asarray(params.w_q)
    return _pattern_matrices(wq, wk, jnp.asarray(deltas), params.d_k, _check_base(base), conv)


def _concrete(a: Any) -> np.ndarray | None:
    """``a`` as a NumPy array, or ``None`` when it is traced."""
    try:
        return np.asarray(a)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def _distinct_offsets(pos_q: Any, pos_k: Any) -> tuple[Array, Array]:
    """Offsets ``u [U]`` and the index of ``pos_q[i] - pos_k[j]`` in ``u`` (``[..., T_q, T_k]``).

    Concrete positions (including the defaults, also under ``jit``) give exactly the distinct
    offsets that occur (NumPy, static). Traced positions cannot be deduplicated at a static size,
    so every ``(i, j)`` gets its own offset entry (``U = T_q T_k`` per position batch).
    """
    cq, ck = _concrete(pos_q), _concrete(pos_k)
    if cq is not None and ck is not None:
        deltas = cq[..., :, None].astype(np.int64) - ck[..., None, :]
        u, inv = np.unique(deltas, return_inverse=True)
        return jnp.asarray(u), jnp.asarray(inv.reshape(deltas.shape))
    deltas = jnp.asarray(pos_q)[..., :, None] - jnp.asarray(pos_k)[..., None, :]
    return deltas.ravel(), jnp.arange(deltas.size).reshape(deltas.shape)


@float64_scoped
def rope_patterns_attention(
    params: AttentionParams,
    x_q: Float[ArrayLike, "... T_q d_model"],
    x_kv: Float[ArrayLike, "... T_k d_model"] | None = None,
    *,
    positions_q: Int[ArrayLike, "... T_q"] | None = None,
    positions_kv: Int[ArrayLike, "... T_k"] | None = None,
    mask: Bool[ArrayLike, "... #T_q #T_k"] | None = None,
    bias: Float[ArrayLike, "... #T_q #T_k"] | None = None,
    scale: float | None = None,
    base: float = 10000.0,
    convention: str = "rotate_half",
    residual: bool = False,
) -> Float[Array, "... T_q d_model"]:
    """:func:`rope_attention` in the relative pattern view (a teaching / reference form).

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
    memory ``O(H T_q T_k d_model^2)``, a reference form, not a fast one. Arguments as in
    :func:`rope_attention`.

    Args:
        params: Per-head weights (:class:`attnref.AttentionParams`); query head ``i`` reads
            key/value head ``i // G`` (``G = H / K``).
        x_q: Query tokens, row vectors ``[..., T_q, d_model]``, the dtype of ``params``.
        x_kv: Key/value tokens ``[..., T_k, d_model]`` with the batch shape of ``x_q``;
            ``None`` (default) means ``x_q`` (self-attention).
        positions_q: Integer query positions ``[..., T_q]`` or ``[T_q]``; ``None`` (default)
            means ``arange(T_q)``.
        positions_kv: Integer key positions ``[..., T_k]`` or ``[T_k]``; ``None`` (default)
            means ``arange(T_k)``.
        mask: Boolean, broadcastable to ``[..., T_q, T_k]``, ``True`` = may attend; ``None``
            (default) allows every pair.
        bias: Floating additive bias, broadcastable to ``[..., T_q, T_k]``, added to the scaled
            logits (``-inf`` masks like ``False``); cast to the dtype of ``x_q``.
        scale: The logit scale; ``None`` (default) means ``1/sqrt(d_k)``.
        base: The frequency base (default 10000, the paper's), a static positive finite number.
        convention: ``"rotate_half"`` (default; pairs ``(x_p, x_{p + d/2})``) or
            ``"interleaved"`` (pairs ``(x_{2p}, x_{2p+1})``); static.
        residual: If ``True``, return ``x_q + MultiHead`` (the residual-stream update).

    Returns:
        The block output ``[..., T_q, d_model]``, the dtype of ``x_q``; a fully masked query row
        is ``b_O`` (zero without biases).

    Raises:
        ValueError: If ``params`` is malformed or ``d_k`` is odd, ``x_q``/``x_kv`` have rank
            < 2, the wrong ``d_model`` or different batch shapes, ``mask``/``bias``/positions do
            not broadcast to their shapes, ``scale`` is not a scalar, ``base`` is not positive
            and finite, or ``convention`` is unknown.
        TypeError: If ``x_q``, ``x_kv`` and ``params`` mix dtypes, ``mask`` is not boolean,
            ``bias`` is not floating, positions are not integers, ``scale`` is not a real
            number, or ``base`` is not a static Python number.
    """
    r = _prepare_rope(
        params, x_q, x_kv, positions_q, positions_kv, mask, bias, scale, base, convention
    )
    h = params.num_heads
    wq = homogeneous_weights(params.w_q, params.b_q)
    wk = repeat_heads(homogeneous_weights(params.w_k, params.b_k), r.group_size)
    wv = repeat_heads(homogeneous_weights(params.w_v, params.b_v), r.group_size)
    u, inv = _distinct_offsets(r.pos_q, r.pos_k)
    w_pat = _pattern_matrices(wq, wk, u, params.d_k, r.base, r.convention)  # [H, U, D1, D1]
    gathered = jnp.moveaxis(w_pat[:, inv], 0, -5)  # [..., H, T_q, T_k, D1, D1]
    d1 = params.d_model + 1
    gathered = jnp.broadcast_to(gathered, (*r.p.batch_shape, h, r.p.t_q, r.p.t_k, d1, d1))
    w_msg = jnp.einsum("hav,hvd->had", wv, params.w_o, precision=HIGHEST)  # [H, D1, d_model]

    def compute(p: Prepared) -> Array:
        xq, xkv = homogeneous(p.x_q), homogeneous(p.x_kv)
        logits = jnp.einsum("...qa,...hqkab,...kb->...hqk", xq, gathered, xkv, precision=HIGHEST)
        a = masked_softmax(p.add_bias(logits * p.scale), p.head_mask())
        m = jnp.einsum("...ka,had->...hkd", xkv, w_msg, precision=HIGHEST)
        y = add_output_bias(
            jnp.sum(jnp.einsum("...hqk,...hkd->...hqd", a, m, precision=HIGHEST), -3), params
        )
        return residual_or(y, p.x_q, residual)

    return r.p.guarded(compute, residual)


# ----------------------------------------------------------------------------- the RoPE family


def _rope_example(problem: ExampleProblem, causal: bool) -> Example:
    """The softmax family's example (a causal mask or none); default positions ``arange(T)``,
    rotate-half pairs."""
    example = masked_example(problem, causal)
    return dataclasses.replace(example, note="rotate_half, " + example.note)


ROPE = Family(
    name="rope",
    oracle=oracle.rope_attention,
    bound=tolerance.rope_attention_error_bound,
    signature="apply(params, x_q, x_kv=None, *, positions_q=None, positions_kv=None, "
    "mask=None, bias=None, scale=None, base=10000.0, convention='rotate_half', residual=False)",
    note="Scale $1/\\sqrt{d_k}$ unless `scale=` is given; positions default to `arange(T)`; "
    "`convention='rotate_half'` pairs $(x_p, x_{p + d/2})$, `'interleaved'` pairs $(x_{2p}, "
    "x_{2p+1})$. Fully masked rows as in the softmax family (output $b_O$); see "
    "[RoPE](../rope.md).",
    equation_symbols=("R(",),
    static_argnames=("residual", "base", "convention"),
    example=_rope_example,
)


# ----------------------------------------------------------------------------- registry entries
#
# The cost models assume the default positions ``arange(T_q)``, ``arange(T_k)`` (shape ``[T]``,
# shared by the batch and the heads, so ``cos``/``sin`` are evaluated ``(T_q + T_k) d_k / 2``
# times each; see ``attnref._src.core.cost._angles``), with the counting conventions of
# ``attnref._src.core.cost``.

ROFORMER = (
    "Su et al. (2024), RoFormer: Enhanced Transformer with Rotary Position Embedding, "
    "Neurocomputing 568 (arXiv:2104.09864)."
)


def rope_cost(
    d: _cost.Dims, *, positions_batch: int = 1, traced_positions: bool = False
) -> _cost.Cost:
    """Concat's counts plus the rotations of ``q`` and ``k``: ``a c - b s`` and ``a s + b c``
    per pair (6 elementwise ops per pair per head and token) and the angles ``m theta_p`` (one
    multiply per position and plane). The matmuls are concat's: a rotation is elementwise, not a
    ``dot``.

    ``positions_batch`` is the number of position rows (1 for the default ``[T]`` positions;
    ``B`` for positions ``[B, T]``); ``traced_positions`` says they are ``jit`` arguments rather
    than constants (the defaults are constants)."""
    c = concat_cost(d)
    b, h, half = d.batch, d.heads, d.d_k // 2
    el_a, tr_a, angle_tensors = _cost.angles(positions_batch * (d.t_q + d.t_k), d, traced_positions)
    pairs = b * h * (d.t_q + d.t_k) * half  # rotated pairs of q and k
    # per side: the two halves (slices), four products, two sums, the merged result
    rotation_tensors = [
        n for t in (d.t_q, d.t_k) for n in [b * h * t * half] * 8 + [b * h * t * d.d_k]
    ]
    tensors = angle_tensors + rotation_tensors
    extra = sum(tensors) * d.itemsize
    return dataclasses.replace(
        c,
        elementwise_flops=c.elementwise_flops + _cost.ROTATE_PER_PAIR * pairs + el_a,
        transcendentals=c.transcendentals + tr_a,
        intermediate_bytes=max(c.intermediate_bytes, max(tensors) * d.itemsize),
        workspace_bytes=c.workspace_bytes + extra,
    )


def rope_patterns_cost(
    d: _cost.Dims, *, offsets: int | None = None, traced_positions: bool = False
) -> _cost.Cost:
    """The relative pattern-matrix form. ``U = offsets`` pattern matrices are formed (default
    ``T_q + T_k - 1``: the default positions; concrete positions give the distinct values of
    ``pos_q[i] - pos_k[j]``, traced positions ``[B, T]`` give ``B T_q T_k``, with
    ``traced_positions=True``), each from a rotation ``R(delta)`` built elementwise from 0/+-1
    patterns (``d_k / 2`` planes of ``d_k^2`` entries: two multiplies and an add each, then the
    sum over planes) and ``W~_Q R W~_K^T`` (the einsum contracts ``W~_Q R`` first:
    ``2 H U D1 d_k^2 + 2 H U D1^2 d_k``, ``D1 = d_model + 1``). The logits contract ``x~_i``
    with the gathered ``W~_P`` first (``2 B H T_q T_k D1^2``), then with ``x~_j``
    (``2 B H T_q T_k D1``). Values go through the merged ``W~_M = W~_V W_O`` (homogeneous, so
    ``b_V W_O`` is a row of it and costs no elementwise add). The gathered
    ``[B, H, T_q, T_k, D1, D1]`` tensor is the largest intermediate."""
    b, h, dm, dk, dv, tq, tk = d.batch, d.heads, d.d_model, d.d_k, d.d_v, d.t_q, d.t_k
    u = tq + tk - 1 if offsets is None else offsets
    d1, half = dm + 1, dk // 2
    logits = b * h * tq * tk
    el_a, tr_a, angle_tensors = _cost.angles(u, d, traced_positions)
    mm = (
        2 * h * u * d1 * dk * dk  # W~_Q R(delta)
        + 2 * h * u * d1 * d1 * dk  # (W~_Q R) W~_K^T
        + 2 * logits * d1 * d1  # x~_i W~_P
        + 2 * logits * d1  # (x~_i W~_P) x~_j^T
        + 2 * h * d1 * dv * dm  # W~_M = W~_V W_O
        + 2 * b * tk * d1 * h * dm  # messages x~_kv W~_M
        + 2 * logits * dm  # sum_j a_ij M_j
    )
    el = (
        el_a
        + 3 * u * half * dk * dk  # c P_cos, s P_sin and their sum, per plane
        + u * (half - 1) * dk * dk  # the sum over planes
        + _cost.softmax_elementwise(d)
        + b * (h - 1) * tq * dm  # the sum over heads
        + (b * tq * dm if d.bias else 0)  # b_O
    )
    tensors = [
        *angle_tensors,
        h * d1 * dk,  # W~_Q, W~_K, W~_V
        h * d1 * dk,
        h * d1 * dv,
        *[u * half * dk * dk] * 3,  # the rotation's per-plane terms and their sum
        u * dk * dk,  # R(delta)
        h * u * d1 * dk,  # W~_Q R
        h * u * d1 * d1,  # W~_P
        h * tq * tk * d1 * d1,  # gathered per (i, j)
        b * h * tq * tk * d1 * d1,  # broadcast over the batch
        b * tq * d1,  # x~_q, x~_kv
        b * tk * d1,
        b * h * tq * tk * d1,  # x~_i W~_P
        *_cost.softmax_tensors(d, logits),
        h * d1 * dm,  # W~_M
        b * h * tk * dm,  # messages
        b * h * tq * dm,  # per-head mixes
        b * tq * dm,  # y
    ]
    return _cost.finish(d, mm, el, logits + tr_a, tensors)


register(
    Formulation(
        id="rope",
        title="Rotary position embedding (rotate q and k)",
        equation=(
            r"s_{ij} = \frac{\big(q_i R(m_i)\big)\big(k_j R(n_j)\big)^\top}{\sqrt{d_k}},"
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
            r"s_{ij} = \frac{\tilde x_i\, W_P(m_i - n_j)\, \tilde x_j^\top}{\sqrt{d_k}},"
            r"\quad W_P(\delta) = \tilde W_Q\, R(\delta)\, \tilde W_K^\top,"
            r"\quad \tilde x = [x, 1],\ \tilde W = [W; b]"
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
