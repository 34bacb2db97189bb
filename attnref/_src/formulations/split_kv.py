"""Split-KV attention (flash-decoding): the keys cut into ``P`` splits, one state each, one merge.

The ``S`` keys, padded to ``P c`` (``c = ceil(S / P)``), form ``P`` contiguous runs ``K_p = {p c,
..., p c + c - 1}``; each split's state of every query (:func:`~attnref._src.formulations.
distributed.chunk.chunk_state`: kernel options are rules on global key positions) is computed
for all ``P`` at once (``vmap``) and the states merge in one pass
(:func:`attnref.merge_state_stack`)::

    (o_p, lse_p) = (softmax_{j in K_p}(s_ij) V_{K_p},  log sum_{j in K_p} exp(s_ij))
    m = max_p lse_p,   lse = m + log sum_p exp(lse_p - m),   o = sum_p exp(lse_p - lse) o_p

Padded keys (positions ``>= S``) are never allowed, so a split of padding alone is the empty
state (``lse = -inf``, the merge's identity): exact for every ``S >= 0``, ``P >= 1`` (``S < P``
included). The finishing rules (masked rows, query padding, lengths out of range) run once on
the merged state; ``masked_rows="uniform"`` reads the sum of the values, each split's
``value_sum``.

The decoding kernel of Dao, Haziza, Massa & Sizov (2023), "Flash-Decoding for long-context
inference" (PyTorch and Stanford CRFM blog posts, October 2023; flash-attn's
``flash_fwd_splitkv_kernel`` then ``flash_fwd_splitkv_combine_kernel`` when ``num_splits > 1``):
with one query and a long cache, the splits run in parallel. Splits compute in the compute dtype
(float32 for 16-bit inputs), the output is cast once after the merge; gradients by autodiff. A
key, value or bias entry a query may not read never reaches its output or gradients (each
split's kernel runs on finite parts).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from attnref._src.core import cost as _cost
from attnref._src.core.common import rows_level
from attnref._src.core.registry import Formulation, register
from attnref._src.formulations.distributed.chunk import chunk_state, value_sum
from attnref._src.formulations.kernel import (
    KernelCall,
    Option,
    finish,
    kernel_call,
    kernel_public,
    kernel_rows,
    option_args,
    rows_public,
    uniform_rows,
)
from attnref._src.formulations.kernel_forms import DAO, GQA, MILAKOV, kernel_rows_cost
from attnref._src.formulations.kernel_spec import lengths_only
from attnref._src.formulations.states import merge_state_stack

NUM_SPLITS = 4  # the default number of splits (the registry entry's)


def check_num_splits(num_splits: Any) -> int:
    """``num_splits``, a positive int (NumPy ints accepted; ``TypeError`` for a non-int, bool
    included, ``ValueError`` below 1), as an int."""
    if not isinstance(num_splits, (int, np.integer)) or isinstance(num_splits, (bool, np.bool_)):
        raise TypeError(f"num_splits must be a positive int, got {num_splits!r}")
    if num_splits < 1:
        raise ValueError(f"num_splits must be a positive int, got {num_splits!r}")
    return int(num_splits)


def _splits(a: Array, c: int, p: int) -> Array:
    """``[B, S, ...]`` zero-padded to ``[B, P c, ...]`` and cut into ``[P, B, c, ...]``."""
    pad = [(0, 0)] * a.ndim
    pad[1] = (0, p * c - a.shape[1])
    a = jnp.pad(a, pad)
    return jnp.moveaxis(a.reshape(a.shape[0], p, c, *a.shape[2:]), 1, 0)


def split_kv(
    call: KernelCall, num_splits: int
) -> tuple[Float[Array, "B T N H_v"], Float[Array, "B T N"]]:
    """The states of the ``P`` splits (``vmap``), their merge, and the finishing rules: ``o``
    in the input dtype, ``lse`` in the compute dtype."""
    spec, inputs = call.spec, call.inputs
    c = -(-spec.s // num_splits)  # keys per split; positions >= S are padding
    k_pos = jnp.asarray(np.arange(num_splits * c, dtype=np.int32).reshape(num_splits, c))
    k, v = _splits(inputs.k, c, num_splits), _splits(inputs.v, c, num_splits)
    kv_seg = None if inputs.kv_seg is None else _splits(inputs.kv_seg, c, num_splits)
    q_pos = jnp.arange(spec.t, dtype=jnp.int32)
    lengths = lengths_only(inputs.q_lens, inputs.kv_lens)

    def state(k_p: Array, v_p: Array, pos_p: Array, seg_p: Array | None) -> tuple[Array, Array]:
        return chunk_state(
            spec, lengths, call.scale, inputs.q, q_pos, inputs.q_seg, k_p, v_p, pos_p, seg_p,
            inputs.bias, inputs.mask, inputs.keep,
        )  # fmt: skip

    o, lse = jax.vmap(state)(k, v, k_pos, kv_seg)  # [P, B, T, N, H_v], [P, B, T, N]
    o, lse = merge_state_stack(o, lse, axis=0)
    mean_v = None
    if spec.masked_rows == "uniform" and not spec.has_sinks:
        v_sum = jnp.sum(jax.vmap(lambda v_p, p: value_sum(spec, v_p, p))(v, k_pos), axis=0)
        mean_v = uniform_rows(spec, v_sum)
    # The sink joins once, after the merge: no split's state holds it (never counted twice).
    return finish(spec, lengths, o, lse, ~jnp.isneginf(lse), q_pos, mean_v, inputs.sinks)


_NUM_SPLITS_DOC = (
    "The number of key splits ``P``, a positive int (default 4); each holds ``ceil(S / P)`` keys."
)

split_kv_dot_product_attention = kernel_public(
    split_kv,
    name="split_kv_dot_product_attention",
    summary=(
        "Split-KV (flash-decoding) attention: ``P`` key splits, one state each, one merge.\n\n"
        "Equal to :func:`attnref.dot_product_attention` with the same arguments (rounding "
        "aside):\n``lse = m + log sum_p exp(lse_p - m)``, ``o = sum_p exp(lse_p - lse) o_p`` "
        "over the states\n``(o_p, lse_p)`` of the splits (see the module docstring). ``S`` need "
        "not be a multiple of\n``num_splits`` (the last splits are padded; padding is never "
        "attended); ``T = 1`` is one decoding step."
    ),
    options=(Option("num_splits", NUM_SPLITS, "int", _NUM_SPLITS_DOC),),
    check=check_num_splits,
    returns=" Both differentiable (autodiff through the splits and the merge).",
    value_errors=", or ``num_splits`` is below 1",
    type_errors=", or ``num_splits`` is not an int (a bool or a float included)",
)


split_kv_attention = rows_public(
    rows_level(
        "_split_rows",
        kernel_call(split_kv_dot_product_attention),
        option_args(
            f"num_splits: {_NUM_SPLITS_DOC}",
            "``num_splits`` is below 1",
            "``num_splits`` is not an int",
        ),
        {"num_splits": (NUM_SPLITS, "int")},
        check=check_num_splits,
    ),
    kernel_rows,
    __name__,
    name="split_kv_attention",
    summary=(
        "Multi-head attention through :func:`split_kv_dot_product_attention`: the keys cut "
        "into\n``num_splits`` splits, each split's state ``(o_p, lse_p)`` computed for every "
        "query, the\nstates merged (flash-decoding)."
    ),
)


# ----------------------------------------------------------------------------- cost model


# Per logit of a split, beyond the naive kernel's masked softmax (SOFTMAX_PER_LOGIT): the
# split's allowed set from global positions (k_pos < S, q_pos < T, their "and") and its "and"
# with the mask's columns.
SPLIT_PER_LOGIT = 4
# Per query row of a split: the kernel's lse (log's "+ top", where) and its finishing selects
# (lengths in range on o's row and on lse).
SPLIT_PER_ROW = 5
# Per state merged (one per split and query row; merge_state_stack): the max over splits, the
# select of empty states, "lse - m", the weights' sum, isneginf; and per value entry the select
# of empty states' o, "w o" and the sum over splits (3 per entry, counted with d_v).
MERGE_PER_STATE = 5
# Per merged row: isfinite, m_safe, the safe total, "m + log", and the finishing of the merge
# (isneginf, isfinite, or, two selects on lse) and of the kernel (isneginf, two lengths
# selects); per value entry the division, the merge's two selects and the kernel's one (4).
MERGE_PER_ROW = 12


def split_kv_cost(d: _cost.Dims, num_splits: int = NUM_SPLITS) -> _cost.Cost:
    """The cost of :func:`split_kv_attention` with ``num_splits = P`` (default 4): ``P`` splits
    of ``c = ceil(T_k / P)`` keys (padded to ``P c``), each the naive kernel on its keys (one
    ``vmap``ped body), then the merge of the ``P`` states per row."""
    b, h, dm = d.batch, d.heads, d.d_model
    p = check_num_splits(num_splits)
    sp = p * -(-d.t_k // p)  # keys padded to whole splits
    logits = b * h * d.t_q * sp
    rows = b * h * d.t_q
    states = p * rows
    kernel_el = (
        (_cost.SOFTMAX_PER_LOGIT + SPLIT_PER_LOGIT) * logits
        + (_cost.SOFTMAX_PER_ROW + SPLIT_PER_ROW) * states
        + _cost.guard_elementwise(
            d,
            operands=b * d.t_q * h * d.d_k + b * sp * h * (d.d_k + d.d_v),
            logits=logits,
            rows=states,
            outputs=states * (d.d_v + 1),
        )
    )
    merge_el = (MERGE_PER_STATE + 3 * d.d_v) * states + (MERGE_PER_ROW + 4 * d.d_v) * rows
    qkv = [b * d.t_q * h * d.d_k, b * d.t_k * h * d.d_k, b * d.t_k * h * d.d_v]
    split_kv_ = [b * sp * h * d.d_k, b * sp * h * d.d_v]  # padded, split-major
    tensors = [
        *qkv,
        *qkv,  # their finite parts
        *split_kv_,
        *split_kv_,
        b * d.t_q * sp,  # the mask's and the bias's columns of every split (one head)
        b * d.t_q * sp,
        *_cost.softmax_tensors(d, logits),
        2 * states,  # per-split lse and its mask
        states * d.d_v,  # the states' o
        states * (d.d_v + 1),  # the merge's weights and weighted o
        rows * (d.d_v + 1),  # the merged state
        b * d.t_q * h * d.d_v,  # heads, token-major
        b * d.t_q * dm,
        b * d.t_q * d.t_k,  # the weight-level allowed set
    ]
    return kernel_rows_cost(
        d,
        2 * logits * (d.d_k + d.d_v),
        kernel_el + merge_el,
        logits + 2 * states,  # exp of the logits; per state, the kernel's log and the weight
        tensors,
        max(logits, *qkv, b * d.t_q * dm),
    )


# ----------------------------------------------------------------------------- registry entry

FLASH_DECODING = (
    "Dao, Haziza, Massa & Sizov (2023), Flash-Decoding for long-context inference (PyTorch and "
    "Stanford CRFM blog posts, October 2023)."
)

register(
    Formulation(
        id="split_kv",
        title="Split-KV attention (flash-decoding): one state per key split, one merge",
        equation=(
            r"(o^{(p)}_{i,n}, \ell^{(p)}_{i,n}) = \Big(\mathrm{softmax}_{j \in K_p}(s_{ij,n})"
            r" V_{K_p, g(n)},\ \log \sum_{j \in K_p} e^{s_{ij,n}}\Big),\quad s_{ij,n} ="
            r" \frac{q_{i,n} k_{j,g(n)}^\top}{\sqrt{d_k}} + b_{ij},\quad m_{i,n} = \max_p"
            r" \ell^{(p)}_{i,n},\ \ \ell_{i,n} = m_{i,n} + \log \sum_{p=1}^{P} e^{\ell^{(p)}_{i,n}"
            r" - m_{i,n}},\ \ o_{i,n} = \sum_{p=1}^{P} e^{\ell^{(p)}_{i,n} - \ell_{i,n}}\,"
            r" o^{(p)}_{i,n} = \mathrm{softmax}_j(s_{ij,n}) V_{g(n)}"
        ),
        convention="kernel",
        citation=FLASH_DECODING + " The merge: " + MILAKOV + " " + DAO + " GQA: " + GQA,
        apply=split_kv_attention,
        native=split_kv_dot_product_attention,
        formula=split_kv,
        summary=(
            "The keys cut into P contiguous splits; every split's state (o, lse) is computed "
            "at once (vmap over the splits) and the P states are merged in one stable pass "
            "(merge_state_stack); gradients by autodiff."
        ),
        cost=(
            "FLOPs as concat plus O(P H T_q (d_v + 1)) for the merge; memory O(H T_q T_k) "
            "logits (all splits at once) plus O(P H T_q d_v) states."
        ),
        cost_model=split_kv_cost,
        static_argnames=("residual", "num_splits"),
    )
)
