"""Checks at production shapes (``check_attention(..., shapes="production")``): each property
runs a fixed list of cases, cheapest first, against the fast float64 oracle, stopping at the
first failure: lengths ``2^k - 1, 2^k, 2^k + 1`` for ``k = 7 .. 13`` (``T == S``, and ``T != S``
with ``cross``); head dims 64, 128, 256 (the declared ``(H, H_v)`` instead, if any); up to 32
query heads over 8 (GQA), 1 (MQA) or 32 K/V heads; every allowed mask kind, ragged lengths one
past a 128-tile, the lse and the gradients.

A case's work ``B N T S (H + H_v)`` is capped at :data:`WORK_BUDGET` (``B N T S`` at
:data:`ARRAY_BUDGET` for kinds with ``[.., T, S]`` arrays, which skip longer lengths) by taking
fewer heads (one head at head dim 64 always runs): minutes on two cores. ``max_examples`` keeps
the first cases. ``causality`` and ``extreme_logits`` run at the small shapes only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from attnref import strategies as ast
from attnref._src.kit.conformance.context import Context
from attnref._src.kit.conformance.options import NEEDS
from attnref._src.kit.conformance.plans import assert_gradients
from attnref._src.kit.conformance.references import assert_lse, assert_output

WORK_BUDGET = 2**33
ARRAY_BUDGET = 2**25
LENGTHS = tuple(n for k in range(7, 14) for n in (2**k - 1, 2**k, 2**k + 1))
HEAD_DIMS = (64, 128, 256)
_ARRAY_KINDS = frozenset(
    {"random", "bias", "alibi", "neg_inf_bias", "fully_masked_row", "combined"}
)
SMALL_ONLY = {
    "causality": "runs at the small shapes only (no tiling question: a prefix property)",
    "extreme_logits": "runs at the small shapes only (logit size, not tiling)",
}


@dataclasses.dataclass(frozen=True)
class Case:
    """One production case (``str``: its label)."""

    config: ast.Config
    kind: str
    seed: int
    ragged: bool = False

    def __str__(self) -> str:
        c = self.config
        h_v = "" if c.h_v == c.h else f" H_v={c.h_v}"
        return f"B={c.b} T={c.t} S={c.s} N={c.n} K={c.k} H={c.h}{h_v} {self.kind}" + (
            " ragged" if self.ragged else ""
        )


def _config(
    b: int, t: int, s: int, n: int, k: int, dims: tuple[int, int], dtype: str
) -> ast.Config:
    h, h_v = dims
    return ast.Config(batch=b, t=t, s=s, n=n, k=k, h=h, h_v=h_v, d_model=8, dtype=dtype)


def _heads(
    ctx: Context, b: int, t: int, s: int, dims: tuple[int, int], kind: str
) -> tuple[int, int] | None:
    """``(N, K)``: the most heads (<= 32; ``K = N / 4`` under gqa) the budgets allow, or None."""
    if kind in _ARRAY_KINDS and b * t * s > ARRAY_BUDGET:
        return None
    n = 32
    while n > 1:
        work_ok = b * n * t * s * sum(dims) <= WORK_BUDGET
        arrays_ok = kind not in _ARRAY_KINDS or b * n * t * s <= ARRAY_BUDGET
        if work_ok and arrays_ok:
            return n, (max(1, n // 4) if "gqa" in ctx.features else n)
        n //= 2
    return 1, 1


def _past_tile(n: int) -> int:
    """A length one past a 128-tile below ``n`` (1 when ``n <= 129``)."""
    return max(1, ((n - 2) // 128) * 128 + 1)


def _sweep(
    ctx: Context, pairs: list[tuple[int, int]], kinds: tuple[str, ...], b: int = 1
) -> list[Case]:
    out: list[Case] = []
    for i, (t, s) in enumerate(pairs):
        kind = kinds[i % len(kinds)]
        fixed = ctx.head_dim is not None  # a declared head dim is never halved
        h = HEAD_DIMS[i % len(HEAD_DIMS)]
        dims = (h, h) if ctx.head_dim is None else ctx.head_dim
        heads = _heads(ctx, b, t, s, dims, kind)
        while not fixed and heads == (1, 1) and h > 64 and b * t * s * 2 * h > WORK_BUDGET:
            h //= 2  # one head over budget: the smallest head dim instead
            dims = (h, h)
            heads = _heads(ctx, b, t, s, dims, kind)
        if heads is None:
            continue
        out.append(Case(_config(b, t, s, *heads, dims, ctx.primary), kind, seed=i))
    return sorted(out, key=_work)


def _work(case: Case) -> int:
    """``B N T S (H + H_v)``: the forward's multiply-adds."""
    c = case.config
    return c.b * c.n * c.t * c.s * (c.h + c.h_v)


def _pairs(ctx: Context) -> list[tuple[int, int]]:
    pairs = [(n, n) for n in LENGTHS]
    if "cross" in ctx.features:
        pairs += [(1, 8193), (129, 4097), (4095, 255), (1023, 2049)]
    return pairs


def cases(ctx: Context, name: str) -> list[Case] | str:
    """The production cases of property ``name`` (cheapest first), or why it is skipped."""
    if name in SMALL_ONLY:
        return SMALL_ONLY[name]
    if name in NEEDS and NEEDS[name] not in ctx.features:
        return f"needs feature {NEEDS[name]!r}"
    if name == "oracle":
        return _sweep(ctx, _pairs(ctx), ("none",))
    if name == "masks":
        kinds = ctx.kinds(tuple(k for k in ast.MASK_KINDS if k not in ("none",)))
        if not kinds:
            return "needs a mask feature"
        lengths = [129, 257, 1025, 2049, 4097, 8193]
        pairs = [(n, n) for n in lengths for _ in kinds]
        return _sweep(ctx, pairs, kinds)
    if name == "gqa":
        out = []
        for i, (t, n, k, h) in enumerate(((255, 32, 8, 128), (1025, 32, 1, 64), (2049, 8, 2, 256))):
            dims = (h, h) if ctx.head_dim is None else ctx.head_dim
            out.append(Case(_config(1, t, t, n, k, dims, ctx.primary), "none", seed=i))
        return out
    if name == "lse":
        kinds = ctx.kinds(("none", "causal", "bias"))
        return _sweep(ctx, [(n, n) for n in (127, 128, 129, 1025, 4097)], kinds)
    if name == "gradients":
        kinds = ctx.kinds(("none", "causal", "padding"))
        return _sweep(ctx, [(n, n) for n in (127, 129, 255, 257, 1025)], kinds)
    if name in ("batch_independence", "fully_masked_rows"):
        if not {"query_seq_lengths", "key_value_seq_lengths"} <= ctx.features:
            return "needs features 'query_seq_lengths' and 'key_value_seq_lengths' (ragged lengths)"
        sizes = (257, 1025) if name == "fully_masked_rows" else (129, 1025, 2049)
        return [
            dataclasses.replace(c, ragged=True)
            for c in _sweep(ctx, [(n, n) for n in sizes], ("none",), b=2)
        ]
    return f"no production cases for {name!r}"


def problem(ctx: Context, case: Case, empty: bool = False) -> ast.KernelProblem:
    """The case's problem; ``ragged``: lengths ``[T, T']``, ``[S, S']``, ``T'``, ``S'`` one past
    a 128-tile (``S' = 0`` with ``empty``)."""
    p = ctx.problem(case.config, case.kind, case.seed)
    if case.ragged:
        c = case.config
        q_len = np.array([c.t, _past_tile(c.t)], np.int32)
        kv_len = np.array([c.s, 0 if empty else _past_tile(c.s)], np.int32)
        p = p.replace(options={"query_seq_lengths": q_len, "key_value_seq_lengths": kv_len})
    return p


class _Ahead:
    """The problems of ``cases``, each built on a thread while the case before it runs, and the
    target's forward program for it compiled there (``want_lse``; ``None``: not the forward):
    drawing and casting the arrays, building the masks and XLA's compile leave a core free
    while the oracle and the target use both. The same problems and programs, sooner."""

    def __init__(
        self, ctx: Context, cases: Sequence[Case], empty: bool, want_lse: bool | None
    ) -> None:
        self.ctx, self.cases, self.empty, self.want_lse = ctx, list(cases), empty, want_lse
        self.pool: ThreadPoolExecutor | None = None  # started by the first case with a next
        self.next: tuple[Case, Future[ast.KernelProblem]] | None = None

    def __call__(self, case: Case) -> ast.KernelProblem:
        """``problem(ctx, case, empty)``; the following case's build starts before returning."""
        ready = self.next
        self.next = None
        p = ready[1].result() if ready is not None and ready[0] == case else None
        if case in self.cases and (i := self.cases.index(case) + 1) < len(self.cases):
            self.pool = self.pool or ThreadPoolExecutor(1, thread_name_prefix="attnref-problems")
            self.next = (after := self.cases[i], self.pool.submit(self._build, after))
        elif self.pool is not None:  # the last case: the thread ends
            self.pool.shutdown(wait=False)
            self.pool = None
        return p if p is not None else problem(self.ctx, case, self.empty)

    def _build(self, case: Case) -> ast.KernelProblem:
        p = problem(self.ctx, case, self.empty)
        if self.want_lse is not None:
            self.ctx.compile_ahead(p, self.want_lse)
        return p


def check(ctx: Context, name: str, cases: Sequence[Case] = ()) -> Callable[[Case], None]:
    """Property ``name``'s check of one production case; ``cases``: the cases to be run, in
    order, whose problems are built one ahead (:class:`_Ahead`)."""
    want_lse, empty = name == "lse", name == "fully_masked_rows"
    ahead = _Ahead(ctx, cases, empty, want_lse=None if name == "gradients" else want_lse)
    tail = ", S'=0" if empty else ""  # fully_masked_rows: batch element 1 has no key

    def forward(case: Case) -> None:
        p = ahead(case)
        out, lse = ctx.run(p, want_lse=want_lse)
        assert_output(out, ctx.view(p), f"{name} [{case}{tail}]")
        if want_lse:
            assert_lse(lse, ctx.view(p), f"lse [{case}]")

    def gradients(case: Case) -> None:
        p = ctx.view(ahead(case))
        c = case.config
        rng = np.random.default_rng([case.seed, 1])
        cot = rng.standard_normal((c.b, c.t, c.n, c.h_v)).astype(c.dtype)
        assert_gradients(p, cot, ctx.target.vjp(p, cot), f"gradients [{case}]")

    def batch(case: Case) -> None:
        p = ahead(case)
        full, _ = ctx.run(p)
        assert_output(full, ctx.view(p), f"batch_independence [{case}] batched")
        for b in range(case.config.b):
            one, _ = ctx.run(p.batch_slice(b))
            assert_output(one, ctx.view(p.batch_slice(b)), f"batch element {b} alone [{case}]")

    table = {"gradients": gradients, "batch_independence": batch}
    return table.get(name, forward)
