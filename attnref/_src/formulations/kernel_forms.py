"""Multi-head (weight-level, row-convention) forms of the blockwise and cached-decoding kernels:
project per head (``q = x W_Q + b_Q``; K/V heads shared by groups of query heads), run the kernel
in the ``jax.nn.dot_product_attention`` layout, return ``sum_n o_n W_O[n] + b_O``.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float

from attnref._src.core import cost as _cost
from attnref._src.core.checks import float64_scoped
from attnref._src.core.common import (
    RESIDUAL_ARG,
    Call,
    Prepared,
    prepare_rows,
    residual_or,
    row_args,
    rows_level,
)
from attnref._src.core.entry import compiled
from attnref._src.core.params import AttentionParams
from attnref._src.core.registry import Formulation, register
from attnref._src.formulations.blockwise import blockwise_dot_product_attention
from attnref._src.formulations.decode import cache_attend, kv_cache_append, scan
from attnref._src.formulations.decode_cache import init_cache
from attnref._src.formulations.kernel import (
    flat_rows,
    kernel_call,
    kernel_heads,
    kernel_pairs,
    kernel_rows,
    output_rows,
    rows_public,
)
from attnref._src.formulations.standard import Bias, Keys, Mask, Params, Queries


def kv_cache(
    params: Params,
    x_q: Queries,
    x_kv: Keys,
    mask: Mask,
    bias: Bias,
    scale: float | None,
    residual: bool,
) -> Float[Array, "... T_q d_model"]:
    """Prefill a cache with ``x_kv``'s keys and values, then read it one query at a time:
    ``o_t = softmax_j(scale q_t . k_j + bias_{t, p_j}, mask) v_j``, ``sum_n o_n W_O[n] + b_O``."""
    xq, xkv, b = flat_rows(x_q, x_kv)
    k = kernel_heads(xkv, params.w_k, params.b_k).astype(xkv.dtype)  #  [B, T_k, K, d_k]
    v = kernel_heads(xkv, params.w_v, params.b_v).astype(xkv.dtype)  #  [B, T_k, K, d_v]
    cache = kv_cache_append(init_cache(params, b, xkv.shape[1]), k, v)
    steps = {"q": jnp.swapaxes(kernel_heads(xq, params.w_q, params.b_q), 0, 1)}  # [T_q, B, ...]
    pairs = {"mask": kernel_pairs(mask, x_q, x_kv), "bias": kernel_pairs(bias, x_q, x_kv)}
    steps |= {name: jnp.swapaxes(a[:, 0], 0, 1) for name, a in pairs.items() if a is not None}

    def step(_: None, row: dict[str, Any]) -> tuple[None, Array]:  # cache_attend's arguments
        out = cache_attend(cache, scale=scale, **{name: a[:, None] for name, a in row.items()})
        return None, out[:, 0]

    _, o = jax.lax.scan(step, None, steps)  # o_t                      [T_q, B, H, d_v]
    return output_rows(params, jnp.swapaxes(o, 0, 1), x_q, residual)


# ----------------------------------------------------------------------------- the kernel rows
# The row level, but the formula gets the caller's ``scale`` as given: the kernel resolves
# ``None`` in its compute dtype (float32 for 16-bit inputs). blockwise_attention is
# kernel.kernel_rows with the blockwise kernel.


def _kernel_call(rows: Prepared, scale: float | None) -> Call:
    args = (rows.params, rows.x_q, rows.x_kv, rows.mask, rows.bias, scale, rows.residual)
    return Call(args, rows)


KERNEL_ROWS = rows_level("_kernel_rows", _kernel_call, row_args(), {})
BLOCKWISE_ROWS = rows_level(
    "_blockwise_rows",
    kernel_call(blockwise_dot_product_attention),
    row_args(
        RESIDUAL_ARG
        + """
    block_q: Queries per tile, a positive int (default 3).
    block_k: Keys per tile, a positive int (default 2).""",
        also=",\n        or a block size is not a positive int",
    ),
    {"block_q": (3, "int"), "block_k": (2, "int")},
)

# Non-finite tokens a query may not read stay out of it and of every gradient (the projections'
# backward would otherwise multiply them by zero): both run through entry.guard.
blockwise_attention = rows_public(
    BLOCKWISE_ROWS,
    kernel_rows,
    __name__,
    name="blockwise_attention",
    summary="Multi-head attention through :func:`attnref.blockwise_dot_product_attention`.\n\n"
    "Online softmax in ``block_q x block_k`` tiles; the small odd defaults exercise partial "
    "tiles.",
)
kv_cache_attention = rows_public(
    KERNEL_ROWS,
    kv_cache,
    __name__,
    name="kv_cache_attention",
    summary="Multi-head attention read from a KV cache: ``x_kv``'s keys and values are projected "
    "and\nappended (the prefill), then a ``lax.scan`` runs the queries one at a time against the "
    "cache\nwith row ``t`` of ``mask`` and ``bias`` (by absolute key position).\n\n"
    "With a causal mask this is what incremental decoding computes (:func:`scan`\n"
    "appends one token per step instead; both are tested against the oracle).",
)


@float64_scoped
def decode_attention(
    params: AttentionParams,
    x_q: Float[ArrayLike, "... T d_model"],
    x_kv: Float[ArrayLike, "... T d_model"] | None = None,
    *,
    mask: Bool[ArrayLike, "... T T"] | None = None,
    bias: Float[ArrayLike, "... T T"] | None = None,
    scale: float | None = None,
    residual: bool = False,
    window: int | None = None,
) -> Float[Array, "... T d_model"]:
    p = prepare_rows(params, x_q, x_kv, mask, bias, scale)
    if p.t_q != p.t_k:
        raise ValueError(
            f"decoding pairs query t with key t: x_q has T_q={p.t_q} tokens but x_kv has "
            f"T_k={p.t_k}"
        )
    # one program: the cache holds every token (or is a ring of W), so no value check of
    # scan's can fail at run time
    return compiled(_decode_rows, params, p, scale, residual, window)  # type: ignore[no-any-return]


def _decode_rows(
    params: AttentionParams, p: Prepared, scale: Any, residual: bool, window: int | None
) -> Array:
    xq, xkv, b = flat_rows(p.x_q, p.x_kv)
    m, bi = (kernel_pairs(a, p.x_q, p.x_kv) for a in (p.mask, p.bias))  # [B, 1, T_q, T_k]
    m, bi = (None if a is None else a[:, 0] for a in (m, bi))
    cache = init_cache(params, b, p.t_k if window is None else window, window=window)
    y, _ = scan(params, cache, xq, xs_kv=xkv, mask=m, bias=bi, scale=scale)
    y = y.reshape(*p.batch_shape, p.t_q, -1)
    return residual_or(y, p.x_q, residual)


_WINDOW_ARG = """
    window: ``None`` (default: full causal attention) or a positive int ``W`` (sliding
        window of the ``W`` most recent tokens, the current one included)."""
decode_attention.__doc__ = (
    "Causal attention computed by KV-cached decoding, one token per ``lax.scan`` step.\n\n"
    "Token ``t`` brings query ``x_q[t]`` and key/value ``x_kv[t]`` (default ``x_q``); it attends "
    "to\nthe cached tokens ``j <= t`` with ``mask[t, j]`` and ``bias[t, j]`` (the mask is "
    "combined with\nthe causal rule). Always causal; needs ``T_q == T_k``. With ``window = W`` "
    "the cache is a ring\nbuffer of capacity ``W`` that wraps once ``T > W``, and token ``t`` "
    "attends to ``t - W < j <= t``\n(sliding-window attention).\n\n"
    + row_args(
        RESIDUAL_ARG + _WINDOW_ARG, ",\n        ``T_q != T_k``, or ``window`` is not a positive int"
    )
    + "\n\nReturns:\n    The block output ``[..., T, d_model]``, the dtype of ``x_q``.\n"
)


# ----------------------------------------------------------------------------- registry entries

MILAKOV = (
    "Milakov & Gimelshein (2018), Online normalizer calculation for softmax, arXiv:1805.02867."
)
DAO = (
    "Dao et al. (2022), FlashAttention: Fast and Memory-Efficient Exact Attention with "
    "IO-Awareness, NeurIPS."
)
GQA = (
    "Ainslie et al. (2023), GQA: Training Generalized Multi-Query Transformer Models from "
    "Multi-Head Checkpoints, EMNLP; Shazeer (2019), Fast Transformer Decoding: One Write-Head is "
    "All You Need (MQA)."
)

BLOCK_Q, BLOCK_K = 3, 2  # the registry entry's tile sizes (blockwise_attention's defaults)
# Per logit of a tile, from attnref._src.formulations.blockwise: two index tests and their "and",
# the mask "and", bias != -inf and its "and", the column and row "any", scale, + bias, where
# before the max, the max, s - shift, two wheres around exp, the row sum.
BLOCK_PER_LOGIT = 17
# Per query row of a tile: maximum, == -inf, where, m - shift, alpha * l, + sum, and the
# accumulator's alpha * acc + pv (2 per value entry, counted separately).
BLOCK_PER_ROW = 6


def kernel_rows_cost(
    d: _cost.Dims, mm: int, el: int, tr: int, tensors: list[int], largest: int, **loop: int
) -> _cost.Cost:
    """A kernel's ``mm``, ``el``, ``tr`` plus its row form's: the projections, the output
    projection and its head sum, the weight-level guard and the bias adds (:func:`_cost.build`;
    ``loop``: a looping kernel's trips and per-trip counts)."""
    b, h, dm = d.batch, d.heads, d.d_model
    pq, pk, pv = _cost.projections(d)
    mm += pq + pk + pv + 2 * b * d.t_q * h * d.d_v * dm
    el += b * d.t_q * dm * (h - 1) + _cost.weight_guard_elementwise(d) + _cost.qkvo_bias_adds(d)
    return _cost.build(d, mm, el, tr, tensors, largest, **loop)


def blockwise_cost(d: _cost.Dims) -> _cost.Cost:
    """Online softmax over ``n_q x n_k`` tiles (padded to whole tiles); XLA counts one tile.

    The entry is measured with a full mask and a bias (what this model counts), so every tile
    is an edge tile: one loop, each tile with the mask arithmetic. Without them the kernel's
    schedule (:func:`attnref.costs.tile_schedule`) runs its full tiles in a second loop without
    the mask; :func:`attnref.costs.blockwise_dot_flops` counts the kernel's tiles for any options.
    """
    b, h, dm = d.batch, d.heads, d.d_model
    bq, bk = min(BLOCK_Q, d.t_q), min(BLOCK_K, d.t_k)
    nq, nk = math.ceil(d.t_q / bq), math.ceil(d.t_k / bk)
    tile_logits = b * h * bq * bk
    step_mm = 2 * tile_logits * (d.d_k + d.d_v)
    step_el = (
        BLOCK_PER_LOGIT * tile_logits
        + (BLOCK_PER_ROW + 2 * d.d_v) * b * h * bq
        + _cost.guard_elementwise(
            d,
            operands=b * bq * h * d.d_k + b * bk * h * (d.d_k + d.d_v),
            logits=tile_logits,
            rows=b * h * bq,
            outputs=0,
        )
    )
    step_tr = tile_logits + b * h * bq  # exp of the tile, exp(m - m')
    rows = b * h * nq * bq
    kernel_operands = b * d.t_q * h * d.d_k + b * d.t_k * h * (d.d_k + d.d_v)
    el = (
        step_el * nq * nk
        + rows * (2 * d.d_v + 4)  # l > 0, where, a / l; poisoning the dirty rows
        + _cost.GUARD_PER_OPERAND * kernel_operands  # the kernel's finite parts and dirty tests
    )
    tp, sp = nq * bq, nk * bk
    tensors = [
        b * d.t_q * h * d.d_k,  # projections
        b * d.t_k * h * d.d_k,
        b * d.t_k * h * d.d_v,
        b * tp * h * d.d_k,  # padded to whole tiles
        b * sp * h * d.d_k,
        b * sp * h * d.d_v,
        b * tp * d.t_k,  # padded mask and bias (one head)
        b * tp * sp,
        b * tp * sp,
        3 * rows + rows * d.d_v,  # m, l, acc stacked over query tiles
        b * d.t_q * h * d.d_v,
        b * d.t_q * dm,
        8 * tile_logits,  # one tile's logits, allowed, probabilities and their temporaries
    ]
    return kernel_rows_cost(
        d,
        nq * nk * step_mm,
        el,
        nq * nk * step_tr,
        tensors,
        max(b * sp * h * max(d.d_k, d.d_v), b * d.t_q * dm),
        loop_trips=nq * nk,
        per_trip_matmul_flops=step_mm,
        per_trip_elementwise_flops=step_el,
        per_trip_transcendentals=step_tr,
    )


def kv_cache_cost(d: _cost.Dims) -> _cost.Cost:
    """Keys and values projected into a cache once, then ``T_q`` steps of one query each."""
    b, h, dm, tk = d.batch, d.heads, d.d_model, d.t_k
    row = b * h * tk  # one step's logits
    step_mm = 2 * row * (d.d_k + d.d_v)
    # the naive kernel's masked softmax on one row of logits, plus building the allowed set from
    # slot positions, the mask row and the bias row (gathers, compares, where)
    step_el = (_cost.SOFTMAX_PER_LOGIT + 6) * row + _cost.SOFTMAX_PER_ROW * b * h + b * h * d.d_k
    step_el += _cost.guard_elementwise(
        d,
        operands=b * h * d.d_k + b * tk * h * (d.d_k + d.d_v),
        logits=row,
        rows=b * h,
        outputs=b * h * (d.d_v + 1),
    )
    cache = [b * tk * h * d.d_k, b * tk * h * d.d_v, b * tk]  # keys, values, positions
    tensors = [
        b * d.t_q * h * d.d_k,
        *cache,
        *cache,  # the scatter's output and its operand
        b * d.t_q * tk,  # mask and bias rows, time-major
        b * d.t_q * tk,
        10 * row,  # one step's logits and softmax temporaries
        b * d.t_q * h * d.d_v,
        b * d.t_q * h * d.d_v,
        b * d.t_q * dm,
    ]
    return kernel_rows_cost(
        d,
        d.t_q * step_mm,
        d.t_q * step_el,
        d.t_q * row,
        tensors,
        max(b * tk * h * max(d.d_k, d.d_v), b * d.t_q * dm),
        loop_trips=d.t_q,
        per_trip_matmul_flops=step_mm,
        per_trip_elementwise_flops=step_el,
        per_trip_transcendentals=row,
    )


register(
    Formulation(
        id="blockwise",
        title="Blockwise online softmax (the flash form)",
        equation=(
            r"s_{ij,n} = \frac{q_{i,n} k_{j,g(n)}^\top}{\sqrt{d_k}} + b_{ij},\quad"
            r" m' = \max(m, \max_{j \in B} s_{ij,n}),\ \ \ell' = e^{m - m'}\ell"
            r" + \sum_{j \in B} e^{s_{ij,n} - m'},\ \ a' = e^{m - m'} a + \sum_{j \in B}"
            r" e^{s_{ij,n} - m'} v_{j,g(n)},\quad o_{i,n} = a / \ell"
            r" = \mathrm{softmax}_j(s_{ij,n}) V_{g(n)},\ \ \mathrm{lse}_{i,n} = m + \log \ell"
        ),
        convention="kernel",
        citation=MILAKOV + " " + DAO + " GQA: " + GQA,
        apply=blockwise_attention,
        formula=blockwise_dot_product_attention.formula,  # type: ignore[attr-defined]
        native=blockwise_dot_product_attention,
        summary=(
            "The tile pairs of a static schedule (lax.scan; a tile the mask removes is never "
            "computed) with a running max and sum per query tile; the backward is a custom_vjp "
            "that recomputes the same tiles from the saved lse."
        ),
        cost=(
            "FLOPs as concat plus O(H T_q T_k / B_k) rescalings; memory O(H (T_q + T_k) d + "
            "B_q B_k H) temporaries: linear in T (no T_q x T_k tensor)."
        ),
        cost_model=blockwise_cost,
        static_argnames=("residual", "block_q", "block_k"),
    )
)

register(
    Formulation(
        id="kv_cache",
        title="KV-cached attention, one query per step",
        equation=(
            r"\mathcal{C} = \{(p_j, k_j, v_j)\}_{j < T_k},\quad o_t = \sum_{i=1}^{H}"
            r" \mathrm{softmax}_{j \in \mathcal{C}}\!\Big(\frac{q_{t,i} k_{j,g(i)}^\top}"
            r"{\sqrt{d_k}} + b_{t, p_j}\Big) v_{j,g(i)} W_{O,i} + b_O"
        ),
        convention="kernel",
        citation=(
            "Incremental decoding with the keys and values of earlier steps cached: Shazeer "
            "(2019), Fast Transformer Decoding: One Write-Head is All You Need, section 2.4 "
            "(and MQA); Ainslie et al. (2023), GQA: Training Generalized Multi-Query Transformer "
            "Models from Multi-Head Checkpoints, EMNLP."
        ),
        apply=kv_cache_attention,
        native=cache_attend,
        summary=(
            "Keys and values projected once into a cache (slots with absolute positions), then a "
            "lax.scan reads it one query at a time; masks and biases index absolute positions."
        ),
        cost=(
            "FLOPs as concat; memory O(H T_k (d_k + d_v)) for the cache plus O(H T_k) logits per "
            "step: no T_q x T_k tensor."
        ),
        cost_model=kv_cache_cost,
    )
)
