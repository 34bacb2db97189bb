"""One-call checks of a kernel against the float64 oracle, the allowance derived from the same
options (:mod:`attnref.testing` describes them)."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Sequence
from typing import Any

import numpy as np

from attnref import oracle, tolerance
from attnref.tolerance import K_Y, gamma, unit_roundoff
from attnref.tolerance._rounding import is_16bit

# The oracle's keyword options; jax.nn's "implementation" (a backend choice) is ignored.
_ORACLE_PARAMS = inspect.signature(oracle.dot_product_attention).parameters
OPTION_NAMES = tuple(
    n for n in _ORACLE_PARAMS if n not in ("query", "key", "value", "return_lse", "method")
)
IGNORED_OPTIONS = ("implementation",)
OUT_AXES = "[b, t, n, h]"
LSE_AXES = "[b, t, n]"
# each gradient's name and axes (dbias has the bias's own broadcast shape)
_GRADS = {
    "query": ("dq", OUT_AXES),
    "key": ("dk", "[b, s, k, h]"),
    "value": ("dv", "[b, s, k, h]"),
    "bias": ("dbias", "[b, n, t, s]"),
}


@dataclasses.dataclass(frozen=True)
class Match:
    """A passing comparison: ``max_error`` (largest ``|kernel - oracle|``), the ``worst`` element
    (largest error / allowance; ``()`` when empty), the ``ratio`` and ``allowed`` error there,
    and the compute ``dtype`` of the bound."""

    max_error: float
    worst: tuple[int, ...]
    ratio: float
    allowed: float
    dtype: str


def _numpy(value: Any, name: str) -> np.ndarray:
    """A NumPy, JAX or CPU torch array as NumPy, or a ``TypeError``."""
    __tracebackhide__ = True
    if hasattr(value, "detach") and hasattr(value, "cpu"):  # a torch tensor
        value = value.detach().cpu()
    try:
        return np.asarray(value)
    except Exception as exc:
        raise TypeError(
            f"{name} must be an array, got {type(value).__name__} ({type(exc).__name__}: {exc})"
        ) from None


def _floating(value: Any, name: str) -> np.ndarray:
    __tracebackhide__ = True
    a = _numpy(value, name)
    if a.dtype.kind in "biucOSUmM":
        raise TypeError(f"{name} must be a floating-point array, got dtype {a.dtype}")
    return a


def _options(where: str, options: dict[str, Any]) -> dict[str, Any]:
    """The options as NumPy (a segment-id pair kept a pair); ``TypeError`` for an unknown one."""
    __tracebackhide__ = True
    unknown = sorted(set(options) - set(OPTION_NAMES) - set(IGNORED_OPTIONS))
    if unknown:
        raise TypeError(
            f"{where}: unknown option(s) {unknown}; the options are those of "
            f"attnref.oracle.dot_product_attention: {', '.join(OPTION_NAMES)}"
        )
    out: dict[str, Any] = {}
    for name, value in options.items():
        if name in IGNORED_OPTIONS:
            continue
        if isinstance(value, (tuple, list)) and any(hasattr(v, "__array__") for v in value):
            value = tuple(_numpy(v, name) for v in value)
        elif hasattr(value, "__array__"):
            value = _numpy(value, name)
        out[name] = value
    return out


def _compute_dtype(dtype: Any, *arrays: np.ndarray) -> np.dtype[Any]:
    """``dtype``, or (``None``) the arrays' coarsest (float32 out of bfloat16 in: bfloat16)."""
    __tracebackhide__ = True
    if dtype is not None:
        try:
            return np.dtype(dtype)
        except TypeError:
            raise TypeError(f"dtype must be a NumPy dtype or its name, got {dtype!r}") from None
    return max((a.dtype for a in arrays), key=unit_roundoff)


def _call(where: str, fn: Any, *args: Any, **kw: Any) -> Any:
    """``fn(*args, **kw)``, a ``ValueError`` or ``TypeError`` re-raised prefixed ``where``."""
    __tracebackhide__ = True
    try:
        return fn(*args, **kw)
    except (ValueError, TypeError) as exc:
        raise type(exc)(f"{where}: {exc}") from None


def _flash_allowances(
    qkv: tuple[np.ndarray, ...],
    opts: dict[str, Any],
    dtype: Any,
    cot: Any,
    exact: Sequence[np.ndarray],
    n: int,
) -> list[float]:
    """Per ``exact``: 2 x attnref's own error in ``dtype`` (NaN left out) + gamma_n(u) max|e|."""
    import jax
    import jax.numpy as jnp

    from attnref._src.formulations.kernel import dot_product_attention

    kw = dict(opts)
    bias = kw.pop("bias", None)
    args = tuple(jnp.asarray(x, dtype) for x in (*qkv, bias) if x is not None)

    def f(*a: Any) -> Any:
        return dot_product_attention(*a[:3], bias=a[3] if len(a) > 3 else None, **kw)

    if cot is None:
        same = [f(*args)]
    else:
        o, pull = jax.vjp(f, *args)
        same = pull(jnp.asarray(cot, o.dtype))
    top = max(float(np.max(np.abs(np.nan_to_num(e)), initial=0.0)) for e in exact)
    floor = gamma(n, unit_roundoff(dtype)) * top
    errors = (
        np.where(np.isnan(e), 0.0, np.nan_to_num(np.abs(np.asarray(r, np.float64) - e), nan=np.inf))
        for r, e in zip(same, exact, strict=False)
    )
    return [2.0 * float(np.max(err, initial=0.0)) + floor for err in errors]


def compare(
    actual: np.ndarray,
    expected: np.ndarray,
    allowed: Any,
    *,
    name: str,
    axes: str,
    dtype: np.dtype[Any],
    rule: str,
) -> Match:
    """Fail unless ``|actual - expected| <= allowed`` elementwise, the numpy.testing way (NaN
    must match ``expected``'s, a declared meaning; other NaN or inf has infinite error): how many
    mismatch, the worst as ``name{axes} = name[i, ...]``, both values, the error as a multiple
    of the allowance, the ``rule``."""
    __tracebackhide__ = True
    if actual.shape != expected.shape:
        raise AssertionError(
            f"{name}: shape {actual.shape} != the oracle's {expected.shape} {axes}"
        )
    a = actual.astype(np.float64)
    e = np.asarray(expected, np.float64)
    allowed = np.broadcast_to(np.asarray(allowed, np.float64), a.shape)
    nan_a, nan_e = np.isnan(a), np.isnan(e)
    with np.errstate(invalid="ignore", over="ignore"):
        err = np.abs(a - e)
    err = np.where(nan_a & nan_e, 0.0, np.where(np.isfinite(err), err, np.inf))
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(err == 0.0, 0.0, err / allowed)  # err > 0 = allowance: inf
    bad = err > allowed
    if not a.size:
        return Match(0.0, (), 0.0, 0.0, str(dtype))
    worst = tuple(int(i) for i in np.unravel_index(int(np.argmax(ratio)), a.shape))
    if not bad.any():
        return Match(
            float(err.max()), worst, float(ratio[worst]), float(allowed[worst]), str(dtype)
        )
    n_bad, total = int(bad.sum()), a.size
    finite = np.isfinite(err) & bad
    lines = [
        f"{name} does not match the float64 oracle within the derived allowance "
        f"({rule}, {dtype}, u = {unit_roundoff(dtype):.3g})",
        f"Mismatched elements: {n_bad} / {total} ({100.0 * n_bad / total:.3g}%)",
        f"Worst element: {name}{axes} = {name}[{', '.join(map(str, worst))}]",
        f"  kernel:  {float(a[worst])!r}",
        f"  oracle:  {float(e[worst])!r}",
        f"  |error|: {err[worst]:.3e} = {ratio[worst]:.3g} x the allowance {allowed[worst]:.3e}",
    ]
    if finite.any():
        lines.append(f"Max absolute error among mismatches: {float(err[finite].max()):.3e}")
    if count := int((~np.isfinite(err)).sum()):
        lines.append(f"NaN or inf where the oracle has a number (or the reverse): {count}")
    raise AssertionError("\n".join(lines))


def assert_matches_oracle(
    out: Any,
    query: Any,
    key: Any,
    value: Any,
    *,
    dtype: Any = None,
    lse: Any = None,
    **options: Any,
) -> Match:
    """Assert that a kernel's ``out = fn(query, key, value, **options)`` equals the float64 oracle
    :func:`attnref.oracle.dot_product_attention` (row vectors, ``out [B, T, N, H_v]``) within the
    derived componentwise bound :func:`attnref.tolerance.kernel_call_error_bound` for ``dtype``,
    both computed from the same ``options``.

    Args:
        out: The kernel's output ``[B, T, N, H_v]`` (NumPy, JAX or a CPU torch array).
        query: ``[B, T, N, H]``, exactly as the kernel received it.
        key: ``[B, S, K, H]``.
        value: ``[B, S, K, H_v]``.
        dtype: The kernel's compute format (``None``: the coarsest of ``out``'s and
            ``query``'s). 16-bit formats are judged by FlashAttention's rule against attnref's
            own kernel in that format.
        lse: The kernel's log-sum-exp ``[B, T, N]``, if any: compared within the lse bound
            where the oracle's is finite.
        **options: Those of :func:`attnref.oracle.dot_product_attention`; jax.nn's
            ``implementation`` is ignored.

    Returns:
        The :class:`Match` of the output (its worst element and ratio).

    Raises:
        AssertionError: A wrong shape, or an element off by more than its allowance (NaN and
            inf included): how many, the worst index ``[b, t, n, h]``, both values, the ratio.
        TypeError: Not a floating array, an unknown option or dtype, an option of the wrong
            type (the oracle's message).
        ValueError: Inputs or options the oracle refuses (its message).
    """
    __tracebackhide__ = True
    where = "assert_matches_oracle"
    a = _floating(out, "out")
    q, k, v = (_floating(x, n) for x, n in ((query, "query"), (key, "key"), (value, "value")))
    opts = _options(where, options)
    dt = _compute_dtype(dtype, a, q)
    ref, ref_lse = _call(where, oracle.dot_product_attention, q, k, v, return_lse=True, **opts)
    bound, lse_bound = _call(where, tolerance.kernel_call_error_bound, q, k, v, dtype=dt, **opts)
    rule = "tolerance.kernel_call_error_bound"
    allowed: Any = bound
    if is_16bit(dt):  # the kit's 16-bit rule (docs/tolerances.md): FlashAttention's
        allowed = _flash_allowances((q, k, v), opts, dt, None, [ref], K_Y)[0]
        rule = "FlashAttention's rule: 2 x attnref's own error in this dtype + gamma_8(u) max|o|"
    match = compare(a, ref, allowed, name="out", axes=OUT_AXES, dtype=dt, rule=rule)
    if lse is not None:
        got = _floating(lse, "lse")
        live = np.isfinite(ref_lse)
        if got.shape == ref_lse.shape:
            got = np.where(live, got.astype(np.float64), 0.0)
        want, allow = (np.where(live, x, 0.0) for x in (ref_lse, lse_bound))
        compare(got, want, allow, name="lse", axes=LSE_AXES, dtype=dt, rule=rule + " (lse)")
    return match


def assert_grads_match_oracle(
    grads: Any,
    query: Any,
    key: Any,
    value: Any,
    cotangent: Any,
    *,
    lse_cotangent: Any = None,
    dtype: Any = None,
    **options: Any,
) -> dict[str, Match]:
    """Assert that a kernel's ``grads = (dq, dk, dv[, dbias])`` of ``sum(cotangent * out) +
    sum(lse_cotangent * lse)``, ``out = fn(query, key, value, **options)``, equal the float64
    gradient oracle :func:`attnref.oracle.dot_product_attention_vjp` within
    :func:`attnref.tolerance.kernel_grad_error_bound` for ``dtype``, both from ``options``.

    ``grads``: ``jax.vjp``'s pullback or ``jax.grad(..., argnums=(0, 1, 2))``'s tuple;
    ``cotangent``: ``dO [B, T, N, H_v]``; ``dtype``, ``options`` as
    :func:`assert_matches_oracle`'s. Returns ``{"query": Match, "key": ..., "value": ...[,
    "bias": ...]}``.

    Raises:
        AssertionError: A wrong shape or an element off by more than its allowance: which
            gradient, how many, the worst index (``dq[b, t, n, h]``, ``dk[b, s, k, h]``,
            ``dv[b, s, k, h]``, ``dbias[b, n, t, s]``), both values, the ratio.
        TypeError: ``grads`` not 3 (with a ``bias``, 4) floating arrays, an unknown option or
            dtype.
        ValueError: Inputs, options or a cotangent the oracle refuses (its message).
    """
    __tracebackhide__ = True
    where = "assert_grads_match_oracle"
    if isinstance(grads, dict) or not isinstance(grads, Sequence):
        raise TypeError(
            f"{where}: grads must be a tuple (dq, dk, dv) or (dq, dk, dv, dbias), got "
            f"{type(grads).__name__}"
        )
    names = tuple(_GRADS)
    if len(grads) not in (3, 4) or (len(grads) == 4 and options.get("bias") is None):
        raise TypeError(
            f"{where}: grads must hold 3 arrays (dq, dk, dv), or 4 with a bias (dq, dk, dv, "
            f"dbias), got {len(grads)}" + (" without a bias option" if len(grads) == 4 else "")
        )
    got = [
        _floating(g, f"grads[{i}] (d{n})")
        for i, (g, n) in enumerate(zip(grads, names, strict=False))
    ]
    q, k, v = (_floating(x, n) for x, n in ((query, "query"), (key, "key"), (value, "value")))
    cot = _numpy(cotangent, "cotangent")
    opts = _options(where, options)
    dt = _compute_dtype(dtype, q, *got)
    kw = dict(cotangent=cot, lse_cotangent=lse_cotangent, **opts)
    exact = _call(where, oracle.dot_product_attention_vjp, q, k, v, **kw)
    bound = _call(where, tolerance.kernel_grad_error_bound, q, k, v, dtype=dt, **kw)
    rule = "tolerance.kernel_grad_error_bound"
    allowed: list[Any] = [getattr(bound, n) for n in names[: len(got)]]
    if is_16bit(dt):  # the gradients property's 16-bit rule (attnref._src.kit.conformance)
        wanted = [getattr(exact, n) for n in names[: len(got)]]
        (_, t_, n_, h_), (_, s_, k_, h_v) = q.shape, v.shape
        n_b = t_ * (n_ // max(k_, 1)) + s_ + h_ + h_v + 2  # the backward's longest chain
        allowed = _flash_allowances((q, k, v), opts, dt, cot, wanted, n_b)
        rule = (
            "FlashAttention's rule: 2 x attnref's own gradient error in this dtype + "
            "gamma_N(u) max|g|, N = T G + S + H + H_v + 2"
        )
    return {
        n: compare(
            g, getattr(exact, n), a, name=_GRADS[n][0], axes=_GRADS[n][1], dtype=dt, rule=rule
        )
        for n, g, a in zip(names, got, allowed, strict=False)
    }
