"""Findings per allocation site (and per second site: where a leak lost its owner, the premature
free of a use-after-free), as LeakSanitizer groups by stack."""

from __future__ import annotations

import numpy as np

from kvaudit.audit.findings import Finding
from kvaudit.audit.hooks import Auditor


def release_frame(auditor: Auditor, sid: int, memo: dict[int, tuple]) -> tuple:
    """``(function, file)`` of site ``sid``'s first frame above the target's release entries (its
    release path), ``()`` for no site; memoized in ``memo``."""
    if sid not in memo:
        sites = auditor.site(sid)
        s = next((x for x in sites if not x.entry), sites[-1]) if sites else None
        memo[sid] = (s.function, s.file) if s else ()
    return memo[sid]


def group_by_site(auditor: Auditor, kind: str, pool: str, units: np.ndarray, msg: str,
                   second: dict[int, tuple] | None = None, into: str = "lost_sites",
                   alloc_events: np.ndarray | None = None) -> list[Finding]:
    """One finding per allocation site of ``units`` (``[n] int64``) and, with ``second`` (unit -> (site
    id, where[, by])), per second site too, recorded as the findings' ``into`` stack, ``lost_from`` and
    ``lost_by``. The
    allocation is each unit's latest, or ``alloc_events`` (``[n]`` event ids, -1 for none)."""
    led = auditor.ledgers[pool]
    ev_ids = led.last_alloc[units] if alloc_events is None else alloc_events
    site_of_unit = [auditor.events[e].site if e >= 0 else -1 for e in ev_ids.tolist()]
    second = second or {}
    keys = [(a, *second.get(u, (-1, "")), "")[:4] for a, u in zip(site_of_unit, units.tolist())]
    out = []
    for key in sorted(set(keys)):
        mine = units[np.array([k == key for k in keys])]
        f = auditor._unit_finding(kind, pool, mine, msg, alloc_sid=int(key[0]))
        setattr(f, into, auditor.site(int(key[1])))
        f.lost_from, f.lost_by = key[2], key[3]
        out.append(f)
    return out
