"""Token layouts of sequence parallelism: which global positions each device holds.

A sequence of ``n`` tokens is padded to ``n_pad`` (a multiple of ``P``, or of ``2 P`` for zigzag)
and cut into ``P`` equal shards of ``c = n_pad / P`` tokens. Device ``d`` holds the positions
``positions(n_pad, P, layout)[d]``:

* ``"contiguous"`` (ring attention, Liu et al. 2023): ``d c, ..., d c + c - 1``;
* ``"striped"`` (Brandon et al. 2023): ``d, d + P, d + 2P, ...`` (every ``P``-th token);
* ``"zigzag"`` (load-balanced causal: the zigzag ring of zhuzilin/ring-flash-attention, and the
  chunks of the Llama 3 report's all-gather context parallelism, Grattafiori et al. 2024): the
  sequence in ``2P`` chunks of ``h = n_pad / 2P``; device ``d`` holds chunk ``d`` then chunk
  ``2P - 1 - d``.

Positions ``>= n`` are padding: never attended as keys (the allowed rule tests ``j < S``) and
dropped as queries. :func:`to_layout` and :func:`from_layout` move a natural-order array into the
device-major order (the concatenation of the shards) and back.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

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
        h = c // 2
        chunks = np.arange(n_pad).reshape(2 * devices, h)
        table = np.concatenate([chunks[:devices], chunks[devices:][::-1]], axis=1)
    table = np.ascontiguousarray(table, dtype=np.int32)
    table.setflags(write=False)
    return table


def to_layout(
    x: Array, axis: int, n_pad: int, devices: int, layout: str, fill: float | int | bool = 0
) -> Array:
    """``x`` (natural order along ``axis``, length ``n``) padded with ``fill`` to ``n_pad`` and
    permuted into device-major order: shard ``d`` of the result holds ``positions[d]``."""
    n = x.shape[axis]
    if n_pad > n:
        pad = [(0, 0)] * x.ndim
        pad[axis] = (0, n_pad - n)
        x = jnp.pad(x, pad, constant_values=fill)
    if layout == "contiguous":
        return x
    return jnp.take(x, jnp.asarray(positions(n_pad, devices, layout).reshape(-1)), axis=axis)


def from_layout(y: Array, axis: int, n: int, devices: int, layout: str) -> Array:
    """The inverse of :func:`to_layout`: natural order along ``axis``, padding dropped."""
    n_pad = y.shape[axis]
    if layout != "contiguous":
        inverse = np.argsort(positions(n_pad, devices, layout).reshape(-1))
        y = jnp.take(y, jnp.asarray(inverse.astype(np.int32)), axis=axis)
    return jax_slice(y, axis, n)


def jax_slice(y: Array, axis: int, n: int) -> Array:
    """The first ``n`` entries of ``y`` along ``axis``."""
    index = [slice(None)] * y.ndim
    index[axis] = slice(0, n)
    return y[tuple(index)]
