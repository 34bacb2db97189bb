"""The checks must fail for wrong code. Each realistic bug class is planted once and shown caught
by the same check function the property tests use: a wrong scale, a transposed W_O, a causal mask
off by one (``check_formulation``), and the classes of issue 11: a broadcast mask padded as data
in the tiled form, non-finite values leaking across rows through ``0 * NaN``, and traced lengths
out of range read as plausible lengths."""

from __future__ import annotations

import inspect
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import attnref
from attnref import strategies as ast

from . import test_extreme_logits as ext
from . import test_nonfinite as nf
from .helpers import check_formulation
from .test_bad_input import _assert_same_refusal
from .test_kernel import (
    check_broadcast_patterns,
    check_out_of_range_lengths,
    check_unread_nonfinite_values,
)

# The modules that define the public functions: mutants are planted in their internals, reached
# from the public names (no private import path to keep in step with the package layout).
KERNEL = inspect.getmodule(attnref.dot_product_attention)
BLOCKWISE = inspect.getmodule(attnref.blockwise_dot_product_attention)
STANDARD = inspect.getmodule(attnref.concat_attention)
COMMON = inspect.getmodule(STANDARD.project)  # the shared row-form preparation

# H * d_v == d_model, so a transposed W_O type-checks
SQUARE = ast.Config(batch=(2,), t=5, s=5, n=2, k=2, h=4, h_v=4, d_model=8)


@pytest.fixture(autouse=True)
def _fresh_programs():
    """Each public function compiles one program per shapes and options and reuses it
    (``jax.jit``'s caches): a mutant patched into attnref's internals must be traced afresh, and
    its program must not outlive the test. ``jax.clear_caches`` before and after each test."""
    jax.clear_caches()
    yield
    jax.clear_caches()


def _problems(kind):
    return [ast.make_attention_problem(SQUARE, kind, seed, np.float32) for seed in range(3)]


def _caught(apply, kind="combined"):
    for p in _problems(kind):
        with pytest.raises(AssertionError):
            check_formulation(apply, p, "mutant")


@pytest.mark.parametrize("fid", attnref.ids("softmax"))
def test_wrong_scale_is_caught_in_every_formulation(fid, monkeypatch):
    """1/sqrt(d_model) instead of 1/sqrt(d_k) (the pattern form's classic slip)."""
    original = COMMON.scale_value

    def wrong(d_k, scale, dtype):
        return original(SQUARE.d_model, scale, dtype)

    attnref.formulations()  # every formulation module loaded
    for name, mod in list(sys.modules.items()):  # wherever the scale is computed
        if name.startswith("attnref.") and hasattr(mod, "scale_value"):
            monkeypatch.setattr(mod, "scale_value", wrong)
    apply = attnref.get(fid).apply
    # A fresh jitted wrapper, traced here after the patch (no program compiled before it can
    # be reused), compiled once for the three problems of one shape: eager runs would compile
    # every primitive and re-trace the looped forms' control flow on each call.
    _caught(jax.jit(lambda *args, **kwargs: apply(*args, **kwargs)))


def test_transposed_w_o_is_caught():
    def transposed(params, x_q, x_kv=None, *, mask=None, bias=None, scale=None, residual=False):
        w_o = jnp.asarray(params.w_o).reshape(-1, params.d_model).T.reshape(params.w_o.shape)
        mutant = attnref.AttentionParams(
            params.w_q, params.w_k, params.w_v, w_o, params.b_q, params.b_k, params.b_v, params.b_o
        )
        return attnref.concat_attention(mutant, x_q, x_kv, mask=mask, bias=bias)

    _caught(transposed)


@pytest.mark.parametrize("shift", [1, -1])
def test_causal_mask_off_by_one_is_caught(shift):
    def off_by_one(params, x_q, x_kv=None, *, mask=None, bias=None, scale=None, residual=False):
        t = x_q.shape[-2]
        return attnref.concat_attention(
            params, x_q, x_kv, mask=np.tril(np.ones((t, t), bool), k=shift), bias=bias
        )

    _caught(off_by_one, kind="causal")


def test_unmutated_code_passes_the_same_problems():
    for p in _problems("combined") + _problems("causal"):
        check_formulation(attnref.concat_attention, p, "concat")


def _blockwise(q, k, v, **kw):
    """Eager blockwise form (module globals are looked up per call, so patches apply)."""
    return attnref.blockwise_dot_product_attention(q, k, v, block_q=2, block_k=3, **kw)


def test_broadcast_mask_padded_as_data_is_caught(monkeypatch):
    """Defect 1: padding a size-1 (broadcast) query axis of a ``[B, 1, 1, S]`` mask to whole
    tiles makes rows 1.. look fully masked."""

    def pad_every_axis(a, axis, size, value=0):
        widths = [(0, 0)] * a.ndim
        widths[axis] = (0, max(size - a.shape[axis], 0))
        return jnp.pad(a, widths, constant_values=value)

    monkeypatch.setattr(BLOCKWISE, "_pad_axis", pad_every_axis)
    # A fresh jitted wrapper, traced here after the patch: one compile, not every primitive
    # of the tiled form run eagerly.
    fn = jax.jit(lambda q, k, v, **kw: _blockwise(q, k, v, **kw), static_argnames=("return_lse",))
    with pytest.raises(AssertionError):
        check_broadcast_patterns(fn, ["B11S"])


@pytest.mark.parametrize("form", ["dot_product_attention", "blockwise"])
def test_nonfinite_leak_through_zero_times_nan_is_caught(form, monkeypatch):
    """Defect 3: contracting the raw operands (no finite parts, no poisoned rows) lets a value
    that only row 5 may read turn rows 0-4 and their gradients into NaN."""
    entry = inspect.getmodule(KERNEL.guard)  # the one guard every kernel goes through
    for module in (KERNEL, BLOCKWISE, entry):
        for name, identity in (("finite_part", lambda a: a), ("poison_rows", lambda d, v: v)):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, identity)
    kernel = attnref.dot_product_attention if form == "dot_product_attention" else _blockwise
    # A fresh jitted wrapper, traced here after the patch: one compiled forward (and backward)
    # for the clean call and the five poisoned ones, instead of every primitive run eagerly.
    fn = jax.jit(lambda q, k, v, **kw: kernel(q, k, v, **kw), static_argnames=("is_causal",))
    with pytest.raises(AssertionError):
        check_unread_nonfinite_values(fn)


def test_out_of_range_traced_lengths_read_as_valid_is_caught(monkeypatch):
    """Defect 5 (kernel part): under jit, a length above T must not act as "all valid"."""
    monkeypatch.setattr(KERNEL, "lengths_in_range", lambda spec, x: jnp.ones((spec.b,), bool))
    fn = jax.jit(
        lambda q, k, v, **kw: attnref.dot_product_attention(q, k, v, **kw),
        static_argnames=("return_lse",),
    )
    with pytest.raises(AssertionError):
        check_out_of_range_lengths(fn)


@pytest.mark.usefixtures("unchecked_annotations")  # checks attnref's own errors
def test_oracle_reading_a_float_mask_as_booleans_is_caught(monkeypatch):
    """Defect 4: an oracle that casts a float 0/-inf mask to booleans computes the inverted
    (anti-causal) result silently; the bad-input property refuses it in both twins."""
    from attnref.oracle import _checks

    def lenient(mask, bias, target, axes):
        m = None if mask is None else np.broadcast_to(np.asarray(mask).astype(bool), target)
        b = None if bias is None else np.broadcast_to(np.asarray(bias, np.float64), target)
        return m, b

    monkeypatch.setattr(_checks, "check_mask_and_bias", lenient)
    q = np.random.default_rng(0).standard_normal((1, 3, 1, 2))
    mask = np.where(np.tril(np.ones((3, 3))) > 0, 0.0, -np.inf)[None, None]
    fns = {"jax": attnref.dot_product_attention, "oracle": attnref.oracle.dot_product_attention}
    with pytest.raises(pytest.fail.Exception, match="accepted"):
        _assert_same_refusal(fns, dict(query=q, key=q, value=q, mask=mask), TypeError, "mask")


@settings(max_examples=1, database=None)
@given(st.just(3))
def test_weight_level_leak_is_caught(seed):
    """Defect 3 at the weight level: without the guard's finite parts, ``x_kv`` rows a query may
    not read reach it through ``0 * NaN`` (eager concat, so the patch is traced)."""
    p = ast.make_attention_problem(nf.BUCKET, "causal", seed, np.float64)
    pz = nf.poison(p, p.mask & (p.bias != -np.inf), seed + 1, np.nan, False)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(COMMON.Prepared, "finite", lambda self: self)
        with pytest.raises(AssertionError):
            nf._check_softmax(pz, 5, lambda fn: fn, ids=("concat",))


def test_softmax_without_max_subtraction_is_caught(monkeypatch):
    """Extreme logits: ``exp(s) / sum exp(s)`` without subtracting the row maximum overflows
    at |logit| ~ 1e2 in float32."""

    def naive_softmax(logits, mask=None, *, axis=-1):
        e = jnp.exp(logits)
        if mask is not None:
            e = jnp.where(mask, e, 0.0)
        return e / jnp.sum(e, axis=axis, keepdims=True)

    monkeypatch.setattr(STANDARD, "masked_softmax", naive_softmax)
    p = ext.make_extreme(ext.BUCKET, "none", 7, "float32", 1e3, "bias")
    with pytest.raises(AssertionError):
        ext.check_extreme_float32(p, {"concat": attnref.concat_attention})
