"""Rotary position embedding: three computations agree, relative offsets, conventions, gradients.

Tolerances are derived, first order in the unit round-off ``u`` of the tested dtype (plus the
float64 oracle's own error): :func:`attnref.tolerance.rope_attention_error_bound` and
:func:`attnref.tolerance.rope_map_error_bound`, whose derivation (angle errors ``e_p(m)`` of
``cos``/``sin`` of ``m theta_p``, the rotated pairs, the logits of both the rotate-``q``-and-``k``
and the relative ``W~_P(delta)`` forms) is in :mod:`attnref.tolerance` and ``docs/tolerances.md``.
Two computations of the same exact value differ by at most the sum of their bounds.
"""

from __future__ import annotations

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, note
from hypothesis import strategies as st

import attnref
from attnref import oracle
from attnref import rope as R
from attnref import strategies as ast
from attnref.oracle import _rope as rope_oracle
from attnref.testing import assert_comparative, assert_within_bound
from attnref.tolerance import (
    gamma,
    pair_sum,
    rope_angle_error,
    rope_attention_error_bound,
    rope_logit_error,
    rope_map_error_bound,
    unit_roundoff,
)

from .helpers import scaled

BASE = 10000.0
U64 = unit_roundoff(np.float64)
CONVENTIONS = R.CONVENTIONS
SEEDS = st.integers(0, 2**31 - 1)

ROPE_BUCKETS = (
    # no batch dims, three rotation planes
    ast.Config(batch=(), t=5, s=5, n=2, k=2, h=6, h_v=3, d_model=8),
    # batch dims, cross-attention T_q != T_k, d_v > d_k
    ast.Config(batch=(2,), t=4, s=6, n=2, k=2, h=4, h_v=5, d_model=6),
)
JIT_BUCKET = ROPE_BUCKETS[1]
POSITION_KINDS = ("arange", "decode", "random", "equal")


# ----------------------------------------------------------------------------- problems


@dataclasses.dataclass
class RopeProblem:
    p: ast.AttentionProblem
    pos_q: np.ndarray
    pos_k: np.ndarray
    convention: str

    def bound(self, pos_q=None, pos_k=None, **kw):
        p = self.p
        return rope_attention_error_bound(
            p.params,
            p.x_q,
            p.x_kv,
            positions_q=self.pos_q if pos_q is None else pos_q,
            positions_kv=self.pos_k if pos_k is None else pos_k,
            base=BASE,
            convention=self.convention,
            dtype=p.dtype,
            **p.inputs(),
            **kw,
        )

    def oracle(self, **kw):
        p = self.p
        kw = {"positions_q": self.pos_q, "positions_kv": self.pos_k, **kw}
        return rope_oracle.rope_attention(
            p.params, p.x_q, p.x_kv, convention=self.convention, base=BASE, **p.inputs(), **kw
        )


def make_positions(bucket: ast.Config, kind: str, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Integer positions of full shape ``[*batch, T]`` (int32, so one compile serves all)."""
    rng = np.random.default_rng(seed)
    b = bucket
    if kind == "arange":
        pq, pk = np.arange(b.t), np.arange(b.s)
    elif kind == "decode":  # queries are the last tokens of a long context
        c = int(rng.integers(0, 2000))
        pk = c + np.arange(b.s)
        pq = c + b.s - b.t + np.arange(b.t)
    elif kind == "random":
        pq = rng.integers(-64, 512, (*b.batch, b.t))
        pk = rng.integers(-64, 512, (*b.batch, b.s))
    else:  # "equal"
        c = int(rng.integers(0, 1000))
        pq, pk = np.full(b.t, c), np.full(b.s, c)
    pq = np.broadcast_to(pq, (*b.batch, b.t)).astype(np.int32)
    pk = np.broadcast_to(pk, (*b.batch, b.s)).astype(np.int32)
    return pq, pk


@st.composite
def rope_problems(
    draw,
    dtypes=("float32", "float64"),
    kinds=ast.WEIGHT_KINDS,
    buckets=(JIT_BUCKET,),
    position_kinds=POSITION_KINDS,
    conventions=CONVENTIONS,
    biases=(True,),
):
    """Problems for the RoPE forms. Jitted tests keep one bucket and parameter biases on (a
    ``None`` bias is a different pytree, hence another compile); the eager test varies both."""
    bucket = draw(st.sampled_from(buckets), label="bucket")
    kind = draw(st.sampled_from(kinds), label="mask kind")
    dtype = draw(st.sampled_from(dtypes), label="dtype")
    with_bias = draw(st.sampled_from(biases), label="parameter biases")
    convention = draw(st.sampled_from(conventions), label="convention")
    pkind = draw(st.sampled_from(position_kinds), label="position kind")
    seed = draw(SEEDS, label="data seed")
    note(f"{bucket} kind={kind} {dtype} biases={with_bias} {convention} {pkind} seed={seed}")
    p = ast.make_attention_problem(bucket, kind, seed, dtype, param_bias=with_bias)
    pq, pk = make_positions(bucket, pkind, seed)
    return RopeProblem(p, pq, pk, convention)


# ----------------------------------------------------------------------------- compiled functions


def _form(fn, convention):
    def apply(params, x_q, x_kv, pos_q, pos_k, mask, bias):
        return fn(
            params,
            x_q,
            x_kv,
            positions_q=pos_q,
            positions_kv=pos_k,
            mask=mask,
            bias=bias,
            base=BASE,
            convention=convention,
        )

    return apply


# Module-level callables with stable identity: jit caches are shared across examples.
FORMS = {"rope": R.rope_attention, "patterns": R.rope_patterns_attention}
APPLY = {(f, c): _form(fn, c) for f, fn in FORMS.items() for c in CONVENTIONS}
MAPS = {
    (name, c): functools.partial(fn, base=BASE, convention=c)
    for name, fn in (("real", R.apply_rope), ("complex", R.apply_rope_complex))
    for c in CONVENTIONS
}


def _run(variant, form, rp: RopeProblem, params=None, convention=None, pos_q=None, pos_k=None):
    p = rp.p
    fn = APPLY[form, convention or rp.convention]
    pq = rp.pos_q if pos_q is None else pos_q
    pk = rp.pos_k if pos_k is None else pos_k
    y = variant(fn)(p.params if params is None else params, p.x_q, p.x_kv, pq, pk, p.mask, p.bias)
    return np.asarray(y)


def _permutation(d: int) -> np.ndarray:
    """``P x = x[perm]``: interleaved pair layout -> rotate-half pair layout."""
    return np.concatenate([np.arange(0, d, 2), np.arange(1, d, 2)])


# ----------------------------------------------------------------------------- (1) agreement


@st.composite
def map_inputs(draw):
    shape = (2, 5, 3, 6)  # one shape: batch dims, several heads, three planes
    dtype = draw(st.sampled_from(["float32", "float64"]), label="dtype")
    convention = draw(st.sampled_from(CONVENTIONS), label="convention")
    seed = draw(SEEDS, label="seed")
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(dtype)
    positions = rng.integers(-100, 3000, shape[:-2]).astype(np.int32)
    return x, positions, convention


class RopeMapTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @scaled(0.5)
    @given(inputs=map_inputs())
    def test_rotation_complex_and_oracle_agree(self, inputs):
        """apply_rope (pairs and cos/sin) and apply_rope_complex (z exp(i m theta)) both lie
        within the derived bound of the float64 oracle, for both conventions."""
        x, positions, conv = inputs
        ref = rope_oracle.rope(x, positions, base=BASE, convention=conv)
        bound = rope_map_error_bound(x, positions, base=BASE, convention=conv, dtype=x.dtype)
        for name in ("real", "complex"):
            y = np.asarray(self.variant(MAPS[name, conv])(x, positions))
            assert y.dtype == x.dtype, f"{name}: {y.dtype}"
            assert_within_bound(y, ref, bound, label=f"{name} {conv}")

    @chex.variants(with_jit=True)
    @scaled(0.5)
    @given(inputs=map_inputs())
    def test_conventions_differ_by_a_fixed_permutation(self, inputs):
        """(3) rope_interleaved(x) = P^-1 rope_rotate_half(P x), P x = concat(x[0::2], x[1::2])."""
        x, positions, _ = inputs
        perm = _permutation(x.shape[-1])
        inter = np.asarray(self.variant(MAPS["real", "interleaved"])(x, positions))
        half = np.asarray(self.variant(MAPS["real", "rotate_half"])(x[..., perm], positions))
        back = np.empty_like(half)
        back[..., perm] = half
        bound = rope_map_error_bound(
            x, positions, base=BASE, convention="interleaved", dtype=x.dtype
        )
        assert_within_bound(back, inter, 2 * bound, label="P^-1 rope_half(P x)")


class RopeAttentionTest(chex.TestCase):
    def _check(self, rp: RopeProblem):
        ref, bound = rp.oracle(), rp.bound()
        outs = {}
        for form in FORMS:
            y = _run(self.variant, form, rp)
            assert y.dtype == rp.p.dtype, f"{form}: computed in {y.dtype}"
            assert_within_bound(y, ref, bound, label=f"{form} {rp.convention}")
            outs[form] = y
        assert_within_bound(outs["patterns"], outs["rope"], 2 * bound, label="patterns vs rope")

    @chex.variants(with_jit=True)
    @given(rp=rope_problems())
    def test_rope_and_patterns_forms_match_oracle(self, rp):
        """(1) rotate-q-and-k and the relative W_P(delta) form both equal the oracle."""
        self._check(rp)

    @chex.variants(without_jit=True)
    @scaled(0.3)
    @given(rp=rope_problems(dtypes=("float64",), buckets=ROPE_BUCKETS[:1], biases=(True, False)))
    def test_rope_and_patterns_forms_match_oracle_eagerly(self, rp):
        """The same without jit (float64; eager dispatch compiles every primitive per shape), on
        the bucket without batch dims, with and without parameter biases: concrete positions
        take the NumPy distinct-offsets path."""
        self._check(rp)

    @chex.variants(with_jit=True)
    @scaled(0.5)
    @given(rp=rope_problems(kinds=("none", "causal", "bias")), shift=st.integers(-500, 2000))
    def test_shifting_all_positions_leaves_output_unchanged(self, rp, shift):
        """(2) logits depend on pos_q - pos_k only: both exact outputs are equal, so the two
        computed outputs differ by at most the sum of their bounds."""
        sq, sk = rp.pos_q + np.int32(shift), rp.pos_k + np.int32(shift)
        bound = rp.bound() + rp.bound(sq, sk)
        for form in FORMS:
            y0 = _run(self.variant, form, rp)
            y1 = _run(self.variant, form, rp, pos_q=sq, pos_k=sk)
            assert_within_bound(y1, y0, bound, label=f"{form} shifted by {shift}")

    @chex.variants(with_jit=True)
    @scaled(0.5)
    @given(rp=rope_problems(conventions=("interleaved",)))
    def test_interleaved_is_rotate_half_on_permuted_columns(self, rp):
        """(3) interleaved RoPE with W_Q, W_K (and b_Q, b_K) equals rotate-half RoPE with their
        head-dimension columns permuted by P (q . k is invariant under a shared permutation)."""
        w = rp.p.params
        perm = _permutation(w.w_q.shape[-1])
        permuted = dataclasses.replace(
            w,
            **{
                k: None if getattr(w, k) is None else getattr(w, k)[..., perm]
                for k in ("w_q", "w_k", "b_q", "b_k")
            },
        )
        bound = rp.bound()
        for form in FORMS:
            inter = _run(self.variant, form, rp)
            half = _run(self.variant, form, rp, params=permuted, convention="rotate_half")
            assert_within_bound(half, inter, 2 * bound, label=f"{form} permuted")

    @chex.variants(with_jit=True)
    @scaled(0.3)
    @given(rp=rope_problems(position_kinds=("equal",)))
    def test_equal_positions_reduce_to_plain_attention(self, rp):
        """(5) with every position equal, R(m - n) = I: RoPE attention is plain attention."""
        p = rp.p
        ref = oracle.attention(p.params, p.x_q, p.x_kv, **p.inputs())
        for form in FORMS:
            assert_within_bound(_run(self.variant, form, rp), ref, rp.bound(), label=form)


# ----------------------------------------------------------------------------- the registry

ROPE_ENTRIES = attnref.formulations("rope")
REGISTRY_KINDS = ("none", "causal", "padding", "combined")


class RopeRegistryTest(chex.TestCase):
    """Every registry entry of the "rope" family against the oracle, so that a new entry is
    tested as soon as it is registered. Each example checks the drawn mask kind and a problem
    with a fully masked query row (its output is ``b_O``)."""

    def _check(self, rp: RopeProblem, seed: int) -> None:
        p = rp.p
        with_bias = p.params.b_q is not None
        masked = ast.make_attention_problem(
            p.config, "fully_masked_row", seed, p.dtype, param_bias=with_bias
        )
        assert ROPE_ENTRIES, "no formulation is registered in the 'rope' family"
        for problem in (rp, dataclasses.replace(rp, p=masked)):
            ref, bound = problem.oracle(), problem.bound()
            for f in ROPE_ENTRIES:
                fn = self.variant(f.apply, static_argnames=f.static_argnames)
                y = fn(
                    problem.p.params,
                    problem.p.x_q,
                    problem.p.x_kv,
                    positions_q=problem.pos_q,
                    positions_kv=problem.pos_k,
                    base=BASE,
                    convention=problem.convention,
                    **problem.p.inputs(),
                )
                assert y.dtype == p.dtype, f"{f.id}: computed in {y.dtype}"
                assert_within_bound(y, ref, bound, label=f"{f.id} {problem.p.kind}")

    @chex.variants(with_jit=True)
    @scaled(0.25)
    @given(rp=rope_problems(dtypes=("float32",), kinds=REGISTRY_KINDS), seed=SEEDS)
    def test_every_rope_entry_matches_oracle(self, rp, seed):
        """``jax.jit(apply, static_argnames=entry.static_argnames)`` of every entry (float32;
        float64 in the eager test)."""
        self._check(rp, seed)

    @chex.variants(without_jit=True)
    @scaled(0.25)
    @given(
        rp=rope_problems(
            dtypes=("float64",),
            kinds=REGISTRY_KINDS,
            buckets=ROPE_BUCKETS[:1],
            biases=(True, False),
        ),
        seed=SEEDS,
    )
    def test_every_rope_entry_matches_oracle_eagerly(self, rp, seed):
        """The same without jit (the eager test's bucket and dtype: its op caches)."""
        self._check(rp, seed)


def _three_logits(params, q, k, x_q, x_kv, pos_q, pos_k, convention):
    """Logits ``[..., H, T_q, T_k]`` three ways: real rotations, complex rotations, and
    ``x_i W_P(m_i - n_j) x_j^T`` with one pattern matrix per (batch, i, j) offset."""
    kw = dict(base=BASE, convention=convention)
    hi = "highest"
    real = jnp.einsum(
        "...qhd,...khd->...hqk",
        R.apply_rope(q, pos_q, **kw),
        R.apply_rope(k, pos_k, **kw),
        precision=hi,
    )
    cplx = jnp.einsum(
        "...qhd,...khd->...hqk",
        R.apply_rope_complex(q, pos_q, **kw),
        R.apply_rope_complex(k, pos_k, **kw),
        precision=hi,
    )
    deltas = pos_q[..., :, None] - pos_k[..., None, :]
    w_pat = R.rope_pattern_matrices(params, deltas.ravel(), **kw)
    w_pat = w_pat.reshape(w_pat.shape[0], *deltas.shape, *w_pat.shape[-2:])
    pattern = jnp.einsum("...qa,h...qkab,...kb->...hqk", x_q, w_pat, x_kv, precision=hi)
    return real, cplx, pattern


THREE_LOGITS = jax.jit(_three_logits, static_argnames=("convention",))


@scaled(0.3)
@given(
    seed=SEEDS,
    dtype=st.sampled_from(["float32", "float64"]),
    convention=st.sampled_from(CONVENTIONS),
)
def test_logits_three_ways(seed, dtype, convention):
    """(1) q' . k' with real rotations, with complex rotations, and x_i W_P(m_i - n_j) x_j^T from
    rope_pattern_matrices, all within the derived logit bound of the float64 oracle's logits
    (no biases, no scale: ``|ds| <= (gamma_{N_s} + e(m) + e(n)) QJ . KJ``; the inputs ``q, k``
    are ``x W`` rounded once to the dtype, within the projection allowance of ``N_s``)."""
    b = JIT_BUCKET
    p = ast.make_attention_problem(b, "none", seed, dtype, param_bias=False)
    pq, pk = make_positions(b, "random", seed)
    w = p.params
    q = np.einsum("...td,hde->...the", p.x_q, w.w_q).astype(dtype)
    k = np.einsum("...td,hde->...the", p.x_kv, w.w_k).astype(dtype)
    kw = dict(base=BASE, convention=convention)
    ref = np.einsum(
        "...qhd,...khd->...hqk", rope_oracle.rope(q, pq, **kw), rope_oracle.rope(k, pk, **kw)
    )
    outs = THREE_LOGITS(w, q, k, p.x_q, p.x_kv, pq, pk, convention=convention)
    qa = np.einsum("...td,hde->...hte", np.abs(p.x_q), np.abs(w.w_q))
    ka = np.einsum("...td,hde->...hte", np.abs(p.x_kv), np.abs(w.w_k))
    ls = np.einsum("...hqd,...hkd->...hqk", pair_sum(qa, convention), pair_sum(ka, convention))
    n_s = 2 * (b.d_model + 3) + 2 * b.d_k + 2
    bound = sum(
        gamma(n_s, unit_roundoff(dt)) * ls
        + rope_logit_error(qa, ka, pq, pk, convention, unit_roundoff(dt), BASE)
        for dt in (dtype, np.float64)
    )
    for label, y in zip(("real", "complex", "patterns"), outs, strict=True):
        assert y.dtype == dtype, label
        assert_within_bound(y, ref, bound, label=f"logits {label} {convention}")


# ----------------------------------------------------------------------------- (4) R(delta)

ROTATION = jax.jit(R.rope_rotation, static_argnames=("head_dim", "base", "convention", "dtype"))


@scaled(0.5)
@given(
    seed=SEEDS,
    dtype=st.sampled_from([np.float32, np.float64]),
    convention=st.sampled_from(CONVENTIONS),
    head_dim=st.just(6),
)
def test_rotation_matrix_group_properties(seed, dtype, convention, head_dim):
    """(4) R(delta) is orthogonal, R(0) = I, R(a) R(b) = R(a + b), R(m) R(n)^T = R(m - n)
    (the sign of the relative offset), and rope(q, m) = q R(m) for rows q.

    ``R^`` entries are within ``e(delta)`` of ``R``; a product of two such matrices has two
    non-zero terms per entry, so ``|R^(a) R^(b) - R(a) R(b)| <= 2 e(a) + 2 e(b) + 2 gamma_d``."""
    rng = np.random.default_rng(seed)
    kw = dict(head_dim=head_dim, base=BASE, convention=convention, dtype=dtype)
    a, b = rng.integers(-1000, 1000, 8), rng.integers(-1000, 1000, 8)
    ra, rb = np.asarray(ROTATION(a, **kw)), np.asarray(ROTATION(b, **kw))
    assert ra.dtype == dtype
    u = unit_roundoff(dtype)

    def e(delta):  # [8, 1, 1], the largest frequency theta_0 = 1
        return rope_angle_error(np.abs(delta).astype(np.float64), u, BASE)[:, None, None]

    eye = np.broadcast_to(np.eye(head_dim), ra.shape)
    np.testing.assert_array_equal(np.asarray(ROTATION(np.zeros(8, np.int64), **kw)), eye)
    assert_within_bound(
        ra @ np.swapaxes(ra, -1, -2), eye, 4 * e(a) + 2 * gamma(head_dim, u), label="R R^T"
    )
    ab = np.asarray(ROTATION(a + b, **kw))
    tol = 2 * e(a) + 2 * e(b) + e(a + b) + 2 * gamma(head_dim, u)
    assert_within_bound(ra @ rb, ab, tol, label="R(a) R(b) = R(a + b)")
    amb = np.asarray(ROTATION(a - b, **kw))
    tol = 2 * e(a) + 2 * e(b) + e(a - b) + 2 * gamma(head_dim, u)
    assert_within_bound(ra @ np.swapaxes(rb, -1, -2), amb, tol, label="R(m) R(n)^T = R(m - n)")
    # Row convention: rope(q, m) = q R(m) (kernel layout: 8 tokens, 1 head).
    q = rng.standard_normal((8, 1, head_dim)).astype(dtype)
    rot = np.asarray(R.apply_rope(q, a, base=BASE, convention=convention))
    row = np.einsum("tnd,tde->tne", q.astype(np.float64), ra.astype(np.float64))
    mag = pair_sum(np.abs(q.astype(np.float64)), convention)
    tol = mag * (2 * e(a) + gamma(2, u) + gamma(head_dim, u))
    assert_within_bound(rot, row, tol, label="rope(q, m) = q R(m)")


# ----------------------------------------------------------------------------- (6) gradients


def _loss(fn, params, x_q, x_kv, pos_q, pos_k, mask, bias, cot):
    return jnp.sum(fn(params, x_q, x_kv, pos_q, pos_k, mask, bias) * cot)


GRAD = {key: jax.grad(functools.partial(_loss, fn), argnums=(0, 1, 2)) for key, fn in APPLY.items()}


def _flat(grads):
    params_g, gx_q, gx_kv = grads
    named = {
        f"d/d{k}": getattr(params_g, k)
        for k in ("w_q", "w_k", "w_v", "w_o", "b_q", "b_k", "b_v", "b_o")
    }
    named.update({"d/dx_q": gx_q, "d/dx_kv": gx_kv})
    return {k: np.asarray(v, np.float64) for k, v in named.items() if v is not None}


class RopeGradientTest(chex.TestCase):
    @chex.variants(with_jit=True)
    @scaled(0.25)
    @given(
        rp=rope_problems(
            dtypes=("float64",),
            kinds=("none", "combined", "fully_masked_row"),
            conventions=("interleaved",),  # rotate_half's gradients: test_check_grads_float64
        )
    )
    def test_gradients_of_rope_and_patterns_forms_agree(self, rp):
        """(6) d loss / d (params, x_q, x_kv) through both forms.

        float32: FlashAttention's comparative rule, as in test_gradients (float64 gradients as
        the truth, the rope form's float32 gradient as the same-precision reference, floor
        ``gamma_{N_b}(u32) M``). float64: there is no more precise truth, so the rule is carried
        over by first-order scaling: each form's float64 error is ``(u64/u32)`` times its
        float32 error to first order, hence ``|g64_pat - g64_rope| <= 2 (u64/u32) (err32_rope +
        err32_pat) + gamma_{N_b}(u64) M``. ``N_b`` counts the longest backward reduction: the
        relative form sums ``dW_P`` over every (batch, query, key) pair, then contracts through
        ``R`` and ``W~_K``: ``N_b = prod(batch) T_q T_k + T_k + 2 (d_model + 1) + 2 d_k + d_v + H``.
        """
        p, b = rp.p, JIT_BUCKET
        cot = np.random.default_rng(0).standard_normal((*b.batch, b.t, b.d_model))

        def grads(form, dtype):
            g = self.variant(GRAD[form, rp.convention])(
                p.params.astype(dtype),
                p.x_q.astype(dtype),
                p.x_kv.astype(dtype),
                rp.pos_q,
                rp.pos_k,
                p.mask,
                p.bias.astype(dtype),
                cot.astype(dtype),
            )
            return _flat(g)

        g64 = {f: grads(f, np.float64) for f in FORMS}
        g32 = {f: grads(f, np.float32) for f in FORMS}
        n_b = (
            int(np.prod(b.batch)) * b.t * b.s + b.s + 2 * (b.d_model + 1) + 2 * b.d_k + b.d_v + b.n
        )
        scale = max(float(np.abs(g).max()) for g in g64["rope"].values())
        ratio = unit_roundoff(np.float64) / unit_roundoff(np.float32)
        for name, truth in g64["rope"].items():
            for form in FORMS:
                assert np.all(np.isfinite(g32[form][name])), f"{form} {name} not finite"
                assert_comparative(
                    g32[form][name],
                    truth,
                    g32["rope"][name],
                    dtype=np.float32,
                    floor_n=n_b,
                    floor_magnitude=scale,
                    label=f"float32 {form} {name}",
                )
            err32 = sum(float(np.abs(g32[f][name] - g64[f][name]).max()) for f in FORMS)
            allowed = 2 * ratio * err32 + gamma(n_b, unit_roundoff(np.float64)) * scale
            diff = float(np.abs(g64["patterns"][name] - truth).max())
            assert diff <= allowed, f"float64 {name}: {diff:.3e} > {allowed:.3e}"


@pytest.mark.parametrize("form", list(FORMS))
def test_check_grads_float64(form):
    """Finite differences vs autodiff (forward and reverse, first order) on a tiny case."""
    b = ast.Config(batch=(), t=3, s=4, n=1, k=1, h=4, h_v=2, d_model=4)
    p = ast.make_attention_problem(b, "combined", seed=7, dtype=np.float64)
    pq, pk = make_positions(b, "random", 7)
    fn = jax.jit(
        lambda params, x_q, x_kv: APPLY[form, "rotate_half"](
            params, x_q, x_kv, pq, pk, p.mask, p.bias
        )
    )
    jax.test_util.check_grads(fn, (p.params, p.x_q, p.x_kv), order=1, modes=("fwd", "rev"))


# ----------------------------------------------------------------------------- defaults, GQA


def test_defaults_broadcast_positions_residual_and_scale():
    """Default positions are arange(T); [T] positions broadcast over batch; residual and an
    explicit scale as everywhere; float64 inputs compute in float64 with x64 off."""
    b = JIT_BUCKET
    p = ast.make_attention_problem(b, "causal", seed=3, dtype=np.float64)
    rp = RopeProblem(p, *make_positions(b, "arange", 0), "rotate_half")
    pq, pk = np.array([5, 1, 9, 2]), np.array([0, 3, 3, 7, 8, 20])
    kw = dict(scale=0.3, residual=True)
    for form, fn in FORMS.items():

        def defaults(params, x_q, x_kv, fn=fn):
            return fn(params, x_q, x_kv, **p.inputs())

        def given_positions(params, x_q, x_kv, pq, pk, fn=fn):
            return fn(params, x_q, x_kv, positions_q=pq, positions_kv=pk, **kw, **p.inputs())

        y = jax.jit(defaults)(p.params, p.x_q, p.x_kv)
        assert_within_bound(y, rp.oracle(), rp.bound(), label=f"{form} defaults")
        y = jax.jit(given_positions)(p.params, p.x_q, p.x_kv, pq, pk)
        ref = rp.oracle(positions_q=pq, positions_kv=pk, **kw)
        assert_within_bound(y, ref, rp.bound(pq, pk, **kw), label=f"{form} [T] positions")


def test_float64_inputs_compute_in_float64_with_x64_off():
    """float64 means float64 with x64 off too (the shapes of the eager test: its op caches)."""
    b = ROPE_BUCKETS[0]
    p = ast.make_attention_problem(b, "combined", seed=4, dtype=np.float64)
    rp = RopeProblem(
        p, *(pos.astype(np.int64) for pos in make_positions(b, "random", 4)), "interleaved"
    )
    kw = dict(positions_q=rp.pos_q, positions_kv=rp.pos_k, convention="interleaved", base=BASE)
    with jax.enable_x64(False):
        outs = {f: fn(p.params, p.x_q, p.x_kv, **kw, **p.inputs()) for f, fn in FORMS.items()}
        rot = R.apply_rope(np.ones((4, 2, 6)), np.arange(4))
        rot_c = R.apply_rope_complex(np.ones((4, 2, 6)), np.arange(4))
        rmat = R.rope_rotation(3, 6, dtype=np.float64)
    for form, y in outs.items():
        assert y.dtype == np.float64, form
        assert_within_bound(y, rp.oracle(), rp.bound(), label=f"{form} x64 off")
    assert rot.dtype == rot_c.dtype == rmat.dtype == np.float64


def test_grouped_query_heads_match_repeated_heads():
    """K shared key/value heads: query head n uses kv head n // (H / K), i.e. the same as
    repeating each kv head H / K times."""
    b = ast.Config(batch=(2,), t=4, s=6, n=4, k=4, h=4, h_v=3, d_model=6)
    p = ast.make_attention_problem(b, "combined", seed=5, dtype=np.float64)
    w = p.params
    shared = dataclasses.replace(w, w_k=w.w_k[::2], b_k=w.b_k[::2], w_v=w.w_v[::2], b_v=w.b_v[::2])
    repeated = dataclasses.replace(
        w, **{k: np.repeat(getattr(shared, k), 2, axis=0) for k in ("w_k", "b_k", "w_v", "b_v")}
    )
    pq, pk = make_positions(b, "random", 5)
    rp = RopeProblem(dataclasses.replace(p, params=repeated), pq, pk, "interleaved")
    ref = rp.oracle()
    np.testing.assert_array_equal(
        rope_oracle.rope_attention(
            shared,
            p.x_q,
            p.x_kv,
            positions_q=pq,
            positions_kv=pk,
            convention="interleaved",
            **p.inputs(),
        ),
        ref,
    )
    for form in FORMS:
        y = jax.jit(APPLY[form, "interleaved"])(shared, p.x_q, p.x_kv, pq, pk, p.mask, p.bias)
        assert_within_bound(y, ref, rp.bound(), label=f"{form} GQA")


# ----------------------------------------------------------------------------- (7) errors


ERR_P = ast.make_attention_problem(ROPE_BUCKETS[1], "none", seed=0, dtype=np.float64)


def _odd_params():
    w = ERR_P.params
    return dataclasses.replace(
        w, w_q=w.w_q[..., :3], w_k=w.w_k[..., :3], b_q=w.b_q[..., :3], b_k=w.b_k[..., :3]
    )


@pytest.mark.usefixtures("unchecked_annotations")  # checks attnref's own errors
@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize(
    ("kw", "exc", "match"),
    [
        (dict(params="odd"), ValueError, r"d_k .*must be a positive even integer.*d_k.*=3"),
        (dict(convention="neox"), ValueError, r"unknown RoPE convention 'neox'"),
        (dict(positions_q=np.arange(5)), ValueError, r"positions_q has shape \(5,\).*T=4"),
        (dict(positions_kv=np.zeros((3, 6), int)), ValueError, r"positions_kv has shape \(3, 6\)"),
        (dict(positions_q=np.zeros(4)), TypeError, r"positions_q must hold integer positions"),
    ],
)
def test_errors_name_the_argument(form, jit, kw, exc, match):
    p = ERR_P
    kw = dict(kw)
    params = _odd_params() if kw.pop("params", None) == "odd" else p.params
    conv = kw.pop("convention", "rotate_half")

    def call(params, x_q, x_kv):
        return FORMS[form](params, x_q, x_kv, convention=conv, **kw)

    with pytest.raises(exc, match=match):
        (jax.jit(call) if jit else call)(params, p.x_q, p.x_kv)


@pytest.mark.usefixtures("unchecked_annotations")  # checks attnref's own errors
def test_map_errors():
    x = np.zeros((4, 2, 6), np.float32)
    with pytest.raises(ValueError, match=r"head_dim \(x.shape\[-1\]\) must be a positive even"):
        R.apply_rope(np.zeros((4, 2, 5), np.float32), np.arange(4))
    with pytest.raises(ValueError, match="unknown RoPE convention 'gptj'"):
        R.apply_rope_complex(x, np.arange(4), convention="gptj")
    with pytest.raises(ValueError, match=r"positions has shape \(5,\)"):
        R.apply_rope(x, np.arange(5))
    with pytest.raises(ValueError, match=r"rank >= 3"):
        R.apply_rope(np.zeros((4, 6)), np.arange(4))
    with pytest.raises(
        ValueError, match="head_dim must be a positive even integer; got head_dim=7"
    ):
        R.rope_frequencies(7)
    with pytest.raises(ValueError, match="head_dim must be a positive even"):
        R.rope_rotation(3, 5)
    with pytest.raises(ValueError, match="base must be a positive finite"):
        R.rope_frequencies(8, base=-1.0)
    with pytest.raises(ValueError, match=r"deltas must have shape \[D\]"):
        R.rope_pattern_matrices(ERR_P.params, np.zeros((2, 2), int))
    # And the oracle refuses the same inputs.
    with pytest.raises(ValueError, match="even head dimension"):
        rope_oracle.rope(np.zeros((4, 2, 5)), np.arange(4))
    with pytest.raises(ValueError, match="unknown RoPE convention"):
        rope_oracle.rope(x, np.arange(4), convention="gptj")
    with pytest.raises(ValueError, match=r"positions of shape \(5,\)"):
        rope_oracle.rope(x, np.arange(5))


def test_frequencies():
    theta = np.asarray(R.rope_frequencies(8, base=100.0, dtype=np.float64))
    np.testing.assert_allclose(theta, [1.0, 100.0**-0.25, 0.1, 100.0**-0.75], rtol=4 * U64)
    assert R.rope_frequencies(8).dtype == np.float32
    with jax.enable_x64(False):
        assert R.rope_frequencies(8, dtype=np.float64).dtype == np.float64
