"""The bound of attention computed in pieces whose states are merged (:func:`pieces_error_bound`:
split-KV, ring / striped / zigzag, any scheme merging per-piece states ``(o, lse)``). NumPy only,
float64.

**Why the kernel bound is not enough.** :func:`attnref.tolerance.kernel_call_error_bound` with
``key_blocks=P`` keeps the running max exact, so its ``P`` term does not depend on ``|lse|``; a
merge stores every piece's and partial merge's ``lse`` (off by ``u |lse|`` each), a shift of the
weights below it: ``~ D u Lmax`` after depth ``D`` (``D x 6e-4`` at ``|lse| ~ 1e4`` in float32).

**The composition** (factors: :func:`kernel_call_error_bound`, :func:`merge_error_bound`,
``docs/states.md``). Pieces hold disjoint key sets ``A_p``; piece ``p`` is the call restricted
to ``A_p``, its states stored in ``state_dtype``:

1. Each piece's state is within ``(e_p, lambda_p)``, its kernel bound (``key_blocks`` per piece;
   16-bit states add the cast of ``o_p``, a 16-bit ``lse_p`` ``u_16 (|lse_p| + lambda_p)``). A row
   with no key in ``A_p`` has the empty state.
2. The exact pieces' states merge to the whole call's state, so :func:`merge_error_bound` with
   ``o_error = e_p``, ``lse_error = lambda_p`` bounds the distance from it for ``tree``.
3. The whole call's float64 kernel bound (counting the oracle twice) is added.
4. Rows with no allowed key merge exactly; under ``masked_rows="uniform"`` they get the whole
   call's kernel bound.
5. A 16-bit ``dtype`` with wider states rounds the merged output once: ``+ u_16 (|o| + bound)``.

**Unknown pieces** (``pieces=None``: any partition into at most ``S`` pieces, any tiling, any
tree of depth ``<= depth(tree, S)``) are covered by the merge bound of the one-key states ``(v_j,
s_ij)`` with errors dominating every piece's:

* ``o_error_j = c_i |v_j|``, ``c_i = K_i / sum_j p_ij |v_j|`` (``K_i`` the whole call's kernel
  bound with ``key_blocks=None``, which no piece's exceeds): then ``sum_p pi_p e_p <= sum_j p_ij
  c_i |v_j|`` and ``max_p e_p <= max_j c_i |v_j|``.
* ``lse_error = K^lse_i + sum_u u ((C_EXP + 1) ln S + max_j |s_ij| + ln S)`` (a piece's ``|log
  l_p| <= ln S``, ``|lse_p| <= max_j |s_ij| + ln S``).
* ``V``, ``R`` of the ``v_j`` and ``max_j |s_ij| + ln S`` dominate every partition's statistics,
  and the merge bound is non-decreasing in each.

Memory: the allowed set ``[B, N, T, S]`` and ``P`` (or ``S``) states ``[B, T, N, H_v]``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from attnref.oracle._doc import KERNEL, doc, signed
from attnref.oracle._kernel import dot_product_attention
from attnref.oracle._kernel_call import call_allowed, kernel_call, parse
from attnref.oracle._kernel_fast import head_groups, logits_block

from ._kernel import kernel_call_error_bound
from ._rounding import C_EXP, is_16bit, unit_roundoff, work_units
from ._states import as_dtype, merge_depth, merge_error_bound


def _assignment(pieces: Any, num_pieces: Any, s: int) -> tuple[np.ndarray, int]:
    """``(ids [S], P)``: each key's piece (``-1``: none) and the number of merged states."""
    if isinstance(pieces, (bool, np.bool_)):
        raise TypeError(f"pieces must be an int, an int array [S] or None, got {pieces!r}")
    if isinstance(pieces, (int, np.integer)):
        if num_pieces is not None:
            raise ValueError("num_pieces is only for an array of piece ids (an int is P itself)")
        if pieces < 1:
            raise ValueError(f"pieces must be >= 1, got {pieces}")
        chunk = max(-(-s // int(pieces)), 1)
        return np.arange(s) // chunk, int(pieces)
    ids = np.asarray(pieces)
    if ids.ndim != 1 or ids.shape[0] != s or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(
            f"pieces must be an int or an int array [S] = [{s}] of piece ids, got "
            f"{ids.dtype} array of shape {ids.shape}"
        )
    top = int(ids.max(initial=-1)) + 1
    count = top if num_pieces is None else num_pieces
    if isinstance(count, (bool, np.bool_)) or not isinstance(count, (int, np.integer)):
        raise TypeError(f"num_pieces must be an int, got {num_pieces!r}")
    if (ids < -1).any() or count < top:
        raise ValueError(
            f"piece ids must lie in [-1, num_pieces) = [-1, {count}), got ids in "
            f"[{int(ids.min(initial=0))}, {top - 1}]"
        )
    return ids.astype(np.int64), int(count)


def _logits(c: Any) -> np.ndarray:
    """The call's logits ``[B, N, T, S]`` (capped, biased), ``-inf`` off the allowed set."""
    b_size, n_heads, t, s = c.shape
    out = np.full((b_size, n_heads, t, s), -np.inf)
    for hg in head_groups(c):
        out[hg.b, hg.heads] = logits_block(c, hg, 0, t, 0, s)[0]
    return out


def _piece_states(
    c: Any,
    allowed: np.ndarray,
    ids: np.ndarray,
    count: int,
    state_fmt: np.dtype[Any],
    lse_fmt: np.dtype[Any],
    key_blocks: int | None,
) -> tuple[np.ndarray, ...]:
    """Step 1: per piece (axis 0), the oracle's state of the restricted call and its bound."""
    b_size, n_heads, t, _ = c.shape
    h_v = c.v.shape[-1]
    bias = None if c.bias is None else np.where(allowed, c.bias, 0.0)  # masked: never read
    o = np.zeros((count, b_size, t, n_heads, h_v))
    lse = np.full((count, b_size, t, n_heads), -np.inf)
    e_o, e_l = np.zeros_like(o), np.zeros_like(lse)
    kw: dict[str, Any] = {"scale": c.scale, "softcap": c.softcap}
    for p in range(count):
        cols = np.flatnonzero(ids == p)
        if cols.size == 0:
            continue
        b_cols = None if bias is None else bias[..., cols]
        args = (c.q, c.k[:, cols], c.v[:, cols], b_cols, allowed[..., cols])
        if c.keep is not None:  # each piece drops the weights of its own keys
            kw.update(dropout_mask=c.keep[..., cols], dropout_rate=c.rate)
        o[p], lse[p] = dot_product_attention(*args, return_lse=True, **kw)
        e_o[p], e_l[p] = kernel_call_error_bound(
            *args, dtype=state_fmt, key_blocks=key_blocks, **kw
        )
    if is_16bit(lse_fmt):  # each piece's lse stored in 16 bits
        live = np.isfinite(lse)
        e_l = e_l + unit_roundoff(lse_fmt) * (np.abs(np.where(live, lse, 0.0)) + e_l)
    # inf x 0 in the kernel bound: every attended value is 0, so the output is exactly 0
    return o, lse, np.where(np.isnan(e_o), 0.0, e_o), e_l


def _key_states(
    c: Any, call: dict[str, Any], work: np.dtype[Any], state_fmt: np.dtype[Any], lse_fmt: Any
) -> tuple[np.ndarray, ...]:
    """Unknown pieces (module docstring): the one-key states and their dominating errors."""
    b_size, n_heads, t, s = c.shape
    k_out, k_lse = kernel_call_error_bound(**call, dtype=work, key_blocks=None)
    absolute = {"query": c.q, "key": c.k, "value": np.abs(c.v), "masked_rows": "zeros"}
    mag = dot_product_attention(**{**call, **absolute})  # sum_j p_ij |v_j|
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(mag > 0, k_out / np.where(mag > 0, mag, 1.0), 0.0)
    factor = ratio.max(axis=-1, keepdims=True, initial=0.0)  # c_i, [B, T, N, 1]
    if is_16bit(state_fmt):  # each piece's o stored in 16 bits
        factor = (1.0 + unit_roundoff(state_fmt)) * factor + unit_roundoff(state_fmt)
    vg = np.repeat(c.v, c.group, axis=2)  # [B, S, N, H_v]
    o = np.broadcast_to(vg.transpose(1, 0, 2, 3)[:, :, None], (s, b_size, t, n_heads, vg.shape[-1]))
    logits = _logits(c)
    lse = logits.transpose(3, 0, 2, 1)  # [S, B, T, N]
    live = np.isfinite(logits)
    top = np.where(live, np.abs(np.where(live, logits, 0.0)), 0.0).max(axis=-1, initial=0.0)
    top = top.transpose(0, 2, 1)  # max_j |s_ij| over allowed keys, [B, T, N]
    ln_s = math.log(max(s, 1))
    units = unit_roundoff(work) + unit_roundoff(np.float64)
    lam = k_lse + units * ((C_EXP + 1) * ln_s + top + ln_s)
    if is_16bit(lse_fmt):
        lam = lam + unit_roundoff(lse_fmt) * (top + ln_s + lam)
    e_o = factor[None] * np.abs(o)
    return o, lse, e_o, np.broadcast_to(lam, lse.shape)


@doc(
    KERNEL,
    pieces="An int ``P`` (contiguous chunks of ``ceil(S / P)`` keys, as split-KV and a contiguous "
    "ring), an int array ``[S]`` of piece ids (``-1``: in no piece, attended by no query), or "
    "``None``: unknown (any partition and tiling, module docstring).",
    num_pieces="With an array of ids, the number of states merged (default ``max id + 1``).",
    tree='``"sequential"`` (default: depth ``P - 1``, every binary order, a ring), ``"balanced"``, '
    '``"stack"`` (split-KV) or an int depth (:func:`attnref.tolerance.merge_depth`).',
    dtype="The format of the inputs and the output; ``None`` (default) is ``query``'s.",
    state_dtype="The format of the pieces' stored ``o``; ``None`` (default): the compute format "
    "(float32 for 16-bit inputs), the output then rounded once to ``dtype``.",
    lse_dtype="The stored ``lse``'s format; ``None``: float32 for 16-bit states, else "
    "``state_dtype``.",
    masked_rows='``"zeros"`` (default), ``"uniform"`` or ``"nan"``: the whole call\'s policy.',
    key_blocks="Key blocks of each piece's online softmax; ``None`` (default, and with "
    "``pieces=None``): any tiling.",
)
@signed(kernel_call, front=("pieces", "num_pieces", "tree", "dtype", "state_dtype", "lse_dtype"))
def pieces_error_bound(
    call: dict[str, Any],
    *,
    pieces: Any,
    num_pieces: int | None = None,
    tree: str | int = "sequential",
    dtype: Any = None,
    state_dtype: Any = None,
    lse_dtype: Any = None,
    key_blocks: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Componentwise bounds on ``|o - o_oracle|`` and ``|lse - lse_oracle|`` of attention
    computed in pieces (each by a kernel, the states merged by ``tree``) against the float64
    oracle of the whole call. Derivation: module docstring.

    Returns:
        ``(out_bound [B, T, N, H_v], lse_bound [B, T, N])``, float64, non-negative.

    Raises:
        ValueError: For the arguments :func:`attnref.oracle.dot_product_attention` refuses with
            ``ValueError``; bad ``pieces``/``num_pieces``; an attended key in no piece; a bad
            ``tree`` (:func:`attnref.tolerance.merge_depth`); ``key_blocks`` with
            ``pieces=None``.
        TypeError: For those it refuses with ``TypeError``; ``pieces`` a bool; ``tree``
            neither a string nor an int.
    """
    c = parse(**call)
    fmt = as_dtype(np.asarray(call["query"]).dtype if dtype is None else dtype)
    work, _ = work_units(fmt)
    state_fmt = work if state_dtype is None else as_dtype(state_dtype)
    lse_fmt = work_units(state_fmt)[0] if lse_dtype is None else as_dtype(lse_dtype)
    s = c.shape[3]
    allowed = call_allowed(c)
    if pieces is None:
        if key_blocks is not None:
            raise ValueError("key_blocks needs known pieces (pieces=None assumes any tiling)")
        merge_depth(tree, s)
        o, lse, e_o, e_l = _key_states(c, call, work, state_fmt, lse_fmt)
    else:
        ids, count = _assignment(pieces, num_pieces, s)
        merge_depth(tree, count)
        orphan = ids < 0
        if (allowed & orphan).any():
            j = int(np.flatnonzero((allowed & orphan).any(axis=(0, 1, 2)))[0])
            raise ValueError(f"key {j} is in no piece (id -1) but some query may attend it")
        o, lse, e_o, e_l = _piece_states(c, allowed, ids, count, state_fmt, lse_fmt, key_blocks)
    if c.sinks is not None:
        # The sink: one exact state (0, z_n), merged once after the pieces' merge. Any order of
        # the P + 1 states is covered by the sequential tree (depth P, the deepest).
        z = np.broadcast_to(c.sinks, lse.shape[1:])[None]
        o, e_o = (np.concatenate([a, np.zeros_like(a[:1])]) for a in (o, e_o))
        lse, e_l = np.concatenate([lse, z]), np.concatenate([e_l, np.zeros_like(z)])
        tree = "sequential"
    out_b, lse_b = merge_error_bound(
        o, lse, axis=0, dtype=state_fmt, lse_dtype=lse_fmt, tree=tree, o_error=e_o, lse_error=e_l
    )
    whole64 = kernel_call_error_bound(**call, dtype=np.float64, key_blocks=1)
    out_b, lse_b = out_b + whole64[0], lse_b + whole64[1]
    if call["masked_rows"] == "uniform" and c.sinks is None:
        dead = np.transpose(~np.any(allowed, axis=-1), (0, 2, 1))  # [B, T, N]
        whole = kernel_call_error_bound(**call, dtype=state_fmt, key_blocks=None)[0]
        out_b = np.where(dead[..., None], whole + whole64[0], out_b)
    if unit_roundoff(fmt) > unit_roundoff(state_fmt):  # the output rounded once to dtype
        ref = np.nan_to_num(dot_product_attention(**call))
        out_b = out_b + unit_roundoff(fmt) * (np.abs(ref) + out_b)
    return out_b, lse_b
