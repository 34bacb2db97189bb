"""Composition scores (Elhage et al. 2021) and alignment with embedding tables.

The scores are computed from the thin factors; here they are compared with the definition on the
formed ``d_model x d_model`` matrices (row convention: ``Q: ||W_M1 W_P2||``, ``K: ||W_P2
W_M1^T||``, ``V: ||W_M1 W_M2||``, each over the product of the two Frobenius norms), in float64.
Both are sums of products of the same factors, so they agree to ``gamma_N`` times the same sums
of absolute values (Higham 2002, eq. 3.13); ``N = 2 (d_model + d)`` covers the longest chain.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import attnref
from attnref import tolerance
from attnref.interp import composition_baseline, composition_scores, top_aligned

U64 = tolerance.unit_roundoff(np.float64)
SHAPES = st.sampled_from([(8, 2, 2, 3, 2, 1), (6, 3, 4, 2, 2, 2), (8, 2, 2, 4, 4, 2)])


def _abs_product(*factors):
    """``|F_1| |F_2| ...`` per head pair: the magnitudes the rounding errors scale with."""
    out = np.abs(factors[0])
    for f in factors[1:]:
        out = np.einsum("...ab,...bc->...ac", out, np.abs(f))
    return out


def formed(first, second, kind):
    """The definition on formed matrices, and a rounding allowance for comparing with the
    factored computation: with ``A = |F_1|...|F_4|`` (absolute values of the four factors of a
    product ``P``) both methods compute ``||P||_F^2`` within ``gamma_N ||A||_F^2`` (every term of
    either sum is a product of entries of the factors, Higham eq. 3.13), so ``||P||_F`` within
    ``gamma_N ||A||_F^2 / (2 ||P||_F) + gamma_N ||A||_F``; the score's allowance adds the
    numerator's and ``score`` times the denominator's, over the denominator."""
    a = attnref.interop.repeat_kv_heads(first)
    b = attnref.interop.repeat_kv_heads(second)
    v1, o1 = a.w_v[:, None], a.w_o[:, None]  # [H1, 1, ...]
    q2, k2, v2, o2 = (w[None] for w in (b.w_q, b.w_k, b.w_v, b.w_o))  # [1, H2, ...]
    tr = lambda w: np.swapaxes(w, -1, -2)  # noqa: E731
    chains = {
        "q": (v1, o1, q2, tr(k2)),
        "k": (q2, tr(k2), tr(o1), tr(v1)),
        "v": (v1, o1, v2, o2),
    }
    p = chains[kind]
    prod = np.einsum("...ab,...bc,...cd,...de->...ae", *p)
    num = np.linalg.norm(prod, axis=(-2, -1))
    first_pair = (v1, o1)
    second_pair = (v2, o2) if kind == "v" else (q2, tr(k2))
    norms = []
    for f, g in (first_pair, second_pair):
        m = np.einsum("...ab,...bc->...ac", f, g)
        norms.append(
            (np.linalg.norm(m, axis=(-2, -1)), np.linalg.norm(_abs_product(f, g), axis=(-2, -1)))
        )
    den = norms[0][0] * norms[1][0]
    n = 2 * (first.d_model + first.d_v + second.d_k + second.d_v) + 4
    g = tolerance.gamma(n, U64)

    def allowance(value, abs_norm):
        return g * abs_norm**2 / (2 * np.maximum(value, 1e-300)) + g * abs_norm

    d_num = allowance(num, np.linalg.norm(_abs_product(*p), axis=(-2, -1)))
    d_den = norms[1][0] * allowance(*norms[0]) + norms[0][0] * allowance(*norms[1])
    score = num / den
    return score, (d_num + score * d_den) / den * 2


def test_orthogonal_subspaces_do_not_compose():
    """If ``W_O1``'s rows are orthogonal to the columns of ``W_Q2`` (resp. ``W_K2``, ``W_V2``),
    the Q- (K-, V-) composition is exactly zero; a head reading exactly what another writes
    scores high."""
    rng = np.random.default_rng(0)
    d, dk = 8, 2
    first = attnref.init_params(0, d_model=d, num_heads=1, d_k=dk, dtype=np.float64)
    basis, _ = np.linalg.qr(first.w_o[0].T)  # [d, dk]: the written subspace
    proj = np.eye(d) - basis @ basis.T

    def second_with(**repl):
        base = attnref.init_params(1, d_model=d, num_heads=1, d_k=dk, dtype=np.float64)
        return attnref.AttentionParams(**{**base.__dict__, **repl})

    s_q = second_with(w_q=(proj @ rng.standard_normal((d, dk)))[None])
    s_k = second_with(w_k=(proj @ rng.standard_normal((d, dk)))[None])
    s_v = second_with(w_v=(proj @ rng.standard_normal((d, dk)))[None])
    # Exactly zero in exact arithmetic; in float64 the projector is orthogonal to the written
    # subspace up to QR's O(d d_k u) (Higham Thm 19.4), and the normalised score's products add
    # gamma_{3 d}: a relative residue of at most gamma_{4 d d_k + 3 d}(u64).
    residue = tolerance.gamma(4 * d * dk + 3 * d, U64)
    for params, kind in ((s_q, "q"), (s_k, "k"), (s_v, "v")):
        assert float(composition_scores(first, params, kind)[0, 0]) <= residue, kind
    reads = second_with(w_q=basis[None], w_v=basis[None])
    assert float(composition_scores(first, reads, "q")[0, 0]) > 0.5
    assert float(composition_scores(first, reads, "v")[0, 0]) > 0.5


def test_baseline_is_between_zero_and_one():
    a = attnref.init_params(0, d_model=16, num_heads=2, d_k=2)
    b = attnref.init_params(1, d_model=16, num_heads=2, d_k=2)
    for kind in "qkv":
        base = composition_baseline(a, b, kind, seeds=3)
        assert 0.0 < base < 1.0


@pytest.mark.usefixtures("unchecked_annotations")  # checks attnref's own errors
def test_bad_kind_and_shapes():
    a = attnref.init_params(0, d_model=8, num_heads=2, d_k=2)
    with pytest.raises(ValueError, match="kind"):
        composition_scores(a, a, "o")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="d_model"):
        composition_scores(a, attnref.init_params(0, d_model=6, num_heads=2, d_k=2), "q")


@given(
    seed=st.integers(0, 2**31 - 1), k=st.integers(1, 5), metric=st.sampled_from(["cosine", "dot"])
)
def test_top_aligned_matches_numpy(seed, k, metric):
    rng = np.random.default_rng(seed)
    table = rng.standard_normal((11, 6))
    table[3] = 0.0  # a zero row scores 0 under cosine
    vecs = rng.standard_normal((2, 3, 6))
    vals, idx = top_aligned(vecs, table, k, metric=metric)
    sims = vecs @ table.T
    if metric == "cosine":
        norms = np.linalg.norm(vecs, axis=-1, keepdims=True) * np.linalg.norm(table, axis=-1)
        sims = np.where(norms > 0, sims / np.where(norms > 0, norms, 1), 0)
    ref_vals = -np.sort(-sims, axis=-1)[..., :k]
    # Dot products of length d = 6 (and, for cosine, two norms and a division) in two orders:
    # gamma_{d + 4} times the magnitude |v| |t| (cosine: times 1 / (|v| |t|)), on each side.
    mag = (
        1.0
        if metric == "cosine"
        else float(np.max(np.linalg.norm(vecs, axis=-1)) * np.max(np.linalg.norm(table, axis=-1)))
    )
    atol = 2 * tolerance.gamma(6 + 4, U64) * mag
    np.testing.assert_allclose(np.asarray(vals), ref_vals, rtol=0, atol=atol)
    np.testing.assert_allclose(np.take_along_axis(sims, np.asarray(idx), -1), ref_vals, atol=atol)
    jitted = jax.jit(top_aligned, static_argnames=("k", "metric"))(vecs, table, k=k, metric=metric)
    np.testing.assert_allclose(np.asarray(jitted[0]), ref_vals, rtol=0, atol=atol)


@pytest.mark.usefixtures("unchecked_annotations")  # checks attnref's own errors
def test_top_aligned_errors():
    with pytest.raises(ValueError, match="metric"):
        top_aligned(np.ones(3), np.eye(3), 1, metric="l2")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="k=4"):
        top_aligned(np.ones(3), np.eye(3), 4)
    with pytest.raises(ValueError, match="table"):
        top_aligned(np.ones(3), np.eye(4), 1)
