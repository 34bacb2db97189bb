"""``python -m attnref``: the ``attnref`` command (:func:`attnref.cli.main`)."""

from __future__ import annotations

import sys

from attnref.cli import main

if __name__ == "__main__":
    sys.exit(main())
