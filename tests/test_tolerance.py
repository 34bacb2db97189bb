"""The rounding model of :mod:`attnref.tolerance`, and its bounds against measured errors.

NumPy only (no JAX computation): each property is checked against a truth outside the module.

* ``unit_roundoff`` against the formats' significand width ``p`` (``np.finfo`` /
  ``ml_dtypes.finfo``: ``u = 2^-p``) and against the arithmetic itself (``1 + u`` rounds to 1,
  ``1 + 2u`` does not; every rounding is within ``u`` relative).
* ``gamma`` against exact rational arithmetic (``fractions``): its formula, and Higham's
  Lemma 3.1 (``|prod (1 + d_i)^(+-1) - 1| <= gamma_n`` at the extreme ``|d_i| = u``).
* The bounds: non-negative, finite, ordered by the format's ``u``, linear where the model says
  so, and covering the actual error of a float32 NumPy computation written here from the equations
  (``docs/tolerances.md``), against the float64 oracle, while staying far below the output scale.
"""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, note
from hypothesis import strategies as st

from attnref import oracle, tolerance

FLOATS = {
    "float64": np.float64,
    "float32": np.float32,
    "float16": np.float16,
    "bfloat16": ml_dtypes.bfloat16,
}
U32 = tolerance.unit_roundoff(np.float32)


def _significand_bits(dtype) -> int:
    """``p`` (stored mantissa bits + the implicit one), from the format's own description."""
    info = ml_dtypes.finfo(dtype) if dtype is ml_dtypes.bfloat16 else np.finfo(dtype)
    return int(info.nmant) + 1


# ----------------------------------------------------------------------------- unit round-off


@pytest.mark.parametrize("name", FLOATS)
def test_unit_roundoff_is_two_to_the_minus_p(name):
    dtype = FLOATS[name]
    p = {"float64": 53, "float32": 24, "float16": 11, "bfloat16": 8}[name]  # IEEE 754 / bfloat16
    assert _significand_bits(dtype) == p
    assert tolerance.unit_roundoff(dtype) == 2.0**-p
    assert tolerance.unit_roundoff(np.dtype(dtype)) == 2.0**-p  # a dtype object works alike


@pytest.mark.parametrize("name", FLOATS)
def test_unit_roundoff_matches_the_arithmetic(name):
    """Round to nearest, ties to even: ``1 + u`` is a tie that rounds down to 1, while ``1 + 2u``
    (one ulp of 1) is representable; ``u`` is therefore the largest relative rounding error."""
    dtype = FLOATS[name]
    u = tolerance.unit_roundoff(dtype)
    one = np.asarray(1.0, dtype)
    assert one + np.asarray(u, dtype) == one
    assert one + np.asarray(2 * u, dtype) > one
    assert float(np.asarray(1.0 + 1.5 * u, np.float64).astype(dtype)) == 1.0 + 2 * u


@pytest.mark.parametrize("name", FLOATS)
@given(x=st.floats(1e-3, 1e3) | st.floats(-1e3, -1e-3))
def test_every_rounding_is_within_u_relative(name, x):
    dtype = FLOATS[name]
    rounded = float(np.asarray(x, np.float64).astype(dtype))
    assert abs(Fraction(rounded) - Fraction(x)) <= Fraction(tolerance.unit_roundoff(dtype)) * abs(
        Fraction(x)
    )


@pytest.mark.parametrize("bad", [np.int32, np.int8, np.uint16, np.bool_, "int64", np.dtype("U3")])
def test_unit_roundoff_refuses_a_non_float_dtype(bad):
    with pytest.raises(ValueError, match="floating-point dtype"):
        tolerance.unit_roundoff(bad)


# ----------------------------------------------------------------------------- gamma


U_VALUES = [tolerance.unit_roundoff(d) for d in FLOATS.values()]


@given(n=st.integers(0, 10**7), u=st.sampled_from(U_VALUES))
def test_gamma_is_n_u_over_one_minus_n_u(n, u):
    exact = Fraction(n) * Fraction(u)
    got = tolerance.gamma(n, u)
    if exact >= 1:
        assert got == math.inf  # no bound of this form: refused as inf, never a finite number
        return
    want = exact / (1 - exact)
    # n u is exact (u a power of two); 1 - n u and the division round: within gamma_3(2^-53).
    assert abs(Fraction(got) - want) <= Fraction(tolerance.gamma(3, 2.0**-53)) * want
    assert got >= float(exact)  # gamma_n >= n u


@given(n=st.integers(0, 10**6), u=st.sampled_from(U_VALUES))
def test_gamma_increases_with_n_until_it_refuses(n, u):
    a, b = tolerance.gamma(n, u), tolerance.gamma(n + 1, u)
    if (n + 1) * u < 1:
        assert 0 <= a < b < math.inf
    else:
        assert b == math.inf


@pytest.mark.parametrize("u", [2.0**-8, 2.0**-11])
@pytest.mark.parametrize("n", [1, 2, 7, 30])
def test_gamma_bounds_n_compounded_roundings(n, u):
    """Higham 2002, Lemma 3.1: ``prod_i (1 + d_i)^(r_i)`` with ``|d_i| <= u``, ``r_i = +-1`` is
    ``1 + t`` with ``|t| <= gamma_n``. The extremes are all ``d_i = u`` or ``-u`` with all
    exponents alike; computed exactly. (``n u`` alone, the first-order term, would fail here.)
    For ``n = 1`` the lemma is tight (``1/(1 - u) - 1 = gamma_1``), so the float64 rounding of
    ``gamma`` itself is allowed for: one ``u_64`` relative."""
    g = Fraction(tolerance.gamma(n, u)) * (1 + Fraction(2) ** -53)
    uf = Fraction(u)
    for t in ((1 + uf) ** n - 1, 1 - (1 - uf) ** n, 1 / (1 - uf) ** n - 1, 1 - 1 / (1 + uf) ** n):
        assert 0 < t <= g
    assert (1 / (1 - uf) ** n - 1) > n * uf


def test_gamma_refuses_n_u_at_or_above_one():
    assert tolerance.gamma(256, 2.0**-8) == math.inf
    assert tolerance.gamma(2**30, 2.0**-24) == math.inf
    assert tolerance.gamma(255, 2.0**-8) == 255.0  # (255/256) / (1/256), every step exact


# ----------------------------------------------------------------------------- problems

# Bucketed shapes (B, T_q, T_k, d_model, H, K, d_k, d_v): batch-free, batched, cross, grouped.
SHAPES = [
    ((), 3, 3, 4, 2, 2, 2, 3),
    ((2,), 4, 4, 3, 2, 1, 4, 2),
    ((), 2, 5, 4, 4, 2, 3, 4),
    ((1,), 5, 3, 6, 1, 1, 4, 4),
]


def _f32(a: np.ndarray) -> np.ndarray:
    """Round to float32 and return float64: inputs exactly representable in the tested format."""
    return a.astype(np.float32).astype(np.float64)


@st.composite
def weight_problems(draw, lo=-1.0):
    """A weight-level problem with every entry in ``[lo, 1]`` (before rounding to float32)."""
    batch, t_q, t_k, d_model, h, kv, d_k, d_v = draw(st.sampled_from(SHAPES), label="shape")
    seed = draw(st.integers(0, 2**32 - 1), label="seed")
    has_bias = draw(st.booleans(), label="biases")
    cross = draw(st.booleans(), label="cross") or t_q != t_k
    masking = draw(st.sampled_from(["none", "causal", "random", "neg_inf_bias"]), label="mask")
    rng = np.random.default_rng(seed)

    def r(*shape):
        return _f32(rng.uniform(lo, 1.0, shape))

    params = {
        "w_q": r(h, d_model, d_k),
        "w_k": r(kv, d_model, d_k),
        "w_v": r(kv, d_model, d_v),
        "w_o": r(h, d_v, d_model),
    }
    if has_bias:
        params |= {"b_q": r(h, d_k), "b_k": r(kv, d_k), "b_v": r(kv, d_v), "b_o": r(d_model)}
    x_q = r(*batch, t_q, d_model)
    x_kv = r(*batch, t_k, d_model) if cross else None
    mask = bias = None
    if masking == "causal":
        mask = np.tril(np.ones((t_q, t_k), bool))
    elif masking == "random":
        mask = rng.random((*batch, t_q, t_k)) < 0.6  # may leave a row with no key
    elif masking == "neg_inf_bias":
        bias = _f32(rng.uniform(-2, 2, (t_q, t_k)))
        bias[rng.random((t_q, t_k)) < 0.3] = -np.inf
    note(f"shape={(batch, t_q, t_k, d_model, h, kv, d_k, d_v)} seed={seed} {masking}")
    return params, x_q, x_kv, mask, bias, _scale32(d_k)


def _scale32(d: int) -> float:
    """``1/sqrt(d)`` rounded to float32, passed to all three computations: the scale is an input
    like the weights (the model bounds arithmetic on given inputs, not the rounding of inputs)."""
    return float(np.float32(1.0 / math.sqrt(d)))


def attention_float32(params, x_q, x_kv, mask, bias, scale):
    """Multi-head attention in float32 NumPy, from the equation (``docs/tolerances.md``; row
    convention, query head ``i`` reads key/value head ``i // G``)::

        s = (x_q W_Q[i] + b_Q[i]) (x_kv W_K[g] + b_K[g])^T scale + bias   (allowed keys)
        p = exp(s - max s) / sum exp(s - max s)                (zero row if no key is allowed)
        y = sum_i p (x_kv W_V[g] + b_V[g]) W_O[i] + b_O
    """
    f = np.float32
    w = {k: np.asarray(v, f) for k, v in params.items()}
    xq = np.asarray(x_q, f)
    xkv = xq if x_kv is None else np.asarray(x_kv, f)
    h, kv, d_k = w["w_q"].shape[0], w["w_k"].shape[0], w["w_q"].shape[2]
    shape = (*xq.shape[:-2], xq.shape[-2], xkv.shape[-2])
    allowed = np.ones(shape, bool) if mask is None else np.broadcast_to(mask, shape)
    add = np.zeros(shape, f) if bias is None else np.broadcast_to(np.asarray(bias, f), shape)
    allowed = allowed & ~np.isneginf(add)
    scale = f(scale)
    y = np.zeros((*xq.shape[:-1], xq.shape[-1]), f)
    for i in range(h):
        g = i // (h // kv)
        q = xq @ w["w_q"][i] + w.get("b_q", np.zeros((h, d_k), f))[i]
        k = xkv @ w["w_k"][g] + w.get("b_k", np.zeros((kv, d_k), f))[g]
        v = xkv @ w["w_v"][g] + (w["b_v"][g] if "b_v" in w else f(0))
        s = (q @ np.swapaxes(k, -1, -2)) * scale + np.where(allowed, add, f(0))
        top = np.max(np.where(allowed, s, -np.inf), axis=-1, keepdims=True)
        top = np.where(np.isfinite(top), top, f(0)).astype(f)
        e = np.where(allowed, np.exp(np.where(allowed, s - top, f(0))), f(0)).astype(f)
        total = e.sum(axis=-1, keepdims=True)
        p = (e / np.where(total > 0, total, f(1))).astype(f)
        y = y + (p @ v) @ w["w_o"][i]
    if "b_o" in w:
        y = y + w["b_o"]
    assert y.dtype == f
    return y


def _a_priori_scale(params) -> float:
    """``max |y|`` over all inputs with entries in ``[-1, 1]`` (weights sum to one per head):
    ``H (d_model + 1) d_v max|W~_V| max|W_O| + max|b_O|``, with the weights' own maxima."""
    h, d_v, d_model = params["w_o"].shape
    v_max = max(np.abs(params["w_v"]).max(), np.abs(params.get("b_v", np.zeros(1))).max())
    return float(
        h * (d_model + 1) * d_v * v_max * np.abs(params["w_o"]).max()
        + np.abs(params.get("b_o", np.zeros(1))).max()
    )


# ----------------------------------------------------------------------------- weight level


@given(weight_problems())
def test_attention_bound_covers_float32_numpy(problem):
    params, x_q, x_kv, mask, bias, scale = problem
    got = attention_float32(params, x_q, x_kv, mask, bias, scale).astype(np.float64)
    ref = oracle.attention(params, x_q, x_kv, mask=mask, bias=bias, scale=scale)
    bound = tolerance.attention_error_bound(
        params, x_q, x_kv, mask=mask, bias=bias, scale=scale, dtype=np.float32
    )
    assert bound.shape == ref.shape
    err = np.abs(got - ref)
    note(f"max err/bound {np.max(err / np.where(bound > 0, bound, 1)):.3g}")
    assert np.all(err <= bound), np.max(err - bound)


@given(weight_problems())
def test_attention_bound_is_not_vacuous(problem):
    """Entries in ``[-1, 1]``, ``d_model <= 6``, ``d_k, d_v <= 4``, ``H <= 4``, ``T_k <= 5``:

    * ``|x~ W~_Q|`` entries ``<= d_model + 1 = 7``, so ``Ls <= d_k 49 / sqrt(d_k) <= 98`` plus
      ``|bias| <= 2``: ``Ls, |s| <= 100`` and ``|s - max s| <= 200``;
    * ``N_s = 2 (d_model + 1) + d_k + 2 <= 20``: ``E <= gamma_20 100 + 200 u ~ 2200 u``;
    * ``rho <= expm1(2 E) + gamma_15 ~ 4415 u``; ``N_y <= 5 + 6 + 4 + 4 + 2 = 21``;
    * ``sum_h sum_j p G + |b_O| <= M`` (:func:`_a_priori_scale`), so
      ``bound <= (rho + gamma_21) M + (float64 share) < 4500 u M``, i.e. about ``2.7e-4`` of the
      largest output any input could give: a useful float32 tolerance, not a vacuous one."""
    params, x_q, x_kv, mask, bias, scale = problem
    bound = tolerance.attention_error_bound(
        params, x_q, x_kv, mask=mask, bias=bias, scale=scale, dtype=np.float32
    )
    assert np.all(bound <= 4500 * U32 * _a_priori_scale(params))


@given(weight_problems(), st.sampled_from([2.0, 0.5, 3.0, 1e-3]))
def test_attention_bound_is_linear_in_w_o_and_b_o(problem, c):
    """``W_O``, ``b_O`` enter only the output step, linearly: ``sum_j p_hij |x~_j||W~_V||W_O|``
    and ``gamma_{N_y} |b_O|``; the logits and weights (``rho``) do not see them. Powers of two
    scale exactly."""
    params, x_q, x_kv, mask, bias, _ = problem
    scaled = dict(params, w_o=params["w_o"] * c)
    if "b_o" in params:
        scaled["b_o"] = params["b_o"] * c
    kw = dict(mask=mask, bias=bias, dtype=np.float32)
    b1 = tolerance.attention_error_bound(params, x_q, x_kv, **kw)
    b2 = tolerance.attention_error_bound(scaled, x_q, x_kv, **kw)
    if math.log2(c).is_integer():
        np.testing.assert_array_equal(b2, c * b1)
    else:
        np.testing.assert_allclose(b2, c * b1, rtol=1e-13, atol=0)


@given(weight_problems())
def test_attention_bound_grows_with_the_formats_unit_roundoff(problem):
    """Same inputs (exact in every format below: they are float32 values, and the bound takes
    them as given), four formats: bfloat16 >= float16 >= float32 >= float64 entrywise, strictly
    where the bound is not zero. Every bound is non-negative and finite at these sizes."""
    params, x_q, x_kv, mask, bias, _ = problem
    bounds = [
        tolerance.attention_error_bound(params, x_q, x_kv, mask=mask, bias=bias, dtype=d)
        for d in (ml_dtypes.bfloat16, np.float16, np.float32, np.float64)
    ]
    for b in bounds:
        assert np.all(np.isfinite(b)) and np.all(b >= 0)
    for hi, lo in itertools.pairwise(bounds):
        assert np.all(hi >= lo)
        live = lo > 0
        assert np.all(hi[live] > lo[live])


@given(weight_problems())
def test_local_errors_are_the_bounds_ingredients(problem):
    """``attention_local_errors``: non-negative and finite, zero at masked keys, the weights'
    term exactly ``gamma_{T_k + 10}`` in float32's and float64's ``u``, and ordered by format."""
    params, x_q, x_kv, mask, _, _ = problem
    t_k = (x_q if x_kv is None else x_kv).shape[-2]
    e32 = tolerance.attention_local_errors(params, x_q, x_kv, mask=mask, dtype=np.float32)
    e64 = tolerance.attention_local_errors(params, x_q, x_kv, mask=mask, dtype=np.float64)
    c = tolerance.C_EXP
    assert e32["weights"] == tolerance.gamma(t_k + 2 + 2 * c, U32) + tolerance.gamma(
        t_k + 2 + 2 * c, 2.0**-53
    )
    for key in ("logits", "output"):
        assert np.all(np.isfinite(e32[key])) and np.all(e32[key] >= 0)
        assert np.all(e32[key] >= e64[key])
    if mask is not None:
        dead = ~np.broadcast_to(np.expand_dims(mask, -3), e32["logits"].shape)
        assert np.all(e32["logits"][dead] == 0)


# ----------------------------------------------------------------------------- kernel level

KERNEL_SHAPES = [(1, 3, 3, 2, 2, 4, 3), (2, 4, 5, 2, 1, 3, 2), (1, 2, 6, 4, 2, 8, 4)]


@st.composite
def kernel_problems(draw):
    """``q [B, T, N, H]``, ``k [B, S, K, H]``, ``v [B, S, K, H_v]`` in ``[-1, 1]`` and options."""
    b, t, s, n, kv, h, h_v = draw(st.sampled_from(KERNEL_SHAPES), label="shape")
    seed = draw(st.integers(0, 2**32 - 1), label="seed")
    rng = np.random.default_rng(seed)
    q, k, v = (
        _f32(rng.uniform(-1, 1, shape)) for shape in ((b, t, n, h), (b, s, kv, h), (b, s, kv, h_v))
    )
    opts = {}
    if draw(st.booleans(), label="causal"):
        opts["is_causal"] = True
    if draw(st.booleans(), label="mask"):
        opts["mask"] = rng.random((b, n, t, s)) < 0.7
    if draw(st.booleans(), label="bias"):
        opts["bias"] = _f32(rng.uniform(-2, 2, (b, n, t, s)))
    opts["scale"] = _scale32(h)
    note(f"shape={(b, t, s, n, kv, h, h_v)} seed={seed} {sorted(opts)}")
    return q, k, v, opts


def _allowed(q, k, opts):
    b, t, n, _ = q.shape
    return oracle.kernel_allowed(
        (b, n, t, k.shape[1]),
        opts.get("bias"),
        opts.get("mask"),
        is_causal=opts.get("is_causal", False),
    )


def kernel_float32(q, k, v, allowed, bias, scale):
    """``o = softmax(q k^T scale + bias) v`` over allowed keys, and ``lse``, in float32."""
    f = np.float32
    n, kv = q.shape[2], k.shape[2]
    kg = np.repeat(k.astype(f), n // kv, axis=2)
    vg = np.repeat(v.astype(f), n // kv, axis=2)
    s = np.einsum("btnh,bsnh->bnts", q.astype(f), kg) * f(scale)
    if bias is not None:
        s = s + bias.astype(f)
    top = np.max(np.where(allowed, s, -np.inf), axis=-1, keepdims=True)
    live = np.isfinite(top)
    top = np.where(live, top, f(0)).astype(f)
    e = np.where(allowed, np.exp(np.where(allowed, s - top, f(0))), f(0)).astype(f)
    total = e.sum(axis=-1, keepdims=True)
    p = (e / np.where(live, total, f(1))).astype(f)
    o = np.einsum("bnts,bsnh->btnh", p, vg)
    with np.errstate(divide="ignore"):
        lse = np.where(live, top + np.log(np.where(live, total, f(1))), -np.inf)[..., 0]
    assert o.dtype == f
    return o, np.swapaxes(lse, 1, 2)


@given(kernel_problems())
def test_kernel_bound_covers_float32_numpy(problem):
    q, k, v, opts = problem
    allowed = _allowed(q, k, opts)
    o_ref, lse_ref = oracle.dot_product_attention(q, k, v, return_lse=True, **opts)
    o32, lse32 = kernel_float32(q, k, v, allowed, opts.get("bias"), opts["scale"])
    # key_blocks=1: the naive (one-pass) softmax, as computed above.
    ob, lb = tolerance.kernel_error_bound(
        q, k, v, allowed, opts.get("bias"), scale=opts["scale"], dtype=np.float32, key_blocks=1
    )
    assert np.all(np.abs(o32 - o_ref) <= ob)
    live = np.isfinite(lse_ref)
    assert np.array_equal(live, np.isfinite(lse32))
    assert np.all(np.abs(lse32[live] - lse_ref[live]) <= lb[live])
    assert np.all(o32[~live] == 0)


@given(kernel_problems())
def test_kernel_bound_is_not_vacuous_and_ordered(problem):
    """Entries in ``[-1, 1]``, ``H <= 8``, ``S <= 6``, ``|bias| <= 2``: ``|s| <= sqrt(H) + 2 <= 5``,
    ``E <= gamma_9 sqrt(8) + u 5 + u 10 ~ 41 u``, ``rho <= 82 u + gamma_{S + 10} ~ 98 u``, so
    ``|do| <= (rho + gamma_S) max|v| < 128 u max|v|``: about ``8e-6`` of the value scale.
    And ``key_blocks=None`` (any tiling) >= one block; float16 >= float32 >= float64."""
    q, k, v, opts = problem
    allowed = _allowed(q, k, opts)
    kw = dict(key_blocks=1, scale=opts["scale"])
    ob = {
        d: tolerance.kernel_error_bound(q, k, v, allowed, opts.get("bias"), dtype=d, **kw)[0]
        for d in (np.float16, np.float32, np.float64)
    }
    assert np.all(ob[np.float32] <= 128 * U32 * np.abs(v).max())
    for d in ob:
        assert np.all(np.isfinite(ob[d])) and np.all(ob[d] >= 0)
    assert np.all(ob[np.float16] >= ob[np.float32]) and np.all(ob[np.float32] >= ob[np.float64])
    tiled, _ = tolerance.kernel_error_bound(
        q, k, v, allowed, opts.get("bias"), scale=opts["scale"], dtype=np.float32
    )
    assert np.all(tiled >= ob[np.float32])


@given(kernel_problems(), st.sampled_from([4.0, 0.25, 3.0]))
def test_kernel_bound_is_linear_in_v(problem, c):
    """``v`` enters only ``sum_j p_ij |v_j|``: the output bound scales with it (exactly for powers
    of two); ``lse``'s bound does not depend on ``v`` at all."""
    q, k, v, opts = problem
    allowed = _allowed(q, k, opts)
    o1, l1 = tolerance.kernel_error_bound(q, k, v, allowed, opts.get("bias"), dtype=np.float32)
    o2, l2 = tolerance.kernel_error_bound(q, k, c * v, allowed, opts.get("bias"), dtype=np.float32)
    np.testing.assert_array_equal(l2, l1)
    if math.log2(c).is_integer():
        np.testing.assert_array_equal(o2, c * o1)
    else:
        np.testing.assert_allclose(o2, c * o1, rtol=1e-13, atol=0)
