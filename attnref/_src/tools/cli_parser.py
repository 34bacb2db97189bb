"""The ``attnref`` command line's argument parser: help as plain text with every option's
default, usage errors on one line of stderr with a "did you mean" where a name is close to a
known one, and the value checks of the report's options."""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from collections.abc import Iterable, Sequence
from typing import Any, NoReturn

from attnref._src.core.registry import ids
from attnref._src.formulations.feature_maps import (
    MAP_NAMES,
    elu_plus_one,
    identity_features,
    relu_features,
    taylor2,
)
from attnref._src.kit.conformance.options import SIGNATURES

# The feature maps by the names of their factories (``attnref.linear.relu_features``), as the
# README and the linear family's pages write them -> the name the formulations take. The CLI
# documents these names and also accepts the formulations' own (``relu``).
FEATURE_MAPS: dict[str, str] = {
    **{f.__name__: f().name for f in (elu_plus_one, relu_features, identity_features, taylor2)},
    "favor_plus": "favor_plus",  # drawn from the problem's seed (favor_plus(seed, d, m))
}
REPORT_DTYPES = ("float32", "float64")


def _run_options(parser: argparse.ArgumentParser, seed_help: str) -> None:
    """The options every kit command takes: the properties, the examples and the seed."""
    parser.add_argument(
        "--properties", metavar="LIST", help="comma-separated properties to run (default: all)"
    )
    parser.add_argument(
        "--max-examples", type=int, metavar="N", help="examples per property (default: 20)"
    )
    parser.add_argument("--seed", type=int, default=0, help=seed_help)


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """``" (did you mean 'x'?)"`` for the choice closest to ``word`` (difflib's ratio at least
    0.6, case and ``-``/``_`` ignored), else ``""``."""
    folded = {_fold(c): c for c in choices}
    if _fold(word) in folded and folded[_fold(word)] != word:
        return f" (did you mean {folded[_fold(word)]!r}?)"
    close = difflib.get_close_matches(_fold(word), list(folded), n=1, cutoff=0.6)
    return f" (did you mean {folded[close[0]]!r}?)" if close else ""


def _fold(word: str) -> str:
    return word.strip().lower().replace("_", "-")


class HelpFormatter(argparse.HelpFormatter):
    """argparse's help with each option's default appended, ``(default: 2)``, unless its help
    already says ``default`` or it has none to show (a flag, ``None``)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if "default" in text or action.nargs == 0 or not action.option_strings:
            return text
        if default is None or default is argparse.SUPPRESS:
            return text
        shown = ",".join(map(str, default)) if isinstance(default, (list, tuple)) else default
        return f"{text} (default: {str(shown).replace('%', '%%')})"


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line on stderr, ``attnref report: error:
    ...`` (exit 2), naming the close known option or value when there is one; an unknown option
    is reported by the subcommand it was given to."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        if choice := re.search(r"argument (\S+): invalid choice: '([^']*)'", message):
            name, given = choice.groups()
            for action in self._actions:
                if action.choices and name in (*action.option_strings, action.metavar):
                    message += did_you_mean(given, [str(c) for c in action.choices])
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: Any = None
    ) -> argparse.Namespace:
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            sub = self._subparser(getattr(parsed, "command", None))
            (sub or self).unrecognized(extras)
        return parsed

    def _subparser(self, command: str | None) -> Parser | None:
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction) and command in action.choices:
                found = action.choices[command]
                return found if isinstance(found, Parser) else None
        return None

    def unrecognized(self, extras: Sequence[str]) -> NoReturn:
        """The one-line error for arguments this parser does not know, with the option closest
        to the first unknown one."""
        known = [s for a in self._actions for s in a.option_strings if s.startswith("--")]
        flags = [e.split("=", 1)[0] for e in extras if e.startswith("-")]
        hint = did_you_mean(flags[0], known) if flags else ""
        self.error(f"unrecognized arguments: {' '.join(extras)}{hint}")


def positive(text: str) -> int:
    """``text`` as an integer of at least 1; otherwise argparse's one-line error."""
    value = nonnegative(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text!r}")
    return value


def nonnegative(text: str) -> int:
    """``text`` as an integer of at least 0; otherwise argparse's one-line error."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {text!r}")
    return value


def items(text: str) -> list[str]:
    """The non-empty items of a comma-separated list (at least one)."""
    found = [s.strip() for s in text.split(",") if s.strip()]
    if not found:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
    return found


def formulation_id(text: str) -> str:
    """``text`` if it is a registry id; otherwise argparse's one-line error naming the close id
    and the known ids."""
    known = ids()
    if text not in known:
        raise argparse.ArgumentTypeError(
            f"unknown formulation {text!r}{did_you_mean(text, known)} (known: {', '.join(known)})"
        )
    return text


def formulation_ids(text: str) -> list[str]:
    """Comma-separated registry ids; otherwise argparse's one-line error."""
    return [formulation_id(s) for s in items(text)]


def report_dtypes(text: str) -> list[str]:
    """Comma-separated dtypes of :data:`REPORT_DTYPES`; otherwise argparse's one-line error."""
    chosen = items(text)
    for name in chosen:
        if name not in REPORT_DTYPES:
            raise argparse.ArgumentTypeError(
                f"unknown dtype {name!r}{did_you_mean(name, REPORT_DTYPES)} "
                f"(choose from {', '.join(REPORT_DTYPES)})"
            )
    return chosen


def feature_map(text: str) -> str:
    """The formulations' name of feature map ``text``: a factory's name (``relu_features``) or
    the formulations' own (``relu``); otherwise argparse's one-line error."""
    if text in FEATURE_MAPS:
        return FEATURE_MAPS[text]
    if text in MAP_NAMES:
        return text
    raise argparse.ArgumentTypeError(
        f"unknown feature map {text!r}{did_you_mean(text, [*FEATURE_MAPS, *MAP_NAMES])} "
        f"(choose from {', '.join(FEATURE_MAPS)})"
    )


# What ``attnref check`` and ``check-merge`` add to XLA_FLAGS in the console script (each flag
# unless the caller's XLA_FLAGS sets it already): a check compiles the target at dozens of
# shapes, and compiling is most of its time. On the CPU (no other backend reads them), LLVM's
# optimisation level 0 and the classic elemental emitters cut XLA's compile time by more than
# half (a default check of jax.nn: 65 s -> 27 s on 2 cores), and one LLVM module per program
# instead of several on a thread pool cuts another 15% (39.4 s, 41.7 s -> 33.8 s, 35.3 s,
# alternating runs on 2 cores); they change how fast the generated code runs, not the
# operations it computes (the suite runs with the same three flags).
CHECK_XLA_FLAGS = (
    "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
    " --xla_cpu_parallel_codegen_split_count=1"
)
PROGRESS_HELP = "no progress bar (one is shown only when stderr is a terminal)"
DESCRIPTION = (
    "attnref: every formulation of multi-head attention against a float64 NumPy oracle, and "
    "the conformance properties for your own attention kernels. Tables print as plain text "
    "when piped (attnref report prints each row as it finishes) and are drawn by rich on a "
    "terminal; a progress bar shows on stderr only when it is a terminal. Exit status: 0 "
    "success, 1 a check or a bound failed, 2 a usage error (one line on stderr, naming the "
    "close option or name when there is one). 'attnref COMMAND --help' describes each command."
)
TARGET_HELP = (
    "the function to check: package.module:function (or package.module:obj.attr), or a "
    "file, path/to/attn.py:function"
)
SIZES_HELP = {
    "batch": "batch size B",
    "t_q": "query length T_q",
    "t_k": "key/value length T_k (cross-attention when it differs from T_q)",
    "num_heads": "number of heads H",
    "d_model": "model width d_model",
    "d_k": "query/key head dimension d_k",
    "d_v": "value head dimension d_v",
}


def build(
    version: str, problem: Any, masked_rows: Sequence[str], alignments: Sequence[str]
) -> Parser:
    """The ``attnref`` parser; ``problem`` is the report's default problem (its sizes are the
    flags' defaults), ``masked_rows`` and ``alignments`` the kit's accepted declarations."""
    p = Parser(prog="attnref", description=DESCRIPTION)
    p.add_argument("--version", action="version", version=f"%(prog)s {version}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _report_parser(sub, problem)
    sub.add_parser(
        "list",
        help="registered formulations with their equations",
        description="One entry per registered formulation: id, family, convention, title, "
        "equation, cost and citation (a table, wrapped to the terminal's width; plain text "
        "when piped, at most COLUMNS or 100 columns wide).",
    )
    _check_parser(sub, masked_rows, alignments)
    _merge_parser(sub)
    k = sub.add_parser(
        "cite",
        help="how to cite a formulation or a source: plain text or BibTeX",
        description="Print the citation of a registered formulation (its title, its sources "
        "and attnref) or of one source it cites, as plain text, or BibTeX entries with "
        "--bibtex. NAME is a registry id or a formulation's title (attnref list shows them), a "
        "short name (flash, flash-decoding, GQA, RoPE, Megatron, ...), a source's BibTeX key or "
        "its first author (elhage, vaswani, ...); case is ignored.",
    )
    k.add_argument("name", metavar="NAME", help="what to cite (see above)")
    k.add_argument("--bibtex", action="store_true", help="BibTeX entries instead of plain text")
    return p


def _report_parser(sub: Any, d: Any) -> None:
    r = sub.add_parser(
        "report",
        help="every formulation against the float64 oracle",
        description="Run every registered formulation (or those of --formulations) on one "
        "problem and print, per formulation and dtype, the max absolute and relative error "
        "against the float64 NumPy oracle, the error as a fraction of the derived bound "
        "(at most 1: within it), the analytic and XLA FLOPs, XLA's temporary bytes and the "
        "median jitted time. Piped, each row prints as it finishes. Exit status 1 if a row "
        "exceeds its bound.",
    )
    for name, about in SIZES_HELP.items():
        r.add_argument(
            f"--{name.replace('_', '-')}", type=positive, default=getattr(d, name), help=about
        )
    r.add_argument("--seed", type=nonnegative, default=d.seed, help="seed of the inputs")
    r.add_argument("--no-bias", action="store_true", help="parameters without biases")
    r.add_argument("--no-causal", action="store_true", help="no causal mask")
    r.add_argument(
        "--formulations",
        type=formulation_ids,
        metavar="IDS",
        help="comma-separated registry ids (default: all)",
    )
    r.add_argument(
        "--dtypes",
        type=report_dtypes,
        default=list(REPORT_DTYPES),
        help=f"comma-separated dtypes, from {', '.join(REPORT_DTYPES)}",
    )
    r.add_argument(
        "--feature-map",
        type=feature_map,
        default="elu_plus_one",
        metavar="NAME",
        help=f"the linear family's feature map: {', '.join(FEATURE_MAPS)} (attnref.linear's "
        "factories; relu and identity are accepted too)",
    )
    r.add_argument("--json", action="store_true", help="machine-readable output")
    r.add_argument("--repeats", type=positive, default=5, help="timed calls per formulation")
    r.add_argument(
        "--plot",
        metavar="DIR",
        help="also sweep T and write log-log PNGs to DIR (needs attnref[plot]; default: no plot)",
    )
    r.add_argument("--no-progress", action="store_true", help=PROGRESS_HELP)
    r.add_argument(
        "--mla",
        action="store_true",
        help="print multi-head latent attention's cost table instead (naive against absorbed "
        "form: matmul GFLOPs, cache bytes per token, the crossover T_q*) and exit",
    )


def _check_parser(sub: Any, masked_rows: Sequence[str], alignments: Sequence[str]) -> None:
    c = sub.add_parser(
        "check",
        help="run the conformance properties against your attention function",
        description="Run attnref's conformance properties (check_attention) against an "
        "attention function. One example in four takes tile-straddling lengths (15 to 513), "
        "so a fault in a kernel's last, partial tile fails by default. The check compiles the "
        "function at dozens of shapes: XLA's CPU compile runs with "
        f"{CHECK_XLA_FLAGS} unless XLA_FLAGS sets those flags. On Linux with glibc >= 2.35 "
        "the command restarts once with glibc.malloc.hugetlb=1 added to GLIBC_TUNABLES "
        "(huge pages for large buffers), unless GLIBC_TUNABLES names that tunable. Exit "
        "status: 0 all passed "
        "(skips allowed), 1 a property failed, 2 the target cannot be loaded or an option is "
        "invalid.",
    )
    c.add_argument("target", help=TARGET_HELP)
    about = {
        "jax_nn": "jax.nn.dot_product_attention's",
        "qkv_mask": "fn(q, k, v, mask)",
        "numpy": "NumPy in, NumPy out",
        "torch": "torch SDPA's, [B, N, T, H] tensors",
    }
    named = [f"{n} ({about[n]})" if n in about else n for n in SIGNATURES]
    c.add_argument(
        "--signature", default="jax_nn", help=f"how the function is called: {', '.join(named)}"
    )
    c.add_argument(
        "--features",
        metavar="LIST",
        help="comma-separated features the function supports (default: the signature's)",
    )
    _run_options(c, "base seed (a failure prints its own)")
    c.add_argument(
        "--masked-rows",
        default="zeros",
        choices=masked_rows,
        help="the function's declared output on fully masked rows (jax.nn and Flax: uniform)",
    )
    c.add_argument(
        "--causal-alignment",
        default="top_left",
        choices=alignments,
        help="the function's declared causal alignment when T != S (FlashAttention: bottom_right)",
    )
    c.add_argument(
        "--dtypes",
        metavar="LIST",
        help="comma-separated input dtypes the function takes (default: float32): the oracle "
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
        help="small: Hypothesis draws over small shapes; production: tile-boundary "
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
        "(otherwise a clear error, exit 2) (default: one device, no mesh)",
    )
    c.add_argument(
        "--refuses-lengths",
        action="store_true",
        help="a declared limit: the function refuses some sequence lengths (a blocked kernel "
        "whose block size must divide them); a clear refusal (ValueError, TypeError or "
        "NotImplementedError saying divisible, divide, multiple, length, pad, reshape or power "
        "of 2) draws "
        "another example and is counted in the property's detail instead of failing it "
        "(default: every refusal fails)",
    )
    c.add_argument(
        "--head-dim",
        metavar="H[,H_v]",
        help="a declared limit: the head dim of every example (default: 4 at small shapes; 64, "
        "128 and 256 at production shapes), for a kernel whose matrix units need more, e.g. 8 "
        "or 16 for jax.nn's cuDNN path; H,H_v gives the values a head dim of their own, e.g. "
        "192,128 for an MLA kernel (the only way the kit draws H_v != H)",
    )
    c.add_argument("--json", action="store_true", help="machine-readable report")
    c.add_argument("--no-progress", action="store_true", help=PROGRESS_HELP)
    c.add_argument(
        "--verbose",
        action="store_true",
        help="print a line per production case and per mesh size to stderr even when it is not "
        "a terminal (on a terminal these lines show above the progress bar anyway)",
    )


def _merge_parser(sub: Any) -> None:
    m = sub.add_parser(
        "check-merge",
        help="run the state-algebra properties against your merge_states",
        description="Run the attention state algebra's properties (check_merge_states: oracle, "
        "commutative, associative, identity, stability, dtypes, gradients) against a function "
        "merge(o_a, lse_a, o_b, lse_b) -> (o, lse). Exit status: 0 all passed, 1 a property "
        "failed, 2 the target cannot be loaded or an option is invalid.",
    )
    m.add_argument("target", help=TARGET_HELP)
    _run_options(m, "Hypothesis seed of every property")
    m.add_argument(
        "--dtypes",
        metavar="LIST",
        help="comma-separated formats, from float32,float64,bfloat16,float16 (default: all four)",
    )
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
