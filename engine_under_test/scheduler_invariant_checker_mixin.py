"""Accounting: the requests that own rows, the engine's integrity facts and its accounting
identities (:class:`PoolCheck`, one per pool).

SGLang 0.5.23 ``srt/managers/scheduler_components/invariant_checker.py``
(``SchedulerInvariantChecker``: ``_requests_owning_rows``, ``_check_req_pool``,
``_check_all_pools``).
"""

from __future__ import annotations

from typing import NamedTuple

from engine_under_test.memory import PoolIntegrityError
from engine_under_test.req import Req


class PoolCheck(NamedTuple):
    """One line of :meth:`Scheduler.check_memory`, in tokens (rows for ``req_to_token_pool``)."""

    pool: str
    available: int
    evictable: int
    protected: int
    session_held: int
    uncached: int
    total: int

    @property
    def ok(self) -> bool:
        return self.available + self.evictable + self.protected + self.session_held + self.uncached == self.total

    def message(self) -> str:
        return (f"[{self.pool}] total={self.total}, available={self.available}, evictable={self.evictable}, "
                f"protected={self.protected}, session_held={self.session_held}, uncached={self.uncached}")


class SchedulerInvariantCheckerMixin:
    def live_request_groups(self) -> list[list[Req]]:
        """The structures that hold live requests, each a list (a request may be in several): the running
        batch, the last batch's, the waiting queue, the PD transfer queue, the chunked request, HiSparse's
        staging queue (what SGLang's ``_requests_owning_rows`` reads, with the PD decode queues)."""
        return [self.running_batch, self.last_batch.reqs if self.last_batch else [], self.waiting_queue,
                self.disagg_transfer_queue, [self.chunked_req] if self.chunked_req else [],
                self.hisparse_coordinator.staging_reqs() if self.hisparse_coordinator else []]

    def requests_owning_rows(self) -> list[Req]:
        """Every live request that holds a row, deduplicated (SGLang ``_requests_owning_rows``,
        extended with the PD decode queues, which SGLang keeps out of the busy check)."""
        seen, out = set(), []
        for group in self.live_request_groups():
            for r in group:
                if id(r) not in seen and r.kv.holds_kv:
                    seen.add(id(r))
                    out.append(r)
        return out

    def check_integrity(self) -> None:
        """Engine facts of SGLang's invariants (reference 7.1, items 6-12): each pool's own
        bookkeeping, ``0 <= committed <= allocated <= context_len``, a page-aligned protected
        prefix, and rows owned by one live request each and absent from the free list.
        Raises :class:`PoolIntegrityError` with the numbers."""
        self.token_to_kv_pool_allocator.check_integrity()
        self.req_to_token_pool.check_integrity()
        self.tree_cache.check_integrity()
        if self.hicache_host_pool is not None:
            self.hicache_host_pool.check_integrity()
        hs = self.hisparse_coordinator
        if hs is not None:
            hs.hisparse_attn_allocator.check_integrity()
            hs.host_pool.check_integrity()
            hs.check_integrity({r.kv.req_pool_idx for r in self.requests_owning_rows()})
        ps, rows = self.page_size, {}
        free_rows = set(self.req_to_token_pool.free_slots)
        live = self.requests_owning_rows() + self.waiting_queue
        if self.session_controller is not None:
            self.session_controller.check_integrity(list({id(r): r for r in live}.values()))
        slots = [] if self.session_controller is None else self.session_controller.slots()
        borrowed = {id(slot.kv) for _, slot in slots}
        for sid, slot in slots:
            if slot.kv.req_pool_idx in free_rows:
                raise PoolIntegrityError(f"row {slot.kv.req_pool_idx} of session {sid} is in the free list")
            rows[slot.kv.req_pool_idx] = f"session {sid}"
        for req in self.requests_owning_rows():
            kv = req.kv
            if id(kv) in borrowed:  # the one turn running on its session's record
                borrowed.discard(id(kv))
                rows.pop(kv.req_pool_idx)
            if not 0 <= kv.kv_committed_len <= kv.kv_allocated_len <= self.config.context_len:
                raise PoolIntegrityError(f"{req.rid}: committed={kv.kv_committed_len} allocated={kv.kv_allocated_len}"
                                         f" context_len={self.config.context_len}")
            if kv.cache_protected_len % ps or kv.cache_protected_len > -(-kv.kv_allocated_len // ps) * ps:
                raise PoolIntegrityError(f"{req.rid}: cache_protected_len={kv.cache_protected_len} is not a page-aligned"
                                         f" prefix of allocated={kv.kv_allocated_len}")
            if kv.req_pool_idx in rows or kv.req_pool_idx in free_rows:
                other = rows.get(kv.req_pool_idx, "the free list")
                raise PoolIntegrityError(f"row {kv.req_pool_idx} of {req.rid} is also held by {other}")
            rows[kv.req_pool_idx] = req.rid

    def check_memory(self, idle: bool | None = None) -> list[PoolCheck]:
        """SGLang's accounting identities, one :class:`PoolCheck` per pool.

        ``available + evictable + protected + session_held + uncached == total``; at idle
        ``uncached`` is 0 and the request-pool identity is added. Unlike SGLang, which skips the
        checks under HiSparse, the HiSparse device buffer and host pool get identities too.
        """
        idle = self.is_fully_idle() if idle is None else idle
        owners = [] if idle else self.requests_owning_rows()
        # A turn running on its session's borrowed record is counted once, as session_held.
        double = "session-borrow-double-count" in self.config.bugs
        # BUG (sglang PRs #22213, #22753): with the switch on, the busy check also counts the
        # borrowed record as the turn's uncached KV: the identity reports a leak that is not there.
        uncached = sum(self.ceil_page(r.kv.kv_allocated_len) - r.kv.cache_protected_len for r in owners
                       if r.borrowed_slot is None or double)
        alloc = self.token_to_kv_pool_allocator
        checks = [PoolCheck("token_to_kv_pool", alloc.available_size(), self.tree_cache.evictable_size(),
                            self.tree_cache.protected_size(), self.session_held_tokens(), uncached, alloc.size)]
        if self.hicache_host_pool is not None:
            hp, tree = self.hicache_host_pool, self.tree_cache
            checks.append(PoolCheck("hicache_host", hp.available_size(), tree.host_evictable_size(),
                                    tree.host_protected_size(), 0, 0, hp.size))
        hs = self.hisparse_coordinator
        if hs is not None:
            rows = [r.kv.req_pool_idx for r in owners]
            checks.append(PoolCheck("hisparse_device", hs.hisparse_attn_allocator.available_size(), 0, 0, 0,
                                    sum(hs.device_size(x) for x in rows), hs.hisparse_attn_allocator.size))
            checks.append(PoolCheck("hisparse_host", hs.host_pool.available_size(), 0, 0, 0,
                                    sum(hs.host_size(x) for x in rows), hs.host_pool.size))
        if idle:
            rp = self.req_to_token_pool
            session_rows = 0 if self.session_controller is None else len(self.session_controller.slots())
            checks.append(PoolCheck("req_to_token_pool", rp.available_size(), 0, 0, session_rows, 0,
                                    rp.size + rp.pre_alloc_size))
        return checks
