"""Kernel-level problems: :class:`KernelProblem`, :func:`make_kernel_problem` and the strategies
:func:`kernel_problems` and :func:`mixed_kernel_problems`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
from hypothesis import note
from hypothesis import strategies as st

from attnref import oracle, tolerance
from attnref._src.formulations.kernel import STATIC_OPTIONS
from attnref.oracle import KernelGrads

from ._masks import (
    BIAS_SHAPE_KINDS,
    MASK_KINDS,
    MASK_SHAPE_KINDS,
    kind_name,
    make_options,
    mask_kind_tuple,
    mask_kinds,
)
from ._shapes import (
    BROADCAST_SHAPES,
    Config,
    DrawFn,
    ShortRepr,
    broadcast_shapes,
    check_kernel_batch,
    configs_strategy,
    with_dtype,
)

IDENTICAL = ("none", "keys", "queries")  # the "identical rows" special case


def kernel_inputs(
    config: Config, seed: int, *, identical: str = "none", scale: float = 1.0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``q [B, T, N, H]``, ``k [B, S, K, H]``, ``v [B, S, K, H_v]``: PCG64 ``seed`` standard
    normal (``q``, ``k`` times ``scale``) in ``config.dtype``; ``identical`` repeats key (or
    query) row 0 everywhere (:data:`IDENTICAL`)."""
    if identical not in IDENTICAL:
        raise ValueError(f"identical must be one of {IDENTICAL}, got {identical!r}")
    check_kernel_batch(config)
    c = config
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((c.b, c.t, c.n, c.h))
    k = rng.standard_normal((c.b, c.s, c.k, c.h))
    v = rng.standard_normal((c.b, c.s, c.k, c.h_v))
    if scale != 1.0:  # (x * 1.0 == x: no pass over the arrays for the common case)
        q, k = q * scale, k * scale
    if identical == "keys":
        k[:] = k[:, :1]
    elif identical == "queries":
        q[:] = q[:, :1]
    dt = np.dtype(c.dtype)
    return q.astype(dt, copy=False), k.astype(dt, copy=False), v.astype(dt, copy=False)


def _describe(value: Any) -> str:
    if isinstance(value, np.ndarray):
        if value.ndim <= 1 and value.size <= 8:
            return repr(value.tolist())
        return f"{value.dtype}{list(value.shape)}"
    if isinstance(value, tuple) and all(isinstance(v, np.ndarray) for v in value):
        return "(" + ", ".join(_describe(v) for v in value) + ")"
    return repr(value)


@dataclasses.dataclass
class KernelProblem(ShortRepr):
    """``q [B, T, N, H]``, ``k [B, S, K, H]``, ``v [B, S, K, H_v]``, the keyword ``options`` of
    :func:`attnref.dot_product_attention`, the :class:`Config`, the mask ``kind`` (``+``-joined
    for a mix), the ``seed``, the ``identical`` case and the oracle's semantics."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    options: dict[str, Any]
    config: Config
    kind: str = "none"
    seed: int = 0
    identical: str = "none"
    masked_rows: str = "zeros"
    causal_alignment: str = "top_left"

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={_describe(v)}" for k, v in sorted(self.options.items()))
        extra = "" if self.identical == "none" else f", identical={self.identical!r}"
        return (
            f"KernelProblem({self.config!r}, kind={self.kind!r}, seed={self.seed}{extra}, "
            f"options={{{opts}}})"
        )

    @property
    def dtype(self) -> np.dtype[Any]:
        """``config.dtype``."""
        return np.dtype(self.config.dtype)

    def semantics(self) -> dict[str, Any]:
        """``{"masked_rows": ..., "causal_alignment": ...}``, the oracle's semantics."""
        return {"masked_rows": self.masked_rows, "causal_alignment": self.causal_alignment}

    @property
    def kwargs(self) -> dict[str, Any]:
        """The ``options``, and the semantics where not the defaults."""
        default = {"masked_rows": "zeros", "causal_alignment": "top_left"}
        return {**self.options, **{k: v for k, v in self.semantics().items() if v != default[k]}}

    @property
    def static(self) -> dict[str, Any]:
        """The entries of :attr:`kwargs` in :data:`STATIC_OPTIONS`."""
        return {k: v for k, v in self.kwargs.items() if k in STATIC_OPTIONS}

    def apply(self, fn: Callable[..., Any], **kw: Any) -> Any:
        """``fn(q, k, v, **kw)`` with the problem's options and semantics."""
        return fn(self.q, self.k, self.v, **kw, **self.semantics(), **self.options)

    def allowed(self) -> np.ndarray:
        """The allowed pairs ``[B, N, T, S]`` (:func:`attnref.oracle.kernel_allowed`)."""
        c = self.config
        values = ("softcap", "scale", "sinks", "dropout_mask", "dropout_rate")  # not the set's
        kw = {k: v for k, v in self.options.items() if k not in values}
        return oracle.kernel_allowed(
            (c.b, c.n, c.t, c.s), causal_alignment=self.causal_alignment, **kw
        )

    def oracle(self, method: str = "fast") -> tuple[np.ndarray, np.ndarray]:
        """Float64 ``(out [B, T, N, H_v], lse [B, T, N])`` (``method`` ``"fast"`` or
        ``"definition"``)."""
        return self.apply(oracle.dot_product_attention, return_lse=True, method=method)

    def oracle_vjp(
        self, cotangent: Any, lse_cotangent: Any = None, method: str = "fast"
    ) -> KernelGrads:
        """Float64 gradients ``(query, key, value, bias)`` of ``sum(cotangent * out) +
        sum(lse_cotangent * lse)`` from :func:`attnref.oracle.dot_product_attention_vjp`."""
        vjp = oracle.dot_product_attention_vjp
        return self.apply(vjp, cotangent=cotangent, lse_cotangent=lse_cotangent, method=method)

    def bound(self, key_blocks: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """:func:`attnref.tolerance.kernel_call_error_bound` of ``(out, lse)`` in the problem's
        dtype (``key_blocks=None``: any tiling)."""
        return self.apply(tolerance.kernel_call_error_bound, key_blocks=key_blocks)

    def grad_bound(self, cotangent: Any, lse_cotangent: Any = None) -> KernelGrads:
        """:func:`attnref.tolerance.kernel_grad_error_bound` in the problem's dtype."""
        bound = tolerance.kernel_grad_error_bound
        return self.apply(bound, cotangent=cotangent, lse_cotangent=lse_cotangent)

    def replace(self, **changes: Any) -> KernelProblem:
        """A copy with fields replaced; ``config`` follows the new array shapes and dtype."""
        new = dataclasses.replace(self, **changes)
        b, t, n, h = new.q.shape
        s, kh, h_v = new.k.shape[1], new.k.shape[2], new.v.shape[3]
        cfg = dataclasses.replace(
            new.config, batch=b, t=t, s=s, n=n, k=kh, h=h, h_v=h_v, dtype=str(new.q.dtype)
        )
        return dataclasses.replace(new, config=cfg)

    def batch_slice(self, b: int) -> KernelProblem:
        """Batch element ``b`` alone (every per-example option sliced with it)."""
        opts: dict[str, Any] = {}
        for key, val in self.options.items():
            if key in ("query_seq_lengths", "key_value_seq_lengths") or (
                key in ("mask", "bias") and np.shape(val)[0] > 1
            ):
                val = val[b : b + 1]
            elif key == "segment_ids":
                val = tuple(a[b : b + 1] for a in val) if isinstance(val, tuple) else val[b : b + 1]
            opts[key] = val
        sl = slice(b, b + 1)
        return self.replace(q=self.q[sl], k=self.k[sl], v=self.v[sl], options=opts)

    def astype(self, dtype: Any) -> KernelProblem:
        """The same problem with ``q, k, v`` (and a float bias) rounded to ``dtype``."""
        dt = np.dtype(dtype)
        opts = dict(self.options)
        if "bias" in opts:
            opts["bias"] = np.asarray(opts["bias"]).astype(dt)
        return self.replace(
            q=self.q.astype(dt), k=self.k.astype(dt), v=self.v.astype(dt), options=opts
        )


def make_kernel_problem(
    config: Config,
    kind: str | tuple[str, ...] = "none",
    seed: int = 0,
    dtype: Any = None,
    *,
    identical: str = "none",
    scale: float = 1.0,
    masked_rows: str = "zeros",
    causal_alignment: str = "top_left",
    mask_shape: str | None = None,
    bias_shape: str | None = None,
    static: dict[str, Any] | None = None,
    empty_rows: bool = False,
) -> KernelProblem:
    """The :class:`KernelProblem` behind one draw of :func:`kernel_problems` (or, with
    ``static`` and several kinds, :func:`mixed_kernel_problems`): inputs by
    :func:`kernel_inputs` (``scale`` multiplies ``q`` and ``k``), options by
    :func:`make_options`; ``dtype`` overrides ``config.dtype``. ``static``: a
    :data:`STATIC_PROFILES` entry (static options only, else ``ValueError``), whose semantics
    override ``masked_rows`` and ``causal_alignment``."""
    c = with_dtype(config, dtype)
    extra = dict(static or {})
    masked_rows = extra.pop("masked_rows", masked_rows)
    causal_alignment = extra.pop("causal_alignment", causal_alignment)
    if not set(extra) <= set(STATIC_OPTIONS) - {"return_lse"}:
        raise ValueError(f"static takes static options {STATIC_OPTIONS}, got {sorted(extra)}")
    kinds = mask_kind_tuple(kind)
    q, k, v = kernel_inputs(c, seed, identical=identical, scale=scale)
    opts = make_options(
        c,
        kinds,
        seed,
        causal_alignment=causal_alignment,
        mask_shape=mask_shape,
        bias_shape=bias_shape,
        empty_rows=empty_rows,
    )
    opts.update(extra)
    name = kind if isinstance(kind, str) else kind_name(kinds)
    return KernelProblem(q, k, v, opts, c, name, seed, identical, masked_rows, causal_alignment)


@st.composite
def kernel_problems(
    draw: DrawFn,
    configs: st.SearchStrategy[Config] | None = None,
    *,
    kinds: tuple[str, ...] = MASK_KINDS,
    identical_rows: bool = False,
    masked_rows: str = "zeros",
    causal_alignment: str = "top_left",
    mask_shapes: tuple[str, ...] | None = BROADCAST_SHAPES,
    bias_shapes: tuple[str, ...] | None = BROADCAST_SHAPES,
) -> KernelProblem:
    """A :class:`KernelProblem` (:func:`make_kernel_problem`), labelled draws of a config (default
    :func:`configs`), a kind from ``kinds``, a seed, with ``identical_rows`` the identical-rows
    case one time in four, and a mask's or bias's broadcast shape from ``mask_shapes`` /
    ``bias_shapes`` (``None``: the kind's fixed shape)."""
    config = draw(configs_strategy() if configs is None else configs, label="config")
    kind = draw(mask_kinds(kinds=tuple(kinds)), label="mask kind")
    mask_shape = bias_shape = None
    if kind in MASK_SHAPE_KINDS and mask_shapes is not None:
        mask_shape = draw(broadcast_shapes(tuple(mask_shapes)), label="mask shape")
    if kind in BIAS_SHAPE_KINDS and bias_shapes is not None:
        bias_shape = draw(broadcast_shapes(tuple(bias_shapes)), label="bias shape")
    identical = "none"
    if identical_rows:  # one draw in four, on purpose (shrinks towards "none")
        identical = draw(st.sampled_from(("none", "none", *IDENTICAL[1:])), label="identical rows")
    seed = draw(st.integers(0, 2**32 - 1), label="data seed")
    shapes = "".join(
        f" {name}={value}"
        for name, value in (("mask_shape", mask_shape), ("bias_shape", bias_shape))
        if value is not None
    )
    note(f"config={config!r} kind={kind}{shapes} identical={identical} seed={seed}")
    return make_kernel_problem(
        config,
        kind,
        seed,
        identical=identical,
        masked_rows=masked_rows,
        causal_alignment=causal_alignment,
        mask_shape=mask_shape,
        bias_shape=bias_shape,
    )
