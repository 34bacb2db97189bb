"""``attnref report``: every registered formulation against the float64 oracle on one problem;
implemented in ``attnref._src.tools.report``."""

from __future__ import annotations

from attnref._src.tools.report import (
    COLUMNS,
    FOOTER,
    PlainRows,
    Problem,
    Row,
    Table,
    format_table,
    header,
    plot,
    run,
    sweep,
    to_json,
)

__all__ = [
    "COLUMNS",
    "FOOTER",
    "PlainRows",
    "Problem",
    "Row",
    "Table",
    "format_table",
    "header",
    "plot",
    "run",
    "sweep",
    "to_json",
]
