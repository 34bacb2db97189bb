"""RoPE's option checks, multi-head level :data:`ROPE_ROWS`, Args text (each written once),
family and cost models; the formulas are in :mod:`attnref._src.formulations.rope`."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool

from attnref import oracle, tolerance
from attnref._src.core import cost as _cost
from attnref._src.core.checks import dtype_of, is_traced, shape_of
from attnref._src.core.common import RESIDUAL_ARG, Prepared, row_args, rows_level
from attnref._src.core.family import Example, ExampleProblem, Family, masked_example
from attnref._src.formulations.standard import concat_cost
from attnref.oracle._checks import broadcasts
from attnref.oracle._rope import CONVENTIONS as CONVENTIONS  # the one copy (attnref.rope)
from attnref.oracle._rope import check_convention

F = TypeVar("F", bound=Callable[..., Any])

# ----------------------------------------------------------------------------- validation


def check_head_dim(head_dim: Any, name: str = "head_dim") -> int:
    d = int(head_dim)
    if d != head_dim or d < 2 or d % 2:
        raise ValueError(
            f"RoPE rotates pairs of features, so {name} must be a positive even integer; "
            f"got {name}={head_dim}"
        )
    return d


def check_base(base: Any) -> float:
    try:
        b = float(base)
    except (jax.errors.ConcretizationTypeError, TypeError) as err:
        raise TypeError(f"base must be a static Python number, got {base!r}") from err
    if not (np.isfinite(b) and b > 0.0):
        raise ValueError(f"base must be a positive finite number, got {base!r}")
    return b


def check_integer(name: str, a: Any) -> None:
    if not np.issubdtype(dtype_of(a), np.integer):
        raise TypeError(f"{name} must hold integer positions, got dtype {dtype_of(a)}")


def check_positions(name: str, positions: Any, lead: tuple[int, ...], t: int) -> None:
    """``positions`` must be integer and broadcast to ``lead + (t,)`` without growing it."""
    check_integer(name, positions)
    shape = shape_of(positions)
    target = (*lead, t)
    want = f"[T={t}] or a shape broadcasting to {list(target)}"
    if len(shape) < 1 or shape[-1] != t:
        raise ValueError(f"{name} has shape {shape}; expected {want}")
    if not broadcasts(shape, target):
        raise ValueError(f"{name} has shape {shape}, which does not broadcast to {want}")


def check_kernel_layout(x: Any, positions: Any, convention: Any) -> str:
    """``x [..., T, N, head_dim]`` floating with ``head_dim`` even, integer ``positions``."""
    conv = check_convention(convention)
    shape = shape_of(x)
    if len(shape) < 3:
        raise ValueError(f"x must have shape [..., T, N, head_dim] (rank >= 3), got {shape}")
    if not jnp.issubdtype(dtype_of(x), jnp.floating):
        raise TypeError(f"x must be floating, got dtype {dtype_of(x)}")
    check_head_dim(shape[-1], "head_dim (x.shape[-1])")
    check_positions("positions", positions, shape[:-3], shape[-3])
    return conv


# ----------------------------------------------------------------------------- Args text

_BASE = """
    base: The frequency base (default 10000, the paper's), a static positive finite number."""
_CONVENTION = """
    convention: ``"rotate_half"`` (default; pairs ``(x_p, x_{p + d/2})``) or
        ``"interleaved"`` (pairs ``(x_{2p}, x_{2p+1})``); static."""


def with_args(args: str, returns: str) -> Callable[[F], F]:
    """Append the Args/Raises text ``args`` (written once per signature) and ``returns`` to the
    docstring of the decorated function."""

    def attach(fn: F) -> F:
        fn.__doc__ = f"{inspect.cleandoc(fn.__doc__ or '')}\n\n{args}\n\nReturns:\n    {returns}\n"
        return fn

    return attach


FREQUENCY_ARGS = f"""Args:
    head_dim: The (even, positive) head dimension ``d``.{_BASE}
    dtype: The result dtype (default float32).

Raises:
    ValueError: If ``head_dim`` is not a positive even integer, or ``base`` is not positive
        and finite.
    TypeError: If ``base`` is not a static Python number."""

KERNEL_ARGS = f"""Args:
    x: Queries or keys ``[..., T, N, head_dim]``, floating, ``head_dim`` even.
    positions: Integer positions ``[..., T]`` or ``[T]``, broadcasting to ``x.shape[:-2]``
        (shared by all heads).{_BASE}{_CONVENTION}

Raises:
    ValueError: If ``x`` has rank < 3 or an odd ``head_dim``, ``positions`` do not broadcast
        to ``[..., T]``, ``base`` is not positive and finite, or ``convention`` is unknown.
    TypeError: If ``x`` is not floating, ``positions`` are not integers, or ``base`` is not
        a static Python number."""

ROTATION_ARGS = f"""Args:
    delta: Integer offsets, any shape ``[...]``.
    head_dim: The (even, positive) head dimension.{_BASE}{_CONVENTION}
    dtype: The entries' dtype (default float32).

Raises:
    ValueError: If ``head_dim`` is not a positive even integer, ``base`` is not positive and
        finite, or ``convention`` is unknown.
    TypeError: If ``delta`` is not integer, or ``base`` is not a static Python number."""

PATTERN_ARGS = f"""Args:
    params: Per-head weights (:class:`attnref.AttentionParams`), ``d_k`` even; query head
        ``n`` uses key head ``g(n) = n // (H / K)``.
    deltas: Integer offsets ``[D]`` (query position minus key position).{_BASE}{_CONVENTION}

Raises:
    ValueError: If ``params`` is malformed or ``d_k`` is odd, ``deltas`` is not 1-D,
        ``base`` is not positive and finite, or ``convention`` is unknown.
    TypeError: If ``deltas`` is not integer, or ``base`` is not a static Python number."""

# ----------------------------------------------------------------------------- the row level


class Rotary(NamedTuple):
    """The rotation of a multi-head RoPE call: integer positions (NumPy ``arange(T)`` by
    default), the frequency base and the pair convention."""

    pos_q: Any
    pos_k: Any
    base: float
    convention: str


class Positions:
    """Concrete positions as static data of a compiled program, compared and hashed by value
    (the program sees NumPy constants)."""

    def __init__(self, value: Any) -> None:
        self.value = np.asarray(value)

    def _key(self) -> tuple[Any, ...]:
        return (self.value.shape, self.value.dtype.str, self.value.tobytes())

    def __hash__(self) -> int:
        return hash(self._key())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Positions) and self._key() == other._key()


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RopeInputs:
    """Validated inputs of a multi-head RoPE call: the row inputs plus the rotation's positions,
    base and convention; a pytree, so :func:`attnref._src.core.entry.compiled` runs it as one
    program. The default positions (``None``: NumPy ``arange(T)``) and concrete positions under
    a caller's trace (:class:`Positions`) are static, so their offsets stay static
    (:func:`attnref._src.formulations.rope.distinct_offsets`); in an eager call, given positions
    are traced, so one program serves every position (a decoding loop compiles once)."""

    rows: Prepared
    pos_q: Any
    pos_k: Any
    base: float
    convention: str

    @property
    def rot(self) -> Rotary:
        """The rotation, concrete positions as NumPy arrays."""
        pos_q, pos_k = (
            np.arange(t) if p is None else p.value if isinstance(p, Positions) else p
            for p, t in ((self.pos_q, self.rows.t_q), (self.pos_k, self.rows.t_k))
        )
        return Rotary(pos_q, pos_k, self.base, self.convention)

    def run(self, formula: Callable[..., Any]) -> Any:
        """``formula(params, x_q, x_kv, mask, bias, scale, residual, rot)`` on the finite parts."""
        return self.rows.run(lambda *row_args: formula(*row_args, self.rot))

    def dirty_rows(self) -> Bool[Array, "... T_q"]:
        return self.rows.dirty_rows()


def rotary(
    positions_q: Any,
    positions_kv: Any,
    batch: tuple[int, ...],
    t_q: int,
    t_k: int,
    base: float,
    convention: str,
) -> Rotary:
    """The rotation of a call: checked positions (``None``: ``arange(T)``, NumPy constants, so
    the offsets stay static under jit), ``base`` and ``convention``."""
    given = (("positions_q", positions_q, t_q), ("positions_kv", positions_kv, t_k))
    for name, pos, t in given:
        if pos is not None:
            check_positions(name, pos, batch, t)
    pos_q, pos_k = (np.arange(t) if pos is None else pos for _, pos, t in given)
    return Rotary(pos_q, pos_k, base, convention)


def rotated(
    rows: Prepared, positions_q: Any, positions_kv: Any, base: Any, convention: Any
) -> RopeInputs:
    """Validated rows plus their checked rotation (positions ``None``: ``arange(T)``; concrete
    positions static under a caller's trace, traced in an eager call)."""
    base, convention = check_base(base), check_convention(convention)
    rotary(positions_q, positions_kv, rows.batch_shape, rows.t_q, rows.t_k, base, convention)
    under_trace = is_traced(rows.x_q, rows.x_kv)
    pos_q, pos_k = (
        Positions(p) if under_trace and p is not None and not is_traced(p) else p
        for p in (positions_q, positions_kv)
    )
    return RopeInputs(rows, pos_q, pos_k, base, convention)


def _rope_inputs(rows: Prepared, scale: Any, **rope: Any) -> RopeInputs:
    check_head_dim(rows.params.d_k, "d_k (params.w_q.shape[2])")
    return rotated(rows, **rope)


_POSITIONS = """
    positions_q: Integer query positions ``[..., T_q]`` or ``[T_q]``; ``None`` (default)
        means ``arange(T_q)``.
    positions_kv: Integer key positions ``[..., T_k]`` or ``[T_k]``; ``None`` (default)
        means ``arange(T_k)``."""

# Formulas take ``(params, x_q, x_kv, mask, bias, scale, residual, rot)``, validated, finite.
ROPE_ROWS = rows_level(
    "prepare_rope",
    _rope_inputs,
    row_args(
        RESIDUAL_ARG + _POSITIONS + _BASE + _CONVENTION,
        also=";\n        or ``d_k`` is odd, positions do not broadcast, ``base`` is not positive "
        "and finite,\n        or ``convention`` is unknown",
        also_type=";\n        or positions are not integers, or ``base`` is not a static Python "
        "number",
    ),
    {
        "positions_q": (None, 'Int[ArrayLike, "... T_q"] | None'),
        "positions_kv": (None, 'Int[ArrayLike, "... T_k"] | None'),
        "base": (10000.0, "float"),
        "convention": ("rotate_half", "str"),
    },
)

# ----------------------------------------------------------------------------- the RoPE family


def _rope_example(problem: ExampleProblem, causal: bool) -> Example:
    """The softmax family's example (a causal mask or none); default positions ``arange(T)``,
    rotate-half pairs."""
    example = masked_example(problem, causal)
    return dataclasses.replace(example, note="rotate_half, " + example.note)


ROPE = Family(
    name="rope",
    oracle=oracle.rope_attention,
    bound=tolerance.rope_attention_error_bound,
    signature="apply(params, x_q, x_kv=None, *, mask=None, bias=None, scale=None, "
    "residual=False, positions_q=None, positions_kv=None, base=10000.0, "
    "convention='rotate_half')",
    note="Scale $1/\\sqrt{d_k}$ unless `scale=` is given; positions default to `arange(T)`; "
    "`convention='rotate_half'` pairs $(x_p, x_{p + d/2})$, `'interleaved'` pairs $(x_{2p}, "
    "x_{2p+1})$. Fully masked rows as in the softmax family (output $b_O$); see "
    "[RoPE](../rope.md).",
    equation_symbols=("R(",),
    static_argnames=("residual", "base", "convention"),
    example=_rope_example,
)

ROFORMER = (
    "Su et al. (2024), RoFormer: Enhanced Transformer with Rotary Position Embedding, "
    "Neurocomputing 568 (arXiv:2104.09864)."
)

# ----------------------------------------------------------------------------- cost models
#
# The cost models assume the default positions ``arange(T_q)``, ``arange(T_k)`` (shape ``[T]``,
# shared by the batch and the heads, so ``cos``/``sin`` are evaluated ``(T_q + T_k) d_k / 2``
# times each; see ``attnref._src.core.cost._angles``), with the counting conventions of
# ``attnref._src.core.cost``.


def rope_cost(
    d: _cost.Dims, *, positions_batch: int = 1, traced_positions: bool = False
) -> _cost.Cost:
    """Concat's counts plus the rotations of ``q`` and ``k`` (``a c - b s``, ``a s + b c``: 6
    elementwise ops per pair, head and token; a rotation is not a ``dot``) and the angles
    ``m theta_p`` (one multiply per position and plane). ``positions_batch``: the position rows
    (1 for ``[T]``, ``B`` for ``[B, T]``); ``traced_positions``: ``jit`` arguments, not
    constants."""
    c = concat_cost(d)
    b, h, half = d.batch, d.heads, d.d_k // 2
    el_a, tr_a, angle_tensors = _cost.angles(positions_batch * (d.t_q + d.t_k), d, traced_positions)
    pairs = b * h * (d.t_q + d.t_k) * half  # rotated pairs of q and k
    # per side: the two halves (slices), four products, two sums, the merged result
    rotation_tensors = [
        n for t in (d.t_q, d.t_k) for n in [b * h * t * half] * 8 + [b * h * t * d.d_k]
    ]
    tensors = angle_tensors + rotation_tensors
    extra = sum(tensors) * d.itemsize
    return dataclasses.replace(
        c,
        elementwise_flops=c.elementwise_flops + _cost.ROTATE_PER_PAIR * pairs + el_a,
        transcendentals=c.transcendentals + tr_a,
        intermediate_bytes=max(c.intermediate_bytes, max(tensors) * d.itemsize),
        workspace_bytes=c.workspace_bytes + extra,
    )


def rope_patterns_cost(
    d: _cost.Dims, *, offsets: int | None = None, traced_positions: bool = False
) -> _cost.Cost:
    """The relative pattern-matrix form. ``U = offsets`` pattern matrices are formed (default
    ``T_q + T_k - 1``: the default positions; concrete positions give the distinct values of
    ``pos_q[i] - pos_k[j]``, traced positions ``[B, T]`` give ``B T_q T_k``, with
    ``traced_positions=True``), each from a rotation ``R(delta)`` built elementwise from 0/+-1
    patterns (``d_k / 2`` planes of ``d_k^2`` entries: two multiplies and an add each, then the
    sum over planes) and ``W~_Q R W~_K^T`` (the einsum contracts ``W~_Q R`` first:
    ``2 H U D1 d_k^2 + 2 H U D1^2 d_k``, ``D1 = d_model + 1``). The logits contract ``x~_i``
    with the gathered ``W~_P`` first (``2 B H T_q T_k D1^2``), then with ``x~_j``
    (``2 B H T_q T_k D1``). Values go through the merged ``W~_M = W~_V W_O`` (homogeneous, so
    ``b_V W_O`` is a row of it and costs no elementwise add). The gathered
    ``[B, H, T_q, T_k, D1, D1]`` tensor is the largest intermediate."""
    b, h, dm, dk, dv, tq, tk = d.batch, d.heads, d.d_model, d.d_k, d.d_v, d.t_q, d.t_k
    u = tq + tk - 1 if offsets is None else offsets
    d1, half = dm + 1, dk // 2
    logits = b * h * tq * tk
    el_a, tr_a, angle_tensors = _cost.angles(u, d, traced_positions)
    mm = (
        2 * h * u * d1 * dk * dk  # W~_Q R(delta)
        + 2 * h * u * d1 * d1 * dk  # (W~_Q R) W~_K^T
        + 2 * logits * d1 * d1  # x~_i W~_P
        + 2 * logits * d1  # (x~_i W~_P) x~_j^T
        + 2 * h * d1 * dv * dm  # W~_M = W~_V W_O
        + 2 * b * tk * d1 * h * dm  # messages x~_kv W~_M
        + 2 * logits * dm  # sum_j a_ij M_j
    )
    el = (
        el_a
        + 3 * u * half * dk * dk  # c P_cos, s P_sin and their sum, per plane
        + u * (half - 1) * dk * dk  # the sum over planes
        + _cost.softmax_elementwise(d)
        + b * (h - 1) * tq * dm  # the sum over heads
        + (b * tq * dm if d.bias else 0)  # b_O
    )
    tensors = [
        *angle_tensors,
        h * d1 * dk,  # W~_Q, W~_K, W~_V
        h * d1 * dk,
        h * d1 * dv,
        *[u * half * dk * dk] * 3,  # the rotation's per-plane terms and their sum
        u * dk * dk,  # R(delta)
        h * u * d1 * dk,  # W~_Q R
        h * u * d1 * d1,  # W~_P
        h * tq * tk * d1 * d1,  # gathered per (i, j)
        b * h * tq * tk * d1 * d1,  # broadcast over the batch
        b * tq * d1,  # x~_q, x~_kv
        b * tk * d1,
        b * h * tq * tk * d1,  # x~_i W~_P
        *_cost.softmax_tensors(d, logits),
        h * d1 * dm,  # W~_M
        b * h * tk * dm,  # messages
        b * h * tq * dm,  # per-head mixes
        b * tq * dm,  # y
    ]
    return _cost.finish(d, mm, el, logits + tr_a, tensors)
