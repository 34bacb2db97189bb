"""attnref's six distributed schemes through the conformance kit (issue 22): each passes
``check_attention(fn, devices=(2, 4, 8))``, the head-parallel ones (Ulysses, tensor parallelism)
included. They split the query heads over the mesh and refuse a head count ``P`` does not
divide; the kit's distributed buckets have ``K`` (and so ``N``) a multiple of ``lcm(devices)``.

Few examples, ``oracle`` and ``ring_size_growth`` only, features ``causal`` and ``gqa`` (so the
buckets with ``N = 2K`` and ``N = 4K`` are drawn from): one compiled program per (scheme,
mesh size, bucket, option set).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import pytest

import attnref.distributed
from attnref.conformance import Context, Target, mesh_contexts
from attnref.testing import check_attention

from .helpers import thorough

SCHEMES = ("ring", "striped", "zigzag", "all_gather", "ulysses", "tensor_parallel")
DEVICES = (2, 4, 8)
# The sweep over mesh sizes: every size in the ``thorough`` profile; in ``ci`` (and ``dev``) the
# smallest and the largest, whose buckets are the full sweep's (lengths times 2 lcm = 16, K/V
# heads 8), so each is one of its runs.
SWEEP = DEVICES if thorough() else (2, 8)
PROPERTIES = ("oracle", "ring_size_growth")
EXAMPLES = 1


@pytest.fixture(autouse=True)
def _eight_devices():
    assert jax.device_count() >= 8, f"needs 8 devices (tests/conftest.py), has {jax.device_count()}"


@pytest.mark.parametrize("scheme", SCHEMES)
def test_each_scheme_passes_the_kit_on_2_4_8_devices(scheme):
    """Every property passes on every mesh size; the head-parallel schemes saw only head counts
    every size divides (before issue 22 the kit drew ``N = 2`` and Ulysses and tensor
    parallelism failed from ``P = 4``: "N=2 query heads ... P=4 do not divide").

    A sweep over the mesh sizes: 2, 4 and 8 in the ``thorough`` profile, 2 and 8 in ``ci``
    (:data:`SWEEP`); the head counts are those of ``devices=(2, 4, 8)`` either way."""
    fn = getattr(attnref.distributed, f"{scheme}_dot_product_attention")
    seen: set[tuple[int, int, int]] = set()

    def spy(query, key, value, *args, mesh, **kw):
        seen.add((mesh.size, query.shape[2], key.shape[2]))
        return fn(query, key, value, *args, mesh=mesh, **kw)

    report = check_attention(
        spy,
        features=("causal", "gqa"),
        properties=PROPERTIES,
        devices=SWEEP,
        max_examples=EXAMPLES,
        seed=0,
        target=scheme,
    )
    assert report.passed, report.summary()
    for r in report.results:
        assert [(m.devices, m.status) for m in r.meshes] == [(p, "passed") for p in SWEEP]
        assert r.examples == EXAMPLES * len(SWEEP), report.summary()
    assert {p for p, _, _ in seen} == set(SWEEP)
    assert all(n % 8 == 0 and k % 8 == 0 and n % k == 0 for _, n, k in seen), seen


def _none(*args, **kwargs):
    return None


def _single(features: frozenset[str]) -> Context:
    return Context(
        target=Target(_none, "jax_nn"),
        signature="jax_nn",
        features=features,
        masked_rows="zeros",
        causal_alignment="top_left",
        dtypes=("float32",),
    )


# (N, K) of the buckets self, general (N = 2K with gqa), tall, gqa (N = 2K), mqa (N = 4K)
SINGLE_HEADS = [(2, 2), (4, 2), (2, 2), (4, 2), (4, 1)]


@pytest.mark.parametrize(
    ("devices", "heads"),
    [
        ((1,), SINGLE_HEADS),
        ((2,), [(2, 2), (4, 2), (2, 2), (4, 2), (8, 2)]),
        ((1, 2, 4, 8), [(8, 8), (16, 8), (8, 8), (16, 8), (32, 8)]),
        ((2, 3), [(6, 6), (12, 6), (6, 6), (12, 6), (24, 6)]),
    ],
)
def test_distributed_buckets_have_head_counts_every_size_divides(devices, heads):
    """A distributed context's buckets are the single-device ones with ``T, S`` times
    ``2 lcm(devices)`` and ``N, K`` times the least factor that makes ``K`` a multiple of
    ``lcm(devices)`` (``N / K`` kept); every context of one check has the same buckets."""
    features = frozenset({"gqa", "cross"})
    names = ("self", "general", "tall", "gqa", "mqa")
    single = _single(features).pool(*names)
    assert [(c.n, c.k) for c in single] == SINGLE_HEADS
    contexts = mesh_contexts(
        _none,
        devices,
        signature="jax_nn",
        features=features,
        masked_rows="zeros",
        causal_alignment="top_left",
        dtypes=("float32",),
    )
    pools = [ctx.pool(*names) for ctx in contexts.values()]
    assert all(pool == pools[0] for pool in pools)
    assert [(c.n, c.k) for c in pools[0]] == heads
    m = 2 * math.lcm(*devices)
    for c, base in zip(pools[0], single, strict=True):
        assert (c.t, c.s) == (base.t * m, base.s * m)
        assert dataclasses.replace(c, t=base.t, s=base.s, n=base.n, k=base.k) == base
