"""What the driver plays in place of what is not on this machine: the model (``stop_at`` samples
:data:`EOS`), the clock (one second a scheduler step), the batch's sampling state, and a grammar
backend whose compiles take scheduler steps."""

from __future__ import annotations

import time
from concurrent import futures
from types import SimpleNamespace

from kvaudit.targets.sglang.boot import GRAMMAR_BACKEND, one_rank_group

EOS = 1
MAX_PREFILL_TOKENS = 16384  # ServerArgs.max_prefill_tokens' default: PrefillAdder's rem_input_tokens


class StepClock:
    """A driver's clock as the ``time`` of the SGLang modules whose timeouts it drives: ``monotonic()``
    is the step clock, everything else the real ``time``."""

    def __init__(self):
        self.now = 1000.0

    def install(self, module, perf_counter: bool = False) -> None:
        """``module.time`` becomes this clock; with ``perf_counter`` its ``perf_counter()`` too (a module that
        times deadlines with it, as ``sglang.srt.utils.poll_timer``)."""
        module.time = _StepPerfCounter(self) if perf_counter else self

    def monotonic(self) -> float:
        return self.now

    def __getattr__(self, name):
        return getattr(time, name)


class _StepPerfCounter:
    """A :class:`StepClock` whose ``perf_counter()`` is the step clock too."""

    def __init__(self, clock: StepClock):
        self.clock = clock

    def perf_counter(self) -> float:
        return self.clock.now

    def __getattr__(self, name):
        return getattr(self.clock, name)


class StepEvent:
    """A copy's ``finish_event`` that completes at step ``ready_at``: on CPU every copy would be done at
    the next poll, on a GPU it can outlive its batch (hazard A.4)."""

    def __init__(self, event, target, ready_at: int):
        self.event, self.target, self.ready_at = event, target, ready_at

    def query(self) -> bool:
        return self.target.steps >= self.ready_at and self.event.query()

    def synchronize(self) -> None:
        pass

    def __getattr__(self, name):
        return getattr(self.event, name)


class NoSampling:
    """The batch's ``sampling_info`` (model-side, no memory): what ``filter_batch`` and ``merge_batch`` call."""

    penalizer_orchestrator = SimpleNamespace(is_required=False)

    def filter_batch(self, keep_indices, keep_indices_device) -> None:
        pass

    def merge_batch(self, other) -> None:
        pass


class StepGrammarBackend:
    """kvaudit's grammar backend (SGLang's ``register_grammar_backend``): a grammar compiles at the step
    in its key, on a future already running, so an abort's ``cancel()`` fails as on a real server."""

    enable_strict_thinking = False

    def __init__(self, grammar_cls):
        self.grammar_cls = grammar_cls
        self.pending: list[tuple[int, futures.Future]] = []

    def get_request_grammar_key(self, key, input_ids=None, thinking_budget=None):
        return key

    def get_cached_or_future_value(self, key, require_reasoning):
        f = futures.Future()
        f.set_running_or_notify_cancel()
        self.pending.append((int(key[1].split(":")[1]), f))
        return f, False

    def tick(self, now: int) -> None:
        due = [f for at, f in self.pending if at <= now]
        self.pending = [(at, f) for at, f in self.pending if at > now]
        for f in due:
            f.set_result(self.grammar_cls())

    def set_cache(self, key, value) -> None:
        pass

    def reset(self) -> None:
        pass


def step_grammar_manager(S, server_args, model_config):
    """SGLang's own ``GrammarManager`` for a one-rank scheduler, over :class:`StepGrammarBackend`."""

    class StepGrammar(S.BaseGrammarObject):

        def accept_token(self, token: int) -> None:
            pass

    S.register_grammar_backend(GRAMMAR_BACKEND, lambda *a: StepGrammarBackend(StepGrammar))
    group = SimpleNamespace(world_size=1, first_rank=0, is_first_rank=True)
    stand_in = SimpleNamespace(server_args=server_args, tokenizer=None, model_config=model_config,
                               dp_tp_cpu_group=one_rank_group(), dp_tp_group=group, pp_group=None,
                               ps=SimpleNamespace(pp_rank=0, pp_size=1))  # (0.5.20 reads the stage here)
    manager = S.GrammarManager(stand_in)
    manager.SGLANG_GRAMMAR_POLL_INTERVAL = 1e-4  # its poll sleeps up to this long per step (seconds)
    return manager
