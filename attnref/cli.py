"""The ``attnref`` command line: ``attnref report`` and ``attnref list``."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence

from attnref._src import report as _report
from attnref._src.checks import enable_x64
from attnref._src.feature_maps import MAP_NAMES
from attnref._src.registry import formulations


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="attnref", description=__doc__)
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
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "list":
        for f in formulations():
            print(
                f"{f.id:<18} [{f.family}, {f.convention}] {f.title}\n    {f.equation}\n"
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
