"""The conformance kit's ``torch`` signature (``check_attention(fn, signature="torch")``,
``attnref check ... --signature torch``) on PyTorch kernels: torch's SDPA and a hand-written
kernel pass, a kernel with a planted bug fails with the property that names it, gradients are
checked through autograd.

Tests that import torch carry ``pytest.mark.torch``: the default run deselects them (CI has no
torch), ``nox -s clients`` installs torch and runs them. torch is imported inside the tests only,
so that collecting this file without torch neither fails nor skips. The kernels live in
``tests/torch_kernels.py``. Small ``max_examples`` and a fixed seed keep the file fast.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from attnref.cli import main
from attnref.conformance import OptionError
from attnref.testing import SIGNATURES, check_attention

ROOT = Path(__file__).resolve().parents[1]
KERNELS = "tests/torch_kernels.py"


def _kernels():
    from tests import torch_kernels  # imports torch

    return torch_kernels


def _statuses(report) -> dict[str, str]:
    return {r.name: r.status for r in report.results}


def test_torch_is_a_signature_whose_features_are_sdpa_options():
    assert "torch" in SIGNATURES
    for feature in ("lse", "window", "query_seq_lengths", "segment_ids", "softcap"):
        with pytest.raises(OptionError, match=f"signature 'torch' cannot express.*{feature}"):
            check_attention(lambda *a, **k: None, signature="torch", features=["mask", feature])


def test_torch_signature_without_torch_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'attnref\[torch\]'"):
        check_attention(lambda *a, **k: None, signature="torch")


@pytest.mark.torch
@pytest.mark.parametrize("name", ["sdpa_math", "attention"])
def test_sdpa_and_a_hand_written_kernel_pass_every_property(name):
    fn = getattr(_kernels(), name)
    report = check_attention(
        fn, signature="torch", max_examples=6, dtypes=("float32", "float64", "bfloat16")
    )
    assert report.passed, report.summary()
    statuses = _statuses(report)
    assert statuses.pop("lse") == "skipped"  # torch's SDPA returns no lse
    assert set(statuses.values()) == {"passed"}, statuses
    assert "gradients" in statuses


@pytest.mark.torch
@pytest.mark.parametrize(
    ("name", "failing", "passing"),
    [
        # 1/H for 1/sqrt(H): every comparison with the oracle
        ("wrong_scale", {"oracle", "masks", "gradients"}, set()),
        # key i + 1 readable from query i: only causal problems
        ("causal_off_by_one", {"causality", "masks"}, {"oracle", "fully_masked_rows"}),
        # the output right, its gradient wrong: the gradient properties only
        ("detached_denominator", {"gradients"}, {"oracle", "masks", "extreme_logits"}),
    ],
)
def test_a_planted_bug_fails_the_property_that_sees_it(name, failing, passing):
    fn = getattr(_kernels(), name)
    props = sorted(failing | passing)
    statuses = _statuses(check_attention(fn, signature="torch", max_examples=6, properties=props))
    assert {p for p, s in statuses.items() if s == "failed"} == failing, statuses
    assert {p for p, s in statuses.items() if s == "passed"} == passing, statuses


@pytest.mark.torch
def test_causal_bug_is_diagnosed_as_a_future_token_read():
    report = check_attention(
        _kernels().causal_off_by_one, signature="torch", max_examples=6, properties=["causality"]
    )
    (result,) = report.results
    assert result.status == "failed"
    assert "future token" in result.detail, result.detail


@pytest.mark.torch
def test_output_in_the_kits_layout_is_refused_with_torchs_layout_named():
    report = check_attention(
        _kernels().transposed_output, signature="torch", max_examples=3, properties=["oracle"]
    )
    (result,) = report.results
    assert result.status == "failed"
    assert "expected torch's layout [B, N, T, H_v]" in result.detail, result.detail


@pytest.mark.torch
def test_cli_checks_a_torch_kernel_by_file_path(capsys):
    args = ["--signature", "torch", "--max-examples", "3", "--no-progress"]
    assert main(["check", f"{KERNELS}:sdpa_math", *args, "--properties", "oracle,gradients"]) == 0
    assert main(["check", f"{KERNELS}:wrong_scale", *args, "--properties", "oracle"]) == 1
    out = capsys.readouterr().out
    assert "signature 'torch'" in out and "oracle failed" in out, out


@pytest.mark.torch
def test_cli_in_a_fresh_interpreter():
    """``attnref check`` as a reader runs it: the console script's module, a new process."""
    done = subprocess.run(
        [sys.executable, "-m", "attnref", "check", f"{KERNELS}:attention", "--signature",
         "torch", "--max-examples", "2", "--properties", "masks", "--no-progress"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed, 0 failed" in done.stdout, done.stdout
