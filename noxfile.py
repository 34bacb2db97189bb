"""nox sessions: ``nox -s tests``, ``nox -s lint``, ``nox -s typecheck``, ``nox -s lowest``."""

from __future__ import annotations

import re
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
    session.run("ruff", "format", "--check", "attnref", "tests", "noxfile.py")


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
