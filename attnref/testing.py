"""Assertions for checking attention outputs against the oracle with derived tolerances.

``assert_within_bound`` compares componentwise against a bound from
:func:`attnref.tolerance.attention_error_bound`; ``assert_comparative`` applies FlashAttention's
rule (error at most ``factor`` times a same-precision reference's error plus a rounding floor).
Both fail on any NaN/inf where the expected value is finite, and refuse a non-finite expectation.
Failure messages name the rule, the worst index, and the error in units of the allowance.

:func:`assert_attention_close` is the one entry point for kernel authors: it offers the three
rules by name (``"bound"``, ``"flash"``, ``"torch"``; see ``docs/tolerances.md``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from attnref.tolerance import K_Y, comparative_bound, gamma, kernel_error_bound, unit_roundoff

__all__ = [
    "DEFAULT_FEATURES",
    "FEATURES",
    "PROPERTIES",
    "RULES",
    "SIGNATURES",
    "Closeness",
    "ConformanceReport",
    "PropertyResult",
    "assert_attention_close",
    "assert_comparative",
    "assert_within_bound",
    "check_attention",
    "load_target",
]

RULES = ("bound", "flash", "torch")
FLASH_FACTOR = 2.0  # FlashAttention's tests: error <= 2 x the same-precision reference's
TORCH_FACTOR = 5.0  # PyTorch's SDPA tests: error <= max(floor, 5 x the reference's)


def _prepare(actual: Any, expected: Any, label: str) -> tuple[np.ndarray, np.ndarray]:
    a = np.asarray(actual, dtype=np.float64)
    e = np.asarray(expected, dtype=np.float64)
    if a.shape != e.shape:
        raise AssertionError(f"{label}: shape {a.shape} != expected shape {e.shape}")
    if not np.all(np.isfinite(e)):
        raise AssertionError(
            f"{label}: the expected (oracle) value has NaN/inf; refusing to compare"
        )
    bad = ~np.isfinite(a)
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        raise AssertionError(
            f"{label}: non-finite value {a[idx]} at index {idx} where the oracle has {e[idx]}"
        )
    return a, e


def assert_within_bound(actual: Any, expected: Any, bound: Any, *, label: str = "output") -> None:
    """``|actual - expected| <= bound`` elementwise (bound from the derived error model)."""
    a, e = _prepare(actual, expected, label)
    b = np.broadcast_to(np.asarray(bound, dtype=np.float64), a.shape)
    err = np.abs(a - e)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(err == 0, 0.0, err / b)
    worst = np.unravel_index(int(np.argmax(ratio)), a.shape) if a.size else ()
    if a.size and ratio[worst] > 1.0:
        raise AssertionError(
            f"{label}: derived-bound rule failed: |actual - oracle| = {err[worst]:.3e} at index "
            f"{tuple(int(i) for i in worst)} exceeds the bound {b[worst]:.3e} "
            f"({ratio[worst]:.3g} x the bound); actual {a[worst]!r}, oracle {e[worst]!r}"
        )


def assert_comparative(
    actual: Any,
    expected: Any,
    reference: Any,
    *,
    dtype: Any,
    factor: float = 2.0,
    floor_n: int = 2,
    floor_magnitude: float | None = None,
    label: str = "output",
) -> None:
    """FlashAttention's rule: ``max|actual - expected| <= factor * max|reference - expected|
    + gamma_{floor_n}(u) * M``, with ``reference`` a same-precision computation and ``M`` =
    ``floor_magnitude`` if given, else ``max|expected|``."""
    a, e = _prepare(actual, expected, label)
    r = np.asarray(reference, dtype=np.float64)
    ref_err = float(np.max(np.abs(r - e))) if r.size else 0.0
    if floor_magnitude is None:
        floor_magnitude = float(np.max(np.abs(e))) if e.size else 0.0
    allowed = comparative_bound(ref_err, floor_magnitude, dtype, factor=factor, n=floor_n)
    err = np.abs(a - e)
    if a.size and err.max() > allowed:
        worst = tuple(int(i) for i in np.unravel_index(int(np.argmax(err)), a.shape))
        raise AssertionError(
            f"{label}: comparative rule (factor {factor}) failed: max error {err.max():.3e} at "
            f"index {worst} exceeds {allowed:.3e} = {factor} x reference error {ref_err:.3e} + "
            f"floor ({err.max() / allowed:.3g} x the allowance)"
        )


@dataclasses.dataclass(frozen=True)
class Closeness:
    """The outcome of a passing :func:`assert_attention_close`: the rule, the largest error, what
    the rule allowed there, their ratio (at most 1) and the index of the worst entry."""

    rule: str
    max_error: float
    allowed: float
    ratio: float
    index: tuple[int, ...]


def _split_nan(a: np.ndarray, e: np.ndarray, expected_nan: bool, label: str) -> np.ndarray:
    """NaN bookkeeping: returns the entries to compare. A NaN in ``actual`` where the oracle has
    none fails; a NaN in the oracle fails unless ``expected_nan`` declares it (a "nan"
    fully-masked-row policy), and then ``actual`` must have NaN at exactly those entries."""
    nan_e, nan_a = np.isnan(e), np.isnan(a)
    if nan_e.any() and not expected_nan:
        idx = tuple(int(i) for i in np.argwhere(nan_e)[0])
        raise AssertionError(
            f"{label}: the oracle has NaN at index {idx}; pass expected_nan=True only if NaN is "
            "the declared meaning there (masked_rows='nan'), otherwise the inputs are invalid"
        )
    wrong = nan_a & ~nan_e
    if wrong.any():
        idx = tuple(int(i) for i in np.argwhere(wrong)[0])
        raise AssertionError(f"{label}: NaN at index {idx} where the oracle has {e[idx]!r}")
    missing = nan_e & ~nan_a
    if missing.any():
        idx = tuple(int(i) for i in np.argwhere(missing)[0])
        raise AssertionError(
            f"{label}: the oracle has NaN at {idx} (declared) but actual has {a[idx]!r}"
        )
    if np.isinf(e).any():
        raise AssertionError(f"{label}: the expected (oracle) value has inf; refusing to compare")
    inf_a = np.isinf(a)
    if inf_a.any():
        idx = tuple(int(i) for i in np.argwhere(inf_a)[0])
        raise AssertionError(f"{label}: inf at index {idx} where the oracle has {e[idx]!r}")
    return ~nan_e


def assert_attention_close(
    actual: Any,
    expected_fp64: Any,
    *,
    dtype: Any,
    reference_same_dtype: Any = None,
    rule: str | None = None,
    bound: Any = None,
    inputs: dict[str, Any] | None = None,
    floor_n: int = K_Y,
    expected_nan: bool = False,
    label: str = "output",
) -> Closeness:
    """Compare a kernel's output with the float64 oracle under a named tolerance rule.

    * ``"bound"``: ``|actual - expected| <= bound`` componentwise, with ``bound`` given or derived
      by :func:`attnref.tolerance.kernel_error_bound` from ``inputs`` (``q, k, v, allowed`` and
      optionally ``bias, scale, softcap, masked_rows, key_blocks``): a first-order forward-error
      bound from ``dtype``'s unit round-off and the reduction lengths.
    * ``"flash"`` (FlashAttention's tests): ``max|actual - expected| <= 2 max|ref - expected| +
      gamma_{floor_n}(u) max|expected|`` with ``ref = reference_same_dtype``, a same-precision
      computation in another operation order.
    * ``"torch"`` (PyTorch's SDPA tests): ``max|actual - expected| <= max(gamma_{floor_n}(u)
      max|expected|, 5 max|ref - expected|)``.

    ``rule=None`` picks ``"bound"`` when ``bound`` or ``inputs`` is given, else ``"flash"``.
    A NaN in ``actual`` where the oracle has none always fails; a NaN in the oracle fails unless
    ``expected_nan`` declares it. The failure message names the rule, the index, the error and
    the error in units of the allowance.
    """
    a = np.asarray(actual, dtype=np.float64)
    e = np.asarray(expected_fp64, dtype=np.float64)
    if a.shape != e.shape:
        raise AssertionError(f"{label}: shape {a.shape} != expected shape {e.shape}")
    if rule is None:
        rule = "bound" if (bound is not None or inputs is not None) else "flash"
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
    keep = _split_nan(a, e, expected_nan, label)
    err = np.where(keep, np.abs(np.where(keep, a, 0.0) - np.where(keep, e, 0.0)), 0.0)
    if rule == "bound":
        if bound is None:
            if inputs is None:
                raise ValueError("rule='bound' needs bound= or inputs= (see kernel_error_bound)")
            kw = dict(inputs)
            q, k, v, allowed = (kw.pop(n) for n in ("q", "k", "v", "allowed"))
            bound = kernel_error_bound(q, k, v, allowed, dtype=dtype, **kw)[0]
        allowed_arr = np.broadcast_to(np.asarray(bound, np.float64), a.shape)
    else:
        if reference_same_dtype is None:
            raise ValueError(f"rule={rule!r} needs reference_same_dtype=")
        r = np.asarray(reference_same_dtype, np.float64)
        ref_err = float(np.max(np.where(keep, np.abs(np.where(keep, r, 0.0) - e), 0.0)))
        magnitude = float(np.max(np.abs(np.where(keep, e, 0.0)))) if e.size else 0.0
        floor = gamma(floor_n, unit_roundoff(dtype)) * magnitude
        limit = (
            comparative_bound(ref_err, magnitude, dtype, factor=FLASH_FACTOR, n=floor_n)
            if rule == "flash"
            else max(floor, TORCH_FACTOR * ref_err)
        )
        allowed_arr = np.full(a.shape, limit)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(err == 0, 0.0, err / allowed_arr)
    if not a.size:
        return Closeness(rule, 0.0, 0.0, 0.0, ())
    worst = tuple(int(i) for i in np.unravel_index(int(np.argmax(ratio)), a.shape))
    result = Closeness(
        rule, float(err[worst]), float(allowed_arr[worst]), float(ratio[worst]), worst
    )
    if result.ratio > 1.0:
        raise AssertionError(
            f"{label}: rule {rule!r} failed at index {worst}: |actual - oracle| = "
            f"{result.max_error:.3e} > allowed {result.allowed:.3e} ({result.ratio:.3g} x the "
            f"allowance); actual {a[worst]!r}, oracle {e[worst]!r}"
        )
    return result


# The conformance kit imports assert_attention_close from this module, so it comes last.
from attnref._src.conformance import (  # noqa: E402
    DEFAULT_FEATURES,
    FEATURES,
    PROPERTIES,
    SIGNATURES,
    ConformanceReport,
    PropertyResult,
    check_attention,
    load_target,
)
