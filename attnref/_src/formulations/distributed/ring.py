"""Ring attention and its load-balanced orderings: K/V chunks rotate around the devices with
``ppermute`` while each device merges the state of its queries against every chunk.

Device ``d`` holds the queries and the K/V chunk at the global positions ``positions[d]`` of
the padded layout (``"contiguous"``, ``"striped"``, ``"zigzag"``; ``docs/distributed.md``). At
step ``r = 0, ..., P - 1`` it holds chunk ``(d - r) mod P`` and updates its state::

    (o, lse) <- merge((o, lse), state(q, K_{(d - r) mod P}, V_{(d - r) mod P}))

then passes the chunk on to device ``d + 1``. Every option is a rule on global positions, so the
answer is :func:`attnref.dot_product_attention`'s for any ``T``, ``S`` and ``P``. A step no
local query may read is skipped (``lax.cond``); the others are computed in the tiles of
:func:`attnref.distributed.piece_tiles`.

**Gradients** (a ``jax.custom_vjp`` around each device's ring). The forward saves the local
inputs and the merged ``(o, lse)``. With ``L`` the final lse and ``w_c = exp(lse_c - L)`` the
weight of chunk ``c`` in ``o = sum_c w_c o_c``, the cotangents of chunk ``c``'s state are::

    do_c = w_c do,      dlse_c = w_c (do . (o_c - o) + dlse)

(``d o / d lse_c = w_c (o_c - o)``, ``d L / d lse_c = w_c``). The backward runs the ring again,
feeding these to ``jax.vjp`` of each step's recomputed chunk state: ``dq``, the bias rows' and a
traced scale's cotangents accumulate locally, ``dk``, ``dv`` travel with the chunk back to
their owner; what every device shares (a bias broadcast along ``T``, the scale) is summed by the
transpose of the ``pcast`` that shares it. Rows with a non-finite ``L`` get ``w_c = 0``. Forward
mode is refused (a ``custom_vjp`` has no JVP rule); forward over reverse works.

References: Liu, Zaharia & Abbeel (2023), *Ring Attention with Blockwise Transformers for
Near-Infinite Context*, arXiv:2310.01889; Brandon et al. (2023), *Striped Attention: Faster Ring
Attention for Causal Transformers*, arXiv:2311.09431; the zigzag ring of
zhuzilin/ring-flash-attention (GitHub, 2024).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec
from jaxtyping import Array, Int

from attnref._src.formulations.distributed import chunk as chunks
from attnref._src.formulations.distributed import cost as _dcost
from attnref._src.formulations.distributed import layout as seq_layout
from attnref._src.formulations.distributed.family import (
    mesh_axis,
    mesh_kernel,
    register_scheme,
    scheme_rows,
    split_scale,
)
from attnref._src.formulations.distributed.layout import LocalInputs, shard_inputs
from attnref._src.formulations.kernel import KernelCall, allowed_pairs, finish, naive, uniform_rows
from attnref._src.formulations.kernel_spec import KernelSpec, lengths_only
from attnref._src.formulations.states import merge_states

# The layout of each scheme, by registry id.
LAYOUT_OF = {"ring": "contiguous", "striped": "striped", "zigzag": "zigzag"}


@dataclasses.dataclass(frozen=True)
class _Ring:
    """Static description of one ring call (``custom_vjp``'s non-differentiable argument)."""

    spec: KernelSpec
    axis: str
    devices: int
    layout: str
    t_pad: int
    s_pad: int
    bias_shared: bool  # the bias's T axis is broadcast: one copy on every device
    scale: float | None  # the caller's scale when concrete (a traced one travels in LocalInputs)

    def q_positions(self) -> Int[Array, " tq"]:
        """Global positions of this device's queries."""
        table = jnp.asarray(seq_layout.positions(self.t_pad, self.devices, self.layout))
        return table[jax.lax.axis_index(self.axis)]

    def k_positions(self, step: Any) -> Int[Array, " tk"]:
        """Global positions of the chunk held at ``step`` (device ``(d - step) mod P``'s)."""
        table = jnp.asarray(seq_layout.positions(self.s_pad, self.devices, self.layout))
        owner = (jax.lax.axis_index(self.axis) - step) % self.devices
        return table[owner]

    def rotate(self, xs: Any) -> Any:
        """Send every leaf to the next device (``d -> d + 1 mod P``)."""
        perm = [(i, (i + 1) % self.devices) for i in range(self.devices)]
        return jax.tree_util.tree_map(lambda a: jax.lax.ppermute(a, self.axis, perm), xs)

    def pass_on(self, step: Any, xs: Any) -> Any:
        """:meth:`rotate` after every step but the last (the same branch on every device)."""
        return jax.lax.cond(step < self.devices - 1, self.rotate, lambda a: a, xs)


def _reachable(ring: _Ring, local: LocalInputs, q_pos: Array, k_pos: Array) -> Array:
    """Whether any local query may read any key of the chunk by the position rules alone."""
    lengths = lengths_only(local.q_lens, local.kv_lens)
    allowed = allowed_pairs(ring.spec, lengths, q_pos, k_pos, in_range=True)
    assert allowed is not None  # in_range: never None
    return jnp.any(allowed)


def _part(a: Any, axis: int, part: slice) -> Any:
    """``a[..., part, ...]`` along ``axis``; ``None`` and a broadcast (size-1) axis stay."""
    if a is None or a.shape[axis] == 1:
        return a
    return jax.lax.slice_in_dim(a, part.start, part.stop, axis=axis)


def _key_runs(kinds: Any) -> list[list[tuple[int, int, bool]]]:
    """Per query tile of :func:`piece_tiles`' table, its key runs ``(b0, b1, gated)``: each
    ``SOMETIMES`` tile gated alone, adjacent ``ALWAYS`` tiles as one slice, no ``NEVER`` tile."""
    runs: list[list[tuple[int, int, bool]]] = []
    for row in kinds.tolist():
        mine: list[tuple[int, int, bool]] = []
        for b, kind in enumerate(row):
            if kind == _dcost.ALWAYS and mine and not mine[-1][2] and mine[-1][1] == b:
                mine[-1] = (mine[-1][0], b + 1, False)
            elif kind != _dcost.NEVER:
                mine.append((b, b + 1, kind == _dcost.SOMETIMES))
        runs.append(mine)
    return runs


def _piece_kinds(ring: _Ring, local: LocalInputs) -> Any:
    """:func:`attnref.distributed.piece_tiles` of the call, with its position rules when they
    are known from the shapes (no traced lengths; no sink tokens under a window)."""
    spec = ring.spec
    static = (
        local.q_lens is None
        and local.kv_lens is None
        and not (spec.window is not None and spec.sink_tokens)
    )
    offset = (0 if spec.alignment == "top_left" else spec.s - spec.t) if static else None
    return _dcost.piece_tiles(
        spec.t, spec.s, ring.devices, ring.layout, offset, causal=spec.is_causal, window=spec.window
    )


def _state_fn(
    ring: _Ring, local: LocalInputs, q_pos: Array, k_pos: Array, kv_seg: Array | None
) -> Any:
    """``(q, k, v, bias, scale) -> (o, lse)`` of the local queries against a chunk at ``k_pos``,
    in the tiles of :func:`_piece_kinds` (``scale``: the traced one, or ``None``)."""
    lengths = lengths_only(local.q_lens, local.kv_lens)
    c_q, c_k = q_pos.shape[0], k_pos.shape[0]
    kinds = _piece_kinds(ring, local)
    n = kinds.shape[0]
    q_parts = [slice(a * c_q // n, (a + 1) * c_q // n) for a in range(n)]
    runs = _key_runs(kinds)

    def tile(
        q: Array, k: Array, v: Array, bias: Array | None, scale: Any, qs: slice, ks: slice
    ) -> Any:
        return chunks.chunk_state(
            ring.spec,
            lengths,
            ring.scale if scale is None else scale,
            _part(q, 1, qs),
            q_pos[qs],
            _part(local.q_seg, 1, qs),
            _part(k, 1, ks),
            _part(v, 1, ks),
            k_pos[ks],
            _part(kv_seg, 1, ks),
            _part(bias, 2, qs),
            _part(local.mask, 2, qs),
        )

    def state(
        q: Array, k: Array, v: Array, bias: Array | None, scale: Array | None
    ) -> tuple[Array, Array]:
        args = (q, k, v, bias, scale)
        if n == 1:
            return tile(*args, slice(0, c_q), slice(0, c_k))  # type: ignore[no-any-return]

        def empty(qs: slice, *_: Any) -> tuple[Array, Array]:
            return _empty_state(ring, q[:, qs])

        rows: list[tuple[Array, Array]] = []
        for qs, mine in zip(q_parts, runs, strict=True):
            states = []
            for b0, b1, gated in mine:
                ks = slice(b0 * c_k // n, b1 * c_k // n)
                run = functools.partial(tile, qs=qs, ks=ks)
                if gated:
                    reach = _reachable(ring, local, q_pos[qs], k_pos[ks])
                    states.append(jax.lax.cond(reach, run, functools.partial(empty, qs), *args))
                else:
                    states.append(run(*args))
            o, lse = states[0] if states else empty(qs)
            for o_t, lse_t in states[1:]:  # the query tile's key runs, merged in order
                o, lse = merge_states(o, lse, o_t, lse_t)
            rows.append((o, lse))
        return jnp.concatenate([r[0] for r in rows], 1), jnp.concatenate([r[1] for r in rows], 1)

    return state


def _varying(ring: _Ring, a: Array) -> Array:
    """``a`` (the same on every device) typed as varying over the ring's axis."""
    return jax.lax.pcast(a, ring.axis, to="varying")


def _zeros(ring: _Ring, like: tuple[Array | None, ...]) -> tuple[Array | None, ...]:
    """Zero gradients (compute dtype, varying) shaped like ``like`` (``None`` stays)."""
    cd = ring.spec.compute_dtype
    return tuple(None if a is None else _varying(ring, jnp.zeros(a.shape, cd)) for a in like)


def _empty_state(ring: _Ring, q: Array) -> tuple[Array, Array]:
    """The merge's identity for the local rows: ``o = 0``, ``lse = -inf`` (compute dtype)."""
    spec = ring.spec
    rows = (q.shape[0], q.shape[1], spec.n)
    o = jnp.zeros((*rows, spec.h_v), spec.compute_dtype)
    return _varying(ring, o), _varying(ring, jnp.full(rows, -jnp.inf, spec.compute_dtype))


def _forward(ring: _Ring, local: LocalInputs) -> tuple[Array, Array]:
    """The ring: ``P`` steps of chunk state and merge, K/V rotated between steps."""
    q_pos = ring.q_positions()
    cd = ring.spec.compute_dtype
    q = local.q.astype(cd)

    def chunk(step: Any, k: Array, v: Array, kv_seg: Array | None) -> tuple[Array, Array]:
        k_pos = ring.k_positions(step)
        state = _state_fn(ring, local, q_pos, k_pos, kv_seg)
        return jax.lax.cond(
            _reachable(ring, local, q_pos, k_pos),
            lambda: state(q, k.astype(cd), v.astype(cd), local.bias, local.scale),
            lambda: _empty_state(ring, q),
        )

    def body(step: Any, carry: tuple[Any, ...]) -> tuple[Any, ...]:
        k, v, kv_seg, o, lse = carry
        o, lse = merge_states(o, lse, *chunk(step, k, v, kv_seg))
        k, v, kv_seg = ring.pass_on(step, (k, v, kv_seg))
        return k, v, kv_seg, o, lse

    init = (local.k, local.v, local.kv_seg, *_empty_state(ring, q))
    return jax.lax.fori_loop(0, ring.devices, body, init)[3:]


# The merged state ``(o, lse)`` of the local queries over every key (compute dtype).
_ring_states = jax.custom_vjp(_forward, nondiff_argnums=(0,))


def _ring_fwd(ring: _Ring, local: LocalInputs) -> tuple[tuple[Array, Array], Any]:
    o, lse = _forward(ring, local)
    return (o, lse), (local, o, lse)


def _ring_bwd(ring: _Ring, res: Any, cts: tuple[Array, Array]) -> tuple[LocalInputs]:
    local, o, lse = res
    cd = ring.spec.compute_dtype
    q_pos = ring.q_positions()
    q = local.q.astype(cd)
    # Rows with a finite L: the others (no key, or a non-finite value read) have no gradient.
    ok = jnp.isfinite(lse)
    do = jnp.where(ok[..., None], cts[0].astype(cd), 0.0)
    dlse = jnp.where(ok, cts[1].astype(cd), 0.0)
    o_safe = jnp.where(ok[..., None], o, 0.0)
    lse_safe = jnp.where(ok, lse, 0.0)

    def grads(step: Any, k: Array, v: Array, kv_seg: Array | None) -> tuple[Any, ...]:
        k_pos = ring.k_positions(step)
        state = _state_fn(ring, local, q_pos, k_pos, kv_seg)

        def compute() -> tuple[Any, ...]:
            (o_c, lse_c), vjp = jax.vjp(
                state, q, k.astype(cd), v.astype(cd), local.bias, local.scale
            )
            w = jnp.where(ok, jnp.exp(jnp.where(ok, lse_c, -jnp.inf) - lse_safe), 0.0)
            spread = jnp.sum(do * (jnp.where(ok[..., None], o_c, 0.0) - o_safe), axis=-1)
            return vjp((w[..., None] * do, w * (spread + dlse)))

        skip = functools.partial(_zeros, ring, (q, k, v, local.bias, local.scale))
        return jax.lax.cond(_reachable(ring, local, q_pos, k_pos), compute, skip)

    def add(acc: tuple[Any, ...], g: tuple[Any, ...]) -> tuple[Any, ...]:
        return tuple(None if a is None else a + b for a, b in zip(acc, g, strict=True))

    def body(step: Any, carry: tuple[Any, ...]) -> tuple[Any, ...]:
        k, v, kv_seg, dq, dk, dv, db, ds = carry
        dq, dk, dv, db, ds = add((dq, dk, dv, db, ds), grads(step, k, v, kv_seg))
        # The accumulators move at every step (P rotations bring each back to its owner).
        dk, dv = ring.rotate((dk, dv))
        k, v, kv_seg = ring.pass_on(step, (k, v, kv_seg))
        return k, v, kv_seg, dq, dk, dv, db, ds

    zeros = _zeros(ring, (local.q, local.k, local.v, local.bias, local.scale))
    dq, dk, dv, db, ds = jax.lax.fori_loop(
        0, ring.devices, body, (local.k, local.v, local.kv_seg, *zeros)
    )[3:]
    # A traced scale's cotangent is this device's share: the pcast that shares it (_device) sums
    # the shares.
    grads_x = {"q": dq, "k": dk, "v": dv, "bias": db, "scale": ds}
    cast = {n: None if g is None else g.astype(getattr(local, n).dtype) for n, g in grads_x.items()}
    return (LocalInputs(**cast),)


_ring_states.defvjp(_ring_fwd, _ring_bwd)


def _device(ring: _Ring, local: LocalInputs) -> tuple[Array, Array]:
    """One device's program: the ring's merged state, then the kernel's finishing rules."""
    spec = ring.spec
    if local.bias is not None and ring.bias_shared:
        # One bias for every device: typed as varying, so its gradient is summed (psum).
        local = dataclasses.replace(local, bias=_varying(ring, local.bias))
    if local.scale is not None:  # a traced scale, the same on every device: likewise
        local = dataclasses.replace(local, scale=_varying(ring, local.scale))
    o, lse = _ring_states(ring, local)
    mean_v = None
    if spec.masked_rows == "uniform":  # the mean of all S values: each chunk's sum, psum
        own = chunks.value_sum(spec, local.v, ring.k_positions(0))
        mean_v = uniform_rows(spec, jax.lax.psum(own, ring.axis))
    lengths = lengths_only(local.q_lens, local.kv_lens)
    return finish(spec, lengths, o, lse, ~jnp.isneginf(lse), ring.q_positions(), mean_v)


@functools.lru_cache(maxsize=256)
def _program(ring: _Ring, mesh: Any, specs: LocalInputs) -> Any:
    """The jitted ``shard_map`` of :func:`_device` (cached: an eager call compiles once)."""
    tokens = PartitionSpec(None, ring.axis)
    return jax.jit(
        jax.shard_map(
            functools.partial(_device, ring),
            mesh=mesh,
            in_specs=(specs,),
            out_specs=(tokens, tokens),
        )
    )


# JAX's error for forward-mode differentiation of a ``custom_vjp``, and the kernels' instead.
_JVP_ERROR = "can't apply forward-mode autodiff (jvp) to a custom_vjp function"
_FORWARD_MODE = (
    "{name} does not support forward-mode differentiation (jax.jvp, jax.jacfwd, jax.linearize): "
    "its backward is a jax.custom_vjp that runs the ring again, and JAX has no forward-mode rule "
    "for a custom_vjp. Use reverse mode (jax.grad, jax.vjp, jax.jacrev; forward-over-reverse "
    "such as jax.hessian works), or all_gather_dot_product_attention, which has no custom rule "
    "and supports both modes."
)


def _schedule(scheme: str) -> Any:
    """The ring engine over the layout of ``scheme`` (the three public kernels differ only in
    it)."""
    layout = LAYOUT_OF[scheme]

    def ring_schedule(call: KernelCall, mesh: Any, axis_name: str | None) -> tuple[Array, Array]:
        spec, inputs, scale = call.spec, call.inputs, call.scale
        axis, devices = mesh_axis(mesh, axis_name)
        if spec.t == 0 or spec.s == 0:  # nothing to distribute: no query, or no key at all
            return naive(call)
        t_pad = seq_layout.padded_length(spec.t, devices, layout)
        s_pad = seq_layout.padded_length(spec.s, devices, layout)
        static_scale, traced_scale = split_scale(scale)
        traced = traced_scale is not None
        local, specs = shard_inputs(inputs, layout, devices, axis, t_pad, s_pad, traced)
        shared = specs.bias == PartitionSpec()  # the bias's T axis broadcast
        ring = _Ring(spec, axis, devices, layout, t_pad, s_pad, shared, static_scale)
        try:
            o, lse = _program(ring, mesh, specs)(local)
        except TypeError as error:
            if _JVP_ERROR not in str(error):
                raise
            raise TypeError(_FORWARD_MODE.format(name=f"{scheme}_dot_product_attention")) from error
        out = seq_layout.from_layout(o, 1, spec.t, devices, layout)
        return out, seq_layout.from_layout(lse, 1, spec.t, devices, layout)

    return ring_schedule


_KERNEL_DOC = """{title}

The {layout} layout: {layout_rule}.
At ring step ``r = 0, ..., P - 1`` device ``d`` updates
``(o, lse) <- merge((o, lse), state(q, K_{{(d - r) mod P}}, V_{{(d - r) mod P}}))``
and passes the chunk to device ``d + 1``. Same semantics, results and errors as
:func:`attnref.dot_product_attention` (lengths that {multiple} does not divide are padded
inside); the backward is a ``jax.custom_vjp`` that runs the ring again.
{cite} Under ``jax.jit``, ``mesh`` and ``axis_name`` are static.
"""


# Per scheme: the title, its layout rule, citation, length multiple, layout equation and registry
# summary.
_SCHEMES = {
    "ring": (
        "Ring attention (Liu et al. 2023): contiguous chunks, K/V rotated around the devices.",
        "device ``d`` holds positions ``d c, ..., d c + c - 1`` with ``c = T_pad / P``",
        "Liu, Zaharia & Abbeel (2023), Ring Attention with Blockwise Transformers for "
        "Near-Infinite Context, arXiv:2310.01889.",
        "``P``",
        r"\mathcal{P}_d = \{d c, \dots, (d + 1) c - 1\},\ c = T' / P",
        "Contiguous chunks; K/V chunks rotate around the devices (ppermute) while each "
        "device merges its queries' states online; custom_vjp backward with travelling dK/dV.",
    ),
    "striped": (
        "Striped attention (Brandon et al. 2023): the ring over a striped token layout.",
        "device ``d`` holds positions ``d, d + P, d + 2P, ...``, so under a causal mask "
        "every step is about equally useful on every device",
        "Brandon et al. (2023), Striped Attention: Faster Ring Attention for Causal "
        "Transformers, arXiv:2311.09431; the ring of Liu et al. (2023), arXiv:2310.01889.",
        "``P``",
        r"\mathcal{P}_d = \{d, d + P, d + 2P, \dots\}",
        "The ring over a striped layout (device d holds every P-th token from d): "
        "causal work balanced across devices at every step.",
    ),
    "zigzag": (
        "Zigzag ring attention: the ring over ``2P`` chunks, device ``d`` holding ``d`` and "
        "``2P - 1 - d``.",
        "the sequence in ``2P`` chunks; device ``d`` holds chunk ``d`` and chunk ``2P - 1 - d``, "
        "one early and one late, which balances the causal work",
        "The zigzag ring layout of zhuzilin/ring-flash-attention (GitHub, 2024); the ring of "
        "Liu et al. (2023), arXiv:2310.01889.",
        "``2P``",
        r"\mathcal{P}_d = C_d \cup C_{2P - 1 - d}\ (C_j: \text{chunk } j \text{ of } 2P)",
        "The ring over 2P chunks, device d holding chunks d and 2P - 1 - d: causal "
        "work balanced across devices.",
    ),
}


def _named(scheme: str) -> Any:
    """The public kernel ``<scheme>_dot_product_attention``: the ring over its layout."""
    title, rule, cite, multiple, _, _ = _SCHEMES[scheme]
    summary = _KERNEL_DOC.format(
        title=title, layout=LAYOUT_OF[scheme], layout_rule=rule, cite=cite, multiple=multiple
    )
    return mesh_kernel(
        _schedule(scheme),
        name=f"{scheme}_dot_product_attention",
        summary=summary.rstrip(),
        axis="of the ring",
        returns=(
            " Natural order, ``lse`` in the compute dtype; both differentiable in reverse mode"
            "\n    with respect to ``query``, ``key``, ``value``, ``bias`` and a traced ``scale`` "
            "(forward\n    over reverse, as ``jax.hessian``, works too)."
        ),
        type_errors=(
            "; or under forward-mode differentiation (``jax.jvp``, ``jax.jacfwd``): the backward\n"
            "        is a ``jax.custom_vjp`` (under an outer ``jax.jit``, JAX's own ``TypeError``\n"
            "        when the derivative is compiled). Use reverse mode, or\n"
            "        :func:`attnref.distributed.all_gather_dot_product_attention`"
        ),
    )


ring_dot_product_attention = _named("ring")
striped_dot_product_attention = _named("striped")
zigzag_dot_product_attention = _named("zigzag")
ring_attention = scheme_rows(ring_dot_product_attention)
striped_attention = scheme_rows(striped_dot_product_attention)
zigzag_attention = scheme_rows(zigzag_dot_product_attention)

_STEP = (
    r"(o_{{i,n}}, \mathrm{{lse}}_{{i,n}}) \leftarrow \mathrm{{merge}}\big((o_{{i,n}},"
    r" \mathrm{{lse}}_{{i,n}}), \mathrm{{state}}(q_{{i,n}}, K_{{\mathcal{{P}}_{{(d - r) \bmod"
    r" P}}, g(n)}}, V_{{\mathcal{{P}}_{{(d - r) \bmod P}}, g(n)}})\big),\ r = 0, \dots, P - 1,"
    r"\quad \mathrm{{state}}(q, K, V) = \Big(\mathrm{{softmax}}_j\big(\tfrac{{q k_j^\top}}"
    r"{{\sqrt{{d_k}}}} + b_j\big) V,\ \log \sum_j e^{{q k_j^\top / \sqrt{{d_k}} + b_j}}\Big),"
    r"\quad {layout}"
)
for _scheme in ("ring", "striped", "zigzag"):
    register_scheme(
        _scheme,
        globals()[f"{_scheme}_attention"],
        globals()[f"{_scheme}_dot_product_attention"],
        title=_SCHEMES[_scheme][0].split(":")[0],
        equation=_STEP.format(layout=_SCHEMES[_scheme][4]),
        citation=_SCHEMES[_scheme][2],
        formula=_forward,
        summary=_SCHEMES[_scheme][5],
        cost=(
            "FLOPs as the naive kernel over P devices (skipped steps do none); per device "
            "O(T S N H / P) work, O((T + S) N H / P) memory, P - 1 K/V sends of "
            "O(S K (H + H_v) / P) each (2P - 1 with the backward's dK/dV)."
        ),
    )
