"""Kernel level: ``attnref.dot_product_attention`` against its float64 NumPy twin, and the
properties every attention kernel must have (causality, no cross-talk, NaN isolation, fully
masked rows, extreme logits), plus the documented differences from ``jax.nn``.

Tolerances: :func:`attnref.tolerance.kernel_error_bound` (derivation in its docstring and in
docs/tolerances.md); no tolerance here is hand-picked.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import attnref
from attnref import oracle, tolerance
from attnref import strategies as ast

from .kernel_helpers import assert_kernel_close, kproblems

KBUCKETS = ast.KERNEL_BUCKETS
PROFILES = ast.STATIC_PROFILES
STATIC = ast.STATIC_OPTIONS
_DPA = jax.jit(attnref.dot_product_attention, static_argnames=STATIC)


class KernelOracleTest(chex.TestCase):
    @chex.variants(with_jit=True)
    @given(problem=kproblems())
    def test_matches_oracle(self, problem):
        """Every option combination equals the float64 twin; lse is the log-sum-exp of the
        allowed logits (``-inf`` for fully masked rows); the dtype is kept."""
        p = problem
        out, lse = self.variant(attnref.dot_product_attention, static_argnames=STATIC)(
            p.q, p.k, p.v, return_lse=True, **p.kwargs
        )
        assert out.dtype == p.dtype
        assert_kernel_close(out, lse, p, "dot_product_attention", key_blocks=1)

    @chex.variants(without_jit=True)
    @given(problem=kproblems(buckets=KBUCKETS[:1]))
    def test_matches_oracle_eagerly(self, problem):
        p = problem
        out, lse = self.variant(attnref.dot_product_attention)(
            p.q, p.k, p.v, return_lse=True, **p.kwargs
        )
        assert_kernel_close(out, lse, p, "dot_product_attention (eager)", key_blocks=1)


@given(problem=kproblems(dtypes=("bfloat16", "float16"), buckets=KBUCKETS[:2]))
def test_16bit_inputs(problem):
    """16-bit inputs: float32 logits, softmax and accumulation, output cast back (bound adds
    ``u_16 |o|``)."""
    p = problem
    out, lse = _DPA(p.q, p.k, p.v, return_lse=True, **p.kwargs)
    assert out.dtype == p.dtype and lse.dtype == np.float32
    assert_kernel_close(out, lse, p, f"dot_product_attention {p.dtype}", key_blocks=1)


def test_lse_is_logsumexp_of_masked_logits():
    """``lse`` from its definition, computed here with NumPy from the masked logits."""
    p = ast.make_kernel_problem(
        KBUCKETS[0], ("random", "bias"), 3, np.float64, static=PROFILES[4], empty_rows=True
    )
    _, lse = _DPA(p.q, p.k, p.v, return_lse=True, **p.kwargs)
    kg = np.repeat(p.k, p.config.group, axis=2)
    raw = np.einsum("btnh,bsnh->bnts", p.q, kg) / np.sqrt(p.config.h)
    logits = 3.0 * np.tanh(raw / 3.0) + p.kwargs["bias"]
    masked = np.where(p.allowed(), logits, -np.inf)
    with np.errstate(divide="ignore"):
        top = masked.max(-1, keepdims=True)
        ref = (
            np.log(np.sum(np.exp(masked - np.where(np.isfinite(top), top, 0)), -1))
            + np.where(np.isfinite(top), top, 0)[..., 0]
        )
    ref = np.where(np.isfinite(top[..., 0]), ref, -np.inf)
    _, bound = p.bound(key_blocks=1)
    got = np.swapaxes(np.asarray(lse), 1, 2)
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(ref))
    fin = np.isfinite(ref)
    assert np.all(np.abs(got[fin] - ref[fin]) <= np.swapaxes(bound, 1, 2)[fin])


# ----------------------------------------------------------------------------- properties


def _causal_fns():
    def dpa(q, k, v):
        return attnref.dot_product_attention(q, k, v, is_causal=True)

    def blockwise(q, k, v):
        return attnref.blockwise_dot_product_attention(
            q, k, v, is_causal=True, block_q=2, block_k=3
        )

    def decode(q, k, v):
        cache = attnref.decode.kv_cache_init(
            q.shape[0], q.shape[1], k.shape[2], k.shape[3], v.shape[3], dtype=q.dtype
        )
        return attnref.decode.cached_attention(cache, q, k, v)[0]

    return {"dot_product_attention": dpa, "blockwise": blockwise, "cached_decode": decode}


CAUSAL = _causal_fns()


@pytest.mark.parametrize("name", sorted(CAUSAL))
def test_causality_prefix_and_zero_gradient(name):
    """Appending future tokens leaves earlier outputs unchanged (within the two derived bounds),
    and the gradient of output ``t`` with respect to every input after ``t`` is exactly zero
    (the full call, the prefixes and the gradients compiled as one program)."""
    p = ast.make_kernel_problem(KBUCKETS[1], "causal", 11, np.float32)
    full, prefixes, all_grads = _causal_runs(p.q, p.k, p.v, name=name)
    full = np.asarray(full, np.float64)
    bound_full, _ = p.bound()
    for t in PREFIXES:
        sub = p.replace(q=p.q[:, :t], k=p.k[:, :t], v=p.v[:, :t])
        prefix = np.asarray(prefixes[t], np.float64)
        bound_sub, _ = sub.bound()
        assert np.all(np.abs(full[:, :t] - prefix) <= bound_full[:, :t] + bound_sub), name
        grads = all_grads[t]
        for g, label in zip(grads, "qkv", strict=True):
            g = np.asarray(g)
            assert np.all(g[:, t:] == 0.0), f"{name}: d out[{t - 1}] / d {label}[{t}:] != 0"
            # (with one allowed key the weight is 1 whatever q and k are: only v then matters)
            if label == "v" or t > 1:
                assert np.any(g[:, :t] != 0.0), f"{name}: gradient to the past vanished"


PREFIXES = (1, 3, 5)


@functools.partial(jax.jit, static_argnames=("name",))
def _causal_runs(q, k, v, *, name):
    """``CAUSAL[name]`` on the whole sequence and on each prefix of :data:`PREFIXES`, and the
    gradients of ``sum(sin(out[:, t - 1]))`` for each ``t``."""
    fn = jax.jit(CAUSAL[name])  # traced once per shape, its gradients reuse the trace
    prefixes = {t: fn(q[:, :t], k[:, :t], v[:, :t]) for t in PREFIXES}
    grads = {}
    for t in PREFIXES:

        def out_t(q, k, v, t=t):
            return jnp.sum(jnp.sin(fn(q, k, v)[:, t - 1]))

        grads[t] = jax.grad(out_t, argnums=(0, 1, 2))(q, k, v)
    return fn(q, k, v), prefixes, grads


def _padded_problem(dtype):
    """Keys beyond ``kv_len`` and queries beyond ``q_len`` are padding; one key column is masked
    for every query."""
    p = ast.make_kernel_problem(KBUCKETS[0], "causal", 5, dtype, causal_alignment="bottom_right")
    q_len, kv_len = np.array([3, 5], np.int32), np.array([6, 4], np.int32)
    mask = np.ones((2, 1, 5, 7), bool)
    mask[:, :, :, 1] = False
    kw = dict(p.kwargs, query_seq_lengths=q_len, key_value_seq_lengths=kv_len, mask=mask)
    return p, kw, q_len, kv_len


KERNELS = {
    "dot_product_attention": _DPA,
    "blockwise": jax.jit(
        attnref.blockwise_dot_product_attention, static_argnames=(*STATIC, "block_q", "block_k")
    ),
}


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_nan_in_padding_never_reaches_output_or_gradients(name):
    """NaN and inf stored in padded or fully masked key/value positions (and padded queries)
    leave the output and every gradient bitwise unchanged."""
    fn = KERNELS[name]
    extra = dict(block_q=2, block_k=3) if name == "blockwise" else {}
    p, kw, q_len, kv_len = _padded_problem(np.float32)
    poisoned = [a.copy() for a in (p.q, p.k, p.v)]
    for b in range(2):
        poisoned[0][b, q_len[b] :] = np.nan
        poisoned[1][b, kv_len[b] :] = np.nan
        poisoned[2][b, kv_len[b] :] = np.inf
    poisoned[1][:, 1] = np.nan  # masked for every query
    poisoned[2][:, 1] = -np.inf

    def loss(q, k, v):
        out, lse = fn(q, k, v, return_lse=True, **kw, **extra)
        return jnp.sum(jnp.sin(out)) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

    clean_out = fn(p.q, p.k, p.v, **kw, **extra)
    dirty_out = fn(*poisoned, **kw, **extra)
    assert not np.any(np.isnan(clean_out))
    np.testing.assert_array_equal(np.asarray(dirty_out), np.asarray(clean_out))
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))  # one program for both
    clean_g = grad(p.q, p.k, p.v)
    dirty_g = grad(*poisoned)
    for c, d in zip(clean_g, dirty_g, strict=True):
        assert np.all(np.isfinite(d))
        np.testing.assert_array_equal(np.asarray(d), np.asarray(c))


def check_broadcast_patterns(fn, patterns, **extra):
    """``fn`` (a kernel) on masks and biases of the given broadcast patterns
    (:data:`attnref.strategies.BROADCAST_SHAPES`), each mask pattern paired with a bias pattern
    (``7 i + 3 mod 16``: a permutation of all 16), against the oracle within the derived bound.
    The calls are traced into one compiled program (one per pattern would compile each)."""
    problems = {}
    for i, mask_pattern in enumerate(patterns):
        bias_pattern = ast.BROADCAST_SHAPES[(7 * i + 3) % 16]
        problems[f"mask {mask_pattern} bias {bias_pattern}"] = ast.make_kernel_problem(
            KBUCKETS[0],
            ("random", "bias"),
            40 + i,
            np.float32,
            mask_shape=mask_pattern,
            bias_shape=bias_pattern,
            empty_rows=True,
        )
    statics = {label: p.static for label, p in problems.items()}

    @jax.jit
    def run_all(arrays):
        return {
            label: fn(q, k, v, return_lse=True, **kw, **statics[label], **extra)
            for label, (q, k, v, kw) in arrays.items()
        }

    outputs = run_all(
        {
            label: (p.q, p.k, p.v, {k: a for k, a in p.kwargs.items() if k not in p.static})
            for label, p in problems.items()
        }
    )
    for label, p in problems.items():
        out, lse = outputs[label]
        assert_kernel_close(out, lse, p, label, key_blocks=3 if extra else None)


def test_every_broadcast_shape_of_mask_and_bias_in_the_tiled_form():
    """Each of the 12 ways a rank-4 mask broadcasts over a tiled axis (T or S of size 1; B and N
    full or 1), each paired with a bias pattern, gives the oracle's rows in the blockwise form,
    with blocks that pad both T and S: a size-1 axis must broadcast, never be padded as data
    (issue 11, defect 1). Every kernel form draws all 16 patterns in ``kproblems`` too; this
    test enumerates the ones that tiling can get wrong (12 kernels, one compiled program)."""
    tiled_axis_broadcast = [pt for pt in ast.BROADCAST_SHAPES if "1" in pt[2:]]
    check_broadcast_patterns(KERNELS["blockwise"], tiled_axis_broadcast, block_q=2, block_k=3)


def check_unread_nonfinite_values(fn):
    """The issue's example: T = S = 6, causal, NaN / inf / -inf in key or value row 5. Rows 0-4
    cannot read it: they equal the clean call bit for bit, and so does the gradient of their
    outputs. Row 5 reads it: attnref returns NaN there (documented), where the definition (the
    oracle) is non-finite too."""
    q, k, v = ast.kernel_inputs(KBUCKETS[1], 13)
    clean = np.asarray(fn(q, k, v, is_causal=True))

    def loss(q, k, v):
        return jnp.sum(jnp.sin(fn(q, k, v, is_causal=True)[:, :5]))

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))  # one program for the six calls
    clean_g = grad(q, k, v)
    for which, bad in ((2, np.nan), (2, np.inf), (2, -np.inf), (1, np.nan), (1, np.inf)):
        args = [q, k, v.copy()] if which == 2 else [q, k.copy(), v]
        args[which][:, 5] = bad
        out = np.asarray(fn(*args, is_causal=True))
        with np.errstate(invalid="ignore", over="ignore"):  # the oracle computes IEEE NaN/inf
            ref = oracle.dot_product_attention(*args, is_causal=True)
        np.testing.assert_array_equal(out[:, :5], clean[:, :5], err_msg=f"{which} {bad}")
        assert np.all(np.isnan(out[:, 5])) and not np.any(np.isfinite(ref[:, 5])), (which, bad)
        for c, d in zip(clean_g, grad(*args), strict=True):
            np.testing.assert_array_equal(np.asarray(d), np.asarray(c), err_msg=f"grad {bad}")


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_values_a_query_may_not_read_never_reach_it(name):
    check_unread_nonfinite_values(KERNELS[name])


@given(problem=kproblems(dtypes=("float32",), buckets=KBUCKETS[:1]))
def test_batch_equals_per_example(problem):
    """No cross-talk through padding or masks: each batch element alone gives its own rows."""
    p = problem
    out = np.asarray(_DPA(p.q, p.k, p.v, **p.kwargs), np.float64)
    bound, _ = p.bound()
    for b in range(p.config.batch):
        one = p.batch_slice(b)  # every per-example option sliced with the inputs
        one = np.asarray(_DPA(one.q, one.k, one.v, **one.kwargs), np.float64)
        ok = np.isnan(out[b]) == np.isnan(one[0])
        assert ok.all()
        diff = np.abs(np.nan_to_num(out[b] - one[0]))
        assert np.all(diff <= 2 * bound[b]), f"batch element {b} differs from its solo run"


@pytest.mark.parametrize("policy", ["zeros", "uniform", "nan"])
@pytest.mark.parametrize("name", sorted(KERNELS))
def test_fully_masked_rows_policy(name, policy):
    """A query with no allowed key returns 0, the mean of every ``v`` row, or NaN; its ``lse`` is
    ``-inf``; padded queries return 0 under every policy; the "zeros" gradient is finite."""
    fn = KERNELS[name]
    extra = dict(block_q=2, block_k=3) if name == "blockwise" else {}
    p = ast.make_kernel_problem(KBUCKETS[0], "none", 2, np.float64)
    mask = np.ones((2, 4, 5, 7), bool)
    mask[0, :, 2] = False  # query 2 of example 0: every head fully masked
    mask[1, 1, 0] = False  # query 0 of example 1: head 1 only
    q_len = np.array([5, 4], np.int32)
    out, lse = fn(
        p.q,
        p.k,
        p.v,
        mask=mask,
        query_seq_lengths=q_len,
        masked_rows=policy,
        return_lse=True,
        **extra,
    )
    out, lse = np.asarray(out), np.asarray(lse)
    dead = [(0, 2, n) for n in range(4)] + [(1, 0, 1)]
    for b, t, n in dead:
        assert lse[b, t, n] == -np.inf
        row = out[b, t, n]
        if policy == "zeros":
            np.testing.assert_array_equal(row, 0.0)
        elif policy == "nan":
            assert np.all(np.isnan(row))
        else:
            kv = n // 2
            # a float64 mean of S = 7 values on each side: gamma_8(u64) max|v|, twice
            atol = 2 * tolerance.gamma(8, 2.0**-53) * np.abs(p.v).max()
            np.testing.assert_allclose(row, p.v[b, :, kv].mean(0), rtol=0, atol=atol)
    np.testing.assert_array_equal(out[1, 4], 0.0)  # padded query
    assert np.all(lse[1, 4] == -np.inf)
    live = np.ones(out.shape[:3], bool)
    for b, t, n in dead:
        live[b, t, n] = False
    live[1, 4] = False
    assert np.all(np.isfinite(out[live]))
    if policy == "zeros":
        g = jax.jit(jax.grad(lambda q: jnp.sum(fn(q, p.k, p.v, mask=mask, **extra))))(p.q)
        assert np.all(np.isfinite(np.asarray(g)))


@pytest.mark.parametrize("softcap", [None, 30.0])
@pytest.mark.parametrize("name", sorted(KERNELS))
def test_extreme_logits(name, softcap):
    """|logit| up to 1e4 in float32: no inf or NaN in outputs or gradients, and the output still
    matches the oracle within the derived bound."""
    fn = KERNELS[name]
    extra = dict(block_q=2, block_k=3) if name == "blockwise" else {}
    p = ast.make_kernel_problem(KBUCKETS[1], ("causal", "random"), 9, np.float32, empty_rows=True)
    logits = np.einsum("btnh,bsnh->bnts", p.q.astype(np.float64), p.k.astype(np.float64)) / 2.0
    grow = np.sqrt(1e4 / np.abs(logits).max())  # scale q and k so that max |logit| = 1e4
    p.q, p.k = (p.q * grow).astype(np.float32), (p.k * grow).astype(np.float32)
    p.options = dict(p.options, softcap=softcap)
    kw = p.kwargs
    out, lse = fn(p.q, p.k, p.v, return_lse=True, **kw, **extra)
    assert np.all(np.isfinite(np.asarray(out)))
    assert_kernel_close(out, lse, p, f"{name} extreme logits softcap={softcap}")
    g = jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v, **kw, **extra)), argnums=(0, 1, 2))(
        p.q, p.k, p.v
    )
    for a in g:
        assert np.all(np.isfinite(np.asarray(a)))


# ----------------------------------------------------------------------------- jax.nn anchor


def test_agrees_with_jax_nn_where_semantics_agree():
    """jax.nn.dot_product_attention (implementation "xla") equals attnref on rows that are not
    fully masked: GQA, T != S with top-left causal alignment, a window, bias, seq lengths."""
    # jax.nn needs H_v == H: GQA (N=4, K=2), T=5 != S=7.
    config = ast.Config(batch=2, t=5, s=7, n=4, k=2, h=3, h_v=3, d_model=8)
    p = ast.make_kernel_problem(config, "bias", 4, np.float32)
    kw = dict(
        bias=p.options["bias"],
        is_causal=True,
        local_window_size=(3, 0),
        query_seq_lengths=np.array([5, 3], np.int32),
        key_value_seq_lengths=np.array([7, 6], np.int32),
    )
    ours = attnref.dot_product_attention(p.q, p.k, p.v, **kw)
    theirs = jax.nn.dot_product_attention(p.q, p.k, p.v, implementation="xla", **kw)
    p.options = kw
    # jax.nn computes in float32 like attnref: each is within the bound of the oracle.
    bound, _ = p.bound(key_blocks=1)
    ref = oracle.dot_product_attention(p.q, p.k, p.v, **kw)
    assert np.all(np.abs(np.asarray(theirs, np.float64) - ref) <= bound)
    assert np.all(np.abs(np.asarray(ours, np.float64) - ref) <= bound)


def test_documented_difference_from_jax_nn_on_fully_masked_rows():
    """The difference, stated: for a fully masked row jax.nn returns the mean of V (it masks with
    a large finite negative, so the softmax is uniform) and a finite lse; attnref returns zeros
    and ``-inf`` by default, and matches jax.nn's values with ``masked_rows="uniform"`` (the
    three calls compiled as one program)."""
    p = ast.make_kernel_problem(KBUCKETS[1], "none", 6, np.float32)
    mask = np.ones((1, 2, 6, 6), bool)
    mask[0, :, 3] = False
    (theirs, their_lse), (ours, our_lse), uni = _jax_nn_and_ours(p.q, p.k, p.v, mask)
    theirs, ours, uni = (np.asarray(a, np.float64) for a in (theirs, ours, uni))
    mean_v = p.v[0].astype(np.float64).mean(0)  # [K, H_v]
    # A mean of S = 6 float32 values (sum, then divide): gamma_{S+1}(u32) max|v|, on each side.
    atol = 2 * tolerance.gamma(6 + 1, tolerance.unit_roundoff(np.float32)) * np.abs(p.v).max()
    np.testing.assert_allclose(theirs[0, 3], mean_v, rtol=0, atol=atol)
    np.testing.assert_array_equal(ours[0, 3], 0.0)
    np.testing.assert_allclose(uni[0, 3], theirs[0, 3], rtol=0, atol=atol)
    assert np.all(np.isfinite(np.asarray(their_lse)[0, 3]))
    assert np.all(np.asarray(our_lse)[0, 3] == -np.inf)
    live = np.ones(6, bool)
    live[3] = False
    bound, _ = p.bound()
    assert np.all(np.abs(ours[0, live] - theirs[0, live]) <= 2 * bound[0, live])


@jax.jit
def _jax_nn_and_ours(q, k, v, mask):
    """jax.nn's output and lse, attnref's (default policy), attnref's under ``"uniform"``."""
    return (
        jax.nn.dot_product_attention(
            q, k, v, mask=mask, implementation="xla", return_residual=True
        ),
        attnref.dot_product_attention(q, k, v, mask=mask, return_lse=True),
        attnref.dot_product_attention(q, k, v, mask=mask, masked_rows="uniform"),
    )


# ----------------------------------------------------------------------------- ALiBi, errors


def test_alibi_slopes():
    """Press et al. (2022): 8 heads give 1/2, 1/4, ..., 1/256; other counts follow the paper's
    reference rule (the JAX helper and the NumPy oracle are written independently)."""
    np.testing.assert_array_equal(attnref.alibi_slopes(8), 2.0 ** -np.arange(1, 9))
    # Each side: the exponent's rounding (u) amplified by |x| ln 2 <= 8 ln 2 < 6 in 2^x, plus at
    # most 4 more roundings (log2, pow, product) -> <= 10 u per side, 20 u between them.
    rtol = tolerance.gamma(20, 2.0**-53)
    for n in range(1, 33):
        np.testing.assert_allclose(attnref.alibi_slopes(n), oracle.alibi_slopes(n), rtol=rtol)
    bias = np.asarray(attnref.alibi_bias(attnref.alibi_slopes(4), 5, 5, dtype=jnp.float64))
    i, j = np.tril_indices(5)
    np.testing.assert_allclose(
        bias[0][:, i, j], attnref.alibi_slopes(4)[:, None] * (j - i)[None], rtol=2.0**-52
    )


@pytest.mark.usefixtures("unchecked_annotations")  # checks attnref's own errors
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(local_window_size=(-1, 2)), "negative"),
        (dict(local_window_size=(1, 2, 3)), "local_window_size"),
        (dict(query_seq_lengths=np.array([6, 1])), "query_seq_lengths"),
        (dict(key_value_seq_lengths=np.array([-1, 1])), "key_value_seq_lengths"),
        (dict(key_value_seq_lengths=np.array([1.0, 1.0])), "integer"),
        (dict(query_seq_lengths=np.array([1, 1, 1])), "query_seq_lengths"),
        (dict(mask=np.ones((2, 5, 7), bool)), "rank 4"),
        (dict(mask=np.ones((2, 1, 5, 6), bool)), "does not broadcast"),
        (dict(mask=np.ones((2, 1, 5, 7), np.float32)), "boolean"),
        (dict(masked_rows="ignore"), "masked_rows"),
        (dict(causal_alignment="center"), "causal_alignment"),
        (dict(softcap=0.0), "softcap"),
        (dict(segment_ids=np.zeros((2, 5), np.int32)), "T == S"),
        (dict(segment_ids=(np.zeros((2, 5), np.int32), np.zeros((2, 6), np.int32))), "segment"),
    ],
)
def test_bad_options_raise_clear_errors(kwargs, message):
    q, k, v = ast.kernel_inputs(KBUCKETS[0], 0)
    with pytest.raises((ValueError, TypeError), match=message):
        attnref.dot_product_attention(q, k, v, **kwargs)


@pytest.mark.usefixtures("unchecked_annotations")  # checks attnref's own errors
def test_bad_shapes_raise_clear_errors():
    p = ast.make_kernel_problem(KBUCKETS[0], "none", 0, np.float32)
    with pytest.raises(ValueError, match="multiple of K"):
        attnref.dot_product_attention(p.q[:, :, :3], p.k, p.v)
    with pytest.raises(ValueError, match="head dim"):
        attnref.dot_product_attention(p.q[..., :2], p.k, p.v)
    with pytest.raises(ValueError, match="rank 4"):
        attnref.dot_product_attention(p.q[0], p.k, p.v)
    with pytest.raises(TypeError, match="one dtype"):
        attnref.dot_product_attention(p.q.astype(np.float64), p.k, p.v)
    with pytest.raises(ValueError, match="block_q"):
        attnref.blockwise_dot_product_attention(p.q, p.k, p.v, block_q=0)


@given(window=st.tuples(st.integers(0, 3), st.integers(0, 3)))
def test_window_semantics_match_jax_nn_doc_example(window):
    """jax.nn's documented window: with (left, right) a query at position c attends to keys
    c - left .. c + right. Checked on the allowed set directly (both implementations)."""
    allowed = oracle.kernel_allowed((1, 1, 10, 10), local_window_size=window)[0, 0]
    c = 6
    expect = np.zeros(10, bool)
    expect[max(0, c - window[0]) : c + window[1] + 1] = True
    np.testing.assert_array_equal(allowed[c], expect)


def check_out_of_range_lengths(fn):
    """Traced lengths cannot be checked at trace time: a batch element whose length exceeds T
    or S (or is negative) comes back all NaN under jit; eager calls raise."""
    p = ast.make_kernel_problem(KBUCKETS[1], "none", 12, np.float32)
    t, s = p.config.t, p.config.s
    good = np.array([t], np.int32)
    bad_pairs = ((np.array([t + 2]), good), (good, np.array([s + 1])), (good, np.array([-1])))
    for q_len, kv_len in bad_pairs:
        kw = dict(
            query_seq_lengths=q_len.astype(np.int32), key_value_seq_lengths=kv_len.astype(np.int32)
        )
        out, lse = fn(p.q, p.k, p.v, return_lse=True, **kw)
        assert np.all(np.isnan(np.asarray(out))) and np.all(np.isnan(np.asarray(lse))), kw
        with pytest.raises(ValueError, match="seq_lengths"):
            attnref.dot_product_attention(p.q, p.k, p.v, **kw)
    # In range: the lengths act, nothing is NaN.
    out = fn(p.q, p.k, p.v, query_seq_lengths=good, key_value_seq_lengths=good - 2)
    assert not np.any(np.isnan(np.asarray(out)))


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_out_of_range_lengths_under_jit_give_nan_never_a_plausible_number(name):
    check_out_of_range_lengths(KERNELS[name])


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_checked_mode_raises_for_traced_lengths_out_of_range(name):
    """``attnref.checked`` turns the NaN rows of out-of-range traced lengths into an error that
    names the argument; in-range lengths give the unchecked result unchanged."""
    fn = attnref.checked(KERNELS[name])
    p = ast.make_kernel_problem(KBUCKETS[1], "none", 12, np.float32)
    t = p.config.t
    with pytest.raises(ValueError, match="query_seq_lengths"):
        fn(p.q, p.k, p.v, query_seq_lengths=np.array([t + 1], np.int32))
    lens = np.array([t - 1], np.int32)
    np.testing.assert_array_equal(
        np.asarray(fn(p.q, p.k, p.v, query_seq_lengths=lens)),
        np.asarray(KERNELS[name](p.q, p.k, p.v, query_seq_lengths=lens)),
    )
