"""The conformance kit for a user's merge of attention states: :func:`check_merge_states`.

The target is ``merge(o_a, lse_a, o_b, lse_b) -> (o, lse)`` (:func:`attnref.merge_states`'
signature; NumPy in, anything :func:`numpy.asarray` reads out). Each property
(:data:`MERGE_PROPERTIES`: ``oracle``, ``commutative``, ``associative``, ``identity``,
``stability``, ``dtypes``, ``gradients``; ``docs/states.md`` says what each checks) is a
Hypothesis test over :func:`attnref.strategies.attention_states` comparing with the float64 oracle
:func:`attnref.oracle.merge_state_stack` within :func:`attnref.tolerance.merge_error_bound` (the
gradients with :func:`attnref.oracle.merge_states_vjp` within
:func:`attnref.tolerance.merge_grad_error_bound`); a row where every state is empty must come back
empty (``lse = -inf``, ``o`` per ``masked_rows``), its gradients exactly 0.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st

from attnref import oracle
from attnref import strategies as ast
from attnref._src.kit.closeness import assert_ratio_within, first_index
from attnref._src.kit.conformance.engine import changed, check_target, planned, run_suite
from attnref._src.kit.conformance.options import OptionError, check_properties, check_subset
from attnref._src.kit.conformance.report import ConformanceReport
from attnref._src.kit.conformance.targets import describe_target, x64_if
from attnref.oracle import merge_states_vjp
from attnref.oracle._states import STATE_POLICIES
from attnref.strategies._states import STATE_DTYPES, as_dtype
from attnref.tolerance import merge_grad_error_bound

MERGE_PROPERTIES = (
    "oracle",
    "commutative",
    "associative",
    "identity",
    "stability",
    "dtypes",
    "gradients",
)
MERGE_DTYPES = STATE_DTYPES
_SHAPE = (((2, 3), 4),)  # one (rows, H_v) bucket: a jitted target compiles one program per dtype


def _formats(dtypes: Sequence[str]) -> tuple[tuple[str, str], ...]:
    """``(o dtype, lse dtype)`` pairs: each format, and a 16-bit ``o`` with float32 ``lse``."""
    return tuple(
        f for d in dtypes for f in ((d, d), (d, "float32"))[: 2 if as_dtype(d).itemsize == 2 else 1]
    )


def _cast(s: ast.StateStack, o_dt: str, l_dt: str) -> ast.StateStack:
    return dataclasses.replace(s, o=s.o.astype(as_dtype(o_dt)), lse=s.lse.astype(as_dtype(l_dt)))


class _Merge:
    """Calls the target on NumPy states, ``(o, lse)`` back as float64; :meth:`vjp`: jax.vjp."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.jitted_pull = jax.jit(self._pull)
        self.eager = False  # set once the target fails to trace under jit

    def __call__(self, o_a: Any, l_a: Any, o_b: Any, l_b: Any) -> tuple[np.ndarray, np.ndarray]:
        with x64_if(o_a, l_a, o_b, l_b):
            o, lse = (np.asarray(x).astype(np.float64) for x in self._pair(o_a, l_a, o_b, l_b))
        return o, lse

    def _pair(self, *states: Any) -> tuple[Any, Any]:
        out = self.fn(*states)
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise AssertionError(f"merge must return a pair (o, lse), got {type(out).__name__}")
        o, lse = out[0], out[1]
        if np.shape(o) != np.shape(states[0]) or np.shape(lse) != np.shape(states[1]):
            raise AssertionError(
                f"merge returned o {np.shape(o)} and lse {np.shape(lse)}; expected o "
                f"{np.shape(states[0])} and lse {np.shape(states[1])} (the inputs' shapes)"
            )
        return o, lse

    def _pull(self, states: tuple[Any, ...], cot: tuple[Any, Any]) -> tuple[Any, ...]:
        (o, lse), pull = jax.vjp(self._pair, *states)
        return tuple(pull((cot[0].astype(o.dtype), cot[1].astype(lse.dtype))))

    def vjp(
        self, o_a: Any, l_a: Any, o_b: Any, l_b: Any, g_o: np.ndarray, g_l: np.ndarray
    ) -> tuple[np.ndarray, ...]:
        """``(d o_a, d lse_a, d o_b, d lse_b)`` as float64 for the cotangents ``(g_o, g_l)``,
        jitted (eagerly for a target that cannot be traced)."""
        with x64_if(o_a, l_a, o_b, l_b):
            states = tuple(jnp.asarray(x) for x in (o_a, l_a, o_b, l_b))
            cot = (jnp.asarray(g_o), jnp.asarray(g_l))
            try:
                if not self.eager:
                    try:
                        grads = self.jitted_pull(states, cot)
                    except (
                        jax.errors.ConcretizationTypeError,
                        jax.errors.TracerArrayConversionError,
                        jax.errors.TracerIntegerConversionError,
                    ):
                        self.eager = True
                if self.eager:
                    grads = self._pull(states, cot)
            except jax.errors.TracerArrayConversionError:
                raise AssertionError(
                    "jax.vjp cannot differentiate the merge: it converts its inputs to NumPy "
                    "arrays (TracerArrayConversionError). A NumPy merge has no JAX gradient: "
                    "declare it with grad=False (attnref check-merge --no-grad) to skip this "
                    "property"
                ) from None
            return tuple(np.asarray(g).astype(np.float64) for g in grads)


def _merge_tree(merge: _Merge, tree: ast.Tree, s: ast.StateStack) -> tuple[Any, Any]:
    """``tree`` evaluated with ``merge``, each intermediate cast back to the states' formats."""
    if isinstance(tree, tuple):
        o, lse = merge(*_merge_tree(merge, tree[0], s), *_merge_tree(merge, tree[1], s))
        return o.astype(s.o.dtype), lse.astype(s.lse.dtype)
    return s.o[tree], s.lse[tree]


def _check_state(
    got: tuple[np.ndarray, np.ndarray], s: ast.StateStack, tree: str | int, policy: str, label: str
) -> None:
    """``got`` is the oracle merge of ``s`` within the bound of ``tree``, empty rows empty."""
    o, lse = got
    ref_o, ref_l = oracle.merge_state_stack(s.o, s.lse, masked_rows=policy)
    o_b, l_b = s.bound(tree)
    empty = np.isneginf(ref_l)
    if (idx := first_index(empty & ~np.isneginf(lse))) is not None:
        raise AssertionError(
            f"{label}: every state of row {idx} is empty (lse = -inf), so the merge is empty; "
            f"got lse {lse[idx]!r}"
        )
    bad_fill = empty[..., None] & (~np.isnan(o) if policy == "nan" else (o != 0))
    if (idx := first_index(bad_fill)) is not None:
        want = "NaN" if policy == "nan" else "0"
        raise AssertionError(
            f"{label}: row {idx[:-1]} is empty; masked_rows={policy!r} wants o = {want}, "
            f"got {o[idx]!r}"
        )
    live = ~empty
    sides = (("lse", lse, ref_l, l_b, live), ("o", o, ref_o, o_b, live[..., None]))
    for name, x, ref, _, mask in sides:
        if (idx := first_index(mask & ~np.isfinite(x))) is not None:
            raise AssertionError(
                f"{label}: non-finite {name} {x[idx]!r} at index {idx} where the oracle has "
                f"{ref[idx]!r}"
            )
    for name, x, ref, b, mask in sides:
        _within(x, ref, b, mask, f"{label}: |{name} - oracle|", "bound")


def _within(x: Any, ref: Any, b: Any, mask: Any, what: str, bound: str) -> None:
    assert_ratio_within(
        np.abs(np.where(mask, x, 0.0) - np.where(mask, ref, 0.0)),
        np.where(mask, b, 0.0),
        "{what} = {error:.3e} at index {index} exceeds the derived {bound} {allowed:.3e} "
        "({ratio:.3g} x); got {got!r}, oracle {want!r}",
        what=what,
        bound=bound,
        got=x,
        want=ref,
    )


_GRAD_NAMES = ("o_a", "lse_a", "o_b", "lse_b")


def _check_gradients(
    got: tuple[np.ndarray, ...], s: ast.StateStack, g_o: np.ndarray, g_l: np.ndarray, label: str
) -> None:
    """``(d o_a, d lse_a, d o_b, d lse_b)`` within the bound, 0 for empty states and rows."""
    states = (*s.state(0), *s.state(1))
    want = merge_states_vjp(*states, g_o, g_l)
    bounds = merge_grad_error_bound(*states, g_o, g_l, dtype=s.dtype, lse_dtype=s.lse_dtype)
    both = np.asarray(np.isneginf(s.lse).all(axis=0))  # rows where every state is empty
    for i, (name, x, ref, b) in enumerate(zip(_GRAD_NAMES, got, want, bounds, strict=True)):
        empty = np.isneginf(s.lse[i // 2])
        zero = empty if name.startswith("lse") else empty[..., None]
        if (idx := first_index(zero & (x != 0))) is not None:
            where = (
                "both states are empty (the merge is the constant empty state)"
                if both[idx[: both.ndim]]
                else f"state {name[-1]} is empty (lse = -inf: weight 0, its o never read)"
            )
            raise AssertionError(
                f"{label}: d/d{name} = {x[idx]!r} at index {idx}, where {where}, so the gradient "
                "is exactly 0"
            )
        defined = np.isfinite(ref)
        if (idx := first_index(defined & ~np.isfinite(x))) is not None:
            raise AssertionError(
                f"{label}: non-finite d/d{name} {x[idx]!r} at index {idx} where the oracle's "
                f"gradient is {ref[idx]!r}"
            )
        _within(x, ref, b, defined, f"{label}: |d/d{name} - oracle|", "gradient bound")


def _with_empty_states(s: ast.StateStack) -> ast.StateStack:
    """``s`` with row ``(0, 0)`` empty in both states, ``(0, 1)`` in ``a``, ``(1, 0)`` in ``b``."""
    o, lse = s.o.copy(), s.lse.copy()
    for p, row in ((0, (0, 0)), (1, (0, 0)), (0, (0, 1)), (1, (1, 0))):
        lse[(p, *row)] = -np.inf
        o[(p, *row)] = np.nan
    return dataclasses.replace(s, o=o, lse=lse)


def _agree(a: Any, b: Any, allowed: Any, label: str, message: str, **fields: Any) -> None:
    """Two ``(o, lse)`` with NaN and infinities alike, elsewhere within ``allowed``."""
    for i, what in ((1, "lse"), (0, "o")):
        x, y = (np.asarray(g[i], np.float64) for g in (a, b))
        for kind, f in (("NaN", np.isnan), ("-inf", np.isneginf), ("+inf", np.isposinf)):
            if (idx := first_index(f(x) != f(y))) is not None:
                raise AssertionError(
                    f"{label}, {what}: {kind} at {idx} in one result only: {x[idx]!r} vs {y[idx]!r}"
                )
        ok = np.isfinite(x) & np.isfinite(y)
        err = np.abs(np.where(ok, x, 0.0) - np.where(ok, y, 0.0))
        assert_ratio_within(err, allowed[i], message, what=what, **fields)


def _states(
    pieces: tuple[int, int],
    dtype: str,
    *,
    spreads: tuple[str, ...] = ast.SPREADS,
    centers: tuple[float, ...] = ast.CENTERS,
    empty: bool = True,
) -> Any:
    return ast.attention_states(
        min_pieces=pieces[0],
        max_pieces=pieces[1],
        shapes=_SHAPE,
        dtypes=(dtype,),
        lse_dtypes=(dtype,) if as_dtype(dtype).itemsize != 2 else None,
        spreads=spreads,
        centers=centers,
        empty=empty,
    )


@st.composite
def _tree_cases(draw: ast.DrawFn, states: Any) -> tuple[ast.StateStack, ast.Tree, ast.Tree]:
    s = draw(states, label="states")
    first = draw(ast.merge_trees(s.pieces), label="first tree")
    second = draw(ast.merge_trees(s.pieces), label="second tree")
    return s, first, second


def _explicit(dtype: str, spread: str, center: float, pieces: int = 2) -> ast.StateStack:
    rows, h_v = _SHAPE[0]
    return ast.make_state_stack(pieces, rows, h_v, 1, dtype=dtype, spread=spread, center=center)


def _plan(name: str, merge: _Merge, policy: str, dtypes: tuple[str, ...]) -> tuple[Any, ...]:
    """``(strategy, check, explicit cases)`` of property ``name``."""
    primary = "float32" if "float32" in dtypes else dtypes[0]

    def check_one(s: ast.StateStack) -> None:
        _check_state(merge(*s.state(0), *s.state(1)), s, 1, policy, "merge(a, b)")

    if name == "oracle":
        spreads = ("tied", "small", "large")
        return _states((2, 2), primary, spreads=spreads, centers=(0.0,)), check_one, ()
    if name == "commutative":

        def check_comm(s: ast.StateStack) -> None:
            ab = merge(*s.state(0), *s.state(1))
            ba = merge(*s.state(1), *s.state(0))
            o_b, l_b = s.bound(1)
            _agree(
                ab,
                ba,
                (2.0 * o_b, 2.0 * l_b),
                "merge(a, b) vs merge(b, a)",
                "merge(a, b) and merge(b, a) differ in {what} by {error:.3e} at {index}, "
                "more than twice the bound of one merge ({allowed:.3e})",
            )

        return _states((2, 2), primary), check_comm, (_explicit(primary, "large", 1e4),)
    if name == "associative":
        strategy = _tree_cases(_states((3, 5), primary))

        def check_assoc(case: tuple[ast.StateStack, ast.Tree, ast.Tree]) -> None:
            s, t1, t2 = case
            got1, got2 = _merge_tree(merge, t1, s), _merge_tree(merge, t2, s)
            d1, d2 = ast.tree_depth(t1), ast.tree_depth(t2)
            _check_state(got1, s, d1, policy, f"tree {t1!r}")
            _check_state(got2, s, d2, policy, f"tree {t2!r}")
            b1, b2 = s.bound(d1), s.bound(d2)
            _agree(
                got1,
                got2,
                (b1[0] + b2[0], b1[1] + b2[1]),
                f"trees {t1!r} and {t2!r}",
                "trees {t1} and {t2} differ in {what} by {error:.3e} at {index}, more than "
                "the sum of their bounds ({allowed:.3e})",
                t1=repr(t1),
                t2=repr(t2),
            )

        return strategy, check_assoc, ()
    if name == "identity":

        def check_identity(s: ast.StateStack) -> None:
            o_e = np.full_like(s.o[0], np.nan)
            l_e = np.full_like(s.lse[0], -np.inf)
            pair = dataclasses.replace(s, o=np.stack([s.o[0], o_e]), lse=np.stack([s.lse[0], l_e]))
            _check_state(merge(*s.state(0), o_e, l_e), pair, 1, policy, "merge(a, empty)")
            _check_state(merge(o_e, l_e, *s.state(0)), pair, 1, policy, "merge(empty, a)")
            both = dataclasses.replace(s, o=np.stack([o_e, o_e]), lse=np.stack([l_e, l_e]))
            _check_state(merge(o_e, l_e, o_e, l_e), both, 1, policy, "merge(empty, empty)")

        return _states((1, 1), primary), check_identity, ()
    if name == "stability":
        strategy = _states((2, 2), primary, spreads=("large", "huge"), empty=False)
        explicit = (_explicit(primary, "large", 1e4), _explicit(primary, "huge", 0.0))
        return strategy, check_one, explicit
    if name == "gradients":

        def check_gradients(s: ast.StateStack) -> None:
            rng = np.random.default_rng([s.seed, 1])
            g_o = rng.standard_normal(s.o.shape[1:]).astype(s.dtype)
            g_l = rng.standard_normal(s.lse.shape[1:]).astype(s.lse_dtype)
            got = merge.vjp(*s.state(0), *s.state(1), g_o, g_l)
            _check_gradients(got, s, g_o, g_l, "gradients of merge(a, b)")

        explicit = (
            _with_empty_states(_explicit(primary, "tied", 0.0)),
            _explicit(primary, "large", 1e4),
        )
        return _states((2, 2), primary), check_gradients, explicit

    formats = _formats(dtypes)

    def check_dtypes(s: ast.StateStack) -> None:
        for o_dt, l_dt in formats:
            c = _cast(s, o_dt, l_dt)
            label = f"merge(a, b) with o {o_dt}, lse {l_dt}"
            _check_state(merge(*c.state(0), *c.state(1)), c, 1, policy, label)

    return _states((2, 2), "float64"), check_dtypes, (_explicit("float64", "large", -1e4),)


def check_merge_states(
    merge: Callable[..., Any],
    *,
    max_examples: int | None = None,
    seed: int = 0,
    dtypes: Sequence[str] = MERGE_DTYPES,
    masked_rows: str = "zeros",
    properties: Sequence[str] | None = None,
    target: str | None = None,
    progress: Callable[[int, int, str], None] | None = None,
    grad: bool = True,
) -> ConformanceReport:
    """Run the state-algebra properties (module docstring) against ``merge(o_a, lse_a, o_b,
    lse_b) -> (o, lse)`` (``o [..., H_v]``, ``lse [...]``, NumPy in): a
    :class:`ConformanceReport` (signature ``"merge_states"``).

    ``dtypes``: the ``dtypes`` property's formats (default :data:`MERGE_DTYPES`); the others run
    in float32 when requested, else the first. ``masked_rows``: the ``o`` of a merge of empty
    states (``"zeros"`` or ``"nan"``). ``grad=False``: a merge ``jax.vjp`` cannot differentiate
    (``gradients`` skipped). ``max_examples`` (``None``: 20), ``seed``, ``properties``,
    ``target`` and ``progress`` as in :func:`check_attention`. Raises ``ValueError`` (an
    ``OptionError``) for an unknown property, dtype or ``masked_rows``, no dtypes or
    ``max_examples < 1``; ``TypeError`` for ``merge`` not callable or ``grad`` not a bool.
    """
    if masked_rows not in STATE_POLICIES:
        raise OptionError(
            f"masked_rows must be one of {STATE_POLICIES} for a merge of states, got "
            f"{masked_rows!r}",
            "masked_rows",
            masked_rows,
            STATE_POLICIES,
        )
    names = check_properties(properties, MERGE_PROPERTIES)
    dts = check_subset("dtypes", dtypes, MERGE_DTYPES)
    check_target(merge, max_examples, "merge")
    if not isinstance(grad, bool):
        raise TypeError(f"grad must be a bool, got {type(grad).__name__}")
    declared = {"masked_rows": masked_rows} if masked_rows != "zeros" else {}
    target_merge = _Merge(merge)

    def plan(name: str) -> tuple[Any, ...] | str:
        if name == "gradients" and not grad:
            return "needs gradient support (grad=False: a merge JAX cannot differentiate)"
        return _plan(name, target_merge, masked_rows, dts)

    # no empty row in stability; a gradient is 0 on empty rows whatever their o
    def in_effect(name: str) -> tuple[str, ...]:
        skip = name in ("stability", "gradients")
        return tuple(f"{k}={v}" for k, v in declared.items() if not skip)

    run = planned(plan, seed=seed, max_examples=max_examples or 20, in_effect=in_effect)
    results = run_suite(names, run, seed=seed, progress=progress)
    return ConformanceReport(
        target=target or describe_target(merge),
        signature="merge_states",
        features=("grad",) if grad else (),
        declared=declared,
        results=results,
        options=changed(
            ("max_examples", max_examples, None),
            ("dtypes", list(dts), list(MERGE_DTYPES)),
            ("masked_rows", masked_rows, "zeros"),
            ("grad", grad, True),
        ),
    )
