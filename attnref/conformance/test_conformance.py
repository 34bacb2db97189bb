"""attnref's conformance properties as pytest tests, one per property, against your function::

    python -m pytest --pyargs attnref.conformance --attnref-target=mypkg.kernels:attention

Options: ``pytest --help``, group "attnref" (``--attnref-merge-target``: one
``test_merge_property`` per state-algebra property). Each test runs
:func:`attnref.testing.check_attention` for its property, so ``-k``, ``-x`` and xdist work per
property; a failure shows the message, the shrunk example and the replay command, an unsupported
property skips with the reason.
"""

from __future__ import annotations

import pytest

from attnref.conformance import PROPERTIES, format_failure
from attnref.conformance.plugin import session
from attnref.testing import MERGE_PROPERTIES, check_merge_states

NO_TARGET = (
    "no --attnref-target given; run `python -m pytest --pyargs attnref.conformance "
    "--attnref-target=package.module:function`"
)
NO_PLUGIN = (
    "the attnref pytest plugin is not loaded (plugin autoloading off?); add "
    "-p attnref.conformance.plugin"
)


NO_MERGE_TARGET = (
    "no --attnref-merge-target given; run `python -m pytest --pyargs attnref.conformance "
    "--attnref-merge-target=package.module:merge`"
)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "attnref_merge_property" in metafunc.fixturenames:
        metafunc.parametrize("attnref_merge_property", MERGE_PROPERTIES)
    if "attnref_property" not in metafunc.fixturenames:
        return
    state = session(metafunc.config)
    names, xfail = (
        (state.properties, state.xfail) if state and state.properties else (PROPERTIES, {})
    )
    params = [
        pytest.param(
            name,
            id=name,
            marks=[pytest.mark.xfail(reason=xfail[name], strict=False)] if name in xfail else [],
        )
        for name in names
    ]
    metafunc.parametrize("attnref_property", params)


def test_property(attnref_property: str, request: pytest.FixtureRequest) -> None:
    state = session(request.config)
    if state is None:
        pytest.skip(NO_PLUGIN)
    if state.options is None or state.fn is None:
        pytest.skip(NO_TARGET)
    report = state.options.run(state.fn, properties=[attnref_property])
    (result,) = (r for r in report.results if r.name == attnref_property)
    if result.status == "skipped":
        pytest.skip(f"{attnref_property}: {result.detail}")
    if result.status == "failed":
        pytest.fail(format_failure(result, state.options), pytrace=False)
    assert result.status == "passed", result


def test_merge_property(attnref_merge_property: str, request: pytest.FixtureRequest) -> None:
    state = session(request.config)
    if state is None:
        pytest.skip(NO_PLUGIN)
    if state.merge_fn is None:
        pytest.skip(NO_MERGE_TARGET)
    get = request.config.getoption
    report = check_merge_states(
        state.merge_fn,
        max_examples=get("--attnref-examples"),
        seed=get("--attnref-seed"),
        properties=[attnref_merge_property],
        target=get("--attnref-merge-target"),
    )
    (result,) = report.results
    if result.status == "failed":
        pytest.fail(report.summary(), pytrace=False)
    assert result.status == "passed", result
