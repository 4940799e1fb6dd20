"""The sparse check schedule (``AuditedRun(check_every=K)``) and its localization by replay: K=1 is
the per-step audit exactly; a sparse run's hit on every zoo bug is reported as the per-step run's
(signature, op_index, step); a hit the replay does not reproduce is kept, saying so."""

from __future__ import annotations

import glob
import os
import random

import pytest

from kvaudit import replay
from kvaudit.audit.findings import Finding
from kvaudit.audit.runner import AuditedRun, execute
from kvaudit.program import Abort, Idle, Step, Submit
from kvaudit.program.generate import random_program
from kvaudit.targets.eut.presets import get_preset
from replay_helpers import CoverAll, count_replays

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ZOO = sorted(glob.glob(os.path.join(ROOT, "corpora", "regressions", "*.json")))


def _key(findings: list[Finding]) -> list[tuple[str, int, int]]:
    return [(f.signature, f.op_index, f.step) for f in findings]


def _run(config, program, check_every: int) -> AuditedRun:
    """The program as a search runs it: up to its first finding, then the end-of-program check."""
    with AuditedRun(config, full_stacks=False, check_every=check_every) as run:
        for op in program:
            if run.apply(op):
                break
        else:
            run.finish()
    return run


@pytest.mark.parametrize("path", ZOO[:4], ids=[os.path.basename(p) for p in ZOO[:4]])
def test_every_step_is_the_recorded_run(path):
    config, program, recorded, _ = replay.load(path)
    run = _run(config, program, 1)
    assert _key(run.findings) == _key(recorded)
    assert run.finish() == []  # a per-step run has nothing left to check




@pytest.mark.parametrize("check_every", [16, 10**6])
@pytest.mark.parametrize("path", ZOO, ids=[os.path.basename(p) for p in ZOO])
def test_a_sparse_hit_is_reported_as_the_per_step_run(path, check_every):
    config, program, _, _ = replay.load(path)
    want = _key(execute(config, program, full_stacks=False).findings)
    assert want
    # (session-borrow-double-count exists only while a turn runs on a borrowed session record: the
    # target's transient() has the schedule check after every step meanwhile)
    assert _key(_run(config, program, check_every).findings) == want


def test_a_clean_program_checked_sparsely_finds_nothing_and_checks_less():
    config, program, _, _ = replay.load(ZOO[0])
    import dataclasses

    clean = dataclasses.replace(config, bugs=frozenset())
    calls = []
    with AuditedRun(clean, full_stacks=False, check_every=10**6) as run:
        import kvaudit.audit.runner as runner

        real = runner.oracles.check
        runner.oracles.check = lambda *a, **k: calls.append(k) or real(*a, **k)
        try:
            for op in program:
                assert run.apply(op) == []
            assert run.finish() == [] or run.unchecked == 0
        finally:
            runner.oracles.check = real
    assert run.findings == []
    assert len(calls) < run.target.steps


def test_a_hit_the_replay_does_not_reproduce_is_kept_and_says_so():
    config = get_preset("default").config(model="none")
    ghost = Finding(kind="leak", pool="token_to_kv_pool", message="planted", op_index=0, step=1)
    with AuditedRun(config, full_stacks=False, check_every=16) as run:
        run.auditor.pending.append(ghost)  # a finding no engine state backs: the replay is clean
        from kvaudit.program import Step

        found = run.apply(Step(1))
    assert found == [ghost]
    assert "did not reproduce" in ghost.message and "every 16 steps" in ghost.message


def test_check_every_must_be_positive():
    with pytest.raises(ValueError, match="check_every"):
        AuditedRun(get_preset("default").config(model="none"), check_every=0)


@pytest.mark.slow
@pytest.mark.parametrize("bug", sorted(os.path.basename(p)[:-len(".json")] for p in ZOO))
def test_the_search_reports_every_zoo_bug_as_a_per_step_run_of_its_program(bug):
    """The default fuzzer on the sparse schedule (the searches' default) finds the bug, and its report is
    what the per-step audit of the returned program reports: signature, first op and step."""
    from kvaudit.constants import DEFAULT_FUZZER
    from kvaudit.search import fuzzers, schedule
    from kvaudit.search.fuzz import FuzzStats
    from kvaudit.targets import registry

    assert schedule.CHECK_EVERY > 1
    eut = registry.get("eut")
    config = eut.preset(eut.bugs()[bug].preset).config(bugs=frozenset([bug]))
    found = fuzzers.get(DEFAULT_FUZZER).search(config, 120, 1, FuzzStats(), fuzzers.Search(
        max_executions=2000, use_seeds=False))
    assert found is not None, f"{bug}: not found in 2,000 executions"
    program, findings = found
    assert _key(findings) == _key(execute(config, program, full_stacks=False).findings)


def _sites_and_locks(config, program, lean: bool, site_keys: bool = True):
    with AuditedRun(config, full_stacks=False, check_every=16, lean=lean, site_keys=site_keys) as run:
        for op in program:
            if run.apply(op):
                break
        else:
            run.finish()
        a = run.auditor
        return run.findings, a.site_keys(), len(a._site_frames), len(a.lock_events), a.lock_count, len(a.events)


@pytest.mark.parametrize("path", ZOO, ids=[os.path.basename(p) for p in ZOO])
def test_a_lean_run_keeps_what_detects_and_the_site_keys(path):
    """Lean hooks (a search's sparse run): the same findings (the replay's), the same ledger events and
    lock-event count, the same engine lines as the corpus fuzzer's features, and no sites or lock records."""
    config, program, _, _ = replay.load(path)
    found, keys, n_sites, n_locks, lock_count, n_events = _sites_and_locks(config, program, lean=True)
    want, want_keys, _, want_locks, want_count, want_events = _sites_and_locks(config, program, lean=False)
    assert _key(found) == _key(want)
    assert keys == want_keys and keys
    assert (n_sites, n_locks) == (0, 0)
    assert lock_count == want_count == want_locks and n_events == want_events


def test_a_lean_runs_engine_lines_are_resolved_once_per_process():
    """The lean hooks' frame keys -> line numbers are kept for the process (per target definition): a
    second run of a program starts with every line it will meet already known, computes none again, and
    reports the first run's site keys (the corpus fuzzer's features) all the same."""
    config, program, _, _ = replay.load(ZOO[0])
    keys = []
    for _ in range(2):
        with AuditedRun(config, full_stacks=False, lean=True, check_every=16) as run:
            known = len(run.auditor._lean_lines)
            for op in program:
                if run.apply(op):
                    break
            else:
                run.finish()
            keys.append(run.auditor.site_keys())
    assert keys[1] == keys[0] and keys[0]
    assert known and len(run.auditor._lean_lines) == known  # the second run: every line known at its start


def test_lean_is_off_where_a_run_reports_itself():
    """A per-step run (no replay behind it) and a run with suppressions (they sift its own findings by
    signature) keep every site however asked."""
    from kvaudit.audit.suppress import SuppressionSet

    config = get_preset("default").config(model="none")
    for kwargs in ({"check_every": 1}, {"check_every": 16, "suppressions": SuppressionSet([])}):
        with AuditedRun(config, full_stacks=False, lean=True, **kwargs) as run:
            assert not run.auditor.lean
    with AuditedRun(config, full_stacks=False, lean=True, check_every=16) as run:
        assert run.auditor.lean


def test_the_search_run_is_lean():
    from kvaudit.search import schedule

    with schedule.search_run(get_preset("default").config(model="none")) as run:
        assert run.check_every > 1 and run.auditor.lean


def test_no_kind_has_its_own_search_schedule():
    # a target says when it needs a check after a step (Target.transient); the kinds' table has no per-kind K
    import dataclasses

    from kvaudit.targets.registry import TargetKind

    assert not [f.name for f in dataclasses.fields(TargetKind) if "check" in f.name and f.name != "engine_check"]


class _Covers:
    """Suppressions (the interface the runner takes, as the history suite's ``NotThisBug``) that cover
    the given signatures."""

    needs_full_stacks = False

    def __init__(self, signatures):
        self.signatures = set(signatures)

    def sift(self, findings, suppressed):
        suppressed.extend(f for f in findings if f.signature in self.signatures)
        return [f for f in findings if f.signature not in self.signatures]


@pytest.mark.parametrize("path", ZOO, ids=[os.path.basename(p) for p in ZOO])
def test_a_covered_hit_is_localized_like_any_other(path):
    # the per-step run's findings covered: the sparse run reports what the per-step run reports past
    # them, never its own late sighting of a covered bug (whose signature can differ: the full check met
    # the units later, e.g. without the chunked request they came from)
    config, program, _, _ = replay.load(path)
    covered = {f.signature for f in execute(config, program, full_stacks=False).findings}

    def run(check_every):
        with AuditedRun(config, full_stacks=False, suppressions=_Covers(covered), check_every=check_every) as r:
            for op in program:
                if r.apply(op):
                    break
            else:
                r.finish()
        return r

    per_step, sparse = run(1), run(16)
    assert _key(sparse.findings) == _key(per_step.findings)
    assert not any("did not reproduce" in f.message for f in sparse.findings)
    assert {f.signature for f in sparse.suppressed} & covered


def _ending_cases():
    from kvaudit.program import Abort, FlushCache, Idle, MemoryPressure, PauseGeneration, Step, Submit

    return [  # (preset, bug, program): found per step, then ended by an op before the next sparse check
        ("mixed-chunk", "prefill-finish-leaks-row",
         [Submit(family=0, prompt_len=1, max_new_tokens=1), Step(2), FlushCache(0), Idle()]),
        ("chunked", "chunked-abort-ignored",
         [Submit(prompt_len=33, max_new_tokens=1), Step(1), Abort(None), Step(1), FlushCache(0), Idle()]),
        ("retract", "radix-lock-skips-matched-node",
         [Submit(family=4, prompt_len=13, max_new_tokens=7), Step(1), MemoryPressure(), Step(3), Abort(None), Idle()]),
        ("retract", "radix-lock-skips-matched-node",
         [Submit(family=4, prompt_len=13, max_new_tokens=7), Step(1), MemoryPressure(), Step(3),
          PauseGeneration(mode=0), Idle()]),
    ]


@pytest.mark.parametrize("case", range(4))
def test_an_op_that_ends_a_state_is_checked_before(case):
    # a leak a flush wipes, a use-after-free whose request an abort or a pause releases: the per-step run
    # meets them after the step before that op; the sparse schedule checks there too (OpSpec.ends)
    preset, bug, program = _ending_cases()[case]
    config = get_preset(preset).config(model="none", bugs=frozenset([bug]))
    want = _key(execute(config, program, full_stacks=False).findings)
    assert want
    assert _key(_run(config, program, 16).findings) == want


def test_a_transient_answer_is_asked_once_a_step():
    # a target's transient() may note what it has seen (vLLM's newly idle engine answers True once): the
    # schedule asks it once a step and checks on that answer
    from kvaudit.program import Step, Submit

    config = get_preset("default").config(model="none")
    with AuditedRun(config, full_stacks=False, check_every=16) as run:
        asked = []

        def once():
            asked.append(run.target.steps)
            return asked.count(run.target.steps) == 1

        run.target.transient = once
        run.apply(Submit())
        run.apply(Step(1))
        assert run.unchecked == 0  # checked after that step
        assert asked == [1]


def _checks_at_finish(program, paranoid: bool = False) -> int:
    import kvaudit.audit.runner as runner

    config = get_preset("default").config(model="none")
    with AuditedRun(config, full_stacks=False, check_every=16, lean=True, paranoid=paranoid) as run:
        for op in program:
            assert run.apply(op) == []
        real, calls = runner.oracles.check, []
        runner.oracles.check = lambda *a, **k: calls.append(k) or real(*a, **k)
        try:
            assert run.finish() == []
        finally:
            runner.oracles.check = real
    return len(calls)


def test_a_check_at_idle_that_would_sweep_what_the_last_swept_is_skipped():
    # the drain forced no check (stop 57): finish() sweeps what it left. After 40 idle steps the every-K
    # check has swept the idle engine; only idle iterations ran since: finish() has nothing new to sweep.
    # A message since (an abort of no request: no ledger event) or a paranoid run: it sweeps
    from kvaudit.program import Abort, Idle, Step, Submit

    drained = [Submit(prompt_len=9, max_new_tokens=2), Idle()]
    assert _checks_at_finish(drained) == 1
    assert _checks_at_finish(drained + [Step(40)]) == 0
    assert _checks_at_finish(drained + [Step(40)], paranoid=True) == 1
    assert _checks_at_finish(drained + [Step(40), Abort(None), Step(1)]) == 1


def test_a_search_checks_per_step_only_in_its_kinds_first_programs(monkeypatch):
    # TargetKind.search_per_step_first: the first N programs of a search run with a check after every step
    # (no localizing replay on a hit there); the eut asks for none, a kind that asks for 2 gets programs 1-2
    import time

    from kvaudit.search import fuzz, schedule

    config = get_preset("default").config(model="none")
    assert schedule.per_step_first(config) == 0
    seen = []
    real = schedule.search_run

    def spy(*a, **k):
        run = real(*a, **k)
        seen.append(run.check_every)
        return run

    monkeypatch.setattr(schedule, "search_run", spy)
    monkeypatch.setattr(schedule, "per_step_first", lambda c: 2)
    stats = fuzz.FuzzStats()
    for n in (1, 2, 3):
        stats.executions = n
        fuzz.run_program(config, [], stats, None, time.monotonic() + 60)
    assert seen == [1, 1, schedule.CHECK_EVERY]


def test_later_localizations_go_on_with_the_open_replay(monkeypatch):
    # every finding covered, so a program meets several localizations: one replay engine per program,
    # each op replayed once (the replay goes on from where the last localization left it), and what it
    # passes over is what the per-step run passes over
    built, applied, asked = count_replays(monkeypatch)
    several = 0
    for path, seed in ((path, seed) for path in ZOO for seed in range(8)):
        config = replay.load(path)[0]
        program = random_program(random.Random(seed), 60)
        with AuditedRun(config, full_stacks=False, suppressions=CoverAll()) as per_step:
            for op in program:
                per_step.apply(op)
        built[0], applied[0], asked[:] = 0, 0, []
        with AuditedRun(config, full_stacks=False, suppressions=CoverAll(), check_every=16) as sparse:
            for op in program:
                sparse.apply(op)
            sparse.finish()
        assert built[0] == (1 if asked else 0) and applied[0] == max(asked, default=0)
        assert _key(sparse.suppressed) == _key(per_step.suppressed)[:len(sparse.suppressed)]
        several += len(set(asked)) > 1
        if several >= 2:
            break
    assert several  # (random programs on the zoo's configs meet several covered findings)


def test_an_idle_ops_loop_reads_is_idle_once_a_step_on_the_sparse_schedule():
    # the loop's read before a step is the state the last step's check read after it (nothing ran between):
    # a sparse run asks the target once per step, not twice; a per-step run and the bare engine as before
    from kvaudit.program import Idle, Submit

    config = get_preset("default").config(model="none")
    # (sparse: the drain forces no check since stop 57, so the loop reads it once a step, as the bare engine)
    for every, audit, want in ((16, True, lambda steps: steps), (1, True, lambda steps: 2 * steps),
                               (16, False, lambda steps: steps)):
        with AuditedRun(config, audit=audit, full_stacks=False, check_every=every) as run:
            run.apply(Submit(prompt_len=9, max_new_tokens=6))
            real, asked = run.target.is_idle, []
            run.target.is_idle = lambda: asked.append(run.target.steps) or real()
            before = run.target.steps
            assert run.apply(Idle()) == []
            steps = run.target.steps - before
            assert steps >= 3 and len(asked) == want(steps), (every, audit, steps, asked)


@pytest.mark.parametrize("lean", [True, False])
def test_a_sparse_runs_events_carry_the_per_step_runs_op_and_step(lean):
    # the sparse runner stores the auditor's op index and step without its setters (nothing to pair): every
    # ledger event still carries the op and step a per-step run records
    config = get_preset("default").config(model="none")
    program = random_program(random.Random(7), 40)

    def events(check_every: int) -> list[tuple]:
        with AuditedRun(config, full_stacks=False, check_every=check_every, lean=lean) as run:
            for op in program:
                assert run.apply(op) == []
            run.finish()
            return [(e.kind, e.pool, e.units, e.op_index, e.step) for e in run.auditor.events]

    got = events(16)
    assert len({(e[3], e[4]) for e in got}) > 10 and got == events(1)


@pytest.mark.parametrize("check_every,lean", [(16, True), (1, False)], ids=["sparse-lean", "per-step"])
def test_a_closed_run_and_its_ledger_are_freed_by_reference_counts(check_every, lean):
    # a run the cycle collector has to free keeps its ledger (every Event, the site keys) in the collector's young
    # generations until then: measured at 0.035x of the bare engine's CPU time (docs/internals/performance.md, stop 56)
    import gc
    import weakref

    config = get_preset("default").config(model="none")
    program = random_program(random.Random(3), 20)
    gc.collect()
    gc.disable()
    try:
        run = AuditedRun(config, full_stacks=False, check_every=check_every, lean=lean)
        for op in program:
            run.apply(op)
        run.finish()
        assert run.auditor.events  # (the program allocated: there is a ledger to free)
        run.close()
        auditor, ledger, run_ref = weakref.ref(run.auditor), weakref.ref(run.auditor.ledgers["token_to_kv_pool"]), weakref.ref(run)
        del run
        assert run_ref() is None, "the closed run is still referenced: only the cycle collector frees it"
        assert auditor() is None and ledger() is None, "the closed run's auditor is still referenced"
    finally:
        gc.enable()


def test_an_idle_ops_drain_forces_no_check_on_the_sparse_schedule():
    # stop 57: an Idle op's drain is swept by the next forced check (every K steps, before an ending op, at
    # finish()), not by one of its own; a per-step run checks after every step as before
    import kvaudit.audit.runner as runner
    from kvaudit.program import Idle, Submit

    config = get_preset("default").config(model="none")
    program = [Submit(prompt_len=9, max_new_tokens=2), Idle(), Submit(prompt_len=12, max_new_tokens=3), Idle()]
    real = runner.oracles.check
    for every, lean in ((16, True), (16, False)):
        calls = []
        runner.oracles.check = lambda *a, **k: calls.append(k) or real(*a, **k)
        try:
            with AuditedRun(config, full_stacks=False, check_every=every, lean=lean) as run:
                for op in program:
                    assert run.apply(op) == []
                steps = run.target.steps
                assert steps < every and calls == []  # (two drains, no check)
                assert run.finish() == [] and [k.get("idle") for k in calls] == [True]
        finally:
            runner.oracles.check = real


@pytest.mark.parametrize("name", ["radix-lock-skips-matched-node", "prefill-finish-leaks-row",
                                  "retract-unaligned-page", "hisparse-prebuilt-skip-finish"])
def test_a_bug_met_at_a_drain_no_check_swept_is_reported_at_its_first_step(name):
    # the per-step run meets the bug at an Idle op's drain (the lock imbalance, a leak at idle); on the sparse
    # schedule that drain is not checked and the program goes on: the hit comes later (at the latest at
    # finish()), and its localizing replay reports the per-step run's signature, first op and step
    from kvaudit.program import Idle, Submit

    config, program, _, _ = replay.load(os.path.join(ROOT, "corpora", "regressions", f"{name}.json"))
    want = execute(config, program, full_stacks=False).findings
    first = want[0].op_index
    assert isinstance(program[first], Idle)
    longer = program[:first + 1] + [Submit(prompt_len=10, max_new_tokens=2), Idle()]
    want = _key(execute(config, longer, full_stacks=False).findings)
    assert want and want[0][1] == first
    with AuditedRun(config, full_stacks=False, check_every=16, lean=True) as run:
        hit_at = next((i for i, op in enumerate(longer) if run.apply(op)), None)
        if hit_at is None:
            assert run.finish()
        assert hit_at is None or hit_at > first  # (the drain at `first` swept nothing)
        assert _key(run.findings) == want


@pytest.mark.parametrize("path", ZOO, ids=[os.path.basename(p) for p in ZOO])
def test_a_lean_run_without_site_keys_detects_the_same(path):
    """A search's program that collects no site keys (schedule.site_keys_due): the same findings (the
    replay's), ledger events and lock-event count as one that does, and no site keys."""
    config, program, _, _ = replay.load(path)
    found, keys, _, _, lock_count, n_events = _sites_and_locks(config, program, lean=True, site_keys=False)
    want, want_keys, _, _, want_count, want_events = _sites_and_locks(config, program, lean=True)
    assert _key(found) == _key(want) and want
    assert (lock_count, n_events) == (want_count, want_events)
    assert keys == set() and want_keys


def test_a_search_collects_the_site_keys_in_one_program_of_every_16():
    # stop 57: the 1st, 17th, 33rd ... program of a search collect the site keys (the corpus fuzzer's site
    # features, the progress line's count); the others none, with the same detection
    import time

    from kvaudit.search import fuzz, schedule
    from kvaudit.search.fuzz import FuzzStats

    assert schedule.SITE_KEYS_EVERY == 16
    assert [n for n in range(1, 50) if schedule.site_keys_due(n)] == [1, 17, 33, 49]
    config = get_preset("default").config(model="none")
    program = random_program(random.Random(3), 30)
    got = {}
    for n in (1, 2, 17):
        stats = FuzzStats()
        stats.executions = n
        ran, found, _, sites = fuzz.run_program(config, program, stats, None, time.monotonic() + 120)
        got[n] = (ran, _key(found), sites, stats.sites)
    assert got[1][2] and got[17][2] == got[1][2] == got[1][3]
    assert got[2][2] == set() == got[2][3]
    assert got[1][:2] == got[2][:2] == got[17][:2]


def test_ending_ops_in_a_row_and_the_end_check_sweep_only_after_a_step():
    # the forced checks (before an ending op, at finish()) sweep only when a step ran since the last check:
    # an ending op right after another, and finish() right after them, have nothing new to sweep (stop 59
    # counted 354 of 747 ending ops so skipped, 147 of them right after another ending op). A leak planted
    # in the step right before an ending op is still met there, at the per-step run's step and op
    import kvaudit.audit.runner as runner
    from kvaudit.program import Abort, FlushCache, Step, Submit

    real = runner.oracles.check
    calls = []
    runner.oracles.check = lambda *a, **k: calls.append(k) or real(*a, **k)
    try:
        config = get_preset("default").config(model="none")
        with AuditedRun(config, full_stacks=False, check_every=16, lean=True) as run:
            assert run.apply(Submit(prompt_len=9, max_new_tokens=4)) == [] and run.apply(Step(1)) == []
            assert calls == []
            for op, swept in ((Abort(0), 1), (FlushCache(0), 1), (Abort(None), 1)):
                assert run.apply(op) == [] and len(calls) == swept
            assert run.finish() == [] and len(calls) == 1
    finally:
        runner.oracles.check = real
    preset, bug, program = _ending_cases()[0]  # (a leak a flush wipes)
    program = program[:2] + [Abort(None)] + program[2:]
    config = get_preset(preset).config(model="none", bugs=frozenset([bug]))
    want = _key(execute(config, program, full_stacks=False).findings)
    assert want and _key(_run(config, program, 16).findings) == want


@pytest.mark.parametrize("lean", [False, True])
def test_an_idle_verdict_at_the_programs_end_is_found_by_the_end_check(monkeypatch, lean):
    """Liveness judges a lost request or an ignored abort at idle only, and a sparse run samples it at its full
    checks; the end-of-program check (``finish()``) swept the memory oracles, not liveness, so a program whose last
    idle left a request its abort was ignored for (the mutant abort-running-ignored, from the engine's class: the
    replay's fresh engine has it too) was clean sparse and a finding per step. Now the search reports what the
    per-step run does."""
    from engine_under_test.scheduler import Scheduler

    intake = Scheduler.process_input_requests

    def ignoring(self):  # the abort's to_finish dropped as the intake set it: the request runs to its end
        intake(self)
        for r in self.running_batch:
            r.to_finish = None

    monkeypatch.setattr(Scheduler, "process_input_requests", ignoring)
    config = get_preset("default").config(model="none")
    program = [Submit(family=0, prompt_len=9, max_new_tokens=12), Step(2), Abort(handle=0), Idle()]
    want = _key(execute(config, program).findings)
    assert [s for s, _, _ in want] == ["liveness/-/progress/-:abort-ignored"]
    with AuditedRun(config, full_stacks=False, check_every=16, lean=lean) as run:
        assert not any(run.apply(op) for op in program)  # (no full check due before the end: 16 steps apart)
        assert _key(run.finish()) == want
