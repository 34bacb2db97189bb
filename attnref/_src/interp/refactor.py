"""Spectra of the merged matrices and fuse-and-refactor (truncated SVD from the factors).

Row convention. Query head ``i`` (key/value head ``g = i // G``) has the pattern matrix
``W_P[i] = W_Q[i] W_K[g]^T`` and the message matrix ``W_M[i] = W_V[g] W_O[i]``, both
``d_model x d_model`` of rank at most ``d_k`` and ``d_v``.

**SVD from the factors.** For ``W = A B^T`` with thin factors ``A [m, d]``, ``B [n, d]``: thin QR
``A = Q_A R_A``, ``B = Q_B R_B``; SVD of the small core ``R_A R_B^T = U S V^T`` (at most
``d x d``); then ``W = (Q_A U) S (Q_B V)^T`` is an SVD of ``W``. Cost ``O((m + n) d^2 + d^3)``; no
``m x n`` matrix is ever formed.

**Biases (exact rules).** ``(x W_Q + b_Q)(y W_K + b_K)^T = [x, 1] [W_Q; b_Q] W_K^T y^T`` plus
terms without ``y``, constant along a softmax row: ``b_K`` drops out and the function depends on
the augmented ``W~_P = [W_Q; b_Q] W_K^T`` (``(d_model + 1) x d_model``). Messages are
``y W_M + b_V W_O``: scores sum to 1, so folding ``b_O' = b_O + sum_i b_V[g] W_O[i]`` is exact
on every row with an allowed key (a fully masked row then outputs ``b_O'``, not ``b_O``); the
augmented ``W~_M = [W_V; b_V] W_O`` is exact on every row.

Seed: "Reframing Attention: A Matrix Decomposition Perspective" (2025-02-18), which proposes
fusing ``W_Q W_K^T`` and ``W_V W_O`` and factoring them again by SVD.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float
from threadpoolctl import threadpool_limits

from attnref._src.core.checks import check_params, float64_scoped, is_traced
from attnref._src.core.common import HIGHEST, homogeneous_weights
from attnref._src.core.params import AttentionParams, repeat_kv_heads_unchecked

Gauge = Literal["sqrt", "left", "right"]
ValueBias = Literal["fold", "homogeneous"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FactoredSVD:
    """Thin SVD ``W[h] = left[h] diag(s[h]) right[h]^T`` per head, ``k = min(d, m, n)`` for
    factors of inner width ``d``.

    Attributes:
        left: Left singular vectors ``U`` per head, ``[H, m, k]``, orthonormal columns.
        s: Singular values per head, ``[H, k]``, descending.
        right: Right singular vectors ``V`` per head, ``[H, n, k]``, orthonormal columns.
    """

    left: Any
    s: Any
    right: Any


def _svd_of_product(xp: Any, a: Any, b: Any) -> FactoredSVD:
    """QR of both factors, SVD of the core, with ``xp`` = NumPy (LAPACK) or ``jax.numpy``."""
    mm = xp.matmul if xp is np else (lambda x, y: jnp.matmul(x, y, precision=HIGHEST))
    q_a, r_a = xp.linalg.qr(a, mode="reduced")  # [H, m, ka], [H, ka, d]
    q_b, r_b = xp.linalg.qr(b, mode="reduced")  # [H, n, kb], [H, kb, d]
    u, s, vt = xp.linalg.svd(mm(r_a, xp.swapaxes(r_b, -1, -2)), full_matrices=False)
    return FactoredSVD(left=mm(q_a, u), s=s, right=mm(q_b, xp.swapaxes(vt, -1, -2)))


def _resolve_dtype(dtype: Any) -> Any:
    if dtype is None:
        return None
    dt = np.dtype(dtype)
    if dt not in (np.dtype(np.float32), np.dtype(np.float64)):
        raise ValueError(f"compute dtype must be float32 or float64, got {dt}")
    return dt


def factored_svd(
    a: Float[ArrayLike, "H m d"], b: Float[ArrayLike, "H n d"], *, dtype: Any = None
) -> FactoredSVD:
    """SVD of ``a[h] @ b[h]^T`` per head from the thin factors ``a [H, m, d]``, ``b [H, n, d]``.

    ``dtype``: ``None`` (the inputs'; float32 for 16-bit or non-float inputs), ``np.float32`` or
    ``np.float64``. Concrete inputs go through NumPy's LAPACK and give NumPy arrays; traced ones
    (under ``jax.jit``; enable x64 yourself for float64) take the same steps in ``jax.numpy``.
    ``ValueError`` for factors without one ``H`` and ``d``, or another ``dtype``.
    """
    if np.ndim(a) != 3 or np.ndim(b) != 3 or np.shape(a)[::2] != np.shape(b)[::2]:
        raise ValueError(
            f"factors must be [H, m, d] and [H, n, d] with the same H and d, got "
            f"{np.shape(a)} and {np.shape(b)}"
        )
    dt = _resolve_dtype(dtype)
    if is_traced(a, b):
        a, b = jnp.asarray(a), jnp.asarray(b)
        if dt is not None:
            a, b = a.astype(dt), b.astype(dt)
        return _svd_of_product(jnp, a, b)
    a_np, b_np = np.asarray(a), np.asarray(b)
    dt = dt or np.result_type(a_np, b_np)
    if not np.issubdtype(dt, np.floating) or np.dtype(dt).itemsize < 4:
        dt = np.dtype(np.float32)  # LAPACK has no 16-bit routines
    # NumPy's LAPACK on one thread: on a busy machine a multithreaded OpenBLAS can spin for
    # seconds on one small QR.
    with threadpool_limits(limits=1, user_api="blas"):
        return _svd_of_product(np, a_np.astype(dt), b_np.astype(dt))


def _augment(w: Any, b: Any) -> Any:
    """``[W; b]`` per head (:func:`homogeneous_weights`), ``W`` if ``b`` is ``None``."""
    if b is None:
        return (jnp if is_traced(w) else np).asarray(w)
    return homogeneous_weights(w, b, xp=jnp if is_traced(w, b) else np)


def _factors(params: AttentionParams, bias: bool, side: str) -> tuple[Any, Any]:
    """Per query head, ``(W~_Q [H, d_model(+1), d_k], W_K [H, d_model, d_k])`` for ``side``
    ``"qk"``, else ``(W~_V [H, d_model(+1), d_v], W_O^T [H, d_model, d_v])``."""
    mha = repeat_kv_heads_unchecked(params)
    if side == "qk":
        return _augment(mha.w_q, mha.b_q if bias else None), _augment(mha.w_k, None)
    w_o = _augment(mha.w_o, None)
    xp = jnp if is_traced(w_o) else np
    return _augment(mha.w_v, mha.b_v if bias else None), xp.swapaxes(w_o, -1, -2)


def pattern_svd(params: AttentionParams, *, bias: bool = False, dtype: Any = None) -> FactoredSVD:
    """SVD of the pattern matrices ``W_P[i] = W_Q[i] W_K[i // G]^T`` from the factors.

    ``bias=True`` (ignored without ``b_Q``): of the augmented ``W~_P[i] = [W_Q[i]; b_Q[i]] W_K^T``.
    ``s [H, min(d_k, d_model)]`` descending, ``left [H, d_model(+1), k]``, ``right [H, d_model,
    k]``; grouped heads repeated per query head. ``dtype`` and errors as :func:`factored_svd`.
    """
    check_params(params)
    return factored_svd(*_factors(params, bias and params.b_q is not None, "qk"), dtype=dtype)


def message_svd(params: AttentionParams, *, bias: bool = False, dtype: Any = None) -> FactoredSVD:
    """SVD of the message matrices ``W_M[i] = W_V[i // G] W_O[i]`` from the factors.

    ``bias=True`` gives the augmented ``W~_M[i] = [W_V; b_V] W_O[i]`` (last row ``b_V W_O``;
    ignored without ``b_V``). ``k = min(d_v, d_model)``; otherwise as :func:`pattern_svd`.
    """
    check_params(params)
    return factored_svd(*_factors(params, bias and params.b_v is not None, "vo"), dtype=dtype)


@float64_scoped
def effective_rank(
    s: Float[ArrayLike, "... k"],
    *,
    method: Literal["entropy", "energy"] = "entropy",
    threshold: float = 0.99,
) -> Array:
    """Effective rank of matrices from their singular values (last axis).

    * ``"entropy"`` (Roy and Vetterli 2007): ``exp(-sum_k p_k log p_k)`` with
      ``p_k = s_k / sum_j s_j``; a real number in ``[1, rank]``, equal to ``r`` for ``r`` equal
      non-zero singular values. A zero matrix has effective rank 0.
    * ``"energy"``: the smallest ``r`` with ``sum_{k <= r} s_k^2 >= threshold * sum_k s_k^2``,
      i.e. the smallest rank whose best approximation has relative Frobenius error at most
      ``sqrt(1 - threshold)`` (Eckart-Young), ``threshold`` in ``(0, 1]``. An integer (as the
      array's dtype).

    ``s [..., k]`` in any order, signs ignored; returns ``[...]``. ``ValueError`` for an unknown
    ``method`` or a ``threshold`` out of range.
    """
    s = jnp.abs(jnp.asarray(s))
    if method == "entropy":
        total = jnp.sum(s, axis=-1, keepdims=True)
        p = s / jnp.where(total > 0, total, 1.0)
        ent = -jnp.sum(jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1.0)), 0.0), axis=-1)
        return jnp.where(total[..., 0] > 0, jnp.exp(ent), 0.0)
    if method == "energy":
        if not 0.0 < threshold <= 1.0:
            raise ValueError(f"threshold must be in (0, 1], got {threshold}")
        e = jnp.sort(s, axis=-1)[..., ::-1] ** 2
        cum = jnp.cumsum(e, axis=-1)
        total = cum[..., -1:]
        # The tolerance keeps threshold=1 from failing on the rounding of the cumulative sum.
        slack = e.shape[-1] * jnp.finfo(e.dtype).eps * total
        reached = cum >= threshold * total - slack
        return jnp.where(total[..., 0] > 0, jnp.argmax(reached, axis=-1) + 1, 0).astype(s.dtype)
    raise ValueError(f"unknown method {method!r}; expected 'entropy' or 'energy'")


@float64_scoped
def truncation_error(s: Float[ArrayLike, "... k"], rank: int, *, relative: bool = False) -> Array:
    """``||W - W_r||_F = sqrt(sum_{k > r} s_k^2)`` (Eckart-Young), per matrix.

    ``s [..., k]`` are the singular values (signs ignored, sorted here), ``rank`` the kept
    ``r`` (``r >= k`` gives 0); ``relative=True`` divides by ``||W||_F = sqrt(sum_k s_k^2)``
    (0 for a zero matrix). Returns ``[...]``.
    """
    s = jnp.sort(jnp.abs(jnp.asarray(s)), axis=-1)[..., ::-1]
    dropped = jnp.sqrt(jnp.sum(s[..., rank:] ** 2, axis=-1))
    if not relative:
        return dropped
    total = jnp.sqrt(jnp.sum(s**2, axis=-1))
    return jnp.where(total > 0, dropped / jnp.where(total > 0, total, 1.0), 0.0)


def param_count(params: AttentionParams) -> int:
    """The number of stored parameters (a Python int): the sizes of every weight and every
    present bias; grouped-query parameters count their ``K`` key/value heads once."""
    return int(sum(int(np.size(leaf)) for leaf in jax.tree_util.tree_leaves(params)))


@dataclasses.dataclass(frozen=True)
class Refactored:
    """The result of :func:`refactor`.

    Attributes:
        params: The refactored parameters (``d_k' = rank_qk``, ``d_v' = rank_vo``, ``K = H``).
        count_before: :func:`param_count` of the input.
        count_after: :func:`param_count` of the result.
        rank_qk: The pattern rank asked for (``None``: that side was kept).
        rank_vo: The message rank asked for (``None``: that side was kept).
        s_qk: Singular values ``[H, k]`` of the truncated ``W~_P`` (``W_P`` without ``b_Q``).
        s_vo: Singular values ``[H, k]`` of the truncated ``W_M`` or ``W~_M``.
        error_qk: Relative truncation errors ``||W - W_r||_F / ||W||_F`` per head, ``[H]``.
        error_vo: As ``error_qk`` for the messages; ``s_*`` and ``error_*`` are ``None`` for a
            side that was kept.
    """

    params: AttentionParams
    count_before: int
    count_after: int
    rank_qk: int | None
    rank_vo: int | None
    s_qk: np.ndarray | None
    s_vo: np.ndarray | None
    error_qk: np.ndarray | None
    error_vo: np.ndarray | None


def _relative_truncation_error(s: np.ndarray, rank: int) -> np.ndarray:
    """``sqrt(sum_{k > r} s_k^2 / sum_k s_k^2)`` per head, in float64 (NumPy)."""
    s2 = np.asarray(s, np.float64) ** 2
    total = s2.sum(-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(total > 0, np.sqrt(s2[..., rank:].sum(-1) / total), 0.0)


def _split(svd: FactoredSVD, rank: int, gauge: str) -> tuple[Any, Any]:
    """Rank-``rank`` factors ``(L [H, m, r], R [H, n, r])`` with ``L R^T = U_r S_r V_r^T``."""
    u, s, v = svd.left[..., :rank], svd.s[..., :rank], svd.right[..., :rank]
    if gauge == "sqrt":
        root = np.sqrt(s)[..., None, :]
        return u * root, v * root
    if gauge == "left":
        return u * s[..., None, :], v
    return u, v * s[..., None, :]  # "right" (refactor checks the gauge)


def _check_rank(name: str, rank: int | None, width: int, d_model: int) -> None:
    if rank is None:
        return
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)):
        raise TypeError(f"{name} must be an int or None, got {type(rank).__name__}")
    limit = min(width, d_model)
    if not 1 <= rank <= limit:
        raise ValueError(
            f"{name}={rank} is out of range: the merged matrix has rank at most "
            f"min(head width, d_model) = {limit}, and a head needs width >= 1"
        )


def refactor(
    params: AttentionParams,
    rank_qk: int | None,
    rank_vo: int | None,
    *,
    gauge: Gauge = "sqrt",
    value_bias: ValueBias = "fold",
    rescale: bool = True,
    dtype: Any = None,
) -> Refactored:
    """Fuse-and-refactor: per query head, the best rank-``r`` approximations (Eckart-Young) of
    the merged matrices, as standard-form factors; grouped-query parameters become multi-head.

    ``rank_qk = r``: ``[W_Q'; b_Q'] W_K'^T = c * (rank-r approximation of [W_Q; b_Q] W_K^T)``,
    ``c = sqrt(r / d_k)`` if ``rescale`` (so the default scale ``1/sqrt(r)`` reproduces
    ``1/sqrt(d_k)``) else 1; ``b_K' = None`` (``b_Q' = None`` without ``b_Q``). ``rank_vo = r``:
    ``W_V' W_O'`` approximates ``W_M`` (``value_bias="fold"``: ``b_V' = None``, ``b_V W_O``
    folded into ``b_O'``) or ``[W_V; b_V] W_O`` (``"homogeneous"``: ``b_V'`` its last row); the
    module docstring says where each is exact. ``gauge`` splits ``S_r`` between the factors:
    ``"sqrt"`` ``U_r S_r^(1/2)``, ``V_r S_r^(1/2)``; ``"left"`` ``U_r S_r``, ``V_r``; ``"right"``
    ``U_r``, ``V_r S_r`` (the products, hence the outputs, do not depend on it). At ``r = d_k``
    (``d_v``) the function is preserved to rounding.

    Args:
        params: Per-head weights (:class:`attnref.AttentionParams`).
        rank_qk: ``1 <= r <= min(d_k, d_model)``, or ``None`` to keep ``W_Q, W_K, b_Q, b_K``.
        rank_vo: ``1 <= r <= min(d_v, d_model)``, or ``None`` to keep ``W_V, W_O, b_V, b_O``.
        gauge: ``"sqrt"`` (default), ``"left"`` or ``"right"``.
        value_bias: ``"fold"`` (default) or ``"homogeneous"``.
        rescale: Multiply the new query factor by ``sqrt(rank_qk / d_k)`` (default ``True``).
        dtype: The compute dtype: ``None`` (the parameters'; float32 for 16-bit ones),
            ``np.float32`` or ``np.float64``. The result has the parameters' dtype, as NumPy
            arrays (LAPACK; not traced).

    Returns:
        A :class:`Refactored` with the new parameters, counts, spectra and errors (with both
        ranks ``None``, ``params`` itself and no spectra).

    Raises:
        ValueError: If ``params`` is malformed, a rank is out of range, ``gauge`` or
            ``value_bias`` is unknown, or ``dtype`` is not ``None``, float32 or float64.
        TypeError: If a rank is not an int or ``None`` (bools refused), or the parameters are
            not floating or mix dtypes.
    """
    _, d_model, d_k, d_v = check_params(params)
    _check_rank("rank_qk", rank_qk, d_k, d_model)
    _check_rank("rank_vo", rank_vo, d_v, d_model)
    if gauge not in ("sqrt", "left", "right"):
        raise ValueError(f"unknown gauge {gauge!r}; expected 'sqrt', 'left' or 'right'")
    if value_bias not in ("fold", "homogeneous"):
        raise ValueError(f"unknown value_bias {value_bias!r}; expected 'fold' or 'homogeneous'")
    out_dtype = params.dtype
    count_before = param_count(params)
    if rank_qk is None and rank_vo is None:
        return Refactored(params, count_before, count_before, None, None, None, None, None, None)
    dt = _resolve_dtype(dtype) or np.dtype(out_dtype)
    if dt.itemsize < 4:
        dt = np.dtype(np.float32)
    mha = jax.tree_util.tree_map(
        lambda a: np.asarray(a).astype(dt), repeat_kv_heads_unchecked(params)
    )
    new: dict[str, Any] = {f.name: getattr(mha, f.name) for f in dataclasses.fields(mha)}
    s_qk = s_vo = err_qk = err_vo = None
    if rank_qk is not None:
        has_bq = mha.b_q is not None
        svd = factored_svd(*_factors(mha, has_bq, "qk"), dtype=dt)
        left, right = _split(svd, rank_qk, gauge)
        if rescale:
            left = left * dt.type(math.sqrt(rank_qk / d_k))
        new["w_q"] = left[:, :d_model]
        new["b_q"] = left[:, d_model] if has_bq else None
        new["w_k"], new["b_k"] = right, None
        s_qk, err_qk = svd.s, _relative_truncation_error(svd.s, rank_qk)
    if rank_vo is not None:
        homogeneous = value_bias == "homogeneous" and mha.b_v is not None
        svd = factored_svd(*_factors(mha, homogeneous, "vo"), dtype=dt)
        left, right = _split(svd, rank_vo, gauge)
        new["w_v"] = left[:, :d_model]
        new["b_v"] = left[:, d_model] if homogeneous else None
        new["w_o"] = np.swapaxes(right, -1, -2)
        if mha.b_v is not None and not homogeneous:
            folded = np.einsum("hv,hvd->d", mha.b_v, mha.w_o)
            new["b_o"] = folded if mha.b_o is None else mha.b_o + folded
        s_vo, err_vo = svd.s, _relative_truncation_error(svd.s, rank_vo)
    result = AttentionParams(
        **{k: None if v is None else np.asarray(v).astype(out_dtype) for k, v in new.items()}  # type: ignore[arg-type]
    )
    counts = (count_before, param_count(result))
    return Refactored(result, *counts, rank_qk, rank_vo, s_qk, s_vo, err_qk, err_vo)
