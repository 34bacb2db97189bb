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
from attnref import strategies as ast
from attnref.testing import assert_comparative, assert_within_bound

from .helpers import scaled

LINEAR = attnref.formulations("linear")
KERNEL = [f for f in LINEAR if f.native is not f.apply]  # forms with a (q, k, v) native level
MAPS = ("elu_plus_one", "relu", "identity", "taylor2", "favor_plus")
CHUNKS = (1, 2, 4, 7)
POLICIES = attnref.linear.EPS_POLICIES
# eps: none, small (1e-6 of denominators that are O(1) .. O(20) for these inputs), and large
# enough to matter (0.5, 4: output changes of several percent up to most of the output).
EPS = (0.0, 1e-6, 0.5, 4.0)


@dataclasses.dataclass(frozen=True)
class KBucket:
    batch: tuple[int, ...]
    t: int
    heads: int
    d_k: int
    d_v: int


KBUCKETS = (KBucket((), 5, 1, 3, 2), KBucket((2,), 6, 2, 4, 3))


def feature_map(name: str, d_k: int, seed: int = 0) -> attnref.linear.FeatureMap:
    if name == "favor_plus":
        return attnref.linear.favor_plus(seed, d_k, 2 * d_k)
    return attnref.linear.FeatureMap(name)


@dataclasses.dataclass
class KProblem:
    bucket: KBucket
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    key_mask: np.ndarray
    fm: attnref.linear.FeatureMap
    causal: bool
    eps: float
    dtype: np.dtype
    eps_policy: str = "add"


def make_kproblem(bucket, map_name, causal, padded, eps, seed, dtype, eps_policy="add"):
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
        eps_policy,
    )


@st.composite
def kproblems(draw, maps=MAPS, dtypes=("float32", "float64"), buckets=KBUCKETS):
    bucket = draw(st.sampled_from(buckets), label="bucket")
    name = draw(st.sampled_from(maps), label="feature map")
    causal = draw(st.booleans(), label="causal")
    padded = draw(st.booleans(), label="key padding")
    eps = draw(st.sampled_from(EPS), label="eps")
    policy = draw(st.sampled_from(POLICIES), label="eps_policy")
    dtype = draw(st.sampled_from(dtypes), label="dtype")
    seed = draw(st.integers(0, 2**31 - 1), label="seed")
    note(f"{bucket} {name} causal={causal} padded={padded} eps={eps} {policy} {dtype} seed={seed}")
    return make_kproblem(bucket, name, causal, padded, eps, seed, dtype, policy)


def _kw(p, **extra):
    return dict(
        feature_map=p.fm,
        causal=p.causal,
        key_mask=p.key_mask,
        eps=p.eps,
        eps_policy=p.eps_policy,
        **extra,
    )


def _static(f):
    return tuple(n for n in f.static_argnames if n != "residual")


def _kernel_forms(q, k, v, *, causal, chunk, **kw):
    """Every kernel-level form that takes ``causal``, on the same arguments (``chunk`` for the
    chunked form; ``None``: its default): ``{form id: y}``. Under jit one program for all."""
    out = {}
    for f in KERNEL:
        if causal in f.causal_modes:
            chunked = chunk is not None and "chunk_size" in f.static_argnames
            extra = {"chunk_size": chunk} if chunked else {}
            out[f.id] = f.native(q, k, v, causal=causal, **kw, **extra)
    return out


def _check_kernel_forms(p, chunk, variant):
    ref = oracle.linear_attention(p.q, p.k, p.v, **_kw(p))
    bound = tolerance.linear_error_bound(p.q, p.k, p.v, dtype=p.dtype, **_kw(p))
    for f in KERNEL:
        if p.causal not in f.causal_modes:
            with pytest.raises(ValueError, match="causal"):
                f.native(p.q, p.k, p.v, **_kw(p))
    forms = variant(_kernel_forms, static_argnames=("causal", "chunk", "eps_policy"))
    ys = forms(p.q, p.k, p.v, chunk=chunk, **_kw(p))
    for fid, y in ys.items():
        y = np.asarray(y)
        assert y.dtype == p.dtype, fid
        assert_within_bound(y, ref, bound, label=fid)
    assert len(ys) >= 2  # non-causal: quadratic, associative; causal: four forms


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
    bucket=st.sampled_from(ast.WEIGHT_BUCKETS[1:]),
    name=st.sampled_from(MAPS),
    causal=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
    dtype=st.sampled_from(("float32", "float64")),
    eps=st.sampled_from(EPS),
    policy=st.sampled_from(POLICIES),
)
def test_multihead_forms_match_oracle(bucket, name, causal, seed, dtype, eps, policy):
    """Registry ``apply`` (params and rows) against ``oracle.linear_multihead``, biases on, every
    eps policy with eps drawn (traced under jit: one compile serves every eps)."""
    p = ast.make_attention_problem(bucket, "none", seed, dtype)
    x_kv = p.x_q if causal else p.x_kv
    rng = np.random.default_rng(seed)
    key_mask = (
        np.arange(x_kv.shape[-2]) < rng.integers(1, x_kv.shape[-2] + 1, bucket.batch)[..., None]
    )
    kw = dict(
        feature_map=feature_map(name, bucket.d_k, seed),
        causal=causal,
        key_mask=key_mask,
        eps=eps,
        eps_policy=policy,
    )
    ref = oracle.linear_multihead(p.params, p.x_q, x_kv, **kw)
    bound = tolerance.linear_multihead_error_bound(p.params, p.x_q, x_kv, dtype=p.dtype, **kw)
    for f in LINEAR:
        if causal in f.causal_modes:
            y = f.jit()(p.params, p.x_q, x_kv, **kw)
            assert y.dtype == p.dtype
            assert_within_bound(y, ref, bound, label=f"{f.id} {name}")


def test_multihead_residual_form():
    """Every causal form with ``residual=True`` against the oracle (the forms compiled as one
    program)."""
    p = ast.make_attention_problem(ast.WEIGHT_BUCKETS[2], "none", 4, np.float64)
    kw = dict(feature_map=attnref.linear.elu_plus_one(), causal=True)
    ref = oracle.linear_multihead(p.params, p.x_q, residual=True, **kw)
    bound = tolerance.linear_multihead_error_bound(
        p.params, p.x_q, residual=True, dtype=np.float64, **kw
    )
    for fid, y in _residual_forms(p.params, p.x_q, kw["feature_map"]).items():
        assert_within_bound(y, ref, bound, label=fid)


@jax.jit
def _residual_forms(params, x_q, fm):
    """Every causal registry form's ``apply`` with ``residual=True``, one program."""
    return {
        f.id: f.apply(params, x_q, residual=True, feature_map=fm, causal=True)
        for f in LINEAR
        if True in f.causal_modes
    }


# ----------------------------------------------------------------------------- gradients


def _loss(native, q, k, v, key_mask, cot, eps, *, fm, causal, **static):
    return jnp.sum(
        native(q, k, v, feature_map=fm, causal=causal, key_mask=key_mask, eps=eps, **static) * cot
    )


@functools.cache
def _grad_fn(fid, causal, chunk, eps_policy):
    f = attnref.get(fid)
    static = {"chunk_size": chunk} if "chunk_size" in f.static_argnames else {}
    static["eps_policy"] = eps_policy

    def loss(q, k, v, key_mask, cot, fm, eps):  # eps traced: one compile for every eps
        return _loss(f.native, q, k, v, key_mask, cot, eps, fm=fm, causal=causal, **static)

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
        fn = _grad_fn(fid, p.causal, chunk, p.eps_policy)
        return [
            np.asarray(g, np.float64)
            for g in fn(
                p.q.astype(dtype),
                p.k.astype(dtype),
                p.v.astype(dtype),
                p.key_mask,
                cot.astype(dtype),
                p.fm,
                p.eps,
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
    are within their bounds of the same exact values (causality makes them equal). ``fn``
    returns one output or ``{label: output}`` (several forms)."""
    rng = np.random.default_rng(seed)

    def extend(a, more=None):
        if more is None:
            more = rng.standard_normal((*a.shape[:-3], extra_tokens, *a.shape[-2:])) * 3
        return np.concatenate([a, more.astype(a.dtype)], axis=-3)

    q2, k2, v2 = extend(p.q), extend(p.k, _future_keys(p, extra_tokens, rng)), extend(p.v)
    km2 = np.concatenate([p.key_mask, np.ones((*p.key_mask.shape[:-1], extra_tokens), bool)], -1)
    kw = dict(feature_map=p.fm, causal=True, eps=p.eps, eps_policy=p.eps_policy)
    short = fn(p.q, p.k, p.v, key_mask=p.key_mask, **kw)
    long = fn(q2, k2, v2, key_mask=km2, **kw)
    if not isinstance(short, dict):
        short, long = {"": short}, {"": long}
    bound = tolerance.linear_error_bound(p.q, p.k, p.v, key_mask=p.key_mask, dtype=p.dtype, **kw)
    for label, y in short.items():
        assert_within_bound(
            np.asarray(long[label])[..., : p.bucket.t, :, :],
            np.asarray(y),
            2 * bound,
            label=f"prefix outputs after appending tokens {label}",
        )


@scaled(0.3)
@given(
    bucket=st.sampled_from(KBUCKETS),
    name=st.sampled_from(MAPS),
    seed=st.integers(0, 2**31 - 1),
    extra=st.sampled_from((1, 3)),
    eps=st.sampled_from((1e-2, 4.0)),
    policy=st.sampled_from(POLICIES),
)
def test_appending_future_tokens_never_changes_the_past(bucket, name, seed, extra, eps, policy):
    """eps > 0 throughout: with eps = 0 a per-sequence shift would cancel and hide a leak.
    Every causal form (default chunk size), compiled as one program per shape."""
    p = make_kproblem(bucket, name, True, True, eps, seed, np.float64, policy)
    _prefix_check(_CAUSAL_FORMS, p, extra, seed)


_CAUSAL_FORMS = jax.jit(
    functools.partial(_kernel_forms, chunk=None), static_argnames=("causal", "eps_policy")
)


def test_causality_check_catches_a_sequence_wide_max():
    """The property above fails for FAVOR+ keys stabilised by a max over the sequence (with
    eps > 0 the shift no longer cancels, so future keys move past outputs)."""
    p = make_kproblem(KBUCKETS[1], "favor_plus", True, False, 1e-2, 3, np.float64)
    leaky = dataclasses.replace(p, fm=_LeakyMap(p.fm))
    leaky_quadratic = jax.jit(
        attnref.linear.linear_quadratic, static_argnames=("causal", "eps_policy", "feature_map")
    )  # the duck-typed map is no pytree: static
    with pytest.raises(AssertionError, match="prefix outputs"):
        _prefix_check(leaky_quadratic, leaky, 3, 3)


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
    """d y_t / d(q, k, v) is exactly 0 at every later position (the gradient compiled)."""
    p = make_kproblem(KBUCKETS[1], "favor_plus", True, False, 1e-3, 5, np.float64)
    f = attnref.get(fid)
    t = 2

    def out_t(q, k, v):
        y = f.native(q, k, v, feature_map=p.fm, causal=True, key_mask=p.key_mask, eps=p.eps)
        return jnp.sum(y[..., t, :, :])

    gq, gk, gv = jax.jit(jax.grad(out_t, argnums=(0, 1, 2)))(p.q, p.k, p.v)
    for g in (gq, gk, gv):
        np.testing.assert_array_equal(np.asarray(g)[..., t + 1 :, :, :], 0.0)
    assert np.abs(np.asarray(gk)[..., : t + 1, :, :]).max() > 0  # the past does matter


# ----------------------------------------------------------------------------- decoding


_STEP = jax.jit(attnref.linear.linear_step, static_argnames=("eps_policy",))  # eps traced


@scaled(0.3)
@given(
    bucket=st.sampled_from(KBUCKETS),
    name=st.sampled_from(MAPS),
    seed=st.integers(0, 2**31 - 1),
    eps=st.sampled_from(EPS),
    policy=st.sampled_from(POLICIES),
)
def test_recurrent_decoding_equals_causal_form_at_every_step(bucket, name, seed, eps, policy):
    """Constant-size state, one token per step (jitted step), against the causal oracle."""
    p = make_kproblem(bucket, name, True, True, eps, seed, np.float64, policy)
    ref = oracle.linear_attention(p.q, p.k, p.v, **_kw(p))
    bound = tolerance.linear_error_bound(p.q, p.k, p.v, dtype=np.float64, **_kw(p))
    m = p.fm.num_features(bucket.d_k)
    state = attnref.linear.linear_state_init(bucket.batch, bucket.heads, m, bucket.d_v, np.float64)
    for t in range(bucket.t):
        state, y_t = _STEP(
            state,
            p.q[..., t, :, :],
            p.k[..., t, :, :],
            p.v[..., t, :, :],
            feature_map=p.fm,
            key_valid=p.key_mask[..., t],
            eps=p.eps,
            eps_policy=p.eps_policy,
        )
        assert state.s.shape == (*bucket.batch, bucket.heads, m, bucket.d_v)  # constant memory
        assert_within_bound(y_t, ref[..., t, :, :], bound[..., t, :, :], label=f"step {t}")


# ----------------------------------------------------------------------------- denominator


def test_eps_policies_and_eps_to_zero():
    """add: y = num / (D + eps) -> num / D as eps -> 0, with |y_eps - y_0| = |y_0| eps / |D + eps|;
    clamp: y = num / max(D, eps) equals the exact ratio once D >= eps."""
    p = make_kproblem(KBUCKETS[1], "elu_plus_one", True, False, 0.0, 1, np.float64)
    exact = np.asarray(attnref.linear.linear_prefix_sum(p.q, p.k, p.v, feature_map=p.fm))
    fq = oracle.features(p.fm, p.q, "query")
    fk = oracle.features(p.fm, p.k, "key")
    den = np.einsum("...thm,...thm->...th", fq, np.cumsum(fk, axis=-3))
    prev = None
    for eps in (1e-1, 1e-3, 1e-5, 1e-7, 1e-9):
        y = np.asarray(attnref.linear.linear_prefix_sum(p.q, p.k, p.v, feature_map=p.fm, eps=eps))
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
    y = attnref.linear.linear_prefix_sum(
        p.q, p.k, p.v, feature_map=p.fm, eps=clamp_eps, eps_policy="clamp"
    )
    bound = tolerance.linear_error_bound(
        p.q, p.k, p.v, feature_map=p.fm, causal=True, dtype=np.float64
    )
    assert_within_bound(y, exact, 2 * bound, label="clamp below every denominator")


# ----------------------------------------------------------------------------- FAVOR+ and eps


def _favor_by_definition(q, k, v, *, feature_map, causal, key_mask, eps, eps_policy):
    """FAVOR+ attention written out from Choromanski et al. (2021), float64, *no* stabilisation:
    ``phi(x) = exp(-|x~|^2/2) / sqrt(m) [exp(w_i.x~)]_i`` with ``x~ = x / d^(1/4)``,
    ``A = phi(Q) phi(K)^T`` over the allowed keys, ``y = A V / (A 1 + eps)`` ("add") or
    ``A V / max(A 1, eps)`` ("clamp"), 0 where that is 0. Only for small inputs: the exps must
    neither overflow nor underflow. Returns ``y [..., T_q, H, d_v]`` and ``D = A 1 [..., T_q, H]``.
    """
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    w = np.asarray(feature_map.omega, np.float64)
    d, m = q.shape[-1], w.shape[0]

    def phi(x):
        xs = x / d**0.25
        return np.exp(-0.5 * np.sum(xs * xs, -1, keepdims=True)) / np.sqrt(m) * np.exp(xs @ w.T)

    a = np.einsum("...qhm,...khm->...hqk", phi(q), phi(k))
    allowed = np.ones(k.shape[:-3] + k.shape[-3:-2], bool) if key_mask is None else key_mask
    allowed = np.asarray(allowed, bool)[..., None, None, :]
    if causal:
        allowed = allowed & np.tril(np.ones(a.shape[-2:], bool))
    a = np.where(allowed, a, 0.0)
    num = np.einsum("...hqk,...khv->...qhv", a, v)
    den = np.swapaxes(a.sum(-1), -1, -2)
    adj = den + eps if eps_policy == "add" else np.maximum(den, eps)
    y = np.where((adj != 0)[..., None], num / np.where(adj == 0, 1.0, adj)[..., None], 0.0)
    return y, den


def _unscaled_eps(p, eps):
    """The rule before issue 11: eps added to the *stabilised* denominator ``exp(-c_q) D``."""
    fq, fk = oracle.features(p.fm, p.q, "query"), oracle.features(p.fm, p.k, "key")
    a = np.einsum("...qhm,...khm->...hqk", fq, fk)
    allowed = p.key_mask[..., None, None, :]
    if p.causal:
        allowed = allowed & np.tril(np.ones(a.shape[-2:], bool))
    a = np.where(allowed, a, 0.0)
    den = np.swapaxes(a.sum(-1), -1, -2)
    adj = den + eps if p.eps_policy == "add" else np.maximum(den, eps)
    num = np.einsum("...hqk,...khv->...qhv", a, p.v)
    return np.where((adj != 0)[..., None], num / np.where(adj == 0, 1.0, adj)[..., None], 0.0)


@scaled(0.3)
@given(p=kproblems(maps=("favor_plus",)), chunk=st.sampled_from(CHUNKS))
def test_favor_plus_eps_means_its_written_definition(p, chunk):
    """Issue 11 (defect 6): FAVOR+ with ``eps = r median(D)``, ``r = 1e-3, 0.1, 1`` relative to
    the denominators ``D`` of the definition, under the drawn policy, against FAVOR+ written out
    without any stabilising shift (:func:`_favor_by_definition`, float64).

    Tolerance: the definition, the oracle and the forms all sum the same products ``A_ij v_j``;
    ``linear_error_bound(dtype)`` is the form's share in ``dtype`` plus a float64 share, and the
    float64 share covers a float64 evaluation of the definition (its exponents
    ``w.x~ - |x~|^2/2`` are smaller than the stabilised ones the bound assumes). So
    ``|form - definition| <= linear_error_bound(dtype)``, ``|oracle - definition| <=
    linear_error_bound(float64)``. The stabilised features give ``exp(-c_q) D``; eps added to that
    unscaled (the old rule) must fail the same check, so the check can fail."""
    _, den = _favor_by_definition(p.q, p.k, p.v, **dict(_kw(p), eps=0.0, eps_policy="add"))
    scale = float(np.median(den[den > 0])) if np.any(den > 0) else 1.0
    note(f"median D = {scale:.3g}")
    for r in (1e-3, 0.1, 1.0):
        kw = dict(_kw(p), eps=r * scale)
        exact, _ = _favor_by_definition(p.q, p.k, p.v, **kw)
        b64 = tolerance.linear_error_bound(p.q, p.k, p.v, dtype=np.float64, **kw)
        ref = oracle.linear_attention(p.q, p.k, p.v, **kw)
        assert_within_bound(ref, exact, b64, label=f"oracle, eps = {r} median D")
        bound = tolerance.linear_error_bound(p.q, p.k, p.v, dtype=p.dtype, **kw)
        for f in KERNEL:
            if p.causal in f.causal_modes:
                extra = {"chunk_size": chunk} if "chunk_size" in f.static_argnames else {}
                y = _jitted(f.id)(p.q, p.k, p.v, **kw, **extra)
                assert_within_bound(y, exact, bound, label=f"{f.id}, eps = {r} median D")
        if r == 1.0 and np.any(den > 0):
            with pytest.raises(AssertionError, match="derived-bound rule failed"):
                assert_within_bound(_unscaled_eps(p, r * scale), exact, b64, label="old rule")


# Choromanski et al. (2021) by hand: d = 1, m = 2, w = (1, -1), so x~ = x and
#   phi(x) = exp(-x^2/2) / sqrt(2) [e^x, e^-x],   phi(q).phi(k) = exp(-(q^2 + k^2)/2) cosh(q + k).
_W2 = np.array([[1.0], [-1.0]])


def _a_by_hand(q, k):
    return np.exp(-(q * q + k * k) / 2) * np.cosh(q + k)


def test_favor_plus_worked_example():
    """q = k = (0, 1), v = (1, 3), eps = 1; the oracle, and every form and the decoding step in
    float32 (the inputs are exact there; the same compiled programs as the next test):
    A00 = 1, A01 = A10 = e^(-1/2) cosh 1 = 0.935926, A11 = e^(-1) cosh 2 = 1.384034;
      add, non-causal:   y = ((1 + 3 A01) / (1 + A01 + 1), (A01 + 3 A11) / (A01 + A11 + 1))
                           = (1.296960, 1.532557);  causal: y_0 = 1 / (1 + 1) = 0.5
      clamp, non-causal: y = ((1 + 3 A01) / max(1 + A01, 1), (A01 + 3 A11) / max(A01 + A11, 1))
                           = (1.966903, 2.193154);  causal: y_0 = 1 / max(1, 1) = 1
    The stabilised query features carry exp(-c), c = max_i(w_i x + 1/2) - x^2/2 = (0.5, 1.0):
    an eps added unscaled gives the causal y_0 = e^-0.5 / (e^-0.5 + 1) = 0.377541, not 0.5."""
    fm = attnref.linear.FeatureMap("favor_plus", _W2)
    x = np.array([0.0, 1.0])
    a01, a11 = _a_by_hand(0.0, 1.0), _a_by_hand(1.0, 1.0)
    np.testing.assert_allclose([a01, a11], [0.935926, 1.384034], atol=5e-7)
    np.testing.assert_allclose(np.asarray(fm.kernel(x[:, None], x[:, None])), [1.0, a11])
    np.testing.assert_allclose(np.asarray(fm.query_features(x[:, None])[1]), [0.5, 1.0])
    y1_add, y1_clamp = (a01 + 3 * a11) / (a01 + a11 + 1), (a01 + 3 * a11) / max(a01 + a11, 1.0)
    expected = {
        ("add", False): [(1 + 3 * a01) / (1 + a01 + 1), y1_add],
        ("add", True): [0.5, y1_add],
        ("clamp", False): [(1 + 3 * a01) / max(1 + a01, 1.0), y1_clamp],
        ("clamp", True): [1.0, y1_clamp],
    }
    np.testing.assert_allclose(
        [expected["add", False], expected["clamp", False]],
        [[1.296960, 1.532557], [1.966903, 2.193154]],
        atol=5e-7,
    )
    q = k = x.reshape(2, 1, 1).astype(np.float32)
    v = np.array([1.0, 3.0], np.float32).reshape(2, 1, 1)
    for (policy, causal), want in expected.items():
        kw = dict(feature_map=fm, causal=causal, eps=1.0, eps_policy=policy)
        want = np.asarray(want).reshape(2, 1, 1)
        # The hand values are float64 evaluations of the same products (see the test above): the
        # float64 share of each bound covers them, the float32 share the forms.
        b64 = tolerance.linear_error_bound(q, k, v, dtype=np.float64, **kw)
        assert_within_bound(oracle.linear_attention(q, k, v, **kw), want, b64, label="oracle")
        bound = tolerance.linear_error_bound(q, k, v, dtype=np.float32, **kw)
        for f in KERNEL:
            if causal in f.causal_modes:
                y = _jitted(f.id)(q, k, v, **kw)
                assert_within_bound(y, want, bound, label=f"{f.id} {policy} causal={causal}")
        if causal:
            state = attnref.linear.linear_state_init((), 1, 2, 1, np.float32)
            for t in range(2):
                state, y_t = _STEP(
                    state, q[t], k[t], v[t], feature_map=fm, eps=1.0, eps_policy=policy
                )
                assert_within_bound(y_t, want[t], bound[t], label=f"linear_step {t} {policy}")
    assert abs(np.exp(-0.5) / (np.exp(-0.5) + 1) - 0.377541) < 5e-7  # the unscaled-eps value


def test_favor_plus_eps_where_the_shift_overflows():
    """float32, the worked example's map, a query at x = 14.6: c = |x| + 1/2 - x^2/2 = -91.48, so
    the factor exp(-c) ~ 5e39 overflows float32 and the defined D ~ 1e-40 underflows it. The
    forms rescale num, den and eps by exp(c + L) (L = log(max float) / 2): outputs within the
    bound of the float64 oracle (``y ~ 3e-34``, a normal float32), gradients finite (checked on
    two paths through ``normalize``: the quadratic form and the scanned decoding step)."""
    fm = attnref.linear.FeatureMap("favor_plus", _W2)
    q = np.array([0.0, 14.6], np.float32).reshape(2, 1, 1)
    k = np.array([0.0, 1.0], np.float32).reshape(2, 1, 1)
    v = np.array([1.0, 3.0], np.float32).reshape(2, 1, 1)
    assert float(np.asarray(fm.query_features(q)[1])[1, 0]) < -np.log(np.finfo(np.float32).max)
    for policy in POLICIES:
        for f in KERNEL:
            causal = f.causal_modes[0]
            kw = dict(feature_map=fm, causal=causal, eps=1e-6, eps_policy=policy)
            ref = oracle.linear_attention(q, k, v, **kw)
            assert 1e-36 < ref[1, 0, 0] < 1e-31
            bound = tolerance.linear_error_bound(q, k, v, dtype=np.float32, **kw)
            fn = _jitted(f.id)
            assert_within_bound(fn(q, k, v, **kw), ref, bound, label=f"{f.id} {policy}")
            if policy == "add" and f.id in ("linear_quadratic", "linear_recurrent"):
                g = jax.grad(lambda q, fn=fn, kw=kw: jnp.sum(fn(q, k, v, **kw)))(q)
                assert np.all(np.isfinite(np.asarray(g))), f.id


_FACTORIES = (
    attnref.linear.elu_plus_one,
    attnref.linear.relu_features,
    attnref.linear.identity_features,
    attnref.linear.taylor2,
    attnref.linear.favor_plus,
)


@pytest.mark.usefixtures("unchecked_annotations")  # checks attnref's own errors
@pytest.mark.parametrize("factory", _FACTORIES, ids=lambda f: f.__name__)
def test_uncalled_factory_raises_a_clear_type_error(factory):
    """Issue 11 (defect 9): ``feature_map=attnref.linear.elu_plus_one`` (uncalled) is a TypeError
    that says to call it, in every form, the step, the registry entries and the oracle."""
    p = make_kproblem(KBUCKETS[1], "elu_plus_one", True, False, 0.0, 0, np.float64)
    mp = ast.make_attention_problem(ast.WEIGHT_BUCKETS[0], "none", 0, np.float64)
    match = rf"factory function {factory.__name__} itself: call it"
    for f in KERNEL:
        with pytest.raises(TypeError, match=match):
            f.native(p.q, p.k, p.v, feature_map=factory, causal=f.causal_modes[0])
    for f in LINEAR:
        with pytest.raises(TypeError, match=match):
            f.apply(mp.params, mp.x_q, feature_map=factory, causal=f.causal_modes[0])
    state = attnref.linear.linear_state_init((2,), 2, 4, 3, np.float64)
    with pytest.raises(TypeError, match=match):
        attnref.linear.linear_step(state, p.q[:, 0], p.k[:, 0], p.v[:, 0], feature_map=factory)
    with pytest.raises(TypeError, match=match):
        oracle.linear_attention(p.q, p.k, p.v, feature_map=factory)
    with pytest.raises(TypeError, match=match):
        oracle.linear_multihead(mp.params, mp.x_q, feature_map=factory)


@pytest.mark.parametrize("fid", [f.id for f in KERNEL])
def test_no_allowed_key_gives_zero_output_and_finite_gradient(fid):
    f = attnref.get(fid)
    causal = f.causal_modes[0]
    p = make_kproblem(KBUCKETS[1], "elu_plus_one", causal, False, 0.0, 2, np.float64)
    key_mask = p.key_mask.copy()
    key_mask[0] = False  # batch element 0: every key padded

    def loss(q):
        return jnp.sum(f.native(q, p.k, p.v, feature_map=p.fm, causal=causal, key_mask=key_mask))

    def out_and_grad(q):  # one compiled program
        return f.native(q, p.k, p.v, feature_map=p.fm, causal=causal, key_mask=key_mask), jax.grad(
            loss
        )(q)

    y, g = (np.asarray(a) for a in jax.jit(out_and_grad)(p.q))
    np.testing.assert_array_equal(y[0], 0.0)
    assert np.all(np.isfinite(g)) and np.all(g[0] == 0.0)


def test_identity_map_near_zero_denominator_is_reproduced_not_hidden():
    """Signed features: D = phi(q).sum_j phi(k_j) can cancel. Exact cancellation gives 0 (no
    NaN); near cancellation the ratio grows like 1/D and float64 still determines it (finite
    bound), while float32's bound is infinite there (the ratio is not determined). The form and
    its gradient run compiled, one program for both ``k``."""
    fm = attnref.linear.identity_features()
    q = np.array([[[1.0, 0.0]], [[1.0, 0.0]]])  # [T=2, H=1, d=2]
    for delta, expect_zero in ((0.0, True), (1e-9, False)):
        k = np.array([[[1.0, 0.5]], [[-1.0 + delta, 0.25]]])
        v = np.array([[[2.0]], [[1.0]]])
        y, g = (np.asarray(a) for a in _associative_and_grad(q, k, v, fm))
        assert np.all(np.isfinite(y))
        if expect_zero:
            np.testing.assert_array_equal(y, 0.0)
            assert np.all(np.isfinite(g))
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


@jax.jit
def _associative_and_grad(q, k, v, fm):
    """``linear_associative``'s output and d(sum of it)/dq."""

    def total(q):
        return jnp.sum(attnref.linear.linear_associative(q, k, v, feature_map=fm))

    return attnref.linear.linear_associative(q, k, v, feature_map=fm), jax.grad(total)(q)


# ----------------------------------------------------------------------------- bad input


@pytest.mark.usefixtures("unchecked_annotations")  # checks attnref's own errors
def test_bad_input_raises_clearly():
    p = make_kproblem(KBUCKETS[1], "elu_plus_one", False, False, 0.0, 0, np.float64)
    fm = p.fm
    with pytest.raises(ValueError, match=r"causal linear attention needs T_q == T_k"):
        attnref.linear.linear_quadratic(p.q[..., :3, :, :], p.k, p.v, feature_map=fm, causal=True)
    with pytest.raises(ValueError, match="linear_associative is non-causal"):
        attnref.linear.linear_associative(p.q, p.k, p.v, feature_map=fm, causal=True)
    with pytest.raises(ValueError, match="linear_prefix_sum is a causal form"):
        attnref.linear.linear_prefix_sum(p.q, p.k, p.v, feature_map=fm, causal=False)
    with pytest.raises(ValueError, match=r"key_mask has shape \(6,\)"):
        attnref.linear.linear_quadratic(p.q, p.k, p.v, feature_map=fm, key_mask=np.ones(6, bool))
    with pytest.raises(ValueError, match=r"v has shape \(2, 5, 2, 3\)"):
        attnref.linear.linear_quadratic(p.q, p.k, p.v[:, :5], feature_map=fm)
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        attnref.linear.linear_chunked(p.q, p.k, p.v, feature_map=fm, chunk_size=0)
    with pytest.raises(ValueError, match="eps_policy must be one of"):
        attnref.linear.linear_quadratic(p.q, p.k, p.v, feature_map=fm, eps_policy="max")
    with pytest.raises(ValueError, match=r"favor_plus omega has shape \(8, 4\); inputs have d=3"):
        attnref.linear.linear_quadratic(
            p.q[..., :3], p.k[..., :3], p.v, feature_map=attnref.linear.favor_plus(0, 4, 8)
        )
    with pytest.raises(TypeError, match=r"causal must be a Python bool.*static_argnames"):
        jax.jit(attnref.linear.linear_quadratic)(p.q, p.k, p.v, feature_map=fm, causal=True)
    with pytest.raises(ValueError, match="unknown feature map 'softmax'"):
        attnref.linear.FeatureMap("softmax")
    with pytest.raises(TypeError, match="feature_map must be a FeatureMap"):
        attnref.linear.linear_quadratic(p.q, p.k, p.v, feature_map="elu_plus_one")
    with pytest.raises(ValueError, match="role must be 'query' or 'key'"):
        fm(p.q, "value")
    with pytest.raises(ValueError, match="eps must be >= 0"):
        attnref.linear.linear_associative(p.q, p.k, p.v, feature_map=fm, eps=-1e-3)
    state = attnref.linear.linear_state_init((2,), 2, 4, 3, np.float64)
    t0 = (p.q[:, 0], p.k[:, 0], p.v[:, 0])
    with pytest.raises(ValueError, match=r"k_t has shape \(2, 4\)"):
        attnref.linear.linear_step(state, t0[0], t0[1][:, 0], t0[2], feature_map=fm)
    with pytest.raises(ValueError, match="the feature map gives 21 features; the state has 4"):
        attnref.linear.linear_step(state, *t0, feature_map=attnref.linear.taylor2())
