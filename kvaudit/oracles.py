"""Oracles run after every scheduler step: reachability and the accounting identity.

Reachability is a mark and sweep over the target's roots, per pool, against the ledger:

* allocated but unreachable            -> ``leak``
* reachable but free in the ledger     -> ``use-after-free``
* privately owned by two roots         -> ``aliasing``

Leaks are *direct* or *indirect* (reachable only from a leaked request row), as in LeakSanitizer.

The accounting identity is SGLang's ``available + evictable + protected + session_held + uncached
== total`` (``invariant_checker.py``), with ``uncached`` and ``session_held`` taken from kvaudit's
own marks of live requests and session slots, never from the engine; each of the engine's terms
is also checked against the structure it describes (``available`` against the ledger,
``session_held`` against the session roots, and what the target's ``recount()`` gives: the tree's
``evictable``/``protected`` from its nodes' lock refs, host terms from host copies), since a sum
hides a counter booked in the wrong term. When one fails while reachability is clean -- or the
engine's own ``check_memory()`` or metrics fail while every kvaudit oracle is clean -- the finding
is ``accounting-drift``: a counter is wrong, memory is intact. Lock balance is checked at idle. Double frees, aliasing at allocation and stale KV come
from the hooks (:mod:`kvaudit.hooks`, :mod:`kvaudit.shadow`).
"""

from __future__ import annotations

import numpy as np

from kvaudit.findings import Finding
from kvaudit.hooks import Auditor


KIND_ORDER = ("use-after-free", "double-free", "stale-kv", "aliasing", "leak", "lock-imbalance", "accounting-drift",
              "liveness", "hang", "crash")


def check(auditor: Auditor, target, idle: bool = False, scan_only: bool = False) -> list[Finding]:
    """Run every oracle once; returns the findings, root causes first (a use-after-free before the
    leak it leaves behind). Also records owner changes in the ledger.

    ``idle``: the engine is quiescent, so lock balance is checked too (a leaked lock shows only
    once its holder is gone). ``scan_only``: use-after-free only, by requests not being aborted
    (the mid-step scan after intake; an aborted request's in-flight result releases it next).
    """
    findings: list[Finding] = []
    by_pool: dict[str, list] = {name: [] for name in auditor.ledgers}
    for root in (target.roots(aborting=False) if scan_only else target.roots()):
        by_pool[root.pool].append(root)
    acc = {} if scan_only else target.accounting()
    free_lists = target.free_lists() if not scan_only and hasattr(target, "free_lists") else {}
    recounts = target.recount() if not scan_only and hasattr(target, "recount") else {}
    leaked: dict[str, np.ndarray] = {}
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
        if not scan_only and (owner != led.owner).any():
            changed = np.flatnonzero(owner != led.owner)
            auditor.owner_changes.append((auditor.op_index, auditor.step, pool, changed, owner[changed]))
            led.owner = owner
        pool_findings = []
        if (led.allocated != referenced).any():
            uaf = np.flatnonzero(referenced & ~led.allocated)
            if uaf.size:
                pool_findings.extend(_group_by_site(auditor, "use-after-free", pool, uaf,
                                                    "referenced by a live owner but free in the ledger"))
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
                pool_findings.extend(_group_by_site(auditor, "aliasing", pool, alias,
                                                    "privately owned by more than one root"))
        a = acc.get(pool)
        if a is not None and not pool_findings and pool not in leaked:
            drift.extend(_identity(auditor, pool, led, a, req_units, session_units, recounts.get(pool, {})))
        if pool in free_lists and not pool_findings:
            drift.extend(_replay_free_list(auditor, pool, led, free_lists[pool]))
        findings.extend(pool_findings)
    findings.extend(_leaks(auditor, target, leaked))
    if not scan_only:
        if not findings:
            findings.extend(drift or _engine_disagrees(auditor, target))
        if idle:
            findings.extend(_lock_balance(auditor, target))
    findings.sort(key=lambda f: KIND_ORDER.index(f.kind) if f.kind in KIND_ORDER else len(KIND_ORDER))
    return attach_engine_verdict(target, findings)


def _units_count(units: list[np.ndarray], n: int) -> int:
    mark = np.zeros(n, dtype=bool)
    for u in units:
        mark[u] = True
    return int(np.count_nonzero(mark))


def _identity(auditor: Auditor, pool: str, led, a, req_units, session_units, recount=None) -> list[Finding]:
    """The accounting identity with kvaudit's own ``uncached`` and ``session_held``, and each of the
    engine's counters against the structure it describes: ``available`` against the units the ledger
    holds as free, ``session_held`` against the units session slots hold privately, and every term
    the target recounts (``recount``: ``{term: Recount}``, e.g. ``evictable``/``protected`` from the
    tree's nodes and lock refs) against its recount -- the identity adds ``evictable`` and
    ``protected`` together, so a leaf booked in the wrong one balances it. At most one finding, whose
    message gives every check that fails, the recounted counters first (they name the counter)."""
    ps, n = led.spec.page_size, led.allocated.size
    uncached = _units_count(req_units, n) * ps
    held = _units_count(session_units, n) * ps
    lines = []
    if recount:
        have = {term: getattr(a, term) for term in recount}
        if any(have[t] != r.tokens for t, r in recount.items()):
            lines += [f"{r.counter} counter {t}={have[t]} but {r.source} hold {r.tokens} tokens"
                      for t, r in recount.items() if have[t] != r.tokens]
            lines += [f"{t}={have[t]} matches {r.source}" for t, r in recount.items() if have[t] == r.tokens]
    free_units = (n - 1) - int(np.count_nonzero(led.allocated[1:]))
    if led.spec.kind == "kv" and a.available != free_units * ps:
        lines.append(f"the engine reports available={a.available} but the ledger holds {free_units * ps} slots free")
    if a.session_held != held:
        lines.append(f"the engine reports session_held={a.session_held} but session slots privately hold {held}")
    lhs = a.available + a.evictable + a.protected + held + uncached
    if lhs != a.total:
        lines.append(f"available={a.available} + evictable={a.evictable} + protected={a.protected} + "
                     f"session_held={held} + uncached={uncached} = {lhs} != total={a.total}, "
                     f"while every allocated unit is reachable")
    if not lines:
        return []
    return [Finding(kind="accounting-drift", pool=pool, unit="slot", message="; ".join(lines),
                    op_index=auditor.op_index, step=auditor.step)]


def _replay_free_list(auditor: Auditor, pool: str, led, free: np.ndarray) -> list[Finding]:
    """The engine's free list (``[n] int64`` units) against the replay of kvaudit's event log: a unit
    free in one and allocated in the other means a free or alloc path that bypasses the hooks (or a
    unit listed twice: an unrecorded double free)."""
    n = led.allocated.size
    listed = np.bincount(free[(free >= 0) & (free < n)], minlength=n)
    missing = np.flatnonzero(~led.allocated & (listed == 0))
    extra = np.flatnonzero(led.allocated & (listed > 0))
    twice = np.flatnonzero(listed > 1)
    if not (missing.size or extra.size or twice.size):
        return []
    return [Finding(kind="accounting-drift", pool=pool, unit="slot",
                    message=f"the engine's free list disagrees with the replay of the event log: {extra.size} unit(s) "
                            f"free in the list but allocated in the log, {missing.size} the other way, {twice.size} "
                            f"listed twice (a path that bypasses kvaudit's wrappers)",
                    op_index=auditor.op_index, step=auditor.step)]


def _engine_disagrees(auditor: Auditor, target) -> list[Finding]:
    """The engine's own ``check_memory()`` (and its metrics) fail while every kvaudit oracle is
    clean: the checker or a counter is wrong, memory is intact (``accounting-drift``)."""
    out = []
    for line in target.engine_check() + getattr(target, "metrics_check", lambda: [])():
        pool = line[1:line.index("]")] if line.startswith("[") else "-"
        out.append(Finding(kind="accounting-drift", pool=pool, unit="slot",
                           message=f"the engine's own check fails while memory is intact: {line}",
                           op_index=auditor.op_index, step=auditor.step))
    return out[:1]


def _leaks(auditor: Auditor, target, leaked: dict[str, np.ndarray]) -> list[Finding]:
    """Leaks, classified as LeakSanitizer does: units reachable only from a leaked row (the
    request's KV, buffers and host copies) are *indirect*; the rest are *direct*."""
    rows = leaked.get("req_to_token_pool")
    via_rows = target.units_of_rows(rows) if rows is not None and hasattr(target, "units_of_rows") else {}
    out = []
    for pool, units in leaked.items():
        held = via_rows.get(pool)
        indirect = units[np.isin(units, held)] if held is not None and held.size else units[:0]
        direct = np.setdiff1d(units, indirect)
        if direct.size:
            out.extend(_group_by_site(auditor, "leak", pool, direct, "allocated, unreachable from every root"))
        for f in (_group_by_site(auditor, "leak", pool, indirect, "reachable only from a leaked request row")
                  if indirect.size else []):
            f.indirect = True
            out.append(f)
    out.sort(key=lambda f: f.indirect)
    return out


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
    lines = [f"{node}: lock_ref={have} but {want} live holder(s)" for node, _, have, want, _ in bad]
    units = np.unique(np.concatenate([slots // ps for _, slots, _, _, _ in bad]))
    f = auditor._unit_finding("lock-imbalance", "token_to_kv_pool", units, "; ".join(lines))
    # the lock-ref ledger: the inc/dec events on the node (or below it: a lock covers the path)
    ids = bad[0][4]
    if ids is None:  # a lock the device ledger does not record (HiCache's host locks): the target counted it
        f.alloc_sites = []
        f.message += "; counted by the target per node (not in the device lock-ref ledger)"
        return [f]
    events = [e for e in auditor.lock_events if e[0] in ids]
    net: dict[int, int] = {}
    for nid, d, *_ in events:
        net[nid] = net.get(nid, 0) + d
    f.message += (f"; lock-ref ledger for it: {sum(e[1] > 0 for e in events)} inc, "
                  f"{sum(e[1] < 0 for e in events)} dec")
    # incs and decs pair up per node; the latest inc on a node left with a surplus is the suspect
    incs = [e for e in events if e[1] > 0 and net[e[0]] > 0]
    decs = [e for e in events if e[1] < 0 and net[e[0]] < 0]
    f.alloc_sites = []  # the unit's allocation site says nothing about a lock
    if incs:
        _, _, sid, op, step = incs[-1]
        f.alloc_sites = auditor.site(sid)
        f.message += f"; last unmatched inc at op {op}, step {step}"
    elif decs:
        _, _, sid, op, step = decs[-1]
        f.free_sites = auditor.site(sid)
        f.message += f"; last unmatched dec at op {op}, step {step}"
    else:
        f.message += ("; incs and decs pair up per node, so a lock and its release walked different paths "
                      "(the tree changed shape, or a lock started at the wrong node)")
    return [f]


def _group_by_site(auditor: Auditor, kind: str, pool: str, units: np.ndarray, msg: str) -> list[Finding]:
    """One finding per allocation site of ``units`` (LeakSanitizer groups by stack the same way)."""
    led = auditor.ledgers[pool]
    ev_ids = led.last_alloc[units]
    site_of_unit = np.array([auditor.events[e].site if e >= 0 else -1 for e in ev_ids.tolist()], dtype=np.int64)
    return [auditor._unit_finding(kind, pool, units[site_of_unit == sid], msg, alloc_sid=int(sid))
            for sid in np.unique(site_of_unit).tolist()]
