"""The target's own invariants (:meth:`kvaudit.targets.base.Target.invariant_findings`) as findings."""

from __future__ import annotations

import numpy as np

from kvaudit.audit.findings import KINDS, Finding
from kvaudit.audit.hooks import Auditor
from kvaudit.config import json_value
from kvaudit.targets.registry import TargetDefinitionError, kind_name


def target_findings(auditor: Auditor, target) -> list[Finding]:
    """The target's own invariant violations as findings, located at the latest allocation of their
    first unit (and at the frees the target names). Raises
    :class:`kvaudit.targets.registry.TargetDefinitionError` for a finding kind not in :data:`KINDS`."""
    out = []
    for t in target.invariant_findings():
        if t.kind not in KINDS:  # (the target's own mistake, not a new kind of finding: reports read KINDS' table)
            raise TargetDefinitionError(f"target {kind_name(target)}: {type(target).__name__}.invariant_findings(): "
                                        f"finding kind {json_value(t.kind, 40)} is not one of {', '.join(KINDS)}")
        units = np.asarray(t.units, dtype=np.int64).reshape(-1)
        f = auditor._unit_finding(t.kind, t.pool, units if units.size else np.zeros(1, np.int64), t.message)
        f.check = t.check
        f.used_by = list(t.used_by)  # who still uses the units, as the target says it
        f.lost_by = t.lost_by  # what lost a leaked reference, as the target says it (a leak signature's part)
        if t.free_sites:  # the frees that broke it: the last one, and the one before it
            f.free_sites = auditor.site(int(t.free_sites[-1]))
            if len(t.free_sites) > 1:
                f.prev_free_sites = auditor.site(int(t.free_sites[-2]))
        out.append(f)
    return out
