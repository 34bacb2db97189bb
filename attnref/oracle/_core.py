"""Oracle core: multi-head attention from its definition, per head and per query (NumPy, float64).

For batch index ``b``, query head ``i`` and query ``t`` (row convention, Vaswani et al. 2017),
with ``g = i // G`` the key/value head of query head ``i``::

    q   = x_q[b, t] W_Q[i] + b_Q[i]
    s_j = (q . (x_kv[b, j] W_K[g] + b_K[g])) * scale + bias[b, t, j]   for allowed keys j
    p_j = exp(s_j - max_j s_j) / sum_j exp(s_j - max_j s_j)             (0 if no key is allowed)
    y[b, t] += sum_j p_j (x_kv[b, j] W_V[g] + b_V[g]) W_O[i]
    y[b, t] += b_O   (once)

``W_Q [H, d_model, d_k]``, ``W_O [H, d_v, d_model]`` per query head; ``W_K [K, d_model, d_k]``,
``W_V [K, d_model, d_v]`` (and ``b_K``, ``b_V``) per key/value head, ``H = K G`` (grouped-query
attention, Ainslie et al. 2023; ``K = 1``: multi-query, Shazeer 2019). ``scale`` defaults to
``1/sqrt(d_k)``; a key is allowed where ``mask`` is True and ``bias`` is not ``-inf``; a query
with no allowed key outputs ``b_O``.

``emulate=dtype`` rounds every intermediate to ``dtype`` (a same-precision reference, for the
comparative rule of :mod:`attnref.tolerance`). ``method="definition"`` runs the loops above;
``"fast"`` (default) uses float64 BLAS for every head of a batch element, streamed over query
blocks whose ``[H, block, T_k]`` temporaries stay within :data:`_BUDGET_BYTES`, each key/value
head projected once and indexed by its ``G`` query heads (so grouped parameters and their
multi-head twin agree bit for bit).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from ._checks import PARAM_BIASES, PARAM_WEIGHTS, check_method, check_weight_level
from ._doc import WEIGHT, WEIGHT_RAISES, doc, method_option, signed, weight_call

FIELDS = PARAM_WEIGHTS + PARAM_BIASES
Params = dict[str, np.ndarray | None]


def get_param(params: Any, name: str) -> np.ndarray | None:
    """``params.name`` (or ``params[name]``) as a float64 array, ``None`` where absent."""
    value = params.get(name) if isinstance(params, dict) else getattr(params, name, None)
    return None if value is None else np.asarray(value, dtype=np.float64)


def unpack(params: Any) -> Params:
    """The parameters as float64 arrays (weights required)."""
    out = {name: get_param(params, name) for name in FIELDS}
    for name in PARAM_WEIGHTS:
        if out[name] is None:
            raise ValueError(f"params.{name} is required")
    return out


def head_weights(w: Params) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(W_Q, W_K, W_V, W_O)`` of unpacked parameters (each present)."""
    w_q, w_k, w_v, w_o = w["w_q"], w["w_k"], w["w_v"], w["w_o"]
    assert w_q is not None and w_k is not None and w_v is not None and w_o is not None
    return w_q, w_k, w_v, w_o


def offset(w: Params, name: str, i: Any) -> Any:
    """Head ``i``'s entry of the bias ``name``, ``0.0`` when the parameters have none."""
    b = w[name]
    return 0.0 if b is None else b[i]


def tokens(x_q: Any, x_kv: Any) -> tuple[np.ndarray, np.ndarray]:
    """``(x_q, x_kv)`` as float64 arrays, ``x_kv`` the same array as ``x_q`` when ``None``."""
    xq = np.asarray(x_q, dtype=np.float64)
    return xq, (xq if x_kv is None else np.asarray(x_kv, dtype=np.float64))


def group_size(w: Params) -> int:
    """``G = H / K`` from ``w_q [H, ...]`` and ``w_k, w_v [K, ...]``; query head i reads i // G."""
    w_q, w_k, w_v, _ = head_weights(w)
    n_heads, n_kv = w_q.shape[0], w_k.shape[0]
    if n_kv < 1 or n_heads % n_kv or w_v.shape[0] != n_kv:
        raise ValueError(
            f"params.w_q has {n_heads} heads, params.w_k {n_kv} and params.w_v {w_v.shape[0]}; "
            "w_k and w_v need the same number of heads, and num_heads must be a multiple of it"
        )
    return n_heads // n_kv


def _rounder(emulate: Any) -> Any:
    if emulate is None or np.dtype(emulate) == np.float64:
        return lambda a: a
    return lambda a: np.asarray(a).astype(emulate).astype(np.float64)


def row_weights(p: Fast, idx: tuple[int, ...], t: int, scores: np.ndarray, rd: Any) -> np.ndarray:
    """The weights of query ``t`` of batch element ``idx`` from its scaled logits (bias, mask):
    the max-subtracted softmax over the allowed entries, zeros if none."""
    allowed = np.ones(scores.shape[-1], dtype=bool)
    if p.bias is not None:
        scores = rd(scores + p.bias[idx][t])
        allowed &= p.bias[idx][t] != -np.inf
    if p.mask is not None:
        allowed &= p.mask[idx][t]
    weights = np.zeros_like(scores)
    if not allowed.any():
        return weights
    e = rd(np.exp(rd(scores[allowed] - np.max(scores[allowed]))))
    weights[allowed] = rd(e / rd(np.sum(e)))
    return weights


# (vector, integer position) -> the vector rotated by that position (RoPE, definition path)
Turn = Callable[[np.ndarray, int], np.ndarray]


def per_head_per_query(
    p: Fast,
    emulate: Any = None,
    turn: Turn | None = None,
    pos: tuple[np.ndarray, np.ndarray] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Weights ``[..., H, T_q, T_k]`` and per-head outputs ``[..., H, T_q, d_model]`` by the
    definition, rounded to ``emulate``; ``turn`` (RoPE) rotates to the positions ``pos``."""
    rd = _rounder(emulate)
    w_q, w_k, w_v, w_o = head_weights(p.w)
    n_heads, d_model, _ = w_q.shape
    t_q, t_k = p.xq.shape[-2], p.xkv.shape[-2]
    weights_out = np.zeros((*p.batch, n_heads, t_q, t_k))
    outs = np.zeros((*p.batch, n_heads, t_q, d_model))
    for idx in np.ndindex(*p.batch):
        for i in range(n_heads):
            g = p.kv_of[i]  # the key/value head that query head i reads
            if turn is None or pos is None:
                keys = rd(rd(p.xkv[idx] @ w_k[g]) + offset(p.w, "b_k", g))
            else:
                kb = offset(p.w, "b_k", g)
                keys = [turn(p.xkv[idx][j] @ w_k[g] + kb, int(pos[1][idx][j])) for j in range(t_k)]
            values = rd(rd(p.xkv[idx] @ w_v[g]) + offset(p.w, "b_v", g))
            for t in range(t_q):
                q = rd(rd(p.xq[idx][t] @ w_q[i]) + offset(p.w, "b_q", i))
                if turn is not None and pos is not None:
                    q = turn(q, int(pos[0][idx][t]))
                scores = rd(rd(np.array([q @ keys[j] for j in range(t_k)])) * rd(p.scale))
                pr = row_weights(p, idx, t, scores, rd)
                weights_out[idx][i, t] = pr
                z = np.zeros(values.shape[-1])
                for j in range(t_k):
                    if pr[j] != 0.0:
                        z = rd(z + rd(pr[j] * values[j]))
                outs[idx][i, t] = rd(z @ w_o[i])
    return weights_out, outs


def definition_output(p: Fast, outs: np.ndarray, residual: bool, emulate: Any = None) -> np.ndarray:
    """``y = sum_i o_i (+ b_O) (+ x_q)`` from the per-head outputs, head by head."""
    rd = _rounder(emulate)
    y = np.zeros(outs.shape[:-3] + outs.shape[-2:])
    for i in range(outs.shape[-3]):
        y = rd(y + outs[..., i, :, :])
    if p.w["b_o"] is not None:
        y = rd(y + p.w["b_o"])
    if residual:
        y = rd(y + p.xq)
    return y


# ----------------------------------------------------------------------------- the fast path

_BUDGET_BYTES = 64 * 2**20  # temporaries of one query block, about 64 MiB
# float64 [H, block, T_k] arrays a forward block is budgeted for: the logits (turned into weights
# in place) are kept, the rest is headroom for NumPy's temporaries and BLAS workspace
_FORWARD_ARRAYS = 4

# (batch index, query rows, vectors [H, rows, d]) -> the vectors rotated (RoPE) or unchanged
Rotation = Callable[[tuple[int, ...], slice, np.ndarray], np.ndarray]


class Fast(NamedTuple):
    """A validated weight-level problem in float64, as the vectorised paths read it."""

    w: Params  # unpack: w_k, w_v, b_k, b_v keep their K key/value heads
    xq: np.ndarray  # [*batch, T_q, d_model]
    xkv: np.ndarray  # [*batch, T_k, d_model] (x_q itself when x_kv is None)
    mask: np.ndarray | None  # broadcast to [*batch, T_q, T_k]
    bias: np.ndarray | None  # broadcast to [*batch, T_q, T_k], float64
    scale: float
    batch: tuple[int, ...]
    kv_of: np.ndarray  # [H]: the key/value head i // G that query head i reads


def fast_problem(
    params: Any, x_q: Any, x_kv: Any, mask: Any, bias: Any, scale: float | None
) -> Fast:
    """Validate (as the definition does) and read the inputs as float64 arrays."""
    batch, _, _, m, b, sc = check_weight_level(params, x_q, x_kv, mask, bias, scale)
    w = unpack(params)
    group = group_size(w)
    xq, xkv = tokens(x_q, x_kv)
    n_heads, _, d_k = head_weights(w)[0].shape
    s = 1.0 / math.sqrt(d_k) if sc is None else sc
    return Fast(w, xq, xkv, m, b, s, tuple(batch), np.arange(n_heads) // group)


def side_by_side(a: np.ndarray) -> np.ndarray:
    """``[H, n, d]`` -> ``[n, H d]``: row ``t`` holds every head's row ``t``, head by head."""
    return np.swapaxes(a, 0, 1).reshape(a.shape[1], a.shape[0] * a.shape[2])


def stacked_t(w: np.ndarray) -> np.ndarray:
    """``W [H, d_model, d]`` -> ``[H d, d_model]``: every ``W[h]^T``, stacked."""
    return np.swapaxes(w, -1, -2).reshape(w.shape[0] * w.shape[2], w.shape[1])


def _project(x: np.ndarray, wt: np.ndarray, bt: np.ndarray | None) -> np.ndarray:
    """``x W[h] + b[h]`` for every head: ``[n, d_model]`` -> ``[heads, n, d]``."""
    y = np.matmul(x, wt)
    return y if bt is None else y + bt[:, None, :]


def allowed_pairs(p: Fast, at: tuple[Any, ...] = ()) -> np.ndarray | None:
    """``mask & (bias != -inf)`` at the index ``at`` (default: all); ``None``: all allowed."""
    keep = None if p.mask is None else p.mask[at]
    if p.bias is not None:
        finite = p.bias[at] != -np.inf
        keep = finite if keep is None else keep & finite
    return keep


def _block_weights(p: Fast, at: tuple[Any, ...], q: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """The weights ``[H, n, T_k]`` of queries ``q [H, n, d_k]`` at ``at = (*idx, rows)``: the
    logits ``s = (q . k) * scale + bias``, then the masked softmax of every row (zero rows where
    none is allowed), in place."""
    scores = np.matmul(q, np.swapaxes(keys, -1, -2))
    scores *= p.scale
    if p.bias is not None:
        scores += p.bias[at]
    allowed = allowed_pairs(p, at)
    if allowed is not None:
        np.copyto(scores, -np.inf, where=~allowed)
    top = np.max(scores, axis=-1, keepdims=True, initial=-np.inf)
    top[~np.isfinite(top)] = 0.0  # rows with no allowed key: every entry stays -inf, exp 0
    scores -= top
    np.exp(scores, out=scores)
    total = np.sum(scores, axis=-1, keepdims=True)
    total[total == 0.0] = 1.0
    scores /= total
    return scores


class Block(NamedTuple):
    """One block of queries of one batch element, with what the forward computed for it."""

    idx: tuple[int, ...]
    rows: slice
    q: np.ndarray  # [H, n, d_k], rotated when a rotation is given
    keys: np.ndarray  # [H, T_k, d_k], rotated likewise
    values: np.ndarray  # [H, T_k, d_v]
    weights: np.ndarray  # [H, n, T_k]


def each_block(
    p: Fast,
    visit: Callable[[Block], None],
    *,
    rotate_q: Rotation | None = None,
    rotate_k: Rotation | None = None,
    arrays: int = _FORWARD_ARRAYS,
) -> None:
    """Call ``visit`` on one query block at a time (``arrays`` temporaries ``[H, block, T_k]`` in
    the budget; a callback, so no block outlives its visit); ``rotate_q``/``rotate_k`` (RoPE)
    turn queries and keys after projection."""
    w_q, w_k, w_v, _ = head_weights(p.w)
    t_q, t_k = p.xq.shape[-2], p.xkv.shape[-2]
    step = max(1, _BUDGET_BYTES // (arrays * 8 * w_q.shape[0] * max(t_k, 1)))  # rows per block
    for idx in np.ndindex(*p.batch):
        keys = _project(p.xkv[idx], w_k, p.w["b_k"])[p.kv_of]  # [H, T_k, d_k]
        values = _project(p.xkv[idx], w_v, p.w["b_v"])[p.kv_of]  # [H, T_k, d_v]
        if rotate_k is not None:
            keys = rotate_k(idx, slice(None), keys)
        for start in range(0, t_q, step):
            rows = slice(start, min(start + step, t_q))
            q = _project(p.xq[idx][rows], w_q, p.w["b_q"])
            if rotate_q is not None:
                q = rotate_q(idx, rows, q)
            weights = _block_weights(p, (*idx, rows), q, keys)
            visit(Block(idx, rows, q, keys, values, weights))
            del weights  # before the next block's logits are allocated


def _weighted_values(weights: np.ndarray, values: np.ndarray) -> np.ndarray:
    """``z = P V`` per head, ``[H, n, d_v]``, skipping keys of weight 0 (so a NaN value there is
    never read), as the definition does."""
    bad = ~np.isfinite(values)  # [H, T_k, d_v]
    if not bad.any():
        return np.matmul(weights, values)
    z = np.matmul(weights, np.where(bad, 0.0, values))
    for h, j, d in zip(*np.nonzero(bad), strict=True):
        reads = weights[h, :, j] != 0.0
        z[h, reads, d] += weights[h, reads, j] * values[h, j, d]
    return z


def _per_head(call: dict[str, Any], outputs: bool) -> np.ndarray:
    """The weights ``[*batch, H, T_q, T_k]``, or the per-head outputs ``o_i = P_i V_i W_O[i]``
    ``[*batch, H, T_q, d_model]``, by ``call``'s method."""
    definition = check_method(call.pop("method")) == "definition"
    p = fast_problem(*call.values())
    if definition:
        return per_head_per_query(p)[1 if outputs else 0]
    w_o = head_weights(p.w)[3]
    last = w_o.shape[2] if outputs else p.xkv.shape[-2]
    out = np.zeros((*p.batch, w_o.shape[0], p.xq.shape[-2], last))

    def visit(blk: Block) -> None:
        z = np.matmul(_weighted_values(blk.weights, blk.values), w_o) if outputs else blk.weights
        out[blk.idx][:, blk.rows] = z

    each_block(p, visit)
    return out


def fast_output(
    p: Fast,
    *,
    rotate_q: Rotation | None = None,
    rotate_k: Rotation | None = None,
    residual: bool = False,
) -> np.ndarray:
    """``y = sum_i P_i V_i W_O[i] (+ b_O) (+ x_q)``, ``[*batch, T_q, d_model]``, one product of the
    concatenated heads per block."""
    w_o = head_weights(p.w)[3]
    n_heads, d_v, d_model = w_o.shape
    w_cat = w_o.reshape(n_heads * d_v, d_model)
    y = np.zeros((*p.batch, p.xq.shape[-2], d_model))

    def visit(blk: Block) -> None:
        z = _weighted_values(blk.weights, blk.values)  # [H, n, d_v]
        y[blk.idx][blk.rows] = side_by_side(z) @ w_cat

    each_block(p, visit, rotate_q=rotate_q, rotate_k=rotate_k)
    if p.w["b_o"] is not None:
        y = y + p.w["b_o"]
    if residual:
        y = y + p.xq
    return y


@doc(WEIGHT, WEIGHT_RAISES)
@signed(weight_call, method_option)
def attention_weights(call: dict[str, Any]) -> np.ndarray:
    """Row-stochastic attention weights ``[..., H, T_q, T_k]`` (zero rows where fully masked).

    Returns:
        float64 weights ``[..., H, T_q, T_k]``.
    """
    return _per_head(call, outputs=False)


@doc(WEIGHT, WEIGHT_RAISES)
@signed(weight_call, method_option)
def head_outputs(call: dict[str, Any]) -> np.ndarray:
    """Per-head outputs in model space ``[..., H, T_q, d_model]`` (without ``b_O``).

    Returns:
        float64 ``o_i = A_i V_i W_O[i]`` for every query head, ``[..., H, T_q, d_model]``.
    """
    return _per_head(call, outputs=True)


@doc(WEIGHT, WEIGHT_RAISES)
@signed(weight_call)
def attention(
    call: dict[str, Any],
    *,
    residual: bool = False,
    emulate: Any = None,
    method: str = "fast",
) -> np.ndarray:
    """Multi-head attention output ``[..., T_q, d_model]`` in float64 (``x_q +`` it if residual).

    Returns:
        The block output ``[..., T_q, d_model]``, float64 (values rounded to ``emulate`` when
        given); a fully masked query row is ``b_O``.
    """
    emulating = emulate is not None and np.dtype(emulate) != np.float64
    fast = check_method(method) == "fast" and not emulating
    p = fast_problem(*call.values())
    if fast:
        return fast_output(p, residual=residual)
    return definition_output(p, per_head_per_query(p, emulate)[1], residual, emulate)
