"""The ``attnref`` command line behaves like the tools people use.

* a bad flag or value is argparse's usage and one-line error (exit 2), a user's mistake found
  inside a command one line ``attnref <command>: error: ...`` (exit 2), never a traceback;
* a closed pipe (``attnref list | head -1``) and Ctrl-C end quietly (exit 141 and 130);
* output to a pipe is plain ASCII text (no ANSI code, no line wrapped at 80 columns) and a
  progress bar is drawn only when stderr is a terminal (a fake terminal in-process, a real
  pseudo-terminal in one subprocess).

The commands run in-process (``cli.main``) wherever they can; three subprocesses (about 3 s each:
JAX starts) check what only a real process shows. ``tests/test_conformance_cli.py`` and
``tests/test_registry.py`` check the commands' results; this file checks how they are shown.
"""

from __future__ import annotations

import io
import os
import pty
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from rich.console import Console

from attnref import cli, ids
from attnref import report as report_mod
from attnref.cli import console
from attnref.testing import ConformanceReport, MeshResult, PropertyResult

ROOT = Path(__file__).resolve().parents[1]
GOOD = "tests.conformance_targets:good"
# One cheap property of jax.nn (its fully masked rows are uniform, a declared difference).
CHECK = ["check", GOOD, "--properties", "oracle", "--max-examples", "1", "--masked-rows", "uniform"]
SUMMARY = "1 passed, 0 failed, 0 skipped: PASS"
ANSI = re.compile(r"\x1b\[")
# What the progress bar draws: rich's bar glyphs, a carriage return, the step count.
PROGRESS = re.compile(r"\r|\u2501|\u2578|\u257a| 0/1 | 1/1 ")


class FakeTerminal(io.StringIO):
    """A captured stream that says it is a terminal."""

    def isatty(self) -> bool:
        return True


class ClosedPipe(io.StringIO):
    """stdout whose reader has gone (``attnref list | head -1`` after head exits)."""

    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")


class Interrupted(io.StringIO):
    """stdout of a command the user stops with Ctrl-C while it prints."""

    def write(self, text: str) -> int:
        raise KeyboardInterrupt


@pytest.fixture
def terminal_env(monkeypatch):
    """An ordinary colour terminal, whatever the environment running the tests says."""
    monkeypatch.setenv("TERM", "xterm-256color")
    for name in ("NO_COLOR", "FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "COLUMNS"):
        monkeypatch.delenv(name, raising=False)


def _one_error_line(err: str, command: str) -> str:
    """The stderr of a user's mistake: exactly one line ``attnref <command>: error: ...``."""
    assert "Traceback" not in err, err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"attnref {command}: error: "), err
    return lines[0]


# --- errors -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["report", "--bogus"], "attnref report: error: unrecognized arguments: --bogus"),
        (["report", "--batch", "0"], "argument --batch: must be at least 1, got '0'"),
        (["report", "--repeats", "two"], "argument --repeats: not an integer: 'two'"),
        (["report", "--seed", "-1"], "argument --seed: must be at least 0, got '-1'"),
        (["report", "--formulations", "concat,nope"], "unknown formulation 'nope' "),
        (["report", "--dtypes", "float99"], "unknown dtype 'float99' "),
        (["report", "--feature-map", "nope"], "argument --feature-map: unknown feature map 'nope'"),
        (["check", GOOD, "--shapes", "huge"], "argument --shapes: invalid choice: 'huge'"),
        (["cite", "nope"], "attnref cite: error: nothing to cite is called 'nope'"),
        (["nope"], "argument COMMAND: invalid choice: 'nope'"),
    ],
)
def test_a_bad_flag_or_value_is_one_line_of_error(capsys, argv, message):
    """The one line the help promises (argparse's usage block is not printed);
    ``tests/test_cli_usability.py`` checks the "did you mean" each may carry."""
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err and "usage:" not in err
    assert len(err.splitlines()) == 1, err
    assert re.match(r"attnref( [\w-]+)?: error: ", err) and message in err, err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--features", "mask,nope"], "check: error: unknown feature 'nope'; choose from mask"),
        (["--properties", "oracle,nope"], "check: error: unknown property 'nope'; choose from"),
        (["--devices", "1,two"], "check: error: devices must be comma-separated mesh sizes"),
        (["--devices", "1,64"], "check: error: devices=(1, 64) asks for a mesh of 64 devices"),
    ],
)
def test_a_mistake_inside_check_is_one_error_line(capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        cli.main(["check", GOOD, *argv])
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert message in _one_error_line(err, "check")


def test_a_target_that_cannot_be_loaded_is_one_error_line(capsys):
    assert cli.main(["check", "no_such_module_for_attnref:attention"]) == 2
    assert "cannot import module 'no_such_module_for_attnref'" in _one_error_line(
        capsys.readouterr().err, "check"
    )
    assert cli.main(["check-merge", "tests.conformance_targets:missing"]) == 2
    assert "missing" in _one_error_line(capsys.readouterr().err, "check-merge")
    with pytest.raises(SystemExit) as exc:
        cli.main(["check-merge", "attnref:merge_states", "--properties", "bogus"])
    assert exc.value.code == 2
    assert "unknown properties" in _one_error_line(capsys.readouterr().err, "check-merge")


def test_a_closed_pipe_and_ctrl_c_end_quietly(capsys, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(sys, "stdout", ClosedPipe())
        assert cli.main(["list"]) == 141  # 128 + SIGPIPE, as a tool the signal ends
    assert capsys.readouterr().err == ""

    with monkeypatch.context() as m:
        m.setattr(sys, "stdout", Interrupted())
        assert cli.main(["list"]) == 130
    assert capsys.readouterr().err == "attnref: interrupted\n"


def test_list_piped_into_head_prints_no_traceback():
    """A real shell pipe: ``head -1`` exits after the first line."""
    run = subprocess.run(
        f"{sys.executable} -m attnref list | head -1",
        shell=True,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    heading = ["id", "family", "convention", "title,", "equation,", "cost,", "citation"]
    assert run.stdout.split() == heading
    assert "Traceback" not in run.stderr and "BrokenPipeError" not in run.stderr, run.stderr


# --- plain text to a pipe ---------------------------------------------------------------


def _ascii_without_codes(text: str) -> None:
    assert not ANSI.search(text), text
    assert all(ord(c) < 128 for c in text), [c for c in text if ord(c) >= 128]


def test_list_is_a_plain_table_with_every_formulation(capsys):
    assert cli.main(["list"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    _ascii_without_codes(out)
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["id", "family", "convention"]
    assert set(lines[1]) == {"-", " "}  # the heading's rule, ASCII
    starts = [line.split()[0] for line in lines[2:] if line and not line[0].isspace()]
    assert starts == list(ids())  # a row per formulation, starting with its id
    assert all(line == line.rstrip() for line in lines)  # no trailing spaces
    assert "Vaswani et al. (2017)" in out


def _rows() -> list[report_mod.Row]:
    """Two rows with made-up numbers: the layout, not the measurement, is under test."""
    concat = report_mod.Row(
        "concat",
        "float32",
        5.05e-07,
        2.9e-07,
        8.1e-05,
        "causal mask",
        model_flops=439_040,
        xla_flops=449_024.0,
        temp_bytes=24_576,
        median_us=143.8,
    )
    linear = report_mod.Row(
        "linear_recurrent",
        "float64",
        9.4e-16,
        5.5e-16,
        1.37,
        "elu_plus_one, causal",
        model_flops=401_280,
        xla_flops=336_794.0,
        temp_bytes=68_216,
        median_us=192.0,
    )
    return [concat, linear]  # fmt: skip


def test_report_table_is_plain_text_one_line_per_row():
    problem = report_mod.Problem()
    text = report_mod.format_table(_rows(), problem)
    _ascii_without_codes(text)
    lines = text.splitlines()
    assert lines[:3] == report_mod.header(problem).splitlines()  # the heading and the legend
    assert lines[3] == ""
    assert lines[4].split()[:4] == ["formulation", "dtype", "max", "abs"]
    assert set(lines[5]) == {"-", " "}
    concat, linear = lines[6], lines[7]
    expected = "concat float32 5.050e-07 2.900e-07 8.10e-05 ok 439,040 449,024 24,576 143.8"
    assert concat.split() == [*expected.split(), "causal", "mask"]
    assert linear.startswith("linear_recurrent ") and len(linear) > 80  # not wrapped at 80
    assert linear.split()[5] == "FAIL" and linear.endswith("elu_plus_one, causal")
    # right-aligned numbers: the columns' last characters line up under their headings
    assert (
        concat.index("439,040") + 7
        == linear.index("401,280") + 7
        == lines[4].index("model FLOPs") + len("model FLOPs")
    )
    assert lines[8] == report_mod.FOOTER and len(lines) == 9


def _conformance_report(devices: tuple[int, ...] = ()) -> ConformanceReport:
    detail = "oracle [float32]: rule 'bound' failed [bold]not markup[/bold] :smile:"
    failed = PropertyResult("oracle", "failed", detail, "Config(batch=1)", 7, 3, seconds=1.25)
    skipped = PropertyResult("lse", "skipped", "needs feature 'lse'", None, 0, 0)
    if devices:
        meshes = (
            MeshResult(1, "passed", "", None, 3, seconds=0.5, ratio=0.25),
            MeshResult(2, "failed", detail, "Config(batch=1)", 3, seconds=0.75),
        )
        failed = PropertyResult(
            "oracle", "failed", "P=2: " + detail, "Config(batch=1)", 7, 6, meshes=meshes
        )
    return ConformanceReport(
        "pkg.mod:fn", "jax_nn", ("mask",), {"masked_rows": "uniform"}, (failed, skipped),
        devices=devices,
    )  # fmt: skip


def test_conformance_summary_is_plain_text_with_its_summary_line():
    text = _conformance_report().summary()
    _ascii_without_codes(text)
    lines = text.splitlines()
    assert lines[:3] == [
        "attnref conformance: pkg.mod:fn (signature 'jax_nn')",
        "features: mask",
        "declared differences: masked_rows=uniform (attnref default: zeros)",
    ]
    assert lines[4].split() == ["property", "status", "examples", "time", "detail"]
    assert set(lines[5]) == {"-", " "}
    assert lines[6].split()[:4] == ["oracle", "failed", "3", "1.2"]
    assert lines[6].endswith("[bold]not markup[/bold] :smile:")  # printed as written
    assert lines[7].split() == ["lse", "skipped", "0", "needs", "feature", "'lse'"]
    assert lines[8:10] == ["", "0 passed, 1 failed, 1 skipped: FAIL"]  # its own line
    assert "--- oracle failed (seed 7) ---" in lines
    distributed = _conformance_report(devices=(1, 2)).summary().splitlines()
    heading = ["property", "P", "status", "examples", "time", "ratio", "detail"]
    assert distributed[4].split() == heading
    assert distributed[6].split()[:6] == ["oracle", "1", "passed", "3", "0.5", "s"]
    assert distributed[6].split()[6] == "0.25"
    assert "--- oracle failed at P=2 (seed 7) ---" in distributed


def test_on_a_terminal_rich_draws_the_tables_in_colour():
    """The same report on a (forced) terminal 80 columns wide: ANSI colour, wrapped to fit."""
    buffer = io.StringIO()
    Console(file=buffer, force_terminal=True, width=80, color_system="standard").print(
        _conformance_report()
    )
    drawn = buffer.getvalue()
    assert ANSI.search(drawn)
    plain_lines = [re.sub(r"\x1b\[[0-9;]*m", "", line) for line in drawn.splitlines()]
    assert max(len(line) for line in plain_lines) <= 80
    assert "0 passed, 1 failed, 1 skipped: FAIL" in plain_lines


# --- progress only on a terminal --------------------------------------------------------


def test_progress_shows_on_a_terminal_unless_no_progress(capsys, monkeypatch, terminal_env):
    for flags, shown in (((), True), (("--no-progress",), False)):
        tty = FakeTerminal()
        with monkeypatch.context() as m:
            m.setattr(sys, "stderr", tty)
            assert cli.main([*CHECK, *flags]) == 0
        out = capsys.readouterr().out
        assert out.rstrip().endswith(SUMMARY) and not ANSI.search(out)  # stdout is no terminal
        drawn = tty.getvalue()
        assert bool(PROGRESS.search(drawn)) is shown, drawn
        assert ("oracle ..." in drawn) is shown  # the bar names the property running
    # stderr not a terminal (captured): no bar, nothing at all
    assert cli.main(CHECK) == 0
    assert capsys.readouterr().err == ""


def test_verbose_prints_the_engines_log_lines_to_a_pipe(capsys):
    args = ["--features", "causal", "--properties", "oracle", "--max-examples", "1"]
    assert cli.main(["check", "tests.conformance_targets:ring", *args, "--devices", "1"]) == 0
    assert capsys.readouterr().err == ""
    verbose = ["--devices", "1", "--verbose"]
    assert cli.main(["check", "tests.conformance_targets:ring", *args, *verbose]) == 0
    err = capsys.readouterr().err
    assert re.fullmatch(r"oracle P=1: passed \(\d+\.\d s\)\n", err), err
    assert not PROGRESS.search(err)


def test_a_real_pipe_and_a_real_terminal():
    """One subprocess per kind of stderr: a pipe gets nothing, a pseudo-terminal the bar;
    stdout, a pipe both times, gets the same plain table."""
    env = {**os.environ, "COLUMNS": "100", "TERM": "xterm-256color"}
    env.pop("FORCE_COLOR", None)
    env.pop("NO_COLOR", None)
    command = [sys.executable, "-m", "attnref", *CHECK]
    piped = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, timeout=180)
    out = piped.stdout.decode()
    assert piped.returncode == 0, piped.stderr
    assert out.rstrip().endswith(SUMMARY) and not ANSI.search(out)
    err = piped.stderr.decode()
    assert not ANSI.search(err) and not PROGRESS.search(err) and "oracle ..." not in err, err

    master, slave = pty.openpty()
    chunks: list[bytes] = []

    def drain() -> None:  # read the terminal while the command runs (a full pty blocks it)
        while True:
            try:
                data = os.read(master, 4096)
            except OSError:  # EIO: the command closed the terminal
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=slave)
    os.close(slave)
    tty_out, _ = proc.communicate(timeout=180)
    reader.join(timeout=10)
    os.close(master)
    assert proc.returncode == 0
    tty_text = tty_out.decode()  # stdout, a pipe: the same plain table (times aside)
    assert tty_text.rstrip().endswith(SUMMARY) and not ANSI.search(tty_text)
    assert tty_text.splitlines()[:6] == out.splitlines()[:6]
    drawn = b"".join(chunks).decode(errors="replace")
    assert ANSI.search(drawn) and "oracle ..." in drawn and PROGRESS.search(drawn), drawn


def test_emit_is_plain_unless_the_stream_is_a_terminal(terminal_env):
    table = console.table(("name", "value"), right=("value",))
    table.add_row("x", "1")
    piped = io.StringIO()
    console.emit(table, piped)
    assert piped.getvalue() == "name  value\n----- -----\nx         1\n"
    tty = FakeTerminal()
    console.emit(console.table(("name",), terminal=True), tty)
    assert ANSI.search(tty.getvalue())  # rich's bold heading
    assert not console.is_terminal(None) and console.is_terminal(FakeTerminal())


def test_report_mla_prints_the_crossover(capsys):
    """``attnref report --mla``: one row per cache length with the crossover ``T_q*`` below
    which the absorbed form needs fewer matmul FLOPs. The column is checked against the root
    of ``d_c a (T_k - T_q) = T_q T_k (2 d_c - a)`` written here, at DeepSeek-V3's defaults
    (``d_c = 512``, ``a = d_nope + d_v = 256``), and the absorbed form's cache bytes per token
    against ``(d_c + d_rope) x 2`` (the latent and the shared RoPE key, bfloat16)."""
    assert cli.main(["report", "--mla"]) == 0
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines()[2:]]
    assert len(rows) == 3
    d_c, a = 512, 128 + 128
    for row in rows:
        t_k, t_star = int(row[0]), float(row[1])
        assert abs(t_star - d_c * a * t_k / (d_c * a + t_k * (2 * d_c - a))) < 0.05
        assert int(row[-1]) == (512 + 64) * 2  # the latent and the shared RoPE key
