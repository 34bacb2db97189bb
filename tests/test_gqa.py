"""Grouped-query and multi-query attention (Ainslie et al. 2023; Shazeer 2019).

``H`` query heads share ``K`` key/value heads, ``H % K == 0``; query head ``i`` reads key/value
head ``i // G`` with ``G = H / K`` (the grouping of ``jax.nn.dot_product_attention``, PyTorch and
Flax). Properties:

* every registered formulation (softmax and linear), jit and no-jit, equals the float64 oracle on
  grouped params within the derived bound (:mod:`attnref.tolerance`);
* ``repeat_kv_heads`` is exact: the oracle gives bit-identical results on grouped and repeated
  params, and every formulation agrees on the two within its bound;
* merged matrices are per query head: ``W_P[i] = W_Q[i] W_K[i // G]^T``,
  ``W_M[i] = W_V[i // G] W_O[i]``;
* weight sharing in the gradient: the gradient with respect to a shared key/value head is the
  sum over its group of the gradients with respect to the repeated (multi-head) params
  (FlashAttention's comparative rule, as in ``tests/test_gradients.py``);
* malformed groupings and layouts without GQA raise clear errors.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, note
from hypothesis import strategies as st

import attnref
from attnref import oracle, tolerance
from attnref import strategies as ast
from attnref.interop import repeat_kv_heads
from attnref.testing import assert_comparative, assert_within_bound

from .helpers import check_formulation, expected, scaled

SOFTMAX = attnref.formulations("softmax")
LINEAR = attnref.formulations("linear")

# (shape bucket with H = 4 query heads, K key/value heads, dtype): grouped-query attention with
# batch dims and cross-attention (T_q != T_k, d_k != d_v) in float32, and multi-query
# self-attention without batch dims in float64. Few fixed shapes, so jit caches are reused.
GQA_CASES = (
    (ast.Config(batch=(2,), t=5, s=7, n=4, k=4, h=4, h_v=3, d_model=8), 2, "float32"),
    (ast.Config(batch=(), t=4, s=4, n=4, k=4, h=2, h_v=5, d_model=6), 1, "float64"),
)
CASE_IDS = ("gqa-float32", "mqa-float64")


def gqa_problem(
    bucket: ast.Config, num_kv_heads: int, kind: str, seed: int, dtype, *, with_bias: bool = True
) -> ast.AttentionProblem:
    """:func:`attnref.strategies.make_attention_problem` with ``num_kv_heads`` K/V heads (the
    inputs and masks do not depend on them)."""
    config = dataclasses.replace(bucket, k=num_kv_heads)
    return ast.make_attention_problem(config, kind, seed, dtype, param_bias=with_bias)


@st.composite
def gqa_problems(draw, cases=GQA_CASES):
    bucket, kv, dtype = draw(st.sampled_from(cases), label="bucket, num_kv_heads, dtype")
    kind = draw(ast.mask_kinds(kinds=ast.WEIGHT_KINDS), label="mask kind")
    seed = draw(st.integers(0, 2**31 - 1), label="data seed")
    note(f"bucket={bucket} K={kv} dtype={dtype} kind={kind} seed={seed}")
    return gqa_problem(bucket, kv, kind, seed, dtype)


def _mha_problem(p: ast.AttentionProblem) -> ast.AttentionProblem:
    return dataclasses.replace(p, params=repeat_kv_heads(p.params))


# ----------------------------------------------------------------------------- softmax family


class SoftmaxGQATest(chex.TestCase):
    @chex.variants(with_jit=True)
    @scaled(0.4)
    @given(problem=gqa_problems())
    def test_every_formulation_matches_oracle(self, problem):
        assert problem.params.num_kv_heads < problem.params.num_heads
        for f in SOFTMAX:
            check_formulation(self.variant(f.apply), problem, f.id)

    @chex.variants(without_jit=True)
    @scaled(0.1)
    @given(problem=gqa_problems(cases=GQA_CASES[1:]))
    def test_every_formulation_matches_oracle_eagerly(self, problem):
        """Without jit on the multi-query case (eager execution compiles every primitive per
        shape, so one case only, the one without batch dims). The two looped kernel forms
        (blockwise, kv_cache) run GQA natively in the kernel, whose eager GQA path is checked in
        tests/test_kernel.py and tests/test_blockwise.py; here they would only re-compile it."""
        for f in SOFTMAX:
            if f.id not in ("blockwise", "kv_cache"):
                check_formulation(self.variant(f.apply), problem, f.id)


@pytest.mark.parametrize("case", GQA_CASES, ids=CASE_IDS)
def test_repeat_kv_heads_is_exact_and_equivalent(case):
    """The oracle and the bound are bit-identical on grouped and repeated params; on the
    grouped-query case every formulation is within its bound of the oracle on both (so the two
    differ by at most twice the bound)."""
    bucket, kv, dtype = case
    p = gqa_problem(bucket, kv, "combined", seed=17, dtype=dtype)
    mha = _mha_problem(p)
    args = (p.x_q, p.x_kv)
    np.testing.assert_array_equal(
        oracle.attention(p.params, *args, **p.inputs()),
        oracle.attention(mha.params, *args, **p.inputs()),
    )
    np.testing.assert_array_equal(
        oracle.head_outputs(p.params, *args, **p.inputs()),
        oracle.head_outputs(mha.params, *args, **p.inputs()),
    )
    _, bound = expected(p)
    np.testing.assert_array_equal(bound, expected(mha)[1])
    if kv == 1:
        return  # formulations on the MQA case: SoftmaxGQATest; saves compiling its MHA twin
    for f in SOFTMAX:
        y_gqa = check_formulation(f.jit(), p, f"{f.id} K={kv}")
        y_mha = check_formulation(f.jit(), mha, f"{f.id} repeated")
        assert_within_bound(y_gqa, y_mha, 2 * bound, label=f"{f.id} grouped vs repeated")


def test_repeat_kv_heads_structure():
    """Entry ``i`` of the repeated K/V arrays is K/V head ``i // G`` exactly; query-side arrays
    pass through as the same objects; NumPy stays NumPy; multi-head params come back unchanged;
    it traces under jit."""
    p = attnref.init_params(2, d_model=6, num_heads=6, d_k=2, d_v=3, bias=True, num_kv_heads=2)
    assert (p.num_heads, p.num_kv_heads, p.group_size) == (6, 2, 3)
    r = repeat_kv_heads(p)
    assert (r.num_heads, r.num_kv_heads, r.group_size) == (6, 6, 1)
    for name in ("w_q", "w_o", "b_q", "b_o"):
        assert getattr(r, name) is getattr(p, name), name
    for name in ("w_k", "w_v", "b_k", "b_v"):
        rep, src = getattr(r, name), getattr(p, name)
        assert isinstance(rep, np.ndarray) and rep.dtype == src.dtype, name
        for i in range(6):
            np.testing.assert_array_equal(rep[i], src[i // 3], err_msg=f"{name}[{i}]")
    assert repeat_kv_heads(r) is r
    no_bias = attnref.AttentionParams(p.w_q, p.w_k, p.w_v, p.w_o)
    assert repeat_kv_heads(no_bias).b_k is None
    traced = jax.jit(repeat_kv_heads)(p)
    for name in ("w_k", "w_v", "b_k", "b_v"):
        np.testing.assert_array_equal(getattr(traced, name), getattr(r, name), err_msg=name)


def test_init_params_default_draws_are_unchanged():
    """``num_kv_heads=None`` and ``num_kv_heads=H`` draw exactly the multi-head params."""
    kw = dict(d_model=6, num_heads=4, d_k=2, d_v=3, bias=True)
    a = attnref.init_params(5, **kw)
    b = attnref.init_params(5, **kw, num_kv_heads=4)
    for name in ("w_q", "w_k", "w_v", "w_o", "b_q", "b_k", "b_v", "b_o"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
    m = attnref.init_params(5, **kw, num_kv_heads=1)
    assert m.w_k.shape == (1, 6, 2) and m.w_v.shape == (1, 6, 3)
    assert m.b_k.shape == (1, 2) and m.b_v.shape == (1, 3)
    assert m.w_o.shape == (4, 3, 6) and (m.num_kv_heads, m.group_size) == (1, 4)


# ----------------------------------------------------------------------------- merged matrices


@scaled(0.3)
@given(
    shape=st.sampled_from([(8, 4, 2, 4, 3), (6, 4, 1, 2, 5), (6, 6, 3, 3, 3)]),
    seed=st.integers(0, 1000),
)
def test_merged_matrices_are_per_query_head(shape, seed):
    """``W_P[i] = W_Q[i] W_K[i // G]^T``, ``W_M[i] = W_V[i // G] W_O[i]`` (explicit loops),
    ``W_A = W_P^T``, ``W_I = W_M^T``: query heads of a group share W_V, not W_M."""
    d_model, h, kv, d_k, d_v = shape
    p = attnref.init_params(
        seed, d_model=d_model, num_heads=h, d_k=d_k, d_v=d_v, dtype=np.float64, num_kv_heads=kv
    )
    g = h // kv
    wp, wm = np.asarray(attnref.interp.w_p(p)), np.asarray(attnref.interp.w_m(p))
    wa, wi = np.asarray(attnref.interp.w_a(p)), np.asarray(attnref.interp.w_i(p))
    assert wp.shape == wm.shape == wa.shape == wi.shape == (h, d_model, d_model)
    u = tolerance.unit_roundoff(np.float64)
    for i in range(h):
        wk, wv = p.w_k[i // g], p.w_v[i // g]
        # |fl(A B) - A B| <= gamma_n |A||B| for each of the two computations being compared.
        tol_p = 2 * tolerance.gamma(d_k, u) * np.abs(p.w_q[i]) @ np.abs(wk).T
        tol_m = 2 * tolerance.gamma(d_v, u) * np.abs(wv) @ np.abs(p.w_o[i])
        assert_within_bound(wp[i], p.w_q[i] @ wk.T, tol_p, label=f"W_P[{i}]")
        assert_within_bound(wm[i], wv @ p.w_o[i], tol_m, label=f"W_M[{i}]")
        assert_within_bound(wa[i], (p.w_q[i] @ wk.T).T, tol_p.T, label=f"W_A[{i}]")
        assert_within_bound(wi[i], (wv @ p.w_o[i]).T, tol_m.T, label=f"W_I[{i}]")
    if g > 1:  # distinct W_O per query head: a group's message matrices differ
        assert not np.array_equal(wm[0], wm[1])


# ----------------------------------------------------------------------------- linear family

LINEAR_BUCKET = GQA_CASES[0][0]  # batch dims; causal cases use x_kv = x_q (T_q == T_k)
# (K, dtype, causal) under jit: each linear formulation runs in one of its causal modes with
# K = 2 or K = 1 (the eager test runs K = 2 in both modes).
LINEAR_JIT_CASES = ((2, "float32", False), (1, "float64", True), (2, "float32", True))


def _linear_case(kv, dtype, causal, seed, map_name="elu_plus_one"):
    """Problem, x_kv and keyword arguments; ``key_mask`` pads every batch row differently."""
    p = gqa_problem(LINEAR_BUCKET, kv, "none", seed, dtype)
    x_kv = p.x_q if causal else p.x_kv
    rng = np.random.default_rng(seed)
    t_k = x_kv.shape[-2]
    key_mask = np.arange(t_k) < rng.integers(1, t_k + 1, LINEAR_BUCKET.batch)[..., None]
    fm = (
        attnref.linear.favor_plus(seed, LINEAR_BUCKET.d_k, 2 * LINEAR_BUCKET.d_k)
        if map_name == "favor_plus"
        else attnref.linear.FeatureMap(map_name)
    )
    return p, x_kv, dict(feature_map=fm, causal=causal, key_mask=key_mask)


def _check_linear(p, x_kv, kw, variant, skip=()):
    ref = oracle.linear_multihead(p.params, p.x_q, x_kv, **kw)
    np.testing.assert_array_equal(  # the oracle is exact under repeat_kv_heads
        ref, oracle.linear_multihead(repeat_kv_heads(p.params), p.x_q, x_kv, **kw)
    )
    bound = tolerance.linear_multihead_error_bound(p.params, p.x_q, x_kv, dtype=p.dtype, **kw)
    ran = 0
    for f in LINEAR:
        if kw["causal"] not in f.causal_modes or f.id in skip:
            continue
        fn = variant(f.apply, static_argnames=f.static_argnames)
        y = np.asarray(fn(p.params, p.x_q, x_kv, **kw))
        assert y.dtype == p.dtype, f.id
        assert_within_bound(y, ref, bound, label=f"{f.id} {kw['feature_map'].name}")
        ran += 1
    assert ran >= 2  # non-causal: quadratic, associative, messages; causal: five forms
    return ran


class LinearGQATest(chex.TestCase):
    @chex.variants(with_jit=True)
    @scaled(0.3)
    @given(case=st.sampled_from(LINEAR_JIT_CASES), seed=st.integers(0, 2**31 - 1))
    def test_every_linear_formulation_matches_oracle(self, case, seed):
        kv, dtype, causal = case
        note(f"K={kv} dtype={dtype} causal={causal} seed={seed}")
        _check_linear(*_linear_case(kv, dtype, causal, seed), self.variant)

    @chex.variants(without_jit=True)
    def test_every_linear_formulation_matches_oracle_eagerly(self):
        """Without jit, every linear formulation once (in a causal mode it takes), one case."""
        done = ("linear_quadratic", "linear_associative", "linear_messages")
        ran = _check_linear(*_linear_case(2, np.float64, False, seed=3), self.variant)
        ran += _check_linear(*_linear_case(2, np.float64, True, seed=3), self.variant, skip=done)
        assert ran == len(LINEAR)


# ----------------------------------------------------------------------------- gradients


def _loss(apply, params, x_q, x_kv, mask, bias, cot):
    return jnp.sum(apply(params, x_q, x_kv, mask=mask, bias=bias) * cot)


@functools.cache
def _grad_fn(fid):
    return jax.jit(jax.grad(functools.partial(_loss, attnref.get(fid).apply), argnums=(0, 1, 2)))


def _named(grads, group):
    """Gradient arrays by name, K/V arrays of repeated params summed over each group."""
    params_g, gx_q, gx_kv = grads
    out = {"d/dx_q": gx_q, "d/dx_kv": gx_kv}
    for name in ("w_q", "w_k", "w_v", "w_o", "b_q", "b_k", "b_v", "b_o"):
        g = np.asarray(getattr(params_g, name), np.float64)
        if group > 1 and name in ("w_k", "w_v", "b_k", "b_v"):
            g = g.reshape(g.shape[0] // group, group, *g.shape[1:]).sum(axis=1)
        out[f"d/d{name}"] = g
    return {k: np.asarray(v, np.float64) for k, v in out.items()}


def test_gradient_of_shared_kv_head_is_sum_over_its_group():
    """``d L / d W_K[g] = sum_{i : i // G = g} d L / d W_K'[i]`` with ``W_K'`` the repeated
    params (a separate multi-head evaluation), likewise W_V, b_K, b_V; all other gradients are
    equal. Through ``scores_messages``, which uses both mechanisms (shared key projections for
    the scores, per-query-head ``W_M[i] = W_V[i // G] W_O[i]`` for the messages). Float32 on
    grouped params against float64 on repeated params, FlashAttention's rule with the repeated
    float32 gradient as same-precision reference and the floor of ``tests/test_gradients.py``
    (plus G terms for the group sum)."""
    fid = "scores_messages"
    bucket, kv, _ = GQA_CASES[0]  # G = 2: two groups of two query heads
    p = gqa_problem(bucket, kv, "combined", seed=29, dtype=np.float64)
    group = p.params.group_size
    mha = repeat_kv_heads(p.params)
    cot = np.random.default_rng(1).standard_normal((*bucket.batch, bucket.t, bucket.d_model))

    def grads(params, dtype, group_sum):
        args = (p.x_q, p.x_kv, p.mask, p.bias, cot)
        cast = [a if a.dtype == bool else a.astype(dtype) for a in args]
        g = _grad_fn(fid)(params.astype(dtype), *cast)
        return _named(g, group_sum)

    actual = grads(p.params, np.float32, 1)
    exact = grads(mha, np.float64, group)
    reference = grads(mha, np.float32, group)
    b = bucket
    n_b = int(np.prod(b.batch)) * b.t + b.s + b.d_model + b.d_k + b.d_v + b.n + group
    scale = max(float(np.abs(g).max()) for g in exact.values())
    assert actual.keys() == exact.keys()
    for name in exact:
        assert actual[name].shape == exact[name].shape, name
        assert_comparative(
            actual[name],
            exact[name],
            reference[name],
            dtype=np.float32,
            floor_n=n_b,
            floor_magnitude=scale,
            label=f"{fid} K={kv} {name}",
        )


# ----------------------------------------------------------------------------- errors

_P = attnref.init_params(0, d_model=8, num_heads=4, d_k=2, d_v=3, bias=True, num_kv_heads=2)
_X = np.random.default_rng(0).standard_normal((5, 8)).astype(np.float32)


def _bad(**changes):
    return dataclasses.replace(_P, **changes)


BAD_PARAMS = (
    (
        "H not a multiple of K",
        _bad(w_k=np.zeros((3, 8, 2), np.float32), w_v=np.zeros((3, 8, 3), np.float32)),
        r"params\.w_k has 3 heads but params\.w_q has 4 \(shapes \(3, 8, 2\) and \(4, 8, 2\)\); "
        r"num_heads must be a multiple of num_kv_heads",
    ),
    (
        "w_v heads differ from w_k",
        _bad(w_v=np.zeros((4, 8, 3), np.float32)),
        r"params\.w_k has shape \(2, 8, 2\) but params\.w_v has shape \(4, 8, 3\)",
    ),
    (
        "b_k with H heads",
        _bad(b_k=np.zeros((4, 2), np.float32)),
        r"params\.b_k has shape \(4, 2\); expected \[K, d_k\] = \(2, 2\)",
    ),
    (
        "b_v with H heads",
        _bad(b_v=np.zeros((4, 3), np.float32)),
        r"params\.b_v has shape \(4, 3\); expected \[K, d_v\] = \(2, 3\)",
    ),
)


@pytest.mark.parametrize("jit", [False, True], ids=["nojit", "jit"])
@pytest.mark.parametrize("case", BAD_PARAMS, ids=[c[0] for c in BAD_PARAMS])
def test_bad_grouping_raises_clearly(case, jit):
    _, params, pattern = case
    linear_kw = dict(feature_map=attnref.linear.elu_plus_one())
    for f, kw in [(f, {}) for f in SOFTMAX] + [(f, linear_kw) for f in LINEAR]:
        fn = jax.jit(f.apply, static_argnames=f.static_argnames) if jit else f.apply
        with pytest.raises(ValueError, match=pattern):
            fn(params, _X, **kw)
    for merged in (
        attnref.interp.w_p,
        attnref.interp.w_m,
        attnref.interp.w_a,
        attnref.interp.w_i,
        repeat_kv_heads,
    ):
        with pytest.raises(ValueError, match=pattern):
            merged(params)


def test_group_size_and_init_params_reject_bad_grouping():
    with pytest.raises(ValueError, match=r"num_heads must be a multiple of num_kv_heads"):
        _ = BAD_PARAMS[0][1].group_size
    with pytest.raises(ValueError, match=r"num_heads=4 is not a multiple of num_kv_heads=3"):
        attnref.init_params(0, d_model=8, num_heads=4, d_k=2, num_kv_heads=3)
    with pytest.raises(ValueError, match=r"num_kv_heads must be a positive integer, got 0"):
        attnref.init_params(0, d_model=8, num_heads=4, d_k=2, num_kv_heads=0)


def test_oracle_and_bounds_reject_bad_grouping():
    bad = BAD_PARAMS[0][1]
    fm = attnref.linear.elu_plus_one()
    pattern = r"params\.w_q has 4 heads, params\.w_k 3"
    for fn in (
        lambda: oracle.attention(bad, _X),
        lambda: oracle.linear_multihead(bad, _X, feature_map=fm),
        lambda: tolerance.attention_error_bound(bad, _X),
        lambda: tolerance.linear_multihead_error_bound(bad, _X, feature_map=fm),
    ):
        with pytest.raises(ValueError, match=pattern):
            fn()


@pytest.mark.parametrize(
    "convert",
    (attnref.interop.to_flax, attnref.interop.to_torch_mha, attnref.interop.to_hf_bert),
    ids=lambda f: f.__name__,
)
def test_fused_layouts_reject_grouped_params(convert):
    """Flax, nn.MultiheadAttention and BERT store one K/V head per query head: GQA params raise
    and point to ``repeat_kv_heads``, whose output converts and round-trips."""
    p = attnref.init_params(0, d_model=8, num_heads=4, d_k=2, bias=True, num_kv_heads=2)
    with pytest.raises(ValueError, match=re.escape("num_kv_heads=2") + ".*repeat_kv_heads"):
        convert(p)
    assert convert(repeat_kv_heads(p))
