"""All-gather context parallelism (the Llama 3 report, Grattafiori et al. 2024).

The sequence is split over ``P`` devices in the load-balanced zigzag layout (``2P`` chunks;
device ``d`` holds chunks ``d`` and ``2P - 1 - d``, :mod:`attnref._src.formulations.distributed.layout`), so
that under a causal mask every device has the same number of useful (query, key) pairs. Each
device gathers the keys and values of every device (``lax.all_gather``, with their segment
ids), knows the global position of every gathered key (the layout's position table, flattened)
and computes its own queries against *all* keys in one piece::

    K_all, V_all = all_gather(K_d), all_gather(V_d)          # [B, S', K, H], [B, S', K, H_v]
    o_i = softmax_j(s_ij, allowed(p_i, p_j)) v_j             # i on device d, every j

No state merge is needed (every row is computed in one piece, the kernel's naive form on global
positions: :func:`attnref._src.formulations.distributed.chunk.chunk_state`); the fully-masked-row policy,
query padding and the cast follow (:func:`~attnref._src.formulations.distributed.chunk.finish_rows`, with the
value sum over every gathered real key for ``"uniform"``). Communication: one all-gather of
``K`` and ``V``, ``(P - 1)/P`` of ``B S' K (H + H_v)`` numbers received per device; the backward
(autodiff) reduce-scatters ``dK`` and ``dV``, the transpose of the all-gather.

Lengths that ``2P`` does not divide are padded (to ``T', S'``): padded keys are never attended
(the allowed rule tests ``j < S``) and padded queries are dropped, so every ``T, S >= 0`` gives
the exact answer.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as Spec
from jaxtyping import Array, ArrayLike, Bool, Float, Int

from attnref._src.core.checks import float64_scoped
from attnref._src.core.params import AttentionParams
from attnref._src.core.registry import Formulation, register
from attnref._src.formulations.distributed import cost as _dcost
from attnref._src.formulations.distributed.chunk import (
    chunk_state,
    finish_rows,
    lengths_only,
    value_sum,
)
from attnref._src.formulations.distributed.family import DISTRIBUTED, mesh_axis, row_form
from attnref._src.formulations.distributed.layout import (
    from_layout,
    padded_length,
    positions,
    to_layout,
)
from attnref._src.formulations.distributed.tensor_parallel import optional, split_scale
from attnref._src.formulations.kernel import (
    Alignment,
    KernelInputs,
    KernelSpec,
    MaskedRows,
    prepare,
    require_lengths_in_range,
)

LAYOUT = "zigzag"


def _rows(a: Array | None, t_pad: int, devices: int, fill: float) -> Array | None:
    """A mask or bias ``[#B, #N, #T, #S]`` with a full query axis put in the zigzag layout
    (padded with ``fill``); a broadcast query axis stays 1."""
    if a is None or a.shape[2] == 1:
        return a
    return to_layout(a, 2, t_pad, devices, LAYOUT, fill)


@functools.partial(jax.jit, static_argnames=("spec", "scale", "mesh", "axis", "devices"))
def _all_gather(
    spec: KernelSpec,
    x: KernelInputs,
    traced_scale: Array | None,
    scale: float | None,
    mesh: Mesh,
    axis: str,
    devices: int,
) -> tuple[Array, Array]:
    """Zigzag layout, gather K/V, local queries against every key; ``(o, lse)`` global.
    Jitted (a ``shard_map`` run eagerly dispatches every operation on its own)."""
    t_pad, s_pad = padded_length(spec.t, devices, LAYOUT), padded_length(spec.s, devices, LAYOUT)

    def seq(a: Array | None, n_pad: int) -> Array | None:
        return None if a is None else to_layout(a, 1, n_pad, devices, LAYOUT)

    q_pos = jnp.asarray(positions(t_pad, devices, LAYOUT).reshape(-1))
    k_pos_table = positions(s_pad, devices, LAYOUT).reshape(-1)  # every gathered key's position
    args = optional(
        q=seq(x.q, t_pad),
        k=seq(x.k, s_pad),
        v=seq(x.v, s_pad),
        q_pos=q_pos,
        q_seg=seq(x.q_seg, t_pad),
        kv_seg=seq(x.kv_seg, s_pad),
        bias=_rows(x.bias, t_pad, devices, 0.0),
        mask=_rows(x.mask, t_pad, devices, 0.0),  # padded with False
        q_lens=x.q_lens,
        kv_lens=x.kv_lens,
        scale=traced_scale,
    )
    sharded = {"q": 1, "k": 1, "v": 1, "q_pos": 0, "q_seg": 1, "kv_seg": 1, "bias": 2, "mask": 2}
    specs = {}
    for name, a in args.items():
        dim = sharded.get(name)
        full_rows = dim is not None and (name not in ("bias", "mask") or a.shape[2] > 1)
        specs[name] = Spec(*([None] * dim), axis) if full_rows else Spec()  # type: ignore[operator]

    def gather(a: Array) -> Array:
        return jax.lax.all_gather(a, axis, axis=1, tiled=True)

    def body(a: dict[str, Array]) -> tuple[Array, Array]:
        k_pos = jnp.asarray(k_pos_table)
        lengths = lengths_only(a.get("q_lens"), a.get("kv_lens"))
        k, v = gather(a["k"]), gather(a["v"])
        kv_seg = gather(a["kv_seg"]) if "kv_seg" in a else None
        o, lse = chunk_state(
            spec,
            lengths,
            a.get("scale", scale),
            a["q"],
            a["q_pos"],
            a.get("q_seg"),
            k,
            v,
            k_pos,
            kv_seg,
            a.get("bias"),
            a.get("mask"),
        )
        total = value_sum(spec, v, k_pos) if spec.masked_rows == "uniform" else None
        return finish_rows(spec, lengths, o, lse, a["q_pos"], total)

    out_spec = Spec(None, axis)
    run = jax.shard_map(body, mesh=mesh, in_specs=(specs,), out_specs=(out_spec, out_spec))
    out, lse = run(args)
    return (
        from_layout(out, 1, spec.t, devices, LAYOUT),
        from_layout(lse, 1, spec.t, devices, LAYOUT),
    )


@float64_scoped
def all_gather_dot_product_attention(
    query: Float[ArrayLike, "B T N H"],
    key: Float[ArrayLike, "B S K H"],
    value: Float[ArrayLike, "B S K H_v"],
    bias: Float[ArrayLike, "#B #N #T #S"] | None = None,
    mask: Bool[ArrayLike, "#B #N #T #S"] | None = None,
    *,
    mesh: Mesh,
    axis_name: str | None = None,
    scale: float | ArrayLike | None = None,
    is_causal: bool = False,
    query_seq_lengths: Int[ArrayLike, " B"] | None = None,
    key_value_seq_lengths: Int[ArrayLike, " B"] | None = None,
    local_window_size: int | tuple[int | None, int | None] | None = None,
    segment_ids: Any = None,
    softcap: float | None = None,
    causal_alignment: Alignment = "top_left",
    masked_rows: MaskedRows = "zeros",
    return_lse: bool = False,
) -> Any:
    """``attnref.dot_product_attention`` by all-gather context parallelism (Llama 3).

    ``q``, ``k``, ``v`` are padded to multiples of ``2P`` and put in the zigzag layout (device
    ``d`` holds sequence chunks ``d`` and ``2P - 1 - d``); every device all-gathers ``k`` and
    ``v`` (and the key segment ids) and computes ``o_i = softmax_j(s_ij, allowed) v_j`` for its
    queries against every key, each row in one piece, the options applied on global positions.
    ``mask``/``bias`` rows follow the query layout when their ``T`` axis is full; their ``S``
    axis stays whole on every device. The output comes back in natural token order. Semantics,
    results and errors are those of :func:`attnref.dot_product_attention` (``docs/kernel.md``).

    Args:
        query: ``[B, T, N, H]``, floating.
        key: ``[B, S, K, H]``, the dtype of ``query``; ``N`` must be a multiple of ``K``.
        value: ``[B, S, K, H_v]``, the dtype of ``query``.
        bias: Floating, rank 4, broadcastable to ``[B, N, T, S]``; ``None`` (default).
        mask: Boolean, rank 4, broadcastable to ``[B, N, T, S]``, ``True`` = may attend;
            ``None`` (default).
        mesh: A ``jax.sharding.Mesh``.
        axis_name: The mesh axis to split the sequence over; ``None`` (default): the only axis
            of a 1-D mesh.
        scale: The logit scale; ``None`` (default) means ``1/sqrt(H)``.
        is_causal: Causal masking (placed by ``causal_alignment``).
        query_seq_lengths: Integer ``[B]`` in ``[0, T]``; ``None`` (default): every row real.
        key_value_seq_lengths: Integer ``[B]`` in ``[0, S]``; ``None`` (default): all keys.
        local_window_size: ``w`` or ``(left, right)``; ``None`` (default): no window.
        segment_ids: ``[B, T]`` (``T == S``) or a pair ``([B, T], [B, S])``; ``None``.
        softcap: A positive finite number ``c`` (logits ``c tanh(s / c)``); ``None``.
        causal_alignment: ``"top_left"`` (default) or ``"bottom_right"``.
        masked_rows: ``"zeros"`` (default), ``"uniform"`` or ``"nan"``.
        return_lse: If ``True``, also return the log-sum-exp ``[B, T, N]``.

    Returns:
        ``o [B, T, N, H_v]`` in the dtype of ``query``, natural token order, or ``(o, lse)``
        with ``return_lse``.

    Raises:
        ValueError: For every input :func:`attnref.dot_product_attention` refuses with
            ``ValueError``, or if ``axis_name`` is not an axis of ``mesh`` (or is ``None`` for
            a mesh with several axes).
        TypeError: For every input :func:`attnref.dot_product_attention` refuses with
            ``TypeError``, or if ``mesh`` is not a ``jax.sharding.Mesh``.
    """
    spec, x = prepare(
        query,
        key,
        value,
        bias,
        mask,
        scale=scale,
        is_causal=is_causal,
        query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths,
        local_window_size=local_window_size,
        segment_ids=segment_ids,
        softcap=softcap,
        causal_alignment=causal_alignment,
        masked_rows=masked_rows,
    )
    axis, devices = mesh_axis(mesh, axis_name)
    require_lengths_in_range(spec, x)
    static, traced = split_scale(scale)
    out, lse = _all_gather(spec, x, traced, static, mesh, axis, devices)
    return (out, lse) if return_lse else out


@float64_scoped
def all_gather_attention(
    params: AttentionParams,
    x_q: Float[ArrayLike, "... T_q d_model"],
    x_kv: Float[ArrayLike, "... T_k d_model"] | None = None,
    *,
    mask: Bool[ArrayLike, "... #T_q #T_k"] | None = None,
    bias: Float[ArrayLike, "... #T_q #T_k"] | None = None,
    scale: float | None = None,
    residual: bool = False,
    mesh: Mesh | None = None,
) -> Float[Array, "... T_q d_model"]:
    """Multi-head attention through :func:`all_gather_dot_product_attention`:
    ``sum_n o_n W_O[n] + b_O`` with ``o`` computed by all-gather context parallelism on
    ``mesh``.

    Args:
        params: Per-head weights (:class:`attnref.AttentionParams`); query head ``i`` reads
            key/value head ``i // G`` (``G = H / K``).
        x_q: Query tokens, row vectors ``[..., T_q, d_model]``, the dtype of ``params``.
        x_kv: Key/value tokens ``[..., T_k, d_model]`` with the batch shape of ``x_q``;
            ``None`` (default) means ``x_q`` (self-attention).
        mask: Boolean, broadcastable to ``[..., T_q, T_k]``, ``True`` = may attend; ``None``
            (default) allows every pair.
        bias: Floating additive bias, broadcastable to ``[..., T_q, T_k]`` (``-inf`` masks like
            ``False``); cast to the dtype of ``x_q``.
        scale: The logit scale; ``None`` (default) means ``1/sqrt(d_k)``.
        residual: If ``True``, return ``x_q + MultiHead`` (the residual-stream update).
        mesh: A 1-D ``jax.sharding.Mesh``; ``None`` (default): every device.

    Returns:
        The block output ``[..., T_q, d_model]``, the dtype of ``x_q``; a fully masked query row
        is ``b_O`` (zero without biases).

    Raises:
        ValueError: If ``params`` is malformed, ``x_q``/``x_kv`` have rank < 2, the wrong
            ``d_model`` or different batch shapes, ``mask``/``bias`` do not broadcast to
            ``[..., T_q, T_k]``, ``scale`` is not a scalar, or ``mesh`` has several axes.
        TypeError: If ``x_q``, ``x_kv`` and ``params`` mix dtypes, ``mask`` is not boolean,
            ``bias`` is not floating, ``scale`` is not a real number, or ``mesh`` is not a
            ``jax.sharding.Mesh``.
    """
    return row_form(
        all_gather_dot_product_attention, params, x_q, x_kv, mask, bias, scale, residual, mesh
    )


register(
    Formulation(
        id="all_gather",
        title="All-gather context parallelism (zigzag queries, every key gathered)",
        equation=(
            r"K' = \mathrm{all\_gather}_d(K_{\mathcal{T}_d}),\ V' = \mathrm{all\_gather}_d"
            r"(V_{\mathcal{T}_d}),\quad O_{\mathcal{T}_d} = \mathrm{softmax}\Big(\frac{Q_"
            r"{\mathcal{T}_d} K'^\top}{\sqrt{d_k}} + B_{\mathcal{T}_d}\Big) V',\quad"
            r" \mathcal{T}_d = C_d \cup C_{2P-1-d}"
        ),
        convention="kernel",
        citation=(
            "Grattafiori et al. (2024), The Llama 3 Herd of Models, arXiv:2407.21783 (context "
            "parallelism: all-gathered keys and values, each rank holding chunks i and "
            "2P - 1 - i)."
        ),
        apply=all_gather_attention,
        native=all_gather_dot_product_attention,
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
        family=DISTRIBUTED,
        cost_model=_dcost.all_gather_cost,
    )
)
