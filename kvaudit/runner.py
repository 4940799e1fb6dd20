"""Run a program against a target under audit.

``execute`` is a pure function of (config, program): the same inputs give the same findings,
which is what replay, minimization and confirmation rely on.
"""

from __future__ import annotations

import os
import traceback
from dataclasses import dataclass, field

from engine_under_test import EngineConfig
from kvaudit import oracles
from kvaudit.findings import Finding, Site, portable_path
from kvaudit.hooks import Auditor
from kvaudit.program import Idle, Op, Step
from kvaudit.targets.eut import EutTarget

MAX_IDLE_STEPS = 2000
_KVAUDIT_DIR = os.path.dirname(os.path.abspath(__file__))


@dataclass
class Execution:
    findings: list[Finding] = field(default_factory=list)
    ops_run: int = 0
    steps: int = 0

    @property
    def signatures(self) -> list[str]:
        return [f.signature for f in self.findings]


class AuditedRun:
    """A target plus its auditor, advanced one op at a time (the fuzzers drive this directly).

    ``audit=False`` runs the bare engine (for throughput baselines); ``oracles=False`` keeps the
    hooks' ledger (double free, aliasing at alloc) but skips the per-step reachability scan;
    ``full_stacks=False`` is the fuzzers' fast mode (see :class:`kvaudit.hooks.Auditor`).
    """

    def __init__(self, config: EngineConfig, audit: bool = True, run_oracles: bool = True,
                 full_stacks: bool = True):
        self.target = EutTarget(config)
        self.auditor = Auditor(self.target, full_stacks=full_stacks) if audit else None
        self.run_oracles = audit and run_oracles
        self.findings: list[Finding] = []
        self.ops_run = 0

    def _check(self, scan: bool = True) -> list[Finding]:
        """Findings the hooks raised, then (``scan``) the oracles' scan of the engine state."""
        if self.auditor is None:
            return []
        self.auditor.step = self.target.steps
        found, self.auditor.pending = self.auditor.pending, []
        if not found and self.run_oracles and scan:
            return oracles.check(self.auditor, self.target)
        return oracles.attach_engine_verdict(self.target, found)

    def _step(self) -> list[Finding]:
        if self.auditor is not None:
            self.auditor.step = self.target.steps + 1
        self.target.step()
        return self._check()

    def apply(self, op: Op) -> list[Finding]:
        """Run one op; returns the findings it produced (also kept in ``self.findings``)."""
        if self.auditor is not None:
            self.auditor.op_index = self.ops_run
        self.ops_run += 1
        try:
            found: list[Finding] = []
            if isinstance(op, Step):
                for _ in range(max(1, op.n)):
                    found = self._step()
                    if found:
                        break
            elif isinstance(op, Idle):
                for _ in range(MAX_IDLE_STEPS):
                    idle = self.target.is_idle()
                    found = self._step()  # when idle, this iteration runs the engine's on_idle
                    if found or idle:
                        break
                else:
                    found = [self._hang_finding()]
            else:
                self.target.apply(op)  # only queues a message: no memory moves until a step
                found = self._check(scan=False)
        except Exception as exc:  # the engine crashed: that is a finding, not our error
            found = [_crash_finding(exc, self.ops_run - 1, self.target.steps)]
        self.findings.extend(found)
        return found

    def _hang_finding(self) -> Finding:
        busy = getattr(self.target, "describe_busy", lambda: "")()
        f = Finding(kind="hang", pool="-", op_index=self.ops_run - 1, step=self.target.steps,
                    message=f"engine not idle after {MAX_IDLE_STEPS} steps of idle(): {busy}")
        return oracles.attach_engine_verdict(self.target, [f])[0]

    def close(self) -> None:
        """Remove the hooks. This also breaks the engine <-> auditor reference cycle, so a finished
        run is freed at once instead of waiting for the cycle collector."""
        if self.auditor is not None:
            self.auditor.uninstall()

    def __enter__(self) -> "AuditedRun":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _crash_finding(exc: BaseException, op_index: int, step: int) -> Finding:
    tb = traceback.extract_tb(exc.__traceback__)
    frames = [Site(portable_path(fr.filename), fr.lineno or 0, fr.name) for fr in reversed(tb)
              if not os.path.abspath(fr.filename).startswith(_KVAUDIT_DIR + os.sep)]
    return Finding(kind="crash", pool="-", message=f"{type(exc).__name__}: {exc}", alloc_sites=frames[:8],
                   op_index=op_index, step=step,
                   traceback="".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))


def execute(config: EngineConfig, program: list[Op], audit: bool = True, stop_on_finding: bool = True,
            full_stacks: bool = True) -> Execution:
    """Run ``program`` from a fresh engine; stop at the first op that produced a finding."""
    with AuditedRun(config, audit=audit, full_stacks=full_stacks) as run:
        for op in program:
            found = run.apply(op)
            if found and stop_on_finding:
                break
        return Execution(run.findings, run.ops_run, run.target.steps)
