"""Rotary position embedding (RoPE; Su et al. 2021, RoFormer) and the relative-pattern view.

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

**Multi-head attention** (row convention, shapes as in :mod:`attnref._src.standard`):
``q_n = rope(x_q W_Q[n] + b_Q[n], pos_q)``, ``k_n = rope(x_kv W_K[g(n)] + b_K[g(n)], pos_k)``,
``y = sum_n softmax(q_n k_n^T scale + bias, mask) (x_kv W_V[g(n)] + b_V[g(n)]) W_O[n] + b_O``.
Key/value heads may be shared (grouped-query attention): with ``K = W_K.shape[0]`` key heads
(and ``W_V.shape[0]`` value heads) dividing ``H``, query head ``n`` uses ``g(n) = n // (H / K)``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Float, Int

from attnref._src.checks import check_params, enable_x64, float64_scoped, x64_enabled
from attnref._src.common import HIGHEST, Prepared, add_output_bias, project, residual_or
from attnref._src.params import AttentionParams
from attnref._src.softmax import masked_softmax

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


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in np.shape(x))


def _dtype(x: Any) -> np.dtype[Any]:
    dtype = getattr(x, "dtype", None)
    return np.dtype(dtype) if dtype is not None else np.asarray(x).dtype


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
    if not np.issubdtype(_dtype(a), np.integer):
        raise TypeError(f"{name} must hold integer positions, got dtype {_dtype(a)}")


def _check_positions(name: str, positions: Any, lead: tuple[int, ...], t: int) -> None:
    """``positions`` must be integer and broadcast to ``lead + (t,)`` without growing it."""
    _check_integer(name, positions)
    shape = _shape(positions)
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


def _in_x64_if_float64(dtype: Any, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Run ``fn`` with x64 switched on when ``dtype`` asks for float64 (cf. ``float64_scoped``)."""
    if np.dtype(dtype) == np.float64 and not x64_enabled():
        with enable_x64():
            return fn(*args, **kwargs)
    return fn(*args, **kwargs)


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
    """
    d = _check_head_dim(head_dim)
    b = _check_base(base)
    return _in_x64_if_float64(dtype, _theta, d, b, np.dtype(dtype))


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
    shape = _shape(x)
    if len(shape) < 3:
        raise ValueError(f"x must have shape [..., T, N, head_dim] (rank >= 3), got {shape}")
    if not jnp.issubdtype(_dtype(x), jnp.floating):
        raise TypeError(f"x must be floating, got dtype {_dtype(x)}")
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
    """
    conv = _check_convention(convention)
    d = _check_head_dim(head_dim)
    b = _check_base(base)
    _check_integer("delta", delta)
    return _in_x64_if_float64(dtype, _rotation, jnp.asarray(delta), d, b, conv, np.dtype(dtype))


# ----------------------------------------------------------------------------- multi-head forms


def _groups(params: AttentionParams, name: str) -> int:
    """``H / K`` for the key (``name="w_k"``) or value (``"w_v"``) heads; validates ``K | H``."""
    h = params.num_heads
    k = int(np.shape(getattr(params, name))[0])
    if k < 1 or h % k:
        raise ValueError(
            f"params.{name} has {k} heads, which must divide the {h} query heads of params.w_q "
            "(grouped-query attention: query head n uses key/value head n // (H / K))"
        )
    return h // k


def _expand(y: Array, groups: int, axis: int) -> Array:
    """Repeat each key/value head ``groups`` times: head ``n`` becomes ``y[n // groups]``."""
    return y if groups == 1 else jnp.repeat(y, groups, axis=axis)


class _RopeInputs:
    """Validated inputs of the multi-head RoPE forms."""

    def __init__(
        self,
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
    ) -> None:
        self.convention = _check_convention(convention)
        self.base = _check_base(base)
        self.p = Prepared(params, x_q, x_kv, mask, bias, scale)
        self.g_k, self.g_v = _groups(params, "w_k"), _groups(params, "w_v")
        _check_head_dim(params.d_k, "d_k (params.w_q.shape[2])")
        p = self.p
        for name, pos, t in (
            ("positions_q", positions_q, p.t_q),
            ("positions_kv", positions_kv, p.t_k),
        ):
            if pos is not None:
                _check_positions(name, pos, p.batch_shape, t)
        # Default positions 0 .. T - 1 are NumPy constants, so the offsets stay static under jit.
        self.pos_q = np.arange(p.t_q) if positions_q is None else positions_q
        self.pos_k = np.arange(p.t_k) if positions_kv is None else positions_kv


def _hom(x: Array) -> Array:
    """Homogeneous coordinates ``x~ = [x, 1]`` on the last axis."""
    return jnp.concatenate([x, jnp.ones((*x.shape[:-1], 1), x.dtype)], axis=-1)


def _hom_weights(w: Any, b: Any) -> Array:
    """``W~ = [W; b]`` per head: ``[H, d_model + 1, d]`` (a zero row when there is no bias)."""
    w = jnp.asarray(w)
    row = jnp.zeros((w.shape[0], 1, w.shape[2]), w.dtype) if b is None else jnp.asarray(b)[:, None]
    return jnp.concatenate([w, row], axis=1)


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
    mask: Bool[ArrayLike, "... T_q T_k"] | None = None,
    bias: Float[ArrayLike, "... T_q T_k"] | None = None,
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
    """
    r = _RopeInputs(
        params, x_q, x_kv, positions_q, positions_kv, mask, bias, scale, base, convention
    )
    pos_q = jnp.asarray(r.pos_q)[..., None, :]  # a head axis: broadcasts to [..., H, T_q]
    pos_k = jnp.asarray(r.pos_k)[..., None, :]

    def compute(p: Prepared) -> Array:
        q = _rotate(project(p.x_q, params.w_q, params.b_q), pos_q, r.base, r.convention)
        k = _rotate(project(p.x_kv, params.w_k, params.b_k), pos_k, r.base, r.convention)
        k = _expand(k, r.g_k, axis=-3)
        v = _expand(project(p.x_kv, params.w_v, params.b_v), r.g_v, axis=-3)
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
    """
    conv = _check_convention(convention)
    check_params(params)
    _check_head_dim(params.d_k, "d_k (params.w_q.shape[2])")
    _check_integer("deltas", deltas)
    if np.ndim(deltas) != 1:
        raise ValueError(f"deltas must have shape [D], got {_shape(deltas)}")
    wk = _expand(jnp.asarray(params.w_k), _groups(params, "w_k"), axis=0)
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
    mask: Bool[ArrayLike, "... T_q T_k"] | None = None,
    bias: Float[ArrayLike, "... T_q T_k"] | None = None,
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
    """
    r = _RopeInputs(
        params, x_q, x_kv, positions_q, positions_kv, mask, bias, scale, base, convention
    )
    h = params.num_heads
    wq = _hom_weights(params.w_q, params.b_q)
    wk = _expand(_hom_weights(params.w_k, params.b_k), r.g_k, axis=0)
    wv = _expand(_hom_weights(params.w_v, params.b_v), r.g_v, axis=0)
    u, inv = _distinct_offsets(r.pos_q, r.pos_k)
    w_pat = _pattern_matrices(wq, wk, u, params.d_k, r.base, r.convention)  # [H, U, D1, D1]
    gathered = jnp.moveaxis(w_pat[:, inv], 0, -5)  # [..., H, T_q, T_k, D1, D1]
    d1 = params.d_model + 1
    gathered = jnp.broadcast_to(gathered, (*r.p.batch_shape, h, r.p.t_q, r.p.t_k, d1, d1))
    w_msg = jnp.einsum("hav,hvd->had", wv, params.w_o, precision=HIGHEST)  # [H, D1, d_model]

    def compute(p: Prepared) -> Array:
        xq, xkv = _hom(p.x_q), _hom(p.x_kv)
        logits = jnp.einsum("...qa,...hqkab,...kb->...hqk", xq, gathered, xkv, precision=HIGHEST)
        a = masked_softmax(p.add_bias(logits * p.scale), p.head_mask())
        m = jnp.einsum("...ka,had->...hkd", xkv, w_msg, precision=HIGHEST)
        y = add_output_bias(
            jnp.sum(jnp.einsum("...hqk,...hkd->...hqd", a, m, precision=HIGHEST), -3), params
        )
        return residual_or(y, p.x_q, residual)

    return r.p.guarded(compute, residual)
