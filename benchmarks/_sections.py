"""Write one generated section of a Markdown page, between ``<!-- name:start -->`` and
``<!-- name:end -->`` markers, leaving the rest of the page (other benchmarks' sections) as it is.
"""

from __future__ import annotations

import os


def write_section(path: str, name: str, text: str) -> None:
    """Replace section ``name`` of ``path`` with ``text`` (appended when the page lacks it).

    Args:
        path: The Markdown file (created if missing).
        name: The section's marker name.
        text: The section's Markdown, without markers.
    """
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    block = f"{start}\n{text.rstrip()}\n{end}\n"
    page = ""
    if os.path.exists(path):
        with open(path) as fh:
            page = fh.read()
    if start in page and end in page:
        before, rest = page.split(start, 1)
        after = rest.split(end, 1)[1].lstrip("\n")
        page = before + block + ("\n" + after if after else "")
    else:
        page = page.rstrip("\n") + ("\n\n" if page else "") + block
    with open(path, "w") as fh:
        fh.write(page)
