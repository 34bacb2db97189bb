"""Registry completeness, the helpers against the oracle, README tour runs, and the CLI.

The generated pages are checked by ``tests/test_docs_pages.py``.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import attnref
from attnref import cli, oracle, tolerance
from attnref import strategies as ast
from attnref.testing import assert_within_bound

ROOT = Path(__file__).resolve().parents[1]


def test_every_entry_is_complete():
    seen = set()
    for f in attnref.formulations():
        assert re.fullmatch(r"[a-z_]+", f.id) and f.id not in seen
        seen.add(f.id)
        assert f.title and f.citation and f.summary and f.convention and "O(" in f.cost
        assert "\\" in f.equation, f.id
        assert any(word in f.equation for word in f.family.equation_symbols), f.id
        assert callable(f.apply) and callable(f.native)
        assert f.apply.__name__ == f"{f.id}_attention", f.id  # the multi-head row form's name
        assert f.apply.__doc__ and f.native.__doc__
        assert f.causal_modes and set(f.causal_modes) <= {False, True}
        assert f.cost_model is not None and f.cost_model.__name__ == f"{f.id}_cost"
    assert len(attnref.ids("softmax")) >= 7 and len(attnref.ids("linear")) >= 6


def test_a_family_is_an_object():
    """Each entry's family carries its oracle and bound; families compare by identity (code calls
    a family, it never compares names); filters take the object or its name."""
    fams = list(dict.fromkeys(f.family for f in attnref.formulations()))
    assert [fam.name for fam in fams] == ["softmax", "linear", "rope", "distributed"]
    for fam in fams:
        assert isinstance(fam, attnref.Family)
        assert fam != fam.name and sum(other is fam for other in fams) == 1
        assert attnref.formulations(fam) == attnref.formulations(fam.name)
        assert fam.oracle.__module__.startswith("attnref.oracle.")
        assert fam.bound.__module__.startswith("attnref.tolerance.")
        assert fam.signature.startswith("apply(params, x_q, x_kv=None, *,")
        assert fam.note and fam.equation_symbols and "residual" in fam.static_argnames
    assert sum(len(attnref.ids(fam)) for fam in fams) == len(attnref.ids())


def test_registry_order_does_not_depend_on_import_order():
    """Entries are listed in the registry's module order, whichever module was imported first."""
    code = "import attnref.rope, attnref.linear, attnref; print(','.join(attnref.ids()))"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert run.stdout.strip().split(",") == list(attnref.ids())


def test_helpers_match_the_oracle():
    """The helpers of ``attnref.pages.HELPERS`` that no other test checks against the
    oracle: ``decode_attention`` on a causal problem, ``sum_i head_outputs_i + b_O`` (both with
    the derived output bound, which holds for any order of the sums over keys and heads), and
    ``attention_weights`` equal to the probes' scores (``tests/test_probes.py`` checks those)."""
    bucket = ast.WEIGHT_BUCKETS[2]
    p = ast.make_attention_problem(bucket, "combined", 7, np.float32)  # causal & padding & bias
    args, inputs = (p.params, p.x_q, p.x_kv), p.inputs()
    ref = oracle.attention(*args, **inputs)
    bound = tolerance.attention_error_bound(*args, dtype=p.dtype, **inputs)
    assert_within_bound(
        attnref.decode.decode_attention(*args, **inputs), ref, bound, label="decode"
    )
    heads = np.asarray(attnref.head_outputs(*args, **inputs), np.float64)
    y = heads.sum(axis=-3) + np.asarray(p.params.b_o, np.float64)
    assert_within_bound(y, ref, bound, label="head_outputs")
    np.testing.assert_array_equal(
        np.asarray(attnref.attention_weights(*args, **inputs)),
        np.asarray(attnref.interp.attention_probes(*args, **inputs).scores),
    )


def test_docs_exist():
    for name in ("conventions.md", "tolerances.md"):
        assert (ROOT / "docs" / name).exists()


def test_readme_opens_with_the_two_commands():
    """The fresh-machine commands, one block each (pasting the first must not start the
    suite); the README's tour and every other block are run by ``tests/test_docs_examples.py``."""
    text = (ROOT / "README.md").read_text()
    before, first, rest = text.split("```bash\n", 2)
    assert before.splitlines()[0] == "# attnref"
    assert all(line.startswith("<!--") for line in before.splitlines()[1:] if line.strip())
    job = first.split("```", 1)[0].splitlines()
    between, tests = first.split("```", 1)[1], rest.split("```", 1)[0].splitlines()
    assert all(line.startswith("<!--") for line in between.splitlines() if line.strip())
    # Each command makes its own virtual environment (PEP 668: the system pip may refuse).
    assert len(job) == 1 and "pytest" not in job[0]
    assert job[0].startswith("python3 -m venv .venv && .venv/bin/pip install . && ")
    assert ".venv/bin/attnref report" in job[0]
    assert len(tests) == 1 and "attnref report" not in tests[0]
    assert tests[0].startswith("python3 -m venv .venv && .venv/bin/pip install ")
    assert ".venv/bin/python -m pytest -q" in tests[0]


def test_cli_report_table_and_json(capsys):
    args = [
        "report",
        "--t-q",
        "5",
        "--t-k",
        "5",
        "--batch",
        "1",
        "--d-model",
        "8",
        "--num-heads",
        "2",
        "--d-k",
        "2",
        "--d-v",
        "3",
    ]
    # One formulation of each family and convention here; every id is in the default-problem
    # report test below.
    some = ["concat", "column", "graph", "blockwise", "kv_cache", "rope", "linear_recurrent"]
    chosen = ["--formulations", ",".join(some)]
    assert cli.main([*args, *chosen, "--no-progress", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    for fid in some:
        assert out.count(f"\n{fid} ") == 2, fid  # one float32 row and one float64 row
    assert cli.main([*args, "--json", "--formulations", "concat,graph", "--repeats", "2"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [r["id"] for r in data["rows"]] == ["concat", "graph", "concat", "graph"]
    for r in data["rows"]:
        assert r["bound_ratio"] <= 1.0
        assert r["max_rel_error"] < (1e-12 if r["dtype"] == "float64" else 1e-5)
    for r in data["rows"]:  # the cost columns: model dots == XLA's, times measured
        assert r["model_matmul_flops"] == r["xla_dot_flops"] > 0
        assert r["model_flops"] >= r["model_matmul_flops"] and r["median_us"] > 0
        assert r["temp_bytes"] >= 0 and r["xla_flops"] >= r["xla_dot_flops"]
    assert cli.main(["list"]) == 0
    assert "Vaswani" in capsys.readouterr().out


def test_report_default_problem_float64_below_1e12():
    """The issue's acceptance criterion on the default problem, computed in a fresh interpreter.

    In four of six full runs of the suite under xdist (never when this file ran alone, nor with
    the files tried beside it), the worker running this test died of a segfault inside XLA's CPU
    ``executable.serialize()`` (jax 0.10.2) while it wrote one of these float64 programs to the
    persistent compilation cache; turning the cache off from inside the test does not help, as
    JAX decides once per process. A segfault is not a result of the test, so the report runs in
    a subprocess of its own (no persistent cache, none of the worker's earlier state) and the
    test checks what it prints."""
    code = (
        "import json\n"
        "from attnref import report\n"
        "rows = report.run(report.Problem(), dtypes=('float64',), repeats=1)\n"
        "print(json.dumps([[r.id, r.max_rel_error, r.bound_ratio] for r in rows]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
        env={**os.environ, "JAX_ENABLE_X64": "1"},  # as the suite runs (tests/conftest.py)
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    assert {r[0] for r in rows} == set(attnref.ids())
    assert max(r[1] for r in rows) < 1e-12
    assert all(np.isfinite(r[2]) and r[2] <= 1 for r in rows)


def test_cli_plot_writes_pngs(tmp_path, capsys):
    """``--plot DIR`` sweeps T and writes two log-log PNGs (matplotlib is the ``plot`` extra,
    which .ci/run installs; without it the command exits with an install hint instead)."""
    pytest.importorskip("matplotlib", reason="the optional 'plot' extra is not installed")
    args = [
        "report",
        "--batch",
        "1",
        "--d-model",
        "8",
        "--num-heads",
        "1",
        "--d-k",
        "2",
        "--d-v",
        "2",
        "--dtypes",
        "float32",
        "--formulations",
        "concat,linear_associative",
        "--repeats",
        "1",
        "--plot",
        str(tmp_path),
    ]
    assert cli.main(args) == 0
    for name in ("cost_vs_T.png", "time_vs_T.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert "wrote" in capsys.readouterr().err


# What a public function may compile besides its one program: the placement of a caller's
# argument over a mesh's devices (JAX's "_multi_slice" cuts it into the shards). Lifting or
# casting a NumPy argument compiles nothing ("stage" and "convert_element_type" programs would
# be one more per new shape: ``attnref._src.core.checks.device_array``).
CONVERSIONS = {"jit(_multi_slice)"}
# The one program: ``entry.compiled``'s, or ``entry.checked_program``'s (value checks inside).
PROGRAMS = {"jit(_program)", "jit(_checked_program)"}


def test_an_eager_call_is_one_compiled_program():
    """Each registered formulation, called eagerly, validates and then computes in one compiled
    program (``attnref._src.core.entry.compiled``): no formula or guard step dispatched op by
    op, which would compile one program per operation at every new shape and dispatch each one
    at every call (the RoPE forms once did: their inputs were not a pytree). Counted with JAX's
    own compile events after ``jax.clear_caches()``, on a self-attention problem with a causal
    mask and the family's required keywords; likewise the MLA forms with given positions, the
    latent cache, RoPE on its own, the masked softmax, the state merges, the three kernels
    with every option at once, the one-query and graph forms, decoding with a window, ALiBi,
    the mask helpers, the decoding steps, the paged cache, the column form, the merged
    matrices, the composition scores and the RoPE matrices. A second decoding step at a new
    position compiles nothing (given positions are traced, not static)."""
    import jax

    problem = attnref.report.Problem(batch=1, t_q=9, t_k=9, num_heads=2, d_model=12, d_k=6, d_v=4)
    params = attnref.init_params(0, d_model=12, num_heads=2, d_k=6, d_v=4)
    x = np.random.default_rng(0).standard_normal((1, 9, 12)).astype(np.float32)
    compiled: list[str] = []

    def listen(event: str, duration: float, **kw) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compiled.append(kw.get("fun_name", "?"))

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        jax.clear_caches()
        for f in attnref.formulations():
            example = f.family.example(problem, f.causal_modes[-1])
            kw = {**example.kwargs, **f.family.required_kwargs(problem)}
            compiled.clear()
            f.apply(params, x, None if example.self_attention else x, **kw)
            programs = [n for n in compiled if n not in CONVERSIONS]
            assert programs == ["jit(_program)"], (f.id, compiled)
        mla = attnref.mla.init_mla_params(0, d_model=12, num_heads=2, d_c=6, d_nope=4, d_rope=2)
        causal = np.tril(np.ones((9, 9), bool))
        heads = x.reshape(1, 9, 2, 6)
        o, lse = attnref.dot_product_attention(heads, heads, heads, return_lse=True)
        x_jax = jax.numpy.asarray(x)  # a JAX array in, for one helper at least
        empty = attnref.decode.init_cache(params, 1, 16)
        pages, table = heads.reshape(3, 3, 2, 6), np.array([[2, 0, 1]])  # 3 pages of 3 slots
        calls = {
            "mla_attention": lambda: attnref.mla.mla_attention(
                mla, x, mask=causal, positions_q=np.arange(9) + 3
            ),
            "mla_absorbed_attention": lambda: attnref.mla.mla_absorbed_attention(
                mla, x, mask=causal, positions_q=np.arange(9) + 3
            ),
            "mla_latent_cache": lambda: attnref.mla.mla_latent_cache(mla, x),
            "apply_rope": lambda: attnref.rope.apply_rope(heads, np.arange(9)),
            "apply_rope_complex": lambda: attnref.rope.apply_rope_complex(heads, np.arange(9)),
            "masked_softmax": lambda: attnref.masked_softmax(x_jax, x > 0),
            "merge_states": lambda: attnref.merge_states(o, lse, o, lse),
            "merge_state_stack": lambda: attnref.merge_state_stack(
                np.stack([o, o]), np.stack([lse, lse])
            ),
            "soft_search": lambda: attnref.soft_search(params, x[0, 0], x[0], mask=x[0, :, 0] > 0),
            "graph_message_passing": lambda: attnref.graph_message_passing(
                params, x[0], x[0], np.array([0, 1, 2]), np.array([1, 2, 2])
            ),
            "decode_attention": lambda: attnref.decode.decode_attention(params, x, window=4),
            "alibi_bias": lambda: attnref.alibi_bias(
                attnref.alibi_slopes(2), 9, 9, query_seq_lengths=np.array([9])
            ),
            "padding_mask": lambda: attnref.padding_mask(np.array([3, 9]), 9),
            "combine_masks": lambda: attnref.combine_masks(causal, x[0, :, :9] > 0),
            "mask_to_bias": lambda: attnref.mask_to_bias(causal),
            # the decoding functions' overflow checks are in the program (checkify)
            "decode.step": lambda: attnref.decode.step(params, empty, x[:, :3]),
            "decode.scan": lambda: attnref.decode.scan(params, empty, x[:, :5]),
            "decode.cache_attend": lambda: attnref.decode.cache_attend(
                empty, heads[:, :2], query_positions=np.array([[0, 1]])
            ),
            "decode.paged_attention": lambda: attnref.decode.paged_attention(
                heads[:, :1], pages, pages, table, np.array([7])
            ),
            "decode.paged_kv_append": lambda: attnref.decode.paged_kv_append(
                pages, pages, table, np.array([5]), heads[:, :2], heads[:, :2]
            ),
            "column_form": lambda: attnref.column_form(params, np.swapaxes(x, -1, -2)),
            "interp.patterns": lambda: attnref.interp.patterns(params, x),
            "interp.messages": lambda: attnref.interp.messages(params, x),
            "interp.w_p": lambda: attnref.interp.w_p(params),
            "interp.composition_scores": lambda: attnref.interp.composition_scores(
                params, attnref.init_params(1, d_model=12, num_heads=2, d_k=6, d_v=4), "v"
            ),
            "rope.rope_rotation": lambda: attnref.rope.rope_rotation(np.arange(5), 6),
            "rope.rope_pattern_matrices": lambda: attnref.rope.rope_pattern_matrices(
                params, np.arange(3)
            ),
        }
        # the kernels with every option at once (the lengths' range is checked in NumPy)
        rng = np.random.default_rng(1)
        q = rng.standard_normal((2, 9, 4, 8)).astype(np.float32)
        kv = rng.standard_normal((2, 9, 2, 8)).astype(np.float32)
        options = {
            "mask": np.tril(np.ones((1, 1, 9, 9), bool)),
            "bias": rng.standard_normal((1, 4, 9, 9)).astype(np.float32),
            "query_seq_lengths": np.array([9, 5]),
            "key_value_seq_lengths": np.array([7, 9]),
            "segment_ids": np.array([[0] * 4 + [1] * 5, [0] * 9]),
            "local_window_size": (3, 0),
            "softcap": 20.0,
            "sinks": np.zeros(4, np.float32),
            "dropout_mask": rng.random((2, 4, 9, 9)) > 0.1,
            "dropout_rate": 0.1,
            "return_lse": True,
            "is_causal": True,
        }
        for kernel in (
            attnref.dot_product_attention,
            attnref.blockwise_dot_product_attention,
            attnref.split_kv_dot_product_attention,
        ):
            calls[kernel.__name__] = functools.partial(kernel, q, kv, kv, **options)
        for name, call in calls.items():
            compiled.clear()
            call()
            programs = [n for n in compiled if n not in CONVERSIONS]
            assert len(programs) == 1 and programs[0] in PROGRAMS, (name, compiled)
        # given positions are traced in an eager call: a decoding loop compiles once
        cache = attnref.mla.mla_latent_cache(mla, x)
        for step in (9, 10):
            compiled.clear()
            attnref.mla.mla_cache_attention(mla, x[:, :1], cache, positions_q=np.array([step]))
            assert (compiled == []) == (step == 10), compiled
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
