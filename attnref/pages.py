"""The docs generator (``python -m attnref.pages``): the formulation pages, ``docs/distributed.md``
and the test pages; implemented in ``attnref._src.tools``."""

from __future__ import annotations

from attnref._src.tools.distributed_page import render_distributed, write_distributed
from attnref._src.tools.pages import (
    HELPERS,
    NAMESPACES,
    formula_source,
    link_docs_mentions,
    main,
    public_name,
    render,
    write,
)
from attnref._src.tools.suite_pages import (
    PROPERTY_TESTS,
    covered_ids,
    site_label,
    suite_functions,
    write_test_pages,
)

__all__ = [
    "HELPERS",
    "NAMESPACES",
    "PROPERTY_TESTS",
    "covered_ids",
    "formula_source",
    "link_docs_mentions",
    "main",
    "public_name",
    "render",
    "render_distributed",
    "site_label",
    "suite_functions",
    "write",
    "write_distributed",
    "write_test_pages",
]

if __name__ == "__main__":
    main()
