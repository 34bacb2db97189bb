"""The ``attnref`` command line: ``attnref report``, ``list``, ``check``, ``check-merge``,
``cite`` and ``--version`` (the parser, its help and its usage errors: :mod:`cli_parser`)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib.util
import json
import os
import shutil
import sys
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rich.table import Table
from rich.text import Text

from attnref import __version__
from attnref import conformance as kit
from attnref import report as _report_mod
from attnref._src.core.checks import enable_x64
from attnref._src.core.registry import formulations, get
from attnref._src.formulations.mla_family import mla_cost_table
from attnref._src.kit import console
from attnref._src.kit.console import is_terminal
from attnref._src.tools import citations
from attnref._src.tools.cli_parser import CHECK_XLA_FLAGS, build, did_you_mean
from attnref.conformance import ALIGNMENTS, MASKED_ROWS

__all__ = ["CHECK_XLA_FLAGS", "main"]


def _fail(command: str, error: Exception | str) -> SystemExit:
    """Print ``attnref <command>: error: <error>`` (one line) to stderr; the exit to raise."""
    message = " ".join(line.strip() for line in str(error).strip().splitlines())
    print(f"attnref {command}: error: {message}", file=sys.stderr)
    return SystemExit(2)


def _cite(name: str, bibtex: bool) -> str:
    """The citation of what ``name`` names (:func:`citations.resolve`, else a usage error): a
    formulation's title and sources, or one source and the formulations citing it; then
    attnref's. Plain text, or the BibTeX entries."""
    try:
        found = citations.resolve(name)
    except LookupError as e:
        raise _fail("cite", e) from None
    if found.kind == "formulation":
        if bibtex:
            return citations.formulation_bibtex(found.name).rstrip()
        f = get(found.name)
        return f"{f.title} ({f.id})\n\nSources: {f.citation}\n\nattnref: {citations.attnref_text()}"
    key = found.name
    if bibtex:
        ours = citations.bibtex(citations.ATTNREF_KEY, citations.attnref_entry())
        return f"{citations.bibtex(key, citations.ENTRIES[key])}\n\n{ours}"
    users = ", ".join(citations.citing(key))
    return (
        f"{citations.source_text(key)}\n\nCited by the formulations: {users}\n\n"
        f"attnref: {citations.attnref_text()}"
    )


def _suggestion(error: ValueError) -> str:
    """The "did you mean" of the kit's rejection of an option (``error``'s cause, an
    ``OptionError``): the accepted value closest to the first rejected one, or ``""``."""
    cause = error.__cause__
    accepted = getattr(cause, "accepted", ())
    value = getattr(cause, "value", None)
    first = value[0] if isinstance(value, (list, tuple)) and value else value
    return did_you_mean(first, accepted) if isinstance(first, str) and accepted else ""


def load(spec: str) -> Callable[..., Any]:
    """The callable ``spec`` names: ``package.module:function`` (the kit's :func:`kit.load`),
    or ``path/to/attn.py:function`` (a ``.py`` file, or a path with a ``/``), loaded from that
    file as a module, its directory first on ``sys.path`` (as ``python path/to/attn.py`` puts
    it) so its own imports of neighbours work. Every failure is a :class:`kit.TargetError`
    whose message (one line) says what was wrong."""
    where, sep, attr = spec.rpartition(":")
    if not sep or not (where.endswith(".py") or "/" in where or os.sep in where):
        return kit.load(spec)
    path = Path(where)
    if not path.is_file():
        raise kit.TargetError(f"target {spec!r}: no such file {where!r}")
    if not attr:
        raise kit.TargetError(f"target {spec!r} names no function: use {where}:function")
    name = "attnref_target_" + "".join(c if c.isalnum() else "_" for c in path.stem)
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise kit.TargetError(f"target {spec!r}: {where!r} cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    directory = str(path.resolve().parent)
    if directory not in sys.path:
        sys.path.insert(0, directory)
    sys.modules[name] = module  # before it runs: a dataclass in the file looks its module up
    try:
        module_spec.loader.exec_module(module)
    except BaseException as e:
        del sys.modules[name]
        if not isinstance(e, Exception):
            raise
        raise kit.TargetError(f"cannot load {where!r}: {type(e).__name__}: {e}") from e
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            hint = did_you_mean(part, [n for n in dir(obj) if not n.startswith("_")])
            raise kit.TargetError(f"target {spec!r}: {where!r} has no {part!r}{hint}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise kit.TargetError(f"target {spec!r} is a {type(obj).__name__}, not a callable")
    return obj  # type: ignore[no-any-return]


def _check_merge(args: argparse.Namespace) -> int:
    from attnref._src.kit.conformance.states import MERGE_DTYPES
    from attnref.testing import MERGE_PROPERTIES, check_merge_states

    chosen = kit.split_list(args.properties) or ()
    unknown = [p for p in chosen if p not in MERGE_PROPERTIES]
    hint = did_you_mean(unknown[0], MERGE_PROPERTIES) if unknown else ""
    fn = _load("check-merge", args.target)
    if fn is None:
        return 2
    dtypes = MERGE_DTYPES if args.dtypes is None else tuple(kit.split_list(args.dtypes) or ())
    try:
        report = check_merge_states(
            fn,
            max_examples=args.max_examples,
            seed=args.seed,
            masked_rows=args.masked_rows,
            properties=chosen or None,
            target=args.target,
            grad=not args.no_grad,
            dtypes=dtypes,
        )
    except ValueError as e:  # the engine's check of an option; hint: a misspelt property
        raise _fail("check-merge", f"{e}{hint}") from None
    return _emit(report, args.json)


def _load(command: str, target: str) -> Callable[..., Any] | None:
    """:func:`load` of ``target``; ``None`` once its failure is printed (exit status 2)."""
    try:
        return load(target)
    except kit.TargetError as e:
        _fail(command, e)
        return None


def _emit(report: Any, as_json: bool, replay: str = "") -> int:
    """Print a kit's ``report`` (JSON, or the table and then ``replay``); the exit status."""
    if as_json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        console.emit(report)
        if replay:
            print(replay)
    return 0 if report.passed else 1


def _check(args: argparse.Namespace) -> int:
    # the flags of the same names, the comma-separated lists split
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(kit.Options)}
    lists = {name: kit.split_list(given[name]) for name in ("features", "dtypes", "properties")}
    try:
        devices = kit.split_devices(args.devices)
        head_dim = kit.split_head_dim(args.head_dim)
        options = kit.Options(**{**given, **lists, "devices": devices, "head_dim": head_dim})
        options.validate()
    except ValueError as e:  # a split's error has no cause, hence no suggestion
        raise _fail("check", f"{e}{_suggestion(e)}") from None
    fn = _load("check", args.target)
    if fn is None:
        return 2
    try:
        options.preflight(fn)  # the engine's own checks (e.g. a feature the signature lacks)
    except ValueError as e:
        raise _fail("check", e) from None
    names = options.selected()
    log = sys.stderr if args.verbose else None
    with console.progress_bar(not args.no_progress, log=log) as bar:

        def progress(done: int, total: int, name: str) -> None:
            # the engine reports each finished property; the bar names the one running next
            bar.update(done, total, f"{names[done]} ..." if done < len(names) else "done")

        if names:
            progress(0, len(names), names[0])
        report = options.run(fn, progress=progress, log=bar.log)
    return _emit(report, args.json, "" if args.json else _replay_text(report, options))


def _replay_text(report: Any, options: kit.Options) -> str:
    """Per failure, the shell command that replays it (empty if none failed)."""
    failed = [r for r in report.results if r.status == "failed"]
    if not failed:
        return ""
    return "\nreplay from the shell:\n" + "\n".join(
        f"  {options.replay_command(r.name, r.seed, kit.failed_devices(r))}" for r in failed
    )


def _list() -> Table:
    """The registry as a table, a blank line between rows, the last column holding title,
    equation, cost and citation; rich wraps it on a terminal, else each line is wrapped at spaces
    to the width ``shutil.get_terminal_size`` reports (``COLUMNS``, else 100), continued lines
    indented by two (a longer word, such as a long LaTeX command run, is cut)."""
    headings = ("id", "family", "convention", "title, equation, cost, citation")
    terminal = is_terminal(sys.stdout)
    table = console.table(headings, terminal=terminal)
    table.leading = 1
    entries = formulations()
    columns: list[list[str]] = [[f.id, f.family.name, str(f.convention)] for f in entries]
    used = sum(max(len(headings[i]), *(len(c[i]) for c in columns)) + 2 for i in range(3))
    width = max(shutil.get_terminal_size((100, 24)).columns - used, 30)
    for f in entries:
        about = [f.title, f.equation, f"cost: {f.cost}", f.citation]
        if not terminal:
            wrap = functools.partial(textwrap.wrap, subsequent_indent="  ", break_on_hyphens=False)
            about = ["\n".join(wrap(line, width)) for line in about]
        table.add_row(f.id, f.family.name, f.convention, Text("\n".join(about)))
    return table


def _report(args: argparse.Namespace) -> int:
    if args.mla:  # an analytic table: nothing to compute
        print(mla_cost_table())
        return 0
    sizes = {f.name for f in dataclasses.fields(_report_mod.Problem)} - {"bias", "causal"}
    problem = _report_mod.Problem(
        **{name: getattr(args, name) for name in sizes},
        bias=not args.no_bias,
        causal=not args.no_causal,
    )
    # Piped, the rows print as they are measured (a report of every formulation takes a
    # minute); on a terminal the progress bar runs and rich draws the table at the end.
    stream = None
    if not (args.json or is_terminal(sys.stdout)):
        stream = _report_mod.PlainRows(problem, args.formulations or [f.id for f in formulations()])
        print(stream.head(), flush=True)

    def on_row(row: _report_mod.Row) -> None:
        if stream is not None:
            print(stream.row(row), flush=True)

    with enable_x64(), console.progress_bar(not args.no_progress) as bar:
        # the table includes float64 rows; float32 rows stay float32
        rows = _report_mod.run(
            problem,
            args.formulations,
            args.dtypes,
            repeats=args.repeats,
            progress=bar.update,
            on_row=on_row,
        )
        if stream is not None:
            print(_report_mod.FOOTER, flush=True)
        if args.plot:
            swept = _report_mod.sweep(problem, args.formulations, progress=bar.update)
            try:
                paths = _report_mod.plot(swept, args.plot, problem)
            except OSError as e:
                raise _fail("report", e) from None
            for path in paths:
                print(f"wrote {path}", file=sys.stderr)
    if args.json:
        print(_report_mod.to_json(rows, problem))
    elif stream is None:
        console.emit(_report_mod.Table(rows, problem))
    return 0 if all(r.bound_ratio <= 1.0 for r in rows) else 1


def _compile_fast(argv: Sequence[str] | None) -> None:
    """From the shell (``argv`` ``None``), add to ``XLA_FLAGS`` each flag of
    :data:`CHECK_XLA_FLAGS` it does not set (JAX reads it at the first computation)."""
    if argv is not None:
        return
    flags = os.environ.get("XLA_FLAGS", "")
    for flag in CHECK_XLA_FLAGS.split():
        if flag.split("=")[0] not in flags:
            flags = f"{flags} {flag}".strip()
    os.environ["XLA_FLAGS"] = flags


def _run(argv: Sequence[str] | None) -> int:
    """Parse ``argv`` and run the command; argparse exits 2 on a bad flag or value."""
    args = build(__version__, _report_mod.Problem(), MASKED_ROWS, ALIGNMENTS).parse_args(argv)
    if args.command in ("check", "check-merge"):
        _compile_fast(argv)
    if args.command == "check":
        return _check(args)
    if args.command == "check-merge":
        return _check_merge(args)
    if args.command == "cite":
        print(_cite(args.name, args.bibtex))
        return 0
    if args.command == "list":
        console.emit(_list())
        return 0
    return _report(args)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``attnref`` with ``argv`` (default: ``sys.argv[1:]``); the exit status: 0 success,
    1 a check or a bound failed, 2 a usage error. A closed pipe (``attnref list | head -1``)
    ends the command quietly with status 141 (128 + SIGPIPE, as a tool killed by the signal
    reports), Ctrl-C with status 130; neither prints a traceback."""
    try:
        status = _run(argv)
        sys.stdout.flush()  # a closed pipe shows here, not at the interpreter's exit
    except BrokenPipeError:
        _silence_stdout()
        return 141
    except KeyboardInterrupt:
        print("attnref: interrupted", file=sys.stderr)
        if argv is None:  # the console script: leave now, without the interpreter's teardown
            _leave(130)
        return 130
    return status


def _leave(status: int) -> None:
    """Flush the standard streams and exit at once: an interrupted JAX compilation can crash
    the interpreter's teardown (a segmentation fault, status -11, instead of 130)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's final flush of the output a closed
    pipe refused raises nothing (the recipe of Python's ``signal`` documentation)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # not a real file (pytest's capture)
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


if __name__ == "__main__":
    sys.exit(main())
