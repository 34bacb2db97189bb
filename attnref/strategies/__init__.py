"""Hypothesis strategies for attention problems, at the kernel level and at the weight level::

    from hypothesis import given
    from attnref import strategies as ast

    @given(problem=ast.kernel_problems(ast.configs(dtypes=("float32",))))
    def test_my_kernel(problem):
        out = my_kernel(problem.q, problem.k, problem.v, **problem.options)
        ref, _ = problem.oracle()
        attnref.testing.assert_attention_close(
            out, ref, dtype=problem.config.dtype, bound=problem.bound()[0]
        )

Design rules:

* **Shapes from buckets** (a jitted function compiles once per bucket and dtype), ordered small
  to large so Hypothesis shrinks to the smallest: :data:`BUCKETS` (power-of-two head dims, every
  shape class), :data:`KERNEL_BUCKETS` (odd head dims), :data:`WEIGHT_BUCKETS` (zero to two
  leading batch dims). :func:`tile_configs` gives a bucket lengths from :data:`TILE_LENGTHS`
  (``n - 1, n, n + 1, 3n/2 + 1, 2n + 1`` for the tiles :data:`TILE_SIZES` 16 .. 256), where a
  kernel's partial last tile is, sorted so a failure shrinks to the shortest length.
* **No degenerate fill.** Arrays are seeded PCG64 standard normal (the seed a labelled draw),
  rounded once to the dtype; the oracle sees the rounded values. Identical rows (every key, or
  every query, equal) are drawn on purpose, labelled ``"identical rows"``. Every draw is
  labelled and summarised with ``hypothesis.note``.
* **Every broadcastable shape.** A boolean mask and an additive bias take any of the 16
  :data:`BROADCAST_SHAPES` (each axis of ``[B, N, T, S]`` full or 1; rank 4, as jax.nn requires),
  drawn apart (:func:`broadcast_shapes`), one pair per example (at most one new compilation per
  kind), shrinking towards the full ``"BNTS"``.
* **Mask kinds** (:data:`MASK_KINDS`): ``none``, ``causal``, ``padding`` (sequence lengths),
  ``random`` (boolean mask, every row keeps a key), ``bias``, ``alibi``, ``neg_inf_bias``
  (``-inf`` entries, every row keeps a finite one), ``window``, ``segments``, ``softcap``,
  ``fully_masked_row`` and ``combined`` (causal, padding, a random mask and a bias);
  :data:`PRODUCTION_KINDS` (``sinks``, ``sink_tokens``, ``dropout``) only where asked for.
  :data:`KIND_FEATURES`: the :func:`attnref.testing.check_attention` feature each kind needs.
  :func:`make_options` builds every kind's arrays at both levels; ``empty_rows=True`` lets a
  query row lose every key by accident too.
* **Option mixes.** :func:`mixed_kernel_problems` draws a static profile of
  :data:`STATIC_PROFILES` with up to three :data:`ARRAY_KINDS`; :func:`with_production` adds
  learnable sinks, sink tokens under a window and a dropout mask of every broadcast shape.

Kernel problems use the layout of :func:`attnref.dot_product_attention` (``q [B, T, N, H]``,
``k [B, S, K, H]``, ``v [B, S, K, H_v]``); weight-level problems that of
:func:`attnref.oracle.attention` (``x_q [B, T, d_model]``, ``x_kv [B, S, d_model]``, parameters
from :func:`attnref.init_params`).

**Attention states**: :func:`attention_states` draws ``P`` states ``(o, lse)`` where merges break
(:class:`StateStack`): ``|lse|`` up to ``1e4``, differences beyond 88 (float32 ``exp``
overflows) and 709 (float64), exact ties, empty states (``lse = -inf``, ``o`` NaN).
:func:`merge_trees` draws a merge tree (nested pairs of piece indices) and :func:`key_partitions`
a problem's keys split into ``P`` pieces (:class:`KeyPartition`; ``.bound()`` the merged pieces'
allowance).
"""

# ruff: noqa: F401 (the names below are the exports: __all__ lists them)
from __future__ import annotations

from attnref._src.formulations.kernel import STATIC_OPTIONS

from ._kernel import IDENTICAL, KernelProblem, kernel_inputs, kernel_problems, make_kernel_problem
from ._masks import (
    BIAS_SHAPE_KINDS,
    KIND_FEATURES,
    MASK_KINDS,
    MASK_SHAPE_KINDS,
    PRODUCTION_KINDS,
    make_options,
    mask_kinds,
    segment_ids,
    seq_lengths,
)
from ._mixes import (
    ARRAY_KINDS,
    DROPOUT_RATES,
    PRODUCTION_OPTIONS,
    STATIC_PROFILES,
    mixed_kernel_problems,
    with_production,
)
from ._shapes import (
    BROADCAST_SHAPES,
    BUCKETS,
    KERNEL_BUCKETS,
    TILE_LENGTHS,
    TILE_SIZES,
    WEIGHT_BUCKETS,
    Config,
    DrawFn,
    broadcast_shape,
    broadcast_shapes,
    configs,
    tile_configs,
)
from ._states import (
    CENTERS,
    LAYOUTS,
    SPREADS,
    STATE_DTYPES,
    STATE_SHAPES,
    KeyPartition,
    StateStack,
    Tree,
    apply_merge_tree,
    attention_states,
    balanced_tree,
    key_partitions,
    make_key_partition,
    make_state_stack,
    merge_trees,
    sequential_tree,
    tree_depth,
    tree_leaves,
)
from ._weight import WEIGHT_KINDS, AttentionProblem, attention_problems, make_attention_problem

__all__ = sorted(n for n in dir() if not n.startswith("_") and n != "annotations")
