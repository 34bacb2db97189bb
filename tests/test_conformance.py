"""The conformance kit (``attnref.testing.check_attention``) on real clients and broken kernels.

Real clients: ``jax.nn.dot_product_attention`` (implementation "xla") and Flax's
``dot_product_attention`` pass, with their documented meaning of fully masked rows declared
(``masked_rows="uniform"``); with attnref's default the ``fully_masked_rows`` property fails for
jax.nn, so the declared difference is real and not hidden by a tolerance. Deliberately broken
kernels are each caught, with a small shrunk example and a seed that replays the failure.

Small ``max_examples`` and fixed seeds keep the file fast and deterministic.
"""

from __future__ import annotations

import functools
import json
import math
import subprocess
import sys
from pathlib import Path

import flax.linen as nn
import hypothesis
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attnref
from attnref import strategies as ast
from attnref.testing import (
    FEATURES,
    PROPERTIES,
    ConformanceReport,
    PropertyResult,
    assert_ratio_within,
    check_attention,
    load_target,
    production_plan,
)

from . import conformance_targets as targets

EXAMPLES = 5
# jax.nn with implementation "xla": conformance_targets' ``good``, the same object as the other
# kit tests' (the kit's jitted programs are keyed by the function, so they are compiled once)
JAX_NN = targets.good


# ----------------------------------------------------------------------------- a hand kernel


def naive_kernel(
    query,
    key,
    value,
    bias=None,
    mask=None,
    *,
    scale=None,
    is_causal=False,
    bug=None,
):
    """A plain jnp kernel with the jax.nn signature (mask, bias, causal, GQA; fully masked rows
    return zeros), and optionally one deliberate bug."""
    _, t, n, h = query.shape
    s, kh = key.shape[1], key.shape[2]
    group = n // kh
    if bug == "gqa_tiled":  # head i reads K/V head i % K instead of i // G
        k, v = jnp.tile(key, (1, 1, group, 1)), jnp.tile(value, (1, 1, group, 1))
    else:
        k, v = jnp.repeat(key, group, axis=2), jnp.repeat(value, group, axis=2)
    sc = (1.0 / h if bug == "scale" else 1.0 / math.sqrt(h)) if scale is None else scale
    logits = jnp.einsum("btnh,bsnh->bnts", query, k, precision="highest") * sc
    allowed = jnp.ones((1, 1, t, s), bool)
    if bias is not None:
        logits = logits + bias
        allowed = allowed & (bias != -jnp.inf)
    if mask is not None:
        allowed = allowed & mask
    if is_causal:
        off = 1 if bug == "causal_off_by_one" else 0
        allowed = allowed & (jnp.arange(s)[None, :] <= jnp.arange(t)[:, None] + off)
    if bug == "no_max":
        top = jnp.zeros_like(logits[..., :1])
    elif bug == "global_max":  # the max over every key, masked or future ones included
        top = jnp.max(logits, axis=-1, keepdims=True)
    else:
        top = jnp.max(jnp.where(allowed, logits, -jnp.inf), axis=-1, keepdims=True)
        top = jax.lax.stop_gradient(jnp.where(jnp.isfinite(top), top, 0.0))
    e = jnp.where(allowed, jnp.exp(jnp.where(allowed, logits - top, 0.0)), 0.0)
    axis = -2 if bug == "softmax_axis" else -1
    denom = jnp.sum(e, axis=axis, keepdims=True)
    if bug == "stopped_denominator":  # forward exact; the backward drops the D_i term
        denom = jax.lax.stop_gradient(denom)
    p = e / jnp.where(denom > 0, denom, 1.0)
    out = jnp.einsum("bnts,bsnh->btnh", p, v, precision="highest")
    return out.astype(query.dtype)


HAND_FEATURES = ("mask", "bias", "causal", "gqa", "cross", "grad")


@functools.cache
def broken_kernel(bug):
    """``naive_kernel`` with ``bug``, one object per bug: the kit's jitted programs are keyed by
    the function, so the tests that check the same bug reuse them instead of compiling again."""
    return functools.partial(naive_kernel, bug=bug)


def _fails(report: ConformanceReport) -> dict[str, PropertyResult]:
    return {r.name: r for r in report.results if r.status == "failed"}


# ----------------------------------------------------------------------------- real clients


def test_jax_nn_passes_with_its_masked_rows_declared():
    report = check_attention(JAX_NN, masked_rows="uniform", max_examples=EXAMPLES, seed=0)
    assert report.passed, report.summary()
    assert [r.name for r in report.results] == list(PROPERTIES)
    assert all(r.status == "passed" and r.examples == EXAMPLES for r in report.results)
    # the difference from attnref's semantics is listed, not absorbed by a tolerance
    assert report.declared == {"masked_rows": "uniform"}
    by_name = {r.name: r for r in report.results}
    assert by_name["fully_masked_rows"].declared == ("masked_rows=uniform",)
    assert by_name["oracle"].declared == ()
    assert "declared differences: masked_rows=uniform" in report.summary()


def test_jax_nn_fails_fully_masked_rows_under_attnref_default():
    """The declared difference is real: with attnref's default ``masked_rows="zeros"`` the
    property fails, and says what jax.nn returns instead."""
    report = check_attention(
        JAX_NN, properties=["fully_masked_rows"], max_examples=EXAMPLES, seed=0
    )
    (result,) = report.results
    assert result.status == "failed"
    assert "masked_rows='zeros'" in result.detail
    assert "masked_rows='uniform'" in result.detail  # what the kernel actually does
    assert report.declared == {}


def test_flax_dot_product_attention_passes():
    """Flax's ``dot_product_attention`` (layout [B, T, N, H], mask and bias ``[B, N, T, S]``; no
    GQA, no causal flag, no lse; it masks with ``finfo.min``, so fully masked rows are uniform)
    through the jax.nn adapter, and with causality expressed through a mask."""
    report = check_attention(
        nn.dot_product_attention,
        features=("mask", "bias", "cross", "grad"),
        masked_rows="uniform",
        properties=["oracle", "masks", "batch_independence", "fully_masked_rows", "gradients"],
        max_examples=EXAMPLES,
        seed=1,
    )
    assert report.passed, report.summary()

    def flax_qkv_mask(q, k, v, mask):
        return nn.dot_product_attention(q, k, v, mask=mask)

    report = check_attention(
        flax_qkv_mask,
        signature="qkv_mask",
        features=("mask", "causal", "seq_lengths", "window", "segment_ids", "grad"),
        masked_rows="uniform",
        properties=["masks", "causality", "extreme_logits"],
        max_examples=EXAMPLES,
        seed=2,
    )
    assert report.passed, report.summary()


def test_attnref_kernels_pass():
    """attnref's own kernel through the jax.nn adapter with its extra keywords (``segment_ids``,
    ``softcap``; the lse through ``return_lse``), and its float64 NumPy oracle through the NumPy
    adapter."""
    report = check_attention(
        attnref.dot_product_attention,
        features=("segment_ids", "softcap", "lse", "causal", "gqa"),
        properties=["masks", "lse"],
        max_examples=2,
        seed=3,
    )
    assert report.passed, report.summary()
    assert [r.examples for r in report.results] == [2, 2]
    report = check_attention(
        attnref.oracle.dot_product_attention,
        signature="numpy",
        properties=["oracle", "lse", "fully_masked_rows"],
        max_examples=3,
        seed=3,
    )
    assert report.passed, report.summary()


def _off_by(fraction: float):
    """A NumPy kernel ``fraction`` times its derived bound away from the oracle, everywhere."""

    def fn(query, key, value, **kw):
        out = attnref.oracle.dot_product_attention(query, key, value, **kw)
        bound, _ = attnref.tolerance.kernel_call_error_bound(query, key, value, **kw)
        return out + fraction * bound

    return fn


def test_the_bound_decides_above_its_minorant():
    """The kit tests an output first against ``tolerance.kernel_bound_minorant`` (at most half
    the bound where a row has a key): 0.75 x the bound is above it everywhere the bound is not 0,
    so passing needs the bound itself; 1.5 x the bound fails with the bound's own message."""
    props, kw = ["oracle", "masks"], {"signature": "numpy", "max_examples": 3, "seed": 5}
    report = check_attention(_off_by(0.75), properties=props, **kw)
    assert report.passed, report.summary()
    report = check_attention(_off_by(1.5), properties=props, **kw)
    for r in report.results:
        assert r.status == "failed" and "rule 'bound' failed" in r.detail, r.detail


# ----------------------------------------------------------------------------- broken kernels

# bug -> (properties run, the properties that must catch it)
BROKEN = {
    "scale": (("oracle",), {"oracle"}),
    "causal_off_by_one": (("masks", "causality"), {"masks", "causality"}),
    "softmax_axis": (("oracle",), {"oracle"}),
    "no_max": (("oracle", "extreme_logits"), {"extreme_logits"}),
    "global_max": (("causality", "extreme_logits"), {"causality", "extreme_logits"}),
    "gqa_tiled": (("oracle", "gqa"), {"gqa"}),
    # a backward-only bug: only the gradient oracle (dS = P (dP - D)) can see it
    "stopped_denominator": (("oracle", "gradients"), {"gradients"}),
}


def test_the_hand_kernel_itself_passes():
    """The control: without a bug, the hand kernel passes every property that catches a bug."""
    props = sorted(set().union(*(p for p, _ in BROKEN.values())))
    report = check_attention(
        naive_kernel, features=HAND_FEATURES, properties=props, max_examples=EXAMPLES, seed=0
    )
    assert report.passed, report.summary()


@pytest.mark.parametrize("bug", sorted(BROKEN))
def test_broken_kernel_is_caught_with_a_small_shrunk_example(bug):
    properties, catchers = BROKEN[bug]
    fn = broken_kernel(bug)
    report = check_attention(
        fn, features=HAND_FEATURES, properties=properties, max_examples=EXAMPLES, seed=0
    )
    failed = _fails(report)
    assert catchers <= set(failed), report.summary()
    for name in catchers:
        r = failed[name]
        assert r.example is not None and "Config(" in r.example, r.example
        assert r.detail and r.seed == 0 and r.examples >= 1
    assert not report.passed
    assert "FAIL" in report.summary()


def test_shrunk_examples_are_small():
    """Shrinking moves towards the first (smallest) bucket and the smallest logit scale."""
    fn = broken_kernel("no_max")
    report = check_attention(
        fn, features=HAND_FEATURES, properties=["extreme_logits"], max_examples=EXAMPLES, seed=0
    )
    (r,) = report.results
    assert r.status == "failed"
    assert "max_abs_logit=100.0" in r.example, r.example  # 1e2 already overflows exp
    assert "batch=2, t=4, s=4" in r.example, r.example  # the self-attention bucket


def test_failure_replays_from_its_seed():
    fn = broken_kernel("causal_off_by_one")
    first = check_attention(
        fn, features=HAND_FEATURES, properties=["causality"], max_examples=EXAMPLES, seed=7
    )
    (r,) = first.results
    assert r.status == "failed" and r.seed == 7
    again = check_attention(
        fn, features=HAND_FEATURES, properties=[r.name], max_examples=EXAMPLES, seed=r.seed
    )
    (r2,) = again.results
    assert (r2.status, r2.example, r2.detail) == (r.status, r.example, r.detail)


# ----------------------------------------------------------------------------- report structure


def test_skipped_properties_name_the_missing_feature():
    calls = []
    report = check_attention(
        naive_kernel,
        features=("mask", "cross"),
        properties=["causality", "gqa", "lse", "gradients", "fully_masked_rows"],
        max_examples=2,
        seed=0,
        progress=lambda done, total, name: calls.append((done, total, name)),
        target="tests:naive_kernel",
    )
    by_name = {r.name: r for r in report.results}
    for name, feature in (("causality", "causal"), ("gqa", "gqa"), ("lse", "lse")):
        assert by_name[name].status == "skipped"
        assert f"'{feature}'" in by_name[name].detail
        assert by_name[name].examples == 0 and by_name[name].example is None
    assert by_name["gradients"].status == "skipped" and "'grad'" in by_name["gradients"].detail
    assert by_name["fully_masked_rows"].status == "passed"
    assert report.passed  # skips do not fail a report
    assert calls == [
        (1, 5, "causality"),
        (2, 5, "gqa"),
        (3, 5, "lse"),
        (4, 5, "fully_masked_rows"),
        (5, 5, "gradients"),
    ]
    data = report.to_dict()
    assert json.loads(json.dumps(data)) == data
    assert data["target"] == "tests:naive_kernel" and data["passed"] is True
    assert "skipped" in report.summary()


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="signature"):
        check_attention(naive_kernel, signature="pytorch")
    with pytest.raises(ValueError, match="unknown features"):
        check_attention(naive_kernel, features=("flash",))
    with pytest.raises(ValueError, match="cannot express"):
        check_attention(naive_kernel, signature="qkv_mask", features=("bias",))
    with pytest.raises(ValueError, match="unknown properties"):
        check_attention(naive_kernel, properties=["speed"])
    with pytest.raises(ValueError, match="masked_rows"):
        check_attention(naive_kernel, masked_rows="ignore")


@pytest.mark.parametrize(
    "first", ["attnref.conformance", "attnref.strategies", "attnref.testing", "attnref.cli"]
)
def test_the_kit_imports_first_without_a_cycle(first):
    """Any entry point of the kit imports first in a fresh interpreter."""
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run(
        [sys.executable, "-c", f"import {first}"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr


def test_assert_ratio_within_names_the_worst_element():
    err = np.array([[0.0, 3.0], [2.0, 0.5]])
    # an allowance per element: the largest ratio (2 / 1), not the largest error (3 / 4)
    per_element = np.array([[1.0, 4.0], [1.0, 1.0]])
    with pytest.raises(AssertionError, match=r"^\(1, 0\) 2 2\.0 1\.0 x=20\.0$"):
        assert_ratio_within(
            err, per_element, "{index} {ratio:g} {error} {allowed} x={x}", x=10 * err
        )
    # one allowance for every element: the largest error
    with pytest.raises(AssertionError, match=r"^\(0, 1\) 3$"):
        assert_ratio_within(err, 1.0, "{index} {ratio:g}")
    assert assert_ratio_within(err, 4.0, "unused") == ((0, 1), 0.75)
    assert assert_ratio_within(np.zeros(0), 0.0, "unused") == ((), 0.0)
    with pytest.raises(AssertionError, match=r"^nan$"):
        assert_ratio_within(np.array([np.nan, 0.0]), 1.0, "{error}", require_finite=True)
    # allowances that would pass anything (negative: every ratio < 0; NaN: NaN > 1 is False) or
    # cannot be read elementwise are refused, not compared
    for bad in (-1.0, np.array([[1.0, -1.0]]), np.nan, np.array([1.0, np.nan])):
        with pytest.raises(ValueError, match=">= 0"):
            assert_ratio_within(err, bad, "unused")
    with pytest.raises(ValueError, match=r"shape \(3,\) does not broadcast"):
        assert_ratio_within(err, np.ones(3), "unused")
    with pytest.raises(ValueError, match="does not broadcast"):
        assert_ratio_within(err[0], per_element, "unused")  # would grow the errors


def test_a_failed_comparison_has_no_traceback():
    """The closeness rules are the kit's own comparisons: their failures carry no traceback."""
    report = check_attention(targets.wrong_scale, properties=["oracle"], max_examples=2, seed=0)
    (r,) = report.results
    assert r.status == "failed" and r.detail.startswith("oracle [float32]: rule 'bound'")
    assert r.traceback is None


def test_load_target():
    assert load_target("attnref:dot_product_attention") is attnref.dot_product_attention
    assert load_target("attnref.oracle:dot_product_attention") is (
        attnref.oracle.dot_product_attention
    )
    assert load_target("jax:nn.dot_product_attention") is jax.nn.dot_product_attention
    with pytest.raises(ValueError, match=r"package\.module:function"):
        load_target("attnref.dot_product_attention")
    with pytest.raises(ImportError, match="no_such_module"):
        load_target("no_such_module:f")
    with pytest.raises(AttributeError, match="nope"):
        load_target("attnref:nope")


def test_jit_failure_falls_back_to_eager_and_says_so():
    def concrete_only(query, key, value, bias=None, mask=None, **kw):
        np.asarray(query)  # fails on a tracer
        return naive_kernel(query, key, value, bias, mask, **kw)

    report = check_attention(
        concrete_only, features=("cross",), properties=["oracle"], max_examples=2, seed=0
    )
    (r,) = report.results
    assert r.status == "passed", r.detail
    assert "ran eagerly" in r.detail


# ----------------------------------------------------------------------------- strategies


def test_strategies_make_labelled_reproducible_problems():
    c = ast.BUCKETS[-1]
    for kind in ast.MASK_KINDS:
        a = ast.make_kernel_problem(c, kind, 5)
        b = ast.make_kernel_problem(c, kind, 5)
        for x, y in ((a.q, b.q), (a.k, b.k), (a.v, b.v)):
            np.testing.assert_array_equal(x, y)
        out, lse = a.oracle()
        bound, lse_bound = a.bound()
        assert out.shape == (c.batch, c.t, c.n, c.h_v) == bound.shape
        assert lse.shape == (c.batch, c.t, c.n) == lse_bound.shape
        rows = a.allowed().any(-1)
        if kind not in ("fully_masked_row", "combined", "window"):
            assert rows.all() or kind == "padding", kind
        if kind == "fully_masked_row":
            assert not rows.all()
        assert "Config(" in repr(a) and kind in repr(a)
    same = ast.make_kernel_problem(c, "none", 1, identical="keys")
    assert np.all(same.k == same.k[:, :1])
    # no degenerate fill by accident: distinct rows
    p = ast.make_kernel_problem(c, "none", 1)
    assert len({row.tobytes() for row in p.k.reshape(-1, c.h)}) == p.k.size // c.h
    w = ast.make_attention_problem(ast.BUCKETS[4], "combined", 2)
    assert w.params.w_k.shape[0] == ast.BUCKETS[4].k
    assert w.oracle().shape == w.bound().shape == (1, 4, 8)


def test_declared_nan_rows_and_bottom_right_alignment():
    """A kernel with the "nan" policy and FlashAttention's bottom-right causal alignment passes
    when it declares them (the report lists both), and is caught when it does not."""
    fn = functools.partial(
        attnref.dot_product_attention, masked_rows="nan", causal_alignment="bottom_right"
    )
    kw = dict(features=("mask", "causal", "cross"), max_examples=6, seed=4)
    props = ["masks", "fully_masked_rows"]
    report = check_attention(
        fn, masked_rows="nan", causal_alignment="bottom_right", properties=props, **kw
    )
    assert report.passed, report.summary()
    assert report.declared == {"masked_rows": "nan", "causal_alignment": "bottom_right"}
    by_name = {r.name: r for r in report.results}
    assert by_name["masks"].declared == ("masked_rows=nan", "causal_alignment=bottom_right")
    undeclared = _fails(check_attention(fn, properties=props, **kw))
    assert set(undeclared) == set(props)
    assert "NaN" in undeclared["fully_masked_rows"].detail


# ----------------------------------------------------------------------------- issue 11


def test_broadcast_shapes_are_every_rank4_pattern():
    """The strategies draw every shape that broadcasts to ``[B, N, T, S]`` (each axis full or 1,
    rank 4), and each kind that takes a mask or a bias builds it in the drawn shape."""
    import itertools

    want = {
        "".join(a if keep else "1" for a, keep in zip("BNTS", k, strict=True))
        for k in itertools.product((True, False), repeat=4)
    }
    assert set(ast.BROADCAST_SHAPES) == want and len(ast.BROADCAST_SHAPES) == 16
    assert ast.BROADCAST_SHAPES[0] == "BNTS"  # shrinks towards the full shape
    c = ast.BUCKETS[-1]  # batch 2, T=5, S=7, N=4: every axis distinct from 1
    for pattern in ast.BROADCAST_SHAPES:
        shape = ast.broadcast_shape(c, pattern)
        for kind in ("random", "fully_masked_row", "combined"):
            p = ast.make_kernel_problem(c, kind, 3, mask_shape=pattern)
            assert p.options["mask"].shape == shape, (kind, pattern)
            assert p.oracle()[0].shape == p.bound()[0].shape
        for kind in ("bias", "neg_inf_bias", "combined"):
            p = ast.make_kernel_problem(c, kind, 3, bias_shape=pattern)
            assert p.options["bias"].shape == shape, (kind, pattern)
            if kind != "combined":  # every row keeps a key
                assert p.allowed().any(-1).all(), (kind, pattern)
    with pytest.raises(ValueError, match="BROADCAST_SHAPES"):
        ast.broadcast_shape(c, "BN1")
    # the public strategy draws them, labelled (mask_shapes=None: the kind's own shape)
    seen = set()

    @hypothesis.seed(0)
    @hypothesis.settings(max_examples=40, database=None, deadline=None)
    @hypothesis.given(ast.kernel_problems(kinds=("random",), mask_shapes=("B11S", "1111")))
    def draw(p):
        seen.add(p.options["mask"].shape)

    draw()
    assert all(shape[1:3] == (1, 1) for shape in seen), seen
    # both patterns come up in 40 draws ("1111" has S = 1, "B11S" has S > 1 in every bucket)
    assert {shape[3] == 1 for shape in seen} == {True, False}, seen


@pytest.mark.parametrize(
    ("name", "features", "kind"),
    [
        ("mask_row0_only", ("mask",), "random"),
        ("padded_broadcast", ("mask",), "random"),
        ("padded_broadcast", ("bias",), "neg_inf_bias"),
    ],
)
def test_masks_property_rejects_query_broadcast_bugs(name, features, kind):
    """A mask applied to query row 0 only, and the pre-fix blockwise defect (a query-broadcast
    mask or bias padded like data), both pass on every full-shape mask and bias; the masks
    property draws the broadcast shapes (the key-padding ones first, whatever the seed and the
    Hypothesis version) and catches them with a shape that has T = 1."""
    report = check_attention(
        getattr(targets, name), features=features, properties=["masks"], max_examples=3, seed=0
    )
    (r,) = report.results
    assert r.status == "failed", report.summary()
    assert f"masks [{kind}:" in r.detail, r.detail
    shape = r.detail.split("[", 2)[2].split("]", 1)[0]  # e.g. "2, 1, 1, 4"
    assert shape.split(", ")[2] == "1", r.detail  # broadcast over the query axis
    assert "_shape='" in r.example, r.example  # the drawn shape is in the shrunk example
    assert r.traceback is None  # a failed comparison, not an exception


def test_lse_none_and_wrong_shape_are_failures_naming_the_shapes():
    report = check_attention(
        targets.lse_none, features=("lse",), properties=["lse"], max_examples=2, seed=0
    )
    (r,) = report.results
    assert r.status == "failed"
    assert "None" in r.detail and "lse [B, T, N]" in r.detail and "(2, 4, 2)" in r.detail
    report = check_attention(
        targets.wrong_shape,
        features=("mask", "grad"),
        properties=["oracle", "batch_independence", "gradients"],
        max_examples=2,
        seed=0,
    )
    for r in report.results:  # the message, not an internal error from a later comparison
        assert r.status == "failed" and r.traceback is None, r
        assert r.detail.startswith("fn returned its output [B, T, N, H_v] with shape (2, 2, 4, 4)")
        assert "expected (2, 4, 2, 4)" in r.detail, r.detail


def test_all_nan_kernel_fails_every_property_that_runs():
    report = check_attention(targets.all_nan, max_examples=2, seed=0)
    assert {r.name for r in report.results if r.status != "failed"} == set(), report.summary()
    by_name = {r.name: r for r in report.results}
    assert "NaN" in by_name["batch_independence"].detail


def test_a_kernel_that_raises_shows_its_traceback():
    report = check_attention(targets.raises, properties=["oracle"], max_examples=2, seed=0)
    (r,) = report.results
    assert r.status == "failed"
    assert r.detail.startswith("ValueError: kernel_helper_exploded")
    assert r.traceback is not None
    assert "in _broken_helper" in r.traceback and "conformance_targets.py" in r.traceback
    assert "/hypothesis/" not in r.traceback  # Hypothesis's frames are left out
    assert r.traceback.rstrip().endswith("kernel_helper_exploded on a query of shape (2, 4, 2, 4)")
    assert "in _broken_helper" in report.summary()
    assert report.to_dict()["results"][0]["traceback"] == r.traceback


def _parse_case(label: str) -> dict[str, object]:
    """``"B=1 T=129 S=129 N=32 K=8 H=64 causal"`` -> sizes and kind."""
    parts = label.split()
    sizes = {k: int(v) for k, v in (p.split("=") for p in parts if "=" in p)}
    return {**sizes, "kind": parts[6], "ragged": "ragged" in parts}


def test_production_plan_covers_the_tiling_cases():
    """The production sweep (what ``shapes="production"`` runs) reaches what the issue asks:
    every length 2^k - 1, 2^k, 2^k + 1 for k = 7..13 with T == S, T != S pairs, head dims 64,
    128 and 256, 32 query heads over 8 (GQA) and over 1 (MQA) K/V head, every mask kind at a
    length one past a 128-key tile, ragged two-element batches; cheapest case first."""
    plan = production_plan(features=FEATURES)  # every feature jax_nn's signature can express
    oracle_cases = [_parse_case(c) for c in plan["oracle"]]
    lengths = {n for k in range(7, 14) for n in (2**k - 1, 2**k, 2**k + 1)}
    assert lengths <= {c["T"] for c in oracle_cases if c["T"] == c["S"]}
    assert any(c["T"] != c["S"] for c in oracle_cases)
    everything = [_parse_case(c) for v in plan.values() if not isinstance(v, str) for c in v]
    assert {64, 128, 256} <= {c["H"] for c in everything}
    assert any(c["N"] == 32 and c["K"] == 8 for c in everything)
    assert any(c["N"] == 32 and c["K"] == 1 for c in everything)
    mask_cases = [_parse_case(c) for c in plan["masks"]]
    assert set(ast.MASK_KINDS) - {"none"} <= {
        c["kind"] for c in mask_cases if c["S"] > 128 and c["S"] % 128
    }
    for name in ("batch_independence", "fully_masked_rows"):
        assert all(c["ragged"] and c["B"] == 2 for c in map(_parse_case, plan[name]))
    for name in ("causality", "extreme_logits"):
        assert isinstance(plan[name], str)
    for name, cases in plan.items():
        if not isinstance(cases, str):
            work = [c["B"] * c["N"] * c["T"] * c["S"] * c["H"] for c in map(_parse_case, cases)]
            assert work == sorted(work), name


def test_production_plan_follows_the_features():
    """Without ``gqa`` every case has K == N and the gqa property is skipped; the masks sweep
    draws only the kinds the features allow."""
    plan = production_plan(features=("mask", "causal"))
    assert isinstance(plan["gqa"], str) and isinstance(plan["lse"], str)
    assert all(_parse_case(c)["K"] == _parse_case(c)["N"] for c in plan["oracle"])
    assert {_parse_case(c)["kind"] for c in plan["masks"]} == {
        "causal",
        "random",
        "fully_masked_row",
    }
