"""The docs generator (``python -m attnref.pages``): the formulation pages, ``docs/distributed.md``
and the test pages; implemented in ``attnref._src.tools.pages``."""

from __future__ import annotations

from attnref._src.tools.pages import (
    HELPERS,
    NAMESPACES,
    PROPERTY_TESTS,
    covered_ids,
    main,
    public_name,
    render,
    render_distributed,
    write,
    write_distributed,
    write_test_pages,
)

__all__ = [
    "HELPERS",
    "NAMESPACES",
    "PROPERTY_TESTS",
    "covered_ids",
    "main",
    "public_name",
    "render",
    "render_distributed",
    "write",
    "write_distributed",
    "write_test_pages",
]

if __name__ == "__main__":
    main()
