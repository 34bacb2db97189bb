"""Derived error bounds for attention computed in a floating-point format (NumPy only).

A formulation run in a format with unit round-off ``u`` (``eps / 2``) is compared with the float64
oracle on the *same* inputs (already in the format), so only arithmetic error is bounded. The
bound is first order in ``u`` and componentwise (derivation also in ``docs/tolerances.md``):

1. **Logits.** Every formulation computes ``s_ij = scale * x~_i W~_Q W~_K^T x~_j^T`` (homogeneous
   ``x~ = [x, 1]``, ``W~ = [W; b]``) in *some* parenthesisation, plus the scale and the bias. A
   matrix product in any order has ``|fl(A_1...A_k) - A_1...A_k| <= gamma_N |A_1|...|A_k|``, ``N``
   the sum of inner dimensions, ``gamma_n = n u / (1 - n u)`` (Higham 2002, eq. 3.13, Lemma 3.3).
   So ``|ds_ij| <= gamma_{N_s} Ls_ij + u |s_ij - max_j s_ij|`` with ``N_s = 2 (d_model + 1) + d_k +
   2``, ``Ls = |scale| |x~_q||W~_Q||W~_K|^T|x~_kv|^T + |bias|`` (the last term: the max
   subtraction; forms that drop the row-constant ``b_K`` terms are covered, softmax ignores them).
2. **Softmax.** Logit errors ``<= E_i`` scale each weight by ``[exp(-2 E_i), exp(2 E_i)]``;
   ``exp`` (``C_EXP = 4`` units), the row sum and the division add ``gamma_{T_k + 2 + 2 C_EXP}``:
   ``|dp_ij| <= rho_i p_ij``, ``rho_i = exp(2 E_i) - 1 + gamma_{T_k + 10}``.
3. **Output.** ``y_i = sum_h sum_j p_hij x~_j W~_V[h] W_O[h] + b_O`` has ``N_y = T_k + d_model +
   d_v + H + 2``; with ``G_hj = |x~_j||W~_V[h]||W_O[h]|``, ``|dy_i| <= sum_h (rho_hi + gamma_{N_y})
   sum_j p_hij G_hj + gamma_{N_y} |b_O|`` (``+ u |x_i + y_i|`` in residual form).

**16-bit formats** (worst-case ``gamma_n`` is vacuous there) use XLA's model: dot products and
sums accumulate in float32, each stored intermediate rounds once to 16 bits; over all
formulations at most ``K_S = 8`` roundings on the logit chain and ``K_Y = 8`` on the output
chain, plus one 16-bit scatter-add of length ``T_k`` (the graph form); softmax adds ``4 u``.

**Grouped-query parameters** (``K < H``) are bounded as their multi-head twin (each K/V head
repeated for its ``G`` query heads): every formulation computes the same products per query head.

**Rotary position embedding** (:func:`rope_attention_error_bound`). The angle ``m theta_p`` is off
by ``(gamma_2 + (|ln base| + 3) u64) |m| theta_p`` and ``cos``/``sin`` add ``C_TRIG = 4`` units,
so ``|c^ - cos|, |s^ - sin| <= e_p(m)``; a rotated pair is off by ``(|a| + |b|) (e_p(m) +
gamma_2)`` (:func:`rope_map_error_bound`). With ``QP_p`` the pair sum over plane ``p`` of ``Q =
|x~_q||W~_Q|`` and ``QJ`` spread back to both members (``|rope(q)| <= QJ``), both the rotated and
the relative form satisfy ``|ds_ij| <= gamma_{N_s} Ls_ij + |scale| sum_p (e_p(m_i) + e_p(n_j)) 2
QP_ip KP_jp + u |s_ij - max_j s_ij|``, ``N_s = 2 (d_model + 3) + 2 d_k + 2``, ``Ls = |scale| QJ .
KJ + |bias|``; softmax and output as above.

The float64 oracle's own error is the same bound at float64's ``u``; :func:`attention_error_bound`
returns the sum, so ``|actual - oracle| <= bound`` is a rigorous first-order test.

Modules (NumPy only; :mod:`attnref.oracle` imported where a bound needs an exact intermediate):
``_rounding`` (the rounding model: ``unit_roundoff``, ``gamma``, ``C_EXP``, ``C_TRIG``, ``K_S``,
``K_Y``), ``_core`` (weight level, local errors, the comparative rule), ``_linear``, ``_kernel``
(the kernel level, by the allowed set or streamed from a call), ``_rope``, ``_grad_kernel``,
``_grad_weight``, ``_grad_linear`` (gradients), ``_states`` (state merges, ``docs/states.md``),
``_mla``, ``_pieces`` (attention in pieces whose states are merged).
"""

from __future__ import annotations

from ._core import attention_error_bound, attention_local_errors, comparative_bound
from ._grad_kernel import kernel_grad_error_bound
from ._grad_linear import linear_attention_vjp_error_bound, linear_multihead_vjp_error_bound
from ._grad_weight import attention_vjp_error_bound, rope_attention_vjp_error_bound
from ._kernel import kernel_bound_minorant, kernel_call_error_bound, kernel_error_bound
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
    "kernel_bound_minorant",
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
