"""The ``vllm-cpu-offload-swa`` presets: vLLM's Scheduler with ``SimpleCPUOffloadConnector``'s scheduler
side (eager mode) and kvaudit's worker stand-in (``OffloadWorkerStandIn``, kvaudit/targets/vllm/connector.py),
and vLLM #42571 (a GPU block listed twice in one request's eager store, freed twice at its completion)
replayed on vLLM 0.23.0, a release whose ``BlockPool.free_blocks`` queues such a block twice."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from release_helpers import child_env

from kvaudit.program import Abort, Idle, Step, Submit
from kvaudit.targets.vllm.config import VLLM_PRESETS, VllmConfig

ROOT = Path(__file__).resolve().parent.parent
REPRO = ROOT / "tests" / "data" / "vllm_releases" / "vllm-42571.json"  # corpora/vllm/history/ once catalogued
QUEUED_TWICE = "double-free/block_pool/_free_blocks@scheduler.py/_process_store_completion@manager.py/check:queued-twice"
PRESETS = ["vllm-cpu-offload-swa", "vllm-cpu-offload-swa-async"]


def offload_config(name: str = "vllm-cpu-offload-swa", **changes) -> VllmConfig:
    return VLLM_PRESETS[name].config(**changes)


def random_program(seed: int, n: int = 40) -> list:
    """A program of submits (three prompt families), aborts and steps, drained at the end."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        r = rng.random()
        if r < 0.35:
            out.append(Submit(family=rng.randrange(3), prompt_len=rng.randrange(20, 120),
                              max_new_tokens=rng.randrange(1, 60)))
        elif r < 0.40:
            out.append(Abort(handle=rng.randrange(8)))
        else:
            out.append(Step(n=rng.randrange(1, 4)))
    return out + [Idle()]


@pytest.mark.parametrize("name", PRESETS)
def test_preset_config(name):
    c = offload_config(name)
    assert c.kv_connector == "SimpleCPUOffloadConnector" and c.sliding_window == 8 and c.num_cpu_blocks == 6
    assert c.wake_for_transfers and c.blocks_per_request() <= c.num_gpu_blocks - 1
    for bad in (dict(num_cpu_blocks=1), dict(num_cpu_blocks=True), dict(enable_prefix_caching=False),
                dict(level="manager", async_scheduling=False)):
        with pytest.raises(ValueError):
            c.replace(**bad)


@pytest.mark.vllm
@pytest.mark.parametrize("name", PRESETS)
def test_preset_builds_the_connector_scheduler_side(name):
    from kvaudit.audit.runner import AuditedRun
    with AuditedRun(offload_config(name)) as run:
        t = run.target
        c = t.scheduler.connector
        assert type(c).__name__ == "SimpleCPUOffloadConnector"
        m = c.scheduler_manager
        assert m is not None and not m._lazy_mode  # eager, the mode of vLLM #42571
        assert m.cpu_block_pool.num_gpu_blocks == t.config.num_cpu_blocks == 6
        assert m.cpu_block_pool is not t.manager.block_pool
        assert m._gpu_block_pool is t.manager.block_pool  # bind_gpu_block_pool, as the Scheduler calls it
        assert len(m.cpu_kv_cache_config.kv_cache_groups) == 2  # full attention + sliding window
        assert type(t.worker).__name__ == "OffloadWorkerStandIn"


class _StoreCounter:
    """Wraps a target's ``_on_schedule``: the store events and stored GPU blocks each step's metadata asks."""

    def __init__(self, target):
        self.events = 0
        self.blocks = 0
        self.duplicated = 0  # store events listing one GPU block more than once
        on_schedule = target._on_schedule

        def record(out):
            m = out.kv_connector_metadata
            if m.store_event >= 0:
                self.events += 1
                self.blocks += len(m.store_gpu_blocks)
                self.duplicated += len(set(m.store_gpu_blocks)) < len(m.store_gpu_blocks)
            on_schedule(out)

        target._on_schedule = record


@pytest.mark.vllm
def test_stores_complete_in_order_and_the_pool_is_whole_after():
    """One request: its computed blocks are stored (touched while the store is in flight, counted as the
    connector's holders), the stand-in reports each store event once and in order, and once drained the
    GPU pool is whole and the CPU pool holds the stored blocks as cached."""
    from kvaudit.audit.runner import AuditedRun
    with AuditedRun(offload_config(sliding_window=None, kv_transfer_latency_steps=4)) as run:
        t = run.target
        m = t.scheduler.connector.scheduler_manager
        seen = []
        finished = t.worker.finished

        def record(step, cls):
            out = finished(step, cls)
            if out is not None and out.kv_connector_worker_meta is not None:
                seen.extend(out.kv_connector_worker_meta.completed_store_events)
            return out

        t.worker.finished = record
        run.apply(Submit(family=0, prompt_len=60, max_new_tokens=20, ignore_eos=1))
        held = False
        for _ in range(30):
            run.apply(Step(n=1))
            held |= any(o.startswith("offload-store:") for o, _, _ in t.connector_holders())
        run.apply(Idle())
        assert not run.findings, [f.signature for f in run.findings]
        assert held and seen and seen == sorted(seen) and len(seen) == len(set(seen))
        assert not m._store_event_to_blocks and not t.worker.stores
        assert t.manager.block_pool.get_num_free_blocks() == t.config.num_gpu_blocks - 1
        # cached, evictable; block 0 is the CPU pool's null block
        assert m.cpu_block_pool.get_num_free_blocks() == t.config.num_cpu_blocks - 1


@pytest.mark.vllm
def test_reach_counts_each_store_and_load_the_scheduler_side_names():
    """The presets exist for SimpleCPUOffloadConnector's stores and loads, but reach() counted neither: `kvaudit
    fuzz --target vllm --preset vllm-cpu-offload-swa` printed `reached: connector_held_frees=0, preemptions=5,
    preemptions_in_flight=0, stale_reads_checked=...`. Each store and load event the scheduler side's metadata
    names is counted once (`offload_stores`, `offload_loads`), and `offload_flushes` counts the need_flush
    metadata that found a transfer outstanding (seed 28: 26 stores, 1 load)."""
    from kvaudit.audit.runner import AuditedRun
    with AuditedRun(offload_config()) as run:
        t = run.target
        connector, worker = t.scheduler.connector, t.worker
        build, events, flushes = connector.build_connector_meta, {"store": set(), "load": set()}, []

        def record(*a, **k):
            meta = build(*a, **k)
            events["store"].update({meta.store_event} - {-1})
            events["load"].update({meta.load_event} - {-1})
            flushes.append(bool(meta.need_flush and (worker.loads or worker.stores)))  # (before the worker starts it)
            return meta

        connector.build_connector_meta = record
        for op in random_program(28):
            assert run.apply(op) == []
        reach = t.reach()
        assert (reach["offload_stores"], reach["offload_loads"], reach["offload_flushes"]) == (
            len(events["store"]), len(events["load"]), sum(flushes)), (reach, events)
        assert min(reach["offload_stores"], reach["offload_loads"], reach["offload_flushes"]) > 0, reach


@pytest.mark.vllm
def test_without_the_connectors_holders_the_in_flight_stores_read_as_leaks():
    """The holders the observer adds for the connector are needed: dropping them makes the GPU blocks a
    store in flight pins read as references nobody holds."""
    from kvaudit.audit.runner import AuditedRun
    with AuditedRun(offload_config(sliding_window=None, kv_transfer_latency_steps=8)) as run:
        run.target.connector_holders = lambda: []
        run.apply(Submit(family=0, prompt_len=60, max_new_tokens=30, ignore_eos=1))
        for _ in range(6):
            run.apply(Step(n=1))
        assert any(f.kind == "leak" and f.signature.endswith("check:ref_cnt") for f in run.findings), \
            [f.signature for f in run.findings]


@pytest.mark.vllm
def test_clean_without_sliding_window():
    """Full attention only (no block leaves a request's table while it runs): 12 random programs find
    nothing, and the connector did store blocks (so the run is not vacuous)."""
    from kvaudit.audit.runner import AuditedRun
    stores = 0
    for seed in range(12):
        with AuditedRun(offload_config(sliding_window=None)) as run:
            counter = _StoreCounter(run.target)
            for op in random_program(seed):
                run.apply(op)
            assert not run.findings, (seed, [f.signature for f in run.findings])
            assert run.target.is_idle()
            stores += counter.blocks
    assert stores > 100


@pytest.mark.vllm
def test_a_block_listed_twice_is_queued_once_on_this_vllm():
    """vLLM >= 0.24.0's ``free_blocks`` queues a block when its count reaches 0 at that entry, so a
    block touched and freed twice in one call (what #42571's store does) is queued once: no finding."""
    from kvaudit.audit.runner import AuditedRun
    from kvaudit.targets.vllm.boot import load
    if load().version != "0.33.0":
        pytest.skip("written against vLLM 0.33.0's BlockPool.free_blocks")
    with AuditedRun(offload_config(sliding_window=None)) as run:
        pool = run.target.manager.block_pool
        blocks = pool.get_new_blocks(2)
        pool.touch([blocks[0]])
        pool.free_blocks([blocks[0], blocks[1], blocks[0]])
        assert blocks[0].ref_cnt == 0 and pool.get_num_free_blocks() == run.target.config.num_gpu_blocks - 1
        assert run.target.queued_twice == []


def _replay_on(version: str, path: Path) -> dict:
    """``path`` replayed under vLLM ``version`` (a child process: one vLLM per process): the signatures
    found, and the store events that listed a GPU block twice with the request each came from."""
    env = child_env("vllm", version, ROOT)
    code = f"""
import json, vllm
from kvaudit import replay
from kvaudit.audit.runner import AuditedRun
assert vllm.__version__ == {version!r}, vllm.__version__
config, program = replay.load({str(path)!r})[:2]
dups = []
with AuditedRun(config) as run:
    t = run.target
    sm = t.scheduler.connector.scheduler_manager
    on = t._on_schedule
    def record(out):
        g = out.kv_connector_metadata.store_gpu_blocks
        twice = sorted({{b for b in g if g.count(b) > 1}})
        if twice:
            reqs = sm._store_event_to_reqs.get(out.kv_connector_metadata.store_event, [])
            lists = {{r: [ids.count(b) for ids in sm._reqs_to_store[r].block_ids for b in twice]
                      for r in reqs if r in sm._reqs_to_store}}
            dups.append(dict(blocks=twice, reqs=reqs, listed=lists))
        on(out)
    t._on_schedule = record
    for op in program:
        run.apply(op)
    print(json.dumps(dict(signatures=sorted({{f.signature for f in run.findings}}), dups=dups)))
"""
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _one_request_lists_a_block_twice(out: dict) -> None:
    first = out["dups"][0]
    assert len(first["reqs"]) == 1, first  # one request's store names the block twice: #42571's mechanism
    assert sum(first["listed"][first["reqs"][0]]) >= 2, first


@pytest.mark.releases
def test_42571_reproducer_replays_to_the_double_free_on_0_23_0():
    """vLLM #42571 on 0.23.0 (eager SimpleCPUOffloadConnector, sliding window): one request's
    ``StoreRequestState.block_ids`` names a GPU block twice (a sliding-window position that block left,
    and the position the same request got it back at), its store lists and touches it twice, and when
    the store completes after the request released it, ``free_blocks`` queues it twice."""
    doc = json.loads(REPRO.read_text())
    assert doc["config"]["preset"] == "vllm-cpu-offload-swa" and doc["config"]["sliding_window"] == 8
    out = _replay_on("0.23.0", REPRO)
    assert QUEUED_TWICE in out["signatures"], out
    _one_request_lists_a_block_twice(out)


@pytest.mark.parametrize("version", [pytest.param("0.24.0", marks=pytest.mark.releases),
                                     pytest.param("0.33.0", marks=pytest.mark.vllm)])
def test_42571_duplicate_is_still_listed_but_queued_once_from_0_24_0(version):
    """The same program on 0.24.0 and 0.33.0: the connector still lists the block twice for one request
    (no release de-duplicates the eager store; the fix PRs #42615 and #42903 are open), but
    ``BlockPool.free_blocks`` queues a block when its own decrement reaches 0 (0.24.0's rewrite), so the
    pool stays whole: no finding."""
    out = _replay_on(version, REPRO)
    assert out["signatures"] == [], out
    _one_request_lists_a_block_twice(out)
