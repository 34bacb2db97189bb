"""Render the per-formulation Markdown pages of ``docs/formulations/`` from the registry, and
``docs/distributed.md`` (:func:`render_distributed`) from the distributed family's entries and
their cost models; and, for the documentation site, one page per test module
(:func:`write_test_pages`, run by ``docs/conf.py`` at build time) and the list of property tests
each formulation page cites (:data:`PROPERTY_TESTS`, :func:`covered_ids`).

The export rule (checked by ``tests/test_docs_pages.py``): every registered formulation's
``native`` and ``apply`` are exported under their ``__name__``, from ``attnref`` or from one of
its namespaces (:data:`NAMESPACES`), and its page shows that qualified name
(:func:`public_name`); every exported function taking the registry's row signature
``(params, x_q, x_kv, ...)`` is a registered ``native``/``apply`` or is listed in
:data:`HELPERS` with the reason it is not a registry entry, and the page of the formulation it
belongs to shows it.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

from attnref._src.core.family import public_path
from attnref._src.core.registry import Formulation, formulations
from attnref._src.formulations.kernel_forms import decode_attention
from attnref._src.formulations.standard import attention_weights, head_outputs
from attnref._src.interp.probes import attention_logits, attention_probes, residual_update
from attnref._src.tools.citations import formulation_bibtex

# Where a page may find a function, after the top level: the namespaces that export
# formulations and their helpers (the others hold the NumPy oracle and bounds, the models and
# the testing kits).
NAMESPACES = ("linear", "rope", "decode", "interp", "interop", "costs", "distributed")


class Helper(NamedTuple):
    """An exported function with the registry's row signature that is not a registry entry.

    Attributes:
        fn: The function.
        formulation: The id of the registry entry whose page lists it.
        reason: Why it is not an entry (Markdown, shown on that page).
    """

    fn: Callable[..., Any]
    formulation: str
    reason: str


_PROBE = "A probe of the block (see [probes](../probes.md)), not the block output: "

HELPERS: tuple[Helper, ...] = (
    Helper(
        decode_attention,
        "kv_cache",
        "The `kv_cache` computation fed one token per `lax.scan` step (`attnref.decode.scan`: "
        "token `t` appends its key and value, then its query attends to the cache). It is always "
        "causal and needs `T_q == T_k`, so it cannot take the softmax family's arbitrary masks "
        "and cross-attention; `tests/test_registry.py` checks it against the oracle with a "
        "causal mask.",
    ),
    Helper(
        attention_weights,
        "per_head_sum",
        _PROBE + "the weights `A_i` of every query head. `tests/test_registry.py` checks that it "
        "equals the `scores` field of `attnref.interp.attention_probes` bit for bit, which "
        "`tests/test_probes.py` checks against the oracle.",
    ),
    Helper(
        head_outputs,
        "per_head_sum",
        _PROBE + "the per-head terms `o_i = head_i W_O[i]` (no `b_O`). `tests/test_registry.py` "
        "checks `sum_i o_i + b_O` against the oracle's output with the derived bound.",
    ),
    Helper(
        attention_logits,
        "scores_messages",
        _PROBE + "the masked pre-softmax logits. `tests/test_probes.py` checks that it equals "
        "the `logits` field of `attnref.interp.attention_probes` bit for bit and those against a "
        "derived bound.",
    ),
    Helper(
        attention_probes,
        "scores_messages",
        _PROBE + "every intermediate at once, as a pytree; `tests/test_probes.py` checks each "
        "field against the oracle.",
    ),
    Helper(
        residual_update,
        "scores_messages",
        "The residual form `x_q + y` computed from `attnref.interp.attention_probes` (scores times "
        "messages): the same function as every formulation's `apply` with `residual=True`, "
        "which the registry tests; `tests/test_probes.py` checks the two agree.",
    ),
)

_CONVENTION_NOTE = {
    "row": "Row vectors: tokens are rows, `x_q [..., T_q, d_model]`, output `[..., T_q, d_model]`.",
    "column": "Column vectors: tokens are columns, `X [..., d_model, T]`, output "
    "`[..., d_model, T_q]`; masks are `[..., T_k, T_q]` and the attention matrix is "
    "column-stochastic. `apply` is the row-convention adapter (transposes in and out).",
    "single-query": "One query row `x_q [d_model]` against `X_kv [T_k, d_model]`; `apply` vmaps "
    "it over queries and batch dims.",
    "graph": "Nodes and an edge list `(senders, receivers)`; the row-convention `apply` uses the "
    "complete bipartite graph with the mask as adjacency (static shapes, jit-able).",
    "kernel": "Kernel level, the layout of `jax.nn.dot_product_attention`: `q [..., T_q, N, d_k]`, "
    "`k [..., T_k, K, d_k]`, `v [..., T_k, K, d_v]` -> `[..., T_q, N, d_v]` (heads on the "
    "second-to-last axis; `K` K/V heads shared by groups of `N / K` query heads); `apply` is the "
    "multi-head form on rows `x_q [..., T_q, d_model]`. Linear family masks: `causal` (needs "
    "`T_q == T_k`) and `key_mask [..., T_k]`; softmax family: every option of "
    "`attnref.dot_product_attention` (see [the kernel level](../kernel.md)).",
}


def public_name(fn: Callable[..., Any]) -> str:
    """The name a page shows for ``fn``: ``attnref.<name>`` if the top level exports it, else
    ``attnref.<namespace>.<name>`` for the first of :data:`NAMESPACES` that does.

    Args:
        fn: A registered ``native``/``apply`` or a helper.

    Returns:
        The qualified public name (``tests/test_docs_pages.py`` checks it resolves to ``fn``).

    Raises:
        LookupError: ``fn`` is exported nowhere under its ``__name__`` (the export rule).
    """
    import attnref

    name = fn.__name__
    if name in attnref.__all__ and getattr(attnref, name) is fn:
        return f"attnref.{name}"
    for namespace in NAMESPACES:
        module = importlib.import_module(f"attnref.{namespace}")
        if name in getattr(module, "__all__", ()) and getattr(module, name) is fn:
            return f"attnref.{namespace}.{name}"
    raise LookupError(
        f"{fn.__module__}.{name} is exported neither from attnref nor from attnref.<namespace> "
        f"for a namespace in {NAMESPACES}"
    )


def _autodoc(fn: Callable[..., Any]) -> str:
    """An autodoc block for ``fn`` under its public name: the site shows the signature and the
    docstring from the code (``:no-index:``: the API reference is the indexed entry)."""
    return f"```{{eval-rst}}\n.. autofunction:: {public_name(fn)}\n   :no-index:\n```"


def _code(f: Formulation) -> str:
    family = f"registry `apply` ({f.family.name} family)"
    if f.native is f.apply:
        text = f"**Code.** Native form and {family}:\n\n{_autodoc(f.native)}"
    else:
        text = (
            f"**Code.** Native form:\n\n{_autodoc(f.native)}\n\n"
            f"{family[0].upper()}{family[1:]}:\n\n{_autodoc(f.apply)}"
        )
    helpers = [h for h in HELPERS if h.formulation == f.id]
    if helpers:
        text += "\n\n**Helpers** (exported multi-head functions that are not registry entries):"
        for h in helpers:
            text += f"\n\n{_autodoc(h.fn)}\n\n{h.reason}"
    return text


_DIMS = re.compile(r"\[\s*\w+\s*,\s*['\"]([^'\"]*)['\"]\s*\]")


def _dims(annotation: Any) -> str | None:
    """``[..., T_q, d_model]`` from a jaxtyping annotation ``Float[ArrayLike, '... T_q
    d_model']`` (a string under ``from __future__ import annotations``); ``None`` if none."""
    if not isinstance(annotation, str):
        return None
    m = _DIMS.search(annotation)
    return None if m is None else "[" + ", ".join(m.group(1).split()) + "]"


def _shapes(f: Formulation) -> str:
    """The array arguments of the native form and their shapes, from its annotations."""
    sig = inspect.signature(f.native)
    args = [
        f"`{name} {dims}`"
        for name, par in sig.parameters.items()
        if (dims := _dims(par.annotation)) is not None
    ]
    out = _dims(sig.return_annotation)
    returns = f"; returns `{out}`" if out is not None else ""
    return (
        f"**Shapes** (the annotations of `{public_name(f.native)}`; a leading `#` marks an axis "
        f"that may be 1 and broadcasts): {', '.join(args)}{returns}."
    )


def _family(f: Formulation) -> str:
    fam = f.family
    return (
        f"**Family.** {fam.name}: every `apply` of the family takes `{fam.signature}` and is "
        f"checked against `{public_path(fam.oracle)}` within the derived bound "
        f"`{public_path(fam.bound)}`."
    )


def _cite(f: Formulation) -> str:
    """The "Cite" block: BibTeX for the formulation's sources and for attnref."""
    return (
        f"**Cite.** BibTeX for the sources above and for attnref (`attnref cite {f.id} "
        f"--bibtex` prints it):\n\n```bibtex\n{formulation_bibtex(f.id)}```"
    )


def render(f: Formulation, tests_dir: Path | None = None) -> str:
    """The Markdown page of one formulation.

    Args:
        f: A registry entry.
        tests_dir: The test suite whose property tests the page lists (:func:`covered_ids`);
            ``None`` (default) means ``tests/`` of this checkout.

    Returns:
        The page's Markdown text.
    """
    module = inspect.getmodule(f.native)
    details = (inspect.getdoc(module) or "") if module is not None else ""
    return (
        f"# {f.title}\n\n"
        f"Registry id: `{f.id}` · convention: {f.convention}\n\n"
        f"$$\n{f.equation}\n$$\n\n"
        f"{f.summary}\n\n"
        f"**Cost.** {f.cost}\n\n"
        f"{_shapes(f)}\n\n"
        f"**Convention.** {_CONVENTION_NOTE[f.convention]} {f.family.note}\n\n"
        f"{_family(f)}\n\n"
        f"{_tests(f, TESTS if tests_dir is None else tests_dir)}\n\n"
        f"{_code(f)}\n\n"
        f"**Details** (from `{f.native.__module__}`).\n\n"
        f"```{{eval-rst}}\n{details}\n```\n\n"
        f"**Citation.** {f.citation}\n\n"
        f"{_cite(f)}\n\n"
        "*This page is generated from the registry by `python -m attnref.pages`; "
        "`tests/test_docs_pages.py` checks it is current and that every name on it is the "
        "code's.*\n"
    )


def write(directory: Path) -> list[Path]:
    """Write one page per registered formulation into ``directory``; returns the paths."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for f in formulations():
        path = directory / f"{f.id}.md"
        path.write_text(render(f))
        paths.append(path)
    return paths


# ----------------------------------------------------------------------------- the tests' pages

TESTS = Path(__file__).resolve().parents[3] / "tests"  # the suite of this checkout

# The property tests that run formulations against the oracle and against each other, as
# ``<module>.<function>`` or ``<module>.<Class>.<method>`` (their site labels are ``tests.`` and
# this). Which formulations each one runs is read from its source (:func:`covered_ids`), not
# written here, and each formulation page lists the ones that run it;
# ``tests/test_docs_pages.py`` checks that every entry exists and runs at least one
# formulation, and that every formulation is run by at least one entry. The reading is an
# over-approximation (a test that filters what it names, as the linear kernel-level test does
# with the forms that have a ``(q, k, v)`` level, would be credited with the whole family), so
# only tests that run every formulation they name belong here.
PROPERTY_TESTS: tuple[str, ...] = (
    "test_formulations.AgreementTest.test_every_formulation_matches_oracle_and_each_other",
    "test_formulations.AgreementTest.test_every_formulation_matches_oracle_eagerly",
    "test_formulations.LowPrecisionTest.test_16bit_formats_meet_flashattention_rule",
    "test_formulations.test_residual_form",
    "test_formulations.test_every_broadcast_shape_of_mask_and_bias",
    "test_gradients.GradientAgreementTest.test_gradients_agree_across_formulations",
    "test_gqa.SoftmaxGQATest.test_every_formulation_matches_oracle",
    "test_rope.RopeRegistryTest.test_every_rope_entry_matches_oracle",
    "test_rope.RopeRegistryTest.test_every_rope_entry_matches_oracle_eagerly",
    "test_linear.test_multihead_forms_match_oracle",
    "test_gqa.LinearGQATest.test_every_linear_formulation_matches_oracle",
    "test_gqa.LinearGQATest.test_every_linear_formulation_matches_oracle_eagerly",
    "test_distributed_ring.test_matches_oracle_on_every_mesh",
    "test_distributed_ring.test_row_form_matches_the_oracle",
    "test_distributed_heads.ForwardTest.test_matches_oracle_on_every_mesh",
    "test_distributed_heads.test_row_form_matches_the_oracle",
)


def site_label(test: str) -> str:
    """The site label of ``test`` (``<module>.<function>`` or ``<module>.<Class>.<method>``):
    ``tests.<module>.<function>``; link to it with ``{ref}`tests.<module>.<function>```."""
    return f"tests.{test}"


def suite_functions(source: str) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """The test functions of a module's ``source``, in order: top-level ``test_*`` functions
    and the ``test_*`` methods of top-level classes, as ``(qualname, node)``."""
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if node.name.startswith("test"):
                yield node.name, node
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and (
                    item.name.startswith("test")
                ):
                    yield f"{node.name}.{item.name}", item


def _definitions(tree: ast.Module) -> dict[str, ast.AST]:
    """Module-level functions, classes and assigned names of ``tree`` (a method as
    ``Class.method``), each with the node that defines it."""
    defs: dict[str, ast.AST] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            defs[node.name] = node
        elif isinstance(node, ast.ClassDef):
            defs[node.name] = node
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    defs[f"{node.name}.{item.name}"] = item
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name) and node.value is not None:
                    defs[target.id] = node.value
    return defs


def covered_ids(test: str, tests_dir: Path = TESTS) -> frozenset[str]:
    """The registry ids that property test ``test`` (an entry of :data:`PROPERTY_TESTS`) runs,
    read from its source: the test function, and transitively the module-level functions,
    methods of its class and module-level names it uses, are searched for
    ``formulations("<family>")`` / ``ids("<family>")`` (the whole family) and for tuples or
    lists of registered ids written out (``SCHEMES = ("ring", "striped", "zigzag")``).

    Args:
        test: ``<module>.<function>`` or ``<module>.<Class>.<method>``.
        tests_dir: The directory of the test modules.

    Returns:
        The ids, possibly empty.

    Raises:
        LookupError: The module has no such test function.
    """
    module, qualname = test.split(".", 1)
    return _covered_in(module, qualname, (tests_dir / f"{module}.py").read_text())


@functools.lru_cache(maxsize=256)
def _covered_in(module: str, qualname: str, source: str) -> frozenset[str]:
    """:func:`covered_ids` of ``qualname`` in a module's ``source`` (cached by the source's
    text: rendering every page asks for each test once per formulation)."""
    from attnref._src.core.registry import formulations as _formulations

    defs = _definitions(ast.parse(source))
    if qualname not in defs or not qualname.rsplit(".", 1)[-1].startswith("test"):
        raise LookupError(f"tests/{module}.py has no test function {qualname}")
    cls = qualname.split(".")[0] if "." in qualname else None
    families = {f.family.name for f in _formulations()}
    registered = {f.id for f in _formulations()}
    ids: set[str] = set()
    seen: set[str] = set()
    todo = [qualname]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for node in ast.walk(defs[name]):
            if isinstance(node, ast.Name) and node.id in defs:
                todo.append(node.id)
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in ("self", "cls")
                and cls is not None
                and f"{cls}.{node.attr}" in defs
            ):
                todo.append(f"{cls}.{node.attr}")
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, (ast.Name, ast.Attribute))
                and (node.func.id if isinstance(node.func, ast.Name) else node.func.attr)
                in ("formulations", "ids")
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and node.args[0].value in families
            ):
                ids.update(f.id for f in _formulations(node.args[0].value))
            if isinstance(node, (ast.Tuple, ast.List)):
                ids.update(
                    e.value
                    for e in node.elts
                    if isinstance(e, ast.Constant) and e.value in registered
                )
    return frozenset(ids)


def _tests(f: Formulation, tests_dir: Path) -> str:
    """The page's list of the property tests that run ``f`` (:func:`covered_ids`)."""
    runs = [t for t in PROPERTY_TESTS if f.id in covered_ids(t, tests_dir)]
    items = "\n".join(f"* {{ref}}`{site_label(t)}`" for t in runs)
    return (
        f"**Tests that prove it equal to the others.** The property tests that run `{f.id}` "
        f"with the other formulations they name against `{public_path(f.family.oracle)}` "
        "(each page of the test suite shows the test's source):\n\n"
        f"{items}"
    )


_ROLE = re.compile(r":(func|class|mod|meth|data|attr|exc|obj):`(~?[\w.]+)`")


def _test_docstring(doc: str) -> str:
    """A test's docstring as Markdown: the tests' docstrings are prose with ``code`` spans (which
    Markdown reads alike), not reStructuredText (``|x|`` is an absolute value there, not a
    substitution); their Sphinx roles become MyST's (``{py:func}`...```)."""
    return _ROLE.sub(lambda m: f"{{py:{m[1]}}}`{m[2]}`", doc)


def render_test_page(module: str, source: str) -> str:
    """The site page of test module ``tests/<module>.py``: its docstring, then per test function
    its label (:func:`site_label`), a heading with its name, its docstring and its source.

    Args:
        module: The module's name (``test_formulations``).
        source: Its source text.

    Returns:
        The page's Markdown text.
    """
    tree = ast.parse(source)
    doc = ast.get_docstring(tree)
    parts = [f"# tests/{module}.py\n"]
    if doc:
        parts.append(_test_docstring(doc) + "\n")
    for qualname, node in suite_functions(source):
        parts.append(f"({site_label(f'{module}.{qualname}')})=\n## {qualname}\n")
        fdoc = ast.get_docstring(node)
        if fdoc:
            parts.append(_test_docstring(fdoc) + "\n")
        dedent = ":dedent:\n" if "." in qualname else ""  # a method: out of its class
        parts.append(
            f"```{{literalinclude}} ../../tests/{module}.py\n:language: python\n"
            f":pyobject: {qualname}\n{dedent}```\n"
        )
    return "\n".join(parts)


def write_test_pages(tests_dir: Path, out: Path) -> list[Path]:
    """Write ``out/<module>.md`` for every ``tests_dir/test_*.py`` and ``out/index.md`` (their
    table of contents); remove pages of modules that are gone. ``docs/conf.py`` calls it at
    every build, so the pages are always the suite's (nothing to commit).

    Args:
        tests_dir: The test suite (``tests/``).
        out: The pages' directory (``docs/tests/``).

    Returns:
        The paths written, the index last.
    """
    out.mkdir(parents=True, exist_ok=True)
    modules = sorted(p.stem for p in tests_dir.glob("test_*.py"))
    for stale in out.glob("*.md"):
        if stale.stem not in modules and stale.stem != "index":
            stale.unlink()
    paths = []
    for module in modules:
        path = out / f"{module}.md"
        text = render_test_page(module, (tests_dir / f"{module}.py").read_text())
        if not path.exists() or path.read_text() != text:  # unchanged: Sphinx reuses its read
            path.write_text(text)
        paths.append(path)
    index = out / "index.md"
    text = (
        "# The test suite\n\n"
        "One page per test module of `tests/`, generated at every build of the site from the "
        "suite itself: each test function with its docstring and its source. The formulation "
        "pages and the atlas link to the property that checks each claim.\n\n"
        "```{toctree}\n:maxdepth: 1\n\n" + "\n".join(modules) + "\n```\n"
    )
    if not index.exists() or index.read_text() != text:
        index.write_text(text)
    paths.append(index)
    return paths


# ----------------------------------------------------------------------------- docs/distributed.md

BENCH_SECTION = "bench_distributed"  # the marked section benchmarks/bench_distributed.py writes
# The reference problem of the page's communication table (per device, float32).
REFERENCE = {"batch": 1, "t": 4096, "heads": 8, "d_model": 512, "d_k": 64, "devices": 8}


# The page's order of the schemes (any other entry of the family follows, in registry order).
SCHEME_ORDER = ("ring", "striped", "zigzag", "all_gather", "ulysses", "tensor_parallel")


def _distributed() -> list[Formulation]:
    """The distributed family's entries in :data:`SCHEME_ORDER`."""
    entries = list(formulations("distributed"))
    rank = {fid: i for i, fid in enumerate(SCHEME_ORDER)}
    return sorted(entries, key=lambda f: rank.get(f.id, len(rank)))


def _positions_table(n: int, devices: int) -> str:
    """Which positions each device holds in each layout for ``n`` tokens (padding in italics)."""
    from attnref._src.formulations.distributed import layout as seq_layout

    lines = ["| device | " + " | ".join(seq_layout.LAYOUTS) + " |", "|---" * 4 + "|"]
    tables = {
        layout: seq_layout.positions(seq_layout.padded_length(n, devices, layout), devices, layout)
        for layout in seq_layout.LAYOUTS
    }
    for d in range(devices):
        cells = [
            " ".join(str(i) if i < n else f"*{i}*" for i in tables[layout][d])
            for layout in seq_layout.LAYOUTS
        ]
        lines.append(f"| {d} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _communication_table() -> str:
    """Per-device work and communication of each scheme on :data:`REFERENCE` (its cost model)."""
    from attnref._src.core.cost import Dims

    r = REFERENCE
    dims = Dims(
        r["batch"],
        r["t"],
        r["t"],
        r["heads"],
        r["d_model"],
        r["d_k"],
        r["d_k"],
        devices=r["devices"],
    )
    lines = [
        "| scheme | collective | calls | operand per call (MiB) | sent per device (MiB) "
        "| matmul per device (GFLOP) | largest intermediate (MiB) |",
        "|---|---|---|---|---|---|---|",
    ]
    mib = 2.0**20
    for f in _distributed():
        c = f.cost_model(dims)  # type: ignore[misc]
        for kind in dict.fromkeys(k.kind for k in c.collectives):
            ks = [k for k in c.collectives if k.kind == kind]
            sizes = sorted({k.operand_bytes / mib for k in ks})
            lines.append(
                f"| {f.id} | {kind} | {sum(k.calls for k in ks)} | "
                + ", ".join(f"{v:.3f}" for v in sizes)
                + f" | {sum(k.sent_bytes for k in ks) / mib:.3f} | {c.matmul_flops / 1e9:.2f} | "
                f"{c.intermediate_bytes / mib:.1f} |"
            )
    return "\n".join(lines)


def _balance_table() -> str:
    """``max / mean`` useful causal pairs per device for each layout (exact fractions)."""
    from attnref._src.formulations.distributed import layout as seq_layout
    from attnref._src.formulations.distributed.cost import load_balance

    lines = [
        "| P | T | " + " | ".join(seq_layout.LAYOUTS) + " |",
        "|---|---|" + "---|" * len(seq_layout.LAYOUTS),
    ]
    for p in (2, 4, 8):
        for t in (1000, 1024, 4096):
            cells = [f"{float(load_balance(t, p, layout)):.4f}" for layout in seq_layout.LAYOUTS]
            lines.append(f"| {p} | {t} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _distributed_name(fn: Callable[..., Any]) -> str:
    """``attnref.distributed.<name>`` where that namespace exports ``fn``, else
    :func:`public_name` (the namespace joins :data:`NAMESPACES` with the family's registration)."""
    import attnref.distributed

    name = fn.__name__
    if name in attnref.distributed.__all__ and getattr(attnref.distributed, name) is fn:
        return f"attnref.distributed.{name}"
    return public_name(fn)


def _scheme(f: Formulation) -> str:
    model = f.cost_model
    if model is None:
        raise ValueError(f"{f.id}: a distributed scheme without a cost model")
    comm = inspect.getdoc(model) or ""
    return (
        f"### {f.title} (`{f.id}`)\n\n"
        f"$$\n{f.equation}\n$$\n\n"
        f"{f.summary}\n\n"
        f"**Kernel.** `{_distributed_name(f.native)}`; row form `{_distributed_name(f.apply)}` "
        f"([page](formulations/{f.id}.md)).\n\n"
        f"**Cost.** {f.cost}\n\n"
        f"**Per-device model** (`{model.__module__}.{model.__name__}`). {comm}\n\n"
        f"**Citation.** {f.citation}"
    )


def _bench_section(existing: str) -> str:
    """The marked benchmark section of ``existing`` (the page as it is), or a placeholder."""
    start, end = f"<!-- {BENCH_SECTION}:start -->", f"<!-- {BENCH_SECTION}:end -->"
    if start in existing and end in existing:
        body = existing.split(start, 1)[1].split(end, 1)[0].strip("\n")
    else:
        body = (
            "## Benchmark\n\nNot run yet: `python benchmarks/bench_distributed.py --out "
            "docs/distributed.md` writes this section and `docs/img/distributed.png`."
        )
    return f"{start}\n{body}\n{end}"


def render_distributed(existing: str = "") -> str:
    """``docs/distributed.md``: the layouts, every entry of the distributed family (equation,
    citation, cost, per-device communication model), the communication and load balance tables,
    and the benchmark section kept from ``existing``.

    Args:
        existing: The page as it is now ('' for none): its benchmark section (written by
            ``benchmarks/bench_distributed.py``) is kept verbatim.

    Returns:
        The page's Markdown text.
    """
    import attnref.distributed  # noqa: F401  (registers the schemes)
    from attnref._src.formulations.distributed import cost as dcost
    from attnref._src.formulations.distributed.family import GRADIENTS

    schemes = "\n\n".join(_scheme(f) for f in _distributed())
    r = REFERENCE
    return (
        "# Distributed attention: the same function, computed on a mesh\n\n"
        "The distributed family (`attnref.distributed`) computes the softmax family's function "
        "in pieces on the devices of a `jax.sharding.Mesh` (`shard_map` with `ppermute`, "
        "`all_gather`, `all_to_all`, `psum`). Each scheme is a registry entry whose kernel level "
        "takes the layout and options of `attnref.dot_product_attention` plus `mesh` and "
        "`axis_name` (global arrays in, global arrays out) and whose row form is checked against "
        "the float64 oracle like every other entry. On one host, "
        "`XLA_FLAGS=--xla_force_host_platform_device_count=8` (set before JAX starts) gives 8 "
        "virtual CPU devices.\n\n"
        "## Token layouts\n\n"
        "Sequence-parallel schemes give device `d` the queries (and K/V chunk) at the global "
        "positions `positions(T', P, layout)[d]` (`attnref._src.formulations.distributed.layout`): "
        "**contiguous** (ring, Ulysses) `d c .. d c + c - 1` with `c = T' / P`; **striped** "
        "`d, d + P, d + 2P, ...`; **zigzag** (zigzag ring, all-gather) the sequence in `2P` "
        "chunks, device `d` holding chunks `d` and `2P - 1 - d`. `T = 16` tokens on `P = 4` "
        "devices:"
        f"\n\n{_positions_table(16, 4)}\n\n"
        "**Padding.** A length that `P` (`2P` for zigzag) does not divide is padded inside to "
        "`T'`, the next multiple: padded keys are never attended (the allowed rule tests "
        "`j < S`), padded queries are dropped, so every `T, S >= 0` gives the exact answer. "
        "`T = 10` on `P = 4` (padding in italics; contiguous and striped pad to 12, zigzag to "
        f"16):\n\n{_positions_table(10, 4)}\n\n"
        f"## Schemes\n\n{schemes}\n\n"
        f"{GRADIENTS}\n\n"
        "## Communication and work per device\n\n"
        "Every cost model (`attnref.costs.cost` on `Dims(..., devices=P)`) counts per device, as "
        "XLA's `cost_analysis()` of the SPMD program does, and lists the scheme's collectives "
        "(`attnref._src.core.cost.Collective`: kind, operand bytes per call, calls). What a device "
        "sends per call follows the bandwidth-optimal algorithms: a permute sends its operand, a "
        "ring all-gather its shard `P - 1` times, an all-to-all `(P - 1)/P` of its operand, a ring "
        "all-reduce `2 (P - 1)/P`. `tests/test_distributed_cost.py` checks the matmul FLOPs, "
        "transcendentals and per-call collective bytes against the compiled HLO "
        "(`attnref._src.core.cost.hlo_collectives`, `while` trip counts included) exactly, at "
        f"`P` = 1, 2 and 4. On B = {r['batch']}, T = S = {r['t']}, H = {r['heads']} heads, "
        f"d_model = {r['d_model']}, d_k = d_v = {r['d_k']}, float32, P = {r['devices']}:"
        f"\n\n{_communication_table()}\n\n"
        "Tensor parallelism's matmul includes the projections of its `H/P` heads; the "
        "sequence-parallel rows include the row form's projections on all tokens (striped, "
        "zigzag, all-gather: XLA's partitioner does not shard through the layout's gather) or "
        "on the device's own (ring, Ulysses). Around the `shard_map`, the partitioner may add "
        "collectives of its own to reshard the global arrays; the benchmark below measures them "
        "separately.\n\n"
        "## Causal load balance\n\n"
        f"{dcost.CLOSED_FORMS}\n\n"
        "`balance = max_d / mean_d` of the allowed (query, key) pairs per device under causal "
        "self-attention (`attnref._src.formulations.distributed.cost.load_balance`; `tests/"
        "test_distributed_cost.py` checks it against a brute-force count and the closed forms):"
        f"\n\n{_balance_table()}\n\n"
        "All-gather context parallelism uses the zigzag layout (its balance is zigzag's); "
        "Ulysses and tensor parallelism split heads, so every device does the same causal work. "
        "The ring skips a step whose chunk no local query may read, so on the contiguous layout "
        "device `d` computes `d + 1` of its `P` pieces under a causal mask.\n\n"
        f"{_bench_section(existing)}\n\n"
        "*Generated from the registry and the cost models by `python -m attnref.pages` (the "
        "benchmark section by `benchmarks/bench_distributed.py`); "
        "`tests/test_distributed_cost.py` checks it is current.*\n"
    )


def write_distributed(path: Path) -> Path:
    """Regenerate ``path`` (``docs/distributed.md``), keeping its benchmark section."""
    existing = path.read_text() if path.exists() else ""
    path.write_text(render_distributed(existing))
    return path


def main() -> None:
    """Regenerate ``docs/formulations/`` and ``docs/distributed.md`` (``python -m attnref.pages``)."""
    import attnref  # noqa: F401  (registers the formulations)

    docs = Path(__file__).resolve().parents[3] / "docs"
    for p in write(docs / "formulations"):
        print(p)
    print(write_distributed(docs / "distributed.md"))
