"""Analytic cost models of the RoPE formulations (``rope``, ``rope_patterns``).

The counting conventions are those of :mod:`attnref._src.cost` (matmul FLOPs equal to XLA's
``dot`` FLOPs, transcendentals equal to ``cost_analysis()["transcendentals"]``, elementwise FLOPs
an upper bound counted from the source, bytes between the largest intermediate and a workspace
bound). RoPE adds to them:

* **transcendentals**: one ``cos`` and one ``sin`` per (position, plane), which XLA counts as
  transcendentals like ``exp``. The models assume the default positions ``arange(T_q)``,
  ``arange(T_k)`` (shape ``[T]``, shared by the batch and the heads, so ``cos``/``sin`` are
  evaluated ``(T_q + T_k) d_k / 2`` times each); positions ``[..., T]`` with batch dimensions
  multiply that by the batch (``positions_batch=``). XLA constant-folds ``cos``/``sin`` of
  constant positions when ``d_k = 2`` (see :func:`_angles`).
* **rope** (rotate ``q`` and ``k``): concat's counts plus the rotations, ``a c - b s`` and
  ``a s + b c`` per pair (6 elementwise ops per pair per head and token) and the angles
  ``m theta_p`` (one multiply per position and plane). The matmuls are concat's: a rotation is
  elementwise, not a ``dot``.
* **rope_patterns** (relative ``W~_P(delta)``): ``U`` offsets (``T_q + T_k - 1`` for the
  default positions, the distinct values of ``pos_q[i] - pos_k[j]`` for concrete positions,
  ``T_q T_k`` per position batch for traced ones; ``offsets=``) each get a rotation ``R(delta)``
  built elementwise from 0/+-1 patterns (``d_k / 2`` planes of ``d_k^2`` entries: two multiplies
  and an add each, then the sum over planes) and a pattern matrix ``W~_Q R W~_K^T`` (the einsum
  contracts ``W~_Q R`` first: ``2 H U D1 d_k^2 + 2 H U D1^2 d_k``, ``D1 = d_model + 1``). The
  logits contract ``x~_i`` with the gathered ``W~_P`` first (``2 B H T_q T_k D1^2``), then with
  ``x~_j`` (``2 B H T_q T_k D1``). Values go through the merged ``W~_M = W~_V W_O``
  (homogeneous, so ``b_V W_O`` is a row of it and costs no elementwise add). The gathered
  ``[B, H, T_q, T_k, D1, D1]`` tensor is the largest intermediate.
"""

from __future__ import annotations

import dataclasses

from attnref._src.cost import (
    Cost,
    Dims,
    _finish,
    _softmax_elementwise,
    _softmax_tensors,
    concat_cost,
)

ROTATE_PER_PAIR = 6  # a*c, b*s, a*c - b*s, a*s, b*c, a*s + b*c


def _angles(positions: int, d: Dims, traced: bool) -> tuple[int, int, list[int]]:
    """(elementwise, transcendentals, tensors) of ``cos``/``sin`` of ``m theta_p`` for
    ``positions`` positions: the angle multiply, then one cos and one sin per angle.

    With constant positions and ``d_k = 2`` (one plane, ``theta = [1]``) the angle is the
    position itself and XLA constant-folds ``cos``/``sin``: nothing is left to count. (With more
    planes the angle is a broadcast product, which XLA's constant folding does not fold.)"""
    n = positions * (d.d_k // 2)
    if d.d_k == 2 and not traced:
        return 0, 0, [n, n, n]
    return n, 2 * n, [n, n, n]  # angle, cos, sin


def rope_cost(d: Dims, *, positions_batch: int = 1, traced_positions: bool = False) -> Cost:
    """Concat plus the rotations of ``q`` and ``k`` (see the module docstring).

    ``positions_batch`` is the number of position rows (1 for the default ``[T]`` positions;
    ``B`` for positions ``[B, T]``); ``traced_positions`` says they are ``jit`` arguments rather
    than constants (the defaults are constants)."""
    c = concat_cost(d)
    b, h, half = d.batch, d.heads, d.d_k // 2
    el_a, tr_a, angle_tensors = _angles(positions_batch * (d.t_q + d.t_k), d, traced_positions)
    pairs = b * h * (d.t_q + d.t_k) * half  # rotated pairs of q and k
    # per side: the two halves (slices), four products, two sums, the merged result
    rotation_tensors = [
        n for t in (d.t_q, d.t_k) for n in [b * h * t * half] * 8 + [b * h * t * d.d_k]
    ]
    tensors = angle_tensors + rotation_tensors
    extra = sum(tensors) * d.itemsize
    return dataclasses.replace(
        c,
        elementwise_flops=c.elementwise_flops + ROTATE_PER_PAIR * pairs + el_a,
        transcendentals=c.transcendentals + tr_a,
        intermediate_bytes=max(c.intermediate_bytes, max(tensors) * d.itemsize),
        workspace_bytes=c.workspace_bytes + extra,
    )


def rope_patterns_cost(
    d: Dims, *, offsets: int | None = None, traced_positions: bool = False
) -> Cost:
    """The relative pattern-matrix form (see the module docstring); ``offsets`` is the number
    ``U`` of pattern matrices formed (default ``T_q + T_k - 1``: the default positions; traced
    positions ``[B, T]`` give ``B T_q T_k``, with ``traced_positions=True``)."""
    b, h, dm, dk, dv, tq, tk = d.batch, d.heads, d.d_model, d.d_k, d.d_v, d.t_q, d.t_k
    u = tq + tk - 1 if offsets is None else offsets
    d1, half = dm + 1, dk // 2
    logits = b * h * tq * tk
    el_a, tr_a, angle_tensors = _angles(u, d, traced_positions)
    mm = (
        2 * h * u * d1 * dk * dk  # W~_Q R(delta)
        + 2 * h * u * d1 * d1 * dk  # (W~_Q R) W~_K^T
        + 2 * logits * d1 * d1  # x~_i W~_P
        + 2 * logits * d1  # (x~_i W~_P) x~_j^T
        + 2 * h * d1 * dv * dm  # W~_M = W~_V W_O
        + 2 * b * tk * d1 * h * dm  # messages x~_kv W~_M
        + 2 * logits * dm  # sum_j a_ij M_j
    )
    el = (
        el_a
        + 3 * u * half * dk * dk  # c P_cos, s P_sin and their sum, per plane
        + u * (half - 1) * dk * dk  # the sum over planes
        + _softmax_elementwise(d)
        + b * (h - 1) * tq * dm  # the sum over heads
        + (b * tq * dm if d.bias else 0)  # b_O
    )
    tensors = [
        *angle_tensors,
        h * d1 * dk,  # W~_Q, W~_K, W~_V
        h * d1 * dk,
        h * d1 * dv,
        *[u * half * dk * dk] * 3,  # the rotation's per-plane terms and their sum
        u * dk * dk,  # R(delta)
        h * u * d1 * dk,  # W~_Q R
        h * u * d1 * d1,  # W~_P
        h * tq * tk * d1 * d1,  # gathered per (i, j)
        b * h * tq * tk * d1 * d1,  # broadcast over the batch
        b * tq * d1,  # x~_q, x~_kv
        b * tk * d1,
        b * h * tq * tk * d1,  # x~_i W~_P
        *_softmax_tensors(d, logits),
        h * d1 * dm,  # W~_M
        b * h * tk * dm,  # messages
        b * h * tq * dm,  # per-head mixes
        b * tq * dm,  # y
    ]
    return _finish(d, mm, el, logits + tr_a, tensors)
