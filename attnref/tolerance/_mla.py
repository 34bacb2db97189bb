"""The derived error bound of multi-head latent attention (MLA), both forms (NumPy only, float64).

**Derivation.** Both forms compute the same products in a different order (row convention;
``W_DQ`` the identity without query compression, ``d_cq = 0``):

* **Logits, compressed part.** Naive ``(x_i W_DQ W_UQ[h]) . (x_j W_DKV W_UK[h])`` and absorbed
  ``((x_i W_DQ W_UQ[h]) W_UK[h]^T) . (x_j W_DKV)`` are two parenthesisations of one six-factor
  product; in any order ``|fl(A_1...A_k) - A_1...A_k| <= gamma_N |A_1|...|A_k|``, ``N`` the sum
  of inner dimensions (Higham 2002, eq. 3.13, Lemma 3.3): at most ``2 d_model + d_cq + d_c +
  d_nope + d_rope`` (the final dot also sums the RoPE part).
* **Logits, RoPE part** (shared ``k_rope``, per-head ``q_rope``; not absorbable): as in
  :func:`attnref.tolerance.rope_attention_error_bound`, ``gamma_2`` relative to the pair sums
  ``QJ``, ``KJ`` and the angle error ``sum_p (e_p(m_i) + e_p(n_j)) 2 QP_ip KP_jp``
  (:func:`attnref.tolerance.rope_logit_error`).
* With scale and bias, ``N_s = 2 d_model + d_cq + d_c + d_nope + d_rope + 6``, ``|ds_hij| <=
  gamma_{N_s} Ls_hij + |scale| angle_hij + u |s_hij - max_j s_hij|``, ``Ls = |scale|
  (|x_i||W_DQ||W_UQ[h]||W_UK[h]|^T|W_DKV|^T|x_j|^T + QJ_hi . KJ_j) + |bias_ij|``.
* **Softmax** as everywhere (``docs/tolerances.md``): ``rho_hi = exp(2 E_hi) - 1 + gamma_{T_k + 2
  + 2 C_EXP}``, ``E_hi`` the row max of the logit bound.
* **Output.** ``y_i = sum_h sum_j p_hij x_j W_DKV W_UV[h] W_O[h]`` in either order (values first,
  or the latent mixed first): ``N_y = T_k + d_model + d_c + d_v + H + 2``, ``|dy_i| <= sum_h
  (rho_hi + gamma_{N_y}) sum_j p_hij G_hj``, ``G_hj = |x_j||W_DKV||W_UV[h]||W_O[h]|`` (``+ u |x_i
  + y_i|`` residual).

Plus the float64 oracle's own error (the same at float64's ``u``): ``|form in dtype - oracle| <=
bound`` is a rigorous first-order test; two forms differ by at most twice it. 16-bit formats get
the worst-case expression in their ``u`` (loose).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from attnref.oracle._doc import signed
from attnref.oracle._mla import check_mla_params, mla_call, mla_problem, mla_weights

from ._core import bound_options, softmax, summed_bound
from ._rope import pair_sum, rope_logit_error

__all__ = ["mla_attention_error_bound"]


@signed(mla_call, bound_options)
def mla_attention_error_bound(call: dict[str, Any]) -> np.ndarray:
    """Componentwise bound on ``|MLA in dtype - float64 oracle|``, ``[..., T_q, d_model]``, for
    both forms and their cache-level twins (module docstring).

    Returns:
        The bound, float64 ``[..., T_q, d_model]``, non-negative.

    Raises:
        ValueError, TypeError: As :func:`attnref.oracle.mla_attention`.
    """
    params, x_q, convention, base = (call[n] for n in ("params", "x_q", "convention", "base"))
    residual, dtype = call["residual"], call["dtype"]
    dims = check_mla_params(params)
    x_kv = x_q if call["x_kv"] is None else call["x_kv"]
    q, k, v, m, b, s = mla_problem(call)
    batch, t_q, t_k = q.shape[:-3], q.shape[-3], k.shape[-3]
    f: dict[str, Any] = mla_weights(params)
    a: dict[str, Any] = {n: None if w is None else np.abs(w) for n, w in f.items()}
    xq, xkv = np.asarray(x_q, np.float64), np.asarray(x_kv, np.float64)
    full = (*batch, t_q, t_k)
    mask_b = np.ones(full, bool) if m is None else m
    bias_b = np.zeros(full) if b is None else b
    logits = np.einsum("...tid,...jid->...itj", q, k) * s + bias_b[..., None, :, :]
    allowed = mask_b[..., None, :, :] & (logits != -np.inf)
    sm = softmax(logits, allowed)

    cq = np.abs(xq) if a["w_dq"] is None else np.abs(xq) @ a["w_dq"]  # |x||W_DQ|
    ckv = np.abs(xkv) @ a["w_dkv"]  # |x||W_DKV|                                 [..., T_k, d_c]
    qa = np.einsum("...tc,icn->...itn", cq, a["w_uq"])  # [..., H, T_q, d_nope]
    ka = np.einsum("...jc,icn->...ijn", ckv, a["w_uk"])  # [..., H, T_k, d_nope]
    ls_pre = np.einsum("...itn,...ijn->...itj", qa, ka)
    pos_q = np.arange(t_q) if call["positions_q"] is None else np.asarray(call["positions_q"])
    pos_k = np.arange(t_k) if call["positions_kv"] is None else np.asarray(call["positions_kv"])
    if dims.d_rope:
        qr = np.einsum("...tc,icr->...itr", cq, a["w_qr"])  # [..., H, T_q, d_rope]
        kr = np.broadcast_to(
            (np.abs(xkv) @ a["w_kr"])[..., None, :, :], (*batch, dims.heads, t_k, dims.d_rope)
        )
        ls_pre = ls_pre + np.einsum(
            "...itr,...ijr->...itj", pair_sum(qr, convention), pair_sum(kr, convention)
        )
    ls = abs(s) * ls_pre + np.abs(bias_b)[..., None, :, :]
    g = np.einsum("...jc,icv,ivd->...ijd", ckv, a["w_uv"], a["w_o"])  # G_hj [..., H, T_k, d_model]
    mixed = np.einsum("...itj,...ijd->...itd", sm.weights, g)

    def logit_error(g_s: float, u: float) -> np.ndarray:
        err = g_s * ls + u * sm.spread
        if dims.d_rope:
            err = err + abs(s) * rope_logit_error(qr, kr, pos_q, pos_k, convention, u, base)
        return err

    n_s = 2 * dims.d_model + dims.d_cq + dims.d_c + dims.d_nope + dims.d_rope + 6
    n_y = t_k + dims.d_model + dims.d_c + dims.d_v + dims.heads + 2
    resid = (
        xq + np.einsum("...itj,...jiv,ivd->...td", sm.weights, v, f["w_o"]) if residual else None
    )
    return summed_bound(dtype, (n_s, n_y, t_k), logit_error, allowed, mixed, None, resid)
