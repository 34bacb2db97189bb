"""Gradients agree across formulations; ``check_grads`` passes on the concat form in float64.

Tolerance for gradients: FlashAttention's comparative rule. For each formulation F, the float32
gradient's max error against the float64 NumPy gradient oracle (``attnref.oracle.attention_vjp``,
analytic, on the same float32-rounded inputs) must be at most twice the
max error of the concat form's own float32 gradient (a same-precision reference with a different
operation order) plus a rounding floor ``gamma_{N_b}(u32) * M`` with ``M`` the largest float64
gradient entry over the whole gradient pytree (every gradient is assembled from the same
backward quantities, and ``d/db_K`` is exactly zero in exact arithmetic, so a per-array scale
would be zero). ``N_b`` is the number of terms on the longest reduction chain of the backward
pass: parameter gradients sum over every (batch, query) position, then over keys and the feature
axes, so ``N_b = prod(batch) * T_q + T_k + d_model + d_k + d_v + H``. Without that floor, a tiny
gradient array (``db_Q`` of one head has ``d_k`` entries) can have a same-precision reference
that is exact by luck, and the rule would fail a correct formulation.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given

import attnref
from attnref import oracle, tolerance
from attnref import strategies as ast
from attnref.testing import assert_comparative

from .helpers import problems, scaled

BUCKETS = ast.WEIGHT_BUCKETS


def _loss(apply, params, x_q, x_kv, mask, bias, cot):
    """A generic linear functional of the output, so every output entry gets a gradient."""
    return jnp.sum(apply(params, x_q, x_kv, mask=mask, bias=bias) * cot)


# One gradient function per formulation, built once, so jit caches are reused across examples.
_GRAD = {
    f.id: jax.grad(functools.partial(_loss, f.apply), argnums=(0, 1, 2))
    for f in attnref.formulations("softmax")
}


def _grads(fid, problem, dtype, cot, variant):
    p = problem
    return variant(_GRAD[fid])(
        p.params.astype(dtype),
        p.x_q.astype(dtype),
        p.x_kv.astype(dtype),
        p.mask,
        p.bias.astype(dtype),
        cot.astype(dtype),
    )


def _flat(grads):
    params_g, gx_q, gx_kv = grads
    named = {
        f"d/d{k}": getattr(params_g, k)
        for k in ("w_q", "w_k", "w_v", "w_o", "b_q", "b_k", "b_v", "b_o")
    }
    named.update({"d/dx_q": gx_q, "d/dx_kv": gx_kv})
    return {k: np.asarray(v, np.float64) for k, v in named.items() if v is not None}


def _oracle_grads(problem, cot):
    """The float64 NumPy gradient oracle (analytic, no autodiff) on the float32-rounded inputs
    the float32 gradients see, so only arithmetic error is compared."""
    p = problem
    p32 = p.params.astype(np.float32).astype(np.float64)
    r = lambda a: np.asarray(a, np.float32).astype(np.float64)  # noqa: E731
    g = oracle.attention_vjp(p32, r(p.x_q), r(p.x_kv), d_y=r(cot), mask=p.mask, bias=r(p.bias))
    named = {
        f"d/d{k}": g.params.get(k) for k in ("w_q", "w_k", "w_v", "w_o", "b_q", "b_k", "b_v", "b_o")
    }
    named.update({"d/dx_q": g.x_q, "d/dx_kv": g.x_kv})
    return {k: np.asarray(v, np.float64) for k, v in named.items() if v is not None}


def _check_gradients_agree(problem, variant):
    rng = np.random.default_rng(0)
    b = problem.config
    cot = rng.standard_normal((*b.batch, b.t, b.d_model))
    n_b = int(np.prod(b.batch)) * b.t + b.s + b.d_model + b.d_k + b.d_v + b.n
    g64 = _oracle_grads(problem, cot)
    g32_ref = _flat(_grads("concat", problem, np.float32, cot, variant))
    scale = max(float(np.abs(g).max()) for g in g64.values())
    for f in attnref.formulations("softmax"):
        g32 = _flat(_grads(f.id, problem, np.float32, cot, variant))
        assert g32.keys() == g64.keys()
        for name in g64:
            assert np.all(np.isfinite(g32[name])), f"{f.id} {name} not finite"
            assert_comparative(
                g32[name],
                g64[name],
                g32_ref[name],
                dtype=np.float32,
                floor_n=n_b,
                floor_magnitude=scale,
                label=f"{f.id} {name}",
            )
        # b_K cancels in the softmax: its exact gradient is zero.
        assert np.abs(g32["d/db_k"]).max() <= tolerance.gamma(n_b, 2.0**-24) * scale, f.id


KINDS = ("none", "combined", "fully_masked_row")


class GradientAgreementTest(chex.TestCase):
    @chex.variants(with_jit=True)
    @scaled(0.3)
    @given(problem=problems(dtypes=("float64",), kinds=KINDS, buckets=BUCKETS[1:2]))
    def test_gradients_agree_across_formulations(self, problem):
        _check_gradients_agree(problem, self.variant)


def test_check_grads_concat_float64():
    """Finite differences vs autodiff, forward and reverse modes, in float64."""
    p = ast.make_attention_problem(BUCKETS[1], "combined", seed=7, dtype=np.float64)
    f = attnref.get("concat").apply

    def fn(params, x_q, x_kv):
        return f(params, x_q, x_kv, mask=p.mask, bias=p.bias)

    jax.test_util.check_grads(fn, (p.params, p.x_q, p.x_kv), order=1, modes=("fwd", "rev"))


def test_fully_masked_row_gradient_is_finite_and_zero_through_softmax():
    """A fully masked query row: output b_O, gradient finite, and zero w.r.t. that query."""
    # float32: the gradients compiled for the agreement property above are reused.
    p = ast.make_attention_problem(BUCKETS[1], "none", seed=9, dtype=np.float32)
    mask = p.mask.copy()
    mask[..., 2, :] = False
    cot = np.ones((*p.config.batch, p.config.t, p.config.d_model), np.float32)
    for fm in attnref.formulations("softmax"):
        g = np.asarray(jax.jit(_GRAD[fm.id])(p.params, p.x_q, p.x_kv, mask, p.bias, cot)[1])
        assert np.all(np.isfinite(g)), fm.id
        np.testing.assert_array_equal(g[..., 2, :], 0.0, err_msg=fm.id)
