"""The seam of the composed SGLang target: a serving mode (HiSparse, HiCache, L3 storage, PD decode, ...)
is a :class:`SglangFeature` that :class:`~kvaudit.targets.sglang.target.SglangTarget` calls at the
points where SGLang's scheduler calls into that mode. Every hook's default does nothing.

Design notes: docs/internals/sglang.md ("The shape")."""

from __future__ import annotations


class SglangFeature:
    """One serving mode's part of a target. Observer hooks fold: each gets the result so far (the plain
    target's, then earlier features') and returns it, extended or replaced."""

    name = ""  # SglangTarget.feature(name)

    def __init__(self, target):
        self.target = target  # built before the target's SGLang objects: build() comes next

    # -- construction ------------------------------------------------------------------------------
    def build(self, config):
        """SGLang's objects for ``config`` (``boot.build``'s result) when this mode builds them (at most one
        feature of a target does); None: ``boot.build`` does."""
        return None

    def pools(self, pools: list) -> list:
        """The target's ``PoolSpec`` list, with this mode's pools."""
        return pools

    def attach(self) -> None:
        """After the target's objects and state exist: shims and wrappers on them."""

    def close(self) -> None:
        """``Target.close``: what the mode owns outside the process (a directory)."""

    # -- observer: hooks ---------------------------------------------------------------------------
    def framework_files(self, files: list[str]) -> list[str]:
        return files

    def framework_classes(self, classes: list[type]) -> list[type]:
        return classes

    def install_pool(self, spec, auditor, wrap) -> bool:
        """Wrap a pool of this mode's own kind; True if it did (else the target's ``install_pool`` does)."""
        return False

    def install_lock_ledger(self, wrap, record) -> None:
        """More lock counters than the tree's ``inc_lock_ref``/``dec_lock_ref``."""

    # -- driver ------------------------------------------------------------------------------------
    def memory_pressure(self) -> None:
        """After the tree's eviction under memory pressure."""

    def before_batch(self) -> None:
        """``get_next_batch_to_run``, after ``process_pending_chunked_abort``: events polled before admission."""

    def queued(self, req, is_retracted: bool) -> None:
        """Before ``_add_request_to_queue`` queues ``req``."""

    def prefetch(self, req) -> None:
        """``Scheduler._prefetch_kvcache`` for a request entering the waiting queue."""

    def prefetch_ready(self, req) -> bool:
        """Admission's gate for ``req``: False keeps it waiting."""
        return True

    def prefetch_after_device_hit_loss(self, req) -> bool:
        """After the match: True if ``req`` went back to prefetching (admission skips it)."""
        return False

    def new_batch(self, batch, kind: str) -> None:
        """A ``ScheduleBatch`` right after ``init_new`` (``kind``: ``"extend"`` or ``"decode"``)."""

    def join_running(self) -> bool:
        """``get_next_batch_to_run``'s merge into the running batch; True if this mode's took its place."""
        return False

    def prefilled(self, req) -> bool:
        """A prefill result that did not finish ``req``; True if this mode took it (else it joins the running
        batch)."""
        return False

    def after_decode_alloc(self, batch) -> None:
        """After ``alloc_for_decode``."""

    def after_extend_alloc(self, batch) -> None:
        """After ``alloc_for_extend`` (``prepare_for_extend``'s per-request fields a mode sets past the
        allocation)."""

    def forward(self, batch) -> None:
        """The model forward of a prefill batch (mixed-in decode rows included), as the batch stands when
        it runs: what a mode's stand-in kernel writes."""

    def spec_algorithm(self, algo):
        """The ``SpeculativeAlgorithm`` the scheduler's batches carry (``algo``: the result so far)."""
        return algo

    def decode_alloc(self, batch) -> bool:
        """``prepare_for_decode``'s allocation; True if this mode's took its place (speculative decoding)."""
        return False

    def model_result(self, kind: str, batch):
        """The model's ``GenerationBatchResult`` for ``batch`` (a ``results.result_batch``) if this mode plays
        the model's forward (a speculative verify); None: the stand-in sampler's one token per request."""
        return None

    def release(self, req) -> None:
        """Before ``release_kv_cache`` of a finished request (not inside ``process_pending_chunked_abort``,
        where SGLang 0.5.23 calls no mode's method)."""

    def after_process(self) -> None:
        """At the end of ``process_batch_result``."""

    def hisparse_coordinator(self):
        """The ``HiSparseCoordinator`` SGLang's releases are given, if this mode has one."""
        return None

    # -- observer: requests, idle state ------------------------------------------------------------
    def inflight(self, reqs: list) -> list:
        """``collect_inflight_reqs``."""
        return reqs

    def active(self, reqs: list) -> list:
        """Every request the server holds."""
        return reqs

    def place_groups(self, groups: tuple) -> tuple:
        """``(name, requests)`` of the scheduler structures, most specific first."""
        return groups

    def is_idle(self, idle: bool, ignore_waiting: bool) -> bool:
        """``is_fully_idle``."""
        return idle

    def is_idle_for_health_check(self, idle: bool) -> bool:
        return idle

    def stalled(self, stalled: bool) -> bool:
        return stalled

    def progress(self, out: dict[str, int]) -> dict[str, int]:
        return out

    def stuck(self, out: str) -> str:
        return out

    def describe_busy(self, out: str) -> str:
        return out

    # -- observer: roots and counters --------------------------------------------------------------
    def roots(self, out: list, aborting: bool) -> list:
        return out

    def units_of_rows(self, out: dict, rows) -> dict:
        return out

    def accounting(self, out: dict) -> dict:
        return out

    def free_lists(self, out: dict) -> dict:
        return out

    def lock_holders(self, out: list) -> list:
        return out

    def lock_balance(self, bad: list) -> list:
        return bad

    def engine_check(self, lines: list[str]) -> list[str]:
        """SGLang's own check's lines (``[]``: none under this mode)."""
        return lines

    def reach(self, out: dict[str, int]) -> dict[str, int]:
        """``Target.reach``: this mode's path counters (cumulative since the target was built), added to
        ``out``; a path at 0 was not searched."""
        return out

    def invariant_findings(self, out: list) -> list:
        """``Target.invariant_findings``: this mode's own invariant violations (``TargetFinding``), checked
        after every step; added to ``out``."""
        return out


class SglangLoop(SglangFeature):
    """A feature that is a second driver (PD decode): its own event loop and message handling in place of
    the shared driver's; the target delegates each of these to it. At most one per target."""

    def step(self) -> None:
        raise NotImplementedError

    def abort(self, rid: str, message: str | None) -> None:
        raise NotImplementedError

    def transfer_fail(self, handle: int | None) -> None:
        """A ``TransferFail`` op."""

    def new_req(self, rid: str, ids, sp):
        raise NotImplementedError

    def session_req(self, session, recv):
        """``Session.create_req`` for a session turn on this server (a mode that drives sessions overrides it)."""
        raise NotImplementedError(f"{self.name} drives no sessions")

    def add_request_to_queue(self, req, is_retracted: bool) -> None:
        raise NotImplementedError

    def pause_retract(self) -> None:
        raise NotImplementedError

    def continue_generation(self) -> None:
        """Before the shared ``continue_generation`` sends the held requests."""

    def active(self, reqs: list) -> list:
        """Every request the server holds: each of this loop's ``place_groups``' requests, once."""
        return list({id(r): r for _, group in self.place_groups(()) for r in group}.values())
