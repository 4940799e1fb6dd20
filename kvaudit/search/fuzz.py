"""Fuzzing: a Hypothesis state machine whose rules are program ops, plus the confirm/minimize pipeline.

Each Hypothesis test case builds a fresh audited engine and applies ops as rules fire; a finding
fails the case and Hypothesis shrinks it. The shrunk program is then confirmed by K-of-K
deterministic replays, minimized by :mod:`kvaudit.search.minimize`, and confirmed again before it is
reported (syzkaller reproduces a crash before reporting it, for the same reason).
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import time
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
from kvaudit.search.minimize import minimize
from kvaudit.program import Idle, Op, make_op, random_program
from kvaudit.program.schema import OPS, kinds, swarm_groups
from kvaudit.program.schema import max_prompt as context_max_prompt
from kvaudit.program.schema import reach as program_reach
from kvaudit.program.strategies import arg_strategies
from kvaudit.audit.runner import AuditedRun, execute, is_watchdog_hang
from kvaudit.targets import program_features


class FindingFound(AssertionError):
    """Raised inside a test case so that Hypothesis records it as failing and shrinks it."""


class _BudgetSpent(KeyboardInterrupt):
    """Raised inside a test case when the search's budget ran out while Hypothesis shrinks a failure
    (its shrinker has no wall-clock limit of its own). A KeyboardInterrupt, the one exception
    Hypothesis lets end a run mid-case without taking it for a failure or recording the cut-short
    case (any other makes its data tree call the case flaky); :func:`hypothesis_search` catches it.
    The last failing program stands; the minimizer (:func:`triage`) finishes the job."""


class SearchInterrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM (:data:`kvaudit.audit.runner.INTERRUPTED`) during a search that had met a
    finding it had not returned yet, while Hypothesis shrank it. ``found``: (program, findings) of the
    latest failing case -- the first one, or a smaller one the shrinking reached since --, neither
    confirmed nor minimized. Callers that do not know it take it as the KeyboardInterrupt it is."""

    def __init__(self, found: tuple[list[Op], list[Finding]]):
        super().__init__()
        self.found = found


_KIND_ERRORS: dict[str, type] = {}


def _finding_error(kind: str) -> type:
    """A FindingFound subclass per finding kind: Hypothesis tells failures apart by exception type,
    so a shrink never trades a use-after-free for the double free it leads to."""
    if kind not in _KIND_ERRORS:
        _KIND_ERRORS[kind] = type(f"FindingFound_{kind.replace('-', '_')}", (FindingFound,), {})
    return _KIND_ERRORS[kind]


@dataclass
class FuzzStats:
    started: float = field(default_factory=time.monotonic)
    executions: int = 0  # programs the search ran (Hypothesis's shrink reruns count apart)
    shrink_executions: int = 0  # reruns while Hypothesis shrank a failure
    ops: int = 0
    findings: int = 0  # distinct unsuppressed signatures
    phase: str = "fuzzing"
    # engine code reached: (code, line) of every alloc/free/lock site seen (the coverage Hypothesis
    # can give without instrumenting the interpreter)
    sites: set = field(default_factory=set)
    suppressed: set = field(default_factory=set)  # distinct suppressed signatures seen
    coverage: str | None = None  # the fuzzer's own coverage figure, where it has one ("469 edges")
    # (executions, seconds) when the first finding was seen, before any shrinking: time-to-bug
    # ("found after N executions")
    first_hit: tuple[int, float] | None = None

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
    timeline: dict | None = None  # the pool occupancy of ``program`` (kvaudit.reports.timeline.record), recorded by triage

    @property
    def finding(self) -> Finding:
        return self.findings[0]


class OnlySignature:
    """A search's ``known`` that knows every signature but one: the search goes on past every other
    finding (it ends that program, as a known one does) until it meets ``signature`` (or, with
    ``substring``, a signature containing it). For measuring executions to one given bug
    (benchmarks/rediscover_sglang.py); atheris's harness takes a list of signatures, not this."""

    def __init__(self, signature: str, substring: bool = False):
        self.signature, self.substring = signature, substring

    def wants(self, sig: str) -> bool:
        return self.signature in sig if self.substring else sig == self.signature

    def __contains__(self, sig: str) -> bool:
        return not self.wants(sig)


class _Recorder:
    def __init__(self, stats: FuzzStats, deadline: float, known: frozenset[str] = frozenset(),
                 on_progress: Callable[[FuzzStats], None] | None = None):
        self.stats = stats
        self.deadline = deadline
        self.known = known  # signatures already reported (a resumed campaign): not failures
        self.last_failure: tuple[list[Op], list[Finding]] | None = None
        self.cap: int | None = None  # executions after which new cases run nothing
        self.on_progress = on_progress
        self._last_tick = time.monotonic()

    def start_program(self) -> bool:
        """A case's first op: count the program (a shrink rerun apart from the search's executions:
        with report_multiple_bugs off, every case after the first failure is one) and report progress
        at most twice a second (a batch can take seconds). False: the execution budget is spent."""
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


# Swarm testing (Groce et al., ISSTA 2012): each test case leaves out a random subset of the op
# kinds' swarm groups (OpSpec.swarm: kvaudit.program.schema.swarm_groups), so that programs made of a few
# kinds only (aborts and idles, say, with no steps to dilute them) are drawn far more often than a fixed
# mix would draw them. step and idle (swarm None) are always in.


def _gate(group: str | None):
    """A rule's gate: drawn only in a case whose swarm keeps ``group`` (None: in every case)."""
    return (lambda r: r) if group is None else precondition(lambda self: group in self.swarm)


def _rules(reach: frozenset) -> list[tuple[str, str, tuple[str, ...], str | None]]:
    """(rule name, op kind, pinned arguments, swarm group) of each rule: one per op kind of the schema
    the target models, every argument drawn from the schema (:mod:`kvaudit.program.strategies`); submits
    have two more that pin a history (shared prefixes, a chat client resending it) or a session (drawn
    with the ops that open and close sessions), so about one rule in four sends a request."""
    rules = [(kind, kind, (), OPS[kind].swarm) for kind in kinds(reach)]
    if "prefix_cache" in reach:
        rules.append(("submit_extending", "submit", ("extends",), OPS["submit"].swarm))
    if "sessions" in reach:
        rules.append(("submit_turn", "submit", ("session",), OPS["open_session"].swarm))
    return rules


def _machine(config: TargetConfig, rec: _Recorder, max_prompt: int, suppressions=None, swarm: bool = True):
    reach = program_reach(config)  # ops and arguments the target gives meaning to
    groups = swarm_groups()

    class ProgramMachine(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            self.run = AuditedRun(config, full_stacks=False, suppressions=suppressions, deadline=rec.deadline)
            self.ops: list[Op] = []
            self.swarm = frozenset(groups)
            self.prompt_cap = max_prompt
            self.dead = False  # a known finding ended this case's program: the rest are no-ops

        @initialize(kinds=st.sets(st.sampled_from(groups)) if swarm else st.just(frozenset(groups)),
                    short=st.booleans() if swarm else st.just(False))
        def choose_swarm(self, kinds, short):
            """The case's swarm: the op kinds it may use, and (a preset option) short prompts only."""
            self.swarm = frozenset(kinds)
            self.prompt_cap = max(1, max_prompt // 8) if short else max_prompt

        def _do(self, op: Op) -> None:
            if self.dead:
                return
            if time.monotonic() > rec.deadline:
                if rec.last_failure is None:
                    return  # out of time: let the remaining cases finish as no-ops
                self.dead = True
                raise _BudgetSpent  # shrinking past the budget: stop Hypothesis, keep the last failure
            if not self.ops and not rec.start_program():
                self.dead = True  # the execution budget is spent: this case runs nothing
                return
            self.ops.append(op)
            rec.stats.ops += 1
            found = self.run.apply(op)
            # out of time inside this op (an idle() or a long step), or a known finding: the case ends.
            # Past a finding teardown must not run the closing idle(): the program would end with an op
            # that never runs on replay (which stops at the first finding), and a second finding there
            # (a crash leaves state half-updated) would replace this one
            self.dead = self.run.out_of_time or bool(found)
            if self.run.out_of_time:
                if rec.last_failure is not None:
                    raise _BudgetSpent
            elif found and not all(f.signature in rec.known for f in found):
                rec.stats.hit()
                rec.last_failure = (list(self.ops), found)
                raise _finding_error(found[0].kind)(found[0].signature)

        def teardown(self):
            try:
                if self.ops and not isinstance(self.ops[-1], Idle):
                    self._do(Idle())  # every program ends with the strong idle checks
            finally:
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
    """How many of ``runs`` fresh replays yield ``signature`` (with ``suppressions``, a
    :class:`kvaudit.audit.suppress.SuppressionSet`, left out of each)."""
    return sum(signature in execute(config, program, full_stacks=False, suppressions=suppressions).signatures
               for _ in range(runs))


def retry_seed(seed: int, flaky: int) -> int:
    """The seed of the search after ``flaky`` findings that did not replay (``kvaudit fuzz`` and
    :func:`kvaudit.testing.fuzz` search on past them): ``seed`` itself first, then a fresh one each."""
    return seed if not flaky else seed * 1_000_003 + flaky


def triage(config: TargetConfig, program: list[Op], finding: Finding, suppressions=None,
           on_phase: Callable[[str], None] | None = None) -> Crash | None:
    """Confirm, minimize, confirm again. Returns None for a finding that does not replay K of K.
    ``suppressions`` applies to every run, so the crash keeps an unsuppressed signature and lists
    no suppressed findings. ``on_phase`` is told each phase as it starts: ``"confirming"``,
    ``"minimizing"``, ``"confirming the minimized program"``. The crash carries the minimized
    program's occupancy timeline (:func:`kvaudit.reports.timeline.record`), for its replay file and reports."""
    from kvaudit.reports.timeline import record

    sig = finding.signature
    phase = on_phase or (lambda name: None)
    phase("confirming")
    if is_watchdog_hang(finding):
        # Every replay of a hang costs the watchdog's full step limit, and ddmin would need dozens:
        # one full-stacks replay confirms it (1 of 1) and records the report's timeline; no
        # minimization (Hypothesis already shrank it within the budget), no drain (the engine is stuck).
        program = program[:finding.op_index + 1]
        found: list[Finding] = []
        timeline = record(config, program, suppressions=suppressions, findings=found)
        primary = next((f for f in found if f.signature == sig), None)
        if primary is None:
            return None
        others = [f for f in found if f is not primary and f.op_index == primary.op_index]
        return Crash(config, program, [primary] + others, len(program), 1, runs=1, timeline=timeline)
    if confirm(config, program, sig, suppressions=suppressions) < CONFIRM_RUNS:
        return None
    phase("minimizing")
    small = minimize(config, program, sig, suppressions)
    phase("confirming the minimized program")
    # full stacks and owners for the report; then drained to idle for the engine's verdict there
    final = execute(config, small, suppressions=suppressions, drain=True)
    primary = next(f for f in final.findings if f.signature == sig)
    others = [f for f in final.findings if f is not primary]
    confirmations = confirm(config, small, sig, suppressions=suppressions)
    # NOTE: the plot's data is recorded here, with the finding, and kept in its replay file: writing a
    # report never runs the engine (kvaudit.reports.outputs)
    return Crash(config, small, [primary] + others, len(program), confirmations,
                 timeline=record(config, small, suppressions=suppressions))


def warm_up_hypothesis() -> None:
    """Pay Hypothesis's one-time set-up in this process before a search's clock starts (``--max-time`` is
    search time: :mod:`kvaudit.app.budget`). Its first run registers numpy's global PRNG, which runs a
    full ``gc.collect()`` (0.45 s measured with a test suite's objects alive; more with a real engine's
    loaded), and reads the constants of every local module it has not read yet: paid inside the budget,
    a 0.5 s search ran no program at all. One generated example of a trivial test does both."""
    from hypothesis import given

    @settings(max_examples=1, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HypHealthCheck), verbosity=Verbosity.quiet)
    @given(st.integers())
    def once(_: int) -> None:
        pass

    once()


def hypothesis_search(config: TargetConfig, max_time: float, seed_value: int, stats: FuzzStats,
                      on_progress: Callable[[FuzzStats], None] | None = None,
                      batch_examples: int = 100, max_steps: int = 16,
                      suppressions=None, known: frozenset[str] = frozenset(), database: str | None = None,
                      swarm: bool = True, max_executions: int | None = None) -> tuple[list[Op], list[Finding]] | None:
    """Run seeded Hypothesis batches until a finding or ``max_time`` seconds. Returns the shrunk
    failing program and its findings, or None. The budget bounds the shrinking too: past it, the
    program of the last failing case is returned as Hypothesis left it (``stats.first_hit`` holds
    the executions and seconds to the first failure; shrink reruns count in
    ``stats.shrink_executions``, not ``stats.executions``). Findings that ``suppressions`` (a
    :class:`kvaudit.audit.suppress.SuppressionSet`) covers are not findings: the search goes on past them
    (they count as hits of the set); nor are those whose signature is in ``known``.

    ``database``: a directory for Hypothesis's example database (a campaign's corpus), or an
    ``ExampleDatabase`` (a fleet's, :meth:`kvaudit.search.hub.Hub.example_database`), whose saved
    examples are replayed first. ``swarm``: swarm testing (see :func:`kvaudit.program.schema.swarm_groups`). ``max_executions``:
    stop after that many programs too (cases past it run nothing; shrinking is not cut by it).

    Raises :class:`SearchInterrupted`, carrying the failing program, when interrupted after the first
    failure (Hypothesis shrinks it before the run returns: seconds to minutes); KeyboardInterrupt
    before it. In a campaign the failing case is in ``database`` too (Hypothesis saves it as it fails)."""
    deadline = time.monotonic() + max_time
    rec = _Recorder(stats, deadline, known if isinstance(known, OnlySignature) else frozenset(known), on_progress)
    if max_executions is not None:
        rec.cap = stats.executions + max_executions
    max_prompt = context_max_prompt(config.context_len)
    db = None
    if database is not None:
        from hypothesis.database import DirectoryBasedExampleDatabase

        db = DirectoryBasedExampleDatabase(database) if isinstance(database, str) else database
    hs = settings(max_examples=batch_examples, stateful_step_count=max_steps, deadline=None, database=db,
                  suppress_health_check=list(HypHealthCheck), verbosity=Verbosity.quiet,
                  phases=([Phase.reuse] if db is not None else []) + [Phase.generate, Phase.shrink],
                  report_multiple_bugs=False)
    batch = 0
    while time.monotonic() < deadline and (rec.cap is None or stats.executions < rec.cap):
        machine = seed(seed_value * 1_000_003 + batch)(_machine(config, rec, max_prompt, suppressions, swarm))
        try:
            run_state_machine_as_test(machine, settings=hs)
        except _BudgetSpent:
            return rec.last_failure
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM; while shrinking, the failure is not lost with it
            if rec.last_failure is not None:
                raise SearchInterrupted(rec.last_failure) from None
            raise
        except (FindingFound, FlakyFailure):
            # FlakyFailure cannot come from the engine (it is deterministic) but is kept as a
            # guard: the program recorded at the failure is still confirmed by replay in triage.
            if rec.last_failure is not None:
                return rec.last_failure
            raise
        except Flaky:
            # FlakyStrategyDefinition and kin: a case that behaved differently on a rerun. The engine
            # is deterministic, the clock is not (the budget's end turns ops into no-ops, and the
            # watchdog cuts a slow step): seen once at a budget's end on a real-engine preset, where it
            # ended the search as an internal error. The batch is lost, not the search.
            if rec.last_failure is not None:
                return rec.last_failure
        batch += 1
        if on_progress:
            on_progress(stats)
    return None


def random_search(config: TargetConfig, max_time: float, seed_value: int, stats: FuzzStats,
                  on_progress: Callable[[FuzzStats], None] | None = None, suppressions=None,
                  known: frozenset[str] = frozenset(), min_ops: int = 4, max_ops: int = 24,
                  max_executions: int | None = None) -> tuple[list[Op], list[Finding]] | None:
    """The plain random baseline: fresh random programs (:func:`kvaudit.program.random_program`, a
    fixed op mix) of ``min_ops..max_ops`` ops, no coverage feedback, no shrinking -- what a load test
    with an idle check amounts to, but with kvaudit's oracles. Returns the first program that yields
    a finding (neither suppressed nor ``known``) with its findings, or None after ``max_time`` s (or
    ``max_executions`` programs)."""
    rng = random.Random(seed_value)
    deadline = time.monotonic() + max_time
    max_prompt = context_max_prompt(config.context_len)
    last = time.monotonic()
    cap = stats.executions + max_executions if max_executions is not None else None
    while time.monotonic() < deadline and (cap is None or stats.executions < cap):
        program = random_program(rng, rng.randint(min_ops, max_ops), max_prompt=max_prompt,
                                 features=program_features(config))
        stats.executions += 1
        ran, found, out_of_time, _ = run_program(config, program, stats, suppressions, deadline)
        if not out_of_time and found and not all(f.signature in known for f in found):
            stats.hit()
            return program[:ran], found
        if on_progress and time.monotonic() - last > 0.5:
            last = time.monotonic()
            on_progress(stats)
    return None


def run_program(config: TargetConfig, program: list[Op], stats: FuzzStats, suppressions, deadline: float,
                on_step: Callable | None = None, before: Callable[[int, Op], None] | None = None,
                tracer=None) -> tuple[int, list[Finding], bool, set]:
    """Run ``program`` from a fresh audited engine (fast-mode stacks) up to its first finding or
    ``deadline`` (monotonic seconds), counting its ops and sites and the suppressed signatures met in
    ``stats``. ``on_step``: the run's step callback; ``before(i, op)``: called before op ``i``;
    ``tracer``: a context manager held around the ops. Returns (ops run, the last op's findings,
    whether the deadline cut the program, the auditor's site keys)."""
    with AuditedRun(config, full_stacks=False, suppressions=suppressions, deadline=deadline) as run, \
            (tracer or contextlib.nullcontext()):
        if on_step is not None:
            run.on_step = on_step
        ran, found = 0, []
        for i, op in enumerate(program):
            if before is not None:
                before(i, op)
            found = run.apply(op)
            ran += 1
            stats.ops += 1
            if run.out_of_time or found:
                break
        sites = run.auditor.site_keys()
        stats.sites |= sites
        stats.suppressed.update(f.signature for f in run.suppressed)
    return ran, found, run.out_of_time, sites
