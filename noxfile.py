"""nox sessions: ``nox -s tests``, ``nox -s lint``, ``nox -s typecheck``, ``nox -s lowest``,
``nox -s docs``, ``nox -s docs_shell``, ``nox -s clients``, ``nox -s citation``, and ``nox -s gpu``
(a CUDA machine only)."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import nox

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

nox.options.sessions = ["lint", "typecheck", "tests"]


@nox.session
def tests(session: nox.Session) -> None:
    """The README's test command in a fresh environment (Hypothesis profile from env, else dev)."""
    session.install("-e", ".[test]")
    session.run("pytest", "-q", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    session.install("ruff")
    session.run("ruff", "check", ".")
    session.run(
        "ruff", "format", "--check", "attnref", "tests", "noxfile.py", "docs/conf.py", "benchmarks"
    )


@nox.session
def typecheck(session: nox.Session) -> None:
    session.install("-e", ".[dev]")
    session.run("mypy")


def lowest_pins(extras: tuple[str, ...] = ("test",)) -> list[str]:
    """``name==X`` for every ``name>=X`` in pyproject's dependencies and ``extras``: the declared
    minimum of each direct dependency (transitive ones resolve normally)."""
    project = tomllib.loads(Path(__file__).with_name("pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in extras:
        reqs += project["optional-dependencies"][extra]
    pins = []
    for req in reqs:
        match = re.fullmatch(r"\s*([A-Za-z0-9_.\-]+)\s*>=\s*([0-9][^,;\s]*)\s*", req)
        if match is None:
            raise ValueError(f"pyproject requirement {req!r} has no plain '>=' lower bound")
        pins.append(f"{match[1]}=={match[2]}")
    return pins


@nox.session(python="3.11")
def lowest(session: nox.Session) -> None:
    """The suite at the lowest versions pyproject declares, so that the bounds are true:
    ``nox -s lowest`` (``-- tests/test_conformance.py`` for one file)."""
    session.install(*lowest_pins())
    session.install("--no-deps", "-e", ".")
    session.run("python", "-m", "pip", "freeze")
    session.run("pytest", "-q", *session.posargs)


CHROMIUM = "/usr/bin/chromium"  # Debian's package; tests/site/ drives it headless


def _ensure_chromium(session: nox.Session) -> None:
    """Install Debian's Chromium (no recommended packages) where ``/usr/bin/chromium`` is
    missing: as root, ``apt-get update`` and ``apt-get install``; otherwise stop with the command
    to run."""
    if Path(CHROMIUM).exists():
        return
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        session.error(
            f"{CHROMIUM} is missing and this session cannot install it (it needs root and "
            "apt-get): run `sudo apt-get update && sudo apt-get install -y "
            "--no-install-recommends chromium` (Debian/Ubuntu), then `nox -s docs` again"
        )
    env = {"DEBIAN_FRONTEND": "noninteractive"}
    # Fresh package lists: a container's may be missing or stale (old versions 404 on a mirror).
    session.run("apt-get", "update", external=True, env=env)
    session.run(
        "apt-get", "install", "-y", "--no-install-recommends", "chromium", external=True, env=env
    )


@nox.session
def docs(session: nox.Session) -> None:
    """The documentation site: ``sphinx-build`` with warnings as errors (no network: MathJax is
    bundled), then the tests of the built site in headless Chromium (``pytest -n 0 -m site``;
    ``nox -s docs -- -k math`` passes arguments to pytest). The site is
    ``docs/_build/html/index.html``. The slow shell examples are ``nox -s docs_shell``."""
    session.install("-e", ".[docs,test]")
    session.run("sphinx-build", "-W", "--keep-going", "-b", "html", "docs", "docs/_build/html")
    _ensure_chromium(session)
    session.run("pytest", "-n", "0", "-m", "site", *session.posargs)


@nox.session
def docs_shell(session: nox.Session) -> None:
    """The docs' slow examples (``pytest -n 0 -m docs_shell``: the blocks marked ``slow``, such
    as ``attnref check`` runs and a pytest run of the plugin), apart from the site's build."""
    session.install("-e", ".[test]")
    session.run("pytest", "-n", "0", "-m", "docs_shell", *session.posargs)


@nox.session
def gpu(session: nox.Session) -> None:
    """The GPU run (``scripts/gpu_check.py``): on a CUDA machine, JAX with CUDA installed, then the
    kernel-level properties on the card, the kit against jax.nn (``xla``, ``cudnn``), Pallas'
    flash attention and torch SDPA's backends where present, and the benchmark table
    (``nox -s gpu -- --out docs/benchmarks.md``). Not part of CI: nothing in CI needs a GPU."""
    session.install("-e", ".[test,bench]")
    session.install("jax[cuda12]")
    session.run("python", "scripts/gpu_check.py", *session.posargs)


@nox.session
def clients(session: nox.Session) -> None:
    """The conformance kit on real clients: installs PyTorch, Equinox and transformers, runs the
    tests that need torch (``pytest -n 0 -m torch``: the kit's torch signature,
    docs/torch_kernels.md's examples), then ``scripts/clients.py``, which rewrites
    ``docs/clients.md`` (``nox -s clients -- --examples 2`` passes arguments to the script)."""
    session.install("-e", ".[test,torch]", "equinox", "transformers")
    session.run("pytest", "-n", "0", "-m", "torch")
    session.run("python", "scripts/clients.py", *session.posargs)


@nox.session
def citation(session: nox.Session) -> None:
    """``CITATION.cff`` against the Citation File Format schema (cffconvert)."""
    session.install("cffconvert")
    session.run("cffconvert", "--validate", "-i", "CITATION.cff")
