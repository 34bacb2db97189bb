"""The native signatures of the non-row formulations, checked directly against the oracle:
the graph form on a sparse edge list (only the present edges), one query at a time, and the
column form with its transposed masks."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

import attnref
from attnref import oracle, tolerance
from attnref import strategies as ast
from attnref.testing import assert_within_bound

from .helpers import scaled

BUCKETS = ast.WEIGHT_BUCKETS


@scaled(0.15)
@given(seed=st.integers(0, 2**31 - 1), kind=st.sampled_from(("random", "fully_masked_row")))
def test_graph_on_sparse_edge_list_equals_masked_attention(seed, kind):
    """Only the adjacency's edges are passed; receivers without edges get b_O."""
    p = ast.make_attention_problem(BUCKETS[1], kind, seed, np.float64)
    mask, bias = p.mask[0], p.bias[0]
    senders, receivers = attnref.edges_from_mask(mask)
    assert len(senders) == mask.sum()
    y = attnref.graph_message_passing(
        p.params, p.x_kv[0], p.x_q[0], senders, receivers, edge_bias=bias[receivers, senders]
    )
    ref = oracle.attention(p.params, p.x_q[0], p.x_kv[0], mask=mask, bias=bias)
    bound = tolerance.attention_error_bound(
        p.params, p.x_q[0], p.x_kv[0], mask=mask, bias=bias, dtype=np.float64
    )
    assert_within_bound(y, ref, bound)


def test_graph_edge_order_does_not_matter():
    p = ast.make_attention_problem(BUCKETS[1], "random", 3, np.float64)
    senders, receivers = attnref.edges_from_mask(p.mask[0])
    perm = np.random.default_rng(0).permutation(len(senders))
    a = attnref.graph_message_passing(p.params, p.x_kv[0], p.x_q[0], senders, receivers)
    b = attnref.graph_message_passing(p.params, p.x_kv[0], p.x_q[0], senders[perm], receivers[perm])
    bound = tolerance.attention_error_bound(
        p.params, p.x_q[0], p.x_kv[0], mask=p.mask[0], dtype=np.float64
    )
    assert_within_bound(a, b, 2 * bound)


@scaled(0.5)
@given(seed=st.integers(0, 2**31 - 1))
def test_soft_search_one_query_equals_oracle_row(seed):
    p = ast.make_attention_problem(BUCKETS[1], "combined", seed, np.float64)
    t = np.random.default_rng(seed).integers(p.config.t)
    y = attnref.soft_search(p.params, p.x_q[0, t], p.x_kv[0], mask=p.mask[0, t], bias=p.bias[0, t])
    ref = oracle.attention(p.params, p.x_q[0], p.x_kv[0], mask=p.mask[0], bias=p.bias[0])
    bound = tolerance.attention_error_bound(
        p.params, p.x_q[0], p.x_kv[0], mask=p.mask[0], bias=p.bias[0], dtype=np.float64
    )
    assert_within_bound(y, ref[t], bound[t])


def test_column_form_native_layout():
    """Column inputs d_model x T and masks M[j, i]; outputs are the transposed row outputs."""
    p = ast.make_attention_problem(BUCKETS[2], "combined", 5, np.float64)
    xc, xkvc = np.swapaxes(p.x_q, -1, -2), np.swapaxes(p.x_kv, -1, -2)
    y = attnref.column_form(
        p.params, xc, xkvc, mask=np.swapaxes(p.mask, -1, -2), bias=np.swapaxes(p.bias, -1, -2)
    )
    assert y.shape == (*p.config.batch, p.config.d_model, p.config.t)
    ref = oracle.attention(p.params, p.x_q, p.x_kv, **p.inputs())
    bound = tolerance.attention_error_bound(p.params, p.x_q, p.x_kv, dtype=np.float64, **p.inputs())
    assert_within_bound(np.swapaxes(np.asarray(y), -1, -2), ref, bound)
