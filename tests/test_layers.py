"""The layers of attnref, and imports that point down only.

Layers, bottom up (``docs/conventions.md``):

0. the float64 NumPy oracle and the rounding model (``attnref.oracle``, ``attnref.tolerance``):
   NumPy only, never JAX, so that their agreement with the JAX code is evidence;
1. the formulations (``attnref._src`` and the namespaces ``attnref.linear``, ``attnref.rope``,
   ``attnref.decode``, ``attnref.interp``, ``attnref.interop``, ``attnref.costs``,
   ``attnref.distributed``);
2. the testing kit (closeness rules, strategies, the conformance engine and its front ends);
3. the tools built on the formulations and the kit (the report, the docs generator, the models);
4. the command line.

A module may import modules of its own layer or below, never above. The top-level package
``attnref/__init__.py`` imports nothing at run time (PEP 562 ``__getattr__``), so importing a
submodule never drags the layers above it in; the subprocess tests check that in a fresh
interpreter, where ``sys.modules`` shows what an ``import`` really loaded.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "attnref"

# Longest matching prefix wins.
LAYERS = {
    "attnref.oracle": 0,
    "attnref.tolerance": 0,
    "attnref._src": 1,
    "attnref._src.core": 1,
    "attnref._src.formulations": 1,
    "attnref.linear": 1,
    "attnref.rope": 1,
    "attnref.mla": 1,
    "attnref.decode": 1,
    "attnref.interop": 1,
    "attnref.costs": 1,
    "attnref.distributed": 1,
    "attnref._src.kit.closeness": 2,
    "attnref._src.kit.conformance": 2,
    "attnref._src.kit.oracle_match": 2,
    "attnref.testing": 2,
    "attnref.strategies": 2,
    "attnref.conformance": 2,
    "attnref._src.interp": 3,
    "attnref.interp": 3,
    "attnref._src.tools": 3,
    "attnref.report": 3,
    "attnref.pages": 3,
    "attnref.models": 3,
    "attnref._src.tools.cli": 4,
    "attnref.cli": 4,
    "attnref.__main__": 4,
}
# The bottom layer's third-party imports: NumPy and its dtypes, and threadpoolctl, which holds
# BLAS to one thread while the oracle's blocks run on threads (attnref.oracle._threads).
NUMPY_ONLY = {"numpy", "ml_dtypes", "threadpoolctl", "math", "__future__", "typing", "dataclasses"}
NUMPY_ONLY |= {"itertools"}


def layer(module: str) -> int:
    """The layer of a dotted module name (the longest prefix in :data:`LAYERS`)."""
    best = max(
        (p for p in LAYERS if module == p or module.startswith(p + ".")), key=len, default=None
    )
    if best is None:
        raise KeyError(f"module {module} is in no layer: add it to LAYERS")
    return LAYERS[best]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _type_checking(node: ast.If) -> bool:
    return isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def imports(source: str, here: str, is_package: bool = False) -> list[tuple[int, str]]:
    """``(line, module)`` for every import executed at run time (``TYPE_CHECKING`` blocks skipped),
    relative imports resolved, ``from package import submodule`` read as the submodule."""
    tree = ast.parse(source, here)
    package = here if is_package else here.rpartition(".")[0]
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child):
                for other in child.orelse:
                    visit(other)
                continue
            if isinstance(child, ast.Import):
                found.extend((child.lineno, a.name) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                    base = ".".join([*anchor, base] if base else anchor)
                for a in child.names:
                    candidate = f"{base}.{a.name}"
                    spec = ROOT.parent / Path(*candidate.split("."))
                    is_module = spec.with_suffix(".py").exists() or (spec / "__init__.py").exists()
                    found.append((child.lineno, candidate if is_module else base))
            visit(child)

    visit(tree)
    return found


SOURCES = sorted(p for p in ROOT.rglob("*.py") if p != ROOT / "__init__.py")


def test_every_module_is_in_a_layer():
    missing = [module_name(p) for p in SOURCES if not _has_layer(module_name(p))]
    assert not missing, f"modules in no layer (add them to LAYERS): {missing}"


def _has_layer(module: str) -> bool:
    try:
        layer(module)
    except KeyError:
        return False
    return True


def upward(source: str, here: str, is_package: bool = False) -> list[str]:
    """The imports of ``source`` (module ``here``) that point to a higher layer."""
    return [
        f"line {line}: {target} (layer {layer(target)})"
        for line, target in imports(source, here, is_package)
        if target.startswith("attnref.") and layer(target) > layer(here)
    ]


def _file_imports(path: Path) -> list[tuple[int, str]]:
    return imports(path.read_text(), module_name(path), path.name == "__init__.py")


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: module_name(p))
def test_imports_point_down(path):
    here = module_name(path)
    up = upward(path.read_text(), here, path.name == "__init__.py")
    assert not up, f"{here} (layer {layer(here)}) imports from a layer above: {up}"


@pytest.mark.parametrize(
    "path", [p for p in SOURCES if layer(module_name(p)) == 0], ids=lambda p: module_name(p)
)
def test_bottom_layer_imports_numpy_only(path):
    outside = [
        f"line {line}: {target}"
        for line, target in _file_imports(path)
        if not target.startswith(("attnref.oracle", "attnref.tolerance"))
        and target.split(".")[0] not in NUMPY_ONLY | set(sys.stdlib_module_names)
    ]
    assert not outside, f"{module_name(path)} must import NumPy and the standard library only"


def _loaded_after(statement: str) -> set[str]:
    code = f"import sys\n{statement}\nprint('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    return {m.split(".")[0] for m in out.split()}


def test_the_oracle_and_the_rounding_model_load_without_jax():
    loaded = _loaded_after("import attnref.oracle, attnref.tolerance")
    assert {"jax", "jaxlib", "hypothesis", "chex"}.isdisjoint(loaded), sorted(loaded)


def test_import_attnref_loads_neither_jax_nor_hypothesis():
    loaded = _loaded_after("import attnref")
    assert {"jax", "hypothesis"}.isdisjoint(loaded), sorted(loaded)


def test_the_formulations_load_without_the_testing_kit():
    loaded = _loaded_after("import attnref; attnref.concat_attention; attnref.formulations()")
    assert "jax" in loaded  # the test can fail: it sees what was loaded
    assert "hypothesis" not in loaded, "the formulations must not import the testing kit"


def test_the_detector_sees_upward_imports():
    """The check can fail: upward imports written every way are flagged, a TYPE_CHECKING one not."""
    source = (
        "from typing import TYPE_CHECKING\n"
        "from attnref._src.formulations import kernel\n"
        "import attnref.testing\n"
        "from .. import strategies\n"
        "def f():\n    from attnref.cli import main\n"
        "if TYPE_CHECKING:\n    import attnref.models\n"
        "from . import _kernel\n"
    )
    flagged = upward(source, "attnref.oracle._core")
    assert [f.split(": ")[1].split(" ")[0] for f in flagged] == [
        "attnref._src.formulations.kernel",
        "attnref.testing",
        "attnref.strategies",
        "attnref.cli",
    ]
