"""The idle check from the cache's roots alone (kvaudit/audit/oracles/idle.py): at idle it certifies a clean
state in a few numpy calls without the full mark and sweep, leaves the auditor as the full check would,
leaves every finding to the full check, and paranoid mode runs both and raises on any difference."""

from __future__ import annotations

import dataclasses
import glob
import os

import numpy as np
import pytest

from kvaudit import replay
from kvaudit.audit import oracles
from kvaudit.audit.oracles.incremental import DeltaDisagreement
from kvaudit.audit.runner import AuditedRun
from kvaudit.program import Idle, Step, Submit
from kvaudit.targets.eut.presets import get_preset
from kvaudit.targets.eut.target import EutTarget

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROGRAM = [Submit(family=0, prompt_len=12, max_new_tokens=3), Submit(family=0, prompt_len=14, max_new_tokens=2),
           Idle(), Submit(family=1, prompt_len=9, max_new_tokens=4), Step(n=2), Idle(),
           Submit(family=0, prompt_len=12, max_new_tokens=2), Idle()]


def _run(config, program, paranoid: bool = False, full: bool = False, **kw) -> AuditedRun:
    run = AuditedRun(config, paranoid=paranoid, **kw)
    if full:  # the full mark and sweep at idle too, as before the idle check
        run.target.idle_roots = lambda: None
    for op in program:
        if run.apply(op):
            break
    run.finish()
    return run


def _state(run: AuditedRun) -> tuple:
    aud = run.auditor
    changes = [(op, step, pool, units.tolist(), owners.tolist()) for op, step, pool, units, owners in aud.owner_changes]
    at_check = {pool: [(r.owner, r.units.tolist(), r.role) for r in roots] for pool, roots in aud.roots_at_check.items()}
    return (changes, {p: led.owner.tolist() for p, led in aud.ledgers.items()}, aud.checked_upto, aud.owner_where,
            at_check, aud.digest())


def test_an_idle_check_of_the_cache_alone_reads_no_roots(monkeypatch):
    roots = []
    real = EutTarget.roots
    monkeypatch.setattr(EutTarget, "roots", lambda self, *a, **k: (roots.append(1), real(self, *a, **k))[1])
    run = _run(get_preset("default").config(), PROGRAM[:3])
    try:
        assert run.target.is_idle() and run.findings == []
        roots.clear()
        assert oracles.check(run.auditor, run.target, idle=True) == []
        assert roots == []  # (the full check reads them: one call)
        assert run.target.idle_roots().units["token_to_kv_pool"].size  # the tree holds KV: something to compare
    finally:
        run.close()


@pytest.mark.parametrize("every", [1, 16])
def test_the_idle_check_leaves_the_auditor_as_the_full_check_does(every):
    """The ledger's owners and their change record, checked_upto, owner_where and roots_at_check after each
    idle check equal the full check's (the per-step run's and a search's sparse one)."""
    config = get_preset("default").config(model="none")
    quick, full = _run(config, PROGRAM, check_every=every), _run(config, PROGRAM, full=True, check_every=every)
    try:
        assert quick.findings == full.findings == []
        assert quick.auditor.owner_changes  # the tree took the requests' KV: owners changed at the checks
        assert _state(quick) == _state(full)
    finally:
        quick.close()
        full.close()


@pytest.mark.parametrize("name", ["evictable-size-uses-key-len", "prefill-finish-leaks-row",
                                  "radix-lock-skips-matched-node", "aborted-kv-inserted"])
def test_a_finding_at_idle_is_the_full_checks(name):
    """A leak, a lock imbalance, a counter drift at idle: the idle check leaves it to the full check, whose
    findings (kinds, messages, first op and step) are those of a run that never takes the idle check."""
    config, program, recorded, _ = replay.load(os.path.join(ROOT, "corpora", "regressions", f"{name}.json"))
    quick, full = _run(config, program), _run(config, program, full=True)
    try:
        assert {f.signature for f in recorded} <= {f.signature for f in quick.findings}
        got = [(f.kind, f.signature, f.message, f.op_index, f.step) for f in quick.findings]
        assert got == [(f.kind, f.signature, f.message, f.op_index, f.step) for f in full.findings]
    finally:
        quick.close()
        full.close()


def test_lock_balance_runs_at_every_idle_check():
    """A node locked with no holder at idle (its counters moved with it): the idle check does not pass it,
    the full check names it."""
    run = _run(get_preset("default").config(), PROGRAM[:3])
    try:
        tree = run.target.engine.tree_cache
        tree.inc_lock_ref(next(n for n in tree.nodes() if n.value is not None))
        assert run.target.idle_roots().locked
        found = oracles.check(run.auditor, run.target, idle=True)
        assert [f.kind for f in found] == ["lock-imbalance"]
    finally:
        run.close()


@pytest.mark.parametrize("lie", ["a unit left out", "locked", "a unit twice"])
def test_paranoid_mode_raises_when_the_idle_check_and_the_full_check_differ(lie):
    run = _run(get_preset("default").config(), PROGRAM[:3], paranoid=True)
    try:
        real = run.target.idle_roots()
        units = real.units["token_to_kv_pool"]
        told = {"a unit left out": real._replace(units={"token_to_kv_pool": units[1:]}),
                "locked": real._replace(locked=True),
                "a unit twice": real._replace(units={"token_to_kv_pool": np.concatenate([units, units[:1]])})}[lie]
        assert oracles.check(run.auditor, run.target, idle=True) == []  # (the truth: no disagreement)
        run.target.idle_roots = lambda: told
        with pytest.raises(DeltaDisagreement, match="the idle check says not clean, the full check found 0"):
            oracles.check(run.auditor, run.target, idle=True)
    finally:
        run.close()


def test_paranoid_mode_raises_when_the_idle_check_passes_what_the_full_check_finds():
    run = _run(get_preset("default").config(), PROGRAM[:3], paranoid=True)
    try:
        tree = run.target.engine.tree_cache
        tree.inc_lock_ref(next(n for n in tree.nodes() if n.value is not None))  # a lock no holder took
        run.target.idle_roots = lambda: EutTarget.idle_roots(run.target)._replace(locked=False)
        with pytest.raises(DeltaDisagreement, match="the idle check says clean, the full check found 1"):
            oracles.check(run.auditor, run.target, idle=True)
    finally:
        run.close()


@pytest.mark.parametrize("preset, why", [("streaming-session", "session records"), ("hicache", "the host tier")])
def test_idle_roots_leave_sessions_and_the_host_tier_to_the_full_check(preset, why):
    run = _run(get_preset(preset).config(), PROGRAM[:3])
    try:
        assert run.target.is_idle()
        assert run.target.idle_roots() is None, why
    finally:
        run.close()


def test_idle_roots_leave_a_queued_request_to_the_full_check():
    run = _run(get_preset("default").config(), PROGRAM[:3])
    try:
        assert run.target.idle_roots() is not None
        run.target.apply(Submit(family=0, prompt_len=5, max_new_tokens=1))
        run.target.step()  # taken in: the request is in a queue now
        assert not run.target.is_idle() and run.target.idle_roots() is None
    finally:
        run.close()


def test_paranoid_over_the_zoos_regressions_finds_no_disagreement(monkeypatch):
    """Every corpora/regressions program, bug on and off, per step and on a search's sparse schedule, in paranoid
    mode: the idle check and the full check agree at every idle check (a disagreement raises), and both
    verdicts are met (clean and not)."""
    seen = []
    real = oracles._idle_agrees
    monkeypatch.setattr(oracles, "_idle_agrees", lambda a, t, quick, found: (seen.append(quick[0]), real(a, t, quick, found)))
    for path in sorted(glob.glob(os.path.join(ROOT, "corpora", "regressions", "*.json"))):
        config, program, _, _ = replay.load(path)
        for cfg in (config, dataclasses.replace(config, bugs=frozenset())):
            for every in (1, 16):
                _run(cfg, program, paranoid=True, check_every=every).close()
    assert True in seen and False in seen
