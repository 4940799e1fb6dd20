"""Run a program against a target under audit, every engine call under a watchdog.

``execute`` is a pure function of (config, program): the same inputs give the same findings, which
replay, minimization and confirmation rely on. Design notes: docs/internals/audit.md.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import time
import traceback
import weakref
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from kvaudit.config import TargetConfig
from kvaudit.audit import oracles
from kvaudit.constants import DEFAULT_STEP_TIMEOUT, WATCHDOG_IDLE_POLL
from kvaudit.audit.findings import Finding
from kvaudit.audit.kinds import lookup
from kvaudit.audit.hooks import Auditor
from kvaudit.audit.oracles.outcome import LIVENESS_STEPS, MAX_IDLE_STEPS, WATCHDOG_HANG  # noqa: F401 (re-exported)
from kvaudit.program import ContinueGeneration, Idle, Op, Step
from kvaudit.program.schema import OPS
from kvaudit.targets import make_target
from kvaudit.targets.registry import TargetDefinitionError, kind_name

# NOTE: set by the CLI's SIGINT handler and checked by every op: a KeyboardInterrupt raised inside a
# garbage-collector callback is swallowed by Python ("Exception ignored in ..."), this flag is not
INTERRUPTED = threading.Event()
STALL_STEPS = 20  # idle() gives up quietly after this many steps of a stall the target calls legitimate
# a sparse run localizes an idle() still not drained after this many steps right there (AuditedRun._long_idle)
LONG_IDLE_STEPS = MAX_IDLE_STEPS // 8
_step_timeout = DEFAULT_STEP_TIMEOUT


def set_step_timeout(seconds: float) -> None:
    """Set the watchdog's limit on one engine step (seconds, > 0) for every later run in this
    process (the CLI's ``--step-timeout``). Raises ``ValueError`` for a non-positive limit."""
    global _step_timeout
    if not seconds > 0:
        raise ValueError(f"step timeout must be positive, not {seconds!r}")
    _step_timeout = float(seconds)


def step_timeout() -> float:
    """The watchdog's limit on one engine step, in seconds (see :func:`set_step_timeout`)."""
    return _step_timeout


def fuzz_step_timeout(max_time: float) -> float:
    """A fuzz's limit on one engine step when none is given, for a search budget of ``max_time`` seconds:
    min(DEFAULT_STEP_TIMEOUT, max_time / 6), at least 1 s. A hang found near the end costs one more limit in
    triage; a limit past the budget would never fire (the budget's end cuts the stuck step short, no finding)."""
    return min(DEFAULT_STEP_TIMEOUT, max(1.0, max_time / 6))


def is_watchdog_hang(finding: Finding) -> bool:
    """A ``hang`` the watchdog raised (a step that never returned), not an idle() that never drained."""
    return finding.kind == "hang" and finding.message.startswith(WATCHDOG_HANG)


class StepTimeout(BaseException):
    """Raised asynchronously in the engine's thread by the watchdog when one engine call overruns its
    limit (a BaseException: the engine's own ``except Exception`` does not swallow it)."""


class _Watchdog:
    """One daemon thread per process that interrupts an engine call running past its limit: it raises
    :class:`StepTimeout` in the armed thread, after recording its stack. A thread arms it before each
    engine call and disarms it after.

    NOTE: a StepTimeout can land at any bytecode boundary, inside :meth:`disarm` too: the engine thread
    takes no lock here, and every method it calls is safe to repeat (docs/internals/audit.md).
    """

    RESEND_S = 0.2  # a StepTimeout that a library swallowed (a gc callback's) is raised again this often

    def __init__(self):
        self._armed: dict[int, tuple[float, bool]] = {}  # thread id -> (fire at, is the budget's deadline)
        self._resend: dict[int, float] = {}  # thread id -> when to raise it again, while the call runs on
        self._fired: dict[int, tuple[list, bool]] = {}  # thread id -> (stack outermost first, budget)
        self._firing: int | None = None  # the thread id the watchdog is deciding to interrupt
        self._thread: threading.Thread | None = None
        self._start = threading.Lock()  # only around starting the thread (never held by an armed call)

    def arm(self, limit: float, deadline: float | None) -> None:
        fire_at, budget = time.monotonic() + limit, False
        if deadline is not None and deadline < fire_at:
            fire_at, budget = deadline, True
        tid = threading.get_ident()
        self._fired.pop(tid, None)
        if self._thread is None:
            with self._start:  # not armed yet: no StepTimeout can be on its way to this thread
                if self._thread is None:
                    self._thread = threading.Thread(target=self._loop, name="kvaudit-watchdog", daemon=True)
                    quiet_unraisable()
                    self._thread.start()
        self._armed[tid] = (fire_at, budget)

    def disarm(self) -> None:
        """Stop watching this thread; safe to repeat. Once it returns, no StepTimeout is pending."""
        tid = threading.get_ident()
        self._armed.pop(tid, None)
        self._resend.pop(tid, None)
        while self._firing == tid:  # the watchdog is mid-decision on this thread: let it finish
            time.sleep(0)
        if tid in self._fired:  # sent: withdraw it if it has not landed yet
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(tid), None)

    def take(self) -> tuple[list, bool] | None:
        """(stack outermost first, whether the budget's deadline rather than the limit was due) if
        the watchdog fired on this thread since it was last armed, else None."""
        return self._fired.pop(threading.get_ident(), None)

    def _loop(self) -> None:
        while True:
            now = time.monotonic()
            for tid, entry in list(self._armed.items()):
                if entry[0] <= now:
                    self._send(tid, lambda: self._armed.get(tid) is entry, now, entry)  # not returned yet
            # a StepTimeout that landed where an exception is swallowed (a gc callback prints "Exception
            # ignored" and goes on; so can a bare except) left the call running: raise it again
            for tid, at in list(self._resend.items()):
                if at <= now:
                    self._send(tid, lambda: self._resend.get(tid) == at, now)  # not disarmed: still running
            nxt = min([e[0] for e in self._armed.values()] + list(self._resend.values()), default=None)
            time.sleep(WATCHDOG_IDLE_POLL if nxt is None else min(0.02, max(0.0, nxt - time.monotonic())))

    def _send(self, tid: int, still_due: Callable[[], bool], now: float, entry: tuple | None = None) -> None:
        self._firing = tid
        try:
            if still_due():
                if entry is not None:
                    frame = sys._current_frames().get(tid)
                    self._fired[tid] = (traceback.extract_stack(frame) if frame is not None else [], entry[1])
                    self._armed.pop(tid, None)
                self._resend[tid] = now + self.RESEND_S
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(tid), ctypes.py_object(StepTimeout))
        finally:
            self._firing = None


def quiet_unraisable() -> None:
    """Leave out of the log an interrupt that landed where Python cannot raise it (a gc callback): a
    StepTimeout (raised again, ``_Watchdog.RESEND_S``) or a KeyboardInterrupt once :data:`INTERRUPTED`
    is set (the next op stops on it). Other unraisable exceptions go to the previous hook. Idempotent."""
    previous = sys.unraisablehook
    if getattr(previous, "_kvaudit", False):
        return

    def hook(unraisable):
        if unraisable.exc_type is StepTimeout:
            return
        if issubclass(unraisable.exc_type, KeyboardInterrupt) and INTERRUPTED.is_set():
            return
        previous(unraisable)
    hook._kvaudit = True
    sys.unraisablehook = hook


_WATCHDOG = _Watchdog()


def _new_watchdog_after_fork() -> None:
    global _WATCHDOG  # a forked child has no watchdog thread (and maybe a held lock): start afresh
    _WATCHDOG = _Watchdog()


os.register_at_fork(after_in_child=_new_watchdog_after_fork)


@dataclass
class Execution:
    findings: list[Finding] = field(default_factory=list)
    ops_run: int = 0
    steps: int = 0
    digest: str = ""  # the ledger's digest (Auditor.digest), "" when not audited

    @property
    def signatures(self) -> list[str]:
        return [f.signature for f in self.findings]


class AuditedRun:
    """A target plus its auditor, advanced one op at a time (the fuzzers drive this directly).

    ``audit=False`` runs the bare engine (for throughput baselines); ``run_oracles=False`` keeps the
    hooks' ledger but skips the per-step reachability scan; ``full_stacks=False`` is the fuzzers' fast
    mode. Findings ``suppressions`` covers go to ``self.suppressed``, never returned or kept.
    ``paranoid`` runs the full mark and sweep beside the incremental check at every step and raises on
    any disagreement (:mod:`kvaudit.audit.oracles.incremental`); None: ``KVAUDIT_PARANOID`` (``--paranoid``).

    ``check_every=K`` is the search's sparse schedule (docs/internals/audit.md, "The sparse schedule"): the
    full oracle scan runs every K scheduler steps and where a state could end unseen; what the hooks raise
    at event time stays immediate. A hit is localized by replay with a check after every step, and ``apply``
    returns that run's findings (one it does not reproduce is returned as found, its message saying so).
    K=1 (the default) is the per-step audit, with no replay.

    ``lean`` (a search's run; only with ``check_every > 1`` and no ``suppressions``, else ignored): the hooks
    record what detects and leave what reports to the replay: no call sites (their innermost engine lines
    are kept, :meth:`kvaudit.audit.hooks.Auditor.site_keys`) and no lock-event records (a count). A hit the
    replay does not reproduce then has no sites. ``site_keys=False`` (lean only): not those lines either
    (``site_keys()`` is empty; a search collects them in one program of every
    :data:`kvaudit.search.schedule.SITE_KEYS_EVERY`).

    Every engine call runs under the watchdog: one past ``step_limit`` seconds (default
    :func:`step_timeout`) is a ``hang``. ``deadline`` (``time.monotonic()`` seconds; a search's budget)
    also cuts a call short, with no finding: ``out_of_time`` is set. An op that raises is a ``crash``
    (``crashed``, suppressed or not). After either, every later op is a no-op.
    """

    def __init__(self, config: TargetConfig, audit: bool = True, run_oracles: bool = True,
                 full_stacks: bool = True, suppressions=None, shadow: bool = True,
                 deadline: float | None = None, step_limit: float | None = None, paranoid: bool | None = None,
                 check_every: int = 1, lean: bool = False, site_keys: bool = True):
        if check_every < 1:
            raise ValueError(f"check_every must be at least 1 (steps between full checks), not {check_every!r}")
        self.config, self.check_every = config, check_every
        self.program: list[Op] = []  # the ops applied, kept for a sparse run's replay
        self._passed_over: set[str] = set()  # sparse: the signatures already localized (_sift)
        self._replayed: list[Finding] | None = None  # sparse: what that localization found, not yet returned
        self._replay_memo: tuple[int, AuditedRun] | None = None  # sparse: (ops applied, the open replay) (_replay)
        self.unchecked = 0  # scheduler steps since the last full oracle scan
        self._idle_after: bool | None = None  # sparse: target.is_idle() read by this step's check after the step
        self._checked_mark: tuple | None = None  # (idle, ledger events, lock events, sent) at the last sparse check
        self.sent = 0  # ops other than steps and idle() handed to the target (each queues a message)
        self.deadline, self.out_of_time = deadline, False
        self.step_limit = step_timeout() if step_limit is None else step_limit
        self.suppressions, self.suppressed = suppressions, []
        # a site glob may name any frame: record whole stacks, so fast and full runs match alike
        full_stacks = full_stacks or (suppressions is not None and suppressions.needs_full_stacks)
        self.target = make_target(config)
        # (suppressions sift a run's own findings by their signatures: those need the sites)
        lean = lean and check_every > 1 and suppressions is None
        self.auditor = (Auditor(self.target, full_stacks=full_stacks, shadow=shadow, lean=lean, site_keys=site_keys)
                        if audit else None)
        if self.auditor is not None:  # None: the process default (--paranoid sets it for every run)
            self.auditor.paranoid = oracles.paranoid_default() if paranoid is None else paranoid
        self.run_oracles = audit and run_oracles
        self._sparse = self.run_oracles and check_every > 1  # (_step's test for the not-due steps)
        self.full_stacks, self.shadow = full_stacks, shadow  # (a sparse run's replay takes the same)
        if self.auditor is not None and check_every > 1:
            self.auditor.pair_locks = False  # only a report needs the lock ledger's pairing: the replay's
        if self.run_oracles:
            self.target.on_intake(_weakly(self._intake_scan))  # (the target's hook must not keep a closed run)
        self.findings: list[Finding] = []
        self.last_progress: dict[str, tuple[int, int]] = {}  # rid -> (progress value, step it last changed)
        self.told_once: set[str] = set()  # the lost requests (and ignored aborts) the liveness oracle reported
        self.flushes_checked = 0  # successful flush_cache requests already checked for quiescence
        self.ops_run = 0
        self.crashed = False  # an op raised: the run ends there (apply() is a no-op from then on)
        self.on_step = None  # called as on_step(self) after every scheduler step (kvaudit.reports.timeline)

    def _check(self, scan: bool = True, transient: bool | None = None) -> list[Finding]:
        # transient: the target's answer this step, when the caller has asked it (it is asked once a step)
        if self.auditor is None:
            return []
        aud = self.auditor
        # NOTE: runs after every step: with the lock ledger unpaired (a sparse run) the step setter only stores
        # the value (Auditor.step), so it is stored here directly, without the property's call
        if aud.pair_locks:
            aud.step = self.target.steps
        else:
            aud._step = self.target.steps
        found = aud.pending
        if found:
            aud.pending = []
            return oracles.attach_engine_verdict(self.target, found)
        if not self.run_oracles or not scan:
            return []
        if self.check_every > 1:
            # (asked once a step: a target's answer may note what it has seen, vLLM's newly idle engine)
            if transient is None:
                transient = self.target.transient()
            if self.unchecked < self.check_every and not transient:
                return []  # the sparse schedule: not due yet (before is_idle)
            idle = self._idle_after = self.target.is_idle()  # (the Idle op's loop reads it)
            if not self._due(idle, transient):
                return []  # the sparse schedule: not due yet
        else:
            idle = self.target.is_idle()
        self.unchecked = 0
        return oracles.check(aud, self.target, idle=idle)

    def _due(self, idle: bool, transient: bool) -> bool:
        # the sparse schedule, past a forced check (docs/internals/audit.md): a check at idle that would sweep
        # what the last one at idle swept (no ledger or lock event, no op's message since) is not due; a
        # paranoid run sweeps anyway.
        if not idle:
            self._checked_mark = (False, len(self.auditor.events), self.auditor.lock_count, self.sent)
            return True
        mark = (idle, len(self.auditor.events), self.auditor.lock_count, self.sent)
        if not transient and mark == self._checked_mark and not self.auditor.paranoid:
            self.unchecked = 0  # (what the last check swept is what is there)
            return False
        self._checked_mark = mark
        return True

    def _outcome(self, stage: str, *args) -> list[Finding]:
        """The findings of the runner's oracle rows of ``stage`` (:data:`kvaudit.audit.oracles.ORACLES`)."""
        found = []
        for o in oracles.rows(stage):
            if o.when(self, *args):
                found += o.run(self, *args)
        return found

    def _intake_scan(self) -> None:
        # NOTE: right after the engine took its messages, before it schedules: a close or an abort that
        # frees memory still in use is a use-after-free here, before its release makes it a double free
        if not self.auditor.pending:
            self.auditor.pending.extend(self._outcome("intake"))
        if not self.auditor.pending and self.check_every == 1:  # (sparse: the next full check sees it)
            self.auditor.pending.extend(oracles.check(self.auditor, self.target, scan_only=True))

    def _guarded(self, call, *args) -> list[Finding] | None:
        # None when call(*args) returned in time, else [] (the deadline was due: out_of_time) or [hang]
        called, raised, landed = False, None, None
        while True:
            # NOTE: a StepTimeout landing in the call or in the disarm (sent as the call returned, or
            # sent again) lands here, and the disarm is repeated
            try:
                if not called:
                    called = True
                    _WATCHDOG.arm(self.step_limit, self.deadline)  # (an overdue deadline fires at once)
                    try:
                        call(*args)
                    except StepTimeout:
                        raise
                    except BaseException as exc:  # a crash (or Ctrl-C): disarm first, then raise it,
                        raised = exc  # else the watchdog fires later into whatever runs next
                _WATCHDOG.disarm()
                fired = _WATCHDOG.take()
                break
            except StepTimeout as e:
                # NOTE: kept past the disarm: its traceback holds the interrupted call's frames (a model's
                # tensors, GBs), whose release here took long enough for a StepTimeout sent again to land
                # on the way back into the try, uncaught (a traceback, exit 1)
                landed = e
                continue
        del landed  # (the interrupted call's frames, released once nothing more can be sent)
        if raised is not None:
            raise raised  # the engine's own error, raised before any interrupt landed
        if fired is None:
            return None
        stack, budget = fired
        if budget:
            self.out_of_time = True
            return []
        here = os.path.abspath(__file__)  # the stuck thread's frames below this run
        below = next((i + 1 for i in range(len(stack) - 1, -1, -1)
                      if stack[i].name == "_guarded" and os.path.abspath(stack[i].filename) == here), 0)
        return self._outcome("timeout", stack[below:])

    def _step(self) -> list[Finding]:
        aud = self.auditor
        if aud is not None:
            self._idle_after = None
            if aud.pair_locks:
                aud.step = self.target.steps + 1
            else:  # (the setter would only store it: see _check)
                aud._step = self.target.steps + 1
        self.unchecked += 1
        before = self.target.steps
        cut = self._guarded(self.target.step)
        if cut is not None:
            return cut
        if self.target.steps != before + 1:  # (else a finding's step, lifecycle and liveness rows read wrong)
            raise TargetDefinitionError(f"target {kind_name(self.target)}: {type(self.target).__name__}.step() left "
                                        f"self.steps at {self.target.steps}: a target's step() must add 1 to self.steps")
        if self._sparse and not aud.pending:
            # NOTE: most steps of a sparse run end here: _check's not-due answer without its call (transient()
            # asked once a step, as there; the auditor's step, stored before the step, is the target's now)
            transient = self.target.transient()
            if self.unchecked < self.check_every and not transient:
                if self.on_step is not None:
                    self.on_step(self)
                return []
            found = self._check(transient=transient)
        else:
            found = self._check()
        # the "step" rows (liveness) judge a run with oracles only: a bare or ledger-only run pays no call
        # for them (sparse: at each full check)
        if not found and self.run_oracles and (self.check_every == 1 or not self.unchecked):
            found = self._outcome("step")
        if self.on_step is not None:
            self.on_step(self)
        return found

    def apply(self, op: Op) -> list[Finding]:
        """Run one op; returns the findings it produced (also kept in ``self.findings``).
        Raises ``KeyboardInterrupt`` once :data:`INTERRUPTED` is set."""
        if INTERRUPTED.is_set():
            raise KeyboardInterrupt
        if self._cut_short() or self.crashed:
            # NOTE: a real scheduler process dies on an uncaught exception: no later finding comes from
            # the state a half-done call left behind
            return []
        if self.auditor is not None:
            aud = self.auditor
            if aud.pair_locks:
                aud.op_index = self.ops_run
            else:  # (the setter would only store it: see _check)
                aud._op_index = self.ops_run
        self.ops_run += 1
        if self.check_every > 1:
            self.program.append(op)
        # suppressed findings are sifted out as they come: they do not end a step loop either (a per-step run
        # without suppressions has nothing to sift: no call of _sift per step)
        sift = self._sift if self.check_every > 1 or self.suppressions is not None else _as_found
        try:
            found: list[Finding] = []
            if isinstance(op, Step):
                for _ in range(max(1, op.n)):
                    found = self._step()
                    if found:  # (sift([]) is []: no call per step)
                        found = sift(found)
                    if found or self._out_of_time():
                        break
            elif isinstance(op, Idle):
                if self.target.paused:
                    self.target.apply(ContinueGeneration())  # a paused engine never drains
                stalled, self._idle_after = 0, None
                reuse = self.check_every > 1 and self.run_oracles  # (sparse: _check reads is_idle() after each step)
                for n in range(MAX_IDLE_STEPS):
                    if reuse and self._idle_after is not None:
                        idle = self._idle_after  # what the last step's check read after it: nothing ran since
                    else:
                        idle = self.target.is_idle()
                    found = self._step()  # when idle, this iteration runs the engine's on_idle
                    if found:
                        found = sift(found)
                    stalled = stalled + 1 if self.target.stalled() else 0
                    if found or idle or stalled > STALL_STEPS or self._out_of_time():
                        break  # out of time: no hang finding, the budget ran out, not the engine
                    if n + 1 == LONG_IDLE_STEPS and self.check_every > 1:
                        found = self._long_idle()
                        if found:
                            break
                else:
                    found = self._outcome("idle")
            else:
                found = self._before_ending(op) if self.check_every > 1 else []
                if not found:  # only queues a message: no memory moves until a step
                    self.sent += 1
                    found = self._guarded(self.target.apply, op)
                    if found is None:  # (sparse: only what a hook raised; the step stored is the target's)
                        found = self._check(scan=False) if not self._sparse or self.auditor.pending else []
        except Exception as exc:  # the engine crashed: that is a finding, not our error
            found = self._outcome("raise", exc)
            if not found:
                if self.check_every > 1:
                    self._replay()  # the target's own error: raised as a per-step run raises it, where it does
                raise
            self.crashed = True
        return self._answer(found, sift)

    def _before_ending(self, op: Op) -> list[Finding]:
        # the sparse schedule (apply() calls it only when check_every > 1), before an op that can end a state
        # the oracles see (OpSpec.ends: an abort, a flush, a pause ... releases at the next intake): a full
        # check of what the steps left, which a per-step run has checked (else a leak a flush wipes, or a
        # use-after-free whose request an abort releases, is never met)
        if not self.unchecked:
            return []
        spec = OPS.get(getattr(op, "kind", ""))
        if spec is None or not spec.ends:
            return []
        self.unchecked = self.check_every  # due now
        return self._sift(self._check())

    def _answer(self, found: list[Finding], sift: Callable[[list[Finding]], list[Finding]]) -> list[Finding]:
        # what an op or the end check reports (and keeps): sifted (by apply's sift) and merged, or the localizing
        # replay's findings
        if not found and self._replayed is None:
            return found  # (most ops: nothing to sift, merge or keep)
        if self._replayed is None:
            found = _merge_same_signature(sift(found))
        if self._replayed is not None:
            found, self._replayed = self._replayed, None
        self.findings.extend(found)
        return found

    def _sift(self, found: list[Finding]) -> list[Finding]:
        """The findings no suppression covers (the covered ones go to ``suppressed``). A sparse run
        localizes a hit here, covered or not, the first time this run meets its signature: the per-step
        replay's findings are the answer (docs/internals/audit.md, "The sparse schedule"). A hit the replay
        meets nothing of is kept, saying so; one whose replay the ``deadline`` cut short is no finding
        (``out_of_time``)."""
        sets = self.suppressions
        if self.check_every == 1 or not found:
            return found if sets is None else sets.sift(found, self.suppressed)
        new = {f.signature for f in found} - self._passed_over
        if not new:  # localized before, where the per-step run reported nothing of it
            return []
        self._passed_over |= new
        replay = self._replay()
        if replay.out_of_time:  # the search's budget ended inside the replay: no finding, as for a step cut short
            self.out_of_time = True
            return []
        if replay.findings or replay.suppressed:
            self.suppressed[:] = replay.suppressed
            kept = list(replay.findings)
        else:
            kept = found if sets is None else sets.sift(found, self.suppressed)
            for f in kept:
                f.message += (f" [found by the sparse schedule (a full check every {self.check_every} steps); a "
                              "replay with a check after every step did not reproduce it]")
        self._replayed = kept or None
        return kept

    def finish(self) -> list[Finding]:
        """The sparse schedule's check at the program's end: a full oracle scan, liveness included, when a step ran
        since the last one (localized like :meth:`apply`'s). [] for a per-step run, or one already cut short."""
        if self.check_every == 1 or not self.unchecked or self._cut_short() or self.crashed or not self.run_oracles:
            return []
        self.unchecked = self.check_every  # due now
        try:
            found = self._check()
            if not found:  # liveness too: a lost request, an ignored abort are judged at idle, as the program ends
                found = self._outcome("step")
        except Exception:  # (the target's own error: raised where a per-step run raises it)
            self._replay()
            raise
        return self._answer(found, self._sift)

    def _long_idle(self) -> list[Finding]:
        # NOTE: an idle() that has not drained after LONG_IDLE_STEPS steps is most often a hang, met by
        # the sparse run only at MAX_IDLE_STEPS and then localized by a replay that runs the whole loop
        # again. The replay is the per-step run of the ops so far, this idle() included to its end: run
        # it now. Its uncovered findings are what the sparse run's localization would return at this op
        # (or where the sparse run meets them later, the same per-step findings): returned now, the loop
        # ends. Else the loop goes on and a later localization in this op reuses this replay (_replay).
        replay = self._replay()
        if not replay.findings:
            return []
        self._passed_over |= {f.signature for f in replay.findings}
        self.suppressed[:] = replay.suppressed
        self._replayed = list(replay.findings)
        return self._replayed

    def _replay(self) -> "AuditedRun":
        """The ops applied so far, from a fresh engine with a check after every step, up to its first
        finding (what it raises, it raises) or this run's ``deadline`` (``out_of_time``). Runs are
        deterministic, so the replay is kept open (closed with this run) and a later localization in this
        program only applies the ops since; one that stopped at a finding stays the answer."""
        if self._replay_memo is None:
            self._replay_memo = (0, AuditedRun(
                self.config, audit=self.auditor is not None, run_oracles=self.run_oracles,
                full_stacks=self.full_stacks, suppressions=self.suppressions, shadow=self.shadow,
                deadline=self.deadline, step_limit=self.step_limit,
                paranoid=self.auditor.paranoid if self.auditor else None))
        done, replay = self._replay_memo
        try:
            while done < len(self.program) and not replay.findings and not replay.out_of_time:
                done += 1
                replay.apply(self.program[done - 1])
        except BaseException:  # (half-applied: never reused)
            self._replay_memo = None
            replay.close()
            raise
        self._replay_memo = (done, replay)
        return replay

    def _cut_short(self) -> bool:
        return self.out_of_time or any(is_watchdog_hang(f) for f in self.findings)

    def _out_of_time(self) -> bool:
        if self.deadline is not None and time.monotonic() > self.deadline:
            self.out_of_time = True
        return self.out_of_time

    def drain_verdict(self) -> list[str]:
        """The engine's own ``check_memory()`` once drained to idle after the program: bare steps (no
        oracle) until idle, plus the idle iteration that runs its ``on_idle``, at most MAX_IDLE_STEPS,
        each under the watchdog. A drain that crashes, hangs or never reaches idle says so first."""
        if self._cut_short():
            return ["not drained: an engine step hung (the watchdog interrupted it)"]
        try:
            if self.target.paused:
                if self._guarded(self.target.apply, ContinueGeneration()) is not None:
                    return [f"not drained: continue_generation hung past {self.step_limit:g}s"]
            for n in range(MAX_IDLE_STEPS):
                idle = self.target.is_idle()
                if self._guarded(self.target.step) is not None:
                    return [f"not drained: a step hung past {self.step_limit:g}s while draining"]
                if idle:
                    break
            else:
                return [f"not idle after {MAX_IDLE_STEPS} steps of draining"] + self.target.engine_check()
            return self.target.engine_check() or ["engine check_memory(): ok"]
        except Exception as exc:
            return [f"crashed while draining: {type(exc).__name__}: {exc}"]

    def close(self) -> None:
        """Remove the hooks (so a finished run is freed at once, not by the cycle collector) and close
        the target (L3 storage's directory)."""
        if self._replay_memo is not None:
            self._replay_memo, (_, replay) = None, self._replay_memo
            replay.close()
        if self.auditor is not None:
            self.auditor.uninstall()
        self.target.close()

    def __enter__(self) -> "AuditedRun":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _weakly(method: Callable[[], None]) -> Callable[[], None]:
    """A call of ``method`` (a bound method) that holds its object weakly and does nothing once it is gone: a
    hook installed on the engine then keeps no run alive, so a closed run and its ledger are freed by reference
    counts, not by the cycle collector (measured: docs/internals/performance.md, stop 56)."""
    # NOTE: called at every intake that took a message: the object's weak reference is dereferenced in C
    # (a WeakMethod's call is a Python frame of its own), the method's function is a class attribute anyway
    ref, func = weakref.ref(method.__self__), method.__func__

    def call() -> None:
        obj = ref()
        if obj is not None:
            func(obj)
    return call


def _as_found(found: list[Finding]) -> list[Finding]:
    return found  # (AuditedRun.apply's sift where nothing is sifted)


def _merge_same_signature(found: list[Finding]) -> list[Finding]:
    """One finding per signature among those one op produced, holding every unit of them (the first,
    given the later ones' use sites, owners and units; other allocation lines named in its message)."""
    if len(found) < 2:
        return found
    out: dict[str, Finding] = {}
    for f in found:
        first = out.setdefault(f.signature, f)
        if first is not f:
            first.read_sites = first.read_sites or f.read_sites
            first.used_by = sorted(set(first.used_by) | set(f.used_by))
            _merge_units(first, f)
    return list(out.values())


def _merge_units(into: Finding, other: Finding) -> None:
    if not other.slots:
        return
    per = next((len(f.slots) // f.num_units for f in (into, other) if f.unit != "row" and f.num_units and f.slots), 1)
    slots = np.union1d(np.asarray(into.slots, dtype=np.int64), np.asarray(other.slots, dtype=np.int64))
    into.slots = slots.tolist()
    into.num_units = int(np.unique(slots // max(1, per)).size)
    site = other.alloc_sites[0] if other.alloc_sites else None
    if site is not None and into.alloc_sites and site != into.alloc_sites[0] and lookup(into.kind).allocates:
        also = f"also allocated at {site.short()}"
        if also not in into.message:
            into.message += f"; {also}"


def warm_up(config: TargetConfig) -> None:
    """Build ``config``'s audited target once and drop it, so that the first build's cost is paid
    before a search's clock starts. Raises what building the target raises."""
    AuditedRun(config, full_stacks=False).close()


def execute(config: TargetConfig, program: list[Op], full_stacks: bool = True, suppressions=None, drain: bool = False,
            on_op: Callable[[int, int], None] | None = None, step_limit: float | None = None) -> Execution:
    """Run ``program`` from a fresh engine; stop at the first op that produced a finding
    ``suppressions`` does not cover. With ``drain``, a run with findings then records the engine's
    verdict at idle in each finding's ``engine_check_at_idle``. ``on_op(ops run, scheduler steps)``
    is called after each op. ``step_limit``: the watchdog's seconds (default :func:`step_timeout`)."""
    with AuditedRun(config, full_stacks=full_stacks, suppressions=suppressions, step_limit=step_limit) as run:
        for op in program:
            found = run.apply(op)
            if on_op is not None:
                on_op(run.ops_run, run.target.steps)
            if found:
                break
        ex = Execution(run.findings, run.ops_run, run.target.steps,
                       run.auditor.digest() if run.auditor is not None else "")
        if drain and run.findings:  # after the digest and step count: those are the program's alone
            verdict = run.drain_verdict()
            for f in run.findings:
                f.engine_check_at_idle = list(verdict)
        return ex
