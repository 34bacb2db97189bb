"""The distributed schemes on 8 virtual CPU devices: load balance, communication, memory, time.

Not a test: run ``python benchmarks/bench_distributed.py [--out docs/distributed.md]`` (needs
matplotlib for ``docs/img/distributed.png``). For each scheme and ``T`` (causal self-attention,
kernel level, ``B = 1``, float32) it reports the per-device useful-FLOP balance (allowed causal
pairs, :func:`attnref.distributed.load_balance`), the bytes each device sends (the cost
model's and the compiled HLO's, :func:`attnref.costs.hlo_collectives`), the
temporary memory per device (XLA's ``memory_analysis()``, per device for an SPMD program) and
the time relative to single-device :func:`attnref.blockwise_dot_product_attention` on the same
host. The eight virtual devices share the host's cores, so that ratio measures the overhead of
distributing the computation, not a speedup.
"""

from __future__ import annotations

import os

# Eight virtual CPU devices; set before JAX starts (a caller's own device count wins).
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _sections import write_section  # noqa: E402  (benchmarks/ is on sys.path as a script)
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

import attnref  # noqa: E402
import attnref.distributed as dist  # noqa: E402
from attnref.costs import Dims, hlo_collectives, xla_counts  # noqa: E402
from attnref.distributed import (  # noqa: E402
    load_balance,
    padded_length,
    piece_tiles,
    ring_tiles_computed,
    useful_pairs,
)

# Scheme -> (kernel, the layout its useful work follows; None: heads split, every device alike)
RINGS = ("ring", "striped", "zigzag")
SCHEMES = {
    "ring": (dist.ring_dot_product_attention, "contiguous"),
    "striped": (dist.striped_dot_product_attention, "striped"),
    "zigzag": (dist.zigzag_dot_product_attention, "zigzag"),
    "all_gather": (dist.all_gather_dot_product_attention, "zigzag"),
    "ulysses": (dist.ulysses_dot_product_attention, None),
    "tensor_parallel": (dist.tensor_parallel_dot_product_attention, None),
}
MIB = 2.0**20


def _timeit(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _pieces(t: int, devices: int, layout: str) -> tuple[float, float]:
    """(busiest device, all devices): the ring's computed work under causality, in pieces
    (a piece is one step's ``c x c`` block; :func:`attnref.distributed.ring_tiles_computed`
    counts its computed ``n x n`` tiles, skipped tiles and steps doing none)."""
    n = piece_tiles(t, t, devices, layout, 0).shape[0]
    tiles = ring_tiles_computed(t, devices, layout)
    return float(tiles.max()) / n**2, float(tiles.sum()) / n**2


def _sent(collectives, *, scheme: bool) -> tuple[float, bool]:
    """MiB sent per device by the scheme's (or the partitioner's) collectives, and whether a
    count is an upper bound (a collective in a conditional branch)."""
    chosen = [c for c in collectives if c.in_shard_map == scheme and c.devices > 1]
    return sum(c.sent_bytes for c in chosen) / MIB, any(c.conditional for c in chosen)


def _measure(name, fn, q, k, v, repeats):
    jitted = jax.jit(fn)
    compiled = jitted.lower(q, k, v).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes / MIB
    found = hlo_collectives(compiled.as_text())
    out = np.asarray(jitted(q, k, v))
    ms = _timeit(jitted, q, k, v, repeats=repeats)
    return out, temp, found, ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--ts", default="1024,4096")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None, help="write the section of this Markdown page")
    ap.add_argument("--plot", default="docs/img/distributed.png")
    args = ap.parse_args()
    devices = jax.device_count()
    if devices < 8:
        raise SystemExit(f"needs 8 devices, found {devices} (XLA_FLAGS was set too late?)")
    mesh = dist.default_mesh(8)
    p = 8
    n, h = args.heads, args.head_dim
    replicated = NamedSharding(mesh, PartitionSpec())
    rows, results = [], {}
    for t in (int(v) for v in args.ts.split(",")):
        rng = np.random.default_rng(t)
        q, k, v = (
            jax.device_put(jnp.asarray(rng.standard_normal((1, t, n, h)), jnp.float32), replicated)
            for _ in range(3)
        )
        base_out, base_temp, _, base_ms = _measure(
            "blockwise",
            lambda q, k, v: attnref.blockwise_dot_product_attention(q, k, v, is_causal=True),
            q,
            k,
            v,
            args.repeats,
        )
        rows.append(
            f"| blockwise (1 device) | {t} | 1 | - | - | - | - | - | {base_temp:.1f} | "
            f"{base_ms:.0f} | 1.00x |"
        )
        dims = Dims(1, t, t, n, n * h, h, h, devices=p)
        for fid, (kernel, layout) in SCHEMES.items():
            out, temp, found, ms = _measure(
                fid,
                lambda q, k, v, kernel=kernel: kernel(q, k, v, mesh=mesh, is_causal=True),
                q,
                k,
                v,
                args.repeats,
            )
            # A smoke guard that the wiring computes the same function (the tests check the
            # schemes against the oracle with derived bounds; this only catches a broken run).
            assert np.allclose(out, base_out, rtol=1e-3, atol=1e-4), f"{fid} disagrees at T={t}"
            balance = 1.0 if layout is None else float(load_balance(t, p, layout))
            model = attnref.get(fid).cost_model(dims).sent_bytes / MIB
            sent, bound = _sent(found, scheme=True)
            reshard, _ = _sent(found, scheme=False)
            results[(fid, t)] = ms / base_ms
            busiest, total = _pieces(t, p, layout) if fid in RINGS else (0, 0)
            pieces = f"{busiest:g} / {total:g} of {p * p}" if fid in RINGS else "-"
            compiled = "-"
            if fid in RINGS:  # XLA's dot FLOPs of one loop trip (a step), over a whole piece's
                fn = jax.jit(
                    lambda q, k, v, kernel=kernel: kernel(q, k, v, mesh=mesh, is_causal=True)
                )
                piece = 2 * n * (2 * h) * (padded_length(t, p, layout) // p) ** 2
                compiled = f"{xla_counts(fn, q, k, v).dot_flops / piece:.4g}"
            rows.append(
                f"| {fid} | {t} | {balance:.4f} | {pieces} | {compiled} | {model:.2f} | "
                f"{'<= ' if bound else ''}"
                f"{sent:.2f} | {reshard:.2f} | {temp:.1f} | {ms:.0f} | {ms / base_ms:.2f}x |"
            )
            print(rows[-1], flush=True)
    machine = (
        f"{platform.platform()}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs shared by {p} virtual devices, JAX {jax.__version__} on "
        f"{jax.default_backend()}; B = 1, N = {n} heads, H = {h}, float32, causal "
        f"(`is_causal=True`), inputs replicated on the mesh, median of {args.repeats} calls "
        "after warm-up"
    )
    table = "\n".join(
        [
            "| scheme | T | useful FLOP balance (max/mean) | ring pieces computed (busiest / "
            "all) | step's dot FLOPs in XLA's count (pieces) | sent per device, model (MiB) | "
            "sent per device, HLO (MiB) | partitioner resharding (MiB) | temp per device (MiB) | "
            "time (ms) | time / blockwise |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
            *rows,
        ]
    )
    print(machine)
    print(table)
    plot = _plot(args.plot, results, p) if args.plot else None
    if args.out:
        rel = os.path.relpath(plot, Path(args.out).parent) if plot else ""
        figure = f"\n\n![time and balance]({rel})" if plot else ""
        write_section(
            args.out,
            "bench_distributed",
            "## Benchmark: 8 virtual CPU devices\n\n"
            "Generated by `python benchmarks/bench_distributed.py --out docs/distributed.md`. "
            "**The eight virtual devices share one host's cores**, so the time ratio against "
            "single-device `attnref.blockwise_dot_product_attention` measures the overhead of "
            "distributing (layouts, collectives, per-piece work, skipped and padded steps), not "
            "a speedup. A ratio below 1 is not a speedup either: XLA runs the virtual devices' "
            "programs concurrently on the host's cores and each device's piece is one naive "
            "product, while the single-device blockwise kernel loops over 128 x 128 tiles; on "
            "real devices the pieces run in parallel and the slowest device sets the time.\n\n"
            f"Machine and problem: {machine}.\n\n"
            "Columns: the useful-FLOP balance is max / mean of the allowed causal pairs per "
            "device (the layout's; Ulysses and tensor parallelism split heads: 1). Ring pieces: "
            "a ring step's piece (its queries against one K/V chunk) is computed in tiles "
            "(`attnref.distributed.piece_tiles`), each a naive product, and a tile or a whole "
            "step no local query may read is skipped (`attnref.distributed."
            "ring_tiles_computed`), so under causality the busiest device computes `P - 1/4` "
            "pieces' worth with contiguous chunks, `(2P + 1)/4` zigzag and `(n + 1)P/(2n)` "
            "striped in n x n tiles of 64 rows or more (`9P/16` at T = 4096), about half: the "
            "balance of the layouts shows as work. The step's "
            "dot FLOPs in XLA's count: `cost_analysis()` of the compiled kernel, which counts "
            "the loop body once and every branch of a `cond`, over a whole piece's; the striped "
            "ring's tiles above the diagonal are not in its program (`(n + 1)/(2n)` of a "
            "piece), the contiguous and zigzag rings skip their tiles at run time, under a `cond` "
            "(XLA's count: 1). On one host whose cores the devices share, total work sets the "
            "time; on real devices the busiest device does. "
            "Sent per "
            "device: the cost model's (the row form's communication: tensor parallelism's psum "
            "of the block output, which its kernel level does not run) and the compiled "
            "kernel's collectives inside the `shard_map` (`<=`: a send in a conditional branch, "
            "counted on every loop trip: the ring's last step sends nothing). Partitioner "
            "resharding: collectives XLA adds outside the `shard_map` to lay out the global "
            "arrays. Temp: XLA's `memory_analysis()` per device.\n\n"
            f"{table}{figure}\n",
        )


def _plot(path: str, results: dict, devices: int) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return None
    schemes = list(SCHEMES)
    ts = sorted({t for _, t in results})
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / len(ts)
    for i, t in enumerate(ts):
        xs = np.arange(len(schemes)) + i * width
        left.bar(xs, [results[(s, t)] for s in schemes], width, label=f"T = {t}")
    left.axhline(1.0, color="k", lw=0.8, ls="--")
    left.set_xticks(np.arange(len(schemes)) + width * (len(ts) - 1) / 2)
    left.set_xticklabels(schemes, rotation=20)
    left.set_ylabel("time / single-device blockwise")
    left.set_title(f"{devices} virtual CPU devices sharing one host's cores")
    left.legend()
    t = ts[-1]
    for j, layout in enumerate(("contiguous", "striped", "zigzag")):
        pairs = useful_pairs(t, devices, layout)
        right.bar(np.arange(devices) + j * 0.27, pairs / pairs.mean(), 0.27, label=layout)
    right.axhline(1.0, color="k", lw=0.8, ls="--")
    right.set_xlabel("device")
    right.set_ylabel("useful causal pairs / mean")
    right.set_title(f"causal load balance, T = {t}, P = {devices}")
    right.set_xticks(np.arange(devices) + 0.27)
    right.set_xticklabels([str(d) for d in range(devices)])
    right.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path


if __name__ == "__main__":
    main()
