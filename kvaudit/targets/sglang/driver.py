"""The driver: SGLang's scheduler loop (``Scheduler.event_loop_normal`` / ``event_loop_overlap``)
played over SGLang's own objects in the scheduler's order, so that a driver mistake never reads as
an SGLang bug. Each method names the SGLang function it follows. Injected faults act here."""

from __future__ import annotations

import numpy as np
import torch

from kvaudit.targets.sglang import compat
from kvaudit.targets.sglang.results import SglangResults
from kvaudit.targets.sglang.standins import EOS, MAX_PREFILL_TOKENS, NoSampling


class SglangDriver(SglangResults):
    """``Scheduler``'s batches: one ``step`` is one iteration of its event loop."""

    def step(self) -> None:
        """One iteration of ``Scheduler.event_loop_normal`` (``event_loop_overlap`` with ``enable_overlap``:
        the previous batch's result is processed after the next batch is allocated)."""
        self.steps += 1
        self.clock.now += 1.0
        if self.session_controller is not None:
            self.session_controller.maybe_reap(float(self.steps), interval=0.0)
            if any(not r.kv.holds_kv and not r.finished() for r in self.running):
                return  # a deferred close took a running turn's record: the scan reports it first
        self._poll_timeout_aborts()
        self._check_pending_flush()
        if self.grammar_manager is not None:  # compiles run beside the scheduler, paused or not
            self.grammar_manager.grammar_backend.tick(self.steps)
        if self.scheduler_paused:  # event_loop_*: after ingest_requests, a paused scheduler runs nothing
            self._snapshot_held()
            return
        overlap = self.config.enable_overlap
        self._process_pending_chunked_abort()
        chunked = self.chunked_req
        if chunked is not None:
            prefix_len, extend_end = self._span(chunked)
            if extend_end > prefix_len:
                self._checkpoint_chunked(chunked)
        self._join_running()
        self.running = [r for r in self.running if not r.finished()]
        batch = self._prefill() or self._decode()
        self._scheduled = batch
        if overlap:
            last, self._last = self._last, batch
            if last is not None:
                self._process(*last)
        elif batch is not None:
            self._process(*batch)
        self._snapshot_held()

    def _span(self, req) -> tuple[int, int]:
        """``(prefix_len, extend_end)`` of ``req``'s next extend: ``Req.prefix_len`` / ``extend_end``, or
        before them (change ``req-prefix-len``) ``len(prefix_indices)`` / ``extend_range.end``."""
        return compat.req_span(req, self.S.version)

    def _checkpoint_chunked(self, chunked) -> None:
        """The chunked request's KV published before the next chunk: ``common.checkpoint_kv_cache``, or
        before it (change ``req-prefix-len``) ``common.maybe_cache_unfinished_req`` (``Scheduler.
        get_new_batch_prefill``'s ``cache_unfinished_req`` of the chunked request, in both releases)."""
        if compat.has("req-prefix-len", self.S.version):
            self.S.common.checkpoint_kv_cache(chunked, self.tree_cache)
        else:
            self.S.common.maybe_cache_unfinished_req(chunked, self.tree_cache, chunked=True)

    def _snapshot_held(self) -> None:
        """What each running request holds now: if a release elsewhere takes its record away, the next scan
        still sees the request reading it."""
        table = self.req_to_token_pool.req_to_token
        self._held = {r.rid: (kv.req_pool_idx, table[kv.req_pool_idx, : kv.kv_allocated_len].clone(),
                      kv.cache_protected_len) for r in self.running if (kv := self._kv(r)).req_pool_idx is not None}

    def _join_running(self) -> None:
        """``get_next_batch_to_run``'s merge: under overlap the last prefill batch joins the running batch."""
        if self.config.enable_overlap and self._last is not None and self._last[0] == "extend":
            excluded = (self.chunked_req, self._last[2])
            self.running += [r for r in self._last[1] if not r.finished() and not r.is_retracted
                             and r not in self.running and not any(r is x for x in excluded)]

    def _prefilled(self, req) -> None:
        """A prefill result that did not finish its request: without overlap it joins the running batch."""
        if not self.config.enable_overlap:
            self.running.append(req)

    def _new_batch(self, batch, kind: str) -> None:
        """A ``ScheduleBatch`` right after ``init_new``: what a feature sets on it (nothing here)."""

    def _after_decode_alloc(self, batch) -> None:
        """After ``alloc_for_decode``: nothing here."""

    def _after_extend_alloc(self, batch) -> None:
        """After ``alloc_for_extend``: nothing here."""

    def _forward(self, batch) -> None:
        """The forward of a prefill batch (``run_batch``): nothing here (no kernel runs)."""

    def _process(self, kind: str, reqs: list, chunked=None, decoding=()) -> None:
        """``Scheduler.process_batch_result`` of an ``"extend"`` or ``"decode"`` batch: SGLang's own
        ``process_batch_result_prefill`` / ``_decode`` (:meth:`_process_by_sglang`). ``decoding``: the decode
        rows of a mixed batch, which go back to the running batch."""
        self._process_by_sglang(kind, reqs, decoding)

    def _process_pending_chunked_abort(self) -> None:
        """``Scheduler.process_pending_chunked_abort``: an aborted chunked request is released with
        ``checkpoint=False``; one no longer chunked is aborted again where it is now."""
        req, self._pending_chunked_abort = self._pending_chunked_abort, None
        if req is None:
            return
        if self.chunked_req is not req:
            if not req.finished() and req.kv.holds_kv:
                self._abort(req.rid)
            return
        self.S.prepare_abort(req, "Aborted")
        req.to_finish = None
        self._release_aborted_request(req)
        self.finished.add(req.rid)
        self.chunked_req = None
        self._release(req, checkpoint=False)

    def _allocatable(self, held: int) -> int:
        """``Scheduler.get_num_allocatable_reqs``, plus the rows the counted requests already hold."""
        return min(self.config.max_running_requests - len(self.running),
                   self.req_to_token_pool.available_size() + held)

    def _prefill(self) -> tuple[str, list, object] | None:
        """``Scheduler.get_new_batch_prefill`` with SGLang's own ``PrefillAdder``. Returns ``("extend",
        admitted, chunked_req[, decoding])`` for :meth:`_process`, or None."""
        S, cfg, cache = self.S, self.config, self.tree_cache
        gm = self.grammar_manager
        if gm is not None and gm.has_waiting_grammars():  # _get_new_batch_prefill_raw's first step
            for req in gm.get_ready_grammar_requests():
                self._add_request_to_queue(req)
        preemption = cfg.enable_priority_scheduling  # enable_priority_preemption (disable_priority_preemption unset)
        if self.chunked_req is None and (not self.waiting or (self._allocatable(0) <= 0 and not preemption)):
            return None
        running = self._running_batch(self.running, cfg.enable_overlap)
        if self.policy is not None:  # FCFS: by priority, then wait_queue_entry_time
            self.policy.calc_priority(self.waiting, running)
        mixed = cfg.enable_mixed_chunk  # is_mixed_chunk: the adder leaves one token per decode row
        adder = S.PrefillAdder(cfg.page_size, cache, self.allocator, running, cfg.new_token_ratio, MAX_PREFILL_TOKENS,
                               cfg.chunked_prefill_size, len(running.reqs) if mixed else 0,
                               cfg.priority_scheduling_preemption_threshold, max_running_requests=cfg.max_running_requests)
        if self.chunked_req is not None:
            self.chunked_req.init_next_round_input()
            self.chunked_req = adder.add_chunked_req(self.chunked_req)
        full = False  # running_batch.batch_is_full: once set, every later request must preempt
        mamba = getattr(self.req_to_token_pool, "mamba_allocator", None)  # a hybrid SSM model's slots
        if mamba is not None:  # pre-allocated for the matches' copy-on-write, the unused returned below
            mamba.alloc_group_begin(len(self.waiting))
        for req in self.waiting:
            if adder.budget_state() == S.AddReqResult.OTHER:
                break
            full = full or len(adder.can_run_list) >= min(
                cfg.max_running_requests - len(running.reqs),
                self.req_to_token_pool.available_size() + sum(r.kv.holds_kv for r in adder.can_run_list))
            # a full batch ends admission, unless the request preempts lower-priority running ones
            # (preempt_to_schedule: release_req each, then filter_batch)
            if full and (not preemption or not adder.preempt_to_schedule(req)):
                break
            if not self._prefetch_ready(req):
                continue
            req.init_next_round_input(cache)
            if self._prefetch_after_device_hit_loss(req):
                continue
            if adder.add_one_req(req, has_chunked_req=self.chunked_req is not None,
                                 truncation_align_size=None) != S.AddReqResult.CONTINUE:
                self._revert_mamba_match(req, adder)
                break
        if mamba is not None:
            mamba.alloc_group_end()
        admitted = list(adder.can_run_list)
        # the admitted leave the queue first, then the preempted come back to it (even if nothing was
        # admitted), so the queue limit sees the queue SGLang's _add_request_to_queue sees
        self.waiting = [r for r in self.waiting if not any(r is a for a in admitted)]
        if adder.preempt_list:  # released by preempt_to_schedule
            self.running = list(running.reqs)
            self._preempted(len(adder.preempt_list))
            for req in adder.preempt_list:
                self._add_request_to_queue(req)
        if not admitted:
            return None
        for req in admitted:  # set_forward_entry_time: the running timeout's start, set once (not on re-admission)
            if getattr(req, "kvaudit_forward_at", None) is None:
                req.kvaudit_forward_at = self.steps
        if adder.new_chunked_req is not None:
            assert self.chunked_req is None
            self.chunked_req = adder.new_chunked_req
        if self.chunked_req is not None:
            self.chunked_req.inflight_middle_chunks += 1
        for req in admitted:
            req.is_retracted = False  # prepare_for_extend: a retracted request is prefilled afresh
        batch = self._extend_batch(admitted)
        decoding = self._mix_with_running(batch) if mixed and self.running else []
        self._forward(batch)
        if decoding:
            return "extend", admitted + decoding, self.chunked_req, decoding
        return "extend", admitted, self.chunked_req

    def _revert_mamba_match(self, req, adder) -> None:
        """``get_new_batch_prefill``'s revert of a request the adder did not take: the match's deferred
        copy-on-write is dropped and its fresh mamba slot freed (a session's is its own)."""
        if adder.can_run_list and req is adder.can_run_list[-1]:
            return
        req.kv.mamba_cow_src_index = None
        req.kv.mamba_needs_clear = False
        if req.kv.holds_mamba and not getattr(req, "session", None):
            self.req_to_token_pool.mamba_allocator.free(req.kv.mamba_pool_idx.unsqueeze(-1))
            req.kv.mamba_pool_idx = None

    def _extend_batch(self, admitted: list):
        """``ScheduleBatch.init_new`` and ``prepare_for_extend``'s ``alloc_for_extend``."""
        S = self.S
        batch = S.ScheduleBatch.init_new(admitted, self.req_to_token_pool, self.allocator, self.tree_cache,
                                         self.model_config, self.config.enable_overlap, self._spec_algorithm(),
                                         chunked_req=self.chunked_req)
        self._new_batch(batch, "extend")
        batch.forward_mode = S.ForwardMode.EXTEND
        spans = [self._span(r) for r in admitted]
        batch.prefix_lens = [p for p, _ in spans]
        batch.extend_lens = [e - p for p, e in spans]
        batch.seq_lens_cpu = torch.tensor([e for _, e in spans], dtype=torch.int64)
        batch.seq_lens = batch.seq_lens_cpu.to(batch.device)
        batch.orig_seq_lens = batch.seq_lens.clone()
        batch.extend_num_tokens = sum(batch.extend_lens)
        batch.out_cache_loc, batch.req_pool_indices, batch.req_pool_indices_cpu = S.allocation.alloc_for_extend(batch)
        for req, (_, end) in zip(admitted, spans):  # the batch's seq_lens, carried into decode (+1 a step)
            req.kvaudit_seq_len = end
        self._after_extend_alloc(batch)
        return batch

    def _mix_with_running(self, batch) -> list:
        """``enable_mixed_chunk``: the running requests decode inside the prefill batch
        (``mix_with_running``) if they pass ``check_decode_mem``. Returns the decode rows mixed in."""
        self.running = [r for r in self.running if r not in self._finishing_inflight()]
        if not self.running:
            return []
        running = self._running_batch(self.running, False)
        if not running.check_decode_mem():
            return []
        running.forward_mode = self.S.ForwardMode.DECODE
        running.out_cache_loc = self.S.allocation.alloc_for_decode(running, 1)
        for req in running.reqs:
            req.kvaudit_seq_len += 1
        self._after_decode_alloc(running)
        running.seq_lens_cpu = running.seq_lens_cpu + 1
        running.seq_lens = running.seq_lens + 1
        batch.sampling_info = NoSampling()
        batch.extend_logprob_start_lens = [0] * len(batch.reqs)  # (logprobs: model-side; mix_with_running extends it)
        batch.mix_with_running(running)
        decoding = list(running.reqs)
        self.running = []
        return decoding

    def _finishing_inflight(self) -> list:
        """``Scheduler._reqs_finishing_inflight`` (overlap)."""
        if not self.config.enable_overlap or self._last is None:
            return []
        queued = set(map(id, self._last[1]))
        return [r for r in self.running if id(r) in queued and r.next_output_finishes_by_length()]

    def _decode(self) -> tuple[str, list, None] | None:
        """``Scheduler.update_running_batch``: ``check_decode_mem``, ``retract_decode`` when it fails (or under
        memory pressure), ``alloc_for_decode``. Returns ``("decode", reqs, None)`` or None."""
        S = self.S
        finishing = self._finishing_inflight()
        self.running = [r for r in self.running if r not in finishing]
        if not self.running:
            return None
        batch = self._running_batch(self.running, False)
        batch.forward_mode = S.ForwardMode.DECODE
        full = not batch.check_decode_mem()
        if full and finishing:
            return None  # the queued result frees the finishing requests' KV: decode the rest next step
        if self._force_retract or full:
            forced, self._force_retract = self._force_retract, False
            before = self.allocator.available_size() + self.tree_cache.evictable_size()
            retracted, _, aborted = batch.retract_decode()
            self.retractions += len(retracted) + len(aborted)
            freed = self.allocator.available_size() + self.tree_cache.evictable_size() - before
            why = ("forced by memory pressure" if forced else "nothing left to retract" if not batch.reqs
                   else "one request left" if len(batch.reqs) == 1 else "check_decode_mem passes")
            self.last_retraction = (f"step {self.steps}: retracted {len(retracted)} request(s)"
                                    + (f", aborted {len(aborted)}" if aborted else "")
                                    + f", freed {freed} tokens (available + evictable); stopped: {why}; "
                                    f"{len(batch.reqs)} kept")
            for req in retracted:
                self._add_request_to_queue(req, is_retracted=True)
            for req in aborted:  # released inside retract_decode; the client gets the abort
                self.finished.add(req.rid)
            self.running = list(batch.reqs)
            if not batch.reqs:
                return None
        self._decode_alloc(batch)
        self._after_decode_alloc(batch)
        return "decode", list(batch.reqs), None

    def _decode_alloc(self, batch) -> None:
        """``ScheduleBatch.prepare_for_decode``'s allocation: ``alloc_for_decode(batch, 1)`` (the out cache locations
        kept on the batch), each request's seq_len one longer."""
        batch.out_cache_loc = self.S.allocation.alloc_for_decode(batch, 1)
        for req in batch.reqs:
            req.kvaudit_seq_len += 1

    def _spec_algorithm(self):
        """The ``SpeculativeAlgorithm`` every ``ScheduleBatch`` is built with (``Scheduler.spec_algorithm``): none."""
        return self.S.SpeculativeAlgorithm.NONE

    def _running_batch(self, reqs: list, overlap: bool):
        """``Scheduler.running_batch`` as a ``ScheduleBatch`` of ``reqs``."""
        S = self.S
        batch = S.ScheduleBatch.init_new(list(reqs), self.req_to_token_pool, self.allocator, self.tree_cache,
                                         self.model_config, overlap, self._spec_algorithm())
        self._new_batch(batch, "decode")
        batch.req_pool_indices_cpu = torch.tensor([r.kv.req_pool_idx for r in reqs], dtype=torch.int64)
        batch.req_pool_indices = batch.req_pool_indices_cpu.to(batch.device)
        batch.seq_lens_cpu = torch.tensor([r.kvaudit_seq_len for r in reqs], dtype=torch.int64)
        batch.seq_lens = batch.seq_lens_cpu.to(batch.device)
        batch.orig_seq_lens = batch.seq_lens.clone()
        batch.sampling_info = NoSampling()
        return batch

    def _sample(self, req) -> int:
        """The stand-in sampler's next token of ``req``."""
        return self._sample_at(req, len(req.output_ids))

    def _sample_at(self, req, n: int) -> int:
        """The stand-in sampler's output token ``n`` of ``req`` (a function of the request and position;
        ``EOS`` at its planned stop)."""
        if getattr(req, "kvaudit_stop_at", None) is not None and n + 1 >= req.kvaudit_stop_at:
            return EOS
        return 2 + ((len(req.origin_input_ids) + n) * 7 + 3) % (self.config.vocab_size - 2)

    def _release(self, req, checkpoint: bool) -> None:
        """``release_kv_cache(req, tree_cache, checkpoint=...)``; injected faults act here."""
        self.finished.add(req.rid)
        if "skip-release" in self._faults:
            self._faults.discard("skip-release")
            return
        mine = None
        if "double-free" in self._faults and req.kv.holds_kv and req.session is None:
            kv = req.kv
            mine = self._pages(self.req_to_token_pool.req_to_token[kv.req_pool_idx,
                                                                     kv.cache_protected_len:kv.kv_allocated_len])
        compat.release_kv(self.S, req, self.tree_cache, checkpoint)  # (before 0.5.22: is_insert, positional)
        if mine is not None:  # free once more what this release gave back (none: wait for the next)
            freed = np.setdiff1d(mine, self._pages(self.tree_cache.all_values_flatten()))
            if freed.size:
                self._faults.discard("double-free")
                self.allocator.free(torch.as_tensor(freed, dtype=torch.int64) * self.config.page_size)

    def _inject_lock_leak(self) -> None:
        cache = self.tree_cache
        unlock = cache.unlock

        def unlock_dropping_one(lock):
            if lock is not None and "lock-leak" in self._faults and lock.node != cache.root_node_handle():
                self._faults.discard("lock-leak")
                return None
            return unlock(lock)

        cache.unlock = unlock_dropping_one

    def _inflight(self) -> list:
        """``Scheduler.collect_inflight_reqs``: the running batch, the last batch, the chunked request."""
        reqs = list(self.running)
        if self._last is not None:
            reqs += [r for r in self._last[1] if not any(r is x for x in reqs)]
        if self.chunked_req is not None and not any(self.chunked_req is x for x in reqs):
            reqs.append(self.chunked_req)
        return reqs

    def _active(self) -> list:
        """Waiting requests (and the grammar queue's), then the in-flight ones."""
        queued = self.waiting + (self.grammar_manager.grammar_queue if self.grammar_manager is not None else [])
        return queued + [r for r in self._inflight() if not any(r is w for w in queued)]

    def _preempted(self, n: int) -> None:
        # NOTE: here, last in the file, so that no recorded frame's line moves (corpora/*: kvaudit replay --update)
        self.retractions += n
        self.priority_preemptions += n  # (reach: priority_preemptions)
