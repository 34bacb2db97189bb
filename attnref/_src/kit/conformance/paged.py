"""The conformance kit for a user's paged-KV-cache attention: :func:`check_paged`.

The target has the signature of :func:`attnref.decode.paged_attention`::

    fn(query [B, T, N, H], k_pages [P, page_size, K, H], v_pages [P, page_size, K, H],
       block_table [B, max_pages] int32, seq_lens [B] int32, **options) -> o [B, T, N, H]

(NumPy in, anything :func:`numpy.asarray` reads out; ``jax.numpy`` arrays for ``gradients``).
Token ``j`` of sequence ``b`` is in page ``block_table[b, j // page_size]`` at offset ``j %
page_size``; ``seq_lens`` counts every token, the ``T`` queries being the last ``T``. Options are
passed only when used: ``is_causal=True`` (``prefill``), ``return_lse=True`` (``lse``: ``(o, lse
[B, T, N])``).

Each property (:data:`PAGED_PROPERTIES`; ``docs/paged.md`` says what each checks) compares with
the float64 oracle :func:`attnref.oracle.paged_attention` within
:func:`attnref.tolerance.kernel_call_error_bound` (gradients:
:func:`attnref.tolerance.kernel_grad_error_bound`) on the gathered keys (``key_blocks=None``: any
page or split schedule; a gather does not round); ``page_size`` 8 and 16, lengths in ``[1, S]``.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st

from attnref import oracle, tolerance
from attnref._src.kit.closeness import assert_ratio_within, first_index
from attnref._src.kit.conformance.engine import changed, check_target, planned, run_suite
from attnref._src.kit.conformance.options import check_properties, check_subset
from attnref._src.kit.conformance.report import ConformanceReport
from attnref._src.kit.conformance.targets import describe_target, x64_if

PAGED_PROPERTIES = (
    "oracle",
    "unused_pages",
    "permutation",
    "append",
    "prefill",
    "gqa",
    "lse",
    "gradients",
)
PAGED_FEATURES = ("prefill", "gqa", "lse", "grad")
PAGED_DTYPES = ("float32", "float64")
_NEEDS = {"prefill": "prefill", "gqa": "gqa", "lse": "lse", "gradients": "grad"}
# (B, N, K, H, page_size, max_pages): H = H_v (the Pallas kernel's layout has one head dim)
_BUCKETS = ((2, 2, 2, 16, 16, 3), (3, 2, 2, 16, 8, 4))
_GQA_BUCKETS = ((2, 4, 2, 16, 16, 3), (2, 4, 1, 16, 8, 4))


class Problem:
    """One paged call: the arrays, and the contiguous twin of its cache (float64)."""

    def __init__(
        self, bucket: tuple[int, ...], seed: int, dtype: str, t: int = 1, fill: float = 1e4
    ) -> None:
        b, n, kh, h, ps, mp = bucket
        rng = np.random.default_rng(seed)
        num_pages = b * mp + 2
        self.dtype = np.dtype(dtype)
        self.q = rng.normal(size=(b, t, n, h)).astype(self.dtype)
        self.k_pages = rng.normal(size=(num_pages, ps, kh, h)).astype(self.dtype)
        self.v_pages = rng.normal(size=(num_pages, ps, kh, h)).astype(self.dtype)
        self.table = rng.permutation(num_pages)[: b * mp].reshape(b, mp).astype(np.int32)
        self.lens = rng.integers(max(1, t), mp * ps + 1, size=b).astype(np.int32)
        self.page_size = ps
        self.options: dict[str, Any] = {}
        self.seed = seed
        read = self.read_slots()
        self.k_pages[~read] = fill
        self.v_pages[~read] = fill

    def used(self) -> np.ndarray:
        """``[B, S]``: slot ``j`` of row ``b`` is read."""
        return np.arange(self.table.shape[1] * self.page_size)[None, :] < self.lens[:, None]

    def read_slots(self) -> np.ndarray:
        """``[P, page_size]``: the pool's slots that some sequence reads."""
        read = np.zeros(self.k_pages.shape[:2], bool)
        b_idx, j_idx = np.nonzero(self.used())
        read[self.table[b_idx, j_idx // self.page_size], j_idx % self.page_size] = True
        return read

    def args(self) -> tuple[np.ndarray, ...]:
        return self.q, self.k_pages, self.v_pages, self.table, self.lens

    def gathered(self, pages: np.ndarray) -> np.ndarray:
        b, m = self.table.shape
        g = pages.astype(np.float64)[np.clip(self.table, 0, pages.shape[0] - 1)]
        g = g.reshape(b, m * self.page_size, *pages.shape[2:])
        return np.where(self.used()[..., None, None], g, 0.0)

    def call(self) -> dict[str, Any]:
        return {
            "query": self.q,
            "key": self.gathered(self.k_pages).astype(self.dtype),
            "value": self.gathered(self.v_pages).astype(self.dtype),
            "key_value_seq_lengths": self.lens,
            "causal_alignment": "bottom_right",
            **self.options,
        }

    def scatter(self, grads: np.ndarray) -> np.ndarray:
        out = np.zeros(self.k_pages.shape[:3] + grads.shape[3:])
        b_idx, j_idx = np.nonzero(self.used())
        page = self.table[b_idx, j_idx // self.page_size]
        np.add.at(out, (page, j_idx % self.page_size), grads[b_idx, j_idx])
        return out


def _call(
    fn: Callable[..., Any], p: Problem, lse: bool = False
) -> tuple[np.ndarray, np.ndarray | None]:
    """``fn`` on a :class:`Problem`: float64 ``(o, lse or None)``, shapes checked."""
    with x64_if(p.dtype):
        out = fn(*p.args(), **p.options, **({"return_lse": True} if lse else {}))
        o, l_out = (out[0], out[1]) if lse else (out, None)
        o = np.asarray(o).astype(np.float64)
        want = (*p.q.shape[:3], p.v_pages.shape[-1])
        if o.shape != want:
            raise AssertionError(f"the target returned o {o.shape}; expected {want}")
        if l_out is None:
            return o, None
        l_arr = np.asarray(l_out).astype(np.float64)
        if l_arr.shape != p.q.shape[:3]:
            raise AssertionError(f"lse has shape {l_arr.shape}; expected {p.q.shape[:3]}")
        return o, l_arr


def _check(got: tuple[np.ndarray, np.ndarray | None], p: Problem, label: str) -> None:
    """``o`` (and ``lse``) within the kernel bound of the oracle; finite wherever it is."""
    o, lse = got
    ref, ref_lse = oracle.paged_attention(*p.args(), **p.options, return_lse=True)
    bound, lse_bound = tolerance.kernel_call_error_bound(**p.call(), dtype=p.dtype)
    if (idx := first_index(np.isfinite(ref) & ~np.isfinite(o))) is not None:
        raise AssertionError(f"{label}: non-finite output {o[idx]!r} at {idx}; oracle {ref[idx]!r}")
    assert_ratio_within(
        np.abs(o - ref),
        bound,
        "{label}: |o - oracle| = {error:.3e} at index {index} exceeds the derived bound "
        "{allowed:.3e} ({ratio:.3g} x)",
        label=label,
    )
    if lse is not None:
        assert_ratio_within(
            np.abs(lse - ref_lse),
            lse_bound,
            "{label}: |lse - oracle| = {error:.3e} at index {index} exceeds {allowed:.3e}",
            label=label,
        )


def _relayout(p: Problem, seed: int) -> Problem:
    """The same logical cache in another permutation of the pool."""
    q = copy.copy(p)
    perm = np.random.default_rng([seed, 7]).permutation(p.k_pages.shape[0])  # new id of page i
    q.k_pages, q.v_pages = np.empty_like(p.k_pages), np.empty_like(p.v_pages)
    q.k_pages[perm], q.v_pages[perm] = p.k_pages, p.v_pages
    q.table = perm[p.table].astype(np.int32)
    return q


def _unused(bucket: tuple[int, ...], seed: int, dtype: str) -> Problem:
    """NaN in the unused slots, and pages of other sequences in the unused table entries."""
    p = Problem(bucket, seed, dtype, fill=np.nan)
    used = np.arange(p.table.shape[1])[None, :] * p.page_size < p.lens[:, None]
    foreign = np.roll(p.table, 1, axis=0)  # pages of other sequences
    p.table = np.where(used, p.table, foreign).astype(np.int32)
    return p


def _prefill(bucket: tuple[int, ...], seed: int, dtype: str) -> Problem:
    p = Problem(bucket, seed, dtype, t=3)
    p.options = {"is_causal": True}
    return p


# The properties that check each dtype's problem against the oracle: (its problem, its label).
_FORWARD: dict[str, tuple[Callable[..., Problem], str]] = {
    "oracle": (Problem, "oracle"),
    "gqa": (Problem, "gqa"),
    "lse": (Problem, "lse"),
    "unused_pages": (_unused, "NaN in unused slots, foreign pages in unused entries"),
    "prefill": (_prefill, "chunked prefill T=3, is_causal"),
}


def _plan(name: str, fn: Callable[..., Any], dtypes: tuple[str, ...]) -> tuple[Any, Any]:
    """``(strategy, check)`` of property ``name``."""
    target = functools.partial(_call, fn)
    seeds = st.integers(0, 2**16)
    buckets = st.sampled_from(_GQA_BUCKETS if name == "gqa" else _BUCKETS)
    cases = st.tuples(buckets, seeds)
    if name in _FORWARD:
        make, label = _FORWARD[name]

        def check_forward(case: tuple[Any, int]) -> None:
            for dt in dtypes:
                p = make(*case, dt)
                _check(target(p, name == "lse"), p, f"{label} ({dt})")

        return cases, check_forward
    if name == "permutation":

        def check_perm(case: tuple[Any, int]) -> None:
            for dt in dtypes:
                p = Problem(*case, dt)
                a, b = target(p)[0], target(_relayout(p, case[1]))[0]
                _check((a, None), p, f"layout 1 ({dt})")
                bound, _ = tolerance.kernel_call_error_bound(**p.call(), dtype=p.dtype)
                assert_ratio_within(
                    np.abs(a - b),
                    2 * bound,
                    "two page layouts of one cache differ by {error:.3e} at {index}, more than "
                    "twice the bound ({allowed:.3e})",
                )

        return cases, check_perm
    if name == "append":

        def check_append(case: tuple[Any, int]) -> None:
            p = Problem(*case, dtypes[0])
            full = p.lens.copy()
            for length in range(1, int(full.max()) + 1, max(1, p.page_size // 3)):
                p.lens = np.minimum(full, length).astype(np.int32)
                _check(target(p), p, f"decode at length {length}")

        return cases, check_append

    def check_grad(case: tuple[Any, int]) -> None:
        p = Problem(*case, dtypes[0], fill=np.nan)
        cot = np.random.default_rng([case[1], 3]).normal(size=p.q.shape)
        with x64_if(p.dtype):

            def loss(q: Any, kp: Any, vp: Any) -> Any:
                o = fn(q, kp, vp, p.table, p.lens)
                return jnp.sum(jnp.asarray(cot, o.dtype) * o)

            grads = jax.grad(loss, argnums=(0, 1, 2))(*(jnp.asarray(a) for a in p.args()[:3]))
        dq, dk, dv = (np.asarray(g).astype(np.float64) for g in grads)
        ref = oracle.dot_product_attention_vjp(**p.call(), cotangent=cot)
        bnd = tolerance.kernel_grad_error_bound(**p.call(), cotangent=cot, dtype=p.dtype)
        read = p.read_slots()[..., None, None]
        for what, got, want, allowed in (
            ("query", dq, ref.query, bnd.query),
            ("k_pages", dk, p.scatter(ref.key), p.scatter(bnd.key)),
            ("v_pages", dv, p.scatter(ref.value), p.scatter(bnd.value)),
        ):
            if what != "query" and (idx := first_index(~read & (got != 0))) is not None:
                raise AssertionError(
                    f"d/d{what} = {got[idx]!r} at {idx}, an unused slot (never read): must be 0"
                )
            assert_ratio_within(
                np.abs(got - want),
                allowed,
                "|d/d{what} - oracle| = {error:.3e} at {index} exceeds the bound {allowed:.3e}",
                what=what,
            )

    return cases, check_grad


def check_paged(
    fn: Callable[..., Any],
    *,
    features: Sequence[str] = PAGED_FEATURES,
    dtypes: Sequence[str] = ("float32",),
    max_examples: int | None = None,
    seed: int = 0,
    properties: Sequence[str] | None = None,
    target: str | None = None,
    progress: Callable[[int, int, str], None] | None = None,
) -> ConformanceReport:
    """Run the paged-cache properties (module docstring) against ``fn``: a
    :class:`ConformanceReport` (signature ``"paged"``).

    ``features`` (of :data:`PAGED_FEATURES`): what ``fn`` supports (a property needing another
    is skipped). ``dtypes`` (of :data:`PAGED_DTYPES`): each forward property's formats
    (``append`` and ``gradients`` use the first). ``max_examples`` (``None``: 10), ``seed``,
    ``properties``, ``target``, ``progress`` as in :func:`check_attention`. Raises
    ``ValueError`` (an ``OptionError``) for an unknown property, feature or dtype, ``TypeError``
    for ``fn`` not callable.
    """
    names = check_properties(properties, PAGED_PROPERTIES)
    feats = check_subset("features", features, PAGED_FEATURES, empty=True)
    dts = check_subset("dtypes", dtypes, PAGED_DTYPES)
    check_target(fn, max_examples)

    def plan(name: str) -> tuple[Any, Any] | str:
        need = _NEEDS.get(name)
        if need is not None and need not in feats:
            return f"needs the {need!r} feature (not declared)"
        return _plan(name, fn, dts)

    run = planned(plan, seed=seed, max_examples=max_examples or 10)
    results = run_suite(names, run, seed=seed, progress=progress)
    return ConformanceReport(
        target=target or describe_target(fn),
        signature="paged",
        features=feats,
        declared={},
        results=results,
        options=changed(
            ("features", list(feats), list(PAGED_FEATURES)),
            ("dtypes", list(dts), ["float32"]),
            ("max_examples", max_examples, None),
        ),
    )
