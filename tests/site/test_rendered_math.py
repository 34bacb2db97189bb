"""The built documentation site in a real browser: the math of a formulation page is rendered.

``nox -s docs`` builds ``docs/_build/html`` and runs these tests (marker ``site``, deselected in
the default run). Debian's Chromium (``/usr/bin/chromium``, installed by the nox session) loads
the page from disk, headless, with every network feature off, runs its scripts (MathJax, bundled
in ``_static/mathjax``) for up to 15 s of virtual time and dumps the DOM.
"""

from __future__ import annotations

import re
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

pytestmark = pytest.mark.site

ROOT = Path(__file__).resolve().parents[2]
SITE = ROOT / "docs" / "_build" / "html"
PAGE = SITE / "formulations" / "patterns_messages.html"
CHROMIUM = Path("/usr/bin/chromium")
BUILD = "the site is not built: run `nox -s docs` (it builds docs/_build/html, then runs this)"


class _Text(HTMLParser):
    """The text a reader sees: everything outside ``<script>``, ``<style>`` and MathJax's
    rendered output (whose assistive MathML repeats the formula as text)."""

    SKIP = ("script", "style", "mjx-container")

    def __init__(self) -> None:
        super().__init__()
        self.depth = 0
        self.parts: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in self.SKIP:
            self.depth += 1

    def handle_endtag(self, tag: str) -> None:
        if tag in self.SKIP:
            self.depth -= 1

    def handle_data(self, data: str) -> None:
        if self.depth == 0:
            self.parts.append(data)


def _visible_text(html: str) -> str:
    parser = _Text()
    parser.feed(html)
    return "".join(parser.parts)


def _rendered_dom(page: Path, tmp_path: Path) -> str:
    """``page`` after its scripts ran, as Chromium serialises it (``--dump-dom``)."""
    assert CHROMIUM.exists(), f"{CHROMIUM} is missing: `nox -s docs` installs Debian's chromium"
    run = subprocess.run(
        [
            str(CHROMIUM),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={tmp_path / 'profile'}",
            "--virtual-time-budget=15000",
            "--dump-dom",
            page.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert run.returncode == 0 and run.stdout, f"chromium failed: {run.stderr[-2000:]}"
    return run.stdout


def _math_elements(html: str) -> int:
    """How many formulas Sphinx wrote for MathJax (``<span|div class="math ...">``)."""
    return len(re.findall(r'<(?:span|div) class="math[ "]', html))


def test_formulation_page_math_is_rendered(tmp_path):
    if not PAGE.exists():
        pytest.fail(BUILD)
    source = PAGE.read_text()
    formulas = _math_elements(source)
    assert formulas >= 2, "the page lost its equation (a $$ block and inline math)"
    assert "$$" not in _visible_text(source), "MyST left $$ unparsed"

    dom = _rendered_dom(PAGE, tmp_path)
    rendered = len(re.findall(r"<mjx-container\b", dom))
    assert rendered == formulas, f"MathJax rendered {rendered} of {formulas} formulas"
    assert "<mjx-merror" not in dom, "MathJax reported a TeX error"
    text = _visible_text(dom)
    for raw in ("$$", "\\(", "\\)", "\\[", "\\]"):
        assert raw not in text, f"raw math delimiter {raw!r} left in the rendered page"


def test_no_page_loads_a_script_or_style_from_the_network():
    """MathJax and the theme's assets are bundled: no ``<script src>`` or ``<link href>`` of the
    site points outside it, so it renders offline."""
    if not (SITE / "index.html").exists():
        pytest.fail(BUILD)
    remote = re.compile(r"<(?:script|link)\b[^>]*\b(?:src|href)=\"(?:https?:)?//", re.I)
    offenders = sorted(
        str(p.relative_to(SITE)) for p in SITE.rglob("*.html") if remote.search(p.read_text())
    )
    assert not offenders, f"pages that load from the network: {offenders}"
    assert (SITE / "_static" / "mathjax" / "tex-chtml.js").exists()
