"""The property plans (package docstring): each property's strategy and check, or why it is
skipped."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import numpy as np
from hypothesis import strategies as st

from attnref import strategies as ast
from attnref._src.kit.closeness import FLASH_FACTOR, assert_ratio_within, first_index
from attnref._src.kit.conformance import memo
from attnref._src.kit.conformance.context import ONE_SIDED, Case, Context, Plan, case_strategy
from attnref._src.kit.conformance.options import GROWTH, UNEVEN
from attnref._src.kit.conformance.references import assert_lse, assert_output, ref_vjp
from attnref._src.kit.conformance.targets import (
    REFUSAL_TYPES,
    REFUSAL_WORDS,
    first_line,
    is_refusal,
)
from attnref.tolerance import gamma, unit_roundoff
from attnref.tolerance._rounding import is_16bit

# The masks property's kinds whose mask or bias takes the drawn broadcast shape.
_DRAWN_SHAPES = {"random": "mask_shape", "neg_inf_bias": "bias_shape"}
_MASK_PROPERTY_KINDS = (
    *(k for k in ast.MASK_KINDS if k not in ("none", "fully_masked_row")),
    *ast.PRODUCTION_KINDS,  # each only where the target declares its feature
)


def _plan_oracle(ctx: Context) -> Plan | str:
    pool = ctx.pool("self", "general", "tall", "mqa")
    strategy = ast.kernel_problems(
        ctx.configs(pool, ctx.dtypes[0]),  # drawn in the first dtype, then cast to the others
        kinds=("none",),
        identical_rows=True,
        masked_rows=ctx.masked_rows,
        causal_alignment=ctx.causal_alignment,
    )

    def check(p: ast.KernelProblem) -> None:
        for dtype in ctx.dtypes:
            ctx.at(f"dtype={dtype!r}")
            pd = p.astype(dtype)
            out, _ = ctx.run(pd)
            assert_output(out, ctx.view(pd), f"oracle [{pd.dtype}]")

    return strategy, check


def _mask_kinds(ctx: Context) -> tuple[str, ...]:
    """The masks property's kinds the target's features allow (a one-sided length option is a
    kind of its own where the target has one length option only)."""
    kinds = ctx.kinds(_MASK_PROPERTY_KINDS)
    return kinds if "padding" in kinds else kinds + ctx.kinds(tuple(ONE_SIDED))


def _plan_masks(ctx: Context) -> Plan | str:
    kinds = _mask_kinds(ctx)
    if not kinds:
        return (
            "needs a mask feature (one of mask, bias, causal, query_seq_lengths, "
            "key_value_seq_lengths, window, segment_ids, softcap)"
        )

    def check(case: Case) -> None:
        for kind in (case.get("kind"),) if case.has("kind") else kinds:
            ctx.at(f"kind={kind!r}")
            drawn = _DRAWN_SHAPES.get(kind)
            shape = {drawn: case.get(drawn)} if drawn else {}
            p = ctx.problem(case.config, kind, case.seed, **shape)
            out, _ = ctx.run(p)
            assert_output(out, ctx.view(p), f"masks [{kind}: {_options_text(p)}]")

    # A drawn shape is a new program: two kinds take one; a tile-length example checks one kind.
    pool = ctx.pool("self", "general", "tall")
    shapes = dict(mask_shape=ast.broadcast_shapes(), bias_shape=ast.broadcast_shapes())
    small = case_strategy(ctx.small_configs(pool), **shapes)
    tiles = case_strategy(ctx.tile_configs(pool), kind=st.sampled_from(kinds), **shapes)
    strategy = ctx.mix(small, tiles)
    # The key-padding shapes (mask [B, 1, 1, S], bias [1, 1, 1, S]) run first for every seed.
    first = Case(
        dataclasses.replace(pool[0], dtype=ctx.primary),
        0,
        (("mask_shape", "B11S"), ("bias_shape", "111S")),
    )
    return strategy, check, (first,)


def _options_text(p: ast.KernelProblem) -> str:
    return repr(p).split("options=", 1)[1][:-1]


def _plan_causality(ctx: Context) -> Plan | str:
    pool = ctx.pool("self")
    scales = st.sampled_from((1.0, 1000.0))

    def check(case: Case) -> None:
        c = case.config
        t = c.t // 2  # one prefix shape: one more compiled program
        p = ctx.problem(c, "causal", case.seed)
        grow = case.get("future_key_scale")
        k, v = p.k.astype(np.float64), p.v.astype(np.float64)
        k[:, t:] *= grow
        v[:, t:] *= grow
        p = p.replace(k=k.astype(p.dtype), v=v.astype(p.dtype))
        pre = p.replace(q=p.q[:, :t], k=p.k[:, :t], v=p.v[:, :t])
        ctx.at(f"the full run (T={c.t}) against the prefix run (T={t})")
        full_out, _ = ctx.run(p)
        part, _ = ctx.run(pre)
        full = np.asarray(full_out, np.float64)[:, :t]
        part = np.asarray(part, np.float64)
        bound = memo.bound(ctx.view(p))[0][:, :t] + memo.bound(ctx.view(pre))[0]
        bad = ~np.isfinite(full) | ~np.isfinite(part)
        err = np.where(bad, np.inf, np.abs(np.nan_to_num(full - part)))
        assert_ratio_within(
            err,
            bound,
            "causality: appending {future} future token(s) changed output row {index[1]} (index "
            "{index} of the first {t} rows): |full - prefix| = {error:.3e} > {allowed:.3e} "
            "({ratio:.3g} x the sum of the two derived bounds); full {full!r}, prefix-only "
            "{prefix!r}",
            future=c.t - t,
            t=t,
            full=full,
            prefix=part,
        )
        # agreeing with each other is not enough (an all-zero kernel does): each equals the oracle
        ctx.at(f"the full run (T={c.t}) against the oracle")
        assert_output(full_out, ctx.view(p), "causality: the full run")
        ctx.at(f"the prefix run (T={t}) against the oracle")
        assert_output(part, ctx.view(pre), "causality: the prefix run")
        if "grad" in ctx.features and ctx.signature != "numpy":
            ctx.at(f"the gradient of output row {t - 1}")
            rng = np.random.default_rng(case.seed)
            cot = np.zeros((c.b, c.t, c.n, c.h_v))
            cot[:, t - 1] = rng.standard_normal((c.b, c.n, c.h_v))
            grads = ctx.target.vjp(ctx.view(p), cot.astype(p.dtype))
            for name, g in zip("qkv", grads, strict=True):
                g = np.asarray(g, np.float64)
                if (idx := first_index(g[:, t:] != 0.0)) is not None:
                    pos = (idx[0], idx[1] + t, *idx[2:])
                    raise AssertionError(
                        f"causality: d out[:, {t - 1}] / d {name}{list(pos)} = {g[pos]!r} != 0 "
                        f"(position {pos[1]} is in the future of query {t - 1})"
                    )

    return case_strategy(ctx.configs(pool), future_key_scale=scales), check


def _per_kind(
    feature: str, shapes: tuple[str, ...], kinds: tuple[str, ...], draw: bool = False
) -> Any:
    """The plan of ``gqa`` or ``lse``: each of ``kinds`` against the oracle (and its lse); with
    ``draw``, first one kind per example drawn from ``"none"`` and the masks property's other
    kinds (an lse that forgets the lengths, the window or the mask is wrong there alone)."""

    def plan(ctx: Context) -> Plan | str:
        declared = ctx.kinds(kinds)
        others = ("none", *(k for k in _mask_kinds(ctx) if k not in kinds)) if draw else ()
        extra = {"kind": st.sampled_from(others)} if others else {}

        def check(case: Case) -> None:
            c = case.config
            for kind in (case.get("kind"), *declared) if others else declared:
                ctx.at(f"kind={kind!r}")
                p = ctx.problem(c, kind, case.seed)
                out, lse = ctx.run(p, want_lse=feature == "lse")
                if feature == "gqa":
                    assert_output(out, ctx.view(p), f"gqa [N={c.n}, K={c.k}, {kind}]")
                else:
                    assert_output(out, ctx.view(p), f"lse [{kind}] output")
                    assert_lse(lse, ctx.view(p), f"lse [{kind}]")

        return case_strategy(ctx.configs(ctx.pool(*shapes)), **extra), check

    return plan


def _plan_batch(ctx: Context) -> Plan | str:
    kinds = ctx.kinds(("none", "padding", "random", "neg_inf_bias", "segments", "combined"))
    pool = ctx.pool("self", "general")

    def check(p: ast.KernelProblem) -> None:
        ctx.at("the batched run")
        full, _ = ctx.run(p)
        full = np.asarray(full, np.float64)
        bound, _ = memo.bound(ctx.view(p))
        if is_16bit(p.dtype):
            bound = bound + unit_roundoff(p.dtype) * np.abs(full)
        for b in range(p.config.b):
            ctx.at(f"batch element {b} alone")
            one, _ = ctx.run(p.batch_slice(b))
            one = np.asarray(one, np.float64)
            if one.shape != full[b : b + 1].shape:
                raise AssertionError(f"batch element {b}: shape {one.shape} alone")
            nan_full, nan_one = np.isnan(full[b]), np.isnan(one[0])
            if (idx := first_index(nan_full != nan_one)) is not None:
                raise AssertionError(
                    f"batch element {b}: NaN pattern differs at {idx}: batched "
                    f"{full[b][idx]!r}, alone {one[0][idx]!r}"
                )
            err = np.abs(np.where(nan_full, 0.0, full[b] - np.where(nan_one, 0.0, one[0])))
            assert_ratio_within(
                err,
                2 * bound[b],
                "batch element {b} run alone differs from its slice of the batched run at "
                "{index}: {alone!r} vs {batched!r} ({ratio:.3g} x twice the derived bound); "
                "kind {kind}",
                require_finite=True,
                b=b,
                alone=one[0],
                batched=full[b],
                kind=p.kind,
            )
            # equal to each other is not enough (an all-NaN kernel is): each equals the oracle
            assert_output(one, ctx.view(p.batch_slice(b)), f"batch element {b} run alone")
        ctx.at("the batched run against the oracle")
        assert_output(full, ctx.view(p), f"batched run [{p.kind}: {_options_text(p)}]")

    strategy = ast.kernel_problems(
        ctx.configs(pool),
        kinds=kinds,
        masked_rows=ctx.masked_rows,
        causal_alignment=ctx.causal_alignment,
        # fixed shapes: the masks property draws the broadcast ones
        mask_shapes=None,
        bias_shapes=None,
    )
    return strategy, check


def _observed_policy(row: np.ndarray, mean_v: np.ndarray, tol: float) -> str:
    if np.all(np.isnan(row)):
        return "NaN (masked_rows='nan')"
    if np.all(row == 0.0):
        return "zeros (masked_rows='zeros')"
    if np.all(np.isfinite(row)) and np.max(np.abs(row - mean_v)) <= tol:
        return "the mean of v over all keys (masked_rows='uniform')"
    return f"{row!r}, none of the three meanings"


def _plan_fully_masked(ctx: Context) -> Plan | str:
    if not ({"mask", "key_value_seq_lengths"} & ctx.features):
        return "needs feature 'mask' or 'key_value_seq_lengths' to build a row with no allowed key"
    use_mask = "mask" in ctx.features

    def check(case: Case) -> None:
        c = case.config
        if use_mask:
            p = ctx.problem(c, "fully_masked_row", case.seed, mask_shape=case.get("mask_shape"))
        else:
            p = ctx.problem(c, "none", case.seed)
            lens = np.full(c.batch, c.s, np.int32)
            lens[case.seed % c.b] = 0
            p = p.replace(options={"key_value_seq_lengths": lens})
        view = ctx.view(p)
        out, _ = ctx.run(p)
        out = np.asarray(out, np.float64)
        ref, _ = memo.oracle(view)
        allowed = view.allowed()  # [B, N, T, S]
        dead = ~allowed.any(-1)  # [B, N, T]
        if view.options.get("query_seq_lengths") is not None:
            lens_q = np.asarray(view.options["query_seq_lengths"])
            dead &= (np.arange(c.t)[None, :] < lens_q[:, None])[:, None, :]
        vg = np.repeat(view.v.astype(np.float64), c.group, axis=2)  # [B, S, N, H_v]
        tol = 2 * gamma(c.s + 1, unit_roundoff(np.float32)) * float(np.abs(vg).max())
        if is_16bit(p.dtype):
            tol += 2 * unit_roundoff(p.dtype) * float(np.abs(vg).max())
        for b, n, i in zip(*np.nonzero(dead), strict=True):
            row = out[b, i, n]
            want = ref[b, i, n]
            mean_v = vg[b, :, n].mean(0)
            ok = {
                "zeros": np.all(row == 0.0),
                "nan": np.all(np.isnan(row)),
                "uniform": np.all(np.isfinite(row)) and np.max(np.abs(row - want)) <= tol,
            }[ctx.masked_rows]
            if not ok:
                raise AssertionError(
                    f"fully masked row (b={b}, t={i}, n={n}): declared masked_rows="
                    f"{ctx.masked_rows!r}, but the kernel returns "
                    f"{_observed_policy(row, mean_v, tol)}; declare the kernel's meaning with "
                    "check_attention(..., masked_rows=...)"
                )
        assert_output(out, view, "fully_masked_rows")

    extra = {"mask_shape": ast.broadcast_shapes()} if use_mask else {}
    return case_strategy(ctx.configs(ctx.pool("self", "general")), **extra), check


def _plan_gradients(ctx: Context) -> Plan | str:
    # Each example: a kind drawn from the unmasked call and the masks property's kinds (a masked
    # key's gradient is exactly 0; a bias, window or lengths take another backward path), then
    # causal where declared.
    drawn = ("none", *(k for k in _mask_kinds(ctx) if k != "causal"))
    fixed = ctx.kinds(("causal",))

    def check(case: Case) -> None:
        c = case.config
        rng = np.random.default_rng([case.seed, 1])
        cot = rng.standard_normal((c.b, c.t, c.n, c.h_v)).astype(c.dtype)
        for kind in (case.get("kind"), *fixed):
            ctx.at(f"kind={kind!r}")
            view = ctx.view(ctx.problem(c, kind, case.seed))
            got = ctx.target.vjp(view, cot)
            assert_gradients(view, cot, got, f"gradients [{kind}]")

    configs = ctx.configs(ctx.pool("general") or ctx.pool("self"))
    return case_strategy(configs, kind=st.sampled_from(drawn)), check


def assert_gradients(p: ast.KernelProblem, cot: np.ndarray, got: Any, label: str) -> None:
    """``got = (dq, dk, dv)`` equals the float64 gradient oracle (the ``gradients`` property)."""
    grads = memo.oracle_vjp(p, cot)
    exact = (grads.query, grads.key, grads.value)
    allowances: list[Any]
    if is_16bit(p.dtype):
        same = ref_vjp(p, cot)
        m = max(float(np.max(np.abs(g), initial=0.0)) for g in exact)
        c = p.config
        n_b = c.t * c.group + c.s + c.h + c.h_v + 2
        floor = gamma(n_b, unit_roundoff(p.dtype)) * m
        allowances = [
            2 * float(np.max(np.abs(r - e), initial=0.0)) + floor
            for r, e in zip(same, exact, strict=False)
        ]
        rule = "comparative rule (2 x attnref's {dtype} error + gamma_N_b(u) max|g64|)"
    else:
        bound = memo.grad_bound(p, cot)
        allowances = [bound.query, bound.key, bound.value]
        rule = "derived gradient bound (tolerance.kernel_grad_error_bound)"
    for name, g, e, allowed in zip("qkv", got, exact, allowances, strict=False):
        g = np.asarray(g, np.float64)
        if g.shape != e.shape:
            raise AssertionError(f"{label}: d/d{name} has shape {g.shape}, expected {e.shape}")
        if (idx := first_index(~np.isfinite(g))) is not None:
            raise AssertionError(f"{label}: d/d{name}{list(idx)} = {g[idx]!r}")
        assert_ratio_within(
            np.abs(g - e),
            allowed,
            "{label}: d/d{name} off the float64 gradient oracle at {index}: {error:.3e} > "
            "{allowed:.3e} ({ratio:.3g} x the allowance, " + rule + "); got {got!r}, "
            "float64 {want!r}",
            label=label,
            name=name,
            dtype=p.dtype,
            got=g,
            want=e,
        )


def _plan_extreme(ctx: Context) -> Plan | str:
    kinds = ctx.kinds(("none", "causal", "random"))

    def check(case: Case) -> None:
        c = case.config
        kind = case.get("kind")
        top = case.get("max_abs_logit")
        p = ctx.problem(c, kind, case.seed)
        q64, k64 = p.q.astype(np.float64), p.k.astype(np.float64)
        kg = np.repeat(k64, c.group, axis=2)
        logits = np.einsum("btnh,bsnh->bnts", q64, kg) / math.sqrt(c.h)
        grow = math.sqrt(top / float(np.abs(logits).max()))
        p = p.replace(q=(q64 * grow).astype(p.dtype), k=(k64 * grow).astype(p.dtype))
        out, _ = ctx.run(p)
        out = np.asarray(out, np.float64)
        bad = ~np.isfinite(out) & ~np.isnan(memo.oracle(ctx.view(p))[0])
        if (idx := first_index(bad)) is not None:
            raise AssertionError(
                f"extreme logits (max |logit| = {top:g}, {kind}): output {out[idx]!r} at {idx} "
                "is not finite (overflow in exp? no max subtraction?)"
            )
        assert_output(out, ctx.view(p), f"extreme logits [max |logit| = {top:g}, {kind}]")

    strategy = case_strategy(
        ctx.small_configs(ctx.pool("self", "general")),  # logit size, not tiling
        kind=st.sampled_from(kinds),
        max_abs_logit=st.sampled_from((1e2, 1e3, 1e4)),
    )
    return strategy, check


def _plan_growth(ctx: Context) -> Plan | str:
    anchor = ctx.anchor
    if ctx.devices is None or anchor is None:
        return "needs devices= (a distributed kernel, run on meshes of several sizes)"
    kinds = ctx.kinds(("none", "causal"))

    def check(case: Case) -> None:
        for dtype in ctx.dtypes:
            config = dataclasses.replace(case.config, dtype=dtype)
            for kind in kinds:
                ctx.at(f"dtype={dtype!r}, kind={kind!r}")
                p = ctx.view(ctx.problem(config, kind, case.seed))
                _assert_growth(ctx, anchor, p, kind)

    return case_strategy(ctx.configs(ctx.pool("self", "general"))), check


def _assert_growth(ctx: Context, anchor: Any, p: ast.KernelProblem, kind: str) -> None:
    """``|o_P - o64| <= bound + 2 e_1`` (``ring_size_growth``), the ratio to ``ctx.ratios``."""
    label = f"{GROWTH} [P={ctx.devices}, {p.dtype}, {kind}]"
    ref, _ = memo.oracle(p)
    bound, _ = memo.bound(p)
    out, _ = ctx.run(p)
    rule = "the derived bound"
    allowed = bound
    if is_16bit(p.dtype):
        one, _ = anchor.forward(p)
        over = np.abs(np.asarray(one, np.float64) - ref) - bound
        # a non-finite anchor fails the oracle property at P = 1; it widens nothing here
        excess = float(np.max(np.where(np.isfinite(over), over, 0.0), initial=0.0))
        allowed = bound + FLASH_FACTOR * excess
        rule += f" + {FLASH_FACTOR:g} x the excess on 1 device, {excess:.3e}"
    got = np.asarray(out, np.float64)
    err = np.abs(got - ref)
    err = np.where(np.isfinite(err), err, np.inf)  # NaN or inf where the oracle is finite
    err = np.where(np.isnan(ref) & np.isnan(got), 0.0, err)  # masked_rows="nan", declared
    with np.errstate(divide="ignore", invalid="ignore"):
        ctx.ratios.append(float(np.max(np.where(err == 0, 0.0, err / allowed))))
    assert_ratio_within(
        err,
        allowed,
        "{label}: |o - oracle| = {error:.3e} at index {index} > {allowed:.3e} ({ratio:.3g} x "
        "the allowance: " + rule + "); got {got!r}, oracle {want!r}",
        require_finite=True,
        label=label,
        got=got,
        want=ref,
    )


class TargetRaised(AssertionError):
    """A failure that is the target's exception (``__cause__``, whose traceback is reported)."""


def _plan_uneven(ctx: Context) -> Plan | str:
    if ctx.devices is None:
        return "needs devices= (a distributed kernel, run on meshes of several sizes)"
    kinds = ctx.kinds(("none", "causal"))
    offsets = st.integers(1, 2 * ctx.devices - 1)

    def check(case: Case) -> None:
        c = case.config
        t = c.t + case.get("t_offset")
        s = t if c.s == c.t else c.s + case.get("s_offset")
        config = dataclasses.replace(c, t=t, s=s)
        for kind in kinds:
            ctx.at(f"T={t}, S={s}, kind={kind!r}")
            _assert_uneven(ctx, ctx.view(ctx.problem(config, kind, case.seed)), kind)

    pool = ctx.pool("self", "general")
    return case_strategy(ctx.configs(pool), t_offset=offsets, s_offset=offsets), check


def _assert_uneven(ctx: Context, p: ast.KernelProblem, kind: str) -> None:
    """One ``uneven_lengths`` call, a refusal or equal to the oracle, tallied in ``ctx.calls``."""
    c = p.config
    label = f"{UNEVEN} [P={ctx.devices}, T={c.t}, S={c.s}, {p.dtype}, {kind}]"
    try:
        out, _ = ctx.run(p)
    except AssertionError:  # the kit's shape checks (or the target's own assert)
        raise
    except Exception as exc:
        if is_refusal(exc):
            ctx.calls.append(f"refused: {first_line(exc)}")
            return
        raise TargetRaised(
            f"{label}: fn raised {first_line(exc)}; not a refusal (a {UNEVEN} refusal is a "
            f"{', '.join(t.__name__ for t in REFUSAL_TYPES)} whose message contains one of "
            f"{', '.join(REFUSAL_WORDS)})"
        ) from exc
    assert_output(out, p, label)
    ctx.calls.append("computed")


def calls_detail(calls: list[str]) -> str:
    """A passing ``uneven_lengths`` detail: the first refusal, how many refused and computed."""
    refused = [c for c in calls if c != "computed"]
    counts = (
        f"{len(refused)} of {len(calls)} calls refused, {len(calls) - len(refused)} computed "
        "and equal to the oracle"
    )
    return f"{refused[0]}; {counts}" if refused else counts


PLANS: dict[str, Callable[[Context], Plan | str]] = {
    "oracle": _plan_oracle,
    "masks": _plan_masks,
    "causality": _plan_causality,
    "gqa": _per_kind("gqa", ("gqa", "mqa"), ("none", "causal")),
    "lse": _per_kind("lse", ("self", "general"), ("causal", "bias"), draw=True),
    "batch_independence": _plan_batch,
    "fully_masked_rows": _plan_fully_masked,
    "gradients": _plan_gradients,
    "extreme_logits": _plan_extreme,
    GROWTH: _plan_growth,
    UNEVEN: _plan_uneven,
}
