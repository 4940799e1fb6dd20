"""The lock-balance oracle (``lock-imbalance``): tree nodes locked more or less than their live
holders account for, blamed on the lock-ref ledger's open inc (:mod:`kvaudit.audit.locks`)."""

from __future__ import annotations

import numpy as np

from kvaudit.audit.findings import Finding
from kvaudit.audit.hooks import Auditor
from kvaudit.audit.locks import holder_kind
from kvaudit.targets.base import LockImbalance


def lock_balance(auditor: Auditor, target, idle: bool) -> list[Finding]:
    """``lock-imbalance``: a tree node locked more (or less) than its live holders account for (SGLang
    invariants 13 and 14); one finding per lock kind (device ``lock_ref``, host pins). It blames the
    lock-ref ledger's open inc whose holder is gone (``alloc_sites``, ``holder``, ``lost_sites``), else
    one no holder claimed, else the unmatched dec (``free_sites``). Busy (``idle`` false), only nodes
    locked *below* their live holders count, and, on a target whose ``lock_holders_exact`` holds, nodes
    locked above them under a lock the ledger saw its holder leave unreleased (``LockLedger.orphaned``)."""
    bad = [LockImbalance(*b) for b in target.lock_balance()]
    if not idle:
        orphaned = auditor.locks.orphaned() if getattr(target, "lock_holders_exact", False) else set()
        bad = [b for b in bad if b.lock_ref < b.holders or (
            orphaned and b.lock_ref > b.holders and any((b.lock, i) in orphaned for i in b.ids or ()))]
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
        f.holder, f.lost_sites = holder_kind(r.holder), auditor.site(auditor.locks.let_go(r))
        if r.holder is not None:
            taken = f"lock taken for {r.handed_from} at op {r.op}, step {r.step}, then held by {r.holder}" \
                if r.handed_from else f"lock taken for {r.holder} at op {r.op}, step {r.step}"
            f.message += (f"; {taken}; its holder was gone by op {r.gone[0]}, step {r.gone[1]} "
                          f"without a release" + (f" of it (its other lock was released in {f.lost_sites[0].function})"
                                                  if f.lost_sites else ""))
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
            f.alloc_sites, f.holder = auditor.site(r.site), holder_kind(r.holder or r.hint)
            f.message += (f"; {r.holder or r.hint} holds it, its lock taken at op {r.op}, step {r.step}"
                          f"{f' in {f.alloc_sites[0].function}' if f.alloc_sites else ''}")
        else:  # no live holder: the latest release that reached these nodes walked past their locks
            decs = [e for e in auditor.lock_events if e[0] in every and e[5] == lock and e[1] < 0]
            if decs:
                f.free_sites = auditor.site(decs[-1][2])
                f.message += f"; the latest release on them at op {decs[-1][3]}, step {decs[-1][4]}"
    return f
