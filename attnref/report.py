"""``attnref report``: every registered formulation against the float64 oracle on one problem."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from attnref._src.cost import Dims, cost, xla_counts
from attnref._src.params import AttentionParams, init_params
from attnref._src.registry import families, formulations, get


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
        """Parameters, ``x_q``, ``x_kv``; drawn in float64 and rounded once to ``dtype`` (the
        causal mask, or the linear family's ``causal`` flag, comes from the family's
        ``example``)."""
        params = init_params(
            self.seed,
            d_model=self.d_model,
            num_heads=self.num_heads,
            d_k=self.d_k,
            d_v=self.d_v,
            bias=self.bias,
            dtype=np.float64,
        )
        rng = np.random.default_rng(self.seed + 1)
        x_q = rng.standard_normal((self.batch, self.t_q, self.d_model))
        x_kv = (
            x_q
            if self.t_k == self.t_q
            else rng.standard_normal((self.batch, self.t_k, self.d_model))
        )
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


def _dims(problem: Problem, causal: bool, t_k: int, dt: np.dtype[Any]) -> Dims:
    return Dims(
        problem.batch,
        problem.t_q,
        t_k,
        problem.num_heads,
        problem.d_model,
        problem.d_k,
        problem.d_v,
        bias=problem.bias,
        feature_map=problem.feature_map,
        features=2 * problem.d_k,
        chunk=16,
        itemsize=dt.itemsize,
        causal=causal,
    )


def _median_us(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], repeats: int) -> float:
    jax.block_until_ready(fn(*args, **kwargs))  # compile and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args, **kwargs))
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e6


def _progress(done: int, total: int, label: str, stream: Any) -> None:
    if stream is None:
        return
    width = 24
    filled = width * done // total
    end = "\n" if done == total else ""
    stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label:<32}{end}")
    stream.flush()


def run(
    problem: Problem,
    ids: Sequence[str] | None = None,
    dtypes: Sequence[str] = ("float32", "float64"),
    *,
    repeats: int = 5,
    progress: Any = None,
) -> list[Row]:
    """Every chosen formulation on the problem: error against its family's oracle, analytic
    cost, XLA's counts and the median jitted time.

    Each entry runs causally if the problem is and the entry can (else in its default mode),
    with the keyword arguments of its family's ``example`` (a causal mask, or the linear
    family's feature map and ``causal`` flag, self-attention when causal).

    ``max_rel_error = max|y - y_64| / max|y_64|`` (normwise); ``bound_ratio`` is the largest
    ``|y - y_64| / bound`` with the derived componentwise bound of :mod:`attnref.tolerance`
    (at most 1 means within the bound). ``progress`` is a stream for a progress bar.
    """
    chosen = formulations() if ids is None else tuple(get(i) for i in ids)
    rows = []
    total, done = len(chosen) * len(dtypes), 0
    for dt_name in dtypes:
        dt = np.dtype(dt_name)
        params, x_q, x_kv = problem.build(dt)
        for f in chosen:
            _progress(done, total, f"{f.id} {dt_name}", progress)
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
            rows.append(
                Row(
                    f.id,
                    dt_name,
                    float(err.max()),
                    float(err.max() / scale),
                    ratio,
                    note,
                    model.flops,
                    model.matmul_flops,
                    xc.flops,
                    xc.dot_flops,
                    xc.temp_bytes,
                    _median_us(fn, (params, x_q, xkv), kw, repeats),
                )
            )
            done += 1
    _progress(total, total, "done", progress)
    return rows


def format_table(rows: Sequence[Row], problem: Problem) -> str:
    head = (
        f"attnref report: B={problem.batch} T_q={problem.t_q} T_k={problem.t_k} "
        f"H={problem.num_heads} d_model={problem.d_model} d_k={problem.d_k} "
        f"d_v={problem.d_v} bias={problem.bias} causal={problem.causal} seed={problem.seed}\n"
        "errors against the float64 NumPy oracle of each family ("
        + "; ".join(f"{fam.name}: oracle.{fam.oracle.__name__}" for fam in families())
        + ");\nrel = max|err| / max|y|; err/bound <= 1 means within the derived tolerance "
        "(attnref.tolerance)\n"
    )
    lines = [
        f"{'formulation':<19} {'dtype':<8} {'max abs err':>11} {'max rel err':>11} "
        f"{'err/bound':>9} {'ok':<4} {'model FLOPs':>11} {'XLA FLOPs':>11} {'temp bytes':>10} "
        f"{'median us':>9}  setting"
    ]
    lines.append("-" * len(lines[0]))
    for r in rows:
        ok = "ok" if r.bound_ratio <= 1.0 else "FAIL"
        lines.append(
            f"{r.id:<19} {r.dtype:<8} {r.max_abs_error:>11.3e} {r.max_rel_error:>11.3e} "
            f"{r.bound_ratio:>9.2e} {ok:<4} {r.model_flops:>11,d} {r.xla_flops:>11,.0f} "
            f"{r.temp_bytes:>10,d} {r.median_us:>9.1f}  {r.note}"
        )
    lines.append(
        "model FLOPs: matmul (a multiply-add is 2; equal to XLA's dot count) + elementwise counted "
        "from attnref's source; XLA FLOPs: cost_analysis(), which counts a scan body once."
    )
    return head + "\n".join(lines)


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
    progress: Any = None,
) -> list[Row]:
    """float32 rows of :func:`run` for self-attention at each ``T`` (``note`` holds ``T=...``)."""
    rows = []
    for i, t in enumerate(ts):
        _progress(i, len(ts), f"sweep T={t}", progress)
        sized = dataclasses.replace(problem, t_q=t, t_k=t)
        for r in run(sized, ids, ("float32",), repeats=repeats):
            rows.append(dataclasses.replace(r, note=f"T={t}"))
    _progress(len(ts), len(ts), "sweep done", progress)
    return rows


def plot(rows: Sequence[Row], directory: str) -> list[str]:
    """Log-log PNGs of model FLOPs, XLA FLOPs, temporary bytes and time against ``T``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - depends on the optional extra
        raise SystemExit(
            "attnref report --plot needs matplotlib: pip install 'attnref[plot]'"
        ) from exc
    import os

    os.makedirs(directory, exist_ok=True)
    ids = list(dict.fromkeys(r.id for r in rows))
    styles = ("-", "--", "-.", ":")  # one line style per family, in registry order
    style_of = {fam: styles[i % len(styles)] for i, fam in enumerate(families())}
    panels = (
        ("model_flops", "analytic FLOPs"),
        ("xla_flops", "XLA cost_analysis FLOPs"),
        ("temp_bytes", "XLA temporary bytes"),
        ("median_us", "median time (us)"),
    )
    paths = []
    for name, (fields, suffix) in {
        "cost_vs_T.png": (panels[:3], "cost"),
        "time_vs_T.png": (panels[3:], "time"),
    }.items():
        fig, axes = plt.subplots(1, len(fields), figsize=(5.5 * len(fields), 4.5), squeeze=False)
        for ax, (field, label) in zip(axes[0], fields, strict=True):
            for fid in ids:
                pts = [(int(r.note[2:]), getattr(r, field)) for r in rows if r.id == fid]
                style = style_of[get(fid).family]
                ax.loglog(*zip(*pts, strict=True), style, marker="o", ms=3, label=fid)
            ax.set_xlabel("T (tokens)")
            ax.set_title(label)
            ax.grid(True, which="both", alpha=0.3)
        axes[0][-1].legend(fontsize=7, loc="upper left")
        fig.suptitle(f"attnref {suffix} against T (float32, self-attention)")
        fig.tight_layout()
        path = os.path.join(directory, name)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
