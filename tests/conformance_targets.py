"""Small attention functions for ``tests/test_conformance.py`` and
``tests/test_conformance_cli.py``: targets for ``attnref check`` and the pytest plugin
(``tests.conformance_targets:good`` and so on).

``good`` is jax.nn's own XLA attention (it needs ``masked_rows="uniform"`` declared);
``wrong_scale`` is the same with the logits scaled by twice the right factor, which the
``oracle`` property catches; ``NOT_CALLABLE`` is a target that loads but cannot be called.

The other targets are :func:`attnref.dot_product_attention` with one deliberate defect each, the
defects of issue 11 that the kit once passed:

* ``mask_row0_only``: a mask that broadcasts over the query axis (``[.., 1, S]``, the usual
  key-padding mask) is applied to query row 0 only;
* ``padded_broadcast``: the pre-fix ``blockwise_dot_product_attention``: a mask or bias that
  broadcasts over the query axis is broadcast to ``[.., T, S]`` and rows ``1..`` are filled the
  way padding would be (``False``, ``-inf``), so they come out as if fully masked;
* ``lse_none``: returns ``(out, None)`` when the lse is asked for;
* ``all_nan``: NaN everywhere, of the right shape;
* ``wrong_shape``: the output in the ``[B, N, T, H_v]`` layout;
* ``raises``: raises from inside a helper (the report must show the traceback).

``past_tile`` is jax.nn's attention with a tiling fault: when ``S`` is past one 128-key tile and
not a multiple of 128, the keys of the last, partial tile are dropped (what a kernel that forgets
its tail tile does). Every small shape (``S <= 8``) is right; ``shapes="production"`` catches it.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

import attnref

good = functools.partial(jax.nn.dot_product_attention, implementation="xla")

NOT_CALLABLE = 3


def past_tile(query: Any, key: Any, value: Any, *args: Any, **kw: Any) -> Any:
    """jax.nn's attention reading only the full 128-key tiles when ``S > 128``, ``S % 128``."""
    s = key.shape[1]
    if s > 128 and s % 128:
        full = (s // 128) * 128
        lens = kw.pop("key_value_seq_lengths", None)
        cap = jnp.full((key.shape[0],), full, jnp.int32)
        kw["key_value_seq_lengths"] = cap if lens is None else jnp.minimum(lens, cap)
    return jax.nn.dot_product_attention(query, key, value, *args, implementation="xla", **kw)


def wrong_scale(query: Any, key: Any, value: Any, *args: Any, scale: Any = None, **kw: Any) -> Any:
    """jax.nn's attention with ``2 / sqrt(H)`` as the default scale: a broken kernel."""
    s = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    return jax.nn.dot_product_attention(
        query, key, value, *args, scale=2.0 * s, implementation="xla", **kw
    )


def _rows_after_first(arr: Any, t: int, fill: Any) -> Any:
    """``arr [.., 1, S]`` broadcast to ``[.., T, S]`` with rows ``1..`` set to ``fill``; an array
    that does not broadcast over the query axis (or ``T == 1``) is returned unchanged."""
    if arr is None or arr.shape[2] != 1 or t == 1:
        return arr
    arr = jnp.asarray(arr)
    full = jnp.broadcast_to(arr, (*arr.shape[:2], t, arr.shape[3]))
    return full.at[:, :, 1:, :].set(fill)


def mask_row0_only(
    query: Any, key: Any, value: Any, bias: Any = None, mask: Any = None, **kw: Any
) -> Any:
    """attnref's kernel, but a query-broadcast mask masks query row 0 only (rows 1.. see every
    key)."""
    mask = _rows_after_first(mask, query.shape[1], True)
    return attnref.dot_product_attention(query, key, value, bias, mask, **kw)


def padded_broadcast(
    query: Any, key: Any, value: Any, bias: Any = None, mask: Any = None, **kw: Any
) -> Any:
    """attnref's kernel with the pre-fix blockwise defect: a query-broadcast mask or bias is
    padded like data, so query rows 1.. have no allowed key (``False`` / ``-inf``)."""
    t = query.shape[1]
    mask = _rows_after_first(mask, t, False)
    bias = _rows_after_first(bias, t, -jnp.inf)
    return attnref.dot_product_attention(query, key, value, bias, mask, **kw)


def lse_none(
    query: Any,
    key: Any,
    value: Any,
    bias: Any = None,
    mask: Any = None,
    *,
    return_lse: bool = False,
    **kw: Any,
) -> Any:
    """attnref's kernel that answers a request for the lse with ``(out, None)``."""
    out = attnref.dot_product_attention(query, key, value, bias, mask, **kw)
    return (out, None) if return_lse else out


def all_nan(query: Any, key: Any, value: Any, *args: Any, **kw: Any) -> Any:
    """NaN everywhere, in the right shape and dtype."""
    b, t, n, _ = query.shape
    return jnp.full((b, t, n, value.shape[-1]), jnp.nan, query.dtype)


def wrong_shape(query: Any, key: Any, value: Any, *args: Any, **kw: Any) -> Any:
    """attnref's kernel with its output in the ``[B, N, T, H_v]`` layout."""
    out = attnref.dot_product_attention(query, key, value, *args, **kw)
    return jnp.swapaxes(out, 1, 2)


def _broken_helper(query: Any) -> Any:
    raise ValueError(f"kernel_helper_exploded on a query of shape {query.shape}")


def raises(query: Any, key: Any, value: Any, *args: Any, **kw: Any) -> Any:
    """Raises from inside ``_broken_helper``, jitted or not."""
    return _broken_helper(query)
