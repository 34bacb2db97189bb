"""Bad input raises a clear error naming the argument and its shape, at trace time (jit too)."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

import attnref
from attnref import strategies as ast

P = ast.make_attention_problem(ast.WEIGHT_BUCKETS[1], "none", seed=0, dtype=np.float64)
B, TQ, TK, D = (2,), 5, 7, 8


def _cases():
    p = P
    w = p.params
    yield (
        "x_q feature size",
        dict(x_q=np.zeros((2, TQ, D + 1))),
        ValueError,
        r"x_q has shape \(2, 5, 9\)",
    )
    yield (
        "x_kv feature size",
        dict(x_kv=np.zeros((2, TK, 3))),
        ValueError,
        r"x_kv has shape \(2, 7, 3\)",
    )
    yield "x_q rank", dict(x_q=np.zeros((D,))), ValueError, r"x_q must have rank >= 2.*\(8,\)"
    yield (
        "batch mismatch",
        dict(x_kv=np.zeros((3, TK, D))),
        ValueError,
        r"batch shape \(2,\).*\(3,\)",
    )
    yield (
        "w_k head count",
        dict(params=dataclasses.replace(w, w_k=w.w_k[:1])),
        ValueError,
        r"params\.w_k has shape \(1, 8, 4\)",
    )
    yield (
        "w_o head count",
        dict(params=dataclasses.replace(w, w_o=w.w_o[:1])),
        ValueError,
        r"params\.w_o has shape \(1, 3, 8\)",
    )
    yield (
        "w_q rank",
        dict(params=dataclasses.replace(w, w_q=w.w_q[0])),
        ValueError,
        r"params\.w_q must have rank 3.*\(8, 4\)",
    )
    yield (
        "b_v shape",
        dict(params=dataclasses.replace(w, b_v=w.b_v[:, :1])),
        ValueError,
        r"params\.b_v has shape \(2, 1\)",
    )
    yield (
        "mask shape",
        dict(mask=np.ones((TK, TQ), bool)),
        ValueError,
        r"mask has shape \(7, 5\).*\(2, 5, 7\)",
    )
    yield (
        "mask grows batch",
        dict(mask=np.ones((3, 2, TQ, TK), bool)),
        ValueError,
        r"mask has shape \(3, 2, 5, 7\)",
    )
    yield (
        "mask rank",
        dict(mask=np.ones((TK,), bool)),
        ValueError,
        r"mask must have rank >= 2.*\(7,\)",
    )
    yield "mask dtype", dict(mask=np.ones((TQ, TK))), TypeError, r"mask must be boolean.*float64"
    yield "bias shape", dict(bias=np.zeros((2, TQ, TQ))), ValueError, r"bias has shape \(2, 5, 5\)"
    yield "bias dtype", dict(bias=np.zeros((TQ, TK), bool)), TypeError, r"bias must be floating"
    yield (
        "mixed dtypes",
        dict(x_q=p.x_q.astype(np.float32)),
        TypeError,
        r"x_q has dtype float32 but params\.w_q has dtype float64",
    )
    yield (
        "mixed param dtypes",
        dict(params=dataclasses.replace(w, w_v=w.w_v.astype(np.float32))),
        TypeError,
        r"params\.w_v has dtype float32",
    )
    yield "scale shape", dict(scale=np.ones(2)), ValueError, r"scale must be a scalar"


CASES = list(_cases())


@pytest.mark.parametrize("jit", [False, True], ids=["nojit", "jit"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("fid", attnref.ids("softmax"))
def test_bad_input_raises_clearly(fid, case, jit):
    _, override, exc, pattern = case
    args = dict(params=P.params, x_q=P.x_q, x_kv=P.x_kv, mask=None, bias=None, scale=None)
    args.update(override)
    f = attnref.get(fid).apply
    if jit:
        f = jax.jit(f)
    with pytest.raises(exc, match=pattern):
        f(args.pop("params"), args.pop("x_q"), args.pop("x_kv"), **args)


def test_column_native_names_its_layout():
    x = np.swapaxes(P.x_q, -1, -2)
    with pytest.raises(ValueError, match=r"mask has shape \(2, 5, 7\).*\[\.\.\., T_k, T_q\]"):
        attnref.column_form(
            P.params, x, np.swapaxes(P.x_kv, -1, -2), mask=np.ones((2, TQ, TK), bool)
        )
    with pytest.raises(ValueError, match=r"x has shape \(2, 4, 8\).*\[\.\.\., d_model, T\]"):
        attnref.column_form(P.params, np.zeros((2, 4, D)))  # row layout given to column form


def test_graph_native_checks_edges():
    xs, xr = P.x_kv[0], P.x_q[0]
    s, r = np.array([0, 1, 2]), np.array([0, 0, 1])
    with pytest.raises(ValueError, match=r"receivers has shape \(2,\)"):
        attnref.graph_message_passing(P.params, xs, xr, s, r[:2])
    with pytest.raises(ValueError, match=r"senders has indices outside \[0, 7\)"):
        attnref.graph_message_passing(P.params, xs, xr, np.array([0, 9, 2]), r)
    with pytest.raises(ValueError, match=r"edge_mask must have shape \(3,\)"):
        attnref.graph_message_passing(P.params, xs, xr, s, r, edge_mask=np.ones(4, bool))
    with pytest.raises(TypeError, match=r"senders must be integer"):
        attnref.graph_message_passing(P.params, xs, xr, s.astype(float), r)


def test_soft_search_native_checks_one_query():
    with pytest.raises(ValueError, match=r"x_q must be one query of shape \(8,\)"):
        attnref.soft_search(P.params, P.x_q[0], P.x_kv[0])
    with pytest.raises(ValueError, match=r"mask must have shape \(7,\)"):
        attnref.soft_search(P.params, P.x_q[0, 0], P.x_kv[0], mask=np.ones((1, 7), bool))


def test_converters_reject_bad_layouts():
    with pytest.raises(ValueError, match="head_dim = embed_dim / num_heads"):
        attnref.interop.to_torch_mha(P.params)  # d_k=4, d_v=3
    with pytest.raises(KeyError, match="in_proj_weight"):
        attnref.interop.from_torch_mha({}, num_heads=2)
    with pytest.raises(ValueError, match="not divisible by num_heads=3"):
        attnref.interop.from_hf_bert(attnref.interop.to_hf_bert(P.params), num_heads=3)
    with pytest.raises(ValueError, match="d_k must be a positive integer"):
        attnref.init_params(0, d_model=4, num_heads=1, d_k=0)
