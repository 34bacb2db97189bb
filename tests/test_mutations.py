"""The agreement check must fail for wrong code: a wrong scale, a transposed W_O, and a causal
mask off by one. Each mutant runs through ``check_formulation``, the same check the property
tests apply to every registered formulation."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import attnref
from attnref._src import common

from .helpers import Bucket, check_formulation, make_problem

SQUARE = Bucket((2,), 5, 5, 2, 8, 4, 4)  # H * d_v == d_model, so a transposed W_O type-checks


def _problems(kind):
    return [make_problem(SQUARE, kind, seed, np.float32) for seed in range(3)]


def _caught(apply, kind="combined"):
    for p in _problems(kind):
        with pytest.raises(AssertionError):
            check_formulation(apply, p, "mutant")


@pytest.mark.parametrize("fid", attnref.ids("softmax"))
def test_wrong_scale_is_caught_in_every_formulation(fid, monkeypatch):
    """1/sqrt(d_model) instead of 1/sqrt(d_k) (the pattern form's classic slip)."""
    original = common.scale_value

    def wrong(d_k, scale, dtype):
        return original(SQUARE.d_model, scale, dtype)

    for module in ("standard", "merged", "column", "soft_search", "graph", "common", "kernel"):
        mod = __import__(f"attnref._src.{module}", fromlist=["x"])
        if hasattr(mod, "scale_value"):
            monkeypatch.setattr(mod, "scale_value", wrong)
    _caught(attnref.get(fid).apply)


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
