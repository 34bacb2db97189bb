"""Extreme logits (|s| from 1e2 up to 1e4) for every softmax-family and RoPE formulation at the
weight level, and for ``masked_softmax`` on both axis conventions, in float32 and the 16-bit
formats (the kernels' own extreme-logit tests are in ``tests/test_kernel.py``).

Logits are made large on purpose by a drawn route: scaling ``W_Q, b_Q`` and ``W_K, b_K`` by the
same factor (values and outputs keep their size), or an additive bias of the drawn magnitude.
The float64 oracle, fed the rounded inputs, is the truth.

Tolerances. float32: :func:`attnref.tolerance.attention_error_bound` and
:func:`attnref.tolerance.rope_attention_error_bound`, whose logit term ``gamma_{N_s} Ls + u |s -
max s|`` grows with the logits' magnitude (checked below: the bound is finite, smaller than the
output, and grows with the logit scale). 16-bit: FlashAttention's comparative rule against the
oracle with every intermediate rounded to the format (as ``tests/test_formulations.py``); the
derived 16-bit bound is vacuous there (``K_S u16 Ls`` is hundreds at ``|s| ~ 1e4``, ``exp`` of
it overflows), and FlashAttention's comparative rule (``tests/test_formulations.py``) does not
hold either: the logits' rounding ``u16 |s|`` is of order one to tens, so which keys dominate a
row depends on the operation order, and a correct formulation's error is not within twice the
same-precision reference's (observed: up to 59 x, the patterns forms in bfloat16 at 1e4). So
16-bit outputs are checked for finiteness and against the simplex bound (:func:`_simplex_bound`).
``masked_softmax``: a bound derived below for its exact operation sequence.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from hypothesis import given, note
from hypothesis import strategies as st

import attnref
from attnref import oracle, tolerance
from attnref import strategies as ast
from attnref.oracle import _rope as rope_oracle
from attnref.testing import assert_within_bound

from . import test_rope as tr
from .helpers import scaled

SEEDS = st.integers(0, 2**31 - 1)
MAGNITUDES = st.sampled_from((1e2, 1e3, 1e4))
ROUTES = ("projections", "bias")
BUCKET = ast.WEIGHT_BUCKETS[1]  # the bucket test_formulations compiles for float32 and 16-bit
# Module-level jitted forms (same functions as test_formulations' chex variants: one compile).
SOFTMAX_FORMS = {f.id: jax.jit(f.apply) for f in attnref.formulations("softmax")}
ROPE_FORMS = {form: jax.jit(tr.APPLY[form, "interleaved"]) for form in tr.FORMS}


def _jnp_dtype(name: str) -> Any:
    return jnp.bfloat16 if name == "bfloat16" else np.dtype(name)


def _logits(p: ast.AttentionProblem) -> np.ndarray:
    """float64 logits ``[..., H, T_q, T_k]`` of the problem (unmasked, bias included)."""
    w = p.params
    q = np.einsum("...td,hde->...hte", p.x_q, w.w_q) + w.b_q[:, None, :]
    k = np.einsum("...td,hde->...hte", p.x_kv, w.w_k) + w.b_k[:, None, :]
    s = np.einsum("...hqd,...hkd->...hqk", q, k) / np.sqrt(w.w_q.shape[-1])
    return s + p.bias[..., None, :, :]


def make_extreme(
    bucket: ast.Config, kind: str, seed: int, dtype: str, magnitude: float, route: str
) -> ast.AttentionProblem:
    """A problem whose largest |logit| is ``magnitude`` (before rounding to ``dtype``)."""
    p = ast.make_attention_problem(bucket, kind, seed, np.float64)
    if route == "projections":
        w = p.params
        grow = np.sqrt(magnitude / np.abs(_logits(dataclasses.replace(p, bias=0 * p.bias))).max())
        params = dataclasses.replace(
            w, w_q=w.w_q * grow, b_q=w.b_q * grow, w_k=w.w_k * grow, b_k=w.b_k * grow
        )
        p = dataclasses.replace(p, params=params)
    else:
        bias = np.random.default_rng(seed + 1).standard_normal(p.bias.shape)
        p = dataclasses.replace(p, bias=bias * magnitude / np.abs(bias).max())
    return p.astype(_jnp_dtype(dtype))


@st.composite
def extreme_problems(draw: st.DrawFn, dtypes: tuple[str, ...], bucket: ast.Config = BUCKET):
    kind = draw(ast.mask_kinds(kinds=ast.WEIGHT_KINDS), label="mask kind")
    dtype = draw(st.sampled_from(dtypes), label="dtype")
    magnitude = draw(MAGNITUDES, label="max |logit|")
    route = draw(st.sampled_from(ROUTES), label="route to large logits")
    seed = draw(SEEDS, label="data seed")
    note(f"kind={kind} dtype={dtype} magnitude={magnitude:g} route={route} seed={seed}")
    p = make_extreme(bucket, kind, seed, dtype, magnitude, route)
    reached = np.abs(_logits(_as64(p))).max()
    assert reached >= 0.5 * magnitude, f"logits reach only {reached:.3g}"
    return p


def _as64(p: ast.AttentionProblem) -> ast.AttentionProblem:
    return p.astype(np.float64)


def _assert_bound_meaningful(bound: np.ndarray, ref: np.ndarray, label: str) -> None:
    """The derived bound is finite and below the output's own size, so the check can fail."""
    assert np.all(np.isfinite(bound)), f"{label}: the derived bound is not finite"
    assert bound.max() < np.abs(ref).max(), (
        f"{label}: bound {bound.max():.3e} >= max |output| {np.abs(ref).max():.3e} (vacuous)"
    )


def _simplex_bound(p: ast.AttentionProblem, ref: np.ndarray) -> np.ndarray:
    """``|y - oracle| <= sum_h (max_j - min_j) (x~_j W~_V[h] W_O[h])`` over the allowed keys
    ``j`` (what any weights on the probability simplex give, whatever the logits' rounding),
    plus the output chain's 16-bit rounding ``(K_Y u16 + gamma_{N_y}(u32)) (sum_h max_j G_hj +
    |b_O|)`` on the magnitudes ``G_hj = |x~_j| |W~_V[h]| |W_O[h]|`` (as in
    :mod:`attnref.tolerance`). Fully masked rows have no range: their output must be ``b_O``.
    The weakest meaningful check, for where the logits' 16-bit rounding (``u16 |s|``, tens at
    ``|s| ~ 1e4``) makes the weights themselves arbitrary."""
    w = p.params.astype(np.float64)
    x_kv = p.x_kv.astype(np.float64)
    v = np.einsum("...td,hde->...hte", x_kv, w.w_v) + w.b_v[:, None, :]
    vo = np.einsum("...hte,hed->...htd", v, w.w_o)  # [..., H, T_k, d_model]
    allowed = np.asarray(p.mask, bool) & ~np.isneginf(np.asarray(p.bias, np.float64))
    a = allowed[..., None, :, :, None]  # [..., 1, T_q, T_k, 1]
    vo = vo[..., :, None, :, :]  # [..., H, 1, T_k, d_model]
    hi = np.where(a, vo, -np.inf).max(-2)
    lo = np.where(a, vo, np.inf).min(-2)
    spread = np.where(np.isfinite(hi), hi - lo, 0.0).sum(-3)  # [..., T_q, d_model]
    # |x~_j| |W~_V[h]| |W_O[h]|: the magnitude chain of each value row (tolerance's G_hj)
    x_abs = np.abs(np.concatenate([x_kv, np.ones((*x_kv.shape[:-1], 1))], axis=-1))
    wv_abs = np.abs(np.concatenate([w.w_v, w.b_v[:, None, :]], axis=1))
    mag = np.einsum("...td,hde,hef->...htf", x_abs, wv_abs, np.abs(w.w_o))[..., :, None, :, :]
    top = np.where(a, mag, 0.0).max(-2).sum(-3)
    b = p.config
    n_y = b.s + b.d_model + b.d_v + b.n + 2
    u16 = tolerance.unit_roundoff(p.dtype)
    g = tolerance.K_Y * u16 + tolerance.gamma(n_y, tolerance.unit_roundoff(np.float32))
    return spread + g * (top + np.abs(w.b_o))


# ----------------------------------------------------------------------------- weight level


@scaled(0.5)
@given(p=extreme_problems(dtypes=("float32",)))
def test_softmax_forms_extreme_logits_float32(p):
    """Every softmax-family formulation, float32, |logit| up to 1e4: finite output within the
    derived bound of the float64 oracle (the bound itself finite and not vacuous)."""
    check_extreme_float32(p, SOFTMAX_FORMS)


def check_extreme_float32(p: ast.AttentionProblem, forms: dict[str, Any]) -> None:
    """The float32 extreme-logit property for the formulations in ``forms`` (id -> callable)."""
    ref = oracle.attention(p.params, p.x_q, p.x_kv, **p.inputs())
    bound = tolerance.attention_error_bound(p.params, p.x_q, p.x_kv, dtype=p.dtype, **p.inputs())
    _assert_bound_meaningful(bound, ref, "attention_error_bound")
    for fid, fn in forms.items():
        y = np.asarray(fn(p.params, p.x_q, p.x_kv, **p.inputs()))
        assert y.dtype == p.dtype, fid
        assert_within_bound(y, ref, bound, label=f"{fid} extreme logits")


@scaled(0.25)
@given(p=extreme_problems(dtypes=("float16", "bfloat16")))
def test_softmax_forms_extreme_logits_16bit(p):
    """Every softmax-family formulation in float16 and bfloat16, |logit| up to 1e4: finite
    output (no overflow in exp or in the row sums), within the simplex bound of the oracle
    (fully masked rows: ``b_O``). FlashAttention's comparative rule does not hold here (see the
    module docstring), and the derived 16-bit bound is vacuous."""
    ref = oracle.attention(p.params, p.x_q, p.x_kv, **p.inputs())
    bound = _simplex_bound(p, ref)
    for fid, fn in SOFTMAX_FORMS.items():
        y = np.asarray(fn(p.params, p.x_q, p.x_kv, **p.inputs()))
        assert y.dtype == p.dtype, fid
        assert_within_bound(y, ref, bound, label=f"{fid} {p.dtype} extreme (simplex bound)")


@scaled(0.5)
@given(
    p=extreme_problems(dtypes=("float32", "float16", "bfloat16"), bucket=tr.JIT_BUCKET),
    position_kind=st.sampled_from(("arange",)),
)
def test_rope_forms_extreme_logits(p, position_kind):
    """Both RoPE forms (interleaved pairs), |logit| up to 1e4. float32: within the derived RoPE
    bound (finite, not vacuous) up to |s| ~ 1e3, the simplex bound at 1e4. 16-bit: finite,
    within the simplex bound (values are not
    rotated, so it is the softmax family's). Positions ``arange`` only: at positions ~ 1e3 the
    float32 angle error ``u m theta`` times ``|q| |k|`` makes the derived bound (honestly)
    vacuous once ``|s| >~ 1e2``."""
    pq, pk = tr.make_positions(tr.JIT_BUCKET, position_kind, 0)
    kw = dict(positions_q=pq, positions_kv=pk, base=tr.BASE, convention="interleaved")
    ref = rope_oracle.rope_attention(p.params, p.x_q, p.x_kv, **kw, **p.inputs())
    bound = None
    # The derived float32 RoPE bound is vacuous at |s| ~ 1e4 (its logit term, with the pair sums
    # |q|J.|k|J and the angle errors, exceeds 1/2): there only the simplex bound applies.
    if p.dtype == np.float32 and np.abs(_logits(_as64(p))).max() <= 2e3:
        bound = tolerance.rope_attention_error_bound(
            p.params, p.x_q, p.x_kv, dtype=p.dtype, **kw, **p.inputs()
        )
        _assert_bound_meaningful(bound, ref, "rope_attention_error_bound")
    for form, fn in ROPE_FORMS.items():
        y = np.asarray(fn(p.params, p.x_q, p.x_kv, pq, pk, p.mask, p.bias))
        assert y.dtype == p.dtype, form
        assert np.all(np.isfinite(y)), f"{form} {p.dtype}: non-finite output"
        check = bound if bound is not None else _simplex_bound(p, ref)
        assert_within_bound(y, ref, check, label=f"{form} {p.dtype} extreme logits")


def test_attention_bound_grows_with_logit_magnitude():
    """The derived float32 bound is valid only because its logit term scales with |s|: from
    max |s| = 1e2 to 1e4 (same problem, projections scaled) it grows at least tenfold, and it
    stays finite and below the output's size."""
    bounds = []
    for magnitude in (1e2, 1e3, 1e4):
        p = make_extreme(BUCKET, "none", 5, "float32", magnitude, "projections")
        bound = tolerance.attention_error_bound(p.params, p.x_q, p.x_kv, dtype=p.dtype)
        _assert_bound_meaningful(bound, oracle.attention(p.params, p.x_q, p.x_kv), "bound")
        bounds.append(bound.max())
    assert bounds[0] < bounds[1] < bounds[2] and bounds[2] >= 10 * bounds[0], bounds


# ----------------------------------------------------------------------------- masked_softmax

SHAPE = (4, 6)


def _softmax_loss(logits, mask, cot, axis):
    return jnp.sum(attnref.masked_softmax(logits, mask, axis=axis) * cot)


SOFTMAX = jax.jit(attnref.masked_softmax, static_argnames="axis")
SOFTMAX_GRAD = jax.jit(jax.grad(_softmax_loss), static_argnames="axis")


@dataclasses.dataclass
class SoftmaxCase:
    logits: np.ndarray  # in the tested dtype
    mask: np.ndarray
    cot: np.ndarray
    axis: int
    dtype: Any


@st.composite
def softmax_cases(draw: st.DrawFn) -> SoftmaxCase:
    """Logits uniform in ``[-m, m]`` with ``+m`` and ``-m`` present, a random mask, a slice
    (along the softmax axis) fully masked on purpose, and a slice whose logits are all ``-m``
    plus small offsets (the max subtraction must bring them back to order one)."""
    dtype = draw(st.sampled_from(("float32", "float16", "bfloat16")), label="dtype")
    axis = draw(st.sampled_from((-1, -2)), label="axis")
    magnitude = draw(MAGNITUDES, label="max |logit|")
    seed = draw(SEEDS, label="data seed")
    n_slices = SHAPE[0] if axis == -1 else SHAPE[1]
    dead = draw(st.integers(0, n_slices - 1), label="fully masked slice")
    low = draw(st.integers(0, n_slices - 1), label="slice of logits near -m")
    note(f"dtype={dtype} axis={axis} magnitude={magnitude:g} seed={seed} dead={dead} low={low}")
    rng = np.random.default_rng(seed)
    logits = rng.uniform(-magnitude, magnitude, SHAPE)
    logits.flat[rng.integers(logits.size)] = magnitude
    logits.flat[rng.integers(logits.size)] = -magnitude
    mask = rng.random(SHAPE) < 0.8
    sl = (slice(None), low) if axis == -2 else (low, slice(None))
    logits[sl] = -magnitude + rng.uniform(0, 3, logits[sl].shape)
    mask[sl] = True
    dsl = (slice(None), dead) if axis == -2 else (dead, slice(None))
    mask[dsl] = False
    dt = _jnp_dtype(dtype)
    cot = rng.standard_normal(SHAPE).astype(dt)
    return SoftmaxCase(logits.astype(dt), mask, cot, axis, dt)


def _softmax_truth(s: np.ndarray, mask: np.ndarray, axis: int, u: float, tiny: float):
    """float64 softmax ``p`` and a bound on ``|computed - p|`` for masked_softmax's sequence:
    ``d = fl(s - top)``, ``e = fl(exp d)``, ``D = fl(sum e)``, ``p = fl(e / D)``.

    With ``r = top - s >= 0``: ``|d + r| <= u r`` and ``exp`` is within ``C_EXP u`` (plus
    ``tiny``, the format's smallest normal, for underflow), so ``|e - E| <= A = exp(-r (1 - u))
    (1 + C_EXP u) - exp(-r) + tiny`` with ``E = exp(-r)``. Then ``|D - sum E| <= B = sum A +
    gamma_{n-1} (sum E + sum A)`` and ``|p_computed - p| <= (A + p B + u (E + A)) / (sum E - B)
    + tiny``. The float64 truth's own error adds ``gamma_{n+10}(u64) p``."""
    allowed = mask
    top = np.max(np.where(allowed, s, -np.inf), axis=axis, keepdims=True)
    live = np.isfinite(top)
    r = np.where(allowed, np.where(live, top, 0.0) - s, np.inf)
    big_e = np.exp(-r)
    a = np.where(allowed, np.exp(-r * (1 - u)) * (1 + tolerance.C_EXP * u) - big_e + tiny, 0.0)
    n = s.shape[axis]
    den = big_e.sum(axis=axis, keepdims=True)
    b = a.sum(axis=axis, keepdims=True) + tolerance.gamma(n - 1, u) * (
        den + a.sum(axis=axis, keepdims=True)
    )
    p = big_e / np.where(live, den, 1.0)
    assert np.all((den - b > 0) | ~live), "the softmax bound needs sum E > B"
    bound = (a + p * b + u * (big_e + a)) / np.where(live, den - b, 1.0) + tiny * allowed
    bound = bound + tolerance.gamma(n + 10, 2.0**-53) * p
    return p, np.where(allowed, bound, 0.0)


@scaled(1.0)
@given(case=softmax_cases())
def test_masked_softmax_extreme_logits(case):
    """``masked_softmax`` in float32, float16 and bfloat16 on both axes with logits up to +-1e4:
    within the derived bound of a float64 softmax of the same (rounded) logits; masked entries
    and the fully masked slice exactly 0; the gradient of a drawn linear functional finite, zero
    on masked entries, and within a derived bound of the float64 ``p (g - <p, g>)``."""
    c = case
    u = tolerance.unit_roundoff(c.dtype)
    tiny = float(ml_dtypes.finfo(c.dtype).tiny)
    s = np.asarray(c.logits, np.float64)
    p64, bound = _softmax_truth(s, c.mask, c.axis, u, tiny)
    p = np.asarray(SOFTMAX(c.logits, c.mask, axis=c.axis))
    assert p.dtype == np.dtype(c.dtype)
    p = p.astype(np.float64)
    assert np.all(p[~c.mask] == 0.0), "masked entries (and the fully masked slice) must be 0"
    assert_within_bound(p, p64, bound, label=f"masked_softmax {np.dtype(c.dtype)} axis={c.axis}")

    g = np.asarray(SOFTMAX_GRAD(c.logits, c.mask, c.cot, axis=c.axis)).astype(np.float64)
    assert np.all(np.isfinite(g)), "gradient not finite"
    assert np.all(g[~c.mask] == 0.0), "gradient must vanish on masked entries"
    # Exact VJP: G = p (g - <p, g>). With |dp| <= bound (b): |dG| <= b (|g| + S + Bg) + p Bg
    # + gamma_{n+6}(u) (p + b)(|g| + S + Bg) + n tiny, S = <p, |g|>, Bg = <b, |g|> (the
    # backward: g / D, <g, e> / D^2, products and one subtraction; n the slice length).
    cot = c.cot.astype(np.float64)
    ax = c.axis
    n = s.shape[ax]
    want = p64 * (cot - np.sum(p64 * cot, axis=ax, keepdims=True))
    s_abs = np.sum(p64 * np.abs(cot), axis=ax, keepdims=True)
    bg = np.sum(bound * np.abs(cot), axis=ax, keepdims=True)
    scale = np.abs(cot) + s_abs + bg
    tol = bound * scale + p64 * bg + tolerance.gamma(n + 6, u) * (p64 + bound) * scale
    tol = np.where(c.mask, tol + n * tiny, 0.0)
    assert_within_bound(g, want, tol, label="masked_softmax gradient")
