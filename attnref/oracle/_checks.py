"""Input validation of the float64 oracle, NumPy only (never JAX), shared with the JAX twins.

Every refusal is ``ValueError`` (bad shape or value) or ``TypeError`` (bad dtype or kind), naming
the argument; nothing converts silently (a float mask, a fractional length, a misspelt policy are
refused). ``T = 0`` gives an empty output; ``S = 0`` masks every row (``"uniform"`` is refused);
a head dimension of 0 is refused (the default scale ``1/sqrt(H)`` is undefined).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

POLICIES = ("zeros", "uniform", "nan")
ALIGNMENTS = ("top_left", "bottom_right")
PARAM_WEIGHTS = ("w_q", "w_k", "w_v", "w_o")
PARAM_BIASES = ("b_q", "b_k", "b_v", "b_o")


# ----------------------------------------------------------------------------- primitives


def shape_of(x: Any) -> tuple[int, ...]:
    """The shape of an array or array-like."""
    return tuple(int(d) for d in np.shape(x))


def dtype_of(x: Any) -> np.dtype[Any]:
    """The dtype of an array, or NumPy's dtype for an array-like without one."""
    dtype = getattr(x, "dtype", None)
    return np.dtype(dtype) if dtype is not None else np.asarray(x).dtype


def is_floating(dt: np.dtype[Any]) -> bool:
    """A real floating dtype, including the ``ml_dtypes`` formats (bfloat16, float8_*)."""
    return dt.kind == "f" or (dt.kind == "V" and "float" in dt.name)


def is_integer(dt: np.dtype[Any]) -> bool:
    """A signed or unsigned integer dtype (bool is not an integer here)."""
    return dt.kind in "iu"


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def check_real_scalar(name: str, x: Any) -> float:
    """A real number (Python, NumPy scalar or 0-d array; not bool, complex or text) as float."""
    check_real_kind(name, x)
    return float(np.asarray(x, dtype=np.float64))


def check_real_kind(name: str, x: Any) -> None:
    """The checks of :func:`check_real_scalar` on shape and dtype only (``x`` may be traced)."""
    if isinstance(x, (str, bytes)):
        raise TypeError(f"{name} must be a real number, got {x!r}")
    if np.ndim(x) != 0:
        raise ValueError(f"{name} must be a scalar, got shape {shape_of(x)}")
    dt = dtype_of(x)
    if not (is_floating(dt) or is_integer(dt)):
        raise TypeError(f"{name} must be a real number, got {x!r} (dtype {dt})")


def check_scale(scale: Any) -> float | None:
    """``None`` (the default ``1/sqrt(d)``) or a real scalar."""
    return None if scale is None else check_real_scalar("scale", scale)


def check_mask_and_bias(
    mask: Any, bias: Any, target: tuple[int, ...], axes: str
) -> tuple[np.ndarray | None, np.ndarray | None]:
    """``mask`` boolean and ``bias`` floating, each broadcast to ``target`` (``bias`` float64)."""
    check_mask_and_bias_kinds(mask, bias, target, axes)
    m = None if mask is None else np.broadcast_to(np.asarray(mask, dtype=bool), target)
    b = None if bias is None else np.broadcast_to(np.asarray(bias, dtype=np.float64), target)
    return m, b


def check_mask_and_bias_kinds(mask: Any, bias: Any, target: tuple[int, ...], axes: str) -> None:
    """The shape and dtype checks of :func:`check_mask_and_bias`, without reading the values."""
    for name, arr in (("mask", mask), ("bias", bias)):
        if arr is None:
            continue
        shape = shape_of(arr)
        if len(shape) < 2:
            raise ValueError(
                f"{name} must have rank >= 2 with its last two axes {axes}, got shape {shape}"
            )
        if not broadcasts(shape, target):
            raise ValueError(
                f"{name} has shape {shape}, which does not broadcast to {axes} = {target}"
            )
        dt = dtype_of(arr)
        if name == "mask" and dt != np.bool_:
            raise TypeError(
                f"mask must be boolean (True = may attend), got dtype {dt}; pass additive "
                "scores through bias instead"
            )
        if name == "bias" and not is_floating(dt):
            raise TypeError(f"bias must be floating, got dtype {dt}")


def broadcasts(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    """Whether ``shape`` broadcasts to ``target`` without growing it."""
    try:
        return np.broadcast_shapes(shape, target) == target
    except ValueError:
        return False


def check_cotangent(name: str, x: Any, want: tuple[int, ...], layout: str = "") -> np.ndarray:
    """A floating cotangent of exactly the output's shape ``want``, as float64."""
    got = None if x is None else shape_of(x)
    if got != want:
        raise ValueError(f"{name} has shape {got}; expected {layout}{want}")
    if not is_floating(dtype_of(x)):
        raise TypeError(f"{name} must be floating, got dtype {dtype_of(x)}")
    return np.asarray(x, dtype=np.float64)


def check_axis(axis: Any, shape: tuple[int, ...]) -> int:
    """An int axis of ``lse``'s ``shape`` (negative from the end), returned non-negative."""
    if not _is_int(axis):
        raise TypeError(f"axis must be an int, got {axis!r}")
    if not -len(shape) <= axis < len(shape):
        raise ValueError(f"axis={axis} is out of range for lse of shape {shape}")
    return int(axis) % len(shape)


# ----------------------------------------------------------------------------- kernel level


METHODS = ("fast", "definition")  # vectorised BLAS by query blocks; one element at a time


def _one_of(name: str, x: Any, choices: tuple[str, ...]) -> str:
    if not isinstance(x, str) or x not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {x!r}")
    return x


def check_policy(masked_rows: Any) -> str:
    """One of :data:`POLICIES`, spelled exactly (no case folding)."""
    return _one_of("masked_rows", masked_rows, POLICIES)


def check_alignment(causal_alignment: Any) -> str:
    """One of :data:`ALIGNMENTS`, spelled exactly (``"bottom-right"`` is refused)."""
    return _one_of("causal_alignment", causal_alignment, ALIGNMENTS)


def check_method(method: Any) -> str:
    """One of :data:`METHODS`."""
    return _one_of("method", method, METHODS)


def check_flag(name: str, x: Any) -> bool:
    """A Python or NumPy bool (a string such as ``"False"`` would otherwise read as True)."""
    if not isinstance(x, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {x!r}")
    return bool(x)


def check_window(local_window_size: Any) -> tuple[int | None, int | None]:
    """``None``, ``w`` (both sides) or ``(left, right)`` of ints >= 0 or ``None`` (unbounded);
    returns ``(left, right)``."""
    lws = local_window_size
    if lws is None:
        return (None, None)
    if not (_is_int(lws) or isinstance(lws, (tuple, list))):
        raise TypeError(
            "local_window_size must be an int or a (left, right) pair of ints (None = "
            f"unbounded), got {lws!r}"
        )
    pair = (lws, lws) if _is_int(lws) else tuple(lws)
    if len(pair) != 2:
        raise ValueError(
            "local_window_size must be an int or a (left, right) pair (None = unbounded), "
            f"got {lws!r}"
        )
    for side, w in zip(("left", "right"), pair, strict=True):
        if w is not None and not _is_int(w):
            raise TypeError(f"local_window_size {side} must be an int or None, got {w!r}")
        if w is not None and w < 0:
            raise ValueError(
                f"local_window_size {side} = {w} is negative; a query at position p attends to "
                "keys in [p - left, p + right], so both sides must be >= 0"
            )
    left, right = (None if w is None else int(w) for w in pair)
    return left, right


def check_ints(
    name: str, x: Any, shape: tuple[int, ...], upper: int | None, *, concrete: bool = True
) -> Any:
    """An integer array of exactly ``shape`` with entries in ``[0, upper]`` (unless ``upper`` is
    None), as int64; ``concrete=False`` (a tracer): shape and dtype only, ``x`` returned."""
    if x is None:
        return None
    if shape_of(x) != shape:
        raise ValueError(f"{name} has shape {shape_of(x)}; expected {shape}")
    dt = dtype_of(x)
    if not is_integer(dt):
        raise TypeError(f"{name} must be integer, got dtype {dt}")
    if not concrete:
        return x
    arr = np.asarray(x).astype(np.int64)
    if upper is not None and arr.size and (arr.min() < 0 or arr.max() > upper):
        raise ValueError(
            f"{name} = {arr.tolist()} is out of range; every length must lie in [0, {upper}]"
        )
    return arr


def check_segments(
    segment_ids: Any, b: int, t: int, s: int, check: Callable[..., Any] = check_ints
) -> tuple[Any, Any]:
    """``None``, one ``[B, T]`` array (needs ``T == S``) or a pair ``([B, T], [B, S])``, each
    checked by ``check(name, x, shape, None)``."""
    if segment_ids is None:
        return None, None
    if isinstance(segment_ids, (tuple, list)):
        if len(segment_ids) != 2:
            raise ValueError(
                "segment_ids must be one [B, T] array (T == S) or a pair "
                "(query_segment_ids [B, T], key_value_segment_ids [B, S])"
            )
        q_in, kv_in = segment_ids
    else:
        if t != s:
            raise ValueError(
                f"a single segment_ids array needs T == S, got T={t}, S={s}; "
                "pass (query_segment_ids, key_value_segment_ids)"
            )
        q_in = kv_in = segment_ids
    return (
        check("query_segment_ids", q_in, (b, t), None),
        check("key_value_segment_ids", kv_in, (b, s), None),
    )


def check_options(
    shape: tuple[int, int, int, int], bias: Any, mask: Any, options: Mapping[str, Any]
) -> tuple[Any, ...]:
    """The allowed-set ``options`` (named as :func:`attnref.dot_product_attention`'s arguments)
    for ``shape = (B, N, T, S)``; returns ``(mask, bias, q_lens, kv_lens, q_seg, kv_seg, window,
    alignment, is_causal, sink_tokens)``, mask and bias broadcast to ``shape``."""
    b, _, t, s = shape
    alignment = check_alignment(options["causal_alignment"])
    causal = check_flag("is_causal", options["is_causal"])
    for name, arr in (("bias", bias), ("mask", mask)):
        if arr is not None and np.ndim(arr) != 4:
            raise ValueError(
                f"{name} must have rank 4 broadcastable to [B, N, T, S] = {shape}, got shape "
                f"{shape_of(arr)}"
            )
    m, bs = check_mask_and_bias(mask, bias, shape, "[B, N, T, S]")
    q_lens = check_ints("query_seq_lengths", options["query_seq_lengths"], (b,), t)
    kv_lens = check_ints("key_value_seq_lengths", options["key_value_seq_lengths"], (b,), s)
    q_seg, kv_seg = check_segments(options["segment_ids"], b, t, s)
    window = check_window(options["local_window_size"])
    n_sink, _ = check_production(shape, window, sink_tokens=options["sink_tokens"])
    return m, bs, q_lens, kv_lens, q_seg, kv_seg, window, alignment, causal, n_sink


def check_allowed_shape(shape: Any) -> tuple[int, int, int, int]:
    """``shape`` of :func:`kernel_allowed`: four ints ``(B, N, T, S)``, each >= 0."""
    if (
        not isinstance(shape, (tuple, list))
        or len(shape) != 4
        or not all(_is_int(d) and d >= 0 for d in shape)
    ):
        raise ValueError(f"shape must be four ints (B, N, T, S), each >= 0, got {shape!r}")
    b, n, t, s = (int(d) for d in shape)
    return b, n, t, s


def check_kernel(
    query: Any, key: Any, value: Any, *, scale: Any, softcap: Any, masked_rows: Any
) -> tuple[tuple[int, int, int, int], float, float | None, str]:
    """A kernel call's shapes, dtypes, scale, softcap and policy; returns ``((B, N, T, S), scale,
    softcap, masked_rows)``."""
    (b, t, n, h), (s, _, _), _ = check_kernel_arrays(query, key, value)
    policy = check_policy(masked_rows)
    sc = check_scale(scale)
    cap = check_softcap(softcap)
    if s == 0 and policy == "uniform":
        raise ValueError(
            f"key has S=0 keys (shape {shape_of(key)}): every query row is fully masked, and "
            "masked_rows='uniform' (the mean of value over all S keys) is undefined for S = 0; "
            "use 'zeros' or 'nan'"
        )
    return (b, n, t, s), (1.0 / math.sqrt(h) if sc is None else sc), cap, policy


def check_kernel_arrays(
    query: Any, key: Any, value: Any
) -> tuple[tuple[int, int, int, int], tuple[int, int, int], np.dtype[Any]]:
    """``query [B, T, N, H]``, ``key [B, S, K, H]``, ``value [B, S, K, H_v]``, one floating dtype,
    ``K | N``, ``H >= 1``; returns ``((B, T, N, H), (S, K, H_v), dtype)``."""
    for name, x in (("query", query), ("key", key), ("value", value)):
        if np.ndim(x) != 4:
            layout = "[B, T, N, H]" if name == "query" else "[B, S, K, H]"
            raise ValueError(f"{name} must have rank 4 ({layout}), got shape {shape_of(x)}")
    b, t, n, h = qs = shape_of(query)
    bk, s, kh, hk = ks = shape_of(key)
    bv, sv, kv, h_v = vs = shape_of(value)
    if bk != b or bv != b:
        raise ValueError(f"batch sizes differ: query {qs}, key {ks}, value {vs}")
    if hk != h:
        raise ValueError(f"key has head dim {hk} (shape {ks}) but query has {h} (shape {qs})")
    if (sv, kv) != (s, kh):
        raise ValueError(
            f"value has shape {vs}; expected [B, S={s}, K={kh}, H_v] to match key {ks}"
        )
    if kh < 1:
        raise ValueError(f"key has K=0 heads (shape {ks}); it needs at least one K/V head")
    if n < 1 or n % kh:
        raise ValueError(
            f"query has N={n} heads (shape {qs}) and key has K={kh} (shape {ks}); N must be a "
            "positive multiple of K for GQA/MQA"
        )
    if h < 1:
        raise ValueError(
            f"query has head dim H=0 (shape {qs}); H must be >= 1 (the default scale "
            "1/sqrt(H) is undefined at 0)"
        )
    dtypes = {"query": dtype_of(query), "key": dtype_of(key), "value": dtype_of(value)}
    if not is_floating(dtypes["query"]):
        raise TypeError(f"query must be floating, got dtype {dtypes['query']}")
    if len(set(dtypes.values())) != 1:
        raise TypeError(f"query, key and value must share one dtype, got {dtypes}; cast explicitly")
    return (b, t, n, h), (s, kh, h_v), dtypes["query"]


def check_softcap(softcap: Any, *, concrete: bool = True) -> float | None:
    """``None`` or a positive finite real scalar as float (``concrete=False``: refused)."""
    if softcap is None:
        return None
    ok = concrete and not isinstance(softcap, (str, bytes, bool, np.bool_))
    ok = ok and np.ndim(softcap) == 0
    ok = ok and (is_floating(dtype_of(softcap)) or is_integer(dtype_of(softcap)))
    cap = float(np.asarray(softcap, dtype=np.float64)) if ok else None
    if cap is None or not (math.isfinite(cap) and cap > 0):
        raise ValueError(f"softcap must be a positive finite Python number, got {softcap!r}")
    return cap


# ----------------------------------------------------------------------------- weight level


def _param(params: Any, name: str) -> Any:
    return params.get(name) if isinstance(params, dict) else getattr(params, name, None)


def heads_message(sq: tuple[int, ...], sk: tuple[int, ...], sv: tuple[int, ...]) -> str:
    """The error text of :func:`check_params` when ``H`` is not a multiple of ``K``."""
    return (
        f"params.w_q has {sq[0]} heads, params.w_k {sk[0]} and params.w_v {sv[0]} (shapes {sq}, "
        f"{sk}, {sv}); num_heads must be a multiple of num_kv_heads"
    )


def check_params(
    params: Any, *, heads_text: Callable[..., str] = heads_message
) -> tuple[int, int, int, int, int]:
    """The parameters' shapes and dtypes (leaves may be traced); returns ``(H, K, d_model, d_k,
    d_v)``. ``w_q [H, d_model, d_k]``, ``w_k [K, d_model, d_k]``, ``w_v [K, d_model, d_v]``,
    ``w_o [H, d_v, d_model]``, optional biases (shapes below); ``K | H``, ``H, K, d_k >= 1``, one
    floating dtype. ``heads_text(w_q, w_k, w_v shapes)`` words the ``K | H`` error."""
    for name in PARAM_WEIGHTS:
        w = _param(params, name)
        if w is None:
            raise TypeError(f"params.{name} is missing; expected an AttentionParams pytree")
        if np.ndim(w) != 3:
            raise ValueError(
                f"params.{name} must have rank 3 (per-head layout), got shape {shape_of(w)}"
            )
    h, d_model, d_k = sq = shape_of(_param(params, "w_q"))
    if h < 1:
        raise ValueError(f"params.w_q has shape {sq}; it needs at least one head")
    if d_k < 1:
        raise ValueError(
            f"params.w_q has shape {sq}; d_k must be >= 1 (the default scale 1/sqrt(d_k) is "
            "undefined at 0)"
        )
    kv, dmk, dkk = sk = shape_of(_param(params, "w_k"))
    if (dmk, dkk) != (d_model, d_k):
        raise ValueError(
            f"params.w_k has shape {sk} but params.w_q has shape {sq}; expected "
            f"w_k [K, d_model={d_model}, d_k={d_k}]"
        )
    hv, dmv, d_v = sv = shape_of(_param(params, "w_v"))
    if kv < 1 or h % kv:
        raise ValueError(heads_text(sq, sk, sv))
    if dmv != d_model:
        raise ValueError(f"params.w_v has shape {sv}; expected [K={kv}, d_model={d_model}, d_v]")
    if hv != kv:
        raise ValueError(
            f"params.w_k has shape {sk} but params.w_v has shape {sv}; keys and values must "
            "have the same number of heads (num_kv_heads)"
        )
    so = shape_of(_param(params, "w_o"))
    if so != (h, d_v, d_model):
        raise ValueError(
            f"params.w_o has shape {so}; expected [H={h}, d_v={d_v}, d_model={d_model}] to "
            f"match params.w_q {sq} and params.w_v {sv}"
        )
    expected = {
        "b_q": ((h, d_k), "[H, d_k]"),
        "b_k": ((kv, d_k), "[K, d_k]"),
        "b_v": ((kv, d_v), "[K, d_v]"),
        "b_o": ((d_model,), "[d_model]"),
    }
    for name, (shape, axes) in expected.items():
        bias = _param(params, name)
        if bias is not None and shape_of(bias) != shape:
            raise ValueError(
                f"params.{name} has shape {shape_of(bias)}; expected {axes} = {shape} "
                f"(H={h} query heads, K={kv} key/value heads)"
            )
    dtypes = {
        name: dtype_of(_param(params, name))
        for name in PARAM_WEIGHTS + PARAM_BIASES
        if _param(params, name) is not None
    }
    first = dtypes["w_q"]
    if not is_floating(first):
        raise TypeError(f"params.w_q has dtype {first}; attention parameters must be floating")
    for name, dt in dtypes.items():
        if dt != first:
            raise TypeError(
                f"params.{name} has dtype {dt} but params.w_q has dtype {first}; attnref does "
                "not mix dtypes, cast the parameters explicitly"
            )
    return h, kv, d_model, d_k, d_v


def check_weight_level(
    params: Any, x_q: Any, x_kv: Any, mask: Any, bias: Any, scale: Any
) -> tuple[tuple[int, ...], int, int, np.ndarray | None, np.ndarray | None, float | None]:
    """Parameters, tokens ``[..., T, d_model]``, ``mask``/``bias`` ``[..., T_q, T_k]`` and scale;
    returns ``(batch_shape, T_q, T_k, mask, bias, scale)``, mask and bias broadcast."""
    _, _, d_model, _, _ = check_params(params)
    x_kv = x_q if x_kv is None else x_kv
    batch, t_q, t_k = check_tokens(d_model, dtype_of(_param(params, "w_q")), x_q, x_kv)
    m, b = check_mask_and_bias(mask, bias, (*batch, t_q, t_k), "[..., T_q, T_k]")
    return batch, t_q, t_k, m, b, check_scale(scale)


def check_tokens(
    d_model: int,
    p_dtype: np.dtype[Any],
    x_q: Any,
    x_kv: Any,
    *,
    layout: str = "row",
    names: tuple[str, str] = ("x_q", "x_kv"),
) -> tuple[tuple[int, ...], int, int]:
    """Tokens ``[..., T, d_model]`` (``layout="column"``: ``[..., d_model, T]``) of the parameters'
    dtype and one batch shape; returns ``(batch_shape, T_q, T_k)``."""
    feat_axis, tok_axis = (-1, -2) if layout == "row" else (-2, -1)
    want = "[..., T, d_model]" if layout == "row" else "[..., d_model, T]"
    for name, x in zip(names, (x_q, x_kv), strict=True):
        if np.ndim(x) < 2:
            raise ValueError(f"{name} must have rank >= 2 ({want}), got shape {shape_of(x)}")
        if shape_of(x)[feat_axis] != d_model:
            raise ValueError(
                f"{name} has shape {shape_of(x)} but params have d_model={d_model}; expected {want}"
            )
        if dtype_of(x) != p_dtype:
            raise TypeError(
                f"{name} has dtype {dtype_of(x)} but params.w_q has dtype {p_dtype}; attnref "
                "does not mix dtypes, cast explicitly"
            )
    sq, skv = shape_of(x_q), shape_of(x_kv)
    if sq[:-2] != skv[:-2]:
        raise ValueError(
            f"{names[0]} has batch shape {sq[:-2]} (shape {sq}) but {names[1]} has batch shape "
            f"{skv[:-2]} (shape {skv}); batch dimensions must match exactly"
        )
    return sq[:-2], sq[tok_axis], skv[tok_axis]


# ----------------------------------------------------------------------------- production options


def check_production(
    shape: tuple[int, int, int, int],
    window: tuple[int | None, int | None] | None,
    *,
    sinks: Any = None,
    sink_tokens: Any = 0,
    dropout_mask: Any = None,
    dropout_rate: Any = None,
) -> tuple[int, float | None]:
    """Sinks, sink tokens and dropout of a kernel call of ``shape = (B, N, T, S)`` (``window``:
    the checked ``local_window_size``; arrays may be traced); returns ``(sink_tokens,
    dropout_rate)`` (rate ``None`` without a mask)."""
    _, n, _, _ = shape
    if sinks is not None:
        if shape_of(sinks) != (n,):
            raise ValueError(
                f"sinks must have shape [N] = ({n},), one logit per query head, got shape "
                f"{shape_of(sinks)}"
            )
        if not is_floating(dtype_of(sinks)):
            raise TypeError(f"sinks must be floating, got dtype {dtype_of(sinks)}")
    if not _is_int(sink_tokens) or sink_tokens < 0:
        raise ValueError(f"sink_tokens must be an int >= 0, got {sink_tokens!r}")
    if sink_tokens and (window is None or window[0] is None):
        raise ValueError(
            f"sink_tokens={sink_tokens} keeps the first keys visible past a sliding window's "
            f"left edge, but local_window_size={window!r} has no left edge; pass a window"
        )
    if dropout_mask is None:
        if dropout_rate is not None:
            raise ValueError(
                f"dropout_rate={dropout_rate!r} needs a dropout_mask: attnref's dropout is "
                "deterministic (pass the boolean keep mask)"
            )
        return int(sink_tokens), None
    if dropout_rate is None:
        raise ValueError("dropout_mask needs dropout_rate (the rate the mask was drawn with)")
    rate = check_real_scalar("dropout_rate", dropout_rate)
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"dropout_rate must lie in [0, 1), got {dropout_rate!r}")
    mshape = shape_of(dropout_mask)
    if len(mshape) != 4 or not broadcasts(mshape, shape):
        raise ValueError(
            f"dropout_mask must have rank 4 broadcastable to [B, N, T, S] = {shape}, got shape "
            f"{mshape}"
        )
    if dtype_of(dropout_mask) != np.bool_:
        raise TypeError(
            f"dropout_mask must be boolean (True = keep), got dtype {dtype_of(dropout_mask)}"
        )
    return int(sink_tokens), rate
