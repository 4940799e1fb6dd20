"""What kvaudit's analyses say about known findings, keyed by signature: a title naming the symptom and
the function, why it is a defect, a suggested fix, and what a maintainer sees on a running server.
Condensed from the hand-written analyses in ``corpora/sglang/README.md`` (the numbers there); a
finding not listed here gets a report without them (the sections say so)."""

from __future__ import annotations

from typing import NamedTuple


class Note(NamedTuple):
    """``title`` (symptom + function), ``why`` (the broken rule), ``fix`` (a suggestion; "" if none
    is known), ``server`` (what a client sees on a real server), ``readme`` (the section of
    corpora/sglang/README.md with the full analysis)."""

    title: str
    why: str
    fix: str
    server: str
    readme: str


_INFLIGHT = ("`Session.abort_req` clears `_inflight` unconditionally, so a turn rejected by `Session.create_req` "
             "(\"Streaming session already has an active request\") un-marks the turn that is really in flight; "
             "the session then accepts another turn while the first still runs (a streaming session must have at "
             "most one in-flight turn).")
_INFLIGHT_FIX = ("Clear `_inflight` only for the in-flight turn itself (remember its rid on the session and "
                 "compare in `abort_req`), or detach a turn rejected by `create_req` from its session "
                 "(`req.session = None` next to `set_finish_with_abort`) so it never calls back into the session.")

NOTES: dict[str, Note] = {
    "crash/-/AssertionError@take@streaming_session.py": Note(
        "Scheduler crash: AssertionError in StreamingSession.take when a rejected second turn shares the "
        "first prefill batch of a streaming session",
        "The second turn arrives while the first is queued; `Session.create_req` rejects it "
        "(`set_finish_with_abort`) but leaves `req.session` set. Both requests are admitted into one prefill "
        "batch; `find_active_slot` would detach the rejected one only if the session's slot already held KV, "
        "and here the slot does not exist yet. `alloc_for_extend` -> `UnifiedRadixCache.maybe_hand_to_session` "
        "hands both to `take()`: the first creates the slot, the second trips the assertion, an unhandled "
        "exception in the scheduler's event loop.",
        "Detach a turn rejected by `create_req` from its session when it is rejected (`req.session = None`), "
        "or make `take()` (and `_is_streaming`) skip requests that have `to_finish` set.",
        "the scheduler process dies on the first prefill: the batched /generate gets no answer or an error, "
        "and the server stops answering", "1"),
    "aliasing/token_to_kv_pool/request-kv": Note(
        "Two running turns share one session record after a rejected turn clears Session._inflight "
        "(StreamingSession.find_active_slot -> Session.abort_req)",
        _INFLIGHT + " At admission `try_match_prefix` lends the third turn the record the first turn is "
        "decoding on; both extend one `ReqKvInfo`, each at its own sequence length, so positions are "
        "overwritten and counted twice: the record names slot 0 (the padding slot) as KV, and displaced slots "
        "leak.", _INFLIGHT_FIX,
        "no error at once: corrupted KV for both turns; after the session is closed and the cache flushed the "
        "pool is short of tokens (kv_available_tokens below the capacity)", "2"),
    "leak/token_to_kv_pool/request-kv": Note(
        "KV leak: a retracted streaming-session turn counts as finished (ScheduleBatch.retract_decode -> "
        "StreamingSession.try_cache_finished_req -> Session.finish_req)",
        "Retraction releases the turn through `release_kv_cache(checkpoint=False)`, whose streaming path calls "
        "`session.finish_req(req)` for a request that has not finished: `_inflight` is cleared and the "
        "retracted turn becomes the session's last request. The session accepts the next turn, built on the "
        "unfinished turn's arrays; both are admitted on the same record and the second borrow's `_free_tail` "
        "cuts the record under the first: a leak, and two requests on one record.",
        "On retraction keep the session in flight (do not call `finish_req` for an unfinished request), or have "
        "`create_req` reject a turn while the last request is unfinished, as the non-streaming path does.",
        "after the session is closed and the cache flushed, kv_available_tokens stays below the capacity", "3"),
    "use-after-free/token_to_kv_pool/request-kv/free_kv_row_segments@common.py": Note(
        "Use-after-free: a deferred session close frees the KV a running turn decodes on "
        "(SessionController._close -> StreamingSession.release_session) after a rejected turn",
        "The close is correctly deferred (`close_on_finish`) because a turn is in flight. " + _INFLIGHT +
        " At the next `maybe_reap`, `_close` no longer sees an in-flight turn and releases the session: the "
        "slot's row and KV go back to the pools while the turn still decodes on them (the failure SGLang PR "
        "#21875 fixed for the plain close, reopened through `_inflight`).",
        _INFLIGHT_FIX + " In addition `_close` could check whether a live request still borrows the slot's "
        "record instead of trusting `_inflight` alone.",
        "the next decode indexes a freed row: an exception in the scheduler (server stops answering) or, once "
        "the row is reused, another request's KV", "4"),
    "crash/-/AssertionError@try_match_prefix@streaming_session.py": Note(
        "Scheduler crash: AssertionError 'streaming session prefix shrank' in StreamingSession.try_match_prefix "
        "after a rejected turn clears Session._inflight",
        _INFLIGHT + " The first turn has not finished, so the accepted third turn is built from its own input "
        "with no history; matching lends it the slot's record, whose protected prefix is longer than the "
        "turn's key, and the append-only assertion fires in the event loop.", _INFLIGHT_FIX,
        "the scheduler process dies when the third turn is admitted: the server stops answering", "5"),
    "crash/-/AssertionError@checkpoint_into_tree@unified_radix_cache.py": Note(
        "Scheduler crash: AssertionError in UnifiedRadixCache.checkpoint_into_tree when a turn sharing a "
        "session record is aborted",
        _INFLIGHT + " The accepted third turn extends the shared record's protected prefix; the first turn, "
        "aborted, is released as a finish and checkpoints its own shorter KV against a record whose "
        "`cache_protected_len` is the third turn's: the tree's consistency assertion fires.", _INFLIGHT_FIX,
        "the scheduler process dies when the aborted turn is released: the server stops answering", "6"),
    "leak/hisparse_device_pool/_grow_device_buffers@hisparse_coordinator.py": Note(
        "HiSparse device-buffer slot leak: a short request finishing at the step its buffer grows to the padded "
        "size (HiSparseCoordinator.map_last_loc_to_buffer / request_finished)",
        "At the decode step where `seq_len` reaches the device buffer size, `_grow_device_buffers` grows a short "
        "request's buffer to the padded size and records both new slots; `map_last_loc_to_buffer` then writes "
        "the newest token's slot into the entry at `device_buffer_size`, overwriting the one that named the "
        "padded slot. If the request finishes at that step, `request_finished` frees the slots its table names, "
        "and the overwritten one is in no free list and no table. One device slot is lost per such request "
        "(page size 1); SGLang's own memory checks are off under HiSparse.",
        "Write the reserved slot into `token_locs[..., device_buffer_size]` only when the buffer is full "
        "(`seq_len > device_buffer_size`), or have `request_finished` free the buffer's own table "
        "(`req_to_device_buffer[row, :cap]`).",
        "nothing at once; each such request loses one device slot of the HiSparse buffer pool, which /metrics "
        "does not report: the decode capacity shrinks over time", "7"),
    "leak/hisparse_device_pool/_grow_device_buffers@hisparse_coordinator.py/request_finished@hisparse_coordinator.py":
        Note("HiSparse device-buffer slot leak released through HiSparseCoordinator.request_finished (the same "
             "padded-buffer overwrite, seen with its release)",
             "The same allocation and release as the padded-buffer leak (corpora/sglang/README.md, 7): here a "
             "live row's buffer still names the lost slot's neighbours when the leak is seen, so kvaudit names "
             "`request_finished` as the release that let go of it. Believed the same defect, not proven.",
             "As for the padded-buffer leak: guard the write at `device_buffer_size` in "
             "`map_last_loc_to_buffer`, or free the buffer's own table in `request_finished`.",
             "nothing at once; device slots of the HiSparse buffer pool are lost (not in /metrics)", "7b"),
    "crash/-/RuntimeError@_grow_device_buffers@hisparse_coordinator.py": Note(
        "Scheduler crash: RuntimeError 'HiSparse _grow_device_buffers failed' in decode when buffer growth was "
        "never reserved (HiSparseCoordinator._grow_device_buffers)",
        "Admission reserves a request's persistent device buffer only with speculative scratch, and the decode "
        "gate (`check_decode_mem`) counts the step's new tokens but not the pages `_grow_device_buffers` takes "
        "when short requests jump to the padded buffer size; staged requests join the running batch with no "
        "check at all. With several short requests decoding in a nearly full physical pool the bulk allocation "
        "fails and the coordinator raises instead of the scheduler retracting.",
        "Count buffer growth in the decode gate (so `retract_decode` makes room), or reserve each request's "
        "padded buffer at admission also without speculation.",
        "the scheduler process dies in a decode step: the server stops answering", "8"),
    "hang/-/idle/prealloc:memory|sglang-pd-decode": Note(
        "Hang: a PD decode server accepts a request it can never pre-allocate "
        "(DecodePreallocQueue._check_if_req_exceed_kv_capacity vs _prealloc_required_tokens)",
        "Pre-allocation needs the prompt plus `num_reserved_decode_tokens` free, but the intake check compares "
        "the prompt alone with the pool; a prompt within the reserve of the pool size is accepted and waits in "
        "the prealloc queue for ever with the pool empty. No memory is lost.",
        "Make the intake check use pre-allocation's requirement (prompt + reserve > max_total_num_tokens) and "
        "abort such a request at once with the \"exceeds the maximum number of tokens\" error.",
        "the request never answers; sglang:num_decode_prealloc_queue_reqs stays 1 with the pool free", "9"),
    "crash/-/RuntimeError@create_req@session_controller.py": Note(
        "Scheduler crash: RuntimeError 'dictionary changed size during iteration' in Session.create_req for a "
        "non-streaming session turn with replace and no rid",
        "The `replace` branch without `session_params.rid` clears the history by iterating `self.req_nodes` "
        "while `SessionReqNode.clear` deletes entries from that dict; nothing upstream validates "
        "`session_params` or catches the error, so one /generate call kills the scheduler.",
        "Clear from the roots over a snapshot of the values (or clear the dict after aborting every unfinished "
        "node).", "the scheduler process dies at intake of the replacing turn: the server stops answering",
        "10"),
}


def note_for(signatures: list[str], preset: str = "") -> Note | None:
    """The note of the first signature that has one, else None. A signature that says little on its own
    (``hang/-/idle/prealloc:memory``: any PD decode server whose pre-allocation never fits) is keyed
    ``signature|preset``."""
    for s in signatures:
        for key in (f"{s}|{preset}", s):
            if key in NOTES:
                return NOTES[key]
    return None


# what a server shows for a vLLM bug of the history suite (kvaudit/history/catalogue.py), by bug id
HISTORY_SERVER: dict[str, str] = {
    "vllm-33377": "the aborted request's second finished_sending trips `assert req_id in self.requests` in "
                  "`Scheduler._update_from_kv_xfer_finished`: EngineCore dies and the server stops answering "
                  "(/health 503 or no answer)",
}


def _engine_name(kind: str) -> str:
    """The engine's name as its project spells it (its kind's HTTP table's), else the kind's name."""
    from kvaudit.export.http_api import export_for
    try:
        return export_for(kind).api.engine
    except KeyError:
        return kind


def history_note(bug, note: Note | None) -> Note:
    """The note for a replay file of the history suite's ``bug`` (a
    :class:`kvaudit.history.catalogue.HistoryBug`): its title, how a server reaches it (``reach``), the
    upstream fix, and what a server shows (:data:`HISTORY_SERVER`; else ``note``'s)."""
    fix = (f"Fixed upstream in vLLM {bug.fixed} ({', '.join(bug.sources)}); upgrade." if bug.fixed else
           f"Not fixed upstream as of the history suite ({', '.join(bug.sources)}).")
    server = HISTORY_SERVER.get(bug.id, note.server if note is not None else "")
    engine = _engine_name(bug.engine)
    return Note(f"{bug.title} ({engine} {bug.buggy}, {', '.join(bug.sources)})", bug.reach, fix, server,
                "\"vLLM's own bugs in old releases\"")
