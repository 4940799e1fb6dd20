"""Where the target's row writes put KV units: the fact that names a leak no owner had and no release
named (``Target.lost_by``; docs/internals/audit.md, "A leak with no second part").

SGLang writes a request's KV slots into its row of ``ReqToTokenPool.req_to_token`` at
``ReqToTokenPool.write`` (``write_cache_indices``, ``alloc_for_decode_default``) and, for spec decode, with the
``assign_req_to_token_pool`` kernel (:func:`kvaudit.targets.sglang.spec.assign_rows` here). A unit such a write
put into a session record's row, or wrote past the table's last row, and that no root reaches at the next
check, was lost by that row: a later write displaced its entry, or the record's length was cut under it.
"""

from __future__ import annotations

import numpy as np
import torch

# a unit's place code -> its lost_by value ("": no write recorded)
PLACES = ("", "row:request", "row:session", "past-table")
REQUEST, SESSION, PAST = 1, 2, 3


LOG_MAX = 4096  # writes logged before they are folded into the per-unit arrays (bounds the log's memory)


class RowWrites:
    """Per KV unit of ``pool``: the event count (``len(auditor.events)``) at the last write that put it, and
    that write's place (:data:`PLACES`): a request's row, a session record's row (``session_rows()``: the
    rows the live session records hold, read at the write), or past the table. A record counts only when
    made after the unit's latest allocation (the ledger's ``last_alloc``).

    A write is logged as it comes (the tensors it wrote, by reference: SGLang builds them per batch and
    does not write to them after) and folded into the arrays only when read, or every :data:`LOG_MAX`
    writes: a program that leaks nothing pays one list append per write."""

    def __init__(self, auditor, pool: str, page_size: int, session_rows):
        self.auditor, self.pool, self.page_size, self.session_rows = auditor, pool, page_size, session_rows
        n = auditor.ledgers[pool].last_alloc.size
        self.event = np.full(n, -1, dtype=np.int64)
        self.place = np.zeros(n, dtype=np.int8)
        self.log: list[tuple] = []

    def put(self, rows, slots: torch.Tensor, past: torch.Tensor | None = None) -> None:
        """Log a write of ``slots`` (``[n]`` int token slots) into ``rows`` (``[n]`` int rows, or one row: an
        int or a 0-d tensor); ``past`` (``[n]`` bool, optional) marks slots written past the table."""
        self.log.append((len(self.auditor.events), rows, slots, past, self.session_rows()))
        if len(self.log) >= LOG_MAX:
            self.fold()

    def fold(self) -> None:
        """The logged writes into ``event``/``place``: per unit, its last write's (one pass per write, none
        per slot)."""
        if not self.log:
            return
        units, events, codes = [], [], []
        for ev, rows, slots, past, sess in self.log:
            s = slots.reshape(-1).to(torch.int64).cpu().numpy()
            code = np.full(s.shape, REQUEST, dtype=np.int8)
            if sess:
                r = torch.as_tensor(rows).reshape(-1).cpu().numpy()
                if r.size in (1, s.size):
                    code[np.broadcast_to((r[:, None] == np.asarray(sess)).any(1), s.shape)] = SESSION
            if past is not None:
                code[past.reshape(-1).cpu().numpy()] = PAST
            units.append(s // self.page_size)
            events.append(np.full(s.shape, ev, dtype=np.int64))
            codes.append(code)
        self.log.clear()
        u, e, c = np.concatenate(units), np.concatenate(events), np.concatenate(codes)
        keep = (u > 0) & (u < self.event.size)  # (0: the padding entry)
        u, e, c = u[keep], e[keep], c[keep]
        last = u.size - 1 - np.unique(u[::-1], return_index=True)[1]  # each unit's last write
        self.event[u[last]] = e[last]
        self.place[u[last]] = c[last]

    def lost_by(self, units: np.ndarray) -> list[str]:
        """Per unit of ``units`` (``[n] int64``): its last recorded write's place, ``""`` when none was
        recorded since its latest allocation."""
        self.fold()
        ok = units < self.event.size
        u = np.where(ok, units, 0)
        fresh = ok & (self.event[u] > self.auditor.ledgers[self.pool].last_alloc[u])
        return [PLACES[c] for c in np.where(fresh, self.place[u], 0).tolist()]
