"""Oracles run after every scheduler step: reachability and the accounting identity.

Reachability is a mark and sweep over the target's roots, per pool, against the ledger:

* allocated but unreachable            -> ``leak``
* reachable but free in the ledger     -> ``use-after-free``
* privately owned by two roots         -> ``aliasing``

The accounting identity is SGLang's ``available + evictable + protected + session_held + uncached
== total`` (``invariant_checker.py``), with ``uncached`` taken from kvaudit's own marks of live
requests, never from the engine. When it fails while reachability is clean, the finding is
``accounting-drift``: a counter is wrong, memory is intact. Double frees and aliasing at
allocation come from the hooks (:mod:`kvaudit.hooks`).
"""

from __future__ import annotations

import numpy as np

from kvaudit.findings import Finding
from kvaudit.hooks import Auditor


def check(auditor: Auditor, target) -> list[Finding]:
    """Run every oracle once; returns the findings (also records owner changes in the ledger)."""
    findings: list[Finding] = []
    by_pool: dict[str, list] = {name: [] for name in auditor.ledgers}
    for root in target.roots():
        by_pool[root.pool].append(root)
    acc = target.accounting()
    for pool, led in auditor.ledgers.items():
        n = led.allocated.size
        referenced = np.zeros(n, dtype=bool)
        private = np.zeros(n, dtype=bool)
        owner = np.zeros(n, dtype=np.int64)
        private_units, req_units = [], []
        for root in by_pool[pool]:
            referenced[root.units] = True
            if root.private:
                private_units.append(root.units)
                owner[root.units] = auditor.owner_id(root.owner)
                if root.role == "req":
                    req_units.append(root.units)
        referenced[0] = True  # the reserved unit reads as allocated in the ledger
        if (owner != led.owner).any():
            changed = np.flatnonzero(owner != led.owner)
            auditor.owner_changes.append((auditor.op_index, auditor.step, pool, changed, owner[changed]))
            led.owner = owner
        pool_findings = []
        if (led.allocated != referenced).any():
            for kind, units, msg in (
                    ("leak", np.flatnonzero(led.allocated & ~referenced), "allocated, unreachable from every root"),
                    ("use-after-free", np.flatnonzero(referenced & ~led.allocated),
                     "referenced by a live owner but free in the ledger")):
                if units.size:
                    pool_findings.extend(_group_by_site(auditor, kind, pool, units, msg))
        if private_units:
            cat = np.concatenate(private_units)
            private[cat] = True
            if np.count_nonzero(private) != cat.size:  # some unit is privately owned twice
                alias = np.flatnonzero(np.bincount(cat, minlength=n) > 1)
                pool_findings.extend(_group_by_site(auditor, "aliasing", pool, alias,
                                                    "privately owned by more than one root"))
        a = acc.get(pool)
        if a is not None and not pool_findings:
            req_private = np.zeros(n, dtype=bool)
            for u in req_units:
                req_private[u] = True
            uncached = int(np.count_nonzero(req_private)) * led.spec.page_size
            lhs = a.available + a.evictable + a.protected + a.session_held + uncached
            if lhs != a.total:
                pool_findings.append(Finding(
                    kind="accounting-drift", pool=pool, unit="slot",
                    message=(f"available={a.available} + evictable={a.evictable} + protected={a.protected} + "
                             f"session_held={a.session_held} + uncached={uncached} = {lhs} != total={a.total}, "
                             f"while every allocated unit is reachable"),
                    op_index=auditor.op_index, step=auditor.step))
        findings.extend(pool_findings)
    findings.extend(_lock_balance(auditor, target))
    return attach_engine_verdict(target, findings)


def attach_engine_verdict(target, findings: list[Finding]) -> list[Finding]:
    """Put the engine's own ``check_memory()`` verdict beside each finding; returns ``findings``."""
    if findings:
        verdict = target.engine_check() or ["engine check_memory(): ok"]
        for f in findings:
            f.engine_check = verdict
    return findings


def _lock_balance(auditor: Auditor, target) -> list[Finding]:
    """``lock-imbalance``: a tree node locked more (or less) than its live holders account for.

    A leaked lock keeps tokens ``protected`` forever: the identity still balances and eviction
    can never reclaim them, so admission eventually stalls (SGLang invariants 13 and 14).
    """
    balance = getattr(target, "lock_balance", None)
    bad = balance() if balance else []
    if not bad:
        return []
    led = auditor.ledgers["token_to_kv_pool"]
    ps = led.spec.page_size
    lines = [f"{node}: lock_ref={have} but {want} live holder(s)" for node, _, have, want in bad]
    units = np.unique(np.concatenate([slots // ps for _, slots, _, _ in bad]))
    f = auditor._unit_finding("lock-imbalance", "token_to_kv_pool", units, "; ".join(lines))
    return [f]


def _group_by_site(auditor: Auditor, kind: str, pool: str, units: np.ndarray, msg: str) -> list[Finding]:
    """One finding per allocation site of ``units`` (LeakSanitizer groups by stack the same way)."""
    led = auditor.ledgers[pool]
    ev_ids = led.last_alloc[units]
    site_of_unit = np.array([auditor.events[e].site if e >= 0 else -1 for e in ev_ids.tolist()], dtype=np.int64)
    return [auditor._unit_finding(kind, pool, units[site_of_unit == sid], msg, alloc_sid=int(sid))
            for sid in np.unique(site_of_unit).tolist()]
