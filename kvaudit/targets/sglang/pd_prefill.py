"""PD disaggregation, prefill side, on SGLang 0.5.23 (``disaggregation_mode="prefill"``): SGLang's own
``PrefillBootstrapQueue``, inflight queue and ``SchedulerDisaggregationPrefillMixin`` methods, driven by a
second driver (:class:`PdPrefill`) in ``event_loop_normal_disagg_prefill``'s order; kvaudit plays the decode
peer and the wire (:class:`DecodePeer`, its senders built on SGLang's ``FakeKVSender``).

Design notes: docs/internals/sglang.md ("PD prefill")."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from kvaudit.targets.base import PoolSpec, Root
from kvaudit.targets.sglang import compat
from kvaudit.targets.sglang.boot import SglangUnavailable, build, cpu_server_args, load, one_rank_group, \
    override_parallel
from kvaudit.targets.sglang.config import SglangConfig
from kvaudit.targets.sglang.pd import load_pd, publish_scheduler
from kvaudit.targets.sglang.pd_transfer import PdServer, install_metadata_pool, metadata_roots
from kvaudit.targets.sglang.standins import EOS

DECODE_HOST = "10.0.0.2"  # the decode peer's bootstrap host (not FAKE_BOOTSTRAP_HOST: its KV enters the tree)
COUNTERS = ("prefill_transfers_done", "prefill_transfers_failed", "prefill_bootstrap_failed",
            "prefill_bootstrap_timeouts", "prefill_waiting_timeouts", "prefill_aborts_bootstrap",
            "prefill_aborts_waiting", "prefill_aborts_chunked", "prefill_aborts_inflight", "prefill_chunks_sent",
            "prefill_optimistic_requeues", "prefill_session_turns", "prefill_session_turns_requeued")


def load_prefill():
    """SGLang's ``disaggregation/prefill.py`` and ``fake/conn.py``, after :func:`load_pd`. Raises
    :class:`SglangUnavailable` when they do not import."""
    P = load_pd()
    try:
        import sglang.srt.disaggregation.fake.conn as fake_conn
        import sglang.srt.disaggregation.prefill as prefill
        from sglang.srt.disaggregation.fake.conn import FakeKVSender
    except ImportError as exc:
        raise SglangUnavailable(f"SGLang's PD prefill path does not import: {exc}") from None
    return SimpleNamespace(P=P, prefill=prefill, fake_conn=fake_conn, FakeKVSender=FakeKVSender)


class DecodePeer:
    """The decode server and the wire, seen from prefill: request ``n``'s decode bootstraps ``bootstrap_steps``
    after it arrived (never, for every ``lost_every``-th); a transfer lands ``latency`` steps after its last
    chunk is sent. ``step`` is the scheduler's step count."""

    def __init__(self, bootstrap_steps: int, lost_every: int | None, latency: int, reads_after_failure: bool):
        self.bootstrap_steps, self.lost_every, self.latency = bootstrap_steps, lost_every, latency
        self.reads_after_failure = reads_after_failure
        self.step = 0
        self.rooms = 0
        # the wire's reads: (step it lands, sender, [n] int64 source pages) of each chunk in flight
        self.reads: list[tuple[int, object, np.ndarray]] = []

    def tick(self) -> None:
        self.step += 1
        self.reads = [r for r in self.reads if r[0] > self.step]

    def reading(self) -> list[tuple[int, np.ndarray]]:
        """``(room, source pages)`` of each chunk the wire still reads: until it lands; once its room failed,
        only with ``reads_after_failure`` (the transfer worker is inside its sync call and finishes the chunk:
        sglang#38961), else the failure stops it at once."""
        failed = self.KVPoll_Failed
        return [(rx.bootstrap_room, pages) for _, rx, pages in self.reads
                if self.reads_after_failure or rx.conclude_state != failed]

    def sender_class(self, Q):
        """kvaudit's ``KVSender``: SGLang's ``FakeKVSender`` (its waiting timeout on the step clock) with the
        bootstrap handshake (``Bootstrapping`` until decode's destinations come, ``CommonKVSender``'s bootstrap
        timeout) and the transfer in flight (``Transferring`` until it lands)."""
        peer, KVPoll = self, Q.P.KVPoll
        S_version = load().version
        self.KVPoll_Failed = KVPoll.Failed

        class Sender(Q.FakeKVSender):
            def __init__(self, mgr, bootstrap_addr, bootstrap_room, timeouts):
                if compat.has("fake-sender-args", S_version):
                    super().__init__(mgr, bootstrap_addr, bootstrap_room)
                else:  # one tensor-parallel rank, one pipeline stage; 0.5.20's does not keep the room
                    super().__init__(mgr, bootstrap_addr, bootstrap_room, dest_tp_ranks=[0], pp_rank=0)
                    self.bootstrap_room = bootstrap_room
                peer.rooms += 1
                self.created = peer.step
                self.lost = peer.lost_every is not None and peer.rooms % peer.lost_every == 0
                self.bootstrap_timeout, self.waiting_timeout = timeouts
                self.num_pages, self.sent_pages, self.lands_at = 0, 0, None
                self.timed_out = ""

            def poll(self):
                if self.conclude_state is not None:
                    return self.conclude_state
                if self.lost or peer.step < self.created + peer.bootstrap_steps:
                    if peer.step - self.created >= self.bootstrap_timeout:  # CommonKVSender._check_bootstrap_timeout
                        self.conclude_state, self.timed_out = KVPoll.Failed, "bootstrap"
                        return KVPoll.Failed
                    return KVPoll.Bootstrapping
                if self.lands_at is not None:
                    if peer.step < self.lands_at:
                        return KVPoll.Transferring
                    self.conclude_state = KVPoll.Success
                    return KVPoll.Success
                out = super().poll()  # WaitingForInput, or Failed on FakeKVSender's waiting timeout
                if out == KVPoll.Failed:
                    self.timed_out = "waiting"
                return out

            def init(self, num_kv_indices: int, aux_index=None):
                super().init(num_kv_indices, aux_index)
                self.num_pages = num_kv_indices

            def send(self, kv_indices, state_indices=None, num_kv_tokens=None, **k):
                """A chunk leaves; the last one (every page sent) starts the transfer's clock."""
                super().send(kv_indices, state_indices, num_kv_tokens)
                self.sent_pages += len(kv_indices)
                if peer.latency and len(kv_indices):
                    pages = np.asarray(kv_indices, dtype=np.int64)
                    peer.reads.append((peer.step + peer.latency, self, pages))
                if self.sent_pages >= self.num_pages and self.lands_at is None:
                    self.lands_at = peer.step + peer.latency

        return Sender


class _PrefillScheduler:
    """The ``Scheduler`` state SGLang's prefill-mode methods read, under the scheduler's own names, with
    ``SchedulerDisaggregationPrefillMixin`` mixed in; ``waiting_queue`` and ``chunked_req`` are the shared
    driver's."""

    def __init__(self, pd, **attrs):
        self.__dict__.update(attrs)
        self._pd, self._target = pd, pd.target

    @property
    def waiting_queue(self):
        return self._target.waiting

    @waiting_queue.setter
    def waiting_queue(self, reqs):
        self._target.waiting = reqs

    @property
    def chunked_req(self):
        return self._target.chunked_req

    @chunked_req.setter
    def chunked_req(self, req):
        self._target.chunked_req = req

    def _release_aborted_request(self, req) -> None:
        self._target._release_aborted_request(req)

    def retire_unadmitted_request(self, req) -> None:
        """``Scheduler.retire_unadmitted_request``: a request rejected at intake."""
        self._target._release_aborted_request(req)
        self._target.finished.add(req.rid)

    def maybe_send_health_check_signal(self) -> None:
        pass


class _Streamer:
    """``output_streamer``: what prefill streams to the client (memory-free); a streamed request is done."""

    def __init__(self, target):
        self.target = target

    def stream_output(self, reqs, return_logprob=False, *a, **k) -> None:
        self.target.finished.update(r.rid for r in reqs)


class PdPrefill(PdServer):
    """The prefill server of PD disaggregation, a second driver. A third pool, ``metadata_buffers``: the
    ``ReqToMetadataIdxAllocator`` slots a request holds from bootstrap until its transfer concludes."""

    name = "pd-prefill"

    def build(self, config: SglangConfig):
        S, Q = load(), load_prefill()
        P = Q.P
        group = SimpleNamespace(cpu_group=one_rank_group(), world_size=1)
        # (a prefill server refuses the fake backend: the declared one is mooncake, the senders are kvaudit's)
        sa = S.ServerArgs(model_path="dummy", page_size=config.page_size, disaggregation_mode="prefill",
                          disaggregation_transfer_backend="mooncake", max_running_requests=config.max_running_requests,
                          chunked_prefill_size=config.chunked_prefill_size or -1,
                          optimistic_prefill_attempts=config.optimistic_prefill_attempts,
                          **cpu_server_args(S.version))
        P.handle_pd_disaggregation(sa)
        publish_scheduler(P, sa)
        override_parallel(S, attn_tp_group=group)
        o = build(config, server_args=sa)
        self.target.clock.install(Q.fake_conn)  # FakeKVSender's waiting timeout: one second a step
        self.peer = DecodePeer(config.bootstrap_steps, config.bootstrap_lost_every, config.transfer_latency_steps,
                               config.prefill_reads_after_failure)
        self._sender_cls = self.peer.sender_class(Q)
        self.counts = dict.fromkeys(COUNTERS, 0)
        # Scheduler.init_disaggregation, prefill branch: max_running_requests * 2 metadata slots
        n_meta = config.max_running_requests * 2
        self.metadata_allocator = P.ReqToMetadataIdxAllocator(n_meta)
        # 0.5.19's Scheduler passes no mask size (MetadataBuffers reads its environment variable)
        mask = ({"max_sampling_mask_tokens": sa.sampling_mask_max_tokens}
                if compat.has("sampling-mask-arg", S.version) else {})
        buffers = P.MetadataBuffers(n_meta, hidden_size=16, hidden_states_dtype=torch.float32, custom_mem_pool=None,
                                    output_dsa_topk_indices_dim=0, **mask,
                                    **({"kv_checksum_enabled": False} if compat.has("kv-checksum", S.version) else {}))
        metrics = SimpleNamespace(enable_metrics=False, report_prefill_stats=lambda **k: None)
        cls = type("PrefillScheduler", (_PrefillScheduler, Q.prefill.SchedulerDisaggregationPrefillMixin), {})
        sched = cls(
            self, tree_cache=o.tree_cache, req_to_token_pool=o.req_to_token_pool,
            token_to_kv_pool_allocator=o.allocator, req_to_metadata_buffer_idx_allocator=self.metadata_allocator,
            disagg_metadata_buffers=buffers, disagg_prefill_inflight_queue=[], disagg_prefill_pending_chunk_rids=set(),
            attn_cp_cpu_group=group.cpu_group, attn_tp_cpu_group=group.cpu_group, enable_overlap=False,
            enable_staging=False, kv_checksum_computer=None, output_streamer=_Streamer(self.target),
            metrics_reporter=metrics, scheduler_stage_metrics=None, spec_algorithm=S.SpeculativeAlgorithm.NONE,
            processed_tokens_counter=0, running_batch=None, last_batch=None,
            # 0.5.20's failure handlers read Scheduler.ps's ranks and enable_hicache_storage (HiCache is off here)
            ps=SimpleNamespace(tp_rank=0, pp_rank=0, pp_size=1), enable_hicache_storage=False,
            # process_batch_result_disagg_prefill's logprob steps (no logprobs are asked for here)
            batch_result_processor=SimpleNamespace(snapshot_auxiliary_output_starts=lambda b, r: None,
                                                   move_logprobs_to_cpu=lambda **k: None))
        sched.disagg_prefill_bootstrap_queue = self._bootstrap_queue(Q, sched, o, buffers, config)
        self.sched, self.bootstrap_queue, self.Q, self.P = sched, sched.disagg_prefill_bootstrap_queue, Q, P
        return o

    def _bootstrap_queue(self, Q, sched, o, buffers, config):
        """``PrefillBootstrapQueue``'s state as its ``__init__`` leaves it, without ``_init_kv_manager`` (which
        registers the KV pool's GPU buffers with the transfer engine): a manager with no state payloads."""
        P = Q.P
        q = object.__new__(Q.prefill.PrefillBootstrapQueue)
        q.__dict__.update(
            token_to_kv_pool=o.allocator.get_kvcache(), draft_token_to_kv_pool=None, is_mla_backend=False,
            metadata_buffers=buffers, req_to_metadata_buffer_idx_allocator=self.metadata_allocator, tp_rank=0,
            pp_rank=0, pp_size=1, gpu_id=0, bootstrap_port=P.get_disagg().disaggregation_bootstrap_port, queue=[],
            scheduler=sched, scheduler_stage_metrics=None, max_total_num_tokens=config.total_tokens,
            max_input_len=config.total_tokens, transfer_backend=P.TransferBackend.FAKE, pp_poll_sync_work_list=[],
            kv_manager=SimpleNamespace(kv_args=SimpleNamespace(state_types=[])), kv_checksum_signature=0)
        return q

    def attach(self) -> None:
        """Counters on SGLang's failure handlers, and the planted fault."""
        sched, mixin = self.sched, self.Q.prefill.SchedulerDisaggregationPrefillMixin
        counts, module = self.counts, self.Q.prefill
        faults = self.target._faults

        def transfer_failed(req):
            counts["prefill_transfers_failed"] += 1
            if "prefill-skip-failed-release" not in faults:
                return mixin.handle_inflight_transfer_failure(sched, req)
            faults.discard("prefill-skip-failed-release")
            real, module.release_kv_cache = module.release_kv_cache, lambda *a, **k: None
            try:
                return mixin.handle_inflight_transfer_failure(sched, req)
            finally:
                module.release_kv_cache = real

        def bootstrap_failed(req):
            counts["prefill_bootstrap_failed"] += 1
            why = getattr(req.disagg_kv_sender, "timed_out", "")
            if why:
                counts[f"prefill_{why}_timeouts"] += 1
            return mixin.handle_bootstrap_failure(sched, req)

        def send_chunk(req, last_chunk=False, end_idx=None):
            counts["prefill_chunks_sent"] += not last_chunk
            return mixin.send_kv_chunk(sched, req, last_chunk, end_idx)

        def requeue(req):
            counts["prefill_optimistic_requeues"] += 1
            counts["prefill_session_turns_requeued"] += getattr(req, "session", None) is not None
            self.target.requeued.add(req.rid)
            return mixin.optimistic_release_and_requeue(sched, req)

        sched.optimistic_release_and_requeue = requeue
        sched.handle_inflight_transfer_failure = transfer_failed
        sched.handle_bootstrap_failure = bootstrap_failed
        sched.send_kv_chunk = send_chunk

    # -- observer -----------------------------------------------------------------------------
    def framework_classes(self, classes: list[type]) -> list[type]:
        return classes + [type(self.metadata_allocator)]

    def install_pool(self, spec: PoolSpec, auditor, wrap) -> bool:
        return install_metadata_pool(spec, auditor)

    # -- driver ------------------------------------------------------------------------------------
    def new_req(self, rid: str, ids, sp):
        """A prefill-side ``Req``; its decode peer is kvaudit's (:class:`DecodePeer`). A health check carries
        ``FAKE_BOOTSTRAP_HOST`` (as the tokenizer's health request does: no decode peer, no radix-cache
        insert), and so does every ``fake_bootstrap_every``-th client request; any other request a decode host."""
        P = self.P
        fake = rid.startswith("HEALTH_CHECK_") or self.target.fake_bootstrap(rid)
        host = P.FAKE_BOOTSTRAP_HOST if fake else DECODE_HOST
        return self.target.S.Req(rid, "", ids, sp, vocab_size=self.target.config.vocab_size, eos_token_ids={EOS},
                                 bootstrap_host=host, bootstrap_port=8998,
                                 bootstrap_room=1000 + self.peer.rooms, disagg_mode=P.DisaggregationMode.PREFILL)

    def session_req(self, session, recv):
        """``Session.create_req`` on a prefill server (``disagg_mode`` PREFILL): the turn's bootstrap fields are
        the decode peer's, as a router sends them with each turn."""
        recv.bootstrap_host, recv.bootstrap_port, recv.bootstrap_room = DECODE_HOST, 8998, 1000 + self.peer.rooms
        cfg = self.target.config
        req = session.create_req(recv, None, cfg.vocab_size, eos_token_ids={EOS},
                                 disagg_mode=self.P.DisaggregationMode.PREFILL)
        self.counts["prefill_session_turns"] += req.to_finish is None
        return req

    def add_request_to_queue(self, req, is_retracted: bool) -> None:
        """``Scheduler._add_request_to_queue``, prefill branch: ``PrefillBootstrapQueue.add``, then kvaudit's
        sender in place of the fake one it made (a health check keeps SGLang's, as on a real server)."""
        self.bootstrap_queue.add(req, 1)
        sender = getattr(req, "disagg_kv_sender", None)
        if sender is not None and req.bootstrap_host != self.P.FAKE_BOOTSTRAP_HOST:
            cfg = self.target.config
            req.disagg_kv_sender = self._sender_cls(sender.kv_mgr, f"{DECODE_HOST}:8998", req.bootstrap_room,
                                                    (cfg.bootstrap_timeout_steps, cfg.waiting_timeout_steps))
        elif sender is None or req.finished():
            self.target.finished.add(req.rid)

    def _release_waiting(self, req) -> None:
        """An aborted waiting request's prefill state: ``release_aborted_prefill_waiting_req``; before change
        ``prefill-waiting-abort`` (0.5.20), ``Scheduler.abort_request``'s own prefill branch: the metadata slot
        freed, the sender aborted only if still bootstrapping, KV released only for a mamba state."""
        if compat.has("prefill-waiting-abort", self.target.S.version):
            self.sched.release_aborted_prefill_waiting_req(req)
            return
        pending = req.pending_bootstrap
        self.Q.prefill.maybe_release_metadata_buffer(req, self.metadata_allocator)
        if pending and getattr(req, "disagg_kv_sender", None) is not None:
            req.disagg_kv_sender.abort()
        if req.kv.holds_mamba:
            self.target._release(req, False)

    def abort(self, rid: str, message: str | None) -> None:
        """``Scheduler.abort_request``, prefill branch (rids match by prefix): the chunked request is marked, a
        waiting one is released (``release_aborted_prefill_waiting_req``), a bootstrapping or inflight one
        has its sender aborted (its queue concludes it at the next poll), an in-batch one gets ``to_finish``."""
        t, sched, S, c = self.target, self.sched, self.target.S, self.counts
        if t.chunked_req is not None and t.chunked_req.rid.startswith(rid):
            t._pending_chunked_abort = t.chunked_req
        for req in [r for r in t.waiting if r.rid.startswith(rid)]:
            t.waiting.remove(req)
            c["prefill_aborts_waiting"] += 1
            t._release_aborted_request(req)
            self._release_waiting(req)
            t.finished.add(req.rid)
        for req in self.bootstrap_queue.queue:
            if req.rid.startswith(rid):
                c["prefill_aborts_bootstrap"] += 1
                t._release_aborted_request(req)
                req.disagg_kv_sender.abort()
        for req in sched.disagg_prefill_inflight_queue:
            if req.rid.startswith(rid):
                c["prefill_aborts_inflight"] += 1
                req.disagg_kv_sender.abort()
        for req in self.inflight([]):
            if req.rid.startswith(rid) and not req.finished():
                req.to_finish = S.FINISH_ABORT() if message is None else S.FINISH_ABORT(message)

    def process_pending_chunked_abort(self) -> None:
        """``Scheduler.process_pending_chunked_abort``, prefill branch: the chunked request's sender is aborted,
        its metadata slot and KV released (``checkpoint=False``)."""
        t, sched = self.target, self.sched
        req, t._pending_chunked_abort = t._pending_chunked_abort, None
        if req is None:
            return
        if t.chunked_req is not req:
            if not req.finished() and req.kv.holds_kv:
                self.abort(req.rid, None)
            return
        self.counts["prefill_aborts_chunked"] += 1
        t.S.prepare_abort(req, "Aborted")
        req.to_finish = None
        sched.clear_pending_chunk_send(req)
        req.disagg_kv_sender.abort()
        self.Q.prefill.maybe_release_metadata_buffer(req, self.metadata_allocator)
        req.pending_bootstrap = False
        t._release_aborted_request(req)
        compat.release_kv(t.S, req, t.tree_cache, False)
        t.chunked_req = None
        t.finished.add(req.rid)

    def transfer_fail(self, handle: int | None) -> None:
        """:class:`TransferFail` on the live requests with a sender: the decode peer fails the room (bootstrap
        queue, waiting, chunked or inflight alike; SGLang concludes it where it is at the next poll)."""
        fake = self.P.FAKE_BOOTSTRAP_HOST
        senders = {r.rid: r.disagg_kv_sender for r in self.active([])
                   if getattr(r, "disagg_kv_sender", None) and r.bootstrap_host != fake}
        pending = [rid for rid in self.target.live_rids() if rid in senders]
        for rid in pending if handle is None else [pending[handle % len(pending)]] if pending else []:
            senders[rid].conclude_state = self.P.KVPoll.Failed

    def step(self) -> None:
        """One iteration of ``event_loop_normal_disagg_prefill``: ``pop_bootstrapped`` into the waiting queue,
        ``get_next_disagg_prefill_batch_to_run`` (pending chunked abort, ``resolve_waiting_queue_bootstrap``,
        ``process_prefill_chunk``, the shared driver's ``get_new_batch_prefill``), the batch's result
        (``process_batch_result_disagg_prefill``), then ``process_disagg_prefill_inflight_queue``."""
        t, sched = self.target, self.sched
        t.steps += 1
        t.clock.now += 1.0
        self.peer.tick()
        if t.session_controller is not None:  # process_input_requests
            t.session_controller.maybe_reap(float(t.steps), interval=0.0)
        t._check_pending_flush()
        if t.scheduler_paused:
            return
        t.waiting.extend(self.bootstrap_queue.pop_bootstrapped())
        self.process_pending_chunked_abort()
        sched.resolve_waiting_queue_bootstrap()
        # (last_batch=None: its filter only trims the batch a decode step would merge; prefill merges none, and its
        # running batch stays empty: only its batch_is_full flag is read)
        sched.process_prefill_chunk(last_batch=None, running_batch=SimpleNamespace(batch_is_full=False))
        self._batch = None
        planned = t._prefill()
        batch = self._batch if planned is not None else None
        if batch is not None:
            ids = torch.tensor([t._sample(r) for r in batch.reqs], dtype=torch.int64)
            result = SimpleNamespace(logits_output=None, next_token_ids=ids, extend_input_len_per_req=None,
                                     extend_logprob_start_len_per_req=None, copy_done=None,
                                     auxiliary_host_output=None, routed_experts_output=None,
                                     indexer_topk_output=None, next_draft_input=None, can_run_cuda_graph=False)
            sched.process_batch_result_disagg_prefill(batch, result)
        for req in sched.process_disagg_prefill_inflight_queue():
            self.counts["prefill_transfers_done"] += not isinstance(req.finished_reason, t.S.FINISH_ABORT) \
                and req.disagg_kv_sender.conclude_state == self.P.KVPoll.Success
            t.finished.add(req.rid)
        sched.last_batch = self._last_batch = batch

    def new_batch(self, batch, kind: str) -> None:
        if kind == "extend":
            self._batch = batch

    def pause_retract(self) -> None:
        """``pause_generation(mode="retract")`` on a prefill server: nothing runs between steps (every batch's
        result is processed in its step, the running batch is empty and a prefill last batch is not merged: its
        requests are in the inflight queue), the chunked request is kept (SGLang keeps a live mid-chunk
        ``chunked_req`` in disagg prefill); ``last_batch`` is dropped."""
        self.sched.last_batch = self._last_batch = None

    # -- observer: requests ------------------------------------------------------------------------
    def inflight(self, reqs: list) -> list:
        """``collect_inflight_reqs``: the last batch's requests (prefill's running batch stays empty)."""
        last = getattr(self, "_last_batch", None)
        return list(last.reqs) if last is not None else []

    def place_groups(self, groups: tuple) -> tuple:
        chunked = [self.target.chunked_req] if self.target.chunked_req is not None else []
        return (("bootstrap", list(self.bootstrap_queue.queue)), ("chunked", chunked),
                ("waiting", list(self.target.waiting)), ("inflight", list(self.sched.disagg_prefill_inflight_queue)))

    def roots(self, out: list, aborting: bool) -> list:
        """Also each metadata slot's holder, and the source pages of each chunk on the wire (shared: the
        request's own root names them too while it holds them)."""
        wire = [Root("token_to_kv_pool", f"transfer:room{room}", pages, private=False, role="transfer",
                     where="wire") for room, pages in self.peer.reading()]
        return out + wire + metadata_roots([(r.rid, r.metadata_buffer_index) for r in self.active([])])

    def is_idle(self, idle: bool, ignore_waiting: bool) -> bool:
        """``is_fully_idle`` on a prefill server: also the inflight and bootstrap queues empty."""
        return idle and not self.sched.disagg_prefill_inflight_queue and not self.bootstrap_queue.queue

    def stalled(self, stalled: bool) -> bool:
        return False

    def stuck(self, out: str) -> str:
        """``inflight:kv-transfer``, ``chunked:prefill``, ``waiting:memory`` or ``bootstrap:handshake``."""
        if self.sched.disagg_prefill_inflight_queue:
            return "inflight:kv-transfer"
        if self.target.chunked_req is not None:
            return "chunked:prefill"
        if self.target.waiting:
            return "waiting:memory"
        return "bootstrap:handshake" if self.bootstrap_queue.queue else out

    def describe_busy(self, out: str) -> str:
        return (f"bootstrap={len(self.bootstrap_queue.queue)} waiting={len(self.target.waiting)} "
                f"chunked={int(self.target.chunked_req is not None)} "
                f"inflight={len(self.sched.disagg_prefill_inflight_queue)} "
                f"available={self.target.allocator.available_size()}")

    def reach(self, out: dict[str, int]) -> dict[str, int]:
        """The prefill path's counters; the chunk ones only under chunked prefill (none are sent without it).
        The shared driver's ``retractions``, ``sglang_result_batches`` and ``aborts_processed`` are left out: a
        prefill server never decodes, and its results go through SGLang's ``process_batch_result_disagg_prefill``,
        not the batch result processor those count (so the output-after-abort check has nothing to see here)."""
        cfg = self.target.config
        off = {"chunk": cfg.chunked_prefill_size is None, "optimistic": not cfg.optimistic_prefill_attempts,
               "session": not cfg.enable_streaming_session,
               "session_turns_requeued": not (cfg.enable_streaming_session and cfg.optimistic_prefill_attempts)}
        shared = {k: v for k, v in out.items() if k not in ("retractions", "sglang_result_batches", "aborts_processed")}
        return {**shared, **{k: v for k, v in self.counts.items() if not any(o and w in k for w, o in off.items())}}
