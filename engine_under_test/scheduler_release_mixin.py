"""Release and checkpoint: publishing a request's KV into the tree, the finish path, and the
finished output.

SGLang 0.5.23 ``srt/mem_cache/common.py`` (``release_kv_cache``, ``checkpoint_kv_cache``).
``release_kv_cache`` itself, the single release entry point, stays in ``scheduler.py`` (shipped
signatures name it ``release_kv_cache@scheduler.py``).
"""

from __future__ import annotations

import torch

from engine_under_test.req import Req, ReqKvInfo
from engine_under_test.schedule_batch import FinishedOutput


class SchedulerReleaseMixin:
    def ceil_page(self, n: int) -> int:
        return -(-n // self.page_size) * self.page_size

    def row_slots(self, kv: ReqKvInfo, start: int, end: int) -> torch.Tensor:
        """A copy of the slots (``[max(0, end - start)] int64``) at positions ``[start, end)`` of ``kv``'s row."""
        return self.req_to_token_pool.req_to_token[kv.req_pool_idx, start:max(start, end)].clone()

    def _release_finished(self, req: Req, checkpoint: bool) -> None:
        """A finish path: tell HiSparse the request is done, then ``release_kv_cache``."""
        if self.hisparse_coordinator is not None:
            self.hisparse_coordinator.request_finished(req)
        self.release_kv_cache(req, checkpoint=checkpoint)
        self._emit(req)

    def _emit(self, req: Req) -> None:
        self.finished_outputs.append(FinishedOutput(req.rid, req.finished_reason, list(req.output_ids)))
        if req.is_health_check:
            self.health_check_acks += 1

    def checkpoint_kv_cache(self, req: Req, up_to: int | None = None) -> None:
        """Publish ``[0, page_floor(up_to))`` into the tree (default ``kv_committed_len``) and move
        the lock there.

        Slots of positions the tree already held are freed and the row is re-pointed to the
        tree's (SGLang ``checkpoint`` / legacy ``cache_unfinished_req``). A session turn publishes
        only its session's first prompt, under the slot's lock (``try_checkpoint``).
        """
        tree = self.tree_cache
        up_to = req.kv.kv_committed_len if up_to is None else up_to
        slot = req.borrowed_slot
        if tree.disable or (slot is not None and not slot.publishes_prompt):
            req.prefix_len = max(req.prefix_len, up_to)
            return
        if slot is not None:  # the slot's lock moves to the request for the insert, then back
            req.lock, slot.lock = slot.lock, None
            self.checkpoint_kv_cache_into_tree(req, up_to)
            slot.lock, req.lock = req.lock, None
        else:
            self.checkpoint_kv_cache_into_tree(req, up_to)

    def checkpoint_kv_cache_into_tree(self, req: Req, up_to: int) -> None:
        tree = self.tree_cache
        n = up_to // self.page_size * self.page_size
        row = req.kv.req_pool_idx
        table = self.req_to_token_pool.req_to_token
        key = req.fill_ids[:n]
        already = tree.insert(req.fill_ids[:up_to], table[row, :n])  # the tree keeps whole pages only
        start = req.kv.cache_protected_len
        if already > start:
            self.token_to_kv_pool_allocator.free(table[row, start:already].clone())
        match = tree.match_prefix(key)
        table[row, start:n] = match.device_indices[start:n]
        tree.inc_lock_ref(match.last_node)
        if req.lock is not None:
            tree.dec_lock_ref(req.lock)
        req.lock = req.last_node = match.last_node
        req.kv.cache_protected_len = n
        req.prefix_len = max(req.prefix_len, n)
