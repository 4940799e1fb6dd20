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

import torch

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
        n = led.allocated.numel()
        private = torch.zeros(n, dtype=torch.int64)
        referenced = torch.zeros(n, dtype=torch.bool)
        req_private = torch.zeros(n, dtype=torch.bool)
        owner = torch.zeros(n, dtype=torch.int64)
        for root in by_pool[pool]:
            u = root.units
            referenced[u] = True
            if root.private:
                private.index_add_(0, u, torch.ones_like(u))
                owner[u] = auditor.owner_id(root.owner)
                if root.role == "req":
                    req_private[u] = True
        referenced[0] = False
        changed = (owner != led.owner).nonzero().squeeze(1)
        if changed.numel():
            auditor.owner_changes.append((auditor.op_index, auditor.step, pool, changed, owner[changed]))
            led.owner = owner
        leaked = (led.allocated & ~referenced).nonzero().squeeze(1)
        leaked = leaked[leaked > 0]
        uaf = (referenced & ~led.allocated).nonzero().squeeze(1)
        alias = (private > 1).nonzero().squeeze(1)
        pool_findings = []
        for kind, units, msg in (("leak", leaked, "allocated, unreachable from every root"),
                                 ("use-after-free", uaf, "referenced by a live owner but free in the ledger"),
                                 ("aliasing", alias, "privately owned by more than one root")):
            if units.numel():
                pool_findings.extend(_group_by_site(auditor, kind, pool, units, msg))
        a = acc.get(pool)
        if a is not None and not pool_findings:
            unit_tokens = led.spec.page_size
            uncached = int(req_private.sum()) * unit_tokens
            lhs = a.available + a.evictable + a.protected + a.session_held + uncached
            if lhs != a.total:
                pool_findings.append(Finding(
                    kind="accounting-drift", pool=pool, unit="slot",
                    message=(f"available={a.available} + evictable={a.evictable} + protected={a.protected} + "
                             f"session_held={a.session_held} + uncached={uncached} = {lhs} != total={a.total}, "
                             f"while every allocated unit is reachable"),
                    op_index=auditor.op_index, step=auditor.step))
        findings.extend(pool_findings)
    if findings:
        verdict = target.engine_check()
        for f in findings:
            f.engine_check = verdict or ["engine check_memory(): ok"]
    return findings


def _group_by_site(auditor: Auditor, kind: str, pool: str, units: torch.Tensor, msg: str) -> list[Finding]:
    """One finding per allocation site of ``units`` (LeakSanitizer groups by stack the same way)."""
    led = auditor.ledgers[pool]
    ev_ids = led.last_alloc[units]
    sites = torch.tensor([auditor.events[int(e)].site if e >= 0 else -1 for e in ev_ids.unique().tolist()])
    ev_site = {int(e): int(s) for e, s in zip(ev_ids.unique().tolist(), sites.tolist())}
    site_of_unit = torch.tensor([ev_site[int(e)] for e in ev_ids.tolist()]) if units.numel() else sites
    out = []
    for sid in site_of_unit.unique().tolist():
        group = units[site_of_unit == sid]
        out.append(auditor._unit_finding(kind, pool, group, msg, alloc_sid=int(sid)))
    return out
