"""Run attnref's conformance properties against your attention function, from pytest or a shell.

* ``attnref check package.module:function [--signature ...] [--masked-rows uniform] ...``: a
  progress bar, the summary table, the declared differences, exit status 0 / 1 (a property
  failed) / 2 (the target cannot be loaded); ``--devices 1,2,4,8`` checks a distributed kernel
  on meshes of those sizes (every property, and ``ring_size_growth`` and ``uneven_lengths``).
* ``pytest --pyargs attnref.conformance --attnref-target=package.module:function``: one pytest
  test per property (:mod:`attnref.conformance.test_conformance`), with the options of
  :mod:`attnref.conformance.plugin` (registered through the ``pytest11`` entry point).

Both call :func:`attnref.testing.check_attention` (``docs/testing_your_kernel.md``) through the
glue here; also :func:`check_paged` (a paged KV cache, ``docs/paged.md``) and :func:`check_mla`
(multi-head latent attention, ``docs/mla.md``).
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import sys
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from attnref._src.kit.conformance.context import Context as Context
from attnref._src.kit.conformance.engine import check_attention
from attnref._src.kit.conformance.engine import mesh_contexts as mesh_contexts
from attnref._src.kit.conformance.mla import MLA_PROPERTIES, check_mla
from attnref._src.kit.conformance.options import (
    ALL_PROPERTIES,
    CAUSAL_ALIGNMENTS,
    DISTRIBUTED_PROPERTIES,
    FEATURES,
    MASKED_ROWS_POLICIES,
    PROPERTIES,
    SIGNATURES,
    OptionError,
    check_choice,
    check_devices,
    check_features,
    check_head_dim,
    check_max_examples,
    check_properties,
)
from attnref._src.kit.conformance.paged import PAGED_FEATURES, PAGED_PROPERTIES, check_paged
from attnref._src.kit.conformance.targets import AXIS as AXIS
from attnref._src.kit.conformance.targets import Target as Target
from attnref._src.kit.conformance.targets import load_target
from attnref._src.kit.conformance.targets import mesh as mesh

__all__ = [
    "ALIGNMENTS",
    "ALL_PROPERTIES",
    "DISTRIBUTED_PROPERTIES",
    "FEATURES",
    "MASKED_ROWS",
    "MLA_PROPERTIES",
    "PAGED_FEATURES",
    "PAGED_PROPERTIES",
    "PROPERTIES",
    "SIGNATURES",
    "OptionError",
    "Options",
    "TargetError",
    "check_mla",
    "check_paged",
    "failed_devices",
    "format_failure",
    "load",
    "read_xfail_file",
    "split_devices",
    "split_head_dim",
    "split_list",
]

MASKED_ROWS: tuple[str, ...] = MASKED_ROWS_POLICIES  # "zeros" (attnref), "uniform" (jax.nn), "nan"
ALIGNMENTS: tuple[str, ...] = CAUSAL_ALIGNMENTS  # "top_left" (jax.nn), "bottom_right" (flash)


class TargetError(Exception):
    """The target spec does not name a loadable callable (the CLI exits 2 on it)."""


def split_list(text: str | None) -> tuple[str, ...] | None:
    """``"a, b,c"`` -> ``("a", "b", "c")``; ``None`` or blank -> ``None`` (the default)."""
    if text is None or not text.strip():
        return None
    return tuple(s.strip() for s in text.split(",") if s.strip())


def split_devices(text: str | None) -> tuple[int, ...] | None:
    """``"1, 2,4"`` -> ``(1, 2, 4)``; ``None`` or blank -> ``None``; ``ValueError`` otherwise."""
    items = split_list(text)
    if items is None:
        return None
    try:
        return tuple(int(s) for s in items)
    except ValueError:
        raise ValueError(
            f"devices must be comma-separated mesh sizes such as 1,2,4,8, got {text!r}"
        ) from None


def split_head_dim(text: str | None) -> int | tuple[int, int] | None:
    """``"64"`` -> ``64``; ``"192,128"`` -> ``(192, 128)`` (``H, H_v``); ``None`` or blank ->
    ``None``; ``ValueError`` otherwise (the range is ``check_attention``'s to check)."""
    items = split_list(text)
    if items is None:
        return None
    try:
        dims = tuple(int(s) for s in items)
    except ValueError:
        dims = ()
    if len(dims) not in (1, 2):
        raise ValueError(f"head-dim must be H or H,H_v (e.g. 64 or 192,128), got {text!r}")
    return dims[0] if len(dims) == 1 else (dims[0], dims[1])


def load(spec: str) -> Callable[..., Any]:
    """Load ``package.module:function`` (or ``package.module:obj.attr``), the current directory
    on ``sys.path`` (a project's root works uninstalled); a :class:`TargetError` says what failed.
    """
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        raise TargetError(
            f"target {spec!r} is not of the form package.module:function "
            "(e.g. mypkg.kernels:attention)"
        )
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)
    try:
        return load_target(spec)
    except ImportError as e:
        raise TargetError(
            f"{e} (is the package installed, or the current directory its parent?)"
        ) from e
    except Exception as e:  # the user's module may raise anything while importing
        raise TargetError(f"cannot load target {spec!r}: {type(e).__name__}: {e}") from e


@dataclasses.dataclass(frozen=True)
class Options:
    """What the CLI and the pytest plugin pass to ``check_attention`` (``None``: its default),
    and ``target``, the spec ``package.module:function``."""

    target: str
    signature: str = "jax_nn"
    features: tuple[str, ...] | None = None
    max_examples: int | None = None
    seed: int = 0
    masked_rows: str = "zeros"
    causal_alignment: str = "top_left"
    dtypes: tuple[str, ...] | None = None
    properties: tuple[str, ...] | None = None
    shapes: str = "small"
    devices: tuple[int, ...] | None = None
    refuses_lengths: bool = False
    head_dim: int | tuple[int, int] | None = None

    def validate(self) -> None:
        """``check_attention``'s checks before the target is loaded (the rest:
        :meth:`preflight`); a ``ValueError`` in the CLI's words."""
        try:
            check_choice("signature", self.signature)
            check_features(self.features or ())
            check_properties(self.properties or ())
            for option in ("masked_rows", "causal_alignment", "shapes"):
                check_choice(option, getattr(self, option))
            if self.max_examples is not None:
                check_max_examples(self.max_examples)
            if self.head_dim is not None:
                check_head_dim(self.head_dim)
            if self.devices is not None:
                check_devices(self.devices)
        except OptionError as e:
            raise ValueError(_cli_message(e)) from e

    def selected(self) -> tuple[str, ...]:
        """The properties to run, in the engine's order."""
        if self.properties is None:
            return PROPERTIES if self.devices is None else (*PROPERTIES, *DISTRIBUTED_PROPERTIES)
        return tuple(p for p in ALL_PROPERTIES if p in self.properties)

    def preflight(self, fn: Callable[..., Any]) -> None:
        """``check_attention``'s validation against ``fn``, no property run; ``ValueError``."""
        try:
            self.run(fn, properties=())
        except TypeError as e:
            raise ValueError(str(e)) from e

    def run(
        self,
        fn: Callable[..., Any],
        properties: Sequence[str] | None = None,
        progress: Callable[[int, int, str], None] | None = None,
        log: Callable[[str], None] | None = None,
    ) -> Any:
        """``check_attention(fn, ...)`` with these options (``properties`` overrides them)."""
        kw = {k: v for k, v in dataclasses.asdict(self).items() if v is not None}
        kw["properties"] = list(properties if properties is not None else self.selected())
        return check_attention(fn, progress=progress, log=log, **kw)

    def replay_command(self, name: str, seed: int, devices: int | None = None) -> str:
        """The ``attnref check`` line that reruns ``name`` from ``seed`` (on ``devices`` alone)."""
        args = ["attnref", "check", self.target, "--properties", name, "--seed", str(seed)]
        for flag, value, default in (
            ("signature", self.signature, "jax_nn"),
            ("features", self.features, None),
            ("max-examples", self.max_examples, None),
            ("masked-rows", self.masked_rows, "zeros"),
            ("causal-alignment", self.causal_alignment, "top_left"),
            ("dtypes", self.dtypes, None),
            ("shapes", self.shapes, "small"),
            ("head-dim", self.head_dim, None),
            ("devices", (devices,) if devices is not None else self.devices, None),
        ):
            if value != default:
                text = ",".join(map(str, value)) if isinstance(value, (tuple, list)) else str(value)
                args += [f"--{flag}", text]
        if self.refuses_lengths:
            args.append("--refuses-lengths")
        return shlex.join(args)


def _cli_message(e: OptionError) -> str:
    if e.option == "signature":
        return f"signature {e.value!r} is not one of {', '.join(e.accepted)}"
    if e.option in ("features", "properties") and e.accepted:
        label = {"features": "feature", "properties": "property"}[e.option]
        return f"unknown {label} {e.value[0]!r}; choose from {', '.join(e.accepted)}"
    if e.option in ("masked_rows", "causal_alignment", "shapes"):
        return f"{e.option} {e.value!r} is not one of {e.accepted}"
    if e.option == "max_examples":
        return f"max_examples must be at least 1, got {e.value}"
    return str(e)


def _mesh_text(m: Any) -> str:
    ratio = "" if m.ratio is None else f" (error / allowance {m.ratio:.3g})"
    return f"P={m.devices} {m.status}{ratio}"


def failed_devices(result: Any) -> int | None:
    """The first mesh size a distributed property failed on (``None``: not distributed)."""
    meshes = getattr(result, "meshes", ())
    return next((m.devices for m in meshes if m.status == "failed"), None)


def format_failure(result: Any, options: Options) -> str:
    """A failed property as text: the message, the example, and the replay lines."""
    lines = [f"property {result.name!r} failed after {result.examples} example(s)"]
    lines.append(textwrap.indent(result.detail.rstrip() or "(no message)", "  "))
    if result.example:
        lines.append(textwrap.indent(result.example.rstrip(), "  "))  # headed shrunk or explicit
    if getattr(result, "traceback", None):
        lines += ["traceback:", textwrap.indent(result.traceback.rstrip(), "  ")]
    if result.declared:
        lines.append(f"declared: {', '.join(result.declared)}")
    if getattr(result, "meshes", ()):
        lines.append("per mesh size: " + ", ".join(_mesh_text(m) for m in result.meshes))
    replay = options.replay_command(result.name, result.seed, failed_devices(result))
    lines.append(f"replay (seed {result.seed}): {replay}")
    if getattr(result, "problem_replay", None):
        lines.append(f"replay the failing call (Python): {result.problem_replay}")
    return "\n".join(lines)


def read_xfail_file(path: str | os.PathLike[str], known: Sequence[str]) -> dict[str, str]:
    """Property names (or test ids ending ``[name]``) to mark xfail, one a line, ``#`` starting
    the reason; ``ValueError`` for an unknown name."""
    text = Path(path).read_text(encoding="utf-8")
    out: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        entry, _, comment = raw.partition("#")
        entry = entry.strip()
        if not entry:
            continue
        if entry.endswith("]") and "[" in entry:
            entry = entry[entry.rindex("[") + 1 : -1]
        if entry not in known:
            raise ValueError(
                f"{path}:{number}: {entry!r} is not a property; choose from {', '.join(known)}"
            )
        out[entry] = comment.strip() or f"listed in {path}"
    return out
