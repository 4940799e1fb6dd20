"""Ingest: the messages a step takes in, admission checks at intake, the waiting queue, and the
pause, continue and flush handlers.

SGLang 0.5.23 keeps these in ``srt/managers/scheduler.py`` itself (``process_input_requests``,
``_add_request_to_queue``, ``init_req_max_new_tokens``, ``flush_cache``, ``pause_generation``,
``continue_generation``), fed by ``scheduler_components/request_receiver.py``. ``handle_abort``
stays in ``scheduler.py`` (shipped signatures name it ``handle_abort@scheduler.py``).
"""

from __future__ import annotations

import sys

from engine_under_test.req import FinishReason, Req
from engine_under_test.schedule_batch import EXTEND


class SchedulerInputMixin:
    def process_input_requests(self) -> None:
        msgs, self.recv_queue = self.recv_queue, []
        sc = self.session_controller
        if sc is not None:
            sc.reap()
        for m in msgs:
            if m.kind == "open_session":
                sc.open(m.session_id)
                continue
            if m.kind == "close_session":
                sc.close(m.session_id)
                continue
            if m.session_id is not None:
                sc.create_req(m.session_id, m.req)
            if m.kind == "abort":
                self.handle_abort(m.rid, m.abort_all)
                continue
            if m.kind == "flush_cache":
                self.flush_results.append(self.flush_cache())
                continue
            if m.kind == "pause_generation":
                self.handle_pause_generation(m.mode)
                continue
            if m.kind == "continue_generation":
                self.handle_continue_generation()
                continue
            if m.kind == "memory_pressure":
                self.tree_cache.evict(self.tree_cache.evictable_size())
                self._force_retract = not self.config.is_pd_decode  # PD decode has no re-prefill path
                continue
            if m.kind == "health_check" and not self.is_fully_idle(for_health_check=True):
                # Busy: drop it and answer after the next batch, touching no memory.
                self.pending_health_check_acks += 1
                continue
            rejected = not m.req.intake_aborted and self.init_req_max_new_tokens(m.req)
            if rejected and self.config.is_pd_decode:
                m.req.finished_reason = FinishReason.ABORT  # too long: PD decode answers at once, holding nothing
                self._end_session_turn(m.req)
                self._emit(m.req)
            elif self.config.is_pd_decode:
                self.disagg_prealloc_queue.append(m.req)
            elif self._add_request_to_queue(m.req) and self.hicache_host_pool is not None and m.req.session is None:
                fill = m.req.fill_ids  # prefetch at intake
                self._start_load_back(m.req, self.tree_cache.match_prefix(fill[: len(fill) - 1]),
                                      self._running_token_offset())

    def _add_request_to_queue(self, req: Req) -> bool:
        """Queue ``req`` for prefill; returns False if it was aborted instead (SGLang 0.5.23
        ``Scheduler._add_request_to_queue``, ``_set_or_validate_priority``, ``_abort_on_queued_limit``).

        With priority scheduling a request without a priority gets the lowest (``sys.maxsize`` on the
        preferred side's far end). With ``max_queued_requests`` waiting already, the newcomer is
        aborted; with priority scheduling the least preferred waiting request (the newest on a tie)
        is aborted instead when the newcomer is strictly preferred. Each entry gets a fresh serial
        (``wait_queue_entry_time``). Nothing of the aborted one is held: it only gets its output."""
        cfg = self.config
        if cfg.enable_priority_scheduling and req.priority is None:
            req.priority = sys.maxsize if cfg.schedule_low_priority_values_first else -sys.maxsize - 1
        if cfg.max_queued_requests is not None and len(self.waiting_queue) >= cfg.max_queued_requests:
            victim = req
            if cfg.enable_priority_scheduling:
                worst = max(self.waiting_queue, key=self._priority_key)
                if self._priority_key(req)[0] < self._priority_key(worst)[0]:
                    victim = worst
                    self.waiting_queue.remove(worst)
            victim.finished_reason = FinishReason.ABORT
            self._end_session_turn(victim)
            if victim.load_back is not None:  # tree_cache.finish(ABORT): released at its ack
                self.orphan_load_backs.append(victim.load_back)
                victim.load_back = None
            self._emit(victim)
            if victim is req:
                return False
        req.wait_queue_entry = next(self._queue_ct)
        self.waiting_queue.append(req)
        return True

    def _priority_key(self, req: Req) -> tuple[int, int]:
        """Sort key of the waiting queue with priority scheduling, most preferred first (SGLang
        ``SchedulePolicy._sort_by_priority_and_fcfs``): priority (larger first unless
        ``schedule_low_priority_values_first``), then the earliest entry."""
        sign = 1 if self.config.schedule_low_priority_values_first else -1
        return sign * req.priority, req.wait_queue_entry

    def _end_session_turn(self, req: Req) -> None:
        if self.session_controller is not None:
            self.session_controller.abort_req(req)

    def init_req_max_new_tokens(self, req: Req) -> bool:
        """Trim ``max_new_tokens`` to what the context and an empty pool leave (tokens; it may become
        0: one prefill, then a length finish), then validate the input length; returns True, after
        ``set_finish_with_abort``, for an input of at least ``min(context_len - 1, pool - 1) - 5``
        tokens (SGLang ``Scheduler.init_req_max_new_tokens``, ``max_new_tokens_for_memory`` of
        ``mem_cache/allocator/base.py`` and ``managers/utils.py:validate_input_length``, with
        ``max_req_input_len`` from ``tp_worker.py``). Rejection depends on the input alone."""
        pool, n = self.token_to_kv_pool_allocator.size, len(req.origin_input_ids)
        max_req_len = min(self.config.context_len - 1, pool - 1)
        req.max_new_tokens = max(0, min(req.max_new_tokens, max_req_len - n - 1,
                                        pool - self.ceil_page(n) - self.page_size - 1))
        if n < max_req_len - 5:
            return False
        self.set_finish_with_abort(req)
        return True

    def set_finish_with_abort(self, req: Req) -> Req:
        """Reject ``req`` at intake the SGLang way: it still runs one cheap prefill of a single
        token, then finishes with an abort."""
        req.origin_input_ids = req.origin_input_ids[:1]
        req.max_new_tokens, req.stop_at = 1, None
        req.to_finish, req.intake_aborted = FinishReason.ABORT, True
        return req

    def flush_cache(self) -> bool:
        """Drop the radix tree and return every pool to its initial state, only when fully idle.

        Returns False, touching nothing, while any request is queued or running (SGLang
        ``flush_cache``: "Cache not flushed because there are pending requests"). While paused,
        waiting requests that hold no memory do not count (``is_fully_idle(ignore_waiting=paused)``):
        a retract pause followed by a flush is how a weight update drops the old KV.
        """
        if not self.is_fully_idle(ignore_waiting=self._engine_paused):
            return False
        self.tree_cache.reset()
        if self.hicache_host_pool is not None:
            self.hicache_host_pool.clear()
            self.orphan_load_backs.clear()
        if self.session_controller is not None:
            self.session_controller.clear_slots()
        self.req_to_token_pool.clear()
        self.token_to_kv_pool_allocator.clear()
        hs = self.hisparse_coordinator
        if hs is not None:
            hs.clear()
            hs.hisparse_attn_allocator.clear()
            hs.host_pool.clear()
        return True

    def handle_pause_generation(self, mode: str) -> None:
        """SGLang ``Scheduler.pause_generation`` (``srt/managers/scheduler.py``), at intake.

        ``in_place``: only the flag; running batch, last batch and chunked request stay as they are
        and the normal loop picks them up at continue. ``retract``: with overlap the pending result
        is processed first; a chunked request with a recorded abort is released as the next round
        would (``process_pending_chunked_abort``); then every unfinished request of the running
        batch, of the last batch when it was a prefill, and the chunked request is retracted
        (``retract_all``: :meth:`release_req`, the retraction release path) and queued again (PD
        decode: with the transferred waiting requests, held for a rebootstrap, see
        :meth:`_hold_rebootstrap`). Last batch and chunked request are cleared.
        """
        self._engine_paused = True
        if mode == "in_place":
            return
        if self.config.enable_overlap and self.last_batch is not None:
            self.process_batch_result(self.last_batch)
            self.maybe_send_health_check_signal()
        chunked = self.chunked_req
        if chunked is not None and self._pending_chunked_abort:
            self._pending_chunked_abort = False
            chunked.finished_reason = FinishReason.ABORT
            self._release_finished(chunked, checkpoint=False)
        last = self.last_batch.reqs if self.last_batch is not None and self.last_batch.forward_mode == EXTEND else []
        staged = []  # PD decode: transferred requests waiting to join hold their KV; rebuild it too
        if self.config.is_pd_decode:
            staged = [r for r in self.waiting_queue if r.kv.holds_kv]
            self.waiting_queue = [r for r in self.waiting_queue if not r.kv.holds_kv]
        reqs = [r for r in self.running_batch + last + [chunked] if r is not None and not r.finished()]
        reqs = list({id(r): r for r in reqs + staged if r.kv.holds_kv}.values())  # staged: even finished at hand-off
        self.last_batch = self.chunked_req = None
        self.running_batch = []
        for req in reqs:
            self.release_req(req)
        self.num_retractions += len(reqs)
        if self.config.is_pd_decode:
            self._hold_rebootstrap(reqs)
        else:
            for req in reqs:
                self._add_request_to_queue(req)

    def handle_continue_generation(self) -> None:
        """SGLang ``Scheduler.continue_generation``: clear the flag; PD decode queues the held
        rebootstraps for preallocation (``enqueue_held_rebootstrap``)."""
        self._engine_paused = False
        self.disagg_prealloc_queue.extend(self.held_rebootstrap_reqs)
        self.held_rebootstrap_reqs = []
