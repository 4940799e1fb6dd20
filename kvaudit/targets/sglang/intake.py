"""The driver's intake: kvaudit's ops delivered as the messages SGLang's scheduler receives
(``Scheduler.process_input_requests``)."""

from __future__ import annotations

from array import array
from http import HTTPStatus
from types import SimpleNamespace

from kvaudit.program import PAUSE_MODES, Abort, CloseSession, ContinueGeneration, FlushCache, HealthCheck, \
    MemoryPressure, Op, OpenSession, PauseGeneration, Submit, TransferFail
from kvaudit.program.schema import pick, resolve_submit
from kvaudit.targets.base import Target
from kvaudit.targets.sglang import compat
from kvaudit.targets.sglang.standins import EOS


class SglangIntake(Target):
    """``Scheduler``'s message handling; its batches are :class:`~kvaudit.targets.sglang.driver.SglangDriver`'s."""

    def _init_state(self, config) -> None:
        """The scheduler state both eras keep (no SGLang object), under SGLang's names where it has one."""
        # TpModelWorker: max_req_len = min(context_len - 1, pool tokens - 1), inputs 5 tokens shorter
        self.max_req_len = min(config.context_len - 1, config.total_tokens - 1)
        self.max_req_input_len = self.max_req_len - 5
        self.steps = 0
        self.waiting: list = []  # Scheduler.waiting_queue
        self.running: list = []  # Scheduler.running_batch.reqs
        self.submitted: list[str] = []
        self.finished, self.requeued = set(), set()  # requeued: rids optimistic PD prefill requeued (crash_by)
        self.sessions: list[str] = []  # open session ids, in opening order
        self.session_turns: dict[str, list[str]] = {}  # session id -> its turns' rids (SessionParams.rid)
        self._n = self._opened = self._flushes = 0
        self._force_retract = False
        self._held: dict[str, tuple] = {}
        self._last: tuple[str, list, object] | None = None  # overlap: the batch whose result is still to process
        self.chunked_req = None  # Scheduler.chunked_req: the one request between prefill chunks
        self._pending_chunked_abort = None  # Scheduler._pending_chunked_abort_req
        self.retractions = self.priority_preemptions = 0  # requests retracted or preempted; preempt_to_schedule's
        self.last_retraction: str | None = None  # what the last retract_decode did (retraction())
        self._intake = None
        self._scheduled = None  # Scheduler.last_batch: the batch the latest step ran, (kind, reqs, chunked)
        self._queued = 0  # requests ever queued: their wait_queue_entry_time (FCFS order among equal priorities)
        self.scheduler_paused = False  # Scheduler._engine_paused (pause_generation in_place / retract)
        # TokenizerManager.is_pause: generate requests held until continue, as (op kind, _submit's arguments)
        self.held: list[tuple[str, tuple]] | None = None
        self.policy = None  # Scheduler.policy (SchedulePolicy), only with priority scheduling
        self.lock_net: dict[int, int] = {}  # node id -> incs - decs (the lock-ref ledger, per node)

    @property
    def paused(self) -> bool:
        """A pause is in force (``pause_generation`` until ``continue_generation``)."""
        return self.scheduler_paused or self.held is not None

    def apply(self, op: Op) -> None:
        """Deliver a message, as ``Scheduler.process_input_requests`` does. While paused, the tokenizer
        holds generate requests (submits, health checks) until ``continue_generation``. Raises
        ``TypeError`` for an op that does not go through ``apply``."""
        cfg = self.config
        if isinstance(op, Submit):
            req = resolve_submit(op, cfg.vocab_size, cfg.context_len // 4, cfg.context_len // 2, self.submitted,
                                 self._text, self.sessions)  # the op schema's client request
            self._generate(op.kind, (req.input_ids, req.max_new_tokens, req.stop_at, req.session, "r", op))
        elif isinstance(op, HealthCheck):
            self._generate(op.kind, ())
        elif isinstance(op, Abort):
            live = self.live_rids()
            if op.handle is None:
                for rid in live:
                    self._abort(rid)
            elif live:
                self._abort(pick(op.handle, live))
        elif isinstance(op, FlushCache):
            self._request_flush(float(op.timeout))
        elif isinstance(op, OpenSession):
            if self.session_controller is not None:
                sid = f"s{self._opened}"
                self._opened += 1
                self.session_controller.open(self.S.OpenSessionReqInput(
                    capacity_of_str_len=0, session_id=sid, streaming=self.config.session_streaming,
                    timeout=self.config.session_timeout_steps))
                self.sessions.append(sid)
        elif isinstance(op, CloseSession):
            if self.sessions:  # SessionController.close: immediate when idle, deferred while a turn runs
                sid = self.sessions.pop(op.handle % len(self.sessions))
                self.session_controller.close(self.S.CloseSessionReqInput(session_id=sid))
        elif isinstance(op, MemoryPressure):
            self._memory_pressure()
        elif isinstance(op, PauseGeneration):
            self._pause_generation(PAUSE_MODES[op.mode])
        elif isinstance(op, ContinueGeneration):
            if self.paused:
                self._continue_generation()
        elif isinstance(op, TransferFail):
            self._transfer_fail(op.handle)
        else:
            raise TypeError(f"op {op!r} does not go through apply()")
        if not isinstance(op, (Submit, HealthCheck, OpenSession)):
            self._after_intake()

    def _request_flush(self, timeout: float) -> None:
        """``SchedulerFlushWrapper.handle``: flush now, or deferred up to ``timeout`` seconds (steps)."""
        self.flush_wrapper.handle(self.S.FlushCacheReqInput(timeout_s=timeout))

    def _transfer_fail(self, handle: int | None) -> None:
        """No transfers on an aggregated server (PD decode's loop has them)."""

    def _generate(self, kind: str, args: tuple) -> None:
        """A generate request reaches the tokenizer: held while paused, else a submit, or /health_generate
        (a 1-token request, only when the scheduler is idle)."""
        if self.held is not None:
            self.held.append((kind, args))
        elif kind == "submit":
            self._submit(*args)
        elif self.is_idle_for_health_check():
            self._submit([2], 1, None, None, rid_prefix="HEALTH_CHECK_")

    def _submit(self, prompt: list[int], max_new: int, stop_at: int | None, sid: str | None,
                rid_prefix: str = "r", op: Submit | None = None) -> None:
        """``Scheduler.handle_generate_request``: a ``Req`` or ``Session.create_req``, its length checks, then
        the grammar queue or the waiting queue."""
        S, cfg = self.S, self.config
        op = op or Submit()
        rid = f"{rid_prefix}{self._n}"
        self._n += 1
        sp = S.SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=bool(op.ignore_eos))
        sp.normalize(None)
        ids = array("q", prompt)
        sc = self.session_controller
        gone = None  # handle_generate_request's early returns (before the grammar): a gone session, a bad length
        if sid is not None and (sid not in sc or sc.get(sid).close_on_finish):
            # handle_generate_request: a session timed out (reaped) or closing -- a plain request, aborted
            gone = f"Invalid request: session id {sid} does not exist" if sid not in sc else \
                f"Invalid request: close was requested for session {sid}"
            sid = None
        if sid is not None:  # an open session (closed ones leave self.sessions at once)
            turns = self.session_turns.setdefault(sid, [])
            params = S.SessionParams(id=sid, rid=pick(op.parent, turns),
                                     offset=op.offset, replace=bool(op.replace),
                                     drop_previous_output=bool(op.drop_previous_output))
            turns.append(rid)
            recv = S.TokenizedGenerateReqInput(
                input_text=None, input_ids=ids, input_embeds=None, mm_inputs=None, token_type_ids=None, sampling_params=sp,
                return_logprob=False, logprob_start_len=-1, top_logprobs_num=0, token_ids_logprob=None, stream=True,
                rid=rid, session_params=params, priority=op.priority)
            req = self._create_session_req(sc.get(sid), recv)
        else:
            req = self._new_req(rid, ids, sp)
            req.priority = op.priority
            if gone is not None:
                req.set_finish_with_abort(gone)
        # Scheduler.init_req_max_new_tokens and validate_input_length: a turn whose history no longer
        # fits the context is aborted at intake, before it can reach a row
        input_len = len(req.origin_input_ids)
        max_new = max(0, min(req.sampling_params.max_new_tokens, self.max_req_len - input_len - 1))
        if compat.has("alloc-max-new-tokens", S.version):
            max_new = self.allocator.max_new_tokens_for_memory(input_len, max_new, token_capacity=cfg.total_tokens,
                                                               sliding_window_size=None, chunk_size=None)
        else:  # 0.5.20's own bound: the paged prompt, a page and one token under the pool size
            max_new = max(0, min(max_new, cfg.total_tokens - -(-input_len // cfg.page_size) * cfg.page_size
                                 - cfg.page_size - 1))
        req.sampling_params.max_new_tokens = max_new or 0
        error = None  # managers/utils.py::validate_input_length, without auto-truncation (its default)
        if input_len >= self.max_req_input_len:
            error = f"Input length ({input_len} tokens) exceeds the maximum allowed length ({self.max_req_input_len} tokens)."
        elif max_new is None:
            error = "the prompt cannot fit in the KV pool"
        if error is not None and req.to_finish is None:
            req.set_finish_with_abort(error)
        req.kvaudit_stop_at = stop_at
        self.submitted.append(rid)
        gm = self.grammar_manager
        # (a turn create_req rejected still goes through the grammar, as in SGLang: only its to_finish is set)
        if gone is not None or error is not None or gm is None:
            self._add_request_to_queue(req)
            return
        if op.grammar is not None:
            req.sampling_params.regex = f"kvaudit:{self.steps + op.grammar}:{rid}"
        if not gm.process_req_with_grammar(req):
            self._add_request_to_queue(req)

    def _new_req(self, rid: str, ids, sp):
        if self.fake_bootstrap(rid):  # Req reads bootstrap_host on any server (skip_radix_cache_insert)
            from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST
            return self.S.Req(rid, "", ids, sp, vocab_size=self.config.vocab_size, eos_token_ids={EOS},
                              bootstrap_host=FAKE_BOOTSTRAP_HOST)
        return self.S.Req(rid, "", ids, sp, vocab_size=self.config.vocab_size, eos_token_ids={EOS})

    def fake_bootstrap(self, rid: str) -> bool:
        """Whether client request ``rid`` (``r<n>``) carries ``FAKE_BOOTSTRAP_HOST``: every
        ``fake_bootstrap_every``-th, as a fake-prefill benchmark client sends it (config ``fake_bootstrap_every``)."""
        n = self.config.fake_bootstrap_every
        return n is not None and rid[:1] == "r" and rid[1:].isdigit() and int(rid[1:]) % n == n - 1

    def _create_session_req(self, session, recv):
        """``Session.create_req`` for a session turn (``recv``: its ``TokenizedGenerateReqInput``)."""
        return session.create_req(recv, None, self.config.vocab_size, eos_token_ids={EOS})

    def _add_request_to_queue(self, req, is_retracted: bool = False) -> None:
        """``Scheduler._add_request_to_queue``: ``_set_or_validate_priority``, ``_abort_on_queued_limit``,
        then the waiting queue (``wait_queue_entry_time`` a count, so FCFS ties are deterministic)."""
        cfg = self.config
        if cfg.enable_priority_scheduling and req.priority is None:
            req.priority = -(1 << 62) if not cfg.schedule_low_priority_values_first else 1 << 62  # +-sys.maxsize
        if self._abort_on_queued_limit(req):
            self._release_aborted_request(req)
            self.finished.add(req.rid)
            return
        self._prefetch_kvcache(req)
        self.waiting.append(req)
        self._queued += 1
        req.time_stats.wait_queue_entry_time = float(self._queued)
        req.kvaudit_queued_at = self.steps

    def _prefetch_kvcache(self, req) -> None:
        """``Scheduler._prefetch_kvcache``: no storage tier here."""

    def _prefetch_ready(self, req) -> bool:
        """Admission's storage gate: always ready here (no storage tier)."""
        return True

    def _prefetch_after_device_hit_loss(self, req) -> bool:
        """Admission's storage re-query after the match: never here."""
        return False

    def _abort_on_queued_limit(self, req) -> bool:
        """``Scheduler._abort_on_queued_limit``: True if ``req`` was aborted (with priorities, a less
        preferred waiting request may be aborted instead)."""
        cfg = self.config
        if cfg.max_queued_requests is None or len(self.waiting) + 1 <= cfg.max_queued_requests:
            return False
        if cfg.enable_priority_scheduling:
            d = 1 if cfg.schedule_low_priority_values_first else -1
            idx, worst = max(enumerate(self.waiting), key=lambda it: (d * it[1].priority,
                                                                       it[1].time_stats.wait_queue_entry_time))
            if d * req.priority < d * worst.priority:
                self.waiting.pop(idx)
                self._release_aborted_request(worst)
                self.finished.add(worst.rid)
                return False
        return True

    def _poll_timeout_aborts(self) -> None:
        """``Scheduler._poll_timeout_aborts``: waiting and running timeouts, as 503 aborts."""
        cfg = self.config
        aborts = []
        if cfg.request_waiting_timeout_steps is not None:
            aborts += [(r.rid, "Request waiting timeout reached.") for r in self.waiting
                       if self.steps - r.kvaudit_queued_at > cfg.request_waiting_timeout_steps]
        if cfg.request_running_timeout_steps is not None:
            aborts += [(r.rid, "Request running timeout reached.") for r in self._inflight()
                       if not r.finished() and r.to_finish is None and getattr(r, "kvaudit_forward_at", None) is not None
                       and self.steps - r.kvaudit_forward_at > cfg.request_running_timeout_steps]
        for rid, message in aborts:
            self._abort(rid, message)

    def _abort(self, rid: str, message: str | None = None) -> None:
        """``Scheduler.abort_request``, matching rids by prefix as SGLang does (``r1`` also ends ``r10``):
        the chunked request is only marked, waiting ones are popped, in-flight ones get ``to_finish``."""
        if self.chunked_req is not None and self.chunked_req.rid.startswith(rid):
            self._pending_chunked_abort = self.chunked_req
        for req in [r for r in self.waiting if r.rid.startswith(rid)]:
            self.waiting.remove(req)
            self._release_aborted_request(req)
            self._release_queued_mamba(req)
            self.finished.add(req.rid)
        if self.grammar_manager is not None:  # set_finish_with_abort: it still runs one 1-token prefill
            self.grammar_manager.abort_requests(SimpleNamespace(abort_all=False, rid=rid))
        for req in self._inflight():  # running, or in the last batch
            if req.rid.startswith(rid) and not req.finished():
                req.to_finish = self.S.FINISH_ABORT() if message is None else \
                    self.S.FINISH_ABORT(message, HTTPStatus.SERVICE_UNAVAILABLE)

    def _release_queued_mamba(self, req) -> None:
        """``abort_request``'s "for mamba radix cache" step: a popped waiting request that holds a mamba
        slot (taken by its match) is released with ``checkpoint=False``."""
        if req.kv.holds_mamba:
            compat.release_kv(self.S, req, self.tree_cache, False)

    def _pause_generation(self, mode: str) -> None:
        """``TokenizerManager.pause_generation``: ``abort`` aborts every request; ``in_place`` / ``retract``
        stop the scheduler (``retract`` first retracts every in-flight request)."""
        if self.held is None:
            self.held = []
        if mode == "abort":
            for rid in self.live_rids():
                self._abort(rid)
            return
        if mode == "retract":
            self._pause_retract()
        self.scheduler_paused = True

    def _pause_retract(self) -> None:
        """``Scheduler.pause_generation(mode="retract")``: the pending result first (overlap), then the
        running batch, a prefill last batch and the chunked request through ``retract_all`` and back to
        the waiting queue."""
        if self.config.enable_overlap and self._last is not None:
            last, self._last = self._last, None
            self._process(*last)
        reqs = [r for r in self.running if not r.finished()]
        if self._scheduled is not None and self._scheduled[0] == "extend":
            reqs += [r for r in self._scheduled[1] if not r.finished() and not any(r is x for x in reqs)]
        chunked = self.chunked_req
        if chunked is not None and not chunked.finished() and not any(chunked is x for x in reqs):
            reqs.append(chunked)
        self._scheduled = None
        self._retract_all(reqs)
        self.running = []
        for req in reqs:
            self._add_request_to_queue(req)
        self.chunked_req = None

    def _retract_all(self, reqs: list) -> None:
        """``retract_all(reqs, ..., offload_kv=False)``: a pause rebuilds the KV afterwards."""
        if reqs:
            self.S.retract_all(reqs=reqs, req_to_token_pool=self.req_to_token_pool,
                               token_to_kv_pool_allocator=self.allocator, tree_cache=self.tree_cache,
                               hisparse_coordinator=self._hisparse_coordinator(), offload_kv=False)
        self.retractions += len(reqs)

    def _hisparse_coordinator(self):
        """The ``HiSparseCoordinator`` SGLang's releases are given (none here)."""
        return None

    def _continue_generation(self) -> None:
        """``continue_generation``: the scheduler runs again, then the held requests are sent."""
        self.scheduler_paused = False
        held, self.held = self.held or [], None
        for kind, args in held:
            self._generate(kind, args)

    def _memory_pressure(self) -> None:
        """Another tenant needs memory: evict what the tree can give, retract at the next decode
        (``SGLANG_TEST_RETRACT``)."""
        self.tree_cache.evict(self.S.EvictParams(num_tokens=self.tree_cache.evictable_size()))
        self._force_retract = True

    def _release_aborted_request(self, req) -> None:
        """``Scheduler._release_aborted_request``: the tree's per-request state and ``Session.abort_req``
        (before change ``cache-request-handle``, 0.5.18/0.5.19: ``release_aborted_request(rid)``, only with HiCache
        storage, which the current family drives on neither)."""
        if compat.has("cache-request-handle", self.S.version):
            self.tree_cache.finish(req.cache_request_handle, self.S.CacheRequestOutcome.ABORT)
        if req.session is not None and req.session.streaming:
            req.session.abort_req()

    def _flush_cache(self) -> bool:
        """``Scheduler.flush_cache``: only when fully idle (while paused, waiting requests without KV do not
        count), reset the tree and clear both pools. Returns whether it flushed."""
        if not self.is_idle(ignore_waiting=self.scheduler_paused):
            return False
        self._scheduled = None
        self.tree_cache.reset()
        self.req_to_token_pool.clear()
        self.allocator.clear()
        if self.grammar_manager is not None:
            self.grammar_manager.clear()
        self._flushes += 1
        return True

    def _check_pending_flush(self) -> None:
        """``flush_wrapper.check_pending()``: a deferred flush runs once idle, or fails at its deadline."""
        done = self._flushes
        self.flush_wrapper.check_pending()  # (its timeout warning goes to the root logger, silenced by load())
        if self._flushes != done:
            self._after_intake()

    def on_intake(self, callback) -> None:
        """Call ``callback()`` after each message that can free memory at intake, before the next step: the
        runner's use-after-free scan."""
        self._intake = callback

    def _after_intake(self) -> None:
        if self._intake is not None:
            self._intake()

    def _text(self, rid: str) -> list[int]:
        for req in self._active():
            if req.rid == rid:
                return list(req.origin_input_ids) + list(req.output_ids)
        return []

    def live_rids(self) -> list[str]:
        live = {r.rid for r in self._active() if not r.finished()}
        return [r for r in self.submitted if r in live]

    def is_idle(self, ignore_waiting: bool = False) -> bool:
        """``is_fully_idle``; with ``ignore_waiting`` only waiting requests holding KV count."""
        waiting = any(r.kv.holds_kv for r in self.waiting) if ignore_waiting else bool(self.waiting)
        grammars = self.grammar_manager is not None and bool(self.grammar_manager.grammar_queue)
        return not waiting and not grammars and not self.running and self._last is None and self.chunked_req is None

    def is_idle_for_health_check(self) -> bool:
        """``is_fully_idle(for_health_check=True)``: no waiting, running or chunked request, no pending
        result; a mode's own in-flight work does not count."""
        return not self.waiting and not self.running and self._last is None and self.chunked_req is None
