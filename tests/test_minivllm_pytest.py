"""Audit your own engine from pytest (issue 19): the minivllm example, fuzzed for a few seconds
through the kvaudit plugin's fixture. Its planted bugs must fail with a readable finding."""

import pytest

from examples.minivllm.target import PRESETS
from kvaudit.testing import KvauditFailure

TIGHT = PRESETS["minivllm-tight"]


def test_the_engine_is_clean_for_a_few_seconds(kvaudit):
    kvaudit.fuzz(TIGHT.config(), max_time=3).assert_clean()


@pytest.mark.parametrize("bug, kind", [("preempt-double-free", "double-free"), ("abort-leak", "leak")])
def test_a_planted_bug_fails_with_a_readable_finding(kvaudit, bug, kind):
    result = kvaudit.fuzz(TIGHT.config(bugs={bug}), max_time=10)
    with pytest.raises(KvauditFailure) as failure:
        result.assert_clean()
    report = str(failure.value)
    assert result.findings[0].kind == kind
    assert f"signature: {kind}/block_pool/" in report
    assert "examples/minivllm/engine.py" in report  # the engine's own line, not kvaudit's
