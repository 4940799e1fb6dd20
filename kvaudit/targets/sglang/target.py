"""The real-SGLang target: kvaudit's programs drive SGLang 0.5.23's own memory manager on CPU,
through a driver that plays the scheduler and an observer that reads SGLang's objects; no model
(a sampled token is a function of the request and position).

Design notes: docs/internals/sglang.md."""

from __future__ import annotations

from kvaudit.targets.base import PoolSpec
from kvaudit.targets.sglang import driver, hooks, intake, standins
from kvaudit.targets.sglang.boot import build, load
from kvaudit.targets.sglang.config import SglangConfig
from kvaudit.targets.sglang.driver import SglangDriver
from kvaudit.targets.sglang.observer import SglangObserver
from kvaudit.targets.sglang.standins import StepClock, step_grammar_manager

DRIVER_FILES = (driver.__file__, intake.__file__, standins.__file__)  # the modules that play SGLang's scheduler


class SglangTarget(SglangDriver, SglangObserver):
    """Drives one set of SGLang pools and one ``UnifiedRadixCache``; the modes extend it."""

    name = "sglang"

    def __init__(self, config: SglangConfig):
        S = self.S = load()
        self.config = config
        self.clock = StepClock()  # advanced by step(); a mode's _build may install it too
        o = self._build(config)
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
                                                     send_output=lambda output, request: None)
        if config.enable_priority_scheduling:
            self.policy = S.SchedulePolicy("fcfs", self.tree_cache, False, True, config.schedule_low_priority_values_first)
        self._faults = set(config.bugs)  # each fires once
        ps = config.page_size
        self._pools = [
            PoolSpec("token_to_kv_pool", self.allocator, "kv", ps, config.num_pages),
            PoolSpec("req_to_token_pool", self.req_to_token_pool, "rows", 1, self._row_count()),
        ]
        if "lock-leak" in self._faults:
            self._inject_lock_leak()

    def _build(self, config: SglangConfig):
        """SGLang's objects for ``config`` (``boot.build``); a mode with more objects extends it."""
        return build(config)

    def engine_files(self) -> list[str]:
        """The driver's modules play SGLang's scheduler: their frames are sites like SGLang's own. So are the
        hooks' host-pool wrappers (``_install_host_pool`` is no ``install_*`` method): the recorded ledger
        digests depend on it."""
        return [*DRIVER_FILES, hooks.__file__]
