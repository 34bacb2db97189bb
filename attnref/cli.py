"""The ``attnref`` command line (``attnref report``, ``list``, ``check``, ``check-merge``,
``cite``, ``--version``); implemented in ``attnref._src.tools.cli``, with its BibTeX
(:mod:`citations`) and its terminal output (:mod:`console`)."""

from __future__ import annotations

from attnref._src.kit import console
from attnref._src.tools import citations
from attnref._src.tools.cli import CHECK_XLA_FLAGS, main

__all__ = ["CHECK_XLA_FLAGS", "citations", "console", "main"]
