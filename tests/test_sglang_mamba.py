"""Mamba / hybrid linear attention mode of the real-SGLang target (kvaudit/targets/sglang/mamba.py):
SGLang 0.5.23's HybridReqToTokenPool (MambaPool, MambaSlotAllocator) under the UnifiedRadixCache's mamba
component, driven on CPU.

* objects come from SGLang's constructors and its tree-cache factory (``is_hybrid_ssm``);
* a program takes the slot lifecycle (admission, copy-on-write at a hit, checkpoint copy into the tree,
  donation at finish, retraction, abort) and ends with every slot free or in the tree;
* the slot balance invariant and SGLang's idle mamba check see a broken pool;
* the planted ``mamba-leak-on-release`` is found and minimized, and the program is clean without it.

Skipped where SGLang 0.5.23 is not installed.
"""

import pytest
import torch

from fault_helpers import first_finding_within, fuzz_fault, minimized_fault_program
from kvaudit.audit.runner import execute
from kvaudit.program import Abort, CloseSession, Idle, MemoryPressure, OpenSession, Step, Submit
from kvaudit.targets.sglang.config import SGLANG_PRESETS
from sglang_helpers import CORES, run_ops

pytestmark = pytest.mark.sglang

POOL = "mamba_pool"


def cfg(preset="sglang-mamba", core="rust", **kw):
    return SGLANG_PRESETS[preset].config(tree_core=core, **kw)


def mamba(target):
    return target.feature("mamba")


# -- config -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw, text", [
    ({"page_size": 4}, "page_size 1"),
    ({"max_mamba_cache_size": 23}, "max_running_requests"),
    ({"enable_hierarchical_cache": True}, "enable_hierarchical_cache"),
    ({"mamba_chunk_size": 0}, "mamba_chunk_size"),
])
def test_incompatible_mamba_settings_are_refused(kw, text):
    with pytest.raises(ValueError, match=text):
        cfg(**kw)


def test_the_mamba_fault_is_refused_without_mamba():
    with pytest.raises(ValueError, match="sglang-mamba presets"):
        SGLANG_PRESETS["sglang"].config(bugs=frozenset({"mamba-leak-on-release"}))
    assert cfg(bugs=frozenset({"mamba-leak-on-release"})).bugs == {"mamba-leak-on-release"}


# -- construction -----------------------------------------------------------------------------------
@pytest.mark.parametrize("core", CORES)
def test_objects_come_from_sglangs_own_constructors(core):
    findings, run = run_ops(cfg(core=core), [])
    t = run.target
    try:
        assert type(t.req_to_token_pool).__name__ == "HybridReqToTokenPool"
        assert type(t.req_to_token_pool.mamba_allocator).__name__ == "MambaSlotAllocator"
        assert type(t.allocator.get_kvcache()).__name__ == "HybridLinearKVPool"
        assert type(t.tree_cache).__name__ == "UnifiedRadixCache" and t.tree_cache.supports_mamba()
        assert (t.tree_core == "RustUnifiedTreeCore") == (core == "rust")
        spec = next(p for p in t.pools() if p.name == POOL)
        assert (spec.kind, spec.num_units) == ("mamba", 24)
        assert t.accounting()[POOL].available == 24 and t.engine_check() == []
    finally:
        run.close()


# -- the lifecycle ----------------------------------------------------------------------------------
@pytest.mark.parametrize("core", CORES)
def test_a_program_takes_the_slot_lifecycle_and_ends_with_every_slot_free_or_cached(core):
    findings, run = run_ops(cfg(core=core), [Submit(0, 12, 6), Step(1)])
    t = run.target
    try:
        (r0,) = t.running  # (a 12-token prompt is one chunk)
        assert r0.kv.holds_mamba and findings == []
        # the prefill's checkpoint copied r0's state into the tree: one slot held, one cached
        assert t.tree_cache.all_mamba_values_flatten().numel() == 1
        assert t.accounting()[POOL].available == 22
        run.apply(Submit(0, 14, 6))  # the same family: a prefix hit copies the tree's state (copy-on-write)
        run.apply(Step(1))
        run.apply(MemoryPressure())  # retract_decode -> release_req frees a running request's slot
        run.apply(Step(1))
        run.apply(Submit(1, 9, 30))
        run.apply(Step(2))
        run.apply(Abort(2))
        run.apply(Idle())
        counts = t.reach()
        assert run.findings == [], [f.message for f in run.findings]
        assert counts["mamba_tree_hits"] >= 1 and counts["mamba_slots_freed_on_retract"] >= 1, counts
        a = t.accounting()[POOL]
        assert a.available + a.evictable == a.total and a.protected == 0 and t.engine_check() == []
    finally:
        run.close()


@pytest.mark.parametrize("core", CORES)
def test_under_overlap_a_finished_request_in_the_last_batch_does_not_own_the_state_it_donated(core):
    # aborted while its next decode is in flight: its release donates the slot to the tree (checkpoint at
    # finish), the request keeps mamba_pool_idx and stays in the last batch for one step
    findings, run = run_ops(cfg("sglang-mamba-overlap", core), [Submit(0, 6, 8), Submit(1, 6, 8), Step(3), Abort(0),
                                                               Step(1)])
    t = run.target
    try:
        r0 = next(r for r in t._last[1] if r.rid == "r0")
        assert r0.finished() and r0.kv.holds_mamba and not r0.kv.holds_kv
        assert int(r0.kv.mamba_pool_idx) in t.tree_cache.all_mamba_values_flatten().tolist()
        assert findings == [] and run.findings == [] and t.invariant_findings() == []
        assert not any(r.owner == "req:r0" for r in t.roots() if r.pool == POOL)
        run.apply(Idle())
        assert run.findings == []
    finally:
        run.close()


def test_the_balance_invariant_sees_a_held_slot_on_the_free_list():
    findings, run = run_ops(cfg(), [Submit(0, 12, 6), Step(1)])
    t = run.target
    try:
        assert findings == [] and t.invariant_findings() == []
        (r0,) = t.running
        slots = t.req_to_token_pool.mamba_allocator
        slots.free_slots = torch.cat([slots.free_slots, r0.kv.mamba_pool_idx.reshape(1)])  # bypasses the wrappers
        (bad,) = t.invariant_findings()
        assert (bad.kind, bad.pool, bad.check) == ("use-after-free", POOL, "mamba-balance")
        assert bad.units.tolist() == [int(r0.kv.mamba_pool_idx)]
    finally:
        run.close()


def test_sglangs_idle_mamba_check_fails_on_a_lost_slot():
    findings, run = run_ops(cfg(), [Submit(0, 12, 2), Idle()])
    t = run.target
    try:
        assert findings == [] and t.engine_check() == []
        t.req_to_token_pool.mamba_allocator.free_slots = t.req_to_token_pool.mamba_allocator.free_slots[1:]
        (line,) = t.engine_check()
        assert line.startswith("[mamba_pool]") and "!= total=24" in line
    finally:
        run.close()


def test_one_programs_ledger_digest_is_the_same_in_every_run_on_the_rust_tree_core():
    """As on SWA (test_sglang_swa.py): the rust tree core frees an eviction's FULL and MAMBA parts in the
    order of a map that changes from run to run; the digest keeps each pool's order, not their interleaving."""
    ops = [Submit(family=i % 4, prompt_len=30 + i, max_new_tokens=30) for i in range(8)] + [Idle()]
    digests = []
    for _ in range(3):
        findings, run = run_ops(cfg("sglang-mamba-small"), ops)
        try:
            assert findings == [] and run.target.reach()["mamba_tree_evictions"] > 0
            digests.append(run.auditor.digest())
        finally:
            run.close()
    assert len(set(digests)) == 1, digests


# -- the planted fault ------------------------------------------------------------------------------
def test_random_programs_find_the_planted_mamba_leak():
    ex = first_finding_within(cfg(bugs=frozenset({"mamba-leak-on-release"})), programs=40)
    assert {(f.kind, f.pool) for f in ex.findings} == {("leak", POOL)}, [f.summary() for f in ex.findings]


@pytest.mark.slow
def test_cli_fuzz_finds_and_minimizes_the_planted_mamba_leak(tmp_path):
    doc, path = fuzz_fault(tmp_path, "sglang", "sglang-mamba", "mamba-leak-on-release", max_time="60")
    assert doc["findings"][0]["kind"] == "leak" and doc["findings"][0]["pool"] == POOL
    minimized_fault_program(path, max_ops=6)


@pytest.mark.parametrize("core", CORES)
def test_a_donated_slot_freed_under_the_tree_is_seen_by_the_ledger_and_the_balance_invariant(core):
    program = [Submit(0, 1, 1), Step(1), Idle()]  # the request finishes at prefill and donates its state
    ex = execute(cfg(core=core, bugs=frozenset({"mamba-free-donated"})), program)
    seen = {(f.kind, f.pool, f.check) for f in ex.findings}
    assert ("use-after-free", POOL, "mamba-balance") in seen, [f.summary() for f in ex.findings]
    assert any(f.kind == "use-after-free" and f.check != "mamba-balance" for f in ex.findings)
    assert execute(cfg(core=core), program).findings == []


def test_a_streaming_session_record_keeps_its_mamba_slot_between_turns_and_frees_it_at_close():
    findings, run = run_ops(cfg("sglang-mamba-session"), [OpenSession(), Submit(0, 12, 3, session=0), Idle()])
    t = run.target
    try:
        ((sid, slot),) = t._slots()
        assert findings == [] and slot.kv.holds_mamba and t.accounting()[POOL].session_held == 1
        assert any(r.owner == f"session:{sid}" and r.role == "session" for r in t.roots() if r.pool == POOL)
        run.apply(Submit(1, 5, 3, session=0))
        run.apply(Idle())
        assert run.findings == [] and t.accounting()[POOL].session_held == 1
        run.apply(CloseSession(0))
        run.apply(Idle())
        a = t.accounting()[POOL]
        assert run.findings == [] and a.session_held == 0 and a.available + a.evictable == a.total
    finally:
        run.close()


# -- the extra buffer: track snapshots under mixed chunk ----------------------------------------------
MIXED = [Submit(0, 14, 4), Step(1), Submit(1, 10, 1), Idle()]  # r1's 10-token prefill rides r0's decode


@pytest.mark.parametrize("kw, text", [
    ({"enable_mamba": False}, "needs enable_mamba"),
    ({"context_len": 256}, "track interval"),
    ({"max_mamba_cache_size": 15}, "4 x max_running_requests"),
])
def test_incompatible_extra_buffer_settings_are_refused(kw, text):
    with pytest.raises(ValueError, match=text):
        cfg("sglang-mamba-mixed", **kw)


def test_a_prefill_in_a_mixed_step_donates_the_state_its_forward_tracked():
    findings, run = run_ops(cfg("sglang-mamba-mixed"), MIXED)
    t = run.target
    try:
        m = mamba(t)
        assert findings == [] and t.engine_check() == []
        # r1's 10 tokens track the state after 8 (the mamba chunk) in the mixed forward, and finishing gives
        # that slot to the tree: checked against the tag the stand-in kernel wrote
        assert m.counts["mamba_track_writes_mixed"] == 1 and m.counts["mamba_track_donations"] >= 2
        tree = t.tree_cache.all_mamba_values_flatten().tolist()
        assert 8 in m.written[tree].tolist()
    finally:
        run.close()


def test_a_mixed_step_that_tracks_nothing_leaves_a_stale_donated_state(monkeypatch):
    """0.5.22's merge_batch drops the prefill rows' track fields: modelled here by a forward that writes
    no snapshot in a mixed step; the donated slot then holds no state of its node's tokens."""
    from kvaudit.targets.sglang.mamba import Mamba

    forward = Mamba.forward

    def mixed_writes_nothing(self, batch):
        if batch.forward_mode != self.target.S.ForwardMode.MIXED:
            forward(self, batch)

    monkeypatch.setattr(Mamba, "forward", mixed_writes_nothing)
    findings, run = run_ops(cfg("sglang-mamba-mixed"), MIXED)
    try:
        (f,) = findings
        assert (f.kind, f.pool) == ("stale-kv", POOL) and f.signature.endswith("/mamba-track-state")
        assert "as the state after 8 tokens, but the slot was never written" in f.message
    finally:
        run.close()


def test_a_session_record_under_the_extra_buffer_counts_its_track_slot_as_session_held():
    """``session_held_mamba_slots`` is ``kv_mamba_slots`` per record: the state slot and the ping-pong
    entries not empty; the identity holds once a turn has finished into its record."""
    config = cfg("sglang-mamba-session", mamba_extra_buffer=True, max_running_requests=6)
    findings, run = run_ops(config, [OpenSession(), Submit(0, 12, 2, session=0), Idle()])
    t = run.target
    try:
        ((_, rec),) = mamba(t)._session_slots()
        held = t.accounting()[POOL].session_held
        assert findings == [] and rec.kv.mamba_ping_pong_track_buffer is not None and held == 2
    finally:
        run.close()
