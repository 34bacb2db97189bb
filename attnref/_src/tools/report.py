"""``attnref report``: every registered formulation against the float64 oracle on one problem."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np
from rich.console import Console, ConsoleOptions, RenderableType
from rich.text import Text

from attnref._src.core.cost import Dims, cost, xla_counts
from attnref._src.core.params import AttentionParams, init_params
from attnref._src.core.registry import families, formulations, get
from attnref._src.kit import console

# ``progress(done, total, label)``: ``done`` of ``total`` entries finished, ``label`` running.
Progress = Callable[[int, int, str], None]


@dataclasses.dataclass(frozen=True)
class Problem:
    """A reproducible attention problem (row convention, self-attention unless ``t_k`` differs)."""

    batch: int = 2
    t_q: int = 16
    t_k: int = 16
    num_heads: int = 4
    d_model: int = 32
    d_k: int = 8
    d_v: int = 12
    bias: bool = True
    causal: bool = True
    seed: int = 0
    feature_map: str = "elu_plus_one"  # the linear family's (FAVOR+ gets 2 d_k features)

    def build(self, dtype: Any) -> tuple[AttentionParams, np.ndarray, np.ndarray]:
        """Parameters, ``x_q``, ``x_kv``: drawn in float64, rounded once to ``dtype``."""
        sizes = {"d_model": self.d_model, "num_heads": self.num_heads, "d_k": self.d_k}
        params = init_params(self.seed, **sizes, d_v=self.d_v, bias=self.bias, dtype=np.float64)
        rng = np.random.default_rng(self.seed + 1)
        x_q = rng.standard_normal((self.batch, self.t_q, self.d_model))
        kv_shape = (self.batch, self.t_k, self.d_model)
        x_kv = x_q if self.t_k == self.t_q else rng.standard_normal(kv_shape)
        return params.astype(dtype), x_q.astype(dtype), x_kv.astype(dtype)


@dataclasses.dataclass(frozen=True)
class Row:
    id: str
    dtype: str
    max_abs_error: float
    max_rel_error: float
    bound_ratio: float
    note: str = ""
    model_flops: int = 0  # analytic: matmul (exact) + elementwise (source count)
    model_matmul_flops: int = 0
    xla_flops: float = 0.0  # cost_analysis(); a while body counted once
    xla_dot_flops: int = 0
    temp_bytes: int = 0  # memory_analysis().temp_size_in_bytes
    median_us: float = 0.0  # median wall time of the jitted call after warm-up


def _dims(p: Problem, causal: bool, t_k: int, dt: np.dtype[Any]) -> Dims:
    sizes = (p.batch, p.t_q, t_k, p.num_heads, p.d_model, p.d_k, p.d_v)
    return Dims(*sizes, p.bias, p.feature_map, 2 * p.d_k, 16, dt.itemsize, causal)


def _median_us(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], repeats: int) -> float:
    def timed() -> float:
        start = time.perf_counter()
        jax.block_until_ready(fn(*args, **kwargs))
        return time.perf_counter() - start

    timed()  # compile and warm up
    return float(np.median([timed() for _ in range(repeats)])) * 1e6


def run(
    problem: Problem,
    ids: Sequence[str] | None = None,
    dtypes: Sequence[str] = ("float32", "float64"),
    *,
    repeats: int = 5,
    progress: Progress | None = None,
    on_row: Callable[[Row], None] | None = None,
) -> list[Row]:
    """Every chosen formulation on the problem: error against its family's oracle, analytic
    cost, XLA's counts and the median jitted time; ``on_row(row)`` gets each row once measured.

    Each entry runs causally if the problem is and the entry can (else in its default mode),
    with the keyword arguments of its family's ``example``. ``max_rel_error = max|y - y_64| /
    max|y_64|`` (normwise); ``bound_ratio`` is the largest ``|y - y_64| / bound`` with the
    derived componentwise bound of :mod:`attnref.tolerance` (at most 1: within it).
    ``progress(done, total, label)`` is called before each entry (``label``: its id and dtype)
    and once at the end (``label`` ``"done"``).
    """
    chosen = formulations() if ids is None else tuple(get(i) for i in ids)
    rows: list[Row] = []
    total = len(chosen) * len(dtypes)
    for dt_name in dtypes:
        dt = np.dtype(dt_name)
        params, x_q, x_kv = problem.build(dt)
        for f in chosen:
            if progress is not None:
                progress(len(rows), total, f"{f.id} {dt_name}")
            causal = problem.causal if problem.causal in f.causal_modes else f.causal_modes[0]
            example = f.family.example(problem, causal)
            kw, note = example.kwargs, example.note
            xkv = x_q if example.self_attention else x_kv
            ref = f.family.oracle(params, x_q, xkv, **kw)
            bound = f.family.bound(params, x_q, xkv, dtype=dt, **kw)
            fn = f.jit()
            out = fn(params, x_q, xkv, **kw)
            if out.dtype != dt:
                raise AssertionError(f"{f.id} computed in {out.dtype}, not {dt_name}")
            err = np.abs(np.asarray(out, dtype=np.float64) - ref)
            scale = float(np.abs(ref).max())
            with np.errstate(divide="ignore", invalid="ignore"):
                ratio = float(np.nanmax(np.where(err == 0, 0.0, err / bound)))
            t_k = problem.t_q if example.self_attention else problem.t_k
            model = cost(f.id, _dims(problem, causal, t_k, dt))
            xc = xla_counts(fn, params, x_q, xkv, **kw)
            errors = (float(err.max()), float(err.max() / scale), ratio, note)
            counts = (model.flops, model.matmul_flops, xc.flops, xc.dot_flops, xc.temp_bytes)
            measured = (*errors, *counts, _median_us(fn, (params, x_q, xkv), kw, repeats))
            rows.append(Row(f.id, dt_name, *measured))
            if on_row is not None:
                on_row(rows[-1])
    if progress is not None:
        progress(total, total, "done")
    return rows


def header(problem: Problem) -> str:
    """The report's three heading lines: the problem's sizes and flags; which oracle each
    family is compared with; what ``rel`` and ``err/bound`` mean."""
    return (
        f"attnref report: B={problem.batch} T_q={problem.t_q} T_k={problem.t_k} "
        f"H={problem.num_heads} d_model={problem.d_model} d_k={problem.d_k} "
        f"d_v={problem.d_v} bias={problem.bias} causal={problem.causal} seed={problem.seed}\n"
        "errors against the float64 NumPy oracle of each family ("
        + "; ".join(f"{fam.name}: oracle.{fam.oracle.__name__}" for fam in families())
        + ");\nrel = max|err| / max|y|; err/bound <= 1 means within the derived tolerance "
        "(attnref.tolerance)"
    )


FOOTER = (
    "model FLOPs: matmul (a multiply-add is 2; equal to XLA's dot count) + elementwise counted "
    "from attnref's source; XLA FLOPs: cost_analysis(), which counts a scan body once."
)
# Each column's heading and a row's cell in it, as both layouts print it.
_CELLS: tuple[tuple[str, Callable[[Row], str]], ...] = (
    ("formulation", lambda r: r.id),
    ("dtype", lambda r: r.dtype),
    ("max abs err", lambda r: f"{r.max_abs_error:.3e}"),
    ("max rel err", lambda r: f"{r.max_rel_error:.3e}"),
    ("err/bound", lambda r: f"{r.bound_ratio:.2e}"),
    ("ok", lambda r: "ok" if r.bound_ratio <= 1.0 else "FAIL"),
    ("model FLOPs", lambda r: f"{r.model_flops:,d}"),
    ("XLA FLOPs", lambda r: f"{r.xla_flops:,.0f}"),
    ("temp bytes", lambda r: f"{r.temp_bytes:,d}"),
    ("median us", lambda r: f"{r.median_us:.1f}"),
    ("setting", lambda r: r.note),
)
COLUMNS = tuple(heading for heading, _ in _CELLS)
NUMERIC = COLUMNS[2:5] + COLUMNS[6:10]


@dataclasses.dataclass(frozen=True)
class Table:
    """:func:`run`'s rows on ``problem`` as rich renders them (cells wrap to a terminal's
    width): :func:`header`, a row per formulation and dtype, the FLOP columns' legend."""

    rows: Sequence[Row]
    problem: Problem

    def __rich_console__(self, con: Console, options: ConsoleOptions) -> Iterator[RenderableType]:
        terminal = con.is_terminal
        yield Text(header(self.problem))
        yield Text("")
        table = console.table(COLUMNS, right=NUMERIC, terminal=terminal)
        for r in self.rows:
            cells = _cells(r)
            ok = Text(cells[5], console.status_style(cells[5], terminal))
            table.add_row(*cells[:5], ok, *cells[6:])
        yield table
        yield Text(FOOTER)


def _cells(r: Row) -> tuple[str, ...]:
    """Row ``r``'s cells, in :data:`COLUMNS`' order."""
    return tuple(cell(r) for _, cell in _CELLS)


# The plain layout's least widths of the numeric columns: a count up to 9,999,999,999 fits, the
# errors' and the time's formats always do; a wider cell widens its own line only.
_LEAST = {"model FLOPs": 13, "XLA FLOPs": 13, "temp bytes": 13, "ok": 4, "dtype": 7}


@dataclasses.dataclass(frozen=True)
class PlainRows:
    """The report as plain text a line at a time (``attnref report`` piped), its column widths
    fixed before any row exists (headings, ids, least widths); numbers right-aligned, columns
    two spaces apart, no trailing space."""

    problem: Problem
    ids: Sequence[str]

    def widths(self) -> tuple[int, ...]:
        first = max([len(COLUMNS[0]), *map(len, self.ids)])
        rest = [max(len(c), _LEAST.get(c, 0)) for c in COLUMNS[1:-1]]
        return (first, *rest)

    def line(self, cells: Sequence[str]) -> str:
        """One line of the table: ``cells`` in :data:`COLUMNS`' order, padded to the widths."""
        padded = [
            cell.rjust(w) if heading in NUMERIC else cell.ljust(w)
            for cell, w, heading in zip(cells, self.widths(), COLUMNS, strict=False)
        ]
        return "  ".join([*padded, *cells[len(padded) :]]).rstrip()

    def head(self) -> str:
        """What precedes the rows: :func:`header`, a blank line, the headings and their rule."""
        rule = self.line(["-" * w for w in self.widths()] + ["-" * len(COLUMNS[-1])])
        return f"{header(self.problem)}\n\n{self.line(COLUMNS)}\n{rule}"

    def row(self, r: Row) -> str:
        """Row ``r`` as one line."""
        return self.line(_cells(r))


def format_table(rows: Sequence[Row], problem: Problem) -> str:
    """:func:`run`'s ``rows`` as ``attnref report`` prints them to a pipe (:class:`PlainRows`):
    the heading, a blank line, an ASCII table (no line wrapped), the FLOP columns' legend."""
    plain = PlainRows(problem, [r.id for r in rows])
    return "\n".join([plain.head(), *map(plain.row, rows), FOOTER])


def to_json(rows: Sequence[Row], problem: Problem) -> str:
    return json.dumps(
        {"problem": dataclasses.asdict(problem), "rows": [dataclasses.asdict(r) for r in rows]},
        indent=2,
    )


SWEEP_T = (16, 32, 64, 128, 256)


def sweep(
    problem: Problem,
    ids: Sequence[str] | None = None,
    ts: Sequence[int] = SWEEP_T,
    *,
    repeats: int = 3,
    progress: Progress | None = None,
) -> list[Row]:
    """float32 rows of :func:`run` for self-attention at each ``T`` (``note`` holds ``T=...``);
    ``progress(done, total, label)`` counts the entries over every ``T``."""
    rows = []
    for i, t in enumerate(ts):
        sized = dataclasses.replace(problem, t_q=t, t_k=t)

        def step(done: int, total: int, label: str, i: int = i, t: int = t) -> None:
            if progress is not None and (label != "done" or i == len(ts) - 1):
                progress(i * total + done, len(ts) * total, f"sweep T={t}: {label}")

        for r in run(sized, ids, ("float32",), repeats=repeats, progress=step):
            rows.append(dataclasses.replace(r, note=f"T={t}"))
    return rows


def plot(rows: Sequence[Row], directory: str, problem: Problem | None = None) -> list[str]:
    """Log-log PNGs of :func:`sweep`'s rows against ``T``: ``cost_vs_T.png`` (model FLOPs, XLA
    FLOPs, XLA temporary bytes) and ``time_vs_T.png`` (median time): a colour and marker per
    formulation, a line style per family, the legend right of the axes.

    Args:
        rows: :func:`sweep`'s rows (``note`` is ``T=...``).
        directory: Where to write the PNGs (created if missing).
        problem: The swept problem, named in the figures' titles (its ``t_q``/``t_k`` ignored).

    Returns:
        The paths written.

    Raises:
        SystemExit: matplotlib (the ``plot`` extra) is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.lines import Line2D
        from matplotlib.ticker import FixedLocator, NullLocator, ScalarFormatter
    except ImportError as exc:  # pragma: no cover - depends on the optional extra
        raise SystemExit(
            "attnref report --plot needs matplotlib: pip install 'attnref[plot]'"
        ) from exc
    os.makedirs(directory, exist_ok=True)
    ids = list(dict.fromkeys(r.id for r in rows))
    ts = sorted({int(r.note[2:]) for r in rows})
    styles: tuple[Any, ...] = ("-", "--", "-.", ":")  # a line style per family, registry order
    style_of = {fam: styles[i % len(styles)] for i, fam in enumerate(families())}
    used = [fam for fam in families() if any(get(fid).family is fam for fid in ids)]
    panels = (
        ("model_flops", "analytic FLOPs (attnref.costs)", "FLOPs per call"),
        ("xla_flops", "XLA cost_analysis() FLOPs", "FLOPs per call"),
        ("temp_bytes", "XLA temporary memory", "bytes per call"),
        ("median_us", "median wall time of the jitted call", "time per call (\u00b5s)"),
    )
    setting = "float32 self-attention"
    if problem is not None:
        setting = (
            f"float32 {'causal ' if problem.causal else ''}self-attention, B={problem.batch}, "
            f"H={problem.num_heads}, d_model={problem.d_model}, d_k={problem.d_k}, "
            f"d_v={problem.d_v}"
        )
    figures = {
        "cost_vs_T.png": (panels[:3], "Cost of each formulation against sequence length T"),
        "time_vs_T.png": (panels[3:], "Time of each formulation against sequence length T"),
    }
    paths = []
    with plt.rc_context({"font.size": 11, "axes.titlesize": 12, "legend.fontsize": 10}):
        for name, (fields, title) in figures.items():
            n = len(fields)
            fig, axes = plt.subplots(
                1, n, figsize=(4.6 * n + 4.4, 5.2), squeeze=False, layout="constrained"
            )
            for ax, (field, panel, unit) in zip(axes[0], fields, strict=True):
                for k, fid in enumerate(ids):
                    pts = sorted((int(r.note[2:]), getattr(r, field)) for r in rows if r.id == fid)
                    ax.plot(
                        *zip(*pts, strict=True),
                        style_of[get(fid).family],
                        color=f"C{k % 10}",  # the tab10 cycle, then another marker
                        marker="os^Dv"[k // 10 % 5],
                        ms=4,
                        label=fid,
                    )
                ax.set_xscale("log", base=2)
                ax.set(yscale="log", xlabel="T (tokens, log scale)", ylabel=f"{unit}, log scale")
                ax.set_title(panel)
                ax.xaxis.set_major_locator(FixedLocator(ts))
                ax.xaxis.set_major_formatter(ScalarFormatter())
                ax.xaxis.set_minor_locator(NullLocator())
                ax.grid(True, which="major", alpha=0.35)
                ax.grid(True, which="minor", axis="y", alpha=0.12)
            handles = [
                Line2D([], [], color="black", linestyle=style_of[fam], label=f"{fam.name} family")
                for fam in used
            ] + axes[0][0].get_legend_handles_labels()[0]
            ncols = 1 if len(handles) <= 16 else 2
            fig.legend(handles=handles, loc="outside right center", ncols=ncols, frameon=False)
            fig.suptitle(f"{title}\n{setting}")
            paths.append(os.path.join(directory, name))
            fig.savefig(paths[-1], dpi=110)
            plt.close(fig)
    return paths
