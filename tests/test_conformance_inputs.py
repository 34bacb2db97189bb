"""The conformance kit's failing inputs and its two length features.

* ``PropertyResult.inputs``: the failing call's arrays (equal to what
  ``make_kernel_problem`` builds for the reported case), and ``problem_replay``, a Python line
  that pastes and runs: it fails on the planted kernel and passes on a correct one.
* ``query_seq_lengths`` and ``key_value_seq_lengths`` (jax.nn's two arguments) are declared
  apart; ``seq_lengths`` still means both. A kernel that ignores one length argument fails the
  ``masks`` property through the kit's one-sided padding kind.

Planted kernels are jax.nn with one thing wrong; the checks are the kit's own (derived bounds)."""

from __future__ import annotations

import json
import re
import sys
import types

import jax
import numpy as np
import pytest

from attnref import strategies as ast
from attnref.conformance import Options, format_failure
from attnref.testing import DEFAULT_FEATURES, FEATURES, check_attention, production_plan

EXAMPLES = 3
BOTH = ("query_seq_lengths", "key_value_seq_lengths")


def _scale_one(q, k, v, bias=None, mask=None, **kw):
    """Planted: the logit scale 1 instead of 1/sqrt(H)."""
    kw.pop("scale", None)
    return jax.nn.dot_product_attention(q, k, v, bias, mask, scale=1.0, **kw)


def _frozen_keys(q, k, v, bias=None, mask=None, **kw):
    """Planted: no gradient reaches the keys (the forward is right)."""
    return jax.nn.dot_product_attention(q, jax.lax.stop_gradient(k), v, bias, mask, **kw)


def _drops(name):
    def fn(q, k, v, bias=None, mask=None, **kw):
        kw.pop(name, None)
        return jax.nn.dot_product_attention(q, k, v, bias, mask, **kw)

    fn.__name__ = f"ignores_{name}"
    return fn


# The planted kernels under a loadable name, so that the replay lines load them as users' do.
_MODULE = types.ModuleType("attnref_planted_kernels")
_MODULE.scale_one, _MODULE.frozen_keys = _scale_one, _frozen_keys
sys.modules[_MODULE.__name__] = _MODULE


# ----------------------------------------------------------------------------- inputs and replay


def test_failing_inputs_are_arrays_and_the_replay_line_runs():
    report = check_attention(
        _scale_one,
        properties=["oracle", "masks"],
        max_examples=EXAMPLES,
        target="attnref_planted_kernels:scale_one",
    )
    for r in report.results:
        assert r.status == "failed", r
        assert set(r.inputs) >= {"query", "key", "value"}
        assert all(isinstance(r.inputs[n], np.ndarray) for n in ("query", "key", "value"))
        # the line rebuilds these very arrays: run its make_kernel_problem part
        line = r.problem_replay
        assert line is not None and "make_kernel_problem(" in line
        build = line.split("; p = ", 1)[1].split("; assert_matches_oracle", 1)[0]
        p = eval(build, {"make_kernel_problem": ast.make_kernel_problem, "Config": ast.Config})
        for name, arr in (("query", p.q), ("key", p.k), ("value", p.v)):
            np.testing.assert_array_equal(r.inputs[name], arr)
        assert set(r.inputs) - {"query", "key", "value"} == set(p.options)
        # pasted as it is, it fails on the planted kernel ...
        with pytest.raises(AssertionError, match="Mismatched elements"):
            exec(line, {})
        # ... and passes on a correct one
        exec(line.replace("attnref_planted_kernels:scale_one", "jax.nn:dot_product_attention"), {})
    text = report.summary()
    assert "replay the failing call: from attnref.strategies import" in text
    assert "replay the failing call (Python)" in format_failure(
        report.results[0], Options(target="attnref_planted_kernels:scale_one")
    )
    data = json.loads(json.dumps(report.to_dict()))
    q = data["results"][0]["inputs"]["query"]
    assert q["shape"] == list(report.results[0].inputs["query"].shape)
    np.testing.assert_array_equal(
        np.asarray(q["data"], np.float32), report.results[0].inputs["query"]
    )


def test_a_gradient_failure_replays_with_its_cotangent():
    report = check_attention(
        _frozen_keys,
        properties=["gradients"],
        max_examples=EXAMPLES,
        target="attnref_planted_kernels:frozen_keys",
    )
    (r,) = report.results
    assert r.status == "failed"
    assert r.inputs["cotangent"].shape == r.inputs["query"].shape[:3] + r.inputs["value"].shape[3:]
    with pytest.raises(AssertionError, match=r"dk does not match"):
        exec(r.problem_replay, {})
    exec(
        r.problem_replay.replace(
            "attnref_planted_kernels:frozen_keys", "jax.nn:dot_product_attention"
        ),
        {},
    )


def test_a_changed_problem_has_inputs_but_no_replay_line():
    """causality scales the future keys after building the problem: no make_kernel_problem call
    gives those inputs, so there is no line (never a line that replays something else), and
    the arrays are the way to the failing call."""
    report = check_attention(
        _drops("is_causal"), properties=["causality"], features=("causal",), max_examples=2
    )
    (r,) = report.results
    assert r.status == "failed" and r.problem_replay is None
    assert r.inputs["is_causal"] is True and r.inputs["query"].ndim == 4


def test_passing_and_skipped_results_have_no_inputs():
    report = check_attention(
        jax.nn.dot_product_attention,
        properties=["oracle", "lse"],
        features=("mask",),
        max_examples=2,
    )
    assert [r.status for r in report.results] == ["passed", "skipped"]
    assert all(r.inputs is None and r.problem_replay is None for r in report.results)


# ----------------------------------------------------------------------------- the two lengths


def test_seq_lengths_is_split_and_still_accepted():
    assert "seq_lengths" not in FEATURES and set(BOTH) <= set(FEATURES)
    for signature in ("jax_nn", "qkv_mask", "numpy"):
        assert set(BOTH) <= set(DEFAULT_FEATURES[signature])
    report = check_attention(
        jax.nn.dot_product_attention, features=("mask", "seq_lengths"), properties=[]
    )
    assert report.features == ("mask", *BOTH)
    Options(target="m:f", features=("seq_lengths", "causal")).validate()
    with pytest.raises(ValueError, match="unknown feature 'seq_length'"):
        Options(target="m:f", features=("seq_length",)).validate()
    with pytest.raises(ValueError, match=r"seq_lengths = query_seq_lengths \+ key_value"):
        check_attention(jax.nn.dot_product_attention, features=("lengths",))
    # production's ragged lengths set both
    assert production_plan(features=("seq_lengths",)) == production_plan(features=BOTH)
    assert "needs features" in production_plan(features=BOTH[1:])["batch_independence"]


@pytest.mark.parametrize(
    ("declared", "kind"), [(BOTH[0], "query_padding"), (BOTH[1], "key_padding")]
)
def test_one_length_alone_is_checked(declared, kind):
    """A kernel declaring one length argument: jax.nn passes ``masks`` (and, for the key
    lengths, ``fully_masked_rows`` with masked_rows="uniform", jax.nn's meaning); the kernel
    that ignores that argument fails at the one-sided kind."""
    passing = check_attention(
        jax.nn.dot_product_attention,
        features=(declared,),
        masked_rows="uniform",
        properties=["masks", "fully_masked_rows"],
        max_examples=EXAMPLES,
    )
    assert passing.passed, passing.summary()
    statuses = {r.name: r.status for r in passing.results}
    assert statuses["fully_masked_rows"] == ("passed" if declared == BOTH[1] else "skipped")
    failing = check_attention(
        _drops(declared), features=(declared,), properties=["masks"], max_examples=EXAMPLES
    )
    (r,) = failing.results
    assert r.status == "failed" and f"masks [{kind}: {{{declared}=" in r.detail, r.detail


def test_the_guide_closes_its_fences_and_its_failure_block_is_consistent():
    """docs/testing_your_kernel.md: every fence closes (an unclosed one swallows the page
    below it), and the "Reading a failure" block's ``[dtype]`` header names its case's dtype."""
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "testing_your_kernel.md").read_text()
    fences = [line for line in page.splitlines() if line.startswith("```")]
    assert len(fences) % 2 == 0
    assert all(f == "```" for f in fences[1::2]), "a fence opens where one should close"
    block = page.split("## Reading a failure", 1)[1].split("```console", 1)[1].split("```", 1)[0]
    headers = set(re.findall(r"oracle \[(\w+)\]", block))
    dtypes = set(re.findall(r"dtype='(\w+)'", block))
    assert headers == dtypes == {"float32"}, (headers, dtypes)
    assert "np.float64(" not in block


def test_the_guide_installs_as_the_readme_does():
    """The kernel guide's install command is the README's (a reader who followed the README has
    the guide's environment)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    page = (root / "docs" / "testing_your_kernel.md").read_text()
    block = page.split("```bash\n", 1)[1].split("```", 1)[0]
    install = block.splitlines()[0]
    assert install.startswith("python3 -m venv .venv && .venv/bin/pip install "), install
    assert install in (root / "README.md").read_text()
