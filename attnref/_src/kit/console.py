"""Terminal output through rich: on a terminal (``stream.isatty()``), tables in colour and a
progress bar on stderr; elsewhere plain ASCII tables (no escape, no wrapping, no trailing space)
and no bar."""

from __future__ import annotations

import contextlib
import io
import sys
from collections.abc import Iterator, Sequence
from typing import Any

from rich import box
from rich.console import Console, RenderableType
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

__all__ = ["emit", "is_terminal", "make_console", "plain", "progress_bar", "table"]

# Wide enough that no line of a report is ever wrapped or cropped in plain text.
PLAIN_WIDTH = 100_000

# rich's SIMPLE_HEAD in ASCII: no frame, a row of '-' under the headings, a gap between columns.
ASCII_HEAD = box.Box("    \n    \n -  \n    \n    \n    \n    \n    \n", ascii=True)

STATUS_STYLES = {"passed": "green", "ok": "green", "failed": "bold red", "FAIL": "bold red"}


def is_terminal(stream: Any) -> bool:
    """``stream.isatty()``, False where it cannot answer."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


def make_console(stream: Any) -> Console:
    """A rich console on ``stream`` (plain and :data:`PLAIN_WIDTH` wide off a terminal); no
    markup, highlighting or emoji, so ``[float32]`` or ``:bias:`` print as written."""
    common: dict[str, Any] = {"file": stream, "markup": False, "highlight": False, "emoji": False}
    if is_terminal(stream):
        return Console(**common)
    return Console(**common, force_terminal=False, color_system=None, width=PLAIN_WIDTH)


def table(
    headings: Sequence[str],
    *,
    right: Sequence[str] = (),
    wrap: Sequence[str] | None = None,
    terminal: bool = False,
) -> Table:
    """An empty table with ``headings`` (``right`` ones right-aligned): no frame, headings
    underlined, two spaces between columns; in plain text the rule is ASCII and nothing wraps,
    on a narrow terminal the ``wrap`` columns (default: the last) wrap at spaces."""
    t = Table(
        box=box.SIMPLE_HEAD if terminal else ASCII_HEAD,
        show_edge=False,
        pad_edge=False,
        header_style="bold" if terminal else "",
        highlight=False,
        padding=(0, 1, 0, 0),  # with the rule's gap: two spaces between columns
    )
    wrapping = set(headings[-1:] if wrap is None else wrap) if terminal else set()
    for heading in headings:
        t.add_column(
            heading,
            justify="right" if heading in right else "left",
            no_wrap=heading not in wrapping,
            overflow="fold",
        )
    return t


def status_style(status: str, terminal: bool) -> str:
    """A status cell's colour on a terminal, none in plain text."""
    return STATUS_STYLES.get(status, "") if terminal else ""


def plain(renderable: RenderableType) -> str:
    """``renderable`` as plain text, as :func:`emit` writes it to a pipe (no final newline)."""
    buffer = io.StringIO()
    make_console(buffer).print(renderable)
    return "\n".join(line.rstrip() for line in buffer.getvalue().splitlines()).rstrip("\n")


def emit(renderable: RenderableType, stream: Any = None) -> None:
    """Print ``renderable`` to ``stream`` (default ``sys.stdout``): rich on a terminal, else
    :func:`plain`."""
    stream = sys.stdout if stream is None else stream
    if is_terminal(stream):
        make_console(stream).print(renderable)
    else:
        print(plain(renderable), file=stream)


class Bar:
    """What :func:`progress_bar` yields: ``update`` moves the bar, ``log`` prints above it."""

    def __init__(self, progress: Progress | None, log_stream: Any) -> None:
        self._progress = progress
        self._task = None if progress is None else progress.add_task("", total=None)
        self._log_stream = log_stream
        self._label: str | None = None

    def update(self, done: int, total: int, label: str) -> None:
        """Show ``done`` of ``total``, the running step ``label`` (drawn when it changes)."""
        if self._progress is not None and self._task is not None:
            changed, self._label = label != self._label, label
            self._progress.update(
                self._task, completed=done, total=total, description=label, refresh=changed
            )

    def log(self, line: str) -> None:
        """Print ``line`` above the bar (or to the log stream; else nowhere)."""
        if self._progress is not None:
            self._progress.console.print(line)
        elif self._log_stream is not None:
            print(line, file=self._log_stream, flush=True)


@contextlib.contextmanager
def progress_bar(enabled: bool = True, *, log: Any = None) -> Iterator[Bar]:
    """A :class:`Bar` on ``sys.stderr``, drawn if ``enabled`` and stderr is a terminal (``log``:
    where :meth:`Bar.log` lines go otherwise), erased when the block ends."""
    stream = sys.stderr
    if not (enabled and is_terminal(stream)):
        yield Bar(None, log)
        return
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
    bar = Progress(*columns, TimeElapsedColumn(), console=make_console(stream), transient=True)
    with bar as progress:
        yield Bar(progress, None)
