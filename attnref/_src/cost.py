"""Analytic cost model of every registered formulation, in its own order of operations.

Counting conventions (XLA's, so the model can be checked against ``cost_analysis()``):

* **matmul FLOPs**: a contraction of ``M x K`` by ``K x N`` costs ``2 M N K`` (a multiply-add is
  2); exact for each formulation's einsums, including forming ``W_P``, ``W_M``, ``W_A``, ``W_I``.
* **transcendentals**: one per ``exp`` / ``expm1`` element; exact.
* **elementwise FLOPs**: one per element per arithmetic, comparison or select op, ``n - 1`` per
  reduction of ``n`` elements. The model gives an *upper bound* counted from attnref's source
  (e.g. the masked softmax touches each logit with at most 12 such ops and each row with 2);
  XLA's simplifier can only remove work, so ``matmul <= XLA <= matmul + elementwise``.
* **bytes**: inputs (parameters, tokens, masks), the output, the largest intermediate tensor and
  a workspace bound: every intermediate this order of operations produces, all alive at once,
  plus one copy of the inputs (XLA may copy an input to change its layout). XLA's temporary
  memory lies between the largest intermediate (it must be materialised) and the workspace.

Scan-based forms (``linear_recurrent``, ``linear_chunked``) run their body ``T`` (or ``T / C``)
times; XLA's ``cost_analysis`` counts a ``while`` body once, so :class:`Cost` also carries
``loop_trips`` and ``per_trip_*`` for comparing with XLA.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class Dims:
    """Problem sizes. ``batch`` is the product of the batch dims; ``features`` is the linear
    family's feature count ``m`` and ``feature_map`` its name; ``chunk`` the chunk size."""

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


@dataclasses.dataclass(frozen=True)
class Cost:
    matmul_flops: int
    elementwise_flops: int  # an upper bound (see module docstring)
    transcendentals: int
    input_bytes: int
    output_bytes: int
    intermediate_bytes: int  # the largest intermediate tensor
    workspace_bytes: int = 0  # every intermediate at once plus one copy of the inputs
    loop_trips: int = 1  # > 1 for scan-based forms
    per_trip_matmul_flops: int = 0  # the part of matmul_flops inside the loop, per trip
    per_trip_elementwise_flops: int = 0
    per_trip_transcendentals: int = 0

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


# The non-finite guard (``attnref._src.nonfinite``), counted from its source. Per operand element
# (q, k, v, or a token row's entries): isfinite and where for the finite part, then isfinite, not
# and the row reduction for the dirty test. Per logit: the live test, the reads test (and, any),
# and with a bias: isfinite, not, and, any for the dirty test and isnan, == inf, or, where for its
# finite part. Per query row: the or of the dirty terms; per output entry: the poisoning where.
GUARD_PER_OPERAND = 5
GUARD_PER_LOGIT = 3
GUARD_PER_BIASED_LOGIT = 8
GUARD_PER_ROW = 3


def guard_elementwise(d: Dims, *, operands: int, logits: int, rows: int, outputs: int) -> int:
    """Elementwise FLOPs of the non-finite guard on one attention call of these sizes."""
    per_logit = GUARD_PER_LOGIT + (GUARD_PER_BIASED_LOGIT if d.bias else 0)
    return GUARD_PER_OPERAND * operands + per_logit * logits + GUARD_PER_ROW * rows + outputs


# At the weight level (``Prepared.guarded``): the token rows' finite parts and dirty tests
# (GUARD_PER_OPERAND per entry of x_q and x_kv), and per (query, key) pair the allowed set (and,
# != -inf), the live and reads tests (any; and, any), the bias's dirty test (isfinite, not, and,
# any) and finite part (isnan, == inf, or, where); per output entry the poisoning where.
WEIGHT_GUARD_PER_PAIR = 13


def weight_guard_elementwise(d: Dims, *, pairs: bool = True) -> int:
    """Elementwise FLOPs of the weight-level non-finite guard. ``pairs=False``: the linear
    family's O(T) form (running ors over keys instead of a ``T_q x T_k`` test)."""
    b, dm = d.batch, d.d_model
    tokens = GUARD_PER_OPERAND * b * (d.t_q + d.t_k) * dm
    per_pair = WEIGHT_GUARD_PER_PAIR * b * d.t_q * d.t_k if pairs else 4 * b * (d.t_q + d.t_k)
    return tokens + per_pair + GUARD_PER_ROW * b * d.t_q + b * d.t_q * dm


def _io(d: Dims, *, kv_tokens: bool = True) -> tuple[int, int]:
    h, dm = d.heads, d.d_model
    params = h * dm * (2 * d.d_k + d.d_v) + h * d.d_v * dm
    if d.bias:
        params += h * (2 * d.d_k + d.d_v) + dm
    tokens = d.batch * (d.t_q + (d.t_k if kv_tokens else 0)) * dm
    masks = 2 * d.batch * d.t_q * d.t_k  # bias (itemsize) and boolean mask (1 byte) ~ bounded
    inputs = (params + tokens) * d.itemsize + masks * d.itemsize
    return inputs, d.batch * d.t_q * dm * d.itemsize


def _softmax_elementwise(d: Dims) -> int:
    logits = d.batch * d.heads * d.t_q * d.t_k
    return SOFTMAX_PER_LOGIT * logits + SOFTMAX_PER_ROW * d.batch * d.heads * d.t_q


def _bias_adds(d: Dims, q: int, k: int, v: int, out: int) -> int:
    return (q + k + v + out) if d.bias else 0


def _projections(d: Dims) -> tuple[int, int, int]:
    b, h, dm = d.batch, d.heads, d.d_model
    return (
        2 * b * d.t_q * dm * h * d.d_k,
        2 * b * d.t_k * dm * h * d.d_k,
        2 * b * d.t_k * dm * h * d.d_v,
    )


def _softmax_tensors(d: Dims, logits: int) -> list[int]:
    """Logit-sized tensors the masked softmax can materialise (logits, scaled and biased,
    allowed, shifted, exponentials, weights) and its row vectors (any, max, sum, safe sum)."""
    rows = d.batch * d.heads * d.t_q
    return [logits] * 6 + [rows] * 4


def _finish(d: Dims, matmul: int, elementwise: int, trans: int, tensors: list[int]) -> Cost:
    """A weight-level softmax form's cost, with its non-finite guard's elementwise work."""
    inputs, output = _io(d)
    return Cost(
        matmul,
        elementwise + weight_guard_elementwise(d),
        trans,
        inputs,
        output,
        max(tensors) * d.itemsize,
        sum(tensors) * d.itemsize + inputs,
    )


def concat_cost(d: Dims) -> Cost:
    b, h, dm, tq, tk = d.batch, d.heads, d.d_model, d.t_q, d.t_k
    pq, pk, pv = _projections(d)
    logits = b * h * tq * tk
    mm = pq + pk + pv + 2 * logits * (d.d_k + d.d_v) + 2 * b * tq * h * d.d_v * dm
    el = _softmax_elementwise(d) + _bias_adds(
        d, b * tq * h * d.d_k, b * tk * h * d.d_k, b * tk * h * d.d_v, b * tq * dm
    )
    qkv = [b * h * tq * d.d_k, b * h * tk * d.d_k, b * h * tk * d.d_v]
    tail = [b * h * tq * d.d_v, b * tq * h * d.d_v, b * tq * dm]  # heads, concat, y
    return _finish(d, mm, el, logits, qkv + _softmax_tensors(d, logits) + tail)


def per_head_sum_cost(d: Dims) -> Cost:
    c = concat_cost(d)
    head_sum = d.batch * (d.heads - 1) * d.t_q * d.d_model
    per_head = d.batch * d.heads * d.t_q * d.d_model * d.itemsize
    return dataclasses.replace(
        c,
        elementwise_flops=c.elementwise_flops + head_sum,
        intermediate_bytes=max(c.intermediate_bytes, per_head),
        workspace_bytes=c.workspace_bytes + per_head,
    )


def _messages(d: Dims) -> tuple[int, int]:
    """(matmul, elementwise) of ``X_kv W_M + b_V W_O`` including forming ``W_M``."""
    b, h, dm = d.batch, d.heads, d.d_model
    mm = 2 * h * dm * d.d_v * dm + 2 * b * d.t_k * dm * h * dm
    if d.bias:
        mm += 2 * h * d.d_v * dm
    return mm, (b * h * d.t_k * dm if d.bias else 0)


def _message_tensors(d: Dims) -> list[int]:
    """``W_M``, the messages (before and after ``b_V W_O``), per-head mixes and the output."""
    b, h, dm = d.batch, d.heads, d.d_model
    return [h * dm * dm, b * h * d.t_k * dm, b * h * d.t_k * dm, b * h * d.t_q * dm, b * d.t_q * dm]


def _mix(d: Dims) -> tuple[int, int]:
    """(matmul, elementwise) of ``sum_i A_i M_i + b_O``."""
    b, h, dm = d.batch, d.heads, d.d_model
    el = b * (h - 1) * d.t_q * dm + (b * d.t_q * dm if d.bias else 0)
    return 2 * b * h * d.t_q * d.t_k * dm, el


def scores_messages_cost(d: Dims) -> Cost:
    b, h, tq, tk = d.batch, d.heads, d.t_q, d.t_k
    pq, pk, _ = _projections(d)
    logits = b * h * tq * tk
    mm_m, el_m = _messages(d)
    mm_x, el_x = _mix(d)
    mm = pq + pk + 2 * logits * d.d_k + mm_m + mm_x
    el = (
        _softmax_elementwise(d)
        + el_m
        + el_x
        + _bias_adds(d, b * tq * h * d.d_k, b * tk * h * d.d_k, 0, 0)
    )
    tensors = [
        b * h * tq * d.d_k,
        b * h * tk * d.d_k,
        *_softmax_tensors(d, logits),
        *_message_tensors(d),
    ]
    return _finish(d, mm, el, logits, tensors)


def patterns_messages_cost(d: Dims) -> Cost:
    b, h, dm, tq, tk = d.batch, d.heads, d.d_model, d.t_q, d.t_k
    logits = b * h * tq * tk
    mm_p = (
        2 * h * dm * d.d_k * dm + 2 * b * tq * dm * h * dm + (2 * h * d.d_k * dm if d.bias else 0)
    )
    mm_m, el_m = _messages(d)
    mm_x, el_x = _mix(d)
    mm = mm_p + 2 * logits * dm + mm_m + mm_x
    el = _softmax_elementwise(d) + el_m + el_x + (b * h * tq * dm if d.bias else 0)
    tensors = [
        h * dm * dm,
        b * h * tq * dm,
        b * h * tq * dm,
        *_softmax_tensors(d, logits),
        *_message_tensors(d),
    ]
    return _finish(d, mm, el, logits, tensors)


def column_cost(d: Dims) -> Cost:
    b, h, dm, tq, tk = d.batch, d.heads, d.d_model, d.t_q, d.t_k
    logits = b * h * tq * tk
    mm = (
        2 * h * dm * d.d_k * dm
        + 2 * h * dm * dm * b * tq
        + 2 * logits * dm
        + 2 * h * dm * d.d_v * dm
        + 2 * h * dm * dm * b * tk
        + 2 * logits * dm
    )
    el = _softmax_elementwise(d) + b * (h - 1) * tq * dm
    if d.bias:
        mm += 2 * h * dm * d.d_k + 2 * b * tk * dm * h + 2 * h * d.d_v * dm
        el += logits + b * h * tk * dm + b * tq * dm
    tensors = [
        h * dm * dm,
        b * h * dm * tq,
        *_softmax_tensors(d, logits),
        b * h * tk,
        h * dm * dm,
        b * h * dm * tk,
        b * h * dm * tq,
        b * dm * tq,
        b * (tq + tk) * dm,
        b * tq * dm,
    ]  # row-adapter transposes in and out
    return _finish(d, mm, el, logits, tensors)


def soft_search_cost(d: Dims) -> Cost:
    """vmap leaves query-independent work unbatched: the same counts as patterns x messages;
    the workspace adds the full mask and bias broadcasts and the flattened batch copies."""
    c = patterns_messages_cost(d)
    extra = (2 * d.batch * d.t_q * d.t_k + d.batch * (d.t_q + 2 * d.t_k) * d.d_model) * d.itemsize
    return dataclasses.replace(c, workspace_bytes=c.workspace_bytes + extra)


def graph_cost(d: Dims) -> Cost:
    b, h, dm, tq, tk = d.batch, d.heads, d.d_model, d.t_q, d.t_k
    e = tq * tk  # dense adjacency
    pq, pk, pv = _projections(d)
    mm = pq + pk + pv + 2 * b * tq * h * d.d_v * dm
    edges = b * e * h
    el = (
        edges * (2 * d.d_k - 1)  # q*k and its sum over d_k
        + (SOFTMAX_PER_LOGIT + 2) * edges  # segment softmax: max/sum scatters count per edge
        + 2 * edges * d.d_v  # alpha * v and its scatter-add
        + _bias_adds(d, b * tq * h * d.d_k, b * tk * h * d.d_k, b * tk * h * d.d_v, b * tq * dm)
        + 2 * b * h * tq
    )
    per_edge = [edges * d.d_k, edges * d.d_k, edges * d.d_v, edges * d.d_k, edges * d.d_v]
    tensors = [
        b * tq * h * d.d_k,
        b * tk * h * d.d_k,
        b * tk * h * d.d_v,
        *per_edge,
        *[edges] * 8,
        *[b * tq * h] * 4,
        b * tq * h * d.d_v,
        b * tq * dm,
        2 * b * e,
        b * (tq + tk) * dm,
    ]  # q*k, logits, softmax, mask/bias broadcasts
    return _finish(d, mm, el, edges, tensors)


# ----------------------------------------------------------------------------- linear family


def _feature_cost(d: Dims, tokens: int) -> tuple[int, int, int, int]:
    """(matmul, elementwise, transcendentals, m) of the feature map on ``tokens`` positions."""
    h, dk = d.heads, d.d_k
    n = d.batch * tokens * h
    name = d.feature_map
    if name == "elu_plus_one":
        return 0, 4 * n * dk, n * dk, dk
    if name == "relu":
        return 0, n * dk, 0, dk
    if name == "identity":
        return 0, 0, 0, dk
    if name == "taylor2":
        return 0, n * (dk + 2 * dk * dk), 0, 1 + dk + dk * dk
    m = d.features  # favor_plus: x~ scale, proj, |x~|^2, |w|^2, exponent, max, exp, 1/sqrt(m)
    return 2 * n * dk * m, n * (3 * dk + 5 * m) + 2 * m * dk, n * m, m


def _eps_exp(d: Dims, queries: int) -> int:
    """FAVOR+'s ``eps exp(-c_q)`` (eps in the units of the stabilised features): one ``exp`` per
    query and head; the other maps need none."""
    return d.batch * queries * d.heads if d.feature_map == "favor_plus" else 0


def _linear_proj(d: Dims) -> tuple[int, int]:
    pq, pk, pv = _projections(d)
    b, h = d.batch, d.heads
    out = 2 * b * d.t_q * h * d.d_v * d.d_model
    el = _bias_adds(
        d,
        b * d.t_q * h * d.d_k,
        b * d.t_k * h * d.d_k,
        b * d.t_k * h * d.d_v,
        b * d.t_q * d.d_model,
    )
    return pq + pk + pv + out, el + b * (d.heads - 1) * d.t_q * d.d_model


def _normalize_el(d: Dims) -> int:
    """eps add, zero test, safe select, divide and output select per (query, head); FAVOR+'s
    eps rescaling (negate, exp argument, overflow test, two selects, multiply) adds 6."""
    n = d.batch * d.t_q * d.heads
    return (10 if d.feature_map == "favor_plus" else 4) * n + 2 * n * d.d_v


def _linear_tensors(d: Dims) -> list[int]:
    """Projections (and their token-major copies), features with one temporary each, the
    masked key features, the head outputs and the pre-bias output."""
    b, h, m = d.batch, d.heads, _m(d)
    proj = [b * d.t_q * h * d.d_k, b * d.t_k * h * d.d_k, b * d.t_k * h * d.d_v]
    feats = [b * d.t_q * h * m, b * d.t_k * h * m]
    return [
        *proj,
        *proj,
        *feats,
        *feats,
        b * d.t_k * h * m,
        b * d.t_q * h * d.d_v,
        b * d.t_q * d.d_model,
    ]


def _linear(d: Dims, form_mm: int, form_el: int, tensors: list[int], **loop: int) -> Cost:
    mmq, elq, trq, m = _feature_cost(d, d.t_q)
    mmk, elk, trk, _ = _feature_cost(d, d.t_k)
    mm_p, el_p = _linear_proj(d)
    el = elq + elk + el_p + form_el + _normalize_el(d) + d.batch * d.t_k * d.heads * m  # key mask
    el += weight_guard_elementwise(d, pairs=False)
    inputs, output = _io(d)
    every = _linear_tensors(d) + tensors
    return Cost(
        mm_p + mmq + mmk + form_mm,
        el,
        trq + trk + _eps_exp(d, d.t_q),
        inputs,
        output,
        max(every) * d.itemsize,
        sum(every) * d.itemsize + inputs,
        **loop,
    )


def _m(d: Dims) -> int:
    return _feature_cost(d, 1)[3]


def linear_quadratic_cost(d: Dims) -> Cost:
    b, h, m = d.batch, d.heads, _m(d)
    a = b * h * d.t_q * d.t_k
    outs = [b * d.t_q * h * d.d_v, b * d.t_q * h]
    return _linear(d, 2 * a * (m + d.d_v), a * (2 if d.causal else 1), [a, a, *outs])


def linear_associative_cost(d: Dims) -> Cost:
    b, h, m = d.batch, d.heads, _m(d)
    mm = 2 * b * h * m * d.d_v * d.t_k + 2 * b * d.t_q * h * m * (d.d_v + 1)
    outs = [b * h * m * d.d_v, b * h * m, b * d.t_q * h * d.d_v, b * d.t_q * h]
    return _linear(d, mm, b * h * m * d.t_k, outs)


def linear_prefix_sum_cost(d: Dims) -> Cost:
    b, h, m, t = d.batch, d.heads, _m(d), d.t_q
    states = b * t * h * m * (d.d_v + 1)
    log_t = max(1, math.ceil(math.log2(t)))
    # outer products (1 flop/element), cumsum (an associative scan: <= 2 log2(T) passes), and
    # the denominator phi(q).z, a contraction with no free dimension that XLA lowers to a
    # multiply and a reduction (2m - 1 elementwise flops), not a dot.
    el = b * t * h * m * d.d_v + 2 * log_t * states + b * t * h * (2 * m - 1)
    kv, zs = b * t * h * m * d.d_v, b * t * h * m
    tensors = [kv, kv, kv, zs, zs, zs, b * t * h * d.d_v, b * t * h]  # outer, scan temporaries
    return _linear(d, 2 * b * t * h * m * d.d_v, el, tensors)


def linear_recurrent_cost(d: Dims) -> Cost:
    b, h, m, t = d.batch, d.heads, _m(d), d.t_q
    mm_f, el_f, tr_f, _ = _feature_cost(dataclasses.replace(d, t_q=1, t_k=1), 1)
    step_mm = 2 * b * h * m * d.d_v + 2 * mm_f  # read-out phi(q) S; features of q_t and k_t
    # state update (outer product, adds), phi(q).z (multiply + reduce), features, normalise
    step_el = (
        2 * b * h * m * d.d_v
        + 2 * b * h * m
        + b * h * (2 * m - 1)
        + 2 * el_f
        + _normalize_el(dataclasses.replace(d, t_q=1))
    )
    mm_p, el_p = _linear_proj(d)
    inputs, output = _io(d)
    proj = [b * t * h * d.d_k, b * t * h * d.d_k, b * t * h * d.d_v]
    every = [
        *proj,
        *proj,
        *proj,
        b * t,
        b * h * m * d.d_v,
        b * h * m,
        b * t * h * d.d_v,
        b * t * h * d.d_v,
        b * t * d.d_model,
    ]  # + time-major copies, state, outputs
    return Cost(
        mm_p + t * step_mm,
        el_p + t * step_el + b * t * h * m + weight_guard_elementwise(d, pairs=False),
        t * (2 * tr_f + _eps_exp(d, 1)),
        inputs,
        output,
        max(every) * d.itemsize,
        sum(every) * d.itemsize + inputs,
        loop_trips=t,
        per_trip_matmul_flops=step_mm,
        per_trip_elementwise_flops=step_el,
        per_trip_transcendentals=2 * tr_f + _eps_exp(d, 1),
    )


def linear_chunked_cost(d: Dims) -> Cost:
    b, h, m, t, c = d.batch, d.heads, _m(d), d.t_q, d.chunk
    n = math.ceil(t / c)
    a = b * h * c * c
    step_mm = 2 * a * (m + d.d_v) + 2 * b * c * h * m * (d.d_v + 1) + 2 * b * h * m * d.d_v * c
    step_el = (
        a * 2
        + 2 * b * h * m * (d.d_v + 1)
        + b * c * h * m
        + _normalize_el(dataclasses.replace(d, t_q=c))
    )
    padded = b * n * c * h
    chunked = [padded * m, padded * m, padded * d.d_v] * 2  # padded, then chunk-major copies
    tensors = [*chunked, a, a, b * h * m * d.d_v, b * h * m, padded * d.d_v, padded * d.d_v]
    base = _linear(dataclasses.replace(d, t_q=t, t_k=t), 0, 0, tensors)
    return dataclasses.replace(
        base,
        matmul_flops=base.matmul_flops + n * step_mm,
        elementwise_flops=base.elementwise_flops
        - _normalize_el(d)
        + n * step_el
        + 2 * b * n * c * h * (m + d.d_v),  # padding to whole chunks
        # the eps rescaling runs inside the loop, on every (padded) chunk of queries
        transcendentals=base.transcendentals - _eps_exp(d, t) + n * _eps_exp(d, c),
        loop_trips=n,
        per_trip_matmul_flops=step_mm,
        per_trip_elementwise_flops=step_el,
        per_trip_transcendentals=_eps_exp(d, c),
    )


def linear_messages_cost(d: Dims) -> Cost:
    b, h, m, dm = d.batch, d.heads, _m(d), d.d_model
    a = b * h * d.t_q * d.t_k
    pq, pk, _ = _projections(d)
    mmq, elq, trq, _ = _feature_cost(d, d.t_q)
    mmk, elk, trk, _ = _feature_cost(d, d.t_k)
    mm_m, el_m = _messages(d)
    mm_x, el_x = _mix(d)
    mm = pq + pk + mmq + mmk + 2 * a * m + mm_m + mm_x
    el = (
        elq
        + elk
        + a * (2 if d.causal else 1)
        + 4 * a
        + el_m
        + el_x
        + _bias_adds(d, b * d.t_q * h * d.d_k, b * d.t_k * h * d.d_k, 0, 0)
        + b * d.t_k * h * m
        + weight_guard_elementwise(d, pairs=False)
    )
    inputs, output = _io(d)
    every = [
        *_linear_tensors(d),
        a,
        a,
        a,
        b * h * d.t_q,
        h * dm * dm,
        b * h * d.t_k * dm,
        b * h * d.t_k * dm,
        b * h * d.t_q * dm,
    ]  # A, masked, normalised; W_M, messages
    return Cost(
        mm,
        el,
        trq + trk + _eps_exp(d, d.t_q),
        inputs,
        output,
        max(every) * d.itemsize,
        sum(every) * d.itemsize + inputs,
    )


# ----------------------------------------------------------------------------- kernel era

BLOCK_Q, BLOCK_K = 3, 2  # the registry entry's tile sizes (blockwise_multihead's defaults)
# Per logit of a tile, from attnref._src.blockwise: two index tests and their "and", the mask
# "and", bias != -inf and its "and", the column and row "any", scale, + bias, where before the
# max, the max, s - shift, two wheres around exp, the row sum.
BLOCK_PER_LOGIT = 17
# Per query row of a tile: maximum, == -inf, where, m - shift, alpha * l, + sum, and the
# accumulator's alpha * acc + pv (2 per value entry, counted separately).
BLOCK_PER_ROW = 6


def _tiles(d: Dims) -> tuple[int, int, int, int]:
    bq, bk = min(BLOCK_Q, d.t_q), min(BLOCK_K, d.t_k)
    return bq, bk, math.ceil(d.t_q / bq), math.ceil(d.t_k / bk)


def blockwise_cost(d: Dims) -> Cost:
    """Online softmax over ``n_q x n_k`` tiles (padded to whole tiles); XLA counts one tile."""
    b, h, dm = d.batch, d.heads, d.d_model
    bq, bk, nq, nk = _tiles(d)
    pq, pk, pv = _projections(d)
    tile_logits = b * h * bq * bk
    step_mm = 2 * tile_logits * (d.d_k + d.d_v)
    step_el = (
        BLOCK_PER_LOGIT * tile_logits
        + (BLOCK_PER_ROW + 2 * d.d_v) * b * h * bq
        + guard_elementwise(
            d,
            operands=b * bq * h * d.d_k + b * bk * h * (d.d_k + d.d_v),
            logits=tile_logits,
            rows=b * h * bq,
            outputs=0,
        )
    )
    step_tr = tile_logits + b * h * bq  # exp of the tile, exp(m - m')
    out_mm = 2 * b * d.t_q * h * d.d_v * dm
    rows = b * h * nq * bq
    # l > 0, where, a / l; poisoning the dirty rows; head sum
    tail_el = rows * (2 * d.d_v + 4) + b * d.t_q * dm * (h - 1)
    kernel_operands = b * d.t_q * h * d.d_k + b * d.t_k * h * (d.d_k + d.d_v)
    el = (
        step_el * nq * nk
        + tail_el
        + weight_guard_elementwise(d)
        + GUARD_PER_OPERAND * kernel_operands  # the kernel's finite parts and dirty tests
        + _bias_adds(
            d, b * d.t_q * h * d.d_k, b * d.t_k * h * d.d_k, b * d.t_k * h * d.d_v, b * d.t_q * dm
        )
    )
    tp, sp = nq * bq, nk * bk
    inputs, output = _io(d)
    tensors = [
        b * d.t_q * h * d.d_k,  # projections
        b * d.t_k * h * d.d_k,
        b * d.t_k * h * d.d_v,
        b * tp * h * d.d_k,  # padded to whole tiles
        b * sp * h * d.d_k,
        b * sp * h * d.d_v,
        b * tp * d.t_k,  # padded mask and bias (one head)
        b * tp * sp,
        b * tp * sp,
        3 * rows + rows * d.d_v,  # m, l, acc stacked over query tiles
        b * d.t_q * h * d.d_v,
        b * d.t_q * dm,
        8 * tile_logits,  # one tile's logits, allowed, probabilities and their temporaries
    ]
    return Cost(
        pq + pk + pv + nq * nk * step_mm + out_mm,
        el,
        nq * nk * step_tr,
        inputs,
        output,
        max(b * sp * h * max(d.d_k, d.d_v), b * d.t_q * dm) * d.itemsize,
        sum(tensors) * d.itemsize + inputs,
        loop_trips=nq * nk,
        per_trip_matmul_flops=step_mm,
        per_trip_elementwise_flops=step_el,
        per_trip_transcendentals=step_tr,
    )


def kv_cache_cost(d: Dims) -> Cost:
    """Keys and values projected into a cache once, then ``T_q`` steps of one query each."""
    b, h, dm, tk = d.batch, d.heads, d.d_model, d.t_k
    pq, pk, pv = _projections(d)
    row = b * h * tk  # one step's logits
    step_mm = 2 * row * (d.d_k + d.d_v)
    # the naive kernel's masked softmax on one row of logits, plus building the allowed set from
    # slot positions, the mask row and the bias row (gathers, compares, where)
    step_el = (SOFTMAX_PER_LOGIT + 6) * row + SOFTMAX_PER_ROW * b * h + b * h * d.d_k
    step_el += guard_elementwise(
        d,
        operands=b * h * d.d_k + b * tk * h * (d.d_k + d.d_v),
        logits=row,
        rows=b * h,
        outputs=b * h * (d.d_v + 1),
    )
    out_mm = 2 * b * d.t_q * h * d.d_v * dm
    el = (
        step_el * d.t_q
        + b * d.t_q * dm * (h - 1)
        + weight_guard_elementwise(d)
        + _bias_adds(
            d, b * d.t_q * h * d.d_k, b * tk * h * d.d_k, b * tk * h * d.d_v, b * d.t_q * dm
        )
    )
    inputs, output = _io(d)
    cache = [b * tk * h * d.d_k, b * tk * h * d.d_v, b * tk]  # keys, values, positions
    tensors = [
        b * d.t_q * h * d.d_k,
        *cache,
        *cache,  # the scatter's output and its operand
        b * d.t_q * tk,  # mask and bias rows, time-major
        b * d.t_q * tk,
        10 * row,  # one step's logits and softmax temporaries
        b * d.t_q * h * d.d_v,
        b * d.t_q * h * d.d_v,
        b * d.t_q * dm,
    ]
    return Cost(
        pq + pk + pv + d.t_q * step_mm + out_mm,
        el,
        d.t_q * row,
        inputs,
        output,
        max(b * tk * h * max(d.d_k, d.d_v), b * d.t_q * dm) * d.itemsize,
        sum(tensors) * d.itemsize + inputs,
        loop_trips=d.t_q,
        per_trip_matmul_flops=step_mm,
        per_trip_elementwise_flops=step_el,
        per_trip_transcendentals=row,
    )


def cost(formulation_id: str, dims: Dims) -> Cost:
    """The analytic cost of a registered formulation on ``dims`` (its registry ``cost_model``)."""
    from attnref._src.registry import get  # the registry imports this module's models

    try:
        model = get(formulation_id).cost_model
    except KeyError:
        raise KeyError(
            f"no cost model for {formulation_id!r}: not a registered formulation"
        ) from None
    if model is None:
        raise KeyError(f"no cost model for {formulation_id!r}")
    return model(dims)  # type: ignore[no-any-return]


# ----------------------------------------------------------------------------- XLA's counts

_INSTR = re.compile(r"%([\w.\-]+) = \w+\[([\d,]*)\]")
_DOT = re.compile(
    r"= \w+\[([\d,]*)\]\S* dot\(%([\w.\-]+), %[\w.\-]+\).*?lhs_contracting_dims=\{([\d,]*)\}"
)


def _dims(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(",") if v)


def hlo_dot_flops(hlo_text: str) -> int:
    """``2 * prod(output) * prod(contracted lhs dims)`` summed over the ``dot`` instructions of
    optimised HLO text (a ``while`` body's dots are counted once, as ``cost_analysis`` does)."""
    shapes = {m.group(1): _dims(m.group(2)) for m in _INSTR.finditer(hlo_text)}
    total = 0
    for m in _DOT.finditer(hlo_text):
        out, lhs = _dims(m.group(1)), shapes[m.group(2)]
        total += 2 * math.prod(out) * math.prod(lhs[c] for c in _dims(m.group(3)))
    return total


@dataclasses.dataclass(frozen=True)
class XlaCounts:
    flops: float  # cost_analysis()["flops"]: dots plus every elementwise op XLA executes
    transcendentals: float
    dot_flops: int  # from the optimised HLO's dot instructions
    temp_bytes: int  # memory_analysis().temp_size_in_bytes

    @property
    def other_flops(self) -> float:
        """Elementwise work as XLA counts it (fusion may duplicate cheap producers)."""
        return self.flops - self.dot_flops


def xla_counts(fn: Callable[..., object], *args: object, **kwargs: object) -> XlaCounts:
    """Compile ``fn`` (already ``jax.jit``-wrapped) for ``args`` and read XLA's counts."""
    compiled = fn.lower(*args, **kwargs).compile()  # type: ignore[attr-defined]
    ca = compiled.cost_analysis()
    ca = ca[0] if isinstance(ca, (list, tuple)) else ca
    return XlaCounts(
        float(ca.get("flops", 0.0)),
        float(ca.get("transcendentals", 0.0)),
        hlo_dot_flops(compiled.as_text()),
        int(compiled.memory_analysis().temp_size_in_bytes),
    )
