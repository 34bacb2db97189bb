"""Tensor-parallel heads (Megatron-LM, Shoeybi et al. 2019): the heads are split over the devices.

Multi-head attention is a sum over heads, ``y = sum_n o_n W_O[n] + b_O``, and every head is
independent up to that sum. With ``P`` devices, device ``d`` holds query heads
``d N/P, ..., (d + 1) N/P - 1`` (the rows of ``W_Q`` and ``W_O`` of those heads) and the key/value
heads they read (query head ``n`` reads K/V head ``n // (N/K)``):

* kernel level (:func:`tensor_parallel_dot_product_attention`): ``q [B, T, N, H]`` sharded on its
  head axis, ``k``/``v`` on theirs, the full sequence on every device, the kernel on the local
  heads; **no communication** (the output stays sharded on its head axis);
* row form (:func:`tensor_parallel_attention`): each device projects its own heads
  (``x W_Q[n] + b_Q[n]`` ...), attends and writes its partial block output
  ``sum_{n on d} o_n W_O[n]``; one ``lax.psum`` over the devices gives the per-head sum, then
  ``+ b_O`` (and ``x_q +`` with ``residual``). The psum is the only communication: ``B T d_model``
  numbers per device (an all-reduce).

Grouped K/V heads: when ``P`` divides ``K`` each device holds ``K/P`` whole groups. When it does
not (MQA, or ``K < P``), every K/V head is repeated ``r = lcm(K, P) / K`` times first (as
Megatron-LM replicates K/V heads over tensor-parallel ranks), so that the ``K r`` heads split
evenly and each device holds the copies its query heads read. ``P`` must divide ``N``: a call
that cannot keep every query head whole on one device is refused (``ValueError``).

The head-splitting helpers here (:func:`check_heads`, :func:`kv_repeats`, :func:`head_spec`,
:func:`local_attention`) are shared with Ulysses (:mod:`attnref._src.formulations.distributed.ulysses`), which
splits the heads the same way after its all-to-all. Gradients are autodiff (the transpose of a
``psum`` is a broadcast).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as Spec
from jaxtyping import Array, ArrayLike, Bool, Float, Int

from attnref._src.core.checks import HIGHEST, float64_scoped, is_traced
from attnref._src.core.common import Prepared, add_output_bias, prepare_rows, residual_or
from attnref._src.core.params import AttentionParams
from attnref._src.core.registry import Formulation, register
from attnref._src.formulations.decode import project as _kernel_heads
from attnref._src.formulations.distributed import cost as _dcost
from attnref._src.formulations.distributed.family import DISTRIBUTED, head_mesh, mesh_axis
from attnref._src.formulations.kernel import (
    Alignment,
    KernelInputs,
    KernelSpec,
    MaskedRows,
    dot_product_attention,
    prepare,
    require_lengths_in_range,
)
from attnref._src.formulations.kernel_forms import flat, pairs

# ----------------------------------------------------------------------------- head splitting


def check_heads(n: int, devices: int, axis_name: str, scheme: str, what: str) -> None:
    """Refuse a head count ``n`` that the ``devices`` of ``axis_name`` do not divide.

    Raises:
        ValueError: Naming ``what`` (the argument and its shape) and the mesh axis.
    """
    if n % devices:
        raise ValueError(
            f"{what} has N={n} query heads, which the P={devices} devices of mesh axis "
            f"{axis_name!r} do not divide: {scheme} gives each device N/P whole query heads "
            "(use a mesh axis whose size divides N)"
        )


def kv_repeats(n: int, k: int, devices: int) -> int:
    """How many copies ``r`` of each K/V head make ``K r`` divisible by ``P`` (and still divide
    ``N``): ``lcm(K, P) / K``, 1 when ``P`` divides ``K``. Needs ``P | N`` and ``K | N``."""
    r = math.lcm(k, devices) // k
    assert n % (k * r) == 0, (n, k, devices)
    return r


def repeat_kv(a: Array, r: int, axis: int = 2) -> Array:
    """Each K/V head repeated ``r`` times along ``axis`` (head ``k`` becomes ``k r .. k r + r-1``;
    query head ``n`` then reads copy ``n // (N / (K r))``, a copy of head ``n // (N/K)``)."""
    return a if r == 1 else jnp.repeat(a, r, axis=axis)


def head_spec(a: Array | None, axis_name: str, head_axis: int = 1) -> Spec:
    """The sharding of a mask or bias ``[#B, #N, ...]``: split on its head axis when that axis is
    full (``> 1``), replicated when it broadcasts."""
    if a is None or a.shape[head_axis] == 1:
        return Spec()
    return Spec(*([None] * head_axis), axis_name)


def local_attention(
    spec: KernelSpec,
    scale: Any,
    q: Float[Array, "B T n H"],
    k: Float[Array, "B S k H"],
    v: Float[Array, "B S k H_v"],
    bias: Array | None,
    mask: Array | None,
    q_lens: Int[Array, " B"] | None,
    kv_lens: Int[Array, " B"] | None,
    q_seg: Int[Array, "B T"] | None,
    kv_seg: Int[Array, "B S"] | None,
    masked_rows: str,
) -> tuple[Float[Array, "B T n H_v"], Float[Array, "B T n"]]:
    """``attnref.dot_product_attention`` on one device's heads with the global call's static
    options (causality, alignment, window, softcap) and the given arrays; ``(o, lse)``."""
    return dot_product_attention(
        q,
        k,
        v,
        bias,
        mask,
        scale=scale,
        is_causal=spec.is_causal,
        query_seq_lengths=q_lens,
        key_value_seq_lengths=kv_lens,
        local_window_size=spec.window,
        segment_ids=None if q_seg is None else (q_seg, kv_seg),
        softcap=spec.softcap,
        causal_alignment=spec.alignment,  # type: ignore[arg-type]
        masked_rows=masked_rows,  # type: ignore[arg-type]
        return_lse=True,
    )


def split_scale(scale: Any) -> tuple[float | None, Array | None]:
    """The caller's ``scale`` for a jitted scheme: a concrete one as a static Python float
    (hashable, part of the compiled program's key), a traced one as an array argument."""
    if scale is None:
        return None, None
    if is_traced(scale):
        return None, jnp.asarray(scale)
    return float(scale), None


def optional(**arrays: Any) -> dict[str, Any]:
    """The given arrays without the ``None`` entries (a ``shard_map`` argument pytree)."""
    return {name: a for name, a in arrays.items() if a is not None}


# ----------------------------------------------------------------------------- kernel level


@functools.partial(jax.jit, static_argnames=("spec", "scale", "mesh", "axis", "devices"))
def _sharded(
    spec: KernelSpec,
    x: KernelInputs,
    traced_scale: Array | None,
    scale: float | None,
    mesh: Mesh,
    axis: str,
    devices: int,
) -> tuple[Array, Array]:
    """The kernel on ``N/P`` query heads per device; ``(o, lse)`` global, natural head order.
    Jitted (a ``shard_map`` run eagerly dispatches every operation on its own)."""
    r = kv_repeats(spec.n, spec.k, devices)
    heads = Spec(None, None, axis)
    args = optional(
        q=x.q,
        k=repeat_kv(x.k, r),
        v=repeat_kv(x.v, r),
        bias=x.bias,
        mask=x.mask,
        q_lens=x.q_lens,
        kv_lens=x.kv_lens,
        q_seg=x.q_seg,
        kv_seg=x.kv_seg,
        scale=traced_scale,
    )
    specs = {name: Spec() for name in args}
    specs.update(q=heads, k=heads, v=heads)
    for name in ("bias", "mask"):
        if name in args:
            specs[name] = head_spec(args[name], axis)

    def body(a: dict[str, Array]) -> tuple[Array, Array]:
        return local_attention(
            spec,
            a.get("scale", scale),
            a["q"],
            a["k"],
            a["v"],
            a.get("bias"),
            a.get("mask"),
            a.get("q_lens"),
            a.get("kv_lens"),
            a.get("q_seg"),
            a.get("kv_seg"),
            spec.masked_rows,
        )

    run = jax.shard_map(body, mesh=mesh, in_specs=(specs,), out_specs=(heads, heads))
    return run(args)


@float64_scoped
def tensor_parallel_dot_product_attention(
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
    """``attnref.dot_product_attention`` with the heads split over a mesh axis (Megatron-LM).

    ``o_n = softmax(s_n, allowed) v_{n // G}`` for every query head ``n``; device ``d`` of the
    ``P`` devices of ``axis_name`` computes heads ``d N/P .. (d + 1) N/P - 1`` over the whole
    sequence, reading its share of ``key``/``value`` heads (each K/V head repeated
    ``lcm(K, P)/K`` times first when ``P`` does not divide ``K``). ``mask`` and ``bias`` are split
    on their head axis when it is full and replicated when it broadcasts; lengths and segment ids
    are replicated. No communication: the output is sharded on its head axis. Semantics, results
    and errors are those of :func:`attnref.dot_product_attention` (``docs/kernel.md``).

    Args:
        query: ``[B, T, N, H]``, floating; ``N`` must be a multiple of ``P``.
        key: ``[B, S, K, H]``, the dtype of ``query``; ``N`` must be a multiple of ``K``.
        value: ``[B, S, K, H_v]``, the dtype of ``query``.
        bias: Floating, rank 4, broadcastable to ``[B, N, T, S]``; ``None`` (default).
        mask: Boolean, rank 4, broadcastable to ``[B, N, T, S]``, ``True`` = may attend;
            ``None`` (default).
        mesh: A ``jax.sharding.Mesh``.
        axis_name: The mesh axis to split the heads over; ``None`` (default): the only axis of
            a 1-D mesh.
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
        ``o [B, T, N, H_v]`` in the dtype of ``query`` (sharded on its head axis), or
        ``(o, lse)`` with ``return_lse``.

    Raises:
        ValueError: For every input :func:`attnref.dot_product_attention` refuses with
            ``ValueError``; if ``axis_name`` is not an axis of ``mesh`` (or is ``None`` for a
            mesh with several axes); or if ``P`` does not divide the ``N`` query heads.
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
    check_heads(spec.n, devices, axis, "tensor parallelism", f"query {tuple(x.q.shape)}")
    require_lengths_in_range(spec, x)
    static, traced = split_scale(scale)
    out, lse = _sharded(spec, x, traced, static, mesh, axis, devices)
    return (out, lse) if return_lse else out


# ----------------------------------------------------------------------------- row form


def _head_weights(params: AttentionParams, r: int) -> dict[str, Any]:
    """Every per-head weight and bias (K/V ones repeated ``r`` times), head axis first."""
    kv = {"w_k": params.w_k, "w_v": params.w_v, "b_k": params.b_k, "b_v": params.b_v}
    out = {name: None if a is None else repeat_kv(jnp.asarray(a), r, 0) for name, a in kv.items()}
    return optional(w_q=params.w_q, b_q=params.b_q, w_o=params.w_o, **out)


def _partial_sum(
    w: dict[str, Array], xq: Array, xkv: Array, m: Array | None, b: Array | None, scale: Any
) -> Array:
    """One device's ``sum_{n on d} o_n W_O[n]`` for its heads' weights ``w``."""
    o = dot_product_attention(
        _kernel_heads(xq, w["w_q"], w.get("b_q")),
        _kernel_heads(xkv, w["w_k"], w.get("b_k")),
        _kernel_heads(xkv, w["w_v"], w.get("b_v")),
        b,
        m,
        scale=scale,
    )
    return jnp.einsum("bthv,hvd->btd", o, w["w_o"], precision=HIGHEST)


@functools.partial(jax.jit, static_argnames=("scale", "mesh", "axis"))
def _head_sum(
    weights: dict[str, Array],
    tokens: dict[str, Array],
    scale: float | None,
    mesh: Mesh,
    axis: str,
) -> Float[Array, "B T_q d_model"]:
    """``psum_d sum_{n on d} o_n W_O[n]``: the weights split on their head axis, the tokens,
    mask and bias replicated. Jitted (a ``shard_map`` run eagerly dispatches every operation
    on its own)."""

    def body(w: dict[str, Array], t: dict[str, Array]) -> Array:
        sc = t.get("scale", scale)
        part = _partial_sum(w, t["xq"], t["xkv"], t.get("m"), t.get("bias"), sc)
        return jax.lax.psum(part, axis)

    w_specs = {name: Spec(axis) for name in weights}
    t_specs = {name: Spec() for name in tokens}
    run = jax.shard_map(body, mesh=mesh, in_specs=(w_specs, t_specs), out_specs=Spec())
    return run(weights, tokens)


@float64_scoped
def tensor_parallel_attention(
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
    """Multi-head attention with the heads split over the devices and the head sum a ``psum``.

    ``y = psum_d ( sum_{n on d} softmax(q_n k_{g(n)}^T scale + bias, mask) v_{g(n)} W_O[n] )
    + b_O``: device ``d`` holds ``W_Q``, ``b_Q``, ``W_O`` of its ``H/P`` query heads and
    ``W_K``, ``W_V``, ``b_K``, ``b_V`` of the K/V heads they read (repeated ``lcm(K, P)/K``
    times when ``P`` does not divide ``K``); the tokens, mask and bias are replicated.

    Args:
        params: Per-head weights (:class:`attnref.AttentionParams`); query head ``i`` reads
            key/value head ``i // G`` (``G = H / K``); ``H`` must be a multiple of ``P``.
        x_q: Query tokens, row vectors ``[..., T_q, d_model]``, the dtype of ``params``.
        x_kv: Key/value tokens ``[..., T_k, d_model]`` with the batch shape of ``x_q``;
            ``None`` (default) means ``x_q`` (self-attention).
        mask: Boolean, broadcastable to ``[..., T_q, T_k]``, ``True`` = may attend; ``None``
            (default) allows every pair.
        bias: Floating additive bias, broadcastable to ``[..., T_q, T_k]`` (``-inf`` masks like
            ``False``); cast to the dtype of ``x_q``.
        scale: The logit scale; ``None`` (default) means ``1/sqrt(d_k)``.
        residual: If ``True``, return ``x_q + MultiHead`` (the residual-stream update).
        mesh: A 1-D ``jax.sharding.Mesh``; ``None`` (default): the most devices (at most
            ``jax.device_count()``) whose count divides ``H``.

    Returns:
        The block output ``[..., T_q, d_model]``, the dtype of ``x_q`` (replicated); a fully
        masked query row is ``b_O`` (zero without biases).

    Raises:
        ValueError: If ``params`` is malformed, ``x_q``/``x_kv`` have rank < 2, the wrong
            ``d_model`` or different batch shapes, ``mask``/``bias`` do not broadcast to
            ``[..., T_q, T_k]``, ``scale`` is not a scalar, ``mesh`` has several axes, or the
            mesh's ``P`` devices do not divide the ``H`` query heads.
        TypeError: If ``x_q``, ``x_kv`` and ``params`` mix dtypes, ``mask`` is not boolean,
            ``bias`` is not floating, ``scale`` is not a real number, or ``mesh`` is not a
            ``jax.sharding.Mesh``.
    """
    p = prepare_rows(params, x_q, x_kv, mask, bias, scale)
    n, k = jnp.shape(params.w_q)[0], jnp.shape(params.w_k)[0]
    mesh = head_mesh(int(n)) if mesh is None else mesh
    axis, devices = mesh_axis(mesh, None)
    check_heads(n, devices, axis, "tensor parallelism", f"params.w_q {jnp.shape(params.w_q)}")
    weights = _head_weights(params, kv_repeats(n, k, devices))

    def compute(pr: Prepared) -> Array:
        xq, xkv, b = flat(pr)
        static, traced = split_scale(scale)
        tokens = optional(
            xq=xq, xkv=xkv, m=pairs(pr, pr.mask, b), bias=pairs(pr, pr.bias, b), scale=traced
        )
        y = _head_sum(weights, tokens, static, mesh, axis).reshape(*pr.batch_shape, pr.t_q, -1)
        return residual_or(add_output_bias(y, params), pr.x_q, residual)

    return p.guarded(compute, residual)


register(
    Formulation(
        id="tensor_parallel",
        title="Tensor-parallel heads: per-device head sums reduced with psum (Megatron-LM)",
        equation=(
            r"y_i = \mathrm{psum}_{d=1}^{P} \sum_{n \in \mathcal{H}_d} \mathrm{softmax}_j"
            r"\Big(\frac{q_{i,n} k_{j,g(n)}^\top}{\sqrt{d_k}} + b_{ij}\Big) v_{j,g(n)} W_{O,n}"
            r" + b_O,\quad |\mathcal{H}_d| = H / P"
        ),
        convention="kernel",
        citation=(
            "Shoeybi et al. (2019), Megatron-LM: Training Multi-Billion Parameter Language "
            "Models Using Model Parallelism, arXiv:1909.08053."
        ),
        apply=tensor_parallel_attention,
        native=tensor_parallel_dot_product_attention,
        summary=(
            "Each device projects and attends with its own H/P heads (K/V heads repeated when P "
            "does not divide them) and writes its partial sum of o_n W_O[n]; one psum "
            "(all-reduce of B T d_model numbers) gives the block output."
        ),
        cost=(
            "FLOPs O(B T_q T_k H (d_k + d_v) / P) per device, no sequence communication; "
            "memory O(B H T_q T_k / P) logits per device; one all-reduce of O(B T_q d_model)."
        ),
        family=DISTRIBUTED,
        cost_model=_dcost.tensor_parallel_cost,
    )
)
