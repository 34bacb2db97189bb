"""The generated pages ``docs/formulations/*.md`` tell the truth about the code.

* The committed pages are exactly a fresh generation (one page per registry id, no stale extras).
* Every page shows, beside its LaTeX, the source of the function that computes the formulation
  (``Formulation.formula``): a ``literalinclude`` of its file with ``:pyobject:`` naming it,
  which Sphinx reads from the code at build time.
* Every ``attnref.<name>`` a page shows resolves (a module, or an attribute of one), and so
  does every Sphinx role target (``:func:`cached_attention```)
  from the docstrings a page quotes, looked up in ``attnref`` or the quoted module.
* Where a page shows a signature, ``attnref.<name>(...)`` at the start of a code line or span,
  the text after the name is exactly ``str(inspect.signature(obj))``; the code of a formulation
  is shown by autodoc (``.. autofunction:: attnref.<name>``), one directive per function.
* The property tests a page lists (:data:`attnref.pages.PROPERTY_TESTS`) exist and run the
  formulations :func:`attnref.pages.covered_ids` credits them with; every formulation is run by
  one; every ``{ref}`tests.<module>.<function>``` in ``docs/`` names a test function of the
  suite, which the generated test pages (:func:`attnref.pages.write_test_pages`) label.
* The export rule of :mod:`attnref.pages`: registered callables are exported under their
  ``__name__`` from ``attnref`` or one of its namespaces (``attnref.linear``, ``attnref.rope``,
  ``attnref.decode``, ...), and their page shows that qualified name; every function with the
  registry's row signature exported there is registered or a listed helper that its
  formulation's page shows.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import types
from pathlib import Path
from typing import Any

import pytest

import attnref
from attnref import pages as docs
from attnref.pages import HELPERS

PAGES = Path(__file__).resolve().parents[1] / "docs" / "formulations"
NAME = re.compile(r"attnref(?:\.[A-Za-z_]\w*)+")
ROLE = re.compile(r":(?:func|class|mod|meth|data|attr):`~?([\w.]+)`")
FENCE = re.compile(r"```[a-z]*\n(.*?)```", re.S)
SPAN = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
AUTODOC = re.compile(r"^\.\. autofunction:: (attnref(?:\.\w+)+)$", re.M)
TEST_REF = re.compile(r"\{ref\}`(?:[^`<]*<)?(tests\.[\w.]+)>?`")  # `name` or `text <name>`
DOCS = PAGES.parent
TESTS = DOCS.parent / "tests"


def _resolve(dotted: str) -> Any:
    """The object a dotted name denotes: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)  # AttributeError: the page names something that isn't there
        return obj
    raise ImportError(dotted)


def _has(namespace: Any, dotted: str) -> bool:
    """Whether ``namespace.a.b...`` exists for ``dotted = "a.b..."``."""
    for attr in dotted.split("."):
        if not hasattr(namespace, attr):
            return False
        namespace = getattr(namespace, attr)
    return True


def _code_texts(page: str) -> list[str]:
    """Fenced code lines and inline code spans (double-backtick RST literals excluded)."""
    lines = [ln for block in FENCE.findall(page) for ln in block.splitlines() if ln.strip()]
    return lines + SPAN.findall(FENCE.sub("", page))


def _pages() -> dict[str, str]:
    return {p.stem: p.read_text() for p in sorted(PAGES.glob("*.md"))}


def test_committed_pages_equal_a_fresh_generation():
    pages = _pages()
    assert set(pages) == set(attnref.ids()), "stale or missing pages; run python -m attnref.pages"
    for f in attnref.formulations():
        assert pages[f.id] == docs.render(f), f"docs/formulations/{f.id}.md is stale; regenerate it"


INCLUDE = re.compile(
    r"^```\{literalinclude\} \.\./\.\./(\S+)\n:pyobject: (\S+)\n:language: python\n", re.M
)


def _defined(path: Path, qualname: str) -> bool:
    """Whether ``path`` defines ``qualname`` (a function or class, or ``Class.method``)."""
    body: list[ast.stmt] = ast.parse(path.read_text()).body
    for part in qualname.split("."):
        node = next(
            (n for n in body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == part),
            None,
        )
        if node is None:
            return False
        body = node.body
    return True


@pytest.mark.parametrize("fid", attnref.ids())
def test_every_page_shows_the_source_that_computes_it(fid):
    f = attnref.get(fid)
    page = (PAGES / f"{fid}.md").read_text()
    includes = INCLUDE.findall(page)
    assert len(includes) == 1, f"{fid}.md: no single literalinclude of its formula"
    path, qualname = includes[0]
    assert _defined(DOCS.parent / path, qualname), f"{fid}.md: {path} defines no {qualname}"
    fn = inspect.unwrap(f.formula)
    source = Path(inspect.getsourcefile(fn) or "").resolve()
    assert (DOCS.parent / path).resolve() == source, f"{fid}.md: not the formula's file"
    # the formula itself, or the function it is defined in
    assert qualname == fn.__qualname__.split(".<locals>")[0], f"{fid}.md: not its formula"
    assert page.index(f.equation) < page.index(includes[0][0]), "the code stands by its LaTeX"


def _problems(page: str, module: Any) -> tuple[list[str], int]:
    """What on ``page`` does not resolve or does not match the code, and how many signatures it
    shows. ``module`` is the module whose docstrings the page quotes (for role targets)."""
    problems = []
    for name in sorted(set(NAME.findall(page))):
        try:
            _resolve(name)
        except (ImportError, AttributeError):
            problems.append(f"{name} does not resolve")
    for target in ROLE.findall(page):
        if not any(_has(ns, target) for ns in (attnref, module)):
            try:
                _resolve(target)
            except (ImportError, AttributeError):
                problems.append(f"role target {target} does not resolve")
    shown = 0
    for text in _code_texts(page):
        m = re.match(r"(attnref(?:\.\w+)+)(\(.*)$", text)
        if m is None:
            continue
        shown += 1
        try:
            real = str(inspect.signature(_resolve(m.group(1))))
        except (ImportError, AttributeError):
            continue  # reported above
        if m.group(2) != real:
            problems.append(f"{m.group(1)}: shown {m.group(2)}, real {real}")
    return problems, shown + len(AUTODOC.findall(page))


@pytest.mark.parametrize("fid", attnref.ids())
def test_every_name_resolves_and_every_signature_matches(fid):
    f = attnref.get(fid)
    page = (PAGES / f"{fid}.md").read_text()
    problems, shown = _problems(page, inspect.getmodule(f.native))
    assert not problems, f"docs/formulations/{fid}.md: {problems}"
    helpers = [h for h in HELPERS if h.formulation == fid]
    assert shown == len({f.native, f.apply}) + len(helpers), fid


def test_the_checks_catch_the_old_pages_lies():
    """The two lies of issue 11 as the old generator wrote them: names the namespace lacked (now
    replaced by names it lacks) and a keyword-only marker moved by string replacement."""
    page = (
        "Native form: `attnref.cache_attend_old(cache, q, query_positions=None, *, mask=None)`; "
        "registry `apply`: `attnref.kv_cache_multihead_old(params, x_q)`.\n\n"
        "```python\nattnref.blockwise_dot_product_attention(query, key, value, bias=None, *, "
        "mask=None)\n```"
        "\n\nSee :func:`no_such_helper`."
    )
    problems, shown = _problems(page, None)
    assert shown == 3
    assert len(problems) == 4, problems
    assert any(p.startswith("attnref.blockwise_dot_product_attention: shown") for p in problems)


def _row_signature(obj: Any) -> bool:
    if not isinstance(obj, types.FunctionType) and not callable(getattr(obj, "__wrapped__", None)):
        return False
    try:
        params = list(inspect.signature(obj).parameters)
    except (TypeError, ValueError):
        return False
    return params[:3] == ["params", "x_q", "x_kv"]


def _exported_row_forms() -> set[Any]:
    """Functions with the row signature exported by ``attnref`` or by a namespace a page may
    name (:data:`attnref.pages.NAMESPACES`)."""
    modules = [attnref, *(importlib.import_module(f"attnref.{ns}") for ns in docs.NAMESPACES)]
    return {getattr(m, n) for m in modules for n in m.__all__ if _row_signature(getattr(m, n))}


def test_export_rule():
    registered = {fn for f in attnref.formulations() for fn in (f.native, f.apply)}
    for f in attnref.formulations():
        page = (PAGES / f"{f.id}.md").read_text()
        for fn in (f.native, f.apply):
            name = docs.public_name(fn)  # LookupError: exported nowhere under its __name__
            assert _resolve(name) is fn and name.rsplit(".", 1)[1] == fn.__name__, name
            assert f".. autofunction:: {name}\n" in page, f"{f.id}.md does not show {name}"
    helpers = {h.fn for h in HELPERS}
    assert not helpers & registered
    for h in HELPERS:
        name = docs.public_name(h.fn)
        assert _resolve(name) is h.fn
        assert f".. autofunction:: {name}\n" in (PAGES / f"{h.formulation}.md").read_text()
        assert h.reason
    row_forms = _exported_row_forms()
    assert {attnref.decode.decode_attention, attnref.kv_cache_attention} <= row_forms
    assert attnref.linear.linear_quadratic_attention in row_forms
    unlisted = sorted(fn.__name__ for fn in row_forms - registered - helpers)
    assert not unlisted, (
        f"exported row-signature functions neither registered nor helpers: {unlisted}"
    )


def test_public_name_prefers_the_top_level_and_rejects_unexported():
    assert docs.public_name(attnref.concat_attention) == "attnref.concat_attention"
    assert docs.public_name(attnref.decode.cache_attend) == "attnref.decode.cache_attend"
    assert docs.public_name(attnref.linear.linear_quadratic) == "attnref.linear.linear_quadratic"

    def not_exported(params, x_q, x_kv=None):
        """Exported nowhere."""

    with pytest.raises(LookupError, match="not_exported"):
        docs.public_name(not_exported)


def test_no_generated_page_holds_a_program():
    """The docs runner executes ```python / ```bash blocks: the generated pages show code through
    autodoc and BibTeX, never as a program to run."""
    for page in _pages().values():
        assert not re.search(r"^```(?:python|bash|sh|console)\b", page, re.M)


def test_every_property_test_exists_and_runs_formulations():
    covered: dict[str, frozenset[str]] = {}
    for test in docs.PROPERTY_TESTS:
        covered[test] = docs.covered_ids(test)  # LookupError: no such test function
        assert covered[test], f"{test} runs no registered formulation"
    for fid in attnref.ids():
        runs = [t for t, ids in covered.items() if fid in ids]
        assert runs, f"no property test of attnref.pages.PROPERTY_TESTS runs {fid}"
        page = (PAGES / f"{fid}.md").read_text()
        assert all(f"{{ref}}`tests.{t}`" in page for t in runs), fid


def test_covered_ids_reads_the_source(tmp_path):
    """Families by ``formulations("...")`` / ``ids("...")`` through helpers, methods and
    module-level names; ids written out in tuples; nothing from a test that names none."""
    (tmp_path / "test_fake.py").write_text(
        "import attnref\n"
        "ROPE = attnref.formulations('rope')\n"
        "SCHEMES = ('ring', 'ulysses', 'not_an_id')\n"
        "def _loop():\n    return [f.id for f in ROPE]\n"
        "def test_family():\n    _loop()\n"
        "class Case:\n"
        "    def _check(self):\n        return attnref.ids('linear')\n"
        "    def test_method(self):\n        self._check()\n"
        "def test_listed(scheme=SCHEMES):\n    pass\n"
        "def test_nothing():\n    return ('concat',)[0:0] and None\n"
        "def test_none():\n    return 1\n"
    )

    def ids(t):
        return docs.covered_ids(t, tmp_path)

    assert ids("test_fake.test_family") == frozenset(attnref.ids("rope"))
    assert ids("test_fake.Case.test_method") == frozenset(attnref.ids("linear"))
    assert ids("test_fake.test_listed") == {"ring", "ulysses"}
    assert ids("test_fake.test_none") == frozenset()
    with pytest.raises(LookupError, match="test_missing"):
        ids("test_fake.test_missing")
    with pytest.raises(LookupError, match="_loop"):
        ids("test_fake._loop")


def _suite_labels() -> set[str]:
    labels = set()
    for path in TESTS.glob("test_*.py"):
        labels |= {
            docs.site_label(f"{path.stem}.{q}") for q, _ in docs.suite_functions(path.read_text())
        }
    return labels


def test_test_pages_label_every_test_function(tmp_path):
    paths = docs.write_test_pages(TESTS, tmp_path)
    assert {p.stem for p in paths} == {p.stem for p in TESTS.glob("test_*.py")} | {"index"}
    text = (tmp_path / "test_formulations.md").read_text()
    label = "tests.test_formulations.AgreementTest.test_every_formulation_matches_oracle_eagerly"
    assert f"({label})=\n## AgreementTest.test_every_formulation_matches_oracle_eagerly\n" in text
    assert "(tests.test_formulations.test_residual_form)=\n## test_residual_form\n" in text
    written = {m for p in paths for m in re.findall(r"^\((tests\.[\w.]+)\)=$", p.read_text(), re.M)}
    assert written == _suite_labels()
    (tmp_path / "test_gone.md").write_text("stale")
    docs.write_test_pages(TESTS, tmp_path)
    assert not (tmp_path / "test_gone.md").exists()


def test_every_test_reference_in_the_docs_names_a_test():
    """Before a site build: each ``{ref}`tests.<module>.<function>``` in ``docs/`` (the atlas, the
    formulation pages, ...) names a test function of the suite."""
    labels = _suite_labels()
    refs = {
        (path.relative_to(DOCS), ref)
        for path in DOCS.rglob("*.md")
        if "_build" not in path.parts and path.parent.name != "tests"
        for ref in TEST_REF.findall(path.read_text())
    }
    assert refs, "no page links to a test"
    missing = sorted(f"{page}: {ref}" for page, ref in refs if ref not in labels)
    assert not missing, f"links to tests that do not exist: {missing}"


def test_the_api_reference_has_a_page_per_namespace():
    """``docs/api/<namespace>.md`` documents each public namespace (``automodule`` of its
    ``__all__``), but the CLI's report and this generator; the top-level page leaves the
    namespaces to their pages."""
    api = DOCS / "api"
    left_out = {"pages", "report"}
    expected = {ns for ns in attnref._NAMESPACES if ns not in left_out}
    pages = {p.stem for p in api.glob("*.md")} - {"index", "attnref"}
    assert pages == expected
    toc = (api / "index.md").read_text()
    for ns in expected:
        assert f".. automodule:: attnref.{ns}\n   :members:\n" in (api / f"{ns}.md").read_text()
        assert f"\n{ns}\n" in toc, ns
    top = (api / "attnref.md").read_text()
    excluded = re.search(r":exclude-members: (.*)", top)
    assert excluded is not None
    assert set(excluded[1].split(", ")) == set(attnref._NAMESPACES)
