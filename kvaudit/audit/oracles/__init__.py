"""Oracles run after every scheduler step: reachability and the accounting identity.

Reachability is a mark and sweep over the target's roots, per pool, against the ledger:

* allocated but unreachable            -> ``leak``
* reachable but free in the ledger     -> ``use-after-free``
* privately owned by two roots         -> ``aliasing``

Leaks are *direct* or *indirect* (reachable only from a leaked request row), as in LeakSanitizer.

The accounting identity is the target's own (``Target.identity_terms``), by default SGLang's
``available + evictable + protected + session_held + uncached == total`` (``invariant_checker.py``),
with ``uncached`` and ``session_held`` taken from kvaudit's own marks of live requests and session
slots, never from the engine; each of the engine's terms
is also checked against the structure it describes (``available`` against the ledger,
``session_held`` against the session roots, and what the target's ``recount()`` gives: the tree's
``evictable``/``protected`` from its nodes' lock refs, host terms from host copies), since a sum
hides a counter booked in the wrong term. When one fails while reachability is clean -- or the
engine's own ``check_memory()`` or metrics fail while every kvaudit oracle is clean -- the finding
is ``accounting-drift``: a counter is wrong, memory is intact. Lock balance is checked at idle.
Double frees, aliasing at allocation and stale KV come from the hooks (:mod:`kvaudit.audit.hooks`,
:mod:`kvaudit.audit.shadow`).

:func:`check` is the mark and sweep, per pool, and calls each oracle, one per module: ``leaks``,
``use_after_free``, ``identity`` (and the free list and the engine's own check), ``lock_balance``,
``target`` (the target's own invariants); ``grouping`` groups units into findings by site.
"""

from __future__ import annotations

import numpy as np

from kvaudit.audit.findings import Finding
from kvaudit.audit.hooks import Auditor
from kvaudit.audit.kinds import ORDER
from kvaudit.audit.oracles.grouping import group_by_site
from kvaudit.audit.oracles.identity import engine_disagrees, identity, replay_free_list
from kvaudit.audit.oracles.leaks import leaks
from kvaudit.audit.oracles.lock_balance import lock_balance
from kvaudit.audit.oracles.target import target_findings
from kvaudit.audit.oracles.use_after_free import use_after_free
from kvaudit.targets.registry import TargetDefinitionError, kind_name

KIND_ORDER = ORDER  # root causes first (kvaudit.audit.kinds)


def check(auditor: Auditor, target, idle: bool = False, scan_only: bool = False) -> list[Finding]:
    """Run every oracle once; returns the findings, root causes first (a use-after-free before the
    leak it leaves behind). Also records owner changes in the ledger.

    ``idle``: the engine is quiescent, so lock balance is checked too (a leaked lock shows only
    once its holder is gone). ``scan_only``: use-after-free only, by requests not being aborted
    (the mid-step scan after intake; an aborted request's in-flight result releases it next).
    """
    findings: list[Finding] = []
    by_pool: dict[str, list] = {name: [] for name in auditor.ledgers}
    where: dict[int, str] = {}  # owner id -> where the target holds it (Root.where), for leak sites
    for root in (target.roots(aborting=False) if scan_only else target.roots()):
        mine = by_pool.get(root.pool)
        if mine is None:  # the target's mistake, not the engine's crash
            raise TargetDefinitionError(f"target {kind_name(target)}: a root of {root.owner} names pool {root.pool!r}, "
                                        f"which its pools() does not declare ({', '.join(by_pool)})")
        mine.append(root)
        if root.where:
            where[auditor.owner_id(root.owner)] = root.where
    acc = {} if scan_only else target.accounting()
    free_lists = {} if scan_only else target.free_lists()
    recounts = {} if scan_only else target.recount()
    leaked: dict[str, np.ndarray] = {}
    prev_owner: dict[str, np.ndarray] = {}  # each pool's owners as of the previous check
    drift: list[Finding] = []
    for pool, led in auditor.ledgers.items():
        n = led.allocated.size
        referenced = np.zeros(n, dtype=bool)
        private = np.zeros(n, dtype=bool)
        owner = np.zeros(n, dtype=np.int64)
        private_units, req_units, session_units = [], [], []
        for root in by_pool[pool]:
            referenced[root.units] = True
            if root.private:
                private_units.append(root.units)
                owner[root.units] = auditor.owner_id(root.owner)
                if root.role == "req":
                    req_units.append(root.units)
                elif root.role == "session":
                    session_units.append(root.units)
        referenced[0] = True  # the reserved unit reads as allocated in the ledger
        prev_owner[pool] = led.owner
        if not scan_only and (owner != led.owner).any():
            changed = np.flatnonzero(owner != led.owner)
            auditor.owner_changes.append((auditor.op_index, auditor.step, pool, changed, owner[changed]))
            led.owner = owner
        pool_findings = []
        if (led.allocated != referenced).any():
            uaf = np.flatnonzero(referenced & ~led.allocated)
            if uaf.size:
                pool_findings.extend(use_after_free(auditor, pool, uaf, by_pool[pool]))
            lost = np.flatnonzero(led.allocated & ~referenced)
            if lost.size and not scan_only:
                leaked[pool] = lost
        if private_units and not scan_only:
            cat = np.concatenate(private_units)
            private[cat] = True
            if private[0]:  # a row names the reserved unit 0: positions counted as allocated, never filled
                who = sorted({r.owner for r in by_pool[pool] if r.private and (r.units == 0).any()})
                last = next((e for e in reversed(auditor.events) if e.pool == pool and e.kind == "alloc"), None)
                pool_findings.append(auditor._unit_finding(  # located at the pool's latest allocation
                    "aliasing", pool, np.zeros(1, dtype=np.int64),
                    f"the reserved unit 0 (padding) is referenced by {', '.join(who[:3])}: positions its record "
                    "counts as allocated that no allocation filled (or another owner's writes displaced)",
                    alloc_sid=last.site if last is not None else None))
            elif np.count_nonzero(private) != cat.size:  # some unit is privately owned twice
                alias = np.flatnonzero(np.bincount(cat, minlength=n) > 1)
                pool_findings.extend(group_by_site(auditor, "aliasing", pool, alias,
                                                    "privately owned by more than one root"))
        a = acc.get(pool)
        if a is not None and not pool_findings and pool not in leaked:
            drift.extend(identity(auditor, pool, led, a, req_units, session_units, recounts.get(pool, {}),
                                   terms=target.identity_terms(pool), referenced=referenced))
        if pool in free_lists and not pool_findings:
            drift.extend(replay_free_list(auditor, pool, led, free_lists[pool]))
        findings.extend(pool_findings)
    findings.extend(leaks(auditor, target, leaked, prev_owner))
    if not scan_only:
        findings.extend(target_findings(auditor, target))
        auditor.checked_upto, auditor.owner_where, auditor.roots_at_check = len(auditor.events), where, by_pool
        if not findings:
            findings.extend(drift or engine_disagrees(auditor, target))
        # lock balance at idle; and, for a node locked below its holders, whenever the tree's
        # evictable/protected counters disagree with their recount, since a release too many shows
        # there first: the lock is the root cause and sorts before the drift
        if idle or any(f.kind == "accounting-drift" and f.check.startswith("counter:") and
                       ("evictable" in f.check or "protected" in f.check) for f in findings):
            findings.extend(lock_balance(auditor, target, idle))
    findings.sort(key=lambda f: KIND_ORDER.index(f.kind) if f.kind in KIND_ORDER else len(KIND_ORDER))
    return attach_engine_verdict(target, findings)


def attach_engine_verdict(target, findings: list[Finding]) -> list[Finding]:
    """Put the engine's own ``check_memory()`` verdict beside each finding; returns ``findings``."""
    if findings:
        verdict = target.engine_check() or ["engine check_memory(): ok"]
        for f in findings:
            f.engine_check = verdict
    return findings
