"""The target for ``engine_under_test``: the driving half (the program's ops as SGLang's tokenizer
would send them, and liveness inputs) over :class:`kvaudit.targets.eut.observer.EutObserver`."""

from __future__ import annotations

import os
import sys

import numpy as np
import torch

from engine_under_test import EngineConfig, FinishReason, Scheduler
from kvaudit.program import (PAUSE_MODES, Abort, CloseSession, ContinueGeneration, FlushCache, HealthCheck,
                             MemoryPressure, Op, OpenSession, PauseGeneration, Submit, TransferFail)
from kvaudit.audit.hooks import pass_through
from kvaudit.program.schema import pick, resolve_submit
from kvaudit.targets.base import ABORT_IGNORED, LOST, PoolSpec, kv_length_problems
from kvaudit.targets.eut.observer import EutObserver

_ENGINE_DIR = os.path.dirname(sys.modules[Scheduler.__module__].__file__) + os.sep  # engine_under_test/


class SessionRecords:
    """kvaudit's own ledger of streaming-session KV records (the engine has no allocator for them):
    one unit per ``SessionSlot``, taken when a session adopts a turn's record and given back when
    the slot is released or destroyed. A unit whose session is gone is a leaked record."""

    CAPACITY = 4096

    def __init__(self):
        self.free_units = list(range(1, self.CAPACITY + 1))
        self.unit_of: dict[int, int] = {}  # id(slot) -> unit
        self._slots: dict[int, object] = {}  # id(slot) -> slot, keeps ids unique while tracked

    def available_size(self) -> int:
        return len(self.free_units)

    def alloc(self, n: int) -> list[int] | None:
        if n > len(self.free_units):
            return None
        out, self.free_units = self.free_units[:n], self.free_units[n:]
        return out

    def free(self, rows) -> None:
        self.free_units.extend([rows] if isinstance(rows, int) else rows)

    def _bind(self, slot) -> None:
        got = self.alloc(1)
        if got:
            self.unit_of[id(slot)], self._slots[id(slot)] = got[0], slot

    def _unbind(self, slot) -> None:
        unit = self.unit_of.pop(id(slot), None)
        self._slots.pop(id(slot), None)
        if unit is not None:
            self.free(unit)

    def track(self, sc) -> None:
        """Wrap ``sc`` (the engine's ``SessionController``) so slot creation and release go through here."""
        take, claim, release, clear = sc.take, sc.claim_kv_row, sc.release_session, sc.clear_slots

        def take_wrapper(req):
            s = req.session
            before = None if s is None else s.slot
            take(req)
            if s is not None and s.slot is not None and s.slot is not before:
                self._bind(s.slot)

        def claim_wrapper(req):
            s = req.session
            slot = None if s is None else s.slot
            claimed = claim(req)
            if slot is not None and s.slot is None:  # an aborted turn destroyed the slot
                self._unbind(slot)
            return claimed

        def release_wrapper(s, *a, **k):
            slot = s.slot
            release(s, *a, **k)
            if slot is not None:
                self._unbind(slot)

        def clear_wrapper():
            slots = [s.slot for s in sc.sessions.values() if s.slot is not None]
            clear()
            for slot in slots:
                self._unbind(slot)

        sc.take, sc.claim_kv_row, sc.release_session, sc.clear_slots = (
            take_wrapper, claim_wrapper, release_wrapper, clear_wrapper)


class EutTarget(EutObserver):
    """``engine_under_test`` behind the program model; the target also plays SGLang's tokenizer.

    ``Submit.priority`` is passed on; the engine honours it only with ``enable_priority_scheduling``
    (off by default, as in SGLang). ``PauseGeneration`` follows ``TokenizerManager.pause_generation``:
    every mode holds new submits and health checks here, at the tokenizer, until ``ContinueGeneration``
    sends them in order; ``abort`` aborts every request and leaves the scheduler running,
    ``in_place`` and ``retract`` pause the scheduler (``Scheduler.pause_generation``).
    """

    name = "eut"
    #: an audited run's (:meth:`install_pool`): per abort message the engine took, the outputs it had emitted by then
    abort_taken: list[int] = ()
    abort_ignored: frozenset[str] = frozenset()  # the rids an abort hit while unanswered, answered otherwise

    def __init__(self, config: EngineConfig):
        self.config = config
        self.engine = Scheduler(config)
        self.steps = 0
        self.submitted: list[str] = []  # rids in submission order (handles index the live ones)
        self.prompts: dict[str, list[int]] = {}
        self.aborted: set[str] = set()  # rids an abort was sent for
        self.sessions: list[str] = []  # open session ids, in opening order
        self.held: list[dict | None] = []  # paused: add_request arguments (None: a health check), in order
        self._holding = False  # the tokenizer's is_pause
        self._scheduler_paused = False  # a pause_generation(in_place | retract) was sent, no continue yet
        self._live: dict[str, None] = {}  # the submitted rids no output answered yet, in submission order
        self._seen_outputs = 0
        self.abort_named: list[list[str]] = []  # per abort message sent, the live rids it names (in order)
        self._session_turns = self._failed_transfers = 0  # reach()'s counts
        s = self.engine
        self._pools = [
            PoolSpec("token_to_kv_pool", s.token_to_kv_pool_allocator, "kv", config.page_size,
                     s.token_to_kv_pool_allocator.num_pages),
            PoolSpec("req_to_token_pool", s.req_to_token_pool, "rows", 1,
                     s.req_to_token_pool.size + s.req_to_token_pool.pre_alloc_size),
        ]
        if s.hicache_host_pool is not None:
            hp = s.hicache_host_pool
            self._pools.append(PoolSpec("hicache_host", hp, "kv", config.page_size, hp.num_pages))
        self.session_records: SessionRecords | None = None
        if s.session_controller is not None:
            self.session_records = SessionRecords()
            self._pools.append(PoolSpec("session_records", self.session_records, "rows", 1,
                                        SessionRecords.CAPACITY))
            self.session_records.track(s.session_controller)
        self._load_back_names: dict[int, tuple[object, str]] = {}  # id(LoadBack) -> (record, holder name)
        self.last_retraction: str | None = None
        self._track_retraction()
        self._paths = self._count_paths()  # reach()'s counts of the engine's own paths
        hs = s.hisparse_coordinator
        if hs is not None:
            self._pools += [
                PoolSpec("hisparse_device", hs.hisparse_attn_allocator, "kv", config.page_size,
                         hs.hisparse_attn_allocator.num_pages),
                PoolSpec("hisparse_host", hs.host_pool, "kv", config.page_size, hs.host_pool.num_pages),
            ]

    # -- driving ----------------------------------------------------------------------------
    def pools(self) -> list[PoolSpec]:
        return self._pools

    def live_rids(self) -> list[str]:
        outs, live = self.engine.finished_outputs, self._live
        for o in outs[self._seen_outputs:]:
            live.pop(o.rid, None)
        self._seen_outputs = len(outs)
        return list(live)

    @property
    def paused(self) -> bool:
        """The tokenizer holds new requests (any pause mode, until ``ContinueGeneration``)."""
        return self._holding

    def apply(self, op: Op) -> None:
        cfg, eng = self.config, self.engine
        if isinstance(op, Submit):
            req = resolve_submit(op, cfg.vocab_size, cfg.context_len // 2, lambda max_new: cfg.context_len - max_new,
                                 self.submitted, self._text, self.sessions)
            stop = None if req.stop_at is None else max(1, req.stop_at)
            args = {"input_ids": req.input_ids, "max_new_tokens": req.max_new_tokens, "stop_at": stop,
                    "session_id": req.session, "ignore_eos": bool(op.ignore_eos), "priority": op.priority}
            if self._holding:  # the client sent it now: its prompt and session are resolved now
                self.held.append(args)
            else:
                self._submit(args)
        elif isinstance(op, HealthCheck) and self._holding:
            self.held.append(None)
        elif isinstance(op, PauseGeneration):
            mode = PAUSE_MODES[op.mode]
            self._holding = True
            if mode == "abort":  # the tokenizer aborts everything; the scheduler keeps running
                live = self.live_rids()
                self.aborted.update(live)
                self.abort_named.append(live)
                eng.abort_request(abort_all=True)
            else:
                eng.pause_generation(mode)
                self._scheduler_paused = True
        elif isinstance(op, ContinueGeneration):
            if self._holding:
                eng.continue_generation()
                self._holding = self._scheduler_paused = False
                held, self.held = self.held, []
                for args in held:
                    if args is None:
                        eng.health_check()
                    else:
                        self._submit(args)
        elif isinstance(op, OpenSession):
            if cfg.enable_streaming_session:
                self.sessions.append(eng.open_session())
        elif isinstance(op, CloseSession):
            if self.sessions:
                eng.close_session(self.sessions.pop(op.handle % len(self.sessions)))
        elif isinstance(op, MemoryPressure):
            eng.memory_pressure()
        elif isinstance(op, HealthCheck):
            eng.health_check()
        elif isinstance(op, FlushCache):
            eng.request_flush_cache()
        elif isinstance(op, TransferFail):
            if cfg.is_pd_decode:
                pending = self._pre_join_rids()
                rids = pending if op.handle is None else [pick(op.handle, pending)] if pending else []
                for rid in rids:
                    eng.report_transfer_failure(rid)
                    self.aborted.add(rid)
                    self._failed_transfers += 1
        elif isinstance(op, Abort):
            live = self.live_rids()
            if op.handle is None:
                eng.abort_request(abort_all=True)
                self.aborted.update(live)
                self.abort_named.append(live)
            elif live:
                rid = pick(op.handle, live)
                eng.abort_request(rid)
                self.aborted.add(rid)
                self.abort_named.append([rid])
        else:
            raise TypeError(f"op {op!r} does not go through apply()")

    def _pre_join_rids(self) -> list[str]:
        """PD decode: live submitted rids not yet in the running batch (sent, queued for
        pre-allocation, transferring, transferred and waiting, or held for a rebootstrap), in
        submission order: what :class:`TransferFail` handles index."""
        eng = self.engine
        queued = [m.req for m in eng.recv_queue if m.req is not None] + eng.disagg_prealloc_queue + \
            eng.disagg_transfer_queue + eng.waiting_queue + eng.held_rebootstrap_reqs
        ids = {r.rid for r in queued}
        return [rid for rid in self.live_rids() if rid in ids]

    def _submit(self, args: dict) -> None:
        rid = self.engine.add_request(**args)
        self.submitted.append(rid)
        self._live[rid] = None
        self.prompts[rid] = args["input_ids"]
        self._session_turns += args["session_id"] is not None

    def reach(self) -> dict[str, int]:
        """Requests retracted (decode retraction, forced by memory pressure too; a retract-mode pause; a
        priority preemption), requests aborted (by the client or a failed transfer), successful flush_cache
        calls; then the paths of the config's features (:meth:`_count_paths`): with streaming sessions, turns
        sent into a session; in PD decode, transfers failed by the test. Cumulative since the target was
        built (:meth:`Target.reach`)."""
        out = {"retractions": self.engine.num_retractions, "aborts": len(self.aborted), "flushes": self.flushed()}
        if self.config.enable_streaming_session:
            out["session_turns"] = self._session_turns
        if self.config.is_pd_decode:
            out["failed_transfers"] = self._failed_transfers
        return {**out, **self._paths}

    def _count_paths(self) -> dict[str, int]:
        """Wrap the engine's calls that take the paths its config's features exist for, counting each into
        the dict returned (what :meth:`reach` adds): with ``new_token_ratio`` < 1, ``oom_retractions`` (requests
        decode retracted because the next step did not fit: not forced by memory pressure, not a pause); with
        priority scheduling, ``priority_preemptions`` (requests ``preempt_to_schedule`` preempted); in PD
        decode, ``transfers_landed`` (transfers committed into their request, HiSparse's direct admission
        into a device buffer included; a health check's fake one too); in aggregated HiSparse,
        ``hisparse_staged`` (requests whose host staging finished and that joined decode with a device
        buffer); with HiCache, ``hicache_backups`` (device-to-host copies made) and ``hicache_load_backs``
        (host hits loaded back to the device)."""
        eng, cfg, counts = self.engine, self.config, {}

        def count(obj, name: str, key: str, n=lambda out, *a, **k: int(bool(out))) -> None:
            fn, counts[key] = getattr(obj, name), 0

            def counted(*a, **k):
                out = fn(*a, **k)
                counts[key] += n(out, *a, **k)
                return out

            setattr(obj, name, counted)

        if cfg.new_token_ratio < 1:
            counts["oom_retractions"] = 0
            retract = eng.retract_decode

            def retract_wrapper(reqs, force=False):
                before = eng.num_retractions
                keep = retract(reqs, force=force)
                if not force:
                    counts["oom_retractions"] += eng.num_retractions - before
                return keep

            eng.retract_decode = retract_wrapper
        if cfg.enable_priority_scheduling:
            count(eng, "preempt_to_schedule", "priority_preemptions", lambda out, *a, **k: len(out))
        if cfg.is_pd_decode:
            count(eng, "_commit_transfer_to_req", "transfers_landed")
        elif eng.hisparse_coordinator is not None:
            count(eng.hisparse_coordinator, "collect_ready_reqs", "hisparse_staged", lambda out, *a, **k: len(out))
        if cfg.enable_hicache:
            count(eng.tree_cache, "_backup", "hicache_backups")
            count(eng.tree_cache, "load_back", "hicache_load_backs", lambda out, *a, **k: int(out is not None))
        if not eng.tree_cache.disable:
            self._count_evictions(counts)
            if cfg.is_pd_decode:
                count(eng, "_pre_alloc", "prefix_hits",
                      lambda out, req, *a: int(req.prefix_indices is not None and req.prefix_indices.numel() > 0))
        if not cfg.is_pd_decode:
            self._count_batches(counts)
        return counts

    def _count_evictions(self, counts: dict[str, int]) -> None:
        """``evictions_for_alloc``: evictions from the tree that freed tokens for an allocation (``_evict_for``:
        extend, decode, PD pre-allocation; a HiCache load-back), not a memory-pressure message's (which
        ``process_input_requests`` makes). A wrapper on the tree's ``evict``, which runs only when an allocation
        is short or at memory pressure; its engine caller is read then."""
        tree, counts["evictions_for_alloc"] = self.engine.tree_cache, 0
        evict = tree.evict

        @pass_through  # (between engine frames: a stack's walk goes on past it)
        def counted(num_tokens: int) -> int:
            freed = evict(num_tokens)
            if freed:
                f = sys._getframe(1)
                while f is not None and not f.f_code.co_filename.startswith(_ENGINE_DIR):
                    f = f.f_back
                counts["evictions_for_alloc"] += f is not None and f.f_code.co_name != "process_input_requests"
            return freed

        tree.evict = counted

    def _count_batches(self, counts: dict[str, int]) -> None:
        """The scheduling paths of aggregated serving, read from the prefill batch ``alloc_for_extend`` is given
        (mixed chunk: the batch ``get_next_batch_to_run`` returns; overlap: the lagged result ``process_batch_result``
        ends): with the tree, ``prefix_hits`` (requests admitted on a cached prefix of the tree, not a session's
        borrowed record); with chunked prefill, ``chunks_parked`` (prefill batches after which a request stays
        parked as ``chunked_req``, its next chunk in a later step); with mixed chunk, ``mixed_batches`` (prefill
        batches with decode rows); with overlap, ``deferred_finishes`` (requests a result processed one step
        after its batch ran finished: by length or an abort since)."""
        eng, cfg = self.engine, self.config
        hits, chunks = not eng.tree_cache.disable, cfg.chunked_prefill_size is not None
        if hits or chunks:
            counts.update(dict.fromkeys([k for k, on in (("prefix_hits", hits), ("chunks_parked", chunks)) if on], 0))
            alloc_for_extend = eng.alloc_for_extend

            @pass_through  # (between engine frames: a stack's walk goes on past it)
            def counted_extend(batch) -> None:
                if hits:  # (a chunk's continuation holds its row already)
                    counts["prefix_hits"] += sum(not r.kv.holds_kv and r.prefix_len > 0 and r.prefix_indices is not None
                                                 for r in batch.reqs)
                alloc_for_extend(batch)
                if chunks and eng.chunked_req is not None:
                    counts["chunks_parked"] += any(r is eng.chunked_req for r in batch.reqs)

            eng.alloc_for_extend = counted_extend
        if cfg.enable_mixed_chunk:
            counts["mixed_batches"], next_batch = 0, eng.get_next_batch_to_run

            @pass_through  # (between engine frames: a stack's walk goes on past it)
            def counted_next():
                batch = next_batch()
                if batch is not None and batch.decode_ids:
                    counts["mixed_batches"] += 1
                return batch

            eng.get_next_batch_to_run = counted_next
        if cfg.enable_overlap:
            counts["deferred_finishes"], process = 0, eng.process_batch_result

            @pass_through  # (between engine frames: a stack's walk goes on past it)
            def counted_result(batch):
                live = [r for r in batch.reqs if not r.finished()]
                process(batch)
                counts["deferred_finishes"] += sum(r.finished() for r in live)

            eng.process_batch_result = counted_result

    def _text(self, rid: str) -> list[int]:
        """The prompt and output so far of submitted request ``rid`` (a session turn: its own input)."""
        eng = self.engine
        live = [r for r in eng.running_batch + eng.waiting_queue + (eng.last_batch.reqs if eng.last_batch else [])
                if r.rid == rid]
        if live:
            return live[0].fill_ids
        out = next((o.output_ids for o in eng.finished_outputs if o.rid == rid), [])
        return self.prompts[rid] + out

    def on_intake(self, callback) -> None:
        """Call ``callback()`` each time the engine has taken a batch of messages, before it schedules."""
        eng = self.engine
        intake = eng.process_input_requests

        def wrapper():
            busy = bool(eng.recv_queue)
            intake()
            if busy:
                callback()

        eng.process_input_requests = wrapper

    def progress(self) -> dict[str, int]:
        """Per live request that holds KV or was aborted: a number that grows while it makes progress
        (KV positions committed plus tokens sampled; -1 for an aborted request that holds nothing).
        Once the engine is fully idle, every request sent and not answered is :data:`LOST`: no queue,
        batch or staging area holds it (a retraction or preemption that dropped it); and every request an
        abort named that was still unanswered when the engine took the abort, then answered with another
        reason, is :data:`ABORT_IGNORED` (``_taking_abort``). Empty while the scheduler is paused:
        nothing is expected to progress."""
        eng = self.engine
        if self._scheduler_paused:
            return {}
        if self._idle():  # (the tokenizer's held requests are not sent yet: not in live_rids())
            out = dict.fromkeys(self.live_rids(), LOST)
            if self.abort_taken:  # (idle: every abort sent was taken, and every request it hit answered)
                self._judge_aborts()
            if self.abort_ignored:
                out.update(dict.fromkeys(self.abort_ignored, ABORT_IGNORED))
            return out
        out = {r.rid: r.kv.kv_committed_len + len(r.output_ids) + len(r.future_ids) for r in eng.requests_owning_rows()}
        if self.aborted:  # live_rids() walks the finished outputs: only when an abort was sent
            for rid in self.aborted.intersection(self.live_rids()):
                out.setdefault(rid, -1)
        return out

    def _judge_aborts(self) -> None:
        # the aborts taken since the last idle check: each request one named, answered after the engine took
        # it (its output's index at least the count then), must be answered with the abort reason
        taken, outs, abort = self.abort_taken, self.engine.finished_outputs, FinishReason.ABORT
        otherwise = {o.rid: i for i, o in enumerate(outs[taken[0]:], taken[0]) if o.reason != abort}
        ignored = {rid for emitted, rids in zip(taken, self.abort_named) for rid in rids
                   if otherwise.get(rid, -1) >= emitted}
        if ignored:
            self.abort_ignored = self.abort_ignored | ignored
        del self.abort_named[:len(taken)]
        taken.clear()

    def quiescence(self) -> list[tuple[str, str]]:
        """After a successful ``flush_cache`` (the engine was idle): every pool is full again, the
        tree is empty and no session holds KV. Returns ``(pool, problem)`` per violation; checked once
        per successful flush (see :meth:`flushed`)."""
        eng, out = self.engine, []
        for name, a in self.accounting().items():
            if a.available != a.total:
                out.append((name, f"available={a.available} of total={a.total} after a successful flush_cache"))
        if eng.tree_cache.total_size() or (eng.hicache_host_pool is not None and eng.tree_cache.host_size()):
            out.append(("token_to_kv_pool", "the radix tree still holds tokens after a successful flush_cache"))
        if eng.session_controller is not None and eng.session_controller.slots():
            out.append(("req_to_token_pool", "a session still holds KV after a successful flush_cache"))
        return out

    def flushed(self) -> int:
        """How many flush_cache requests have succeeded so far."""
        return sum(self.engine.flush_results)

    def transient(self) -> bool:
        """A turn running on its session's borrowed KV record (``Req.borrowed_slot``): the busy identity
        counts such a turn by its own rule only while it runs, a step or a few, so a search's sparse schedule
        checks after every step meanwhile (the zoo's ``session-borrow-double-count``, SGLang #22213)."""
        eng = self.engine
        if eng.session_controller is None:  # (asked after every step: no sessions, no borrowed record)
            return False
        for r in eng.running_batch:
            if r.borrowed_slot is not None:
                return True
        if eng.last_batch:
            for r in eng.last_batch.reqs:
                if r.borrowed_slot is not None:
                    return True
        return False

    def stalled(self) -> bool:
        """Only waiting requests are left and memory that open sessions hold keeps them out: SGLang
        waits too (until the sessions close or time out). Not a hang."""
        eng = self.engine
        return (bool(eng.waiting_queue) and eng.session_held_tokens() > 0 and not eng.running_batch
                and eng.last_batch is None and eng.chunked_req is None and not eng._hicache_in_flight()
                and all(r.load_back is None for r in eng.waiting_queue))

    def units_of_rows(self, rows, lengths=None) -> dict[str, np.ndarray]:
        """Units referenced by request rows ``rows`` (``[n] int64``): their KV slots, as units of each pool;
        with ``lengths`` (``[n] int64``), only each row's first ``lengths[i]`` positions in the token pool."""
        eng, ps = self.engine, self.config.page_size
        table = eng.req_to_token_pool.req_to_token[torch.as_tensor(rows, dtype=torch.int64)].cpu().numpy()
        slots = (table if lengths is None else table[np.arange(table.shape[1]) < np.reshape(lengths, (-1, 1))]).reshape(-1)
        out = {"token_to_kv_pool": np.unique(slots // ps)}
        hs = eng.hisparse_coordinator
        if hs is not None:
            for pool, held in (("hisparse_device", hs.req_to_device_buffer), ("hisparse_device", hs.req_prefill_physical),
                               ("hisparse_host", hs.req_to_host_pool)):
                mine = [held[int(r)].cpu().numpy() // ps for r in rows if int(r) in held]
                if mine:
                    out[pool] = np.unique(np.concatenate([out.get(pool, np.empty(0, np.int64))] + mine))
        return out

    def metrics_check(self) -> list[str]:
        """The engine's session gauges against what kvaudit sees (every session holding KV is
        counted), and every live KV record's lengths: ``0 <= kv_committed_len <= kv_allocated_len``."""
        eng, out = self.engine, []
        m = eng.metrics()
        holders = 0 if eng.session_controller is None else len(eng.session_controller.slots())
        if m["num_streaming_sessions"] < holders:
            out.append(f"[sessions] num_streaming_sessions={m['num_streaming_sessions']} but {holders} sessions hold KV")
        return out + kv_length_problems(self._owners())

    def step(self) -> None:
        self.steps += 1
        self.engine.step()

    def is_idle(self) -> bool:
        """The engine is fully idle, has no message to take in, and has completed every close the client
        sent (a close deferred while a turn runs completes at the intake after the turn ends)."""
        return self._idle()

    def _idle(self) -> bool:  # (progress() reads it too: is_idle() is asked once a step, by the runner only)
        return self.engine.is_fully_idle() and not self.engine.recv_queue and not self._closing()
