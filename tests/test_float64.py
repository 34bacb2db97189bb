"""float64 means float64: with x64 off, float64 inputs are still computed in float64."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import attnref
from attnref import strategies as ast
from attnref.testing import assert_within_bound

from .helpers import expected

BUCKETS = ast.WEIGHT_BUCKETS


@pytest.mark.parametrize("fid", attnref.ids("softmax"))
def test_float64_inputs_compute_in_float64_with_x64_off(fid):
    p = ast.make_attention_problem(BUCKETS[1], "combined", seed=2, dtype=np.float64)
    ref, bound = expected(p)
    with jax.enable_x64(False):
        assert not jax.config.jax_enable_x64
        y = attnref.get(fid).apply(p.params, p.x_q, p.x_kv, **p.inputs())
        assert y.dtype == np.float64
    # float64 accuracy, not float32: the float64 bound is ~1e-13 relative, float32 error ~1e-7.
    assert_within_bound(y, ref, bound, label=fid)


def test_float32_inputs_stay_float32_and_merged_matrices_keep_float64():
    p = ast.make_attention_problem(BUCKETS[0], "none", seed=3, dtype=np.float32)
    with jax.enable_x64(False):
        assert attnref.concat_attention(p.params, p.x_q).dtype == np.float32
        p64 = p.params.astype(np.float64)
        for fn in (attnref.interp.w_p, attnref.interp.w_m, attnref.interp.w_a, attnref.interp.w_i):
            assert fn(p64).dtype == np.float64, fn.__name__
        assert attnref.attention_weights(p64, p.x_q.astype(np.float64)).dtype == np.float64


@pytest.mark.parametrize("fid", attnref.ids("linear"))
def test_linear_family_float64_with_x64_off_and_float32_stays_float32(fid):
    f = attnref.get(fid)
    causal = f.causal_modes[0]
    p = ast.make_attention_problem(BUCKETS[1], "none", seed=4, dtype=np.float64)
    x_kv = p.x_q if causal else p.x_kv
    fm = attnref.linear.favor_plus(0, BUCKETS[1].d_k, 8)  # omega is float64 NumPy in both cases
    kw = dict(feature_map=fm, causal=causal)
    with jax.enable_x64(False):
        y64 = f.apply(p.params, p.x_q, x_kv, **kw)
        y32 = f.apply(
            p.params.astype(np.float32), p.x_q.astype(np.float32), x_kv.astype(np.float32), **kw
        )
    assert y64.dtype == np.float64 and y32.dtype == np.float32
    ref = attnref.oracle.linear_multihead(p.params, p.x_q, x_kv, **kw)
    bound = attnref.tolerance.linear_multihead_error_bound(
        p.params, p.x_q, x_kv, dtype=np.float64, **kw
    )
    assert_within_bound(y64, ref, bound, label=fid)
