"""HiCache's L3 storage tier (``--hicache-storage-backend file``, SGLang 0.5.23), a feature on top of
:mod:`~kvaudit.targets.sglang.hicache`: SGLang's ``HiCacheFile`` in a directory of the run's own,
its four storage threads replaced by a step-driven storage worker (shims H5-H7).

Design notes: docs/internals/sglang.md ("HiCache L3 storage")."""

from __future__ import annotations

import json
import os
import queue
import tempfile
import threading
import time
import weakref

import numpy as np
import torch

from kvaudit.targets.base import Accounting, Root
from kvaudit.targets.sglang.boot import SglangUnavailable
from kvaudit.targets.sglang.hicache import HOST_POOL, HiCache
from kvaudit.targets.sglang.hooks import host_units

FILE_DIR_ENV = "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"  # HiCacheFile prefers it to its configured path


class _PassEnd(Exception):
    """No item is due on a storage queue this step: ends one pass of a storage thread's loop."""


class _StepQueue(queue.Queue):
    """A storage thread's queue on the step clock (H6): an item is due ``delay`` steps after its put;
    ``get`` returns a due item or raises :class:`_PassEnd`, never blocks."""

    def __init__(self, now, delay: int):
        super().__init__()
        self._now, self._delay = now, delay

    def _put(self, item) -> None:
        self.queue.append((self._now() + self._delay, item))

    def _get(self):
        return self.queue.popleft()[1]

    def items(self) -> list:
        return [item for _, item in list(self.queue)]

    def get(self, block: bool = True, timeout: float | None = None):
        with self.mutex:
            due = bool(self.queue) and self.queue[0][0] <= self._now()
        if not due:
            raise _PassEnd
        return super().get(block=False)


class _ParkedThread:
    """A storage thread that is never started (H5)."""

    def __init__(self, target=None, daemon=None, **kwargs):
        self.target, self.daemon = target, daemon
        self.name = getattr(target, "__name__", "storage-thread")

    def start(self) -> None:
        pass

    def is_alive(self) -> bool:
        return False

    def join(self, timeout: float | None = None) -> None:
        pass


class _NoThreads:
    """``threading`` for ``managers/cache_controller.py`` (H5): threads are parked, the rest is real."""

    Thread = _ParkedThread

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name):
        return getattr(self._real, name)


def shim_storage_threads() -> str:
    """H5, idempotent. Returns the shim's name."""
    import sglang.srt.managers.cache_controller as cache_controller

    if not isinstance(cache_controller.threading, _NoThreads):
        cache_controller.threading = _NoThreads(threading)
    return "H5 cache_controller.threading.Thread -> parked (the storage threads never start)"


def install_storage_shims(target, cc, cpu: bool) -> list[str]:
    """H6 and (on a CPU device) H7 on one controller; returns the shims' names."""
    ref = weakref.ref(target)  # the controller outlives the target (init_hicache registers an atexit hook)

    def now() -> int:
        t = ref()
        return t.steps if t is not None else 0

    delay = target.config.hicache_storage_ack_steps
    for name, d in (("prefetch_queue", delay), ("prefetch_buffer", delay), ("prefetch_sync_queue", 0),
                    ("backup_queue", delay)):
        assert getattr(cc, name).empty()
        setattr(cc, name, _StepQueue(now, d))
    shims = ["H6 storage thread queues -> step queues (due hicache_storage_ack_steps after put; sync at once)"]
    if cpu:
        cc.mem_pool_host.anchor_entry.host_pool.pin_memory = False
        shims.append("H7 anchor host pool pin_memory=False (the storage read's bounce page)")
    return shims


def load_storage_hash() -> None:
    """Build SGLang's native storage hash now (``mem_cache/cpp_utils/native_hash.py``, JIT-compiled with
    ninja on first use): inside the first prefetch's step it took 10 s and more, which the step watchdog
    reported as a hang. A release without it hashes in Python; a failing build fails later, in SGLang."""
    try:
        from sglang.srt.mem_cache.cpp_utils.native_hash import _load_native_hash_module
    except ImportError:
        return
    try:
        _load_native_hash_module()
    except RuntimeError:
        pass


class HiCacheL3(HiCache):
    """:class:`HiCache` with SGLang's L3 storage tier (``config.hicache_storage_backend``)."""

    name = "hicache"  # (SglangTarget.feature("hicache"): the host tier is this feature's too)

    def __init__(self, target):
        if os.environ.get(FILE_DIR_ENV):
            raise SglangUnavailable(f"unset {FILE_DIR_ENV}: HiCacheFile would write there instead of the run's own "
                                    "directory, and runs would share what they stored")
        super().__init__(target)
        self.storage_dir = tempfile.TemporaryDirectory(prefix="kvaudit-hicache-l3-")  # removed by close()
        # ("prefetch", step, rid, tokens asked) ("query", step, rid, hit tokens) ("transfer", step, rid, tokens)
        # ("loaded", step, rid, tokens) ("backup", step, tokens written)
        self.storage_log: list[tuple] = []

    def attach(self) -> None:
        super().attach()
        load_storage_hash()  # (after SGLang is loaded: boot.load installs what its imports need)
        cc, t = self.cache_controller, self.target
        if not (cc.enable_storage and t.tree_cache.enable_storage):
            raise SglangUnavailable(f"SGLang {t.S.version} did not attach the {t.config.hicache_storage_backend} "
                                    "storage backend")
        self.shims += install_storage_shims(t, cc, self._cpu)
        self._observe_storage(cc)
        # the timeout policy's deadlines (PollTimer: time.perf_counter) on the step clock, until close()
        import sglang.srt.utils.poll_timer as poll_timer
        self._poll_timer = poll_timer
        t.clock.install(poll_timer, perf_counter=True)
        self._count_deadlines(t.tree_cache)
        self._fail_storage(cc.storage_backend)

    def close(self) -> None:
        """Remove the run's storage directory now (``AuditedRun.close``), not when the cycle collector frees
        the target: a campaign would pile them up meanwhile. The poll timer's clock is the real one again."""
        self.storage_dir.cleanup()
        if getattr(self, "_poll_timer", None) is not None:
            self._poll_timer.time = time  # the module's own ``import time``

    def _count_deadlines(self, cache) -> None:
        """Counts ``_mark_prefetch_deadline_expired`` (a prefetch the timeout policy ended): a wrapper on the
        tree *instance*."""
        mark = cache._mark_prefetch_deadline_expired
        self.deadlines_expired = 0

        def counted(operation):
            self.deadlines_expired += 1
            return mark(operation)

        cache._mark_prefetch_deadline_expired = counted

    def _fail_storage(self, backend) -> None:
        """Every ``hicache_storage_fail_every``-th storage read or write fails whole, as a backend that is down
        answers ``HiCacheFile``'s API: ``batch_get`` no page (``None`` each), ``batch_set`` False; SGLang's
        ``_generic_page_get`` then loads nothing and ``_page_backup`` stops. Wrappers on the backend *instance*."""
        every, calls = self.target.config.hicache_storage_fail_every, [0]
        self.storage_failures = 0
        if every is None:
            return
        get, put = backend.batch_get, backend.batch_set

        def fails() -> bool:
            calls[0] += 1
            failed = calls[0] % every == 0
            self.storage_failures += failed
            return failed

        backend.batch_get = lambda keys, *a, **k: [None] * len(keys) if fails() else get(keys, *a, **k)
        backend.batch_set = lambda keys, *a, **k: False if fails() else put(keys, *a, **k)

    def reach(self, out: dict[str, int]) -> dict[str, int]:
        """:meth:`HiCache.reach`'s, then ``storage_loads``: admissions that took KV prefetched from storage; ``prefetch_deadlines`` (timeout
        policy only): prefetches it ended; ``storage_failures`` (with ``hicache_storage_fail_every``): failed
        storage reads and writes."""
        cfg = self.target.config
        out = {**super().reach(out), "storage_loads": sum(1 for e in self.storage_log if e[0] == "loaded" and e[3] > 0)}
        if cfg.hicache_storage_prefetch_policy == "timeout":  # the only policy with a deadline
            out["prefetch_deadlines"] = self.deadlines_expired
        if cfg.hicache_storage_fail_every is not None:
            out["storage_failures"] = self.storage_failures
        return out

    def _storage_server_args(self) -> dict:
        cfg = self.target.config
        extra = {"prefetch_threshold": cfg.hicache_storage_prefetch_threshold,
                 "prefetch_timeout_base": cfg.hicache_storage_prefetch_timeout_steps,
                 "prefetch_timeout_per_ki_token": 0,
                 "file_storage_path": self.storage_dir.name,
                 "enable_metadata_cache": False, "max_size": 0, "min_free_space": 0}
        return dict(hicache_storage_backend=cfg.hicache_storage_backend,
                    hicache_storage_prefetch_policy=cfg.hicache_storage_prefetch_policy,
                    hicache_storage_backend_extra_config=json.dumps(extra))

    def build(self, config):
        h5 = shim_storage_threads()  # before the controller attaches the backend (its threads start there)
        o = super().build(config)  # (build() states this process's place in the pipeline: the storage config reads it)
        self.shims.append(h5)
        return o

    def _observe_storage(self, cc) -> None:
        """Log the storage worker's work into :attr:`storage_log`."""
        log, t = self.storage_log, self.target
        ps = t.config.page_size
        query, transfer, backup = cc._storage_hit_query, cc._page_transfer_kv_batch, cc._page_backup

        def query_wrapper(operation):
            hashes, hit = query(operation)
            log.append(("query", t.steps, operation.request_id, hit))
            return hashes, hit

        def transfer_wrapper(operation, *a, **k):
            pages = transfer(operation, *a, **k)
            log.append(("transfer", t.steps, operation.request_id, pages * ps))
            return pages

        def backup_wrapper(operation):
            out = backup(operation)
            log.append(("backup", t.steps, operation.completed_tokens))
            return out

        cc._storage_hit_query, cc._page_transfer_kv_batch, cc._page_backup = query_wrapper, transfer_wrapper, \
            backup_wrapper

    # -- driver -------------------------------------------------------------------------------
    def _run_storage_threads(self) -> None:
        """The storage worker: one pass of each storage thread's own loop, in data-flow order, until its
        queue has no item due this step."""
        cc = self.cache_controller
        if not cc.enable_storage:
            return
        for loop in (cc.prefetch_thread_func, cc.prefetch_io_aux_func, cc.prefetch_sync_thread_func,
                     cc.backup_thread_func):
            try:
                loop()
            except _PassEnd:
                pass

    def _process_hicache_events(self) -> None:
        """``Scheduler._process_hicache_events`` with storage: the worker's pass, ``check_hicache_events``,
        then ``_process_storage_prefetch_retries``."""
        self._run_storage_threads()
        super()._process_hicache_events()
        self._process_storage_prefetch_retries()

    def _process_storage_prefetch_retries(self) -> None:
        """``Scheduler._process_storage_prefetch_retries`` (``pop_ready`` counts passes, not time)."""
        from sglang.srt.runtime_context import get_memory

        memory = get_memory()
        for req, storage_hit_end in self.target.tree_cache.storage_prefetch_retries.pop_ready(
                self.target.waiting, memory.hicache_storage_prefetch_retry_poll_interval,
                memory.hicache_storage_prefetch_retry_max_attempts):
            self._retry_storage_prefetch(req, storage_hit_end)

    def _retry_storage_prefetch(self, req, storage_hit_end=None) -> None:
        req.storage_prefetch_retry_attempts += 1
        self.prefetch(req, storage_hit_end)

    def queued(self, req, is_retracted: bool) -> None:
        """A retracted request's storage bookkeeping starts over."""
        if is_retracted:
            req.storage_prefetch_retry_attempts = 0
            req.storage_prefetch_last_match_len = None
            req.staged_prefetch_plan = None

    def prefetch(self, req, storage_hit_end=None) -> None:
        """``Scheduler._prefetch_kvcache`` (cache mode): from a backed-up (or root) last host node, prefetch
        the tokens beyond the device and host match."""
        cache = self.target.tree_cache
        req.init_next_round_input(cache, cow_mamba=False)
        last_host_node = req.last_host_node
        matched_len = req.prefix_len + req.host_hit_length
        req.storage_prefetch_last_match_len = matched_len
        if not (cache.is_backuped(last_host_node) or cache.is_root(last_host_node)):
            return
        fill = req.full_untruncated_fill_ids
        new_input_tokens = fill[matched_len:req._compute_max_prefix_len(len(fill))]
        prefix_keys = cache.get_prefix_hash_values(last_host_node) if cache.hicache_storage_pass_prefix_keys else None
        handle = req.cache_request_handle
        cache.prefetch_from_storage(handle, last_host_node, new_input_tokens, cache.get_last_hash_value(last_host_node),
                                    prefix_keys, matched_prefix_tokens=fill[:matched_len], extra_key=req.extra_key,
                                    cache_salt=req.cache_salt, storage_hit_end=storage_hit_end)
        if handle in cache.ongoing_prefetch:
            asked = len(cache.ongoing_prefetch[handle].prefetch_key)
            self.storage_log.append(("prefetch", self.target.steps, req.rid, asked))

    def prefetch_ready(self, req) -> bool:
        """Admission's storage gate: ``check_prefetch_progress``, then ``pop_prefetch_loaded_span`` (the
        request's ``storage_hit_length``)."""
        cache = self.target.tree_cache
        if not cache.check_prefetch_progress(req.cache_request_handle):
            return False
        loaded, start = cache.pop_prefetch_loaded_span(req.cache_request_handle)
        if loaded > 0:
            req.storage_hit_length, req.storage_hit_start, req.host_hit_is_storage = loaded, start, False
            self.storage_log.append(("loaded", self.target.steps, req.rid, loaded))
        return True

    def prefetch_after_device_hit_loss(self, req) -> bool:
        """``Scheduler._prefetch_after_device_hit_loss``."""
        from sglang.srt.runtime_context import get_memory

        previous = req.storage_prefetch_last_match_len
        if not previous:
            return False
        current = req.prefix_len + req.host_hit_length
        if current >= previous:
            return False
        if req.storage_prefetch_retry_attempts >= get_memory().hicache_storage_prefetch_retry_max_attempts:
            req.storage_prefetch_last_match_len = current
            return False
        self._retry_storage_prefetch(req)
        return True

    def new_batch(self, batch, kind: str) -> None:
        """A prefill batch's requests leave the retry set (``retries.cancel``)."""
        if kind == "extend":
            for req in batch.reqs:
                self.target.tree_cache.storage_prefetch_retries.cancel(req.rid)
        super().new_batch(batch, kind)

    def is_idle(self, idle: bool, ignore_waiting: bool) -> bool:
        """``is_fully_idle`` with storage: also no prefetch or storage backup pending."""
        cache = self.target.tree_cache
        return super().is_idle(idle, ignore_waiting) and not cache.ongoing_prefetch and not cache.ongoing_backup

    def stuck(self, out: str) -> str:
        """Also ``hicache:storage`` (a prefetch or storage backup pending)."""
        cache = self.target.tree_cache
        return super().stuck(out) or ("hicache:storage" if cache.ongoing_prefetch or cache.ongoing_backup else "")

    def describe_busy(self, out: str) -> str:
        cache = self.target.tree_cache
        return (super().describe_busy(out) + f" prefetch_inflight={len(cache.ongoing_prefetch)} "
                f"backup_inflight={len(cache.ongoing_backup)}")

    # -- observer -----------------------------------------------------------------------------
    def _inflight_prefetch_operations(self) -> list:
        """Queued prefetch operations with host buffers, once each, in queue order."""
        cc = self.cache_controller
        candidates = cc.prefetch_buffer.items()
        candidates += [ack.operation for ack in cc.prefetch_sync_queue.items() + list(cc.ack_prefetch_queue.queue)
                       if ack is not None]
        return list({id(op): op for op in candidates if op is not None and op.host_indices is not None}.values())

    def storage_host_slots(self) -> list[tuple[str, torch.Tensor]]:
        """Host slots storage work holds, as ``(owner, [n] int64 slots)``: in-flight prefetches' buffers, a
        terminated prefetch's tail until its ack, and the pages queued for release."""
        cache, cc = self.target.tree_cache, self.cache_controller
        out = [(f"prefetch:{h.rid}", info.host_indices) for h, info in cache.ongoing_prefetch.items()
               if info.host_indices is not None]
        for op in self._inflight_prefetch_operations():
            info = cache.ongoing_prefetch.get(op.handle)
            if info is None or info.operation is not op:
                out.append((f"prefetch:{op.request_id}", op.host_indices[op.completed_tokens:]))
        release = [p for p in list(cc.host_mem_release_queue.queue) if p is not None]
        if release:
            out.append(("host_mem_release_queue", torch.cat(release)))
        return [(owner, slots.to(torch.int64)) for owner, slots in out if slots.numel()]

    def _host_roots(self) -> list[Root]:
        """Also the host slots storage work holds (role ``req``: counted as ``uncached``)."""
        ps = self.target.config.page_size
        held = [Root(HOST_POOL, owner, host_units(slots, ps)) for owner, slots in self.storage_host_slots()]
        tree = super()._host_roots()
        if held and tree and not self.python_core:
            taken = np.concatenate([r.units for r in held])
            tree = [Root(HOST_POOL, r.owner, np.setdiff1d(r.units, taken), role=r.role) for r in tree]
        return tree + held

    def accounting(self, out: dict) -> dict:
        """Rust core: less the host tokens storage work holds (the oracle counts those as ``uncached``)."""
        out = super().accounting(out)
        if not self.python_core:
            ps = self.target.config.page_size
            held = [host_units(slots, ps) for _, slots in self.storage_host_slots()]
            tokens = int(np.unique(np.concatenate(held)).size) * ps if held else 0
            a = out[HOST_POOL]
            out[HOST_POOL] = Accounting(a.available, a.evictable - tokens, a.protected, a.session_held, a.total)
        return out

    def _host_lock_holders(self) -> list:
        """Also each in-flight prefetch's anchor and each storage backup's node."""
        cache = self.target.tree_cache
        out = super()._host_lock_holders()
        out += [(f"hicache prefetch of node {info.anchor_node_id}", info.anchor_node_id)
                for info in cache.ongoing_prefetch.values() if info.anchor_lock_params is not None]
        out += [(f"hicache storage backup of node {node}", node) for node, _ in cache.ongoing_backup.values()]
        return out
