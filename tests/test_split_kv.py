"""Split-KV (flash-decoding) attention: equal to the oracle for every number of splits (splits
that do not divide ``S``, more splits than keys, no keys), every kernel option and dtype, with
gradients equal to the gradient oracle, masked non-finite keys kept out of both, single-query
decoding against a long cache, its row form and cost model, and its refusals.

Tolerances (derived, nothing hand-picked):

* Forward. The kernel computes each split's state with the naive kernel on that split's keys (in
  the compute dtype) and merges the ``P`` states in one stacked merge, so its bound is
  :func:`attnref.tolerance.pieces_error_bound` (the kernel's splits of ``ceil(S / P)`` keys,
  ``key_blocks=1``, ``tree="stack"``): each split's
  :func:`attnref.tolerance.kernel_call_error_bound` carried as the pieces' errors through
  :func:`attnref.tolerance.merge_error_bound`, plus the whole call's float64 oracle error; fully
  masked rows under ``"uniform"`` (the mean of ``v``) take the whole call's kernel bound, and
  16-bit outputs add the final cast's ``u_16 (|o| + bound)``. (The kernel bound with
  ``key_blocks=P`` models an online softmax, whose rescaling never stores a partial ``lse``; the
  merge stores each split's ``lse = top + log l`` before forming its weight, a shift of
  ``u |lse_p|`` that the merge bound lists and the online-softmax model does not.)
* Gradients: :func:`attnref.tolerance.kernel_grad_error_bound` (first order, any tiling of the
  keys and any evaluation order of the backward equations) against
  :func:`attnref.oracle.dot_product_attention_vjp`.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import attnref
from attnref import split_kv_attention, split_kv_dot_product_attention, tolerance
from attnref import strategies as ast
from attnref.costs import Dims, xla_counts
from attnref.testing import assert_ratio_within

from .helpers import check_formulation, problems, scaled
from .kernel_helpers import kproblems

KBUCKETS = ast.KERNEL_BUCKETS
PROFILES = ast.STATIC_PROFILES
STATIC = (*ast.STATIC_OPTIONS, "num_splits")
SPLITS = (1, 2, 3, 5)  # 2 and 3 do not divide S = 7; 5 exceeds S = 4 (whole splits of padding)
_SPLIT_KV = jax.jit(split_kv_dot_product_attention, static_argnames=STATIC)


# ----------------------------------------------------------------------------- the bound


def split_kv_bound(p: ast.KernelProblem, num_splits: int) -> tuple[np.ndarray, np.ndarray]:
    """Bounds on ``|o - oracle|`` and ``|lse - oracle lse|`` of the split-KV kernel (module
    docstring): :func:`attnref.tolerance.pieces_error_bound` with the kernel's own splits
    (``P`` runs of ``ceil(S / P)`` keys; a split of padding alone is an empty state, merged), each a
    full softmax (``key_blocks=1``) with its state in the compute dtype, merged in one stacked
    merge."""
    s = p.config.s
    ids = np.full(s, -1)
    c = -(-s // num_splits)  # the kernel's splits: keys p c .. p c + c - 1
    for split in range(num_splits):
        ids[split * c : (split + 1) * c] = split
    return tolerance.pieces_error_bound(
        p.q,
        p.k,
        p.v,
        pieces=ids,
        num_pieces=num_splits,
        tree="stack",
        key_blocks=1,
        **p.semantics(),
        **p.options,
    )


def assert_split_close(out, lse, p: ast.KernelProblem, num_splits: int, label: str) -> None:
    """``out`` and ``lse`` within :func:`split_kv_bound` of the oracle; NaN and ``-inf``
    exactly where the oracle has them."""
    ref, ref_lse = p.oracle()
    bound, lse_bound = split_kv_bound(p, num_splits)
    out, lse = np.asarray(out, np.float64), np.asarray(lse, np.float64)
    nan_ref = np.isnan(ref)
    np.testing.assert_array_equal(np.isnan(out), nan_ref, err_msg=f"{label}: NaN pattern")
    err = np.abs(np.where(nan_ref, 0.0, out - np.where(nan_ref, 0.0, ref)))
    assert_ratio_within(
        err,
        np.where(nan_ref, 0.0, bound),
        f"{label}: |out - oracle| = {{error:.3e}} > bound {{allowed:.3e}} at {{index}}",
    )
    inf_ref = np.isneginf(ref_lse)
    np.testing.assert_array_equal(np.isneginf(lse), inf_ref, err_msg=f"{label}: -inf lse")
    fin = np.isfinite(ref_lse)
    lerr = np.abs(np.where(fin, lse - np.where(fin, ref_lse, 0.0), 0.0))
    np.testing.assert_array_equal(np.isnan(lse), np.isnan(ref_lse), err_msg=f"{label}: NaN lse")
    assert_ratio_within(
        np.where(np.isnan(lerr), 0.0, lerr),
        np.where(fin, lse_bound, 0.0),
        f"{label}: lse error {{error:.3e}} exceeds its bound {{allowed:.3e}} at {{index}}",
    )


# ----------------------------------------------------------------------------- forward


class SplitKVOracleTest(chex.TestCase):
    @chex.variants(with_jit=True)
    @given(problem=kproblems(), splits=st.sampled_from(SPLITS))
    def test_matches_oracle_for_every_number_of_splits(self, problem, splits):
        """Every option mix (masks and biases of every broadcast shape, causal in both
        alignments, windows, lengths, segments, GQA/MQA, softcap, every masked-rows policy),
        float32 and float64, lse too."""
        p = problem
        out, lse = self.variant(split_kv_dot_product_attention, static_argnames=STATIC)(
            p.q, p.k, p.v, return_lse=True, num_splits=splits, **p.kwargs
        )
        assert out.dtype == p.dtype
        assert_split_close(out, lse, p, splits, f"split_kv P={splits}")

    @chex.variants(without_jit=True)
    def test_matches_oracle_eagerly(self):
        """Without jit (every primitive dispatched on its own): one problem with lengths, a
        random mask, a bias, bottom-right causal and a window, three splits of S = 7."""
        p = ast.make_kernel_problem(
            KBUCKETS[0], ("padding", "random", "bias"), 3, np.float64, static=PROFILES[2]
        )
        out, lse = self.variant(split_kv_dot_product_attention)(
            p.q, p.k, p.v, return_lse=True, num_splits=3, **p.kwargs
        )
        assert_split_close(out, lse, p, 3, "split_kv P=3 (eager)")


@given(
    problem=kproblems(dtypes=("bfloat16",), buckets=KBUCKETS[:2], profiles=PROFILES[:4]),
    splits=st.sampled_from((2, 3)),
)
@scaled(0.5)
def test_bfloat16_inputs(problem, splits):
    """16-bit inputs: every split and the merge in float32, the output cast back once."""
    p = problem
    out, lse = _SPLIT_KV(p.q, p.k, p.v, return_lse=True, num_splits=splits, **p.kwargs)
    assert out.dtype == p.dtype and lse.dtype == np.float32
    assert_split_close(out, lse, p, splits, f"split_kv bfloat16 P={splits}")


def _decoding_problem(dtype, seed: int = 0) -> ast.KernelProblem:
    """One new token (``T = 1``) against a cache of ``S = 257`` keys (prime: no split count
    divides it), GQA (4 query heads on 2 K/V heads), the second cache only 130 keys long."""
    config = ast.Config(batch=2, t=1, s=257, n=4, k=2, h=8, h_v=8, d_model=8)
    p = ast.make_kernel_problem(config, "none", seed, dtype)
    p.options["key_value_seq_lengths"] = np.array([257, 130], np.int32)
    return p


DECODING_OPTIONS = (
    {},
    # the new token sits on the last cache slot; a sliding window of 64 keys; a softcap
    {
        "is_causal": True,
        "causal_alignment": "bottom_right",
        "local_window_size": (64, 0),
        "softcap": 20.0,
    },
)


@pytest.mark.parametrize(
    ("dtype", "options", "splits"),
    [
        (np.float32, 0, 1),
        (np.float32, 0, 3),
        (np.float32, 0, 16),
        (np.float32, 1, 5),
        (np.float64, 1, 8),
        ("bfloat16", 1, 4),
    ],
)
def test_single_query_decoding_against_a_long_cache(dtype, options, splits):
    """The use split-KV exists for: ``T = 1`` and a long cache cut into many splits."""
    p = _decoding_problem(dtype)
    opts = dict(DECODING_OPTIONS[options])
    semantics = {"causal_alignment": opts.pop("causal_alignment", "top_left")}
    p = p.replace(options={**p.options, **opts}, **semantics)
    out, lse = _SPLIT_KV(p.q, p.k, p.v, return_lse=True, num_splits=splits, **p.kwargs)
    assert out.shape == (2, 1, 4, 8) and out.dtype == p.dtype
    assert_split_close(out, lse, p, splits, f"decoding P={splits}")


@pytest.mark.parametrize("masked_rows", ["zeros", "nan"])
def test_few_or_no_keys(masked_rows):
    """More splits than keys (``S = 2``, ``P = 5``: three splits of padding alone), no keys at
    all (``S = 0``: every row fully masked, the policy decides) and no queries (``T = 0``)."""
    for t, s, splits in ((3, 2, 5), (3, 0, 3), (0, 4, 2)):
        config = ast.Config(batch=2, t=t, s=s, n=2, k=1, h=4, h_v=3, d_model=8)
        p = ast.make_kernel_problem(config, "none", 7, np.float64, masked_rows=masked_rows)
        out, lse = _SPLIT_KV(p.q, p.k, p.v, return_lse=True, num_splits=splits, **p.kwargs)
        assert out.shape == (2, t, 2, 3)
        assert_split_close(out, lse, p, splits, f"T={t} S={s} P={splits}")
        if s == 0:  # no key: exactly the policy's value, lse exactly -inf
            fill = 0.0 if masked_rows == "zeros" else np.nan
            np.testing.assert_array_equal(np.asarray(out), np.full(out.shape, fill))
            assert np.all(np.isneginf(np.asarray(lse)))


def test_traced_lengths_out_of_range_give_nan():
    """Under jit the lengths cannot be checked: a batch element whose lengths lie outside
    ``[0, T]`` / ``[0, S]`` is NaN in every output and lse entry, as in
    :func:`attnref.dot_product_attention` (``docs/kernel.md``); the others are unaffected."""
    p = ast.make_kernel_problem(KBUCKETS[0], "none", 4, np.float32)
    for name, bad, b in (("key_value_seq_lengths", [8, 7], 0), ("query_seq_lengths", [5, -1], 1)):
        lens = {name: jnp.asarray(bad, jnp.int32)}
        out, lse = _SPLIT_KV(p.q, p.k, p.v, return_lse=True, num_splits=2, **lens)
        for got in (np.asarray(out), np.asarray(lse)):
            assert np.all(np.isnan(got[b])) and not np.any(np.isnan(got[1 - b]))


# ----------------------------------------------------------------------------- gradients


def _loss(static, q, k, v, bias, arrays, cot, cot_lse):
    """A linear functional of the output and of lse (NaN rows and -inf lse contribute 0)."""
    out, lse = split_kv_dot_product_attention(
        q, k, v, bias, return_lse=True, **dict(static), **arrays
    )
    out = jnp.where(jnp.isnan(out), 0.0, out)
    return jnp.sum(out * cot) + jnp.sum(jnp.where(jnp.isfinite(lse), lse * cot_lse, 0.0))


# One jitted gradient per static option set: compiled once, reused across examples.
_GRAD = jax.jit(jax.grad(_loss, argnums=(1, 2, 3, 4)), static_argnames=("static",))


def _neutral_arrays(p: ast.KernelProblem) -> tuple[dict, np.ndarray]:
    """Every array option present (neutral values where the draw has none), so one compiled
    gradient serves each static profile whatever array options were drawn; the bias full
    ``[B, N, T, S]`` (its gradient is per entry) and finite (``-inf`` entries have none)."""
    c = p.config
    kw = p.kwargs
    arrays = {
        "mask": kw.get("mask", np.ones((1, 1, c.t, c.s), bool)),
        "query_seq_lengths": kw.get("query_seq_lengths", np.full(c.b, c.t, np.int32)),
        "key_value_seq_lengths": kw.get("key_value_seq_lengths", np.full(c.b, c.s, np.int32)),
        "segment_ids": kw.get(
            "segment_ids", (np.zeros((c.b, c.t), np.int32), np.zeros((c.b, c.s), np.int32))
        ),
    }
    bias = kw.get("bias")
    if bias is None or not np.all(np.isfinite(bias)):
        bias = np.zeros((1, c.n, c.t, c.s))
    return arrays, np.broadcast_to(bias, (c.b, c.n, c.t, c.s)).astype(p.dtype)


def _check_grads(p: ast.KernelProblem, splits: int, grad_fn, label: str) -> None:
    static = tuple(sorted({**p.static, "num_splits": splits}.items()))
    arrays, bias = _neutral_arrays(p)
    rng = np.random.default_rng(0)
    c = p.config
    cot = rng.standard_normal((c.b, c.t, c.n, c.h_v)).astype(p.dtype)
    cot_lse = rng.standard_normal((c.b, c.t, c.n)).astype(p.dtype)
    full = p.replace(options={**p.options, **arrays, "bias": bias})
    exact = full.oracle_vjp(cot, cot_lse)
    bound = full.grad_bound(cot, cot_lse)
    got = grad_fn(static, p.q, p.k, p.v, bias, arrays, cot, cot_lse)
    for name, g, e, bd in zip(("q", "k", "v", "bias"), got, exact[:4], bound[:4], strict=True):
        err = np.abs(np.asarray(g, np.float64) - e)
        worst = np.unravel_index(np.argmax(err - bd), err.shape)
        assert np.all(err <= bd), (
            f"{label} d/d{name}: {err[worst]:.3e} > bound {bd[worst]:.3e} at {worst}"
        )


# Profiles with distinct backward paths: plain; window + softcap + NaN rows; bottom-right
# causal + softcap + uniform rows (whose gradient reaches every v row).
GRAD_PROFILES = (PROFILES[0], PROFILES[3], PROFILES[4])


@given(
    problem=kproblems(dtypes=("float32",), buckets=KBUCKETS[:1], profiles=GRAD_PROFILES),
    splits=st.sampled_from((2, 5)),
)
@scaled(0.5)
def test_gradients_match_the_gradient_oracle(problem, splits):
    """Gradients with respect to q, k, v and the bias, through the output and lse, by autodiff
    through the splits and the merge (jitted), within the derived gradient bound of the
    float64 gradient oracle."""
    _check_grads(problem, splits, _GRAD, f"split_kv P={splits}")


def test_non_finite_masked_keys_reach_neither_output_nor_gradients():
    """NaN and inf in the keys and values beyond ``key_value_seq_lengths`` and a NaN bias on
    masked pairs: the output equals the oracle's, and every gradient is finite, exactly zero on
    the masked keys, and within the gradient bound of the oracle on the same inputs cleaned
    (what a query may not read does not matter)."""
    c = KBUCKETS[0]  # B=2, T=5, S=7, GQA
    p = ast.make_kernel_problem(c, "random", 5, np.float32, mask_shape="BNTS")
    kv_lens = np.array([4, 7], np.int32)
    mask = p.options["mask"].copy()
    mask[:, :, :, 2] = False  # key 2 masked for every query
    bias = np.random.default_rng(1).standard_normal((c.b, c.n, c.t, c.s)).astype(np.float32)
    dirty_bias = np.where(mask, bias, np.nan).astype(np.float32)
    k, v = p.k.copy(), p.v.copy()
    k[0, 4:], v[0, 4:] = np.nan, np.inf
    k[:, 2], v[:, 2] = np.inf, np.nan
    opts = {"mask": mask, "key_value_seq_lengths": kv_lens}
    clean = p.replace(options={**opts, "bias": bias})
    dirty = p.replace(k=k, v=v, options={**opts, "bias": dirty_bias})

    def loss(q, k, v, b):
        out, lse = split_kv_dot_product_attention(q, k, v, b, return_lse=True, num_splits=3, **opts)
        return jnp.sum(out * cot) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

    cot = np.random.default_rng(2).standard_normal((c.b, c.t, c.n, c.h_v)).astype(np.float32)
    out, lse = _SPLIT_KV(dirty.q, k, v, dirty_bias, return_lse=True, num_splits=3, **opts)
    assert np.all(np.isfinite(np.asarray(out)))
    assert_split_close(out, lse, clean, 3, "split_kv with masked NaN/inf")
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(dirty.q, k, v, dirty_bias)
    for g in grads:
        assert np.all(np.isfinite(np.asarray(g)))
    dk, dv, db = (np.asarray(g) for g in grads[1:])
    assert np.all(dk[0, 4:] == 0) and np.all(dv[0, 4:] == 0)
    assert np.all(dk[:, 2] == 0) and np.all(dv[:, 2] == 0)
    assert np.all(db[~np.broadcast_to(mask, db.shape)] == 0)
    cot_lse = np.ones((c.b, c.t, c.n), np.float32)
    exact = clean.oracle_vjp(cot, cot_lse)
    bound = clean.grad_bound(cot, cot_lse)
    for name, g, e, bd in zip("qkvb", grads, exact[:4], bound[:4], strict=True):
        err = np.abs(np.asarray(g, np.float64) - e)
        assert np.all(err <= bd), f"d/d{name}: {err.max():.3e}"


# ----------------------------------------------------------------------------- the row form


@given(
    problem=problems(dtypes=("float32",), buckets=ast.WEIGHT_BUCKETS[1:2]),
    splits=st.sampled_from((3, 5)),
)
@scaled(0.25)
def test_row_form_matches_the_oracle_for_any_number_of_splits(problem, splits):
    """The registry entry's ``apply`` with other split counts than its default (4, which the
    suite's softmax-family tests run): cross-attention, ``T_k = 7`` in 3 or 5 splits."""
    f = attnref.get("split_kv")
    assert f.native is split_kv_dot_product_attention and f.apply is split_kv_attention
    apply = jax.jit(split_kv_attention, static_argnames=f.static_argnames)
    check_formulation(
        lambda *a, **kw: apply(*a, num_splits=splits, **kw), problem, f"split_kv P={splits}"
    )


def test_cost_model_matches_xla_for_splits_that_do_not_divide_t_k():
    """``split_kv_cost`` against XLA for a decoding step (``T_q = 1``, ``T_k = 37``, three
    splits: 39 padded keys) with biases, under the conventions of tests/test_cost.py: dot FLOPs
    and transcendentals exact, the elementwise model an upper bound on XLA's count up to fusion
    duplication (at most 4 consumers per intermediate), temporary bytes between the largest
    intermediate and the workspace."""
    d = Dims(batch=2, t_q=1, t_k=37, heads=2, d_model=8, d_k=4, d_v=6, bias=True)
    p = attnref.init_params(0, d_model=8, num_heads=2, d_k=4, d_v=6, bias=True)
    x_q, x_kv = np.zeros((2, 1, 8), np.float32), np.zeros((2, 37, 8), np.float32)
    full = (2, 1, 37)
    fn = jax.jit(split_kv_attention, static_argnames=("residual", "num_splits"))
    xc = xla_counts(
        fn, p, x_q, x_kv, mask=np.ones(full, bool), bias=np.zeros(full, np.float32), num_splits=3
    )
    model = attnref.get("split_kv").cost_model(d, 3)
    assert xc.dot_flops == model.matmul_flops
    assert xc.transcendentals == model.transcendentals
    assert 0 <= xc.other_flops <= 4 * model.elementwise_flops
    assert model.intermediate_bytes <= xc.temp_bytes <= model.workspace_bytes


# ----------------------------------------------------------------------------- bad input


@pytest.mark.usefixtures("unchecked_annotations")
@pytest.mark.parametrize(
    ("num_splits", "error"),
    [(0, ValueError), (-2, ValueError), (True, TypeError), (2.0, TypeError), ("2", TypeError)],
)
def test_bad_num_splits_is_refused(num_splits, error):
    p = ast.make_kernel_problem(KBUCKETS[0], "none", 0, np.float32)
    with pytest.raises(error, match="num_splits must be a positive int"):
        split_kv_dot_product_attention(p.q, p.k, p.v, num_splits=num_splits)
    params = attnref.init_params(0, d_model=8, num_heads=2, d_k=4, d_v=4)
    with pytest.raises(error, match="num_splits must be a positive int"):
        split_kv_attention(params, np.zeros((1, 3, 8), np.float32), num_splits=num_splits)


@pytest.mark.usefixtures("unchecked_annotations")
@pytest.mark.parametrize(
    "change",
    [
        {"key": np.zeros((2, 7, 3), np.float32)},  # rank 3
        {"value": np.zeros((2, 6, 2, 2), np.float32)},  # S differs from key's
        {"masked_rows": "bogus"},
        {"mask": np.ones((2, 4, 5), bool)},  # rank 3
        {"key_value_seq_lengths": np.array([8, 7])},  # beyond S = 7
        {"query": np.zeros((2, 5, 4, 3), np.float64)},  # dtypes differ
    ],
)
def test_refuses_what_dot_product_attention_refuses(change):
    """The same exception type and message as :func:`attnref.dot_product_attention`."""
    p = ast.make_kernel_problem(KBUCKETS[0], "none", 0, np.float32)
    kw = {"query": p.q, "key": p.k, "value": p.v, **change}
    with pytest.raises((ValueError, TypeError)) as want:
        attnref.dot_product_attention(**kw)
    with pytest.raises(want.type) as got:
        split_kv_dot_product_attention(**kw, num_splits=3)
    assert str(got.value) == str(want.value)
