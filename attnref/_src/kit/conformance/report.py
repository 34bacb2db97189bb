"""The conformance kit's report: a :class:`PropertyResult` per property (a :class:`MeshResult`
per mesh size of a distributed target) in a :class:`ConformanceReport`, printed as a table or
JSON."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import numpy as np
from rich.console import Console, ConsoleOptions, RenderableType
from rich.table import Table
from rich.text import Text

from attnref._src.kit import console
from attnref._src.kit.conformance.options import DEFAULT_SEMANTICS
from attnref._src.kit.conformance.replay import JSON_MAX_ELEMENTS, target_call


@dataclasses.dataclass(frozen=True)
class MeshResult:
    """One property of a distributed target on ``devices`` devices: the fields of
    :class:`PropertyResult` at this size (a passing ``uneven_lengths``' detail is its tally of
    refused and computed calls), and ``ratio``, the worst error / allowance where the property
    measures one (``ring_size_growth``; else ``None``)."""

    devices: int
    status: str
    detail: str
    example: str | None
    examples: int
    traceback: str | None = None
    seconds: float = 0.0
    ratio: float | None = None
    inputs: dict[str, Any] | None = None
    problem_replay: str | None = None


@dataclasses.dataclass(frozen=True)
class PropertyResult:
    """The outcome of property ``name``: ``status`` ``"passed"``, ``"failed"`` or ``"skipped"``.

    ``detail``: the skip reason or failure message (rule, index, ratio). ``example``: the
    failing example, headed shrunk or explicit, its ``Case(...)`` line naming the sub-case that
    failed (or the failing production case). ``seed`` replays it; ``examples`` counts those run
    (up to the first failing one); ``declared``: the declared semantics in effect, e.g.
    ``("masked_rows=uniform",)``. ``traceback``: where the target raised (or returned something
    unusable), Hypothesis's frames left out. ``seconds``: wall-clock time. ``meshes``: a
    distributed target's outcome per mesh size (ascending); ``detail``, ``example``,
    ``traceback`` and ``inputs`` are then the first failing size's, ``detail`` prefixed
    ``P=<size>:``.

    ``inputs`` (failures only): the target's last call in the failing example as keyword
    arguments (``query``, ``key``, ``value``, its options; ``cotangent`` for a gradient call).
    ``problem_replay``: one line of Python rebuilding them with
    :func:`attnref.strategies.make_kernel_problem` and asserting the call against the oracle
    (:func:`attnref.testing.assert_matches_oracle` or ``assert_grads_match_oracle``); ``None``
    where the property changed the problem after building it or the target is distributed."""

    name: str
    status: str
    detail: str
    example: str | None
    seed: int
    examples: int
    declared: tuple[str, ...] = ()
    traceback: str | None = None
    seconds: float = 0.0
    meshes: tuple[MeshResult, ...] = ()
    inputs: dict[str, Any] | None = None
    problem_replay: str | None = None


@dataclasses.dataclass(frozen=True)
class ConformanceReport:
    """Every property's :class:`PropertyResult` (``results``, in ``PROPERTIES`` order) for
    ``target``, with the ``signature``, the ``features`` checked, the ``declared`` semantics that
    differ from attnref's, the ``shapes``, the mesh sizes (``devices``; ``()``: one device) and
    the keyword ``options`` given other than properties, seed and callbacks (the replay lines
    pass them again)."""

    target: str
    signature: str
    features: tuple[str, ...]
    declared: dict[str, str]
    results: tuple[PropertyResult, ...]
    shapes: str = "small"
    devices: tuple[int, ...] = ()
    options: tuple[tuple[str, Any], ...] = ()

    @property
    def passed(self) -> bool:
        """No result has status ``"failed"``."""
        return all(r.status != "failed" for r in self.results)

    def summary(self) -> str:
        """The report as plain text (``rich.print(report)`` draws it in colour): the heading, a
        row per property (and mesh size), ``N passed, M failed, K skipped: PASS|FAIL``, and each
        failure's message, example and :meth:`replay` line."""
        return console.plain(self)

    def __rich_console__(self, con: Console, options: ConsoleOptions) -> Iterator[RenderableType]:
        terminal = con.is_terminal
        shapes = "" if self.shapes == "small" else f", shapes {self.shapes!r}"
        on = f", devices {', '.join(map(str, self.devices))}" if self.devices else ""
        yield Text(f"attnref conformance: {self.target} (signature {self.signature!r}{shapes}{on})")
        yield Text(f"features: {', '.join(self.features) or '(none)'}")
        differences = [
            f"{k}={v} (attnref default: {DEFAULT_SEMANTICS[k]})"
            for k, v in sorted(self.declared.items())
        ]
        if differences:
            yield Text(f"declared differences: {', '.join(differences)}")
        limits = dict(self.options)
        declared_limits = ["refuses_lengths"] if limits.get("refuses_lengths") else []
        if limits.get("head_dim") is not None:
            declared_limits.append(
                f"head_dim={','.join(map(str, np.atleast_1d(limits['head_dim'])))}"
            )
        if declared_limits:
            yield Text(f"declared limits: {', '.join(declared_limits)}")
        yield Text("")
        yield self._table(terminal)
        counts = {s: sum(r.status == s for r in self.results) for s in ("passed", "failed")}
        skipped = len(self.results) - counts["passed"] - counts["failed"]
        verdict = "PASS" if self.passed else "FAIL"
        yield Text("")
        yield Text.assemble(
            f"{counts['passed']} passed, {counts['failed']} failed, {skipped} skipped: ",
            (verdict, console.status_style("passed" if self.passed else "failed", terminal)),
        )
        for line in self._failures():
            yield Text(line)

    def _table(self, terminal: bool) -> Table:
        meshes = bool(self.devices)
        head: tuple[str, ...] = ("property", "status", "examples", "time")
        if meshes:
            head = ("property", "P", *head[1:], "ratio")
        right = ("P", "examples", "time", "ratio")
        table = console.table((*head, "detail"), right=right, terminal=terminal)
        for r in self.results:
            for m in r.meshes or (r,):
                status = Text(m.status, console.status_style(m.status, terminal))
                cells: list[Any] = [r.name, status, str(m.examples), _took(m)]
                if meshes:
                    ratio = getattr(m, "ratio", None)
                    cells.insert(1, str(m.devices) if isinstance(m, MeshResult) else "")
                    cells.append("" if ratio is None else f"{ratio:.3g}")
                table.add_row(*cells, _first_line(m.detail))
        return table

    def _failures(self) -> list[str]:
        lines: list[str] = []
        for r in self.results:
            if r.status != "failed":
                continue
            for f in tuple(m for m in r.meshes if m.status == "failed") or (r,):
                devices = f.devices if isinstance(f, MeshResult) else None
                at = "" if devices is None else f" at P={devices}"
                lines += ["", f"--- {r.name} failed{at} (seed {r.seed}) ---", f.detail.strip()]
                if f.example:
                    lines.append(f.example.strip())
                if f.traceback:
                    lines.append(f.traceback.rstrip())
                lines.append(f"replay: {self.replay(r, devices)}")
                if f.problem_replay:
                    lines.append(f"replay the failing call: {f.problem_replay}")
        return lines

    def replay(self, result: PropertyResult, devices: int | None = None) -> str:
        """The Python that reruns ``result``'s property alone with this report's options and
        seed (on ``devices`` devices alone when given); it calls ``fn`` unless :attr:`target`
        is a loadable ``module:function``."""
        checks = {"merge_states": "check_merge_states", "paged": "check_paged", "mla": "check_mla"}
        check = checks.get(self.signature, "check_attention")
        module = "attnref.conformance" if self.signature in ("paged", "mla") else "attnref.testing"
        fn, load = target_call(self.target)
        kw: dict[str, Any] = {"properties": [result.name], "seed": result.seed}
        kw.update(self.options)
        if self.shapes == "production":  # a fixed sweep: up to the failing case
            kw["max_examples"] = result.examples
        if devices is not None:
            kw["devices"] = (devices,)
        args = ", ".join([fn, *(f"{k}={v!r}" for k, v in kw.items())])
        return f"from {module} import {check}{load}; {check}({args})"

    def to_dict(self) -> dict[str, Any]:
        """The fields, ``passed`` and each result, as JSON-able data."""
        return {
            "target": self.target,
            "signature": self.signature,
            "features": list(self.features),
            "declared": dict(self.declared),
            "shapes": self.shapes,
            "devices": list(self.devices),
            "options": {k: list(v) if isinstance(v, tuple) else v for k, v in self.options},
            "passed": self.passed,
            "results": [
                {
                    **_as_dict(r),
                    "declared": list(r.declared),
                    "meshes": [_as_dict(m) for m in r.meshes],
                }
                for r in self.results
            ],
        }


def _json_value(value: Any) -> Any:
    """An array as ``{"dtype", "shape", "data"}`` (no data above ``JSON_MAX_ELEMENTS``)."""
    if isinstance(value, tuple):
        return [_json_value(v) for v in value]
    if isinstance(value, np.ndarray):
        small = value.size <= JSON_MAX_ELEMENTS
        data = value.astype(np.float64).tolist() if value.dtype.kind == "V" else value.tolist()
        return {
            "dtype": str(value.dtype),
            "shape": list(value.shape),
            "data": data if small else None,
        }
    return value


def _as_dict(r: PropertyResult | MeshResult) -> dict[str, Any]:
    out = {f.name: getattr(r, f.name) for f in dataclasses.fields(r) if f.name != "meshes"}
    if r.inputs is not None:
        out["inputs"] = {k: _json_value(v) for k, v in r.inputs.items()}
    return out


def _first_line(text: str) -> str:
    first = text.strip().splitlines()[0] if text.strip() else ""
    return first[:87] + "..." if len(first) > 90 else first


def _took(r: PropertyResult | MeshResult) -> str:
    return f"{r.seconds:.1f} s" if r.status != "skipped" else ""
