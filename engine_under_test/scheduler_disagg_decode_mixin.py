"""PD disaggregation, decode side: pre-allocation for incoming transfers, the transfer queue, failed
transfers, rebootstrap after a retract pause, and the prebuilt batch.

SGLang 0.5.23 ``srt/disaggregation/decode.py`` (``SchedulerDisaggregationDecodeMixin``,
``DecodePreallocQueue``, ``DecodeTransferQueue``). ``_pre_alloc`` stays in ``scheduler.py``
(shipped signatures name it ``_pre_alloc@scheduler.py``).
"""

from __future__ import annotations

import torch

from engine_under_test import model as model_mod
from engine_under_test.memory import INDEX_DTYPE
from engine_under_test.req import FinishReason, Req
from engine_under_test.schedule_batch import PREBUILT, ScheduleBatch


class SchedulerDisaggregationDecodeMixin:
    def process_decode_queue(self) -> None:
        """``pop_preallocated`` then ``pop_transferred``; failed transfers first.

        Pre-allocation takes the queue's head while a row is free and ``fill - prefix + remaining
        output + 2 pages`` fits the free tokens less those promised to admitted requests. With the
        decode radix cache (SGLang 0.5.23 ``DecodePreallocQueue.pop_preallocated``,
        ``_match_prefix_and_lock``, ``_allocatable_token_budgets``) the prompt's cached prefix is
        matched and locked first (not for a rebootstrap), evictable tokens count as free, and the
        lock is dropped again when the request does not fit. Unlike SGLang, at least the prompt's
        last token is transferred: our transfer stand-in computes the hand-off token from it."""
        if self.failed_transfers:
            self.poll_transfer_failures()
        alloc, tree = self.token_to_kv_pool_allocator, self.tree_cache
        reserved = self._reserved_tokens(self.running_batch + self.waiting_queue + self.disagg_transfer_queue)
        while self.disagg_prealloc_queue:
            req = self.disagg_prealloc_queue[0]
            fill_len = self._pre_alloc_fill_len(req)
            match = None
            if not tree.disable and not req.pd_rebootstrap_in_progress:
                match = tree.match_prefix(req.origin_input_ids[: fill_len - 1])
                tree.inc_lock_ref(match.last_node)
            prefix = 0 if match is None else match.device_indices.numel()
            need = fill_len - prefix + req.max_new_tokens - len(req.output_ids) + 2 * self.page_size
            if self.req_to_token_pool.available_size() == 0 or \
                    need > alloc.available_size() + tree.evictable_size() - reserved:
                if match is not None:
                    tree.dec_lock_ref(match.last_node)
                break
            if match is not None:
                req.prefix_indices, req.last_node = match.device_indices, match.last_node
            self._pre_alloc(req, fill_len)
            reserved += need
            self.disagg_prealloc_queue.pop(0)
            fake = req.is_health_check  # FAKE_BOOTSTRAP_HOST: the transfer completes at once
            req.transfer_ready_step = self.forward_ct + (0 if fake else self.config.transfer_latency_steps)
            self.disagg_transfer_queue.append(req)
        for req in list(self.disagg_transfer_queue):
            if self.forward_ct < req.transfer_ready_step:
                continue
            if not self._commit_transfer_to_req(req):
                continue  # HiSparse: no device buffer yet; retry next step
            self.disagg_transfer_queue.remove(req)
            self.waiting_queue.append(req)

    def _reserved_tokens(self, reqs) -> int:
        """PD decode pre-allocation: tokens still promised to ``reqs`` (their remaining decode
        steps plus a page of slack each)."""
        return sum(r.max_new_tokens - len(r.output_ids) + self.page_size for r in reqs)

    def poll_transfer_failures(self) -> None:
        """Abort every queued request whose receiver polls ``KVPoll.Failed`` (SGLang 0.5.23
        ``srt/disaggregation/decode.py``): in the prealloc queue, nothing is held yet
        (``DecodePreallocQueue._update_handshake_waiters``, then ``pop_preallocated`` drops it); in the
        transfer queue, its row and pre-allocated KV (HiSparse: its host slots and any device buffer)
        are released without caching (``DecodeTransferQueue.pop_transferred``, ``_release_request``).
        A transferred request waiting to join fails when its prebuilt batch is formed
        (:meth:`get_next_disagg_decode_batch_to_run`), so its rid is kept; any other is dropped."""
        failed = self.failed_transfers
        for req in [r for r in self.disagg_prealloc_queue if r.rid in failed]:
            self.disagg_prealloc_queue.remove(req)
            req.finished_reason = FinishReason.ABORT
            self._emit(req)
        for req in [r for r in self.disagg_transfer_queue if r.rid in failed]:
            self.disagg_transfer_queue.remove(req)
            req.finished_reason = FinishReason.ABORT
            self._release_finished(req, checkpoint=False)
        pending = self.waiting_queue + self.held_rebootstrap_reqs + [m.req for m in self.recv_queue if m.req]
        self.failed_transfers = failed & {r.rid for r in pending}

    @staticmethod
    def _pre_alloc_fill_len(req: Req) -> int:
        """Positions the transfer fills (SGLang ``_pre_alloc_fill_len``): a rebootstrap's whole text
        (its last token was popped to be replayed as the hand-off), else all but the last output."""
        if req.pd_rebootstrap_in_progress:
            return len(req.origin_input_ids) + len(req.output_ids)
        return len(req.origin_input_ids) + max(len(req.output_ids) - 1, 0)

    def _commit_transfer_to_req(self, req: Req) -> bool:
        """The prefill side's KV of ``[cache_protected_len, committed)`` has landed (a decode-radix
        prefix hit was not sent): compute it (our stand-in for RDMA) and append the
        hand-off token (a rebootstrap replays the token it popped); HiSparse admits the request
        straight into its device buffer first. Returns False, changing nothing but the KV content,
        if HiSparse has no buffer room."""
        n, p = req.kv.kv_committed_len, req.kv.cache_protected_len  # decode radix: [0, p) was not sent
        row = req.kv.req_pool_idx
        hs = self.hisparse_coordinator
        if self.model is None:
            tok = model_mod.pseudo_next_token(req.fill_ids[n - 1], n - 1, self.config.vocab_size)
        else:
            dev = self.kv_pool.k_buffer.device
            toks = torch.tensor(req.fill_ids[p:n], dtype=INDEX_DTYPE, device=dev)
            pos = torch.arange(n, dtype=INDEX_DTYPE, device=dev)
            if hs is not None:
                target, loc = hs.host_pool, hs.req_to_host_pool[row][:n].to(dev)
            else:
                target, loc = self.kv_pool, self.req_to_token_pool.req_to_token[row, :n]
            tok = self.model.forward(target, toks, pos[p:], loc[p:], loc, pos)
        if hs is not None and not hs.admit_request_direct(req):
            return False
        if req.pd_rebootstrap_forced_output_id is not None:
            tok, req.pd_rebootstrap_forced_output_id = req.pd_rebootstrap_forced_output_id, None
        req.pd_rebootstrap_in_progress = False
        self._append_token(req, tok)
        return True

    def get_next_disagg_decode_batch_to_run(self) -> ScheduleBatch | None:
        """Prebuilt batch (processed at once), then the decode batch over the running requests
        (SGLang 0.5.23 ``get_next_disagg_decode_batch_to_run``, ``get_new_prebuilt_batch``). A picked
        request whose transfer was reported failed is aborted and released there, as a KV checksum
        mismatch is (``_verify_kv_checksums``, ``_handle_kv_checksum_mismatch``)."""
        self.running_batch = [r for r in self.running_batch if not r.finished()]
        room = min(self.req_to_token_pool.size, self.config.max_running_requests) - len(self.running_batch)
        ran_prebuilt = False
        if room > 0 and self.waiting_queue:
            reqs, self.waiting_queue = self.waiting_queue[:room], self.waiting_queue[room:]
            for req in [r for r in reqs if r.rid in self.failed_transfers]:
                # _verify_kv_checksums -> _handle_kv_checksum_mismatch: the received KV is bad
                self.failed_transfers.discard(req.rid)
                reqs.remove(req)
                req.finished_reason = FinishReason.ABORT
                self._release_finished(req, checkpoint=False)
            prebuilt = ScheduleBatch(reqs, PREBUILT)
            for req in reqs:  # process_prebuilt
                self.checkpoint_kv_cache(req)
            self.process_batch_result_prebuilt(prebuilt)
            self.running_batch.extend(r for r in reqs if not r.finished())
            ran_prebuilt = True
        batch = self.update_running_batch()
        if batch is None and ran_prebuilt:
            return ScheduleBatch([], PREBUILT)  # the prebuilt step counts as work done
        return batch

    def process_batch_result_prebuilt(self, batch: ScheduleBatch) -> None:
        """Finish requests on their hand-off token (``max_new_tokens == 1``, EOS, or an abort)."""
        for req in batch.reqs:
            req.update_finish_state(self._eos(req))
            if not req.finished():
                continue
            if "hisparse-prebuilt-skip-finish" in self.config.bugs:
                # BUG (sglang PR #22882): the prebuilt finish path released the KV row without
                # HiSparseCoordinator.request_finished, so the device buffer and host slots leaked.
                self.release_kv_cache(req, checkpoint=True)
                self._emit(req)
            else:
                self._release_finished(req, checkpoint=True)

    def _hold_rebootstrap(self, reqs: list[Req]) -> None:
        """PD decode retraction (SGLang ``hold_rebootstrap``): the last emitted token is popped and
        kept as the hand-off token of a new transfer of the rest, which is queued at continue."""
        for req in reqs:
            if req.output_ids:
                req.pd_rebootstrap_forced_output_id = req.output_ids.pop()
            req.pd_rebootstrap_in_progress = True
        self.held_rebootstrap_reqs.extend(reqs)
