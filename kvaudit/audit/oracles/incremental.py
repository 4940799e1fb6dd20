"""Incremental ownership bookkeeping: a reference count and an owner per unit, kept from the target's
ownership deltas (:meth:`kvaudit.targets.base.Target.ownership_deltas`), so that a busy step's check
costs what the step changed, not the pool's size. A unit the deltas leave allocated and unreferenced,
referenced while free, or privately held twice is an *anomaly*: the full mark and sweep then runs and
reports it. Paranoid mode (``Auditor.paranoid``) sweeps at every step as well and raises
:class:`DeltaDisagreement` on any difference (a mistake in the deltas, never a finding).

Design notes (what is kept per pool, when it is rebuilt, :data:`MIN_UNITS`, :class:`LazyRoots`):
docs/internals/performance.md, "Incremental ownership bookkeeping".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvaudit.targets.base import PRIVATE_REQ, PRIVATE_SESSION, SHARED, Root
from kvaudit.targets.registry import TargetDefinitionError


#: below this many units in all pools together the full sweep is cheaper than the deltas (a dozen numpy
#: calls over small pools against several dozen: docs/internals/performance.md), so the busy check sweeps;
#: paranoid mode applies the deltas at any size
MIN_UNITS = 1 << 16


class DeltaDisagreement(TargetDefinitionError):
    """Paranoid mode: the incremental bookkeeping and the full mark and sweep disagree."""


@dataclass(slots=True)
class PoolCounts:
    """One pool's kept state: ``[n] int64`` counts per unit, and the units with a count (unit 0 out of
    ``n_ref``, as the identity's ``referenced`` term leaves it out)."""

    ref: np.ndarray  # root entries that reference the unit
    priv: np.ndarray  # of those, private ones (more than one: aliasing)
    req: np.ndarray  # private ones a live request holds (the identity's uncached)
    sess: np.ndarray  # private ones a session holds (the identity's session_held)
    n_ref: int = 0
    n_req: int = 0
    n_sess: int = 0

    def counts(self) -> tuple[int, int, int]:
        """``(uncached units, session units, referenced units)`` for the identity oracle."""
        return self.n_req, self.n_sess, self.n_ref


class Bookkeeping:
    """The kept state of every pool of one auditor, and the owners' places and roles."""

    def __init__(self, units: int):
        self.big = units >= MIN_UNITS  # worth keeping (MIN_UNITS): the pools' units together
        self.pools: dict[str, PoolCounts] = {}
        self.valid = False  # rebuilt by the last full check, and every check since was clean
        self.where: dict[str, str] = {}  # owner name -> Root.where, as of the last check
        self.last: tuple = (None, None)  # the last deltas' owner names and their ids

    # -- from the full sweep ---------------------------------------------------------------------
    def resync(self, auditor, by_pool: dict[str, list[Root]], where: dict[str, str]) -> None:
        """Rebuild every pool's counts from the roots of a full check (the ground truth)."""
        self.pools = {pool: _counts_of(by_pool.get(pool, []), led.allocated.size)
                      for pool, led in auditor.ledgers.items()}
        self.where = where
        self.valid = True

    # -- from the deltas ---------------------------------------------------------------------------
    def apply(self, auditor, deltas) -> bool:
        """Apply ``deltas`` (:class:`kvaudit.targets.base.OwnershipDeltas`) to the counts; True when no
        unit they or the events since the last check touched is an anomaly, in which case the owners
        are updated too (and their changes recorded); False leaves the owners as at the last check.
        Raises :class:`DeltaDisagreement` on a count taken below zero in paranoid mode (otherwise
        that is an anomaly: the full sweep runs)."""
        if deltas.owners != self.last[0]:  # (most steps name the same owners in the same order: ids kept)
            known = auditor._owner_ids.get  # owner_id per name, the common case inlined
            self.last = (deltas.owners, np.array([known(n) or auditor.owner_id(n) for n in deltas.owners] or [0],
                                                 dtype=np.int64))
        ids = self.last[1]
        touched = _event_units(auditor)
        clean, updates = True, []
        for pool, c in self.pools.items():
            entry = deltas.pools.get(pool)
            t = touched.get(pool)
            if entry is None and t is None:
                continue
            oi, units, sign, kind = entry if entry is not None else (_E, _E, _E, _E8)
            t = np.unique(units if t is None else np.concatenate([units, t]))
            ok = _apply_counts(c, t, units, sign, kind, auditor.paranoid, pool)
            clean = clean and ok and _consistent(c, t, auditor.ledgers[pool].allocated)
            updates.append((pool, t, units[(sign > 0) & (kind != SHARED)], ids[oi[(sign > 0) & (kind != SHARED)]]))
        self.where = deltas.where
        if clean:
            for pool, t, units, owners in updates:
                _set_owners(auditor, pool, self.pools[pool], t, units, owners)
        return clean

    # -- paranoid ------------------------------------------------------------------------------------
    def disagreement(self, auditor, by_pool: dict[str, list[Root]], clean: bool) -> str:
        """What the kept state (after :meth:`apply`) gets wrong against the full check's roots
        ``by_pool``; ``""`` when nothing. ``clean``: the incremental verdict, against the sweep's."""
        lines, full_anomaly = [], False
        for pool, led in auditor.ledgers.items():
            mine, truth = self.pools[pool], _counts_of(by_pool.get(pool, []), led.allocated.size)
            for what in ("ref", "priv", "req", "sess"):
                bad = np.flatnonzero(getattr(mine, what) != getattr(truth, what))
                if bad.size:
                    lines.append(f"{pool}: {what} count differs on {bad.size} unit(s), e.g. unit {int(bad[0])}: "
                                 f"kept {int(getattr(mine, what)[bad[0]])}, swept {int(getattr(truth, what)[bad[0]])}")
            if mine.counts() != truth.counts():
                lines.append(f"{pool}: kept (uncached, session, referenced) units {mine.counts()}, swept {truth.counts()}")
            full_anomaly = full_anomaly or not _consistent(truth, np.arange(led.allocated.size), led.allocated)
        if not lines and clean == full_anomaly:
            lines.append(f"the incremental check says {'clean' if clean else 'anomaly'}, the sweep "
                         f"{'anomaly' if full_anomaly else 'clean'}")
        return "; ".join(lines)

    def lazy_roots(self, auditor) -> "LazyRoots":
        """The private roots as of this check, built only when read (``Auditor.roots_at_check``).
        NOTE: holds the ledgers' owner arrays, not copies: a later clean check replaces this object
        before it changes them in place, and the full sweep gives the ledgers new arrays."""
        return LazyRoots(auditor, {pool: led.owner for pool, led in auditor.ledgers.items()})


class WhereByName:
    """``Auditor.owner_where`` (owner id -> place) read through the owners' names, O(1) to set."""

    def __init__(self, auditor, where: dict[str, str]):
        self.names, self.where = auditor.owner_names, where

    def get(self, oid: int, default=None):
        return self.where.get(self.names[oid], default) if 0 < oid < len(self.names) else default


class LazyRoots:
    """``Auditor.roots_at_check`` after an incremental check: each pool's *private* roots (a root per
    owner, from the owners kept at that check), materialized when first read. Shared references (a
    request's tree-owned prefix) are not kept per owner, so they are not among them."""

    def __init__(self, auditor, owners: dict[str, np.ndarray]):
        self.auditor, self.owners, self.built = auditor, owners, {}

    def get(self, pool: str, default=None):
        if pool not in self.owners:
            return default
        if pool not in self.built:
            owner = self.owners[pool]
            units = np.flatnonzero(owner)
            order = np.argsort(owner[units], kind='stable')  # (quoted so: not a finding kind)
            units, who = units[order], owner[units[order]]
            cuts = np.flatnonzero(np.diff(who)) + 1
            names = self.auditor.owner_names
            self.built[pool] = [Root(pool, names[int(w[0])], u, role=_role(names[int(w[0])]))
                                for u, w in zip(np.split(units, cuts), np.split(who, cuts)) if u.size]
        return self.built[pool]


def _role(owner: str) -> str:
    # a root's role from its owner's name (the names Root documents: req:<rid>, session:<sid>, tree)
    return "req" if owner.startswith("req:") else "session" if owner.startswith("session:") else ""


_E, _E8 = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int8)


def _counts_of(roots: list[Root], n: int) -> PoolCounts:
    def count(rs) -> np.ndarray:
        return np.bincount(np.concatenate([r.units for r in rs]), minlength=n) if rs else np.zeros(n, dtype=np.int64)

    priv = [r for r in roots if r.private]
    # (every unit once per root: the private count plus the shared one, each bincount over its own roots)
    c = PoolCounts(None, count(priv), count([r for r in priv if r.role == "req"]),
                   count([r for r in priv if r.role == "session"]))
    c.ref = c.priv + count([r for r in roots if not r.private]) if len(priv) < len(roots) else c.priv.copy()
    c.n_ref, c.n_req, c.n_sess = (int(np.count_nonzero(c.ref[1:])), int(np.count_nonzero(c.req)),
                                  int(np.count_nonzero(c.sess)))
    return c


def _event_units(auditor) -> dict[str, np.ndarray]:
    # pool -> the units allocated or freed since the last check
    got: dict[str, list] = {}
    for ev in auditor.events[auditor.checked_upto:]:
        got.setdefault(ev.pool, []).extend(ev.units)
    return {pool: np.asarray(us, dtype=np.int64) for pool, us in got.items()}


def _apply_counts(c: PoolCounts, t: np.ndarray, units, sign, kind, paranoid: bool, pool: str) -> bool:
    # the counts of touched units t, before and after, keep n_ref/n_req/n_sess; False on a negative count
    before = (c.ref[t] > 0, c.req[t] > 0, c.sess[t] > 0)
    np.add.at(c.ref, units, sign)
    priv = kind != SHARED
    np.add.at(c.priv, units[priv], sign[priv])
    for arr, k in ((c.req, PRIVATE_REQ), (c.sess, PRIVATE_SESSION)):
        m = kind == k
        np.add.at(arr, units[m], sign[m])
    after = (c.ref[t] > 0, c.req[t] > 0, c.sess[t] > 0)
    not0 = t != 0
    c.n_ref += int(np.count_nonzero(after[0] & not0)) - int(np.count_nonzero(before[0] & not0))
    c.n_req += int(np.count_nonzero(after[1])) - int(np.count_nonzero(before[1]))
    c.n_sess += int(np.count_nonzero(after[2])) - int(np.count_nonzero(before[2]))
    if t.size and min(c.ref[t].min(), c.priv[t].min(), c.req[t].min(), c.sess[t].min()) < 0:
        if paranoid:
            raise DeltaDisagreement(f"ownership deltas took a count of {pool} below zero (a unit lost by an owner "
                                    "that never gained it)")
        return False
    return True


def _consistent(c: PoolCounts, t: np.ndarray, allocated: np.ndarray) -> bool:
    # units t: referenced exactly when allocated (unit 0 reads as both), none privately held twice
    if c.priv[0] > 0:
        return False
    refd = c.ref[t] > 0
    refd[t == 0] = True
    return not np.count_nonzero(refd != allocated[t]) and not np.count_nonzero(c.priv[t] > 1)


def _set_owners(auditor, pool: str, c: PoolCounts, t: np.ndarray, units: np.ndarray, owners: np.ndarray) -> None:
    # the private owner of each touched unit (gains last; a unit no private root holds: nobody), and the
    # changes recorded as the full sweep records them
    led = auditor.ledgers[pool]
    old = led.owner[t]
    led.owner[units] = owners
    led.owner[t[c.priv[t] == 0]] = 0
    changed = np.flatnonzero(led.owner[t] != old)
    if changed.size:
        auditor.owner_changes.append((auditor.op_index, auditor.step, pool, t[changed], led.owner[t[changed]]))
