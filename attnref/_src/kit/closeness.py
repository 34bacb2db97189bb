"""Closeness rules (:mod:`attnref.testing` describes them); :func:`assert_ratio_within` is the
step every rule and the kit's comparisons share."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from attnref.tolerance import K_Y, comparative_bound, gamma, kernel_error_bound, unit_roundoff

RULES = ("bound", "flash", "torch")
FLASH_FACTOR = 2.0  # FlashAttention's tests: error <= 2 x the same-precision reference's
TORCH_FACTOR = 5.0  # PyTorch's SDPA tests: error <= max(floor, 5 x the reference's)


def assert_ratio_within(
    err: Any,
    allowed: Any,
    message: str,
    *,
    require_finite: bool = False,
    **values: Any,
) -> tuple[tuple[int, ...], float]:
    """Fail at the worst element of ``r = err / allowed`` (``0`` where ``err == 0``) when ``r >
    1`` there (with ``require_finite``, also for any non-finite ``err``); return its ``(index,
    ratio)`` (``((), 0.0)`` when empty).

    The worst element is the first largest ``r`` (the first NaN), or with a scalar allowance the
    first largest ``err``. The ``AssertionError`` is the :meth:`str.format` template ``message``
    filled with ``index``, ``ratio``, ``error``, ``allowed`` and the ``values`` (arrays read at
    the index). ``ValueError`` where ``allowed`` does not broadcast to ``err`` or is negative or
    NaN anywhere."""
    __tracebackhide__ = True  # pytest shows the caller's frame, not this one
    err = np.asarray(err)
    allowed_a = np.asarray(allowed)
    try:
        grows = np.broadcast_shapes(err.shape, allowed_a.shape) != err.shape
    except ValueError:
        grows = True
    if grows:
        raise ValueError(
            f"the allowance of shape {allowed_a.shape} does not broadcast to the errors' shape "
            f"{err.shape}"
        )
    if np.any(np.isnan(allowed_a)) or np.any(allowed_a < 0):
        raise ValueError("the allowance must be >= 0 everywhere (got a negative or NaN entry)")
    if not err.size:
        return (), 0.0
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(err == 0, 0.0, err / allowed)
    score = err if np.ndim(allowed) == 0 else ratio
    index = tuple(int(i) for i in np.unravel_index(int(np.argmax(score)), score.shape))
    worst = float(ratio[index])
    if worst > 1.0 or (require_finite and not np.all(np.isfinite(err))):
        fields = {"allowed": allowed, **values}
        at = {k: _scalar(v[index]) if isinstance(v, np.ndarray) else v for k, v in fields.items()}
        raise AssertionError(message.format(index=index, ratio=worst, error=err[index], **at))
    return index, worst


def _scalar(value: Any) -> Any:
    return value.item() if isinstance(value, np.generic) else value


def first_index(where: Any) -> tuple[int, ...] | None:
    """The index of the first ``True`` of ``where`` (C order), ``None`` where there is none."""
    w = np.asarray(where, dtype=bool)
    if not w.any():  # a scan that stops at the first True, no list of every hit
        return None
    return tuple(int(i) for i in np.unravel_index(int(np.argmax(w)), w.shape))


def _prepare(actual: Any, expected: Any, label: str) -> tuple[np.ndarray, np.ndarray]:
    __tracebackhide__ = True  # pytest shows the caller's frame, not this one
    a = np.asarray(actual, dtype=np.float64)
    e = np.asarray(expected, dtype=np.float64)
    if a.shape != e.shape:
        raise AssertionError(f"{label}: shape {a.shape} != expected shape {e.shape}")
    if not np.all(np.isfinite(e)):
        raise AssertionError(
            f"{label}: the expected (oracle) value has NaN/inf; refusing to compare"
        )
    if (idx := first_index(~np.isfinite(a))) is not None:
        raise AssertionError(
            f"{label}: non-finite value {a[idx]} at index {idx} where the oracle has {e[idx]}"
        )
    return a, e


def assert_within_bound(actual: Any, expected: Any, bound: Any, *, label: str = "output") -> None:
    """The derived-bound rule: ``|actual - expected| <= bound`` elementwise (``expected`` the
    finite oracle value, ``bound`` e.g. from :func:`attnref.tolerance.attention_error_bound`).
    The ``AssertionError`` (a shape mismatch, a non-finite value, the worst index above the
    bound) names ``label``."""
    __tracebackhide__ = True  # pytest shows the caller's frame, not this one
    a, e = _prepare(actual, expected, label)
    b = np.broadcast_to(np.asarray(bound, dtype=np.float64), a.shape)
    err = np.abs(a - e)
    assert_ratio_within(
        err,
        b,
        "{label}: derived-bound rule failed: |actual - oracle| = {error:.3e} at index {index} "
        "exceeds the bound {allowed:.3e} ({ratio:.3g} x the bound); actual {actual!r}, "
        "oracle {oracle!r}",
        label=label,
        actual=a,
        oracle=e,
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
    """FlashAttention's rule: ``max|actual - expected| <= factor max|reference - expected|
    + gamma_{floor_n}(u) M``, ``reference`` a same-precision computation in another order,
    ``u`` the unit round-off of ``dtype``, ``M = floor_magnitude`` (``None``: ``max|expected|``).
    The ``AssertionError`` (a shape mismatch, a non-finite value, the worst index above the
    allowance) names ``label``."""
    __tracebackhide__ = True  # pytest shows the caller's frame, not this one
    a, e = _prepare(actual, expected, label)
    r = np.asarray(reference, dtype=np.float64)
    if r.shape != e.shape:
        raise AssertionError(f"{label}: reference shape {r.shape} != expected shape {e.shape}")
    ref_err = float(np.max(np.abs(r - e))) if r.size else 0.0
    if floor_magnitude is None:
        floor_magnitude = float(np.max(np.abs(e))) if e.size else 0.0
    allowed = comparative_bound(ref_err, floor_magnitude, dtype, factor=factor, n=floor_n)
    err = np.abs(a - e)
    assert_ratio_within(
        err,
        allowed,
        "{label}: comparative rule (factor {factor}) failed: max error {error:.3e} at index "
        "{index} exceeds {allowed:.3e} = {factor} x reference error {ref_err:.3e} + floor "
        "({ratio:.3g} x the allowance)",
        label=label,
        factor=factor,
        ref_err=ref_err,
    )


@dataclasses.dataclass(frozen=True)
class Closeness:
    """A passing :func:`assert_attention_close`: the ``rule``, the worst entry's ``index``
    (``()`` when empty), its error, what was ``allowed`` there and their ``ratio``."""

    rule: str
    max_error: float
    allowed: float
    ratio: float
    index: tuple[int, ...]


def _split_nan(a: np.ndarray, e: np.ndarray, expected_nan: bool, label: str) -> np.ndarray:
    """The entries to compare: NaN must match a declared oracle NaN; inf fails."""
    __tracebackhide__ = True  # pytest shows the caller's frame, not this one
    nan_e, nan_a = np.isnan(e), np.isnan(a)
    if not expected_nan and (idx := first_index(nan_e)) is not None:
        raise AssertionError(
            f"{label}: the oracle has NaN at index {idx}; pass expected_nan=True only if NaN is "
            "the declared meaning there (masked_rows='nan'), otherwise the inputs are invalid"
        )
    if (idx := first_index(nan_a & ~nan_e)) is not None:
        raise AssertionError(f"{label}: NaN at index {idx} where the oracle has {e[idx]!r}")
    if (idx := first_index(nan_e & ~nan_a)) is not None:
        raise AssertionError(
            f"{label}: the oracle has NaN at {idx} (declared) but actual has {a[idx]!r}"
        )
    if np.isinf(e).any():
        raise AssertionError(f"{label}: the expected (oracle) value has inf; refusing to compare")
    if (idx := first_index(np.isinf(a))) is not None:
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

    NaN in ``actual`` must match NaN in the oracle, which fails unless ``expected_nan``.
    ``dtype``: the kernel's precision; ``rule=None``: ``"bound"`` when ``bound`` or ``inputs`` is
    given, else ``"flash"``. Returns the worst entry's :class:`Closeness`. The
    ``AssertionError`` (shape, misplaced NaN or inf, the worst index above the allowance) names
    ``label``; ``ValueError`` for an unknown ``rule`` or one missing its arguments.
    """
    __tracebackhide__ = True  # pytest shows the caller's frame, not this one
    a = np.asarray(actual, dtype=np.float64)
    e = np.asarray(expected_fp64, dtype=np.float64)
    if a.shape != e.shape:
        raise AssertionError(f"{label}: shape {a.shape} != expected shape {e.shape}")
    if rule is None:
        rule = "bound" if (bound is not None or inputs is not None) else "flash"
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
    err = np.abs(a - e)
    keep: Any = True  # every entry: a finite error means neither side has NaN or inf
    if not np.isfinite(err).all():
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
    if not a.size:
        return Closeness(rule, 0.0, 0.0, 0.0, ())
    worst, ratio = assert_ratio_within(
        err,
        allowed_arr,
        "{label}: rule {rule!r} failed at index {index}: |actual - oracle| = {error:.3e} > "
        "allowed {allowed:.3e} ({ratio:.3g} x the allowance); actual {actual!r}, "
        "oracle {oracle!r}",
        label=label,
        rule=rule,
        actual=a,
        oracle=e,
    )
    return Closeness(rule, float(err[worst]), float(allowed_arr[worst]), ratio, worst)
