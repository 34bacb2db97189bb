"""The jaxtyping annotations are checked at runtime in the test suite.

pyproject's ``addopts`` run the suite with jaxtyping's import hook (as equinox runs its own),
``--jaxtyping-packages=attnref._src.core,...,tests.conftest.typechecker``: every function and
dataclass of the packages whose modules carry jaxtyping shape annotations is imported decorated
with ``@jaxtyped(typechecker=beartype)``, so a call whose arrays contradict its shape annotation
fails with a :class:`jaxtyping.TypeCheckError`, eagerly and at trace time. The NumPy layers'
plain annotations are mypy's (``.ci/run``). (``attnref.conformance.plugin`` lets the hook see
attnref although the plugin is part of it.)

Here: the hook is on (a contradiction is refused by the annotation before the body runs), and
the pytrees keep working under ``jax.jit`` and ``jax.grad``. The pytree dataclasses
(``AttentionParams``, ``KVCache``, ...) are ``@no_type_check``: JAX rebuilds a pytree with any
leaves (``tree_map`` results, placeholders, ``float0`` cotangents), so their constructors must
accept them. ``LinearState`` is a NamedTuple, whose fields no hook checks.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import pytest

import attnref
from attnref import decode, linear


def _instrumented(fn) -> bool:
    """Whether jaxtyping's import hook decorated ``fn``: its ``@jaxtyped`` wrapper is on the
    ``__wrapped__`` chain (attnref's own decorators, e.g. ``float64_scoped``, may sit above)."""
    while fn is not None:
        code = getattr(fn, "__code__", None)
        if code is not None and Path(code.co_filename).parent.name == "jaxtyping":
            return True
        fn = getattr(fn, "__wrapped__", None)
    return False


HOOKED = _instrumented(linear.FeatureMap.kernel)
requires_hook = pytest.mark.skipif(
    not HOOKED,
    reason="attnref is not instrumented: the suite was run without jaxtyping's import hook "
    "(pyproject's addopts pass --jaxtyping-packages=attnref...,...; it was overridden or removed)",
)


def _hooked_packages(request) -> list[str]:
    """The packages ``--jaxtyping-packages`` names (its last entry is the type checker)."""
    packages = request.config.getoption("--jaxtyping-packages", default=None) or ""
    names = [p.strip() for p in packages.split("(", 1)[0].split(",")][:-1]
    if not any(n == "attnref" or n.startswith("attnref.") for n in names):
        pytest.skip("run without --jaxtyping-packages=attnref...,... (pyproject's default)")
    return names


def test_the_configured_hook_instruments_attnref(request):
    """With ``--jaxtyping-packages`` naming attnref's packages (the default, from pyproject), the
    modules really are instrumented: a plugin import order that left them unchecked fails here
    instead of skipping every test below."""
    _hooked_packages(request)
    assert HOOKED
    assert _instrumented(attnref.concat_attention)
    assert _instrumented(attnref.dot_product_attention)


def test_the_hook_covers_every_module_with_shape_annotations(request):
    """Every attnref module that imports jaxtyping (its annotations carry array shapes) lies in a
    package the hook instruments, so a new such module outside the list fails here rather than
    going unchecked."""
    names = _hooked_packages(request)
    root = Path(attnref.__file__).resolve().parent
    shaped = []
    for path in sorted(root.rglob("*.py")):
        if re.search(r"^(from jaxtyping import|import jaxtyping)", path.read_text(), re.M):
            parts = path.relative_to(root.parent).with_suffix("").parts
            shaped.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    assert len(shaped) > 20  # the formulations, the core, the probes, the models
    uncovered = [m for m in shaped if not any(m == n or m.startswith(n + ".") for n in names)]
    assert not uncovered, f"shape-annotated modules outside --jaxtyping-packages: {uncovered}"


@requires_hook
def test_a_contradiction_is_refused_by_the_annotation_first():
    """``FeatureMap.kernel(q: [..., d], k: [..., d])`` given ``d = 3`` and ``d = 1``: the body
    refuses it with its own ValueError, but with the hook on the annotation's shared ``d``
    refuses it first (a TypeCheckError), eagerly and while tracing under ``jax.jit``."""
    fm = linear.elu_plus_one()
    q, k = np.ones((5, 3)), np.ones((5, 1))
    unchecked = inspect.unwrap(linear.FeatureMap.kernel)
    with pytest.raises(ValueError, match="same last dimension"):
        unchecked(fm, q, k)  # the body's own check
    with pytest.raises(jaxtyping.TypeCheckError, match="parameter 'k'"):
        fm.kernel(q, k)
    with pytest.raises(jaxtyping.TypeCheckError, match="parameter 'k'"):
        jax.jit(fm.kernel)(q, k)
    assert np.shape(fm.kernel(q, np.ones((5, 3)))) == (5,)  # the same call, consistent


@requires_hook
def test_a_checked_dataclass_field_is_refused():
    """A dataclass is checked on construction (but for the pytrees of arrays, see above):
    ``FeatureMap``'s static ``orthogonal`` must be a bool, which its ``__post_init__`` does not
    check."""
    with pytest.raises(jaxtyping.TypeCheckError, match="orthogonal"):
        linear.FeatureMap("elu_plus_one", orthogonal="yes")


def _params():
    return attnref.init_params(0, d_model=8, num_heads=4, d_k=2, bias=True, num_kv_heads=2)


def test_attention_params_under_jit_grad_and_tree_map():
    params = _params()
    x = np.random.default_rng(0).standard_normal((2, 5, 8)).astype(np.float32)

    def loss(p, x):
        return jnp.sum(attnref.concat_attention(p, x, mask=attnref.causal_mask(5)) ** 2)

    grads = jax.jit(jax.grad(loss))(params, x)
    assert isinstance(grads, attnref.AttentionParams)
    assert grads.w_q.shape == params.w_q.shape and grads.b_o.shape == params.b_o.shape
    np.testing.assert_allclose(grads.w_q, jax.grad(loss)(params, x).w_q, rtol=1e-5, atol=1e-6)
    y = jax.vmap(attnref.concat_attention, in_axes=(None, 0))(params, x)
    assert y.shape == x.shape
    # JAX rebuilds the pytree with other leaves: shapes, and the per-argument in_axes of vmap
    shapes = jax.tree.map(lambda a: a.shape, params)
    assert shapes.w_k == (2, 8, 2)
    axes = jax.tree.map(lambda a: None, params)
    assert jax.vmap(attnref.concat_attention, in_axes=(axes, 0))(params, x).shape == x.shape


def test_kv_cache_under_jit_and_grad():
    params = _params()
    x = np.random.default_rng(1).standard_normal((2, 3, 8)).astype(np.float32)
    cache = decode.init_cache(params, batch=2, capacity=4)
    out, cache2 = jax.jit(decode.step)(params, cache, x)
    assert isinstance(cache2, decode.KVCache) and out.shape == x.shape
    np.testing.assert_array_equal(cache2.lengths, [3, 3])

    def loss(p, c):
        return jnp.sum(decode.step(p, c, x)[0] ** 2)

    gp, gc = jax.jit(jax.grad(loss, argnums=(0, 1), allow_int=True))(params, cache)
    assert isinstance(gp, attnref.AttentionParams) and np.all(np.isfinite(gp.w_v))
    assert isinstance(gc, decode.KVCache)
    assert gc.positions.dtype == jax.dtypes.float0  # an int field's cotangent, not an int array


def test_linear_state_under_jit_and_grad():
    fm = linear.elu_plus_one()
    state = linear.linear_state_init((2,), 3, fm.num_features(4), 5, jnp.float32)
    rng = np.random.default_rng(2)
    q, k = (jnp.asarray(rng.standard_normal((2, 3, 4)), jnp.float32) for _ in range(2))
    v = jnp.asarray(rng.standard_normal((2, 3, 5)), jnp.float32)
    step = jax.jit(lambda s, q, k, v: linear.linear_step(s, q, k, v, feature_map=fm))
    state2, out = step(state, q, k, v)
    assert isinstance(state2, linear.LinearState) and out.shape == (2, 3, 5)

    def loss(s, q):
        return jnp.sum(linear.linear_step(s, q, k, v, feature_map=fm)[1] ** 2)

    gs, gq = jax.jit(jax.grad(loss, argnums=(0, 1)))(state2, q)
    assert isinstance(gs, linear.LinearState) and gs.s.shape == state2.s.shape
    assert gq.shape == q.shape and np.all(np.isfinite(gq))
