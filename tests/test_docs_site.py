"""The site's source side, without a build: the index's README mentions of ``docs/*.md`` become
links, the stylesheet lets wide equations scroll, each display equation gets a copy-as-LaTeX
button, and every registered equation shows its head index and its scale. Pure text: no JAX
compile, no Sphinx run (the built pages are checked in a browser by ``tests/site/``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import attnref
from attnref.pages import link_docs_mentions

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
MENTION = re.compile(r"`docs/([A-Za-z0-9_./-]+\.md)(?:#[A-Za-z0-9_-]+)?`")


def _unlinked(markdown: str) -> list[str]:
    """Mentions of existing docs pages written as code and not as a link's text."""
    text = re.sub(r"^(```|~~~).*?^\1", "", markdown, flags=re.M | re.S)  # fences drop out
    return [
        m.group(1)
        for m in MENTION.finditer(text)
        if (DOCS / m.group(1)).is_file() and text[max(m.start() - 1, 0)] != "["
    ]


def test_link_docs_mentions_links_pages_and_nothing_else(tmp_path):
    (tmp_path / "atlas.md").write_text("# atlas\n")
    source = (
        "See `docs/atlas.md` and `docs/atlas.md#step-1-a`, not `docs/missing.md`.\n"
        "Already [`docs/atlas.md`](docs/atlas.md).\n"
        "```console\n$ cat `docs/atlas.md`\n```\n"
    )
    out = link_docs_mentions(source, tmp_path)
    assert out.splitlines()[0] == (
        "See [`docs/atlas.md`](docs/atlas.md) and "
        "[`docs/atlas.md#step-1-a`](docs/atlas.md#step-1-a), not `docs/missing.md`."
    )
    assert out.splitlines()[1:] == source.splitlines()[1:], "a link or a fence was rewritten"
    assert link_docs_mentions(out, tmp_path) == out, "not idempotent"


def test_the_sites_index_links_every_docs_page_the_readme_mentions():
    """The index includes the README through ``docs/conf.py``'s ``include-read`` hook, which
    applies :func:`attnref.pages.link_docs_mentions`: no mention of an existing page is left
    as code."""
    readme = (ROOT / "README.md").read_text()
    assert _unlinked(readme), "the README mentions no docs page as code: this test sees nothing"
    assert _unlinked(link_docs_mentions(readme, DOCS)) == []
    conf = (DOCS / "conf.py").read_text()
    assert 'app.connect("include-read", _link_readme_mentions)' in conf
    assert "pages.link_docs_mentions(" in conf
    assert "```{include} ../README.md" in (DOCS / "index.md").read_text()


def test_wide_equations_scroll_and_every_equation_has_a_copy_button():
    """``_static/attnref.css`` gives display math ``overflow-x: auto`` and ``conf.py`` loads it
    and ``copy_tex.js``, and wraps every ``math_block`` with a button carrying ``data-tex``."""
    css = (DOCS / "_static" / "attnref.css").read_text()
    rules = re.findall(r"([^{}]+)\{([^}]*)\}", re.sub(r"/\*.*?\*/", "", css, flags=re.S))
    scrolling = {
        sel.strip()
        for sels, body in rules
        if re.search(r"overflow-x:\s*auto", body)
        for sel in sels.split(",")
    }
    assert {"div.math", 'mjx-container[display="true"]'} <= scrolling
    js = (DOCS / "_static" / "copy_tex.js").read_text()
    assert "button.copy-tex" in js and "dataset.tex" in js and "clipboard" in js
    conf = (DOCS / "conf.py").read_text()
    for needed in (
        'html_static_path = ["_static"]',
        'html_css_files = ["attnref.css"]',
        'html_js_files = ["copy_tex.js"]',
        'app.connect("doctree-resolved", _copy_tex_buttons)',
        'class="copy-tex" data-tex=',
    ):
        assert needed in conf, needed


# A registered equation names the head it is for: a sum over the heads i = 1..H (row forms), a
# head index n with its key/value head g(n) (kernel forms), head_i, or h = 1..H (RoPE, linear).
HEAD_INDEX = re.compile(
    r"\\sum_\{i=1\}\^\{H\}|\\sum_\{n \\in|g\(n\)|g\(i\)|,h\}|\^\{\(h\)\}|_\{[a-z]+,i\}"
    r"|\\mathrm\{head\}_i|h = 1, \\dots, H"
)
# A per-head weight written without its head (`W_K^\top W_Q`, `W_{V}`); the stacked `W_O` of
# `Concat(head_1, ..., head_H) W_O` is the one whole matrix an equation may name.
UNINDEXED_WEIGHT = re.compile(r"W_(?:\{[QKVOPMAI]\}|[QKVOPMAI](?![A-Za-z0-9,{]))")


def _head_problems(equation: str, scaled: bool) -> list[str]:
    problems = []
    if not HEAD_INDEX.search(equation):
        problems.append("no head index")
    whole = UNINDEXED_WEIGHT.findall(equation.replace(r"\mathrm{head}_H)\,W_O", ""))
    if whole:
        problems.append(f"weights without their head: {whole}")
    if scaled and r"\sqrt{d_k}" not in equation:
        problems.append("no 1/sqrt(d_k)")
    return problems


@pytest.mark.parametrize("fid", attnref.ids())
def test_every_equation_shows_its_head_index_and_its_scale(fid):
    r"""Each registered equation carries its head index on both sides, and the softmax forms
    (softmax, RoPE, distributed) carry the scale $1/\sqrt{d_k}$ in the equation, not only in
    the prose. The linear family has no scale: its feature map acts on $q$ and $k$ as given."""
    f = attnref.get(fid)
    assert _head_problems(f.equation, f.family.name != "linear") == [], f.equation


def test_the_head_check_rejects_the_old_equations():
    """The column and RoPE equations as they read before issue 26 fail the check."""
    column = (
        r"Y = \sum_{i=1}^{H} W_{I,i} X_{kv}\, \sigma\!\big(X_{kv}^\top W_{A,i} X\big) + b_O"
        r"\mathbf{1}^\top,\quad W_{A,i} = W_{K}^\top W_{Q},\ W_{I,i} = W_{O}^\top W_{V}"
    )
    assert _head_problems(column, True) == [
        "weights without their head: ['W_{K}', 'W_{Q}', 'W_{O}', 'W_{V}']",
        "no 1/sqrt(d_k)",
    ]
    rope = r"s_{ij} = \frac{\tilde x_i\, W_P(m_i - n_j)\, \tilde x_j^\top}{\sqrt{d_k}}"
    assert _head_problems(rope, True) == ["no head index", "weights without their head: ['W_P']"]
    concat = (
        r"\mathrm{Concat}(\mathrm{head}_1,\dots,\mathrm{head}_H)\,W_O + b_O,\quad \sum_{i=1}^{H}"
    )
    assert _head_problems(concat + r" \sqrt{d_k}", True) == []
