"""Oracles: every check kvaudit makes of the engine, one row each in :data:`ORACLES` with the
condition under which it runs. :func:`check` is the mark and sweep over the target's roots after every
scheduler step (leak, use-after-free, aliasing, accounting drift, lock balance); the runner's own rows
judge the outcome of each engine call (:mod:`kvaudit.audit.oracles.outcome`).

Design notes (the oracles and when each runs): docs/internals/audit.md.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import numpy as np

from kvaudit.audit.findings import Finding
from kvaudit.audit.hooks import Auditor
from kvaudit.audit.kinds import KINDS, lookup
from kvaudit.audit.oracles.grouping import group_by_site
from kvaudit.audit.oracles.incremental import Bookkeeping, DeltaDisagreement, WhereByName
from kvaudit.audit.oracles.identity import engine_disagrees, identity, replay_free_list
from kvaudit.audit.oracles.idle import commit, idle_check, owners as idle_owners
from kvaudit.audit.oracles.leaks import leaks
from kvaudit.audit.oracles.lock_balance import lock_balance
from kvaudit.audit.oracles.outcome import attach_engine_verdict, crash, idle_hang, liveness, quiescence, watchdog_hang
from kvaudit.audit.oracles.target import target_findings
from kvaudit.audit.oracles.use_after_free import use_after_free
from kvaudit.config import json_value
from kvaudit.targets.registry import TargetDefinitionError, kind_name


@dataclass(slots=True)
class Scan:
    """What one check knows: the target's roots per pool, its accounting, free lists and recounts, the
    units each pool lost, each pool's owners at the previous check, the findings so far and the
    accounting drift held back until no other oracle finds anything."""

    auditor: Auditor
    target: object
    idle: bool
    scan_only: bool
    by_pool: dict
    acc: dict
    free_lists: dict
    recounts: dict
    leaked: dict = field(default_factory=dict)
    prev_owner: dict = field(default_factory=dict)
    findings: list = field(default_factory=list)
    drift: list = field(default_factory=list)


@dataclass(slots=True)
class PoolScan:
    """One pool's mark and sweep: which units the roots reference, and hold privately (a request's or a
    session's own too)."""

    pool: str
    led: object
    referenced: np.ndarray
    private_units: list
    req_units: list
    session_units: list
    uaf: np.ndarray | None = None  # the units it references that are free in the ledger, if any
    found: list = field(default_factory=list)  # this pool's findings so far
    # an incremental check's (uncached, session, referenced) unit counts (referenced is then None)
    counts: tuple[int, int, int] | None = None


class Oracle(NamedTuple):
    """One oracle: ``run`` gives its findings, ``when`` says whether it runs (both take the same
    arguments, by ``stage``); ``into``: ``"findings"``, or ``"drift"`` (kept back, reported only when no
    other oracle finds anything); ``emits``: the finding kinds it can raise (rows of :mod:`kvaudit.audit.kinds`)."""

    name: str
    # in check(), taking the Scan: "pool" (and each pool's PoolScan), once per pool inside the mark and
    # sweep; "engine", once after it. In the runner, taking the AuditedRun: "intake" (the engine took its
    # messages), "step" (a step found nothing), "idle" (idle() did not drain), "timeout" (the watchdog
    # interrupted an engine call; and its stack), "raise" (an engine call raised; and the exception)
    stage: str
    when: Callable[..., bool]
    run: Callable[..., list]
    emits: tuple[str, ...]
    into: str = "findings"


def _aliasing(s: Scan, p: PoolScan) -> list[Finding]:
    # NOTE: the sweep's owner marks (p.led.owner, made by this check: aliasing runs only when not
    # scan_only) already tell the common case: as many owned units as private units, unit 0 unowned, means
    # no unit is owned twice. Anything else (an owner id 0 included) takes the exact count below
    if not p.led.owner[0] and np.count_nonzero(p.led.owner) == sum(u.size for u in p.private_units):
        return []
    auditor, pool, roots = s.auditor, p.pool, s.by_pool[p.pool]
    private = np.zeros(p.referenced.size, dtype=bool)
    cat = np.concatenate(p.private_units)
    private[cat] = True
    if private[0]:  # a row names the reserved unit 0: positions counted as allocated, never filled
        who = sorted({r.owner for r in roots if r.private and (r.units == 0).any()})
        last = next((e for e in reversed(auditor.events) if e.pool == pool and e.kind == "alloc"), None)
        return [auditor._unit_finding(  # located at the pool's latest allocation
            "aliasing", pool, np.zeros(1, dtype=np.int64),
            f"the reserved unit 0 (padding) is referenced by {', '.join(who[:3])}: positions its record "
            "counts as allocated that no allocation filled (or another owner's writes displaced)",
            alloc_sid=last.site if last is not None else None)]
    if np.count_nonzero(private) != cat.size:  # some unit is privately owned twice
        alias = np.flatnonzero(np.bincount(cat, minlength=p.referenced.size) > 1)
        return group_by_site(auditor, "aliasing", pool, alias, "privately owned by more than one root")
    return []


def _tree_counter_drift(s: Scan) -> bool:
    # a node locked below its holders shows first as the tree's evictable/protected counters drifting
    return any(f.kind == "accounting-drift" and f.check.startswith("counter:") and
               ("evictable" in f.check or "protected" in f.check) for f in s.findings)


def _orphaned_lock(s: Scan) -> bool:
    # a lock whose holder left without its release, on a target that names every holder: the lock balance
    # need not wait for idle (the ledger pairs holders only where it is asked to: a check after every step)
    return getattr(s.target, "lock_holders_exact", False) and s.auditor.pair_locks and bool(s.auditor.locks.orphaned())


# Every oracle, in the order they run (the order of findings within a kind); check() reads only this.
ORACLES: list[Oracle] = [
    Oracle("use-after-free", "pool", lambda s, p: p.uaf is not None,
           lambda s, p: use_after_free(s.auditor, p.pool, p.uaf, s.by_pool[p.pool]), ("use-after-free",)),
    Oracle("aliasing", "pool", lambda s, p: bool(p.private_units) and not s.scan_only, _aliasing, ("aliasing",)),
    Oracle("identity", "pool", lambda s, p: s.acc.get(p.pool) is not None and not p.found and p.pool not in s.leaked,
           lambda s, p: identity(s.auditor, p.pool, p.led, s.acc[p.pool], p.req_units, p.session_units,
                                 s.recounts.get(p.pool, {}), terms=s.target.identity_terms(p.pool),
                                 referenced=p.referenced, counts=p.counts), ("accounting-drift",), into="drift"),
    Oracle("free-list", "pool", lambda s, p: p.pool in s.free_lists and not p.found,
           lambda s, p: replay_free_list(s.auditor, p.pool, p.led, s.free_lists[p.pool]), ("accounting-drift",),
           into="drift"),
    Oracle("leaks", "engine", lambda s: True, lambda s: leaks(s.auditor, s.target, s.leaked, s.prev_owner, s.by_pool),
           ("leak",)),
    Oracle("target", "engine", lambda s: not s.scan_only, lambda s: target_findings(s.auditor, s.target),
           KINDS),  # a target's own invariants may raise any kind
    Oracle("engine-check", "engine", lambda s: not s.scan_only and not s.findings,
           lambda s: s.drift or engine_disagrees(s.auditor, s.target), ("accounting-drift",)),
    Oracle("lock-balance", "engine", lambda s: not s.scan_only and (s.idle or _tree_counter_drift(s) or _orphaned_lock(s)),
           lambda s: lock_balance(s.auditor, s.target, s.idle), ("lock-imbalance",)),
    Oracle("quiescence", "intake", lambda run: run.target.flushed() != run.flushes_checked, quiescence, ("leak",)),
    Oracle("liveness", "step", lambda run: run.run_oracles, liveness, ("liveness",)),
    Oracle("idle-hang", "idle", lambda run: True, idle_hang, ("hang", "lock-imbalance")),
    Oracle("watchdog-hang", "timeout", lambda run, stack: True, watchdog_hang, ("hang",)),
    # the target's own code breaking the API is not the engine's crash: the runner raises that
    Oracle("crash", "raise", lambda run, exc: not isinstance(exc, TargetDefinitionError), crash, ("crash",)),
]


def paranoid_default() -> bool:
    """Whether runs are paranoid unless told otherwise: ``KVAUDIT_PARANOID=1`` (``--paranoid`` sets it, so
    that a search's worker processes inherit it)."""
    return os.environ.get("KVAUDIT_PARANOID", "") not in ("", "0")


_staged: tuple[list, int, dict[str, list[Oracle]]] = ([], 0, {})


def rows(stage: str) -> list[Oracle]:
    """The rows of :data:`ORACLES` of ``stage``, in order."""
    global _staged
    # NOTE: asked before every step: the split is cached until ORACLES is replaced or grows
    if _staged[0] is not ORACLES or _staged[1] != len(ORACLES):
        _staged = (ORACLES, len(ORACLES), {})
        for o in ORACLES:
            _staged[2].setdefault(o.stage, []).append(o)
    return _staged[2].get(stage, [])


def check(auditor: Auditor, target, idle: bool = False, scan_only: bool = False) -> list[Finding]:
    """Run every ``"pool"`` and ``"engine"`` oracle of :data:`ORACLES` whose condition holds, once;
    returns the findings, root causes first. Also records owner changes in the ledger. ``idle``: the
    engine is quiescent (lock balance is checked). ``scan_only``: use-after-free only, by requests not
    being aborted (the scan after intake). A busy check of a target that gives ownership deltas runs
    from the kept counts (:mod:`kvaudit.audit.oracles.incremental`) while they are clean; the full mark
    and sweep runs otherwise, at idle, and beside it in paranoid mode (``auditor.paranoid``), which
    raises :class:`~kvaudit.audit.oracles.incremental.DeltaDisagreement` on any difference. Runs inside
    the target's ``checking()`` context (:meth:`kvaudit.targets.base.Target.checking`)."""
    with target.checking():
        return _check(auditor, target, idle, scan_only)


def _check(auditor: Auditor, target, idle: bool, scan_only: bool) -> list[Finding]:
    if scan_only:
        return _full_check(auditor, target, False, True)[0]
    if auditor.bookkeeping is None:
        auditor.bookkeeping = Bookkeeping(sum(led.allocated.size for led in auditor.ledgers.values()))
    bk = auditor.bookkeeping
    quick = idle_check(auditor, target) if idle and not bk.big else None
    if quick is not None and not auditor.paranoid:
        bk.valid = False  # (as after the full sweep below this size: the next busy check sweeps)
        if quick[0]:
            commit(auditor, quick[1])
            return []
        return _full_check(auditor, target, idle, False)[0]  # (the findings, by the full check)
    exact = auditor.paranoid or idle or not bk.valid  # (the full sweep rebuilds the kept state below)
    deltas = target.ownership_deltas(exact) if bk.big or auditor.paranoid else None
    if deltas is None:
        bk.valid = False
        found = _full_check(auditor, target, idle, False)[0]
        if quick is not None:
            _idle_agrees(auditor, target, quick, found)
        return found
    clean = bk.apply(auditor, deltas) if bk.valid and (auditor.paranoid or not idle) else None
    if clean and not idle and not auditor.paranoid:
        found = _incremental_check(auditor, target, bk)
    else:
        found, by_pool, where = _full_check(auditor, target, idle, False)
        if clean is not None and auditor.paranoid:
            wrong = bk.disagreement(auditor, by_pool, clean)
            if where != bk.where:
                wrong += f"; the owners' places differ: kept {_differing(bk.where, where)}"
            if wrong:
                raise DeltaDisagreement(f"target {kind_name(target)}: paranoid check at op {auditor.op_index}, step "
                                        f"{auditor.step}: the ownership deltas disagree with the full sweep: "
                                        f"{wrong.lstrip('; ')}")
        if quick is not None:
            _idle_agrees(auditor, target, quick, found)
        bk.resync(auditor, by_pool, where)
        if not exact:
            # an anomaly in a busy check: the target's copy brought up to the roots just swept (a write it
            # did not look for is in them); the engine has not moved since, so nothing else is in these
            target.ownership_deltas(True)
    bk.valid = not found
    return found


def _idle_agrees(auditor: Auditor, target, quick: tuple, found: list[Finding]) -> None:
    # paranoid: the idle check's verdict and owners (read before the full check ran) against the full check's
    clean, got = quick
    wrong = [] if clean == (not found) else [f"the idle check says {'clean' if clean else 'not clean'}, the full "
                                             f"check found {len(found)} finding(s)"]
    if clean and not found:
        wrong += [f"{pool}'s owners differ at units {np.flatnonzero(owner != auditor.ledgers[pool].owner)[:5].tolist()}"
                  for pool, owner in idle_owners(auditor, got).items() if np.count_nonzero(owner != auditor.ledgers[pool].owner)]
    if wrong:
        raise DeltaDisagreement(f"target {kind_name(target)}: paranoid check at op {auditor.op_index}, step "
                                f"{auditor.step}: the idle check disagrees with the full sweep: {'; '.join(wrong)}")


def _differing(kept: dict, swept: dict) -> str:
    keys = sorted(k for k in set(kept) | set(swept) if kept.get(k) != swept.get(k))
    return ", ".join(f"{k}: {kept.get(k)!r} (swept {swept.get(k)!r})" for k in keys[:3])


def _full_check(auditor: Auditor, target, idle: bool, scan_only: bool) -> tuple[list[Finding], dict, dict]:
    # the mark and sweep over every root; also returns the roots by pool and the owners' places by name
    by_pool: dict[str, list] = {name: [] for name in auditor.ledgers}
    where: dict[str, str] = {}  # owner -> where the target holds it (Root.where), for leak sites
    ids: dict[int, str] = {}  # the same by owner id
    for root in (target.roots(aborting=False) if scan_only else target.roots()):
        mine = by_pool.get(root.pool)
        if mine is None:  # the target's mistake, not the engine's crash
            raise TargetDefinitionError(f"target {kind_name(target)}: a root of {root.owner} names pool {json_value(root.pool)}, "
                                        f"which its pools() does not declare ({', '.join(by_pool)})")
        mine.append(root)
        if root.where:
            where[root.owner] = ids[auditor.owner_id(root.owner)] = root.where
    s = Scan(auditor, target, idle, scan_only, by_pool, {} if scan_only else target.accounting(),
             {} if scan_only else target.free_lists(), {} if scan_only else target.recount())
    _run(s, [(lambda pool=pool, led=led: _sweep(s, pool, led)) for pool, led in auditor.ledgers.items()])
    if not scan_only:  # what the next check's leak and use-after-free attribution start from
        auditor.checked_upto, auditor.owner_where, auditor.roots_at_check = len(auditor.events), ids, by_pool
    s.findings.sort(key=lambda f: lookup(f.kind).rank)
    return attach_engine_verdict(target, s.findings), by_pool, where


def _incremental_check(auditor: Auditor, target, bk: Bookkeeping) -> list[Finding]:
    # a busy check from the kept counts (clean: no unit to sweep for); every other oracle as in the full one
    s = Scan(auditor, target, False, False, {name: [] for name in auditor.ledgers}, target.accounting(),
             target.free_lists(), target.recount())

    def pool_scan(pool: str, led) -> PoolScan:
        s.prev_owner[pool] = led.owner
        return PoolScan(pool, led, None, [], [], [], counts=bk.pools[pool].counts())

    _run(s, [(lambda pool=pool, led=led: pool_scan(pool, led)) for pool, led in auditor.ledgers.items()])
    auditor.checked_upto = len(auditor.events)
    auditor.owner_where, auditor.roots_at_check = WhereByName(auditor, bk.where), bk.lazy_roots(auditor)
    s.findings.sort(key=lambda f: lookup(f.kind).rank)
    return attach_engine_verdict(target, s.findings)


def _run(s: Scan, scans: list) -> None:
    # every "pool" oracle on each pool's scan (scans: made in order, as each pool is reached), then every "engine" one
    per_pool = rows("pool")
    for make in scans:
        p = make()
        for oracle in per_pool:
            if oracle.when(s, p):
                (s.drift if oracle.into == "drift" else p.found).extend(oracle.run(s, p))
        s.findings.extend(p.found)
    for oracle in rows("engine"):
        if oracle.when(s):
            (s.drift if oracle.into == "drift" else s.findings).extend(oracle.run(s))


def _sweep(s: Scan, pool: str, led) -> PoolScan:
    auditor = s.auditor
    n = led.allocated.size
    referenced = np.zeros(n, dtype=bool)
    owner = np.zeros(n, dtype=np.int64)
    private_units, req_units, session_units = [], [], []
    for root in s.by_pool[pool]:
        referenced[root.units] = True
        if root.private:
            private_units.append(root.units)
            owner[root.units] = auditor.owner_id(root.owner)
            if root.role == "req":
                req_units.append(root.units)
            elif root.role == "session":
                session_units.append(root.units)
    referenced[0] = True  # the reserved unit reads as allocated in the ledger
    s.prev_owner[pool] = led.owner
    # NOTE: runs for every pool after every step: np.count_nonzero and .nonzero() cost a fraction of
    # ndarray.any() and np.flatnonzero (Python-level wrappers)
    if not s.scan_only:
        changed = (owner != led.owner).nonzero()[0]
        if changed.size:
            auditor.owner_changes.append((auditor.op_index, auditor.step, pool, changed, owner[changed]))
            led.owner = owner
    uaf = None
    if np.count_nonzero(led.allocated != referenced):  # (most checks: the roots reach exactly the allocated units)
        uaf = (referenced & ~led.allocated).nonzero()[0]
        uaf = uaf if uaf.size else None
        lost = (led.allocated & ~referenced).nonzero()[0]
        if lost.size and not s.scan_only:
            s.leaked[pool] = lost
    return PoolScan(pool, led, referenced, private_units, req_units, session_units, uaf)

