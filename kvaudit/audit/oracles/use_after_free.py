"""The use-after-free oracle: units a live owner references while the ledger holds them free."""

from __future__ import annotations

import numpy as np

from kvaudit.audit.findings import Finding
from kvaudit.audit.hooks import Auditor
from kvaudit.audit.oracles.grouping import group_by_site


def use_after_free(auditor: Auditor, pool: str, units: np.ndarray, roots) -> list[Finding]:
    """Units a live owner references while the ledger holds them free: one finding per (allocation
    site, free site), naming the free that came too early and the owners still using the units."""
    led = auditor.ledgers[pool]
    free_site = {u: (auditor.events[e].site if e >= 0 else -1, "")
                 for u, e in zip(units.tolist(), led.last_free[units].tolist())}
    out = group_by_site(auditor, "use-after-free", pool, units, "referenced by a live owner but free in the ledger",
                         second=free_site, into="free_sites")
    for f in out:
        mine = np.asarray(f.slots if f.unit == "row" else sorted({s // led.spec.page_size for s in f.slots}),
                          dtype=np.int64)
        f.used_by = sorted({r.owner for r in roots if np.isin(r.units, mine).any()})
        if f.used_by:
            f.message += f" (still used by {', '.join(f.used_by[:3])})"
    return out
