"""Option mixes: the static option profiles :data:`STATIC_PROFILES` with up to three of the
array kinds :data:`ARRAY_KINDS` at once (:func:`mixed_kernel_problems`)."""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import note
from hypothesis import strategies as st

from ._kernel import KernelProblem, make_kernel_problem
from ._masks import kind_name, segment_ids, seq_lengths
from ._shapes import (
    BROADCAST_SHAPES,
    Config,
    DrawFn,
    broadcast_shape,
    broadcast_shapes,
    configs_strategy,
)

# The kinds that are arrays (or an array pair), which mixed_kernel_problems combines (at most one
# of bias, alibi and neg_inf_bias per problem).
ARRAY_KINDS = ("random", "bias", "alibi", "neg_inf_bias", "padding", "segments")

# Static option profiles of attnref.dot_product_attention (masked_rows and causal_alignment set a
# KernelProblem's semantics): each compiles once per bucket and dtype.
STATIC_PROFILES: tuple[dict[str, Any], ...] = (
    dict(),
    dict(is_causal=True, masked_rows="uniform"),
    dict(is_causal=True, causal_alignment="bottom_right", local_window_size=(2, 0)),
    dict(local_window_size=(1, 1), softcap=2.0, masked_rows="nan"),
    dict(is_causal=True, causal_alignment="bottom_right", softcap=3.0, masked_rows="uniform"),
    dict(local_window_size=(None, 1), causal_alignment="bottom_right"),
)


@st.composite
def mixed_kernel_problems(
    draw: DrawFn,
    configs: st.SearchStrategy[Config] | None = None,
    *,
    profiles: tuple[dict[str, Any], ...] = STATIC_PROFILES,
    kinds: tuple[str, ...] = ARRAY_KINDS,
    max_kinds: int = 3,
    mask_shapes: tuple[str, ...] = BROADCAST_SHAPES,
    bias_shapes: tuple[str, ...] = BROADCAST_SHAPES,
) -> KernelProblem:
    """A :class:`KernelProblem` mixing a static profile with several array kinds (``kind``
    ``+``-joined), labelled draws of a config, a profile, up to ``max_kinds`` of ``kinds`` (one
    bias at most: ``neg_inf_bias`` over ``alibi`` over ``bias``), broadcast shapes, a seed, and
    lengths and segment ids (independent packings) where drawn; rows may lose every key by
    accident (``empty_rows=True``). ``ValueError`` (when drawn) for other kinds or no profile."""
    bad = [k for k in kinds if k not in ARRAY_KINDS]
    if bad or not profiles:
        raise ValueError(f"kinds must be a subset of ARRAY_KINDS and profiles non-empty: {bad}")
    config = draw(configs_strategy() if configs is None else configs, label="config")
    profile = draw(st.sampled_from(tuple(profiles)), label="static profile")
    chosen = draw(st.sets(st.sampled_from(tuple(kinds)), max_size=max_kinds), label="array kinds")
    if "neg_inf_bias" in chosen:
        chosen -= {"alibi", "bias"}
    elif "alibi" in chosen:
        chosen -= {"bias"}
    picked = tuple(k for k in ARRAY_KINDS if k in chosen)
    mask_shape = bias_shape = None
    if "random" in chosen:
        mask_shape = draw(broadcast_shapes(tuple(mask_shapes)), label="mask shape")
    if chosen & {"bias", "neg_inf_bias"}:
        bias_shape = draw(broadcast_shapes(tuple(bias_shapes)), label="bias shape")
    seed = draw(st.integers(0, 2**32 - 1), label="data seed")
    note(
        f"config={config!r} profile={profile} kinds={picked} mask_shape={mask_shape} "
        f"bias_shape={bias_shape} seed={seed}"
    )
    seeded = tuple(k for k in picked if k not in ("padding", "segments"))
    problem = make_kernel_problem(
        config,
        seeded,
        seed,
        static=profile,
        mask_shape=mask_shape,
        bias_shape=bias_shape,
        empty_rows=True,
    )
    c, opts = config, problem.options
    if "padding" in chosen:
        opts["query_seq_lengths"] = draw(seq_lengths(c.b, c.t), label="query seq lengths")
        opts["key_value_seq_lengths"] = draw(seq_lengths(c.b, c.s), label="key/value seq lengths")
    if "segments" in chosen:
        q_seg = draw(segment_ids(c.b, c.t), label="query segment ids")
        kv_seg = draw(segment_ids(c.b, c.s), label="key/value segment ids")
        opts["segment_ids"] = (q_seg, kv_seg)
    problem.kind = kind_name(picked)
    return problem


# The production options each with_production draw may add (see :func:`with_production`).
PRODUCTION_OPTIONS = ("sinks", "sink_tokens", "dropout")
DROPOUT_RATES = (0.0, 0.25, 0.5)


@st.composite
def with_production(
    draw: DrawFn,
    problems: st.SearchStrategy[KernelProblem],
    *,
    options: tuple[str, ...] = PRODUCTION_OPTIONS,
    keep_shapes: tuple[str, ...] = BROADCAST_SHAPES,
) -> KernelProblem:
    """A problem of ``problems`` with some of the production options of
    :func:`attnref.dot_product_attention` added (each drawn on or off): learnable ``sinks``
    (``[N]``, normal times 3, an entry ``-inf`` now and then: no sink for that head),
    ``sink_tokens`` (1 or 2, only where the problem has a window with a left side), and a
    deterministic dropout (a keep mask of a shape drawn from ``keep_shapes``, every broadcast
    shape by default, and a rate from :data:`DROPOUT_RATES`). The arrays come from the
    problem's seed; ``kind`` gains ``+sinks``, ``+sink_tokens``, ``+dropout``."""
    p = draw(problems)
    c = p.config
    rng = np.random.default_rng(p.seed + 7919)
    extra: dict[str, Any] = {}
    names: list[str] = []
    if "sinks" in options and draw(st.booleans()):
        z = rng.standard_normal(c.n) * 3.0
        if c.n > 1 and draw(st.booleans()):
            z[draw(st.integers(0, c.n - 1))] = -np.inf
        extra["sinks"] = z.astype(p.dtype)
        names.append("sinks")
    window = p.options.get("local_window_size")
    left = window if isinstance(window, int) else (None if window is None else window[0])
    if "sink_tokens" in options and left is not None and draw(st.booleans()):
        extra["sink_tokens"] = draw(st.sampled_from((1, 2)))
        names.append("sink_tokens")
    if "dropout" in options and draw(st.booleans()):
        shape = broadcast_shape(c, draw(broadcast_shapes(keep_shapes)))
        extra["dropout_mask"] = rng.random(shape) < 0.7
        extra["dropout_rate"] = draw(st.sampled_from(DROPOUT_RATES))
        names.append("dropout")
    note(f"production options: {names or 'none'}")
    kind = "+".join([p.kind, *names]) if names else p.kind
    return p.replace(options={**p.options, **extra}, kind=kind)
