"""The attnref pytest plugin: ``--attnref-*`` options for ``pytest --pyargs attnref.conformance``.

Registered through the ``pytest11`` entry point ``attnref``, so installing attnref is enough::

    python -m pytest --pyargs attnref.conformance --attnref-target=mypkg.kernels:attention

Without ``--attnref-target`` the options do nothing and the shipped tests skip. With it, the target
is loaded and every option validated once at start-up; a bad target or option is a usage error
(pytest exit status 4) with a message that says what is wrong. Where plugin autoloading is off
(``PYTEST_DISABLE_PLUGIN_AUTOLOAD``), load it with ``-p attnref.conformance.plugin``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest

from attnref.conformance import (
    ALIGNMENTS,
    MASKED_ROWS,
    PROPERTIES,
    Options,
    TargetError,
    load,
    read_xfail_file,
    split_list,
)

__all__ = ["Session", "session"]


@dataclasses.dataclass(frozen=True)
class Session:
    """The plugin's view of one pytest run: the options, the loaded target (``None`` without
    ``--attnref-target``), the properties to generate tests for and the xfail entries."""

    options: Options | None
    fn: Callable[..., Any] | None
    properties: tuple[str, ...]
    xfail: dict[str, str]


_KEY = pytest.StashKey[Session]()


def session(config: pytest.Config) -> Session | None:
    """The plugin's state for ``config``, or ``None`` when the plugin is not loaded."""
    return config.stash.get(_KEY, None)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup(
        "attnref", "attnref conformance (pytest --pyargs attnref.conformance --attnref-target=...)"
    )
    group.addoption(
        "--attnref-target",
        metavar="MODULE:FUNCTION",
        default=None,
        help="the attention function to check, as package.module:function",
    )
    group.addoption(
        "--attnref-signature",
        metavar="NAME",
        default="jax_nn",
        help="how to call the target: jax_nn (jax.nn.dot_product_attention's), qkv_mask "
        "(fn(q, k, v, mask)) or numpy (NumPy in, NumPy out); default jax_nn",
    )
    group.addoption(
        "--attnref-features",
        metavar="LIST",
        default=None,
        help="comma-separated features the target supports (default: the signature's); a "
        "property needing a missing feature is skipped",
    )
    group.addoption(
        "--attnref-properties",
        metavar="LIST",
        default=None,
        help="comma-separated properties to run (default: all)",
    )
    group.addoption(
        "--attnref-examples",
        metavar="N",
        type=int,
        default=None,
        help="Hypothesis examples per property (default: check_attention's, 20)",
    )
    group.addoption("--attnref-seed", metavar="S", type=int, default=0, help="base seed")
    group.addoption(
        "--attnref-masked-rows",
        default="zeros",
        choices=MASKED_ROWS,
        help="the target's declared output for fully masked rows (jax.nn and Flax: uniform)",
    )
    group.addoption(
        "--attnref-causal-alignment",
        default="top_left",
        choices=ALIGNMENTS,
        help="the target's declared causal alignment when T != S (FlashAttention: bottom_right)",
    )
    group.addoption(
        "--attnref-dtypes",
        metavar="LIST",
        default=None,
        help="comma-separated input dtypes (default: float32)",
    )
    group.addoption(
        "--attnref-xfail",
        metavar="FILE",
        default=None,
        help="a file of property names to mark xfail, one per line (# starts a comment)",
    )


def pytest_configure(config: pytest.Config) -> None:
    get = config.getoption
    spec = get("--attnref-target")
    xfail_file = get("--attnref-xfail")
    if spec is None and xfail_file is None:
        config.stash[_KEY] = Session(None, None, (), {})
        return
    options = Options(
        target=spec or "",
        signature=get("--attnref-signature"),
        features=split_list(get("--attnref-features")),
        max_examples=get("--attnref-examples"),
        seed=get("--attnref-seed"),
        masked_rows=get("--attnref-masked-rows"),
        causal_alignment=get("--attnref-causal-alignment"),
        dtypes=split_list(get("--attnref-dtypes")),
        properties=split_list(get("--attnref-properties")),
    )
    try:
        options.validate()
        xfail = {} if xfail_file is None else read_xfail_file(xfail_file, PROPERTIES)
    except (ValueError, OSError) as e:
        raise pytest.UsageError(f"attnref: {e}") from e
    fn = None
    if spec is not None:
        try:
            fn = load(spec)
        except TargetError as e:
            raise pytest.UsageError(f"attnref: --attnref-target: {e}") from e
        try:
            options.preflight(fn)
        except ValueError as e:
            raise pytest.UsageError(f"attnref: {e}") from e
    config.stash[_KEY] = Session(options if spec else None, fn, options.selected(), xfail)


def pytest_report_header(config: pytest.Config) -> str | None:
    state = session(config)
    if state is None or state.options is None:
        return None
    o = state.options
    declared = [
        f"{k}={v}"
        for k, v, d in (
            ("masked_rows", o.masked_rows, "zeros"),
            ("causal_alignment", o.causal_alignment, "top_left"),
        )
        if v != d
    ]
    return (
        f"attnref: target {o.target} (signature {o.signature}"
        + (f", features {','.join(o.features)}" if o.features is not None else "")
        + f", seed {o.seed}"
        + (f", declared {', '.join(declared)}" if declared else "")
        + ")"
    )
