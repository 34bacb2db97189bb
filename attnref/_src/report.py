"""``attnref report``: every registered formulation against the float64 oracle on one problem."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from attnref import oracle, tolerance
from attnref._src.feature_maps import FeatureMap, favor_plus
from attnref._src.params import AttentionParams, init_params
from attnref._src.registry import formulations, get


@dataclasses.dataclass(frozen=True)
class Problem:
    """A reproducible attention problem (row convention, self-attention unless ``t_k`` differs)."""

    batch: int = 2
    t_q: int = 16
    t_k: int = 16
    num_heads: int = 4
    d_model: int = 32
    d_k: int = 8
    d_v: int = 12
    bias: bool = True
    causal: bool = True
    seed: int = 0
    feature_map: str = "elu_plus_one"

    def linear_feature_map(self) -> FeatureMap:
        """The linear family's feature map (FAVOR+ gets ``2 d_k`` orthogonal features)."""
        if self.feature_map == "favor_plus":
            return favor_plus(self.seed, self.d_k, 2 * self.d_k)
        return FeatureMap(self.feature_map)

    def build(
        self, dtype: Any
    ) -> tuple[AttentionParams, np.ndarray, np.ndarray, np.ndarray | None]:
        """Parameters, ``x_q``, ``x_kv``, mask; drawn in float64 and rounded once to ``dtype``."""
        params = init_params(
            self.seed,
            d_model=self.d_model,
            num_heads=self.num_heads,
            d_k=self.d_k,
            d_v=self.d_v,
            bias=self.bias,
            dtype=np.float64,
        )
        rng = np.random.default_rng(self.seed + 1)
        x_q = rng.standard_normal((self.batch, self.t_q, self.d_model))
        x_kv = (
            x_q
            if self.t_k == self.t_q
            else rng.standard_normal((self.batch, self.t_k, self.d_model))
        )
        mask = np.tril(np.ones((self.t_q, self.t_k), bool)) if self.causal else None
        return params.astype(dtype), x_q.astype(dtype), x_kv.astype(dtype), mask


@dataclasses.dataclass(frozen=True)
class Row:
    id: str
    dtype: str
    max_abs_error: float
    max_rel_error: float
    bound_ratio: float
    note: str = ""


def run(
    problem: Problem,
    ids: Sequence[str] | None = None,
    dtypes: Sequence[str] = ("float32", "float64"),
) -> list[Row]:
    """Errors of each formulation against the oracle on the problem's inputs.

    ``max_rel_error = max|y - y_64| / max|y_64|`` (normwise); ``bound_ratio`` is the largest
    ``|y - y_64| / bound`` with the derived componentwise bound of :mod:`attnref.tolerance`
    (at most 1 means within the bound).
    """
    chosen = formulations() if ids is None else tuple(get(i) for i in ids)
    rows = []
    for dt_name in dtypes:
        dt = np.dtype(dt_name)
        params, x_q, x_kv, mask = problem.build(dt)
        for f in chosen:
            if f.family == "softmax":
                kw: dict[str, Any] = dict(mask=mask)
                ref = oracle.attention(params, x_q, x_kv, **kw)
                bound = tolerance.attention_error_bound(params, x_q, x_kv, dtype=dt, **kw)
                note = "causal mask" if problem.causal else "no mask"
                xkv = x_kv
            else:  # linear family: self-attention, causal if the form takes it
                causal = problem.causal if problem.causal in f.causal_modes else f.causal_modes[0]
                kw = dict(feature_map=problem.linear_feature_map(), causal=causal)
                xkv = x_q if causal else x_kv
                ref = oracle.linear_multihead(params, x_q, xkv, **kw)
                bound = tolerance.linear_multihead_error_bound(params, x_q, xkv, dtype=dt, **kw)
                note = f"{problem.feature_map}, {'causal' if causal else 'non-causal'}"
            out = f.jit()(params, x_q, xkv, **kw)
            if out.dtype != dt:
                raise AssertionError(f"{f.id} computed in {out.dtype}, not {dt_name}")
            err = np.abs(np.asarray(out, dtype=np.float64) - ref)
            scale = float(np.abs(ref).max())
            with np.errstate(divide="ignore", invalid="ignore"):
                ratio = float(np.nanmax(np.where(err == 0, 0.0, err / bound)))
            rows.append(Row(f.id, dt_name, float(err.max()), float(err.max() / scale), ratio, note))
    return rows


def format_table(rows: Sequence[Row], problem: Problem) -> str:
    head = (
        f"attnref report: B={problem.batch} T_q={problem.t_q} T_k={problem.t_k} "
        f"H={problem.num_heads} d_model={problem.d_model} d_k={problem.d_k} "
        f"d_v={problem.d_v} bias={problem.bias} causal={problem.causal} seed={problem.seed}\n"
        "errors against the float64 NumPy oracle of each family (softmax: oracle.attention; "
        "linear: oracle.linear_multihead);\nrel = max|err| / max|y|; err/bound <= 1 means within "
        "the derived tolerance (attnref.tolerance)\n"
    )
    cols = ("formulation", "dtype", "max abs err", "max rel err", "err/bound", "status", "setting")
    lines = [
        f"{cols[0]:<20} {cols[1]:<8} {cols[2]:>12} {cols[3]:>12} {cols[4]:>10}  {cols[5]:<6}"
        f" {cols[6]}"
    ]
    lines.append("-" * len(lines[0]))
    for r in rows:
        ok = "ok" if r.bound_ratio <= 1.0 else "FAIL"
        lines.append(
            f"{r.id:<20} {r.dtype:<8} {r.max_abs_error:>12.3e} {r.max_rel_error:>12.3e} "
            f"{r.bound_ratio:>10.2e}  {ok:<6} {r.note}"
        )
    return head + "\n".join(lines)


def to_json(rows: Sequence[Row], problem: Problem) -> str:
    return json.dumps(
        {"problem": dataclasses.asdict(problem), "rows": [dataclasses.asdict(r) for r in rows]},
        indent=2,
    )
