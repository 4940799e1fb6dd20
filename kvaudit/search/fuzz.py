"""Fuzzing: a Hypothesis state machine whose rules are program ops, the plain random baseline, and the
confirm/minimize pipeline (:func:`triage`) every fuzzer's finding goes through.

Design notes: docs/internals/fuzzers.md.
"""

from __future__ import annotations

import dataclasses
import functools
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

from hypothesis import HealthCheck as HypHealthCheck
from hypothesis import Phase, Verbosity, seed, settings
from hypothesis import strategies as st
from hypothesis.errors import Flaky, FlakyFailure
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule, run_state_machine_as_test

from kvaudit.config import TargetConfig
from kvaudit.constants import CONFIRM_RUNS
from kvaudit.audit.findings import Finding
from kvaudit.search.minimize import OutOfTime, minimize, reproduces
from kvaudit.program import Idle, Op, make_op, random_program
from kvaudit.program.schema import OPS, kinds, swarm_groups
from kvaudit.program.schema import max_prompt as context_max_prompt
from kvaudit.program.schema import reach as program_reach
from kvaudit.program.strategies import arg_strategies
from kvaudit.audit.runner import execute, is_watchdog_hang
from kvaudit.search import schedule
from kvaudit.targets import program_features
from kvaudit.targets.registry import TargetDefinitionError


class FindingFound(AssertionError):
    """Raised inside a test case so that Hypothesis records it as failing and shrinks it."""


class _BudgetSpent(KeyboardInterrupt):
    """The budget ran out (Hypothesis has no clock: it would run the batch's other cases, or shrink, on).
    KeyboardInterrupt: the one exception that ends a run mid-case without Hypothesis calling the case
    flaky. The last failure, if any, stands."""


class SearchInterrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM (:data:`kvaudit.audit.runner.INTERRUPTED`) while Hypothesis shrank a finding.
    ``found``: (program, findings) of the latest failing case, neither confirmed nor minimized."""

    def __init__(self, found: tuple[list[Op], list[Finding]]):
        super().__init__()
        self.found = found


@functools.cache
def _finding_error(kind: str) -> type:
    # NOTE: Hypothesis tells failures apart by exception type: a shrink never trades a use-after-free for the
    # double free it leads to
    return type(f"FindingFound_{kind.replace('-', '_')}", (FindingFound,), {})


@dataclass
class FuzzStats:
    started: float = field(default_factory=time.monotonic)
    executions: int = 0  # programs the search ran (Hypothesis's shrink reruns count apart)
    shrink_executions: int = 0
    ops: int = 0
    findings: int = 0  # distinct unsuppressed signatures
    phase: str = "fuzzing"
    sites: set = field(default_factory=set)  # (code, line) of every alloc/free/lock site seen
    suppressed: set = field(default_factory=set)  # distinct suppressed signatures seen
    coverage: str | None = None  # the fuzzer's own coverage figure, where it has one ("469 edges")
    first_hit: tuple[int, float] | None = None  # (executions, seconds) at the first finding, before shrinking
    reached: Counter = field(default_factory=Counter)  # Target.reach() summed over the programs run

    def hit(self) -> None:
        if self.first_hit is None:
            self.first_hit = (self.executions, self.elapsed)

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started


@dataclass
class Crash:
    """A confirmed, minimized finding: the program reproduces ``finding.signature`` K of K times."""

    config: TargetConfig
    program: list[Op]
    findings: list[Finding]  # the primary finding first, then others the same op produced
    original_length: int
    confirmations: int
    runs: int = CONFIRM_RUNS  # replays tried: ``confirmations`` of ``runs`` reproduced the signature
    timeline: dict | None = None  # the pool occupancy of ``program`` (kvaudit.reports.timeline.record)
    minimized: bool = True  # False: minimization ran out of time (``program``: the smallest that reproduced)

    @property
    def finding(self) -> Finding:
        return self.findings[0]


class OnlySignature:
    """A search's ``known`` that knows every signature but ``signature`` (with ``substring``, every one
    not containing it): the search goes on until it meets that one bug (benchmarks/rediscover_sglang.py)."""

    def __init__(self, signature: str, substring: bool = False):
        self.signature, self.substring = signature, substring

    def wants(self, sig: str) -> bool:
        return self.signature in sig if self.substring else sig == self.signature

    def __contains__(self, sig: str) -> bool:
        return not self.wants(sig)


class _Recorder:
    def __init__(self, stats: FuzzStats, deadline: float, known: frozenset[str] = frozenset(),
                 on_progress: Callable[[FuzzStats], None] | None = None, cap: int | None = None):
        self.stats = stats
        self.deadline = deadline
        self.known = known  # signatures already reported (a resumed campaign): not failures
        self.last_failure: tuple[list[Op], list[Finding]] | None = None
        self.cap = cap  # executions after which new cases run nothing
        self.on_progress = on_progress
        self._last_tick = time.monotonic()

    def start_program(self) -> bool:
        """Count a case's program (after the first failure, every case is a shrink rerun) and report
        progress at most twice a second. False: the execution budget is spent."""
        if self.last_failure is None:
            if self.cap is not None and self.stats.executions >= self.cap:
                return False
            self.stats.executions += 1
        else:
            self.stats.shrink_executions += 1
        if self.on_progress is not None and time.monotonic() - self._last_tick >= 0.5:
            self._last_tick = time.monotonic()
            self.on_progress(self.stats)
        return True


def _gate(group: str | None):
    return (lambda r: r) if group is None else precondition(lambda self: group in self.swarm)


def _rules(reach: frozenset) -> list[tuple[str, str, tuple[str, ...], str | None]]:
    """(rule name, op kind, pinned arguments, swarm group) of each rule: one per op kind of ``reach``,
    and submits that pin a history (``extends``) or a session."""
    rules = [(kind, kind, (), OPS[kind].swarm) for kind in kinds(reach)]
    if "prefix_cache" in reach:
        rules.append(("submit_extending", "submit", ("extends",), OPS["submit"].swarm))
    if "sessions" in reach:
        rules.append(("submit_turn", "submit", ("session",), OPS["open_session"].swarm))
    return rules


def _machine(config: TargetConfig, rec: _Recorder, max_prompt: int, suppressions=None, swarm: bool = True):
    reach = program_reach(config)
    groups = swarm_groups()

    class ProgramMachine(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            self.run = schedule.search_run(config, suppressions, rec.deadline)
            self.ops: list[Op] = []
            self.swarm = frozenset(groups)
            self.prompt_cap = max_prompt
            self.dead = False  # a known finding ended this case's program: the rest are no-ops

        @initialize(kinds=st.sets(st.sampled_from(groups)) if swarm else st.just(frozenset(groups)),
                    short=st.booleans() if swarm else st.just(False))
        def choose_swarm(self, kinds, short):
            self.swarm = frozenset(kinds)
            self.prompt_cap = max(1, max_prompt // 8) if short else max_prompt

        def _do(self, op: Op) -> None:
            if self.dead:
                return
            if time.monotonic() > rec.deadline:  # out of time: the batch ends here (each case builds an engine)
                self.dead = True
                raise _BudgetSpent
            if not self.ops and not rec.start_program():
                self.dead = True  # the execution budget is spent: this case runs nothing
                return
            self.ops.append(op)
            rec.stats.ops += 1
            self._record(self.run.apply(op))

        def _record(self, found: list[Finding]) -> None:
            # NOTE: past a finding, teardown must not run the closing idle(): replay stops at the first finding,
            # and a second one there (a crash leaves state half-updated) would replace this one
            self.dead = self.run.out_of_time or bool(found)
            if self.run.out_of_time:
                raise _BudgetSpent
            elif found and not all(f.signature in rec.known for f in found):
                rec.stats.hit()
                rec.last_failure = (list(self.ops), found)
                raise _finding_error(found[0].kind)(found[0].signature)

        def teardown(self):
            try:
                if self.ops and not isinstance(self.ops[-1], Idle):
                    self._do(Idle())  # every program ends with the strong idle checks
                if self.ops and not self.dead and time.monotonic() <= rec.deadline:
                    self._record(self.run.finish())  # the sparse schedule's end-of-program check
            finally:
                rec.stats.reached.update(self.run.target.reach())  # (as the random and corpus searches count)
                self.run.close()
                rec.stats.sites |= self.run.auditor.site_keys()
                rec.stats.suppressed.update(f.signature for f in self.run.suppressed)

    def add_rule(name: str, kind: str, pinned: tuple[str, ...], group: str | None):
        def apply(self, **values):
            op = make_op(kind, values, reach, max_prompt)
            if kind == "submit":  # its prompt cut to the case's cap
                op = dataclasses.replace(op, prompt_len=min(op.prompt_len, self.prompt_cap))
            self._do(op)

        apply.__name__ = name
        setattr(ProgramMachine, name, _gate(group)(rule(**arg_strategies(kind, reach, max_prompt, pinned=pinned))(apply)))

    for r in _rules(reach):
        add_rule(*r)
    return ProgramMachine


def confirm(config: TargetConfig, program: list[Op], signature: str, runs: int = CONFIRM_RUNS,
            suppressions=None) -> int:
    """How many of ``runs`` fresh replays yield ``signature`` (``suppressions`` left out of each)."""
    return sum(reproduces(config, program, signature, suppressions) for _ in range(runs))


def retry_seed(seed: int, flaky: int) -> int:
    """The seed of the search after ``flaky`` findings that did not replay: ``seed`` itself first."""
    return seed if not flaky else seed * 1_000_003 + flaky


def triage(config: TargetConfig, program: list[Op], finding: Finding, suppressions=None,
           on_phase: Callable[[str], None] | None = None, minimize_until: float | None = None) -> Crash | None:
    """Confirm, minimize, confirm again; None for a finding that does not replay K of K. ``suppressions``
    applies to every run. ``on_phase`` is told ``"confirming"``, ``"minimizing"`` and ``"confirming the
    minimized program"`` as each starts. ``minimize_until`` (``time.monotonic()`` seconds): minimization stops
    there with the smallest program that reproduced (``Crash.minimized`` False). The crash carries the
    minimized program's occupancy timeline."""
    from kvaudit.reports.timeline import record

    sig = finding.signature
    phase = on_phase or (lambda name: None)
    phase("confirming")
    hang, minimized = is_watchdog_hang(finding), True
    if hang:
        # NOTE: every replay of a hang costs the watchdog's full step limit: one full-stacks replay confirms it
        # (1 of 1) and records the timeline; no minimization, no drain (the engine is stuck)
        program = small = program[:finding.op_index + 1]
        found: list[Finding] = []
        timeline = record(config, small, suppressions=suppressions, findings=found)
        confirmations = runs = 1
    else:
        if confirm(config, program, sig, suppressions=suppressions) < CONFIRM_RUNS:
            return None
        phase("minimizing")
        try:
            small = minimize(config, program, sig, suppressions, until=minimize_until)
        except OutOfTime as e:
            small, minimized = e.smallest, False
        except TargetDefinitionError:  # (a ValueError: the target's mistake a smaller program met, not flakiness)
            raise
        except ValueError:  # NOTE: it replayed K of K, then not: flaky after all (was an internal error, exit 70)
            return None
        phase("confirming the minimized program")
        # full stacks and owners for the report, drained to idle for the engine's verdict there
        found = execute(config, small, suppressions=suppressions, drain=True).findings
        confirmations, runs = confirm(config, small, sig, suppressions=suppressions), CONFIRM_RUNS
        # NOTE: the plot's data is kept in the replay file: writing a report never runs the engine
        timeline = record(config, small, suppressions=suppressions)
    primary = next((f for f in found if f.signature == sig), None)
    if primary is None:
        return None
    others = [f for f in found if f is not primary and (not hang or f.op_index == primary.op_index)]
    return Crash(config, small, [primary] + others, len(program), confirmations, runs=runs, timeline=timeline,
                 minimized=minimized)


def warm_up_hypothesis() -> None:
    """Pay Hypothesis's one-time set-up (a full ``gc.collect()``, reading local modules' constants: 0.5 s
    and more) in this process before a search's clock starts."""
    from hypothesis import given

    @settings(max_examples=1, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HypHealthCheck), verbosity=Verbosity.quiet)
    @given(st.integers())
    def once(_: int) -> None:
        pass

    once()


def _reseed(machine: type, value: int) -> None:
    # @seed(value) again on the same class, without the chain of settings it would build (each @seed wraps the
    # class's previous settings, which run_state_machine_as_test does not read: it is given its own)
    if "_hypothesis_internal_use_settings" in vars(machine):
        delattr(machine, "_hypothesis_internal_use_settings")
    seed(value)(machine)


def hypothesis_search(config: TargetConfig, max_time: float, seed_value: int, stats: FuzzStats,
                      on_progress: Callable[[FuzzStats], None] | None = None,
                      batch_examples: int = 100, max_steps: int = 16,
                      suppressions=None, known: frozenset[str] = frozenset(), database: str | None = None,
                      swarm: bool = True, max_executions: int | None = None) -> tuple[list[Op], list[Finding]] | None:
    """Run seeded Hypothesis batches until a finding or ``max_time`` seconds (shrinking included: past it,
    the last failing case stands). Returns the shrunk failing program and its findings, or None. Findings
    that ``suppressions`` covers or whose signature is in ``known`` are not findings.

    ``database``: a directory or an ``ExampleDatabase`` (a fleet's) whose examples are replayed first.
    ``swarm``: swarm testing. ``max_executions``: stop after that many programs too (not the shrinking).

    Raises :class:`SearchInterrupted` when interrupted after the first failure; KeyboardInterrupt before it."""
    deadline = time.monotonic() + max_time
    rec = _Recorder(stats, deadline, known if isinstance(known, OnlySignature) else frozenset(known), on_progress,
                    cap=None if max_executions is None else stats.executions + max_executions)
    max_prompt = context_max_prompt(config.context_len)
    db = None
    if database is not None:
        from hypothesis.database import DirectoryBasedExampleDatabase

        db = DirectoryBasedExampleDatabase(database) if isinstance(database, str) else database
    hs = settings(max_examples=batch_examples, stateful_step_count=max_steps, deadline=None, database=db,
                  suppress_health_check=list(HypHealthCheck), verbosity=Verbosity.quiet,
                  phases=([Phase.reuse] if db is not None else []) + [Phase.generate, Phase.shrink],
                  report_multiple_bugs=False)
    # NOTE: one machine class per search, seeded again per batch: Hypothesis keeps every state machine class it
    # ran, with its rules and their strategies (RuleBasedStateMachine._setup_state_per_class), so a class per
    # batch grew a long search's heap by ~370 objects every 100 programs, for good (docs/internals/fuzzers.md, "Memory")
    machine = _machine(config, rec, max_prompt, suppressions, swarm)
    batch = 0
    while time.monotonic() < deadline and (rec.cap is None or stats.executions < rec.cap):
        _reseed(machine, seed_value * 1_000_003 + batch)
        try:
            run_state_machine_as_test(machine, settings=hs)
        except _BudgetSpent:
            return rec.last_failure
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM; while shrinking, the failure is not lost with it
            if rec.last_failure is not None:
                raise SearchInterrupted(rec.last_failure) from None
            raise
        except (FindingFound, Flaky) as e:
            # NOTE: the engine is deterministic, the clock is not (the budget's end, the watchdog): a flaky
            # batch (FlakyStrategyDefinition and kin) is lost, not the search; triage replays what was recorded
            if rec.last_failure is not None:
                return rec.last_failure
            if isinstance(e, (FindingFound, FlakyFailure)):
                raise
        batch += 1
        if on_progress:
            on_progress(stats)
    return None


def random_search(config: TargetConfig, max_time: float, seed_value: int, stats: FuzzStats,
                  on_progress: Callable[[FuzzStats], None] | None = None, suppressions=None,
                  known: frozenset[str] = frozenset(), min_ops: int = 4, max_ops: int = 24,
                  max_executions: int | None = None) -> tuple[list[Op], list[Finding]] | None:
    """The plain random baseline: fresh random programs of ``min_ops..max_ops`` ops, no feedback, no
    shrinking. Returns the first program that yields a finding (neither suppressed nor ``known``) with its
    findings, or None after ``max_time`` seconds (or ``max_executions`` programs)."""
    rng = random.Random(seed_value)
    deadline = time.monotonic() + max_time
    max_prompt = context_max_prompt(config.context_len)
    features = program_features(config)  # (and every capability: see corpus_fuzz.corpus_search)
    for _ in programs_until(deadline, max_executions, stats, on_progress):
        program = random_program(rng, rng.randint(min_ops, max_ops), max_prompt=max_prompt, features=features)
        ran, found, out_of_time, _ = run_program(config, program, stats, suppressions, deadline)
        if not out_of_time and found and not all(f.signature in known for f in found):
            stats.hit()
            return program[:ran], found
    return None


def programs_until(deadline: float, max_executions: int | None, stats: FuzzStats,
                   on_progress: Callable[[FuzzStats], None] | None):
    """A search's budget: yields once per program until ``deadline`` (monotonic seconds) or ``max_executions``
    programs, each counted in ``stats.executions`` first; then ``on_progress(stats)``, at most twice a second."""
    cap = None if max_executions is None else stats.executions + max_executions
    last = time.monotonic()
    while time.monotonic() < deadline and (cap is None or stats.executions < cap):
        stats.executions += 1
        yield
        if on_progress and time.monotonic() - last > 0.5:
            last = time.monotonic()
            on_progress(stats)


def run_program(config: TargetConfig, program: list[Op], stats: FuzzStats, suppressions, deadline: float,
                on_step: Callable | None = None, site_keys: bool | None = None) -> tuple[int, list[Finding], bool, set]:
    """Run ``program`` from a fresh audited engine (fast stacks) up to its first finding or ``deadline``
    (monotonic seconds), counting into ``stats``; ``on_step``: the run's, called after each scheduler step;
    ``site_keys``: whether it collects them (None: :func:`kvaudit.search.schedule.site_keys_due`).
    Returns (ops run, up to the first finding's op: a sparse check that met a hit after it, the replay named
    it; the last op's findings, whether the deadline cut the program, the auditor's site keys: empty in a
    program that collects none, :func:`kvaudit.search.schedule.site_keys_due`)."""
    per_step = stats.executions <= schedule.per_step_first(config)  # (the caller counted this program)
    site_keys = schedule.site_keys_due(stats.executions) if site_keys is None else site_keys
    with schedule.search_run(config, suppressions, deadline, per_step, site_keys) as run:
        if on_step is not None:
            run.on_step = on_step
        ran, found = 0, []
        for op in program:
            found = run.apply(op)
            ran += 1
            stats.ops += 1
            if run.out_of_time or found:
                break
        else:
            found = run.finish()  # the sparse schedule's end-of-program check
        sites = run.auditor.site_keys()
        stats.reached.update(run.target.reach())
        stats.sites |= sites
        stats.suppressed.update(f.signature for f in run.suppressed)
    if found:  # (runs are deterministic: the program up to that op reproduces the report)
        ran = min(ran, 1 + min((f.op_index for f in found if f.op_index >= 0), default=ran - 1))
    return ran, found, run.out_of_time, sites
