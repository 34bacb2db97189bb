"""``python -m attnref`` and the ``attnref`` console script: :func:`attnref.cli.main`, a check
first restarted once with huge pages (:mod:`attnref._src.tools.relaunch`)."""

from __future__ import annotations

import sys

from attnref._src.tools.relaunch import relaunch


def main() -> int:
    """The ``attnref`` command from the shell (``sys.argv``)."""
    relaunch(sys.argv)  # before JAX is imported: a restart then costs little
    from attnref.cli import main as run

    return run()


if __name__ == "__main__":
    sys.exit(main())
