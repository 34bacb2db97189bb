"""The kernel oracle's two implementations and its gradient oracle.

``method="definition"`` (one element at a time) is the root of trust; ``method="fast"`` (float64
BLAS over query blocks) must agree with it within the derived float64 bound: each is a float64
evaluation of the same sums, so each is within ``tolerance.kernel_call_error_bound(...,
dtype=float64)``'s float64 term of the exact result, and that bound (which counts the float64
term twice) covers their difference. The gradient oracle is checked three ways: fast against
definition (within twice its float64 gradient bound, the same argument), the definition against
central finite differences of the *definition forward* (an outside truth: no analytic formula
shared), and against JAX's float64 autodiff of ``attnref.dot_product_attention`` (an independent
implementation of the forward, differentiated by JAX).
"""

from __future__ import annotations

import math
import tracemalloc

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import attnref
from attnref import oracle, tolerance
from attnref import strategies as ast

from .helpers import scaled
from .kernel_helpers import kproblems

F64 = ("float64",)


def _cotangents(p: ast.KernelProblem, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng([seed, 7])
    c = p.config
    return rng.standard_normal((c.b, c.t, c.n, c.h_v)), rng.standard_normal((c.b, c.t, c.n))


def _assert_within(got: np.ndarray, want: np.ndarray, bound: np.ndarray, label: str) -> None:
    """Same NaN and infinity pattern; elsewhere ``|got - want| <= bound``."""
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=f"{label}: NaN pattern")
    np.testing.assert_array_equal(np.isinf(got), np.isinf(want), err_msg=f"{label}: inf pattern")
    fin = np.isfinite(want)
    err = np.abs(np.where(fin, got, 0.0) - np.where(fin, want, 0.0))
    bad = err > np.where(fin, bound, 0.0)
    assert not bad.any(), (
        f"{label}: |fast - definition| = {err[bad].max():.3e} > bound at "
        f"{tuple(np.argwhere(bad)[0])}"
    )


@given(problem=kproblems(dtypes=F64))
@scaled(0.5)
def test_fast_forward_equals_definition(problem):
    """Output, lse and the allowed set, over mixed options (every mask kind, its broadcast shapes,
    GQA, T != S, softcap, windows, every masked-rows policy and alignment)."""
    p = problem
    out_f, lse_f = p.oracle()
    out_d, lse_d = p.oracle(method="definition")
    bound, lse_bound = p.bound()  # float64 problem: the float64 term, counted twice
    _assert_within(out_f, out_d, bound, f"output {p!r}")
    _assert_within(lse_f, lse_d, lse_bound, f"lse {p!r}")
    c = p.config
    kw = {k: v for k, v in p.options.items() if k not in ("softcap", "scale")}
    shape = (c.b, c.n, c.t, c.s)
    fast = oracle.kernel_allowed(shape, causal_alignment=p.causal_alignment, **kw)
    slow = oracle.kernel_allowed(
        shape, causal_alignment=p.causal_alignment, method="definition", **kw
    )
    np.testing.assert_array_equal(fast, slow)


@given(problem=ast.with_production(kproblems(dtypes=F64)))
@scaled(0.5)
def test_magnitude_is_the_output_for_absolute_values(problem):
    """``return_magnitude``'s ``sum_j p_ij w_ij |v_j|`` (fast: one GEMM with the output) is the
    definition's output of the same call with ``|v|`` for ``v`` (within that call's float64
    bound; the definition's own magnitude exactly), and asking for it leaves ``o`` and ``lse``
    within their bounds of the plain call's."""
    p = problem
    out, lse, mag = p.apply(oracle.dot_product_attention, return_lse=True, return_magnitude=True)
    plain, plain_lse = p.oracle()
    bound, lse_bound = p.bound()
    _assert_within(out, plain, bound, f"output {p!r}")
    _assert_within(lse, plain_lse, lse_bound, f"lse {p!r}")
    absolute = p.replace(v=np.abs(p.v))
    want = absolute.oracle(method="definition")[0]
    _assert_within(mag, want, absolute.bound()[0], f"magnitude {p!r}")
    _, own = p.apply(oracle.dot_product_attention, return_magnitude=True, method="definition")
    np.testing.assert_array_equal(own, want)


@given(
    problem=ast.with_production(kproblems(dtypes=("float32", "float64", "bfloat16", "float16"))),
    key_blocks=st.sampled_from((None, 1)),
)
@scaled(0.5)
def test_bound_minorant_is_below_every_kernel_bound(problem, key_blocks):
    """``kernel_bound_minorant`` (the kit's first, cheap test) lies below the kernel bound for any
    tiling or one key block, and below the merged-pieces bound of distributed targets; it is
    positive wherever the magnitude is, so it is not vacuous."""
    p = problem
    _, mag = p.apply(oracle.dot_product_attention, return_magnitude=True)
    floor = tolerance.kernel_bound_minorant(mag, p.config.s, p.dtype)
    for name, bound in (
        (f"kernel bound, key_blocks={key_blocks}", p.bound(key_blocks)[0]),
        ("pieces bound", p.apply(tolerance.pieces_error_bound, pieces=None)[0]),
    ):
        over = floor > bound
        assert not over.any(), f"{name}: minorant above it at {tuple(np.argwhere(over)[0])}"
    live = np.isfinite(mag) & (mag > 0)
    assert np.all(floor[live] > 0) and np.all(floor[~live] == 0)


def test_bound_minorant_refuses_bad_input():
    mag = np.ones((1, 2, 1, 3))
    for keys in (-1, 2.5, True):
        with pytest.raises(ValueError, match="keys must be an integer >= 0"):
            tolerance.kernel_bound_minorant(mag, keys, np.float32)
    with pytest.raises(ValueError, match=r"magnitude \(1, 2, 1, 3\) must be >= 0"):
        tolerance.kernel_bound_minorant(-mag, 4, np.float32)
    with pytest.raises(ValueError, match="expected a floating-point dtype"):
        tolerance.kernel_bound_minorant(mag, 4, np.int32)
    # a negative entry beside a NaN, and -inf, are refused too
    for bad in (np.array([np.nan, -1.0, 2.0]), np.array([1.0, -np.inf])):
        with pytest.raises(ValueError, match="must be >= 0"):
            tolerance.kernel_bound_minorant(bad, 4, np.float32)


def test_bound_minorant_is_zero_where_the_magnitude_is_not_finite():
    mag = np.array([[1.0, np.nan], [np.inf, 2.0]])
    g = tolerance.gamma(4, tolerance.unit_roundoff(np.float32))
    got = tolerance.kernel_bound_minorant(mag, 4, np.float32)
    np.testing.assert_array_equal(got, [[g, 0.0], [0.0, 2 * g]])
    np.testing.assert_array_equal(
        tolerance.kernel_bound_minorant(mag[:, :0], 4, "float32"), [[], []]
    )


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("extra", [{}, {"sinks": np.array([0.5, -1.0, 2.0, 0.0])}])
def test_bound_minorant_is_tight_on_uniform_empty_rows(dtype, extra):
    """Where the bound is closest to the minorant: a row with no key under ``"uniform"`` has
    ``gamma_{S+1} mean_j |v_j|`` per unit round-off (the format's and the oracle's) against
    ``gamma_S(u) mean_j |v_j|``: a ratio of ``5/6`` in float32 (so a minorant 1.5 times too large
    fails) and ``5/12`` in float64 (16 bits add the output's cast, far larger); a row with a key
    has at least twice its minorant."""
    config = ast.Config(batch=2, t=6, s=5, n=4, k=2, h=8, h_v=8, d_model=8, dtype=dtype)
    p = ast.make_kernel_problem(config, "fully_masked_row", 3, masked_rows="uniform")
    p = p.replace(options={**p.options, **extra})
    _, mag = p.apply(oracle.dot_product_attention, return_magnitude=True)
    floor = tolerance.kernel_bound_minorant(mag, config.s, p.dtype)
    bound = p.bound()[0]
    dead = ~np.isfinite(p.oracle()[1])[..., None] & (bound > 0)
    live = np.isfinite(p.oracle()[1])[..., None] & (bound > 0)
    ratio = floor / np.where(bound > 0, bound, 1.0)
    if extra:  # with sinks a row with no key is 0 with a 0 bound; its minorant is 0 too
        keyless = ~p.allowed().any(axis=-1).transpose(0, 2, 1)  # [B, T, N]
        assert keyless.any() and not dead.any()
        assert np.all(bound[keyless] == 0) and np.all(floor[keyless] == 0)
    else:
        u, u64 = tolerance.unit_roundoff(dtype), tolerance.unit_roundoff(np.float64)
        g = tolerance.gamma
        want = g(config.s, u) / (g(config.s + 1, u) + g(config.s + 1, u64))
        assert dead.any()
        np.testing.assert_allclose(ratio[dead].max(), want, rtol=1e-9)
    assert ratio[live].max() <= 0.5


@given(problem=kproblems(dtypes=F64), seed=st.integers(0, 2**16))
@scaled(0.4)
def test_fast_gradient_equals_definition(problem, seed):
    """dq, dk, dv and dbias through the output and the lse."""
    p = problem
    cot, cot_lse = _cotangents(p, seed)
    fast = p.oracle_vjp(cot, cot_lse)
    slow = p.oracle_vjp(cot, cot_lse, method="definition")
    bound = p.grad_bound(cot, cot_lse)
    for name, f, s, b in zip(fast._fields, fast, slow, bound, strict=True):
        if s is None:
            assert f is None and b is None
            continue
        _assert_within(f, s, 2 * b, f"d/d{name} {p!r}")


def _loss_np(p: ast.KernelProblem, q, k, v, bias, cot, cot_lse) -> float:
    opts = dict(p.options)
    if bias is not None:
        opts["bias"] = bias
    out, lse = oracle.dot_product_attention(
        q, k, v, return_lse=True, method="definition", **p.semantics(), **opts
    )
    out = np.where(np.isnan(out), 0.0, out)  # "nan" rows: constant, no derivative
    return float(np.sum(out * cot) + np.sum(np.where(np.isfinite(lse), lse * cot_lse, 0.0)))


@given(problem=kproblems(dtypes=F64, profiles=ast.STATIC_PROFILES[:2]), seed=st.integers(0, 99))
@scaled(0.3)
def test_definition_gradient_matches_finite_differences(problem, seed):
    """``<vjp(dO), u>`` equals the central difference ``(L(x + h u) - L(x - h u)) / 2h`` of the
    definition forward along a random direction ``u`` (over q, k, v and the finite bias).

    Error of the central difference: truncation ``h^2 |L'''| / 6`` plus rounding
    ``2 eps_L / (2 h)`` with ``eps_L ~ 1e2 u64 sum|terms|``; at ``h = 1e-4`` on these O(1)
    inputs (|L'''| <= ~1e3 for logits of size ~10) truncation is ~2e-6 and rounding ~1e-9, so
    ``1e-4 (1 + |<vjp, u>|)`` holds with a 50x margin, while a wrong term (a dropped ``D_i`` or
    lse term, a missing scale) moves the product by O(1)."""
    p = problem
    cot, cot_lse = _cotangents(p, seed)
    rng = np.random.default_rng([seed, 3])
    bias = p.options.get("bias")
    finite_bias = None if bias is None else np.where(np.isinf(bias), 0.0, 1.0)
    dirs = [rng.standard_normal(a.shape) for a in (p.q, p.k, p.v)]
    dirs.append(None if bias is None else rng.standard_normal(np.shape(bias)) * finite_bias)
    grads = p.oracle_vjp(cot, cot_lse, method="definition")
    pred = sum(float(np.sum(g * d)) for g, d in zip(grads[:4], dirs, strict=True) if d is not None)
    h = 1e-4

    def at(sign: float) -> float:
        args = [a + sign * h * d for a, d in zip((p.q, p.k, p.v), dirs[:3], strict=True)]
        b = None if bias is None else bias + sign * h * dirs[3]
        return _loss_np(p, *args, b, cot, cot_lse)

    fd = (at(1.0) - at(-1.0)) / (2 * h)
    assert abs(fd - pred) <= 1e-4 * (1 + abs(pred)), f"{p!r}: fd {fd} vs vjp {pred}"


def _autodiff_loss(static, q, k, v, bias, arrays, cot, cot_lse):
    """``<out, cot> + <lse, cot_lse>`` of attnref's naive kernel (NaN rows and ``-inf`` lse
    contribute 0), the problem's static options (semantics included) in ``static``."""
    out, lse = attnref.dot_product_attention(
        q, k, v, bias, return_lse=True, **dict(static), **arrays
    )
    out = jnp.where(jnp.isnan(out), 0.0, out)
    return jnp.sum(out * cot) + jnp.sum(jnp.where(jnp.isfinite(lse), lse * cot_lse, 0.0))


# JAX's autodiff of the loss, compiled once per static option set and array structure (not
# run eagerly: eager autodiff compiles every primitive of the forward and backward per shape).
_AUTODIFF = jax.jit(jax.grad(_autodiff_loss, argnums=(1, 2, 3, 4)), static_argnames="static")


@given(problem=kproblems(dtypes=F64), seed=st.integers(0, 2**16))
@scaled(0.3)
def test_gradient_oracle_matches_jax_float64_autodiff(problem, seed):
    """JAX's float64 autodiff of attnref's naive kernel (another implementation of the forward,
    differentiated by JAX) is within the derived float64 gradient bound of the oracle."""
    p = problem
    cot, cot_lse = _cotangents(p, seed)
    kwargs = dict(p.kwargs)
    bias = kwargs.pop("bias", None)
    static = tuple(sorted(p.static.items()))
    arrays = {name: a for name, a in kwargs.items() if name not in p.static}
    with jax.enable_x64(True):
        got = _AUTODIFF(static, p.q, p.k, p.v, bias, arrays, cot, cot_lse)
    want = p.oracle_vjp(cot, cot_lse)
    bound = p.grad_bound(cot, cot_lse)
    for name, g, w, b in zip(want._fields, got, want, bound, strict=False):
        if g is None:  # no bias
            assert name == "bias" and bias is None and w is None, name
            continue
        g = np.asarray(g, np.float64)
        if name == "bias":
            g = np.where(np.isneginf(bias), 0.0, g)  # a masked entry's gradient is 0
        _assert_within(g, w, b, f"d/d{name} {p!r}")


def test_gradient_bound_is_not_vacuous():
    """A gradient with one term dropped (the lse cotangent's ``p dl``) is far outside the
    bound, and a float32 kernel's gradient is inside it."""
    p = ast.make_kernel_problem(
        ast.Config(batch=1, t=4, s=5, n=2, k=1, h=4, h_v=3, d_model=8), "causal", 3
    )
    cot, cot_lse = _cotangents(p, 0)
    bound = p.grad_bound(cot, cot_lse)
    full = p.oracle_vjp(cot, cot_lse)
    without = p.oracle_vjp(cot, None)
    assert np.max(np.abs(full.query - without.query) / bound.query) > 1e3

    def loss(q, k, v, cot, cot_lse):
        out, lse = attnref.dot_product_attention(q, k, v, return_lse=True, is_causal=True)
        return jnp.sum(out * cot) + jnp.sum(lse * cot_lse)

    # jitted: one compiled program instead of every primitive compiled eagerly
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    got = grad(p.q, p.k, p.v, cot.astype(np.float32), cot_lse.astype(np.float32))
    for g, w, b in zip(got, full, bound, strict=False):
        assert np.all(np.abs(np.asarray(g, np.float64) - w) <= b)


def test_masked_nonfinite_entries_never_reach_output_or_gradient():
    """NaN and inf in k, v and the bias at masked positions leave the fast forward and both
    gradient oracles equal to the same call with those entries zeroed."""
    cfg = ast.Config(batch=1, t=4, s=6, n=2, k=2, h=4, h_v=3, d_model=8, dtype="float64")
    p = ast.make_kernel_problem(cfg, "padding", 5)
    lens = p.options["key_value_seq_lengths"]
    k, v = p.k.copy(), p.v.copy()
    k[0, int(lens[0]) :] = np.nan
    v[0, int(lens[0]) :] = np.inf
    bad = p.replace(k=k, v=v)
    clean = p.replace(k=np.nan_to_num(k, nan=0.0), v=np.where(np.isinf(v), 0.0, v))
    cot, cot_lse = _cotangents(p, 1)
    for method in ("fast", "definition"):
        o_bad, l_bad = bad.oracle(method)
        o_ok, l_ok = clean.oracle(method)
        np.testing.assert_array_equal(o_bad, o_ok)
        np.testing.assert_array_equal(l_bad, l_ok)
        for g_bad, g_ok in zip(
            bad.oracle_vjp(cot, cot_lse, method),
            clean.oracle_vjp(cot, cot_lse, method),
            strict=True,
        ):
            if g_ok is not None:
                live = np.isfinite(g_ok)
                np.testing.assert_array_equal(np.where(live, g_bad, 0.0), np.where(live, g_ok, 0.0))


def test_oracle_does_not_write_to_its_inputs():
    cfg = ast.Config(batch=1, t=1, s=3, n=2, k=1, h=4, h_v=4, d_model=8, dtype="float64")
    p = ast.make_kernel_problem(cfg, "none", 0)
    before = [a.copy() for a in (p.q, p.k, p.v)]
    cot, cot_lse = _cotangents(p, 0)
    for method in ("fast", "definition"):
        p.oracle(method)
        p.oracle_vjp(cot, cot_lse, method)
    for a, b in zip((p.q, p.k, p.v), before, strict=True):
        np.testing.assert_array_equal(a, b)


def test_gradient_oracle_refuses():
    p = ast.make_kernel_problem(
        ast.Config(batch=1, t=3, s=3, n=1, k=1, h=2, h_v=2, d_model=4), "none", 0
    )
    cot = np.zeros((1, 3, 1, 2))
    with pytest.raises(ValueError, match="method"):
        oracle.dot_product_attention(p.q, p.k, p.v, method="exact")
    with pytest.raises(ValueError, match="cotangent"):
        oracle.dot_product_attention_vjp(p.q, p.k, p.v, cotangent=cot[:, :2])
    with pytest.raises(TypeError, match="cotangent must be floating"):
        oracle.dot_product_attention_vjp(p.q, p.k, p.v, cotangent=np.full(cot.shape, "a"))
    with pytest.raises(ValueError, match="lse_cotangent"):
        oracle.dot_product_attention_vjp(
            p.q, p.k, p.v, cotangent=cot, lse_cotangent=np.zeros((1, 3))
        )
    v = p.v.copy()
    v[0, 1, 0, 0] = np.nan  # read by every query: no derivative
    for method in ("fast", "definition"):
        with pytest.raises(ValueError, match="non-finite value"):
            oracle.dot_product_attention_vjp(p.q, p.k, v, cotangent=cot, method=method)


def test_fast_oracle_memory_is_linear_in_t():
    """At T = S = 4096 with 2 heads one ``[N, T, S]`` float64 array is 256 MiB; the fast oracle
    streams over query blocks whose temporaries fit its 64 MiB budget (the inputs and outputs
    add 2 MiB), so its peak stays below half of that array (an unstreamed softmax needs at
    least the whole array)."""
    rng = np.random.default_rng(0)
    t, n, h = 4096, 2, 8
    q, k, v = (rng.standard_normal((1, t, n, h)) for _ in range(3))
    tracemalloc.start()
    oracle.dot_product_attention(q, k, v)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    full = n * t * t * 8
    assert peak < full / 2, f"peak {peak / 2**20:.1f} MiB >= half of [N, T, S] {full / 2**21:.0f}"


@given(problem=kproblems(dtypes=("float32", "bfloat16")), budget=st.sampled_from((1, 2**30)))
@scaled(0.5)
def test_streamed_bound_equals_full_bound(problem, budget):
    """``kernel_call_error_bound`` (streamed with the oracle's blocks, one query row or all of
    them per block) equals ``kernel_error_bound`` given the whole allowed set."""
    p = problem
    full = tolerance.kernel_error_bound(
        p.q,
        p.k,
        p.v,
        p.allowed(),
        p.options.get("bias"),
        scale=p.options.get("scale"),
        softcap=p.options.get("softcap"),
        masked_rows=p.masked_rows,
        dtype=p.dtype,
    )
    streamed = tolerance.kernel_call_error_bound(
        p.q, p.k, p.v, budget=budget, **p.semantics(), **p.options
    )
    for a, b in zip(full, streamed, strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-12, atol=0)


@pytest.mark.parametrize("kind", ["none", "causal", "bias", "padding"])
def test_fast_oracle_with_logits_beyond_the_shift_free_range(kind):
    """Logits up to ~1e3 (q and k scaled up): the fast path must take its shifted branch (a row
    max per row) and still equal the definition within the float64 bound."""
    cfg = ast.Config(batch=2, t=5, s=7, n=4, k=2, h=4, h_v=3, d_model=8, dtype="float64")
    p = ast.make_kernel_problem(cfg, kind, 4, scale=40.0)
    logits = np.einsum("btnh,bsnh->bnts", p.q, np.repeat(p.k, 2, axis=2)) / 2.0
    assert np.abs(logits).max() > 700  # beyond the Cauchy-Schwarz shift-free range
    out_f, lse_f = p.oracle()
    out_d, lse_d = p.oracle(method="definition")
    bound, lse_bound = p.bound()
    _assert_within(out_f, out_d, bound, f"output {p!r}")
    _assert_within(lse_f, lse_d, lse_bound, f"lse {p!r}")


# ---------------------------------------------------------------------------------------------
# Rows whose every logit lies near -1000 (issue 22). The fast path skips the max shift when its
# Cauchy-Schwarz estimate (or, per block, the row maxes) lie within (-700, 700) in *absolute*
# value; exp(-1000) = 0 in float64 (the smallest subnormal is ~e^-745), so a row near -1000 must
# be shifted or it becomes 0/0. Each case below reaches -1000 by a different term of the estimate
# (|scale|, |q||k|, |bias|), so dropping any one abs() sends some case down the unshifted road.

_FAR = dict(b=2, t=4, s=5, n=2, k=1, h=4, h_v=3)


def _far_case(case: str, masking: str) -> tuple[tuple[np.ndarray, ...], dict[str, object]]:
    """``(q, k, v, bias), kwargs`` whose logits all lie near a far centre (``case``):

    * ``"-1000"``, ``"+1000"``: ``q[..., 0] = 1``, ``k[..., 0] = -/+2000`` (scale 1/2), the other
      components O(1): every logit is the centre + O(1);
    * ``"-1000 +- 20"``: as ``"-1000"`` with ``k[..., 0]`` spread by +-40, so one row spans
      about -1020 .. -980 (no single key dominates);
    * ``"+-1000 rows"``: ``q[..., 0] = +-1`` by row, so some rows sit at +1000, others at -1000;
    * ``"bias -1000"``: small ``q . k`` (no scaling) plus a bias of -1000 + N(0, 9);
    * ``"scale < 0"``: ``scale = -1/2`` with ``k[..., 0] = +2000``: logits near -1000.

    ``masking``: ``"none"``; ``"mask"`` (a random boolean mask with one fully masked row, plus
    ``-inf`` bias entries in the bias case); ``"causal"``."""
    d = _FAR
    rng = np.random.default_rng([22, len(case), len(masking)])
    q = rng.standard_normal((d["b"], d["t"], d["n"], d["h"]))
    k = rng.standard_normal((d["b"], d["s"], d["k"], d["h"]))
    v = rng.standard_normal((d["b"], d["s"], d["k"], d["h_v"]))
    bias = None
    kw: dict[str, object] = {"scale": 0.5}
    if case == "bias -1000":
        bias = -1000.0 + 3.0 * rng.standard_normal((d["b"], d["n"], d["t"], d["s"]))
    else:
        q[..., 0] = 1.0
        k[..., 0] = 2000.0 if case in ("+1000", "+-1000 rows", "scale < 0") else -2000.0
        if case == "-1000 +- 20":
            k[..., 0] += rng.uniform(-40.0, 40.0, k.shape[:-1])
        if case == "+-1000 rows":
            q[:, 1::2, :, 0] = -1.0
        if case == "scale < 0":
            kw["scale"] = -0.5
    if masking == "mask":
        mask = rng.random((d["b"], d["n"], d["t"], d["s"])) < 0.6
        mask[..., 0] |= True  # every row keeps key 0 ...
        mask[0, 1, 2] = False  # ... but one, fully masked (output 0, lse -inf)
        kw["mask"] = mask
        if bias is not None:
            bias[..., 3] = -np.inf
    elif masking == "causal":
        kw["is_causal"] = True
    return (q, k, v, bias), kw


def _by_definition(q, k, v, bias, scale, mask=None, is_causal=False):
    """``o_i = sum_j e_ij v_j / sum_j e_ij``, ``e_ij = exp(s_ij - max_A s_i)`` over the allowed
    keys ``A`` (``mask``, causal ``j <= i``, ``bias != -inf``), ``s_ij = scale fsum_h q_ih k_jh
    + bias_ij``, ``lse_i = max_A s_i + log sum_j e_ij``; a row with no allowed key: 0, -inf.
    Written here from the definition (sums by ``math.fsum``), sharing nothing with the oracle."""
    b_size, t, n, _ = q.shape
    s_len, n_kv, h_v = k.shape[1], k.shape[2], v.shape[-1]
    out, lse = np.zeros((b_size, t, n, h_v)), np.full((b_size, t, n), -np.inf)
    for b, i, hd in np.ndindex(b_size, t, n):
        g = hd // (n // n_kv)
        logits = {}
        for j in range(s_len):
            bij = 0.0 if bias is None else float(bias[b, hd, i, j])
            if (mask is not None and not mask[b, hd, i, j]) or (is_causal and j > i):
                continue
            if bij == -np.inf:
                continue
            logits[j] = scale * math.fsum(q[b, i, hd] * k[b, j, g]) + bij
        if not logits:
            continue
        top = max(logits.values())
        e = {j: math.exp(s - top) for j, s in logits.items()}
        total = math.fsum(e.values())
        for c in range(h_v):
            out[b, i, hd, c] = math.fsum(e[j] * v[b, j, g, c] for j in e) / total
        lse[b, i, hd] = top + math.log(total)
    return out, lse


FAR_CASES = ("-1000", "+1000", "-1000 +- 20", "+-1000 rows", "bias -1000", "scale < 0")


@pytest.mark.parametrize("masking", ["none", "mask", "causal"])
def test_fast_oracle_rows_near_plus_or_minus_1000_equal_the_definition(masking):
    """Every case of :func:`_far_case`: the fast oracle's output and lse are finite (0 and -inf
    on a fully masked row) and within :func:`attnref.tolerance.kernel_call_error_bound` in
    float64 of :func:`_by_definition`. That bound is the float64 first-order bound of any
    evaluation order of these sums, counted twice; the oracle is such an evaluation, and so is
    ``_by_definition`` (its dot products are exactly rounded fsums, its exp, subtraction and
    division one rounding each, all inside the bound's ``gamma_{H+1}``, ``u |s - max s|``,
    ``C_EXP u`` and ``gamma_S`` terms), so their difference is within it. An unshifted
    ``exp(-1000)`` gives 0/0 = NaN rows and fails."""
    failures = []
    for case in FAR_CASES:
        (q, k, v, bias), kw = _far_case(case, masking)
        out, lse = oracle.dot_product_attention(q, k, v, bias, return_lse=True, **kw)
        ref, ref_lse = _by_definition(q, k, v, bias, **kw)
        bound, lse_bound = tolerance.kernel_call_error_bound(q, k, v, bias, dtype=np.float64, **kw)
        live = np.isfinite(ref_lse)
        with np.errstate(invalid="ignore"):
            bad = ~np.all(np.abs(out - ref) <= bound, axis=-1)  # [B, T, N]; True on NaN
            bad |= np.isfinite(lse) != live
            bad |= live & ~(np.abs(np.where(live, lse - ref_lse, 0.0)) <= lse_bound)
        if bad.any():
            r = tuple(int(i) for i in np.argwhere(bad)[0])
            failures.append(
                f"{case}: {bad.sum()} bad rows, first {r}: out {out[r]} vs definition "
                f"{ref[r]}, lse {lse[r]:.8g} vs {ref_lse[r]:.8g}"
            )
    assert not failures, f"masking {masking}:\n" + "\n".join(failures)
