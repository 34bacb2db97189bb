"""Per-query "soft search": one query vector at a time, in model space.

For one query token ``x_q`` (a row of length ``d_model``) and key tokens ``X_kv [T_k, d_model]``,
head ``i`` forms its pattern ``p_i = x_q W_P[i] + b_Q[i] W_K[g]^T``, scores every key by
``alpha_i = softmax(X_kv p_i^T / sqrt(d_k))`` and returns ``o = sum_i alpha_i M_i + b_O``
with ``M_i = X_kv W_M[i] + b_V[g] W_O[i]`` (``g = i // G``), ``vmap``ped over queries and batch
dims in the batched form. A key the query may not read never reaches its output or gradients
(``attnref._src.core.nonfinite``). Seed: "Refactoring the Attention Equations" (2025-02-19).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Float

from attnref._src.core import cost as _cost
from attnref._src.core.checks import HIGHEST, check_params, check_scale, device_array
from attnref._src.core.common import (
    BLOCK_RETURNS,
    ROWS,
    Call,
    add_output_bias,
    residual_or,
    scale_value,
)
from attnref._src.core.entry import Level, public
from attnref._src.core.nonfinite import allowed_pairs, nonfinite_rows, reads_nonfinite
from attnref._src.core.params import AttentionParams, w_p_unchecked
from attnref._src.core.registry import Formulation, register
from attnref._src.core.softmax import masked_softmax
from attnref._src.formulations.merged import compute_messages, pattern_bias, patterns_messages_cost
from attnref._src.formulations.standard import Bias, Keys, Mask, Params, Queries


def search(
    params: AttentionParams,
    x_q: Float[Array, " d_model"],
    x_kv: Float[Array, "T_k d_model"],
    mask: Bool[Array, " T_k"],
    bias: Float[Array, " T_k"],
    scale: Array,
) -> Float[Array, " d_model"]:
    """``o = sum_i softmax(X_kv p_i^T * scale + bias, mask) M_i + b_O`` for one query."""
    p = jnp.einsum("d,hde->he", x_q, w_p_unchecked(params), precision=HIGHEST)
    qb = pattern_bias(params)
    p = p if qb is None else p + qb  # p_i = x_q W_P[i] + b_Q[i] W_K[g]^T     [H, d_model]
    s = jnp.einsum("he,ke->hk", p, x_kv, precision=HIGHEST) * scale + bias  #  [H, T_k]
    alpha = masked_softmax(s, mask)  # alpha_i                              [H, T_k]
    m = compute_messages(params, x_kv)  # M_i                           [H, T_k, d_model]
    o = jnp.sum(jnp.einsum("hk,hke->he", alpha, m, precision=HIGHEST), axis=0)
    return add_output_bias(o, params)  # sum_i alpha_i M_i + b_O


def search_rows(
    params: Params, x_q: Queries, x_kv: Keys, mask: Mask, bias: Bias, scale: Array, residual: bool
) -> Float[Array, "... T_q d_model"]:
    """:func:`search` ``vmap``-ed over the queries, then over the flattened batch dims."""
    *batch, t_q, d = x_q.shape
    full = (*batch, t_q, x_kv.shape[-2])
    m = jnp.ones(full, bool) if mask is None else jnp.broadcast_to(mask, full)
    b = jnp.zeros(full, x_q.dtype) if bias is None else jnp.broadcast_to(bias, full)

    def one(xq1: Array, xkv1: Array, m1: Array, b1: Array) -> Array:
        return search(params, xq1, xkv1, m1, b1, scale)

    per_query = jax.vmap(one, in_axes=(0, None, 0, 0))
    flat = (a.reshape(-1, *a.shape[len(batch) :]) for a in (x_q, x_kv, m, b))
    y = jax.vmap(per_query)(*flat).reshape(*batch, t_q, d)
    return residual_or(y, x_q, residual)


# ----------------------------------------------------------------------------- the one-query level


def _one_query(
    params: AttentionParams,
    x_q: Float[ArrayLike, " d_model"],
    x_kv: Float[ArrayLike, "T_k d_model"],
    *,
    mask: Bool[ArrayLike, " T_k"] | None = None,
    bias: Float[ArrayLike, " T_k"] | None = None,
    scale: float | None = None,
) -> Call:
    _, d_model, d_k, _ = check_params(params)
    if jnp.ndim(x_q) != 1 or jnp.shape(x_q)[0] != d_model:
        raise ValueError(f"x_q must be one query of shape ({d_model},), got {jnp.shape(x_q)}")
    if jnp.ndim(x_kv) != 2 or jnp.shape(x_kv)[1] != d_model:
        raise ValueError(f"x_kv must have shape [T_k, {d_model}], got {jnp.shape(x_kv)}")
    t_k = jnp.shape(x_kv)[0]
    for name, arr in (("mask", mask), ("bias", bias)):
        if arr is not None and jnp.shape(arr) != (t_k,):
            raise ValueError(f"{name} must have shape ({t_k},) for one query, got {jnp.shape(arr)}")
    m_in, b_in = (None if a is None else device_array(a) for a in (mask, bias))
    if m_in is not None and m_in.dtype != jnp.bool_:  # worded as prepare_rows words it
        raise TypeError(
            f"mask must be boolean (True = may attend), got dtype {m_in.dtype}; pass additive "
            "scores through bias instead"
        )
    if b_in is not None and not jnp.issubdtype(b_in.dtype, jnp.floating):
        raise TypeError(f"bias must be floating, got dtype {b_in.dtype}")
    check_scale(scale)
    xq, xkv = device_array(x_q), device_array(x_kv)
    if xq.dtype != xkv.dtype or xq.dtype != device_array(params.w_q).dtype:
        raise TypeError(f"x_q {xq.dtype}, x_kv {xkv.dtype} and params must share one dtype")
    m = device_array(np.ones((t_k,), bool)) if m_in is None else m_in
    b = device_array(np.zeros((t_k,), xq.dtype)) if b_in is None else device_array(b_in, xq.dtype)
    s = scale_value(d_k, scale, xq.dtype)
    return Call((params, xq, xkv, m, b, s), OneQueryRows(xq, xkv, m, b))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class OneQueryRows:
    """The one-query level's validated tokens, mask and bias, whose :meth:`dirty_rows` runs
    inside the compiled program."""

    x_q: Array
    x_kv: Array
    mask: Array
    bias: Array

    def dirty_rows(self) -> Array:
        """0-d: whether the one output row reads a non-finite value through an allowed key."""
        allowed = allowed_pairs(self.mask, self.bias, self.mask.shape)[None]  # [1, T_k]
        bad_q, bad_kv = nonfinite_rows(self.x_q)[None], nonfinite_rows(self.x_kv)
        return reads_nonfinite(allowed, bad_q, bad_kv, self.bias[None])[0]


ONE_QUERY = Level(
    _one_query,
    """Args:
    params: Per-head weights (:class:`attnref.AttentionParams`); ``W_P[i]`` and ``W_M[i]``
        (and the bias terms ``b_Q[i] W_K[g]^T``, ``b_V[g] W_O[i]``) are formed from them.
    x_q: One query token, a row vector ``[d_model]``, the dtype of ``params``.
    x_kv: The key/value tokens ``[T_k, d_model]`` (no batch dims), the dtype of ``x_q``.
    mask: Boolean ``[T_k]``, ``True`` = the query may read that key; ``None`` (default)
        allows every key.
    bias: Additive bias ``[T_k]`` on the scaled scores (``-inf`` masks like ``False``);
        cast to the dtype of ``x_q``.
    scale: The score scale; ``None`` (default) means ``1/sqrt(d_k)``.

Raises:
    ValueError: If ``params`` is malformed, ``x_q`` is not ``[d_model]``, ``x_kv`` is not
        ``[T_k, d_model]``, ``mask``/``bias`` are not ``[T_k]``, or ``scale`` is not a
        scalar.
    TypeError: If ``x_q``, ``x_kv`` and ``params`` do not share one dtype, ``mask`` is not
        boolean, ``bias`` is not floating, or ``scale`` is not a real number.""",
)

soft_search = public(
    ONE_QUERY,
    search,
    name="soft_search",
    summary="One query: ``o = sum_i softmax(X_kv (x_q W_P[i])^T / sqrt(d_k)) M_i + b_O``.",
    returns="The query's block output ``o``, ``[d_model]``; ``b_O`` (zero without biases) when\n"
    "    no key is allowed.",
)
soft_search_attention = public(
    ROWS,
    search_rows,
    name="soft_search_attention",
    summary=":func:`soft_search` ``vmap``-ed over queries and then over flattened batch dims.",
    returns=BLOCK_RETURNS,
)


# ----------------------------------------------------------------------------- registry entry


def soft_search_cost(d: _cost.Dims) -> _cost.Cost:
    """vmap leaves query-independent work unbatched: the same counts as patterns x messages;
    the workspace adds the full mask and bias broadcasts and the flattened batch copies."""
    c = patterns_messages_cost(d)
    extra = (2 * d.batch * d.t_q * d.t_k + d.batch * (d.t_q + 2 * d.t_k) * d.d_model) * d.itemsize
    return dataclasses.replace(c, workspace_bytes=c.workspace_bytes + extra)


register(
    Formulation(
        id="soft_search",
        title="Per-query soft search",
        equation=(
            r"o = \sum_{i=1}^{H} \mathrm{softmax}\!\Big(\frac{X_{kv}\, p_i^\top}{\sqrt{d_k}}"
            r"\Big)^{\!\top} M_i + b_O,\quad p_i = x_q W_{P,i} + b_{Q,i} W_{K,i}^\top"
        ),
        convention="single-query",
        citation="Refactoring the Attention Equations: Patterns and Messages (2025-02-19), "
        "single-query version; search perspective of Attention: All you need to know (2025-03-29).",
        apply=soft_search_attention,
        formula=search,
        native=soft_search,
        summary=(
            "One query vector at a time searches the keys with its pattern; vmapped over queries."
        ),
        cost=(
            "As patterns_messages: written one query at a time, but vmap leaves the "
            "query-independent work (W_P, W_M and the messages X_kv W_M) unbatched, so it is "
            "computed once (XLA's FLOP count equals patterns_messages'); memory "
            "O(H (T_q + T_k) d_model + H T_q T_k)"
        ),
        cost_model=soft_search_cost,
    )
)
