"""The distributed cost models against XLA's per-device counts; the causal load balance of the
layouts; ``docs/distributed.md`` is current.

* Per device (XLA's ``cost_analysis()`` of an SPMD program is per device), for each scheme at
  ``P`` = 1, 2 and 4: matmul FLOPs equal the HLO's ``dot`` FLOPs and transcendentals equal XLA's
  count, exactly (a ``while`` body counted once: :meth:`Cost.as_counted_by_xla`); XLA's other
  FLOPs lie in ``[0, 4 x]`` the model's elementwise bound (``tests/test_cost.py``'s rule);
  temporary bytes lie between the model's largest intermediate and its workspace bound.
* Communication: per kind of collective, the operand bytes of one call and the number of calls
  of the scheme's collectives (those HLO metadata places in the ``shard_map``) equal the
  model's, exactly; a collective in a branch of a ``conditional`` (the ring's last step does not
  send) is counted by the HLO reader once per loop trip, an upper bound on the model's calls.
  :func:`hlo_collectives` itself is checked on a hand-built program of known sizes.
* Load balance: the allowed pairs per device against a brute-force count over the causal mask,
  for ``P`` in {2, 4, 8} and drawn lengths, and the closed forms of
  :data:`attnref._src.formulations.distributed.cost.CLOSED_FORMS`.
"""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import PartitionSpec

import attnref
from attnref import distributed as dcost
from attnref import pages
from attnref.costs import Collective, Cost, Dims, hlo_collectives, xla_counts
from attnref.distributed import LAYOUTS, default_mesh, padded_length, positions
from tests.test_docs_pages import _problems

SCHEMES = ("ring", "striped", "zigzag", "all_gather", "ulysses", "tensor_parallel")
DUPLICATION = 4  # tests/test_cost.py: no intermediate in attnref's kernels feeds > 4 consumers
# (B, T, H, d_model, d_k, d_v, biases) per device count: T = 10 on 4 devices is padded by every
# layout (to 12, zigzag to 16; XLA then shards the contiguous layout's projections over the
# padded length); H = 4 heads split over every P (Ulysses and tensor parallelism need P | H).
SHAPES = {
    1: (1, 16, 4, 8, 4, 6, False),
    2: (2, 12, 4, 12, 8, 4, True),
    4: (2, 10, 4, 12, 8, 4, True),
}


def _xla(fid: str, devices: int):
    b, t, h, dm, dk, dv, bias = SHAPES[devices]
    f = attnref.get(fid)
    p = attnref.init_params(0, d_model=dm, num_heads=h, d_k=dk, d_v=dv, bias=bias)
    x = np.zeros((b, t, dm), np.float32)
    full = (b, t, t)  # a full mask and bias: all of the model's mask and bias work is there
    kw = dict(mask=np.ones(full, bool), bias=np.zeros(full, np.float32), mesh=default_mesh(devices))
    dims = Dims(b, t, t, h, dm, dk, dv, bias=bias, devices=devices)
    return dims, xla_counts(f.jit(), p, x, **kw)


def _check_collectives(label: str, model: Cost, hlo: tuple[Collective, ...], devices: int) -> None:
    """Per kind: one call's operand bytes and the call count of the scheme's collectives."""
    ours = [c for c in hlo if c.in_shard_map and c.devices > 1]
    assert all(c.devices == devices for c in ours), (label, ours)
    kinds = {c.kind for c in ours} | {c.kind for c in model.collectives}
    for kind in sorted(kinds):
        m = [c for c in model.collectives if c.kind == kind]
        x = [c for c in ours if c.kind == kind]
        m_calls, x_calls = {c.calls for c in m}, {c.calls for c in x}
        assert len(m_calls) == 1 and len(x_calls) == 1, (label, kind, m, x)
        assert sum(c.operand_bytes for c in m) == sum(c.operand_bytes for c in x), (label, m, x)
        if any(c.conditional for c in x):
            assert 0 < m_calls.pop() <= x_calls.pop(), (label, kind, m, x)
        else:
            assert m_calls == x_calls, (label, kind, m, x)


@pytest.mark.parametrize("devices", sorted(SHAPES))
@pytest.mark.parametrize("fid", SCHEMES)
def test_model_matches_xla_per_device(fid, devices):
    dims, xc = _xla(fid, devices)
    model = attnref.get(fid).cost_model(dims)
    label = f"{fid} P={devices}"
    mm, el, tr = model.as_counted_by_xla()
    assert xc.dot_flops == mm, f"{label}: XLA dots {xc.dot_flops} != model {mm}"
    assert xc.transcendentals == tr, f"{label}: XLA {xc.transcendentals} != model {tr}"
    assert 0 <= xc.other_flops <= DUPLICATION * el, (label, xc.other_flops, el)
    assert model.intermediate_bytes <= xc.temp_bytes <= model.workspace_bytes, (
        label,
        model.intermediate_bytes,
        xc.temp_bytes,
        model.workspace_bytes,
    )
    _check_collectives(label, model, xc.collectives, devices)
    assert (model.sent_bytes > 0) == (devices > 1), label


def test_hlo_collectives_on_a_known_program():
    """A ``shard_map`` over 4 devices with a ``[1, 8, 2, 4]`` float32 shard (256 bytes): two
    ``ppermute`` in a 3-trip ``fori_loop``, one in a ``lax.cond`` inside it, an all-gather, an
    all-to-all and a ``psum``. The counts are worked out by hand from the program."""
    mesh = default_mesh(4)
    perm = [(i, (i + 1) % 4) for i in range(4)]

    def body(a):
        def step(i, carry):
            k, v = carry
            k = jax.lax.ppermute(k, "devices", perm)
            v = jax.lax.ppermute(v * 2.0, "devices", perm)
            v = jax.lax.cond(i < 1, lambda u: jax.lax.ppermute(u, "devices", perm), lambda u: u, v)
            return k, v

        k, v = jax.lax.fori_loop(0, 3, step, (a, a + 1.0))
        g = jax.lax.all_gather(k, "devices", axis=1, tiled=True)  # [1, 32, 2, 4]
        t = jax.lax.all_to_all(v, "devices", 1, 2, tiled=True)  # [1, 2, 8, 4]
        s = jax.lax.psum(k + v, "devices")
        return g[:, :8] + t.reshape(g[:, :8].shape) + s

    spec = PartitionSpec(None, "devices")
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,), out_specs=spec))
    text = fn.lower(jnp.zeros((1, 32, 2, 4), jnp.float32)).compile().as_text()
    found = hlo_collectives(text)
    by_kind = {}
    for c in found:
        assert c.in_shard_map and c.devices == 4, c
        by_kind.setdefault(c.kind, []).append(c)
    permutes = by_kind.pop("collective-permute")
    plain = [c for c in permutes if not c.conditional]
    branch = [c for c in permutes if c.conditional]
    assert sum(c.operand_bytes * c.calls for c in plain) == 2 * 3 * 256  # k and v, 3 trips
    assert [(c.operand_bytes, c.calls) for c in branch] == [(256, 3)]  # at most once per trip
    assert [(c.operand_bytes, c.calls) for c in by_kind.pop("all-gather")] == [(256, 1)]
    assert [(c.operand_bytes, c.calls) for c in by_kind.pop("all-to-all")] == [(256, 1)]
    assert [(c.operand_bytes, c.calls) for c in by_kind.pop("all-reduce")] == [(256, 1)]
    assert not by_kind
    # What each device sends: a permute its operand, a ring all-gather its shard P - 1 times,
    # an all-to-all 3/4 of its operand, a ring all-reduce 2 x 3/4.
    sent = {c.kind: c.sent_bytes for c in found if not c.conditional and c.calls == 1}
    assert sent == {"all-gather": 768, "all-to-all": 192, "all-reduce": 384}


# ----------------------------------------------------------------------------- load balance


def _brute_pairs(t: int, devices: int, layout: str, causal: bool) -> list[int]:
    """Allowed pairs per device counted on the mask itself: the rows of ``tril(ones(T, T))``
    (or of ``ones``) at each device's real query positions."""
    allowed = np.tril(np.ones((t, t), bool)) if causal else np.ones((t, t), bool)
    table = positions(padded_length(t, devices, layout), devices, layout)
    return [int(allowed[[i for i in row if i < t]].sum()) for row in table]


@given(
    devices=st.sampled_from([2, 4, 8]),
    t=st.sampled_from([0, 1, 5, 16, 24, 33, 64, 100, 129]),
    layout=st.sampled_from(LAYOUTS),
    causal=st.booleans(),
)
def test_useful_pairs_count_the_mask(devices, t, layout, causal):
    pairs = dcost.useful_pairs(t, devices, layout, causal=causal)
    assert pairs.tolist() == _brute_pairs(t, devices, layout, causal)
    assert int(pairs.sum()) == (t * (t + 1) // 2 if causal else t * t)
    flops = dcost.useful_flops(t, devices, layout, causal=causal, batch=2, heads=3, d_k=4, d_v=5)
    assert flops.tolist() == [2 * 2 * 3 * (4 + 5) * n for n in pairs.tolist()]
    brute = _brute_pairs(t, devices, layout, causal)
    expected = Fraction(max(brute) * devices, sum(brute)) if sum(brute) else Fraction(1)
    assert dcost.load_balance(t, devices, layout, causal=causal) == expected


@given(devices=st.sampled_from([2, 4, 8]), chunks=st.sampled_from([1, 2, 3, 8, 33]))
def test_balance_closed_forms(devices, chunks):
    """``T = 2 P h`` (no padding in any layout): contiguous ``2 - 1/P - (P - 1)/(P (T + 1))``,
    striped ``(T + P)/(T + 1)``, zigzag exactly 1; non-causal 1 everywhere."""
    p, t = devices, 2 * devices * chunks
    balance = {layout: dcost.load_balance(t, p, layout) for layout in LAYOUTS}
    assert balance["contiguous"] == 2 - Fraction(1, p) - Fraction(p - 1, p * (t + 1))
    assert balance["striped"] == Fraction(t + p, t + 1)
    assert balance["zigzag"] == 1
    assert balance["zigzag"] < balance["striped"] < balance["contiguous"] < 2 - Fraction(1, p)
    assert all(dcost.load_balance(t, p, lay, causal=False) == 1 for lay in LAYOUTS)


def test_models_refuse_heads_the_devices_do_not_divide():
    dims = Dims(1, 8, 8, 3, 8, 4, 4, devices=2)
    for fid in ("ulysses", "tensor_parallel"):
        with pytest.raises(ValueError, match="divide the heads"):
            attnref.get(fid).cost_model(dims)


# ----------------------------------------------------------------------------- the page

PAGE = Path(__file__).resolve().parents[1] / "docs" / "distributed.md"


def test_distributed_page_is_current():
    """``docs/distributed.md`` is a fresh generation (its benchmark section kept) and every
    ``attnref.<name>`` on it resolves."""
    page = PAGE.read_text()
    assert page == pages.render_distributed(page), "stale; run python -m attnref.pages"
    problems, _ = _problems(page, dcost)
    assert not problems, problems
    for fid in SCHEMES:
        f = attnref.get(fid)
        assert f.equation in page and f.citation in page, fid
        assert f"`attnref.distributed.{f.native.__name__}`" in page, fid
