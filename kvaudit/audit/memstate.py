"""Who holds the memory: the lines an out-of-memory crash report shows ("Prefill/Decode out of
memory", as SGLang's ``alloc_for_extend``/``alloc_for_decode`` raise), read at the crash.

Design notes: docs/internals/audit.md.
"""

from __future__ import annotations

import re

import numpy as np

OOM = re.compile(r"out of memory", re.IGNORECASE)
TOP_HOLDERS = 5


def is_out_of_memory(message: str) -> bool:
    """Whether a crash message is the engine's out-of-memory (prefill, decode, any pool)."""
    return bool(OOM.search(message))


def memory_state(target, auditor=None) -> list[str]:
    """Plain lines describing who holds each pool's memory now: identity terms (tokens; rows for a row
    pool), the largest holders, locks with no live holder, the last retraction. ``auditor`` (or None)
    supplies page sizes and the lock-ref ledger. Never raises: a part that cannot be read says so."""
    lines: list[str] = []
    for part in (_terms, _holders, _orphan_locks, _retraction):
        try:
            lines += part(target, auditor)
        except Exception as exc:  # a report of a crash must not crash: say what could not be read
            lines.append(f"({part.__name__.strip('_')} unavailable: {type(exc).__name__}: {exc})")
    return lines


def _page_sizes(target, auditor) -> dict[str, int]:
    if auditor is not None:
        return {name: led.spec.page_size for name, led in auditor.ledgers.items()}
    return {spec.name: spec.page_size for spec in target.pools()}


def _by_owner(target, auditor) -> dict[str, dict[str, tuple[int, int]]]:
    # pool -> owner -> (tokens or rows it references, of which shared: a tree prefix it reads)
    ps = _page_sizes(target, auditor)
    units: dict[str, dict[str, tuple[list, list]]] = {}
    for root in target.roots():
        mine = units.setdefault(root.pool, {}).setdefault(root.owner, ([], []))
        mine[0 if root.private else 1].append(root.units)
    out: dict[str, dict[str, tuple[int, int]]] = {}
    for pool, owners in units.items():
        k = ps.get(pool, 1)
        out[pool] = {}
        for owner, (private, shared) in owners.items():
            every = np.unique(np.concatenate(private + shared))
            only_shared = np.setdiff1d(np.concatenate(shared + [every[:0]]), np.concatenate(private + [every[:0]]))
            out[pool][owner] = (int(every.size) * k, int(only_shared.size) * k)
    return out


def _terms(target, auditor) -> list[str]:
    ps = _page_sizes(target, auditor)
    uncached: dict[str, int] = {}
    marks: dict[str, list[np.ndarray]] = {}
    for root in target.roots():
        if root.private and root.role == "req":
            marks.setdefault(root.pool, []).append(root.units)
    for pool, us in marks.items():
        uncached[pool] = int(np.unique(np.concatenate(us)).size) * ps.get(pool, 1)
    out = []
    for pool, a in target.accounting().items():
        u = uncached.get(pool, 0)
        lhs = a.available + a.evictable + a.protected + a.session_held + u
        out.append(f"{pool}: available={a.available} evictable={a.evictable} protected={a.protected} "
                   f"session_held={a.session_held} uncached={u} (sum {lhs}) of total={a.total}")
    return out


def _holders(target, auditor) -> list[str]:
    out = []
    for pool, owners in _by_owner(target, auditor).items():
        spec = next((s for s in target.pools() if s.name == pool), None)
        if spec is None or spec.kind == "rows":
            continue
        top = sorted(owners.items(), key=lambda kv: (-kv[1][0], kv[0]))[:TOP_HOLDERS]
        if top:
            out.append(f"largest holders of {pool}: " + ", ".join(
                f"{o} {n} tokens" + (f" ({sh} of them a shared tree prefix)" if sh else "") for o, (n, sh) in top))
    return out


def _orphan_locks(target, auditor) -> list[str]:
    from kvaudit.targets.base import LockImbalance

    over = [b for b in map(lambda x: LockImbalance(*x), target.lock_balance()) if b.lock_ref > b.holders]
    if not over:
        return []
    out = []
    for lock in ("device", "host"):
        mine = [b for b in over if b.lock == lock]
        if not mine:
            continue
        tokens = int(np.unique(np.concatenate([b.slots for b in mine])).size)
        line = (f"locked with no live holder ({mine[0].pool}): {tokens} tokens on "
                + ", ".join(b.node for b in mine[:3]) + (" ..." if len(mine) > 3 else ""))
        if auditor is not None:
            auditor.lock_snapshot()
            ids = set().union(*(b.ids for b in mine if b.ids))
            culprits = auditor.locks.culprits(lock, ids)
            if culprits:
                r = culprits[0]
                site = auditor.site(r.site)
                where = f" at {site[0].short()}" if site else ""
                line += (f"; unreleased lock taken{f' for {r.holder}' if r.holder else ''}{where} "
                         f"(op {r.op}, step {r.step})")
        out.append(line)
    return out


def _retraction(target, auditor) -> list[str]:
    said = target.retraction()  # None: the target does not model retraction; "": none this run
    return [f"last retraction: {said}"] if said else (["last retraction: none this run"] if said is not None else [])
