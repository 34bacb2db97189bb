"""Render the per-formulation Markdown pages of ``docs/formulations/`` from the registry, and
``docs/distributed.md`` (:func:`render_distributed`) from the distributed family's entries and
their cost models.

The export rule (checked by ``tests/test_docs_pages.py``): every registered formulation's
``native`` and ``apply`` are exported under their ``__name__``, from ``attnref`` or from one of
its namespaces (:data:`NAMESPACES`), and its page shows that qualified name
(:func:`public_name`); every exported function taking the registry's row signature
``(params, x_q, x_kv, ...)`` is a registered ``native``/``apply`` or is listed in
:data:`HELPERS` with the reason it is not a registry entry, and the page of the formulation it
belongs to shows it.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from attnref._src.citations import formulation_bibtex
from attnref._src.family import public_path
from attnref._src.kernel_forms import decode_attention
from attnref._src.probes import attention_logits, attention_probes, residual_update
from attnref._src.registry import Formulation, formulations
from attnref._src.standard import attention_weights, head_outputs

# Where a page may find a function, after the top level: the namespaces that export
# formulations and their helpers (the others hold the NumPy oracle and bounds, the models and
# the testing kits).
NAMESPACES = ("linear", "rope", "decode", "interp", "interop", "costs", "distributed")


class Helper(NamedTuple):
    """An exported function with the registry's row signature that is not a registry entry.

    Attributes:
        fn: The function.
        formulation: The id of the registry entry whose page lists it.
        reason: Why it is not an entry (Markdown, shown on that page).
    """

    fn: Callable[..., Any]
    formulation: str
    reason: str


_PROBE = "A probe of the block (see [probes](../probes.md)), not the block output: "

HELPERS: tuple[Helper, ...] = (
    Helper(
        decode_attention,
        "kv_cache",
        "The `kv_cache` computation fed one token per `lax.scan` step (`attnref.decode.scan`: "
        "token `t` appends its key and value, then its query attends to the cache). It is always "
        "causal and needs `T_q == T_k`, so it cannot take the softmax family's arbitrary masks "
        "and cross-attention; `tests/test_registry.py` checks it against the oracle with a "
        "causal mask.",
    ),
    Helper(
        attention_weights,
        "per_head_sum",
        _PROBE + "the weights `A_i` of every query head. `tests/test_registry.py` checks that it "
        "equals the `scores` field of `attnref.interp.attention_probes` bit for bit, which "
        "`tests/test_probes.py` checks against the oracle.",
    ),
    Helper(
        head_outputs,
        "per_head_sum",
        _PROBE + "the per-head terms `o_i = head_i W_O[i]` (no `b_O`). `tests/test_registry.py` "
        "checks `sum_i o_i + b_O` against the oracle's output with the derived bound.",
    ),
    Helper(
        attention_logits,
        "scores_messages",
        _PROBE + "the masked pre-softmax logits. `tests/test_probes.py` checks that it equals "
        "the `logits` field of `attnref.interp.attention_probes` bit for bit and those against a "
        "derived bound.",
    ),
    Helper(
        attention_probes,
        "scores_messages",
        _PROBE + "every intermediate at once, as a pytree; `tests/test_probes.py` checks each "
        "field against the oracle.",
    ),
    Helper(
        residual_update,
        "scores_messages",
        "The residual form `x_q + y` computed from `attnref.interp.attention_probes` (scores times "
        "messages): the same function as every formulation's `apply` with `residual=True`, "
        "which the registry tests; `tests/test_probes.py` checks the two agree.",
    ),
)

_CONVENTION_NOTE = {
    "row": "Row vectors: tokens are rows, `x_q [..., T_q, d_model]`, output `[..., T_q, d_model]`.",
    "column": "Column vectors: tokens are columns, `X [..., d_model, T]`, output "
    "`[..., d_model, T_q]`; masks are `[..., T_k, T_q]` and the attention matrix is "
    "column-stochastic. `apply` is the row-convention adapter (transposes in and out).",
    "single-query": "One query row `x_q [d_model]` against `X_kv [T_k, d_model]`; `apply` vmaps "
    "it over queries and batch dims.",
    "graph": "Nodes and an edge list `(senders, receivers)`; the row-convention `apply` uses the "
    "complete bipartite graph with the mask as adjacency (static shapes, jit-able).",
    "kernel": "Kernel level, the layout of `jax.nn.dot_product_attention`: `q [..., T_q, N, d_k]`, "
    "`k [..., T_k, K, d_k]`, `v [..., T_k, K, d_v]` -> `[..., T_q, N, d_v]` (heads on the "
    "second-to-last axis; `K` K/V heads shared by groups of `N / K` query heads); `apply` is the "
    "multi-head form on rows `x_q [..., T_q, d_model]`. Linear family masks: `causal` (needs "
    "`T_q == T_k`) and `key_mask [..., T_k]`; softmax family: every option of "
    "`attnref.dot_product_attention` (see [the kernel level](../kernel.md)).",
}


def public_name(fn: Callable[..., Any]) -> str:
    """The name a page shows for ``fn``: ``attnref.<name>`` if the top level exports it, else
    ``attnref.<namespace>.<name>`` for the first of :data:`NAMESPACES` that does.

    Args:
        fn: A registered ``native``/``apply`` or a helper.

    Returns:
        The qualified public name (``tests/test_docs_pages.py`` checks it resolves to ``fn``).

    Raises:
        LookupError: ``fn`` is exported nowhere under its ``__name__`` (the export rule).
    """
    import attnref

    name = fn.__name__
    if name in attnref.__all__ and getattr(attnref, name) is fn:
        return f"attnref.{name}"
    for namespace in NAMESPACES:
        module = importlib.import_module(f"attnref.{namespace}")
        if name in getattr(module, "__all__", ()) and getattr(module, name) is fn:
            return f"attnref.{namespace}.{name}"
    raise LookupError(
        f"{fn.__module__}.{name} is exported neither from attnref nor from attnref.<namespace> "
        f"for a namespace in {NAMESPACES}"
    )


def _code_block(fn: Callable[..., Any]) -> str:
    """``fn``'s public name and its ``inspect.signature``, verbatim, as a Python code block."""
    return f"```python\n{public_name(fn)}{inspect.signature(fn)}\n```"


def _code(f: Formulation) -> str:
    family = f"registry `apply` ({f.family.name} family)"
    if f.native is f.apply:
        text = f"**Code.** Native form and {family}:\n\n{_code_block(f.native)}"
    else:
        text = (
            f"**Code.** Native form:\n\n{_code_block(f.native)}\n\n"
            f"{family[0].upper()}{family[1:]}:\n\n{_code_block(f.apply)}"
        )
    helpers = [h for h in HELPERS if h.formulation == f.id]
    if helpers:
        text += "\n\n**Helpers** (exported multi-head functions that are not registry entries):"
        for h in helpers:
            text += f"\n\n{_code_block(h.fn)}\n\n{h.reason}"
    return text


def _family(f: Formulation) -> str:
    fam = f.family
    return (
        f"**Family.** {fam.name}: every `apply` of the family takes `{fam.signature}` and is "
        f"checked against `{public_path(fam.oracle)}` within the derived bound "
        f"`{public_path(fam.bound)}`."
    )


def _cite(f: Formulation) -> str:
    """The "Cite" block: BibTeX for the formulation's sources and for attnref."""
    return (
        f"**Cite.** BibTeX for the sources above and for attnref (`attnref cite {f.id} "
        f"--bibtex` prints it):\n\n```bibtex\n{formulation_bibtex(f.id)}```"
    )


def render(f: Formulation) -> str:
    """The Markdown page of one formulation.

    Args:
        f: A registry entry.

    Returns:
        The page's Markdown text.
    """
    doc = inspect.getdoc(f.native) or ""
    module = inspect.getmodule(f.native)
    details = (inspect.getdoc(module) or "") if module is not None else ""
    return (
        f"# {f.title}\n\n"
        f"Registry id: `{f.id}` · convention: {f.convention}\n\n"
        f"$$\n{f.equation}\n$$\n\n"
        f"{f.summary}\n\n"
        f"**Cost.** {f.cost}\n\n"
        f"**Convention.** {_CONVENTION_NOTE[f.convention]} {f.family.note}\n\n"
        f"{_family(f)}\n\n"
        f"{_code(f)}\n\n"
        f"{doc}\n\n"
        f"**Details** (from `{f.native.__module__}`).\n\n{details}\n\n"
        f"**Citation.** {f.citation}\n\n"
        f"{_cite(f)}\n\n"
        "*This page is generated from the registry by `python -m attnref.pages`; "
        "`tests/test_docs_pages.py` checks it is current and that every name and signature on it "
        "is the code's.*\n"
    )


def write(directory: Path) -> list[Path]:
    """Write one page per registered formulation into ``directory``; returns the paths."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for f in formulations():
        path = directory / f"{f.id}.md"
        path.write_text(render(f))
        paths.append(path)
    return paths


# ----------------------------------------------------------------------------- docs/distributed.md

BENCH_SECTION = "bench_distributed"  # the marked section benchmarks/bench_distributed.py writes
# The reference problem of the page's communication table (per device, float32).
REFERENCE = {"batch": 1, "t": 4096, "heads": 8, "d_model": 512, "d_k": 64, "devices": 8}


# The page's order of the schemes (any other entry of the family follows, in registry order).
SCHEME_ORDER = ("ring", "striped", "zigzag", "all_gather", "ulysses", "tensor_parallel")


def _distributed() -> list[Formulation]:
    """The distributed family's entries in :data:`SCHEME_ORDER`."""
    entries = list(formulations("distributed"))
    rank = {fid: i for i, fid in enumerate(SCHEME_ORDER)}
    return sorted(entries, key=lambda f: rank.get(f.id, len(rank)))


def _positions_table(n: int, devices: int) -> str:
    """Which positions each device holds in each layout for ``n`` tokens (padding in italics)."""
    from attnref._src.distributed import _layout

    lines = ["| device | " + " | ".join(_layout.LAYOUTS) + " |", "|---" * 4 + "|"]
    tables = {
        layout: _layout.positions(_layout.padded_length(n, devices, layout), devices, layout)
        for layout in _layout.LAYOUTS
    }
    for d in range(devices):
        cells = [
            " ".join(str(i) if i < n else f"*{i}*" for i in tables[layout][d])
            for layout in _layout.LAYOUTS
        ]
        lines.append(f"| {d} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _communication_table() -> str:
    """Per-device work and communication of each scheme on :data:`REFERENCE` (its cost model)."""
    from attnref._src.cost import Dims

    r = REFERENCE
    dims = Dims(
        r["batch"],
        r["t"],
        r["t"],
        r["heads"],
        r["d_model"],
        r["d_k"],
        r["d_k"],
        devices=r["devices"],
    )
    lines = [
        "| scheme | collective | calls | operand per call (MiB) | sent per device (MiB) "
        "| matmul per device (GFLOP) | largest intermediate (MiB) |",
        "|---|---|---|---|---|---|---|",
    ]
    mib = 2.0**20
    for f in _distributed():
        c = f.cost_model(dims)  # type: ignore[misc]
        for kind in dict.fromkeys(k.kind for k in c.collectives):
            ks = [k for k in c.collectives if k.kind == kind]
            sizes = sorted({k.operand_bytes / mib for k in ks})
            lines.append(
                f"| {f.id} | {kind} | {sum(k.calls for k in ks)} | "
                + ", ".join(f"{v:.3f}" for v in sizes)
                + f" | {sum(k.sent_bytes for k in ks) / mib:.3f} | {c.matmul_flops / 1e9:.2f} | "
                f"{c.intermediate_bytes / mib:.1f} |"
            )
    return "\n".join(lines)


def _balance_table() -> str:
    """``max / mean`` useful causal pairs per device for each layout (exact fractions)."""
    from attnref._src.distributed import _layout
    from attnref._src.distributed.cost import load_balance

    lines = [
        "| P | T | " + " | ".join(_layout.LAYOUTS) + " |",
        "|---|---|" + "---|" * len(_layout.LAYOUTS),
    ]
    for p in (2, 4, 8):
        for t in (1000, 1024, 4096):
            cells = [f"{float(load_balance(t, p, layout)):.4f}" for layout in _layout.LAYOUTS]
            lines.append(f"| {p} | {t} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _distributed_name(fn: Callable[..., Any]) -> str:
    """``attnref.distributed.<name>`` where that namespace exports ``fn``, else
    :func:`public_name` (the namespace joins :data:`NAMESPACES` with the family's registration)."""
    import attnref.distributed

    name = fn.__name__
    if name in attnref.distributed.__all__ and getattr(attnref.distributed, name) is fn:
        return f"attnref.distributed.{name}"
    return public_name(fn)


def _scheme(f: Formulation) -> str:
    model = f.cost_model
    comm = (inspect.getdoc(model) or "") if model is not None else ""
    return (
        f"### {f.title} (`{f.id}`)\n\n"
        f"$$\n{f.equation}\n$$\n\n"
        f"{f.summary}\n\n"
        f"**Kernel.** `{_distributed_name(f.native)}`; row form `{_distributed_name(f.apply)}` "
        f"([page](formulations/{f.id}.md)).\n\n"
        f"**Cost.** {f.cost}\n\n"
        f"**Per-device model** (`{model.__module__}.{model.__name__}`). {comm}\n\n"
        f"**Citation.** {f.citation}"
    )


def _bench_section(existing: str) -> str:
    """The marked benchmark section of ``existing`` (the page as it is), or a placeholder."""
    start, end = f"<!-- {BENCH_SECTION}:start -->", f"<!-- {BENCH_SECTION}:end -->"
    if start in existing and end in existing:
        body = existing.split(start, 1)[1].split(end, 1)[0].strip("\n")
    else:
        body = (
            "## Benchmark\n\nNot run yet: `python benchmarks/bench_distributed.py --out "
            "docs/distributed.md` writes this section and `docs/img/distributed.png`."
        )
    return f"{start}\n{body}\n{end}"


def render_distributed(existing: str = "") -> str:
    """``docs/distributed.md``: the layouts, every entry of the distributed family (equation,
    citation, cost, per-device communication model), the communication and load balance tables,
    and the benchmark section kept from ``existing``.

    Args:
        existing: The page as it is now ('' for none): its benchmark section (written by
            ``benchmarks/bench_distributed.py``) is kept verbatim.

    Returns:
        The page's Markdown text.
    """
    import attnref.distributed  # noqa: F401  (registers the schemes)
    from attnref._src.distributed import cost as dcost

    schemes = "\n\n".join(_scheme(f) for f in _distributed())
    r = REFERENCE
    return (
        "# Distributed attention: the same function, computed on a mesh\n\n"
        "The distributed family (`attnref.distributed`) computes the softmax family's function "
        "in pieces on the devices of a `jax.sharding.Mesh` (`shard_map` with `ppermute`, "
        "`all_gather`, `all_to_all`, `psum`). Each scheme is a registry entry whose kernel level "
        "takes the layout and options of `attnref.dot_product_attention` plus `mesh` and "
        "`axis_name` (global arrays in, global arrays out) and whose row form is checked against "
        "the float64 oracle like every other entry. On one host, "
        "`XLA_FLAGS=--xla_force_host_platform_device_count=8` (set before JAX starts) gives 8 "
        "virtual CPU devices.\n\n"
        "## Token layouts\n\n"
        "Sequence-parallel schemes give device `d` the queries (and K/V chunk) at the global "
        "positions `positions(T', P, layout)[d]` (`attnref._src.distributed._layout`): "
        "**contiguous** (ring, Ulysses) `d c .. d c + c - 1` with `c = T' / P`; **striped** "
        "`d, d + P, d + 2P, ...`; **zigzag** (zigzag ring, all-gather) the sequence in `2P` "
        "chunks, device `d` holding chunks `d` and `2P - 1 - d`. `T = 16` tokens on `P = 4` "
        "devices:"
        f"\n\n{_positions_table(16, 4)}\n\n"
        "**Padding.** A length that `P` (`2P` for zigzag) does not divide is padded inside to "
        "`T'`, the next multiple: padded keys are never attended (the allowed rule tests "
        "`j < S`), padded queries are dropped, so every `T, S >= 0` gives the exact answer. "
        "`T = 10` on `P = 4` (padding in italics; contiguous and striped pad to 12, zigzag to "
        f"16):\n\n{_positions_table(10, 4)}\n\n"
        f"## Schemes\n\n{schemes}\n\n"
        "## Communication and work per device\n\n"
        "Every cost model (`attnref.costs.cost` on `Dims(..., devices=P)`) counts per device, as "
        "XLA's `cost_analysis()` of the SPMD program does, and lists the scheme's collectives "
        "(`attnref._src.cost.Collective`: kind, operand bytes per call, calls). What a device "
        "sends per call follows the bandwidth-optimal algorithms: a permute sends its operand, a "
        "ring all-gather its shard `P - 1` times, an all-to-all `(P - 1)/P` of its operand, a ring "
        "all-reduce `2 (P - 1)/P`. `tests/test_distributed_cost.py` checks the matmul FLOPs, "
        "transcendentals and per-call collective bytes against the compiled HLO "
        "(`attnref._src.cost.hlo_collectives`, `while` trip counts included) exactly, at "
        f"`P` = 1, 2 and 4. On B = {r['batch']}, T = S = {r['t']}, H = {r['heads']} heads, "
        f"d_model = {r['d_model']}, d_k = d_v = {r['d_k']}, float32, P = {r['devices']}:"
        f"\n\n{_communication_table()}\n\n"
        "Tensor parallelism's matmul includes the projections of its `H/P` heads; the "
        "sequence-parallel rows include the row form's projections on all tokens (striped, "
        "zigzag, all-gather: XLA's partitioner does not shard through the layout's gather) or "
        "on the device's own (ring, Ulysses). Around the `shard_map`, the partitioner may add "
        "collectives of its own to reshard the global arrays; the benchmark below measures them "
        "separately.\n\n"
        "## Causal load balance\n\n"
        f"{dcost.CLOSED_FORMS}\n\n"
        "`balance = max_d / mean_d` of the allowed (query, key) pairs per device under causal "
        "self-attention (`attnref._src.distributed.cost.load_balance`; `tests/"
        "test_distributed_cost.py` checks it against a brute-force count and the closed forms):"
        f"\n\n{_balance_table()}\n\n"
        "All-gather context parallelism uses the zigzag layout (its balance is zigzag's); "
        "Ulysses and tensor parallelism split heads, so every device does the same causal work. "
        "The ring skips a step whose chunk no local query may read, so on the contiguous layout "
        "device `d` computes `d + 1` of its `P` pieces under a causal mask.\n\n"
        f"{_bench_section(existing)}\n\n"
        "*Generated from the registry and the cost models by `python -m attnref.pages` (the "
        "benchmark section by `benchmarks/bench_distributed.py`); "
        "`tests/test_distributed_cost.py` checks it is current.*\n"
    )


def write_distributed(path: Path) -> Path:
    """Regenerate ``path`` (``docs/distributed.md``), keeping its benchmark section."""
    existing = path.read_text() if path.exists() else ""
    path.write_text(render_distributed(existing))
    return path


if __name__ == "__main__":
    import attnref  # noqa: F401  (registers the formulations)

    docs = Path(__file__).resolve().parents[1] / "docs"
    for p in write(docs / "formulations"):
        print(p)
    print(write_distributed(docs / "distributed.md"))
