"""Independent blocks of NumPy work on a thread pool: the oracle's and the bounds' query blocks.

Ufuncs and BLAS release the GIL, so blocks writing disjoint slices run side by side; BLAS is held
to one thread per worker (``threadpoolctl``), so each block's arithmetic is unchanged.
"""

from __future__ import annotations

import contextvars
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from threadpoolctl import threadpool_limits

Job = TypeVar("Job")


def workers(jobs: int) -> int:
    """Threads for ``jobs`` blocks: the usable cores (``os.sched_getaffinity`` where the
    platform has it), at most one a job; ``ATTNREF_THREADS`` overrides (``1``: serial)."""
    forced = os.environ.get("ATTNREF_THREADS")
    if forced:
        return max(1, min(jobs, int(forced)))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(jobs, cores or 1))


def each_block(jobs: Sequence[Job], work: Callable[[Job], None]) -> None:
    """``work(job)`` for every job on :func:`workers` threads, each in a copy of the caller's
    context (so ``np.errstate`` holds); the first exception is raised here."""
    threads = workers(len(jobs))
    if threads <= 1:
        for job in jobs:
            work(job)
        return
    contexts = [contextvars.copy_context() for _ in jobs]
    with threadpool_limits(limits=1, user_api="blas"), ThreadPoolExecutor(threads) as pool:
        for _ in pool.map(lambda ctx, job: ctx.run(work, job), contexts, jobs):
            pass
