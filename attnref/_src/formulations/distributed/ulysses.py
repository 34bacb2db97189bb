"""DeepSpeed-Ulysses (Jacobs et al. 2023): an all-to-all turns a sequence split into a head split.

Inputs padded to ``T', S'`` (multiples of ``P``) and split along the sequence (contiguous layout)
are exchanged for a head split::

    [B, T'/P, N, H] --all_to_all--> [B, T', N/P, H]

so each device attends over the whole sequence for ``N/P`` query heads (and the K/V heads they
read) with ``attnref.dot_product_attention``; a second all-to-all turns the output back. The
kernel gets the real lengths, so padding never changes a result; ``masked_rows="uniform"``
averages the real keys only. ``P`` must divide ``N``; K/V heads are repeated ``lcm(K, P)/K``
times when ``P`` does not divide ``K``. Gradients are autodiff. See ``docs/distributed.md``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as Spec
from jaxtyping import Array

from attnref._src.formulations.distributed.family import (
    MeshRun,
    mesh_args,
    mesh_kernel,
    mesh_schedule,
    register_scheme,
    scheme_rows,
)
from attnref._src.formulations.distributed.layout import pad_axis, padded_length
from attnref._src.formulations.distributed.tensor_parallel import (
    head_specs,
    kv_repeats,
    local_attention,
    repeat_kv,
)
from attnref._src.formulations.kernel_spec import KernelInputs, KernelSpec, lengths_in_range

LAYOUT = "contiguous"


def _padded(a: Array | None, t_pad: int, s_pad: int, fill: Any) -> Array | None:
    """A mask or bias with its full ``T`` and ``S`` axes padded to ``T'`` and ``S'``."""
    if a is None:
        return None
    if a.shape[2] > 1:
        a = pad_axis(a, 2, t_pad, fill)
    return pad_axis(a, 3, s_pad, fill) if a.shape[3] > 1 else a


def _uniform_rows(
    spec: KernelSpec, o: Array, lse: Array, v: Array, q_lens: Array, k_local: int
) -> Array:
    """Fully masked real rows (``lse = -inf``, ``i < q_lens``) set to the mean of ``v`` over the
    ``S`` real keys (not the padding), per local query head."""
    cd = spec.compute_dtype
    mean = jnp.sum(v[:, : spec.s].astype(cd), axis=1) / spec.s  # [B, k_local, H_v]
    mean = jnp.repeat(mean, o.shape[2] // k_local, axis=1)[:, None]  # [B, 1, n_local, H_v]
    real = jnp.arange(o.shape[1])[None, :, None] < q_lens[:, None, None]  # [B, T', 1]
    dead = jnp.logical_and(jnp.isneginf(lse), real)
    return jnp.where(dead[..., None], mean.astype(o.dtype), o)


def _ulysses(
    mesh_run: MeshRun, inputs: KernelInputs, traced_scale: Array | None
) -> tuple[Array, Array]:
    """Pad, all-to-all to heads, attend, all-to-all back; ``(o, lse)`` global, unpadded."""
    spec, scale, mesh, axis, devices = mesh_run
    t_pad, s_pad = padded_length(spec.t, devices, LAYOUT), padded_length(spec.s, devices, LAYOUT)
    r = kv_repeats(spec.n, spec.k, devices)
    full = jnp.full((spec.b,), 1, jnp.int32)
    args = mesh_args(
        inputs,
        traced_scale,
        q=pad_axis(inputs.q, 1, t_pad),
        k=repeat_kv(pad_axis(inputs.k, 1, s_pad), r),
        v=repeat_kv(pad_axis(inputs.v, 1, s_pad), r),
        bias=_padded(inputs.bias, t_pad, s_pad, 0.0),
        mask=_padded(inputs.mask, t_pad, s_pad, False),
        q_lens=full * spec.t if inputs.q_lens is None else inputs.q_lens,
        kv_lens=full * spec.s if inputs.kv_lens is None else inputs.kv_lens,
        q_seg=None if inputs.q_seg is None else pad_axis(inputs.q_seg, 1, t_pad),
        kv_seg=None if inputs.kv_seg is None else pad_axis(inputs.kv_seg, 1, s_pad),
    )
    seq = Spec(None, axis)
    specs = head_specs(args, seq, axis)
    uniform = spec.masked_rows == "uniform"
    k_local = spec.k * r // devices

    def body(a: dict[str, Array]) -> tuple[Array, Array]:
        q, k, v = (jax.lax.all_to_all(a[n], axis, 2, 1, tiled=True) for n in ("q", "k", "v"))
        masked_rows = "zeros" if uniform else spec.masked_rows
        o, lse = local_attention(spec, a, scale, masked_rows, q=q, k=k, v=v)
        if uniform:
            o = _uniform_rows(spec, o, lse, v, a["q_lens"], k_local)
        o = jax.lax.all_to_all(o, axis, 1, 2, tiled=True)  # [B, T'/P, N, H_v]
        return o, jax.lax.all_to_all(lse, axis, 1, 2, tiled=True)

    run = jax.shard_map(body, mesh=mesh, in_specs=(specs,), out_specs=(seq, seq))
    out, lse = run(args)
    out, lse = out[:, : spec.t], lse[:, : spec.t]
    bad = ~lengths_in_range(spec, inputs)[:, None, None]  # NaN as the kernel (traced lengths only)
    return jnp.where(bad[..., None], jnp.nan, out), jnp.where(bad, jnp.nan, lse)


ulysses_dot_product_attention = mesh_kernel(
    mesh_schedule(_ulysses, heads="Ulysses"),
    name="ulysses_dot_product_attention",
    summary=(
        "``attnref.dot_product_attention`` by DeepSpeed-Ulysses: sequence split -> head split ->\n"
        "attention -> sequence split, with two all-to-alls per tensor.\n\n"
        "``[B, T'/P, N, H] --all_to_all--> [B, T', N/P, H]`` per device, full attention on those\n"
        "heads, and back. Semantics, results and errors are those of\n"
        ":func:`attnref.dot_product_attention` (``docs/kernel.md``); ``P`` must divide ``N``."
    ),
    axis="to run over",
    returns=" Natural token order.",
    value_errors="; or if ``P`` does not divide the ``N`` query heads",
)
ulysses_attention = scheme_rows(ulysses_dot_product_attention, heads=True)


register_scheme(
    "ulysses",
    ulysses_attention,
    ulysses_dot_product_attention,
    title="DeepSpeed-Ulysses: all-to-all from a sequence split to a head split",
    equation=(
        r"[Q, K, V]_{:, \mathcal{H}_d} = \mathrm{all\_to\_all}\big([Q, K, V]_{\mathcal{T}_d,"
        r" :}\big),\quad O_{:, n} = \mathrm{softmax}\Big(\frac{Q_{:, n} K_{:, g(n)}^\top}"
        r"{\sqrt{d_k}} + B\Big) V_{:, g(n)},\ n \in \mathcal{H}_d,"
        r"\quad O_{\mathcal{T}_d, :} = \mathrm{all\_to\_all}"
        r"\big(O_{:, \mathcal{H}_d}\big)"
    ),
    citation=(
        "Jacobs et al. (2023), DeepSpeed Ulysses: System Optimizations for Enabling Training "
        "of Extreme Long Sequence Transformer Models, arXiv:2309.14509."
    ),
    formula=_ulysses,
    summary=(
        "Sequence-split q, k, v are exchanged by all_to_all for a head split (H/P heads, "
        "the whole sequence, per device), attended as usual, and the output exchanged back; "
        "P must divide the query heads (K/V heads repeated when it does not divide them)."
    ),
    cost=(
        "FLOPs O(B T_q T_k H (d_k + d_v) / P) per device; memory O(B H T_q T_k / P) logits "
        "per device; four all-to-alls of O(B T H d / P) numbers each."
    ),
)
