"""The lock-ref ledger: every ``inc_lock_ref``/``dec_lock_ref`` (device) and host pin, paired with
the holder that took it (the target's ``lock_holders()``, read between steps and ops), so a
lock-imbalance finding blames the lock whose holder is gone.

Design notes (the pairing rules): docs/internals/audit.md.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass


def holder_kind(name: str | None) -> str:
    """The kind of the lock holder ``name`` when it is not a request, for a signature: ``"session:3"``
    -> ``"session"``, ``"hicache write-through of node 12"`` -> ``"hicache-write-through"``; ``""`` for
    a request (``"req:7"``), for a holder that acts for one (``"hicache load-back for req:7"``) and for
    None (whether the ledger saw a request hold a lock depends on timing)."""
    if not name:
        return ""
    head, sep, owner = name.partition(" for ")
    if sep:
        return holder_kind(owner)
    kind = "-".join(head.split(" of ", 1)[0].split(":", 1)[0].split())
    return "" if kind == "req" else kind


@dataclass(slots=True, eq=False)  # records are compared by identity: two incs can be alike in every field
class LockRecord:
    """One inc of ``lock`` (``"device"`` or ``"host"``) on tree node ``node``."""

    lock: str
    node: int
    site: int
    op: int
    step: int
    holder: str | None = None  # once a holder claimed it
    gone: tuple[int, int] | None = None  # (op, step) at which its holder was first seen gone
    released: bool = False  # a dec paired with it
    handed_from: str | None = None  # the holder it was taken over from (no inc of its own)
    hint: str | None = None  # the owner the taking frames worked for (``req:<rid>``), if they named one
    gone_in: int = -1  # the interval (LockLedger.intervals) in which its holder was first seen gone
    released_in: int = -1  # the interval of the dec that released it
    released_site: int = -1  # that dec's site


class LockLedger:
    """Inc/dec events paired with the target's live holders. ``holders``: a callable returning
    ``[(lock, holder name, node id)]``, or None (every inc stays unclaimed; decs pair as a stack per node)."""

    def __init__(self, holders=None):
        self.holders = holders
        self.records: list[LockRecord] = []
        self._open: dict[tuple[str, int], list[LockRecord]] = {}  # unreleased, in inc order
        self._fresh: dict[tuple[str, int], list[LockRecord]] = {}  # this interval's unpaired incs
        self._deferred: list[tuple[tuple[str, int], int, int, int]] = []  # (key, site, op, step)
        self.unmatched_decs: list[tuple[str, int, int, int, int]] = []  # (lock, node, site, op, step)
        self._live: Counter = Counter()
        self._listed: list = []  # the holders at the last snapshot, sorted
        self.dirty = False  # lock events since the last snapshot
        self._n_open = 0
        self.intervals = 0  # snapshots taken: the events since the last one belong to interval ``intervals``

    def inc(self, lock: str, node: int, site: int, op: int, step: int, hint: str | None = None) -> None:
        r = LockRecord(lock, node, site, op, step, hint=hint)
        self.dirty = True
        self._n_open += 1
        self.records.append(r)
        self._open.setdefault((lock, node), []).append(r)
        self._fresh.setdefault((lock, node), []).append(r)

    def dec(self, lock: str, node: int, site: int, op: int, step: int, hint: str | None = None) -> None:
        self.dirty = True
        if hint is not None:  # the releasing frames name their owner: its oldest unclaimed lock here
            mine = [r for r in self._open.get((lock, node), []) if r.holder is None and r.hint == hint]
            if mine:  # (a claimed lock pairs by its holder's liveness, below)
                self._release(mine[0], site)
                return
        fresh = [r for r in self._fresh.get((lock, node), []) if hint is None or r.hint in (None, hint)]
        if fresh:  # a lock and its release in one interval (a call's own pin), not another owner's
            self._release(fresh[-1], site)
        else:
            self._deferred.append(((lock, node), site, op, step))

    def _release(self, r: LockRecord, site: int) -> None:
        r.released, r.released_in, r.released_site = True, self.intervals, site
        self._n_open -= 1
        self._open[(r.lock, r.node)].remove(r)
        fresh = self._fresh.get((r.lock, r.node))
        if fresh and r in fresh:
            fresh.remove(r)

    def busy(self) -> bool:
        """Whether a snapshot could change anything."""
        return bool(self._deferred or self._listed or self._n_open)

    def snapshot(self, op: int, step: int) -> None:
        """Close the interval: read the live holders and pair this interval's events; ``op``/``step``:
        when this snapshot is taken (stamped on gone holders)."""
        named = self.holders() if self.holders is not None else None  # None: the target names none
        listed = sorted(named) if named is not None else []
        self.dirty = False
        if listed == self._listed and not self._deferred and not self._fresh:
            return  # nothing came, went or was released
        self._listed, now = listed, Counter(listed)
        gone, new = self._live - now, now - self._live
        for (lock, name, node), k in gone.items():
            for r in list(self._open.get((lock, node), [])):
                if k and r.holder == name and r.gone is None:
                    r.gone, r.gone_in, k = (op, step), self.intervals, k - 1
        for (lock, name, node), k in new.items():
            key = (lock, node)
            for _ in range(k):
                opened = self._open.get(key, [])
                fresh = [r for r in self._fresh.get(key, []) if r.holder is None and not r.released]
                just_gone = [r for r in opened if r.gone == (op, step)]
                older = [r for r in opened if r.holder is None]
                any_gone = sorted((r for r in opened if r.gone is not None), key=lambda r: r.gone)
                # several incs on the node: the one taken for this holder (its frames named it), else
                # one taken for nobody named, else the latest
                mine = [r for r in fresh + older if r.hint == name]
                unnamed = [r for r in fresh if r.hint is None]
                pick = (mine or unnamed or fresh or just_gone or older or any_gone or [None])[-1]
                if pick is None:
                    break
                if pick.holder is not None:
                    pick.handed_from = pick.holder
                pick.holder, pick.gone = name, None
        for key, site, dop, dstep in self._deferred:
            opened = self._open.get(key, [])
            gone_rs = sorted((r for r in opened if r.gone is not None), key=lambda r: r.gone)
            unclaimed = [r for r in opened if r.holder is None]
            if gone_rs:
                self._release(gone_rs[-1], site)
            elif unclaimed:
                self._release(unclaimed[-1], site)
            else:  # only live holders' locks: one released too often (paired later if its holder leaves)
                self.unmatched_decs.append((key[0], key[1], site, dop, dstep))
        for d in list(self.unmatched_decs):  # released before its holder left the target's lists
            left = [r for r in self._open.get(d[:2], []) if r.gone == (op, step)]
            if left:
                self.unmatched_decs.remove(d)
                self._release(left[0], d[2])
        # an inc taken for a named owner that holds nothing on its node now is that owner's leak
        names = {name for _, name, _ in listed}
        for rs in (self._fresh.values() if named is not None else ()):  # (no holders: no claims)
            for r in rs:
                if r.holder is None and not r.released and r.hint is not None and r.hint not in names:
                    r.holder, r.gone, r.gone_in = r.hint, (op, step), self.intervals
        self._fresh.clear()
        self._deferred.clear()
        self._live = now
        self.intervals += 1

    def orphaned(self) -> set[tuple[str, int]]:
        """``(lock, node)`` of every unreleased inc whose holder is gone, as of the last snapshot: a lock
        that no live holder will release (what a busy lock balance may report before the engine is idle)."""
        return {key for key, rs in self._open.items() for r in rs if r.gone is not None}

    def holder_lock(self, lock: str, nodes) -> LockRecord | None:
        """The latest inc of ``lock`` (any node) taken by or for a live holder listed on one of
        ``nodes`` at the last snapshot: when incs and decs pair up per node, the lock that holder
        took walked another path than the one it holds (None if the ledger has none)."""
        names = {name for lk, name, node in self._listed if lk == lock and node in nodes}
        return next((r for r in reversed(self.records) if r.lock == lock and (r.holder in names or r.hint in names)),
                    None)

    def let_go(self, r: LockRecord) -> int:
        """The site of the release that let ``r``'s holder go and left ``r`` out: the dec, in the
        interval the holder was first seen gone, of the holder's other kind of lock on the same node (a
        load-back released on its device lock but not on its host pin); -1 if none."""
        if r.holder is None or r.gone_in < 0:
            return -1
        return next((o.released_site for o in reversed(self.records) if o.lock != r.lock and o.node == r.node
                     and o.released and o.released_in == r.gone_in
                     # the same holder; or, taken and let go within one interval (never listed), the same owner
                     and ((o.holder is not None and o.holder == r.holder) or (o.hint is not None and o.hint == r.hint))),
                    -1)

    def culprits(self, lock: str, nodes) -> list[LockRecord]:
        """The open incs on ``nodes`` to blame, best first: those whose holder is gone (the earliest
        gone first), then those no holder ever claimed (oldest first)."""
        rs = [r for (lk, node), rs in self._open.items() if lk == lock and node in nodes for r in rs]
        gone = sorted((r for r in rs if r.gone is not None), key=lambda r: (r.gone, r.op, r.step))
        return gone + [r for r in rs if r.holder is None]
