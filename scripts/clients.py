"""The conformance kit on real clients: ``python scripts/clients.py [--examples N] [--out FILE]
[--row NAME ...]`` (``nox -s clients`` runs it with torch and Equinox installed and writes
``docs/clients.md``).

Each row runs :func:`attnref.testing.check_attention` on an attention kernel people use, with the
features and the masked-row meaning that kernel declares (its documented options; the row says
which), and records the verdict, the properties that ran and the time. The modules with
projections (Flax's ``nnx.MultiHeadAttention`` and ``linen.MultiHeadDotProductAttention``,
Equinox's ``MultiheadAttention``, ``torch.nn.MultiheadAttention``, Hugging Face's
``BertSelfAttention``) get identity projections through attnref's converters
(:mod:`attnref.interop`: ``W_Q`` maps ``x[:, n H + h]`` to head ``n``'s ``q[:, h]``, and ``W_O``
back), so the module computes exactly the attention of the ``q, k, v`` the kit draws: every
product with the identity is exact in floating point, and the kit's bound is the kernel's.

A row whose package is missing is left out with a note. After the rows, the findings: peer
behaviour the kit or a direct repro showed, each with the repro and the number measured now.
Exit status 0 (a peer's failure is a finding, not the script's failure), 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import math
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import attnref
from attnref.interop import to_flax, to_hf_bert, to_torch_mha
from attnref.testing import check_attention

ROOT = Path(__file__).resolve().parents[1]


@dataclasses.dataclass
class Row:
    """One kernel: ``build()`` returns ``(fn, check_attention keywords)`` or raises
    ``ModuleNotFoundError`` (the row is left out, the note names the package); ``declares``
    says where its features and masked-row meaning come from."""

    name: str
    kernel: str
    build: Callable[[], tuple[Callable[..., Any], dict[str, Any]]]
    declares: str
    why: str = ""  # what the verdict means, where a property fails or the row is special


def _identity_params(n: int, h: int) -> attnref.AttentionParams:
    """Multi-head params with identity projections: ``d_model = N H``, head ``n`` reads columns
    ``n H .. n H + H - 1`` and ``W_O`` writes them back (float32)."""
    d = n * h
    eye = np.eye(d, dtype=np.float32)
    w_in = np.ascontiguousarray(eye.reshape(d, n, h).transpose(1, 0, 2))  # [N, d_model, H]
    return attnref.AttentionParams(w_in, w_in, w_in, eye.reshape(n, h, d))


def _merge_heads(x: Any) -> Any:
    return x.reshape(*x.shape[:2], -1)  # [B, T, N, H] -> [B, T, N H]


# --- JAX rows ----------------------------------------------------------------------------------


def _jax_nn() -> tuple[Callable[..., Any], dict[str, Any]]:
    fn = functools.partial(jax.nn.dot_product_attention, implementation="xla")
    return fn, {"masked_rows": "uniform"}


def _pallas(grad: bool) -> Callable[[], tuple[Callable[..., Any], dict[str, Any]]]:
    def build() -> tuple[Callable[..., Any], dict[str, Any]]:
        from jax.experimental.pallas.ops.gpu.attention import mha

        def pallas_mha(query: Any, key: Any, value: Any, *, scale: Any = None, **kw: Any) -> Any:
            # mha's sm_scale defaults to 1.0, not 1/sqrt(H): the wrapper passes the kit's scale
            sm = 1 / math.sqrt(query.shape[-1]) if scale is None else scale
            causal = bool(kw.pop("is_causal", False))
            if kw:
                raise TypeError(f"pallas_mha takes no {sorted(kw)}")
            return mha(query, key, value, None, sm_scale=sm, causal=causal, interpret=True)

        if grad:  # the forward row runs the rest
            kw = {"features": ("causal", "grad"), "properties": ("gradients",)}
        else:
            kw = {"features": ("causal",)}
        return pallas_mha, {**kw, "refuses_lengths": True}

    return build


@functools.cache
def _nnx_module(n: int, h: int) -> Any:
    with jax.ensure_compile_time_eval():  # built on the first (traced) call: concrete weights
        return _new_nnx_module(n, h)


def _new_nnx_module(n: int, h: int) -> Any:
    from flax import nnx

    d = n * h
    m = nnx.MultiHeadAttention(
        num_heads=n, in_features=d, qkv_features=d, out_features=d, use_bias=False,
        decode=False, rngs=nnx.Rngs(0),
    )  # fmt: skip
    tree = to_flax(_identity_params(n, h))
    for name in ("query", "key", "value", "out"):
        getattr(m, name).kernel[...] = jnp.asarray(tree[name]["kernel"])
    return m


def _flax_nnx() -> tuple[Callable[..., Any], dict[str, Any]]:
    import flax.nnx  # noqa: F401  (a missing Flax leaves the row out)

    def nnx_mha(query: Any, key: Any, value: Any, mask: Any = None) -> Any:
        m = _nnx_module(query.shape[2], query.shape[3])
        out = m(_merge_heads(query), _merge_heads(key), _merge_heads(value), mask=mask)
        return out.reshape((*query.shape[:3], value.shape[3]))

    return nnx_mha, {"features": ("mask", "cross", "grad"), "masked_rows": "uniform"}


def _flax_linen() -> tuple[Callable[..., Any], dict[str, Any]]:
    import flax.linen as nn

    def linen_mha(query: Any, key: Any, value: Any, mask: Any = None) -> Any:
        n, h = query.shape[2], query.shape[3]
        module = nn.MultiHeadDotProductAttention(
            num_heads=n, qkv_features=n * h, out_features=n * h, use_bias=False
        )
        params = {"params": to_flax(_identity_params(n, h))}
        out = module.apply(
            params, _merge_heads(query), _merge_heads(key), _merge_heads(value), mask=mask
        )
        return out.reshape((*query.shape[:3], value.shape[3]))

    return linen_mha, {"features": ("mask", "cross", "grad"), "masked_rows": "uniform"}


def _equinox() -> tuple[Callable[..., Any], dict[str, Any]]:
    import equinox as eqx

    @functools.cache
    def module(n: int, h: int) -> Any:
        with jax.ensure_compile_time_eval():  # built on the first (traced) call
            return new_module(n, h)

    def new_module(n: int, h: int) -> Any:
        d = n * h
        m = eqx.nn.MultiheadAttention(n, d, key=jax.random.key(0))
        sd = to_hf_bert(_identity_params(n, h))  # nn.Linear's [out, in], as Equinox's Linear
        names = {"query_proj": "self.query.weight", "key_proj": "self.key.weight"}
        names |= {"value_proj": "self.value.weight", "output_proj": "output.dense.weight"}
        for attr, k in names.items():
            m = eqx.tree_at(lambda m, a=attr: getattr(m, a).weight, m, jnp.asarray(sd[k]))
        return m

    def eqx_mha(query: Any, key: Any, value: Any, mask: Any = None) -> Any:
        b, t, n, h = query.shape
        s = key.shape[1]
        m = module(n, h)
        full = (
            jnp.ones((b, n, t, s), bool) if mask is None else jnp.broadcast_to(mask, (b, n, t, s))
        )
        out = jax.vmap(m)(_merge_heads(query), _merge_heads(key), _merge_heads(value), full)
        return out.reshape(b, t, n, value.shape[3])

    return eqx_mha, {"features": ("mask", "cross", "grad"), "masked_rows": "uniform"}


# --- torch rows --------------------------------------------------------------------------------


def _torch_sdpa(backend: str) -> Callable[[], tuple[Callable[..., Any], dict[str, Any]]]:
    def build() -> tuple[Callable[..., Any], dict[str, Any]]:
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        chosen = getattr(SDPBackend, backend)

        def sdpa(q: Any, k: Any, v: Any, **kw: Any) -> Any:
            with sdpa_kernel([chosen]):
                return F.scaled_dot_product_attention(q, k, v, **kw)

        sdpa.__qualname__ = f"sdpa_{backend.lower()}"
        dtypes = ("float32", "float64", "bfloat16")
        return sdpa, {"signature": "torch", "dtypes": dtypes}

    return build


def _torch_mha() -> tuple[Callable[..., Any], dict[str, Any]]:
    import torch

    @functools.cache
    def module(n: int, h: int) -> Any:
        m = torch.nn.MultiheadAttention(n * h, n, bias=False, batch_first=True)
        sd = {k: torch.from_numpy(v) for k, v in to_torch_mha(_identity_params(n, h)).items()}
        m.load_state_dict(sd)
        return m

    def torch_mha(q: Any, k: Any, v: Any, attn_mask: Any = None, **kw: Any) -> Any:
        b, n, t, h = q.shape
        s = k.shape[2]
        if kw:
            raise TypeError(f"torch_mha takes no {sorted(kw)}")
        m = module(n, h).to(q.dtype)
        merged = [x.transpose(1, 2).reshape(x.shape[0], x.shape[2], -1) for x in (q, k, v)]
        if attn_mask is not None:
            # nn.MultiheadAttention's boolean attn_mask is True where a key is NOT allowed (the
            # opposite of SDPA's), [B N, T, S]
            attn_mask = ~attn_mask.expand(b, n, t, s).reshape(b * n, t, s)
        out, _ = m(*merged, attn_mask=attn_mask, need_weights=False)
        return out.reshape(b, t, n, h).transpose(1, 2)

    return torch_mha, {"signature": "torch", "features": ("mask", "cross", "grad")}


def _hf_bert() -> tuple[Callable[..., Any], dict[str, Any]]:
    import torch
    from transformers import BertConfig
    from transformers.models.bert.modeling_bert import BertSelfAttention

    @functools.cache
    def module(n: int, h: int) -> Any:
        # One input x = [q | k | v] (d_model = 3 N H): W_Q, W_K and W_V select its thirds, so a
        # self-attention module sees the kit's three independent arrays; exact, as the identity.
        d = n * h
        config = BertConfig(hidden_size=d, num_attention_heads=n, attention_probs_dropout_prob=0.0)
        config._attn_implementation = "eager"  # BERT's own softmax(q k^T / sqrt(H) + mask) v
        m = BertSelfAttention(config).eval()
        eye = np.eye(3 * d, dtype=np.float32).reshape(3 * d, 3, n, h).transpose(1, 2, 0, 3)
        sel = attnref.AttentionParams(eye[0], eye[1], eye[2], np.zeros((n, h, 3 * d), np.float32))
        sd = to_hf_bert(sel)  # [N H, 3 N H] each, nn.Linear's (out, in)
        for name in ("query", "key", "value"):
            lin = getattr(m, name)
            lin.in_features = 3 * d
            lin.weight = torch.nn.Parameter(torch.from_numpy(sd[f"self.{name}.weight"]))
            lin.bias.data.zero_()
        return m

    def bert_self_attention(q: Any, k: Any, v: Any, attn_mask: Any = None, **kw: Any) -> Any:
        b, n, t, h = q.shape
        if kw or k.shape[2] != t or (attn_mask is not None and attn_mask.dtype == torch.bool):
            raise TypeError("BertSelfAttention: self-attention, an additive mask only")
        x = torch.cat([a.transpose(1, 2).reshape(b, t, n * h) for a in (q, k, v)], dim=-1)
        out = module(n, h).to(q.dtype)(x, attention_mask=attn_mask)[0]  # [B, T, N H]
        return out.reshape(b, t, n, h).transpose(1, 2)

    return bert_self_attention, {"signature": "torch", "features": ("bias", "grad")}


ROWS = (
    Row("jax.nn (xla)", "jax.nn.dot_product_attention(..., implementation='xla')", _jax_nn,
        "its default features (every jax.nn option); a fully masked row is the mean of v "
        "(masked_rows='uniform'; with the default 'zeros' its fully_masked_rows property "
        "fails, tests/test_conformance.py)", "float32 here; in float64 it fails (finding 1)."),
    Row("Pallas mha, forward", "jax.experimental.pallas.ops.gpu.attention.mha(interpret=True)",
        _pallas(False), "causal only (no mask, bias or GQA arguments), T = S (finding 2); "
        "refuses lengths its block (min(128, T)) does not divide (refuses_lengths)",
        "Each refusal is a declared limit, counted below, not a failure."),
    Row("Pallas mha, with gradients", "the same, gradients through its Pallas backward pass",
        _pallas(True), "causal, grad; refuses_lengths; the gradients property alone",
        "The gradients are NaN at lengths the backward pass's blocks of 32 do not divide, "
        "which its forward pass accepts (finding 3): a silent wrong answer, not a refusal."),
    Row("Flax nnx.MultiHeadAttention", "flax.nnx.MultiHeadAttention, identity projections",
        _flax_nnx, "mask, cross, grad (the module's mask argument); masked_rows='uniform'"),
    Row("Flax linen attention", "flax.linen.MultiHeadDotProductAttention, identity projections",
        _flax_linen, "mask, cross, grad; masked_rows='uniform'"),
    Row("Equinox MultiheadAttention", "equinox.nn.MultiheadAttention, identity projections",
        _equinox, "mask, cross, grad; masked_rows='uniform'"),
    Row("torch SDPA (math)", "torch.nn.functional.scaled_dot_product_attention, MATH backend",
        _torch_sdpa("MATH"), "the torch signature's defaults: mask, bias, causal, gqa, cross, "
        "grad; a fully masked row is zeros (the kit's default)"),
    Row("torch SDPA (CPU flash)", "the same, FLASH_ATTENTION backend (CPU)",
        _torch_sdpa("FLASH_ATTENTION"), "as the math backend"),
    Row("torch.nn.MultiheadAttention", "torch.nn.MultiheadAttention(batch_first=True), "
        "identity projections", _torch_mha, "mask, cross, grad (its attn_mask; True = masked "
        "out, inverted by the wrapper, finding 4); a fully masked row is zeros"),
    Row("HF BertSelfAttention", "transformers' BertSelfAttention (eager), selecting projections",
        _hf_bert, "bias, grad: self-attention (T = S), its additive attention_mask; the "
        "input is [q / k / v] and W_Q, W_K, W_V select its thirds"),
)  # fmt: skip


@dataclasses.dataclass
class Outcome:
    row: Row
    verdict: str  # "PASS", "FAIL" or "not run: <why>"
    passed: tuple[str, ...] = ()
    failed: tuple[tuple[str, str], ...] = ()  # (property, first line of its detail)
    notes: tuple[tuple[str, str], ...] = ()  # (property, detail of a passing one)
    seconds: float = 0.0
    options: str = ""


def run_row(row: Row, examples: int) -> Outcome:
    try:
        fn, kw = row.build()
    except ModuleNotFoundError as exc:
        return Outcome(row, f"not run: {exc.name} is not installed")
    start = time.perf_counter()
    report = check_attention(fn, max_examples=examples, seed=0, target=row.name, **kw)
    took = time.perf_counter() - start
    passed = tuple(r.name for r in report.results if r.status == "passed")
    failed = tuple(
        (r.name, (r.detail.splitlines() or [""])[0][:240])
        for r in report.results
        if r.status == "failed"
    )
    notes = tuple(
        (r.name, r.detail[:240]) for r in report.results if r.status == "passed" and r.detail
    )
    shown = ", ".join(f"{k}={v!r}" for k, v in kw.items())
    return Outcome(row, "PASS" if report.passed else "FAIL", passed, failed, notes, took, shown)


# --- findings ----------------------------------------------------------------------------------


def _finding_jax_nn_float64() -> str:
    """jax.nn's float64 inputs: the error against the float64 oracle."""
    from attnref import oracle

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 16, 4, 32)) for _ in range(3))
    with jax.enable_x64(True):  # float64 arrays stay float64
        out = np.asarray(jax.nn.dot_product_attention(q, k, v, implementation="xla"))
    ref = oracle.dot_product_attention(q, k, v)
    err = float(np.max(np.abs(out - ref)))
    return (
        f"**jax.nn (xla), float64 inputs: float32-level error.** The output is float64 but its "
        f"error against the float64 oracle is {err:.1e} (a float64 kernel's is about 1e-16): "
        "the logits are float64, but `_dot_product_attention_core` (`jax/_src/nn/functions.py`) "
        'casts them to float32 for the softmax (its comment: "Softmax and it is always carried '
        "out in fp32\"). `check_attention(..., dtypes=('float64',))` fails its `oracle` "
        "property by about 1e7 times the float64 allowance.\n\n```python\n"
        "import jax, numpy as np\nfrom attnref import oracle\n"
        "jax.config.update('jax_enable_x64', True)\nrng = np.random.default_rng(0)\n"
        "q, k, v = (rng.standard_normal((2, 16, 4, 32)) for _ in range(3))\n"
        "out = np.asarray(jax.nn.dot_product_attention(q, k, v, implementation='xla'))\n"
        "err = np.abs(out - oracle.dot_product_attention(q, k, v)).max()\n"
        f"print(out.dtype, err)  # float64 {err:.1e}\n"
        "```"
    )


def _finding_pallas_causal_tall() -> str:
    from jax.experimental.pallas.ops.gpu.attention import mha

    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((1, 5, 1, 4)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((1, 3, 1, 4)), jnp.float32)
    out = np.asarray(mha(q, k, k, None, sm_scale=0.5, causal=True, interpret=True))
    nan = int(np.isnan(out).sum())
    return (
        "**Pallas mha, causal with more queries than keys (T > S): NaN.** With T = 5, S = 3 "
        f"every output is NaN ({nan} of {out.size}), although under its top-left causal mask "
        "every query row keeps key 0 (jax.nn gives finite values). Pallas' tests use T = S; "
        "the rows above declare no `cross` for it. Its causal loop runs to key block "
        "`ceil(block_q (i + 1) / block_k)`, past the last one when T > S, so it reads K and V "
        "beyond S. Compiled on an H200 (docs/benchmarks.md) the same reads give wrong outputs: "
        "with T = 32, S = 16 the rows from S on are off by up to 12 in float32, and in float16 "
        "the output is infinite."
        "\n\n```python\n"
        "import jax.numpy as jnp, numpy as np\n"
        "from jax.experimental.pallas.ops.gpu.attention import mha\n"
        "rng = np.random.default_rng(0)\n"
        "q = jnp.asarray(rng.standard_normal((1, 5, 1, 4)), jnp.float32)\n"
        "k = jnp.asarray(rng.standard_normal((1, 3, 1, 4)), jnp.float32)\n"
        f"print(mha(q, k, k, None, sm_scale=0.5, causal=True, interpret=True))  # {nan} NaN\n"
        "```"
    )


def _finding_pallas_grad() -> str:
    from jax.experimental.pallas.ops.gpu.attention import mha

    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((1, 33, 1, 4)), jnp.float32)
    g = np.asarray(jax.grad(lambda q: mha(q, q, q, None, sm_scale=0.5, interpret=True).sum())(q))
    nan = int(np.isnan(g).sum())
    return (
        "**Pallas mha's backward pass, T = 33: NaN, not a refusal.** The forward pass refuses "
        "a length its block does not divide (`q_seq_len=129 must be a multiple of "
        "block_q=128`), but takes T = 33 (its block is min(128, T) = 33); the backward pass's "
        "blocks (`block_q_dq = block_kv_dq = 32`) do not divide 33 and it returns NaN "
        f"gradients ({nan} of {g.size} entries of dq here) instead of refusing. Seen with "
        "`interpret=True` on the CPU; on a GPU the out-of-bounds reads may differ.\n\n"
        "```python\nimport jax, jax.numpy as jnp, numpy as np\n"
        "from jax.experimental.pallas.ops.gpu.attention import mha\n"
        "q = jnp.asarray(np.random.default_rng(0).standard_normal((1, 33, 1, 4)), jnp.float32)\n"
        "g = jax.grad(lambda q: mha(q, q, q, None, sm_scale=0.5, interpret=True).sum())(q)\n"
        f"print(int(jnp.isnan(g).sum()))  # {nan}\n```"
    )


def _finding_pallas_x64() -> str:
    from jax.experimental.pallas.ops.gpu.attention import mha

    q = jnp.ones((1, 4, 1, 4), jnp.float32)
    try:
        with jax.enable_x64(True):
            mha(q, q, q, None, sm_scale=0.5, causal=True, interpret=True)
        seen = "no error (fixed in this JAX)"
    except TypeError as exc:
        seen = f"`TypeError: {str(exc).splitlines()[0].split(' (Tip')[0]}`"
    return (
        "**Pallas mha, `causal=True` under `jax_enable_x64`: it does not trace.** With 64-bit "
        "mode on (as in attnref's test suite), its causal loop bound mixes int32 and int64: "
        f"{seen}. float32 inputs, so the flag alone decides; the rows above run with it off "
        "(`tests/test_clients.py`, where the suite turns it on, reruns Flax's rows only).\n\n"
        "```python\nimport jax, jax.numpy as jnp\n"
        "from jax.experimental.pallas.ops.gpu.attention import mha\n"
        "jax.config.update('jax_enable_x64', True)\nq = jnp.ones((1, 4, 1, 4), jnp.float32)\n"
        "mha(q, q, q, None, sm_scale=0.5, causal=True, interpret=True)  # TypeError\n```"
    )


def _finding_torch_mha_mask() -> str:
    import torch

    m = torch.nn.MultiheadAttention(4, 1, bias=False, batch_first=True)
    x = torch.randn(1, 2, 4)
    keep = torch.tensor([[True, False], [True, True]])  # SDPA's meaning: True = may attend
    a = m(x, x, x, attn_mask=keep, need_weights=True)[1]
    return (
        "**torch.nn.MultiheadAttention reads a boolean `attn_mask` the other way round from "
        "SDPA:** `True` means *not* allowed. Passing SDPA's mask `[[True, False], [True, "
        f"True]]` gives the weights {np.round(a[0].detach().numpy(), 3).tolist()} (row 0 "
        "attends only to the key SDPA's mask removes; row 1, all `True`, has NaN weights, while "
        "the output of its `need_weights=False` path is zeros there). The row "
        "above inverts the mask in its wrapper; without the inversion the kit's `masks` "
        "property fails.\n\n<!-- docs-test: torch -->\n```python\nimport torch\n"
        "m = torch.nn.MultiheadAttention(4, 1, bias=False, batch_first=True)\n"
        "x = torch.randn(1, 2, 4)\n"
        "print(m(x, x, x, attn_mask=torch.tensor([[True, False], [True, True]]))[1])\n```"
    )


FINDINGS: tuple[tuple[str, str, Callable[[], str]], ...] = (
    ("jax.nn float64", "jax", _finding_jax_nn_float64),
    ("Pallas causal T > S", "jax", _finding_pallas_causal_tall),
    ("Pallas backward", "jax", _finding_pallas_grad),
    ("Pallas x64", "jax", _finding_pallas_x64),
    ("torch MHA mask", "torch", _finding_torch_mha_mask),
)

# Recorded on a lent GPU (docs/benchmarks.md's GPU section), not rerun by this script.
GPU_FINDING = (
    "**jax.nn (xla) on a GPU computes float32 in TF32 by default** (recorded on an NVIDIA H100 "
    "80GB HBM3, JAX 0.11.2, CUDA 13, by `scripts/gpu_check.py`; [benchmarks](benchmarks.md)'s "
    "GPU section). At its default matmul precision the kit fails 8 of its 9 properties by "
    "27-53x the float32 allowance (`kit: jax.nn (xla): 1 passed, 8 failed, 0 skipped`); under "
    '`jax.default_matmul_precision("highest")` the same kernel passes all 9. A float32 user of '
    "jax.nn on such a card gets TF32 accuracy (about 1e-3 relative) unless they ask for more."
)


def _list(names: tuple[str, ...]) -> str:
    return ", ".join(names) if names else "none"


def render(outcomes: list[Outcome], findings: list[str], examples: int, took: float) -> str:
    torch_v = _version("torch")
    lines = [
        "# The kit on real clients",
        "",
        "Generated by `python scripts/clients.py` (`nox -s clients`). Each row runs "
        "`attnref.testing.check_attention` on a kernel people use, with the features and the "
        "meaning of a fully masked row that the kernel declares, "
        f"{examples} examples per property, seed 0. Machine: {platform.machine()} CPU, "
        f"Python {platform.python_version()}, JAX {jax.__version__}"
        + (f", PyTorch {torch_v}" if torch_v else "")
        + (f", Flax {_version('flax')}" if _version("flax") else "")
        + (f", Equinox {_version('equinox')}" if _version("equinox") else "")
        + f"; the whole run took {took:.0f} s.",
        "",
        "The modules with projections run with identity projections set through "
        "`attnref.interop` (`to_flax`, `to_torch_mha`, `to_hf_bert`), so they compute exactly "
        "the attention of the kit's `q, k, v` (a product with the identity is exact). See "
        "[testing your kernel](testing_your_kernel.md) and [torch kernels](torch_kernels.md) "
        "for the kit itself.",
        "",
        "| kernel | declares | verdict | properties passed | failed | time |",
        "|---|---|---|---|---|---|",
    ]
    for o in outcomes:
        failed = _list(tuple(name for name, _ in o.failed))
        verdict = o.verdict if not o.verdict.startswith("not run") else f"*{o.verdict}*"
        t = f"{o.seconds:.1f} s" if o.seconds else ""
        lines.append(
            f"| {o.row.name} (`{o.row.kernel}`) | {o.row.declares} | {verdict} | "
            f"{_list(o.passed)} | {failed} | {t} |"
        )
    lines += ["", "## Why each verdict", ""]
    for o in outcomes:
        lines.append(f"* **{o.row.name}**: {_explain(o)}")
    lines += ["", "## Findings", ""]
    lines += [f"{i}. {text}\n" for i, text in enumerate(findings, start=1)]
    lines += [f"{len(findings) + 1}. {GPU_FINDING}", ""]
    return "\n".join(lines)


def _explain(o: Outcome) -> str:
    if o.verdict.startswith("not run"):
        return f"{o.verdict}; install it to run the row."
    text = f"`check_attention(fn, {o.options})`." if o.options else "`check_attention(fn)`."
    text += f" {o.row.why}" if o.row.why else ""
    if not o.failed:
        text += f" Every property it can run passed ({len(o.passed)})."
    for name, detail in o.failed:
        text += f" `{name}` failed: {detail.replace('|', '/')}."
    for name, detail in o.notes:
        text += f" `{name}`: {detail.replace('|', '/')}."
    return text


def _version(package: str) -> str | None:
    if importlib.util.find_spec(package) is None:
        return None
    from importlib.metadata import version

    return version(package)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=4, help="examples per property")
    parser.add_argument("--out", default=str(ROOT / "docs" / "clients.md"), help="Markdown out")
    parser.add_argument(
        "--row", action="append", default=[], help="a row's name, repeatable (default: all)"
    )
    parser.add_argument("--no-findings", action="store_true", help="leave the findings out")
    args = parser.parse_args(argv)
    chosen = args.row
    unknown = [c for c in chosen if c not in {r.name for r in ROWS}]
    if unknown:
        parser.error(f"unknown rows {unknown}; choose from {[r.name for r in ROWS]}")
    start = time.perf_counter()
    outcomes = []
    for row in ROWS:
        if chosen and row.name not in chosen:
            continue
        o = run_row(row, args.examples)
        outcomes.append(o)
        print(f"client: {row.name}: {o.verdict} ({o.seconds:.1f} s)", flush=True)
    findings = []
    for name, package, finding in () if args.no_findings else FINDINGS:
        if importlib.util.find_spec(package) is None:
            findings.append(f"*{name}: not run, {package} is not installed.*")
            continue
        findings.append(finding())
        print(f"finding: {name}", flush=True)
    text = render(outcomes, findings, args.examples, time.perf_counter() - start)
    Path(args.out).write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
