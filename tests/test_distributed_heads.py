"""All-gather context parallelism, DeepSpeed-Ulysses and tensor-parallel heads
(``attnref.distributed.{all_gather,ulysses,tensor_parallel}_dot_product_attention``) on meshes of
1, 2, 4 and 8 virtual CPU devices, against the float64 NumPy oracle.

Tolerances, all derived (none tuned):

* Forward: :func:`attnref.tolerance.kernel_call_error_bound` with ``key_blocks=1``. Each scheme
  computes every query row in one piece: all-gather runs a device's queries against every
  gathered key at once, Ulysses and tensor parallelism run the ordinary kernel on whole
  sequences of their heads; no state is merged, so the bound of a single-block softmax holds
  (the bound's docstring: ``n_b`` key blocks, here 1). 16-bit inputs: the bound's float32
  model plus one rounding of the output.
* Gradients: :func:`attnref.tolerance.kernel_grad_error_bound` (first order, any evaluation
  order of the backward equations; the all-gather's reduce-scatter, the all-to-alls and the
  sums over repeated K/V heads are such orders) around
  :func:`attnref.oracle.dot_product_attention_vjp`.
* Row forms: :func:`attnref.tolerance.attention_error_bound` around
  :func:`attnref.oracle.attention` (the ``psum`` of tensor parallelism is one more order of
  the head sum the bound covers).

Shapes: three buckets whose head counts the meshes divide (``N = 8`` or 4; ``K = 2`` and
``K = 1`` are repeated on the meshes they do not divide), ``T, S`` of 5 and 7 (no mesh divides
them), 6 (2 divides, 4 does not) and 8 (every contiguous split, zigzag up to 4 devices). Each
jitted function is compiled once per (scheme, mesh, bucket, dtype, options).
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import Mesh

import attnref
from attnref import oracle, tolerance
from attnref import strategies as ast
from attnref.distributed import DISTRIBUTED, default_mesh
from attnref.testing import assert_within_bound

from .helpers import scaled
from .kernel_helpers import assert_kernel_close

SCHEMES = ("all_gather", "ulysses", "tensor_parallel")
MESHES = (1, 2, 4, 8)
KERNELS = {s: getattr(attnref.distributed, f"{s}_dot_product_attention") for s in SCHEMES}
ROWS = {s: getattr(attnref.distributed, f"{s}_attention") for s in SCHEMES}
STATIC_OPTIONS = ast.STATIC_OPTIONS
STATIC = (*STATIC_OPTIONS, "mesh", "axis_name")
JITTED = {s: jax.jit(fn, static_argnames=STATIC) for s, fn in KERNELS.items()}
PROFILES = ast.STATIC_PROFILES

GQA8 = ast.Config(batch=2, t=5, s=7, n=8, k=2, h=3, h_v=2, d_model=8)  # K = 2 repeated on 4, 8
MQA4 = ast.Config(batch=1, t=6, s=6, n=4, k=1, h=2, h_v=3, d_model=8)  # K = 1, T = S
MHA8 = ast.Config(batch=1, t=8, s=8, n=8, k=8, h=2, h_v=2, d_model=8)  # splits evenly
BUCKETS = (GQA8, MQA4)


def _meshes(scheme: str, n: int) -> list[int]:
    """The mesh sizes a scheme takes for ``n`` query heads (Ulysses and tensor parallelism
    split the heads, so ``P`` must divide ``N``)."""
    return [d for d in MESHES if scheme == "all_gather" or n % d == 0]


def _poison_unread(p: ast.KernelProblem) -> ast.KernelProblem:
    """``p`` with NaN keys beyond each ``key_value_seq_lengths`` and ``+inf`` values there (keys
    no query may read), and NaN query rows beyond each ``query_seq_lengths`` (padding rows);
    values stay clean under ``masked_rows="uniform"``, which reads every value row."""
    q, k, v = p.q.copy(), p.k.copy(), p.v.copy()
    for b, n in enumerate(p.options.get("key_value_seq_lengths", ())):
        k[b, n:] = np.nan
        if p.masked_rows != "uniform":
            v[b, n:] = np.inf
    for b, n in enumerate(p.options.get("query_seq_lengths", ())):
        q[b, n:] = np.nan
    return p.replace(q=q, k=k, v=v)


class ForwardTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @given(
        scheme=st.sampled_from(SCHEMES),
        problem=ast.mixed_kernel_problems(
            ast.configs(buckets=BUCKETS, dtypes=("float32", "float64"), value_dim_differs=True)
        ),
        data=st.data(),
    )
    @scaled(0.25)
    def test_matches_oracle_on_every_mesh(self, scheme, problem, data):
        """Each scheme on a drawn mesh, lengths no mesh divides, the kernel's options mixed
        (masks and biases of any broadcast shape, causal in both alignments, windows, lengths,
        segments, GQA/MQA, softcap, every masked-rows policy): output and lse within the
        derived bound of the oracle, NaN and ``-inf`` exactly where it has them."""
        p = problem
        devices = data.draw(st.sampled_from(_meshes(scheme, p.config.n)), label="devices")
        fn = self.variant(KERNELS[scheme], static_argnames=STATIC)
        out, lse = fn(p.q, p.k, p.v, mesh=default_mesh(devices), return_lse=True, **p.kwargs)
        assert out.dtype == p.dtype and out.shape == (*p.q.shape[:3], p.v.shape[-1])
        assert_kernel_close(out, lse, p, f"{scheme} on {devices}", key_blocks=1)


# (scheme, devices, bucket, array kinds, static profile, mask shape, bias shape, dtype): every
# mesh for every scheme, every profile (both alignments, windows, softcap, the three policies),
# every array kind, full and broadcast head / query / key axes (all-gather lays out a full T
# axis, Ulysses and tensor parallelism split a full N axis), GQA with K/V heads repeated, MQA.
BF16 = ml_dtypes.bfloat16
CASES = (
    ("all_gather", 1, GQA8, ("random", "bias"), 0, "BNTS", "1N1S", np.float64),
    ("all_gather", 2, GQA8, ("random", "padding"), 1, "B1T1", None, np.float32),
    ("all_gather", 4, MHA8, ("segments", "neg_inf_bias"), 2, None, "B1TS", BF16),
    ("all_gather", 8, MQA4, ("random", "padding", "alibi"), 3, "11TS", None, np.float32),
    ("ulysses", 1, MQA4, ("bias", "segments"), 3, None, "BNTS", np.float32),
    ("ulysses", 2, GQA8, ("padding", "random", "bias"), 2, "111S", "1NT1", np.float64),
    ("ulysses", 4, MHA8, ("random", "neg_inf_bias"), 1, "BNTS", "B1TS", BF16),
    ("ulysses", 8, GQA8, ("padding", "alibi"), 4, None, None, np.float64),
    ("tensor_parallel", 1, GQA8, ("padding", "segments"), 3, None, None, np.float32),
    ("tensor_parallel", 2, MQA4, ("random", "bias"), 4, "1NTS", "B1TS", np.float64),
    ("tensor_parallel", 4, GQA8, ("padding", "neg_inf_bias", "random"), 5, "B11S", "1NT1", BF16),
    ("tensor_parallel", 8, MHA8, ("padding", "alibi", "random"), 0, "BN11", None, np.float32),
)


def _case(case: tuple, seed: int = 7) -> ast.KernelProblem:
    _, _, bucket, kinds, profile, mask_shape, bias_shape, dtype = case
    return ast.make_kernel_problem(
        bucket,
        kinds,
        seed,
        dtype,
        static=PROFILES[profile],
        mask_shape=mask_shape,
        bias_shape=bias_shape,
        empty_rows=True,
    )


def _label(case: tuple) -> str:
    scheme, devices, bucket, kinds, profile, *_, dtype = case
    return f"{scheme}-{devices}-t{bucket.t}-{'+'.join(kinds)}-p{profile}-{np.dtype(dtype).name}"


@pytest.mark.parametrize("case", CASES, ids=_label)
def test_every_option_on_every_mesh(case):
    """The coverage table (jitted): output and lse within the derived bound of the clean
    problem's oracle, with NaN keys, infinite values and NaN padding queries where no query
    reads them (they change nothing)."""
    scheme, devices = case[:2]
    p = _case(case)
    poisoned = _poison_unread(p)
    out, lse = JITTED[scheme](
        poisoned.q,
        poisoned.k,
        poisoned.v,
        mesh=default_mesh(devices),
        return_lse=True,
        **poisoned.kwargs,
    )
    assert out.dtype == p.dtype and lse.dtype == jnp.promote_types(p.dtype, jnp.float32)
    assert_kernel_close(out, lse, p, _label(case), key_blocks=1)


def test_every_length_including_empty():
    """``T = 0`` and ``S = 0`` give the kernel's answer (empty output; every row fully masked);
    ``T = 1`` on 8 devices leaves 7 (all-gather: 15 of 16 zigzag chunks) with padding only.
    Eagerly, with and without ``return_lse``."""
    rng = np.random.default_rng(4)
    q = rng.standard_normal((1, 1, 8, 4))
    k = rng.standard_normal((1, 3, 2, 4))
    for scheme, t, s in (
        ("all_gather", 1, 3),
        ("all_gather", 0, 3),
        ("ulysses", 1, 0),
        ("ulysses", 0, 3),
        ("tensor_parallel", 0, 0),
        ("tensor_parallel", 1, 3),
    ):
        c = ast.Config(batch=1, t=t, s=s, n=8, k=2, h=4, h_v=4, d_model=8, dtype="float64")
        p = ast.KernelProblem(q[:, :t], k[:, :s], k[:, :s], {}, c, masked_rows="nan")
        out, lse = KERNELS[scheme](
            p.q, p.k, p.v, mesh=default_mesh(8), return_lse=True, masked_rows="nan"
        )
        assert out.shape == (1, t, 8, 4) and lse.shape == (1, t, 8)
        assert_kernel_close(out, lse, p, f"{scheme} T={t}, S={s}", key_blocks=1)
        alone = KERNELS[scheme](p.q, p.k, p.v, mesh=default_mesh(8), masked_rows="nan")
        assert isinstance(alone, jax.Array)  # return_lse=False: the output alone
        np.testing.assert_array_equal(np.asarray(alone), np.asarray(out))


def test_two_axis_mesh_runs_over_the_named_axis():
    """A 2 x 4 mesh: each scheme runs over the axis it is given (its collectives within the
    groups along that axis; the other axis replicates)."""
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    p = _case(CASES[1])
    for scheme, axis in (
        ("all_gather", "model"),
        ("ulysses", "data"),
        ("tensor_parallel", "model"),
    ):
        out, lse = JITTED[scheme](
            p.q, p.k, p.v, mesh=mesh, axis_name=axis, return_lse=True, **p.kwargs
        )
        assert_kernel_close(out, lse, p, f"{scheme} over {axis}", key_blocks=1)


def test_out_of_range_lengths_under_jit_are_nan_or_raise_when_checked():
    """Traced lengths cannot be checked at trace time: a batch element whose lengths are out of
    range is NaN (as the kernel), the other is exact; under :func:`attnref.checked` the call
    raises. (The table's compiled programs, reused: T = 5 and S = 7.)"""
    bad_lens = np.array([8, 3], np.int32)  # S = 7: batch element 0 is out of range
    for case in (CASES[1], CASES[5], CASES[8]):
        scheme, devices = case[:2]
        p = _case(case)
        bad = dict(p.kwargs, key_value_seq_lengths=bad_lens)
        out, lse = JITTED[scheme](p.q, p.k, p.v, mesh=default_mesh(devices), return_lse=True, **bad)
        assert np.all(np.isnan(out[0])) and np.all(np.isnan(lse[0])), scheme
        good = p.replace(options={**p.options, "key_value_seq_lengths": bad_lens})
        assert_kernel_close(out[1:], lse[1:], good.batch_slice(1), scheme, key_blocks=1)
    p = _case(CASES[5])
    checked = attnref.checked(JITTED["ulysses"])
    with pytest.raises(ValueError, match="key_value_seq_lengths"):
        checked(
            p.q, p.k, p.v, mesh=default_mesh(2), **p.kwargs | {"key_value_seq_lengths": bad_lens}
        )


def _loss(scheme, devices, static, q, k, v, bias, arrays, cot, cot_lse):
    """A linear functional of the output and lse (NaN rows and ``-inf`` lse contribute 0)."""
    out, lse = KERNELS[scheme](
        q, k, v, bias, mesh=default_mesh(devices), return_lse=True, **dict(static), **arrays
    )
    out = jnp.where(jnp.isnan(out), 0.0, out)
    return jnp.sum(out * cot) + jnp.sum(jnp.where(jnp.isfinite(lse), lse * cot_lse, 0.0))


_GRAD = jax.grad(_loss, argnums=(3, 4, 5, 6))
_GRAD_JIT = jax.jit(_GRAD, static_argnums=(0, 1, 2))

# (scheme, devices, bucket, array kinds, static profile, mask shape, bias shape): the backward
# of each communication pattern: the all-gather's reduce-scatter with a bias sharded along T;
# the all-to-alls with a bias split on its head axis; the heads of MQA repeated for 2 devices
# (their gradients summed) with a bias replicated on every device (a psum of its gradient).
GRAD_CASES = (
    ("all_gather", 4, GQA8, ("random", "bias", "padding"), 4, "B1TS", "1NTS"),
    ("ulysses", 8, GQA8, ("bias", "segments", "padding"), 3, None, "BNTS"),
    ("tensor_parallel", 2, MQA4, ("random", "bias", "padding"), 1, "111S", "B1T1"),
)


def _check_grads(scheme, devices, p, grad_fn, cot, cot_lse):
    kw = dict(p.options)
    bias = kw.pop("bias")
    static = tuple(sorted((n, a) for n, a in p.kwargs.items() if n in STATIC_OPTIONS))
    arrays = {n: a for n, a in kw.items() if n not in STATIC_OPTIONS}
    poisoned = _poison_unread(p)
    got = grad_fn(
        scheme, devices, static, poisoned.q, poisoned.k, poisoned.v, bias, arrays, cot, cot_lse
    )
    exact, bound = p.oracle_vjp(cot, cot_lse), p.grad_bound(cot, cot_lse)
    for name, g, e, bd in zip(("q", "k", "v", "bias"), got, exact[:4], bound[:4], strict=True):
        assert g.shape == e.shape, (name, g.shape, e.shape)
        assert_within_bound(np.asarray(g, np.float64), e, bd, label=f"{scheme} d/d{name}")


@pytest.mark.parametrize("case", GRAD_CASES, ids=lambda c: c if isinstance(c, str) else None)
def test_gradients_match_the_gradient_oracle(case):
    """``d/dq``, ``d/dk``, ``d/dv`` and ``d/dbias`` of a functional of the output and lse, by
    autodiff through the collectives, in float32 and jitted, within the derived gradient bound
    of the float64 NumPy gradient oracle; keys, values and queries no row reads hold NaN and
    inf and change no gradient."""
    scheme, devices, bucket, kinds, profile, mask_shape, bias_shape = case
    p = ast.make_kernel_problem(
        bucket,
        kinds,
        3,
        np.float32,
        static=PROFILES[profile],
        mask_shape=mask_shape,
        bias_shape=bias_shape,
    )
    b = p.config
    rng = np.random.default_rng(0)
    cot = rng.standard_normal((b.batch, b.t, b.n, b.h_v)).astype(np.float32)
    cot_lse = rng.standard_normal((b.batch, b.t, b.n)).astype(np.float32)
    _check_grads(scheme, devices, p, _GRAD_JIT, cot, cot_lse)


def test_gradients_eagerly():
    """The same gradients without ``jax.jit``, in float64 (causal, a bias, GQA with K/V heads
    repeated for 4 devices)."""
    p = ast.make_kernel_problem(GQA8, ("bias",), 5, np.float64, static=PROFILES[1])
    b = p.config
    rng = np.random.default_rng(1)
    cot = rng.standard_normal((b.batch, b.t, b.n, b.h_v))
    cot_lse = rng.standard_normal((b.batch, b.t, b.n))
    _check_grads("tensor_parallel", 4, p, _GRAD, cot, cot_lse)


ROW_CONFIG = ast.Config(batch=(2,), t=5, s=7, n=4, k=2, h=4, h_v=3, d_model=8)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_row_form_matches_the_oracle(scheme):
    """``<scheme>_attention(params, x_q, x_kv, mask=..., bias=..., mesh=...)`` (the registry's
    ``apply``) within the derived weight-level bound of :func:`attnref.oracle.attention`, eagerly
    and jitted with ``residual=True``, on 4 devices (cross-attention, T = 5 and S = 7; 2 K/V
    heads for 4 devices; parameter biases)."""
    p = ast.make_attention_problem(ROW_CONFIG, "combined", 2, np.float32)
    args, inputs = (p.params, p.x_q, p.x_kv), p.inputs()
    mesh = default_mesh(4)
    jitted = jax.jit(ROWS[scheme], static_argnames=DISTRIBUTED.static_argnames)
    for residual, apply in ((False, ROWS[scheme]), (True, jitted)):
        ref = oracle.attention(*args, residual=residual, **inputs)
        bound = tolerance.attention_error_bound(*args, residual=residual, dtype=p.dtype, **inputs)
        y = apply(*args, mesh=mesh, residual=residual, **inputs)
        assert y.dtype == p.dtype
        assert_within_bound(
            np.asarray(y, np.float64), ref, bound, label=f"{scheme}_attention {residual=}"
        )


def test_tensor_parallel_row_form_guards_nonfinite_tokens():
    """A NaN key token that the mask hides from every query changes nothing (the row forms'
    non-finite guard); a query row that reads it is NaN."""
    p = ast.make_attention_problem(ROW_CONFIG, "none", 3, np.float64)
    mask = np.ones((5, 7), bool)
    mask[:, 6] = False
    x_kv = p.x_kv.copy()
    x_kv[:, 6] = np.nan
    y = attnref.distributed.tensor_parallel_attention(
        p.params, p.x_q, x_kv, mask=mask, mesh=default_mesh(2)
    )
    ref = oracle.attention(p.params, p.x_q, p.x_kv, mask=mask)
    bound = tolerance.attention_error_bound(p.params, p.x_q, p.x_kv, mask=mask, dtype=np.float64)
    assert_within_bound(np.asarray(y), ref, bound, label="hidden NaN token")
    mask[2, 6] = True
    y = attnref.distributed.tensor_parallel_attention(
        p.params, p.x_q, x_kv, mask=mask, mesh=default_mesh(2)
    )
    assert np.all(np.isnan(y[:, 2])) and np.all(np.isfinite(np.delete(np.asarray(y), 2, 1)))


def test_registry_entries():
    """Each module registers its entry, with its scheme's functions and cost model."""
    for scheme in SCHEMES:
        f = attnref.get(scheme)
        assert f.id == scheme and f.family is DISTRIBUTED and f.convention == "kernel"
        assert f.apply is ROWS[scheme] and f.native is KERNELS[scheme]
        assert any(sym in f.equation for sym in DISTRIBUTED.equation_symbols), f.equation
        assert f.cost_model.__name__ == f"{scheme}_cost"


def test_bad_input_names_the_argument(unchecked_annotations):
    q = np.zeros((1, 4, 6, 4), np.float32)
    k = np.zeros((1, 4, 2, 4), np.float32)
    mesh4 = default_mesh(4)
    for scheme in ("ulysses", "tensor_parallel"):
        with pytest.raises(ValueError, match=r"query \(1, 4, 6, 4\) has N=6 query heads.*P=4"):
            KERNELS[scheme](q, k, k, mesh=mesh4)
    p = ast.make_attention_problem(
        ast.Config(batch=(1,), t=3, s=3, n=6, k=2, h=2, h_v=2, d_model=4), "none", 0, np.float32
    )
    for scheme in ("ulysses", "tensor_parallel"):
        with pytest.raises(ValueError, match=r"N=6 query heads.*P=4 devices of mesh axis"):
            ROWS[scheme](p.params, p.x_q, mesh=mesh4)
    for scheme in SCHEMES:
        fn = KERNELS[scheme]
        with pytest.raises(TypeError, match=r"mesh must be a jax\.sharding\.Mesh"):
            fn(q, k, k, mesh="devices")
        with pytest.raises(ValueError, match="axis_name 'model' is not an axis"):
            fn(q, k, k, mesh=mesh4, axis_name="model")
        for bad in (
            dict(key=k[..., :3]),
            dict(key_value_seq_lengths=np.array([5], np.int32)),
            dict(mask=np.ones((1, 1, 3, 4), bool)),
            dict(masked_rows="mean"),
        ):
            args = {"query": q, "key": k, "value": k, **bad}
            with pytest.raises(ValueError) as want:
                attnref.dot_product_attention(**args)
            with pytest.raises(ValueError) as got:
                fn(**args, mesh=default_mesh(2))
            assert str(got.value) == str(want.value), scheme
