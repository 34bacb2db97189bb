"""Assertions for checking attention outputs against the oracle with derived tolerances.

``assert_within_bound`` compares componentwise against a bound from
:func:`attnref.tolerance.attention_error_bound`; ``assert_comparative`` applies FlashAttention's
rule (error at most ``factor`` times a same-precision reference's error plus a rounding floor).
Both fail on any NaN/inf where the expected value is finite, and refuse a non-finite expectation.
Failure messages name the rule, the worst index, and the error in units of the allowance.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from attnref.tolerance import comparative_bound

__all__ = ["assert_comparative", "assert_within_bound"]


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
