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
  16-bit roundings), and ``ring_size_growth`` fails, by a factor that grows with ``P``.

Few examples, lengths multiplied by ``2 lcm(devices)`` from the kit's small buckets, and one
compiled program per (target, mesh size, bucket, option set), reused across examples.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from attnref.cli import main
from attnref.conformance import Options
from attnref.testing import (
    ALL_PROPERTIES,
    PROPERTIES,
    ConformanceReport,
    PropertyResult,
    check_attention,
)

from . import conformance_targets as targets

pytest_plugins = ["pytester"]

DEVICES = (1, 2, 4, 8)
EXAMPLES = 2
FEATURES = ("causal", "lse")
GROWTH = "ring_size_growth"
PLUGIN = ("-p", "no:attnref", "-p", "attnref.conformance.plugin")


def _by_name(report: ConformanceReport) -> dict[str, PropertyResult]:
    return {r.name: r for r in report.results}


def _statuses(result: PropertyResult) -> dict[int, str]:
    return {m.devices: m.status for m in result.meshes}


@pytest.fixture(autouse=True)
def _eight_devices():
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices (tests/conftest.py sets XLA_FLAGS for 8 virtual CPUs)")


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
    size; the growth row of each size has its worst error / allowance below 1."""
    report = check_attention(
        getattr(targets, name),
        features=FEATURES,
        properties=properties,
        devices=DEVICES,
        dtypes=dtypes,
        max_examples=EXAMPLES,
        seed=0,
    )
    assert report.passed, report.summary()
    assert report.devices == DEVICES
    for r in report.results:
        assert r.status == "passed", report.summary()
        assert _statuses(r) == dict.fromkeys(DEVICES, "passed")
        assert r.examples == EXAMPLES * len(DEVICES)
    growth = _by_name(report)[GROWTH]
    for m in growth.meshes:
        assert m.ratio is not None and 0.0 < m.ratio <= 1.0, m
    # the table: a row per property and mesh size, the ratio in the growth rows
    text = report.summary()
    assert f"devices {', '.join(map(str, DEVICES))}" in text
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
    assert "replay: check_attention(fn, properties=['oracle'], devices=(2,), seed=0" in text


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
    assert (*PROPERTIES, GROWTH) == ALL_PROPERTIES
    assert Options(target="m:f").selected() == PROPERTIES
    assert Options(target="m:f", devices=(1, 2)).selected() == (*PROPERTIES, GROWTH)


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
    assert "xla_force_host_platform_device_count=8" in " ".join(capsys.readouterr().out.split())


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
    result.assert_outcomes(failed=1, skipped=6)  # the 6 state-merge tests: no merge target
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
    from attnref._src.conformance.targets import AXIS, _Target, mesh

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
    placed = _Target(spy, "jax_nn", m4)._sharded((q, q, q, {}))
    for x in placed[:3]:
        assert x.sharding == jax.sharding.NamedSharding(m4, jax.sharding.PartitionSpec(None, AXIS))
