"""The distributed family: its :class:`~attnref._src.core.family.Family`, the mesh helpers every scheme
shares, and the row-form adapter that turns a kernel-level scheme into a registry ``apply``.

A kernel-level scheme takes the layout and options of ``jax.nn.dot_product_attention``
(``query [B, T, N, H]``, ``key [B, S, K, H]``, ``value [B, S, K, H_v]``, global arrays in natural
token order, sharded or not) plus ``mesh`` and ``axis_name``; it shards what it needs over the
mesh axis itself (``shard_map``) and returns the global output. Its row form
(``<id>_attention(params, x_q, x_kv, *, mask, bias, scale, residual, mesh)``) projects the heads,
calls the scheme and applies ``W_O``: the same function as every softmax-family entry, checked
by the same oracle (:func:`attnref.oracle.attention`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh
from jaxtyping import Array

from attnref import oracle, tolerance
from attnref._src.core.common import Prepared, prepare_rows
from attnref._src.core.family import Family
from attnref._src.core.params import AttentionParams
from attnref._src.formulations.decode import project as _kernel_heads
from attnref._src.formulations.kernel_forms import block_output, flat, pairs

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
    """The default mesh of a head-parallel scheme: :func:`default_mesh` over the largest device
    count ``P <= jax.device_count()`` that divides ``num_heads`` (each device takes ``H / P``
    whole heads).

    Args:
        num_heads: The number of query heads ``H``, a positive int.

    Returns:
        The cached 1-D mesh.
    """
    n = max(p for p in range(1, jax.device_count() + 1) if num_heads % p == 0)
    return default_mesh(n)


def mesh_axis(mesh: Any, axis_name: str | None) -> tuple[str, int]:
    """The mesh axis a scheme runs over and its size ``P``.

    Args:
        mesh: A ``jax.sharding.Mesh``.
        axis_name: One of ``mesh.axis_names``; ``None`` means the only axis of a 1-D mesh.

    Returns:
        ``(axis_name, P)``.

    Raises:
        TypeError: If ``mesh`` is not a ``jax.sharding.Mesh``.
        ValueError: If ``axis_name`` is not an axis of the mesh, or is ``None`` for a mesh with
            several axes.
    """
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


def row_form(
    native: Callable[..., Any],
    params: AttentionParams,
    x_q: Any,
    x_kv: Any,
    mask: Any,
    bias: Any,
    scale: float | None,
    residual: bool,
    mesh: Mesh | None,
) -> Array:
    """``sum_n native(x_q W_Q, x_kv W_K, x_kv W_V)_n W_O[n] + b_O`` (``x_q +`` that with
    ``residual``): the row form of a kernel-level scheme, with the non-finite guard of every
    row form (:meth:`attnref._src.core.common.Prepared.guarded`). ``mesh=None``: all devices."""
    mesh = default_mesh() if mesh is None else mesh

    def compute(p: Prepared) -> Array:
        xq, xkv, b = flat(p)
        o = native(
            _kernel_heads(xq, params.w_q, params.b_q),
            _kernel_heads(xkv, params.w_k, params.b_k),
            _kernel_heads(xkv, params.w_v, params.b_v),
            pairs(p, p.bias, b),
            pairs(p, p.mask, b),
            mesh=mesh,
            scale=scale,
        )
        return block_output(p, params, o, residual)

    return prepare_rows(params, x_q, x_kv, mask, bias, scale).guarded(compute, residual)


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
            "**Ring, striped, zigzag.** The backward is a `jax.custom_vjp` that runs the ring again"
            " (module docstring of `attnref._src.formulations.distributed.ring`): each step recomputes its "
            "chunk's state and takes its `jax.vjp`, the scale included; `dq` and the scale's "
            "cotangent accumulate on the device, `dK`/`dV` travel with the chunk back to its owner,"
            " and what every device shares (a bias broadcast along `T`, the scale) has its "
            "per-device cotangents summed (`psum`). JAX has no forward-mode rule for a "
            "`custom_vjp`, so **forward mode is not supported**: `jax.jvp` and `jax.jacfwd` of "
            "these kernels raise `TypeError: <scheme>_dot_product_attention does not support "
            "forward-mode differentiation (...)`, which names the way out (reverse mode, or "
            "`all_gather_dot_product_attention`). Under an outer `jax.jit` (`jax.jvp(jax.jit(f), "
            "...)`, `jax.jit(lambda x: jax.jvp(f, ...))`) and for the function `jax.linearize` "
            "returns, the failure only shows when JAX compiles or runs the derivative, after the "
            "kernel has returned, as JAX's own `TypeError: can't apply forward-mode autodiff (jvp) "
            "to a custom_vjp function.` Supporting it would take a `custom_jvp`, from which JAX "
            "derives the reverse mode by transposing the tangent ring: every step's probabilities "
            "kept, the memory this backward exists to avoid. Forward over reverse works "
            "(`jax.hessian`, `jax.jvp` of `jax.grad`): the outer forward mode differentiates the "
            "`custom_vjp`'s own rules, ordinary JAX code."
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
        "options "
        "of `jax.nn.dot_product_attention` plus `mesh` and `axis_name`. Lengths that the "
        "device count does not divide are padded inside (padded keys are never attended, padded "
        "queries are dropped), so every length is exact. See [distributed](../distributed.md)."
    ),
    equation_symbols=("softmax", "lse", "psum", "all"),
    static_argnames=("residual", "mesh"),
)
