"""The attnref pytest plugin: ``--attnref-*`` options for ``pytest --pyargs attnref.conformance``.

Registered through the ``pytest11`` entry point ``attnref``, so installing attnref is enough::

    python -m pytest --pyargs attnref.conformance --attnref-target=mypkg.kernels:attention

Without ``--attnref-target`` the shipped tests skip; with it, the target is loaded and every
option validated once (a bad one is a usage error, exit status 4). Without plugin autoloading,
add ``-p attnref.conformance.plugin``. The kit (JAX, Hypothesis) is imported only once an
``--attnref-*`` option asks for it.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from attnref.conformance import Options

__all__ = ["Session", "session"]

# Spelled out so that adding the options imports nothing (Options.validate checks the values).
_MASKED_ROWS_HELP = "zeros, uniform or nan"
_ALIGNMENTS_HELP = "top_left or bottom_right"


@dataclasses.dataclass(frozen=True)
class Session:
    """One pytest run: the options, the target, the properties to test and the xfail entries."""

    options: Options | None
    fn: Callable[..., Any] | None
    properties: tuple[str, ...]
    xfail: dict[str, str]
    merge_fn: Callable[..., Any] | None = None  # --attnref-merge-target's function


_KEY = pytest.StashKey[Session]()


def session(config: pytest.Config) -> Session | None:
    """The plugin's state for ``config``, or ``None`` when the plugin is not loaded."""
    return config.stash.get(_KEY, None)


# The --attnref-<name> options: (name, metavar, default, help); examples and seed are ints.
_OPTIONS: tuple[tuple[str, str, Any, str], ...] = (
    (
        "target",
        "MODULE:FUNCTION",
        None,
        "the attention function to check, as package.module:function",
    ),
    (
        "signature",
        "NAME",
        "jax_nn",
        "how to call the target: jax_nn (jax.nn.dot_product_attention's), qkv_mask "
        "(fn(q, k, v, mask)) or numpy (NumPy in, NumPy out); default jax_nn",
    ),
    (
        "features",
        "LIST",
        None,
        "comma-separated features the target supports (default: the signature's); a "
        "property needing a missing feature is skipped",
    ),
    ("properties", "LIST", None, "comma-separated properties to run (default: all)"),
    ("examples", "N", None, "Hypothesis examples per property (default: check_attention's, 20)"),
    ("seed", "S", 0, "base seed"),
    (
        "masked-rows",
        "POLICY",
        "zeros",
        f"the target's declared output for fully masked rows: {_MASKED_ROWS_HELP} "
        "(jax.nn and Flax: uniform; default zeros)",
    ),
    (
        "causal-alignment",
        "ALIGNMENT",
        "top_left",
        f"the target's declared causal alignment when T != S: {_ALIGNMENTS_HELP} "
        "(FlashAttention: bottom_right; default top_left)",
    ),
    ("dtypes", "LIST", None, "comma-separated input dtypes (default: float32)"),
    (
        "shapes",
        "SHAPES",
        "small",
        "small (Hypothesis draws over small shapes; default) or production (tile-boundary "
        "lengths up to 8193, head dims 64/128/256, up to 32 heads, against the fast oracle)",
    ),
    (
        "devices",
        "LIST",
        None,
        "check a distributed kernel (fn(..., mesh=, axis_name=)) on 1-D meshes of these "
        "sizes, e.g. 1,2,4,8: every property on each size, plus ring_size_growth and "
        "uneven_lengths (on a CPU host: XLA_FLAGS=--xla_force_host_platform_device_count=8)",
    ),
    (
        "head-dim",
        "H[,H_v]",
        None,
        "the head dim of every example (default: 4 at small shapes; 64, 128 and 256 at "
        "production shapes), for a kernel whose matrix units need more (e.g. 16 for cuDNN); "
        "H,H_v: a value head dim of its own (e.g. 192,128 for MLA)",
    ),
    (
        "merge-target",
        "MODULE:FUNCTION",
        None,
        "a state merge merge(o_a, lse_a, o_b, lse_b) -> (o, lse) to check with the state "
        "algebra's properties (check_merge_states; --attnref-examples and --attnref-seed apply)",
    ),
    (
        "xfail",
        "FILE",
        None,
        "a file of property names to mark xfail, one per line (# starts a comment)",
    ),
)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup(
        "attnref", "attnref conformance (pytest --pyargs attnref.conformance --attnref-target=...)"
    )
    for name, metavar, default, text in _OPTIONS:
        typed = {"type": int} if name in ("examples", "seed") else {}
        group.addoption(f"--attnref-{name}", metavar=metavar, default=default, help=text, **typed)
    group.addoption(
        "--attnref-refuses-lengths",
        action="store_true",
        help="a declared limit: the function refuses some sequence lengths (attnref check "
        "--refuses-lengths); a clear refusal draws another example instead of failing",
    )


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(
    early_config: pytest.Config, parser: pytest.Parser, args: list[str]
) -> None:
    """Let ``--jaxtyping-packages=attnref...`` instrument attnref: its modules, imported with this
    plugin before jaxtyping's hook, are dropped from ``sys.modules`` to be imported again."""
    del early_config
    value = getattr(parser.parse_known_args(args), "jaxtyping_packages", None)
    if not value:
        return
    *packages, _typechecker = (p.strip() for p in value.split("(", 1)[0].split(","))
    if any(p == "attnref" or p.startswith("attnref.") for p in packages):
        for name in [m for m in sys.modules if m.partition(".")[0] == "attnref"]:
            if name != __name__:
                del sys.modules[name]


def pytest_configure(config: pytest.Config) -> None:
    get = config.getoption
    merge_fn = _load(get("--attnref-merge-target"), "merge-target")
    spec = get("--attnref-target")
    xfail_file = get("--attnref-xfail")
    declared = (get("--attnref-masked-rows"), get("--attnref-causal-alignment"))
    quiet = get("--attnref-devices") is None and declared == ("zeros", "top_left")
    if spec is None and xfail_file is None and quiet:
        config.stash[_KEY] = Session(None, None, (), {}, merge_fn)
        return
    from attnref.conformance import (
        ALL_PROPERTIES,
        Options,
        read_xfail_file,
        split_devices,
        split_head_dim,
        split_list,
    )

    split: dict[str, Any] = {}
    for flag, parse in (("devices", split_devices), ("head-dim", split_head_dim)):
        try:
            split[flag] = parse(get(f"--attnref-{flag}"))
        except ValueError as e:
            raise pytest.UsageError(f"attnref: --attnref-{flag}: {e}") from e
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
        shapes=get("--attnref-shapes"),
        devices=split["devices"],
        head_dim=split["head-dim"],
        refuses_lengths=get("--attnref-refuses-lengths"),
    )
    try:
        options.validate()
        xfail = {} if xfail_file is None else read_xfail_file(xfail_file, ALL_PROPERTIES)
    except (ValueError, OSError) as e:
        raise pytest.UsageError(f"attnref: {e}") from e
    if spec is None and xfail_file is None:  # only declared semantics or devices, validated
        config.stash[_KEY] = Session(None, None, (), {}, merge_fn)
        return
    fn = _load(spec, "target")
    if fn is not None:
        try:
            options.preflight(fn)
        except ValueError as e:
            raise pytest.UsageError(f"attnref: {e}") from e
    config.stash[_KEY] = Session(options if spec else None, fn, options.selected(), xfail, merge_fn)


def _load(spec: str | None, flag: str) -> Callable[..., Any] | None:
    if spec is None:
        return None
    from attnref.conformance import TargetError, load

    try:
        return load(spec)
    except TargetError as e:
        raise pytest.UsageError(f"attnref: --attnref-{flag}: {e}") from e


def pytest_report_header(config: pytest.Config) -> str | None:
    state = session(config)
    if state is None or state.options is None:
        return None
    from attnref._src.kit.conformance.options import DEFAULT_SEMANTICS

    o = state.options
    declared = [f"{k}={getattr(o, k)}" for k, d in DEFAULT_SEMANTICS.items() if getattr(o, k) != d]
    return (
        f"attnref: target {o.target} (signature {o.signature}"
        + (f", features {','.join(o.features)}" if o.features is not None else "")
        + f", seed {o.seed}"
        + (f", devices {','.join(map(str, o.devices))}" if o.devices is not None else "")
        + (f", declared {', '.join(declared)}" if declared else "")
        + ")"
    )
