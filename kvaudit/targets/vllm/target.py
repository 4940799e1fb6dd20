"""The real-vLLM targets: kvaudit's programs drive vLLM's own v1 ``Scheduler`` (or ``AsyncScheduler``)
and ``KVCacheManager`` on CPU, releases 0.15.1 to 0.33.0 (the API changes between them: :mod:`.compat`).

* :class:`VllmSchedulerTarget` calls the scheduler as vLLM's engine core does (``vllm/v1/engine/core.py``:
  ``EngineCore.step``, ``step_with_batch_queue``): ``add_request``; per step ``schedule()``, a synthetic
  ``ModelRunnerOutput``, ``update_from_output()``; ``finish_requests(id, FINISHED_ABORTED)`` for an abort, one
  call per request in arrival order (given several ids, 0.33.0's ``finish_requests`` frees them in the order of
  ``set(request_ids)``, which follows ``PYTHONHASHSEED``: the free queue's order, so which blocks later steps get,
  would differ between processes); ``reset_prefix_cache()`` for a flush. Every decision (admission, chunking,
  preemption, freeing) is vLLM's.
* :class:`VllmManagerTarget` drives the ``KVCacheManager`` alone, playing the scheduler's calls in its order
  (``get_computed_blocks``, ``allocate_slots``, ``free``; preempting the newest running request). Fast.

There is no model: a sampled token is a hash of the request id and position; the vocabulary's last token is
EOS (``SamplingParams.update_from_generation_config``), sampled at the program's ``stop_at``.
"""

from __future__ import annotations

import zlib
from collections import Counter, deque
from itertools import compress, repeat
from operator import itemgetter

import numpy as np

from kvaudit.program import Abort, CloseSession, FlushCache, MemoryPressure, OpenSession, Submit, pick, resolve_submit
from kvaudit.targets.base import Target, TargetFinding
from kvaudit.targets.vllm.boot import build_manager, build_scheduler, load
from kvaudit.targets.vllm.config import VllmConfig
from kvaudit.targets.vllm.observer import POOL, VllmObserver, after_call, block_ids, status_names


class _VllmBase(VllmObserver, Target):
    """What both levels share: request intake, the synthetic sampler, the faults."""

    name = "vllm"

    def _init_common(self, config: VllmConfig, n: int = 0) -> None:
        """``n``: the tokens after each block that its prefix-cache hash covers (``get_request_block_hasher``'s
        ``num_hash_lookahead_tokens``, new in 0.33.0, as ``EngineCore.__init__`` passes it)."""
        self.V, self.hash_lookahead = load(), n
        self.config, self.steps = config, 0
        self.eos = config.vocab_size - 1
        self.hasher = self.V.get_request_block_hasher(config.hash_block_size, self.V.sha256,
                                                      **({"num_hash_lookahead_tokens": n} if n else {}))
        self.submitted: list[str] = []
        self.texts: dict[str, list[int]] = {}  # rid -> prompt + sampled tokens (extends read them)
        self.stop_at: dict[str, int | None] = {}
        self.prompt_lens: dict[str, int] = {}
        self.sessions: list[int] = []  # open streaming sessions, by number, in opening order (scheduler level)
        self._flushes = 0
        self._faults = set(config.bugs)  # each fires once
        self.reached: Counter = Counter()  # path counters (reach()); a path's preset sets its keys to 0 first
        self._init_observer()
        if self._faults:  # the configured faults (config.FAULTS); their module only where a run has some
            from kvaudit.targets.vllm import faults
            faults.inject(self.manager, self._faults)

    # -- intake --------------------------------------------------------------------------------------
    def _new_request(self, op: Submit, resumable: bool = False):
        """A vLLM ``Request`` for ``op`` (prompt at most half the context, output a quarter) under a new id."""
        req = self._resolve(op)
        rid = f"req-{len(self.submitted) + 1:06d}"
        request = self._request(rid, req.input_ids, req.max_new_tokens, op.ignore_eos,
                                self._extra_args(rid, len(req.input_ids)), resumable, op.priority)
        self.submitted.append(rid)
        self.texts[rid] = list(req.input_ids)
        self.stop_at[rid] = req.stop_at
        self.prompt_lens[rid] = len(req.input_ids)
        return request

    def _resolve(self, op: Submit):
        c = self.config
        return resolve_submit(op, c.vocab_size - 1, max(1, c.context_len // 4), max(1, c.context_len // 2),
                              self.submitted, lambda rid: self.texts[rid], self.sessions)

    def _request(self, rid: str, input_ids, max_tokens: int, ignore_eos, extra_args, resumable: bool = False,
                 priority: int | None = None):
        """``Request(rid, input_ids, ...)`` as vLLM's input processor builds it (greedy, EOS the vocabulary's
        last token; ``priority`` under the priority scheduling policy, unset: vLLM's default, 0)."""
        sp = self.V.SamplingParams(max_tokens=max_tokens, ignore_eos=bool(ignore_eos), temperature=0.0,
                                   extra_args=extra_args)
        sp.update_from_generation_config({}, self.eos)  # the keyword is model_eos_token_id before 0.17.0
        kw = {} if self.V.has("request-eos-from-sampling") else {"eos_token_id": self.eos}
        if self.config.scheduling_policy == "priority":
            kw["priority"] = priority or 0
        return self.V.Request(rid, list(input_ids), sp, None, arrival_time=float(len(self.submitted)),
                              block_hasher=self.hasher, resumable=resumable, **kw)

    def _extra_args(self, rid: str, prompt_len: int) -> dict | None:
        """``SamplingParams.extra_args`` of ``rid`` (where a client puts ``kv_transfer_params``): none here."""
        return None

    def token(self, rid: str, i: int) -> int:
        """The token of ``rid`` at output position ``i``: EOS at ``stop_at``, else a hash of (rid, i)."""
        return self.eos if self.stop_at[rid] == i + 1 else zlib.crc32(f"{rid}:{i}".encode()) % self.eos

    def sample(self, rid: str) -> int:
        """The next token of ``rid`` (:meth:`token`), appended to its text."""
        text = self.texts[rid]
        text.append(self.token(rid, len(text) - self.prompt_lens[rid]))
        return text[-1]

    def draft_ok(self, rid: str, i: int) -> bool:
        """Whether the drafter guesses ``rid``'s output position ``i`` right (about 2 in 3, by a hash)."""
        return zlib.crc32(f"{rid}:{i}:draft".encode()) % 3 != 0

    def known(self) -> dict:
        """Request id -> ``(Request, status name)`` of every request the scheduler knows (``self.requests``:
        ``Scheduler.requests`` at scheduler level)."""
        where = status_names(self.V.RequestStatus)
        return {rid: (r, where[r.status]) for rid, r in self.requests.items()}

    def deferred(self) -> list:
        """The block lists of deferred frees: none here."""
        return []

    def _abort(self, handle: int | None) -> list[str]:
        """The ids an abort of ``handle`` picks: modulo the live requests; None, all of them."""
        live = list(self.requests)
        return live if handle is None or not live else [live[handle % len(live)]]

    def _held(self, rid: str, held: np.ndarray | None = None) -> np.ndarray:
        """``[num_gpu_blocks] bool``: ``held`` (default: nothing) and the blocks of ``rid``'s tables, every group."""
        held = np.zeros(self.config.num_gpu_blocks, dtype=bool) if held is None else held.copy()
        for mgr in self.groups:
            held[block_ids(mgr.req_to_blocks.get(rid, ()))] = True
        return held

    def text(self, rid: str) -> list[int]:
        return list(self.texts.get(rid, ()))

    def flushed(self) -> int:
        return self._flushes

    def reach(self) -> dict[str, int]:
        return dict(self.reached)


class VllmSchedulerTarget(_VllmBase):
    """vLLM's ``Scheduler`` / ``AsyncScheduler`` (see the module docstring)."""

    def __init__(self, config: VllmConfig):
        self.scheduler, self.vllm_config = build_scheduler(config)
        self.manager, self.requests = self.scheduler.kv_cache_manager, self.scheduler.requests
        # (SchedulerOutput, ModelRunnerOutput, {rid: [n] int64 blocks the step writes}), oldest first
        self.batch_queue: list[tuple] = []
        self._shadow = None  # (ShadowKV, report) once install_shadow ran
        self.max_in_flight = 2 if config.async_scheduling else 1  # EngineCore's batch queue size
        if load().has("config-max-concurrent-batches"):  # before 0.23.0 the executor's (the same rule)
            self.max_in_flight = self.vllm_config.max_concurrent_batches
        # an EAGLE drafter with prefix caching and no KV connector hashes each block with the token after it
        self._init_common(config, self.vllm_config.num_hash_lookahead_tokens if load().has("hash-lookahead") else 0)
        # vLLM's own condition for holding back the blocks an in-flight step writes (0.24.0's Scheduler.__init__,
        # the fix of #45357): a KV consumer's loads into a reused block are not ordered against that step
        kv = self.vllm_config.kv_transfer_config
        self.guard_inflight = self.max_in_flight > 1 and kv is not None and kv.is_kv_consumer
        self._count_preemptions()
        self._init_sessions()
        if self._faults:
            from kvaudit.targets.vllm import faults
            faults.inject_scheduler(self.scheduler, self._faults, self.V.RequestStatus)
        if config.num_spec_tokens:
            self.reached.update(accepted_draft_tokens=0, rejected_draft_tokens=0)
        if config.mamba:
            self._count_mamba()
        if "free-under-inflight-step" in self._faults and self.V.has("deferred-frees"):
            self.scheduler.defer_block_free = False  # the fault (config.FAULTS): for the whole run
        if "free-preempted-under-inflight-step" in self._faults and self.V.has("deferred-frees"):
            from kvaudit.targets.vllm import faults
            faults.free_preempted_at_once(self.scheduler)

    def _count_preemptions(self) -> None:
        """Wrap the instance's ``Scheduler._preempt_request`` (every preemption) to count ``preemptions`` and
        ``preemptions_in_flight``, those of a request a batch still in ``batch_queue`` schedules."""
        self.reached.update(preemptions=0, preemptions_in_flight=0)
        self.inflight_preempted: list[str] = []  # this schedule()'s victims with a step in flight
        self.preempt_findings: list = []

        def count(_, request, *a, **k):
            self.reached["preemptions"] += 1
            if any(request.request_id in out.num_scheduled_tokens for out, *_ in self.batch_queue):
                self.reached["preemptions_in_flight"] += 1
                self.inflight_preempted.append(request.request_id)

        after_call(self.scheduler, "_preempt_request", count)

    def _count_mamba(self) -> None:
        """Count ``mamba_cow_hits`` (a partial hit's block copied into the hit's table) and ``mamba_tail_copies``
        (a cached prompt tail moved out) of ``take_pending_cow_copies``; ``cow_frees_deferred`` (copies parked
        behind a fence), ``mamba_boundary_offloads`` (states offered to a KV connector), by wrapping instances.
        The last two only where the scheduler can reach them (``defer_block_free``: a KV consumer with a step in
        flight; a connector: without one ``schedule()`` drops the states), so a 0 means a path not searched. With
        drafts (``num_speculative_blocks``), ``mamba_spec_relocations``: the speculative state blocks a step past
        their columns moves to the table's end (``MambaManager._relocate_speculative_block``)."""
        s, manager = self.scheduler, self.manager
        mgr = next(m for m in self.groups if isinstance(m.kv_cache_spec, self.V.MambaSpec))
        self.reached.update(mamba_cow_hits=0, mamba_tail_copies=0)
        deferring, offered = getattr(s, "defer_block_free", False), getattr(s, "connector", None) is not None
        self.reached.update(**({"cow_frees_deferred": 0} if deferring else {}),
                            **({"mamba_boundary_offloads": 0} if offered else {}))
        retain = s._free_cow_retained_blocks

        def count_copies(pairs):
            held = {b.block_id for t in mgr.req_to_blocks.values() for b in t}
            hits = sum(dst.block_id in held for _, dst in pairs)
            self.reached.update(mamba_cow_hits=hits, mamba_tail_copies=len(pairs) - hits)

        def retain_counted(blocks, fence_seq):
            n = len(s.deferred_frees)
            retain(blocks, fence_seq)
            self.reached["cow_frees_deferred"] += len(s.deferred_frees) > n

        if deferring:
            s._free_cow_retained_blocks = retain_counted
        after_call(mgr, "take_pending_cow_copies", count_copies)
        if mgr.num_speculative_blocks:  # a step past a block moves its speculative blocks to the table's end
            self.reached["mamba_spec_relocations"] = 0
            after_call(mgr, "_relocate_speculative_block", lambda *_: self.reached.update(mamba_spec_relocations=1))
        if offered:
            after_call(manager, "take_boundary_state_offloads",
                       lambda out: self.reached.update(mamba_boundary_offloads=sum(map(len, out.values()))))

    def deferred(self) -> list:
        """The block lists of ``Scheduler.deferred_frees`` (vLLM >= 0.24.0, ``compat`` "deferred-frees")."""
        return [blocks for _, blocks in self.scheduler.deferred_frees] if self.V.has("deferred-frees") else []

    def apply(self, op) -> None:
        s = self.scheduler
        if isinstance(op, Submit):
            self._submit(op)
        elif isinstance(op, Abort) and s.requests:
            for rid in self._abort(op.handle):  # NOTE: one id a call, in arrival order: see the module docstring
                s.finish_requests(rid, self.V.RequestStatus.FINISHED_ABORTED)
        elif isinstance(op, FlushCache):
            self._flushes += bool(s.reset_prefix_cache(reset_running_requests=self.config.flush_running))
        elif isinstance(op, MemoryPressure):
            _evict_cached(self.manager)
        elif isinstance(op, OpenSession) and self.config.streaming_sessions:
            self.sessions.append(len(self.session_rid))
            self.session_rid.append(None)
        elif isinstance(op, CloseSession) and self.sessions:
            rid = self.session_rid[self.sessions.pop(op.handle % len(self.sessions))]
            if self._live_session(rid):  # AsyncLLM's end of the input stream: a final, non-resumable request
                s.add_request(self._request(rid, [0], 1, 0, None))
        # health checks, pauses: no scheduler path in vLLM (ignored)

    # -- streaming-input sessions (vLLM #28973; AsyncLLM._add_streaming_input_request) --------------------
    def _init_sessions(self) -> None:
        """``session_rid[n]``: session ``n``'s request id (None before its first chunk); ``turns[rid]``: the
        ``stop_at`` of its chunks not taken in yet. Wraps ``Scheduler._update_request_as_session``: :meth:`_on_turn`."""
        self.session_rid: list[str | None] = []
        self.turns: dict[str, deque] = {}
        if not self.config.streaming_sessions:
            return
        self.reached["session_turns"] = 0
        after_call(self.scheduler, "_update_request_as_session", lambda _, session, *a, **k: self._on_turn(session))

    def _submit(self, op: Submit) -> None:
        """A plain request, or a session's input chunk: its first (a resumable ``Request`` under a new id), or a
        next one (a resumable ``Request`` under the session's id, as AsyncLLM sends each ``StreamingInput``),
        dropped once vLLM has finished the session (AsyncLLM's input loop stops then)."""
        n = pick(op.session, self.sessions)
        if n is None or self.session_rid[n] is None:
            request = self._new_request(op, resumable=n is not None)
            if n is not None:
                self.session_rid[n], self.turns[request.request_id] = request.request_id, deque()
            self.scheduler.add_request(request)
            return
        rid = self.session_rid[n]
        if self._live_session(rid):
            req = self._resolve(op)
            self.turns[rid].append(req.stop_at)
            self.scheduler.add_request(self._request(rid, req.input_ids, req.max_new_tokens, op.ignore_eos, None,
                                                     resumable=True))

    def _live_session(self, rid: str | None) -> bool:
        request = self.scheduler.requests.get(rid)
        return request is not None and not request.is_finished()

    def _on_turn(self, session) -> None:
        """vLLM took ``session``'s next chunk in: the driver's text, prompt length and ``stop_at`` follow."""
        rid = session.request_id
        self.texts[rid], self.prompt_lens[rid] = list(session.all_token_ids), session.num_prompt_tokens
        self.stop_at[rid] = self.turns[rid].popleft()
        self.reached["session_turns"] += 1

    def stalled(self) -> bool:
        """Nothing runs or is in flight, and a session waits for its client's next chunk holding KV (vLLM waits
        too: it preempts no waiting request; vLLM #53321, open, would time such a session out)."""
        s, W = self.scheduler, self.V.RequestStatus.WAITING_FOR_STREAMING_REQ
        return not (s.running or self.batch_queue) and any(r.status == W for r in s.requests.values())

    def step(self) -> None:
        """One engine-core iteration: schedule a batch and queue it; process the oldest batch once the queue is
        full (``max_in_flight``) or nothing new was scheduled. With no request left (``has_requests``), only a
        batch still in flight is processed."""
        s = self.scheduler
        if not s.has_requests():
            if self.batch_queue:
                s.update_from_output(*self.batch_queue.pop(0)[:2])
            self.steps += 1
            return
        out = s.schedule()
        if self._unsettled:  # (audited: the blocks this schedule() took, where their requests sit now)
            self._settle_tables()
        if self.inflight_preempted and not self.preempt_findings:  # checked before that batch is processed
            self.preempt_findings = self._inflight_findings()
        self.inflight_preempted.clear()
        self._on_schedule(out)
        if out.total_num_scheduled_tokens > 0:
            self.batch_queue.append((out, self._model_output(out), self._written_blocks(out)))
        elif not self.batch_queue:
            s.update_from_output(out, self._empty_output())
        if self.batch_queue and (len(self.batch_queue) >= self.max_in_flight or out.total_num_scheduled_tokens == 0):
            done, result, _ = self.batch_queue.pop(0)
            drafted = [s.requests[r] for r in done.num_scheduled_tokens] if self._shadow and self._drafts else ()
            s.update_from_output(done, result)
            self._tag_drafts(drafted)
            self._post_step(done)
        self.steps += 1

    def _post_step(self, out) -> None:
        """``EngineCore.post_step`` after a synchronous step that ran the model: ``num_spec_tokens`` drafts for
        each request of ``out`` (right where :meth:`draft_ok`) to ``Scheduler.update_draft_token_ids``. With
        async scheduling the worker keeps its drafts (the AsyncScheduler schedules ``-1`` placeholders)."""
        k = self.config.num_spec_tokens
        if not k or self.max_in_flight > 1 or not out.total_num_scheduled_tokens:
            return
        ids, drafts = list(out.num_scheduled_tokens), []
        for rid in ids:
            n = len(self.texts[rid]) - self.prompt_lens[rid]
            guess = [self.token(rid, n + j) for j in range(k)]
            drafts.append([t if self.draft_ok(rid, n + j) else (t + 1) % self.eos for j, t in enumerate(guess)])
        self.scheduler.update_draft_token_ids(self.V.DraftTokenIds(ids, drafts))

    def _written_blocks(self, out) -> dict:
        """Per request of the step ``out`` (``num_computed_tokens`` already past it): ``(written, read)``, ``[n]
        int64`` block ids of the positions it computes and of those its attention reads before (:func:`_first`;
        a Mamba group: the block of the state it starts from)."""
        bs, reqs = self.config.block_size, self.scheduler.requests
        touched = {}
        for rid, n in out.num_scheduled_tokens.items():
            end = reqs[rid].num_computed_tokens
            start = max(end - n, 0)
            lo, hi = start // bs, (max(end, 1) - 1) // bs + 1
            written, read = [], []
            for mgr in self.groups:
                table = mgr.req_to_blocks.get(rid, ())
                mamba = isinstance(mgr.kv_cache_spec, self.V.MambaSpec)
                first = max(start - 1, 0) // bs if mamba else _first(start, getattr(mgr, "sliding_window", None)) // bs
                written += block_ids(table[lo:hi])
                read += block_ids(table[first:lo])
            if written or read:
                touched[rid] = (np.array(written, dtype=np.int64), np.array(read, dtype=np.int64))
        return touched

    # -- KV content (shadow tags) ----------------------------------------------------------------------
    def kv_pools(self) -> dict[str, int]:
        """The stale-KV shadow's one pool: the ``BlockPool`` in token slots, slot ``block_id * block_size +
        offset`` (every KV-cache group's blocks come from that one pool)."""
        return {POOL: self.config.num_gpu_blocks * self.config.block_size}

    def install_shadow(self, shadow, wrap, report) -> None:
        """Tag and check attention groups' KV in ``shadow`` (:class:`kvaudit.audit.shadow.ShadowKV`) per step
        (:meth:`_shadow_step`, after ``Scheduler._update_after_schedule``) and per KV load (:meth:`_shadow_load`);
        a stale read calls ``report(pool, slots, message)``. Not with drafts under async scheduling (the worker's
        shift of positions by rejected drafts is not modelled): there ``stale_reads_checked`` is not counted (a
        check that is off, not a path no program took)."""
        if self.config.num_spec_tokens and self.max_in_flight > 1:
            return
        self.reached["stale_reads_checked"] = 0
        self._shadow = (shadow, report)
        self._cow = self.V.has("pending-cow")
        self._lane = np.arange(self.config.block_size, dtype=np.int64)  # a block's slot offsets
        # [num_gpu_blocks, block_size] int64: each block's token slots, a row a block
        self._block_slots = np.arange(self.config.num_gpu_blocks * self.config.block_size,
                                      dtype=np.int64).reshape(-1, self.config.block_size)
        self._drafts: dict = {}  # (rid, group) -> ([n] positions, [n] slots) written before their tokens were known
        # where schedule() advances num_computed_tokens (after_call's hook, without its lambda: once a step)
        update, shadow_step = self.scheduler._update_after_schedule, self._shadow_step

        def update_after_schedule(out, *a, **k):
            result = update(out, *a, **k)
            shadow_step(out)
            return result

        wrap(self.scheduler, "_update_after_schedule", update_after_schedule)
        attention = {"SlidingWindowManager", "FullAttentionManager"}  # _attention: (group, window in tokens or None)
        self._attention = [(g, getattr(mgr, "sliding_window", None)) for g, mgr in enumerate(self.groups)
                           if attention & {c.__name__ for c in type(mgr).__mro__}]

    def _tags(self, request) -> np.ndarray:
        """``[n] int64`` tags of ``request``'s known tokens, async placeholders too (``ShadowKV.request_tags``)."""
        text = self.texts[request.request_id]
        return self._shadow[0].request_tags(request, request.prompt_token_ids, request.output_token_ids,
                                            text[request.num_tokens:])

    def _table(self, g: int, rid: str) -> np.ndarray:
        """``[n + 1] int64``: the block ids of ``rid``'s table in group ``g``, then the null block's id (0),
        which positions past the table read."""
        return np.array([b.block_id for b in self.groups[g].req_to_blocks.get(rid, ())] + [0], dtype=np.int64)

    def _slots(self, table: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """``[n] int64`` token slots of positions ``pos`` in ``table`` (:meth:`_table`)."""
        bs = self.config.block_size
        return table[np.minimum(pos // bs, table.size - 1)] * bs + pos % bs

    def _shadow_step(self, out) -> None:
        """The KV of the step ``out`` as a forward moves it: its copy-on-writes first, then every request's
        positions ``[start, end)`` written with its tags, then each one's reads (:func:`_first` to ``start``)
        checked: a slot never written, or written for another prefix, is stale KV (``report``). Draft positions
        past the known tokens are tagged once known (:meth:`_tag_drafts`, or the request's next step). The
        slots of a request's reads and writes are one span: the blocks it covers expanded to their slots by one
        ``take`` of the pool's slot rows (``[num_gpu_blocks, block_size]``; positions past the table read the
        null block's, :meth:`_slots`). Every read of the step is compared at once, and only a step that reads a
        wrong tag looks at each request's reads apart."""
        shadow = self._shadow[0]
        bs, reqs, tags_of = self.config.block_size, self.scheduler.requests, shadow.tags[POOL]
        rows, groups = self._block_slots, self.groups
        copies = out.kv_cache_block_copies if self._cow else None
        if copies:  # the worker copies each copy-on-write block before the forward (copy_kv_cache_blocks_inplace)
            src, dst = (np.array(copies, dtype=np.int64)[:, :, None] * bs + self._lane).transpose(1, 0, 2)
            tags_of[dst.ravel()] = tags_of[src.ravel()]
        null = tags_of[:bs].copy()  # NOTE: every write goes in whole, then the null block's tags are put back:
        spans = []  # the same as leaving its slots out of each write, in one call a step instead of two a write
        for rid, n in out.num_scheduled_tokens.items():
            request = reqs[rid]
            tags = self._tags(request)
            done = request.num_computed_tokens
            end, start = min(done, tags.size), max(done - n, 0)
            for g, window in self._attention:
                if self._drafts and (rid, g) in self._drafts:
                    pos, slots = self._drafts.pop((rid, g))
                    keep = (self._slots(self._table(g, rid), pos) == slots) & (pos < tags.size)
                    tags_of[slots[keep]] = tags[pos[keep]]
                first = _first(start, window)
                blocks = groups[g].req_to_blocks.get(rid, ())  # reads [first, start), then writes [start, done)
                if done > len(blocks) * bs:  # (positions past the table: the null block's, clamped)
                    slots = self._slots(self._table(g, rid), np.arange(first, done))
                else:
                    lo = first % bs
                    slots = rows.take([b.block_id for b in blocks[first // bs:(done + bs - 1) // bs]],
                                      axis=0).ravel()[lo:lo + done - first]
                written = slots[start - first:]
                if end < done:  # (speculative drafts: tagged once known)
                    pos = np.arange(start, done)
                    keep = written >= bs  # (not the null block's: a draft's slot is tagged later)
                    late, keep = keep & (pos >= end), keep & (pos < end)
                    self._drafts[(rid, g)] = (pos[late], written[late])
                    tags_of[written[keep]] = tags[pos[keep]]
                else:
                    tags_of[written] = tags[start:done]
                read = min(start, end)
                spans.append((rid, g, first, read, slots[:max(read - first, 0)], tags))
        tags_of[:bs] = null
        self._check_reads(spans, tags_of)

    def _check_reads(self, spans: list, tags_of: np.ndarray) -> None:
        """Each span ``(rid, group, first, start, [start - first] slots, tags)`` of a step reads the tags
        ``tags[first:start]`` from ``slots``; a slot holding another tag is reported (``ShadowKV.read``), in
        the spans' order. One comparison of all spans first: a step without a stale read ends there."""
        shadow, report = self._shadow
        if not spans:
            return
        slots = np.concatenate([s[4] for s in spans]) if len(spans) > 1 else spans[0][4]
        self.reached["stale_reads_checked"] += slots.size
        want = b"".join([tags[first:start].tobytes() for _, _, first, start, _, tags in spans])
        if tags_of.take(slots).tobytes() == want:
            return
        bs = self.config.block_size
        for rid, g, first, start, slots, tags in spans:
            if tags_of.take(slots).tobytes() != tags[first:start].tobytes():
                bad, what = shadow.read(POOL, slots, tags[first:start])
                pos = np.arange(first, start)
                ids = np.unique(slots[bad] // bs)  # every block the finding lists, as its headline counts them
                blocks = ", ".join(map(str, ids[:8])) + (f", ... ({ids.size} in all)" if ids.size > 8 else "")
                report(POOL, slots[bad], f"req:{rid} read KV of {bad.size} position(s) from {pos[bad[0]]} to "
                                         f"{pos[bad[-1]]} (group {g}, block(s) {blocks}) from slots {what}")

    def _tag_drafts(self, requests) -> None:
        """Tag the draft positions :meth:`_shadow_step` left of ``requests`` (the step just processed) that were
        accepted (below the rolled-back ``num_computed_tokens``): vLLM caches their blocks now (``cache_blocks``
        in ``update_from_output``), before any next step of theirs."""
        for request in requests:
            for g, _ in self._attention:
                pos, slots = self._drafts.pop((request.request_id, g), (np.zeros(0, dtype=np.int64),) * 2)
                tags = self._tags(request)  # computed with the accepted tokens: below the rolled-back count
                keep = pos < min(tags.size, request.num_computed_tokens)
                self._shadow[0].tags[POOL][slots[keep]] = tags[pos[keep]]

    def _shadow_load(self, rid: str, blocks: np.ndarray) -> None:
        """A KV connector's load into ``blocks`` (``[n] int64``) of ``rid`` completed: they hold ``rid``'s own
        prefix's KV (positions past its known tokens left alone; an unknown ``rid``, freed, skipped)."""
        request = self.scheduler.requests.get(rid)
        if self._shadow is None or request is None or not blocks.size:
            return
        bs, tags, tags_of = self.config.block_size, self._tags(request), self._shadow[0].tags[POOL]
        for g, _ in self._attention:
            table = self._table(g, rid)[:-1]
            idx = np.flatnonzero(np.isin(table, blocks))
            pos = (idx[:, None] * bs + np.arange(bs)).ravel()
            pos = pos[pos < tags.size]
            tags_of[self._slots(table, pos)] = tags[pos]

    def invariant_findings(self) -> list:
        """The observer's, :meth:`_inflight_findings` (also as of a preempting ``schedule()``), :meth:`copy_findings`
        of the steps in flight's copies, :meth:`_dead_table_findings`."""
        copies = [c for out, _, _ in self.batch_queue for c in out.kv_cache_block_copies or ()] \
            if self.guard_inflight and self.V.has("pending-cow") else []
        return (super().invariant_findings() + self.preempt_findings[:1] + self._inflight_findings()
                + self.copy_findings(copies) + self._dead_table_findings())

    def _dead_table_findings(self) -> list:
        """Once idle, no dict attribute of the Scheduler is keyed by a request id it no longer knows (vLLM drops
        a request's state in ``Scheduler._free_request`` / ``_free_blocks``; not so 0.22.0-0.30.0's
        ``_re_block_ids``, vLLM #49684). Sets are left out: ``finished_req_ids`` and the like hold ids a step."""
        if not self.is_idle():
            return []
        known, texts = self.scheduler.requests, self.texts.keys()  # (texts' keys: request ids, all str)
        # only the dicts holding a request id the Scheduler no longer knows (found by set operations in C; the
        # dict attributes picked in C too: most of the Scheduler's attributes are not dicts)
        attrs = vars(self.scheduler)
        tables = [(name, table) for name in compress(attrs, map(isinstance, attrs.values(), repeat(dict)))
                  if (table := attrs[name]) and not (texts & table.keys()) <= known.keys()]
        for name, table in sorted(tables, key=itemgetter(0)):  # (the attributes' names: the first one said)
            dead = [k for k in table if isinstance(k, str) and k in self.texts and k not in known]
            if dead:
                return [TargetFinding("leak", POOL, np.array([1], dtype=np.int64),
                                      f"Scheduler.{name} still holds {len(dead)} entry(ies) of request(s) it "
                                      f"no longer knows (first req:{dead[0]}) once idle",
                                      check=f"dead-table:{name}")]
        return []

    def _inflight_findings(self) -> list:
        """Under ``guard_inflight``, every block a step in flight writes (vLLM #45357, fixed in 0.24.0; check
        ``inflight-write``, first) or reads (#47282, fixed in 0.26.0; ``inflight-read``) is in that request's
        tables or ``deferred_frees``: freed, a KV consumer's load can overwrite it under the step."""
        if not self.guard_inflight or not self.batch_queue:
            return []
        parked = np.zeros(self.config.num_gpu_blocks, dtype=bool)
        parked[[b for blocks in self.deferred() for b in block_ids(blocks)]] = True
        for which, check in ((0, "inflight-write"), (1, "inflight-read")):
            for rid, sets in ((r, t) for _, _, touched in self.batch_queue for r, t in touched.items()):
                lost = sets[which][~self._held(rid, parked)[sets[which]]]
                if lost.size:
                    b = int(lost[0])
                    owners = [o for o, _, units in self._holders(self.known())[0] if (units == b).any()]
                    now = f"now held by {', '.join(owners)}" if owners else f"ref_cnt={self._ref_counts()[b]}"
                    verb = check.removeprefix("inflight-")
                    return [TargetFinding("use-after-free", POOL, lost, f"block {b} was freed while a step in flight "
                                          f"still {verb}s it for req:{rid} ({now})", check=check,
                                          free_sites=self.free_sites(b),
                                          used_by=(f"a step in flight that {verb}s it for req:{rid}",))]
        return []

    def _on_schedule(self, out) -> None:
        """What the workers do with a new ``SchedulerOutput`` besides running it: nothing here."""

    def _kv_output(self):
        """The ``KVConnectorOutput`` a model output carries: none without a KV connector."""
        return None

    def _empty_output(self):
        return self.V.ModelRunnerOutput(req_ids=[], req_id_to_index={}, kv_connector_output=self._kv_output())

    def _model_output(self, out):
        """Each scheduled request's tokens: none mid-prefill, else :meth:`_verify` of its scheduled drafts."""
        ids = list(out.num_scheduled_tokens)
        reqs, spec = self.scheduler.requests, out.scheduled_spec_decode_tokens
        toks = [[] if self._is_prefill_chunk(reqs[r]) else self._verify(r, len(spec.get(r, ()))) for r in ids]
        output = self.V.ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                          sampled_token_ids=toks, kv_connector_output=self._kv_output())
        if self.config.return_routed_experts:
            output.routed_experts = self._routed_experts(out, ids)
        return output

    def _verify(self, rid: str, k: int) -> list[int]:
        """The rejection sampler over ``k`` drafts of ``rid``: ``1 + accepted`` tokens of :meth:`sample` (drafts up
        to the first :meth:`draft_ok` rejects, then a correction or the bonus), past a stop too; counted."""
        n = len(self.texts[rid]) - self.prompt_lens[rid]
        accepted = next((j for j in range(k) if not self.draft_ok(rid, n + j)), k)
        if k:
            self.reached["accepted_draft_tokens"] += accepted
            self.reached["rejected_draft_tokens"] += k - accepted
        return [self.sample(rid) for _ in range(1 + accepted)]

    def _routed_experts(self, out, ids):
        """The step's ``RoutedExpertsLists`` (what the model runner D2Hs): per scheduled token, in ``ids``
        order, its KV slot (:meth:`_slots`, the full-attention table) and a routing row ``[1 layer, 2 experts
        per token]`` (expert ids from the slot)."""
        from vllm.v1.outputs import RoutedExpertsLists
        reqs, slots = self.scheduler.requests, []
        for rid in ids:
            end = reqs[rid].num_computed_tokens
            slots.append(self._slots(self._table(0, rid), np.arange(end - out.num_scheduled_tokens[rid], end)))
        slot_mapping = np.concatenate(slots) if slots else np.zeros(0, dtype=np.int64)
        routing = np.stack([slot_mapping % 4, (slot_mapping + 1) % 4], axis=1)[:, None, :].astype(np.int32)
        return RoutedExpertsLists(routing_data=routing, slot_mapping=slot_mapping)

    def _is_prefill_chunk(self, request) -> bool:
        """Whether the step just scheduled leaves ``request`` mid-prefill: ``Request.is_prefill_chunk`` (compat)."""
        return request.is_prefill_chunk if self.V.has("is-prefill-chunk") else \
            request.num_computed_tokens < request.num_tokens

    def is_idle(self) -> bool:
        """The engine core's test (``has_requests()``, no batch in flight), and no unfinished request it no longer
        counts (not a waiting session): never scheduled again, a hang (vLLM #52693 on 0.27.0 to 0.30.0). The
        three reads are pure, so asked cheapest-to-refute first: a busy engine's first request is unfinished
        (no call into the Scheduler's counts), an idle one's table is empty."""
        s, W = self.scheduler, self.V.RequestStatus.WAITING_FOR_STREAMING_REQ
        return not self.batch_queue and not any(
            not r.is_finished() and r.status != W for r in s.requests.values()) and not s.has_requests()

    def progress(self) -> dict[str, int]:
        return {r.request_id: r.num_computed_tokens + r.num_output_tokens + 1000 * r.num_preemptions
                for r in self.scheduler.running}

    def stuck(self) -> str:
        """``running:decode`` (or a batch in flight), ``waiting:<status>`` (of the waiting head, or of an unfinished
        request in no queue, e.g. 0.33.0's ``kv_holding_waiting``), ``finished:held``; ``""`` when nothing is busy."""
        s = self.scheduler
        if s.running or self.batch_queue:
            return "running:decode"
        for r in [*s.waiting, *(r for r in s.requests.values() if not r.is_finished())]:
            return "waiting:" + r.status.name.lower().replace("_", "-")
        return "finished:held" if s.has_requests() else ""

    def describe_busy(self) -> str:
        """``waiting`` counts every unfinished request not running, whichever queue holds it (``waiting``, or
        0.33.0's ``kv_holding_waiting``, where a request waiting for remote KV sits); ``finished_held`` the
        finished ones the scheduler still holds (a KV send in flight)."""
        s = self.scheduler
        running = {r.request_id for r in s.running}
        rest = [r.is_finished() for rid, r in s.requests.items() if rid not in running]
        return (f"waiting={rest.count(False)} running={len(s.running)} in_flight={len(self.batch_queue)} "
                f"free_blocks={self.manager.block_pool.get_num_free_blocks()}"
                + (f" finished_held={rest.count(True)}" if True in rest else ""))


class VllmManagerTarget(_VllmBase):
    """vLLM's ``KVCacheManager`` alone (see the module docstring). Engine frames are this driver's."""

    def __init__(self, config: VllmConfig):
        self.manager = build_manager(config)
        self.requests: dict = {}  # rid -> Request, in arrival order
        self.waiting: list = []
        self.running: list = []
        self._init_common(config)
        self.reached["preemptions"] = 0

    def engine_files(self) -> list[str]:
        return [__file__]

    def apply(self, op) -> None:
        S = self.V.RequestStatus
        if isinstance(op, Submit):
            request = self._new_request(op)
            self.requests[request.request_id] = request
            self.waiting.append(request)
        elif isinstance(op, Abort) and self.requests:
            for rid in self._abort(op.handle):
                self._finish(self.requests[rid], S.FINISHED_ABORTED)
        elif isinstance(op, FlushCache):
            self._flushes += bool(self.manager.reset_prefix_cache())
        elif isinstance(op, MemoryPressure):
            _evict_cached(self.manager)

    def _finish(self, request, status) -> None:
        """``Scheduler.finish_requests`` / ``_free_request``: out of the queues, status set, blocks freed. First,
        where each request that took blocks sits (the observer's place record, which the Scheduler's level takes
        after each ``schedule()``; this level has none: a request admitted and finished in one ``step()`` sat in
        ``running``, as a check would have seen it)."""
        if self.block_tables is not None:  # (audited)
            self._settle_tables()
        for queue in (self.running, self.waiting):
            if request in queue:
                queue.remove(request)
        request.status = status
        self.manager.free(request)
        del self.requests[request.request_id]

    def _preempt(self, request) -> None:
        """``Scheduler._preempt_request``: blocks freed, recomputed from scratch later, first in line. The places
        first, as :meth:`_finish` records them."""
        if self.block_tables is not None:  # (audited)
            self._settle_tables()
        self.running.remove(request)
        self.manager.free(request)
        request.status = self.V.RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.reached["preemptions"] += 1
        self.waiting.insert(0, request)

    def step(self) -> None:
        """Decode every running request (preempting the newest for a block), then admit FCFS while room allows."""
        S, m, c = self.V.RequestStatus, self.manager, self.config
        budget = c.max_num_batched_tokens
        for request in list(self.running):
            if request not in self.running:
                continue  # preempted to make room for an older one
            while m.allocate_slots(request, 1) is None:
                victim = self.running[-1]
                self._preempt(victim)
                if victim is request:
                    break
            if request not in self.running:
                continue
            request.num_computed_tokens += 1
            budget -= 1
            self._append(request, S)
        while self.waiting and len(self.running) < c.max_num_seqs and budget > 0:
            request = self.waiting[0]
            blocks, hits = m.get_computed_blocks(request)[:2]  # a third value from vLLM 0.26.0 (compat)
            need = request.num_tokens - hits
            if need > budget and self.running:
                break
            if m.allocate_slots(request, need, hits, blocks) is None:
                break  # FCFS: the head waits (a failed allocate may leave an empty table: still known)
            self.waiting.pop(0)
            request.status = S.RUNNING
            request.num_computed_tokens = request.num_tokens
            budget -= need
            self.running.append(request)
            self._append(request, S)
        self.take_events()
        self.steps += 1

    def _append(self, request, S) -> None:
        """Sample one token; finish the request at EOS, ``max_tokens`` or ``max_model_len`` (``check_stop``)."""
        tok = self.sample(request.request_id)
        request.append_output_token_ids(tok)
        if tok == self.eos:  # the EOS the request was built with (on SamplingParams from vLLM 0.17.0)
            self._finish(request, S.FINISHED_STOPPED)
        elif request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.config.max_model_len:
            self._finish(request, S.FINISHED_LENGTH_CAPPED)

    def take_events(self) -> None:
        self.manager.take_events()  # teed into the event shadow (observer)

    def is_idle(self) -> bool:
        return not self.requests

    def progress(self) -> dict[str, int]:
        return {r.request_id: r.num_computed_tokens + 1000 * r.num_preemptions for r in self.running}

    def stuck(self) -> str:
        """``running:decode`` or ``waiting:memory``; ``""`` when nothing is busy."""
        return "running:decode" if self.running else "waiting:memory" if self.waiting else ""

    def describe_busy(self) -> str:
        return (f"waiting={len(self.waiting)} running={len(self.running)} "
                f"free_blocks={self.manager.block_pool.get_num_free_blocks()}")


def _first(start: int, window: int | None) -> int:
    """The first position a step from ``start`` reads: 0 (full attention), ``start - window + 1`` (a window)."""
    return 0 if window is None else max(start - window + 1, 0)


def _evict_cached(manager) -> None:
    """``KVCacheManager.evict_blocks`` of every cached block not in use: the prefix cache's contents
    dropped, as when a KV connector reports them invalid (``Scheduler._handle_invalid_blocks``)."""
    pool = manager.block_pool
    ids = {b.block_id for b in pool.blocks if b.ref_cnt == 0 and b.block_hash is not None and not b.is_null}
    if ids:
        manager.evict_blocks(ids)
