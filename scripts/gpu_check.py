"""The GPU run, prepared as one script: ``python scripts/gpu_check.py [--quick] [--out FILE]``
(``nox -s gpu`` installs JAX with CUDA first, then runs it).

On a machine whose JAX default backend is a GPU it:

1. names the card (``jax.devices()[0].device_kind``) and the JAX version;
2. runs the kernel-level properties there (``pytest`` over ``tests/test_kernel.py``,
   ``test_blockwise.py``, ``test_split_kv.py``, ``test_sinks_dropout.py``; Hypothesis profile
   ``ci``); attnref's kernels then compute on the card, the oracle in NumPy;
3. runs the conformance kit (``check_attention``) against ``jax.nn.dot_product_attention`` with
   ``implementation="xla"`` and ``"cudnn"``, Pallas' flash attention
   (``jax.experimental.pallas.ops.gpu.attention.mha``) when it imports, and torch SDPA's flash
   and memory-efficient backends when torch with CUDA is present (through the ``numpy``
   signature: no gradients);
4. times the kernels (``benchmarks/bench_attention.py``) and writes the Markdown table to
   ``--out`` (default ``gpu_benchmarks.md``; ``docs/benchmarks.md`` to replace the page's).

Without a GPU it says so and runs step 3 for ``implementation="xla"`` alone, with one example
per property, so the script itself is exercised on any machine (``--quick`` does the same on a
GPU machine, to check the set-up in seconds). Each verdict is printed as
``kit: <target>: <passed> passed, <failed> failed, <skipped> skipped`` and the script's exit
status is 1 if a property of attnref's own kernels failed, 0 otherwise (a peer's failure is a
finding to report, not the script's failure).
"""

from __future__ import annotations

import argparse
import functools
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from attnref.testing import check_attention

ROOT = Path(__file__).resolve().parents[1]
PROPERTY_FILES = (
    "test_kernel.py",
    "test_blockwise.py",
    "test_split_kv.py",
    "test_sinks_dropout.py",
)


def _torch_sdpa(backend: str) -> Callable[..., Any] | None:
    """torch SDPA on CUDA with one backend, as a ``numpy``-signature target (``[B, T, N, H]``
    in and out; ``mask`` True = attend, ``is_causal`` top-left); ``None`` without torch+CUDA."""
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    chosen = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION}

    def sdpa(q: Any, k: Any, v: Any, bias: Any = None, mask: Any = None, **kw: Any) -> Any:
        def to(x: Any) -> Any:
            return torch.as_tensor(np.asarray(x)).cuda().transpose(1, 2)

        attn_mask = None if mask is None else torch.as_tensor(np.asarray(mask)).cuda()
        with sdpa_kernel(chosen[backend]):
            o = torch.nn.functional.scaled_dot_product_attention(
                to(q), to(k), to(v), attn_mask=attn_mask, is_causal=bool(kw.get("is_causal"))
            )
        return o.transpose(1, 2).cpu().numpy()

    return sdpa


def _pallas_mha() -> Callable[..., Any] | None:
    """Pallas' GPU flash attention (``mha(q, k, v, segment_ids, causal=...)``, ``[B, T, N, H]``),
    or ``None`` where it does not import."""
    try:
        from jax.experimental.pallas.ops.gpu import attention
    except ImportError:
        return None

    def mha(q: Any, k: Any, v: Any, bias: Any = None, mask: Any = None, **kw: Any) -> Any:
        scale = kw.get("scale") or 1.0 / np.sqrt(q.shape[-1])
        return attention.mha(q, k, v, None, sm_scale=scale, causal=bool(kw.get("is_causal")))

    return mha


def _verdict(name: str, report: Any) -> bool:
    counts = {
        s: sum(r.status == s for r in report.results) for s in ("passed", "failed", "skipped")
    }
    print(f"kit: {name}: {counts['passed']} passed, {counts['failed']} failed, "
          f"{counts['skipped']} skipped", flush=True)  # fmt: skip
    for r in report.results:
        if r.status == "failed":
            print(f"  {r.name}: {r.detail.splitlines()[0] if r.detail else ''}", flush=True)
    return counts["failed"] == 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one example per property, no pytest")
    ap.add_argument("--out", default="gpu_benchmarks.md", help="the benchmark table's file")
    args = ap.parse_args(argv)
    device = jax.devices()[0]
    gpu = device.platform == "gpu"
    print(f"device: {device.device_kind} ({device.platform}), jax {jax.__version__}", flush=True)
    if not gpu:
        print("no GPU: only the CPU check of the kit against jax.nn (xla) runs", flush=True)
    quick = args.quick or not gpu
    ok = True
    if not quick:
        env = {**os.environ, "HYPOTHESIS_PROFILE": "ci"}
        files = [str(ROOT / "tests" / f) for f in PROPERTY_FILES]
        ok = subprocess.run([sys.executable, "-m", "pytest", "-q", *files], env=env).returncode == 0
    targets: dict[str, Callable[..., Any] | None] = {
        "jax.nn (xla)": functools.partial(jax.nn.dot_product_attention, implementation="xla")
    }
    if gpu:
        targets["jax.nn (cudnn)"] = functools.partial(
            jax.nn.dot_product_attention, implementation="cudnn"
        )
        targets["pallas mha"] = _pallas_mha()
        targets["torch sdpa flash"] = _torch_sdpa("flash")
        targets["torch sdpa efficient"] = _torch_sdpa("efficient")
    examples = 1 if quick else None
    for name, fn in targets.items():
        if fn is None:
            print(f"kit: {name}: not available here", flush=True)
            continue
        signature = "numpy" if name.startswith("torch") else "jax_nn"
        features = None if name.startswith("jax.nn") else ("causal",)  # None: jax.nn's set
        # jax.nn's XLA path masks with a large finite negative: a fully masked row is the mean
        # of v (declared, as tests/test_conformance.py does); the others are run as they come.
        declared = {"masked_rows": "uniform"} if name == "jax.nn (xla)" else {}
        report = check_attention(
            fn, signature=signature, features=features, max_examples=examples, **declared
        )
        _verdict(name, report)
    if gpu and not args.quick:
        bench = [sys.executable, str(ROOT / "benchmarks" / "bench_attention.py"), "--out", args.out]
        subprocess.run(bench, check=False)
        print(f"benchmarks: {args.out}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
