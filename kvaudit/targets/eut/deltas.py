"""The ``eut`` target's ownership deltas (:meth:`kvaudit.targets.base.Target.ownership_deltas`): how its
roots (:meth:`kvaudit.targets.eut.observer.EutObserver.roots`) changed since the previous call, without
rebuilding them.

Per KV record (a live request's, a session slot's) it keeps ``(row, cache_protected_len,
kv_allocated_len, kind, record object)`` (as arrays, compared whole when the live records are the
same ones in the same order), and a copy of ``req_to_token`` that holds every live record's parts as
last reported. A call compares the live records with the kept ones: the positions that entered or left a
record's parts (a row grew or shrank, a span moved from its own KV to its tree-owned prefix) and a record
that is new, dropped, or changed row, holder or record object are read as spans (the gained ones from
the table, into the copy too). Which entries were rewritten inside a part a record kept
(``checkpoint_kv_cache_into_tree`` pointing a span at the tree's slots, or a bug's stray write) is a
compare of the table with its copy; such an entry is a unit lost and one gained. An exact call compares
the whole table; ``exact=False`` (a busy check) only the rows whose record's protected prefix moved or
whose allocation shrank, the rows where the engine's own code rewrites a kept part: a stray write
elsewhere waits for the next exact call, which the core makes wherever the full sweep runs (at idle,
after an anomaly, in paranoid mode), and that sweep reports it. Two live records on one row make the call return
None (the full sweep judges that state). The tree is walked only when its shape may have changed (its
root, clock or sizes moved, or HiCache is on); a node whose value is a different tensor lost the old one
and gained the new one. A change none of these see (a tree node dropped with no size or clock change) is
what the paranoid mode reports as a disagreement.

Not covered (the method returns None and the full sweep runs): pages larger than one token (a root's
units are then a set of pages, not a count of positions), HiSparse (its per-request buffers), and a KV
table on a device other than the CPU.
"""

from __future__ import annotations

from itertools import chain
from operator import attrgetter, is_

import numpy as np
import torch

from kvaudit.targets.base import PRIVATE_OTHER, PRIVATE_REQ, PRIVATE_SESSION, SHARED, OwnershipDeltas, span_units


class EutDeltas:
    """The kept state of one :class:`kvaudit.targets.eut.target.EutTarget` (``target``)."""

    def __init__(self, target):
        self.target = target
        # the records as last reported: names, record objects, kinds, [k, 3] (row, protected, allocated)
        self.kept: tuple = ([], [], [], np.zeros((0, 3), dtype=np.int64))
        self._neq: np.ndarray | None = None  # the compare's buffer, kept
        self.shadow: np.ndarray | None = None  # req_to_token entries of the kept records, as last reported
        self.nodes: dict[int, tuple] = {}  # node id -> (value, host value) last seen
        self.tree_key: tuple | None = None
        self.session_units: dict[str, int] = {}
        self.reqs: tuple = ([], [], {}, {})  # the live requests last read, their names, places, places by name

    def covered(self) -> bool:
        eng = self.target.engine
        return (self.target.config.page_size == 1 and eng.hisparse_coordinator is None
                and eng.req_to_token_pool.req_to_token.device.type == "cpu")

    def deltas(self, exact: bool = True) -> OwnershipDeltas | None:
        """Since the previous call: per pool ``(owner, units, sign, kind)``; None when not covered.
        ``exact=False``: the table compared only on the rows where the engine's own code rewrites a
        record's kept part (:meth:`_written`)."""
        if not self.covered():
            return None
        out = _Out()
        where = self._records(out, exact)
        self._sessions(out)
        self._tree(out)
        return None if where is None else OwnershipDeltas(out.owners, out.pools(), where)

    def _live(self) -> tuple[list, list, list, dict[str, str]]:
        # every live record as roots() finds them, as (names, kvs, kinds), and their places by name
        t, eng = self.target, self.target.engine
        sc = eng.session_controller
        slots = [] if sc is None else sc.slots()
        names = [f"session:{sid}" for sid, _ in slots]
        kvs = [slot.kv for _, slot in slots]
        where = dict.fromkeys(names, "session")
        reqs = eng.requests_owning_rows()
        if kvs:
            held = set(map(id, kvs))
            reqs = [r for r in reqs if id(r.kv) not in held]
        places = t._places()
        last = self.reqs
        # NOTE: most steps keep the same requests in the same places: their names and places are then
        # reused (a request's rid never changes), not rebuilt request by request
        if len(reqs) == len(last[0]) and all(map(is_, reqs, last[0])) and places == last[2]:
            req_names, req_where = last[1], last[3]
        else:
            req_names = ["req:" + r.rid for r in reqs]
            req_where = {n: p for n, p in zip(req_names, map(places.get, map(id, reqs))) if p}
            self.reqs = (reqs, req_names, places, req_where)
        where.update(req_where)
        kinds = [PRIVATE_SESSION] * len(names) + [PRIVATE_REQ] * len(reqs)
        return names + req_names, kvs + list(map(_KV, reqs)), kinds, where

    def _records(self, out: "_Out", exact: bool = True) -> dict[str, str] | None:
        # the records' deltas into out; their places by owner; None: two live records share a row (the
        # full sweep judges that state; the kept copy is brought up to date all the same)
        table = self.target.engine.req_to_token_pool.req_to_token.numpy()
        if self.shadow is None or self.shadow.shape != table.shape:
            self.shadow = table.astype(np.int64, copy=True)
        lost, gained = _Spans(), _Spans()
        names, kvs, kinds, where = self._live()
        lens = np.fromiter(chain.from_iterable(map(_LENS, kvs)), dtype=np.int64, count=3 * len(kvs)).reshape(-1, 3)
        # a protected prefix past the allocation (a bug's record cut short under it) is read to the allocation,
        # as the roots read it (records_roots: the row up to kv_allocated_len)
        np.minimum(lens[:, 1], lens[:, 2], out=lens[:, 1])
        old = self.kept
        if (names == old[0] and kinds == old[2] and all(map(is_, kvs, old[1]))
                and np.array_equal(lens[:, 0], old[3][:, 0])):  # the same records on the same rows (most steps)
            c = np.column_stack([lens[:, 0], old[3][:, 1:], lens[:, 1:], np.array(kinds, dtype=np.int64)])
            kept = names
        else:
            c, kept = _match(old, names, kvs, kinds, lens, lost, gained, out)
        self.kept = (names, kvs, kinds, lens)
        common = _continuing(c, lost, gained, out.owner_block(kept))
        shared_rows = _repeats(c[:, 0])
        mis = self._written(table, None if exact else c)
        lost_units = lost.gather(self.shadow)
        gained_units, at = gained.gather(table, flat=True)
        parts = [(-1, lost_units), (1, gained_units)]
        if mis.size and not shared_rows:
            lp, gp = _rewrites(self.shadow, table, mis, common)
            parts += [(-1, lp), (1, gp)]
        flat = self.shadow.ravel()
        flat[mis] = table.ravel()[mis]
        flat[at] = gained_units[1]  # (the kept copy holds every record's parts as last reported)
        for sign, (owner, units, kind) in parts:
            if units.size:
                out.add("token_to_kv_pool", owner, units, sign, kind)
        return None if shared_rows else where

    def _written(self, table: np.ndarray, c: np.ndarray | None) -> np.ndarray:
        # the flat positions of the table written since the last call: every one (c None), or those on
        # the rows of continuing records c (_continuing's [k, 6]) whose protected prefix moved or whose
        # allocation shrank, the only rows where the engine's own code rewrites a part a record kept
        # (checkpoint_kv_cache_into_tree points [old protected, new) at the tree's slots). Every other write
        # of a step lands in a part it grew (read from the table as gained). A write elsewhere, a stray one,
        # is left to the next exact call: the core makes one wherever the full sweep runs (idle, after an
        # anomaly, paranoid mode), and that sweep reports what the write did
        if c is None:
            if self._neq is None or self._neq.shape != table.shape:
                self._neq = np.empty(table.shape, dtype=bool)
            np.not_equal(table, self.shadow, out=self._neq)
            return np.flatnonzero(self._neq)
        row, op, oa, np_, na = c[:, :5].T
        rows = row[(op != np_) | (na < oa)]
        if not rows.size:
            return _E
        r, col = np.divmod(np.flatnonzero(table[rows] != self.shadow[rows]), table.shape[1])
        return rows[r] * table.shape[1] + col

    def _sessions(self, out: "_Out") -> None:
        t = self.target
        sc = t.engine.session_controller
        if sc is None:
            return
        now = {f"session:{sid}": t.session_records.unit_of.get(id(s.slot)) for sid, s in sc.sessions.items()}
        now = {k: u for k, u in now.items() if u is not None}
        for name in set(now) | set(self.session_units):
            a, b = self.session_units.get(name), now.get(name)
            if a != b:
                for u, sign in ((a, -1), (b, 1)):
                    if u is not None:
                        out.add("session_records", np.array([out.owner(name)]), np.array([u]), sign,
                                np.array([PRIVATE_SESSION], dtype=np.int8))
        self.session_units = now

    def _tree(self, out: "_Out") -> None:
        eng = self.target.engine
        tree = eng.tree_cache
        hicache = eng.hicache_host_pool is not None
        key = (id(tree.root_node), tree._clock, tree.evictable_size_, tree.protected_size_)
        if key == self.tree_key and not hicache:
            return
        self.tree_key = key
        seen, lost, gained = {}, [], []
        for n in tree.nodes():
            now = (n.value, n.host_value if hicache else None)
            seen[n.id] = now
            old = self.nodes.get(n.id, (None, None))
            for i in (0, 1):
                if now[i] is not old[i]:
                    if old[i] is not None:
                        lost.append((i, old[i]))
                    if now[i] is not None:
                        gained.append((i, now[i]))
        for nid in self.nodes.keys() - seen.keys():
            lost += [(i, v) for i, v in enumerate(self.nodes[nid]) if v is not None]
        self.nodes = seen
        tree_owner = out.owner("tree")
        for pool, i in (("token_to_kv_pool", 0), ("hicache_host", 1)):
            for sign, part in ((-1, lost), (1, gained)):
                vals = [v for j, v in part if j == i]
                if vals:
                    units = torch.cat(vals).to(torch.int64).numpy()
                    out.add(pool, np.full(units.size, tree_owner), units, sign,
                            np.full(units.size, PRIVATE_OTHER, dtype=np.int8))


def _repeats(rows: np.ndarray) -> bool:
    # whether a row number appears twice (NOTE: a bincount over the table's few rows, not np.unique's sort)
    if rows.size < 2:
        return False
    return bool(np.bincount(rows).max() > 1) if rows.min() >= 0 else np.unique(rows).size != rows.size


def _match(old: tuple, names: list, kvs: list, kinds: list, lens: np.ndarray, lost: "_Spans", gained: "_Spans",
           out: "_Out") -> tuple[np.ndarray, list]:
    # the live records (names, kvs, kinds, lens) against the kept ones (old: the same four): each record new,
    # dropped, or moved (row, kind or record object) goes to lost/gained whole; returns the rest as
    # _continuing's [k, 6] and their names
    at = {n: i for i, n in enumerate(old[0])}
    cont, kept = [], []
    for i, name in enumerate(names):
        j = at.pop(name, None)
        row, p, n = lens[i].tolist()
        if j is not None and old[3][j, 0] == row and old[1][j] is kvs[i] and old[2][j] == kinds[i]:
            cont += (row, int(old[3][j, 1]), int(old[3][j, 2]), p, n, kinds[i])
            kept.append(name)
            continue
        if j is not None:
            _whole(name, (*old[3][j].tolist(), old[2][j]), lost, gained, out, -1)
        _whole(name, (row, p, n, kinds[i]), lost, gained, out, 1)
    for name, j in at.items():  # dropped
        _whole(name, (*old[3][j].tolist(), old[2][j]), lost, gained, out, -1)
    return np.array(cont, dtype=np.int64).reshape(-1, 6), kept


def _whole(name: str, rec: tuple | None, lost: "_Spans", gained: "_Spans", out: "_Out", sign: int) -> None:
    # every entry of record rec ((row, protected, allocated, kind, ...)), lost (sign -1) or gained
    if rec is None:
        return
    row, p, n, kind = rec[:4]
    owner = out.owner(name)
    out.add("req_to_token_pool", np.array([owner]), np.array([row]), sign, np.array([kind], dtype=np.int8))
    spans = lost if sign < 0 else gained
    spans.extend(np.array([owner, owner]), np.array([row, row]), np.array([0, p]), np.array([p, n]),
                 np.array([SHARED, kind]))


def _continuing(c: np.ndarray, lost: "_Spans", gained: "_Spans", owners: np.ndarray) -> tuple:
    # records that kept their row, kind and object: c ``[k, 6]`` (row, old protected, old allocated, new
    # protected, new allocated, kind), owners ``[k]``. The positions that entered or left a part go to
    # lost/gained as spans; returns the parts kept, judged by content: (rows, lo, a, b, kind, owners), the
    # shared [0, lo) and the own [a, b) of each
    row, op, oa, np_, na, kind = c.T
    lo, a, b = np.minimum(op, np_), np.maximum(op, np_), np.minimum(oa, na)
    apart = a >= b  # no own position in common
    a, b = np.where(apart, 0, a), np.where(apart, 0, b)
    zero = np.zeros_like(row)
    for spans, p, n in ((lost, op, oa), (gained, np_, na)):
        spans.extend(owners, row, lo, p, np.full_like(kind, SHARED))
        spans.extend(owners, row, p, np.where(apart, n, a), kind)
        spans.extend(owners, row, np.where(apart, zero, b), np.where(apart, zero, n), kind)
    return row, lo, a, b, kind, owners


def _rewrites(old: np.ndarray, now: np.ndarray, mis: np.ndarray, common: tuple) -> tuple:
    # the entries at flat positions mis (written since the last call) in a part a record kept: lost (old
    # content) and gained (now), as (owner, units, kind) each
    rows, lo, a, b, kind, owners = common
    rec = np.full(now.shape[0], -1, dtype=np.int64)
    rec[rows] = np.arange(rows.size)
    r, c = np.divmod(mis, now.shape[1])
    i = rec[r]
    keep = i >= 0
    c, i, pos = c[keep], i[keep], mis[keep]
    shared = c < lo[i]
    hit = shared | ((c >= a[i]) & (c < b[i]))
    kinds = np.where(shared, SHARED, kind[i]).astype(np.int8)[hit]
    who, pos = owners[i[hit]], pos[hit]
    return (who, old.ravel()[pos].astype(np.int64), kinds), (who, now.ravel()[pos].astype(np.int64), kinds)


class _Spans:
    """Row spans ``[start, end)`` to gather, each with its owner's index and kind, in blocks of arrays."""

    def __init__(self):
        self.blocks: list[tuple] = []

    def extend(self, owner, rows, starts, ends, kind) -> None:
        self.blocks.append((owner, rows, starts, ends, kind))

    def gather(self, src: np.ndarray, flat: bool = False) -> tuple:
        """(owner, units, kind) of every entry, read from ``src``; ``flat``: and, beside that triple, the
        entries' flat positions in ``src``."""
        if not self.blocks:
            return ((_E, _E, _E8), _E) if flat else (_E, _E, _E8)
        owner, rows, starts, ends, kind = (np.concatenate([b[i] for b in self.blocks]) for i in range(5))
        units, r, cols, span = span_units(src, rows, starts, ends)
        got = owner[span], units, kind[span].astype(np.int8)
        return (got, r * src.shape[1] + cols) if flat else got


_E, _E8 = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int8)
_LENS = attrgetter("req_pool_idx", "cache_protected_len", "kv_allocated_len")
_KV = attrgetter("kv")


class _Out:
    """The deltas being built: owner names, and per pool the chunks of entries."""

    def __init__(self):
        self.owners: list[str] = []
        self._ids: dict[str, int] = {}
        self.chunks: dict[str, list] = {}

    def owner_block(self, names: list[str]) -> np.ndarray:
        """The indices of ``names``, none of them named before (``[k] int64``)."""
        first = len(self.owners)
        self.owners += names
        return np.arange(first, first + len(names), dtype=np.int64)

    def owner(self, name: str) -> int:
        ids, n = self._ids, len(self.owners)
        if len(ids) < n:  # NOTE: names of a block indexed only when a single owner is looked up (most steps: never)
            ids.update(zip(self.owners[len(ids):], range(len(ids), n)))
        i = ids.get(name)
        if i is None:
            i = self._ids[name] = len(self.owners)
            self.owners.append(name)
        return i

    def add(self, pool: str, owner: np.ndarray, units: np.ndarray, sign: int, kind: np.ndarray) -> None:
        self.chunks.setdefault(pool, []).append((owner, units, np.full(units.size, sign, dtype=np.int64), kind))

    def pools(self) -> dict:
        return {pool: tuple(np.concatenate([c[i] for c in chunks]).astype(dt, copy=False)
                            for i, dt in enumerate((np.int64, np.int64, np.int64, np.int8)))
                for pool, chunks in self.chunks.items()}
