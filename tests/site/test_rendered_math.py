"""The built documentation site in a real browser: the math of a formulation page is rendered,
wide display equations scroll instead of being clipped, and each has a copy-as-LaTeX button that
copies the TeX MathJax rendered.

``nox -s docs`` builds ``docs/_build/html`` and runs these tests (marker ``site``, deselected in
the default run). Debian's Chromium (``/usr/bin/chromium``, installed by the nox session) loads
the page from disk, headless, with every network feature off, runs its scripts (MathJax, bundled
in ``_static/mathjax``) for up to 15 s of virtual time and dumps the DOM. ``ATTNREF_SITE`` names
another built site (``sphinx-build ... docs /tmp/site``) to check instead of ``docs/_build/html``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from html import unescape
from html.parser import HTMLParser
from pathlib import Path

import pytest

pytestmark = pytest.mark.site

ROOT = Path(__file__).resolve().parents[2]
SITE = Path(os.environ.get("ATTNREF_SITE", ROOT / "docs" / "_build" / "html"))
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


def _rendered_dom(page: Path, tmp_path: Path, width: int | None = None) -> str:
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
            *([f"--window-size={width},1000"] if width else []),
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


# Run in the page once MathJax has typeset it: for each display equation, its box against the
# article's, its overflow, the TeX MathJax typeset, its button's data-tex and what a click on the
# button puts on the clipboard (the clipboard and execCommand are stubbed to record the text).
_PROBE = """
<script>
window.addEventListener("load", async () => {
  const out = {};
  try {
    await MathJax.startup.promise;
    const copied = [];
    Object.defineProperty(navigator, "clipboard", {configurable: true, value: {
      writeText: (text) => { copied.push(text); return Promise.resolve(); }}});
    document.execCommand = () => { copied.push(document.querySelector("textarea").value);
                                   return true; };
    const article = document.querySelector("article") || document.body;
    const edge = article.getBoundingClientRect().right;
    const items = Array.from(MathJax.startup.document.math);
    out.equations = Array.from(document.querySelectorAll('mjx-container[display="true"]'))
      .map((el) => {
        const button = el.closest("div.attnref-equation")?.querySelector("button.copy-tex");
        const item = items.find((m) => m.typesetRoot === el);
        if (button) button.click();
        return {
          overflowX: getComputedStyle(el).overflowX, scrollWidth: el.scrollWidth,
          clientWidth: el.clientWidth, right: el.getBoundingClientRect().right, edge: edge,
          tex: item ? item.math : null, dataTex: button ? button.dataset.tex : null,
          copied: button ? copied[copied.length - 1] : null,
        };
      });
  } catch (e) {
    out.error = String(e);
  }
  const pre = document.createElement("pre");
  pre.id = "attnref-probe";
  pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
});
</script>
"""


def _probe(page: Path, tmp_path: Path, width: int) -> list[dict]:
    """The display equations of ``page`` in a ``width``-pixel window (see ``_PROBE``); the page
    is copied into ``tmp_path`` with ``<base>`` pointing at its folder, so its assets load."""
    html = page.read_text()
    html = html.replace("<head>", f'<head><base href="{page.parent.as_uri()}/">', 1)
    html = html.replace("</body>", _PROBE + "</body>", 1)
    probe_page = tmp_path / page.name
    probe_page.write_text(html)
    dom = _rendered_dom(probe_page, tmp_path, width=width)
    found = re.search(r'<pre id="attnref-probe">(.*?)</pre>', dom, flags=re.S)
    assert found, "the probe did not run (MathJax never finished?)"
    out = json.loads(unescape(found.group(1)))
    assert "error" not in out, f"the probe failed: {out.get('error')}"
    return out["equations"]


def _clipped(eq: dict) -> bool:
    """An equation is clipped when its box passes the article's right edge, or its content is
    wider than its box and the box does not scroll."""
    wider = eq["scrollWidth"] > eq["clientWidth"] + 1
    return eq["right"] > eq["edge"] + 1 or (wider and eq["overflowX"] not in ("auto", "scroll"))


def test_the_clip_check_sees_a_clipped_equation():
    fits = {
        "scrollWidth": 300,
        "clientWidth": 300,
        "right": 400,
        "edge": 420,
        "overflowX": "visible",
    }
    assert not _clipped(fits)
    assert _clipped({**fits, "scrollWidth": 900})  # wider than its box, which does not scroll
    assert not _clipped({**fits, "scrollWidth": 900, "overflowX": "auto"})
    assert _clipped({**fits, "right": 900})  # the box itself runs past the article


@pytest.mark.parametrize("name", ["formulations/column.html", "atlas.html"])
def test_wide_equations_scroll_and_copy_their_tex(name, tmp_path):
    """In a narrow (600 px) window the column equation and the atlas's Step 0 are wider than the
    text: each scrolls inside the article instead of being clipped. Every display equation has
    a "Copy LaTeX" button whose click copies its ``data-tex``, the TeX MathJax typeset."""
    page = SITE / name
    if not page.exists():
        pytest.fail(BUILD)
    equations = _probe(page, tmp_path, width=600)
    assert equations, "no display equation rendered"
    wide = [eq for eq in equations if eq["scrollWidth"] > eq["clientWidth"] + 1]
    assert wide, "no equation is wider than a 600 px window: this check sees nothing"
    clipped = [eq["tex"][:60] for eq in equations if _clipped(eq)]
    assert not clipped, f"clipped equations: {clipped}"
    for eq in equations:
        assert eq["dataTex"] is not None, f"no copy button beside {eq['tex'][:60]!r}"
        assert eq["copied"] == eq["dataTex"], "the click copied something else"
        assert " ".join(eq["dataTex"].split()) in " ".join(eq["tex"].split()), (
            f"the button's TeX {eq['dataTex'][:60]!r} is not the equation's {eq['tex'][:60]!r}"
        )
