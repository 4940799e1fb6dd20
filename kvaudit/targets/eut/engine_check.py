"""The built-in engine's own memory check, run bare: what the engine alone would have caught."""

from __future__ import annotations

from kvaudit.audit.runner import MAX_IDLE_STEPS
from kvaudit.program import Idle, Step
from kvaudit.targets.eut.target import EutTarget


def first_failures(config, program) -> tuple[int | None, int | None]:
    """The engine's own SGLang-style ``check_memory()`` after every scheduler step of ``program``,
    the engine running bare: (first step whose idle check fails, first step whose busy or idle check
    fails), None for never. SGLang raises only at idle (benchmarks/engine_check.py tabulates both;
    ``kvaudit bench`` reports the first as its 'SGLang idle check' column)."""
    target = EutTarget(config)  # the engine bare: no hooks, no audit
    eng = target.engine
    first_idle = first_any = None
    for op in program:
        if isinstance(op, (Step, Idle)):
            for _ in range(op.n if isinstance(op, Step) else MAX_IDLE_STEPS):
                idle = target.is_idle()
                try:
                    target.step()
                    bad = [c for c in eng.check_memory() if not c.ok]
                except Exception:  # the engine crashed: its checks never ran again
                    return first_idle, first_any
                if bad and first_any is None:
                    first_any = target.steps
                if bad and eng.is_fully_idle() and first_idle is None:
                    first_idle = target.steps
                if isinstance(op, Idle) and idle:
                    break
        else:
            target.apply(op)
    return first_idle, first_any
