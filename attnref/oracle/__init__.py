"""The float64 NumPy oracle: attention from its definitions, written independently of the JAX code.

This package imports NumPy only (never JAX) and shares no code with the JAX formulations, so that
agreement between the two is evidence, not tautology. Everything is computed in float64.

* :mod:`attnref.oracle._core`: multi-head attention at the weight level (per head, per query),
  linear attention and its feature maps.
"""

from __future__ import annotations

from ._core import (
    attention,
    attention_weights,
    features,
    head_outputs,
    linear_attention,
    linear_multihead,
)

__all__ = [
    "attention",
    "attention_weights",
    "features",
    "head_outputs",
    "linear_attention",
    "linear_multihead",
]
