"""The leak oracle: allocated units no root reaches, direct or indirect (reachable only from a
leaked request row), grouped by allocation site and by where they lost their last owner."""

from __future__ import annotations

import numpy as np

from kvaudit.audit.findings import Finding
from kvaudit.audit.hooks import Auditor
from kvaudit.audit.oracles.grouping import group_by_site, release_frame


def leaks(auditor: Auditor, target, leaked: dict[str, np.ndarray],
           prev_owner: dict[str, np.ndarray], roots: dict[str, list]) -> list[Finding]:
    """Leaks of ``leaked`` (pool -> ``[n] int64`` units no root reaches), *indirect* when reachable only
    from a leaked request row, else *direct* (as LeakSanitizer), grouped by allocation site and by
    where the units lost their last owner (``prev_owner``: each pool's owner ids at the previous check;
    ``roots``: this check's roots by pool)."""
    rows = leaked.get("req_to_token_pool")
    via_rows = (target.units_of_rows(rows) if rows is not None else None) or {}
    out = []
    for pool, units in leaked.items():
        held = via_rows.get(pool)
        indirect = units[np.isin(units, held)] if held is not None and held.size else units[:0]
        direct = np.setdiff1d(units, indirect)
        lost = _lost_sites(auditor, target, pool, units, prev_owner, roots)
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
                prev_owner: dict[str, np.ndarray], roots: dict[str, list]) -> dict[int, tuple]:
    # unit -> (site id, where[, by]) it lost its last owner (docs/internals/audit.md, leak attribution)
    # a leak re-reported at a later check keeps the attribution it had when first seen
    memo, last = auditor.lost_memo.setdefault(pool, {}), auditor.ledgers[pool].last_alloc
    out = {u: memo[u][1] for u in units.tolist() if u in memo and memo[u][0] == last[u]}
    if len(out) < units.size:
        fresh = np.array([u for u in units.tolist() if u not in out], dtype=np.int64)
        for u, lost in _attribute(auditor, target, pool, fresh, prev_owner, roots).items():
            memo[u] = (int(last[u]), lost)
            out[u] = lost
    return out

def _attribute(auditor: Auditor, target, pool: str, units: np.ndarray,
               prev_owner: dict[str, np.ndarray], roots: dict[str, list]) -> dict[int, tuple]:
    # by the row that maps the unit; else by its owner at the previous check (a unit allocated since: the
    # owner of its earlier allocation, if that owner is still a root); else, for an owner that freed nothing, the place it was dropped from;
    # else, for a unit no owner held, what the target says lost it (Target.lost_by: (-1, "", by))
    frees = [ev for ev in reversed(auditor.events[auditor.checked_upto:]) if ev.kind == "free"]
    had = _earlier_owner(auditor, pool, units, prev_owner, roots)
    out = _by_row(auditor, target, pool, units, prev_owner, frees)
    rest = np.array([u for u in units.tolist() if u not in out], dtype=np.int64)
    if rest.size:
        # the owner at the previous check of the allocation that leaked (0: allocated since)
        owners = np.where(auditor.ledgers[pool].last_alloc[rest] < auditor.checked_upto, prev_owner[pool][rest], 0)
        out.update(_by_owner(pool, rest, owners, frees, prev_owner, first_only=True))
        born = np.array([u for u, o in zip(rest.tolist(), owners.tolist()) if o == 0 and u not in out], dtype=np.int64)
        if born.size:
            earlier = dict(zip(units.tolist(), had.tolist()))
            out.update(_by_owner(pool, born, np.array([earlier[u] for u in born.tolist()], dtype=np.int64), frees,
                                 prev_owner, first_only=False))
    where = auditor.owner_where  # an owner that freed nothing: the place it was dropped from
    for u, oid in zip(units.tolist(), had.tolist()):
        if u not in out and oid > 0:
            out[u] = (-1, where.get(oid, ""))
    rest = np.array([u for u in units.tolist() if u not in out], dtype=np.int64)
    by = target.lost_by(pool, rest) if rest.size else None  # no owner, no release: what the target says lost it
    out.update({u: (-1, "", b) for u, b in zip(rest.tolist(), by or ()) if b})
    return out

def _earlier_owner(auditor: Auditor, pool: str, units: np.ndarray, prev_owner: dict[str, np.ndarray],
                   roots: dict[str, list]) -> np.ndarray:
    # each unit's owner at the previous check (0: none), but 0 for a unit allocated again since whose owner
    # then is no root of this check: it let go of the unit (aborted, finished), so the new allocation that
    # leaked is another owner's (its release is not where this one was lost); 0 too when the new allocation's
    # frames name another owner (a preempted request admitted again: a root, yet not the one that took it)
    had = prev_owner[pool][units].copy()
    last = auditor.ledgers[pool].last_alloc
    again = (last[units] >= auditor.checked_upto) & (had > 0)
    if again.any():
        alive = {r.owner for rs in roots.values() for r in rs}
        names, events = auditor.owner_names, auditor.events
        took = [auditor.site_owner(events[a].site) for a in last[units[again]].tolist()]
        had[again] = [o if names[o] in alive and who in (None, names[o]) else 0
                      for o, who in zip(had[again].tolist(), took)]
    return had

def _by_owner(pool: str, units: np.ndarray, owners: np.ndarray, frees: list, prev_owner: dict[str, np.ndarray],
              first_only: bool) -> dict[int, tuple[int, str]]:
    # the latest free (frees: latest first) of other units its owner held then, in pool first, else any.
    # first_only: only a unit's first free since the check counts (its second is the next holder's)
    out: dict[int, tuple[int, str]] = {}
    if not frees or not (owners > 0).any():
        return out
    freed_from, seen = [], {}
    for ev in reversed(frees):
        first = [v for v in ev.units if v not in seen.setdefault(ev.pool, set())] if first_only else ev.units
        seen.setdefault(ev.pool, set()).update(first)
        ids = prev_owner[ev.pool][np.asarray(first, dtype=np.int64)] if ev.pool in prev_owner else []
        freed_from.append((ev, set(np.asarray(ids).tolist())))
    freed_from.reverse()  # the latest first
    for u, oid in zip(units.tolist(), owners.tolist()):
        for same in (True, False):
            hit = next((ev for ev, ids in freed_from if oid > 0 and (ev.pool == pool) == same and oid in ids), None)
            if hit is not None:
                out[u] = (hit.site, "")
                break
    return out

def _by_row(auditor: Auditor, target, pool: str, units: np.ndarray, prev_owner: dict[str, np.ndarray],
            frees: list) -> dict[int, tuple[int, str]]:
    # the latest free of another unit of the request row that maps it, in pool first, else any.
    # NOTE: a row keeps stale entries of earlier tenants: only units allocated since the row was, freed
    # after that, not another owner's at the previous check; a row freed meanwhile: that release's path.
    # Where the target records its tenant's length (units_of_tenants), not its entries past it either
    rows_led = auditor.ledgers.get("req_to_token_pool")
    if rows_led is None or not frees or target.units_of_rows(np.zeros(0, dtype=np.int64)) is None:
        return {}
    live = rows_led.allocated | (rows_led.last_free >= auditor.checked_upto)
    live[0] = False
    held: dict[int, dict[str, set]] = {}  # row -> pool -> its units
    for r in np.flatnonzero(live).tolist():
        since = rows_led.last_alloc[r]
        mapped = target.units_of_tenants(np.array([r]))
        mapped = target.units_of_rows(np.array([r])) if mapped is None else mapped
        held[r] = {p: set(us[auditor.ledgers[p].last_alloc[us] >= since].tolist()) if p in auditor.ledgers else set()
                   for p, us in ((p, np.asarray(us, dtype=np.int64)) for p, us in mapped.items())}
        held[r].setdefault("req_to_token_pool", {r})
    leaked = set(units.tolist())
    allocs: dict[str, dict[int, list[int]]] = {}  # pool -> unit -> its allocations since the previous check
    for ev in auditor.events[auditor.checked_upto:]:
        if ev.kind == "alloc":
            for v in ev.units:
                allocs.setdefault(ev.pool, {}).setdefault(v, []).append(ev.id)
    paths: dict[int, tuple] = {}
    released: dict[int, list[int]] = {}  # free event id -> released_with's rows

    def owner_of(r: int) -> int:  # the row's owner at the previous check (0: allocated since)
        return prev_owner["req_to_token_pool"][r] if rows_led.last_alloc[r] < auditor.checked_upto else 0

    def released_with(ev) -> list[int]:  # the rows freed since the check by ev's release: its op, step, path
        if ev.id not in released:
            released[ev.id] = [r for r in held if not rows_led.allocated[r] and rows_led.last_free[r] >= auditor.checked_upto
                               and rows_led.last_alloc[r] < ev.id and _same_release(auditor, ev, rows_led.last_free[r], paths)]
        return released[ev.id]

    def of_row(ev, r: int) -> bool:
        if ev.id <= rows_led.last_alloc[r]:
            return False
        mine = held[r].get(ev.pool, set()).intersection(ev.units) - (leaked if ev.pool == pool else set())
        for r2 in released_with(ev):  # a unit another row freed by this release maps is that row's: r's entry
            if r2 != r:  # of it is stale (an earlier tenant's, the unit handed to that row since)
                mine -= held[r2].get(ev.pool, set())
        if ev.pool in prev_owner:  # (a unit allocated again since the check: its owner then held the old one)
            since = allocs.get(ev.pool, {})
            mine = {v for v in mine if prev_owner[ev.pool][v] in (0, owner_of(r)) or any(a < ev.id for a in since.get(v, ()))}
        freed = not rows_led.allocated[r] and rows_led.last_free[r] >= auditor.checked_upto
        return bool(mine) and (not freed or release_frame(auditor, ev.site, paths)
                                == release_frame(auditor, auditor.events[rows_led.last_free[r]].site, paths))

    out: dict[int, tuple[int, str]] = {}
    fresh = auditor.ledgers[pool].last_alloc[units] >= auditor.checked_upto
    for u, new in zip(units.tolist(), fresh.tolist()):  # the rows that map it, not through a stale entry
        rows = [r for r, m in held.items() if u in m.get(pool, ())
                and (new or pool not in prev_owner or prev_owner[pool][u] in (0, owner_of(r)))]
        for same in (True, False):
            hit = next((ev for ev in frees if (ev.pool == pool) == same and any(of_row(ev, r) for r in rows)), None)
            if hit is not None:
                out[u] = (hit.site, "")
                break
    return out


def _same_release(auditor: Auditor, ev, other: int, paths: dict[int, tuple]) -> bool:
    # free event ``other`` (an id) came from the same release as ``ev``: the same op, step and release path
    o = auditor.events[other]
    return (o.op_index, o.step) == (ev.op_index, ev.step) and release_frame(auditor, o.site, paths) == release_frame(
        auditor, ev.site, paths)
