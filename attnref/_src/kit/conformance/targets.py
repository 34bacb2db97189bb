"""The conformance kit's view of the target: loading it by name, and the adapter
(:class:`Target`) that calls it through its signature, jitted where the signature is JAX's (one
jitted callable per static option set, shared across ``check_attention`` calls), and checks the
shape of what it returns. A distributed target gets a ``mesh`` (:func:`mesh`) and its inputs
``q, k, v`` sharded along the sequence axis over it."""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import re
from collections.abc import Callable
from typing import Any

import hypothesis
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from attnref import strategies as ast
from attnref._src.core.checks import enable_x64
from attnref._src.kit.conformance.torch_target import torch_forward, torch_vjp

# The axis of the kit's meshes (attnref's own distributed schemes name theirs the same).
AXIS = "devices"

_STATIC = ("scale", "is_causal", "local_window_size", "softcap", "sink_tokens", "dropout_rate")
_ARRAYS = (
    "bias", "mask", "query_seq_lengths", "key_value_seq_lengths", "segment_ids", "sinks",
    "dropout_mask",
)  # fmt: skip


# A clear refusal of a length (uneven_lengths' rule, and a target that declares refuses_lengths):
# the exception types, and the words (case-insensitive, anywhere in the message) that say the
# refusal is about the length. "reshape" is jax.numpy's refusal ("cannot reshape array of shape
# (1, 65) ... into shape (1, 4, 16)") in a kernel that cuts the sequence into equal chunks;
# shard_map's own refusal says "not evenly divisible"; Pallas' flash attention says "q_seq_len=129
# must be a multiple of block_q=128".
REFUSAL_TYPES: tuple[type[Exception], ...] = (ValueError, NotImplementedError, TypeError)
REFUSAL_WORDS = ("divisib", "divide", "multiple", "length", "pad", "reshape")
_REFUSAL = re.compile("|".join(REFUSAL_WORDS), re.IGNORECASE)


def is_refusal(exc: BaseException) -> bool:
    """Whether ``exc`` is a clear refusal of a length: an instance of :data:`REFUSAL_TYPES`
    whose message contains one of :data:`REFUSAL_WORDS` (case-insensitive)."""
    return isinstance(exc, REFUSAL_TYPES) and _REFUSAL.search(str(exc)) is not None


def first_line(exc: BaseException) -> str:
    """``"<Type>: <the message's first line>"``, memory addresses dropped (a function's repr in
    shard_map's message) and cut at 300 characters."""
    line = (str(exc).strip().splitlines() or [""])[0]
    line = re.sub(r" at 0x[0-9a-fA-F]+", "", line)
    line = line if len(line) <= 300 else line[:297] + "..."
    return f"{type(exc).__name__}: {line}" if line else type(exc).__name__


def x64_if(*arrays: Any) -> Any:
    """``jax.enable_x64`` where one of the arrays (or dtypes) is float64, else nothing."""
    wide = any(np.dtype(getattr(a, "dtype", a)) == np.float64 for a in arrays)
    return enable_x64() if wide else contextlib.nullcontext()


def load_target(spec: str) -> Callable[..., Any]:
    """Import a callable by name: ``"package.module:function"`` -> ``package.module.function``
    (or ``"package.module:object.attribute"``). Raises ``ValueError`` (not exactly one ``:``
    with text on both sides), ``ImportError``, ``AttributeError`` (an attribute on the path is
    missing) or ``TypeError`` (the object found is not callable)."""
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


def describe_target(fn: Any) -> str:
    if isinstance(fn, functools.partial):
        kw = ", ".join(f"{k}={v!r}" for k, v in fn.keywords.items())
        return f"functools.partial({describe_target(fn.func)}{', ' if kw else ''}{kw})"
    module = getattr(fn, "__module__", None)
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    if module and name:
        return f"{module}:{name}"
    return repr(fn)


@functools.cache
def mesh(devices: int) -> Mesh:
    """The 1-D mesh (axis :data:`AXIS`) over the first ``devices`` of ``jax.devices()``; cached,
    so that jitted callers see the same mesh and reuse their programs."""
    return Mesh(jax.devices()[:devices], (AXIS,))


def _parameters(fn: Any) -> dict[str, inspect.Parameter] | None:
    try:
        return dict(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None


def takes_keyword(fn: Any, name: str) -> bool | None:
    """Whether ``fn`` accepts the keyword ``name`` (by name or through ``**kwargs``); ``None``
    when its signature cannot be read."""
    params = _parameters(fn)
    if params is None:
        return None
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def _lse_keyword(fn: Any) -> str:
    """The keyword that asks ``fn`` for the lse: ``return_residual`` (jax.nn) or ``return_lse``
    (attnref), whichever ``fn`` names; for ``fn(..., **kw)`` naming neither, ``return_residual``."""
    params = _parameters(fn) or {}
    return next((kw for kw in ("return_residual", "return_lse") if kw in params), "return_residual")


class _ShapeError(Exception):
    """Raised while tracing the target's vjp when its output has the wrong shape."""


# jitted callables shared across check_attention calls: (fn, signature, kind, static) -> jitted
_JIT_CACHE: dict[tuple[Any, ...], Callable[..., Any]] = {}
_JIT_CACHE_MAX = 512


def split_options(options: dict[str, Any]) -> tuple[tuple[tuple[str, Any], ...], dict[str, Any]]:
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


class Target:
    """Calls the user's function through its adapter, jitted where the signature is JAX's; with a
    ``mesh`` (a distributed target), passes ``mesh=`` (and ``axis_name=`` where ``fn`` names that
    parameter) and shards ``q, k, v`` along their sequence axis over the mesh."""

    def __init__(
        self,
        fn: Callable[..., Any],
        signature: str,
        mesh: Mesh | None = None,
        refuses_lengths: bool = False,
    ) -> None:
        self.fn = fn
        self.signature = signature
        self.mesh = mesh
        # a declared limit: a clear refusal of the call's lengths skips the example
        self.refuses_lengths = refuses_lengths
        self.refusals: list[str] = []  # each refused call's first line, in order
        self._eager: set[tuple[Any, ...]] = set()  # (kind, static, lse, dtype) that failed jit
        self.notes: list[str] = []
        # the problem and cotangent (None: a forward call) of the latest call, as passed
        self.last_call: tuple[ast.KernelProblem, np.ndarray | None] | None = None
        self.lse_keyword = _lse_keyword(fn)
        params = _parameters(fn) or {}
        self._mesh_kw: dict[str, Any] = {}
        if mesh is not None:
            self._mesh_kw["mesh"] = mesh
            if "axis_name" in params:
                self._mesh_kw["axis_name"] = AXIS

    # the raw call: (q, k, v, arrays) -> whatever fn returns
    def _raw(self, static: tuple[tuple[str, Any], ...], want_lse: bool) -> Callable[..., Any]:
        fn, signature, lse_kw, mesh_kw = self.fn, self.signature, self.lse_keyword, self._mesh_kw

        def call(q: Any, k: Any, v: Any, arrays: dict[str, Any]) -> Any:
            if signature == "qkv_mask":
                return fn(q, k, v, arrays["mask"])
            kw = dict(arrays)
            kw.update(static)
            kw.update(mesh_kw)
            if want_lse:
                kw[lse_kw] = True
            return fn(q, k, v, **kw)

        return call

    def _sharded(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """``q, k, v`` (the first three arguments) placed on the mesh, sharded along the
        sequence axis (axis 1) where the mesh size divides it, else replicated."""
        on = self.mesh
        if on is None:
            return args

        def place(x: Any) -> Any:
            spec = PartitionSpec(None, AXIS) if np.shape(x)[1] % on.size == 0 else PartitionSpec()
            return jax.device_put(x, NamedSharding(on, spec))

        return (*(place(x) for x in args[:3]), *args[3:])

    def _jitted(self, key: tuple[Any, ...], fn: Callable[..., Any]) -> Any:
        full = (self.fn, self.signature, self.mesh, *key)
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
        with x64_if(dtype):
            args = self._sharded(args)
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

    @contextlib.contextmanager
    def _declared_limit(self, p: ast.KernelProblem) -> Any:
        """With ``refuses_lengths``, a clear refusal (:func:`is_refusal`) of the call is recorded
        in :attr:`refusals` and the example rejected (``hypothesis.reject()``: Hypothesis draws
        another; the production sweep skips the case); anything else propagates."""
        try:
            yield
        except Exception as exc:
            if not (self.refuses_lengths and is_refusal(exc)):
                raise
            self.refusals.append(f"T={p.config.t}, S={p.config.s}: {first_line(exc)}")
            hypothesis.reject()

    def forward(self, p: ast.KernelProblem, want_lse: bool = False) -> tuple[np.ndarray, Any]:
        """``(out, lse or None)`` as NumPy arrays, each checked to be a numeric array of the
        expected shape (``out [B, T, N, H_v]``, ``lse [B, T, N]``) before any comparison."""
        with self._declared_limit(p):
            return self._forward(p, want_lse)

    def _forward(self, p: ast.KernelProblem, want_lse: bool) -> tuple[np.ndarray, Any]:
        self.last_call = (p, None)
        c = p.config
        if self.signature == "torch":  # no lse: the signature refuses that feature
            out = torch_forward(self.fn, p)
            return _checked_array(out, (c.b, c.t, c.n, c.h_v), "output [B, T, N, H_v]"), None
        static, arrays = split_options(p.options)
        raw = self._raw(static, want_lse)
        result = self._invoke(("forward", static, want_lse), raw, (p.q, p.k, p.v, arrays), p.dtype)
        if want_lse:
            if not isinstance(result, (tuple, list)) or len(result) != 2:
                raise AssertionError(
                    f"asked for the lse ({self.lse_keyword}=True) but fn returned "
                    f"{type(result).__name__}, not a pair (out, lse)"
                )
            out = _checked_array(result[0], (c.b, c.t, c.n, c.h_v), "output [B, T, N, H_v]")
            lse = _checked_array(
                result[1], (c.b, c.t, c.n), f"lse [B, T, N] ({self.lse_keyword}=True)"
            )
            return out, lse
        return _checked_array(_first(result), (c.b, c.t, c.n, c.h_v), "output [B, T, N, H_v]"), None

    def vjp(self, p: ast.KernelProblem, cotangent: np.ndarray) -> tuple[np.ndarray, ...]:
        """Gradients of ``<fn(q, k, v), cotangent>`` with respect to ``q, k, v``."""
        with self._declared_limit(p):
            return self._vjp(p, cotangent)

    def _vjp(self, p: ast.KernelProblem, cotangent: np.ndarray) -> tuple[np.ndarray, ...]:
        self.last_call = (p, cotangent)
        if self.signature == "torch":
            return tuple(
                _checked_array(g, np.shape(x), f"gradient d/d{name}")
                for name, g, x in zip(
                    "qkv", torch_vjp(self.fn, p, cotangent), (p.q, p.k, p.v), strict=True
                )
            )
        static, arrays = split_options(p.options)
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
