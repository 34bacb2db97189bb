"""Linear (kernel) attention: every form equals every other and the float64 oracle, causality,
recurrent decoding, the denominator policy, and bad input. FAVOR+ statistics live in
``tests/test_favor_statistics.py``.

Tolerances: :func:`attnref.tolerance.linear_error_bound` and ``linear_multihead_error_bound``
(derived componentwise bounds, documented there and in ``docs/linear_attention.md``).
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
from attnref import oracle, tolerance
from attnref._src import linear as linear_impl
from attnref.testing import assert_comparative, assert_within_bound

from .helpers import BUCKETS, make_problem, scaled

LINEAR = attnref.formulations("linear")
KERNEL = [f for f in LINEAR if f.native is not f.apply]  # forms with a (q, k, v) native level
MAPS = ("elu_plus_one", "relu", "identity", "taylor2", "favor_plus")
CHUNKS = (1, 2, 4, 7)


@dataclasses.dataclass(frozen=True)
class KBucket:
    batch: tuple[int, ...]
    t: int
    heads: int
    d_k: int
    d_v: int


KBUCKETS = (KBucket((), 5, 1, 3, 2), KBucket((2,), 6, 2, 4, 3))


def feature_map(name: str, d_k: int, seed: int = 0) -> attnref.FeatureMap:
    if name == "favor_plus":
        return attnref.favor_plus(seed, d_k, 2 * d_k)
    return attnref.FeatureMap(name)


@dataclasses.dataclass
class KProblem:
    bucket: KBucket
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    key_mask: np.ndarray
    fm: attnref.FeatureMap
    causal: bool
    eps: float
    dtype: np.dtype


def make_kproblem(bucket, map_name, causal, padded, eps, seed, dtype):
    rng = np.random.default_rng(seed)
    b = bucket
    q, k = (rng.standard_normal((*b.batch, b.t, b.heads, b.d_k)) for _ in range(2))
    v = rng.standard_normal((*b.batch, b.t, b.heads, b.d_v))
    lengths = rng.integers(0, b.t + 1, size=b.batch) if padded else np.full(b.batch, b.t)
    key_mask = np.arange(b.t) < np.asarray(lengths)[..., None]
    dt = np.dtype(dtype)
    return KProblem(
        b,
        q.astype(dt),
        k.astype(dt),
        v.astype(dt),
        key_mask,
        feature_map(map_name, b.d_k, seed),
        causal,
        eps,
        dt,
    )


@st.composite
def kproblems(draw, maps=MAPS, dtypes=("float32", "float64"), buckets=KBUCKETS):
    bucket = draw(st.sampled_from(buckets), label="bucket")
    name = draw(st.sampled_from(maps), label="feature map")
    causal = draw(st.booleans(), label="causal")
    padded = draw(st.booleans(), label="key padding")
    eps = draw(st.sampled_from((0.0, 1e-3)), label="eps")
    dtype = draw(st.sampled_from(dtypes), label="dtype")
    seed = draw(st.integers(0, 2**31 - 1), label="seed")
    note(f"{bucket} {name} causal={causal} padded={padded} eps={eps} {dtype} seed={seed}")
    return make_kproblem(bucket, name, causal, padded, eps, seed, dtype)


def _kw(p, **extra):
    return dict(feature_map=p.fm, causal=p.causal, key_mask=p.key_mask, eps=p.eps, **extra)


def _static(f):
    return tuple(n for n in f.static_argnames if n != "residual")


def _check_kernel_forms(p, chunk, variant):
    ref = oracle.linear_attention(p.q, p.k, p.v, **_kw(p))
    bound = tolerance.linear_error_bound(p.q, p.k, p.v, dtype=p.dtype, **_kw(p))
    ran = 0
    for f in KERNEL:
        if p.causal not in f.causal_modes:
            with pytest.raises(ValueError, match="causal"):
                f.native(p.q, p.k, p.v, **_kw(p))
            continue
        extra = {"chunk_size": chunk} if "chunk_size" in f.static_argnames else {}
        fn = variant(f.native, static_argnames=_static(f))
        y = np.asarray(fn(p.q, p.k, p.v, **_kw(p, **extra)))
        assert y.dtype == p.dtype, f.id
        assert_within_bound(y, ref, bound, label=f.id)
        ran += 1
    assert ran >= 2  # non-causal: quadratic, associative; causal: four forms


class KernelAgreementTest(chex.TestCase):
    @chex.variants(with_jit=True)
    @scaled(0.6)
    @given(p=kproblems(), chunk=st.sampled_from(CHUNKS))
    def test_every_form_matches_oracle(self, p, chunk):
        _check_kernel_forms(p, chunk, self.variant)

    @chex.variants(without_jit=True)
    @scaled(0.5)
    @given(p=kproblems(buckets=KBUCKETS[1:]), chunk=st.sampled_from(CHUNKS))
    def test_every_form_matches_oracle_eagerly(self, p, chunk):
        """Without jit on one shape bucket (eager execution compiles per primitive and shape)."""
        _check_kernel_forms(p, chunk, self.variant)


@scaled(0.3)
@given(
    bucket=st.sampled_from(BUCKETS[1:]),
    name=st.sampled_from(MAPS),
    causal=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
    dtype=st.sampled_from(("float32", "float64")),
)
def test_multihead_forms_match_oracle(bucket, name, causal, seed, dtype):
    """Registry ``apply`` (params and rows) against ``oracle.linear_multihead``, biases on."""
    p = make_problem(bucket, "none", seed, dtype)
    x_kv = p.x_q if causal else p.x_kv
    rng = np.random.default_rng(seed)
    key_mask = (
        np.arange(x_kv.shape[-2]) < rng.integers(1, x_kv.shape[-2] + 1, bucket.batch)[..., None]
    )
    kw = dict(feature_map=feature_map(name, bucket.d_k, seed), causal=causal, key_mask=key_mask)
    ref = oracle.linear_multihead(p.params, p.x_q, x_kv, **kw)
    bound = tolerance.linear_multihead_error_bound(p.params, p.x_q, x_kv, dtype=p.dtype, **kw)
    for f in LINEAR:
        if causal in f.causal_modes:
            y = f.jit()(p.params, p.x_q, x_kv, **kw)
            assert y.dtype == p.dtype
            assert_within_bound(y, ref, bound, label=f"{f.id} {name}")


def test_multihead_residual_form():
    p = make_problem(BUCKETS[2], "none", 4, np.float64)
    kw = dict(feature_map=attnref.elu_plus_one(), causal=True)
    ref = oracle.linear_multihead(p.params, p.x_q, residual=True, **kw)
    bound = tolerance.linear_multihead_error_bound(
        p.params, p.x_q, residual=True, dtype=np.float64, **kw
    )
    for f in LINEAR:
        if True in f.causal_modes:
            y = f.apply(p.params, p.x_q, residual=True, **kw)
            assert_within_bound(y, ref, bound, label=f.id)


# ----------------------------------------------------------------------------- gradients


def _loss(native, q, k, v, key_mask, cot, *, fm, causal, **static):
    return jnp.sum(
        native(q, k, v, feature_map=fm, causal=causal, key_mask=key_mask, **static) * cot
    )


@functools.cache
def _grad_fn(fid, causal, chunk):
    f = attnref.get(fid)
    static = {"chunk_size": chunk} if "chunk_size" in f.static_argnames else {}

    def loss(q, k, v, key_mask, cot, fm):
        return _loss(f.native, q, k, v, key_mask, cot, fm=fm, causal=causal, **static)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


@scaled(0.2)
@given(
    p=kproblems(maps=("elu_plus_one", "taylor2", "favor_plus"), dtypes=("float64",)),
    chunk=st.sampled_from(CHUNKS),
)
def test_gradients_agree_across_forms(p, chunk):
    """FlashAttention's rule in float32 against the float64 quadratic form (as for softmax, see
    tests/test_gradients.py); positive maps only: with signed maps the ratio's gradient is not
    determined by float32 arithmetic near cancelling denominators."""
    rng = np.random.default_rng(0)
    cot = rng.standard_normal((*p.v.shape[:-3], p.q.shape[-3], *p.v.shape[-2:]))
    b = p.bucket
    n_b = int(np.prod(b.batch)) * b.t + b.t + p.fm.num_features(b.d_k) + b.d_k + b.d_v + 4

    def grads(fid, dtype):
        fn = _grad_fn(fid, p.causal, chunk)
        return [
            np.asarray(g, np.float64)
            for g in fn(
                p.q.astype(dtype),
                p.k.astype(dtype),
                p.v.astype(dtype),
                p.key_mask,
                cot.astype(dtype),
                p.fm,
            )
        ]

    g64 = grads("linear_quadratic", np.float64)
    ref32 = grads("linear_quadratic", np.float32)
    scale = max(float(np.abs(g).max()) for g in g64)
    for f in KERNEL:
        if p.causal not in f.causal_modes:
            continue
        for name, a, e, r in zip("qkv", grads(f.id, np.float32), g64, ref32, strict=True):
            assert np.all(np.isfinite(a)), f"{f.id} d/d{name}"
            assert_comparative(
                a,
                e,
                r,
                dtype=np.float32,
                floor_n=n_b,
                floor_magnitude=scale,
                label=f"{f.id} d/d{name}",
            )


# ----------------------------------------------------------------------------- causality


def _leaky_favor_keys(fm):
    """A deliberately wrong FAVOR+: keys stabilised by a max over the whole sequence."""

    def phi(x, role):
        if role == "query":
            return fm(x, role)
        d = x.shape[-1]
        xs = x * d**-0.25
        w = jnp.asarray(fm.omega, x.dtype)
        expo = jnp.einsum("...d,md->...m", xs, w) - 0.5 * jnp.sum(xs * xs, -1, keepdims=True)
        return jnp.exp(expo - jnp.max(expo, axis=(-3, -1), keepdims=True)) / w.shape[0] ** 0.5

    return phi


def _future_keys(p, extra_tokens, rng):
    """Half the appended keys are random (x3 norm); the rest sit on a FAVOR+ direction
    (k = w_i d^(1/4), the largest possible key exponent), the adversarial case for any
    stabiliser that looks across positions."""
    shape = (*p.k.shape[:-3], extra_tokens, *p.k.shape[-2:])
    more = rng.standard_normal(shape) * 3
    if p.fm.name == "favor_plus":
        w = np.asarray(p.fm.omega)[rng.integers(len(p.fm.omega))]
        more[..., extra_tokens // 2 :, :, :] = w * p.k.shape[-1] ** 0.25
    return more.astype(p.k.dtype)


@functools.cache
def _jitted(fid):
    f = attnref.get(fid)
    return jax.jit(f.native, static_argnames=_static(f))


def _prefix_check(fn, p, extra_tokens, seed):
    """Outputs for the first T tokens are unchanged when future tokens are appended: both runs
    are within their bounds of the same exact values (causality makes them equal)."""
    rng = np.random.default_rng(seed)

    def extend(a, more=None):
        if more is None:
            more = rng.standard_normal((*a.shape[:-3], extra_tokens, *a.shape[-2:])) * 3
        return np.concatenate([a, more.astype(a.dtype)], axis=-3)

    q2, k2, v2 = extend(p.q), extend(p.k, _future_keys(p, extra_tokens, rng)), extend(p.v)
    km2 = np.concatenate([p.key_mask, np.ones((*p.key_mask.shape[:-1], extra_tokens), bool)], -1)
    kw = dict(feature_map=p.fm, causal=True, eps=p.eps)
    short = np.asarray(fn(p.q, p.k, p.v, key_mask=p.key_mask, **kw))
    long = np.asarray(fn(q2, k2, v2, key_mask=km2, **kw))[..., : p.bucket.t, :, :]
    bound = tolerance.linear_error_bound(p.q, p.k, p.v, key_mask=p.key_mask, dtype=p.dtype, **kw)
    assert_within_bound(long, short, 2 * bound, label="prefix outputs after appending tokens")


@scaled(0.3)
@given(
    bucket=st.sampled_from(KBUCKETS),
    name=st.sampled_from(MAPS),
    seed=st.integers(0, 2**31 - 1),
    extra=st.sampled_from((1, 3)),
)
def test_appending_future_tokens_never_changes_the_past(bucket, name, seed, extra):
    p = make_kproblem(bucket, name, True, True, 1e-2, seed, np.float64)
    for f in KERNEL:
        if True in f.causal_modes:
            _prefix_check(_jitted(f.id), p, extra, seed)


def test_causality_check_catches_a_sequence_wide_max():
    """The property above fails for FAVOR+ keys stabilised by a max over the sequence (with
    eps > 0 the shift no longer cancels, so future keys move past outputs)."""
    p = make_kproblem(KBUCKETS[1], "favor_plus", True, False, 1e-2, 3, np.float64)
    leaky = dataclasses.replace(p, fm=_LeakyMap(p.fm))
    with pytest.raises(AssertionError, match="prefix outputs"):
        _prefix_check(linear_impl.linear_quadratic, leaky, 3, 3)


class _LeakyMap:
    """Duck-typed feature map wrapping FAVOR+ with the leaky key stabilisation."""

    def __init__(self, fm):
        self._fm, self._phi = fm, _leaky_favor_keys(fm)
        self.name, self.omega = fm.name, fm.omega

    def __call__(self, x, role):
        return self._phi(x, role)

    def num_features(self, d):
        return self._fm.num_features(d)


@pytest.mark.parametrize("fid", [f.id for f in KERNEL if True in f.causal_modes])
def test_gradient_to_future_tokens_is_exactly_zero(fid):
    p = make_kproblem(KBUCKETS[1], "favor_plus", True, False, 1e-3, 5, np.float64)
    f = attnref.get(fid)
    t = 2

    def out_t(q, k, v):
        y = f.native(q, k, v, feature_map=p.fm, causal=True, key_mask=p.key_mask, eps=p.eps)
        return jnp.sum(y[..., t, :, :])

    gq, gk, gv = jax.grad(out_t, argnums=(0, 1, 2))(p.q, p.k, p.v)
    for g in (gq, gk, gv):
        np.testing.assert_array_equal(np.asarray(g)[..., t + 1 :, :, :], 0.0)
    assert np.abs(np.asarray(gk)[..., : t + 1, :, :]).max() > 0  # the past does matter


# ----------------------------------------------------------------------------- decoding


@scaled(0.3)
@given(bucket=st.sampled_from(KBUCKETS), name=st.sampled_from(MAPS), seed=st.integers(0, 2**31 - 1))
def test_recurrent_decoding_equals_causal_form_at_every_step(bucket, name, seed):
    """Constant-size state, one token per step (jitted step), against the causal oracle."""
    p = make_kproblem(bucket, name, True, True, 0.0, seed, np.float64)
    ref = oracle.linear_attention(p.q, p.k, p.v, **_kw(p))
    bound = tolerance.linear_error_bound(p.q, p.k, p.v, dtype=np.float64, **_kw(p))
    m = p.fm.num_features(bucket.d_k)
    state = attnref.linear_state_init(bucket.batch, bucket.heads, m, bucket.d_v, np.float64)
    step = jax.jit(attnref.linear_step)
    for t in range(bucket.t):
        state, y_t = step(
            state,
            p.q[..., t, :, :],
            p.k[..., t, :, :],
            p.v[..., t, :, :],
            feature_map=p.fm,
            key_valid=p.key_mask[..., t],
        )
        assert state.s.shape == (*bucket.batch, bucket.heads, m, bucket.d_v)  # constant memory
        assert_within_bound(y_t, ref[..., t, :, :], bound[..., t, :, :], label=f"step {t}")


# ----------------------------------------------------------------------------- denominator


def test_eps_policies_and_eps_to_zero():
    """add: y = num / (D + eps) -> num / D as eps -> 0, with |y_eps - y_0| = |y_0| eps / |D + eps|;
    clamp: y = num / max(D, eps) equals the exact ratio once D >= eps."""
    p = make_kproblem(KBUCKETS[1], "elu_plus_one", True, False, 0.0, 1, np.float64)
    exact = np.asarray(linear_impl.linear_prefix_sum(p.q, p.k, p.v, feature_map=p.fm))
    fq = oracle.features(p.fm, p.q, "query")
    fk = oracle.features(p.fm, p.k, "key")
    den = np.einsum("...thm,...thm->...th", fq, np.cumsum(fk, axis=-3))
    prev = None
    for eps in (1e-1, 1e-3, 1e-5, 1e-7, 1e-9):
        y = np.asarray(linear_impl.linear_prefix_sum(p.q, p.k, p.v, feature_map=p.fm, eps=eps))
        predicted = np.abs(exact) * (eps / (den + eps))[..., None]
        gap = np.abs(y - exact)
        # The gap is the predicted one up to the rounding bound of the two evaluations.
        bound = 2 * tolerance.linear_error_bound(
            p.q, p.k, p.v, feature_map=p.fm, causal=True, eps=eps, dtype=np.float64
        )
        assert np.all(np.abs(gap - predicted) <= bound + 1e-300)
        if prev is not None:
            assert gap.max() < prev
        prev = gap.max()
    clamp_eps = float(den.min()) / 2
    y = linear_impl.linear_prefix_sum(
        p.q, p.k, p.v, feature_map=p.fm, eps=clamp_eps, eps_policy="clamp"
    )
    bound = tolerance.linear_error_bound(
        p.q, p.k, p.v, feature_map=p.fm, causal=True, dtype=np.float64
    )
    assert_within_bound(y, exact, 2 * bound, label="clamp below every denominator")


@pytest.mark.parametrize("fid", [f.id for f in KERNEL])
def test_no_allowed_key_gives_zero_output_and_finite_gradient(fid):
    f = attnref.get(fid)
    causal = f.causal_modes[0]
    p = make_kproblem(KBUCKETS[1], "elu_plus_one", causal, False, 0.0, 2, np.float64)
    key_mask = p.key_mask.copy()
    key_mask[0] = False  # batch element 0: every key padded

    def loss(q):
        return jnp.sum(f.native(q, p.k, p.v, feature_map=p.fm, causal=causal, key_mask=key_mask))

    y = np.asarray(f.native(p.q, p.k, p.v, feature_map=p.fm, causal=causal, key_mask=key_mask))
    np.testing.assert_array_equal(y[0], 0.0)
    g = np.asarray(jax.grad(loss)(p.q))
    assert np.all(np.isfinite(g)) and np.all(g[0] == 0.0)


def test_identity_map_near_zero_denominator_is_reproduced_not_hidden():
    """Signed features: D = phi(q).sum_j phi(k_j) can cancel. Exact cancellation gives 0 (no
    NaN); near cancellation the ratio grows like 1/D and float64 still determines it (finite
    bound), while float32's bound is infinite there (the ratio is not determined)."""
    fm = attnref.identity_features()
    q = np.array([[[1.0, 0.0]], [[1.0, 0.0]]])  # [T=2, H=1, d=2]
    for delta, expect_zero in ((0.0, True), (1e-9, False)):
        k = np.array([[[1.0, 0.5]], [[-1.0 + delta, 0.25]]])
        v = np.array([[[2.0]], [[1.0]]])
        y = np.asarray(attnref.linear_associative(q, k, v, feature_map=fm))
        assert np.all(np.isfinite(y))
        if expect_zero:
            np.testing.assert_array_equal(y, 0.0)
            g = jax.grad(
                lambda q, k=k, v=v: jnp.sum(attnref.linear_associative(q, k, v, feature_map=fm))
            )(q)
            assert np.all(np.isfinite(np.asarray(g)))
            continue
        ref = oracle.linear_attention(q, k, v, feature_map=fm)
        assert np.abs(ref).min() > 1e8  # ~ (2 + 1) / 1e-9
        b64 = tolerance.linear_error_bound(q, k, v, feature_map=fm, dtype=np.float64)
        assert np.all(np.isfinite(b64))
        assert_within_bound(y, ref, b64)
        b32 = tolerance.linear_error_bound(
            q.astype(np.float32),
            k.astype(np.float32),
            v.astype(np.float32),
            feature_map=fm,
            dtype=np.float32,
        )
        assert np.all(np.isinf(b32))


# ----------------------------------------------------------------------------- bad input


def test_bad_input_raises_clearly():
    p = make_kproblem(KBUCKETS[1], "elu_plus_one", False, False, 0.0, 0, np.float64)
    fm = p.fm
    with pytest.raises(ValueError, match=r"causal linear attention needs T_q == T_k"):
        attnref.linear_quadratic(p.q[..., :3, :, :], p.k, p.v, feature_map=fm, causal=True)
    with pytest.raises(ValueError, match="linear_associative is non-causal"):
        attnref.linear_associative(p.q, p.k, p.v, feature_map=fm, causal=True)
    with pytest.raises(ValueError, match="linear_prefix_sum is a causal form"):
        attnref.linear_prefix_sum(p.q, p.k, p.v, feature_map=fm, causal=False)
    with pytest.raises(ValueError, match=r"key_mask has shape \(6,\)"):
        attnref.linear_quadratic(p.q, p.k, p.v, feature_map=fm, key_mask=np.ones(6, bool))
    with pytest.raises(ValueError, match=r"v has shape \(2, 5, 2, 3\)"):
        attnref.linear_quadratic(p.q, p.k, p.v[:, :5], feature_map=fm)
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        attnref.linear_chunked(p.q, p.k, p.v, feature_map=fm, chunk_size=0)
    with pytest.raises(ValueError, match="eps_policy must be one of"):
        attnref.linear_quadratic(p.q, p.k, p.v, feature_map=fm, eps_policy="max")
    with pytest.raises(ValueError, match=r"favor_plus omega has shape \(8, 4\); inputs have d=3"):
        attnref.linear_quadratic(
            p.q[..., :3], p.k[..., :3], p.v, feature_map=attnref.favor_plus(0, 4, 8)
        )
    with pytest.raises(TypeError, match=r"causal must be a Python bool.*static_argnames"):
        jax.jit(attnref.linear_quadratic)(p.q, p.k, p.v, feature_map=fm, causal=True)
    with pytest.raises(ValueError, match="unknown feature map 'softmax'"):
        attnref.FeatureMap("softmax")
    with pytest.raises(ValueError, match="eps must be >= 0"):
        attnref.linear_associative(p.q, p.k, p.v, feature_map=fm, eps=-1e-3)
    state = attnref.linear_state_init((2,), 2, 4, 3, np.float64)
    t0 = (p.q[:, 0], p.k[:, 0], p.v[:, 0])
    with pytest.raises(ValueError, match=r"k_t has shape \(2, 4\)"):
        attnref.linear_step(state, t0[0], t0[1][:, 0], t0[2], feature_map=fm)
    with pytest.raises(ValueError, match="the feature map gives 21 features; the state has 4"):
        attnref.linear_step(state, *t0, feature_map=attnref.taylor2())
