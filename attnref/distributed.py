"""Distributed attention on a JAX mesh: the same function, computed in pieces on several devices.

Kernel level (the layout and options of ``jax.nn.dot_product_attention`` plus ``mesh`` and
``axis_name``; global arrays in, global arrays out): ``<scheme>_dot_product_attention`` for the
ring, striped and zigzag rings (K/V rotated with ``ppermute``, states merged online by
:func:`attnref.merge_states`), all-gather, Ulysses (``all_to_all`` between sequence and head
sharding) and tensor parallelism (heads sharded); row forms ``<scheme>_attention(params, x_q,
x_kv, *, mask, bias, scale, residual, mesh)``, the registry's ``apply``. The layouts
(:data:`LAYOUTS`) come with their causal load balance and the ring's computed tiles.

On one host, ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (set before JAX starts)
gives 8 virtual CPU devices. See ``docs/distributed.md``.
"""

from attnref._src.formulations.distributed.all_gather import (
    all_gather_attention,
    all_gather_dot_product_attention,
)
from attnref._src.formulations.distributed.cost import (
    ALWAYS,
    NEVER,
    SOMETIMES,
    chunk_tiles,
    load_balance,
    piece_tiles,
    ring_tiles_computed,
    useful_flops,
    useful_pairs,
)
from attnref._src.formulations.distributed.family import DISTRIBUTED, default_mesh
from attnref._src.formulations.distributed.layout import LAYOUTS, padded_length, positions
from attnref._src.formulations.distributed.ring import (
    LAYOUT_OF,
    ring_attention,
    ring_dot_product_attention,
    striped_attention,
    striped_dot_product_attention,
    zigzag_attention,
    zigzag_dot_product_attention,
)
from attnref._src.formulations.distributed.tensor_parallel import (
    tensor_parallel_attention,
    tensor_parallel_dot_product_attention,
)
from attnref._src.formulations.distributed.ulysses import (
    ulysses_attention,
    ulysses_dot_product_attention,
)

__all__ = [
    "ALWAYS",
    "DISTRIBUTED",
    "LAYOUTS",
    "LAYOUT_OF",
    "NEVER",
    "SOMETIMES",
    "all_gather_attention",
    "all_gather_dot_product_attention",
    "chunk_tiles",
    "default_mesh",
    "load_balance",
    "padded_length",
    "piece_tiles",
    "positions",
    "ring_attention",
    "ring_dot_product_attention",
    "ring_tiles_computed",
    "striped_attention",
    "striped_dot_product_attention",
    "tensor_parallel_attention",
    "tensor_parallel_dot_product_attention",
    "ulysses_attention",
    "ulysses_dot_product_attention",
    "useful_flops",
    "useful_pairs",
    "zigzag_attention",
    "zigzag_dot_product_attention",
]
