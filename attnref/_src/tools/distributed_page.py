"""``docs/distributed.md`` (:func:`render_distributed`): the token layouts, every entry of the
distributed family with its cost model, the communication and causal load balance tables, and
the benchmark section that ``benchmarks/bench_distributed.py`` writes."""

from __future__ import annotations

import inspect
from pathlib import Path

from attnref._src.core.cost import Dims
from attnref._src.core.registry import Formulation, formulations
from attnref._src.formulations.distributed.cost import (
    CLOSED_FORMS,
    load_balance,
    piece_tiles,
    ring_tiles_computed,
)
from attnref._src.formulations.distributed.layout import LAYOUTS, padded_length, positions
from attnref._src.tools.pages import public_name

BENCH_SECTION = "bench_distributed"  # the marked section benchmarks/bench_distributed.py writes
# The reference problem of the page's communication table (per device, float32).
REFERENCE = Dims(batch=1, t_q=4096, t_k=4096, heads=8, d_model=512, d_k=64, d_v=64, devices=8)


# The page's order of the schemes (any other entry of the family follows, in registry order).
SCHEME_ORDER = ("ring", "striped", "zigzag", "all_gather", "ulysses", "tensor_parallel")


def _distributed() -> list[Formulation]:
    """The distributed family's entries in :data:`SCHEME_ORDER`."""
    entries = list(formulations("distributed"))
    rank = {fid: i for i, fid in enumerate(SCHEME_ORDER)}
    return sorted(entries, key=lambda f: rank.get(f.id, len(rank)))


def _table(head: list[str], rows: list[list[str]]) -> str:
    """A Markdown table: the headings, their rule, a line per row."""
    lines = ["| " + " | ".join(cells) + " |" for cells in [head, *rows]]
    return "\n".join([lines[0], "|---" * len(head) + "|", *lines[1:]])


def _positions_table(n: int, devices: int) -> str:
    """Which positions each device holds in each layout for ``n`` tokens (padding in italics)."""
    held = [positions(padded_length(n, devices, lo), devices, lo) for lo in LAYOUTS]
    rows = [
        [str(d), *(" ".join(str(i) if i < n else f"*{i}*" for i in h[d]) for h in held)]
        for d in range(devices)
    ]
    return _table(["device", *LAYOUTS], rows)


def _communication_table() -> str:
    """Per-device work and communication of each scheme on :data:`REFERENCE` (its cost model)."""
    head = "scheme, collective, calls, operand per call (MiB), sent per device (MiB)"
    head += ", matmul per device (GFLOP), largest intermediate (MiB)"
    rows = []
    mib = 2.0**20
    for f in _distributed():
        c = f.cost_model(REFERENCE)  # type: ignore[misc]
        work = [f"{c.matmul_flops / 1e9:.2f}", f"{c.intermediate_bytes / mib:.1f}"]
        for kind in dict.fromkeys(k.kind for k in c.collectives):
            ks = [k for k in c.collectives if k.kind == kind]
            sizes = ", ".join(f"{v:.3f}" for v in sorted({k.operand_bytes / mib for k in ks}))
            sent = f"{sum(k.sent_bytes for k in ks) / mib:.3f}"
            rows.append([f.id, kind, str(sum(k.calls for k in ks)), sizes, sent, *work])
    return _table(head.split(", "), rows)


def _balance_table() -> str:
    """``max / mean`` useful causal pairs per device for each layout (exact fractions)."""
    rows = [
        [str(p), str(t), *(f"{float(load_balance(t, p, layout)):.4f}" for layout in LAYOUTS)]
        for p in (2, 4, 8)
        for t in (1000, 1024, 4096)
    ]
    return _table(["P", "T", *LAYOUTS], rows)


def _tiles_table() -> str:
    """The ring's computed work under causality: the busiest device's and the mean device's
    pieces (computed tiles over ``n^2``), of the ``P`` pieces a device meets."""
    t = 4096
    rows = []
    for p in (2, 4, 8):
        cells = []
        for layout in LAYOUTS:
            n = piece_tiles(t, t, p, layout, 0).shape[0]
            tiles = ring_tiles_computed(t, p, layout) / n**2
            cells.append(f"{tiles.max():g} / {tiles.mean():g}")
        rows.append([str(p), str(t), *cells])
    return _table(["P", "T", *(f"{layout} (busiest / mean)" for layout in LAYOUTS)], rows)


def _scheme(f: Formulation) -> str:
    model = f.cost_model
    if model is None:
        raise ValueError(f"{f.id}: a distributed scheme without a cost model")
    comm = inspect.getdoc(model) or ""
    return (
        f"### {f.title} (`{f.id}`)\n\n"
        f"$$\n{f.equation}\n$$\n\n"
        f"{f.summary}\n\n"
        f"**Kernel.** `{public_name(f.native)}`; row form `{public_name(f.apply)}` "
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
    """``docs/distributed.md``: the layouts, each scheme with its cost model, the communication
    and load balance tables, and the benchmark section of ``existing`` (the page as it is now,
    '' for none) kept verbatim."""
    import attnref.distributed  # noqa: F401  (registers the schemes)
    from attnref._src.formulations.distributed.family import GRADIENTS

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
        "positions `positions(T', P, layout)[d]` (`attnref._src.formulations.distributed.layout`): "
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
        f"{GRADIENTS}\n\n"
        "## Communication and work per device\n\n"
        "Every cost model (`attnref.costs.cost` on `Dims(..., devices=P)`) counts per device, as "
        "XLA's `cost_analysis()` of the SPMD program does, and lists the scheme's collectives "
        "(`attnref._src.core.cost.Collective`: kind, operand bytes per call, calls). What a device "
        "sends per call follows the bandwidth-optimal algorithms: a permute sends its operand, a "
        "ring all-gather its shard `P - 1` times, an all-to-all `(P - 1)/P` of its operand, a ring "
        "all-reduce `2 (P - 1)/P`. `tests/test_distributed_cost.py` checks the matmul FLOPs, "
        "transcendentals and per-call collective bytes against the compiled HLO "
        "(`attnref._src.core.cost.hlo_collectives`, `while` trip counts included) exactly, at "
        f"`P` = 1, 2 and 4. On B = {r.batch}, T = S = {r.t_q}, H = {r.heads} heads, "
        f"d_model = {r.d_model}, d_k = d_v = {r.d_k}, float32, P = {r.devices}:"
        f"\n\n{_communication_table()}\n\n"
        "Tensor parallelism's matmul includes the projections of its `H/P` heads; the "
        "sequence-parallel rows include the row form's projections on all tokens (striped, "
        "zigzag, all-gather: XLA's partitioner does not shard through the layout's gather) or "
        "on the device's own (ring, Ulysses). Around the `shard_map`, the partitioner may add "
        "collectives of its own to reshard the global arrays; the benchmark below measures them "
        "separately.\n\n"
        "## Causal load balance\n\n"
        f"{CLOSED_FORMS}\n\n"
        "`balance = max_d / mean_d` of the allowed (query, key) pairs per device under causal "
        "self-attention (`attnref._src.formulations.distributed.cost.load_balance`; `tests/"
        "test_distributed_cost.py` checks it against a brute-force count and the closed forms):"
        f"\n\n{_balance_table()}\n\n"
        "All-gather context parallelism uses the zigzag layout (its balance is zigzag's); "
        "Ulysses and tensor parallelism split heads, so every device does the same causal work. "
        "The ring skips a step whose chunk no local query may read, and computes the other "
        "steps' pieces in tiles (`attnref.distributed.piece_tiles`), forward and backward. "
        "In general a piece is 2 x 2 tiles, each skipped when no query of it may read one of "
        "its keys. When the position rules are known from the shapes (causality, the window) "
        "and few conditions suffice, it is up to 16 x 16 tiles of 64 rows or more: the tiles "
        "no step may reach are left out of the program, those every step reaches run with no "
        "cond (a query tile's adjacent ones as one run of keys, no merge), the rest under a "
        "cond. A striped piece under causality alone is the same local triangle on every "
        "step, so its tiles above the diagonal are not in the program "
        "(`tests/test_distributed_ring.py` checks XLA's dot FLOPs against the count); a "
        "window leaves only its band. So the balance shows as work: under a causal mask the "
        "busiest device computes `P - 1/4` pieces' worth with contiguous chunks, `(2P + 1)/4` "
        "zigzag and `(n + 1)P/(2n)` striped in n x n tiles (`9P/16` in 8 x 8; it was `3P/4` "
        "in 2 x 2), of the `P` pieces it meets (`attnref.distributed.ring_tiles_computed`; "
        "`tests/test_distributed_ring.py` checks it against a brute-force count of the "
        "allowed pairs):"
        f"\n\n{_tiles_table()}\n\n"
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
