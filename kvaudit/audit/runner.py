"""Run a program against a target under audit.

``execute`` is a pure function of (config, program): the same inputs give the same findings,
which is what replay, minimization and confirmation rely on.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from kvaudit.config import TargetConfig
from kvaudit.audit import memstate
from kvaudit.audit import oracles
from kvaudit.constants import DEFAULT_STEP_TIMEOUT
from kvaudit.audit.findings import Finding, Site, portable_path
from kvaudit.audit.kinds import lookup
from kvaudit.audit.hooks import Auditor
from kvaudit.program import ContinueGeneration, Idle, Op, Step
from kvaudit.targets import make_target
from kvaudit.targets.registry import TargetDefinitionError

MAX_IDLE_STEPS = 2000
# Set by the CLI's SIGINT handler. A KeyboardInterrupt raised inside a garbage-collector callback
# is swallowed by Python ("Exception ignored in ..."); every op checks this flag, so a Ctrl-C is
# never lost.
INTERRUPTED = threading.Event()
LIVENESS_STEPS = 300  # no request needs this many steps without progress in any preset
STALL_STEPS = 20  # idle() gives up quietly after this many steps of a stall the target calls legitimate
_KVAUDIT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # kvaudit/
WATCHDOG_HANG = "engine step did not return within"  # the message of a watchdog hang starts so
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


def is_watchdog_hang(finding: Finding) -> bool:
    """A ``hang`` the watchdog raised (a step that never returned), not an idle() that never drained."""
    return finding.kind == "hang" and finding.message.startswith(WATCHDOG_HANG)


class StepTimeout(BaseException):
    """Raised asynchronously in the engine's thread by the watchdog when one engine call overruns its
    limit. A BaseException, so that the engine's own ``except Exception`` handlers do not swallow it."""


class _Watchdog:
    """One daemon thread per process that interrupts an engine call running past its limit.

    A thread arms it before each engine call (:meth:`arm`) and disarms it after (:meth:`disarm`).
    When a call is due, the watchdog records the stuck thread's stack (``sys._current_frames()``)
    and raises :class:`StepTimeout` in it (``PyThreadState_SetAsyncExc``), which lands at the
    thread's next Python bytecode: a loop of ``time.sleep`` or of Python code is interrupted; one
    blocking C call that never returns is not. The watchdog polls (every 20 ms while a call is
    armed, 200 ms otherwise), so a limit is kept to within 20 ms.

    NOTE: a StepTimeout can land in the engine's thread at any bytecode boundary, including inside
    :meth:`disarm` after the call returned. So the engine thread takes no lock here (a lock taken
    when the exception lands would stay held: a deadlock), every method it calls is made of atomic
    dict operations and is safe to repeat, and callers repeat
    ``disarm``/``take`` until they complete (see ``AuditedRun._guarded``). ``disarm`` waits out a
    send the watchdog has decided on (``_firing``) and withdraws it if not yet raised, so no
    StepTimeout arrives once ``disarm`` has returned.
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
        """Stop watching this thread; safe to repeat. Once it returns, no StepTimeout is pending
        for this thread and none will be sent."""
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
            time.sleep(0.2 if nxt is None else min(0.02, max(0.0, nxt - time.monotonic())))

    def _send(self, tid: int, still_due: Callable[[], bool], now: float, entry: tuple | None = None) -> None:
        """Raise StepTimeout in thread ``tid`` if ``still_due()``, under ``_firing`` (see :meth:`disarm`);
        a first send (``entry``: its arming) records the thread's stack first."""
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
    """Leave out of the log an interrupt that landed where Python cannot raise it (a gc callback,
    such as Hypothesis's: "Exception ignored in ... Traceback ..."): a StepTimeout (the watchdog
    raises it again, ``_Watchdog.RESEND_S``) or a KeyboardInterrupt from kvaudit's Ctrl-C/SIGTERM
    handlers once :data:`INTERRUPTED` is set (the next op stops on it). Any other unraisable
    exception goes to the hook that was there before. Idempotent."""
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

    ``audit=False`` runs the bare engine (for throughput baselines); ``oracles=False`` keeps the
    hooks' ledger (double free, aliasing at alloc) but skips the per-step reachability scan;
    ``full_stacks=False`` is the fuzzers' fast mode (see :class:`kvaudit.audit.hooks.Auditor`).
    ``suppressions`` (a :class:`kvaudit.audit.suppress.SuppressionSet`) moves the findings it covers to
    ``self.suppressed``: they are never returned or kept in ``self.findings``.

    Every engine call (``target.step()``, ``target.apply(op)``) runs under the watchdog: one that
    takes more than ``step_limit`` seconds (default :func:`step_timeout`) is a ``hang`` finding
    naming the frames it was stuck in. ``deadline`` (``time.monotonic()`` seconds; a search's
    budget) also cuts a call or an ``idle()`` short, but that is no finding: ``out_of_time`` is
    set, and every later op is a no-op (the engine was interrupted mid-step). An op that raises is a
    ``crash`` finding and ends the run the same way (``crashed``), whether or not a suppression
    covers it: the real scheduler process would be gone.
    """

    def __init__(self, config: TargetConfig, audit: bool = True, run_oracles: bool = True,
                 full_stacks: bool = True, suppressions=None, shadow: bool = True,
                 deadline: float | None = None, step_limit: float | None = None):
        self.deadline, self.out_of_time = deadline, False
        self.step_limit = step_timeout() if step_limit is None else step_limit
        self.suppressions, self.suppressed = suppressions, []
        # a site glob may name any frame: record whole stacks, so fast and full runs match alike
        full_stacks = full_stacks or (suppressions is not None and suppressions.needs_full_stacks)
        self.target = make_target(config)
        self.auditor = Auditor(self.target, full_stacks=full_stacks, shadow=shadow) if audit else None
        self.run_oracles = audit and run_oracles
        if self.run_oracles:
            self.target.on_intake(self._intake_scan)
        self.findings: list[Finding] = []
        self._progress: dict[str, tuple[int, int]] = {}  # rid -> (progress value, step it last changed)
        self._flushes = 0  # successful flush_cache requests already checked for quiescence
        self.ops_run = 0
        self.crashed = False  # an op raised: the run ends there (apply() is a no-op from then on)
        self.on_step = None  # called as on_step(self) after every scheduler step (kvaudit.reports.timeline)

    def _check(self, scan: bool = True) -> list[Finding]:
        """Findings the hooks raised, then (``scan``) the oracles' scan of the engine state."""
        if self.auditor is None:
            return []
        self.auditor.step = self.target.steps
        found, self.auditor.pending = self.auditor.pending, []
        if not found and self.run_oracles and scan:
            return oracles.check(self.auditor, self.target, idle=self.target.is_idle())
        return oracles.attach_engine_verdict(self.target, found)

    def _intake_scan(self) -> None:
        """Reachability right after the engine took its messages, before it schedules: a close or an
        abort that frees memory still in use shows as use-after-free here, before the release that
        follows in the same step turns it into a double free."""
        if not self.auditor.pending:
            self.auditor.pending.extend(self._quiescence())
        if not self.auditor.pending:
            self.auditor.pending.extend(oracles.check(self.auditor, self.target, scan_only=True))

    def _guarded(self, call, *args) -> list[Finding] | None:
        """``call(*args)`` under the watchdog: None when it returned in time, else ``[]`` (the
        deadline was due: ``out_of_time`` is set) or ``[hang finding]``."""
        called, raised = False, None
        while True:
            # one try around the call and the disarm: the engine thread interrupted (what the
            # watchdog saw is in take()), or a StepTimeout sent as the call returned (or sent again,
            # see _Watchdog.RESEND_S) landing in the disarm, lands here and the disarm is repeated
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
            except StepTimeout:
                continue
        if raised is not None:
            raise raised  # the engine's own error, raised before any interrupt landed
        if fired is None:
            return None
        stack, budget = fired
        if budget:
            self.out_of_time = True
            return []
        return [self._stuck_finding(stack)]

    def _stuck_finding(self, stack) -> Finding:
        """The watchdog's ``hang``: the stuck thread's frames below this run (innermost first),
        without kvaudit's own except a target's ``engine_files``."""
        inner = stack
        for i, fr in enumerate(stack):
            if fr.name == "_guarded" and os.path.abspath(fr.filename) == os.path.abspath(__file__):
                inner = stack[i + 1:]
        frames = _engine_frames(inner, self.target.engine_files())
        where = f"; stuck in {frames[0].short()}" if frames else ""
        f = Finding(kind="hang", pool="-", op_index=self.ops_run - 1, step=self.target.steps, alloc_sites=frames[:8],
                    message=f"{WATCHDOG_HANG} {self.step_limit:g}s (watchdog){where}")
        try:  # the step was cut short: the engine's counters may be half-updated, or its check may fail
            return oracles.attach_engine_verdict(self.target, [f])[0]
        except Exception as exc:
            f.engine_check = [f"engine check_memory() raised {type(exc).__name__}: {exc}"]
            return f

    def _step(self) -> list[Finding]:
        if self.auditor is not None:
            self.auditor.step = self.target.steps + 1
        cut = self._guarded(self.target.step)
        if cut is not None:
            return cut
        found = self._check()
        if not found and self.run_oracles:
            found = self._liveness()
        if self.on_step is not None:
            self.on_step(self)
        return found

    def _quiescence(self) -> list[Finding]:
        """Right after a successful ``flush_cache`` (at intake, before anything is scheduled): every
        pool is full again (``leak`` otherwise)."""
        done = self.target.flushed()
        if done == self._flushes:
            return []
        self._flushes = done
        bad = self.target.quiescence()
        found = [Finding(kind="leak", pool=pool, op_index=self.ops_run - 1, step=self.target.steps,
                         message=f"not quiescent: {problem}") for pool, problem in bad]
        return oracles.attach_engine_verdict(self.target, found[:1])

    def _liveness(self) -> list[Finding]:
        """``liveness``: a request that holds KV, or was aborted, and makes no progress for
        LIVENESS_STEPS steps (a parked request nobody schedules, an abort that never ends it)."""
        now, seen = self.target.steps, {}
        for rid, value in self.target.progress().items():
            last = self._progress.get(rid)
            seen[rid] = last if last is not None and last[0] == value else (value, now)
        self._progress = seen
        stuck = sorted(rid for rid, (_, since) in seen.items() if now - since >= LIVENESS_STEPS)
        if not stuck:
            return []
        self._progress = {}
        aborted = seen[stuck[0]][0] < 0
        what = "aborted, never finished" if aborted else "holds KV"
        # its signature names where the request sits (Root.where: transfer, chunked, running, ...) and
        # what it is, never its id: one cause reads the same in every program
        where = next((r.where for r in self.target.roots() if r.owner == f"req:{stuck[0]}" and r.where), "")
        f = Finding(kind="liveness", pool="-", op_index=self.ops_run - 1, step=now,
                    check=f"{where or '-'}:{'aborted' if aborted else 'holds-kv'}",
                    message=f"req:{stuck[0]} ({what}{f', in {where}' if where else ''}) made no progress for "
                            f"{LIVENESS_STEPS} steps" + (f"; also {', '.join(stuck[1:4])}" if len(stuck) > 1 else ""))
        return oracles.attach_engine_verdict(self.target, [f])

    def apply(self, op: Op) -> list[Finding]:
        """Run one op; returns the findings it produced (also kept in ``self.findings``).
        Raises ``KeyboardInterrupt`` once :data:`INTERRUPTED` is set."""
        if INTERRUPTED.is_set():
            raise KeyboardInterrupt
        if self._cut_short() or self.crashed:
            # interrupted mid-call, or crashed (a real scheduler process dies on an uncaught
            # exception; a crash a suppression covers too): nothing more runs on it, so no later
            # finding comes from the state a half-done call left behind
            return []
        if self.auditor is not None:
            self.auditor.op_index = self.ops_run
        self.ops_run += 1
        # suppressed findings are sifted out as they come, so that they do not end a step loop either
        sets = self.suppressions
        sift = (lambda fs: fs) if sets is None else (lambda fs: sets.sift(fs, self.suppressed))
        try:
            found: list[Finding] = []
            if isinstance(op, Step):
                for _ in range(max(1, op.n)):
                    found = sift(self._step())
                    if found or self._out_of_time():
                        break
            elif isinstance(op, Idle):
                if self.target.paused:
                    self.target.apply(ContinueGeneration())  # a paused engine never drains
                stalled = 0
                for _ in range(MAX_IDLE_STEPS):
                    idle = self.target.is_idle()
                    found = sift(self._step())  # when idle, this iteration runs the engine's on_idle
                    stalled = stalled + 1 if self.target.stalled() else 0
                    if found or idle or stalled > STALL_STEPS or self._out_of_time():
                        break  # out of time: no hang finding, the budget ran out, not the engine
                else:
                    found = self._hang_findings()
            else:
                # only queues a message: no memory moves until a step
                found = self._guarded(self.target.apply, op)
                if found is None:
                    found = self._check(scan=False)
        except TargetDefinitionError:  # the target's own code broke the API: not the engine's crash
            raise
        except Exception as exc:  # the engine crashed: that is a finding, not our error
            self.crashed = True
            found = [_crash_finding(exc, self.ops_run - 1, self.target.steps,
                                    self.target.engine_files(), self.target, self.auditor)]
        found = _merge_same_signature(sift(found))
        self.findings.extend(found)
        return found

    def _cut_short(self) -> bool:
        """The watchdog interrupted an engine call of this run (the deadline, or a hang)."""
        return self.out_of_time or any(is_watchdog_hang(f) for f in self.findings)

    def _out_of_time(self) -> bool:
        """The run's ``deadline`` has passed (sets ``out_of_time``)."""
        if self.deadline is not None and time.monotonic() > self.deadline:
            self.out_of_time = True
        return self.out_of_time

    def drain_verdict(self) -> list[str]:
        """The engine's own ``check_memory()`` once the engine is drained to idle after the program
        (what the engine's own idle check would say then): the engine runs bare steps (hooks recording, no
        oracle) until idle, plus the one idle iteration that runs its ``on_idle``, at most
        MAX_IDLE_STEPS steps, each under the watchdog. Lines as in ``Finding.engine_check``; a
        drain that crashes, hangs or never reaches idle says so in the first line."""
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

    def _hang_findings(self) -> list[Finding]:
        """idle() never drained: a ``hang`` whose signature names what the target says is stuck
        (``Target.stuck()``, in ``check``) and whose message gives its ``describe_busy()``; before it,
        the locks no live holder accounts for (the lock-balance oracle as at idle, between steps), which
        name the lock that holds the memory a ``waiting:memory-locked`` hang waits for: one hang
        symptom, several causes."""
        busy = self.target.describe_busy()  # "" (the base's default): the target does not say
        stuck = self.target.stuck()
        f = Finding(kind="hang", pool="-", op_index=self.ops_run - 1, step=self.target.steps, check=stuck,
                    message=f"engine not idle after {MAX_IDLE_STEPS} steps of idle()"
                    + (f": {busy}" if busy else " (the target's describe_busy() names nothing)")
                    + (f"; stuck: {stuck}" if stuck else ""))
        locks = oracles.lock_balance(self.auditor, self.target, idle=True) if self.run_oracles else []
        return oracles.attach_engine_verdict(self.target, locks + [f])

    def close(self) -> None:
        """Remove the hooks. This also breaks the engine <-> auditor reference cycle, so a finished
        run is freed at once instead of waiting for the cycle collector. A target that holds outside
        resources (L3 storage's directory) releases them (its ``close()``)."""
        if self.auditor is not None:
            self.auditor.uninstall()
        self.target.close()

    def __enter__(self) -> "AuditedRun":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _merge_same_signature(found: list[Finding]) -> list[Finding]:
    """One finding per signature among those one op produced, holding every unit of them: a
    premature free seen by the scan after intake and again by the owner's own release in the same
    step is one use-after-free (the first, given the later one's use site and owners where it has
    none); units allocated on two lines of one function (grouped per line, one signature) are one
    leak of all of them, its allocation stack the first line's, the other lines named in its message."""
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
    """``into`` takes ``other``'s units (the union: the same unit seen twice counts once; a page or
    block finding lists whole pages' slots, so its units are counted from the slots) and, for units
    allocated elsewhere, names ``other``'s allocation line in its message."""
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


def _kept_frames(stack, engine_files=()) -> list:
    """The frames of ``stack`` (``traceback`` FrameSummary list) that are not kvaudit's own, except a
    target's ``engine_files`` (a driver that plays the scheduler), in ``stack``'s order."""
    keep = {os.path.abspath(f) for f in engine_files}
    return [fr for fr in stack
            if not os.path.abspath(fr.filename).startswith(_KVAUDIT_DIR + os.sep) or os.path.abspath(fr.filename) in keep]


def _engine_frames(stack, engine_files=()) -> list[Site]:
    """``stack`` (``traceback`` FrameSummary list, outermost first) as Sites, innermost first, without
    kvaudit's own frames except a target's ``engine_files`` (:func:`_kept_frames`)."""
    return [Site(portable_path(fr.filename), fr.lineno or 0, fr.name, (fr.line or "").strip())
            for fr in reversed(_kept_frames(stack, engine_files))]


def _display_path(path: str) -> str:
    """:func:`portable_path`, and an installed module's path from its import root (``sglang/srt/...``
    for ``.../site-packages/sglang/srt/...`` or a release overlay's): for text, not for reading."""
    path = portable_path(path)
    if not os.path.isabs(path):
        return path
    roots = [os.path.abspath(r) for r in sys.path if r and os.path.isabs(r)]
    root = max((r for r in roots if path.startswith(r + os.sep)), key=len, default=None)
    return os.path.relpath(path, root) if root else path


def _engine_traceback(exc: BaseException, engine_files=()) -> str:
    """``exc``'s traceback as Python prints it, chained exceptions included, but with the frames
    :func:`_engine_frames` keeps (no kvaudit runner or hook frames, whose line numbers move with
    kvaudit's code) and portable paths (``sglang/srt/...``, not this machine's site-packages), so
    that a replay file's text does not change when only kvaudit or the machine does."""
    te = traceback.TracebackException(type(exc), exc, exc.__traceback__)
    seen, todo = set(), [te]
    while todo:
        t = todo.pop()
        if id(t) in seen:
            continue
        seen.add(id(t))
        frames = _kept_frames(t.stack, engine_files)
        for fr in frames:
            fr.filename = _display_path(fr.filename)
        t.stack = traceback.StackSummary.from_list(frames)
        todo += [c for c in (t.__cause__, t.__context__) if c is not None]
    return "".join(te.format())


def _crash_finding(exc: BaseException, op_index: int, step: int, engine_files=(), target=None,
                   auditor=None) -> Finding:
    """The crash as a finding: its stack without kvaudit's frames, except a target's ``engine_files``
    (a driver that plays the engine's scheduler). An out-of-memory crash also carries who held the
    memory at that moment (``memory_state``, read from ``target`` and ``auditor``: :mod:`kvaudit.audit.memstate`)."""
    frames = _engine_frames(traceback.extract_tb(exc.__traceback__), engine_files)
    f = Finding(kind="crash", pool="-", message=f"{type(exc).__name__}: {exc}", alloc_sites=frames[:8],
                op_index=op_index, step=step, traceback=_engine_traceback(exc, engine_files))
    if target is not None and memstate.is_out_of_memory(str(exc)):
        f.memory_state = memstate.memory_state(target, auditor)
    return f


def warm_up(config: TargetConfig) -> None:
    """Build ``config``'s audited target once and drop it, so that what the first build costs (the
    target's own modules, the engine's one-time set-up) is paid before a search's clock starts
    (``--max-time`` is search time: :mod:`kvaudit.app.budget`). Raises what building the target raises."""
    AuditedRun(config, full_stacks=False).close()


def execute(config: TargetConfig, program: list[Op], audit: bool = True, stop_on_finding: bool = True,
            full_stacks: bool = True, suppressions=None, drain: bool = False,
            on_op: Callable[[int, int], None] | None = None) -> Execution:
    """Run ``program`` from a fresh engine; stop at the first op that produced a finding (one that
    ``suppressions``, a :class:`kvaudit.audit.suppress.SuppressionSet`, does not cover). With ``drain``,
    a run with findings then drains the engine to idle and records the engine's own verdict there
    in each finding's ``engine_check_at_idle`` (:meth:`AuditedRun.drain_verdict`). ``on_op(ops run,
    scheduler steps)`` is called after each op (a long replay's progress)."""
    with AuditedRun(config, audit=audit, full_stacks=full_stacks, suppressions=suppressions) as run:
        for op in program:
            found = run.apply(op)
            if on_op is not None:
                on_op(run.ops_run, run.target.steps)
            if found and stop_on_finding:
                break
        ex = Execution(run.findings, run.ops_run, run.target.steps,
                       run.auditor.digest() if run.auditor is not None else "")
        if drain and run.findings:  # after the digest and step count: those are the program's alone
            verdict = run.drain_verdict()
            for f in run.findings:
                f.engine_check_at_idle = list(verdict)
        return ex
