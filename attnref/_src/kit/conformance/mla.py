"""The conformance kit for a user's multi-head latent attention: :func:`check_mla`.

The target has the signature of :func:`attnref.mla.mla_attention` (and of
:func:`attnref.mla.mla_absorbed_attention`)::

    fn(params: attnref.mla.MLAParams, x_q [B, T_q, d_model], x_kv [B, T_k, d_model], *,
       positions_q=None, positions_kv=None, mask=None) -> y [B, T_q, d_model]

NumPy in (parameters included), anything :func:`numpy.asarray` reads out; a keyword only when a
property uses it. Each property (:data:`MLA_PROPERTIES`; ``docs/mla.md`` says what each checks)
compares with the float64 oracle :func:`attnref.oracle.mla_attention` within
:func:`attnref.tolerance.mla_attention_error_bound` (both forms, any summation order), parameters
from :func:`attnref.mla.init_mla_params`, small buckets.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from hypothesis import strategies as st

from attnref import oracle, tolerance
from attnref._src.formulations.mla_family import init_mla_params
from attnref._src.kit.closeness import assert_ratio_within
from attnref._src.kit.conformance.engine import changed, check_target, planned, run_suite
from attnref._src.kit.conformance.options import check_properties, check_subset
from attnref._src.kit.conformance.report import ConformanceReport
from attnref._src.kit.conformance.targets import describe_target

MLA_PROPERTIES = ("oracle", "rope", "causal", "decode", "masked_nan")
MLA_DTYPES = ("float32", "float64")
# (B, T, d_model, H, d_c, d_nope, d_v)
_BUCKETS = ((2, 5, 16, 2, 8, 4, 4), (1, 7, 12, 3, 6, 4, 2))


def _params(bucket: tuple[int, ...], seed: int, dtype: str, rope: bool, compress: bool) -> Any:
    _, _, d_model, h, d_c, d_nope, d_v = bucket
    return init_mla_params(
        seed, d_model=d_model, num_heads=h, d_c=d_c, d_nope=d_nope, d_v=d_v,
        d_rope=4 if rope else 0, d_cq=6 if compress else None, dtype=np.dtype(dtype),
    )  # fmt: skip


def _compare(y: Any, want: np.ndarray, bound: np.ndarray, label: str) -> None:
    got = np.asarray(y, np.float64)
    if got.shape != want.shape:
        raise AssertionError(f"{label}: output shape {got.shape}, expected {want.shape}")
    if not np.all(np.isfinite(got)):
        raise AssertionError(f"{label}: non-finite output where the oracle is finite")
    assert_ratio_within(
        np.abs(got - want),
        bound,
        f"{label}: |y - oracle| = {{error:.3e}} exceeds the derived bound {{allowed:.3e}} at "
        "{index}",
    )


def _plan(name: str, fn: Callable[..., Any], dtypes: tuple[str, ...]) -> tuple[Any, Any]:
    cases = st.tuples(st.sampled_from(_BUCKETS), st.integers(0, 2**31 - 1), st.booleans())

    def check(case: tuple[tuple[int, ...], int, bool]) -> None:
        bucket, seed, compress = case
        b, t, d_model = bucket[:3]
        rng = np.random.default_rng(seed)
        for dtype in dtypes:
            p = _params(bucket, seed, dtype, name != "oracle", compress and name != "oracle")
            x = rng.standard_normal((b, t, d_model)).astype(dtype)
            x_q = x
            kw: dict[str, Any] = {}
            if name == "causal":
                kw["mask"] = np.broadcast_to(np.tril(np.ones((t, t), bool)), (b, t, t))
            elif name == "decode":
                t_q = 2
                x_q = x[:, -t_q:]
                pos = np.broadcast_to(np.arange(t), (b, t))
                kw["positions_q"], kw["positions_kv"] = pos[:, -t_q:], pos
                kw["mask"] = np.broadcast_to(np.tril(np.ones((t, t), bool))[-t_q:], (b, t_q, t))
            elif name == "masked_nan":
                mask = np.ones((b, t, t), bool)
                mask[..., 1] = False  # token 1 is nobody's key
                kw["mask"] = mask
                x = x.copy()
                x[:, 1] = np.nan
                x_q = rng.standard_normal((b, t, d_model)).astype(dtype)  # finite queries
            want = oracle.mla_attention(p, x_q, x, **kw)
            # the never-read NaN token as 0: a masked token enters no sum, so the bound holds
            finite = np.where(np.isnan(x), 0.0, x).astype(dtype)
            bound = tolerance.mla_attention_error_bound(p, x_q, finite, dtype=dtype, **kw)
            _compare(fn(p, x_q, x, **kw), want, bound, f"{name} [{dtype}]")

    return cases, check


def check_mla(
    fn: Callable[..., Any],
    *,
    dtypes: Sequence[str] = ("float32",),
    max_examples: int | None = None,
    seed: int = 0,
    properties: Sequence[str] | None = None,
    target: str | None = None,
) -> ConformanceReport:
    """Run the MLA properties (module docstring) against ``fn``: a :class:`ConformanceReport`
    (signature ``"mla"``). ``dtypes`` (of :data:`MLA_DTYPES`): each property's formats;
    ``max_examples`` (``None``: 6), ``seed``, ``properties``, ``target`` as in
    :func:`check_attention`. Raises ``ValueError`` (an ``OptionError``) for an unknown property
    or dtype, ``TypeError`` for ``fn`` not callable."""
    names = check_properties(properties, MLA_PROPERTIES)
    dts = check_subset("dtypes", dtypes, MLA_DTYPES)
    check_target(fn, max_examples)
    run = planned(lambda name: _plan(name, fn, dts), seed=seed, max_examples=max_examples or 6)
    results = run_suite(names, run, seed=seed)
    return ConformanceReport(
        target=target or describe_target(fn),
        signature="mla",
        features=(),
        declared={},
        results=results,
        options=changed(("dtypes", list(dts), ["float32"]), ("max_examples", max_examples, None)),
    )
