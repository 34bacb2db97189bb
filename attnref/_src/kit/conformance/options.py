"""What ``check_attention`` accepts, and the one check of each option (which the CLI and the
pytest plugin share through :class:`attnref.conformance.Options`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from attnref._src.formulations.kernel import CAUSAL_ALIGNMENTS, MASKED_ROWS_POLICIES

PROPERTIES = (
    "oracle",
    "masks",
    "causality",
    "gqa",
    "lse",
    "batch_independence",
    "fully_masked_rows",
    "gradients",
    "extreme_logits",
)
# The properties of a distributed kernel alone (check_attention(..., devices=...)).
GROWTH = "ring_size_growth"
UNEVEN = "uneven_lengths"
DISTRIBUTED_PROPERTIES = (GROWTH, UNEVEN)
ALL_PROPERTIES = PROPERTIES + DISTRIBUTED_PROPERTIES
SIGNATURES = ("jax_nn", "qkv_mask", "numpy", "torch")
# "small": Hypothesis draws over a few small buckets; "production": tile-boundary sweeps
SHAPES = ("small", "production")
FEATURES = (
    "mask",
    "bias",
    "causal",
    "query_seq_lengths",
    "key_value_seq_lengths",
    "window",
    "gqa",
    "cross",
    "lse",
    "grad",
    "segment_ids",
    "softcap",
    "sinks",
    "sink_tokens",
    "dropout",
)
# Names a target may declare that stand for several features: "seq_lengths" (the name before the
# split) is both of jax.nn's length arguments.
FEATURE_ALIASES: dict[str, tuple[str, ...]] = {
    "seq_lengths": ("query_seq_lengths", "key_value_seq_lengths"),
}
_LENGTHS = FEATURE_ALIASES["seq_lengths"]
DEFAULT_FEATURES: dict[str, tuple[str, ...]] = {
    # what jax.nn.dot_product_attention supports
    "jax_nn": ("mask", "bias", "causal", *_LENGTHS, "window", "gqa", "cross", "lse", "grad"),
    # everything a boolean mask can express, differentiable
    "qkv_mask": ("mask", "causal", *_LENGTHS, "window", "cross", "grad", "segment_ids"),
    # jax.nn's options, NumPy in and out, no gradients
    "numpy": ("mask", "bias", "causal", *_LENGTHS, "window", "gqa", "cross", "lse"),
    # torch.nn.functional.scaled_dot_product_attention's options, gradients by autograd
    "torch": ("mask", "bias", "causal", "gqa", "cross", "grad"),
}
_UNSUPPORTED: dict[str, tuple[str, ...]] = {
    "jax_nn": (),
    "qkv_mask": ("bias", "softcap", "lse", "sinks", "dropout"),
    "numpy": ("grad",),
    # SDPA has attn_mask, is_causal, scale and enable_gqa; no lse, lengths, windows or segments
    "torch": (
        *_LENGTHS,
        "window",
        "segment_ids",
        "softcap",
        "lse",
        "sinks",
        "sink_tokens",
        "dropout",
    ),
}
DEFAULT_SEMANTICS = {"masked_rows": "zeros", "causal_alignment": "top_left"}
# Each option's choices (the declared semantics': the kernel's own option names).
_CHOICES: dict[str, tuple[str, ...]] = {
    "signature": SIGNATURES,
    "masked_rows": MASKED_ROWS_POLICIES,
    "causal_alignment": CAUSAL_ALIGNMENTS,
    "shapes": SHAPES,
}
# The feature a property needs (else it is skipped), small and production shapes alike.
NEEDS = {"causality": "causal", "gqa": "gqa", "lse": "lse", "gradients": "grad"}
# Which declared semantics can change each property's outcome (for PropertyResult.declared).
DEPENDS: dict[str, tuple[str, ...]] = {
    "oracle": (),
    "masks": ("masked_rows", "causal_alignment"),
    "causality": ("causal_alignment",),
    "gqa": (),
    "lse": ("causal_alignment",),
    "batch_independence": ("masked_rows", "causal_alignment"),
    "fully_masked_rows": ("masked_rows",),
    "gradients": ("causal_alignment",),
    "extreme_logits": ("causal_alignment",),
    GROWTH: ("causal_alignment",),
    UNEVEN: ("causal_alignment",),
}


class OptionError(ValueError):
    """An invalid option: ``option`` names it, ``value`` is what was given (or the unknown
    names), ``accepted`` the accepted values (or ``()``)."""

    def __init__(
        self, message: str, option: str, value: Any, accepted: tuple[str, ...] = ()
    ) -> None:
        super().__init__(message)
        self.option = option
        self.value = value
        self.accepted = accepted


def check_features(features: Sequence[str]) -> None:
    """Every feature in :data:`FEATURES` or an alias, else an :class:`OptionError`."""
    unknown = [f for f in features if f not in FEATURES and f not in FEATURE_ALIASES]
    if unknown:
        raise OptionError(
            f"unknown features {unknown}; choose from {FEATURES} (or {tuple(FEATURE_ALIASES)}: "
            + ", ".join(f"{a} = {' + '.join(fs)}" for a, fs in FEATURE_ALIASES.items())
            + ")",
            "features",
            unknown,
            FEATURES + tuple(FEATURE_ALIASES),
        )


def expand_features(features: Sequence[str]) -> tuple[str, ...]:
    """``features`` with each alias expanded in place, repeats dropped."""
    out = (g for f in features for g in FEATURE_ALIASES.get(f, (f,)))
    return tuple(dict.fromkeys(out))


def check_expressible(signature: str, features: Sequence[str]) -> None:
    """The signature can pass every feature, else an :class:`OptionError` naming those it cannot."""
    impossible = [f for f in features if f in _UNSUPPORTED[signature]]
    if impossible:
        raise OptionError(
            f"signature {signature!r} cannot express features {impossible} "
            f"(it has no way to pass {', '.join(impossible)})",
            "features",
            impossible,
        )


def check_choice(option: str, value: str) -> None:
    """``value`` is one of ``option``'s choices, else an :class:`OptionError`."""
    accepted = _CHOICES[option]
    if value not in accepted:
        raise OptionError(
            f"{option} must be one of {accepted}, got {value!r}", option, value, accepted
        )


def check_properties(
    properties: Sequence[str] | None, known: tuple[str, ...] = ALL_PROPERTIES
) -> tuple[str, ...]:
    """``properties`` (``None``: all) in ``known``'s order, else an :class:`OptionError` listing
    the unknown."""
    if properties is None:
        return known
    bad = [p for p in properties if p not in known]
    if bad:
        raise OptionError(
            f"unknown properties {bad}; choose from {known}", "properties", bad, known
        )
    return tuple(p for p in known if p in properties)


def check_subset(
    option: str, given: Sequence[Any], allowed: tuple[str, ...], empty: bool = False
) -> tuple[str, ...]:
    """``given`` as strings, each in ``allowed`` and (unless ``empty``) at least one, else an
    :class:`OptionError` listing the unknown ones."""
    out = tuple(str(x) for x in given)
    bad = [x for x in out if x not in allowed]
    if bad or not (out or empty):
        some = "a" if empty else "a non-empty"
        message = f"{option} must be {some} subset of {allowed}, got {list(out)}"
        raise OptionError(message, option, bad, allowed)
    return out


def check_dtypes(dtypes: Sequence[Any]) -> tuple[str, ...]:
    """At least one dtype's canonical name (NumPy's ``TypeError`` for an unknown one)."""
    names = tuple(str(np.dtype(d)) for d in dtypes)
    if not names:
        raise OptionError("dtypes must name at least one dtype", "dtypes", names)
    return names


def check_max_examples(max_examples: int) -> None:
    """``max_examples >= 1``, else an :class:`OptionError`."""
    if max_examples < 1:
        raise OptionError(
            f"max_examples must be >= 1, got {max_examples}", "max_examples", max_examples
        )


def check_head_dim(head_dim: int | Sequence[int]) -> tuple[int, int]:
    """``(H, H_v)`` of ``head_dim``: an int ``H`` (``H_v = H``) or a pair ``(H, H_v)``, each a
    whole number from 1 to 1024, else an :class:`OptionError`."""
    dims = tuple(head_dim) if isinstance(head_dim, (tuple, list)) else (head_dim, head_dim)
    if len(dims) != 2 or any(
        not isinstance(d, (int, np.integer)) or isinstance(d, bool) for d in dims
    ):
        raise OptionError(
            f"head_dim must be an int H or a pair (H, H_v) of ints, got {head_dim!r}",
            "head_dim",
            head_dim,
        )
    if not all(1 <= d <= 1024 for d in dims):
        raise OptionError(f"head_dim must be in 1..1024, got {head_dim!r}", "head_dim", head_dim)
    return int(dims[0]), int(dims[1])


def check_devices(devices: Sequence[int]) -> tuple[int, ...]:
    """Mesh sizes, ascending, unique, positive, at most ``jax.device_count()``, else an
    :class:`OptionError`."""
    sizes = tuple(devices)
    bad = [p for p in sizes if not isinstance(p, (int, np.integer)) or isinstance(p, bool) or p < 1]
    if bad or not sizes:
        raise OptionError(
            f"devices must be a non-empty list of positive ints (mesh sizes), got {devices!r}",
            "devices",
            devices,
        )
    out = tuple(sorted({int(p) for p in sizes}))
    available = jax.devices()
    if out[-1] > len(available):
        raise OptionError(
            f"devices={out} asks for a mesh of {out[-1]} devices but this host has "
            f"{len(available)} ({available[0].platform}); on a CPU host start Python with "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={out[-1]} (set before JAX "
            "starts) for virtual CPU devices",
            "devices",
            out,
        )
    return out
