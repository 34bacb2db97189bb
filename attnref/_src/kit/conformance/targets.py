"""The conformance kit's view of the target: loading it by name, and :class:`Target`, which calls
it through its signature and checks the shape of what it returns."""

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
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from attnref import strategies as ast
from attnref._src.core.checks import device_array, enable_x64
from attnref._src.kit.conformance.torch_target import torch_forward, torch_vjp

# The axis of the kit's meshes (attnref's own distributed schemes name theirs the same).
AXIS = "devices"

_STATIC = ("scale", "is_causal", "local_window_size", "softcap", "sink_tokens", "dropout_rate")
_ARRAYS = (
    "bias", "mask", "query_seq_lengths", "key_value_seq_lengths", "segment_ids", "sinks",
    "dropout_mask",
)  # fmt: skip


# A clear refusal of a length: the exception types, and the words of the message (jax.numpy's
# "cannot reshape array", shard_map's "not evenly divisible", Pallas' "must be a multiple of" and
# its Triton lowering's "whose size is a power of 2").
REFUSAL_TYPES: tuple[type[Exception], ...] = (ValueError, NotImplementedError, TypeError)
REFUSAL_WORDS = ("divisib", "divide", "multiple", "length", "pad", "reshape", "power of 2")
_REFUSAL = re.compile("|".join(REFUSAL_WORDS), re.IGNORECASE)


def is_refusal(exc: BaseException) -> bool:
    """``exc`` is one of :data:`REFUSAL_TYPES` with one of :data:`REFUSAL_WORDS` (any case)."""
    return isinstance(exc, REFUSAL_TYPES) and _REFUSAL.search(str(exc)) is not None


def first_line(exc: BaseException) -> str:
    """``"<Type>: <first line>"``, memory addresses dropped, cut at 300 characters."""
    line = (str(exc).strip().splitlines() or [""])[0]
    line = re.sub(r" at 0x[0-9a-fA-F]+", "", line)
    line = line if len(line) <= 300 else line[:297] + "..."
    return f"{type(exc).__name__}: {line}" if line else type(exc).__name__


def x64_if(*arrays: Any) -> Any:
    """``jax.enable_x64`` where one of the arrays (or dtypes) is float64, else nothing."""
    wide = any(np.dtype(getattr(a, "dtype", a)) == np.float64 for a in arrays)
    return enable_x64() if wide else contextlib.nullcontext()


def load_target(spec: str) -> Callable[..., Any]:
    """Import ``"package.module:function"`` (or ``"package.module:object.attribute"``). Raises
    ``ValueError`` (not one ``:`` with text on both sides), ``ImportError``, ``AttributeError``
    or ``TypeError`` (not callable)."""
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
    """The 1-D mesh (axis :data:`AXIS`) over the first ``devices`` of ``jax.devices()``, cached."""
    return Mesh(jax.devices()[:devices], (AXIS,))


def _parameters(fn: Any) -> dict[str, inspect.Parameter] | None:
    try:
        return dict(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None


def takes_keyword(fn: Any, name: str) -> bool | None:
    """Whether ``fn`` accepts keyword ``name`` (``None``: its signature cannot be read)."""
    params = _parameters(fn)
    if params is None:
        return None
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def _lse_keyword(fn: Any) -> str:
    """``return_lse`` where ``fn`` names it (not ``return_residual``), else the latter."""
    params = _parameters(fn) or {}
    return next((kw for kw in ("return_residual", "return_lse") if kw in params), "return_residual")


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
    """``value`` as a numeric array of ``shape``, or an ``AssertionError`` naming ``what``."""
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


def _checked_grads(grads: Any, p: ast.KernelProblem) -> tuple[np.ndarray, ...]:
    return tuple(
        _checked_array(g, np.shape(x), f"gradient d/d{name}")
        for name, g, x in zip("qkv", grads, (p.q, p.k, p.v), strict=True)
    )


class Target:
    """Calls the user's function through its adapter, jitted where JAX's; with a ``mesh``, passes
    ``mesh=`` (and ``axis_name=``) and shards ``q, k, v`` along the sequence axis."""

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
        """``q, k, v`` sharded along axis 1 where the mesh size divides it, else replicated."""
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
        """``fn(*args)`` jitted once per ``key``, eagerly for NumPy or where jitting failed."""
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
        return tuple(jax.tree_util.tree_map(device_array, a) for a in args)

    @contextlib.contextmanager
    def _declared_limit(self, p: ast.KernelProblem) -> Any:
        """With ``refuses_lengths``, a clear refusal is recorded and the example rejected."""
        try:
            yield
        except Exception as exc:
            if not (self.refuses_lengths and is_refusal(exc)):
                raise
            self.refusals.append(f"T={p.config.t}, S={p.config.s}: {first_line(exc)}")
            hypothesis.reject()

    def compile_ahead(self, p: ast.KernelProblem, want_lse: bool = False) -> None:
        """Compile the jitted call that :meth:`forward` of ``p`` makes, on any thread, so that
        it finds the program compiled (JAX shares its compile cache). Only where that call is
        jitted and unsharded; a failure is left for :meth:`forward` to meet and report."""
        if self.signature in ("torch", "numpy") or self.mesh is not None:
            return
        static, arrays = split_options(p.options)
        key = ("forward", static, want_lse)
        if (*key, str(np.dtype(p.dtype))) in self._eager:
            return
        with contextlib.suppress(Exception), x64_if(p.dtype):
            self._jitted(key, self._raw(static, want_lse)).lower(p.q, p.k, p.v, arrays).compile()

    def forward(self, p: ast.KernelProblem, want_lse: bool = False) -> tuple[np.ndarray, Any]:
        """``(out [B, T, N, H_v], lse [B, T, N] or None)``, shapes checked."""
        self.last_call = (p, None)
        c = p.config
        with self._declared_limit(p):
            if self.signature == "torch":  # no lse: the signature refuses that feature
                out, lse = torch_forward(self.fn, p), None
            else:
                static, arrays = split_options(p.options)
                raw = self._raw(static, want_lse)
                key = ("forward", static, want_lse)
                out = self._invoke(key, raw, (p.q, p.k, p.v, arrays), p.dtype)
                if want_lse and (not isinstance(out, (tuple, list)) or len(out) != 2):
                    raise AssertionError(
                        f"asked for the lse ({self.lse_keyword}=True) but fn returned "
                        f"{type(out).__name__}, not a pair (out, lse)"
                    )
                out, lse = out if want_lse else (_first(out), None)
            out = _checked_array(out, (c.b, c.t, c.n, c.h_v), "output [B, T, N, H_v]")
            if want_lse and self.signature != "torch":
                what = f"lse [B, T, N] ({self.lse_keyword}=True)"
                lse = _checked_array(lse, (c.b, c.t, c.n), what)
            return out, lse

    def vjp(self, p: ast.KernelProblem, cotangent: np.ndarray) -> tuple[np.ndarray, ...]:
        """Gradients of ``<fn(q, k, v), cotangent>`` with respect to ``q, k, v``."""
        self.last_call = (p, cotangent)
        with self._declared_limit(p):
            if self.signature == "torch":
                return _checked_grads(torch_vjp(self.fn, p, cotangent), p)
            static, arrays = split_options(p.options)
            raw = self._raw(static, False)

            def grads(q: Any, k: Any, v: Any, arrays: dict[str, Any], cot: Any) -> Any:
                out, pull = jax.vjp(lambda a, b, c: _first(raw(a, b, c, arrays)), q, k, v)
                if tuple(out.shape) != tuple(cot.shape):  # raised again by the eager call
                    raise AssertionError(
                        f"fn returned its output [B, T, N, H_v] with shape "
                        f"{tuple(out.shape)}; expected {tuple(cot.shape)}"
                    )
                return pull(cot.astype(out.dtype))

            args = (p.q, p.k, p.v, arrays, cotangent)
            result = self._invoke(("vjp", static, False), grads, args, p.dtype)
            return _checked_grads(result, p)
