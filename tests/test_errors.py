"""Bad input raises a clear error naming the argument and its shape, at trace time (jit too)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attnref
from attnref import strategies as ast

P = ast.make_attention_problem(ast.WEIGHT_BUCKETS[1], "none", seed=0, dtype=np.float64)
B, TQ, TK, D = (2,), 5, 7, 8


# Bad input on purpose: the runtime annotation checks are off here, so that what is tested is
# attnref's own error (the one users see); tests/conftest.py::unchecked_annotations.
pytestmark = pytest.mark.usefixtures("unchecked_annotations")


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


# ----------------------------------------------------------------------------- native entry points
# Bad input to the entry points outside the registry (KV cache, soft search, graph edge lists,
# linear attention, composition): each case is refused with a clear error naming the argument,
# eagerly and, where the function can be jitted, at trace time under jax.jit.


@dataclasses.dataclass(frozen=True)
class NativeCase:
    """``fn(**static, **arrays)`` raises ``exc`` matching ``pattern``; under jit the ``arrays``
    are traced (``static`` is bound first). ``jit=False``: a function with static-only inputs."""

    id: str
    fn: Callable[..., Any]
    arrays: dict[str, Any]
    exc: type[Exception]
    pattern: str
    static: dict[str, Any] = dataclasses.field(default_factory=dict)
    jit: bool = True


def _native_cases() -> list[NativeCase]:
    dec = attnref.decode
    cache = dec.kv_cache_init(2, 4, 1, 3, dtype=jnp.float32)
    chunk = np.zeros((2, 2, 1, 3), np.float32)  # [B, L, K, H]
    params32 = attnref.init_params(0, d_model=D, num_heads=2, d_k=4, d_v=3, dtype=np.float32)
    xs, xr = P.x_kv[0], P.x_q[0]
    s, r = np.array([0, 1, 2]), np.array([0, 0, 1])
    graph = dict(params=P.params, x_senders=xs, x_receivers=xr)
    qkv = {n: np.ones((1, 4, 2, 3), np.float32) for n in ("q", "k", "v")}  # [B, T, H, d]
    fm = dict(feature_map=attnref.linear.elu_plus_one())
    other = attnref.init_params(1, d_model=D - 2, num_heads=2, d_k=4, dtype=np.float64)
    return [
        NativeCase(
            "cache_attend q rank 1",
            dec.cache_attend,
            dict(cache=cache, q=np.zeros((3,), np.float32)),
            ValueError,
            r"q has shape \(3,\); expected \[B=2, L, N, H=3\]",
        ),
        NativeCase(
            "cache_attend q rank 0",
            dec.cache_attend,
            dict(cache=cache, q=np.float32(0.0)),
            ValueError,
            r"q has shape \(\)",
        ),
        NativeCase(
            "soft_search mask int",
            attnref.soft_search,
            dict(params=P.params, x_q=P.x_q[0, 0], x_kv=xs, mask=np.ones(TK, np.int32)),
            TypeError,
            r"mask must be boolean.*int32",
        ),
        NativeCase(
            "soft_search mask float",
            attnref.soft_search,
            dict(params=P.params, x_q=P.x_q[0, 0], x_kv=xs, mask=np.zeros(TK)),
            TypeError,
            r"mask must be boolean.*float64",
        ),
        NativeCase(
            "soft_search bias bool",
            attnref.soft_search,
            dict(params=P.params, x_q=P.x_q[0, 0], x_kv=xs, bias=np.ones(TK, bool)),
            TypeError,
            r"bias must be floating, got dtype bool",
        ),
        NativeCase(
            "soft_search_attention mask int",
            attnref.soft_search_attention,
            dict(params=P.params, x_q=P.x_q, x_kv=P.x_kv, mask=np.ones((TQ, TK), np.int32)),
            TypeError,
            r"mask must be boolean.*int32",
        ),
        NativeCase(
            "graph edge_bias bool",
            attnref.graph_message_passing,
            dict(**graph, senders=s, receivers=r, edge_bias=np.ones(3, bool)),
            TypeError,
            r"edge_bias must be floating, got dtype bool",
        ),
        NativeCase(
            "graph edge_bias int",
            attnref.graph_message_passing,
            dict(**graph, senders=s, receivers=r, edge_bias=np.zeros(3, np.int32)),
            TypeError,
            r"edge_bias must be floating, got dtype int32",
        ),
        # Concrete index values are checked whatever their array type (traced ones: see
        # test_graph_traced_indices_out_of_range_are_nan_or_checked).
        NativeCase(
            "graph senders jax array out of range",
            attnref.graph_message_passing,
            dict(**graph, senders=jnp.array([0, 9, 2]), receivers=r),
            ValueError,
            r"senders has indices outside \[0, 7\): min 0, max 9",
            jit=False,
        ),
        NativeCase(
            "graph receivers jax array negative",
            attnref.graph_message_passing,
            dict(**graph, senders=s, receivers=jnp.array([0, -1, 1])),
            ValueError,
            r"receivers has indices outside \[0, 5\): min -1, max 1",
            jit=False,
        ),
        NativeCase(
            "graph senders list out of range",
            attnref.graph_message_passing,
            dict(**graph, senders=[0, 7, 2], receivers=r),
            ValueError,
            r"senders has indices outside \[0, 7\)",
            jit=False,
        ),
        NativeCase(
            "kv_cache_init head_dim_v 0",
            dec.kv_cache_init,
            dict(batch=2, capacity=4, num_kv_heads=1, head_dim=3, head_dim_v=0),
            ValueError,
            r"head_dim_v must be a positive int, got 0",
            jit=False,
        ),
        NativeCase(
            "kv_cache_init head_dim_v float",
            dec.kv_cache_init,
            dict(batch=2, capacity=4, num_kv_heads=1, head_dim=3, head_dim_v=2.5),
            ValueError,
            r"head_dim_v must be a positive int, got 2\.5",
            jit=False,
        ),
        NativeCase(
            "kv_cache_init batch bool",
            dec.kv_cache_init,
            dict(batch=True, capacity=4, num_kv_heads=1, head_dim=3),
            ValueError,
            r"batch must be a positive int, got True",
            jit=False,
        ),
        NativeCase(
            "kv_cache_append valid int",
            dec.kv_cache_append,
            dict(cache=cache, k=chunk, v=chunk, valid=np.ones((2, 2), np.int32)),
            TypeError,
            r"valid must be boolean.*int32",
        ),
        NativeCase(
            "cached_attention valid float",
            dec.cached_attention,
            dict(cache=cache, q=chunk, k=chunk, v=chunk, valid=np.ones((2, 2), np.float32)),
            TypeError,
            r"valid must be boolean.*float32",
        ),
        NativeCase(
            "scan valid int",
            dec.scan,
            dict(
                params=params32,
                cache=dec.init_cache(params32, 2, 6),
                xs=np.zeros((2, 3, D), np.float32),
                valid=np.ones((2, 3), np.int32),
            ),
            TypeError,
            r"valid must be boolean.*int32",
        ),
        NativeCase(
            "linear_associative causal 1",
            attnref.linear.linear_associative,
            dict(**qkv, causal=1),
            TypeError,
            r"causal must be a Python bool, got (int|\w*Tracer)",
            static=fm,
        ),
        NativeCase(
            "linear_associative causal text",
            attnref.linear.linear_associative,
            dict(**qkv),
            TypeError,
            r"causal must be a Python bool, got str",
            static=dict(**fm, causal="False"),
        ),
        NativeCase(
            "linear_prefix_sum causal 0",
            attnref.linear.linear_prefix_sum,
            dict(**qkv, causal=0),
            TypeError,
            r"causal must be a Python bool, got (int|\w*Tracer)",
            static=fm,
        ),
        NativeCase(
            "composition_baseline d_model mismatch",
            attnref.interp.composition_baseline,
            dict(first=P.params, second=other, kind="q", seeds=1),
            ValueError,
            r"different d_model \(8 and 6\)",
            jit=False,
        ),
    ]


NATIVE_CASES = _native_cases()
NATIVE_RUNS = [(c, jit) for c in NATIVE_CASES for jit in ((False, True) if c.jit else (False,))]


@pytest.mark.parametrize(
    ("case", "jit"),
    NATIVE_RUNS,
    ids=[f"{c.id}-{'jit' if jit else 'nojit'}" for c, jit in NATIVE_RUNS],
)
def test_native_bad_input_raises_clearly(case, jit):
    f = functools.partial(case.fn, **case.static)
    if jit:
        f = jax.jit(f)
    with pytest.raises(case.exc, match=case.pattern):
        f(**case.arrays)


def test_graph_traced_indices_out_of_range_are_nan_or_checked():
    """Traced indices cannot be checked at trace time, and JAX gathers clamp an out-of-range
    index: unchecked the output is all NaN (never the clamped, plausible number); under
    attnref.checked it raises. Concrete indices inside jit (closed over) raise at trace time."""
    xs, xr = P.x_kv[0], P.x_q[0]
    f = jax.jit(attnref.graph_message_passing)
    s, r = np.array([0, 1, 2]), np.array([0, 0, 1])
    good = np.asarray(f(P.params, xs, xr, s, r))
    assert np.all(np.isfinite(good))
    np.testing.assert_array_equal(np.asarray(attnref.checked(f)(P.params, xs, xr, s, r)), good)
    for senders, receivers, pattern in (
        (np.array([0, 7, 2]), r, r"senders has indices outside \[0, 7\): min 0, max 7"),
        (s, np.array([0, -1, 1]), r"receivers has indices outside \[0, 5\): min -1, max 1"),
    ):
        out = np.asarray(f(P.params, xs, xr, senders, receivers))
        assert out.shape == good.shape and np.all(np.isnan(out))
        with pytest.raises(ValueError, match=pattern):  # checkify.JaxRuntimeError is one
            attnref.checked(f)(P.params, xs, xr, senders, receivers)
    closed = jax.jit(lambda a, b: attnref.graph_message_passing(P.params, a, b, [0, 9, 2], r))
    with pytest.raises(ValueError, match=r"senders has indices outside \[0, 7\)"):
        closed(xs, xr)


def test_kv_cache_init_accepts_numpy_ints():
    """NumPy integer sizes (e.g. from array shapes) are valid: the same cache as Python ints."""
    got = attnref.decode.kv_cache_init(
        np.int64(2), np.int32(4), np.int64(1), np.int64(3), np.int64(2), window=np.int64(3)
    )
    want = attnref.decode.kv_cache_init(2, 4, 1, 3, 2, window=3)
    assert got.window == want.window == 3 and type(got.window) is int
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
