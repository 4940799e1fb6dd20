"""The observer: what the oracles read of SGLang's pools, tree and requests (roots, accounting, free
lists, lock holders, the engine's conservation identity, progress and idle state)."""

from __future__ import annotations

import numpy as np
import torch

from kvaudit.targets.base import (Accounting, PoolSpec, Recount, Root, Target, kv_length_problems, record_roots,
                                  slot_pages)
from kvaudit.targets.sglang import compat
from kvaudit.targets.sglang.hooks import SglangHooks


class SglangReads(Target):
    """What both eras read alike: the pools, the flush count and the last retraction the driver keeps, a
    frame's request, the allocations that are a request's own KV."""

    owner_hint_vars = ("req",)
    owner_stop_vars = ("reqs", "batch")
    # srt/mem_cache/allocation.py (common.py before 0.5.23): alloc_for_extend's row (alloc_req_slots) and
    # slots, alloc_for_decode's slots (page 1: alloc_token_slots for both; paged: the _extend and
    # _decode helpers), and speculative decoding's draft slots: one role, request-kv, in a signature
    request_kv_allocs = ("alloc_req_slots", "alloc_token_slots", "alloc_paged_token_slots_extend",
                         "alloc_paged_token_slots_decode")
    _row_base = 0  # the row pool's ledger unit of row r: r + _row_base (the legacy era's before 0.5.11: 1)

    def pools(self) -> list[PoolSpec]:
        return self._pools

    @staticmethod
    def owner_hint(frame_locals: dict) -> str | None:
        rid = getattr(frame_locals.get("req"), "rid", None)
        return f"req:{rid}" if isinstance(rid, str) else None

    def flushed(self) -> int:
        return self._flushes

    def retraction(self) -> str:
        return self.last_retraction or ""

    @staticmethod
    def _kv(holder):
        """The per-era accessor of a request's or session slot's KV record (``req_pool_idx``,
        ``kv_committed_len``, ``kv_allocated_len``, ``cache_protected_len``): its ``ReqKvInfo``,
        ``holder.kv``. The legacy era keeps those fields on ``Req`` and ``SessionSlot`` themselves."""
        return holder.kv

    def _pages(self, slots: torch.Tensor) -> np.ndarray:
        return slot_pages(slots, self.config.page_size)

    def progress(self) -> dict[str, int]:
        """Per running (or chunked) request a number that grows while it progresses, -1 once aborted;
        nothing while the scheduler is paused."""
        if self.scheduler_paused:
            return {}
        out = {r.rid: self._kv(r).kv_committed_len + len(r.output_ids) for r in self.running}
        if self.chunked_req is not None:  # in no batch between chunks; a chunk advances extend_end
            out[self.chunked_req.rid] = compat.req_span(self.chunked_req, self.S.version)[1]
        for r in self.running:
            if r.to_finish is not None:
                out[r.rid] = -1
        return out

    def quiescence(self) -> list[tuple[str, str]]:
        """After a successful flush: both pools full again and the tree empty."""
        out = []
        for name, a in self.accounting().items():
            if a.available + a.session_held != a.total:
                out.append((name, f"available={a.available} of total={a.total} after a successful flush_cache"))
        if self.tree_cache.evictable_size() + self.tree_cache.protected_size():
            out.append(("token_to_kv_pool", "the radix tree still holds tokens after a successful flush_cache"))
        return out

    def describe_busy(self) -> str:
        """The queues' counts (``grammar`` and ``chunked`` when they hold a request: what :meth:`stuck` may
        name while ``waiting`` is 0), then the pools'."""
        grammar = len(self.grammar_manager.grammar_queue) if self.grammar_manager is not None else 0
        return (f"waiting={len(self.waiting)} running={len(self.running)} "
                + (f"grammar={grammar} " if grammar else "") + ("chunked=1 " if self.chunked_req is not None else "")
                + f"available={self.allocator.available_size()} evictable={self.tree_cache.evictable_size()} "
                f"protected={self.tree_cache.protected_size()} session_held={self._session_held_tokens()}")

    def units_of_rows(self, rows) -> dict[str, np.ndarray]:
        """The KV pool's units the row pool's units ``rows`` point at (ledger units: ``row + _row_base``)."""
        table = self.req_to_token_pool.req_to_token
        slots = table[torch.as_tensor(np.asarray(rows) - self._row_base, dtype=torch.int64)].reshape(-1)
        return {"token_to_kv_pool": self._pages(slots[slots > 0])}

    def free_lists(self) -> dict[str, np.ndarray]:
        """The KV pool's from its ``PoolSpec`` (HiSparse's is the logical allocator), the row pool's."""
        kv = next(spec.obj for spec in self._pools if spec.name == "token_to_kv_pool")
        return {"token_to_kv_pool": compat.free_pages(kv, self.S.version).cpu().numpy(),
                "req_to_token_pool": np.asarray(self.req_to_token_pool.free_slots, dtype=np.int64) + self._row_base}


class SglangObserver(SglangHooks, SglangReads):
    """Reads, never mutates (besides the hooks' bookkeeping), the state the driver keeps under SGLang's
    names."""

    # SGLang 0.5.23 srt/mem_cache/common.py: release_kv_cache -> tree_cache.free_kv_row ->
    # free_kv_row_segments (and _release_overallocated_kv_indices); the driver's _release plays the
    # result processors' finish: a free's path is the frame above them
    release_entries = ("release_kv_cache@common.py", "free_kv_row", "free_kv_row_segments@common.py",
                       "_release_overallocated_kv_indices@common.py", "_release@driver.py", "_release@hisparse.py")

    def framework_files(self) -> list[str]:
        import sglang.srt.mem_cache.allocator.base as base
        import sglang.srt.mem_cache.memory_pool as memory_pool
        return [base.__file__, memory_pool.__file__]

    def recount(self) -> dict[str, dict[str, Recount]]:
        """The tree's ``evictable`` / ``protected`` recounted from its nodes (the Python core's
        ``sanity_check`` part 4; on the Rust core through ``walk_for_kv_canary`` and
        ``all_values_flatten``)."""
        cache = self.tree_cache
        if cache.disable:
            return {}
        core = cache.tree_core
        if self.tree_core.startswith("Rust"):
            ev = int(core.walk_for_kv_canary(True, False).slot_indices.numel())
            pr = int(cache.all_values_flatten().numel()) - ev
        else:
            from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
            full, ev, pr = ComponentType.FULL, 0, 0
            stack = list(core.root_node.children.values())
            while stack:
                node = stack.pop()
                stack.extend(node.children.values())
                data = node.component_data[full]
                if data.value is not None:
                    if data.lock_ref > 0:
                        pr += len(data.value)
                    else:
                        ev += len(data.value)
        return {"token_to_kv_pool": {"evictable": Recount(ev, "tree", "its nodes with lock_ref 0"),
                                     "protected": Recount(pr, "tree", "its nodes with lock_ref > 0")}}

    def stalled(self) -> bool:
        """Only waiting requests are left and memory sessions hold (their KV, or their slot's tree lock)
        keeps them out: SGLang waits too."""
        held = self._session_held_tokens() > 0 or any(s.lock is not None for _, s in self._slots())
        return bool(self.waiting) and not self.running and held

    def stuck(self) -> str:
        """``running:decode``, ``chunked:prefill``, ``grammar:compile``, or for the waiting queue's head
        ``waiting:rows``, ``waiting:memory-locked`` or ``waiting:memory``; ``""`` when nothing is busy."""
        if self.running or self._last is not None:
            return "running:decode"
        if self.chunked_req is not None:
            return "chunked:prefill"
        if self.grammar_manager is not None and self.grammar_manager.grammar_queue:
            return "grammar:compile"
        if not self.waiting:
            return ""
        if not self.req_to_token_pool.available_size():
            return "waiting:rows"
        return "waiting:memory-locked" if self.tree_cache.protected_size() else "waiting:memory"

    def _ceil(self, n: int) -> int:
        ps = self.config.page_size
        return -(-n // ps) * ps

    def _slots(self):
        return [] if self.session_controller is None else list(self.tree_cache.session.slots.items())

    def _session_held_tokens(self) -> int:
        """SGLang's ``session_held``: per slot holding KV, ``ceil_align(kv_allocated_len) - cache_protected_len``."""
        return sum(self._ceil(s.kv.kv_allocated_len) - s.kv.cache_protected_len for _, s in self._slots()
                   if s.kv.holds_kv)

    def _place_groups(self) -> tuple:
        """``(name, requests)`` of the scheduler structures, most specific first (``Root.where``)."""
        return (("chunked", (self.chunked_req,) if self.chunked_req is not None else ()),
                ("grammar", self.grammar_manager.grammar_queue if self.grammar_manager is not None else ()),
                ("waiting", self.waiting), ("running", self.running),
                ("last_batch", self._last[1] if self._last is not None else ()))

    def _places(self) -> dict[int, str]:
        out: dict[int, str] = {}
        for name, group in self._place_groups():
            for r in group:
                out.setdefault(id(r), name)
        return out

    def _live(self) -> list:
        """Requests that own a row (SGLang's ``_requests_owning_rows``)."""
        return [r for r in self._active() if r.kv.holds_kv]

    def roots(self, aborting: bool = True) -> list[Root]:
        """The tree's values; each live request's row with its own KV (private) and its tree-owned prefix
        (shared); each session slot's record the same way."""
        table = self.req_to_token_pool.req_to_token
        out: list[Root] = []

        def record(kv, owner: str, role: str, where: str) -> None:
            out.extend(record_roots(table, kv, owner, role, self.config.page_size, where))

        held = set()
        for sid, slot in self._slots():
            if slot.kv.holds_kv:
                record(slot.kv, f"session:{sid}", "session", "session")
                held.add(id(slot.kv))
        live = self._live()
        places = self._places() if live else {}  # (a stuck engine's checks often have no live request)
        for req in live:
            if not aborting and req.to_finish is not None:
                continue
            if id(req.kv) not in held:  # a turn on its session's record: the session root covers it
                record(req.kv, f"req:{req.rid}", "req", places.get(id(req), ""))
        for req in self.running:  # running, yet its record was released under it: it still reads that KV
            if not req.kv.holds_kv and not req.finished() and req.rid in self._held:
                row, slots, protected = self._held[req.rid]
                owner = f"req:{req.rid}"
                out.append(Root("req_to_token_pool", owner, np.array([row], dtype=np.int64)))
                out.append(Root("token_to_kv_pool", owner, self._pages(slots[protected:])))
        values = self.tree_cache.all_values_flatten()
        if values.numel():
            out.append(Root("token_to_kv_pool", "tree", self._pages(values), role="tree"))
        return out

    def accounting(self) -> dict[str, Accounting]:
        a, cache, rp = self.allocator, self.tree_cache, self.req_to_token_pool
        rows = sum(1 for _, s in self._slots() if s.kv.holds_kv)
        return {
            "token_to_kv_pool": Accounting(a.available_size(), cache.evictable_size(), cache.protected_size(),
                                           self._session_held_tokens(), a.size),
            "req_to_token_pool": Accounting(rp.available_size(), 0, 0, rows, self._row_count()),
        }

    def _row_count(self) -> int:
        """Usable rows: row 0 is padding (a PD decode pool adds its ``pre_alloc_size`` rows)."""
        return self.req_to_token_pool._alloc_size - 1

    def metrics_check(self) -> list[str]:
        """Every live record's ``0 <= kv_committed_len <= kv_allocated_len``."""
        return kv_length_problems(self._live())

    def _path_slots(self, node):
        """``[n]`` KV slots on the path root -> ``node``: ``UnifiedRadixCache.path_device_indices``, which
        0.5.20/0.5.21 lack (the same tree-core call, ``collect_full_device_indices``)."""
        cache = self.tree_cache
        if hasattr(cache, "path_device_indices"):
            return cache.path_device_indices(node)
        return cache.tree_core.collect_full_device_indices(node, cache.root_node_handle())

    def lock_balance(self):
        """Nodes whose net lock count differs from the live lock holders on them; with every node balanced,
        ``protected_size()`` against the union of the holders' paths."""
        cache = self.tree_cache
        want: dict[int, int] = {}
        holders = self._lock_holders()
        for node in holders:
            want[node] = want.get(node, 0) + 1
        bad = []
        for node, have in self.lock_net.items():
            if have != want.get(node, 0):
                try:
                    slots = self._path_slots(node).cpu().numpy()
                except Exception:  # the node is gone (evicted or reset)
                    slots = np.empty(0, np.int64)
                bad.append((f"node {node}", slots, have, want.get(node, 0), {node}))
        if not bad:
            paths = [self._path_slots(node) for node in holders]
            covered = np.unique(torch.cat(paths).cpu().numpy()) if paths else np.empty(0, np.int64)
            if covered.size != cache.protected_size():
                bad.append(("tree", covered, cache.protected_size(), int(covered.size), set(want)))
        return [b for b in bad if b[1].size] or bad[:0]

    def lock_holders(self) -> list[tuple[str, str, int]]:
        """Every live lock receipt as ``(lock, holder, node id)``: ``req.lock`` and ``slot.lock``. Before
        change ``release-checkpoint`` a request keeps no receipt object: ``PrefillAdder`` locks ``req.last_node``
        when it admits the request and ``release_kv_cache``'s ``unpin`` drops it, so every request owning a
        row holds its ``last_node`` (``schedule_policy.py::_req_inc_lock_ref``, ``BasePrefixCache.unpin``)."""
        if not compat.has("release-checkpoint", self.S.version):
            return [("device", f"req:{r.rid}", r.last_node) for r in self._live() if r.last_node is not None]
        out = [("device", f"req:{r.rid}", r.lock.node) for r in self._live() + self.waiting if r.lock is not None]
        out += [("device", f"session:{sid}", s.lock.node) for sid, s in self._slots() if s.lock is not None]
        return out

    def _lock_holders(self) -> list:
        return [node for lock, _, node in self.lock_holders() if lock == "device"]

    def engine_check(self) -> list[str]:
        """SGLang's conservation identity (``SchedulerInvariantChecker``'s formula): ``available + evictable +
        protected + session_held + uncached == total``."""
        a = self.accounting()["token_to_kv_pool"]
        held = {id(s.kv) for _, s in self._slots()}
        uncached = sum(self._ceil(r.kv.kv_allocated_len) - r.kv.cache_protected_len for r in self._live()
                       if id(r.kv) not in held)
        lhs = a.available + a.evictable + a.protected + a.session_held + uncached
        if lhs != a.total:
            return [f"[token_to_kv_pool] available={a.available} + evictable={a.evictable} + protected={a.protected}"
                    f" + session_held={a.session_held} + uncached={uncached} = {lhs} != total={a.total}"]
        return []
