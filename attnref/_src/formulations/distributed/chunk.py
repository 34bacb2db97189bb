"""One device's piece of a sequence-parallel scheme: the state ``(o, lse)`` of its queries
against one chunk of keys, ``allowed = structural(q_pos, k_pos) AND mask[q_pos, k_pos]`` on global
positions, by the naive kernel (``masked_rows="zeros"``, ``return_lse=True``). Pieces run in the
compute dtype and merge with :func:`attnref.merge_states`; the cast to the input dtype happens
once, in the kernel's ``finish`` (one rounding, not one per ring step:
zhuzilin/ring-flash-attention #42).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from attnref._src.formulations.kernel import allowed_pairs, dot_product_attention
from attnref._src.formulations.kernel_spec import KernelInputs, KernelSpec


def columns(rows: Array | None, k_pos: Int[Array, " tk"], s: int) -> Array | None:
    """The key columns ``k_pos`` of a mask or bias ``[#B, #N, #tq, S or 1]`` (a broadcast key
    axis stays 1; padding positions ``>= S`` read column ``S - 1``, never allowed anyway)."""
    if rows is None or rows.shape[-1] == 1:
        return rows
    return jnp.take(rows, jnp.minimum(k_pos, max(s - 1, 0)), axis=-1)


def chunk_state(
    spec: KernelSpec,
    lengths: KernelInputs,
    scale: Any,
    q: Float[Array, "B tq N H"],
    q_pos: Int[Array, " tq"],
    q_seg: Int[Array, "B tq"] | None,
    k: Float[Array, "B tk K H"],
    v: Float[Array, "B tk K H_v"],
    k_pos: Int[Array, " tk"],
    kv_seg: Int[Array, "B tk"] | None,
    bias_rows: Array | None,
    mask_rows: Array | None,
    keep_rows: Array | None = None,
) -> tuple[Float[Array, "B tq N H_v"], Float[Array, "B tq N"]]:
    """The state ``(o, lse)`` of queries at ``q_pos`` (``>= T``: padding; segment ids ``q_seg``)
    against the keys ``k``, values ``v`` at ``k_pos`` (segment ids ``kv_seg``): the naive kernel
    with every option on global positions (``lengths``: :func:`lengths_only`; ``scale``: the
    call's) and the local queries' ``bias_rows`` and ``mask_rows`` (``[#B, #N, #tq, S or 1]``).
    In the compute dtype; an empty row has ``o = 0``, ``lse = -inf``. ``keep_rows``: the
    dropout keep mask of the local queries (``spec.dropout_rate``), like ``mask_rows``.
    """
    m = columns(mask_rows, k_pos, spec.s)
    allowed = allowed_pairs(spec, lengths, q_pos, k_pos, q_seg, kv_seg, m, None, True)
    cd = spec.compute_dtype
    return dot_product_attention(  # type: ignore[no-any-return]
        q.astype(cd),
        k.astype(cd),
        v.astype(cd),
        columns(bias_rows, k_pos, spec.s),
        allowed,
        scale=scale,
        softcap=spec.softcap,
        dropout_mask=columns(keep_rows, k_pos, spec.s),
        dropout_rate=None if keep_rows is None else spec.dropout_rate,
        return_lse=True,
    )


def value_sum(
    spec: KernelSpec, v: Float[Array, "B tk K H_v"], k_pos: Int[Array, " tk"]
) -> Float[Array, "B K H_v"]:
    """``sum_j v_j`` over the real keys (``k_pos < S``) of a chunk, for ``masked_rows="uniform"``
    (sum the chunks: :func:`~attnref._src.formulations.kernel.uniform_rows`)."""
    real = (k_pos < spec.s)[None, :, None, None]
    return jnp.sum(jnp.where(real, v.astype(spec.compute_dtype), 0.0), axis=1)
