"""HiSparse of SGLang 0.5.23 (``HiSparseTokenToKVPoolAllocator``, its host pool and
``HiSparseCoordinator``) driven on CPU in the scheduler's order, with the radix cache off and CPU
shims S1-S4 that stand in for CUDA plumbing, never for memory management.

Design notes: docs/internals/sglang.md ("HiSparse")."""

from __future__ import annotations

import types
import warnings

import numpy as np
import torch

from kvaudit.targets.base import Accounting, PoolSpec, Root, slot_pages
from kvaudit.targets.sglang.boot import SglangUnavailable, build, one_rank_group, publish_server_args, shim_cuda_host_register
from kvaudit.targets.sglang.hooks import host_free_units, host_units
from kvaudit.targets.sglang.standins import StepEvent
from kvaudit.targets.sglang.feature import SglangFeature

_SHIMS: list[str] = []


def install_module_shims(hc, pool_host_common) -> list[str]:
    """S1 and S2, once per process; returns the shims' names."""
    if _SHIMS:
        return list(_SHIMS)
    shim_cuda_host_register()  # shared with HiCache (boot)
    real = torch

    class _NoPinTorch(types.ModuleType):
        def __getattr__(self, name):
            return getattr(real, name)

        @staticmethod
        def tensor(*a, **k):
            k.pop("pin_memory", None)
            return real.tensor(*a, **k)

    hc.torch = _NoPinTorch("torch")
    _SHIMS.extend(["S1 pool_host.common._cuda_host_register no-op", "S2 hisparse_coordinator.torch.tensor w/o pin_memory"])
    return list(_SHIMS)


def install_instance_shims(co) -> None:
    """S3 and S4 on one coordinator."""
    host = co.mem_pool_host

    def backup_all(device_pool, host_indices, device_indices, io_backend):
        for layer_id in range(device_pool.start_layer, device_pool.end_layer):
            hl = layer_id - device_pool.start_layer
            host.k_buffer[hl][host_indices] = device_pool.get_key_buffer(layer_id)[device_indices]
            host.v_buffer[hl][host_indices] = device_pool.get_value_buffer(layer_id)[device_indices]

    def load_layer(device_pool, host_indices, device_indices, layer_id, io_backend, **kw):
        hl = layer_id - device_pool.start_layer
        device_pool.get_key_buffer(layer_id)[device_indices] = host.k_buffer[hl][host_indices]
        device_pool.get_value_buffer(layer_id)[device_indices] = host.v_buffer[hl][host_indices]

    host.backup_from_device_all_layer = backup_all
    host.load_to_device_per_layer = load_layer
    for stream in (co.write_staging_stream, co.decode_backup_stream):
        if not hasattr(stream, "synchronize"):
            stream.synchronize = lambda: None


class HiSparse(SglangFeature):
    """HiSparse (``config.enable_hisparse``)."""

    name = "hisparse"

    def __init__(self, target):
        super().__init__(target)
        self.staged_joins = self.decode_maps = 0  # reach(): requests out of staging; map_last_loc_to_buffer calls

    def pools(self, pools: list) -> list:
        """The logical pool in place of the allocator, and the physical device and host pools."""
        t = self.target
        ps, a, host = t.config.page_size, t.allocator, self.coordinator.mem_pool_host
        return [
            PoolSpec("token_to_kv_pool", a.logical_attn_allocator, "kv", ps, a.logical_attn_allocator.size // ps),
            pools[1],  # the row pool
            PoolSpec("hisparse_device_pool", a.hisparse_attn_allocator, "kv", ps, a.hisparse_attn_allocator.size // ps),
            PoolSpec("hisparse_host_pool", host, "host", ps, -(-host.size // ps)),
        ]

    def build(self, config):
        """SGLang's HiSparse objects as the server builds them; sets ``self.coordinator``."""
        S, target = self.target.S, self.target
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                import sglang.srt.managers.hisparse_coordinator as hc
                import sglang.srt.mem_cache.pool_host.common as pool_host_common
                from sglang.srt.mem_cache.allocator.hisparse import HiSparseTokenToKVPoolAllocator
                from sglang.srt.mem_cache.memory_pool import MiniMaxSparseKVPool
            except ImportError as exc:
                raise SglangUnavailable(f"SGLang {S.version}'s HiSparse modules do not import: {exc}") from None
        cpu = torch.device(config.device).type == "cpu"  # the shims stand in for CUDA: none on a GPU
        self.shims = install_module_shims(hc, pool_host_common) if cpu else []
        ps, size, dev = config.page_size, config.total_tokens, config.device
        ratio, dbs = config.hisparse_host_to_device_ratio, config.hisparse_device_buffer_size
        sa = publish_server_args(config, disable_radix_cache=True)
        S.get_parallel().override_permanently(tp_rank=0)
        kvcache = MiniMaxSparseKVPool(size, page_size=ps, dtype=torch.bfloat16, head_num=1, head_dim=8, idx_head_dim=8,
                                      dense_layer_ids=[], sparse_layer_ids=[0], device=dev, start_layer=0, end_layer=1,
                                      enable_hisparse=True, host_to_device_ratio=ratio)
        allocator = HiSparseTokenToKVPoolAllocator(size, page_size=ps, dtype=torch.bfloat16, device=dev, kvcache=kvcache,
                                                   need_sort=config.need_sort, host_to_device_ratio=ratio)
        req_to_token_pool = S.ReqToTokenPool(size=config.max_req_rows, max_context_len=config.context_len + 8,
                                             device=dev, enable_memory_saver=False)
        co = hc.HiSparseCoordinator(req_to_token_pool=req_to_token_pool, token_to_kv_pool_allocator=allocator,
                                    top_k=max(1, dbs // 2), device_buffer_size=dbs, device=dev,
                                    tp_group=one_rank_group(), host_to_device_ratio=ratio, swap_in_block_size=960,
                                    shared_index_layers=None, num_draft_tokens=0)
        if cpu:
            install_instance_shims(co)
        if config.hisparse_staging_steps:
            admit = co.admit_request_into_staging

            def admit_with_copy_time(req):  # the copy stays in flight for hisparse_staging_steps steps
                admit(req)
                act = co.ack_staging_queue[-1]
                co.ack_staging_queue[-1] = act._replace(finish_event=StepEvent(
                    act.finish_event, target, target.steps + 1 + config.hisparse_staging_steps))

            co.admit_request_into_staging = admit_with_copy_time
        if "hisparse-skip-finish" in config.bugs:
            finished = co.request_finished

            def request_finished_skipped_once(req):  # the fault: SGLang's result processor's call is lost
                if "hisparse-skip-finish" in target._faults:
                    target._faults.discard("hisparse-skip-finish")
                    return
                finished(req)

            co.request_finished = request_finished_skipped_once
        self.coordinator = co
        # the tree cache (disabled) through the shared build, which also asserts the tree core
        return build(config, server_args=sa, make_kv=lambda dev: (kvcache, allocator),
                     make_rows=lambda dev: req_to_token_pool, disable_radix_cache=True)

    # -- observer: hooks ---------------------------------------------------------------------
    def framework_files(self, files: list[str]) -> list[str]:
        """Also the HiSparse allocator and the host pool's internals."""
        import sglang.srt.mem_cache.allocator.hisparse as alloc_hisparse
        import sglang.srt.mem_cache.pool_host.base as host_base
        import sglang.srt.mem_cache.pool_host.hisparse as host_hisparse
        return files + [alloc_hisparse.__file__, host_base.__file__, host_hisparse.__file__]

    # -- driver -------------------------------------------------------------------------------
    def new_batch(self, batch, kind: str) -> None:
        """``batch.hisparse_coordinator = ...`` (``get_new_batch_prefill``, ``get_next_batch_to_run``), for
        SGLang's own ``alloc_for_extend`` and ``retract_decode``."""
        batch.hisparse_coordinator = self.coordinator

    def hisparse_coordinator(self):
        return self.coordinator

    def join_running(self) -> bool:
        """``get_next_batch_to_run``'s HiSparse branch: ``collect_ready_reqs()`` merged into the running
        batch, with seq len ``len(origin_input_ids) + len(output_ids) - 1``."""
        for req in self.coordinator.collect_ready_reqs():
            req.kvaudit_seq_len = len(req.origin_input_ids) + len(req.output_ids) - 1
            self.target.running.append(req)
            self.staged_joins += 1
        return True

    def prefilled(self, req) -> bool:
        """The request joins no batch: SGLang's result processor staged it (``admit_request_into_staging``)."""
        return True

    def after_decode_alloc(self, batch) -> None:
        """``prepare_for_decode``'s ``hisparse_coordinator.map_last_loc_to_buffer(...)``."""
        rows = torch.tensor([r.kv.req_pool_idx for r in batch.reqs], dtype=torch.int64)
        seq_lens = torch.tensor([r.kvaudit_seq_len for r in batch.reqs], dtype=torch.int64)
        self.coordinator.map_last_loc_to_buffer(seq_lens.to(batch.device), batch.out_cache_loc, rows.to(batch.device),
                                                seq_lens, rows)
        self.decode_maps += 1

    def reach(self, out: dict[str, int]) -> dict[str, int]:
        """``hisparse_staged``: requests whose host staging finished and that joined decode
        (``collect_ready_reqs``); ``hisparse_decode_steps``: decode batches mapped to device buffers
        (``map_last_loc_to_buffer``), since the target was built."""
        return {**out, "hisparse_staged": self.staged_joins, "hisparse_decode_steps": self.decode_maps}

    @property
    def _last_batch(self) -> list:
        """``Scheduler.last_batch``'s requests."""
        scheduled = self.target._scheduled
        return list(scheduled[1]) if scheduled is not None else []

    def staged(self) -> list:
        """Requests in the coordinator's staging queue: in no batch, yet owners of a row, logical and
        physical KV and host slots."""
        return [act.req for act in self.coordinator.ack_staging_queue]

    def inflight(self, reqs: list) -> list:
        """Also ``last_batch`` (a staged request is in it for the step after its prefill)."""
        return reqs + [r for r in self._last_batch if not any(r is x for x in reqs)]

    def place_groups(self, groups: tuple) -> tuple:
        return (("staging", self.staged()),) + groups

    def active(self, reqs: list) -> list:
        """Also the staged requests (``abort_request`` cannot reach them: its ``todo hisparse``)."""
        return reqs + [r for r in self.staged() if not any(r is x for x in reqs)]

    def is_idle(self, idle: bool, ignore_waiting: bool) -> bool:
        """``is_fully_idle`` under HiSparse also waits for ``has_ongoing_staging()``."""
        return idle and not self.coordinator.has_ongoing_staging()

    def is_idle_for_health_check(self, idle: bool) -> bool:
        """Staging does not count, the last batch does."""
        return idle and not self._last_batch

    def progress(self, out: dict[str, int]) -> dict[str, int]:
        for r in self.staged() if not self.target.scheduler_paused else []:
            out.setdefault(r.rid, r.kv.kv_committed_len + len(r.output_ids))
        return out

    def stuck(self, out: str) -> str:
        """Also ``staging:host-backup``, before the waiting queue."""
        if not out.startswith(("running:", "chunked:")) and self.coordinator.has_ongoing_staging():
            return "staging:host-backup"
        return out

    def describe_busy(self, out: str) -> str:
        stats = self.coordinator.get_token_stats()
        return (out + f" staged={len(self.staged())} device_tokens={stats.device_tokens} "
                f"host_tokens={stats.host_tokens}")

    # -- observer: roots and counters ---------------------------------------------------------
    def _hisparse_units(self, kv) -> tuple[np.ndarray, np.ndarray]:
        """``(physical pages, host units)`` a record's row owns in the coordinator: its device buffer, the
        physical slots its logical slots still map to, and its host slots."""
        co, ps = self.coordinator, self.target.config.page_size
        row = kv.req_pool_idx
        cap = int(co.req_device_buffer_size[row])
        logical = self.target.req_to_token_pool.req_to_token[row, : kv.kv_allocated_len].to(torch.int64)
        mapped = self.target.allocator.full_to_hisparse_device_index_mapping[logical]
        phys = torch.cat([co.req_device_buffer_token_locs[:, row, :cap].reshape(-1).to(torch.int64),
                          co.req_to_device_buffer[row, :cap].to(torch.int64), mapped])
        phys = phys[phys >= ps]  # page 0 is the padding sink, never owned
        host = co.req_to_host_pool[row, : int(co.req_to_host_pool_allocated_len[row])]
        return np.unique(slot_pages(phys, ps)), host_units(host, ps)

    def roots(self, out: list, aborting: bool) -> list:
        """Also each owner's physical device and host slots; staged requests are owners."""
        for req in self.target._live():
            if not aborting and req.to_finish is not None:
                continue
            phys, host = self._hisparse_units(req.kv)
            out.append(Root("hisparse_device_pool", f"req:{req.rid}", phys))
            out.append(Root("hisparse_host_pool", f"req:{req.rid}", host))
        return out

    def units_of_rows(self, out: dict, rows) -> dict:
        co, ps = self.coordinator, self.target.config.page_size
        rows = torch.as_tensor(rows, dtype=torch.int64)
        phys = co.req_to_device_buffer[rows].reshape(-1).to(torch.int64)
        out["hisparse_device_pool"] = np.unique(slot_pages(phys[phys >= ps], ps))
        out["hisparse_host_pool"] = host_units(co.req_to_host_pool[rows].reshape(-1), ps)
        return out

    def accounting(self, out: dict) -> dict:
        """The logical, row, physical and host pools (``get_token_stats``'s counters)."""
        a, cache = self.target.allocator, self.target.tree_cache
        lo, hi, host = a.logical_attn_allocator, a.hisparse_attn_allocator, self.coordinator.mem_pool_host
        return {
            **out,  # the row pool, as on every preset
            "token_to_kv_pool": Accounting(lo.available_size(), cache.evictable_size(), cache.protected_size(), 0,
                                           lo.size),
            "hisparse_device_pool": Accounting(hi.available_size(), 0, 0, 0, hi.size),
            "hisparse_host_pool": Accounting(host.available_size(), 0, 0, 0, host.size),
        }

    def free_lists(self, out: dict) -> dict:
        a = self.target.allocator
        return {**out, "hisparse_device_pool": a.hisparse_attn_allocator.get_all_free_pages().cpu().numpy(),
                "hisparse_host_pool": host_free_units(self.coordinator.mem_pool_host, self.target.config.page_size)}

    def engine_check(self, lines: list[str]) -> list[str]:
        """None: under HiSparse the scheduler skips its idle checks (memory model 1.9) and the busy check is
        opt-in; see :meth:`busy_check`."""
        return []

    def sglang_owners(self) -> list:
        """``SchedulerInvariantChecker._requests_owning_rows``: ``last_batch``, ``running_batch`` and the
        chunked request, holding KV (staged requests drop out of them: memory model A.4)."""
        out: list = []
        t = self.target
        for r in self._last_batch + t.running + ([t.chunked_req] if t.chunked_req is not None else []):
            if r.kv.holds_kv and not any(r is x for x in out):
                out.append(r)
        return out

    def busy_check(self) -> list[str]:
        """``self_check_during_busy``'s identity on the logical pool, with ``uncached`` over
        :meth:`sglang_owners` only: a failing line when staged requests are missed (A.4)."""
        if not self._last_batch:  # self_check_during_busy returns when last_batch is None
            return []
        t = self.target
        lo, cache = t.allocator.logical_attn_allocator, t.tree_cache
        uncached = sum(t._ceil(r.kv.kv_allocated_len) - r.kv.cache_protected_len for r in self.sglang_owners())
        lhs = lo.available_size() + cache.evictable_size() + cache.protected_size() + uncached
        if lhs != lo.size:
            return [f"[token_to_kv_pool] available={lo.available_size()} + evictable={cache.evictable_size()} + "
                    f"protected={cache.protected_size()} + uncached={uncached} = {lhs} != total={lo.size}"]
        return []
