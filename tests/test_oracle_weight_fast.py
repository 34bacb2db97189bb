"""The weight-level oracle's two methods and its gradient oracle.

1. **Fast forward.** ``method="fast"`` (vectorised, streamed over query blocks) equals
   ``method="definition"`` for ``attention``, ``head_outputs``, ``attention_weights``, ``rope``
   and ``rope_attention``. Each is one float64 computation of the same equations, so each is
   within the float64 share of the derived bound of the exact result and their difference within
   twice that share, which is what :func:`attnref.tolerance.attention_error_bound` and the RoPE
   bounds return for ``dtype=np.float64`` (the format's share plus the oracle's, both float64).
   Masks and biases are drawn in every broadcast shape of ``[..., T_q, T_k]`` (each axis full or
   1, leading axes dropped), with ``-inf`` biases, fully masked rows, grouped-query heads,
   self-attention (``x_kv=None``), an explicit scale and the residual form.
2. **Gradient oracle, fast vs definition:** within twice
   :func:`attnref.tolerance.attention_vjp_error_bound` (one float64 computation each).
3. **Gradient oracle vs finite differences** of the *definition forward* (a truth independent of
   the backward formulas), one random direction per group of inputs (all parameters at once,
   ``x_q``, ``x_kv``, ``bias``): see :func:`_check_directional`.
4. **Gradient oracle vs JAX** float64 reverse-mode autodiff of :func:`attnref.concat_attention`,
   within twice the gradient bound (its derivation covers that computation: module docstring of
   :mod:`attnref.tolerance._grad_weight`, stage 7).
5. A bad ``method`` is refused naming ``method``; the fast paths never build ``[H, T_q, T_k]``.

Every gradient comparison also checks that its tolerance resolves the gradients (a small fraction
of their magnitude), so a wrong gradient cannot pass.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import tracemalloc
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, note
from hypothesis import strategies as st

import attnref
from attnref import oracle, tolerance
from attnref import strategies as ast
from attnref.testing import assert_within_bound

from .helpers import scaled

U64 = tolerance.unit_roundoff(np.float64)
FIELDS = ("w_q", "w_k", "w_v", "w_o", "b_q", "b_k", "b_v", "b_o")
GQA_BUCKETS = (
    ast.Config(batch=(), t=4, s=4, n=3, k=1, h=2, h_v=3, d_model=6),  # multi-query, self
    ast.Config(batch=(2,), t=5, s=7, n=4, k=2, h=4, h_v=3, d_model=8),  # grouped-query, cross
)
BUCKETS = ast.WEIGHT_BUCKETS + GQA_BUCKETS  # every d_k even (RoPE)
# A gradient tolerance must be below this fraction of the largest gradient entry. The float64
# gradient bounds are ~1e-11 of it (gamma_n u64 times magnitudes |.||.| some 1e3 times the
# gradients, which cancel); RoPE's grow with the positions: the angle error e_p(m) ~ 14 u64 m
# (6e-12 at m ~ 4096) enters every weight's relative error, ~1e-9, so ~1e-6 of the gradients.
RESOLUTION = 1e-8
ROPE_RESOLUTION = 1e-5


# ----------------------------------------------------------------------------- drawn cases


@dataclasses.dataclass
class Case:
    """A weight-level problem with its mask and bias in drawn broadcast shapes."""

    problem: ast.AttentionProblem
    x_kv: np.ndarray | None  # None: self-attention
    mask: np.ndarray | None
    bias: np.ndarray | None
    scale: float | None
    residual: bool

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        """Hypothesis shows the short ``repr``, not every array."""
        printer.text(repr(self))

    def __repr__(self) -> str:
        m = None if self.mask is None else self.mask.shape
        b = None if self.bias is None else self.bias.shape
        return (
            f"Case({self.problem!r}, self={self.x_kv is None}, mask={m}, bias={b}, "
            f"scale={self.scale}, residual={self.residual})"
        )

    @property
    def args(self) -> tuple[Any, ...]:
        return (self.problem.params, self.problem.x_q, self.x_kv)

    def kwargs(self, residual: bool = True) -> dict[str, Any]:
        kw: dict[str, Any] = dict(mask=self.mask, bias=self.bias, scale=self.scale)
        return {**kw, "residual": self.residual} if residual else kw

    def cotangent(self, seed: int = 0) -> np.ndarray:
        return np.random.default_rng(seed).standard_normal(self.problem.x_q.shape)


def _broadcast(a: np.ndarray, keep: tuple[bool, ...], drop: int) -> np.ndarray:
    """``a`` with the axes not kept reduced to size 1 and up to ``drop`` leading size-1 axes
    removed (rank >= 2): an array that broadcasts back to ``a``'s shape."""
    for axis, kept in enumerate(keep):
        if not kept:
            a = a[(slice(None),) * axis + (slice(0, 1),)]
    while drop and a.ndim > 2 and a.shape[0] == 1:
        a, drop = a[0], drop - 1
    return np.ascontiguousarray(a)


@st.composite
def cases(draw: Any, buckets: tuple[ast.Config, ...] = BUCKETS) -> Case:
    configs = ast.configs(buckets=buckets, dtypes=("float64",), value_dim_differs=True)
    p = draw(ast.attention_problems(configs), label="problem")
    rank = p.mask.ndim

    def pattern(name: str) -> tuple[tuple[bool, ...], int]:
        full = st.sampled_from((True, False))  # shrinks towards the full axis
        keep = draw(st.tuples(*[full] * rank), label=f"{name}: axes kept")
        return keep, draw(st.integers(0, rank - 2), label=f"{name}: leading axes dropped")

    use_mask = draw(st.booleans(), label="mask")
    bias_kind = draw(st.sampled_from(("finite", "-inf", "none")), label="bias")
    mask = _broadcast(p.mask, *pattern("mask")) if use_mask else None
    bias = None
    if bias_kind != "none":
        full_bias = p.bias if bias_kind == "finite" else np.where(p.mask, p.bias, -np.inf)
        bias = _broadcast(full_bias, *pattern("bias"))
    shared = p.config.t == p.config.s and draw(st.booleans(), label="x_kv=None")
    scale = draw(st.sampled_from((None, 0.37)), label="scale")
    residual = draw(st.booleans(), label="residual")
    case = Case(p, None if shared else p.x_kv, mask, bias, scale, residual)
    note(repr(case))
    return case


def _positions(case: Case, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Random positions in [0, 4096): per batch element for queries, shared ``[T_k]`` for keys."""
    rng = np.random.default_rng(seed)
    c = case.problem.config
    return rng.integers(0, 4096, (*c.batch_shape, c.t)), rng.integers(0, 4096, (c.s,))


def _gqa_index(case: Case) -> np.ndarray:
    c = case.problem.config
    return np.arange(c.n) // (c.n // c.k)


# ----------------------------------------------------------------------------- forward bounds


def _head_bound(case: Case, i: int) -> np.ndarray:
    """The float64 bound of head ``i``'s output ``P_i V_i W_O[i]``: the weight-level bound of the
    one-head problem (head ``i``'s query and output weights, its key/value head, no ``b_O``)."""
    w, g = case.problem.params, int(_gqa_index(case)[i])

    def pick(name: str, j: int) -> np.ndarray | None:
        a = getattr(w, name)
        return None if a is None else np.asarray(a)[j : j + 1]

    one = {n: pick(n, i) for n in ("w_q", "w_o", "b_q")}
    one.update({n: pick(n, g) for n in ("w_k", "w_v", "b_k", "b_v")})
    return tolerance.attention_error_bound(
        one, *case.args[1:], **case.kwargs(False), dtype=np.float64
    )


def _weights_bound(case: Case, weights: np.ndarray) -> np.ndarray:
    """``rho_i p_ij``, the float64 bound of the weights (step 2 of the forward derivation, module
    docstring of :mod:`attnref.tolerance`), counted twice (both methods' shares):
    ``rho_i = exp(2 E_i) - 1 + gamma_{T_k + 2 + 2 C_EXP}`` with ``E_i = max_j (gamma_{N_s} Ls_ij
    + u |s_ij - max_j s_ij|)``, ``N_s = 2 (d_model + 1) + d_k + 2`` and ``Ls = |scale| |x~_q||W~_Q|
    |W~_K|^T |x~_kv|^T + |bias|``."""
    w, c = case.problem.params, case.problem.config
    kv = _gqa_index(case)
    x_q = case.problem.x_q
    x_kv = x_q if case.x_kv is None else case.x_kv
    scale = 1 / math.sqrt(c.d_k) if case.scale is None else case.scale

    def hom(x: np.ndarray) -> np.ndarray:
        return np.concatenate([x, np.ones((*x.shape[:-1], 1))], axis=-1)

    def heads(x: np.ndarray, wt: Any, b: Any, rows: np.ndarray, absolute: bool) -> np.ndarray:
        b = np.zeros((wt.shape[0], wt.shape[2])) if b is None else np.asarray(b)
        wh = np.concatenate([np.asarray(wt), b[:, None, :]], axis=1)[rows]
        f = np.abs if absolute else (lambda a: a)
        return np.einsum("...td,hde->...hte", f(hom(x)), f(wh))

    full = (*c.batch_shape, c.t, c.s)
    bias = np.zeros(full) if case.bias is None else np.broadcast_to(case.bias, full)
    finite = np.where(np.isneginf(bias), 0.0, bias)[..., None, :, :]
    allowed = np.broadcast_to(~np.isneginf(bias), full)
    if case.mask is not None:
        allowed = allowed & case.mask
    allowed = np.broadcast_to(allowed[..., None, :, :], weights.shape)
    q, k = heads(x_q, w.w_q, w.b_q, np.arange(c.n), False), heads(x_kv, w.w_k, w.b_k, kv, False)
    qa, ka = heads(x_q, w.w_q, w.b_q, np.arange(c.n), True), heads(x_kv, w.w_k, w.b_k, kv, True)
    s = np.einsum("...hqd,...hkd->...hqk", q, k) * scale + finite
    ls = abs(scale) * np.einsum("...hqd,...hkd->...hqk", qa, ka) + np.abs(finite)
    top = np.max(np.where(allowed, s, -np.inf), axis=-1, keepdims=True, initial=-np.inf)
    spread = np.where(allowed, np.abs(s - np.where(np.isfinite(top), top, 0.0)), 0.0)
    n_s = 2 * (c.d_model + 1) + c.d_k + 2
    e = np.where(allowed, tolerance.gamma(n_s, U64) * ls + U64 * spread, 0.0)
    e_row = np.max(e, axis=-1, keepdims=True, initial=0.0)
    rho = np.expm1(2 * e_row) + tolerance.gamma(c.s + 2 + 2 * tolerance.C_EXP, U64)
    return 2 * rho * weights


# ----------------------------------------------------------------------------- 1. forward


@scaled(1.5)
@given(case=cases())
def test_fast_forward_matches_definition(case):
    args, kw = case.args, case.kwargs()
    y_def = oracle.attention(*args, **kw, method="definition")
    y_fast = oracle.attention(*args, **kw, method="fast")
    bound = tolerance.attention_error_bound(*args, **kw, dtype=np.float64)
    assert_within_bound(y_fast, y_def, bound, label="attention")

    kw = case.kwargs(residual=False)
    h_def = oracle.head_outputs(*args, **kw, method="definition")
    h_fast = oracle.head_outputs(*args, **kw)
    h_bound = np.stack([_head_bound(case, i) for i in range(h_def.shape[-3])], axis=-3)
    assert_within_bound(h_fast, h_def, h_bound, label="head_outputs")

    p_def = oracle.attention_weights(*args, **kw, method="definition")
    p_fast = oracle.attention_weights(*args, **kw)
    assert_within_bound(p_fast, p_def, _weights_bound(case, p_def), label="attention_weights")
    dead = p_def.sum(axis=-1) == 0.0  # fully masked rows: exactly zero in both
    assert np.all(p_fast[dead] == 0.0)


@scaled(1.0)
@given(case=cases(), convention=st.sampled_from(("rotate_half", "interleaved")))
def test_fast_rope_matches_definition(case, convention):
    pq, pk = _positions(case, seed=case.problem.seed % 1000)
    kw = dict(positions_q=pq, positions_kv=pk, convention=convention, **case.kwargs())
    y_def = oracle.rope_attention(*case.args, **kw, method="definition")
    y_fast = oracle.rope_attention(*case.args, **kw)
    bound = tolerance.rope_attention_error_bound(*case.args, **kw, dtype=np.float64)
    assert_within_bound(y_fast, y_def, bound, label=f"rope_attention {convention}")

    rng = np.random.default_rng(case.problem.seed % 1000)
    x = rng.standard_normal((*case.problem.x_q.shape[:-1], 3, 2 * case.problem.config.d_k))
    for pos in (pq, pq[..., 0, :] if pq.ndim > 1 else pq):  # [..., T] and [T]
        r_def = oracle.rope(x, pos, convention=convention, base=500.0, method="definition")
        r_fast = oracle.rope(x, pos, convention=convention, base=500.0)
        r_bound = tolerance.rope_map_error_bound(
            x, pos, convention=convention, base=500.0, dtype=np.float64
        )
        assert_within_bound(r_fast, r_def, r_bound, label=f"rope {convention}")


def test_emulated_precision_runs_the_definition():
    """``emulate`` rounds the definition's own operation order, whatever ``method`` says."""
    p = ast.make_attention_problem(BUCKETS[1], "combined", seed=5, dtype=np.float64)
    args = (p.params, p.x_q, p.x_kv)
    for dt in (np.float16, np.float32):
        fast = oracle.attention(*args, **p.inputs(), emulate=dt, method="fast")
        definition = oracle.attention(*args, **p.inputs(), emulate=dt, method="definition")
        np.testing.assert_array_equal(fast, definition)


# ----------------------------------------------------------------------------- 2. gradients


def _as_dict(g: oracle.AttentionGrads) -> dict[str, np.ndarray]:
    out = {f"d/d{n}": a for n, a in g.params.items() if a is not None}
    out["d/dx_q"] = g.x_q
    if g.x_kv is not None:
        out["d/dx_kv"] = g.x_kv
    if g.bias is not None:
        out["d/dbias"] = g.bias
    return out


def _check_grads(
    actual, expected, bound, label: str, factor: float = 2.0, resolution: float = RESOLUTION
) -> None:
    """``|actual - expected| <= factor * bound`` for every gradient, the same ``None`` entries,
    and a tolerance that resolves the gradients (``resolution`` of the largest entry)."""
    a, e, b = _as_dict(actual), _as_dict(expected), _as_dict(bound)
    assert a.keys() == e.keys() == b.keys(), (a.keys(), e.keys(), b.keys())
    scale = max(float(np.abs(g).max(initial=0.0)) for g in e.values())
    for name in e:
        assert_within_bound(a[name], e[name], factor * b[name], label=f"{label} {name}")
        assert factor * float(b[name].max(initial=0.0)) <= resolution * scale, (
            f"{label} {name}: bound {b[name].max():.2e} does not resolve gradients of {scale:.2e}"
        )


def _check_zero_paths(case: Case, g: oracle.AttentionGrads, dy: np.ndarray, label: str) -> None:
    """The bias gradient is exactly zero at ``-inf`` entries; a fully masked query row gets no
    gradient through the softmax (``d/dx_q`` there is ``d_y`` in residual form, else 0)."""
    if case.bias is not None:
        assert g.bias is not None and np.all(g.bias[np.isneginf(case.bias)] == 0.0), label
    weights = oracle.attention_weights(*case.args, **case.kwargs(False), method="definition")
    dead = np.all(weights.sum(axis=-1) == 0.0, axis=-2)  # [..., T_q], every head
    if case.x_kv is not None:
        expected = dy[dead] if case.residual else np.zeros_like(dy[dead])
        np.testing.assert_array_equal(g.x_q[dead], expected, err_msg=f"{label}: dead rows")


@scaled(1.5)
@given(case=cases())
def test_gradient_fast_matches_definition(case):
    dy = case.cotangent(case.problem.seed % 997)
    kw = dict(d_y=dy, **case.kwargs())
    g_def = oracle.attention_vjp(*case.args, **kw, method="definition")
    g_fast = oracle.attention_vjp(*case.args, **kw)
    bound = tolerance.attention_vjp_error_bound(*case.args, **kw)
    _check_grads(g_fast, g_def, bound, "fast vs definition")
    for g, label in ((g_def, "definition"), (g_fast, "fast")):
        _check_zero_paths(case, g, dy, label)


@scaled(0.6)
@given(case=cases(), convention=st.sampled_from(("rotate_half", "interleaved")))
def test_rope_gradient_fast_matches_definition(case, convention):
    pq, pk = _positions(case, seed=case.problem.seed % 1000)
    dy = case.cotangent(case.problem.seed % 997)
    kw = dict(d_y=dy, positions_q=pq, positions_kv=pk, convention=convention, **case.kwargs())
    g_def = oracle.rope_attention_vjp(*case.args, **kw, method="definition")
    g_fast = oracle.rope_attention_vjp(*case.args, **kw)
    bound = tolerance.rope_attention_vjp_error_bound(*case.args, **kw)
    label = f"rope {convention} fast vs definition"
    _check_grads(g_fast, g_def, bound, label, resolution=ROPE_RESOLUTION)


# ----------------------------------------------------------------------------- 3. differences

# Central differences D(h) = (phi(z + h d) - phi(z - h d)) / 2h of phi = <d_y, definition(z)>
# along a random direction d of one input array. D(h) is off from phi'(0) by
# * truncation h^2 phi''' / 6 + O(h^4): since D(4h) - D(h) = 15 h^2 phi''' / 6 + O(h^4), it is
#   about |D(4h) - D(h)| / 15; the tolerance takes a third of it (five times the estimate; it
#   also absorbs D(4h)'s own rounding), plus the change of <g, d_eff> between the two steps,
#   and the larger of that and the same estimate one rung up divided by 16 (an estimate can
#   vanish by accident when the h^2 and h^4 terms cancel: seen at 1 in ~300 drawn cases);
# * rounding (eps(z + hd) + eps(z - hd)) / 2h with eps = sum |d_y| B + gamma_n(u64) sum |d_y y|,
#   B the float64 forward bound (attention_error_bound: it covers the definition's own error) and
#   gamma_n the inner product of n = d_y.size terms;
# * the step actually taken: z +- hd is rounded, so the gradient is dotted with
#   d_eff = (fl(z + hd) - fl(z - hd)) / 2h, and its own error is sum B_vjp |d_eff|.
# h = 2^-17 ~ u64^(1/3) balances truncation (h^2) and rounding (u / h) for inputs of order one
# and a forward bound of order u64; RoPE's looser bound (~1e-8 relative at positions ~4096)
# moves the balance to larger h. So the check runs along the ladder STEPS (ratio 4) and uses
# the step whose tolerance is smallest.
STEPS = tuple(2.0**-e for e in (17, 15, 13, 11, 9, 7, 5))
FD_RESOLUTION = 1e-5  # tolerance / sum_j |g_j| |d_eff_j| over every input (the gradient's size)


def _inputs(case: Case) -> dict[str, np.ndarray]:
    """Every differentiable input of the case, by name (present parameters, x_q, x_kv, bias)."""
    w = case.problem.params
    z = {n: np.asarray(getattr(w, n)) for n in FIELDS if getattr(w, n) is not None}
    z["x_q"] = case.problem.x_q
    if case.x_kv is not None:
        z["x_kv"] = case.x_kv
    if case.bias is not None:
        z["bias"] = case.bias
    return z


def _grad_by_name(g: oracle.AttentionGrads, name: str) -> np.ndarray:
    out = g.params[name] if name in FIELDS else getattr(g, name)
    assert out is not None, name
    return out


def _check_directional(case: Case, forward: Any, bound_of: Any, grads: Any, bounds: Any) -> None:
    """``<g, d_eff>`` equals the central difference of ``forward`` (the definition) along one
    random direction per group of inputs (every parameter at once, ``x_q``, ``x_kv``, ``bias``),
    within the tolerance derived above."""
    dy = case.cotangent(case.problem.seed % 997)
    z = _inputs(case)
    rng = np.random.default_rng(case.problem.seed % 991)

    def phi(zz: dict[str, np.ndarray]) -> tuple[float, float]:
        y = forward(zz)
        eps = np.sum(np.abs(dy) * bound_of(zz)) + tolerance.gamma(dy.size, U64) * np.sum(
            np.abs(dy * y)
        )
        return float(np.sum(dy * y)), float(eps)

    def central(d: dict[str, np.ndarray], h: float) -> tuple[float, float, dict[str, np.ndarray]]:
        zp = {n: z[n] + h * d[n] if n in d else z[n] for n in z}
        zm = {n: z[n] - h * d[n] if n in d else z[n] for n in z}
        (fp, ep), (fm, em) = phi(zp), phi(zm)
        d_eff = {}
        for n in d:  # 0 at -inf bias entries (never perturbed)
            d_eff[n] = np.zeros(z[n].shape)
            np.subtract(zp[n], zm[n], out=d_eff[n], where=np.isfinite(z[n]))
            d_eff[n] /= 2 * h
        return (fp - fm) / (2 * h), (ep + em) / (2 * h), d_eff

    def dot(g: Any, d: dict[str, np.ndarray], f: Any = lambda a: a) -> float:
        return float(sum(np.sum(f(_grad_by_name(g, n) * d[n])) for n in d))

    groups = [tuple(n for n in FIELDS if n in z)] + [
        (n,) for n in ("x_q", "x_kv", "bias") if n in z
    ]
    rows, magnitude = [], 0.0
    for group in groups:
        d = {n: np.where(np.isfinite(z[n]), rng.standard_normal(z[n].shape), 0.0) for n in group}
        diffs = [central(d, h) for h in STEPS]
        # truncation at step h, estimated twice: from (h, 4h) and, scaled by 1/16 (h^2), from
        # (4h, 16h); the larger is used, so that an estimate that vanishes by accident (the h^2
        # and h^4 terms cancelling) cannot pick a step whose error it does not cover
        pairs = list(itertools.pairwise(diffs))
        est = [
            abs(d4 - d1) / 3 + abs(dot(grads, e4) - dot(grads, e1))
            for (d1, _, e1), (d4, _, e4) in pairs
        ]
        best: tuple[float, float, float] | None = None
        for i, ((d1, r1, e1), _) in enumerate(pairs[:-1]):
            gd = dot(grads, e1)
            trunc = max(est[i], est[i + 1] / 16)
            tol = trunc + r1 + dot(bounds, e1, np.abs)
            if best is None or tol < best[2]:
                best = (gd, d1, tol)
        assert best is not None
        magnitude += dot(grads, diffs[0][2], np.abs)
        rows.append(("/".join(group), *best))
    for name, gd, d1, tol in rows:
        assert abs(gd - d1) <= tol, (
            f"d/d{name}: <grad, d> = {gd:.12e}, central difference {d1:.12e}, "
            f"|diff| {abs(gd - d1):.3e} > tolerance {tol:.3e}"
        )
        assert tol <= FD_RESOLUTION * magnitude, (
            f"d/d{name}: tolerance {tol:.2e} does not resolve the gradient ({magnitude:.2e})"
        )


def _params_of(zz: dict[str, np.ndarray]) -> dict[str, np.ndarray | None]:
    return {n: zz.get(n) for n in FIELDS}


@scaled(0.6)
@given(case=cases())
def test_gradient_definition_matches_finite_differences(case):
    kw = case.kwargs()
    shared = case.x_kv is None

    def inputs(zz: dict[str, np.ndarray]) -> tuple[Any, ...]:
        return _params_of(zz), zz["x_q"], None if shared else zz["x_kv"]

    def forward(zz: dict[str, np.ndarray]) -> np.ndarray:
        return oracle.attention(*inputs(zz), **{**kw, "bias": zz.get("bias")}, method="definition")

    def bound_of(zz: dict[str, np.ndarray]) -> np.ndarray:
        return tolerance.attention_error_bound(
            *inputs(zz), **{**kw, "bias": zz.get("bias")}, dtype=np.float64
        )

    dy = case.cotangent(case.problem.seed % 997)
    grads = oracle.attention_vjp(*case.args, d_y=dy, **kw, method="definition")
    bounds = tolerance.attention_vjp_error_bound(*case.args, d_y=dy, **kw)
    _check_directional(case, forward, bound_of, grads, bounds)


@scaled(0.3)
@given(case=cases(), convention=st.sampled_from(("rotate_half", "interleaved")))
def test_rope_gradient_definition_matches_finite_differences(case, convention):
    pq, pk = _positions(case, seed=case.problem.seed % 1000)
    kw = dict(positions_q=pq, positions_kv=pk, convention=convention, **case.kwargs())
    shared = case.x_kv is None

    def inputs(zz: dict[str, np.ndarray]) -> tuple[Any, ...]:
        return _params_of(zz), zz["x_q"], None if shared else zz["x_kv"]

    def forward(zz: dict[str, np.ndarray]) -> np.ndarray:
        return oracle.rope_attention(
            *inputs(zz), **{**kw, "bias": zz.get("bias")}, method="definition"
        )

    def bound_of(zz: dict[str, np.ndarray]) -> np.ndarray:
        return tolerance.rope_attention_error_bound(
            *inputs(zz), **{**kw, "bias": zz.get("bias")}, dtype=np.float64
        )

    dy = case.cotangent(case.problem.seed % 997)
    grads = oracle.rope_attention_vjp(*case.args, d_y=dy, **kw, method="definition")
    bounds = tolerance.rope_attention_vjp_error_bound(*case.args, d_y=dy, **kw)
    _check_directional(case, forward, bound_of, grads, bounds)


# ----------------------------------------------------------------------------- 4. JAX


def _loss(params, x_q, x_kv, mask, bias, dy, scale, residual):
    """``<d_y, concat_attention(...)>``; ``x_kv = None`` is self-attention."""
    y = attnref.concat_attention(
        params, x_q, x_kv, mask=mask, bias=bias, scale=scale, residual=residual
    )
    return jnp.sum(y * dy)


# One compiled gradient for every case (scale and residual static; None inputs change the
# pytree structure and so the trace, as do the drawn mask and bias shapes).
_JAX_GRAD = jax.jit(jax.grad(_loss, argnums=(0, 1, 2, 4)), static_argnames=("scale", "residual"))


def _jax_grads(case: Case, dy: np.ndarray) -> oracle.AttentionGrads:
    """``jax.grad`` of ``<d_y, concat_attention(...)>`` in float64, as :class:`AttentionGrads`."""
    gp, gx, gkv, gb = _JAX_GRAD(
        case.problem.params,
        case.problem.x_q,
        case.x_kv,
        case.mask,
        case.bias,
        dy,
        scale=case.scale,
        residual=case.residual,
    )
    params = {n: None if getattr(gp, n) is None else np.asarray(getattr(gp, n)) for n in FIELDS}
    return oracle.AttentionGrads(
        params,
        np.asarray(gx),
        None if gkv is None else np.asarray(gkv),
        None if gb is None else np.asarray(gb),
    )


@scaled(0.5)
@given(case=cases(buckets=(ast.WEIGHT_BUCKETS[1], GQA_BUCKETS[0])))
def test_gradient_definition_matches_jax_autodiff(case):
    dy = case.cotangent(case.problem.seed % 997)
    kw = dict(d_y=dy, **case.kwargs())
    g_def = oracle.attention_vjp(*case.args, **kw, method="definition")
    bound = tolerance.attention_vjp_error_bound(*case.args, **kw)
    with jax.enable_x64(True):  # float64 JAX arrays, also when this test runs on its own
        g_jax = _jax_grads(case, dy)
    _check_grads(g_jax, g_def, bound, "jax vs definition")


# ----------------------------------------------------------------------------- 5. refusals, memory


def _small_case() -> tuple[tuple[Any, ...], np.ndarray]:
    """Arguments of a valid call and a valid cotangent."""
    p = ast.make_attention_problem(BUCKETS[1], "causal", seed=9, dtype=np.float64)
    return (p.params, p.x_q, p.x_kv), np.zeros(p.x_q.shape)


@pytest.mark.parametrize("method", ["Fast", "exact", "", None, 1])
def test_bad_method_is_refused(unchecked_annotations, method):
    args, dy = _small_case()
    x = np.zeros((2, 3, 1, 4))
    calls = {
        "attention": lambda: oracle.attention(*args, method=method),
        "attention_weights": lambda: oracle.attention_weights(*args, method=method),
        "head_outputs": lambda: oracle.head_outputs(*args, method=method),
        "rope": lambda: oracle.rope(x, np.arange(3), method=method),
        "rope_attention": lambda: oracle.rope_attention(*args, method=method),
        "attention_vjp": lambda: oracle.attention_vjp(*args, d_y=dy, method=method),
        "rope_attention_vjp": lambda: oracle.rope_attention_vjp(*args, d_y=dy, method=method),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError, match="method") as info:
            call()
        assert repr(method) in str(info.value), name


def test_bad_cotangent_is_refused(unchecked_annotations):
    args, dy = _small_case()
    for vjp in (oracle.attention_vjp, oracle.rope_attention_vjp):
        for method in ("fast", "definition"):
            with pytest.raises(ValueError, match="d_y"):
                vjp(*args, d_y=dy[..., :-1], method=method)
            with pytest.raises(ValueError, match="d_y"):
                vjp(*args, d_y=None, method=method)
            with pytest.raises(TypeError, match="d_y"):
                vjp(*args, d_y=dy.astype(np.int64), method=method)


def test_fast_paths_never_build_every_query_row():
    """At T_q = T_k = 2048, H = 2 the weights of all queries take H T_q T_k 8 bytes = 64 MiB;
    the fast forward and gradient stream over query blocks, so their peak traced allocation
    (NumPy reports its buffers to tracemalloc) stays below half of that."""
    t, n_heads, d_model = 2048, 2, 32
    p = attnref.init_params(
        0, d_model=d_model, num_heads=n_heads, d_k=16, bias=True, dtype=np.float64
    )
    rng = np.random.default_rng(0)
    x, dy = rng.standard_normal((t, d_model)), rng.standard_normal((t, d_model))
    mask = np.tril(np.ones((t, t), dtype=bool))
    full = n_heads * t * t * 8
    runs = {
        "attention": lambda: oracle.attention(p, x, mask=mask),
        "attention_vjp": lambda: oracle.attention_vjp(p, x, d_y=dy, mask=mask),
    }
    for name, run in runs.items():
        tracemalloc.start()
        try:
            run()
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < full / 2, f"{name}: peak {peak / 2**20:.1f} MiB, full {full / 2**20:.0f} MiB"


@pytest.mark.parametrize("planted", [np.nan, np.inf, -np.inf])
def test_fast_paths_skip_what_a_query_cannot_read(planted):
    """A masked key/value token holding NaN or inf reaches no output of the fast paths, as in
    the definition (which skips keys of weight 0); an allowed one poisons exactly its rows."""
    p = attnref.init_params(0, d_model=4, num_heads=2, d_k=2, d_v=2, dtype=np.float64)
    x = np.random.default_rng(0).standard_normal((2, 3, 4))
    mask = np.ones((2, 3, 3), bool)
    mask[0, :, 2] = False  # batch 0: token 2 is masked for every query
    x_kv = x.copy()
    x_kv[:, 2] = planted  # batch 1 reads it
    # batch 0 must equal the same call with the masked token zeroed, within the float64 bound
    # (both sides float64: the bound's float64 term counted twice covers their difference)
    clean = x_kv[:1].copy()
    clean[:, 2] = 0.0
    bound = tolerance.attention_error_bound(p, x[:1], clean, mask=mask[:1], dtype=np.float64)
    for fn in (oracle.attention, oracle.rope_attention):
        with np.errstate(invalid="ignore", over="ignore"):
            fast = fn(p, x, x_kv, mask=mask)
            slow = fn(p, x, x_kv, mask=mask, method="definition")
        np.testing.assert_array_equal(np.isnan(fast), np.isnan(slow))
        assert np.all(np.isfinite(fast[0])), fn.__name__
        if fn is oracle.attention:
            assert np.all(np.abs(fast[:1] - fn(p, x[:1], clean, mask=mask[:1])) <= bound)
    with np.errstate(invalid="ignore", over="ignore"):
        heads = oracle.head_outputs(p, x, x_kv, mask=mask)
    assert np.all(np.isfinite(heads[0]))


@pytest.mark.parametrize("planted", [np.nan, np.inf])
def test_gradient_oracle_ignores_a_token_no_query_reads(planted):
    """A key/value token masked for every query passes nothing to any gradient, even NaN or inf:
    both methods give exactly the gradients of the same call with that token zeroed."""
    p = attnref.init_params(1, d_model=4, num_heads=2, d_k=2, d_v=2, bias=True, dtype=np.float64)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 3, 4))
    x_kv = rng.standard_normal((2, 4, 4))
    mask = np.ones((2, 3, 4), bool)
    mask[1, :, 3] = False  # batch 1: token 3 is never read
    bad, zero = x_kv.copy(), x_kv.copy()
    bad[1, 3], zero[1, 3] = planted, 0.0
    dy = rng.standard_normal((2, 3, 4))
    for fn in (oracle.attention_vjp, oracle.rope_attention_vjp):
        for method in ("fast", "definition"):
            g_bad = fn(p, x, bad, d_y=dy, mask=mask, method=method)
            g_zero = fn(p, x, zero, d_y=dy, mask=mask, method=method)
            np.testing.assert_array_equal(g_bad.x_kv, g_zero.x_kv)
            np.testing.assert_array_equal(g_bad.x_q, g_zero.x_q)
            for name, value in g_zero.params.items():
                np.testing.assert_array_equal(g_bad.params[name], value, err_msg=name)
            assert np.all(g_zero.x_kv[1, 3] == 0.0)
