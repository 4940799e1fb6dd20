"""The use-after-free oracle: units a live owner references while the ledger holds them free."""

from __future__ import annotations

import numpy as np

from kvaudit.audit.findings import Finding
from kvaudit.audit.hooks import Auditor
from kvaudit.audit.oracles.grouping import group_by_site, release_frame


def use_after_free(auditor: Auditor, pool: str, units: np.ndarray, roots) -> list[Finding]:
    """``units`` (``[n] int64``) of ``pool`` that ``roots`` reference while the ledger holds them free:
    one finding per (allocation site, the free that came too early, what the target says of that free:
    ``Target.freed_by``), naming the owners still using them."""
    led = auditor.ledgers[pool]
    alloc, free = led.last_alloc[units].copy(), led.last_free[units].copy()
    for i, (a, f) in _broken_at(auditor, pool, units).items():
        alloc[i], free[i] = a, f
    by = auditor.target.freed_by(pool, units, free) or [""] * units.size  # what the target says of each free
    free_site = {u: (auditor.events[e].site if e >= 0 else -1, "", b)
                 for u, e, b in zip(units.tolist(), free.tolist(), by)}
    out = group_by_site(auditor, "use-after-free", pool, units, "referenced by a live owner but free in the ledger",
                         second=free_site, into="free_sites", alloc_events=alloc)
    for f in out:
        mine = np.asarray(f.slots if f.unit == "row" else sorted({s // led.spec.page_size for s in f.slots}),
                          dtype=np.int64)
        f.used_by = sorted({r.owner for r in roots if np.isin(r.units, mine).any()})
        if f.used_by:
            f.message += f" (still used by {', '.join(f.used_by[:3])})"
    return out


def _broken_at(auditor: Auditor, pool: str, units: np.ndarray) -> dict[int, tuple[int, int]]:
    # index into units -> (alloc event, free event): a unit freed, allocated again and freed again since
    # the check, whose first free came under a request that read it then and still held its row (its row
    # not freed since, or on another release path), or that the target recorded as a free under a reader
    # (Target.freed_under_reader): that free broke it (docs/internals/audit.md)
    led, since, evs = auditor.ledgers[pool], auditor.checked_upto, auditor.events
    again = np.flatnonzero(led.last_alloc[units] >= since)  # allocated since the check, and free now
    if not again.size:
        return {}
    at_check = auditor.roots_at_check
    readers = [r for r in at_check.get(pool, []) if r.role == "req"]
    row_of = {r.owner: int(r.units[0]) for r in at_check.get("req_to_token_pool", []) if r.role == "req" and r.units.size}
    first_free: dict[tuple[str, int], int] = {}  # (pool, unit) -> its first free since the check
    want = {(pool, u) for u in units[again].tolist()} | {("req_to_token_pool", r) for r in row_of.values()}
    for ev in evs[since:]:
        if ev.kind == "free":
            for u in ev.units:
                if (ev.pool, u) in want:
                    first_free.setdefault((ev.pool, u), ev.id)
    paths: dict[int, tuple] = {}

    def path(e: int) -> tuple:  # event e's release path
        return release_frame(auditor, evs[e].site, paths)

    def held_at(owner: str, f: int) -> bool:  # the request still held its row at event f
        row = row_of.get(owner)
        gone = first_free.get(("req_to_token_pool", row), -1) if row is not None else -1
        return row is not None and (gone < 0 or (gone > f and path(gone) != path(f)))

    out = {}
    held = [(i, int(units[i])) for i in again.tolist()
            if 0 <= first_free.get((pool, int(units[i])), -1) < led.last_alloc[units[i]]]  # (else not held at the check)
    firsts = np.array([first_free[(pool, u)] for _, u in held], dtype=np.int64)
    # or a first free the target recorded as one under a reader (one admitted since the check: not a root then)
    under = (auditor.target.freed_under_reader(pool, np.array([u for _, u in held], dtype=np.int64), firsts)
             if held else None) or [False] * len(held)
    for (i, u), f, by_target in zip(held, firsts.tolist(), under):
        if by_target or any(held_at(r.owner, f) for r in readers if (r.units == u).any()):
            a = next((k for k in range(f - 1, -1, -1) if evs[k].kind == "alloc" and evs[k].pool == pool
                      and u in evs[k].units), -1)
            out[i] = (a, f)
    return out
