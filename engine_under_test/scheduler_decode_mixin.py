"""Decode: whether one decode step fits, and retraction when it does not.

SGLang 0.5.23 ``srt/managers/schedule_batch.py`` (``ScheduleBatch.check_decode_mem``,
``retract_decode``, ``release_req``). ``update_running_batch`` stays in ``scheduler.py`` (shipped
signatures name it ``update_running_batch@scheduler.py``).
"""

from __future__ import annotations

from engine_under_test.req import FinishReason, Req


class SchedulerDecodeMixin:
    def _decode_need(self, reqs: list[Req]) -> int:
        """Tokens one decode step takes: a fresh page for each request whose next position starts one."""
        ps = self.page_size
        return ps * sum(r.kv.kv_allocated_len % ps == 0 for r in reqs)

    def _decode_fits(self, reqs: list[Req]) -> bool:
        """SGLang ``check_decode_mem``: one decode step fits in free plus evictable tokens."""
        return self._decode_need(reqs) <= self.token_to_kv_pool_allocator.available_size() + self.tree_cache.evictable_size()

    def retract_decode(self, reqs: list[Req], force: bool = False) -> list[Req]:
        """Decode out of memory: retract requests until one step fits (SGLang ``retract_decode``).

        Victims go in SGLang's order: fewest output tokens first, then longest prompt. Each is
        released without caching (:meth:`release_req`) and re-queued at the front of the waiting
        queue, to re-prefill prompt + output later. At least one request is kept; if even that one
        does not fit, it is aborted. ``force`` (memory pressure) retracts all but one. Returns the
        requests that stay.
        """
        keep = sorted(reqs, key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)), reverse=True)
        retracted = []
        while len(keep) > 1 and (force or not self._decode_fits(keep)):
            victim = keep.pop()
            self.release_req(victim)
            retracted.append(victim)
        if not self._decode_fits(keep):
            self.abort_retracted_last(keep.pop())
        self.running_batch = [r for r in self.running_batch if r in keep]
        for r in retracted:  # their wait_queue_entry_time is stamped again (priority scheduling's FCFS tie)
            r.wait_queue_entry = next(self._queue_ct)
        self.waiting_queue[:0] = retracted
        self.num_retractions += len(retracted)
        return [r for r in reqs if r in keep]

    def abort_retracted_last(self, req: Req) -> None:
        """"Out of memory even after retracting all other requests": ``req`` gets ``to_finish``
        and is released as a retraction (:meth:`release_req`) before it finishes, so a session turn's
        record stays with its session and the turn becomes the session's last one, its output so
        far kept (SGLang 0.5.23 ``ScheduleBatch.retract_decode``, ``release_req``, then
        ``StreamingSession.try_cache_finished_req`` and ``Session.finish_req``)."""
        req.to_finish = FinishReason.ABORT
        self.release_req(req)
        req.update_finish_state(False)
        if self.session_controller is not None:
            self.session_controller.finish_req(req)
        self._emit(req)

    def release_req(self, req: Req) -> None:
        """Release a retracted request's KV without caching it, and reset it to re-prefill."""
        if "retract-unaligned-page" in self.config.bugs:
            # BUG (sglang PR #4977): the retraction free range began at the cached prompt's end padded up to a
            # page, so the page that holds an unaligned prompt end (and the first decode tokens) was skipped.
            req.kv.cache_protected_len = max(req.kv.cache_protected_len, self.ceil_page(req.extend_end))
        if self.hisparse_coordinator is not None:
            self.hisparse_coordinator.retract_req(req)
        self.release_kv_cache(req, checkpoint=False)
        req.future_ids.clear()  # overlap: the in-flight token is dropped and sampled again
        req.kv.kv_committed_len = req.kv.cache_protected_len = 0  # reset_for_retract
        req.prefix_len = req.extend_end = 0
        req.prefix_indices, req.last_node = None, None
