"""The LINEAR family, the cost models (``<id>_cost``) of its forms and their registry entries."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from attnref import oracle, tolerance
from attnref._src.core import cost as _cost
from attnref._src.core.family import Example, ExampleProblem, Family
from attnref._src.core.registry import REFACTOR, Formulation, register
from attnref._src.formulations.feature_maps import feature_map_from_name
from attnref._src.formulations.linear import kernel, multihead


def linear_required(problem: ExampleProblem) -> dict[str, Any]:
    """The feature map the problem names (FAVOR+ gets ``2 d_k`` orthogonal features)."""
    fm = feature_map_from_name(
        problem.feature_map, seed=problem.seed, d=problem.d_k, num_features=2 * problem.d_k
    )
    return {"feature_map": fm}


def linear_example(problem: ExampleProblem, causal: bool) -> Example:
    """Causality is the ``causal`` flag, and a causal form is self-attention (``T_q == T_k``)."""
    note = f"{problem.feature_map}, {'causal' if causal else 'non-causal'}"
    return Example({**linear_required(problem), "causal": causal}, causal, note)


LINEAR = Family(
    name="linear",
    oracle=oracle.linear_multihead,
    bound=tolerance.linear_multihead_error_bound,
    signature="apply(params, x_q, x_kv=None, *, feature_map, causal=..., key_mask=None, "
    "eps=0.0, eps_policy='add', residual=False)",
    note="Feature map $\\phi$ from `attnref.linear.elu_plus_one`, "
    "`attnref.linear.relu_features`, `attnref.linear.identity_features`, "
    "`attnref.linear.taylor2` or `attnref.linear.favor_plus`. Denominator policy: "
    "`eps_policy='add'` divides by $D_i + \\epsilon$ (fast-transformers), `'clamp'` by "
    "$\\max(D_i, \\epsilon)$; the default $\\epsilon = 0$ is the exact ratio, and an exactly "
    "zero adjusted denominator (no allowed key) gives a zero output. With the signed `identity` "
    "map the denominator can be near zero and the ratio grows like $1/D_i$; attnref reproduces "
    "that rather than hiding it (see [linear attention](../linear_attention.md)).",
    equation_symbols=("phi",),
    static_argnames=("causal", "eps_policy", "residual"),
    required_kwargs=linear_required,
    example=linear_example,
)


# ----------------------------------------------------------------------------- registry entries

KATHAROPOULOS = (
    "Katharopoulos et al. (2020), Transformers are RNNs: Fast Autoregressive Transformers with "
    "Linear Attention, ICML."
)
CHOROMANSKI = "Choromanski et al. (2021), Rethinking Attention with Performers, ICLR (FAVOR+)."
LIN_EQ = (
    r"y_{i,h} = \frac{\sum_{j \in \mathcal{A}(i)} \phi(q_{i,h})^\top \phi(k_{j,h})\,"
    r" v_{j,h}^\top}{\sum_{j \in \mathcal{A}(i)} \phi(q_{i,h})^\top \phi(k_{j,h}) + \epsilon}"
)


def linear_quadratic_cost(d: _cost.Dims) -> _cost.Cost:
    b, h, m = d.batch, d.heads, _cost.feature_count(d)
    a = b * h * d.t_q * d.t_k
    outs = [b * d.t_q * h * d.d_v, b * d.t_q * h]
    return _cost.linear(d, 2 * a * (m + d.d_v), a * (2 if d.causal else 1), [a, a, *outs])


def linear_associative_cost(d: _cost.Dims) -> _cost.Cost:
    b, h, m = d.batch, d.heads, _cost.feature_count(d)
    mm = 2 * b * h * m * d.d_v * d.t_k + 2 * b * d.t_q * h * m * (d.d_v + 1)
    outs = [b * h * m * d.d_v, b * h * m, b * d.t_q * h * d.d_v, b * d.t_q * h]
    return _cost.linear(d, mm, b * h * m * d.t_k, outs)


def linear_prefix_sum_cost(d: _cost.Dims) -> _cost.Cost:
    b, h, m, t = d.batch, d.heads, _cost.feature_count(d), d.t_q
    states = b * t * h * m * (d.d_v + 1)
    log_t = max(1, math.ceil(math.log2(t)))
    # outer products (1 flop/element), cumsum (an associative scan: <= 2 log2(T) passes), and
    # the denominator phi(q).z, a contraction with no free dimension that XLA lowers to a
    # multiply and a reduction (2m - 1 elementwise flops), not a dot.
    el = b * t * h * m * d.d_v + 2 * log_t * states + b * t * h * (2 * m - 1)
    kv, zs = b * t * h * m * d.d_v, b * t * h * m
    tensors = [kv, kv, kv, zs, zs, zs, b * t * h * d.d_v, b * t * h]  # outer, scan temporaries
    return _cost.linear(d, 2 * b * t * h * m * d.d_v, el, tensors)


def linear_recurrent_cost(d: _cost.Dims) -> _cost.Cost:
    b, h, m, t = d.batch, d.heads, _cost.feature_count(d), d.t_q
    mm_f, el_f, tr_f, _ = _cost.feature_cost(dataclasses.replace(d, t_q=1, t_k=1), 1)
    step_mm = 2 * b * h * m * d.d_v + 2 * mm_f  # read-out phi(q) S; features of q_t and k_t
    # state update (outer product, adds), phi(q).z (multiply + reduce), features, normalise
    step_el = (
        2 * b * h * m * d.d_v
        + 2 * b * h * m
        + b * h * (2 * m - 1)
        + 2 * el_f
        + _cost.normalize_el(dataclasses.replace(d, t_q=1))
    )
    mm_p, el_p = _cost.linear_proj(d)
    proj = [b * t * h * d.d_k, b * t * h * d.d_k, b * t * h * d.d_v]
    # projections and their time-major copies, the mask, the state, the outputs
    every = [*proj * 3, b * t, b * h * m * d.d_v, b * h * m]
    every += [b * t * h * d.d_v, b * t * h * d.d_v, b * t * d.d_model]
    step_tr = 2 * tr_f + _cost.eps_exp(d, 1)
    return _cost.build(
        d,
        mm_p + t * step_mm,
        el_p + t * step_el + b * t * h * m + _cost.weight_guard_elementwise(d, pairs=False),
        t * step_tr,
        every,
        loop_trips=t,
        per_trip_matmul_flops=step_mm,
        per_trip_elementwise_flops=step_el,
        per_trip_transcendentals=step_tr,
    )


def linear_chunked_cost(d: _cost.Dims) -> _cost.Cost:
    b, h, m, t, c = d.batch, d.heads, _cost.feature_count(d), d.t_q, d.chunk
    n = math.ceil(t / c)
    a = b * h * c * c
    step_mm = 2 * a * (m + d.d_v) + 2 * b * c * h * m * (d.d_v + 1) + 2 * b * h * m * d.d_v * c
    step_el = (
        a * 2
        + 2 * b * h * m * (d.d_v + 1)
        + b * c * h * m
        + _cost.normalize_el(dataclasses.replace(d, t_q=c))
    )
    padded = b * n * c * h
    chunked = [padded * m, padded * m, padded * d.d_v] * 2  # padded, then chunk-major copies
    tensors = [*chunked, a, a, b * h * m * d.d_v, b * h * m, padded * d.d_v, padded * d.d_v]
    base = _cost.linear(dataclasses.replace(d, t_q=t, t_k=t), 0, 0, tensors)
    return dataclasses.replace(
        base,
        matmul_flops=base.matmul_flops + n * step_mm,
        elementwise_flops=base.elementwise_flops
        - _cost.normalize_el(d)
        + n * step_el
        + 2 * b * n * c * h * (m + d.d_v),  # padding to whole chunks
        # the eps rescaling runs inside the loop, on every (padded) chunk of queries
        transcendentals=base.transcendentals - _cost.eps_exp(d, t) + n * _cost.eps_exp(d, c),
        loop_trips=n,
        per_trip_matmul_flops=step_mm,
        per_trip_elementwise_flops=step_el,
        per_trip_transcendentals=_cost.eps_exp(d, c),
    )


def linear_messages_cost(d: _cost.Dims) -> _cost.Cost:
    b, h, m, dm = d.batch, d.heads, _cost.feature_count(d), d.d_model
    a = b * h * d.t_q * d.t_k
    pq, pk, _ = _cost.projections(d)
    mmq, elq, trq, _ = _cost.feature_cost(d, d.t_q)
    mmk, elk, trk, _ = _cost.feature_cost(d, d.t_k)
    mm_m, el_m = _cost.messages(d)
    mm_x, el_x = _cost.mix(d)
    mm = pq + pk + mmq + mmk + 2 * a * m + mm_m + mm_x
    el = (
        elq
        + elk
        + a * (2 if d.causal else 1)
        + 4 * a
        + el_m
        + el_x
        + _cost.bias_adds(d, b * d.t_q * h * d.d_k, b * d.t_k * h * d.d_k, 0, 0)
        + b * d.t_k * h * m
        + _cost.weight_guard_elementwise(d, pairs=False)
    )
    every = [*_cost.linear_tensors(d), a, a, a, b * h * d.t_q]  # A, masked, normalised; den
    every += [h * dm * dm, b * h * d.t_k * dm, b * h * d.t_k * dm, b * h * d.t_q * dm]  # messages
    return _cost.build(d, mm, el, trq + trk + _cost.eps_exp(d, d.t_q), every)


def register_linear(form: str, **entry: Any) -> None:
    """Register the form ``form`` (``"quadratic"``, ...) of the LINEAR family: the entry
    ``linear_<form>`` with convention ``kernel`` and citation :data:`KATHAROPOULOS` unless
    ``entry`` says, and (unless ``entry`` names them) the public
    ``multihead.linear_<form>_attention`` (apply), the formula ``kernel.<form>`` and the kernel
    ``kernel.linear_<form>`` (native)."""
    fid = f"linear_{form}"
    defaults = {"id": fid, "convention": "kernel", "citation": KATHAROPOULOS, "family": LINEAR}
    if "apply" not in entry:
        defaults["apply"] = getattr(multihead, f"{fid}_attention")
        defaults["formula"] = getattr(kernel, form)
        defaults["native"] = getattr(kernel, fid)
    register(Formulation(**{**defaults, **entry}))


register_linear(
    "quadratic",
    cost_model=linear_quadratic_cost,
    title="Linear attention, quadratic form",
    equation=(
        r"Y_h = \frac{(\phi(Q_h)\phi(K_h)^\top \odot M)\, V_h}"
        r"{(\phi(Q_h)\phi(K_h)^\top \odot M)\,\mathbf{1} + \epsilon},\quad " + LIN_EQ
    ),
    citation=KATHAROPOULOS + " Feature maps: " + CHOROMANSKI,
    summary=(
        "The T x T kernel matrix materialised, masked (causal and/or key padding), row-normalised."
    ),
    cost="FLOPs O(H T_q T_k (m + d_v)); memory O(H T_q T_k). m = number of features.",
)

register_linear(
    "associative",
    cost_model=linear_associative_cost,
    title="Linear attention, associative (non-causal) form",
    equation=(
        r"Y_h = \frac{\phi(Q_h)\,\big(\phi(K_h)^\top V_h\big)}"
        r"{\phi(Q_h)\,\big(\phi(K_h)^\top \mathbf{1}\big) + \epsilon},\ h = 1, \dots, H"
    ),
    summary="Associativity turns O(T^2 d) into O(T m d_v): keys and values are summarised first.",
    cost="FLOPs O(H (T_q + T_k) m d_v); memory O(H m d_v): linear in T.",
    causal_modes=(False,),
)

register_linear(
    "prefix_sum",
    cost_model=linear_prefix_sum_cost,
    title="Linear attention, causal prefix sums",
    equation=(
        r"S_{t,h} = \sum_{j \le t} \phi(k_{j,h}) v_{j,h}^\top,\ z_{t,h} = \sum_{j \le t}"
        r" \phi(k_{j,h}),\quad y_{t,h} = \frac{\phi(q_{t,h})^\top S_{t,h}}{\phi(q_{t,h})^\top"
        r" z_{t,h} + \epsilon}"
    ),
    summary="Cumulative sums of phi(k) v^T and phi(k) give every causal prefix at once.",
    cost="FLOPs O(H T m d_v); memory O(H T m d_v) for the prefix states.",
    causal_modes=(True,),
)

register_linear(
    "recurrent",
    cost_model=linear_recurrent_cost,
    title="Linear attention, recurrent (RNN) form",
    equation=(
        r"S_{t,h} = S_{t-1,h} + \phi(k_{t,h}) v_{t,h}^\top,\ z_{t,h} = z_{t-1,h} +"
        r" \phi(k_{t,h}),\quad y_{t,h} = \frac{\phi(q_{t,h})^\top S_{t,h}}{\phi(q_{t,h})^\top"
        r" z_{t,h} + \epsilon}"
    ),
    summary=(
        "A lax.scan over the constant-size state (S_t, z_t): the decoding view, O(m d_v) memory."
    ),
    cost=(
        "FLOPs O(H T m d_v) in T sequential steps; memory O(H m d_v), constant in T "
        "(the KV-cache analogue)."
    ),
    causal_modes=(True,),
)

register_linear(
    "chunked",
    cost_model=linear_chunked_cost,
    title="Linear attention, chunked form",
    equation=(
        r"y_{t,h} = \frac{\phi(q_{t,h})^\top \big(S_{c-1,h} + \sum_{j \in c,\, j \le t}"
        r" \phi(k_{j,h}) v_{j,h}^\top\big)}{\phi(q_{t,h})^\top \big(z_{c-1,h} + \sum_{j \in c,"
        r"\, j \le t} \phi(k_{j,h})\big) + \epsilon},\ t \in \text{chunk } c"
    ),
    citation=KATHAROPOULOS + " Chunkwise evaluation as in later linear-attention kernels.",
    summary=(
        "Quadratic inside each chunk, the state carried between chunks by lax.scan; any chunk size."
    ),
    cost=(
        "FLOPs O(H T (C (m + d_v) + m d_v)) for chunk size C, T / C sequential steps; "
        "memory O(H (C^2 + m d_v))."
    ),
    causal_modes=(True,),
    static_argnames=(*LINEAR.static_argnames, "chunk_size"),
)

register_linear(
    "messages",
    cost_model=linear_messages_cost,
    title="Linear attention, scores x messages",
    equation=(
        r"Y = \sum_{i=1}^{H} \mathrm{rownorm}\big(\phi(Q_i)\phi(K_i)^\top \odot M\big)\,"
        r" \big(X_{kv} W_{M,i}\big) + b_O"
    ),
    convention="row",
    citation=KATHAROPOULOS + " Messages view: " + REFACTOR,
    apply=multihead.linear_messages_attention,
    native=multihead.linear_messages_attention,
    summary="The normalised linear attention matrix of each head times its messages X W_M.",
    cost=(
        "FLOPs O(H T_q T_k (m + d_model) + H T_k d_model^2); memory O(H T_q T_k + H T_k d_model)."
    ),
)
