"""The ledger: per-unit state of every pool (allocated flag or reference count, last alloc and free
event, owner) and the recording of allocs, references and frees, with double frees and aliasing
caught as they happen. Design notes: docs/internals/audit.md.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from kvaudit.audit.findings import Finding, OwnerChange
from kvaudit.targets.base import PoolSpec

SMALL_EVENT = 64  # events up to this many units take the scalar fast path (numpy call overhead dominates)
MARK_LOOP = 20  # a fast path's event marks up to this many units one by one, more with numpy (the two cost alike at ~20)


class Event(NamedTuple):
    """One alloc or free the ledger recorded (``Ledger.events[id]``)."""

    id: int
    kind: str  # "alloc" | "free"
    pool: str
    units: list[int]  # the units (pages or rows), an owned copy
    op_index: int
    step: int
    site: int


_new_tuple = tuple.__new__
_NONE = np.zeros(0, dtype=np.int64)  # no units (read only)


def _as_list(units) -> list[int]:
    return units.tolist() if hasattr(units, "tolist") else list(units)


class PoolLedger:
    """Per-unit state of one pool: allocated flag, last alloc and free event, current owner id; for a
    ``"blocks"`` pool also ``refs`` (``[n] int64`` reference counts; allocated means a count above 0)."""

    def __init__(self, spec: PoolSpec):
        n = spec.num_units + 1
        self.spec = spec
        self.flags = bytearray(n)  # allocated flags; ``allocated`` is a numpy view of the same bytes
        self.allocated = np.frombuffer(self.flags, dtype=bool)
        self.last_alloc = np.full(n, -1, dtype=np.int64)
        self.last_free = self.last_alloc.copy()  # (a copy in C: np.full is Python)
        self.owner = np.zeros(n, dtype=np.int64)  # id into Auditor.owner_names; 0 = nobody
        self.allocated[0] = True  # reserved padding unit: any alloc of it trips the aliasing check
        self.refs = np.zeros(n, dtype=np.int64) if spec.kind == "blocks" else None


class Ledger:
    """The recording half of :class:`kvaudit.audit.hooks.Auditor` (``ledgers``, ``events``,
    ``pending``); sites come from the auditor."""

    def _event(self, kind: str, pool: str, units: list[int], sid: int) -> int:
        # the new event's id (the auditor's op_index and step as stored: their properties' getters, without the
        # calls; built by tuple.__new__ at once, without the named tuple's own __new__ frame: one event per alloc
        # and free)
        eid = len(self.events)
        self.events.append(_new_tuple(Event, (eid, kind, pool, units, self._op_index, self._step, sid)))
        return eid

    def _mark(self, kind: str, pool: str, units: list[int], sid: int, led: PoolLedger, last: np.ndarray,
              value: int) -> None:
        # a fast path's event: recorded (_event, inline), and each unit's allocated flag set to ``value`` and its
        # ``last`` event (last_alloc or last_free) to it; one by one on a few units (Python scalar stores beat
        # numpy's call), with numpy's fancy stores on more
        eid = len(self.events)
        self.events.append(_new_tuple(Event, (eid, kind, pool, units, self._op_index, self._step, sid)))
        if len(units) > MARK_LOOP:
            u = np.array(units, dtype=np.int64)
            led.allocated[u] = value
            last[u] = eid
            return
        flags = led.flags
        for x in units:
            flags[x] = value
            last[x] = eid

    def _alloc_event(self, led: PoolLedger, pool: str, units: np.ndarray, sid: int) -> None:
        eid = self._event("alloc", pool, units.tolist(), sid)
        led.allocated[units] = True
        led.last_alloc[units] = eid

    def on_alloc(self, pool: str, units, sid: int, expected_new: int | tuple | None = None) -> None:
        """Record an allocation of ``units`` (a list or ``[n] int64`` array); aliasing when fewer than
        ``expected_new`` units are fresh (or ``(allocator, available_size() before)``, counted only
        when needed)."""
        led = self.ledgers[pool]
        # (_as_list inline: one call fewer per event)
        ul, flags = list(units) if type(units) is list else _as_list(units), led.flags
        if led.refs is not None:  # a reference-counted pool: a fresh block starts at count 1
            if len(ul) <= SMALL_EVENT and not any(map(flags.__getitem__, ul)) and len(set(ul)) == len(ul):
                ul = sorted(ul)  # fast path: every block fresh, named once (the event lists them sorted)
                refs = led.refs
                for x in ul:
                    refs[x] = 1
                self._mark("alloc", pool, ul, sid, led, led.last_alloc, 1)
                return
            u = np.asarray(ul, dtype=np.int64)
            held = led.allocated[u]  # (the reserved block 0 always reads as held)
            names, times = np.unique(u, return_counts=True)
            taken = np.unique(u[held]) if held.any() else names[times > 1]  # referenced already, or named twice
            if taken.size:
                self.pending.append(self._unit_finding(
                    "aliasing", pool, taken, f"allocator handed out {taken.size} block(s) already referenced "
                    "(or the reserved block 0)", alloc_sid=sid))
            fresh = np.unique(u[~held])
            if fresh.size:
                led.refs[fresh] = 1
                self._alloc_event(led, pool, fresh, sid)
            return
        if len(ul) <= SMALL_EVENT and not any(map(flags.__getitem__, ul)):
            # fast path (the common case): every unit is fresh. Python scalar ops beat numpy here.
            self._mark("alloc", pool, ul, sid, led, led.last_alloc, 1)
            return
        units = np.asarray(ul, dtype=np.int64)
        held = led.allocated[units]  # unit 0 always reads as held (see PoolLedger)
        fresh = units
        if held.any():
            fresh = units[~held]
            if isinstance(expected_new, tuple):  # (allocator, its available size before): count now
                expected_new = (expected_new[1] - expected_new[0].available_size()) // led.spec.page_size
            if expected_new is None:
                expected_new = units.size
            if fresh.size < expected_new or not units.all():
                taken = units[held] if fresh.size < expected_new else units[units == 0]
                self.pending.append(self._unit_finding(
                    "aliasing", pool, taken, f"allocator handed out {_units(taken.size)} already allocated "
                    "(or the reserved unit 0)", alloc_sid=sid))
        self._alloc_event(led, pool, fresh, sid)

    def on_ref(self, pool: str, units, sid: int) -> None:
        """Record one more reference to each of ``units`` (a list or array; a unit named twice gains
        two) in a ``"blocks"`` pool (vLLM's ``BlockPool.touch``); a block at count 0 is allocated again."""
        led = self.ledgers[pool]
        ul, refs = _as_list(units), led.refs
        if len(ul) <= SMALL_EVENT:  # fast path: Python scalar ops beat numpy on a few blocks
            revived = sorted({x for x in ul if x > 0 and refs[x] == 0})
            for x in ul:
                refs[x] += 1
            if revived:
                self._alloc_event(led, pool, np.array(revived, dtype=np.int64), sid)
            return
        u = np.asarray(ul, dtype=np.int64)
        revived = np.unique(u[led.refs[u] == 0])
        revived = revived[revived > 0]
        np.add.at(led.refs, u, 1)
        if revived.size:
            self._alloc_event(led, pool, revived, sid)

    def _unref(self, pool: str, units: list[int], sid: int) -> None:
        led = self.ledgers[pool]
        refs, flags = led.refs, led.flags
        # NOTE: a count is never below 0 (a decrement past it is put back to 0 below), so a held block is one whose
        # count is not 0: tested in C (map), not by a generator over numpy scalars
        if len(units) <= SMALL_EVENT and 0 not in units and len(set(units)) == len(units) and all(
                map(refs.__getitem__, units)):  # fast path: a few blocks, each held, named once
            zero = []
            for x in units:
                n = refs[x] - 1
                refs[x] = n
                if not n and flags[x]:
                    zero.append(x)
            if not zero:
                return  # (no block let go: nothing more to record; the reserved block's flag is untouched)
            bad, zero = _NONE, np.array(sorted(zero), dtype=np.int64)
        else:
            u = np.asarray(units, dtype=np.int64)
            np.subtract.at(refs, u, 1)
            bad = np.unique(u[(refs[u] < 0) | (u == 0)])
            zero = np.unique(u[refs[u] == 0])
            zero = zero[led.allocated[zero] & (zero > 0)]
        if bad.size:
            led.refs[bad] = np.maximum(led.refs[bad], 0)
            self.pending.append(self._double_free(pool, bad, sid))
        if zero.size:
            eid = self._event("free", pool, zero.tolist(), sid)
            led.allocated[zero] = False
            led.last_free[zero] = eid
            # NOTE: said here, at the free, so one premature free is one use-after-free whether or not a
            # scan runs before the holder's own release takes the count below zero
            users = self._users(pool, zero)
            if users:
                f = self._unit_finding("use-after-free", pool, zero,
                                       f"{zero.size} block(s) freed (reference count 0) while "
                                       f"{', '.join(users[:3])} still referenced them")
                f.free_sites, f.used_by = self.site(sid), users
                self.pending.append(f)
        led.allocated[0] = True

    def on_free(self, pool: str, units, sid: int) -> None:
        """Record a free of ``units`` (a list or array); a unit already free, or listed twice, is a
        double free. In a ``"blocks"`` pool, a decrement of each unit's count (vLLM's ``free_blocks``)."""
        led = self.ledgers[pool]
        ul, flags = list(units) if type(units) is list else _as_list(units), led.flags  # (_as_list inline)
        if led.refs is not None:
            return self._unref(pool, ul, sid)
        if (len(ul) <= SMALL_EVENT and all(map(flags.__getitem__, ul)) and 0 not in ul
                and len(set(ul)) == len(ul)):
            # fast path: every unit allocated, and named once
            self._mark("free", pool, ul, sid, led, led.last_free, 0)
            return
        units = np.asarray(ul, dtype=np.int64)
        bad = units[~led.allocated[units]]
        if not units.all():  # freeing the reserved unit 0 is always wrong
            bad = np.union1d(bad, [0])
        if units.size > 1:
            srt = np.sort(units)
            dup = srt[1:][srt[1:] == srt[:-1]]
            if dup.size:
                bad = np.union1d(bad, dup)
        eid = self._event("free", pool, ul, sid)
        if bad.size:
            self.pending.append(self._double_free(pool, np.unique(bad), sid))
        led.allocated[units] = False
        led.last_free[units] = eid
        led.allocated[0] = True

    def _double_free(self, pool: str, bad: np.ndarray, sid: int) -> Finding:
        # a use-after-free named by the first free when a live owner still references the units, else
        # a double-free (docs/internals/audit.md, the ledger)
        prev = int(self.ledgers[pool].last_free[bad[0]])
        prev_sites = self.site(self.events[prev].site) if prev >= 0 else []
        again = self.site(sid)
        # the same line freeing twice is a double free whoever still maps the units
        users = ([] if prev < 0 or prev_sites[:1] == again[:1] else
                 self._group_users if self._group_users is not None else self._users(pool, bad))
        if users:
            f = self._unit_finding("use-after-free", pool, bad,
                                   f"{_units(bad.size)} freed while {', '.join(users[:3])} still referenced "
                                   f"{_them(bad.size)}; its release freed {_them(bad.size)} again")
            f.free_sites, f.read_sites, f.used_by = prev_sites, again, users
            f.lost_by = (self.target.freed_by(pool, bad[:1], np.array([prev], dtype=np.int64)) or [""])[0]
            return f
        f = self._unit_finding("double-free", pool, bad, f"{_units(bad.size)} freed while already free")
        f.free_sites, f.prev_free_sites = again, prev_sites
        return f

    def _users(self, pool: str, units: np.ndarray) -> list[str]:
        # the target's roots, and the owner (at the last check) of each allocated row that maps the units:
        # a request leaving the scheduler to be released is in no root, yet its record names them
        users: set[str] = set()
        try:
            named = self.target.users_of(pool, units)
            if named is not None:
                users.update(named)
            else:  # aborting requests too: their release is a use of what they map
                roots = [r for r in self.target.roots() if r.pool == pool]
                if roots and np.isin(np.concatenate([r.units for r in roots]), units).any():  # (one test: rarely)
                    users.update(r.owner for r in roots if np.isin(r.units, units).any())
            rows_led = self.ledgers.get("req_to_token_pool")
            of_rows = self.target.units_of_rows
            if rows_led is not None and pool != "req_to_token_pool" and of_rows(units[:0]) is not None:
                live = rows_led.allocated.copy()
                live[0] = False
                for row in np.flatnonzero(live & (rows_led.owner > 0)):
                    if np.isin(units, of_rows(np.array([row])).get(pool, units[:0])).any():
                        users.add(self.owner_names[int(rows_led.owner[row])])
        except Exception:  # noqa: BLE001 -- a half-updated record: no claim either way
            pass
        return sorted(users)

    def _unit_finding(self, kind: str, pool: str, units: np.ndarray, message: str,
                      alloc_sid: int | None = None) -> Finding:
        led = self.ledgers[pool]
        spec = led.spec
        units = np.sort(units)
        if alloc_sid is None:
            ev = int(led.last_alloc[units[0]])
            alloc_sid = self.events[ev].site if ev >= 0 else -1
        if spec.kind == "rows":
            unit, slots = "row", units.tolist()
        else:  # a pool counts in the unit it declares: blocks for a "blocks" pool (vLLM's), whatever their size
            unit = "block" if spec.kind == "blocks" else "page" if spec.page_size > 1 else "slot"
            slots = (units[:, None] * spec.page_size + np.arange(spec.page_size)).reshape(-1).tolist()
        return Finding(kind=kind, pool=pool, message=message, unit=unit, slots=slots, num_units=int(units.size),
                       alloc_sites=self.site(alloc_sid), owner_history=self.history(pool, int(units[0])),
                       op_index=self.op_index, step=self.step)

    def history(self, pool: str, unit: int):
        """Alloc, owner changes and free of ``unit``, in order, as :class:`OwnerChange` records."""
        out = []
        for ev in self.events:
            if ev.pool == pool and unit in ev.units:
                site = self.site(ev.site)
                who = self.site_owner(ev.site)
                out.append(OwnerChange(ev.op_index, ev.step, who or "-",
                                       f"{ev.kind} at {site[0].short() if site else '?'}"
                                       + (f" for {who}" if who else "")))
        for op_index, step, p, units, owners in self.owner_changes:
            if p == pool:
                hit = np.flatnonzero(units == unit)
                if hit.size:
                    out.append(OwnerChange(op_index, step, self.owner_names[int(owners[hit[0]])], "owner"))
        # owners are read at the end of a step, after its allocs and frees (the sort is stable)
        out.sort(key=lambda o: (o.step, o.op_index, o.event == "owner"))
        return out


def _units(n: int) -> str:
    return f"{n} unit" + "s" * (n != 1)


def _them(n: int) -> str:
    return "them" if n != 1 else "it"
