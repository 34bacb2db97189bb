"""``check_attention(..., refuses_lengths=True)``: a kernel that declares it refuses some
sequence lengths (a blocked kernel whose block size must divide them, as Pallas' flash attention)
has a clear refusal of those lengths counted in the property's detail, not failed; any other
exception, and a wrong answer on the lengths it accepts, still fail.

The targets wrap ``jax.nn.dot_product_attention`` (exact within the derived bound) with a check
of the lengths at trace time; one property (``oracle``), a few examples, a fixed seed. Shrinking
or the tile-length draws (one example in four) reach lengths that 4 does not divide.
"""

from __future__ import annotations

import jax
import pytest

from attnref import dot_product_attention
from attnref.cli import main
from attnref.conformance import OptionError, split_head_dim
from attnref.testing import check_attention

BLOCK = 4


def _blocked(query, key, value, **kw):
    t, s = query.shape[1], key.shape[1]
    if t % BLOCK or s % BLOCK:
        raise ValueError(f"q_seq_len={t} and kv_seq_len={s} must be multiples of {BLOCK}")
    return jax.nn.dot_product_attention(query, key, value, **kw)


def _powers_of_2(query, key, value, **kw):
    """Pallas' Triton lowering's refusal (seen on an H200, docs/benchmarks.md) of a length that
    is not a power of 2."""
    t = query.shape[1]
    if t & (t - 1):
        raise ValueError(
            "The Pallas Triton lowering currently requires that all operations have array "
            f"arguments and results whose size is a power of 2. Encountered an array of shape "
            f"({t}, {query.shape[-1]})"
        )
    return jax.nn.dot_product_attention(query, key, value, **kw)


def _crashes(query, key, value, **kw):
    if query.shape[1] % BLOCK:
        raise RuntimeError("segmentation fault in the tile loop")
    return jax.nn.dot_product_attention(query, key, value, **kw)


def _wrong_when_accepted(query, key, value, **kw):
    return 1.001 * _blocked(query, key, value, **kw)


def _oracle(fn, **kw):
    (result,) = check_attention(fn, max_examples=12, properties=["oracle"], **kw).results
    return result


def test_a_declared_refusal_is_counted_not_failed():
    result = _oracle(_blocked, refuses_lengths=True)
    assert result.status == "passed", result.detail
    assert "refused, as declared (refuses_lengths)" in result.detail, result.detail
    assert "must be multiples of 4" in result.detail


def test_pallas_power_of_2_refusal_is_a_declared_refusal():
    result = _oracle(_powers_of_2, refuses_lengths=True)
    assert result.status == "passed", result.detail
    assert "size is a power of 2" in result.detail, result.detail


def test_without_the_declaration_the_refusal_fails():
    result = _oracle(_blocked)
    assert result.status == "failed"
    assert "must be multiples of 4" in result.detail


def test_other_exceptions_and_wrong_answers_still_fail():
    crash = _oracle(_crashes, refuses_lengths=True)
    assert crash.status == "failed" and "RuntimeError" in crash.detail, crash.detail
    wrong = _oracle(_wrong_when_accepted, refuses_lengths=True)
    assert wrong.status == "failed" and "rule 'bound' failed" in wrong.detail, wrong.detail


def test_refuses_lengths_is_not_for_distributed_kernels():
    with pytest.raises(OptionError, match="refuses_lengths is for a single-device kernel"):
        check_attention(lambda *a, **k: None, devices=[1], refuses_lengths=True)


def test_cli_flag_declares_the_limit_and_the_replay_keeps_it(capsys):
    target = "tests/test_declared_limits.py:_blocked"
    args = ["--properties", "oracle", "--max-examples", "12", "--no-progress"]
    assert main(["check", target, *args, "--refuses-lengths"]) == 0
    out = capsys.readouterr().out
    assert "refused, as declared" in out, out
    assert "declared limits: refuses_lengths" in out, out
    assert main(["check", target, *args]) == 1
    out = capsys.readouterr().out
    assert "must be multiples of 4" in out, out
    assert main(["check", "tests/test_declared_limits.py:_wrong_when_accepted", *args,
                 "--refuses-lengths"]) == 1  # fmt: skip
    assert "--refuses-lengths" in capsys.readouterr().out  # in the replay line


# head_dim: a kernel whose matrix units need a larger head dim than the small shapes' 4 (cuDNN
# refuses one that is not a multiple of 8; docs/benchmarks.md). _SEEN: the (H, H_v) it was called
# with.
MIN_HEAD_DIM = 16
_SEEN: set[tuple[int, int]] = set()


def _needs_wide_heads(query, key, value, **kw):
    _SEEN.add((query.shape[-1], value.shape[-1]))
    if query.shape[-1] < MIN_HEAD_DIM:
        raise NotImplementedError(f"head dim must be >= {MIN_HEAD_DIM}, got {query.shape[-1]}")
    return jax.nn.dot_product_attention(query, key, value, **kw)


def _wrong_at_wide_heads(query, key, value, **kw):
    out = jax.nn.dot_product_attention(query, key, value, **kw)
    return out * 1.001 if query.shape[-1] >= MIN_HEAD_DIM else out


def test_head_dim_declares_the_head_dim_of_every_example():
    _SEEN.clear()
    report = check_attention(_needs_wide_heads, max_examples=6, properties=["oracle", "masks"])
    assert not report.passed and "head dim must be >= 16" in report.results[0].detail
    _SEEN.clear()
    report = check_attention(
        _needs_wide_heads, max_examples=6, properties=["oracle", "masks"], head_dim=MIN_HEAD_DIM
    )
    assert report.passed, [r.detail for r in report.results]
    assert {(MIN_HEAD_DIM, MIN_HEAD_DIM)} == _SEEN, _SEEN
    assert dict(report.options)["head_dim"] == MIN_HEAD_DIM
    assert "declared limits: head_dim=16" in report.summary(), report.summary()


def test_a_kernel_wrong_at_the_declared_head_dim_still_fails():
    assert check_attention(_wrong_at_wide_heads, max_examples=4, properties=["oracle"]).passed
    wrong = _oracle(_wrong_at_wide_heads, head_dim=MIN_HEAD_DIM)
    assert wrong.status == "failed" and "rule 'bound' failed" in wrong.detail, wrong.detail


def test_production_shapes_take_the_declared_head_dim():
    _SEEN.clear()
    report = check_attention(
        _needs_wide_heads, shapes="production", max_examples=1, properties=["oracle"], head_dim=32
    )
    assert report.passed, report.results[0].detail
    assert {(32, 32)} == _SEEN, _SEEN


@pytest.mark.parametrize("bad", [0, 1025, 4.0, True, "16"])
def test_a_bad_head_dim_is_refused(bad):
    with pytest.raises(OptionError, match="head_dim must be"):
        check_attention(_needs_wide_heads, head_dim=bad)


# head_dim=(H, H_v): the values' head dim of its own, the only way the kit draws H_v != H (jax.nn
# refuses it). attnref's kernel takes any H_v; the planted bug takes the default scale from H_v,
# which no example with H_v == H can tell from the right one.


def _any_value_dim(query, key, value, **kw):
    _SEEN.add((query.shape[-1], value.shape[-1]))
    return dot_product_attention(query, key, value, **kw)


def _scale_from_value_dim(query, key, value, scale=None, **kw):
    scale = value.shape[-1] ** -0.5 if scale is None else scale
    return dot_product_attention(query, key, value, scale=scale, **kw)


def test_a_declared_value_head_dim_catches_a_scale_taken_from_it():
    assert check_attention(_scale_from_value_dim, max_examples=4, properties=["oracle"]).passed
    wrong = _oracle(_scale_from_value_dim, head_dim=(8, 4))
    assert wrong.status == "failed" and "rule 'bound' failed" in wrong.detail, wrong.detail
    _SEEN.clear()
    report = check_attention(
        _any_value_dim, max_examples=6, properties=["oracle"], head_dim=(4, 12)
    )
    assert report.passed, report.results[0].detail
    assert {(4, 12)} == _SEEN, _SEEN
    assert dict(report.options)["head_dim"] == [4, 12]
    assert "declared limits: head_dim=4,12" in report.summary(), report.summary()
    # a pair with H_v == H is the int
    same = check_attention(_any_value_dim, max_examples=1, properties=["oracle"], head_dim=(8, 8))
    assert dict(same.options)["head_dim"] == 8


def test_production_shapes_take_the_declared_value_head_dim():
    _SEEN.clear()
    report = check_attention(
        _any_value_dim,
        shapes="production",
        max_examples=1,
        properties=["oracle", "gqa"],
        head_dim=(64, 32),
        log=(lines := []).append,
    )
    assert report.passed, [r.detail for r in report.results]
    assert {(64, 32)} == _SEEN, _SEEN
    assert all("H=64 H_v=32" in line for line in lines), lines


@pytest.mark.parametrize("bad", [(8,), (8, 4, 2), (0, 4), (8, 1025), ("8", 4), (8, True)])
def test_a_bad_head_dim_pair_is_refused(bad):
    with pytest.raises(OptionError, match="head_dim must be"):
        check_attention(_any_value_dim, head_dim=bad)


def test_split_head_dim():
    assert split_head_dim("64") == 64 and split_head_dim(" 192, 128") == (192, 128)
    assert split_head_dim(None) is None and split_head_dim("  ") is None
    for bad in ("8,x", "1,2,3", "x"):
        with pytest.raises(ValueError, match="head-dim must be H or H,H_v"):
            split_head_dim(bad)


@pytest.mark.parametrize(
    ("target", "good", "bad", "refusal"),
    [
        ("_wrong_at_wide_heads", "16", "0", "head_dim must be in 1..1024, got 0"),
        ("_scale_from_value_dim", "8,4", "8,x", "head-dim must be H or H,H_v"),
    ],
)
def test_cli_head_dim_flag_and_its_replay(capsys, target, good, bad, refusal):
    target = f"tests/test_declared_limits.py:{target}"
    args = ["--properties", "oracle", "--max-examples", "4", "--no-progress"]
    assert main(["check", target, *args]) == 0
    capsys.readouterr()
    assert main(["check", target, *args, "--head-dim", good]) == 1
    assert f"--head-dim {good}" in capsys.readouterr().out  # in the replay line
    with pytest.raises(SystemExit) as exit_:
        main(["check", target, *args, "--head-dim", bad])
    assert exit_.value.code == 2
    assert refusal in capsys.readouterr().err
