"""Oracle twin of the kernel level: ``dot_product_attention(q, k, v, ...)`` in float64 NumPy.

Same signature and semantics as :func:`attnref.dot_product_attention` (layout of
``jax.nn.dot_product_attention``: ``q [B, T, N, H]``, ``k [B, S, K, H]``, ``v [B, S, K, H_v]``),
written from the definition one batch element, head and query at a time::

    p_i   = i + offset          offset = 0 (top_left) or S_b - T_b (bottom_right)
    key j allowed for query i  iff  mask, bias != -inf, i < T_b, j < S_b, seg_q[i] == seg_k[j],
                                    j <= p_i (causal), p_i - left <= j <= p_i + right (window;
                                    j < sink_tokens ignores the left edge)
    s_j   = scale q_i . k_j ;  s_j = c tanh(s_j / c) (softcap c) ;  s_j += bias_ij
    lse_i = log (exp(z_n) + sum_j exp(s_j))        (z_n the head's sink logit; none: no term)
    o_i   = sum_j exp(s_j - lse_i) w_ij v_j over allowed j, w_ij = keep_ij / (1 - p) (dropout)

Query head ``n`` reads K/V head ``n // (N / K)``. A row with no allowed key gets zeros, the
mean of all ``v`` rows, or NaN (``masked_rows``), and ``lse = -inf``; with sinks it is 0 with
``lse = z_n``; query rows beyond ``T_b`` are 0 with ``lse = -inf``. Refusals and empty inputs:
:mod:`attnref.oracle._checks`. NumPy only.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np

from ._checks import check_allowed_shape, check_method, check_options
from ._doc import KERNEL, KERNEL_RAISES, doc, method_option, retemplate, signed
from ._kernel_call import OPTIONS, KernelCall, call_allowed, kernel_call, parse, pick
from ._kernel_fast import forward


def allowed_shape(shape: tuple[int, int, int, int]) -> None:
    """The grid ``(B, N, T, S)`` of :func:`kernel_allowed`: a template for :func:`signed`."""


@doc(KERNEL)
@signed(allowed_shape, retemplate(kernel_call, only=("bias", "mask", *OPTIONS)), method_option)
def kernel_allowed(call: dict[str, Any]) -> np.ndarray:
    """The allowed (query, key) pairs ``[B, N, T, S]`` of a kernel call (of ``bias`` only its
    ``-inf`` entries matter), options validated as :func:`attnref.dot_product_attention` does.

    Returns:
        A boolean array ``[B, N, T, S]``, ``True`` where query ``i`` may read key ``j``.

    Raises:
        ValueError: For a bad ``shape`` or an option refused with ``ValueError`` by
            :func:`attnref.dot_product_attention`.
        TypeError: For an option refused with ``TypeError`` there.
    """
    method = check_method(call.pop("method"))
    shape, bias, mask, options = call["shape"], call["bias"], call["mask"], pick(call, OPTIONS)
    full = check_allowed_shape(shape)
    b_size, n_heads, t, s = full
    if method == "fast" and n_heads > 0:
        kv = np.zeros((b_size, s, n_heads, 1))
        return call_allowed(parse(np.zeros((b_size, t, n_heads, 1)), kv, kv, bias, mask, **options))
    mask_f, bias_f, q_lens, kv_lens, seg_q, seg_k, window, alignment, causal, n_sink = (
        check_options(full, bias, mask, options)
    )
    q_len = np.full(b_size, t) if q_lens is None else q_lens
    kv_len = np.full(b_size, s) if kv_lens is None else kv_lens
    left, right = window
    out = np.zeros(full, bool)
    for b, n, i, j in np.ndindex(*full):
        offset = 0 if alignment == "top_left" else int(kv_len[b]) - int(q_len[b])
        pos = i + offset
        out[b, n, i, j] = not (
            i >= q_len[b]
            or j >= kv_len[b]
            or (mask_f is not None and not mask_f[b, n, i, j])
            or (bias_f is not None and bias_f[b, n, i, j] == -np.inf)
            or (seg_q is not None and seg_k is not None and seg_q[b, i] != seg_k[b, j])
            or (causal and j > pos)
            or (left is not None and j < pos - left and j >= n_sink)
            or (right is not None and j > pos + right)
        )
    return out


@doc(KERNEL, KERNEL_RAISES)
@signed(kernel_call)
def dot_product_attention(
    call: dict[str, Any],
    *,
    return_lse: bool = False,
    return_magnitude: bool = False,
    method: str = "fast",
) -> Any:
    """Float64 reference for :func:`attnref.dot_product_attention` (same arguments, same
    refusals); ``"definition"`` is the module docstring's element-wise definition.

    Returns:
        float64 ``o [B, T, N, H_v]``; a tuple ``(o, lse)`` with ``lse [B, T, N]`` (``-inf`` on
        fully masked and padding rows) when ``return_lse``, followed by ``|o|_w = sum_j p_ij w_ij
        |v_j|`` ``[B, T, N, H_v]`` (``o`` with ``|v|`` for ``v``) when ``return_magnitude``.
    """
    check_method(method)
    c = parse(**call)
    if method == "fast":
        return _returned(forward(c, magnitude=return_magnitude), return_lse)
    b_size, n_heads, t, _ = c.shape
    out = np.zeros((b_size, t, n_heads, c.v.shape[-1]))
    lse = np.full((b_size, t, n_heads), -np.inf)  # query padding beyond T_b: 0 and -inf
    mag = np.zeros_like(out)
    for b, n, kvh, i, keys, sink in definition_rows(c, call):
        if not keys and sink is None:
            if c.policy == "uniform":
                out[b, i, n] = c.v[b, :, kvh].mean(axis=0)
                mag[b, i, n] = np.abs(c.v[b, :, kvh]).mean(axis=0)
            elif c.policy == "nan":
                out[b, i, n] = mag[b, i, n] = np.nan
            continue
        # the sink z_n is one more logit of the softmax, with no value (gpt-oss)
        sv = np.array([definition_logit(c, b, n, i, j)[1] for j in keys])
        top = float(np.max(np.append(sv, [] if sink is None else [sink])))  # NaN wins
        if top == -np.inf:  # a -inf sink and no key: nothing to attend
            continue
        e = np.exp(sv - top)
        total = e.sum() + (0.0 if sink is None else math.exp(sink - top))
        lse[b, i, n] = top + math.log(total)
        w = e / total
        if c.keep is not None and c.rate is not None:  # dropout after normalising
            w = np.where(c.keep[b, n, i, keys], w / (1.0 - c.rate), 0.0)
        out[b, i, n] = w @ c.v[b, keys, kvh] if keys else 0.0
        mag[b, i, n] = w @ np.abs(c.v[b, keys, kvh]) if keys else 0.0
    return _returned((out, lse, mag) if return_magnitude else (out, lse), return_lse)


def _returned(res: tuple[np.ndarray, ...], return_lse: bool) -> Any:
    """``o``, ``(o, lse)``, ``(o, |o|_w)`` or ``(o, lse, |o|_w)``, as asked."""
    picked = res if return_lse else (res[0], *res[2:])
    return picked if len(picked) > 1 else picked[0]


def definition_logit(c: KernelCall, b: int, n: int, i: int, j: int) -> tuple[float, float]:
    """``(x, s)`` of query ``i`` and key ``j`` (batch ``b``, query head ``n``), one at a time:
    ``x = scale q_i . k_j`` and ``s = c tanh(x / c) + bias_ij`` (softcap and bias when given)."""
    x = c.scale * float(c.q[b, i, n] @ c.k[b, j, n // c.group])
    s = x if c.softcap is None else c.softcap * math.tanh(x / c.softcap)
    if c.bias is not None:
        s += float(c.bias[b, n, i, j])
    return x, s


def definition_rows(
    c: KernelCall, call: dict[str, Any]
) -> Iterator[tuple[int, int, int, int, list[int], float | None]]:
    """``(b, n, g, i, keys, sink)`` for every query row ``i < T_b`` of a parsed ``call``, one at a
    time: query head ``n`` reads key/value head ``g``, ``keys`` the ones :func:`kernel_allowed`
    allows (by the definition), ``sink`` the head's sink logit (``None``: no sinks)."""
    allowed = kernel_allowed(
        c.shape, call["bias"], call["mask"], method="definition", **pick(call, OPTIONS)
    )
    for b, n in np.ndindex(*c.shape[:2]):
        for i in range(int(c.q_len[b])):
            keys = [j for j in range(c.shape[3]) if allowed[b, n, i, j]]
            yield b, n, n // c.group, i, keys, None if c.sinks is None else float(c.sinks[n])
