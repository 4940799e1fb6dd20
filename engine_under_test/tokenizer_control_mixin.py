"""The client side: what SGLang's tokenizer manager sends the scheduler, queued as messages that
:meth:`Scheduler.process_input_requests` takes in at the next step.

SGLang 0.5.23 keeps these entry points apart from the event loop: ``srt/managers/tokenizer_manager.py``
(``generate_request``, ``abort_request``, ``pause_generation``, ``continue_generation``) and
``srt/managers/tokenizer_control_mixin.py`` (``TokenizerControlMixin``: ``flush_cache``,
``open_session``, ``close_session``); health checks are ``entrypoints/http_server.py``'s
``/health_generate``.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine_under_test.req import HEALTH_CHECK_RID_PREFIX, Req


@dataclass
class _Msg:
    kind: str  # "generate" | "abort" | "health_check" | "flush_cache" | "open_session" | "close_session"
    #            | "memory_pressure" | "pause_generation" | "continue_generation"
    req: Req | None = None
    rid: str | None = None
    abort_all: bool = False
    session_id: str | None = None
    mode: str | None = None  # pause_generation: "in_place" | "retract"


class TokenizerControlMixin:
    """Queue requests and control messages for the scheduler; mutates only ``recv_queue`` (and
    ``failed_transfers``)."""

    def add_request(self, input_ids: list[int], max_new_tokens: int, stop_at: int | None = None,
                    rid: str | None = None, session_id: str | None = None, ignore_eos: bool = False,
                    priority: int | None = None) -> str:
        """Queue a generate request; returns its rid. ``stop_at`` is the output length at which EOS
        is sampled; with ``ignore_eos`` (SGLang's sampling parameter) that EOS is kept in the output
        but finishes nothing, and the request runs to ``max_new_tokens``. ``priority`` matters only with
        ``enable_priority_scheduling`` (see :meth:`_add_request_to_queue`). With ``session_id`` it is
        the next turn of that streaming session: its prompt is appended to the session's history at
        intake (a turn over the context is aborted there). Raises ``ValueError`` for an empty prompt,
        one that cannot fit the context, or a session id without ``enable_streaming_session``."""
        if not input_ids or max_new_tokens < 1:
            raise ValueError("a request needs at least one input token and max_new_tokens >= 1")
        if len(input_ids) + max_new_tokens > self.config.context_len:
            raise ValueError(f"prompt + max_new_tokens exceeds context_len={self.config.context_len}")
        if session_id is not None and self.session_controller is None:
            raise ValueError("session turns need enable_streaming_session")
        rid = rid or self._new_id("req-")
        self.recv_queue.append(_Msg("generate", Req(rid, list(input_ids), max_new_tokens, stop_at, ignore_eos,
                                                    priority), session_id=session_id))
        return rid

    def _new_id(self, prefix: str) -> str:
        """``prefix`` and a 6-digit serial: ids are prefix-free (for the first million of an engine),
        since :meth:`abort_request` matches by prefix. SGLang's rids are UUID hex (``uuid4().hex``,
        ``GenerateReqInput.regenerate_rid``): fixed width as well."""
        return f"{prefix}{next(self._rids):06d}"

    def open_session(self, session_id: str | None = None) -> str:
        """Queue the opening of a streaming session; returns its id. Raises ``ValueError`` without
        ``enable_streaming_session``."""
        if self.session_controller is None:
            raise ValueError("sessions need enable_streaming_session")
        session_id = session_id or self._new_id("session-")
        self.recv_queue.append(_Msg("open_session", session_id=session_id))
        return session_id

    def close_session(self, session_id: str) -> None:
        """Queue a close; it is deferred while a turn of the session is in flight."""
        if self.session_controller is None:
            raise ValueError("sessions need enable_streaming_session")
        self.recv_queue.append(_Msg("close_session", session_id=session_id))

    def memory_pressure(self) -> None:
        """Queue a memory-pressure event: the tree's evictable KV is evicted at intake and the next
        decode step retracts every running request but one (SGLang's forced retraction for tests,
        ``SGLANG_TEST_RETRACT``, and ``pause_generation(mode="retract")`` followed by a resume)."""
        self.recv_queue.append(_Msg("memory_pressure"))

    def metrics(self) -> dict[str, int]:
        """SGLang's streaming-session gauges: ``num_streaming_sessions`` (open sessions, holding KV
        or not) and ``streaming_session_held_tokens`` (tokens, see :meth:`session_held_tokens`)."""
        sc = self.session_controller
        return {"num_streaming_sessions": 0 if sc is None else len(sc.sessions),
                "streaming_session_held_tokens": self.session_held_tokens()}

    def session_held_tokens(self) -> int:
        return 0 if self.session_controller is None else self.session_controller.held_tokens()

    def health_check(self) -> str:
        """Queue a health check (SGLang ``/health_generate``: input ``[0]``, ``max_new_tokens=1``)."""
        rid = self._new_id(f"{HEALTH_CHECK_RID_PREFIX}_")
        self.recv_queue.append(_Msg("health_check", Req(rid, [0], 1)))
        return rid

    def pause_generation(self, mode: str) -> None:
        """Queue SGLang's ``/pause_generation`` for the scheduler (a weight update's first step).

        ``mode`` is ``"in_place"`` (stop scheduling, state frozen) or ``"retract"`` (first retract
        every in-flight request to the waiting queue, so ``flush_cache`` can succeed while paused);
        see :meth:`handle_pause_generation`. The third SGLang mode, ``"abort"``, is the tokenizer's
        alone (abort every request and hold new ones; the scheduler keeps running): the caller
        does it with ``abort_request(abort_all=True)``. Raises ``ValueError`` for any other mode.
        """
        if mode not in ("in_place", "retract"):
            raise ValueError(f"the scheduler pauses 'in_place' or 'retract', got {mode!r}")
        self.recv_queue.append(_Msg("pause_generation", mode=mode))

    def continue_generation(self) -> None:
        """Queue SGLang's ``/continue_generation``: the scheduler runs again (a no-op when not paused)."""
        self.recv_queue.append(_Msg("continue_generation"))

    @property
    def paused(self) -> bool:
        """SGLang ``_engine_paused``: a step only takes in messages; nothing is scheduled or run."""
        return self._engine_paused

    def request_flush_cache(self) -> None:
        """Queue a cache flush (SGLang ``/flush_cache``); the outcome lands in ``flush_results``."""
        self.recv_queue.append(_Msg("flush_cache"))

    def report_transfer_failure(self, rid: str) -> None:
        """PD decode: the KV transfer of request ``rid`` (exact rid, as a bootstrap room) failed or
        timed out on the prefill side or the wire; its receiver polls ``KVPoll.Failed`` from now on,
        and the next poll aborts the request and releases what was pre-allocated for it
        (:meth:`poll_transfer_failures`). Ignored once the request has joined the running batch.
        Raises ``ValueError`` on an aggregated engine."""
        if not self.config.is_pd_decode:
            raise ValueError("transfer failures need disaggregation_mode='decode'")
        self.failed_transfers.add(rid)

    def abort_request(self, rid: str | None = None, abort_all: bool = False) -> None:
        """Queue an abort by rid prefix, or of everything."""
        self.recv_queue.append(_Msg("abort", rid=rid, abort_all=abort_all))
