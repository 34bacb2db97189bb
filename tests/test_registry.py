"""Registry completeness, generated docs in sync, README tour runs, and the CLI."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

import attnref
from attnref import cli
from attnref._src import docs

ROOT = Path(__file__).resolve().parents[1]


def test_every_entry_is_complete():
    seen = set()
    for f in attnref.formulations("softmax"):
        assert re.fullmatch(r"[a-z_]+", f.id) and f.id not in seen
        seen.add(f.id)
        assert f.title and f.citation and f.summary and f.convention and "O(" in f.cost
        kernel = {"softmax": ("softmax", "sigma"), "linear": ("phi",)}[f.family]
        assert "\\" in f.equation and any(word in f.equation for word in kernel), f.id
        assert callable(f.apply) and callable(f.native)
        assert f.apply.__doc__ and f.native.__doc__
        assert f.causal_modes and set(f.causal_modes) <= {False, True}
    assert len(attnref.ids("softmax")) >= 7 and len(attnref.ids("linear")) >= 6


def test_generated_docs_are_current():
    for f in attnref.formulations("softmax"):
        page = ROOT / "docs" / "formulations" / f"{f.id}.md"
        assert page.exists(), f"missing {page}; run python -m attnref._src.docs"
        assert page.read_text() == docs.render(f), f"{page} is stale; regenerate it"
    for name in ("conventions.md", "tolerances.md"):
        assert (ROOT / "docs" / name).exists()


def test_readme_opens_with_the_two_commands_and_its_tour_runs():
    text = (ROOT / "README.md").read_text()
    first_block = text.split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
    assert first_block[0].startswith("python3 -m pip install . && attnref report")
    assert "python3 -m pytest -q" in first_block[1]
    tour = text.split("```python\n", 1)[1].split("```", 1)[0]
    exec(compile(tour, "README tour", "exec"), {})


def test_cli_report_table_and_json(capsys):
    args = [
        "report",
        "--t-q",
        "5",
        "--t-k",
        "5",
        "--batch",
        "1",
        "--d-model",
        "8",
        "--num-heads",
        "2",
        "--d-k",
        "2",
        "--d-v",
        "3",
    ]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    for fid in attnref.ids("softmax"):
        assert out.count(f"\n{fid} ") == 2, fid  # one float32 row and one float64 row
    assert cli.main([*args, "--json", "--formulations", "concat,graph"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [r["id"] for r in data["rows"]] == ["concat", "graph", "concat", "graph"]
    for r in data["rows"]:
        assert r["bound_ratio"] <= 1.0
        assert r["max_rel_error"] < (1e-12 if r["dtype"] == "float64" else 1e-5)
    assert cli.main(["list"]) == 0
    assert "Vaswani" in capsys.readouterr().out


def test_report_default_problem_float64_below_1e12():
    """The issue's acceptance criterion on the default problem."""
    from attnref._src import report

    rows = report.run(report.Problem(), dtypes=("float64",))
    assert {r.id for r in rows} == set(attnref.ids())
    assert max(r.max_rel_error for r in rows) < 1e-12
    assert all(np.isfinite(r.bound_ratio) and r.bound_ratio <= 1 for r in rows)
