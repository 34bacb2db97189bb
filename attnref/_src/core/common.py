"""The row level (:data:`ROWS`, :data:`ROW_PROBES`) and helpers shared by the row-convention
formulations (projections, homogeneous coordinates)."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float

from attnref._src.core.checks import (
    HIGHEST,
    check_mask_and_bias,
    check_scale,
    check_tokens,
    device_array,
)
from attnref._src.core.entry import Guardable, Level
from attnref._src.core.nonfinite import (
    allowed_pairs,
    finite_bias,
    finite_part,
    nonfinite_rows,
    reads_nonfinite,
)
from attnref._src.core.params import AttentionParams, repeat_heads


# Pytrees (every field a child): :func:`attnref._src.core.entry.compiled` traces their arrays
# and keeps the rest (shapes, flags) static.
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Prepared:
    """Validated row-convention inputs (:func:`prepare_rows`), possibly non-finite: :meth:`run`
    evaluates a formula on their finite parts."""

    x_q: Array
    x_kv: Array
    mask: Array | None
    bias: Array | None  # in the dtype of x_q
    scale: Array  # scalar, in the dtype of x_q
    batch_shape: tuple[int, ...]
    t_q: int
    t_k: int
    params: Any = None  # AttentionParams (MLAParams at the MLA levels)
    residual: bool | None = None  # None: the function has no residual argument

    def run(self, formula: Callable[..., Any]) -> Any:
        """``formula(params, x_q, x_kv, mask, bias, scale[, residual])`` on the finite parts."""
        f = self.finite()
        args = (self.params, f.x_q, f.x_kv, f.mask, f.bias, f.scale)
        return formula(*args) if self.residual is None else formula(*args, self.residual)

    def head_mask(self) -> Bool[Array, "..."] | None:
        """The mask with a head axis inserted: broadcasts to ``[..., H, T_q, T_k]``."""
        return None if self.mask is None else jnp.expand_dims(self.mask, -3)

    def dirty_rows(self) -> Bool[Array, "... T_q"]:
        """Rows that read a non-finite value through an allowed pair (:func:`reads_nonfinite`)."""
        shape = (*self.batch_shape, self.t_q, self.t_k)
        return reads_nonfinite(
            allowed_pairs(self.mask, self.bias, shape),  # mask AND bias != -inf
            nonfinite_rows(self.x_q),
            nonfinite_rows(self.x_kv),
            self.bias,
            bool(self.residual),
        )

    def finite(self) -> Prepared:
        """A copy on the finite parts of ``x_q``, ``x_kv`` and the bias (:func:`finite_bias`)."""
        return dataclasses.replace(
            self,
            x_q=finite_part(self.x_q),
            x_kv=finite_part(self.x_kv),
            bias=finite_bias(self.bias),
        )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Call:
    """A formula's validated arguments, in its order, and its dirty rows (a level with a
    convention of its own); :meth:`run` reads the token arrays at indices ``tokens`` and the bias
    at ``bias`` through their finite parts. ``dirty`` is the rows' array, or a pytree with a
    ``dirty_rows()`` method (e.g. the :class:`Prepared` rows) that computes it inside the
    compiled program, not eagerly."""

    args: tuple[Any, ...]
    dirty: Any
    tokens: tuple[int, ...] = (1, 2)
    bias: int = 4

    def run(self, formula: Callable[..., Any]) -> Any:
        args = list(self.args)
        for i in self.tokens:
            args[i] = finite_part(args[i])
        args[self.bias] = finite_bias(args[self.bias])
        return formula(*args)

    def dirty_rows(self) -> Array:
        return self.dirty.dirty_rows() if hasattr(self.dirty, "dirty_rows") else self.dirty


def prepare_rows(
    params: Any,  # AttentionParams, or other weights checked by ``tokens``
    x_q: Any,
    x_kv: Any = None,
    mask: Any = None,
    bias: Any = None,
    scale: Any = None,
    residual: Any = None,
    *,
    tokens: Callable[[Any, Any], tuple[tuple[int, ...], int, int]] | None = None,
    d_k: int | None = None,
) -> Prepared:
    """Validate a row-convention call into :class:`Prepared` inputs (``x_kv=None``: ``x_q``;
    ``residual=None``: the function has none). ``tokens(x_q, x_kv)`` checks the tokens against
    other weights than :class:`AttentionParams` (returning the batch shape, ``T_q``, ``T_k``),
    ``d_k`` sets their default scale ``1/sqrt(d_k)`` (default: ``params.d_k``)."""
    x_kv = x_q if x_kv is None else x_kv
    check = functools.partial(check_tokens, params) if tokens is None else tokens
    batch, t_q, t_k = check(x_q, x_kv)
    check_mask_and_bias(mask, bias, (*batch, t_q, t_k))
    check_scale(scale)
    xq = device_array(x_q)
    return Prepared(
        x_q=xq,
        x_kv=device_array(x_kv),
        mask=None if mask is None else device_array(mask),
        bias=None if bias is None else device_array(bias, xq.dtype),
        scale=scale_value(params.d_k if d_k is None else d_k, scale, xq.dtype),
        batch_shape=batch,
        t_q=t_q,
        t_k=t_k,
        params=params,
        residual=residual,
    )


def _rows(
    params: AttentionParams,
    x_q: Float[ArrayLike, "... T_q d_model"],
    x_kv: Float[ArrayLike, "... T_k d_model"] | None = None,
    *,
    mask: Bool[ArrayLike, "... #T_q #T_k"] | None = None,
    bias: Float[ArrayLike, "... #T_q #T_k"] | None = None,
    scale: float | None = None,
    residual: bool = False,
) -> Prepared:
    return prepare_rows(params, x_q, x_kv, mask, bias, scale, residual)


_ROW_ARGS = """Args:
    params: Per-head weights (:class:`attnref.AttentionParams`); query head ``i`` reads
        key/value head ``i // G`` (``G = H / K``).
    x_q: Query tokens, row vectors ``[..., T_q, d_model]``, the dtype of ``params``.
    x_kv: Key/value tokens ``[..., T_k, d_model]`` with the batch shape of ``x_q``;
        ``None`` (default) means ``x_q`` (self-attention).
    mask: Boolean, broadcastable to ``[..., T_q, T_k]``, ``True`` = may attend; ``None``
        (default) allows every pair.
    bias: Floating additive bias, broadcastable to ``[..., T_q, T_k]``, added to the scaled
        logits (``-inf`` masks like ``False``); cast to the dtype of ``x_q``.
    scale: The logit scale; ``None`` (default) means ``1/sqrt(d_k)``.{more}

Raises:
    ValueError: If ``params`` is malformed, ``x_q``/``x_kv`` have rank < 2, the wrong
        ``d_model`` or different batch shapes, ``mask``/``bias`` do not broadcast to
        ``[..., T_q, T_k]``, or ``scale`` is not a scalar{also}.
    TypeError: If ``x_q``, ``x_kv`` and ``params`` mix dtypes, ``mask`` is not boolean,
        ``bias`` is not floating, or ``scale`` is not a real number{also_type}."""
RESIDUAL_ARG = """
    residual: If ``True``, return ``x_q + MultiHead`` (the residual-stream update)."""


def row_args(more: str = RESIDUAL_ARG, also: str = "", also_type: str = "") -> str:
    """The row level's Args and Raises text: ``more`` after ``scale``, ``also``/``also_type``
    further ``ValueError``/``TypeError`` cases."""
    return _ROW_ARGS.format(more=more, also=also, also_type=also_type)


# The shapes a row-level formula reads (validated and finite), written once.
Queries = Float[Array, "... T_q d_model"]
Keys = Float[Array, "... T_k d_model"]
Mask = Bool[Array, "... #T_q #T_k"] | None
Bias = Float[Array, "... #T_q #T_k"] | None


def rows_level(
    name: str,
    build: Callable[..., Guardable],
    args: str,
    options: dict[str, tuple[Any, str]],
    check: Callable[..., object] | None = None,
    residual: bool = True,
    validate: Callable[..., Prepared] = prepare_rows,
    params_type: str = "AttentionParams",
) -> Level:
    """A level whose ``prepare`` (named ``name``) has :data:`ROWS`' signature (without
    ``residual`` when ``residual=False``) plus keyword-only ``options`` (name -> (default,
    annotation)) and returns ``build(validate(...), scale, **options)`` after ``check(**options)``;
    ``params_type``: the weights' annotation."""
    base = inspect.signature(_rows)
    row_parameters = [p for p in base.parameters.values() if residual or p.name != "residual"]
    row_parameters[0] = row_parameters[0].replace(annotation=params_type)
    kind = inspect.Parameter.KEYWORD_ONLY
    extra = [inspect.Parameter(n, kind, default=d, annotation=a) for n, (d, a) in options.items()]
    signature = base.replace(parameters=[*row_parameters, *extra])

    def prepare(*positional: Any, **keywords: Any) -> Guardable:
        bound = signature.bind(*positional, **keywords)
        bound.apply_defaults()
        values = bound.arguments
        chosen = {n: values[n] for n in options}
        if check is not None:
            check(**chosen)
        rows = validate(*(values.get(n) for n in base.parameters))  # params, x_q, ..., residual
        return build(rows, values["scale"], **chosen)

    fn: Any = prepare
    fn.__signature__ = signature.replace(return_annotation="Guardable")
    fn.__name__ = fn.__qualname__ = name
    return Level(fn, args)


# The row level: ``(params, x_q, x_kv=None, *, mask, bias, scale, residual)``; formulas take
# ``(params, x_q, x_kv, mask, bias, scale, residual)``, positionally, validated and finite.
ROWS = Level(_rows, row_args())
# The same without ``residual`` (probes of the block: weights, per-head outputs).
ROW_PROBES = rows_level(
    "_row_probes", lambda rows, scale: rows, row_args(more=""), {}, residual=False
)
# What a row-level block returns, for ``public(..., returns=BLOCK_RETURNS)``.
BLOCK_RETURNS = (
    "The block output ``[..., T_q, d_model]``, the dtype of ``x_q``; a fully masked query row\n"
    "    is ``b_O`` (zero without biases)."
)


def scale_value(d_k: int, scale: Any, dtype: Any) -> Array:
    """``1/sqrt(d_k)`` unless an explicit ``scale`` is given, as a scalar of ``dtype``."""
    value = 1.0 / math.sqrt(d_k) if scale is None else scale
    return device_array(value, dtype)


def project(
    x: Float[Array, "... T d_model"], w: Float[ArrayLike, "H d_model d"], b: ArrayLike | None
) -> Float[Array, "... H T d"]:
    """Per-head projection ``x W[i] + b[i]`` with a head axis before the token axis."""
    y = jnp.einsum("...td,hde->...hte", x, w, precision=HIGHEST)
    return y if b is None else y + jnp.asarray(b)[:, None, :]


def project_kv(
    x: Float[Array, "... T d_model"],
    w: Float[ArrayLike, "K d_model d"],
    b: ArrayLike | None,
    group_size: int,
) -> Float[Array, "... H T d"]:
    """Key/value projection for every query head, ``x W[i // G] + b[i // G]`` (each K/V head
    projected once, then repeated)."""
    return repeat_heads(project(x, w, b), group_size, axis=-3)


# ----------------------------------------------------------------------------- homogeneous
# coordinates: x~ = [x, 1] and W~ = [W; b], so that x~ W~ = x W + b.


def homogeneous(x: Float[Array, "... d"]) -> Float[Array, "... d1"]:
    """Homogeneous coordinates ``x~ = [x, 1]`` on the last axis."""
    return jnp.concatenate([x, jnp.ones((*x.shape[:-1], 1), x.dtype)], axis=-1)


def homogeneous_weights(
    w: Float[ArrayLike, "H d_in d"], b: Float[ArrayLike, "H d"] | None, *, xp: Any = jnp
) -> Any:
    """``W~ = [W; b]`` per head: ``[H, d_in + 1, d]``, a zero last row when ``b`` is ``None``
    (built with ``xp``: ``jax.numpy`` or NumPy)."""
    wa = xp.asarray(w)
    row = xp.zeros((wa.shape[0], 1, wa.shape[2]), wa.dtype) if b is None else xp.asarray(b)[:, None]
    return xp.concatenate([wa, row], axis=1)


def add_output_bias(y: Float[Array, "... d_model"], params: AttentionParams) -> Array:
    return y if params.b_o is None else y + jnp.asarray(params.b_o)


def residual_or(y: Array, x: Array, residual: bool) -> Array:
    """``x + y`` for the residual-stream form, ``y`` otherwise."""
    return x + y if residual else y
