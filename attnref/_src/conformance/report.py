"""The conformance kit's report: one :class:`PropertyResult` per property (for a distributed
target, with one :class:`MeshResult` per mesh size), in a :class:`ConformanceReport` that prints
as a table (:meth:`ConformanceReport.summary`: a row per property, or per property and mesh size;
rich renders the same table in colour on a terminal) and as JSON
(:meth:`ConformanceReport.to_dict`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

from rich.console import Console, ConsoleOptions, RenderableType
from rich.table import Table
from rich.text import Text

from attnref._src import console
from attnref._src.conformance.options import _DEFAULT_SEMANTICS

__all__ = ["ConformanceReport", "MeshResult", "PropertyResult"]


@dataclasses.dataclass(frozen=True)
class MeshResult:
    """The outcome of one property of a distributed target on a mesh of ``devices`` devices.

    Attributes:
        devices: The mesh size ``P``.
        status: ``"passed"``, ``"failed"`` or ``"skipped"``.
        detail: The failure message (or skip reason); where ``uneven_lengths`` passed, its
            tally (the first refusal's ``"refused: <Type>: <first line>"``, and how many calls
            were refused and how many computed).
        example: Hypothesis's shrunk falsifying example and notes.
        examples: The examples run at this size.
        traceback: As :attr:`PropertyResult.traceback`.
        seconds: Wall-clock time at this size.
        ratio: The worst error / allowance over the examples, for properties that measure one
            (``ring_size_growth``); ``None`` otherwise.
    """

    devices: int
    status: str
    detail: str
    example: str | None
    examples: int
    traceback: str | None = None
    seconds: float = 0.0
    ratio: float | None = None


@dataclasses.dataclass(frozen=True)
class PropertyResult:
    """The outcome of one property: passed, failed (with the example and seed that replay the
    failure) or skipped (with the reason).

    Attributes:
        name: The property (one of ``PROPERTIES``).
        status: ``"passed"``, ``"failed"`` or ``"skipped"``.
        detail: The skip reason or the failure message (rule, index, ratio).
        example: Hypothesis's shrunk falsifying example and notes.
        seed: Replays the failure with ``check_attention(fn, properties=[name], seed=seed, ...)``.
        examples: The examples run (up to and including the first failing one).
        declared: The declared differences from attnref's semantics in effect, e.g.
            ``("masked_rows=uniform",)``.
        traceback: Where the failure is an exception rather than a failed comparison (the
            target raised, or returned something the kit could not use): where it was raised,
            with Hypothesis's own frames left out.
        seconds: Wall-clock time the property took (0 when skipped).
        meshes: For a distributed target, the outcome on each mesh size (ascending); the
            property failed when it failed on any, and ``detail``, ``example`` and
            ``traceback`` are those of the first size it failed on, ``detail`` prefixed with
            ``P=<size>:`` and a space.
    """

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


@dataclasses.dataclass(frozen=True)
class ConformanceReport:
    """Every property's :class:`PropertyResult` for one target; ``passed`` = no property failed.

    Attributes:
        target: The target's name.
        signature: The adapter used (``"jax_nn"``, ``"qkv_mask"`` or ``"numpy"``).
        features: The features checked.
        declared: The declared semantics that differ from attnref's defaults
            (``masked_rows="zeros"``, ``causal_alignment="top_left"``).
        results: One :class:`PropertyResult` per property run, in ``PROPERTIES`` order.
        shapes: ``"small"`` (Hypothesis draws over small buckets) or ``"production"``
            (tile-boundary sweeps).
        devices: The mesh sizes a distributed target ran on (``()``: a single-device target).
    """

    target: str
    signature: str
    features: tuple[str, ...]
    declared: dict[str, str]
    results: tuple[PropertyResult, ...]
    shapes: str = "small"
    devices: tuple[int, ...] = ()

    @property
    def passed(self) -> bool:
        """Whether the target conforms: no property failed (skipped ones do not fail a report).

        Returns:
            True iff no result has status ``"failed"``.
        """
        return all(r.status != "failed" for r in self.results)

    def summary(self) -> str:
        """The report as plain text: one row per property (per property and mesh size for a
        distributed target, with the worst error / allowance where the property measures one),
        then each failure in full.

        Returns:
            The heading (target, signature, features, declared differences), a table (property,
            status, examples, time, detail), the line ``N passed, M failed, K skipped:
            PASS|FAIL``, and each failure's message, shrunk example and the call that replays
            it; ASCII layout, no terminal codes, no line wrapped. ``rich.print(report)`` draws
            the same on a terminal, in colour.
        """
        return console.plain(self)

    def __rich_console__(self, con: Console, options: ConsoleOptions) -> Iterator[RenderableType]:
        """The report as rich renders it (:meth:`summary` is this, as plain text)."""
        terminal = con.is_terminal
        shapes = "" if self.shapes == "small" else f", shapes {self.shapes!r}"
        on = f", devices {', '.join(map(str, self.devices))}" if self.devices else ""
        yield Text(f"attnref conformance: {self.target} (signature {self.signature!r}{shapes}{on})")
        yield Text(f"features: {', '.join(self.features) or '(none)'}")
        if self.declared:
            yield Text(
                "declared differences: "
                + ", ".join(
                    f"{k}={v} (attnref default: {_DEFAULT_SEMANTICS[k]})"
                    for k, v in sorted(self.declared.items())
                )
            )
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
        """One row per property (per property and mesh size for a distributed target)."""
        meshes = bool(self.devices)
        head: tuple[str, ...] = ("property", "status", "examples", "time")
        if meshes:
            head = ("property", "P", *head[1:], "ratio")
        right = ("P", "examples", "time", "ratio")
        table = console.table((*head, "detail"), right=right, terminal=terminal)
        for r in self.results:
            runs: list[Any] = list(r.meshes) or [r]
            for m in runs:
                cells: list[Any] = [r.name]
                if meshes:
                    cells.append(str(m.devices) if isinstance(m, MeshResult) else "")
                cells += [
                    Text(m.status, console.status_style(m.status, terminal)),
                    str(m.examples),
                    _took(m),
                ]
                if meshes:
                    ratio = getattr(m, "ratio", None)
                    cells.append("" if ratio is None else f"{ratio:.3g}")
                table.add_row(*cells, _first_line(m.detail))
        return table

    def _failures(self) -> list[str]:
        """Each failure (per failing mesh size) in full: message, example, traceback, replay."""
        lines: list[str] = []
        for r in self.results:
            if r.status != "failed":
                continue
            failures: list[Any] = [m for m in r.meshes if m.status == "failed"] or [r]
            for f in failures:
                at = f" at P={f.devices}" if isinstance(f, MeshResult) else ""
                lines += ["", f"--- {r.name} failed{at} (seed {r.seed}) ---", f.detail.strip()]
                if f.example:
                    lines.append(f.example.strip())
                if f.traceback:
                    lines.append(f.traceback.rstrip())
                if self.shapes == "production":  # a fixed sweep: the failing case's index
                    replay = f"shapes='production', max_examples={r.examples}"
                else:
                    replay = f"seed={r.seed}, max_examples=..."
                if isinstance(f, MeshResult):
                    replay = f"devices=({f.devices},), " + replay
                check = (
                    "check_merge_states" if self.signature == "merge_states" else "check_attention"
                )
                lines.append(f"replay: {check}(fn, properties=[{r.name!r}], {replay}, ...)")
        return lines

    def to_dict(self) -> dict[str, Any]:
        """The report as plain data: the fields, ``passed``, and each result as a dict.

        Returns:
            A JSON-able dict of the report (``passed`` included).
        """
        return {
            "target": self.target,
            "signature": self.signature,
            "features": list(self.features),
            "declared": dict(self.declared),
            "shapes": self.shapes,
            "devices": list(self.devices),
            "passed": self.passed,
            "results": [
                {
                    **dataclasses.asdict(r),
                    "declared": list(r.declared),
                    "meshes": [dataclasses.asdict(m) for m in r.meshes],
                }
                for r in self.results
            ],
        }


def _first_line(text: str) -> str:
    first = text.strip().splitlines()[0] if text.strip() else ""
    return first[:87] + "..." if len(first) > 90 else first


def _took(r: PropertyResult | MeshResult) -> str:
    return f"{r.seconds:.1f} s" if r.status != "skipped" else ""
