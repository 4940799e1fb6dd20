"""Prefill: the next batch to run, admission of waiting requests (``PrefillAdder``), priority
preemption, HiCache load-back, and the allocation helpers the extend and decode paths share.

SGLang 0.5.23: ``srt/managers/scheduler.py`` (``get_next_batch_to_run``, ``get_new_batch_prefill``),
``srt/managers/schedule_policy.py`` (``PrefillAdder``, ``preempt_to_schedule``) and
``srt/mem_cache/allocation.py``. ``alloc_for_extend`` stays in ``scheduler.py`` (shipped signatures
name it ``alloc_for_extend@scheduler.py``).
"""

from __future__ import annotations

import torch

from engine_under_test.hicache import HiRadixCache
from engine_under_test.memory import INDEX_DTYPE
from engine_under_test.req import FinishReason, Req
from engine_under_test.schedule_batch import CLIP_MAX_NEW_TOKENS, EXTEND, ScheduleBatch


class SchedulerPrefillMixin:
    def get_next_batch_to_run(self) -> ScheduleBatch | None:
        hs = self.hisparse_coordinator
        if hs is not None:  # collect_ready_reqs: staged requests with a device buffer join decode
            self.running_batch.extend(hs.collect_ready_reqs(self.forward_ct))
        chunked = self.chunked_req
        if chunked is not None and self._pending_chunked_abort:  # process_pending_chunked_abort
            self._pending_chunked_abort = False
            self.chunked_req = None
            chunked.finished_reason = FinishReason.ABORT
            self._release_finished(chunked, checkpoint=False)
        elif chunked is not None:  # stash_chunked_request: publish the chunks computed so far
            self.checkpoint_kv_cache(chunked)
        # HiSparse has its own prefill-to-decode transition (staging, collected above): no merge, as in
        # SGLang; a merge would add a request collected in the same step a second time.
        if hs is None and self.last_batch is not None and self.last_batch.forward_mode == EXTEND:
            # A request whose last chunk sampled nothing is mid-prefill: it never joins decode.
            self.running_batch.extend(r for r in self.last_batch.reqs
                                      if not r.finished() and r is not self.chunked_req and r.kv.holds_kv
                                      and (r.output_ids or r.future_ids) and id(r) not in self.last_batch.decode_ids)
        self.running_batch = [r for r in self.running_batch if not r.finished()]
        batch = self.get_new_batch_prefill()
        if batch is not None:
            if self.config.enable_mixed_chunk and self.running_batch:
                # Mixed chunk: the running requests decode in the same forward as the prefill.
                dec = self.update_running_batch()
                if dec is not None:
                    batch.reqs = batch.reqs + dec.reqs
                    batch.out_cache_loc = torch.cat((batch.out_cache_loc, dec.out_cache_loc))
                    batch.decode_ids = frozenset(id(r) for r in dec.reqs)
            return batch
        return self.update_running_batch()

    def _running_token_offset(self) -> float:
        """Tokens admission holds back for the running requests: their remaining output (at most
        ``CLIP_MAX_NEW_TOKENS``) times ``new_token_ratio`` (1 for ``ignore_eos``), no page each
        (SGLang ``PrefillAdder._get_running_request_total_token_offset``)."""
        return sum(self._req_token_offset(r) for r in self.running_batch)

    def _req_token_offset(self, r: Req) -> float:
        ratio = 1.0 if r.ignore_eos else self.config.new_token_ratio
        return min(r.max_new_tokens - len(r.output_ids), CLIP_MAX_NEW_TOKENS) * ratio

    def get_new_batch_prefill(self) -> ScheduleBatch | None:
        """Admit waiting requests as SGLang's ``PrefillAdder`` does (``managers/schedule_policy.py``
        with ``mem_cache/prefill_budget.py:PrefillBudget``), all in tokens.

        ``rem_total = available + evictable - offset``; ``offset`` starts at
        :meth:`_running_token_offset` (plus one token per running request with mixed chunk) and
        grows by ``ceil_page(extend) + page + max_new`` per admitted request (``reserve``; a
        non-final chunk reserves no output). A new request is admitted while
        ``extend + min(max_new - output, CLIP) + page < rem_total``, its matched prefix locked
        (``add_one_req``); rows and ``max_running_requests`` bound the batch. With
        ``chunked_prefill_size`` the batch computes at most that many (page-ceiled) tokens
        (``rem_chunk_tokens``, less the mixed decode rows), a longer prompt becomes the one parked
        ``chunked_req`` (its first chunk page-aligned), and its next chunk is
        ``min(rem_chunk_tokens, rem_total)`` (``add_chunked_req``, ``available_chunk_tokens``).
        When ``rem_total <= 0`` SGLang takes the whole ``rem_chunk_tokens`` to make progress;
        here that chunk is further bounded by what the pool can allocate now (page-aligned) and
        the request waits a round when that is nothing, where SGLang would raise "Prefill out of
        memory". With priority scheduling the waiting queue is first sorted by :meth:`_priority_key`
        (``SchedulePolicy.calc_priority``), and a request that meets a full batch (running requests or
        rows) may preempt running ones (:meth:`preempt_to_schedule`); the preempted are queued again
        after the round, even when nothing was admitted. Not modelled: the ``ignore_eos`` admission
        without a tree (``add_one_req_ignore_eos``) and ``max_prefill_tokens``.
        """
        if not self.waiting_queue and self.chunked_req is None:
            return None
        tree, alloc, ps = self.tree_cache, self.token_to_kv_pool_allocator, self.page_size
        hs = self.hisparse_coordinator
        if self.config.enable_priority_scheduling:
            self.waiting_queue.sort(key=self._priority_key)
        mixed = len(self.running_batch) if self.config.enable_mixed_chunk else 0
        offset = mixed + self._running_token_offset()  # total_offset

        def rem_total() -> float:
            return alloc.available_size() + tree.evictable_size() - offset

        chunk_size = self.config.chunked_prefill_size
        rem_chunk = float("inf") if chunk_size is None else chunk_size - mixed  # rem_chunk_tokens
        can_run: list[Req] = []
        for req in self.waiting_queue:  # HiCache loading_check: an acked load-back drops its locks
            if req.load_back is not None and tree.load_back_ready(req.load_back):
                tree.release_load_back(req.load_back)
                req.load_back = None
        chunked = self.chunked_req
        if chunked is not None:  # add_chunked_req: the next chunk, bounded by what memory is left
            prefix = chunked.prefix_len = chunked.kv.kv_committed_len
            left = len(chunked.fill_ids) - prefix
            take = min(rem_chunk, int(rem_total()))
            if take <= 0:  # SGLang: a continuation must make progress; here only as far as the pool allows
                room = (alloc.available_size() + tree.evictable_size()) // ps * ps
                take = min(rem_chunk, self.ceil_page(prefix) - prefix + room)
            take = int(min(left, take))
            if take > 0:
                chunked.extend_end = prefix + take
                if take < left:
                    chunked.inflight_middle_chunks += 1
                else:
                    self.chunked_req = None  # the final chunk runs as a normal prefill
                final_out = 0 if take < left else min(chunked.max_new_tokens, CLIP_MAX_NEW_TOKENS)
                offset += self.ceil_page(take) + ps + final_out
                rem_chunk -= self.ceil_page(take)
                can_run.append(chunked)
        preempted: list[Req] = []
        full = False  # batch_is_full: once set, each later request of the round must preempt to get in
        for req in list(self.waiting_queue):
            if rem_chunk <= 0:  # budget_state: OTHER
                break
            full = full or len(self.running_batch) + len(can_run) >= self.config.max_running_requests or \
                self.req_to_token_pool.available_size() <= len(can_run)
            if full:
                victims = self.preempt_to_schedule(req, rem_total()) if self.config.enable_priority_scheduling else []
                if not victims:
                    break
                offset -= sum(map(self._req_token_offset, victims))
                preempted += victims
            if rem_total() <= 0:  # budget_state: NO_TOKEN; add_one_req refuses
                break
            if hs is not None and self.ceil_page(len(req.fill_ids)) + sum(
                    self.ceil_page(r.extend_end) for r in can_run) > hs.hisparse_attn_allocator.available_size():
                break  # HiSparse prefill KV lives in physical slots (request_slot_reserve)
            fill = req.fill_ids
            if req.load_back is not None:  # HiCache: the load-back's ack has not arrived yet
                continue
            sc = self.session_controller
            borrow = None if sc is None else sc.match(req, len(fill) - 1, commit=False)
            if borrow is None:
                match = tree.match_prefix(fill[: len(fill) - 1])  # compute at least one token
                if self._start_load_back(req, match, int(offset)):
                    continue
                tree.inc_lock_ref(match.last_node)  # the temporary pin of _lock_node, kept on admission
                prefix = match.device_indices.numel()
            else:
                prefix = borrow
            extend = len(fill) - prefix
            max_new = min(max(req.max_new_tokens - len(req.output_ids), 0), CLIP_MAX_NEW_TOKENS)
            fits = extend + max_new + ps < rem_total()  # the whole request, as check_prefill sees it
            chunk_now = self.ceil_page(extend) > rem_chunk
            if chunk_now:  # the first chunk: as much as the budget allows, ending on a page boundary
                extend = (prefix + int(rem_chunk) // ps * ps) // ps * ps - prefix
            if not fits or (chunk_now and (extend <= 0 or self.chunked_req is not None)):
                if borrow is None:
                    tree.dec_lock_ref(match.last_node)
                break
            if borrow is None:
                req.prefix_indices, req.last_node, req.lock = match.device_indices, match.last_node, match.last_node
            else:  # the turn continues on its session's record; the slot keeps the tree lock
                sc.match(req, len(fill) - 1, commit=True)
                req.prefix_indices = req.last_node = req.lock = None
            req.prefix_len, req.extend_end = prefix, prefix + extend
            if chunk_now:
                req.inflight_middle_chunks = 1
                self.chunked_req = req
            offset += self.ceil_page(extend) + ps + (0 if chunk_now else min(req.max_new_tokens, CLIP_MAX_NEW_TOKENS))
            rem_chunk -= self.ceil_page(extend)
            can_run.append(req)
            self.waiting_queue.remove(req)
        for req in preempted:
            self._add_request_to_queue(req)
        if not can_run:
            return None
        batch = ScheduleBatch(can_run, EXTEND)
        self.alloc_for_extend(batch)
        return batch

    def preempt_to_schedule(self, req: Req, rem_total: float) -> list[Req]:
        """Make room for waiting ``req`` by preempting running requests of lower priority; returns
        them, released as retractions (:meth:`release_req`) and out of the running batch, or ``[]``
        touching nothing (SGLang 0.5.23 ``PrefillAdder.preempt_to_schedule``).

        Candidates (unfinished running requests) go least preferred first, the latest queued first
        on a tie; each must trail ``req`` by more than ``priority_scheduling_preemption_threshold``
        (the first that does not ends the search). They are taken until their reserved output
        (:meth:`_req_token_offset`) covers ``extend + min(max_new, CLIP) - rem_total`` (tokens;
        ``extend`` from a fresh prefix match); if it is never covered, nobody is preempted."""
        fill = req.fill_ids
        need = (len(fill) - self.tree_cache.match_prefix(fill[: len(fill) - 1]).device_indices.numel()
                + min(req.max_new_tokens - len(req.output_ids), CLIP_MAX_NEW_TOKENS) - rem_total)
        limit, victims = self.config.priority_scheduling_preemption_threshold, []
        for r in sorted((r for r in self.running_batch if not r.finished()), key=self._priority_key, reverse=True):
            if self._priority_key(r)[0] - self._priority_key(req)[0] <= limit:
                break
            victims.append(r)
            need -= self._req_token_offset(r)
            if need <= 0:
                break
        if not victims or need > 0:
            return []
        for r in victims:
            self.release_req(r)
        self.running_batch = [r for r in self.running_batch if r not in victims]
        self.num_retractions += len(victims)
        return victims

    def _start_load_back(self, req: Req, match, reserved: int) -> bool:
        """HiCache: start loading the host-only part of ``req``'s match back to the device, if the
        budget allows (the load locks its whole path). The request then waits for the ack
        (SGLang ``init_load_back``, and the storage prefetch that starts at intake)."""
        tree = self.tree_cache
        if not (match.host_hit_length and isinstance(tree, HiRadixCache)) or req.load_back is not None:
            return False
        if match.host_hit_length + match.device_indices.numel() > \
                self.token_to_kv_pool_allocator.available_size() + tree.evictable_size() - reserved:
            return False
        req.load_back = tree.load_back(match.host_node)  # None: no room
        return req.load_back is not None

    def _evict_for(self, num_tokens: int) -> None:
        short = num_tokens - self.token_to_kv_pool_allocator.available_size()
        if short > 0:
            self.tree_cache.evict(short)

    def _last_loc(self, reqs: list[Req], lens: list[int]) -> torch.Tensor:
        rows = torch.tensor([r.kv.req_pool_idx for r in reqs], dtype=INDEX_DTYPE)
        pos = torch.tensor([n - 1 for n in lens], dtype=INDEX_DTYPE)
        table = self.req_to_token_pool.req_to_token
        loc = table[rows.to(table.device), pos.clamp(min=0).to(table.device)]
        return torch.where(pos.to(table.device) >= 0, loc, torch.full_like(loc, -1))
