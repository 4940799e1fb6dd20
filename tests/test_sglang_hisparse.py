"""HiSparse mode of the real-SGLang target (kvaudit/targets/sglang/hisparse.py): SGLang 0.5.23's
HiSparseTokenToKVPoolAllocator, host pool and HiSparseCoordinator driven on CPU.

* objects come from SGLang's constructors; the 7.2 sequences run clean;
* the memory model's hazards A.3 (a release without request_finished) and A.4 (staged requests own
  memory in no batch) as programs, with what kvaudit sees;
* the one finding the fuzzer makes on the preset (a page-1 device-buffer slot lost at growth).

Skipped where SGLang 0.5.23 is not installed.
"""

import pytest


from cli_helpers import invoke
from kvaudit.program import (Abort, ContinueGeneration, FlushCache, HealthCheck, Idle, MemoryPressure,
                             PauseGeneration, Step, Submit)
from sglang_helpers import CORES, run_ops
from kvaudit.audit.runner import AuditedRun, execute
from kvaudit.targets.sglang.config import SGLANG_PRESETS, SglangConfig

pytestmark = pytest.mark.sglang

HOST = "hisparse_host_pool"
DEVICE = "hisparse_device_pool"



def sparse(target):
    """The target's hisparse feature."""
    return target.feature("hisparse")

def cfg(core="rust", **kw):
    return SGLANG_PRESETS["sglang-hisparse"].config(tree_core=core, **kw)


def free_counts(t):
    a = t.allocator
    return (a.logical_attn_allocator.available_size(), a.hisparse_attn_allocator.available_size(),
            sparse(t).coordinator.mem_pool_host.available_size(), t.req_to_token_pool.available_size())


def full_counts(t):
    a = t.allocator
    return (a.logical_attn_allocator.size, a.hisparse_attn_allocator.size, sparse(t).coordinator.mem_pool_host.size,
            t.req_to_token_pool.size)


# -- config ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw, text", [
    ({"enable_streaming_session": True}, "enable_streaming_session"),
    ({"enable_overlap": True}, "enable_overlap"),
    ({"hisparse_device_buffer_size": 24, "page_size": 16}, "multiple of page_size"),
    ({"hisparse_device_buffer_size": 256}, "below num_slots"),
    ({"hisparse_host_to_device_ratio": 0}, "hisparse_host_to_device_ratio"),
])
def test_incompatible_hisparse_settings_are_refused(kw, text):
    with pytest.raises(ValueError, match=text):
        cfg(**kw)


def test_hisparse_fault_needs_hisparse_and_radix_cache_is_off():
    with pytest.raises(ValueError, match="is for --preset sglang-hisparse only"):
        SglangConfig(bugs=frozenset({"hisparse-skip-finish"}))
    assert cfg().disable_radix_cache and not SglangConfig().disable_radix_cache


# -- bootstrap ------------------------------------------------------------------------------------
@pytest.mark.parametrize("core", CORES)
def test_objects_come_from_sglangs_own_constructors(core):
    with AuditedRun(cfg(core)) as run:
        t = run.target
        a, co = t.allocator, sparse(t).coordinator
        assert type(t).__name__ == "SglangTarget" and [type(f).__name__ for f in t.features] == ["HiSparse"]
        assert type(a).__name__ == "HiSparseTokenToKVPoolAllocator" and a.__module__.startswith("sglang.")
        assert type(a.get_kvcache()).__name__ == "MiniMaxSparseKVPool"
        assert type(co).__name__ == "HiSparseCoordinator" and co.is_m3_hisparse
        assert type(co.mem_pool_host).__name__ == "HiSparseMHATokenToKVPoolHost"
        assert type(a.logical_attn_allocator).__name__ == type(a.hisparse_attn_allocator).__name__ \
            == "PagedTokenToKVPoolAllocator"
        assert a.logical_attn_allocator.size == 2 * a.hisparse_attn_allocator.size == 512
        assert co.device_buffer_size == 32 and co.padded_buffer_size == 33
        assert t.tree_cache.disable and t.tree_core == ("RustUnifiedTreeCore" if core == "rust" else "UnifiedTreeCore")
        assert [p.name for p in t.pools()] == ["token_to_kv_pool", "req_to_token_pool", DEVICE, HOST]
        assert [s[:2] for s in sparse(t).shims] == ["S1", "S2"]


# -- section 7.2 event sequences, clean --------------------------------------------------------------
SEQUENCES = {
    "new request": [Submit(0, 20, 4), Idle()],
    "prompt longer than the device buffer": [Submit(0, 60, 6), Submit(1, 40, 3), Idle()],
    "max_new_tokens 1 and EOS at the first token": [Submit(0, 9, 1), Submit(1, 9, 8, stop_at=1), Idle()],
    "health check idle, then busy": [HealthCheck(), Idle(), Submit(0, 20, 8), Step(1), HealthCheck(), Idle()],
    "abort waiting, running, unknown and all": [Submit(0, 20, 8), Step(3), Submit(1, 20, 8), Abort(1), Abort(0),
                                               Abort(7), Step(2), Submit(2, 9, 9), Step(2), Abort(None), Idle()],
    "abort right after prefill (staged, in the last batch)": [Submit(0, 50, 8), Step(1), Abort(0), Idle()],
    "memory pressure retracts": [Submit(0, 20, 20), Submit(1, 50, 20), Step(4), MemoryPressure(), Step(2), Idle()],
    "flush idle": [Submit(0, 20, 2), Idle(), Step(1)],
}


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("staging_steps", [0, 1, 3])
@pytest.mark.parametrize("name", list(SEQUENCES))
def test_event_sequence_runs_clean(name, staging_steps, core):
    ex = execute(cfg(core, hisparse_staging_steps=staging_steps), SEQUENCES[name])
    assert ex.findings == [], [f.message for f in ex.findings]


def test_sequences_take_the_hisparse_paths():
    # staging -> collect_ready_reqs -> device buffers: a long prompt gets the padded buffer, its surplus
    # prefill slots go back; a short one gets a page-aligned buffer that grows while decoding
    findings, run = run_ops(cfg(), [Submit(0, 60, 6), Submit(1, 10, 6), Step(1)])
    t, co = run.target, sparse(run.target).coordinator
    assert findings == [] and [r.rid for r in sparse(t).staged()] == ["r0", "r1"] and t.running == []
    assert free_counts(t) == (512 - 70, 256 - 70, 513 - 70, 14)  # prefill KV mapped physically, all backed up
    run.apply(Step(2))  # staging done (one step in flight), both decode once
    rows = {r.rid: r.kv.req_pool_idx for r in t.running}
    assert sparse(t).staged() == [] and sorted(rows) == ["r0", "r1"]
    assert int(co.req_device_buffer_size[rows["r0"]]) == 33 and int(co.req_device_buffer_size[rows["r1"]]) == 11
    assert free_counts(t)[1] == 256 - 33 - 11
    run.apply(Idle())
    assert run.findings == [] and free_counts(t) == full_counts(t)
    # a clean sglang-hisparse run's reached: line named no HiSparse path: both staged, decoded over device buffers
    assert t.reach()["hisparse_staged"] == 2 and t.reach()["hisparse_decode_steps"] >= 5, t.reach()
    run.close()
    # memory pressure: retract_decode -> release_req -> retract_req -> request_finished on a running request
    seen = []
    findings, run = run_ops(cfg(), [Submit(0, 20, 20), Submit(1, 50, 20), Step(4)])
    real = sparse(run.target).coordinator.retract_req
    sparse(run.target).coordinator.retract_req = lambda req: (seen.append((req.rid, req.hisparse_staging)), real(req))
    run.apply(MemoryPressure())
    run.apply(Step(1))
    assert run.target.retractions == 1 and seen == [("r1", False)]
    run.apply(Idle())
    assert run.findings == [] and free_counts(run.target) == full_counts(run.target)
    run.close()


# -- hazard A.3: a release without request_finished --------------------------------------------------
@pytest.mark.parametrize("core", CORES)
def test_hazard_a3_release_without_request_finished_leaks_device_buffer_and_host_slots(core):
    """A.3 via the fault hisparse-skip-finish: release_kv_cache frees the logical slots (and, through the
    mapping, the decode tokens' physical slots) but the device buffer -- taken out of the mapping by
    alloc_device_buffer -- and every host slot stay allocated. kvaudit: leaks in both HiSparse pools at
    SGLang's allocation sites; SGLang's own checks are silent (skipped under HiSparse)."""
    ops = [Submit(0, 20, 4), Idle()]
    findings, run = run_ops(cfg(core, bugs=frozenset({"hisparse-skip-finish"})), ops)
    t = run.target
    leaks = {(f.pool, f.alloc_sites[0].function): f.num_units for f in findings if f.kind == "leak"}
    assert {f.kind for f in findings} == {"leak"}
    assert leaks == {(DEVICE, "alloc_token_slots"): 20,  # the prefill's physical slots, kept as the buffer
                     (HOST, "admit_request_into_staging"): 20, (HOST, "_eager_backup_previous_token"): 2}
    assert all(not f.indirect and f.engine_check == ["engine check_memory(): ok"] for f in findings)
    assert "sglang/srt/managers/hisparse_coordinator.py" in \
        next(f for f in findings if f.pool == HOST).alloc_sites[0].file.replace("\\", "/")
    assert free_counts(t) == (512, 256 - 20, 513 - 22, 16)  # logical and rows all back, not the rest
    # the row's next occupant re-uses the stale host slots (req_to_host_pool_allocated_len stayed), and
    # frees them at its own finish: the host leak heals, the device buffer stays lost
    run.apply(Submit(1, 30, 2))
    run.apply(Idle())
    assert free_counts(t) == (512, 256 - 20, 513, 16)
    run.close()


@pytest.mark.parametrize("core", CORES)
def test_hazard_a3_chunked_abort_calls_no_hisparse_method_and_is_clean(core, monkeypatch):
    """A.3, chunked prefill: process_pending_chunked_abort releases with release_kv_cache(checkpoint=False)
    and no request_finished. The chunked request was never staged (staging follows the last chunk), so
    its physical prefill slots are still mapped and allocator.free returns them: clean (a leak needs
    speculative scratch, which this target does not build)."""
    findings, run = run_ops(cfg(core, chunked_prefill_size=16), [Submit(0, 60, 8), Step(2)])
    t, co = run.target, sparse(run.target).coordinator
    req = t.chunked_req
    assert findings == [] and req is not None and req.extend_end == 32 and not req.hisparse_staging
    assert free_counts(t)[1] == 256 - 32  # both chunks' physical slots, mapped
    calls = []
    for name in ("request_finished", "retract_req", "abort_staging_request"):
        real = getattr(co, name)
        monkeypatch.setattr(co, name, lambda r, _n=name, _f=real: (calls.append(_n), _f(r)))
    run.apply(Abort(0))
    run.apply(Step(1))
    assert calls == [] and t.chunked_req is None and req.finished() and not req.kv.holds_kv
    assert run.findings == [] and free_counts(t) == full_counts(t)
    run.close()


# -- hazard A.4: staged requests own memory in no batch ----------------------------------------------------
@pytest.mark.parametrize("core", CORES)
def test_hazard_a4_staged_request_owns_memory_in_no_batch_and_abort_cannot_reach_it(core):
    """A.4: with the staging copy in flight (hisparse_staging_steps=2), r0 stays staged after its prefill
    batch stopped being the last batch. It owns a row, 40 logical and 40 physical slots and 40 host
    slots, and is in neither running_batch nor last_batch: SGLang's busy-check owners miss it (its
    identity comes out 40 short), abort_request cannot reach it (r0 later finishes by length), and
    kvaudit counts its memory as reachable -- no false leak."""
    findings, run = run_ops(cfg(core, hisparse_staging_steps=2), [Submit(0, 40, 6), Step(1), Submit(1, 10, 20),
                                                                   Step(1)])
    t, co = run.target, sparse(run.target).coordinator
    r0 = next(r for r in sparse(t).staged() if r.rid == "r0")
    row = r0.kv.req_pool_idx
    assert findings == [] and r0.hisparse_staging and [r.rid for r in sparse(t)._last_batch] == ["r1"]
    assert not any(r is r0 for r in t.running + sparse(t)._last_batch)
    assert r0.kv.holds_kv and r0.kv.kv_allocated_len == 40
    assert int(co.req_to_host_pool_allocated_len[row]) == 40
    logical = t.req_to_token_pool.req_to_token[row, :40].long()
    assert int((t.allocator.full_to_hisparse_device_index_mapping[logical] > 0).sum()) == 40
    assert not any(r is r0 for r in sparse(t).sglang_owners())
    assert sparse(t).busy_check() == ["[token_to_kv_pool] available=462 + evictable=0 + protected=0 + uncached=10 = "
                                      "472 != total=512"]  # r0's 40 logical slots are nobody's
    run.apply(Abort(0))
    assert r0.to_finish is None and not r0.finished()  # not reached: "todo hisparse"
    run.apply(Idle())
    assert run.findings == []
    assert r0.finished() and type(r0.finished_reason).__name__ == "FINISH_LENGTH" and len(r0.output_ids) == 6
    assert free_counts(t) == full_counts(t)
    run.close()
    # the contrast: aborted while its prefill batch is still the last batch, the abort reaches it
    findings, run = run_ops(cfg(core, hisparse_staging_steps=2), [Submit(0, 40, 6), Step(1), Abort(0)])
    (r0,) = sparse(run.target).staged()
    assert findings == [] and r0.to_finish is not None
    run.apply(Idle())
    assert run.findings == [] and type(r0.finished_reason).__name__ == "FINISH_ABORT" and len(r0.output_ids) < 6
    run.close()


# -- the fuzzer's finding on sglang-hisparse ---------------------------------------------------------------
@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("prompt, new, leaked", [(31, 2, 1), (20, 13, 1), (31, 3, 0), (40, 3, 0)])
def test_short_request_finishing_as_its_buffer_reaches_the_padded_size_loses_one_slot(core, prompt, new, leaked):
    """SGLang 0.5.23, page 1: a short request (prompt < device_buffer_size) whose decode makes
    seq_len == device_buffer_size grows its buffer to the padded size (+2 slots) in _grow_device_buffers;
    map_last_loc_to_buffer then writes the reserved slot (position seq_len-1) into
    req_device_buffer_token_locs[..., device_buffer_size], overwriting the new last slot's entry. If the
    request finishes at that step, request_finished frees the union of token_locs and misses that slot:
    one physical slot lost for good. One step later the entry is rewritten and nothing is lost."""
    ex = execute(cfg(core), [Submit(0, prompt, new), Idle()])
    if leaked:
        (f,) = ex.findings
        assert (f.kind, f.pool, f.num_units, f.alloc_sites[0].function) == ("leak", DEVICE, 1, "_grow_device_buffers")
    else:
        assert ex.findings == []


# -- CLI -------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_cli_fuzz_finds_the_injected_hisparse_leak(tmp_path):
    r = invoke("fuzz", "--target", "sglang", "--preset", "sglang-hisparse", "--bug", "hisparse-skip-finish",
               "--max-time", "30", "--seed", "1", "--out", str(tmp_path / "out"))
    assert r.exit_code == 1, r.output
    assert "leak" in r.stdout and "hisparse_" in r.stdout


@pytest.mark.parametrize("core", CORES)
def test_pause_retract_during_staging_aborts_the_staging_and_frees_every_pool(core):
    """Retraction during staging (memory model 7.2): the staged request was in the last (prefill)
    batch, so ``pause_generation(retract)`` retracts it; ``release_req`` -> ``retract_req`` ->
    ``abort_staging_request`` returns its physical slots and host slots, ``release_kv_cache`` the rest."""
    findings, run = run_ops(cfg(core), [])
    t = run.target
    before = free_counts(t)
    for op in [Submit(0, 20, 8), Step(1)]:
        assert run.apply(op) == []
    assert [r.rid for r in sparse(t).staged()] == ["r0"] and sparse(t).coordinator.has_ongoing_staging()
    assert all(a < b for a, b in zip(free_counts(t), before))  # row, logical, physical and host slots held
    assert run.apply(PauseGeneration(2)) == []
    assert sparse(t).staged() == [] and not sparse(t).coordinator.has_ongoing_staging() and t.retractions == 1
    assert free_counts(t) == before and [r.rid for r in t.waiting] == ["r0"]
    assert run.apply(FlushCache()) == [] and t.flushed() == 1
    for op in [ContinueGeneration(), Idle()]:
        assert run.apply(op) == []
    assert free_counts(t) == before and t.finished == {"r0"}
    run.close()


@pytest.mark.parametrize("core", CORES)
def test_a_paused_scheduler_keeps_its_last_batch_so_an_abort_still_reaches_a_staged_request(core):
    """While paused the loop never replaces ``last_batch``: the staged request of the last prefill stays
    reachable by ``abort_request`` (hazard A.4's window stays as SGLang has it)."""
    ops = [Submit(0, 20, 8), Step(1), PauseGeneration(1), Step(2), Abort(0)]
    findings, run = run_ops(cfg(core, hisparse_staging_steps=5), ops)
    t = run.target
    assert findings == [] and [(r.rid, r.to_finish is not None) for r in sparse(t).staged()] == [("r0", True)]
    assert run.apply(Idle()) == []
    run.close()


@pytest.mark.parametrize("core", CORES)
def test_a_health_check_runs_while_a_request_is_staged(core):
    """is_fully_idle(for_health_check=True) ignores HiSparse staging (only a flush waits for it), but not
    the last batch: once the staged request's prefill batch is no longer the last one, a health check
    sent while it is still staged runs."""
    run = AuditedRun(cfg(core, hisparse_staging_steps=3))
    t = run.target
    for op in [Submit(0, 10, 5), Step(1), Step(1)]:
        assert run.apply(op) == []
    assert sparse(t).staged() and not t.is_idle() and t.is_idle_for_health_check()
    run.apply(HealthCheck())
    assert t.submitted[-1].startswith("HEALTH_CHECK_")
    assert run.apply(Idle()) == []
    run.close()
