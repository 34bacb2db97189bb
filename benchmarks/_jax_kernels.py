"""Time and temporary memory of attnref's JAX kernels against ``jax.nn.dot_product_attention``.

Not a test: ``python benchmarks/_jax_kernels.py [--settings 4096:causal,8192:window 256]
[--repeats 5]`` prints
a table; ``benchmarks/bench_oracle.py`` calls :func:`jax_kernel_rows` for its section of
``docs/benchmarks.md``.

Three kernels compute the same attention on the same float32 inputs ``q, k, v [B, T, N, H]``
(``T = S``; no mask, causal, or a causal 256-token sliding window: :data:`MASKS`):
``jax.nn.dot_product_attention(implementation="xla")`` (the reference of every ratio),
``attnref.dot_product_attention`` (the naive form: every ``T x S`` logit at once) and
``attnref.blockwise_dot_product_attention`` (the flash form, its default blocks, skipping the
tiles the mask removes). Each is jitted and compiled once; the compiled executables then run
round-robin, ``repeats`` times each after one warm-up call, so a change in the machine's load
falls on all three alike. Reported: the median wall-clock time (``block_until_ready``) and XLA's
temporary memory, ``compiled.memory_analysis().temp_size_in_bytes`` (buffers beyond the
arguments and the output), each with its ratio to jax.nn's.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import attnref

MIB = 2**20

# The masks measured: name -> jax.nn-compatible options. "window 256": each query reads itself and
# the 255 keys before it (a causal sliding window of 256 tokens, Mistral's and Gemma's).
MASKS: dict[str, dict[str, Any]] = {
    "none": {},
    "causal": {"is_causal": True},
    "window 256": {"is_causal": True, "local_window_size": (255, 0)},
}

# name -> f(q, k, v, **mask options): the candidates, the reference (jax.nn) first.
KERNELS: dict[str, Callable[..., Any]] = {
    "jax.nn (xla)": functools.partial(jax.nn.dot_product_attention, implementation="xla"),
    "attnref naive": attnref.dot_product_attention,
    "attnref blockwise": attnref.blockwise_dot_product_attention,
}


def _inputs(t: int, batch: int, heads: int, head_dim: int) -> tuple[jax.Array, ...]:
    """Standard normal float32 ``q, k, v [batch, t, heads, head_dim]`` (PCG64 seed ``t``)."""
    rng = np.random.default_rng(t)
    shape = (batch, t, heads, head_dim)
    return tuple(jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in range(3))


def _temp_bytes(compiled: Any) -> float:
    """XLA's temporary memory of a compiled executable, bytes (NaN where it is not reported)."""
    analysis = compiled.memory_analysis()
    return float("nan") if analysis is None else float(analysis.temp_size_in_bytes)


def _run_once(compiled: Any, args: tuple[jax.Array, ...]) -> float:
    """Seconds of one call, up to ``block_until_ready``."""
    start = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    return time.perf_counter() - start


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


SETTINGS = (
    *((t, m) for t in (1024, 2048, 4096) for m in ("none", "causal")),
    (8192, "window 256"),
)


def jax_kernel_rows(
    settings: tuple[tuple[int, str], ...] = SETTINGS,
    *,
    batch: int = 1,
    heads: int = 8,
    head_dim: int = 64,
    repeats: int = 5,
) -> list[dict[str, Any]]:
    """Time and temporary memory of every kernel of :data:`KERNELS` at each setting.

    Args:
        settings: ``(T, mask)`` pairs: the sequence length ``T = S`` and a key of :data:`MASKS`.
        batch: The batch size ``B``.
        heads: The number of heads ``N`` (query and key/value heads alike).
        head_dim: The head dim ``H``.
        repeats: Timed calls per kernel and setting (after one warm-up call); the median is
            reported.

    Returns:
        One dict per setting and kernel, in that nesting order (jax.nn first): ``kernel``
        (name), ``T``, ``mask``, ``ms`` (median milliseconds), ``time_ratio``
        (``ms`` over jax.nn's), ``temp_mib`` (XLA's temporary memory, MiB) and ``temp_ratio``
        (over jax.nn's).

    Raises:
        ValueError: If ``repeats`` is less than 1.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    rows: list[dict[str, Any]] = []
    for t, mask in settings:
        args = _inputs(t, batch, heads, head_dim)
        compiled = {
            name: jax.jit(functools.partial(fn, **MASKS[mask])).lower(*args).compile()
            for name, fn in KERNELS.items()
        }
        times: dict[str, list[float]] = {name: [] for name in compiled}
        for c in compiled.values():
            _run_once(c, args)  # warm-up, not timed
        for _ in range(repeats):
            for name, c in compiled.items():
                times[name].append(_run_once(c, args))
        seconds = {name: statistics.median(ts) for name, ts in times.items()}
        temp = {name: _temp_bytes(c) for name, c in compiled.items()}
        ref = next(iter(KERNELS))
        for name in compiled:
            rows.append(
                {
                    "kernel": name,
                    "T": t,
                    "mask": mask,
                    "ms": seconds[name] * 1e3,
                    "time_ratio": _ratio(seconds[name], seconds[ref]),
                    "temp_mib": temp[name] / MIB,
                    "temp_ratio": _ratio(temp[name], temp[ref]),
                }
            )
        del compiled
    return rows


def format_rows(rows: list[dict[str, Any]]) -> str:
    """The rows of :func:`jax_kernel_rows` as a Markdown table."""
    lines = [
        "| kernel | T = S | mask | time ms | time / jax.nn | temp MiB | temp / jax.nn |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['kernel']} | {r['T']} | {r['mask']} | {r['ms']:.1f} | "
            f"{r['time_ratio']:.2f}x | {r['temp_mib']:.1f} | {r['temp_ratio']:.3f}x |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--settings",
        default=",".join(f"{t}:{m}" for t, m in SETTINGS),
        help="comma-separated T:mask pairs (masks: " + ", ".join(MASKS) + ")",
    )
    ap.add_argument("--repeats", type=int, default=5, help="timed calls per kernel (median)")
    args = ap.parse_args()
    settings = tuple((int(t), m) for t, m in (x.split(":") for x in args.settings.split(",")))
    print(f"JAX {jax.__version__} on {jax.default_backend()}, float32, B = 1, N = 8, H = 64")
    print(format_rows(jax_kernel_rows(settings, repeats=args.repeats)))


if __name__ == "__main__":
    main()
