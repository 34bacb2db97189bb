"""The one-call oracle assertions (``attnref.testing.assert_matches_oracle`` and
``assert_grads_match_oracle``): correct kernels pass (jax.nn and attnref's own, jit and no-jit),
planted wrong ones fail with the numpy.testing-style summary, bad input is refused by name, and
pytest hides attnref's frames in a failure.

No tolerance is chosen here: the assertions derive theirs. The planted faults are far above any
derived allowance (an error of 1.0 on values of size ~1, where float32's allowance is ~1e-5), so
the expected mismatch counts and worst indices are known without the code under test."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import attnref
from attnref import oracle
from attnref import strategies as ast
from attnref.testing import Match, assert_grads_match_oracle, assert_matches_oracle

from .kernel_helpers import kproblems

B, T, S, N, K, H = 2, 5, 6, 4, 2, 8


def _inputs(dtype=np.float32, seed=0, t=T, s=S):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, t, N, H)).astype(dtype)
    k = rng.standard_normal((B, s, K, H)).astype(dtype)
    v = rng.standard_normal((B, s, K, H)).astype(dtype)
    return q, k, v


# jax.nn's options, typed once: each set goes to the kernel and to the assertion alike
JAX_NN_OPTIONS = [
    {},
    {"is_causal": True},
    {"key_value_seq_lengths": np.array([6, 3], np.int32)},
    {"query_seq_lengths": np.array([5, 2], np.int32), "is_causal": True},
    {"local_window_size": (2, 1)},
    {"mask": np.tril(np.ones((T, S), bool))[None, None], "scale": 0.5},
    {"bias": np.linspace(-1.0, 1.0, T * S, dtype=np.float32).reshape(1, 1, T, S)},
]


class JaxNnPasses(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_output_and_gradients(self):
        """jax.nn.dot_product_attention (float32, GQA N = 2K, cross T != S) passes both
        assertions under each of its options."""
        q, k, v = _inputs()
        cot = np.random.default_rng(1).standard_normal((B, T, N, H)).astype(np.float32)
        for opts in JAX_NN_OPTIONS:
            static = {n: o for n, o in opts.items() if n in ("is_causal", "local_window_size")}
            arrays = {n: o for n, o in opts.items() if n not in static}

            def fn(q, k, v, arrays, static=static):
                return jax.nn.dot_product_attention(q, k, v, **arrays, **static)

            run = self.variant(fn)
            out = run(q, k, v, arrays)
            match = assert_matches_oracle(out, q, k, v, **opts)
            assert isinstance(match, Match) and match.ratio <= 1.0 and match.dtype == "float32"
            _, pull = jax.vjp(lambda a, b, c, run=run, arrays=arrays: run(a, b, c, arrays), q, k, v)
            grads = pull(jnp.asarray(cot))
            matches = assert_grads_match_oracle(grads, q, k, v, cot, **opts)
            assert set(matches) == {"query", "key", "value"}


@pytest.mark.parametrize("dtype", [jnp.bfloat16])  # XLA:CPU has no float16 dot with f32 result
def test_jax_nn_16bit_passes_and_a_16bit_fault_fails(dtype):
    """16 bits take the kit's comparative rule (twice attnref's own error in that dtype plus
    gamma_8(u) max|o|); jax.nn passes, and the output with one element moved by 1.0 fails."""
    q, k, v = (jnp.asarray(x, dtype) for x in _inputs())
    out = jax.jit(jax.nn.dot_product_attention)(q, k, v)
    match = assert_matches_oracle(out, q, k, v)
    assert match.dtype == str(np.dtype(dtype))
    with pytest.raises(AssertionError, match=r"(?s)FlashAttention.*Mismatched elements: 1 / 320 "):
        assert_matches_oracle(out.at[1, 2, 3, 4].add(1.0), q, k, v)


_DPA = jax.jit(attnref.dot_product_attention, static_argnames=ast.STATIC_OPTIONS)


@given(p=kproblems(dtypes=("float32",), buckets=ast.KERNEL_BUCKETS[:2]), data=st.data())
def test_every_option_mix_passes_and_one_planted_element_fails(p, data):
    """attnref's kernel (float32, jitted) on mixed problems (every array kind, every static
    profile, rows with no key under each masked-rows policy) passes with its lse; the output
    with one drawn element moved by 1.0 fails with exactly that element mismatched (1.0 is far
    above any float32 allowance at these sizes: values are O(1), allowances O(1e-5))."""
    out, lse = _DPA(p.q, p.k, p.v, return_lse=True, **p.kwargs)
    assert_matches_oracle(out, p.q, p.k, p.v, lse=lse, **p.kwargs)
    bad = np.array(out)
    idx = tuple(
        data.draw(st.integers(0, n - 1), label=f"axis {i}") for i, n in enumerate(bad.shape)
    )
    if np.isnan(bad[idx]):  # masked_rows="nan": NaN + 1.0 is still the declared NaN
        return
    bad[idx] += 1.0
    where = ", ".join(map(str, idx))
    with pytest.raises(
        AssertionError, match=rf"(?s)Mismatched elements: 1 / {bad.size} .*out\[{where}\]"
    ):
        assert_matches_oracle(bad, p.q, p.k, p.v, **p.kwargs)


def test_attnref_options_pass_and_the_lse_is_checked():
    """attnref's own kernel with options jax.nn lacks (segment ids, softcap, sinks, a window
    with a sink token) and its lse; the lse moved by 1.0 at one entry fails, named ``lse[b, t,
    n]``."""
    q, k, v = _inputs(s=T)
    seg = np.array([[0, 0, 1, 1, 1], [0, 0, 0, 0, 1]], np.int32)
    opts = dict(
        segment_ids=seg,
        softcap=2.0,
        sinks=np.array([0.5, -1.0, 0.0, 2.0], np.float32),
        local_window_size=(2, 0),
        sink_tokens=1,
        masked_rows="zeros",
    )
    out, lse = attnref.dot_product_attention(q, k, v, return_lse=True, **opts)
    assert_matches_oracle(out, q, k, v, lse=lse, **opts)
    bad = np.array(lse)
    bad[0, 3, 1] += 1.0
    with pytest.raises(AssertionError, match=r"(?s)Mismatched elements: 1 / 40 .*lse\[0, 3, 1\]"):
        assert_matches_oracle(out, q, k, v, lse=bad, **opts)


def test_planted_output_errors_fail_with_the_summary():
    """Three entries moved by 1.0 (the largest at [1, 4, 2, 7]): three mismatched of 320, the
    worst index with its axes, the kernel's and the oracle's values there, the multiple."""
    q, k, v = _inputs()
    out = oracle.dot_product_attention(q, k, v, is_causal=True).astype(np.float32)
    bad = out.copy()
    bad[0, 0, 0, 0] += 1.0
    bad[0, 1, 3, 2] -= 1.0
    bad[1, 4, 2, 7] += 2.0
    with pytest.raises(AssertionError) as info:
        assert_matches_oracle(bad, q, k, v, is_causal=True)
    text = str(info.value)
    assert "Mismatched elements: 3 / 320 (0.938%)" in text
    assert "Worst element: out[b, t, n, h] = out[1, 4, 2, 7]" in text
    assert f"kernel:  {float(bad[1, 4, 2, 7])!r}" in text
    assert "oracle:  " in text and "x the allowance" in text
    # the same output without is_causal is a different function: every row moves
    with pytest.raises(AssertionError, match="Mismatched elements"):
        assert_matches_oracle(out, q, k, v)


def test_planted_wrong_kernels_fail():
    """Wrong kernels, not wrong numbers: the scale 1/H for 1/sqrt(H), causal ignored, the key
    lengths ignored."""
    q, k, v = _inputs()
    lens = np.array([6, 3], np.int32)
    wrong = {
        "scale": (jax.nn.dot_product_attention(q, k, v, scale=1.0 / H), {}),
        "causal": (jax.nn.dot_product_attention(q, k, v), {"is_causal": True}),
        "lengths": (
            jax.nn.dot_product_attention(q, k, v),
            {"key_value_seq_lengths": lens},
        ),
    }
    for name, (out, opts) in wrong.items():
        with pytest.raises(AssertionError, match="Mismatched elements"):
            assert_matches_oracle(out, q, k, v, **opts)
        assert name


def test_nan_and_masked_rows():
    """A NaN where the oracle has a number is a mismatch; under ``masked_rows="nan"`` NaN is the
    declared meaning of a fully masked row, and zeros there fail."""
    q, k, v = _inputs(s=T)
    lens = np.array([5, 0], np.int32)  # batch element 1 has no key: every row fully masked
    out = oracle.dot_product_attention(q, k, v, key_value_seq_lengths=lens).astype(np.float32)
    assert_matches_oracle(out, q, k, v, key_value_seq_lengths=lens)
    bad = out.copy()
    bad[0, 2, 1, 0] = np.nan
    with pytest.raises(AssertionError, match=r"(?s)1 / 320.*out\[0, 2, 1, 0\].*nan"):
        assert_matches_oracle(bad, q, k, v, key_value_seq_lengths=lens)
    nan_rows = out.copy()
    nan_rows[1] = np.nan
    assert_matches_oracle(nan_rows, q, k, v, key_value_seq_lengths=lens, masked_rows="nan")
    with pytest.raises(AssertionError, match="Mismatched elements: 160 / 320"):
        assert_matches_oracle(out, q, k, v, key_value_seq_lengths=lens, masked_rows="nan")


def test_planted_wrong_gradient_fails():
    """A kernel whose forward is right but whose keys get no gradient (``stop_gradient``):
    dk fails, named ``dk[b, s, k, h]``; dq and dv alone would pass."""
    q, k, v = _inputs()
    cot = np.random.default_rng(2).standard_normal((B, T, N, H)).astype(np.float32)

    def frozen_keys(q, k, v):
        return jax.nn.dot_product_attention(q, jax.lax.stop_gradient(k), v, is_causal=True)

    out, pull = jax.vjp(jax.jit(frozen_keys), q, k, v)
    assert_matches_oracle(out, q, k, v, is_causal=True)
    grads = pull(jnp.asarray(cot))
    with pytest.raises(
        AssertionError, match=r"dk does not match.*\n.*\nWorst element: dk\[b, s, k, h\]"
    ):
        assert_grads_match_oracle(grads, q, k, v, cot, is_causal=True)


def test_bias_gradient():
    """With a bias the fourth gradient, ``dbias [b, n, t, s]`` (of the bias's own shape), is
    compared too; moved by 1.0 at one entry it fails."""
    q, k, v = _inputs()
    bias = np.random.default_rng(3).standard_normal((1, N, T, S)).astype(np.float32)
    cot = np.random.default_rng(4).standard_normal((B, T, N, H)).astype(np.float32)
    f = jax.jit(lambda q, k, v, b: jax.nn.dot_product_attention(q, k, v, bias=b))
    _, pull = jax.vjp(f, q, k, v, bias)
    grads = [np.array(g) for g in pull(jnp.asarray(cot))]
    assert set(assert_grads_match_oracle(grads, q, k, v, cot, bias=bias)) == {
        "query", "key", "value", "bias"
    }  # fmt: skip
    grads[3][0, 1, 2, 3] += 1.0
    with pytest.raises(AssertionError, match=r"dbias\[b, n, t, s\] = dbias\[0, 1, 2, 3\]"):
        assert_grads_match_oracle(grads, q, k, v, cot, bias=bias)


def test_bad_input_is_refused_by_name():
    q, k, v = _inputs()
    out = oracle.dot_product_attention(q, k, v).astype(np.float32)
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['is_casual'\]"):
        assert_matches_oracle(out, q, k, v, is_casual=True)
    with pytest.raises(TypeError, match="out must be a floating-point array, got dtype int"):
        assert_matches_oracle(out.astype(np.int32), q, k, v)
    with pytest.raises(TypeError, match="dtype must be a NumPy dtype"):
        assert_matches_oracle(out, q, k, v, dtype="float33")
    with pytest.raises(ValueError, match=r"^assert_matches_oracle: .*head dim"):
        assert_matches_oracle(out, q, k[..., :3], v)
    with pytest.raises(AssertionError, match=r"out: shape \(2, 5, 4\) != the oracle's"):
        assert_matches_oracle(out[..., 0], q, k, v)
    cot = np.ones_like(out)
    with pytest.raises(TypeError, match="grads must hold 3 arrays"):
        assert_grads_match_oracle((q, k), q, k, v, cot)
    with pytest.raises(TypeError, match=r"4 with a bias.*without a bias option"):
        assert_grads_match_oracle((q, k, v, q), q, k, v, cot)
    with pytest.raises(TypeError, match="grads must be a tuple"):
        assert_grads_match_oracle({"query": q}, q, k, v, cot)
    with pytest.raises(ValueError, match=r"^assert_grads_match_oracle: .*cotangent"):
        assert_grads_match_oracle((q, k, v), q, k, v, cot[:, :2])
    # jax.nn's backend choice changes nothing computed: accepted and ignored
    assert_matches_oracle(out, q, k, v, implementation=None)


class _TorchLike:
    """A stand-in for a torch tensor: ``detach()`` and ``cpu()``, then ``__array__``."""

    def __init__(self, array):
        self.array, self.calls = array, []

    def detach(self):
        self.calls.append("detach")
        return self

    def cpu(self):
        self.calls.append("cpu")
        return self

    def __array__(self, dtype=None, copy=None):
        return self.array if dtype is None else self.array.astype(dtype)


def test_a_torch_like_tensor_is_detached_and_read():
    q, k, v = _inputs()
    out = _TorchLike(oracle.dot_product_attention(q, k, v).astype(np.float32))
    assert_matches_oracle(out, q, k, v)
    assert out.calls == ["detach", "cpu"]


_FAILING_TEST = """
import numpy as np
from attnref import oracle
from attnref.testing import assert_attention_close, assert_matches_oracle

rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((1, 3, 2, 4)).astype(np.float32) for _ in range(3))

def test_one_call():
    out = oracle.dot_product_attention(q, k, v).astype(np.float32)
    out[0, 1, 1, 2] += 1.0
    assert_matches_oracle(out, q, k, v)

def test_close():
    ref = oracle.dot_product_attention(q, k, v)
    assert_attention_close(ref + 1.0, ref, dtype=np.float32, rule="bound", bound=1e-6)
"""


def test_pytest_hides_attnref_frames(tmp_path):
    """A failing assertion in a user's test: pytest's report shows the user's line and the
    message, and no frame of attnref's own code (``__tracebackhide__``)."""
    (tmp_path / "test_user.py").write_text(textwrap.dedent(_FAILING_TEST))
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
         "-p", "no:randomly", "test_user.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    text = run.stdout
    assert run.returncode == 1, text + run.stderr
    assert "2 failed" in text, text
    assert "Mismatched elements: 1 / 24" in text
    assert "assert_matches_oracle(out, q, k, v)" in text  # the user's line
    assert "rule 'bound' failed" in text
    for internal in ("oracle_match.py", "closeness.py", "__tracebackhide__", "def compare"):
        assert internal not in text, text
    failures = text.split("= FAILURES =")[1].split("short test summary")[0]
    assert len(failures.splitlines()) < 60, failures
