"""The scheduler: SGLang's event loop over the memory pools.

Modelled on SGLang 0.5.x ``srt/managers/scheduler.py`` (``event_loop_normal``,
``get_next_batch_to_run``, ``process_input_requests``, ``abort_request``, ``on_idle``,
``pause_generation``, ``continue_generation``),
``srt/managers/scheduler_components/batch_result_processor.py``, ``srt/mem_cache/common.py``
(``release_kv_cache``, ``checkpoint_kv_cache``), ``srt/mem_cache/allocation.py``
(``alloc_for_extend``, ``alloc_for_decode``) and, for PD decode, ``srt/disaggregation/decode.py``.

One :meth:`Scheduler.step` is one loop iteration::

    [HiCache acks] -> ingest (+ session reap) -> [paused: stop here] -> [PD: prealloc, transfer] -> [HiSparse: staged reqs join]
        -> next batch (prefill | prebuilt + decode) -> run (KV written, tokens to future_ids)
        -> process result (this batch; with overlap the previous one) -> last_batch = batch
        -> (nothing ran or in flight: on_idle)

The phases are mixins, one module each, named for where SGLang keeps them: the client side
(``tokenizer_control_mixin.py``), ingest (``scheduler_input_mixin.py``), prefill
(``scheduler_prefill_mixin.py``), decode (``scheduler_decode_mixin.py``), running a batch
(``scheduler_output_processor_mixin.py``), release and checkpoint (``scheduler_release_mixin.py``), PD
decode (``scheduler_disagg_decode_mixin.py``) and accounting (``scheduler_invariant_checker_mixin.py``).
The mixins hold no state of their own (``__init__`` here sets every attribute). This module keeps
the loop and six methods that shipped signatures name as ``function@scheduler.py``.
Streaming sessions live in ``session.py``, the HiCache host tier in ``hicache.py`` (the tree),
HiSparse in ``hisparse.py``.
"""

from __future__ import annotations

import itertools

import torch

from engine_under_test import model as model_mod
from engine_under_test.config import EngineConfig
from engine_under_test.hicache import HiRadixCache
from engine_under_test.hisparse import HiSparseCoordinator
from engine_under_test.memory import INDEX_DTYPE, HostKVPool, MHATokenToKVPool, ReqToTokenPool, TokenToKVPoolAllocator
from engine_under_test.radix_cache import RadixCache
from engine_under_test.req import FinishReason, Req
from engine_under_test.schedule_batch import DECODE, EXTEND, PREBUILT, FinishedOutput, ScheduleBatch
from engine_under_test.scheduler_decode_mixin import SchedulerDecodeMixin
from engine_under_test.scheduler_disagg_decode_mixin import SchedulerDisaggregationDecodeMixin
from engine_under_test.scheduler_input_mixin import SchedulerInputMixin
from engine_under_test.scheduler_invariant_checker_mixin import PoolCheck, SchedulerInvariantCheckerMixin
from engine_under_test.scheduler_output_processor_mixin import SchedulerOutputProcessorMixin
from engine_under_test.scheduler_prefill_mixin import SchedulerPrefillMixin
from engine_under_test.scheduler_release_mixin import SchedulerReleaseMixin
from engine_under_test.session import SessionController
from engine_under_test.tokenizer_control_mixin import TokenizerControlMixin, _Msg


class Scheduler(TokenizerControlMixin, SchedulerInputMixin, SchedulerPrefillMixin, SchedulerDecodeMixin,
                SchedulerOutputProcessorMixin, SchedulerReleaseMixin, SchedulerDisaggregationDecodeMixin,
                SchedulerInvariantCheckerMixin):
    """The engine. Build it from an :class:`EngineConfig`; feed it with :meth:`add_request`,
    :meth:`health_check` and :meth:`abort_request`; advance it with :meth:`step`.

    Raises ``RuntimeError`` on an allocation that admission should have prevented (SGLang's
    fail-loud "out of memory" paths) and on a second ``release_kv_cache`` of one request.
    """

    def __init__(self, config: EngineConfig):
        self.config = cfg = config
        ps, dev = cfg.page_size, cfg.device
        self.page_size = ps
        logical = cfg.total_tokens * (cfg.hisparse_host_ratio if cfg.enable_hisparse else 1)
        self.token_to_kv_pool_allocator = TokenToKVPoolAllocator(logical, ps, dev, "token_to_kv_pool")
        self.req_to_token_pool = ReqToTokenPool(cfg.max_req_rows, cfg.context_len, dev,
                                                cfg.pd_pre_alloc_rows if cfg.is_pd_decode else 0)
        self.kv_pool = MHATokenToKVPool((cfg.num_pages + 1) * ps, model_mod.NUM_LAYERS, model_mod.NUM_HEADS,
                                        model_mod.HEAD_DIM, dev)
        self.model = (model_mod.TinyModel(cfg.vocab_size, cfg.context_len, cfg.seed, dev)
                      if cfg.model == "tiny" else None)
        self.hicache_host_pool: HostKVPool | None = None
        if cfg.enable_hicache:
            self.hicache_host_pool = HostKVPool(cfg.total_tokens * cfg.hicache_ratio, ps, model_mod.NUM_LAYERS,
                                                model_mod.NUM_HEADS, model_mod.HEAD_DIM, "hicache_host")
            self.tree_cache: RadixCache = HiRadixCache(
                self.token_to_kv_pool_allocator, ps, self.hicache_host_pool, cfg.hicache_write_policy,
                cfg.host_ack_latency_steps, cfg.bugs, self.kv_pool if self.model is not None else None)
        else:
            self.tree_cache = RadixCache(self.token_to_kv_pool_allocator, ps, disable=cfg.disable_radix_cache,
                                         bugs=cfg.bugs)
        self.orphan_load_backs: list = []  # HiCache: load-backs whose request is gone, released at their ack
        self.hisparse_coordinator: HiSparseCoordinator | None = None
        if cfg.enable_hisparse:
            physical = TokenToKVPoolAllocator(cfg.total_tokens, ps, dev, "hisparse_device")
            host = HostKVPool(logical, ps, model_mod.NUM_LAYERS, model_mod.NUM_HEADS, model_mod.HEAD_DIM,
                              "hisparse_host")
            host.compute_device = torch.device(dev)
            self.hisparse_coordinator = HiSparseCoordinator(physical, host, cfg.hisparse_device_buffer_size, ps,
                                                            copy_kv=self.model is not None)
            self.hisparse_coordinator.kv_pool = self.kv_pool
        self.recv_queue: list[_Msg] = []
        self.waiting_queue: list[Req] = []
        self.running_batch: list[Req] = []
        self.last_batch: ScheduleBatch | None = None
        self.disagg_prealloc_queue: list[Req] = []
        self.held_rebootstrap_reqs: list[Req] = []  # PD decode: retracted by a pause, queued again at continue
        self.disagg_transfer_queue: list[Req] = []
        self.failed_transfers: set[str] = set()  # PD decode: rids whose KV receiver polls KVPoll.Failed
        self.forward_ct = 0
        self.pending_health_check_acks = 0
        self.health_check_acks = 0
        self.finished_outputs: list[FinishedOutput] = []
        self.last_idle_check: list[PoolCheck] | None = None
        self.flush_results: list[bool] = []  # one per flush_cache request, in order
        self.chunked_req: Req | None = None  # the one request between prefill chunks
        self.num_retractions = 0
        self._pending_chunked_abort = False
        self._force_retract = False
        self._engine_paused = False
        self._rids = itertools.count()
        self._queue_ct = itertools.count(1)  # wait_queue_entry serials
        self.session_controller = SessionController(self) if cfg.enable_streaming_session else None

    # ------------------------------------------------------------------------------------
    # The loop (SGLang keeps it in srt/managers/scheduler.py)
    # ------------------------------------------------------------------------------------
    def step(self) -> bool:
        """One event-loop iteration. Returns True if a batch ran.

        Normal mode runs a batch and processes its result at once. With ``enable_overlap``
        (SGLang ``event_loop_overlap``) the next batch is scheduled and launched *before* the
        previous batch's result is processed: finishes and releases lag one step, so a request
        that has in fact finished can still be given one more decode slot.
        """
        self.forward_ct += 1
        if self.hicache_host_pool is not None and not self._engine_paused:
            self.check_hicache_events()  # SGLang drains HiCache events in get_next_batch_to_run
        self.process_input_requests()
        if self._engine_paused:  # event_loop_*: a paused engine only ingests
            return False
        if self.config.is_pd_decode:
            self.process_decode_queue()
            batch = self.get_next_disagg_decode_batch_to_run()
        else:
            batch = self.get_next_batch_to_run()
        if batch is not None:
            self.run_batch(batch)
        done = self.last_batch if self.config.enable_overlap else batch
        if done is not None:
            self.process_batch_result(done)
            self.maybe_send_health_check_signal()
        idle = batch is None and (self.last_batch is None or not self.config.enable_overlap)
        self.last_batch = batch
        if idle:
            self.on_idle()
        return batch is not None

    def run_until_idle(self, max_steps: int = 10_000) -> int:
        """Step until fully idle; returns the steps taken. Raises ``RuntimeError`` past ``max_steps``."""
        for n in range(max_steps):
            if self.is_fully_idle() and not self.recv_queue:
                self.step()  # one idle iteration: runs on_idle
                return n + 1
            self.step()
        raise RuntimeError(f"engine did not reach idle within {max_steps} steps")

    def is_fully_idle(self, for_health_check: bool = False, ignore_waiting: bool = False) -> bool:
        """SGLang ``is_fully_idle``: no batch, no queued request, no PD queue entry.

        ``for_health_check`` selects SGLang's narrower set for health checks; with the queues this
        engine has (no grammar, PP or HiCache queues yet) the two sets coincide. ``ignore_waiting``
        (a flush while paused) passes waiting requests that hold no memory: no row, no KV and no
        HiCache load-back (whose locks a flush would drop under it).
        """
        if ignore_waiting:
            waiting = any(r.kv.holds_kv or r.load_back is not None for r in self.waiting_queue)
        else:
            waiting = self.waiting_queue or self.held_rebootstrap_reqs
        busy = self.running_batch or self.last_batch is not None or waiting or self.chunked_req
        if self.config.is_pd_decode:
            busy = busy or self.disagg_prealloc_queue or self.disagg_transfer_queue
        hs = self.hisparse_coordinator
        return not (busy or (hs is not None and hs.has_ongoing_staging()) or self._hicache_in_flight())

    def _hicache_in_flight(self) -> bool:
        """A device<->host copy not yet acknowledged (SGLang's idle check waits for them)."""
        tree = self.tree_cache
        return isinstance(tree, HiRadixCache) and (bool(tree.ongoing_write_through) or any(
            not tree.load_back_ready(r) for r in tree.ongoing_load_back.values()))

    def check_hicache_events(self) -> None:
        """Acks: write-throughs unlock; load-backs whose request was aborted are released."""
        tree = self.tree_cache
        tree.check_hicache_events(self.forward_ct)
        for rec in [r for r in self.orphan_load_backs if tree.load_back_ready(r)]:
            self.orphan_load_backs.remove(rec)
            tree.release_load_back(rec)

    def on_idle(self) -> None:
        """SGLang ``on_idle``: when fully idle, run the memory checks (recorded, never raised)."""
        self.maybe_send_health_check_signal()
        if self.is_fully_idle():
            self.last_idle_check = self.check_memory(idle=True)

    def maybe_send_health_check_signal(self) -> None:
        self.health_check_acks += self.pending_health_check_acks
        self.pending_health_check_acks = 0

    # ------------------------------------------------------------------------------------
    # Methods of the phases that shipped signatures name as ``function@scheduler.py``: a finding's
    # signature names its sites by function and file, so these stay in this file
    # ------------------------------------------------------------------------------------
    def handle_abort(self, rid: str | None, abort_all: bool) -> None:
        """SGLang ``abort_request``: by rid prefix or all, wherever the request sits."""
        def hit(r: Req) -> bool:
            return abort_all or (rid is not None and r.rid.startswith(rid))

        for req in [r for r in self.waiting_queue if hit(r)]:
            self.waiting_queue.remove(req)
            req.finished_reason = FinishReason.ABORT
            self._end_session_turn(req)
            if req.load_back is not None and "hicache-abort-loadback-leak" not in self.config.bugs:
                self.orphan_load_backs.append(req.load_back)  # tree_cache.finish(ABORT): released at its ack
            # BUG (sglang PR #9874): with the switch on, the abort dropped the request's in-flight
            # load-back record, so nothing ever released its device lock and host pin.
            req.load_back = None
            if req.kv.holds_kv and "pd-abort-after-transfer-leak" in self.config.bugs:
                # BUG (sglang PR #9817): an abort of a transferred request waiting to join the
                # running batch dropped it from the queue with no cleanup: its row and KV leaked.
                self._emit(req)
            elif req.kv.holds_kv:  # PD decode: the transferred KV is already allocated
                self._release_finished(req, checkpoint=True)  # emits the output
            else:
                self._emit(req)
        hs = self.hisparse_coordinator
        for req in [r for r in (hs.staging_reqs() if hs is not None else []) if hit(r)]:
            hs.abort_staging_request(req)  # HiSparse staging: the host backup is still in flight
            req.finished_reason = FinishReason.ABORT
            self._release_finished(req, checkpoint=False)
        for queue in (self.disagg_prealloc_queue, self.held_rebootstrap_reqs):  # PD decode: nothing held yet
            for req in [r for r in queue if hit(r)]:
                queue.remove(req)
                req.finished_reason = FinishReason.ABORT
                self._emit(req)
        for req in [r for r in self.disagg_transfer_queue if hit(r)]:
            self.disagg_transfer_queue.remove(req)
            req.finished_reason = FinishReason.ABORT
            self._release_finished(req, checkpoint=False)  # emits the output
        chunked = self.chunked_req
        if chunked is not None and hit(chunked):
            if "chunked-abort-ignored" in self.config.bugs:
                # BUG (sglang-jax PR #984): the abort path only knew the queues and the running
                # batch; the parked chunked request was dropped from scheduling, never released.
                self.chunked_req = None
            else:  # SGLang records it and releases it at the top of the next scheduling round
                self._pending_chunked_abort = True
        in_flight = list(self.running_batch) + (self.last_batch.reqs if self.last_batch else [])
        for req in in_flight:
            if not hit(req) or req.finished() or req is chunked or not req.kv.holds_kv:
                continue
            req.to_finish = FinishReason.ABORT  # released by the next result processing
            if "overlap-abort-double-free" in self.config.bugs and self.config.enable_overlap \
                    and self.last_batch is not None and req in self.last_batch.reqs:
                # BUG (mini-sglang PR #111): the abort freed the KV and the row of a request whose
                # batch was still in flight; the delayed result then finished it and freed them again.
                kv = req.kv
                row = self.req_to_token_pool.req_to_token[kv.req_pool_idx]
                self.token_to_kv_pool_allocator.free(row[kv.cache_protected_len : kv.kv_allocated_len].clone())
                self.tree_cache.dec_lock_ref(req.lock)
                req.lock = None
                self.req_to_token_pool.free(kv.req_pool_idx)
                self.running_batch = [r for r in self.running_batch if r is not req]

    def alloc_for_extend(self, batch: ScheduleBatch) -> None:
        """SGLang ``alloc_for_extend`` (``mem_cache/allocation.py``): rows, then slots for
        ``[prefix_len, extend_end)`` after evicting the shortfall, then the row write."""
        reqs = batch.reqs
        fresh = [r for r in reqs if not r.kv.holds_kv]  # a chunk continuation keeps its row
        rows = self.req_to_token_pool.alloc(len(fresh)) if fresh else []
        if rows is None:
            raise RuntimeError("alloc_req_slots runs out of memory")
        for req, row in zip(fresh, rows):
            req.kv.req_pool_idx = row
            req.kv.cache_protected_len = req.prefix_len
            self.req_to_token_pool.write(row, 0, req.prefix_indices)
        prefix_lens = [r.prefix_len for r in reqs]
        seq_lens = [r.extend_end for r in reqs]
        # Page 1 evicts exactly the shortfall (alloc_token_slots); paged allocation assumes a fresh page
        # per request (alloc_paged_token_slots_extend).
        self._evict_for(sum(s - p for p, s in zip(prefix_lens, seq_lens)) + (len(reqs) * self.page_size
                                                                             if self.page_size > 1 else 0))
        out = self.token_to_kv_pool_allocator.alloc_extend(prefix_lens, seq_lens, self._last_loc(reqs, prefix_lens))
        if out is None:
            raise RuntimeError("Prefill out of memory")
        off = 0
        for req, p, s in zip(reqs, prefix_lens, seq_lens):
            self.req_to_token_pool.write(req.kv.req_pool_idx, p, out[off : off + s - p])
            off += s - p
            req.kv.kv_allocated_len = req.kv.kv_committed_len = s
            if self.session_controller is not None:
                self.session_controller.take(req)  # maybe_hand_to_session
        batch.out_cache_loc = out
        hs = self.hisparse_coordinator
        if hs is not None:  # the prefill's KV is written into physical slots
            phys = [hs.alloc_prefill(r.kv.req_pool_idx, s) for r, s in zip(reqs, seq_lens)]
            if any(x is None for x in phys):
                raise RuntimeError("HiSparse prefill out of physical slots")
            batch.model_loc = torch.cat([x[p:] for x, p in zip(phys, prefix_lens)])

    def update_running_batch(self) -> ScheduleBatch | None:
        """A decode batch over the running requests, with one new slot each (``alloc_for_decode``);
        None when retraction leaves no request (SGLang ``Scheduler.update_running_batch`` returns
        the empty batch, which runs nothing)."""
        reqs = [r for r in self.running_batch if not r.finished()]
        if self.config.enable_overlap:  # _reqs_finishing_inflight: the lagged result ends them by length
            reqs = [r for r in reqs if len(r.output_ids) + len(r.future_ids) < r.max_new_tokens]
        if not reqs:
            return None
        if self._force_retract or not self._decode_fits(reqs):
            reqs = self.retract_decode(reqs, force=self._force_retract)
            self._force_retract = False
            if not reqs:  # the last request was aborted: no decode batch this step
                return None
        self._evict_for(self._decode_need(reqs))
        lens = [r.kv.kv_allocated_len for r in reqs]
        out = self.token_to_kv_pool_allocator.alloc_decode([n + 1 for n in lens], self._last_loc(reqs, lens))
        if out is None:
            raise RuntimeError("Decode out of memory")
        rows = torch.tensor([r.kv.req_pool_idx for r in reqs], dtype=INDEX_DTYPE, device=out.device)
        self.req_to_token_pool.req_to_token[rows, torch.tensor(lens, dtype=INDEX_DTYPE, device=out.device)] = out
        for r in reqs:
            r.kv.kv_allocated_len += 1
            r.kv.kv_committed_len += 1
        batch = ScheduleBatch(reqs, DECODE, out)
        hs = self.hisparse_coordinator
        if hs is not None:  # map_last_loc_to_buffer: a buffer slot and a host slot per new token
            pairs = [hs.map_last_loc_to_buffer(r, n) for r, n in zip(reqs, lens)]
            batch.model_loc = torch.cat([p[0] for p in pairs])
            batch.host_loc = torch.cat([p[1] for p in pairs])
        return batch

    def process_batch_result(self, batch: ScheduleBatch) -> None:
        """SGLang ``process_batch_result_{prefill,decode}``: finish and release, or checkpoint.

        Rows already finished (an overlap overshoot) or retracted since the batch ran are skipped;
        their sampled token is dropped.
        """
        if batch.forward_mode == PREBUILT:
            return  # process_batch_result_prebuilt already ran
        alloc = self.token_to_kv_pool_allocator
        alloc.free_group_begin()
        try:
            for req, sampled in zip(batch.reqs, batch.sampled):
                tok = req.future_ids.pop(0) if sampled and req.future_ids else None
                if req.finished() or not req.kv.holds_kv:
                    continue
                prefill_row = batch.forward_mode == EXTEND and id(req) not in batch.decode_ids
                if prefill_row and req.inflight_middle_chunks > 0:
                    req.inflight_middle_chunks -= 1  # a middle chunk samples nothing
                    continue
                self._append_token(req, tok)
                if req.finished() and prefill_row and "prefill-finish-leaks-row" in self.config.bugs \
                        and self.config.enable_mixed_chunk:
                    # BUG (sglang PR #10871): with mixed chunk, a request finishing in its first
                    # prefill only had this step's token slots freed; its row was never released.
                    row = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
                    self.token_to_kv_pool_allocator.free(row[req.kv.cache_protected_len : req.extend_end].clone())
                    self.tree_cache.dec_lock_ref(req.lock)
                    req.lock = None
                    req.kv.mark_kv_released()
                    self._emit(req)
                elif req.finished():
                    self._release_finished(req, checkpoint=self._caches_on_release(req))
                elif prefill_row:
                    self.checkpoint_kv_cache(req)
                    hs = self.hisparse_coordinator
                    if hs is not None and not hs.admit_request_into_staging(req, self.forward_ct,
                                                                            self.config.host_ack_latency_steps):
                        raise RuntimeError("HiSparse host pool is full! Bug in memory estimation.")
        finally:
            alloc.free_group_end()

    def release_kv_cache(self, req: Req, checkpoint: bool) -> None:
        """The single release entry point (SGLang ``release_kv_cache``).

        Optionally checkpoints into the tree, then frees the private span
        ``[cache_protected_len, kv_allocated_len)`` (whole pages), unlocks, and frees the row.
        Raises ``RuntimeError`` if the request holds no row (a second release).
        """
        kv = req.kv
        if not kv.holds_kv:
            raise RuntimeError(f"release_kv_cache: {req.rid} holds no KV (released twice?)")
        if self.session_controller is not None and self.session_controller.claim_kv_row(req):
            return  # the session slot keeps the record
        if checkpoint:
            self.checkpoint_kv_cache(req, up_to=req.owned_kv_len())
        self.token_to_kv_pool_allocator.free(self.row_slots(kv, kv.cache_protected_len, kv.kv_allocated_len))
        if req.lock is not None:
            self.tree_cache.dec_lock_ref(req.lock)
            req.lock = None
        self.req_to_token_pool.free(kv.req_pool_idx)
        kv.mark_kv_released()

    def _pre_alloc(self, req: Req, fill_len: int) -> None:
        """A row whose ``[0, prefix)`` points at the locked match ``req.prefix_indices`` (ending at
        ``req.last_node``, now the request's lock; its length becomes ``cache_protected_len``; None
        without the tree), plus fresh slots for ``[prefix, fill_len)``, the transfer target, after
        evicting the shortfall from the tree (HiSparse: logical ids + host slots). SGLang 0.5.23
        ``DecodePreallocQueue._pre_alloc``, ``alloc_for_decode_prealloc``."""
        rows = self.req_to_token_pool.alloc(1)
        if rows is None:
            raise RuntimeError("KV cache is full! Bug in memory estimation.")
        req.kv.req_pool_idx = rows[0]
        alloc = self.token_to_kv_pool_allocator
        prefix = 0 if req.prefix_indices is None else req.prefix_indices.numel()  # page-aligned
        self._evict_for(self.ceil_page(fill_len) - prefix)
        out = alloc.alloc_extend([prefix], [fill_len], torch.tensor([-1], dtype=INDEX_DTYPE, device=alloc.device))
        if out is None:
            raise RuntimeError("KV cache is full! Bug in memory estimation.")
        if self.hisparse_coordinator is not None and not self.hisparse_coordinator.alloc_host(rows[0], fill_len):
            raise RuntimeError("HiSparse host pool is full! Bug in memory estimation.")
        if req.prefix_indices is not None:
            self.req_to_token_pool.write(rows[0], 0, req.prefix_indices)
            req.lock, req.kv.cache_protected_len = req.last_node, prefix
        self.req_to_token_pool.write(rows[0], prefix, out)
        req.kv.kv_allocated_len = req.kv.kv_committed_len = fill_len
        req.prefix_len = req.extend_end = fill_len
