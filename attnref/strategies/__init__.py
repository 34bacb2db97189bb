"""Hypothesis strategies for attention problems, at the kernel level and at the weight level.

A kernel author writes property tests with these instead of hand-picking shapes::

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

* **Shapes from buckets.** A config (``batch, T, S, N, K, H, H_v, d_model``, dtype) is drawn from a
  short tuple of buckets, so a jitted function is compiled once per bucket and dtype, not once per
  example: :data:`BUCKETS` (power-of-two head dims, every attention shape class),
  :data:`KERNEL_BUCKETS` (odd head dims) and :data:`WEIGHT_BUCKETS` (zero, one and two leading
  batch dims, for the weight level). Buckets are ordered small to large, so Hypothesis shrinks
  towards the smallest.
* **Tile-straddling lengths.** :func:`tile_configs` gives a bucket lengths from
  :data:`TILE_LENGTHS` (``n - 1, n, n + 1, 3n/2 + 1, 2n + 1`` for the tile sizes
  :data:`TILE_SIZES` 16 .. 256), where a kernel's last, partial tile is; sorted, so a failure
  shrinks to the shortest length that still fails.
* **No degenerate fill.** Arrays come from NumPy's seeded PCG64 generator (the seed is a labelled
  draw), standard normal, rounded once to the tested dtype; the oracle sees the rounded values.
  Identical rows (every key equal, or every query equal) are a special case drawn on purpose with
  the label ``"identical rows"``, never an accident of shrinking.
* **Every draw is labelled** (``draw(..., label=...)``) and summarised with ``hypothesis.note``.
* **Every broadcastable shape.** A boolean mask and an additive bias may have any of the 16
  shapes :data:`BROADCAST_SHAPES` (each axis of ``[B, N, T, S]`` full or 1; rank 4 only, as
  :func:`jax.nn.dot_product_attention` and :func:`attnref.dot_product_attention` require).
  :func:`kernel_problems` draws the mask's and the bias's shape separately (labelled draws,
  :func:`broadcast_shapes`), one pair per example: a shape changes the compiled program, so an
  example costs at most one new compilation per mask kind, and the shapes shrink towards the
  full ``"BNTS"``, so a shrunk example shows the least broadcasting that still fails.
* **Mask kinds** (:data:`MASK_KINDS`): ``none``, ``causal``, ``padding`` (sequence lengths),
  ``random`` (boolean mask, every row keeps a key), ``bias``, ``alibi``, ``neg_inf_bias`` (a bias
  with ``-inf`` entries, every row keeps a finite one), ``window``, ``segments`` (segment ids),
  ``softcap``, ``fully_masked_row`` (a boolean mask with one row entirely False) and ``combined``
  (causal, padding, a random mask and a bias together); :data:`PRODUCTION_KINDS` (``sinks``,
  ``sink_tokens``, ``dropout``) are drawn only where asked for. :data:`KIND_FEATURES` names the
  feature of :func:`attnref.testing.check_attention` each kind needs. One builder,
  :func:`make_options`, makes every kind's arrays, at the kernel level and (rendered to a full
  ``[..., T, S]`` mask and bias) at the weight level; ``empty_rows=True`` lets masks, lengths,
  segment ids and ``-inf`` biases leave a query row with no key by accident, as well as on
  purpose.
* **Option mixes.** :func:`mixed_kernel_problems` draws one of the static option profiles
  :data:`STATIC_PROFILES` (causal alignment, windows, softcap, the masked-rows policy) with up to
  three of the array kinds :data:`ARRAY_KINDS` at once; :func:`with_production` adds the
  production options to any kernel problem (learnable sinks, sink tokens under a window, a
  deterministic dropout mask of every broadcast shape).

Kernel problems use the layout of :func:`attnref.dot_product_attention` (``q [B, T, N, H]``,
``k [B, S, K, H]``, ``v [B, S, K, H_v]``); weight-level problems the multi-head layout of
:func:`attnref.oracle.attention` (``x_q [B, T, d_model]``, ``x_kv [B, S, d_model]``, parameters
from :func:`attnref.init_params`, GQA through ``num_kv_heads``).

**Attention states** (:mod:`._states`): :func:`attention_states` draws ``P`` states ``(o, lse)``
where merges break (:class:`StateStack`): ``|lse|`` up to ``1e4``, differences between states
beyond 88 (``exp`` of the difference overflows float32, so ``lse + log(1 + exp(lse_b - lse))``
is ``inf``) and beyond 709 (float64), exact ties, and empty states (``lse = -inf``) whose ``o``
holds NaN (never to be read). :func:`merge_trees` draws a merge tree, a nested pair of piece
indices (every order and grouping of ``P`` pieces is one), and :func:`key_partitions` a kernel
problem's keys split into ``P`` pieces (:class:`KeyPartition`: each piece is the call with an
extra key mask; ``.bound()`` is the derived allowance of the merged pieces against the whole
call).

Submodules: :mod:`._shapes` (Config, buckets, broadcast shapes), :mod:`._masks` (mask kinds and
their builder), :mod:`._kernel` (kernel-level problems), :mod:`._mixes` (option mixes),
:mod:`._weight` (weight-level problems), :mod:`._states` (states, merge trees, key partitions).
"""

# ruff: noqa: F401 (the names below are the exports: __all__ lists them)
from __future__ import annotations

from attnref._src.formulations.kernel import STATIC_OPTIONS

from ._kernel import (
    IDENTICAL,
    KernelProblem,
    kernel_inputs,
    kernel_problems,
    make_kernel_problem,
)
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
from ._weight import (
    WEIGHT_KINDS,
    AttentionProblem,
    attention_problems,
    make_attention_problem,
)

__all__ = sorted(n for n in dir() if not n.startswith("_") and n != "annotations")
