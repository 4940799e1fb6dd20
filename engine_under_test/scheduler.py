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

Streaming sessions live in ``session.py``, the HiCache host tier in ``hicache.py`` (the tree),
HiSparse in ``hisparse.py``.
"""

from __future__ import annotations

import itertools
import sys
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from engine_under_test import model as model_mod
from engine_under_test.config import EngineConfig
from engine_under_test.hicache import HiRadixCache
from engine_under_test.hisparse import HiSparseCoordinator
from engine_under_test.memory import (INDEX_DTYPE, HostKVPool, MHATokenToKVPool, PoolIntegrityError,
                                      ReqToTokenPool, TokenToKVPoolAllocator)
from engine_under_test.radix_cache import RadixCache
from engine_under_test.req import HEALTH_CHECK_RID_PREFIX, FinishReason, Req, ReqKvInfo
from engine_under_test.session import SessionController

EXTEND, DECODE, PREBUILT = "extend", "decode", "prebuilt"
EOS_TOKEN = 1
CLIP_MAX_NEW_TOKENS = 4096  # SGLang SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION: admission caps output estimates here


@dataclass
class ScheduleBatch:
    reqs: list[Req]
    forward_mode: str
    out_cache_loc: torch.Tensor | None = None  # [n] int64 slots written into the rows
    decode_ids: frozenset = frozenset()  # mixed chunk: ids of the decoding rows of an extend batch
    sampled: list[bool] = field(default_factory=list)  # per row: did the forward sample a token
    model_loc: torch.Tensor | None = None  # HiSparse: [bs] physical buffer slots the model writes
    host_loc: torch.Tensor | None = None  # HiSparse: [bs] host slots that back the new tokens up


class PoolCheck(NamedTuple):
    """One line of :meth:`Scheduler.check_memory`, in tokens (rows for ``req_to_token_pool``)."""

    pool: str
    available: int
    evictable: int
    protected: int
    session_held: int
    uncached: int
    total: int

    @property
    def ok(self) -> bool:
        return self.available + self.evictable + self.protected + self.session_held + self.uncached == self.total

    def message(self) -> str:
        return (f"[{self.pool}] total={self.total}, available={self.available}, evictable={self.evictable}, "
                f"protected={self.protected}, session_held={self.session_held}, uncached={self.uncached}")


@dataclass
class _Msg:
    kind: str  # "generate" | "abort" | "health_check" | "flush_cache" | "open_session" | "close_session"
    #            | "memory_pressure" | "pause_generation" | "continue_generation"
    req: Req | None = None
    rid: str | None = None
    abort_all: bool = False
    session_id: str | None = None
    mode: str | None = None  # pause_generation: "in_place" | "retract"


@dataclass
class FinishedOutput:
    rid: str
    reason: FinishReason
    output_ids: list[int] = field(default_factory=list)


class Scheduler:
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
    # Client side
    # ------------------------------------------------------------------------------------
    def add_request(self, input_ids: list[int], max_new_tokens: int, stop_at: int | None = None,
                    rid: str | None = None, session_id: str | None = None, ignore_eos: bool = False,
                    priority: int | None = None) -> str:
        """Queue a generate request; returns its rid. ``stop_at`` is the output length at which EOS
        is sampled; with ``ignore_eos`` (SGLang's sampling parameter) that EOS is kept in the output
        but finishes nothing, and the request runs to ``max_new_tokens``. ``priority`` matters only with
        ``enable_priority_scheduling`` (see :meth:`_add_request_to_queue`). With ``session_id`` it is
        the next turn of that streaming session: its prompt is appended to the session's history at
        intake (a turn over the context is aborted there). Raises ``ValueError`` for an empty prompt,
        one that cannot fit the context, or a session id without ``enable_streaming_session``."""
        if not input_ids or max_new_tokens < 1:
            raise ValueError("a request needs at least one input token and max_new_tokens >= 1")
        if len(input_ids) + max_new_tokens > self.config.context_len:
            raise ValueError(f"prompt + max_new_tokens exceeds context_len={self.config.context_len}")
        if session_id is not None and self.session_controller is None:
            raise ValueError("session turns need enable_streaming_session")
        rid = rid or self._new_id("req-")
        self.recv_queue.append(_Msg("generate", Req(rid, list(input_ids), max_new_tokens, stop_at, ignore_eos,
                                                    priority), session_id=session_id))
        return rid

    def _new_id(self, prefix: str) -> str:
        """``prefix`` and a 6-digit serial: ids are prefix-free (for the first million of an engine),
        since :meth:`abort_request` matches by prefix. SGLang's rids are UUID hex (``uuid4().hex``,
        ``GenerateReqInput.regenerate_rid``): fixed width as well."""
        return f"{prefix}{next(self._rids):06d}"

    def open_session(self, session_id: str | None = None) -> str:
        """Queue the opening of a streaming session; returns its id. Raises ``ValueError`` without
        ``enable_streaming_session``."""
        if self.session_controller is None:
            raise ValueError("sessions need enable_streaming_session")
        session_id = session_id or self._new_id("session-")
        self.recv_queue.append(_Msg("open_session", session_id=session_id))
        return session_id

    def close_session(self, session_id: str) -> None:
        """Queue a close; it is deferred while a turn of the session is in flight."""
        if self.session_controller is None:
            raise ValueError("sessions need enable_streaming_session")
        self.recv_queue.append(_Msg("close_session", session_id=session_id))

    def memory_pressure(self) -> None:
        """Queue a memory-pressure event: the tree's evictable KV is evicted at intake and the next
        decode step retracts every running request but one (SGLang's forced retraction for tests,
        ``SGLANG_TEST_RETRACT``, and ``pause_generation(mode="retract")`` followed by a resume)."""
        self.recv_queue.append(_Msg("memory_pressure"))

    def set_finish_with_abort(self, req: Req) -> Req:
        """Reject ``req`` at intake the SGLang way: it still runs one cheap prefill of a single
        token, then finishes with an abort."""
        req.origin_input_ids = req.origin_input_ids[:1]
        req.max_new_tokens, req.stop_at = 1, None
        req.to_finish, req.intake_aborted = FinishReason.ABORT, True
        return req

    def metrics(self) -> dict[str, int]:
        """SGLang's streaming-session gauges: ``num_streaming_sessions`` (open sessions, holding KV
        or not) and ``streaming_session_held_tokens`` (tokens, see :meth:`session_held_tokens`)."""
        sc = self.session_controller
        return {"num_streaming_sessions": 0 if sc is None else len(sc.sessions),
                "streaming_session_held_tokens": self.session_held_tokens()}

    def session_held_tokens(self) -> int:
        return 0 if self.session_controller is None else self.session_controller.held_tokens()

    def health_check(self) -> str:
        """Queue a health check (SGLang ``/health_generate``: input ``[0]``, ``max_new_tokens=1``)."""
        rid = self._new_id(f"{HEALTH_CHECK_RID_PREFIX}_")
        self.recv_queue.append(_Msg("health_check", Req(rid, [0], 1)))
        return rid

    def pause_generation(self, mode: str) -> None:
        """Queue SGLang's ``/pause_generation`` for the scheduler (a weight update's first step).

        ``mode`` is ``"in_place"`` (stop scheduling, state frozen) or ``"retract"`` (first retract
        every in-flight request to the waiting queue, so ``flush_cache`` can succeed while paused);
        see :meth:`handle_pause_generation`. The third SGLang mode, ``"abort"``, is the tokenizer's
        alone (abort every request and hold new ones; the scheduler keeps running): the caller
        does it with ``abort_request(abort_all=True)``. Raises ``ValueError`` for any other mode.
        """
        if mode not in ("in_place", "retract"):
            raise ValueError(f"the scheduler pauses 'in_place' or 'retract', got {mode!r}")
        self.recv_queue.append(_Msg("pause_generation", mode=mode))

    def continue_generation(self) -> None:
        """Queue SGLang's ``/continue_generation``: the scheduler runs again (a no-op when not paused)."""
        self.recv_queue.append(_Msg("continue_generation"))

    @property
    def paused(self) -> bool:
        """SGLang ``_engine_paused``: a step only takes in messages; nothing is scheduled or run."""
        return self._engine_paused

    def request_flush_cache(self) -> None:
        """Queue a cache flush (SGLang ``/flush_cache``); the outcome lands in ``flush_results``."""
        self.recv_queue.append(_Msg("flush_cache"))

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

    def report_transfer_failure(self, rid: str) -> None:
        """PD decode: the KV transfer of request ``rid`` (exact rid, as a bootstrap room) failed or
        timed out on the prefill side or the wire; its receiver polls ``KVPoll.Failed`` from now on,
        and the next poll aborts the request and releases what was pre-allocated for it
        (:meth:`poll_transfer_failures`). Ignored once the request has joined the running batch.
        Raises ``ValueError`` on an aggregated engine."""
        if not self.config.is_pd_decode:
            raise ValueError("transfer failures need disaggregation_mode='decode'")
        self.failed_transfers.add(rid)

    def abort_request(self, rid: str | None = None, abort_all: bool = False) -> None:
        """Queue an abort by rid prefix, or of everything."""
        self.recv_queue.append(_Msg("abort", rid=rid, abort_all=abort_all))

    # ------------------------------------------------------------------------------------
    # The loop
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
    # Ingest
    # ------------------------------------------------------------------------------------
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

    def _hold_rebootstrap(self, reqs: list[Req]) -> None:
        """PD decode retraction (SGLang ``hold_rebootstrap``): the last emitted token is popped and
        kept as the hand-off token of a new transfer of the rest, which is queued at continue."""
        for req in reqs:
            if req.output_ids:
                req.pd_rebootstrap_forced_output_id = req.output_ids.pop()
            req.pd_rebootstrap_in_progress = True
        self.held_rebootstrap_reqs.extend(reqs)

    def handle_continue_generation(self) -> None:
        """SGLang ``Scheduler.continue_generation``: clear the flag; PD decode queues the held
        rebootstraps for preallocation (``enqueue_held_rebootstrap``)."""
        self._engine_paused = False
        self.disagg_prealloc_queue.extend(self.held_rebootstrap_reqs)
        self.held_rebootstrap_reqs = []

    # ------------------------------------------------------------------------------------
    # Aggregated mode: prefill and decode
    # ------------------------------------------------------------------------------------
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

    def _reserved_tokens(self, reqs) -> int:
        """PD decode pre-allocation: tokens still promised to ``reqs`` (their remaining decode
        steps plus a page of slack each)."""
        return sum(r.max_new_tokens - len(r.output_ids) + self.page_size for r in reqs)

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
            # BUG (sglang PR #4977): the retraction free range was padded to page bounds by
            # flooring its end, so the partly filled last page the request owned was skipped.
            req.kv.kv_allocated_len = req.kv.kv_allocated_len // self.page_size * self.page_size
        if self.hisparse_coordinator is not None:
            self.hisparse_coordinator.retract_req(req)
        self.release_kv_cache(req, checkpoint=False)
        req.future_ids.clear()  # overlap: the in-flight token is dropped and sampled again
        req.kv.kv_committed_len = req.kv.cache_protected_len = 0  # reset_for_retract
        req.prefix_len = req.extend_end = 0
        req.prefix_indices, req.last_node = None, None

    # ------------------------------------------------------------------------------------
    # Running a batch
    # ------------------------------------------------------------------------------------
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

    def _caches_on_release(self, req: Req) -> bool:
        """Whether a finished request's KV is inserted into the tree: not for an abort (its KV may
        be incomplete; sglang PR #28374), unless the ``aborted-kv-inserted`` switch is on."""
        if req.finished_reason != FinishReason.ABORT:
            return True
        # BUG (sglang PR #28374): an aborted request was cached like a finished one, including
        # positions whose KV its skipped last forward never wrote.
        return "aborted-kv-inserted" in self.config.bugs

    # ------------------------------------------------------------------------------------
    # Release and checkpoint (srt/mem_cache/common.py)
    # ------------------------------------------------------------------------------------
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

    # ------------------------------------------------------------------------------------
    # PD disaggregation, decode side (srt/disaggregation/decode.py)
    # ------------------------------------------------------------------------------------
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

    # ------------------------------------------------------------------------------------
    # Accounting (srt/managers/scheduler_components/invariant_checker.py)
    # ------------------------------------------------------------------------------------
    def requests_owning_rows(self) -> list[Req]:
        """Every live request that holds a row, deduplicated (SGLang ``_requests_owning_rows``,
        extended with the PD decode queues, which SGLang keeps out of the busy check)."""
        seen, out = set(), []
        groups = [self.running_batch, self.last_batch.reqs if self.last_batch else [], self.waiting_queue,
                  self.disagg_transfer_queue, [self.chunked_req] if self.chunked_req else [],
                  self.hisparse_coordinator.staging_reqs() if self.hisparse_coordinator else []]
        for group in groups:
            for r in group:
                if id(r) not in seen and r.kv.holds_kv:
                    seen.add(id(r))
                    out.append(r)
        return out

    def check_integrity(self) -> None:
        """Engine facts of SGLang's invariants (reference 7.1, items 6-12): each pool's own
        bookkeeping, ``0 <= committed <= allocated <= context_len``, a page-aligned protected
        prefix, and rows owned by one live request each and absent from the free list.
        Raises :class:`PoolIntegrityError` with the numbers."""
        self.token_to_kv_pool_allocator.check_integrity()
        self.req_to_token_pool.check_integrity()
        self.tree_cache.check_integrity()
        if self.hicache_host_pool is not None:
            self.hicache_host_pool.check_integrity()
        hs = self.hisparse_coordinator
        if hs is not None:
            hs.hisparse_attn_allocator.check_integrity()
            hs.host_pool.check_integrity()
            hs.check_integrity({r.kv.req_pool_idx for r in self.requests_owning_rows()})
        ps, rows = self.page_size, {}
        free_rows = set(self.req_to_token_pool.free_slots)
        live = self.requests_owning_rows() + self.waiting_queue
        if self.session_controller is not None:
            self.session_controller.check_integrity(list({id(r): r for r in live}.values()))
        slots = [] if self.session_controller is None else self.session_controller.slots()
        borrowed = {id(slot.kv) for _, slot in slots}
        for sid, slot in slots:
            if slot.kv.req_pool_idx in free_rows:
                raise PoolIntegrityError(f"row {slot.kv.req_pool_idx} of session {sid} is in the free list")
            rows[slot.kv.req_pool_idx] = f"session {sid}"
        for req in self.requests_owning_rows():
            kv = req.kv
            if id(kv) in borrowed:  # the one turn running on its session's record
                borrowed.discard(id(kv))
                rows.pop(kv.req_pool_idx)
            if not 0 <= kv.kv_committed_len <= kv.kv_allocated_len <= self.config.context_len:
                raise PoolIntegrityError(f"{req.rid}: committed={kv.kv_committed_len} allocated={kv.kv_allocated_len}"
                                         f" context_len={self.config.context_len}")
            if kv.cache_protected_len % ps or kv.cache_protected_len > -(-kv.kv_allocated_len // ps) * ps:
                raise PoolIntegrityError(f"{req.rid}: cache_protected_len={kv.cache_protected_len} is not a page-aligned"
                                         f" prefix of allocated={kv.kv_allocated_len}")
            if kv.req_pool_idx in rows or kv.req_pool_idx in free_rows:
                other = rows.get(kv.req_pool_idx, "the free list")
                raise PoolIntegrityError(f"row {kv.req_pool_idx} of {req.rid} is also held by {other}")
            rows[kv.req_pool_idx] = req.rid

    def check_memory(self, idle: bool | None = None) -> list[PoolCheck]:
        """SGLang's accounting identities, one :class:`PoolCheck` per pool.

        ``available + evictable + protected + session_held + uncached == total``; at idle
        ``uncached`` is 0 and the request-pool identity is added. Unlike SGLang, which skips the
        checks under HiSparse, the HiSparse device buffer and host pool get identities too.
        """
        idle = self.is_fully_idle() if idle is None else idle
        owners = [] if idle else self.requests_owning_rows()
        # A turn running on its session's borrowed record is counted once, as session_held.
        double = "session-borrow-double-count" in self.config.bugs
        # BUG (sglang PRs #22213, #22753): with the switch on, the busy check also counts the
        # borrowed record as the turn's uncached KV: the identity reports a leak that is not there.
        uncached = sum(self.ceil_page(r.kv.kv_allocated_len) - r.kv.cache_protected_len for r in owners
                       if r.borrowed_slot is None or double)
        alloc = self.token_to_kv_pool_allocator
        checks = [PoolCheck("token_to_kv_pool", alloc.available_size(), self.tree_cache.evictable_size(),
                            self.tree_cache.protected_size(), self.session_held_tokens(), uncached, alloc.size)]
        if self.hicache_host_pool is not None:
            hp, tree = self.hicache_host_pool, self.tree_cache
            checks.append(PoolCheck("hicache_host", hp.available_size(), tree.host_evictable_size(),
                                    tree.host_protected_size(), 0, 0, hp.size))
        hs = self.hisparse_coordinator
        if hs is not None:
            rows = [r.kv.req_pool_idx for r in owners]
            checks.append(PoolCheck("hisparse_device", hs.hisparse_attn_allocator.available_size(), 0, 0, 0,
                                    sum(hs.device_size(x) for x in rows), hs.hisparse_attn_allocator.size))
            checks.append(PoolCheck("hisparse_host", hs.host_pool.available_size(), 0, 0, 0,
                                    sum(hs.host_size(x) for x in rows), hs.host_pool.size))
        if idle:
            rp = self.req_to_token_pool
            session_rows = 0 if self.session_controller is None else len(self.session_controller.slots())
            checks.append(PoolCheck("req_to_token_pool", rp.available_size(), 0, 0, session_rows, 0,
                                    rp.size + rp.pre_alloc_size))
        return checks

