"""The real-SGLang target in PD-disaggregation decode mode (preset ``sglang-pd-decode``): SGLang 0.5.23's
``DecodePreallocQueue``, ``DecodeTransferQueue`` and prebuilt batches, driven on CPU (issue 8).

* a request's path through the decode server, each stage as SGLang holds it;
* hazard A.8 of the memory model's Appendix A: a release deferred until prefill acknowledges the
  abort, or a timeout, holds the KV meanwhile; kvaudit counts it as held, not leaked;
* aborts in every decode queue, and decode-mode retraction with its KV backup, clean;
* the KV checksum (memory model 7.2, "checksum mismatch"): a transfer corrupted on the wire is aborted
  at its prebuilt batch by ``_verify_kv_checksums``, its memory back, the rest of the batch unharmed.

Skipped, with the install command, where SGLang is not installed.
"""

import pytest


from kvaudit.program import (Abort, ContinueGeneration, FlushCache, HealthCheck, Idle, MemoryPressure,
                             PauseGeneration, Step, Submit, TransferFail)
from cli_helpers import invoke, reached
from sglang_helpers import CORES, run_ops
from kvaudit.audit.runner import AuditedRun, execute
from kvaudit.targets.sglang.config import SGLANG_PRESETS

pytestmark = pytest.mark.sglang


def dec(target):
    """The target's pd-decode feature."""
    return target.feature("pd-decode")

def cfg(core="rust", **kw):
    return SGLANG_PRESETS["sglang-pd-decode"].config(tree_core=core, **kw)


def stages(t):
    """Where each request is: the decode server's queues, as SGLang holds them."""
    pq, tq = dec(t).prealloc_queue, dec(t).transfer_queue
    out = {dr.req.rid: "prealloc" for dr in pq.queue}
    out.update({dr.req.rid: "transfer" for dr in tq.queue})
    out.update({e[0].req.rid: "deferred" for e in tq._deferred_releases})
    out.update({r.rid: "waiting" for r in dec(t).sched.waiting_queue})
    out.update({r.rid: "running" for r in dec(t).sched.running_batch.reqs if not r.finished()})
    out.update({r.rid: "retracted" for r in pq.retracted_queue})
    return out


def full(t):
    return (t.allocator.available_size() == t.allocator.size and t.req_to_token_pool.available_size() == t._row_count()
            and dec(t).metadata_allocator.available_size() == dec(t).metadata_allocator.size)


@pytest.mark.parametrize("core", CORES)
def test_objects_are_sglangs_decode_server(core):
    with AuditedRun(cfg(core)) as run:
        t = run.target
        assert type(t.req_to_token_pool).__name__ == "DecodeReqToTokenPool"
        assert t.req_to_token_pool.pre_alloc_size > 0  # rows for requests still receiving their KV
        assert t._row_count() == t.req_to_token_pool.size + t.req_to_token_pool.pre_alloc_size
        assert type(t.tree_cache).__name__ == "UnifiedRadixCache" and t.tree_cache.disable  # decode default: off
        assert type(dec(t).prealloc_queue).__module__ == type(dec(t).transfer_queue).__module__ == \
            "sglang.srt.disaggregation.decode"
        assert t.allocator.need_sort is True
        assert type(dec(t).sched).__mro__[2].__name__ == "SchedulerDisaggregationDecodeMixin"


@pytest.mark.parametrize("core", CORES)
def test_a_request_goes_prealloc_transfer_prebuilt_decode(core):
    run = AuditedRun(cfg(core, transfer_latency_steps=2))
    t = run.target
    run.apply(Submit(0, 20, 4))
    seen = [stages(t)["r0"]]
    held = []
    while not t.is_idle():
        run.apply(Step(1))
        seen.append(stages(t).get("r0", "done"))
        held.append(t.allocator.available_size())
    assert run.findings == []
    # pre-allocated at the first step (row + the prompt's 20 slots: 5 pages), landed two steps later,
    # then the prebuilt batch joined the running batch in the same step; decoded to its 4 tokens
    assert seen[:4] == ["prealloc", "transfer", "transfer", "running"], seen
    assert seen[-1] == "done" and held[0] == t.allocator.size - 20
    assert full(t)
    run.close()


@pytest.mark.parametrize("core", CORES)
def test_health_check_finishes_at_its_prebuilt_result(core, monkeypatch):
    """A health check on a decode server: the fake transfer lands, max_new_tokens=1 finishes it in
    process_batch_result_prebuilt, which releases it; it never reaches a decode batch."""
    import sys

    run = AuditedRun(cfg(core))
    t = run.target
    brp = sys.modules[type(dec(t).sched.batch_result_processor).__module__]  # it imported release_kv_cache by name
    callers = []
    real = brp.release_kv_cache

    def spy(req, cache, *, checkpoint):
        callers.append((req.rid, sys._getframe(1).f_code.co_name))
        return real(req, cache, checkpoint=checkpoint)

    monkeypatch.setattr(brp, "release_kv_cache", spy)
    run.apply(HealthCheck())
    run.apply(Idle())
    assert run.findings == [] and full(t)
    assert callers == [("HEALTH_CHECK_0", "process_batch_result_prebuilt")]
    run.close()


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("ack", [2, None])
def test_hazard_a8_deferred_release_holds_the_kv_until_ack_or_timeout(core, ack):
    """A.8: an abort while the KV is in transfer fails the transfer; with a backend that notifies
    prefill, DecodeTransferQueue defers the release (_defer_release) until prefill acknowledges the
    abort (here after 2 steps) or the deadline passes (6 steps). Meanwhile the row, the KV and the
    metadata slot stay out of the pools, held only by _deferred_releases; SGLang's idle check is
    suppressed. kvaudit counts that memory as held by the request: no finding; and it comes back."""
    run = AuditedRun(cfg(core, transfer_latency_steps=3, abort_ack_steps=ack))
    t = run.target
    for op in [Submit(0, 20, 4), Step(2), Abort(0)]:
        run.apply(op)
    assert stages(t) == {"r0": "transfer"}
    run.apply(Step(1))
    assert stages(t) == {"r0": "deferred"}
    req = dec(t).transfer_queue._deferred_releases[0][0].req
    assert req.finished() and req.kv.holds_kv and req.kv.kv_allocated_len == 20
    assert t.allocator.available_size() == t.allocator.size - 20
    assert dec(t).metadata_allocator.available_size() == dec(t).metadata_allocator.size - 1
    assert not t.is_idle()
    run.apply(FlushCache())  # refused: a deferred release keeps the server busy
    assert t.flushed() == 0
    run.apply(Abort(None))  # abort_request cannot reach a deferred release: a no-op
    steps = 0
    while stages(t):
        run.apply(Step(1))
        steps += 1
    # the ack (armed at the abort, 2 steps out) lands one step after the deferral; the deadline is
    # 6 seconds (steps) after it
    assert steps == (1 if ack == 2 else 6)
    assert run.findings == [] and full(t)
    run.close()


@pytest.mark.parametrize("core", CORES)
def test_transfer_failure_without_deferral_releases_at_once(core):
    """With SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE off, the failed transfer's KV, row and
    metadata slot go back at the poll that sees the failure (_release_request)."""
    run = AuditedRun(cfg(core, transfer_latency_steps=3, deferred_kv_release=False))
    t = run.target
    for op in [Submit(0, 20, 4), Step(2), Abort(0), Step(1)]:
        run.apply(op)
    assert stages(t) == {} and t.is_idle() and run.findings == [] and full(t)
    run.close()


@pytest.mark.parametrize("core", CORES)
def test_a_transfer_failed_by_the_program_is_released_and_counted(core):
    """The preset's programs draw TransferFail ops, but reach() counted landed transfers only: a clean run said
    nothing of failed ones. A receiver concluding KVPoll.Failed ends its request, the KV goes back, the other
    transfer lands, and `pd_transfers_failed` counts the one failed."""
    run = AuditedRun(cfg(core, transfer_latency_steps=3))
    t = run.target
    for op in [Submit(0, 20, 4), Submit(1, 12, 4), Step(1)]:
        assert run.apply(op) == []
    assert stages(t) == {"r0": "transfer", "r1": "transfer"}
    assert run.apply(TransferFail(0)) == [] and run.apply(Idle()) == []
    assert stages(t) == {} and full(t) and "r1" in t.finished
    assert (t.reach()["pd_transfers_failed"], t.reach()["pd_transfers_landed"]) == (1, 1), t.reach()
    run.close()


@pytest.mark.parametrize("core", CORES)
def test_hazard_a8_a_deferred_entry_dropped_is_a_leak_kvaudit_sees(core):
    """What SGLang's suppressed idle check would miss: if the deferred entry is dropped without its
    release (DecodeTransferQueue.release_memory_occupation, reachable only while idle in a server),
    the row, its KV and the metadata slot leak; kvaudit's reachability scan reports all three at the
    next step, at the SGLang functions that took them."""
    run = AuditedRun(cfg(core, transfer_latency_steps=3, abort_ack_steps=None))
    t = run.target
    for op in [Submit(0, 20, 4), Step(2), Abort(0), Step(1)]:
        run.apply(op)
    assert stages(t) == {"r0": "deferred"} and run.findings == []
    dec(t).transfer_queue.release_memory_occupation()
    run.apply(Step(1))
    sites = {f.pool: (f.kind, f.indirect, f.alloc_sites[0].function) for f in run.findings}
    run.close()
    assert sites == {"req_to_token_pool": ("leak", False, "_pre_alloc"),
                     "metadata_buffers": ("leak", False, "_send_kv_metadata"),
                     "token_to_kv_pool": ("leak", True, "alloc_for_decode_prealloc")}  # via the leaked row


@pytest.mark.parametrize("core", CORES)
def test_health_check_runs_while_transfers_are_pending(core):
    """is_fully_idle(for_health_check=True) on a decode server ignores the prealloc and transfer queues
    and deferred releases; the health check keeps SGLang's fake receiver and lands at once."""
    run = AuditedRun(cfg(core, transfer_latency_steps=4))
    t = run.target
    for op in [Submit(0, 20, 4), Step(1), HealthCheck()]:
        run.apply(op)
    assert stages(t) == {"r0": "transfer", "HEALTH_CHECK_1": "prealloc"}
    run.apply(Step(1))
    assert stages(t) == {"r0": "transfer"}  # transferred, prebuilt and finished in one step
    run.apply(Idle())
    assert run.findings == [] and full(t)
    run.close()


@pytest.mark.parametrize("core", CORES)
def test_no_transfer_latency_lands_within_the_same_queue_pass(core):
    run = AuditedRun(cfg(core, transfer_latency_steps=0))
    t = run.target
    run.apply(Submit(0, 20, 4))
    run.apply(Step(1))
    assert stages(t) == {"r0": "running"}  # pre-allocated, landed, prebuilt and decoding in one step
    run.apply(Idle())
    assert run.findings == [] and full(t)
    run.close()


def spy_verify(t, monkeypatch):
    """Each prebuilt batch through ``_verify_kv_checksums``: (rid, expected_kv_checksum) of the batch
    before, and the rids it keeps."""
    seen = []
    real = dec(t).sched._verify_kv_checksums

    def verify(batch):
        before = [(r.rid, r.expected_kv_checksum) for r in batch.reqs]
        real(batch)
        seen.append((before, [r.rid for r in batch.reqs]))

    monkeypatch.setattr(dec(t).sched, "_verify_kv_checksums", verify)
    return seen


@pytest.mark.parametrize("core", CORES)
def test_checksum_mismatch_aborts_the_corrupted_transfer_at_its_prebuilt_step(core, monkeypatch):
    """Three transfers land in the same step, the second corrupted on the wire. _commit_transfer_to_req
    keeps each prefill digest; the prebuilt batch's _verify_kv_checksums digests the received pages and
    _handle_kv_checksum_mismatch aborts r1 with a 500 (prepare_abort, release_kv_cache(checkpoint=False))
    and filters it out: its row and KV are back at once (its metadata slot went back at the commit);
    r0 and r2 run on and finish. No finding."""
    run = AuditedRun(cfg(core, kv_checksum_mismatch_every=2))
    t = run.target
    seen = spy_verify(t, monkeypatch)
    assert full(t)
    for op in [Submit(0, 20, 4), Submit(1, 20, 4), Submit(2, 20, 4), Step(1)]:
        run.apply(op)
    assert stages(t) == {"r0": "transfer", "r1": "transfer", "r2": "transfer"} and seen == []
    reqs = {r.rid: r for r in t._active()}
    run.apply(Step(1))
    (before, kept), = seen
    assert [rid for rid, _ in before] == ["r0", "r1", "r2"] and all(expected for _, expected in before)
    assert kept == ["r0", "r2"] and stages(t) == {"r0": "running", "r2": "running"}
    r1 = reqs["r1"]
    reason = r1.finished_reason
    assert type(reason).__name__ == "FINISH_ABORT" and reason.message == "KV checksum mismatch"
    assert reason.status_code == 500 and not r1.kv.holds_kv
    held = sum(-(-r.kv.kv_allocated_len // 4) * 4 for r in (reqs["r0"], reqs["r2"]))
    assert t.allocator.available_size() == t.allocator.size - held
    assert t.req_to_token_pool.available_size() == t._row_count() - 2
    assert dec(t).metadata_allocator.available_size() == dec(t).metadata_allocator.size
    run.apply(Idle())
    assert run.findings == [] and full(t) and dec(t).network.corrupted == 1
    for rid in ("r0", "r2"):
        assert type(reqs[rid].finished_reason).__name__ == "FINISH_LENGTH" and len(reqs[rid].output_ids) == 4
    run.close()


@pytest.mark.parametrize("core", CORES)
def test_every_clean_transfer_is_verified_and_none_aborted(core, monkeypatch):
    """Without corruption every landed transfer is digested once at its prebuilt batch and matches; a
    health check carries no digest and is not verified. Nothing aborted, no finding."""
    run = AuditedRun(cfg(core, transfer_latency_steps=2))
    t = run.target
    seen = spy_verify(t, monkeypatch)
    for op in [Submit(0, 20, 4), Step(1), HealthCheck(), Submit(1, 13, 6), Step(3), Submit(2, 30, 3), Idle()]:
        run.apply(op)
    assert dec(t).sched.kv_checksum_computer.calls == dec(t).network.landed == 3 and dec(t).network.corrupted == 0
    verified = {rid: expected for before, _ in seen for rid, expected in before}
    assert sorted(verified) == ["HEALTH_CHECK_1", "r0", "r2", "r3"]
    assert all(verified[rid] for rid in ("r0", "r2", "r3")) and verified["HEALTH_CHECK_1"] == 0
    assert all([rid for rid, _ in before] == kept for before, kept in seen)
    assert sorted(t.finished) == ["r0", "r2", "r3"]  # all by decode (the health check at its prebuilt result)
    assert run.findings == [] and full(t)
    run.close()


@pytest.mark.parametrize("ci", [False, True])
def test_mismatch_every_counts_landed_transfers_not_health_checks(ci, monkeypatch):
    """Every 2nd landed transfer is corrupted: r0 lands first, the health check (SGLang's fake receiver,
    no digest) does not count, so r2, the second, is aborted and r3, the third, is not (the health
    check took rid number 1). Under
    SGLANG_IS_IN_CI SGLang raises on a mismatch unless it was injected: kvaudit's is, so it aborts too."""
    if ci:
        monkeypatch.setenv("SGLANG_IS_IN_CI", "true")
    run = AuditedRun(cfg(kv_checksum_mismatch_every=2))
    seen = spy_verify(run.target, monkeypatch)
    for op in [Submit(0, 20, 4), Step(1), HealthCheck(), Step(1), Submit(1, 20, 4), Submit(2, 20, 4), Idle()]:
        run.apply(op)
    dropped = [rid for before, kept in seen for rid, _ in before if rid not in kept]
    assert dropped == ["r2"] and dec(run.target).network.landed == 3
    assert run.findings == [] and full(run.target)
    run.close()


ABORTS = {
    "in the prealloc queue (no memory yet)": [Submit(0, 60, 40), Submit(1, 60, 40), Submit(2, 60, 40),
                                              Submit(3, 60, 40), Submit(4, 60, 40), Abort(4), Idle()],
    "in transfer": [Submit(0, 20, 4), Step(1), Abort(0), Idle()],
    "waiting (transferred)": [Submit(0, 20, 4), Step(2), Abort(0), Idle()],
    "running": [Submit(0, 20, 9), Step(4), Abort(0), Idle()],
    "all, everywhere": [Submit(i, 24, 12) for i in range(6)] + [Step(3), Abort(None), Idle()],
}


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("name", list(ABORTS))
def test_aborts_in_every_decode_queue_run_clean(name, core):
    ex = execute(cfg(core), ABORTS[name])
    assert ex.findings == [], [f.message for f in ex.findings]


def run_to_stage(core: str, ops, stage: str):
    """An audited decode-server run (transfer latency 2 steps) after ``ops``, and a request now in
    ``stage`` (see :func:`stages`; ``waiting``: its transfer landed, the prebuilt batch has not taken
    it yet). Returns (run, target, that request)."""
    run = AuditedRun(cfg(core, transfer_latency_steps=2))
    t = run.target
    for op in ops:
        run.apply(op)
    if stage == "waiting":
        while dec(t).network.sending:
            dec(t).network.tick()
        dec(t).sched.waiting_queue.extend(dec(t).transfer_queue.pop_transferred())
    victim = next(r for r, where in stages(t).items() if where == stage)
    return run, t, next(r for r in t._active() if r.rid == victim)


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("stage, ops", [
    ("prealloc", [Submit(i, 60, 40) for i in range(5)] + [Step(1)]),
    ("transfer", [Submit(0, 20, 30), Step(1)]),
    ("waiting", [Submit(0, 20, 30), Step(1)]),
    ("running", [Submit(0, 20, 30), Step(4)]),
    ("retracted", [Submit(0, 30, 30), Submit(1, 20, 30), Step(3), MemoryPressure(), Step(1)]),
])
def test_an_abort_ends_the_request_in_each_decode_queue(stage, ops, core):
    """The effect of each branch of abort_request's decode side: the request ends early (FINISH_ABORT,
    or, retracted, its backup dropped and gone from the retracted queue), and memory comes back."""
    run, t, req = run_to_stage(core, ops, stage)
    handle = t.live_rids().index(req.rid)
    produced = len(req.output_ids)
    run.apply(Abort(handle))
    run.apply(Idle())
    assert run.findings == [] and full(t) and stages(t) == {}
    if stage == "retracted":  # dropped with its backup: never resumed
        assert req.kv.retraction_backup is None and not req.kv.holds_kv and len(req.output_ids) == produced
    else:
        assert type(req.finished_reason).__name__ == "FINISH_ABORT"
        assert len(req.output_ids) < 30


@pytest.mark.parametrize("core", CORES)
def test_decode_retraction_backs_up_and_resumes(core):
    """Decode-mode retraction: release_req backs the victim's KV up (cpu_tensor) and frees it; the
    request waits in the retracted queue, resume_retracted_reqs pre-allocates it again and restores
    the KV, and it finishes. Clean."""
    run = AuditedRun(cfg(core))
    t = run.target
    for op in [Submit(0, 30, 12), Submit(1, 20, 12), Step(3), MemoryPressure(), Step(1)]:
        run.apply(op)
    assert t.retractions == 1
    retracted = [r for r in stages(t) if stages(t)[r] == "retracted"]
    assert len(retracted) == 1
    req = dec(t).prealloc_queue.retracted_queue[0]
    assert not req.kv.holds_kv and req.kv.retraction_backup is not None
    run.apply(Idle())
    assert run.findings == [] and full(t) and stages(t) == {}
    run.close()


@pytest.mark.parametrize("core", CORES)
def test_pause_retract_holds_requests_for_rebootstrap_until_continue(core):
    """``pause_generation(retract)`` on a decode server: running and transferred-waiting requests are
    retracted without a host backup and held (``hold_rebootstrap``); the server is then idle, so the
    weight update's flush succeeds; ``continue_generation`` re-bootstraps them (their KV recomputed by
    prefill, a new transfer). The re-bootstrap's prefill digests the prompt and the replayed output,
    decode verifies the prompt's pages only (``_verify_kv_checksums``): a request whose replay reaches
    a new page is aborted with a false "KV checksum mismatch" (a 500; corpora/sglang/README.md, "Seen
    by reading"), the one whose replay stays within its last page finishes. No memory is lost."""
    findings, run = run_ops(cfg(core), [Submit(0, 20, 8), Submit(1, 10, 8), Submit(2, 5, 8), Step(4)])
    t = run.target
    assert findings == [] and set(stages(t).values()) == {"running"} and not full(t)
    assert run.apply(PauseGeneration(2)) == []
    held = list(dec(t).prealloc_queue.held_rebootstrap_reqs)
    assert sorted(r.rid for r in held) == ["r0", "r1", "r2"] and stages(t) == {} and t.retractions == 3
    assert all(not r.kv.holds_kv and r.pd_rebootstrap_in_progress and r.kv.retraction_backup is None for r in held)
    assert [len(r.output_ids) for r in held] == [3, 3, 3]  # the boundary token popped for the replay
    assert full(t) and t.is_idle()
    assert run.apply(FlushCache()) == [] and t.flushed() == 1
    assert run.apply(Step(2)) == [] and stages(t) == {}  # paused: nothing moves
    assert run.apply(ContinueGeneration()) == [] and set(stages(t).values()) == {"prealloc"}
    assert run.apply(Idle()) == [] and full(t)
    ends = {r.rid: (type(r.finished_reason).__name__, getattr(r.finished_reason, "message", None)) for r in held}
    # pages of 4: 20 + 3 and 10 + 3 tokens reach a new page, 5 + 3 does not
    assert ends == {"r0": ("FINISH_ABORT", "KV checksum mismatch"), "r1": ("FINISH_ABORT", "KV checksum mismatch"),
                    "r2": ("FINISH_LENGTH", None)}
    assert all(r.finished_reason.status_code == 500 for r in held[:2])
    run.close()


@pytest.mark.parametrize("core", CORES)
def test_skipped_release_on_a_decode_server_is_a_leak(core):
    findings, run = run_ops(cfg(core, bugs=frozenset({"skip-release"})), [Submit(0, 20, 3), Idle()])
    run.close()
    assert ("leak", "req_to_token_pool") in {(f.kind, f.pool) for f in findings}


def test_missing_pd_dependency_is_one_line_exit_69(monkeypatch, tmp_path):
    from cli_helpers import invoke, one_error_line
    from kvaudit.targets.sglang import pd
    from kvaudit.targets.sglang.boot import SglangUnavailable

    def unavailable():
        raise SglangUnavailable("SGLang's PD decode path does not import: No module named 'einops'")

    monkeypatch.setattr(pd, "load_pd", unavailable)
    r = invoke("fuzz", "--target", "sglang", "--preset", "sglang-pd-decode", "--max-time", "5",
               "--out", str(tmp_path / "out"))
    assert r.exit_code == 69  # (a package this host lacks, as a missing atheris or redis-py)
    assert "einops" in one_error_line(r)


def test_a_clean_pd_decode_fuzz_run_counts_the_transfers_that_landed(tmp_path):
    """The preset exists to reach transfers (prealloc -> transfer -> prebuilt): its clean runs' ``reached:``
    line named retractions and checksums but not one transfer."""
    r = invoke("fuzz", "--target", "sglang", "--preset", "sglang-pd-decode", "--fuzzer", "random", "--max-time", "2",
               "--seed", "1", "--out", str(tmp_path))
    assert r.exit_code == 0, r.output
    counts = reached(r.stdout)
    assert counts["pd_transfers_landed"] > 0 and counts["kv_checksums_verified"] > 0, counts


# -- the decode radix cache (preset sglang-pd-decode-radix) ----------------------------------------------------
def radix_cfg(core="rust", **kw):
    return SGLANG_PRESETS["sglang-pd-decode-radix"].config(tree_core=core, **kw)


@pytest.mark.parametrize("core", CORES)
def test_decode_radix_cache_matches_a_prompt_against_decodes_tree_and_prefill_sends_the_rest(core):
    """--disaggregation-decode-enable-radix-cache, which SGLang refuses with the fake transfer backend and
    whose inserts a fake bootstrap host skips: the preset's requests carry a real host, and kvaudit's wire
    sends prefill's first token and room as a real prefill does. A second request of the first's family is
    matched against decode's own tree (``decode_prefix_len`` > 0: ``pd_decode_prefix_hits``) and commits
    SGLang's handoff token; the tree holds what both cached, and a flush gives every pool back."""
    run = AuditedRun(radix_cfg(core))
    t = run.target
    assert not t.tree_cache.disable and dec(t).P.get_disagg().disaggregation_decode_enable_radix_cache
    assert dec(t).network.prefix_hits == 0
    for op in [Submit(0, 40, 4, stop_at=3), Step(10), Submit(0, 60, 4, stop_at=3), Step(1)]:
        assert run.apply(op) == []
    req = next(dr.req for dr in dec(t).prealloc_queue.queue + dec(t).transfer_queue.queue)
    assert req.bootstrap_host != dec(t).P.FAKE_BOOTSTRAP_HOST and not req.skip_radix_cache_insert
    handoff = dec(t).P.decode._generate_fake_prefill_handoff_output_id(req)
    assert run.apply(Step(4)) == [] and req.output_ids[0] == handoff
    assert run.apply(Idle()) == [] and t.tree_cache.evictable_size() > 0
    assert t.reach()["pd_decode_prefix_hits"] == 1 and t.reach()["kv_checksums_verified"] == 2
    assert run.apply(FlushCache()) == [] and run.apply(Idle()) == [] and full(t)
    run.close()


@pytest.mark.parametrize("program", [
    [HealthCheck(), Idle()],  # a health check stays a fake transfer (its receiver got no metadata: a hang)
    [Submit(0, 1, 3), Step(2), PauseGeneration(2), Idle()],  # the re-bootstrap asks prefill to recompute
], ids=["health-check", "retract-rebootstrap"])
def test_decode_radix_cache_health_checks_and_rebootstraps_run_clean(program):
    """Both found by the first fuzz of the preset, driver faults: a hang (every health check is a fake-transfer
    request on a real server: http_server's health_generate sets FAKE_BOOTSTRAP_HOST) and a crash (a real-host
    request's re-bootstrap calls the manager's submit_prefill_recompute)."""
    ex = execute(radix_cfg(), program, full_stacks=False)
    assert ex.findings == [] and ex.ops_run == len(program)


def test_decode_radix_cache_needs_pd_decode_without_hisparse():
    with pytest.raises(ValueError, match="decode_radix_cache needs disaggregation_mode decode"):
        SGLANG_PRESETS["sglang"].config(decode_radix_cache=True)
