"""kvaudit's own KV connector for ``vllm-kv-save`` (imports vLLM: ``KVConnectorFactory`` loads it, registered in
``boot``), and the ``lmcache`` client stand-in of ``vllm-lmcache-mp`` (:func:`install_lmcache_client`).

The save connector saves every request's KV asynchronously and so answers ``request_finished ->
delay_free_blocks=True`` for *any* finished request with blocks, aborted ones too, as vLLM's
``OffloadingConnector`` did with a store in flight in 0.15.1 and 0.16.0 (the history suite's #33377 row;
from 0.21.0 it never delays a free: the ``vllm-offload*`` presets). Its worker side:
:class:`kvaudit.targets.vllm.connector.SaveWorkerStandIn` (a request finished twice is saved twice).
"""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata


class KvauditSaveMetadata(KVConnectorMetadata):
    """``reqs_to_send``: the request ids whose save starts with this step."""

    def __init__(self, reqs_to_send: list[str]):
        self.reqs_to_send = reqs_to_send


class KvauditAsyncSaveConnector(KVConnectorBase_V1):
    """See the module docstring. The worker-role methods do nothing (no worker runs here)."""

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        self._to_send: list[str] = []  # finished since the last build_connector_meta

    # the worker role (never called by the scheduler), and update_state_after_alloc: nothing is loaded
    start_load_kv = wait_for_layer_load = save_kv_layer = wait_for_save = update_state_after_alloc = \
        lambda self, *a, **k: None

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        return 0, False  # nothing is loaded: a save-only connector

    def build_connector_meta(self, scheduler_output) -> KvauditSaveMetadata:
        meta = KvauditSaveMetadata(self._to_send)
        self._to_send = []
        return meta

    def request_finished(self, request, block_ids):
        """Hold the blocks while the request's KV is saved: ``(True, None)`` when it has blocks."""
        delay = len(block_ids) > 0
        if delay:
            self._to_send.append(request.request_id)
        return delay, None


class LMCacheServerStandIn:
    """``LMCacheMPSchedulerAdapter`` of the ``lmcache`` client (ZMQ to an LMCache server) for a server that
    holds nothing: every lookup misses (0 tokens: no load); locks, sessions, allocation reports are
    dropped. ``blocks_per_chunk``: LMCache's 256-token chunk."""

    def __init__(self, server_url, context, model_name, vllm_block_size, parallel_strategy, *a, **k):
        self.blocks_per_chunk = max(1, 256 // vllm_block_size)

    def num_blocks_per_chunk(self) -> int:
        return self.blocks_per_chunk

    def check_lookup_result(self, request_id: str) -> int:
        return 0

    maybe_submit_lookup_request = cleanup_lookup_result = free_lookup_locks = end_session = \
        report_block_allocations = lambda self, *a, **k: None


def install_lmcache_client() -> None:
    """Put into ``sys.modules``, unless an ``lmcache`` is imported, the narrowest stand-in of the ``lmcache``
    package that vLLM 0.33.0's ``kv_connector/v1/lmcache_mp_connector.py`` imports: the names it takes, the
    scheduler adapter being :class:`LMCacheServerStandIn`. The real package (0.5.6) does not import on CPU
    and needs a running server. With no ``lmcache.integration.vllm.lmcache_mp_connector``, vLLM uses its
    built-in ``LMCacheMPConnectorUpstream``."""
    import logging
    import sys
    from types import ModuleType

    if "lmcache" in sys.modules:
        return
    names = ("lmcache", "lmcache.utils", "lmcache.integration", "lmcache.integration.vllm",
             "lmcache.integration.vllm.utils", "lmcache.integration.vllm.vllm_multi_process_adapter",
             "lmcache.v1", "lmcache.v1.multiprocess", "lmcache.v1.multiprocess.custom_types")
    mods = {n: ModuleType(n) for n in names}
    mods["lmcache.utils"].init_logger = logging.getLogger
    mods["lmcache.integration.vllm.utils"].mla_enabled = lambda model_config: False
    adapter = mods["lmcache.integration.vllm.vllm_multi_process_adapter"]
    adapter.LMCacheMPSchedulerAdapter, adapter.LMCacheMPWorkerAdapter = LMCacheServerStandIn, None
    adapter.LoadStoreOp = adapter.ParallelStrategy = lambda *a, **k: (a, k)
    mods["lmcache.v1.multiprocess.custom_types"].BlockAllocationRecord = dict
    sys.modules.update(mods)
