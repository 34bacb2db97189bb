"""The RoPE cost models (``attnref.get("rope").cost_model``, ``attnref.get("rope_patterns")
.cost_model``) against XLA's own counts.

The same checks as ``test_model_matches_xla`` in ``tests/test_cost.py``: matmul FLOPs equal to
the ``dot`` FLOPs of XLA's optimised HLO, transcendentals (``exp``, and ``cos``/``sin`` of the
angles) equal to ``cost_analysis()["transcendentals"]``, XLA's remaining FLOPs within
``[0, 4 x]`` the model's elementwise count, and XLA's temporary bytes between the model's
largest intermediate and its workspace bound. The registry models assume the default positions;
the number of offsets ``rope_patterns`` forms (and the position batch of ``rope``'s cos/sin) is
checked for given positions too.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

import attnref
from attnref.costs import Cost, Dims, xla_counts

SHAPES = [(2, 16, 2, 16, 4, 6), (1, 24, 3, 12, 8, 4)]  # tests/test_cost.py's shapes
DUPLICATION = 4  # as in tests/test_cost.py: no intermediate feeds more than 4 consumers
# The registry's cost models (registered with their formulations by ``attnref.rope``).
rope_cost = attnref.get("rope").cost_model
rope_patterns_cost = attnref.get("rope_patterns").cost_model
MODELS = {"rope": rope_cost, "rope_patterns": rope_patterns_cost}


def _params(dims: Dims) -> attnref.AttentionParams:
    return attnref.init_params(
        0, d_model=dims.d_model, num_heads=dims.heads, d_k=dims.d_k, d_v=dims.d_v, bias=dims.bias
    )


def _check(label: str, xc, model: Cost) -> None:
    mm, el, tr = model.as_counted_by_xla()
    assert xc.dot_flops == mm, f"{label}: XLA dots {xc.dot_flops} != model {mm}"
    assert xc.transcendentals == tr, f"{label}: XLA transcendentals {xc.transcendentals} != {tr}"
    assert 0 <= xc.other_flops <= DUPLICATION * el, (label, xc.other_flops, el)
    assert model.intermediate_bytes <= xc.temp_bytes <= model.workspace_bytes, (
        label,
        model.intermediate_bytes,
        xc.temp_bytes,
        model.workspace_bytes,
    )
    assert model.flops >= model.matmul_flops > 0 and model.output_bytes > 0


# As tests/test_cost.py: biases off on the first shape, on on the second.
CASES = [
    (fid, shape, bias) for fid in MODELS for shape, bias in zip(SHAPES, (False, True), strict=True)
]


@pytest.mark.parametrize(("fid", "shape", "bias"), CASES)
def test_model_matches_xla(fid, shape, bias):
    """The registry call (default positions, full mask and bias) as in tests/test_cost.py."""
    f = attnref.get(fid)
    b, t, h, dm, dk, dv = shape
    dims = Dims(b, t, t, h, dm, dk, dv, bias=bias)
    full = (b, t, t)
    x = np.zeros((b, t, dm), np.float32)
    xc = xla_counts(
        f.jit(), _params(dims), x, mask=np.ones(full, bool), bias=np.zeros(full, np.float32)
    )
    _check(fid, xc, MODELS[fid](dims))


def test_registry_entries_use_these_models():
    for fid, model in MODELS.items():
        assert attnref.get(fid).cost_model is model, fid
    d = Dims(2, 8, 8, 2, 8, 4, 4)
    assert attnref.costs.cost("rope_patterns", d) == rope_patterns_cost(d)


def test_given_positions_offsets_and_position_batches():
    """Traced positions ``[B, T]``: ``rope`` evaluates cos/sin per position row
    (``positions_batch=B``) and ``rope_patterns`` forms one ``W~_P`` per (b, i, j)
    (``offsets = B T_q T_k``). Concrete positions (closed over): one ``W~_P`` per distinct
    offset."""
    b, t, h, dm, dk, dv = SHAPES[0]
    dims = Dims(b, t, t, h, dm, dk, dv, bias=True)
    p, x = _params(dims), np.zeros((b, t, dm), np.float32)
    rng = np.random.default_rng(0)
    pq, pk = rng.integers(0, 6, (b, t)), rng.integers(0, 6, (b, t))
    kw = dict(positions_q=pq, positions_kv=pk)
    rope, patterns = attnref.get("rope"), attnref.get("rope_patterns")
    model = rope_cost(dims, positions_batch=b, traced_positions=True)
    _check("rope traced", xla_counts(rope.jit(), p, x, **kw), model)
    model = rope_patterns_cost(dims, offsets=b * t * t, traced_positions=True)
    _check("patterns traced", xla_counts(patterns.jit(), p, x, **kw), model)
    offsets = len(np.unique(pq[:, :, None] - pk[:, None, :]))
    fn = jax.jit(lambda p, x: patterns.apply(p, x, positions_q=pq, positions_kv=pk))
    _check("patterns concrete", xla_counts(fn, p, x), rope_patterns_cost(dims, offsets=offsets))


@pytest.mark.parametrize("traced", [False, True])
def test_one_plane_constant_positions_fold_cos_and_sin(traced):
    """``d_k = 2``: with constant positions the angle is the position itself and XLA folds
    ``cos``/``sin`` into constants (no transcendentals left); traced positions are counted."""
    b, tq, tk, h, dm, dk, dv = 3, 7, 5, 1, 6, 2, 5
    dims = Dims(b, tq, tk, h, dm, dk, dv)
    p = _params(dims)
    xq, xkv = np.zeros((b, tq, dm), np.float32), np.zeros((b, tk, dm), np.float32)
    kw = dict(positions_q=np.arange(tq), positions_kv=np.arange(tk)) if traced else {}
    for fid, model in MODELS.items():
        xc = xla_counts(attnref.get(fid).jit(), p, xq, xkv, **kw)
        extra = dict(offsets=tq * tk) if (traced and fid == "rope_patterns") else {}
        _check(f"{fid} traced={traced}", xc, model(dims, traced_positions=traced, **extra))
