"""Cost models: analytic FLOPs, transcendentals and bytes of each formulation, and XLA's counts.

:func:`cost` (``cost("concat", Dims(...))``) is each registry entry's ``cost_model``;
:func:`xla_counts` reads XLA's cost analysis of a compiled function and :func:`hlo_dot_flops`
counts the dot FLOPs in its HLO text, so the analytic model is checked against the compiler;
:func:`hlo_collectives` reads the collectives (and the bytes each device sends) of a compiled
SPMD program, which the distributed schemes' models (:class:`Collective`) are checked against;
:func:`feature_cost` is what the kernels' learnable sinks and dropout add; :func:`tile_schedule`
is the blockwise kernel's static schedule (the tiles it computes, those it computes without the
mask, those it skips) and :func:`blockwise_dot_flops` the dot FLOPs of the tiles it computes.
See ``docs/cost.md``.
"""

from attnref._src.core.cost import (
    Collective,
    Cost,
    Dims,
    XlaCounts,
    cost,
    hlo_collectives,
    hlo_dot_flops,
    xla_counts,
)
from attnref._src.formulations.blockwise import TileSchedule, blockwise_dot_flops, tile_schedule
from attnref._src.formulations.kernel import FeatureCost, feature_cost

__all__ = [
    "Collective",
    "Cost",
    "Dims",
    "FeatureCost",
    "TileSchedule",
    "XlaCounts",
    "blockwise_dot_flops",
    "cost",
    "feature_cost",
    "hlo_collectives",
    "hlo_dot_flops",
    "tile_schedule",
    "xla_counts",
]
