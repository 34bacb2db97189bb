"""Distributed attention on a JAX mesh: sequence-parallel (ring, striped, zigzag, all-gather,
Ulysses) and head-parallel (tensor-parallel) formulations. Public names: :mod:`attnref.distributed`.
"""
