"""The kernel-level bound: :func:`kernel_error_bound` for ``dot_product_attention(q, k, v, ...)``
with every mask option, softcap, online (blockwise) softmax and grouped key/value heads. NumPy
only, float64.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ._core import _softmax
from ._rounding import C_EXP, _is_16bit, gamma, unit_roundoff


def kernel_error_bound(
    q: Any,
    k: Any,
    v: Any,
    allowed: Any,
    bias: Any = None,
    *,
    scale: float | None = None,
    softcap: float | None = None,
    masked_rows: str = "zeros",
    dtype: Any = np.float32,
    key_blocks: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Componentwise bounds on ``|o - o_oracle|`` and ``|lse - lse_oracle|`` for kernel-level
    attention computed in ``dtype``.

    ``|do_i| <= (rho_i + gamma_S) sum_j p_ij |v_j|``, ``rho_i = exp(2 E_i) - 1 + gamma_{S + 2 +
    2 C_EXP + 2 (C_EXP + 1)(n_b - 1)}``, ``E_i = max_j |ds_ij|``.

    The derivation follows the weight-level bound (module docstring), with the kernel's inputs
    ``q, k, v`` exact:

    1. ``|ds_ij| <= gamma_{H+1} scale |q_i|.|k_j| + (C_EXP + 2) u |s~_ij| + u |s_ij| +
       u |s_ij - max_j s_ij|`` (dot product and scale; softcap's tanh, division and multiply,
       whose derivative is at most 1; the bias add; the max subtraction).
    2. Softmax: ``rho_i`` as above: the online form rescales each partial sum by ``exp(m - m')``
       once per later key block (``n_b = key_blocks`` blocks; ``None`` assumes the worst,
       ``n_b = S``).
    3. Output as above; ``lse``:
       ``|d lse_i| <= E_i + delta_i / (1 - delta_i) + (C_EXP + 1) u |log l_i| + u |lse_i|``
       with ``delta_i = expm1(E_i) + gamma_{S + C_EXP + 2 (C_EXP + 1)(n_b - 1)}``.

    16-bit inputs are computed in float32 (the kernel promotes), so the float32 terms apply and
    the final cast adds ``u_16 |o|``. Fully masked rows are exact (0 or NaN) except under
    ``"uniform"``: ``gamma_{S+1} mean_j |v_j|``. Includes the float64 oracle's own error.

    Args:
        q: queries ``[B, T, N, H]``, exactly as the kernel received them.
        k: keys ``[B, S, K, H]`` (``K`` divides ``N``: grouped key/value heads).
        v: values ``[B, S, K, H_v]``.
        allowed: boolean ``[B, N, T, S]`` (broadcast), the attended pairs
            (``attnref.oracle.kernel_allowed``).
        bias: additive logit bias, broadcast to ``[B, N, T, S]`` (``-inf`` entries are masked).
        scale: logit scale (default ``1/sqrt(H)``).
        softcap: ``c`` of the logit cap ``c tanh(s / c)``, or ``None``.
        masked_rows: the kernel's policy for rows with no allowed key (``"zeros"``, ``"nan"``,
            ``"uniform"``).
        dtype: the format of the kernel's inputs and output.
        key_blocks: number of key blocks of an online (blockwise) softmax; ``None``: any tiling.

    Returns:
        ``(out_bound [B, T, N, H_v], lse_bound [B, T, N])``, float64, non-negative (``inf``
        where the model gives no bound).
    """
    qa, ka, va = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    b_size, t, n_heads, h = qa.shape
    s, n_kv = ka.shape[1], ka.shape[2]
    group = n_heads // n_kv
    allowed = np.broadcast_to(np.asarray(allowed, bool), (b_size, n_heads, t, s))
    sc = 1.0 / math.sqrt(h) if scale is None else float(scale)
    kg = np.repeat(ka, group, axis=2)  # [B, S, N, H]
    vg = np.repeat(va, group, axis=2)
    raw = sc * np.einsum("btnh,bsnh->bnts", qa, kg)
    mag = abs(sc) * np.einsum("btnh,bsnh->bnts", np.abs(qa), np.abs(kg))
    capped = raw if softcap is None else softcap * np.tanh(raw / softcap)
    b_arr = (
        np.zeros_like(raw)
        if bias is None
        else np.broadcast_to(np.asarray(bias, np.float64), raw.shape)
    )
    logits = capped + np.where(np.isneginf(b_arr), 0.0, b_arr)
    sm = _softmax(logits, allowed)
    top, live, l_sum = sm.top, sm.live, sm.total
    # Normalised where the max is finite (a +inf bias gives inf, not the NaN of inf / inf).
    p = sm.e / np.where(live, l_sum, 1.0)
    o_mag = np.einsum("bnts,bsnh->btnh", p, np.abs(vg))
    o_ref = np.einsum("bnts,bsnh->btnh", p, vg)
    lse_ref = np.where(live, top + np.log(np.where(live, l_sum, 1.0)), 0.0)[..., 0]
    n_b = s if key_blocks is None else max(1, int(key_blocks))
    c = C_EXP

    def one(u: float) -> tuple[np.ndarray, np.ndarray]:
        err = gamma(h + 1, u) * mag + u * np.abs(logits) + u * sm.spread
        if softcap is not None:
            err = err + (c + 2) * u * np.abs(capped)
        e_row = np.where(allowed, err, 0.0).max(axis=-1)  # [B, N, T]
        extra = 2 * (c + 1) * (n_b - 1)
        with np.errstate(over="ignore"):
            rho = np.expm1(2.0 * e_row) + gamma(s + 2 + 2 * c + extra, u)
            delta = np.expm1(e_row) + gamma(s + c + extra, u)
        out = np.einsum("bnt,btnh->btnh", rho + gamma(s, u), o_mag)
        with np.errstate(divide="ignore", invalid="ignore"):
            log_l = np.log(np.where(live, l_sum, 1.0))[..., 0]
            d_lse = e_row + np.where(delta < 1, delta / (1 - delta), np.inf)
        d_lse = d_lse + (c + 1) * u * np.abs(log_l) + u * np.abs(lse_ref)
        return out, np.swapaxes(np.where(live[..., 0], d_lse, 0.0), 1, 2)

    np_dtype = np.dtype(dtype)
    work = np.float32 if _is_16bit(np_dtype) else np_dtype
    out_b, lse_b = one(unit_roundoff(work))
    out64, lse64 = one(unit_roundoff(np.float64))
    out_b, lse_b = out_b + out64, lse_b + lse64
    if masked_rows == "uniform":
        dead = np.swapaxes(~live[..., 0], 1, 2)[..., None]  # [B, T, N, 1]
        mean_abs = np.abs(vg).mean(axis=1)[:, None]  # [B, 1, N, H_v]
        g = gamma(s + 1, unit_roundoff(work)) + gamma(s + 1, unit_roundoff(np.float64))
        out_b = np.where(dead, g * mean_abs, out_b)
        o_ref = np.where(dead, vg.mean(axis=1)[:, None], o_ref)
    if _is_16bit(np_dtype):
        out_b = out_b + unit_roundoff(np_dtype) * (np.abs(o_ref) + out_b)
    return out_b, lse_b
