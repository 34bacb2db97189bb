"""Multi-head latent attention (DeepSeek-V2): the naive and absorbed forms, the latent cache.

Properties (jit and no-jit, float32 and float64):

1. Both forms, from tokens and from the latent cache, equal the float64 oracle
   (:func:`attnref.oracle.mla_attention`, the paper's equations) within the derived bound
   :func:`attnref.tolerance.mla_attention_error_bound` (derivation in its module docstring), and
   each other within twice that bound (two computations of one exact value).
2. The MLA oracle equals the softmax kernel oracle (:func:`attnref.oracle.dot_product_attention`)
   on the decompressed per-head queries, keys and values (:func:`attnref.oracle.mla_qkv`), and
   without the RoPE part the row-form oracle :func:`attnref.oracle.attention` on
   :func:`attnref.mla.to_attention_params`; the seeds' ``W_P`` of the converted parameters is the
   absorbed query-key product.
3. The absorbed form's cache holds ``d_c + d_rope`` numbers per token, and decoding the last
   token against the cache equals the last row of causal prefill.
4. Gradients (``jax.grad``) of both forms against the kernel gradient oracle
   (:func:`attnref.oracle.dot_product_attention_vjp`) carried through the projections by the chain
   rule in NumPy, with FlashAttention's comparative rule.
5. Masked keys holding NaN never reach the output or the gradient; bad input is refused with the
   argument named.
6. The cost model's matmul FLOPs equal XLA's dot FLOPs; the crossover.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import attnref
from attnref import mla, oracle, tolerance
from attnref.costs import hlo_dot_flops
from attnref.testing import assert_comparative, assert_within_bound

from .helpers import scaled


@dataclasses.dataclass(frozen=True)
class Cfg:
    batch: tuple[int, ...]
    t_q: int
    t_k: int
    heads: int
    d_model: int
    d_c: int
    d_nope: int
    d_rope: int
    d_v: int
    d_cq: int | None
    convention: str = "interleaved"  # one RoPE layout per bucket: one compiled program each


BUCKETS = (
    # no batch dims, RoPE part, no query compression, T_q = T_k
    Cfg((), 4, 4, 2, 8, 6, 4, 4, 3, None),
    # batch dims, cross-attention T_q < T_k, query compression, d_v > d_nope, rotate-half pairs
    Cfg((2,), 3, 5, 3, 6, 5, 2, 2, 4, 3, "rotate_half"),
)
NO_ROPE = Cfg((2,), 3, 5, 2, 6, 4, 3, 0, 2, None)
STATIC = ("residual", "base", "convention")
FORMS = {"naive": mla.mla_attention, "absorbed": mla.mla_absorbed_attention}
CACHE_FORMS = {"naive": mla.mla_cache_attention, "absorbed": mla.mla_absorbed_cache_attention}
CACHE = jax.jit(mla.mla_latent_cache, static_argnames=("base", "convention"))


@dataclasses.dataclass
class Problem:
    cfg: Cfg
    params: mla.MLAParams
    x_q: np.ndarray
    x_kv: np.ndarray
    kw: dict

    def cast(self, dtype):
        p = jax.tree_util.tree_map(lambda a: np.asarray(a, dtype), self.params)
        return p, self.x_q.astype(dtype), self.x_kv.astype(dtype)


def make_problem(cfg: Cfg, seed: int, mask_kind: str, pos_kind: str, convention: str) -> Problem:
    rng = np.random.default_rng(seed)
    params = mla.init_mla_params(
        seed,
        d_model=cfg.d_model,
        num_heads=cfg.heads,
        d_c=cfg.d_c,
        d_nope=cfg.d_nope,
        d_rope=cfg.d_rope,
        d_v=cfg.d_v,
        d_cq=cfg.d_cq,
        dtype=np.float64,
    )
    x_q = rng.standard_normal((*cfg.batch, cfg.t_q, cfg.d_model))
    x_kv = rng.standard_normal((*cfg.batch, cfg.t_k, cfg.d_model))
    full = (*cfg.batch, cfg.t_q, cfg.t_k)
    mask = {
        "none": None,
        "causal": np.tril(np.ones(full[-2:], bool), cfg.t_k - cfg.t_q),  # bottom-right
        "random": rng.random(full) < 0.6,  # fully masked rows included by chance
    }[mask_kind]
    shift = cfg.t_k - cfg.t_q
    pos_q, pos_k = {
        "arange": (None, None),
        "decode": (np.arange(cfg.t_q) + shift, np.arange(cfg.t_k)),
        "random": (
            rng.integers(0, 500, (*cfg.batch, cfg.t_q)),
            rng.integers(0, 500, (*cfg.batch, cfg.t_k)),
        ),
    }[pos_kind]
    kw = dict(mask=mask, positions_q=pos_q, positions_kv=pos_k, convention=convention)
    return Problem(cfg, params, x_q, x_kv, kw)


@st.composite
def problems(
    draw,
    buckets=BUCKETS,
    dtypes=("float32", "float64"),
    masks=("none", "causal", "random"),
    positions=("arange", "decode", "random"),
):
    cfg = draw(st.sampled_from(buckets), label="bucket")
    return make_problem(
        cfg,
        draw(st.integers(0, 2**31 - 1), label="seed"),
        draw(st.sampled_from(masks), label="mask"),
        draw(st.sampled_from(positions), label="positions"),
        cfg.convention,
    ), np.dtype(draw(st.sampled_from(dtypes), label="dtype"))


# Under jit, a mask and positions given as arrays share one compiled program per bucket and
# convention (``None`` is another program: the default paths run in the other tests).
ARRAYS = dict(masks=("causal", "random"), positions=("decode", "random"))


def _no_kv_positions(kw):
    return {k: v for k, v in kw.items() if k != "positions_kv"}


def _all_forms(variant, prob: Problem, dtype) -> dict[str, np.ndarray]:
    """Both forms from tokens, and both from the cache that ``mla_latent_cache`` builds (under
    jit one program for the four)."""
    p, xq, xkv = prob.cast(dtype)
    out = variant(_forms_and_cache_forms, static_argnames=STATIC)(p, xq, xkv, **prob.kw)
    return {name: np.asarray(y) for name, y in out.items()}


def _forms_and_cache_forms(p, xq, xkv, **kw):
    out = {name: f(p, xq, xkv, **kw) for name, f in FORMS.items()}
    cache = CACHE(p, xkv, positions_kv=kw["positions_kv"], convention=kw["convention"])
    for name, f in CACHE_FORMS.items():
        out["cache_" + name] = f(p, xq, cache, **_no_kv_positions(kw))
    return out


# ----------------------------------------------------------------------------- (1) agreement


class AgreementTest(chex.TestCase):
    def _check(self, prob: Problem, dtype):
        p, xq, xkv = prob.cast(dtype)
        ref = oracle.mla_attention(p, xq, xkv, **prob.kw)
        bound = tolerance.mla_attention_error_bound(p, xq, xkv, dtype=dtype, **prob.kw)
        outs = _all_forms(self.variant, prob, dtype)
        for name, y in outs.items():
            assert y.dtype == dtype, f"{name} computed in {y.dtype}"
            assert_within_bound(y, ref, bound, label=f"{name} {dtype}")
        assert_within_bound(outs["absorbed"], outs["naive"], 2 * bound, label="absorbed vs naive")

    @chex.variants(with_jit=True)
    @given(case=problems(**ARRAYS))
    def test_forms_match_oracle_and_each_other(self, case):
        self._check(*case)

    @chex.variants(without_jit=True)
    @scaled(0.25)
    @given(case=problems(buckets=BUCKETS[1:], dtypes=("float64",)))
    def test_forms_match_oracle_eagerly(self, case):
        self._check(*case)


def test_residual_and_explicit_scale():
    prob = make_problem(BUCKETS[1], 3, "causal", "decode", "interleaved")
    p, xq, xkv = prob.cast(np.float32)
    for kw in (dict(residual=True), dict(scale=0.3)):
        ref = oracle.mla_attention(p, xq, xkv, **prob.kw, **kw)
        bound = tolerance.mla_attention_error_bound(p, xq, xkv, dtype=np.float32, **prob.kw, **kw)
        for name, y in _token_forms(p, xq, xkv, **prob.kw, **kw).items():
            assert_within_bound(y, ref, bound, label=f"{name} {kw}")


@functools.partial(jax.jit, static_argnames=(*STATIC, "scale"))  # scale a Python number
def _token_forms(p, xq, xkv, **kw):
    """Both forms from tokens, one program."""
    return {name: f(p, xq, xkv, **kw) for name, f in FORMS.items()}


# ----------------------------------------------------------------------------- (2) anchors


@scaled(0.5)
@given(case=problems(dtypes=("float64",)))
def test_oracle_equals_softmax_kernel_oracle_on_decompressed_qkv(case):
    """``oracle.mla_attention`` (its own softmax) against ``oracle.dot_product_attention`` on
    ``mla_qkv``'s per-head ``q, k, v`` followed by ``sum_i o_i W_O[i]``: two float64
    computations of one value, each within the float64 part of the bound."""
    prob, _ = case
    p, xq, xkv = prob.cast(np.float64)
    kw = prob.kw
    q, k, v = oracle.mla_qkv(
        p,
        xq,
        xkv,
        positions_q=kw["positions_q"],
        positions_kv=kw["positions_kv"],
        convention=kw["convention"],
    )
    lead = q.shape[:-3]
    q4, k4, v4 = (_flat(a) for a in (q, k, v))
    m4 = _mask4(kw["mask"], lead, prob.cfg.t_q, prob.cfg.t_k)
    scale = 1.0 / np.sqrt(prob.cfg.d_nope + prob.cfg.d_rope)
    o = oracle.dot_product_attention(q4, k4, v4, mask=m4, scale=scale)
    y = np.einsum("btiv,ivd->btd", o, p.w_o).reshape(*lead, prob.cfg.t_q, prob.cfg.d_model)
    ref = oracle.mla_attention(p, xq, xkv, **kw)
    b64 = tolerance.mla_attention_error_bound(p, xq, xkv, dtype=np.float64, **kw)
    assert_within_bound(ref, y, b64, label="mla oracle vs kernel oracle")
    # and the JAX forms against the kernel oracle: their bound plus the kernel oracle's own error
    for name, f in FORMS.items():
        yj = jax.jit(f, static_argnames=STATIC)(p, xq, xkv, **kw)
        assert_within_bound(yj, y, b64, label=f"{name} vs kernel oracle")


def test_without_rope_it_is_attention_with_decompressed_params():
    """``to_attention_params``: ``W_K[i] = W_DKV W_UK[i]`` etc. The row-form oracle on them equals
    both forms, and the seeds' ``W_P[i] = W_Q[i] W_K[i]^T`` is the absorbed product
    ``W_UQ[i] W_UK[i]^T W_DKV^T`` (``W_M[i] = W_DKV W_UV[i] W_O[i]``) up to float64 rounding
    (``gamma_n |A||B||C|``, ``n`` the inner dimensions)."""
    prob = make_problem(NO_ROPE, 5, "random", "arange", "interleaved")
    p, xq, xkv = prob.cast(np.float64)
    ap = mla.to_attention_params(p)
    ref = oracle.attention(ap, xq, xkv, mask=prob.kw["mask"])
    bound = tolerance.mla_attention_error_bound(p, xq, xkv, dtype=np.float64, mask=prob.kw["mask"])
    bound = bound + tolerance.attention_error_bound(
        ap, xq, xkv, mask=prob.kw["mask"], dtype=np.float64
    )
    for name, f in FORMS.items():
        y = jax.jit(f, static_argnames=STATIC)(p, xq, xkv, mask=prob.kw["mask"])
        assert_within_bound(y, ref, bound, label=f"{name} vs attention on decompressed params")
    u = tolerance.unit_roundoff(np.float64)
    absorbed = np.einsum("hdn,hcn,ec->hde", p.w_uq, p.w_uk, p.w_dkv)
    mag = np.einsum("hdn,hcn,ec->hde", *(np.abs(w) for w in (p.w_uq, p.w_uk, p.w_dkv)))
    n = NO_ROPE.d_nope + 2 * NO_ROPE.d_c + NO_ROPE.d_model
    assert_within_bound(
        attnref.interp.w_p(ap), absorbed, 2 * tolerance.gamma(n, u) * mag, label="W_P"
    )
    merged = np.einsum("dc,hcv,hve->hde", p.w_dkv, p.w_uv, p.w_o)
    mag = np.einsum("dc,hcv,hve->hde", *(np.abs(w) for w in (p.w_dkv, p.w_uv, p.w_o)))
    n = NO_ROPE.d_c + NO_ROPE.d_v
    assert_within_bound(
        attnref.interp.w_m(ap), merged, 2 * tolerance.gamma(n, u) * mag, label="W_M"
    )
    with pytest.raises(ValueError, match="RoPE part"):
        mla.to_attention_params(make_problem(BUCKETS[0], 0, "none", "arange", "interleaved").params)


# ----------------------------------------------------------------------------- (3) the cache


def test_cache_is_latent_and_decoding_equals_prefill():
    """The cache is ``[..., T_k, d_c + d_rope]``; its first ``d_c`` columns are ``x W_DKV`` and the
    rest is the rotated shared key ``RoPE(x W_KR)`` (the oracle's ``rope``). Decoding the last
    token (position ``T - 1``) against the cache equals the last row of causal prefill."""
    cfg = BUCKETS[0]
    prob = make_problem(cfg, 7, "none", "arange", "interleaved")
    p, x, _ = prob.cast(np.float64)
    cache = np.asarray(CACHE(p, x))
    assert cache.shape == (cfg.t_k, cfg.d_c + cfg.d_rope)
    u = tolerance.unit_roundoff(np.float64)
    c_ref = x @ p.w_dkv
    assert_within_bound(
        cache[:, : cfg.d_c],
        c_ref,
        tolerance.gamma(cfg.d_model, u) * (np.abs(x) @ np.abs(p.w_dkv)),
        label="c^KV",
    )
    k_r = oracle.rope((x @ p.w_kr)[:, None, :], np.arange(cfg.t_k), convention="interleaved")[:, 0]
    mag = tolerance.rope_map_error_bound(
        (np.abs(x) @ np.abs(p.w_kr))[:, None, :],
        np.arange(cfg.t_k),
        convention="interleaved",
        dtype=np.float64,
    )[:, 0]
    proj = tolerance.gamma(cfg.d_model, u) * (np.abs(x) @ np.abs(p.w_kr))  # then rotated:
    k_mag = tolerance.pair_sum(proj, "interleaved")  # |c e_a - s e_b| <= |e_a| + |e_b|
    assert_within_bound(cache[:, cfg.d_c :], k_r, mag + k_mag, label="k^R")
    causal = np.tril(np.ones((cfg.t_q, cfg.t_k), bool))
    full = oracle.mla_attention(p, x, mask=causal)
    bound = tolerance.mla_attention_error_bound(p, x, mask=causal, dtype=np.float64)
    last = x[-1:]
    for name, f in CACHE_FORMS.items():
        y = jax.jit(f, static_argnames=STATIC)(p, last, cache, positions_q=np.array([cfg.t_k - 1]))
        assert_within_bound(y, full[-1:], bound[-1:], label=f"decode {name}")


# ----------------------------------------------------------------------------- (4) gradients


def _loss(apply, params, x_q, x_kv, cot, mask, pos_q, pos_k, convention):
    y = apply(
        params, x_q, x_kv, mask=mask, positions_q=pos_q, positions_kv=pos_k, convention=convention
    )
    return jnp.sum(y * cot)


def _flat(a):
    return a.reshape(-1, *a.shape[-3:])  # one batch axis: the kernel layout [B, T, N, d]


def _mask4(mask, lead, t_q, t_k):
    return (
        None if mask is None else np.broadcast_to(mask, (*lead, t_q, t_k)).reshape(-1, 1, t_q, t_k)
    )


def _oracle_grads(prob: Problem, cot: np.ndarray, dtype):
    """``d/dx_q``, ``d/dx_kv`` of ``sum(cot * y)`` in float64: the kernel gradient oracle on the
    decompressed ``q, k, v`` (``d_o = cot W_O[i]^T``), then the chain rule through the
    projections; RoPE is a rotation, so its transpose is the rotation by ``-m``."""
    p, xq, xkv = prob.cast(dtype)
    names = ("w_dkv", "w_uk", "w_uv", "w_uq", "w_o", "w_kr", "w_qr", "w_dq")
    f = {n: None if getattr(p, n) is None else np.asarray(getattr(p, n), np.float64) for n in names}
    kw, cfg = prob.kw, prob.cfg
    pos = {n: kw[n] for n in ("positions_q", "positions_kv", "convention")}
    q, k, v = oracle.mla_qkv(p, xq, xkv, **pos)
    lead = q.shape[:-3]
    d_o = np.einsum("...td,ivd->...tiv", cot, f["w_o"])
    g = oracle.dot_product_attention_vjp(
        _flat(q),
        _flat(k),
        _flat(v),
        mask=_mask4(kw["mask"], lead, cfg.t_q, cfg.t_k),
        scale=1 / np.sqrt(cfg.d_nope + cfg.d_rope),
        cotangent=_flat(d_o),
    )
    dq, dk, dv = (a.reshape(*lead, *a.shape[1:]) for a in (g.query, g.key, g.value))
    conv, n = kw["convention"], cfg.d_nope
    d_cq = np.einsum("...tin,icn->...tc", dq[..., :n], f["w_uq"])
    d_c = np.einsum("...jin,icn->...jc", dk[..., :n], f["w_uk"])
    d_c = d_c + np.einsum("...jiv,icv->...jc", dv, f["w_uv"])
    dxkv = d_c @ f["w_dkv"].T
    if cfg.d_rope:
        pq, pk = kw["positions_q"], kw["positions_kv"]
        pq = np.broadcast_to(np.arange(cfg.t_q) if pq is None else pq, (*lead, cfg.t_q))
        pk = np.broadcast_to(np.arange(cfg.t_k) if pk is None else pk, (*lead, cfg.t_k))
        dqr = oracle.rope(dq[..., n:], -pq, convention=conv)  # R(m)^T = R(-m)
        d_cq = d_cq + np.einsum("...tir,icr->...tc", dqr, f["w_qr"])
        dkr = oracle.rope(dk[..., n:].sum(-2, keepdims=True), -pk, convention=conv)[..., 0, :]
        dxkv = dxkv + dkr @ f["w_kr"].T
    dxq = d_cq if f["w_dq"] is None else d_cq @ f["w_dq"].T
    return dxq, dxkv


def _kernel_route(params, x_q, x_kv, cot, mask, pos_q, pos_k, convention):
    """A same-precision reference in another order: the JAX kernel ``attnref.dot_product_attention``
    on per-head ``q, k, v`` formed here with ``attnref.rope.apply_rope``."""
    p = params
    c_q = x_q if p.w_dq is None else x_q @ p.w_dq
    q = jnp.einsum("...tc,icn->...tin", c_q, p.w_uq)
    c = x_kv @ p.w_dkv
    k = jnp.einsum("...jc,icn->...jin", c, p.w_uk)
    v = jnp.einsum("...jc,icv->...jiv", c, p.w_uv)
    t_q, t_k = x_q.shape[-2], x_kv.shape[-2]
    if p.w_qr is not None:
        pq = jnp.arange(t_q) if pos_q is None else pos_q
        pk = jnp.arange(t_k) if pos_k is None else pos_k
        qr = jnp.einsum("...tc,icr->...tir", c_q, p.w_qr)
        qr = attnref.rope.apply_rope(qr, pq, convention=convention)
        kr = attnref.rope.apply_rope((x_kv @ p.w_kr)[..., None, :], pk, convention=convention)
        q = jnp.concatenate([q, qr], -1)
        k = jnp.concatenate([k, jnp.broadcast_to(kr, (*k.shape[:-1], kr.shape[-1]))], -1)
    lead = x_q.shape[:-2]
    m4 = (
        None if mask is None else jnp.broadcast_to(mask, (*lead, t_q, t_k)).reshape(-1, 1, t_q, t_k)
    )
    scale = 1 / np.sqrt(q.shape[-1])
    o = attnref.dot_product_attention(_flat(q), _flat(k), _flat(v), mask=m4, scale=scale)
    y = jnp.einsum("btiv,ivd->btd", o, p.w_o).reshape(*x_q.shape[:-1], -1)
    return jnp.sum(y * cot)


REFERENCE = jax.jit(jax.grad(_kernel_route, argnums=(1, 2)), static_argnames=("convention",))
LOSSES = {name: jax.grad(functools.partial(_loss, f), argnums=(1, 2)) for name, f in FORMS.items()}


class GradientTest(chex.TestCase):
    @chex.variants(with_jit=True)
    @scaled(0.5)
    @given(case=problems(dtypes=("float32",), **ARRAYS))
    def test_gradients_match_the_kernel_gradient_oracle(self, case):
        self._check(case)

    @chex.variants(without_jit=True)
    @scaled(0.25)
    @given(case=problems(buckets=BUCKETS[1:], dtypes=("float32",), **ARRAYS))
    def test_gradients_match_the_kernel_gradient_oracle_eagerly(self, case):
        self._check(case)

    def _check(self, case):
        """FlashAttention's rule: ``max|g - g64| <= 2 max|g_ref - g64| + gamma_{N_b}(u32) M``,
        ``g64`` the oracle chain, ``g_ref`` the float32 gradient through the JAX kernel
        (another operation order), ``N_b = prod(batch) T_q + T_k + 2 d_model + d_c + d_cq +
        d_nope + d_rope + d_v + H`` the longest backward reduction chain, ``M`` the largest
        oracle gradient entry."""
        prob, dtype = case
        cfg, kw = prob.cfg, prob.kw
        cot = np.random.default_rng(0).standard_normal((*cfg.batch, cfg.t_q, cfg.d_model))
        p, xq, xkv = prob.cast(dtype)
        exp_q, exp_kv = _oracle_grads(prob, cot, dtype)
        args = (cot.astype(dtype), kw["mask"], kw["positions_q"], kw["positions_kv"])
        ref_q, ref_kv = REFERENCE(p, xq, xkv, *args, convention=kw["convention"])
        n_b = int(np.prod(cfg.batch)) * cfg.t_q + cfg.t_k + 2 * cfg.d_model + cfg.d_c
        n_b += (cfg.d_cq or 0) + cfg.d_nope + cfg.d_rope + cfg.d_v + cfg.heads
        big = max(np.abs(exp_q).max(), np.abs(exp_kv).max())
        for name, grad in LOSSES.items():
            fn = self.variant(grad, static_argnames=("convention",))
            g_q, g_kv = fn(p, xq, xkv, *args, convention=kw["convention"])
            for label, g, e, r in (("x_q", g_q, exp_q, ref_q), ("x_kv", g_kv, exp_kv, ref_kv)):
                assert_comparative(
                    g,
                    e,
                    r,
                    dtype=dtype,
                    floor_n=n_b,
                    floor_magnitude=big,
                    label=f"{name} d/d{label}",
                )


# ----------------------------------------------------------------------------- (5) hygiene


def test_masked_nan_keys_never_reach_output_or_gradient():
    """A masked key token holding NaN: every form's output and gradient equal those with the
    token zeroed; a query that may read it is NaN (never a plausible number)."""
    cfg = BUCKETS[0]
    prob = make_problem(cfg, 11, "none", "arange", "interleaved")
    p, xq, xkv = prob.cast(np.float32)
    mask = np.ones((cfg.t_q, cfg.t_k), bool)
    mask[:-1, -1] = False  # only the last query reads the last key
    bad, clean = xkv.copy(), xkv.copy()
    bad[-1], clean[-1] = np.nan, 0.0
    cot = np.ones((cfg.t_q, cfg.d_model), np.float32)
    ref = oracle.mla_attention(p, xq, bad, mask=mask)  # the oracle reads allowed pairs only
    bound = tolerance.mla_attention_error_bound(p, xq, clean, mask=mask, dtype=np.float32)
    assert np.isnan(ref[-1]).all() and np.isfinite(ref[:-1]).all()
    for name, f in FORMS.items():
        fn = jax.jit(f, static_argnames=STATIC)
        yb, yc = np.asarray(fn(p, xq, bad, mask=mask)), np.asarray(fn(p, xq, clean, mask=mask))
        np.testing.assert_array_equal(yb[:-1], yc[:-1], err_msg=name)
        assert_within_bound(yb[:-1], ref[:-1], bound[:-1], label=f"{name} clean rows")
        assert np.isnan(yb[-1]).all(), name
        grad = jax.grad(
            lambda x, xk, fn=fn: jnp.sum(fn(p, x, xk, mask=mask)[:-1] * cot[:-1]), (0, 1)
        )
        gb, gc = grad(xq, bad), grad(xq, clean)
        np.testing.assert_array_equal(np.asarray(gb[0]), np.asarray(gc[0]), err_msg=name)
        assert np.isfinite(np.asarray(gb[1])).all(), name


@pytest.mark.usefixtures("unchecked_annotations")
def test_bad_input_is_refused_with_the_argument_named():
    prob = make_problem(BUCKETS[1], 0, "none", "arange", "interleaved")
    p, xq, xkv = prob.cast(np.float32)
    bad_uk = dataclasses.replace(p, w_uk=p.w_uk[:, :-1])
    for fn in (mla.mla_attention, mla.mla_absorbed_attention, oracle.mla_attention):
        with pytest.raises(ValueError, match=r"params.w_uk must have shape"):
            fn(bad_uk, xq, xkv)
        with pytest.raises(ValueError, match=r"w_kr and params.w_qr go together"):
            fn(dataclasses.replace(p, w_qr=None), xq, xkv)
        with pytest.raises(ValueError, match=r"x_kv must have shape \[..., T, 6\]"):
            fn(p, xq, xkv[..., :-1])
        with pytest.raises(TypeError, match="x_q has dtype float64"):
            fn(p, xq.astype(np.float64), xkv)
        with pytest.raises(ValueError, match="mask has shape"):
            fn(p, xq, xkv, mask=np.ones((4, 4), bool))
        with pytest.raises(ValueError, match="positions_q"):
            fn(p, xq, xkv, positions_q=np.arange(7))
    cache = CACHE(p, xkv)
    with pytest.raises(ValueError, match=r"cache must have shape \[..., T, 7\]"):
        mla.mla_absorbed_cache_attention(p, xq, cache[..., :-1])
    with pytest.raises(ValueError, match="d_rope must be 0 or a positive even"):
        mla.init_mla_params(0, d_model=4, num_heads=1, d_c=2, d_nope=2, d_rope=3)


# ----------------------------------------------------------------------------- (6) cost


@pytest.mark.parametrize("from_cache", [False, True])
@pytest.mark.parametrize("form", ["naive", "absorbed"])
@pytest.mark.parametrize("cfg", [BUCKETS[1], dataclasses.replace(NO_ROPE, d_cq=3)])
def test_cost_model_matmul_flops_equal_xla_dot_flops(cfg, form, from_cache):
    """``mla_cost(...).matmul_flops`` is exactly what XLA's compiled HLO does in dots."""
    prob = make_problem(cfg, 0, "none", "arange", "interleaved")
    p, xq, xkv = prob.cast(np.float32)
    batch = int(np.prod(cfg.batch))
    if from_cache:
        fn, kv = CACHE_FORMS[form], CACHE(p, xkv)
    else:
        fn, kv = FORMS[form], xkv
    hlo = jax.jit(fn, static_argnames=STATIC).lower(p, xq, kv).compile().as_text()
    model = mla.mla_cost(
        p.dims, batch=batch, t_q=cfg.t_q, t_k=cfg.t_k, form=form, from_cache=from_cache
    )
    assert model.matmul_flops == hlo_dot_flops(hlo)
    per_token = (
        cfg.d_c + cfg.d_rope
        if form == "absorbed"
        else cfg.heads * (cfg.d_nope + cfg.d_rope + cfg.d_v)
    )
    assert (
        model.cache_elements_per_token == per_token and model.cache_bytes_per_token == 4 * per_token
    )


def test_crossover_separates_the_cheaper_form():
    """Below ``mla_crossover`` queries per call the absorbed form is cheaper, above it the naive
    one (the ``ModelArgs`` defaults of DeepSeek-V3's ``inference/model.py``, and with query
    compression)."""
    for dims in (mla.DEEPSEEK_DEFAULTS, mla.DEEPSEEK_DEFAULTS._replace(d_cq=1536)):
        _crossover(dims)
    # FlashMLA's test runs the absorbed kernel with d = 576 (dv = 512): the cache row's width.
    cost = mla.mla_cost(mla.DEEPSEEK_DEFAULTS, batch=1, t_q=1, t_k=8, form="absorbed")
    assert cost.cache_elements_per_token == 576


def _crossover(dims):
    for t_k in (1024, 32768):
        star = mla.mla_crossover(dims, t_k)
        for t_q, absorbed_cheaper in ((int(star), True), (int(star) + 1, False), (1, True)):
            n, a = (
                mla.mla_cost(dims, batch=1, t_q=t_q, t_k=t_k, form=f, from_cache=True)
                for f in ("naive", "absorbed")
            )
            assert (a.matmul_flops < n.matmul_flops) == absorbed_cheaper, (t_k, t_q)


def test_docs_page_shows_the_cost_table():
    """``docs/mla.md`` holds ``mla_cost_table()`` verbatim (regenerate the page's table when the
    model changes)."""
    page = (Path(__file__).resolve().parents[1] / "docs" / "mla.md").read_text()
    assert mla.mla_cost_table() in page


def test_float64_inputs_compute_in_float64_with_x64_off():
    """float64 means float64: every public MLA function, with x64 off, returns float64 at float64
    accuracy (within the float64 bound; float32 arithmetic would miss it by ~1e9)."""
    prob = make_problem(BUCKETS[1], 4, "causal", "decode", "rotate_half")
    p, xq, xkv = prob.cast(np.float64)
    kw = prob.kw
    ref = oracle.mla_attention(p, xq, xkv, **kw)
    bound = tolerance.mla_attention_error_bound(p, xq, xkv, dtype=np.float64, **kw)
    with jax.enable_x64(False):
        assert not jax.config.jax_enable_x64
        cache = mla.mla_latent_cache(
            p, xkv, positions_kv=kw["positions_kv"], convention=kw["convention"]
        )
        ys = [f(p, xq, xkv, **kw) for f in FORMS.values()]
        ys += [f(p, xq, cache, **_no_kv_positions(kw)) for f in CACHE_FORMS.values()]
        p0 = make_problem(NO_ROPE, 0, "none", "arange", "interleaved").params
        assert mla.to_attention_params(p0).w_k.dtype == np.float64
    assert cache.dtype == np.float64
    for y in ys:
        assert y.dtype == np.float64
        assert_within_bound(y, ref, bound, label="x64 off")


# ----------------------------------------------------------------------------- the kit


def _no_rope_in_scale(p, x_q, x_kv, **kw):
    """Planted: the softmax scale ``1/sqrt(d_nope)``, forgetting the RoPE dims."""
    return mla.mla_absorbed_attention(p, x_q, x_kv, scale=1 / np.sqrt(p.w_uk.shape[-1]), **kw)


def _positions_dropped(p, x_q, x_kv, positions_q=None, positions_kv=None, **kw):
    """Planted: the queries rotated at ``0 .. T_q - 1`` whatever their positions."""
    return mla.mla_absorbed_attention(p, x_q, x_kv, **kw)


def _dense(p, x_q, x_kv, **kw):
    """Planted: a dense kernel that lets a masked token's NaN reach every output (0 x NaN)."""
    return np.asarray(mla.mla_absorbed_attention(p, x_q, x_kv, **kw)) + 0.0 * np.sum(x_kv)


def test_check_mla_passes_both_forms_and_catches_planted_bugs():
    """``attnref.conformance.check_mla``: the absorbed form passes every property (the naive
    form runs the same checks in the property tests above); each planted bug fails exactly the
    properties that can see it, and a failure's replay line reruns ``check_mla``."""
    from attnref.conformance import MLA_PROPERTIES, check_mla

    good = check_mla(mla.mla_absorbed_attention, max_examples=1)
    assert [r.status for r in good.results] == ["passed"] * len(MLA_PROPERTIES), good.summary()
    expect = {
        _no_rope_in_scale: {"rope", "causal", "decode", "masked_nan"},
        _positions_dropped: {"decode"},
        _dense: {"masked_nan"},
    }
    for bad, failing in expect.items():
        report = check_mla(bad, max_examples=1)
        got = {r.name for r in report.results if r.status == "failed"}
        assert got == failing, (bad.__name__, got)
    line = report.replay(report.results[-1])
    assert line.startswith("from attnref.conformance import check_mla"), line
