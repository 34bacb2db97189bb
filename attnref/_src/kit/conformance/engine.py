"""The conformance kit's engine: each property plan run as a Hypothesis test, and
:func:`check_attention`."""

from __future__ import annotations

import dataclasses
import glob
import math
import os
import re
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import hypothesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import UnsatisfiedAssumption
from hypothesis.reporting import with_reporter

from attnref._src.kit import closeness
from attnref._src.kit.conformance import production
from attnref._src.kit.conformance.context import Check, Context
from attnref._src.kit.conformance.options import (
    DEFAULT_FEATURES,
    DEFAULT_SEMANTICS,
    DEPENDS,
    DISTRIBUTED_PROPERTIES,
    NEEDS,
    PROPERTIES,
    OptionError,
    check_choice,
    check_devices,
    check_dtypes,
    check_expressible,
    check_features,
    check_head_dim,
    check_max_examples,
    check_properties,
    expand_features,
)
from attnref._src.kit.conformance.plans import PLANS, TargetRaised, calls_detail
from attnref._src.kit.conformance.replay import call_inputs, problem_replay
from attnref._src.kit.conformance.report import ConformanceReport, MeshResult, PropertyResult
from attnref._src.kit.conformance.targets import Target, describe_target, mesh, takes_keyword
from attnref._src.kit.conformance.torch_target import require_torch


# Typed as the decorator it is used as: beartype rejects the settings class as a hint.
def _settings(max_examples: int) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    return settings(
        max_examples=max_examples,
        database=None,
        derandomize=False,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        phases=(Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink),
        report_multiple_bugs=False,
        print_blob=False,
    )


# The kit's own source files: this package's modules and the closeness rules.
_KIT_DIR = os.path.dirname(os.path.abspath(__file__))
_KIT_FILES = frozenset(
    os.path.normcase(os.path.abspath(f))
    for f in [*glob.glob(os.path.join(_KIT_DIR, "*.py")), closeness.__file__]
)


def _is_comparison_failure(exc: BaseException) -> bool:
    """An ``AssertionError`` raised in the kit's own files, not the target's."""
    if not isinstance(exc, AssertionError) or exc.__traceback__ is None:
        return False
    frames = traceback.extract_tb(exc.__traceback__)
    return bool(frames) and os.path.normcase(os.path.abspath(frames[-1].filename)) in _KIT_FILES


def _format_traceback(exc: BaseException) -> str:
    """``exc``'s traceback without Hypothesis's frames."""
    hyp = os.sep + "hypothesis" + os.sep
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if hyp not in f.filename]
    last = f"{type(exc).__module__}.{type(exc).__qualname__}".removeprefix("builtins.")
    text = str(exc)  # not format_exception_only: that repeats Hypothesis's notes
    return "".join(["Traceback (most recent call last):\n", *traceback.format_list(frames)]) + (
        f"{last}: {text}" if text else last
    )


# (status, detail, example, examples, traceback)
_Run = tuple[str, str, str | None, int, str | None]
# How a failing example is headed: a generated one is shrunk, an explicit one fails as it is.
SHRUNK = "shrunk example (Hypothesis's smallest failing draw):"
EXPLICIT = "explicit example (run first for every seed; not shrunk):"


def run_property(
    strategy: Any,
    check: Check,
    max_examples: int,
    seed: int,
    explicit: Sequence[Any] = (),
    sub_case: Callable[[], str | None] = lambda: None,
) -> _Run:
    """Run ``check`` as a Hypothesis test: ``(status, detail, example, examples, traceback)``.
    The ``explicit`` cases run first for every seed (counted only when one fails); the example
    is headed :data:`SHRUNK` or :data:`EXPLICIT`, its ``Case(...)`` line ending with
    ``sub_case()`` after the failing run."""
    state = {"count": 0, "failed": False, "explicit": False}

    def body(case: Any) -> None:
        is_explicit = any(case is e for e in explicit)
        if not state["failed"] and not is_explicit:
            state["count"] += 1
        try:
            check(case)
        except UnsatisfiedAssumption:  # a declared refusal (refuses_lengths): another draw
            raise
        except BaseException:
            if not state["failed"] and is_explicit:
                state["count"] += 1
            state["failed"] = True
            state["explicit"] = is_explicit
            raise

    test: Any = given(case=strategy)(body)
    for case in reversed(tuple(explicit)):
        test = hypothesis.example(case=case)(test)
    test = hypothesis.seed(seed)(_settings(max_examples)(test))
    printed: list[str] = []
    try:
        with with_reporter(lambda value: printed.append(str(value))):
            test()
    except Exception as exc:
        # Hypothesis reports the shrunk example as a note or through the reporter, headed
        # "Falsifying example:" (before 6.15x) or "Failing test case:" (after): both put first.
        notes = [str(n) for n in getattr(exc, "__notes__", ())] + printed
        heads = ("Failing test case", "Falsifying", "Failing explicit example")
        cases = [n for n in notes if n.startswith(heads)]
        lines = list(dict.fromkeys(cases + [n for n in notes if n not in cases]))
        text = _name_sub_case("\n".join(lines).strip(), sub_case())
        head = EXPLICIT if state["explicit"] else SHRUNK
        example = f"{head}\n{text}" if text else None
        message, tb = _failure(exc)
        return "failed", message, example, int(state["count"]), tb
    return "passed", "", None, int(state["count"]), None


def run_suite(
    names: Sequence[str],
    run: Callable[[str], PropertyResult | str],
    *,
    seed: int,
    progress: Callable[[int, int, str], None] | None = None,
) -> tuple[PropertyResult, ...]:
    """``run(name)`` for each property (a string: why it is skipped); ``progress`` after each."""
    results: list[PropertyResult] = []
    for done, name in enumerate(names, start=1):
        out = run(name)
        if isinstance(out, str):
            out = PropertyResult(name, "skipped", out, None, seed, 0)
        results.append(out)
        if progress is not None:
            progress(done, len(names), name)
    return tuple(results)


def planned(
    plan: Callable[[str], tuple[Any, ...] | str],
    *,
    seed: int,
    max_examples: int,
    in_effect: Callable[[str], tuple[str, ...]] = lambda name: (),
) -> Callable[[str], PropertyResult | str]:
    """A :func:`run_suite` runner: :func:`run_property` over ``plan(name)``, ``(strategy,
    check[, explicit cases])`` or why it is skipped."""

    def run(name: str) -> PropertyResult | str:
        start = time.perf_counter()
        out = plan(name)
        if isinstance(out, str):
            return out
        strategy, check, *explicit = out
        status, detail, example, count, tb = run_property(
            strategy, check, max_examples, seed, *explicit
        )
        took = time.perf_counter() - start
        return PropertyResult(name, status, detail, example, seed, count, in_effect(name), tb, took)

    return run


def changed(*given: tuple[str, Any, Any]) -> tuple[tuple[str, Any], ...]:
    """The ``(option, value)`` of each ``(option, value, default)`` whose value is not the default
    (:attr:`ConformanceReport.options`)."""
    return tuple((k, v) for k, v, default in given if v != default)


def check_target(fn: Any, max_examples: int | None, name: str = "fn") -> None:
    """``max_examples`` (``None`` or ``>= 1``) and a callable ``fn``, else an :class:`OptionError`
    or a ``TypeError``."""
    if max_examples is not None:
        check_max_examples(max_examples)
    if not callable(fn):
        raise TypeError(f"{name} must be callable, got {type(fn).__name__}")


def _name_sub_case(text: str, sub_case: str | None) -> str:
    """``text`` with ``  # failed at: <sub_case>`` after the drawn case's line."""
    if not sub_case:
        return text
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if re.match(r"\s*(case|p)=", line):
            lines[i] = f"{line}  # failed at: {sub_case}"
            return "\n".join(lines)
    return f"{text}\nfailed at: {sub_case}"


def _failure(exc: BaseException) -> tuple[str, str | None]:
    """``(message, traceback)``, no traceback for the kit's own comparisons."""
    message = str(exc).strip() or type(exc).__name__
    if isinstance(exc, TargetRaised) and exc.__cause__ is not None:
        return message, _format_traceback(exc.__cause__)
    if _is_comparison_failure(exc):
        return message, None
    return f"{type(exc).__name__}: {message}", _format_traceback(exc)


def _production(
    ctx: Context, name: str, max_examples: int | None, log: Callable[[str], None] | None
) -> _Run | str:
    """:func:`run_property` over the first ``max_examples`` production cases, in order."""
    cases = production.cases(ctx, name)
    if isinstance(cases, str):
        return cases
    cases = cases[:max_examples]
    check = production.check(ctx, name, cases)
    for i, case in enumerate(cases, start=1):
        start = time.perf_counter()
        try:
            check(case)
        except UnsatisfiedAssumption:  # a declared refusal (refuses_lengths): the next case
            continue
        except Exception as exc:
            message, tb = _failure(exc)
            return "failed", message, f"production case {i}/{len(cases)}: {case}", i, tb
        if log is not None:
            log(f"{name} {i}/{len(cases)}: {case} ({time.perf_counter() - start:.1f} s)")
    return "passed", "", None, len(cases), None


def _small(ctx: Context, name: str, max_examples: int, seed: int) -> _Run | str:
    """:func:`run_property` over the small buckets, or why it is skipped."""
    if name in NEEDS and NEEDS[name] not in ctx.features:
        return f"needs feature {NEEDS[name]!r}"
    plan = PLANS[name](ctx)
    if isinstance(plan, str):
        return plan
    strategy, check, *explicit = plan

    def tracked(case: Any) -> None:
        ctx.sub_case = None
        check(case)

    first = explicit[0] if explicit else ()
    return run_property(strategy, tracked, max_examples, seed, first, sub_case=lambda: ctx.sub_case)


def _timed(
    ctx: Context, target: str, run: Callable[..., _Run | str], *args: Any
) -> dict[str, Any] | str:
    """``run(ctx, *args)`` as a result's fields, or why it is skipped: the target's notes in the
    detail, the ``seconds``, a failure's ``inputs`` and ``problem_replay`` (of the target's last
    call, the target named ``target``)."""
    start = time.perf_counter()
    before, refused = len(ctx.target.notes), len(ctx.target.refusals)
    ctx.target.last_call = None
    out = run(ctx, *args)
    if isinstance(out, str):
        return out
    status, detail, example, count, tb = out
    notes = ctx.target.notes[before:]
    if refusals := ctx.target.refusals[refused:]:
        notes.append(
            f"{len(refusals)} call(s) refused, as declared (refuses_lengths), examples drawn "
            f"again; first: {refusals[0]}"
        )
    if status == "passed" and ctx.calls:
        detail = calls_detail(ctx.calls)
    detail = "; ".join([detail, *notes] if detail else notes) if notes else detail
    took = time.perf_counter() - start
    run_fields = dict(status=status, detail=detail, example=example, examples=count, traceback=tb)
    if status == "failed" and ctx.target.last_call is not None:
        p, cot = ctx.target.last_call
        replay = problem_replay(p, cot, ctx.signature, target, ctx.devices is not None)
        run_fields.update(inputs=call_inputs(p, cot), problem_replay=replay)
    return {**run_fields, "seconds": took}


def _on_meshes(
    contexts: dict[int, Context],
    name: str,
    max_examples: int,
    seed: int,
    log: Callable[[str], None] | None,
) -> tuple[MeshResult, ...] | str:
    """Property ``name`` on each mesh size, or why it is skipped (the same at every size)."""
    out: list[MeshResult] = []
    for size, ctx in contexts.items():
        ctx.ratios.clear()
        ctx.calls.clear()
        run = _timed(ctx, "fn", _small, name, max_examples, seed)
        if isinstance(run, str):
            return run
        out.append(MeshResult(size, ratio=max(ctx.ratios, default=None), **run))
        if log is not None:
            log(f"{name} P={size}: {run['status']} ({run['seconds']:.1f} s)")
    return tuple(out)


def _combined(
    name: str, meshes: tuple[MeshResult, ...], seed: int, in_effect: tuple[str, ...]
) -> PropertyResult:
    """One result over every mesh size: the first failing size's, prefixed ``P=<size>: ``."""
    first = next((m for m in meshes if m.status == "failed"), None)
    examples, took = sum(m.examples for m in meshes), sum(m.seconds for m in meshes)
    result = PropertyResult(name, "passed", "", None, seed, examples, in_effect, None, took, meshes)
    if first is None:
        return result
    return dataclasses.replace(
        result,
        status="failed",
        detail=f"P={first.devices}: {first.detail}",
        example=first.example,
        traceback=first.traceback,
        inputs=first.inputs,
    )


def mesh_contexts(
    fn: Callable[..., Any], sizes: tuple[int, ...], **common: Any
) -> dict[int, Context]:
    """A distributed target's context per mesh size: one anchor (the one-device target), the
    same shapes at every size."""
    anchor = Target(fn, common["signature"], mesh(1))
    # head counts a head-parallel kernel splits on every size; lengths twice that (zigzag cuts
    # 2P chunks), divisible by every layout of every size
    heads = math.lcm(*sizes)
    return {
        size: Context(
            target=anchor if size == 1 else Target(fn, common["signature"], mesh(size)),
            devices=size,
            anchor=anchor,
            length_multiple=2 * heads,
            head_multiple=heads,
            **common,
        )
        for size in sizes
    }


def _check_distributed(fn: Any, signature: str, shapes: str) -> None:
    """``devices=`` needs the ``jax_nn`` signature, small shapes and a ``mesh`` keyword."""
    if signature != "jax_nn":
        raise OptionError(
            f"devices= needs signature 'jax_nn' (a distributed kernel takes jax.nn's arguments "
            f"plus mesh=), got {signature!r}",
            "devices",
            signature,
        )
    if shapes != "small":
        raise OptionError(
            "devices= runs the small shapes only (shapes='small'); the production sweep's "
            "lengths are not multiples of the device counts",
            "devices",
            shapes,
        )
    if takes_keyword(fn, "mesh") is False:
        raise TypeError(
            f"devices= checks a distributed kernel, called as fn(query, key, value, ..., "
            f"mesh=<jax.sharding.Mesh>); {describe_target(fn)} takes no mesh keyword"
        )


def _features(signature: str, features: Sequence[str] | None) -> tuple[str, ...]:
    """The features (``None``: the signature's default), checked, aliases expanded."""
    check_choice("signature", signature)
    feats = tuple(DEFAULT_FEATURES[signature] if features is None else features)
    check_features(feats)
    feats = expand_features(feats)
    check_expressible(signature, feats)
    return feats


def check_attention(
    fn: Callable[..., Any],
    *,
    signature: str = "jax_nn",
    features: Sequence[str] | None = None,
    max_examples: int | None = None,
    seed: int = 0,
    masked_rows: str = "zeros",
    causal_alignment: str = "top_left",
    dtypes: Sequence[str] = ("float32",),
    properties: Sequence[str] | None = None,
    progress: Callable[[int, int, str], None] | None = None,
    target: str | None = None,
    shapes: str = "small",
    log: Callable[[str], None] | None = None,
    devices: Sequence[int] | None = None,
    refuses_lengths: bool = False,
    head_dim: int | tuple[int, int] | None = None,
) -> ConformanceReport:
    """Run the conformance properties (package docstring) against ``fn``, each a Hypothesis test
    comparing ``fn`` with the float64 oracle.

    Args:
        fn: The attention function.
        signature: ``"jax_nn"``, ``"qkv_mask"``, ``"numpy"`` or ``"torch"`` (the adapters).
        features: What ``fn`` supports (:data:`FEATURES`, ``"seq_lengths"`` for both lengths;
            ``None``: ``DEFAULT_FEATURES[signature]``); a property needing an absent one skips.
        max_examples: Examples per property (``None``: 20); with production shapes, the first
            cases of each sweep (``None``: all).
        seed: The Hypothesis seed of every property.
        masked_rows: The kernel's output on fully masked rows (the oracle runs with it; the
            report lists it when not attnref's ``"zeros"``).
        causal_alignment: Its causal alignment when ``T != S``, likewise (``"top_left"``).
        dtypes: The input dtypes ``fn`` takes (default float32), e.g. ``("float32",
            "bfloat16")``: ``oracle`` (and ``ring_size_growth``) runs each, the others float32
            when requested, else the first (float64 inside ``jax.enable_x64``).
        properties: A subset of :data:`ALL_PROPERTIES` (default :data:`PROPERTIES`, plus
            :data:`DISTRIBUTED_PROPERTIES` with ``devices``), run in that order.
        progress: ``progress(done, total, name)`` after each property.
        target: The report's name for ``fn`` (default: its module and name).
        shapes: ``"small"`` (Hypothesis draws; default) or ``"production"`` (fixed sweeps at tile
            boundaries, :mod:`attnref._src.kit.conformance.production`).
        log: ``log(line)`` after each production case, and with ``devices`` after each property
            on each mesh size.
        devices: Mesh sizes of a distributed kernel, e.g. ``(1, 2, 4, 8)`` (package docstring);
            ``None``: a single-device function.
        refuses_lengths: ``fn`` refuses some lengths (package docstring; the production sweep
            skips a refused case). Not with ``devices``.
        head_dim: ``H = H_v`` or ``(H, H_v)`` of every example (package docstring; ``None``: 4
            at small shapes; 64, 128 and 256 at production shapes), e.g. a multiple of 8 for
            jax.nn's cuDNN path (docs/benchmarks.md), ``(192, 128)`` for MLA.

    Returns:
        The :class:`ConformanceReport`, one :class:`PropertyResult` per property.

    Raises:
        ValueError: An ``OptionError``, in this order: an unknown signature, feature, semantics
            or property; a feature the signature cannot express; no dtypes; ``max_examples <
            1``; ``head_dim`` not an int or a pair of ints in 1..1024; bad ``devices`` or more
            than the host has; ``devices`` with another signature than ``jax_nn``, with
            production shapes or with ``refuses_lengths``.
        TypeError: A dtype NumPy does not know, ``fn`` not callable, or (with ``devices``) a
            ``fn`` without a ``mesh`` keyword.
        ImportError: ``signature="torch"`` without PyTorch.
    """
    feats = _features(signature, features)
    if signature == "torch":
        require_torch()  # an ImportError saying how to install it
    check_choice("masked_rows", masked_rows)
    check_choice("causal_alignment", causal_alignment)
    default = PROPERTIES if devices is None else (*PROPERTIES, *DISTRIBUTED_PROPERTIES)
    names = check_properties(tuple(default if properties is None else properties))
    dts = check_dtypes(dtypes)
    if max_examples is not None:
        check_max_examples(max_examples)
    dims = None if head_dim is None else check_head_dim(head_dim)
    check_choice("shapes", shapes)
    sizes = None if devices is None else check_devices(devices)
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    if sizes is not None:
        _check_distributed(fn, signature, shapes)
        if refuses_lengths:
            raise OptionError(
                "refuses_lengths is for a single-device kernel; with devices= the "
                "uneven_lengths property judges refusals",
                "refuses_lengths",
                refuses_lengths,
            )

    semantics = {"masked_rows": masked_rows, "causal_alignment": causal_alignment}
    declared = {k: v for k, v in semantics.items() if v != DEFAULT_SEMANTICS[k]}
    common: dict[str, Any] = dict(
        signature=signature, features=frozenset(feats), dtypes=dts, head_dim=dims, **semantics
    )
    ctx = Context(target=Target(fn, signature, refuses_lengths=refuses_lengths), **common)
    contexts = {} if sizes is None else mesh_contexts(fn, sizes, **common)

    def run(name: str) -> PropertyResult | str:
        in_effect = tuple(f"{k}={declared[k]}" for k in DEPENDS[name] if k in declared)
        if contexts:
            meshes = _on_meshes(contexts, name, max_examples or 20, seed, log)
            return meshes if isinstance(meshes, str) else _combined(name, meshes, seed, in_effect)
        label = target or describe_target(fn)
        if shapes == "production":
            run = _timed(ctx, label, _production, name, max_examples, log)
        else:
            run = _timed(ctx, label, _small, name, max_examples or 20, seed)
        if isinstance(run, str):
            return run
        return PropertyResult(name, seed=seed, declared=in_effect, **run)

    results = run_suite(names, run, seed=seed, progress=progress)
    return ConformanceReport(
        target=target or describe_target(fn),
        signature=signature,
        features=feats,
        declared=declared,
        results=results,
        shapes=shapes,
        devices=sizes or (),
        options=changed(
            ("signature", signature, "jax_nn"),
            ("features", None if features is None else list(features), None),
            ("max_examples", max_examples, None),
            ("masked_rows", masked_rows, "zeros"),
            ("causal_alignment", causal_alignment, "top_left"),
            ("dtypes", list(dtypes), ["float32"]),
            ("shapes", shapes, "small"),
            ("devices", sizes, None),
            ("refuses_lengths", refuses_lengths, False),
            ("head_dim", _declared_dims(dims), None),
        ),
    )


def _declared_dims(dims: tuple[int, int] | None) -> int | list[int] | None:
    """The report's ``head_dim``: ``H`` where ``H_v = H``, else ``[H, H_v]``."""
    return None if dims is None else dims[0] if dims[0] == dims[1] else list(dims)


def production_plan(
    signature: str = "jax_nn", features: Sequence[str] | None = None
) -> dict[str, tuple[str, ...] | str]:
    """The cases ``check_attention(..., shapes="production")`` would run for this ``signature``
    and ``features``: ``{property: case labels, cheapest first, or why it is skipped}``. Raises
    ``ValueError`` (an ``OptionError``) as :func:`check_attention`."""
    feats = _features(signature, features)
    target = Target(lambda *a, **k: None, signature)
    ctx = Context(target, signature, frozenset(feats), "zeros", "top_left", ("float32",))
    plan = {name: production.cases(ctx, name) for name in PROPERTIES}
    return {n: c if isinstance(c, str) else tuple(str(x) for x in c) for n, c in plan.items()}
