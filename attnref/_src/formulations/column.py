"""The column-vector form of "Attention: All you need to know" (far.in.net, 2025-03-29).

The notation (``softmax_col``, ``W_A = W_K^T W_Q``, ``W_I = W_O^T W_V``) is that post's; its
footnote 2 makes column vectors its own choice. The two products are the QK and OV circuits of
Elhage et al. (2021), who write ``A = softmax(x^T W_Q^T W_K x)`` (query ``i`` in row ``i``) and
``W_OV = W_O W_V`` (their ``W_O`` is ``d_model x d_head``): ``W_A`` is the transpose of their
``W_Q^T W_K``, and ``W_I`` is their ``W_OV`` with ``W_O`` stored ``d_v x d_model``.

Tokens are columns, ``X [..., d_model, T]``. Per head, ``A_i = X_kv^T W_A[i] X_q`` (``[j, i]``
scores key ``j`` for query ``i``), ``~A_i = softmax_col(A_i / sqrt(d_k))`` (column-stochastic)
and ``Y = sum_i W_I[i] X_kv ~A_i + b_O 1^T``, ``W_A[i] = W_P[i]^T``, ``W_I[i] = W_M[i]^T``
(grouped-query params: ``W_K``, ``W_V``, ``b_V`` of key/value head ``g = i // G``). Masks and
biases are transposed too, ``[..., T_k, T_q]`` (``M[j, i]``: query ``i`` may read key ``j``).
``b_Q`` adds ``X_kv^T (W_K[g] b_Q[i]) 1^T`` to the scores (``b_K`` cancels in the column
softmax), ``b_V`` adds ``(W_O[i]^T b_V[g]) 1^T`` to the updates. A key column a query may not
read never reaches its output column or gradients (``attnref._src.core.nonfinite``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float

from attnref._src.core import cost as _cost
from attnref._src.core.checks import (
    HIGHEST,
    check_mask_and_bias,
    check_scale,
    check_tokens,
    device_array,
)
from attnref._src.core.common import BLOCK_RETURNS, ROWS, Call, residual_or, scale_value
from attnref._src.core.entry import Level, public
from attnref._src.core.nonfinite import allowed_pairs, nonfinite_rows, reads_nonfinite
from attnref._src.core.params import AttentionParams, w_a_unchecked, w_i_unchecked
from attnref._src.core.registry import Formulation, register
from attnref._src.core.softmax import masked_softmax
from attnref._src.formulations.merged import message_bias, pattern_bias
from attnref._src.formulations.standard import Bias, Keys, Mask, Params, Queries


def column(
    params: AttentionParams,
    x: Float[Array, "... d_model T_q"],
    x_kv: Float[Array, "... d_model T_k"],
    mask: Bool[Array, "... #T_k #T_q"] | None,
    bias: Float[Array, "... #T_k #T_q"] | None,
    scale: Array,
    residual: bool,
) -> Float[Array, "... d_model T_q"]:
    """``Y = sum_i W_I[i] X_kv softmax_col(X_kv^T W_A[i] X * scale + bias, mask) + b_O 1^T``."""
    wa_x = jnp.einsum("hde,...eq->...hdq", w_a_unchecked(params), x, precision=HIGHEST)
    a = jnp.einsum("...dk,...hdq->...hkq", x_kv, wa_x, precision=HIGHEST)  # [..., H, T_k, T_q]
    kb = pattern_bias(params)  # W_K[g] b_Q[i]: X_kv^T (W_K[g] b_Q[i]) 1^T; b_K cancels
    if kb is not None:
        a = a + jnp.einsum("...dk,hd->...hk", x_kv, kb, precision=HIGHEST)[..., None]
    a = a * scale if bias is None else a * scale + jnp.expand_dims(bias, -3)
    a = masked_softmax(a, None if mask is None else jnp.expand_dims(mask, -3), axis=-2)
    u = jnp.einsum("hed,...dk->...hek", w_i_unchecked(params), x_kv, precision=HIGHEST)
    ob = message_bias(params)  # W_O[i]^T b_V[g]                      [H, d_model]
    u = u if ob is None else u + ob[..., None]  # W_I[i] X_kv + (W_O[i]^T b_V[g]) 1^T
    y = jnp.sum(jnp.einsum("...hek,...hkq->...heq", u, a, precision=HIGHEST), axis=-3)
    y = y if params.b_o is None else y + jnp.asarray(params.b_o)[:, None]
    return residual_or(y, x, residual)


def column_rows(
    params: Params, x_q: Queries, x_kv: Keys, mask: Mask, bias: Bias, scale: Array, residual: bool
) -> Float[Array, "... T_q d_model"]:
    """:func:`column` behind the row convention: ``Y^T`` of the transposed inputs."""

    def t(a: Any) -> Any:
        return None if a is None else jnp.swapaxes(a, -1, -2)

    return t(column(params, t(x_q), t(x_kv), t(mask), t(bias), scale, residual))


# ----------------------------------------------------------------------------- the column level


def _columns(
    params: AttentionParams,
    x: Float[ArrayLike, "... d_model T_q"],
    x_kv: Float[ArrayLike, "... d_model T_k"] | None = None,
    *,
    mask: Bool[ArrayLike, "... T_k T_q"] | None = None,
    bias: Float[ArrayLike, "... T_k T_q"] | None = None,
    scale: float | None = None,
    residual: bool = False,
) -> Call:
    x_kv = x if x_kv is None else x_kv
    batch, t_q, t_k = check_tokens(params, x, x_kv, layout="column", names=("x", "x_kv"))
    check_mask_and_bias(mask, bias, (*batch, t_k, t_q), axes="[..., T_k, T_q]")
    check_scale(scale)
    xq, xkv = device_array(x), device_array(x_kv)
    m = None if mask is None else device_array(mask)
    b = None if bias is None else device_array(bias, xq.dtype)
    s = scale_value(params.d_k, scale, xq.dtype)
    rows = ColumnRows(xq, xkv, m, b, bool(residual), (*batch, t_q, t_k))
    return Call((params, xq, xkv, m, b, s, residual), rows)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ColumnRows:
    """The column level's validated tokens, mask and bias (``[..., T_k, T_q]``), whose
    :meth:`dirty_rows` runs inside the compiled program; ``pairs``: ``(*batch, T_q, T_k)``."""

    x: Array
    x_kv: Array
    mask: Array | None
    bias: Array | None
    residual: bool
    pairs: tuple[int, ...]

    def dirty_rows(self) -> Array:
        """``[..., 1, T_q]``: the columns of ``Y`` that read a non-finite value."""
        m_rows, b_rows = (
            None if a is None else jnp.swapaxes(a, -1, -2) for a in (self.mask, self.bias)
        )
        allowed = allowed_pairs(m_rows, b_rows, self.pairs)
        bad_q, bad_kv = nonfinite_rows(self.x, axis=-2), nonfinite_rows(self.x_kv, axis=-2)
        dirty = reads_nonfinite(allowed, bad_q, bad_kv, b_rows, self.residual)  # [..., T_q]
        return dirty[..., None, :]


COLUMNS = Level(
    _columns,
    """Args:
    params: Per-head weights (:class:`attnref.AttentionParams`, stored in row convention);
        ``W_A[i] = W_P[i]^T`` and ``W_I[i] = W_M[i]^T`` are formed from them.
    x: Query tokens as columns, ``[..., d_model, T_q]``, the dtype of ``params``.
    x_kv: Key/value tokens as columns, ``[..., d_model, T_k]``, with the batch shape of
        ``x``; ``None`` (default) means ``x`` (self-attention).
    mask: Boolean in the transposed layout, broadcastable to ``[..., T_k, T_q]``
        (``mask[..., j, i]``: query ``i`` may read key ``j``); ``None`` (default) allows all.
    bias: Floating additive bias, broadcastable to ``[..., T_k, T_q]`` (transposed like
        ``mask``), added to the scaled scores; cast to the dtype of ``x``.
    scale: The score scale; ``None`` (default) means ``1/sqrt(d_k)``.
    residual: If ``True``, return ``X + Y`` (the residual-stream update).

Raises:
    ValueError: If ``params`` is malformed, ``x``/``x_kv`` have rank < 2, the wrong
        ``d_model`` or different batch shapes, ``mask``/``bias`` do not broadcast to
        ``[..., T_k, T_q]``, or ``scale`` is not a scalar.
    TypeError: If ``x``, ``x_kv`` and ``params`` mix dtypes, ``mask`` is not boolean,
        ``bias`` is not floating, or ``scale`` is not a real number.""",
)

column_form = public(
    COLUMNS,
    column,
    name="column_form",
    summary="``Y = sum_i W_I[i] X_kv softmax_col(X_kv^T W_A[i] X / sqrt(d_k)) + b_O`` (columns).",
    returns="``Y`` as columns, ``[..., d_model, T_q]``; a fully masked query column is ``b_O``\n"
    "    (zero without biases).",
)
column_attention = public(
    ROWS,
    column_rows,
    name="column_attention",
    summary=":func:`column_form` behind the row-convention signature (transposes in and out).\n\n"
    "Same values as :func:`attnref.concat_attention`; ``mask`` and ``bias`` are in the row\n"
    "layout ``[..., T_q, T_k]`` here and are transposed for :func:`column_form`.",
    returns=BLOCK_RETURNS,
)


# ----------------------------------------------------------------------------- registry entry

COLUMN = (
    "The column form and its notation (softmax_col, W_A = W_K^T W_Q, W_I = W_O^T W_V): "
    "Attention: All you need to know (far.in.net, 2025-03-29), column vectors by its own choice "
    "(footnote 2). The two products: the QK and OV circuits of Elhage et al. (2021), A "
    "Mathematical Framework for Transformer Circuits, Transformer Circuits Thread, written "
    "A = softmax(x^T W_Q^T W_K x) and W_OV = W_O W_V."
)


def column_cost(d: _cost.Dims) -> _cost.Cost:
    b, h, dm, tq, tk = d.batch, d.heads, d.d_model, d.t_q, d.t_k
    logits = b * h * tq * tk
    mm = (
        2 * h * dm * d.d_k * dm
        + 2 * h * dm * dm * b * tq
        + 2 * logits * dm
        + 2 * h * dm * d.d_v * dm
        + 2 * h * dm * dm * b * tk
        + 2 * logits * dm
    )
    el = _cost.softmax_elementwise(d) + b * (h - 1) * tq * dm
    if d.bias:
        mm += 2 * h * dm * d.d_k + 2 * b * tk * dm * h + 2 * h * d.d_v * dm
        el += logits + b * h * tk * dm + b * tq * dm
    tensors = [
        h * dm * dm,
        b * h * dm * tq,
        *_cost.softmax_tensors(d, logits),
        b * h * tk,
        h * dm * dm,
        b * h * dm * tk,
        b * h * dm * tq,
        b * dm * tq,
        b * (tq + tk) * dm,
        b * tq * dm,
    ]  # row-adapter transposes in and out
    return _cost.finish(d, mm, el, logits, tensors)


register(
    Formulation(
        id="column",
        title='Column-vector form ("Attention: All you need to know")',
        equation=(
            r"Y = \sum_{i=1}^{H} W_{I,i} X_{kv}\, \sigma_{\mathrm{col}}\!\Big(\frac{X_{kv}^\top"
            r" W_{A,i} X}{\sqrt{d_k}}\Big) + b_O \mathbf{1}^\top,\quad W_{A,i} = W_{K,i}^\top"
            r" W_{Q,i},\ W_{I,i} = W_{O,i}^\top W_{V,i}\ \text{(column convention)}"
        ),
        convention="column",
        citation=COLUMN,
        apply=column_attention,
        formula=column,
        native=column_form,
        summary="Tokens as columns (d_model x T); sigma is a scaled, masked column softmax.",
        cost=(
            "As patterns_messages (the same products, transposed); memory "
            "O(H (T_q + T_k) d_model + H T_q T_k)."
        ),
        cost_model=column_cost,
    )
)
