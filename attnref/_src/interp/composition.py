"""Composition scores between heads of consecutive layers, and alignment with embedding tables.

**Composition** (Elhage et al. 2021; ``docs/probes.md``). The paper's ``W_QK = W_Q^T W_K`` and
``W_OV = W_O W_V`` are, in attnref's rows, ``W_P = W_Q W_K^T`` and ``W_M^T = (W_V W_O)^T``. Head
``h1`` of layer ``l`` writes ``y W_M1``; head ``h2`` of layer ``l + 1`` reads it into its queries
(**Q**: ``||W_M1 W_P2||_F / (||W_M1||_F ||W_P2||_F)``), keys (**K**: ``||W_P2 W_M1^T||_F / (...)``)
or values (**V**: ``||W_M1 W_M2||_F / (||W_M1||_F ||W_M2||_F)``). Each score is in ``[0, 1]``,
computed from the thin factors with ``||X C Y||_F^2 = tr(C^T (X^T X) C (Y Y^T))``. Weights only
(no biases, nothing between the layers): an overlap of subspaces, not a causal effect; random
heads score about ``1 / sqrt(d_model)`` (:func:`composition_baseline`).

**Alignment** (:func:`top_aligned`): the embedding rows (vocabulary or positions) most aligned
with model-space directions such as patterns or messages, as the seeds propose ("Reframing
Attention", 2025-02-18).
"""

from __future__ import annotations

from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float, Int

from attnref._src.core.checks import check_params, float64_scoped
from attnref._src.core.common import HIGHEST
from attnref._src.core.entry import compiled
from attnref._src.core.params import AttentionParams, init_params, repeat_kv_heads_unchecked

Kind = Literal["q", "k", "v"]


def _ein(spec: str, *ops: Any) -> Array:
    return jnp.einsum(spec, *ops, precision=HIGHEST)


def _gram(w: Array) -> Array:
    """``W^T W`` per head for ``w [H, d_model, d]``: ``[H, d, d]``."""
    return _ein("hmd,hme->hde", w, w)


def _sq_norm(x_gram: Array, c: Array, yy: Array) -> Array:
    """``||X C Y||_F^2 = tr(C^T (X^T X) C (Y Y^T))`` for ``c [H1, H2, a, b]``,
    ``x_gram [H1 or H2, a, a]`` broadcast on the axis the caller chose, ``yy [.., b, b]``."""
    return jnp.sum(
        _ein("...ab,...bc->...ac", x_gram, c) * _ein("...ab,...bc->...ac", c, yy), (-2, -1)
    )


@float64_scoped
def composition_scores(
    first: AttentionParams, second: AttentionParams, kind: Kind
) -> Float[Array, "H1 H2"]:
    """Q-, K- or V-composition scores ``[H1, H2]`` in ``[0, 1]`` from every head ``h1`` of
    ``first`` (an earlier layer, the writer) to every head ``h2`` of ``second`` (the next layer,
    the reader, with the same ``d_model``); module docstring for the definitions. ``kind``
    (``"q"``, ``"k"`` or ``"v"``) names the input of ``second`` that the output of ``first``
    feeds. A score whose denominator has a zero norm is 0; grouped-query heads are scored per
    query head. ``ValueError`` for malformed params, different ``d_model`` or an unknown kind.
    """
    check_params(first)
    check_params(second)
    if first.d_model != second.d_model:
        raise ValueError(
            f"the layers have different d_model ({first.d_model} and {second.d_model})"
        )
    if kind not in ("q", "k", "v"):
        raise ValueError(f"unknown composition kind {kind!r}; expected 'q', 'k' or 'v'")
    return compiled(_scores, first, second, kind)  # type: ignore[no-any-return]


def _scores(first: AttentionParams, second: AttentionParams, kind: Kind) -> Array:
    """:func:`composition_scores` of validated layers."""
    a, b = repeat_kv_heads_unchecked(first), repeat_kv_heads_unchecked(second)
    v1, o1 = jnp.asarray(a.w_v), jnp.asarray(a.w_o)
    q2, k2, v2, o2 = (jnp.asarray(w) for w in (b.w_q, b.w_k, b.w_v, b.w_o))
    g_v1, oo1 = _gram(v1), _ein("hvd,hwd->hvw", o1, o1)
    norm_m1 = jnp.sqrt(jnp.einsum("hab,hba->h", g_v1, oo1))  # ||W_M1||_F
    oo2 = _ein("gwd,gxd->gwx", o2, o2)
    if kind == "q":  # ||W_V1 (W_O1 W_Q2) W_K2^T||
        num = _sq_norm(g_v1[:, None], _ein("hvd,gdk->hgvk", o1, q2), _gram(k2)[None])
    elif kind == "k":  # ||W_Q2 (W_K2^T W_O1^T) W_V1^T||
        num = _sq_norm(_gram(q2)[None], _ein("gdk,hvd->hgkv", k2, o1), g_v1[:, None])
    else:  # "v": ||W_V1 (W_O1 W_V2) W_O2||
        num = _sq_norm(g_v1[:, None], _ein("hvd,gdw->hgvw", o1, v2), oo2[None])
    pair = (_gram(v2), oo2) if kind == "v" else (_gram(q2), _gram(k2))
    norm_2 = jnp.sqrt(jnp.einsum("gab,gba->g", *pair))  # ||W_P2||_F or ||W_M2||_F
    denom = norm_m1[:, None] * norm_2[None, :]
    num = jnp.sqrt(jnp.maximum(num, 0.0))
    return jnp.where(denom > 0, num / jnp.where(denom > 0, denom, 1.0), 0.0)


def composition_baseline(
    first: AttentionParams, second: AttentionParams, kind: Kind, *, seeds: int = 8
) -> float:
    """The mean score of ``kind`` between random Gaussian heads of the shapes of ``first`` and
    ``second`` (Elhage et al. 2021's baseline: about ``1 / sqrt(d_model)`` whatever the head
    widths), a Python float over all head pairs of ``seeds`` pairs of float64 multi-head
    :func:`attnref.init_params` draws (seeds ``0 .. 2 seeds - 1``). Arguments and errors as
    :func:`composition_scores`.
    """
    h1, d_model, _, d_v1 = check_params(first)
    h2, d_model2, d_k2, d_v2 = check_params(second)
    if d_model != d_model2:  # as composition_scores: the layers must share one residual stream
        raise ValueError(f"the layers have different d_model ({d_model} and {d_model2})")
    vals = []
    shape1 = {"num_heads": h1, "d_k": first.d_k, "d_v": d_v1}
    shape2 = {"num_heads": h2, "d_k": d_k2, "d_v": d_v2}
    for s in range(seeds):
        r1 = init_params(2 * s, d_model=d_model, **shape1, bias=False, dtype=np.float64)
        r2 = init_params(2 * s + 1, d_model=d_model, **shape2, bias=False, dtype=np.float64)
        vals.append(float(np.mean(np.asarray(composition_scores(r1, r2, kind)))))
    return float(np.mean(vals))


@float64_scoped
def _top_aligned(vectors: ArrayLike, table: ArrayLike, k: int, metric: str) -> tuple[Array, Array]:
    v, t = jnp.asarray(vectors), jnp.asarray(table)
    sims = _ein("...d,vd->...v", v, t)
    if metric == "cosine":
        denom = jnp.linalg.norm(v, axis=-1, keepdims=True) * jnp.linalg.norm(t, axis=-1)
        sims = jnp.where(denom > 0, sims / jnp.where(denom > 0, denom, 1.0), 0.0)
    values, indices = jax.lax.top_k(sims, k)
    return values, indices


def top_aligned(
    vectors: Float[ArrayLike, "... d_model"],
    table: Float[ArrayLike, "V d_model"],
    k: int = 10,
    *,
    metric: Literal["cosine", "dot"] = "cosine",
) -> tuple[Float[Array, "... k"], Int[Array, "... k"]]:
    """The ``k`` rows of ``table [V, d_model]`` best aligned with each of ``vectors [...,
    d_model]``: ``(values, indices)``, each ``[..., k]``, best first; ``1 <= k <= V``.

    ``metric="cosine"``: ``<v, e_t> / (|v| |e_t|)`` (zero rows score 0); ``"dot"``:
    ``<v, e_t>``. ``jax.jit``-able with ``k`` and ``metric`` static; try a singular vector as
    ``v`` and ``-v``. ``ValueError`` for an unknown metric, a mismatched table or ``k`` out of
    range.
    """
    if metric not in ("cosine", "dot"):
        raise ValueError(f"unknown metric {metric!r}; expected 'cosine' or 'dot'")
    if np.ndim(table) != 2 or np.shape(table)[-1] != np.shape(vectors)[-1]:
        raise ValueError(
            f"table must be [V, d_model] matching vectors [..., d_model]; got {np.shape(table)} "
            f"and {np.shape(vectors)}"
        )
    if not 1 <= k <= np.shape(table)[0]:
        raise ValueError(f"k={k} must be between 1 and the table's {np.shape(table)[0]} rows")
    return _top_aligned(vectors, table, int(k), metric)
