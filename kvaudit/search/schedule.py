"""How a search checks a program: the one place every in-process fuzzer (and the atheris harness) opens
its audited run. The full oracle scan runs on the sparse schedule (every :data:`CHECK_EVERY` scheduler
steps, where the program's idle() drains, and at the program's end); a hit is localized by a per-step
replay (:class:`kvaudit.audit.runner.AuditedRun`), so what a search reports is what a per-step run of the
same program reports. Measured choice of K: docs/internals/performance.md.
"""

from __future__ import annotations

from kvaudit.audit.runner import AuditedRun
from kvaudit.config import TargetConfig

CHECK_EVERY = 16  # scheduler steps between full checks in a search; 1: a check after every step


def search_run(config: TargetConfig, suppressions=None, deadline: float | None = None) -> AuditedRun:
    """A fresh audited engine for one search program: fast stacks, the sparse schedule. The caller
    applies ops until the first finding, then calls ``finish()`` (the end-of-program check) when the
    program ran out without one. A target whose state needs a check after a step says so
    (``Target.transient``); the schedule is the same for every kind.
    On the sparse schedule the hooks are lean (no call sites, no lock-event records: the replay reports)."""
    return AuditedRun(config, full_stacks=False, suppressions=suppressions, deadline=deadline,
                      check_every=CHECK_EVERY, lean=True)
