"""One device's piece of a sequence-parallel scheme: the state of its queries against one chunk
of keys, located by global positions, and the finishing rules of the kernel.

Every option of ``attnref.dot_product_attention`` is a rule on global positions (lengths,
causality and its alignment, the window, segments) or an array indexed by them (mask, bias), so a
piece computes ``allowed = structural(q_pos, k_pos) AND mask[q_pos, k_pos]`` and runs the naive
kernel on it with ``masked_rows="zeros"`` and ``return_lse=True``: the piece's state
``(o, lse)``. Pieces merge with :func:`attnref.merge_states`; :func:`finish_rows` then applies the
fully-masked-row policy and query padding as the kernel does.

Pieces run in the compute dtype (float32 for 16-bit inputs): a 16-bit output rounded at every
ring step would add one rounding per step (the error that grows with the ring size,
zhuzilin/ring-flash-attention #42); the cast to the input dtype happens once, in
:func:`finish_rows`.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from attnref._src.formulations.kernel import (
    KernelInputs,
    KernelSpec,
    dot_product_attention,
    lengths_in_range,
    structural_allowed,
)


def lengths_only(q_lens: Array | None, kv_lens: Array | None) -> KernelInputs:
    """A :class:`KernelInputs` carrying only the lengths (what the position rules read; the
    arrays they never read are ``None``)."""
    unread: Any = None
    return KernelInputs(unread, unread, unread, None, None, q_lens, kv_lens, None, None, unread)


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
) -> tuple[Float[Array, "B tq N H_v"], Float[Array, "B tq N"]]:
    """The state ``(o, lse)`` of queries at ``q_pos`` against the keys at ``k_pos``.

    Args:
        spec: The global call's :class:`KernelSpec` (``T``, ``S`` and the static options).
        lengths: The global lengths (:func:`lengths_only`).
        scale: The caller's ``scale`` (``None``: ``1/sqrt(H)``).
        q: Local queries; ``q_pos`` their global positions (``>= T``: padding).
        q_seg: Their segment ids, or ``None``.
        k: A chunk of keys; ``v`` its values; ``k_pos`` their global positions.
        kv_seg: The chunk's segment ids, or ``None``.
        bias_rows: The bias rows of the local queries, ``[#B, #N, #tq, S or 1]``, or ``None``.
        mask_rows: The mask rows of the local queries, the same layout, or ``None``.

    Returns:
        ``(o, lse)`` in the compute dtype; an empty row has ``o = 0``, ``lse = -inf``.
    """
    allowed = structural_allowed(spec, lengths, q_pos, k_pos, q_seg, kv_seg)[:, None]
    m = columns(mask_rows, k_pos, spec.s)
    mask = allowed if m is None else jnp.logical_and(allowed, m)
    cd = spec.compute_dtype
    return dot_product_attention(
        q.astype(cd),
        k.astype(cd),
        v.astype(cd),
        columns(bias_rows, k_pos, spec.s),
        mask,
        scale=scale,
        softcap=spec.softcap,
        return_lse=True,
    )


def value_sum(
    spec: KernelSpec, v: Float[Array, "B tk K H_v"], k_pos: Int[Array, " tk"]
) -> Float[Array, "B K H_v"]:
    """``sum_j v_j`` over the real keys (``k_pos < S``) of a chunk, for ``masked_rows="uniform"``
    (sum the chunks, divide by ``S``: :func:`finish_rows`)."""
    real = (k_pos < spec.s)[None, :, None, None]
    return jnp.sum(jnp.where(real, v.astype(spec.compute_dtype), 0.0), axis=1)


def finish_rows(
    spec: KernelSpec,
    lengths: KernelInputs,
    o: Float[Array, "B tq N H_v"],
    lse: Float[Array, "B tq N"],
    q_pos: Int[Array, " tq"],
    v_total: Float[Array, "B K H_v"] | None = None,
) -> tuple[Array, Array]:
    """The kernel's finishing rules on merged states (``attnref._src.formulations.kernel.finish``): the
    fully-masked-row policy (``"uniform"``: ``v_total / S``, the sum of :func:`value_sum` over
    all chunks), query padding (``q_pos >= query_seq_lengths``: 0 and ``-inf``), NaN for lengths
    out of range; the output cast to the input dtype.

    Returns:
        ``(o, lse)``: ``o`` in ``spec.dtype``, ``lse`` in the compute dtype.
    """
    live: Bool[Array, "B tq N"] = ~jnp.isneginf(lse)
    if spec.masked_rows == "uniform":
        if v_total is None:
            raise ValueError("masked_rows='uniform' needs the value sum over all keys (v_total)")
        mean = jnp.repeat(v_total / spec.s, spec.group, axis=1)[:, None]  # [B, 1, N, H_v]
        o = jnp.where(live[..., None], o, mean)
    elif spec.masked_rows == "nan":
        o = jnp.where(live[..., None], o, jnp.nan)
    if lengths.q_lens is not None:
        valid = (q_pos[None, :] < lengths.q_lens[:, None])[..., None]  # [B, tq, 1]
        o = jnp.where(valid[..., None], o, 0.0)
        lse = jnp.where(valid, lse, -jnp.inf)
    bad = ~lengths_in_range(spec, lengths)[:, None, None]
    o = jnp.where(bad[..., None], jnp.nan, o)
    lse = jnp.where(bad, jnp.nan, lse)
    return o.astype(spec.dtype), lse
