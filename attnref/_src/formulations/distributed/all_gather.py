"""All-gather context parallelism (the Llama 3 report, Grattafiori et al. 2024).

Queries stay in the load-balanced zigzag layout (device ``d`` holds chunks ``d`` and
``2P - 1 - d`` of ``2P``); each device gathers every key and value with their global positions
and computes its queries against *all* keys in one piece (no state merge)::

    K_all, V_all = all_gather(K_d), all_gather(V_d)          # [B, S', K, H], [B, S', K, H_v]
    o_i = softmax_j(s_ij, allowed(p_i, p_j)) v_j             # i on device d, every j

then the kernel's finishing rules. The backward (autodiff) reduce-scatters ``dK`` and ``dV``.
Padding and communication: ``docs/distributed.md``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as Spec
from jaxtyping import Array

from attnref._src.formulations.distributed.chunk import chunk_state, value_sum
from attnref._src.formulations.distributed.family import (
    MeshRun,
    mesh_kernel,
    mesh_schedule,
    register_scheme,
    scheme_rows,
)
from attnref._src.formulations.distributed.layout import (
    LocalInputs,
    from_layout,
    padded_length,
    positions,
    shard_inputs,
)
from attnref._src.formulations.kernel import finish, uniform_rows
from attnref._src.formulations.kernel_spec import KernelInputs, lengths_only

LAYOUT = "zigzag"


def _all_gather(
    mesh_run: MeshRun, inputs: KernelInputs, traced_scale: Array | None
) -> tuple[Array, Array]:
    """Zigzag layout, gather K/V, local queries against every key; ``(o, lse)`` global."""
    spec, scale, mesh, axis, devices = mesh_run
    t_pad, s_pad = padded_length(spec.t, devices, LAYOUT), padded_length(spec.s, devices, LAYOUT)
    traced = traced_scale is not None
    local, specs = shard_inputs(inputs, LAYOUT, devices, axis, t_pad, s_pad, traced)
    local = dataclasses.replace(local, scale=traced_scale)  # the caller's scale, when traced
    q_table = positions(t_pad, devices, LAYOUT)
    k_table = positions(s_pad, devices, LAYOUT).reshape(-1)  # every gathered key's position

    def gather(a: Any) -> Any:
        return None if a is None else jax.lax.all_gather(a, axis, axis=1, tiled=True)

    def body(a: LocalInputs) -> tuple[Array, Array]:
        q_pos, k_pos = jnp.asarray(q_table)[jax.lax.axis_index(axis)], jnp.asarray(k_table)
        lengths = lengths_only(a.q_lens, a.kv_lens)
        k, v, kv_seg = gather(a.k), gather(a.v), gather(a.kv_seg)
        a_scale = scale if a.scale is None else a.scale
        o, lse = chunk_state(
            spec, lengths, a_scale, a.q, q_pos, a.q_seg, k, v, k_pos, kv_seg, a.bias, a.mask
        )
        mean_v = None
        if spec.masked_rows == "uniform":
            mean_v = uniform_rows(spec, value_sum(spec, v, k_pos))
        return finish(spec, lengths, o, lse, ~jnp.isneginf(lse), q_pos, mean_v)

    out_spec = Spec(None, axis)
    run = jax.shard_map(body, mesh=mesh, in_specs=(specs,), out_specs=(out_spec, out_spec))
    out, lse = (from_layout(a, 1, spec.t, devices, LAYOUT) for a in run(local))
    return out, lse


all_gather_dot_product_attention = mesh_kernel(
    mesh_schedule(_all_gather),
    name="all_gather_dot_product_attention",
    summary=(
        "``attnref.dot_product_attention`` by all-gather context parallelism (Llama 3).\n\n"
        "Queries in the zigzag layout (device ``d`` holds chunks ``d`` and ``2P - 1 - d`` of "
        "``2P``);\nevery device all-gathers ``k`` and ``v`` and computes "
        "``o_i = softmax_j(s_ij, allowed) v_j``\nfor its queries against every key. Semantics, "
        "results and errors are those of\n:func:`attnref.dot_product_attention` "
        "(``docs/kernel.md``)."
    ),
    axis="to split the sequence over",
    returns=" Natural token order.",
)
all_gather_attention = scheme_rows(all_gather_dot_product_attention)


register_scheme(
    "all_gather",
    all_gather_attention,
    all_gather_dot_product_attention,
    title="All-gather context parallelism (zigzag queries, every key gathered)",
    equation=(
        r"K' = \mathrm{all\_gather}_d(K_{\mathcal{T}_d}),\ V' = \mathrm{all\_gather}_d"
        r"(V_{\mathcal{T}_d}),\quad O_{\mathcal{T}_d, n} = \mathrm{softmax}\Big(\frac{Q_"
        r"{\mathcal{T}_d, n} K'^\top_{g(n)}}{\sqrt{d_k}} + B_{\mathcal{T}_d}\Big) V'_{g(n)},"
        r"\ n = 1, \dots, N,\quad"
        r" \mathcal{T}_d = C_d \cup C_{2P-1-d}"
    ),
    citation=(
        "Grattafiori et al. (2024), The Llama 3 Herd of Models, arXiv:2407.21783 (context "
        "parallelism: all-gathered keys and values, each rank holding chunks i and "
        "2P - 1 - i)."
    ),
    formula=_all_gather,
    summary=(
        "Queries stay in the load-balanced zigzag layout (chunks d and 2P-1-d); keys and "
        "values are all-gathered, so each device computes its rows against every key in one "
        "piece (no state merge); the backward reduce-scatters dK and dV."
    ),
    cost=(
        "FLOPs O(B T_q T_k H (d_k + d_v) / P) per device (balanced under a causal mask); "
        "memory O(B T_k K (d_k + d_v)) for the gathered K/V plus O(B H T_q T_k / P) logits; "
        "one all-gather of O(B T_k K (d_k + d_v)) numbers."
    ),
)
