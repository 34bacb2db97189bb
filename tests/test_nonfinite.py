"""What a query may not read never influences it, whatever it holds (issue 11, defect 3).

A key or value a query cannot attend to (mask, ``-inf`` bias, causality, ``key_mask``, window,
lengths, segments) must not reach that query's output or gradients even when it is NaN or
``+-inf``: IEEE arithmetic turns ``0 * NaN`` into NaN, so a naive contraction lets one poisoned
padding row reach every row and every parameter gradient.

For every registered formulation of every family (softmax, RoPE, linear) and for the kernels
(``dot_product_attention``, ``blockwise_dot_product_attention``), a problem is drawn from the
shared buckets,
token rows (``x_kv``, ``k``, ``v``) at positions masked for at least one query are replaced by
NaN, ``+inf`` or ``-inf``, and so are bias entries (at masked pairs, and sometimes one allowed
pair) and the query rows of fully masked rows (and sometimes one other query row). The test
works out, independently of the implementation, which query rows read a poisoned value
(*dirty*: an allowed poisoned key/value row or bias entry, or its own poisoned query row when it
has an allowed key) and checks:

* every clean row equals the float64 oracle on the *clean* problem (the same problem before the
  poisoning; the oracle on it is the truth for those rows) within the derived bound;
* every dirty row holds a non-finite value (the IEEE value of the definition);
* the gradient of a drawn functional of the clean rows w.r.t. every input (parameters, ``x_q``,
  ``x_kv``; ``q``, ``k``, ``v``, bias) is finite and equals the clean problem's gradient within
  ``2 gamma_{N_b}(u) M`` (``M`` the largest clean gradient entry, ``N_b`` the longest backward
  reduction chain, the rounding floor of ``tests/test_gradients.py``: two evaluations of the
  same backward quantities differ by at most twice that floor). A leaked NaN or infinity fails
  the finiteness check, a leaked finite value moves the gradient by O(1).

Cost: the weight-level properties run on the cross-attention bucket in float64 with the
gradient functions of ``tests/test_gradients.py`` (same functions, shapes and dtypes, so the
compiled programs are shared); the kernel properties reuse ``tests/test_blockwise.py``'s
gradient function. The eager variant covers the softmax family on two examples.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, note
from hypothesis import strategies as st

import attnref
from attnref import oracle, tolerance
from attnref import strategies as ast
from attnref.testing import assert_within_bound

from . import test_blockwise as tb
from . import test_gradients as tg
from .helpers import scaled
from .kernel_helpers import expected

BUCKET = ast.WEIGHT_BUCKETS[1]  # batch (2,), T_q 5 != T_k 7: the bucket test_gradients compiles
POISONS = (np.nan, np.inf, -np.inf)
KINDS = ("causal", "padding", "random", "combined", "fully_masked_row")
SEEDS = st.integers(0, 2**31 - 1)
U64 = tolerance.unit_roundoff(np.float64)

Tree = Any


# ----------------------------------------------------------------------------- poisoning


def _rows_bad(x: np.ndarray) -> np.ndarray:
    return ~np.all(np.isfinite(x), axis=-1)


def dirty_rows(
    allowed: np.ndarray, x_q: np.ndarray, x_kv: np.ndarray, bias: np.ndarray | None
) -> np.ndarray:
    """``[..., T_q]``: rows that read a non-finite value through an allowed pair (the spec)."""
    live = allowed.any(-1)
    dirty = _rows_bad(x_q) & live
    dirty |= (allowed & _rows_bad(x_kv)[..., None, :]).any(-1)
    if bias is not None:
        dirty |= (allowed & ~np.isfinite(bias)).any(-1)
    return dirty


@dataclasses.dataclass
class Poisoned:
    """A clean problem and its poisoned inputs; ``dirty`` ``[..., T_q]`` from the spec."""

    clean: ast.AttentionProblem
    x_q: np.ndarray
    x_kv: np.ndarray
    bias: np.ndarray
    allowed: np.ndarray
    dirty: np.ndarray
    self_attention: bool


def poison(
    p: ast.AttentionProblem, allowed: np.ndarray, seed: int, value: float, bias_too: bool
) -> Poisoned:
    """Poison ``x_kv`` rows masked for some query, bias entries at masked pairs (and sometimes one
    allowed pair), the query rows of fully masked rows (and sometimes one other query row)."""
    rng = np.random.default_rng(seed)
    allowed = np.broadcast_to(allowed, (*p.config.batch, p.x_q.shape[-2], p.x_kv.shape[-2]))
    self_attention = p.x_kv is p.x_q
    x_q = p.x_q.copy()
    x_kv = x_q if self_attention else p.x_kv.copy()
    bias = p.bias.copy()
    masked_for_some = ~allowed.all(-2)  # [..., T_k]
    chosen = masked_for_some & (rng.random(masked_for_some.shape) < 0.6)
    if masked_for_some.any() and not chosen.any():  # at least one poisoned key row
        idx = np.argwhere(masked_for_some)
        chosen[tuple(idx[rng.integers(len(idx))])] = True
    x_kv[chosen] = value
    dead = ~allowed.any(-1)
    x_q[dead] = value  # a fully masked query reads nothing: still clean
    if rng.random() < 0.5:  # one more query row: dirty iff it has an allowed key
        b = p.config
        x_q.reshape(-1, b.t, b.d_model)[0, rng.integers(b.t)] = value  # a view: x_q copied
    if bias_too:
        bias_value = np.nan if np.isnan(value) else np.inf  # -inf in a bias is a mask
        bias[~allowed & (rng.random(allowed.shape) < 0.5)] = bias_value
        if rng.random() < 0.5 and allowed.any():
            idx = np.argwhere(allowed)
            bias[tuple(idx[rng.integers(len(idx))])] = bias_value
    dirty = dirty_rows(allowed, x_q, x_kv, bias if bias_too else None)
    note(f"poison={value} rows={np.argwhere(chosen).tolist()} dirty={np.argwhere(dirty).tolist()}")
    return Poisoned(p, x_q, x_kv, bias, allowed, dirty, self_attention)


def _cotangent(pz: Poisoned, seed: int) -> np.ndarray:
    """A drawn functional of the clean rows: random weights, zero on every dirty row."""
    b = pz.clean.config
    cot = np.random.default_rng(seed).standard_normal((*b.batch, b.t, b.d_model))
    return np.where(pz.dirty[..., None], 0.0, cot)


def _n_b(b: Any) -> int:
    return int(np.prod(b.batch)) * b.t + b.s + b.d_model + b.d_k + b.d_v + b.n


def check_rows(y: Any, ref: np.ndarray, bound: np.ndarray, dirty: np.ndarray, label: str) -> None:
    """Clean rows within the derived bound of the clean oracle; dirty rows non-finite."""
    y = np.asarray(y, np.float64)
    assert y.shape == ref.shape, f"{label}: shape {y.shape} != {ref.shape}"
    clean = ~dirty
    assert np.all(np.isfinite(y[clean])), f"{label}: a clean row is not finite"
    assert_within_bound(y[clean], ref[clean], np.broadcast_to(bound, ref.shape)[clean], label=label)
    bad = ~np.all(np.isfinite(y[dirty]), axis=-1)
    assert np.all(bad), f"{label}: a row that reads a non-finite value came out finite"


def check_same_gradients(g: Tree, g_clean: Tree, n_b: int, u: float, label: str) -> None:
    """Finite, and within ``2 gamma_{N_b}(u) M`` of the clean problem's gradient."""
    leaves = [np.asarray(a, np.float64) for a in jax.tree_util.tree_leaves(g)]
    ref = [np.asarray(a, np.float64) for a in jax.tree_util.tree_leaves(g_clean)]
    assert len(leaves) == len(ref), label
    for i, a in enumerate(leaves):
        assert np.all(np.isfinite(a)), f"{label}: gradient leaf {i} is not finite"
    scale = max(float(np.abs(a).max(initial=0.0)) for a in ref)
    tol = 2 * tolerance.gamma(n_b, u) * scale
    for i, (a, r) in enumerate(zip(leaves, ref, strict=True)):
        err = float(np.abs(a - r).max(initial=0.0))
        assert err <= tol, f"{label}: gradient leaf {i} differs from the clean one by {err:.3e}"


# ----------------------------------------------------------------------------- weight level


@st.composite
def poisoned_problems(draw: st.DrawFn, bias_too: bool = True) -> Poisoned:
    kind = draw(st.sampled_from(KINDS), label="mask kind")
    seed = draw(SEEDS, label="data seed")
    value = draw(st.sampled_from(POISONS), label="poison")
    p = ast.make_attention_problem(BUCKET, kind, seed, np.float64)
    allowed = p.mask & (p.bias != -np.inf)
    return poison(p, allowed, seed + 1, value, bias_too)


def _softmax_run(
    f: attnref.Formulation, variant: Callable[..., Any], pz: Poisoned, cot: np.ndarray
) -> tuple[Any, Tree, Tree]:
    p = pz.clean
    x_kv = None if pz.self_attention else pz.x_kv
    y = variant(f.apply)(p.params, pz.x_q, x_kv, mask=p.mask, bias=pz.bias)
    grad = variant(tg._GRAD[f.id])
    g = grad(p.params, pz.x_q, pz.x_q if x_kv is None else x_kv, p.mask, pz.bias, cot)
    g_clean = grad(p.params, p.x_q, p.x_kv, p.mask, p.bias, cot)
    return y, g, g_clean


# Eagerly: the Prepared path and the transposed (column) path; the jit variant covers every form.
EAGER_IDS = ("concat", "column")


def _check_softmax(
    pz: Poisoned, seed: int, variant: Callable[..., Any], ids: tuple[str, ...] | None = None
) -> None:
    p = pz.clean
    ref = oracle.attention(p.params, p.x_q, p.x_kv, **p.inputs())
    bound = tolerance.attention_error_bound(p.params, p.x_q, p.x_kv, dtype=p.dtype, **p.inputs())
    cot = _cotangent(pz, seed)
    for f in attnref.formulations("softmax"):
        if ids is not None and f.id not in ids:
            continue
        y, g, g_clean = _softmax_run(f, variant, pz, cot)
        check_rows(y, ref, bound, pz.dirty, f.id)
        check_same_gradients(g, g_clean, _n_b(BUCKET), U64, f"{f.id} gradient")


def _rope_grad_fn(f: attnref.Formulation) -> Callable[..., Any]:
    def loss(params: Any, x_q: Any, x_kv: Any, mask: Any, bias: Any, cot: Any) -> Any:
        return jnp.sum(f.apply(params, x_q, x_kv, mask=mask, bias=bias) * cot)

    return jax.grad(loss, argnums=(0, 1, 2))


_ROPE_GRAD = {f.id: _rope_grad_fn(f) for f in attnref.formulations("rope")}


def _check_rope(pz: Poisoned, seed: int, variant: Callable[..., Any]) -> None:
    p = pz.clean
    ref = oracle.rope_attention(p.params, p.x_q, p.x_kv, **p.inputs())
    bound = tolerance.rope_attention_error_bound(
        p.params, p.x_q, p.x_kv, dtype=p.dtype, **p.inputs()
    )
    cot = _cotangent(pz, seed)
    for f in attnref.formulations("rope"):
        y = variant(f.apply)(p.params, pz.x_q, pz.x_kv, mask=p.mask, bias=pz.bias)
        check_rows(y, ref, bound, pz.dirty, f.id)
        grad = variant(_ROPE_GRAD[f.id])
        g = grad(p.params, pz.x_q, pz.x_kv, p.mask, pz.bias, cot)
        g_clean = grad(p.params, p.x_q, p.x_kv, p.mask, p.bias, cot)
        check_same_gradients(g, g_clean, _n_b(BUCKET), U64, f"{f.id} gradient")


class WeightLevelTest(chex.TestCase):
    @chex.variants(with_jit=True)
    @scaled(0.25)
    @given(pz=poisoned_problems(), seed=SEEDS)
    def test_softmax_forms_ignore_what_a_query_cannot_read(self, pz, seed):
        """Every softmax-family formulation, under jit."""
        _check_softmax(pz, seed, self.variant)

    @chex.variants(without_jit=True)
    @scaled(0.25)
    @given(pz=poisoned_problems(), seed=SEEDS)
    def test_softmax_forms_ignore_what_a_query_cannot_read_eagerly(self, pz, seed):
        """The same property without jit, on one formulation per guard code path (the
        ``Prepared`` forms, the column form, the vmapped single query, the edge list)."""
        _check_softmax(pz, seed, self.variant, EAGER_IDS)

    @chex.variants(with_jit=True)
    @scaled(0.25)
    @given(pz=poisoned_problems(), seed=SEEDS)
    def test_rope_forms_ignore_what_a_query_cannot_read(self, pz, seed):
        """Both RoPE formulations (default positions), under jit."""
        _check_rope(pz, seed, self.variant)


# ----------------------------------------------------------------------------- linear family

LINEAR_MAPS = ("elu_plus_one", "favor_plus")


def _feature_map(name: str, d_k: int, seed: int) -> attnref.linear.FeatureMap:
    if name == "favor_plus":
        return attnref.linear.favor_plus(seed, d_k, 2 * d_k)
    return attnref.linear.elu_plus_one()


def _linear_grad_fn(f: attnref.Formulation, causal: bool) -> Callable[..., Any]:
    def loss(params: Any, x_q: Any, x_kv: Any, fm: Any, key_mask: Any, cot: Any) -> Any:
        y = f.apply(params, x_q, x_kv, feature_map=fm, causal=causal, key_mask=key_mask)
        return jnp.sum(y * cot)

    return jax.grad(loss, argnums=(0, 1, 2))


_LINEAR_GRAD = {
    (f.id, c): _linear_grad_fn(f, c) for f in attnref.formulations("linear") for c in (False, True)
}


@st.composite
def linear_poisoned(
    draw: st.DrawFn,
) -> tuple[Poisoned, bool, attnref.linear.FeatureMap, np.ndarray]:
    causal = draw(st.booleans(), label="causal")
    seed = draw(SEEDS, label="data seed")
    value = draw(st.sampled_from(POISONS), label="poison")
    name = draw(st.sampled_from(LINEAR_MAPS), label="feature map")
    p = ast.make_attention_problem(BUCKET, "none", seed, np.float64)
    if causal:  # causal linear attention is self-attention (T_q == T_k)
        p = dataclasses.replace(p, x_kv=p.x_q)
    t_q, t_k = p.x_q.shape[-2], p.x_kv.shape[-2]
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, t_k + 1, BUCKET.batch)
    key_mask = np.arange(t_k) < lengths[..., None]  # [B, T_k]
    allowed = np.broadcast_to(key_mask[..., None, :], (*BUCKET.batch, t_q, t_k))
    if causal:
        allowed = allowed & np.tril(np.ones((t_q, t_k), bool))
    note(f"causal={causal} map={name} lengths={lengths.tolist()}")
    pz = poison(p, allowed, seed + 1, value, bias_too=False)
    return pz, causal, _feature_map(name, BUCKET.d_k, seed), key_mask


class LinearTest(chex.TestCase):
    @chex.variants(with_jit=True)
    @scaled(0.25)
    @given(case=linear_poisoned(), seed=SEEDS)
    def test_linear_forms_ignore_what_a_query_cannot_read(self, case, seed):
        """Every linear formulation in each causal mode it takes: ``key_mask`` and causality
        define what is allowed."""
        pz, causal, fm, key_mask = case
        p = pz.clean
        kw = dict(feature_map=fm, causal=causal, key_mask=key_mask)
        x_kv = pz.x_kv
        ref = oracle.linear_multihead(p.params, p.x_q, p.x_kv, **kw)
        bound = tolerance.linear_multihead_error_bound(p.params, p.x_q, p.x_kv, dtype=p.dtype, **kw)
        cot = _cotangent(pz, seed)
        ran = 0
        for f in attnref.formulations("linear"):
            if causal not in f.causal_modes:
                continue
            y = self.variant(f.apply, static_argnames=f.static_argnames)(
                p.params, pz.x_q, x_kv, **kw
            )
            check_rows(y, ref, bound, pz.dirty, f.id)
            grad = self.variant(_LINEAR_GRAD[f.id, causal])
            g = grad(p.params, pz.x_q, x_kv, fm, key_mask, cot)
            g_clean = grad(p.params, p.x_q, p.x_kv, fm, key_mask, cot)
            check_same_gradients(g, g_clean, _n_b(BUCKET), U64, f"{f.id} gradient")
            ran += 1
        assert ran >= 3


# ----------------------------------------------------------------------------- kernel level

# Static profiles of tests/test_blockwise.py's gradient function: (profile, array options).
KERNEL_CASES: tuple[tuple[dict[str, Any], tuple[str, ...]], ...] = (
    (dict(is_causal=True, masked_rows="uniform"), ()),  # causal
    (dict(), ("padding",)),  # padding through key_value_seq_lengths
    (dict(), ("segments",)),  # packed sequences
    (dict(local_window_size=(1, 1), softcap=2.0, masked_rows="nan"), ("bias",)),  # a window
    (dict(), ("neg_inf_bias",)),  # -inf bias entries
    (dict(), ("random",)),  # a boolean mask broadcast over heads and query rows: [B, 1, 1, S]
)


def _kernel_dirty(kp: ast.KernelProblem, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """``[B, T, N]``: rows reading a non-finite ``q``, ``k``, ``v`` or bias through an allowed
    pair; with ``masked_rows="uniform"`` a fully masked row reads (the mean of) every ``v``."""
    b = kp.config
    allowed = kp.allowed()  # [B, N, T, S]
    g = b.n // b.k
    bad_kv = np.repeat(_rows_bad(k) | _rows_bad(v), g, axis=2)  # [B, S, N]
    live = allowed.any(-1)
    dirty = live & np.swapaxes(_rows_bad(q), 1, 2)
    dirty |= (allowed & np.swapaxes(bad_kv, 1, 2)[:, :, None, :]).any(-1)
    bias = kp.kwargs.get("bias")
    if bias is not None:
        dirty |= (allowed & ~np.isfinite(bias)).any(-1)
    if kp.kwargs.get("masked_rows") == "uniform":
        any_v = np.repeat(_rows_bad(v).any(1), g, axis=1)  # [B, N]
        dirty |= ~live & any_v[:, :, None]
    dirty = np.swapaxes(dirty, 1, 2)  # [B, T, N]
    q_lens = kp.kwargs.get("query_seq_lengths")
    if q_lens is not None:  # padded query rows are zero whatever they read
        dirty &= (np.arange(b.t)[None, :] < q_lens[:, None])[..., None]
    return dirty


@st.composite
def kernel_poisoned(
    draw: st.DrawFn,
) -> tuple[ast.KernelProblem, ast.KernelProblem, np.ndarray, np.ndarray]:
    case = draw(st.sampled_from(range(len(KERNEL_CASES))), label="kernel case")
    profile, extras = KERNEL_CASES[case]
    seed = draw(SEEDS, label="data seed")
    value = draw(st.sampled_from(POISONS), label="poison")
    bucket = ast.KERNEL_BUCKETS[0]
    pattern = "B11S" if "random" in extras else "BNTS"
    kp = ast.make_kernel_problem(
        bucket, extras, seed, np.float64, static=profile, mask_shape=pattern, empty_rows=True
    )
    rng = np.random.default_rng(seed + 1)
    allowed = kp.allowed()  # [B, N, T, S]
    g = bucket.n // bucket.k
    grouped = allowed.reshape(bucket.batch, bucket.k, g, bucket.t, bucket.s)
    masked_for_some = np.swapaxes(~grouped.all(axis=(2, 3)), 1, 2)  # [B, S, K]
    k, v = kp.k.copy(), kp.v.copy()
    for arr in (k, v):
        pick = masked_for_some & (rng.random(masked_for_some.shape) < 0.5)
        arr[pick] = value
    kw = dict(kp.kwargs)
    if "bias" in kw:  # NaN at pairs masked by something other than the bias, for every
        bias = kw["bias"].copy()  # element the (broadcast) bias entry serves
        skip = ("softcap", "masked_rows", "scale", "bias")
        structural = oracle.kernel_allowed(
            allowed.shape, **{n: a for n, a in kw.items() if n not in skip}
        )
        axes = tuple(i for i, d in enumerate(bias.shape) if d == 1)
        masked = ~structural.any(axis=axes, keepdims=True)
        bias[masked & (rng.random(bias.shape) < 0.5)] = np.nan
        kw["bias"] = bias
    poisoned = kp.replace(k=k, v=v, options={n: kw[n] for n in kp.options})
    dirty = _kernel_dirty(poisoned, poisoned.q, k, v)
    # A row that reads a non-finite v (or any NaN) is non-finite; one that reads only an infinite
    # k can legitimately be finite (a logit of -inf is a weight of 0 on a finite value).
    reads_v = _kernel_dirty(poisoned, kp.q, kp.k, v) if np.isinf(value) else dirty
    note(f"case={case} poison={value} dirty={np.argwhere(dirty).tolist()}")
    return kp, poisoned, dirty, reads_v


def _kernel_forward(which: str, static: tuple[tuple[str, Any], ...], q, k, v, bias, arrays):
    return tb._FNS[which](q, k, v, bias, **dict(static), **arrays)


# One compiled forward per (kernel, static options), reused by the poisoned and clean problems
# and across examples (a fresh jax.jit per call would compile each time).
_FORWARD = jax.jit(_kernel_forward, static_argnames=("which", "static"))


def _kernel_run(
    which: str, kp: ast.KernelProblem, cot: np.ndarray, cot_lse: np.ndarray
) -> tuple[Any, list[np.ndarray]]:
    arrays, _ = tb._neutral_arrays(kp)  # its bias replaces non-finite biases: not here
    b = kp.config
    bias = kp.kwargs.get("bias", np.zeros((1, b.n, b.t, b.s)))
    bias = np.broadcast_to(bias, (b.batch, b.n, b.t, b.s)).astype(np.float64)
    static = tuple(sorted(kp.static.items()))
    out = _FORWARD(which, static, kp.q, kp.k, kp.v, bias, arrays)
    return out, tb._grads(which, static, kp, np.float64, bias, arrays, cot, cot_lse)


@scaled(0.375)
@given(case=kernel_poisoned(), cot_seed=SEEDS)
def test_kernels_ignore_what_a_query_cannot_read(case, cot_seed):
    """``dot_product_attention`` and ``blockwise_dot_product_attention`` with NaN / ``+-inf`` in
    ``k`` and
    ``v`` rows masked for some query (causal, padding lengths, segments, a local window, ``-inf``
    bias, a ``[B, 1, 1, S]`` mask) and NaN bias entries at masked pairs: clean rows equal the
    oracle on the clean problem, dirty rows are non-finite, gradients w.r.t. ``q``, ``k``, ``v``
    and the bias equal the clean problem's."""
    kp, poisoned, dirty, nonfinite = case
    b = kp.config
    ref, _, bound, _ = expected(kp)
    rng = np.random.default_rng(cot_seed)
    cot = np.where(dirty[..., None], 0.0, rng.standard_normal((b.batch, b.t, b.n, b.h_v)))
    cot_lse = np.zeros((b.batch, b.t, b.n))
    keep = ~dirty
    if kp.kwargs.get("masked_rows") == "nan":  # fully masked rows are NaN by policy
        keep &= np.swapaxes(kp.allowed().any(-1), 1, 2)
    n_b = b.batch * b.t + b.s + b.h + b.h_v + b.n
    for which in ("naive", "blockwise"):
        out, g = _kernel_run(which, poisoned, cot, cot_lse)
        _, g_clean = _kernel_run(which, kp, cot, cot_lse)
        out = np.asarray(out, np.float64)
        assert_within_bound(out[keep], ref[keep], bound[keep], label=which)
        assert np.all(~np.all(np.isfinite(out[nonfinite]), axis=-1)), f"{which}: row finite"
        check_same_gradients(g, g_clean, n_b, U64, f"{which} gradient")


# ----------------------------------------------------------------------------- residual form


def test_residual_row_with_a_nonfinite_query_reads_it():
    """A fully masked query row with a NaN token: its output is ``b_O`` (finite) without the
    residual stream and NaN with it (``x_q + y`` reads ``x_q``); the other rows are unaffected."""
    p = ast.make_attention_problem(BUCKET, "causal", seed=5, dtype=np.float64)
    mask = p.mask.copy()
    mask[0, 2] = False
    x_q = p.x_q.copy()
    x_q[0, 2] = np.nan
    for f in map(attnref.get, ("concat", "column")):  # the rule is shared (reads_nonfinite)
        for residual in (False, True):
            y = np.array(f.jit()(p.params, x_q, p.x_kv, mask=mask, bias=p.bias, residual=residual))
            assert np.isfinite(y[0, 2]).all() != residual, f"{f.id} residual={residual}"
            y[0, 2] = 0.0
            assert np.isfinite(y).all(), f"{f.id} residual={residual}: a clean row is not finite"
