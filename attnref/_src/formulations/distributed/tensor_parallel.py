"""Tensor-parallel heads (Megatron-LM, Shoeybi et al. 2019): the heads are split over the devices.

``y = sum_n o_n W_O[n] + b_O`` is a sum over independent heads: device ``d`` holds query heads
``d N/P, ..., (d + 1) N/P - 1`` and the K/V heads they read. The kernel level runs the local
heads with no communication (the output stays sharded on its head axis); the row form projects,
attends and writes its partial ``sum_{n on d} o_n W_O[n]``, and one ``lax.psum`` (an all-reduce
of ``B T d_model`` numbers) gives the block output, then ``+ b_O``. ``P`` must divide ``N``; K/V
heads are repeated ``lcm(K, P) / K`` times when ``P`` does not divide ``K`` (as Megatron-LM
replicates them). The head-splitting helpers are shared with Ulysses. Gradients are autodiff.
See ``docs/distributed.md``.
"""

from __future__ import annotations

import functools
import math
from typing import Any, cast

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as Spec
from jaxtyping import Array, Float

from attnref._src.core.checks import PARAM_FIELDS, device_array
from attnref._src.core.common import Call, Prepared, add_output_bias, residual_or
from attnref._src.core.params import AttentionParams
from attnref._src.formulations.distributed.family import (
    MeshRun,
    check_heads,
    head_mesh,
    mesh_args,
    mesh_axis,
    mesh_kernel,
    mesh_schedule,
    optional,
    register_scheme,
    scheme_rows,
    split_scale,
)
from attnref._src.formulations.kernel import dot_product_attention, kernel_rows, row_call
from attnref._src.formulations.kernel_spec import KernelInputs, KernelSpec
from attnref._src.formulations.standard import Bias, Keys, Mask, Params, Queries

# ----------------------------------------------------------------------------- head splitting


def kv_repeats(n: int, k: int, devices: int) -> int:
    """``r = lcm(K, P) / K``: the copies of each K/V head that make ``K r`` divisible by ``P``."""
    r = math.lcm(k, devices) // k
    assert n % (k * r) == 0, (n, k, devices)
    return r


def repeat_kv(a: Array, r: int, axis: int = 2) -> Array:
    """Each K/V head repeated ``r`` times along ``axis`` (``k`` becomes ``k r .. k r + r-1``)."""
    return a if r == 1 else jnp.repeat(a, r, axis=axis)


def head_specs(args: dict[str, Array], qkv: Spec, axis_name: str) -> dict[str, Spec]:
    """The ``shard_map`` specs of a head-splitting scheme's arguments: ``q``, ``k``, ``v`` as
    ``qkv``, a mask or bias ``[#B, #N, ...]`` split on a full head axis, the rest replicated."""
    specs = {name: Spec() for name in args}
    specs.update(q=qkv, k=qkv, v=qkv)
    for name in ("bias", "mask"):
        if name in args and args[name].shape[1] > 1:
            specs[name] = Spec(None, axis_name)
    return specs


def local_attention(
    spec: KernelSpec, a: dict[str, Array], scale: float | None, masked_rows: str, **arrays: Array
) -> tuple[Float[Array, "B T n H_v"], Float[Array, "B T n"]]:
    """``(o, lse)`` of ``attnref.dot_product_attention`` on one device's heads: the call's static
    options and the arrays of ``a`` (``arrays`` replacing some)."""
    a = {**a, **arrays}
    return dot_product_attention(  # type: ignore[no-any-return]
        a["q"],
        a["k"],
        a["v"],
        a.get("bias"),
        a.get("mask"),
        scale=a.get("scale", scale),
        is_causal=spec.is_causal,
        query_seq_lengths=a.get("q_lens"),
        key_value_seq_lengths=a.get("kv_lens"),
        local_window_size=spec.window,
        segment_ids=(a["q_seg"], a["kv_seg"]) if "q_seg" in a else None,
        softcap=spec.softcap,
        causal_alignment=spec.alignment,
        masked_rows=masked_rows,
        return_lse=True,
    )


# ----------------------------------------------------------------------------- kernel level


def _sharded(
    mesh_run: MeshRun, inputs: KernelInputs, traced_scale: Array | None
) -> tuple[Array, Array]:
    """The kernel on ``N/P`` query heads per device; ``(o, lse)`` global, natural head order."""
    spec, scale, mesh, axis, devices = mesh_run
    r = kv_repeats(spec.n, spec.k, devices)
    heads = Spec(None, None, axis)
    args = mesh_args(inputs, traced_scale, k=repeat_kv(inputs.k, r), v=repeat_kv(inputs.v, r))
    specs = head_specs(args, heads, axis)

    def body(a: dict[str, Array]) -> tuple[Array, Array]:
        return local_attention(spec, a, scale, spec.masked_rows)

    run = jax.shard_map(body, mesh=mesh, in_specs=(specs,), out_specs=(heads, heads))
    return run(args)


tensor_parallel_dot_product_attention = mesh_kernel(
    mesh_schedule(_sharded, heads="tensor parallelism"),
    name="tensor_parallel_dot_product_attention",
    summary=(
        "``attnref.dot_product_attention`` with the heads split over a mesh axis "
        "(Megatron-LM).\n\n``o_n = softmax(s_n, allowed) v_{n // G}``; device ``d`` computes "
        "heads\n``d N/P .. (d + 1) N/P - 1`` with no communication. Semantics, results and "
        "errors are those of\n:func:`attnref.dot_product_attention` (``docs/kernel.md``); "
        "``P`` must divide ``N``."
    ),
    axis="to split the heads over",
    returns=" ``o`` is sharded on its head axis.",
    value_errors="; or if ``P`` does not divide the ``N`` query heads",
)


# ----------------------------------------------------------------------------- row form


def _head_weights(params: AttentionParams, r: int) -> dict[str, Any]:
    """Every per-head weight and bias (K/V ones repeated ``r`` times); no ``b_O``."""
    kv = {"w_k": params.w_k, "w_v": params.w_v, "b_k": params.b_k, "b_v": params.b_v}
    out = {name: None if a is None else repeat_kv(device_array(a), r, 0) for name, a in kv.items()}
    return optional(w_q=params.w_q, b_q=params.b_q, w_o=params.w_o, **out)


@functools.partial(jax.jit, static_argnames=("scale", "mesh", "axis"))
def _head_sum(
    weights: dict[str, Array],
    tokens: dict[str, Array],
    scale: float | None,
    mesh: Mesh,
    axis: str,
) -> Float[Array, "... T_q d_model"]:
    """``psum_d sum_{n on d} o_n W_O[n]``: the weights split on their head axis, the rest
    replicated."""

    def body(w: dict[str, Array], t: dict[str, Array]) -> Array:
        local = AttentionParams(**{n: w.get(n) for n in PARAM_FIELDS})  # type: ignore[arg-type]
        sc = t.get("scale", scale)
        options = {"kernel": dot_product_attention}
        part = kernel_rows(local, t["xq"], t["xkv"], t.get("m"), t.get("bias"), sc, False, options)
        return jax.lax.psum(part, axis)

    w_specs = {name: Spec(axis) for name in weights}
    t_specs = {name: Spec() for name in tokens}
    run = jax.shard_map(body, mesh=mesh, in_specs=(w_specs, t_specs), out_specs=Spec())
    return run(weights, tokens)


def head_parallel_rows(
    params: Params,
    x_q: Queries,
    x_kv: Keys,
    mask: Mask,
    bias: Bias,
    scale: Any,
    residual: bool,
    options: dict[str, Any],
) -> Float[Array, "... T_q d_model"]:
    """``y = psum_d ( sum_{n on d} softmax(q_n k_{g(n)}^T scale + bias, mask) v_{g(n)} W_O[n] )
    + b_O`` (``options``: the head ``weights``, the ``mesh`` and its ``axis``)."""
    weights, mesh, axis = options["weights"], options["mesh"], options["axis"]
    static, traced = split_scale(scale)
    tokens = optional(xq=x_q, xkv=x_kv, m=mask, bias=bias, scale=traced)
    y = _head_sum(weights, tokens, static, mesh, axis)
    return residual_or(add_output_bias(y, params), x_q, residual)


def _head_call(rows: Prepared, scale: float | None, mesh: Mesh | None) -> Call:
    params = cast(AttentionParams, rows.params)
    n, k = jnp.shape(params.w_q)[0], jnp.shape(params.w_k)[0]
    mesh = head_mesh(int(n)) if mesh is None else mesh
    axis, devices = mesh_axis(mesh, None)
    check_heads(n, devices, axis, "tensor parallelism", f"params.w_q {jnp.shape(params.w_q)}")
    weights = _head_weights(params, kv_repeats(n, k, devices))
    return row_call(rows, scale, {"weights": weights, "mesh": mesh, "axis": axis})


tensor_parallel_attention = scheme_rows(
    tensor_parallel_dot_product_attention,
    formula=head_parallel_rows,
    heads=True,
    on_mesh=_head_call,
)


register_scheme(
    "tensor_parallel",
    tensor_parallel_attention,
    tensor_parallel_dot_product_attention,
    title="Tensor-parallel heads: per-device head sums reduced with psum (Megatron-LM)",
    equation=(
        r"y_i = \mathrm{psum}_{d=1}^{P} \sum_{n \in \mathcal{H}_d} \mathrm{softmax}_j"
        r"\Big(\frac{q_{i,n} k_{j,g(n)}^\top}{\sqrt{d_k}} + b_{ij}\Big) v_{j,g(n)} W_{O,n}"
        r" + b_O,\quad |\mathcal{H}_d| = H / P"
    ),
    citation=(
        "Shoeybi et al. (2019), Megatron-LM: Training Multi-Billion Parameter Language "
        "Models Using Model Parallelism, arXiv:1909.08053."
    ),
    summary=(
        "Each device projects and attends with its own H/P heads (K/V heads repeated when P "
        "does not divide them) and writes its partial sum of o_n W_O[n]; one psum "
        "(all-reduce of B T d_model numbers) gives the block output."
    ),
    cost=(
        "FLOPs O(B T_q T_k H (d_k + d_v) / P) per device, no sequence communication; "
        "memory O(B H T_q T_k / P) logits per device; one all-reduce of O(B T_q d_model)."
    ),
)
