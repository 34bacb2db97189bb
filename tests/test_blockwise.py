"""The blockwise (flash) form: equal to the oracle for every block size and option, its
``custom_vjp`` backward equal to autodiff of the naive form, and temporary memory linear in T.

Tolerances: forward, :func:`attnref.tolerance.kernel_error_bound` with the number of key blocks
(each later block rescales the running sums once). Gradients: the float64 NumPy gradient oracle
(:func:`attnref.oracle.dot_product_attention_vjp`, analytic, no autodiff) is the ground truth,
and :func:`attnref.tolerance.kernel_grad_error_bound` (derived, first order, any evaluation order
of the backward, flash recomputation included) the componentwise allowance. The same bounds
judge a hidden key whose logit is 1000 above the rest (issue 22), which a row max over masked
logits would turn into 0/0 rows.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.test_util import check_grads

import attnref
from attnref import oracle, tolerance
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
        for name, g, e, bd in zip(("q", "k", "v", "bias"), got, exact[:4], bound[:4], strict=True):
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


# ---------------------------------------------------------------------------------------------
# A masked logit far above the allowed ones must not enter the row max (issue 22).
#
# Every online or masked softmax keeps a row max ``m`` and weighs key ``j`` by ``exp(s_ij - m)``.
# If ``m`` were taken over the masked logits too, a masked key whose logit is ``D`` above every
# allowed one would give every allowed key ``exp(-D)``: at ``D ~ 1000`` that is 0 in float32 (and
# in float64), so the row sum is 0 and the row is 0/0 or 0 with ``lse = -inf``. With an ordinary
# masked logit the same bug only moves the row by rounding (~1e-7), which is all the bitwise
# masked-content tests can see; here the damage is total. Shapes: B = 2, T = S = 6, N = 2 query
# heads on K = 1 key/value head, H = 4, H_v = 3, float32.

_HOT_LOGIT = 1000.0  # the hidden key's logit lies about this far above every allowed one
_HOT_SHAPE = dict(b=2, t=6, n=2, k=1, h=4, h_v=3)
_SPLIT = jax.jit(
    attnref.split_kv_dot_product_attention, static_argnames=(*ast.STATIC_OPTIONS, "num_splits")
)
# Every kernel-level form with a row max, and its number of key tiles (``key_blocks`` of the
# bound; ``None``: any order). The flash form's running max (tiles 2 x 3: the hidden key shares
# the first or the last key tile with allowed keys; causal rows 0-2 meet it in a key tile they
# may not read at all); the naive kernel's one masked max (also behind ``attnref.cache_attend``
# and the ``kv_cache`` entry); split-KV (the naive max per split of 2 keys, then the merge's max
# over the splits' ``lse``).
_HOT_KERNELS = {
    "blockwise 2x3": (functools.partial(_BW, block_q=2, block_k=3), 2),
    "naive": (_NAIVE, 1),
    "split_kv 3": (functools.partial(_SPLIT, num_splits=3), None),
}


def _hot_problem(hot: int) -> tuple[np.ndarray, ...]:
    """``q, k, v`` (ordinary content) and ``k_hot, v_hot``: the same with key ``hot`` replaced by
    one whose logit is ``_HOT_LOGIT`` for every query of every head (``q[..., 0] = 1`` and
    ``k_hot[hot] = 2 _HOT_LOGIT e_0``, ``scale = 1/sqrt(4)``), while every other ``|s_ij| <=
    |q_i| |k_j| / 2`` is a few units; its value is 100, so any weight leaking to it shows."""
    rng = np.random.default_rng(22)
    d = _HOT_SHAPE
    q = rng.standard_normal((d["b"], d["t"], d["n"], d["h"])).astype(np.float32)
    q[..., 0] = 1.0
    k = rng.standard_normal((d["b"], d["t"], d["k"], d["h"])).astype(np.float32)
    v = rng.standard_normal((d["b"], d["t"], d["k"], d["h_v"])).astype(np.float32)
    k_hot, v_hot = k.copy(), v.copy()
    k_hot[:, hot] = 0.0
    k_hot[:, hot, :, 0] = 2 * _HOT_LOGIT
    v_hot[:, hot] = 100.0
    return q, k, v, k_hot, v_hot


def _hot_route(route: str) -> tuple[int, dict[str, Any], np.ndarray]:
    """One way of hiding a key: ``(hot, kernel arguments, rows [B, T] that cannot read it)``.
    Every array argument is present in every route (neutral where unused), so each kernel
    compiles once per ``is_causal``."""
    b, t = _HOT_SHAPE["b"], _HOT_SHAPE["t"]
    kw: dict[str, Any] = {
        "bias": np.zeros((1, 1, t, t), np.float32),
        "mask": np.ones((1, 1, t, t), bool),
        "key_value_seq_lengths": np.full(b, t, np.int32),
        "is_causal": False,
    }
    unread = np.ones((b, t), bool)
    if route == "mask":
        hot = 2  # the end of the first key tile of 3
        kw["mask"] = kw["mask"].copy()
        kw["mask"][..., hot] = False
    elif route == "-inf bias":  # the logit itself becomes -inf, so even a max over every
        hot = 4  # logit ignores it: this route guards the bias path; the max bug dies on the rest
        kw["bias"] = np.random.default_rng(7).standard_normal((1, 1, t, t)).astype(np.float32)
        kw["bias"][..., hot] = -np.inf
    elif route == "causal":
        hot = t - 1  # a future key for rows 0..4; row 5 reads it (weight ~1)
        kw["is_causal"] = True
        unread = np.broadcast_to(np.arange(t) < hot, (b, t))
    else:  # key padding: lengths 4 and 5, so key 5 is padding in both batch rows
        hot = t - 1
        kw["key_value_seq_lengths"] = np.array([4, 5], np.int32)
    return hot, kw, unread


HOT_ROUTES = ("mask", "-inf bias", "causal", "kv padding")


@pytest.mark.parametrize("route", HOT_ROUTES)
def test_a_masked_logit_1000_above_the_rest_leaves_output_and_lse_unchanged(route):
    """Key ``j`` hidden (by ``route``) with a logit about 1000 above every allowed logit, in each
    form with a row max: (1) the rows that cannot read ``j`` equal, bit for bit, the call with
    ``j``'s ordinary content (a hidden key enters neither the max nor the sums, and the same
    compiled program does the same arithmetic); (2) output and ``lse`` are finite and within the
    derived float32 bound (:func:`attnref.tolerance.kernel_call_error_bound`, ``key_blocks`` =
    the form's key tiles) of the float64 oracle. A max over masked logits makes those rows 0/0
    (NaN) or 0 with ``lse = -inf``: every check fails. Failures are collected over the forms."""
    hot, kw, unread = _hot_route(route)
    q, k, v, k_hot, v_hot = _hot_problem(hot)
    ref, ref_lse = oracle.dot_product_attention(q, k_hot, v_hot, return_lse=True, **kw)
    failures = []
    for name, (fn, key_blocks) in _HOT_KERNELS.items():
        bound, lse_bound = tolerance.kernel_call_error_bound(
            q, k_hot, v_hot, dtype=np.float32, key_blocks=key_blocks, **kw
        )
        out, lse = (np.asarray(a, np.float64) for a in fn(q, k_hot, v_hot, return_lse=True, **kw))
        plain, plain_lse = (np.asarray(a, np.float64) for a in fn(q, k, v, return_lse=True, **kw))
        if not (
            np.array_equal(out[unread], plain[unread])
            and np.array_equal(lse[unread], plain_lse[unread])
        ):
            failures.append(f"{name}: rows that cannot read key {hot} changed with its content")
        ok_out = np.abs(out - ref) <= bound  # False on NaN
        ok_lse = np.abs(lse - ref_lse) <= lse_bound
        if not (ok_out.all() and ok_lse.all()):
            r = tuple(int(i) for i in np.argwhere(~ok_out.all(axis=-1) | ~ok_lse)[0])  # b, t, n
            failures.append(
                f"{name}: off the float64 oracle beyond the bound, first at row {r}: out "
                f"{out[r]} vs {ref[r]}, lse {lse[r]:.6g} vs {ref_lse[r]:.6g}"
            )
    assert not failures, f"{route}:\n" + "\n".join(failures)


@pytest.mark.parametrize("route", HOT_ROUTES)
def test_a_masked_logit_1000_above_the_rest_leaves_the_gradients_right(route):
    """The gradients with respect to ``q``, ``k``, ``v`` and the bias of ``sum(c . o) + sum(c'
    lse)`` for the problem above, through the flash backward (blocks 2 x 3), are within the
    derived float32 gradient bound (:func:`attnref.tolerance.kernel_grad_error_bound`) of the
    float64 gradient oracle. A max over masked logits zeroes the forward's rows (``lse =
    -inf``), and the backward, which recomputes ``p = exp(s - lse)``, gives them no gradient."""
    hot, kw, _ = _hot_route(route)
    q, _, _, k, v = _hot_problem(hot)
    kw = dict(kw)
    bias, causal = kw.pop("bias"), kw.pop("is_causal")
    rng = np.random.default_rng(5)
    cot = rng.standard_normal(q.shape[:3] + v.shape[-1:]).astype(np.float32)
    cot_lse = rng.standard_normal(q.shape[:3]).astype(np.float32)
    exact = oracle.dot_product_attention_vjp(
        q, k, v, bias, is_causal=causal, cotangent=cot, lse_cotangent=cot_lse, **kw
    )
    bound = tolerance.kernel_grad_error_bound(
        q, k, v, bias, is_causal=causal, cotangent=cot, lse_cotangent=cot_lse, **kw
    )
    static = (("block_k", 3), ("block_q", 2), ("is_causal", causal))
    got = _GRAD("blockwise", static, q, k, v, bias, kw, cot, cot_lse)
    failures = []
    for name, g, e, bd in zip(("q", "k", "v", "bias"), got, exact[:4], bound[:4], strict=True):
        g = np.asarray(g, np.float64)
        err = np.abs(g - e)
        if not np.all(err <= bd):  # False on NaN
            i = tuple(int(j) for j in np.argwhere(~(err <= bd))[0])
            failures.append(f"d/d{name} at {i}: {g[i]:.6g} vs oracle {e[i]:.6g}")
    assert not failures, f"{route}:\n" + "\n".join(failures)
