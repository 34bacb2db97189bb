"""Bad input is refused alike by the JAX functions and their float64 oracle twins; empty inputs
have one meaning in both.

Each bad-input class below is one defect applied to a valid, Hypothesis-drawn base problem. The
JAX function and its oracle twin must both raise, with the same exception type, and both messages
must name the offending argument. Every class is refused during validation, before any
computation, so these properties compile nothing.

Empty inputs: ``T = 0`` (no queries) gives an empty output; ``S = 0`` (no keys) leaves every query
row fully masked, so ``masked_rows`` decides (``"zeros"``: 0, ``"nan"``: NaN, ``lse = -inf``;
``"uniform"``, a mean over zero keys, is refused by both); at the weight level ``T_k = 0`` gives
zero weights and the output ``b_O``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import attnref
from attnref import oracle

# Fixed small shapes (nothing recompiles between examples): GQA with N = 2 query heads per
# K = 1 key/value head, T != S and H_v != H.
B, T, S, N, K, H, HV = 2, 3, 4, 2, 1, 4, 3
D_MODEL, HEADS, KV_HEADS, D_K, D_V = 8, 2, 1, 4, 3

Override = Callable[[dict[str, Any]], dict[str, Any]]


# Bad input on purpose: the runtime annotation checks are off here, so that what is tested is
# attnref's own error (the one users see); tests/conftest.py::unchecked_annotations.
pytestmark = pytest.mark.usefixtures("unchecked_annotations")


@st.composite
def kernel_base(draw: Any) -> dict[str, Any]:
    """A valid kernel call ``{query, key, value}`` (float32) with drawn values."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    return dict(
        query=rng.standard_normal((B, T, N, H)).astype(np.float32),
        key=rng.standard_normal((B, S, K, H)).astype(np.float32),
        value=rng.standard_normal((B, S, K, HV)).astype(np.float32),
    )


@st.composite
def weight_base(draw: Any) -> dict[str, Any]:
    """A valid weight-level call ``{params, x_q, x_kv}`` (float64, GQA, with biases)."""
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    params = attnref.init_params(
        seed,
        d_model=D_MODEL,
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        d_k=D_K,
        d_v=D_V,
        bias=True,
        dtype=np.float64,
    )
    return dict(
        params=params,
        x_q=rng.standard_normal((B, T, D_MODEL)),
        x_kv=rng.standard_normal((B, S, D_MODEL)),
    )


def _raised(fn: Callable[..., Any], kwargs: dict[str, Any]) -> BaseException:
    try:
        fn(**kwargs)
    except Exception as err:
        return err
    pytest.fail(f"{getattr(fn, '__module__', '')}.{getattr(fn, '__name__', fn)} accepted it")


def _assert_same_refusal(
    fns: dict[str, Callable[..., Any]],
    kwargs: dict[str, Any],
    exc: type[Exception],
    name: str,
) -> None:
    """Every function in ``fns`` raises exactly ``exc`` and names the argument ``name``."""
    for label, fn in fns.items():
        err = _raised(fn, dict(kwargs))
        assert type(err) is exc, f"{label} raised {type(err).__name__}: {err}"
        assert re.search(name, str(err)), f"{label} does not name {name!r}: {err}"


# ----------------------------------------------------------------------------- kernel level


def _mask(shape: tuple[int, ...], dtype: Any = bool) -> np.ndarray:
    return np.ones(shape, dtype)


def _kernel_classes() -> list[tuple[str, Override, type[Exception], str]]:
    causal = np.tril(np.ones((T, S), bool))[None, None]
    float_mask = np.where(causal, 0.0, -np.inf).astype(np.float32)  # additive 0/-inf "mask"
    return [
        ("mask float 0/-inf", lambda b: dict(mask=float_mask), TypeError, "mask"),
        ("mask int", lambda b: dict(mask=_mask((B, N, T, S), np.int32)), TypeError, "mask"),
        ("mask rank 3", lambda b: dict(mask=_mask((N, T, S))), ValueError, "mask"),
        (
            "mask not broadcastable",
            lambda b: dict(mask=_mask((B, 1, T, S + 1))),
            ValueError,
            "mask",
        ),
        ("mask grows batch", lambda b: dict(mask=_mask((B + 1, 1, T, S))), ValueError, "mask"),
        ("bias bool", lambda b: dict(bias=_mask((1, 1, T, S))), TypeError, "bias"),
        ("bias int", lambda b: dict(bias=_mask((1, 1, T, S), np.int32)), TypeError, "bias"),
        ("bias rank 2", lambda b: dict(bias=np.zeros((T, S), np.float32)), ValueError, "bias"),
        (
            "alignment bottom-right",
            lambda b: dict(causal_alignment="bottom-right", is_causal=True),
            ValueError,
            "causal_alignment",
        ),
        (
            "alignment case",
            lambda b: dict(causal_alignment="Top_Left"),
            ValueError,
            "causal_alignment",
        ),
        ("masked_rows Uniform", lambda b: dict(masked_rows="Uniform"), ValueError, "masked_rows"),
        ("masked_rows ZEROS", lambda b: dict(masked_rows="ZEROS"), ValueError, "masked_rows"),
        ("masked_rows NaN", lambda b: dict(masked_rows="NaN"), ValueError, "masked_rows"),
        ("masked_rows None", lambda b: dict(masked_rows=None), ValueError, "masked_rows"),
        ("is_causal string", lambda b: dict(is_causal="False"), TypeError, "is_causal"),
        (
            "K/V head count mismatch",
            lambda b: dict(value=np.concatenate([b["value"]] * 2, axis=2)),
            ValueError,
            "value",
        ),
        (
            "K = 0",
            lambda b: dict(key=b["key"][:, :, :0], value=b["value"][:, :, :0]),
            ValueError,
            "key",
        ),
        (
            "N not a multiple of K",
            lambda b: dict(
                key=np.concatenate([b["key"]] * 3, 2), value=np.concatenate([b["value"]] * 3, 2)
            ),
            ValueError,
            "query",
        ),
        (
            "head dim H = 0",
            lambda b: dict(query=b["query"][..., :0], key=b["key"][..., :0]),
            ValueError,
            "query",
        ),
        ("key head dim", lambda b: dict(key=b["key"][..., :2]), ValueError, "key"),
        ("query rank 3", lambda b: dict(query=b["query"][0]), ValueError, "query"),
        (
            "batch mismatch",
            lambda b: dict(key=b["key"][:1], value=b["value"][:1]),
            ValueError,
            "key",
        ),
        ("mixed dtypes", lambda b: dict(query=b["query"].astype(np.float64)), TypeError, "query"),
        (
            "integer query",
            lambda b: dict(query=np.ones((B, T, N, H), np.int32)),
            TypeError,
            "query",
        ),
        (
            "q lengths above T",
            lambda b: dict(query_seq_lengths=np.array([T + 1, 1])),
            ValueError,
            "query_seq_lengths",
        ),
        (
            "kv lengths above S",
            lambda b: dict(key_value_seq_lengths=np.array([1, S + 1])),
            ValueError,
            "key_value_seq_lengths",
        ),
        (
            "negative lengths",
            lambda b: dict(key_value_seq_lengths=np.array([-1, 2])),
            ValueError,
            "key_value_seq_lengths",
        ),
        (
            "fractional lengths",
            lambda b: dict(query_seq_lengths=np.array([1.5, 2.0])),
            TypeError,
            "query_seq_lengths",
        ),
        (
            "bool lengths",
            lambda b: dict(key_value_seq_lengths=np.array([True, True])),
            TypeError,
            "key_value_seq_lengths",
        ),
        (
            "lengths wrong shape",
            lambda b: dict(query_seq_lengths=np.array([1, 1, 1])),
            ValueError,
            "query_seq_lengths",
        ),
        ("window -1", lambda b: dict(local_window_size=-1), ValueError, "local_window_size"),
        (
            "window (-1, 2)",
            lambda b: dict(local_window_size=(-1, 2)),
            ValueError,
            "local_window_size",
        ),
        (
            "window triple",
            lambda b: dict(local_window_size=(1, 2, 3)),
            ValueError,
            "local_window_size",
        ),
        ("window float", lambda b: dict(local_window_size=2.0), TypeError, "local_window_size"),
        ("window bool", lambda b: dict(local_window_size=True), TypeError, "local_window_size"),
        (
            "window side float",
            lambda b: dict(local_window_size=(1, 0.5)),
            TypeError,
            "local_window_size",
        ),
        ("softcap 0", lambda b: dict(softcap=0.0), ValueError, "softcap"),
        ("softcap negative", lambda b: dict(softcap=-1.0), ValueError, "softcap"),
        ("softcap inf", lambda b: dict(softcap=float("inf")), ValueError, "softcap"),
        ("softcap nan", lambda b: dict(softcap=float("nan")), ValueError, "softcap"),
        ("softcap vector", lambda b: dict(softcap=np.ones(2)), ValueError, "softcap"),
        ("scale vector", lambda b: dict(scale=np.ones(2)), ValueError, "scale"),
        ("scale text", lambda b: dict(scale="0.5"), TypeError, "scale"),
        ("scale complex", lambda b: dict(scale=1j), TypeError, "scale"),
        (
            "segment ids need T == S",
            lambda b: dict(segment_ids=np.zeros((B, T), np.int32)),
            ValueError,
            "segment_ids",
        ),
        (
            "segment ids pair shape",
            lambda b: dict(
                segment_ids=(np.zeros((B, T), np.int32), np.zeros((B, S + 1), np.int32))
            ),
            ValueError,
            "key_value_segment_ids",
        ),
        (
            "segment ids float",
            lambda b: dict(segment_ids=(np.zeros((B, T)), np.zeros((B, S), np.int32))),
            TypeError,
            "query_segment_ids",
        ),
        (
            "segment ids triple",
            lambda b: dict(segment_ids=(np.zeros((B, T), np.int32),) * 3),
            ValueError,
            "segment_ids",
        ),
        (
            "S = 0 with uniform",
            lambda b: dict(key=b["key"][:, :0], value=b["value"][:, :0], masked_rows="uniform"),
            ValueError,
            "masked_rows",
        ),
    ]


KERNEL_CLASSES = _kernel_classes()
KERNEL_FNS: dict[str, Callable[..., Any]] = {
    "dot_product_attention": attnref.dot_product_attention,
    "blockwise_dot_product_attention": lambda **kw: attnref.blockwise_dot_product_attention(
        **kw, block_q=2, block_k=2
    ),
    "oracle.dot_product_attention": oracle.dot_product_attention,
}


@pytest.mark.parametrize(
    ("override", "exc", "name"),
    [c[1:] for c in KERNEL_CLASSES],
    ids=[c[0] for c in KERNEL_CLASSES],
)
@given(base=kernel_base())
def test_kernel_bad_input_refused_alike(base, override, exc, name):
    """Each bad-input class: the JAX kernels and the oracle raise the same type, naming it."""
    _assert_same_refusal(KERNEL_FNS, {**base, **override(base)}, exc, name)


def test_kernel_allowed_refuses_bad_options():
    """The oracle's allowed set checks its options like the kernel (no silent inversion)."""
    shape = (B, N, T, S)
    with pytest.raises(TypeError, match="mask must be boolean"):
        oracle.kernel_allowed(shape, mask=np.zeros((1, 1, T, S)))
    with pytest.raises(ValueError, match="causal_alignment"):
        oracle.kernel_allowed(shape, is_causal=True, causal_alignment="bottom-right")
    with pytest.raises(ValueError, match="shape must be four ints"):
        oracle.kernel_allowed((B, N, T))


# ----------------------------------------------------------------------------- weight level


def _replace(name: str, fn: Callable[[Any], Any]) -> Override:
    return lambda b: dict(params=dataclasses.replace(b["params"], **{name: fn(b["params"])}))


def _truncate_d_k(params: Any, d_k: int) -> Any:
    """The parameters with only the first ``d_k`` query/key features (biases too)."""
    return dataclasses.replace(
        params,
        w_q=params.w_q[..., :d_k],
        w_k=params.w_k[..., :d_k],
        b_q=params.b_q[:, :d_k],
        b_k=params.b_k[:, :d_k],
    )


def _weight_classes() -> list[tuple[str, Override, type[Exception], str]]:
    return [
        ("x_q d_model", lambda b: dict(x_q=b["x_q"][..., :-1]), ValueError, "x_q"),
        ("x_kv d_model", lambda b: dict(x_kv=b["x_kv"][..., :3]), ValueError, "x_kv"),
        ("x_q rank 1", lambda b: dict(x_q=b["x_q"][0, 0]), ValueError, "x_q"),
        ("batch mismatch", lambda b: dict(x_kv=b["x_kv"][:1]), ValueError, "x_kv"),
        ("x_q dtype", lambda b: dict(x_q=b["x_q"].astype(np.float32)), TypeError, "x_q"),
        ("w_q rank 2", _replace("w_q", lambda p: p.w_q[0]), ValueError, r"params\.w_q"),
        (
            "w_k head count",
            _replace("w_k", lambda p: np.concatenate([p.w_k] * 3)),
            ValueError,
            r"params\.w_k",
        ),
        (
            "w_v head count",
            _replace("w_v", lambda p: np.concatenate([p.w_v] * 2)),
            ValueError,
            r"params\.w_v",
        ),
        ("w_o shape", _replace("w_o", lambda p: p.w_o[:1]), ValueError, r"params\.w_o"),
        ("b_v shape", _replace("b_v", lambda p: p.b_v[:, :1]), ValueError, r"params\.b_v"),
        (
            "w_v dtype",
            _replace("w_v", lambda p: p.w_v.astype(np.float32)),
            TypeError,
            r"params\.w_v",
        ),
        (
            "d_k = 0",
            lambda b: dict(params=_truncate_d_k(b["params"], 0)),
            ValueError,
            r"params\.w_q",
        ),
        ("mask shape", lambda b: dict(mask=_mask((S, T))), ValueError, "mask"),
        ("mask rank 1", lambda b: dict(mask=_mask((S,))), ValueError, "mask"),
        ("mask grows batch", lambda b: dict(mask=_mask((3, B, T, S))), ValueError, "mask"),
        ("mask float", lambda b: dict(mask=np.zeros((T, S))), TypeError, "mask"),
        ("bias bool", lambda b: dict(bias=_mask((T, S))), TypeError, "bias"),
        ("bias shape", lambda b: dict(bias=np.zeros((B, T, T))), ValueError, "bias"),
        ("scale vector", lambda b: dict(scale=np.ones(2)), ValueError, "scale"),
        ("scale text", lambda b: dict(scale="1"), TypeError, "scale"),
    ]


WEIGHT_CLASSES = _weight_classes()
WEIGHT_PAIRS: dict[str, dict[str, Callable[..., Any]]] = {
    "attention": {"concat_attention": attnref.concat_attention, "oracle": oracle.attention},
    "weights": {"attention_weights": attnref.attention_weights, "oracle": oracle.attention_weights},
    "heads": {"head_outputs": attnref.head_outputs, "oracle": oracle.head_outputs},
    "rope": {"rope_attention": attnref.rope.rope_attention, "oracle": oracle.rope_attention},
}


@pytest.mark.parametrize("pair", sorted(WEIGHT_PAIRS))
@pytest.mark.parametrize(
    ("override", "exc", "name"),
    [c[1:] for c in WEIGHT_CLASSES],
    ids=[c[0] for c in WEIGHT_CLASSES],
)
@given(base=weight_base())
def test_weight_level_bad_input_refused_alike(base, override, exc, name, pair):
    """Each bad-input class at the weight level: JAX and the oracle raise the same type."""
    _assert_same_refusal(WEIGHT_PAIRS[pair], {**base, **override(base)}, exc, name)


ROPE_CLASSES: list[tuple[str, Override, type[Exception], str]] = [
    ("convention", lambda b: dict(convention="gptj"), ValueError, "convention"),
    ("base negative", lambda b: dict(base=-1.0), ValueError, "base"),
    ("base inf", lambda b: dict(base=float("inf")), ValueError, "base"),
    ("positions_q float", lambda b: dict(positions_q=np.arange(T) * 1.0), TypeError, "positions_q"),
    (
        "positions_kv length",
        lambda b: dict(positions_kv=np.arange(S + 1)),
        ValueError,
        "positions_kv",
    ),
    (
        "odd d_k",
        lambda b: dict(params=_truncate_d_k(b["params"], 3)),
        ValueError,
        "d_k",
    ),
]


@pytest.mark.parametrize(
    ("override", "exc", "name"), [c[1:] for c in ROPE_CLASSES], ids=[c[0] for c in ROPE_CLASSES]
)
@given(base=weight_base())
def test_rope_attention_bad_input_refused_alike(base, override, exc, name):
    _assert_same_refusal(WEIGHT_PAIRS["rope"], {**base, **override(base)}, exc, name)


APPLY_ROPE_CLASSES: list[tuple[str, dict[str, Any], type[Exception], str]] = [
    ("x rank 2", dict(x=np.zeros((T, H))), ValueError, "x"),
    ("x integer", dict(x=np.zeros((T, N, H), np.int32)), TypeError, "x"),
    ("odd head dim", dict(x=np.zeros((T, N, 3))), ValueError, "head_dim"),
    ("positions float", dict(positions=np.arange(T) * 1.0), TypeError, "positions"),
    ("positions length", dict(positions=np.arange(T + 1)), ValueError, "positions"),
    ("positions missing", dict(positions=None), TypeError, "positions"),
    ("convention", dict(convention="neox"), ValueError, "convention"),
    ("base zero", dict(base=0.0), ValueError, "base"),
]


@pytest.mark.parametrize(
    ("override", "exc", "name"),
    [c[1:] for c in APPLY_ROPE_CLASSES],
    ids=[c[0] for c in APPLY_ROPE_CLASSES],
)
def test_apply_rope_bad_input_refused_alike(override, exc, name):
    base = dict(x=np.ones((T, N, H)), positions=np.arange(T))
    fns = {"apply_rope": attnref.rope.apply_rope, "oracle.rope": oracle.rope}
    _assert_same_refusal(fns, {**base, **override}, exc, name)


# A non-bool ``causal`` (truthy or falsy) is a TypeError in every linear form and in the oracle,
# checked before the form's own causal/non-causal rule (never read as a truth value).
LINEAR_CAUSAL_CLASSES: list[tuple[str, Any]] = [
    ("causal 1", 1),
    ("causal 0", 0),
    ("causal text", "False"),
    ("causal None", None),
    ("causal array", np.array(True)),
]
LINEAR_FNS: dict[str, Callable[..., Any]] = {
    "oracle.linear_attention": oracle.linear_attention,
    **{
        name: getattr(attnref.linear, name)
        for name in (
            "linear_associative",
            "linear_quadratic",
            "linear_prefix_sum",
            "linear_recurrent",
            "linear_chunked",
        )
    },
}


@pytest.mark.parametrize("fid", sorted(LINEAR_FNS))
@pytest.mark.parametrize(
    "causal", [c[1] for c in LINEAR_CAUSAL_CLASSES], ids=[c[0] for c in LINEAR_CAUSAL_CLASSES]
)
def test_linear_causal_flag_refused_alike(causal, fid):
    kw: dict[str, Any] = {n: np.ones((B, T, N, H), np.float32) for n in ("q", "k", "v")}
    kw.update(feature_map=attnref.linear.elu_plus_one(), causal=causal)
    _assert_same_refusal({fid: LINEAR_FNS[fid]}, kw, TypeError, "causal")


# ----------------------------------------------------------------------------- empty inputs


@given(
    base=kernel_base(),
    sizes=st.sampled_from([(0, S), (T, 0), (0, 0)]),
    policy=st.sampled_from(["zeros", "nan", "uniform"]),
    is_causal=st.booleans(),
    with_lengths=st.booleans(),
)
def test_empty_kernel_inputs_have_one_meaning(base, sizes, policy, is_causal, with_lengths):
    """T = 0 or S = 0: the JAX kernel and the oracle agree exactly (shape, values, NaN, -inf);
    S = 0 with "uniform" is refused by both."""
    t, s = sizes
    kw: dict[str, Any] = dict(
        query=base["query"][:, :t],
        key=base["key"][:, :s],
        value=base["value"][:, :s],
        masked_rows=policy,
        is_causal=is_causal,
        return_lse=True,
    )
    if with_lengths:
        kw.update(query_seq_lengths=np.array([t, t // 2]), key_value_seq_lengths=np.array([s, 0]))
    if s == 0 and policy == "uniform":
        _assert_same_refusal(
            {"jax": attnref.dot_product_attention, "oracle": oracle.dot_product_attention},
            kw,
            ValueError,
            "masked_rows",
        )
        return
    out, lse = attnref.dot_product_attention(**kw)
    ref, ref_lse = oracle.dot_product_attention(**kw)
    assert out.shape == ref.shape == (B, t, N, HV)
    assert lse.shape == ref_lse.shape == (B, t, N)
    # No arithmetic happens on an empty key set: 0, NaN and -inf are exact in both.
    np.testing.assert_array_equal(np.asarray(out, np.float64), ref)
    np.testing.assert_array_equal(np.asarray(lse, np.float64), ref_lse)
    if s == 0 and t > 0:
        expect = np.nan if policy == "nan" else 0.0
        rows = ref[0] if not with_lengths else ref[0, :t]
        np.testing.assert_array_equal(rows, np.full_like(rows, expect))
        assert np.all(ref_lse == -np.inf)


@pytest.mark.parametrize("pair", ["attention", "weights", "heads"])
@given(base=weight_base(), sizes=st.sampled_from([(0, S), (T, 0), (0, 0)]))
def test_empty_tokens_have_one_meaning(base, sizes, pair):
    """T_q = 0 gives an empty output; T_k = 0 gives zero weights and the output ``b_O``; JAX and
    the oracle agree exactly (no arithmetic touches an empty key set except ``+ b_O``)."""
    t_q, t_k = sizes
    args = dict(params=base["params"], x_q=base["x_q"][:, :t_q], x_kv=base["x_kv"][:, :t_k])
    fn, ref_fn = WEIGHT_PAIRS[pair].values()
    got, ref = np.asarray(fn(**args)), ref_fn(**args)
    assert got.shape == ref.shape
    np.testing.assert_array_equal(got, ref)
    if pair == "attention" and t_q > 0:
        np.testing.assert_array_equal(ref, np.broadcast_to(base["params"].b_o, ref.shape))
