"""Kernel-level attention ``(q, k, v) -> o`` with the layout of ``jax.nn.dot_product_attention``.

Shapes: ``query [B, T, N, H]``, ``key [B, S, K, H]``, ``value [B, S, K, H_v]``; ``N`` query heads,
``K`` key/value heads with ``N % K == 0``: query head ``n`` reads key/value head ``n // (N // K)``
(consecutive query heads share a K/V head, as in every anchor: GQA, Ainslie et al. 2023; MQA,
Shazeer 2019). Output ``[B, T, N, H_v]``; ``lse [B, T, N]``.

For batch ``b``, head ``n`` and query ``i`` (row convention)::

    s_ij = scale * q_i . k_j                       scale defaults to 1/sqrt(H)
    s_ij = c * tanh(s_ij / c)                      if softcap = c is given
    s_ij = s_ij + bias_ij
    o_i  = sum_{j allowed} softmax_j(s_ij) v_j,    lse_i = log sum_{j allowed} exp(s_ij)

Key ``j`` is *allowed* for query ``i`` when every given condition holds: ``mask`` is True, the
bias is not ``-inf``, ``i < query_seq_lengths[b]``, ``j < key_value_seq_lengths[b]``,
``segment_ids`` agree, and, with query ``i`` placed at key position ``p_i = i + offset``,
``j <= p_i`` (``is_causal``) and ``p_i - left <= j <= p_i + right`` (``local_window_size``).
``causal_alignment="top_left"`` (default; jax.nn, PyTorch SDPA) uses ``offset = 0``;
``"bottom_right"`` (FlashAttention) uses ``offset = S_b - T_b`` with the actual lengths, so the last
query sits on the last key.

A query row with no allowed key is *fully masked*. ``masked_rows`` says what it returns:
``"zeros"`` (default, attnref's meaning everywhere), ``"uniform"`` (the mean of ``v`` over all ``S``
keys, what jax.nn and Flax give because they mask with a large finite negative), or ``"nan"``
(xformers, the Pallas GPU reference). Its ``lse`` is ``-inf`` under every policy. Query rows at or
beyond ``query_seq_lengths[b]`` are padding: output 0 and ``lse = -inf`` under every policy (as
jax.nn).

A key, value or bias entry that query ``i`` may not attend to never influences row ``i``'s
output or gradients, whatever it holds (NaN, inf): every product runs on the finite parts of
the operands, and a row that does read a non-finite value (its own query, an allowed key, value
or bias entry) is NaN, with NaN ``lse`` and no gradient (``attnref._src.core.nonfinite``).
``masked_rows="uniform"`` reads every ``v`` row by definition.

16-bit inputs are computed with float32 logits, softmax and accumulation (as jax.nn and
FlashAttention do) and the output is cast back; float64 inputs are computed in float64.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Literal, no_type_check

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Float, Int

from attnref._src.core.checked import require
from attnref._src.core.checks import (
    HIGHEST,
    check_mask_and_bias,
    check_scale,
    dtype_of,
    float64_scoped,
    is_traced,
    shape_of,
)
from attnref._src.core.checks import real_dtype as _real_dtype
from attnref._src.core.common import scale_value
from attnref._src.core.nonfinite import finite_bias, finite_part, nonfinite_rows, poison_rows

MaskedRows = Literal["zeros", "uniform", "nan"]
Alignment = Literal["top_left", "bottom_right"]
# The accepted values of masked_rows and causal_alignment: the one copy (prepare, alibi_bias,
# the conformance kit and its CLI read these).
MASKED_ROWS_POLICIES = ("zeros", "uniform", "nan")
CAUSAL_ALIGNMENTS = ("top_left", "bottom_right")
# Keyword options that change the computation's structure: static under jax.jit.
STATIC_OPTIONS = (
    "scale",
    "is_causal",
    "local_window_size",
    "softcap",
    "causal_alignment",
    "masked_rows",
    "return_lse",
)


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """Static description of one kernel call: shapes, dtypes and the static options."""

    b: int
    t: int
    s: int
    n: int
    k: int
    h: int
    h_v: int
    dtype: Any
    compute_dtype: Any
    is_causal: bool
    window: tuple[int | None, int | None] | None
    alignment: str
    softcap: float | None
    masked_rows: str

    @property
    def group(self) -> int:
        return self.n // self.k


# @no_type_check: no runtime check of the fields (the suite's jaxtyping hook), since JAX rebuilds
# a pytree with any leaves (tree_map results, vmap axes, placeholders: the blockwise
# kernel's custom_vjp passes object()).
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
@no_type_check
class KernelInputs:
    """Validated arrays of one call (``None`` where an option is not given)."""

    q: Array
    k: Array
    v: Array
    bias: Array | None  # rank 4, broadcastable to [B, N, T, S], compute dtype
    mask: Array | None  # rank 4, broadcastable to [B, N, T, S]
    q_lens: Array | None  # [B] int32
    kv_lens: Array | None  # [B] int32
    q_seg: Array | None  # [B, T] int32
    kv_seg: Array | None  # [B, S] int32
    scale: Array  # scalar, compute dtype


def _window(local_window_size: Any) -> tuple[int | None, int | None] | None:
    """``None``, ``w`` or ``(left, right)`` (ints >= 0, ``None`` = unbounded side); bools and
    floats are refused (``TypeError``), a pair of the wrong length or a negative side too
    (``ValueError``)."""
    if local_window_size is None:
        return None
    if isinstance(local_window_size, (int, np.integer)) and not isinstance(
        local_window_size, (bool, np.bool_)
    ):
        pair: tuple[Any, Any] = (local_window_size, local_window_size)
    elif isinstance(local_window_size, (tuple, list)):
        if len(local_window_size) != 2:
            raise ValueError(
                "local_window_size must be an int or a (left, right) pair (None = unbounded), "
                f"got {local_window_size!r}"
            )
        pair = (local_window_size[0], local_window_size[1])
    else:
        raise TypeError(
            "local_window_size must be an int or a (left, right) pair of ints (None = "
            f"unbounded), got {local_window_size!r}"
        )
    out: list[int | None] = []
    for side, w in zip(("left", "right"), pair, strict=True):
        if w is None:
            out.append(None)
            continue
        if not isinstance(w, (int, np.integer)) or isinstance(w, (bool, np.bool_)):
            raise TypeError(f"local_window_size {side} must be an int or None, got {w!r}")
        if w < 0:
            raise ValueError(
                f"local_window_size {side} = {w} is negative; a query at position p attends to "
                "keys in [p - left, p + right], so both sides must be >= 0"
            )
        out.append(int(w))
    return (out[0], out[1])


def _check_ints(name: str, x: Any, shape: tuple[int, ...], upper: int | None) -> Array | None:
    """An integer array (or list) of exactly ``shape``; when concrete, every entry in
    ``[0, upper]`` (``upper=None``: no range). Returned as int32, ``None`` passes through."""
    if x is None:
        return None
    if shape_of(x) != shape:
        raise ValueError(f"{name} has shape {shape_of(x)}; expected {shape}")
    dt = dtype_of(x)
    if not np.issubdtype(dt, np.integer):
        raise TypeError(f"{name} must be integer, got dtype {dt}")
    if upper is not None and not is_traced(x):
        arr = np.asarray(x)
        if arr.size and (arr.min() < 0 or arr.max() > upper):
            raise ValueError(
                f"{name} = {arr.tolist()} is out of range; every length must lie in [0, {upper}]"
            )
    return jnp.asarray(x, dtype=jnp.int32)


def compute_dtype(dtype: Any) -> Any:
    """float32 for 16-bit inputs, the input dtype otherwise."""
    return jnp.promote_types(dtype, jnp.float32)


def prepare(
    query: Any,
    key: Any,
    value: Any,
    bias: Any,
    mask: Any,
    *,
    scale: Any,
    is_causal: bool,
    query_seq_lengths: Any,
    key_value_seq_lengths: Any,
    local_window_size: Any,
    segment_ids: Any,
    softcap: Any,
    causal_alignment: str,
    masked_rows: str,
) -> tuple[KernelSpec, KernelInputs]:
    """Validate a kernel call at trace time; every error names the argument and its shape.

    Array-likes without a dtype (nested lists) are converted with ``jnp.asarray`` first. Empty
    inputs: ``T = 0`` gives an empty output; ``S = 0`` leaves every query row fully masked, so
    ``masked_rows`` decides (``"uniform"``, a mean over zero keys, is refused); ``H = 0`` is
    refused (the default scale ``1/sqrt(H)`` is undefined). ``attnref.oracle`` refuses the same
    inputs with the same exception types.
    """
    query, key, value = (
        x if hasattr(x, "dtype") and hasattr(x, "shape") else jnp.asarray(x)
        for x in (query, key, value)
    )
    for name, x in (("query", query), ("key", key), ("value", value)):
        if np.ndim(x) != 4:
            layout = "[B, T, N, H]" if name == "query" else "[B, S, K, H]"
            raise ValueError(f"{name} must have rank 4 ({layout}), got shape {shape_of(x)}")
    b, t, n, h = shape_of(query)
    bk, s, kh, hk = shape_of(key)
    bv, sv, kv, h_v = shape_of(value)
    if bk != b or bv != b:
        raise ValueError(
            f"batch sizes differ: query {shape_of(query)}, key {shape_of(key)}, value {shape_of(value)}"
        )
    if hk != h:
        raise ValueError(
            f"key has head dim {hk} (shape {shape_of(key)}) but query has {h} (shape {shape_of(query)})"
        )
    if (sv, kv) != (s, kh):
        raise ValueError(
            f"value has shape {shape_of(value)}; expected [B, S={s}, K={kh}, H_v] to "
            f"match key {shape_of(key)}"
        )
    if kh < 1:
        raise ValueError(
            f"key has K=0 heads (shape {shape_of(key)}); it needs at least one K/V head"
        )
    if n < 1 or n % kh:
        raise ValueError(
            f"query has N={n} heads (shape {shape_of(query)}) and key has K={kh} "
            f"(shape {shape_of(key)}); N must be a positive multiple of K for GQA/MQA"
        )
    if h < 1:
        raise ValueError(
            f"query has head dim H=0 (shape {shape_of(query)}); H must be >= 1 (the default scale "
            "1/sqrt(H) is undefined at 0)"
        )
    dtypes = {nm: dtype_of(x) for nm, x in (("query", query), ("key", key), ("value", value))}
    if not jnp.issubdtype(dtypes["query"], jnp.floating):
        raise TypeError(f"query must be floating, got dtype {dtypes['query']}")
    if len(set(dtypes.values())) != 1:
        raise TypeError(f"query, key and value must share one dtype, got {dtypes}; cast explicitly")
    if not isinstance(masked_rows, str) or masked_rows not in MASKED_ROWS_POLICIES:
        raise ValueError(f"masked_rows must be one of {MASKED_ROWS_POLICIES}, got {masked_rows!r}")
    if not isinstance(causal_alignment, str) or causal_alignment not in CAUSAL_ALIGNMENTS:
        raise ValueError(
            f"causal_alignment must be one of {CAUSAL_ALIGNMENTS}, got {causal_alignment!r}"
        )
    if not isinstance(is_causal, (bool, np.bool_)):
        raise TypeError(f"is_causal must be a bool, got {is_causal!r}")
    check_scale(scale)
    cap: float | None = None
    if softcap is not None:
        ok = (
            not isinstance(softcap, (str, bytes, bool, np.bool_))
            and np.ndim(softcap) == 0
            and not is_traced(softcap)
            and _real_dtype(dtype_of(softcap))
        )
        cap = float(softcap) if ok else None
        if cap is None or not (math.isfinite(cap) and cap > 0):
            raise ValueError(f"softcap must be a positive finite Python number, got {softcap!r}")
    target = (b, n, t, s)
    for name, arr in (("bias", bias), ("mask", mask)):
        if arr is not None and np.ndim(arr) != 4:
            raise ValueError(
                f"{name} must have rank 4 broadcastable to [B, N, T, S] = {target}, got shape "
                f"{shape_of(arr)}"
            )
    check_mask_and_bias(mask, bias, target, axes="[B, N, T, S]")
    q_lens = _check_ints("query_seq_lengths", query_seq_lengths, (b,), t)
    kv_lens = _check_ints("key_value_seq_lengths", key_value_seq_lengths, (b,), s)
    q_seg = kv_seg = None
    if segment_ids is not None:
        if isinstance(segment_ids, (tuple, list)):
            if len(segment_ids) != 2:
                raise ValueError(
                    "segment_ids must be one [B, T] array (T == S) or a pair "
                    "(query_segment_ids [B, T], key_value_segment_ids [B, S])"
                )
            q_seg_in, kv_seg_in = segment_ids
        else:
            if t != s:
                raise ValueError(
                    f"a single segment_ids array needs T == S, got T={t}, S={s}; "
                    "pass (query_segment_ids, key_value_segment_ids)"
                )
            q_seg_in = kv_seg_in = segment_ids
        q_seg = _check_ints("query_segment_ids", q_seg_in, (b, t), None)
        kv_seg = _check_ints("key_value_segment_ids", kv_seg_in, (b, s), None)
    window = _window(local_window_size)
    if s == 0 and masked_rows == "uniform":
        raise ValueError(
            f"key has S=0 keys (shape {shape_of(key)}): every query row is fully masked, and "
            "masked_rows='uniform' (the mean of value over all S keys) is undefined for S = 0; "
            "use 'zeros' or 'nan'"
        )
    dtype = dtypes["query"]
    cd = compute_dtype(dtype)
    spec = KernelSpec(
        b=b,
        t=t,
        s=s,
        n=n,
        k=kh,
        h=h,
        h_v=h_v,
        dtype=dtype,
        compute_dtype=cd,
        is_causal=bool(is_causal),
        window=window,
        alignment=causal_alignment,
        softcap=cap,
        masked_rows=masked_rows,
    )
    inputs = KernelInputs(
        q=jnp.asarray(query),
        k=jnp.asarray(key),
        v=jnp.asarray(value),
        bias=None if bias is None else jnp.asarray(bias).astype(cd),
        mask=None if mask is None else jnp.asarray(mask),
        q_lens=q_lens,
        kv_lens=kv_lens,
        q_seg=q_seg,
        kv_seg=kv_seg,
        scale=scale_value(h, scale, cd),
    )
    return spec, inputs


def index_conditions(
    spec: KernelSpec,
    x: KernelInputs,
    qi: Int[Array, "1 tq 1"],
    kj: Int[Array, "1 1 tk"],
    q_seg: Int[Array, "B tq"] | None = None,
    kv_seg: Int[Array, "B tk"] | None = None,
) -> Bool[Array, "#B #tq #tk"] | None:
    """The AND of the index-based options (lengths, causality, window, segments) for query indices
    ``qi`` and key indices ``kj``; leading axis ``B`` or 1. ``None`` when no option restricts the
    pairs (the indices are not checked against ``T`` and ``S``: that is the caller's)."""
    conds: list[Array] = []
    t_len = spec.t if x.q_lens is None else x.q_lens[:, None, None]
    s_len = spec.s if x.kv_lens is None else x.kv_lens[:, None, None]
    if x.q_lens is not None:
        conds.append(qi < t_len)
    if x.kv_lens is not None:
        conds.append(kj < s_len)
    if spec.is_causal or spec.window is not None:
        offset: Any = 0 if spec.alignment == "top_left" else s_len - t_len
        pos = qi + offset
        if spec.is_causal:
            conds.append(kj <= pos)
        if spec.window is not None:
            left, right = spec.window
            if left is not None:
                conds.append(kj >= pos - left)
            if right is not None:
                conds.append(kj <= pos + right)
    if q_seg is not None and kv_seg is not None:
        conds.append(q_seg[:, :, None] == kv_seg[:, None, :])
    return functools.reduce(jnp.logical_and, conds) if conds else None


def structural_allowed(
    spec: KernelSpec,
    x: KernelInputs,
    q_idx: Int[Array, " tq"],
    k_idx: Int[Array, " tk"],
    q_seg: Int[Array, "B tq"] | None = None,
    kv_seg: Int[Array, "B tk"] | None = None,
) -> Bool[Array, "B1 tq tk"]:
    """Allowed (query, key) pairs from the index-based options, for query indices ``q_idx`` and
    key indices ``k_idx`` (a tile or the whole range). Leading axis ``B`` or 1.

    Indices beyond ``T`` or ``S`` (tile padding) are never allowed.
    """
    qi = q_idx[None, :, None]
    kj = k_idx[None, None, :]
    allowed = jnp.logical_and(qi < spec.t, kj < spec.s)
    conds = index_conditions(spec, x, qi, kj, q_seg, kv_seg)
    return allowed if conds is None else jnp.logical_and(allowed, conds)


def query_rows_valid(spec: KernelSpec, x: KernelInputs) -> Bool[Array, "B1 T"]:
    """Query rows that exist: ``i < query_seq_lengths[b]`` (all rows without lengths)."""
    idx = jnp.arange(spec.t)[None, :]
    return idx < (spec.t if x.q_lens is None else x.q_lens[:, None])


def logits_transform(spec: KernelSpec, raw: Array) -> Array:
    """``c tanh(raw / c)`` with ``c = softcap``, identity without softcap."""
    if spec.softcap is None:
        return raw
    c = jnp.asarray(spec.softcap, raw.dtype)
    return c * jnp.tanh(raw / c)


def grouped(a: Array, spec: KernelSpec) -> Array:
    """``[B, N, ...] -> [B, K, G, ...]`` (query head ``n = k * G + g``)."""
    return a.reshape(a.shape[0], spec.k, spec.group, *a.shape[2:])


def uniform_rows(spec: KernelSpec, v: Array) -> Float[Array, "B 1 N H_v"]:
    """The ``"uniform"`` policy's output: the mean of every ``v`` row, per query head."""
    mean = jnp.mean(v.astype(spec.compute_dtype), axis=1)  # [B, K, H_v]
    return jnp.repeat(mean, spec.group, axis=1)[:, None]


def finish(
    spec: KernelSpec,
    x: KernelInputs,
    out: Float[Array, "B T N H_v"],
    lse: Float[Array, "B T N"],
    live: Bool[Array, "B T N"],
) -> tuple[Array, Array]:
    """Apply the fully-masked-row policy and query padding; cast the output to the input dtype.

    A batch element whose ``query_seq_lengths`` or ``key_value_seq_lengths`` lies outside
    ``[0, T]`` / ``[0, S]`` (only possible under ``jax.jit``, where the lengths are traced and
    cannot be checked; eager calls raise) returns NaN in every output and ``lse`` entry: an
    unmistakable result instead of a plausible wrong one (``lengths_in_range`` checks it).
    """
    if spec.masked_rows == "uniform":
        out = jnp.where(live[..., None], out, uniform_rows(spec, x.v))
    elif spec.masked_rows == "nan":
        out = jnp.where(live[..., None], out, jnp.nan)
    if x.q_lens is not None:
        valid = query_rows_valid(spec, x)[..., None]  # [B, T, 1]
        out = jnp.where(valid[..., None], out, 0.0)
        lse = jnp.where(valid, lse, -jnp.inf)
    bad = ~lengths_in_range(spec, x)[:, None, None]  # [B, 1, 1]
    out = jnp.where(bad[..., None], jnp.nan, out)
    lse = jnp.where(bad, jnp.nan, lse)
    return out.astype(spec.dtype), lse


def require_lengths_in_range(spec: KernelSpec, x: KernelInputs) -> None:
    """Under :func:`attnref.checked`, raise for traced lengths out of range (eager calls have
    raised already in ``prepare``); unchecked, ``finish`` returns NaN for those batch rows."""
    if x.q_lens is None and x.kv_lens is None:
        return
    ok = lengths_in_range(spec, x)
    require(
        ok,
        f"query_seq_lengths must lie in [0, T={spec.t}] and key_value_seq_lengths in "
        f"[0, S={spec.s}]; batch element {{b}} is out of range",
        b=jnp.argmin(ok),
    )


def lengths_in_range(spec: KernelSpec, x: KernelInputs) -> Bool[Array, " B"]:
    """Per batch element: ``0 <= query_seq_lengths <= T`` and ``0 <= key_value_seq_lengths <= S``
    (True where the lengths are not given)."""
    ok = jnp.ones((spec.b,), bool)
    for lens, upper in ((x.q_lens, spec.t), (x.kv_lens, spec.s)):
        if lens is not None:
            ok = jnp.logical_and(ok, jnp.logical_and(lens >= 0, lens <= upper))
    return ok


def allowed_pairs(spec: KernelSpec, x: KernelInputs) -> Bool[Array, "#B #N #T S"] | None:
    """Every allowed (query, key) pair of the call: the index-based options, ``mask`` and
    ``bias != -inf``, at their broadcast shape (never broadcast to ``[B, N, T, S]``: a causal mask
    stays ``[1, 1, T, S]``). ``None`` when every pair is allowed (no option restricts, ``S > 0``).
    """
    qi, kj = jnp.arange(spec.t)[None, :, None], jnp.arange(spec.s)[None, None, :]
    parts = []
    conds = index_conditions(spec, x, qi, kj, x.q_seg, x.kv_seg)
    if conds is not None:
        parts.append(conds[:, None])
    if x.mask is not None:
        parts.append(x.mask)
    if x.bias is not None:
        parts.append(x.bias != -jnp.inf)
    if not parts:
        return None if spec.s else jnp.zeros((1, 1, 1, 0), bool)
    allowed = functools.reduce(jnp.logical_and, parts)
    return jnp.broadcast_to(allowed, (*allowed.shape[:-1], spec.s))


def bad_operands(x: KernelInputs) -> tuple[Array, Array, Array | None]:
    """Where the operands hold NaN or inf: query rows ``[B, T, N]``, key/value rows
    ``[B, S, K]`` (either of ``k`` and ``v``), and bias entries that are NaN or ``+inf`` (a
    ``-inf`` bias masks its pair instead)."""
    bad_q = nonfinite_rows(x.q)
    bad_kv = jnp.logical_or(nonfinite_rows(x.k), nonfinite_rows(x.v))
    bias_bad = None
    if x.bias is not None:
        bias_bad = jnp.logical_or(jnp.isnan(x.bias), x.bias == jnp.inf)
    return bad_q, bad_kv, bias_bad


def _head_groups(a: Array, spec: KernelSpec) -> Array:
    """``[B, N, ...] -> [B, K, G, ...]`` (:func:`grouped`); a size-1 head axis stays size 1."""
    return a[:, :, None] if a.shape[1] == 1 else grouped(a, spec)


def reads_bad(
    spec: KernelSpec,
    allowed: Bool[Array, "#B #N #tq tk"],
    bad_kv: Bool[Array, "B tk K"],
    bias_bad: Array | None,
) -> Bool[Array, "B N #tq"]:
    """Query rows with an allowed key whose key/value row or bias entry is non-finite.

    ``allowed`` may keep size-1 (broadcast) batch, head and query axes; the result keeps the
    query axis of ``allowed`` (and ``bias_bad``), size 1 where both broadcast.
    """
    bad = jnp.swapaxes(bad_kv, 1, 2)[:, :, None, None, :]  # [B, K, 1, 1, tk]
    if bias_bad is not None:
        bad = jnp.logical_or(bad, _head_groups(bias_bad, spec))
    reads = jnp.any(jnp.logical_and(_head_groups(allowed, spec), bad), axis=-1)
    tq = reads.shape[-1]
    return jnp.broadcast_to(reads, (spec.b, spec.k, spec.group, tq)).reshape(spec.b, spec.n, tq)


def _where(allowed: Array | None, a: Array, fill: float) -> Array:
    """``where(allowed, a, fill)``; ``a`` itself when every pair is allowed (``None``)."""
    return a if allowed is None else jnp.where(allowed, a, fill)


def _logits(spec: KernelSpec, q: Array, k: Array) -> Float[Array, "B N T S"]:
    """``q_i . k_j`` for every head; query head ``n = k G + g`` reads K/V head ``k``.

    The query rows of a K/V head are laid out ``(g, t)`` before the product, so the ``[T, S]``
    logits come out of the ``dot`` in their final order (no transposed copy of them).
    """
    qg = q.reshape(spec.b, spec.t, spec.k, spec.group, spec.h)
    qg = jnp.transpose(qg, (0, 2, 3, 1, 4)).reshape(spec.b, spec.k, spec.group * spec.t, spec.h)
    raw = jnp.einsum("bkmh,bskh->bkms", qg, k, precision=HIGHEST)
    return raw.reshape(spec.b, spec.n, spec.t, spec.s)


def _mix_values(spec: KernelSpec, p: Array, v: Array) -> Float[Array, "B T N H_v"]:
    """``o_i = sum_j p_ij v_j`` per head, the ``dot`` reading ``p`` in place (rows ``(g, t)`` of
    each K/V head); only the ``[T, H_v]`` output is transposed to ``[B, T, N, H_v]``."""
    pg = p.reshape(spec.b, spec.k, spec.group * spec.t, spec.s)
    o = jnp.einsum("bkms,bskh->bkmh", pg, v, precision=HIGHEST)
    o = jnp.transpose(o.reshape(spec.b, spec.k, spec.group, spec.t, spec.h_v), (0, 3, 1, 2, 4))
    return o.reshape(spec.b, spec.t, spec.n, spec.h_v)


def _attend(
    spec: KernelSpec,
    x: KernelInputs,
    q: Array,
    k: Array,
    v: Array,
    allowed: Bool[Array, "#B #N #T S"] | None,
    live: Bool[Array, "#B #N #T"] | None,
) -> tuple[Array, Array]:
    """``softmax(s, allowed) v`` and ``lse`` (``[B, T, N, H_v]``, ``[B, N, T]``), compute dtype.

    ``allowed=None`` (and ``live=None``): every pair is allowed. One ``select`` feeds the max and
    one the exponential, ``e_ij = exp(where(allowed, s_ij - top_i, -inf))``, exactly 0 on a pair
    that is not allowed whatever its logit holds, and with a zero gradient there.
    """
    s = logits_transform(spec, _logits(spec, q, k) * x.scale)
    bias = finite_bias(x.bias)
    if bias is not None:
        s = s + bias
    top = jnp.max(_where(allowed, s, -jnp.inf), axis=-1, keepdims=True, initial=-jnp.inf)
    if live is not None:
        top = jnp.where(live[..., None], top, 0.0)
    top = jax.lax.stop_gradient(top)
    e = jnp.exp(_where(allowed, s - top, -jnp.inf))
    denom = jnp.sum(e, axis=-1)
    if live is not None:
        denom = jnp.where(live, denom, 1.0)
    lse = top[..., 0] + jnp.log(denom)
    if live is not None:
        lse = jnp.where(live, lse, -jnp.inf)
    return _mix_values(spec, e / denom[..., None], v), lse


def naive(spec: KernelSpec, x: KernelInputs) -> tuple[Array, Array]:
    """The naive form: every ``T x S`` logit at once; output and ``lse [B, T, N]``.

    Computed on the finite parts of ``q``, ``k``, ``v`` and the bias; the rows that read a
    non-finite value are NaN (``attnref._src.core.nonfinite``). The allowed pairs keep their broadcast
    shape, and the ``[B, N, T, S]`` tensors are never transposed (:func:`_logits`,
    :func:`_mix_values`).
    """
    cd = spec.compute_dtype
    allowed = allowed_pairs(spec, x)
    live_bnt = None if allowed is None else jnp.any(allowed, axis=-1)  # [B|1, N|1, T|1]
    q, k, v = (finite_part(a.astype(cd)) for a in (x.q, x.k, x.v))
    out, lse = _attend(spec, x, q, k, v, allowed, live_bnt)
    shape = (spec.b, spec.n, spec.t)
    live = jnp.ones(shape, bool) if live_bnt is None else jnp.broadcast_to(live_bnt, shape)
    live = jnp.swapaxes(live, 1, 2)  # [B, T, N]
    bad_q, bad_kv, bias_bad = bad_operands(x)
    every = jnp.ones((1, 1, 1, spec.s), bool)
    reads = reads_bad(spec, every if allowed is None else allowed, bad_kv, bias_bad)
    reads = jnp.swapaxes(jnp.broadcast_to(reads, shape), 1, 2)
    dirty = jnp.logical_or(jnp.logical_and(bad_q, live), reads)  # [B, T, N]
    out, lse = poison_rows(dirty, (out, jnp.swapaxes(lse, 1, 2)))
    return finish(spec, x, out, lse, live)


@float64_scoped
def dot_product_attention(
    query: Float[ArrayLike, "B T N H"],
    key: Float[ArrayLike, "B S K H"],
    value: Float[ArrayLike, "B S K H_v"],
    bias: Float[ArrayLike, "#B #N #T #S"] | None = None,
    mask: Bool[ArrayLike, "#B #N #T #S"] | None = None,
    *,
    scale: float | ArrayLike | None = None,
    is_causal: bool = False,
    query_seq_lengths: Int[ArrayLike, " B"] | None = None,
    key_value_seq_lengths: Int[ArrayLike, " B"] | None = None,
    local_window_size: int | tuple[int | None, int | None] | None = None,
    segment_ids: Any = None,
    softcap: float | None = None,
    causal_alignment: Alignment = "top_left",
    masked_rows: MaskedRows = "zeros",
    return_lse: bool = False,
) -> Any:
    """``o = softmax(c tanh(scale q k^T / c) + bias, allowed) v`` per head, jax.nn layout.

    The semantics (alignment, the fully-masked-row policy, padding) are in the module docstring
    of ``attnref._src.formulations.kernel`` and in ``docs/kernel.md``. Query head ``n`` reads key/value head
    ``n // (N // K)``. 16-bit inputs are computed in float32 and the output cast back.

    Args:
        query: ``[B, T, N, H]``, floating.
        key: ``[B, S, K, H]``, the dtype of ``query``; ``N`` must be a multiple of ``K``.
        value: ``[B, S, K, H_v]``, the dtype of ``query``.
        bias: Floating, rank 4, broadcastable to ``[B, N, T, S]``, added after the softcap
            (``-inf`` masks the pair); ``None`` (default) adds nothing.
        mask: Boolean, rank 4, broadcastable to ``[B, N, T, S]``, ``True`` = may attend;
            ``None`` (default) allows every pair.
        scale: The logit scale; ``None`` (default) means ``1/sqrt(H)``.
        is_causal: If ``True``, query ``i`` reads keys ``j <= p_i`` only (``p_i`` placed by
            ``causal_alignment``).
        query_seq_lengths: Integer ``[B]`` in ``[0, T]``: rows at or beyond the length are
            padding (output 0, ``lse = -inf``); ``None`` (default) means every row is real.
        key_value_seq_lengths: Integer ``[B]`` in ``[0, S]``: keys at or beyond the length are
            never read; ``None`` (default) means all ``S`` keys.
        local_window_size: ``w`` or ``(left, right)`` (ints >= 0, ``None`` = unbounded side):
            query ``i`` reads keys in ``[p_i - left, p_i + right]``; ``None`` (default): no
            window.
        segment_ids: One ``[B, T]`` int array (needs ``T == S``) or a pair
            ``(query_segment_ids [B, T], key_value_segment_ids [B, S])``; a query attends only
            to keys of its own segment (packed sequences). ``None`` (default): one segment.
        softcap: A positive finite Python number ``c``: logits become ``c tanh(s / c)`` before
            the bias; ``None`` (default): no cap.
        causal_alignment: ``"top_left"`` (default; jax.nn, PyTorch SDPA: ``p_i = i``) or
            ``"bottom_right"`` (FlashAttention: ``p_i = i + S_b - T_b`` with the actual
            lengths); used by ``is_causal`` and ``local_window_size``.
        masked_rows: What a fully masked query row returns: ``"zeros"`` (default), ``"uniform"``
            (the mean of ``value`` over all ``S`` keys, as jax.nn and Flax) or ``"nan"``
            (xformers).
        return_lse: If ``True``, also return the log-sum-exp of each row's allowed logits.

    Returns:
        ``o [B, T, N, H_v]`` in the dtype of ``query``, or ``(o, lse)`` with ``lse [B, T, N]``
        (``-inf`` on fully masked and padding rows) when ``return_lse``. Under ``jax.jit``
        (lengths traced, not checkable) a batch element with out-of-range lengths is NaN,
        unless run under :func:`attnref.checked`, which raises.

    Raises:
        ValueError: If ``query``/``key``/``value`` are not rank 4 or their shapes disagree
            (batch, head dim, ``S``/``K``, ``N % K != 0``, ``H = 0``), ``mask``/``bias`` are not
            rank 4 broadcastable to ``[B, N, T, S]``, ``masked_rows``/``causal_alignment`` are
            not accepted values, ``softcap`` is not a positive finite number, ``scale`` is not a
            scalar, a lengths or segment-ids array has the wrong shape, concrete lengths are out
            of range, a single ``segment_ids`` array is given with ``T != S``,
            ``local_window_size`` has a negative side or is not a pair, or
            ``masked_rows="uniform"`` with ``S = 0``.
        TypeError: If ``query`` is not floating, the three dtypes differ, ``mask`` is not
            boolean, ``bias`` is not floating, ``is_causal`` is not a bool, ``scale`` is not a
            real number, lengths or segment ids are not integers, or ``local_window_size`` is
            not an int or a pair of ints.
    """
    spec, x = prepare(
        query,
        key,
        value,
        bias,
        mask,
        scale=scale,
        is_causal=is_causal,
        query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths,
        local_window_size=local_window_size,
        segment_ids=segment_ids,
        softcap=softcap,
        causal_alignment=causal_alignment,
        masked_rows=masked_rows,
    )
    require_lengths_in_range(spec, x)
    out, lse = naive(spec, x)
    return (out, lse) if return_lse else out


def alibi_slopes(num_heads: int) -> np.ndarray:
    """ALiBi head slopes (Press et al. 2022), float64 ``[num_heads]``.

    For ``n`` a power of two, ``m_h = 2^(-8 h / n)``, ``h = 1..n``; otherwise the slopes of the
    closest lower power of two ``c`` followed by every other slope of ``2c`` (the paper's
    reference implementation).

    Args:
        num_heads: The number of query heads ``n``, a positive int.

    Returns:
        A NumPy float64 array ``[num_heads]``, one slope per head (for :func:`alibi_bias`).

    Raises:
        ValueError: If ``num_heads`` is not a positive int.
    """
    if not isinstance(num_heads, (int, np.integer)) or num_heads < 1:
        raise ValueError(f"num_heads must be a positive int, got {num_heads!r}")

    def power_of_two(n: int) -> list[float]:
        return [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]

    c = 2 ** math.floor(math.log2(num_heads))
    slopes = power_of_two(c)
    if c != num_heads:
        slopes += power_of_two(2 * c)[0::2][: num_heads - c]
    return np.asarray(slopes, dtype=np.float64)


def alibi_bias(
    slopes: Float[ArrayLike, " N"],
    t: int,
    s: int,
    *,
    causal_alignment: Alignment = "top_left",
    dtype: Any = jnp.float32,
) -> Float[Array, "1 N T S"]:
    """ALiBi bias ``-m_n |p_i - j|`` with ``p_i = i + offset`` (offset as ``causal_alignment``).

    Under a causal mask this is the paper's ``m_n (j - i)`` on every allowed key; the symmetric
    ``|.|`` extends it to non-causal attention, as FlashAttention does. Pass it as ``bias``.

    Args:
        slopes: Per-head slopes ``[N]`` (:func:`alibi_slopes`).
        t: The number of queries ``T``.
        s: The number of keys ``S``.
        causal_alignment: ``"top_left"`` (default, ``offset = 0``) or ``"bottom_right"``
            (``offset = s - t``, the last query on the last key).
        dtype: The bias dtype (default float32).

    Returns:
        The bias ``[1, N, T, S]`` of ``dtype``, broadcastable to ``[B, N, T, S]`` for
        :func:`dot_product_attention`.

    Raises:
        ValueError: If ``causal_alignment`` is not ``"top_left"`` or ``"bottom_right"``.
    """
    if causal_alignment not in CAUSAL_ALIGNMENTS:
        raise ValueError(
            f"causal_alignment must be one of {CAUSAL_ALIGNMENTS}, got {causal_alignment!r}"
        )
    offset = 0 if causal_alignment == "top_left" else s - t
    dist = jnp.abs(jnp.arange(t)[:, None] + offset - jnp.arange(s)[None, :]).astype(dtype)
    return (-jnp.asarray(slopes, dtype)[:, None, None] * dist)[None]
