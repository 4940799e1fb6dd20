"""The real-SGLang target: kvaudit's programs drive SGLang 0.5.23's own memory manager on CPU.

Three layers (see ``boot`` for the first):

* **bootstrap** -- version probe, import stubs, objects built by SGLang's tree-cache factory;
* **driver** (:class:`SglangTarget`) -- kvaudit's ops mapped onto SGLang's scheduler-level functions
  in the scheduler's own order. The driver plays ``Scheduler`` (``managers/scheduler.py``), including
  its admission budget (``PrefillBudget``, ``schedule_policy.PrefillAdder``) and decode retraction
  (``ScheduleBatch.check_decode_mem``/``retract_decode``), so that a driver mistake never reads as an
  SGLang bug. Each method names the SGLang function whose call order it follows;
* **observer** -- wrappers on the allocator and request-pool *instances* (never the classes) that
  feed kvaudit's ledger, plus the roots, counters and lock holders the oracles read.

There is no model: a sampled token is a deterministic function of the request and position, and
``stop_at`` samples EOS (token 1). No KV content is computed, so there are no shadow tags here.
"""

from __future__ import annotations

import time
from array import array
from concurrent import futures
from http import HTTPStatus
from types import SimpleNamespace

import numpy as np
import torch

from kvaudit.program import PAUSE_MODES, Abort, CloseSession, ContinueGeneration, FlushCache, HealthCheck, \
    MemoryPressure, Op, OpenSession, PauseGeneration, Submit, TransferFail, prompt_tokens
from kvaudit.targets.base import (Accounting, PoolSpec, Recount, Root, kv_length_problems, record_roots, slot_pages,
                                  wrap_insert)
from kvaudit.targets.sglang.boot import GRAMMAR_BACKEND, build, load, one_rank_group
from kvaudit.targets.sglang.config import SglangConfig

EOS = 1
MAX_PREFILL_TOKENS = 16384  # ServerArgs.max_prefill_tokens' default: PrefillAdder's rem_input_tokens


def host_units(slots: torch.Tensor, page_size: int) -> np.ndarray:
    """Host slots (``[n]`` int64, tokens) as ledger units: host page + 1 (SGLang's host pools have no
    reserved slot 0; kvaudit's unit 0 is the reserved padding unit of every pool)."""
    s = slots.to(torch.int64).cpu().numpy()
    s = s[s >= 0]
    return np.unique(s // page_size) + 1


def host_free_units(host_pool, page_size: int) -> np.ndarray:
    """A host pool's free list (``free_slots`` and the pending ``release_slots``) as ledger units, one
    entry per free page (the first slot of each), for the event-log replay check."""
    slots = host_pool.free_slots
    if host_pool.release_slots:
        slots = torch.cat([slots, *host_pool.release_slots])
    slots = slots[slots % page_size == 0]
    return (slots // page_size + 1).cpu().numpy()


class StepClock:
    """A driver's clock (one second a scheduler step) as the ``time`` of the SGLang modules whose
    timeouts it drives (session timeouts, deferred flushes, PD deferred releases), so they are
    deterministic: ``monotonic()`` is the clock, everything else the real ``time``."""

    def __init__(self):
        self.now = 1000.0

    def install(self, module) -> None:
        """Be ``module.time`` (replacing whatever clock an earlier target installed there)."""
        module.time = self

    def monotonic(self) -> float:
        return self.now

    def __getattr__(self, name):
        return getattr(time, name)


class _NoSampling:
    """The batch's ``sampling_info`` (penalties, temperatures: model-side, no memory). Only
    ``filter_batch`` (retraction, preemption) and ``merge_batch`` (a mixed batch) touch it here."""

    def filter_batch(self, keep_indices, keep_indices_device) -> None:
        pass

    def merge_batch(self, other) -> None:
        pass


class _StepGrammarBackend:
    """kvaudit's grammar backend, registered under :data:`GRAMMAR_BACKEND` with SGLang's
    ``register_grammar_backend`` (its extension point for custom backends): a grammar "compiles" a
    number of scheduler steps after its request arrived -- the step is in the key the driver sets as
    the request's ``regex`` -- instead of on a thread pool. The future is running from the start (a
    free compile worker took it), so an abort's ``cancel()`` fails, as on a real server; the aborted
    request still leaves the queue at the next poll (``set_finish_with_abort`` drops its grammar).
    No tokenizer, no vocab masks."""

    enable_strict_thinking = False

    def __init__(self, grammar_cls):
        self.grammar_cls = grammar_cls
        self.pending: list[tuple[int, futures.Future]] = []

    def get_request_grammar_key(self, key, input_ids=None, thinking_budget=None):
        return key

    def get_cached_or_future_value(self, key, require_reasoning):
        f = futures.Future()
        f.set_running_or_notify_cancel()
        self.pending.append((int(key[1].split(":")[1]), f))
        return f, False

    def tick(self, now: int) -> None:
        """Complete the compiles due by step ``now``."""
        due = [f for at, f in self.pending if at <= now]
        self.pending = [(at, f) for at, f in self.pending if at > now]
        for f in due:
            f.set_result(self.grammar_cls())

    def set_cache(self, key, value) -> None:
        pass

    def reset(self) -> None:
        pass


def _grammar_manager(S, server_args, model_config):
    """SGLang's own ``GrammarManager`` for a one-rank scheduler, over :class:`_StepGrammarBackend`."""

    class StepGrammar(S.BaseGrammarObject):
        """A compiled grammar that constrains nothing (sampling is the driver's)."""

        def accept_token(self, token: int) -> None:
            pass

    S.register_grammar_backend(GRAMMAR_BACKEND, lambda *a: _StepGrammarBackend(StepGrammar))
    group = SimpleNamespace(world_size=1, first_rank=0, is_first_rank=True)
    stand_in = SimpleNamespace(server_args=server_args, tokenizer=None, model_config=model_config,
                               dp_tp_cpu_group=one_rank_group(), dp_tp_group=group, pp_group=None)
    manager = S.GrammarManager(stand_in)
    manager.SGLANG_GRAMMAR_POLL_INTERVAL = 1e-4  # its poll sleeps up to this long per step (seconds)
    return manager


class SglangTarget:
    """Drives one set of SGLang pools and one ``UnifiedRadixCache`` (see the module docstring)."""

    name = "sglang"
    owner_hint_vars = ("req",)
    owner_stop_vars = ("reqs", "batch")

    def __init__(self, config: SglangConfig):
        S = self.S = load()
        self.config = config
        self.clock = StepClock()  # advanced by step(); a mode's _build may install it too
        o = self._build(config)
        self.allocator, self.req_to_token_pool, self.tree_cache = o.allocator, o.req_to_token_pool, o.tree_cache
        self.model_config, self.tree_core = o.model_config, o.tree_core
        # Scheduler.grammar_manager (a PD decode server's stand-in has its own)
        self.grammar_manager = _grammar_manager(S, o.server_args, o.model_config) \
            if config.disaggregation_mode == "null" else None
        self.session_controller = S.SessionController(self.tree_cache) if config.enable_streaming_session else None
        if self.session_controller is not None:
            # the session timeout's clock (Session.is_timed_out: time.monotonic()) is the step count
            import sglang.srt.session.session_controller as session_controller
            self.clock.install(session_controller)
        self.steps = 0
        # TpModelWorker: max_req_len = min(context_len - 1, pool tokens - 1), inputs 5 tokens shorter
        self.max_req_len = min(config.context_len - 1, config.total_tokens - 1)
        self.max_req_input_len = self.max_req_len - 5
        self.waiting: list = []  # Scheduler.waiting_queue
        self.running: list = []  # Scheduler.running_batch.reqs
        self.submitted: list[str] = []
        self.finished: set[str] = set()
        self.sessions: list[str] = []  # open session ids, in opening order
        self.session_turns: dict[str, list[str]] = {}  # session id -> its turns' rids (SessionParams.rid)
        self._n = 0
        self._opened = 0
        self._force_retract = False
        self._flushes = 0
        self._held: dict[str, tuple] = {}
        self._last: tuple[str, list, object] | None = None  # overlap: the batch whose result is still to process
        self.chunked_req = None  # Scheduler.chunked_req: the one request between prefill chunks
        self._pending_chunked_abort = None  # Scheduler._pending_chunked_abort_req
        self.retractions = 0  # requests retract_decode took out of the running batch
        self.last_retraction: str | None = None  # what the last retract_decode did (retraction())
        self._intake = None
        self._scheduled = None  # Scheduler.last_batch: the batch the latest step ran, (kind, reqs, chunked)
        self._queued = 0  # requests ever queued: their wait_queue_entry_time (FCFS order among equal priorities)
        self.scheduler_paused = False  # Scheduler._engine_paused (pause_generation in_place / retract)
        # TokenizerManager.is_pause: generate requests held until continue, as (op kind, _submit's arguments)
        self.held: list[tuple[str, tuple]] | None = None
        self.policy = None  # Scheduler.policy (SchedulePolicy), only with priority scheduling
        # flush_cache with a timeout waits for idle (is_fully_idle, never ignoring waiting requests);
        # its deadline reads the module's clock: one second a scheduler step
        import sglang.srt.managers.scheduler_components.flush_wrapper as flush_wrapper
        self.clock.install(flush_wrapper)
        self.flush_wrapper = S.SchedulerFlushWrapper(flush_cache=self._flush_cache, is_fully_idle=self.is_idle,
                                                     send_output=lambda output, request: None)
        if config.enable_priority_scheduling:
            self.policy = S.SchedulePolicy("fcfs", self.tree_cache, False, True, config.schedule_low_priority_values_first)
        self._faults = set(config.bugs)  # each fires once
        self.lock_net: dict[int, int] = {}  # node id -> incs - decs (the lock-ref ledger, per node)
        ps = config.page_size
        self._pools = [
            PoolSpec("token_to_kv_pool", self.allocator, "kv", ps, config.num_pages),
            PoolSpec("req_to_token_pool", self.req_to_token_pool, "rows", 1, self._row_count()),
        ]
        if "lock-leak" in self._faults:
            self._inject_lock_leak()

    def _build(self, config: SglangConfig):
        """SGLang's objects for ``config`` (``boot.build``); a mode with more objects extends it."""
        return build(config)

    # -- observer: hooks ---------------------------------------------------------------------
    def pools(self) -> list[PoolSpec]:
        return self._pools

    def engine_files(self) -> list[str]:
        """This driver plays SGLang's scheduler: its frames are sites like SGLang's own (a free the
        driver makes itself, as flush_cache's clear(), is located here, not in kvaudit's runner)."""
        return [__file__]

    def framework_files(self) -> list[str]:
        """Allocator-internal files: a site's innermost frame is the first frame outside these."""
        import sglang.srt.mem_cache.allocator.base as base
        import sglang.srt.mem_cache.memory_pool as memory_pool
        return [base.__file__, memory_pool.__file__]

    def install_pool(self, spec: PoolSpec, auditor, wrap) -> None:
        """Wrap ``spec``'s instance methods so every alloc and free reaches ``auditor``'s ledger.

        * rows: ``ReqToTokenPool.alloc_rows``/``free_rows`` (``alloc``/``free`` bind requests on top);
        * KV, page 1: ``TokenToKVPoolAllocator.alloc``/``free`` -- every free path (``free_segments``,
          ``free_page_ids``, ``free_group_end``) ends in ``free``;
        * KV, paged: ``alloc``/``alloc_extend``/``alloc_decode`` recorded as the pages that left the
          free set (extend and decode also hand out slots on a request's partly filled page, so
          ``out // page_size`` would name pages that were never free), and frees at
          ``_release_page_ids``, the one place every paged free path returns pages;
        * ``clear()`` as a free of every allocated unit.
        """
        obj, pool, ps = spec.obj, spec.name, spec.page_size
        capture = auditor.capture_site
        auditor.wrap_clear(spec)
        if spec.kind == "rows":
            auditor.wrap_rows(spec, alloc="alloc_rows", free="free_rows")
        else:
            # Frees inside a free group (free_group_begin/end: the scheduler's result processing)
            # reach the free list at free_group_end; they are recorded then, each with the site
            # of its own call. ``free()`` deduplicates pages over the whole group (one
            # torch.unique at the end); ``free_page_ids`` does not.
            pending: list[tuple[list[int], int, bool]] = []
            ending = [False]

            def grouped(name, to_units, dedup):
                orig = getattr(obj, name)

                def wrapper(idx, *a, **k):
                    if obj.free_group is not None and not ending[0] and idx.numel():
                        pending.append((to_units(idx), capture(), dedup))
                    return orig(idx, *a, **k)

                wrap(obj, name, wrapper)

            if ps == 1 and not hasattr(obj, "_release_page_ids"):  # TokenToKVPoolAllocator (a paged one may be page 1)
                alloc, free = obj.alloc, obj.free

                def alloc_wrapper(n):
                    out = alloc(n)
                    if out is not None and out.numel():
                        auditor.on_alloc(pool, out.tolist(), capture())
                    return out

                def free_wrapper(idx):
                    direct = obj.free_group is None and not ending[0]
                    if not direct and obj.free_group is not None and not ending[0] and idx.numel():
                        pending.append((idx.tolist(), capture(), False))
                    free(idx)
                    if direct and idx.numel():
                        auditor.on_free(pool, idx.tolist(), capture())

                wrap(obj, "alloc", alloc_wrapper)
                wrap(obj, "free", free_wrapper)
            else:
                def paged(name):
                    orig = getattr(obj, name)

                    def alloc_wrapper(*a, **k):
                        before = obj.get_all_free_pages().cpu().numpy()
                        out = orig(*a, **k)
                        if out is not None:
                            taken = np.setdiff1d(before, obj.get_all_free_pages().cpu().numpy())
                            if taken.size:
                                auditor.on_alloc(pool, taken.tolist(), capture())
                        return out
                    return alloc_wrapper

                for name in ("alloc", "alloc_extend", "alloc_decode"):
                    wrap(obj, name, paged(name))
                grouped("free", lambda idx: torch.unique(idx // ps).tolist(), True)
                grouped("free_page_ids", lambda ids: ids.tolist(), False)
                release = obj._release_page_ids

                def release_wrapper(*page_ids):
                    release(*page_ids)
                    units = torch.cat([p.reshape(-1) for p in page_ids]).tolist() if page_ids else []
                    if units and not ending[0]:
                        auditor.on_free(pool, units, capture())

                wrap(obj, "_release_page_ids", release_wrapper)

            group_end = obj.free_group_end

            def group_end_wrapper():
                ending[0] = True
                try:
                    group_end()
                finally:
                    ending[0] = False
                items = list(pending)
                pending.clear()
                seen: set[int] = set()
                for units, sid, dedup in items:
                    if dedup:
                        units = [u for u in units if u not in seen]
                        seen.update(units)
                    if units:
                        auditor.on_free(pool, units, sid)

            wrap(obj, "free_group_end", group_end_wrapper)

    def _install_host_pool(self, spec: PoolSpec, auditor, wrap, live: set | None = None) -> None:
        """A host pool (``HostKVCache``, HiSparse's or HiCache's): ``alloc(n)``/``free(slots)`` on the
        instance and ``clear()``, in host pages + 1 (:func:`host_units`). ``live``, if given, mirrors
        the units held."""
        obj, pool, ps = spec.obj, spec.name, spec.page_size
        capture = auditor.capture_site
        auditor.wrap_clear(spec)
        alloc, free = obj.alloc, obj.free
        live = set() if live is None else live

        def alloc_wrapper(need_size, *a, **k):
            out = alloc(need_size, *a, **k)
            if out is not None and out.numel():
                units = host_units(out, ps).tolist()
                live.update(units)
                auditor.on_alloc(pool, units, capture())
            return out

        def free_wrapper(indices, *a, **k):
            out = free(indices, *a, **k)
            if indices.numel():
                units = host_units(indices, ps).tolist()
                live.difference_update(units)
                auditor.on_free(pool, units, capture())
            return out

        wrap(obj, "alloc", alloc_wrapper)
        wrap(obj, "free", free_wrapper)
        cleared = getattr(obj, "clear", None)  # auditor.wrap_clear's wrapper
        if cleared is not None:
            def clear_wrapper(*a, **k):
                live.clear()
                return cleared(*a, **k)

            wrap(obj, "clear", clear_wrapper)

    def install_lock_ledger(self, wrap, record) -> None:
        """Report every ``inc_lock_ref``/``dec_lock_ref`` of the tree (``UnifiedRadixCache``; ``lock``,
        ``unlock`` and checkpoint's lock moves all go through them) to ``record(node_id, delta)``."""
        cache = self.tree_cache
        inc, dec = cache.inc_lock_ref, cache.dec_lock_ref
        net = self.lock_net

        def inc_wrapper(node_id, *a, **k):
            out = inc(node_id, *a, **k)
            net[node_id] = net.get(node_id, 0) + 1
            record(node_id, +1)
            return out

        def dec_wrapper(node_id, *a, **k):
            out = dec(node_id, *a, **k)
            net[node_id] = net.get(node_id, 0) - 1
            record(node_id, -1)
            return out

        wrap(cache, "inc_lock_ref", inc_wrapper)
        wrap(cache, "dec_lock_ref", dec_wrapper)

    def install_insert_check(self, wrap, report) -> None:
        """Check every ``UnifiedRadixCache.insert(params)`` (``checkpoint_into_tree``'s, on the instance):
        the tree takes ``min(len(params.key), len(params.value))`` tokens of the request being cached
        (the caller's local ``req``), which must not exceed its ``kv_committed_len``; else
        ``report(owner, inserted, committed, slots)`` with the slots past ``kv_committed_len``."""

        def measure(req, params, *a, **k):
            value = params.value
            inserted = min(len(params.key), int(value.numel())) if value is not None else 0
            return f"req:{req.rid}", inserted, req.kv.kv_committed_len, value

        wrap_insert(wrap, self.tree_cache, "insert", measure, report)

    def recount(self) -> dict[str, dict[str, Recount]]:
        """The tree's terms recounted from its nodes (SGLang's definition, the Python core's
        ``sanity_check`` part 4): ``evictable`` = FULL device tokens of nodes whose FULL ``lock_ref`` is 0,
        ``protected`` = those of nodes with ``lock_ref > 0``. Python core: one walk of its nodes; Rust
        core (no Python nodes): ``walk_for_kv_canary(unlocked_only=True)`` for the unlocked tokens and
        ``all_values_flatten`` for all of them."""
        cache = self.tree_cache
        if cache.disable:
            return {}
        core = cache.tree_core
        if self.tree_core.startswith("Rust"):
            ev = int(core.walk_for_kv_canary(True, False).slot_indices.numel())
            pr = int(cache.all_values_flatten().numel()) - ev
        else:
            from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
            full, ev, pr = ComponentType.FULL, 0, 0
            stack = list(core.root_node.children.values())
            while stack:
                node = stack.pop()
                stack.extend(node.children.values())
                data = node.component_data[full]
                if data.value is not None:
                    if data.lock_ref > 0:
                        pr += len(data.value)
                    else:
                        ev += len(data.value)
        return {"token_to_kv_pool": {"evictable": Recount(ev, "tree", "its nodes with lock_ref 0"),
                                     "protected": Recount(pr, "tree", "its nodes with lock_ref > 0")}}

    def _inject_lock_leak(self) -> None:
        cache = self.tree_cache
        unlock = cache.unlock

        def unlock_dropping_one(lock):
            if lock is not None and "lock-leak" in self._faults and lock.node != cache.root_node_handle():
                self._faults.discard("lock-leak")
                return None
            return unlock(lock)

        cache.unlock = unlock_dropping_one

    @staticmethod
    def owner_hint(frame_locals: dict) -> str | None:
        rid = getattr(frame_locals.get("req"), "rid", None)
        return f"req:{rid}" if isinstance(rid, str) else None

    # -- driver -------------------------------------------------------------------------------
    @property
    def paused(self) -> bool:
        """A pause is in force (``pause_generation`` until ``continue_generation``)."""
        return self.scheduler_paused or self.held is not None

    def apply(self, op: Op) -> None:
        """Deliver a message, as ``Scheduler.process_input_requests`` does at intake. While paused, the
        tokenizer holds generate requests (submits, health checks) until ``continue_generation``; a held
        submit's prompt and session are the client's, resolved when it is sent, as the built-in
        engine's target does."""
        cfg = self.config
        if isinstance(op, Submit):
            max_new = max(1, min(op.max_new_tokens, cfg.context_len // 4))
            plen = max(1, min(op.prompt_len, cfg.context_len // 2))
            prompt = prompt_tokens(op.family, plen, cfg.vocab_size)
            if op.extends is not None and self.submitted:
                prompt = (self._text(self.submitted[op.extends % len(self.submitted)]) + prompt)[: cfg.context_len // 2]
            sid = self.sessions[op.session % len(self.sessions)] if op.session is not None and self.sessions else None
            self._generate(op.kind, (prompt, max_new, op.stop_at, sid, "r", op))
        elif isinstance(op, HealthCheck):
            self._generate(op.kind, ())
        elif isinstance(op, Abort):
            live = self.live_rids()
            if op.handle is None:
                for rid in live:
                    self._abort(rid)
            elif live:
                self._abort(live[op.handle % len(live)])
        elif isinstance(op, FlushCache):  # SchedulerFlushWrapper.handle: now, or deferred up to the timeout
            self.flush_wrapper.handle(self.S.FlushCacheReqInput(timeout_s=float(op.timeout)))
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

    def _transfer_fail(self, handle: int | None) -> None:
        """:class:`TransferFail`: a no-op here (no transfers on an aggregated server); the PD decode
        driver overrides it."""

    def _generate(self, kind: str, args: tuple) -> None:
        """A generate request reaches the tokenizer: held while paused, else sent to the scheduler
        (a submit: :meth:`_submit`; /health_generate: a 1-token request, run only when the scheduler is
        idle)."""
        if self.held is not None:
            self.held.append((kind, args))
        elif kind == "submit":
            self._submit(*args)
        elif self.is_idle_for_health_check():
            self._submit([2], 1, None, None, rid_prefix="HEALTH_CHECK_")

    def _submit(self, prompt: list[int], max_new: int, stop_at: int | None, sid: str | None,
                rid_prefix: str = "r", op: Submit | None = None) -> None:
        """``Scheduler.handle_generate_request``: a plain ``Req``, or ``Session.create_req`` for a session
        turn; then its length checks; then ``process_req_with_grammar`` (a request with a grammar waits
        in the grammar queue until it compiles, ``op.grammar`` steps from now) or the waiting queue. A
        request aborted at intake goes to the waiting queue at once. ``op``, the submit, gives the rest:
        ``priority``, ``ignore_eos``, ``grammar``, and the turn's ``SessionParams`` (``parent``,
        ``replace``, ``drop_previous_output``, ``offset``)."""
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
            params = S.SessionParams(id=sid, rid=turns[op.parent % len(turns)] if op.parent is not None and turns else None,
                                     offset=op.offset, replace=bool(op.replace),
                                     drop_previous_output=bool(op.drop_previous_output))
            turns.append(rid)
            recv = S.TokenizedGenerateReqInput(
                input_text=None, input_ids=ids, input_embeds=None, mm_inputs=None, token_type_ids=None, sampling_params=sp,
                return_logprob=False, logprob_start_len=-1, top_logprobs_num=0, token_ids_logprob=None, stream=True,
                rid=rid, session_params=params, priority=op.priority)
            req = sc.get(sid).create_req(recv, None, cfg.vocab_size, eos_token_ids={EOS})
        else:
            req = self._new_req(rid, ids, sp)
            req.priority = op.priority
            if gone is not None:
                req.set_finish_with_abort(gone)
        # Scheduler.init_req_max_new_tokens and validate_input_length: a turn whose history no longer
        # fits the context is aborted at intake, before it can reach a row
        input_len = len(req.origin_input_ids)
        max_new = max(0, min(req.sampling_params.max_new_tokens, self.max_req_len - input_len - 1))
        max_new = self.allocator.max_new_tokens_for_memory(input_len, max_new, token_capacity=cfg.total_tokens,
                                                           sliding_window_size=None, chunk_size=None)
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
        """A plain ``Req`` (``handle_generate_request``)."""
        return self.S.Req(rid, "", ids, sp, vocab_size=self.config.vocab_size, eos_token_ids={EOS})

    def _add_request_to_queue(self, req, is_retracted: bool = False) -> None:
        """``Scheduler._add_request_to_queue``: ``_set_or_validate_priority`` (with priority scheduling a
        request without one gets the lowest), ``_abort_on_queued_limit``, then the waiting queue, stamped
        with ``wait_queue_entry_time`` (here a count, so FCFS ties are deterministic)."""
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
        """``Scheduler._prefetch_kvcache`` as a request is queued: an L3 storage prefetch (none here)."""

    def _prefetch_ready(self, req) -> bool:
        """Admission's storage gate (``check_prefetch_progress`` on a request's prefetch): a request whose
        prefetch is still running is skipped this round. Always ready here (no storage tier)."""
        return True

    def _prefetch_after_device_hit_loss(self, req) -> bool:
        """Admission, after the match: a storage re-query that skips the request this round. Never here."""
        return False

    def _abort_on_queued_limit(self, req) -> bool:
        """``Scheduler._abort_on_queued_limit``: with the waiting queue at ``max_queued_requests``, the
        newcomer is aborted (503); with priority scheduling, the least preferred waiting request is
        aborted instead if the newcomer is strictly preferred. Returns True if ``req`` was aborted."""
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
        """``Scheduler._poll_timeout_aborts`` (each ``ingest_requests``): an abort, by rid (so by rid
        prefix, as every abort), with the message "Request waiting/running timeout reached." and a 503,
        for each waiting request queued ``request_waiting_timeout_steps`` ago and each in-flight one
        scheduled ``request_running_timeout_steps`` ago."""
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
        """``Scheduler.abort_request``, which matches rids by prefix (``req.rid.startswith(rid)``: an
        abort of ``r1`` also ends ``r10``..``r19``, as SGLang's would): the chunked request is only
        marked (``_pending_chunked_abort_req``, torn down at the next step); waiting requests are
        popped (they hold no KV outside PD decode) and their cache state dropped
        (``_release_aborted_request``); running ones, or ones in the last batch, get ``to_finish`` and
        end at their next result, through ``release_kv_cache`` like any finish. A timeout abort's
        ``message`` goes with a 503 (``FINISH_ABORT(message, SERVICE_UNAVAILABLE)``)."""
        if self.chunked_req is not None and self.chunked_req.rid.startswith(rid):
            self._pending_chunked_abort = self.chunked_req
        for req in [r for r in self.waiting if r.rid.startswith(rid)]:
            self.waiting.remove(req)
            self._release_aborted_request(req)
            self.finished.add(req.rid)
        if self.grammar_manager is not None:  # set_finish_with_abort: it still runs one 1-token prefill
            self.grammar_manager.abort_requests(SimpleNamespace(abort_all=False, rid=rid))
        for req in self._inflight():  # running, or in the last batch
            if req.rid.startswith(rid) and not req.finished():
                req.to_finish = self.S.FINISH_ABORT() if message is None else \
                    self.S.FINISH_ABORT(message, HTTPStatus.SERVICE_UNAVAILABLE)

    def _pause_generation(self, mode: str) -> None:
        """``TokenizerManager.pause_generation``: generate requests are held from now on. ``abort``: the
        tokenizer aborts every request (``abort_request(abort_all=True)``), the scheduler keeps running.
        ``in_place`` / ``retract``: ``Scheduler.pause_generation`` -- the scheduler stops scheduling;
        ``retract`` first retracts every in-flight request (:meth:`_pause_retract`)."""
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
        """``Scheduler.pause_generation(mode="retract")``: under overlap the pending result is processed
        first; then the unfinished requests of the running batch, of the last batch if it was a prefill
        (its requests may not have joined the running batch yet: overlap, HiSparse staging) and the
        chunked request go through ``retract_all(..., offload_kv=False)`` (``release_req`` each:
        HiSparse ``retract_req``, ``release_kv_cache(checkpoint=False)``, ``reset_for_retract``) and back
        to the waiting queue; the running batch, last batch and chunked request are cleared."""
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
        """``retract_all(reqs, ..., offload_kv=False)``, as ``pause_generation(retract)`` calls it: each
        request through ``release_req`` (no host backup: a pause rebuilds the KV afterwards)."""
        if reqs:
            self.S.retract_all(reqs=reqs, req_to_token_pool=self.req_to_token_pool,
                               token_to_kv_pool_allocator=self.allocator, tree_cache=self.tree_cache,
                               hisparse_coordinator=self._hisparse_coordinator(), offload_kv=False)
        self.retractions += len(reqs)

    def _hisparse_coordinator(self):
        """The ``HiSparseCoordinator`` SGLang's releases are given (none on this target)."""
        return None

    def _continue_generation(self) -> None:
        """``Scheduler.continue_generation`` and ``TokenizerManager.continue_generation``: the scheduler
        runs again, then the held generate requests are sent, in order."""
        self.scheduler_paused = False
        held, self.held = self.held or [], None
        for kind, args in held:
            self._generate(kind, args)

    def _memory_pressure(self) -> None:
        """Another tenant needs memory: evict what the tree can give, retract at the next decode
        (``SGLANG_TEST_RETRACT``'s forced retraction)."""
        self.tree_cache.evict(self.S.EvictParams(num_tokens=self.tree_cache.evictable_size()))
        self._force_retract = True

    def _release_aborted_request(self, req) -> None:
        """``Scheduler._release_aborted_request``: the tree's per-request state, and a streaming
        session's turn bookkeeping (``Session.abort_req``)."""
        self.tree_cache.finish(req.cache_request_handle, self.S.CacheRequestOutcome.ABORT)
        if req.session is not None and req.session.streaming:
            req.session.abort_req()

    def _process_pending_chunked_abort(self) -> None:
        """``Scheduler.process_pending_chunked_abort`` (top of ``get_next_batch_to_run``): an aborted
        chunked request is finished (``prepare_abort``) and released with ``checkpoint=False``; its
        chunk still in flight (overlap) only drains its ``inflight_middle_chunks`` when its result
        lands. A request no longer chunked is aborted again where it is now."""
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

    def _flush_cache(self) -> bool:
        """``Scheduler.flush_cache``: only when fully idle (:meth:`is_idle`; sessions do not count; while
        the scheduler is paused, waiting requests that hold no KV do not either), reset the tree and clear
        both pools. Returns whether it flushed."""
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
        """``flush_wrapper.check_pending()`` (each ``ingest_requests``): a deferred flush runs once the
        server is idle, or fails at its deadline; the quiescence check follows a flush at once."""
        done = self._flushes
        self.flush_wrapper.check_pending()  # (its timeout warning goes to the root logger, silenced by load())
        if self._flushes != done:
            self._after_intake()

    def step(self) -> None:
        """One iteration of ``Scheduler.event_loop_normal``: reap deferred session closes
        (``SessionController.maybe_reap``), then a prefill batch if one can be admitted
        (``get_new_batch_prefill``, prefill first), else a decode step (``update_running_batch``),
        then the batch's result processing. With ``enable_overlap`` it is ``event_loop_overlap``:
        the previous batch's result is processed after the next batch is scheduled and allocated,
        and the previous prefill batch joins the running batch before its result is in
        (``get_next_batch_to_run``). Before scheduling, ``get_next_batch_to_run`` tears down a
        pending chunked abort and stashes the chunked request (``stash_chunked_request`` ->
        ``checkpoint_kv_cache``), which never joins the running batch between chunks."""
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
        if chunked is not None and chunked.extend_end > chunked.prefix_len:
            self.S.common.checkpoint_kv_cache(chunked, self.tree_cache)
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

    def _snapshot_held(self) -> None:
        """What each running request holds now: if a release elsewhere takes its record away (a session
        released under a running turn), the next scan still sees the request reading it."""
        table = self.req_to_token_pool.req_to_token
        self._held = {r.rid: (r.kv.req_pool_idx, table[r.kv.req_pool_idx, : r.kv.kv_allocated_len].clone(),
                              r.kv.cache_protected_len) for r in self.running if r.kv.holds_kv}

    def _join_running(self) -> None:
        """``get_next_batch_to_run``'s merge: under overlap the last prefill batch joins the running
        batch before its result is in, less the chunked request (this step's and the batch's). Without
        overlap, :meth:`_prefilled` has already added each request when its result came in."""
        if self.config.enable_overlap and self._last is not None and self._last[0] == "extend":
            excluded = (self.chunked_req, self._last[2])
            self.running += [r for r in self._last[1] if not r.finished() and not r.is_retracted
                             and r not in self.running and not any(r is x for x in excluded)]

    def _prefilled(self, req) -> None:
        """A prefill result that did not finish its request, after ``checkpoint_kv_cache``: without
        overlap the request joins the running batch now."""
        if not self.config.enable_overlap:
            self.running.append(req)

    def _new_batch(self, batch, kind: str) -> None:
        """A prefill (``kind`` ``"extend"``) or decode / running (``"decode"``) ``ScheduleBatch`` right after
        ``init_new``, before any allocation: what the scheduler sets on it besides (nothing more on
        this target)."""

    def _after_decode_alloc(self, batch) -> None:
        """After ``alloc_for_decode`` (``prepare_for_decode``): nothing more on this target."""

    def _process(self, kind: str, reqs: list, chunked=None, decoding=()) -> None:
        """``process_batch_result_prefill`` / ``_decode``, inside one free group: one sampled token per
        request, ``update_finish_state``, then ``release_kv_cache(checkpoint=True)`` for a finished
        request or, after a prefill, ``checkpoint_kv_cache``. A middle chunk samples nothing: its
        result only counts down ``inflight_middle_chunks``, even when the request was aborted since.
        Under overlap a request that finished or was retracted since the batch ran is skipped (its
        over-allocated slot goes back in its release). ``decoding``: the decode rows of a mixed batch
        (``batch.decoding_reqs``), which are not checkpointed; they go back to the running batch."""
        self.allocator.free_group_begin()
        for req in reqs:
            if (req.finished() and req.inflight_middle_chunks <= 0) or req.is_retracted:
                continue
            if kind == "extend" and req.inflight_middle_chunks > 0:
                req.inflight_middle_chunks -= 1
                continue
            req.output_ids.append(self._sample(req))
            req.update_finish_state()
            if req.finished():
                self._release(req, checkpoint=True)
            elif any(req is d for d in decoding):
                if not self.config.enable_overlap:  # (under overlap the last-batch merge brings it back)
                    self.running.append(req)
            elif kind == "extend":
                self.S.common.checkpoint_kv_cache(req, self.tree_cache)
                self._prefilled(req)
        self.allocator.free_group_end()
        if kind == "decode":
            self.running = [r for r in self.running if not r.finished()]

    def on_intake(self, callback) -> None:
        """Call ``callback()`` after each message that can free memory at intake (abort, session close,
        flush, memory pressure), before the next step schedules: the runner's use-after-free scan."""
        self._intake = callback

    def _after_intake(self) -> None:
        if self._intake is not None:
            self._intake()

    def _ceil(self, n: int) -> int:
        ps = self.config.page_size
        return -(-n // ps) * ps

    def _allocatable(self, held: int) -> int:
        """``Scheduler.get_num_allocatable_reqs``: the running-request budget left, and the free rows plus
        the rows the counted requests already hold (a continuing chunk, a session borrow)."""
        return min(self.config.max_running_requests - len(self.running),
                   self.req_to_token_pool.available_size() + held)

    def _prefill(self) -> tuple[str, list, object] | None:
        """``Scheduler.get_new_batch_prefill``, FCFS, with SGLang's own ``PrefillAdder``: the chunked
        request continues first (``add_chunked_req``), then each waiting request is matched
        (``init_next_round_input``: prefix match and session borrow) and offered to ``add_one_req``
        (prefill budget with the running batch's decode reserve, chunking, the admission lock), until
        it refuses; then ``ScheduleBatch.init_new`` and ``alloc_for_extend``. Returns
        ``("extend", admitted, chunked_req)`` for :meth:`_process`, or None when nothing is admitted."""
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
                break
        admitted = list(adder.can_run_list)
        # the admitted leave the queue first, then the preempted come back to it (even if nothing was
        # admitted), so the queue limit sees the queue SGLang's _add_request_to_queue sees
        self.waiting = [r for r in self.waiting if not any(r is a for a in admitted)]
        if adder.preempt_list:  # released by preempt_to_schedule
            self.running = list(running.reqs)
            self.retractions += len(adder.preempt_list)
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
        batch = S.ScheduleBatch.init_new(admitted, self.req_to_token_pool, self.allocator, cache, self.model_config,
                                         cfg.enable_overlap, S.SpeculativeAlgorithm.NONE, chunked_req=self.chunked_req)
        self._new_batch(batch, "extend")
        batch.forward_mode = S.ForwardMode.EXTEND
        batch.prefix_lens = [r.prefix_len for r in admitted]
        batch.extend_lens = [r.extend_end - r.prefix_len for r in admitted]
        batch.seq_lens_cpu = torch.tensor([r.extend_end for r in admitted], dtype=torch.int64)
        batch.seq_lens = batch.seq_lens_cpu.to(batch.device)
        batch.orig_seq_lens = batch.seq_lens.clone()
        batch.extend_num_tokens = sum(batch.extend_lens)
        # prepare_for_extend keeps what alloc_for_extend returns on the batch
        batch.out_cache_loc, batch.req_pool_indices, batch.req_pool_indices_cpu = S.allocation.alloc_for_extend(batch)
        for req in admitted:  # the batch's seq_lens, carried into decode (prepare_for_decode adds 1 a step)
            req.kvaudit_seq_len = req.extend_end
        decoding = self._mix_with_running(batch) if mixed and self.running else []
        if decoding:
            return "extend", admitted + decoding, self.chunked_req, decoding
        return "extend", admitted, self.chunked_req

    def _mix_with_running(self, batch) -> list:
        """``get_new_batch_prefill``'s mixed-style chunked prefill (``enable_mixed_chunk``): the running
        requests whose queued result finishes them by length leave the running batch
        (``_reqs_finishing_inflight``); if the rest pass ``check_decode_mem``, they get their decode
        slot (``prepare_for_decode`` -> ``alloc_for_decode``) and ride in the prefill batch
        (``mix_with_running``, ``decoding_reqs``), and the running batch is emptied; else they sit
        this step out (a mixed step never retracts). Returns the decode rows mixed in."""
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
        batch.sampling_info = _NoSampling()
        batch.extend_logprob_start_lens = [0] * len(batch.reqs)  # (logprobs: model-side; mix_with_running extends it)
        batch.mix_with_running(running)
        decoding = list(running.reqs)
        self.running = []
        return decoding

    def _finishing_inflight(self) -> list:
        """``Scheduler._reqs_finishing_inflight`` (overlap): running requests in the batch whose result is
        still queued that this result finishes by length."""
        if not self.config.enable_overlap or self._last is None:
            return []
        queued = set(map(id, self._last[1]))
        return [r for r in self.running if id(r) in queued and r.next_output_finishes_by_length()]

    def _decode(self) -> tuple[str, list, None] | None:
        """``Scheduler.update_running_batch``: under overlap, the requests whose queued result finishes
        them by length leave the batch first (``_reqs_finishing_inflight``); ``check_decode_mem``, and
        ``retract_decode`` when it fails (or under memory pressure); then ``alloc_for_decode`` for one
        token each. Returns ``("decode", reqs)`` for :meth:`_process`, or None."""
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
        batch.out_cache_loc = S.allocation.alloc_for_decode(batch, 1)  # as prepare_for_decode keeps it
        for req in batch.reqs:
            req.kvaudit_seq_len += 1
        self._after_decode_alloc(batch)
        return "decode", list(batch.reqs), None

    def _running_batch(self, reqs: list, overlap: bool):
        """``Scheduler.running_batch`` as a ``ScheduleBatch`` of ``reqs`` with the per-request tensors
        ``filter_batch`` and ``release_req`` read (rows, seq lens), for decode and for preemption."""
        S = self.S
        batch = S.ScheduleBatch.init_new(list(reqs), self.req_to_token_pool, self.allocator, self.tree_cache,
                                         self.model_config, overlap, S.SpeculativeAlgorithm.NONE)
        self._new_batch(batch, "decode")
        batch.req_pool_indices_cpu = torch.tensor([r.kv.req_pool_idx for r in reqs], dtype=torch.int64)
        batch.req_pool_indices = batch.req_pool_indices_cpu.to(batch.device)
        batch.seq_lens_cpu = torch.tensor([r.kvaudit_seq_len for r in reqs], dtype=torch.int64)
        batch.seq_lens = batch.seq_lens_cpu.to(batch.device)
        batch.orig_seq_lens = batch.seq_lens.clone()
        batch.sampling_info = _NoSampling()
        return batch

    def _sample(self, req) -> int:
        n = len(req.output_ids)
        if getattr(req, "kvaudit_stop_at", None) is not None and n + 1 >= req.kvaudit_stop_at:
            return EOS
        return 2 + ((len(req.origin_input_ids) + n) * 7 + 3) % (self.config.vocab_size - 2)

    def _release(self, req, checkpoint: bool) -> None:
        """``release_kv_cache(req, tree_cache, checkpoint=...)``, the one release of a finished request
        (``process_batch_result_*``). Injected faults act here."""
        self.finished.add(req.rid)
        if "skip-release" in self._faults:
            self._faults.discard("skip-release")
            return
        mine = None
        if "double-free" in self._faults and req.kv.holds_kv and req.session is None:
            kv = req.kv
            mine = self._pages(self.req_to_token_pool.req_to_token[kv.req_pool_idx,
                                                                     kv.cache_protected_len:kv.kv_allocated_len])
        self.S.common.release_kv_cache(req, self.tree_cache, checkpoint=checkpoint)
        if mine is not None:  # free once more what this release gave back (none: wait for the next)
            freed = np.setdiff1d(mine, self._pages(self.tree_cache.all_values_flatten()))
            if freed.size:
                self._faults.discard("double-free")
                self.allocator.free(torch.as_tensor(freed, dtype=torch.int64) * self.config.page_size)

    def _text(self, rid: str) -> list[int]:
        for req in self._active():
            if req.rid == rid:
                return list(req.origin_input_ids) + list(req.output_ids)
        return []

    def live_rids(self) -> list[str]:
        live = {r.rid for r in self._active() if not r.finished()}
        return [r for r in self.submitted if r in live]

    def is_idle(self, ignore_waiting: bool = False) -> bool:
        """``is_fully_idle``; with ``ignore_waiting`` (flush while paused) waiting requests count only if
        they hold KV."""
        waiting = any(r.kv.holds_kv for r in self.waiting) if ignore_waiting else bool(self.waiting)
        grammars = self.grammar_manager is not None and bool(self.grammar_manager.grammar_queue)
        return not waiting and not grammars and not self.running and self._last is None and self.chunked_req is None

    def is_idle_for_health_check(self) -> bool:
        """``is_fully_idle(for_health_check=True)``: a health check runs only when no batch can carry
        health information -- no waiting, running or chunked request, no batch whose result is
        pending. Unlike :meth:`is_idle` (flush), a mode's own in-flight work (HiSparse staging,
        HiCache copies) does not count."""
        return not self.waiting and not self.running and self._last is None and self.chunked_req is None

    def stalled(self) -> bool:
        """Only waiting requests are left and memory sessions hold keeps them out -- their own KV
        (``session_held``) or their slot's tree lock (the history, counted as ``protected``): SGLang
        waits too."""
        held = self._session_held_tokens() > 0 or any(s.lock is not None for _, s in self._slots())
        return bool(self.waiting) and not self.running and held

    def flushed(self) -> int:
        return self._flushes

    def quiescence(self) -> list[tuple[str, str]]:
        """After a successful flush: both pools full again and the tree empty."""
        out = []
        for name, a in self.accounting().items():
            if a.available + a.session_held != a.total:
                out.append((name, f"available={a.available} of total={a.total} after a successful flush_cache"))
        if self.tree_cache.evictable_size() + self.tree_cache.protected_size():
            out.append(("token_to_kv_pool", "the radix tree still holds tokens after a successful flush_cache"))
        return out

    def progress(self) -> dict[str, int]:
        """Per running (or chunked) request a number that grows while it progresses, -1 once aborted;
        nothing while the scheduler is paused (nothing is meant to progress then)."""
        if self.scheduler_paused:
            return {}
        out = {r.rid: r.kv.kv_committed_len + len(r.output_ids) for r in self.running}
        if self.chunked_req is not None:  # in no batch between chunks; a chunk advances extend_end
            out[self.chunked_req.rid] = self.chunked_req.extend_end
        for r in self.running:
            if r.to_finish is not None:
                out[r.rid] = -1
        return out

    def describe_busy(self) -> str:
        return (f"waiting={len(self.waiting)} running={len(self.running)} "
                f"available={self.allocator.available_size()} evictable={self.tree_cache.evictable_size()} "
                f"protected={self.tree_cache.protected_size()} session_held={self._session_held_tokens()}")

    # -- observer: roots and counters ---------------------------------------------------------
    def _pages(self, slots: torch.Tensor) -> np.ndarray:
        return slot_pages(slots, self.config.page_size)

    def _slots(self):
        return [] if self.session_controller is None else list(self.tree_cache.session.slots.items())

    def _session_held_tokens(self) -> int:
        """SGLang's ``session_held``: per slot holding KV, ``ceil_align(kv_allocated_len) - cache_protected_len``."""
        return sum(self._ceil(s.kv.kv_allocated_len) - s.kv.cache_protected_len for _, s in self._slots()
                   if s.kv.holds_kv)

    def _inflight(self) -> list:
        """``Scheduler.collect_inflight_reqs``: the running batch, and the last batch -- (overlap) the one
        whose result is pending, and the chunked request, whose last chunk ran last."""
        reqs = list(self.running)
        if self._last is not None:
            reqs += [r for r in self._last[1] if not any(r is x for x in reqs)]
        if self.chunked_req is not None and not any(self.chunked_req is x for x in reqs):
            reqs.append(self.chunked_req)
        return reqs

    def _active(self) -> list:
        """Waiting requests (and those in the grammar queue), and the in-flight ones (:meth:`_inflight`);
        the chunked request is in no batch between chunks, and SGLang's invariant checker adds it as this
        does."""
        queued = self.waiting + (self.grammar_manager.grammar_queue if self.grammar_manager is not None else [])
        return queued + [r for r in self._inflight() if not any(r is w for w in queued)]

    def _places(self) -> dict[int, str]:
        """``id(req)`` -> the scheduler structure that holds it (``Root.where``); the most specific one
        wins (the chunked request is in the last batch too, a decoding one in the running batch)."""
        groups = (("chunked", (self.chunked_req,) if self.chunked_req is not None else ()),
                  ("grammar", self.grammar_manager.grammar_queue if self.grammar_manager is not None else ()),
                  ("waiting", self.waiting), ("running", self.running),
                  ("last_batch", self._last[1] if self._last is not None else ()))
        out: dict[int, str] = {}
        for name, group in groups:
            for r in group:
                out.setdefault(id(r), name)
        return out

    def _live(self) -> list:
        """Requests that own a row (SGLang's ``_requests_owning_rows``: running batch, last batch,
        waiting queue)."""
        return [r for r in self._active() if r.kv.holds_kv]

    def roots(self, aborting: bool = True) -> list[Root]:
        """Every reference into the pools (recipe, "Roots for reachability"): the tree's values; each
        live request's row with its own KV ``[cache_protected_len, kv_allocated_len)`` (private) and
        its tree-owned prefix (shared); each session slot's record the same way."""
        table = self.req_to_token_pool.req_to_token
        out: list[Root] = []

        def record(kv, owner: str, role: str, where: str) -> None:
            out.extend(record_roots(table, kv, owner, role, self.config.page_size, where))

        held = set()
        for sid, slot in self._slots():
            if slot.kv.holds_kv:
                record(slot.kv, f"session:{sid}", "session", "session")
                held.add(id(slot.kv))
        places = self._places()
        for req in self._live():
            if not aborting and req.to_finish is not None:
                continue
            if id(req.kv) not in held:  # a turn on its session's record: the session root covers it
                record(req.kv, f"req:{req.rid}", "req", places.get(id(req), ""))
        for req in self.running:  # running, yet its record was released under it: it still reads that KV
            if not req.kv.holds_kv and not req.finished() and req.rid in self._held:
                row, slots, protected = self._held[req.rid]
                owner = f"req:{req.rid}"
                out.append(Root("req_to_token_pool", owner, np.array([row], dtype=np.int64)))
                out.append(Root("token_to_kv_pool", owner, self._pages(slots[protected:])))
        values = self.tree_cache.all_values_flatten()
        if values.numel():
            out.append(Root("token_to_kv_pool", "tree", self._pages(values), role="tree"))
        return out

    def units_of_rows(self, rows) -> dict[str, np.ndarray]:
        table = self.req_to_token_pool.req_to_token
        slots = table[torch.as_tensor(rows, dtype=torch.int64)].reshape(-1)
        return {"token_to_kv_pool": self._pages(slots[slots > 0])}

    def accounting(self) -> dict[str, Accounting]:
        a, cache, rp = self.allocator, self.tree_cache, self.req_to_token_pool
        rows = sum(1 for _, s in self._slots() if s.kv.holds_kv)
        return {
            "token_to_kv_pool": Accounting(a.available_size(), cache.evictable_size(), cache.protected_size(),
                                           self._session_held_tokens(), a.size),
            "req_to_token_pool": Accounting(rp.available_size(), 0, 0, rows, self._row_count()),
        }

    def _row_count(self) -> int:
        """Usable rows: row 0 is padding (``_alloc_size`` counts it; a PD decode pool adds its
        ``pre_alloc_size`` rows to ``size``)."""
        return self.req_to_token_pool._alloc_size - 1

    def metrics_check(self) -> list[str]:
        """Every live record's ``0 <= kv_committed_len <= kv_allocated_len`` (the free lists are checked
        against the event log by the oracles, through :meth:`free_lists`)."""
        return kv_length_problems(self._live())

    def free_lists(self) -> dict[str, np.ndarray]:
        """Each pool's free list as SGLang holds it (``get_all_free_pages``, ``free_slots``), for the
        event-log replay check."""
        return {"token_to_kv_pool": self.allocator.get_all_free_pages().cpu().numpy(),
                "req_to_token_pool": np.asarray(self.req_to_token_pool.free_slots, dtype=np.int64)}

    def lock_balance(self):
        """Tree nodes whose net lock count (``inc_lock_ref`` minus ``dec_lock_ref``) differs from the live
        lock holders on them (requests' ``req.lock``, session slots' ``slot.lock``); and, with every node
        balanced, ``protected_size()`` against the union of the holders' paths (recipe: orphan locks)."""
        cache = self.tree_cache
        want: dict[int, int] = {}
        holders = self._lock_holders()
        for node in holders:
            want[node] = want.get(node, 0) + 1
        bad = []
        for node, have in self.lock_net.items():
            if have != want.get(node, 0):
                try:
                    slots = cache.path_device_indices(node).cpu().numpy()
                except Exception:  # the node is gone (evicted or reset)
                    slots = np.empty(0, np.int64)
                bad.append((f"node {node}", slots, have, want.get(node, 0), {node}))
        if not bad:
            paths = [cache.path_device_indices(node) for node in holders]
            covered = np.unique(torch.cat(paths).cpu().numpy()) if paths else np.empty(0, np.int64)
            if covered.size != cache.protected_size():
                bad.append(("tree", covered, cache.protected_size(), int(covered.size), set(want)))
        return [b for b in bad if b[1].size] or bad[:0]

    def retraction(self) -> str | None:
        """What the last ``retract_decode`` retracted and freed, and why it stopped (None: none yet)."""
        return self.last_retraction

    def lock_holders(self) -> list[tuple[str, str, int]]:
        """Every live lock receipt as ``(lock, holder, node id)`` (the lock-ref ledger pairs incs with
        them, :mod:`kvaudit.locks`): requests' ``req.lock``, session slots' ``slot.lock``."""
        out = [("device", f"req:{r.rid}", r.lock.node) for r in self._live() + self.waiting if r.lock is not None]
        out += [("device", f"session:{sid}", s.lock.node) for sid, s in self._slots() if s.lock is not None]
        return out

    def _lock_holders(self) -> list:
        """The node each live device lock receipt is on (:meth:`lock_holders`)."""
        return [node for lock, _, node in self.lock_holders() if lock == "device"]

    def engine_check(self) -> list[str]:
        """SGLang's conservation identity (``SchedulerInvariantChecker``'s formula; the checker itself
        needs a whole Scheduler): ``available + evictable + protected + session_held + uncached == total``,
        with ``uncached = ceil_align(kv_allocated_len) - cache_protected_len`` per running request."""
        a = self.accounting()["token_to_kv_pool"]
        held = {id(s.kv) for _, s in self._slots()}
        uncached = sum(self._ceil(r.kv.kv_allocated_len) - r.kv.cache_protected_len for r in self._live()
                       if id(r.kv) not in held)
        lhs = a.available + a.evictable + a.protected + a.session_held + uncached
        if lhs != a.total:
            return [f"[token_to_kv_pool] available={a.available} + evictable={a.evictable} + protected={a.protected}"
                    f" + session_held={a.session_held} + uncached={uncached} = {lhs} != total={a.total}"]
        return []
