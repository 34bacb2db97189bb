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

``--steps`` picks among ``properties`` (2), ``probe`` (Pallas' ``mha`` on chosen shapes
against a float64 softmax), ``kit`` (3) and ``bench`` (4); ``--only a,b`` keeps the kit
targets whose names contain ``a`` or ``b``.

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
import time
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
        return o.transpose(1, 2).cpu().numpy()  # the input's dtype (float16 for flash)

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


def _pallas_probe() -> None:
    """Pallas' ``mha`` against a float64 NumPy softmax on a few shapes: the largest error per
    shape, so a shape it mishandles (short sequences, head dims that are not powers of 2)
    shows by itself, apart from the kit's properties."""
    try:
        from jax.experimental.pallas.ops.gpu import attention
    except ImportError:
        return
    rng = np.random.default_rng(0)
    # (T, S, H, causal): powers of 2, the kit's small head dims (4, 8), lengths that are not
    # powers of 2, and causal with T > S (finding 2 of docs/clients.md, seen there in
    # interpret mode) and T < S.
    shapes = ((128, 128, 64, False), (128, 128, 64, True), (16, 16, 16, False), (8, 8, 16, False),
              (16, 16, 12, False), (16, 16, 4, False), (16, 16, 4, True), (32, 32, 8, True),
              (4, 4, 4, True), (5, 5, 4, False), (40, 40, 64, True), (32, 16, 16, True),
              (256, 128, 64, True), (16, 32, 16, True))  # fmt: skip
    for t, s_len, h, causal in shapes:
        for dtype in (np.float32, np.float16):
            q = rng.standard_normal((1, t, 2, h)).astype(dtype)
            k, v = (rng.standard_normal((1, s_len, 2, h)).astype(dtype) for _ in range(2))
            s = np.einsum("bqnh,bknh->bnqk", q.astype(np.float64), k.astype(np.float64))
            s /= np.sqrt(h)
            if causal:  # top-left, as Pallas' own mha_reference (jnp.tril of [T, S])
                s = np.where(np.tril(np.ones((t, s_len), bool)), s, -np.inf)
            w = np.exp(s - s.max(-1, keepdims=True))
            ref = np.einsum("bnqk,bknh->bqnh", w / w.sum(-1, keepdims=True), v.astype(np.float64))
            case = f"pallas probe: T={t} S={s_len} H={h} causal={causal} {np.dtype(dtype).name}"
            try:
                out = attention.mha(q, k, v, None, sm_scale=1.0 / np.sqrt(h), causal=causal)
                out = np.asarray(out, np.float64)
                err = float(np.max(np.abs(np.nan_to_num(out - ref, nan=np.inf))))
                rows = np.flatnonzero(np.any(~(np.abs(out - ref) < 0.1), axis=(0, 2, 3)))
                print(f"{case}: max |out - ref| = {err:.2e}; rows off by >= 0.1: "
                      f"{rows.tolist()[:12]}", flush=True)  # fmt: skip
            except Exception as e:
                print(f"{case}: {type(e).__name__}: {e}"[:300], flush=True)


def _verdict(name: str, report: Any) -> bool:
    """Print the counts, then each failure's first three lines (its shapes and its error)."""
    counts = {
        s: sum(r.status == s for r in report.results) for s in ("passed", "failed", "skipped")
    }
    print(f"kit: {name}: {counts['passed']} passed, {counts['failed']} failed, "
          f"{counts['skipped']} skipped", flush=True)  # fmt: skip
    for r in report.results:
        if r.status == "failed":
            lines = (r.detail or "").splitlines()[:3]
            print(f"  {r.name}: " + "\n    ".join(line[:400] for line in lines), flush=True)
            shapes = {k: getattr(a, "shape", a) for k, a in (r.inputs or {}).items()}
            print(f"    inputs: {shapes}"[:600], flush=True)
            for line in (r.example or "").splitlines()[:4]:
                print(f"    {line[:400]}", flush=True)
    return counts["failed"] == 0


def _run(cmd: list[str], seconds: float, env: dict[str, str] | None = None) -> bool:
    """Run ``cmd``, stopped after ``seconds`` (reported, not raised); True if it exited 0."""
    print(f"$ {' '.join(cmd)}", flush=True)
    try:
        return subprocess.run(cmd, env=env, timeout=seconds, check=False).returncode == 0
    except subprocess.TimeoutExpired:
        print(f"stopped after {seconds:.0f} s", flush=True)
        return False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one example per property, no pytest")
    ap.add_argument("--out", default="gpu_benchmarks.md", help="the benchmark table's file")
    ap.add_argument("--examples", type=int, default=None, help="kit examples per property")
    ap.add_argument("--budget", type=float, default=900.0, help="seconds for each slow step")
    ap.add_argument(
        "--steps",
        default="properties,probe,kit,bench",
        help="comma-separated steps to run: properties (pytest), probe (Pallas), kit, bench",
    )
    ap.add_argument(
        "--only", default="", help="kit: only targets whose name contains one of these (a,b)"
    )
    args = ap.parse_args(argv)
    steps = set(args.steps.split(","))
    device = jax.devices()[0]
    gpu = device.platform == "gpu"
    print(f"device: {device.device_kind} ({device.platform}), jax {jax.__version__}", flush=True)
    if not gpu:
        print("no GPU: only the CPU check of the kit against jax.nn (xla) runs", flush=True)
    quick = args.quick or not gpu
    ok = True
    if not quick and "properties" in steps:
        # Each pytest worker is a process of its own: none may take the card's memory up front.
        env = {**os.environ, "HYPOTHESIS_PROFILE": "ci", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
        # tests/conftest.py sets CPU code-generation flags unless XLA_FLAGS is set; a GPU build
        # of XLA that does not know one aborts at start (the likely cause of the workers that
        # died without a message on the H100), so the card's run sets its own (none).
        env.setdefault("XLA_FLAGS", "")
        files = [str(ROOT / "tests" / f) for f in PROPERTY_FILES]
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "4", *files]
        ok = _run(cmd, args.budget, env)
    highest = jax.default_matmul_precision("highest")

    def xla_highest(*a: Any, **kw: Any) -> Any:
        with highest:  # IEEE float32 products (a GPU's default for float32 is TF32)
            return jax.nn.dot_product_attention(*a, implementation="xla", **kw)

    # name -> (fn, declared options): the kit's verdicts on each peer kernel.
    targets: dict[str, tuple[Callable[..., Any] | None, dict[str, Any]]] = {
        # jax.nn's XLA path masks with a large finite negative: a fully masked row is the mean
        # of v (declared, as tests/test_conformance.py does).
        "jax.nn (xla)": (
            functools.partial(jax.nn.dot_product_attention, implementation="xla"),
            {"masked_rows": "uniform"},
        )
    }
    if gpu:
        targets["jax.nn (xla, highest precision)"] = (xla_highest, {"masked_rows": "uniform"})
        # Head dim 16: the kit's small shapes have 4, which cuDNN refuses and Pallas computes
        # wrongly (below 8 in float32, below 16 in float16; docs/benchmarks.md).
        targets["jax.nn (cudnn, bfloat16)"] = (
            functools.partial(jax.nn.dot_product_attention, implementation="cudnn"),
            {"dtypes": ("bfloat16",), "features": ("causal", "gqa")},
        )
        targets["jax.nn (cudnn, bfloat16, head dim 16)"] = (
            functools.partial(jax.nn.dot_product_attention, implementation="cudnn"),
            {"dtypes": ("bfloat16",), "head_dim": 16, "refuses_lengths": True},
        )
        # Pallas refuses lengths its blocks do not divide and that are not powers of 2
        # (declared); float32 products are TF32 there, float16 isolates its logic from that.
        pallas = {"features": ("causal",), "refuses_lengths": True}
        targets["pallas mha"] = (_pallas_mha(), pallas)
        targets["pallas mha (head dim 16)"] = (_pallas_mha(), {**pallas, "head_dim": 16})
        f16 = {**pallas, "dtypes": ("float16",), "head_dim": 16}
        targets["pallas mha (float16, head dim 16)"] = (_pallas_mha(), f16)
        targets["pallas mha (float16, head dim 16, cross)"] = (
            _pallas_mha(),
            {**f16, "features": ("causal", "cross")},
        )
        # Production shapes: head dims 64-256, lengths 2^k - 1, 2^k, 2^k + 1 (the first cases
        # of each sweep with --examples).
        targets["pallas mha (float16, production shapes)"] = (
            _pallas_mha(),
            {**pallas, "dtypes": ("float16",), "shapes": "production",
             "features": ("causal", "grad")},
        )  # fmt: skip
        targets["jax.nn (cudnn, bfloat16, production shapes)"] = (
            functools.partial(jax.nn.dot_product_attention, implementation="cudnn"),
            {"dtypes": ("bfloat16",), "features": ("causal", "gqa"), "shapes": "production",
             "refuses_lengths": True},
        )  # fmt: skip
        targets["torch sdpa flash (float16)"] = (
            _torch_sdpa("flash"),
            {"signature": "numpy", "features": ("causal",), "dtypes": ("float16",)},
        )
        targets["torch sdpa efficient"] = (
            _torch_sdpa("efficient"),
            {"signature": "numpy", "features": ("causal",)},
        )
        if "probe" in steps:
            _pallas_probe()
    examples = 1 if quick else args.examples
    for name, (fn, declared) in targets.items():
        if "kit" not in steps or not any(o in name for o in args.only.split(",")):
            continue
        if fn is None:
            print(f"kit: {name}: not available here", flush=True)
            continue
        options = {"signature": "jax_nn", "features": None, **declared}  # None: jax.nn's set
        start = time.perf_counter()
        try:
            report = check_attention(fn, max_examples=examples, **options)
        except Exception as e:  # a peer that cannot run at all is a finding, not a crash
            print(f"kit: {name}: could not run: {type(e).__name__}: {e}"[:400], flush=True)
            continue
        _verdict(name, report)
        print(f"  ({time.perf_counter() - start:.0f} s)", flush=True)
    if gpu and not args.quick and "bench" in steps:
        kernels = [sys.executable, str(ROOT / "benchmarks" / "_jax_kernels.py"), "--repeats", "10"]
        kernels += ["--settings", "1024:none,4096:none,4096:causal,8192:causal,8192:window 256"]
        _run(kernels, args.budget)
        # The same with IEEE float32 products in jax.nn (attnref's kernels ask for them).
        _run(kernels, args.budget, {**os.environ, "JAX_DEFAULT_MATMUL_PRECISION": "highest"})
        bench = [sys.executable, str(ROOT / "benchmarks" / "bench_attention.py"), "--out", args.out]
        # Flax and jax.nn in IEEE float32 too: the table checks each against attnref's at 1e-3.
        _run(bench, args.budget, {**os.environ, "JAX_DEFAULT_MATMUL_PRECISION": "highest"})
        print(f"benchmarks: {args.out}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
