"""Linear (kernel) attention in every form (Katharopoulos et al. 2020, "Transformers are RNNs").

The package re-exports every name the single module ``attnref._src.formulations.linear`` had:

- :mod:`attnref._src.formulations.linear.common`: input checks, the denominator policy (:func:`normalize`),
  the non-finite guards;
- :mod:`attnref._src.formulations.linear.kernel`: the kernel-level forms (quadratic, associative, prefix sum,
  recurrent with :class:`LinearState`, chunked);
- :mod:`attnref._src.formulations.linear.multihead`: the multi-head forms ``linear_<form>_attention`` and
  ``linear_messages_attention``;
- :mod:`attnref._src.formulations.linear.family`: the ``LINEAR`` family, the cost models and the registry
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
from attnref._src.core import cost as _cost
from attnref._src.core.checks import check_tokens, float64_scoped
from attnref._src.core.common import HIGHEST, add_output_bias, project, project_kv, residual_or
from attnref._src.core.family import Example, ExampleProblem, Family
from attnref._src.core.nonfinite import finite_part, nonfinite_rows, poison_rows
from attnref._src.core.params import AttentionParams
from attnref._src.core.registry import REFACTOR, Formulation, register
from attnref._src.formulations.feature_maps import (
    FeatureMap,
    FeatureMapLike,
    check_feature_map,
    feature_map_from_name,
)
from attnref._src.formulations.linear.common import (
    EPS_POLICIES,
    UNGUARDED,
    EpsPolicy,
    causal_pairs,
    check_policy,
    check_qkv,
    defined_eps,
    dirty_rows,
    features,
    finite_or_same,
    guarded_kernel,
    guarded_rows,
    normalize,
    query,
)
from attnref._src.formulations.linear.family import (
    CHOROMANSKI,
    KATHAROPOULOS,
    LIN_EQ,
    LINEAR,
    linear_associative_cost,
    linear_chunked_cost,
    linear_example,
    linear_messages_cost,
    linear_prefix_sum_cost,
    linear_quadratic_cost,
    linear_recurrent_cost,
    linear_required,
)
from attnref._src.formulations.linear.kernel import (
    LinearState,
    linear_associative,
    linear_chunked,
    linear_prefix_sum,
    linear_quadratic,
    linear_recurrent,
    linear_state_init,
    linear_step,
    quadratic_parts,
    require_causal,
)
from attnref._src.formulations.linear.multihead import (
    KERNEL_FORMS,
    linear_associative_attention,
    linear_chunked_attention,
    linear_messages_attention,
    linear_prefix_sum_attention,
    linear_quadratic_attention,
    linear_recurrent_attention,
    multihead,
)
from attnref._src.formulations.merged import compute_messages
