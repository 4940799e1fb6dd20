"""HiCache mode of the real-SGLang target (kvaudit/targets/sglang/hicache.py): SGLang 0.5.23's
UnifiedRadixCache with init_hicache, HybridCacheController and its host pool, driven on CPU.

* objects come from SGLang's factory; settings the target does not drive are refused;
* the memory model's 7.2 HiCache events as programs, each asserting its path was taken: write-through
  and its delayed ack, demotion to host and load-back with its ack, host eviction pressure,
  write_back and write_through_selective, flush refused while an ack is pending;
* a host-pool leak injected into SGLang's own host free path is caught (the host oracle can fail);
* the L3 mode (``sglang-hicache-l3``, kvaudit/targets/sglang/hicache_l3.py): backups reach storage,
  a prefix evicted from device and host is prefetched back from storage (its KV intact), an abort
  or ``best_effort`` admission ends a prefetch in flight and its host buffers come back, a match
  lost while queued is re-queried, the storage threads never start, and a run replays identically.

Skipped where SGLang 0.5.23 is not installed.
"""

import gc
import os
import threading
import time

import pytest


import torch

from kvaudit.program import (Abort, FlushCache, HealthCheck, Idle, MemoryPressure, Step, Submit,
                             prompt_tokens)
from kvaudit.audit.runner import AuditedRun, execute
from kvaudit.targets.sglang.config import SGLANG_PRESETS
from sglang_helpers import CORES, run_ops

pytestmark = pytest.mark.sglang

HOST = "hicache_host_pool"



def hc(target):
    """The target's hicache feature."""
    return target.feature("hicache")

def cfg(core="rust", **kw):
    return SGLANG_PRESETS["sglang-hicache"].config(tree_core=core, **kw)


def state(t):
    c = t.tree_cache
    return dict(avail=t.allocator.available_size(), evictable=c.evictable_size(), protected=c.protected_size(),
                host_avail=hc(t).host_group.available_size(), wt=len(c.ongoing_write_through),
                lb=len(c.ongoing_load_back))


def steps(run, n, trace=None):
    for _ in range(n):
        assert run.apply(Step(1)) == []
        if trace is not None:
            trace.append(state(run.target))


def test_a_flush_frees_the_host_pool_at_the_site_it_had_before_the_target_was_split():
    """flush_cache clears the host pool through the observer's ``_install_host_pool`` wrapper, whose
    frame was a site while it shared the driver's file: the split keeps it one (hooks.py among
    ``engine_files``), so a HiCache run's ledger digest is what it was (issue 19)."""
    with AuditedRun(cfg("python")) as run:
        for op in [Submit(0, 20, 3), Idle(), FlushCache(), Idle()]:
            assert run.apply(op) == []
        a = run.auditor
        frees = [a.site(ev.site)[0] for ev in a.events if ev.pool == HOST and ev.kind == "free"]
    assert frees and {(s.function, s.file.replace("\\", "/")) for s in frees} == \
        {("clear_wrapper", "kvaudit/targets/sglang/hooks.py")}


# -- config ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw, text", [
    ({"enable_hisparse": True}, "enable_hisparse"),
    ({"enable_streaming_session": True}, "enable_streaming_session"),
    ({"enable_overlap": True}, "enable_overlap"),
    ({"disaggregation_mode": "decode"}, "disaggregation_mode decode"),
    ({"hicache_write_policy": "write_around"}, "hicache_write_policy"),
    ({"hicache_ratio": 1.0}, "hicache_ratio"),
    ({"hicache_ack_steps": 0}, "hicache_ack_steps"),
])
def test_settings_not_driven_are_refused(kw, text):
    with pytest.raises(ValueError, match=text):
        cfg(**kw)


# -- bootstrap ------------------------------------------------------------------------------------
@pytest.mark.parametrize("core", CORES)
def test_objects_come_from_sglangs_factory(core):
    with AuditedRun(cfg(core)) as run:
        t = run.target
        c = t.tree_cache
        assert type(t).__name__ == "SglangTarget" and [type(f).__name__ for f in t.features] == ["HiCache"]
        assert type(c).__name__ == "UnifiedRadixCache" and type(c).__module__.startswith("sglang.")
        assert type(hc(t).cache_controller).__name__ == "HybridCacheController"
        assert type(hc(t).host_group).__name__ == "HostPoolGroup"
        assert type(hc(t).host_pool).__name__ == "MHATokenToKVPoolHost"
        assert hc(t).host_pool.size == 2 * 128 + 4  # hicache_ratio 2, one page more
        assert (c.write_through_threshold, c.is_write_back) == (1, False)
        assert [p.name for p in t.pools()] == ["token_to_kv_pool", "req_to_token_pool", HOST]
        assert [s.split()[0] for s in hc(t).shims] == ["S1", "H2", "H3", "H4"]


# -- 7.2 HiCache events ----------------------------------------------------------------------------
@pytest.mark.parametrize("ack", [1, 3])
@pytest.mark.parametrize("core", CORES)
def test_write_through_holds_its_lock_until_the_ack(core, ack):
    """Insert -> BackupKV: host slots allocated, node locked (protected); ``ack`` steps later
    writing_check releases it (evictable)."""
    findings, run = run_ops(cfg(core, hicache_ack_steps=ack), [Submit(0, 40, 1)])
    trace = []
    steps(run, ack + 1, trace)
    t = run.target
    # step 1: prefill, finish (max_new 1), insert 40 tokens: write-through in flight, node locked
    assert trace[0] == dict(avail=88, evictable=0, protected=40, host_avail=220, wt=1, lb=0)
    assert trace[ack - 1]["wt"] == 1 and trace[ack - 1]["protected"] == 40
    assert trace[ack] == dict(avail=88, evictable=40, protected=0, host_avail=220, wt=0, lb=0)
    assert hc(t).hicache_log == [("d2h", 1, 40)]
    assert run.apply(Idle()) == []
    run.close()


@pytest.mark.parametrize("core", CORES)
def test_flush_is_refused_while_a_write_through_is_in_flight(core):
    with AuditedRun(cfg(core, hicache_ack_steps=3)) as run:
        t = run.target
        for op in [Submit(0, 40, 1), Step(1), FlushCache()]:
            assert run.apply(op) == []
        assert not t.is_idle() and t.flushed() == 0 and len(t.tree_cache.ongoing_write_through) == 1
        for op in [Idle(), FlushCache(), Idle()]:
            assert run.apply(op) == []
        assert t.flushed() == 1 and state(t)["host_avail"] == hc(t).host_pool.size


@pytest.mark.parametrize("page", [1, 4])
@pytest.mark.parametrize("core", CORES)
def test_demote_to_host_then_load_back_and_its_ack(core, page):
    """After the write ack, device eviction demotes the node to host-only (device slots back, host
    kept); the same prompt plus 8 tokens then matches on host: add_one_req -> init_load_back
    allocates device slots and locks the path, ready_to_load_host_cache starts the copy; both locks
    go at the load ack. The KV content survives the round trip."""
    ack = 2
    run = AuditedRun(cfg(core, page_size=page, hicache_ack_steps=ack))
    t, c = run.target, run.target.tree_cache
    kv = t.allocator.get_kvcache()
    kv._get_key_buffer(0)[:] = 7.0  # the "forward" of the first request: its KV is all 7s
    assert run.apply(Submit(0, 40, 1)) == [] and run.apply(Idle()) == []
    prompt = prompt_tokens(0, 40, t.config.vocab_size)  # Submit(0, 40, ...)'s prompt
    c.evict(t.S.EvictParams(num_tokens=c.evictable_size()))  # demote: written through, so host-only now
    kv._get_key_buffer(0)[:] = 0.0  # the device copy is gone
    assert state(t) == dict(avail=128, evictable=0, protected=0, host_avail=hc(t).host_pool.size - 40, wt=0, lb=0)
    t._submit(prompt + [90 + i for i in range(8)], 4, None, None)
    trace = []
    steps(run, 1, trace)
    req = next(r for r in t.running if r.rid == "r1")
    assert req.host_hit_length == 40 and req.host_loaded_length == 40  # all of it loaded back
    assert trace[0]["lb"] == 1 and trace[0]["protected"] >= 40  # loaded slots locked until the ack
    h2d = [e for e in hc(t).hicache_log if e[0] == "h2d"]
    assert h2d == [("h2d", t.steps, 40)] and ("load_ready", t.steps, 0) in hc(t).hicache_log
    row = t.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :40].to(torch.int64)
    assert bool((kv._get_key_buffer(0)[row] == 7.0).all())  # device slots reallocated, content loaded back
    steps(run, ack, trace)
    assert trace[ack]["lb"] == 0  # load ack: device and host locks released
    assert run.apply(Idle()) == [] and state(t)["protected"] == 0
    assert all(v == 0 for v in hc(t).host_lock_net.values())
    run.close()


def test_a_run_says_how_many_write_throughs_and_load_backs_it_reached():
    """A clean ``sglang-hicache`` run's ``reached:`` line named only the shared driver's counters, none of the
    host tier the preset exists for: now one write-through (the first request's backup) and one load-back (a
    host hit after device eviction) are counted."""
    run = AuditedRun(cfg())
    t, c = run.target, run.target.tree_cache
    assert run.apply(Submit(0, 40, 1)) == [] and run.apply(Idle()) == []
    c.evict(t.S.EvictParams(num_tokens=c.evictable_size()))  # demote to host-only
    assert t.reach()["hicache_write_throughs"] == 1 and t.reach()["hicache_load_backs"] == 0
    assert run.apply(Submit(0, 48, 1)) == [] and run.apply(Idle()) == []  # the same family: a host hit
    assert (t.reach()["hicache_write_throughs"], t.reach()["hicache_load_backs"]) >= (1, 1)
    run.close()


@pytest.mark.parametrize("core", CORES)
def test_host_eviction_pressure(core):
    """Distinct 60-token prompts, device evicted after each (write-through: demoted to host): the
    260-slot host pool fills; _execute_kv_backup makes room with evict_host, and MemoryPressure
    evicts host leaves beyond half the host pool."""
    with AuditedRun(cfg(core)) as run:
        t, c = run.target, run.target.tree_cache
        calls = []
        real = c.evict_host

        def counting(n, *a, **k):
            out = real(n, *a, **k)
            calls.append((n, out))
            return out

        c.evict_host = counting
        host_seen = []
        for i in range(6):
            for op in [Submit(i, 60, 1), Idle()]:
                assert run.apply(op) == []
            c.evict(t.S.EvictParams(num_tokens=c.evictable_size()))
            host_seen.append(hc(t).host_group.available_size())
        assert min(host_seen) < 60 and calls and all(out > 0 for _, out in calls)  # backups evicted host leaves
        before = len(calls)
        assert run.apply(MemoryPressure()) == []
        assert len(calls) == before + 1 and hc(t).host_group.available_size() >= hc(t).host_pool.size // 2
        assert run.apply(Idle()) == []


@pytest.mark.parametrize("core", CORES)
def test_write_back_backs_up_only_on_eviction(core):
    with AuditedRun(cfg(core, hicache_write_policy="write_back")) as run:
        t, c = run.target, run.target.tree_cache
        for op in [Submit(0, 40, 1), Idle()]:
            assert run.apply(op) == []
        assert c.is_write_back and hc(t).hicache_log == [] and state(t)["host_avail"] == hc(t).host_pool.size
        assert run.apply(MemoryPressure()) == []  # eviction backs up the leaf, then demotes it
        assert [e[0] for e in hc(t).hicache_log] == ["d2h"]
        assert hc(t).host_group.available_size() == hc(t).host_pool.size - 40
        assert state(t)["avail"] == 128
        assert run.apply(Idle()) == []


@pytest.mark.parametrize("core", CORES)
def test_write_through_selective_backs_up_on_the_second_hit(core):
    with AuditedRun(cfg(core, hicache_write_policy="write_through_selective")) as run:
        t, c = run.target, run.target.tree_cache
        assert c.write_through_threshold == 2
        for op in [Submit(0, 40, 1), Idle()]:
            assert run.apply(op) == []
        assert hc(t).hicache_log == []
        for op in [Submit(0, 40, 1), Idle()]:
            assert run.apply(op) == []
        assert [e[0] for e in hc(t).hicache_log] == ["d2h"] and hc(t).host_group.available_size() < hc(t).host_pool.size


SEQUENCES = {
    "reuse after pressure": [Submit(0, 40, 2), Idle(), MemoryPressure(), Submit(0, 44, 3), Idle(), FlushCache(),
                             Idle()],
    "fill device and host": [Submit(i, 60, 4) for i in range(8)] + [Idle(), MemoryPressure(), Submit(3, 60, 2),
                                                                     Idle()],
}


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("name", list(SEQUENCES))
def test_sequences_run_clean(name, core, policy):
    ex = execute(cfg(core, hicache_write_policy=policy), SEQUENCES[name])
    assert ex.findings == [], [f.message for f in ex.findings]


# -- the host-pool oracle can fail --------------------------------------------------------------------
def test_a_lost_host_free_is_a_host_pool_leak():
    """SGLang's own host-eviction path drops its host frees once (UnifiedRadixCache._drain_host_frees):
    the node loses its host value, the slots stay allocated -> leak on hicache_host_pool (Python core:
    the tree's host values are its roots)."""
    with AuditedRun(cfg("python")) as run:
        t, c = run.target, run.target.tree_cache
        drain = c._drain_host_frees
        dropped = []

        def dropping(host_frees):
            if not dropped and host_frees:
                dropped.append({k: sum(int(v.numel()) for v in vs) for k, vs in host_frees.items()})
                host_frees.clear()
                return None
            return drain(host_frees)

        c._drain_host_frees = dropping
        for op in [Submit(0, 40, 1), Idle()]:
            assert run.apply(op) == []
        c.evict(t.S.EvictParams(num_tokens=c.evictable_size()))
        c.evict_host(hc(t).host_pool.size)
        findings = run.apply(Step(1))
        assert dropped and list(dropped[0].values()) == [40]
        assert [(f.kind, f.pool) for f in findings] == [("leak", HOST)]
        assert "unreachable" in findings[0].message


def test_the_rust_core_audits_the_host_pool_by_ledger_and_free_list():
    """On the Rust core the host roots are the wrappers' own allocation set (no node walk): a lost host
    free is not a leak there, but the free-list replay still catches a free that bypasses the wrappers."""
    with AuditedRun(cfg("rust")) as run:
        t = run.target
        for op in [Submit(0, 40, 1), Idle()]:
            assert run.apply(op) == []
        assert hc(t).tree_host_values() is None and len(hc(t)._host_live) == 10  # 40 tokens, page 4
        hp = hc(t).host_pool
        u = min(hc(t)._host_live)  # a host page the tree holds, freed behind the wrappers' back
        type(hp).free(hp, torch.arange((u - 1) * 4, u * 4, dtype=torch.int64))
        findings = run.apply(Step(1))
        assert [(f.kind, f.pool) for f in findings] == [("accounting-drift", HOST)]
        assert "free list disagrees" in findings[0].message



@pytest.mark.parametrize("core", CORES)
def test_a_dropped_host_lock_release_is_a_lock_imbalance(core):
    """A load-back takes a host lock on its node until its ack (loading_check -> dec_host_lock_ref); one
    release dropped leaves host_lock_ref at 1 with no load-back pending: kvaudit reports the imbalance
    on that node, on the host pool, with the site of the host lock nobody released."""
    run = AuditedRun(cfg(core))
    t, c = run.target, run.target.tree_cache
    assert run.apply(Submit(0, 40, 1)) == [] and run.apply(Idle()) == []
    c.evict(t.S.EvictParams(num_tokens=c.evictable_size()))  # demote to host-only
    release, dropped = c.dec_host_lock_ref, []

    def drop_first(node, *a, **k):
        if not dropped:
            dropped.append(node)
            return None
        return release(node, *a, **k)

    c.dec_host_lock_ref = drop_first
    t._submit(prompt_tokens(0, 40, t.config.vocab_size) + [90 + i for i in range(8)], 4, None, None)  # a host hit
    found = run.apply(Idle())
    run.close()
    assert len(dropped) == 1
    (f,) = found
    assert f.kind == "lock-imbalance" and f"host lock on node {dropped[0]}: host_ref=1 but 0" in f.message
    # the first release dropped is that of add_one_req's pin around init_load_back (taken for the request
    # and released in the same call), not the load-back's (released at its ack): the pin is blamed
    assert f.pool == "hicache_host_pool" and "lock taken for req:" in f.message
    assert f.alloc_sites and "kvaudit" not in f.alloc_sites[0].file  # the inc_host_lock_ref's caller


@pytest.mark.parametrize("core", CORES)
def test_a_health_check_runs_while_a_copy_is_in_flight(core):
    """is_fully_idle(for_health_check=True) ignores in-flight write-throughs and load-backs (only a flush
    waits for them): a health check sent while a write-through's ack is pending runs."""
    run = AuditedRun(cfg(core, hicache_ack_steps=3))
    t = run.target
    for op in [Submit(0, 40, 1), Step(1), Step(1)]:
        assert run.apply(op) == []
    assert t.tree_cache.ongoing_write_through and not t.is_idle() and t.is_idle_for_health_check()
    run.apply(HealthCheck())
    assert t.submitted[-1].startswith("HEALTH_CHECK_")
    assert run.apply(Idle()) == []
    run.close()


# -- L3: the storage tier (sglang-hicache-l3) ------------------------------------------------------
def l3(core="rust", **kw):
    return SGLANG_PRESETS["sglang-hicache-l3"].config(tree_core=core, **kw)


def backed_up_then_evicted(run):
    """Submit(0, 40, 1) with its KV all 7s, run it to idle (written through to host, then backed up to
    storage), then evict it from device and host and zero both copies: only storage holds it."""
    t, c = run.target, run.target.tree_cache
    kv = t.allocator.get_kvcache()
    kv._get_key_buffer(0)[:] = 7.0
    for op in [Submit(0, 40, 1), Idle()]:
        assert run.apply(op) == []
    assert [e[2] for e in hc(t).storage_log if e[0] == "backup"] == [40]
    assert len(os.listdir(hc(t).storage_dir.name)) == 10
    c.evict(t.S.EvictParams(num_tokens=c.evictable_size()))
    c.evict_host(hc(t).host_pool.size)
    kv._get_key_buffer(0)[:] = 0.0
    hc(t).host_pool.kv_buffer[:] = 0
    assert state(t) == dict(avail=128, evictable=0, protected=0, host_avail=hc(t).host_pool.size, wt=0, lb=0)
    return prompt_tokens(0, 40, t.config.vocab_size)


@pytest.mark.parametrize("core", CORES)
def test_a_prefix_evicted_from_device_and_host_is_prefetched_from_storage(core):
    """The same prompt plus 8 tokens comes back: at queueing, prefetch_from_storage from the root; one
    step later the worker's hit query finds the 40 stored tokens and check_hicache_events allocates host
    buffers for them (held by the prefetch: roots, owner prefetch:r1); the next step the page transfer
    lands, the result is inserted into the tree as host values, admission's check_prefetch_progress
    passes and pop_prefetch_loaded_span credits 40 tokens, and the host hit loads back to device. The KV
    read from the files is the first request's."""
    run = AuditedRun(l3(core))
    t, c = run.target, run.target.tree_cache
    prompt = backed_up_then_evicted(run)
    t._submit(prompt + [90 + i for i in range(8)], 4, None, None)
    assert hc(t).storage_log[-1] == ("prefetch", 4, "r1", 44) and c.ongoing_prefetch
    steps(run, 1)
    assert hc(t).storage_log[-1] == ("query", 5, "r1", 40) and not t.running  # waiting for its prefetch
    assert [o for o, _ in hc(t).storage_host_slots()] == ["prefetch:r1"]
    assert hc(t).host_group.available_size() == hc(t).host_pool.size - 40
    steps(run, 1)
    assert hc(t).storage_log[-2:] == [("transfer", 6, "r1", 40), ("loaded", 6, "r1", 40)]
    (req,) = t.running
    assert (req.rid, req.storage_hit_length, req.host_hit_length) == ("r1", 40, 40)  # reused, not recomputed
    assert not c.ongoing_prefetch and hc(t).storage_host_slots() == []
    kv = t.allocator.get_kvcache()
    row = t.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :40].to(torch.int64)
    assert bool((kv._get_key_buffer(0)[row] == 7.0).all())  # storage -> host -> device, intact
    assert run.apply(Idle()) == [] and all(v == 0 for v in hc(t).host_lock_net.values())
    run.close()


@pytest.mark.parametrize("core", CORES)
def test_an_abort_while_the_prefetch_is_in_flight_returns_its_host_buffers(core):
    """With storage operations 3 steps long, the request is aborted while its page transfer is queued:
    finish(ABORT) -> release_aborted_request terminates the prefetch and drops it from ongoing_prefetch;
    the operation still owns its 40-token host buffer (root prefetch:r1) until its completion ack, whose
    drain queues the buffer for release (root host_mem_release_queue), freed at the next poll. No finding
    at any step; the host pool is whole at the end."""
    run = AuditedRun(l3(core, hicache_storage_ack_steps=3))
    t, c = run.target, run.target.tree_cache
    prompt = backed_up_then_evicted(run)
    t._submit(prompt + [90 + i for i in range(8)], 4, None, None)
    steps(run, 3)  # the hit query (due 3 steps after queueing): buffers allocated, transfer queued
    handle = next(iter(c.ongoing_prefetch))
    assert c.ongoing_prefetch[handle].host_indices.numel() == 40 and t.live_rids() == ["r1"]
    finished = []
    real_finish = c.finish
    c.finish = lambda h, outcome: (finished.append((h.rid, outcome.name)), real_finish(h, outcome))
    assert run.apply(Abort(0)) == []
    assert finished == [("r1", "ABORT")] and not c.ongoing_prefetch and not t.waiting
    assert [(o, s.numel()) for o, s in hc(t).storage_host_slots()] == [("prefetch:r1", 40)]  # the queued operation's
    owners = []
    for _ in range(5):
        steps(run, 1)
        owners.append([o for o, _ in hc(t).storage_host_slots()])
    # the transfer is due 3 steps after the query: it reads nothing (terminated), its ack queues the release
    assert owners == [["prefetch:r1"], ["prefetch:r1"], ["host_mem_release_queue"], [], []]
    assert not any(e[0] == "transfer" for e in hc(t).storage_log)
    assert run.apply(Idle()) == [] and hc(t).host_group.available_size() == hc(t).host_pool.size
    assert state(t)["avail"] == 128
    run.close()


def test_a_dropped_prefetch_release_is_a_host_pool_leak():
    """The oracle can fail on prefetch buffers: the completion ack's release of the aborted prefetch's
    buffer is dropped (HybridCacheController.append_host_mem_release), so 40 host tokens stay allocated
    with no owner -- a leak on hicache_host_pool (Python core: the tree's host values and the storage
    work's buffers are the roots)."""
    run = AuditedRun(l3("python", hicache_storage_ack_steps=3))
    t = run.target
    prompt = backed_up_then_evicted(run)
    t._submit(prompt + [90 + i for i in range(8)], 4, None, None)
    steps(run, 3)
    assert run.apply(Abort(0)) == []
    cc, dropped = hc(t).cache_controller, []
    release = cc.append_host_mem_release

    def dropping(host_indices=None, extra_pools=None):
        if not dropped and host_indices is not None and host_indices.numel():
            dropped.append(host_indices.numel())
            return None
        return release(host_indices, extra_pools)

    cc.append_host_mem_release = dropping
    findings = []
    for _ in range(4):
        findings = run.apply(Step(1))
        if findings:
            break
    assert dropped == [40]
    assert [(f.kind, f.pool) for f in findings] == [("leak", HOST)]
    run.close()


@pytest.mark.parametrize("core", CORES)
def test_best_effort_admission_ends_a_running_prefetch(core):
    """hicache_storage_prefetch_policy best_effort, storage operations 2 steps long, one running request at
    most: r2 waits behind r1 while its hit query lands and host buffers are allocated; at its admission the
    page transfer is still queued, so check_prefetch_progress terminates the prefetch and keeps what landed
    (nothing): r2 is prefilled from scratch, and the buffer goes back at the operation's completion ack."""
    cfg = l3(core, hicache_storage_prefetch_policy="best_effort", hicache_storage_ack_steps=2, max_running_requests=1)
    run = AuditedRun(cfg)
    t, c = run.target, run.target.tree_cache
    prompt = backed_up_then_evicted(run)
    assert run.apply(Submit(1, 20, 2)) == []  # r1: the one running slot, for two steps
    t._submit(prompt + [90 + i for i in range(8)], 4, None, None)
    steps(run, 2)
    (info,) = c.ongoing_prefetch.values()
    assert info.host_indices.numel() == 40 and [r.rid for r in t.waiting] == ["r2"]
    steps(run, 1)
    (req,) = t.running
    assert (req.rid, req.storage_hit_length, req.host_hit_length) == ("r2", 0, 0)
    assert not any(e[0] == "h2d" for e in hc(t).hicache_log)  # nothing loaded back: all 48 tokens prefilled
    assert not c.ongoing_prefetch and [(o, s.numel()) for o, s in hc(t).storage_host_slots()] == [("prefetch:r2", 40)]
    assert run.apply(Idle()) == [] and not any(e[0] in ("transfer", "loaded") for e in hc(t).storage_log)
    assert hc(t).storage_host_slots() == []
    run.close()


@pytest.mark.parametrize("core", CORES)
def test_the_timeout_policy_admits_a_request_when_its_prefetch_deadline_passes(core):
    """SGLang's default prefetch policy, timeout, with a 1-second deadline (one step) and storage operations 3
    steps long: the queued request's first blocked admission poll starts the deadline's timer (PollTimer, on
    the step clock); two steps later it has passed, _mark_prefetch_deadline_expired ends the prefetch and the
    request is admitted and prefilled from scratch. The operation's host buffer is held (prefetch:r1) until its
    completion ack queues it for release; no finding at any step."""
    run = AuditedRun(l3(core, hicache_storage_prefetch_policy="timeout", hicache_storage_ack_steps=3,
                        hicache_storage_prefetch_timeout_steps=1))
    t = run.target
    prompt = backed_up_then_evicted(run)
    t._submit(prompt + [90 + i for i in range(8)], 4, None, None)
    admitted = []
    for _ in range(6):
        steps(run, 1)
        admitted.append((t.steps, [r.rid for r in t.running], t.reach()["prefetch_deadlines"]))
    start = admitted[0][0]
    assert admitted[:3] == [(start, [], 0), (start + 1, [], 0), (start + 2, ["r1"], 1)]
    assert not any(e[0] in ("transfer", "loaded") for e in hc(t).storage_log)  # nothing read: prefilled afresh
    assert run.apply(Idle()) == [] and hc(t).storage_host_slots() == []
    run.close()


@pytest.mark.parametrize("core", CORES)
def test_a_failed_storage_read_loads_nothing_and_returns_its_host_buffer(core):
    """hicache_storage_fail_every=2: the backup (storage call 1) lands, the prefetch's read (call 2) fails
    whole. The hit query still finds 40 tokens and host buffers are allocated; the transfer reads no page,
    so r1 is admitted with no storage or host hit and prefilled from scratch, and the buffer goes back
    through host_mem_release_queue. No finding at any step."""
    run = AuditedRun(l3(core, hicache_storage_fail_every=2))
    t = run.target
    prompt = backed_up_then_evicted(run)
    t._submit(prompt + [90 + i for i in range(8)], 4, None, None)
    steps(run, 2)
    assert hc(t).storage_log[-2:] == [("query", t.steps - 1, "r1", 40), ("transfer", t.steps, "r1", 0)]
    (req,) = t.running
    assert (req.rid, req.storage_hit_length, req.host_hit_length) == ("r1", 0, 0)
    assert [o for o, _ in hc(t).storage_host_slots()] == ["host_mem_release_queue"]
    assert run.apply(Idle()) == [] and hc(t).storage_host_slots() == []
    assert t.reach()["storage_failures"] == 1
    run.close()


def test_a_failed_storage_write_backs_up_nothing():
    """hicache_storage_fail_every=1: every write fails, so _page_backup stops at its first batch (0 tokens
    backed up, no file written) and the tree keeps the host copy only. No finding."""
    run = AuditedRun(l3("python", hicache_storage_fail_every=1))
    t = run.target
    for op in [Submit(0, 40, 1), Idle()]:
        assert run.apply(op) == []
    assert [e[2] for e in hc(t).storage_log if e[0] == "backup"] == [0]
    assert os.listdir(hc(t).storage_dir.name) == [] and t.reach()["storage_failures"] == 1
    run.close()


def test_the_poll_timers_clock_is_the_real_one_again_after_the_target():
    """The L3 target puts sglang.srt.utils.poll_timer on its step clock (the timeout policy's deadlines) and
    gives the real clock back at close, so a later target in the process does not read a dead one."""
    run = AuditedRun(l3("python"))
    import sglang.srt.utils.poll_timer as poll_timer
    assert poll_timer.time.perf_counter() == run.target.clock.now
    run.close()
    assert poll_timer.time is time


@pytest.mark.parametrize("core", CORES)
def test_a_match_lost_while_queued_is_queried_again_from_storage(core):
    """A request queued behind a running one (one running request at most) matches 40 tokens on device;
    they are evicted from device and host before it is admitted. At admission the match has shrunk, so
    _prefetch_after_device_hit_loss re-issues the storage query and skips it this round; it then loads
    the 40 tokens from storage."""
    run = AuditedRun(l3(core, max_running_requests=1))
    t, c = run.target, run.target.tree_cache
    for op in [Submit(0, 40, 1), Idle(), Submit(1, 20, 12), Step(2)]:
        assert run.apply(op) == []
    assert [r.rid for r in t.running] == ["r1"]
    t._submit(prompt_tokens(0, 40, t.config.vocab_size) + [90 + i for i in range(8)], 4, None, None)
    (req,) = t.waiting
    assert req.storage_prefetch_last_match_len == 40 and not c.ongoing_prefetch  # 4 new tokens: below threshold
    c.evict(t.S.EvictParams(num_tokens=c.evictable_size()))
    c.evict_host(hc(t).host_pool.size)
    assert run.apply(Idle()) == []
    assert req.storage_prefetch_retry_attempts == 1
    assert ("loaded", req.kvaudit_forward_at, "r2", 40) in hc(t).storage_log
    run.close()


def test_the_storage_threads_never_start():
    """H5: attach_storage_backend and reset() (flush_cache) start SGLang's four storage threads; here they
    are parked, and the worker runs their loops on the scheduler's step."""
    before = threading.active_count()
    with AuditedRun(l3()) as run:
        t = run.target
        cc = hc(t).cache_controller
        for op in [Submit(0, 40, 2), Idle(), FlushCache(), Submit(0, 40, 2), Idle()]:
            assert run.apply(op) == []
        assert t.flushed() == 1 and ("loaded", 6, "r1", 36) in hc(t).storage_log  # after the flush, from storage
        threads = [cc.prefetch_thread, cc.prefetch_io_aux_thread, cc.prefetch_sync_thread, cc.backup_thread]
        assert {type(th).__name__ for th in threads} == {"_ParkedThread"} and not any(th.is_alive() for th in threads)
        assert threading.active_count() == before
        assert [s.split()[0] for s in hc(t).shims] == ["S1", "H5", "H2", "H3", "H4", "H6", "H7"]


L3_PROGRAM = [Submit(0, 40, 2), Submit(1, 36, 3), Idle(), MemoryPressure(), Submit(2, 60, 2), Submit(3, 60, 2), Idle(),
              MemoryPressure(), Submit(0, 44, 3), Submit(1, 40, 2), Step(1), Abort(1), Idle(), FlushCache(),
              Submit(2, 60, 2), Submit(0, 48, 1), Idle()]


@pytest.mark.parametrize("core", CORES)
def test_a_replay_is_identical(core):
    """Determinism: the same program twice gives the same ledger (every alloc, free and lock event with its
    site and step) and the same storage and copy logs -- with prefetches loaded from storage in it."""
    runs = []
    for _ in range(2):
        with AuditedRun(l3(core)) as run:
            for op in L3_PROGRAM:
                assert run.apply(op) == []
            t = run.target
            runs.append((run.auditor.digest(), list(hc(t).storage_log), list(hc(t).hicache_log), t.steps))
    assert runs[0] == runs[1]
    assert sum(e[3] for e in runs[0][1] if e[0] == "loaded") > 0


def test_the_storage_directory_goes_with_the_target():
    """HiCacheFile writes into the run's own temporary directory, removed once the target is freed (the
    process's first target stays referenced by the frame that imported SGLang: a second one is used)."""
    dirs = []
    for _ in range(2):
        with AuditedRun(l3()) as run:
            for op in [Submit(0, 40, 1), Idle()]:
                assert run.apply(op) == []
            dirs.append(hc(run.target).storage_dir.name)
            assert os.listdir(dirs[-1])
        del run
    gc.collect()
    assert dirs[0] != dirs[1] and not os.path.exists(dirs[1])


@pytest.mark.parametrize("write, prefetch", [("write_through", "best_effort"),
                                             ("write_through_selective", "wait_complete"),
                                             ("write_back", "wait_complete")])
@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("name", list(SEQUENCES) + ["l3"])
def test_sequences_run_clean_with_storage(name, core, write, prefetch):
    program = L3_PROGRAM if name == "l3" else SEQUENCES[name]
    ex = execute(l3(core, hicache_write_policy=write, hicache_storage_prefetch_policy=prefetch), program)
    assert ex.findings == [], [f.message for f in ex.findings]


def test_the_l3_target_loads_sglangs_native_storage_hash_when_it_is_built():
    """SGLang JIT-compiles the storage hash (ninja) at the first prefetch's hit query, inside an engine
    step: on a machine that had not built it, the step watchdog reported a hang in subprocess.py (.ci/run,
    a fresh venv). The target loads it when built, before any step."""
    from sglang.srt.mem_cache.cpp_utils import native_hash

    native_hash._load_native_hash_module.cache_clear()
    run = AuditedRun(l3(CORES[0]))
    try:
        assert native_hash._load_native_hash_module.cache_info().currsize == 1
        assert run.target.steps == 0
    finally:
        run.close()
