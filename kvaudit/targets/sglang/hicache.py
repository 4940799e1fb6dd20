"""HiCache, host tier (L2), of SGLang 0.5.23 (``UnifiedRadixCache.init_hicache``,
``HybridCacheController`` and its host pool group) driven on CPU in the scheduler's order, with
CPU shims H2-H4. The L3 storage tier is :mod:`~kvaudit.targets.sglang.hicache_l3`.

Design notes: docs/internals/sglang.md ("HiCache")."""

from __future__ import annotations

import atexit
import warnings
from types import SimpleNamespace

import numpy as np
import torch

from kvaudit.targets.base import Accounting, LockImbalance, PoolSpec, Root
from kvaudit.targets.sglang.boot import SglangUnavailable, build, publish_server_args, shim_cuda_host_register
from kvaudit.targets.sglang.hooks import host_free_units, host_units
from kvaudit.targets.sglang.standins import StepEvent
from kvaudit.targets.sglang.feature import SglangFeature

HOST_POOL = "hicache_host_pool"


def install_instance_shims(feature, cc) -> list[str]:
    """H2, H3, H4 on one controller (idempotent); returns the shims' names."""
    if getattr(cc, "__kvaudit_shimmed__", False):
        return []
    eng = cc.l2_transfer_engine
    host = cc.mem_pool_host.anchor_entry.host_pool

    def backup_all(device_pool, host_indices, device_indices, io_backend):
        for hl in range(device_pool.layer_num):
            layer_id = hl + device_pool.start_layer
            host.k_buffer[hl][host_indices] = device_pool._get_key_buffer(layer_id)[device_indices]
            host.v_buffer[hl][host_indices] = device_pool._get_value_buffer(layer_id)[device_indices]

    def load_layer(device_pool, host_indices, device_indices, layer_id, io_backend, **kw):
        # the controller passes stage-local layer ids (0 .. layer_num - 1)
        device_pool._get_key_buffer(layer_id + device_pool.start_layer)[device_indices] = host.k_buffer[layer_id][host_indices]
        device_pool._get_value_buffer(layer_id + device_pool.start_layer)[device_indices] = host.v_buffer[layer_id][host_indices]

    host.backup_from_device_all_layer = backup_all
    host.load_to_device_per_layer = load_layer
    for stream in (eng.device_to_host_stream, eng.host_to_device_stream):
        if not hasattr(stream, "synchronize"):
            stream.synchronize = lambda: None
    target, delay = feature.target, feature.target.config.hicache_ack_steps

    def step_gated(submit, kind):
        def wrapper(transfers, *a, **k):
            c = submit(transfers, *a, **k)
            feature.hicache_log.append((kind, target.steps, sum(len(t.host_indices) for t in transfers)))
            return c._replace(finish_event=StepEvent(c.finish_event, target, target.steps + delay))
        return wrapper

    eng.submit_device_to_host = step_gated(eng.submit_device_to_host, "d2h")
    eng.submit_host_to_device = step_gated(eng.submit_host_to_device, "h2d")
    cc.__kvaudit_shimmed__ = True
    return ["H2 l2_transfer_engine.submit_* -> step-gated finish_event",
            "H3 host pool backup_from_device_all_layer / load_to_device_per_layer -> torch index copies",
            "H4 transfer streams: synchronize() no-op"]


class HiCache(SglangFeature):
    """HiCache's host tier (``config.enable_hierarchical_cache``)."""

    name = "hicache"

    def __init__(self, target):
        super().__init__(target)
        self.hicache_log: list[tuple] = []  # ("d2h"|"h2d"|"load_ready", step, tokens)
        self.host_lock_net: dict[int, int] = {}
        self._host_live: set[int] = set()  # host units the wrappers saw allocated (the Rust core's roots)

    def build(self, config):
        S = self.target.S
        self._cpu = torch.device(config.device).type == "cpu"
        self.shims = [shim_cuda_host_register()] if self._cpu else []
        sa = publish_server_args(config, enable_hierarchical_cache=True, hicache_ratio=float(config.hicache_ratio),
                                 hicache_write_policy=config.hicache_write_policy, hicache_io_backend="direct",
                                 hicache_mem_layout="layer_first", **self._storage_server_args())
        # create_unified_radix_cache registers the load-back layer counter with the worker (no forward here)
        tp_worker = SimpleNamespace(register_hicache_layer_transfer_counter=lambda counter: None)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            o = build(config, server_args=sa, tp_worker=tp_worker, enable_hierarchical_cache=True)
        if getattr(o.tree_cache, "cache_controller", None) is None:
            raise SglangUnavailable(f"SGLang {S.version}'s tree cache did not initialise HiCache (no cache_controller)")
        return o

    def _storage_server_args(self) -> dict:
        """The L3 tier's ``ServerArgs``: none here (``hicache_l3`` adds a backend)."""
        return dict(hicache_storage_backend=None)

    def pools(self, pools: list) -> list:
        hp = self.target.tree_cache.cache_controller.mem_pool_host.anchor_entry.host_pool
        ps = self.target.config.page_size
        return pools + [PoolSpec(HOST_POOL, hp, "host", ps, -(-hp.size // ps))]

    def attach(self) -> None:
        tree = self.target.tree_cache
        cc = self.cache_controller = tree.cache_controller
        self.host_group = cc.mem_pool_host
        self.host_pool = cc.mem_pool_host.anchor_entry.host_pool
        if self._cpu:
            self.shims += install_instance_shims(self, cc)
        # init_hicache registers the tree's shutdown (a storage detach) to run at exit, which would keep every
        # run's tree -- and through the driver's wrappers, the target (and L3's directory) -- alive until then
        atexit.unregister(tree.shutdown)

    @property
    def python_core(self) -> bool:
        return not self.target.tree_core.startswith("Rust")

    # -- observer: hooks ---------------------------------------------------------------------
    def framework_files(self, files: list[str]) -> list[str]:
        import sglang.srt.managers.cache_controller as cache_controller
        import sglang.srt.mem_cache.pool_host.base as host_base
        import sglang.srt.mem_cache.pool_host.group as host_group
        return files + [host_base.__file__, host_group.__file__, cache_controller.__file__]

    def install_pool(self, spec, auditor, wrap) -> bool:
        """The host pool, its wrappers mirroring the units held (the Rust core's roots)."""
        if spec.name != HOST_POOL:
            return False
        self.target._install_host_pool(spec, auditor, wrap, live=self._host_live)
        return True

    def install_lock_ledger(self, wrap, record) -> None:
        """Also ``inc_host_lock_ref``/``dec_host_lock_ref`` per node (load-back, and ``add_one_req``'s pin
        around ``init_load_back``), recorded as ``"host"`` locks."""
        self.target.install_lock_counter(wrap, record, self.target.tree_cache, "inc_host_lock_ref",
                                         "dec_host_lock_ref", self.host_lock_net, "host")

    # -- driver -------------------------------------------------------------------------------
    def memory_pressure(self) -> None:
        """Also host eviction: ``evict_host`` of what the host holds beyond half its size."""
        over = (self.host_pool.size - self.host_group.available_size()) - self.host_pool.size // 2
        if over > 0:
            self.target.tree_cache.evict_host(over)

    def before_batch(self) -> None:
        """``get_next_batch_to_run``: ``_process_hicache_events()``."""
        self._process_hicache_events()

    def _process_hicache_events(self) -> None:
        """``Scheduler._process_hicache_events``: acks due this step release their locks."""
        self.target.tree_cache.check_hicache_events()

    def new_batch(self, batch, kind: str) -> None:
        """``new_batch.hicache_consumer_index = ready_to_load_host_cache()`` (starts queued load-backs)."""
        if kind == "extend":
            batch.hicache_consumer_index = self.target.tree_cache.ready_to_load_host_cache()
            if batch.hicache_consumer_index >= 0:
                self.hicache_log.append(("load_ready", self.target.steps, batch.hicache_consumer_index))

    def after_process(self) -> None:
        """``process_batch_result``, ending in ``tree_cache.flush_pending_backups()``."""
        self.target.tree_cache.flush_pending_backups()

    def is_idle(self, idle: bool, ignore_waiting: bool) -> bool:
        """``is_fully_idle`` under HiCache: no write-through or load-back in flight."""
        cache = self.target.tree_cache
        return idle and not cache.ongoing_write_through and not cache.ongoing_load_back

    def stuck(self, out: str) -> str:
        """Also, before the waiting queue, ``hicache:load-back`` or ``hicache:write-through``: a copy never
        acked."""
        cache = self.target.tree_cache
        if out.startswith(("running:", "chunked:", "grammar:")):
            return out
        if cache.ongoing_load_back or cache.ongoing_write_through:
            return "hicache:" + ("load-back" if cache.ongoing_load_back else "write-through")
        return out

    def describe_busy(self, out: str) -> str:
        cache = self.target.tree_cache
        return (out + f" write_through_inflight={len(cache.ongoing_write_through)} "
                f"load_back_inflight={len(cache.ongoing_load_back)} host_available={self.host_group.available_size()}")

    def reach(self, out: dict[str, int]) -> dict[str, int]:
        """``hicache_write_throughs``: device-to-host copies submitted (write-through backups);
        ``hicache_load_backs``: host-to-device copies submitted (a host hit loaded back). Both counted per
        ``l2_transfer_engine`` submission since the target was built; at 0 the host tier was not searched. On
        CUDA (no H2 shim to count them) neither is given."""
        if not self._cpu:
            return out
        kinds = [e[0] for e in self.hicache_log]
        return {**out, "hicache_write_throughs": kinds.count("d2h"), "hicache_load_backs": kinds.count("h2d")}

    # -- observer: roots and counters ---------------------------------------------------------
    def tree_host_values(self) -> torch.Tensor | None:
        """Host slots held by tree nodes (FULL ``host_value``); None on the Rust core."""
        if not self.python_core:
            return None
        from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

        core = self.target.tree_cache.tree_core
        vals, stack = [], [core.root_node]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node is core.root_node:
                continue
            hv = node.component_data[ComponentType.FULL].host_value
            if hv is not None and hv.numel():
                vals.append(hv.to(torch.int64))
        return torch.cat(vals) if vals else torch.empty(0, dtype=torch.int64)

    def roots(self, out: list, aborting: bool) -> list:
        """Also the host pool's (:meth:`_host_roots`)."""
        return out + self._host_roots()

    def _host_roots(self) -> list[Root]:
        """The tree's host values (Python core), or the host units the wrappers saw allocated (Rust core,
        whose nodes cannot be listed)."""
        hv = self.tree_host_values()
        if hv is not None:
            units = host_units(hv, self.target.config.page_size)
        else:
            units = np.fromiter(sorted(self._host_live), dtype=np.int64)
        return [Root(HOST_POOL, "tree", units, role="tree")] if units.size else []

    def accounting(self, out: dict) -> dict:
        """Also the host pool, the tree's host tokens as evictable."""
        total = self.host_pool.size
        avail = self.host_group.available_size()
        hv = self.tree_host_values()
        held = int(hv.numel()) if hv is not None else total - avail
        out[HOST_POOL] = Accounting(avail, held, 0, 0, total)
        return out

    def free_lists(self, out: dict) -> dict:
        return {**out, HOST_POOL: host_free_units(self.host_pool, self.target.config.page_size)}

    def lock_holders(self, out: list) -> list:
        """Also the write-through, load-back and host-lock receipts."""
        cache = self.target.tree_cache
        out = out + [("device", f"hicache write-through of node {w.node_id}", w.node_id)
                     for w in cache.ongoing_write_through.values() if w.lock_params is not None]
        out += [("device", f"hicache load-back of node {lb.node_id}", lb.node_id)
                for lb in cache.ongoing_load_back.values()]
        return out + [("host", name, node) for name, node in self._host_lock_holders()]

    def _host_lock_holders(self) -> list[tuple[str, int]]:
        """``(holder, node)`` of each pending host-lock receipt: the load-backs'."""
        return [(f"hicache load-back of node {lb.node_id}", lb.node_id)
                for lb in self.target.tree_cache.ongoing_load_back.values()]

    def lock_balance(self, bad: list) -> list:
        """Also each node's net host-lock count against its host-lock receipts."""
        want: dict[int, int] = {}
        for _, node in self._host_lock_holders():
            want[node] = want.get(node, 0) + 1
        for node, have in self.host_lock_net.items():
            if have != want.get(node, 0):
                # host_lock_ref: inc_host_lock_ref - dec_host_lock_ref; the finding names the host pool's
                # padding unit (the node's host slots are not looked up by node id here)
                bad.append(LockImbalance(f"host lock on node {node}", np.zeros(1, np.int64), have, want.get(node, 0),
                                         {node}, "host", HOST_POOL))
        return bad
