"""Rotary position embedding (Su et al. 2024) and attention with it.

``q_m -> R(m theta) q_m``, ``k_n -> R(n theta) k_n``, so the logit depends on ``n - m`` only:
``q_m^T R((n - m) theta) k_n``. Kernel layout ``[..., T, H, d]`` for :func:`apply_rope`; the
multi-head forms take row-vector tokens ``[..., T, d_model]``. See ``docs/rope.md``.
"""

from attnref._src.formulations.rope import (
    apply_rope,
    apply_rope_complex,
    rope_attention,
    rope_frequencies,
    rope_pattern_matrices,
    rope_patterns_attention,
    rope_rotation,
)
from attnref._src.formulations.rope_family import CONVENTIONS

__all__ = [
    "CONVENTIONS",
    "apply_rope",
    "apply_rope_complex",
    "rope_attention",
    "rope_frequencies",
    "rope_pattern_matrices",
    "rope_patterns_attention",
    "rope_rotation",
]
