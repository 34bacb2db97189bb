"""attnref's own passes (the same-precision reference) and the comparisons of a target's output
and lse with the float64 oracle."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from attnref import strategies as ast
from attnref._src.formulations.kernel import STATIC_OPTIONS
from attnref._src.formulations.kernel import dot_product_attention as _attnref_dpa
from attnref._src.kit.closeness import assert_attention_close
from attnref._src.kit.conformance import memo
from attnref._src.kit.conformance.targets import split_options
from attnref.tolerance import kernel_bound_minorant, unit_roundoff
from attnref.tolerance._rounding import is_16bit

_REF = jax.jit(_attnref_dpa, static_argnames=STATIC_OPTIONS)


def _ref_forward(p: ast.KernelProblem) -> np.ndarray:
    """attnref's output in the problem's dtype (the same-precision reference)."""
    static, arrays = split_options(p.options)
    return np.asarray(_REF(p.q, p.k, p.v, **arrays, **dict(static), **p.semantics()))


@functools.lru_cache(maxsize=64)
def _ref_vjp_jit(static: tuple[tuple[str, Any], ...]) -> Callable[..., Any]:
    kw = dict(static)

    def grads(q: Any, k: Any, v: Any, arrays: dict[str, Any], cot: Any) -> Any:
        out, pull = jax.vjp(lambda a, b, c: _attnref_dpa(a, b, c, **arrays, **kw), q, k, v)
        return pull(cot.astype(out.dtype))

    return jax.jit(grads)


def ref_vjp(p: ast.KernelProblem, cotangent: np.ndarray) -> tuple[np.ndarray, ...]:
    """attnref's own ``(dq, dk, dv)`` in the problem's dtype (the comparative rule's reference)."""
    if "query_seq_lengths" not in p.options:
        # the structural options as one full mask: one compiled program serves every kind
        keep = {k: v for k, v in p.options.items() if k in ("bias", "softcap", "scale")}
        p = p.replace(options={"mask": p.allowed(), **keep})
    static, arrays = split_options(p.options)
    key = tuple(sorted({**dict(static), **p.semantics()}.items()))
    out = _ref_vjp_jit(key)(p.q, p.k, p.v, arrays, cotangent)
    return tuple(np.asarray(g, np.float64) for g in out)


def assert_output(out: np.ndarray, p: ast.KernelProblem, label: str) -> None:
    """``out`` equals the oracle: the derived bound, or in 16 bits FlashAttention's rule.

    The bound costs more than the oracle, so an output is first held to the bound's minorant
    (:func:`attnref.tolerance.kernel_bound_minorant`, from the oracle's own pass): within it,
    it is within the bound; otherwise the bound decides, with its own message."""
    ref, _, mag = memo.oracle_magnitude(p)
    close = functools.partial(
        assert_attention_close, out, ref, dtype=p.dtype, expected_nan=p.masked_rows == "nan"
    )
    if is_16bit(p.dtype):
        close(rule="flash", reference_same_dtype=_ref_forward(p), label=label)
        return
    try:
        close(rule="bound", bound=kernel_bound_minorant(mag, p.k.shape[1], p.dtype), label=label)
    except AssertionError:
        close(rule="bound", bound=memo.bound(p)[0], label=label)


def assert_lse(lse: np.ndarray, p: ast.KernelProblem, label: str) -> None:
    _, ref_lse = memo.oracle(p)
    _, lse_bound = memo.bound(p)
    lse_dtype = np.asarray(lse).dtype
    lse = np.asarray(lse, np.float64)
    if lse.shape != ref_lse.shape:
        raise AssertionError(
            f"{label}: lse shape {lse.shape} != expected [B, T, N] {ref_lse.shape}"
        )
    live = np.isfinite(ref_lse)
    if is_16bit(lse_dtype):  # an lse returned in 16 bits adds its final rounding
        lse_bound = lse_bound + unit_roundoff(lse_dtype) * (np.abs(ref_lse) + lse_bound)
    assert_attention_close(
        np.where(live, lse, 0.0),
        np.where(live, ref_lse, 0.0),
        dtype=p.dtype,
        bound=np.where(live, lse_bound, 0.0),
        rule="bound",
        label=label,
    )


def to_target(p: ast.KernelProblem, signature: str) -> ast.KernelProblem:
    """The problem as the target sees it (``"qkv_mask"``: one full mask ``[B, N, T, S]``)."""
    if signature != "qkv_mask":
        return p
    return p.replace(options={"mask": p.allowed()})
