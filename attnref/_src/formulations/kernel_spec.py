"""The kernel level's one validated call: :func:`prepare` checks the arguments of
``jax.nn.dot_product_attention`` once into a :class:`KernelSpec` (shapes, dtypes, static options)
and :class:`KernelInputs` (the arrays), which every kernel (naive, blockwise, split-KV, the four
distributed schemes) then schedules; :data:`KERNEL_ARGS` is their Args text, written once.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, no_type_check

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Float, Int

from attnref._src.core.checked import require
from attnref._src.core.checks import (
    check_ints,
    check_kernel_arrays,
    check_mask_and_bias,
    check_scale,
    check_softcap,
    check_window,
    device_array,
    is_traced,
    shape_of,
)
from attnref._src.core.common import scale_value
from attnref.oracle import _checks as oc

MaskedRows = Literal["zeros", "uniform", "nan"]
Alignment = Literal["top_left", "bottom_right"]
# The accepted values of masked_rows and causal_alignment: the one copy (prepare, alibi_bias,
# the conformance kit and its CLI read these).
MASKED_ROWS_POLICIES = oc.POLICIES
CAUSAL_ALIGNMENTS = oc.ALIGNMENTS
# Keyword options that change the computation's structure: static under jax.jit.
STATIC_OPTIONS = (
    "scale",
    "is_causal",
    "local_window_size",
    "softcap",
    "sink_tokens",
    "dropout_rate",
    "causal_alignment",
    "masked_rows",
    "return_lse",
)


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """Static description of one kernel call: shapes, dtypes and the static options."""

    b: int
    t: int  # queries T
    s: int  # keys S
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
    sink_tokens: int = 0  # the first keys, exempt from a window's left edge (StreamingLLM)
    dropout_rate: float | None = None  # with ``KernelInputs.keep``: weights scaled 1/(1-p)
    has_sinks: bool = False  # learnable sink logits given (``KernelInputs.sinks``)

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
    scale: Array  # scalar, compute dtype
    bias: Array | None = None  # rank 4, broadcastable to [B, N, T, S], compute dtype
    mask: Array | None = None  # rank 4, broadcastable to [B, N, T, S]
    q_lens: Array | None = None  # [B] int32
    kv_lens: Array | None = None  # [B] int32
    q_seg: Array | None = None  # [B, T] int32
    kv_seg: Array | None = None  # [B, S] int32
    sinks: Array | None = None  # [N], compute dtype: one sink logit per query head
    keep: Array | None = None  # rank 4 bool, broadcastable to [B, N, T, S]: dropout's keep mask


def lengths_only(q_lens: Array | None, kv_lens: Array | None) -> KernelInputs:
    """A :class:`KernelInputs` carrying only the lengths (what the position rules read; the
    arrays they never read are ``None``)."""
    unread: Any = None
    return KernelInputs(unread, unread, unread, unread, q_lens=q_lens, kv_lens=kv_lens)


def lengths_in_range(spec: KernelSpec, lengths: KernelInputs) -> Bool[Array, " B"]:
    """Per batch element: ``0 <= query_seq_lengths <= T`` and ``0 <= key_value_seq_lengths <= S``
    (True where the lengths are not given)."""
    ok = jnp.ones((spec.b,), bool)
    for lens, upper in ((lengths.q_lens, spec.t), (lengths.kv_lens, spec.s)):
        if lens is not None:
            ok = jnp.logical_and(ok, jnp.logical_and(lens >= 0, lens <= upper))
    return ok


def require_lengths_in_range(spec: KernelSpec, lengths: KernelInputs) -> None:
    """Under :func:`attnref.checked`, raise for traced lengths out of range (eager calls have
    raised already in ``prepare``); unchecked, ``finish`` returns NaN for those batch rows."""
    if not is_traced(lengths.q_lens, lengths.kv_lens):
        return  # none given, or concrete: ``check_ints`` has checked their range in NumPy
    ok = lengths_in_range(spec, lengths)
    require(
        ok,
        f"query_seq_lengths must lie in [0, T={spec.t}] and key_value_seq_lengths in "
        f"[0, S={spec.s}]; batch element {{b}} is out of range",
        b=jnp.argmin(ok),
    )


def prepare(
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
    sinks: ArrayLike | None = None,  # [N], floating: checked by check_production
    sink_tokens: int = 0,
    dropout_mask: ArrayLike | None = None,  # bool, broadcastable to [B, N, T, S]: ditto
    dropout_rate: float | None = None,
    causal_alignment: Alignment = "top_left",
    masked_rows: MaskedRows = "zeros",
    return_lse: bool = False,
) -> tuple[KernelSpec, KernelInputs, bool, Any]:
    """Validate a kernel call once, at trace time, for every kernel (the signature of each
    :func:`~attnref._src.formulations.kernel.kernel_public`) into the spec, the arrays,
    ``return_lse`` and the caller's ``scale``; errors name the argument and its shape, as
    ``attnref.oracle``'s. ``T = 0`` gives an empty output; ``S = 0`` fully masks every row
    (``"uniform"`` refused); ``H = 0`` is refused (``1/sqrt(H)`` undefined)."""
    query, key, value = (
        x if hasattr(x, "dtype") and hasattr(x, "shape") else device_array(x)
        for x in (query, key, value)
    )
    (b, t, n, h), (s, kh, h_v), dtype = check_kernel_arrays(query, key, value)
    oc.check_policy(masked_rows)
    oc.check_alignment(causal_alignment)
    oc.check_flag("is_causal", is_causal)
    check_scale(scale)
    cap = check_softcap(softcap)
    target = (b, n, t, s)
    for name, arr in (("bias", bias), ("mask", mask)):
        if arr is not None and np.ndim(arr) != 4:
            raise ValueError(
                f"{name} must have rank 4 broadcastable to [B, N, T, S] = {target}, got shape "
                f"{shape_of(arr)}"
            )
    check_mask_and_bias(mask, bias, target, axes="[B, N, T, S]")
    q_lens = check_ints("query_seq_lengths", query_seq_lengths, (b,), t)
    kv_lens = check_ints("key_value_seq_lengths", key_value_seq_lengths, (b,), s)
    q_seg, kv_seg = oc.check_segments(segment_ids, b, t, s, check=check_ints)
    window = check_window(local_window_size)
    n_sink, rate = oc.check_production(
        target,
        window,
        sinks=sinks,
        sink_tokens=sink_tokens,
        dropout_mask=dropout_mask,
        dropout_rate=dropout_rate,
    )
    if s == 0 and masked_rows == "uniform":
        raise ValueError(
            f"key has S=0 keys (shape {shape_of(key)}): every query row is fully masked, and "
            "masked_rows='uniform' (the mean of value over all S keys) is undefined for S = 0; "
            "use 'zeros' or 'nan'"
        )
    cd = jnp.promote_types(dtype, jnp.float32)  # float32 for 16-bit inputs
    options = (bool(is_causal), window, causal_alignment, cap, masked_rows, n_sink, rate)
    spec = KernelSpec(b, t, s, n, kh, h, h_v, dtype, cd, *options, sinks is not None)

    def optional(a: Any, dtype: Any = None) -> Any:
        return None if a is None else device_array(a, dtype)

    # KernelInputs' field order: q, k, v, scale, bias, mask, lengths, segments, sinks, keep
    q, k, v = (device_array(a) for a in (query, key, value))
    masks = (optional(bias, cd), optional(mask), q_lens, kv_lens, q_seg, kv_seg)
    extra = (optional(sinks, cd), optional(dropout_mask))
    inputs = KernelInputs(q, k, v, scale_value(h, scale, cd), *masks, *extra)
    return spec, inputs, bool(return_lse), scale


KERNEL_ARGS = """Args:
    query: ``[B, T, N, H]``, floating.
    key: ``[B, S, K, H]``, the dtype of ``query``; ``N`` must be a multiple of ``K``.
    value: ``[B, S, K, H_v]``, the dtype of ``query``.
    bias: Floating, rank 4, broadcastable to ``[B, N, T, S]``, added after the softcap
        (``-inf`` masks the pair); ``None`` (default) adds nothing.
    mask: Boolean, rank 4, broadcastable to ``[B, N, T, S]``, ``True`` = may attend;
        ``None`` (default) allows every pair.{options}
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
    sinks: Floating ``[N]``, one learnable sink logit ``z_n`` per query head (gpt-oss): it
        joins each row's softmax denominator and carries no value,
        ``o_i = sum_j exp(s_ij) v_j / (exp(z_n) + sum_j exp(s_ij))``, and ``lse`` includes it; a
        fully masked row is then 0 (``lse = z_n``) under every ``masked_rows``. ``None``
        (default): no sink.
    sink_tokens: An int ``n >= 0``: the first ``n`` keys stay visible past the window's left
        edge (StreamingLLM's sink tokens, FlashAttention's ``sink_token_length``); needs
        ``local_window_size`` with a left side. Default 0.
    dropout_mask: Boolean, rank 4, broadcastable to ``[B, N, T, S]``, ``True`` = keep: the
        normalised weights are multiplied by ``mask / (1 - dropout_rate)`` before the values
        (deterministic dropout; ``lse`` is unchanged). ``None`` (default): no dropout.
    dropout_rate: The rate ``p`` in ``[0, 1)`` the mask was drawn with; given exactly when
        ``dropout_mask`` is.
    causal_alignment: ``"top_left"`` (default; jax.nn, PyTorch SDPA: ``p_i = i``) or
        ``"bottom_right"`` (FlashAttention: ``p_i = i + S_b - T_b`` with the actual
        lengths); used by ``is_causal`` and ``local_window_size``.
    masked_rows: What a fully masked query row returns: ``"zeros"`` (default), ``"uniform"``
        (the mean of ``value`` over all ``S`` keys, as jax.nn and Flax) or ``"nan"``
        (xformers).
    return_lse: If ``True``, also return the log-sum-exp of each row's allowed logits.

Returns:
    ``o [B, T, N, H_v]`` in the dtype of ``query``, or ``(o, lse)`` with ``lse [B, T, N]``
    (``-inf`` on fully masked and padding rows) when ``return_lse``.{returns} Under
    ``jax.jit`` (lengths traced, not checkable) a batch element with out-of-range lengths is
    NaN, unless run under :func:`attnref.checked`, which raises.

Raises:
    ValueError: If ``query``/``key``/``value`` are not rank 4 or their shapes disagree
        (batch, head dim, ``S``/``K``, ``N % K != 0``, ``H = 0``), ``mask``/``bias`` are not
        rank 4 broadcastable to ``[B, N, T, S]``, ``masked_rows``/``causal_alignment`` are
        not accepted values, ``softcap`` is not a positive finite number, ``scale`` is not a
        scalar, a lengths or segment-ids array has the wrong shape, concrete lengths are out
        of range, a single ``segment_ids`` array is given with ``T != S``,
        ``local_window_size`` has a negative side or is not a pair,
        ``masked_rows="uniform"`` with ``S = 0``, ``sinks`` is not ``[N]``, ``sink_tokens``
        is negative or given without a window's left side, ``dropout_rate`` lies outside
        ``[0, 1)`` or is given without ``dropout_mask`` (or the reverse), or ``dropout_mask``
        does not broadcast to ``[B, N, T, S]``{value_errors}.
    TypeError: If ``query`` is not floating, the three dtypes differ, ``mask`` is not
        boolean, ``bias`` is not floating, ``is_causal`` is not a bool, ``scale`` is not a
        real number, lengths or segment ids are not integers, ``local_window_size`` is
        not an int or a pair of ints, ``sinks`` is not floating, or ``dropout_mask`` is not
        boolean{type_errors}."""
