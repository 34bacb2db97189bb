"""Render the per-formulation Markdown pages of ``docs/formulations/`` from the registry."""

from __future__ import annotations

import inspect
from pathlib import Path

from attnref._src.registry import Formulation, formulations

_CONVENTION_NOTE = {
    "row": "Row vectors: tokens are rows, `x_q [..., T_q, d_model]`, output `[..., T_q, d_model]`.",
    "column": "Column vectors: tokens are columns, `X [..., d_model, T]`, output "
    "`[..., d_model, T_q]`; masks are `[..., T_k, T_q]` and the attention matrix is "
    "column-stochastic. `apply` is the row-convention adapter (transposes in and out).",
    "single-query": "One query row `x_q [d_model]` against `X_kv [T_k, d_model]`; `apply` vmaps "
    "it over queries and batch dims.",
    "graph": "Nodes and an edge list `(senders, receivers)`; the row-convention `apply` uses the "
    "complete bipartite graph with the mask as adjacency (static shapes, jit-able).",
}


def render(f: Formulation) -> str:
    native = f"attnref.{f.native.__name__}"
    apply = f"attnref.{f.apply.__name__}"
    doc = inspect.getdoc(f.native) or ""
    module = inspect.getmodule(f.native)
    details = (inspect.getdoc(module) or "") if module is not None else ""
    return (
        f"# {f.title}\n\n"
        f"Registry id: `{f.id}` · convention: {f.convention}\n\n"
        f"$$\n{f.equation}\n$$\n\n"
        f"{f.summary}\n\n"
        f"**Convention.** {_CONVENTION_NOTE[f.convention]} Scale $1/\\sqrt{{d_k}}$ unless "
        "`scale=` is given. A fully masked query row gets zero attention weights, so the output "
        "there is $b_O$ (see [conventions](../conventions.md)).\n\n"
        f"**Code.** Native form: `{native}`; uniform row signature: `{apply}(params, x_q, "
        "x_kv=None, *, mask=None, bias=None, scale=None, residual=False)`.\n\n"
        f"{doc}\n\n"
        f"**Details** (from `{f.native.__module__}`).\n\n{details}\n\n"
        f"**Citation.** {f.citation}\n\n"
        "*This page is generated from the registry by `python -m attnref._src.docs`; "
        "`tests/test_registry.py` checks it is current.*\n"
    )


def write(directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for f in formulations():
        path = directory / f"{f.id}.md"
        path.write_text(render(f))
        paths.append(path)
    return paths


if __name__ == "__main__":
    import attnref  # noqa: F401  (registers the formulations)

    for p in write(Path(__file__).resolve().parents[2] / "docs" / "formulations"):
        print(p)
