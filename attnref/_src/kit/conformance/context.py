"""What the property plans draw from: the buckets (few shapes: few compiled programs), the drawn
:class:`Case`, and the :class:`Context` of one ``check_attention`` call (or mesh size)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from hypothesis import note
from hypothesis import strategies as st

from attnref import strategies as ast
from attnref import tolerance
from attnref._src.kit.conformance.references import to_target
from attnref._src.kit.conformance.targets import Target
from attnref.strategies._shapes import ShortRepr

# Conformance buckets (see Context.pool); head dims 4 make the scale 1/2 exact.
_SELF = ast.Config(batch=2, t=4, s=4, n=2, k=2, h=4, h_v=4, d_model=8)
_TALL = ast.Config(batch=1, t=5, s=3, n=2, k=2, h=4, h_v=4, d_model=8)
_GQA = ast.Config(batch=2, t=4, s=4, n=4, k=2, h=4, h_v=4, d_model=8)
_MQA = ast.Config(batch=1, t=4, s=4, n=4, k=1, h=4, h_v=4, d_model=8)
# One drawn config in TILE_SHARE takes tile-straddling lengths (Context.configs).
TILE_SHARE = 4
# One-sided padding kinds (the strategies' "padding" sets both) and the option each sets.
ONE_SIDED: dict[str, str] = {
    "query_padding": "query_seq_lengths",
    "key_padding": "key_value_seq_lengths",
}


@dataclasses.dataclass(frozen=True)
class Case(ShortRepr):
    """One drawn case of a property that builds several problems from a config and a seed."""

    config: ast.Config
    seed: int
    extra: tuple[tuple[str, Any], ...] = ()

    def __repr__(self) -> str:
        more = "".join(f", {k}={v!r}" for k, v in self.extra)
        return f"Case({self.config!r}, seed={self.seed}{more})"

    def get(self, name: str) -> Any:
        return dict(self.extra)[name]

    def has(self, name: str) -> bool:
        return any(k == name for k, _ in self.extra)


@dataclasses.dataclass
class _MergedProblem(ast.KernelProblem):
    """A kernel problem as a distributed target sees it: :meth:`bound` allows for any partition
    of the keys, any tiling, any merge order of the states ``(o, lse)``.

    That is :func:`attnref.tolerance.pieces_error_bound` with ``pieces=None``: the merge bound of
    the one-key states (every key its own piece, a merge tree of depth ``S - 1``), which covers
    every coarser partition and tree; it counts each stored partial ``lse``'s rounding (``u
    |lse|`` per level), so a correct ring passes at large logits, and keeps 16-bit inputs' states
    in float32, so a ring rounding its running state to 16 bits fails (``ring_size_growth``)."""

    def bound(self, key_blocks: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Bounds on ``|out - oracle|`` and ``|lse - oracle lse|`` (``key_blocks=None`` only)."""
        if key_blocks is not None:
            raise ValueError(
                "a distributed target's allowance assumes any tiling (key_blocks=None)"
            )
        return self.apply(tolerance.pieces_error_bound, pieces=None, tree="sequential")


@dataclasses.dataclass
class Context:
    """One target as the plans see it; a distributed target has one per mesh size ``devices``,
    ``anchor`` the target on one device, lengths times ``length_multiple`` and ``K`` a multiple
    of ``head_multiple`` (:meth:`pool`). ``ratios``: each example's worst error / allowance;
    ``calls``: ``uneven_lengths``' tally; ``sub_case``: see :meth:`at`."""

    target: Target
    signature: str
    features: frozenset[str]
    masked_rows: str
    causal_alignment: str
    dtypes: tuple[str, ...]
    devices: int | None = None
    anchor: Target | None = None
    length_multiple: int = 1
    head_multiple: int = 1
    head_dim: tuple[int, int] | None = None  # (H, H_v), declared
    ratios: list[float] = dataclasses.field(default_factory=list)
    calls: list[str] = dataclasses.field(default_factory=list)
    sub_case: str | None = None

    def at(self, sub_case: str) -> None:
        """Record the sub-case a check is at (a failure's ``Case(...)`` line names it)."""
        self.sub_case = sub_case

    @property
    def primary(self) -> str:
        """The dtype of every property but ``oracle``: float32 when requested, else the first."""
        return "float32" if "float32" in self.dtypes else self.dtypes[0]

    def pool(self, *shapes: str) -> tuple[ast.Config, ...]:
        """The buckets of the named shapes the features allow: ``"self"`` (T == S, N == K),
        ``"general"`` (T < S with ``"cross"``, N = 2K with ``"gqa"``), ``"tall"`` (T > S, with
        ``"cross"``), ``"gqa"`` (N = 2K), ``"mqa"`` (N = 4K); ``T``, ``S`` times
        :attr:`length_multiple`, ``N``, ``K`` times the least factor making ``K`` a multiple of
        :attr:`head_multiple`; ``(H, H_v) =`` :attr:`head_dim` when declared."""
        cross, gqa = "cross" in self.features, "gqa" in self.features
        general = dataclasses.replace(
            _SELF, t=3 if cross else 4, s=5 if cross else 4, n=4 if gqa else 2
        )
        named = {
            "self": _SELF,
            "general": general if cross or gqa else None,
            "tall": _TALL if cross else None,
            "gqa": _GQA if gqa else None,
            "mqa": _MQA if gqa else None,
        }
        m, h = self.length_multiple, self.head_multiple
        out = []
        for c in (named.get(name) for name in shapes):
            if c is not None:
                f = h // math.gcd(c.k, h)
                c = dataclasses.replace(c, t=c.t * m, s=c.s * m, n=c.n * f, k=c.k * f)
                d = self.head_dim
                out.append(c if d is None else dataclasses.replace(c, h=d[0], h_v=d[1]))
        return tuple(dict.fromkeys(out))

    def configs(self, pool: tuple[ast.Config, ...], dtype: str | None = None) -> Any:
        """A config from ``pool``, or with tile-straddling lengths (:meth:`mix`)."""
        return self.mix(self.small_configs(pool, dtype), self.tile_configs(pool, dtype))

    def mix(self, small: Any, tiles: Any) -> Any:
        """``small`` in ``TILE_SHARE - 1`` examples of ``TILE_SHARE``, ``tiles`` (each a new
        compiled program) in the other; a distributed target draws ``small`` alone (its lengths
        are already 48 to 80 on 8 devices, and ``uneven_lengths`` asks its length question)."""
        if self.devices is not None:
            return small
        return st.one_of(*[small] * (TILE_SHARE - 1), tiles)

    def small_configs(self, pool: tuple[ast.Config, ...], dtype: str | None = None) -> Any:
        return ast.configs(
            buckets=pool,
            dtypes=(dtype or self.primary,),
            cross=True,
            gqa=True,
            value_dim_differs=True,
        )

    def tile_configs(self, pool: tuple[ast.Config, ...], dtype: str | None = None) -> Any:
        """A config from ``pool`` with ``T``, ``S`` from :data:`attnref.strategies.TILE_LENGTHS`."""
        return self.small_configs(pool, dtype).flatmap(ast.tile_configs)

    def problem(self, config: ast.Config, kind: str, seed: int, **kw: Any) -> ast.KernelProblem:
        """:func:`attnref.strategies.make_kernel_problem` with the declared semantics; a kind of
        :data:`ONE_SIDED` is ``"none"`` with that one length option drawn from ``seed``."""
        p = ast.make_kernel_problem(
            config,
            "none" if kind in ONE_SIDED else kind,
            seed,
            masked_rows=self.masked_rows,
            causal_alignment=self.causal_alignment,
            **kw,
        )
        if kind in ONE_SIDED:
            name = ONE_SIDED[kind]
            top = config.t if name == "query_seq_lengths" else config.s
            lens = np.random.default_rng([seed, 3]).integers(1, top + 1, size=config.b)
            p = p.replace(options={name: lens.astype(np.int32)}, kind=kind)
        return p

    def kinds(self, candidates: Sequence[str]) -> tuple[str, ...]:
        """The ``candidates`` whose features the target declares."""
        need = {**ast.KIND_FEATURES, **{k: (o,) for k, o in ONE_SIDED.items()}}
        return tuple(k for k in candidates if set(need[k]) <= self.features)

    def run(self, p: ast.KernelProblem, want_lse: bool = False) -> tuple[np.ndarray, Any]:
        return self.target.forward(to_target(p, self.signature), want_lse)

    def compile_ahead(self, p: ast.KernelProblem, want_lse: bool = False) -> None:
        """:meth:`run`'s program compiled now (:meth:`Target.compile_ahead`)."""
        self.target.compile_ahead(to_target(p, self.signature), want_lse)

    def view(self, p: ast.KernelProblem) -> ast.KernelProblem:
        """The problem as the target sees it (a :class:`_MergedProblem` when distributed)."""
        p = to_target(p, self.signature)
        if self.devices is None:
            return p
        return _MergedProblem(**{f.name: getattr(p, f.name) for f in dataclasses.fields(p)})


@st.composite
def case_strategy(draw: ast.DrawFn, configs: Any, **extras: Any) -> Case:
    config = draw(configs, label="config")
    extra = tuple((name, draw(strategy, label=name)) for name, strategy in extras.items())
    seed = draw(st.integers(0, 2**32 - 1), label="data seed")
    note(f"config={config!r} seed={seed} " + " ".join(f"{k}={v!r}" for k, v in extra))
    return Case(config, seed, extra)


Check = Callable[[Any], None]
# (strategy, check) or (strategy, check, explicit cases run first), or a skip reason (str)
Plan = tuple[Any, Check] | tuple[Any, Check, tuple[Any, ...]]
