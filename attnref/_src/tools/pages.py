"""The per-formulation Markdown pages of ``docs/formulations/`` (``python -m attnref.pages``),
each with the source of the function that computes it (``Formulation.formula``) included by
Sphinx's ``literalinclude`` at build time, so the page cannot drift from the code.

The export rule (checked by ``tests/test_docs_pages.py``): every registered formulation's
``native`` and ``apply`` are exported under their ``__name__``, from ``attnref`` or from one of
its namespaces (:data:`NAMESPACES`), and its page shows that qualified name
(:func:`public_name`); every exported function taking the registry's row signature
``(params, x_q, x_kv, ...)`` is a registered ``native``/``apply`` or is listed in
:data:`HELPERS` with the reason it is not a registry entry, and the page of the formulation it
belongs to shows it.
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from attnref._src.core.family import public_path
from attnref._src.core.registry import Formulation, formulations
from attnref._src.formulations.kernel_forms import decode_attention
from attnref._src.formulations.standard import attention_weights, head_outputs
from attnref._src.interp.probes import attention_logits, attention_probes, residual_update
from attnref._src.tools.citations import formulation_bibtex
from attnref._src.tools.suite_pages import TESTS, tests_section

ROOT = Path(__file__).resolve().parents[3]  # the repository of this checkout

# Where a page may find a function, after the top level: the namespaces that export
# formulations and their helpers (the others hold the NumPy oracle and bounds, the models and
# the testing kits).
NAMESPACES = ("linear", "rope", "decode", "interp", "interop", "costs", "distributed")


class Helper(NamedTuple):
    """An exported function ``fn`` with the registry's row signature that is not a registry
    entry, the id of the ``formulation`` whose page lists it, and the ``reason`` why not
    (Markdown, shown on that page)."""

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
    """The name a page shows for ``fn`` (a registered ``native``/``apply`` or a helper):
    ``attnref.<name>`` if the top level exports it, else ``attnref.<namespace>.<name>`` for the
    first of :data:`NAMESPACES` that does; ``LookupError`` if none exports it under its
    ``__name__`` (the export rule)."""
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
    """An autodoc block for ``fn`` under its public name (``:no-index:``: the API reference is
    the indexed entry)."""
    return f"```{{eval-rst}}\n.. autofunction:: {public_name(fn)}\n   :no-index:\n```"


def formula_source(f: Formulation) -> tuple[str, str]:
    """Where ``f.formula`` (unwrapped) is defined: its file relative to the repository root and
    the qualified name ``literalinclude``'s ``:pyobject:`` takes (a nested function's outer one).

    Raises:
        ValueError: The formula is not defined in a file of this checkout.
    """
    fn = inspect.unwrap(f.formula)  # type: ignore[arg-type]
    path = Path(inspect.getsourcefile(fn) or "").resolve()
    if not path.is_relative_to(ROOT):
        raise ValueError(f"{f.id}: its formula is not defined in {ROOT}")
    return path.relative_to(ROOT).as_posix(), fn.__qualname__.split(".<locals>")[0]


def _formula(f: Formulation) -> str:
    """The source of the function that computes ``f``, included at build time."""
    path, qualname = formula_source(f)
    dedent = ":dedent:\n" if "." in qualname else ""  # a method: out of its class
    return (
        f"**Formula in code.** `{qualname}` in `{path}`, the function that computes it (read "
        f"from the source when the site is built):\n\n```{{literalinclude}} ../../{path}\n"
        f":pyobject: {qualname}\n"
        f":language: python\n{dedent}```"
    )


def _code(f: Formulation) -> str:
    family = f"registry `apply` ({f.family.name} family)"
    if f.native is f.apply:
        text = f"**Code.** Native form and {family}:\n\n{_autodoc(f.native)}"
    else:
        text = (
            f"**Code.** Native form:\n\n{_autodoc(f.native)}\n\n"
            f"{family[0].upper()}{family[1:]}:\n\n{_autodoc(f.apply)}"
        )
    if helpers := [h for h in HELPERS if h.formulation == f.id]:
        text += "\n\n**Helpers** (exported multi-head functions that are not registry entries):"
        text += "".join(f"\n\n{_autodoc(h.fn)}\n\n{h.reason}" for h in helpers)
    return text


_DIMS = re.compile(r"\[\s*\w+\s*,\s*['\"]([^'\"]*)['\"]\s*\]")


def _dims(annotation: Any) -> str | None:
    """``[..., T_q, d_model]`` from a jaxtyping annotation ``Float[ArrayLike, '... T_q
    d_model']`` (a string under ``from __future__ import annotations``); ``None`` if none."""
    m = _DIMS.search(annotation) if isinstance(annotation, str) else None
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
    """The Markdown page of registry entry ``f``, listing the property tests of ``tests_dir``
    that run it (default: ``tests/`` of this checkout)."""
    module = inspect.getmodule(f.native)
    details = (inspect.getdoc(module) or "") if module is not None else ""
    return (
        f"# {f.title}\n\n"
        f"Registry id: `{f.id}` · convention: {f.convention}\n\n"
        f"$$\n{f.equation}\n$$\n\n"
        f"{_formula(f)}\n\n"
        f"{f.summary}\n\n"
        f"**Cost.** {f.cost}\n\n"
        f"{_shapes(f)}\n\n"
        f"**Convention.** {_CONVENTION_NOTE[f.convention]} {f.family.note}\n\n"
        f"{_family(f)}\n\n"
        f"{tests_section(f, TESTS if tests_dir is None else tests_dir)}\n\n"
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
    paths = [directory / f"{f.id}.md" for f in formulations()]
    for f, path in zip(formulations(), paths, strict=True):
        path.write_text(render(f))
    return paths


def main() -> None:
    """``python -m attnref.pages``: write ``docs/formulations/`` and ``docs/distributed.md``."""
    import attnref  # noqa: F401  (registers the formulations)
    from attnref._src.tools.distributed_page import write_distributed

    for p in write(ROOT / "docs" / "formulations"):
        print(p)
    print(write_distributed(ROOT / "docs" / "distributed.md"))


# ----------------------------------------------------------------------------- the site's index

# `docs/<page>.md` or `docs/<page>.md#anchor` written as inline code, not already a link's text.
_DOCS_MENTION = re.compile(r"(?<!\[)`docs/([A-Za-z0-9_./-]+\.md)(#[A-Za-z0-9_-]+)?`(?!\]\()")
_FENCE = re.compile(r"^\s*(```|~~~)")


def link_docs_mentions(markdown: str, docs: Path) -> str:
    """``markdown`` (the README, as the site's index includes it) with each inline-code mention
    of an existing page of ``docs`` (`` `docs/atlas.md` ``), outside fenced code, made a link
    with that text (`` [`docs/atlas.md`](docs/atlas.md) ``; MyST's ``:relative-docs: docs/``
    then points it at the page)."""

    def link(m: re.Match[str]) -> str:
        if not (docs / m.group(1)).is_file():
            return m.group(0)
        return f"[`docs/{m.group(1)}{m.group(2) or ''}`](docs/{m.group(1)}{m.group(2) or ''})"

    out: list[str] = []
    fenced = False
    for line in markdown.splitlines(keepends=True):
        fence = _FENCE.match(line) is not None
        fenced ^= fence
        out.append(line if fenced or fence else _DOCS_MENTION.sub(link, line))
    return "".join(out)
