"""Gradients with fully masked query rows drawn on purpose, for every softmax/RoPE formulation at
the weight level and for both kernels (naive autodiff and the flash ``custom_vjp``) under every
``masked_rows`` policy.

The truth is independent of every JAX implementation: central finite differences of the float64
NumPy oracle along drawn directions. For ``phi(tau) = <cot, oracle(z + tau d)>`` the central
difference ``D(h) = (phi(h) - phi(-h)) / 2h`` is off from ``phi'(0)`` by

* truncation ``h^2 |phi'''| / 6``. Estimated a posteriori (Richardson): ``D(h) - D(2h) =
  -h^2 phi''' / 2 + O(h^4)``, so the truncation of ``D(h)`` is about ``|D(h) - D(2h)| / 3``; the
  tolerance takes ``|D(h) - D(2h)|``, three times the estimate (it also absorbs ``D(2h)``'s own
  rounding).
* rounding ``(eps(z + hd) + eps(z - hd)) / 2h`` with ``eps`` the oracle's own float64 error on
  ``phi``: ``sum |cot| B`` with ``B`` the derived bound of :mod:`attnref.tolerance` in float64,
  plus ``gamma_n(u64) sum |cot y|`` for the inner product of ``n`` terms. ``h = 2^-17`` is about
  ``eps64^(1/3)``, which balances the two for inputs of order one.
* the perturbed inputs are rounded: the direction actually taken is ``d_eff = (fl(z + hd) -
  fl(z - hd)) / 2h`` (exact by Sterbenz's lemma wherever ``|z| > 2 h |d|``), and the JAX gradient
  is dotted with ``d_eff``, not ``d``.

The float64 JAX gradient's own error is at most ``gamma_{N_b}(u64) sum |g| |d_eff|`` with ``N_b``
the longest backward reduction chain (``tests/test_gradients.py``, ``tests/test_rope.py``,
``tests/test_blockwise.py``). Every check also asserts that its tolerance resolves a relative
error of ``1e-5`` (RoPE: ``1e-4``) of the magnitude ``sum |g| |d_eff|``, so a wrong gradient
cannot pass.

The functions compiled here are the ones compiled by ``test_gradients``, ``test_rope`` and
``test_blockwise`` (same functions, shapes and dtypes), except the float64 weight-level gradients
of the non-concat softmax forms.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from hypothesis import given, note
from hypothesis import strategies as st

import attnref
from attnref import oracle, tolerance
from attnref import strategies as ast
from attnref.oracle import _rope as rope_oracle

from . import test_blockwise as tb
from . import test_gradients as tg
from . import test_rope as tr
from .helpers import scaled

U64 = tolerance.unit_roundoff(np.float64)
U32 = tolerance.unit_roundoff(np.float32)
# Steps h: 2^-17 ~ eps64^(1/3) balances the truncation h^2 |phi'''| / 6 and the rounding
# eps / h when the oracle's bound is of order u64; looser bounds (RoPE's) move it to larger h.
STEPS = tuple(2.0**-e for e in (17, 15, 13, 11, 9, 7, 5))
RESOLUTION = 1e-5  # every tolerance must be below this fraction of sum |g| |d_eff|
# The RoPE oracle's float64 bound grows with the positions (angle error ~ u64 m theta, about
# 1e-9 relative at m ~ 2000), so its differences resolve less: 1e-4 of the magnitude.
ROPE_RESOLUTION = 1e-4
BASE_KINDS = ("none", "causal", "padding", "random", "bias", "combined")
SEEDS = st.integers(0, 2**31 - 1)

Tree = Any


# ----------------------------------------------------------------------------- finite differences


def _axpy(a: float, d: Tree, z: Tree) -> Tree:
    return jax.tree_util.tree_map(lambda di, zi: np.asarray(zi) + a * np.asarray(di), d, z)


def _dot(g: Tree, d: Tree, absolute: bool = False) -> float:
    f = np.abs if absolute else (lambda a: a)
    leaves = zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(d), strict=True)
    return float(sum(np.sum(f(np.asarray(a, np.float64)) * f(np.asarray(b))) for a, b in leaves))


def _direction(rng: np.random.Generator, z: Tree) -> Tree:
    return jax.tree_util.tree_map(lambda a: rng.standard_normal(np.shape(a)), z)


def _central(
    phi: Callable[[Tree], tuple[float, float]], z: Tree, d: Tree, h: float
) -> tuple[float, float, Tree]:
    """``(D(h), rounding error of D(h), d_eff)``; ``phi`` returns ``(value, its error bound)``."""
    zp, zm = _axpy(h, d, z), _axpy(-h, d, z)
    (fp, ep), (fm, em) = phi(zp), phi(zm)
    d_eff = jax.tree_util.tree_map(lambda a, b: (a - b) / (2 * h), zp, zm)
    return (fp - fm) / (2 * h), (ep + em) / (2 * h), d_eff


def check_directional(
    phi: Callable[[Tree], tuple[float, float]],
    z: Tree,
    grads: dict[str, Tree],
    d: Tree,
    n_b: int,
    label: str,
    resolution: float = RESOLUTION,
) -> None:
    """Each gradient in ``grads`` (float64, same structure as ``z``), dotted with the direction
    actually taken, equals the central difference of the oracle within the derived tolerance,
    at the step of the ladder ``STEPS`` where that tolerance is smallest."""
    diffs = [_central(phi, z, d, h) for h in STEPS]
    for name, g in grads.items():
        assert all(np.all(np.isfinite(a)) for a in jax.tree_util.tree_leaves(g)), (
            f"{label} {name}: gradient not finite"
        )
        mag = _dot(g, diffs[0][2], absolute=True)
        best: tuple[float, ...] | None = None
        for (d1, r1, e1), (d4, _, e4) in itertools.pairwise(diffs):
            # D(4h) - D(h) = 15 h^2 phi'''/6 + O(h^4): the truncation of D(h) is about a
            # fifteenth of it; a third (5 x the estimate) is taken. The second term: d_eff
            # itself moves with h by rounding.
            trunc = abs(d4 - d1) / 3 + abs(_dot(g, e4) - _dot(g, e1))
            tol = trunc + r1 + tolerance.gamma(n_b, U64) * mag
            if best is None or tol < best[0]:
                best = (tol, trunc, r1, d1, _dot(g, e1))
        assert best is not None
        tol, trunc, r1, d1, gd = best
        # (an exactly zero gradient has no magnitude to resolve: the oracle's difference must
        # then be zero within the rounding and truncation terms alone)
        assert mag == 0.0 or tol <= resolution * mag, (
            f"{label} {name}: tolerance {tol:.2e} cannot resolve (truncation {trunc:.2e}, "
            f"rounding {r1:.2e}, magnitude {mag:.2e})"
        )
        err = abs(gd - d1)
        assert err <= tol, (
            f"{label} {name}: <grad, d> = {gd:.12e}, oracle finite difference "
            f"{d1:.12e}: |diff| {err:.3e} > tolerance {tol:.3e}"
        )


# ----------------------------------------------------------------------------- weight level


@dataclasses.dataclass
class DeadRowProblem:
    """A weight-level problem with query ``row`` fully masked in batch elements ``dead``."""

    p: ast.AttentionProblem
    row: int
    dead: tuple[int, ...]
    how: str  # "mask" or "neg_inf_bias"


@st.composite
def dead_row_problems(
    draw: st.DrawFn, bucket: ast.Config, dtype: str = "float64"
) -> DeadRowProblem:
    kind = draw(st.sampled_from(BASE_KINDS), label="base mask kind")
    seed = draw(SEEDS, label="data seed")
    row = draw(st.integers(0, bucket.t - 1), label="fully masked query row")
    n_batch = int(np.prod(bucket.batch))
    dead = tuple(
        sorted(
            draw(
                st.sets(st.integers(0, n_batch - 1), min_size=1, max_size=n_batch),
                label="batch elements with the dead row",
            )
        )
    )
    how = draw(st.sampled_from(("mask", "neg_inf_bias")), label="masking mechanism")
    note(f"kind={kind} seed={seed} row={row} dead={dead} how={how}")
    p = ast.make_attention_problem(bucket, kind, seed, dtype)
    mask = p.mask.reshape(-1, bucket.t, bucket.s).copy()
    bias = p.bias.reshape(-1, bucket.t, bucket.s).copy()
    for b in dead:
        if how == "mask":
            mask[b, row] = False
        else:
            bias[b, row] = -np.inf
    p = dataclasses.replace(p, mask=mask.reshape(p.mask.shape), bias=bias.reshape(p.bias.shape))
    return DeadRowProblem(p, row, dead, how)


def _dead_cot(dp: DeadRowProblem, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """A drawn cotangent over every output, and one that is non-zero only on the dead rows."""
    b = dp.p.config
    cot = rng.standard_normal((*b.batch, b.t, b.d_model))
    only = np.zeros_like(cot).reshape(-1, b.t, b.d_model)
    for i in dp.dead:
        only[i, dp.row] = cot.reshape(-1, b.t, b.d_model)[i, dp.row]
    return cot, only.reshape(cot.shape)


def _phi_softmax(p: ast.AttentionProblem, cot: np.ndarray) -> Callable[[Tree], tuple[float, float]]:
    def phi(z: Tree) -> tuple[float, float]:
        params, x_q, x_kv = z
        y = oracle.attention(params, x_q, x_kv, mask=p.mask, bias=p.bias)
        bound = tolerance.attention_error_bound(
            params, x_q, x_kv, mask=p.mask, bias=p.bias, dtype=np.float64
        )
        err = np.sum(np.abs(cot) * bound) + tolerance.gamma(cot.size, U64) * np.sum(np.abs(cot * y))
        return float(np.sum(cot * y)), float(err)

    return phi


def _assert_dead_rows_isolated(grads: Tree, dp: DeadRowProblem, only: np.ndarray, label: str):
    """A cotangent on the dead rows only: their output is ``b_O``, so every gradient but
    ``d/db_O`` (``= sum cot``) is exactly zero."""
    params_g, gx_q, gx_kv = grads
    for name, g in (("x_q", gx_q), ("x_kv", gx_kv)):
        g = np.asarray(g)
        assert np.all(g == 0.0), f"{label}: d(dead row)/d{name} = {np.abs(g).max():.3e} != 0"
    for name in ("w_q", "w_k", "w_v", "w_o", "b_q", "b_k", "b_v"):
        g = np.asarray(getattr(params_g, name))
        assert np.all(g == 0.0), f"{label}: d(dead row)/d{name} = {np.abs(g).max():.3e} != 0"
    # d/db_O sums the non-zero cotangent entries: one per dead batch element, n terms.
    b_o = np.asarray(params_g.b_o, np.float64)
    flat = only.reshape(-1, only.shape[-1])
    u = tolerance.unit_roundoff(np.asarray(params_g.b_o).dtype)
    # cot rounded to the dtype (u per term), then a sum of len(dead) non-zero terms
    tol = (u + tolerance.gamma(len(dp.dead), u)) * np.abs(flat).sum(0)
    assert np.all(np.abs(b_o - flat.sum(0)) <= tol), f"{label}: d/db_O != sum of the cotangent"


GRAD_BUCKET = ast.WEIGHT_BUCKETS[1]  # the bucket whose gradients test_gradients compiles
# test_gradients' and test_rope's gradient functions, jitted once here (same compiled programs).
SOFTMAX_GRADS = {fid: jax.jit(g) for fid, g in tg._GRAD.items()}
ROPE_GRADS = {form: jax.jit(tr.GRAD[form, "interleaved"]) for form in tr.FORMS}


def _n_b(b: ast.Config) -> int:
    return int(np.prod(b.batch)) * b.t + b.s + b.d_model + b.d_k + b.d_v + b.n


def _grad_args(p: ast.AttentionProblem, dtype: Any, cot: np.ndarray) -> tuple[Any, ...]:
    return (
        p.params.astype(dtype),
        p.x_q.astype(dtype),
        p.x_kv.astype(dtype),
        p.mask,
        p.bias.astype(dtype),
        cot.astype(dtype),
    )


@scaled(0.25)
@given(dp=dead_row_problems(GRAD_BUCKET), dir_seed=SEEDS)
def test_softmax_forms_gradients_with_dead_row_match_oracle_differences(dp, dir_seed):
    """Every softmax-family formulation: the float64 gradient of ``<cot, y>`` w.r.t. the
    parameters, ``x_q`` and ``x_kv`` (one drawn direction each) equals the oracle's central
    difference; a cotangent on the dead rows alone gives exactly zero gradients (``b_O`` aside),
    in float64 and in float32; every gradient is finite."""
    p, b = dp.p, GRAD_BUCKET
    rng = np.random.default_rng(dir_seed)
    cot, only = _dead_cot(dp, rng)
    z = (p.params, p.x_q, p.x_kv)
    grads = {}
    for f in attnref.formulations("softmax"):
        fn = SOFTMAX_GRADS[f.id]
        g = fn(*_grad_args(p, np.float64, cot))
        grads[f.id] = jax.tree_util.tree_map(np.asarray, g)
        _assert_dead_rows_isolated(fn(*_grad_args(p, np.float64, only)), dp, only, f.id)
        _assert_dead_rows_isolated(fn(*_grad_args(p, np.float32, only)), dp, only, f"{f.id} f32")
        g32 = fn(*_grad_args(p, np.float32, cot))
        assert all(np.all(np.isfinite(a)) for a in jax.tree_util.tree_leaves(g32)), f.id
    phi = _phi_softmax(p, cot)
    zero = jax.tree_util.tree_map(np.zeros_like, z)
    for i, group in enumerate(("params", "x_q", "x_kv")):
        d = list(zero)
        d[i] = _direction(rng, z[i])
        check_directional(phi, z, grads, tuple(d), _n_b(b), f"d/d{group}")


def _rope_args(
    p: ast.AttentionProblem, pq: np.ndarray, pk: np.ndarray, dtype: Any, cot: np.ndarray
):
    return (
        p.params.astype(dtype),
        p.x_q.astype(dtype),
        p.x_kv.astype(dtype),
        pq,
        pk,
        p.mask,
        p.bias.astype(dtype),
        cot.astype(dtype),
    )


@scaled(0.25)
@given(
    dp=dead_row_problems(tr.JIT_BUCKET),
    position_kind=st.sampled_from(tr.POSITION_KINDS),
    dir_seed=SEEDS,
)
def test_rope_forms_gradients_with_dead_row_match_oracle_differences(dp, position_kind, dir_seed):
    """Both RoPE forms (interleaved pairs, the convention whose gradients test_rope compiles):
    float64 gradients equal the RoPE oracle's central differences along drawn directions; the
    dead rows alone give exactly zero gradients (``b_O`` aside); float32 gradients are finite.
    ``N_b`` is the relative form's longer chain (``tests/test_rope.py``)."""
    p, b = dp.p, tr.JIT_BUCKET
    pq, pk = tr.make_positions(b, position_kind, dir_seed)
    rng = np.random.default_rng(dir_seed)
    cot, only = _dead_cot(dp, rng)
    grads = {}
    for form in tr.FORMS:
        fn = ROPE_GRADS[form]
        grads[form] = jax.tree_util.tree_map(
            np.asarray, fn(*_rope_args(p, pq, pk, np.float64, cot))
        )
        _assert_dead_rows_isolated(fn(*_rope_args(p, pq, pk, np.float64, only)), dp, only, form)
        g32 = fn(*_rope_args(p, pq, pk, np.float32, cot))
        assert all(np.all(np.isfinite(a)) for a in jax.tree_util.tree_leaves(g32)), form

    def phi(z: Tree) -> tuple[float, float]:
        params, x_q, x_kv = z
        kw = dict(positions_q=pq, positions_kv=pk, mask=p.mask, bias=p.bias, base=tr.BASE)
        y = rope_oracle.rope_attention(params, x_q, x_kv, convention="interleaved", **kw)
        bound = tolerance.rope_attention_error_bound(
            params, x_q, x_kv, convention="interleaved", dtype=np.float64, **kw
        )
        err = np.sum(np.abs(cot) * bound) + tolerance.gamma(cot.size, U64) * np.sum(np.abs(cot * y))
        return float(np.sum(cot * y)), float(err)

    n_b = int(np.prod(b.batch)) * b.t * b.s + b.s + 2 * (b.d_model + 1) + 2 * b.d_k + b.d_v + b.n
    z = (p.params, p.x_q, p.x_kv)
    zero = jax.tree_util.tree_map(np.zeros_like, z)
    for i, group in enumerate(("params", "x_q", "x_kv")):
        d = list(zero)
        d[i] = _direction(rng, z[i])
        check_directional(
            phi, z, grads, tuple(d), n_b, f"rope d/d{group}", resolution=ROPE_RESOLUTION
        )


# ----------------------------------------------------------------------------- kernel level

KB = ast.KERNEL_BUCKETS[0]  # the bucket whose gradients test_blockwise compiles
POLICY_PROFILES = {prof.get("masked_rows", "zeros"): prof for prof in tb.GRAD_PROFILES}
KERNEL_EXTRAS = ("bias", "padding", "segments")


@dataclasses.dataclass
class DeadKernelProblem:
    p: ast.KernelProblem
    static: tuple[tuple[str, Any], ...]
    arrays: dict[str, Any]
    bias: np.ndarray
    dead: np.ndarray  # [B, T, N] rows with no allowed key
    padded: np.ndarray  # [B, T] queries beyond query_seq_lengths (0 under every policy)

    @property
    def policy(self) -> str:
        return dict(self.static).get("masked_rows", "zeros")


@st.composite
def dead_kernel_problems(draw: st.DrawFn, policy: str) -> DeadKernelProblem:
    """A kernel problem with fully masked rows made on purpose: a drawn query of a drawn batch
    element loses every key (in one drawn head or all of them) through the mask, or a batch
    element gets ``key_value_seq_lengths = 0``."""
    b = KB
    profile = POLICY_PROFILES[policy]
    extras = draw(st.sets(st.sampled_from(KERNEL_EXTRAS), max_size=2), label="array options")
    extras = tuple(sorted({"random", *extras}))
    seed = draw(SEEDS, label="data seed")
    p = ast.make_kernel_problem(b, extras, seed, np.float64, static=profile, empty_rows=True)
    arrays, bias = tb._neutral_arrays(p)
    arrays = dict(arrays)
    how = draw(st.sampled_from(("mask", "kv_length_zero")), label="masking mechanism")
    batch = draw(st.integers(0, b.batch - 1), label="dead batch element")
    q_len = np.array(arrays["query_seq_lengths"])
    if how == "mask":
        mask = np.array(arrays["mask"])
        row = draw(st.integers(0, b.t - 1), label="dead query")
        head = draw(st.integers(0, mask.shape[1] - 1), label="dead head (of the mask's heads)")
        mask[batch, head, row] = False
        arrays["mask"] = mask
        q_len[batch] = max(q_len[batch], row + 1)  # a real query, not padding
        note(f"seed={seed} extras={extras} mask row b={batch} t={row} head={head}")
    else:
        kv = np.array(arrays["key_value_seq_lengths"])
        kv[batch] = 0
        arrays["key_value_seq_lengths"] = kv
        q_len[batch] = max(q_len[batch], 1)
        note(f"seed={seed} extras={extras} key_value_seq_lengths[{batch}] = 0")
    arrays["query_seq_lengths"] = q_len
    static = tuple(sorted(p.static.items()))
    allowed = _allowed(dict(static), arrays, bias)
    padded = np.arange(b.t)[None, :] >= q_len[:, None]
    dead = np.swapaxes(~allowed.any(-1), 1, 2) & ~padded[:, :, None]
    assert dead.any(), "the drawn row must be fully masked"
    return DeadKernelProblem(p, static, arrays, bias, dead, padded)


def _allowed(static: dict[str, Any], arrays: dict[str, Any], bias: np.ndarray) -> np.ndarray:
    """The oracle's allowed set ``[B, N, T, S]`` for the static options and arrays."""
    kw = {k: v for k, v in static.items() if k not in ("softcap", "masked_rows")}
    b = KB
    return oracle.kernel_allowed((b.batch, b.n, b.t, b.s), bias=bias, **kw, **arrays)


def _kernel_phi(dk: DeadKernelProblem, cot: np.ndarray, cot_lse: np.ndarray):
    kw = dict(dk.static)
    arrays = dk.arrays

    def phi(z: Tree) -> tuple[float, float]:
        q, k, v, bias = z
        out, lse = oracle.dot_product_attention(q, k, v, bias, return_lse=True, **kw, **arrays)
        allowed = _allowed(kw, arrays, bias)
        ob, lb = tolerance.kernel_error_bound(
            q,
            k,
            v,
            allowed,
            bias,
            softcap=kw.get("softcap"),
            masked_rows=dk.policy,
            dtype=np.float64,
            key_blocks=1,
        )
        out = np.where(np.isnan(out), 0.0, out)
        fin = np.isfinite(lse)
        lse = np.where(fin, lse, 0.0)
        value = np.sum(out * cot) + np.sum(lse * cot_lse * fin)
        n = cot.size + cot_lse.size
        mag = np.sum(np.abs(out * cot)) + np.sum(np.abs(lse * cot_lse))
        err = (
            np.sum(np.where(np.isnan(ob), 0.0, ob) * np.abs(cot))
            + np.sum(np.where(fin, lb, 0.0) * np.abs(cot_lse))
            + tolerance.gamma(n, U64) * mag
        )
        return float(value), float(err)

    return phi


def _kernel_grads(which: str, dk: DeadKernelProblem, dtype: Any, cot, cot_lse) -> list[np.ndarray]:
    static = dk.static
    if which == "blockwise":
        static = (*static, ("block_k", 3), ("block_q", 2))
    return tb._grads(which, static, dk.p, dtype, dk.bias, dk.arrays, cot, cot_lse)


def _check_kernel_policy(dk: DeadKernelProblem, dir_seed: int) -> None:
    p, b = dk.p, KB
    rng = np.random.default_rng(dir_seed)
    cot = rng.standard_normal((b.batch, b.t, b.n, b.h_v))
    cot_lse = rng.standard_normal((b.batch, b.t, b.n)) * ~dk.dead  # lse is -inf on dead rows
    if dk.policy == "nan":
        cot = cot * ~dk.dead[..., None]  # the forward is NaN there: a cotangent of zero
    n_b = b.t * (b.n // b.k) + b.s + b.h + b.h_v + 2
    exact = _kernel_grads("naive", dk, np.float64, cot, cot_lse)
    z = (p.q, p.k, p.v, dk.bias)
    phi = _kernel_phi(dk, cot, cot_lse)
    zero = [np.zeros_like(a) for a in z]
    for i, name in enumerate("qkvb"):
        d = list(zero)
        d[i] = rng.standard_normal(z[i].shape)
        check_directional(phi, list(z), {"naive": exact}, d, n_b, f"{dk.policy} d/d{name}")
    # The flash backward in float32: FlashAttention's rule against the float64 truth, with the
    # naive float32 gradient as the same-precision reference (tests/test_blockwise.py).
    ref32 = _kernel_grads("naive", dk, np.float32, cot, cot_lse)
    got32 = _kernel_grads("blockwise", dk, np.float32, cot, cot_lse)
    m = max(float(np.max(np.abs(g))) for g in exact)
    floor = tolerance.gamma(n_b, U32) * m
    for name, g, r, e in zip("qkvb", got32, ref32, exact, strict=True):
        assert np.all(np.isfinite(g)) and np.all(np.isfinite(r)), f"{dk.policy} d/d{name}"
        allowed = 2 * float(np.max(np.abs(r - e))) + floor
        err = float(np.max(np.abs(g - e)))
        assert err <= allowed, f"{dk.policy} blockwise d/d{name}: {err:.3e} > {allowed:.3e}"


def _check_dead_rows_alone(dk: DeadKernelProblem, dir_seed: int) -> None:
    """A cotangent on the dead rows only (not under "nan", whose rows are NaN): "zeros" rows
    have no gradient at all; a "uniform" row is ``mean_j v_j``, so ``dv_j`` gets ``cot / S``
    from it (summed over the query heads of the group), and q, k and the bias get nothing."""
    b = KB
    rng = np.random.default_rng(dir_seed + 1)
    cot = rng.standard_normal((b.batch, b.t, b.n, b.h_v)) * dk.dead[..., None]
    cot_lse = np.zeros((b.batch, b.t, b.n))
    g_group = b.n // b.k
    want_v = np.zeros((b.batch, b.s, b.k, b.h_v))
    if dk.policy == "uniform":
        per_kv = cot.reshape(b.batch, b.t, b.k, g_group, b.h_v).sum(axis=(1, 3)) / b.s
        want_v = np.broadcast_to(per_kv[:, None], want_v.shape)
    n_terms = b.t * g_group + 1  # the sum over dead (query, head) pairs, then the 1/S
    # (the flash backward is compiled in float32 only, as in test_blockwise)
    for which, dtype in (("naive", np.float64), ("naive", np.float32), ("blockwise", np.float32)):
        gq, gk, gv, gb = _kernel_grads(which, dk, dtype, cot, cot_lse)
        label = f"{which} {dtype.__name__} {dk.policy}"
        for name, g in (("q", gq), ("k", gk), ("bias", gb)):
            assert np.all(g == 0.0), f"{label}: d(dead rows)/d{name} != 0"
        # cot is rounded to dtype first: u |cot| / S per term, then gamma_{n} of the sum.
        u = tolerance.unit_roundoff(dtype)
        mag = np.abs(cot).reshape(b.batch, b.t, b.k, g_group, b.h_v).sum(axis=(1, 3)) / b.s
        tol = (u + tolerance.gamma(n_terms + 2, u)) * mag[:, None]
        err = np.abs(gv - want_v)
        assert np.all(err <= tol), f"{label}: dv {err.max():.3e} > {tol.max():.3e}"


@scaled(0.25)
@given(
    policy=st.sampled_from(tuple(POLICY_PROFILES)),
    data=st.data(),
    dir_seed=SEEDS,
)
def test_kernel_gradients_with_dead_rows_every_policy(policy, data, dir_seed):
    """Both kernels under each ``masked_rows`` policy with fully masked rows drawn on purpose:
    the naive form's float64 autodiff gradient w.r.t. q, k, v and the bias equals the oracle's
    central differences (through the output and lse); the flash backward meets FlashAttention's
    rule against it; "nan" rows, with a zero cotangent, leave every gradient finite; the dead
    rows' own gradient is zero ("zeros") or the mean's ``1/S`` on every v row ("uniform")."""
    dk = data.draw(dead_kernel_problems(policy), label="problem")
    _check_kernel_policy(dk, dir_seed)
    if policy != "nan":
        _check_dead_rows_alone(dk, dir_seed)
