"""A sparse run localizes an idle() that has not drained after LONG_IDLE_STEPS steps right there (the
replay runs the loop to its end), and a second localization within one op reuses that replay: the report
is the per-step run's either way (kvaudit.audit.runner.AuditedRun._long_idle, _replay)."""

from __future__ import annotations

import os

import pytest

from kvaudit import replay
from kvaudit.audit.runner import LONG_IDLE_STEPS, MAX_IDLE_STEPS, AuditedRun, execute
from replay_helpers import CoverAll, count_replays

pytestmark = pytest.mark.sglang

HANG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "corpora", "sglang",
                    "hang-pd-prealloc-never-fits.json")


def _key(findings):
    return [(f.signature, f.op_index, f.step) for f in findings]


def _sparse(config, program, monkeypatch, suppressions=None):
    """The program as a search runs it; also (engines the replays built, ops they applied, the program's
    length at each localization)."""
    built, applied, asked = count_replays(monkeypatch)
    with AuditedRun(config, full_stacks=False, check_every=16, lean=True, suppressions=suppressions) as run:
        for op in program:
            if run.apply(op):
                break
        else:
            run.finish()
    return run, (built[0], applied[0], asked)


def test_a_hang_is_localized_once_its_idle_passes_the_long_idle_mark(monkeypatch):
    config, program, _, _ = replay.load(HANG)
    want = execute(config, program, full_stacks=False)
    assert [f.kind for f in want.findings] == ["hang"] and want.steps >= MAX_IDLE_STEPS
    run, (built, _, asked) = _sparse(config, program, monkeypatch)
    assert _key(run.findings) == _key(want.findings)
    assert built == 1 and len(asked) == 1
    # the sparse run stopped its own loop at the mark, not at MAX_IDLE_STEPS
    assert run.target.steps < want.steps - MAX_IDLE_STEPS // 2


def test_a_covered_hang_is_replayed_once_within_its_op(monkeypatch):
    config, program, _, _ = replay.load(HANG)
    run, (built, applied, asked) = _sparse(config, program, monkeypatch, suppressions=CoverAll())
    assert run.findings == []
    hang = next(f for f in run.suppressed if f.kind == "hang")
    # the long-idle replay met only the covered hang: the loop went on to MAX_IDLE_STEPS, and that hang's
    # localization (and any later one) went on with the same open replay: one engine, no op run twice
    assert run.target.steps >= MAX_IDLE_STEPS > LONG_IDLE_STEPS
    assert asked.count(hang.op_index + 1) == 2
    assert built == 1 and applied == max(asked)
