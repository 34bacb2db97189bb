"""The blockwise (flash) form: equal to the oracle for every block size and option, its
``custom_vjp`` backward equal to autodiff of the naive form, and temporary memory linear in T.

Tolerances: forward, :func:`attnref.tolerance.kernel_error_bound` with the number of key blocks
(each later block rescales the running sums once). Gradients: the float64 NumPy gradient oracle
(:func:`attnref.oracle.dot_product_attention_vjp`, analytic, no autodiff) is the ground truth,
and :func:`attnref.tolerance.kernel_grad_error_bound` (derived, first order, any evaluation order
of the backward, flash recomputation included) the componentwise allowance.
"""

from __future__ import annotations

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from jax.test_util import check_grads

import attnref
from attnref import strategies as ast
from attnref.costs import xla_counts

from .helpers import scaled
from .kernel_helpers import assert_kernel_close, kproblems

KBUCKETS = ast.KERNEL_BUCKETS
PROFILES = ast.STATIC_PROFILES
STATIC = (*ast.STATIC_OPTIONS, "block_q", "block_k")
BLOCKS = ((1, 1), (2, 3), (3, 2), (4, 4), (8, 8))
_BW = jax.jit(attnref.blockwise_dot_product_attention, static_argnames=STATIC)
_NAIVE = jax.jit(attnref.dot_product_attention, static_argnames=STATIC[:-2])


class BlockwiseOracleTest(chex.TestCase):
    @chex.variants(with_jit=True)
    @given(problem=kproblems(), blocks=st.sampled_from(BLOCKS))
    @scaled(1.0)
    def test_matches_oracle_for_every_block_size(self, problem, blocks):
        """Any block sizes, T and S not multiples of them, every option; lse too."""
        p = problem
        bq, bk = blocks
        out, lse = self.variant(attnref.blockwise_dot_product_attention, static_argnames=STATIC)(
            p.q, p.k, p.v, return_lse=True, block_q=bq, block_k=bk, **p.kwargs
        )
        assert out.dtype == p.dtype
        n_blocks = math.ceil(p.config.s / min(bk, p.config.s))
        assert_kernel_close(out, lse, p, f"blockwise {blocks}", key_blocks=n_blocks)

    @chex.variants(without_jit=True)
    @given(problem=kproblems(buckets=KBUCKETS[:1], profiles=PROFILES[:3]))
    @scaled(0.5)
    def test_matches_oracle_eagerly(self, problem):
        p = problem
        out, lse = self.variant(attnref.blockwise_dot_product_attention)(
            p.q, p.k, p.v, return_lse=True, block_q=2, block_k=3, **p.kwargs
        )
        assert_kernel_close(out, lse, p, "blockwise (eager)", key_blocks=3)


_FNS = {
    "naive": attnref.dot_product_attention,
    "blockwise": attnref.blockwise_dot_product_attention,
}


def _loss(which, static, q, k, v, bias, arrays, cot, cot_lse):
    """A linear functional of the output and of lse (NaN rows and -inf lse contribute 0)."""
    out, lse = _FNS[which](q, k, v, bias, return_lse=True, **dict(static), **arrays)
    out = jnp.where(jnp.isnan(out), 0.0, out)
    return jnp.sum(out * cot) + jnp.sum(jnp.where(jnp.isfinite(lse), lse * cot_lse, 0.0))


# One jitted gradient per (form, static options): compiled once, reused across examples.
_GRAD = jax.jit(jax.grad(_loss, argnums=(2, 3, 4, 5)), static_argnames=("which", "static"))


def _grads(which, static, p, dtype, bias, arrays, cot, cot_lse):
    q, k, v = (a.astype(dtype) for a in (p.q, p.k, p.v))
    b = None if bias is None else bias.astype(dtype)
    g = _GRAD(which, static, q, k, v, b, arrays, cot.astype(dtype), cot_lse.astype(dtype))
    return [np.asarray(a, np.float64) for a in g if a is not None]


def _neutral_arrays(p):
    """Every array option present (neutral values where the draw has none), so one compiled
    gradient serves each static profile whatever array options were drawn."""
    b = p.config
    kw = p.kwargs
    arrays = {
        "mask": kw.get("mask", np.ones((1, 1, b.t, b.s), bool)),
        "query_seq_lengths": kw.get("query_seq_lengths", np.full(b.batch, b.t, np.int32)),
        "key_value_seq_lengths": kw.get("key_value_seq_lengths", np.full(b.batch, b.s, np.int32)),
        "segment_ids": kw.get(
            "segment_ids",
            (np.zeros((b.batch, b.t), np.int32), np.zeros((b.batch, b.s), np.int32)),
        ),
    }
    bias = kw.get("bias")
    if bias is None or not np.all(np.isfinite(bias)):
        # -inf entries have no gradient (the masking itself is tested elsewhere)
        bias = np.zeros((1, b.n, b.t, b.s))
    # Full [B, N, T, S]: the drawn bias may broadcast over any axis; its gradient is per entry.
    return arrays, np.broadcast_to(bias, (b.batch, b.n, b.t, b.s)).astype(np.float64)


# Profiles with distinct backward paths: plain; window + softcap + NaN rows; bottom-right
# causal + softcap + uniform rows (whose gradient reaches every v row).
GRAD_PROFILES = (PROFILES[0], PROFILES[3], PROFILES[4])


@given(problem=kproblems(dtypes=("float32",), buckets=KBUCKETS[:1], profiles=GRAD_PROFILES))
@scaled(0.35)
def test_flash_backward_matches_the_gradient_oracle(problem):
    """Gradients with respect to q, k, v and the bias, through the output and lse (blocks
    2 x 3: partial tiles in both directions), of the float32 flash backward and of autodiff of
    the float32 naive form, each within the derived gradient bound of the float64 NumPy
    gradient oracle (float64 itself: ``test_check_grads_on_the_custom_vjp``)."""
    p = problem
    static = tuple(sorted(p.static.items()))
    arrays, bias = _neutral_arrays(p)
    rng = np.random.default_rng(0)
    b = p.config
    cot = rng.standard_normal((b.batch, b.t, b.n, b.h_v)).astype(np.float32)
    cot_lse = rng.standard_normal((b.batch, b.t, b.n)).astype(np.float32)
    full = p.replace(options={**p.options, **arrays, "bias": bias.astype(np.float32)})
    exact = full.oracle_vjp(cot, cot_lse)
    bound = full.grad_bound(cot, cot_lse)
    bw_static = (*static, ("block_k", 3), ("block_q", 2))
    for which, st_ in (("naive", static), ("blockwise", bw_static)):
        got = _grads(which, st_, p, np.float32, bias, arrays, cot, cot_lse)
        for name, g, e, bd in zip(("q", "k", "v", "bias"), got, exact, bound, strict=True):
            err = np.abs(g - e)
            worst = np.unravel_index(np.argmax(err - bd), err.shape)
            assert np.all(err <= bd), (
                f"{which} d/d{name}: {err[worst]:.3e} > bound {bd[worst]:.3e} at {worst}"
            )


def test_check_grads_on_the_custom_vjp():
    """JAX's numerical gradient check (first order, reverse mode) on the flash backward, with
    softcap, bias, GQA and a causal mask, in float64."""
    p = ast.make_kernel_problem(KBUCKETS[0], ("causal", "bias"), 8, np.float64)

    def f(q, k, v, bias):
        out, lse = attnref.blockwise_dot_product_attention(
            q, k, v, bias, is_causal=True, softcap=2.0, block_q=2, block_k=3, return_lse=True
        )
        return jnp.sum(jnp.sin(out)) + jnp.sum(lse)

    check_grads(f, (p.q, p.k, p.v, p.options["bias"]), order=1, modes=["rev"])


def _temp_bytes(fn, t):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, t, 2, 8)).astype(np.float32)
    k = rng.standard_normal((1, t, 2, 8)).astype(np.float32)
    return xla_counts(fn, q, k, k).temp_bytes


def test_temporary_memory_linear_in_t_for_blockwise_quadratic_for_naive():
    """Compiled temporary bytes (XLA ``memory_analysis``) from T = 64 to 256: the blockwise form
    grows with exponent about 1 (its tiles are fixed; its carries and outputs are linear), the
    naive form with exponent about 2 (the ``T x T`` logits)."""
    ts = (64, 128, 256)

    def blockwise(q, k, v):
        return attnref.blockwise_dot_product_attention(
            q, k, v, is_causal=True, block_q=16, block_k=16
        )

    def naive(q, k, v):
        return attnref.dot_product_attention(q, k, v, is_causal=True)

    slopes = {}
    for name, fn in (("blockwise", blockwise), ("naive", naive)):
        mem = [_temp_bytes(jax.jit(fn), t) for t in ts]
        slopes[name] = np.polyfit(np.log(ts), np.log(mem), 1)[0]
    assert slopes["blockwise"] <= 1.1, slopes
    assert slopes["naive"] >= 1.8, slopes
