"""How fast the float64 oracle is, measured against the machine's own float64 GEMM rate, and how
the JAX naive and blockwise kernels compare with ``jax.nn.dot_product_attention``.

Not a test: run ``python benchmarks/bench_oracle.py [--out docs/benchmarks.md] [--lengths ...]``.
One run on one machine prints (and with ``--out`` writes its section of the page):

* the machine's float64 GEMM throughput: ``np.matmul`` of two 2048 x 2048 matrices, median of
  five, measured in the same run;
* the fast oracle (``attnref.oracle.dot_product_attention``, the default ``method="fast"``) at
  ``B = 1, N = 8, H = 64``, ``T = S`` in ``--lengths`` (1024, 4096, 16384), causal and not: its
  time (median of three calls after a warm-up call, as the GEMM's), its useful FLOP rate (``4 B
  N T S H``, half of it when causal) as a fraction of the GEMM rate (goal: at least 50% at ``T
  >= 4096``), and its peak memory above the inputs and outputs (``tracemalloc``, over the
  warm-up call, which is not timed; goal: at most 256 MiB);
* the JAX kernels (:mod:`_jax_kernels`): time and temporary memory of the naive and blockwise
  kernels relative to ``jax.nn.dot_product_attention(implementation="xla")``.

Times are wall-clock medians; they depend on the machine and its load, so they are reported, never
asserted by a test.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
import tracemalloc

import numpy as np

# benchmarks/ is on sys.path when run as a script
from _jax_kernels import SETTINGS, format_rows, jax_kernel_rows
from _sections import write_section

from attnref import oracle

MIB = 2**20


def gemm_rate(n: int = 2048, repeats: int = 5) -> float:
    """The float64 ``np.matmul`` rate on ``n x n`` matrices, FLOP/s (median of ``repeats``)."""
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((n, n)), rng.standard_normal((n, n))
    a @ b  # warm-up: BLAS threads started
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return 2.0 * n**3 / statistics.median(times)


def oracle_row(
    t: int, causal: bool, heads: int = 8, head_dim: int = 64, repeats: int = 3
) -> dict[str, float]:
    """Time (median of ``repeats`` calls after a warm-up, as :func:`gemm_rate`), useful FLOP rate
    and peak extra memory (the warm-up call, traced) of the fast oracle."""
    rng = np.random.default_rng(t)
    q, k, v = (rng.standard_normal((1, t, heads, head_dim)) for _ in range(3))
    tracemalloc.start()  # the warm-up call, traced: tracing slows allocation, so it is not timed
    out = oracle.dot_product_attention(q, k, v, is_causal=causal)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        oracle.dot_product_attention(q, k, v, is_causal=causal)
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    flops = 4.0 * heads * t * t * head_dim * (0.5 if causal else 1.0)
    # the output and the lse are the call's own results; inputs were allocated before tracing
    results = out.nbytes + t * heads * 8
    return {
        "T": t,
        "causal": causal,
        "seconds": seconds,
        "flops": flops / seconds,
        "extra_mib": (peak - results) / MIB,
        "io_mib": (3 * q.nbytes + results) / MIB,
    }


def _machine() -> str:
    import jax

    return (
        f"{platform.platform()}, {platform.machine()}, {os.cpu_count()} CPUs, NumPy "
        f"{np.__version__}, JAX {jax.__version__} on {jax.default_backend()}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="1024,4096,16384", help="comma-separated T = S")
    ap.add_argument(
        "--jax-settings",
        default=None,
        help='T:mask pairs of the JAX kernels (default: _jax_kernels.SETTINGS; "": none)',
    )
    ap.add_argument("--out", default=None, help="write this benchmark's section here")
    args = ap.parse_args()
    rate = gemm_rate()
    print(f"float64 GEMM (2048 x 2048): {rate / 1e9:.1f} GFLOP/s")
    lines = [
        "| T = S | causal | time s | useful GFLOP/s | of GEMM rate | peak extra MiB "
        "(inputs + outputs MiB) |",
        "|---|---|---|---|---|---|",
    ]
    for t in (int(x) for x in args.lengths.split(",")):
        for causal in (False, True):
            r = oracle_row(t, causal)
            line = (
                f"| {t} | {'yes' if causal else 'no'} | {r['seconds']:.2f} | "
                f"{r['flops'] / 1e9:.1f} | {r['flops'] / rate:.0%} | "
                f"{r['extra_mib']:.0f} ({r['io_mib']:.0f}) |"
            )
            print(line)
            lines.append(line)
    rate_after = gemm_rate()
    print(f"float64 GEMM again after the oracle runs: {rate_after / 1e9:.1f} GFLOP/s")
    jax_rows = jax_kernel_rows(
        SETTINGS
        if args.jax_settings is None
        else tuple(
            (int(t), m) for t, m in (x.split(":") for x in args.jax_settings.split(",") if x)
        )
    )
    jtable = format_rows(jax_rows)
    print(jtable)
    if args.out:
        write_section(
            args.out,
            "bench_oracle",
            "## The float64 oracle and the JAX kernels\n\n"
            "Generated by `python benchmarks/bench_oracle.py --out docs/benchmarks.md`.\n\n"
            f"Machine: {_machine()}. float64 GEMM (`np.matmul`, 2048 x 2048, median of 5, "
            f"same run): {rate / 1e9:.1f} GFLOP/s before the oracle rows, "
            f"{rate_after / 1e9:.1f} after.\n\n"
            'The fast oracle (`attnref.oracle.dot_product_attention`, `method="fast"`), '
            "B = 1, N = 8, H = 64, float64. Useful FLOPs are `4 N T S H` (half when causal); "
            "the goals are at least 50% of the GEMM rate at T >= 4096 and at most 256 MiB "
            "above the inputs and outputs.\n\n"
            + "\n".join(lines)
            + '\n\nThe JAX kernels against `jax.nn.dot_product_attention(implementation="xla")`,'
            " jitted, float32, B = 1, N = 8, H = 64 (temporary memory from XLA's "
            "`memory_analysis()`; goals: the naive kernel at most 1.5x jax.nn's time at "
            "T = 4096; the blockwise form, which skips the tiles the mask removes, at most "
            "0.6x jax.nn's time causal at T = 4096 and 0.15x with a 256-token window at "
            "T = 8192, its memory a few percent of jax.nn's).\n\n" + jtable + "\n",
        )


if __name__ == "__main__":
    main()
