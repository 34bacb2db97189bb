"""The conformance kit's report: one :class:`PropertyResult` per property, in a
:class:`ConformanceReport` that prints as a table (:meth:`ConformanceReport.summary`) and as
JSON (:meth:`ConformanceReport.to_dict`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from attnref._src.conformance.options import _DEFAULT_SEMANTICS

__all__ = ["ConformanceReport", "PropertyResult"]


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
    """

    target: str
    signature: str
    features: tuple[str, ...]
    declared: dict[str, str]
    results: tuple[PropertyResult, ...]
    shapes: str = "small"

    @property
    def passed(self) -> bool:
        """Whether the target conforms: no property failed (skipped ones do not fail a report).

        Returns:
            True iff no result has status ``"failed"``.
        """
        return all(r.status != "failed" for r in self.results)

    def summary(self) -> str:
        """The report as text: one row per property, then each failure in full.

        Returns:
            A readable table (property, status, examples, detail), the declared differences, and
            each failure's shrunk example with the seed that replays it.
        """
        rows = [("property", "status", "examples", "time", "detail")]
        for r in self.results:
            first = r.detail.strip().splitlines()[0] if r.detail.strip() else ""
            if len(first) > 90:
                first = first[:87] + "..."
            took = f"{r.seconds:.1f} s" if r.status != "skipped" else ""
            rows.append((r.name, r.status, str(r.examples), took, first))
        widths = [max(len(row[i]) for row in rows) for i in range(4)]
        shapes = "" if self.shapes == "small" else f", shapes {self.shapes!r}"
        lines = [
            f"attnref conformance: {self.target} (signature {self.signature!r}{shapes})",
            f"features: {', '.join(self.features) or '(none)'}",
        ]
        if self.declared:
            lines.append(
                "declared differences: "
                + ", ".join(
                    f"{k}={v} (attnref default: {_DEFAULT_SEMANTICS[k]})"
                    for k, v in sorted(self.declared.items())
                )
            )
        lines.append("")
        for i, row in enumerate(rows):
            lines.append(
                "  ".join(c.ljust(w) for c, w in zip(row[:4], widths, strict=True)) + "  " + row[4]
            )
            if i == 0:
                lines.append("  ".join("-" * w for w in widths) + "  " + "-" * 6)
        counts = {s: sum(r.status == s for r in self.results) for s in ("passed", "failed")}
        skipped = len(self.results) - counts["passed"] - counts["failed"]
        lines.append("")
        lines.append(
            f"{counts['passed']} passed, {counts['failed']} failed, {skipped} skipped: "
            + ("PASS" if self.passed else "FAIL")
        )
        for r in self.results:
            if r.status != "failed":
                continue
            lines += ["", f"--- {r.name} failed (seed {r.seed}) ---", r.detail.strip()]
            if r.example:
                lines.append(r.example.strip())
            if r.traceback:
                lines.append(r.traceback.rstrip())
            if self.shapes == "production":  # a fixed sweep: the failing case's index replays it
                replay = f"shapes='production', max_examples={r.examples}"
            else:
                replay = f"seed={r.seed}, max_examples=..."
            lines.append(f"replay: check_attention(fn, properties=[{r.name!r}], {replay}, ...)")
        return "\n".join(lines)

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
            "passed": self.passed,
            "results": [
                {**dataclasses.asdict(r), "declared": list(r.declared)} for r in self.results
            ],
        }
