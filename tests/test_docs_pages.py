"""The generated pages ``docs/formulations/*.md`` tell the truth about the code.

* The committed pages are exactly a fresh generation (one page per registry id, no stale extras).
* Every ``attnref.<name>`` a page shows resolves (``attnref._src.decode`` as a module, the rest as
  attributes of ``attnref``), and so does every Sphinx role target (``:func:`cached_attention```)
  from the docstrings a page quotes, looked up in ``attnref`` or the quoted module.
* Where a page shows a signature, ``attnref.<name>(...)`` at the start of a code line or span,
  the text after the name is exactly ``str(inspect.signature(obj))``.
* The export rule of :mod:`attnref.pages`: registered callables are exported under their
  ``__name__`` from ``attnref`` or one of its namespaces (``attnref.linear``, ``attnref.rope``,
  ``attnref.decode``, ...), and their page shows that qualified name; every function with the
  registry's row signature exported there is registered or a listed helper that its
  formulation's page shows.
"""

from __future__ import annotations

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
    return problems, shown


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
            assert f"{name}(" in page, f"{f.id}.md does not show {name}"
    helpers = {h.fn for h in HELPERS}
    assert not helpers & registered
    for h in HELPERS:
        name = docs.public_name(h.fn)
        assert _resolve(name) is h.fn
        assert f"{name}(" in (PAGES / f"{h.formulation}.md").read_text()
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
