"""Render the per-formulation Markdown pages of ``docs/formulations/`` from the registry."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

from attnref._src.catalog import HELPERS
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
    "kernel": "Kernel level, the layout of `jax.nn.dot_product_attention`: `q [..., T_q, N, d_k]`, "
    "`k [..., T_k, K, d_k]`, `v [..., T_k, K, d_v]` -> `[..., T_q, N, d_v]` (heads on the "
    "second-to-last axis; `K` K/V heads shared by groups of `N / K` query heads); `apply` is the "
    "multi-head form on rows `x_q [..., T_q, d_model]`. Linear family masks: `causal` (needs "
    "`T_q == T_k`) and `key_mask [..., T_k]`; softmax family: every option of "
    "`attnref.dot_product_attention` (see [the kernel level](../kernel.md)).",
}


_FAMILY_NOTE = {
    "softmax": "Scale $1/\\sqrt{d_k}$ unless `scale=` is given. A fully masked query row gets "
    "zero attention weights, so the output there is $b_O$ (see [conventions](../conventions.md)).",
    "rope": "Scale $1/\\sqrt{d_k}$ unless `scale=` is given; positions default to `arange(T)`; "
    "`convention='rotate_half'` pairs $(x_p, x_{p + d/2})$, `'interleaved'` pairs $(x_{2p}, "
    "x_{2p+1})$. Fully masked rows as in the softmax family (output $b_O$); see "
    "[RoPE](../rope.md).",
    "linear": "Feature map $\\phi$ from `attnref.elu_plus_one`, `attnref.relu_features`, "
    "`attnref.identity_features`, `attnref.taylor2` or `attnref.favor_plus`. Denominator policy: "
    "`eps_policy='add'` divides by $D_i + \\epsilon$ (fast-transformers), `'clamp'` by "
    "$\\max(D_i, \\epsilon)$; the default $\\epsilon = 0$ is the exact ratio, and an exactly "
    "zero adjusted denominator (no allowed key) gives a zero output. With the signed `identity` "
    "map the denominator can be near zero and the ratio grows like $1/D_i$; attnref reproduces "
    "that rather than hiding it (see [linear attention](../linear_attention.md)).",
}


def _exported_name(fn: Callable[..., Any]) -> str:
    """The name a page shows for ``fn``: ``attnref.<__name__>`` (``tests/test_docs_pages.py``
    checks that it resolves to ``fn`` itself)."""
    return f"attnref.{fn.__name__}"


def _code_block(fn: Callable[..., Any]) -> str:
    """``fn``'s public name and its ``inspect.signature``, verbatim, as a Python code block."""
    return f"```python\n{_exported_name(fn)}{inspect.signature(fn)}\n```"


def _code(f: Formulation) -> str:
    family = f"registry `apply` ({f.family} family)"
    if f.native is f.apply:
        text = f"**Code.** Native form and {family}:\n\n{_code_block(f.native)}"
    else:
        text = (
            f"**Code.** Native form:\n\n{_code_block(f.native)}\n\n"
            f"{family[0].upper()}{family[1:]}:\n\n{_code_block(f.apply)}"
        )
    helpers = [h for h in HELPERS if h.formulation == f.id]
    if helpers:
        text += "\n\n**Helpers** (exported multi-head functions that are not registry entries):"
        for h in helpers:
            text += f"\n\n{_code_block(h.fn)}\n\n{h.reason}"
    return text


def render(f: Formulation) -> str:
    """The Markdown page of one formulation."""
    doc = inspect.getdoc(f.native) or ""
    module = inspect.getmodule(f.native)
    details = (inspect.getdoc(module) or "") if module is not None else ""
    return (
        f"# {f.title}\n\n"
        f"Registry id: `{f.id}` · convention: {f.convention}\n\n"
        f"$$\n{f.equation}\n$$\n\n"
        f"{f.summary}\n\n"
        f"**Cost.** {f.cost}\n\n"
        f"**Convention.** {_CONVENTION_NOTE[f.convention]} {_FAMILY_NOTE[f.family]}\n\n"
        f"{_code(f)}\n\n"
        f"{doc}\n\n"
        f"**Details** (from `{f.native.__module__}`).\n\n{details}\n\n"
        f"**Citation.** {f.citation}\n\n"
        "*This page is generated from the registry by `python -m attnref._src.docs`; "
        "`tests/test_docs_pages.py` checks it is current and that every name and signature on it "
        "is the code's.*\n"
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


if __name__ == "__main__":
    import attnref  # noqa: F401  (registers the formulations)

    for p in write(Path(__file__).resolve().parents[2] / "docs" / "formulations"):
        print(p)
