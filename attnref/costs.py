"""Cost models: analytic FLOPs, transcendentals and bytes of each formulation, and XLA's counts.

:func:`cost` (``cost("concat", Dims(...))``) is each registry entry's ``cost_model``;
:func:`xla_counts` reads XLA's cost analysis of a compiled function and :func:`hlo_dot_flops`
counts the dot FLOPs in its HLO text, so the analytic model is checked against the compiler;
:func:`hlo_collectives` reads the collectives (and the bytes each device sends) of a compiled
SPMD program, which the distributed schemes' models (:class:`Collective`) are checked against.
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

__all__ = [
    "Collective",
    "Cost",
    "Dims",
    "XlaCounts",
    "cost",
    "hlo_collectives",
    "hlo_dot_flops",
    "xla_counts",
]
