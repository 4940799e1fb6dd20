"""Running a batch and its tokens: the forward (KV written, one token sampled per row) and the
end-of-sequence rules the result processing applies.

SGLang 0.5.23: ``srt/managers/scheduler.py`` (``run_batch``) and
``srt/managers/scheduler_components/batch_result_processor.py`` (before it,
``scheduler_output_processor_mixin.py``'s ``SchedulerOutputProcessorMixin``).
``process_batch_result`` stays in ``scheduler.py`` (shipped signatures name it
``process_batch_result@scheduler.py``).
"""

from __future__ import annotations

import torch

from engine_under_test import model as model_mod
from engine_under_test.memory import INDEX_DTYPE
from engine_under_test.req import FinishReason, Req
from engine_under_test.schedule_batch import EOS_TOKEN, EXTEND, PREBUILT, ScheduleBatch


class SchedulerOutputProcessorMixin:
    def run_batch(self, batch: ScheduleBatch) -> None:
        """Forward every row of ``batch``: write its KV and sample one token per sampling row.

        Sampled tokens go to ``req.future_ids`` (SGLang's future token map) until the result is
        processed. A middle prefill chunk samples nothing. A decode row already marked ``to_finish``
        (aborted while in flight) computes nothing: SGLang would discard its token anyway, and the
        KV of its new position is never written (the state sglang PR #28374 is about). A prefill row
        is computed even when marked (an aborted request prefilled again after a retract pause, or
        one aborted at intake): its chunk may be checkpointed into the tree before its result ends it.
        """
        if batch.forward_mode == PREBUILT:
            return
        off = 0
        for req in batch.reqs:
            prefill_row = batch.forward_mode == EXTEND and id(req) not in batch.decode_ids
            if prefill_row:
                start, end = req.prefix_len, req.extend_end
                sampled = end >= len(req.fill_ids)
            else:
                end = req.kv.kv_committed_len
                start, sampled = end - 1, True
            locs = batch.out_cache_loc if batch.model_loc is None else batch.model_loc
            loc = locs[off : off + end - start]
            off += end - start
            batch.sampled.append(sampled)
            if req.to_finish is not None and not prefill_row:
                tok = EOS_TOKEN
            else:
                tok = self._forward(req, start, end, loc)
            if sampled:  # the sampler emits the EOS, so a forward that runs before the result reads it
                req.future_ids.append(EOS_TOKEN if self._eos_at(req, len(req.output_ids) + len(req.future_ids) + 1)
                                      else tok)
        if batch.host_loc is not None:
            self.hisparse_coordinator.backup(batch.model_loc, batch.host_loc)

    def _forward(self, req: Req, start: int, end: int, write_loc: torch.Tensor) -> int:
        fill = req.fill_ids + req.future_ids
        if self.model is None:
            return model_mod.pseudo_next_token(fill[end - 1], end - 1, self.config.vocab_size)
        dev = self.kv_pool.k_buffer.device
        tokens = torch.tensor(fill[start:end], dtype=INDEX_DTYPE, device=dev)
        positions = torch.arange(start, end, dtype=INDEX_DTYPE, device=dev)
        hs = self.hisparse_coordinator
        if hs is not None and req.hisparse_admitted:
            ctx_loc, ctx_pos = hs.physical_context(req)
        elif hs is not None:
            ctx_loc, ctx_pos = hs.prefill_context(req.kv.req_pool_idx, end)
        else:
            ctx_loc = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :end]
            ctx_pos = torch.arange(end, dtype=INDEX_DTYPE, device=dev)
        return self.model.forward(self.kv_pool, tokens, positions, write_loc, ctx_loc, ctx_pos)

    @staticmethod
    def _eos_at(req: Req, n: int) -> bool:
        """Whether the token that makes the output ``n`` long is an EOS: the one sampled at output
        length ``stop_at``. A request that ignores EOS runs past it, so only that one is."""
        return req.stop_at is not None and (n == req.stop_at if req.ignore_eos else n >= req.stop_at)

    def _eos(self, req: Req) -> bool:
        return self._eos_at(req, len(req.output_ids))

    def _append_token(self, req: Req, tok: int) -> None:
        req.output_ids.append(tok)
        if self._eos(req):
            req.output_ids[-1] = EOS_TOKEN
        req.update_finish_state(self._eos(req))

    def _caches_on_release(self, req: Req) -> bool:
        """Whether a finished request's KV is inserted into the tree: not for an abort (its KV may
        be incomplete; sglang PR #28374), unless the ``aborted-kv-inserted`` switch is on."""
        if req.finished_reason != FinishReason.ABORT:
            return True
        # BUG (sglang PR #28374): an aborted request was cached like a finished one, including
        # positions whose KV its skipped last forward never wrote.
        return "aborted-kv-inserted" in self.config.bugs
