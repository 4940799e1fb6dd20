"""Which tree evictions freed KV units under a reader that held no lock on them: the fact that tells apart
two causes of one premature free, ``release@radix_cache.py`` (``Target.freed_by``;
docs/reference/signatures.md).

The receipts are counted from the lock calls themselves: each ``inc_lock_ref(node)`` not yet matched by a
``dec_lock_ref(node)`` (a request's ``req.lock``, a session slot's ``slot.lock``, a write-through's, ...,
also while its holder is between the scheduler's lists). A node the tree evicts while such a receipt
covers it (the receipt's node or a descendant) was evicted under a lock the engine did not count (its
``lock_ref`` was 0 on a path a caller locked: ``radix-lock-skips-matched-node``). A node no receipt covered
was the tree's to evict: its reader read it without a lock (a lock released under it:
``session-close-while-running``), and the free is recorded as :data:`UNLOCKED`, for each unit no covered
node holds too (a unit two nodes hold, one of them covered, is the tree's own aliasing: the aftermath of an
earlier premature free, whose unit was handed on and cached again).
"""

from __future__ import annotations

import weakref

import numpy as np

from kvaudit.audit.hooks import pass_through

UNLOCKED = "unlocked"  # the freed_by value of a unit whose evicted node no live receipt covered


class Evictions:
    """Per unit of ``pool``: the free event of its last eviction from an unlocked node, compared when read
    with the free a finding names (a later free is not the eviction's). The auditor is held by a weak
    reference: the target outlives it, and a cycle would leave a closed run to the cycle collector."""

    def __init__(self, auditor, pool: str, page_size: int):
        self.auditor, self.pool, self.page_size = weakref.ref(auditor), pool, page_size
        self.free_event = np.full(auditor.ledgers[pool].last_free.size, -1, dtype=np.int64)
        self.covered_free = np.full(self.free_event.size, -1, dtype=np.int64)  # the same, of covered nodes
        self.receipts: dict[int, list] = {}  # node id -> [node, incs not yet matched by a dec]

    def install(self, tree, wrap) -> None:
        """Wrap ``tree``'s ``inc_lock_ref``/``dec_lock_ref`` (the receipts; its ``reset`` drops them) and
        ``_evict_lru``, so that each unlocked node its ``release`` frees is recorded (the receipts' paths are
        read once per call, at its first release: an eviction takes and drops no lock)."""
        for name, delta in (("inc_lock_ref", 1), ("dec_lock_ref", -1)):
            wrap(tree, name, self._counting(getattr(tree, name), delta))
        reset, receipts = tree.reset, self.receipts

        def reset_wrapper():  # a flush drops every node: the receipts of its locks (a session slot's, whose
            receipts.clear()  # flush never unlocks it) would cover the old nodes' units, handed on since
            return reset()

        wrap(tree, "reset", reset_wrapper)
        evict_lru = tree._evict_lru

        @pass_through
        def evict_lru_wrapper(num_tokens, candidate, release):
            covered: list = []  # [id() of the nodes a receipt covers, the units they hold], once read

            @pass_through  # (between engine frames: a free's whole stack goes on to _evict_lru and its callers)
            def release_wrapper(node):
                if not covered:
                    covered.extend(self._covered())
                auditor = self.auditor()
                n0 = len(auditor.events) if auditor is not None else -1
                out = release(node)
                if n0 >= 0:
                    self._record(auditor.events[n0:], covered[1], id(node) in covered[0])
                return out

            return evict_lru(num_tokens, candidate, release_wrapper)

        wrap(tree, "_evict_lru", evict_lru_wrapper)

    def _counting(self, fn, delta: int):
        receipts = self.receipts

        def counted(node):
            if node is not None:
                held = receipts.setdefault(node.id, [node, 0])
                held[1] += delta
                if held[1] <= 0:  # (an unmatched dec is the lock ledger's finding, not a receipt)
                    del receipts[node.id]
            return fn(node)

        return counted

    def _covered(self) -> tuple[set[int], np.ndarray]:
        # id() of every node on a live receipt's path (a lock covers its node and the node's ancestors), and
        # the units those nodes hold ([n] int64)
        out: set[int] = set()
        held = []
        for node, _ in self.receipts.values():
            while node is not None and id(node) not in out:
                out.add(id(node))
                if node.value is not None:
                    held.append(node.value.reshape(-1).cpu().numpy() // self.page_size)
                node = node.parent
        return out, np.concatenate(held).astype(np.int64) if held else np.zeros(0, dtype=np.int64)

    def _record(self, events: list, covered: np.ndarray, locked: bool) -> None:
        # the frees of pool units in ``events`` (the release of one node): a locked (covered) node's in
        # covered_free, an unlocked one's in free_event, but units a covered node holds
        for ev in events:
            if ev.kind == "free" and ev.pool == self.pool:
                u = np.asarray(ev.units, dtype=np.int64)
                u = u[u < self.free_event.size]
                if locked:
                    self.covered_free[u] = ev.id
                else:
                    self.free_event[u[~np.isin(u, covered)]] = ev.id

    def freed_by(self, units: np.ndarray, frees: np.ndarray) -> list[str]:
        """Per unit of ``units`` (``[n] int64``) freed by event ``frees`` (``[n] int64``): :data:`UNLOCKED`
        when that free was an unlocked node's eviction, else ``""``."""
        ok = (units >= 0) & (units < self.free_event.size)
        hit = ok & (self.free_event[np.where(ok, units, 0)] == frees) & (frees >= 0)
        return [UNLOCKED if h else "" for h in hit.tolist()]

    def under_lock(self, units: np.ndarray, frees: np.ndarray) -> list[bool]:
        """Per unit of ``units`` (``[n] int64``) freed by event ``frees`` (``[n] int64``): whether that free
        was the eviction of a node a live receipt covered (a free under the lock call's reader)."""
        ok = (units >= 0) & (units < self.covered_free.size)
        return (ok & (self.covered_free[np.where(ok, units, 0)] == frees) & (frees >= 0)).tolist()
