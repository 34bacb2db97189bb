"""Attention as message passing on a graph (Karpathy 2023, via "Attention: All you need to know";
tokens as nodes, attention as a GNN layer, as in "[Concept] The Attention Mechanism of Transformer
Models", 2025-08-22).

A directed edge ``s -> r`` lets receiver ``r`` listen to sender ``s`` (the mask is the adjacency
matrix). Per head ``i`` and edge ``e = (s, r)``: ``a_e = (x_r W_Q[i] + b_Q[i]) . (x_s W_K[g] +
b_K[g]) * scale + bias_e``, ``g = i // G`` (grouped-query params, ``G = H / K``); a segment softmax
over each receiver's incoming edges gives ``alpha_e``; ``z_r = sum_{e -> r} alpha_e (x_s W_V[g] +
b_V[g])`` and ``y_r = sum_i z_r W_O[i] + b_O`` (``b_O`` without an allowed incoming edge). A
sender a receiver may not listen to (no edge, masked, ``-inf`` bias) never reaches that
receiver's update or gradients, whatever it holds (``attnref._src.core.nonfinite``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Float, Int

from attnref._src.core import cost as _cost
from attnref._src.core.checked import require
from attnref._src.core.checks import (
    HIGHEST,
    check_params,
    check_scale,
    device_array,
    dtype_of,
    is_traced,
)
from attnref._src.core.common import BLOCK_RETURNS, ROWS, Call, residual_or, scale_value
from attnref._src.core.entry import Level, public
from attnref._src.core.nonfinite import allowed_pairs, nonfinite_rows
from attnref._src.core.params import AttentionParams, repeat_heads
from attnref._src.core.registry import Formulation, register
from attnref._src.formulations.kernel import kernel_heads
from attnref._src.formulations.standard import Bias, Keys, Mask, Params, Queries
from attnref.oracle._checks import is_floating, is_integer


def message_passing(
    params: AttentionParams,
    x_senders: Float[Array, "N_s d_model"],
    x_receivers: Float[Array, "N_r d_model"],
    senders: Int[Array, " E"],
    receivers: Int[Array, " E"],
    edge_mask: Bool[Array, " E"] | None,
    edge_bias: Float[Array, " E"] | None,
    scale: Array,
    residual: bool,
) -> Float[Array, "N_r d_model"]:
    """``y_r = sum_i (sum_{e = s -> r} alpha_{e,i} v_{s,i}) W_O[i] + b_O``, ``alpha`` the
    segment softmax over each receiver's edges of ``q_{r,i} . k_{s,i} * scale + bias_e``."""
    g, n_r = params.group_size, x_receivers.shape[0]
    q = kernel_heads(x_receivers, params.w_q, params.b_q)[receivers]  # [E, H, d_k]
    k, v = (  # [E, H, d_k], [E, H, d_v]: each sender projected once per K/V head
        repeat_heads(kernel_heads(x_senders, w, b), g, axis=1)[senders]
        for w, b in ((params.w_k, params.b_k), (params.w_v, params.b_v))
    )
    logits = jnp.sum(q * k, axis=-1) * scale  #                                   [E, H]
    logits = logits if edge_bias is None else logits + edge_bias[:, None]
    allowed = logits != -jnp.inf
    allowed = allowed if edge_mask is None else jnp.logical_and(allowed, edge_mask[:, None])
    alpha = segment_softmax(logits, allowed, receivers, n_r)
    z = jax.ops.segment_sum(alpha[..., None] * v, receivers, n_r)  #      [N_r, H, d_v]
    y = jnp.einsum("rhv,hvd->rd", z, params.w_o, precision=HIGHEST)
    y = y if params.b_o is None else y + jnp.asarray(params.b_o)
    return residual_or(y, x_receivers, residual)


def graph(
    params: Params, x_q: Queries, x_kv: Keys, mask: Mask, bias: Bias, scale: Array, residual: bool
) -> Float[Array, "... T_q d_model"]:
    """:func:`message_passing` on the complete bipartite graph (every (query, key) pair an
    edge, the mask its switch), ``vmap``-ed over the flattened batch dims."""
    *batch, t_q, d = x_q.shape
    t_k = x_kv.shape[-2]
    rcv, snd = (jnp.asarray(a.reshape(-1)) for a in np.indices((t_q, t_k), dtype=np.int32))
    full = (*batch, t_q, t_k)
    m = jnp.ones(full, bool) if mask is None else jnp.broadcast_to(mask, full)
    b = jnp.zeros(full, x_q.dtype) if bias is None else jnp.broadcast_to(bias, full)

    def one(xq: Array, xkv: Array, m1: Array, b1: Array) -> Array:
        return message_passing(params, xkv, xq, snd, rcv, m1, b1, scale, False)

    q_flat, kv_flat = (x.reshape(-1, *x.shape[-2:]) for x in (x_q, x_kv))  # [B, T, d_model]
    y = jax.vmap(one)(q_flat, kv_flat, m.reshape(-1, t_q * t_k), b.reshape(-1, t_q * t_k))
    return residual_or(y.reshape(*batch, t_q, d), x_q, residual)


def segment_softmax(
    logits: Float[Array, "E H"], allowed: Bool[Array, "E H"], receivers: Array, n_r: int
) -> Float[Array, "E H"]:
    """``alpha_e = exp(a_e - max) / sum_{e' -> r} exp(a_e' - max)`` over each receiver ``r``."""
    top = jax.ops.segment_max(jnp.where(allowed, logits, -jnp.inf), receivers, n_r)
    top = jax.lax.stop_gradient(jnp.where(jnp.isfinite(top), top, jnp.zeros_like(top)))
    shifted = jnp.where(allowed, logits - top[receivers], jnp.zeros_like(logits))
    ex = jnp.where(allowed, jnp.exp(shifted), jnp.zeros_like(logits))
    denom = jax.ops.segment_sum(ex, receivers, n_r)
    denom = jnp.where(denom > 0, denom, jnp.ones_like(denom))
    return ex / denom[receivers]


# ----------------------------------------------------------------------------- the edge level


def _check_edges(
    senders: ArrayLike,
    receivers: ArrayLike,
    n_s: int,
    n_r: int,
    edge_mask: ArrayLike | None,
    edge_bias: ArrayLike | None,
) -> None:
    for name, idx in (("senders", senders), ("receivers", receivers)):
        if np.ndim(idx) != 1:
            raise ValueError(f"{name} must be a 1-D edge index array, got shape {np.shape(idx)}")
        if not is_integer(dtype_of(idx)):
            raise TypeError(f"{name} must be integer indices, got dtype {dtype_of(idx)}")
    e = int(np.shape(senders)[0])
    if np.shape(receivers) != (e,):
        raise ValueError(
            f"senders has shape {np.shape(senders)} but receivers has shape {np.shape(receivers)}"
        )
    for name, idx, n in (("senders", senders, n_s), ("receivers", receivers, n_r)):
        # Concrete values (NumPy, lists, JAX arrays outside jit) are checked here; traced ones
        # by _edges (checked mode, else an all-NaN output): a JAX gather would clamp an
        # out-of-range index silently.
        if e and not is_traced(idx):
            vals = np.asarray(idx)
            if vals.min() < 0 or vals.max() >= n:
                raise ValueError(
                    f"{name} has indices outside [0, {n}): min {vals.min()}, max {vals.max()}"
                )
    for name, arr in (("edge_mask", edge_mask), ("edge_bias", edge_bias)):
        if arr is not None and np.shape(arr) != (e,):
            raise ValueError(
                f"{name} must have shape ({e},) (one entry per edge), got {np.shape(arr)}"
            )
    if edge_mask is not None and dtype_of(edge_mask) != np.bool_:
        raise TypeError(f"edge_mask must be boolean, got dtype {dtype_of(edge_mask)}")
    if edge_bias is not None and not is_floating(dtype_of(edge_bias)):
        raise TypeError(f"edge_bias must be floating, got dtype {dtype_of(edge_bias)}")


def _edges(
    params: AttentionParams,
    x_senders: Float[ArrayLike, "N_s d_model"],
    x_receivers: Float[ArrayLike, "N_r d_model"],
    senders: Int[ArrayLike, " E"],
    receivers: Int[ArrayLike, " E"],
    *,
    edge_mask: Bool[ArrayLike, " E"] | None = None,
    edge_bias: Float[ArrayLike, " E"] | None = None,
    scale: float | None = None,
    residual: bool = False,
) -> Call:
    _, d_model, d_k, _ = check_params(params)
    for name, x in (("x_senders", x_senders), ("x_receivers", x_receivers)):
        if np.ndim(x) != 2 or np.shape(x)[1] != d_model:
            raise ValueError(f"{name} must have shape [N, {d_model}], got {np.shape(x)}")
        dt, want = (jax.dtypes.canonicalize_dtype(dtype_of(a)) for a in (x, params.w_q))
        if dt != want:  # as JAX would hold them (a list of floats is float32 without x64)
            raise TypeError(f"{name} has dtype {dt}; params have {want}")
    n_s, n_r = int(np.shape(x_senders)[0]), int(np.shape(x_receivers)[0])
    _check_edges(senders, receivers, n_s, n_r, edge_mask, edge_bias)
    check_scale(scale)
    xs, xr = device_array(x_senders), device_array(x_receivers)
    snd, rcv = device_array(senders), device_array(receivers)
    em = None if edge_mask is None else device_array(edge_mask)
    eb = None if edge_bias is None else device_array(edge_bias, xr.dtype)
    # traced indices (a caller's jit): the range check runs in the program
    rows = EdgeRows(xs, xr, snd, rcv, em, eb, n_s, n_r, residual, is_traced(senders, receivers))
    s = scale_value(d_k, scale, xr.dtype)
    return Call((params, xs, xr, snd, rcv, em, eb, s, residual), rows, tokens=(1, 2), bias=6)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class EdgeRows:
    """The edge level's validated arrays, whose :meth:`dirty_rows` runs inside the compiled
    program (``check_range``: the indices were traced, so their range is checked there)."""

    x_senders: Array
    x_receivers: Array
    senders: Array
    receivers: Array
    edge_mask: Array | None
    edge_bias: Array | None
    n_s: int
    n_r: int
    residual: bool
    check_range: bool

    def dirty_rows(self) -> Array:
        """Dirty receivers ``[N_r]``: their own row, or through an allowed edge a non-finite
        sender row or a NaN / +inf bias (-inf edges are not allowed); with ``check_range``, all
        of them where an index is out of range (:func:`attnref.checked` raises)."""
        snd, rcv, eb, n_s, n_r = self.senders, self.receivers, self.edge_bias, self.n_s, self.n_r
        allowed = allowed_pairs(self.edge_mask, eb, snd.shape)  # [E]

        def per_receiver(flags: Array) -> Array:
            return jax.ops.segment_max(flags.astype(jnp.int32), rcv, n_r) > 0

        bad_edge = nonfinite_rows(self.x_senders)[snd]
        if eb is not None:
            bad_edge = jnp.logical_or(bad_edge, jnp.logical_not(jnp.isfinite(eb)))
        own = nonfinite_rows(self.x_receivers)
        if not self.residual:
            own = jnp.logical_and(own, per_receiver(allowed))
        dirty = jnp.logical_or(own, per_receiver(jnp.logical_and(allowed, bad_edge)))
        if snd.shape[0] and self.check_range:  # checked mode raises; else all NaN
            ok_s, ok_r = (snd >= 0) & (snd < n_s), (rcv >= 0) & (rcv < n_r)
            for name, idx, ok, n in (("senders", snd, ok_s, n_s), ("receivers", rcv, ok_r, n_r)):
                require(
                    ok,
                    f"{name} has indices outside [0, {n}): min {{lo}}, max {{hi}} (JAX would "
                    "clamp an out-of-range index silently)",
                    lo=jnp.min(idx),
                    hi=jnp.max(idx),
                )
            dirty = jnp.logical_or(dirty, ~jnp.logical_and(jnp.all(ok_s), jnp.all(ok_r)))
        return dirty


EDGES = Level(
    _edges,
    """Args:
    params: Per-head weights (:class:`attnref.AttentionParams`); query head ``i`` reads
        key/value head ``i // G`` (``G = H / K``).
    x_senders: Sender (key/value) node features, row vectors ``[N_s, d_model]`` (no batch
        dims), the dtype of ``params``.
    x_receivers: Receiver (query) node features ``[N_r, d_model]``, the dtype of ``params``.
    senders: Integer ``[E]``: edge ``e`` goes from node ``senders[e]`` of ``x_senders`` ...
    receivers: Integer ``[E]``: ... to node ``receivers[e]`` of ``x_receivers``.
    edge_mask: Boolean ``[E]``, ``False`` switches an edge off; ``None`` (default) keeps
        every edge.
    edge_bias: Additive bias ``[E]`` on each edge's scaled score (``-inf`` switches the edge
        off); cast to the dtype of ``x_receivers``.
    scale: The score scale; ``None`` (default) means ``1/sqrt(d_k)``.
    residual: If ``True``, return ``x_receivers + y`` (the residual-stream update).

Raises:
    ValueError: If ``params`` is malformed, the node features are not ``[N, d_model]``,
        ``senders``/``receivers`` are not 1-D of one length ``E``, a concrete index is out of
        range, ``edge_mask``/``edge_bias`` are not ``[E]``, or ``scale`` is not a scalar.
        Traced indices (under ``jax.jit``) cannot be checked at trace time: out of range,
        every output row is NaN, and :func:`attnref.checked` raises
        ``checkify.JaxRuntimeError`` (a ``ValueError``) instead.
    TypeError: If the node features' dtype is not the parameters', the indices are not
        integers, ``edge_mask`` is not boolean, ``edge_bias`` is not floating, or ``scale``
        is not a real number.""",
)

graph_message_passing = public(
    EDGES,
    message_passing,
    name="graph_message_passing",
    summary="Message passing over an explicit edge list with a segment softmax per receiver.\n\n"
    "``senders[e]`` indexes ``x_senders`` (keys/values), ``receivers[e]`` indexes\n"
    "``x_receivers`` (queries); ``edge_mask`` disables edges without changing shapes (for\n"
    "``jit``).",
    returns="The receivers' updates ``y [N_r, d_model]``; a receiver with no allowed incoming\n"
    "    edge gets ``b_O`` (zero without biases).",
)
graph_attention = public(
    ROWS,
    graph,
    name="graph_attention",
    summary=":func:`graph_message_passing` on the complete bipartite graph, the mask as "
    "adjacency.\n\nEvery (query, key) pair is an edge, so shapes are static and the function "
    "is ``jit``-able;\nthe mask switches edges off. Batch dims are ``vmap``-ed.",
    returns=BLOCK_RETURNS,
)


def edges_from_mask(mask: Bool[ArrayLike, "T_q T_k"]) -> tuple[np.ndarray, np.ndarray]:
    """Sparse edge list ``(senders, receivers)`` of a concrete 2-D adjacency mask ``[T_q, T_k]``
    (on the host: the number of edges is data-dependent, so it cannot be traced).

    Args:
        mask: A concrete boolean adjacency matrix ``[T_q, T_k]``; ``mask[r, s]`` = receiver
            (query) ``r`` may listen to sender (key) ``s``.

    Returns:
        ``(senders, receivers)``, two ``int32`` arrays ``[E]`` (one entry per ``True`` in
        ``mask``, in row-major order), ready for :func:`graph_message_passing`.

    Raises:
        ValueError: If ``mask`` is not a 2-D boolean array.
    """
    m = np.asarray(mask)
    if m.ndim != 2 or m.dtype != np.bool_:
        raise ValueError(f"mask must be a 2-D boolean array, got shape {m.shape} dtype {m.dtype}")
    receivers, senders = np.nonzero(m)
    return senders.astype(np.int32), receivers.astype(np.int32)


# ----------------------------------------------------------------------------- registry entry

KARPATHY = (
    "Karpathy (2023), Stanford CS25 lecture on transformers, attention as message exchange; as "
    "presented in Attention: All you need to know (far.in.net, 2025-03-29). Tokens as the nodes "
    "of a graph, attention as a graph-neural-network layer: [Concept] The Attention Mechanism of "
    "Transformer Models (blog post, 2025-08-22)."
)


def graph_cost(d: _cost.Dims) -> _cost.Cost:
    b, h, dm, tq, tk = d.batch, d.heads, d.d_model, d.t_q, d.t_k
    e = tq * tk  # dense adjacency
    pq, pk, pv = _cost.projections(d)
    mm = pq + pk + pv + 2 * b * tq * h * d.d_v * dm
    edges = b * e * h
    el = (
        edges * (2 * d.d_k - 1)  # q*k and its sum over d_k
        + (_cost.SOFTMAX_PER_LOGIT + 2) * edges  # segment softmax: max/sum scatters per edge
        + 2 * edges * d.d_v  # alpha * v and its scatter-add
        + _cost.qkvo_bias_adds(d)
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
    return _cost.finish(d, mm, el, edges, tensors)


register(
    Formulation(
        id="graph",
        title="Graph message passing over an edge list",
        equation=(
            r"y_r = \sum_{i=1}^{H} \Big(\sum_{e=(s\to r)} \alpha_{e,i}\, v_{s,i}\Big) W_{O,i}"
            r" + b_O,\quad \alpha_{\cdot,i} = \mathrm{segment\_softmax}_r\!\big("
            r"q_{r,i}\cdot k_{s,i}/\sqrt{d_k}\big)"
        ),
        convention="graph",
        citation=KARPATHY,
        apply=graph_attention,
        formula=message_passing,
        native=graph_message_passing,
        summary="Tokens are nodes, the mask is the adjacency; a segment softmax per receiver.",
        cost=(
            "FLOPs O(H (N_r + N_s) d_model (d_k + d_v) + H E (d_k + d_v)) for E edges "
            "(E = T_q T_k for the dense adjacency); memory O(H E (d_k + d_v)) for gathered "
            "per-edge keys and values."
        ),
        cost_model=graph_cost,
    )
)
