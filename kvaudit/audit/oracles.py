"""Oracles run after every scheduler step: reachability and the accounting identity.

Reachability is a mark and sweep over the target's roots, per pool, against the ledger:

* allocated but unreachable            -> ``leak``
* reachable but free in the ledger     -> ``use-after-free``
* privately owned by two roots         -> ``aliasing``

Leaks are *direct* or *indirect* (reachable only from a leaked request row), as in LeakSanitizer.

The accounting identity is the target's own (``Target.identity_terms``), by default SGLang's
``available + evictable + protected + session_held + uncached == total`` (``invariant_checker.py``), with ``uncached`` and ``session_held`` taken from kvaudit's
own marks of live requests and session slots, never from the engine; each of the engine's terms
is also checked against the structure it describes (``available`` against the ledger,
``session_held`` against the session roots, and what the target's ``recount()`` gives: the tree's
``evictable``/``protected`` from its nodes' lock refs, host terms from host copies), since a sum
hides a counter booked in the wrong term. When one fails while reachability is clean -- or the
engine's own ``check_memory()`` or metrics fail while every kvaudit oracle is clean -- the finding
is ``accounting-drift``: a counter is wrong, memory is intact. Lock balance is checked at idle. Double frees, aliasing at allocation and stale KV come
from the hooks (:mod:`kvaudit.audit.hooks`, :mod:`kvaudit.audit.shadow`).
"""

from __future__ import annotations

import numpy as np

from kvaudit.audit.findings import Finding
from kvaudit.audit.kinds import ORDER
from kvaudit.audit.hooks import Auditor
from kvaudit.targets.base import DEFAULT_IDENTITY, LockImbalance


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
        by_pool[root.pool].append(root)
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
                pool_findings.extend(_use_after_free(auditor, pool, uaf, by_pool[pool]))
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
            drift.extend(_identity(auditor, pool, led, a, req_units, session_units, recounts.get(pool, {}),
                                   terms=target.identity_terms(pool), referenced=referenced))
        if pool in free_lists and not pool_findings:
            drift.extend(_replay_free_list(auditor, pool, led, free_lists[pool]))
        findings.extend(pool_findings)
    findings.extend(_leaks(auditor, target, leaked, prev_owner))
    if not scan_only:
        findings.extend(_target_findings(auditor, target))
        auditor.checked_upto, auditor.owner_where = len(auditor.events), where
        if not findings:
            findings.extend(drift or _engine_disagrees(auditor, target))
        # lock balance at idle; and, for a node locked below its holders, whenever the tree's
        # evictable/protected counters disagree with their recount, since a release too many shows
        # there first: the lock is the root cause and sorts before the drift
        if idle or any(f.kind == "accounting-drift" and f.check.startswith("counter:") and
                       ("evictable" in f.check or "protected" in f.check) for f in findings):
            findings.extend(_lock_balance(auditor, target, idle))
    findings.sort(key=lambda f: KIND_ORDER.index(f.kind) if f.kind in KIND_ORDER else len(KIND_ORDER))
    return attach_engine_verdict(target, findings)


def _target_findings(auditor: Auditor, target) -> list[Finding]:
    """The target's own invariant violations (:meth:`kvaudit.targets.base.Target.invariant_findings`)
    as findings, located at the latest allocation of their first unit."""
    out = []
    for t in target.invariant_findings():
        units = np.asarray(t.units, dtype=np.int64).reshape(-1)
        f = auditor._unit_finding(t.kind, t.pool, units if units.size else np.zeros(1, np.int64), t.message)
        f.check = t.check
        out.append(f)
    return out


def _units_count(units: list[np.ndarray], n: int) -> int:
    mark = np.zeros(n, dtype=bool)
    for u in units:
        mark[u] = True
    return int(np.count_nonzero(mark))


def _identity(auditor: Auditor, pool: str, led, a, req_units, session_units, recount=None,
              terms: tuple[str, ...] = DEFAULT_IDENTITY, referenced: np.ndarray | None = None) -> list[Finding]:
    """The accounting identity with kvaudit's own ``uncached`` and ``session_held``, and each of the
    engine's counters against the structure it describes: ``available`` against the units the ledger
    holds as free, ``session_held`` against the units session slots hold privately, and every term
    the target recounts (``recount``: ``{term: Recount}``, e.g. ``evictable``/``protected`` from the
    tree's nodes and lock refs) against its recount -- the identity adds ``evictable`` and
    ``protected`` together, so a leaf booked in the wrong one balances it. At most one finding, whose
    message gives every check that fails, the recounted counters first (they name the counter).
    ``terms``: the target's identity (:meth:`kvaudit.targets.base.Target.identity_terms`);
    ``referenced``: ``[n] bool``, the units some root references (the ``referenced`` term)."""
    ps, n = led.spec.page_size, led.allocated.size
    uncached = _units_count(req_units, n) * ps
    held = _units_count(session_units, n) * ps
    lines, checks = [], []
    if recount:
        have = {term: getattr(a, term) for term in recount}
        wrong = [t for t, r in recount.items() if have[t] != r.tokens]
        if wrong:
            lines += [f"{recount[t].counter} counter {t}={have[t]} but {recount[t].source} hold "
                      f"{recount[t].tokens} tokens" for t in wrong]
            lines += [f"{t}={have[t]} matches {r.source}" for t, r in recount.items() if t not in wrong]
            checks.append("counter:" + ",".join(sorted(wrong)))
    free_units = (n - 1) - int(np.count_nonzero(led.allocated[1:]))
    if led.spec.kind == "kv" and a.available != free_units * ps:
        lines.append(f"the engine reports available={a.available} but the ledger holds {free_units * ps} slots free")
        checks.append("counter:available")
    if a.session_held != held:
        lines.append(f"the engine reports session_held={a.session_held} but session slots privately hold {held}")
        checks.append("counter:session_held")
    def term(t: str) -> int:
        if t == "referenced":
            return int(np.count_nonzero(referenced[1:])) * ps if referenced is not None else 0
        return held if t == "session_held" else uncached if t == "uncached" else getattr(a, t)

    # (the default identity summed directly: this runs after every step of every program)
    lhs = (a.available + a.evictable + a.protected + held + uncached if terms is DEFAULT_IDENTITY
           else sum(term(t) for t in terms))
    if lhs != a.total:
        values = [(t, term(t)) for t in terms]
        lines.append(" + ".join(f"{t}={v}" for t, v in values) + f" = {lhs} != total={a.total}, "
                     "while every allocated unit is reachable")
        checks.append("identity")
    if not lines:
        return []
    return [Finding(kind="accounting-drift", pool=pool, unit="slot", message="; ".join(lines),
                    op_index=auditor.op_index, step=auditor.step, check=checks[0])]


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
                    op_index=auditor.op_index, step=auditor.step, check="free_list")]


def _engine_disagrees(auditor: Auditor, target) -> list[Finding]:
    """The engine's own ``check_memory()`` (and its metrics) fail while every kvaudit oracle is
    clean: the checker or a counter is wrong, memory is intact (``accounting-drift``)."""
    out = []
    for line in target.engine_check() + target.metrics_check():
        pool = line[1:line.index("]")] if line.startswith("[") else "-"
        out.append(Finding(kind="accounting-drift", pool=pool, unit="slot",
                           message=f"the engine's own check fails while memory is intact: {line}",
                           op_index=auditor.op_index, step=auditor.step, check="engine_check"))
    return out[:1]


def _leaks(auditor: Auditor, target, leaked: dict[str, np.ndarray],
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
            out.extend(_group_by_site(auditor, "leak", pool, direct, "allocated, unreachable from every root",
                                      second=lost))
        for f in (_group_by_site(auditor, "leak", pool, indirect, "reachable only from a leaked request row",
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


def _use_after_free(auditor: Auditor, pool: str, units: np.ndarray, roots) -> list[Finding]:
    """Units a live owner references while the ledger holds them free: one finding per (allocation
    site, free site), naming the free that came too early and the owners still using the units."""
    led = auditor.ledgers[pool]
    free_site = {u: (auditor.events[e].site if e >= 0 else -1, "")
                 for u, e in zip(units.tolist(), led.last_free[units].tolist())}
    out = _group_by_site(auditor, "use-after-free", pool, units, "referenced by a live owner but free in the ledger",
                         second=free_site, into="free_sites")
    for f in out:
        mine = np.asarray(f.slots if f.unit == "row" else sorted({s // led.spec.page_size for s in f.slots}),
                          dtype=np.int64)
        f.used_by = sorted({r.owner for r in roots if np.isin(r.units, mine).any()})
        if f.used_by:
            f.message += f" (still used by {', '.join(f.used_by[:3])})"
    return out


def attach_engine_verdict(target, findings: list[Finding]) -> list[Finding]:
    """Put the engine's own ``check_memory()`` verdict beside each finding; returns ``findings``."""
    if findings:
        verdict = target.engine_check() or ["engine check_memory(): ok"]
        for f in findings:
            f.engine_check = verdict
    return findings


def _lock_balance(auditor: Auditor, target, idle: bool = True) -> list[Finding]:
    """``lock-imbalance``: a tree node locked more (or less) than its live holders account for; one
    finding per lock kind (device ``lock_ref`` on ``token_to_kv_pool``, host pins on the host pool).

    A leaked lock keeps tokens ``protected`` forever: the identity still balances and eviction
    can never reclaim them, so admission eventually stalls (SGLang invariants 13 and 14). The
    finding blames, from the lock-ref ledger (:mod:`kvaudit.audit.locks`), the open inc whose holder is
    gone (its stack in ``alloc_sites``), else one no holder ever claimed, else the unmatched dec
    (``free_sites``). Busy (``idle`` false), only nodes locked *below* their live holders count: a
    lock taken ahead of its holder's record is normal mid-flight, a release too many never is.
    """
    bad = [LockImbalance(*b) for b in target.lock_balance()]
    if not idle:
        bad = [b for b in bad if b.lock_ref < b.holders]
    if not bad:
        return []
    auditor.lock_snapshot()
    out = []
    for lock in ("device", "host"):
        mine = [b for b in bad if b.lock == lock]
        if mine and mine[0].pool in auditor.ledgers:
            out.append(_lock_finding(auditor, lock, mine))
    return out


def _lock_finding(auditor: Auditor, lock: str, bad: list) -> Finding:
    pool = bad[0].pool
    ps = auditor.ledgers[pool].spec.page_size
    what = "lock_ref" if lock == "device" else "host_ref"
    lines = [f"{b.node}: {what}={b.lock_ref} but {b.holders} live holder(s)" for b in bad]
    units = np.unique(np.concatenate([b.slots // ps for b in bad]))
    f = auditor._unit_finding("lock-imbalance", pool, units, "; ".join(lines))
    f.alloc_sites = []  # the unit's allocation site says nothing about a lock
    ids = bad[0].ids
    if ids is None:  # a lock the ledger does not record: the target counted it
        f.message += "; counted by the target per node (not in the lock-ref ledger)"
        return f
    # the lock-ref ledger: the inc/dec events on the node (or below it: a lock covers the path)
    events = [e for e in auditor.lock_events if e[0] in ids and e[5] == lock]
    f.message += (f"; lock-ref ledger for it: {sum(e[1] > 0 for e in events)} inc, "
                  f"{sum(e[1] < 0 for e in events)} dec")
    culprits = auditor.locks.culprits(lock, ids)
    decs = [d for d in auditor.locks.unmatched_decs if d[0] == lock and d[1] in ids]
    if not decs:  # a dec that released a live holder's lock before its own release: net below zero
        net: dict[int, int] = {}
        for nid, d, *_ in events:
            net[nid] = net.get(nid, 0) + d
        decs = [(lock, nid, sid, op, step) for nid, d, sid, op, step, _ in events if d < 0 and net[nid] < 0]
    if decs and bad[0].lock_ref < bad[0].holders:  # released once too often: the dec is the cause
        culprits = []
    if culprits:
        r = culprits[0]
        f.alloc_sites = auditor.site(r.site)
        if r.holder is not None:
            taken = f"lock taken for {r.handed_from} at op {r.op}, step {r.step}, then held by {r.holder}" \
                if r.handed_from else f"lock taken for {r.holder} at op {r.op}, step {r.step}"
            f.message += (f"; {taken}; its holder was gone by op {r.gone[0]}, step {r.gone[1]} "
                          f"without a release")
        else:  # its holder, if any, came and went within one step: the inc's frames may still name it
            who = auditor.site_owner(r.site)
            f.message += (f"; lock taken{f' for {who}' if who else ''} at op {r.op}, step {r.step}"
                          f"{f' in {f.alloc_sites[0].function}' if f.alloc_sites else ''}"
                          " that no live holder was ever seen with")
        if len(culprits) > 1:
            f.message += f" (and {len(culprits) - 1} more unreleased)"
    elif decs:
        _, _, sid, op, step = decs[-1]
        f.free_sites = auditor.site(sid)
        f.message += f"; unmatched release at op {op}, step {step}"
    else:
        f.message += ("; incs and decs pair up per node, so a lock and its release walked different paths "
                      "(the tree changed shape, or a lock started at the wrong node)")
        f.check = "walk"
        every = set().union(*(b.ids or () for b in bad))
        r = auditor.locks.holder_lock(lock, every)
        if r is not None:  # the live holder's own lock: where the walk that missed this node began
            f.alloc_sites = auditor.site(r.site)
            f.message += (f"; {r.holder or r.hint} holds it, its lock taken at op {r.op}, step {r.step}"
                          f"{f' in {f.alloc_sites[0].function}' if f.alloc_sites else ''}")
        else:  # no live holder: the latest release that reached these nodes walked past their locks
            decs = [e for e in auditor.lock_events if e[0] in every and e[5] == lock and e[1] < 0]
            if decs:
                f.free_sites = auditor.site(decs[-1][2])
                f.message += f"; the latest release on them at op {decs[-1][3]}, step {decs[-1][4]}"
    return f


def _group_by_site(auditor: Auditor, kind: str, pool: str, units: np.ndarray, msg: str,
                   second: dict[int, tuple[int, str]] | None = None, into: str = "lost_sites") -> list[Finding]:
    """One finding per allocation site of ``units`` (LeakSanitizer groups by stack the same way) and,
    with ``second`` (unit -> (site id, where)), per second site and place too, recorded as the
    findings' ``into`` stack (``lost_sites``: where a leak lost its owner; ``free_sites``: a
    premature free) and ``lost_from``."""
    led = auditor.ledgers[pool]
    ev_ids = led.last_alloc[units]
    site_of_unit = [auditor.events[e].site if e >= 0 else -1 for e in ev_ids.tolist()]
    second = second or {}
    keys = [(a, *second.get(u, (-1, ""))) for a, u in zip(site_of_unit, units.tolist())]
    out = []
    for key in sorted(set(keys)):
        mine = units[np.array([k == key for k in keys])]
        f = auditor._unit_finding(kind, pool, mine, msg, alloc_sid=int(key[0]))
        setattr(f, into, auditor.site(int(key[1])))
        f.lost_from = key[2]
        out.append(f)
    return out
