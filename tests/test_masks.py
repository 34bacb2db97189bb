"""Mask builders and the shared safe softmax."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import attnref
from attnref import tolerance


def test_causal_mask_is_top_left_aligned():
    m = np.asarray(attnref.causal_mask(3, 5))
    expected = np.array([[j <= i for j in range(5)] for i in range(3)])
    np.testing.assert_array_equal(m, expected)
    np.testing.assert_array_equal(
        np.asarray(attnref.causal_mask(4)), np.tril(np.ones((4, 4), bool))
    )


@pytest.mark.usefixtures("unchecked_annotations")  # checks attnref's own errors
def test_padding_mask_and_combination():
    pad = np.asarray(attnref.padding_mask(np.array([2, 0, 4]), 4))
    assert pad.shape == (3, 1, 4)
    np.testing.assert_array_equal(pad[:, 0], [[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    both = np.asarray(attnref.combine_masks(attnref.causal_mask(4), pad, None))
    assert both.shape == (3, 4, 4)
    np.testing.assert_array_equal(both[0], np.tril(np.ones((4, 4), bool)) & (np.arange(4) < 2))
    assert attnref.combine_masks(None, None) is None
    with pytest.raises(TypeError, match="boolean"):
        attnref.combine_masks(np.ones((2, 2)))
    with pytest.raises(ValueError, match=r"lengths must have shape \[B\]"):
        attnref.padding_mask(np.array([[1]]), 3)


@given(seed=st.integers(0, 10_000))
def test_masked_softmax_matches_definition(seed):
    rng = np.random.default_rng(seed)
    s = rng.standard_normal((3, 5)) * 10
    m = rng.random((3, 5)) < 0.6
    m[1] = False
    p = np.asarray(attnref.masked_softmax(jnp.asarray(s), jnp.asarray(m)))
    for i in range(3):
        if not m[i].any():
            np.testing.assert_array_equal(p[i], 0.0)
            continue
        e = np.where(m[i], np.exp(s[i] - s[i][m[i]].max()), 0.0)
        # Both sides evaluate the same formula in float64: exp (C_EXP ulps), a sum of 5 terms
        # and a division each, so they differ by at most 2 gamma_{5 + 2 + 2 C_EXP}(u) relative.
        u = 2.0**-53
        rtol = 2 * tolerance.gamma(5 + 2 + 2 * tolerance.C_EXP, u)
        np.testing.assert_allclose(p[i], e / e.sum(), rtol=rtol, atol=0)
    col = np.asarray(attnref.masked_softmax(jnp.asarray(s.T), jnp.asarray(m.T), axis=-2))
    np.testing.assert_array_equal(col, p.T)


def test_masked_softmax_never_nan_for_extreme_masked_logits():
    s = jnp.array([[1e30, 0.0, -jnp.inf], [jnp.inf, 1.0, 2.0]])
    m = jnp.array([[False, True, True], [False, True, True]])
    p = attnref.masked_softmax(s, m)
    g = jax.grad(lambda s: jnp.sum(attnref.masked_softmax(s, m) * jnp.arange(3.0)))(s)
    assert np.all(np.isfinite(np.asarray(p))) and np.all(np.isfinite(np.asarray(g)))
    np.testing.assert_allclose(np.asarray(p[1]), [0, 1 / (1 + np.e), np.e / (1 + np.e)])


def test_mask_to_bias_is_equivalent():
    m = np.tril(np.ones((3, 3), bool))
    b = np.asarray(attnref.mask_to_bias(m, jnp.float64))
    np.testing.assert_array_equal(b, np.where(m, 0.0, -np.inf))
