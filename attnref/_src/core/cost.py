"""Analytic cost models (:class:`Dims`, :class:`Cost`, the shared helpers, :func:`cost`) and
XLA's own counts (:func:`xla_counts`, :func:`hlo_collectives`).

Each formulation's ``<id>_cost(dims) -> Cost`` lives next to its code as its registry entry's
``cost_model``. The counting conventions (XLA's: ``2 M N K`` per contraction, one transcendental
per ``exp``/``expm1``/``cos``/``sin`` element, an elementwise upper bound, bytes up to a
workspace bound, ``while`` bodies counted once by XLA, per-device counts and
:class:`Collective` records for distributed forms) are in ``docs/cost.md``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from attnref._src.core.hlo import collective_calls, hlo_dot_flops


@dataclasses.dataclass(frozen=True)
class Dims:
    """Problem sizes.

    Attributes:
        batch: The product of the batch dims.
        t_q: The number of queries ``T_q``.
        t_k: The number of keys ``T_k``.
        heads: The number of heads ``H`` (one key/value head per query head).
        d_model: The model width.
        d_k: The query/key head dim.
        d_v: The value head dim.
        bias: Whether the parameters have biases (default ``False``).
        feature_map: The linear family's feature map name (default ``"elu_plus_one"``).
        features: FAVOR+'s feature count ``m`` (the other maps derive ``m`` from ``d_k``).
        chunk: The chunk size of ``linear_chunked`` (default 16).
        itemsize: Bytes per element (default 4, float32).
        causal: Whether the linear forms run causally (default ``False``).
        devices: The device count ``P`` of a distributed form (its cost is per device).
    """

    batch: int
    t_q: int
    t_k: int
    heads: int
    d_model: int
    d_k: int
    d_v: int
    bias: bool = False
    feature_map: str = "elu_plus_one"
    features: int = 0
    chunk: int = 16
    itemsize: int = 4
    causal: bool = False
    devices: int = 1


# HLO's names of ``ppermute``, ``all_gather``, ``all_to_all``, ``psum`` and ``psum_scatter``.
COLLECTIVES = ("collective-permute", "all-gather", "all-to-all", "all-reduce", "reduce-scatter")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective a device runs ``calls`` times, each call on ``operand_bytes`` of its own.

    Attributes:
        kind: One of :data:`COLLECTIVES`.
        operand_bytes: One device's operand as HLO shows it (``all-gather``: the local shard;
            ``reduce-scatter``: the full input).
        calls: How many times each device runs it.
        devices: The group size ``P``.
        in_shard_map: ``True`` for a scheme's own collectives, ``False`` for those XLA's SPMD
            partitioner adds to reshard the global arrays.
        conditional: ``True`` when HLO runs it in a branch of a ``conditional`` (its ``calls``
            are then an upper bound); always ``False`` in a model.
    """

    kind: str
    operand_bytes: int
    calls: int
    devices: int
    in_shard_map: bool = True
    conditional: bool = False

    def __post_init__(self) -> None:
        if self.kind not in COLLECTIVES:
            raise ValueError(f"kind must be one of {COLLECTIVES}, got {self.kind!r}")

    @property
    def sent_bytes_per_call(self) -> float:
        """Bytes one device sends in one call (bandwidth-optimal ring algorithms): ``n``,
        ``(P - 1) n``, ``(P - 1) n / P`` and ``2 (P - 1) n / P`` for a permute, all-gather,
        all-to-all and all-reduce of operand ``n``."""
        p, n = self.devices, self.operand_bytes
        if p <= 1:
            return 0.0
        return {
            "collective-permute": float(n),
            "all-gather": float((p - 1) * n),
            "all-to-all": (p - 1) * n / p,
            "all-reduce": 2 * (p - 1) * n / p,
            "reduce-scatter": (p - 1) * n / p,
        }[self.kind]

    @property
    def sent_bytes(self) -> float:
        """Bytes one device sends over all its calls."""
        return self.calls * self.sent_bytes_per_call


@dataclasses.dataclass(frozen=True)
class Cost:
    """The analytic cost of one call (counting conventions in the module docstring).

    Attributes:
        matmul_flops: Contraction FLOPs, ``2 M N K`` per ``M x K`` by ``K x N``; exact.
        elementwise_flops: An upper bound on elementwise, comparison, select and reduction ops.
        transcendentals: ``exp``/``expm1`` elements; exact.
        input_bytes: Parameters, tokens and masks.
        output_bytes: The output.
        intermediate_bytes: The largest intermediate tensor.
        workspace_bytes: Every intermediate at once plus one copy of the inputs.
        loop_trips: Loop body executions (``> 1`` for the scan-based forms).
        per_trip_matmul_flops: The part of ``matmul_flops`` inside the loop, per trip.
        per_trip_elementwise_flops: Likewise for ``elementwise_flops``.
        per_trip_transcendentals: Likewise for ``transcendentals``.
        collectives: A distributed form's communication per device (:class:`Collective`).
    """

    matmul_flops: int
    elementwise_flops: int
    transcendentals: int
    input_bytes: int
    output_bytes: int
    intermediate_bytes: int
    workspace_bytes: int = 0
    loop_trips: int = 1
    per_trip_matmul_flops: int = 0
    per_trip_elementwise_flops: int = 0
    per_trip_transcendentals: int = 0
    collectives: tuple[Collective, ...] = ()

    @property
    def sent_bytes(self) -> float:
        """Bytes one device sends over the whole call (:attr:`Collective.sent_bytes`)."""
        return float(sum(c.sent_bytes for c in self.collectives))

    @property
    def flops(self) -> int:
        """Total work: matmul FLOPs plus the elementwise upper bound."""
        return self.matmul_flops + self.elementwise_flops

    def as_counted_by_xla(self) -> tuple[int, int, int]:
        """``(matmul, elementwise bound, transcendentals)`` with loop bodies counted once."""
        extra = self.loop_trips - 1
        return (
            self.matmul_flops - extra * self.per_trip_matmul_flops,
            self.elementwise_flops - extra * self.per_trip_elementwise_flops,
            self.transcendentals - extra * self.per_trip_transcendentals,
        )


SOFTMAX_PER_LOGIT = 12  # != -inf, and mask, any, where, max, -, where, where, sum, /, *scale, +bias
SOFTMAX_PER_ROW = 2  # where(any, max, 0), where(any, sum, 1)


# The non-finite guard (``core/nonfinite.py``), counted from its source. Per operand element:
# isfinite, where; isfinite, not, reduce. Per logit: live test; and, any; with a bias also
# isfinite, not, and, any; isnan, == inf, or, where. Per row: the or of the dirty terms.
GUARD_PER_OPERAND = 5
GUARD_PER_LOGIT = 3
GUARD_PER_BIASED_LOGIT = 8
GUARD_PER_ROW = 3


def guard_elementwise(d: Dims, *, operands: int, logits: int, rows: int, outputs: int) -> int:
    """Elementwise FLOPs of the non-finite guard on one attention call of these sizes."""
    per_logit = GUARD_PER_LOGIT + (GUARD_PER_BIASED_LOGIT if d.bias else 0)
    return GUARD_PER_OPERAND * operands + per_logit * logits + GUARD_PER_ROW * rows + outputs


# At the weight level (``Prepared.guarded``), per (query, key) pair: and, != -inf; any; and, any;
# the bias's isfinite, not, and, any and isnan, == inf, or, where.
WEIGHT_GUARD_PER_PAIR = 13


def weight_guard_elementwise(d: Dims, *, pairs: bool = True) -> int:
    """Elementwise FLOPs of the weight-level guard (``pairs=False``: linear's O(T) form)."""
    b, dm = d.batch, d.d_model
    tokens = GUARD_PER_OPERAND * b * (d.t_q + d.t_k) * dm
    per_pair = WEIGHT_GUARD_PER_PAIR * b * d.t_q * d.t_k if pairs else 4 * b * (d.t_q + d.t_k)
    return tokens + per_pair + GUARD_PER_ROW * b * d.t_q + b * d.t_q * dm


def io(d: Dims, *, kv_tokens: bool = True) -> tuple[int, int]:
    h, dm = d.heads, d.d_model
    params = h * dm * (2 * d.d_k + d.d_v) + h * d.d_v * dm
    if d.bias:
        params += h * (2 * d.d_k + d.d_v) + dm
    tokens = d.batch * (d.t_q + (d.t_k if kv_tokens else 0)) * dm
    masks = 2 * d.batch * d.t_q * d.t_k  # bias (itemsize) and boolean mask (1 byte) ~ bounded
    return (params + tokens + masks) * d.itemsize, d.batch * d.t_q * dm * d.itemsize


def softmax_elementwise(d: Dims) -> int:
    logits = d.batch * d.heads * d.t_q * d.t_k
    return SOFTMAX_PER_LOGIT * logits + SOFTMAX_PER_ROW * d.batch * d.heads * d.t_q


def bias_adds(d: Dims, q: int, k: int, v: int, out: int) -> int:
    return (q + k + v + out) if d.bias else 0


def qkvo_bias_adds(d: Dims) -> int:
    """The bias adds of the ``q``, ``k``, ``v`` projections and the output (0 without biases)."""
    b, h = d.batch, d.heads
    qkv = b * h * (d.t_q * d.d_k + d.t_k * (d.d_k + d.d_v))
    return bias_adds(d, qkv, 0, 0, b * d.t_q * d.d_model)


def projections(d: Dims) -> tuple[int, int, int]:
    b, h, dm = d.batch, d.heads, d.d_model
    return (
        2 * b * d.t_q * dm * h * d.d_k,
        2 * b * d.t_k * dm * h * d.d_k,
        2 * b * d.t_k * dm * h * d.d_v,
    )


def softmax_tensors(d: Dims, logits: int) -> list[int]:
    """The masked softmax's 6 logit-sized tensors and 4 row vectors."""
    rows = d.batch * d.heads * d.t_q
    return [logits] * 6 + [rows] * 4


def build(
    d: Dims, mm: int, el: int, tr: int, tensors: list[int], largest: int | None = None, **kw: Any
) -> Cost:
    """A :class:`Cost` with :func:`io`'s bytes, the largest intermediate (``largest`` elements,
    else ``max(tensors)``) and the workspace ``sum(tensors)`` plus the inputs."""
    inputs, output = io(d)
    big = (max(tensors) if largest is None else largest) * d.itemsize
    return Cost(mm, el, tr, inputs, output, big, sum(tensors) * d.itemsize + inputs, **kw)


def finish(d: Dims, matmul: int, elementwise: int, trans: int, tensors: list[int]) -> Cost:
    """A weight-level softmax form's cost, with its non-finite guard's elementwise work."""
    return build(d, matmul, elementwise + weight_guard_elementwise(d), trans, tensors)


def messages(d: Dims) -> tuple[int, int]:
    """(matmul, elementwise) of ``X_kv W_M + b_V W_O`` including forming ``W_M``."""
    b, h, dm = d.batch, d.heads, d.d_model
    mm = 2 * h * dm * d.d_v * dm + 2 * b * d.t_k * dm * h * dm
    return mm + (2 * h * d.d_v * dm if d.bias else 0), (b * h * d.t_k * dm if d.bias else 0)


def message_tensors(d: Dims) -> list[int]:
    """``W_M``, the messages (before and after ``b_V W_O``), per-head mixes and the output."""
    b, h, dm = d.batch, d.heads, d.d_model
    return [h * dm * dm, b * h * d.t_k * dm, b * h * d.t_k * dm, b * h * d.t_q * dm, b * d.t_q * dm]


def mix(d: Dims) -> tuple[int, int]:
    """(matmul, elementwise) of ``sum_i A_i M_i + b_O``."""
    b, h, dm = d.batch, d.heads, d.d_model
    el = b * (h - 1) * d.t_q * dm + (b * d.t_q * dm if d.bias else 0)
    return 2 * b * h * d.t_q * d.t_k * dm, el


# ----------------------------------------------------------------------------- linear family


def feature_cost(d: Dims, tokens: int) -> tuple[int, int, int, int]:
    """(matmul, elementwise, transcendentals, m) of the feature map on ``tokens`` positions."""
    h, dk = d.heads, d.d_k
    n = d.batch * tokens * h
    m = d.features  # favor_plus: x~ scale, proj, |x~|^2, |w|^2, exponent, max, exp, 1/sqrt(m)
    return {
        "elu_plus_one": (0, 4 * n * dk, n * dk, dk),
        "relu": (0, n * dk, 0, dk),
        "identity": (0, 0, 0, dk),
        "taylor2": (0, n * (dk + 2 * dk * dk), 0, 1 + dk + dk * dk),
    }.get(d.feature_map, (2 * n * dk * m, n * (3 * dk + 5 * m) + 2 * m * dk, n * m, m))


def eps_exp(d: Dims, queries: int) -> int:
    """FAVOR+'s ``eps exp(-c_q)``: one ``exp`` per query and head (none for the other maps)."""
    return d.batch * queries * d.heads if d.feature_map == "favor_plus" else 0


def linear_proj(d: Dims) -> tuple[int, int]:
    pq, pk, pv = projections(d)
    b, h = d.batch, d.heads
    out = 2 * b * d.t_q * h * d.d_v * d.d_model
    return pq + pk + pv + out, qkvo_bias_adds(d) + b * (h - 1) * d.t_q * d.d_model


def normalize_el(d: Dims) -> int:
    """eps add, zero test, safe select, divide and output select per (query, head); FAVOR+'s
    eps rescaling (negate, exp argument, overflow test, two selects, multiply) adds 6."""
    n = d.batch * d.t_q * d.heads
    return (10 if d.feature_map == "favor_plus" else 4) * n + 2 * n * d.d_v


def linear_tensors(d: Dims) -> list[int]:
    """Projections and features (twice each), masked key features, head and pre-bias outputs."""
    b, h, m = d.batch, d.heads, feature_count(d)
    proj = [b * d.t_q * h * d.d_k, b * d.t_k * h * d.d_k, b * d.t_k * h * d.d_v]
    feats = [b * d.t_q * h * m, b * d.t_k * h * m]
    rest = [b * d.t_k * h * m, b * d.t_q * h * d.d_v, b * d.t_q * d.d_model]
    return 2 * proj + 2 * feats + rest


def linear(d: Dims, form_mm: int, form_el: int, tensors: list[int], **loop: Any) -> Cost:
    mmq, elq, trq, m = feature_cost(d, d.t_q)
    mmk, elk, trk, _ = feature_cost(d, d.t_k)
    mm_p, el_p = linear_proj(d)
    el = elq + elk + el_p + form_el + normalize_el(d) + d.batch * d.t_k * d.heads * m  # key mask
    el += weight_guard_elementwise(d, pairs=False)
    tr = trq + trk + eps_exp(d, d.t_q)
    return build(d, mm_p + mmq + mmk + form_mm, el, tr, linear_tensors(d) + tensors, **loop)


def feature_count(d: Dims) -> int:
    return feature_cost(d, 1)[3]


# ----------------------------------------------------------------------------- RoPE

ROTATE_PER_PAIR = 6  # a*c, b*s, a*c - b*s, a*s, b*c, a*s + b*c


def angles(positions: int, d: Dims, traced: bool) -> tuple[int, int, list[int]]:
    """(elementwise, transcendentals, tensors) of ``cos``/``sin`` of ``m theta_p``; with constant
    positions and ``d_k = 2`` the angle is the position and XLA folds both."""
    n = positions * (d.d_k // 2)
    folded = d.d_k == 2 and not traced
    return (0, 0, [n, n, n]) if folded else (n, 2 * n, [n, n, n])  # angle, cos, sin


def cost(formulation_id: str, dims: Dims) -> Cost:
    """The :class:`Cost` of registered formulation ``formulation_id`` on ``dims`` (its
    ``cost_model``); ``KeyError`` if it is not registered or has no cost model."""
    from attnref._src.core.registry import get  # lazily: the models' modules import this one

    try:
        model, why = get(formulation_id).cost_model, ""
    except KeyError:
        model, why = None, ": not a registered formulation"
    if model is None:
        raise KeyError(f"no cost model for {formulation_id!r}{why}")
    return model(dims)  # type: ignore[no-any-return]


# ----------------------------------------------------------------------------- XLA's counts


def hlo_collectives(hlo_text: str) -> tuple[Collective, ...]:
    """The collectives of optimised per-device HLO text (``...compile().as_text()``),
    one :class:`Collective` per instruction with its run count (``while`` trips included; an
    upper bound in a ``conditional`` branch) and summed operand bytes.

    Raises:
        ValueError: For a collective in a ``while`` with no known trip count, or an async one.
    """
    return tuple(Collective(*call) for call in collective_calls(hlo_text))


@dataclasses.dataclass(frozen=True)
class XlaCounts:
    """XLA's own counts for one compiled function (see :func:`xla_counts`).

    Attributes:
        flops: ``cost_analysis()["flops"]``: dots plus every elementwise op XLA executes.
        transcendentals: ``cost_analysis()["transcendentals"]``.
        dot_flops: The dot FLOPs of the optimised HLO (:func:`hlo_dot_flops`).
        temp_bytes: ``memory_analysis().temp_size_in_bytes``.
        collectives: The collectives of the optimised HLO (:func:`hlo_collectives`).
    """

    flops: float
    transcendentals: float
    dot_flops: int
    temp_bytes: int
    collectives: tuple[Collective, ...] = ()

    @property
    def other_flops(self) -> float:
        """Elementwise work as XLA counts it (fusion may duplicate cheap producers)."""
        return self.flops - self.dot_flops


def xla_counts(fn: Callable[..., object], *args: object, **kwargs: object) -> XlaCounts:
    """:class:`XlaCounts` of ``fn`` (``jax.jit``-wrapped) compiled for ``args`` and ``kwargs``
    (arrays or ``jax.ShapeDtypeStruct``); a ``while`` body is counted once."""
    compiled = fn.lower(*args, **kwargs).compile()  # type: ignore[attr-defined]
    ca = compiled.cost_analysis()
    ca = ca[0] if isinstance(ca, (list, tuple)) else ca
    text = compiled.as_text()
    return XlaCounts(
        float(ca.get("flops", 0.0)),
        float(ca.get("transcendentals", 0.0)),
        hlo_dot_flops(text),
        int(compiled.memory_analysis().temp_size_in_bytes),
        hlo_collectives(text),
    )
