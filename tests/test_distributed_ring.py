"""Ring, striped and zigzag attention (``attnref.distributed``) on meshes of 1, 2, 4
and 8 virtual CPU devices, against the float64 NumPy oracle.

Tolerances, all derived (none tuned):

* Forward: :func:`attnref.tolerance.pieces_error_bound` with the pieces the ring merges: each
  device computes its queries' state against one K/V chunk (the keys
  ``attnref.distributed.positions(s_pad, P, layout)[d]``) with a full softmax
  (``key_blocks=1``) in the compute dtype, and merges the ``P`` chunk states one at a time
  (``tree="sequential"``: depth ``P - 1``; the first merge, with the empty state, is exact). Not
  the kernel bound with ``key_blocks=P``: that models an online softmax, whose running max is
  exact, while the ring stores each chunk's ``lse`` and each partial merge's, a rounding of
  ``u |lse|`` per step that the merge bound counts.
* Gradients: :func:`attnref.tolerance.kernel_grad_error_bound` (first order, any evaluation
  order of the backward equations, ``p`` recomputed from a saved lse included) around
  :func:`attnref.oracle.dot_product_attention_vjp`. First order only for the ring's backward:
  it weights each chunk's gradient by ``exp(lse_c - L)``, whose stored ``lse_c`` carries the
  same ``u |lse_c|`` rounding, a term the kernel gradient bound does not list (negligible at the
  logits of order one drawn here; not covered at ``|lse| ~ 1e4``).
* Row forms: :func:`attnref.tolerance.attention_error_bound` around
  :func:`attnref.oracle.attention`.

Shapes come from :data:`attnref.strategies.KERNEL_BUCKETS` (``T, S`` of 5 and 7, 6 and 4: most
are not multiples of ``P`` or ``2P``, so the layouts pad), and each jitted function is compiled
once per (scheme, mesh, bucket, dtype, static options).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import attnref.distributed as ring
from attnref import oracle, tolerance
from attnref import strategies as ast
from attnref.costs import xla_counts
from attnref.distributed import default_mesh
from attnref.testing import assert_ratio_within, assert_within_bound

from .helpers import scaled
from .kernel_helpers import kproblems

SCHEMES = ("ring", "striped", "zigzag")
MESHES = (1, 2, 4, 8)
KERNELS = {s: getattr(ring, f"{s}_dot_product_attention") for s in SCHEMES}
ROWS = {s: getattr(ring, f"{s}_attention") for s in SCHEMES}
STATIC_OPTIONS = ast.STATIC_OPTIONS
STATIC = (*STATIC_OPTIONS, "mesh")
JITTED = {s: jax.jit(fn, static_argnames=STATIC) for s, fn in KERNELS.items()}


def _call(scheme, devices, p):
    """The jitted kernel on a problem, with its lse."""
    return JITTED[scheme](p.q, p.k, p.v, mesh=default_mesh(devices), return_lse=True, **p.kwargs)


def tiling_rules(p):
    """Problem ``p``'s position rules as :func:`attnref.distributed.piece_tiles` takes them
    (``offset=None`` when the shapes do not fix them: traced lengths, or sink tokens beside a
    window)."""
    kw = p.kwargs
    window = kw.get("local_window_size")
    window = (window, window) if isinstance(window, int) else window
    lengths = ("query_seq_lengths", "key_value_seq_lengths")
    fixed = not any(kw.get(n) is not None for n in lengths) and not (
        window is not None and kw.get("sink_tokens")
    )
    offset = 0 if kw.get("causal_alignment", "top_left") == "top_left" else p.config.s - p.config.t
    return {
        "offset": offset if fixed else None,
        "causal": bool(kw.get("is_causal")),
        "window": window,
    }


def ring_bound(scheme, devices, p):
    """:func:`attnref.tolerance.pieces_error_bound` of the ring (module docstring): a piece is
    one key tile of the K/V chunk device ``d`` holds in the scheme's layout (the chunk split
    into :func:`attnref.distributed.chunk_tiles` tiles), merged sequentially (any binary merge
    of the ``P n`` pieces, the ring's included, is no deeper than the sequential one)."""
    t, s = p.config.t, p.config.s
    layout = ring.LAYOUT_OF[scheme]
    table = ring.positions(ring.padded_length(s, devices, layout), devices, layout)
    kinds = ring.piece_tiles(t, s, devices, layout, **tiling_rules(p))
    fallback = (kinds == ring.SOMETIMES).all()  # chunk_tiles tiles a side, each one piece
    # a fine split with one run of keys per query tile: one naive piece per chunk; else (a
    # window's band, some tiles under a cond) any tiling of the chunk's keys (key_blocks=None)
    runs = [np.flatnonzero(row != ring.NEVER) for row in kinds]
    one_run = (kinds != ring.SOMETIMES).all() and all(np.all(np.diff(r) == 1) for r in runs)
    n = kinds.shape[0] if fallback else 1
    ids = np.full(table.size, -1)
    for d, row in enumerate(table):
        ids[row] = d * n + np.arange(row.size) // (row.size // n)
    return tolerance.pieces_error_bound(
        p.q,
        p.k,
        p.v,
        pieces=ids[:s],
        num_pieces=devices * n,
        tree="sequential",
        key_blocks=1 if fallback or one_run else None,
        **p.semantics(),
        **p.options,
    )


def assert_ring_close(out, lse, p, scheme, devices, label):
    """``out`` and ``lse`` within :func:`ring_bound` of the oracle; NaN and ``-inf`` exactly
    where the oracle has them."""
    ref, ref_lse = p.oracle()
    bound, lse_bound = ring_bound(scheme, devices, p)
    out, lse = np.asarray(out, np.float64), np.asarray(lse, np.float64)
    nan_ref = np.isnan(ref)
    np.testing.assert_array_equal(np.isnan(out), nan_ref, err_msg=f"{label}: NaN pattern")
    err = np.abs(np.where(nan_ref, 0.0, out - np.where(nan_ref, 0.0, ref)))
    assert_ratio_within(
        err,
        np.where(nan_ref, 0.0, bound),
        f"{label}: |out - oracle| = {{error:.3e}} > bound {{allowed:.3e}} at {{index}}",
    )
    inf_ref = np.isneginf(ref_lse)
    np.testing.assert_array_equal(np.isneginf(lse), inf_ref, err_msg=f"{label}: -inf lse")
    lerr = np.abs(np.where(inf_ref, 0.0, lse - np.where(inf_ref, 0.0, ref_lse)))
    assert_ratio_within(
        lerr,
        np.where(inf_ref, 0.0, lse_bound),
        f"{label}: lse error {{error:.3e}} exceeds its bound {{allowed:.3e}} at {{index}}",
    )


def _check_forward(scheme, devices, p):
    out, lse = _call(scheme, devices, p)
    assert out.dtype == p.dtype and out.shape == (*p.q.shape[:3], p.v.shape[-1])
    assert_ring_close(out, lse, p, scheme, devices, f"{scheme} on {devices}")


@given(scheme=st.sampled_from(SCHEMES), devices=st.sampled_from(MESHES), problem=kproblems())
@scaled(0.25)
def test_matches_oracle_on_every_mesh(scheme, devices, problem):
    """Any scheme on any mesh, lengths the layout must pad, every option of the kernel mixed
    (masks and biases of any broadcast shape, causal in both alignments, windows, lengths,
    segments, GQA/MQA, softcap, every masked-rows policy; rows left without a key by
    accident), output and lse within the derived bound of the oracle, NaN and ``-inf`` exactly
    where it has them."""
    _check_forward(scheme, devices, problem)


# (scheme, devices, bucket, array kinds, static profile, mask shape, bias shape, dtype): the
# meshes the other tests leave out, each with options the gradient cases do not have.
FORWARD_CASES = (
    # T = S = 6 on 2 devices; one segment_ids array for queries and keys; top-left causal.
    ("striped", 2, 1, ("random", "segments"), 1, "BNTS", None, np.float64),
    # zigzag on 1 device still pads to 2 chunks; a -inf bias; a window right of the query.
    ("zigzag", 1, 2, ("neg_inf_bias", "fully_masked_row"), 5, "B1TS", "BN1S", np.float32),
    # 8 devices for T = 5, S = 7; bottom-right causal window; ALiBi; a per-head mask.
    ("ring", 8, 0, ("alibi", "padding", "random"), 2, "1NTS", None, np.float32),
)


@pytest.mark.parametrize("case", FORWARD_CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def test_matches_oracle(case):
    """Fixed option sets on the meshes the other tests do not use, jitted."""
    scheme, devices, bucket, kinds, profile, mask_shape, bias_shape, dtype = case
    p = ast.make_kernel_problem(
        ast.KERNEL_BUCKETS[bucket],
        kinds,
        7,
        dtype,
        static=ast.STATIC_PROFILES[profile],
        mask_shape=mask_shape,
        bias_shape=bias_shape,
    )
    _check_forward(scheme, devices, p)


# (scheme, devices, T, S, static options, array kinds, bucket): pieces the ring splits finely
# (attnref.distributed.piece_tiles). Striped, causal: every tile of a piece is reachable on every
# step or on none; top-left T = S = 512 on 2 devices (4 x 4 tiles of 64, the six above the
# diagonal never computed) with a mask and a bias; bottom-right T = 256 < S = 384 with segments,
# GQA (4 query heads over 2 K/V heads) and a batch of 2; bottom-right T > S, where the first
# query tile of every piece is never computed (its rows read no key: the masked_rows policy).
# Windows: the striped band, causal and two-sided; the contiguous ring's band, whose tiles are
# reachable on some steps only (each under a cond).
FINE_CASES = (
    ("striped", 2, 512, 512, {"is_causal": True}, ("random", "bias"), 1),
    (
        "striped",
        2,
        256,
        384,
        {"is_causal": True, "causal_alignment": "bottom_right", "masked_rows": "uniform"},
        ("segments", "neg_inf_bias"),
        0,
    ),
    (
        "striped",
        2,
        1024,
        256,
        {"is_causal": True, "causal_alignment": "bottom_right"},
        ("random",),
        1,
    ),
    ("striped", 2, 512, 512, {"is_causal": True, "local_window_size": (100, 0)}, ("bias",), 1),
    ("striped", 2, 512, 512, {"local_window_size": (50, 50), "masked_rows": "nan"}, ("random",), 0),
    ("ring", 2, 512, 512, {"is_causal": True, "local_window_size": (64, 0)}, ("random",), 1),
)


def _fine_problem(case):
    scheme, devices, t, s, static, kinds, bucket = case
    config = dataclasses.replace(ast.KERNEL_BUCKETS[bucket], t=t, s=s)
    p = ast.make_kernel_problem(config, kinds, 5, np.float32, static=static, mask_shape="B1TS")
    kind = ring.piece_tiles(t, s, devices, ring.LAYOUT_OF[scheme], **tiling_rules(p))
    assert kind.shape[0] > 1 and (kind != ring.SOMETIMES).any(), kind  # the fine path runs
    return p


@pytest.mark.parametrize("case", FINE_CASES, ids=lambda c: f"{c[0]}-T{c[2]}-S{c[3]}-{len(c[4])}")
def test_fine_pieces_match_the_oracle(case):
    """The ring with its pieces split finely (the tiles no query may read left out of the
    program, each query tile reading its runs of keys, the tiles only some steps reach under a
    cond): output, lse and, through the custom_vjp, ``d/dq``, ``d/dk``, ``d/dv`` and
    ``d/dbias`` within the derived bounds of the oracles (float32, jitted)."""
    p = _fine_problem(case)
    scheme, devices = case[0], case[1]
    b = p.config
    rng = np.random.default_rng(1)
    cot = rng.standard_normal((b.batch, b.t, b.n, b.h_v)).astype(np.float32)
    cot_lse = rng.standard_normal((b.batch, b.t, b.n)).astype(np.float32)
    kw = dict(p.options)
    bias = kw.pop("bias", None)
    static = tuple(sorted((n, a) for n, a in p.kwargs.items() if n in STATIC_OPTIONS))
    arrays = {n: a for n, a in kw.items() if n not in STATIC_OPTIONS}
    # the output and lse of the same compiled program as the gradients (one ring program less)
    (out, lse), got = _outputs_and_grads(
        scheme, devices, static, p.q, p.k, p.v, bias, arrays, cot, cot_lse
    )
    assert out.dtype == p.dtype and out.shape == (*p.q.shape[:3], p.v.shape[-1])
    assert_ring_close(out, lse, p, scheme, devices, f"{scheme} on {devices}")
    exact, bound = p.oracle_vjp(cot, cot_lse), p.grad_bound(cot, cot_lse)
    for name, g, e, bd in zip(("q", "k", "v", "bias"), got, exact[:4], bound[:4], strict=True):
        if e is not None:
            assert_within_bound(np.asarray(g, np.float64), e, bd, label=f"fine d/d{name}")


def _loss_outputs(scheme, devices, static, q, k, v, bias, arrays):
    fn = KERNELS[scheme]
    mesh = default_mesh(devices)
    return fn(q, k, v, bias, mesh=mesh, return_lse=True, **dict(static), **arrays)


def _loss(scheme, devices, static, q, k, v, bias, arrays, cot, cot_lse):
    """A linear functional of the output and lse (NaN rows and ``-inf`` lse contribute 0)."""
    out, lse = _loss_outputs(scheme, devices, static, q, k, v, bias, arrays)
    out = jnp.where(jnp.isnan(out), 0.0, out)
    return jnp.sum(out * cot) + jnp.sum(jnp.where(jnp.isfinite(lse), lse * cot_lse, 0.0))


_GRAD = jax.grad(_loss, argnums=(3, 4, 5, 6))


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _outputs_and_grads(scheme, devices, static, q, k, v, bias, arrays, cot, cot_lse):
    """``(out, lse)`` and the gradient in one compiled program."""
    args = (scheme, devices, static, q, k, v, bias, arrays)
    out, lse = _loss_outputs(*args)
    return (out, lse), _GRAD(*args, cot, cot_lse)


# (scheme, devices, static profile, array kinds, mask shape, bias shape): each backward path.
# A bias broadcast along T is shared by every device (its gradient is a psum), one laid out
# along T is sharded; "uniform" rows read every value (a psum in the forward).
GRAD_CASES = (
    ("ring", 2, ast.STATIC_PROFILES[4], ("random", "bias", "padding"), "B1TS", "1N1S"),
    ("striped", 4, ast.STATIC_PROFILES[3], ("bias", "segments", "padding"), None, "BNTS"),
    ("zigzag", 8, ast.STATIC_PROFILES[1], ("random", "bias", "padding"), "111S", "B1T1"),
)


def _poison_padding(p):
    """``p`` with NaN keys and infinite values beyond each ``key_value_seq_lengths`` (keys no
    query may read; values only without ``masked_rows="uniform"``, whose rows read every
    value by definition)."""
    k, v = p.k.copy(), p.v.copy()
    for b, n in enumerate(p.options["key_value_seq_lengths"]):
        k[b, n:] = np.nan
        if p.masked_rows != "uniform":
            v[b, n:] = np.inf
    return p.replace(k=k, v=v)


@pytest.mark.parametrize("case", GRAD_CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def test_gradients_match_the_gradient_oracle(case):
    """``d/dq``, ``d/dk``, ``d/dv`` and ``d/dbias`` of a functional of the output and lse,
    through the custom_vjp (the ring run again, dK/dV travelling with the chunks), in float32
    and jitted, within the derived gradient bound of the float64 NumPy gradient oracle; keys
    and values no query may read hold NaN and inf and change nothing (outputs, lse and every
    gradient are those of the clean problem)."""
    scheme, devices, profile, kinds, mask_shape, bias_shape = case
    bucket = ast.KERNEL_BUCKETS[0]
    p = ast.make_kernel_problem(
        bucket, kinds, 3, np.float32, static=profile, mask_shape=mask_shape, bias_shape=bias_shape
    )
    if "segments" in kinds:  # independent packings: some rows have no key
        q_seg, kv_seg = (np.sort(np.arange(n) % 2)[None].repeat(2, 0) for n in (5, 7))
        p.options["segment_ids"] = (q_seg.astype(np.int32), kv_seg.astype(np.int32))
    poisoned = _poison_padding(p)
    b = p.config
    rng = np.random.default_rng(0)
    cot = rng.standard_normal((b.batch, b.t, b.n, b.h_v)).astype(np.float32)
    cot_lse = rng.standard_normal((b.batch, b.t, b.n)).astype(np.float32)
    kw = dict(poisoned.options)
    bias = kw.pop("bias")
    static = tuple(sorted((n, a) for n, a in poisoned.kwargs.items() if n in STATIC_OPTIONS))
    arrays = {n: a for n, a in kw.items() if n not in STATIC_OPTIONS}
    args = (poisoned.q, poisoned.k, poisoned.v, bias, arrays, cot, cot_lse)
    (out, lse), got = _outputs_and_grads(scheme, devices, static, *args)
    assert_ring_close(out, lse, p, scheme, devices, f"{scheme} poisoned")
    exact = p.oracle_vjp(cot, cot_lse)
    # first order in the stored chunk lse's rounding (module docstring): fine at |lse| ~ 1
    bound = p.grad_bound(cot, cot_lse)
    for name, g, e, bd in zip(("q", "k", "v", "bias"), got, exact[:4], bound[:4], strict=True):
        assert g.shape == e.shape, (name, g.shape, e.shape)
        assert_within_bound(np.asarray(g, np.float64), e, bd, label=f"{scheme} d/d{name}")


def test_outputs_and_gradients_eagerly():
    """Without ``jax.jit`` (the kernel jits its own ``shard_map``): output, lse and the
    gradients of ``jax.vjp`` in float64 on 4 devices (zigzag: 8 chunks for ``T = S = 4``, so half
    the chunks are padding), with causality, a bias and key lengths."""
    p = ast.make_kernel_problem(ast.KERNEL_BUCKETS[2], ("causal", "bias"), 5, np.float64)
    p.options["key_value_seq_lengths"] = np.array([3, 4], np.int32)
    b = p.config
    rng = np.random.default_rng(1)
    cot = rng.standard_normal((b.batch, b.t, b.n, b.h_v))
    cot_lse = rng.standard_normal((b.batch, b.t, b.n))
    arrays = {"key_value_seq_lengths": p.options["key_value_seq_lengths"]}
    static = (("is_causal", True),)
    (out, lse), vjp = jax.vjp(
        functools.partial(_loss_outputs, "zigzag", 4, static, arrays=arrays),
        p.q,
        p.k,
        p.v,
        p.options["bias"],
    )
    assert_ring_close(out, lse, p, "zigzag", 4, "zigzag eagerly")
    got = vjp((cot, cot_lse))
    exact, bound = p.oracle_vjp(cot, cot_lse), p.grad_bound(cot, cot_lse)
    for name, g, e, bd in zip(("q", "k", "v", "bias"), got, exact[:4], bound[:4], strict=True):
        assert_within_bound(np.asarray(g), e, bd, label=f"eager d/d{name}")


def test_bfloat16_states_are_not_rounded_per_step():
    """bfloat16 on 8 devices has the error scale of 1 device: the chunk states and their merges
    stay in float32 and the output is rounded to bfloat16 once.

    Allowance (derived): :func:`ring_bound` with float32 states (the ring's own model): the
    float32 result is within ``e_32`` (the chunks' float32 kernel bounds carried through eight
    float32 merges, ``~1e-6 |o|`` at these logits) of the exact output and the one rounding
    adds ``u_16 (|o| + e_32)`` with ``u_16 = 2^-8``, so the bound is that of ``P = 1`` but for
    ``e_32``. States rounded to bfloat16 at each of the 8 merges would add up to
    ``8 u_16 |o|`` (about ``sqrt(8) u_16 |o|`` at random), beyond it on some of the 1024
    entries (seen: a mutant that rounds the running state after each merge fails here by a
    factor of 38; the correct ring reaches 0.97 of the bound)."""
    config = ast.Config(batch=2, t=16, s=16, n=4, k=2, h=8, h_v=8, d_model=8)
    p = ast.make_kernel_problem(config, "none", 11, ml_dtypes.bfloat16)
    assert p.q.dtype == ml_dtypes.bfloat16
    out, lse = _call("ring", 8, p)
    assert out.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
    assert_ring_close(out, lse, p, "ring", 8, "bfloat16 on 8 devices")


ROW_MESHES = {"ring": 4, "striped": 8, "zigzag": 2}


@pytest.mark.parametrize("scheme", SCHEMES)
def test_row_form_matches_the_oracle(scheme):
    """``<scheme>_attention(params, x_q, x_kv, mask=..., bias=..., mesh=...)`` (the registry's
    ``apply``), jitted, within the derived weight-level bound of :func:`attnref.oracle.attention`
    (cross-attention, T = 5 and S = 7, a causal mask, key padding and a bias)."""
    p = ast.make_attention_problem(ast.WEIGHT_BUCKETS[1], "combined", 2, np.float32)
    args, inputs = (p.params, p.x_q, p.x_kv), p.inputs()
    ref = oracle.attention(*args, **inputs)
    bound = tolerance.attention_error_bound(*args, dtype=p.dtype, **inputs)
    apply = jax.jit(ROWS[scheme], static_argnames=("residual", "mesh"))
    y = apply(*args, mesh=default_mesh(ROW_MESHES[scheme]), **inputs)
    assert y.dtype == p.dtype
    assert_within_bound(np.asarray(y, np.float64), ref, bound, label=f"{scheme}_attention")


def test_every_length_including_empty():
    """``T = 0`` and ``S = 0`` (nothing to distribute) give the kernel's answer; ``T = 1`` on 8
    devices leaves 7 devices with padding only."""
    rng = np.random.default_rng(4)
    q = rng.standard_normal((1, 1, 2, 4))
    k = rng.standard_normal((1, 3, 2, 4))
    for t, s in ((1, 3), (0, 3), (1, 0)):
        out, lse = JITTED["zigzag"](
            q[:, :t], k[:, :s], k[:, :s], mesh=default_mesh(8), return_lse=True
        )
        config = ast.Config(batch=1, t=t, s=s, n=2, k=2, h=4, h_v=4, d_model=8, dtype="float64")
        p = ast.KernelProblem(q[:, :t], k[:, :s], k[:, :s], {}, config)
        assert out.shape == (1, t, 2, 4) and lse.shape == (1, t, 2)
        assert_ring_close(out, lse, p, "zigzag", 8, f"T={t}, S={s}")


def test_bad_input_names_the_argument(unchecked_annotations):
    q = np.zeros((1, 4, 2, 4), np.float32)
    with pytest.raises(TypeError, match=r"mesh must be a jax\.sharding\.Mesh"):
        ring.ring_dot_product_attention(q, q, q, mesh="devices")
    with pytest.raises(ValueError, match="axis_name 'model' is not an axis"):
        ring.striped_dot_product_attention(q, q, q, mesh=default_mesh(2), axis_name="model")
    with pytest.raises(ValueError, match=r"key has head dim 3 \(shape \(1, 4, 2, 3\)\)"):
        ring.zigzag_dot_product_attention(q, q[..., :3], q, mesh=default_mesh(2))
    with pytest.raises(ValueError, match="key_value_seq_lengths"):
        ring.ring_dot_product_attention(
            q, q, q, mesh=default_mesh(2), key_value_seq_lengths=np.array([5], np.int32)
        )


@pytest.mark.parametrize("layout", ring.LAYOUTS)
@pytest.mark.parametrize(
    ("t", "devices"),
    [(16, 4), (64, 8), (37, 8), (12, 1), (8, 8), (256, 2), (1024, 4), (4096, 8)],
)
def test_ring_tiles_computed_against_the_oracles_allowed_pairs(layout, t, devices):
    """:func:`attnref.distributed.ring_tiles_computed` = the tiles of each device's pieces that
    hold a pair the oracle allows (:func:`attnref.oracle.kernel_allowed`, causal), counted by
    brute force, with the tiling of :func:`attnref.distributed.piece_tiles`; and, by hand, the
    balanced layouts' busiest device computes about half of its ``P`` pieces: zigzag
    ``P / 2 + 1 / (2 n)`` of them once ``2P`` divides ``T`` (``n`` tiles a side), striped
    ``(n + 1) P / (2 n)`` once its pieces split into ``n > 1`` fine tiles a side."""
    allowed = np.tril(np.ones((t, t), bool))
    if t <= 64:  # the oracle's own allowed set where it is cheap; the same lower triangle
        np.testing.assert_array_equal(
            oracle.kernel_allowed((1, 1, t, t), is_causal=True)[0, 0], allowed
        )
    table = ring.positions(ring.padded_length(t, devices, layout), devices, layout)
    c = table.shape[1]
    kinds = ring.piece_tiles(t, t, devices, layout, 0)
    n = kinds.shape[0]
    padded = np.zeros((table.size, table.size), bool)
    padded[:t, :t] = allowed
    parts = table.reshape(devices, n, c // n)
    reach = np.array(
        [
            [
                [
                    [padded[np.ix_(parts[d, a], parts[o, b])].any() for b in range(n)]
                    for o in range(devices)
                ]
                for a in range(n)
            ]
            for d in range(devices)
        ]
    )  # [d, a, o, b]
    got = ring.ring_tiles_computed(t, devices, layout)
    assert got.tolist() == reach.sum(axis=(1, 2, 3)).tolist()
    # a tile the plan never computes is never reachable; one it always computes always is
    never, always = kinds == ring.NEVER, kinds == ring.ALWAYS
    assert not reach.transpose(0, 2, 1, 3)[:, :, never].any()
    assert reach.transpose(0, 2, 1, 3)[:, :, always].all()
    if layout == "zigzag" and t % (2 * devices) == 0 and devices > 1:
        # P/2 + 1/(2n) pieces: (2P + 1)/4 in quarter pieces (n = 2), (4P + 1)/8 with n = 4
        assert 2 * got.max() == n * n * devices + n
    if layout == "striped" and n > 1 and (kinds != ring.SOMETIMES).all():
        assert 2 * got.max() == devices * n * (n + 1)  # (n + 1) P / (2 n) of a piece's n^2


@pytest.mark.parametrize(("t", "devices"), [(256, 2), (1024, 4), (4096, 8)])
def test_fine_pieces_are_what_xla_compiles(t, devices):
    """What the tiling saves is absent from the compiled program: the causal striped ring's dot
    FLOPs per device and step (XLA's ``cost_analysis`` counts the loop body once) equal
    ``2 B N (d_k + d_v)`` times the pairs of the tiles :func:`attnref.distributed.piece_tiles`
    always computes, ``(n + 1) / (2 n)`` of a whole piece's."""
    b, n_heads, d_k, d_v = 1, 2, 4, 6
    q = np.zeros((b, t, n_heads, d_k), np.float32)
    v = np.zeros((b, t, n_heads, d_v), np.float32)
    mesh = default_mesh(devices)
    fn = jax.jit(
        lambda q, k, v: ring.striped_dot_product_attention(q, k, v, mesh=mesh, is_causal=True)
    )
    kinds = ring.piece_tiles(t, t, devices, "striped", 0)
    n, c = kinds.shape[0], t // devices
    per_step = 2 * b * n_heads * (d_k + d_v) * int((kinds == ring.ALWAYS).sum()) * (c // n) ** 2
    assert xla_counts(fn, q, q, v).dot_flops == per_step
    assert 2 * n * per_step == (n + 1) * 2 * b * n_heads * (d_k + d_v) * c * c
