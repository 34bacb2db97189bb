"""Checked mode: value checks that survive ``jax.jit``, built on ``jax.experimental.checkify``.

Conditions on array *values* (a KV cache's fill level, a length, a position) are checked at once
when concrete; traced, :func:`require` records a ``checkify.debug_check`` that raises only under
:func:`checked`, and the unchecked result is an unmistakable NaN row. Usage::

    attention = attnref.checked(jax.jit(attnref.decode.cached_attention))
    out, cache = attention(cache, q, k, v)   # raises instead of returning NaN rows
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from attnref._src.core.checks import float64_scoped, is_traced
from attnref._src.core.entry import call_flat, flatten_call

F = TypeVar("F", bound=Callable[..., Any])

__all__ = ["checked", "require"]


def require(ok: Any, message: str, *, error: type[Exception] = ValueError, **values: Any) -> None:
    """Assert that every element of the boolean array ``ok`` is true.

    ``message`` is a ``str.format`` template filled from ``values`` (pass scalars). Concrete
    ``ok``: raises ``error(message)`` at once. Traced: records ``checkify.debug_check``, which
    raises only under :func:`checked`; the caller makes the unchecked result NaN rows.
    """
    if not is_traced(ok, *values.values()):
        if not bool(np.all(np.asarray(ok))):
            concrete = {name: np.asarray(v).tolist() for name, v in values.items()}
            raise error(message.format(**concrete))
        return
    arrays = {name: jnp.asarray(v) for name, v in values.items()}
    checkify.debug_check(jnp.all(jnp.asarray(ok)), message, **arrays)


def checked(fn: F) -> F:
    """The checked twin of ``fn``: value checks that ``fn`` cannot do at trace time raise.

    ``checked(fn)`` runs ``checkify.checkify(fn, errors=checkify.user_checks)`` and throws the
    first failed :func:`require` (without it, the same failures give NaN rows under
    ``jax.jit``). ``fn`` may be jitted (``checked(jax.jit(fn))`` compiles once); non-array
    arguments pass through unchanged. Call the result outside any ``jax.jit``.

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
        tree, mask, static, arrays = flatten_call(args, kwargs)  # arrays and NumPy scalars
        if is_traced(*arrays):
            raise TypeError(
                f"checked({getattr(fn, '__name__', fn)!r}) was called with traced arguments "
                "(inside jax.jit, vmap or grad); a checked function raises, so call it outside "
                "and jit inside it: checked(jax.jit(fn)), or use checkify.checkify yourself"
            )
        program = functools.partial(call_flat, fn, tree, mask, static)
        err, out = checkify.checkify(program, errors=checkify.user_checks)(*arrays)
        err.throw()
        return out

    return float64_scoped(wrapper)  # type: ignore[return-value]
