"""The incremental per-step check (kvaudit/audit/oracles/incremental.py) against the full mark and
sweep: paranoid mode over every zoo bug's program (corpora/regressions/, every corpora/ file that runs on
the built-in engine) finds no disagreement, with the bug on and off, and still finds what the file
records; a disagreement planted in the target's deltas is caught; the busy check really runs from the
deltas."""

from __future__ import annotations

import dataclasses
import glob
import os

import pytest

from kvaudit import replay
from kvaudit.audit import oracles
from kvaudit.audit.oracles import incremental
from kvaudit.audit.oracles.incremental import DeltaDisagreement
from kvaudit.audit.runner import AuditedRun, execute
from kvaudit.program import Idle, Submit
from kvaudit.targets.eut.presets import get_preset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = sorted(glob.glob(os.path.join(ROOT, "corpora", "regressions", "*.json")))


@pytest.mark.parametrize("path", FILES, ids=[os.path.basename(f) for f in FILES])
def test_paranoid_finds_no_disagreement_on_the_zoo(path, monkeypatch):
    monkeypatch.setenv("KVAUDIT_PARANOID", "1")  # what --paranoid sets
    config, program, recorded, _ = replay.load(path)
    found = execute(config, program)  # raises DeltaDisagreement on any difference
    assert {f.signature for f in recorded} <= set(found.signatures)
    assert execute(dataclasses.replace(config, bugs=frozenset()), program).findings == []


def test_a_record_cut_short_under_its_protected_prefix_is_read_to_its_allocation(monkeypatch):
    """session-abort-borrows-slot cuts the session's record to kv_allocated_len 1 under cache_protected_len 2: the
    roots read the row to its allocation, the deltas read the protected prefix whole (paranoid: "ref count differs
    on 1 unit(s), e.g. unit 2: kept 2, swept 1", the second tester's fuzzed program; the zoo's kept one passes)."""
    from kvaudit.program import OpenSession, Step

    monkeypatch.setenv("KVAUDIT_PARANOID", "1")
    config = dataclasses.replace(get_preset("streaming-session").config(),
                                 bugs=frozenset({"session-abort-borrows-slot"}))
    program = [OpenSession(), Submit(family=0, prompt_len=1, max_new_tokens=11, session=1), Idle(),
               Submit(family=0, prompt_len=43, max_new_tokens=11, session=3), Step(1)]
    found = execute(config, program)  # raised DeltaDisagreement
    assert found.findings and found.findings[0].kind == "leak", found.findings


def _program() -> list:
    return [Submit(family=0, prompt_len=12, max_new_tokens=3), Submit(family=1, prompt_len=9, max_new_tokens=2),
            Idle()]


def _hide_losses(target) -> None:
    # a target whose deltas miss a dropped record: no unit it held is reported lost
    real = target.ownership_deltas

    def deltas(*a):
        d = real(*a)
        if d is None:
            return d
        pools = {p: tuple(a[v[2] > 0] for a in v) for p, v in d.pools.items()}
        return d._replace(pools=pools)

    target.ownership_deltas = deltas


@pytest.fixture
def small_pools_too(monkeypatch):
    # the incremental check runs from 65,536 units up (incremental.MIN_UNITS); the presets are smaller
    monkeypatch.setattr(incremental, "MIN_UNITS", 0)


def test_a_planted_disagreement_is_caught_in_paranoid_mode():
    with AuditedRun(get_preset("default").config(), paranoid=True) as run:
        _hide_losses(run.target)
        with pytest.raises(DeltaDisagreement, match="disagree with the full sweep"):
            for op in _program():
                run.apply(op)


def test_without_paranoid_the_same_target_runs_clean(small_pools_too):
    # the kept state then holds units nobody references: each is an anomaly the full sweep clears
    with AuditedRun(get_preset("default").config(), paranoid=False) as run:
        _hide_losses(run.target)
        for op in _program():
            assert run.apply(op) == []


def test_the_busy_check_runs_from_the_deltas(monkeypatch, small_pools_too):
    """Between the first check and idle, no busy check reads the roots (the incremental path runs)."""
    calls = []
    with AuditedRun(get_preset("default").config(), paranoid=False) as run:
        real = run.target.roots
        monkeypatch.setattr(run.target, "roots", lambda *a, **k: (calls.append(run.target.steps), real(*a, **k))[1])
        run.apply(Submit(family=0, prompt_len=12, max_new_tokens=8))
        run.apply(Idle())
        assert run.findings == []
    busy = [s for s in calls if s > 1]
    assert run.target.steps > 4 and len(busy) < run.target.steps - 2, (calls, run.target.steps)


def test_small_pools_sweep_every_check(monkeypatch):
    """Under incremental.MIN_UNITS units the deltas cost more than the sweep: not asked for, every check full."""
    with AuditedRun(get_preset("default").config(), paranoid=False) as run:
        monkeypatch.setattr(run.target, "ownership_deltas", lambda *a: pytest.fail("deltas asked of a small engine"))
        run.apply(Submit(family=0, prompt_len=12, max_new_tokens=4))
        run.apply(Idle())
        assert run.findings == [] and not run.auditor.bookkeeping.big


def test_a_leak_is_found_at_the_same_step_by_both_checks(small_pools_too):
    path = os.path.join(ROOT, "corpora", "regressions", "prefill-finish-leaks-row.json")
    config, program, _, _ = replay.load(path)
    got = {}
    for paranoid in (False, True):
        with AuditedRun(config, paranoid=paranoid) as run:
            for op in program:
                if run.apply(op):
                    break
            got[paranoid] = [(f.signature, f.op_index, f.step) for f in run.findings]
    assert got[False] and got[False] == got[True]


def test_pages_over_one_token_give_no_deltas(small_pools_too):
    with AuditedRun(dataclasses.replace(get_preset("default").config(), page_size=4), paranoid=False) as run:
        assert run.target.ownership_deltas() is None
        run.apply(Submit(family=0, prompt_len=12, max_new_tokens=2))
        run.apply(Idle())
        assert run.findings == [] and run.target.steps > 0
        assert run.auditor.bookkeeping is not None and not run.auditor.bookkeeping.valid  # every check full


def test_paranoid_defaults_to_the_environment(monkeypatch):
    monkeypatch.delenv("KVAUDIT_PARANOID", raising=False)
    assert oracles.paranoid_default() is False
    monkeypatch.setenv("KVAUDIT_PARANOID", "1")
    assert oracles.paranoid_default() is True
    with AuditedRun(get_preset("default").config()) as run:
        assert run.auditor.paranoid


@pytest.mark.parametrize("path", FILES, ids=[os.path.basename(f) for f in FILES])
def test_the_incremental_check_finds_what_the_sweep_finds(path, monkeypatch):
    """Every zoo program, its busy checks run from the deltas (their req_to_token compare restricted to
    the rows a step rewrites, ownership_deltas(exact=False)), against the full sweep at every check: the
    same findings, at the same op and step."""
    config, program, recorded, _ = replay.load(path)
    swept = [(f.signature, f.op_index, f.step) for f in execute(config, program).findings]
    monkeypatch.setattr(incremental, "MIN_UNITS", 0)
    got = [(f.signature, f.op_index, f.step) for f in execute(config, program).findings]
    assert got == swept and {f.signature for f in recorded} <= {s for s, _, _ in got}
