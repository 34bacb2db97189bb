"""Per-head attention parameters and their merged matrices.

Row-vector convention (Vaswani et al. 2017): query head ``i`` computes ``q = x W_Q[i] + b_Q[i]``,
``k = x W_K[g(i)] + b_K[g(i)]``, ``v = x W_V[g(i)] + b_V[g(i)]`` and writes
``o = softmax(.) v W_O[i]``; the block adds ``b_O`` once. ``H`` query heads share ``K`` K/V heads
in groups of ``G = H / K``: ``g(i) = i // G`` (grouped-query attention, Ainslie et al. 2023;
multi-query, ``K = 1``, Shazeer 2019). Shapes and conventions: ``docs/conventions.md``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, no_type_check

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float

from attnref._src.core.checks import (
    BIAS_FIELDS,
    HIGHEST,
    PARAM_FIELDS,
    check_params,
    float64_scoped,
)
from attnref._src.core.entry import compiled


# @no_type_check: no runtime check of the fields (the suite's jaxtyping hook), since JAX rebuilds
# a pytree with any leaves (tree_map results, vmap axes, placeholders).
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
@no_type_check
class AttentionParams:
    """Per-head multi-head attention weights (a JAX pytree; absent biases are ``None``); query
    head ``i`` uses K/V head ``i // (H / K)``. Shapes are checked by every formulation, not here.

    Attributes:
        w_q: Query weights ``[H, d_model, d_k]``.
        w_k: Key weights ``[K, d_model, d_k]``.
        w_v: Value weights ``[K, d_model, d_v]``.
        w_o: Output weights ``[H, d_v, d_model]`` (Vaswani's stacked ``W_O``, split by head).
        b_q: Query bias ``[H, d_k]`` or ``None``.
        b_k: Key bias ``[K, d_k]`` or ``None``.
        b_v: Value bias ``[K, d_v]`` or ``None``.
        b_o: Output bias ``[d_model]`` or ``None`` (added once per block).
    """

    w_q: Float[ArrayLike, "H d_model d_k"]
    w_k: Float[ArrayLike, "K d_model d_k"]
    w_v: Float[ArrayLike, "K d_model d_v"]
    w_o: Float[ArrayLike, "H d_v d_model"]
    b_q: Float[ArrayLike, "H d_k"] | None = None
    b_k: Float[ArrayLike, "K d_k"] | None = None
    b_v: Float[ArrayLike, "K d_v"] | None = None
    b_o: Float[ArrayLike, " d_model"] | None = None

    @property
    def num_heads(self) -> int:
        """``H``, the number of query (and output) heads."""
        return int(np.shape(self.w_q)[0])

    @property
    def num_kv_heads(self) -> int:
        """``K``, the number of key/value heads (``H`` for multi-head, 1 for multi-query)."""
        return int(np.shape(self.w_k)[0])

    @property
    def group_size(self) -> int:
        """``G = H / K``, the number of consecutive query heads sharing one K/V head."""
        h, k = self.num_heads, self.num_kv_heads
        if k < 1 or h % k:
            raise ValueError(
                f"params.w_k has {k} heads but params.w_q has {h}; num_heads must be a multiple "
                "of num_kv_heads"
            )
        return h // k

    @property
    def d_model(self) -> int:
        """The model (residual stream) width, ``w_q.shape[1]``."""
        return int(np.shape(self.w_q)[1])

    @property
    def d_k(self) -> int:
        """The query/key head dim, ``w_q.shape[2]``."""
        return int(np.shape(self.w_q)[2])

    @property
    def d_v(self) -> int:
        """The value head dim, ``w_v.shape[2]``."""
        return int(np.shape(self.w_v)[2])

    @property
    def dtype(self) -> np.dtype[Any]:
        """The dtype of ``w_q`` (every leaf must share it)."""
        return np.dtype(self.w_q.dtype)  # type: ignore[union-attr]

    @property
    def has_bias(self) -> bool:
        """Whether any of ``b_q``, ``b_k``, ``b_v``, ``b_o`` is present."""
        return any(getattr(self, name) is not None for name in BIAS_FIELDS)

    def astype(self, dtype: Any) -> AttentionParams:
        """The same parameters as NumPy arrays of ``dtype`` (absent biases stay absent)."""
        return jax.tree_util.tree_map(lambda a: np.asarray(a).astype(dtype), self)


# checks.PARAM_FIELDS (WEIGHT_FIELDS + BIAS_FIELDS) is the one list of these fields.
assert tuple(f.name for f in dataclasses.fields(AttentionParams)) == PARAM_FIELDS


def init_params(
    seed: int,
    *,
    d_model: int,
    num_heads: int,
    d_k: int,
    d_v: int | None = None,
    bias: bool = False,
    dtype: Any = np.float32,
    num_kv_heads: int | None = None,
) -> AttentionParams:
    """Seeded random parameters (NumPy PCG64, platform-independent) as NumPy arrays of ``dtype``:
    ``W_Q, W_K, W_V ~ N(0, 1/d_model)``, ``W_O ~ N(0, 1/(H d_v))``, with ``bias=True`` every bias
    ``N(0, 0.1^2)`` (else ``None``); ``K = num_kv_heads`` (default ``H``) K/V heads, ``d_v``
    defaults to ``d_k``. ``ValueError`` if a size is not positive or ``K`` does not divide ``H``.
    """
    d_v = d_k if d_v is None else d_v
    kv = num_heads if num_kv_heads is None else num_kv_heads
    sizes = dict(d_model=d_model, num_heads=num_heads, d_k=d_k, d_v=d_v, num_kv_heads=kv)
    for name, val in sizes.items():
        if int(val) < 1:
            raise ValueError(f"{name} must be a positive integer, got {val}")
    if num_heads % kv:
        raise ValueError(
            f"num_heads={num_heads} is not a multiple of num_kv_heads={kv}; each key/value head "
            "serves num_heads / num_kv_heads query heads"
        )
    rng = np.random.default_rng(seed)
    h = num_heads

    def normal(shape: tuple[int, ...], std: float) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(dtype)

    w_q = normal((h, d_model, d_k), d_model**-0.5)
    w_k = normal((kv, d_model, d_k), d_model**-0.5)
    w_v = normal((kv, d_model, d_v), d_model**-0.5)
    w_o = normal((h, d_v, d_model), (h * d_v) ** -0.5)
    shapes = ((h, d_k), (kv, d_k), (kv, d_v), (d_model,))  # b_q, b_k, b_v, b_o, drawn in order
    biases = [normal(shape, 0.1) for shape in shapes] if bias else [None] * 4
    return AttentionParams(w_q, w_k, w_v, w_o, *biases)


# ----------------------------------------------------------------------------- key/value heads


def repeat_heads(a: Any, group_size: int, *, axis: int = 0) -> Any:
    """Repeat every K/V head ``group_size`` times along ``axis`` (``[K, ...] -> [K G, ...]``,
    entry ``i`` from ``i // group_size``); NumPy stays NumPy, ``group_size == 1`` or ``a=None``
    returns ``a``."""
    if group_size == 1 or a is None:
        return a
    if isinstance(a, jax.Array):
        return jnp.repeat(a, group_size, axis=axis)
    return np.repeat(np.asarray(a), group_size, axis=axis)


@float64_scoped
def repeat_kv_heads(params: AttentionParams) -> AttentionParams:
    """The equivalent multi-head (``K == H``) parameters: ``W_K'[i] = W_K[i // G]``, likewise
    ``W_V``, ``b_K``, ``b_V`` (exact copies: the same function; the gradient of a shared head
    sums its ``G`` copies'). Malformed ``params`` raise as in :func:`w_p`.
    """
    check_params(params)
    return repeat_kv_heads_unchecked(params)


@float64_scoped
def repeat_kv_heads_unchecked(params: AttentionParams) -> AttentionParams:
    """:func:`repeat_kv_heads` on parameters the caller has validated."""
    g = params.group_size
    if g == 1:
        return params
    kv = ("w_k", "w_v", "b_k", "b_v")
    return dataclasses.replace(params, **{n: repeat_heads(getattr(params, n), g) for n in kv})


def _grouped(w: Any, num_kv_heads: int) -> Array:
    """A per-query-head array ``[H, ...]`` viewed as ``[K, G, ...]`` (query head ``k G + j``)."""
    w = jnp.asarray(w)
    return w.reshape(num_kv_heads, w.shape[0] // num_kv_heads, *w.shape[1:])


def _per_query_head(spec: str, a: Any, b: Any) -> Array:
    """``einsum(spec, a, b)``, whose ``[K, G, ...]`` result is read back as ``[H, ...]``."""
    w = jnp.einsum(spec, a, b, precision=HIGHEST)
    return w.reshape(w.shape[0] * w.shape[1], *w.shape[2:])


# ----------------------------------------------------------------------------- merged matrices
#
# ``w_<x>_unchecked``: the einsum, for callers that have validated ``params``.


def w_p_unchecked(params: AttentionParams) -> Float[Array, "H d_model d_model"]:
    """``W_P[i] = W_Q[i] W_K[i // G]^T``."""
    return _per_query_head("kgdc,kec->kgde", _grouped(params.w_q, params.num_kv_heads), params.w_k)


def w_m_unchecked(params: AttentionParams) -> Float[Array, "H d_model d_model"]:
    """``W_M[i] = W_V[i // G] W_O[i]``."""
    return _per_query_head("kdv,kgve->kgde", params.w_v, _grouped(params.w_o, params.num_kv_heads))


def w_a_unchecked(params: AttentionParams) -> Float[Array, "H d_model d_model"]:
    """``W_A[i] = W_K[i // G] W_Q[i]^T = W_P[i]^T``."""
    return _per_query_head("kdc,kgec->kgde", params.w_k, _grouped(params.w_q, params.num_kv_heads))


def w_i_unchecked(params: AttentionParams) -> Float[Array, "H d_model d_model"]:
    """``W_I[i] = W_O[i]^T W_V[i // G]^T = W_M[i]^T``."""
    return _per_query_head("kgve,kdv->kged", _grouped(params.w_o, params.num_kv_heads), params.w_v)


_MERGED_ARGS = """

Args:
    params: Per-head weights (:class:`AttentionParams`, row convention).

Returns:
    ``[H, d_model, d_model]``, one matrix per query head (biases not included).

Raises:
    ValueError: If ``params`` is malformed (ranks, shapes, ``H % K != 0``).
    TypeError: If a weight is missing, or the parameters are not floating or mix dtypes.
"""


def _merged(unchecked: Any, name: str, summary: str) -> Any:
    """The public, validated, float64-scoped form of ``unchecked`` (its Args written once)."""

    @float64_scoped
    def merged(params: AttentionParams) -> Float[Array, "H d_model d_model"]:
        check_params(params)
        return compiled(unchecked, params)  # type: ignore[no-any-return]

    merged.__name__ = merged.__qualname__ = name
    merged.__doc__ = summary + _MERGED_ARGS
    return merged


w_p = _merged(
    w_p_unchecked,
    "w_p",
    """Pattern matrices ``W_P[i] = W_Q[i] W_K[i // G]^T`` (row convention), one per query head.

Logits ``(x_q W_P[i]) x^T``; query heads of one group share ``W_K`` but not ``W_P``.""",
)
w_m = _merged(
    w_m_unchecked,
    "w_m",
    """Message matrices ``W_M[i] = W_V[i // G] W_O[i]`` (row convention), one per query head.

Messages ``x W_M[i]``; query heads of one group share ``W_V`` but each has its own ``W_M``.""",
)
w_a = _merged(
    w_a_unchecked,
    "w_a",
    """Column-convention score matrices ``W_A[i] = W_K^T W_Q``, one per query head.

In the column notation of "Attention: All you need to know" (far.in.net, 2025-03-29),
``W_A = (W_K^c)^T W_Q^c = W_K[i // G] W_Q[i]^T = W_P[i]^T`` and ``A_{j,i} = x_j^T W_A x_i``;
the transpose of Elhage et al.'s (2021) QK matrix ``W_Q^T W_K`` (``docs/conventions.md``).""",
)
w_i = _merged(
    w_i_unchecked,
    "w_i",
    """Column-convention output-value matrices ``W_I[i] = W_O^T W_V``, one per query head.

In the column notation of "Attention: All you need to know" (far.in.net, 2025-03-29),
``W_I = (W_O^c)^T W_V^c = W_O[i]^T W_V[i // G]^T = W_M[i]^T``: Elhage et al.'s (2021) OV circuit
``W_OV = W_O W_V`` (``docs/conventions.md``).""",
)
