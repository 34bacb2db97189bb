"""Derived error bounds for attention computed in a floating-point format (NumPy only).

A formulation run in a format with unit round-off ``u`` (``eps / 2``) is compared with the float64
oracle on the *same* inputs (already rounded to the format), so only arithmetic error is bounded.
The bound is first order in ``u`` and componentwise; its derivation (also in
``docs/tolerances.md``):

1. **Logits.** Every formulation computes ``s_ij = scale * x~_i W~_Q W~_K^T x~_j^T`` (tildes:
   homogeneous coordinates ``x~ = [x, 1]``, ``W~ = [W; b]``, which fold the biases in) as *some*
   parenthesisation of the same four factors, plus the scale multiply and the bias add. For a
   product of matrices computed in any order,
   ``|fl(A_1...A_k) - A_1...A_k| <= gamma_N |A_1|...|A_k|``
   with ``N`` the sum of the inner dimensions and ``gamma_n = n u / (1 - n u)`` (Higham 2002,
   eq. 3.13 and Lemma 3.3). So ``|ds_ij| <= gamma_{N_s} Ls_ij + u |s_ij - max_j s_ij|`` with
   ``N_s = 2 (d_model + 1) + d_k + 2`` and ``Ls = |scale| |x~_q||W~_Q||W~_K|^T|x~_kv|^T + |bias|``;
   the last term is the rounding of the max subtraction. (The patterns and column forms drop the
   row-constant ``b_K`` terms; softmax is invariant to them and the bound covers what remains.)
2. **Softmax.** Logit errors ``|ds_ij| <= E_i`` move each weight by a factor in
   ``[exp(-2 E_i), exp(2 E_i)]``; evaluating ``exp`` (assumed accurate to ``C_EXP = 4`` units of
   ``u``), the row sum of ``T_k`` terms and the division add ``gamma_{T_k + 2 + 2 C_EXP}``. Hence
   ``|dp_ij| <= rho_i p_ij`` with ``rho_i = exp(2 E_i) - 1 + gamma_{T_k + 10}``.
3. **Output.** ``y_i = sum_h sum_j p_hij x~_j W~_V[h] W_O[h] + b_O`` in any order is a product with
   inner dimensions ``T_k, d_model + 1, d_v`` summed over ``H`` heads plus one bias add:
   ``N_y = T_k + d_model + d_v + H + 2``. With ``G_hj = |x~_j||W~_V[h]||W_O[h]|``,
   ``|dy_i| <= sum_h (rho_hi + gamma_{N_y}) sum_j p_hij G_hj + gamma_{N_y} |b_O|``
   (and ``+ u |x_i + y_i|`` in residual form).

**16-bit formats** (float16, bfloat16). The worst-case ``gamma_n`` in the 16-bit ``u`` is vacuous
at ordinary sizes, so these use the model of how XLA evaluates them: dot products and ``jnp.sum``
accumulate in float32 (``gamma_n`` in float32's ``u``) and each stored intermediate is rounded once
to the 16-bit format. Counting stored intermediates over all formulations gives at most
``K_S = 8`` roundings on the logit chain and ``K_Y = 8`` on the output chain, each bounded by the
chain's absolute magnitude, plus one scatter-add segment sum of length ``T_k`` accumulated in the
16-bit format (the graph form). Softmax evaluation adds ``4 u`` for exp, sum and division.

**Grouped-query parameters** (``K < H`` key/value heads, query head ``i`` reading key/value
head ``i // G``) are bounded as their equivalent multi-head parameters (every K/V head repeated
for its ``G`` query heads): each formulation computes the same products per query head, whether a
key/value projection is computed once and shared or once per query head, so the error model is
unchanged.

**Rotary position embedding** (:func:`rope_attention_error_bound`). The angle ``m theta_p``
(``theta_p = base^(-2p/d)`` by ``pow`` in float64, rounded to the angle dtype, times the position)
is off by at most ``(gamma_2 + (|ln base| + 3) u64) |m| theta_p``, and ``cos``/``sin`` add
``C_TRIG = 4`` units of ``u``; as ``|cos(a + da) - cos(a)| <= |da|`` this bounds
``|c^ - cos|, |s^ - sin| <= e_p(m)``. A rotated pair ``(a c - b s, a s + b c)`` is then off by
``(|a| + |b|) (e_p(m) + gamma_2)`` (:func:`rope_map_error_bound`). In the logits, with ``QP_p``
the pair sum over plane ``p`` of ``Q = |x~_q||W~_Q|`` and ``QJ`` the pair sums spread back to both
members (so ``|rope(q)| <= QJ``), both the rotate-``q``-and-``k`` form and the relative form
``x~_i W~_Q R(m - n) W~_K^T x~_j^T`` satisfy
``|ds_ij| <= gamma_{N_s} Ls_ij + |scale| sum_p (e_p(m_i) + e_p(n_j)) 2 QP_ip KP_jp
+ u |s_ij - max_j s_ij|`` with ``N_s = 2 (d_model + 3) + 2 d_k + 2`` and
``Ls = |scale| QJ . KJ + |bias|``; softmax and output are as above (values are not rotated).

The float64 oracle's own error is the same bound with float64's ``u``; :func:`attention_error_bound`
returns the sum of both, so ``|actual - oracle| <= bound`` is a rigorous first-order test.

Modules (this package imports NumPy only, never JAX; :mod:`attnref.oracle`'s NumPy functions are
imported lazily where a bound needs an exact intermediate):

* :mod:`attnref.tolerance._rounding`: the rounding model (``unit_roundoff``, ``gamma``, ``C_EXP``,
  ``C_TRIG``, ``K_S``, ``K_Y``), the one place where a format's arithmetic is modelled.
* :mod:`attnref.tolerance._core`: the weight-level bound (steps 1 to 3), its local error terms,
  the comparative rule, and the helpers the weight-level bounds share.
* :mod:`attnref.tolerance._linear`: linear attention (every feature map and form).
* :mod:`attnref.tolerance._kernel`: the kernel level ``dot_product_attention(q, k, v, ...)``,
  given the allowed set or streamed from the call's arguments (``kernel_call_error_bound``).
* :mod:`attnref.tolerance._rope`: rotary position embedding, the map and attention with it.
* :mod:`attnref.tolerance._grad_kernel`, :mod:`attnref.tolerance._grad_weight`,
  :mod:`attnref.tolerance._grad_linear`: bounds on gradients (the kernel level for a format;
  the weight-level, RoPE and linear gradient oracles' own float64 error).
* :mod:`attnref.tolerance._states`: the merge of attention states (``merge_error_bound``: ``P``
  states merged by a binary tree of depth ``D`` or one stacked merge, linear in ``D``, with the
  pieces' own errors; ``merge_grad_error_bound``: the gradient of one merge; ``docs/states.md``).
* :mod:`attnref.tolerance._mla`: multi-head latent attention, both forms (its derivation).
* :mod:`attnref.tolerance._pieces`: attention computed in pieces whose states are merged
  (``pieces_error_bound``: each piece's kernel bound carried through the merge bound, against
  the whole call; split-KV, ring schemes, and the worst case of unknown pieces).
"""

from __future__ import annotations

from ._core import attention_error_bound, attention_local_errors, comparative_bound
from ._grad_kernel import kernel_grad_error_bound
from ._grad_linear import linear_attention_vjp_error_bound, linear_multihead_vjp_error_bound
from ._grad_weight import attention_vjp_error_bound, rope_attention_vjp_error_bound
from ._kernel import kernel_call_error_bound, kernel_error_bound
from ._linear import linear_error_bound, linear_multihead_error_bound
from ._mla import mla_attention_error_bound
from ._pieces import pieces_error_bound

# Private helpers kept importable from here: tests/test_rope.py rebuilds the RoPE logit bound
# from its parts.
from ._rope import pair_sum as pair_sum
from ._rope import rope_angle_error as rope_angle_error
from ._rope import rope_attention_error_bound, rope_map_error_bound
from ._rope import rope_logit_error as rope_logit_error
from ._rounding import C_EXP as C_EXP
from ._rounding import C_TRIG as C_TRIG
from ._rounding import K_S as K_S
from ._rounding import K_Y as K_Y
from ._rounding import gamma, unit_roundoff
from ._states import TREES, merge_depth, merge_error_bound, merge_grad_error_bound

__all__ = [
    "TREES",
    "attention_error_bound",
    "attention_local_errors",
    "attention_vjp_error_bound",
    "comparative_bound",
    "gamma",
    "kernel_call_error_bound",
    "kernel_error_bound",
    "kernel_grad_error_bound",
    "linear_attention_vjp_error_bound",
    "linear_error_bound",
    "linear_multihead_error_bound",
    "linear_multihead_vjp_error_bound",
    "merge_depth",
    "merge_error_bound",
    "merge_grad_error_bound",
    "mla_attention_error_bound",
    "pieces_error_bound",
    "rope_attention_error_bound",
    "rope_attention_vjp_error_bound",
    "rope_map_error_bound",
    "unit_roundoff",
]
