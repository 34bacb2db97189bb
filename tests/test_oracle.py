"""The oracle itself: correct on hand-derived cases, and well formed.

Its independence from JAX (a normal ``import attnref.oracle`` loads no JAX) is checked in
``tests/test_layers.py``.
"""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

import attnref
from attnref import oracle, tolerance


def test_hand_derived_two_token_case():
    """d_model = d_k = d_v = 1, all weights 1, x = [0, 1]: logits x_i x_j, so row 0 is uniform
    and row 1 puts weight e/(1+e) on token 1."""
    one = np.ones((1, 1, 1))
    p = attnref.AttentionParams(one, one, one, one)
    y = oracle.attention(p, np.array([[0.0], [1.0]]))
    # exp (C_EXP ulps), a two-term sum and a division, on each side: 2 gamma_{3 + 2 C_EXP}(u).
    rtol = 2 * tolerance.gamma(3 + 2 * tolerance.C_EXP, 2.0**-53)
    np.testing.assert_allclose(y[:, 0], [0.5, math.e / (1 + math.e)], rtol=rtol)
    w = oracle.attention_weights(p, np.array([[0.0], [1.0]]), scale=2.0)
    np.testing.assert_allclose(
        w[0, 1], [1 / (1 + math.e**2), math.e**2 / (1 + math.e**2)], rtol=rtol
    )


@given(seed=st.integers(0, 10_000))
def test_weights_are_row_stochastic_or_zero(seed):
    rng = np.random.default_rng(seed)
    p = attnref.init_params(seed, d_model=4, num_heads=2, d_k=3, d_v=2, bias=True, dtype=np.float64)
    mask = rng.random((3, 5)) < 0.5
    w = oracle.attention_weights(
        p, rng.standard_normal((3, 4)), rng.standard_normal((5, 4)), mask=mask
    )
    sums = w.sum(-1)
    live = mask.any(-1)
    # Each weight carries relative error <= gamma_{T_k + 2 + 2 C_EXP}; the sum of 5 adds gamma_5.
    atol = tolerance.gamma(5 + 5 + 2 + 2 * tolerance.C_EXP, 2.0**-53)
    np.testing.assert_allclose(sums[:, live], 1.0, rtol=0, atol=atol)
    np.testing.assert_array_equal(sums[:, ~live], 0.0)
    assert np.all(w[:, ~mask] == 0.0)


def test_emulated_precision_is_identity_for_float64_and_rounds_otherwise():
    p = attnref.init_params(0, d_model=4, num_heads=2, d_k=2, bias=True, dtype=np.float64)
    x = np.random.default_rng(0).standard_normal((3, 4))
    np.testing.assert_array_equal(
        oracle.attention(p, x, emulate=np.float64), oracle.attention(p, x)
    )
    y16 = oracle.attention(p, x, emulate=np.float16)
    np.testing.assert_array_equal(y16, y16.astype(np.float16).astype(np.float64))
    assert not np.array_equal(y16, oracle.attention(p, x))
