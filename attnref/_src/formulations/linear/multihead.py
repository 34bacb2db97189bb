"""Multi-head linear attention: per-head projections, a kernel-level form, the output mixing.

Row vectors: ``q_i = x_q W_Q[i] + b_Q[i]``, ``k_i = x_kv W_K[i // G] + b_K[i // G]``, likewise
``v_i``; the kernel-level form (:mod:`attnref._src.formulations.linear.kernel`) gives ``z_i`` and
``y = sum_i z_i W_O[i] + b_O`` (:func:`multihead`, behind every ``linear_<form>_attention``).
``linear_messages_attention`` mixes ``X_kv W_M[i]`` with the normalised linear weights instead.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float, Real

from attnref._src.core.checks import HIGHEST, check_tokens, device_array
from attnref._src.core.common import (
    Keys,
    Queries,
    add_output_bias,
    project,
    project_kv,
    residual_or,
)
from attnref._src.core.entry import Level, public
from attnref._src.core.params import AttentionParams
from attnref._src.formulations.feature_maps import FeatureMapLike, check_feature_map
from attnref._src.formulations.linear.common import (
    EpsPolicy,
    Form,
    Options,
    RowCall,
    check_causal,
    check_key_mask,
    check_mode,
    check_policy,
    with_chunk_size,
)
from attnref._src.formulations.linear.kernel import (
    CAUSAL_ARG,
    CHUNK_ARG,
    OPTION_ARGS,
    RAISES,
    associative,
    chunked,
    kernel_matrix,
    prefix_sum,
    quadratic,
    recurrent,
)
from attnref._src.formulations.merged import compute_messages


def multihead(
    params: AttentionParams, x_q: Queries, x_kv: Keys, o: Options, residual: bool
) -> Float[Array, "... T_q d_model"]:
    """``y = sum_i z_i W_O[i] + b_O``, ``z_i`` the kernel-level form on head ``i``'s
    ``q_i = x_q W_Q[i] + b_Q[i]`` and its key/value head's ``k_i``, ``v_i``."""
    assert o.form is not None
    g = params.group_size
    # heads on the second-to-last axis (the kernel level's layout): [..., T, H, d]
    q = jnp.swapaxes(project(x_q, params.w_q, params.b_q), -3, -2)
    k = jnp.swapaxes(project_kv(x_kv, params.w_k, params.b_k, g), -3, -2)
    v = jnp.swapaxes(project_kv(x_kv, params.w_v, params.b_v, g), -3, -2)
    z = o.form(q, k, v, o)  # z_i  [..., T_q, H, d_v]
    y = jnp.einsum("...qhv,hvd->...qd", z, params.w_o, precision=HIGHEST)
    return residual_or(add_output_bias(y, params), x_q, residual)


def messages(
    params: AttentionParams, x_q: Queries, x_kv: Keys, o: Options, residual: bool
) -> Float[Array, "... T_q d_model"]:
    """``y = sum_i A_i (X_kv W_M[i] + b_V[i // G] W_O[i]) + b_O`` with the normalised linear
    attention matrix ``A_i = rownorm(phi(Q_i) phi(K_i)^T)`` (masked)."""
    g = params.group_size
    q = jnp.swapaxes(project(x_q, params.w_q, params.b_q), -3, -2)
    k = jnp.swapaxes(project_kv(x_kv, params.w_k, params.b_k, g), -3, -2)
    fq, fk, c = o.features(q, k)
    a = kernel_matrix(fq, fk, o.causal)  # [..., H, T_q, T_k]
    den = jnp.sum(a, axis=-1)  # [..., H, T_q]
    c = None if c is None else jnp.swapaxes(c, -1, -2)  # [..., H, T_q], as den
    a = o.normalize(a, den, c)  # row-normalised, zero rows where den = 0
    msgs = compute_messages(params, x_kv)  # X_kv W_M[i] + b_V[i // G] W_O[i]
    y = jnp.sum(jnp.einsum("...hqk,...hkd->...hqd", a, msgs, precision=HIGHEST), axis=-3)
    return residual_or(add_output_bias(y, params), x_q, residual)


# ----------------------------------------------------------------------------- the row level
#
# One validation for every form, as at the kernel level: ``form`` (``None``: the messages form),
# ``modes`` and the default of ``causal`` are bound by ``functools.partial``.


def prepare_rows(
    form: Form | None,
    modes: tuple[bool, ...],
    params: AttentionParams,
    x_q: Float[ArrayLike, "... T_q d_model"],
    x_kv: Float[ArrayLike, "... T_k d_model"] | None = None,
    *,
    feature_map: FeatureMapLike,
    causal: bool,
    key_mask: Bool[ArrayLike, "... T_k"] | None = None,
    eps: Real[ArrayLike, ""] = 0.0,
    eps_policy: EpsPolicy = "add",
    residual: bool = False,
) -> RowCall:
    """Validate a multi-head call of ``form``: the one validation of the row level."""
    check_feature_map(feature_map)
    x_kv = x_q if x_kv is None else x_kv
    batch, t_q, t_k = check_tokens(params, x_q, x_kv)  # validates params too
    check_mode(form, modes, causal)
    check_causal(causal)
    check_key_mask(key_mask, batch, t_q, t_k, causal)
    check_policy(eps, eps_policy)
    km = None if key_mask is None else device_array(key_mask)
    o = Options(feature_map, eps, eps_policy, causal, km, form=form)
    return RowCall(params, device_array(x_q), device_array(x_kv), o, residual)


ROW_ARGS = (
    """Args:
    params: Per-head weights (:class:`attnref.AttentionParams`); query head ``i`` reads
        key/value head ``i // G`` (``G = H / K``).
    x_q: Query tokens, row vectors ``[..., T_q, d_model]``, the dtype of ``params``.
    x_kv: Key/value tokens ``[..., T_k, d_model]`` with the batch shape of ``x_q``;
        ``None`` (default) means ``x_q`` (self-attention)."""
    + OPTION_ARGS.format(
        causal=CAUSAL_ARG,
        x="``x_q``",
        more="\n    residual: If ``True``, return ``x_q + y`` (the residual-stream update).{chunk}",
    )
    + RAISES.format(
        shapes="``params`` is malformed, ``x_q``/``x_kv`` are not ``[..., T, d_model]``\n"
        "        with one batch shape,",
        dtypes="``x_q``, ``x_kv`` and ``params`` mix dtypes,",
    )
)
RETURNS = (
    "The block output ``[..., T_q, d_model]``, the dtype of ``x_q``; a query with no allowed\n"
    "    key gets ``b_O`` (zero without biases)."
)


def multihead_form(
    form: Form | None, modes: tuple[bool, ...], summary: str, name: str
) -> Callable[..., Array]:
    """The public multi-head function ``name`` of ``form``: validate, scope float64, guard."""
    prepare = with_chunk_size(prepare_rows) if form is chunked else prepare_rows
    bound = functools.partial(prepare, form, modes, causal=modes[0])
    level = Level(bound, ROW_ARGS.format(chunk=CHUNK_ARG if form is chunked else ""))
    formula = messages if form is None else multihead
    return public(level, formula, name=name, summary=summary, returns=RETURNS)


def linear_form(form: Form, modes: tuple[bool, ...]) -> Callable[..., Array]:
    """``linear_<form>_attention``: :func:`linear_<form>` on the heads, then ``W_O``."""
    name = form.__name__
    summary = (
        f"Multi-head linear attention, {name} form: :func:`linear_{name}` on the heads\n"
        "``q_i = x_q W_Q[i] + b_Q[i]``, ``k_i = x_kv W_K[i // G] + b_K[i // G]``,\n"
        "``v_i = x_kv W_V[i // G] + b_V[i // G]`` (``G = H / K``), then\n"
        "``y = sum_i z_i W_O[i] + b_O``. Row vectors, batch dims lead."
    )
    return multihead_form(form, modes, summary, f"linear_{name}_attention")


linear_quadratic_attention = linear_form(quadratic, (False, True))
linear_associative_attention = linear_form(associative, (False,))
linear_prefix_sum_attention = linear_form(prefix_sum, (True,))
linear_recurrent_attention = linear_form(recurrent, (True,))
linear_chunked_attention = linear_form(chunked, (True,))
linear_messages_attention = multihead_form(
    None,
    (False, True),
    "Messages form: ``sum_i A_i (X_kv W_M[i] + b_V[i // G] W_O[i]) + b_O`` with the normalised\n"
    "linear attention matrix ``A_i = rownorm(phi(Q_i) phi(K_i)^T)`` (masked), ``K_i`` projected\n"
    "by key/value head ``i // G``.",
    "linear_messages_attention",
)
