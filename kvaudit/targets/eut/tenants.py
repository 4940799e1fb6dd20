"""How far each request row's current tenant wrote it: the fact that tells a row's own entries from the ones
its earlier tenants left (``Target.units_of_tenants``; docs/internals/audit.md, leak attribution).

The engine fills ``req_to_token`` by tensor indexing and clears nothing when a row is freed, so a row keeps
its former tenants' slot indices past its current tenant's length; once that tenant has finished (a leaked
row's), nothing in the engine says where its own entries end. The tenant writes positions ``[0, n)`` in
order: ``ReqToTokenPool.write`` (the prefix and each prefill chunk, a PD pre-allocation) and the decode
write of ``update_running_batch`` (position ``kv_allocated_len`` of each row it decodes). A checkpoint's
write replaces positions below that length with the tree's copies (still the tenant's entries).
"""

from __future__ import annotations

import weakref

import numpy as np

from kvaudit.audit.hooks import pass_through


class Tenants:
    """Per row of ``pool`` (the row pool): the positions ``[0, length)`` written since its latest allocation.
    A length is kept with the allocation (ledger event id) it was written under; a row allocated again since
    reads 0 until its new tenant writes. The auditor is held by a weak reference (see ``Evictions``)."""

    def __init__(self, auditor, pool: str):
        self.auditor, self.pool = weakref.ref(auditor), pool
        n = auditor.ledgers[pool].last_alloc.size
        self.length = np.zeros(n, dtype=np.int64)
        self.alloc = np.full(n, -1, dtype=np.int64)  # the allocation each length is of

    def install(self, engine, wrap) -> None:
        """Wrap ``engine.req_to_token_pool.write`` and ``engine.update_running_batch`` (its decode write)."""
        rows, record = engine.req_to_token_pool, self._record
        write = rows.write

        def write_wrapper(row, start, indices):
            out = write(row, start, indices)
            record(int(row), int(start) + indices.numel())
            return out

        wrap(rows, "write", write_wrapper)
        decode = engine.update_running_batch

        @pass_through  # (between engine frames: a decode allocation's stack goes on to the step that chose it)
        def decode_wrapper():
            batch = decode()
            for req in batch.reqs if batch is not None else ():
                record(req.kv.req_pool_idx, req.kv.kv_allocated_len)
            return batch

        wrap(engine, "update_running_batch", decode_wrapper)

    def _record(self, row: int, end: int) -> None:
        auditor = self.auditor()
        if auditor is None or not 0 < row < self.length.size:
            return
        since = auditor.ledgers[self.pool].last_alloc[row]
        if self.alloc[row] != since:
            self.alloc[row], self.length[row] = since, 0
        self.length[row] = max(self.length[row], end)

    def lengths(self, rows: np.ndarray) -> np.ndarray:
        """``[m] int64``: how many leading positions of each of ``rows`` (``[m] int64``) its current (or, for a
        row freed and not allocated again, its last) tenant wrote."""
        auditor = self.auditor()
        if auditor is None:
            return np.zeros(rows.size, dtype=np.int64)
        current = self.alloc[rows] == auditor.ledgers[self.pool].last_alloc[rows]
        return np.where(current, self.length[rows], 0)
