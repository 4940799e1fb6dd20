"""The real-SGLang target: kvaudit's programs drive SGLang 0.5.23's own memory manager on CPU,
through a driver that plays the scheduler and an observer that reads SGLang's objects, composed with
the serving modes' features (:mod:`~kvaudit.targets.sglang.feature`); no model (a sampled token is a
function of the request and position).

Design notes: docs/internals/sglang.md."""

from __future__ import annotations

from types import SimpleNamespace

from kvaudit.targets.base import PoolSpec
from kvaudit.targets.sglang import compat, driver, hooks, intake, standins
from kvaudit.targets.sglang.boot import build, load
from kvaudit.targets.sglang.config import SglangConfig
from kvaudit.targets.sglang.driver import SglangDriver
from kvaudit.targets.sglang.feature import SglangFeature, SglangLoop
from kvaudit.targets.sglang.observer import SglangObserver
from kvaudit.targets.sglang.standins import StepClock, step_grammar_manager

DRIVER_FILES = (driver.__file__, intake.__file__, standins.__file__)  # the modules that play SGLang's scheduler


def features(config: SglangConfig) -> list[type[SglangFeature]]:
    """The feature classes ``config`` asks for (imported only then: each loads its SGLang modules)."""
    out: list[type[SglangFeature]] = []
    if config.disaggregation_mode == "decode":
        from kvaudit.targets.sglang.pd import PdDecode
        out.append(PdDecode)
    if config.disaggregation_mode == "prefill":
        from kvaudit.targets.sglang.pd_prefill import PdPrefill
        out.append(PdPrefill)
    if config.enable_hisparse:
        from kvaudit.targets.sglang.hisparse import HiSparse
        out.append(HiSparse)
    if config.hicache_storage_backend is not None:  # L3 storage extends HiCache
        from kvaudit.targets.sglang.hicache_l3 import HiCacheL3
        out.append(HiCacheL3)
    elif config.enable_hierarchical_cache:
        from kvaudit.targets.sglang.hicache import HiCache
        out.append(HiCache)
    if config.sliding_window_size is not None:
        from kvaudit.targets.sglang.swa import SwaHybrid
        out.append(SwaHybrid)
    if config.enable_mamba:
        from kvaudit.targets.sglang.mamba import Mamba
        out.append(Mamba)
    if config.speculative_algorithm is not None:
        from kvaudit.targets.sglang.spec import SpecDecode
        out.append(SpecDecode)
    return out


def _flush_reply_sink(version: str) -> dict:
    """The keyword SchedulerFlushWrapper (managers/scheduler_components/flush_wrapper.py) answers a
    deferred flush_cache through, as one that drops the reply (there is no tokenizer manager): the
    ``send_output`` callable from 0.5.23, before it the scheduler's ``ipc_channels`` (compat change
    ``flush-send-output``)."""
    def drop(output, request):
        return None

    if compat.has("flush-send-output", version):
        return {"send_output": drop}
    return {"ipc_channels": SimpleNamespace(send_to_tokenizer=SimpleNamespace(send_output=drop))}


class SglangTarget(SglangDriver, SglangObserver):
    """Drives one set of SGLang pools and one ``UnifiedRadixCache``, with the features ``config`` asks for
    (``self.features``); a :class:`SglangLoop` among them (``self.loop``) is the scheduler loop. The
    methods that only combine the features' hooks are made from :data:`SEAMS`."""

    name = "sglang"

    def __init__(self, config: SglangConfig):
        S = self.S = load()
        self.config = config
        self.clock = StepClock()  # advanced by step(); a feature's build may install it too
        self.features = [cls(self) for cls in features(config)]
        self._folders: dict[str, list[SglangFeature]] = {}  # hook -> the features that define it (_fold)
        loops = [f for f in self.features if isinstance(f, SglangLoop)]
        assert len(loops) <= 1, loops
        self.loop = loops[0] if loops else None
        self._chunked_abort = False  # inside process_pending_chunked_abort: no feature's release()
        self._batch_paths = dict.fromkeys(
            [k for k, on in (("chunks_parked", config.chunked_prefill_size is not None  # (PD prefill: prefill_chunks_sent)
                                               and config.disaggregation_mode != "prefill"),
                             ("mixed_batches", config.enable_mixed_chunk), ("deferred_finishes", config.enable_overlap))
             if on], 0)  # reach()'s counts of the results processed (_process)
        built = [o for o in (f.build(config) for f in self.features) if o is not None]
        assert len(built) <= 1, "two features built SGLang's objects"
        o = built[0] if built else build(config)
        self.allocator, self.req_to_token_pool, self.tree_cache = o.allocator, o.req_to_token_pool, o.tree_cache
        self.model_config, self.tree_core = o.model_config, o.tree_core
        # Scheduler.grammar_manager (a PD decode server's stand-in has its own)
        self.grammar_manager = step_grammar_manager(S, o.server_args, o.model_config) \
            if config.disaggregation_mode == "null" else None
        self.session_controller = S.SessionController(self.tree_cache) if config.enable_streaming_session else None
        if self.session_controller is not None:
            # the session timeout's clock (Session.is_timed_out: time.monotonic()) is the step count
            import sglang.srt.session.session_controller as session_controller
            self.clock.install(session_controller)
        self._init_state(config)
        # flush_cache with a timeout waits for idle (is_fully_idle, never ignoring waiting requests);
        # its deadline reads the module's clock: one second a scheduler step
        import sglang.srt.managers.scheduler_components.flush_wrapper as flush_wrapper
        self.clock.install(flush_wrapper)
        self.flush_wrapper = S.SchedulerFlushWrapper(flush_cache=self._flush_cache, is_fully_idle=self.is_idle,
                                                     **_flush_reply_sink(S.version))
        if config.enable_priority_scheduling:
            self.policy = S.SchedulePolicy("fcfs", self.tree_cache, False, True, config.schedule_low_priority_values_first)
        self._faults = set(config.bugs)  # each fires once
        ps = config.page_size
        self._pools = [
            PoolSpec("token_to_kv_pool", self.allocator, "kv", ps, config.num_pages),
            PoolSpec("req_to_token_pool", self.req_to_token_pool, "rows", 1, self._row_count()),
        ]
        self._count_evictions_for_alloc()
        if "lock-leak" in self._faults:
            self._inject_lock_leak()
        for f in self.features:
            self._pools = f.pools(self._pools)
            f.attach()

    def _count_evictions_for_alloc(self) -> None:
        """Counts the tree's ``evict_for_alloc`` calls that gave tokens up (an allocation short of free
        slots, ``TokenToKVPoolAllocator.evict_to_free_tokens``): where ``--radix-eviction-policy`` picks the
        leaves; ``memory_pressure`` evicts everything, in any order. A wrapper on the tree *instance*."""
        tree, evict_for_alloc = self.tree_cache, self.tree_cache.evict_for_alloc
        self.evictions_for_alloc = 0

        def counted(*args, **kwargs):
            before = tree.evictable_size()
            out = evict_for_alloc(*args, **kwargs)
            self.evictions_for_alloc += tree.evictable_size() < before
            return out

        tree.evict_for_alloc = counted

    def feature(self, name: str) -> SglangFeature | None:
        """The feature called ``name``, if this target has it."""
        return next((f for f in self.features if f.name == name), None)

    def _fold(self, hook: str, value, *args):
        """``value`` through each feature's ``hook`` (a :class:`SglangFeature` method), in order; a feature
        whose ``hook`` is the base class's (which returns ``value``) is passed over."""
        folders = self._folders.get(hook)
        if folders is None:  # (asked several times a check: the features that define hook, found once)
            base = getattr(SglangFeature, hook)
            folders = self._folders[hook] = [f for f in self.features
                                             if getattr(type(f), hook) is not base or hook in vars(f)]
        for f in folders:
            value = getattr(f, hook)(value, *args)
        return value

    def checking(self):
        """Within one check the live requests and the counters are read once: ``_active`` (the roots, the
        engine's own check, the metrics, the lock holders each walk it), ``_place_groups`` (the roots'
        places; a loop's ``active`` walks its queues too) and ``accounting`` (the identity and the engine's
        own check) give the first call's answer (a copy of the list). The engine is not stepped inside a
        check, so they are the same."""
        return _CheckScope(self)

    _memo: dict | None = None  # inside a check (_CheckScope): what was read once

    def _once(self, key: str, read):
        """``read()``, or inside a check the answer of its first call (under ``key``)."""
        memo = self._memo
        if memo is None:
            return read()
        out = memo.get(key)
        if out is None:
            out = memo[key] = read()
        return out

    def close(self) -> None:
        for f in self.features:
            f.close()

    def engine_files(self) -> list[str]:
        """The driver's modules play SGLang's scheduler: their frames are sites like SGLang's own. So are the
        hooks' host-pool wrappers (``_install_host_pool`` is no ``install_*`` method): the recorded ledger
        digests depend on it."""
        return [*DRIVER_FILES, hooks.__file__]

    # -- the loop: a SglangLoop feature's, else the shared driver's -----------------------------------
    def _abort(self, rid: str, message: str | None = None) -> None:
        if self.loop is not None:
            return self.loop.abort(rid, message)
        super()._abort(rid, message)

    def _transfer_fail(self, handle: int | None) -> None:
        if self.loop is not None:
            self.loop.transfer_fail(handle)

    def _add_request_to_queue(self, req, is_retracted: bool = False) -> None:
        if self.loop is not None:
            return self.loop.add_request_to_queue(req, is_retracted)
        for f in self.features:
            f.queued(req, is_retracted)
        super()._add_request_to_queue(req, is_retracted)

    def _continue_generation(self) -> None:
        if self.loop is not None:
            self.loop.continue_generation()
        super()._continue_generation()

    # -- driver seams -----------------------------------------------------------------------------
    def _memory_pressure(self) -> None:
        super()._memory_pressure()
        for f in self.features:
            f.memory_pressure()

    def _process_pending_chunked_abort(self) -> None:
        self._chunked_abort = True
        try:
            super()._process_pending_chunked_abort()
        finally:
            self._chunked_abort = False
        for f in self.features:
            f.before_batch()

    def _prefetch_ready(self, req) -> bool:
        return all(f.prefetch_ready(req) for f in self.features)

    def _prefetch_after_device_hit_loss(self, req) -> bool:
        return any(f.prefetch_after_device_hit_loss(req) for f in self.features)

    def _model_result(self, kind: str, batch):
        out = next((r for r in (f.model_result(kind, batch) for f in self.features) if r is not None), None)
        return super()._model_result(kind, batch) if out is None else out

    def _release(self, req, checkpoint: bool) -> None:
        if not self._chunked_abort:
            for f in self.features:
                f.release(req)
        super()._release(req, checkpoint)

    def _process(self, kind: str, reqs: list, chunked=None, decoding=()) -> None:
        paths = self._batch_paths
        live = [r for r in reqs if not r.finished()] if "deferred_finishes" in paths else ()
        super()._process(kind, reqs, chunked, decoding)
        for f in self.features:
            f.after_process()
        if paths:
            self._count_batch(paths, kind, chunked, decoding, live)

    def _count_batch(self, paths: dict[str, int], kind: str, chunked, decoding, live) -> None:
        """reach()'s counts of one processed result: with chunked prefill, ``chunks_parked`` (prefill batches
        that left a request parked as ``chunked_req``, its next chunk in a later batch); with mixed chunk,
        ``mixed_batches`` (prefill batches whose running requests decoded in them); under overlap,
        ``deferred_finishes`` (requests ``live`` before the result, processed one step late, that it finished)."""
        if kind == "extend" and chunked is not None and "chunks_parked" in paths:
            paths["chunks_parked"] += 1
        if kind == "extend" and decoding and "mixed_batches" in paths:
            paths["mixed_batches"] += 1
        if live:
            paths["deferred_finishes"] += sum(r.finished() for r in live)

    def _hisparse_coordinator(self):
        return next((c for c in (f.hisparse_coordinator() for f in self.features) if c is not None), None)

    # -- observer ---------------------------------------------------------------------------------
    def install_lock_ledger(self, wrap, record) -> None:
        super().install_lock_ledger(wrap, record)
        for f in self.features:
            f.install_lock_ledger(wrap, record)

    def _active(self) -> list:
        read = super()._active
        return list(self._once("active", lambda: self._fold("active", read())))  # (callers extend it)

    def _place_groups(self) -> tuple:
        read = super()._place_groups
        return self._once("place_groups", lambda: self._fold("place_groups", read()))

    def is_idle(self, ignore_waiting: bool = False) -> bool:
        return self._fold("is_idle", super().is_idle(ignore_waiting), ignore_waiting)

    def roots(self, aborting: bool = True) -> list:
        return self._fold("roots", super().roots(aborting), aborting)

    def accounting(self) -> dict:
        read = super().accounting
        return dict(self._once("accounting", lambda: self._fold("accounting", read())))

    def reach(self) -> dict[str, int]:
        """The shared driver's counters (requests retracted, by decode retraction or priority preemption,
        and with priority scheduling those preempted; with sessions, turns sent into an open session; allocations
        that evicted from the tree, not with the tree off, where nothing is evictable; SGLang's result processing:
        ``results_reach``; the chunked, mixed and overlap paths of :meth:`_count_batch`), then each feature's."""
        more = {"priority_preemptions": self.priority_preemptions} if self.config.enable_priority_scheduling else {}
        if not self.tree_cache.disable:
            more["evictions_for_alloc"] = self.evictions_for_alloc
        if self.session_controller is not None:
            more["session_turns"] = sum(map(len, self.session_turns.values()))
        return self._fold("reach", {"retractions": self.retractions, **more, **self.results_reach(), **self._batch_paths})


def _seam(name: str, hook: str, combine: str):
    """``SglangTarget.<name>`` of a :data:`SEAMS` row: the features' ``hook`` combined by ``combine``."""
    def fold(self, *args):
        return self._fold(hook, getattr(super(SglangTarget, self), name)(*args), *args)

    def each(self, *args) -> None:
        for f in self.features:
            getattr(f, hook)(*args)

    def unless_taken(self, *args) -> None:
        if not any([getattr(f, hook)(*args) for f in self.features]):
            getattr(super(SglangTarget, self), name)(*args)

    def loop(self, *args):
        if self.loop is not None:
            return getattr(self.loop, hook)(*args)
        return getattr(super(SglangTarget, self), name)(*args)

    method = {"fold": fold, "each": each, "unless_taken": unless_taken, "loop": loop}[combine]
    method.__name__, method.__qualname__ = name, f"SglangTarget.{name}"
    return method


# SglangTarget's methods that only combine the features' hooks (SglangFeature / SglangLoop methods):
# (method, hook, how). fold: the shared driver's or observer's answer through each feature's hook, in
# order (_fold); each: every feature's hook, in order (the shared method does nothing); unless_taken: every
# feature's hook, then the shared method unless one took the call (returned true); loop: the SglangLoop
# feature's hook if there is one, else the shared method. (Every argument positional.)
SEAMS = (
    ("step", "step", "loop"), ("_new_req", "new_req", "loop"), ("_create_session_req", "session_req", "loop"),
    ("_pause_retract", "pause_retract", "loop"),
    ("_prefetch_kvcache", "prefetch", "each"), ("_new_batch", "new_batch", "each"),
    ("_after_decode_alloc", "after_decode_alloc", "each"), ("_after_extend_alloc", "after_extend_alloc", "each"),
    ("_forward", "forward", "each"),
    ("_join_running", "join_running", "unless_taken"), ("_prefilled", "prefilled", "unless_taken"),
    ("_decode_alloc", "decode_alloc", "unless_taken"), ("install_pool", "install_pool", "unless_taken"),
    ("_spec_algorithm", "spec_algorithm", "fold"), ("_inflight", "inflight", "fold"),
    ("units_of_rows", "units_of_rows", "fold"), ("framework_files", "framework_files", "fold"),
    ("framework_classes", "framework_classes", "fold"), ("is_idle_for_health_check", "is_idle_for_health_check", "fold"),
    ("stalled", "stalled", "fold"), ("progress", "progress", "fold"), ("stuck", "stuck", "fold"),
    ("describe_busy", "describe_busy", "fold"), ("free_lists", "free_lists", "fold"),
    ("lock_holders", "lock_holders", "fold"), ("lock_balance", "lock_balance", "fold"),
    ("engine_check", "engine_check", "fold"), ("invariant_findings", "invariant_findings", "fold"),
)
for _row in SEAMS:
    setattr(SglangTarget, _row[0], _seam(*_row))


class _CheckScope:
    """:meth:`SglangTarget.checking`: a fresh memo for the check, the previous one (an outer check's) back
    on exit."""

    __slots__ = ("target", "prev")

    def __init__(self, target: SglangTarget):
        self.target = target

    def __enter__(self) -> None:
        self.prev, self.target._memo = self.target._memo, {}

    def __exit__(self, *exc) -> None:
        self.target._memo = self.prev
