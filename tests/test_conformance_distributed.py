"""The conformance kit on distributed kernels: ``check_attention(fn, devices=(1, 2, 4, 8))``.

The targets are user-style ring kernels in ``tests/conformance_targets.py`` (``jax.shard_map`` and
``jax.lax.ppermute`` written directly, not attnref's own schemes). The correct ring and zigzag
pass every property they support on meshes of 1, 2, 4 and 8 virtual CPU devices; each broken one
fails, and the report names the property and the mesh size:

* a zigzag that restores its output with two chunks swapped: ``oracle``, from ``P = 2`` (right at
  ``P = 1``, where the layout is one device's two chunks in order);
* a merge written ``lse + log(1 + exp(lse_b - lse))``: ``extreme_logits`` (the pieces' lse are
  hundreds apart there, and ``exp`` overflows past 88 in float32); its ``oracle`` passes, logits
  of order one never overflow;
* a ring that keeps its running output in the input dtype: with bfloat16 inputs its ``oracle``
  property passes on every mesh (FlashAttention's comparative rule, whose floor allows eight
  16-bit roundings), and ``ring_size_growth`` fails, by a factor that grows with ``P``;
* a zigzag that pads lengths ``2P`` does not divide but leaves the padded keys unmasked
  (EasyContext #57): ``uneven_lengths`` on every mesh size, ``P = 1`` included (odd lengths).

``uneven_lengths`` passes the correct ring and zigzag, which refuse the lengths they cannot lay
out (``jax.shard_map``'s and ``jnp.reshape``'s errors), and attnref's own zigzag, which pads them
inside and computes the exact answer.

A target declares 16-bit support by listing the format in ``dtypes``: the default distributed
check then runs ``ring_size_growth`` in it as well as in float32, and fails the 16-bit state.

Few examples, lengths multiplied by ``2 lcm(devices)`` from the kit's small buckets (and K/V heads
by the least factor that makes them a multiple of ``lcm(devices)``; attnref's own schemes, the
head-parallel ones among them, are ``tests/test_kit_schemes.py``'s), and one compiled program per
(target, mesh size, bucket, option set), reused across examples.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnref.cli import main
from attnref.conformance import DISTRIBUTED_PROPERTIES, Options
from attnref.distributed import zigzag_dot_product_attention
from attnref.testing import (
    ALL_PROPERTIES,
    PROPERTIES,
    ConformanceReport,
    PropertyResult,
    check_attention,
)

from . import conformance_targets as targets
from .helpers import thorough

pytest_plugins = ["pytester"]

DEVICES = (1, 2, 4, 8)
# The correct kernels' sweep: every size in the ``thorough`` profile; in ``ci`` (and ``dev``) the
# sizes that bracket it, one device (no merge) and eight (the most merges), whose lengths
# (2 lcm = 16 times the buckets') and head counts are the full sweep's, so each is one of its runs.
SWEEP = DEVICES if thorough() else (1, 8)
EXAMPLES = 2
FEATURES = ("causal", "lse")
GROWTH = "ring_size_growth"
UNEVEN = "uneven_lengths"
PLUGIN = ("-p", "no:attnref", "-p", "attnref.conformance.plugin")


def _by_name(report: ConformanceReport) -> dict[str, PropertyResult]:
    return {r.name: r for r in report.results}


def _statuses(result: PropertyResult) -> dict[int, str]:
    return {m.devices: m.status for m in result.meshes}


@pytest.fixture(autouse=True)
def _eight_devices():
    # tests/conftest.py gives the test process 8 virtual CPU devices; fewer is a broken setup
    # (e.g. a caller's own XLA_FLAGS device count), not a reason to skip these properties.
    assert jax.device_count() >= 8, (
        f"needs 8 devices, the process has {jax.device_count()} (tests/conftest.py adds "
        "--xla_force_host_platform_device_count=8 to XLA_FLAGS unless a count is set there)"
    )


# ----------------------------------------------------------------------------- correct kernels


@pytest.mark.parametrize(
    ("name", "properties", "dtypes"),
    [
        ("ring", ("oracle", "causality", "lse", "extreme_logits", GROWTH), ("float32", "bfloat16")),
        # the zigzag's own question is where its chunks go, the same in every dtype
        ("zigzag", ("oracle", "causality", GROWTH), ("float32",)),
    ],
)
def test_correct_ring_kernels_pass_on_1_2_4_8_devices(name, properties, dtypes):
    """A ring (contiguous) and a zigzag ring with the stable float32 merge pass on every mesh
    size; the growth row of each size has its worst error / allowance below 1.

    A sweep over the mesh sizes: 1, 2, 4 and 8 in the ``thorough`` profile, 1 and 8 in ``ci``
    (:data:`SWEEP`; the same lengths and head counts; the sizes 2 and 4 run in ``ci`` in the
    broken kernels' and the uneven lengths' tests below)."""
    report = check_attention(
        getattr(targets, name),
        features=FEATURES,
        properties=properties,
        devices=SWEEP,
        dtypes=dtypes,
        max_examples=EXAMPLES,
        seed=0,
    )
    assert report.passed, report.summary()
    assert report.devices == SWEEP
    for r in report.results:
        assert r.status == "passed", report.summary()
        assert _statuses(r) == dict.fromkeys(SWEEP, "passed")
        assert r.examples == EXAMPLES * len(SWEEP)
    growth = _by_name(report)[GROWTH]
    for m in growth.meshes:
        assert m.ratio is not None and 0.0 < m.ratio <= 1.0, m
    # the table: a row per property and mesh size, the ratio in the growth rows
    text = report.summary()
    assert f"devices {', '.join(map(str, SWEEP))}" in text
    for m in growth.meshes:
        assert any(
            line.split()[:3] == [GROWTH, str(m.devices), "passed"] and f"{m.ratio:.3g}" in line
            for line in text.splitlines()
        ), text


# ----------------------------------------------------------------------------- broken kernels


def test_misordered_zigzag_fails_the_oracle_property_from_two_devices():
    report = check_attention(
        targets.zigzag_misordered,
        features=FEATURES,
        properties=["oracle"],
        devices=(1, 2, 4),
        max_examples=EXAMPLES,
        seed=0,
    )
    (r,) = report.results
    assert r.status == "failed"
    assert _statuses(r) == {1: "passed", 2: "failed", 4: "failed"}
    assert r.detail.startswith("P=2: oracle [float32]: rule 'bound' failed"), r.detail
    assert r.example is not None and "Config(" in r.example
    text = report.summary()
    assert "--- oracle failed at P=2 (seed 0) ---" in text
    assert "--- oracle failed at P=4 (seed 0) ---" in text
    # a functools.partial has no loadable name: the replay calls it fn, on the failing size
    assert "; check_attention(fn, properties=['oracle'], seed=0, features=" in text
    assert f"max_examples={EXAMPLES}, devices=(2,))" in text


def test_naive_lse_merge_overflows_under_extreme_logits():
    """``lse + log(1 + exp(lse_b - lse))`` is exact for logits of order one (``oracle`` passes
    on every mesh) and overflows once two pieces' lse are more than 88 apart: the
    ``extreme_logits`` property (``max |logit|`` up to 1e4) fails on every mesh that merges,
    and passes on one device, which merges nothing."""
    report = check_attention(
        targets.ring_naive_merge,
        features=FEATURES,
        properties=["oracle", "extreme_logits"],
        devices=(1, 2, 8),
        max_examples=3,
        seed=0,
    )
    by_name = _by_name(report)
    assert by_name["oracle"].status == "passed", report.summary()
    extreme = by_name["extreme_logits"]
    assert _statuses(extreme) == {1: "passed", 2: "failed", 8: "failed"}, report.summary()
    assert extreme.detail.startswith("P=2: extreme logits"), extreme.detail
    assert "max_abs_logit=" in extreme.example


def test_state_rounded_to_bfloat16_each_step_fails_ring_size_growth():
    """The running output kept in the input dtype: with bfloat16 inputs, ``oracle`` (the
    comparative rule) passes on every mesh, and ``ring_size_growth`` passes on one device (one
    rounding, what the bound allows) and fails on 2 and 8, by more at 8. With float32 inputs
    the state is float32 and the same function passes."""
    report = check_attention(
        targets.ring_state_in_input_dtype,
        features=FEATURES,
        properties=["oracle", GROWTH],
        devices=(1, 2, 8),
        dtypes=("bfloat16",),
        max_examples=EXAMPLES,
        seed=0,
    )
    by_name = _by_name(report)
    assert by_name["oracle"].status == "passed", report.summary()
    growth = by_name[GROWTH]
    assert _statuses(growth) == {1: "passed", 2: "failed", 8: "failed"}, report.summary()
    ratios = {m.devices: m.ratio for m in growth.meshes}
    assert ratios[1] <= 1.0 < ratios[2] < ratios[8], ratios
    assert growth.detail.startswith(f"P=2: {GROWTH} [P=2, bfloat16, "), growth.detail
    assert "--- ring_size_growth failed at P=8 (seed 0) ---" in report.summary()
    float32 = check_attention(
        targets.ring_state_in_input_dtype,
        features=FEATURES,
        properties=[GROWTH],
        devices=(8,),
        max_examples=EXAMPLES,
        seed=0,
    )
    assert float32.passed, float32.summary()


def test_a_declared_16_bit_format_runs_ring_size_growth_in_it_by_default():
    """A target declares 16-bit support by listing the format in ``dtypes`` next to float32;
    the default distributed check (no ``properties``) then runs ``ring_size_growth`` in it as
    well as in float32, while the other properties but ``oracle`` stay in float32. The ring
    that keeps its running output in the input dtype fails that property alone, from two
    devices, its message naming the growth rule and bfloat16; declared float32 only, the same
    check passes (its state is float32 then); the correct ring passes the bfloat16 check."""
    kw = dict(features=(), devices=(1, 2), max_examples=EXAMPLES, seed=0)
    declared = ("float32", "bfloat16")
    report = check_attention(targets.ring_state_in_input_dtype, dtypes=declared, **kw)
    assert [r.name for r in report.results] == [
        *PROPERTIES,
        GROWTH,
        UNEVEN,
    ], report.summary()
    failed = [r.name for r in report.results if r.status == "failed"]
    assert failed == [GROWTH], report.summary()
    growth = _by_name(report)[GROWTH]
    assert _statuses(growth) == {1: "passed", 2: "failed"}, report.summary()
    assert growth.detail.startswith(f"P=2: {GROWTH} [P=2, bfloat16, none]: |o - oracle| ="), (
        growth.detail
    )
    assert "# failed at: dtype='bfloat16', kind='none'" in growth.example
    assert "dtypes=['float32', 'bfloat16'], devices=(2,))" in report.summary()
    float32 = check_attention(targets.ring_state_in_input_dtype, **kw)
    assert float32.passed, float32.summary()
    correct = check_attention(targets.ring, dtypes=declared, **kw)
    assert correct.passed, correct.summary()
    assert _statuses(_by_name(correct)[GROWTH]) == {1: "passed", 2: "passed"}


# ----------------------------------------------------------------------------- uneven lengths


def test_correct_ring_kernels_refuse_the_lengths_they_cannot_lay_out():
    """``ring`` computes every length on one device and refuses, through ``jax.shard_map``'s
    "not evenly divisible" ``ValueError``, the lengths ``P`` does not divide (the first drawn
    example has offset 1); ``zigzag`` refuses every length ``2P`` does not divide, odd ones on
    one device included, through ``jnp.reshape``'s ``TypeError``. Each size's detail is the
    first refusal's line and the tally."""
    calls = 2 * EXAMPLES  # the kinds none and causal per example
    ring = check_attention(
        targets.ring, features=FEATURES, properties=[UNEVEN], devices=DEVICES, max_examples=EXAMPLES
    )
    (r,) = ring.results
    assert r.status == "passed" and _statuses(r) == dict.fromkeys(DEVICES, "passed"), ring.summary()
    details = {m.devices: m.detail for m in r.meshes}
    assert details[1] == f"0 of {calls} calls refused, {calls} computed and equal to the oracle"
    for p in DEVICES[1:]:
        assert details[p].startswith("refused: ValueError: shard_map applied to"), details[p]
        assert "not evenly divisible" in details[p] and " at 0x" not in details[p]
    zigzag = check_attention(
        targets.zigzag,
        features=FEATURES,
        properties=[UNEVEN],
        devices=DEVICES,
        max_examples=EXAMPLES,
    )
    (z,) = zigzag.results
    assert z.status == "passed", zigzag.summary()
    for m in z.meshes:
        assert m.detail.startswith("refused: TypeError: cannot reshape array of shape"), m.detail
        assert m.detail.endswith(
            f"; {calls} of {calls} calls refused, 0 computed and equal to the oracle"
        )
    assert any(
        line.split()[:3] == [UNEVEN, "2", "passed"] and "refused: TypeError" in line
        for line in zigzag.summary().splitlines()
    ), zigzag.summary()


def test_attnref_zigzag_pads_inside_and_computes_the_exact_answer():
    """attnref's zigzag pads lengths ``2P`` does not divide and masks the padding: every call
    computes, equal to the oracle, on 1, 2 and 4 devices; the kernel saw only such lengths, with
    ``T == S`` and ``T != S``.

    A sweep over the mesh sizes: 1, 2 and 4 in the ``thorough`` profile, 1 and 4 in ``ci``
    (the same buckets: lengths times 2 lcm = 8)."""
    sweep = (1, 2, 4) if thorough() else (1, 4)
    seen = set()

    def spy(query, key, value, *, mesh, **kw):
        seen.add((mesh.size, query.shape[1], key.shape[1]))
        return zigzag_dot_product_attention(query, key, value, mesh=mesh, **kw)

    report = check_attention(
        spy, features=(*FEATURES, "cross"), properties=[UNEVEN], devices=sweep, max_examples=2
    )
    (r,) = report.results
    assert r.status == "passed", report.summary()
    for m in r.meshes:
        assert m.detail == "0 of 4 calls refused, 4 computed and equal to the oracle", m.detail
    assert {p for p, _, _ in seen} == set(sweep)
    assert all(t % (2 * p) and s % (2 * p) for p, t, s in seen), seen
    assert any(t == s for _, t, s in seen) and any(t != s for _, t, s in seen), seen


def test_padded_unmasked_zigzag_fails_uneven_lengths_on_every_size():
    """Padding to a multiple of ``2P`` without masking the padded keys is right on the lengths
    of every other property (``oracle`` passes) and wrong on any other length, non-causal, on
    every mesh size: on one device a zigzag still cuts the sequence in two."""
    report = check_attention(
        targets.zigzag_padded_unmasked,
        features=FEATURES,
        properties=["oracle", UNEVEN],
        devices=(1, 2, 4),
        max_examples=1,
    )
    by_name = _by_name(report)
    assert by_name["oracle"].status == "passed", report.summary()
    r = by_name[UNEVEN]
    assert _statuses(r) == {1: "failed", 2: "failed", 4: "failed"}, report.summary()
    assert r.detail.startswith(f"P=1: {UNEVEN} [P=1, T="), r.detail
    assert "float32, none]: rule 'bound' failed" in r.detail and r.traceback is None
    assert "t_offset=" in r.example
    text = report.summary()
    for p in (2, 4):
        assert f"--- {UNEVEN} failed at P={p} (seed 0) ---" in text
        assert f"{UNEVEN} [P={p}, T=" in text


def _no_uneven_answer(how):
    """A distributed target that, on the uneven lengths, raises ``how`` (an exception), returns
    NaN (``"nan"``) or returns its output one row short (``"short"``)."""

    def kernel(query, key, value, *, mesh):
        if isinstance(how, Exception):
            raise how
        b, t, n, _ = query.shape
        if how == "nan":
            return jnp.full((b, t, n, value.shape[-1]), jnp.nan, query.dtype)
        return jnp.zeros((b, t - 1, n, value.shape[-1]), query.dtype)

    return kernel


@pytest.mark.parametrize(
    ("how", "status", "detail"),
    [
        (
            NotImplementedError("sequence length must be a multiple of 2 x devices"),
            "passed",
            "refused: NotImplementedError: sequence length must be a multiple of 2 x devices; "
            "1 of 1 calls refused",
        ),
        (
            ValueError("block table out of range"),
            "failed",
            f"P=1: {UNEVEN} [P=1, T=9, S=9, float32, none]: fn raised ValueError: block table "
            "out of range; not a refusal",
        ),
        (IndexError("chunk 3 of 2"), "failed", "fn raised IndexError: chunk 3 of 2; not a refusal"),
        ("nan", "failed", f"P=1: {UNEVEN} [P=1, T=9, S=9, float32, none]: NaN at index"),
        ("short", "failed", "output [B, T, N, H_v] with shape (2, 8, 2, 4); expected (2, 9, 2, 4)"),
    ],
    ids=["clear-refusal", "unclear-valueerror", "indexerror", "nan", "short"],
)
def test_uneven_lengths_outcome_rule(how, status, detail):
    """A refusal is a ValueError, NotImplementedError or TypeError that names the length; any
    other exception, a NaN output or a wrong shape fails (the exception with its traceback). On
    one device the lengths are the bucket's 4 x 2 lcm(1) = 8, plus 1."""
    report = check_attention(
        _no_uneven_answer(how), features=(), properties=[UNEVEN], devices=(1,), max_examples=1
    )
    (r,) = report.results
    assert r.status == status, report.summary()
    (m,) = r.meshes
    assert detail in (m.detail if status == "passed" else r.detail), r
    if isinstance(how, Exception) and status == "failed":
        assert r.traceback is not None and "in kernel" in r.traceback, r.traceback
        assert "whose message contains one of divisib, divide, multiple" in r.detail
    elif status == "failed":
        assert r.traceback is None


# ----------------------------------------------------------------------------- options, report


def test_devices_options_are_checked():
    with pytest.raises(ValueError, match=r"mesh of 16 devices but this host has 8") as exc:
        check_attention(targets.ring, devices=(1, 16))
    assert "XLA_FLAGS=--xla_force_host_platform_device_count=16" in str(exc.value)
    for bad in ((), (0, 2), (True,)):
        with pytest.raises(ValueError, match="devices must be a non-empty list of positive ints"):
            check_attention(targets.ring, devices=bad)
    with pytest.raises(ValueError, match="devices= needs signature 'jax_nn'"):
        check_attention(targets.ring, signature="numpy", devices=(2,))
    with pytest.raises(ValueError, match="devices= runs the small shapes only"):
        check_attention(targets.ring, shapes="production", devices=(2,))
    with pytest.raises(TypeError, match="takes no mesh keyword"):
        check_attention(targets.good, devices=(2,))


def test_growth_needs_devices_and_defaults_follow_them():
    report = check_attention(targets.ring, features=FEATURES, properties=[GROWTH])
    (r,) = report.results
    assert r.status == "skipped" and "needs devices=" in r.detail
    assert report.devices == () and "P " not in report.summary().splitlines()[3]
    assert DISTRIBUTED_PROPERTIES == (GROWTH, UNEVEN)
    assert (*PROPERTIES, GROWTH, UNEVEN) == ALL_PROPERTIES
    assert Options(target="m:f").selected() == PROPERTIES
    assert Options(target="m:f", devices=(1, 2)).selected() == (*PROPERTIES, GROWTH, UNEVEN)
    uneven = check_attention(targets.ring, features=FEATURES, properties=[UNEVEN])
    assert uneven.results[0].status == "skipped" and "needs devices=" in uneven.results[0].detail


def test_report_json_and_skips_with_devices():
    """Skipped properties have no per-mesh rows; the JSON holds every mesh result."""
    report = check_attention(
        targets.zigzag_misordered,
        features=FEATURES,
        properties=["oracle", "gqa"],
        devices=(1, 2),
        max_examples=1,
        seed=0,
    )
    by_name = _by_name(report)
    assert by_name["gqa"].status == "skipped" and by_name["gqa"].meshes == ()
    data = report.to_dict()
    assert json.loads(json.dumps(data)) == data
    assert data["devices"] == [1, 2]
    oracle = next(r for r in data["results"] if r["name"] == "oracle")
    assert [(m["devices"], m["status"]) for m in oracle["meshes"]] == [
        (1, "passed"),
        (2, "failed"),
    ]


# ----------------------------------------------------------------------------- CLI and plugin


def test_cli_devices(capsys):
    target = "tests.conformance_targets:zigzag_misordered"
    args = ["--features", "causal", "--properties", "oracle", "--max-examples", "1"]
    status = main(["check", target, *args, "--devices", "1,2", "--no-progress"])
    out, _ = capsys.readouterr()
    assert status == 1, out
    assert "(signature 'jax_nn', devices 1, 2)" in out
    assert "--- oracle failed at P=2" in out
    assert f"attnref check {target} --properties oracle --seed 0 --features causal" in out
    assert out.rstrip().endswith("--devices 2"), out  # the replay runs the failing size alone
    for devices, message in (("1,16", "XLA_FLAGS="), ("1,two", "comma-separated mesh sizes")):
        with pytest.raises(SystemExit) as exc:
            main(["check", target, *args, "--devices", devices])
        assert exc.value.code == 2
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["check", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "xla_force_host_platform_device_count=8" in help_text
    # --dtypes and --devices: growth runs in every listed format; 16-bit merges in float32
    sentence = (
        "A 16-bit merge of partial states must accumulate in float32 (the running output and "
        "lse), else the error grows with the ring size"
    )
    assert sentence in help_text
    assert (
        "ring_size_growth (in every --dtypes format: a 16-bit merge of partial states must "
        "accumulate in float32" in help_text
    )
    assert "K/V head counts of lcm(sizes), so a head-parallel kernel can split them" in help_text


def test_plugin_devices(pytester):
    target = "tests.conformance_targets:ring_naive_merge"
    result = pytester.runpytest_inprocess(
        *PLUGIN,
        "-p",
        "no:cacheprovider",
        "-rsxXf",
        "--pyargs",
        "attnref.conformance",
        f"--attnref-target={target}",
        "--attnref-devices=1,2",
        "--attnref-features=causal",
        "--attnref-properties=extreme_logits",
        "--attnref-examples=3",
    )
    result.assert_outcomes(failed=1, skipped=7)  # the 7 state-merge tests: no merge target
    result.stdout.fnmatch_lines(
        [
            f"attnref: target {target} (signature jax_nn, features causal, seed 0, devices 1,2)",
            "*P=2: extreme logits*",
            "*per mesh size: P=1 passed, P=2 failed*",
            f"*attnref check {target} --properties extreme_logits --seed 0 * --devices 2",
        ]
    )
    usage = pytester.runpytest_inprocess(
        *PLUGIN, "--pyargs", "attnref.conformance", "--attnref-devices=64"
    )
    assert usage.ret == pytest.ExitCode.USAGE_ERROR
    usage.stderr.fnmatch_lines(["*attnref: devices=(64,) asks for a mesh of 64 devices*"])


def test_the_target_gets_the_mesh_its_axis_and_sharded_inputs():
    """A target is called with the kit's mesh over the first P devices (cached, axis
    ``"devices"``) and, where it names the parameter, ``axis_name``; ``q, k, v`` arrive sharded
    along the sequence axis."""
    from attnref.conformance import AXIS, Target, mesh

    seen = []

    def spy(query, key, value, *, mesh, axis_name=None):
        seen.append((mesh, axis_name))
        return targets.ring(query, key, value, mesh=mesh, axis_name=axis_name)

    report = check_attention(spy, features=(), properties=["oracle"], devices=(4,), max_examples=1)
    assert report.passed, report.summary()
    m4 = mesh(4)
    assert m4 is mesh(4) and m4.axis_names == (AXIS,) and list(m4.devices) == jax.devices()[:4]
    assert seen and all(s == (m4, AXIS) for s in seen)
    q = np.zeros((1, 8, 1, 4), np.float32)
    placed = Target(spy, "jax_nn", m4)._sharded((q, q, q, {}))
    for x in placed[:3]:
        assert x.sharding == jax.sharding.NamedSharding(m4, jax.sharding.PartitionSpec(None, AXIS))
