"""Input validation and float64 scoping shared by every formulation.

Every check here runs on static information (shapes and dtypes), so errors are raised at trace
time, inside or outside ``jax.jit``, and name the offending argument and its shape.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

F = TypeVar("F", bound=Callable[..., Any])

# The fields of AttentionParams, in declaration order (the one copy: params.py checks it against
# the dataclass at import; checks.py cannot import params.py, which imports it).
WEIGHT_FIELDS = ("w_q", "w_k", "w_v", "w_o")
BIAS_FIELDS = ("b_q", "b_k", "b_v", "b_o")
PARAM_FIELDS = WEIGHT_FIELDS + BIAS_FIELDS

HIGHEST = "highest"  # full-precision matmuls (no TF32/bf16 passes on GPU/TPU): this is a reference


def _enable_x64_context() -> Any:
    """Return JAX's scoped ``jax_enable_x64`` context manager (location moved across versions)."""
    ctx = getattr(jax, "enable_x64", None)
    if ctx is not None:
        return ctx(True)
    from jax import experimental  # pragma: no cover - JAX releases before jax.enable_x64

    return experimental.enable_x64()  # type: ignore[attr-defined]


def x64_enabled() -> bool:
    """Whether ``jax_enable_x64`` is on in the current (possibly scoped) configuration."""
    return bool(jax.config.read("jax_enable_x64"))


def enable_x64() -> Any:
    """A context manager that switches ``jax_enable_x64`` on within its scope."""
    return _enable_x64_context()


def _is_float64(leaf: Any) -> bool:
    dtype = getattr(leaf, "dtype", None)
    return dtype is not None and np.dtype(dtype) == np.float64


def float64_scoped(fn: F) -> F:
    """Run ``fn`` with ``jax_enable_x64`` switched on when any array argument is float64.

    JAX silently turns float64 inputs into float32 while x64 is off. attnref refuses that
    silent downgrade: a call whose inputs (arrays or parameter leaves) are float64 runs inside a
    scoped ``jax.enable_x64(True)``, so the computation and the returned array are float64.
    Under a caller's own ``jax.jit`` the inputs are already tracers of JAX's canonical dtype,
    so callers who jit attnref themselves must enable x64 themselves (JAX's own rule).
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if x64_enabled():
            return fn(*args, **kwargs)
        leaves = jax.tree_util.tree_leaves((args, kwargs))
        if any(_is_float64(leaf) for leaf in leaves):
            with _enable_x64_context():
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def in_x64_if_float64(dtype: Any, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, with x64 switched on when ``dtype`` is float64 (for functions
    whose dtype is an argument rather than an input array's: cf. :func:`float64_scoped`)."""
    if np.dtype(dtype) == np.float64 and not x64_enabled():
        with _enable_x64_context():
            return fn(*args, **kwargs)
    return fn(*args, **kwargs)


def shape_of(x: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in np.shape(x))


def dtype_of(x: Any) -> np.dtype[Any]:
    dtype = getattr(x, "dtype", None)
    return np.dtype(dtype) if dtype is not None else np.asarray(x).dtype


def is_traced(*xs: Any) -> bool:
    """Whether any of ``xs`` is a JAX tracer (its values are unknown at trace time)."""
    return any(isinstance(x, jax.core.Tracer) for x in xs)


def check_params(params: Any) -> tuple[int, int, int, int]:
    """Validate an :class:`~attnref.AttentionParams`; return ``(H, d_model, d_k, d_v)``.

    Shapes: ``w_q [H, d_model, d_k]``, ``w_k [K, d_model, d_k]``, ``w_v [K, d_model, d_v]``,
    ``w_o [H, d_v, d_model]``, ``b_q [H, d_k]``, ``b_k [K, d_k]``, ``b_v [K, d_v]``,
    ``b_o [d_model]``, with ``K`` key/value heads and ``H % K == 0`` (``K == H``: multi-head,
    ``1 < K < H``: grouped-query, ``K == 1``: multi-query attention).
    """
    for name in WEIGHT_FIELDS:
        w = getattr(params, name, None)
        if w is None:
            raise TypeError(f"params.{name} is missing; expected an AttentionParams pytree")
        if np.ndim(w) != 3:
            raise ValueError(
                f"params.{name} must have rank 3 (per-head layout), got shape {shape_of(w)}"
            )
    h, d_model, d_k = shape_of(params.w_q)
    if h < 1:
        raise ValueError(f"params.w_q has shape {shape_of(params.w_q)}; it needs at least one head")
    if d_k < 1:
        raise ValueError(
            f"params.w_q has shape {shape_of(params.w_q)}; d_k must be >= 1 (the default scale "
            "1/sqrt(d_k) is undefined at 0)"
        )
    kv, dmk, dkk = shape_of(params.w_k)
    if (dmk, dkk) != (d_model, d_k):
        raise ValueError(
            f"params.w_k has shape {shape_of(params.w_k)} but params.w_q has shape "
            f"{(h, d_model, d_k)}; expected w_k [K, d_model={d_model}, d_k={d_k}]"
        )
    if kv < 1 or h % kv:
        raise ValueError(
            f"params.w_k has {kv} heads but params.w_q has {h} (shapes {shape_of(params.w_k)} and "
            f"{shape_of(params.w_q)}); num_heads must be a multiple of num_kv_heads"
        )
    hv, dmv, d_v = shape_of(params.w_v)
    if dmv != d_model:
        raise ValueError(
            f"params.w_v has shape {shape_of(params.w_v)}; expected "
            f"[K={kv}, d_model={d_model}, d_v]"
        )
    if hv != kv:
        raise ValueError(
            f"params.w_k has shape {shape_of(params.w_k)} but params.w_v has shape "
            f"{shape_of(params.w_v)}; keys and values must have the same number of heads "
            "(num_kv_heads)"
        )
    if shape_of(params.w_o) != (h, d_v, d_model):
        raise ValueError(
            f"params.w_o has shape {shape_of(params.w_o)}; expected [H={h}, d_v={d_v}, "
            f"d_model={d_model}] to match params.w_q {shape_of(params.w_q)} and params.w_v "
            f"{shape_of(params.w_v)}"
        )
    expected_bias = {
        "b_q": ((h, d_k), "[H, d_k]"),
        "b_k": ((kv, d_k), "[K, d_k]"),
        "b_v": ((kv, d_v), "[K, d_v]"),
        "b_o": ((d_model,), "[d_model]"),
    }
    for name, (shape, axes) in expected_bias.items():
        b = getattr(params, name)
        if b is not None and shape_of(b) != shape:
            raise ValueError(
                f"params.{name} has shape {shape_of(b)}; expected {axes} = {shape} "
                f"(H={h} query heads, K={kv} key/value heads)"
            )
    dtypes = {
        name: dtype_of(getattr(params, name))
        for name in PARAM_FIELDS
        if getattr(params, name) is not None
    }
    first = dtypes["w_q"]
    if not jnp.issubdtype(first, jnp.floating):
        raise TypeError(f"params.w_q has dtype {first}; attention parameters must be floating")
    for name, dt in dtypes.items():
        if dt != first:
            raise TypeError(
                f"params.{name} has dtype {dt} but params.w_q has dtype {first}; attnref does "
                "not mix dtypes, cast the parameters explicitly"
            )
    return h, d_model, d_k, d_v


def check_tokens(
    params: Any,
    x_q: Any,
    x_kv: Any,
    *,
    layout: str = "row",
    names: tuple[str, str] = ("x_q", "x_kv"),
) -> tuple[tuple[int, ...], int, int]:
    """Validate token inputs against the parameters; return ``(batch_shape, T_q, T_k)``.

    ``layout="row"`` expects ``[..., T, d_model]``; ``layout="column"`` expects
    ``[..., d_model, T]``.
    """
    _, d_model, _, _ = check_params(params)
    p_dtype = dtype_of(params.w_q)
    feat_axis, tok_axis = (-1, -2) if layout == "row" else (-2, -1)
    want = "[..., T, d_model]" if layout == "row" else "[..., d_model, T]"
    for name, x in zip(names, (x_q, x_kv), strict=True):
        if np.ndim(x) < 2:
            raise ValueError(f"{name} must have rank >= 2 ({want}), got shape {shape_of(x)}")
        if shape_of(x)[feat_axis] != d_model:
            raise ValueError(
                f"{name} has shape {shape_of(x)} but params have d_model={d_model}; expected {want}"
            )
        if dtype_of(x) != p_dtype:
            raise TypeError(
                f"{name} has dtype {dtype_of(x)} but params.w_q has dtype {p_dtype}; attnref does "
                "not mix dtypes, cast explicitly"
            )
    bq, bkv = shape_of(x_q)[:-2], shape_of(x_kv)[:-2]
    if bq != bkv:
        raise ValueError(
            f"{names[0]} has batch shape {bq} (shape {shape_of(x_q)}) but {names[1]} has batch "
            f"shape {bkv} (shape {shape_of(x_kv)}); batch dimensions must match exactly"
        )
    return bq, shape_of(x_q)[tok_axis], shape_of(x_kv)[tok_axis]


def check_mask_and_bias(
    mask: Any,
    bias: Any,
    target: tuple[int, ...],
    *,
    axes: str = "[..., T_q, T_k]",
) -> None:
    """Check that ``mask`` (boolean) and ``bias`` (floating) broadcast to ``target`` exactly.

    Broadcasting may only add or stretch leading/size-1 axes; it may never grow ``target``.
    """
    for name, arr, kind in (("mask", mask, "bool"), ("bias", bias, "float")):
        if arr is None:
            continue
        shape = shape_of(arr)
        if len(shape) < 2:
            raise ValueError(
                f"{name} must have rank >= 2 with its last two axes {axes}, got shape {shape}"
            )
        try:
            ok = np.broadcast_shapes(shape, target) == target
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(
                f"{name} has shape {shape}, which does not broadcast to {axes} = {target}"
            )
        dt = dtype_of(arr)
        if kind == "bool" and dt != np.bool_:
            raise TypeError(
                f"mask must be boolean (True = may attend), got dtype {dt}; pass additive "
                "scores through bias instead"
            )
        if kind == "float" and not jnp.issubdtype(dt, jnp.floating):
            raise TypeError(f"bias must be floating, got dtype {dt}")


def real_dtype(dt: Any) -> bool:
    """A real floating or integer dtype (bool and complex are not)."""
    return bool(jnp.issubdtype(dt, jnp.floating) or jnp.issubdtype(dt, jnp.integer))


def check_scale(scale: Any) -> None:
    """A scale is a Python or NumPy real scalar, or a 0-d array (traced is fine).

    ``ValueError`` for a non-scalar, ``TypeError`` for a scalar that is not a real number (text,
    bool, complex).
    """
    if scale is None:
        return
    if isinstance(scale, (str, bytes)):
        raise TypeError(f"scale must be a real number, got {scale!r}")
    if np.ndim(scale) != 0:
        raise ValueError(f"scale must be a scalar, got shape {shape_of(scale)}")
    if not real_dtype(dtype_of(scale)):
        raise TypeError(f"scale must be a real number, got {scale!r} (dtype {dtype_of(scale)})")


# ----------------------------------------------------------------------------- the kernel level


def check_kernel_arrays(
    query: Any, key: Any, value: Any
) -> tuple[tuple[int, int, int, int], tuple[int, int, int], Any]:
    """``query [B, T, N, H]``, ``key [B, S, K, H]``, ``value [B, S, K, H_v]`` of one floating
    dtype with ``N`` a positive multiple of ``K`` and ``H >= 1``; returns
    ``((B, T, N, H), (S, K, H_v), dtype)``."""
    for name, x in (("query", query), ("key", key), ("value", value)):
        if np.ndim(x) != 4:
            layout = "[B, T, N, H]" if name == "query" else "[B, S, K, H]"
            raise ValueError(f"{name} must have rank 4 ({layout}), got shape {shape_of(x)}")
    (b, t, n, h), (bk, s, kh, hk), (bv, sv, kv, h_v) = map(shape_of, (query, key, value))
    shapes = f"query {shape_of(query)}, key {shape_of(key)}, value {shape_of(value)}"
    if bk != b or bv != b:
        raise ValueError(f"batch sizes differ: {shapes}")
    if hk != h:
        raise ValueError(
            f"key has head dim {hk} (shape {shape_of(key)}) but query has {h} "
            f"(shape {shape_of(query)})"
        )
    if (sv, kv) != (s, kh):
        raise ValueError(
            f"value has shape {shape_of(value)}; expected [B, S={s}, K={kh}, H_v] to "
            f"match key {shape_of(key)}"
        )
    if kh < 1:
        raise ValueError(
            f"key has K=0 heads (shape {shape_of(key)}); it needs at least one K/V head"
        )
    if n < 1 or n % kh:
        raise ValueError(
            f"query has N={n} heads (shape {shape_of(query)}) and key has K={kh} "
            f"(shape {shape_of(key)}); N must be a positive multiple of K for GQA/MQA"
        )
    if h < 1:
        raise ValueError(
            f"query has head dim H=0 (shape {shape_of(query)}); H must be >= 1 (the default scale "
            "1/sqrt(H) is undefined at 0)"
        )
    dtypes = {nm: dtype_of(x) for nm, x in (("query", query), ("key", key), ("value", value))}
    if not jnp.issubdtype(dtypes["query"], jnp.floating):
        raise TypeError(f"query must be floating, got dtype {dtypes['query']}")
    if len(set(dtypes.values())) != 1:
        raise TypeError(f"query, key and value must share one dtype, got {dtypes}; cast explicitly")
    return (b, t, n, h), (s, kh, h_v), dtypes["query"]


def check_softcap(softcap: Any) -> float | None:
    """``None``, or a positive finite Python (or NumPy) real number, as a float."""
    if softcap is None:
        return None
    ok = (
        not isinstance(softcap, (str, bytes, bool, np.bool_))
        and np.ndim(softcap) == 0
        and not is_traced(softcap)
        and real_dtype(dtype_of(softcap))
    )
    cap = float(softcap) if ok else None
    if cap is None or not (math.isfinite(cap) and cap > 0):
        raise ValueError(f"softcap must be a positive finite Python number, got {softcap!r}")
    return cap


def check_window(local_window_size: Any) -> tuple[int | None, int | None] | None:
    """``None``, ``w`` or ``(left, right)`` (ints >= 0, ``None`` = unbounded side) as a pair;
    bools and floats are refused (``TypeError``), a pair of the wrong length or a negative side
    too (``ValueError``)."""
    if local_window_size is None:
        return None
    if isinstance(local_window_size, (int, np.integer)) and not isinstance(
        local_window_size, (bool, np.bool_)
    ):
        pair: tuple[Any, Any] = (local_window_size, local_window_size)
    elif isinstance(local_window_size, (tuple, list)):
        if len(local_window_size) != 2:
            raise ValueError(
                "local_window_size must be an int or a (left, right) pair (None = unbounded), "
                f"got {local_window_size!r}"
            )
        pair = (local_window_size[0], local_window_size[1])
    else:
        raise TypeError(
            "local_window_size must be an int or a (left, right) pair of ints (None = "
            f"unbounded), got {local_window_size!r}"
        )
    out: list[int | None] = []
    for side, w in zip(("left", "right"), pair, strict=True):
        if w is None:
            out.append(None)
            continue
        if not isinstance(w, (int, np.integer)) or isinstance(w, (bool, np.bool_)):
            raise TypeError(f"local_window_size {side} must be an int or None, got {w!r}")
        if w < 0:
            raise ValueError(
                f"local_window_size {side} = {w} is negative; a query at position p attends to "
                "keys in [p - left, p + right], so both sides must be >= 0"
            )
        out.append(int(w))
    return (out[0], out[1])


def check_ints(name: str, x: Any, shape: tuple[int, ...], upper: int | None) -> Any:
    """An integer array (or list) of exactly ``shape``; when concrete, every entry in
    ``[0, upper]`` (``upper=None``: no range). Returned as int32, ``None`` passes through."""
    if x is None:
        return None
    if shape_of(x) != shape:
        raise ValueError(f"{name} has shape {shape_of(x)}; expected {shape}")
    dt = dtype_of(x)
    if not np.issubdtype(dt, np.integer):
        raise TypeError(f"{name} must be integer, got dtype {dt}")
    if upper is not None and not is_traced(x):
        arr = np.asarray(x)
        if arr.size and (arr.min() < 0 or arr.max() > upper):
            raise ValueError(
                f"{name} = {arr.tolist()} is out of range; every length must lie in [0, {upper}]"
            )
    return jnp.asarray(x, dtype=jnp.int32)
