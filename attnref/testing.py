"""Assertions for checking attention outputs against the oracle, and the conformance kit.

Closeness rules: ``assert_within_bound`` compares componentwise against a bound from
:func:`attnref.tolerance.attention_error_bound`; ``assert_comparative`` applies FlashAttention's
rule (error at most ``factor`` times a same-precision reference's plus a rounding floor);
:func:`assert_attention_close` applies a rule by name (``"bound"``, ``"flash"``, ``"torch"``;
``docs/tolerances.md``). Each fails on NaN/inf where the oracle is finite, refuses a non-finite
oracle, and names the rule, the worst index and the error in units of the allowance.

:func:`assert_matches_oracle` ``(out, query, key, value, **options)`` runs the float64 oracle and
derives the allowance from the same options, failing numpy.testing-style (mismatches ``n / N``,
the worst index ``[b, t, n, h]``, both values, the ratio);
:func:`assert_grads_match_oracle` ``(grads, query, key, value, cotangent, **options)`` does the
same for ``(dq, dk, dv)``. pytest hides these assertions' frames.

:func:`check_attention` runs attnref's properties against anyone's attention function
(``devices=(1, 2, 4, 8)``: a distributed one, with the ring-size growth of its error) and returns
a :class:`ConformanceReport`; :func:`check_merge_states` runs the state-algebra properties
against anyone's ``merge_states``.
"""

# ruff: noqa: F401 (the names below are the exports: __all__ lists them)
from __future__ import annotations

from attnref._src.kit.closeness import (
    RULES,
    Closeness,
    assert_attention_close,
    assert_comparative,
    assert_ratio_within,
    assert_within_bound,
)
from attnref._src.kit.conformance.engine import check_attention, production_plan
from attnref._src.kit.conformance.options import (
    ALL_PROPERTIES,
    DEFAULT_FEATURES,
    DISTRIBUTED_PROPERTIES,
    FEATURE_ALIASES,
    FEATURES,
    PROPERTIES,
    SIGNATURES,
)
from attnref._src.kit.conformance.report import ConformanceReport, MeshResult, PropertyResult
from attnref._src.kit.conformance.states import MERGE_PROPERTIES, check_merge_states
from attnref._src.kit.conformance.targets import load_target
from attnref._src.kit.oracle_match import Match, assert_grads_match_oracle, assert_matches_oracle

__all__ = sorted(n for n in dir() if not n.startswith("_") and n != "annotations")

from attnref._src.kit.closeness import FLASH_FACTOR, TORCH_FACTOR  # importable, not in __all__
