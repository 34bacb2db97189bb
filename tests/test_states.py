"""The attention state algebra: merging states ``(o, lse)`` of disjoint key sets.

Outside truth first: a hand-worked example (logits 0, ln 2, ln 3) and the float64 oracle's own
kernel (merging ``oracle.dot_product_attention`` over a key partition equals the whole call).
Then the JAX merges (binary and stacked; jit and no-jit; their gradients against the analytic
derivative) against the NumPy oracle merge within the derived bound
:func:`attnref.tolerance.merge_error_bound`; partitions of drawn kernel problems computed piece by
piece with :func:`attnref.dot_product_attention` in float32/float64/bfloat16/float16 and merged
in random orders and groupings, against the oracle of the whole call; and the kit
(:func:`check_merge_states`) passing attnref's merge and catching the naive one, and its
``gradients`` property: the float64 gradient oracle of a merge (derived by hand) against worked
numbers and finite differences, and the kit catching merges that are exact forward but whose
gradients are wrong (weights behind ``stop_gradient``; ``log(0)`` on an empty row).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import find, given, note, settings
from hypothesis import strategies as st

import attnref
from attnref import merge_state_stack, merge_states, oracle, tolerance
from attnref import strategies as ast
from attnref.oracle import merge_states_vjp
from attnref.strategies import STATIC_OPTIONS
from attnref.testing import MERGE_PROPERTIES, assert_ratio_within, check_merge_states
from attnref.tolerance import merge_grad_error_bound

_MERGE = jax.jit(merge_states, static_argnames="masked_rows")
_STACK = jax.jit(merge_state_stack, static_argnames=("axis", "masked_rows"))
_KERNEL = jax.jit(attnref.dot_product_attention, static_argnames=STATIC_OPTIONS)
U64 = float(np.finfo(np.float64).eps) / 2


def _merges(jit):
    return (_MERGE, _STACK) if jit else (merge_states, merge_state_stack)


def _assert_state(o, lse, ref_o, ref_l, o_b, l_b, label):
    """NaN, -inf and the empty fill where the oracle has them; elsewhere within the bounds."""
    o, lse = np.asarray(o, np.float64), np.asarray(lse, np.float64)
    for what, f in (("NaN", np.isnan), ("-inf", np.isneginf)):
        np.testing.assert_array_equal(f(lse), f(ref_l), err_msg=f"{label}: {what} in lse")
        np.testing.assert_array_equal(f(o), f(ref_o), err_msg=f"{label}: {what} in o")
    for name, x, ref, b in (("lse", lse, ref_l, l_b), ("o", o, ref_o, o_b)):
        ok = np.isfinite(ref)
        assert np.all(np.isfinite(x[ok])), f"{label}: non-finite {name} where the oracle is finite"
        assert np.all(x[~ok & ~np.isnan(ref)] == ref[~ok & ~np.isnan(ref)]), label
        assert_ratio_within(
            np.abs(np.where(ok, x, 0.0) - np.where(ok, ref, 0.0)),
            np.where(ok, b, 0.0),
            f"{label}: |{name} - oracle| = {{error:.3e}} > bound {{allowed:.3e}} at {{index}}",
        )


# ----------------------------------------------------------------------------- outside truth


def _hand_pieces():
    """One query, three keys with logits 0, ln 2, ln 3 (weights 1, 2, 3: lse = ln 6) and
    values 1, 2, 3 (o = (1 + 4 + 9) / 6 = 7/3). Pieces {0, 1} and {2}: lse ln 3 and ln 3,
    o 5/3 and 3. Pieces {0} and {1, 2}: lse 0 and ln 5, o 1 and 13/5."""
    q = np.ones((1, 1, 1, 1))
    k = np.array([0.0, math.log(2.0), math.log(3.0)]).reshape(1, 3, 1, 1)
    v = np.array([1.0, 2.0, 3.0]).reshape(1, 3, 1, 1)
    return q, k, v


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize(
    "split, want",
    [
        ((True, True, False), ((math.log(3.0), 5 / 3), (math.log(3.0), 3.0))),
        ((True, False, False), ((0.0, 1.0), (math.log(5.0), 13 / 5))),
    ],
)
@pytest.mark.parametrize("shift", [0.0, 1e4])
def test_hand_worked_example(jit, split, want, shift):
    """Pieces from the oracle kernel equal the hand values, and every merge gives lse = ln 6
    (+ shift) and o = 7/3. Allowances: the pieces' float64 kernel bounds; the inputs ln 2, ln 3
    are rounded (logits off by at most u ln 3, which moves lse by as much and o by u ln 3 times
    half the range of v, 1); adding the shift rounds once (u |lse|); the float64 merge bound
    carries these input errors; the hand values ln 3, ln 6 + shift are rounded once more."""
    q, k, v = _hand_pieces()
    keep = np.array(split)
    logit_in = U64 * math.log(3.0)
    os_, ls, o_err, l_err = [], [], [], []
    for piece, (want_l, want_o) in zip((keep, ~keep), want, strict=True):
        mask = piece[None, None, None, :]
        o, lse = oracle.dot_product_attention(q, k, v, mask=mask, scale=1.0, return_lse=True)
        o_b, l_b = tolerance.kernel_call_error_bound(q, k, v, mask=mask, scale=1.0)
        assert abs(lse[0, 0, 0] - want_l) <= l_b[0, 0, 0] + logit_in + U64 * abs(want_l)
        assert abs(o[0, 0, 0, 0] - want_o) <= o_b[0, 0, 0, 0] + logit_in + U64 * want_o
        os_.append(o)
        ls.append(lse + shift)
        o_err.append(o_b + logit_in)
        l_err.append(l_b + logit_in + U64 * np.abs(lse + shift))
    o, lse = np.stack(os_), np.stack(ls)
    o_b, l_b = tolerance.merge_error_bound(
        o, lse, dtype=np.float64, tree=1, o_error=np.stack(o_err), lse_error=np.stack(l_err)
    )
    whole_l = math.log(6.0) + shift
    merge, stack = _merges(jit)
    for got_o, got_l in (
        oracle.merge_states(o[0], lse[0], o[1], lse[1]),
        oracle.merge_state_stack(o, lse),
        merge(o[0], lse[0], o[1], lse[1]),
        merge(o[1], lse[1], o[0], lse[0]),
        stack(o, lse),
    ):
        got_o, got_l = np.asarray(got_o), np.asarray(got_l)
        assert got_o.dtype == np.float64
        assert abs(got_l[0, 0, 0] - whole_l) <= l_b[0, 0, 0] + 2 * U64 * whole_l
        assert abs(got_o[0, 0, 0, 0] - 7 / 3) <= o_b[0, 0, 0, 0] + U64 * 7 / 3


def _kernel_problems(dtypes, kinds):
    bucket = ast.Config(batch=2, t=3, s=5, n=2, k=1, h=4, h_v=2, d_model=8)
    return ast.kernel_problems(
        ast.configs(buckets=(bucket,), dtypes=dtypes, value_dim_differs=True),
        kinds=kinds,
        mask_shapes=None,
        bias_shapes=None,
    )


@given(
    part=ast.key_partitions(
        _kernel_problems(("float64",), ast.MASK_KINDS), min_pieces=2, max_pieces=5
    )
)
def test_oracle_pieces_merge_to_the_whole_call(part):
    """The float64 oracle's states over the pieces of a key partition (every mask kind), merged
    by the drawn tree and stacked, equal the oracle of the whole call within the derived bound
    (the pieces' float64 kernel bounds carried through the merge, plus the whole call's)."""
    o, lse = part.oracle_states()
    ref_o, ref_l = part.problem.oracle()
    pol = part.problem.masked_rows
    for label, got, tree in (
        ("tree", ast.apply_merge_tree(oracle.merge_states, part.tree, o, lse), None),
        ("stack", oracle.merge_state_stack(o, lse, masked_rows=pol), "stack"),
    ):
        _assert_state(*got, ref_o, ref_l, *part.bound(tree), f"oracle {label} {part.tree}")


# ----------------------------------------------------------------------------- bad input


_O = np.zeros((2, 3, 4))
_L = np.zeros((2, 3))
_BAD_BINARY = [
    ((np.zeros(()), np.zeros(()), _O, _L), {}, ValueError),
    ((_O, np.zeros((2, 4)), _O, _L), {}, ValueError),
    ((_O, _L, np.zeros((2, 3, 5)), _L), {}, ValueError),
    ((_O, _L, np.zeros((3, 3, 4)), np.zeros((3, 3))), {}, ValueError),
    ((_O.astype(np.int32), _L, _O, _L), {}, TypeError),
    ((_O, _L, _O, _L.astype(bool)), {}, TypeError),
    ((_O, _L, _O, _L), {"masked_rows": "uniform"}, ValueError),
]
_BAD_STACK = [
    ((_O, np.zeros((3,))), {}, ValueError),
    ((_O, _L), {"axis": 2}, ValueError),
    ((_O, _L), {"axis": -3}, ValueError),
    ((_O, _L), {"axis": 1.0}, TypeError),
    ((_O, _L), {"axis": True}, TypeError),
    ((_O.astype(np.int8), _L), {}, TypeError),
    ((_O, _L), {"masked_rows": "ones"}, ValueError),
]


@pytest.mark.usefixtures("unchecked_annotations")
@pytest.mark.parametrize(
    "which, args, kwargs, exc",
    [("binary", *c) for c in _BAD_BINARY] + [("stack", *c) for c in _BAD_STACK],
)
def test_bad_input_refused_alike(which, args, kwargs, exc):
    """The oracle refuses what the JAX merges refuse, with the same exception and message
    (the argument and its shape named)."""
    pair = (
        (oracle.merge_states, merge_states)
        if which == "binary"
        else (oracle.merge_state_stack, merge_state_stack)
    )
    messages = []
    for fn in pair:
        with pytest.raises(exc) as err:
            fn(*args, **kwargs)
        messages.append(str(err.value))
    assert messages[0] == messages[1]
    assert any(word in messages[0] for word in ("o_", "lse_", "axis", "masked_rows"))


# ----------------------------------------------------------------------------- JAX vs oracle


def _check_merges(merge, stack, states, tree, policy):
    """Binary merges by ``tree`` and the stacked merge (on axis 0 and on axis 1) equal the oracle
    merge within the bound of the tree's depth and of one stacked merge; empty rows follow
    ``policy``."""
    ref_o, ref_l = states.oracle(policy)

    def binary(o_a, l_a, o_b, l_b):
        return merge(o_a, l_a, o_b, l_b, masked_rows=policy)

    if states.pieces > 1:  # (one piece: nothing to merge pairwise)
        got = ast.apply_merge_tree(binary, tree, states.o, states.lse)
        depth = ast.tree_depth(tree)
        _assert_state(*got, ref_o, ref_l, *states.bound(depth), f"tree {tree}")
    bound = states.bound("stack")
    got = stack(states.o, states.lse, axis=0, masked_rows=policy)
    _assert_state(*got, ref_o, ref_l, *bound, "stack")
    moved = np.moveaxis(states.o, 0, 1), np.moveaxis(states.lse, 0, 1)
    got = stack(*moved, axis=1, masked_rows=policy)
    _assert_state(*got, ref_o, ref_l, *bound, "stack on axis 1")


@given(
    states=ast.attention_states(
        min_pieces=1, max_pieces=5, shapes=(ast.STATE_SHAPES[1],), dtypes=ast.STATE_DTYPES
    ),
    data=st.data(),
)
def test_merges_equal_the_oracle(states, data):
    """Jitted merges in a drawn order and grouping, and stacked, equal the oracle in every
    format, at |lse| up to 1e4 with differences beyond 88 and 709, ties, and empty states whose
    o is NaN; empty rows follow the drawn masked_rows policy (:func:`_check_merges`)."""
    tree = data.draw(ast.merge_trees(states.pieces), label="tree")
    policy = data.draw(st.sampled_from(("zeros", "nan")), label="masked_rows")
    _check_merges(_MERGE, _STACK, states, tree, policy)


@pytest.mark.parametrize(
    "dtype, lse_dtype, spread, center",
    [
        ("float32", "float32", "large", 1e4),
        ("bfloat16", "float32", "huge", -1e4),
    ],
)
def test_merges_without_jit(dtype, lse_dtype, spread, center):
    """The same merges run eagerly (no jit) on fixed states with empty states and an empty
    row, both policies."""
    states = ast.make_state_stack(
        3,
        (2, 3),
        2,
        7,
        dtype=dtype,
        lse_dtype=lse_dtype,
        spread=spread,
        center=center,
        empty=0.3,
        empty_row=True,
    )
    for policy in ("zeros", "nan"):
        _check_merges(merge_states, merge_state_stack, states, ((2, 0), 1), policy)


@pytest.mark.parametrize("jit", [False, True])
def test_non_finite_rules(jit):
    """A NaN or +inf lse poisons its row (o and lse NaN); an empty state's NaN o is never read
    (merging it is exact: the other state comes back bit for bit); two empty states are empty,
    o per masked_rows; a finite lse with a NaN o gives a NaN o and a finite lse; no states at
    all is the empty state. The live row equals the oracle within the merge bound."""
    merge, stack = _merges(jit)
    o = np.array([[1.0, np.nan, 2.0, np.nan, 3.0], [4.0, 5.0, np.nan, 7.0, 8.0]])[..., None]
    lse = np.array([[0.0, -np.inf, np.nan, -np.inf, 1.0], [1.0, 2.0, 0.5, -np.inf, np.inf]])
    # rows: 0 live + live, 1 empty (NaN o) + live, 2 NaN lse, 3 empty + empty, 4 +inf lse
    want_l = np.array([np.nan, 2.0, np.nan, -np.inf, np.nan])
    for policy, fill in (("zeros", 0.0), ("nan", np.nan)):
        want_o = np.array([np.nan, 5.0, np.nan, fill, np.nan])[:, None]
        ref_o, ref_l = oracle.merge_state_stack(o, lse, masked_rows=policy)
        o_b, l_b = tolerance.merge_error_bound(o, lse, dtype=np.float64, tree=1)
        for got_o, got_l in (
            oracle.merge_states(o[0], lse[0], o[1], lse[1], masked_rows=policy),
            (ref_o, ref_l),
            merge(o[0], lse[0], o[1], lse[1], masked_rows=policy),
            stack(o, lse, axis=0, masked_rows=policy),
        ):
            got_o, got_l = np.asarray(got_o), np.asarray(got_l)
            np.testing.assert_array_equal(got_l[1:], want_l[1:])
            np.testing.assert_array_equal(got_o[1:], want_o[1:])
            assert abs(got_l[0] - ref_l[0]) <= l_b[0]
            assert abs(got_o[0, 0] - ref_o[0, 0]) <= o_b[0, 0]
    for got_o, got_l in (
        oracle.merge_states(o[1, 2:3], lse[0, :1], o[0, :1], lse[0, :1]),
        merge(o[1, 2:3], lse[0, :1], o[0, :1], lse[0, :1]),
    ):
        assert np.isnan(np.asarray(got_o)).all() and np.isfinite(np.asarray(got_l)).all()
    for got_o, got_l in (
        oracle.merge_state_stack(np.zeros((0, 2, 3)), np.zeros((0, 2))),
        stack(np.zeros((0, 2, 3)), np.zeros((0, 2))),
    ):
        assert np.all(np.asarray(got_o) == 0) and np.all(np.isneginf(np.asarray(got_l)))


# ----------------------------------------------------------------------------- gradients


def _analytic_vjp(o, lse, g_o, g_l):
    """d/do_p = pi_p g_o, d/dlse_p = pi_p (g_o . (o_p - o) + g_l), pi_p = e^{lse_p - L}
    (0 for an empty state). NumPy, float64, from the definition; pieces on axis 0."""
    live = np.isfinite(lse)
    some = live.any(axis=0)
    top = np.where(some, np.where(live, lse, -np.inf).max(axis=0), 0.0)
    w = np.where(live, np.exp(np.where(live, lse - top, 0.0)), 0.0)
    pi = w / np.where(some, w.sum(axis=0), 1.0)
    oo = np.where(live[..., None], o, 0.0)
    merged = (pi[..., None] * oo).sum(axis=0)
    d_o = pi[..., None] * g_o
    d_l = pi * (((oo - merged) * g_o).sum(axis=-1) + g_l)
    return d_o, np.where(live, d_l, 0.0), pi, np.abs(oo) + np.abs(merged)


def _sequential_loss(o, lse, g_o, g_l, live):
    """sum(g_o o) + sum(g_l lse) of the merge of o[0], o[1], ... one after another (rows with
    no live state left out)."""
    acc = (o[0], lse[0])
    for i in range(1, o.shape[0]):
        acc = merge_states(acc[0], acc[1], o[i], lse[i])
    return _loss(*acc, g_o, g_l, live)


def _stack_loss(o, lse, g_o, g_l, live):
    """The same loss of one stacked merge."""
    return _loss(*merge_state_stack(o, lse, axis=0), g_o, g_l, live)


def _loss(mo, ml, g_o, g_l, live):
    return jnp.sum(jnp.where(live[..., None], mo, 0.0) * g_o) + jnp.sum(
        jnp.where(live, ml, 0.0) * g_l
    )


_GRADS = {
    name: jax.grad(fn, argnums=(0, 1))
    for name, fn in (("sequential", _sequential_loss), ("stack", _stack_loss))
}
_GRADS_JIT = {name: jax.jit(fn) for name, fn in _GRADS.items()}


def _check_gradients(grads, states, seed):
    """jax.grad of the merged (o, lse) for random cotangents, binary (sequential) and stacked,
    equals the analytic derivative in float64; empty states (o NaN) get exactly 0 and nothing is
    NaN (rows with at least one live state; a row with none is tested below).

    Allowance per entry: a merge's forward rounds each term at most 13 times on its path
    (the subtraction, exp and log1p as C_EXP = 4 each, the sum, two products, their sum, the
    division) and its VJP at most twice that, 39 per merge; a term passes at most P merges
    (P - 1 sequential; the stack's P-term sums counted as P), so ``N = 40 P`` rounded factors
    give ``gamma_N pi_p M_p``, where ``M_p`` is the magnitude of the term (``|g_o|`` for o,
    ``|g_o| (|o_p| + |o|) + |g_l|`` for lse). The rounded subtraction ``d = lse_p - m`` shifts
    a share by ``|d| u pi_p <= u / e`` absolute per merge: ``+ (P - 1) u / e M_p``; each stored
    partial lse is off by ``u |lse|`` (``<= u Lmax``, ``Lmax = max |lse_p| + ln P``), which
    shifts the shares on either side of it: ``+ 2 (P - 1) u Lmax pi_p M_p``."""
    rng = np.random.default_rng(seed)
    o, lse = states.o, states.lse
    live_rows = np.isfinite(lse).any(axis=0)
    g_o = rng.standard_normal(o.shape[1:]) * live_rows[..., None]
    g_l = rng.standard_normal(lse.shape[1:]) * live_rows
    p = states.pieces
    want_o, want_l, pi, mag = _analytic_vjp(o, lse, g_o, g_l)
    l_max = np.abs(np.where(np.isfinite(lse), lse, 0.0)).max(axis=0) + math.log(p)
    gam = tolerance.gamma(40 * p, U64) + 2 * (p - 1) * U64 * l_max[None]
    slack = (p - 1) * U64 / math.e
    m_o = np.abs(g_o)[None] * np.ones_like(o)
    m_l = (mag * np.abs(g_o)[None]).sum(axis=-1) + np.abs(g_l)[None]
    empty = ~np.isfinite(lse)
    for name, grad in grads.items():
        d_o, d_l = (np.asarray(g) for g in grad(o, lse, g_o, g_l, live_rows))
        assert np.all(np.isfinite(d_o)) and np.all(np.isfinite(d_l)), name
        assert np.all(d_o[empty] == 0) and np.all(d_l[empty] == 0), name
        for label, got, want, m, share in (
            ("d o", d_o, want_o, m_o, (pi * gam)[..., None]),
            ("d lse", d_l, want_l, m_l, pi * gam),
        ):
            assert_ratio_within(
                np.abs(got - want),
                (share + slack) * m,
                f"{name} {label}: {{error:.3e}} > {{allowed:.3e}} at {{index}}",
            )


@given(
    states=ast.attention_states(
        min_pieces=2,
        max_pieces=4,
        shapes=(ast.STATE_SHAPES[0],),
        dtypes=("float64",),
        spreads=("tied", "small", "large"),
        centers=(0.0, 1e4),
    ),
    seed=st.integers(0, 2**31 - 1),
)
def test_gradients_equal_the_analytic_derivative(states, seed):
    """Jitted gradients (see :func:`_check_gradients`) on drawn states."""
    _check_gradients(_GRADS_JIT, states, seed)


def test_gradients_without_jit():
    """The same gradients run eagerly (no jit), on fixed states with ties, empty states (o NaN)
    and a row of empty states (zero gradients, no NaN)."""
    states = ast.make_state_stack(
        3, (4,), 3, 5, dtype="float64", spread="tied", empty=0.3, empty_row=True
    )
    assert np.isneginf(states.lse).any()
    _check_gradients(_GRADS, states, 0)


def test_gradient_of_empty_rows_and_ties():
    """A row where every state is empty has zero gradients (no NaN from their NaN o); exact
    ties split as the derivative says (pi = 1/2 each). Jitted (the eager gradients are
    checked on ties and empty rows in test_gradients_without_jit)."""
    merge, stack = _merges(True)
    o = np.array([[[np.nan, np.nan], [1.0, 2.0]], [[np.nan, np.nan], [3.0, 5.0]]])
    lse = np.array([[-np.inf, 0.7], [-np.inf, 0.7]])

    def loss_b(o, lse):
        mo, ml = merge(o[0], lse[0], o[1], lse[1])
        return jnp.sum(mo[1]) + 2.0 * ml[1] + jnp.sum(jnp.where(jnp.isneginf(ml), 0.0, ml))

    def loss_s(o, lse):
        mo, ml = stack(o, lse, axis=0)
        return jnp.sum(mo[1]) + 2.0 * ml[1] + jnp.sum(jnp.where(jnp.isneginf(ml), 0.0, ml))

    for loss in (loss_b, loss_s):
        d_o, d_l = (np.asarray(g) for g in jax.grad(loss, argnums=(0, 1))(o, lse))
        np.testing.assert_array_equal(d_o[:, 0], 0.0)
        np.testing.assert_array_equal(d_l[:, 0], 0.0)
        np.testing.assert_allclose(d_o[:, 1], 0.5, rtol=4 * U64)
        # d lse_p = pi_p (g_o . (o_p - o) + g_l), g_o = (1, 1), g_l = 3, o = (2, 3.5)
        want = 0.5 * (np.array([1 - 2 + 2 - 3.5, 3 - 2 + 5 - 3.5]) + 3.0)
        np.testing.assert_allclose(d_l[:, 1], want, rtol=16 * U64)


# ----------------------------------------------------------------------------- partitions


@given(
    part=ast.key_partitions(
        _kernel_problems(ast.STATE_DTYPES, ("none", "causal", "fully_masked_row")),
        min_pieces=2,
        max_pieces=4,
    )
)
def test_partition_pieces_merged_equal_the_whole_call(part):
    """Each piece of a key partition computed by attnref.dot_product_attention in the problem's
    format (lse in float32 for 16-bit), merged by the drawn order and grouping and by one
    stacked merge, equals the float64 oracle of the whole call within the derived allowance:
    the pieces' kernel bounds carried through the merge bound of the tree's depth, plus the
    whole call's float64 error (KeyPartition.bound)."""
    p = part.problem
    states = [
        _KERNEL(p.q, p.k, p.v, return_lse=True, **part.piece(i).kwargs) for i in range(part.pieces)
    ]
    o = np.stack([np.asarray(s[0]) for s in states])
    lse = np.stack([np.asarray(s[1]) for s in states])
    assert lse.dtype == (np.float32 if p.dtype.itemsize == 2 else p.dtype)
    ref_o, ref_l = p.oracle()
    pol = p.masked_rows
    note(f"depth={part.depth}")

    def binary(o_a, l_a, o_b, l_b):
        return _MERGE(o_a, l_a, o_b, l_b, masked_rows=pol)

    got = ast.apply_merge_tree(binary, part.tree, o, lse)
    _assert_state(*got, ref_o, ref_l, *part.bound(), f"tree {part.tree}")
    got = _STACK(o, lse, axis=0, masked_rows=pol)
    _assert_state(*got, ref_o, ref_l, *part.bound("stack"), "stack")


# ----------------------------------------------------------------------------- the bound


def test_bound_grows_linearly_with_depth():
    """The merge bound grows linearly in the depth: equal steps from depth 4 to 6 to 8 (the
    oracle's share is the same at every depth); one piece leaves only float64 dust."""
    s = ast.make_state_stack(9, (3,), 2, 0, spread="small")
    b4, b6, b8 = (tolerance.merge_error_bound(s.o, s.lse, tree=d) for d in (4, 6, 8))
    for i in range(2):
        assert np.all(b6[i] > b4[i])
        np.testing.assert_allclose(b8[i] - b6[i], b6[i] - b4[i], rtol=1e-9)
    one = tolerance.merge_error_bound(s.o[:1], s.lse[:1], tree="sequential")
    assert np.all(one[0] < 1e-14) and np.all(one[1] < 1e-14)
    assert tolerance.merge_depth("sequential", 9) == 8
    assert tolerance.merge_depth("balanced", 9) == 4
    assert tolerance.merge_depth("stack", 9) == 1
    assert tolerance.merge_depth("balanced", 1) == 0
    with pytest.raises(ValueError, match="depth in"):
        tolerance.merge_error_bound(s.o, s.lse, tree=2)
    with pytest.raises(ValueError, match="tree must be one of"):
        tolerance.merge_depth("ring", 3)


def test_input_errors_pass_through_one_piece():
    """A single piece with input errors: the bound is the input error (plus float64 dust)."""
    s = ast.make_state_stack(1, (2, 2), 3, 4)
    e_o, e_l = np.full(s.o.shape, 1e-3), np.full(s.lse.shape, 2e-3)
    o_b, l_b = tolerance.merge_error_bound(s.o, s.lse, o_error=e_o, lse_error=e_l)
    np.testing.assert_allclose(o_b, 1e-3, rtol=1e-9)
    np.testing.assert_allclose(l_b, 2e-3, rtol=1e-9)


# ----------------------------------------------------------------------------- strategies


def test_strategies_draw_the_hard_cases():
    """attention_states reaches differences beyond 88 at |lse| near 1e4 and empty states whose
    o is NaN; key_partitions split every key into exactly one piece."""
    hard = find(
        ast.attention_states(min_pieces=2, max_pieces=2),
        lambda s: bool(
            np.any(
                np.abs(
                    np.subtract(
                        *s.lse.astype(np.float64),
                        where=np.isfinite(s.lse).all(0),
                        out=np.zeros(s.lse.shape[1:]),
                    )
                )
                > 88
            )
            and np.any(np.abs(s.lse.astype(np.float64)) > 9e3)
            and np.any(np.isneginf(s.lse) & np.isnan(s.o).all(axis=-1))
        ),
        settings=settings(max_examples=200, database=None),
    )
    assert hard.pieces == 2
    part = find(
        ast.key_partitions(_kernel_problems(("float32",), ("none",)), max_pieces=4),
        lambda p: p.pieces == 3 and p.layout == "random",
        settings=settings(max_examples=200, database=None),
    )
    masks = np.stack([part.piece_mask(i) for i in range(part.pieces)])
    np.testing.assert_array_equal(masks.sum(axis=0), 1)


# ----------------------------------------------------------------------------- the kit


def _naive_merge(o_a, lse_a, o_b, lse_b):
    """The merge as often written: ``lse = lse_a + log(1 + exp(lse_b - lse_a))``. exp overflows
    when lse_b - lse_a > 88 (float32) and the empty state (-inf) gives NaN."""
    o_a, lse_a, o_b, lse_b = (jnp.asarray(x) for x in (o_a, lse_a, o_b, lse_b))
    lse = lse_a + jnp.log(1 + jnp.exp(lse_b - lse_a))
    o = o_a * jnp.exp(lse_a - lse)[..., None] + o_b * jnp.exp(lse_b - lse)[..., None]
    return o, lse


def _lse_in_bfloat16(o_a, lse_a, o_b, lse_b):
    """A stable merge that stores its lse through bfloat16 (a precision bug)."""
    o, lse = merge_states(o_a, lse_a, o_b, lse_b)
    return o, lse.astype(jnp.bfloat16).astype(lse.dtype)


def test_kit_passes_attnref_merge_and_catches_broken_ones():
    """check_merge_states passes attnref's merge (jitted) on every property and dtype, its
    gradients included; it fails
    the naive merge on stability and identity (and the oracle property, on empty rows), and a
    merge that rounds lse to bfloat16 on the oracle property."""
    good = check_merge_states(_MERGE, max_examples=4)
    assert good.passed, good.summary()
    assert [r.name for r in good.results] == list(
        ("oracle", "commutative", "associative", "identity", "stability", "dtypes", "gradients")
    )
    assert good.features == ("grad",)
    naive = check_merge_states(
        _naive_merge, max_examples=4, properties=("oracle", "identity", "stability")
    )
    assert not naive.passed
    assert {r.name: r.status for r in naive.results} == {
        "oracle": "failed",
        "identity": "failed",
        "stability": "failed",
    }, naive.summary()
    assert "non-finite" in next(r.detail for r in naive.results if r.name == "stability")
    sloppy = check_merge_states(
        _lse_in_bfloat16, max_examples=4, properties=("oracle",), dtypes=("float32",)
    )
    assert not sloppy.passed and "derived bound" in sloppy.results[0].detail, sloppy.summary()


# ----------------------------------------------------------------------------- the kit: gradients


def _stop_gradient_merge(o_a, lse_a, o_b, lse_b):
    """attnref's merge (:func:`attnref.merge_states`) step for step, with its weights
    ``w = exp(lse - m)`` behind ``jax.lax.stop_gradient``: exact forward (bit for bit the same
    values), and ``d o_p = pi_p g_o`` survives, but ``d lse_p`` keeps only what flows through the
    shift ``m`` (all of ``g_lse`` to the larger state) and loses ``pi_p g_o . (o_p - o)``."""
    dt = jnp.promote_types(jnp.result_type(o_a, o_b), jnp.float32)
    la, lb = jnp.asarray(lse_a, dt), jnp.asarray(lse_b, dt)
    m = jnp.maximum(la, lb)
    ok = jnp.isfinite(m)
    m_safe = jnp.where(ok, m, 0.0)
    wa = jax.lax.stop_gradient(jnp.exp(jnp.where(ok, la, -jnp.inf) - m_safe))
    wb = jax.lax.stop_gradient(jnp.exp(jnp.where(ok, lb, -jnp.inf) - m_safe))
    oa = jnp.where(jnp.isneginf(la)[..., None], 0.0, jnp.asarray(o_a, dt))
    ob = jnp.where(jnp.isneginf(lb)[..., None], 0.0, jnp.asarray(o_b, dt))
    o = (wa[..., None] * oa + wb[..., None] * ob) / jnp.where(ok, wa + wb, 1.0)[..., None]
    lse = m_safe + jnp.log1p(jnp.where(ok, jnp.minimum(wa, wb), 0.0))
    o = jnp.where(jnp.isneginf(m)[..., None], 0.0, o)
    lse = jnp.where(jnp.isneginf(m), -jnp.inf, lse)
    return o.astype(jnp.result_type(o_a, o_b)), lse.astype(jnp.result_type(lse_a, lse_b))


def _log_total_merge(o_a, lse_a, o_b, lse_b):
    """A merge that is exact forward but writes ``lse = m + log(w_a + w_b)`` (weights relative
    to the larger lse, an empty state's o masked): on a row where both states are empty the
    total is 0, ``log(0) = -inf`` is the right value, but ``log``'s derivative ``1 / 0`` makes
    the gradient NaN (``0 * inf`` through ``exp(-inf)``)."""
    dt = jnp.promote_types(jnp.result_type(o_a, o_b), jnp.float32)
    la, lb = jnp.asarray(lse_a, dt), jnp.asarray(lse_b, dt)
    m = jnp.maximum(la, lb)
    m = jnp.where(jnp.isneginf(m), 0.0, m)
    wa, wb = jnp.exp(la - m)[..., None], jnp.exp(lb - m)[..., None]
    oa = jnp.where(wa > 0, jnp.asarray(o_a, dt), 0.0)
    ob = jnp.where(wb > 0, jnp.asarray(o_b, dt), 0.0)
    total = wa + wb
    o = (wa * oa + wb * ob) / jnp.where(total > 0, total, 1.0)
    lse = m + jnp.log(total[..., 0])
    return o.astype(jnp.result_type(o_a, o_b)), lse.astype(jnp.result_type(lse_a, lse_b))


def test_merge_gradient_oracle_by_hand():
    """merge_states_vjp on worked numbers. Row 0: lse = (0, ln 3), so L = ln 4 and pi = (1/4,
    3/4); o_a = (1, 2), o_b = (5, -2), o = (4, -1); g_o = (1, 0), g_lse = 2: d o_a = (1/4, 0),
    d o_b = (3/4, 0), d lse_a = 1/4 (1 - 4 + 2) = -1/4, d lse_b = 3/4 (5 - 4 + 2) = 9/4 (they
    sum to g_lse: shifting both lse shifts L). Row 1: a empty (o NaN): a gets 0, b gets g_o
    and g_lse. Row 2: both empty: all 0. Row 3: a NaN lse: NaN. Tolerance: a few float64
    roundings of values of order 1 (``16 u_64``); a wrong term moves a value by >= 1/4."""
    nan, inf = np.nan, np.inf
    o_a = np.array([[1.0, 2.0], [nan, nan], [nan, nan], [1.0, 1.0]])
    o_b = np.array([[5.0, -2.0], [3.0, 7.0], [nan, nan], [1.0, 1.0]])
    lse_a = np.array([0.0, -inf, -inf, nan])
    lse_b = np.array([math.log(3.0), 0.5, -inf, 0.0])
    g_o = np.array([[1.0, 0.0], [1.0, -1.0], [1.0, 1.0], [1.0, 1.0]])
    g_l = np.array([2.0, 3.0, 1.0, 1.0])
    d_oa, d_la, d_ob, d_lb = merge_states_vjp(o_a, lse_a, o_b, lse_b, g_o, g_l)
    tol = dict(rtol=16 * U64, atol=16 * U64)
    np.testing.assert_allclose(d_oa[:3], [[0.25, 0.0], [0, 0], [0, 0]], **tol)
    np.testing.assert_allclose(d_ob[:3], [[0.75, 0.0], [1, -1], [0, 0]], **tol)
    np.testing.assert_allclose(d_la[:3], [-0.25, 0.0, 0.0], **tol)
    np.testing.assert_allclose(d_lb[:3], [2.25, 3.0, 0.0], **tol)
    assert np.all(d_oa[1:3] == 0) and np.all(d_la[1:3] == 0) and np.all(d_ob[2] == 0)
    assert np.isnan(d_la[3]) and np.isnan(d_lb[3]) and np.isnan(d_oa[3]).all()
    with pytest.raises(ValueError, match="g_lse"):
        merge_states_vjp(o_a, lse_a, o_b, lse_b, g_o, g_l[:2])


def test_merge_gradient_oracle_is_the_derivative_of_the_oracle_merge():
    """Central differences of the float64 oracle merge (no derivative formula involved) agree
    with merge_states_vjp. Step h = 1e-5 on values of order 1: truncation h^2 |f'''| / 6 ~ 1e-10
    plus rounding ~ u_64 |f| / h ~ 1e-11, so 1e-8 absolute has room, while a wrong or missing
    term is of order 0.1."""
    s = ast.make_state_stack(2, (3,), 3, 4, dtype="float64", spread="small")
    rng = np.random.default_rng(0)
    g_o, g_l = rng.standard_normal(s.o.shape[1:]), rng.standard_normal(s.lse.shape[1:])

    def loss(args):
        o, lse = oracle.merge_states(*args)
        return float((o * g_o).sum() + (lse * g_l).sum())

    base = [x.copy() for x in (*s.state(0), *s.state(1))]
    want = merge_states_vjp(*base, g_o, g_l)
    h = 1e-5
    for i, w in enumerate(want):
        fd = np.zeros_like(base[i])
        for idx in np.ndindex(base[i].shape):
            up, down = [x.copy() for x in base], [x.copy() for x in base]
            up[i][idx] += h
            down[i][idx] -= h
            fd[idx] = (loss(up) - loss(down)) / (2 * h)
        np.testing.assert_allclose(fd, w, rtol=0, atol=1e-8)


def test_merge_grad_error_bound_is_zero_where_the_gradient_is_exact():
    """The gradient bound is 0 for an empty state and on an empty row (exp(-inf) = 0 exactly,
    so a correct backward gives exactly 0 there), positive on live states, and refuses
    mismatched shapes."""
    s = ast.make_state_stack(2, (4,), 3, 1, spread="small")
    s.lse[:, 0] = s.lse[0, 1] = s.lse[1, 2] = -np.inf  # row 0 empty, a empty on 1, b on 2
    s.o[np.isneginf(s.lse)] = np.nan
    g_o, g_l = np.ones(s.o.shape[1:]), np.ones(s.lse.shape[1:])
    b_oa, b_la, b_ob, b_lb = merge_grad_error_bound(*s.state(0), *s.state(1), g_o, g_l)
    for p, b_o, b_l in ((0, b_oa, b_la), (1, b_ob, b_lb)):
        live = np.isfinite(s.lse[p])
        assert np.all(b_l[~live] == 0) and np.all(b_o[~live] == 0)
        assert np.all(b_l[live] > 0) and np.all(b_o[live] > 0)
    with pytest.raises(ValueError, match="g_lse"):
        merge_grad_error_bound(*s.state(0), *s.state(1), g_o, g_l[:2])


def test_kit_gradients_catch_a_stop_gradient_merge():
    """A merge whose weights sit behind jax.lax.stop_gradient is exact forward (the same
    values as attnref's merge, bit for bit) and passes every forward property; only the
    gradients property fails it, on d lse (the derived bound is about 1e-5 there, the missing
    term pi_p g_o . (o_p - o) of order 1)."""
    s = ast.make_state_stack(2, (2, 3), 4, 0, spread="small", empty=0.3, empty_row=True)
    for got, want in zip(
        _stop_gradient_merge(*s.state(0), *s.state(1)),
        _MERGE(*s.state(0), *s.state(1)),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    report = check_merge_states(_stop_gradient_merge, max_examples=3)
    status = {r.name: r.status for r in report.results}
    assert status == {
        **{p: "passed" for p in MERGE_PROPERTIES if p != "gradients"},
        "gradients": "failed",
    }, report.summary()
    (grads,) = (r for r in report.results if r.name == "gradients")
    assert "d/dlse_" in grads.detail and "derived gradient bound" in grads.detail, grads.detail
    assert grads.traceback is None  # a failed comparison, not an exception


def test_kit_gradients_catch_nan_on_empty_rows():
    """``lse = m + log(w_a + w_b)`` is exact forward (log(0) = -inf on a row of empty states),
    but its gradient there is NaN: the gradients property fails it, naming the row of empty
    states, and the forward properties that draw empty rows pass it."""
    props = ("oracle", "identity", "gradients")
    report = check_merge_states(_log_total_merge, max_examples=3, properties=props)
    status = {r.name: r.status for r in report.results}
    assert status == {"oracle": "passed", "identity": "passed", "gradients": "failed"}, (
        report.summary()
    )
    assert "both states are empty" in report.results[-1].detail, report.results[-1].detail


def test_kit_gradients_of_a_numpy_merge():
    """A NumPy merge (here the float64 oracle's) cannot be differentiated by jax.vjp: the
    gradients property fails with a message that says so and how to declare it; declared with
    grad=False it is skipped with the reason (and the report lists no features), while the
    forward properties run as before."""

    def numpy_merge(o_a, lse_a, o_b, lse_b):
        return oracle.merge_states(o_a, lse_a, o_b, lse_b)

    props = ("oracle", "gradients")
    report = check_merge_states(numpy_merge, max_examples=2, properties=props)
    assert [r.status for r in report.results] == ["passed", "failed"], report.summary()
    assert "grad=False" in report.results[1].detail, report.results[1].detail
    declared = check_merge_states(numpy_merge, max_examples=2, properties=props, grad=False)
    assert declared.passed and declared.features == ()
    assert [r.status for r in declared.results] == ["passed", "skipped"]
    assert "grad=False" in declared.results[1].detail
