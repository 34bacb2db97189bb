"""The 1/sqrt(d_k) scaling law, with fixed seeds and stated confidence levels.

Seed: "[Concept] The Attention Mechanism of Transformer Models" (2025-08-22) derives
Var(q.k) = d for q, k with i.i.d. standard normal entries and motivates the 1/sqrt(d) scale by
softmax saturation. Intervals use the variance estimator's standard error from the sample fourth
moment (asymptotically normal; q.k is not Gaussian, so a plain chi-square interval would be too
narrow), with a Bonferroni correction over the tests in each function.
"""

from __future__ import annotations

import itertools
import math
from statistics import NormalDist

import numpy as np

import attnref
from attnref import oracle, tolerance
from attnref import strategies as ast
from attnref.testing import assert_within_bound

Z = NormalDist().inv_cdf
DIMS = (4, 16, 64, 256)


def _variance_interval(x: np.ndarray, z: float) -> tuple[float, float]:
    """Sample variance and its half-width ``z * sqrt((m4 - s^4) / n)``."""
    n = x.size
    c = x - x.mean()
    s2 = float(np.mean(c**2)) * n / (n - 1)
    m4 = float(np.mean(c**4))
    return s2, z * math.sqrt(max(m4 - s2**2, 0.0) / n)


def test_dot_product_variance_is_d_k_and_scaled_logits_have_variance_one():
    rng = np.random.default_rng(2025)
    n = 20_000
    z = Z(1 - 0.001 / (2 * 2 * len(DIMS)))  # 99.9% two-sided, Bonferroni over 8 intervals
    for d in DIMS:
        q, k = rng.standard_normal((n, d)), rng.standard_normal((n, d))
        dots = np.sum(q * k, axis=-1)
        s2, half = _variance_interval(dots, z)
        assert abs(s2 - d) <= half, f"d_k={d}: Var(q.k) = {s2:.3f} +- {half:.3f}"
        s2, half = _variance_interval(dots / math.sqrt(d), z)
        assert abs(s2 - 1.0) <= half, f"d_k={d}: Var(q.k/sqrt(d_k)) = {s2:.4f} +- {half:.4f}"


def _softmax_stats(logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    entropy = -np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0), axis=-1)
    return p.max(-1), entropy


def test_unscaled_softmax_saturates_and_scaled_entropy_stays_bounded():
    """One query against T = 16 keys, 4000 trials per d_k. Unscaled: mean max weight rises and
    mean entropy falls with d_k, each step significant at 99.9% one-sided. Scaled: the entropy
    converges to that of i.i.d. N(0, 1) logits, independent of d_k (two-sided 99.9% at the
    largest d_k against a Monte-Carlo estimate of the limit)."""
    rng = np.random.default_rng(7)
    t, n = 16, 4000
    z1 = Z(1 - 0.001 / (2 * (len(DIMS) - 1)))  # one-sided steps, Bonferroni over both chains
    results = {}
    for d in DIMS:
        q = rng.standard_normal((n, 1, d))
        k = rng.standard_normal((n, t, d))
        dots = np.sum(q * k, axis=-1)
        results[d] = (_softmax_stats(dots), _softmax_stats(dots / math.sqrt(d)))
    for lo, hi in itertools.pairwise(DIMS):
        (max_lo, ent_lo), _ = results[lo]
        (max_hi, ent_hi), _ = results[hi]
        se = math.sqrt(max_lo.var() / n + max_hi.var() / n)
        assert max_hi.mean() - max_lo.mean() > z1 * se, f"max weight did not rise {lo}->{hi}"
        se = math.sqrt(ent_lo.var() / n + ent_hi.var() / n)
        assert ent_lo.mean() - ent_hi.mean() > z1 * se, f"entropy did not fall {lo}->{hi}"
    (_, ent_top), (_, ent_scaled) = results[DIMS[-1]]
    se = math.sqrt(ent_top.var() / n + ent_scaled.var() / n)
    assert ent_scaled.mean() - ent_top.mean() > Z(0.999) * se  # scaling prevents saturation
    _, limit = _softmax_stats(rng.standard_normal((20 * n, t)))
    se = math.sqrt(ent_scaled.var() / n + limit.var() / (20 * n))
    assert abs(ent_scaled.mean() - limit.mean()) <= Z(1 - 0.001 / 2) * se


def test_pattern_form_uses_one_over_sqrt_d_k_not_d_model():
    """P_i = X W_P lives in d_model space, but the logits P_i X^T are the same numbers as
    Q_i K_i^T, so the scale stays 1/sqrt(d_k). Scaling by 1/sqrt(d_model) instead is a different
    function, and the difference is far outside the derived bound."""
    bucket = ast.Config(batch=(2,), t=6, s=6, n=2, k=2, h=4, h_v=4, d_model=16)  # d_model = 4 d_k
    p = ast.make_attention_problem(bucket, "causal", 3, np.float64)
    ref = oracle.attention(p.params, p.x_q, p.x_kv, **p.inputs())
    bound = tolerance.attention_error_bound(p.params, p.x_q, p.x_kv, dtype=np.float64, **p.inputs())
    y = np.asarray(attnref.patterns_messages_attention(p.params, p.x_q, p.x_kv, **p.inputs()))
    assert_within_bound(y, ref, bound)
    wrong = oracle.attention(
        p.params, p.x_q, p.x_kv, scale=1 / math.sqrt(bucket.d_model), **p.inputs()
    )
    assert np.max(np.abs(wrong - y) / bound) > 1e6
