"""Streaming sessions: a session slot keeps one turn's KV record so the next turn continues on it.

Modelled on SGLang 0.5.23 ``srt/session/session_controller.py`` (``Session``, ``SessionController``)
and ``srt/session/streaming_session.py`` (``StreamingSession``, ``SessionSlot``); reference section 5.

Life of a slot, in SGLang's words:

* **take**: the first turn's fresh record is adopted by a new slot right after its row is
  allocated; the slot also takes the turn's tree lock, and the turn *borrows* the record
  (``req.kv is slot.kv``).
* **match**: a later turn borrows the slot's record at admission. Its prefix is the record's
  committed length; the stale tail past it is freed.
* **finish** (``claim_kv_row``): a finished or retracted turn trims its over-allocated tail and
  hands the record back to the slot; nothing is freed. An aborted turn destroys the slot instead,
  and the normal release frees the record; a turn aborted for lack of memory is released as a
  retraction first (``to_finish``), so its record stays (``finish_req``).
* **release** (close): unlock, free ``[cache_protected_len, kv_allocated_len)`` and the row.

A close while a turn is in flight is deferred (``close_on_finish``) and completed by the reap at
the next intake after the turn ends.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine_under_test.memory import PoolIntegrityError
from engine_under_test.req import FinishReason, Req, ReqKvInfo


@dataclass(eq=False)
class SessionSlot:
    """The KV record a session holds between turns, with the tree lock on its published prompt."""

    kv: ReqKvInfo
    lock: object = None
    publishes_prompt: bool = True  # the first turn's prompt is still being inserted into the tree


@dataclass(eq=False)
class Session:
    session_id: str
    slot: SessionSlot | None = None
    inflight: bool = False  # a turn is queued or running (at most one)
    turn: Req | None = None  # that turn
    close_on_finish: bool = False
    last_req: Req | None = None  # the last turn that finished normally

    def history(self) -> list[int]:
        """Tokens the next turn continues from: the last good turn's prompt and kept output."""
        r = self.last_req
        return [] if r is None else r.origin_input_ids + r.output_ids[: r.finished_len]


class SessionController:
    """Every open session, and the slot operations the scheduler calls (``sched`` owns the pools)."""

    def __init__(self, sched):
        self.sched = sched
        self.sessions: dict[str, Session] = {}

    # -- control ------------------------------------------------------------------------------
    def open(self, session_id: str) -> bool:
        """Open a streaming session; False if the id is taken."""
        if session_id in self.sessions:
            return False
        self.sessions[session_id] = Session(session_id)
        return True

    def create_req(self, session_id: str, req: Req) -> Req:
        """Turn ``req`` (its new input only) into the session's next turn, or reject it.

        A turn for an unknown or closing session, or while another turn is in flight, is rejected
        with ``set_finish_with_abort``. A turn longer than the context is *pre-aborted*: it keeps its
        session until matching, which detaches it (SGLang ``create_req`` + ``_handle_generate_request``).
        """
        s = self.sessions.get(session_id)
        if s is None or s.close_on_finish or s.inflight:
            return self.sched.set_finish_with_abort(req)
        req.origin_input_ids = s.history() + req.origin_input_ids
        req.session, s.inflight, s.turn = s, True, req
        if len(req.origin_input_ids) + req.max_new_tokens > self.sched.config.context_len:
            self.sched.set_finish_with_abort(req)
        return req

    def close(self, session_id: str) -> None:
        """Close now, or defer while a turn is in flight (SGLang ``SessionController._close``)."""
        s = self.sessions.get(session_id)
        if s is None:
            return
        running = s.slot is not None and s.slot.kv.holds_kv and s.slot.kv is getattr(s.turn, "kv", None)
        if s.inflight and not (running and "session-close-while-running" in self.sched.config.bugs):
            s.close_on_finish = True
            return
        # BUG (sglang PR #21875, race): with the switch on, the close does not wait for a turn that
        # is decoding on the borrowed record; the slot is released under the running turn.
        self.release_session(s, in_use=running)
        del self.sessions[session_id]

    def reap(self) -> None:
        """Complete deferred closes whose turn has finished (SGLang ``maybe_reap``)."""
        for s in [s for s in self.sessions.values() if s.close_on_finish and not s.inflight]:
            s.close_on_finish = False
            self.close(s.session_id)

    def abort_req(self, req: Req) -> None:
        """A turn ended outside its slot (waiting-queue abort, intake rejection). A turn that was
        retracted already wrote into the slot's record: like any aborted turn it destroys the slot,
        so the next turn does not continue on this turn's KV."""
        s, req.session = req.session, None
        if s is not None:
            s.inflight = False
            if req.retracted_in_session:
                self.release_session(s)

    def finish_req(self, req: Req) -> None:
        """A turn ended after a retraction-style release (an out-of-memory abort): if its record went
        back to the slot it is the session's last turn (SGLang ``Session.finish_req``), else it ends
        like an abort (:meth:`abort_req`)."""
        s = req.session
        if s is None or not req.retracted_in_session:
            self.abort_req(req)
            return
        req.retracted_in_session, s.inflight, s.last_req = False, False, req

    # -- slot operations (called by the scheduler) -----------------------------------------
    def match(self, req: Req, key_len: int, commit: bool) -> int | None:
        """At admission (``find_active_slot``): the prefix length the turn gets by borrowing its
        session's record, or None when there is no record to borrow (it then matches the tree like
        any request). Only with ``commit`` (the turn is admitted) does it borrow and free the stale tail."""
        s = req.session
        if s is None:
            return None
        if req.intake_aborted and "session-abort-borrows-slot" not in self.sched.config.bugs:
            self.abort_req(req)  # a pre-aborted turn runs as an ordinary request; the slot is untouched
            return None
        slot = s.slot
        if slot is None or not slot.kv.holds_kv:
            return None
        if not commit:
            return 0 if req.intake_aborted else self._prefix(slot.kv, key_len)
        kv = req.kv = slot.kv
        req.borrowed_slot = slot
        if req.intake_aborted:
            # BUG (sglang PR #22273): the turn pre-aborted at intake still borrowed the record; its
            # one-token prompt overwrites the row from position 0 and its finish writes committed=1
            # back into the record, so the earlier turns' KV is no longer referenced.
            prefix = 0
        else:
            prefix = self._prefix(kv, key_len)
            start = max(self.sched.ceil_page(prefix), kv.cache_protected_len)  # _free_tail, never tree slots
            self.sched.token_to_kv_pool_allocator.free(self.sched.row_slots(kv, start, kv.kv_allocated_len))
            # A retracted first turn may have published past the positions it recomputes now: the
            # tree keeps those slots (under the slot's lock) and the row takes fresh private ones.
            kv.cache_protected_len = min(kv.cache_protected_len, prefix)
        kv.kv_allocated_len = kv.kv_committed_len = prefix
        return prefix

    def _prefix(self, kv: ReqKvInfo, key_len: int) -> int:
        """``min(kv_committed_len, key_len)``, floored to a page when it falls inside the
        tree-owned prefix (so the turn's new slots never share a page with the tree's)."""
        prefix = min(kv.kv_committed_len, key_len)
        if prefix < kv.cache_protected_len:
            prefix = prefix // self.sched.page_size * self.sched.page_size
        return prefix

    def take(self, req: Req) -> None:
        """After the first row allocation of a turn with no slot: the session adopts the record."""
        s = req.session
        if s is None or req.borrowed_slot is not None or (s.slot is not None and s.slot.kv.holds_kv):
            return
        s.slot = req.borrowed_slot = SessionSlot(req.kv, req.lock)
        req.lock = None

    def claim_kv_row(self, req: Req) -> bool:
        """At release: hand a finished or retracted turn's record to the slot (True: nothing more to
        free), or destroy the slot of an aborted turn (False: the normal release frees the record)."""
        slot = req.borrowed_slot
        s = req.session
        if slot is None or s is None or s.slot is not slot:
            req.borrowed_slot = None
            return False
        kv = req.kv
        aborted = req.finished_reason == FinishReason.ABORT and not (
            req.intake_aborted and "session-abort-borrows-slot" in self.sched.config.bugs)
        if aborted:
            s.slot, req.lock = None, slot.lock
            req.borrowed_slot = None
            self.abort_req(req)
            return False
        owned = req.owned_kv_len()
        if "session-tail-not-trimmed" not in self.sched.config.bugs:
            self.sched.token_to_kv_pool_allocator.free(self.sched.row_slots(kv, self.sched.ceil_page(owned), kv.kv_allocated_len))  # _trim_overshoot
        # BUG (sglang PR #21875, tail leak): with the switch on, the over-allocated tail is not
        # freed before the record is shortened to the owned length, so nothing references it.
        kv.kv_allocated_len = kv.kv_committed_len = min(owned, kv.kv_allocated_len)
        slot.publishes_prompt = False
        req.detach_kv()
        if req.finished():  # a retracted turn stays in flight and borrows the record again
            s.inflight, s.last_req = False, req
        else:
            req.retracted_in_session = True
        return True

    def release_session(self, s: Session, in_use: bool = False) -> None:
        """Free the slot: unlock, free the private span and the row (SGLang ``release_session``).
        ``in_use`` (only under the close race switch) leaves the shared record's fields untouched."""
        slot, s.slot = s.slot, None
        if slot is None or not slot.kv.holds_kv:
            return
        sched, kv = self.sched, slot.kv
        if slot.lock is not None:
            sched.tree_cache.dec_lock_ref(slot.lock)
            slot.lock = None
        sched.token_to_kv_pool_allocator.free(sched.row_slots(kv, kv.cache_protected_len, kv.kv_allocated_len))
        sched.req_to_token_pool.free(kv.req_pool_idx)
        if not in_use:
            kv.mark_kv_released()

    def clear_slots(self) -> None:
        """``flush_cache``: every slot loses its KV (the pools are cleared by the caller)."""
        for s in self.sessions.values():
            s.slot = None

    def check_integrity(self, live: list[Req]) -> None:
        """Reference 7.1 items 20-22: a slot always holds a row; a record is borrowed only by its
        own session's one turn; at most one turn of a session is live. Raises PoolIntegrityError."""
        for sid, s in self.sessions.items():
            if s.slot is not None and not s.slot.kv.holds_kv:
                raise PoolIntegrityError(f"session {sid}: slot without a row")
        turns: dict[str, str] = {}
        for req in live:
            if req.session is None:
                continue
            sid = req.session.session_id
            if sid in turns:
                raise PoolIntegrityError(f"session {sid}: turns {turns[sid]} and {req.rid} both in flight")
            turns[sid] = req.rid
            if req.borrowed_slot is not None and req.borrowed_slot is not req.session.slot:
                raise PoolIntegrityError(f"{req.rid} borrows a record that is not its session's slot")

    # -- accounting ----------------------------------------------------------------------------
    def slots(self) -> list[tuple[str, SessionSlot]]:
        return [(sid, s.slot) for sid, s in self.sessions.items() if s.slot is not None and s.slot.kv.holds_kv]

    def held_tokens(self) -> int:
        """``session_held_tokens``: per slot holding a row, its page-aligned allocation beyond the
        tree-owned prefix."""
        return sum(self.sched.ceil_page(slot.kv.kv_allocated_len) - slot.kv.cache_protected_len
                   for _, slot in self.slots())
