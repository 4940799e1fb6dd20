"""Tests for engine_under_test.scheduler: the request lifecycle over the memory pools."""

import random

import pytest
import torch

from engine_under_test import FinishReason, Req, Scheduler

from kvaudit.targets.eut.presets import get_preset
from engine_under_test.req import HEALTH_CHECK_RID_PREFIX

EOS = 1


@pytest.fixture
def make_engine():
    """``make_engine(preset="default", **config_changes) -> Scheduler``."""
    return lambda preset="default", **kw: Scheduler(get_preset(preset).config(**kw))


# -- helpers -------------------------------------------------------------------------------------

def outputs(s):
    """``{rid: FinishedOutput}``; fails if any rid finished more than once."""
    rids = [o.rid for o in s.finished_outputs]
    assert len(rids) == len(set(rids)), f"a request finished twice: {rids}"
    return {o.rid: o for o in s.finished_outputs}


def assert_clean_at_idle(s):
    assert s.is_fully_idle()
    checks = s.check_memory()
    assert {c.pool for c in checks} >= {"token_to_kv_pool", "req_to_token_pool"}
    assert all(c.ok for c in checks), [c.message() for c in checks if not c.ok]
    assert s.last_idle_check is not None and all(c.ok for c in s.last_idle_check)
    tok = next(c for c in checks if c.pool == "token_to_kv_pool")
    assert tok.protected == 0 and tok.uncached == 0
    assert tok.available + tok.evictable == s.token_to_kv_pool_allocator.size
    rp = s.req_to_token_pool
    assert rp.available_size() == rp.size + rp.pre_alloc_size
    s.token_to_kv_pool_allocator.check_integrity()
    rp.check_integrity()
    s.tree_cache.check_integrity()


def assert_busy_identity(s):
    bad = [c.message() for c in s.check_memory(idle=False) if not c.ok]
    assert not bad, bad


def assert_no_use_after_free(s):
    """No page referenced by a live row ``[0, kv_allocated_len)`` or by a tree node is in the free list."""
    alloc, table = s.token_to_kv_pool_allocator, s.req_to_token_pool.req_to_token
    live = [table[r.kv.req_pool_idx, : r.kv.kv_allocated_len] for r in s.requests_owning_rows()]
    live += [n.value for n in s.tree_cache.nodes()]
    if not live:
        return
    used = torch.unique(torch.cat(live) // alloc.page_size)
    assert int(used.min()) > 0, "a live row or node references page 0"
    reused = used[torch.isin(used, alloc.free_pages)]
    assert reused.numel() == 0, f"pages both free and referenced: {reused.tolist()}"


def spy_extends(s):
    """Record ``(rid, prefix_len, extend_end)`` of every request at prefill allocation time."""
    seen, orig = [], s.alloc_for_extend

    def spy(batch):
        seen.extend((r.rid, r.prefix_len, r.extend_end) for r in batch.reqs)
        orig(batch)

    s.alloc_for_extend = spy
    return seen


def memory_trace(s):
    return (s.token_to_kv_pool_allocator.available_size(), s.tree_cache.evictable_size(),
            s.tree_cache.protected_size(), s.req_to_token_pool.available_size())


def find(reqs, rid):
    return next(r for r in reqs if r.rid == rid)


# -- aggregated serving --------------------------------------------------------------------------

@pytest.mark.parametrize("page_size", [1, 4])
def test_prefill_and_decode_to_completion(make_engine, page_size):
    s = make_engine(num_slots=128, page_size=page_size)
    a = s.add_request([5, 6, 7, 8, 9], max_new_tokens=6)
    b = s.add_request(list(range(20, 31)), max_new_tokens=3)
    c = s.add_request([40, 41], max_new_tokens=8, stop_at=2)
    assert s.step()  # prefill
    assert s.token_to_kv_pool_allocator.available_size() < 128
    assert len(s.last_batch.reqs) == 3
    assert_busy_identity(s)
    s.run_until_idle()
    out = outputs(s)
    assert (out[a].reason, len(out[a].output_ids)) == (FinishReason.LENGTH, 6)
    assert (out[b].reason, len(out[b].output_ids)) == (FinishReason.LENGTH, 3)
    assert out[c].reason == FinishReason.STOP and out[c].output_ids[-1] == EOS and len(out[c].output_ids) == 2
    assert all(t >= 2 for t in out[a].output_ids)
    assert_clean_at_idle(s)
    assert s.tree_cache.evictable_size() > 0  # finished requests were cached


@pytest.mark.parametrize("preset", ["default", "overlap", "chunked", "pd-decode", "pd-decode-hisparse"])
@pytest.mark.parametrize("model", ["none", "tiny"])
def test_ignore_eos_keeps_the_eos_and_runs_to_max_new_tokens(make_engine, preset, model):
    s = make_engine(preset, model=model)
    a = s.add_request([5, 6, 7], max_new_tokens=6, stop_at=2, ignore_eos=True)
    b = s.add_request([5, 6, 8], max_new_tokens=6, stop_at=2)
    s.run_until_idle()
    out = outputs(s)
    assert (out[a].reason, len(out[a].output_ids)) == (FinishReason.LENGTH, 6)
    assert out[a].output_ids[1] == EOS and EOS not in out[a].output_ids[2:]  # sampled once, then run past
    assert (out[b].reason, out[b].output_ids[-1], len(out[b].output_ids)) == (FinishReason.STOP, EOS, 2)
    assert_clean_at_idle(s)
    ref = make_engine("default", model=model)
    ref.add_request([5, 6, 7], max_new_tokens=6, stop_at=2, ignore_eos=True)
    ref.run_until_idle()
    assert out[a].output_ids == ref.finished_outputs[0].output_ids  # later tokens read the EOS in every mode


def test_prefix_shared_between_two_requests_is_reused(make_engine):
    s = make_engine(num_slots=64)
    seen = spy_extends(s)
    shared = [11, 12, 13, 14, 15, 16]
    s.add_request(shared + [17], max_new_tokens=2)
    s.run_until_idle()
    cached = s.tree_cache.match_prefix(shared).device_indices.clone()
    assert cached.numel() == len(shared)
    before = s.token_to_kv_pool_allocator.available_size()
    b = s.add_request(shared + [30, 31], max_new_tokens=2)
    s.step()
    assert seen[-1] == (b, len(shared), len(shared) + 2)
    req = find(s.last_batch.reqs, b)
    row = s.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
    assert row[: len(shared)].tolist() == cached.tolist()
    assert before - s.token_to_kv_pool_allocator.available_size() <= 2  # only the new tokens
    s.run_until_idle()
    assert outputs(s)[b].reason == FinishReason.LENGTH
    assert_clean_at_idle(s)


def test_prefix_reuse_with_page_size_4_matches_whole_pages_only(make_engine):
    s = make_engine(num_slots=64, page_size=4)
    seen = spy_extends(s)
    s.add_request(list(range(10, 20)), max_new_tokens=2)
    s.run_until_idle()
    b = s.add_request(list(range(10, 16)) + [99, 98], max_new_tokens=2)
    s.run_until_idle()
    assert seen[-1] == (b, 4, 8)
    assert_clean_at_idle(s)


def test_identical_prompts_in_one_batch_end_up_sharing(make_engine):
    s = make_engine(num_slots=64)
    p = [3, 4, 5, 6, 7, 8]
    x, y = s.add_request(p, 3), s.add_request(p, 3)
    while s.step():
        assert_no_use_after_free(s)
    out = outputs(s)
    assert out[x].output_ids == out[y].output_ids
    assert s.tree_cache.total_size() == len(p) + 2  # one copy; the last output token has no KV
    assert_clean_at_idle(s)


def test_disabled_radix_cache_leaves_pool_empty(make_engine):
    s = make_engine(num_slots=64, disable_radix_cache=True)
    s.add_request([5, 6, 7], 4)
    s.add_request([5, 6, 7], 4)
    s.run_until_idle()
    assert s.token_to_kv_pool_allocator.available_size() == 64
    assert_clean_at_idle(s)


def test_abort_in_waiting_queue(make_engine):
    s = make_engine(num_slots=64, max_running_requests=1)
    seen = spy_extends(s)
    a = s.add_request([5, 6, 7], 10)
    b = s.add_request([8, 9], 10)
    s.step()
    assert [r.rid for r in s.waiting_queue] == [b]
    s.abort_request(b)
    s.step()
    assert not s.waiting_queue
    out = outputs(s)
    assert out[b].reason == FinishReason.ABORT and out[b].output_ids == []
    s.run_until_idle()
    assert outputs(s)[a].reason == FinishReason.LENGTH
    assert b not in [rid for rid, _, _ in seen]  # never allocated
    assert_clean_at_idle(s)


@pytest.mark.parametrize("page_size", [1, 4])
def test_abort_in_running_batch(make_engine, page_size):
    s = make_engine(num_slots=64, page_size=page_size)
    a = s.add_request([5, 6, 7, 8, 9], 20)
    keep = s.add_request([5, 6, 7, 20], 5)
    for _ in range(3):
        s.step()
    assert find(s.running_batch, a).kv.holds_kv
    s.abort_request(a)
    s.step()
    assert_busy_identity(s)
    out = outputs(s)
    assert out[a].reason == FinishReason.ABORT and len(out[a].output_ids) < 20
    s.run_until_idle()
    assert outputs(s)[keep].reason == FinishReason.LENGTH
    assert_clean_at_idle(s)


def test_abort_all_and_by_prefix(make_engine):
    s = make_engine(num_slots=128)
    s.add_request([5, 6], 30, rid="grp-a")
    s.add_request([7, 8], 30, rid="grp-b")
    other = s.add_request([9, 10], 30, rid="other")
    s.step()
    s.abort_request("grp-")
    s.step()
    out = outputs(s)
    assert out["grp-a"].reason == out["grp-b"].reason == FinishReason.ABORT and other not in out
    s.abort_request(abort_all=True)
    s.run_until_idle()
    assert outputs(s)[other].reason == FinishReason.ABORT
    assert_clean_at_idle(s)


def test_abort_unknown_rid_changes_nothing(make_engine):
    s = make_engine(num_slots=64)
    a = s.add_request([5, 6], 4)
    s.abort_request("nope")
    s.run_until_idle()
    assert outputs(s)[a].reason == FinishReason.LENGTH


# -- health checks -------------------------------------------------------------------------------

@pytest.mark.parametrize("page_size", [1, 4])
def test_health_check_while_idle_runs_as_one_token_request(make_engine, page_size):
    s = make_engine(num_slots=64, page_size=page_size)
    seen = spy_extends(s)
    rid = s.health_check()
    assert rid.startswith(HEALTH_CHECK_RID_PREFIX)
    assert s.step()  # it runs a prefill batch
    assert seen == [(rid, 0, 1)]
    out = outputs(s)
    assert out[rid].reason == FinishReason.LENGTH and len(out[rid].output_ids) == 1
    assert s.health_check_acks == 1
    s.run_until_idle()
    assert_clean_at_idle(s)


def test_health_check_while_busy_touches_no_memory(make_engine):
    cfg = dict(num_slots=64, page_size=4)
    plain, probed = make_engine(**cfg), make_engine(**cfg)
    seen = spy_extends(probed)
    for s in (plain, probed):
        s.add_request([5, 6, 7, 8, 9], 8)
        s.step()
    rid = probed.health_check()
    probed.step()
    plain.step()
    assert memory_trace(probed) == memory_trace(plain)
    assert probed.health_check_acks == 1  # answered after the batch
    assert rid not in outputs(probed) and rid not in [r for r, _, _ in seen]
    while not plain.is_fully_idle():
        plain.step()
        probed.step()
        assert memory_trace(probed) == memory_trace(plain)
    assert probed.health_check_acks == 1


def test_release_kv_cache_twice_raises(make_engine):
    s = make_engine(num_slots=64)
    rid = s.add_request([5, 6, 7], 1)
    s.step()
    req = find(s.last_batch.reqs, rid)
    assert req.finished() and not req.kv.holds_kv
    trace = memory_trace(s)
    with pytest.raises(RuntimeError, match="released twice"):
        s.release_kv_cache(req, checkpoint=False)
    assert memory_trace(s) == trace
    s.run_until_idle()
    assert_clean_at_idle(s)


# -- PD disaggregation, decode side --------------------------------------------------------------

def test_pd_decode_pipeline_stages(make_engine):
    s = make_engine("pd-decode", num_slots=64, max_running_requests=1, transfer_latency_steps=2)
    a = s.add_request([5, 6, 7, 8], 4)
    b = s.add_request([9, 10, 11], 3)
    s.process_input_requests()
    assert [r.rid for r in s.disagg_prealloc_queue] == [a, b]
    s.recv_queue = []  # already ingested
    s.step()  # prealloc: a row and the prompt's slots, then the transfer queue
    assert not s.disagg_prealloc_queue
    assert [r.rid for r in s.disagg_transfer_queue] == [a, b]
    ra, rb = s.disagg_transfer_queue
    assert ra.kv.holds_kv and ra.kv.kv_allocated_len == 4 and ra.output_ids == []
    assert s.token_to_kv_pool_allocator.available_size() == 64 - 7
    assert_busy_identity(s)
    s.step()  # transfer still in flight
    assert len(s.disagg_transfer_queue) == 2 and not s.running_batch
    s.step()  # transfer done -> waiting -> prebuilt (a) -> running; b waits for room
    assert not s.disagg_transfer_queue
    assert [r.rid for r in s.running_batch] == [a]
    assert [r.rid for r in s.waiting_queue] == [b]
    assert len(ra.output_ids) == 2  # the hand-off token plus one decode step
    assert_busy_identity(s)
    s.run_until_idle()
    out = outputs(s)
    assert len(out[a].output_ids) == 4 and len(out[b].output_ids) == 3
    assert_clean_at_idle(s)


def test_pd_decode_prealloc_waits_for_memory(make_engine):
    s = make_engine("pd-decode", num_slots=64)
    s.add_request(list(range(2, 22)), 20)
    s.add_request(list(range(30, 50)), 20)
    s.step()
    assert len(s.disagg_transfer_queue) == 1 and len(s.disagg_prealloc_queue) == 1
    assert not s.disagg_prealloc_queue[0].kv.holds_kv
    s.run_until_idle()
    assert len(outputs(s)) == 2
    assert_clean_at_idle(s)


def test_pd_decode_max_new_tokens_1_finishes_in_prebuilt_step(make_engine):
    s = make_engine("pd-decode", num_slots=64, transfer_latency_steps=1)
    rid = s.add_request([5, 6, 7], 1)
    s.step()
    assert rid not in outputs(s)
    assert s.step()  # the prebuilt step counts as work
    assert s.last_batch.forward_mode == "prebuilt" and s.last_batch.reqs == []
    out = outputs(s)
    assert out[rid].reason == FinishReason.LENGTH and len(out[rid].output_ids) == 1
    assert not s.running_batch
    s.run_until_idle()
    assert_clean_at_idle(s)


@pytest.mark.parametrize("preset", ["pd-decode", "pd-decode-hisparse"])
def test_pd_health_check_while_idle(make_engine, preset):
    s = make_engine(preset)
    rid = s.health_check()
    s.run_until_idle()
    assert outputs(s)[rid].reason == FinishReason.LENGTH
    assert s.health_check_acks == 1
    assert_clean_at_idle(s)


def test_pd_abort_in_transfer_queue_releases_once(make_engine):
    s = make_engine("pd-decode", num_slots=64, transfer_latency_steps=3)
    rid = s.add_request([5, 6, 7], 4)
    s.step()
    assert s.disagg_transfer_queue and s.token_to_kv_pool_allocator.available_size() == 61
    s.abort_request(rid)
    s.step()
    assert outputs(s)[rid].reason == FinishReason.ABORT
    assert s.token_to_kv_pool_allocator.available_size() == 64
    s.run_until_idle()
    assert_clean_at_idle(s)


def test_pd_abort_in_waiting_queue_releases_once(make_engine):
    s = make_engine("pd-decode", num_slots=64, max_running_requests=1)
    s.add_request([5, 6, 7], 6)
    b = s.add_request([5, 6, 8], 6)
    s.step()
    s.step()
    assert [r.rid for r in s.waiting_queue] == [b] and s.waiting_queue[0].kv.holds_kv
    s.abort_request(b)
    s.step()
    assert outputs(s)[b].reason == FinishReason.ABORT
    assert_busy_identity(s)
    s.run_until_idle()
    assert len(outputs(s)) == 2
    assert_clean_at_idle(s)


def test_pd_abort_in_prealloc_queue(make_engine):
    s = make_engine("pd-decode", num_slots=64)
    s.add_request(list(range(2, 22)), 20)
    b = s.add_request(list(range(30, 50)), 20)
    s.step()
    s.abort_request(b)
    s.step()
    assert outputs(s)[b].reason == FinishReason.ABORT and not s.disagg_prealloc_queue
    s.run_until_idle()
    assert_clean_at_idle(s)


# -- HiSparse ------------------------------------------------------------------------------------

@pytest.mark.parametrize("page_size", [1, 4])
def test_hisparse_buffer_and_host_slots_allocated_and_returned(make_engine, page_size):
    s = make_engine("pd-decode-hisparse", page_size=page_size)
    hs = s.hisparse_coordinator
    dev, host = hs.hisparse_attn_allocator, hs.host_pool
    rid = s.add_request(list(range(2, 12)), 12)
    sizes = []
    while rid not in outputs(s):
        s.step()
        assert_busy_identity(s)
        for r in [r for r in s.running_batch if not r.finished()]:
            row = r.kv.req_pool_idx
            sizes.append(hs.buffer_size(row))
            assert hs.host_size(row) >= r.kv.kv_allocated_len
            assert dev.available_size() == dev.size - hs.buffer_size(row)
            assert host.available_size() == host.size - hs.host_size(row)
    assert sizes and 0 < min(sizes) and max(sizes) == hs.device_buffer_size  # 22 positions > 16
    s.run_until_idle()
    assert not hs.req_to_device_buffer and not hs.req_to_host_pool
    assert dev.available_size() == dev.size and host.available_size() == host.size
    assert_clean_at_idle(s)


def test_zoo_hisparse_prebuilt_skip_finish_leaks(make_engine):
    s = make_engine("pd-decode-hisparse", bugs={"hisparse-prebuilt-skip-finish"})
    s.health_check()
    s.run_until_idle()
    checks = {c.pool: c for c in s.check_memory()}
    assert not checks["hisparse_device"].ok
    assert not checks["hisparse_host"].ok
    assert checks["token_to_kv_pool"].ok and checks["req_to_token_pool"].ok
    assert {c.pool for c in s.last_idle_check if not c.ok} == {"hisparse_device", "hisparse_host"}


def test_zoo_hisparse_prebuilt_skip_finish_off_is_clean(make_engine):
    s = make_engine("pd-decode-hisparse")
    s.health_check()
    s.run_until_idle()
    checks = s.check_memory()
    assert {"hisparse_device", "hisparse_host"} <= {c.pool for c in checks}
    assert all(c.ok for c in checks)
    assert_clean_at_idle(s)


def test_zoo_switch_only_affects_prebuilt_finish(make_engine):
    s = make_engine("pd-decode-hisparse", bugs={"hisparse-prebuilt-skip-finish"})
    s.add_request([5, 6, 7], 4)  # finishes in decode, not in the prebuilt step
    s.run_until_idle()
    assert_clean_at_idle(s)


# -- the tiny model ------------------------------------------------------------------------------

def _run_workload(s, prompts, max_new=5):
    rids, trace = [], []
    for p in prompts:
        rids.append(s.add_request(p, max_new))
        s.step()
        trace.append(memory_trace(s))
    while not s.is_fully_idle():
        s.step()
        trace.append(memory_trace(s))
    out = outputs(s)
    return [out[r].output_ids for r in rids], trace


PROMPTS = [[5, 6, 7, 8, 9], [5, 6, 7, 8, 30, 31], [40, 41, 42], [5, 6, 7, 8, 9, 50, 51, 52, 53]]


@pytest.mark.parametrize("preset,page_size", [("default", 1), ("default", 4), ("pd-decode", 4),
                                              ("pd-decode-hisparse", 4)])
def test_tiny_model_has_the_memory_behaviour_of_none(make_engine, preset, page_size):
    none_out, none_trace = _run_workload(make_engine(preset, num_slots=128, page_size=page_size), PROMPTS)
    tiny_out, tiny_trace = _run_workload(
        make_engine(preset, num_slots=128, page_size=page_size, model="tiny"), PROMPTS)
    assert tiny_trace == none_trace
    assert [len(o) for o in tiny_out] == [len(o) for o in none_out]
    assert tiny_out != none_out  # really a different sampler


def test_tiny_model_is_deterministic_for_a_seed(make_engine):
    run = lambda seed: _run_workload(make_engine(num_slots=128, model="tiny", seed=seed), PROMPTS)[0]
    first = run(1)
    assert run(1) == first
    assert run(2) != first
    assert all(2 <= t < 128 for o in first for t in o)


@pytest.mark.parametrize("page_size", [1, 4])
def test_tiny_model_reads_the_reused_prefix_kv(make_engine, page_size):
    # A request whose prefix comes from the tree must produce what it produces alone.
    cfg = dict(num_slots=128, page_size=page_size, model="tiny", seed=1)
    target = [5, 6, 7, 8, 9, 10, 11, 30, 31]
    alone = make_engine(**cfg)
    alone_out, _ = _run_workload(alone, [target], max_new=8)
    shared = make_engine(**cfg)
    seen = spy_extends(shared)
    out, _ = _run_workload(shared, [[5, 6, 7, 8, 9, 10, 11, 12], [40, 41]], max_new=8)
    out, _ = _run_workload(shared, [target], max_new=8)
    assert seen[-1][1] >= 4  # the prefix really came from the tree
    assert out == alone_out


def test_tiny_model_same_tokens_across_serving_modes(make_engine):
    prompts = [[5, 6, 7, 8, 9], [40, 41, 42]]  # short: contexts fit the HiSparse buffer
    got = {p: _run_workload(make_engine(p, num_slots=128, model="tiny", seed=1), prompts, max_new=6)[0]
           for p in ("default", "pd-decode", "pd-decode-hisparse")}
    assert got["pd-decode"] == got["default"]
    assert got["pd-decode-hisparse"] == got["default"]


# -- random mixed workload -----------------------------------------------------------------------

@pytest.mark.parametrize("preset,changes", [
    ("default", {}),
    ("default", {"disable_radix_cache": True}),
    ("pd-decode", {}),
    ("pd-decode-hisparse", {}),
])
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("seed", range(3))
def test_busy_identity_holds_after_every_step(make_engine, preset, changes, page_size, seed):
    s = make_engine(preset, num_slots=96, page_size=page_size, max_req_rows=6, max_running_requests=4,
                    context_len=48, **changes)
    rng = random.Random(seed)
    prefixes = [[rng.randrange(2, 100) for _ in range(rng.randrange(1, 12))] for _ in range(3)]
    rids, health = [], 0
    for _ in range(150):
        op = rng.random()
        if op < 0.3:
            prompt = rng.choice(prefixes) + [rng.randrange(2, 100) for _ in range(rng.randrange(0, 6))]
            m = rng.randrange(1, 10)
            rids.append(s.add_request(prompt, m, stop_at=rng.choice([None, None, rng.randrange(1, m + 1)])))
        elif op < 0.36 and rids:
            s.abort_request(rng.choice(rids))
        elif op < 0.4:
            s.health_check()
            health += 1
        s.step()
        assert_busy_identity(s)
        assert_no_use_after_free(s)
        s.token_to_kv_pool_allocator.check_integrity()
        s.tree_cache.check_integrity()
    s.run_until_idle()
    out = outputs(s)
    assert set(rids) <= set(out)
    assert s.health_check_acks == health
    assert_clean_at_idle(s)


# -- flush_cache ----------------------------------------------------------------------------------

@pytest.mark.parametrize("preset", ["default", "pd-decode-hisparse"])
def test_flush_cache_when_idle_empties_the_tree_and_refills_every_pool(preset):
    eng = Scheduler(get_preset(preset).config(page_size=4))
    eng.add_request(list(range(2, 30)), 3)
    eng.run_until_idle()
    if preset == "default":
        assert eng.tree_cache.total_size() > 0  # something cached to flush
    eng.request_flush_cache()
    eng.step()
    assert eng.flush_results == [True]
    assert eng.tree_cache.total_size() == 0
    assert all(c.ok and c.available == c.total for c in eng.check_memory(idle=True))


def test_flush_cache_while_busy_fails_and_touches_nothing():
    eng = Scheduler(get_preset("default").config())
    eng.add_request(list(range(2, 20)), 8)
    eng.step()
    before = (eng.token_to_kv_pool_allocator.available_size(), eng.req_to_token_pool.available_size(),
              eng.tree_cache.total_size())
    eng.request_flush_cache()
    eng.step()  # ingests the flush while the request decodes
    assert eng.flush_results == [False]
    eng.run_until_idle()
    assert all(c.ok for c in eng.last_idle_check)
    assert before[2] > 0 and eng.tree_cache.total_size() >= before[2]


# -- zoo switch: pd-abort-after-transfer-leak (sglang PR #9817) -----------------------------------

def _abort_in_pd_waiting_queue(bugs):
    """A request waits in the PD waiting queue (the running batch is full) and is aborted there."""
    eng = Scheduler(get_preset("pd-decode").config(max_running_requests=1, bugs=bugs))
    eng.add_request(list(range(2, 12)), 6)
    rid = eng.add_request(list(range(2, 9)), 6)
    for _ in range(10):
        eng.step()
        if any(r.rid == rid for r in eng.waiting_queue):
            break
    waiting = next(r for r in eng.waiting_queue if r.rid == rid)
    assert waiting.kv.holds_kv  # transferred: row and KV are allocated
    row = waiting.kv.req_pool_idx
    eng.abort_request(rid)
    eng.run_until_idle()
    return eng, row


def test_pd_abort_after_transfer_leak_switch_leaks_the_row_and_kv():
    eng, row = _abort_in_pd_waiting_queue({"pd-abort-after-transfer-leak"})
    bad = {c.pool for c in eng.last_idle_check if not c.ok}
    assert bad == {"token_to_kv_pool", "req_to_token_pool"}
    assert row not in eng.req_to_token_pool.free_slots  # the row no structure references


def test_pd_abort_in_waiting_queue_is_clean_without_the_switch():
    eng, row = _abort_in_pd_waiting_queue(set())
    assert all(c.ok for c in eng.last_idle_check)
    assert row in eng.req_to_token_pool.free_slots


# -- chunked prefill -------------------------------------------------------------------------------

def _run_to_idle_checking(eng):
    while not eng.is_fully_idle() or eng.recv_queue:
        eng.step()
        assert all(c.ok for c in eng.check_memory(idle=False)), [c.message() for c in eng.check_memory(idle=False)]
        eng.tree_cache.check_integrity()
    eng.step()
    return eng


@pytest.mark.parametrize("ps", [1, 4])
def test_chunked_prefill_gives_the_same_tokens_as_one_prefill(ps):
    outs = {}
    for chunk in (None, 8, 32):
        eng = Scheduler(get_preset("default").config(model="tiny", seed=1, page_size=ps, chunked_prefill_size=chunk))
        for f in range(3):
            eng.add_request([2 + (f * 7 + i * 3) % 100 for i in range(40 + f * 13)], 5)
        _run_to_idle_checking(eng)
        assert all(c.ok for c in eng.last_idle_check)
        outs[chunk] = sorted((o.rid, tuple(o.output_ids)) for o in eng.finished_outputs)
    assert outs[None] == outs[8] == outs[32]


def test_a_long_prompt_parks_between_chunks_and_samples_only_at_the_last():
    eng = Scheduler(get_preset("chunked").config())  # 32-token chunks
    eng.add_request(list(range(2, 82)), 3)  # 80 tokens: chunks of 32, 32, 16
    eng.step()
    req = eng.chunked_req
    assert req is not None and req.kv.kv_committed_len == 32 and req.output_ids == []
    assert req in eng.requests_owning_rows() and not eng.is_fully_idle()
    eng.step()
    assert eng.chunked_req is req and req.kv.kv_committed_len == 64 and req.output_ids == []
    eng.step()
    assert eng.chunked_req is None and req.kv.kv_committed_len == 80 and len(req.output_ids) == 1


def _abort_between_chunks(bugs):
    eng = Scheduler(get_preset("chunked").config(bugs=bugs))
    rid = eng.add_request(list(range(2, 82)), 3)
    eng.step()
    assert eng.chunked_req is not None
    row = eng.chunked_req.kv.req_pool_idx
    eng.abort_request(rid)
    for _ in range(20):
        eng.step()
    return eng, rid, row


def test_abort_between_chunks_releases_the_parked_request():
    eng, rid, row = _abort_between_chunks(set())
    assert [(o.rid, o.reason) for o in eng.finished_outputs] == [(rid, FinishReason.ABORT)]
    assert all(c.ok for c in eng.last_idle_check) and row in eng.req_to_token_pool.free_slots


def test_chunked_abort_ignored_switch_leaks_the_row_and_kv_and_never_finishes():
    eng, rid, row = _abort_between_chunks({"chunked-abort-ignored"})
    assert eng.finished_outputs == []  # the request never finishes
    assert eng.is_fully_idle()
    assert {c.pool for c in eng.last_idle_check if not c.ok} == {"token_to_kv_pool", "req_to_token_pool"}
    assert row not in eng.req_to_token_pool.free_slots


# -- retraction on decode OOM ----------------------------------------------------------------------

def _retraction_run(ps, bugs=(), tight=True):
    kw = dict(num_slots=160, new_token_ratio=0.1) if tight else dict(num_slots=2048)
    eng = Scheduler(get_preset("default").config(model="tiny", seed=1, page_size=ps, bugs=set(bugs), **kw))
    for f in range(6):
        eng.add_request([2 + (f * 7 + i * 3) % 100 for i in range(10 + f * 5)], 20)
    return eng


@pytest.mark.parametrize("ps", [1, 4])
def test_retraction_re_prefills_and_gives_the_same_tokens(ps):
    roomy = _run_to_idle_checking(_retraction_run(ps, tight=False))
    tight = _run_to_idle_checking(_retraction_run(ps))
    assert roomy.num_retractions == 0 and tight.num_retractions > 0
    assert all(c.ok for c in tight.last_idle_check)
    same = sorted((o.rid, o.reason, tuple(o.output_ids)) for o in roomy.finished_outputs)
    assert sorted((o.rid, o.reason, tuple(o.output_ids)) for o in tight.finished_outputs) == same


def test_retraction_takes_the_fewest_outputs_then_the_longest_prompt_first():
    eng = Scheduler(get_preset("default").config())
    a, b, c = (Req(f"r{i}", [2] * n, 8) for i, n in enumerate((5, 9, 7)))
    a.output_ids, b.output_ids, c.output_ids = [3, 3], [3], [3]
    for r in (a, b, c):  # give each a row so that release works
        r.kv.req_pool_idx = eng.req_to_token_pool.alloc(1)[0]
    eng.running_batch = [a, b, c]
    alloc = eng.token_to_kv_pool_allocator
    alloc.free_pages = alloc.free_pages[:1]  # room for one decode token only
    kept = eng.retract_decode([a, b, c])
    # b (1 output, longest prompt) goes first, then c; a (most outputs) stays and fits
    assert kept == [a] and eng.running_batch == [a] and eng.waiting_queue[:2] == [b, c]
    assert eng.num_retractions == 2 and not b.kv.holds_kv and not c.kv.holds_kv


@pytest.mark.parametrize("bugs", [set(), {"retract-unaligned-page"}], ids=["off", "on"])
def test_retract_unaligned_page_switch_leaks_one_page(bugs):
    from kvaudit.program import prompt_tokens  # the prompts of the fuzzer's 4-op reproducer

    eng = Scheduler(get_preset("retract").config(bugs=bugs))
    for family, n in ((1, 33), (0, 1), (0, 66)):
        eng.add_request(prompt_tokens(family, n), 9)
    eng.run_until_idle()
    assert eng.num_retractions > 0
    (pool,) = [c for c in eng.last_idle_check if c.pool == "token_to_kv_pool"]
    missing = pool.total - pool.available - pool.evictable - pool.protected
    assert missing == (4 if bugs else 0)  # one whole page that nothing references


@pytest.mark.parametrize("prompt_len", [8, 6, 5])
def test_retract_unaligned_page_switch_skips_the_page_that_holds_the_prompt_end(prompt_len):
    # sglang PR #4977: the retraction's free range began at len(prefix_indices) (the cached prompt)
    # padded *up* to a page, so only an unaligned prompt end loses a page, the one holding it; the
    # request's own partly filled last page is freed
    eng = Scheduler(get_preset("retract").config(bugs={"retract-unaligned-page"}))
    eng.add_request(list(range(2, 2 + prompt_len)), 9)
    for _ in range(3):  # the prefill, then two decode steps: 2 slots past the prompt
        eng.step()
    (req,) = eng.running_batch
    assert req.kv.kv_allocated_len == prompt_len + 2
    row = eng.req_to_token_pool.req_to_token[req.kv.req_pool_idx, : req.kv.kv_allocated_len].clone()
    eng.running_batch = []
    eng.release_req(req)
    free = set(eng.token_to_kv_pool_allocator.free_pages.tolist())
    tree = {int(s) // 4 for n in eng.tree_cache.nodes() if n.value is not None for s in n.value}
    lost = sorted({int(s) // 4 for s in row} - free - tree)
    end = prompt_len - 1  # the position of the prompt's last token
    assert lost == ([] if prompt_len % 4 == 0 else [int(row[end]) // 4])


def test_a_request_that_can_never_fit_the_pool_is_rejected_at_intake():
    eng = Scheduler(get_preset("default").config(num_slots=64))
    rid = eng.add_request(list(range(2, 62)), 8)  # 60 + 8 + slack > 64 slots
    eng.run_until_idle()
    assert [(o.rid, o.reason) for o in eng.finished_outputs] == [(rid, FinishReason.ABORT)]
    assert all(c.ok for c in eng.last_idle_check)


# -- Scheduler.check_integrity ---------------------------------------------------------------------

def _busy_engine():
    eng = Scheduler(get_preset("default").config(page_size=4))
    eng.add_request(list(range(2, 30)), 8)
    eng.add_request(list(range(40, 50)), 8)
    eng.step()
    eng.step()
    eng.check_integrity()  # clean so far
    return eng


def test_check_integrity_catches_committed_beyond_allocated():
    from engine_under_test import PoolIntegrityError

    eng = _busy_engine()
    req = eng.requests_owning_rows()[0]
    req.kv.kv_committed_len = req.kv.kv_allocated_len + 1
    with pytest.raises(PoolIntegrityError, match="committed="):
        eng.check_integrity()


def test_check_integrity_catches_a_row_owned_twice():
    from engine_under_test import PoolIntegrityError

    eng = _busy_engine()
    a, b = eng.requests_owning_rows()[:2]
    b.kv.req_pool_idx = a.kv.req_pool_idx
    with pytest.raises(PoolIntegrityError, match="also held by"):
        eng.check_integrity()


def test_check_integrity_catches_an_unaligned_protected_prefix():
    from engine_under_test import PoolIntegrityError

    eng = _busy_engine()
    eng.requests_owning_rows()[0].kv.cache_protected_len = 3
    with pytest.raises(PoolIntegrityError, match="page-aligned"):
        eng.check_integrity()


# -- mixed chunk -----------------------------------------------------------------------------------

def test_mixed_chunk_decodes_running_rows_in_the_prefill_batch_with_the_same_tokens():
    outs = {}
    for mixed in (False, True):
        eng = Scheduler(get_preset("mixed-chunk").config(model="tiny", seed=1, enable_mixed_chunk=mixed))
        eng.add_request(list(range(2, 20)), 10)
        eng.step()
        eng.step()
        eng.add_request(list(range(30, 60)), 5)
        eng.step()
        batch = eng.last_batch
        assert bool(batch.decode_ids) == mixed  # the running request decoded inside the prefill batch
        _run_to_idle_checking(eng)
        assert all(c.ok for c in eng.last_idle_check)
        outs[mixed] = sorted((o.rid, tuple(o.output_ids)) for o in eng.finished_outputs)
    assert outs[False] == outs[True]


@pytest.mark.parametrize("bugs", [set(), {"prefill-finish-leaks-row"}], ids=["off", "on"])
def test_prefill_finish_leaks_row_switch(bugs):
    eng = Scheduler(get_preset("mixed-chunk").config(bugs=bugs))
    eng.add_request(list(range(2, 12)), 1)  # finishes in its first prefill
    eng.run_until_idle()
    bad = {c.pool for c in eng.last_idle_check if not c.ok}
    assert bad == ({"req_to_token_pool"} if bugs else set())
    assert eng.token_to_kv_pool_allocator.available_size() + eng.tree_cache.evictable_size() \
        == eng.token_to_kv_pool_allocator.size  # only the row leaks: the KV slots came back


# -- zoo switch: radix-lock-skips-matched-node (mini-sglang PR #52) --------------------------------

@pytest.mark.parametrize("bugs", [set(), {"radix-lock-skips-matched-node"}], ids=["off", "on"])
def test_radix_lock_skips_matched_node_lets_eviction_free_slots_a_request_reads(bugs):
    eng = Scheduler(get_preset("default").config(num_slots=64, bugs=bugs))
    eng.add_request(list(range(2, 22)), 30)  # 20-token prompt, then a long decode
    eng.step()
    eng.step()
    (a,) = eng.requests_owning_rows()
    assert a.kv.cache_protected_len == 20  # its prompt lives in the tree now
    shared = eng.req_to_token_pool.req_to_token[a.kv.req_pool_idx, :20].clone()
    eng.tree_cache.evict(64)  # memory pressure: evict everything evictable
    free = set(eng.token_to_kv_pool_allocator.free_pages.tolist())
    freed_under_a = [s for s in shared.tolist() if s in free]
    assert bool(freed_under_a) == bool(bugs)  # with the bug, a's row points at free slots


# -- pause_generation / continue_generation (SGLang 0.5.23 Scheduler.pause_generation) ------------

PAUSE_PROMPTS = [[2 + (f * 7 + i * 3) % 100 for i in range(n)] for f, n in enumerate((9, 17, 50, 12))]


def _pause_run(preset, mode=None, flush=False, at=2, **kw):
    """Four requests (one 50-token prompt that chunked presets park), ``at`` steps, then (``mode``)
    a pause, three paused steps, an optional flush while paused, continue, and run to idle.
    Returns ``(engine, outputs, {name: value observed while paused})``."""
    s = Scheduler(get_preset(preset).config(model="tiny", **kw))
    rids = [s.add_request(p, 6, stop_at=3, ignore_eos=i % 2 == 1) for i, p in enumerate(PAUSE_PROMPTS)]
    for _ in range(at):
        s.step()
    seen = {}
    if mode is not None:
        live = s.requests_owning_rows()
        alloc = s.token_to_kv_pool_allocator
        s.pause_generation(mode)
        assert not s.step() and s.paused
        seen.update(live=live, trace=memory_trace(s), outs=len(s.finished_outputs),
                    committed=[r.kv.kv_committed_len for r in live], waiting=list(s.waiting_queue),
                    held=list(s.held_rebootstrap_reqs), owners=s.requests_owning_rows(),
                    token=next(c for c in s.check_memory(idle=False) if c.pool == "token_to_kv_pool"))
        for _ in range(3):
            assert not s.step()
        seen.update(trace_after=memory_trace(s), outs_after=len(s.finished_outputs),
                    committed_after=[r.kv.kv_committed_len for r in live])
        if flush:
            seen["waiting_at_flush"] = len(s.waiting_queue) + len(s.held_rebootstrap_reqs)
            s.request_flush_cache()
            s.step()
            seen["flushed"] = s.flush_results[-1]
            seen["pools_at_flush"] = (alloc.available_size(), s.tree_cache.total_size(),
                                      s.req_to_token_pool.available_size())
        s.continue_generation()
    s.run_until_idle()
    out = outputs(s)
    assert set(out) == set(rids)
    return s, sorted((o.rid, o.reason, tuple(o.output_ids)) for o in out.values()), seen


@pytest.mark.parametrize("preset", ["default", "overlap", "chunked", "mixed-chunk", "pd-decode", "hisparse"])
@pytest.mark.parametrize("at", [1, 2, 4])
def test_in_place_pause_freezes_every_pool_and_continue_resumes_to_the_same_tokens(preset, at):
    _, ref, _ = _pause_run(preset, at=at)
    s, got, seen = _pause_run(preset, "in_place", flush=True, at=at)
    assert seen["trace_after"] == seen["trace"] and seen["outs_after"] == seen["outs"]  # nothing ran
    assert seen["committed_after"] == seen["committed"]
    assert seen["flushed"] is False or not seen["live"]  # requests still hold KV: the flush is refused
    assert s.num_retractions == 0 and not s.paused
    assert got == ref
    assert_clean_at_idle(s)


@pytest.mark.parametrize("preset,at", [(p, at) for p in ("default", "overlap", "chunked", "mixed-chunk", "paged", "retract",
                                                          "streaming-session", "hicache") for at in (1, 2, 4)]
                         + [(p, at) for p in ("pd-decode", "pd-decode-hisparse") for at in (2, 4)])  # 1: in transfer
def test_retract_pause_frees_private_kv_then_flush_succeeds_while_paused_and_continue_finishes(preset, at):
    _, ref, _ = _pause_run(preset, at=at)
    s, got, seen = _pause_run(preset, "retract", flush=True, at=at)
    live, tok = seen["live"], seen["token"]
    assert live, "the pause should find requests in flight"
    assert not seen["owners"] and not any(r.kv.holds_kv for r in live)  # retract_all released every record
    assert tok.uncached == 0 and tok.available + tok.evictable + tok.protected == tok.total  # no private KV
    assert tok.protected == 0 or preset == "hicache"  # no request lock (HiCache: write-throughs not acked yet)
    requeued = seen["held"] if s.config.is_pd_decode else seen["waiting"]
    assert {id(r) for r in live} <= {id(r) for r in requeued}
    assert seen["trace_after"] == seen["trace"]  # retracted requests wait: nothing re-prefills while paused
    assert seen["waiting_at_flush"] >= len(live)
    if preset != "hicache":  # a HiCache write-through may still be in flight: SGLang refuses then too
        rp = s.req_to_token_pool
        assert seen["flushed"] is True
        assert seen["pools_at_flush"] == (tok.total, 0, rp.size + rp.pre_alloc_size)
    assert s.num_retractions == len(live)
    assert got == ref  # re-prefilled (or transferred again) KV gives the same tokens
    assert_clean_at_idle(s)


def test_retract_pause_with_overlap_processes_the_pending_result_first():
    s = Scheduler(get_preset("overlap").config())
    rid = s.add_request(list(range(2, 12)), 6)
    s.step()  # prefill launched; its result is processed one step later
    s.step()
    req = s.running_batch[0]
    assert req.future_ids and s.last_batch is not None
    n = len(req.output_ids)
    s.pause_generation("retract")
    s.step()
    assert len(req.output_ids) == n + 1 and not req.future_ids  # the lagged token landed before the retract
    assert s.last_batch is None and req in s.waiting_queue and not req.kv.holds_kv
    s.continue_generation()
    s.run_until_idle()
    assert len(outputs(s)[rid].output_ids) == 6
    assert_clean_at_idle(s)


def test_retract_pause_releases_a_chunked_request_with_a_recorded_abort_instead():
    s = Scheduler(get_preset("chunked").config())
    rid = s.add_request(list(range(2, 82)), 3)  # parks between chunks
    s.step()
    assert s.chunked_req is not None
    s.abort_request(rid)
    s.pause_generation("retract")
    s.step()
    assert outputs(s)[rid].reason == FinishReason.ABORT and not s.waiting_queue and s.chunked_req is None
    s.request_flush_cache()
    s.step()
    assert s.flush_results == [True]
    s.continue_generation()
    s.run_until_idle()
    assert_clean_at_idle(s)


def test_pd_retract_pause_rebootstraps_and_an_abort_while_held_ends_the_request():
    s = Scheduler(get_preset("pd-decode").config(max_running_requests=2))
    a = s.add_request(list(range(2, 12)), 8)
    b = s.add_request(list(range(20, 30)), 8)
    for _ in range(4):
        s.step()
    ra, rb = (find(s.running_batch + s.waiting_queue, r) for r in (a, b))
    out_a = list(ra.output_ids)
    s.pause_generation("retract")
    s.step()
    assert s.held_rebootstrap_reqs == [ra, rb] and not s.disagg_prealloc_queue  # held until continue
    assert ra.output_ids == out_a[:-1] and ra.pd_rebootstrap_forced_output_id == out_a[-1]
    s.abort_request(b)
    s.step()
    assert outputs(s)[b].reason == FinishReason.ABORT and s.held_rebootstrap_reqs == [ra]
    s.continue_generation()
    s.step()
    assert s.disagg_prealloc_queue == [] and ra.kv.kv_committed_len == 10 + len(out_a) - 1
    s.run_until_idle()
    assert outputs(s)[a].output_ids[: len(out_a)] == out_a and len(outputs(s)[a].output_ids) == 8
    assert_clean_at_idle(s)


def test_pd_retract_pause_rebootstraps_a_transferred_request_already_finished_at_hand_off():
    """SGLang retracts every transferred waiting request, finished or not: one that finished on its
    hand-off token (stop_at=1) is rebuilt and released by the prebuilt step after continue."""
    s = Scheduler(get_preset("pd-decode").config())  # one running request: the others wait
    a = s.add_request(list(range(2, 12)), 8)
    b = s.add_request(list(range(20, 30)), 8, stop_at=1)
    for _ in range(2):
        s.step()
    rb = find(s.waiting_queue, b)
    assert rb.finished() and rb.kv.holds_kv
    s.pause_generation("retract")
    s.step()
    assert rb in s.held_rebootstrap_reqs and not rb.kv.holds_kv
    s.request_flush_cache()
    s.step()
    assert s.flush_results == [True]
    s.continue_generation()
    s.run_until_idle()
    out = outputs(s)
    assert (out[b].reason, out[b].output_ids) == (FinishReason.STOP, [EOS]) and len(out[a].output_ids) == 8
    assert_clean_at_idle(s)


def test_pause_generation_mode_abort_is_the_callers_and_unknown_modes_raise(make_engine):
    s = make_engine()
    for mode in ("abort", "drain"):
        with pytest.raises(ValueError):
            s.pause_generation(mode)
    assert not s.recv_queue
    s.continue_generation()  # not paused: a no-op
    s.step()
    assert not s.paused


# -- layout ----------------------------------------------------------------------------------------

def test_the_engine_keeps_to_its_rooms():
    """The team's rooms: no module over 600 lines, no class over 400, the engine at most 3,600 lines
    (``cat engine_under_test/*.py | wc -l``); and the engine never imports kvaudit."""
    import ast
    import glob
    import os

    import engine_under_test

    total, over = 0, []
    for path in sorted(glob.glob(os.path.join(os.path.dirname(engine_under_test.__file__), "*.py"))):
        text, name = open(path).read(), os.path.basename(path)
        total += text.count("\n")
        if text.count("\n") > 600:
            over.append(f"{name}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 400:
                over.append(f"{name}: class {node.name} has {node.end_lineno - node.lineno + 1} lines")
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import)
                    else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            over += [f"{name}: imports {m}" for m in mods if m.split(".")[0] == "kvaudit"]
    assert not over, over
    assert total <= 3600, f"the engine has {total} lines"
