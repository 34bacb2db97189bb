"""Every program block in README.md and docs/ runs, and shows what it really prints.

The runner collects every fenced block (```` ``` ```` or ``~~~``) of ``README.md`` and
``docs/**/*.md`` (``docs/_build`` and the site's generated test pages ``docs/tests`` left out;
the generated formulation pages included) and runs, one test per
block with the id ``<file>:<line>`` (the line of the opening fence):

* ``python``: executed in-process (JAX is already imported, so it is cheap), in a fresh
  namespace, with JAX's x64 flag off as in a reader's session, in the page's working directory
  (one temporary directory per page, on ``sys.path``). A block whose first line is a comment
  naming a file, ``# mypkg/kernels.py``, is a file the guide asks the reader to create: it is
  written to that path in the page's directory and imported (``mypkg.kernels``), so the page's
  later blocks, and its shell commands, import it.
* ``console``: each line starting with ``$ `` (continued by a trailing ``\\``) is a command,
  run with bash in the page's directory; the lines up to the next ``$ `` are its shown output.
  The environment is a reader's fresh shell: ``PATH`` starts with the virtual environment of
  ``sys.executable``, ``PYTHONPATH`` is the repository root (so ``tests.conformance_targets``
  imports, as it does from a checkout's root; the page's directory is not on it, since ``attnref
  check`` and ``python -m pytest`` must find ``mypkg`` in the current directory), and ``XLA_FLAGS``
  holds only the two compile-speed settings of ``tests/conftest.py`` (no virtual devices: a
  command that needs them sets the flag itself, as the page tells the reader to). Each command
  must exit 0 unless the block declares otherwise. The shown output is not matched line by line
  (tables are laid out by rich and times vary). These shown lines must appear in the real output
  (stdout and stderr), whitespace runs compared as one space, a shown line ending in ``...``
  matching any line it begins: the conformance summary ``N passed, M failed, K skipped:
  PASS|FAIL`` (the last such line printed), pytest's final ``== ... ==`` line (its time left
  out), ``collected N items``, pytest's progress line ``file.py .sx..  [100%]``, ``XFAIL``/
  ``XPASS`` lines, a failure's heading ``--- masks failed (seed 0) ---`` and exception lines
  ``TypeError: ...``, the replay commands ``attnref check ... --seed N ...``, and the lines
  that start ``attnref conformance:``, ``features:``, ``declared differences:`` or
  ``attnref[ check]: error:``. A line ``...`` elides any number of lines.
* ``bash``/``sh``: the whole block, run with ``bash -e`` in the page's directory and the same
  environment; it must exit 0 unless declared.
* Every other label is output, not a program: ``text``, ``bibtex``, no label, and MyST
  directives (``{eval-rst}``, ``{literalinclude}``, ...). An unknown label fails
  :func:`test_every_block_label_and_directive_is_known`, so a ``py`` or ``shell`` block cannot
  slip past the runner.

Blocks of one page share its directory and run in document order; a block run alone (``-k``)
first writes the files that the page's earlier blocks define.

Directives: HTML comments on the lines just before a block's opening fence (several may stack,
one per line), ``<!-- docs-test: NAME[: ARGUMENT] -->``:

* ``skip: REASON``: the block is not run; the test is skipped with the reason (which must be
  non-empty).
* ``slow``: the block takes more than a few seconds; its test carries ``pytest.mark.docs_shell``
  (deselected in the default run, run by ``nox -s docs_shell``). Everything else runs in the default
  suite.
* ``torch``: the block needs PyTorch; its test carries ``pytest.mark.torch`` (deselected in the
  default run, where torch is not installed; run by ``nox -s clients``).
* ``exit N``: every command of a ``console`` block (or the whole ``bash`` block) must exit ``N``.
* ``file: PATH``: the block (``text`` or any other label) is the content of the file ``PATH`` in
  the page's directory; it is written there, not run, before the page's later blocks run.
* ``run: COMMAND``: for a ``console`` block whose shown command takes minutes (production shapes
  on two cores), run ``COMMAND`` instead, a cheaper variant that the page's text names; the shown
  output's checks still apply.

A directive that is not one of these, or ``skip`` without a reason, fails the lint test.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import linecache
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from attnref.cli import CHECK_XLA_FLAGS

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted(
    [ROOT / "README.md"]
    + [
        p
        for p in (ROOT / "docs").rglob("*.md")
        # _build: Sphinx's output; tests: the site's pages of the test suite, generated from
        # tests/*.py at build time (gitignored; their blocks are the tests' own source)
        if not {"_build", "tests"} & set(p.relative_to(ROOT / "docs").parts[:1])
    ]
)
PROGRAMS = {"python", "console", "bash", "sh"}
OUTPUTS = {"", "text", "bibtex", "none"}
DIRECTIVES = {"skip", "slow", "exit", "file", "run", "torch"}
FENCE = re.compile(r"^( {0,3})(`{3,}|~{3,})\s*(\S*)")
DIRECTIVE = re.compile(r"^<!--\s*docs-test:\s*(.*?)\s*-->\s*$")
FILE_COMMENT = re.compile(r"^# ([\w./-]+\.py)\s*$")
# The compile-speed settings that `attnref check` adds and tests/conftest.py sets (the conftest
# spells them out: it sets XLA_FLAGS before attnref may be imported): they change what no
# operation computes.
XLA_SPEED = CHECK_XLA_FLAGS
TIMEOUT_S = 600


@dataclasses.dataclass(frozen=True)
class Block:
    """One fenced block: its page, the line of its opening fence, label, body, directives."""

    page: str  # relative to the repository root
    line: int
    label: str
    body: str
    directives: tuple[tuple[str, str], ...]  # (name, argument) in page order

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    def directive(self, name: str) -> str | None:
        """The argument of directive ``name`` ('' when it takes none), None when absent."""
        return next((arg for n, arg in self.directives if n == name), None)

    @property
    def file(self) -> str | None:
        """The path the block is the content of: a ``file:`` directive or a ``# path.py`` line."""
        if (path := self.directive("file")) is not None:
            return path
        first = self.body.split("\n", 1)[0]
        match = FILE_COMMENT.match(first) if self.label == "python" else None
        return match.group(1) if match else None


def _split_directive(text: str) -> tuple[str, str]:
    """``'skip: reason'`` -> ``('skip', 'reason')``; ``'exit 1'`` -> ``('exit', '1')``."""
    match = re.match(r"^([a-z]+)\s*:?\s*(.*)$", text)
    return (match.group(1), match.group(2)) if match else (text, "")


def parse_blocks(text: str, page: str) -> list[Block]:
    """Every fenced block of a Markdown page, with the directives stacked above its fence."""
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        indent, fence, label = match.groups()
        end = i + 1
        while end < len(lines) and not re.match(
            rf"^ {{0,3}}{fence[0]}{{{len(fence)},}}\s*$", lines[end]
        ):
            end += 1
        directives, j = [], i - 1
        while j >= 0 and (d := DIRECTIVE.match(lines[j])):
            directives.insert(0, _split_directive(d.group(1)))
            j -= 1
        body = "\n".join(
            ln[len(indent) :] if ln.startswith(indent) else ln for ln in lines[i + 1 : end]
        )
        blocks.append(Block(page, i + 1, label, body + "\n", tuple(directives)))
        i = end + 1
    return blocks


def all_blocks() -> list[Block]:
    return [b for p in PAGES for b in parse_blocks(p.read_text(), str(p.relative_to(ROOT)))]


BLOCKS = all_blocks()
RUNNABLE = [b for b in BLOCKS if b.label in PROGRAMS and b.directive("file") is None]


# --- console blocks: commands and the shown output's checked lines --------------------------------


def parse_console(body: str) -> list[tuple[str, list[str]]]:
    """``$ cmd \\`` continuations -> [(command, shown output lines)]."""
    commands: list[tuple[str, list[str]]] = []
    lines = body.rstrip("\n").split("\n")
    i = 0
    while i < len(lines):
        if lines[i].startswith("$ "):
            cmd = lines[i][2:]
            while cmd.endswith("\\") and i + 1 < len(lines):
                i += 1
                cmd = cmd[:-1].rstrip() + " " + lines[i].strip()
            commands.append((cmd, []))
        elif commands:
            commands[-1][1].append(lines[i])
        i += 1
    return commands


_CHECKED = re.compile(
    r"^(\d+ passed, \d+ failed, \d+ skipped: (PASS|FAIL)"
    r"|=+ .* =+"
    r"|collected \d+ items?"
    r"|\S+\.py [.sxXFE]+\s+\[100%\]"
    r"|(XFAIL|XPASS) .*"
    r"|--- .* ---|[A-Z]\w*(Error|Exception): .*|attnref check\S* \S+ .*--seed \d+.*"
    r"|attnref conformance: .*|features: .*|declared differences: .*|attnref( [\w-]+)?: error: .*)$"
)
_PYTEST_TIME = re.compile(r" in \d+(\.\d+)?s( \([0-9:]+\))?")


def _norm(line: str) -> str:
    """Whitespace runs as one space, pytest's time left out, its ``=`` rules (whose width follows
    the time's) as ``==``."""
    return re.sub(r"={2,}", "==", _PYTEST_TIME.sub("", " ".join(line.split())))


def check_output(shown: list[str], real: str) -> list[str]:
    """The shown lines that the real output lacks (see the module docstring for which count)."""
    real_lines = [_norm(ln) for ln in real.splitlines()]
    missing = []
    for line in shown:
        want = _norm(line)
        if not _CHECKED.match(want):
            continue
        if re.match(r"^\d+ passed, \d+ failed, \d+ skipped: ", want):
            summaries = [r for r in real_lines if re.match(r"^\d+ passed, \d+ failed, ", r)]
            ok = bool(summaries) and summaries[-1] == want
        elif want.endswith("..."):
            ok = any(r.startswith(want[:-3].rstrip()) for r in real_lines)
        else:
            ok = want in real_lines
        if not ok:
            missing.append(line)
    return missing


# --- running -------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def page_dirs(tmp_path_factory):
    """One working directory per page, shared by its blocks."""
    dirs: dict[str, Path] = {}

    def get(page: str) -> Path:
        if page not in dirs:
            dirs[page] = tmp_path_factory.mktemp(re.sub(r"\W", "_", page))
        return dirs[page]

    return get


def _write_files(block: Block, where: Path, *, upto_self: bool) -> None:
    """Write the files the page defines before ``block`` (and ``block``'s own, if asked)."""
    for b in BLOCKS:
        if b.page != block.page or b.line > block.line or (b.line == block.line and not upto_self):
            continue
        if (path := b.file) is not None:
            target = where / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(b.body)


def _forget_modules(where: Path) -> None:
    """Drop the modules imported from a page's directory, so the next import reads the files."""
    for name, module in list(sys.modules.items()):
        paths = [getattr(module, "__file__", None) or ""]
        # torch's torch._classes has a __path__ that is not a list of paths
        with contextlib.suppress(Exception):
            paths += [str(p) for p in getattr(module, "__path__", [])]
        if any(p.startswith(str(where)) for p in paths):
            del sys.modules[name]


def _env(where: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "XLA_FLAGS"))}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONPATH"] = str(ROOT)  # not the page's directory: the CLI must find `mypkg` itself
    env["XLA_FLAGS"] = XLA_SPEED
    return env


def _run_python(block: Block, where: Path, monkeypatch) -> None:
    monkeypatch.chdir(where)
    monkeypatch.syspath_prepend(str(where))
    _forget_modules(where)
    try:
        if block.file is not None:
            module = block.file.removesuffix(".py").replace("/", ".").removesuffix(".__init__")
            importlib.invalidate_caches()
            importlib.import_module(module)
            return
        filename = f"<{block.id}>"
        linecache.cache[filename] = (len(block.body), None, block.body.splitlines(True), filename)
        with jax.enable_x64(False):
            exec(compile(block.body, filename, "exec"), {"__name__": "__docs__"})
    finally:
        _forget_modules(where)


def _run_shell(command: str, where: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-e", "-c", command],
        cwd=where,
        env=_env(where),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )


def _run_console(block: Block, where: Path, status: int) -> None:
    commands = parse_console(block.body)
    assert commands, f"{block.id}: a console block without a '$ ' command"
    if (variant := block.directive("run")) is not None:
        shown = [line for _, out in commands for line in out]
        commands = [(variant, shown)]
    for command, shown in commands:
        done = _run_shell(command, where)
        output = done.stdout + done.stderr
        assert done.returncode == status, (
            f"{block.id}: `{command}` exited {done.returncode}, expected {status}\n{output[-6000:]}"
        )
        missing = check_output(shown, output)
        assert not missing, (
            f"{block.id}: `{command}` did not print the shown lines {missing}\n{output[-6000:]}"
        )


def _param(block: Block):
    marks = [pytest.mark.docs_shell] if block.directive("slow") is not None else []
    if block.directive("torch") is not None:
        marks.append(pytest.mark.torch)
    return pytest.param(block, id=block.id, marks=marks)


@pytest.mark.parametrize("block", [_param(b) for b in RUNNABLE])
def test_docs_block_runs(block: Block, page_dirs, monkeypatch):
    if (reason := block.directive("skip")) is not None:
        pytest.skip(reason)
    where = page_dirs(block.page)
    _write_files(block, where, upto_self=False)
    status = int(block.directive("exit") or 0)
    if block.label == "python":
        _write_files(block, where, upto_self=True)
        _run_python(block, where, monkeypatch)
    elif block.label == "console":
        _run_console(block, where, status)
    else:  # bash, sh: the whole block
        done = _run_shell(block.body, where)
        assert done.returncode == status, (
            f"{block.id} exited {done.returncode}, expected {status}\n{done.stdout}{done.stderr}"
        )


# --- the directives and labels themselves --------------------------------------------------------


def problems(blocks: list[Block]) -> list[str]:
    """Unknown labels and directives, and directives missing their argument."""
    found = []
    for b in blocks:
        if b.label not in PROGRAMS | OUTPUTS and not re.fullmatch(r"\{[\w-]+\}", b.label):
            found.append(f"{b.id}: unknown label {b.label!r} (a program or an output?)")
        for name, arg in b.directives:
            if name not in DIRECTIVES:
                found.append(f"{b.id}: unknown directive {name!r}")
            elif name == "skip" and not arg:
                found.append(f"{b.id}: 'skip' needs a reason")
            elif name == "exit" and not arg.isdigit():
                found.append(f"{b.id}: 'exit' needs a status, got {arg!r}")
            elif name in ("file", "run") and not arg:
                found.append(f"{b.id}: {name!r} needs an argument")
            elif name == "run" and b.label != "console":
                found.append(f"{b.id}: 'run' applies to console blocks only")
    return found


def test_every_block_label_and_directive_is_known():
    assert not (found := problems(BLOCKS)), "\n".join(found)


def test_the_runner_reads_pages_as_documented():
    # The parser, the lint and the output check, on pages written here: each case can fail.
    page = (
        "text\n<!-- docs-test: slow -->\n<!-- docs-test: exit 1 -->\n```console\n"
        "$ attnref check a:b \\\n    --max-examples 2\nproperty  status\n...\n"
        "1 passed, 1 failed, 0 skipped: FAIL\n```\n\n```python\n# pkg/mod.py\nX = 1\n```\n"
        "<!-- docs-test: file: x.txt -->\n~~~text\nmasks\n~~~\n"
    )
    console, module, data = parse_blocks(page, "p.md")
    assert (console.line, console.label, console.directive("exit")) == (4, "console", "1")
    assert console.directive("slow") == "" and console.directive("skip") is None
    shown = ["property  status", "...", "1 passed, 1 failed, 0 skipped: FAIL"]
    assert parse_console(console.body) == [("attnref check a:b --max-examples 2", shown)]
    assert (module.file, data.file, data.body) == ("pkg/mod.py", "x.txt", "masks\n")
    assert problems([console, module, data]) == []
    bad = "<!-- docs-test: skip: -->\n```py\nx\n```\n<!-- docs-test: slw -->\n```python\n```\n"
    assert len(problems(parse_blocks(bad, "p.md"))) == 3  # no reason, label 'py', 'slw'

    def ok(shown: list[str], real: str) -> bool:
        return check_output(shown, real) == []

    assert ok(shown, "property | status\n1 passed, 1 failed, 0 skipped: FAIL\n")
    assert not ok(shown, "1 passed, 1 failed, 0 skipped: FAIL\n2 passed, 0 failed, 0 skipped: PASS")
    assert ok(["== 6 passed, 3 xfailed in 9.1s =="], "=== 6 passed, 3 xfailed in 12.4s ===")
    assert not ok(["== 6 passed, 3 xfailed in 9.1s =="], "== 7 passed, 2 xfailed in 9.1s ==")
    assert ok(["attnref: error: devices=(1, 2) asks ..."], "attnref: error: devices=(1, 2) asks 2")
    assert not ok(["TypeError: got 'lse'"], "TypeError: got 'mask'")
