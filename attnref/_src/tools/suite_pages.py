"""The site's pages of the test suite (:func:`write_test_pages`, run by ``docs/conf.py`` at build
time, one page per test module with a label per test function) and the property tests each
formulation page cites (:data:`PROPERTY_TESTS`, read by :func:`covered_ids`)."""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Iterator
from pathlib import Path

from attnref._src.core.family import public_path
from attnref._src.core.registry import Formulation, formulations

_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)
TESTS = Path(__file__).resolve().parents[3] / "tests"  # the suite of this checkout

# The property tests that run formulations against the oracle and against each other, as
# ``<module>.<function>`` or ``<module>.<Class>.<method>`` (their site labels are ``tests.`` and
# this). Which formulations each one runs is read from its source (:func:`covered_ids`), not
# written here, and each formulation page lists the ones that run it;
# ``tests/test_docs_pages.py`` checks that every entry exists and runs at least one
# formulation, and that every formulation is run by at least one entry. The reading is an
# over-approximation (a test that filters what it names, as the linear kernel-level test does
# with the forms that have a ``(q, k, v)`` level, would be credited with the whole family), so
# only tests that run every formulation they name belong here.
PROPERTY_TESTS: tuple[str, ...] = (
    "test_formulations.AgreementTest.test_every_formulation_matches_oracle_and_each_other",
    "test_formulations.AgreementTest.test_every_formulation_matches_oracle_eagerly",
    "test_formulations.LowPrecisionTest.test_16bit_formats_meet_flashattention_rule",
    "test_formulations.test_residual_form",
    "test_formulations.test_every_broadcast_shape_of_mask_and_bias",
    "test_gradients.GradientAgreementTest.test_gradients_agree_across_formulations",
    "test_gqa.SoftmaxGQATest.test_every_formulation_matches_oracle",
    "test_rope.RopeRegistryTest.test_every_rope_entry_matches_oracle",
    "test_rope.RopeRegistryTest.test_every_rope_entry_matches_oracle_eagerly",
    "test_linear.test_multihead_forms_match_oracle",
    "test_gqa.LinearGQATest.test_every_linear_formulation_matches_oracle",
    "test_gqa.LinearGQATest.test_every_linear_formulation_matches_oracle_eagerly",
    "test_distributed_ring.test_matches_oracle_on_every_mesh",
    "test_distributed_ring.test_row_form_matches_the_oracle",
    "test_distributed_heads.ForwardTest.test_matches_oracle_on_every_mesh",
    "test_distributed_heads.test_row_form_matches_the_oracle",
)


def site_label(test: str) -> str:
    """The site label of ``test`` (``<module>.<function>`` or ``<module>.<Class>.<method>``):
    ``tests.<module>.<function>``; link to it with ``{ref}`tests.<module>.<function>```."""
    return f"tests.{test}"


def suite_functions(source: str) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """The test functions of a module's ``source``, in order: top-level ``test_*`` functions
    and the ``test_*`` methods of top-level classes, as ``(qualname, node)``."""
    for name, node in _definitions(ast.parse(source)).items():
        if isinstance(node, _FUNCTIONS) and node.name.startswith("test"):
            yield name, node


def _definitions(tree: ast.Module) -> dict[str, ast.AST]:
    """Module-level functions, classes and assigned names of ``tree`` (a method as
    ``Class.method``), each with the node that defines it."""
    defs: dict[str, ast.AST] = {}
    for node in tree.body:
        if isinstance(node, _FUNCTIONS):
            defs[node.name] = node
        elif isinstance(node, ast.ClassDef):
            defs[node.name] = node
            for item in node.body:
                if isinstance(item, _FUNCTIONS):
                    defs[f"{node.name}.{item.name}"] = item
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name) and node.value is not None:
                    defs[target.id] = node.value
    return defs


def covered_ids(test: str, tests_dir: Path = TESTS) -> frozenset[str]:
    """The registry ids that property test ``test`` (an entry of :data:`PROPERTY_TESTS`) runs,
    read from its source: the test function, and transitively the module-level functions,
    methods of its class and module-level names it uses, are searched for
    ``formulations("<family>")`` / ``ids("<family>")`` (the whole family) and for tuples or
    lists of registered ids written out (``SCHEMES = ("ring", "striped", "zigzag")``).
    ``test`` is ``<module>.<function>`` or ``<module>.<Class>.<method>`` of ``tests_dir``;
    ``LookupError`` if the module has no such test function."""
    module, qualname = test.split(".", 1)
    return _covered_in(module, qualname, (tests_dir / f"{module}.py").read_text())


@functools.lru_cache(maxsize=256)
def _covered_in(module: str, qualname: str, source: str) -> frozenset[str]:
    """:func:`covered_ids` of ``qualname`` in a module's ``source`` (cached by the source's
    text: rendering every page asks for each test once per formulation)."""
    defs = _definitions(ast.parse(source))
    if qualname not in defs or not qualname.rsplit(".", 1)[-1].startswith("test"):
        raise LookupError(f"tests/{module}.py has no test function {qualname}")
    cls = qualname.split(".")[0] if "." in qualname else None  # None.x is in no module
    families = {f.family.name for f in formulations()}
    registered = {f.id for f in formulations()}
    ids: set[str] = set()
    seen: set[str] = set()
    todo = [qualname]
    while todo:
        if (name := todo.pop()) in seen:
            continue
        seen.add(name)
        for node in ast.walk(defs[name]):
            if isinstance(node, ast.Name) and node.id in defs:
                todo.append(node.id)
            elif (
                isinstance(node, ast.Attribute)
                and getattr(node.value, "id", None) in ("self", "cls")
                and f"{cls}.{node.attr}" in defs
            ):
                todo.append(f"{cls}.{node.attr}")
            if (
                isinstance(node, ast.Call)
                and getattr(node.func, "id", getattr(node.func, "attr", None))
                in ("formulations", "ids")
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and node.args[0].value in families
            ):
                ids.update(f.id for f in formulations(node.args[0].value))
            if isinstance(node, (ast.Tuple, ast.List)):
                ids.update(
                    e.value
                    for e in node.elts
                    if isinstance(e, ast.Constant) and e.value in registered
                )
    return frozenset(ids)


def tests_section(f: Formulation, tests_dir: Path = TESTS) -> str:
    """The page's list of the property tests that run ``f`` (:func:`covered_ids`)."""
    runs = [t for t in PROPERTY_TESTS if f.id in covered_ids(t, tests_dir)]
    items = "\n".join(f"* {{ref}}`{site_label(t)}`" for t in runs)
    return (
        f"**Tests that prove it equal to the others.** The property tests that run `{f.id}` "
        f"with the other formulations they name against `{public_path(f.family.oracle)}` "
        "(each page of the test suite shows the test's source):\n\n"
        f"{items}"
    )


_ROLE = re.compile(r":(func|class|mod|meth|data|attr|exc|obj):`(~?[\w.]+)`")


def _test_docstring(doc: str) -> str:
    """A test's docstring as Markdown: the tests' docstrings are prose with ``code`` spans (which
    Markdown reads alike), not reStructuredText (``|x|`` is an absolute value there, not a
    substitution); their Sphinx roles become MyST's (``{py:func}`...```)."""
    return _ROLE.sub(lambda m: f"{{py:{m[1]}}}`{m[2]}`", doc)


def render_test_page(module: str, source: str) -> str:
    """The site page of test module ``tests/<module>.py``: its docstring, then per test function
    its label (:func:`site_label`), a heading with its name, its docstring and its source
    (``source``, the module's text)."""
    parts = [f"# tests/{module}.py\n"]
    if doc := ast.get_docstring(ast.parse(source)):
        parts.append(_test_docstring(doc) + "\n")
    for qualname, node in suite_functions(source):
        parts.append(f"({site_label(f'{module}.{qualname}')})=\n## {qualname}\n")
        if fdoc := ast.get_docstring(node):
            parts.append(_test_docstring(fdoc) + "\n")
        dedent = ":dedent:\n" if "." in qualname else ""  # a method: out of its class
        parts.append(
            f"```{{literalinclude}} ../../tests/{module}.py\n:language: python\n"
            f":pyobject: {qualname}\n{dedent}```\n"
        )
    return "\n".join(parts)


def write_test_pages(tests_dir: Path, out: Path) -> list[Path]:
    """Write ``out/<module>.md`` for every ``tests_dir/test_*.py`` and ``out/index.md`` (their
    table of contents); remove pages of modules that are gone. ``docs/conf.py`` calls it at
    every build (``tests/`` into ``docs/tests/``), so the pages are always the suite's
    (nothing to commit). Returns the paths written, the index last."""
    out.mkdir(parents=True, exist_ok=True)
    modules = sorted(p.stem for p in tests_dir.glob("test_*.py"))
    for stale in out.glob("*.md"):
        if stale.stem not in modules and stale.stem != "index":
            stale.unlink()
    paths = [
        _write_changed(out / f"{m}.md", render_test_page(m, (tests_dir / f"{m}.py").read_text()))
        for m in modules
    ]
    text = (
        "# The test suite\n\n"
        "One page per test module of `tests/`, generated at every build of the site from the "
        "suite itself: each test function with its docstring and its source. The formulation "
        "pages and the atlas link to the property that checks each claim.\n\n"
        "```{toctree}\n:maxdepth: 1\n\n" + "\n".join(modules) + "\n```\n"
    )
    return [*paths, _write_changed(out / "index.md", text)]


def _write_changed(path: Path, text: str) -> Path:
    """Write ``text`` to ``path`` unless it holds it already (then Sphinx reuses its read)."""
    if not path.exists() or path.read_text() != text:
        path.write_text(text)
    return path
