"""PD decode transfer failure (issue 18, missing path): a transfer that fails or times out aborts its
request and releases what was pre-allocated for it, in every state before it joins the running
batch -- queued for pre-allocation (nothing held yet), transferring (row + KV; HiSparse: host slots
and any device buffer) and transferred, waiting to join (released when its prebuilt batch is formed,
as a KV checksum mismatch is). SGLang 0.5.23 ``srt/disaggregation/decode.py``:
``DecodePreallocQueue._update_handshake_waiters`` / ``pop_preallocated``,
``DecodeTransferQueue.pop_transferred`` / ``_release_request``, ``_handle_kv_checksum_mismatch``."""

from __future__ import annotations

import random

import pytest

from engine_under_test import FinishReason, Scheduler

from kvaudit.targets.eut.presets import get_preset
from kvaudit.program.bytes_program import program_from_bytes, program_to_bytes
from kvaudit.program.bytes_v1 import op_kinds
from kvaudit.program import (Idle, Step, Submit, TransferFail, format_program, program_from_json, program_to_json,
                             random_program)
from kvaudit.audit.runner import AuditedRun, execute
from kvaudit.targets import program_features

from test_engine_paths import all_pools, assert_pools_full
from test_scheduler import assert_busy_identity, assert_clean_at_idle, outputs

PD = ["pd-decode", "pd-decode-hisparse"]


def _slots(preset, n):
    """``n`` logical tokens: HiSparse's logical pool is ``hisparse_host_ratio`` (2) times ``num_slots``."""
    return n // get_preset(preset).config().hisparse_host_ratio if "hisparse" in preset else n


def _engine(preset, num_slots=64, **kw):
    return Scheduler(get_preset(preset).config(num_slots=_slots(preset, num_slots), **kw))


def _free(s) -> dict[str, int]:
    return {name: pool.available_size() for name, pool in all_pools(s)} | {"rows": s.req_to_token_pool.available_size()}


def _finish_clean(s):
    s.run_until_idle()
    assert_clean_at_idle(s)
    assert_pools_full(s)


@pytest.mark.parametrize("preset", PD)
def test_failure_while_queued_for_prealloc_aborts_with_nothing_to_release(preset):
    s = _engine(preset, num_slots=64)
    s.add_request(list(range(2, 22)), 20)
    b = s.add_request(list(range(30, 50)), 20)
    s.step()
    assert [r.rid for r in s.disagg_prealloc_queue] == [b]  # no room for b's reservation yet
    before = _free(s)
    s.report_transfer_failure(b)
    s.step()
    assert outputs(s)[b].reason == FinishReason.ABORT and outputs(s)[b].output_ids == []
    assert not s.disagg_prealloc_queue and not any(r.rid == b for r in s.disagg_transfer_queue)
    assert _free(s)["rows"] == before["rows"]
    assert not s.failed_transfers
    _finish_clean(s)
    assert outputs(s)[b].reason == FinishReason.ABORT and len(outputs(s)) == 2


@pytest.mark.parametrize("preset", PD)
def test_failure_while_transferring_releases_the_preallocation(preset):
    s = _engine(preset, num_slots=64, transfer_latency_steps=3)
    empty = _free(s)
    rid = s.add_request([5, 6, 7, 8, 9], 4)
    s.step()
    assert [r.rid for r in s.disagg_transfer_queue] == [rid]
    held = _free(s)
    assert held["token_to_kv_pool"] < empty["token_to_kv_pool"] and held["rows"] < empty["rows"]
    if preset == "pd-decode-hisparse":
        assert held["hisparse_host"] < empty["hisparse_host"]
    assert_busy_identity(s)
    s.report_transfer_failure(rid)
    s.step()
    assert outputs(s)[rid].reason == FinishReason.ABORT
    assert not s.disagg_transfer_queue and not s.waiting_queue and not s.running_batch
    assert _free(s) == empty  # everything pre-allocated is back at once
    _finish_clean(s)


@pytest.mark.parametrize("preset", PD)
def test_failure_while_waiting_to_join_releases_at_the_prebuilt_batch(preset):
    s = _engine(preset, num_slots=128, max_running_requests=1)
    a = s.add_request([5, 6, 7], 6)
    b = s.add_request([5, 6, 8], 6)
    s.step()
    s.step()
    assert [r.rid for r in s.waiting_queue] == [b] and s.waiting_queue[0].kv.holds_kv
    s.report_transfer_failure(b)
    s.step()
    assert b not in outputs(s)  # no room to join yet: the failure is found when it is batched
    assert_busy_identity(s)
    while b not in outputs(s):
        s.step()
    assert outputs(s)[b].reason == FinishReason.ABORT
    assert all(r.rid != b for r in s.running_batch + s.waiting_queue)
    _finish_clean(s)
    assert outputs(s)[a].reason == FinishReason.LENGTH


def test_failure_reports_are_exact_and_ignored_once_running():
    s = _engine("pd-decode", num_slots=64, max_running_requests=1)
    a = s.add_request([5, 6, 7], 6)
    s.step()
    s.step()
    assert [r.rid for r in s.running_batch] == [a]
    s.report_transfer_failure(a)  # too late: it has joined
    s.report_transfer_failure(a[:-1])  # a prefix names no request
    s.step()
    assert not s.failed_transfers
    _finish_clean(s)
    assert outputs(s)[a].reason == FinishReason.LENGTH
    with pytest.raises(ValueError):
        _engine("default").report_transfer_failure(a)


# -- the program op and the generators -----------------------------------------------------------

@pytest.mark.parametrize("preset", PD)
def test_transfer_fail_op_in_each_state_is_audited_clean(preset):
    """Through the target: three requests, one in each state when ``transfer_fail(None)`` (every
    pending transfer) arrives; all three abort and the oracles stay clean."""
    cfg = get_preset(preset).config(num_slots=_slots(preset, 128), max_running_requests=1, transfer_latency_steps=2)
    program = [Submit(0, 8, 12), Step(3), Submit(1, 8, 12), Step(3), Submit(2, 20, 30), Submit(3, 30, 80),
               Step(1), TransferFail(None), Idle()]
    with AuditedRun(cfg) as run:
        for op in program[:-2]:
            assert run.apply(op) == []
        eng = run.target.engine
        states = {r.rid: q for q, reqs in (("waiting", eng.waiting_queue), ("transfer", eng.disagg_transfer_queue),
                                          ("prealloc", eng.disagg_prealloc_queue)) for r in reqs}
        assert sorted(states.values()) == ["prealloc", "transfer", "waiting"], states
        for op in program[-2:]:
            assert run.apply(op) == [], op
        reasons = {o.rid: o.reason for o in eng.finished_outputs}
    assert all(reasons[rid] == FinishReason.ABORT for rid in states)
    assert sum(r == FinishReason.LENGTH for r in reasons.values()) == 1


def test_transfer_fail_handle_takes_the_pre_join_requests_in_order():
    cfg = get_preset("pd-decode").config(num_slots=128, max_running_requests=1, transfer_latency_steps=2)
    with AuditedRun(cfg) as run:
        for op in [Submit(0, 8, 12), Step(3), Submit(1, 8, 12), Submit(2, 8, 12), Step(1), TransferFail(5)]:
            assert run.apply(op) == []
        t = run.target
        assert t._pre_join_rids() == t.submitted[1:]  # the first is running
        assert t.engine.failed_transfers == {t.submitted[2]}  # 5 % 2 == 1
        assert run.apply(Idle()) == []


def test_transfer_fail_is_drawn_only_for_pd_decode():
    assert program_features(get_preset("pd-decode").config()) == {"transfer_fail"}
    assert program_features(get_preset("default").config()) == frozenset()
    rng = random.Random(3)
    ops = [op for _ in range(40) for op in random_program(rng, 24, 40, program_features(get_preset("pd-decode").config()))]
    assert any(isinstance(op, TransferFail) for op in ops)
    rng = random.Random(3)
    ops = [op for _ in range(40) for op in random_program(rng, 24, 40, frozenset())]
    assert not any(isinstance(op, TransferFail) for op in ops)
    assert "transfer_fail" in op_kinds(get_preset("pd-decode-hisparse").config())
    assert "transfer_fail" not in op_kinds(get_preset("streaming-session").config())


def test_transfer_fail_round_trips_through_json_text_and_bytes():
    cfg = get_preset("pd-decode").config()
    program = [Submit(0, 8, 3), TransferFail(None), TransferFail(3), Idle()]
    assert program_from_json(program_to_json(program)) == program
    assert "transfer_fail(handle=None)" in format_program(program)
    for version in (1, 2):
        assert program_from_bytes(program_to_bytes(program, cfg, version), cfg) == program


def test_random_pd_programs_with_transfer_failures_are_clean():
    rng = random.Random(11)
    for preset in PD:
        cfg = get_preset(preset).config()
        for _ in range(15):
            program = random_program(rng, 24, 40, program_features(cfg))
            assert execute(cfg, program).findings == [], format_program(program)


# -- the real SGLang 0.5.23 decode server --------------------------------------------------------

@pytest.mark.sglang
@pytest.mark.parametrize("stage, ops", [
    ("prealloc", [Submit(i, 60, 40) for i in range(5)] + [Step(1)]),
    ("transfer", [Submit(0, 20, 30), Step(1)]),
    ("waiting", [Submit(0, 20, 30), Step(1)]),
])
def test_real_sglang_transfer_failure_in_each_state_aborts_and_releases(stage, ops):
    """The real-SGLang PD driver models the op: a failed receiver in the prealloc or transfer queue
    (SGLang's own handshake and transfer polls, with its deferred release) and a KV checksum
    mismatch for a request waiting to join (its prebuilt batch drops it); memory all comes back."""
    from test_sglang_pd import full, run_to_stage, stages

    run, t, req = run_to_stage("python", ops, stage)
    victim = req.rid
    pending = [r for r in t.live_rids() if stages(t).get(r) in ("prealloc", "transfer", "waiting")]
    run.apply(TransferFail(pending.index(victim)))
    run.apply(Idle())
    assert run.findings == [] and full(t) and stages(t) == {}
    assert type(req.finished_reason).__name__ == "FINISH_ABORT"
    assert len(req.output_ids) <= 1
    others = [r for r in t.submitted if r != victim]
    assert all(r not in t.live_rids() for r in others)  # the rest ran to completion


@pytest.mark.sglang
def test_real_sglang_transfer_failure_with_nothing_pending_is_a_no_op():
    from test_sglang_pd import cfg

    ex = execute(cfg("python"), [TransferFail(0), TransferFail(None), Submit(0, 8, 2), Idle(), TransferFail(3), Idle()])
    assert ex.findings == []
