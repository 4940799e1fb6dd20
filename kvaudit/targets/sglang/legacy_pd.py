"""PD decode with HiSparse in the legacy era (SGLang 0.5.10.post1 and 0.5.11): the decode server's
``DecodePreallocQueue``, ``DecodeTransferQueue`` and decode-mode scheduler methods
(``SchedulerDisaggregationDecodeMixin``), the prebuilt batch's result processing
(``SchedulerOutputProcessorMixin.process_batch_result_prebuilt``, where SGLang #22882 lives), and the
era's HiSparse allocator, device pool and ``HiSparseCoordinator`` on its direct-to-host path; kvaudit
plays the prefill server through SGLang's own ``fake`` transfer backend (every transfer lands at once).

Why this is not :mod:`~kvaudit.targets.sglang.pd` + :mod:`~kvaudit.targets.sglang.hisparse` through the
seam, and what it shares: docs/internals/sglang.md ("The legacy era: PD decode with HiSparse")."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from kvaudit.targets.base import Accounting, PoolSpec, Root, slot_pages
from kvaudit.targets.sglang.boot import SglangUnavailable, imported, one_rank_group, torch_paged_kernels
from kvaudit.targets.sglang.hooks import SglangHooks, host_units, install_free_set
from kvaudit.targets.sglang.legacy import SglangLegacyTarget
from kvaudit.targets.sglang.pd_transfer import (abort_decode_queues, decode_groups, decode_stuck, install_metadata_pool,
                                                 metadata_pool, metadata_roots)
from kvaudit.targets.sglang.standins import EOS

INDEX_HEAD_DIM = 128  # NSATokenToKVPool's indexer buffer is laid out for 128-wide index heads
KV_LORA_RANK, ROPE_DIM = 8, 8  # the MLA latent and rope widths (kv_cache_dim = their sum)


_LOADED: SimpleNamespace | None = None


def load_pd_hisparse(S) -> SimpleNamespace:
    """Import the era's PD decode and HiSparse modules once, and install the one module shim (L2).
    Raises :class:`SglangUnavailable` when one does not import."""
    global _LOADED
    if _LOADED is not None:
        return _LOADED
    P = imported(_pd_hisparse_symbols, lambda exc: f"SGLang {S.version}'s PD decode / HiSparse modules do not "
                 f"import: {exc}")
    _shim_host_alloc(P.memory_pool_host)
    import sglang.srt.mem_cache.allocator as allocator
    _shim_paged_kernels(allocator)
    _LOADED = P
    return _LOADED


def _pd_hisparse_symbols() -> dict:
    """The era's PD decode and HiSparse symbols the target uses, by name."""
    import sglang.srt.disaggregation.decode as decode
    import sglang.srt.managers.hisparse_coordinator as hc
    import sglang.srt.mem_cache.memory_pool_host as memory_pool_host
    from sglang.srt.disaggregation.utils import (FAKE_BOOTSTRAP_HOST, DisaggregationMode, MetadataBuffers,
                                                 ReqToMetadataIdxAllocator, TransferBackend)
    from sglang.srt.managers.overlap_utils import FutureMap
    from sglang.srt.managers.scheduler_output_processor_mixin import SchedulerOutputProcessorMixin as OutputMixin
    from sglang.srt.mem_cache.chunk_cache import ChunkCache
    from sglang.srt.mem_cache.hisparse_memory_pool import HiSparseNSATokenToKVPool, HiSparseTokenToKVPoolAllocator
    return locals()


def _shim_host_alloc(memory_pool_host) -> str:
    """CPU shim L2: the host pool's buffers are allocated unpinned (``ALLOC_MEMORY_FUNCS['cpu']``; the
    default ``alloc_with_host_register`` calls ``cudaHostRegister``)."""

    def unpinned(dims, dtype, device, pin_memory, allocator):
        return allocator.allocate(dims, dtype=dtype, device=device)

    memory_pool_host.ALLOC_MEMORY_FUNCS["cpu"] = unpinned
    return "L2 memory_pool_host.ALLOC_MEMORY_FUNCS['cpu'] -> unpinned"


def _shim_paged_kernels(allocator) -> str:
    """CPU shim L4: ``PagedTokenToKVPoolAllocator``'s two triton kernels of this era, module globals of
    ``mem_cache/allocator.py``, by torch (:func:`~kvaudit.targets.sglang.boot.torch_paged_kernels`; 0.5.23 ships
    a CPU path; 0.5.10 does not)."""
    torch_paged_kernels(allocator)
    return "L4 allocator.alloc_extend_kernel / alloc_decode_kernel -> torch"


def _shim_attn_tp(group) -> str:
    """CPU shim L3: the attention tensor-parallel group of one rank (``parallel_state._ATTN_TP``, which a
    ``ModelRunner`` builds; the prealloc queue asks its size)."""
    import sglang.srt.distributed.parallel_state as parallel_state

    if parallel_state._ATTN_TP is None:
        parallel_state._ATTN_TP = SimpleNamespace(world_size=1, rank_in_group=0, cpu_group=group,
                                                  device_group=group)
    return "L3 parallel_state._ATTN_TP -> one rank"


def _load_to_device(host):
    """CPU stand-in for the host pool's ``load_to_device_per_layer`` kernel (``io_backend='kernel'``):
    the same copy, host slots into device slots, of one layer."""

    def load(device_pool, host_indices, device_indices, layer_id, io_backend, **kw):
        device_pool.kv_buffer[layer_id][device_indices] = host.kv_buffer[layer_id][host_indices.cpu()].to(
            device_pool.kv_buffer[layer_id].device)

    return load


class _DecodeScheduler:
    """The ``Scheduler`` state the era's decode-mode methods read, under the scheduler's own names, with
    ``SchedulerDisaggregationDecodeMixin`` and ``SchedulerOutputProcessorMixin`` mixed in."""

    def __init__(self, target, **attrs):
        self.__dict__.update(attrs)
        self._target = target

    def update_running_batch(self, batch):
        return self._target._update_running_batch(batch)

    def maybe_prepare_mlp_sync_batch(self, batch, *a, **k):
        return batch  # (no data-parallel attention)

    def stream_output(self, reqs, return_logprob=False, *a, **k) -> None:
        """``output_streamer``: what the server streams to the client (memory-free)."""

    def _add_request_to_queue(self, req, is_retracted: bool = False) -> None:
        """``Scheduler._add_request_to_queue``, decode branch: the prealloc queue."""
        self.disagg_decode_prealloc_queue.add(req, is_retracted=is_retracted)


def _scheduler_class(P):
    return type("LegacyDecodeScheduler", (_DecodeScheduler, P.decode.SchedulerDisaggregationDecodeMixin,
                                          P.OutputMixin), {})


class SglangLegacyPdHiSparseTarget(SglangLegacyTarget):
    """A PD decode server with HiSparse on the era's objects. Pools: the logical KV pool
    (``token_to_kv_pool``, 64-token pages), the rows, the metadata slots, HiSparse's physical device pool
    (pages) and its host pool (page 1)."""

    request_kv_allocs = SglangLegacyTarget.request_kv_allocs + ("alloc_logical_only", "alloc_device_buffer",
                                                                "_pre_alloc")

    def __init__(self, config):
        super().__init__(config)
        self._build_queues(config)
        ps, a, host = config.page_size, self.allocator, self.coordinator.mem_pool_host
        self._pools = [
            PoolSpec("token_to_kv_pool", a.logical_attn_allocator, "pages", ps, a.logical_attn_allocator.size // ps),
            PoolSpec("req_to_token_pool", self.req_to_token_pool, "rows", 1, self.req_to_token_pool.size
                     + self.req_to_token_pool.pre_alloc_size),
            metadata_pool(self.metadata_allocator),
            PoolSpec("hisparse_device_pool", a.hisparse_attn_allocator, "pages", ps,
                     a.hisparse_attn_allocator.size // ps),
            PoolSpec("hisparse_host_pool", host, "host", 1, host.size)]
        self.counters = {"health_checks": 0, "prebuilt_finished": 0, "direct_admits": 0, "decode_finished": 0}

    def _build(self, config) -> None:
        """The decode server's ``ServerArgs``, its pools (:meth:`_build_pools`) and its chunk cache; no sessions."""
        S = self.S
        P = self.P = load_pd_hisparse(S)
        self.server_args = S.ServerArgs(model_path="dummy", page_size=config.page_size,
                                        attention_backend="torch_native", disaggregation_mode="decode",
                                        disaggregation_transfer_backend="fake", enable_hisparse=True,
                                        disable_radix_cache=True, max_running_requests=config.max_running_requests,
                                        num_reserved_decode_tokens=config.num_reserved_decode_tokens)
        S.set_global_server_args_for_scheduler(self.server_args)
        self._build_pools(config)
        self.tree_cache = P.ChunkCache(S.CacheInitParams(
            disable=True, req_to_token_pool=self.req_to_token_pool, token_to_kv_pool_allocator=self.allocator,
            page_size=config.page_size))
        self.session_controller = None

    def _build_pools(self, config) -> None:
        """``ModelRunner``'s HiSparse pools (``HiSparseNSATokenToKVPool``, ``HiSparseTokenToKVPoolAllocator``),
        the decode row pool (``DecodeReqToTokenPool``) and the ``HiSparseCoordinator``."""
        P, dev, ps = self.P, config.device, config.page_size
        size, ratio = config.total_tokens, config.hisparse_host_to_device_ratio
        kv = P.HiSparseNSATokenToKVPool(size, page_size=ps, kv_lora_rank=KV_LORA_RANK, dtype=torch.bfloat16,
                                        qk_rope_head_dim=ROPE_DIM, layer_num=1, device=dev,
                                        index_head_dim=INDEX_HEAD_DIM, enable_memory_saver=False,
                                        kv_cache_dim=KV_LORA_RANK + ROPE_DIM, start_layer=0, end_layer=1,
                                        host_to_device_ratio=ratio)
        self.allocator = P.HiSparseTokenToKVPoolAllocator(size, page_size=ps, dtype=torch.bfloat16, device=dev,
                                                          kvcache=kv, need_sort=config.need_sort,
                                                          host_to_device_ratio=ratio)
        self.req_to_token_pool = P.decode.DecodeReqToTokenPool(
            size=config.max_running_requests, max_context_len=config.context_len + 8, device=dev,
            enable_memory_saver=False, pre_alloc_size=config.max_running_requests)
        dbs = config.hisparse_device_buffer_size
        self.coordinator = P.hc.HiSparseCoordinator(
            req_to_token_pool=self.req_to_token_pool, token_to_kv_pool_allocator=self.allocator,
            top_k=max(1, dbs // 2), device_buffer_size=dbs, device=dev, tp_group=one_rank_group(),
            host_to_device_ratio=ratio)
        self.coordinator.mem_pool_host.load_to_device_per_layer = _load_to_device(self.coordinator.mem_pool_host)

    def _build_queues(self, config) -> None:
        """``Scheduler.init_disaggregation``, decode branch: the metadata slots and buffers, the transfer and
        prealloc queues (SGLang's ``fake`` backend: ``FakeKVManager``, ``FakeKVReceiver``)."""
        S, P, r2t = self.S, self.P, self.req_to_token_pool
        group = one_rank_group()
        _shim_attn_tp(group)
        n_meta = (r2t.size + r2t.pre_alloc_size) * 2
        self.metadata_allocator = P.ReqToMetadataIdxAllocator(n_meta)
        buffers = P.MetadataBuffers(n_meta, hidden_size=16, hidden_states_dtype=torch.float32)
        tp_worker = SimpleNamespace(is_hybrid_swa=False, model_runner=SimpleNamespace(kv_cache_dtype_str="bfloat16"))
        sched = _scheduler_class(P)(
            self, spec_algorithm=S.SpeculativeAlgorithm.NONE, server_args=self.server_args, enable_hisparse=True,
            hisparse_coordinator=self.coordinator, tp_worker=tp_worker, dp_rank=None, model_config=self.model_config,
            running_batch=S.ScheduleBatch(reqs=[], batch_is_full=False), waiting_queue=[], last_batch=None,
            cur_batch=None, chunked_req=None, req_to_token_pool=r2t, token_to_kv_pool_allocator=self.allocator,
            tree_cache=self.tree_cache, max_running_requests=config.max_running_requests, enable_overlap=False,
            grammar_manager=SimpleNamespace(has_waiting_grammars=lambda: False),
            future_map=None,  # (process_prebuilt reads it for speculative decoding only)
            disaggregation_mode=P.DisaggregationMode.DECODE, enable_metrics=False, forward_ct=0, gpu_id=0,
            attn_tp_cpu_group=group, tp_cpu_group=group, enable_hierarchical_cache=False)
        tq = P.decode.DecodeTransferQueue(gloo_group=group, req_to_metadata_buffer_idx_allocator=self.metadata_allocator,
                                          tp_rank=0, metadata_buffers=buffers, scheduler=sched, tree_cache=self.tree_cache)
        pq = P.decode.DecodePreallocQueue(
            req_to_token_pool=r2t, token_to_kv_pool_allocator=self.allocator, draft_token_to_kv_pool=None,
            req_to_metadata_buffer_idx_allocator=self.metadata_allocator, metadata_buffers=buffers, scheduler=sched,
            transfer_queue=tq, tree_cache=self.tree_cache, gloo_group=group, tp_rank=0, tp_size=1, dp_size=1,
            gpu_id=0, bootstrap_port=8998, max_total_num_tokens=self.allocator.size_full, pp_rank=0,
            num_reserved_decode_tokens=config.num_reserved_decode_tokens, transfer_backend=P.TransferBackend.FAKE)
        sched.disagg_decode_transfer_queue, sched.disagg_decode_prealloc_queue = tq, pq
        self.sched, self.prealloc_queue, self.transfer_queue = sched, pq, tq
        for name, key in (("process_batch_result_prebuilt", "prebuilt_finished"),):
            self._count_finished(sched, name, key)
        admit = self.coordinator.admit_request_direct

        def counted_admit(req):  # (a counter only: the coordinator's own method runs)
            self.counters["direct_admits"] += 1
            return admit(req)

        self.coordinator.admit_request_direct = counted_admit

    def _count_finished(self, sched, name: str, key: str) -> None:
        orig = getattr(sched, name)

        def counted(batch, *a, **k):
            out = orig(batch, *a, **k)
            self.counters[key] += sum(r.finished() for r in batch.reqs)
            self.finished.update(r.rid for r in batch.reqs if r.finished())
            return out

        setattr(sched, name, counted)

    # -- intake ------------------------------------------------------------------------------------
    def _submit(self, prompt, max_new: int, stop_at, sid, rid_prefix: str = "r", op=None) -> None:
        """``handle_generate_request`` on a decode server: a ``Req`` bootstrapped from the (fake) prefill
        server, into the prealloc queue. A health check is ``http_server.health_generate``'s: input ``[0]``,
        one new token, the fake bootstrap host, room 0."""
        S, P, cfg = self.S, self.P, self.config
        health = rid_prefix == "HEALTH_CHECK_"
        rid = f"{rid_prefix}{self._n}"
        self._n += 1
        sp = S.SamplingParams(max_new_tokens=max_new, temperature=0.0,
                              ignore_eos=bool(op is not None and op.ignore_eos))
        sp.normalize(None)
        ids = [0] if health else list(prompt)
        req = S.Req(rid, "", ids, sp, vocab_size=cfg.vocab_size, eos_token_ids={EOS},
                    bootstrap_host=P.FAKE_BOOTSTRAP_HOST, bootstrap_port=8998,
                    bootstrap_room=0 if health else 1000 + self._n, disagg_mode=P.DisaggregationMode.DECODE)
        self.submitted.append(rid)
        self.counters["health_checks"] += health
        sp.max_new_tokens = max(0, min(sp.max_new_tokens, self.max_req_len - len(req.origin_input_ids) - 1))
        req.kvaudit_stop_at = stop_at
        self.sched._add_request_to_queue(req)

    def _abort(self, rid: str) -> None:
        """``Scheduler.abort_request``, decode branch: a waiting request (it holds its KV) is released with
        ``request_finished`` first; a queued one has its receiver aborted; a retracted one drops its CPU
        copy; a running one gets ``to_finish``."""
        S, sched = self.S, self.sched
        for req in [r for r in sched.waiting_queue if r.rid.startswith(rid)]:
            sched.waiting_queue.remove(req)
            self.finished.add(req.rid)
            self.coordinator.request_finished(req)
            S.common.release_kv_cache(req, self.tree_cache)

        def drop_backup(req):
            if hasattr(req, "kv_cache_cpu"):
                del req.kv_cache_cpu
            self.finished.add(req.rid)

        abort_decode_queues(self.prealloc_queue, self.transfer_queue, sched.running_batch.reqs, rid, drop_backup,
                            S.FINISH_ABORT)

    def _flush_cache(self) -> bool:
        """``Scheduler.flush_cache`` when ``is_fully_idle`` (the intake's: the tree, a chunk cache, the row pool and
        the allocator, logical and device, cleared; as in SGLang, not the host pool nor the coordinator), and
        the scheduler's ``last_batch`` dropped."""
        if not super()._flush_cache():
            return False
        self.sched.last_batch = None
        return True

    def _memory_pressure(self) -> None:
        """A chunk cache has nothing to evict: no effect on a decode server."""

    # -- the loop (event_loop_normal_disagg_decode) ----------------------------------------------
    def step(self) -> None:
        """One iteration: ``process_decode_queue`` (pre-allocation, transfer, ``admit_request_direct``),
        ``get_next_disagg_decode_batch_to_run`` (the prebuilt batch, its result, the decode batch) and the
        decode batch's result."""
        self.steps += 1
        self.clock.now += 1.0
        sched = self.sched
        sched.process_decode_queue()
        batch = sched.get_next_disagg_decode_batch_to_run()
        if batch is not None:
            self._process_decode(batch)
        sched.last_batch = batch
        sched.forward_ct += 1
        self.waiting = list(sched.waiting_queue)
        self.running = [r for r in sched.running_batch.reqs if not r.finished()]

    def _update_running_batch(self, batch):
        """``Scheduler.update_running_batch`` (no overlap): ``retract_decode(server_args)`` when
        ``check_decode_mem`` fails, each retracted request queued again and ``retract_req``'d by the
        coordinator; then ``prepare_for_decode`` (its ``map_last_loc_to_buffer``)."""
        batch.filter_batch()
        if batch.is_empty():
            batch.batch_is_full = False
            return batch
        if not batch.check_decode_mem():
            retracted, _, aborted = batch.retract_decode(self.server_args)
            self.retractions += len(retracted) + len(aborted)
            self.last_retraction = f"step {self.steps}: retracted {len(retracted)}, {len(batch.reqs)} kept"
            for req in retracted:
                self.sched._add_request_to_queue(req, is_retracted=True)
                self.coordinator.retract_req(req)
            self.finished.update(r.rid for r in aborted)
        if batch.is_empty():
            return batch
        batch.hisparse_coordinator = self.coordinator
        batch.prepare_for_decode()
        return batch

    def _process_decode(self, batch) -> None:
        """``process_batch_result_decode`` (no overlap, no speculation): each request's token, then
        ``check_finished``; a finished one gets ``request_finished`` and ``release_kv_cache``."""
        self.allocator.free_group_begin()
        tokens = []
        for req in batch.reqs:
            tokens.append(self._sample(req))
            req.output_ids.append(tokens[-1])
            req.check_finished()
            if req.finished():
                self.counters["decode_finished"] += 1
                self.finished.add(req.rid)
                self.coordinator.request_finished(req)
                self.S.common.release_kv_cache(req, self.tree_cache)
        batch.output_ids = torch.tensor(tokens, dtype=torch.int64)
        self.allocator.free_group_end()

    # -- observer: requests ---------------------------------------------------------------------------
    def _groups(self) -> tuple:
        """``(place, requests)`` of the decode server, from the front of the pipeline (no deferred releases in
        this era)."""
        return decode_groups(self.prealloc_queue, self.transfer_queue, self.sched)

    def _active(self) -> list:
        out: list = []
        for _, group in self._groups():
            out += [r for r in group if not any(r is x for x in out)]
        return out

    def _live(self) -> list:
        """Requests holding a row (pre-allocated, transferred, waiting or running)."""
        return [r for r in self._active() if r.req_pool_idx is not None]

    def _places(self) -> dict[int, str]:
        return {id(r): place for place, group in reversed(self._groups()) for r in group}

    def is_idle(self, ignore_waiting: bool = False) -> bool:
        """``is_fully_idle``: every queue empty, no running request."""
        return not any(group for _, group in self._groups())

    def is_idle_for_health_check(self) -> bool:
        """``is_fully_idle(for_health_check=True)``: the prealloc and transfer queues do not count."""
        s = self.sched
        return (s.running_batch.is_empty() and (s.last_batch is None or s.last_batch.is_empty())
                and not s.waiting_queue)

    # -- observer: pools -------------------------------------------------------------------------------
    def install_pool(self, spec: PoolSpec, auditor, wrap) -> None:
        """Paged pools by their free page set around ``alloc*``/``free``; rows as the legacy target; the
        metadata slots at ``alloc() -> int | None`` / ``free(int)``; the host pool at ``alloc``/``free``."""
        if spec.kind == "rows":
            return super().install_pool(spec, auditor, wrap)
        if spec.kind == "host":
            return SglangHooks._install_host_pool(self, spec, auditor, wrap)
        if install_metadata_pool(spec, auditor):
            return
        auditor.wrap_clear(spec)
        obj = spec.obj
        for name in ("alloc", "alloc_extend", "alloc_decode", "free"):
            taking = name != "free"
            install_free_set(auditor, wrap, spec.name, obj, name, taking, lambda: _free_pages(obj),
                             lambda b, a, t=taking: (np.setdiff1d(b, a) if t else np.setdiff1d(a, b)).tolist())

    def _units(self, req) -> dict[str, np.ndarray]:
        """What ``req``'s row owns: logical pages, HiSparse device pages (its device buffer and what its
        logical slots still map to) and host slots (units: slot + 1)."""
        co, ps, row = self.coordinator, self.config.page_size, req.req_pool_idx
        logical = self.req_to_token_pool.req_to_token[row, : req.kv_allocated_len].to(torch.int64)
        cap = int(co.req_device_buffer_size[row])
        mapped = self.allocator.full_to_hisparse_device_index_mapping[logical]
        phys = torch.cat([co.req_to_device_buffer[row, :cap].to(torch.int64), mapped])
        return {"token_to_kv_pool": np.unique(slot_pages(logical[logical > 0], ps)),
                "hisparse_device_pool": np.unique(slot_pages(phys[phys >= ps], ps)),
                "hisparse_host_pool": host_units(co.req_to_host_pool[row], 1)}

    def roots(self, aborting: bool = True) -> list[Root]:
        """Each live request's row, logical, device and host units; each queued request's metadata slot."""
        out: list[Root] = []
        places = self._places()
        for req in self._live():
            if not aborting and req.to_finish is not None:
                continue
            owner, where = f"req:{req.rid}", places.get(id(req), "")
            out.append(Root("req_to_token_pool", owner, np.array([req.req_pool_idx + self._row_base]),
                            where=where))
            out += [Root(pool, owner, units, where=where) for pool, units in self._units(req).items()]
        held = [(dr.req.rid, dr.metadata_buffer_index) for dr in self.prealloc_queue.queue + self.transfer_queue.queue]
        return out + metadata_roots(held, where="transfer")

    def units_of_rows(self, rows) -> dict[str, np.ndarray]:
        co, ps = self.coordinator, self.config.page_size
        idx = torch.as_tensor(np.asarray(rows) - self._row_base, dtype=torch.int64)
        logical = self.req_to_token_pool.req_to_token[idx].reshape(-1).to(torch.int64)
        phys = co.req_to_device_buffer[idx].reshape(-1).to(torch.int64)
        return {"token_to_kv_pool": np.unique(slot_pages(logical[logical > 0], ps)),
                "hisparse_device_pool": np.unique(slot_pages(phys[phys >= ps], ps)),
                "hisparse_host_pool": host_units(co.req_to_host_pool[idx].reshape(-1), 1)}

    def accounting(self) -> dict[str, Accounting]:
        """The logical, row, metadata, device and host pools' own counters (a chunk cache holds nothing)."""
        a, rp, m, host = self.allocator, self.req_to_token_pool, self.metadata_allocator, self.coordinator.mem_pool_host
        lo, hi = a.logical_attn_allocator, a.hisparse_attn_allocator
        return {"token_to_kv_pool": Accounting(lo.available_size(), 0, 0, 0, lo.size),
                "req_to_token_pool": Accounting(rp.available_size(), 0, 0, 0, rp.size + rp.pre_alloc_size),
                "metadata_buffers": Accounting(m.available_size(), 0, 0, 0, m.size),
                "hisparse_device_pool": Accounting(hi.available_size(), 0, 0, 0, hi.size),
                "hisparse_host_pool": Accounting(host.available_size(), 0, 0, 0, host.size)}

    def free_lists(self) -> dict[str, np.ndarray]:
        a, host = self.allocator, self.coordinator.mem_pool_host
        return {"token_to_kv_pool": _free_pages(a.logical_attn_allocator),
                "hisparse_device_pool": _free_pages(a.hisparse_attn_allocator),
                "hisparse_host_pool": host.free_slots.to(torch.int64).cpu().numpy() + 1,
                "req_to_token_pool": np.asarray(self.req_to_token_pool.free_slots, dtype=np.int64) + self._row_base,
                "metadata_buffers": np.asarray(self.metadata_allocator.free_slots, dtype=np.int64) + 1}

    def engine_check(self) -> list[str]:
        """None: SGLang's idle check is not modelled on this mode (kvaudit's own oracles read the pools)."""
        return []

    def progress(self) -> dict[str, int]:
        out = {r.rid: r.kv_committed_len + len(r.output_ids) for r in self.sched.running_batch.reqs}
        for r in self.sched.running_batch.reqs:
            if r.to_finish is not None:
                out[r.rid] = -1
        return out

    def stuck(self) -> str:
        return decode_stuck(self.prealloc_queue, self.transfer_queue, self.sched,
                            self.req_to_token_pool.available_size())

    def describe_busy(self) -> str:
        pq, tq, s, co = self.prealloc_queue, self.transfer_queue, self.sched, self.coordinator
        return (f"prealloc={len(pq.queue)} transfer={len(tq.queue)} retracted={len(pq.retracted_queue)} "
                f"waiting={len(s.waiting_queue)} running={len(s.running_batch.reqs)} "
                f"logical_available={self.allocator.logical_attn_allocator.available_size()} "
                f"device_available={self.allocator.hisparse_attn_allocator.available_size()} "
                f"host_available={co.mem_pool_host.available_size()}")

    def reach(self) -> dict[str, int]:
        """The path counters: health checks submitted, requests finished in a prebuilt batch and in a decode
        batch, direct-to-host admissions (retraction is not: the history row's sizing keeps it out of reach)."""
        return dict(self.counters)

    def framework_files(self) -> list[str]:
        import sglang.srt.mem_cache.allocator as allocator
        import sglang.srt.mem_cache.hisparse_memory_pool as hisparse_pool
        import sglang.srt.mem_cache.memory_pool_host as memory_pool_host
        return [allocator.__file__, hisparse_pool.__file__, memory_pool_host.__file__]

    def framework_classes(self) -> list[type]:
        """The decode row pool and the metadata allocator share modules with engine code."""
        return [type(self.req_to_token_pool), type(self.metadata_allocator)]


def _free_pages(allocator) -> np.ndarray:
    """A paged allocator's free pages (``free_pages`` and pending ``release_pages``)."""
    return torch.cat([allocator.free_pages, allocator.release_pages]).to(torch.int64).cpu().numpy()
