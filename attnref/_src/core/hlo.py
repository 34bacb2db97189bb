"""Reading compiled HLO text: the dot FLOPs (:func:`hlo_dot_flops`) and the collectives with the
number of times each runs (:func:`collective_calls`, which
:func:`attnref._src.core.cost.hlo_collectives` turns into ``Collective`` records)."""

from __future__ import annotations

import math
import re
from collections.abc import Iterator

_INSTR = re.compile(r"%([\w.\-]+) = \w+\[([\d,]*)\]")
_DOT = re.compile(
    r"= \w+\[([\d,]*)\]\S* dot\(%([\w.\-]+), %[\w.\-]+\).*?lhs_contracting_dims=\{([\d,]*)\}"
)


def _shape(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(",") if v)


def hlo_dot_flops(hlo_text: str, executed: bool = False) -> int:
    """``2 * prod(output) * prod(contracted lhs dims)`` summed over the ``dot`` instructions of
    optimised HLO text; a ``while`` body's dots counted once (as ``cost_analysis``) or, with
    ``executed``, once per known trip (``ValueError`` for a loop with no known trip count)."""
    shapes = {m.group(1): _shape(m.group(2)) for m in _INSTR.finditer(hlo_text)}
    comps, entry = _computations(hlo_text) if executed else ({"": [hlo_text]}, "")
    runs: dict[str, int | None] = _executions(comps, entry)[0] if executed else {"": 1}
    total = 0
    for name, lines in comps.items():
        times = runs.get(name, 0)
        for m in _DOT.finditer("\n".join(lines)):
            if times is None:
                raise ValueError(f"a dot in %{name} runs in a loop with no known trip count")
            out, lhs = _shape(m.group(1)), shapes[m.group(2)]
            total += times * 2 * math.prod(out) * math.prod(lhs[c] for c in _shape(m.group(3)))
    return total


_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4}
_ITEMSIZE |= {"s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8, "c64": 8, "c128": 16}
_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.\-]+) \(.*\{$")
_COLLECTIVE = re.compile(
    r"= (.*?) (collective-permute|all-gather|all-to-all|all-reduce|reduce-scatter)(-start)?\("
)
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([\d,]*)\]")
_GROUPS = re.compile(
    r"replica_groups=(\{\{([\d,]*)\}|\[(\d+),(\d+)\]|\{\}|mesh\[([^\]]*)\] \{([^}]*)\})"
)
_MESH_AXIS = re.compile(r"'([^']+)'=(\d+)")
_PAIRS = re.compile(r"source_target_pairs=\{(.*?)\}\}")
_PARTITIONS = re.compile(r"num_partitions=(\d+)")
_CALLEE = re.compile(
    r"\b(body|condition|calls|to_apply|true_computation|false_computation)=%([\w.\-]+)"
)
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def _itemsize(hlo_type: str) -> int:
    """Bytes per element of an HLO element type (``f32``, ``bf16``, ``f8e4m3fn``, ...)."""
    if hlo_type.startswith("f8"):
        return 1
    if hlo_type not in _ITEMSIZE:
        raise ValueError(f"unknown HLO element type {hlo_type!r}")
    return _ITEMSIZE[hlo_type]


def _computations(hlo_text: str) -> tuple[dict[str, list[str]], str]:
    """The instruction lines of each computation of HLO text, and the entry's name."""
    comps: dict[str, list[str]] = {}
    entry, current = "", None
    for line in hlo_text.splitlines():
        m = _COMPUTATION.match(line)
        if m:
            current = m.group(1)
            comps[current] = []
            if line.startswith("ENTRY"):
                entry = current
        elif line.startswith("}"):
            current = None
        elif current is not None:
            comps[current].append(line)
    return comps, entry


def _executions(comps: dict[str, list[str]], entry: str) -> tuple[dict[str, int | None], set[str]]:
    """How many times each computation runs per call of the entry, and which run in a branch of
    a conditional. A ``while`` body runs its known trip count times per run of its caller
    (``None``: a loop on the way has no known trip count); every other callee (fusions, calls,
    reductions, branches) once per run of its caller, which for a branch is an upper bound."""
    edges: dict[str, list[tuple[str, int | None, bool]]] = {name: [] for name in comps}
    for name, lines in comps.items():
        for line in lines:
            for role, callee in _CALLEE.findall(line):
                trips = _TRIPS.search(line)
                k = (int(trips.group(1)) if trips else None) if role == "body" else 1
                edges[name].append((callee, k, role in ("true_computation", "false_computation")))
            for branches in _BRANCHES.findall(line):
                edges[name] += [(b.strip().lstrip("%"), 1, True) for b in branches.split(",")]
    order: list[str] = []  # callers before callees (HLO call graphs are acyclic)
    seen: set[str] = set()

    def post(name: str) -> None:
        seen.add(name)
        for callee, _, _ in edges.get(name, []):
            if callee not in seen:
                post(callee)
        order.append(name)

    post(entry)
    counts: dict[str, int | None] = {name: 0 for name in order}
    counts[entry] = 1
    branched: set[str] = set()
    for name in reversed(order):
        times = counts[name]
        for callee, k, branch in edges.get(name, []):
            add = None if times is None or k is None else times * k
            prev = counts[callee]
            counts[callee] = None if add is None or prev is None else prev + add
            if branch or name in branched:
                branched.add(callee)
    return counts, branched


def _group_size(line: str, kind: str, partitions: int) -> int:
    """The group size of a collective instruction: ``{{0,1,..}}`` (explicit groups),
    ``[G,P]<=[N]`` (iota groups), ``mesh[...] {'axis'}`` (mesh axes), ``{}`` (every partition);
    for ``collective-permute``, the number of source-target pairs."""
    if kind == "collective-permute":
        pairs = _PAIRS.search(line)
        return len(pairs.group(1).split("},{")) if pairs else 1
    g = _GROUPS.search(line)
    if g is None or g.group(1) == "{}":
        return partitions
    if g.group(2) is not None:
        return len(_shape(g.group(2)))
    if g.group(4) is not None:
        return int(g.group(4))
    sizes = {name: int(n) for name, n in _MESH_AXIS.findall(g.group(5))}
    return math.prod(sizes[a.strip().strip("'")] for a in g.group(6).split(",") if a.strip())


def collective_calls(hlo_text: str) -> Iterator[tuple[str, int, int, int, bool, bool]]:
    """Per collective instruction of ``hlo_text``: ``(kind, operand bytes, calls, group size,
    in_shard_map, conditional)``, as :func:`attnref._src.core.cost.hlo_collectives` documents."""
    comps, entry = _computations(hlo_text)
    runs, branched = _executions(comps, entry)
    found = _PARTITIONS.search(hlo_text)
    partitions = int(found.group(1)) if found else 1
    for name, lines in comps.items():
        for line in lines:
            m = _COLLECTIVE.search(line)
            if m is None:
                continue
            if m.group(3):
                raise ValueError(f"asynchronous collective {m.group(2)}-start is not counted")
            kind = m.group(2)
            if runs.get(name, 0) is None:
                raise ValueError(
                    f"{kind} in %{name} runs inside a while loop with no known trip count"
                )
            size = sum(_itemsize(t) * math.prod(_shape(d)) for t, d in _ARRAY.findall(m.group(1)))
            p = _group_size(line, kind, partitions)
            if kind == "all-gather":
                size //= p
            elif kind == "reduce-scatter":
                size *= p
            yield kind, size, runs.get(name, 0) or 0, p, "/shard_map/" in line, name in branched
