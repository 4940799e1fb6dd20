"""Hybrid and Mamba caching on vLLM 0.33.0 (issue 36): a ``MambaSpec`` group beside full attention in align
mode, block hashes finer than the block (``prefix_match_unit``), so a cache hit inside a block copies it
(copy-on-write); the path counters; the in-flight copy check; the planted fault ``free-cow-source-before-copy``
found, minimized and clean without the fault. Skipped where vLLM is not installed."""

from __future__ import annotations

import re

import pytest

from fault_helpers import fuzz_fault, minimized_fault_program
from kvaudit.audit.runner import AuditedRun
from kvaudit.program import Idle, Step, Submit
from kvaudit.targets import registry

pytestmark = pytest.mark.vllm


def cfg(preset, **kw):
    return registry.get("vllm").preset(preset).config(**kw)


def test_mamba_fields_are_validated():
    with pytest.raises(ValueError, match="prefix_match_unit"):
        cfg("vllm", prefix_match_unit=4)  # without a Mamba group
    with pytest.raises(ValueError, match="prefix_match_unit"):
        cfg("vllm-mamba", prefix_match_unit=16)  # not below block_size
    with pytest.raises(ValueError, match="mamba and sliding_window"):
        cfg("vllm-mamba", sliding_window=32)
    with pytest.raises(ValueError, match="mamba needs level scheduler"):
        cfg("vllm-manager", mamba=True, max_model_len=64)


@pytest.mark.parametrize("preset, prompt", [("vllm-mamba", 41), ("vllm-mamba-async", 41),
                                            ("vllm-mamba-cpu-offload", 43)])  # the prompt's tail ends mid-block
def test_a_hit_inside_a_block_copies_it_and_the_oracles_stay_clean(preset, prompt):
    """vLLM builds the groups as a hybrid model's engine core does (hashes every 4 tokens, the scheduler's
    block 16); a second request of the first's family hits its cached prefix inside a block, and the hit's
    block is copied into a block of its own (``mamba_cow_hits``); with a KV consumer on the AsyncScheduler
    the copy's blocks wait behind the step's fence (``cow_frees_deferred``); with SimpleCPUOffloadConnector
    the Mamba manager's boundary states are offered to it (``mamba_boundary_offloads``). No finding on the
    way."""
    config = cfg(preset)
    with AuditedRun(config, full_stacks=False) as run:
        t = run.target
        assert (t.scheduler.hash_block_size, t.scheduler.block_size) == (config.prefix_match_unit, config.block_size)
        assert [type(m).__name__ for m in t.groups] == ["FullAttentionManager", "MambaManager"]
        assert t.scheduler.defer_block_free == config.async_scheduling
        assert t.reach()["mamba_cow_hits"] == 0
        for op in [Submit(0, prompt, 2, stop_at=2), Step(8), Submit(0, 60, 2, stop_at=2), Step(8), Idle()]:
            assert run.apply(op) == []
    reach = t.reach()
    assert reach["mamba_cow_hits"] >= 1 and reach["stale_reads_checked"] > 0
    assert reach.get("mamba_boundary_offloads", 0) > 0 and reach.get("cow_frees_deferred", 0) > 0 \
        or preset != "vllm-mamba-async"
    assert reach.get("mamba_boundary_offloads", 0) > 0 or preset != "vllm-mamba-cpu-offload"


@pytest.mark.parametrize("preset", ["vllm-mamba", "vllm-mamba-small"])
def test_a_preset_with_no_connector_counts_no_offload_and_no_fence(preset):
    """vllm-mamba-small (the AsyncScheduler, no KV connector) said ``cow_frees_deferred=0`` and
    ``mamba_boundary_offloads=30673``: the first a path its scheduler cannot take (no ``defer_block_free``
    without a KV consumer), the second states ``schedule()`` drops with no connector to offer them to. Neither
    is counted now; the copy-on-write hits are."""
    with AuditedRun(cfg(preset), full_stacks=False) as run:
        t = run.target
        for op in [Submit(0, 41, 2, stop_at=2), Step(8), Submit(0, 60, 2, stop_at=2), Step(8), Idle()]:
            assert run.apply(op) == []
    reach = t.reach()
    assert "mamba_boundary_offloads" not in reach and "cow_frees_deferred" not in reach, reach
    assert reach["mamba_cow_hits"] >= 1 or preset != "vllm-mamba", reach


SPEC_ASYNC = [Submit(0, 41, 8, stop_at=6), Step(8), Submit(0, 60, 8, stop_at=6), Submit(1, 200, 8, stop_at=7),
              Submit(2, 30, 20, stop_at=19), Step(12), Idle()]  # a hit inside a block; a prompt of two chunks
SPEC_SMALL = [Submit(f, 20, 16, ignore_eos=1) for f in range(3)] + [Step(40), Idle()]  # 3 x 36 tokens in 19 blocks


@pytest.mark.parametrize("preset, program, reached", [
    ("vllm-mamba-spec-async", SPEC_ASYNC, ["kv_loads_done", "cow_frees_deferred", "mamba_cow_hits"]),
    ("vllm-mamba-spec-small", SPEC_SMALL, ["preemptions_in_flight"])])
def test_the_mamba_spec_presets_boot_and_reach_their_paths(preset, program, reached):
    """th67's two combinations as presets: vllm-mamba-async with 4 drafts (a KV consumer's loads and the
    copy-on-write fence beside speculative state blocks) and vllm-mamba-small with 4 drafts at max_model_len 40
    (Mamba preemption with drafts and a step in flight, which no other preset reaches). Each boots with 4
    speculative state blocks a request, accepts and rejects drafts, relocates speculative blocks (a step past
    a block: ``mamba_spec_relocations``) and reaches its own path, with no finding."""
    with AuditedRun(cfg(preset), full_stacks=False) as run:
        t = run.target
        mgr = next(m for m in t.groups if type(m).__name__ == "MambaManager")
        assert mgr.num_speculative_blocks == 4 and t.scheduler.defer_block_free == (preset == "vllm-mamba-spec-async")
        for op in program:
            assert run.apply(op) == []
    reach = t.reach()
    assert reach["accepted_draft_tokens"] > 0 and reach["rejected_draft_tokens"] > 0, reach
    assert reach["mamba_spec_relocations"] > 0 and all(reach[k] > 0 for k in reached), reach


def test_relocations_are_counted_with_drafts_only_and_mamba_small_with_drafts_needs_a_short_context():
    with AuditedRun(cfg("vllm-mamba"), full_stacks=False) as run:
        assert "mamba_spec_relocations" not in run.target.reach()
    with pytest.raises(ValueError, match="may need 21 blocks, more than the pool's 19"):
        cfg("vllm-mamba-spec-small", max_model_len=60)


def test_planted_early_cow_free_is_found_minimized_and_clean_without_the_fault(tmp_path):
    doc, path = fuzz_fault(tmp_path, "vllm", "vllm-mamba-async", "free-cow-source-before-copy", max_time="10")
    assert doc["findings"][0]["signature"].endswith("check:cow-inflight")
    minimized_fault_program(path, max_ops=3)  # minimized: one request whose prompt ends inside a block


def test_the_mamba_presets_are_listed_and_built_on_0_33_0_only(monkeypatch):
    from kvaudit.targets.vllm import boot, kind
    config = cfg("vllm-mamba")
    monkeypatch.setattr(boot, "installed_version", lambda: "0.30.0")
    assert not [n for n in kind._presets() if "mamba" in n]
    with pytest.raises(boot.VllmUnavailable, match=re.escape('mamba presets are driven on vLLM >= 0.33.0 (compat "mamba-align-cow"), not 0.30.0')):
        boot.check_config(config)
    monkeypatch.setattr(boot, "installed_version", lambda: "0.33.0")
    assert [n for n in kind._presets() if "mamba" in n] == ["vllm-mamba", "vllm-mamba-async", "vllm-mamba-small",
                                                            "vllm-mamba-spec", "vllm-mamba-spec-async",
                                                            "vllm-mamba-spec-small", "vllm-mamba-cpu-offload"]
