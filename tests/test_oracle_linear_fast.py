"""The fast linear-attention oracle and the linear-attention gradient oracle.

* ``method="fast"`` equals ``method="definition"`` (forward: :func:`tolerance.linear_error_bound`
  with ``dtype=float64``; gradients: twice :func:`tolerance.linear_attention_vjp_error_bound`),
  streamed in blocks of one, a few, or all queries;
* the definition's gradient equals central differences of the definition's forward along random
  directions (tolerance derived next to :func:`_check_directional`);
* the gradient oracle agrees with JAX's float64 autodiff of the quadratic forms;
* bad input (a bad ``method`` included) is refused by both methods alike.

Every map, causal or not, key padding, ``eps`` in ``{0, 1e-6, 0.5}`` and both ``eps`` policies.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, note
from hypothesis import strategies as st

import attnref
from attnref import oracle, tolerance
from attnref import strategies as ast
from attnref.oracle import _linear
from attnref.testing import assert_within_bound

from .helpers import scaled

MAPS = ("elu_plus_one", "relu", "identity", "taylor2", "favor_plus")
POLICIES = ("add", "clamp")
EPS = (0.0, 1e-6, 0.5)
U64 = tolerance.unit_roundoff(np.float64)
FIELDS = ("w_q", "w_k", "w_v", "w_o", "b_q", "b_k", "b_v", "b_o")
# Temporaries budget of the fast path: 1 byte (one query a block), 300 bytes (one to a few
# queries a block at these sizes), None (the 64 MiB default: one block).
BUDGETS = (1, 300, None)


@dataclasses.dataclass(frozen=True)
class Bucket:
    batch: tuple[int, ...]
    t_q: int
    t_k: int
    heads: int
    d_k: int
    d_v: int


# No batch dims; one batch dim; cross-attention (T_q < T_k, causal reads j <= i).
BUCKETS = (Bucket((), 4, 4, 1, 2, 3), Bucket((2,), 5, 5, 2, 3, 2), Bucket((2,), 3, 5, 2, 4, 3))


def feature_map(name: str, d_k: int, seed: int) -> Any:
    if name == "favor_plus":
        return attnref.linear.favor_plus(seed, d_k, 2 * d_k)
    return attnref.linear.FeatureMap(name)


@dataclasses.dataclass
class Problem:
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    d_y: np.ndarray
    key_mask: np.ndarray
    fm: Any
    causal: bool
    eps: float
    eps_policy: str

    def kw(self) -> dict[str, Any]:
        return dict(
            feature_map=self.fm,
            causal=self.causal,
            key_mask=self.key_mask,
            eps=self.eps,
            eps_policy=self.eps_policy,
        )


def make_problem(b: Bucket, name: str, causal: bool, padded: bool, eps: float, policy: str, seed):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((*b.batch, b.t_q, b.heads, b.d_k))
    k = rng.standard_normal((*b.batch, b.t_k, b.heads, b.d_k))
    v = rng.standard_normal((*b.batch, b.t_k, b.heads, b.d_v))
    d_y = rng.standard_normal((*b.batch, b.t_q, b.heads, b.d_v))
    lengths = rng.integers(0, b.t_k + 1, size=b.batch) if padded else np.full(b.batch, b.t_k)
    key_mask = np.arange(b.t_k) < np.asarray(lengths)[..., None]
    return Problem(q, k, v, d_y, key_mask, feature_map(name, b.d_k, seed), causal, eps, policy)


@st.composite
def problems(draw, maps=MAPS, buckets=BUCKETS):
    bucket = draw(st.sampled_from(buckets), label="bucket")
    name = draw(st.sampled_from(maps), label="feature map")
    causal = draw(st.booleans(), label="causal")
    padded = draw(st.booleans(), label="key padding")
    eps = draw(st.sampled_from(EPS), label="eps")
    policy = draw(st.sampled_from(POLICIES), label="eps_policy")
    seed = draw(st.integers(0, 2**31 - 1), label="seed")
    note(f"{bucket} {name} causal={causal} padded={padded} eps={eps} {policy} seed={seed}")
    return make_problem(bucket, name, causal, padded, eps, policy, seed)


@contextlib.contextmanager
def budget(nbytes: int | None) -> Iterator[None]:
    """The fast path's temporaries budget set to ``nbytes`` (``None``: the default)."""
    old = _linear.BUDGET_BYTES
    _linear.BUDGET_BYTES = old if nbytes is None else nbytes
    try:
        yield
    finally:
        _linear.BUDGET_BYTES = old


@dataclasses.dataclass
class MultiProblem:
    params: dict[str, np.ndarray]
    x_q: np.ndarray
    x_kv: np.ndarray | None
    d_y: np.ndarray
    kw: dict[str, Any]


# The weight-level buckets (zero, one and two batch dims) and grouped-query heads (H = 2K).
MULTI_BUCKETS = (
    *ast.WEIGHT_BUCKETS,
    ast.Config(batch=(2,), t=4, s=5, n=4, k=2, h=2, h_v=3, d_model=6),
)


@st.composite
def multi_problems(draw, maps=MAPS):
    """Weight-level problems from :data:`MULTI_BUCKETS`: self-attention (``x_kv = None``) when
    causal or drawn, key padding, biases on or off, residual or not."""
    bucket = draw(st.sampled_from(MULTI_BUCKETS), label="bucket")
    name = draw(st.sampled_from(maps), label="feature map")
    causal = draw(st.booleans(), label="causal")
    self_attention = causal or draw(st.booleans(), label="self-attention")
    bias = draw(st.booleans(), label="parameter biases")
    residual = draw(st.booleans(), label="residual")
    eps = draw(st.sampled_from(EPS), label="eps")
    policy = draw(st.sampled_from(POLICIES), label="eps_policy")
    seed = draw(st.integers(0, 2**31 - 1), label="seed")
    note(f"{bucket} {name} causal={causal} self={self_attention} bias={bias} {policy} eps={eps}")
    p = ast.make_attention_problem(bucket, "none", seed, np.float64, param_bias=bias)
    params = {n: np.asarray(a) for n in FIELDS if (a := getattr(p.params, n)) is not None}
    x_kv = None if self_attention else p.x_kv
    t_k = (p.x_q if x_kv is None else x_kv).shape[-2]
    rng = np.random.default_rng(seed)
    key_mask = np.arange(t_k) < rng.integers(0, t_k + 1, bucket.batch)[..., None]
    d_y = rng.standard_normal(p.x_q.shape)
    kw = dict(
        feature_map=feature_map(name, bucket.d_k, seed),
        causal=causal,
        key_mask=key_mask,
        eps=eps,
        eps_policy=policy,
        residual=residual,
    )
    return MultiProblem(params, p.x_q, x_kv, d_y, kw)


def _named(g: Any) -> dict[str, np.ndarray]:
    """The gradients (or bounds) of a multi-head VJP, flat by name."""
    out = {f"d/d{n}": a for n, a in g.params.items()}
    out["d/dx_q"] = g.x_q
    if g.x_kv is not None:
        out["d/dx_kv"] = g.x_kv
    return out


# ----------------------------------------------------------------------------- fast == definition


@scaled(2.0)
@given(p=problems(), nbytes=st.sampled_from(BUDGETS))
def test_fast_forward_equals_definition(p, nbytes):
    """Tolerance: ``linear_error_bound(dtype=float64)`` is a float64 form's share plus the float64
    oracle's share, each bounding one float64 evaluation of the same products in any order. The
    fast path is such an evaluation (quadratic form, FAVOR+ in log space), the definition the
    other: ``|fast - definition| <= bound``."""
    ref = oracle.linear_attention(p.q, p.k, p.v, method="definition", **p.kw())
    with budget(nbytes):
        fast = oracle.linear_attention(p.q, p.k, p.v, method="fast", **p.kw())
    assert fast.shape == ref.shape and fast.dtype == np.float64
    bound = tolerance.linear_error_bound(p.q, p.k, p.v, dtype=np.float64, **p.kw())
    assert_within_bound(fast, ref, bound, label="fast forward")
    rows = ~np.any(p.key_mask, axis=-1)  # batch elements without a readable key: exactly 0
    np.testing.assert_array_equal(fast[rows], 0.0)


@scaled(1.0)
@given(p=multi_problems())
def test_fast_multihead_forward_equals_definition(p):
    """Same projections in both methods; ``linear_multihead_error_bound(dtype=float64)`` bounds a
    float64 form against the float64 oracle, and the fast method is such a form."""
    ref = oracle.linear_multihead(p.params, p.x_q, p.x_kv, method="definition", **p.kw)
    fast = oracle.linear_multihead(p.params, p.x_q, p.x_kv, method="fast", **p.kw)
    bound = tolerance.linear_multihead_error_bound(
        p.params, p.x_q, p.x_kv, dtype=np.float64, **p.kw
    )
    assert_within_bound(fast, ref, bound, label="fast multi-head forward")


@scaled(2.0)
@given(p=problems(), nbytes=st.sampled_from(BUDGETS))
def test_fast_gradient_equals_definition(p, nbytes):
    """Each method is within ``linear_attention_vjp_error_bound`` of the exact gradient (the
    bound covers either evaluation order), so they are within twice it of each other."""
    ref = oracle.linear_attention_vjp(p.q, p.k, p.v, p.d_y, method="definition", **p.kw())
    with budget(nbytes):
        fast = oracle.linear_attention_vjp(p.q, p.k, p.v, p.d_y, method="fast", **p.kw())
    bound = tolerance.linear_attention_vjp_error_bound(p.q, p.k, p.v, p.d_y, **p.kw())
    assert isinstance(fast, oracle.LinearGrads)
    for name, a, e, b in zip("qkv", fast, ref, bound, strict=True):
        assert a.shape == getattr(p, name).shape
        assert np.all(b >= 0)
        assert_within_bound(a, e, 2 * b, label=f"d/d{name}")


@scaled(1.0)
@given(p=multi_problems())
def test_fast_multihead_gradient_equals_definition(p):
    """As above, with ``linear_multihead_vjp_error_bound``."""
    args = (p.params, p.x_q, p.x_kv)
    ref = _named(oracle.linear_multihead_vjp(*args, d_y=p.d_y, method="definition", **p.kw))
    fast = _named(oracle.linear_multihead_vjp(*args, d_y=p.d_y, method="fast", **p.kw))
    bound = _named(tolerance.linear_multihead_vjp_error_bound(*args, d_y=p.d_y, **p.kw))
    want = (
        {f"d/d{n}" for n in p.params} | {"d/dx_q"} | ({"d/dx_kv"} if p.x_kv is not None else set())
    )
    assert fast.keys() == ref.keys() == bound.keys() == want
    for name in fast:
        assert_within_bound(fast[name], ref[name], 2 * bound[name], label=name)


def test_rows_without_a_readable_key_or_denominator_have_zero_gradient():
    """relu keys all negative: ``A = 0``, ``D = 0``, output 0 and zero gradient for that batch
    element; a fully padded one likewise; both methods."""
    p = make_problem(BUCKETS[1], "relu", True, False, 0.0, "add", 7)
    p.k[0] = -np.abs(p.k[0]) - 0.1
    p.key_mask[1, :] = False
    for method in ("fast", "definition"):
        y = oracle.linear_attention(p.q, p.k, p.v, method=method, **p.kw())
        g = oracle.linear_attention_vjp(p.q, p.k, p.v, p.d_y, method=method, **p.kw())
        np.testing.assert_array_equal(y, 0.0)
        for a in g:
            np.testing.assert_array_equal(a, 0.0)


@pytest.mark.parametrize("name", MAPS)
def test_unreadable_non_finite_keys_never_reach_an_output(name):
    """Padded keys holding inf and NaN (keys and values) are skipped by the definition; the fast
    path agrees: both are within the float64 bound of the problem with those keys zeroed."""
    p = make_problem(BUCKETS[1], name, True, False, 0.5, "add", 11)
    p.key_mask[:, 3:] = False
    clean_k, clean_v = p.k.copy(), p.v.copy()
    clean_k[:, 3:], clean_v[:, 3:] = 0.0, 0.0
    p.k[:, 3:], p.v[:, 3:] = np.inf, np.nan
    p.k[0, 4] = -np.inf
    bound = tolerance.linear_error_bound(p.q, clean_k, clean_v, dtype=np.float64, **p.kw())
    ref = oracle.linear_attention(p.q, clean_k, clean_v, method="definition", **p.kw())
    for nbytes in BUDGETS:
        with budget(nbytes):
            y = oracle.linear_attention(p.q, p.k, p.v, method="fast", **p.kw())
        assert_within_bound(y, ref, bound, label=f"fast, budget {nbytes}")
    # The definition's FAVOR+ forms log A for every key before keeping the readable ones, so
    # NumPy warns about the padded ones there (the values are unaffected).
    with np.errstate(invalid="ignore", over="ignore"):
        y = oracle.linear_attention(p.q, p.k, p.v, method="definition", **p.kw())
    assert_within_bound(y, ref, bound, label="definition")


# ----------------------------------------------------------------------------- finite differences

# Step h = 2^-16 ~ 1.5e-5: the central difference's rounding error is ~ eps_f / h and its
# truncation error ~ h^2 |f'''| / 6; for the O(1) inputs here eps_f ~ 1e-14 (the forward bound)
# and |f'''| ~ 10, so h ~ (3 eps_f / |f'''|)^(1/3) ~ 1.5e-5 balances them (error ~ 1e-9, against
# directional derivatives of size ~ 1 to 10). A power of two keeps t u exact.
STEP = 2.0**-16


def _check_directional(at: Callable[[float], tuple[float, float]], vjp_dot_u: float, vjp_err):
    """``<vjp, u>`` against ``D(h) = (f(h) - f(-h)) / 2h``, ``f(t) = <d_y, F(x + t u)>``.

    ``at(t)`` returns ``f(t)`` and a bound ``e(t)`` on its rounding error. Derivation:
    ``D(h) = f'(0) + c h^2 + O(h^4)`` with the rounding ``R(h) = (e(h) + e(-h)) / 2h``; as
    ``D(2h) - D(h) = 3 c h^2 + O(h^4)`` (plus ``R(h) + R(2h)``), the truncation is at most
    ``T = (|D(2h) - D(h)| + R(h) + R(2h)) / 3``, doubled to cover the ``O(h^4)`` remainder
    (``~h^2`` times smaller at this step). So ``|D(h) - <vjp, u>| <= R(h) + 2T + vjp_err``,
    ``vjp_err = <|u|, vjp bound>``."""
    h = STEP
    (fp1, ep1), (fm1, em1), (fp2, ep2), (fm2, em2) = (at(t) for t in (h, -h, 2 * h, -2 * h))
    assume(np.isfinite([ep1, em1, ep2, em2]).all())  # the forward is determined there
    d1, d2 = (fp1 - fm1) / (2 * h), (fp2 - fm2) / (4 * h)
    r1, r2 = (ep1 + em1) / (2 * h), (ep2 + em2) / (4 * h)
    tol = r1 + 2 * (abs(d2 - d1) + r1 + r2) / 3 + vjp_err
    note(f"D(h) = {d1!r}, D(2h) = {d2!r}, <vjp, u> = {vjp_dot_u!r}, tolerance {tol:.3e}")
    assert abs(d1 - vjp_dot_u) <= tol, (
        f"directional derivative {vjp_dot_u!r} vs central difference {d1!r}: |difference| "
        f"{abs(d1 - vjp_dot_u):.3e} > tolerance {tol:.3e}"
    )


def _input_rounding(grads: list[np.ndarray], xs: list[np.ndarray], us: list[np.ndarray], t):
    """``|f(fl(x + t u)) - f(x + t u)| <= u sum |df/dx| (|x| + 2 |t u|)`` to first order: forming
    ``t u`` (exact here) and adding it to ``x`` round once each."""
    return U64 * sum(
        float(np.sum(np.abs(g) * (np.abs(x) + 2 * abs(t) * np.abs(u))))
        for g, x, u in zip(grads, xs, us, strict=True)
    )


def _kernel_sums(fm: Any, q: np.ndarray, k: np.ndarray, km: np.ndarray, causal: bool):
    """``S_i = sum_j A_ij`` over allowed keys, ``[..., T_q, H]`` (FAVOR+: the defined kernel)."""
    if fm.name == "favor_plus":
        d = q.shape[-1]
        w = np.asarray(fm.omega)
        qs, ks = q / d**0.25, k / d**0.25
        z = (qs @ w.T)[..., :, None, :, :] + (ks @ w.T)[..., None, :, :, :]  # [.., i, j, h, m]
        a = np.exp(z - 0.5 * np.sum(qs * qs, -1)[..., :, None, :, None]).mean(-1)
        a = a * np.exp(-0.5 * np.sum(ks * ks, -1))[..., None, :, :]
    else:
        fq, fk = oracle.features(fm, q, "query"), oracle.features(fm, k, "key")
        a = np.einsum("...ihm,...jhm->...ijh", fq, fk)
    allowed = km[..., None, :, None] & np.ones(a.shape, bool)
    if causal:
        allowed = allowed & np.tril(np.ones(a.shape[-3:-1], bool))[..., None]
    return np.where(allowed, a, 0.0).sum(-2)


def _smooth_path(sums_at: Callable[[float], np.ndarray], eps: float, policy: str) -> bool:
    """Whether ``f`` is smooth enough on ``|t| <= 2h`` for :func:`_check_directional` (sampled
    at ``t = 0, +-h, +-2h``; draws that fail are skipped):

    * "clamp": every row's ``S - eps`` keeps one strict sign (the gradient jumps where it
      changes);
    * every denominator ``D`` either stays exactly 0 (a row without weight) or moves by at most
      10% of ``|D(0)|``: the nearest pole of ``N / D`` is then ``>= 20 h`` away, where the
      ``O(h^4)`` remainder is ``~(h / 20 h)^2 = 1/400`` of the ``h^2`` term (signed maps can
      have denominators near 0)."""
    sums = np.stack([sums_at(t) for t in (0.0, STEP, -STEP, 2 * STEP, -2 * STEP)])
    if policy == "clamp":
        sides = np.sign(sums - eps)
        if not (np.all(sides != 0) and np.all(sides == sides[0])):
            return False
    dens = sums + eps if policy == "add" else np.maximum(sums, eps)
    zero = np.all(dens == 0, axis=0)
    return bool(np.all(zero | (np.abs(dens - dens[0]) <= 0.1 * np.abs(dens[0]))))


@scaled(1.0)
@given(p=problems(), seed=st.integers(0, 2**31 - 1))
def test_definition_gradient_matches_central_differences(p, seed):
    """Directional derivative of the definition's forward along random ``u`` against
    ``<vjp, u>`` of the definition's gradient, every map. Inputs are moved away from the maps'
    kinks (``x += sign(x) 4 h |u|``, so no component crosses 0 over ``|t| <= 2h``); draws
    across the clamp's switch or near a pole are skipped (:func:`_smooth_path`)."""
    rng = np.random.default_rng(seed)
    uq, uk, uv = (rng.standard_normal(a.shape) for a in (p.q, p.k, p.v))
    q = p.q + np.sign(p.q) * 4 * STEP * np.abs(uq)
    k = p.k + np.sign(p.k) * 4 * STEP * np.abs(uk)
    kw = p.kw()

    def sums_at(t: float) -> np.ndarray:
        return _kernel_sums(p.fm, q + t * uq, k + t * uk, p.key_mask, p.causal)

    assume(_smooth_path(sums_at, p.eps, p.eps_policy))
    g = oracle.linear_attention_vjp(q, k, p.v, p.d_y, method="definition", **kw)
    bound = tolerance.linear_attention_vjp_error_bound(q, k, p.v, p.d_y, **kw)
    us, xs = [uq, uk, uv], [q, k, p.v]
    vjp_err = sum(float(np.sum(b * np.abs(u))) for b, u in zip(bound, us, strict=True))
    assume(np.isfinite(vjp_err))

    def at(t: float) -> tuple[float, float]:
        x = [a + t * u for a, u in zip(xs, us, strict=True)]
        y = oracle.linear_attention(*x, method="definition", **kw)
        b = tolerance.linear_error_bound(*x, dtype=np.float64, **kw)
        return float(np.sum(p.d_y * y)), float(np.sum(np.abs(p.d_y) * b)) + _input_rounding(
            list(g), xs, us, t
        )

    dot = sum(float(np.sum(a * u)) for a, u in zip(g, us, strict=True))
    _check_directional(at, dot, vjp_err)


def _heads(x: np.ndarray, w: np.ndarray, b: np.ndarray | None) -> np.ndarray:
    y = np.einsum("...td,hde->...the", x, w)
    return y if b is None else y + b


@scaled(1.0)
@given(p=multi_problems(), seed=st.integers(0, 2**31 - 1))
def test_multihead_definition_gradient_matches_central_differences(p, seed):
    """As above for every parameter and input at once. The kinks are now in the projected
    ``q = x W + b`` (and ``k``): the draw is skipped unless every one of them stays away from 0
    by more than its largest change over ``|t| <= 2h``,
    ``2h (|u_x||W| + |x||u_W| + |u_b|) + 4h^2 |u_x||u_W|``, and the path is smooth
    (:func:`_smooth_path`)."""
    rng = np.random.default_rng(seed)
    u = {n: rng.standard_normal(a.shape) for n, a in p.params.items()}
    u_xq = rng.standard_normal(p.x_q.shape)
    u_xkv = None if p.x_kv is None else rng.standard_normal(p.x_kv.shape)
    kw = p.kw
    fm = kw["feature_map"]

    def point(t: float) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray | None]:
        params = {n: a + t * u[n] for n, a in p.params.items()}
        x_kv = None if p.x_kv is None else p.x_kv + t * u_xkv
        return params, p.x_q + t * u_xq, x_kv

    xkv0 = p.x_q if p.x_kv is None else p.x_kv
    uxkv0 = u_xq if u_xkv is None else u_xkv
    group = p.params["w_q"].shape[0] // p.params["w_k"].shape[0]
    kv_of = np.arange(p.params["w_q"].shape[0]) // group
    for name, x, ux in (("q", p.x_q, u_xq), ("k", xkv0, uxkv0)):
        wt, b = p.params["w_" + name], p.params.get("b_" + name)
        ub = u.get("b_" + name)
        move = 2 * STEP * (
            np.einsum("...td,hde->...the", np.abs(ux), np.abs(wt))
            + np.einsum("...td,hde->...the", np.abs(x), np.abs(u["w_" + name]))
            + (0.0 if ub is None else np.abs(ub))
        ) + 4 * STEP**2 * np.einsum("...td,hde->...the", np.abs(ux), np.abs(u["w_" + name]))
        assume(np.all(np.abs(_heads(x, wt, b)) > move))

    def sums_at(t: float) -> np.ndarray:
        params, xq, x_kv = point(t)
        xkv = xq if x_kv is None else x_kv
        q = _heads(xq, params["w_q"], params.get("b_q"))
        k = _heads(xkv, params["w_k"], params.get("b_k"))[..., kv_of, :]
        return _kernel_sums(fm, q, k, kw["key_mask"], kw["causal"])

    assume(_smooth_path(sums_at, kw["eps"], kw["eps_policy"]))
    args = (p.params, p.x_q, p.x_kv)
    g = oracle.linear_multihead_vjp(*args, d_y=p.d_y, method="definition", **kw)
    bound = tolerance.linear_multihead_vjp_error_bound(*args, d_y=p.d_y, **kw)
    names = list(p.params)
    grads = [g.params[n] for n in names] + [g.x_q] + ([] if u_xkv is None else [g.x_kv])
    bounds = [bound.params[n] for n in names] + [bound.x_q]
    bounds += [] if u_xkv is None else [bound.x_kv]
    us = [u[n] for n in names] + [u_xq] + ([] if u_xkv is None else [u_xkv])
    xs = [p.params[n] for n in names] + [p.x_q] + ([] if p.x_kv is None else [p.x_kv])
    vjp_err = sum(float(np.sum(b * np.abs(d))) for b, d in zip(bounds, us, strict=True))
    assume(np.isfinite(vjp_err))

    def at(t: float) -> tuple[float, float]:
        pt = point(t)
        y = oracle.linear_multihead(*pt, method="definition", **kw)
        b = tolerance.linear_multihead_error_bound(*pt, dtype=np.float64, **kw)
        rounding = _input_rounding(grads, xs, us, t)
        return float(np.sum(p.d_y * y)), float(np.sum(np.abs(p.d_y) * b)) + rounding

    dot = sum(float(np.sum(a * d)) for a, d in zip(grads, us, strict=True))
    _check_directional(at, dot, vjp_err)


# ----------------------------------------------------------------------------- JAX autodiff

# Tolerance: the oracle is within the bound B of the exact gradient; JAX's float64 backward of
# the quadratic form sums the same products (A_ij, their row sums, A V, dy.v, dy.y, ...) in
# another association, which the first-order bound covers too (its counts are order-free; its
# FAVOR+ exponents include the +-|w|^2/2 of the stabilised features JAX evaluates): |jax -
# oracle| <= 2 B.


@functools.cache
def _jax_kernel_grad(causal: bool, eps_policy: str) -> Callable[..., Any]:
    def loss(q, k, v, d_y, key_mask, fm, eps):
        y = attnref.linear.linear_quadratic(
            q, k, v, feature_map=fm, causal=causal, key_mask=key_mask, eps=eps,
            eps_policy=eps_policy,
        )  # fmt: skip
        return jnp.sum(y * d_y)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


@scaled(1.0)
@given(p=problems(buckets=BUCKETS[:2]))  # T_q == T_k: the quadratic form's causal mode
def test_gradient_agrees_with_jax_autodiff(p):
    with jax.enable_x64(True):
        fn = _jax_kernel_grad(p.causal, p.eps_policy)
        got = fn(p.q, p.k, p.v, p.d_y, p.key_mask, p.fm, p.eps)
    ref = oracle.linear_attention_vjp(p.q, p.k, p.v, p.d_y, **p.kw())
    bound = tolerance.linear_attention_vjp_error_bound(p.q, p.k, p.v, p.d_y, **p.kw())
    for name, a, e, b in zip("qkv", got, ref, bound, strict=True):
        assert_within_bound(np.asarray(a), e, 2 * b, label=f"jax d/d{name}")


@functools.cache
def _jax_multihead_grad(causal: bool, eps_policy: str, residual: bool, cross: bool):
    apply = attnref.get("linear_quadratic").apply

    def loss(params, x_q, x_kv, d_y, key_mask, fm, eps):
        y = apply(
            params, x_q, x_kv if cross else None, feature_map=fm, causal=causal,
            key_mask=key_mask, eps=eps, eps_policy=eps_policy, residual=residual,
        )  # fmt: skip
        return jnp.sum(y * d_y)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2) if cross else (0, 1)))


@scaled(0.5)
@given(p=multi_problems(maps=("elu_plus_one", "taylor2", "favor_plus")))
def test_multihead_gradient_agrees_with_jax_autodiff(p):
    """Smooth maps, the registry's quadratic form (a pytree of parameters, ``x_kv = None`` for
    self-attention, so both of its paths reach ``x_q``)."""
    kw = dict(p.kw)
    fm, eps = kw.pop("feature_map"), kw.pop("eps")
    cross = p.x_kv is not None
    with jax.enable_x64(True):
        fn = _jax_multihead_grad(kw["causal"], kw["eps_policy"], kw["residual"], cross)
        x_kv = p.x_kv if cross else p.x_q  # ignored when not cross
        got = fn(attnref.AttentionParams(**p.params), p.x_q, x_kv, p.d_y, kw["key_mask"], fm, eps)
    named = {f"d/d{n}": np.asarray(getattr(got[0], n)) for n in p.params}
    named["d/dx_q"] = np.asarray(got[1])
    if cross:
        named["d/dx_kv"] = np.asarray(got[2])
    args = (p.params, p.x_q, p.x_kv)
    ref = _named(oracle.linear_multihead_vjp(*args, d_y=p.d_y, **p.kw))
    bound = _named(tolerance.linear_multihead_vjp_error_bound(*args, d_y=p.d_y, **p.kw))
    assert named.keys() == ref.keys()
    for name in ref:
        assert_within_bound(named[name], ref[name], 2 * bound[name], label=f"jax {name}")


def test_relu_gradient_at_zero_follows_jax():
    """relu's step is 0 at x = 0 in both (``jax.grad(jax.nn.relu)(0.0) == 0``)."""
    p = make_problem(BUCKETS[0], "relu", False, False, 0.5, "add", 3)
    p.q[..., 0, :, 0] = 0.0
    p.k[..., 1, :, 1] = 0.0
    with jax.enable_x64(True):
        got = _jax_kernel_grad(False, "add")(p.q, p.k, p.v, p.d_y, p.key_mask, p.fm, p.eps)
    for method in ("fast", "definition"):
        ref = oracle.linear_attention_vjp(p.q, p.k, p.v, p.d_y, method=method, **p.kw())
        bound = tolerance.linear_attention_vjp_error_bound(p.q, p.k, p.v, p.d_y, **p.kw())
        assert ref.q[..., 0, :, 0] == 0.0 and ref.k[..., 1, :, 1] == 0.0
        for name, a, e, b in zip("qkv", got, ref, bound, strict=True):
            assert_within_bound(np.asarray(a), e, 2 * b, label=f"{method} d/d{name}")


# ----------------------------------------------------------------------------- bad input


@pytest.mark.usefixtures("unchecked_annotations")
def test_bad_input_is_refused_by_both_methods():
    p = make_problem(BUCKETS[1], "elu_plus_one", False, False, 0.0, "add", 0)
    mp = ast.make_attention_problem(ast.WEIGHT_BUCKETS[1], "none", 0, np.float64)
    fm = p.fm
    kernel = {
        "linear_attention": lambda **kw: oracle.linear_attention(p.q, p.k, p.v, **kw),
        "linear_attention_vjp": lambda **kw: oracle.linear_attention_vjp(
            p.q, p.k, p.v, p.d_y, **kw
        ),
        "linear_multihead": lambda **kw: oracle.linear_multihead(mp.params, mp.x_q, **kw),
        "linear_multihead_vjp": lambda **kw: oracle.linear_multihead_vjp(
            mp.params, mp.x_q, d_y=np.zeros(mp.x_q.shape), **kw
        ),
    }
    for name, call in kernel.items():
        with pytest.raises(ValueError, match=r"method must be one of \('fast', 'definition'\)"):
            call(feature_map=fm, method="vectorised")
        with pytest.raises(ValueError, match="method must be one of"):
            call(feature_map=fm, method=None)
        for method in ("fast", "definition"):
            with pytest.raises(TypeError, match="factory function elu_plus_one itself"):
                call(feature_map=attnref.linear.elu_plus_one, method=method)
            with pytest.raises(TypeError, match="causal must be a bool"):
                call(feature_map=fm, causal=1, method=method)
            with pytest.raises(ValueError, match="eps_policy must be 'add' or 'clamp'"):
                call(feature_map=fm, eps_policy="max", method=method)
            if name.startswith("linear_attention"):
                with pytest.raises(ValueError, match=r"favor_plus omega has shape \(8, 4\)"):
                    call(feature_map=attnref.linear.favor_plus(0, 4, 8), method=method)
    with pytest.raises(ValueError, match=r"d_y has shape \(2, 5, 2, 3\)"):
        oracle.linear_attention_vjp(p.q, p.k, p.v, np.zeros((2, 5, 2, 3)), feature_map=fm)
    with pytest.raises(ValueError, match="d_y has shape"):
        oracle.linear_multihead_vjp(mp.params, mp.x_q, d_y=mp.x_q[..., :2], feature_map=fm)


def test_fast_path_block_size_keeps_to_its_budget():
    """Blocks of ``per_row`` float64 temporaries fit 64 MiB, never fewer than one row."""
    budget_bytes = 64 * 2**20
    for t_q, per_row in ((10, 3), (100_000, 4096 * 64), (7, 10**9)):
        rows = _linear.block_rows(t_q, per_row)
        assert 1 <= rows <= t_q
        assert rows == 1 or rows * per_row * 8 <= budget_bytes


@pytest.mark.parametrize("planted", [np.nan, np.inf])
def test_gradient_oracles_ignore_a_key_no_query_reads(planted):
    """A key masked by ``key_mask`` passes nothing to any gradient, even NaN or inf, at the
    kernel level and through the projections: both methods give exactly the gradients of the
    same call with that key zeroed."""
    rng = np.random.default_rng(3)
    km = np.array([[True, True, True, False]])
    fm = attnref.linear.elu_plus_one()
    q, k, v = (
        rng.standard_normal((1, 3, 2, 4)),
        rng.standard_normal((1, 4, 2, 4)),
        rng.standard_normal((1, 4, 2, 3)),
    )
    dy = rng.standard_normal((1, 3, 2, 3))
    k_bad, v_bad, k_zero, v_zero = k.copy(), v.copy(), k.copy(), v.copy()
    k_bad[0, 3], v_bad[0, 3], k_zero[0, 3], v_zero[0, 3] = planted, planted, 0.0, 0.0
    params = attnref.init_params(
        2, d_model=4, num_heads=2, d_k=4, d_v=3, bias=True, dtype=np.float64
    )
    x_q, x_kv = rng.standard_normal((1, 3, 4)), rng.standard_normal((1, 4, 4))
    x_bad, x_zero = x_kv.copy(), x_kv.copy()
    x_bad[0, 3], x_zero[0, 3] = planted, 0.0
    d_model_dy = rng.standard_normal((1, 3, 4))
    for method in ("fast", "definition"):
        kw = dict(feature_map=fm, key_mask=km, method=method)
        with np.errstate(invalid="ignore", over="ignore"):
            bad = oracle.linear_attention_vjp(q, k_bad, v_bad, dy, **kw)
        for a, b in zip(bad, oracle.linear_attention_vjp(q, k_zero, v_zero, dy, **kw), strict=True):
            np.testing.assert_array_equal(a, b)
        with np.errstate(invalid="ignore", over="ignore"):
            bad_m = oracle.linear_multihead_vjp(params, x_q, x_bad, d_y=d_model_dy, **kw)
        zero_m = oracle.linear_multihead_vjp(params, x_q, x_zero, d_y=d_model_dy, **kw)
        np.testing.assert_array_equal(bad_m.x_kv, zero_m.x_kv)
        np.testing.assert_array_equal(bad_m.x_q, zero_m.x_q)
        for name, value in zero_m.params.items():
            np.testing.assert_array_equal(bad_m.params[name], value, err_msg=name)
