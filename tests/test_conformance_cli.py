"""``attnref check`` and the pytest plugin (``pytest --pyargs attnref.conformance``).

The targets live in ``tests/conformance_targets.py``. Engine runs use a handful of examples and,
except for the one full ``attnref check`` run, a single property: this file tests the surfaces
(exit status, table, failure text, pytest outcomes), ``tests/test_conformance.py`` the engine.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import attnref
from attnref.cli import main
from attnref.conformance import (
    ALIGNMENTS,
    MASKED_ROWS,
    PROPERTIES,
    OptionError,
    Options,
    read_xfail_file,
)
from attnref.testing import MERGE_PROPERTIES, check_attention

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[1]
GOOD = "tests.conformance_targets:good"
BROKEN = "tests.conformance_targets:wrong_scale"
# The plugin by module name, whether or not the installed metadata registers the entry point
# (an editable install made before the entry point existed does not): block the entry-point
# name so the module is never registered twice.
PLUGIN = ("-p", "no:attnref", "-p", "attnref.conformance.plugin")


# --- attnref check ------------------------------------------------------------------------


def test_check_passes_on_jax_nn_with_declared_uniform_masked_rows(capsys):
    # A subset keeps this fast; tests/test_conformance.py runs every property on jax.nn.
    chosen = ["oracle", "gqa", "fully_masked_rows", "extreme_logits"]
    args = ["--max-examples", "3", "--masked-rows", "uniform", "--properties", ",".join(chosen)]
    status = main(["check", GOOD, *args])
    out, err = capsys.readouterr()
    assert status == 0, out
    for name in chosen:
        assert name in out
    assert "masked_rows=uniform" in out  # a declared difference, listed
    assert "4 passed, 0 failed" in out
    assert "4/4" not in err and "\x1b" not in err  # no progress bar: stderr is no terminal


def test_check_fails_on_a_broken_kernel_with_example_and_replay(capsys):
    status = main(["check", BROKEN, "--max-examples", "3", "--properties", "oracle"])
    out, _ = capsys.readouterr()
    assert status == 1, out
    assert "oracle" in out and "failed" in out
    assert "--- oracle failed (seed " in out
    # the shrunk example, in words that are attnref's own (Hypothesis heads it "Falsifying
    # example:" before 6.15x and "Failing test case:" after): the drawn problem and its note
    assert "KernelProblem(Config(" in out and "config=Config(" in out
    assert f"attnref check {BROKEN} --properties oracle --seed" in out  # the replay line


def test_production_shapes_catch_a_fault_past_the_first_128_key_tile(capsys):
    """``past_tile`` drops the keys of a partial last tile: the production sweep (``--shapes
    production``, its first two cases per property) fails it at S = 129 with the case named,
    times each property and prints the replay (the default run's tile lengths catch it too:
    tests/test_conformance_tiles.py)."""
    target = "tests.conformance_targets:past_tile"
    common = ["--masked-rows", "uniform", "--properties", "oracle,masks", "--max-examples", "2"]
    status = main(["check", target, *common, "--shapes", "production", "--verbose"])
    out, err = capsys.readouterr()
    assert status == 1, out
    assert "shapes 'production'" in out
    assert "--- masks failed" in out
    assert "production case 1/2: B=1 T=129 S=129" in out
    assert re.search(r"oracle 1/2: B=1 T=\d+ S=\d+ .* \(\d+\.\d s\)", err)  # a line per case
    assert "--shapes production" in out  # the replay line


def test_production_shapes_pass_jax_nn_first_cases():
    """jax.nn passes the first production cases of every property (the full sweep, minutes on
    two cores, is in docs/benchmarks.md)."""
    report = check_attention(
        jax.nn.dot_product_attention, masked_rows="uniform", shapes="production", max_examples=1
    )
    assert report.passed, report.summary()
    ran = {r.name for r in report.results if r.status == "passed"}
    assert {"oracle", "masks", "gqa", "lse", "gradients", "fully_masked_rows"} <= ran


@pytest.mark.parametrize(
    ("target", "prop", "message"),
    [
        ("padded_broadcast", "masks", "masks [neg_inf_bias: {bias=float32[1, 1, 1, 4]}]"),
        ("raises", "oracle", "Traceback (most recent call last):"),
    ],
)
def test_check_rejects_issue_11_targets(capsys, target, prop, message):
    """``attnref check`` rejects the pre-fix blockwise defect (through the masks property's
    broadcast shapes) and shows a raising kernel's traceback."""
    spec = f"tests.conformance_targets:{target}"
    args = ["--max-examples", "2", "--properties", prop, "--features", "bias", "--no-progress"]
    status = main(["check", spec, *args])
    out, _ = capsys.readouterr()
    assert status == 1, out
    assert message in out, out


def test_check_merge_passes_attnref_and_fails_the_naive_merge(capsys):
    """``attnref check-merge``: attnref's own merge passes every state-algebra property, its
    gradients included (exit 0); ``--no-grad`` skips the gradients; the naive
    ``lse + log(1 + exp(lse_b - lse))`` fails stability and identity (exit 1, each failure with
    its example and replay); a bad option or target exits 2."""
    assert main(["check-merge", "attnref:merge_states", "--max-examples", "2"]) == 0
    out = capsys.readouterr().out
    assert "7 passed, 0 failed" in out and "PASS" in out and "features: grad" in out
    args = ["--properties", "gradients", "--no-grad"]
    assert main(["check-merge", "attnref:merge_states", *args]) == 0
    out = capsys.readouterr().out
    assert "0 passed, 0 failed, 1 skipped" in out and "grad=False" in out, out
    naive = "tests.conformance_targets:merge_states_naive"
    code = main(["check-merge", naive, "--max-examples", "3", "--properties", "stability,identity"])
    out = capsys.readouterr().out
    assert code == 1
    assert re.search(r"stability\s+failed", out) and re.search(r"identity\s+failed", out), out
    replay = next(line for line in out.splitlines() if "properties=['stability']" in line)
    assert replay == (
        "replay: from attnref.testing import check_merge_states, load_target; "
        "check_merge_states(load_target('tests.conformance_targets:merge_states_naive'), "
        "properties=['stability'], seed=0, max_examples=3)"
    )
    with pytest.raises(SystemExit) as exc:
        main(["check-merge", "attnref:merge_states", "--properties", "bogus"])
    assert exc.value.code == 2 and "unknown properties" in capsys.readouterr().err
    assert main(["check-merge", "no_such_module_xyz:merge"]) == 2


def test_check_json(capsys):
    args = ["--max-examples", "2", "--properties", "oracle", "--json", "--no-progress"]
    status = main(["check", BROKEN, *args])
    out, err = capsys.readouterr()
    assert status == 1
    assert err == ""
    report = json.loads(out)
    assert [r["name"] for r in report["results"]] == ["oracle"]
    assert report["results"][0]["status"] == "failed"


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("tests.conformance_targets:missing", "missing"),
        ("no_such_module_for_attnref:attention", "no_such_module_for_attnref"),
        ("tests.conformance_targets", "package.module:function"),
        ("tests.conformance_targets:NOT_CALLABLE", "not a callable"),
    ],
)
def test_check_bad_target_exits_2(capsys, target, message):
    assert main(["check", target, "--no-progress"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert "attnref check: " in err and message in err


def test_check_bad_option_exits_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["check", GOOD, "--properties", "oracle,no_such_property"])
    assert exc.value.code == 2
    assert "no_such_property" in capsys.readouterr().err


def test_console_script_finds_targets_in_the_current_directory():
    """``attnref check`` is a console script: ``sys.path`` starts at its own directory, not the
    project's, so the command appends the current directory to find ``tests.*``."""
    script = shutil.which("attnref", path=str(Path(sys.executable).parent))
    if script is None:
        pytest.skip("the attnref console script is not installed next to this interpreter")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run(
        [script, "check", "tests.conformance_targets:NOT_CALLABLE"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2, run.stderr
    assert "is a int, not a callable" in run.stderr  # imported, so the module was found


def _glibc_with_hugetlb() -> bool:
    """glibc >= 2.35 on Linux, the first release with the ``glibc.malloc.hugetlb`` tunable."""
    libc = os.confstr("CS_GNU_LIBC_VERSION") if hasattr(os, "confstr") else None
    name, _, version = (libc or "").partition(" ")
    release = tuple(int(part) for part in version.split(".")[:2]) if version else ()
    return sys.platform.startswith("linux") and name == "glibc" and release >= (2, 35)


@pytest.mark.parametrize(
    ("given", "seen"),
    [
        ("glibc.malloc.arena_max=4", "glibc.malloc.arena_max=4:glibc.malloc.hugetlb=1"),
        ("glibc.malloc.hugetlb=0", "glibc.malloc.hugetlb=0"),  # the caller's choice stays
    ],
)
def test_check_runs_with_malloc_huge_pages(tmp_path, given, seen):
    """``attnref check`` restarts once with ``glibc.malloc.hugetlb=1`` added to the caller's
    ``GLIBC_TUNABLES`` (glibc >= 2.35), unless they name it: the target, loaded by the process
    that runs the check, reads the environment it ran under."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import os\n"
        "with open(os.environ['PROBE_OUT'], 'w') as fh:\n"
        "    fh.write(os.environ.get('GLIBC_TUNABLES', '<unset>'))\n"
        "fn = 1\n"
    )
    out = tmp_path / "tunables.txt"
    env = {**os.environ, "GLIBC_TUNABLES": given, "PROBE_OUT": str(out)}
    run = subprocess.run(
        [sys.executable, "-m", "attnref", "check", f"{probe}:fn"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2, run.stderr  # loaded once, then refused: fn is not callable
    assert run.stderr.count("not a callable") == 1, run.stderr
    assert out.read_text() == (seen if _glibc_with_hugetlb() else given)


@pytest.mark.parametrize(
    ("options", "cli", "engine"),
    [
        (
            {"signature": "pytorch"},
            "signature 'pytorch' is not one of jax_nn, qkv_mask, numpy, torch",
            "signature must be one of",
        ),
        ({"features": ("mask", "nope")}, "unknown feature 'nope'; choose from", "unknown features"),
        ({"properties": ("nope",)}, "unknown property 'nope'; choose from", "unknown properties"),
        (
            {"causal_alignment": "left"},
            "causal_alignment 'left' is not one of ('top_left', 'bottom_right')",
            "causal_alignment must be one of",
        ),
        ({"max_examples": 0}, "max_examples must be at least 1, got 0", "max_examples must be >="),
        (
            {"shapes": "huge"},
            "shapes 'huge' is not one of ('small', 'production')",
            "shapes must be one of",
        ),
    ],
)
def test_options_run_the_engines_checks_in_the_clis_words(options, cli, engine):
    """``Options.validate`` calls ``check_attention``'s own checks (one place for each) and
    words their rejection for the CLI; the accepted semantics are the kernel's own names."""
    q = np.zeros((1, 2, 1, 2), np.float32)
    for rows in MASKED_ROWS:  # the CLI's choices are names the kernel accepts
        attnref.dot_product_attention(q, q, q, masked_rows=rows)
    for alignment in ALIGNMENTS:
        attnref.dot_product_attention(q, q, q, is_causal=True, causal_alignment=alignment)
    with pytest.raises(ValueError, match=f"^{re.escape(cli)}") as exc:
        Options(target="pkg.mod:fn", **options).validate()
    assert isinstance(exc.value.__cause__, OptionError)
    assert str(exc.value.__cause__).startswith(engine)


def test_replay_command_and_xfail_file(tmp_path):
    opts = Options(target="pkg.mod:fn", signature="numpy", masked_rows="uniform", max_examples=5)
    assert opts.replay_command("causality", 123) == (
        "attnref check pkg.mod:fn --properties causality --seed 123 --signature numpy "
        "--max-examples 5 --masked-rows uniform"
    )
    production = Options(target="pkg.mod:fn", shapes="production", max_examples=3)
    assert production.replay_command("masks", 0) == (
        "attnref check pkg.mod:fn --properties masks --seed 0 --max-examples 3 --shapes production"
    )
    path = tmp_path / "xfails.txt"
    path.write_text("# known\noracle  # scale bug, #12\n\ntest_property[gqa]\n")
    assert read_xfail_file(path, PROPERTIES) == {
        "oracle": "scale bug, #12",
        "gqa": f"listed in {path}",
    }
    path.write_text("oracel\n")
    with pytest.raises(ValueError, match="oracel"):
        read_xfail_file(path, PROPERTIES)


# --- the pytest plugin --------------------------------------------------------------------


# The shipped file's state-merge tests, which skip without --attnref-merge-target.
NO_MERGE = len(MERGE_PROPERTIES)


def _run(pytester, *args):
    return pytester.runpytest_inprocess(
        *PLUGIN, "-p", "no:cacheprovider", "-rsxXf", "--pyargs", "attnref.conformance", *args
    )


def test_plugin_without_target_skips_every_property(pytester):
    result = _run(pytester)
    result.assert_outcomes(skipped=len(PROPERTIES) + NO_MERGE)
    result.stdout.fnmatch_lines(["*no --attnref-target given*"])


def test_plugin_passes_skips_and_reports_declared_semantics(pytester):
    result = _run(
        pytester,
        f"--attnref-target={GOOD}",
        "--attnref-masked-rows=uniform",
        "--attnref-features=mask,bias",
        "--attnref-examples=2",
        "--attnref-properties=oracle,lse",
    )
    result.assert_outcomes(passed=1, skipped=1 + NO_MERGE)  # lse: not a declared feature
    result.stdout.fnmatch_lines(
        [
            f"attnref: target {GOOD} (signature jax_nn, features mask,bias, seed 0, "
            "declared masked_rows=uniform)",
            "SKIPPED*lse: *",
        ]
    )


def test_plugin_failure_shows_message_example_and_seed(pytester):
    args = ("--attnref-examples=2", "--attnref-properties=oracle")
    result = _run(pytester, f"--attnref-target={BROKEN}", *args)
    result.assert_outcomes(failed=1, skipped=NO_MERGE)
    result.stdout.fnmatch_lines(
        [
            "*property 'oracle' failed*",
            f"*replay (seed *): attnref check {BROKEN} --properties oracle --seed *"
            " --max-examples 2",
        ]
    )


def test_plugin_checks_a_merge_target(pytester):
    """``--attnref-merge-target``: one test per state-algebra property; attnref's merge passes
    them, the naive merge fails stability (the attention tests skip without a target)."""
    good = _run(pytester, "--attnref-merge-target=attnref:merge_states", "--attnref-examples=2")
    good.assert_outcomes(passed=NO_MERGE, skipped=len(PROPERTIES))
    naive = _run(
        pytester,
        "--attnref-merge-target=tests.conformance_targets:merge_states_naive",
        "--attnref-examples=3",
        "-k",
        "stability",
    )
    naive.assert_outcomes(failed=1)
    naive.stdout.fnmatch_lines(["*stability*failed*"])


def test_plugin_production_shapes(pytester):
    """``--attnref-shapes production`` reaches the engine: the tiling fault fails ``masks`` at its
    first production case (S = 129), the replay line carries the option."""
    target = "tests.conformance_targets:past_tile"
    args = ("--attnref-examples=1", "--attnref-properties=masks", "--attnref-masked-rows=uniform")
    result = _run(pytester, f"--attnref-target={target}", "--attnref-shapes=production", *args)
    result.assert_outcomes(failed=1, skipped=NO_MERGE)
    result.stdout.fnmatch_lines(["*production case 1/1: B=1 T=129 S=129*", "*--shapes production*"])


def test_plugin_head_dim(pytester):
    """``--attnref-head-dim 16`` reaches the engine: a kernel refusing head dims under 16 (the
    small shapes' default is 4) passes ``oracle``."""
    target = "tests.test_declared_limits:_needs_wide_heads"
    args = ("--attnref-examples=2", "--attnref-properties=oracle")
    result = _run(pytester, f"--attnref-target={target}", "--attnref-head-dim=16", *args)
    result.assert_outcomes(passed=1, skipped=NO_MERGE)


def test_plugin_head_dim_pair(pytester):
    """``--attnref-head-dim=8,4`` reaches the engine: a kernel taking its default scale from
    ``H_v`` fails ``oracle``; a bad pair is a usage error naming the flag."""
    target = "tests.test_declared_limits:_scale_from_value_dim"
    args = (f"--attnref-target={target}", "--attnref-examples=2", "--attnref-properties=oracle")
    _run(pytester, *args, "--attnref-head-dim=8,4").assert_outcomes(failed=1, skipped=NO_MERGE)
    result = _run(pytester, *args, "--attnref-head-dim=8,x")
    result.stderr.fnmatch_lines(["*attnref: --attnref-head-dim: head-dim must be H or H,H_v*"])


def test_plugin_refuses_lengths(pytester):
    """``--attnref-refuses-lengths`` reaches the engine: a kernel refusing lengths 4 does not
    divide passes ``oracle`` with it and fails without it."""
    target = "tests.test_declared_limits:_blocked"
    args = (f"--attnref-target={target}", "--attnref-examples=12", "--attnref-properties=oracle")
    _run(pytester, *args, "--attnref-refuses-lengths").assert_outcomes(passed=1, skipped=NO_MERGE)
    _run(pytester, *args).assert_outcomes(failed=1, skipped=NO_MERGE)


def test_plugin_xfail_file(pytester):
    xfails = pytester.makefile(".txt", xfails="# kernels/attention.py has the scale bug\noracle\n")
    result = _run(
        pytester,
        f"--attnref-target={BROKEN}",
        "--attnref-examples=2",
        "--attnref-properties=oracle",
        f"--attnref-xfail={xfails}",
    )
    result.assert_outcomes(xfailed=1, skipped=NO_MERGE)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--attnref-target=tests.conformance_targets:missing"], "*cannot load target*missing*"),
        ([f"--attnref-target={GOOD}", "--attnref-features=mask,nope"], "*unknown feature 'nope'*"),
        ([f"--attnref-target={GOOD}", "--attnref-xfail=/no/such/file"], "*/no/such/file*"),
    ],
)
def test_plugin_usage_errors(pytester, args, message):
    result = _run(pytester, *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*attnref: {message}"])


def test_entry_point_and_testpaths_are_declared():
    """``pytest11`` registers the plugin; attnref's own run (testpaths ``tests``) never collects
    the shipped ``attnref/conformance/test_conformance.py``."""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["entry-points"]["pytest11"] == {
        "attnref": "attnref.conformance.plugin"
    }
    assert project["tool"]["pytest"]["ini_options"]["testpaths"] == ["tests"]


def test_docs_testing_your_kernel_examples_run(monkeypatch):
    """docs/testing_your_kernel.md: its kernel passes, its broken kernel fails the oracle
    property, its distributed ring passes on 1 and 2 devices, and its examples of
    assert_matches_oracle (with pytest.raises on the broken kernel) and assert_attention_close
    run."""
    import types

    from attnref.testing import check_attention

    text = (ROOT / "docs" / "testing_your_kernel.md").read_text()
    blocks = [b.split("```", 1)[0] for b in text.split("```python\n")[1:]]
    named = {b.splitlines()[0].removeprefix("# "): b for b in blocks if b.startswith("# mypkg/")}
    assert sorted(named) == [
        "mypkg/broken.py",
        "mypkg/kernels.py",
        "mypkg/merge.py",
        "mypkg/ring.py",
    ]
    examples = [b for b in blocks if not b.startswith("# mypkg/")]
    assert [("assert_matches_oracle(" in b, "assert_attention_close(" in b) for b in examples] == [
        (True, False),
        (False, True),
    ]
    package = types.ModuleType("mypkg")
    monkeypatch.setitem(sys.modules, "mypkg", package)
    modules = {}
    for name in ("kernels", "broken", "ring"):
        module = types.ModuleType(f"mypkg.{name}")
        monkeypatch.setitem(sys.modules, f"mypkg.{name}", module)
        setattr(package, name, module)
        exec(compile(named[f"mypkg/{name}.py"], f"docs mypkg/{name}.py", "exec"), module.__dict__)
        modules[name] = module
    features = ["mask", "bias", "causal", "gqa", "cross", "grad"]
    kw = dict(features=features, properties=["oracle", "gqa"], max_examples=3)
    assert check_attention(modules["kernels"].attention, **kw).passed
    report = check_attention(modules["broken"].attention, **kw)
    assert [r.status for r in report.results] == ["failed", "failed"]
    if jax.device_count() >= 2:
        report = check_attention(
            modules["ring"].attention,
            features=("gqa", "cross"),
            properties=["ring_size_growth"],
            devices=(1, 2),
            dtypes=("float32", "bfloat16"),
            max_examples=2,
        )
        assert report.passed, report.summary()
    for i, src in enumerate(examples):
        exec(compile(src, f"docs example {i}", "exec"), {})
