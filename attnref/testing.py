"""Assertions for checking attention outputs against the oracle, and the conformance kit.

The closeness rules (:mod:`attnref._src.kit.closeness`): ``assert_within_bound`` compares
componentwise against a bound from :func:`attnref.tolerance.attention_error_bound`;
``assert_comparative`` applies FlashAttention's rule (error at most ``factor`` times a
same-precision reference's error plus a rounding floor). Both fail on any NaN/inf where the
expected value is finite, and refuse a non-finite expectation. Failure messages name the rule,
the worst index, and the error in units of the allowance.

One call checks a kernel (:mod:`attnref._src.kit.oracle_match`):
:func:`assert_matches_oracle` ``(out, query, key, value, **options)`` runs the float64 oracle
and derives the allowance for the output's dtype from the same options (jax.nn's, and
attnref's extensions), and fails numpy.testing-style (mismatched elements ``n / N``, the worst
index ``[b, t, n, h]``, both values there, the error as a multiple of the allowance);
:func:`assert_grads_match_oracle` ``(grads, query, key, value, cotangent, **options)`` does the
same for ``(dq, dk, dv)``. :func:`assert_attention_close` compares an output with an oracle
value you computed, under the three rules by name (``"bound"``, ``"flash"``, ``"torch"``; see
``docs/tolerances.md``). pytest hides the frames of all these assertions.

The conformance kit (:mod:`attnref._src.kit.conformance`): :func:`check_attention` runs attnref's
properties against anyone's attention function (``devices=(1, 2, 4, 8)``: a distributed one, on
meshes of those sizes, with the ring-size growth of its error) and returns a
:class:`ConformanceReport`; :func:`check_merge_states` runs the state-algebra properties (oracle,
commutative, associative, identity, stability, dtypes, gradients) against anyone's
``merge_states``.
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
