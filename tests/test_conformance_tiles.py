"""The kit's default run reaches the shapes where real kernels break: tile-straddling lengths.

The tail-tile targets of :mod:`tests.conformance_targets` are each right at every length below
their tile, so the small buckets (``T, S <= 7``) never see their fault. The default
``check_attention`` (no ``shapes=``, default ``max_examples`` and seed) must fail each, and
Hypothesis must shrink the failure to the shortest tile length that still fails: the first
length of :data:`attnref.strategies.TILE_LENGTHS` the fault reaches. The report heads a
generated example "shrunk" and an explicit one "explicit", names the sub-case that failed on the
``Case(...)`` line, and its Python replay line pastes and runs.
"""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings

from attnref import strategies as ast
from attnref.testing import check_attention, load_target

GOOD = "tests.conformance_targets:good"


def _first(lengths: tuple[int, ...], fails: object) -> int:
    return next(n for n in lengths if fails(n))  # type: ignore[operator]


# target -> (the axis its fault is on, the lengths it fails at)
TAIL_FAULTS = {
    "skip_key_tail_64": ("s", lambda n: n > 64 and n % 64 != 0),
    "skip_key_tail_128": ("s", lambda n: n > 128 and n % 128 != 0),
    "skip_query_tail_64": ("t", lambda n: n > 64 and n % 64 != 0),
    "drop_key_128": ("s", lambda n: n > 128),
}


@pytest.mark.parametrize("name", sorted(TAIL_FAULTS))
def test_the_default_check_fails_a_tail_tile_fault_at_its_shortest_length(name):
    """The oracle property with its defaults (20 examples, seed 0) fails each fault, and the
    shrunk example's length on the fault's axis is the shortest tile length that fails (65 past
    a 64-tile, 129 past a 128-tile); the other axis shrinks to where it still fails."""
    axis, fails = TAIL_FAULTS[name]
    report = check_attention(
        load_target(f"tests.conformance_targets:{name}"),
        masked_rows="uniform",
        properties=["oracle"],
    )
    (r,) = report.results
    assert r.status == "failed", report.summary()
    assert r.example is not None and r.example.startswith("shrunk example"), r.example
    sizes = re.search(r"Config\(batch=\d+, t=(\d+), s=(\d+)", r.example)
    assert sizes is not None, r.example
    got = {"t": int(sizes[1]), "s": int(sizes[2])}[axis]
    assert got == _first(ast.TILE_LENGTHS, fails), (got, r.example)


def test_a_correct_kernel_passes_the_default_check_at_tile_lengths():
    """jax.nn's own attention passes every default property, tile-length draws included (it
    declares its masked-rows meaning); the drawn configs did reach tile lengths."""
    seen: set[tuple[int, int]] = set()
    good = load_target(GOOD)

    def spy(query, key, value, *args, **kw):
        seen.add((query.shape[1], key.shape[1]))
        return good(query, key, value, *args, **kw)

    report = check_attention(
        spy,
        masked_rows="uniform",
        properties=["oracle", "gqa", "gradients"],
        max_examples=8,
    )
    assert report.passed, report.summary()
    assert any(max(t, s) >= 15 for t, s in seen), seen  # a tile-length draw ran
    assert any(max(t, s) <= 7 for t, s in seen), seen  # and the small buckets


def test_tile_configs_draw_tile_lengths_and_keep_the_rest():
    base = ast.Config(batch=2, t=3, s=5, n=4, k=2, h=4, h_v=4, d_model=8)

    @settings(max_examples=30, database=None, deadline=None)
    @given(c=ast.tile_configs(base), self_c=ast.tile_configs(ast.BUCKETS[0]))
    def check(c: ast.Config, self_c: ast.Config) -> None:
        assert c.t in ast.TILE_LENGTHS and c.s in ast.TILE_LENGTHS
        assert (c.b, c.n, c.k, c.h, c.h_v) == (base.b, base.n, base.k, base.h, base.h_v)
        assert self_c.t == self_c.s in ast.TILE_LENGTHS

    check()
    # around every tile size 16 .. 256: n - 1, n, n + 1 and 2n + 1
    for n in ast.TILE_SIZES:
        assert {n - 1, n, n + 1, 2 * n + 1} <= set(ast.TILE_LENGTHS)
    assert list(ast.TILE_LENGTHS) == sorted(set(ast.TILE_LENGTHS))  # shrinks to the shortest


def test_an_explicit_failure_is_not_called_shrunk_and_names_its_sub_case():
    """``mask_row0_only`` fails the masks property's explicit first case (a ``[B, 1, 1, S]``
    key-padding mask): the example is headed explicit, not shrunk, and its ``Case(...)`` line
    names the mask kind that failed."""
    report = check_attention(
        load_target("tests.conformance_targets:mask_row0_only"),
        properties=["masks"],
        max_examples=3,
    )
    (r,) = report.results
    assert r.status == "failed"
    assert r.example is not None
    head, *rest = r.example.splitlines()
    assert head.startswith("explicit example") and "not shrunk" in head, r.example
    (case_line,) = [line for line in rest if "case=Case(" in line]
    assert case_line.endswith("# failed at: kind='random'"), case_line


def test_the_python_replay_line_pastes_and_reproduces_the_failure():
    """The summary's ``replay:`` line, run as it is, gives the same failure (same detail,
    same example), with the report's options (features, declared semantics, examples)."""
    target = "tests.conformance_targets:skip_query_tail_64"
    report = check_attention(
        load_target(target),
        target=target,
        features=("mask", "causal", "cross"),
        masked_rows="uniform",
        properties=["oracle"],
        max_examples=10,
    )
    failed = [r for r in report.results if r.status == "failed"]
    assert failed, report.summary()
    lines = [ln for ln in report.summary().splitlines() if ln.startswith("replay: ")]
    assert len(lines) == len(failed)
    for r, line in zip(failed, lines, strict=True):
        code = line.removeprefix("replay: ")
        assert "..." not in code and "masked_rows='uniform'" in code, code
        namespace: dict[str, object] = {}
        exec(code.replace("; check_attention(", "; result = check_attention("), namespace)
        (again,) = namespace["result"].results  # type: ignore[attr-defined]
        assert (again.name, again.status, again.detail) == (r.name, "failed", r.detail)
        assert again.example == r.example
