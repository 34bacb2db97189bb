"""Token layouts of sequence parallelism: which global positions each device holds.

A sequence of ``n`` tokens is padded to ``n_pad`` (a multiple of ``P``, ``2 P`` for zigzag) and
cut into ``P`` shards of ``c = n_pad / P``; device ``d`` holds ``positions(n_pad, P, layout)[d]``:
``"contiguous"`` ``d c, ..., d c + c - 1`` (Liu et al. 2023), ``"striped"`` ``d, d + P, ...``
(Brandon et al. 2023), ``"zigzag"`` chunks ``d`` and ``2P - 1 - d`` of ``2P`` (the zigzag ring of
zhuzilin/ring-flash-attention; Llama 3's context parallelism). Positions ``>= n`` are padding
(``docs/distributed.md``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec
from jaxtyping import Array

from attnref._src.formulations.kernel_spec import KernelInputs

LAYOUTS = ("contiguous", "striped", "zigzag")


def multiple(devices: int, layout: str) -> int:
    """The length every padded sequence is a multiple of: ``P``, or ``2 P`` for zigzag."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return 2 * devices if layout == "zigzag" else devices


def padded_length(n: int, devices: int, layout: str) -> int:
    """``n`` rounded up to a multiple of :func:`multiple` (``n = 0`` pads to one multiple, so
    every device holds at least one, padding, position)."""
    m = multiple(devices, layout)
    return max(m, -(-n // m) * m)


@functools.cache
def positions(n_pad: int, devices: int, layout: str) -> np.ndarray:
    """int32 ``[P, n_pad / P]``: row ``d`` lists the global positions device ``d`` holds.

    Raises:
        ValueError: If ``n_pad`` is not a multiple of :func:`multiple` ``(P, layout)``.
    """
    m = multiple(devices, layout)
    if n_pad % m:
        raise ValueError(f"a {layout} layout over {devices} devices needs a multiple of {m}")
    c = n_pad // devices
    if layout == "contiguous":
        table = np.arange(n_pad).reshape(devices, c)
    elif layout == "striped":
        table = np.arange(n_pad).reshape(c, devices).T
    else:
        chunks = np.arange(n_pad).reshape(2 * devices, c // 2)
        table = np.concatenate([chunks[:devices], chunks[devices:][::-1]], axis=1)
    table = np.ascontiguousarray(table, dtype=np.int32)
    table.setflags(write=False)
    return table


def pad_axis(a: Array, axis: int, n: int, fill: Any = 0) -> Array:
    """``a`` padded with ``fill`` to length ``n`` along ``axis``."""
    extra = n - a.shape[axis]
    if extra <= 0:
        return a
    pad = [(0, 0)] * a.ndim
    pad[axis] = (0, extra)
    return jnp.pad(a, pad, constant_values=fill)


def to_layout(
    x: Array, axis: int, n_pad: int, devices: int, layout: str, fill: float | int | bool = 0
) -> Array:
    """``x`` (natural order along ``axis``, length ``n``) padded with ``fill`` to ``n_pad`` and
    permuted into device-major order: shard ``d`` of the result holds ``positions[d]``."""
    x = pad_axis(x, axis, n_pad, fill)
    if layout == "contiguous":
        return x
    return jnp.take(x, jnp.asarray(positions(n_pad, devices, layout).reshape(-1)), axis=axis)


def from_layout(y: Array, axis: int, n: int, devices: int, layout: str) -> Array:
    """The inverse of :func:`to_layout`: natural order along ``axis``, padding dropped."""
    n_pad = y.shape[axis]
    if layout != "contiguous":
        inverse = np.argsort(positions(n_pad, devices, layout).reshape(-1))
        y = jnp.take(y, jnp.asarray(inverse.astype(np.int32)), axis=axis)
    return jax.lax.slice_in_dim(y, 0, n, axis=axis)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LocalInputs:
    """One device's inputs in a ring (``None`` where an option is not given, and for a concrete
    scale); the same pytree carries the ``in_specs`` and the cotangents, hence ``Any``."""

    q: Any
    k: Any
    v: Any
    bias: Any = None
    mask: Any = None
    q_seg: Any = None
    kv_seg: Any = None
    q_lens: Any = None
    kv_lens: Any = None
    scale: Any = None


def shard_inputs(
    inputs: KernelInputs,
    layout: str,
    devices: int,
    axis: str,
    t_pad: int,
    s_pad: int,
    traced_scale: bool,
) -> tuple[LocalInputs, LocalInputs]:
    """The ``shard_map`` operands of a validated call and their ``in_specs``: token axes laid out
    and split over ``axis``, a mask or bias along a full ``T``, the rest shared."""
    tokens, shared = PartitionSpec(None, axis), PartitionSpec()

    def seq(a: Array | None, n_pad: int, fill: float = 0.0) -> Array | None:
        """Axis 1 (tokens) in device-major order (``fill`` takes the array's dtype)."""
        return None if a is None else to_layout(a, 1, n_pad, devices, layout, fill)

    def rows(a: Array | None) -> Array | None:
        """A mask or bias: ``T`` laid out like the queries when full (padded rows ``0.0``,
        i.e. ``False``: padded queries are dropped anyway), else as it is (shared)."""
        if a is None or a.shape[2] == 1:
            return a
        return to_layout(a, 2, t_pad, devices, layout, 0.0)

    def spec(name: str, a: Array | None) -> PartitionSpec | None:
        if a is None:
            return None
        if name in ("bias", "mask"):
            return shared if a.shape[2] == 1 else PartitionSpec(None, None, axis)
        return shared if name in ("q_lens", "kv_lens", "scale") else tokens

    local = LocalInputs(
        q=seq(inputs.q, t_pad),
        k=seq(inputs.k, s_pad),
        v=seq(inputs.v, s_pad),
        bias=rows(inputs.bias),
        mask=rows(inputs.mask),
        q_seg=seq(inputs.q_seg, t_pad, -1.0),
        kv_seg=seq(inputs.kv_seg, s_pad, -2.0),
        q_lens=inputs.q_lens,
        kv_lens=inputs.kv_lens,
        scale=inputs.scale if traced_scale else None,
    )
    fields = dataclasses.fields(LocalInputs)
    return local, LocalInputs(**{f.name: spec(f.name, getattr(local, f.name)) for f in fields})
