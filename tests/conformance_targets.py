"""Small attention functions for ``tests/test_conformance_cli.py``: targets for ``attnref check``
and the pytest plugin (``tests.conformance_targets:good`` and so on).

``good`` is jax.nn's own XLA attention (it needs ``masked_rows="uniform"`` declared);
``wrong_scale`` is the same with the logits scaled by twice the right factor, which the
``oracle`` property catches; ``NOT_CALLABLE`` is a target that loads but cannot be called.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax

good = functools.partial(jax.nn.dot_product_attention, implementation="xla")

NOT_CALLABLE = 3


def wrong_scale(query: Any, key: Any, value: Any, *args: Any, scale: Any = None, **kw: Any) -> Any:
    """jax.nn's attention with ``2 / sqrt(H)`` as the default scale: a broken kernel."""
    s = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    return jax.nn.dot_product_attention(
        query, key, value, *args, scale=2.0 * s, implementation="xla", **kw
    )
