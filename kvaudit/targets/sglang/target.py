"""The real-SGLang target: kvaudit's programs drive SGLang 0.5.23's own memory manager on CPU.

Three layers, a module each:

* **bootstrap** (:mod:`~kvaudit.targets.sglang.boot`) -- version probe, import stubs, objects built by
  SGLang's tree-cache factory;
* **driver** (:class:`~kvaudit.targets.sglang.driver.SglangDriver`, with
  :class:`~kvaudit.targets.sglang.intake.SglangIntake` and :mod:`~kvaudit.targets.sglang.standins`)
  -- kvaudit's ops mapped onto SGLang's scheduler-level functions in the scheduler's own order. The
  driver plays ``Scheduler`` (``managers/scheduler.py``), including its admission budget
  (``PrefillBudget``, ``schedule_policy.PrefillAdder``) and decode retraction
  (``ScheduleBatch.check_decode_mem``/``retract_decode``), so that a driver mistake never reads as an
  SGLang bug. Each method names the SGLang function whose call order it follows;
* **observer** (:class:`~kvaudit.targets.sglang.observer.SglangObserver`, with its hooks in
  :mod:`~kvaudit.targets.sglang.hooks`) -- wrappers on the allocator and request-pool *instances*
  (never the classes) that feed kvaudit's ledger, plus the roots, counters and lock holders the
  oracles read.

:class:`SglangTarget` combines the driver and the observer and builds SGLang's objects; the modes
(``pd``, ``hisparse``, ``hicache``, ``hicache_l3``) extend it.

There is no model: a sampled token is a deterministic function of the request and position, and
``stop_at`` samples EOS (token 1). No KV content is computed, so there are no shadow tags here.
"""

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
    """Drives one set of SGLang pools and one ``UnifiedRadixCache`` (see the module docstring)."""

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
        self.steps = 0
        # TpModelWorker: max_req_len = min(context_len - 1, pool tokens - 1), inputs 5 tokens shorter
        self.max_req_len = min(config.context_len - 1, config.total_tokens - 1)
        self.max_req_input_len = self.max_req_len - 5
        self.waiting: list = []  # Scheduler.waiting_queue
        self.running: list = []  # Scheduler.running_batch.reqs
        self.submitted: list[str] = []
        self.finished: set[str] = set()
        self.sessions: list[str] = []  # open session ids, in opening order
        self.session_turns: dict[str, list[str]] = {}  # session id -> its turns' rids (SessionParams.rid)
        self._n = 0
        self._opened = 0
        self._force_retract = False
        self._flushes = 0
        self._held: dict[str, tuple] = {}
        self._last: tuple[str, list, object] | None = None  # overlap: the batch whose result is still to process
        self.chunked_req = None  # Scheduler.chunked_req: the one request between prefill chunks
        self._pending_chunked_abort = None  # Scheduler._pending_chunked_abort_req
        self.retractions = 0  # requests retract_decode took out of the running batch
        self.last_retraction: str | None = None  # what the last retract_decode did (retraction())
        self._intake = None
        self._scheduled = None  # Scheduler.last_batch: the batch the latest step ran, (kind, reqs, chunked)
        self._queued = 0  # requests ever queued: their wait_queue_entry_time (FCFS order among equal priorities)
        self.scheduler_paused = False  # Scheduler._engine_paused (pause_generation in_place / retract)
        # TokenizerManager.is_pause: generate requests held until continue, as (op kind, _submit's arguments)
        self.held: list[tuple[str, tuple]] | None = None
        self.policy = None  # Scheduler.policy (SchedulePolicy), only with priority scheduling
        # flush_cache with a timeout waits for idle (is_fully_idle, never ignoring waiting requests);
        # its deadline reads the module's clock: one second a scheduler step
        import sglang.srt.managers.scheduler_components.flush_wrapper as flush_wrapper
        self.clock.install(flush_wrapper)
        self.flush_wrapper = S.SchedulerFlushWrapper(flush_cache=self._flush_cache, is_fully_idle=self.is_idle,
                                                     send_output=lambda output, request: None)
        if config.enable_priority_scheduling:
            self.policy = S.SchedulePolicy("fcfs", self.tree_cache, False, True, config.schedule_low_priority_values_first)
        self._faults = set(config.bugs)  # each fires once
        self.lock_net: dict[int, int] = {}  # node id -> incs - decs (the lock-ref ledger, per node)
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
        """The driver's modules play SGLang's scheduler: their frames are sites like SGLang's own (a free
        the driver makes itself, as flush_cache's clear(), is located there, not in kvaudit's runner).
        And the hooks' module: the host pools' wrappers (``_install_host_pool``, not an ``install_*``
        method, so its closures are not hooks) are sites too, e.g. a HiCache flush's host-pool clear()
        at ``clear_wrapper``; the recorded ledger digests depend on it."""
        return [*DRIVER_FILES, hooks.__file__]
