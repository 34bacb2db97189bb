"""FAVOR+ statistics (Choromanski et al. 2021) with fixed seeds and stated confidence levels.

Every threshold is computed from the measured Monte-Carlo spread (a standard error), never a
tuned constant: a test fails only when the observed effect is further from the claim than
chance allows at the stated level. Seeds are fixed, so the outcome is deterministic.
"""

from __future__ import annotations

from statistics import NormalDist

import jax
import numpy as np

import attnref
from attnref import tolerance

Z = NormalDist().inv_cdf


def _estimates(qs: np.ndarray, ks: np.ndarray, omega: np.ndarray) -> np.ndarray:
    """phi(q).phi(k) written out from the FAVOR+ definition (no stabilisation)."""
    expo = (
        (qs + ks) @ omega.T
        - 0.5 * np.sum(qs * qs, -1, keepdims=True)
        - 0.5 * np.sum(ks * ks, -1, keepdims=True)
    )
    return np.mean(np.exp(expo), axis=-1)


def _pairs(seed: int, n: int, d: int, norm: float) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    q, k = (rng.standard_normal((n, d)) * norm / np.sqrt(d) for _ in range(2))
    return q / d**0.25, k / d**0.25  # x~ = x / d^(1/4): kernel exp(q.k / sqrt(d))


def test_library_kernel_and_stabilised_features_match_the_definition():
    d, m = 4, 8
    qs, ks = _pairs(0, 5, d, 1.0)
    for orthogonal in (False, True):
        fm = attnref.linear.favor_plus(7, d, m, orthogonal=orthogonal)
        q, k = qs * d**0.25, ks * d**0.25
        direct = _estimates(qs, ks, np.asarray(fm.omega))
        # Same formula, two evaluation orders, float64: each exponent (magnitude <= mag) is
        # within gamma_{d+6} mag, each exp within C_EXP ulps, the mean of m terms gamma_m; four
        # such evaluations enter the checks below (two kernels, a ratio, exp(-c_q)).
        w_abs = np.abs(np.asarray(fm.omega))
        mag = float(
            np.max(np.abs(qs) @ w_abs.T + np.abs(ks) @ w_abs.T + 0.5 * np.sum(w_abs**2, -1))
            + np.max(np.sum(qs**2, -1))
            + np.max(np.sum(ks**2, -1))
        )
        u = 2.0**-53
        rtol = 4 * (
            np.expm1(tolerance.gamma(d + 6, u) * mag) + tolerance.gamma(m + 2 * tolerance.C_EXP, u)
        )
        np.testing.assert_allclose(np.asarray(fm.kernel(q, k)), direct, rtol=rtol)
        # Stabilised features: phi~(q).phi~(k) = exp(-c_q) phi(q).phi(k), c_q per query only.
        stab = np.sum(np.asarray(fm(q, "query")) * np.asarray(fm(k, "key")), -1)
        ratio = stab / direct
        w = np.asarray(fm.omega)
        c_q = np.max(qs @ w.T + 0.5 * np.sum(w * w, -1), -1) - 0.5 * np.sum(qs * qs, -1)
        np.testing.assert_allclose(ratio, np.exp(-c_q), rtol=rtol)
        # The factor the linear forms rescale eps by (issue 11): query_features returns c_q, the
        # same exponent evaluated in another order (one of the evaluations counted in rtol).
        phi_q, c_lib = fm.query_features(q)
        np.testing.assert_allclose(np.exp(-np.asarray(c_lib)), np.exp(-c_q), rtol=rtol)
        np.testing.assert_array_equal(np.asarray(phi_q), np.asarray(fm(q, "query")))


def test_estimator_is_unbiased():
    """E[phi(q).phi(k)] = exp(q.k / sqrt(d)): for each of 8 pairs the mean over R = 4000 seeds is
    within z * sd / sqrt(R) of the exact kernel, z for 99.9% two-sided with a Bonferroni
    correction over the 8 pairs and both samplers (16 tests)."""
    d, m, r = 4, 4, 4000
    qs, ks = _pairs(1, 8, d, 1.5)
    exact = np.exp(np.sum(qs * ks, -1))
    z = Z(1 - 0.001 / (2 * 16))
    for orthogonal in (False, True):
        est = np.stack(
            [
                _estimates(
                    qs,
                    ks,
                    np.asarray(attnref.linear.favor_plus(s, d, m, orthogonal=orthogonal).omega),
                )
                for s in range(r)
            ]
        )
        mean, se = est.mean(0), est.std(0, ddof=1) / np.sqrt(r)
        t = np.abs(mean - exact) / se
        assert np.all(t <= z), f"orthogonal={orthogonal}: |t| = {t.max():.2f} > {z:.2f}"


def test_orthogonal_features_have_lower_error_than_iid():
    """MSE of the kernel estimate over 16 pairs, R = 2000 seeds each sampler, m = d = 16: the
    i.i.d. minus orthogonal difference exceeds z * se with z for 99.9% one-sided."""
    d, m, r = 16, 16, 2000
    qs, ks = _pairs(123, 16, d, 1.0)
    exact = np.exp(np.sum(qs * ks, -1))

    def mse(orthogonal: bool) -> np.ndarray:
        return np.array(
            [
                np.mean(
                    (
                        _estimates(
                            qs,
                            ks,
                            np.asarray(
                                attnref.linear.favor_plus(s, d, m, orthogonal=orthogonal).omega
                            ),
                        )
                        - exact
                    )
                    ** 2
                )
                for s in range(r)
            ]
        )

    iid, orth = mse(False), mse(True)
    diff = iid.mean() - orth.mean()
    se = np.sqrt(iid.var(ddof=1) / r + orth.var(ddof=1) / r)
    assert diff > Z(0.999) * se, (
        f"iid {iid.mean():.4g} vs orthogonal {orth.mean():.4g}, se {se:.2g}"
    )


def test_attention_error_falls_like_one_over_sqrt_m():
    """RMS error of FAVOR+ attention against exact softmax attention ~ m^(-1/2): the weighted
    least-squares slope of log MSE on log m (m = 16 ... 1024, 40 seeds each, weights from the
    delta-method standard error of each log MSE) is within z * se of -1, z for 99.9%.

    The law is asymptotic: it holds once m exceeds the estimator's relative variance,
    ``Var[phi_i(q) phi_i(k)] / exp(q.k/sqrt(d))^2 ~ exp(|q~ + k~|^2)``. With |q~| ~ 0.5 here that
    is m >~ 10. (At |q~| ~ 1.2, m * MSE still grows up to m = 2048: the output is a convex
    combination of values, so small-m errors saturate and the fitted slope flattens to ~-0.75.)"""
    d, t, d_v, r = 8, 8, 4, 40
    rng = np.random.default_rng(5)
    q, k = (rng.standard_normal((t, 1, d)) * 0.3 for _ in range(2))
    v = rng.standard_normal((t, 1, d_v))
    logits = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(d)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    exact = np.einsum("hqk,khv->qhv", p / p.sum(-1, keepdims=True), v)
    attend = jax.jit(attnref.linear.linear_associative)
    ms = np.array([16, 64, 256, 1024])
    log_mse, se_log = [], []
    for m in ms:
        errs = np.array(
            [
                np.mean(
                    (
                        np.asarray(
                            attend(
                                q,
                                k,
                                v,
                                feature_map=attnref.linear.favor_plus(1000 * int(m) + s, d, int(m)),
                            )
                        )
                        - exact
                    )
                    ** 2
                )
                for s in range(r)
            ]
        )
        log_mse.append(np.log(errs.mean()))
        se_log.append(errs.std(ddof=1) / np.sqrt(r) / errs.mean())
    x, y, w = np.log(ms), np.array(log_mse), 1 / np.array(se_log) ** 2
    xm = np.sum(w * x) / w.sum()
    slope = np.sum(w * (x - xm) * (y - np.sum(w * y) / w.sum())) / np.sum(w * (x - xm) ** 2)
    se_slope = 1 / np.sqrt(np.sum(w * (x - xm) ** 2))
    z = Z(1 - 0.001 / 2)
    assert abs(slope + 1) <= z * se_slope, f"slope {slope:.3f} +- {se_slope:.3f}, expected -1"
    assert slope + z * se_slope < -0.5  # and the decay is real, not a flat line with a wide CI
