"""The distributed family: its :class:`~attnref._src.core.family.Family`, the mesh helpers every
scheme shares, and a scheme's public kernel (the kernel signature plus ``mesh`` and
``axis_name``) and row form (the registry ``apply``); see ``docs/distributed.md``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jaxtyping import Array

from attnref import oracle, tolerance
from attnref._src.core.checks import is_traced
from attnref._src.core.common import Call, Prepared, rows_level
from attnref._src.core.family import Family
from attnref._src.core.params import AttentionParams
from attnref._src.core.registry import Formulation, register
from attnref._src.formulations.distributed import cost as _dcost
from attnref._src.formulations.kernel import (
    KernelCall,
    Option,
    kernel_public,
    kernel_rows,
    option_args,
    row_call,
    rows_public,
)
from attnref._src.formulations.kernel_spec import KernelInputs, KernelSpec

DEFAULT_AXIS = "devices"


@functools.cache
def default_mesh(devices: int | None = None) -> Mesh:
    """A 1-D mesh (axis ``"devices"``) over the first ``devices`` devices (default: all).

    Args:
        devices: How many of ``jax.devices()`` to use; ``None`` (default) means all of them.

    Returns:
        The mesh (cached: equal arguments give the same mesh, so jitted callers reuse programs).

    Raises:
        ValueError: If ``devices`` is not a positive int at most ``jax.device_count()``.
    """
    available = jax.devices()
    n = len(available) if devices is None else devices
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= len(available):
        raise ValueError(
            f"devices must be an int in [1, {len(available)}] (jax.device_count()), got "
            f"{devices!r}; on one host, XLA_FLAGS=--xla_force_host_platform_device_count=8 "
            "gives 8 virtual CPU devices"
        )
    return Mesh(available[:n], (DEFAULT_AXIS,))


def head_mesh(num_heads: int) -> Mesh:
    """:func:`default_mesh` over the largest device count ``P`` that divides ``num_heads``."""
    n = max(p for p in range(1, jax.device_count() + 1) if num_heads % p == 0)
    return default_mesh(n)


def mesh_axis(mesh: Any, axis_name: str | None) -> tuple[str, int]:
    """``(axis_name, P)``: the mesh axis a scheme runs over (``None``: a 1-D mesh's only one)."""
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    names = tuple(mesh.axis_names)
    if axis_name is None:
        if len(names) != 1:
            raise ValueError(
                f"mesh has axes {names} (shape {dict(mesh.shape)}); name the one to run over "
                "with axis_name="
            )
        axis_name = names[0]
    if axis_name not in names:
        raise ValueError(f"axis_name {axis_name!r} is not an axis of the mesh (axes {names})")
    return axis_name, int(mesh.shape[axis_name])


def split_scale(scale: Any) -> tuple[float | None, Array | None]:
    """``(static float, traced array)``: the caller's ``scale`` split for a jitted scheme."""
    if scale is None:
        return None, None
    if is_traced(scale):
        return None, jnp.asarray(scale)
    return float(scale), None


def optional(**arrays: Any) -> dict[str, Any]:
    """The given arrays without the ``None`` entries (a ``shard_map`` argument pytree)."""
    return {name: a for name, a in arrays.items() if a is not None}


def mesh_args(inputs: KernelInputs, traced_scale: Array | None, **changed: Any) -> dict[str, Any]:
    """A scheme's ``shard_map`` argument: the kernel's arrays (``changed`` replacing some) and a
    traced scale, without the ``None`` ones."""
    fields = {f.name: getattr(inputs, f.name) for f in dataclasses.fields(inputs)}
    return optional(**{**fields, **changed, "scale": traced_scale})


def check_heads(n: int, devices: int, axis_name: str, scheme: str, what: str) -> None:
    """Refuse a head count ``n`` that the ``devices`` of ``axis_name`` do not divide."""
    if n % devices:
        raise ValueError(
            f"{what} has N={n} query heads, which the P={devices} devices of mesh axis "
            f"{axis_name!r} do not divide: {scheme} gives each device N/P whole query heads "
            "(use a mesh axis whose size divides N)"
        )


class MeshRun(NamedTuple):
    """The static part of a scheme's call (hashable: its jitted program's key)."""

    spec: KernelSpec
    scale: float | None
    mesh: Mesh
    axis: str
    devices: int


def mesh_schedule(
    program: Callable[..., tuple[Array, Array]], heads: str | None = None
) -> Callable[..., tuple[Array, Array]]:
    """The schedule of a scheme whose jitted ``shard_map`` program takes ``(run: MeshRun, inputs,
    traced_scale)``; ``heads``: a head-parallel scheme's name, its ``P`` checked against ``N``."""
    jitted = jax.jit(program, static_argnums=0)

    def schedule(call: KernelCall, mesh: Any, axis_name: str | None) -> tuple[Array, Array]:
        axis, devices = mesh_axis(mesh, axis_name)
        if heads is not None:
            check_heads(call.spec.n, devices, axis, heads, f"query {tuple(call.inputs.q.shape)}")
        static, traced = split_scale(call.scale)
        return jitted(MeshRun(call.spec, static, mesh, axis, devices), call.inputs, traced)

    schedule.__module__ = program.__module__
    return schedule


# ----------------------------------------------------------------------------- public functions

_MESH = Option("mesh", inspect.Parameter.empty, "Mesh", "A ``jax.sharding.Mesh`` "
               "(:func:`attnref.distributed.default_mesh`).")  # fmt: skip


def mesh_kernel(
    schedule: Callable[..., tuple[Array, Array]],
    *,
    name: str,
    summary: str,
    axis: str,
    returns: str = "",
    value_errors: str = "",
    type_errors: str = "",
) -> Callable[..., Any]:
    """The public kernel ``name`` of a scheme: the kernel signature plus ``mesh`` and
    ``axis_name`` (:func:`~attnref._src.formulations.kernel.kernel_public`); ``schedule(call,
    mesh, axis_name)``. ``axis``: what the scheme splits over the mesh axis."""
    axis_name = Option("axis_name", None, "str | None", f"The mesh axis {axis}; ``None`` "
                       "(default): the only axis of a 1-D mesh.")  # fmt: skip
    return kernel_public(
        schedule,
        name=name,
        summary=summary,
        options=(_MESH, axis_name),
        refuses=("sinks", "sink_tokens", "dropout_mask", "dropout_rate"),
        compile=False,  # the scheme jits its own program, a concrete scale static in its key
        returns=returns,
        value_errors="; if ``axis_name`` is not an axis of ``mesh`` (or is ``None`` for a "
        "mesh with several axes)" + value_errors,
        type_errors=", or ``mesh`` is not a ``jax.sharding.Mesh``" + type_errors,
    )


def _mesh_row_args(heads: bool) -> str:
    """The Args text of a scheme's row form: the row level's plus ``mesh``."""
    default = (
        "the most devices (at most\n        ``jax.device_count()``) whose count divides ``H``"
        if heads
        else "every device\n        (:func:`attnref.distributed.default_mesh`)"
    )
    return option_args(
        f"mesh: A 1-D ``jax.sharding.Mesh``; ``None`` (default): {default}.",
        "``mesh`` has several axes"
        + (", or its ``P`` devices do not divide the ``H`` query heads" if heads else ""),
        "``mesh`` is not a ``jax.sharding.Mesh``",
    )


def scheme_rows(
    native: Callable[..., Any],
    heads: bool = False,
    formula: Callable[..., Any] = kernel_rows,
    on_mesh: Callable[[Prepared, float | None, Mesh | None], Call] | None = None,
) -> Callable[..., Any]:
    """``<scheme>_attention``, the registry's ``apply``: multi-head attention through the
    scheme's kernel ``native`` (``<scheme>_dot_product_attention``) on a mesh: the row signature
    plus ``mesh``, the row call ``on_mesh(rows, scale, mesh)`` (default: ``native`` on ``mesh``,
    ``None`` giving :func:`head_mesh` when ``heads``, else :func:`default_mesh`)."""

    def through_native(rows: Prepared, scale: float | None, mesh: Mesh | None) -> Call:
        if mesh is None:
            params = cast(AttentionParams, rows.params)
            mesh = head_mesh(int(jnp.shape(params.w_q)[0])) if heads else default_mesh()
        return row_call(rows, scale, {"kernel": native, "mesh": mesh})

    options = {"mesh": (None, "Mesh | None")}
    level = rows_level("rows_on_mesh", on_mesh or through_native, _mesh_row_args(heads), options)
    return rows_public(
        level,
        formula,
        native.__module__,
        name=native.__name__.replace("_dot_product_attention", "_attention"),
        summary=(
            f"Multi-head attention through :func:`{native.__name__}` on a mesh:\n"
            f"``sum_n o_n W_O[n] + b_O`` with ``o = {native.__name__}(x_q W_Q, x_kv W_K, "
            "x_kv W_V)``\nper head, ``x_q +`` that with ``residual``."
        ),
    )


def register_scheme(
    scheme: str, apply: Callable[..., Any], native: Callable[..., Any], **entry: Any
) -> None:
    """Register ``scheme`` in :data:`DISTRIBUTED` (convention ``kernel``, the cost model
    ``cost.<scheme>_cost``); ``entry``: the other fields of its
    :class:`~attnref._src.core.registry.Formulation`."""
    cost_model = getattr(_dcost, f"{scheme}_cost")
    fields = {"convention": "kernel", "family": DISTRIBUTED, "cost_model": cost_model}
    register(Formulation(id=scheme, apply=apply, native=native, **fields, **entry))


# The gradients section of docs/distributed.md (attnref.pages.render_distributed).
GRADIENTS = "\n\n".join(
    (
        "## Gradients",
        (
            "Every scheme is differentiable in reverse mode (`jax.grad`, `jax.vjp`, `jax.jacrev`) "
            "with respect to `query`, `key`, `value`, `bias` and `scale` (where it is traced, as "
            "under `jax.grad` with respect to it; the cotangent has its shape and dtype); there are"
            " no gradients with respect to the mask, lengths or segment ids. With `x_ij = q_i . "
            "k_j` and `dS_ij = p_ij (dP_ij - D_i + dlse_i)` the flash backward's logit cotangent, "
            "`dL/dscale = sum_ij dX_ij x_ij`, where `dX = dS` without a softcap and `dX = dS (1 - "
            "tanh^2(scale x / c))` with a softcap `c`."
        ),
        (
            "**Ring, striped, zigzag.** The backward is a `jax.custom_vjp` that runs the ring "
            "again (module docstring of `attnref._src.formulations.distributed.ring`): each step "
            "recomputes its chunk's state and takes its `jax.vjp`, the scale included; `dq` and "
            "the scale's cotangent accumulate on the device, `dK`/`dV` travel with the chunk "
            "back to its owner, and what every device shares (a bias broadcast along `T`, the "
            "scale) has its per-device cotangents summed (`psum`). JAX has no forward-mode rule "
            "for a `custom_vjp`, so **forward mode is not supported**: `jax.jvp` and "
            "`jax.jacfwd` of these kernels raise `TypeError: <scheme>_dot_product_attention does "
            "not support forward-mode differentiation (...)`, which names the way out (reverse "
            "mode, or `all_gather_dot_product_attention`). Under an outer `jax.jit` "
            "(`jax.jvp(jax.jit(f), ...)`, `jax.jit(lambda x: jax.jvp(f, ...))`) and for the "
            "function `jax.linearize` returns, the failure only shows when JAX compiles or runs "
            "the derivative, after the kernel has returned, as JAX's own `TypeError: can't apply "
            "forward-mode autodiff (jvp) to a custom_vjp function.` Supporting it would take a "
            "`custom_jvp`, from which JAX derives the reverse mode by transposing the tangent "
            "ring: every step's probabilities kept, the memory this backward exists to avoid. "
            "Forward over reverse works (`jax.hessian`, `jax.jvp` of `jax.grad`): the outer "
            "forward mode differentiates the `custom_vjp`'s own rules, ordinary JAX code."
        ),
        (
            "**All-gather, Ulysses, tensor parallelism.** No custom rule: JAX differentiates them "
            "in either mode (`jax.jvp`, `jax.jacfwd`, `jax.hessian`)."
        ),
        (
            "`tests/test_distributed_grad.py` checks the scale's cotangent of all six schemes and "
            "of the kernel against a float64 reference within a derived bound, the refusal's "
            "message, forward mode of the other three and the ring's Hessian; "
            "`tests/test_distributed_ring.py` and `tests/test_distributed_heads.py` check the other"
            " gradients."
        ),
    )
)


DISTRIBUTED = Family(
    name="distributed",
    oracle=oracle.attention,
    bound=tolerance.attention_error_bound,
    signature=(
        "apply(params, x_q, x_kv=None, *, mask=None, bias=None, scale=None, residual=False, "
        "mesh=None)"
    ),
    note=(
        "The softmax family's function, computed on a `jax.sharding.Mesh` (`mesh=None`: a 1-D "
        "mesh over all devices, or for the head-parallel schemes over the most devices whose "
        "count divides the head count); the kernel-level form (`native`) takes the layout and "
        "options of `jax.nn.dot_product_attention` plus `mesh` and `axis_name`. Lengths that the "
        "device count does not divide are padded inside (padded keys are never attended, padded "
        "queries are dropped), so every length is exact. See [distributed](../distributed.md)."
    ),
    equation_symbols=("softmax", "lse", "psum", "all"),
    static_argnames=("residual", "mesh"),
)
