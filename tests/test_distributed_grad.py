"""Gradients of the distributed schemes a user can trust (issue 22): the cotangent of a traced
``scale`` for all six schemes, and what forward-mode differentiation does.

**Scale gradient: the reference.** With ``x_ij = q_i . k_j`` (unscaled), ``z_ij = scale x_ij``,
the logits ``l_ij = c tanh(z_ij / c) + bias_ij`` (``l = z + bias`` without a softcap) and ``L``
the loss, ``dL/dscale = sum_ij dX_ij x_ij`` over every batch, head and allowed pair, with
``dS_ij = dL/dl_ij = p_ij (dP_ij - D_i + dlse_i)`` the flash backward's logit cotangent and
``dX = dS f``, ``f = 1 - tanh^2(z / c)`` (``dX = dS`` without a softcap). With a bias of the full
``[B, N, T, S]`` shape, ``dS`` is exactly the bias gradient, so the float64 reference is
``sum(dbias_oracle * f * x)`` with :func:`attnref.oracle.dot_product_attention_vjp`'s bias
gradient (analytic, not autodiff) and ``x``, ``f`` in float64.

**Scale gradient: the tolerance** (first order, derived). The scheme computes ``fl(sum fl(dX~_ij
x~_ij))``: ``x~`` is a dot product of ``H`` terms (``|x~ - x| <= gamma_H a``, ``a_ij = |q_i| .
|k_j|``), ``dX~`` is within ``e_dX`` of ``dX``, and the sum has at most ``n = B N (T + 2P)
(S + 2P)`` terms (padding included; any order: the chunk sums, the ring's steps and the
``psum`` over devices are one summation tree). Hence::

    |g - g_exact| <= sum e_dX a + gamma_{H + n + 1} sum |dX| a.

``e_dS`` is the bias bound of :func:`attnref.tolerance.kernel_grad_error_bound` (the ``dS``
error of any evaluation order of the backward equations, plus the float64 oracle's own, in one:
it sums the bound in float32's ``u`` and in float64's). With a softcap, the bound's step 5 with
``u = u32 + u64``: ``e_t = f gamma_{H+1} |scale| a / c + (C_EXP + 1) u |t|``, ``e_f = 2 |t| e_t
+ 2 u``, ``e_dX = e_dS f + |dS| e_f + u |dX|``. The reference's own float64 sum adds
``gamma_{H + n + 1}(u64) sum |dX| a``. As for the ring's other gradients
(``tests/test_distributed_ring.py``), the ring's stored chunk ``lse`` adds a rounding the kernel
bound does not list, negligible at the logits of order one drawn here. Every check asserts that
the bound is below ``|g_exact| / 10``, so a silent 0 (or a gradient off by a device's share)
cannot pass.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attnref
from attnref import distributed, oracle, tolerance
from attnref.tolerance._rounding import C_EXP

RING = ("ring", "striped", "zigzag")
SCHEMES = (*RING, "all_gather", "ulysses", "tensor_parallel")
KERNELS = {s: getattr(distributed, f"{s}_dot_product_attention") for s in SCHEMES}
U32, U64 = tolerance.unit_roundoff(np.float32), tolerance.unit_roundoff(np.float64)
# B, T (= S), N (= K, a multiple of every mesh size here), H (= H_v).
B, T, N, H = 1, 6, 4, 4
SCALE = 0.75


def _problem(seed: int, dtype: type) -> tuple[np.ndarray, ...]:
    """``(q, k, v, bias, cot, cot_lse)`` in ``dtype``: logits of order one, a full bias."""
    rng = np.random.default_rng(seed)
    q, k, v, cot = (rng.standard_normal((B, T, N, H)) for _ in range(4))
    bias = 0.5 * rng.standard_normal((B, N, T, T))
    cot_lse = rng.standard_normal((B, T, N))
    return tuple(a.astype(dtype) for a in (q, k, v, bias, cot, cot_lse))


def _loss(scheme, devices, options, q, k, v, bias, scale, cot, cot_lse):
    """``sum(cot * o) + sum(cot_lse * lse)``; ``scheme=None``: the non-distributed kernel."""
    kw = dict(options, scale=scale, return_lse=True)
    if scheme is None:
        out, lse = attnref.dot_product_attention(q, k, v, bias, **kw)
    else:
        out, lse = KERNELS[scheme](q, k, v, bias, mesh=distributed.default_mesh(devices), **kw)
    return jnp.sum(out * cot) + jnp.sum(lse * cot_lse)


_SCALE_GRAD = jax.jit(jax.grad(_loss, argnums=7), static_argnums=(0, 1, 2))


def scale_grad_reference(problem, *, scale, is_causal, softcap=None, dtype=np.float32):
    """``(dL/dscale, bound on |g - dL/dscale|, sum |dX| a)`` for ``g`` computed in ``dtype``
    (module docstring)."""
    q, k, v, bias, cot, cot_lse = (np.asarray(a, np.float64) for a in problem)
    kw = dict(scale=scale, is_causal=is_causal, softcap=softcap)
    cots = dict(cotangent=cot, lse_cotangent=cot_lse)
    d_s = oracle.dot_product_attention_vjp(q, k, v, bias, **cots, **kw).bias
    e_s = tolerance.kernel_grad_error_bound(q, k, v, bias, **cots, dtype=dtype, **kw).bias
    x = np.einsum("btnh,bsnh->bnts", q, k)
    a = np.einsum("btnh,bsnh->bnts", np.abs(q), np.abs(k))
    u_work = tolerance.unit_roundoff(dtype)
    d_x, e_x = d_s, e_s
    if softcap is not None:
        u = u_work + U64
        t = np.tanh(scale * x / softcap)
        f = 1.0 - t * t
        e_t = f * tolerance.gamma(H + 1, u) * abs(scale) * a / softcap + (C_EXP + 1) * u * np.abs(t)
        e_f = 2 * np.abs(t) * e_t + 2 * u
        d_x = d_s * f
        e_x = e_s * f + np.abs(d_s) * e_f + u * np.abs(d_x)
    mag = float(np.sum(np.abs(d_x) * a))
    g = tolerance.gamma(TERMS, u_work) + tolerance.gamma(TERMS, U64)
    return float(np.sum(d_x * x)), float(np.sum(e_x * a) + g * mag), mag


# At most n = B N (T + 2P) (S + 2P) summed products (P <= 4: at most 2P - 1 padding positions
# per axis), each of a dot product of H terms, and the product itself.
TERMS = H + B * N * (T + 8) * (T + 8) + 1


@functools.cache
def _reference(seed, scale, is_causal, softcap=None, dtype=np.float32):
    problem = _problem(seed, dtype)
    return scale_grad_reference(
        problem, scale=scale, is_causal=is_causal, softcap=softcap, dtype=dtype
    )


# (scheme, devices, causal, softcap): the ring family on 2 and 4 devices, causal and not (one
# case with a softcap, whose chain rule the chunk's vjp takes); the other three schemes on one
# mesh each; None: the non-distributed kernel (JAX's autodiff of its naive forward), the
# baseline every scheme must agree with.
# Each ring scheme on 2 and 4 devices, one causal and one not (a compiled ring program is the
# file's main cost): every scheme, mesh size and causal flag is reached.
SCALE_CASES = (
    ("ring", 2, False, None),
    ("ring", 4, True, None),
    ("striped", 2, True, None),
    ("striped", 4, False, None),
    ("zigzag", 2, False, None),
    ("zigzag", 4, True, 1.5),
    ("all_gather", 4, False, None),
    ("ulysses", 2, True, None),
    ("tensor_parallel", 4, True, None),
    (None, 1, True, None),
)


def _case_id(case):
    scheme, devices, causal, softcap = case
    return "-".join(
        [str(scheme), str(devices)] + ["causal"] * causal + [f"softcap{softcap}"] * bool(softcap)
    )


@pytest.mark.parametrize("case", SCALE_CASES, ids=_case_id)
def test_scale_gradient(case):
    """``jax.grad`` with respect to a traced float32 ``scale`` (a 0-d array: the cotangent has
    its shape and dtype), jitted, within the derived bound of the float64 reference, for every
    scheme (so the six agree with each other and with the kernel). The ring family's cotangent
    is each step's ``jax.vjp`` of the chunk with respect to the scale, summed over the steps
    and then over the devices (a skipped causal step adds 0)."""
    scheme, devices, causal, softcap = case
    options = tuple(
        (n, o) for n, o in (("is_causal", causal), ("softcap", softcap)) if o not in (None, False)
    )
    q, k, v, bias, cot, cot_lse = _problem(0, np.float32)
    scale = jnp.asarray(SCALE, jnp.float32)
    g = _SCALE_GRAD(scheme, devices, options, q, k, v, bias, scale, cot, cot_lse)
    assert g.shape == () and g.dtype == jnp.float32, (g.shape, g.dtype)
    exact, bound, _ = _reference(0, SCALE, causal, softcap)
    assert bound < abs(exact) / 10, f"bound {bound:.2e} does not resolve {exact:.4e}"
    err = abs(float(g) - exact)
    assert err <= bound, f"d/dscale {float(g):.8e} vs {exact:.8e}: {err:.2e} > {bound:.2e}"


# ----------------------------------------------------------------------------- forward mode


@pytest.mark.parametrize("scheme", RING)
def test_forward_mode_is_refused_naming_the_scheme(scheme):
    """``jax.jvp`` and ``jax.jacfwd`` of a ring-family kernel raise a ``TypeError`` that names
    the kernel and the way out, not JAX's bare custom_vjp message (no compile: the error comes
    while the ring's program is traced)."""
    q, k, v, *_ = _problem(0, np.float32)
    fn = KERNELS[scheme]
    mesh = distributed.default_mesh(2)
    message = rf"{scheme}_dot_product_attention does not support forward-mode differentiation"
    with pytest.raises(TypeError, match=message) as info:
        jax.jvp(lambda s: fn(q, k, v, mesh=mesh, scale=s), (np.float32(SCALE),), (np.float32(1),))
    assert "jax.grad" in str(info.value) and "all_gather_dot_product_attention" in str(info.value)
    with pytest.raises(TypeError, match=message):
        jax.jacfwd(lambda x: fn(x, k, v, mesh=mesh, is_causal=True))(q)


def _jvp_scale(scheme, devices, options, *args):
    """``dL/dscale`` by forward mode (``jax.jvp`` with a unit tangent on the scale)."""
    q, k, v, bias, scale, cot, cot_lse = args
    loss = functools.partial(_loss, scheme, devices, options, q, k, v, bias)
    return jax.jvp(lambda s: loss(s, cot, cot_lse), (scale,), (jnp.ones_like(scale),))[1]


_JVP_SCALE = jax.jit(_jvp_scale, static_argnums=(0, 1, 2))


@pytest.mark.parametrize("scheme", ("all_gather", "ulysses", "tensor_parallel"))
def test_forward_mode_of_the_other_schemes(scheme):
    """All-gather, Ulysses and tensor parallelism have no custom rule: ``jax.jvp`` with respect
    to the scale, in float64 on 2 devices, causal, equals the float64 reference. Tolerance: the
    reference's own bound (:func:`scale_grad_reference` in float64) plus the float64 forward
    derivative's own rounding, ``gamma_{N_b}(u64) sum |dX| a`` with ``N_b = TERMS + S + H_v``
    the longest chain of roundings (the convention of ``tests/test_masked_row_gradients.py``)."""
    q, k, v, bias, cot, cot_lse = _problem(1, np.float64)
    options = (("is_causal", True),)
    got = _JVP_SCALE(scheme, 2, options, q, k, v, bias, jnp.float64(SCALE), cot, cot_lse)
    exact, bound, mag = _reference(1, SCALE, True, None, np.float64)
    tol = bound + tolerance.gamma(TERMS + T + H, U64) * mag
    assert tol <= 1e-9 * abs(exact), (tol, exact)
    assert abs(float(got) - exact) <= tol, (float(got), exact, tol)


def test_hessian_of_the_ring_works():
    """Forward over reverse (``jax.hessian``, ``jax.jvp`` of ``jax.grad``) is not refused: the
    outer forward mode differentiates the custom_vjp's forward and backward rules, ordinary JAX
    code. ``d^2 L / d scale^2`` of the ring (float64, 2 devices, causal: a skipped step) equals
    the central difference of the float64 reference gradient at the step of ``2^-17, 2^-15,
    ..., 2^-9`` where the tolerance is smallest. For ``D(h) = (g(s + h) - g(s - h)) / 2h``
    (``s +- h`` exact: ``s = 3/4``): truncation ``h^2 g''' / 6``, estimated from ``D(4h) - D(h)
    = 15 h^2 g''' / 6 + O(h^4)`` as a third of that difference (five times the estimate, as in
    ``tests/test_masked_row_gradients.py``); rounding ``(e(s + h) + e(s - h)) / 2h`` with ``e``
    the reference's float64 bound; the Hessian's own float64 rounding ``gamma_{N_b}(u64) |H|``
    (``N_b`` as in the test above). The tolerance must resolve ``1e-5 |H|``."""
    q, k, v, bias, cot, cot_lse = _problem(1, np.float64)
    loss = functools.partial(_loss, "ring", 2, (("is_causal", True),), q, k, v, bias)
    grad = jax.grad(lambda s: loss(s, cot, cot_lse))
    hess = float(jax.jit(lambda s: jax.jvp(grad, (s,), (jnp.ones_like(s),))[1])(SCALE))

    def diff(h):
        (gp, ep, _), (gm, em, _) = (
            scale_grad_reference(
                (q, k, v, bias, cot, cot_lse), scale=s, is_causal=True, dtype=np.float64
            )
            for s in (SCALE + h, SCALE - h)
        )
        return (gp - gm) / (2 * h), (ep + em) / (2 * h)

    diffs = [diff(2.0**-e) for e in (17, 15, 13, 11, 9)]
    own = tolerance.gamma(TERMS + T + H, U64) * abs(hess)
    tol, d1 = min(
        (abs(d4 - d1) / 3 + r1 + own, d1) for (d1, r1), (d4, _) in itertools.pairwise(diffs)
    )
    assert tol <= 1e-5 * abs(hess), (tol, hess)
    assert abs(hess - d1) <= tol, f"hessian {hess:.12e} vs difference {d1:.12e} (tol {tol:.2e})"
