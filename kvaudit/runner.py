"""Run a program against a target under audit.

``execute`` is a pure function of (config, program): the same inputs give the same findings,
which is what replay, minimization and confirmation rely on.
"""

from __future__ import annotations

import os
import threading
import traceback
from dataclasses import dataclass, field

from engine_under_test import EngineConfig
from kvaudit import memstate, oracles
from kvaudit.findings import Finding, Site, portable_path
from kvaudit.hooks import Auditor
from kvaudit.program import ContinueGeneration, Idle, Op, Step
from kvaudit.targets import make_target

MAX_IDLE_STEPS = 2000
# Set by the CLI's SIGINT handler. A KeyboardInterrupt raised inside a garbage-collector callback
# is swallowed by Python ("Exception ignored in ..."); every op checks this flag, so a Ctrl-C is
# never lost.
INTERRUPTED = threading.Event()
LIVENESS_STEPS = 300  # no request needs this many steps without progress in any preset
STALL_STEPS = 20  # idle() gives up quietly after this many steps of a stall the target calls legitimate
_KVAUDIT_DIR = os.path.dirname(os.path.abspath(__file__))


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
    ``full_stacks=False`` is the fuzzers' fast mode (see :class:`kvaudit.hooks.Auditor`).
    ``suppressions`` (a :class:`kvaudit.suppress.SuppressionSet`) moves the findings it covers to
    ``self.suppressed``: they are never returned or kept in ``self.findings``.
    """

    def __init__(self, config: EngineConfig, audit: bool = True, run_oracles: bool = True,
                 full_stacks: bool = True, suppressions=None, shadow: bool = True):
        self.suppressions, self.suppressed = suppressions, []
        # a site glob may name any frame: record whole stacks, so fast and full runs match alike
        full_stacks = full_stacks or (suppressions is not None and suppressions.needs_full_stacks)
        self.target = make_target(config)
        self.auditor = Auditor(self.target, full_stacks=full_stacks, shadow=shadow) if audit else None
        self.run_oracles = audit and run_oracles
        if self.run_oracles and hasattr(self.target, "on_intake"):
            self.target.on_intake(self._intake_scan)
        self.findings: list[Finding] = []
        self._progress: dict[str, tuple[int, int]] = {}  # rid -> (progress value, step it last changed)
        self._flushes = 0  # successful flush_cache requests already checked for quiescence
        self.ops_run = 0
        self.on_step = None  # called as on_step(self) after every scheduler step (kvaudit.timeline)

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
        if not self.auditor.pending and hasattr(self.target, "quiescence"):
            self.auditor.pending.extend(self._quiescence())
        if not self.auditor.pending:
            self.auditor.pending.extend(oracles.check(self.auditor, self.target, scan_only=True))

    def _step(self) -> list[Finding]:
        if self.auditor is not None:
            self.auditor.step = self.target.steps + 1
        self.target.step()
        found = self._check()
        if not found and self.run_oracles and hasattr(self.target, "progress"):
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
        what = "aborted, never finished" if seen[stuck[0]][0] < 0 else "holds KV"
        f = Finding(kind="liveness", pool="-", op_index=self.ops_run - 1, step=now,
                    message=f"req:{stuck[0]} ({what}) made no progress for {LIVENESS_STEPS} steps"
                            + (f"; also {', '.join(stuck[1:4])}" if len(stuck) > 1 else ""))
        return oracles.attach_engine_verdict(self.target, [f])

    def apply(self, op: Op) -> list[Finding]:
        """Run one op; returns the findings it produced (also kept in ``self.findings``).
        Raises ``KeyboardInterrupt`` once :data:`INTERRUPTED` is set."""
        if INTERRUPTED.is_set():
            raise KeyboardInterrupt
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
                    if found:
                        break
            elif isinstance(op, Idle):
                if getattr(self.target, "paused", False):
                    self.target.apply(ContinueGeneration())  # a paused engine never drains
                stalled = 0
                for _ in range(MAX_IDLE_STEPS):
                    idle = self.target.is_idle()
                    found = sift(self._step())  # when idle, this iteration runs the engine's on_idle
                    stalled = stalled + 1 if getattr(self.target, "stalled", lambda: False)() else 0
                    if found or idle or stalled > STALL_STEPS:
                        break
                else:
                    found = [self._hang_finding()]
            else:
                self.target.apply(op)  # only queues a message: no memory moves until a step
                found = self._check(scan=False)
        except Exception as exc:  # the engine crashed: that is a finding, not our error
            found = [_crash_finding(exc, self.ops_run - 1, self.target.steps,
                                    getattr(self.target, "engine_files", list)(), self.target, self.auditor)]
        found = _merge_same_signature(sift(found))
        self.findings.extend(found)
        return found

    def _hang_finding(self) -> Finding:
        busy = getattr(self.target, "describe_busy", lambda: "")()
        f = Finding(kind="hang", pool="-", op_index=self.ops_run - 1, step=self.target.steps,
                    message=f"engine not idle after {MAX_IDLE_STEPS} steps of idle(): {busy}")
        return oracles.attach_engine_verdict(self.target, [f])[0]

    def close(self) -> None:
        """Remove the hooks. This also breaks the engine <-> auditor reference cycle, so a finished
        run is freed at once instead of waiting for the cycle collector. A target that holds outside
        resources (L3 storage's directory) releases them (its ``close()``)."""
        if self.auditor is not None:
            self.auditor.uninstall()
        close = getattr(self.target, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> "AuditedRun":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _merge_same_signature(found: list[Finding]) -> list[Finding]:
    """One finding per signature among those one op produced: a premature free seen by the scan
    after intake and again by the owner's own release in the same step is one use-after-free (the
    first, given the later one's use site and owners where it has none)."""
    if len(found) < 2:
        return found
    out: dict[str, Finding] = {}
    for f in found:
        first = out.setdefault(f.signature, f)
        if first is not f:
            first.read_sites = first.read_sites or f.read_sites
            first.used_by = sorted(set(first.used_by) | set(f.used_by))
    return list(out.values())


def _crash_finding(exc: BaseException, op_index: int, step: int, engine_files=(), target=None,
                   auditor=None) -> Finding:
    """The crash as a finding: its stack without kvaudit's frames, except a target's ``engine_files``
    (a driver that plays the engine's scheduler). An out-of-memory crash also carries who held the
    memory at that moment (``memory_state``, read from ``target`` and ``auditor``: :mod:`kvaudit.memstate`)."""
    tb = traceback.extract_tb(exc.__traceback__)
    keep = {os.path.abspath(f) for f in engine_files}
    frames = [Site(portable_path(fr.filename), fr.lineno or 0, fr.name, (fr.line or "").strip()) for fr in reversed(tb)
              if not os.path.abspath(fr.filename).startswith(_KVAUDIT_DIR + os.sep) or os.path.abspath(fr.filename) in keep]
    f = Finding(kind="crash", pool="-", message=f"{type(exc).__name__}: {exc}", alloc_sites=frames[:8],
                op_index=op_index, step=step,
                traceback="".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
    if target is not None and memstate.is_out_of_memory(str(exc)):
        f.memory_state = memstate.memory_state(target, auditor)
    return f


def execute(config: EngineConfig, program: list[Op], audit: bool = True, stop_on_finding: bool = True,
            full_stacks: bool = True, suppressions=None) -> Execution:
    """Run ``program`` from a fresh engine; stop at the first op that produced a finding (one that
    ``suppressions``, a :class:`kvaudit.suppress.SuppressionSet`, does not cover)."""
    with AuditedRun(config, audit=audit, full_stacks=full_stacks, suppressions=suppressions) as run:
        for op in program:
            found = run.apply(op)
            if found and stop_on_finding:
                break
        return Execution(run.findings, run.ops_run, run.target.steps,
                         run.auditor.digest() if run.auditor is not None else "")
