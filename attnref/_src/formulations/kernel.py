"""Kernel-level attention ``(q, k, v) -> o`` with the layout of ``jax.nn.dot_product_attention``.

``query [B, T, N, H]``, ``key [B, S, K, H]``, ``value [B, S, K, H_v]`` -> ``o [B, T, N, H_v]``,
``lse [B, T, N]``; query head ``n`` reads K/V head ``n // (N // K)`` (GQA, Ainslie et al. 2023;
MQA, Shazeer 2019). Per batch ``b``, head ``n`` and query ``i`` (row convention)::

    s_ij = softcap(scale q_i . k_j) + bias_ij      scale defaults to 1/sqrt(H)
    o_i  = sum_{j allowed} softmax_j(s_ij) v_j,    lse_i = log sum_{j allowed} exp(s_ij)

Every mask option folds into :func:`allowed_pairs`; ``masked_rows`` says what a row with no
allowed key returns; 16-bit inputs compute in float32. What a query may not attend to (even NaN
or inf) never reaches its output or gradients. The options' semantics, with their tests, are
in ``docs/kernel.md``. Every kernel (naive, blockwise, split-KV, the four distributed schemes)
takes the one validated call of :func:`prepare` (:class:`KernelSpec`, :class:`KernelInputs`);
:func:`kernel_public` gives each the one signature and Args text (:data:`KERNEL_ARGS`).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from attnref._src.core.checks import HIGHEST, float64_scoped
from attnref._src.core.common import (
    BLOCK_RETURNS,
    RESIDUAL_ARG,
    Call,
    Prepared,
    add_output_bias,
    residual_or,
    row_args,
)
from attnref._src.core.entry import Level, compiled, guard, public
from attnref._src.core.nonfinite import finite_bias, finite_part, nonfinite_rows
from attnref._src.formulations.kernel_spec import CAUSAL_ALIGNMENTS as CAUSAL_ALIGNMENTS
from attnref._src.formulations.kernel_spec import (
    KERNEL_ARGS,
    KernelInputs,
    KernelSpec,
    lengths_in_range,
    prepare,
    require_lengths_in_range,
)
from attnref._src.formulations.kernel_spec import MASKED_ROWS_POLICIES as MASKED_ROWS_POLICIES
from attnref._src.formulations.kernel_spec import STATIC_OPTIONS as STATIC_OPTIONS
from attnref._src.formulations.kernel_spec import Alignment as Alignment
from attnref._src.formulations.kernel_spec import MaskedRows as MaskedRows
from attnref._src.formulations.standard import Bias, Keys, Mask, Params, Queries

# ----------------------------------------------------------------------------- the formula


def attention(
    spec: KernelSpec, inputs: KernelInputs, allowed: Bool[Array, "#B #N #T S"] | None
) -> tuple[Float[Array, "B T N H_v"], Float[Array, "B T N"]]:
    """``s = softcap(scale q k^T) + bias``, ``o = softmax(where(allowed, s, -inf)) v`` and
    ``lse = log sum_{j allowed} exp(s_ij)`` on finite inputs in the compute dtype (``allowed =
    None``: every pair); a fully masked row gives ``o = 0``, ``lse = -inf``. The exponential of
    a pair not allowed is exactly 0 (zero gradient), whatever its logit holds."""
    logits = scores(spec, inputs)  #                                          s  [B, N, T, S]
    live = None if allowed is None else jnp.any(allowed, axis=-1, keepdims=True)  # a key to read
    top = jnp.max(_where(allowed, logits, -jnp.inf), axis=-1, keepdims=True, initial=-jnp.inf)
    top = jax.lax.stop_gradient(_where(live, top, 0.0))
    e = jnp.exp(_where(allowed, logits - top, -jnp.inf))  #                  e^(s - max)
    denom = _where(live, jnp.sum(e, axis=-1, keepdims=True), 1.0)
    lse = _where(live, top + jnp.log(denom), -jnp.inf)[..., 0]
    probs = dropped(spec, e / denom, inputs.keep)  #              p_ij keep_ij / (1 - rate)
    return mix_values(spec, probs, inputs.v), jnp.swapaxes(lse, 1, 2)


def dropped(spec: KernelSpec, probs: Array, keep: Array | None) -> Array:
    """Deterministic dropout of the normalised weights: ``p_ij keep_ij / (1 - rate)``
    (FlashAttention's and PyTorch's references); ``probs`` itself without a keep mask."""
    if keep is None or spec.dropout_rate is None:
        return probs
    return jnp.where(keep, probs * (1.0 / (1.0 - spec.dropout_rate)), 0.0)


def with_sinks(
    sinks: Float[Array, " N"], o: Float[Array, "B tq N H_v"], lse: Float[Array, "B tq N"]
) -> tuple[Array, Array]:
    """The learnable sink ``z_n`` merged, once, into a finished state ``(o, lse)`` as a key of
    value 0: ``lse' = log(e^lse + e^z)``, ``o' = o e^(lse - lse')``. Fully masked rows
    (``lse = -inf``) become ``o' = 0``, ``lse' = z``; ``z = -inf`` is no sink."""
    top = jnp.maximum(lse, sinks)  #                                     max(lse, z)  [B, tq, N]
    alive = top != -jnp.inf  # (a NaN row, poisoned before, stays NaN)
    top = jax.lax.stop_gradient(jnp.where(alive, top, 0.0))
    a, z = jnp.exp(lse - top), jnp.exp(sinks - top)  #               e^(lse - m), e^(z - m)
    total = jnp.where(alive, a + z, 1.0)
    lse_out = jnp.where(alive, top + jnp.log(total), -jnp.inf)
    return o * (a / total)[..., None], lse_out


def scores(spec: KernelSpec, inputs: KernelInputs) -> Float[Array, "B N T S"]:
    """``softcap(scale q_i . k_j) + bias_ij``; query head ``n = k G + g`` reads K/V head ``k``
    (rows laid out ``(g, t)`` so the ``[T, S]`` logits leave the ``dot`` in their final order)."""
    q = inputs.q.reshape(spec.b, spec.t, spec.k, spec.group, spec.h)
    q = jnp.transpose(q, (0, 2, 3, 1, 4)).reshape(spec.b, spec.k, spec.group * spec.t, spec.h)
    raw = jnp.einsum("bkmh,bskh->bkms", q, inputs.k, precision=HIGHEST)
    logits = softcapped(spec, raw.reshape(spec.b, spec.n, spec.t, spec.s) * inputs.scale)
    return logits if inputs.bias is None else logits + inputs.bias


def mix_values(
    spec: KernelSpec, probs: Float[Array, "B N T S"], v: Float[Array, "B S K H_v"]
) -> Float[Array, "B T N H_v"]:
    """``o_i = sum_j p_ij v_j`` per head, the ``dot`` reading ``probs`` in place (rows ``(g, t)``
    of each K/V head); only the ``[T, H_v]`` output is transposed to ``[B, T, N, H_v]``."""
    pg = probs.reshape(spec.b, spec.k, spec.group * spec.t, spec.s)
    o = jnp.einsum("bkms,bskh->bkmh", pg, v, precision=HIGHEST)
    o = jnp.transpose(o.reshape(spec.b, spec.k, spec.group, spec.t, spec.h_v), (0, 3, 1, 2, 4))
    return o.reshape(spec.b, spec.t, spec.n, spec.h_v)


def softcapped(spec: KernelSpec, raw: Array) -> Array:
    """``c tanh(raw / c)`` with ``c = softcap``, identity without softcap."""
    if spec.softcap is None:
        return raw
    c = jnp.asarray(spec.softcap, raw.dtype)
    return c * jnp.tanh(raw / c)


def _where(allowed: Array | None, a: Array, fill: float) -> Array:
    """``where(allowed, a, fill)``; ``a`` itself when every pair is allowed (``None``)."""
    return a if allowed is None else jnp.where(allowed, a, fill)


# ----------------------------------------------------------------------------- the mask


def allowed_pairs(
    spec: KernelSpec,
    inputs: KernelInputs,
    q_idx: Int[Array, " tq"],
    k_idx: Int[Array, " tk"],
    q_seg: Int[Array, "B tq"] | None = None,
    kv_seg: Int[Array, "B tk"] | None = None,
    mask: Bool[Array, "#B #N #tq #tk"] | None = None,
    bias: Float[Array, "#B #N #tq #tk"] | None = None,
    in_range: bool = False,
) -> Bool[Array, "#B #N #tq #tk"] | None:
    """Every mask option in one ``and`` for the queries ``q_idx`` and keys ``k_idx`` (the whole
    range, a tile or a chunk): lengths, causality, window, segments, ``mask`` and ``bias !=
    -inf``; ``in_range``: also ``q_idx < T`` and ``k_idx < S`` (padding). Broadcast shapes are
    kept (a causal mask stays ``[1, 1, tq, tk]``); ``None`` when nothing restricts."""
    qi, kj = q_idx[None, :, None], k_idx[None, None, :]
    t_len = spec.t if inputs.q_lens is None else inputs.q_lens[:, None, None]
    s_len = spec.s if inputs.kv_lens is None else inputs.kv_lens[:, None, None]
    conds: list[Array] = [qi < spec.t, kj < spec.s] if in_range else []
    if inputs.q_lens is not None:
        conds.append(qi < t_len)
    if inputs.kv_lens is not None:
        conds.append(kj < s_len)
    if spec.is_causal or spec.window is not None:
        pos = qi + (0 if spec.alignment == "top_left" else s_len - t_len)  # p_i: i's key slot
        left, right = spec.window or (None, None)
        if spec.is_causal:
            conds.append(kj <= pos)
        if left is not None:  # sink tokens (the first keys) stay visible past the left edge
            conds.append(kj >= pos - left if not spec.sink_tokens else
                         jnp.logical_or(kj >= pos - left, kj < spec.sink_tokens))  # fmt: skip
        if right is not None:
            conds.append(kj <= pos + right)
    if q_seg is not None and kv_seg is not None:
        conds.append(q_seg[:, :, None] == kv_seg[:, None, :])
    parts = [functools.reduce(jnp.logical_and, conds)[:, None]] if conds else []
    if mask is not None:
        parts.append(mask)
    if bias is not None:
        parts.append(bias != -jnp.inf)
    return functools.reduce(jnp.logical_and, parts) if parts else None


# ----------------------------------------------------------------------------- the guard


def bad_operands(inputs: KernelInputs) -> tuple[Array, Array, Array | None]:
    """Where the operands hold NaN or inf: query rows ``[B, T, N]``, key/value rows
    ``[B, S, K]`` (either of ``k`` and ``v``), and bias entries that are NaN or ``+inf`` (a
    ``-inf`` bias masks its pair instead)."""
    bad_q = nonfinite_rows(inputs.q)
    bad_kv = jnp.logical_or(nonfinite_rows(inputs.k), nonfinite_rows(inputs.v))
    bias = inputs.bias
    bias_bad = None if bias is None else jnp.logical_or(jnp.isnan(bias), bias == jnp.inf)
    return bad_q, bad_kv, bias_bad


def grouped(a: Array, spec: KernelSpec) -> Array:
    """``[B, N, ...] -> [B, K, G, ...]`` (query head ``n = k * G + g``)."""
    return a.reshape(a.shape[0], spec.k, spec.group, *a.shape[2:])


def reads_bad(
    spec: KernelSpec,
    allowed: Bool[Array, "#B #N #tq tk"],
    bad_kv: Bool[Array, "B tk K"],
    bias_bad: Array | None,
) -> Bool[Array, "B N #tq"]:
    """Query rows with an allowed key whose key/value row or bias entry is non-finite; the
    query axis stays size 1 where ``allowed`` and ``bias_bad`` both broadcast it."""

    def head_groups(a: Array) -> Array:  # [B, N, ...] -> [B, K, G, ...]; size-1 heads stay
        return a[:, :, None] if a.shape[1] == 1 else grouped(a, spec)

    bad = jnp.swapaxes(bad_kv, 1, 2)[:, :, None, None, :]  # [B, K, 1, 1, tk]
    if bias_bad is not None:
        bad = jnp.logical_or(bad, head_groups(bias_bad))
    reads = jnp.any(jnp.logical_and(head_groups(allowed), bad), axis=-1)
    tq = reads.shape[-1]
    return jnp.broadcast_to(reads, (spec.b, spec.k, spec.group, tq)).reshape(spec.b, spec.n, tq)


def finite_inputs(spec: KernelSpec, inputs: KernelInputs) -> KernelInputs:
    """``q``, ``k``, ``v`` in the compute dtype with non-finite entries read as 0, and the bias
    with NaN and ``+inf`` read as 0 (``-inf`` kept): what a formula computes on."""
    q, k, v = (finite_part(a.astype(spec.compute_dtype)) for a in (inputs.q, inputs.k, inputs.v))
    return dataclasses.replace(inputs, q=q, k=k, v=v, bias=finite_bias(inputs.bias))


@dataclasses.dataclass(frozen=True)
class KernelCall:
    """One validated kernel call (what :func:`prepare` returns), guarded by
    :func:`attnref._src.core.entry.guard`: ``run`` computes a formula on the finite inputs and
    applies the finishing rules, ``dirty_rows`` names the rows that read a non-finite value."""

    spec: KernelSpec
    inputs: KernelInputs
    return_lse: bool = False
    scale: Any = None  # the caller's (None, a number, a traced array): pieces resolve it alike

    @functools.cached_property
    def allowed(self) -> Bool[Array, "#B #N #T S"] | None:
        """The allowed pairs of the whole call, broadcast shape kept; ``None``: every pair."""
        spec, inputs = self.spec, self.inputs
        pos, segments = (jnp.arange(spec.t), jnp.arange(spec.s)), (inputs.q_seg, inputs.kv_seg)
        allowed = allowed_pairs(spec, inputs, *pos, *segments, inputs.mask, inputs.bias)
        if allowed is None:
            return None if spec.s else jnp.zeros((1, 1, 1, 0), bool)
        return jnp.broadcast_to(allowed, (*allowed.shape[:-1], spec.s))

    @functools.cached_property
    def live(self) -> Bool[Array, "B T N"]:
        """Rows with at least one allowed key."""
        shape = (self.spec.b, self.spec.n, self.spec.t)
        if self.allowed is None:
            return jnp.ones((shape[0], shape[2], shape[1]), bool)
        return jnp.swapaxes(jnp.broadcast_to(jnp.any(self.allowed, axis=-1), shape), 1, 2)

    def run(self, formula: Callable[..., tuple[Array, Array]]) -> tuple[Array, Array]:
        """``formula(spec, finite inputs, allowed)``, then :meth:`finish`."""
        o, lse = formula(self.spec, finite_inputs(self.spec, self.inputs), self.allowed)
        return self.finish(o, lse, self.live)

    def finish(self, o: Array, lse: Array, live: Bool[Array, "B T N"]) -> tuple[Array, Array]:
        """:func:`finish` on the rows of the whole call (``"uniform"``: the mean of ``v``)."""
        spec, inputs, mean_v = self.spec, self.inputs, None
        if spec.masked_rows == "uniform" and not spec.has_sinks:
            mean_v = uniform_rows(spec, jnp.sum(inputs.v.astype(spec.compute_dtype), axis=1))
        return finish(spec, inputs, o, lse, live, jnp.arange(spec.t), mean_v, inputs.sinks)

    def dirty_rows(self) -> Bool[Array, "B T N"]:
        """A live row whose query is non-finite, or that reads a non-finite key, value or bias
        entry through an allowed pair."""
        spec = self.spec
        allowed = jnp.ones((1, 1, 1, spec.s), bool) if self.allowed is None else self.allowed
        bad_q, bad_kv, bias_bad = bad_operands(self.inputs)
        reads = reads_bad(spec, allowed, bad_kv, bias_bad)
        reads = jnp.swapaxes(jnp.broadcast_to(reads, (spec.b, spec.n, spec.t)), 1, 2)
        return jnp.logical_or(jnp.logical_and(bad_q, self.live), reads)


def naive(call: KernelCall) -> tuple[Array, Array]:
    """The naive form: every ``T x S`` logit at once (:func:`attention`), guarded."""
    return guard(call, attention)  # type: ignore[no-any-return]


# ----------------------------------------------------------------------------- finishing rules


def uniform_rows(spec: KernelSpec, v_sum: Float[Array, "B K H_v"]) -> Float[Array, "B 1 N H_v"]:
    """The ``"uniform"`` policy's output, ``sum_j v_j / S`` per query head."""
    return jnp.repeat(v_sum / spec.s, spec.group, axis=1)[:, None]


def finish(
    spec: KernelSpec,
    lengths: KernelInputs,
    o: Float[Array, "B tq N H_v"],
    lse: Float[Array, "B tq N"],
    live: Bool[Array, "B tq N"],
    q_pos: Int[Array, " tq"],
    mean_v: Float[Array, "B 1 N H_v"] | None = None,
    sinks: Float[Array, " N"] | None = None,
) -> tuple[Array, Array]:
    """The learnable sinks (:func:`with_sinks`; ``sinks``, the call's, must be passed when
    ``spec.has_sinks``) or else the fully-masked-row policy (``"uniform"``: ``mean_v``), query
    padding (``q_pos >= query_seq_lengths``: 0 and ``-inf``) and the cast to the input dtype. A
    batch element with (traced) lengths out of range (:func:`lengths_in_range`) is NaN in every
    output and ``lse`` entry: unmistakable instead of plausibly wrong."""
    if spec.has_sinks:
        if sinks is None:
            raise ValueError("the call has sinks: pass them to finish")
        # A NaN or +inf sink is read by every row of its head: those rows are NaN.
        bad = jnp.logical_or(jnp.isnan(sinks), sinks == jnp.inf)
        o, lse = with_sinks(jnp.where(bad, 0.0, sinks), o, lse)
        o, lse = jnp.where(bad[:, None], jnp.nan, o), jnp.where(bad, jnp.nan, lse)
    elif spec.masked_rows == "uniform":
        if mean_v is None:
            raise ValueError("masked_rows='uniform' needs the mean of the values (mean_v)")
        o = jnp.where(live[..., None], o, mean_v)
    elif spec.masked_rows == "nan":
        o = jnp.where(live[..., None], o, jnp.nan)
    if lengths.q_lens is not None:
        valid = (q_pos[None, :] < lengths.q_lens[:, None])[..., None]  # [B, tq, 1]
        o, lse = jnp.where(valid[..., None], o, 0.0), jnp.where(valid, lse, -jnp.inf)
    bad = ~lengths_in_range(spec, lengths)[:, None, None]  # [B, 1, 1]
    o, lse = jnp.where(bad[..., None], jnp.nan, o), jnp.where(bad, jnp.nan, lse)
    return o.astype(spec.dtype), lse


# ----------------------------------------------------------------------------- public kernels


@dataclasses.dataclass(frozen=True)
class Option:
    """A keyword argument of one kernel beyond the common ones (block sizes, ``num_splits``,
    ``mesh``): name, default (``inspect.Parameter.empty``: required), annotation, Args line."""

    name: str
    default: Any
    annotation: str
    doc: str


def scheduled(
    schedule: Callable[..., tuple[Array, Array]],
    spec: KernelSpec,
    inputs: KernelInputs,
    return_lse: bool,
    scale: Any,
    extras: dict[str, Any],
) -> Any:
    """``schedule`` on one validated call: ``o``, or ``(o, lse)`` with ``return_lse``."""
    out, lse = schedule(KernelCall(spec, inputs, return_lse, scale), **extras)
    return (out, lse) if return_lse else out


def kernel_public(
    schedule: Callable[..., tuple[Array, Array]],
    *,
    name: str,
    summary: str,
    options: Sequence[Option] = (),
    check: Callable[..., Any] | None = None,
    returns: str = "",
    value_errors: str = "",
    type_errors: str = "",
    formula: Callable[..., Any] | None = None,
    refuses: Sequence[str] = (),
    compile: bool = True,
) -> Callable[..., Any]:
    """The public kernel ``name``: :func:`prepare`'s signature (the ``options`` after ``mask``),
    float64-scoped; validates (``check(**options)``, then :func:`prepare`) and returns
    ``schedule(call, **options)``, ``o`` or ``(o, lse)``, as one compiled program unless
    ``compile=False``. Docstring: ``summary`` and :data:`KERNEL_ARGS` with the options and the
    extra text. ``refuses``: options of :func:`prepare` the schedule does not implement, refused
    (``NotImplementedError``) when not at their default, never ignored."""
    params = list(inspect.signature(prepare).parameters.values())
    kw = inspect.Parameter.KEYWORD_ONLY
    extra = [
        inspect.Parameter(o.name, kw, default=o.default, annotation=o.annotation) for o in options
    ]
    signature = inspect.Signature([*params[:5], *extra, *params[5:]], return_annotation="Any")

    def kernel(*args: Any, **kwargs: Any) -> Any:
        arguments = signature.bind(*args, **kwargs)
        arguments.apply_defaults()
        given = dict(arguments.arguments)
        extras = {o.name: given.pop(o.name) for o in options}
        for option in refuses:
            if given[option] is not signature.parameters[option].default:
                raise NotImplementedError(
                    f"{name} does not implement {option}= (got {given[option]!r}); "
                    "attnref.dot_product_attention, the blockwise and the split-KV kernels do"
                )
        if check is not None:
            check(**extras)
        spec, inputs, return_lse, scale = prepare(**given)
        require_lengths_in_range(spec, inputs)
        call = (spec, inputs, return_lse, scale, extras)
        return scheduled(schedule, *call) if not compile else compiled(scheduled, schedule, *call)

    fn: Any = float64_scoped(kernel)
    fn.__wrapped__ = prepare  # the annotated signature (the suite's jaxtyping hook checks it)
    fn.__signature__ = signature
    fn.__name__ = fn.__qualname__ = name
    fn.__module__ = schedule.__module__
    lines = "".join(f"\n    {o.name}: {o.doc}" for o in options)
    args = KERNEL_ARGS.format(
        options=lines, returns=returns, value_errors=value_errors, type_errors=type_errors
    )
    refused = ", ".join(f"``{o}``" for o in refuses)
    note = f"\n\nNot implemented here (refused with ``NotImplementedError``):\n{refused}."
    fn.__doc__ = f"{summary}{note if refuses else ''}\n\n{args}\n"
    fn.formula = formula or schedule
    return fn  # type: ignore[no-any-return]


dot_product_attention = kernel_public(
    naive,
    name="dot_product_attention",
    summary=(
        "``o = softmax(c tanh(scale q k^T / c) + bias, allowed) v`` per head, jax.nn layout.\n\n"
        "The semantics (alignment, the fully-masked-row policy, padding) are in the module "
        "docstring\nof ``attnref._src.formulations.kernel`` and in ``docs/kernel.md``. Query "
        "head ``n`` reads key/value\nhead ``n // (N // K)``. 16-bit inputs are computed in "
        "float32 and the output cast back."
    ),
    formula=attention,
)


# ----------------------------------------------------------------------------- row forms


def kernel_rows(
    params: Params,
    x_q: Queries,
    x_kv: Keys,
    mask: Mask,
    bias: Bias,
    scale: Any,
    residual: bool,
    options: dict[str, Any],
) -> Float[Array, "... T_q d_model"]:
    """``MultiHead = sum_n kernel(x_q W_Q, x_kv W_K, x_kv W_V)_n W_O[n] + b_O`` (``x_q +`` that
    with ``residual``): the row form of a kernel, on validated finite tokens; ``scale`` is the
    caller's (the kernel resolves ``None`` in its compute dtype); ``options``: the kernel
    (``"kernel"``) and its keyword arguments."""
    kernel, options = options["kernel"], {n: a for n, a in options.items() if n != "kernel"}
    xq, xkv, _ = flat_rows(x_q, x_kv)
    q = kernel_heads(xq, params.w_q, params.b_q)
    k = kernel_heads(xkv, params.w_k, params.b_k)
    v = kernel_heads(xkv, params.w_v, params.b_v)
    o = kernel(q, k, v, *(kernel_pairs(a, x_q, x_kv) for a in (bias, mask)), scale=scale, **options)
    return output_rows(params, o, x_q, residual)


def kernel_heads(x: Array, w: Any, b: Any) -> Array:
    """``x W[h] + b[h]``: ``[..., d] -> [..., heads, d']`` (kernel layout)."""
    y = jnp.einsum("...d,hde->...he", x, jnp.asarray(w), precision=HIGHEST)
    return y if b is None else y + jnp.asarray(b)


def flat_rows(x_q: Array, x_kv: Array) -> tuple[Array, Array, int]:
    """``x_q``, ``x_kv`` with the batch dims flattened to one, ``[B, T, d_model]``, and ``B``."""
    b = math.prod(x_q.shape[:-2])
    return x_q.reshape(b, x_q.shape[-2], -1), x_kv.reshape(b, x_kv.shape[-2], -1), b


def kernel_pairs(a: Array | None, x_q: Array, x_kv: Array) -> Array | None:
    """A ``[..., T_q, T_k]`` mask or bias in the kernel layout ``[B, 1, T_q, T_k]``."""
    if a is None:
        return None
    t_q, t_k = x_q.shape[-2], x_kv.shape[-2]
    return jnp.broadcast_to(a, (*x_q.shape[:-2], t_q, t_k)).reshape(-1, 1, t_q, t_k)


def output_rows(params: Params, o: Array, x_q: Array, residual: bool) -> Array:
    """``sum_n o_n W_O[n] + b_O`` from kernel outputs ``o [B, T_q, H, d_v]``, in ``x_q``'s
    batch shape (``x_q +`` that in residual form)."""
    y = jnp.einsum("bthv,hvd->btd", o, jnp.asarray(params.w_o), precision=HIGHEST)
    return residual_or(add_output_bias(y.reshape(*x_q.shape[:-1], -1), params), x_q, residual)


def row_call(rows: Prepared, scale: Any, options: dict[str, Any]) -> Call:
    """A validated row-form call of a kernel (:func:`attnref._src.core.common.prepare_rows`):
    the arguments of :func:`kernel_rows` (the caller's ``scale``, the kernel's ``options``) and
    the dirty rows."""
    args = (rows.params, rows.x_q, rows.x_kv, rows.mask, rows.bias, scale, bool(rows.residual))
    return Call((*args, options), rows)


def kernel_call(kernel: Callable[..., Any]) -> Callable[..., Call]:
    """The ``build`` of ``kernel``'s row level (:func:`attnref._src.core.common.rows_level`):
    :func:`row_call` with the kernel and the level's options."""
    return lambda rows, scale, **options: row_call(rows, scale, {"kernel": kernel, **options})


def rows_public(
    level: Level, formula: Callable[..., Any], module: str, **kw: Any
) -> Callable[..., Any]:
    """:func:`attnref._src.core.entry.public` at a row level of a kernel, returning the block
    output, in ``module`` (the registry ranks entries by their ``apply``'s module)."""
    fn = public(level, formula, returns=BLOCK_RETURNS, **kw)
    fn.__module__ = module
    return fn


def option_args(option: str, value_error: str, type_error: str) -> str:
    """The row level's Args text (:func:`attnref._src.core.common.row_args`) with one more
    keyword argument and its errors (sentence fragments)."""
    text = row_args(RESIDUAL_ARG + f"\n    {option}", f",\n        or {value_error}")
    return f"{text}\n    TypeError: Also if {type_error}."


# ----------------------------------------------------------------------------- feature costs


class FeatureCost(NamedTuple):
    """What the production options add to a kernel call (XLA's counting: ``flops`` are every
    elementwise op, transcendentals are ``exp`` and ``log`` elements)."""

    elementwise_flops: int  # an upper bound for the sinks; exact for dropout
    transcendentals: int  # exact
    matmul_flops: int = 0  # exact: neither option adds a contraction


def feature_cost(
    b: int, t: int, n: int, s: int, h_v: int, *, sinks: bool = False, dropout: bool = False
) -> FeatureCost:
    """The cost of the learnable sinks and the dropout over a kernel call without them.

    Sinks (:func:`with_sinks`, per row of ``B T N``): ``exp(lse - m)``, ``exp(z - m)`` and the
    ``log`` of their sum (3 transcendentals); the max, selects, subtractions, sum, division,
    guard tests and rescaled output row, at most ``24 + 2 H_v`` ops. Dropout (:func:`dropped`,
    per pair of ``B N T S``, ``S`` padded to the key blocks by the caller): a product and a
    select, exactly 2 ops."""
    rows, pairs = b * t * n, b * n * t * s
    elementwise = (rows * (24 + 2 * h_v) if sinks else 0) + (2 * pairs if dropout else 0)
    return FeatureCost(elementwise, 3 * rows if sinks else 0)
