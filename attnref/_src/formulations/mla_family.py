"""Multi-head latent attention's parameters, its two levels (:data:`MLA_ROWS`: tokens;
:data:`MLA_CACHE`: the latent cache) and its cost model :func:`mla_cost`; the formulas are in
:mod:`attnref._src.formulations.mla`."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Literal, no_type_check

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import ArrayLike, Bool, Float, Int

from attnref._src.core.checks import (
    HIGHEST,
    device_array,
    float64_scoped,
)
from attnref._src.core.common import Prepared, prepare_rows, rows_level
from attnref._src.core.entry import Level
from attnref._src.core.params import AttentionParams
from attnref._src.formulations.rope_family import RopeInputs, rotated
from attnref.oracle._mla import MLADims, check_mla_params, check_mla_tokens

# ----------------------------------------------------------------------------- parameters


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
@no_type_check
class MLAParams:
    """Multi-head latent attention weights (a JAX pytree; row convention: DeepSeek-V2's
    ``W^{DKV} h_t`` is ``x W_DKV``); per-head up-projections are stored ``[H, ...]``.

    Attributes:
        w_dkv: Down-projection to the latent ``c^KV = x W_DKV``: ``[d_model, d_c]``.
        w_uk: Key up-projections, ``k^C_i = c^KV W_UK[i]``: ``[H, d_c, d_nope]``.
        w_uv: Value up-projections, ``v^C_i = c^KV W_UV[i]``: ``[H, d_c, d_v]``.
        w_uq: Query projections, ``q^C_i = c^Q W_UQ[i]``: ``[H, d_q, d_nope]`` with ``d_q =
            d_cq`` when ``w_dq`` is given (``c^Q = x W_DQ``), else ``d_model`` (``c^Q = x``).
        w_o: Output weights ``[H, d_v, d_model]``.
        w_kr: The shared RoPE key projection, ``k^R = RoPE(x W_KR)``: ``[d_model, d_rope]``, or
            ``None`` (no decoupled RoPE part; then ``w_qr`` is ``None`` too).
        w_qr: The per-head RoPE query projections, ``q^R_i = RoPE(c^Q W_QR[i])``:
            ``[H, d_q, d_rope]`` or ``None``.
        w_dq: The optional query down-projection ``[d_model, d_cq]`` (``None``: no query
            compression).
    """

    w_dkv: Float[ArrayLike, "d_model d_c"]
    w_uk: Float[ArrayLike, "H d_c d_nope"]
    w_uv: Float[ArrayLike, "H d_c d_v"]
    w_uq: Float[ArrayLike, "H d_q d_nope"]
    w_o: Float[ArrayLike, "H d_v d_model"]
    w_kr: Float[ArrayLike, "d_model d_rope"] | None = None
    w_qr: Float[ArrayLike, "H d_q d_rope"] | None = None
    w_dq: Float[ArrayLike, "d_model d_cq"] | None = None

    @property
    def dims(self) -> MLADims:
        """The checked sizes (``heads, d_model, d_c, d_nope, d_rope, d_v, d_cq``)."""
        return check_mla_params(self)


def init_mla_params(
    seed: int,
    *,
    d_model: int,
    num_heads: int,
    d_c: int,
    d_nope: int,
    d_rope: int = 0,
    d_v: int | None = None,
    d_cq: int | None = None,
    dtype: Any = np.float32,
) -> MLAParams:
    """Seeded random :class:`MLAParams` (NumPy PCG64, fan-in scaling ``N(0, 1/fan_in)``) of
    ``dtype``; ``d_rope = 0`` leaves out the RoPE part, ``d_cq=None`` the query compression;
    ``d_v`` defaults to ``d_nope``. ``ValueError`` for a size that is not a positive integer
    (``d_rope`` may be 0, and must be even)."""
    d_v = d_nope if d_v is None else d_v
    sizes = dict(d_model=d_model, num_heads=num_heads, d_c=d_c, d_nope=d_nope, d_v=d_v)
    for name, val in {**sizes, "d_cq": 1 if d_cq is None else d_cq}.items():
        if int(val) != val or val < 1:
            raise ValueError(f"{name} must be a positive integer, got {val}")
    if int(d_rope) != d_rope or d_rope < 0 or d_rope % 2:
        raise ValueError(f"d_rope must be 0 or a positive even integer, got {d_rope}")
    rng = np.random.default_rng(seed)
    h = num_heads
    d_q = d_model if d_cq is None else d_cq

    def normal(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) / math.sqrt(shape[-2])).astype(dtype)

    return MLAParams(
        w_dkv=normal(d_model, d_c),
        w_uk=normal(h, d_c, d_nope),
        w_uv=normal(h, d_c, d_v),
        w_uq=normal(h, d_q, d_nope),
        w_o=(rng.standard_normal((h, d_v, d_model)) / math.sqrt(h * d_v)).astype(dtype),
        w_kr=normal(d_model, d_rope) if d_rope else None,
        w_qr=normal(h, d_q, d_rope) if d_rope else None,
        w_dq=None if d_cq is None else normal(d_model, d_cq),
    )


@float64_scoped
def to_attention_params(params: MLAParams) -> AttentionParams:
    """The decompressed per-head :class:`attnref.AttentionParams` of MLA without its RoPE part,
    exactly the same attention (``d_k = d_nope``, so the default scales agree): ``W_Q[i] = W_DQ
    W_UQ[i]`` (``W_UQ[i]`` without query compression), ``W_K[i] = W_DKV W_UK[i]``, ``W_V[i] =
    W_DKV W_UV[i]``, ``W_O[i] = W_O[i]``; :mod:`attnref.interp`'s ``W_P``, ``W_M`` then apply.

    Raises:
        ValueError: If ``params`` is malformed or has a RoPE part (``w_kr``/``w_qr``): the
            rotation sits between ``W_QR`` and ``W_KR`` and depends on the positions, so no
            position-free ``W_K`` exists.
    """
    dims = check_mla_params(params)
    if dims.d_rope:
        raise ValueError(
            f"params has a decoupled RoPE part (d_rope = {dims.d_rope}); only MLA "
            "without it converts exactly to AttentionParams"
        )
    w_q = jnp.asarray(params.w_uq)
    if params.w_dq is not None:
        w_q = jnp.einsum("dc,hcn->hdn", params.w_dq, w_q, precision=HIGHEST)
    w_k = jnp.einsum("dc,hcn->hdn", params.w_dkv, params.w_uk, precision=HIGHEST)
    w_v = jnp.einsum("dc,hcv->hdv", params.w_dkv, params.w_uv, precision=HIGHEST)
    return AttentionParams(w_q, w_k, w_v, jnp.asarray(params.w_o))


# ----------------------------------------------------------------------------- the levels


def _mla_rows(
    params: MLAParams,
    x_q: Any,
    x_kv: Any,
    mask: Any,
    bias: Any,
    scale: Any,
    residual: Any,
    kv_name: str = "x_kv",
    kv_width: int = 0,
) -> Prepared:
    """Validate an MLA call's weights, tokens (or ``kv_width``-wide cache), mask, bias and scale
    (default ``1/sqrt(d_nope + d_rope)``) into :class:`Prepared` rows."""
    dims = check_mla_params(params)
    dtype = np.dtype(device_array(params.w_dkv).dtype)
    tokens = functools.partial(check_mla_tokens, dims, dtype, kv_name=kv_name, kv_width=kv_width)
    d_k = dims.d_nope + dims.d_rope
    return prepare_rows(
        params, x_q, x_kv, mask, bias, scale, bool(residual), tokens=tokens, d_k=d_k
    )


def prepare_mla_cache(
    params: MLAParams,
    x_q: Float[ArrayLike, "... T_q d_model"],
    cache: Float[ArrayLike, "... T_k d_c_plus_d_rope"],
    *,
    mask: Bool[ArrayLike, "... #T_q #T_k"] | None = None,
    bias: Float[ArrayLike, "... #T_q #T_k"] | None = None,
    scale: float | None = None,
    residual: bool = False,
    positions_q: Int[ArrayLike, "... T_q"] | None = None,
    base: float = 10000.0,
    convention: str = "interleaved",
) -> RopeInputs:
    """Validate an MLA call on the latent cache ``[..., T_k, d_c + d_rope]``."""
    d = check_mla_params(params)
    rows = _mla_rows(params, x_q, cache, mask, bias, scale, residual, "cache", d.d_c + d.d_rope)
    return rotated(rows, positions_q, None, base, convention)


_HEAD_ARGS = """Args:
    params: :class:`attnref.mla.MLAParams`.
    x_q: Query tokens, row vectors ``[..., T_q, d_model]``, the dtype of ``params``."""
_COMMON_ARGS = """
    mask: Boolean, broadcastable to ``[..., T_q, T_k]``, ``True`` = may attend; ``None``
        (default) allows every pair.
    bias: Floating additive bias, broadcastable to ``[..., T_q, T_k]``, added to the scaled
        logits (``-inf`` masks like ``False``); cast to the dtype of ``x_q``.
    scale: The logit scale; ``None`` (default) means ``1/sqrt(d_nope + d_rope)`` (DeepSeek-V2's
        ``1/sqrt(d_h + d_h^R)``).
    residual: If ``True``, return ``x_q + MLA`` (the residual-stream update).
    positions_q: Integer query positions ``[..., T_q]`` or ``[T_q]``; default ``arange(T_q)``."""
_ROPE_ARGS = """
    base: The RoPE frequency base (default 10000), a static positive finite number.
    convention: The RoPE pairs: ``"interleaved"`` (default; DeepSeek's ``apply_rotary_emb``
        multiplies consecutive pairs as complex numbers) or ``"rotate_half"``; static.

Raises:
    ValueError: If ``params`` is malformed (the message names the field and both shapes), the
        tokens or the cache have the wrong width or different batch shapes, ``mask``/``bias``/
        positions do not broadcast, ``scale`` is not a scalar, ``base`` is not positive and
        finite, or ``convention`` is unknown.
    TypeError: If the tokens and the weights mix dtypes, ``mask`` is not boolean, ``bias`` is
        not floating, positions are not integers, or ``scale`` is not a real number."""
_MLA_ARGS = f"""{_HEAD_ARGS}
    x_kv: Key/value tokens ``[..., T_k, d_model]`` with the batch shape of ``x_q``; ``None``
        (default) means ``x_q`` (self-attention).{_COMMON_ARGS}
    positions_kv: Integer key positions ``[..., T_k]`` or ``[T_k]``; default ``arange(T_k)``.\
{_ROPE_ARGS}"""
_CACHE_ARGS = f"""{_HEAD_ARGS}
    cache: The latent cache ``[..., T_k, d_c + d_rope]`` (``[c^KV, RoPE(x W_KR)]`` per token,
        :func:`attnref.mla.mla_latent_cache`) with the batch shape of ``x_q``.\
{_COMMON_ARGS}{_ROPE_ARGS}"""

# Formulas take ``(params, x_q, x_kv_or_cache, mask, bias, scale, residual, rot)``, validated and
# finite (``mask``/``bias`` ``[..., T_q, T_k]``).
MLA_ROWS = rows_level(
    "prepare_mla",
    lambda rows, scale, **rope: rotated(rows, **rope),
    _MLA_ARGS,
    {
        "positions_q": (None, 'Int[ArrayLike, "... T_q"] | None'),
        "positions_kv": (None, 'Int[ArrayLike, "... T_k"] | None'),
        "base": (10000.0, "float"),
        "convention": ("interleaved", "str"),
    },
    validate=_mla_rows,
    params_type="MLAParams",
)
MLA_CACHE = Level(prepare_mla_cache, _CACHE_ARGS)

# ----------------------------------------------------------------------------- cost model

Form = Literal["naive", "absorbed"]


@dataclasses.dataclass(frozen=True)
class MLACost:
    """The analytic cost of one MLA call (XLA's counting conventions, ``attnref.costs``).

    Attributes:
        matmul_flops: ``2 M N K`` per contraction, over every einsum of the form.
        cache_elements_per_token: What the form keeps per cached token: ``d_c + d_rope`` (the
            absorbed form's latent) or ``H (d_nope + d_rope + d_v)`` (the decompressed keys and
            values; ``2 H d_h`` when ``d_nope + d_rope = d_v = d_h``).
        cache_bytes_per_token: ``cache_elements_per_token * itemsize``.
    """

    matmul_flops: int
    cache_elements_per_token: int
    cache_bytes_per_token: int


def mla_cost(
    dims: MLADims,
    *,
    batch: int,
    t_q: int,
    t_k: int,
    form: Form,
    from_cache: bool = False,
    itemsize: int = 4,
) -> MLACost:
    """The matmul FLOPs and cache size of one MLA call, in attnref's order of operations.

    Shared by both forms: the queries (``2 B T_q d_model d_cq + 2 B T_q H d_q (d_nope + d_rope)``
    with ``d_q = d_cq`` or ``d_model``) and the output ``2 B T_q H d_v d_model``; from tokens
    (not ``from_cache``) also the cache ``2 B T_k d_model (d_c + d_rope)``. Then:

    * naive: decompress every cached token, ``2 B T_k H d_c (d_nope + d_v)``; logits
      ``2 B H T_q T_k (d_nope + d_rope)``; mix ``2 B H T_q T_k d_v``;
    * absorbed: absorb ``W_UK`` into the queries ``2 B T_q H d_nope d_c``; logits against the
      cache ``2 B H T_q T_k (d_c + d_rope)``; mix the latent ``2 B H T_q T_k d_c``; ``W_UV`` after
      the mix ``2 B T_q H d_c d_v``.

    ``naive - absorbed = 2 B H [d_c (d_nope + d_v) (T_k - T_q) + T_q T_k (d_nope + d_v - 2
    d_c)]``: see :func:`mla_crossover`."""
    h, dm, dc, dn, dr, dv, dcq = dims
    dq = dcq or dm
    b = batch
    mm = 2 * b * t_q * h * dq * (dn + dr) + 2 * b * t_q * h * dv * dm
    if dcq:
        mm += 2 * b * t_q * dm * dcq
    if not from_cache:
        mm += 2 * b * t_k * dm * (dc + dr)
    if form == "naive":
        mm += 2 * b * t_k * h * dc * (dn + dv) + 2 * b * h * t_q * t_k * (dn + dr + dv)
        per_token = h * (dn + dr + dv)
    else:
        mm += 2 * b * t_q * h * dc * (dn + dv) + 2 * b * h * t_q * t_k * (2 * dc + dr)
        per_token = dc + dr
    return MLACost(mm, per_token, per_token * itemsize)


def mla_crossover(dims: MLADims, t_k: int) -> float:
    """The number of queries per call ``T_q*`` below which the absorbed form needs fewer matmul
    FLOPs than the naive one against ``T_k`` cached tokens (both from the cache): the root of
    ``d_c a (T_k - T_q) = T_q T_k (2 d_c - a)``, ``a = d_nope + d_v``, i.e.
    ``T_q* = d_c a T_k / (d_c a + T_k (2 d_c - a))`` (``inf`` when ``2 d_c <= a``: absorbed is
    never dearer). For long caches ``T_q* -> d_c a / (2 d_c - a)``: decoding (``T_q = 1``) and
    short chunks favour the absorbed form, prefill the naive one."""
    a = dims.d_nope + dims.d_v
    if 2 * dims.d_c <= a:
        return math.inf
    return dims.d_c * a * t_k / (dims.d_c * a + t_k * (2 * dims.d_c - a))


# ModelArgs' defaults in DeepSeek-V3's inference/model.py: dim 2048, n_heads 16, kv_lora_rank
# 512, qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim 128, q_lora_rank 0.
DEEPSEEK_DEFAULTS = MLADims(heads=16, d_model=2048, d_c=512, d_nope=128, d_rope=64, d_v=128, d_cq=0)


def mla_cost_table(
    dims: MLADims = DEEPSEEK_DEFAULTS,
    t_ks: tuple[int, ...] = (1024, 4096, 32768),
    itemsize: int = 2,
) -> str:
    """A Markdown table of :func:`mla_cost` for both forms (batch 1): per cache length ``T_k``,
    the crossover :func:`mla_crossover`, the matmul GFLOPs of decoding one token against the
    cache and of prefilling ``T_k`` tokens from tokens, and the cache bytes per token
    (``itemsize`` 2: bfloat16)."""
    head = (
        "| T_k | T_q* | decode naive | decode absorbed | prefill naive | prefill absorbed |"
        " cache B/token naive | cache B/token absorbed |"
    )
    lines = [head, "|" + "---|" * 8]
    for t_k in t_ks:
        # decoding one token against the cache, then prefilling T_k tokens from tokens
        costs = [
            mla_cost(dims, batch=1, t_q=t_q, t_k=t_k, form=f, from_cache=cached, itemsize=itemsize)
            for t_q, cached in ((1, True), (t_k, False))
            for f in ("naive", "absorbed")
        ]
        gf = [f"{c.matmul_flops / 1e9:.4g}" for c in costs]
        lines.append(
            f"| {t_k} | {mla_crossover(dims, t_k):.1f} | {' | '.join(gf)} | "
            f"{costs[0].cache_bytes_per_token} | {costs[1].cache_bytes_per_token} |"
        )
    return "\n".join(lines)
