"""The example vLLM-style engine (examples/minivllm) on its own, without kvaudit: prefix sharing, the
LRU free queue, preemption by recompute, and the two planted bugs breaking its counting invariants."""

import random

import numpy as np
import pytest

from examples.minivllm import BUGS, MiniVllmConfig, Scheduler


def violations(sched: Scheduler) -> list[str]:
    """The counting invariants, read through ``ref_counts``/``free_block_ids``: each block's ref_cnt is
    the number of live requests holding it, the free queue is exactly the ref_cnt-0 blocks, and every
    mapped hash names its block. Returns one line per broken invariant."""
    pool, manager = sched.kv_cache_manager.block_pool, sched.kv_cache_manager
    ref = pool.ref_counts()
    held = np.zeros_like(ref)
    for rid in sched.requests:
        np.add.at(held, [b.block_id for b in manager.req_to_blocks.get(rid, [])], 1)
    free = pool.free_block_ids()
    problems = []
    if (ref < 0).any():
        problems.append(f"ref_cnt below 0 on blocks {np.flatnonzero(ref < 0).tolist()}")
    if (ref[1:] != held[1:]).any():
        problems.append(f"ref_cnt != live holders on blocks {(np.flatnonzero(ref[1:] != held[1:]) + 1).tolist()}")
    if sorted(free.tolist()) != (np.flatnonzero(ref[1:] == 0) + 1).tolist() or len(set(free.tolist())) != len(free):
        problems.append(f"free queue {free.tolist()} is not the ref_cnt-0 blocks")
    if np.intersect1d(free, np.flatnonzero(held)).size:
        problems.append(f"blocks {np.intersect1d(free, np.flatnonzero(held)).tolist()} are free yet held")
    if any(b.block_hash != h for h, b in pool.cached_block_hash_to_block.items()):
        problems.append("a mapped hash names a block with another hash")
    return problems


def run_to_idle(sched: Scheduler, max_steps: int = 500) -> list:
    outputs = []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return outputs
        outputs.append(sched.step())
        assert violations(sched) == []
    raise AssertionError("requests did not finish")


def all_free(sched: Scheduler) -> bool:
    pool = sched.kv_cache_manager.block_pool
    return pool.get_num_free_blocks() == pool.num_gpu_blocks - 1 and not pool.ref_counts().any()


def solo_output(prompt, max_tokens, rid):
    sched = Scheduler(MiniVllmConfig(num_gpu_blocks=64))
    sched.add_request(rid, prompt, max_tokens)
    req = sched.requests[rid]
    run_to_idle(sched)
    return req.output_token_ids


def test_prefix_hit_shares_blocks():
    sched = Scheduler(MiniVllmConfig(num_gpu_blocks=16, block_size=4))
    sched.add_request("a", list(range(9)), 4)
    sched.step()
    sched.add_request("b", list(range(8)) + [99, 98], 4)
    hits, num_hit_tokens = sched.kv_cache_manager.get_computed_blocks(sched.requests["b"])
    assert num_hit_tokens == 8
    sched.step()
    a_blocks, b_blocks = (sched.kv_cache_manager.req_to_blocks[r] for r in "ab")
    assert [b.block_id for b in b_blocks[:2]] == [b.block_id for b in a_blocks[:2]] == [b.block_id for b in hits]
    assert sched.kv_cache_manager.block_pool.ref_counts()[[b.block_id for b in hits]].tolist() == [2, 2]
    assert b_blocks[2] is not a_blocks[2]
    assert violations(sched) == []


def test_full_prompt_hit_still_computes_the_last_token():
    sched = Scheduler(MiniVllmConfig(block_size=4))
    sched.add_request("a", list(range(8)), 1)
    run_to_idle(sched)
    sched.add_request("b", list(range(8)), 1)
    assert sched.kv_cache_manager.get_computed_blocks(sched.requests["b"])[1] == 4
    assert sched.step().num_scheduled_tokens == {"b": 4}


def test_freed_cached_blocks_queue_tail_first_and_are_reused():
    sched = Scheduler(MiniVllmConfig(num_gpu_blocks=8, block_size=4))
    pool = sched.kv_cache_manager.block_pool
    sched.add_request("a", list(range(12)), 1)
    run_to_idle(sched)
    assert all_free(sched)
    assert pool.free_block_ids().tolist() == [4, 5, 6, 7, 3, 2, 1]  # freed tail first: block 3 evicted first
    assert len(pool.cached_block_hash_to_block) == 3  # cached-but-free
    sched.add_request("b", list(range(12)) + [7], 2)
    hits, _ = sched.kv_cache_manager.get_computed_blocks(sched.requests["b"])
    assert [b.block_id for b in hits] == [1, 2, 3]
    sched.step()
    assert pool.ref_counts()[[1, 2, 3]].tolist() == [1, 1, 1]
    assert not set(pool.free_block_ids().tolist()) & {1, 2, 3}
    assert violations(sched) == []


def test_new_blocks_evict_cached_hashes_from_the_head():
    sched = Scheduler(MiniVllmConfig(num_gpu_blocks=5, block_size=4))
    pool = sched.kv_cache_manager.block_pool
    sched.add_request("a", list(range(8)), 1)
    run_to_idle(sched)
    a_hashes = [pool.blocks[1].block_hash, pool.blocks[2].block_hash]
    assert sorted(pool.cached_block_hash_to_block) == sorted(a_hashes)
    sched.add_request("c", [50, 51, 52, 53, 54, 55, 56, 57, 58], 2)  # 3 blocks: 3, 4, then block 2 (a's tail)
    sched.step()
    assert [b.block_id for b in sched.kv_cache_manager.req_to_blocks["c"]] == [3, 4, 2]
    assert a_hashes[0] in pool.cached_block_hash_to_block  # a's head block stays cached-but-free
    assert a_hashes[1] not in pool.cached_block_hash_to_block
    assert pool.free_block_ids().tolist() == [1]
    assert violations(sched) == []


def test_cached_but_free_hits_do_not_count_as_free_for_their_own_request():
    sched = Scheduler(MiniVllmConfig(num_gpu_blocks=5, block_size=2))
    sched.add_request("a", [1, 2, 3, 4, 5], 1)
    run_to_idle(sched)  # blocks 1, 2 cached-but-free
    sched.add_request("c", [9, 9, 9], 3)
    sched.step()  # c takes blocks 4 and 3: the free queue is a's cached blocks 2, 1
    sched.add_request("d", [1, 2, 3, 4, 5, 6, 7], 1)  # hits 1, 2 and needs 2 more: none left
    assert sched.step().num_scheduled_tokens == {"c": 1}
    assert list(sched.waiting) == [sched.requests["d"]]
    assert violations(sched) == []


@pytest.mark.parametrize("caching", [True, False])
def test_preemption_recomputes_and_keeps_the_output(caching):
    sched = Scheduler(MiniVllmConfig(num_gpu_blocks=5, block_size=2, enable_prefix_caching=caching))
    sched.add_request("a", [1, 2, 3], 3)
    sched.add_request("b", [4, 5, 6], 3)  # both fit (2 blocks each) until a needs its third block
    b = sched.requests["b"]
    outputs = run_to_idle(sched)
    assert [o.preempted_req_ids for o in outputs if o.preempted_req_ids] == [["b"]]
    assert b.num_preemptions == 1 and len(b.output_token_ids) == 3
    assert b.output_token_ids == solo_output([4, 5, 6], 3, "b")
    assert all_free(sched)


@pytest.mark.parametrize("caching", [True, False])
def test_random_workload_keeps_counts_and_ends_all_free(caching):
    rng = random.Random(19)
    sched = Scheduler(MiniVllmConfig(num_gpu_blocks=12, block_size=2, max_num_seqs=4,
                                     max_num_batched_tokens=8, enable_prefix_caching=caching))
    base = [rng.randrange(50) for _ in range(8)]
    num_preempted = 0
    for n in range(300):
        roll = rng.random()
        if roll < 0.3:
            sched.add_request(f"r{n}", base[:rng.randrange(1, 8)] + [rng.randrange(50)], rng.randrange(1, 8))
        elif roll < 0.4 and sched.requests:
            sched.abort_request(rng.choice(sorted(sched.requests)))
        else:
            num_preempted += len(sched.step().preempted_req_ids)
        assert violations(sched) == []
    run_to_idle(sched)
    assert num_preempted > 0
    assert all_free(sched)


def test_preempt_double_free_breaks_the_counts():
    def scenario(bugs):
        sched = Scheduler(MiniVllmConfig(num_gpu_blocks=4, block_size=2, bugs=bugs))
        sched.add_request("a", [1, 2, 3], 3)
        sched.add_request("b", [1, 2, 3], 3)  # shares block 1 with a
        for _ in range(3):
            out = sched.step()
        assert out.preempted_req_ids == ["b"]
        return sched

    assert violations(scenario(frozenset())) == []
    # b's own block 3 reaches -1 and is handed to a (reset to 1); block 1, shared with a, reaches 0
    # under a and -1 when a finishes in the same step
    broken = violations(scenario({"preempt-double-free"}))
    assert broken[0] == "ref_cnt below 0 on blocks [1]"


def test_abort_leak_leaves_a_block_neither_free_nor_held():
    def scenario(bugs):
        sched = Scheduler(MiniVllmConfig(bugs=bugs))
        sched.add_request("a", list(range(6)), 4)
        sched.step()
        sched.abort_request("a")
        assert not sched.has_unfinished_requests()
        return sched

    assert violations(scenario(frozenset())) == [] and all_free(scenario(frozenset()))
    leaked = scenario({"abort-leak"})
    assert not all_free(leaked)
    assert violations(leaked) == ["ref_cnt != live holders on blocks [1, 2]"]


def test_config_and_request_validation():
    assert MiniVllmConfig(bugs=list(BUGS)).bugs == frozenset(BUGS)
    with pytest.raises(ValueError, match="unknown bug"):
        MiniVllmConfig(bugs={"nope"})
    with pytest.raises(ValueError, match="num_gpu_blocks"):
        MiniVllmConfig(num_gpu_blocks=1)
    sched = Scheduler(MiniVllmConfig(num_gpu_blocks=4, block_size=2))
    with pytest.raises(ValueError, match="needs 4 blocks"):
        sched.add_request("big", [1, 2, 3], 5)
    sched.add_request("a", [1], 1)
    with pytest.raises(ValueError, match="already exists"):
        sched.add_request("a", [1], 1)
