"""Engine facts of issue 18, divergences 6 and 7: aborts name exactly one request (rids are
prefix-free, as SGLang's UUID rids are, though the abort matches by prefix as SGLang's does), and a
session turn aborted for lack of memory leaves its record with the session (SGLang 0.5.23
``ScheduleBatch.retract_decode`` sets ``to_finish`` and releases the turn through ``release_req``,
where ``StreamingSession.try_cache_finished_req`` keeps the record, as for a retraction)."""

from __future__ import annotations

import pytest

from engine_under_test import FinishReason, Scheduler

from kvaudit.targets.eut.presets import get_preset
from kvaudit.program import Abort, CloseSession, Idle, OpenSession, Step, Submit
from kvaudit.audit.runner import AuditedRun

from test_engine_paths import assert_clean_idle, outputs, token_check


# -- divergence 7: prefix-free rids ----------------------------------------------------------------

def test_engine_abort_of_one_rid_ends_only_that_request_among_twelve():
    """With counter rids ``req-1`` was a prefix of ``req-10`` and ``req-11``: aborting the second
    request also aborted the eleventh and twelfth."""
    s = Scheduler(get_preset("default").config())
    rids = [s.add_request([5 + i, 6, 7], 3) for i in range(12)]
    assert all(not a.startswith(b) for a in rids for b in rids if a != b)
    s.abort_request(rids[1])
    s.run_until_idle()
    reasons = {rid: o.reason for rid, o in outputs(s).items()}
    assert [rid for rid, r in reasons.items() if r == FinishReason.ABORT] == [rids[1]]
    assert len(reasons) == 12


def test_engine_ids_of_requests_sessions_and_health_checks_are_prefix_free():
    s = Scheduler(get_preset("streaming-session").config())
    ids = [s.add_request([5, 6], 2) for _ in range(11)] + [s.open_session() for _ in range(11)]
    ids += [s.health_check() for _ in range(11)]
    assert all(not a.startswith(b) for a in ids for b in ids if a != b)
    assert ids[1] == "req-000001"  # still readable in reports


def test_program_abort_names_one_request_among_more_than_ten():
    """Through the target: a program of twelve submits and ``abort(1)`` aborts only the request the
    handle names, and the run is clean."""
    program = [Submit(0, 4, 4) for _ in range(12)] + [Abort(1), Step(1), Idle()]
    with AuditedRun(get_preset("default").config()) as run:
        for op in program:
            assert run.apply(op) == []
        eng = run.target.engine
        aborted = [o.rid for o in eng.finished_outputs if o.reason == FinishReason.ABORT]
        assert aborted == [run.target.submitted[1]]
        assert len(eng.finished_outputs) == 12


# -- divergence 6: a session turn aborted for lack of memory --------------------------------------

def _oom_config(**changes):
    return get_preset("streaming-session").config(page_size=1, num_slots=64, new_token_ratio=0.0, **changes)


def _oom_session_turn(**changes):
    """Session ``a`` keeps a 24-token record; session ``s``'s only turn (12-token prompt, 20 new
    tokens) is admitted (12 + 20 + 1 < the 40 tokens left, SGLang's PrefillAdder) and decodes; then
    another tenant takes every free slot (planted from the test: with SGLang's admission budget the
    turn cannot outgrow the pool on its own), so the turn's next decode finds no room and
    retract_decode, with nothing else to retract, aborts it. The tenant's slots are given back
    once the turn finished. Returns the engine, the turn's rid and its prompt."""
    s = Scheduler(_oom_config(**changes))
    s.open_session("a")
    s.add_request(list(range(60, 80)), 4, session_id="a")
    s.run_until_idle()
    sid = s.open_session("s")
    prompt = list(range(2, 14))
    rid = s.add_request(prompt, 20, session_id=sid)
    for _ in range(3):  # admitted, prefilled, decoding
        s.step()
    alloc = s.token_to_kv_pool_allocator
    tenant = alloc.alloc(alloc.available_size())
    for _ in range(60):
        s.step()
        if rid in outputs(s):
            break
    alloc.free(tenant)
    return s, rid, prompt


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_session_turn_aborted_for_lack_of_memory_keeps_its_record_in_the_session(overlap):
    s, rid, prompt = _oom_session_turn(enable_overlap=overlap)
    out = outputs(s)[rid]
    assert out.reason == FinishReason.ABORT and len(out.output_ids) > 0
    sess = s.session_controller.sessions["s"]
    slot = sess.slot
    assert slot is not None and slot.kv.holds_kv  # the record stays with the session
    assert not sess.inflight and sess.history() == prompt + out.output_ids
    # the last token's KV is written only under overlap (its in-flight decode ran; the next token is dropped)
    assert len(sess.history()) - 1 <= slot.kv.kv_committed_len <= len(sess.history())
    s.check_integrity()
    assert all(c.ok for c in s.check_memory())
    held = {sid: x.kv.kv_allocated_len - x.kv.cache_protected_len for sid, x in s.session_controller.slots()}
    assert set(held) == {"a", "s"} and token_check(s).session_held == sum(held.values())
    # the next turn continues on the record: its prefix is the record's committed length
    seen, orig = [], s.alloc_for_extend

    def spy(batch):
        seen.extend((r.rid, r.prefix_len) for r in batch.reqs)
        orig(batch)

    s.alloc_for_extend = spy
    committed = slot.kv.kv_committed_len
    s.close_session("a")  # the pool is full of the two records: make room for the next turn
    nxt = s.add_request([40], 1, session_id="s")
    s.run_until_idle()
    assert outputs(s)[nxt].reason == FinishReason.LENGTH
    assert [p for r, p in seen if r == nxt] == [committed]
    s.close_session("s")
    assert_clean_idle(s)


def test_session_turn_aborted_for_lack_of_memory_is_audited_clean():
    """The same path under the auditor: no leak, no stale read, identities hold."""
    program = [OpenSession(), Submit(0, 20, 4, session=0), Idle(), OpenSession(), Submit(1, 12, 40, session=1)]
    program += [Step(4)] * 12 + [CloseSession(0), Submit(1, 1, 1, session=0), Idle(), CloseSession(0), Idle()]
    with AuditedRun(_oom_config()) as run:
        for op in program:
            assert run.apply(op) == [], op
        reasons = [o.reason for o in run.target.engine.finished_outputs]
    assert reasons == [FinishReason.LENGTH, FinishReason.ABORT, FinishReason.LENGTH]
