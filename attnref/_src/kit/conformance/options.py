"""What ``check_attention`` accepts: the names of its properties, signatures, features and
declared semantics, and the one check of each option (the CLI and the pytest plugin call the
same checks through :class:`attnref.conformance.Options`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from attnref._src.formulations.kernel import CAUSAL_ALIGNMENTS, MASKED_ROWS_POLICIES

__all__ = [
    "ALL_PROPERTIES",
    "CAUSAL_ALIGNMENTS",
    "DEFAULT_FEATURES",
    "DISTRIBUTED_PROPERTIES",
    "FEATURES",
    "GROWTH",
    "MASKED_ROWS_POLICIES",
    "PROPERTIES",
    "SHAPES",
    "SIGNATURES",
    "UNEVEN",
    "OptionError",
    "check_choice",
    "check_devices",
    "check_dtypes",
    "check_expressible",
    "check_features",
    "check_max_examples",
    "check_properties",
    "check_signature",
]

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
# The properties of a distributed kernel alone (check_attention(..., devices=...)): the error
# against the oracle at each mesh size within the derived bound; lengths the mesh does not divide
# refused clearly or answered right.
GROWTH = "ring_size_growth"
UNEVEN = "uneven_lengths"
DISTRIBUTED_PROPERTIES = (GROWTH, UNEVEN)
ALL_PROPERTIES = PROPERTIES + DISTRIBUTED_PROPERTIES
SIGNATURES = ("jax_nn", "qkv_mask", "numpy")
# "small": Hypothesis draws over a few small buckets; "production": tile-boundary sweeps
SHAPES = ("small", "production")
FEATURES = (
    "mask",
    "bias",
    "causal",
    "seq_lengths",
    "window",
    "gqa",
    "cross",
    "lse",
    "grad",
    "segment_ids",
    "softcap",
)
DEFAULT_FEATURES: dict[str, tuple[str, ...]] = {
    # what jax.nn.dot_product_attention supports
    "jax_nn": ("mask", "bias", "causal", "seq_lengths", "window", "gqa", "cross", "lse", "grad"),
    # everything a boolean mask can express, differentiable
    "qkv_mask": ("mask", "causal", "seq_lengths", "window", "cross", "grad", "segment_ids"),
    # jax.nn's options, NumPy in and out, no gradients
    "numpy": ("mask", "bias", "causal", "seq_lengths", "window", "gqa", "cross", "lse"),
}
_UNSUPPORTED: dict[str, tuple[str, ...]] = {
    "jax_nn": (),
    "qkv_mask": ("bias", "softcap", "lse"),
    "numpy": ("grad",),
}
DEFAULT_SEMANTICS = {"masked_rows": "zeros", "causal_alignment": "top_left"}
# The values each declared semantics may take: the kernel's own option names.
_CHOICES: dict[str, tuple[str, ...]] = {
    "masked_rows": MASKED_ROWS_POLICIES,
    "causal_alignment": CAUSAL_ALIGNMENTS,
    "shapes": SHAPES,
}
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
    """An invalid ``check_attention`` option: ``str(error)`` is ``check_attention``'s message.

    Args:
        message: The message.
        option: The option's name (``"signature"``, ``"features"``, ``"masked_rows"``, ...).
        value: What was given: the value, or the list of unknown names.
        accepted: The accepted values (empty where there is no list).
    """

    def __init__(
        self, message: str, option: str, value: Any, accepted: tuple[str, ...] = ()
    ) -> None:
        super().__init__(message)
        self.option = option
        self.value = value
        self.accepted = accepted


def check_signature(signature: str) -> None:
    """``signature`` must name an adapter: ``signature in SIGNATURES``.

    Args:
        signature: The adapter's name.

    Raises:
        OptionError: For an unknown signature.
    """
    if signature not in SIGNATURES:
        raise OptionError(
            f"signature must be one of {SIGNATURES}, got {signature!r}",
            "signature",
            signature,
            SIGNATURES,
        )


def check_features(features: Sequence[str]) -> None:
    """Every feature must be known: ``set(features) <= set(FEATURES)``.

    Args:
        features: The features the target declares.

    Raises:
        OptionError: Naming the unknown features (``value``: their list, in the given order).
    """
    unknown = [f for f in features if f not in FEATURES]
    if unknown:
        raise OptionError(
            f"unknown features {unknown}; choose from {FEATURES}", "features", unknown, FEATURES
        )


def check_expressible(signature: str, features: Sequence[str]) -> None:
    """The signature must be able to pass every feature (``qkv_mask`` has no bias, softcap or
    lse; ``numpy`` no gradients).

    Args:
        signature: A known adapter's name.
        features: Known feature names.

    Raises:
        OptionError: Naming the features the signature cannot express.
    """
    impossible = [f for f in features if f in _UNSUPPORTED[signature]]
    if impossible:
        raise OptionError(
            f"signature {signature!r} cannot express features {impossible} "
            f"(it has no way to pass {', '.join(impossible)})",
            "features",
            impossible,
        )


def check_choice(option: str, value: str) -> None:
    """A named choice must be known: ``masked_rows`` in ``MASKED_ROWS_POLICIES``,
    ``causal_alignment`` in ``CAUSAL_ALIGNMENTS`` (the kernel's own), ``shapes`` in ``SHAPES``.

    Args:
        option: ``"masked_rows"``, ``"causal_alignment"`` or ``"shapes"``.
        value: The declared value.

    Raises:
        OptionError: For a value the kernel does not define.
    """
    accepted = _CHOICES[option]
    if value not in accepted:
        raise OptionError(
            f"{option} must be one of {accepted}, got {value!r}", option, value, accepted
        )


def check_properties(properties: Sequence[str]) -> None:
    """Every property must be known: ``set(properties) <= set(ALL_PROPERTIES)`` (the nine of
    :data:`PROPERTIES` and the distributed kernel's :data:`DISTRIBUTED_PROPERTIES`).

    Args:
        properties: The properties asked for.

    Raises:
        OptionError: Naming the unknown properties (``value``: their list, in the given order).
    """
    bad = [p for p in properties if p not in ALL_PROPERTIES]
    if bad:
        raise OptionError(
            f"unknown properties {bad}; choose from {ALL_PROPERTIES}",
            "properties",
            bad,
            ALL_PROPERTIES,
        )


def check_dtypes(dtypes: Sequence[Any]) -> tuple[str, ...]:
    """At least one dtype, each one NumPy understands.

    Args:
        dtypes: The input dtypes (names or dtype objects).

    Returns:
        Their canonical names, e.g. ``("float32",)``.

    Raises:
        OptionError: For an empty list.
        TypeError: For a name that is not a dtype (NumPy's message).
    """
    names = tuple(str(np.dtype(d)) for d in dtypes)
    if not names:
        raise OptionError("dtypes must name at least one dtype", "dtypes", names)
    return names


def check_max_examples(max_examples: int) -> None:
    """At least one example per property: ``max_examples >= 1``.

    Args:
        max_examples: The examples per property.

    Raises:
        OptionError: For ``max_examples < 1``.
    """
    if max_examples < 1:
        raise OptionError(
            f"max_examples must be >= 1, got {max_examples}", "max_examples", max_examples
        )


def check_devices(devices: Sequence[int]) -> tuple[int, ...]:
    """Mesh sizes for a distributed kernel: positive ints, at most ``jax.device_count()``.

    Args:
        devices: The mesh sizes ``P`` to run on, e.g. ``(1, 2, 4, 8)``.

    Returns:
        The sizes, ascending, without repeats.

    Raises:
        OptionError: For an empty list, a size that is not a positive int, or more devices than
            this host has (the message says how to get virtual CPU devices).
    """
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


def length_multiple(devices: Sequence[int]) -> int:
    """``2 lcm(devices)``: sequence lengths that every layout of every mesh size divides (a
    zigzag layout cuts the sequence into ``2P`` chunks)."""
    return 2 * math.lcm(*devices)


def head_multiple(devices: Sequence[int]) -> int:
    """``lcm(devices)``: K/V head counts (and so query head counts) that every mesh size
    divides, so that a head-parallel kernel (Ulysses, tensor parallelism) can split them."""
    return math.lcm(*devices)
