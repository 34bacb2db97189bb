"""The blockwise kernel's static schedule skips exactly the tiles the mask removes.

* The schedule (:func:`attnref.costs.tile_schedule`) against the oracle's allowed pairs
  (:func:`attnref.oracle.kernel_allowed`, written from the definition): a tile is computed if and
  only if some pair of it is allowed, and computed without the mask if and only if every pair of
  it is allowed and it holds no padding. Exact, so a schedule that skipped an allowed tile (a wrong
  answer) or computed a masked one (lost speed) fails.
* Counted by hand for causal attention: the ``n (n + 1) / 2`` tiles on and below the diagonal,
  the ``n`` diagonal ones with the mask.
* XLA's executed dot FLOPs (every ``while`` body times its trip count) equal the cost model
  :func:`attnref.costs.blockwise_dot_flops`, forward and under ``jax.grad``: the compiled program
  computes the scheduled tiles and no others.

The values the kernel computes from this schedule are checked against the oracle by
``tests/test_blockwise.py`` (every option, block size and padding).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import attnref
from attnref import oracle
from attnref.costs import blockwise_dot_flops, hlo_dot_flops, tile_schedule

from .helpers import scaled

SIDES = st.one_of(st.none(), st.integers(0, 12))


@st.composite
def band_settings(draw: st.DrawFn) -> dict:
    """A shape, tile sizes and the static rules (causality, window, alignment, sink tokens)."""
    t, s = draw(st.integers(1, 40)), draw(st.integers(1, 40))
    window = draw(st.one_of(st.none(), st.tuples(SIDES, SIDES)))
    causal = draw(st.booleans())
    sinks = draw(st.integers(0, 5)) if window is not None and window[0] is not None else 0
    return dict(
        t=t,
        s=s,
        block_q=draw(st.integers(1, 9)),
        block_k=draw(st.integers(1, 9)),
        is_causal=causal,
        window=window,
        alignment=draw(st.sampled_from(("top_left", "bottom_right"))),
        sink_tokens=sinks,
    )


def _tiles_of(allowed: np.ndarray, bq: int, bk: int) -> tuple[np.ndarray, np.ndarray]:
    """Per tile: some pair allowed; every pair allowed and no padding (from ``[T, S]``)."""
    t, s = allowed.shape
    nq, nk = -(-t // bq), -(-s // bk)
    padded = np.zeros((nq * bq, nk * bk), bool)
    padded[:t, :s] = allowed
    grid = padded.reshape(nq, bq, nk, bk)
    real = np.zeros_like(padded)
    real[:t, :s] = True
    unpadded = real.reshape(nq, bq, nk, bk).all(axis=(1, 3))
    return grid.any(axis=(1, 3)), grid.all(axis=(1, 3)) & unpadded


def _as_set(pairs: np.ndarray) -> set[tuple[int, int]]:
    return {(int(i), int(j)) for i, j in pairs}


@given(band_settings(), st.booleans())
@scaled(30)  # NumPy only, about 5 ms an example: enough to reach tiles that only a sink reads
def test_the_schedule_is_exactly_the_oracles_allowed_tiles(setting, dynamic):
    """Computed tiles = tiles with an allowed pair; full tiles = wholly allowed, unpadded ones
    (none when a run-time mask may remove pairs the schedule cannot see)."""
    allowed = oracle.kernel_allowed(
        (1, 1, setting["t"], setting["s"]),
        is_causal=setting["is_causal"],
        local_window_size=setting["window"],
        causal_alignment=setting["alignment"],
        sink_tokens=setting["sink_tokens"],
    )[0, 0]
    some, every = _tiles_of(allowed, setting["block_q"], setting["block_k"])
    sched = tile_schedule(**setting, dynamic=dynamic)
    assert sched.tiles == some.shape
    computed = _as_set(sched.edge) | _as_set(sched.full)
    assert computed == _as_set(np.argwhere(some)), setting
    assert not _as_set(sched.edge) & _as_set(sched.full)
    expected_full = set() if dynamic else _as_set(np.argwhere(every))
    assert _as_set(sched.full) == expected_full, setting
    assert sched.skipped == some.size - int(some.sum())


@pytest.mark.parametrize(("n", "block"), [(1, 4), (5, 3), (32, 128)])
def test_causal_computes_the_lower_triangle_of_tiles(n, block):
    """``T = S = n b`` causal in ``b x b`` tiles, by hand: ``n (n + 1) / 2`` tiles, the ``n``
    on the diagonal with the mask, ``n (n - 1) / 2`` skipped."""
    sched = tile_schedule(n * block, n * block, block, block, is_causal=True)
    assert (len(sched.edge), len(sched.full)) == (n, n * (n - 1) // 2)
    assert sched.skipped == n * (n - 1) // 2
    assert all(i == j for i, j in sched.edge) and all(i > j for i, j in sched.full)


# Small enough to compile in about a second each; blocks of 8 make 6 x 5 tiles with padding.
B, T, S, N, K, H, HV, BLOCK = 1, 44, 37, 4, 2, 4, 3, 8
CASES = {
    "none": {},
    "causal": {"is_causal": True},
    "window": {"local_window_size": (5, 2)},
    "causal window and sink tokens": {
        "is_causal": True,
        "local_window_size": (6, None),
        "sink_tokens": 3,
    },
    "bottom-right causal": {"is_causal": True, "causal_alignment": "bottom_right"},
    "lengths, top-left causal": {"is_causal": True, "key_value_seq_lengths": np.array([30])},
}


def _static(options: dict) -> dict:
    """The schedule's arguments for kernel options (the kernel's own reading)."""
    dynamic = "key_value_seq_lengths" in options
    return dict(
        is_causal=options.get("is_causal", False),
        window=options.get("local_window_size"),
        alignment=options.get("causal_alignment", "top_left"),
        sink_tokens=options.get("sink_tokens", 0),
        dynamic=dynamic,
    )


@pytest.mark.parametrize("name", list(CASES))
def test_xla_computes_the_scheduled_tiles_only(name):
    """The compiled program's executed dot FLOPs equal the model's, forward and backward, and the
    causal and windowed calls compute fewer than every tile."""
    options = CASES[name]
    q = jnp.ones((B, T, N, H))
    k, v = jnp.ones((B, S, K, H)), jnp.ones((B, S, K, HV))

    def out(q, k, v):
        return attnref.blockwise_dot_product_attention(
            q, k, v, block_q=BLOCK, block_k=BLOCK, **options
        )

    sched = tile_schedule(T, S, BLOCK, BLOCK, **_static(options))
    fwd, bwd = blockwise_dot_flops(B, N, H, HV, sched, BLOCK, BLOCK)
    text = jax.jit(out).lower(q, k, v).compile().as_text()
    assert hlo_dot_flops(text, executed=True) == fwd
    grad = jax.jit(jax.grad(lambda *a: out(*a).sum(), argnums=(0, 1, 2)))
    assert hlo_dot_flops(grad.lower(q, k, v).compile().as_text(), executed=True) == fwd + bwd
    assert (sched.skipped > 0) == bool(options)  # every case but "none" restricts statically
