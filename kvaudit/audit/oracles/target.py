"""The target's own invariants (:meth:`kvaudit.targets.base.Target.invariant_findings`) as findings."""

from __future__ import annotations

import numpy as np

from kvaudit.audit.findings import Finding
from kvaudit.audit.hooks import Auditor


def target_findings(auditor: Auditor, target) -> list[Finding]:
    """The target's own invariant violations as findings, located at the latest allocation of their
    first unit (and at the frees the target names)."""
    out = []
    for t in target.invariant_findings():
        units = np.asarray(t.units, dtype=np.int64).reshape(-1)
        f = auditor._unit_finding(t.kind, t.pool, units if units.size else np.zeros(1, np.int64), t.message)
        f.check = t.check
        f.used_by = list(t.used_by)  # who still uses the units, as the target says it
        if t.free_sites:  # the frees that broke it: the last one, and the one before it
            f.free_sites = auditor.site(int(t.free_sites[-1]))
            if len(t.free_sites) > 1:
                f.prev_free_sites = auditor.site(int(t.free_sites[-2]))
        out.append(f)
    return out
