"""The real-SGLang target in PD-disaggregation prefill mode (presets ``sglang-pd-prefill`` and
``sglang-pd-prefill-chunked``): SGLang 0.5.23's ``PrefillBootstrapQueue``, inflight queue and prefill-mode
scheduler methods, driven on CPU against kvaudit's decode peer (issue 37).

* a request's path through the prefill server, each stage as SGLang holds it; its KV a root of the inflight
  queue while the transfer is in flight, released on success;
* an abort and a failed transfer at each stage (bootstrapping, waiting, chunked, inflight), a lost bootstrap
  (bootstrap timeout) and the waiting timeout: memory back, nothing hangs;
* the planted fault ``prefill-skip-failed-release`` found and minimized by ``kvaudit fuzz``, refused elsewhere.
"""

import pytest

from cli_helpers import invoke, one_error_line
from fault_helpers import fuzz_fault, minimized_fault_program
from kvaudit.audit.runner import AuditedRun, execute
from kvaudit.program import Abort, Idle, Step, Submit, TransferFail
from kvaudit.targets.sglang.config import SGLANG_PRESETS

pytestmark = pytest.mark.sglang


def cfg(preset="sglang-pd-prefill", **kw):
    return SGLANG_PRESETS[preset].config(**kw)


def pre(target):
    return target.feature("pd-prefill")


def stages(t):
    """Where each request is: the prefill server's queues, as SGLang holds them."""
    p = pre(t)
    out = {r.rid: "bootstrap" for r in p.bootstrap_queue.queue}
    out.update({r.rid: "waiting" for r in t.waiting})
    if t.chunked_req is not None:
        out[t.chunked_req.rid] = "chunked"
    out.update({r.rid: "inflight" for r in p.sched.disagg_prefill_inflight_queue})
    return out


def full(t):
    """Every pool back: KV (free or in the tree), rows, metadata slots."""
    kv = t.allocator.available_size() + t.tree_cache.evictable_size()
    meta = pre(t).metadata_allocator
    return (kv == t.allocator.size and t.req_to_token_pool.available_size() == t._row_count()
            and meta.available_size() == meta.size and t.tree_cache.protected_size() == 0)


def test_objects_are_sglangs_prefill_server():
    with AuditedRun(cfg()) as run:
        t = run.target
        p = pre(t)
        assert type(p.bootstrap_queue).__module__ == "sglang.srt.disaggregation.prefill"
        assert type(p.sched).__mro__[2].__name__ == "SchedulerDisaggregationPrefillMixin"
        assert type(t.tree_cache).__name__ == "UnifiedRadixCache" and not t.tree_cache.disable  # prefill keeps it
        assert t.config.program_features >= {"transfer_fail"}


def test_a_request_bootstraps_prefills_and_its_kv_is_the_inflight_queues_until_the_transfer_lands():
    run = AuditedRun(cfg(bootstrap_steps=2, transfer_latency_steps=2))
    t = run.target
    assert run.apply(Submit(0, 10, 4)) == []
    assert stages(t) == {"r0": "bootstrap"}
    assert run.apply(Step(2)) == []  # bootstrapped at step 2, prefilled, its last chunk sent
    assert stages(t) == {"r0": "inflight"}
    req = pre(t).sched.disagg_prefill_inflight_queue[0]
    assert req.kv.holds_kv and req.metadata_buffer_index >= 0
    places = {r.where for r in t.roots() if r.owner == "req:r0"}
    assert "inflight" in places  # the inflight queue owns its row and KV while the transfer is in flight
    assert any(r.pool == "metadata_buffers" and r.owner == "req:r0" for r in t.roots())
    assert run.apply(Step(1)) == [] and stages(t) == {"r0": "inflight"}  # Transferring
    assert run.apply(Step(1)) == [] and stages(t) == {}  # Success: release_kv_cache, metadata slot freed
    assert full(t) and t.tree_cache.evictable_size() > 0  # its prompt stays cached in the tree
    assert t.reach()["prefill_transfers_done"] == 1 and "r0" in t.finished
    run.close()


@pytest.mark.parametrize("preset, ops, where, counter", [
    ("sglang-pd-prefill", [Submit(0, 10, 4)], "bootstrap", "prefill_aborts_bootstrap"),
    ("sglang-pd-prefill", [Submit(0, 10, 4), Step(2)], "inflight", "prefill_aborts_inflight"),
    ("sglang-pd-prefill-chunked", [Submit(0, 40, 4), Step(4)], "chunked", "prefill_aborts_chunked"),
])
def test_an_abort_at_each_stage_gives_everything_back(preset, ops, where, counter):
    run = AuditedRun(cfg(preset))
    t = run.target
    for op in ops:
        assert run.apply(op) == []
    assert stages(t) == {"r0": where}
    assert run.apply(Abort(0)) == [] and run.apply(Idle()) == []
    assert stages(t) == {} and full(t) and t.reach()[counter] == 1
    run.close()


def test_an_abort_while_waiting_for_memory_releases_the_waiting_request():
    """Two prompts that do not fit together: the second waits (bootstrapped, metadata slot held)."""
    run = AuditedRun(cfg(num_slots=32, transfer_latency_steps=4))
    t = run.target
    for op in [Submit(0, 24, 2), Submit(1, 20, 2), Step(1)]:
        assert run.apply(op) == []
    assert stages(t) == {"r0": "inflight", "r1": "waiting"}
    assert run.apply(Abort(1)) == [] and stages(t) == {"r0": "inflight"}
    assert t.reach()["prefill_aborts_waiting"] == 1
    assert run.apply(Idle()) == [] and full(t)
    run.close()


@pytest.mark.parametrize("preset, ops, where, counter", [
    ("sglang-pd-prefill", [Submit(0, 10, 4)], "bootstrap", "prefill_bootstrap_failed"),
    ("sglang-pd-prefill", [Submit(0, 10, 4), Step(2)], "inflight", "prefill_transfers_failed"),
    ("sglang-pd-prefill-chunked", [Submit(0, 40, 4), Step(4)], "chunked", "prefill_transfers_failed"),
])
def test_a_failed_transfer_at_each_stage_concludes_and_gives_everything_back(preset, ops, where, counter):
    run = AuditedRun(cfg(preset))
    t = run.target
    for op in ops:
        assert run.apply(op) == []
    assert stages(t) == {"r0": where}
    assert run.apply(TransferFail(0)) == [] and run.apply(Idle()) == []
    assert stages(t) == {} and full(t) and t.reach()[counter] == 1
    run.close()


def test_a_lost_bootstrap_times_out_and_a_late_send_hits_the_waiting_timeout():
    """Every 2nd request's decode never comes: SGLang fails it at the bootstrap timeout. A request whose
    bootstrap is done but that waits for memory longer than the waiting timeout fails there."""
    ex = execute(cfg(bootstrap_lost_every=2, bootstrap_timeout_steps=4), [Submit(0, 8, 2), Submit(1, 8, 2), Idle()])
    assert ex.findings == []
    run = AuditedRun(cfg(bootstrap_lost_every=2, bootstrap_timeout_steps=4))
    for op in [Submit(0, 8, 2), Submit(1, 8, 2), Idle()]:
        assert run.apply(op) == []
    reach = run.target.reach()
    assert (reach["prefill_bootstrap_timeouts"], reach["prefill_transfers_done"]) == (1, 1) and full(run.target)
    # a prefill server neither decodes nor runs the batch result processor the shared counters count
    assert not {"retractions", "sglang_result_batches", "aborts_processed"} & set(reach)
    run.close()
    run = AuditedRun(cfg(num_slots=32, transfer_latency_steps=6, waiting_timeout_steps=2))
    for op in [Submit(0, 24, 2), Submit(1, 20, 2), Idle()]:
        assert run.apply(op) == []
    reach = run.target.reach()
    assert reach["prefill_waiting_timeouts"] == 1 and reach["prefill_transfers_done"] == 1 and full(run.target)
    run.close()


# -- the planted fault ------------------------------------------------------------------------------------------
def test_the_prefill_fault_is_refused_off_the_prefill_server():
    r = invoke("fuzz", "--target", "sglang", "--preset", "sglang-pd-decode", "--bug", "prefill-skip-failed-release",
               "--max-time", "1")
    assert r.exit_code == 2, r.output
    assert "prefill-skip-failed-release is for the sglang-pd-prefill presets" in one_error_line(r)


def test_the_prefill_fault_leaks_the_failed_transfers_request_and_only_with_it():
    ops = [Submit(0, 10, 4), Step(2), TransferFail(0), Idle()]
    assert execute(cfg(), ops).findings == []
    (f, *_) = execute(cfg(bugs=frozenset({"prefill-skip-failed-release"})), ops).findings
    assert f.kind == "leak" and f.pool in ("token_to_kv_pool", "req_to_token_pool")


def test_cli_fuzz_finds_and_minimizes_the_prefill_fault(tmp_path):
    doc, path = fuzz_fault(tmp_path, "sglang", "sglang-pd-prefill", "prefill-skip-failed-release", max_time="30")
    f = doc["findings"][0]
    assert f["kind"] == "leak" and f["signature"].startswith("leak/"), f
    config, program = minimized_fault_program(path, max_ops=5)
    assert config.preset == "sglang-pd-prefill" and config.bugs == {"prefill-skip-failed-release"}


# -- the wire's reads (finding 11 in corpora/sglang) ------------------------------------------------------------
def test_a_chunk_on_the_wire_is_a_root_until_it_lands():
    run = AuditedRun(cfg())
    t = run.target
    for op in [Submit(0, 10, 4), Step(1)]:
        assert run.apply(op) == []
    (wire,) = [r for r in t.roots() if r.where == "wire"]
    mine = {int(u) for r in t.roots() if r.owner == "req:r0" and r.pool == "token_to_kv_pool" for u in r.units}
    assert not wire.private and {int(u) for u in wire.units} <= mine  # the request's pages (some in the tree)
    assert run.apply(Step(2)) == [] and not [r for r in t.roots() if r.where == "wire"]  # landed
    run.close()


@pytest.mark.parametrize("fail", [Abort(0), TransferFail(0)])
def test_a_failed_rooms_chunk_read_to_its_end_finds_its_source_page_freed(fail):
    """SGLang releases a failed transfer's KV at the next inflight poll; a chunk the worker is still sending
    reads a page that release freed (sglang#38961). Without ``prefill_reads_after_failure`` the failure
    stops the read, and the same program is clean."""
    ops = [Submit(0, 1, 1), Step(1), fail, Step(1)]
    assert execute(cfg(), ops).findings == []
    (f, *_) = execute(cfg("sglang-pd-prefill-reads"), ops).findings
    assert f.signature == "use-after-free/token_to_kv_pool/request-kv/handle_inflight_transfer_failure@prefill.py"
    assert f.used_by == ["transfer:room1000"]
    assert execute(cfg("sglang-pd-prefill-reads"), [Submit(0, 1, 1), Idle()]).findings == []  # success: clean
