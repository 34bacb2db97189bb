"""Attention as a merge of one-key states: the state algebra as a formulation.

For query ``i`` of head ``h``, key ``j`` alone is the state ``(o, lse) = (v_j, s_ij)`` (its
softmax over one key is 1), and a masked key is the empty state ``(0, -inf)``. Attention over
all keys is the merge of these ``T_k`` states (:func:`attnref.merge_states` is associative,
commutative, with the empty state as identity, so any order and grouping gives the same
function). This entry merges them pairwise in a balanced tree of depth ``ceil(log2 T_k)``::

    level 0:  (o_j, lse_j) = (v_j, s_ij)  (or (0, -inf) where j is masked)
    level l:  (o, lse)_m = merge((o, lse)_{2m}, (o, lse)_{2m+1})   (odd counts: + one empty state)

Row convention as the other softmax forms (``x [..., T, d_model]``); a fully masked row merges
to the empty state, whose output is 0 (so the block output is ``b_O``).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jaxtyping import Array, Float

from attnref._src.core import cost as _cost
from attnref._src.core.checks import HIGHEST
from attnref._src.core.common import BLOCK_RETURNS, ROWS, add_output_bias, project_kv, residual_or
from attnref._src.core.entry import public
from attnref._src.core.nonfinite import allowed_pairs
from attnref._src.core.registry import Formulation, register
from attnref._src.formulations.standard import Bias, Keys, Mask, Params, Queries, logits
from attnref._src.formulations.states import merge_state_stack


def state_merge(
    params: Params, x_q: Queries, x_kv: Keys, mask: Mask, bias: Bias, scale: Array, residual: bool
) -> Float[Array, "... T_q d_model"]:
    """``head_i = merge_j (v_j, s_ij)`` over the allowed keys, ``y = sum_i head_i W_O[i] + b_O``."""
    s = logits(params, x_q, x_kv, bias, scale)  # s_ij                 [..., H, T_q, T_k]
    allowed = allowed_pairs(mask, bias, (*s.shape[:-3], *s.shape[-2:]))[..., None, :, :]
    lse = jnp.where(allowed, s, -jnp.inf)  # a masked key: the empty state (0, -inf)
    v = project_kv(x_kv, params.w_v, params.b_v, params.group_size)  # [..., H, T_k, d_v]
    o = jnp.broadcast_to(v[..., None, :, :], (*s.shape, v.shape[-1]))  # [..., H, T_q, T_k, d_v]
    z = tree_merge(o, lse)[0]  # head_i                                 [..., H, T_q, d_v]
    y = jnp.einsum("...hqv,hvd->...qd", z, params.w_o, precision=HIGHEST)
    return residual_or(add_output_bias(y, params), x_q, residual)


def tree_merge(
    o: Float[Array, "... S d_v"], lse: Float[Array, "... S"]
) -> tuple[Float[Array, "... d_v"], Float[Array, "..."]]:
    """Merge ``S`` states (axis ``-1`` of ``lse``) pairwise, level by level, to one; each level
    reshapes into pairs for :func:`attnref.merge_state_stack` (one consumer per level, so XLA
    does not recompute a level inside the next one's fusions)."""
    if lse.shape[-1] == 0:
        return jnp.zeros(o.shape[:-2] + o.shape[-1:], o.dtype), jnp.full(
            lse.shape[:-1], -jnp.inf, lse.dtype
        )
    while lse.shape[-1] > 1:
        if lse.shape[-1] % 2:  # one empty state makes the count even
            o = jnp.concatenate([o, jnp.zeros_like(o[..., :1, :])], axis=-2)
            lse = jnp.concatenate([lse, jnp.full_like(lse[..., :1], -jnp.inf)], axis=-1)
        half = lse.shape[-1] // 2
        o, lse = merge_state_stack(
            o.reshape(*o.shape[:-2], half, 2, o.shape[-1]),
            lse.reshape(*lse.shape[:-1], half, 2),
            axis=-1,
        )
    return o[..., 0, :], lse[..., 0]


state_merge_attention = public(
    ROWS,
    state_merge,
    name="state_merge_attention",
    summary="Multi-head attention as a balanced-tree merge of one-key states ``(v_j, s_ij)``.\n\n"
    "``head_i = merge_j (v_j, s_ij)`` over the allowed keys (``merge`` of\n"
    ":func:`attnref.merge_states`), ``y = sum_i head_i W_O[i] + b_O``.",
    returns=BLOCK_RETURNS,
)


# Per merged pair of states, counted from attnref._src.formulations.states.merge_state_stack
# with P = 2 (an upper bound, rounded up): per row the max, isfinite, where (m_safe), two wheres
# and two subtractions before the exps, the weight sum, its where, two isneginf, the log's add,
# and _finish's isneginf, isfinite, or, not and two wheres on lse; per value entry two wheres
# (empty states' o), two products, the sum, the division and two wheres in _finish.
MERGE_PER_ROW = 24
MERGE_PER_VALUE = 10
MERGE_TRANSCENDENTALS = 3  # two exps (the weights) and the log of their sum


def _levels(t_k: int) -> list[int]:
    """Pairs merged at each level of the tree over ``t_k`` states."""
    pairs, n = [], t_k
    while n > 1:
        n = math.ceil(n / 2)
        pairs.append(n)
    return pairs


def state_merge_cost(d: _cost.Dims) -> _cost.Cost:
    """Projections, logits and the output projection as concat; no ``A V`` product: the values
    are mixed by ``ceil(log2 T_k)`` levels of elementwise merges (``T_k - 1`` merges per row in
    all, 3 transcendentals each, less the final merge's unused ``log``)."""
    b, h, dm, tq, tk = d.batch, d.heads, d.d_model, d.t_q, d.t_k
    pq, pk, pv = _cost.projections(d)
    logits = b * h * tq * tk
    rows = b * h * tq
    merges = sum(_levels(tk))
    mm = pq + pk + pv + 2 * logits * d.d_k + 2 * b * tq * h * d.d_v * dm
    el = (
        4 * logits  # scale, + bias, the allowed set's head broadcast, where
        + merges * rows * (MERGE_PER_ROW + MERGE_PER_VALUE * d.d_v)
        + b * tq * dm * (h - 1)  # the head sum of the output projection
        + _cost.qkvo_bias_adds(d)
    )
    states = logits * (d.d_v + 1)  # level 0: every (query, key) pair's (o, lse)
    tensors = [
        b * h * tq * d.d_k,
        b * h * tk * d.d_k,
        b * h * tk * d.d_v,
        logits,  # logits, then the level-0 lse
        logits,
        states,
        *(rows * n * (d.d_v + 1) for n in _levels(tk)),  # each level's merged states
        b * h * tq * d.d_v,
        b * tq * dm,
    ]
    # The last merge's lse is never read (the head is its o): its log is dead code.
    trans = rows * (merges * MERGE_TRANSCENDENTALS - (1 if merges else 0))
    return _cost.finish(d, mm, el, trans, tensors)


register(
    Formulation(
        id="state_merge",
        title="Attention as a tree merge of one-key states",
        equation=(
            r"\mathrm{head}_i(q) = \bigoplus_{j \in \mathcal{A}(q)} \big(v_{j,i},\ s_{qj,i}\big)"
            r" = \mathrm{softmax}_j(s_{qj,i})\,V_i,\quad s_{qj,i} = \frac{q_i\, k_{j,i}^\top}"
            r"{\sqrt{d_k}},\quad (o_a, \ell_a) \oplus (o_b, \ell_b) = \Big(\frac{e^{\ell_a} o_a"
            r" + e^{\ell_b} o_b}{e^{\ell_a} + e^{\ell_b}},\ \log(e^{\ell_a} + e^{\ell_b})\Big)"
        ),
        convention="row",
        citation=(
            "Milakov & Gimelshein (2018), Online normalizer calculation for softmax, "
            "arXiv:1805.02867 (the merge); Rabe & Staats (2021), Self-attention Does Not Need "
            "O(n^2) Memory, arXiv:2112.05682 (attention as a reduction over keys)."
        ),
        apply=state_merge_attention,
        native=state_merge_attention,
        summary=(
            "Each key is a state (v_j, s_ij); attention is their merge, done pairwise in a "
            "balanced tree of ceil(log2 T_k) levels (any order gives the same function: the "
            "merge is associative and commutative)."
        ),
        cost=(
            "FLOPs O(H T_q T_k (d_k + d_v)), no A V product (T_k - 1 elementwise merges per "
            "row); memory O(H T_q T_k d_v) for the level-0 states: a reference, not a kernel."
        ),
        cost_model=state_merge_cost,
    )
)
