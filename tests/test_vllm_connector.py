"""The ``vllm-kv-connector`` preset: vLLM's Scheduler with NixlConnector's scheduler side and kvaudit's
worker stand-in (kvaudit/targets/vllm/connector.py). Loads park a request in WAITING_FOR_REMOTE_KVS
until their finished_recving; saves hold a finished request's blocks until their finished_sending;
aborts racing either leave the pool whole."""

import pytest
from cli_helpers import invoke, reached

from kvaudit.audit.runner import AuditedRun, execute
from kvaudit.program import Abort, Idle, MemoryPressure, Step, Submit, TransferFail
from kvaudit.targets import program_features
from kvaudit.targets.vllm.config import VLLM_PRESETS, VllmConfig

ASYNC = [False, True]


def connector_config(async_scheduling: bool, **changes) -> VllmConfig:
    return VLLM_PRESETS["vllm-kv-connector"].config(async_scheduling=async_scheduling, **changes)


class Recorder:
    """Wraps a connector target's ``_on_schedule``: the request ids each step scheduled tokens for."""

    def __init__(self, target):
        self.scheduled: list[set[str]] = []
        on_schedule = target._on_schedule

        def record(out):
            self.scheduled.append(set(out.num_scheduled_tokens))
            on_schedule(out)

        target._on_schedule = record


def held_blocks(target, rid: str) -> list:
    return [b for g in target.groups for b in g.req_to_blocks.get(rid, ()) if not b.is_null]


def pool_whole(target) -> bool:
    return target.manager.block_pool.get_num_free_blocks() == target.config.num_gpu_blocks - 1


@pytest.mark.parametrize("async_scheduling", ASYNC, ids=["sync", "async"])
def test_config_and_preset(async_scheduling):
    c = connector_config(async_scheduling)
    assert c.kv_connector == "NixlConnector" and c.kv_transfer_latency_steps == 3
    for bad in (dict(kv_connector="LMCacheConnectorV1"), dict(kv_transfer_latency_steps=0),
                dict(kv_transfer_latency_steps=True), dict(level="manager", async_scheduling=False)):
        with pytest.raises(ValueError):
            c.replace(**bad)


@pytest.mark.vllm
@pytest.mark.parametrize("async_scheduling", ASYNC, ids=["sync", "async"])
def test_remote_kv_request_admitted_only_after_its_load_completes(async_scheduling):
    with AuditedRun(connector_config(async_scheduling, kv_transfer_latency_steps=4)) as run:
        t = run.target
        rec = Recorder(t)
        run.apply(Submit(family=1, prompt_len=40, max_new_tokens=3))  # submit 1: wants remote KV
        rid = t.submitted[0]
        assert t.scheduler.requests[rid].kv_transfer_params["remote_engine_id"]
        run.apply(Step(n=1))
        S = t.V.RequestStatus
        assert t.scheduler.requests[rid].status == S.WAITING_FOR_REMOTE_KVS
        assert len(held_blocks(t, rid)) == 3  # blocks allocated for the load: 40 tokens / 16
        due = t.worker.recving[rid]
        assert due > 1
        for _ in range(10):
            if rid not in t.worker.recving:
                break
            assert t.scheduler.requests[rid].status == S.WAITING_FOR_REMOTE_KVS
            run.apply(Step(n=1))
        assert rid not in t.worker.recving
        assert not run.findings
        run.apply(Idle())
        assert not run.findings
        first = next(i for i, ids in enumerate(rec.scheduled) if rid in ids)
        assert first >= due  # never scheduled before the worker reported the load done
        assert rid not in t.scheduler.requests and len(t.texts[rid]) == 40 + 3
        assert pool_whole(t)


def _finish_save_request(run):
    """Submit a plain-sized pair (1: load, 2: save) and step until request 2 has finished but its KV
    is still being sent. Returns request 2's id."""
    t = run.target
    run.apply(Submit(family=1, prompt_len=8, max_new_tokens=2))
    run.apply(Submit(family=2, prompt_len=36, max_new_tokens=2))
    rid = t.submitted[1]
    assert t.scheduler.requests[rid].kv_transfer_params == {"do_remote_prefill": False, "do_remote_decode": True}
    for _ in range(20):
        run.apply(Step(n=1))
        if rid in t.worker.sending:
            return rid
    raise AssertionError(f"request 2 never started sending: {t.describe_busy()}")


@pytest.mark.vllm
@pytest.mark.parametrize("async_scheduling", ASYNC, ids=["sync", "async"])
def test_finished_request_holds_blocks_while_its_save_is_in_flight(async_scheduling):
    with AuditedRun(connector_config(async_scheduling, kv_transfer_latency_steps=8)) as run:
        t = run.target
        rid = _finish_save_request(run)
        request = t.scheduler.requests[rid]
        assert request.is_finished()
        blocks = held_blocks(t, rid)
        assert len(blocks) == 3 and all(b.ref_cnt >= 1 for b in blocks)
        owners = {r.owner for r in t.roots() if set(r.units.tolist()) & {b.block_id for b in blocks}}
        assert f"req:{rid}" in owners  # the observer's roots cover the finished-but-held request
        for _ in range(10):
            if rid not in t.worker.sending:
                break
            assert rid in t.scheduler.requests and held_blocks(t, rid) == blocks
            run.apply(Step(n=1))
        assert rid not in t.worker.sending
        run.apply(Step(n=2))  # the output carrying finished_sending is processed (async: one step later)
        assert rid not in t.scheduler.requests and not held_blocks(t, rid)
        assert not run.findings
        run.apply(Idle())
        assert not run.findings and pool_whole(t)


@pytest.mark.vllm
@pytest.mark.parametrize("async_scheduling", ASYNC, ids=["sync", "async"])
def test_abort_during_load_delays_the_free_until_the_load_reports(async_scheduling):
    with AuditedRun(connector_config(async_scheduling, kv_transfer_latency_steps=6)) as run:
        t = run.target
        run.apply(Submit(family=3, prompt_len=40, max_new_tokens=3))
        run.apply(Submit(family=4, prompt_len=20, max_new_tokens=6))  # a plain-sized neighbour (save)
        run.apply(Step(n=1))
        rid = t.submitted[0]
        assert rid in t.worker.recving
        run.apply(Abort(handle=0))
        request = t.scheduler.requests[rid]  # finished, but held until the load reports (vLLM's rule)
        assert request.is_finished() and len(held_blocks(t, rid)) == 3
        assert not run.findings
        run.apply(Idle())
        assert not run.findings
        assert rid not in t.scheduler.requests and not t.worker.recving and pool_whole(t)


@pytest.mark.vllm
@pytest.mark.parametrize("async_scheduling", ASYNC, ids=["sync", "async"])
def test_abort_all_during_a_save_leaves_the_pool_whole(async_scheduling):
    with AuditedRun(connector_config(async_scheduling, kv_transfer_latency_steps=8)) as run:
        t = run.target
        rid = _finish_save_request(run)
        run.apply(Submit(family=5, prompt_len=30, max_new_tokens=8))
        run.apply(Submit(family=6, prompt_len=30, max_new_tokens=8))
        run.apply(Step(n=1))
        run.apply(Abort(handle=None))  # the finished request is not aborted again; the others are
        assert rid in t.scheduler.requests and rid in t.worker.sending
        assert not run.findings
        run.apply(Idle())
        assert not run.findings
        assert not t.scheduler.requests and not len(t.worker) and pool_whole(t)


@pytest.mark.vllm
def test_deferred_frees_are_roots():
    """Async scheduling with a consumer connector defers the frees of requests aborted with a step in
    flight (``Scheduler.deferred_frees``); the observer counts them as holders, so no finding."""
    with AuditedRun(connector_config(True)) as run:
        t = run.target
        seen = 0
        for i in range(8):
            run.apply(Submit(family=i, prompt_len=20, max_new_tokens=10))
        for _ in range(6):
            run.apply(Step(n=1))
            run.apply(Abort(handle=2))
            if t.scheduler.deferred_frees:
                seen += 1
                deferred = {int(u) for r in t.roots() if r.where == "deferred" for u in r.units}
                assert deferred == {b.block_id for _, blocks in t.scheduler.deferred_frees for b in blocks
                                    if not b.is_null}
        assert seen and not run.findings
        run.apply(Idle())
        assert not run.findings and pool_whole(t)


@pytest.mark.vllm
@pytest.mark.parametrize("fault", [False, True], ids=["clean", "free-under-inflight-step"])
def test_inflight_write_oracle(fault):
    """vLLM #45357's invariant: a request that finishes while the next batch (which scheduled it again)
    is in flight keeps its blocks in ``deferred_frees`` until that batch is processed. With the fix
    turned off (the fault), its blocks are freed under the step and the oracle names them."""
    config = connector_config(True, bugs=frozenset({"free-under-inflight-step"} if fault else ()))
    with AuditedRun(config) as run:
        t = run.target
        assert t.guard_inflight and t.scheduler.defer_block_free is not fault
        run.apply(Submit(family=0, prompt_len=1, max_new_tokens=5, stop_at=3))
        run.apply(Idle())
        hits = [f for f in run.findings if f.check == "inflight-write"]
        if fault:
            assert hits and hits[0].kind == "use-after-free"
            assert "freed while a step in flight still writes it for req:req-000001" in hits[0].message
            # recorded from vLLM's package, not this machine's site-packages path (a file reads the same elsewhere)
            assert hits[0].free_sites[0].file == "vllm/v1/core/sched/scheduler.py", hits[0].free_sites[0]
            # the headline names what the detail names: the pool, its units, who still uses them
            head = hits[0].summary()
            assert head.startswith("Use-after-free of 1 block in pool block_pool, freed at ") and \
                head.split("; allocated at ")[0].endswith(
                    "while still used by a step in flight that writes it for req:req-000001"), head
        else:
            assert not run.findings and pool_whole(t)


@pytest.mark.vllm
@pytest.mark.parametrize("fault", [False, True], ids=["clean", "free-window-under-inflight-step"])
def test_inflight_read_oracle(fault):
    """vLLM #47282's invariant: the sliding-window blocks a step in flight still reads stay held until
    that step is processed. With the pre-#47728 count put back (the fault), a finishing request's
    out-of-window blocks are freed under the step and the oracle names the read, not a write."""
    config = VLLM_PRESETS["vllm-kv-connector-swa"].config(
        bugs=frozenset({"free-window-under-inflight-step"} if fault else ()))
    with AuditedRun(config) as run:
        t = run.target
        assert t.guard_inflight and [getattr(m, "sliding_window", None) for m in t.groups] == [None, 32]
        run.apply(Submit(family=0, prompt_len=41, max_new_tokens=12, stop_at=6))
        run.apply(Idle())
        if fault:
            (hit,) = run.findings
            assert (hit.kind, hit.check) == ("use-after-free", "inflight-read")
            assert "still reads it for req:req-000001" in hit.message
            assert "still used by a step in flight that reads it for req:req-000001;" in hit.summary()
        else:
            assert not run.findings and pool_whole(t)


@pytest.mark.vllm
def test_inflight_write_oracle_holds_only_under_vllms_condition():
    """Without a KV consumer vLLM frees under an in-flight step by design (nothing loads into the reused
    block unordered): the guard is off, and the fault changes nothing the oracles see."""
    config = VLLM_PRESETS["vllm-async"].config(bugs=frozenset({"free-under-inflight-step"}))
    with AuditedRun(config) as run:
        assert not run.target.guard_inflight
        run.apply(Submit(family=0, prompt_len=1, max_new_tokens=5, stop_at=3))
        run.apply(Idle())
        assert not run.findings


@pytest.mark.vllm
def test_clean_preset_fuzz_finds_nothing():
    from kvaudit.testing import fuzz
    result = fuzz(VLLM_PRESETS["vllm-kv-connector"].config(), max_time=6, seed=3)
    result.assert_clean()
    assert result.executions > 10


FAIL_PRESETS = {"recompute": "vllm-kv-fail", "fail": "vllm-kv-fail-abort"}


def test_failure_policy_config_and_the_op_it_draws():
    c = VLLM_PRESETS["vllm-kv-fail"].config()
    assert c.kv_load_failure_policy == "recompute" and c.async_scheduling
    assert VLLM_PRESETS["vllm-kv-fail-abort"].config().kv_load_failure_policy == "fail"
    for bad in (dict(kv_load_failure_policy="retry"), dict(kv_connector="KvauditAsyncSaveConnector"),
                dict(sliding_window=32, num_gpu_blocks=96)):
        with pytest.raises(ValueError):
            c.replace(**bad)
    assert "transfer_fail" in program_features(c)
    assert "transfer_fail" not in program_features(connector_config(True))  # the connector presets as they were


@pytest.mark.vllm
@pytest.mark.parametrize("policy", sorted(FAIL_PRESETS))
def test_failed_load_is_recomputed_or_fails_its_request(policy):
    with AuditedRun(VLLM_PRESETS[FAIL_PRESETS[policy]].config()) as run:
        t = run.target
        run.apply(Submit(family=1, prompt_len=40, max_new_tokens=3))  # submit 1: wants remote KV
        rid = t.submitted[0]
        run.apply(TransferFail(handle=0))
        run.apply(Step(n=1))
        assert rid in t.worker.recving and len(held_blocks(t, rid)) == 3
        run.apply(Idle())
        assert not run.findings and pool_whole(t)
        assert (t.reached["failed_transfers"], t.reached["invalid_blocks"]) == (1, 3)
        assert len(t.texts[rid]) - 40 == (3 if policy == "recompute" else 0)  # "fail": FINISHED_ERROR, no token


@pytest.mark.vllm
@pytest.mark.parametrize("policy", sorted(FAIL_PRESETS))
def test_memory_pressure_reports_a_running_requests_cached_blocks_invalid(policy):
    with AuditedRun(VLLM_PRESETS[FAIL_PRESETS[policy]].config()) as run:
        t = run.target
        run.apply(Submit(family=1, prompt_len=8, max_new_tokens=1))
        run.apply(Submit(family=2, prompt_len=40, max_new_tokens=60))  # submit 2: runs here, sent when done
        run.apply(Step(n=4))
        rid = t.submitted[1]
        assert t.scheduler.requests[rid] in t.scheduler.running
        run.apply(MemoryPressure())
        assert len(t.worker.invalid) >= 2  # its full prompt blocks, cached, held
        run.apply(Step(n=3))
        assert t.reached["invalid_blocks"] >= 2 and not run.findings
        request = t.scheduler.requests.get(rid)  # "fail": it ends with FINISHED_ERROR (gone, or held for a send)
        assert (request in t.scheduler.running) == (policy == "recompute")
        run.apply(Idle())
        assert not run.findings and pool_whole(t)


@pytest.mark.vllm
@pytest.mark.parametrize("fault", [False, True], ids=["shipped", "lose-failed-load"])
def test_an_aborted_load_that_fails_frees_its_blocks_once_reported(fault):
    """vLLM #46283's path in pull mode: a load aborted in WAITING_FOR_REMOTE_KVS keeps its blocks until
    the worker reports it; a failed read is reported (finished_recving), so they come back. A report
    that never comes (the fault; #46283: push mode, the prefill side never writes) holds them."""
    config = VLLM_PRESETS["vllm-kv-fail-abort"].config(bugs=frozenset({"lose-failed-load"} if fault else ()))
    program = [Submit(family=0, prompt_len=40, max_new_tokens=3), Step(n=1), Abort(handle=0),
               TransferFail(handle=0), Idle()]
    assert execute(config, program).signatures == (["hang/-/idle/finished:held"] if fault else [])


@pytest.mark.vllm
@pytest.mark.parametrize("abort, counted", [(False, "waiting=1 "), (True, "finished_held=1")],
                         ids=["waiting-for-remote-kvs", "finished-held"])
def test_a_hang_line_counts_the_request_that_is_stuck(abort, counted):
    """vLLM 0.33.0 keeps a request waiting for remote KV in ``kv_holding_waiting``, not ``waiting``: the
    hang read "waiting=0 ...; stuck: waiting:waiting-for-remote-kvs"."""
    config = VLLM_PRESETS["vllm-kv-fail-abort"].config(bugs=frozenset({"lose-failed-load"}))
    program = [Submit(family=0, prompt_len=40, max_new_tokens=3), Step(n=1), *[Abort(handle=0)] * abort,
               TransferFail(handle=0), Idle()]
    [hang] = execute(config, program).findings
    assert hang.kind == "hang" and counted in hang.message, hang.message
    assert ("waiting=0 " in hang.message) == abort, hang.message


@pytest.mark.vllm
def test_a_lost_failed_load_is_found_and_minimized():
    from kvaudit.testing import fuzz
    config = VLLM_PRESETS["vllm-kv-fail-abort"].config(bugs=frozenset({"lose-failed-load"}))
    result = fuzz(config, max_time=10, seed=11, fuzzer="random")
    assert result.signatures == ["hang/-/idle/waiting:waiting-for-remote-kvs"]
    assert 0 < len(result.program) < result.original_length
    assert any(isinstance(op, TransferFail) for op in result.program)
    assert execute(config.replace(bugs=frozenset()), result.program).signatures == []


@pytest.mark.vllm
@pytest.mark.parametrize("preset", sorted(FAIL_PRESETS.values()))
def test_clean_failure_preset_fuzz_finds_nothing(preset):
    from kvaudit.testing import fuzz
    result = fuzz(VLLM_PRESETS[preset].config(), max_time=6, seed=3, fuzzer="random")
    result.assert_clean()
    assert result.executions > 10


@pytest.mark.vllm
def test_push_mode_loads_complete_and_a_failed_push_is_never_reported():
    """``vllm-kv-push-fail``: a decode request's KV is written by the prefill side and reported done; a
    push that never comes is reported by nothing in vLLM 0.33.0, so the request waits for good (#46283's
    cause; aborted, its blocks stay held: corpora/vllm/own/vllm-46283.json)."""
    config = VLLM_PRESETS["vllm-kv-push-fail"].config()
    submits = [Submit(family=0, prompt_len=40, max_new_tokens=3), Submit(family=1, prompt_len=40, max_new_tokens=3)]
    assert execute(config, [*submits, Idle()]).signatures == []
    failed = execute(config, [submits[0], TransferFail(handle=0), Idle()])
    assert failed.signatures == ["hang/-/idle/waiting:waiting-for-remote-kvs"]


@pytest.mark.vllm
def test_a_clean_connector_fuzz_run_counts_the_loads_and_sends_done(tmp_path):
    """vllm-kv-connector exists to reach remote KV loads and sends: its clean runs' ``reached:`` line named
    only failures, held frees and preemptions. It named failures that cannot happen there too: with no
    kv_load_failure_policy no transfer fails and no block is reported invalid, yet `failed_transfers=0,
    invalid_blocks=0` and `not reached: failed_transfers, invalid_blocks, ... (not searched)` were printed on every
    clean run; they are given only where transfers may fail (vllm-kv-fail*)."""
    r = invoke("fuzz", "--target", "vllm", "--preset", "vllm-kv-connector", "--fuzzer", "random", "--max-time", "2",
               "--seed", "1", "--out", str(tmp_path))
    assert r.exit_code == 0, r.output
    counts = reached(r.stdout)
    assert counts["kv_loads_done"] > 0 and counts["kv_sends_done"] > 0, counts
    assert "failed_transfers" not in counts and "invalid_blocks" not in counts, counts
