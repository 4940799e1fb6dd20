"""How a search checks a program: the one place every in-process fuzzer (and the atheris harness) opens
its audited run, on the sparse schedule (every :data:`CHECK_EVERY` scheduler steps, ...: docs/internals/audit.md),
its hits localized by a per-step replay (:class:`kvaudit.audit.runner.AuditedRun`), so what a search reports
is what a per-step run of the same program reports. Measured choice of K: docs/internals/performance.md.
"""

from __future__ import annotations

from kvaudit.audit.runner import AuditedRun
from kvaudit.config import TargetConfig
from kvaudit.targets import registry

CHECK_EVERY = 16  # scheduler steps between full checks in a search; 1: a check after every step
PER_STEP_FIRST = 0  # a search's first programs run with a check after every step (see per_step_first)
SITE_KEYS_EVERY = 16  # a search collects the site keys in its first program and then one in every 16


def site_keys_due(execution: int) -> bool:
    """Whether a search's ``execution``-th program (counted from 1) collects the engine lines its allocs,
    frees and locks ran from (``Auditor.site_keys()``: the corpus fuzzer's site features, the progress
    line's site count): the 1st, then every :data:`SITE_KEYS_EVERY`-th (17th, 33rd, ...). The walk costs a
    frame read per ledger and lock event (0.072x of the bare engine's bytecodes on eut ``default``), and the
    lines a search reaches are few and met early; a line first reached in a program that does not collect
    is counted when a collecting program reaches it (measured: docs/internals/performance.md, stop 57)."""
    return SITE_KEYS_EVERY <= 1 or execution % SITE_KEYS_EVERY == 1


def per_step_first(config: TargetConfig) -> int:
    """How many of a search's first programs on ``config`` run with a check after every step: the kind's
    ``search_per_step_first``, else :data:`PER_STEP_FIRST`. Where a check costs little beside the engine's
    step (vLLM's), a hit within them saves the localizing replay; where it costs more (SGLang's, the eut),
    the per-step programs that do not hit cost more than the replay saves (measured:
    docs/internals/performance.md, stop 48)."""
    first = registry.kind_of(config).search_per_step_first
    return PER_STEP_FIRST if first is None else first


def search_run(config: TargetConfig, suppressions=None, deadline: float | None = None,
               per_step: bool = False, site_keys: bool = True) -> AuditedRun:
    """A fresh audited engine for one search program: fast stacks, the sparse schedule. The caller
    applies ops until the first finding, then calls ``finish()`` (the end-of-program check) when the
    program ran out without one. A target whose state needs a check after a step says so
    (``Target.transient``); the schedule is the same for every kind.
    On the sparse schedule the hooks are lean (no call sites, no lock-event records: the replay reports).
    ``per_step``: a check after every step instead (what a search asks for its first
    :func:`per_step_first` programs): a hit there is reported as found, with no localizing replay, which
    on a hit within the first few programs (most of the history suite's bugs) is a second run of the
    program; a per-step run reports what the sparse run's replay would. ``site_keys=False``: the run
    collects no site keys (see :func:`site_keys_due`)."""
    return AuditedRun(config, full_stacks=False, suppressions=suppressions, deadline=deadline,
                      check_every=1 if per_step else CHECK_EVERY, lean=True, site_keys=site_keys)
