"""The kernel-level bound: :func:`kernel_error_bound` for ``dot_product_attention(q, k, v, ...)``
with every mask option, softcap, online (blockwise) softmax and grouped key/value heads. NumPy
only, float64.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from attnref.oracle._doc import KERNEL, KERNEL_RAISES, doc, signed
from attnref.oracle._kernel_call import kernel_call, parse, query_block
from attnref.oracle._kernel_fast import (
    block_live,
    dropout_weights,
    head_groups,
    logits_block,
    raw_logits,
    row_blocks,
)
from attnref.oracle._threads import each_block

from ._core import Softmax, softmax
from ._rounding import C_EXP, gamma, is_16bit, unit_roundoff, work_units


class Logits(NamedTuple):
    """The logits of some query rows and their magnitudes (float64)."""

    raw: np.ndarray  # x = scale q . k
    mag: np.ndarray  # |scale| |q| . |k|
    capped: np.ndarray  # c tanh(x / c) (x without softcap)
    logits: np.ndarray  # capped + the finite bias
    sm: Softmax  # over the allowed keys


def kernel_logits(
    q: np.ndarray,
    kt: np.ndarray,
    sc: float,
    softcap: float | None,
    bias: np.ndarray | None,
    allowed: np.ndarray,
) -> Logits:
    """:class:`Logits` of queries ``q [..., R, H]`` against keys ``kt [..., H, S]``."""
    raw = sc * (q @ kt)
    mag = abs(sc) * (np.abs(q) @ np.abs(kt))
    capped = raw if softcap is None else softcap * np.tanh(raw / softcap)
    logits = capped if bias is None else capped + np.where(np.isneginf(bias), 0.0, bias)
    return Logits(raw, mag, capped, logits, softmax(logits, allowed))


def logit_reach(lg: Logits, allowed: np.ndarray, h: int, softcap: float | None) -> np.ndarray:
    """Step 1 without its unit: ``M_i = max_j (mag_ij + local_ij / (H + 1))`` over the allowed
    keys, ``[..., R]``, so that ``E_i = gamma_{H+1} M_i >= max_j |ds_ij|`` in every format
    (``local = |s_ij| + |s_ij - max_j s_ij| (+ (C_EXP + 2) |s~_ij|)``, ``u <= gamma_{H+1} / (H +
    1)``): one max serves every unit round-off."""
    local = np.abs(lg.logits) + lg.sm.spread
    if softcap is not None:  # softcap's tanh, division and multiply
        local += (C_EXP + 2) * np.abs(lg.capped)
    err = lg.mag + local / (h + 1)
    return np.where(allowed, err, 0.0).max(axis=-1, initial=0.0)


def row_terms(
    reach: np.ndarray, h: int, s_len: int, n_b: int, u: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Steps 2 and 3 in ``u`` for ``S`` keys in ``n_b`` key blocks: ``(E_i, rho_i, E_i + delta_i
    / (1 - delta_i))`` (``inf`` once ``delta_i >= 1``), ``E_i = gamma_{H+1} reach_i``."""
    c = C_EXP
    e_row = gamma(h + 1, u) * reach
    extra = 2 * (c + 1) * (n_b - 1)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        rho = np.expm1(2.0 * e_row) + gamma(s_len + 2 + 2 * c + extra, u)
        delta = np.expm1(e_row) + gamma(s_len + c + extra, u)
        return e_row, rho, e_row + np.where(delta < 1, delta / (1 - delta), np.inf)


@doc(
    KERNEL,
    q="Queries ``[B, T, N, H]``, exactly as the kernel received them.",
    k="Keys ``[B, S, K, H]`` (``K`` divides ``N``: grouped key/value heads).",
    v="Values ``[B, S, K, H_v]``.",
    allowed="Boolean ``[B, N, T, S]`` (broadcast), the attended pairs "
    "(:func:`attnref.oracle.kernel_allowed`).",
    dtype="The format of the kernel's inputs and output.",
)
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
    attention in ``dtype`` (the weight-level derivation of :mod:`attnref.tolerance`, ``q, k, v``
    exact), plus the float64 oracle's own error:

    1. ``|ds_ij| <= gamma_{H+1} scale |q_i|.|k_j| + (C_EXP + 2) u |s~_ij| + u |s_ij| + u |s_ij -
       max_j s_ij|`` (dot and scale; softcap, 1-Lipschitz; bias add; max subtraction).
    2. ``rho_i = exp(2 E_i) - 1 + gamma_{S + 2 + 2 C_EXP + 2 (C_EXP + 1)(n_b - 1)}``, ``E_i =
       gamma_{H+1} max_j (scale |q_i|.|k_j| + (|s_ij| + ...) / (H + 1)) >= max_j |ds_ij|``
       (:func:`logit_reach`): the online form rescales by ``exp(m - m')`` once per later key
       block (``n_b = key_blocks``; ``None``: ``S``).
    3. ``|do_i| <= (rho_i + gamma_S) sum_j p_ij |v_j|``; ``|d lse_i| <= E_i + delta_i / (1 -
       delta_i) + (C_EXP + 1) u |log l_i| + u |lse_i|``, ``delta_i = expm1(E_i) + gamma_{S + C_EXP
       + 2 (C_EXP + 1)(n_b - 1)}``.

    16-bit inputs run in float32 and the cast adds ``u_16 |o|``; fully masked rows are exact except
    under ``"uniform"`` (``gamma_{S+1} mean_j |v_j|``).

    Returns:
        ``(out_bound [B, T, N, H_v], lse_bound [B, T, N])``, float64, non-negative (``inf``
        where the model gives no bound).
    """
    qa, ka, va = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    b_size, t, n_heads, h = qa.shape
    s, group = ka.shape[1], n_heads // ka.shape[2]
    full = (b_size, n_heads, t, s)
    allowed = np.broadcast_to(np.asarray(allowed, bool), full)
    bias = None if bias is None else np.broadcast_to(np.asarray(bias, np.float64), full)
    kg, vg = np.repeat(ka, group, axis=2), np.repeat(va, group, axis=2)  # per query head
    sc = 1.0 / math.sqrt(h) if scale is None else float(scale)
    qt, kt = qa.transpose(0, 2, 1, 3), kg.transpose(0, 2, 3, 1)  # [B, N, T, H], [B, N, H, S]
    lg = kernel_logits(qt, kt, sc, softcap, bias, allowed)
    live, l_sum = lg.sm.live, lg.sm.total
    # Normalised where the max is finite (a +inf bias gives inf, not the NaN of inf / inf).
    p = lg.sm.e / np.where(live, l_sum, 1.0)
    vt = vg.transpose(0, 2, 1, 3)  # [B, N, S, H_v]
    o_mag = (p @ np.abs(vt)).transpose(0, 2, 1, 3)  # [B, T, N, H_v]
    with np.errstate(divide="ignore", invalid="ignore"):
        log_l = np.log(np.where(live, l_sum, 1.0))[..., 0]
    live = live[..., 0]
    lse_ref = np.where(live, lg.sm.top[..., 0] + log_l, 0.0)
    n_b = s if key_blocks is None else max(1, int(key_blocks))
    reach = logit_reach(lg, allowed, h, softcap)  # [B, N, T]
    np_dtype = np.dtype(dtype)
    _, units = work_units(np_dtype)
    out_b = lse_b = np.zeros(())
    for u in units:  # the format's share, the oracle's
        _, rho, d_lse = row_terms(reach, h, s, n_b, u)
        d_lse = d_lse + (C_EXP + 1) * u * np.abs(log_l) + u * np.abs(lse_ref)
        out_b = out_b + np.swapaxes(rho + gamma(s, u), 1, 2)[..., None] * o_mag
        lse_b = lse_b + np.swapaxes(np.where(live, d_lse, 0.0), 1, 2)
    dead = np.swapaxes(~live, 1, 2)[..., None] if masked_rows == "uniform" else None
    ref = (p @ vt).transpose(0, 2, 1, 3) if is_16bit(np_dtype) else None
    return _uniform_and_cast(out_b, ref, dead, va, s, units, np_dtype), lse_b


def _uniform_and_cast(
    out: np.ndarray,
    o_ref: np.ndarray | None,
    dead: np.ndarray | None,
    v: np.ndarray,
    s: int,
    units: tuple[float, float],
    fmt: np.dtype[Any],
) -> np.ndarray:
    """The dead rows under ``"uniform"`` (``gamma_{S+1} mean_j |v_j|``, ``v [B, S, K, H_v]``
    read by query heads ``g G .. g G + G - 1``) and a 16-bit output's final rounding ``u_16 (|o|
    + bound)`` (``o_ref`` given)."""
    if dead is not None:
        grp = out.shape[2] // v.shape[2]
        g = sum(gamma(s + 1, u) for u in units)
        out = np.where(dead, g * np.repeat(np.abs(v).mean(axis=1), grp, axis=1)[:, None], out)
        if o_ref is not None:
            o_ref = np.where(dead, np.repeat(v.mean(axis=1), grp, axis=1)[:, None], o_ref)
    if o_ref is not None:
        out = out + unit_roundoff(fmt) * (np.abs(o_ref) + out)
    return out


def kernel_bound_minorant(magnitude: Any, keys: int, dtype: Any) -> np.ndarray:
    """``gamma_S(u) |o|_w``: a componentwise lower bound on :func:`kernel_call_error_bound`'s
    output bound, so that an output within it is within the bound, which then need not be
    computed. ``magnitude = |o|_w = sum_j p_ij w_ij |v_j|`` ``[B, T, N, H_v]`` (the float64
    oracle's, :func:`attnref.oracle.dot_product_attention` with ``return_magnitude``), ``keys =
    S``, ``u`` the unit round-off ``dtype`` computes in (float32's for 16 bits).

    Why it is below: a row with a key has ``(rho_i + gamma_{S'}) |o|_w`` per unit round-off
    (``S' >= S``, ``rho_i >= gamma_{S'}``), so at least ``2 gamma_S(u) |o|_w``: twice the
    minorant, far more than the float64 rounding between two evaluations of ``|o|_w``; a row
    without one is 0 in both, or under ``"uniform"`` ``gamma_{S+1} mean_j |v_j|`` per unit
    against ``gamma_S(u) mean_j |v_j|``; the 16-bit cast term is not negative. Non-finite
    ``magnitude`` (or ``gamma_S = inf``): 0, i.e. exact.

    Returns:
        float64, the shape of ``magnitude``.

    Raises:
        ValueError: ``keys`` not an integer ``>= 0``, a negative ``magnitude`` entry, or
            ``dtype`` not a floating format.
    """
    if isinstance(keys, bool) or not isinstance(keys, (int, np.integer)) or keys < 0:
        raise ValueError(f"keys must be an integer >= 0 (the key length S), got {keys!r}")
    _, (u_work, _) = work_units(dtype)  # the working format's unit round-off
    g = gamma(int(keys), u_work)
    mag = np.asarray(magnitude, np.float64)
    if np.any(mag < 0):
        raise ValueError(
            f"magnitude {mag.shape} must be >= 0 (sum_j p_ij w_ij |v_j|), got a negative entry"
        )
    if not math.isfinite(g):
        return np.zeros(mag.shape)
    return np.where(np.isfinite(mag), g * np.where(np.isfinite(mag), mag, 0.0), 0.0)


@doc(KERNEL, KERNEL_RAISES)
@signed(kernel_call)
def kernel_call_error_bound(
    call: dict[str, Any],
    *,
    dtype: Any = None,
    key_blocks: int | None = None,
    budget: int = 32 << 20,
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`kernel_error_bound` of a kernel call given by its arguments, streamed over query
    blocks (memory ``O(block x N x S)``, never ``O(T x S)``).

    Returns:
        ``(out_bound [B, T, N, H_v], lse_bound [B, T, N])``, float64.
    """
    c = parse(**call)  # then the forward's own blocks
    fmt = np.dtype(np.asarray(call["query"]).dtype if dtype is None else dtype)
    b_size, n_heads, t, s_len = c.shape
    h, h_v = c.q.shape[-1], c.v.shape[-1]
    _, units = work_units(fmt)
    n_b = s_len if key_blocks is None else max(1, int(key_blocks))
    if c.sinks is not None:  # the sink is one more key (zero value, exact logit z_n), merged last
        s_len, n_b = s_len + 1, n_b + 1
    out, lse = np.zeros((b_size, t, n_heads, h_v)), np.zeros((b_size, t, n_heads))
    o_ref = np.zeros_like(out) if is_16bit(fmt) else None
    dead = np.ones((b_size, t, n_heads), bool)
    rows = max(1, query_block(c, 6, budget))
    jobs = []
    for hg in head_groups(c):
        abs_kt, abs_v = np.abs(hg.kt), np.abs(hg.v)
        jobs += [(hg, abs_kt, abs_v, blk) for blk in row_blocks(c, hg.b, rows)]

    def one_block(job: tuple[Any, np.ndarray, np.ndarray, tuple[int, int, int, int]]) -> None:
        hg, abs_kt, abs_v, (i0, i1, j0, j1) = job
        s, ok = logits_block(c, hg, i0, i1, j0, j1)
        live = block_live(ok, s.shape)
        reads = np.broadcast_to(live[..., None], s.shape) if ok is None else ok
        # (H + 1) |scale| |q_i| . |k_j|: logit_reach's M_i times H + 1, the factor on |q|
        q_abs = np.abs(c.q[hg.b, i0:i1, hg.heads]).transpose(1, 0, 2) * ((h + 1) * abs(c.scale))
        mag = (q_abs.reshape(-1, h) @ abs_kt[:, j0:j1]).reshape(s.shape)
        v_blk = abs_v[j0:j1]
        w = None if c.keep is None else dropout_weights(c, hg, i0, i1, j0, j1)
        if c.sinks is not None:  # the sink as one more key: exact logit z_n, value 0, weight 1
            z = np.broadcast_to(c.sinks[hg.heads][:, None, None], (*s.shape[:2], 1))
            s = np.concatenate([s, z], axis=-1)
            mag = np.concatenate([mag, np.zeros_like(z)], axis=-1)
            reads = np.concatenate([reads, np.isfinite(z)], axis=-1)  # a -inf sink is no sink
            v_blk = np.vstack([v_blk, np.zeros(v_blk.shape[1])])
            w = None if w is None else np.concatenate([w, np.ones(z.shape)], axis=-1)
            live = np.asarray(reads.any(axis=-1))
        all_read = ok is None and c.sinks is None  # every (row, key) of the block is read
        top = np.where(live, s.max(axis=-1, initial=-np.inf), 0.0)[..., None]
        with np.errstate(invalid="ignore"):
            gap = top - s  # s_ij's distance below the row max (+inf off the allowed set)
            # |s_ij| + |s_ij - max_j s_ij| (the bias add, the max subtraction), in s's place
            local = np.abs(s, out=s)
            local += gap
            if c.softcap is not None:
                capped = c.softcap * np.tanh(raw_logits(c, hg, i0, i1, j0, j1) / c.softcap)
                if c.sinks is not None:  # the sink is not capped
                    capped = np.concatenate([capped, np.zeros((*capped.shape[:2], 1))], -1)
                local += np.where(reads, (C_EXP + 2) * np.abs(capped), 0.0)
            local += mag
        if not all_read:  # off the allowed set: 0 (inf or NaN above)
            np.copyto(local, 0.0, where=~reads)
        reach = local.max(axis=-1, initial=0.0) / (h + 1)  # logit_reach's M_i
        del local, mag
        e = np.exp(np.negative(gap, out=gap), out=gap)  # exp(s_ij - max_j s_ij), in place
        if not all_read:
            np.copyto(e, 0.0, where=~reads)
        total = e.sum(axis=-1)
        ew = e if w is None else e * w  # dropout: the kept weights, scaled
        flat = (s.shape[0] * s.shape[1], s.shape[2])
        norm = np.where(live, total, 1.0)[..., None]
        # sum_j p_ij |v_j| with p = e / l: the block's products by l once per row, not per pair
        o_mag = (ew.reshape(flat) @ v_blk).reshape(*s.shape[:2], h_v) / norm
        log_l = np.log(np.where(live, total, 1.0))
        lse_ref = top[..., 0] + log_l
        blk_out = np.zeros_like(o_mag)
        blk_lse = np.zeros(s.shape[:2])
        for u in units:  # E_i: one max for both units (logit_reach)
            _, rho, d_lse = row_terms(reach, h, s_len, n_b, u)
            d_lse = d_lse + (C_EXP + 1) * u * np.abs(log_l) + u * np.abs(lse_ref)
            blk_out += (rho + gamma(s_len + (w is not None), u))[..., None] * o_mag  # dropout: +1
            blk_lse += np.where(live, d_lse, 0.0)
        out[hg.b, i0:i1, hg.heads] = blk_out.transpose(1, 0, 2)
        lse[hg.b, i0:i1, hg.heads] = blk_lse.T
        dead[hg.b, i0:i1, hg.heads] = ~live.T
        if o_ref is not None:
            v_ref = hg.v[j0:j1] if c.sinks is None else np.vstack([hg.v[j0:j1], np.zeros(h_v)])
            ref = (ew.reshape(flat) @ v_ref).reshape(*s.shape[:2], h_v) / norm
            o_ref[hg.b, i0:i1, hg.heads] = ref.transpose(1, 0, 2)

    each_block(jobs, one_block)  # disjoint (batch, heads, rows) slices of the outputs
    uniform = dead[..., None] if c.policy == "uniform" and c.sinks is None else None
    return _uniform_and_cast(out, o_ref, uniform, c.v, s_len, units, fmt), lse
