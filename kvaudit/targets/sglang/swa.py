"""SWA hybrid: a model whose sliding-window layers keep KV in a second pool beside the full-attention pool.
SGLang 0.5.23 builds, for ``is_hybrid_swa`` (``mem_cache/kv_cache_configurator.py``): ``SWAKVPool`` (a full and
an SWA sub-pool), ``SWATokenToKVPoolAllocator`` (``mem_cache/allocator/swa.py``: ``full_attn_allocator``,
``swa_attn_allocator`` and ``full_to_swa_index_mapping``, the full -> SWA slot translation), and
``create_tree_cache`` a ``UnifiedRadixCache`` with the ``SWA`` component (tombstones: nodes whose SWA part
is evicted while the full part stays). Running requests free the slots that left the window
(``ScheduleBatch.maybe_evict_swa`` -> ``evict_sliding_windows`` -> ``common.free_swa_out_of_window_slots``,
from ``alloc_for_extend`` / ``alloc_for_decode``).

Design notes: docs/internals/sglang.md ("SWA hybrid")."""

from __future__ import annotations

import numpy as np
import torch

from kvaudit.targets.base import Accounting, PoolSpec, Root, TargetFinding, slot_pages
from kvaudit.targets.sglang import compat
from kvaudit.targets.sglang.boot import build, load, publish_server_args, row_width
from kvaudit.targets.sglang.feature import SglangFeature

SWA_POOL = "swa_token_to_kv_pool"


class SwaHybrid(SglangFeature):
    """The SWA pool as a second audited pool, the window's bookkeeping the driver skips (SGLang's
    ``prepare_for_extend`` / ``prepare_for_decode`` count ``extend_batch_idx`` / ``decode_batch_idx``, which
    ``maybe_evict_swa`` reads), SGLang's own SWA balance check, and the ``swa-skip-window-free`` fault."""

    name = "swa"

    def __init__(self, target):
        super().__init__(target)
        self.window_evictions = 0  # evict_sliding_windows calls that moved a request's SWA cursor
        self.window_tokens = 0  # tokens those calls took out of the window
        self.tree_evicted = 0  # SWA tokens the tree's eviction freed (EvictResult.swa_num_tokens_evicted)
        self.keys_checked = 0  # inserted keys with a tombstone on their path, checked for a window at their end
        self.short_keys = []  # TargetFindings of the swa-window-at-key-end check
        self.checker = None

    # -- construction ------------------------------------------------------------------------------
    def build(self, config):
        """``kv_cache_configurator._build_hybrid_swa_kv_pool`` and its ``SWATokenToKVPoolAllocator`` branch, then
        ``kv_cache_builder``'s ``CacheInitParams(sliding_window_size=...)`` and
        ``TreeCacheBuildContext(is_hybrid_swa=True, full_tokens_per_layer=...)``: a stand-in model of one full
        and one sliding-window layer (layer ids 1 and 0)."""
        S = load()
        from sglang.srt.environ import envs
        from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
        from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

        envs.SGLANG_SWA_EVICTION_INTERVAL.set(config.swa_eviction_interval)
        full, swa, ps = config.total_tokens, config.swa_num_slots, config.page_size
        # the scheduler's --chunked-prefill-size, which maybe_evict_swa reads (-1: off, as ServerArgs has it)
        chunk = config.chunked_prefill_size
        sa = publish_server_args(config, chunked_prefill_size=-1 if chunk is None else chunk)
        rows = S.ReqToTokenPool(size=config.max_req_rows, max_context_len=row_width(config),
                                device=config.device, enable_memory_saver=False)

        def make_kv(dev):
            kv = SWAKVPool(size=full, size_swa=swa, page_size=ps, dtype=torch.bfloat16, head_num=1, head_dim=8,
                           swa_attention_layer_ids=[0], full_attention_layer_ids=[1], device=dev,
                           enable_memory_saver=False)
            rows_arg = {"req_to_token_pool": rows} if compat.has("swa-allocator-rows", S.version) else {}
            return kv, SWATokenToKVPoolAllocator(full, swa, page_size=ps, dtype=torch.bfloat16, device=dev,
                                                 kvcache=kv, need_sort=config.need_sort, **rows_arg)

        return build(config, server_args=sa, make_rows=lambda dev: rows, make_kv=make_kv,
                     disable_radix_cache=config.disable_radix_cache,
                     hybrid={"is_hybrid_swa": True, "full_tokens_per_layer": full,
                             "sliding_window_size": config.sliding_window_size, "chunked_prefill_size": chunk})

    def pools(self, pools: list) -> list:
        """The full pool's ``PoolSpec`` becomes ``full_attn_allocator``'s, and ``swa_attn_allocator`` is a pool of
        its own (each with its own ledger)."""
        a, ps = self.target.allocator, self.target.config.page_size
        full = PoolSpec(pools[0].name, a.full_attn_allocator, "kv", ps, a.size_full // ps)
        return [full, *pools[1:], PoolSpec(SWA_POOL, a.swa_attn_allocator, "kv", ps, a.size_swa // ps)]

    def attach(self) -> None:
        """Counters on the tree's window and tree evictions, the fault, and SGLang's invariant checker."""
        t = self.target
        cache, alloc = t.tree_cache, t.allocator
        slide, evict = cache.evict_sliding_windows, cache._evict
        faulty = "swa-skip-window-free" in t._faults
        swa_free = alloc.free_swa_segment
        sliding = [False]

        def evict_sliding_windows(req, pre_len, **k):
            before = req.kv.get_evicted_seqlen(self._swa) if req.kv.holds_kv else 0
            sliding[0] = True
            try:
                slide(req, pre_len, **k)
            finally:
                sliding[0] = False
            moved = (req.kv.get_evicted_seqlen(self._swa) if req.kv.holds_kv else 0) - before
            if moved > 0:
                self.window_evictions += 1
                self.window_tokens += moved

        def free_swa_segment(free_index, *, start_pos):
            group = alloc.swa_page_ids_group
            n = len(group)
            swa_free(free_index, start_pos=start_pos)
            # the fault: a window eviction's SWA pages leave the mapping but never reach the free list
            if sliding[0] and "swa-skip-window-free" in t._faults and len(group) > n:
                t._faults.discard("swa-skip-window-free")
                del group[n:]

        def counted_evict(params, *a, **k):
            out = evict(params, *a, **k)
            self.tree_evicted += int(out.swa_num_tokens_evicted)
            return out

        cache.evict_sliding_windows = evict_sliding_windows
        cache._evict = counted_evict
        if not cache.disable:
            insert = cache.insert

            def checked_insert(params, *a, **k):
                result = insert(params, *a, **k)
                if params.key is not None and not getattr(result, "rotation_tail_declined", False):
                    self._check_key_window(params.key, params.value)
                return result

            cache.insert = checked_insert
        if faulty:
            alloc.free_swa_segment = free_swa_segment
        self.checker = self._invariant_checker()

    def _check_key_window(self, key, values) -> None:
        """The ``swa-window-at-key-end`` oracle, after each tree insert (``UnifiedRadixCache.insert``, from
        ``checkpoint_into_tree``): a key whose path holds an SWA tombstone must end with at least a window of
        live SWA (the SWA component's ``sliding_window_size``), or SGLang's own match validator
        (``unified_cache/components/swa.py``, ``SWAComponent.create_match_validator``) refuses every match
        ending there, the re-match ``checkpoint_into_tree`` runs right after its insert included: the request's
        ``cache_protected_len`` then stays behind the key, and it keeps as its own (aliasing) or later frees
        (use-after-free) KV the tree took. SGLang 0.5.23 promises it (``common.free_swa_out_of_window_slots``
        keeps ``ceil_align(max(window, page), page)`` tokens "so a key that ends at page_floor(pre_len) still
        has a full window of live SWA"); 0.5.22 kept ``max(window, page)``, short where
        ``(window + 1) % page >= 2``. Reads the tree through ``tree_core.swa_tombstone_ranges`` (both tree
        cores; no split, no LRU touch). A HiCache tree is not checked (a host-only SWA copy also passes the
        validator).
        ``key``: the inserted ``RadixKey`` (page-aligned); ``values``: its full slots ``[len(key)]``."""
        cache = self.target.tree_cache
        if getattr(cache, "enable_hicache", False):
            return
        n = len(key)
        tombs = cache.tree_core.swa_tombstone_ranges(key, 0, n)
        if not tombs:
            return
        self.keys_checked += 1
        window = cache.components[self._swa].sliding_window_size
        live = n - tombs[-1][1]
        if live >= window:
            return
        tail = torch.as_tensor(values)[tombs[-1][1]:n].to(torch.int64)
        self.short_keys.append(TargetFinding(
            "unmatchable-prefix", SWA_POOL, self._swa_units(tail),
            f"a {n}-token key was cached with {live} live SWA token(s) after its tombstone {list(tombs[-1])}, "
            f"fewer than the {window}-token window: SGLang's match validator refuses a match ending there, the "
            f"re-match after the insert included, so the inserting request's cache_protected_len stays behind "
            f"the KV the tree took",
            check="swa-window-at-key-end"))

    def invariant_findings(self, out: list) -> list:
        """:meth:`_check_key_window`'s findings since the last check (the first of them: one bug per check),
        reported once, as ``mamba.py``'s stale-state findings are."""
        out, self.short_keys = out + self.short_keys[:1], []
        return out

    @property
    def _swa(self):
        from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
        return ComponentType.SWA

    def _invariant_checker(self):
        """SGLang's ``SchedulerInvariantChecker`` over its ``SchedulerPoolStatsObserver``, as ``Scheduler`` builds
        them for a hybrid-SWA model; the batches it reads are the driver's live requests."""
        from types import SimpleNamespace

        from sglang.srt.managers.scheduler_components.invariant_checker import SchedulerInvariantChecker
        from sglang.srt.managers.scheduler_components.pool_stats_observer import SchedulerPoolStatsObserver
        t = self.target
        a = t.allocator
        stats = SchedulerPoolStatsObserver(
            tree_cache=t.tree_cache, token_to_kv_pool_allocator=a, req_to_token_pool=t.req_to_token_pool,
            session_controller=t.session_controller, hisparse_coordinator=None, is_hybrid_swa=True,
            is_hybrid_ssm=False, enable_hisparse=False, full_tokens_per_layer=a.size_full,
            swa_tokens_per_layer=a.size_swa, max_total_num_tokens=a.size_full)
        return SchedulerInvariantChecker(
            is_hybrid_swa=True, is_hybrid_ssm=False, disaggregation_mode=None, page_size=t.config.page_size,
            full_tokens_per_layer=a.size_full, swa_tokens_per_layer=a.size_swa, max_total_num_tokens=a.size_full,
            tree_cache=t.tree_cache, token_to_kv_pool_allocator=a, req_to_token_pool=t.req_to_token_pool,
            pool_stats_observer=stats, get_last_batch=lambda: SimpleNamespace(reqs=t._live()),
            get_running_batch=lambda: None, scheduler_stage_metrics=None)

    # -- driver ------------------------------------------------------------------------------------
    def new_batch(self, batch, kind: str) -> None:
        """``prepare_for_extend`` counts ``extend_batch_idx`` before ``alloc_for_extend`` (its overlap guard on
        chunked prefills reads it)."""
        if kind == "extend":
            for req in batch.reqs:
                req.extend_batch_idx += 1

    def after_decode_alloc(self, batch) -> None:
        """``prepare_for_decode`` counts ``decode_batch_idx`` after ``alloc_for_decode`` (window eviction waits for
        the second decode step); under speculative decoding ``eagle_prepare_for_decode`` counts it itself."""
        if self.target.config.speculative_algorithm is not None:
            return
        for req in batch.reqs:
            req.decode_batch_idx += 1

    # -- observer ----------------------------------------------------------------------------------
    def _swa_units(self, full_slots: torch.Tensor) -> np.ndarray:
        """The SWA units (pages, or slots at page 1) the full slots ``[n]`` translate to; 0 (no peer) dropped."""
        if not full_slots.numel():
            return np.empty(0, np.int64)
        swa = self.target.allocator.full_to_swa_index_mapping[full_slots.to(torch.int64)]
        return slot_pages(swa[swa > 0], self.target.config.page_size)

    def roots(self, out: list, aborting: bool) -> list:
        """Each full-pool root's SWA peers: a request's private full slots' (those still in its window), a
        session's, the tree's (an SWA-tombstoned node's full slots have none)."""
        t = self.target
        table = t.req_to_token_pool.req_to_token
        owners = {}
        for req in t._live():
            owners.setdefault(id(req.kv), (req.kv, f"req:{req.rid}", "req"))
        for sid, slot in t._slots():
            if slot.kv.holds_kv:
                owners[id(slot.kv)] = (slot.kv, f"session:{sid}", "session")
        wanted = {r.owner for r in out if r.pool == "token_to_kv_pool" and r.private and r.role in ("req", "session")}
        for kv, owner, role in owners.values():
            if owner not in wanted:
                continue
            row = table[kv.req_pool_idx, : kv.kv_allocated_len]
            out.append(Root(SWA_POOL, owner, self._swa_units(row[kv.cache_protected_len:]), role=role))
            if kv.cache_protected_len:
                out.append(Root(SWA_POOL, owner, self._swa_units(row[: kv.cache_protected_len]), private=False,
                                role=role))
        values = t.tree_cache.all_values_flatten()
        if values.numel():
            out.append(Root(SWA_POOL, "tree", self._swa_units(values), role="tree"))
        return out

    def units_of_rows(self, out: dict, rows) -> dict:
        table = self.target.req_to_token_pool.req_to_token
        slots = table[torch.as_tensor(rows, dtype=torch.int64)].reshape(-1)
        out[SWA_POOL] = self._swa_units(slots[slots > 0])
        return out

    def accounting(self, out: dict) -> dict:
        """The full pool's counters are the full side's (``full_available_size``, ``full_evictable_size``,
        ``full_protected_size``); the SWA pool's the SWA side's (session-held: SGLang's
        ``session_held_swa_tokens``)."""
        t = self.target
        a, cache, stats = t.allocator, t.tree_cache, self.checker.pool_stats_observer
        prev = out["token_to_kv_pool"]
        out["token_to_kv_pool"] = Accounting(a.full_available_size(), cache.full_evictable_size(),
                                             cache.full_protected_size(), prev.session_held, a.size_full)
        out[SWA_POOL] = Accounting(a.swa_available_size(), cache.swa_evictable_size(), cache.swa_protected_size(),
                                   stats.session_held_swa_tokens(), a.size_swa)
        return out

    def free_lists(self, out: dict) -> dict:
        out[SWA_POOL] = compat.free_pages(self.target.allocator.swa_attn_allocator, self.target.S.version).cpu().numpy()
        return out

    def engine_check(self, lines: list[str]) -> list[str]:
        """SGLang's own busy check for a hybrid-SWA pool (``SchedulerInvariantChecker.self_check_during_busy``:
        ``_get_total_uncached_sizes``, ``_check_full_pool`` and ``_check_swa_pool`` over its pool stats), in
        place of the plain target's full-pool line."""
        c = self.checker
        ps = c.pool_stats_observer.get_pool_stats()
        full_uncached, swa_uncached = c._get_total_uncached_sizes()
        out = []
        for leak, msg in (c._check_full_pool(ps, uncached=full_uncached), c._check_swa_pool(ps, uncached=swa_uncached)):
            if leak:
                out.append(msg)
        return out

    def reach(self, out: dict[str, int]) -> dict[str, int]:
        """``swa_window_evictions`` (a running request's out-of-window slots freed), ``swa_window_tokens``,
        ``swa_tree_evicted`` (SWA tokens the tree's eviction freed, tombstoning nodes) and
        ``swa_keys_window_checked`` (inserted keys with a tombstone on their path, checked by
        :meth:`_check_key_window`); the last two not with the radix cache off, where there is no tree."""
        out.update(swa_window_evictions=self.window_evictions, swa_window_tokens=self.window_tokens)
        if not self.target.tree_cache.disable:
            out["swa_tree_evicted"] = self.tree_evicted
            out["swa_keys_window_checked"] = self.keys_checked
        return out
