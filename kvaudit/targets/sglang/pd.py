"""PD disaggregation, decode side, on SGLang 0.5.23 (``disaggregation_mode="decode"``): SGLang's own
``DecodePreallocQueue``, ``DecodeTransferQueue`` and decode-mode scheduler methods, driven by a
second driver (:class:`PdDecode`); kvaudit plays the prefill server, the wire and the
KV checksum (:mod:`~kvaudit.targets.sglang.pd_transfer`).

Design notes: docs/internals/sglang.md ("PD decode")."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from kvaudit.targets.base import PoolSpec
from kvaudit.targets.sglang import compat
from kvaudit.targets.sglang.boot import INSTALL_HINT, SglangUnavailable, build, imported, load, one_rank_group
from kvaudit.targets.sglang.config import SglangConfig
from kvaudit.targets.sglang.pd_checksum import ChecksumWatch
from kvaudit.targets.sglang.pd_transfer import (KvChecksums, Network, PdServer, abort_decode_queues, decode_groups,
                                                 decode_stuck, fake_backend, install_metadata_pool, metadata_roots)
from kvaudit.targets.sglang.standins import EOS

_PD = None
PREFILL_HOST = "127.0.0.1"  # the bootstrap host of a decode-radix-cache preset's requests (kvaudit plays prefill)


def load_pd() -> SimpleNamespace:
    """Import SGLang's PD decode path once. Raises :class:`SglangUnavailable` when a module does not
    import (``einops`` missing: the message says how to install it)."""
    global _PD
    if _PD is not None:
        return _PD
    load()
    _PD = imported(_pd_symbols, lambda exc: f"SGLang's PD decode path does not import: {exc} "
                   f"({INSTALL_HINT})")
    return _PD


def _pd_symbols() -> dict:
    """SGLang's PD decode symbols the target uses, by name."""
    import sglang.srt.disaggregation.decode as decode
    from sglang.srt.arg_groups.pd_disaggregation_hook import handle_pd_disaggregation
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.common.conn import CommonKVManager, CommonKVReceiver
    from sglang.srt.disaggregation.fake.conn import FakeKVManager, FakeKVReceiver
    from sglang.srt.disaggregation.utils import (FAKE_BOOTSTRAP_HOST, DisaggregationMode, MetadataBuffers,
                                                 ReqToMetadataIdxAllocator, TransferBackend)
    from sglang.srt.managers.overlap_utils import FutureMap
    from sglang.srt.managers.scheduler_components.batch_result_processor import SchedulerBatchResultProcessor
    from sglang.srt.runtime_context import get_disagg, get_memory, publish
    from sglang.utils import is_in_ci
    return locals()


def publish_scheduler(P, server_args) -> None:
    """``runtime_context.publish`` of a scheduler process: rank 0 of one GPU (``SpawnRanks``); before change
    ``publish-ranks`` (0.5.20) ``publish`` takes no ranks (they are read from the groups, overridden by
    ``boot.build``)."""
    if compat.has("publish-ranks", load().version):
        from sglang.srt.runtime_context import SpawnRanks
        P.publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=0, gpu_id=0))
    else:
        P.publish(server_args, role="scheduler")


class _DecodeScheduler:
    """The ``Scheduler`` state SGLang's decode-mode methods read, under the scheduler's own names, with
    ``SchedulerDisaggregationDecodeMixin`` mixed in (:func:`_scheduler_class`)."""

    def __init__(self, pd, **attrs):
        self.__dict__.update(attrs)
        self._pd, self._target = pd, pd.target

    def update_running_batch(self, batch):
        return self._pd.update_running_batch(batch)

    def _add_request_to_queue(self, req, is_retracted: bool = False) -> None:
        """``Scheduler._add_request_to_queue``, decode branch: the prealloc queue."""
        self.disagg_decode_prealloc_queue.add(req, is_retracted=is_retracted)
        self._pd.swap_receiver(req)

    def retire_unadmitted_request(self, req) -> None:
        """``Scheduler.retire_unadmitted_request``: a request rejected at intake."""
        self._target._release_aborted_request(req)
        self._target.finished.add(req.rid)


def _server_args(S, P, config: SglangConfig):
    """The decode server's ``ServerArgs``, resolved by ``handle_pd_disaggregation`` (which turns the decode radix
    cache off, or on with ``decode_radix_cache``: SGLang refuses it with the fake backend, so the args then name a
    real one; the queues keep kvaudit's wire). The KV checksum is on for both releases: kvaudit's transfer
    stand-in plays 0.5.22's and 0.5.23's digests (``pd_transfer.Network.land``; compat change
    kv-checksum-signature)."""
    radix = config.decode_radix_cache
    sa = S.ServerArgs(model_path="dummy", page_size=config.page_size, disaggregation_mode="decode",
                      disaggregation_transfer_backend="nixl" if radix else "fake",
                      disaggregation_decode_enable_radix_cache=radix,
                      disaggregation_decode_retraction_backup="cpu_tensor", disaggregation_enable_kv_checksum=True,
                      max_running_requests=config.max_running_requests,
                      num_reserved_decode_tokens=config.num_reserved_decode_tokens)
    P.handle_pd_disaggregation(sa)
    return sa


def _scheduler_class(P):
    return type("DecodeScheduler", (_DecodeScheduler, P.decode.SchedulerDisaggregationDecodeMixin), {})


class _Streamer:
    """``output_streamer``: what the decode server streams to the client (memory-free)."""

    def stream_output(self, reqs, return_logprob=False, *a, **k) -> None:
        pass


def _result_processor(P, o, metrics, streamer):
    """The decode server's ``SchedulerBatchResultProcessor`` over ``o``'s pools and tree (what its prebuilt
    batches' results go through)."""
    return P.SchedulerBatchResultProcessor(
        is_generation=True, disaggregation_mode=P.DisaggregationMode.DECODE, enable_overlap=False,
        enable_overlap_mlx=False, model_config=o.model_config, token_to_kv_pool_allocator=o.allocator,
        tree_cache=o.tree_cache, hisparse_coordinator=None, req_to_token_pool=o.req_to_token_pool,
        decode_offload_manager=None, metrics_collector=None, metrics_reporter=metrics, draft_worker=None,
        model_worker=None, logprob_result_processor=None, output_streamer=streamer, beam_coordinator=None,
        abort_request=None)


class PdDecode(PdServer):
    """The decode server of PD disaggregation, a second driver. A third pool, ``metadata_buffers``: the
    ``ReqToMetadataIdxAllocator`` slots (slot ``i`` is unit ``i + 1``) a request holds from
    pre-allocation until its transfer is committed or its release is done."""

    name = "pd-decode"
    transfers_failed = 0  # reach()'s: transfers a TransferFail op failed (counted per instance from 0)

    def build(self, config: SglangConfig):
        S, P = load(), load_pd()
        # the queues all-reduce their polls over the attention-TP CPU group (poll_and_all_reduce)
        group = SimpleNamespace(cpu_group=one_rank_group(), world_size=1)
        sa = _server_args(S, P, config)
        publish_scheduler(P, sa)
        S.get_parallel().override_permanently(attn_tp_group=group)
        disagg = P.get_disagg()
        tp_worker = SimpleNamespace(is_hybrid_swa=False, model_runner=SimpleNamespace(kv_cache_dtype_str="bfloat16"),
                                    register_hicache_layer_transfer_counter=lambda *a: None)

        def rows(device):  # kv_cache_configurator: max_running_requests rows, plus the pre-allocation rows
            return P.decode.DecodeReqToTokenPool(size=config.max_running_requests,
                                                 max_context_len=config.context_len + 8, device=device,
                                                 enable_memory_saver=False,
                                                 pre_alloc_size=disagg.disaggregation_decode_extra_slots)

        o = build(config, server_args=sa, make_rows=rows, disable_radix_cache=P.get_memory().disable_radix_cache,
                  tp_worker=tp_worker)
        r2t, alloc, tree = o.req_to_token_pool, o.allocator, o.tree_cache
        # Scheduler.init_disaggregation, decode branch
        n_meta = r2t.size * 2
        self.metadata_allocator = P.ReqToMetadataIdxAllocator(n_meta)
        buffers = P.MetadataBuffers(n_meta, hidden_size=16, hidden_states_dtype=torch.float32,
                                    max_sampling_mask_tokens=sa.sampling_mask_max_tokens, custom_mem_pool=None,
                                    output_dsa_topk_indices_dim=0,
                                    kv_checksum_enabled=disagg.disaggregation_enable_kv_checksum)
        self.network = Network(config.transfer_latency_steps, config.abort_ack_steps,
                                config.kv_checksum_mismatch_every, config.page_size)
        self.target.clock.install(P.decode)
        manager_cls, self._receiver_cls = fake_backend(P, self.network)
        streamer = _Streamer()
        metrics = SimpleNamespace(enable_metrics=False, current_scheduler_metrics_enabled=False, num_retracted_reqs=0)
        sched = _scheduler_class(P)(
            self, spec_algorithm=S.SpeculativeAlgorithm.NONE, server_args=sa, enable_hisparse=False, random_seed=0,
            tp_worker=tp_worker, model_config=o.model_config, running_batch=S.ScheduleBatch(reqs=[], batch_is_full=False),
            waiting_queue=[], last_batch=None, enable_priority_scheduling=False, enable_lora=False,
            enable_decode_hicache=False, output_streamer=streamer, metrics_reporter=metrics,
            scheduler_stage_metrics=None, req_to_token_pool=r2t, token_to_kv_pool_allocator=alloc, tree_cache=tree,
            max_running_requests=config.max_running_requests, enable_overlap=False, chunked_req=None,
            grammar_manager=SimpleNamespace(has_waiting_grammars=lambda: False),
            ngram_embedding_manager=SimpleNamespace(prepare_for_forward=lambda b, chunked_req=None: b),
            future_map=P.FutureMap(config.device, S.SpeculativeAlgorithm.NONE, r2t),
            dp_attn_adapter=SimpleNamespace(maybe_prepare_mlp_sync_batch=lambda b: b), forward_ct=0,
            attn_tp_cpu_group=group.cpu_group, kv_checksum_computer=None, disagg_decode_prealloc_queue=None)
        sched.batch_result_processor = _result_processor(P, o, metrics, streamer)
        tq = P.decode.DecodeTransferQueue(req_to_metadata_buffer_idx_allocator=self.metadata_allocator,
                                          metadata_buffers=buffers, scheduler=sched, tree_cache=tree)
        # the two environment switches the queue read at construction
        tq.enable_deferred_kv_release = config.deferred_kv_release
        tq.deferred_kv_release_timeout = float(config.deferred_release_timeout_steps)
        # its __init__ builds scheduler.kv_checksum_computer: kvaudit's stand-in in place of the CUDA one
        real_computer, P.decode.KvChecksumComputer = P.decode.KvChecksumComputer, KvChecksums
        try:
            pq = P.decode.DecodePreallocQueue(
                req_to_token_pool=r2t, token_to_kv_pool_allocator=alloc, draft_token_to_kv_pool=None,
                req_to_metadata_buffer_idx_allocator=self.metadata_allocator, metadata_buffers=buffers,
                scheduler=sched, transfer_queue=tq, tree_cache=tree, gpu_id=0,
                bootstrap_port=disagg.disaggregation_bootstrap_port, max_total_num_tokens=config.total_tokens,
                num_reserved_decode_tokens=disagg.num_reserved_decode_tokens, transfer_backend=P.TransferBackend.FAKE)
        finally:
            P.decode.KvChecksumComputer = real_computer
        pq.kv_manager = manager_cls(pq.kv_manager.kv_args, P.DisaggregationMode.DECODE, sa, False)
        # one prefill rank, known from the start: a real-host request's receiver is initialised at once
        pq.kv_manager.prefill_info_table = {f"{PREFILL_HOST}:8998": SimpleNamespace(dp_size=1)}
        self.network.checksums, self.network.metadata_buffers = sched.kv_checksum_computer, buffers
        sched.kv_checksum_computer.kv = alloc.get_kvcache()
        self.watch = ChecksumWatch(sched, self.network, r2t.req_to_token, config.page_size)
        # prefill's layout is this decode's (0.5.22 has no signature: compat change kv-checksum-signature)
        self.network.signature = pq.kv_checksum_signature if compat.has("kv-checksum-signature", S.version) else 0
        # kvaudit's corruption is injected, as SGLANG_TEST_DISAGG_KV_CHECKSUM_MISMATCH_PROB's: no CI raise
        P.decode.is_in_ci = P.is_in_ci if config.kv_checksum_mismatch_every is None else (lambda: False)
        sched.disagg_decode_transfer_queue, sched.disagg_decode_prealloc_queue = tq, pq
        self.sched, self.prealloc_queue, self.transfer_queue, self.P = sched, pq, tq, P
        return o

    # -- observer -----------------------------------------------------------------------------
    def framework_classes(self, classes: list[type]) -> list[type]:
        """``DecodeReqToTokenPool`` and ``ReqToMetadataIdxAllocator`` share modules with engine code: only
        their own methods are allocator frames."""
        return classes + [type(self.target.req_to_token_pool), type(self.metadata_allocator)]

    def install_pool(self, spec: PoolSpec, auditor, wrap) -> bool:
        """``DecodeReqToTokenPool`` takes and gives back rows through ``alloc(reqs)`` / ``free(req)``, the
        metadata allocator through ``alloc() -> int | None`` / ``free(int)``."""
        if install_metadata_pool(spec, auditor):
            return True
        obj, pool = spec.obj, spec.name
        if spec.kind != "rows":
            return False
        auditor.wrap_clear(spec)
        orig_alloc, orig_free = obj.alloc, obj.free

        def alloc(reqs, *a, **k):
            held = {id(r) for r in reqs if r.kv.holds_kv}
            out = orig_alloc(reqs, *a, **k)
            if out is not None:
                new = [r.kv.req_pool_idx for r in reqs if id(r) not in held]
                if new:
                    auditor.on_alloc(pool, new, auditor.capture_site())
            return out

        def free(req, *a, **k):
            row = req.kv.req_pool_idx
            orig_free(req, *a, **k)
            auditor.on_free(pool, [row], auditor.capture_site())

        auditor._wrap(obj, "alloc", alloc)
        auditor._wrap(obj, "free", free)
        return True

    # -- driver ------------------------------------------------------------------------------------
    def new_req(self, rid: str, ids, sp):
        """A decode-side ``Req``, its prefill reached through the fake transfer backend."""
        P = self.P
        self._rooms = getattr(self, "_rooms", 0) + 1
        # a health check is a fake-transfer request on every server (http_server's health_generate sets the host)
        real = self.target.config.decode_radix_cache and not rid.startswith("HEALTH_CHECK_")
        host = PREFILL_HOST if real else P.FAKE_BOOTSTRAP_HOST
        return self.target.S.Req(rid, "", ids, sp, vocab_size=self.target.config.vocab_size, eos_token_ids={EOS},
                          bootstrap_host=host, bootstrap_port=8998, bootstrap_room=1000 + self._rooms,
                          disagg_mode=P.DisaggregationMode.DECODE)

    def add_request_to_queue(self, req, is_retracted: bool) -> None:
        self.sched._add_request_to_queue(req, is_retracted=is_retracted)

    def swap_receiver(self, req) -> None:
        """Replace the fake receiver ``DecodePreallocQueue.add`` made for ``req`` by kvaudit's (latency,
        aborts); a health check keeps SGLang's, as on a real server."""
        if req.rid.startswith("HEALTH_CHECK_"):
            return
        for dr in self.prealloc_queue.queue:
            if dr.req is req and not isinstance(dr.kv_receiver, self._receiver_cls):
                rx = self._receiver_cls(self.prealloc_queue.kv_manager, "kvaudit-prefill", req.bootstrap_room)
                rx.bootstrap_done = dr.kv_receiver.bootstrap_done
                if not self.P.decode._is_fake_transfer(req):  # prefill samples it: SGLang's deterministic token
                    rx.handoff = self.P.decode._generate_fake_prefill_handoff_output_id(req)
                # prefill digests its prompt's KV; a re-bootstrap's prompt is the request's prompt and outputs
                # (the prefill request's origin_input_ids; decode verifies its own origin_input_ids only)
                rx.prompt_len = len(req.origin_input_ids) + (
                    len(req.output_ids) if getattr(req, "pd_rebootstrap_in_progress", False) else 0)
                dr.kv_receiver = rx

    def abort(self, rid: str, message: str | None) -> None:
        """``Scheduler.abort_request``, decode branch (rids match by prefix): a waiting request is released at
        once, a queued one has its receiver aborted, a retracted one drops its backup, a running one gets
        ``to_finish``."""
        sched, t = self.sched, self.target
        S = t.S
        for req in [r for r in sched.waiting_queue if r.rid.startswith(rid)]:
            sched.waiting_queue.remove(req)
            t._release_aborted_request(req)
            if req.finished_reason is None:
                req.finished_reason = S.FINISH_ABORT()
            t._release(req, checkpoint=True)

        def drop_backup(req):
            S.common.discard_kv_cache_backup(req, t.tree_cache, "cpu_tensor")
            t.finished.add(req.rid)

        abort_decode_queues(self.prealloc_queue, self.transfer_queue, sched.running_batch.reqs, rid, drop_backup,
                            S.FINISH_ABORT)

    def transfer_fail(self, handle: int | None) -> None:
        """:class:`TransferFail` on the live requests not yet running: a queued receiver concludes
        ``KVPoll.Failed``; a transferred request waiting to join gets a wrong expected KV checksum (an
        injection: SGLang's ``is_in_ci`` raise is off from then on)."""
        receivers = {dr.req.rid: dr.kv_receiver for dr in self.prealloc_queue.queue + self.transfer_queue.queue}
        waiting = {r.rid: r for r in self.sched.waiting_queue if getattr(r, "expected_kv_checksum", 0)}
        pending = [rid for rid in self.target.live_rids() if (rid in receivers or rid in waiting)
                   and not rid.startswith("HEALTH_CHECK_")]
        for rid in pending if handle is None else [pending[handle % len(pending)]] if pending else []:
            self.transfers_failed += 1
            if rid in receivers:
                receivers[rid].conclude_state = self.P.KVPoll.Failed
            else:
                waiting[rid].expected_kv_checksum ^= 2  # digests are odd: still non-zero, now wrong
                self.P.decode.is_in_ci = lambda: False

    def step(self) -> None:
        """One iteration of ``event_loop_normal_disagg_decode``: the network moves, ``process_decode_queue``,
        ``get_next_disagg_decode_batch_to_run``, and the decode batch's result."""
        t, sched = self.target, self.sched
        t.steps += 1
        t.clock.now += 1.0
        self.network.tick()
        t._check_pending_flush()
        if t.scheduler_paused:  # the loop ingests, then skips everything while paused
            t._snapshot_held()
            return
        sched.process_decode_queue()
        plan = sched.get_next_disagg_decode_batch_to_run(running_batch=sched.running_batch)
        sched.running_batch = plan.running_batch
        batch = plan.batch_to_run
        t.running = [r for r in sched.running_batch.reqs if not r.finished()]
        if batch is not None:
            t._process("decode", list(batch.reqs))  # ends by filtering t.running of what finished
        sched.last_batch = batch
        sched.forward_ct += 1
        t._snapshot_held()

    def pause_retract(self) -> None:
        """``pause_generation(mode="retract")`` on a decode server: ``retract_all(..., offload_kv=False)``,
        each request held for re-bootstrap (``hold_rebootstrap``) until ``continue_generation``."""
        sched = self.sched
        reqs = [r for r in sched.running_batch.reqs if not r.finished()]
        staged = [r for r in sched.waiting_queue if r.kv.holds_kv]
        sched.waiting_queue = [r for r in sched.waiting_queue if not r.kv.holds_kv]
        reqs += staged
        sched.last_batch = None
        self.target._retract_all(reqs)
        sched.running_batch.reqs = []
        self.target.running = []
        for req in reqs:
            if req.output_ids:
                req.pd_rebootstrap_forced_output_id = req.output_ids.pop()
            req.pd_rebootstrap_in_progress = True
            self.prealloc_queue.hold_rebootstrap(req)

    def continue_generation(self) -> None:
        """``enqueue_held_rebootstrap`` (with kvaudit's receivers), before the shared resume."""
        held = list(self.prealloc_queue.held_rebootstrap_reqs)
        self.prealloc_queue.enqueue_held_rebootstrap()
        for req in held:
            self.swap_receiver(req)

    def update_running_batch(self, batch):
        """``Scheduler.update_running_batch`` (no overlap), decode mode: a retracted request's KV is backed up
        (``cpu_tensor``) for ``resume_retracted_reqs``."""
        batch.filter_batch()
        if batch.is_empty():
            batch.batch_is_full = False
            return batch
        full = not batch.check_decode_mem()
        t = self.target
        if full or t._force_retract:
            t._force_retract = False
            retracted, _, aborted = batch.retract_decode()
            t.retractions += len(retracted) + len(aborted)
            for req in retracted:
                self.sched._add_request_to_queue(req, is_retracted=True)
            for req in aborted:
                t.finished.add(req.rid)
        if batch.is_empty():
            return batch
        batch.prepare_for_decode()
        self.network.decoded(batch)
        return batch

    def inflight(self, reqs: list) -> list:
        return [r for r in self.sched.running_batch.reqs]

    def place_groups(self, groups: tuple) -> tuple:
        tq = self.transfer_queue
        return decode_groups(self.prealloc_queue, tq, self.sched, tq._deferred_releases)

    def roots(self, out: list, aborting: bool) -> list:
        """Also each metadata slot's holder (a decode request before its commit, or a deferred release)."""
        held = [(dr.req.rid, dr.metadata_buffer_index) for dr in self.prealloc_queue.queue + self.transfer_queue.queue]
        held += [(e[0].req.rid, e[3]) for e in self.transfer_queue._deferred_releases]
        return out + metadata_roots(held)

    def invariant_findings(self, out: list) -> list:
        """A request the KV checksum aborted while its KV was intact (:class:`ChecksumWatch`), since the last
        check (the first of them: one bug per check), reported once."""
        out, self.watch.findings = out + self.watch.findings[:1], []
        return out

    def reach(self, out: dict[str, int]) -> dict[str, int]:
        """The checksum's verifications and re-verifications (:meth:`ChecksumWatch.reach`), retractions, the
        transfers that landed (``Network.land``) and those a ``TransferFail`` op failed (:meth:`transfer_fail`:
        a receiver concluded ``KVPoll.Failed``, or a landed transfer's expected checksum made wrong)."""
        out["pd_decode_retractions"], out["pd_transfers_landed"] = self.target.retractions, self.network.landed
        out["pd_transfers_failed"] = self.transfers_failed
        if self.target.config.decode_radix_cache:  # transfers of a prompt's tail past decode's own cached prefix
            out["pd_decode_prefix_hits"] = self.network.prefix_hits
        return self.watch.reach(out)

    def is_idle(self, idle: bool, ignore_waiting: bool) -> bool:
        """``is_fully_idle`` on a decode server: every queue empty and no release deferred."""
        return not any(group for _, group in self.place_groups(()))

    def is_idle_for_health_check(self, idle: bool) -> bool:
        """``is_fully_idle(for_health_check=True)``: the prealloc and transfer queues and deferred releases
        do not count."""
        s = self.sched
        return (not s.running_batch.reqs and (s.last_batch is None or s.last_batch.is_empty())
                and not s.waiting_queue and not self.prealloc_queue.retracted_queue)

    def stalled(self, stalled: bool) -> bool:
        return False

    def stuck(self, out: str) -> str:
        """:func:`~kvaudit.targets.sglang.pd_transfer.decode_stuck`, deferred releases included."""
        tq = self.transfer_queue
        return decode_stuck(self.prealloc_queue, tq, self.sched, self.target.req_to_token_pool.available_size(),
                            tq._deferred_releases)

    def describe_busy(self, out: str) -> str:
        pq, tq = self.prealloc_queue, self.transfer_queue
        return (f"prealloc={len(pq.queue)} transfer={len(tq.queue)} deferred={len(tq._deferred_releases)} "
                f"retracted={len(pq.retracted_queue)} waiting={len(self.sched.waiting_queue)} "
                f"running={len(self.sched.running_batch.reqs)} available={self.target.allocator.available_size()}")
