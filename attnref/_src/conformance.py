"""The conformance kit: run attnref's properties against anyone's attention function.

:func:`check_attention` draws problems with :mod:`attnref.strategies`, calls the user's function
through an adapter, compares with the float64 oracle :func:`attnref.oracle.dot_product_attention`
and returns a :class:`ConformanceReport`. Each property is a Hypothesis test run programmatically
(``max_examples`` examples, ``hypothesis.seed(seed)``, no example database), so a failure comes
back with Hypothesis's shrunk falsifying example and the seed that replays it:
``check_attention(fn, properties=[name], seed=result.seed, ...)`` with the same other arguments.

Properties (each equality with the oracle uses the tolerance rules of
:func:`attnref.testing.assert_attention_close`):

``oracle``
    On problems without mask options, the output equals the oracle within
    :func:`attnref.tolerance.kernel_error_bound` (``key_blocks=None``: valid for any tiling of the
    keys), for each requested dtype. 16-bit dtypes use FlashAttention's comparative rule
    (``"flash"``) instead, with :func:`attnref.dot_product_attention` computed in that dtype as the
    same-precision reference: a 16-bit kernel's output is rounded to 16 bits, and the comparative
    rule is how kernel projects judge that rounding. Inputs include the "identical rows" special
    case (every key, or every query, equal), drawn on purpose.
``masks``
    Every supported mask option (boolean ``mask``, ``bias`` including ALiBi and ``-inf`` entries,
    ``is_causal`` with ``T != S`` when ``"cross"`` is supported, sequence lengths, a local window,
    segment ids, softcap, and all of causal + lengths + mask + bias together) equals the oracle run
    with the declared ``causal_alignment`` and ``masked_rows``. Every example checks every option,
    and draws the shape of its boolean mask and of its ``-inf`` bias from all 16 that broadcast
    to ``[B, N, T, S]`` (:data:`attnref.strategies.BROADCAST_SHAPES`; ``[B, 1, 1, S]`` is the
    key-padding mask).
``causality`` (needs ``"causal"``)
    Appending future tokens (with keys scaled up to 1000x, so that a max taken over future keys
    would underflow the past) leaves earlier outputs unchanged within the sum of the two runs'
    derived bounds, and both runs equal the oracle; with ``"grad"``, the gradient of output row
    ``t`` with respect to ``q``, ``k`` and ``v`` at every position after ``t`` is exactly zero.
``gqa`` (needs ``"gqa"``)
    ``N = 2K`` and ``N = 4K`` problems equal the oracle; query head ``n`` reads K/V head
    ``n // (N / K)`` (consecutive groups, as in GQA and MQA).
``lse`` (needs ``"lse"``)
    The returned log-sum-exp ``[B, T, N]`` equals the oracle's within its derived bound (rows
    with an allowed key; a fully masked row's lse is not compared, since jax.nn returns a large
    finite negative where attnref returns ``-inf``).
``batch_independence``
    Each batch element run alone (every per-example option sliced with it) equals its slice of the
    batched run within twice the derived bound, with NaN in the same places, and both runs equal
    the oracle (an all-NaN kernel is batch-independent, and wrong).
``fully_masked_rows`` (needs ``"mask"`` or ``"seq_lengths"``)
    A query row with no allowed key returns the declared ``masked_rows`` meaning (``"zeros"``,
    ``"uniform"``: the mean of every ``v`` row, ``"nan"``), and no other row is NaN.
``gradients`` (needs ``"grad"``)
    The float32 gradients with respect to ``q``, ``k``, ``v`` (for a random output cotangent) meet
    FlashAttention's comparative rule against the float64 gradients of
    :func:`attnref.dot_product_attention`, with attnref's own float32 gradients as the
    same-precision reference: ``max|g - g64| <= 2 max|g32 - g64| + gamma_{N_b}(u32) max|g64|``,
    ``N_b = T G + S + H + H_v + 2`` the longest reduction of the backward pass (as in
    ``tests/test_blockwise.py``).
``extreme_logits``
    With ``q`` and ``k`` scaled so that ``max |logit|`` is ``1e2``, ``1e3`` or ``1e4`` in float32,
    the output is finite and equals the oracle within the derived bound.

Every property first checks that ``fn`` returned an output ``[B, T, N, H_v]`` (and, when the lse
is asked for, a pair whose lse is an array ``[B, T, N]``), and fails with both shapes otherwise.
A failure that is an exception rather than a failed comparison (``fn`` raised) carries its
traceback (:attr:`PropertyResult.traceback`).

Adapters (``signature``):

``"jax_nn"``
    ``fn(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
    query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None)`` with the
    layout of :func:`jax.nn.dot_product_attention`; an option keyword is passed only when used.
    The lse is requested with ``return_residual=True`` (jax.nn) or ``return_lse=True`` (attnref),
    whichever ``fn`` accepts; ``"segment_ids"`` and ``"softcap"`` are passed as attnref's keywords.
    ``fn`` is wrapped in ``jax.jit`` (per static option set, so compilations are reused across
    examples); if tracing fails, it runs eagerly and the results say so.
``"qkv_mask"``
    ``fn(q, k, v, mask)`` with ``mask [B, N, T, S]`` boolean (``True`` = may attend); causality,
    windows, lengths and segments are expressed through the mask, and the oracle is run with that
    mask alone (so a padded query row is a fully masked row).
``"numpy"``
    The ``"jax_nn"`` calling convention with NumPy arrays in and out; no jit, no gradients.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import inspect
import math
import os
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import hypothesis
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, Phase, given, note, settings
from hypothesis import strategies as st
from hypothesis.reporting import with_reporter

from attnref import strategies as ast
from attnref import testing as _attnref_testing
from attnref._src.checks import enable_x64
from attnref._src.kernel import dot_product_attention as _attnref_dpa
from attnref.testing import assert_attention_close
from attnref.tolerance import gamma, unit_roundoff

__all__ = [
    "DEFAULT_FEATURES",
    "FEATURES",
    "PROPERTIES",
    "SIGNATURES",
    "ConformanceReport",
    "PropertyResult",
    "check_attention",
    "load_target",
]

PROPERTIES = (
    "oracle",
    "masks",
    "causality",
    "gqa",
    "lse",
    "batch_independence",
    "fully_masked_rows",
    "gradients",
    "extreme_logits",
)
SIGNATURES = ("jax_nn", "qkv_mask", "numpy")
FEATURES = (
    "mask",
    "bias",
    "causal",
    "seq_lengths",
    "window",
    "gqa",
    "cross",
    "lse",
    "grad",
    "segment_ids",
    "softcap",
)
DEFAULT_FEATURES: dict[str, tuple[str, ...]] = {
    # what jax.nn.dot_product_attention supports
    "jax_nn": ("mask", "bias", "causal", "seq_lengths", "window", "gqa", "cross", "lse", "grad"),
    # everything a boolean mask can express, differentiable
    "qkv_mask": ("mask", "causal", "seq_lengths", "window", "cross", "grad", "segment_ids"),
    # jax.nn's options, NumPy in and out, no gradients
    "numpy": ("mask", "bias", "causal", "seq_lengths", "window", "gqa", "cross", "lse"),
}
_UNSUPPORTED: dict[str, tuple[str, ...]] = {
    "jax_nn": (),
    "qkv_mask": ("bias", "softcap", "lse"),
    "numpy": ("grad",),
}
_DEFAULT_SEMANTICS = {"masked_rows": "zeros", "causal_alignment": "top_left"}
_MASKED_ROWS = ("zeros", "uniform", "nan")
_ALIGNMENTS = ("top_left", "bottom_right")
# Which declared semantics can change each property's outcome (for PropertyResult.declared).
_DEPENDS: dict[str, tuple[str, ...]] = {
    "oracle": (),
    "masks": ("masked_rows", "causal_alignment"),
    "causality": ("causal_alignment",),
    "gqa": (),
    "lse": ("causal_alignment",),
    "batch_independence": ("masked_rows", "causal_alignment"),
    "fully_masked_rows": ("masked_rows",),
    "gradients": ("causal_alignment",),
    "extreme_logits": ("causal_alignment",),
}
_STATIC = ("scale", "is_causal", "local_window_size", "softcap")
_ARRAYS = ("bias", "mask", "query_seq_lengths", "key_value_seq_lengths", "segment_ids")
# The kinds of the masks property whose mask or bias takes the example's drawn broadcast shape:
# a boolean mask (every row keeps a key) and a bias with -inf entries (every row keeps a finite
# one, so it is also the finite bias's broadcast check).
_DRAWN_SHAPES: dict[str, tuple[str, ...]] = {
    "random": ("mask_shape",),
    "neg_inf_bias": ("bias_shape",),
}
_MASK_PROPERTY_KINDS = tuple(k for k in ast.MASK_KINDS if k not in ("none", "fully_masked_row"))


# ----------------------------------------------------------------------------- report


@dataclasses.dataclass(frozen=True)
class PropertyResult:
    """The outcome of one property.

    ``status`` is ``"passed"``, ``"failed"`` or ``"skipped"``; ``detail`` the skip reason or the
    failure message (rule, index, ratio); ``example`` Hypothesis's shrunk falsifying example and
    notes; ``seed`` replays it with ``check_attention(fn, properties=[name], seed=seed, ...)``;
    ``examples`` the examples run (up to and including the first failing one); ``declared`` the
    declared differences from attnref's semantics in effect, e.g. ``("masked_rows=uniform",)``;
    ``traceback`` where the failure is an exception rather than a failed comparison (the
    target raised, or returned something the kit could not use): where it was raised, with
    Hypothesis's own frames left out.
    """

    name: str
    status: str
    detail: str
    example: str | None
    seed: int
    examples: int
    declared: tuple[str, ...] = ()
    traceback: str | None = None


@dataclasses.dataclass(frozen=True)
class ConformanceReport:
    """Every property's :class:`PropertyResult` for one target, with the features checked and the
    declared semantics that differ from attnref's defaults (``masked_rows="zeros"``,
    ``causal_alignment="top_left"``)."""

    target: str
    signature: str
    features: tuple[str, ...]
    declared: dict[str, str]
    results: tuple[PropertyResult, ...]

    @property
    def passed(self) -> bool:
        """True iff no property failed (skipped properties do not fail a report)."""
        return all(r.status != "failed" for r in self.results)

    def summary(self) -> str:
        """A readable table (property, status, examples, detail), the declared differences, and
        each failure's shrunk example with the seed that replays it."""
        rows = [("property", "status", "examples", "detail")]
        for r in self.results:
            first = r.detail.strip().splitlines()[0] if r.detail.strip() else ""
            if len(first) > 90:
                first = first[:87] + "..."
            rows.append((r.name, r.status, str(r.examples), first))
        widths = [max(len(row[i]) for row in rows) for i in range(3)]
        lines = [
            f"attnref conformance: {self.target} (signature {self.signature!r})",
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
                "  ".join(c.ljust(w) for c, w in zip(row[:3], widths, strict=True)) + "  " + row[3]
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
            lines.append(
                f"replay: check_attention(fn, properties=[{r.name!r}], seed={r.seed}, "
                f"max_examples=..., ...)"
            )
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict of the report (``passed`` included)."""
        return {
            "target": self.target,
            "signature": self.signature,
            "features": list(self.features),
            "declared": dict(self.declared),
            "passed": self.passed,
            "results": [
                {**dataclasses.asdict(r), "declared": list(r.declared)} for r in self.results
            ],
        }


# ----------------------------------------------------------------------------- targets


def load_target(spec: str) -> Callable[..., Any]:
    """Import ``"package.module:function"`` or ``"package.module:object.attribute"``."""
    if not isinstance(spec, str) or spec.count(":") != 1:
        raise ValueError(f"target must look like 'package.module:function' (one ':'), got {spec!r}")
    module_name, attr_path = spec.split(":")
    if not module_name or not attr_path:
        raise ValueError(f"target must look like 'package.module:function', got {spec!r}")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ImportError(
            f"cannot import module {module_name!r} of target {spec!r}: {exc}"
        ) from exc
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            raise AttributeError(
                f"target {spec!r}: {type(obj).__name__} {getattr(obj, '__name__', obj)!r} has "
                f"no attribute {part!r}"
            ) from exc
    if not callable(obj):
        raise TypeError(f"target {spec!r} is a {type(obj).__name__}, not a callable")
    return obj  # type: ignore[no-any-return]


def _describe_target(fn: Any) -> str:
    if isinstance(fn, functools.partial):
        kw = ", ".join(f"{k}={v!r}" for k, v in fn.keywords.items())
        return f"functools.partial({_describe_target(fn.func)}{', ' if kw else ''}{kw})"
    module = getattr(fn, "__module__", None)
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    if module and name:
        return f"{module}:{name}"
    return repr(fn)


def _lse_keyword(fn: Any) -> str:
    """The keyword that asks ``fn`` for the lse: ``return_residual`` (jax.nn) or ``return_lse``
    (attnref), whichever ``fn`` names; for ``fn(..., **kw)`` naming neither, ``return_residual``."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return "return_residual"
    return next((kw for kw in ("return_residual", "return_lse") if kw in params), "return_residual")


class _ShapeError(Exception):
    """Raised while tracing the target's vjp when its output has the wrong shape."""


# jitted callables shared across check_attention calls: (fn, signature, kind, static) -> jitted
_JIT_CACHE: dict[tuple[Any, ...], Callable[..., Any]] = {}
_JIT_CACHE_MAX = 512


def _split_options(options: dict[str, Any]) -> tuple[tuple[tuple[str, Any], ...], dict[str, Any]]:
    static = tuple(sorted((k, options[k]) for k in _STATIC if k in options))
    arrays = {k: options[k] for k in _ARRAYS if k in options}
    unknown = set(options) - set(_STATIC) - set(_ARRAYS)
    if unknown:
        raise ValueError(f"unknown kernel options {sorted(unknown)}")
    return static, arrays


def _first(result: Any) -> Any:
    return result[0] if isinstance(result, (tuple, list)) else result


def _checked_array(value: Any, shape: tuple[int, ...], what: str) -> np.ndarray:
    """``value`` as a NumPy array, or an ``AssertionError`` naming ``what``, the expected shape
    and what came back (``None``, a non-numeric object, another shape)."""
    if value is None:
        raise AssertionError(f"fn returned None for its {what}; expected an array of shape {shape}")
    try:
        arr = np.asarray(value)
    except Exception as exc:  # e.g. a ragged nest of lists
        raise AssertionError(
            f"fn returned {type(value).__name__} for its {what}, which is not an array "
            f"({type(exc).__name__}: {exc}); expected shape {shape}"
        ) from exc
    if arr.dtype.kind in "bOSUmM":  # bool, object (e.g. a tuple holding None), text, time
        raise AssertionError(
            f"fn returned a {arr.dtype} array for its {what}; expected a floating-point array "
            f"of shape {shape}"
        )
    if arr.shape != shape:
        raise AssertionError(f"fn returned its {what} with shape {arr.shape}; expected {shape}")
    return arr


class _Target:
    """Calls the user's function through its adapter, jitted where the signature is JAX's."""

    def __init__(self, fn: Callable[..., Any], signature: str) -> None:
        self.fn = fn
        self.signature = signature
        self._eager: set[tuple[Any, ...]] = set()  # (kind, static, lse, dtype) that failed jit
        self.notes: list[str] = []
        self.lse_keyword = _lse_keyword(fn)

    # the raw call: (q, k, v, arrays) -> whatever fn returns
    def _raw(self, static: tuple[tuple[str, Any], ...], want_lse: bool) -> Callable[..., Any]:
        fn, signature, lse_kw = self.fn, self.signature, self.lse_keyword

        def call(q: Any, k: Any, v: Any, arrays: dict[str, Any]) -> Any:
            if signature == "qkv_mask":
                return fn(q, k, v, arrays["mask"])
            kw = dict(arrays)
            kw.update(static)
            if want_lse:
                kw[lse_kw] = True
            return fn(q, k, v, **kw)

        return call

    def _jitted(self, key: tuple[Any, ...], fn: Callable[..., Any]) -> Any:
        full = (self.fn, self.signature, *key)
        try:
            hit = _JIT_CACHE.get(full)
        except TypeError:  # an unhashable fn: no sharing across calls
            return jax.jit(fn)
        if hit is None:
            if len(_JIT_CACHE) >= _JIT_CACHE_MAX:
                _JIT_CACHE.clear()
            hit = _JIT_CACHE[full] = jax.jit(fn)
        return hit

    def _invoke(
        self, key: tuple[Any, ...], fn: Callable[..., Any], args: tuple[Any, ...], dtype: Any
    ) -> Any:
        """``fn(*args)`` jitted (one jitted callable per ``key``, reused across examples and
        calls), or eagerly for NumPy targets and where jitting failed for this ``key`` and dtype.
        NumPy arrays go to the jitted callable as they are (converting them first would compile
        a staging program per shape); an eager JAX call gets jax arrays. float64 runs inside
        ``jax.enable_x64``."""
        with enable_x64() if np.dtype(dtype) == np.float64 else contextlib.nullcontext():
            eager_key = (*key, str(np.dtype(dtype)))
            if self.signature != "numpy" and eager_key not in self._eager:
                try:
                    return self._jitted(key, fn)(*args)
                except Exception as exc:
                    out = fn(*self._eager_args(args))  # raises if fn itself is broken
                    self._eager.add(eager_key)
                    first = (str(exc).splitlines() or [""])[0][:100]
                    self.notes.append(
                        f"jax.jit(fn) failed for {np.dtype(dtype)} ({type(exc).__name__}: "
                        f"{first}); ran eagerly"
                    )
                    return out
            return fn(*self._eager_args(args))

    def _eager_args(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        if self.signature == "numpy":
            return args
        return tuple(jax.tree_util.tree_map(jnp.asarray, a) for a in args)

    def forward(self, p: ast.KernelProblem, want_lse: bool = False) -> tuple[np.ndarray, Any]:
        """``(out, lse or None)`` as NumPy arrays, each checked to be a numeric array of the
        expected shape (``out [B, T, N, H_v]``, ``lse [B, T, N]``) before any comparison."""
        static, arrays = _split_options(p.options)
        raw = self._raw(static, want_lse)
        result = self._invoke(("forward", static, want_lse), raw, (p.q, p.k, p.v, arrays), p.dtype)
        c = p.config
        if want_lse:
            if not isinstance(result, (tuple, list)) or len(result) != 2:
                raise AssertionError(
                    f"asked for the lse ({self.lse_keyword}=True) but fn returned "
                    f"{type(result).__name__}, not a pair (out, lse)"
                )
            out = _checked_array(result[0], (c.batch, c.t, c.n, c.h_v), "output [B, T, N, H_v]")
            lse = _checked_array(
                result[1], (c.batch, c.t, c.n), f"lse [B, T, N] ({self.lse_keyword}=True)"
            )
            return out, lse
        return _checked_array(
            _first(result), (c.batch, c.t, c.n, c.h_v), "output [B, T, N, H_v]"
        ), None

    def vjp(self, p: ast.KernelProblem, cotangent: np.ndarray) -> tuple[np.ndarray, ...]:
        """Gradients of ``<fn(q, k, v), cotangent>`` with respect to ``q, k, v``."""
        static, arrays = _split_options(p.options)
        raw = self._raw(static, False)

        def grads(q: Any, k: Any, v: Any, arrays: dict[str, Any], cot: Any) -> Any:
            out, pull = jax.vjp(lambda a, b, c: _first(raw(a, b, c, arrays)), q, k, v)
            if tuple(out.shape) != tuple(cot.shape):
                raise _ShapeError(
                    f"fn returned its output [B, T, N, H_v] with shape {tuple(out.shape)}; "
                    f"expected {tuple(cot.shape)}"
                )
            return pull(cot.astype(out.dtype))

        try:
            result = self._invoke(
                ("vjp", static, False), grads, (p.q, p.k, p.v, arrays, cotangent), p.dtype
            )
        except _ShapeError as exc:
            raise AssertionError(str(exc)) from None
        return tuple(
            _checked_array(g, np.shape(x), f"gradient d/d{name}")
            for name, g, x in zip("qkv", result, (p.q, p.k, p.v), strict=True)
        )


# ----------------------------------------------------------------------------- attnref itself

_REF_STATIC = (
    "scale",
    "is_causal",
    "local_window_size",
    "softcap",
    "causal_alignment",
    "masked_rows",
    "return_lse",
)
_REF = jax.jit(_attnref_dpa, static_argnames=_REF_STATIC)


def _ref_call(p: ast.KernelProblem) -> Callable[..., Any]:
    static, _ = _split_options(p.options)
    kw = dict(static, **p.semantics())

    def call(q: Any, k: Any, v: Any, arrays: dict[str, Any]) -> Any:
        return _REF(q, k, v, **arrays, **kw)

    return call


def _ref_forward(p: ast.KernelProblem) -> np.ndarray:
    """attnref's output in the problem's dtype (the same-precision reference)."""
    _, arrays = _split_options(p.options)
    return np.asarray(_ref_call(p)(p.q, p.k, p.v, arrays))


@functools.lru_cache(maxsize=64)
def _ref_vjp_jit(static: tuple[tuple[str, Any], ...]) -> Callable[..., Any]:
    kw = dict(static)

    def grads(q: Any, k: Any, v: Any, arrays: dict[str, Any], cot: Any) -> Any:
        out, pull = jax.vjp(lambda a, b, c: _attnref_dpa(a, b, c, **arrays, **kw), q, k, v)
        return pull(cot.astype(out.dtype))

    return jax.jit(grads)


def _ref_vjp(p: ast.KernelProblem, cotangent: np.ndarray) -> tuple[np.ndarray, ...]:
    if "query_seq_lengths" not in p.options:
        # the structural options as one full mask: one compiled program serves every kind
        keep = {k: v for k, v in p.options.items() if k in ("bias", "softcap", "scale")}
        p = p.replace(options={"mask": p.allowed(), **keep})
    static, arrays = _split_options(p.options)
    key = tuple(sorted({**dict(static), **p.semantics()}.items()))
    fn = _ref_vjp_jit(key)
    if p.dtype == np.float64:
        with enable_x64():
            out = fn(p.q, p.k, p.v, arrays, cotangent.astype(np.float64))
    else:
        out = fn(p.q, p.k, p.v, arrays, cotangent)
    return tuple(np.asarray(g, np.float64) for g in out)


# ----------------------------------------------------------------------------- comparisons


def _is16(dtype: Any) -> bool:
    return np.dtype(dtype).itemsize == 2


def _assert_output(out: np.ndarray, p: ast.KernelProblem, label: str) -> None:
    """``out`` equals the oracle: the derived bound (float32/64) or FlashAttention's rule against
    attnref in the same dtype (16-bit)."""
    ref, _ = p.oracle()
    nan = p.masked_rows == "nan"
    if _is16(p.dtype):
        assert_attention_close(
            out,
            ref,
            dtype=p.dtype,
            reference_same_dtype=_ref_forward(p),
            rule="flash",
            expected_nan=nan,
            label=label,
        )
    else:
        bound, _ = p.bound()
        assert_attention_close(
            out, ref, dtype=p.dtype, bound=bound, rule="bound", expected_nan=nan, label=label
        )


def _assert_lse(lse: np.ndarray, p: ast.KernelProblem, label: str) -> None:
    _, ref_lse = p.oracle()
    _, lse_bound = p.bound()
    lse_dtype = np.asarray(lse).dtype
    lse = np.asarray(lse, np.float64)
    if lse.shape != ref_lse.shape:
        raise AssertionError(
            f"{label}: lse shape {lse.shape} != expected [B, T, N] {ref_lse.shape}"
        )
    live = np.isfinite(ref_lse)
    if _is16(lse_dtype):  # an lse returned in 16 bits adds its final rounding
        lse_bound = lse_bound + unit_roundoff(lse_dtype) * (np.abs(ref_lse) + lse_bound)
    assert_attention_close(
        np.where(live, lse, 0.0),
        np.where(live, ref_lse, 0.0),
        dtype=p.dtype,
        bound=np.where(live, lse_bound, 0.0),
        rule="bound",
        label=label,
    )


def _to_target(p: ast.KernelProblem, signature: str) -> ast.KernelProblem:
    """The problem as the target sees it: for ``"qkv_mask"`` every option becomes one full
    boolean mask ``[B, N, T, S]`` (and the oracle sees only that mask)."""
    if signature != "qkv_mask":
        return p
    return p.replace(options={"mask": p.allowed()})


# ----------------------------------------------------------------------------- properties


# Conformance buckets (see _Context.pool); head dims 4 make the scale 1/2 exact.
_SELF = ast.Config(batch=2, t=4, s=4, n=2, k=2, h=4, h_v=4, d_model=8)
_TALL = ast.Config(batch=1, t=5, s=3, n=2, k=2, h=4, h_v=4, d_model=8)
_GQA = ast.Config(batch=2, t=4, s=4, n=4, k=2, h=4, h_v=4, d_model=8)
_MQA = ast.Config(batch=1, t=4, s=4, n=4, k=1, h=4, h_v=4, d_model=8)


@dataclasses.dataclass(frozen=True)
class _Case:
    """One drawn case of a property that builds several problems from a config and a seed."""

    config: ast.Config
    seed: int
    extra: tuple[tuple[str, Any], ...] = ()

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        """Hypothesis (IPython's pretty printer) shows the short ``repr``, not every array."""
        printer.text(repr(self))

    def __repr__(self) -> str:
        more = "".join(f", {k}={v!r}" for k, v in self.extra)
        return f"Case({self.config!r}, seed={self.seed}{more})"

    def get(self, name: str) -> Any:
        return dict(self.extra)[name]


@dataclasses.dataclass
class _Context:
    target: _Target
    signature: str
    features: frozenset[str]
    masked_rows: str
    causal_alignment: str
    dtypes: tuple[str, ...]

    @property
    def primary(self) -> str:
        """The dtype of every property but ``oracle``: float32 when requested, else the first."""
        return "float32" if "float32" in self.dtypes else self.dtypes[0]

    def pool(self, *shapes: str) -> tuple[ast.Config, ...]:
        """The conformance buckets of the named shapes the features allow (few, so that a
        jitted target compiles a handful of programs): ``"self"`` (T == S, N == K, batch 2),
        ``"general"`` (T < S when ``"cross"``, N = 2K when ``"gqa"``, batch 2), ``"tall"``
        (T > S, when ``"cross"``), ``"gqa"`` (N = 2K) and ``"mqa"`` (N = 4K)."""
        cross, gqa = "cross" in self.features, "gqa" in self.features
        out: list[ast.Config] = []
        for name in shapes:
            if name == "self":
                out.append(_SELF)
            elif name == "general":
                if cross or gqa:
                    out.append(
                        dataclasses.replace(
                            _SELF, t=3 if cross else 4, s=5 if cross else 4, n=4 if gqa else 2
                        )
                    )
            elif name == "tall" and cross:
                out.append(_TALL)
            elif name == "gqa" and gqa:
                out.append(_GQA)
            elif name == "mqa" and gqa:
                out.append(_MQA)
        return tuple(dict.fromkeys(out))

    def configs(self, pool: tuple[ast.Config, ...], dtype: str | None = None) -> Any:
        return ast.configs(buckets=pool, dtypes=(dtype or self.primary,), cross=True, gqa=True)

    def problem(self, config: ast.Config, kind: str, seed: int, **kw: Any) -> ast.KernelProblem:
        return ast.make_kernel_problem(
            config,
            kind,
            seed,
            masked_rows=self.masked_rows,
            causal_alignment=self.causal_alignment,
            **kw,
        )

    def kinds(self, candidates: Sequence[str]) -> tuple[str, ...]:
        return tuple(k for k in candidates if set(ast.KIND_FEATURES[k]) <= self.features)

    def run(self, p: ast.KernelProblem, want_lse: bool = False) -> tuple[np.ndarray, Any]:
        return self.target.forward(_to_target(p, self.signature), want_lse)

    def view(self, p: ast.KernelProblem) -> ast.KernelProblem:
        return _to_target(p, self.signature)


@st.composite
def _cases(draw: st.DrawFn, configs: Any, **extras: Any) -> _Case:
    config = draw(configs, label="config")
    extra = tuple((name, draw(strategy, label=name)) for name, strategy in extras.items())
    seed = draw(st.integers(0, 2**32 - 1), label="data seed")
    note(f"config={config!r} seed={seed} " + " ".join(f"{k}={v!r}" for k, v in extra))
    return _Case(config, seed, extra)


Check = Callable[[Any], None]
# (strategy, check) or (strategy, check, explicit cases run first), or a skip reason (str)
Plan = tuple[Any, Check] | tuple[Any, Check, tuple[Any, ...]]


def _plan_oracle(ctx: _Context) -> Plan | str:
    pool = ctx.pool("self", "general", "tall", "mqa")
    strategy = ast.kernel_problems(
        ctx.configs(pool, ctx.dtypes[0]),  # drawn in the first dtype, then cast to the others
        kinds=("none",),
        identical_rows=True,
        masked_rows=ctx.masked_rows,
        causal_alignment=ctx.causal_alignment,
    )

    def check(p: ast.KernelProblem) -> None:
        for dtype in ctx.dtypes:
            pd = p.astype(dtype)
            out, _ = ctx.run(pd)
            _assert_output(out, ctx.view(pd), f"oracle [{pd.dtype}]")

    return strategy, check


def _plan_masks(ctx: _Context) -> Plan | str:
    kinds = ctx.kinds(_MASK_PROPERTY_KINDS)
    if not kinds:
        return (
            "needs a mask feature (one of mask, bias, causal, seq_lengths, window, segment_ids, "
            "softcap)"
        )

    def check(case: _Case) -> None:
        for kind in kinds:
            shape = {name: case.get(name) for name in _DRAWN_SHAPES.get(kind, ())}
            p = ctx.problem(case.config, kind, case.seed, **shape)
            out, _ = ctx.run(p)
            _assert_output(out, ctx.view(p), f"masks [{kind}: {_options_text(p)}]")

    # One mask shape and one bias shape per example, from all 16 broadcastable ones. A shape is
    # a new compiled program, so only two kinds take them (an example adds at most two
    # programs); the other kinds keep their fixed shapes, compiled once per bucket.
    pool = ctx.pool("self", "general", "tall")
    strategy = _cases(
        ctx.configs(pool),
        mask_shape=ast.broadcast_shapes(),
        bias_shape=ast.broadcast_shapes(),
    )
    # The key-padding shapes run first whatever the seed: a mask [B, 1, 1, S], a bias [1, 1, 1, S].
    first = _Case(
        dataclasses.replace(pool[0], dtype=ctx.primary),
        0,
        (("mask_shape", "B11S"), ("bias_shape", "111S")),
    )
    return strategy, check, (first,)


def _options_text(p: ast.KernelProblem) -> str:
    return repr(p).split("options=", 1)[1][:-1]


def _plan_causality(ctx: _Context) -> Plan | str:
    if "causal" not in ctx.features:
        return "needs feature 'causal'"
    pool = ctx.pool("self")
    scales = st.sampled_from((1.0, 1000.0))

    def check(case: _Case) -> None:
        c = case.config
        t = case.get("prefix")
        p = ctx.problem(c, "causal", case.seed)
        grow = case.get("future_key_scale")
        k, v = p.k.astype(np.float64), p.v.astype(np.float64)
        k[:, t:] *= grow
        v[:, t:] *= grow
        p = p.replace(k=k.astype(p.dtype), v=v.astype(p.dtype))
        pre = p.replace(q=p.q[:, :t], k=p.k[:, :t], v=p.v[:, :t])
        full_out, _ = ctx.run(p)
        part, _ = ctx.run(pre)
        full = np.asarray(full_out, np.float64)[:, :t]
        part = np.asarray(part, np.float64)
        bound = ctx.view(p).bound()[0][:, :t] + ctx.view(pre).bound()[0]
        bad = ~np.isfinite(full) | ~np.isfinite(part)
        err = np.where(bad, np.inf, np.abs(np.nan_to_num(full - part)))
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(err == 0, 0.0, err / bound)
        if ratio.max() > 1.0:
            idx = tuple(int(i) for i in np.unravel_index(int(np.argmax(ratio)), ratio.shape))
            raise AssertionError(
                f"causality: appending {c.t - t} future token(s) changed output row {idx[1]} "
                f"(index {idx} of the first {t} rows): |full - prefix| = {err[idx]:.3e} > "
                f"{bound[idx]:.3e} ({ratio[idx]:.3g} x the sum of the two derived bounds); "
                f"full {full[idx]!r}, prefix-only {part[idx]!r}"
            )
        # agreeing with each other is not enough (an all-zero kernel does): each equals the oracle
        _assert_output(full_out, ctx.view(p), "causality: the full run")
        _assert_output(part, ctx.view(pre), "causality: the prefix run")
        if "grad" in ctx.features and ctx.signature != "numpy":
            rng = np.random.default_rng(case.seed)
            cot = np.zeros((c.batch, c.t, c.n, c.h_v))
            cot[:, t - 1] = rng.standard_normal((c.batch, c.n, c.h_v))
            grads = ctx.target.vjp(ctx.view(p), cot.astype(p.dtype))
            for name, g in zip("qkv", grads, strict=True):
                g = np.asarray(g, np.float64)
                if np.any(g[:, t:] != 0.0):
                    idx = tuple(int(i) for i in np.argwhere(g[:, t:] != 0.0)[0])
                    pos = (idx[0], idx[1] + t, *idx[2:])
                    raise AssertionError(
                        f"causality: d out[:, {t - 1}] / d {name}{list(pos)} = {g[pos]!r} != 0 "
                        f"(position {pos[1]} is in the future of query {t - 1})"
                    )

    def prefixes(config: ast.Config) -> Any:
        return st.just(config.t // 2)  # one prefix shape: one more compiled program

    @st.composite
    def cases(draw: st.DrawFn) -> _Case:
        config = draw(ctx.configs(pool), label="config")
        t = draw(prefixes(config), label="prefix")
        grow = draw(scales, label="future_key_scale")
        seed = draw(st.integers(0, 2**32 - 1), label="data seed")
        note(f"config={config!r} prefix={t} future_key_scale={grow} seed={seed}")
        return _Case(config, seed, (("prefix", t), ("future_key_scale", grow)))

    return cases(), check


def _plan_gqa(ctx: _Context) -> Plan | str:
    if "gqa" not in ctx.features:
        return "needs feature 'gqa'"
    pool = ctx.pool("gqa", "mqa")
    kinds = ctx.kinds(("none", "causal"))

    def check(case: _Case) -> None:
        for kind in kinds:
            p = ctx.problem(case.config, kind, case.seed)
            out, _ = ctx.run(p)
            c = case.config
            _assert_output(out, ctx.view(p), f"gqa [N={c.n}, K={c.k}, {kind}]")

    return _cases(ctx.configs(pool)), check


def _plan_lse(ctx: _Context) -> Plan | str:
    if "lse" not in ctx.features:
        return "needs feature 'lse'"
    kinds = ctx.kinds(("none", "causal", "bias"))

    def check(case: _Case) -> None:
        for kind in kinds:
            p = ctx.problem(case.config, kind, case.seed)
            out, lse = ctx.run(p, want_lse=True)
            _assert_output(out, ctx.view(p), f"lse [{kind}] output")
            _assert_lse(lse, ctx.view(p), f"lse [{kind}]")

    return _cases(ctx.configs(ctx.pool("self", "general"))), check


def _plan_batch(ctx: _Context) -> Plan | str:
    kinds = ctx.kinds(("none", "padding", "random", "neg_inf_bias", "segments", "combined"))
    pool = ctx.pool("self", "general")

    def check(p: ast.KernelProblem) -> None:
        full, _ = ctx.run(p)
        full = np.asarray(full, np.float64)
        bound, _ = ctx.view(p).bound()
        if _is16(p.dtype):
            bound = bound + unit_roundoff(p.dtype) * np.abs(full)
        for b in range(p.config.batch):
            one, _ = ctx.run(p.batch_slice(b))
            one = np.asarray(one, np.float64)
            if one.shape != full[b : b + 1].shape:
                raise AssertionError(f"batch element {b}: shape {one.shape} alone")
            nan_full, nan_one = np.isnan(full[b]), np.isnan(one[0])
            if (nan_full != nan_one).any():
                idx = tuple(int(i) for i in np.argwhere(nan_full != nan_one)[0])
                raise AssertionError(
                    f"batch element {b}: NaN pattern differs at {idx}: batched "
                    f"{full[b][idx]!r}, alone {one[0][idx]!r}"
                )
            err = np.abs(np.where(nan_full, 0.0, full[b] - np.where(nan_one, 0.0, one[0])))
            with np.errstate(divide="ignore", invalid="ignore"):
                ratio = np.where(err == 0, 0.0, err / (2 * bound[b]))
            if ratio.max() > 1.0 or not np.all(np.isfinite(err)):
                idx = tuple(int(i) for i in np.unravel_index(int(np.argmax(ratio)), ratio.shape))
                raise AssertionError(
                    f"batch element {b} run alone differs from its slice of the batched run at "
                    f"{idx}: {one[0][idx]!r} vs {full[b][idx]!r} ({ratio[idx]:.3g} x twice the "
                    f"derived bound); kind {p.kind}"
                )
            # equal to each other is not enough (an all-NaN kernel is): each equals the oracle
            _assert_output(one, ctx.view(p.batch_slice(b)), f"batch element {b} run alone")
        _assert_output(full, ctx.view(p), f"batched run [{p.kind}: {_options_text(p)}]")

    strategy = ast.kernel_problems(
        ctx.configs(pool),
        kinds=kinds,
        masked_rows=ctx.masked_rows,
        causal_alignment=ctx.causal_alignment,
        # the kinds' fixed shapes (per-example and batch-broadcast masks and biases among them):
        # the masks property draws the broadcast shapes, and each costs a compiled program here
        # twice (the batch and one element)
        mask_shapes=None,
        bias_shapes=None,
    )
    return strategy, check


def _observed_policy(row: np.ndarray, mean_v: np.ndarray, tol: float) -> str:
    if np.all(np.isnan(row)):
        return "NaN (masked_rows='nan')"
    if np.all(row == 0.0):
        return "zeros (masked_rows='zeros')"
    if np.all(np.isfinite(row)) and np.max(np.abs(row - mean_v)) <= tol:
        return "the mean of v over all keys (masked_rows='uniform')"
    return f"{row!r}, none of the three meanings"


def _plan_fully_masked(ctx: _Context) -> Plan | str:
    if not ({"mask", "seq_lengths"} & ctx.features):
        return "needs feature 'mask' or 'seq_lengths' to build a row with no allowed key"
    use_mask = "mask" in ctx.features

    def check(case: _Case) -> None:
        c = case.config
        if use_mask:
            p = ctx.problem(c, "fully_masked_row", case.seed, mask_shape=case.get("mask_shape"))
        else:
            p = ctx.problem(c, "none", case.seed)
            lens = np.full(c.batch, c.s, np.int32)
            lens[case.seed % c.batch] = 0
            p = p.replace(options={"key_value_seq_lengths": lens})
        view = ctx.view(p)
        out, _ = ctx.run(p)
        out = np.asarray(out, np.float64)
        ref, _ = view.oracle()
        allowed = view.allowed()  # [B, N, T, S]
        dead = ~allowed.any(-1)  # [B, N, T]
        if view.options.get("query_seq_lengths") is not None:
            lens_q = np.asarray(view.options["query_seq_lengths"])
            dead &= (np.arange(c.t)[None, :] < lens_q[:, None])[:, None, :]
        vg = np.repeat(view.v.astype(np.float64), c.group, axis=2)  # [B, S, N, H_v]
        tol = 2 * gamma(c.s + 1, unit_roundoff(np.float32)) * float(np.abs(vg).max())
        if _is16(p.dtype):
            tol += 2 * unit_roundoff(p.dtype) * float(np.abs(vg).max())
        for b, n, i in zip(*np.nonzero(dead), strict=True):
            row = out[b, i, n]
            want = ref[b, i, n]
            mean_v = vg[b, :, n].mean(0)
            ok = {
                "zeros": np.all(row == 0.0),
                "nan": np.all(np.isnan(row)),
                "uniform": np.all(np.isfinite(row)) and np.max(np.abs(row - want)) <= tol,
            }[ctx.masked_rows]
            if not ok:
                raise AssertionError(
                    f"fully masked row (b={b}, t={i}, n={n}): declared masked_rows="
                    f"{ctx.masked_rows!r}, but the kernel returns "
                    f"{_observed_policy(row, mean_v, tol)}; declare the kernel's meaning with "
                    "check_attention(..., masked_rows=...)"
                )
        _assert_output(out, view, "fully_masked_rows")

    extra = {"mask_shape": ast.broadcast_shapes()} if use_mask else {}
    return _cases(ctx.configs(ctx.pool("self", "general")), **extra), check


def _plan_gradients(ctx: _Context) -> Plan | str:
    if "grad" not in ctx.features:
        return "needs feature 'grad'"
    kinds = ctx.kinds(("none", "causal"))

    def check(case: _Case) -> None:
        c = case.config
        rng = np.random.default_rng([case.seed, 1])
        cot = rng.standard_normal((c.batch, c.t, c.n, c.h_v))
        for kind in kinds:
            p = ctx.problem(c, kind, case.seed)
            view = ctx.view(p)
            exact = _ref_vjp(view.astype(np.float64), cot)
            same = _ref_vjp(view, cot.astype(p.dtype))
            got = ctx.target.vjp(view, cot.astype(p.dtype))
            m = max(float(np.max(np.abs(g))) for g in exact)
            n_b = c.t * c.group + c.s + c.h + c.h_v + 2
            floor = gamma(n_b, unit_roundoff(p.dtype)) * m
            for name, g, r, e in zip("qkv", got, same, exact, strict=True):
                g = np.asarray(g, np.float64)
                if g.shape != e.shape:
                    raise AssertionError(f"d/d{name}: shape {g.shape} != {e.shape}")
                if not np.all(np.isfinite(g)):
                    idx = tuple(int(i) for i in np.argwhere(~np.isfinite(g))[0])
                    raise AssertionError(f"gradients [{kind}]: d/d{name}{list(idx)} = {g[idx]!r}")
                ref_err = float(np.max(np.abs(r - e)))
                allowed = 2 * ref_err + floor
                err = np.abs(g - e)
                if err.max() > allowed:
                    idx = tuple(int(i) for i in np.unravel_index(int(np.argmax(err)), err.shape))
                    raise AssertionError(
                        f"gradients [{kind}]: d/d{name} comparative rule (factor 2) failed at "
                        f"{idx}: max error {err.max():.3e} > {allowed:.3e} = 2 x attnref's "
                        f"{p.dtype} error {ref_err:.3e} + floor gamma_{n_b}(u) max|g64| "
                        f"({err.max() / allowed:.3g} x the allowance); got {g[idx]!r}, "
                        f"float64 {e[idx]!r}"
                    )

    return _cases(ctx.configs(ctx.pool("general") or ctx.pool("self"))), check


def _plan_extreme(ctx: _Context) -> Plan | str:
    kinds = ctx.kinds(("none", "causal", "random"))
    dtype = "float32" if "float32" in ctx.dtypes else ctx.primary

    def check(case: _Case) -> None:
        c = case.config
        kind = case.get("kind")
        top = case.get("max_abs_logit")
        p = ctx.problem(c, kind, case.seed)
        q64, k64 = p.q.astype(np.float64), p.k.astype(np.float64)
        kg = np.repeat(k64, c.group, axis=2)
        logits = np.einsum("btnh,bsnh->bnts", q64, kg) / math.sqrt(c.h)
        grow = math.sqrt(top / float(np.abs(logits).max()))
        p = p.replace(q=(q64 * grow).astype(p.dtype), k=(k64 * grow).astype(p.dtype))
        out, _ = ctx.run(p)
        out = np.asarray(out, np.float64)
        bad = ~np.isfinite(out) & ~np.isnan(ctx.view(p).oracle()[0])
        if bad.any():
            idx = tuple(int(i) for i in np.argwhere(bad)[0])
            raise AssertionError(
                f"extreme logits (max |logit| = {top:g}, {kind}): output {out[idx]!r} at {idx} "
                "is not finite (overflow in exp? no max subtraction?)"
            )
        _assert_output(out, ctx.view(p), f"extreme logits [max |logit| = {top:g}, {kind}]")

    strategy = _cases(
        ctx.configs(ctx.pool("self", "general"), dtype),
        kind=st.sampled_from(kinds),
        max_abs_logit=st.sampled_from((1e2, 1e3, 1e4)),
    )
    return strategy, check


_PLANS: dict[str, Callable[[_Context], Plan | str]] = {
    "oracle": _plan_oracle,
    "masks": _plan_masks,
    "causality": _plan_causality,
    "gqa": _plan_gqa,
    "lse": _plan_lse,
    "batch_independence": _plan_batch,
    "fully_masked_rows": _plan_fully_masked,
    "gradients": _plan_gradients,
    "extreme_logits": _plan_extreme,
}


def _settings(max_examples: int) -> settings:
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


_KIT_FILES = frozenset(
    os.path.normcase(os.path.abspath(f)) for f in (__file__, _attnref_testing.__file__)
)


def _is_comparison_failure(exc: BaseException) -> bool:
    """An ``AssertionError`` raised by the kit's own comparisons (this module or
    :mod:`attnref.testing`), as opposed to an exception from the target or its libraries."""
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


def _run_property(
    strategy: Any,
    check: Check,
    max_examples: int,
    seed: int,
    explicit: Sequence[Any] = (),
) -> tuple[str, str, str | None, int, str | None]:
    """Run ``check`` as a Hypothesis test; ``(status, detail, example, examples, traceback)``,
    the traceback only for an exception that is not one of the kit's comparisons. The
    ``explicit`` cases run first, in every Hypothesis version and for every seed; they count
    among the examples only when one fails."""
    state = {"count": 0, "failed": False}

    def body(case: Any) -> None:
        is_explicit = any(case is e for e in explicit)
        if not state["failed"] and not is_explicit:
            state["count"] += 1
        try:
            check(case)
        except BaseException:
            if not state["failed"] and is_explicit:
                state["count"] += 1
            state["failed"] = True
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
        cases = [n for n in notes if n.startswith(("Failing test case", "Falsifying"))]
        lines = list(dict.fromkeys(cases + [n for n in notes if n not in cases]))
        example = "\n".join(lines).strip() or None
        message = str(exc).strip() or type(exc).__name__
        tb = None
        if not _is_comparison_failure(exc):
            message = f"{type(exc).__name__}: {message}"
            tb = _format_traceback(exc)
        return "failed", message, example, int(state["count"]), tb
    return "passed", "", None, int(state["count"]), None


def check_attention(
    fn: Callable[..., Any],
    *,
    signature: str = "jax_nn",
    features: Sequence[str] | None = None,
    max_examples: int = 20,
    seed: int = 0,
    masked_rows: str = "zeros",
    causal_alignment: str = "top_left",
    dtypes: Sequence[str] = ("float32",),
    properties: Sequence[str] | None = None,
    progress: Callable[[int, int, str], None] | None = None,
    target: str | None = None,
) -> ConformanceReport:
    """Run the conformance properties (module docstring) against ``fn``.

    ``signature``: ``"jax_nn"``, ``"qkv_mask"`` or ``"numpy"`` (the adapters, module docstring).
    ``features``: what ``fn`` supports (:data:`FEATURES`; ``None`` = ``DEFAULT_FEATURES
    [signature]``); a property needing an absent feature is skipped with the reason.
    ``masked_rows`` / ``causal_alignment``: the kernel's declared semantics; the oracle is run
    with them, and the report lists them when they differ from attnref's defaults (``"zeros"``,
    ``"top_left"``). ``dtypes``: the oracle property runs each; the others run in float32 when
    requested, else in the first dtype (float64 runs inside ``jax.enable_x64``). ``properties``:
    a subset of :data:`PROPERTIES` (default all), run in that order. ``progress(done, total,
    name)`` is called after each property with the number finished, the number to run and the
    name of the property just finished. ``target``: the name shown in the report.
    """
    if signature not in SIGNATURES:
        raise ValueError(f"signature must be one of {SIGNATURES}, got {signature!r}")
    feats = tuple(DEFAULT_FEATURES[signature] if features is None else features)
    unknown = [f for f in feats if f not in FEATURES]
    if unknown:
        raise ValueError(f"unknown features {unknown}; choose from {FEATURES}")
    impossible = [f for f in feats if f in _UNSUPPORTED[signature]]
    if impossible:
        raise ValueError(
            f"signature {signature!r} cannot express features {impossible} "
            f"(it has no way to pass {', '.join(impossible)})"
        )
    if masked_rows not in _MASKED_ROWS:
        raise ValueError(f"masked_rows must be one of {_MASKED_ROWS}, got {masked_rows!r}")
    if causal_alignment not in _ALIGNMENTS:
        raise ValueError(f"causal_alignment must be one of {_ALIGNMENTS}, got {causal_alignment!r}")
    names = tuple(PROPERTIES if properties is None else properties)
    bad = [p for p in names if p not in PROPERTIES]
    if bad:
        raise ValueError(f"unknown properties {bad}; choose from {PROPERTIES}")
    names = tuple(p for p in PROPERTIES if p in names)
    dts = tuple(str(np.dtype(d)) for d in dtypes)
    if not dts:
        raise ValueError("dtypes must name at least one dtype")
    if max_examples < 1:
        raise ValueError(f"max_examples must be >= 1, got {max_examples}")
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")

    semantics = {"masked_rows": masked_rows, "causal_alignment": causal_alignment}
    declared = {k: v for k, v in semantics.items() if v != _DEFAULT_SEMANTICS[k]}
    ctx = _Context(
        target=_Target(fn, signature),
        signature=signature,
        features=frozenset(feats),
        masked_rows=masked_rows,
        causal_alignment=causal_alignment,
        dtypes=dts,
    )
    results: list[PropertyResult] = []
    for done, name in enumerate(names, start=1):
        plan = _PLANS[name](ctx)
        if isinstance(plan, str):
            results.append(PropertyResult(name, "skipped", plan, None, seed, 0))
        else:
            strategy, check, *explicit = plan
            before = len(ctx.target.notes)
            status, detail, example, count, tb = _run_property(
                strategy, check, max_examples, seed, *explicit
            )
            new_notes = ctx.target.notes[before:]
            if new_notes:
                detail = "; ".join([detail, *new_notes]) if detail else "; ".join(new_notes)
            in_effect = tuple(f"{k}={declared[k]}" for k in _DEPENDS[name] if k in declared)
            results.append(
                PropertyResult(name, status, detail, example, seed, count, in_effect, tb)
            )
        if progress is not None:
            progress(done, len(names), name)
    return ConformanceReport(
        target=target or _describe_target(fn),
        signature=signature,
        features=feats,
        declared=declared,
        results=tuple(results),
    )
