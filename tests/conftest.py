"""Test configuration: x64 on for the suite, Hypothesis profiles ``dev``, ``ci``, ``thorough``.

The suite enables ``jax_enable_x64`` globally (as JAX's own tests do) so float32 and float64
cases can be drawn side by side; ``tests/test_float64.py`` checks the x64-off behaviour in a
scoped ``jax.enable_x64(False)``. Profile: ``$HYPOTHESIS_PROFILE``, else ``ci`` when ``$CI`` is
set, else ``dev``.
"""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path

# Compiling dominates the suite (CI starts from a cold cache). Three CPU code-generation settings
# that change what each operation computes in no way, only how fast the machine code is (which is
# negligible at the suite's sizes) and how long XLA takes to produce it:
# * LLVM's backend optimisation level 0 (the HLO is unchanged): about a quarter less compile time;
# * the classic elemental emitters instead of the MLIR fusion emitters: about half the remaining
#   compile time (measured: 9.9 s -> 4.6 s on the two heaviest tests; cold suite 311 s -> 180 s
#   on 2 cores). This one changes some fusions of the loop forms (graph, blockwise, kv_cache: XLA's
#   elementwise and byte counts move by a few percent) but no dot instruction and no
#   transcendental, which tests/test_cost.py checks exactly; its temporary-bytes checks are bounds
#   that hold with and without the flag (the suite passes both ways).
# * one LLVM module per program instead of several compiled on a thread pool
#   (--xla_cpu_parallel_codegen_split_count=1): on 2 cores the split costs more than its threads
#   win, with two xdist workers and even in one process (attnref check adds it too). Measured on
#   2 cores, 72 programs of the kernel, blockwise and split-KV forms with their gradients: XLA's
#   compile time 11.3 s -> 8.9 s; tests/test_kernel.py with tests/test_mla.py, alternating
#   runs: 41.6 s and 37.8 s -> 28.6 s and 28.7 s. It splits the generated code, not the HLO,
#   so nothing computed changes.
# Set before JAX starts its backend; a caller's own XLA_FLAGS win. XLA aborts the process on a
# flag it does not know (no Python exception: pytest-xdist only sees its workers die), so the
# flags are set only for the jaxlib releases they were checked on (0.9, 0.10; the third flag's
# effect was measured on 0.10, its name read from 0.9.2's library).
os.environ.setdefault(
    "XLA_FLAGS",
    "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
    " --xla_cpu_parallel_codegen_split_count=1"
    if (0, 9)
    <= tuple(int(x) for x in importlib.metadata.version("jaxlib").split(".")[:2])
    < (0, 11)
    else "",
)
# Eight virtual CPU devices, for the distributed formulations' meshes of 1, 2, 4 and 8 devices
# (tests/test_distributed*.py). Everything else runs on device 0 as before. Added to a caller's
# XLA_FLAGS unless they set a device count themselves.
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"

import gc
import socket

import beartype
import jax
import jaxtyping
import pytest
from hypothesis import HealthCheck, settings

# pytest-rerunfailures (pyproject ``addopts``: a crashed worker's test runs once more) keeps its
# counts in the pytest-xdist controller and each worker asks over a local TCP socket before every
# test: a reply-less "set", then the next test's "get". With Nagle's algorithm on, that "get"
# waits for the controller's delayed ACK of the "set" (about 40 ms on Linux), so each short test
# cost about 20 ms more with the plugin than without (tests/test_errors.py, 415 tests on two
# workers: 14.4 s against 5.9 s). The client socket is made with TCP_NODELAY instead; the
# messages and the reruns are the same. Left alone where the plugin or its class is absent.
try:
    import pytest_rerunfailures as _reruns
except ImportError:  # pragma: no cover - the plugin is a test dependency
    _reruns = None
_SocketDB = getattr(_reruns, "SocketDB", None)
if _SocketDB is not None and not getattr(_SocketDB, "attnref_nodelay", False):
    _socket_db_init = _SocketDB.__init__

    def _init_without_nagle(self, *args, **kwargs):
        _socket_db_init(self, *args, **kwargs)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    _SocketDB.__init__ = _init_without_nagle
    _SocketDB.attnref_nodelay = True

# The type checker of jaxtyping's import hook (pyproject ``addopts``, ``--jaxtyping-packages=...,
# tests.conftest.typechecker``): beartype, checking the first item of a container rather than a
# random one, so a run checks the same things every time. Named here because jaxtyping 0.3.11's
# pytest plugin cuts a list of several packages at its first comma when the type checker is
# written with parentheses (``if index := value.find("(") != -1`` binds the comparison).
typechecker = beartype.beartype(conf=beartype.BeartypeConf(is_random=False))

jax.config.update("jax_enable_x64", True)

# JAX's persistent compilation cache: a compiled executable is keyed by its HLO and the compile
# options, so reusing one changes nothing but time. Property tests compile the same functions in
# several files and in both xdist workers; the cache turns those repeats into disk reads.
# ATTNREF_JAX_CACHE overrides the location; an empty value switches the cache off.
_CACHE = os.environ.get(
    "ATTNREF_JAX_CACHE", str(Path(__file__).resolve().parents[1] / ".jax_cache")
)
if _CACHE:
    jax.config.update("jax_compilation_cache_dir", _CACHE)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

_COMMON = dict(
    deadline=None,  # first calls compile; wall-clock deadlines would measure XLA, not attnref
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.differing_executors],
    print_blob=True,
)
settings.register_profile("dev", max_examples=8, **_COMMON)
# ci: 8 derandomized examples per property (about 230 properties, most drawing from a few
# shape buckets, so later examples mostly vary data, not compiled programs); thorough: 300.
settings.register_profile("ci", max_examples=8, derandomize=True, **_COMMON)
settings.register_profile("thorough", max_examples=300, **_COMMON)
settings.load_profile(
    os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev")
)


@pytest.fixture
def unchecked_annotations():
    """Switch the suite's runtime shape checks (jaxtyping + beartype, pyproject ``addopts``) off for
    one test. Bad-input tests pass arguments that contradict the annotations on purpose: what they
    check is attnref's own error (named argument, shape), the one a user without the import hook
    sees, so the annotation check must not fire first. Everything else runs checked."""
    before = jaxtyping.config.jaxtyping_disable
    jaxtyping.config.update("jaxtyping_disable", True)
    yield
    jaxtyping.config.update("jaxtyping_disable", before)


# Python's cyclic garbage collector. A worker's heap grows to millions of objects (JAX's traces,
# lowered modules and compiled programs, kept in its caches, and Hypothesis' data), and every
# full collection walks all of them: about 40 collections of about 0.45 s each per worker, some
# 18 s of each worker's 330 s (measured with gc.callbacks in a full ci run on 2 cores). After
# each test, what survives it is collected young and then frozen (``gc.freeze``: left out of
# later collections; still freed by reference counting). Full collections then walk one test's
# objects only: 2.7 s per worker, the same peak memory (4.9 GB and 3.9 GB per worker, against
# 4.8 and 3.9 without). Nothing a test computes or checks changes.
@pytest.hookimpl(trylast=True)
def pytest_runtest_logfinish(nodeid, location):
    gc.collect(1)
    gc.freeze()
