"""Weight-level problems: :class:`AttentionProblem`, :func:`make_attention_problem` and the
strategy :func:`attention_problems`."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
from hypothesis import note
from hypothesis import strategies as st

from attnref import oracle, tolerance
from attnref._src.core.params import AttentionParams, init_params

from ._masks import build, mask_kinds
from ._shapes import Config, DrawFn, ShortRepr, configs_strategy, with_dtype

WEIGHT_KINDS = ("none", "causal", "padding", "random", "bias", "fully_masked_row", "combined")
# The builder's parts of each weight-level kind: padding pads the keys only (the weight level has
# no query lengths; a masked query row is the fully_masked_row kind), combined has no random mask.
_WEIGHT_PARTS: dict[str, tuple[str, ...]] = {
    "none": (),
    "causal": ("causal",),
    "padding": ("key_padding",),
    "random": ("random",),
    "bias": ("bias",),
    "fully_masked_row": ("fully_masked_row",),
    "combined": ("causal", "key_padding", "bias"),
}


@dataclasses.dataclass
class AttentionProblem(ShortRepr):
    """One weight-level problem: ``params`` (``config.k`` K/V heads), ``x_q [*batch, T,
    d_model]``, ``x_kv [*batch, S, d_model]`` (sometimes ``x_q`` itself), a boolean ``mask
    [*batch, T, S]`` (``True`` = may attend) and an additive ``bias [*batch, T, S]``, both full
    whatever the kind (one program for every kind), the :class:`Config`, ``kind`` and ``seed``."""

    params: AttentionParams
    x_q: np.ndarray
    x_kv: np.ndarray
    mask: np.ndarray
    bias: np.ndarray
    config: Config
    kind: str = "none"
    seed: int = 0

    def __repr__(self) -> str:
        return f"AttentionProblem({self.config!r}, kind={self.kind!r}, seed={self.seed})"

    @property
    def dtype(self) -> np.dtype[Any]:
        """``config.dtype``."""
        return np.dtype(self.config.dtype)

    def inputs(self) -> dict[str, np.ndarray]:
        """The ``mask`` and ``bias`` keyword arguments of every weight-level formulation."""
        return {"mask": self.mask, "bias": self.bias}

    def oracle(self) -> np.ndarray:
        """Float64 output ``[*batch, T, d_model]`` from :func:`attnref.oracle.attention`."""
        return oracle.attention(self.params, self.x_q, self.x_kv, **self.inputs())

    def bound(self) -> np.ndarray:
        """Componentwise bound (:func:`attnref.tolerance.attention_error_bound`)."""
        return tolerance.attention_error_bound(
            self.params, self.x_q, self.x_kv, **self.inputs(), dtype=self.dtype
        )

    def astype(self, dtype: Any) -> AttentionProblem:
        """The same problem with parameters, inputs and bias rounded to ``dtype``."""
        dt = np.dtype(dtype)
        return dataclasses.replace(
            self,
            params=self.params.astype(dt),
            x_q=self.x_q.astype(dt),
            x_kv=self.x_kv.astype(dt),
            bias=self.bias.astype(dt),
            config=dataclasses.replace(self.config, dtype=str(dt)),
        )


def make_attention_problem(
    config: Config, kind: str = "none", seed: int = 0, dtype: Any = None, *, param_bias: bool = True
) -> AttentionProblem:
    """The :class:`AttentionProblem` behind one draw of :func:`attention_problems`, in
    ``config.dtype`` (or ``dtype``), of ``kind`` in :data:`WEIGHT_KINDS` (``padding`` pads keys):
    parameters from :func:`attnref.init_params` (``param_bias``), PCG64 ``seed`` normal inputs
    (``x_kv`` is ``x_q`` in about half the ``T == S`` problems), the mask and bias of
    :func:`make_options` rendered full. ``ValueError`` for another kind or rejected sizes."""
    if kind not in WEIGHT_KINDS:
        raise ValueError(f"kind must be one of {WEIGHT_KINDS}, got {kind!r}")
    c = with_dtype(config, dtype)
    rng = np.random.default_rng(seed)
    params = init_params(
        seed,
        d_model=c.d_model,
        num_heads=c.n,
        d_k=c.d_k,
        d_v=c.d_v,
        bias=param_bias,
        dtype=np.float64,
        num_kv_heads=c.k,
    )
    batch = c.batch_shape
    x_q = rng.standard_normal((*batch, c.t, c.d_model))
    shared = c.t == c.s and rng.random() < 0.5
    x_kv = x_q if shared else rng.standard_normal((*batch, c.s, c.d_model))
    # One head, the batch dims flattened: the builder's [B, 1, T, S] arrays, then [*batch, T, S].
    flat = dataclasses.replace(c, batch=math.prod(batch), n=1, k=1)
    opts = build(
        rng,
        flat,
        frozenset(_WEIGHT_PARTS[kind]),
        np.dtype(np.float64),
        mask_shape="BNTS",
        bias_shape="BNTS",
        causal_alignment="top_left",
        empty_rows=False,
    )
    bias = opts.pop("bias", None)
    allowed = oracle.kernel_allowed((flat.b, 1, c.t, c.s), **opts)
    mask = allowed[:, 0].reshape(*batch, c.t, c.s)
    bias = np.zeros(mask.shape) if bias is None else bias[:, 0].reshape(mask.shape)
    dt = np.dtype(c.dtype)
    return AttentionProblem(
        params.astype(dt), x_q.astype(dt), x_kv.astype(dt), mask, bias.astype(dt), c, kind, seed
    )


@st.composite
def attention_problems(
    draw: DrawFn,
    configs: st.SearchStrategy[Config] | None = None,
    *,
    kinds: tuple[str, ...] = WEIGHT_KINDS,
    param_bias: bool | None = None,
) -> AttentionProblem:
    """An :class:`AttentionProblem` (:func:`make_attention_problem`; GQA when ``k < n``),
    labelled draws of a config (e.g. ``configs(buckets=WEIGHT_BUCKETS,
    value_dim_differs=True)``), a kind from ``kinds``, parameter biases (``None``: drawn) and a
    seed."""
    config = draw(configs_strategy() if configs is None else configs, label="config")
    kind = draw(mask_kinds(kinds=tuple(kinds)), label="mask kind")
    with_bias = draw(st.booleans(), label="parameter biases") if param_bias is None else param_bias
    seed = draw(st.integers(0, 2**31 - 1), label="data seed")
    note(f"config={config!r} kind={kind} parameter biases={with_bias} seed={seed}")
    return make_attention_problem(config, kind, seed, param_bias=with_bias)
