"""The ``attnref`` command line: ``attnref report``, ``attnref list``, ``attnref check``,
``attnref check-merge``, ``attnref cite`` and ``attnref --version``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from typing import Any

from attnref import __version__
from attnref import conformance as kit
from attnref import report as _report
from attnref._src import citations
from attnref._src.checks import enable_x64
from attnref._src.feature_maps import MAP_NAMES
from attnref._src.registry import formulations, get, ids
from attnref.conformance import ALIGNMENTS, MASKED_ROWS


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="attnref", description=__doc__)
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("report", help="every formulation against the float64 oracle")
    d = _report.Problem()
    for name in ("batch", "t_q", "t_k", "num_heads", "d_model", "d_k", "d_v", "seed"):
        r.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(d, name))
    r.add_argument("--no-bias", action="store_true", help="parameters without biases")
    r.add_argument("--no-causal", action="store_true", help="no causal mask")
    r.add_argument(
        "--formulations", default=None, help="comma-separated registry ids (default: all)"
    )
    r.add_argument("--dtypes", default="float32,float64", help="comma-separated dtypes")
    r.add_argument(
        "--feature-map",
        default="elu_plus_one",
        choices=MAP_NAMES,
        help="feature map for the linear family",
    )
    r.add_argument("--json", action="store_true", help="machine-readable output")
    r.add_argument("--repeats", type=int, default=5, help="timed calls per formulation")
    r.add_argument(
        "--plot",
        metavar="DIR",
        default=None,
        help="also sweep T and write log-log PNGs to DIR (needs attnref[plot])",
    )
    r.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    sub.add_parser("list", help="registered formulations with their equations")
    c = sub.add_parser(
        "check",
        help="run the conformance properties against your attention function",
        description="Run attnref's conformance properties (check_attention) against an "
        "attention function. Exit status: 0 all passed (skips allowed), 1 a property failed, "
        "2 the target cannot be loaded or an option is invalid.",
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
        default=None,
        help="comma-separated features the function supports (default: the signature's)",
    )
    c.add_argument(
        "--properties", default=None, help="comma-separated properties to run (default: all)"
    )
    c.add_argument("--max-examples", type=int, default=None, help="examples per property (20)")
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
    c.add_argument("--dtypes", default=None, help="comma-separated input dtypes (float32)")
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
        default=None,
        metavar="LIST",
        help="check a distributed kernel (fn(query, key, value, ..., mesh=, axis_name=)) on "
        "1-D meshes of these sizes, e.g. 1,2,4,8: every property on each size, plus "
        "ring_size_growth and uneven_lengths. The host needs that many devices: on a CPU host "
        "run with XLA_FLAGS=--xla_force_host_platform_device_count=8 (otherwise a clear error, "
        "exit 2)",
    )
    c.add_argument("--json", action="store_true", help="machine-readable report")
    c.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    m = sub.add_parser(
        "check-merge",
        help="run the state-algebra properties against your merge_states",
        description="Run the attention state algebra's properties (check_merge_states: oracle, "
        "commutative, associative, identity, stability, dtypes) against a function "
        "merge(o_a, lse_a, o_b, lse_b) -> (o, lse). Exit status: 0 all passed, 1 a property "
        "failed, 2 the target cannot be loaded or an option is invalid.",
    )
    m.add_argument("target", help="package.module:function")
    m.add_argument(
        "--properties", default=None, help="comma-separated properties to run (default: all)"
    )
    m.add_argument("--max-examples", type=int, default=None, help="examples per property (20)")
    m.add_argument("--seed", type=int, default=0, help="Hypothesis seed of every property")
    m.add_argument(
        "--dtypes", default=None, help="comma-separated formats (float32,float64,bfloat16,float16)"
    )
    m.add_argument(
        "--masked-rows",
        default="zeros",
        choices=("zeros", "nan"),
        help="the declared o of a merge of empty states",
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


def _check_merge(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from attnref.testing import check_merge_states

    try:
        fn = kit.load(args.target)
    except kit.TargetError as e:
        print(f"attnref check-merge: {e}", file=sys.stderr)
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
            **kwargs,
        )
    except ValueError as e:
        parser.error(str(e))  # exits 2
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(report.summary().rstrip())
    return 0 if report.passed else 1


def _check(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        devices = kit.split_devices(args.devices)
    except ValueError as e:
        parser.error(str(e))  # exits 2
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
        parser.error(str(e))  # exits 2
    try:
        fn = kit.load(args.target)
    except kit.TargetError as e:
        print(f"attnref check: {e}", file=sys.stderr)
        return 2
    try:
        options.preflight(fn)  # the engine's own checks (e.g. a feature the signature lacks)
    except ValueError as e:
        parser.error(str(e))
    stream = None if args.no_progress else sys.stderr
    names = options.selected()

    def progress(done: int, total: int, name: str) -> None:
        # the engine reports each finished property; the bar names the one running next
        label = f"{names[done]} ..." if done < len(names) else "done"
        _report._progress(done, total, label, stream)

    if names:
        _report._progress(0, len(names), f"{names[0]} ...", stream)

    def log(line: str) -> None:
        if stream is not None:
            print(f"\r  {line:<70}", file=stream, flush=True)

    report = options.run(fn, progress=progress, log=log)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(_check_text(report, options))
    return 0 if report.passed else 1


def _check_text(report: Any, options: kit.Options) -> str:
    """The engine's summary (table, declared differences, each failure's message, shrunk
    example and seed) and, per failure, the shell command that replays it."""
    text = report.summary().rstrip()
    failed = [r for r in report.results if r.status == "failed"]
    if failed:
        text += "\n\nreplay from the shell:\n" + "\n".join(
            f"  {options.replay_command(r.name, r.seed, kit.failed_devices(r))}" for r in failed
        )
    return text


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "check":
        return _check(args, parser)
    if args.command == "check-merge":
        return _check_merge(args, parser)
    if args.command == "cite":
        print(_cite(args.id, args.bibtex))
        return 0
    if args.command == "list":
        for f in formulations():
            print(
                f"{f.id:<18} [{f.family.name}, {f.convention}] {f.title}\n    {f.equation}\n"
                f"    cost: {f.cost}\n    {f.citation}"
            )
        return 0
    sizes = {f.name for f in dataclasses.fields(_report.Problem)} - {"bias", "causal"}
    problem = _report.Problem(
        **{name: getattr(args, name) for name in sizes},
        bias=not args.no_bias,
        causal=not args.no_causal,
    )
    ids = None if args.formulations is None else [s.strip() for s in args.formulations.split(",")]
    stream = None if args.no_progress else sys.stderr
    chosen_dtypes = [s.strip() for s in args.dtypes.split(",")]
    with enable_x64():  # the table includes float64 rows; float32 rows stay float32
        rows = _report.run(problem, ids, chosen_dtypes, repeats=args.repeats, progress=stream)
        if args.plot:
            swept = _report.sweep(problem, ids, progress=stream)
            for path in _report.plot(swept, args.plot):
                print(f"wrote {path}", file=sys.stderr)
    print(_report.to_json(rows, problem) if args.json else _report.format_table(rows, problem))
    return 0 if all(r.bound_ratio <= 1.0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
