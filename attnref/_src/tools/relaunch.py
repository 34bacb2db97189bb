"""The ``attnref`` command's one restart: a check runs under glibc's transparent huge pages for
``malloc`` (``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``, glibc >= 2.35 on Linux).

A check at production shapes is bound by fresh memory. jax.nn's run and the float64 oracle
allocate hundreds of MiB per case, and glibc maps each large block anew, so the kernel faults it
in 4 KiB at a time. With the tunable, malloc asks for 2 MiB pages (``madvise``), and the faults
fall about tenfold. The tunable is read when the process starts, so the command restarts itself
once (``os.execve``) before it imports JAX. A caller's ``GLIBC_TUNABLES`` that names the tunable
(``glibc.malloc.hugetlb=0`` turns it off) is left as it is. Nothing computed changes.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Mapping, Sequence

TUNABLE = "glibc.malloc.hugetlb"
COMMANDS = ("check", "check-merge")
MIN_GLIBC = (2, 35)


def huge_pages_env(
    environ: Mapping[str, str], libc: str | None, platform: str
) -> dict[str, str] | None:
    """``environ`` with ``glibc.malloc.hugetlb=1`` added to ``GLIBC_TUNABLES`` (``:``-separated),
    or ``None``: the tunables name it already, or the C library is not glibc >= 2.35 on Linux.
    ``libc``: ``os.confstr("CS_GNU_LIBC_VERSION")``, e.g. ``"glibc 2.36"``."""
    name, _, version = (libc or "").partition(" ")
    try:
        release = tuple(int(part) for part in version.split(".")[:2])
    except ValueError:
        return None
    tunables = environ.get("GLIBC_TUNABLES", "")
    if not platform.startswith("linux") or name != "glibc" or release < MIN_GLIBC:
        return None
    if TUNABLE in tunables:
        return None
    return {**environ, "GLIBC_TUNABLES": ":".join(filter(None, (tunables, f"{TUNABLE}=1")))}


def relaunch(argv: Sequence[str]) -> None:
    """Restart this process under :func:`huge_pages_env` when ``argv[1]`` is a check command;
    return where the environment needs no change or the restart cannot be made."""
    if len(argv) < 2 or argv[1] not in COMMANDS:
        return
    try:
        libc = os.confstr("CS_GNU_LIBC_VERSION")
    except (AttributeError, ValueError, OSError):  # no confstr, or not a GNU C library
        return
    env = huge_pages_env(os.environ, libc, sys.platform)
    command = list(getattr(sys, "orig_argv", ()))
    if env is None or not command or not sys.executable:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    with contextlib.suppress(OSError):
        os.execve(sys.executable, command, env)
