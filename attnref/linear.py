"""Linear (kernel) attention: feature maps, the five orders of operations, the recurrent state.

``y_t = phi(q_t)^T S / phi(q_t)^T z`` with ``S = sum_s phi(k_s) v_s^T`` and ``z = sum_s phi(k_s)``
(Katharopoulos et al. 2020; FAVOR+ of Choromanski et al. 2021). Kernel-level forms take
``(q, k, v)`` as ``[..., T, H, d]`` (the ``jax.nn`` layout); the multi-head forms
``linear_<form>_attention(params, x_q, x_kv, ...)`` take row-vector tokens ``[..., T, d_model]``.
See ``docs/linear_attention.md``.
"""

from attnref._src.formulations.feature_maps import (
    FeatureMap,
    elu_plus_one,
    favor_plus,
    identity_features,
    relu_features,
    taylor2,
)
from attnref._src.formulations.linear.common import EPS_POLICIES
from attnref._src.formulations.linear.kernel import (
    LinearState,
    linear_associative,
    linear_chunked,
    linear_prefix_sum,
    linear_quadratic,
    linear_recurrent,
    linear_state_init,
    linear_step,
)
from attnref._src.formulations.linear.multihead import (
    linear_associative_attention,
    linear_chunked_attention,
    linear_messages_attention,
    linear_prefix_sum_attention,
    linear_quadratic_attention,
    linear_recurrent_attention,
)

__all__ = [
    "EPS_POLICIES",
    "FeatureMap",
    "LinearState",
    "elu_plus_one",
    "favor_plus",
    "identity_features",
    "linear_associative",
    "linear_associative_attention",
    "linear_chunked",
    "linear_chunked_attention",
    "linear_messages_attention",
    "linear_prefix_sum",
    "linear_prefix_sum_attention",
    "linear_quadratic",
    "linear_quadratic_attention",
    "linear_recurrent",
    "linear_recurrent_attention",
    "linear_state_init",
    "linear_step",
    "relu_features",
    "taylor2",
]
