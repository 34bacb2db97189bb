"""Linear (kernel) attention in every form (Katharopoulos et al. 2020, "Transformers are RNNs").

The package re-exports every name the single module ``attnref._src.linear`` had:

- :mod:`attnref._src.linear._common`: input checks, the denominator policy (:func:`normalize`),
  the non-finite guards;
- :mod:`attnref._src.linear.kernel`: the kernel-level forms (quadratic, associative, prefix sum,
  recurrent with :class:`LinearState`, chunked);
- :mod:`attnref._src.linear.multihead`: the multi-head forms ``linear_<form>_attention`` and
  ``linear_messages_attention``;
- :mod:`attnref._src.linear.family`: the ``LINEAR`` family, the cost models and the registry
  entries (importing the package registers them).

The kernel-level and multi-head modules carry the full description (denominator policy, forms).
"""

# ruff: noqa: F401  (a re-export module: the names importable from the former single module)

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Float, Real

from attnref import oracle, tolerance
from attnref._src import cost as _cost
from attnref._src.checks import check_tokens, float64_scoped
from attnref._src.common import HIGHEST, add_output_bias, project, project_kv, residual_or
from attnref._src.family import Example, ExampleProblem, Family
from attnref._src.feature_maps import (
    FeatureMap,
    FeatureMapLike,
    check_feature_map,
    feature_map_from_name,
)
from attnref._src.linear._common import (
    _UNGUARDED,
    EPS_POLICIES,
    EpsPolicy,
    _causal,
    _check_policy,
    _check_qkv,
    _defined_eps,
    _dirty,
    _features,
    _finite_or_same,
    _guarded_kernel,
    _guarded_rows,
    _query,
    normalize,
)
from attnref._src.linear.family import (
    _LIN_EQ,
    CHOROMANSKI,
    KATHAROPOULOS,
    LINEAR,
    _linear_example,
    _linear_required,
    linear_associative_cost,
    linear_chunked_cost,
    linear_messages_cost,
    linear_prefix_sum_cost,
    linear_quadratic_cost,
    linear_recurrent_cost,
)
from attnref._src.linear.kernel import (
    LinearState,
    _quadratic_parts,
    _require_causal,
    linear_associative,
    linear_chunked,
    linear_prefix_sum,
    linear_quadratic,
    linear_recurrent,
    linear_state_init,
    linear_step,
)
from attnref._src.linear.multihead import (
    KERNEL_FORMS,
    _multihead,
    linear_associative_attention,
    linear_chunked_attention,
    linear_messages_attention,
    linear_prefix_sum_attention,
    linear_quadratic_attention,
    linear_recurrent_attention,
)
from attnref._src.merged import _messages
from attnref._src.nonfinite import finite_part, nonfinite_rows, poison_rows
from attnref._src.params import AttentionParams
from attnref._src.registry import REFACTOR, Formulation, register
