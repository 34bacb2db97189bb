"""Checked mode: value checks that survive ``jax.jit``, built on ``jax.experimental.checkify``.

Shapes and dtypes are static, so attnref checks them at trace time (``attnref._src.core.checks``).
Some conditions depend on array *values* (a KV cache's fill level, a sequence length, an
absolute position): eagerly they are concrete and checked at once; under ``jax.jit``, ``vmap``
or ``lax.scan`` they are tracers and cannot be. For those, attnref code calls :func:`require`,
which

* raises ``error(message)`` at once when the condition is concrete (eager calls), and
* otherwise records a ``checkify.debug_check``: a no-op in plain (unchecked) traced code, and a
  real check under :func:`checked`, which raises :class:`jax.experimental.checkify.
  JaxRuntimeError` (a ``ValueError``) with the message filled in with the runtime values.

In unchecked traced code the caller must still never return a silently wrong number: every
``require`` site pairs the check with an unmistakable result (NaN rows, documented at the site).

Usage (jit inside, so one compile is reused)::

    attention = attnref.checked(jax.jit(attnref.decode.cached_attention))
    out, cache = attention(cache, q, k, v)   # raises instead of returning NaN rows
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from attnref._src.core.checks import float64_scoped

F = TypeVar("F", bound=Callable[..., Any])

__all__ = ["checked", "require"]


def _is_array(leaf: Any) -> bool:
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic))


def require(
    ok: Any,
    message: str,
    *,
    error: type[Exception] = ValueError,
    **values: Any,
) -> None:
    """Assert that every element of the boolean array ``ok`` is true.

    ``message`` is a ``str.format`` template whose ``{name}`` fields are filled from ``values``
    (arrays or Python numbers; pass scalars, e.g. the first offending position, so the message
    stays short). Put static facts (capacities, shapes) into the template itself with an
    f-string, doubling any literal braces.

    Concrete ``ok`` (eager code): raises ``error(message.format(**values))`` when any element is
    false. Traced ``ok`` (inside ``jax.jit``, ``vmap``, ``lax.scan``, ``grad``): records
    ``checkify.debug_check(all(ok), message, **values)``, which does nothing unless the call runs
    under :func:`checked` (or the caller's own ``checkify.checkify``); there it raises
    ``checkify.JaxRuntimeError``. The caller must make the unchecked traced result unmistakable
    itself (attnref returns NaN rows).
    """
    if not isinstance(ok, jax.core.Tracer) and not any(
        isinstance(v, jax.core.Tracer) for v in values.values()
    ):
        if not bool(np.all(np.asarray(ok))):
            concrete = {name: np.asarray(v).tolist() for name, v in values.items()}
            raise error(message.format(**concrete))
        return
    arrays = {name: jnp.asarray(v) for name, v in values.items()}
    checkify.debug_check(jnp.all(jnp.asarray(ok)), message, **arrays)


def checked(fn: F) -> F:
    """The checked twin of ``fn``: value checks that ``fn`` cannot do at trace time raise.

    ``checked(fn)(*args, **kwargs)`` runs ``checkify.checkify(fn, errors=checkify.user_checks)``
    and throws the first failed :func:`require` as ``checkify.JaxRuntimeError`` (a subclass of
    ``ValueError``) whose message names the offending values; otherwise it returns ``fn``'s
    result unchanged. Without ``checked``, the same failures give documented NaN rows under
    ``jax.jit``. ``fn`` may itself be jitted (recommended: ``checked(jax.jit(fn))`` compiles
    once); arguments that are not arrays (Python ints, floats, callables, strings) are passed
    through unchanged, so ``jax.jit``'s static arguments keep working. Float64 array arguments
    switch ``jax_enable_x64`` on for the call (as every attnref function does).

    Call the result outside any ``jax.jit``: an error can only be raised once its values are
    concrete. To check inside your own jitted code, use ``checkify.checkify`` directly and call
    ``err.throw()`` outside.

    Args:
        fn: Any function built from attnref calls (jitted or not), e.g.
            ``jax.jit(attnref.decode.cached_attention)``.

    Returns:
        A function with ``fn``'s signature that returns ``fn``'s result or raises.

    Raises:
        TypeError: (from the returned function) If it is called with traced arguments, inside
            ``jax.jit``, ``vmap`` or ``grad``.
        checkify.JaxRuntimeError: (from the returned function, a ``ValueError``) For the first
            failed value check, naming the offending values.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
        is_array = [_is_array(leaf) for leaf in leaves]
        if any(isinstance(leaf, jax.core.Tracer) for leaf in leaves):
            raise TypeError(
                f"checked({getattr(fn, '__name__', fn)!r}) was called with traced arguments "
                "(inside jax.jit, vmap or grad); a checked function raises, so call it outside "
                "and jit inside it: checked(jax.jit(fn)), or use checkify.checkify yourself"
            )

        def on_arrays(arrays: list[Any]) -> Any:
            it = iter(arrays)
            full = [next(it) if a else leaf for leaf, a in zip(leaves, is_array, strict=True)]
            a, kw = jax.tree_util.tree_unflatten(treedef, full)
            return fn(*a, **kw)

        arrays = [leaf for leaf, a in zip(leaves, is_array, strict=True) if a]
        err, out = checkify.checkify(on_arrays, errors=checkify.user_checks)(arrays)
        err.throw()
        return out

    return float64_scoped(wrapper)  # type: ignore[return-value]
