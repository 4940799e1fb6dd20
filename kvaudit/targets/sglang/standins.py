"""What the driver plays in place of the parts of SGLang's scheduler that are not on this machine:
the model (a deterministic next token; ``stop_at`` samples :data:`EOS`), the clock (one second a
scheduler step), the batch's sampling state, and a grammar backend whose compiles take scheduler
steps. Frames here are the driver's (``SglangTarget.engine_files``).
"""

from __future__ import annotations

import time
from concurrent import futures
from types import SimpleNamespace

from kvaudit.targets.sglang.boot import GRAMMAR_BACKEND, one_rank_group

EOS = 1
MAX_PREFILL_TOKENS = 16384  # ServerArgs.max_prefill_tokens' default: PrefillAdder's rem_input_tokens


class StepClock:
    """A driver's clock (one second a scheduler step) as the ``time`` of the SGLang modules whose
    timeouts it drives (session timeouts, deferred flushes, PD deferred releases), so they are
    deterministic: ``monotonic()`` is the clock, everything else the real ``time``."""

    def __init__(self):
        self.now = 1000.0

    def install(self, module) -> None:
        """Be ``module.time`` (replacing whatever clock an earlier target installed there)."""
        module.time = self

    def monotonic(self) -> float:
        return self.now

    def __getattr__(self, name):
        return getattr(time, name)


class StepEvent:
    """A copy's ``finish_event`` that completes at scheduler step ``ready_at`` (a HiSparse staging
    copy, a HiCache transfer). On CPU ``torch.cpu.Event.query()`` is always True, so every copy would
    complete at the very next poll; on a GPU the copy can take longer, and a staged request then
    outlives the batch it was prefilled in (hazard A.4)."""

    def __init__(self, event, target, ready_at: int):
        self.event, self.target, self.ready_at = event, target, ready_at

    def query(self) -> bool:
        return self.target.steps >= self.ready_at and self.event.query()

    def synchronize(self) -> None:
        pass

    def __getattr__(self, name):
        return getattr(self.event, name)


class NoSampling:
    """The batch's ``sampling_info`` (penalties, temperatures: model-side, no memory). Only
    ``filter_batch`` (retraction, preemption), ``merge_batch`` (a mixed batch) and, in the legacy
    family, ``prepare_for_decode``'s penalizer check touch it here."""

    penalizer_orchestrator = SimpleNamespace(is_required=False)

    def filter_batch(self, keep_indices, keep_indices_device) -> None:
        pass

    def merge_batch(self, other) -> None:
        pass


class StepGrammarBackend:
    """kvaudit's grammar backend, registered under :data:`GRAMMAR_BACKEND` with SGLang's
    ``register_grammar_backend`` (its extension point for custom backends): a grammar "compiles" a
    number of scheduler steps after its request arrived -- the step is in the key the driver sets as
    the request's ``regex`` -- instead of on a thread pool. The future is running from the start (a
    free compile worker took it), so an abort's ``cancel()`` fails, as on a real server; the aborted
    request still leaves the queue at the next poll (``set_finish_with_abort`` drops its grammar).
    No tokenizer, no vocab masks."""

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
        """Complete the compiles due by step ``now``."""
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
        """A compiled grammar that constrains nothing (sampling is the driver's)."""

        def accept_token(self, token: int) -> None:
            pass

    S.register_grammar_backend(GRAMMAR_BACKEND, lambda *a: StepGrammarBackend(StepGrammar))
    group = SimpleNamespace(world_size=1, first_rank=0, is_first_rank=True)
    stand_in = SimpleNamespace(server_args=server_args, tokenizer=None, model_config=model_config,
                               dp_tp_cpu_group=one_rank_group(), dp_tp_group=group, pp_group=None)
    manager = S.GrammarManager(stand_in)
    manager.SGLANG_GRAMMAR_POLL_INTERVAL = 1e-4  # its poll sleeps up to this long per step (seconds)
    return manager
