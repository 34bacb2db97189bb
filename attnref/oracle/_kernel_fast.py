"""The fast float64 kernel oracle: ``dot_product_attention`` with float64 BLAS over blocks of
query rows, with the semantics of the element-wise definition (:mod:`attnref.oracle._kernel`).

For batch ``b``, key/value head ``g`` (query heads ``g G .. g G + G - 1``) and a block of query
rows, with ``A`` the allowed pairs (:func:`attnref.oracle._kernel_call.allowed_rows`)::

    X = scale Q K^T              [G, rows, S']   (S' = the keys the block can reach)
    S = c tanh(X / c) + bias     (softcap, then bias; each when given)
    S = -inf where not A         (so a masked NaN or inf never reaches a live row)
    m = max_j S,  E = exp(S - m),  [E V, l] = E [V, 1],  O = (E V) / l,  lse = m + log l

Two savings change only the rounding: where Cauchy-Schwarz keeps every logit in ``(-700,
700)``, ``m = 0`` and the keys are summed in chunks; and only keys some row may not read are
masked (for causal attention, the diagonal band). Extra memory ``O(G x rows x S)`` (64 MiB
budget). NumPy only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np

from ._kernel_call import KernelCall, allowed_rows, full_columns, key_range, query_block
from ._threads import each_block


def _weighted_values(
    e: np.ndarray, v: np.ndarray, ok: np.ndarray | None, vt: np.ndarray | None = None
) -> np.ndarray:
    """``sum_j e_ij v_j`` over the allowed keys only (a non-finite ``v_j`` reaches only the rows
    that may read it); ``vt`` (``v^T``, when ``v`` is finite) runs the GEMM as ``(v^T e^T)^T``."""
    if vt is not None:
        return (vt @ e.T).T
    bad = ~np.isfinite(v)
    out = e @ (np.where(bad, 0.0, v) if bad.any() else v)
    for j, h in zip(*np.nonzero(bad), strict=True):
        reads = np.ones(e.shape[0], bool) if ok is None else ok[:, j]
        out[reads, h] += e[reads, j] * v[j, h]
    return out


@dataclasses.dataclass(frozen=True)
class HeadGroup:
    """Contiguous copies for batch ``b`` and key/value head ``g`` (BLAS reads them at full
    speed): ``kt = K^T [H, S]``, ``v [S, H_v]``, and the query heads ``g G .. g G + G - 1``."""

    b: int
    g: int
    kt: np.ndarray
    v: np.ndarray
    heads: slice


def head_group(c: KernelCall, b: int, g: int) -> HeadGroup:
    """Batch ``b``'s key/value head ``g`` as a :class:`HeadGroup`."""
    kt, v = np.ascontiguousarray(c.k[b, :, g].T), np.ascontiguousarray(c.v[b, :, g])
    return HeadGroup(b, g, kt, v, slice(g * c.group, (g + 1) * c.group))


def group_index(c: KernelCall) -> list[tuple[int, int]]:
    """Every (batch, key/value head) pair of the call."""
    return [(b, g) for b in range(c.shape[0]) for g in range(c.k.shape[2])]


def head_groups(c: KernelCall) -> Iterator[HeadGroup]:
    """Every (batch, key/value head) pair of the call, with contiguous ``K^T`` and ``V``."""
    return (head_group(c, b, g) for b, g in group_index(c))


def raw_logits(c: KernelCall, hg: HeadGroup, i0: int, i1: int, j0: int, j1: int) -> np.ndarray:
    """``X = scale Q K^T`` of one block, ``[G, rows, S']``."""
    # a new array (never scale the caller's q in place), [G, rows, H]
    q = np.multiply(c.q[hg.b, i0:i1, hg.heads].transpose(1, 0, 2), c.scale, order="C")
    g, rows, h = q.shape
    # one 2-D GEMM (NumPy's stacked matmul can leave BLAS for small blocks)
    return (q.reshape(g * rows, h) @ hg.kt[:, j0:j1]).reshape(g, rows, j1 - j0)


def capped_logits(c: KernelCall, hg: HeadGroup, i0: int, i1: int, j0: int, j1: int) -> np.ndarray:
    """``S = c tanh(X / c) + bias`` of one block (softcap, then bias; each when given)."""
    s = raw_logits(c, hg, i0, i1, j0, j1)
    if c.softcap is not None:
        np.tanh(s / c.softcap, out=s)
        s *= c.softcap
    if c.bias is not None:
        s += c.bias[hg.b, hg.heads, i0:i1, j0:j1]
    return s


def logits_block(
    c: KernelCall, hg: HeadGroup, i0: int, i1: int, j0: int, j1: int
) -> tuple[np.ndarray, np.ndarray | None]:
    """Capped, biased logits ``[G, rows, S']`` of one block (``-inf`` off the allowed set) and the
    allowed set (``None``: all allowed)."""
    s = capped_logits(c, hg, i0, i1, j0, j1)
    ok = allowed_rows(c, hg.b, hg.heads, i0, i1, j0, j1)
    if ok is not None:
        np.copyto(s, -np.inf, where=~ok)
    return s, ok


def row_blocks(c: KernelCall, b: int, rows: int) -> Iterator[tuple[int, int, int, int]]:
    """Query blocks ``[i0, i1)`` of batch ``b`` (its ``T_b`` rows) with their key range
    ``[j0, j1)``."""
    t_b = int(c.q_len[b])
    for i0 in range(0, t_b, rows):
        i1 = min(i0 + rows, t_b)
        j0, j1 = key_range(c, b, i0, i1)
        yield i0, i1, j0, max(j0, j1)


# |max_j s_ij| below this: exp(s_ij) neither overflows nor underflows its largest term (e^700 and
# e^-700 are normal float64 numbers), so the softmax needs no shift.
_NO_SHIFT = 700.0


def softmax_block(s: np.ndarray, live: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """In place ``s <- exp(s - m)``; returns ``(s, m)``, ``m`` the row max, or 0 where every max
    lies in ``(-700, 700)`` (the ratio does not depend on ``m``) and in rows without a key."""
    top = np.where(live, s.max(axis=-1, initial=-np.inf), 0.0)
    if np.all(np.abs(top) < _NO_SHIFT):  # False for a NaN or infinite max
        top = np.zeros_like(top)
    else:
        s -= top[..., None]
    np.exp(s, out=s)
    return s, top


def block_live(ok: np.ndarray | None, shape: tuple[int, ...]) -> np.ndarray:
    """Rows ``[G, rows]`` of a logits block ``shape = (G, rows, S')`` with an allowed key."""
    return np.full(shape[:-1], shape[-1] > 0) if ok is None else np.asarray(ok.any(axis=-1))


def _shift_free(c: KernelCall, hg: HeadGroup, q_norm: np.ndarray) -> bool:
    """Whether every logit of the head group lies in ``(-700, 700)`` (Cauchy-Schwarz)."""
    top = (
        abs(c.scale)
        * float(q_norm.max(initial=0.0))
        * float(np.sqrt((hg.kt * hg.kt).sum(axis=0)).max(initial=0.0))
    )
    if c.softcap is not None:
        top = min(top, c.softcap)
    if c.bias is not None:  # max |b| over the finite entries (0 if none), by reductions only
        bias = c.bias[hg.b, hg.heads]
        hi, lo = float(bias.max(initial=-np.inf)), float(bias.min(initial=np.inf))
        if not hi < np.inf:
            return False  # a NaN or +inf logit: the shifted path gives the definition's NaN
        if lo == -np.inf:
            lo = float(np.min(bias, where=bias > -np.inf, initial=0.0))
        top += max(0.0, hi, -lo)
    return bool(np.isfinite(top) and top < _NO_SHIFT)


def _forward_block(
    c: KernelCall, hg: HeadGroup, i0: int, i1: int, j0: int, j1: int, finite_v: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """``(e, shift, live, ok)`` of a block that may need a shift: ``e = exp(s - shift)``, 0 off
    the allowed set (``ok``: only where a non-finite value needs it, else ``None``)."""
    s = capped_logits(c, hg, i0, i1, j0, j1)
    jp = full_columns(c, hg.b, i0, i1, j0, j1)
    tail = allowed_rows(c, hg.b, hg.heads, i0, i1, jp, j1)
    if tail is not None:
        np.copyto(s[..., jp - j0 :], -np.inf, where=~tail)
    live = np.ones(s.shape[:-1], bool) if jp > j0 else block_live(tail, s.shape)
    s, shift = softmax_block(s, live)
    ok = None
    if tail is not None and not finite_v:
        ok = np.concatenate([np.ones((*s.shape[:-1], jp - j0), bool), tail], axis=-1)
    return s, shift, live, ok


def _shift_free_block(
    c: KernelCall, hg: HeadGroup, i0: int, i1: int, j0: int, j1: int, v1t: np.ndarray, chunk: int
) -> tuple[np.ndarray, np.ndarray]:
    """``([V, 1]^T exp(S)^T)^T`` and the live rows of a block that needs no shift, summed over
    key chunks of ``chunk`` columns (unshifted partial sums simply add)."""
    grp, rows = c.group, i1 - i0
    jp = full_columns(c, hg.b, i0, i1, j0, j1)
    acc = np.zeros((v1t.shape[0], grp * rows))
    live = np.zeros((grp, rows), bool)
    for a in range(j0, j1, chunk):
        z = min(a + chunk, j1)
        s = capped_logits(c, hg, i0, i1, a, z)
        if a < jp:
            live[:] = True
        if z > jp:
            m = max(a, jp)
            tail = allowed_rows(c, hg.b, hg.heads, i0, i1, m, z)
            if tail is None:
                live[:] = True
            else:
                np.copyto(s[..., m - a :], -np.inf, where=~tail)
                live |= tail.any(axis=-1)
        np.exp(s, out=s)
        acc += v1t[:, a:z] @ s.reshape(grp * rows, z - a).T
    return acc.T, live


def forward(c: KernelCall, magnitude: bool = False) -> tuple[np.ndarray, ...]:
    """``(o [B, T, N, H_v], lse [B, T, N])`` of a validated call, streamed over query blocks;
    with ``magnitude`` also ``sum_j p_ij |v_j| [B, T, N, H_v]`` (the same GEMM, ``[V, 1, |V|]``
    in place of ``[V, 1]``)."""
    b_size, n_heads, t, _ = c.shape
    grp, h_v = c.group, c.v.shape[-1]
    out = np.zeros((b_size, t, n_heads, h_v))
    lse = np.full((b_size, t, n_heads), -np.inf)
    mag = np.zeros_like(out) if magnitude else None
    rows = min(max(1, 256 // grp), query_block(c, 2))
    key_chunk = max(1, (8 << 20) // (8 * grp * rows))  # 8 MiB of logits per chunk (measured)
    q_norm = np.sqrt((c.q * c.q).sum(axis=-1))  # [B, T, N]
    groups = group_index(c)
    Job = tuple[HeadGroup, np.ndarray, np.ndarray | None, bool, tuple[int, ...]]
    plans: list[list[Job]] = [[] for _ in groups]

    def plan(i: int) -> None:  # a head group's copies and checks (on the pool), its blocks
        hg = head_group(c, *groups[i])
        # [V, 1] (one GEMM gives the weighted values and the row sum), [V, 1, |V|] for magnitude
        ones = np.ones((hg.v.shape[0], 1))
        v1 = np.concatenate([hg.v, ones] + ([] if mag is None else [np.abs(hg.v)]), axis=1)
        finite = bool(np.isfinite(hg.v).all())
        v1t = np.ascontiguousarray(v1.T) if finite else None
        shift_free = finite and c.keep is None and _shift_free(c, hg, q_norm[hg.b, :, hg.heads])
        plans[i] = [(hg, v1, v1t, shift_free, blk) for blk in row_blocks(c, hg.b, rows)]

    each_block(range(len(groups)), plan)
    jobs = [job for jobs_of_group in plans for job in jobs_of_group]
    # largest blocks first, so the workers finish together (causal blocks grow with the row)
    jobs.sort(key=lambda job: -(job[4][1] - job[4][0]) * (job[4][3] - job[4][2]))

    def one_block(job: Job) -> None:
        hg, v1, v1t, shift_free, (i0, i1, j0, j1) = job
        if shift_free and v1t is not None:
            o1, live = _shift_free_block(c, hg, i0, i1, j0, j1, v1t, key_chunk)
            top = np.zeros(live.shape)
        else:
            e, top, live, ok = _forward_block(c, hg, i0, i1, j0, j1, v1t is not None)
            flat = (grp * (i1 - i0), j1 - j0)
            flat_ok = None if ok is None else ok.reshape(flat)
            vt = None if v1t is None else v1t[:, j0:j1]
            if c.keep is None:
                o1 = _weighted_values(e.reshape(flat), v1[j0:j1], flat_ok, vt)
            else:  # dropout: the kept weights scaled in the numerator, e in the sum
                w = dropout_weights(c, hg, i0, i1, j0, j1) * e
                o_num = _weighted_values(w.reshape(flat), np.delete(v1[j0:j1], h_v, 1), flat_ok)
                o1 = np.insert(o_num, h_v, e.reshape(flat).sum(axis=-1), axis=1)
        o1 = o1.reshape(grp, i1 - i0, -1)
        total = o1[..., h_v : h_v + 1]
        with np.errstate(divide="ignore", invalid="ignore"):
            o = o1[..., :h_v] / total
            ls = top + np.log(total[..., 0])
            o_mag = None if mag is None else o1[..., h_v + 1 :] / total
        if not live.all():
            o = np.where(live[..., None], o, 0.0)
            ls = np.where(live, ls, -np.inf)
            o_mag = None if o_mag is None else np.where(live[..., None], o_mag, 0.0)
        out[hg.b, i0:i1, hg.heads] = o.transpose(1, 0, 2)
        lse[hg.b, i0:i1, hg.heads] = ls.T
        if mag is not None and o_mag is not None:
            mag[hg.b, i0:i1, hg.heads] = o_mag.transpose(1, 0, 2)
        if live.all() or c.sinks is not None or c.policy == "zeros":
            return  # with sinks a row with no key is 0, lse = z_n (with_sinks)
        nan = c.policy == "nan"
        for n, r in zip(*np.nonzero(~live), strict=True):  # no allowed key: by masked_rows
            at = (hg.b, i0 + r, hg.g * grp + n)
            out[at] = np.nan if nan else c.v[hg.b, :, hg.g].mean(axis=0)
            if mag is not None:
                mag[at] = np.nan if nan else np.abs(c.v[hg.b, :, hg.g]).mean(axis=0)

    each_block(jobs, one_block)  # disjoint (batch, heads, rows) slices of out and lse
    if c.sinks is not None:
        scaled = with_sinks(c, out, lse)
        if mag is not None:  # p_ij / (1 + e^(z - lse)): the same factor as out's
            mag = with_sinks(c, mag, lse)[0]
        out, lse = scaled
    return (out, lse) if mag is None else (out, lse, mag)


def dropout_weights(c: KernelCall, hg: HeadGroup, i0: int, i1: int, j0: int, j1: int) -> np.ndarray:
    """``keep_ij / (1 - p)`` of one block, ``[G, rows, S']``."""
    assert c.keep is not None and c.rate is not None
    return np.where(c.keep[hg.b, hg.heads, i0:i1, j0:j1], 1.0 / (1.0 - c.rate), 0.0)


def with_sinks(c: KernelCall, out: np.ndarray, lse: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The sinks ``z [N]`` joined to the rows ``i < T_b`` of finished ``(out, lse)`` (rows with no
    key: ``out = 0``): ``lse' = log(e^lse + e^z)``, ``out' = out e^(lse - lse')``; a NaN or
    ``+inf`` sink gives NaN (as the definition's ``e^(z - max)`` does)."""
    assert c.sinks is not None
    z = c.sinks  # [N]
    real = (np.arange(out.shape[1])[None, :] < c.q_len[:, None])[..., None]  # [B, T, 1]
    with np.errstate(invalid="ignore"):
        new = np.logaddexp(lse, z)
        w = np.where(np.isneginf(new), 0.0, np.exp(lse - np.where(np.isneginf(new), 0.0, new)))
    w = np.where(np.isposinf(z) | np.isnan(z), np.nan, w)
    new = np.where(np.isposinf(z), np.nan, new)
    return np.where(real[..., None], out * w[..., None], out), np.where(real, new, lse)
