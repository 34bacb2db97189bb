"""The equivalence atlas (``docs/atlas.md``) is complete and its links are true.

Every registered formulation is reached by a step; every step has a display equation, the
convention and condition it holds under, and a link to a property test; every
``{ref}`tests.<module>.<qualname>``` names a test function that exists in ``tests/<module>.py``
(read with :mod:`ast`, the same rule as the site's test pages: top-level ``test*`` functions and
``test*`` methods of top-level classes); every formulation link resolves to its page; the page is
in the site's toctree. Pure text and :mod:`ast`: no JAX compile.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

import attnref

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
ATLAS = DOCS / "atlas.md"

STEP = re.compile(r"^## Step (\d+): \S", re.M)
REF = re.compile(r"\{ref\}`(?:[^`<]*<)?(tests\.[A-Za-z0-9_.]+)>?`")
FORM_LINK = re.compile(r"\]\(formulations/([a-z0-9_]+)\.md\)")
DISPLAY = re.compile(r"^\$\$\n(.+?)\n\$\$$", re.M | re.S)
CHAIN_STEP = re.compile(r"^\s*- .*\(Step (\d+)\b", re.M)


def _sections(text: str) -> dict[str, str]:
    """``## `` heading -> the text up to the next ``## `` heading."""
    parts = re.split(r"^(## .*)$", text, flags=re.M)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts), 2)}


def _steps(text: str) -> dict[int, str]:
    """Step number -> the section's text (heading included)."""
    steps: dict[int, str] = {}
    for heading, body in _sections(text).items():
        m = STEP.match(heading)
        if m:
            assert int(m.group(1)) not in steps, f"two sections for step {m.group(1)}"
            steps[int(m.group(1))] = heading + body
    return steps


@functools.cache
def _test_functions(module: str) -> frozenset[str]:
    """The qualified names of the test functions of ``tests/<module>.py``."""
    tree = ast.parse((ROOT / "tests" / f"{module}.py").read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if node.name.startswith("test"):
                names.add(node.name)
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and (
                    item.name.startswith("test")
                ):
                    names.add(f"{node.name}.{item.name}")
    return frozenset(names)


def _ref_exists(label: str) -> bool:
    """``tests.<module>.<qualname>`` names a test function of ``tests/<module>.py``."""
    _, module, qualname = label.split(".", 2)
    path = ROOT / "tests" / f"{module}.py"
    return path.is_file() and qualname in _test_functions(module)


@pytest.fixture(scope="module")
def text() -> str:
    return ATLAS.read_text()


def test_the_checkers_reject_what_they_should(tmp_path):
    """The parsers on a made-up page: they find what is there and miss what is not."""
    page = (
        "# T\n\nintro\n\n## Step 1: a\n\n**Forms:** [`x`](formulations/x.md).\n\n$$\na = b\n$$\n\n"
        "{ref}`tests.test_atlas.test_the_checkers_reject_what_they_should`\n\n"
        "## Step 2: b\n\nno equation, {ref}`label text <tests.test_atlas.no_such_test>`\n"
    )
    steps = _steps(page)
    assert sorted(steps) == [1, 2]
    assert DISPLAY.findall(steps[1]) == ["a = b"] and not DISPLAY.findall(steps[2])
    assert FORM_LINK.findall(steps[1]) == ["x"]
    refs = REF.findall(page)
    assert refs == [
        "tests.test_atlas.test_the_checkers_reject_what_they_should",
        "tests.test_atlas.no_such_test",
    ]
    assert _ref_exists(refs[0]) and not _ref_exists(refs[1])
    assert not _ref_exists("tests.test_no_such_module.test_x")
    # A class method is found as Class.method; a helper that is not a test is not.
    assert _ref_exists(
        "tests.test_formulations.AgreementTest.test_every_formulation_matches_oracle_and_each_other"
    )
    assert not _ref_exists("tests.test_formulations._check_agreement")
    with pytest.raises(AssertionError, match="two sections"):
        _steps("## Step 1: a\n\n## Step 1: b\n")


def test_steps_are_numbered_from_zero_without_gaps(text):
    steps = _steps(text)
    assert steps, "no '## Step N: ...' sections"
    assert sorted(steps) == list(range(len(steps)))


def _order_problems(text: str) -> list[str]:
    """What is out of order on an atlas page: its ``## Step N`` sections must appear as
    0, 1, 2, ... and the chain's bullets must name each step once, in the same order."""
    problems = []
    headings = [int(n) for n in STEP.findall(text)]
    if headings != sorted(set(headings)):
        problems.append(f"sections out of order or repeated: {headings}")
    chain = [int(n) for n in CHAIN_STEP.findall(_sections(text).get("## The chain", ""))]
    if chain != sorted(set(chain)):
        problems.append(f"the chain's steps out of order or repeated: {chain}")
    if set(chain) != set(headings):
        problems.append(f"the chain names steps {sorted(set(chain) ^ set(headings))} alone")
    return problems


def test_the_order_checker_rejects_misordered_pages():
    """The checker on made-up pages: an in-order page passes; a repeated chain step, a chain out
    of order (the atlas once read 15, 16, 16, 17 before 11) and sections out of order fail."""
    good = (
        "## The chain\n\n- a (Step 0, x)\n  - b (Step 1: y)\n  - c (Step 2: z)\n\n"
        "## Step 0: a\n\n## Step 1: b\n\n## Step 2: c\n"
    )
    assert _order_problems(good) == []
    assert _order_problems(good.replace("(Step 2: z)", "(Step 1: z)"))
    assert _order_problems(
        good.replace("(Step 1: y)", "(Step 2: q)").replace("(Step 2: z)", "(Step 1: z)")
    )
    swapped = good.replace("## Step 1: b", "## Step X").replace("## Step 2: c", "## Step 1: b")
    assert _order_problems(swapped.replace("## Step X", "## Step 2: c"))
    assert _order_problems(good.replace("  - c (Step 2: z)\n", ""))


def test_steps_are_in_reading_order_and_named_once(text):
    """The sections run Step 0, 1, 2, ... down the page, and the chain at the top names every
    step exactly once, in that order."""
    assert _order_problems(text) == []


def test_every_registered_formulation_is_reached_by_a_step(text):
    """Each id is linked from a step's **Forms:** line, the page the link names exists, and the
    chain at the top links each id too."""
    reached: set[str] = set()
    for n, body in _steps(text).items():
        forms = [line for line in body.splitlines() if line.startswith("**Forms:**")]
        assert len(forms) == 1, f"step {n}: one **Forms:** line, found {len(forms)}"
        ids = FORM_LINK.findall(forms[0])
        assert ids, f"step {n}: its **Forms:** line links no formulation"
        reached.update(ids)
    missing = sorted(set(attnref.ids()) - reached)
    assert not missing, f"formulations no step reaches: {missing}"
    unknown = sorted(reached - set(attnref.ids()))
    assert not unknown, f"steps link unregistered ids: {unknown}"
    chain = _sections(text)["## The chain"]
    assert set(attnref.ids()) <= set(FORM_LINK.findall(chain)), "the chain misses a form"
    for fid in set(FORM_LINK.findall(text)):
        assert (DOCS / "formulations" / f"{fid}.md").is_file(), fid


def test_every_step_has_an_equation_a_convention_a_condition_and_a_test(text):
    for n, body in _steps(text).items():
        assert DISPLAY.search(body), f"step {n}: no $$ display equation"
        for field in ("**Identity.**", "**Convention.**", "**Holds.**", "**Sources.**"):
            assert field in body, f"step {n}: no {field}"
        checked = body.split("**Checked by.**", 1)
        assert len(checked) == 2, f"step {n}: no **Checked by.**"
        assert REF.search(checked[1].split("**Sources.**")[0]), f"step {n}: no test link"


def test_display_equations_are_closed(text):
    """``$$`` fences pair up, each on its own line, none empty."""
    fences = [line for line in text.splitlines() if line.strip().startswith("$$")]
    assert all(line == "$$" for line in fences), "a $$ fence shares its line with math"
    assert len(fences) % 2 == 0 and len(fences) == 2 * len(DISPLAY.findall(text))
    assert all(eq.strip() for eq in DISPLAY.findall(text))


def test_every_test_link_names_an_existing_test(text):
    refs = REF.findall(text)
    assert refs
    # Every {ref} on the page is matched by REF (no form it cannot read).
    assert text.count("{ref}`") == len(refs)
    broken = sorted({r for r in refs if not _ref_exists(r)})
    assert not broken, f"links to tests that do not exist: {broken}"


def test_the_page_is_in_the_sites_toctree():
    index = (DOCS / "index.md").read_text()
    trees = re.findall(r"```\{toctree\}\n(.*?)```", index, flags=re.S)
    entries = {line.strip() for tree in trees for line in tree.splitlines()}
    assert "atlas" in entries, "docs/index.md's toctree does not list atlas"
