"""The conformance kit's engine: each property plan run as a Hypothesis test (settings, the
runner that turns a failure into a report entry) and :func:`check_attention`, which validates its
options, runs the selected properties (on each mesh size, for a distributed target) and returns
the :class:`ConformanceReport`."""

from __future__ import annotations

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
    PROPERTIES,
    OptionError,
    check_choice,
    check_devices,
    check_dtypes,
    check_expressible,
    check_features,
    check_max_examples,
    check_properties,
    check_signature,
    expand_features,
    head_multiple,
    length_multiple,
)
from attnref._src.kit.conformance.plans import PLANS, TargetRaised, calls_detail
from attnref._src.kit.conformance.replay import call_inputs, problem_replay
from attnref._src.kit.conformance.report import ConformanceReport, MeshResult, PropertyResult
from attnref._src.kit.conformance.targets import Target, describe_target, mesh, takes_keyword
from attnref._src.kit.conformance.torch_target import require_torch


# A hypothesis.settings, typed as the test decorator it is used as: beartype (the suite's runtime
# checks) rejects the settings class as a hint (its metaclass's repr is inconsistent).
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
    for f in (
        *(os.path.join(_KIT_DIR, name) for name in os.listdir(_KIT_DIR) if name.endswith(".py")),
        closeness.__file__,
    )
)


def _is_comparison_failure(exc: BaseException) -> bool:
    """An ``AssertionError`` raised by the kit's own comparisons (this package or
    :mod:`attnref._src.kit.closeness`), as opposed to an exception from the target or its
    libraries."""
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


# How a failing example is headed in the report: Hypothesis shrinks the examples it generates;
# an explicit example (run first, whatever the seed) fails as it is.
SHRUNK = "shrunk example (Hypothesis's smallest failing draw):"
EXPLICIT = "explicit example (run first for every seed; not shrunk):"


def run_property(
    strategy: Any,
    check: Check,
    max_examples: int,
    seed: int,
    explicit: Sequence[Any] = (),
    sub_case: Callable[[], str | None] = lambda: None,
) -> tuple[str, str, str | None, int, str | None]:
    """Run ``check`` as a Hypothesis test; ``(status, detail, example, examples, traceback)``,
    the traceback only for an exception that is not one of the kit's comparisons. The
    ``explicit`` cases run first, in every Hypothesis version and for every seed; they count
    among the examples only when one fails. The example is headed :data:`SHRUNK` or
    :data:`EXPLICIT`, and its ``Case(...)`` line ends with the sub-case that failed
    (``sub_case()`` after the failing run: the mask kind, dtype or run a check was at)."""
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
    plan: Callable[[str], tuple[Any, ...] | str],
    *,
    seed: int,
    max_examples: int,
    progress: Callable[[int, int, str], None] | None = None,
    in_effect: Callable[[str], tuple[str, ...]] = lambda name: (),
) -> tuple[PropertyResult, ...]:
    """Each property ``name`` run by :func:`run_property` over ``plan(name)``, ``(strategy,
    check[, explicit cases])`` or a skip reason; ``progress`` after each."""
    results: list[PropertyResult] = []
    for done, name in enumerate(names, start=1):
        start = time.perf_counter()
        planned = plan(name)
        if isinstance(planned, str):
            results.append(PropertyResult(name, "skipped", planned, None, seed, 0))
        else:
            strategy, check, *explicit = planned
            run = run_property(strategy, check, max_examples, seed, *explicit)
            status, detail, example, count, tb = run
            took = time.perf_counter() - start
            results.append(
                PropertyResult(
                    name, status, detail, example, seed, count, in_effect(name), tb, took
                )
            )
        if progress is not None:
            progress(done, len(names), name)
    return tuple(results)


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
    """``text`` with ``  # failed at: <sub_case>`` after the first line that shows the drawn
    case (``case=Case(...)`` or ``p=KernelProblem(...)``), which stays valid Python."""
    if not sub_case:
        return text
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if re.match(r"\s*(case|p)=", line):
            lines[i] = f"{line}  # failed at: {sub_case}"
            return "\n".join(lines)
    return f"{text}\nfailed at: {sub_case}"


def _failure(exc: BaseException) -> tuple[str, str | None]:
    """``(message, traceback)``: the traceback only for an exception that is not one of the
    kit's comparisons (for a :class:`TargetRaised`, its cause's: the target's exception)."""
    message = str(exc).strip() or type(exc).__name__
    if isinstance(exc, TargetRaised) and exc.__cause__ is not None:
        return message, _format_traceback(exc.__cause__)
    if _is_comparison_failure(exc):
        return message, None
    return f"{type(exc).__name__}: {message}", _format_traceback(exc)


def _production(
    ctx: Context, name: str, max_examples: int | None, log: Callable[[str], None] | None
) -> tuple[str, str, str | None, int, str | None] | str:
    """Property ``name`` over the first ``max_examples`` cases of its production sweep, in
    order, stopping at the first failure (``(status, detail, example, examples, traceback)`` as
    :func:`run_property`), or why it is skipped."""
    cases = production.cases(ctx, name)
    if isinstance(cases, str):
        return cases
    cases, check = cases[:max_examples], production.check(ctx, name)
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


_Run = tuple[str, str, str | None, int, str | None]


def _small(ctx: Context, name: str, max_examples: int, seed: int) -> _Run | str:
    """Property ``name`` as a Hypothesis test over the small buckets, or why it is skipped."""
    plan = PLANS[name](ctx)
    if isinstance(plan, str):
        return plan
    strategy, check, *explicit = plan

    def tracked(case: Any) -> None:
        ctx.sub_case = None
        check(case)

    first = explicit[0] if explicit else ()
    return run_property(strategy, tracked, max_examples, seed, first, sub_case=lambda: ctx.sub_case)


def _timed(ctx: Context, run: Callable[..., _Run | str], *args: Any) -> tuple[_Run, float] | str:
    """``run(ctx, *args)`` with the target's new notes joined to its detail, and its time;
    ``ctx.failing`` the target's last call where it failed."""
    start = time.perf_counter()
    before, refused = len(ctx.target.notes), len(ctx.target.refusals)
    ctx.target.last_call = ctx.failing = None
    out = run(ctx, *args)
    if isinstance(out, str):
        return out
    status, detail, example, count, tb = out
    if status == "failed":
        ctx.failing = ctx.target.last_call
    notes = ctx.target.notes[before:]
    if refusals := ctx.target.refusals[refused:]:
        notes.append(
            f"{len(refusals)} call(s) refused, as declared (refuses_lengths), examples drawn "
            f"again; first: {refusals[0]}"
        )
    if status == "passed" and ctx.calls:
        detail = calls_detail(ctx.calls)
    detail = "; ".join([detail, *notes] if detail else notes) if notes else detail
    return (status, detail, example, count, tb), time.perf_counter() - start


def _on_meshes(
    contexts: dict[int, Context],
    name: str,
    max_examples: int,
    seed: int,
    log: Callable[[str], None] | None,
) -> tuple[MeshResult, ...] | str:
    """Property ``name`` on each mesh size (ascending; ``log`` gets a line after each), or why
    it is skipped (the same at every size: a plan's reason depends on the features only). A
    passing size whose plan tallied its calls (``uneven_lengths``) has the tally as its detail."""
    out: list[MeshResult] = []
    for size, ctx in contexts.items():
        ctx.ratios.clear()
        ctx.calls.clear()
        timed = _timed(ctx, _small, name, max_examples, seed)
        if isinstance(timed, str):
            return timed
        run, took = timed
        ratio = max(ctx.ratios) if ctx.ratios else None
        out.append(MeshResult(size, *run, took, ratio, *_failing(ctx, True)))
        if log is not None:
            log(f"{name} P={size}: {run[0]} ({took:.1f} s)")
    return tuple(out)


def _combined(
    name: str, meshes: tuple[MeshResult, ...], seed: int, in_effect: tuple[str, ...]
) -> PropertyResult:
    """One property's result over every mesh size: failed where any size failed (its message,
    example and traceback those of the first such size, the message prefixed ``P=<size>: ``)."""
    first = next((m for m in meshes if m.status == "failed"), None)
    return PropertyResult(
        name,
        "passed" if first is None else "failed",
        "" if first is None else f"P={first.devices}: {first.detail}",
        None if first is None else first.example,
        seed,
        sum(m.examples for m in meshes),
        in_effect,
        None if first is None else first.traceback,
        sum(m.seconds for m in meshes),
        meshes,
        None if first is None else first.inputs,
        None,
    )


def _failing(
    ctx: Context, distributed: bool, target: str = "fn"
) -> tuple[dict[str, Any] | None, str | None]:
    """``(inputs, problem_replay)`` of the failing call recorded in ``ctx.failing``
    (:mod:`attnref._src.kit.conformance.replay`), or ``(None, None)``."""
    if ctx.failing is None:
        return None, None
    p, cot = ctx.failing
    replay = problem_replay(p, cot, ctx.signature, target, distributed)
    return call_inputs(p, cot), replay


def mesh_contexts(
    fn: Callable[..., Any], sizes: tuple[int, ...], **common: Any
) -> dict[int, Context]:
    """A distributed target's contexts, one per mesh size: they share the one-device target
    (the growth rule's anchor), lengths that every layout of every size divides and head counts
    that every size divides (the same shapes at every size)."""
    anchor = Target(fn, common["signature"], mesh(1))
    multiple = length_multiple(sizes)
    heads = head_multiple(sizes)
    return {
        size: Context(
            target=anchor if size == 1 else Target(fn, common["signature"], mesh(size)),
            devices=size,
            anchor=anchor,
            length_multiple=multiple,
            head_multiple=heads,
            **common,
        )
        for size in sizes
    }


def _check_distributed(fn: Any, signature: str, shapes: str) -> None:
    """What a distributed target (``devices=``) needs: the ``jax_nn`` signature, the small
    shapes, and a ``mesh`` keyword."""
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
    """The target's features (``None``: the signature's default), checked, aliases expanded."""
    check_signature(signature)
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
) -> ConformanceReport:
    """Run the conformance properties (package docstring) against ``fn``: each is a Hypothesis
    test whose examples compare ``fn`` with the float64 oracle.

    Args:
        fn: The attention function.
        signature: How to call ``fn``: ``"jax_nn"``, ``"qkv_mask"``, ``"numpy"`` or
            ``"torch"`` (the adapters, package docstring).
        features: What ``fn`` supports (:data:`FEATURES`; ``None`` = ``DEFAULT_FEATURES
            [signature]``); a property needing an absent feature is skipped with the reason.
            ``"seq_lengths"`` stands for both ``"query_seq_lengths"`` and
            ``"key_value_seq_lengths"`` (jax.nn's two length arguments, declared apart).
        max_examples: Hypothesis examples per property (``None``: 20); with
            ``shapes="production"``, the first cases of each property's sweep (``None``: all).
        seed: The Hypothesis seed of every property (a failure replays with it).
        masked_rows: The kernel's declared output on fully masked rows; the oracle is run with
            it, and the report lists it when it differs from attnref's default (``"zeros"``).
        causal_alignment: The kernel's declared causal alignment when ``T != S``, likewise
            (attnref's default: ``"top_left"``).
        dtypes: The input dtypes ``fn`` takes (default float32 alone). The oracle property
            (and with ``devices`` ``ring_size_growth``) runs each, the others float32 when
            requested, else the first (float64 inside ``jax.enable_x64``). A kernel that takes
            16-bit inputs declares it here, e.g. ``("float32", "bfloat16")``: its merge of
            partial states must then accumulate in float32, else the error grows with the ring.
        properties: A subset of :data:`ALL_PROPERTIES` (default: :data:`PROPERTIES`, and
            with ``devices`` the :data:`DISTRIBUTED_PROPERTIES`), run in that order.
        progress: ``progress(done, total, name)`` after each property.
        target: The name shown in the report (default: ``fn``'s module and name).
        shapes: ``"small"`` (default: Hypothesis draws over a few small buckets and, for a
            single-device ``fn``, in one example in four over the tile-straddling lengths
            :data:`attnref.strategies.TILE_LENGTHS`) or ``"production"``: fixed sweeps at tile
            boundaries against the fast float64 oracle
            (:mod:`attnref._src.kit.conformance.production`).
        log: ``log(line)`` after each production case (its sizes and time), and with
            ``devices`` after each property on each mesh size.
        devices: Check a distributed kernel on meshes of these sizes, e.g. ``(1, 2, 4, 8)``
            (package docstring): ``fn`` also takes ``mesh=`` (and ``axis_name=``), ``q, k, v``
            come sharded along the sequence axis, every length is a multiple of
            ``2 lcm(devices)`` (but in ``uneven_lengths``) and every K/V head count of
            ``lcm(devices)``. Each property runs on each size (a :class:`MeshResult` each).
            ``None`` (default): a single-device function.

    Returns:
        The :class:`ConformanceReport`, one :class:`PropertyResult` per property.

    Raises:
        ValueError: An unknown signature, feature, semantics or property; a feature the
            signature cannot express; no dtypes; ``max_examples < 1``; bad ``devices`` or more
            than the host has; ``devices`` with another signature than ``jax_nn`` or with
            production shapes (an ``OptionError``, checked in that order).
        TypeError: A dtype NumPy does not know, ``fn`` not callable, or (with ``devices``) a
            ``fn`` that takes no ``mesh`` keyword.
        ImportError: ``signature="torch"`` where PyTorch is not installed.

    ``refuses_lengths`` declares a limit: ``fn`` refuses some sequence lengths (a blocked kernel
    whose block size must divide them, such as Pallas' flash attention). A call that raises a
    clear refusal (an exception of :data:`.targets.REFUSAL_TYPES` whose message has one of
    :data:`.targets.REFUSAL_WORDS`) is then not a failure: the example is drawn again (the
    production sweep skips the case), and the property's detail counts the refused calls and
    gives the first. Any other exception still fails. Not with ``devices`` (whose
    ``uneven_lengths`` property has its own refusal rule).
    """
    feats = _features(signature, features)
    if signature == "torch":
        require_torch()  # an ImportError saying how to install it
    check_choice("masked_rows", masked_rows)
    check_choice("causal_alignment", causal_alignment)
    default = PROPERTIES if devices is None else (*PROPERTIES, *DISTRIBUTED_PROPERTIES)
    names = tuple(default if properties is None else properties)
    names = check_properties(names)
    dts = check_dtypes(dtypes)
    if max_examples is not None:
        check_max_examples(max_examples)
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
        signature=signature,
        features=frozenset(feats),
        masked_rows=masked_rows,
        causal_alignment=causal_alignment,
        dtypes=dts,
    )
    ctx = Context(target=Target(fn, signature, refuses_lengths=refuses_lengths), **common)
    contexts = {} if sizes is None else mesh_contexts(fn, sizes, **common)
    results: list[PropertyResult] = []
    for done, name in enumerate(names, start=1):
        in_effect = tuple(f"{k}={declared[k]}" for k in DEPENDS[name] if k in declared)
        if contexts:
            meshes = _on_meshes(contexts, name, max_examples or 20, seed, log)
            if isinstance(meshes, str):
                results.append(PropertyResult(name, "skipped", meshes, None, seed, 0))
            else:
                results.append(_combined(name, meshes, seed, in_effect))
        else:
            timed = (
                _timed(ctx, _production, name, max_examples, log)
                if shapes == "production"
                else _timed(ctx, _small, name, max_examples or 20, seed)
            )
            if isinstance(timed, str):
                results.append(PropertyResult(name, "skipped", timed, None, seed, 0))
            else:
                (status, detail, example, count, tb), took = timed
                inputs, replay = _failing(ctx, False, target or describe_target(fn))
                results.append(
                    PropertyResult(
                        name,
                        status,
                        detail,
                        example,
                        seed,
                        count,
                        in_effect,
                        tb,
                        took,
                        inputs=inputs,
                        problem_replay=replay,
                    )
                )
        if progress is not None:
            progress(done, len(names), name)
    return ConformanceReport(
        target=target or describe_target(fn),
        signature=signature,
        features=feats,
        declared=declared,
        results=tuple(results),
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
        ),
    )


def production_plan(
    signature: str = "jax_nn", features: Sequence[str] | None = None
) -> dict[str, tuple[str, ...] | str]:
    """The cases ``check_attention(..., shapes="production")`` runs for a target of this
    ``signature`` and these ``features`` (``None``: the signature's default), without running
    any: ``{property: the cases' one-line labels, cheapest first, or why it is skipped}`` in
    ``PROPERTIES`` order. Raises ``ValueError`` (an ``OptionError``) for an unknown signature
    or feature, or one the signature cannot express."""
    feats = _features(signature, features)
    ctx = Context(
        target=Target(lambda *a, **k: None, signature),
        signature=signature,
        features=frozenset(feats),
        masked_rows="zeros",
        causal_alignment="top_left",
        dtypes=("float32",),
    )
    plan = {name: production.cases(ctx, name) for name in PROPERTIES}
    return {n: c if isinstance(c, str) else tuple(str(x) for x in c) for n, c in plan.items()}
