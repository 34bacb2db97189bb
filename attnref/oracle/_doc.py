"""The Args and Raises text of the NumPy layers, written once and attached to each function.

:func:`doc` builds ``Args:`` from a function's signature, one entry per parameter, from the table
of its calling convention (:data:`WEIGHT`, :data:`KERNEL`, :data:`LINEAR`), shared by the oracle
and :mod:`attnref.tolerance`; :func:`signed` gives a body the public signature of its templates.
"""

from __future__ import annotations

import inspect
import re
import textwrap
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

METHOD = (
    '``"fast"`` (default; float64 BLAS, streamed over blocks of query rows) or '
    '``"definition"`` (one element at a time, the root of trust; see :mod:`attnref.oracle`).'
)

# The weight level: ``attention(params, x_q, x_kv, ...)`` and everything that shares its inputs.
WEIGHT = {
    "params": "Per-head weights: an :class:`attnref.AttentionParams` or a dict with its keys "
    "(``w_q [H, d_model, d_k]``, ``w_k [K, d_model, d_k]``, ``w_v [K, d_model, d_v]``, "
    "``w_o [H, d_v, d_model]``, optional biases ``b_q, b_k, b_v, b_o``; ``K`` divides ``H``: "
    "grouped key/value heads), read as float64.",
    "x_q": "Query tokens, row vectors ``[..., T_q, d_model]``, the dtype of ``params``.",
    "x_kv": "Key/value tokens ``[..., T_k, d_model]`` with the batch shape of ``x_q``; ``None`` "
    "(default) means ``x_q`` (its gradient then goes into ``x_q``'s).",
    "d_y": "The cotangent of the output, floating, ``[..., T_q, d_model]`` (keyword-only).",
    "mask": "Boolean, broadcastable to ``[..., T_q, T_k]``, ``True`` = may attend; ``None`` "
    "(default) allows every pair.",
    "bias": "Floating, broadcastable to ``[..., T_q, T_k]``, added to the scaled logits (``-inf`` "
    "masks like ``False``); ``None`` (default) adds nothing.",
    "scale": "The logit scale; ``None`` (default) means ``1/sqrt(d_k)``.",
    "positions_q": "Integer ``[..., T_q]`` or ``[T_q]``; ``None`` (default): ``arange(T_q)``.",
    "positions_kv": "Integer ``[..., T_k]`` or ``[T_k]``; ``None`` (default): ``arange(T_k)``.",
    "base": "The RoPE frequency base (``theta_p = base^(-2p/d)``; default 10000), a positive "
    "finite Python number.",
    "convention": '``"rotate_half"`` (default; pairs ``(p, p + d/2)``) or ``"interleaved"`` '
    "(``(2p, 2p + 1)``).",
    "residual": "If ``True``, the block returns ``x_q + y`` (default ``False``).",
    "emulate": "``None`` (default; exact float64) or a dtype (e.g. ``np.float16``) to round every "
    "intermediate to; that is the definition's operation order, so it runs the definition "
    "whatever ``method`` says.",
    "method": METHOD,
    "dtype": "The format the formulation computes in.",
}
WEIGHT_RAISES = {
    "ValueError": "For the inputs the JAX formulations refuse with ``ValueError`` (malformed "
    "``params``, token ranks, ``d_model`` or batch shapes, a ``mask``/``bias`` that does not "
    "broadcast, a non-scalar ``scale``; for RoPE an odd ``d_k``, positions, ``base`` or "
    "``convention``), an unknown ``method``, or a ``d_y`` not of the output's shape.",
    "TypeError": "For those they refuse with ``TypeError`` (mixed dtypes, a non-boolean mask, a "
    "non-floating bias, a non-real scale, non-integer positions), or a non-floating ``d_y``.",
}

# The kernel level: ``dot_product_attention(query, key, value, bias, mask, ...)``.
KERNEL = {
    "shape": "``(B, N, T, S)``, four ints ``>= 0``.",
    "query": "``[B, T, N, H]``, floating, exactly as the kernel received it.",
    "key": "``[B, S, K, H]``, the dtype of ``query``; ``N`` a multiple of ``K``.",
    "value": "``[B, S, K, H_v]``, the dtype of ``query``.",
    "bias": "Rank-4 floating bias broadcastable to ``[B, N, T, S]``, added after the softcap "
    "(``-inf`` masks the pair); ``None`` (default).",
    "mask": "Rank-4 boolean mask broadcastable to ``[B, N, T, S]``; ``None`` (default).",
    "cotangent": "``dO [B, T, N, H_v]``, the cotangent of the output.",
    "lse_cotangent": "``[B, T, N]``, the cotangent of the lse; ``None`` (default) is zero.",
    "scale": "The logit scale; ``None`` (default) means ``1/sqrt(H)``.",
    "is_causal": "If ``True``, key ``j`` needs ``j <= p_i``; default ``False``.",
    "query_seq_lengths": "Integer ``[B]`` in ``[0, T]`` (rows beyond are padding); ``None`` "
    "(default): all rows.",
    "key_value_seq_lengths": "Integer ``[B]`` in ``[0, S]``; ``None`` (default): all keys.",
    "local_window_size": "``w`` or ``(left, right)`` (``None`` = unbounded side); ``None`` "
    "(default): no window.",
    "segment_ids": "One ``[B, T]`` int array (``T == S``) or a pair ``([B, T], [B, S])``; "
    "``None`` (default): one segment.",
    "softcap": "A positive finite number ``c`` (logits ``c tanh(s / c)``); ``None`` (default).",
    "sinks": "Floating ``[N]``: one sink logit ``z_n`` per query head, in the softmax's "
    "denominator with no value (``lse`` includes it; a fully masked row is 0 with "
    "``lse = z_n``); ``None`` (default).",
    "sink_tokens": "An int ``>= 0``: the first keys stay visible past the window's left edge "
    "(needs ``local_window_size`` with a left side); default 0.",
    "dropout_mask": "Boolean, rank 4, broadcastable to ``[B, N, T, S]`` (True = keep): weights "
    "``p_ij keep_ij / (1 - dropout_rate)``; ``None`` (default).",
    "dropout_rate": "The dropout rate in ``[0, 1)``, given exactly with ``dropout_mask``.",
    "causal_alignment": '``"top_left"`` (default) or ``"bottom_right"``.',
    "masked_rows": '``"zeros"`` (default), ``"uniform"`` or ``"nan"``: a fully masked row\'s '
    "output.",
    "return_lse": "If ``True``, also return ``lse``.",
    "return_magnitude": "If ``True``, also return ``sum_j p_ij w_ij |v_j|``, the output with "
    "``|v|`` for ``v`` (what :func:`attnref.tolerance.kernel_bound_minorant` scales).",
    "method": METHOD,
    "dtype": "The kernel's format; ``None`` (default) is ``query``'s dtype.",
    "key_blocks": "Key blocks of an online (blockwise) softmax; ``None`` (default): any tiling.",
    "budget": "Bytes of float64 temporaries per query block (the default: the fastest size "
    "measured on 2 cores, ``docs/benchmarks.md``).",
}
KERNEL_RAISES = {
    "ValueError": "For the inputs :func:`attnref.dot_product_attention` refuses with "
    "``ValueError`` (shapes, option values, lengths out of range), a cotangent of the wrong "
    "shape, or (gradients) a non-finite logit or value in an allowed pair.",
    "TypeError": "For those it refuses with ``TypeError`` (dtypes, option types), or a "
    "non-floating cotangent.",
}

# Linear attention: ``linear_attention(q, k, v, ...)`` and ``linear_multihead(params, ...)``.
LINEAR = {
    **WEIGHT,
    "q": "Queries ``[..., T_q, H, d_k]``.",
    "k": "Keys ``[..., T_k, H, d_k]``.",
    "v": "Values ``[..., T_k, H, d_v]``.",
    "d_y": "The cotangent of the output (``[..., T_q, H, d_v]``, or ``[..., T_q, d_model]`` for "
    "the multi-head form).",
    "feature_map": "The feature map (:class:`attnref.linear.FeatureMap` or any object with "
    "``name`` and, for FAVOR+, ``omega [m, d]``).",
    "causal": "If ``True``, query ``i`` reads keys ``j <= i`` only; default ``False``.",
    "key_mask": "Boolean ``[..., T_k]``, ``True`` = the key may be read; ``None`` (default) "
    "allows every key.",
    "eps": "The denominator's regulariser (default 0, the exact ratio).",
    "eps_policy": '``"add"`` (default; ``D + eps``) or ``"clamp"`` (``max(D, eps)``; where the '
    "clamp holds, ``D`` is constant; on a tie it follows ``S``).",
    # the linear bounds' input errors
    "dq": "Absolute errors already in ``q`` (broadcast; default 0: exact), e.g. a projection's.",
    "dk": "Absolute errors already in ``k``.",
    "dv": "Absolute errors already in ``v``.",
    "d_dy": "Absolute errors already in ``d_y``.",
}
LINEAR_RAISES = {
    "ValueError": "If a weight is missing, the head counts do not group (``H % K``), "
    "``eps_policy`` or ``method`` is unknown, or ``d_y`` is not shaped as the output.",
    "TypeError": "If ``feature_map`` is not a (called) feature map, or ``causal`` or "
    "``residual`` is not a bool.",
}

# The attention states ``(o, lse)`` of disjoint key sets ``A`` and ``B``, and their merge.
STATES = {
    "o_a": "Normalised output of ``A``, ``[..., H_v]``, floating.",
    "lse_a": "Log-sum-exp of ``A``'s logits, ``[...]`` (``-inf``: ``A`` is empty), floating.",
    "o_b": "Normalised output of ``B``, the shape of ``o_a``.",
    "lse_b": "Log-sum-exp of ``B``'s logits, the shape of ``lse_a``.",
    "g_o": "The cotangent of the merged ``o``, the shape of ``o_a``.",
    "g_lse": "The cotangent of the merged ``lse``, the shape of ``lse_a``.",
    "masked_rows": '``o`` of a row where every state is empty: ``"zeros"`` (default) or ``"nan"``.',
    "o": "``P`` normalised outputs stacked along ``axis`` of ``lse``'s shape plus ``H_v``: "
    "``[..., P, ..., H_v]``, floating.",
    "lse": "Their log-sum-exps, ``o``'s shape without the last axis (``-inf``: empty).",
    "axis": "The stacking axis of ``lse`` (negative counts from ``lse``'s last axis); ``P = 0`` "
    "gives the empty state.",
}
# The Raises of a merge of two states and of a stack (JAX and oracle alike).
MERGE_RAISES = {
    "ValueError": "If a ``lse`` does not have the shape of its ``o`` without the last axis, the "
    'two states\' shapes differ, or ``masked_rows`` is not ``"zeros"`` or ``"nan"``.',
    "TypeError": "If an input is not floating.",
}
STACK_RAISES = {
    "ValueError": "If ``lse`` does not have ``o``'s shape without the last axis, ``axis`` is out "
    'of range for ``lse``, or ``masked_rows`` is not ``"zeros"`` or ``"nan"``.',
    "TypeError": "If an input is not floating or ``axis`` is not an int.",
}


def _entries(items: Mapping[str, str]) -> list[str]:
    """``name: text`` entries wrapped at 96 columns, never inside a ````literal````."""
    return [
        textwrap.fill(
            re.sub(r"``.+?``", lambda m: m.group(0).replace(" ", "\0"), f"{name}: {text}"),
            width=96,
            initial_indent="    ",
            subsequent_indent="        ",
            break_on_hyphens=False,
            break_long_words=False,
        ).replace("\0", " ")
        for name, text in items.items()
    ]


def _template(params: list[inspect.Parameter]) -> Callable[..., None]:
    """A template for :func:`signed` with the signature ``params``."""

    def template(*args: Any, **kwargs: Any) -> None:
        """A template (never called)."""

    template.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    return template


def joined(*templates: Callable[..., Any]) -> Callable[..., None]:
    """One template of several: their positional parameters, then their keyword-only ones."""
    params = [p for t in templates for p in inspect.signature(t).parameters.values()]
    params.sort(key=lambda p: p.kind is p.KEYWORD_ONLY)  # stable: the order within each kind
    return _template(params)


def weight_tokens(params: Any, x_q: Any, x_kv: Any = None) -> None:
    """The weights and tokens of a multi-head block: a template for :func:`signed`."""


def weight_options(*, mask: Any = None, bias: Any = None, scale: float | None = None) -> None:
    """The mask, bias and scale of the weight level: a template for :func:`signed`."""


def rope_positions(*, positions_q: Any = None, positions_kv: Any = None) -> None:
    """The token positions of a RoPE block: a template for :func:`signed`."""


def rope_options(*, base: float = 10000.0, convention: str = "rotate_half") -> None:
    """The RoPE frequency base and pair convention: a template for :func:`signed`."""


def method_option(*, method: str = "fast") -> None:
    """How an oracle is evaluated: a template for :func:`signed`."""


def block_options(*, residual: bool = False, method: str = "fast") -> None:
    """The options of a multi-head block's oracle (``x_q + y`` or not, how it is evaluated),
    written once: a template for :func:`signed`."""


def rope_tokens(x: Any, positions: Any) -> None:
    """The vectors and positions the RoPE map rotates: a template for :func:`signed`."""


# The inputs of the weight level (:func:`attnref.oracle.attention` and its bounds), of the RoPE
# weight level (:func:`attnref.oracle.rope_attention` and its bounds) and of the RoPE map
# (:func:`attnref.oracle.rope` and its bound), each written once: templates for :func:`signed`.
weight_call = joined(weight_tokens, weight_options)
rope_call = joined(weight_tokens, rope_positions, weight_options, rope_options)
rope_map_call = joined(rope_tokens, rope_options)


def linear_qkv(q: Any, k: Any, v: Any) -> None:
    """The per-head inputs of linear attention: a template for :func:`signed`."""


def linear_options(
    *,
    feature_map: Any,
    causal: bool = False,
    key_mask: Any = None,
    eps: float = 0.0,
    eps_policy: str = "add",
) -> None:
    """The options of linear attention, written once: a template for :func:`signed`."""


LINEAR_OPTIONS = tuple(inspect.signature(linear_options).parameters)


def retemplate(
    template: Callable[..., Any], only: tuple[str, ...] | None = None, **defaults: Any
) -> Callable[..., None]:
    """``template`` with other ``defaults`` (and only the parameters ``only``, in that order)."""
    params = inspect.signature(template).parameters
    names = list(params) if only is None else only
    return _template([params[n].replace(default=defaults.get(n, params[n].default)) for n in names])


def signed(*templates: Callable[..., Any], front: tuple[str, ...] = ()) -> Any:
    """Give ``body(call, *, own...)`` the signature of ``templates`` plus its own parameters (those
    in ``front`` after the templates' positional ones, the rest last); the public function calls
    ``body`` with the templates' arguments as one dict. A returned attnref class's annotation is
    evaluated (``__signature__`` is returned as is even with ``eval_str``)."""

    def wrap(body: Callable[..., Any]) -> Any:
        shared = [p for t in templates for p in inspect.signature(t).parameters.values()]
        sig = inspect.signature(body)
        returned = inspect.signature(body, eval_str=True).return_annotation
        if not (inspect.isclass(returned) and returned.__module__.startswith("attnref")):
            returned = sig.return_annotation
        own = list(sig.parameters.values())[1:]
        params = [p for p in shared if p.kind is not p.KEYWORD_ONLY]
        params += [p for p in own if p.name in front]
        params += [p for p in shared if p.kind is p.KEYWORD_ONLY]
        params += [p for p in own if p.name not in front]
        public_sig = inspect.Signature(params, return_annotation=returned)

        def public(*args: Any, **kwargs: Any) -> Any:
            bound = public_sig.bind(*args, **kwargs)
            bound.apply_defaults()
            a = bound.arguments
            return body({p.name: a[p.name] for p in shared}, **{p.name: a[p.name] for p in own})

        for attr in ("__module__", "__name__", "__qualname__", "__doc__"):
            setattr(public, attr, getattr(body, attr))
        public.__signature__ = public_sig  # type: ignore[attr-defined]
        return public

    return wrap


def doc(table: Mapping[str, str], raises: Mapping[str, str] | None = None, **own: str) -> Any:
    """Attach ``Args:`` (before ``Returns:``) and ``Raises:`` (last) to a function's docstring:
    one entry per parameter of its signature, from ``own`` or else ``table``."""

    def attach(fn: F) -> F:
        names = inspect.signature(fn).parameters
        body = inspect.cleandoc(fn.__doc__ or "")
        head, returns, tail = body.partition("\nReturns:")
        parts = [head.rstrip(), "", "Args:", *_entries({n: own.get(n) or table[n] for n in names})]
        if returns:
            parts += ["", "Returns:" + tail.rstrip()]
        if raises:
            parts += ["", "Raises:", *_entries(raises)]
        fn.__doc__ = "\n".join(parts) + "\n"
        return fn

    return attach
