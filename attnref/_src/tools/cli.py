"""The ``attnref`` command line: ``attnref report``, ``attnref list``, ``attnref check``,
``attnref check-merge``, ``attnref cite`` and ``attnref --version``.

Tables print as plain text when piped, drawn by rich on a terminal; a progress bar shows on
stderr only when it is a terminal. Exit status 2 is a usage error (one line of error on stderr).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from rich.table import Table
from rich.text import Text

from attnref import __version__
from attnref import conformance as kit
from attnref import report as _report_mod
from attnref._src.core.checks import enable_x64
from attnref._src.core.registry import formulations, get, ids
from attnref._src.formulations.feature_maps import MAP_NAMES
from attnref._src.formulations.mla_family import mla_cost_table
from attnref._src.kit import console
from attnref._src.kit.console import is_terminal
from attnref._src.tools import citations
from attnref.conformance import ALIGNMENTS, MASKED_ROWS

# What ``attnref check`` and ``check-merge`` add to XLA_FLAGS in the console script (each flag
# unless the caller's XLA_FLAGS sets it already): a check compiles the target at dozens of
# shapes, and compiling is most of its time. On the CPU (no other backend reads them), LLVM's
# optimisation level 0 and the classic elemental emitters cut XLA's compile time by more than
# half (a default check of jax.nn: 65 s -> 27 s on 2 cores); they change how fast the generated
# code runs, not the operations it computes (the suite runs with the same two flags).
CHECK_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="attnref", description=__doc__)
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("report", help="every formulation against the float64 oracle")
    d = _report_mod.Problem()
    for name in ("batch", "t_q", "t_k", "num_heads", "d_model", "d_k", "d_v"):
        r.add_argument(f"--{name.replace('_', '-')}", type=_positive, default=getattr(d, name))
    r.add_argument("--seed", type=_nonnegative, default=d.seed)
    r.add_argument("--no-bias", action="store_true", help="parameters without biases")
    r.add_argument("--no-causal", action="store_true", help="no causal mask")
    r.add_argument(
        "--formulations",
        type=_formulation_ids,
        help="comma-separated registry ids (default: all)",
    )
    r.add_argument(
        "--dtypes",
        type=_report_dtypes,
        default=REPORT_DTYPES,
        help=f"comma-separated dtypes, from {', '.join(REPORT_DTYPES)} (default: both)",
    )
    r.add_argument(
        "--feature-map",
        default="elu_plus_one",
        choices=MAP_NAMES,
        help="feature map for the linear family",
    )
    r.add_argument("--json", action="store_true", help="machine-readable output")
    r.add_argument("--repeats", type=_positive, default=5, help="timed calls per formulation")
    r.add_argument(
        "--plot",
        metavar="DIR",
        help="also sweep T and write log-log PNGs to DIR (needs attnref[plot])",
    )
    r.add_argument("--no-progress", action="store_true", help=PROGRESS_HELP)
    r.add_argument(
        "--mla",
        action="store_true",
        help="print multi-head latent attention's cost table instead (naive against absorbed "
        "form: matmul GFLOPs, cache bytes per token, the crossover T_q*) and exit",
    )
    sub.add_parser(
        "list",
        help="registered formulations with their equations",
        description="One line per registered formulation: id, family, convention, title, "
        "equation, cost and citation (a table; plain text when piped).",
    )
    c = sub.add_parser(
        "check",
        help="run the conformance properties against your attention function",
        description="Run attnref's conformance properties (check_attention) against an "
        "attention function. One example in four takes tile-straddling lengths (15 to 513), "
        "so a fault in a kernel's last, partial tile fails by default. The check compiles the "
        "function at dozens of shapes: XLA's CPU compile runs with "
        f"{CHECK_XLA_FLAGS} unless XLA_FLAGS sets those flags. Exit status: 0 all passed "
        "(skips allowed), 1 a property failed, 2 the target cannot be loaded or an option is "
        "invalid.",
    )
    c.add_argument("target", help="package.module:function (or package.module:obj.attr)")
    c.add_argument(
        "--signature",
        default="jax_nn",
        help="jax_nn (jax.nn.dot_product_attention's), qkv_mask (fn(q, k, v, mask)) or numpy "
        "(NumPy in, NumPy out); default jax_nn",
    )
    c.add_argument(
        "--features",
        help="comma-separated features the function supports (default: the signature's)",
    )
    c.add_argument("--properties", help="comma-separated properties to run (default: all)")
    c.add_argument("--max-examples", type=int, help="examples per property (20)")
    c.add_argument("--seed", type=int, default=0, help="base seed (a failure prints its own)")
    c.add_argument(
        "--masked-rows",
        default="zeros",
        choices=MASKED_ROWS,
        help="the function's declared output on fully masked rows (jax.nn and Flax: uniform)",
    )
    c.add_argument(
        "--causal-alignment",
        default="top_left",
        choices=ALIGNMENTS,
        help="the function's declared causal alignment when T != S (FlashAttention: bottom_right)",
    )
    c.add_argument(
        "--dtypes",
        help="comma-separated input dtypes the function takes (default float32): the oracle "
        "property runs in each, the others in the first (float32 when listed); with --devices, "
        "ring_size_growth runs in each, so list a 16-bit format next to float32 "
        "(float32,bfloat16) to check a 16-bit ring. A 16-bit merge of partial states must "
        "accumulate in float32 (the running output and lse), else the error grows with the "
        "ring size",
    )
    c.add_argument(
        "--shapes",
        default="small",
        choices=("small", "production"),
        help="small: Hypothesis draws over small shapes (default); production: tile-boundary "
        "lengths (2^k - 1, 2^k, 2^k + 1 up to 8193), head dims 64/128/256, up to 32 heads with "
        "GQA, every mask kind, against the fast float64 oracle (minutes on 2 cores)",
    )
    c.add_argument(
        "--devices",
        metavar="LIST",
        help="check a distributed kernel (fn(query, key, value, ..., mesh=, axis_name=)) on "
        "1-D meshes of these sizes, e.g. 1,2,4,8: every property on each size, plus "
        "ring_size_growth (in every --dtypes format: a 16-bit merge of partial states must "
        "accumulate in float32, the running output and lse, else the error grows with the ring "
        "size) and uneven_lengths. Lengths are multiples of 2 lcm(sizes), K/V head counts of "
        "lcm(sizes), so a head-parallel kernel can split them. The host needs that many "
        "devices: on a CPU host run with XLA_FLAGS=--xla_force_host_platform_device_count=8 "
        "(otherwise a clear error, exit 2)",
    )
    c.add_argument("--json", action="store_true", help="machine-readable report")
    c.add_argument("--no-progress", action="store_true", help=PROGRESS_HELP)
    c.add_argument(
        "--verbose",
        action="store_true",
        help="print a line per production case and per mesh size to stderr even when it is not "
        "a terminal (on a terminal these lines show above the progress bar anyway)",
    )
    m = sub.add_parser(
        "check-merge",
        help="run the state-algebra properties against your merge_states",
        description="Run the attention state algebra's properties (check_merge_states: oracle, "
        "commutative, associative, identity, stability, dtypes, gradients) against a function "
        "merge(o_a, lse_a, o_b, lse_b) -> (o, lse). Exit status: 0 all passed, 1 a property "
        "failed, 2 the target cannot be loaded or an option is invalid.",
    )
    m.add_argument("target", help="package.module:function")
    m.add_argument("--properties", help="comma-separated properties to run (default: all)")
    m.add_argument("--max-examples", type=int, help="examples per property (20)")
    m.add_argument("--seed", type=int, default=0, help="Hypothesis seed of every property")
    m.add_argument("--dtypes", help="comma-separated formats (float32,float64,bfloat16,float16)")
    m.add_argument(
        "--masked-rows",
        default="zeros",
        choices=("zeros", "nan"),
        help="the declared o of a merge of empty states",
    )
    m.add_argument(
        "--no-grad",
        action="store_true",
        help="the merge cannot be differentiated by jax.vjp (NumPy inside): skip gradients",
    )
    m.add_argument("--json", action="store_true", help="machine-readable report")
    k = sub.add_parser(
        "cite",
        help="how to cite a formulation: its sources and attnref",
        description="Print the citation of a registered formulation: its title, its sources "
        "and attnref (plain text), or BibTeX entries for them with --bibtex.",
    )
    k.add_argument("id", type=_formulation_id, help="a registry id (attnref list shows them)")
    k.add_argument("--bibtex", action="store_true", help="BibTeX entries instead of plain text")
    return p


PROGRESS_HELP = "no progress bar (one is shown only when stderr is a terminal)"
REPORT_DTYPES = ("float32", "float64")


def _positive(text: str) -> int:
    """``text`` as an integer of at least 1; otherwise argparse's one-line error."""
    value = _nonnegative(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text!r}")
    return value


def _nonnegative(text: str) -> int:
    """``text`` as an integer of at least 0; otherwise argparse's one-line error."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {text!r}")
    return value


def _formulation_ids(text: str) -> list[str]:
    """Comma-separated registry ids; otherwise argparse's one-line error naming the known ids."""
    return [_formulation_id(s) for s in _items(text)]


def _report_dtypes(text: str) -> list[str]:
    """Comma-separated dtypes of :data:`REPORT_DTYPES`; otherwise argparse's one-line error."""
    chosen = _items(text)
    for name in chosen:
        if name not in REPORT_DTYPES:
            raise argparse.ArgumentTypeError(
                f"unknown dtype {name!r} (choose from {', '.join(REPORT_DTYPES)})"
            )
    return chosen


def _items(text: str) -> list[str]:
    """The non-empty items of a comma-separated list (at least one)."""
    items = [s.strip() for s in text.split(",") if s.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
    return items


def _fail(command: str, error: Exception) -> SystemExit:
    """Print ``attnref <command>: error: <error>`` (one line) to stderr; the exit to raise."""
    message = " ".join(line.strip() for line in str(error).strip().splitlines())
    print(f"attnref {command}: error: {message}", file=sys.stderr)
    return SystemExit(2)


def _formulation_id(text: str) -> str:
    """``text`` if it is a registry id; otherwise argparse's one-line error naming the known ids."""
    known = ids()
    if text not in known:
        raise argparse.ArgumentTypeError(
            f"unknown formulation {text!r} (known: {', '.join(known)})"
        )
    return text


def _cite(fid: str, bibtex: bool) -> str:
    """The citation of registry entry ``fid``: plain text (title, the registry's citation,
    attnref's) or BibTeX (its sources' entries, then attnref's)."""
    if bibtex:
        return citations.formulation_bibtex(fid).rstrip()
    f = get(fid)
    return f"{f.title} ({fid})\n\nSources: {f.citation}\n\nattnref: {citations.attnref_text()}"


def _check_merge(args: argparse.Namespace) -> int:
    from attnref.testing import check_merge_states

    try:
        fn = kit.load(args.target)
    except kit.TargetError as e:
        _fail("check-merge", e)
        return 2
    kwargs: dict[str, Any] = {}
    if args.dtypes is not None:
        kwargs["dtypes"] = tuple(kit.split_list(args.dtypes) or ())
    try:
        report = check_merge_states(
            fn,
            max_examples=args.max_examples,
            seed=args.seed,
            masked_rows=args.masked_rows,
            properties=kit.split_list(args.properties) or None,
            target=args.target,
            grad=not args.no_grad,
            **kwargs,
        )
    except ValueError as e:
        raise _fail("check-merge", e) from None
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        console.emit(report)
    return 0 if report.passed else 1


def _check(args: argparse.Namespace) -> int:
    try:
        devices = kit.split_devices(args.devices)
    except ValueError as e:
        raise _fail("check", e) from None
    options = kit.Options(
        target=args.target,
        signature=args.signature,
        features=kit.split_list(args.features),
        max_examples=args.max_examples,
        seed=args.seed,
        masked_rows=args.masked_rows,
        causal_alignment=args.causal_alignment,
        dtypes=kit.split_list(args.dtypes),
        properties=kit.split_list(args.properties),
        shapes=args.shapes,
        devices=devices,
    )
    try:
        options.validate()
    except ValueError as e:
        raise _fail("check", e) from None
    try:
        fn = kit.load(args.target)
    except kit.TargetError as e:
        _fail("check", e)
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
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        console.emit(report)
        replay = _replay_text(report, options)
        if replay:
            print(replay)
    return 0 if report.passed else 1


def _replay_text(report: Any, options: kit.Options) -> str:
    """Per failure, the shell command that replays it (empty if none failed)."""
    failed = [r for r in report.results if r.status == "failed"]
    if not failed:
        return ""
    return "\nreplay from the shell:\n" + "\n".join(
        f"  {options.replay_command(r.name, r.seed, kit.failed_devices(r))}" for r in failed
    )


def _list() -> Table:
    """The registry as a table: a row per formulation, its title, equation, cost and citation
    on consecutive lines of the last column, a blank line between rows."""
    headings = ("id", "family", "convention", "title, equation, cost, citation")
    table = console.table(headings, terminal=is_terminal(sys.stdout))
    table.leading = 1
    for f in formulations():
        about = "\n".join((f.title, f.equation, f"cost: {f.cost}", f.citation))
        table.add_row(f.id, f.family.name, f.convention, Text(about))
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
    with enable_x64(), console.progress_bar(not args.no_progress) as bar:
        # the table includes float64 rows; float32 rows stay float32
        rows = _report_mod.run(
            problem, args.formulations, args.dtypes, repeats=args.repeats, progress=bar.update
        )
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
    else:
        console.emit(_report_mod.Table(rows, problem))
    return 0 if all(r.bound_ratio <= 1.0 for r in rows) else 1


def _compile_fast(argv: Sequence[str] | None) -> None:
    """Add to ``XLA_FLAGS`` each flag of :data:`CHECK_XLA_FLAGS` it does not set already (a
    caller's own setting wins), for a check run from the shell (``argv`` ``None``; JAX reads
    the variable when its backend starts, at the first computation)."""
    if argv is not None:
        return
    flags = os.environ.get("XLA_FLAGS", "")
    for flag in CHECK_XLA_FLAGS.split():
        if flag.split("=")[0] not in flags:
            flags = f"{flags} {flag}".strip()
    os.environ["XLA_FLAGS"] = flags


def _run(argv: Sequence[str] | None) -> int:
    """Parse ``argv`` and run the command; argparse exits 2 on a bad flag or value."""
    args = _parser().parse_args(argv)
    if args.command in ("check", "check-merge"):
        _compile_fast(argv)
    if args.command == "check":
        return _check(args)
    if args.command == "check-merge":
        return _check_merge(args)
    if args.command == "cite":
        print(_cite(args.id, args.bibtex))
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
    """Exit at once with ``status``, after flushing the standard streams: an interrupted JAX
    compilation can crash the interpreter's ordinary teardown (a segmentation fault, status
    -11, instead of 130)."""
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
