"""Every registered formulation equals the float64 oracle and every other formulation.

Jit and no-jit via chex variants; float32 and float64 against the derived componentwise bound
(:mod:`attnref.tolerance`); float16 and bfloat16 against FlashAttention's comparative rule with
a same-precision reference (the oracle with every intermediate rounded to the format).
"""

from __future__ import annotations

import chex
import jax.numpy as jnp
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

import attnref
from attnref import oracle, tolerance
from attnref import strategies as ast
from attnref.testing import assert_comparative, assert_within_bound

from .helpers import check_formulation, expected, problems, scaled

BUCKETS = ast.WEIGHT_BUCKETS

IDS = attnref.ids("softmax")


def _check_agreement(problem, variant):
    outputs = {}
    for f in attnref.formulations("softmax"):
        outputs[f.id] = check_formulation(variant(f.apply), problem, f.id)
    # Pairwise: each is within its bound of the oracle, so two differ by at most 2 bounds.
    _, bound = expected(problem)
    first = outputs[IDS[0]]
    for fid, y in outputs.items():
        assert_within_bound(y, first, 2 * bound, label=f"{fid} vs {IDS[0]}")


class AgreementTest(chex.TestCase):
    @chex.variants(with_jit=True)
    @given(problem=problems(dtypes=("float32",)))
    def test_every_formulation_matches_oracle_and_each_other(self, problem):
        """Every bucket in float32 under jit (float64: the eager variant below, and every
        formulation's float64 path in tests/test_float64.py)."""
        _check_agreement(problem, self.variant)

    @chex.variants(without_jit=True)
    @scaled(0.4)
    @given(problem=problems(buckets=BUCKETS[1:2], dtypes=("float64",)))
    def test_every_formulation_matches_oracle_eagerly(self, problem):
        """The same property without jit, on the cross-attention bucket (batch dims, T_q != T_k,
        d_k != d_v) in float64: eager execution compiles every primitive per shape and dtype,
        and float32 runs through the same code (the jit variant covers both dtypes)."""
        _check_agreement(problem, self.variant)


def test_residual_form():
    """``residual=True`` returns ``x_q + sum_i o_i`` for every formulation (with biases: the
    residual add is the same code with or without them)."""
    for with_bias in (True,):
        p = ast.make_attention_problem(
            BUCKETS[2], "causal", seed=21, dtype=np.float64, param_bias=with_bias
        )
        ref = oracle.attention(p.params, p.x_q, p.x_kv, residual=True, **p.inputs())
        bound = attnref.tolerance.attention_error_bound(
            p.params, p.x_q, p.x_kv, residual=True, dtype=p.dtype, **p.inputs()
        )
        for f in attnref.formulations("softmax"):
            y = f.jit()(p.params, p.x_q, p.x_kv, residual=True, **p.inputs())
            assert_within_bound(y, ref, bound, label=f"{f.id} residual, biases={with_bias}")


class LowPrecisionTest(chex.TestCase):
    @chex.variants(with_jit=True)
    @scaled(0.4)
    @given(problem=problems(dtypes=("float16", "bfloat16"), buckets=BUCKETS[1:2]))
    def test_16bit_formats_meet_flashattention_rule(self, problem):
        p = problem
        dt = jnp.bfloat16 if p.dtype.itemsize == 2 and p.dtype.name == "bfloat16" else p.dtype
        ref64 = oracle.attention(p.params, p.x_q, p.x_kv, **p.inputs())
        same = oracle.attention(p.params, p.x_q, p.x_kv, emulate=dt, **p.inputs())
        for f in attnref.formulations("softmax"):
            y = np.asarray(self.variant(f.apply)(p.params, p.x_q, p.x_kv, **p.inputs()))
            assert y.dtype == p.dtype, f"{f.id} computed in {y.dtype}"
            assert_comparative(
                y, ref64, same, dtype=dt, floor_n=tolerance.K_Y, label=f"{f.id} {p.dtype}"
            )


def test_default_arguments_self_attention_and_none_masks():
    """``x_kv=None`` means self-attention and ``mask=None``/``bias=None`` mean unmasked."""
    p = ast.make_attention_problem(BUCKETS[2], "none", seed=3, dtype=np.float64)
    ref = oracle.attention(p.params, p.x_q)
    bound = attnref.tolerance.attention_error_bound(p.params, p.x_q, dtype=np.float64)
    for f in attnref.formulations("softmax"):
        assert_within_bound(f.jit()(p.params, p.x_q), ref, bound, label=f.id)


def test_unexpanded_masks_broadcast_as_documented():
    """A [T_q, T_k] causal mask and a [B, 1, T_k] padding mask broadcast over batch and queries."""
    b = BUCKETS[1]
    p = ast.make_attention_problem(b, "none", seed=5, dtype=np.float64)
    causal = np.asarray(attnref.causal_mask(b.t, b.s))
    pad = np.asarray(attnref.padding_mask(np.array([3, 7]), b.s))
    mask = np.asarray(attnref.combine_masks(causal, pad))
    full = np.broadcast_to(mask, (*b.batch, b.t, b.s))
    ref = oracle.attention(p.params, p.x_q, p.x_kv, mask=full)
    bound = attnref.tolerance.attention_error_bound(
        p.params, p.x_q, p.x_kv, mask=full, dtype=np.float64
    )
    for f in attnref.formulations("softmax"):
        assert_within_bound(f.apply(p.params, p.x_q, p.x_kv, mask=mask), ref, bound, label=f.id)


# Every rank >= 2 shape that broadcasts to [B, T_q, T_k] = [2, 5, 7] (BUCKETS[1]): the batch
# axis absent, 1 or full, and each token axis 1 or full.
WEIGHT_BROADCAST = tuple(
    (*lead, tq, tk) for lead in ((), (1,), (2,)) for tq in (1, 5) for tk in (1, 7)
)
_SOFTMAX_AND_ROPE = (*IDS, *attnref.ids("rope"))


@scaled(0.5)
@given(
    fid=st.sampled_from(_SOFTMAX_AND_ROPE),
    mask_shape=st.sampled_from(WEIGHT_BROADCAST),
    bias_shape=st.sampled_from(WEIGHT_BROADCAST),
    seed=st.integers(0, 2**31 - 1),
)
def test_every_broadcast_shape_of_mask_and_bias(fid, mask_shape, bias_shape, seed):
    """A mask and a bias of any shape that broadcasts to ``[..., T_q, T_k]`` act as their
    broadcast: the formulation (drawn; one compile per example) equals the oracle given the
    expanded arrays, within the derived bound of the expanded problem."""
    b = BUCKETS[1]
    p = ast.make_attention_problem(b, "none", seed=seed % 1000, dtype=np.float64)
    rng = np.random.default_rng(seed)
    mask, bias = rng.random(mask_shape) < 0.7, rng.standard_normal(bias_shape)
    full = (*b.batch, b.t, b.s)
    kw = dict(mask=np.broadcast_to(mask, full), bias=np.broadcast_to(bias, full))
    f = attnref.get(fid)
    y = f.jit()(p.params, p.x_q, p.x_kv, mask=mask, bias=bias)
    ref = f.family.oracle(p.params, p.x_q, p.x_kv, **kw)
    bound = f.family.bound(p.params, p.x_q, p.x_kv, dtype=np.float64, **kw)
    assert_within_bound(y, ref, bound, label=f"{fid} mask {mask_shape} bias {bias_shape}")


def test_explicit_scale_is_used():
    """``scale=`` replaces 1/sqrt(d_k) everywhere (checked against the oracle with that scale)."""
    p = ast.make_attention_problem(BUCKETS[1], "causal", seed=11, dtype=np.float64)
    ref = oracle.attention(p.params, p.x_q, p.x_kv, scale=0.3, **p.inputs())
    bound = attnref.tolerance.attention_error_bound(
        p.params, p.x_q, p.x_kv, scale=0.3, dtype=np.float64, **p.inputs()
    )
    for f in attnref.formulations("softmax"):
        y = f.apply(p.params, p.x_q, p.x_kv, scale=0.3, **p.inputs())
        assert_within_bound(y, ref, bound, label=f.id)
