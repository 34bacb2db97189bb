"""Feature maps ``phi`` for linear (kernel) attention: ``exp(q.k)`` replaced by ``phi(q).phi(k)``.

The maps (``elu_plus_one``, ``relu``, ``identity``, ``taylor2``, ``favor_plus``; Katharopoulos
et al. 2020, Choromanski et al. 2021) and FAVOR+'s leak-free stabilisation (keys shifted by the
data-independent ``|w_i|^2 / 2``, queries by their own max ``c_q``, ``eps`` rescaled by
``exp(-c_q)``) are in ``docs/linear_attention.md``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float

from attnref._src.core.checks import HIGHEST

Role = Literal["query", "key"]
MAP_NAMES = ("elu_plus_one", "relu", "identity", "taylor2", "favor_plus")


@runtime_checkable
class FeatureMapLike(Protocol):
    """What the linear forms accept as ``feature_map``: a :class:`FeatureMap`, or any object with
    ``name``, ``__call__(x, role)`` and ``num_features(d)`` (:func:`check_feature_map`)."""

    name: str

    def __call__(self, x: Any, role: Role) -> Any: ...

    def num_features(self, d: int) -> int: ...


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FeatureMap:
    """A feature map for linear attention (a pytree: ``omega`` is data, the rest is static);
    build one with a factory (:func:`elu_plus_one`, ..., :func:`favor_plus`).

    Attributes:
        name: One of ``"elu_plus_one"``, ``"relu"``, ``"identity"``, ``"taylor2"``,
            ``"favor_plus"`` (static).
        omega: FAVOR+'s random projections ``[m, d]`` (``None`` for every other map).
        orthogonal: Whether FAVOR+'s projections are in orthogonal blocks (static).

    Raises:
        ValueError: On construction, for an unknown ``name``, or ``omega`` given for a map
            other than ``favor_plus`` (or missing for it).
    """

    name: str = dataclasses.field(metadata=dict(static=True))
    # Any: JAX rebuilds the pytree with any leaves (tree_map results, ArgInfo when lowering).
    omega: Any = None
    orthogonal: bool = dataclasses.field(default=False, metadata=dict(static=True))

    def __post_init__(self) -> None:
        if self.name not in MAP_NAMES:
            raise ValueError(f"unknown feature map {self.name!r}; known: {MAP_NAMES}")
        if (self.name == "favor_plus") != (self.omega is not None):
            raise ValueError("favor_plus needs omega [m, d]; other maps take none")

    @property
    def positive(self) -> bool:
        """Whether ``phi(q).phi(k) > 0`` for all inputs (so non-empty denominators are > 0)."""
        return self.name in ("elu_plus_one", "taylor2", "favor_plus")

    def num_features(self, d: int) -> int:
        """The feature count ``m`` for inputs of dimension ``d``."""
        if self.name == "favor_plus":
            return int(np.shape(self.omega)[0])
        return 1 + d + d * d if self.name == "taylor2" else d

    def __call__(self, x: Float[ArrayLike, "... d"], role: Role) -> Float[Array, "... m"]:
        """Features of the last axis of ``x``; ``role`` matters only for FAVOR+ stabilisation
        (for queries this is ``query_features(x)[0]``)."""
        if role not in ("query", "key"):
            raise ValueError(f"role must be 'query' or 'key', got {role!r}")
        if role == "query":
            return self.query_features(x)[0]
        return self._features(jnp.asarray(x))

    def query_features(
        self, x: Float[ArrayLike, "... d"]
    ) -> tuple[Float[Array, "... m"], Float[Array, "..."]]:
        """``(phi~(x), c(x))`` with ``phi~(q).phi~(k) = exp(-c(q)) phi(q).phi(k)``; ``c = 0`` but
        for FAVOR+, ``c(q) = max_i(w_i.q~ + |w_i|^2/2) - |q~|^2/2``."""
        x = jnp.asarray(x)
        if self.name != "favor_plus":
            return self._features(x), jnp.zeros(x.shape[:-1], x.dtype)
        w = self._omega_for(x)
        xs = x * jnp.asarray(x.shape[-1] ** -0.25, x.dtype)
        expo = jnp.einsum("...d,md->...m", xs, w, precision=HIGHEST) + 0.5 * jnp.sum(w * w, axis=-1)
        top = jnp.max(expo, axis=-1, keepdims=True)  # part of phi~: no stop_gradient
        phi = jnp.exp(expo - top) * jnp.asarray(w.shape[0] ** -0.5, x.dtype)
        return phi, top[..., 0] - 0.5 * jnp.sum(xs * xs, axis=-1)

    def _omega_for(self, x: Array) -> Array:
        w = jnp.asarray(self.omega, x.dtype)
        if w.shape[1] != x.shape[-1]:
            raise ValueError(f"favor_plus omega has shape {w.shape}; inputs have d={x.shape[-1]}")
        return w

    def _features(self, x: Array) -> Array:
        """The features of ``x`` (for FAVOR+, of keys: its queries' are :meth:`query_features`)."""
        d = x.shape[-1]
        if self.name == "elu_plus_one":
            return jax.nn.elu(x) + 1
        if self.name == "relu":
            return jax.nn.relu(x)
        if self.name == "identity":
            return x
        xs = x * jnp.asarray(d**-0.25, x.dtype)
        if self.name == "taylor2":
            outer = (xs[..., :, None] * xs[..., None, :]).reshape(*x.shape[:-1], d * d)
            ones = jnp.ones((*x.shape[:-1], 1), x.dtype)
            return jnp.concatenate([ones, xs, outer * jnp.asarray(0.5**0.5, x.dtype)], axis=-1)
        w = self._omega_for(x)
        proj = jnp.einsum("...d,md->...m", xs, w, precision=HIGHEST)
        # exp(-|k~ - w|^2 / 2) <= 1; queries carry the compensating +|w|^2/2 (query_features)
        expo = proj - 0.5 * jnp.sum(xs * xs, axis=-1, keepdims=True) - 0.5 * jnp.sum(w * w, -1)
        return jnp.exp(expo) * jnp.asarray(w.shape[0] ** -0.5, x.dtype)

    def kernel(
        self, q: Float[ArrayLike, "... d"], k: Float[ArrayLike, "... d"]
    ) -> Float[Array, "..."]:
        """The kernel estimate ``phi(q).phi(k)`` *without* stabilisation (for statistics).

        Raises:
            ValueError: If ``q`` and ``k`` differ in their last (feature) dimension.
        """
        q, k = jnp.asarray(q), jnp.asarray(k)
        if q.shape[-1:] != k.shape[-1:]:
            raise ValueError(
                f"q and k need the same last dimension d, got q {q.shape} and k {k.shape}"
            )
        if self.name != "favor_plus":
            return jnp.sum(self(q, "query") * self(k, "key"), axis=-1)
        d = q.shape[-1]
        w = jnp.asarray(self.omega, q.dtype)
        qs, ks = q * d**-0.25, k * d**-0.25
        expo = (
            jnp.einsum("...d,md->...m", qs + ks, w, precision=HIGHEST)
            - 0.5 * jnp.sum(qs * qs, -1, keepdims=True)
            - 0.5 * jnp.sum(ks * ks, -1, keepdims=True)
        )
        return jnp.mean(jnp.exp(expo), axis=-1)


def elu_plus_one() -> FeatureMap:
    """``phi(x) = elu(x) + 1`` (Katharopoulos et al. 2020): positive, ``m = d`` features."""
    return FeatureMap("elu_plus_one")


def relu_features() -> FeatureMap:
    """``phi(x) = max(x, 0)``: non-negative (a denominator can be 0), ``m = d`` features."""
    return FeatureMap("relu")


def identity_features() -> FeatureMap:
    """``phi(x) = x``: signed (denominators can vanish), ``m = d`` features."""
    return FeatureMap("identity")


def taylor2() -> FeatureMap:
    """``phi(x) = [1, x~, vec(x~ x~^T) / sqrt(2)]``, ``x~ = x / d^(1/4)``, ``m = 1 + d + d^2``:
    ``phi(q).phi(k) = 1 + s + s^2 / 2 > 0``, ``s = q.k / sqrt(d)``."""
    return FeatureMap("taylor2")


def favor_plus(seed: int, d: int, num_features: int, *, orthogonal: bool = True) -> FeatureMap:
    """FAVOR+ with ``num_features`` random projections of dimension ``d`` (Choromanski et al.
    2021, section 2.4: orthogonal blocks by QR, rows rescaled to marginally ``N(0, I_d)``).

    Args:
        seed: Seed of NumPy's ``default_rng`` (PCG64); the same seed gives the same map.
        d: The input dimension (the head dim ``d_k``), ``>= 1``.
        num_features: The number of random features ``m``, ``>= 1``.
        orthogonal: Orthogonal blocks with chi-distributed norms (default), else i.i.d. rows.

    Returns:
        The positive :class:`FeatureMap` ``"favor_plus"`` with float64 ``omega [m, d]``.

    Raises:
        ValueError: If ``d < 1`` or ``num_features < 1``.
    """
    if d < 1 or num_features < 1:
        raise ValueError(f"need d >= 1 and num_features >= 1, got d={d}, {num_features}")
    rng = np.random.default_rng(seed)
    if not orthogonal:
        return FeatureMap("favor_plus", rng.standard_normal((num_features, d)), False)
    blocks = []
    for _ in range(math.ceil(num_features / d)):
        q, r = np.linalg.qr(rng.standard_normal((d, d)))
        q = q * np.sign(np.diag(r))  # Haar-distributed orthogonal matrix
        blocks.append(q.T)
    directions = np.concatenate(blocks)[:num_features]
    norms = np.linalg.norm(rng.standard_normal((num_features, d)), axis=-1)
    return FeatureMap("favor_plus", directions * norms[:, None], True)


def feature_map_from_name(
    name: str, *, seed: int = 0, d: int | None = None, num_features: int | None = None
) -> FeatureMap:
    """The feature map called ``name`` (one of :data:`MAP_NAMES`); ``"favor_plus"`` is drawn
    (orthogonal) from ``seed``, ``d`` and ``num_features``, which the others ignore."""
    if name == "favor_plus":
        if d is None or num_features is None:
            raise ValueError("favor_plus needs d and num_features (and a seed)")
        return favor_plus(seed, d, num_features)
    return FeatureMap(name)


_FACTORIES = ("elu_plus_one", "relu_features", "identity_features", "taylor2")
_FACTORY_CALLS = {name: f"{name}()" for name in _FACTORIES}
_FACTORY_CALLS["favor_plus"] = "favor_plus(seed, d, num_features)"


def check_feature_map(fm: object) -> None:
    """Raise a ``TypeError`` unless ``fm`` is a :class:`FeatureMapLike` (an uncalled factory gets
    a message that says to call it)."""
    if isinstance(fm, FeatureMap):
        return
    name = getattr(fm, "__name__", None)
    if callable(fm) and name in _FACTORY_CALLS and not hasattr(fm, "num_features"):
        raise TypeError(
            f"feature_map must be a FeatureMap; got the factory function {name} itself: call it, "
            f"feature_map=attnref.linear.{_FACTORY_CALLS[name]}"
        )
    if not (callable(fm) and hasattr(fm, "num_features") and hasattr(fm, "name")):
        raise TypeError(
            "feature_map must be a FeatureMap (e.g. attnref.linear.elu_plus_one()), "
            f"got {type(fm).__name__}"
        )
