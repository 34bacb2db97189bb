"""A failing call's inputs (:func:`call_inputs`) and the Python that rebuilds and checks it
(:func:`problem_replay`), for :class:`PropertyResult`."""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from attnref import strategies as ast
from attnref._src.kit.conformance.references import to_target

# Arrays above this many elements are left out of ConformanceReport.to_dict (shape and dtype kept).
JSON_MAX_ELEMENTS = 10_000


def target_call(target: str) -> tuple[str, str]:
    """``(the Python naming the target, its import)``: ``load_target(...)`` for a loadable
    ``module:function``, else ``fn`` (the user's function) and no import."""
    if re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*", target):
        return f"load_target({target!r})", ", load_target"
    return "fn", ""


def call_inputs(p: ast.KernelProblem, cotangent: Any = None) -> dict[str, Any]:
    """The call as keyword arguments: ``query``, ``key``, ``value``, its options, and
    ``cotangent`` for a gradient call."""
    out: dict[str, Any] = {"query": p.q, "key": p.k, "value": p.v, **p.options}
    if cotangent is not None:
        out["cotangent"] = np.asarray(cotangent)
    return {k: np.array(v) if isinstance(v, np.ndarray) else v for k, v in out.items()}


def _pattern(shape: tuple[int, ...]) -> str:
    """The :data:`attnref.strategies.BROADCAST_SHAPES` pattern of a rank-4 shape."""
    return "".join("1" if n == 1 else ch for ch, n in zip("BNTS", shape, strict=True))


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, tuple) or isinstance(b, tuple):
        return (
            isinstance(a, tuple)
            and isinstance(b, tuple)
            and len(a) == len(b)
            and all(_same(x, y) for x, y in zip(a, b, strict=True))
        )
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a), np.asarray(b)
        return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b, equal_nan=True)
    return bool(a == b)


def rebuild(p: ast.KernelProblem, signature: str) -> tuple[ast.KernelProblem, str] | None:
    """``(problem, its Python)``: the :func:`attnref.strategies.make_kernel_problem` call giving
    ``p`` exactly, or ``None`` (the property changed the problem after building it)."""
    if p.kind not in ast.MASK_KINDS + ast.PRODUCTION_KINDS:
        return None
    defaults = {"identical": "none", "masked_rows": "zeros", "causal_alignment": "top_left"}
    kw: dict[str, Any] = {k: getattr(p, k) for k, d in defaults.items() if getattr(p, k) != d}
    if signature != "qkv_mask":
        if p.kind in ast.MASK_SHAPE_KINDS and "mask" in p.options:
            kw["mask_shape"] = _pattern(np.shape(p.options["mask"]))
        if p.kind in ast.BIAS_SHAPE_KINDS and "bias" in p.options:
            kw["bias_shape"] = _pattern(np.shape(p.options["bias"]))
    try:
        built = ast.make_kernel_problem(p.config, p.kind, p.seed, **kw)
    except ValueError:
        return None
    seen = to_target(built, signature)
    arrays = all(_same(x, y) for x, y in ((seen.q, p.q), (seen.k, p.k), (seen.v, p.v)))
    options = set(seen.options) == set(p.options) and all(
        _same(seen.options[k], p.options[k]) for k in p.options
    )
    if not (arrays and options):
        return None
    args = ", ".join(
        [repr(p.config), repr(p.kind), str(p.seed), *(f"{k}={v!r}" for k, v in kw.items())]
    )
    return built, f"p = make_kernel_problem({args})"


def problem_replay(
    p: ast.KernelProblem, cotangent: Any, signature: str, target: str, distributed: bool
) -> str | None:
    """One line of Python that rebuilds the call (:func:`rebuild`), calls the target
    (``load_target(target)`` or ``fn``) and asserts it against the oracle
    (:func:`attnref.testing.assert_matches_oracle` or ``assert_grads_match_oracle``); ``None``
    where it cannot be rebuilt, or for a distributed or ``torch`` target."""
    if distributed or signature == "torch":  # torch: the inputs are tensors in another layout
        return None
    found = rebuild(p, signature)
    if found is None:
        return None
    built, line = found
    fn, load = target_call(target)
    assertion = "assert_matches_oracle" if cotangent is None else "assert_grads_match_oracle"
    imports = [
        "from attnref.strategies import Config, make_kernel_problem",
        f"from attnref.testing import {assertion}{load}",
    ]
    semantics = "".join(f", {k}={v!r}" for k, v in built.kwargs.items() if k not in built.options)
    if signature == "qkv_mask":
        call, opts = "f(p.q, p.k, p.v, p.allowed())", "mask=p.allowed()" + semantics
    else:
        call, opts = "f(p.q, p.k, p.v, **p.options)", "**p.kwargs"
    if cotangent is None:
        check = f"assert_matches_oracle({call}, p.q, p.k, p.v, {opts})"
    else:
        c = p.config
        seeded = np.random.default_rng([p.seed, 1]).standard_normal((c.b, c.t, c.n, c.h_v))
        if not _same(seeded.astype(c.dtype), np.asarray(cotangent)):
            return None
        imports.append("import jax, numpy as np")
        shape = np.shape(cotangent)
        cot = f"cot = np.random.default_rng([{p.seed}, 1]).standard_normal({shape})"
        cot += f".astype({c.dtype!r})"
        body = call.replace("f(p.q, p.k, p.v", "f(q, k, v")
        check = (
            f"{cot}; _, pull = jax.vjp(lambda q, k, v: {body}, p.q, p.k, p.v); "
            f"assert_grads_match_oracle(pull(cot), p.q, p.k, p.v, cot, {opts})"
        )
    return "; ".join([*imports, f"f = {fn}", line, check])
