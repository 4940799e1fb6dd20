"""The target for ``engine_under_test``.

Roots are read from the scheduler's own structures, the way SGLang's invariant checker finds
owners (``_requests_owning_rows``): live requests in the running batch, the last batch, the
waiting queue and the PD transfer queue; the radix tree's nodes; and, for HiSparse, the buffer
and host slots of *live* requests' rows. State the coordinator still keeps for a row that no
live request holds is, by construction, unreachable.
"""

from __future__ import annotations

import numpy as np
import torch

from engine_under_test import EngineConfig, Scheduler
from kvaudit.program import (PAUSE_MODES, Abort, CloseSession, ContinueGeneration, FlushCache, HealthCheck,
                             MemoryPressure, Op, OpenSession, PauseGeneration, Submit, TransferFail, prompt_tokens)
from kvaudit.targets.base import (Accounting, Target, LockImbalance, PoolSpec, Recount, Root, kv_length_problems, record_roots,
                                  slot_pages, wrap_insert)


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


class EutTarget(Target):
    """``engine_under_test`` behind the program model; the target also plays SGLang's tokenizer.

    ``Submit.priority`` is passed on; the engine honours it only with ``enable_priority_scheduling``
    (off by default, as in SGLang). ``PauseGeneration`` follows ``TokenizerManager.pause_generation``:
    every mode holds new submits and health checks here, at the tokenizer, until ``ContinueGeneration``
    sends them in order; ``abort`` aborts every request and leaves the scheduler running,
    ``in_place`` and ``retract`` pause the scheduler (``Scheduler.pause_generation``).
    """

    name = "eut"

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
        self._finished: set[str] = set()
        self._seen_outputs = 0
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
        outs = self.engine.finished_outputs
        for o in outs[self._seen_outputs:]:
            self._finished.add(o.rid)
        self._seen_outputs = len(outs)
        return [r for r in self.submitted if r not in self._finished]

    @property
    def paused(self) -> bool:
        """The tokenizer holds new requests (any pause mode, until ``ContinueGeneration``)."""
        return self._holding

    def apply(self, op: Op) -> None:
        cfg, eng = self.config, self.engine
        if isinstance(op, Submit):
            max_new = max(1, min(op.max_new_tokens, cfg.context_len // 2))
            plen = max(1, min(op.prompt_len, cfg.context_len - max_new))
            stop = None if op.stop_at is None else max(1, op.stop_at)
            prompt = prompt_tokens(op.family, plen, cfg.vocab_size)
            if op.extends is not None and self.submitted:
                prompt = (self._text(self.submitted[op.extends % len(self.submitted)]) + prompt)[: cfg.context_len - max_new]
            sid = self.sessions[op.session % len(self.sessions)] if op.session is not None and self.sessions else None
            args = {"input_ids": prompt, "max_new_tokens": max_new, "stop_at": stop, "session_id": sid,
                    "ignore_eos": bool(op.ignore_eos), "priority": op.priority}
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
                self.aborted.update(self.live_rids())
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
                rids = pending if op.handle is None else [pending[op.handle % len(pending)]] if pending else []
                for rid in rids:
                    eng.report_transfer_failure(rid)
                    self.aborted.add(rid)
        elif isinstance(op, Abort):
            live = self.live_rids()
            if op.handle is None:
                eng.abort_request(abort_all=True)
                self.aborted.update(live)
            elif live:
                rid = live[op.handle % len(live)]
                eng.abort_request(rid)
                self.aborted.add(rid)
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
        self.prompts[rid] = args["input_ids"]

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
        Empty while the scheduler is paused: nothing is expected to progress."""
        eng = self.engine
        if self._scheduler_paused:
            return {}
        out = {r.rid: r.kv.kv_committed_len + len(r.output_ids) + len(r.future_ids) for r in eng.requests_owning_rows()}
        if self.aborted:  # live_rids() walks the finished outputs: only when an abort was sent
            for rid in self.aborted.intersection(self.live_rids()):
                out.setdefault(rid, -1)
        return out

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

    def stalled(self) -> bool:
        """Only waiting requests are left and memory that open sessions hold keeps them out: SGLang
        waits too (until the sessions close or time out). Not a hang."""
        eng = self.engine
        return (bool(eng.waiting_queue) and eng.session_held_tokens() > 0 and not eng.running_batch
                and eng.last_batch is None and eng.chunked_req is None and not eng._hicache_in_flight()
                and all(r.load_back is None for r in eng.waiting_queue))

    def units_of_rows(self, rows) -> dict[str, np.ndarray]:
        """Units referenced by request rows ``rows`` (``[n] int64``): their KV slots, as units of each pool."""
        eng, ps = self.engine, self.config.page_size
        slots = eng.req_to_token_pool.req_to_token[torch.as_tensor(rows, dtype=torch.int64)].reshape(-1).cpu().numpy()
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
        return out + kv_length_problems(eng.requests_owning_rows())

    def step(self) -> None:
        self.steps += 1
        self.engine.step()

    def is_idle(self) -> bool:
        return self.engine.is_fully_idle() and not self.engine.recv_queue

    # -- KV content (shadow tags) ------------------------------------------------------------
    def kv_pools(self) -> dict[str, int]:
        """Every pool whose slots hold KV content, with its size in token slots."""
        return {spec.name: (spec.num_units + 1) * spec.page_size for spec in self._pools if spec.kind == "kv"}

    def install_shadow(self, shadow, wrap, report) -> None:
        """Report the engine's KV writes, copies and reads to ``shadow`` (:class:`kvaudit.shadow.ShadowKV`)
        by wrapping, with ``wrap(obj, name, fn)``, the functions that move KV: the forward, the PD
        transfer, and the HiSparse/HiCache device<->host copies. A read whose tags do not match the
        reader's prefix calls ``report(pool, slots, message)``."""
        eng = self.engine
        hs, tree = eng.hisparse_coordinator, eng.tree_cache
        table = eng.req_to_token_pool.req_to_token
        main = "token_to_kv_pool"
        kv_pool = "hisparse_device" if hs is not None else main  # where the forward writes
        forward, transfer = eng._forward, eng._commit_transfer_to_req
        rows = table.numpy() if table.device.type == "cpu" else None  # a view: no copy per read
        main_tags = shadow.tags[main]
        run_batch, request_tags = eng.run_batch, shadow.request_tags

        def check_read(req, pool: str, idx: np.ndarray, want: np.ndarray, pos: np.ndarray | None = None) -> None:
            """``req`` reads slots ``idx`` for positions ``pos`` (default ``0..n-1``) with prefix tags ``want``."""
            hit = shadow.read(pool, idx, want)
            if hit is not None:
                bad, what = hit
                at = bad if pos is None else pos[bad]
                report(pool, idx[bad], f"req:{req.rid} read KV of positions {_ranges(at)} from slots {what}")

        def forward_wrapper(req, start, end, write_loc):
            """HiSparse (a per-request physical context) or a KV table on the GPU: one forward at a time."""
            tags = request_tags(req, req.origin_input_ids, req.output_ids, req.future_ids)
            if start and hs is None:
                check_read(req, main, shadow._idx(table[req.kv.req_pool_idx, :start]), tags[:start])
            elif start:
                if req.hisparse_admitted:
                    slots, pos = hs.physical_context(req)
                else:
                    slots, pos = hs.prefill_context(req.kv.req_pool_idx, end)
                keep = pos < start
                pos = shadow._idx(pos[keep])
                check_read(req, "hisparse_device", shadow._idx(slots[keep]), tags[pos], pos)
            out = forward(req, start, end, write_loc)
            shadow.write(kv_pool, write_loc, tags[start:end])
            return out

        def batch_wrapper(batch):
            """The common case (no HiSparse, KV on the CPU) checked a batch at a time: every row's
            reads before the forward, its writes after."""
            if batch.forward_mode == "prebuilt":
                return run_batch(batch)
            spans = []
            extend = batch.forward_mode == "extend"
            for req in batch.reqs:
                prefill_row = extend and id(req) not in batch.decode_ids
                if prefill_row:
                    start, end = req.prefix_len, req.extend_end
                else:
                    end = req.kv.kv_committed_len
                    start = end - 1
                tags = request_tags(req, req.origin_input_ids, req.output_ids, req.future_ids)
                computed = prefill_row or req.to_finish is None  # an aborting decode row computes nothing
                spans.append((req, start, end, tags, computed))
                if start and computed:
                    idx, want = rows[req.kv.req_pool_idx, :start], tags[:start]
                    if main_tags.take(idx).tobytes() != want.tobytes():  # shadow.read's fast path, inlined
                        check_read(req, main, idx, want)
            out = run_batch(batch)
            # tolist, not numpy(): a numpy view of each batch's fresh tensor costs more than the list
            loc, off = batch.out_cache_loc.tolist(), 0
            for req, start, end, tags, computed in spans:
                if computed:  # (see Scheduler.run_batch)
                    if end - start == 1:
                        main_tags[loc[off]] = tags[start]
                    else:
                        main_tags[loc[off : off + end - start]] = tags[start:end]
                off += end - start
            return out

        def transfer_wrapper(req):
            n, p = req.kv.kv_committed_len, req.kv.cache_protected_len  # KV of [p, n) lands now; [0, p) is the tree's
            tags = request_tags(req, req.origin_input_ids, req.output_ids)[:n]
            if hs is not None:
                shadow.write("hisparse_host", hs.req_to_host_pool[req.kv.req_pool_idx][:n], tags)
            else:
                shadow.write(main, table[req.kv.req_pool_idx, p:n], tags[p:])
            return transfer(req)

        if hs is None and rows is not None:
            wrap(eng, "run_batch", batch_wrapper)
        else:
            wrap(eng, "_forward", forward_wrapper)
        wrap(eng, "_commit_transfer_to_req", transfer_wrapper)
        if hs is not None:
            backup, load = hs.backup, hs._load
            wrap(hs, "backup", lambda dev, host: (shadow.copy("hisparse_host", host, "hisparse_device", dev),
                                                  backup(dev, host))[1])
            wrap(hs, "_load", lambda dev, host: (shadow.copy("hisparse_device", dev, "hisparse_host", host),
                                                 load(dev, host))[1])
        if eng.hicache_host_pool is not None:
            tree_copy = tree._copy

            def hicache_copy(dst, dst_idx, src, src_idx):
                if dst is tree.host_pool:
                    shadow.copy("hicache_host", dst_idx, main, src_idx)
                else:
                    shadow.copy(main, dst_idx, "hicache_host", src_idx)
                return tree_copy(dst, dst_idx, src, src_idx)

            wrap(tree, "_copy", hicache_copy)

    # -- observing --------------------------------------------------------------------------
    owner_hint_vars = ("req",)  # only frames of functions with such a local are inspected
    owner_stop_vars = ("reqs", "batch")  # a function over a whole batch: ``req`` is a loop variable

    @staticmethod
    def owner_hint(frame_locals: dict) -> str | None:
        """Name the request an allocating engine frame works for (its local ``req``), or None."""
        rid = getattr(frame_locals.get("req"), "rid", None)
        return f"req:{rid}" if isinstance(rid, str) else None

    def roots(self, aborting: bool = True) -> list[Root]:
        """Every reference into the pools. ``aborting=False`` leaves out requests already marked to
        finish with an abort (their in-flight result is about to release them)."""
        eng, ps = self.engine, self.config.page_size
        table = eng.req_to_token_pool.req_to_token
        out: list[Root] = []
        hs = eng.hisparse_coordinator

        def pages(slots: torch.Tensor) -> np.ndarray:
            return slot_pages(slots, ps)

        def record(kv, owner: str, role: str, where: str) -> None:
            out.extend(record_roots(table, kv, owner, role, ps, where))

        sc = eng.session_controller
        slots = [] if sc is None else sc.slots()
        for sid, slot in slots:
            record(slot.kv, f"session:{sid}", "session", "session")
        if sc is not None:
            units = [(sid, self.session_records.unit_of.get(id(s.slot))) for sid, s in sc.sessions.items()]
            out += [Root("session_records", f"session:{sid}", np.array([u], dtype=np.int64), role="session")
                    for sid, u in units if u is not None]
        held = {id(slot.kv) for _, slot in slots}
        places = self._places()
        for req in eng.requests_owning_rows():
            if not aborting and req.to_finish is not None:
                continue
            kv, owner = req.kv, f"req:{req.rid}"
            if id(kv) not in held:  # a turn on its session's record: the session root covers it
                record(kv, owner, "req", places.get(id(req), ""))
            if hs is not None:
                row = kv.req_pool_idx
                for pool, held_slots in (("hisparse_device", hs.req_to_device_buffer.get(row)),
                                         ("hisparse_device", hs.req_prefill_physical.get(row)),
                                         ("hisparse_host", hs.req_to_host_pool.get(row))):
                    if held_slots is not None:
                        out.append(Root(pool, owner, pages(held_slots)))
        nodes = list(eng.tree_cache.nodes())
        values = [n.value for n in nodes if n.value is not None]
        if values:
            out.append(Root("token_to_kv_pool", "tree", pages(torch.cat(values)), role="tree"))
        host = [n.host_value for n in nodes if n.host_value is not None]
        if host and eng.hicache_host_pool is not None:
            out.append(Root("hicache_host", "tree", pages(torch.cat(host)), role="tree"))
        return out

    def _places(self) -> dict[int, str]:
        """``id(req)`` -> the scheduler structure that holds it (``Root.where``); the most specific one
        wins (a chunked request is in the last batch too, a decoding one in the running batch)."""
        eng = self.engine
        hs = eng.hisparse_coordinator
        groups = (("chunked", (eng.chunked_req,) if eng.chunked_req else ()),
                  ("staging", hs.staging_reqs() if hs is not None else ()),
                  ("transfer", eng.disagg_transfer_queue), ("waiting", eng.waiting_queue),
                  ("running", eng.running_batch), ("last_batch", eng.last_batch.reqs if eng.last_batch else ()))
        out: dict[int, str] = {}
        for name, group in groups:
            for r in group:
                out.setdefault(id(r), name)
        return out

    def lock_holders(self) -> list[tuple[str, str, int]]:
        """Every live lock receipt as ``(lock, holder, node id)``: requests' ``req.lock`` and session
        slots' ``slot.lock`` (device), HiCache write-throughs until their ack (device), and load-backs
        (device lock and host pin on the same node) until released, named by the request that started
        them, also once an abort left them to be released at their ack (``orphan_load_backs``)."""
        return [(lock, name, node.id) for lock, name, node in self._holders()]

    def _holders(self) -> list[tuple[str, str, object]]:
        """:meth:`lock_holders` with the tree nodes themselves."""
        eng = self.engine
        tree = eng.tree_cache
        if tree.disable:
            return []
        out = [("device", f"req:{r.rid}", r.lock) for r in eng.requests_owning_rows() if r.lock is not None]
        if eng.session_controller is not None:
            out += [("device", f"session:{sid}", slot.lock) for sid, slot in eng.session_controller.slots()
                    if slot.lock is not None]
        if eng.hicache_host_pool is not None:
            out += [("device", f"hicache write-through of node {node.id}", node)
                    for node, _ in tree.ongoing_write_through.values()]
            names = self._load_back_names
            for r in eng.waiting_queue:
                if r.load_back is not None and id(r.load_back) not in names:
                    names[id(r.load_back)] = (r.load_back, f"hicache load-back for req:{r.rid}")
            recs = [r.load_back for r in eng.waiting_queue if r.load_back is not None] + list(eng.orphan_load_backs)
            for rec in recs:
                name = names.get(id(rec), (None, f"hicache load-back of node {rec.node.id}"))[1]
                out += [("device", name, rec.node), ("host", name, rec.node)]
            if names:
                live = {id(rec) for rec in tree.ongoing_load_back.values()}
                for key in [k for k in names if k not in live]:
                    del names[key]
        return out

    def lock_balance(self) -> list[LockImbalance]:
        """Tree nodes whose ``lock_ref`` (device) or ``host_ref`` (HiCache host pins) differs from the
        live holders whose path covers them (SGLang invariant: ``lock_ref`` equals the number of live
        receipts whose anchor path covers the node). Holders: :meth:`lock_holders`. The device entries
        name ``token_to_kv_pool`` slots, the host ones ``hicache_host`` slots (a host pin covers the
        pinned node and its ancestors, as ``HiRadixCache._pin_host`` walks them)."""
        tree = self.engine.tree_cache
        if tree.disable:
            return []
        want: dict[tuple[str, int], int] = {}
        for lock, _, node in self._holders():
            while node is not None and node is not tree.root_node:
                want[lock, id(node)] = want.get((lock, id(node)), 0) + 1
                node = node.parent
        host = self.engine.hicache_host_pool is not None
        out = []
        for n in tree.nodes():
            if n.lock_ref != want.get(("device", id(n)), 0):
                out.append(LockImbalance(f"node {n.id} ({len(n.key)} tokens)",
                                         (n.value if n.value is not None else n.host_value).cpu().numpy(), n.lock_ref,
                                         want.get(("device", id(n)), 0), {n.id} | {d.id for d in tree.nodes(n)}))
            if host and n.host_ref != want.get(("host", id(n)), 0):
                slots = n.host_value if n.host_value is not None else torch.zeros(1, dtype=torch.int64)
                out.append(LockImbalance(f"host pin on node {n.id} ({len(n.key)} tokens)", slots.cpu().numpy(),
                                         n.host_ref, want.get(("host", id(n)), 0),
                                         {n.id} | {d.id for d in tree.nodes(n)}, "host", "hicache_host"))
        return out

    def install_lock_ledger(self, wrap, record) -> None:
        """Report every ``inc_lock_ref``/``dec_lock_ref`` of the tree to ``record(node_id, delta)``, and
        with HiCache every host pin (``_pin_host(node, delta)``) to ``record(node_id, delta, "host")``."""
        tree = self.engine.tree_cache
        if tree.disable:
            return
        inc, dec = tree.inc_lock_ref, tree.dec_lock_ref

        # a node of None is the engine's own bug: let the engine's call fail where it would unhooked
        def inc_wrapper(node):
            if node is not None:
                record(node.id, +1)
            return inc(node)

        def dec_wrapper(node):
            if node is not None:
                record(node.id, -1)
            return dec(node)

        wrap(tree, "inc_lock_ref", inc_wrapper)
        wrap(tree, "dec_lock_ref", dec_wrapper)
        pin = getattr(tree, "_pin_host", None)
        if pin is not None:
            def pin_wrapper(node, delta):
                if node is not None and node is not tree.root_node:
                    record(node.id, delta, "host")
                return pin(node, delta)

            wrap(tree, "_pin_host", pin_wrapper)

    def _track_retraction(self) -> None:
        """Record what each ``retract_decode`` did (``last_retraction``), read from outside the call:
        requests retracted, tokens freed, and why it stopped (SGLang ``retract_decode``'s loop ends when
        one decode step fits, at the last request, or aborts that one when even it does not fit)."""
        eng = self.engine
        retract = eng.retract_decode

        def retract_wrapper(reqs, force=False):
            before = eng.token_to_kv_pool_allocator.available_size() + eng.tree_cache.evictable_size()
            keep = retract(reqs, force=force)
            after = eng.token_to_kv_pool_allocator.available_size() + eng.tree_cache.evictable_size()
            gone = [r for r in reqs if r not in keep]
            aborted = [r for r in gone if r.finished()]
            why = ("forced by memory pressure (all but one)" if force else
                   "even the last request did not fit: aborted it" if aborted else
                   "one decode step fits" if eng._decode_fits(keep) else "only one request left")
            self.last_retraction = (f"step {self.steps}: retracted {len(gone) - len(aborted)} request(s)"
                                    + (f", aborted {len(aborted)}" if aborted else "")
                                    + f", freed {after - before} tokens (available + evictable); "
                                    f"stopped: {why}; {len(keep)} kept")
            return keep

        eng.retract_decode = retract_wrapper

    def retraction(self) -> str:
        return self.last_retraction or ""

    def install_insert_check(self, wrap, report) -> None:
        """Check every ``RadixCache.insert(key, value)``: the tree takes ``min(len(key), value.numel())``
        tokens of the request being cached (the caller's local ``req``, as in ``checkpoint_kv_cache_into_tree``),
        which must not exceed its ``kv_committed_len``; else ``report(owner, inserted, committed, slots)``
        with the slots (``[n] int64``) of the positions past ``kv_committed_len``."""
        tree = self.engine.tree_cache
        if tree.disable:
            return

        def measure(req, key, value, *a, **k):
            inserted, committed = min(len(key), int(value.numel())), req.kv.kv_committed_len
            return f"req:{req.rid}", inserted, committed, value

        wrap_insert(wrap, tree, "insert", measure, report)

    def recount(self) -> dict[str, dict[str, Recount]]:
        """The tree's terms recounted from its nodes (SGLang's definition, ``RadixCache.check_integrity``):
        ``evictable`` = tokens of device-resident nodes with ``lock_ref == 0``, ``protected`` = those with
        ``lock_ref > 0``; with HiCache, the host pool's ``protected`` = host copies of device-resident or
        pinned (``host_ref > 0``) nodes and ``evictable`` = the other host copies. One walk of the tree."""
        tree = self.engine.tree_cache
        if tree.disable:
            return {}
        ev = pr = hev = hpr = 0
        for n in tree.nodes():
            k = len(n.key)
            if n.value is not None:
                if n.lock_ref:
                    pr += k
                else:
                    ev += k
            if n.host_value is not None:
                if n.value is not None or n.host_ref:
                    hpr += k
                else:
                    hev += k
        out = {"token_to_kv_pool": {"evictable": Recount(ev, "tree", "its nodes with lock_ref 0"),
                                    "protected": Recount(pr, "tree", "its nodes with lock_ref > 0")}}
        if self.engine.hicache_host_pool is not None:
            out["hicache_host"] = {
                "evictable": Recount(hev, "host tree", "host copies of unpinned host-only nodes"),
                "protected": Recount(hpr, "host tree", "host copies of device-resident or pinned nodes")}
        return out

    def describe_busy(self) -> str:
        eng = self.engine
        return (f"waiting={len(eng.waiting_queue)} running={len(eng.running_batch)} "
                f"prealloc={len(eng.disagg_prealloc_queue)} transfer={len(eng.disagg_transfer_queue)} "
                f"available={eng.token_to_kv_pool_allocator.available_size()} "
                f"evictable={eng.tree_cache.evictable_size()} protected={eng.tree_cache.protected_size()}")

    def accounting(self) -> dict[str, Accounting]:
        eng = self.engine
        a = eng.token_to_kv_pool_allocator
        tree = eng.tree_cache
        acc = {"token_to_kv_pool": Accounting(a.available_size(), tree.evictable_size(), tree.protected_size(),
                                              eng.session_held_tokens(), a.size)}
        rp = eng.req_to_token_pool
        session_rows = 0 if eng.session_controller is None else len(eng.session_controller.slots())
        acc["req_to_token_pool"] = Accounting(rp.available_size(), 0, 0, session_rows, rp.size + rp.pre_alloc_size)
        if eng.hicache_host_pool is not None:
            hp = eng.hicache_host_pool
            acc["hicache_host"] = Accounting(hp.available_size(), tree.host_evictable_size(),
                                             tree.host_protected_size(), 0, hp.size)
        hs = eng.hisparse_coordinator
        if hs is not None:
            for name, pool in (("hisparse_device", hs.hisparse_attn_allocator), ("hisparse_host", hs.host_pool)):
                acc[name] = Accounting(pool.available_size(), 0, 0, 0, pool.size)
        return acc

    def engine_check(self) -> list[str]:
        return [c.message() for c in self.engine.check_memory() if not c.ok]


def _ranges(pos) -> str:
    """``[3, 4, 5, 9]`` -> ``"3-5, 9"`` (at most four ranges)."""
    pos = sorted(int(p) for p in pos)
    out, start = [], pos[0]
    for a, b in zip(pos, pos[1:] + [None]):
        if b != a + 1:
            out.append(f"{start}" if start == a else f"{start}-{a}")
            start = b
    return ", ".join(out[:4]) + (", ..." if len(out) > 4 else "")
