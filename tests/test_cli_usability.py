"""What a new user of the ``attnref`` command line met (issue 26), each point as they saw it.

* ``--help`` is plain text (no reStructuredText markup), and every option of every command says
  what it is and, when it takes a value, its default;
* a usage error is the one line the help promises (no usage block), with a "did you mean" when
  the flag, value, feature or name given is close to a known one (the features read from the
  kit, ``attnref.conformance.FEATURES``, whatever it holds);
* ``cite`` takes authors, titles and short names, case ignored;
* ``--feature-map`` takes ``attnref.linear``'s factory names (``relu_features``) and the short
  ones (``relu``);
* ``list`` piped fits the terminal's width (100 when piped), its rule no wider;
* ``report`` piped prints each row as it is measured, not all at the end;
* ``check`` takes a file path, ``path/to/attn.py:function``.

Most run in-process (``cli.main``); one subprocess (about 3 s) checks ``list`` in a real pipe.
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import attnref
from attnref import cli
from attnref import report as report_mod
from attnref.cli import citations
from attnref.conformance import FEATURES, PROPERTIES
from attnref.linear import identity_features, relu_features

ROOT = Path(__file__).resolve().parents[1]
GOOD = "tests.conformance_targets:good"
COMMANDS = ("report", "list", "check", "check-merge", "cite")


class Piped(io.StringIO):
    """stdout that is not a terminal (a pipe), whose text so far can be read at any time."""


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _usage_error(capsys, argv: list[str]) -> str:
    """``argv``'s stderr, which must be exactly one line (exit 2, nothing on stdout)."""
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and "usage:" not in err and "Traceback" not in err, err
    assert err.endswith("\n") and err.count("\n") == 1, err
    return err.rstrip("\n")


# --- help ---------------------------------------------------------------------------------


def _help(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        cli.main([*argv, "--help"])
    assert exc.value.code == 0
    return capsys.readouterr().out


def _options(text: str) -> dict[str, tuple[bool, str]]:
    """The help's options: ``--flag`` -> (whether it takes a value, its entry's text)."""
    entries: dict[str, tuple[bool, str]] = {}
    section = text.split("\noptions:\n", 1)[1]
    current = None
    for line in section.splitlines():
        head = re.match(r"^  (?:-\w, )?(--[\w-]+)( [A-Z_]+| \{[^}]*\})?", line)
        if head:
            current = head.group(1)
            entries[current] = (head.group(2) is not None, line[head.end() :])
        elif current and line.startswith("    "):
            takes, about = entries[current]
            entries[current] = (takes, f"{about} {line.strip()}")
    return {flag: (takes, " ".join(about.split())) for flag, (takes, about) in entries.items()}


def test_help_is_plain_text_and_every_option_has_its_help_and_default(capsys):
    top = _help(capsys, [])
    assert "one line on stderr" in top  # the promise test_usage_errors_are_one_line checks
    for command in (None, *COMMANDS):
        text = top if command is None else _help(capsys, [command])
        assert not re.search(r"``|:(func|mod|class|data):`", text), (command, text)
        options = _options(text)
        assert "--help" in options
        for flag, (takes_value, about) in options.items():
            assert about, (command, flag)  # a description for every option
            if takes_value:
                assert "default" in about, (command, flag, about)
    report = _options(_help(capsys, ["report"]))
    problem = report_mod.Problem()
    assert report["--batch"] == (True, f"batch size B (default: {problem.batch})")
    assert report["--t-q"][1].endswith(f"(default: {problem.t_q})")
    assert set(report) >= {"--t-k", "--num-heads", "--d-model", "--d-k", "--d-v", "--repeats"}


# --- usage errors: one line, and the close name ----------------------------------------------


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["report", "--t_q", "3"], "attnref report: error: unrecognized arguments: --t_q 3 "
         "(did you mean '--t-q'?)"),
        (["report", "--bogus"], "attnref report: error: unrecognized arguments: --bogus"),
        (["reprot"], "attnref: error: argument COMMAND: invalid choice: 'reprot'"),
        (["reprot"], "(did you mean 'report'?)"),
        (["report", "--formulations", "concta"], "unknown formulation 'concta' (did you mean "
         "'concat'?)"),
        (["report", "--dtypes", "float46"], "unknown dtype 'float46' (did you mean 'float64'?)"),
        (["report", "--feature-map", "relu_feature"], "unknown feature map 'relu_feature' (did "
         "you mean 'relu_features'?)"),
        (["check", GOOD, "--shapes", "smal"], "attnref check: error: argument --shapes: invalid "
         "choice: 'smal'"),
        (["check", GOOD, "--shapes", "smal"], "(did you mean 'small'?)"),
        (["check", GOOD, "--masked_rows", "uniform"], "did you mean '--masked-rows'?"),
        (["check", GOOD, "--signature", "jax-nn"], "attnref check: error: signature 'jax-nn' is "
         "not one of jax_nn, qkv_mask, numpy, torch (did you mean 'jax_nn'?)"),
        (["check", GOOD, "--properties", "oracel"], "(did you mean 'oracle'?)"),
        (["check-merge", "attnref:merge_states", "--properties", "oracle,comutative"],
         "attnref check-merge: error: unknown properties ['comutative']"),
        (["check-merge", "attnref:merge_states", "--properties", "comutative"],
         "(did you mean 'commutative'?)"),
        (["cite", "elhagee"], "attnref cite: error: nothing to cite is called 'elhagee' (did you "
         "mean 'elhage'"),
        (["cite", "dao"], "attnref cite: error: 'dao' names several sources: "
         "dao2022flashattention, dao2023flashdecoding; cite one of them by key"),
    ],
)  # fmt: skip
def test_usage_errors_are_one_line_with_the_close_name(capsys, argv, line):
    err = _usage_error(capsys, argv)
    assert line in err, err
    assert err.startswith(line.split(": error: ")[0] if ": error: " in line else "attnref")


def test_a_misspelt_feature_gets_the_kits_feature(capsys):
    """Every feature the kit knows, misspelt (its last letter dropped), is suggested back; the
    names come from the kit, so a feature it adds or splits is covered too."""
    assert "causal" in FEATURES and len(FEATURES) > 5
    for feature in FEATURES:
        err = _usage_error(capsys, ["check", GOOD, "--features", f"mask,{feature[:-1]}"])
        assert f"unknown feature {feature[:-1]!r}" in err
        assert err.endswith(f"(did you mean {feature!r}?)"), err
    err = _usage_error(capsys, ["check", GOOD, "--features", "mask,zzzz"])
    assert "did you mean" not in err  # nothing close: no guess
    assert "oracle" in PROPERTIES


# --- cite ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "first_line"),
    [
        ("elhage", "Elhage et al. (2021). A Mathematical Framework for Transformer Circuits."),
        ("Elhage", "Elhage et al. (2021). A Mathematical Framework for Transformer Circuits."),
        ("VASWANI", "Vaswani et al. (2017). Attention Is All You Need."),
        ("Milakov", "Milakov & Gimelshein (2018). Online normalizer calculation for softmax."),
        ("FlashAttention", "Dao et al. (2022). FlashAttention: Fast and Memory-Efficient"),
        ("Column", 'Column-vector form ("Attention: All you need to know") (column)'),
        ("COLUMN", 'Column-vector form ("Attention: All you need to know") (column)'),
        ("Per-query soft search", "Per-query soft search (soft_search)"),
        ("flash-decoding", "Split-KV attention (flash-decoding)"),
        ("KV-Cache", "KV-cached attention, one query per step (kv_cache)"),
    ],
)
def test_cite_takes_authors_titles_and_short_names_in_any_case(capsys, name, first_line):
    assert cli.main(["cite", name]) == 0
    out = capsys.readouterr().out
    assert out.startswith(first_line), out
    assert out.rstrip().splitlines()[-1].startswith("attnref: attnref developers")


def test_cite_a_source_lists_the_formulations_citing_it_and_its_bibtex(capsys):
    assert cli.main(["cite", "elhage"]) == 0
    out = capsys.readouterr().out
    assert "https://transformer-circuits.pub/2021/framework/index.html" in out
    assert "Cited by the formulations: column\n" in out  # SOURCES["column"] names it
    assert "Elhage et al." in attnref.get("column").citation
    assert cli.main(["cite", "Elhage", "--bibtex"]) == 0
    entries = re.findall(r"^@(\w+)\{([\w]+),$", capsys.readouterr().out, re.M)
    assert entries == [("article", "elhage2021mathematical"), ("misc", "attnref")]


def test_every_alias_names_what_it_says():
    """Each alias resolves to its own target (no alias shadowed by an earlier kind of name), in
    any case, and every registry id, title and source key resolves to itself."""
    for alias, fid in citations.FORMULATION_ALIASES.items():
        assert fid in attnref.ids()
        for name in (alias, alias.upper()):
            assert citations.resolve(name) == citations.Resolved("formulation", fid), name
    for alias, key in citations.SOURCE_ALIASES.items():
        assert key in citations.ENTRIES
        for name in (alias, alias.title()):
            assert citations.resolve(name) == citations.Resolved("source", key), name
    for fid in attnref.ids():
        assert citations.resolve(fid.upper()) == citations.Resolved("formulation", fid)
        assert citations.resolve(attnref.get(fid).title).name == fid
    for key in citations.ENTRIES:
        assert citations.resolve(key) == citations.Resolved("source", key)


# --- report -------------------------------------------------------------------------------


def _fake_rows() -> list[report_mod.Row]:
    return [
        report_mod.Row("concat", "float32", 5e-7, 3e-7, 8e-5, "causal mask", 439_040, 0, 1.0),
        report_mod.Row("column", "float32", 4e-7, 2e-7, 7e-5, "causal mask", 1_016_672, 0, 2.0),
    ]


def test_report_piped_prints_each_row_as_it_is_measured(monkeypatch):
    """The CLI's wiring, with ``attnref.report.run`` replaced: each row is on stdout before the
    next is measured (and the heading before the first); on a terminal the table comes whole
    at the end (rich draws it, a progress bar runs meanwhile)."""
    seen: list[str] = []

    def run(problem, ids, dtypes, *, repeats, progress, on_row):
        assert ids == ["concat", "column"]
        for row in _fake_rows():
            seen.append(sys.stdout.getvalue())
            on_row(row)
        seen.append(sys.stdout.getvalue())
        return _fake_rows()

    monkeypatch.setattr(report_mod, "run", run)
    piped = Piped()
    monkeypatch.setattr(sys, "stdout", piped)
    assert cli.main(["report", "--formulations", "concat,column"]) == 0
    plain = report_mod.PlainRows(report_mod.Problem(), ["concat", "column"])
    head, first, second = plain.head(), plain.row(_fake_rows()[0]), plain.row(_fake_rows()[1])
    assert seen[0] == head + "\n"  # the heading, before any row is measured
    assert seen[1] == f"{head}\n{first}\n"  # the first row, before the second is measured
    assert seen[2] == f"{head}\n{first}\n{second}\n"
    assert piped.getvalue() == f"{head}\n{first}\n{second}\n{report_mod.FOOTER}\n"
    assert piped.getvalue().rstrip("\n") == report_mod.format_table(_fake_rows(), plain.problem)

    seen.clear()
    tty = FakeTerminal()
    monkeypatch.setattr(sys, "stdout", tty)
    assert cli.main(["report", "--formulations", "concat,column", "--no-progress"]) == 0
    assert seen == ["", "", ""]  # nothing printed while the rows are measured
    assert "concat" in tty.getvalue() and "column" in tty.getvalue()
    seen.clear()
    monkeypatch.setattr(sys, "stdout", Piped())
    assert cli.main(["report", "--formulations", "concat,column", "--json"]) == 0
    assert seen == ["", "", ""]  # JSON is one document, printed at the end
    assert [r["id"] for r in json.loads(sys.stdout.getvalue())["rows"]] == ["concat", "column"]


def test_report_rows_line_up_under_their_headings():
    plain = report_mod.PlainRows(report_mod.Problem(), ["concat", "linear_recurrent"])
    heading, rule = plain.head().splitlines()[-2:]
    rows = [plain.row(r) for r in _fake_rows()]
    assert set(rule) == {"-", " "} and "  " in rule
    for name in ("model FLOPs", "median us", "err/bound"):  # numbers: right-aligned
        end = heading.index(name) + len(name)
        assert all(row[end - 1] != " " and row[end] == " " for row in rows), name
    assert all(row.index("ok") == heading.index(" ok ") + 1 for row in rows)
    assert all(row == row.rstrip() for row in rows)


def test_feature_map_takes_the_factory_and_the_short_names(monkeypatch, capsys):
    chosen: list[str] = []

    def run(problem, ids, dtypes, *, repeats, progress, on_row):
        chosen.append(problem.feature_map)
        return []

    monkeypatch.setattr(report_mod, "run", run)
    for name in ("relu_features", "relu", "identity_features", "identity", "favor_plus"):
        assert cli.main(["report", "--feature-map", name, "--json"]) == 0
    relu, identity = relu_features().name, identity_features().name
    assert chosen == [relu, relu, identity, identity, "favor_plus"]
    capsys.readouterr()
    assert "relu_features" in _options(_help(capsys, ["report"]))["--feature-map"][1]


# --- list ---------------------------------------------------------------------------------


@pytest.mark.parametrize("columns", [80, 120])
def test_list_piped_fits_the_width(capsys, monkeypatch, columns):
    monkeypatch.setenv("COLUMNS", str(columns))
    assert cli.main(["list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert set(lines[1]) == {"-", " "} and len(lines[1]) <= columns
    assert all(len(line) <= columns for line in lines)
    assert lines[0].index("title") == lines[2].index("Concatenated")
    starts = [line.split()[0] for line in lines[2:] if line and not line[0].isspace()]
    assert starts == list(attnref.ids())  # continued lines stay in the last column


def test_list_in_a_real_pipe_is_at_most_100_columns_wide():
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    run = subprocess.run(
        [sys.executable, "-m", "attnref", "list"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert 60 < len(lines[1]) <= 100, lines[1]
    assert max(map(len, lines)) <= 100


# --- a file as the target -------------------------------------------------------------------


def test_check_takes_a_file_path_target(tmp_path, capsys):
    kernels = tmp_path / "kernels"
    kernels.mkdir()
    (kernels / "helper_for_attnref_test.py").write_text(
        "import jax\nATTN = jax.nn.dot_product_attention\n"
    )
    (kernels / "attn.py").write_text(
        "from helper_for_attnref_test import ATTN\n\n"
        "def attention(query, key, value, **options):\n"
        "    return ATTN(query, key, value, **options)\n\n"
        "NOT_CALLABLE = 3\n"
    )
    (kernels / "broken.py").write_text("def attention(:\n")
    target = f"{kernels / 'attn.py'}:attention"
    args = ["--properties", "oracle", "--max-examples", "1", "--masked-rows", "uniform"]
    assert cli.main(["check", target, *args]) == 0
    out = capsys.readouterr().out
    assert f"attnref conformance: {target} " in out and "1 passed, 0 failed" in out

    def error(spec: str) -> str:
        assert cli.main(["check", spec, *args]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1 and err.startswith("attnref check: error: ")
        return err

    assert "no such file" in error(f"{tmp_path / 'nope.py'}:attention")
    assert "has no 'attenton' (did you mean 'attention'?)" in error(
        f"{kernels / 'attn.py'}:attenton"
    )
    assert "is a int, not a callable" in error(f"{kernels / 'attn.py'}:NOT_CALLABLE")
    assert "SyntaxError" in error(f"{kernels / 'broken.py'}:attention")
    assert "names no function" in error(f"{kernels / 'attn.py'}:")
