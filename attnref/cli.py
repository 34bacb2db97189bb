"""The ``attnref`` command line (``attnref report``, ``list``, ``check``, ``check-merge``,
``cite``, ``--version``); implemented in ``attnref._src.tools.cli``."""

from __future__ import annotations

from attnref._src.tools.cli import CHECK_XLA_FLAGS, main

__all__ = ["CHECK_XLA_FLAGS", "main"]
