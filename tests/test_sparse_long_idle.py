"""A sparse run localizes an idle() that has not drained after LONG_IDLE_STEPS steps right there (the
replay runs the loop to its end), and a second localization within one op reuses that replay: the report
is the per-step run's either way (kvaudit.audit.runner.AuditedRun._long_idle, _replay)."""

from __future__ import annotations

import os
import time

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


def test_the_localizing_replay_ends_with_the_search_budget(monkeypatch):
    """A campaign with every finding suppressed, the hang included, overran its --max-time by 1.5-2.3 s at a
    5 s budget (stop 56): the sparse run's replay of an idle() that never drains (2,000 steps, ~1.4 s on the
    minivllm plugin) had no deadline. The budget ends as that replay starts: it stops at once, and the run is
    out of time with no finding, as for a step the deadline cuts short."""
    config, program, _, _ = replay.load(HANG)
    localize, replays = AuditedRun._replay, []

    def budget_ends_now(self):
        self.deadline = time.monotonic() - 1.0
        replays.append(localize(self))
        return replays[-1]

    monkeypatch.setattr(AuditedRun, "_replay", budget_ends_now)
    with AuditedRun(config, full_stacks=False, check_every=16, lean=True, suppressions=CoverAll(),
                    deadline=time.monotonic() + 600) as run:
        for op in program:
            if run.apply(op):
                break
        assert replays and all(r.out_of_time and r.target.steps < LONG_IDLE_STEPS for r in replays)
        assert run.out_of_time and run.findings == [] and run.target.steps < MAX_IDLE_STEPS
