"""Input validation and float64 scoping shared by every formulation.

Every check here runs on static information (shapes and dtypes), so errors are raised at trace
time, inside or outside ``jax.jit``, and name the offending argument and its shape.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from attnref.oracle import _checks as oc
from attnref.oracle._checks import check_kernel_arrays as check_kernel_arrays  # written once
from attnref.oracle._checks import dtype_of as dtype_of  # (NumPy only)
from attnref.oracle._checks import shape_of as shape_of

F = TypeVar("F", bound=Callable[..., Any])

# The fields of AttentionParams, in declaration order (the one copy: params.py checks it against
# the dataclass at import; checks.py cannot import params.py, which imports it).
WEIGHT_FIELDS = ("w_q", "w_k", "w_v", "w_o")
BIAS_FIELDS = ("b_q", "b_k", "b_v", "b_o")
PARAM_FIELDS = WEIGHT_FIELDS + BIAS_FIELDS

HIGHEST = "highest"  # full-precision matmuls (no TF32/bf16 passes on GPU/TPU): this is a reference


def enable_x64() -> Any:
    """A context manager that switches ``jax_enable_x64`` on within its scope."""
    return jax.enable_x64(True)


def x64_enabled() -> bool:
    """Whether ``jax_enable_x64`` is on in the current (possibly scoped) configuration."""
    return bool(jax.config.read("jax_enable_x64"))


def _is_float64(leaf: Any) -> bool:
    dtype = getattr(leaf, "dtype", None)
    return dtype is not None and np.dtype(dtype) == np.float64


def _in_x64_if(needed: bool, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, with x64 switched on when ``needed`` and not on already."""
    if needed and not x64_enabled():
        with enable_x64():
            return fn(*args, **kwargs)
    return fn(*args, **kwargs)


def float64_scoped(fn: F) -> F:
    """Run ``fn`` with ``jax_enable_x64`` switched on when any array argument is float64 (JAX
    would silently downgrade it; under a caller's own ``jax.jit`` the caller enables x64)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        leaves = () if x64_enabled() else jax.tree_util.tree_leaves((args, kwargs))
        return _in_x64_if(any(map(_is_float64, leaves)), fn, *args, **kwargs)

    return wrapper  # type: ignore[return-value]


def in_x64_if_float64(dtype: Any, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, with x64 switched on when ``dtype`` is float64 (for functions
    whose dtype is an argument rather than an input array's: cf. :func:`float64_scoped`)."""
    return _in_x64_if(np.dtype(dtype) == np.float64, fn, *args, **kwargs)


def device_array(x: Any, dtype: Any = None) -> Any:
    """``jnp.asarray(x, dtype)``, without compiling for NumPy or Python-scalar input. JAX 0.10
    lifts such a value with a compiled identity program (``jit(stage)``) per new shape and dtype,
    and casts it with a compiled ``convert_element_type``; here NumPy casts on the host (as
    ``jax.device_put`` canonicalizes dtypes) and ``device_put`` copies (a Python scalar stays
    weakly typed without ``dtype``, as with ``jnp.asarray``). JAX arrays, tracers and lists go
    to ``jnp.asarray``."""
    if isinstance(x, (np.ndarray, np.generic, bool, int, float, complex)):
        return jax.device_put(x if dtype is None else np.asarray(x, dtype))
    return jnp.asarray(x, dtype)


def is_traced(*xs: Any) -> bool:
    """Whether any of ``xs`` is a JAX tracer (its values are unknown at trace time)."""
    return any(isinstance(x, jax.core.Tracer) for x in xs)


def jax_heads_message(sq: tuple[int, ...], sk: tuple[int, ...], sv: tuple[int, ...]) -> str:
    """The JAX functions' wording of the ``H % K`` error (the oracle words it its own way)."""
    return (
        f"params.w_k has {sk[0]} heads but params.w_q has {sq[0]} (shapes {sk} and {sq}); "
        "num_heads must be a multiple of num_kv_heads"
    )


def check_params(params: Any) -> tuple[int, int, int, int]:
    """Validate an :class:`~attnref.AttentionParams` (the oracle's static checks, shapes as in
    ``attnref._src.core.params``); return ``(H, d_model, d_k, d_v)``."""
    h, _, d_model, d_k, d_v = oc.check_params(params, heads_text=jax_heads_message)
    return h, d_model, d_k, d_v


def check_tokens(
    params: Any,
    x_q: Any,
    x_kv: Any,
    *,
    layout: str = "row",
    names: tuple[str, str] = ("x_q", "x_kv"),
) -> tuple[tuple[int, ...], int, int]:
    """Validate token inputs (``[..., T, d_model]``, or ``[..., d_model, T]`` for
    ``layout="column"``); return ``(batch_shape, T_q, T_k)``."""
    _, d_model, _, _ = check_params(params)
    return oc.check_tokens(d_model, dtype_of(params.w_q), x_q, x_kv, layout=layout, names=names)


def check_mask_and_bias(
    mask: Any, bias: Any, target: tuple[int, ...], *, axes: str = "[..., T_q, T_k]"
) -> None:
    """Check that ``mask`` (boolean) and ``bias`` (floating) broadcast to ``target`` exactly
    (never growing it)."""
    oc.check_mask_and_bias_kinds(mask, bias, target, axes)


def check_scale(scale: Any) -> None:
    """A scale is a real scalar or a 0-d array (traced is fine): ``ValueError`` for a
    non-scalar, ``TypeError`` for text, bool or complex."""
    if scale is not None:
        oc.check_real_kind("scale", scale)


# ----------------------------------------------------------------------------- the kernel level


def check_softcap(softcap: Any) -> float | None:
    """``None``, or a positive finite Python (or NumPy) real number, as a float."""
    return oc.check_softcap(softcap, concrete=not is_traced(softcap))


def check_window(local_window_size: Any) -> tuple[int | None, int | None] | None:
    """``None``, ``w`` or ``(left, right)`` (ints >= 0, ``None`` = unbounded side) as a pair;
    bools and floats are refused (``TypeError``), a pair of the wrong length or a negative side
    too (``ValueError``)."""
    return None if local_window_size is None else oc.check_window(local_window_size)


def check_ints(name: str, x: Any, shape: tuple[int, ...], upper: int | None) -> Any:
    """An integer array (or list) of exactly ``shape``; when concrete, every entry in
    ``[0, upper]`` (``upper=None``: no range). Returned as int32, ``None`` passes through."""
    if x is None:
        return None
    oc.check_ints(name, x, shape, upper, concrete=not is_traced(x))
    return device_array(x, jnp.int32)
