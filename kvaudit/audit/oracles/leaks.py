"""The leak oracle: allocated units no root reaches, direct or indirect (reachable only from a
leaked request row), grouped by allocation site and by where they lost their last owner."""

from __future__ import annotations

import numpy as np

from kvaudit.audit.findings import Finding
from kvaudit.audit.hooks import Auditor
from kvaudit.audit.oracles.grouping import group_by_site


def leaks(auditor: Auditor, target, leaked: dict[str, np.ndarray],
           prev_owner: dict[str, np.ndarray]) -> list[Finding]:
    """Leaks, classified as LeakSanitizer does: units reachable only from a leaked row (the
    request's KV, buffers and host copies) are *indirect*; the rest are *direct*. Grouped by
    allocation site and by where the units lost their last owner (:func:`_lost_sites`)."""
    rows = leaked.get("req_to_token_pool")
    via_rows = (target.units_of_rows(rows) if rows is not None else None) or {}
    out = []
    for pool, units in leaked.items():
        held = via_rows.get(pool)
        indirect = units[np.isin(units, held)] if held is not None and held.size else units[:0]
        direct = np.setdiff1d(units, indirect)
        lost = _lost_sites(auditor, target, pool, units, prev_owner)
        if direct.size:
            out.extend(group_by_site(auditor, "leak", pool, direct, "allocated, unreachable from every root",
                                      second=lost))
        for f in (group_by_site(auditor, "leak", pool, indirect, "reachable only from a leaked request row",
                                 second=lost) if indirect.size else []):
            f.indirect = True
            out.append(f)
    out.sort(key=lambda f: f.indirect)
    return out

def _lost_sites(auditor: Auditor, target, pool: str, units: np.ndarray,
                prev_owner: dict[str, np.ndarray]) -> dict[int, tuple[int, str]]:
    """Unit -> ``(site id, where)``: where it lost its last owner, as the leak's second signature part.

    The site is the latest free, since the previous check, of anything else the unit's owner record
    held: the release that let go of the owner's other units and left this one out. The owner record
    is the request row that maps the unit (the row itself for a row), read from the row table, so a
    request born and lost in one step is covered; failing that (a session record, a target with no
    row table), the unit's owner at the previous check. ``where`` is the place the target last held
    that owner in (``Root.where``), for an owner that was dropped without freeing anything. Units
    with neither are left out. Runs only when something leaked, over the events since the last check.
    """
    # a leak re-reported at a later check keeps the attribution it had when first seen
    memo, last = auditor.lost_memo.setdefault(pool, {}), auditor.ledgers[pool].last_alloc
    out = {u: memo[u][1] for u in units.tolist() if u in memo and memo[u][0] == last[u]}
    if len(out) < units.size:
        fresh = np.array([u for u in units.tolist() if u not in out], dtype=np.int64)
        for u, lost in _attribute(auditor, target, pool, fresh, prev_owner).items():
            memo[u] = (int(last[u]), lost)
            out[u] = lost
    return out

def _attribute(auditor: Auditor, target, pool: str, units: np.ndarray,
               prev_owner: dict[str, np.ndarray]) -> dict[int, tuple[int, str]]:
    """:func:`_lost_sites` for units seen leaked for the first time."""
    rows_led = auditor.ledgers.get("req_to_token_pool")
    of_rows = target.units_of_rows if target.units_of_rows(np.zeros(0, dtype=np.int64)) is not None else None
    recent = auditor.events[auditor.checked_upto:]
    frees = [ev for ev in reversed(recent) if ev.kind == "free"]
    out: dict[int, tuple[int, str]] = {}
    if rows_led is not None and of_rows is not None and frees:
        live = rows_led.allocated | (rows_led.last_free >= auditor.checked_upto)
        live[0] = False
        # each live row's units per pool, as sets (the row itself in the row pool)
        held = {int(r): {p: set(np.asarray(us).tolist()) for p, us in of_rows(np.array([r])).items()}
                for r in np.flatnonzero(live)}
        for r, m in held.items():
            m.setdefault("req_to_token_pool", {r})
        leaked = set(units.tolist())
        for u in units.tolist():
            mine = [r for r, m in held.items() if u in m.get(pool, ())]
            # the latest such free in the unit's own pool (the release that freed its neighbours and
            # left it out), else in any pool (a release that freed the row and forgot a buffer)
            for same in (True, False):
                hit = next((ev for ev in frees if (ev.pool == pool) == same and any(
                    held[r].get(ev.pool, set()).intersection(ev.units) - (leaked if ev.pool == pool else set())
                    for r in mine)), None)
                if hit is not None:
                    out[u] = (hit.site, "")
                    break
    owners = prev_owner[pool][units]
    wanted = set(owners[owners > 0].tolist())
    site_of: dict[int, int] = {}  # owner id -> site of its latest free
    for ev in frees:
        if not wanted:
            break
        if ev.pool in prev_owner:
            had = prev_owner[ev.pool][np.asarray(ev.units, dtype=np.int64)]
            for oid in wanted.intersection(had.tolist()):
                site_of[oid] = ev.site
                wanted.discard(oid)
    where = auditor.owner_where
    for u, oid in zip(units.tolist(), owners.tolist()):
        if u not in out and oid > 0:
            out[u] = (site_of.get(oid, -1), where.get(oid, ""))
    return out
