"""The use-after-free oracle: units a live owner references while the ledger holds them free."""

from __future__ import annotations

import numpy as np

from kvaudit.audit.findings import Finding
from kvaudit.audit.hooks import Auditor
from kvaudit.audit.oracles.grouping import group_by_site


def use_after_free(auditor: Auditor, pool: str, units: np.ndarray, roots) -> list[Finding]:
    """Units a live owner references while the ledger holds them free: one finding per (allocation
    site, free site), naming the free that came too early and the owners still using the units.

    The free that came too early is the unit's latest, unless the unit was freed, allocated again
    and freed again since the previous check while a request that references it now referenced it
    then: that request's units went at the first of those frees (an eviction under a reader), and the
    second is the next holder's own release (:func:`_broken_at`)."""
    led = auditor.ledgers[pool]
    alloc, free = led.last_alloc[units].copy(), led.last_free[units].copy()
    for i, (a, f) in _broken_at(auditor, pool, units, roots).items():
        alloc[i], free[i] = a, f
    free_site = {u: (auditor.events[e].site if e >= 0 else -1, "") for u, e in zip(units.tolist(), free.tolist())}
    out = group_by_site(auditor, "use-after-free", pool, units, "referenced by a live owner but free in the ledger",
                         second=free_site, into="free_sites", alloc_events=alloc)
    for f in out:
        mine = np.asarray(f.slots if f.unit == "row" else sorted({s // led.spec.page_size for s in f.slots}),
                          dtype=np.int64)
        f.used_by = sorted({r.owner for r in roots if np.isin(r.units, mine).any()})
        if f.used_by:
            f.message += f" (still used by {', '.join(f.used_by[:3])})"
    return out


def _broken_at(auditor: Auditor, pool: str, units: np.ndarray, roots) -> dict[int, tuple[int, int]]:
    """Index into ``units`` -> (allocation event, free event) of the allocation a current user held at
    the previous check and the first free of it since, for each unit freed, allocated again and freed
    again since that check whose users now include a request that referenced it then
    (``Auditor.roots_at_check``). Requests only: the tree and a session record take a unit back
    whenever they cache it again; a request would have to let it go and be matched to it again
    between two checks. Runs only when such a unit is free now: a few events are scanned."""
    led, since = auditor.ledgers[pool], auditor.checked_upto
    again = np.flatnonzero(led.last_alloc[units] >= since)  # allocated since the check, and free now
    if not again.size:
        return {}
    first_free: dict[int, int] = {}
    want = set(units[again].tolist())
    for ev in auditor.events[since:]:
        if ev.kind == "free" and ev.pool == pool:
            for u in want.intersection(ev.units):
                first_free.setdefault(u, ev.id)
    before = auditor.roots_at_check.get(pool, [])
    out = {}
    for i in again.tolist():
        u = int(units[i])
        f = first_free.get(u, -1)
        if not 0 <= f < led.last_alloc[u]:
            continue  # not held at the check (its one allocation since, then its free)
        now = {r.owner for r in roots if r.role == "req" and (r.units == u).any()}
        if now.intersection(r.owner for r in before if r.role == "req" and (r.units == u).any()):
            evs = auditor.events
            a = next((k for k in range(f - 1, -1, -1) if evs[k].kind == "alloc" and evs[k].pool == pool
                      and u in evs[k].units), -1)
            out[i] = (a, f)
    return out
