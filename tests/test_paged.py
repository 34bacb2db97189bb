"""Paged KV cache attention (``attnref.decode.paged_attention``) and its float64 twin
(``attnref.oracle.paged_attention``).

Properties: equal to the contiguous kernel oracle on the keys gathered through the page table,
for any page permutation and any contents of the unused slots and pages (NaN included, which
never reach the output or the gradients); appending through the page table and then attending
equals attending on the concatenation; out-of-range table entries and lengths are refused
eagerly, NaN under ``jax.jit`` and raised under ``attnref.checked``; the cost model's dot FLOPs
equal XLA's and its KV bytes equal the slots the definition reads.

Tolerances (derived, nothing hand-picked): the paged form *is* the kernel on the gathered keys
(a gather moves values without rounding them), so the kernel's bounds apply unchanged:
:func:`attnref.tolerance.kernel_call_error_bound` (``key_blocks=1``: one softmax over all ``S``
slots) for the forward, :func:`attnref.tolerance.kernel_grad_error_bound` for the gradients.
The gradient of a page slot is the gathered slot's gradient moved back by the gather's
transpose; every test table lists each page at most once (a permutation), so no two slots are
summed and the bound moves with the value, unchanged.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import attnref
from attnref import oracle, tolerance
from attnref.conformance import PAGED_PROPERTIES, check_paged
from attnref.costs import xla_counts
from attnref.decode import paged_attention
from attnref.testing import assert_ratio_within

STATIC = ("scale", "is_causal", "local_window_size", "softcap", "masked_rows", "return_lse")
_PAGED = jax.jit(paged_attention, static_argnames=STATIC)

# (B, T, N, K, H, H_v, page_size, max_pages): decoding (T = 1) and chunked prefill (T > 1);
# page sizes 2, 3, 4 with lengths drawn so that most do not fill their last page.
BUCKETS = (
    (2, 1, 4, 2, 4, 3, 3, 3),
    (2, 3, 2, 1, 4, 4, 2, 4),
    (1, 2, 4, 4, 3, 5, 4, 2),
)
PROFILES = (
    {},
    {"is_causal": True},
    {"is_causal": True, "local_window_size": (2, 0)},
    {"is_causal": True, "softcap": 2.0, "masked_rows": "nan"},
)


@dataclasses.dataclass(frozen=True)
class Paged:
    """One paged problem and its contiguous twin (the test's own gather, NumPy)."""

    q: np.ndarray
    k_pages: np.ndarray
    v_pages: np.ndarray
    table: np.ndarray
    lens: np.ndarray
    options: dict[str, Any]

    @property
    def page_size(self) -> int:
        return self.k_pages.shape[1]

    def used(self) -> np.ndarray:
        """``[B, S]``: slot ``j`` of row ``b`` is read (``j < seq_lens[b]``)."""
        s = self.table.shape[1] * self.page_size
        return np.arange(s)[None, :] < self.lens[:, None]

    def gathered(self, pages: np.ndarray) -> np.ndarray:
        """``pages[table[b, j // page], j % page]`` on used slots, 0 elsewhere, float64."""
        b, m = self.table.shape
        idx = np.clip(self.table, 0, pages.shape[0] - 1)
        g = pages.astype(np.float64)[idx].reshape(b, m * self.page_size, *pages.shape[2:])
        return np.where(self.used()[..., None, None], g, 0.0)

    def call(self) -> dict[str, Any]:
        """The contiguous kernel call (the oracle's and the bounds' arguments)."""
        call = {
            "query": self.q.astype(np.float64),
            "key": self.gathered(self.k_pages),
            "value": self.gathered(self.v_pages),
            "key_value_seq_lengths": self.lens,
            "causal_alignment": "bottom_right",
        }
        return {**call, **self.options}

    def scatter(self, grads: np.ndarray, pages_like: np.ndarray) -> np.ndarray:
        """The gather's transpose: slot ``j`` of row ``b`` back to its page (used slots)."""
        out = np.zeros(pages_like.shape)
        b_idx, j_idx = np.nonzero(self.used())
        page = self.table[b_idx, j_idx // self.page_size]
        np.add.at(out, (page, j_idx % self.page_size), grads[b_idx, j_idx])
        return out


def make_paged(bucket, seed: int, dtype, options, *, nan_fill: bool = True) -> Paged:
    """A random problem: pages permuted (each listed once), two pages no table lists, lengths
    in ``[0, S]`` (a zero length one time in four), unused slots and pages NaN (or 1e30), unused
    table entries ``-1`` or past the pool."""
    b, t, n, kh, h, hv, ps, mp = bucket
    rng = np.random.default_rng(seed)
    num_pages = b * mp + 2
    q = rng.normal(size=(b, t, n, h)).astype(dtype)
    k_pages = rng.normal(size=(num_pages, ps, kh, h)).astype(dtype)
    v_pages = rng.normal(size=(num_pages, ps, kh, hv)).astype(dtype)
    table = rng.permutation(num_pages)[: b * mp].reshape(b, mp).astype(np.int32)
    lens = rng.integers(0 if seed % 4 == 0 else 1, mp * ps + 1, size=b).astype(np.int32)
    p = Paged(q, k_pages, v_pages, table, lens, dict(options))
    fill = np.nan if nan_fill else 1e30
    read = np.zeros(k_pages.shape[:2], bool)  # [num_pages, page_size]: slots the definition reads
    b_idx, j_idx = np.nonzero(p.used())
    read[table[b_idx, j_idx // ps], j_idx % ps] = True
    k_pages[~read], v_pages[~read] = fill, fill
    used_pages = np.arange(mp)[None, :] * ps < lens[:, None]
    table[~used_pages] = rng.choice(np.array([-1, num_pages + 5]), size=int((~used_pages).sum()))
    return p


def assert_close(out: Any, lse: Any, p: Paged, label: str) -> None:
    """``out``/``lse`` within the kernel bound of the contiguous oracle on the gathered keys;
    NaN and ``-inf`` exactly where the oracle has them."""
    call = p.call()
    ref, ref_lse = oracle.dot_product_attention(**call, return_lse=True)
    bound, lse_bound = tolerance.kernel_call_error_bound(**call, dtype=p.q.dtype, key_blocks=1)
    out, lse = np.asarray(out, np.float64), np.asarray(lse, np.float64)
    nan_ref = np.isnan(ref)
    np.testing.assert_array_equal(np.isnan(out), nan_ref, err_msg=f"{label}: NaN pattern")
    err = np.abs(np.where(nan_ref, 0.0, out - np.where(nan_ref, 0.0, ref)))
    assert_ratio_within(err, bound, f"{label}: |out - oracle| = {{error:.3e}} > {{allowed:.3e}}")
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse), err_msg=label)
    fin = np.isfinite(ref_lse)
    lerr = np.abs(np.where(fin, lse - np.where(fin, ref_lse, 0.0), 0.0))
    assert_ratio_within(lerr, np.where(fin, lse_bound, 0.0), f"{label}: lse {{error:.3e}}")


def run(fn, p: Paged, **extra: Any) -> Any:
    return fn(p.q, p.k_pages, p.v_pages, p.table, p.lens, **p.options, **extra)


# ----------------------------------------------------------------------------- forward


class PagedOracleTest(chex.TestCase):
    @chex.variants(with_jit=True)
    @given(
        bucket=st.sampled_from(BUCKETS),
        profile=st.sampled_from(PROFILES),
        dtype=st.sampled_from((np.float32, np.float64)),
        seed=st.integers(0, 2**16),
        nan_fill=st.booleans(),
    )
    def test_equals_contiguous_oracle_on_gathered_keys(
        self, bucket, profile, dtype, seed, nan_fill
    ):
        """Any page permutation, any unused contents (NaN or 1e30), any unused table entries,
        decoding and chunked prefill, causal (bottom-right), windows, softcap, GQA."""
        p = make_paged(bucket, seed, dtype, profile, nan_fill=nan_fill)
        fn = self.variant(paged_attention, static_argnames=STATIC)
        out, lse = run(fn, p, return_lse=True)
        assert out.dtype == dtype
        assert_close(out, lse, p, f"paged {bucket} {profile} {np.dtype(dtype)}")

    @chex.variants(without_jit=True)
    def test_equals_contiguous_oracle_eagerly(self):
        """Without jit (every primitive dispatched on its own): causal chunked prefill with a
        window, NaN in the unused slots."""
        p = make_paged(BUCKETS[1], 4, np.float64, PROFILES[2])
        out, lse = run(self.variant(paged_attention), p, return_lse=True)
        assert_close(out, lse, p, "paged prefill, causal window (eager)")


@pytest.mark.skipif(
    "sinks" not in inspect.signature(attnref.dot_product_attention).parameters,
    reason="the kernel has no sinks option (yet)",
)
def test_kernel_options_are_forwarded_sinks_included():
    """The paged signature is the kernel's: an option the kernel gained (learnable sinks,
    one logit per query head) reaches it unchanged and equals the oracle on the gathered keys."""
    opts = {"is_causal": True, "sinks": np.array([0.5, -1.0])}
    p = make_paged(BUCKETS[1], 13, np.float64, opts)
    assert "sinks" in inspect.signature(paged_attention).parameters
    out, lse = run(_PAGED, p, return_lse=True)
    assert_close(out, lse, p, "paged with sinks")


@given(bucket=st.sampled_from(BUCKETS), seed=st.integers(0, 2**16))
def test_oracle_twin_is_the_kernel_oracle_on_the_definition_gather(bucket, seed):
    """``oracle.paged_attention`` reads slot ``j`` from page ``table[b, j // page]`` and nothing
    else: bit-equal to the kernel oracle on the test's own gather (the same float64 call)."""
    p = make_paged(bucket, seed, np.float64, {"is_causal": True})
    got, got_lse = run(oracle.paged_attention, p, return_lse=True)
    ref, ref_lse = oracle.dot_product_attention(**p.call(), return_lse=True)
    np.testing.assert_array_equal(got, ref)
    np.testing.assert_array_equal(got_lse, ref_lse)


def test_decoding_is_single_query_attention_over_the_prefix():
    """A published-reference check written by hand (vLLM's ``ref_single_query_cached_kv_attention``
    shape of the computation): one query per sequence reads keys ``0 .. seq_lens - 1`` through the
    table, softmax with scale ``1/sqrt(H)``, in NumPy float64 here."""
    p = make_paged(BUCKETS[0], 7, np.float64, {})
    out = np.asarray(_PAGED(p.q, p.k_pages, p.v_pages, p.table, p.lens))
    b, _, n, kh, h, _, ps, _ = BUCKETS[0]
    # both float64 computations lie within the kernel bound's float64 term of the exact value
    bound, _ = tolerance.kernel_call_error_bound(**p.call(), key_blocks=1)
    for row in range(b):
        keys = [p.k_pages[p.table[row, j // ps], j % ps] for j in range(p.lens[row])]
        vals = [p.v_pages[p.table[row, j // ps], j % ps] for j in range(p.lens[row])]
        for head in range(n):
            kk = np.array([k[head // (n // kh)] for k in keys])
            vv = np.array([v[head // (n // kh)] for v in vals])
            s = kk @ p.q[row, 0, head] / np.sqrt(h)
            w = np.exp(s - s.max())
            ref = (w / w.sum()) @ vv
            assert np.all(np.abs(out[row, 0, head] - ref) <= 2 * bound[row, 0, head])


# ----------------------------------------------------------------------------- append


def _append_case():
    """Two rows with a cached prefix (lengths 4 and 8, page size 3) and a chunk of 3 new tokens
    each (row 0 crosses into a fresh page 9); every unwritten slot NaN."""
    rng = np.random.default_rng(3)
    b, t, n, kh, h, hv, ps = 2, 3, 4, 2, 4, 3, 3
    lens0 = np.array([4, 8], np.int32)
    table = np.array([[7, 2, 9, -1], [0, 5, 3, 8]], np.int32)
    k_ctx, v_ctx = rng.normal(size=(b, 8, kh, h)), rng.normal(size=(b, 8, kh, hv))
    k_new, v_new = rng.normal(size=(b, t, kh, h)), rng.normal(size=(b, t, kh, hv))
    k_pages, v_pages = np.full((10, ps, kh, h), np.nan), np.full((10, ps, kh, hv), np.nan)
    for row in range(b):  # the cached prefix, written from the definition
        for j in range(lens0[row]):
            k_pages[table[row, j // ps], j % ps] = k_ctx[row, j]
            v_pages[table[row, j // ps], j % ps] = v_ctx[row, j]
    q = rng.normal(size=(b, t, n, h))
    return q, k_pages, v_pages, table, lens0, k_ctx, v_ctx, k_new, v_new


_APPEND = jax.jit(attnref.decode.paged_kv_append)


@pytest.mark.parametrize("jit", [True, False])
def test_append_through_the_table_equals_attention_on_the_concatenation(jit):
    """``paged_kv_append`` writes the chunk to slots ``L0 .. L0 + T - 1`` through the table
    (exactly the definition's slots: every other slot keeps its bits, NaN included); attending
    with the new lengths equals the kernel oracle on the contiguous ``[cache; new]``, bottom-right
    causal, within the kernel bound."""
    q, k_pages, v_pages, table, lens0, k_ctx, v_ctx, k_new, v_new = _append_case()
    ps, t = k_pages.shape[1], k_new.shape[1]
    fn = _APPEND if jit else attnref.decode.paged_kv_append
    kp, vp, lens = (np.asarray(x) for x in fn(k_pages, v_pages, table, lens0, k_new, v_new))
    np.testing.assert_array_equal(lens, lens0 + t)
    want_k, want_v = k_pages.copy(), v_pages.copy()
    for row in range(2):
        for i in range(t):
            pos = lens0[row] + i
            want_k[table[row, pos // ps], pos % ps] = k_new[row, i]
            want_v[table[row, pos // ps], pos % ps] = v_new[row, i]
    np.testing.assert_array_equal(kp, want_k)  # NaN compares equal to NaN here
    np.testing.assert_array_equal(vp, want_v)
    out = np.asarray(_PAGED(q, kp, vp, table, lens, is_causal=True))
    for row in range(2):
        keys = np.concatenate([k_ctx[row, : lens0[row]], k_new[row]])[None]
        vals = np.concatenate([v_ctx[row, : lens0[row]], v_new[row]])[None]
        call = dict(is_causal=True, causal_alignment="bottom_right")
        ref = oracle.dot_product_attention(q[row : row + 1], keys, vals, **call)
        bound, _ = tolerance.kernel_call_error_bound(
            q[row : row + 1], keys, vals, key_blocks=1, **call
        )
        assert_ratio_within(np.abs(out[row : row + 1] - ref), bound, "append {error} {allowed}")


def test_gradient_through_append_then_attend_equals_the_oracle():
    """``jax.grad`` (jitted) of ``sum(cot * attend(append(pages, k_new, v_new)))`` with respect
    to the new keys and values equals the kernel gradient oracle on the contiguous
    ``[cache; new]`` at the new positions (the scatter's transpose gathers them back), within
    :func:`attnref.tolerance.kernel_grad_error_bound`."""
    q, k_pages, v_pages, table, lens0, k_ctx, v_ctx, k_new, v_new = _append_case()
    cot = np.random.default_rng(8).normal(size=(*q.shape[:3], v_new.shape[-1]))

    def loss(k_new, v_new):
        kp, vp, lens = attnref.decode.paged_kv_append(k_pages, v_pages, table, lens0, k_new, v_new)
        return jnp.sum(cot * paged_attention(q, kp, vp, table, lens, is_causal=True))

    dk, dv = (np.asarray(g) for g in jax.jit(jax.grad(loss, argnums=(0, 1)))(k_new, v_new))
    for row in range(2):
        keys = np.concatenate([k_ctx[row, : lens0[row]], k_new[row]])[None]
        vals = np.concatenate([v_ctx[row, : lens0[row]], v_new[row]])[None]
        call = dict(query=q[row : row + 1], key=keys, value=vals, is_causal=True)
        call["causal_alignment"] = "bottom_right"
        ref = oracle.dot_product_attention_vjp(**call, cotangent=cot[row : row + 1])
        bnd = tolerance.kernel_grad_error_bound(**call, cotangent=cot[row : row + 1])
        new = slice(int(lens0[row]), None)
        for got, want, allowed in ((dk, ref.key, bnd.key), (dv, ref.value, bnd.value)):
            assert_ratio_within(
                np.abs(got[row] - want[0, new]), allowed[0, new], "append grad {error:.3e}"
            )


def test_append_that_does_not_fit_is_refused_eagerly_nan_under_jit_and_raises_checked():
    """A chunk past the table (row 1: 8 + 5 > 12 slots) or into an out-of-range page: eagerly a
    ``ValueError`` naming the row; under ``jax.jit`` that row writes nothing and gets length
    ``-1`` (the next attention's rows are NaN), the other row is written; ``attnref.checked``
    raises."""
    q, k_pages, v_pages, table, lens0, _, _, _, _ = _append_case()
    rng = np.random.default_rng(4)
    k_new, v_new = rng.normal(size=(2, 5, 2, 4)), rng.normal(size=(2, 5, 2, 3))
    with pytest.raises(ValueError, match=r"seq_lens\[1\] = 8: a chunk of T=5 tokens does not fit"):
        attnref.decode.paged_kv_append(k_pages, v_pages, table, lens0, k_new, v_new)
    kp, vp, lens = _APPEND(k_pages, v_pages, table, lens0, k_new, v_new)
    assert lens.tolist() == [9, -1]
    written = ~np.isnan(np.asarray(kp)[..., 0, 0])
    assert written.sum() == lens0.sum() + 5  # row 0's chunk only
    out = _PAGED(np.concatenate([q, q[:, :2]], axis=1), kp, vp, table, lens)
    assert np.isnan(out[1]).all() and not np.isnan(out[0]).any()
    with pytest.raises(ValueError, match=r"batch row 1 cannot take 5 tokens"):
        attnref.checked(_APPEND)(k_pages, v_pages, table, lens0, k_new, v_new)
    bad = table.copy()
    bad[0, 2] = 99  # the page row 0 appends into
    with pytest.raises(ValueError, match=r"block_table\[0, 2\] = 99"):
        attnref.decode.paged_kv_append(k_pages, v_pages, bad, lens0, k_new[:, :3], v_new[:, :3])
    kp, _, lens = _APPEND(k_pages, v_pages, bad, lens0, k_new[:, :3], v_new[:, :3])
    assert lens.tolist() == [-1, 11]
    np.testing.assert_array_equal(np.asarray(kp)[[7, 2]], k_pages[[7, 2]])  # row 0 untouched


def test_decoding_token_by_token_under_scan_equals_causal_attention():
    """A ``lax.scan`` over ``L = 7`` steps (page size 3, pages taken from a permuted pool; the
    lengths are traced): each step appends one token with ``paged_kv_append`` and attends with
    ``paged_attention``; output ``t`` equals causal attention over the whole sequence, row ``t``
    (the kernel oracle on the contiguous keys), within the kernel bound."""
    rng = np.random.default_rng(5)
    b, steps, n, kh, h, hv, ps = 2, 7, 4, 2, 4, 3, 3
    table = np.array([[4, 0, 6], [2, 5, 1]], np.int32)
    q = rng.normal(size=(b, steps, n, h))
    k, v = rng.normal(size=(b, steps, kh, h)), rng.normal(size=(b, steps, kh, hv))

    @jax.jit
    def decode(q, k, v):
        pools = (jnp.full((7, ps, kh, h), jnp.nan), jnp.full((7, ps, kh, hv), jnp.nan))

        def step(carry, xs):
            kp, vp, lens = carry
            q_t, k_t, v_t = xs
            kp, vp, lens = attnref.decode.paged_kv_append(kp, vp, table, lens, k_t, v_t)
            return (kp, vp, lens), paged_attention(q_t, kp, vp, table, lens)[:, 0]

        xs = tuple(jnp.swapaxes(a, 0, 1)[:, :, None] for a in (q, k, v))
        _, out = jax.lax.scan(step, (*pools, jnp.zeros(b, jnp.int32)), xs)
        return jnp.swapaxes(out, 0, 1)

    out = np.asarray(decode(q, k, v))
    # step t reads 9 slots, of which t + 1 are allowed: the others add exact zeros (no rounding),
    # so the bound of the contiguous causal call (every row's allowed keys) covers it
    ref = oracle.dot_product_attention(q, k, v, is_causal=True)
    bound, _ = tolerance.kernel_call_error_bound(q, k, v, is_causal=True, key_blocks=1)
    assert_ratio_within(np.abs(out - ref), bound, "scan decode {error:.3e} > {allowed:.3e}")


# ----------------------------------------------------------------------------- gradients


def _paged_loss(q, kp, vp, table, lens, cot, static):
    return jnp.sum(cot * paged_attention(q, kp, vp, table, lens, **dict(static)))


# Arrays as arguments and the static options as one static argument: under jit, one compile per
# (shape, static options), shared across examples (a closure per example would compile each).
_PAGED_GRAD = jax.grad(_paged_loss, argnums=(0, 1, 2))


class PagedGradTest(chex.TestCase):
    @chex.variants(with_jit=True)
    @given(
        bucket=st.sampled_from(BUCKETS[:2]),
        profile=st.sampled_from(PROFILES[:3]),
        seed=st.integers(0, 2**16),
    )
    def test_gradients_equal_the_oracle_and_skip_unused_slots(self, bucket, profile, seed):
        self.check_gradients(bucket, profile, seed)

    @chex.variants(without_jit=True)
    def test_gradients_eagerly(self):
        self.check_gradients(BUCKETS[1], PROFILES[1], 9)

    def check_gradients(self, bucket, profile, seed):
        """``jax.grad`` w.r.t. ``query``, ``k_pages``, ``v_pages`` equals the kernel's gradient
        oracle on the gathered keys moved back through the table; every unused slot (NaN-filled)
        gets exactly 0."""
        p = make_paged(bucket, seed, np.float64, profile)
        cot = np.random.default_rng(seed + 1).normal(size=(*p.q.shape[:3], p.v_pages.shape[-1]))

        fn = self.variant(_PAGED_GRAD, static_argnames=("static",))
        grads = fn(
            p.q, p.k_pages, p.v_pages, p.table, p.lens, cot, tuple(sorted(p.options.items()))
        )
        dq, dk, dv = (np.asarray(g) for g in grads)
        call = p.call()
        ref = oracle.dot_product_attention_vjp(**call, cotangent=cot)
        bnd = tolerance.kernel_grad_error_bound(**call, cotangent=cot, dtype=np.float64)
        read = p.scatter(np.ones((*p.used().shape, 1, 1)), p.k_pages[..., :1, :1]) > 0
        for name, got, r, bd, like in (
            ("dk_pages", dk, ref.key, bnd.key, p.k_pages),
            ("dv_pages", dv, ref.value, bnd.value, p.v_pages),
        ):
            np.testing.assert_array_equal(np.where(read, 0.0, got), 0.0, err_msg=name)
            assert_ratio_within(
                np.abs(got - p.scatter(r, like)), p.scatter(bd, like), f"{name} {{error}}"
            )
        assert_ratio_within(np.abs(dq - ref.query), bnd.query, "dquery {error} {allowed}")


# ----------------------------------------------------------------------------- refusals


def _bad(p: Paged) -> Paged:
    """Row 1's first used page entry pointed past the pool."""
    table = p.table.copy()
    table[1, 0] = p.k_pages.shape[0] + 3
    return dataclasses.replace(p, table=table, lens=np.maximum(p.lens, 1).astype(np.int32))


def test_out_of_range_page_is_an_error_eagerly_in_jax_and_oracle():
    p = _bad(make_paged(BUCKETS[0], 5, np.float32, {}, nan_fill=False))
    bad = int(p.table[1, 0])
    for fn in (paged_attention, oracle.paged_attention):
        with pytest.raises(ValueError, match=rf"block_table\[1, 0\] = {bad}.*batch row 1"):
            run(fn, p)
    # a negative entry too, and an unused entry is never checked (make_paged sets them -1)
    table = p.table.copy()
    table[1, 0] = -2
    with pytest.raises(ValueError, match=r"block_table\[1, 0\] = -2"):
        paged_attention(p.q, p.k_pages, p.v_pages, table, p.lens)


def test_seq_lens_past_the_table_is_an_error_eagerly_in_jax_and_oracle():
    p = make_paged(BUCKETS[0], 6, np.float32, {})
    lens = p.lens.copy()
    lens[0] = p.table.shape[1] * p.page_size + 1
    for fn in (paged_attention, oracle.paged_attention):
        with pytest.raises(ValueError, match=r"seq_lens\[0\] = 10"):
            fn(p.q, p.k_pages, p.v_pages, p.table, lens)


def test_out_of_range_page_under_jit_is_nan_unchecked_and_raises_checked():
    """Under ``jax.jit`` the bad row is NaN (every entry, ``lse`` too) and the other rows are
    unchanged; ``attnref.checked`` raises, naming the row, the slot and the value."""
    p = _bad(make_paged(BUCKETS[0], 5, np.float32, {}, nan_fill=False))
    out, lse = run(_PAGED, p, return_lse=True)
    assert np.isnan(out[1]).all() and np.isnan(lse[1]).all()
    good = dataclasses.replace(p, table=p.table[:1], lens=p.lens[:1], q=p.q[:1])
    np.testing.assert_array_equal(out[0], run(_PAGED, good)[0])
    with pytest.raises(ValueError, match=r"batch row 1 reads page slot 0"):
        attnref.checked(_PAGED)(p.q, p.k_pages, p.v_pages, p.table, p.lens)
    lens = p.lens.copy()
    lens[0] = 99
    assert np.isnan(_PAGED(p.q, p.k_pages, p.v_pages, p.table, lens)[0]).all()
    with pytest.raises(ValueError, match=r"batch row 0 has seq_lens = 99"):
        attnref.checked(_PAGED)(p.q, p.k_pages, p.v_pages, p.table, lens)


@pytest.mark.usefixtures("unchecked_annotations")  # the arguments contradict the annotations
@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"k_pages": np.zeros((3, 2, 4))}, ValueError, "k_pages must have rank 4"),
        ({"v_pages": np.zeros((8, 2, 2, 3), np.float32)}, ValueError, "v_pages has shape"),
        ({"k_pages": np.zeros((8, 3, 2, 5), np.float32)}, ValueError, "head dim"),
        ({"block_table": np.zeros((3, 3), np.int32)}, ValueError, "block_table has shape"),
        ({"block_table": np.zeros((2, 3))}, TypeError, "block_table must be integer"),
        ({"seq_lens": np.zeros(3, np.int32)}, ValueError, "seq_lens has shape"),
        ({"k_pages": np.zeros((8, 3, 2, 4))}, TypeError, "share one dtype"),
        ({"masked_rows": "uniform"}, ValueError, "uniform"),
        ({"key_value_seq_lengths": np.ones(2, np.int32)}, TypeError, "key_value_seq_lengths"),
        ({"causal_alignment": "top_left"}, TypeError, "causal_alignment"),
    ],
)
def test_refusals_match_between_jax_and_oracle(change, error, match):
    p = make_paged(BUCKETS[0], 1, np.float32, {})
    args = {
        "query": p.q,
        "k_pages": p.k_pages,
        "v_pages": p.v_pages,
        "block_table": p.table,
        "seq_lens": p.lens,
        **change,
    }
    for fn in (paged_attention, oracle.paged_attention):
        with pytest.raises(error, match=match):
            fn(**args)


# ----------------------------------------------------------------------------- cost


def test_cost_model_matches_xla_dots_and_the_slots_read():
    """``matmul_flops`` equals the dot FLOPs of XLA's compiled HLO exactly; the byte counts
    equal the slots and pages read, counted here from the table one slot at a time."""
    bucket = BUCKETS[1]
    b, t, n, kh, h, hv, ps, mp = bucket
    p = make_paged(bucket, 11, np.float32, {"is_causal": True})
    c = attnref.decode.paged_cost(
        batch=b,
        t=t,
        heads=n,
        kv_heads=kh,
        d_k=h,
        d_v=hv,
        page_size=ps,
        max_pages=mp,
        seq_lens=p.lens,
    )
    xla = xla_counts(_PAGED, p.q, p.k_pages, p.v_pages, p.table, p.lens, is_causal=True)
    assert c.matmul_flops == xla.dot_flops
    slots = {(int(p.table[r, j // ps]), j % ps) for r in range(b) for j in range(p.lens[r])}
    pages = {page for page, _ in slots}
    assert c.kv_bytes_read == len(slots) * kh * (h + hv) * 4
    assert c.page_bytes_read == len(pages) * ps * kh * (h + hv) * 4
    assert c.useful_flops == 2 * n * t * len(slots) * (h + hv)
    assert c.gathered_bytes == b * mp * ps * kh * (h + hv) * 4


# ----------------------------------------------------------------------------- the kit


def test_kit_passes_the_reference_and_fails_a_kernel_that_reads_whole_pages():
    """``check_paged`` on attnref's own kernel passes every property; a kernel that rounds each
    length up to whole pages (it reads the tail of the last page) fails ``oracle`` (the tail
    holds 1e4) and ``unused_pages`` (the tail holds NaN)."""
    report = check_paged(_PAGED, max_examples=1)
    assert report.passed, report.summary()
    assert [r.status for r in report.results] == ["passed"] * len(PAGED_PROPERTIES)

    def whole_pages(q, kp, vp, table, lens, **options):
        ps = kp.shape[1]
        rounded = np.minimum(-(-lens // ps) * ps, table.shape[1] * ps).astype(np.int32)
        return _PAGED(q, kp, vp, table, rounded, **options)

    bad = check_paged(whole_pages, max_examples=2, properties=["oracle", "unused_pages"])
    assert [r.status for r in bad.results] == ["failed", "failed"], bad.summary()
    assert "exceeds the derived bound" in bad.results[0].detail
    assert "non-finite output" in bad.results[1].detail
    # The replay line of a paged failure reruns check_paged (not check_attention), with its seed.
    line = bad.replay(bad.results[0])
    assert line.startswith("from attnref.conformance import check_paged"), line
    assert "properties=['oracle']" in line and f"seed={bad.results[0].seed}" in line, line
