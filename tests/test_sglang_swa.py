"""SWA hybrid mode of the real-SGLang target (kvaudit/targets/sglang/swa.py): SGLang 0.5.23's SWAKVPool,
SWATokenToKVPoolAllocator and UnifiedRadixCache with its SWA component, driven on CPU.

* objects come from SGLang's constructors; the SWA pool is a pool of its own in the audit;
* running requests' windows slide (out-of-window slots freed) and the tree evicts SWA, counted by reach;
* the planted fault swa-skip-window-free is found and minimized, and refused off the SWA presets;
* sglang#36458 (a chunked prefill pinning the SWA pool of a chunk cache under overlap) reproduces;
* the swa-window-at-key-end oracle: each inserted key keeps a window of live SWA at its end (SGLang
  0.5.22's shortfall, the history row sglang-swa-evict-page-round, is in test_sglang_releases.py).

Skipped where SGLang 0.5.23 is not installed.
"""

import pytest

from fault_helpers import fuzz_fault, minimized_fault_program
from kvaudit.audit.runner import AuditedRun, execute
from kvaudit.program import FlushCache, Idle, Submit
from kvaudit.targets.sglang.config import SGLANG_PRESETS, SglangConfig
from sglang_helpers import CORES, run_ops

pytestmark = pytest.mark.sglang

SWA = "swa_token_to_kv_pool"


def cfg(preset="sglang-swa", core="rust", **kw):
    return SGLANG_PRESETS[preset].config(tree_core=core, **kw)


# -- config ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw, text", [
    ({"enable_hisparse": True, "num_slots": 256}, "without enable_hisparse"),
    ({"enable_hierarchical_cache": True}, "without enable_hierarchical_cache"),
    ({"sliding_window_size": 128}, "sliding_window_size must be"),
    ({"swa_full_tokens_ratio": 0.0}, "swa_full_tokens_ratio"),
    ({"swa_full_tokens_ratio": 0.01}, "the SWA pool"),
    ({"swa_eviction_interval": 0}, "swa_eviction_interval"),
    ({"swa_chunk_cache": True, "enable_streaming_session": True}, "swa_chunk_cache"),
])
def test_incompatible_swa_settings_are_refused(kw, text):
    with pytest.raises(ValueError, match=text):
        cfg(**kw)


def test_the_swa_presets():
    assert {p for p in SGLANG_PRESETS if p.startswith("sglang-swa")} == {
        "sglang-swa", "sglang-swa-chunked", "sglang-swa-small", "sglang-swa-paged", "sglang-swa-chunkcache",
        "sglang-swa-session", "sglang-swa-unaligned"}
    assert cfg("sglang-swa-paged").page_size > cfg("sglang-swa-paged").sliding_window_size
    un = cfg("sglang-swa-unaligned")  # neither the window nor one past it is a page multiple
    assert 1 < un.page_size < un.sliding_window_size and (un.sliding_window_size + 1) % un.page_size >= 2
    chunked = cfg("sglang-swa-chunked")
    assert chunked.enable_overlap and chunked.chunked_prefill_size == 16
    cc = cfg("sglang-swa-chunkcache")
    assert cc.swa_chunk_cache and cc.enable_overlap and cc.swa_num_slots < 2 * cc.chunked_prefill_size
    assert cfg("sglang-swa-session").enable_streaming_session


def test_swa_fault_and_chunk_cache_need_a_window():
    with pytest.raises(ValueError, match="is for the SWA presets only"):
        SglangConfig(bugs=frozenset({"swa-skip-window-free"}))
    with pytest.raises(ValueError, match="needs sliding_window_size"):
        SglangConfig(swa_chunk_cache=True)
    assert cfg("sglang-swa-chunkcache").disable_radix_cache and not cfg().disable_radix_cache
    assert cfg().swa_num_slots == 128 and cfg("sglang-swa-paged").swa_num_slots % 16 == 0


# -- bootstrap ------------------------------------------------------------------------------------
@pytest.mark.parametrize("core", CORES)
def test_objects_come_from_sglangs_own_constructors(core):
    with AuditedRun(cfg(core=core)) as run:
        t = run.target
        a = t.allocator
        assert [type(f).__name__ for f in t.features] == ["SwaHybrid"]
        assert type(a).__name__ == "SWATokenToKVPoolAllocator" and a.__module__.startswith("sglang.")
        assert type(a.get_kvcache()).__name__ == "SWAKVPool"
        assert (a.size_full, a.size_swa) == (256, 128)
        assert type(t.tree_cache).__name__ == "UnifiedRadixCache" and t.tree_cache.supports_swa()
        assert t.tree_cache.sliding_window_size == 8
        pools = {p.name: p for p in t.pools()}
        assert pools["token_to_kv_pool"].obj is a.full_attn_allocator and pools[SWA].obj is a.swa_attn_allocator
        assert (pools["token_to_kv_pool"].num_units, pools[SWA].num_units) == (256, 128)


# -- the window and the tree ------------------------------------------------------------------------
@pytest.mark.parametrize("core", CORES)
def test_a_long_decode_slides_its_window_and_a_flush_gives_both_pools_back(core):
    findings, run = run_ops(cfg(core=core), [Submit(family=0, prompt_len=4, max_new_tokens=32),
                                             Submit(family=1, prompt_len=40, max_new_tokens=20), Idle()])
    try:
        t = run.target
        assert findings == []
        reached = t.reach()
        assert reached["swa_window_evictions"] > 0 and reached["swa_window_tokens"] > 0
        acc = t.accounting()
        # the tree holds both prompts' full KV but only a window of SWA (the rest is tombstoned)
        assert acc["token_to_kv_pool"].evictable > acc[SWA].evictable > 0
        assert t.engine_check() == []
        assert not run.apply(FlushCache())
        a = t.allocator
        assert (a.full_available_size(), a.swa_available_size()) == (a.size_full, a.size_swa)
    finally:
        run.close()


def test_the_tree_evicts_swa_under_pressure_and_the_small_preset_retracts():
    ops = [Submit(family=i % 4, prompt_len=30 + i, max_new_tokens=30) for i in range(8)] + [Idle()]
    findings, run = run_ops(cfg("sglang-swa-small"), ops)
    try:
        reached = run.target.reach()
        assert findings == [] and reached["swa_tree_evicted"] > 0 and reached["retractions"] > 0
    finally:
        run.close()


def test_one_programs_ledger_digest_is_the_same_in_every_run_on_the_rust_tree_core():
    """SGLang 0.5.23's rust tree core hands an eviction's frees over as a map the binding fills
    (``rust_tree_core/adapter.py``, ``_fill_evict_result``), whose order changes from run to run, and
    ``UnifiedRadixCache._drain_device_frees`` frees the FULL and SWA parts in that order: each pool's frees
    are the same, their interleaving is not. Four runs in one process gave four digests, and ``replay
    --check-determinism`` of a clean program said "NOT deterministic"."""
    ops = [Submit(family=i % 4, prompt_len=30 + i, max_new_tokens=30) for i in range(8)] + [Idle()]
    digests = []
    for _ in range(4):
        findings, run = run_ops(cfg(), ops)
        try:
            assert findings == [] and run.target.reach()["swa_tree_evicted"] > 0  # both pools' frees, one call
            digests.append(run.auditor.digest())
        finally:
            run.close()
    assert len(set(digests)) == 1, digests


# -- the fault --------------------------------------------------------------------------------------
@pytest.mark.slow
def test_fuzz_finds_and_minimizes_the_skipped_window_free(tmp_path):
    doc, path = fuzz_fault(tmp_path, "sglang", "sglang-swa", "swa-skip-window-free")
    (finding,) = doc["findings"]
    assert finding["signature"].startswith(f"leak/{SWA}/"), finding["signature"]
    config, program = minimized_fault_program(path, max_ops=10)
    # SGLang's own hybrid-SWA check sees the lost slots too
    with AuditedRun(config) as run:
        for op in list(program) + [Idle()]:
            run.apply(op)
        assert any(line.startswith("[swa]") for line in run.target.engine_check())


def test_the_window_fault_is_refused_with_a_clear_error_off_the_swa_presets(tmp_path):
    from cli_helpers import invoke
    r = invoke("fuzz", "--target", "sglang", "--preset", "sglang", "--bug", "swa-skip-window-free",
               "--max-time", "5", "--out", str(tmp_path))
    assert r.exit_code == 2 and "SWA presets only" in r.output, r.output


# -- sglang#36458 -----------------------------------------------------------------------------------
def test_sglang_36458_a_chunked_prefill_pins_the_chunk_caches_swa_pool_under_overlap():
    """Chunk 1 (16 tokens) and chunk 2 (the SWA budget less a page: 4) stay pinned while
    ``extend_batch_idx < 2`` (``maybe_evict_swa``'s overlap guard); then ``add_chunked_req`` finds a page
    of SWA room, returns the request unscheduled, and no batch runs ``maybe_evict_swa`` again."""
    program = [Submit(family=0, prompt_len=22, max_new_tokens=1), Idle()]
    ex = execute(cfg("sglang-swa-chunkcache"), program, full_stacks=False)
    assert [(f.kind, f.signature) for f in ex.findings] == [("liveness", "liveness/-/progress/chunked:holds-kv")]
    # without overlap the second chunk evicts the first's out-of-window slots and the prompt finishes
    assert execute(cfg("sglang-swa-chunkcache", enable_overlap=False), program, full_stacks=False).findings == []


# -- the live window at a key's end -----------------------------------------------------------------
UNALIGNED_DECODE = [Submit(family=0, prompt_len=4, max_new_tokens=14),
                    Submit(family=1, prompt_len=9, max_new_tokens=21), Idle()]


@pytest.mark.parametrize("core", CORES)
def test_every_inserted_key_keeps_a_window_of_live_swa_at_its_end(core):
    """0.5.23 keeps ``ceil_align(max(window, page), page)`` tokens: the keys the finished requests insert
    (tombstoned below their window) pass the check, and the tree holds their output past the prompt."""
    findings, run = run_ops(cfg("sglang-swa-unaligned", core=core), UNALIGNED_DECODE)
    try:
        reached = run.target.reach()
        assert findings == [] and reached["swa_window_evictions"] > 0 and reached["swa_keys_window_checked"] >= 2
        assert run.target.accounting()["token_to_kv_pool"].evictable >= 32  # 16 + 28 tokens, page-floored
    finally:
        run.close()


def test_an_eviction_that_keeps_less_than_the_trees_window_is_found(monkeypatch):
    """The oracle can fail: SGLang's own window eviction, told a window 3 tokens short of the one the tree
    matches by (the class of 0.5.22's page rounding), leaves keys whose end the tree's match refuses: the
    check names it at the first such insert (the prefill's checkpoint)."""
    from kvaudit.targets.sglang.boot import load

    load()  # (SGLang's import shims)
    from sglang.srt.mem_cache.unified_cache.components import swa as swa_component

    evict = swa_component.free_swa_out_of_window_slots

    def short(req, pre_len, *, sliding_window_size, **k):
        return evict(req, pre_len, sliding_window_size=sliding_window_size - 3, **k)

    monkeypatch.setattr(swa_component, "free_swa_out_of_window_slots", short)
    ex = execute(cfg("sglang-swa-unaligned"), UNALIGNED_DECODE, full_stacks=False)
    sigs = {f.signature for f in ex.findings}
    assert any(s.startswith(f"unmatchable-prefix/{SWA}/") and s.endswith("/check:swa-window-at-key-end")
               for s in sigs), sigs
    assert "fewer than the 6-token window" in ex.findings[0].message
