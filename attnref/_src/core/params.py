"""Per-head attention parameters, their merged matrices, and fused-layout converters.

Row-vector convention (Vaswani et al. 2017): a token is a row ``x`` of length ``d_model`` and
query head ``i`` computes ``q = x W_Q[i] + b_Q[i]``, ``k = x W_K[g(i)] + b_K[g(i)]``,
``v = x W_V[g(i)] + b_V[g(i)]`` and writes ``o = softmax(.) v W_O[i]``; the block adds ``b_O`` once.

Shapes: ``W_Q: [H, d_model, d_k]``, ``W_K: [K, d_model, d_k]``, ``W_V: [K, d_model, d_v]``,
``W_O: [H, d_v, d_model]``, ``b_Q: [H, d_k]``, ``b_K: [K, d_k]``, ``b_V: [K, d_v]``,
``b_O: [d_model]``. Biases are optional (``None``).

**Key/value heads.** ``H`` query heads share ``K`` key/value heads, ``H % K == 0``, in groups of
``G = H / K`` consecutive query heads: query head ``i`` reads K/V head ``g(i) = i // G`` (the
grouping of ``jax.nn.dot_product_attention``, PyTorch's ``enable_gqa`` and Flax). ``K == H`` is
ordinary multi-head attention (Vaswani et al. 2017), ``1 < K < H`` grouped-query attention
(Ainslie et al. 2023) and ``K == 1`` multi-query attention (Shazeer 2019).
:func:`repeat_kv_heads` gives the equivalent ``K == H`` parameters.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
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


# @no_type_check: no runtime check of the fields (the suite's jaxtyping hook), since JAX rebuilds
# a pytree with any leaves (tree_map results, vmap axes, placeholders).
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
@no_type_check
class AttentionParams:
    """Per-head multi-head attention weights (a JAX pytree; absent biases are ``None``).

    ``H`` query heads (``w_q``, ``w_o``, ``b_q``) and ``K`` key/value heads (``w_k``, ``w_v``,
    ``b_k``, ``b_v``) with ``H % K == 0``; query head ``i`` uses K/V head ``i // (H / K)``.
    Row convention: ``q = x W_Q[i] + b_Q[i]`` for a token row ``x [d_model]``. Shapes are
    checked by every formulation, not here; :func:`attnref.init_params` draws random ones.

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
    """Seeded random parameters with fan-in scaling, as NumPy arrays of ``dtype``.

    ``W_Q, W_K, W_V ~ N(0, 1/d_model)``, ``W_O ~ N(0, 1/(H d_v))``; with ``bias=True`` every bias
    is drawn ``N(0, 0.1^2)`` (non-zero, so that tests exercise the bias paths). Drawing with
    NumPy's PCG64 keeps the values identical on every platform and independent of JAX's x64 flag.
    ``num_kv_heads=K`` (default ``H``) draws ``K`` key/value heads, ``H % K == 0``; the default
    draws exactly what earlier versions drew for the same seed.

    Args:
        seed: Seed of NumPy's ``default_rng``.
        d_model: The model width, a positive int.
        num_heads: The number of query heads ``H``, a positive int.
        d_k: The query/key head dim, a positive int.
        d_v: The value head dim; ``None`` (default) means ``d_k``.
        bias: If ``True``, draw all four biases; default ``False`` (every bias ``None``).
        dtype: The arrays' dtype (default float32).
        num_kv_heads: The number of key/value heads ``K``; ``None`` (default) means ``H``.

    Returns:
        :class:`AttentionParams` of NumPy arrays, ``w_q [H, d_model, d_k]``,
        ``w_k [K, d_model, d_k]``, ``w_v [K, d_model, d_v]``, ``w_o [H, d_v, d_model]``.

    Raises:
        ValueError: If a size is not a positive integer, or ``num_heads`` is not a multiple of
            ``num_kv_heads``.
    """
    d_v = d_k if d_v is None else d_v
    kv = num_heads if num_kv_heads is None else num_kv_heads
    for name, val in (
        ("d_model", d_model),
        ("num_heads", num_heads),
        ("d_k", d_k),
        ("d_v", d_v),
        ("num_kv_heads", kv),
    ):
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
    if not bias:
        return AttentionParams(w_q, w_k, w_v, w_o)
    return AttentionParams(
        w_q,
        w_k,
        w_v,
        w_o,
        b_q=normal((h, d_k), 0.1),
        b_k=normal((kv, d_k), 0.1),
        b_v=normal((kv, d_v), 0.1),
        b_o=normal((d_model,), 0.1),
    )


# ----------------------------------------------------------------------------- key/value heads


def repeat_heads(a: Any, group_size: int, *, axis: int = 0) -> Any:
    """Repeat every K/V head ``group_size`` times along ``axis`` (``[K, ...] -> [K G, ...]``).

    Entry ``i`` of the result is entry ``i // group_size`` of ``a``: the grouping rule of the
    module docstring. NumPy arrays stay NumPy arrays (exact copies); JAX arrays and tracers use
    ``jnp.repeat``. ``group_size == 1`` returns ``a`` itself.
    """
    if group_size == 1:
        return a
    if isinstance(a, jax.Array):
        return jnp.repeat(a, group_size, axis=axis)
    return np.repeat(np.asarray(a), group_size, axis=axis)


@float64_scoped
def repeat_kv_heads(params: AttentionParams) -> AttentionParams:
    """The equivalent multi-head (``K == H``) parameters of grouped- or multi-query params.

    ``W_K'[i] = W_K[i // G]``, ``W_V'[i] = W_V[i // G]``, ``b_K'[i] = b_K[i // G]``,
    ``b_V'[i] = b_V[i // G]`` for ``i < H`` and ``G = H / K``; ``W_Q``, ``W_O`` and the other
    biases are passed through. The copies are exact, so every formulation (and the oracle) gives
    the same function of the inputs with either set. Parameters that are already multi-head are
    returned unchanged. Under differentiation the gradient with respect to a shared K/V head is
    the sum of the gradients of its ``G`` copies.

    Args:
        params: :class:`AttentionParams` with ``K`` key/value heads, ``H % K == 0``.

    Returns:
        :class:`AttentionParams` with ``H`` key/value heads (``params`` itself when ``K == H``);
        NumPy leaves stay NumPy, JAX leaves JAX.

    Raises:
        ValueError: If ``params`` is malformed (ranks, shapes, ``H % K != 0``).
        TypeError: If a weight is missing, or the parameters are not floating or mix dtypes.
    """
    check_params(params)
    return repeat_kv_heads_unchecked(params)


@float64_scoped
def repeat_kv_heads_unchecked(params: AttentionParams) -> AttentionParams:
    """:func:`repeat_kv_heads` on parameters the caller has validated."""
    g = params.group_size
    if g == 1:
        return params
    return dataclasses.replace(
        params,
        w_k=repeat_heads(params.w_k, g),
        w_v=repeat_heads(params.w_v, g),
        b_k=None if params.b_k is None else repeat_heads(params.b_k, g),
        b_v=None if params.b_v is None else repeat_heads(params.b_v, g),
    )


def _grouped(w: Any, num_kv_heads: int) -> Array:
    """A per-query-head array ``[H, ...]`` viewed as ``[K, G, ...]`` (query head ``k G + j``)."""
    w = jnp.asarray(w)
    return w.reshape(num_kv_heads, w.shape[0] // num_kv_heads, *w.shape[1:])


def _per_query_head(w: Array) -> Array:
    """``[K, G, ...] -> [H, ...]``, the inverse of :func:`_grouped`."""
    return w.reshape(w.shape[0] * w.shape[1], *w.shape[2:])


# Unvalidated bodies of w_p, w_m, w_a, w_i (the public functions validate, then call these);
# for callers that have validated ``params`` already.


def w_p_unchecked(params: AttentionParams) -> Array:
    wq = _grouped(params.w_q, params.num_kv_heads)
    return _per_query_head(jnp.einsum("kgdc,kec->kgde", wq, params.w_k, precision=HIGHEST))


def w_m_unchecked(params: AttentionParams) -> Array:
    wo = _grouped(params.w_o, params.num_kv_heads)
    return _per_query_head(jnp.einsum("kdv,kgve->kgde", params.w_v, wo, precision=HIGHEST))


def w_a_unchecked(params: AttentionParams) -> Array:
    wq = _grouped(params.w_q, params.num_kv_heads)
    return _per_query_head(jnp.einsum("kdc,kgec->kgde", params.w_k, wq, precision=HIGHEST))


def w_i_unchecked(params: AttentionParams) -> Array:
    wo = _grouped(params.w_o, params.num_kv_heads)
    return _per_query_head(jnp.einsum("kgve,kdv->kged", wo, params.w_v, precision=HIGHEST))


# ----------------------------------------------------------------------------- merged matrices


@float64_scoped
def w_p(params: AttentionParams) -> Float[Array, "H d_model d_model"]:
    """Pattern matrices ``W_P[i] = W_Q[i] W_K[i // G]^T`` (row convention), one per query head.

    Logits ``(x_q W_P[i]) x^T``; query heads of one group share ``W_K`` but not ``W_P``.

    Args:
        params: Per-head weights (:class:`AttentionParams`).

    Returns:
        ``W_P [H, d_model, d_model]`` (biases not included).

    Raises:
        ValueError: If ``params`` is malformed (ranks, shapes, ``H % K != 0``).
        TypeError: If a weight is missing, or the parameters are not floating or mix dtypes.
    """
    check_params(params)
    return w_p_unchecked(params)


@float64_scoped
def w_m(params: AttentionParams) -> Float[Array, "H d_model d_model"]:
    """Message matrices ``W_M[i] = W_V[i // G] W_O[i]`` (row convention), one per query head.

    Messages ``x W_M[i]``; query heads of one group share ``W_V`` but each has its own ``W_M``.

    Args:
        params: Per-head weights (:class:`AttentionParams`).

    Returns:
        ``W_M [H, d_model, d_model]`` (biases not included).

    Raises:
        ValueError: If ``params`` is malformed (ranks, shapes, ``H % K != 0``).
        TypeError: If a weight is missing, or the parameters are not floating or mix dtypes.
    """
    check_params(params)
    return w_m_unchecked(params)


@float64_scoped
def w_a(params: AttentionParams) -> Float[Array, "H d_model d_model"]:
    """Column-convention score matrices ``W_A[i] = W_K^T W_Q``, one per query head.

    The notation of "Attention: All you need to know" (far.in.net, 2025-03-29), which writes
    tokens as columns by its own choice. With column vectors, ``q = W_Q^c x`` where
    ``W_Q^c = W_Q[i]^T`` is ``d_k x d_model``, so
    ``W_A = (W_K^c)^T W_Q^c = W_K[i // G] W_Q[i]^T = W_P[i]^T`` and ``A_{j,i} = x_j^T W_A x_i``.
    Elhage et al. (2021) write the scores ``A = softmax(x^T W_Q^T W_K x)`` (query ``i`` in row
    ``i``): ``W_A`` is the transpose of their QK matrix ``W_Q^T W_K``.

    Args:
        params: Per-head weights (:class:`AttentionParams`, row convention).

    Returns:
        ``W_A [H, d_model, d_model]``, the transposes of :func:`w_p`.

    Raises:
        ValueError: If ``params`` is malformed (ranks, shapes, ``H % K != 0``).
        TypeError: If a weight is missing, or the parameters are not floating or mix dtypes.
    """
    check_params(params)
    return w_a_unchecked(params)


@float64_scoped
def w_i(params: AttentionParams) -> Float[Array, "H d_model d_model"]:
    """Column-convention output-value matrices ``W_I[i] = W_O^T W_V``, one per query head.

    The notation of "Attention: All you need to know" (far.in.net, 2025-03-29), which writes
    tokens as columns by its own choice. It stores ``W_V^c = W_V[i // G]^T`` (``d_v x d_model``)
    and ``W_O^c = W_O[i]`` (``d_v x d_model``), so ``W_I = (W_O^c)^T W_V^c
    = W_O[i]^T W_V[i // G]^T = W_M[i]^T``. Elhage et al. (2021) store the output weights as
    ``d_model x d_v`` and write the same matrix ``W_OV = W_O W_V`` (the OV circuit).

    Args:
        params: Per-head weights (:class:`AttentionParams`, row convention).

    Returns:
        ``W_I [H, d_model, d_model]``, the transposes of :func:`w_m`.

    Raises:
        ValueError: If ``params`` is malformed (ranks, shapes, ``H % K != 0``).
        TypeError: If a weight is missing, or the parameters are not floating or mix dtypes.
    """
    check_params(params)
    return w_i_unchecked(params)


# ----------------------------------------------------------------------------- fused layouts


def _np(x: Any) -> np.ndarray:
    return np.asarray(x)


def _require_mha(params: AttentionParams, layout: str) -> None:
    """Fused layouts store one K/V head per query head; refuse grouped/multi-query params."""
    check_params(params)
    if params.num_kv_heads != params.num_heads:
        raise ValueError(
            f"{layout} has no grouped-query layout: params have num_heads={params.num_heads} "
            f"but num_kv_heads={params.num_kv_heads} (params.w_k has shape "
            f"{tuple(np.shape(params.w_k))}); convert attnref.interop.repeat_kv_heads(params), the "
            "equivalent multi-head parameters, instead"
        )


def _require(d: Mapping[str, Any], key: str, layout: str) -> np.ndarray:
    if key not in d:
        raise KeyError(f"{layout} weights are missing {key!r}; got keys {sorted(d)}")
    return _np(d[key])


def to_flax(params: AttentionParams) -> dict[str, dict[str, np.ndarray]]:
    """Flax ``MultiHeadDotProductAttention`` params (``DenseGeneral`` kernels).

    ``query/key/value``: ``kernel [d_model, H, d_head]``, ``bias [H, d_head]``;
    ``out``: ``kernel [H, d_v, d_model]``, ``bias [d_model]``. Grouped-query params raise
    ``ValueError`` (use :func:`repeat_kv_heads` first).

    Args:
        params: Multi-head (``K == H``) :class:`AttentionParams`.

    Returns:
        ``{"query"|"key"|"value"|"out": {"kernel": ..., "bias": ...}}`` of NumPy arrays; a
        ``"bias"`` entry only where ``params`` has that bias.

    Raises:
        ValueError: If ``params`` is malformed or grouped-query (``K != H``).
        TypeError: If a weight is missing, or the parameters are not floating or mix dtypes.
    """
    _require_mha(params, "Flax MultiHeadDotProductAttention")
    out: dict[str, dict[str, np.ndarray]] = {}
    for name, w, b in (
        ("query", params.w_q, params.b_q),
        ("key", params.w_k, params.b_k),
        ("value", params.w_v, params.b_v),
    ):
        out[name] = {"kernel": np.transpose(_np(w), (1, 0, 2))}
        if b is not None:
            out[name]["bias"] = _np(b)
    out["out"] = {"kernel": _np(params.w_o)}
    if params.b_o is not None:
        out["out"]["bias"] = _np(params.b_o)
    return out


def from_flax(tree: Mapping[str, Mapping[str, Any]]) -> AttentionParams:
    """Inverse of :func:`to_flax` (accepts Flax's nested ``params`` dict for the module).

    Args:
        tree: ``{"query", "key", "value", "out"}`` each with a rank-3 ``"kernel"`` and an
            optional ``"bias"`` (a missing ``"bias"`` gives ``None``).

    Returns:
        :class:`AttentionParams` of NumPy arrays (multi-head, ``K == H``).

    Raises:
        KeyError: If a module or a ``"kernel"`` is missing.
        ValueError: If a kernel is not rank 3.
    """
    for key in ("query", "key", "value", "out"):
        if key not in tree:
            raise KeyError(f"Flax attention params are missing {key!r}; got keys {sorted(tree)}")

    def kernel(name: str) -> np.ndarray:
        k = _require(tree[name], "kernel", f"Flax {name}")
        if k.ndim != 3:
            raise ValueError(f"Flax {name}.kernel must have rank 3, got shape {k.shape}")
        return k

    def bias(name: str) -> np.ndarray | None:
        return _np(tree[name]["bias"]) if "bias" in tree[name] else None

    return AttentionParams(
        w_q=np.transpose(kernel("query"), (1, 0, 2)),
        w_k=np.transpose(kernel("key"), (1, 0, 2)),
        w_v=np.transpose(kernel("value"), (1, 0, 2)),
        w_o=kernel("out"),
        b_q=bias("query"),
        b_k=bias("key"),
        b_v=bias("value"),
        b_o=bias("out"),
    )


def _heads_to_out_in(w: np.ndarray) -> np.ndarray:
    """``[H, d_in, d_head] -> [H*d_head, d_in]`` (PyTorch's (out, in), head-major out rows)."""
    h, d_in, d_head = w.shape
    return np.transpose(w, (0, 2, 1)).reshape(h * d_head, d_in)


def _out_in_to_heads(w: np.ndarray, num_heads: int, name: str) -> np.ndarray:
    out, d_in = w.shape
    if out % num_heads:
        raise ValueError(f"{name} has {out} output rows, not divisible by num_heads={num_heads}")
    return np.transpose(w.reshape(num_heads, out // num_heads, d_in), (0, 2, 1))


def _all_or_no_bias(params: AttentionParams) -> list[np.ndarray] | None:
    if not params.has_bias:
        return None
    h, d_model, d_k, d_v = params.num_heads, params.d_model, params.d_k, params.d_v
    dt = params.dtype
    shapes = ((h, d_k), (h, d_k), (h, d_v), (d_model,))  # b_q, b_k, b_v, b_o
    # A layout that stores all biases or none gets explicit zeros for the absent ones: the
    # function is unchanged (a zero bias adds nothing), only the None-ness is lost.
    return [
        _np(getattr(params, n)) if getattr(params, n) is not None else np.zeros(s, dt)
        for n, s in zip(BIAS_FIELDS, shapes, strict=True)
    ]


def to_torch_mha(params: AttentionParams) -> dict[str, np.ndarray]:
    """PyTorch ``nn.MultiheadAttention`` state dict (``in_proj_weight [3E, E]``, (out, in)).

    PyTorch's packed layout needs ``d_k == d_v == d_model / H``; absent biases are written as
    zeros when any bias is present (PyTorch has all biases or none). Grouped-query params raise
    ``ValueError`` (use :func:`repeat_kv_heads` first).

    Args:
        params: Multi-head (``K == H``) :class:`AttentionParams` with
            ``d_k == d_v == d_model / H``.

    Returns:
        ``{"in_proj_weight": [3E, E], "out_proj.weight": [E, E]}`` (``E = d_model``, NumPy),
        plus ``"in_proj_bias" [3E]`` and ``"out_proj.bias" [E]`` when any bias is present.

    Raises:
        ValueError: If ``params`` is malformed or grouped-query (``K != H``), or
            ``d_k == d_v == d_model / H`` does not hold.
        TypeError: If a weight is missing, or the parameters are not floating or mix dtypes.
    """
    _require_mha(params, "PyTorch nn.MultiheadAttention")
    h, d_model, d_k, d_v = params.num_heads, params.d_model, params.d_k, params.d_v
    if not (d_k == d_v and h * d_k == d_model):
        raise ValueError(
            "nn.MultiheadAttention packs q, k, v with head_dim = embed_dim / num_heads; got "
            f"H={h}, d_model={d_model}, d_k={d_k}, d_v={d_v}"
        )
    sd = {
        "in_proj_weight": np.concatenate(
            [_heads_to_out_in(_np(w)) for w in (params.w_q, params.w_k, params.w_v)]
        ),
        "out_proj.weight": np.transpose(_np(params.w_o).reshape(h * d_v, d_model)),
    }
    biases = _all_or_no_bias(params)
    if biases is not None:
        b_q, b_k, b_v, b_o = biases
        sd["in_proj_bias"] = np.concatenate([b_q.reshape(-1), b_k.reshape(-1), b_v.reshape(-1)])
        sd["out_proj.bias"] = b_o
    return sd


def from_torch_mha(state_dict: Mapping[str, Any], num_heads: int) -> AttentionParams:
    """Inverse of :func:`to_torch_mha`; ``num_heads`` is not recorded in the state dict.

    Args:
        state_dict: ``in_proj_weight [3E, E]``, ``out_proj.weight [E, E]`` and optionally
            ``in_proj_bias [3E]`` with ``out_proj.bias [E]`` (arrays or tensors NumPy can read).
        num_heads: The number of heads ``H`` (must divide ``E``).

    Returns:
        Multi-head :class:`AttentionParams` of NumPy arrays, ``d_k = d_v = E / H``; biases
        only if ``in_proj_bias`` is present.

    Raises:
        KeyError: If a required entry is missing.
        ValueError: If ``in_proj_weight`` is not ``[3E, E]`` or ``E`` is not divisible by
            ``num_heads``.
    """
    w_in = _require(state_dict, "in_proj_weight", "nn.MultiheadAttention")
    w_out = _require(state_dict, "out_proj.weight", "nn.MultiheadAttention")
    if w_in.ndim != 2 or w_in.shape[0] != 3 * w_in.shape[1]:
        raise ValueError(f"in_proj_weight must have shape [3E, E], got {w_in.shape}")
    e = w_in.shape[1]
    wq, wk, wv = (
        _out_in_to_heads(w_in[i * e : (i + 1) * e], num_heads, "in_proj_weight") for i in range(3)
    )
    w_o = np.transpose(w_out).reshape(num_heads, e // num_heads, e)
    if "in_proj_bias" not in state_dict:
        return AttentionParams(wq, wk, wv, w_o)
    b_in = _np(state_dict["in_proj_bias"])
    b_q, b_k, b_v = (b_in[i * e : (i + 1) * e].reshape(num_heads, -1) for i in range(3))
    b_o = _require(state_dict, "out_proj.bias", "nn.MultiheadAttention")
    return AttentionParams(wq, wk, wv, w_o, b_q, b_k, b_v, b_o)


_HF_KEYS = {
    "w_q": "self.query.weight",
    "w_k": "self.key.weight",
    "w_v": "self.value.weight",
    "w_o": "output.dense.weight",
    "b_q": "self.query.bias",
    "b_k": "self.key.bias",
    "b_v": "self.value.bias",
    "b_o": "output.dense.bias",
}


def to_hf_bert(params: AttentionParams, prefix: str = "") -> dict[str, np.ndarray]:
    """Hugging Face BERT attention weights: ``{prefix}self.query.weight [H*d_k, d_model]`` etc.

    ``nn.Linear`` stores ``(out, in)``; heads are contiguous blocks of the out features (BERT's
    ``view(..., H, d_head)``). ``output.dense.weight`` is ``[d_model, H*d_v]``. Absent biases are
    written as zeros when any bias is present. Grouped-query params raise ``ValueError`` (use
    :func:`repeat_kv_heads` first).

    Args:
        params: Multi-head (``K == H``) :class:`AttentionParams`.
        prefix: Prepended to every key (e.g. ``"encoder.layer.0.attention."``); default ``""``.

    Returns:
        ``{prefix + "self.query.weight": [H d_k, d_model], ...}`` (NumPy): the query, key,
        value and ``output.dense`` weights, and their biases when any bias is present.

    Raises:
        ValueError: If ``params`` is malformed or grouped-query (``K != H``).
        TypeError: If a weight is missing, or the parameters are not floating or mix dtypes.
    """
    _require_mha(params, "Hugging Face BERT attention")
    h, d_model, d_v = params.num_heads, params.d_model, params.d_v
    sd = {
        prefix + _HF_KEYS["w_q"]: _heads_to_out_in(_np(params.w_q)),
        prefix + _HF_KEYS["w_k"]: _heads_to_out_in(_np(params.w_k)),
        prefix + _HF_KEYS["w_v"]: _heads_to_out_in(_np(params.w_v)),
        prefix + _HF_KEYS["w_o"]: np.transpose(_np(params.w_o).reshape(h * d_v, d_model)),
    }
    biases = _all_or_no_bias(params)
    if biases is not None:
        for name, b in zip(BIAS_FIELDS, biases, strict=True):
            sd[prefix + _HF_KEYS[name]] = b.reshape(-1)
    return sd


def from_hf_bert(
    state_dict: Mapping[str, Any], num_heads: int, prefix: str = ""
) -> AttentionParams:
    """Inverse of :func:`to_hf_bert` (e.g. ``prefix="encoder.layer.0.attention."``).

    Args:
        state_dict: Hugging Face BERT weights (``{prefix}self.query.weight [H d_k, d_model]``,
            ..., ``{prefix}output.dense.weight [d_model, H d_v]``), arrays or tensors NumPy can
            read; the biases are read when ``{prefix}self.query.bias`` is present.
        num_heads: The number of heads ``H`` (not recorded in the weights).
        prefix: The key prefix; default ``""``.

    Returns:
        Multi-head :class:`AttentionParams` of NumPy arrays.

    Raises:
        KeyError: If a required weight (or, with biases, a bias) is missing.
        ValueError: If a projection's output rows are not divisible by ``num_heads``.
    """

    def get(name: str) -> np.ndarray:
        return _require(state_dict, prefix + _HF_KEYS[name], "Hugging Face BERT")

    w_q = _out_in_to_heads(get("w_q"), num_heads, prefix + _HF_KEYS["w_q"])
    w_k = _out_in_to_heads(get("w_k"), num_heads, prefix + _HF_KEYS["w_k"])
    w_v = _out_in_to_heads(get("w_v"), num_heads, prefix + _HF_KEYS["w_v"])
    dense = get("w_o")
    w_o = np.transpose(dense).reshape(num_heads, dense.shape[1] // num_heads, dense.shape[0])
    if prefix + _HF_KEYS["b_q"] not in state_dict:
        return AttentionParams(w_q, w_k, w_v, w_o)
    return AttentionParams(
        w_q,
        w_k,
        w_v,
        w_o,
        b_q=get("b_q").reshape(num_heads, -1),
        b_k=get("b_k").reshape(num_heads, -1),
        b_v=get("b_v").reshape(num_heads, -1),
        b_o=get("b_o"),
    )
