"""The real-SGLang target: SGLang 0.5.23's own allocators, request pool, UnifiedRadixCache (both tree
cores) and streaming sessions, driven on CPU (issue 8).

* injected faults through the wrappers are caught on the real code;
* the event sequences of the memory model's section 7.2 run clean, and take the path they name;
* the hazards of its Appendix A, as programs, with what kvaudit sees.

Skipped, with the install command, where SGLang is not installed.
"""

import json
import os
import re

import pytest


from cli_helpers import invoke, reached
from kvaudit import replay
from kvaudit.program import (Abort, CloseSession, ContinueGeneration, FlushCache, HealthCheck, Idle,
                             MemoryPressure, OpenSession, PauseGeneration, Step, Submit)
from sglang_helpers import CORES, kinds, run_ops
from fault_helpers import assert_names_both_tree_counters, first_finding_within
from kvaudit.audit.runner import AuditedRun, execute
from kvaudit.targets.sglang.config import SGLANG_PRESETS

pytestmark = pytest.mark.sglang



def cfg(preset="sglang", core="rust", **kw):
    return SGLANG_PRESETS[preset].config(tree_core=core, **kw)


# -- bootstrap ------------------------------------------------------------------------------------
@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("preset", list(SGLANG_PRESETS))
def test_objects_come_from_sglangs_own_factory(preset, core):
    with AuditedRun(cfg(preset, core)) as run:
        t = run.target
        assert type(t.tree_cache).__name__ == "UnifiedRadixCache"
        assert t.tree_core == ("RustUnifiedTreeCore" if core == "rust" else "UnifiedTreeCore")
        want = "TokenToKVPoolAllocator" if t.config.page_size == 1 else "PagedTokenToKVPoolAllocator"
        if t.config.enable_hisparse:  # tests/test_sglang_hisparse.py checks its objects
            want = "HiSparseTokenToKVPoolAllocator"
        if t.config.sliding_window_size is not None:  # tests/test_sglang_swa.py checks its objects
            want = "SWATokenToKVPoolAllocator"
        assert type(t.allocator).__name__ == want
        assert t.allocator.need_sort is t.config.need_sort
        assert t.allocator.__module__.startswith("sglang.")  # SGLang's code, not a copy


def test_engine_files_are_the_driver_modules_and_the_hooks_module():
    """Frames in ``engine_files`` are sites like SGLang's own: every module that plays SGLang's
    scheduler, and the hooks' module (it shared the driver's file before the split; see
    ``SglangTarget.engine_files`` and test_sglang_hicache's flush test)."""
    import inspect
    from kvaudit.targets.sglang import driver, hooks, intake, observer, standins, target
    with AuditedRun(cfg()) as run:
        files = {os.path.abspath(f) for f in run.target.engine_files()}
    assert files == {os.path.abspath(m.__file__) for m in (driver, intake, standins, hooks)}
    for name, member in vars(driver.SglangDriver).items() | vars(intake.SglangIntake).items():
        fn = getattr(member, "fget", member)
        if inspect.isfunction(fn):
            assert os.path.abspath(inspect.getsourcefile(fn)) in files, name
    assert os.path.abspath(observer.__file__) not in files and os.path.abspath(target.__file__) not in files


def test_every_seam_row_names_a_feature_hook_and_the_shared_method_it_combines_with():
    """``target.SEAMS`` makes ``SglangTarget``'s combining methods by one rule: a row naming a hook no
    feature defines, or a shared method that does not exist, would fail only when the path runs."""
    from kvaudit.targets.sglang.feature import SglangFeature, SglangLoop
    from kvaudit.targets.sglang.target import SEAMS, SglangTarget
    shared = super(SglangTarget, SglangTarget)
    for method, hook, how in SEAMS:
        assert callable(getattr(SglangLoop if how == "loop" else SglangFeature, hook, None)), (method, hook)
        assert getattr(SglangTarget, method).__qualname__ == f"SglangTarget.{method}"
        assert how == "each" or callable(getattr(shared, method, None)), (method, how)
    assert len({m for m, _, _ in SEAMS}) == len(SEAMS)


@pytest.mark.parametrize("preset", ["sglang", "sglang-paged"])
def test_prefill_and_decode_allocations_are_the_requests_kv(preset):
    """SGLang's ``alloc_for_extend`` and ``alloc_for_decode`` allocate through ``alloc_req_slots`` and
    ``alloc_token_slots`` (page 1) or the paged ``_extend`` / ``_decode`` helpers: every row and slot
    allocation of a request that prefills and decodes is flagged ``request_kv`` (one role in a
    signature, ``SglangObserver.request_kv_allocs``), under whichever helper allocated it."""
    with AuditedRun(cfg(preset)) as run:
        run.apply(Submit(0, 14, 6))  # decode crosses a 16-token page
        run.apply(Idle())
        aud = run.auditor
        sites = [aud.site(e.site)[0] for e in aud.events if e.kind == "alloc"
                 and e.pool in ("token_to_kv_pool", "req_to_token_pool")]
    assert sites and all(s.request_kv for s in sites), {(s.function, s.request_kv) for s in sites}
    want = ({"alloc_req_slots", "alloc_token_slots"} if preset == "sglang" else
            {"alloc_req_slots", "alloc_paged_token_slots_extend", "alloc_paged_token_slots_decode"})
    assert {s.function for s in sites} == want


def test_a_check_reads_the_live_requests_and_the_counters_once(monkeypatch):
    """Inside ``checking()`` (one oracle check: the engine does not move) the roots, the engine's own check
    and the metrics walk the live requests once, read the counters once and the queues' place groups once
    (the roots' places), with the same answers as outside it; after it, every read is fresh again (a step
    moves the engine). Composed features too: the PD decode loop's ``active`` and ``place_groups`` are
    feature hooks."""
    from kvaudit.targets.sglang.driver import SglangDriver
    from kvaudit.targets.sglang.observer import SglangObserver

    calls = {"active": 0, "accounting": 0, "places": 0}

    def counted(cls, name, key):
        orig = getattr(cls, name)

        def wrapper(self, *a, **k):
            calls[key] += 1
            return orig(self, *a, **k)
        monkeypatch.setattr(cls, name, wrapper)

    counted(SglangDriver, "_active", "active")
    counted(SglangObserver, "accounting", "accounting")
    counted(SglangObserver, "_place_groups", "places")
    for preset in ("sglang", "sglang-pd-decode"):
        with AuditedRun(SGLANG_PRESETS[preset].config()) as run:
            run.apply(Submit(0, 14, 6))
            run.apply(Step(2))
            t = run.target

            def reads():
                return ([(r.owner, r.units.tolist(), r.where) for r in t.roots()], t.engine_check(),
                        t.metrics_check(), t.accounting(), t.lock_holders())
            calls.update(active=0, accounting=0, places=0)
            outside = reads()
            assert calls["active"] >= 3 and calls["accounting"] == 2 and calls["places"] == 1, (preset, calls)
            calls.update(active=0, accounting=0, places=0)
            with t.checking():
                inside = reads()
                assert t._active() == t._active() and t._active() is not t._active()  # (a copy each)
                assert t._place_groups() == t._place_groups()
            assert calls == {"active": 1, "accounting": 1, "places": 1}, (preset, calls)
            assert inside == outside and any(where for _, _, where in outside[0]), preset
            t._active(), t.accounting(), t._place_groups()
            assert calls == {"active": 2, "accounting": 2, "places": 2}, (preset, calls)


# -- injected faults (must show) ------------------------------------------------------------------
@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("preset", ["sglang", "sglang-paged"])
def test_skipped_release_is_a_leak_at_an_sglang_site(preset, core):
    findings, run = run_ops(cfg(preset, core, bugs=frozenset({"skip-release"})), [Submit(0, 20, 3), Idle()])
    run.close()
    assert ("leak", "req_to_token_pool") in kinds(findings)
    kv = [f for f in findings if f.kind == "leak" and f.pool == "token_to_kv_pool"]
    assert kv and all(f.indirect for f in kv)  # reachable only from the leaked row
    row = next(f for f in findings if f.pool == "req_to_token_pool")
    assert "sglang/srt/mem_cache" in row.alloc_sites[0].file.replace("\\", "/")
    assert row.alloc_sites[0].function in ("alloc_req_slots", "alloc")


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("preset", ["sglang", "sglang-paged"])
def test_second_free_is_a_double_free_sglang_accepts_silently(preset, core):
    # the second request's KV duplicates the tree's, so its release frees slots: the fault frees them again
    ops = [Submit(0, 20, 2), Idle(), Submit(0, 20, 2), Idle()]
    findings, run = run_ops(cfg(preset, core, bugs=frozenset({"double-free"})), ops)
    free = run.target.allocator.get_all_free_pages()
    run.close()
    df = [f for f in findings if f.kind == "double-free"]
    assert df, findings
    assert df[0].free_sites and df[0].prev_free_sites  # both frees, with their sites
    # the second free is the driver's (the fault): located in the driver, never in a harness frame
    assert df[0].free_sites[-1].file.replace("\\", "/").endswith("kvaudit/targets/sglang/driver.py") \
        or "sglang/srt/" in df[0].free_sites[0].file.replace("\\", "/")
    assert free.unique().numel() < free.numel()  # SGLang took the page back twice, without a word


@pytest.mark.parametrize("core", CORES)
def test_lock_never_released_is_a_lock_imbalance(core):
    findings, run = run_ops(cfg("sglang", core, bugs=frozenset({"lock-leak"})), [Submit(0, 20, 3), Idle()])
    run.close()
    assert [f.kind for f in findings] == ["lock-imbalance"]
    assert "0 live holder" in findings[0].message


def _misbook_new_leaves(core, monkeypatch):
    """Plant the fault: tokens the tree adds as a new leaf are booked as protected instead of evictable.
    Python core: in ``UnifiedTreeCore._add_new_node`` itself. Rust core (its counters live in Rust): the
    adapter's ``evictable_size``/``protected_size`` move every token an insert added and never move it back."""
    from kvaudit.targets.sglang.boot import load
    load()
    if core == "python":
        from sglang.srt.mem_cache.unified_cache.unified_tree_core import BASE_COMPONENT_TYPE, UnifiedTreeCore
        add = UnifiedTreeCore._add_new_node

        def misbooking_add(self, *a, **k):
            node = add(self, *a, **k)
            n = self.components_by_type[BASE_COMPONENT_TYPE].reclaimable_value_len(node)
            self.component_evictable_size_[BASE_COMPONENT_TYPE] -= n
            self.component_protected_size_[BASE_COMPONENT_TYPE] += n
            return node

        monkeypatch.setattr(UnifiedTreeCore, "_add_new_node", misbooking_add)
        return
    from sglang.srt.mem_cache.rust_tree_core.adapter import RustUnifiedTreeCore
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
    insert, evictable, protected = UnifiedRadixCache.insert, RustUnifiedTreeCore.evictable_size, \
        RustUnifiedTreeCore.protected_size

    def misbooking_insert(self, params):
        before = evictable(self.tree_core)
        out = insert(self, params)
        self.tree_core.misbooked = getattr(self.tree_core, "misbooked", 0) + evictable(self.tree_core) - before
        return out

    monkeypatch.setattr(UnifiedRadixCache, "insert", misbooking_insert)
    monkeypatch.setattr(RustUnifiedTreeCore, "evictable_size", lambda self: evictable(self) - getattr(self, "misbooked", 0))
    monkeypatch.setattr(RustUnifiedTreeCore, "protected_size", lambda self: protected(self) + getattr(self, "misbooked", 0))


@pytest.mark.parametrize("core", CORES)
def test_a_leaf_booked_as_protected_is_accounting_drift_naming_the_counter(core, monkeypatch):
    """Issue 16 item 1 on real SGLang: the identity balances, each term recounted from the tree does not."""
    _misbook_new_leaves(core, monkeypatch)
    assert_names_both_tree_counters(first_finding_within(cfg("sglang", core)).findings[0])


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("preset", ["sglang", "sglang-paged"])
def test_the_tree_caching_past_kv_committed_len_is_reported_at_the_insert(preset, core, monkeypatch):
    """Issue 16 item 8 on real SGLang: a checkpoint that caches one position past ``kv_committed_len``."""
    from kvaudit.targets.sglang.boot import load
    load()
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
    checkpoint = UnifiedRadixCache.checkpoint
    monkeypatch.setattr(UnifiedRadixCache, "checkpoint",
                        lambda self, req, *, up_to, **k: checkpoint(self, req, up_to=up_to + cfg(preset).page_size, **k))
    findings, run = run_ops(cfg(preset, core), [Submit(0, 45, 3), Idle()])  # 48 tokens: 3 pages of 16
    run.close()
    f = findings[0]
    assert (f.kind, f.pool) == ("accounting-drift", "token_to_kv_pool"), f.summary()
    assert "tokens of req:" in f.message and "past its committed KV" in f.message
    inserted, committed = (int(f.message.split(w)[1].split()[0].rstrip(":")) for w in ("caches ", "kv_committed_len="))
    assert inserted > committed
    assert f.alloc_sites[0].function == "checkpoint_into_tree"


# -- section 7.2 event sequences, clean --------------------------------------------------------------
SEQUENCES = {
    "new request": [Submit(0, 20, 4), Idle()],
    "shared prefix, whole pages": [Submit(1, 40, 2), Idle(), Submit(1, 44, 3), Idle()],
    "shared prefix, partial page": [Submit(1, 21, 2), Idle(), Submit(1, 27, 3), Idle()],
    "identical prompt": [Submit(2, 30, 2), Idle(), Submit(2, 30, 2), Submit(2, 30, 2), Idle()],
    "extends an earlier request": [Submit(0, 20, 4), Step(3), Submit(1, 5, 3, extends=0), Idle()],
    "max_new_tokens 1 and EOS at the first token": [Submit(0, 9, 1), Submit(1, 9, 8, stop_at=1), Idle()],
    "health check idle, then busy": [HealthCheck(), Idle(), Submit(0, 20, 8), Step(1), HealthCheck(), Idle()],
    "abort waiting, running, unknown and all": [Submit(0, 20, 8), Step(2), Submit(1, 20, 8), Abort(1), Abort(0),
                                               Abort(7), Step(2), Submit(2, 9, 9), Step(2), Abort(None), Idle()],
    "flush idle, and refused while busy": [Submit(0, 20, 2), Idle(), FlushCache(), Step(1), Submit(0, 20, 9),
                                          Step(1), FlushCache(), Idle()],
    "memory pressure retracts": [Submit(0, 20, 20), Submit(1, 20, 20), Step(3), MemoryPressure(), Step(2), Idle()],
    # a session's history outgrows the context: the turn is aborted at intake (validate_input_length)
    # longer than sglang-chunked's 16-token chunk: PrefillAdder chunks it (the others prefill it whole)
    "prompt longer than the chunk size": [Submit(0, 60, 4), Submit(1, 20, 3), Step(2), Submit(2, 50, 2), Idle()],
    "abort a parked chunked prefill": [Submit(0, 60, 8), Step(2), Abort(0), Step(1), Submit(1, 60, 3), Idle()],
    "over-long session turn": [OpenSession(), Submit(0, 48, 12, session=0), Idle(), Submit(1, 48, 1, session=0),
                               Idle(), Submit(2, 40, 3, session=0), Idle()],
    # pause_generation / continue_generation, each mode (a weight update's pause)
    "pause in place, then continue": [Submit(0, 20, 8), Step(2), PauseGeneration(1), Step(3), Submit(1, 9, 3),
                                      HealthCheck(), Abort(0), Step(2), ContinueGeneration(), Idle()],
    "pause retract, flush while paused, continue": [Submit(0, 20, 8), Submit(1, 12, 6), Step(3), PauseGeneration(2),
                                                    FlushCache(), Submit(2, 5, 3), Step(2), ContinueGeneration(),
                                                    Idle()],
    "pause abort mode": [Submit(0, 20, 8), Submit(1, 5, 4), Step(2), PauseGeneration(0), Submit(3, 4, 2), Step(2),
                         Idle()],
    "idle resumes a paused engine": [Submit(0, 20, 8), Step(1), PauseGeneration(2), Idle(), Submit(1, 20, 4),
                                     Step(1), PauseGeneration(1), Idle()],
    "ignore_eos runs past EOS": [Submit(0, 8, 10, stop_at=2, ignore_eos=1), Submit(0, 8, 10, stop_at=2), Idle()],
    # ignored without priority scheduling (SGLang's default); sglang-priority orders and preempts by them
    "flush waits for idle, or times out": [Submit(0, 20, 4), Step(1), FlushCache(timeout=10), Step(6),
                                           Submit(1, 20, 30), Step(1), FlushCache(timeout=2), Step(4), Idle()],
    "grammar queue, with an abort in it": [Submit(0, 20, 4, grammar=3), Submit(1, 10, 4, grammar=5), Submit(2, 9, 3),
                                           Step(2), Abort(1), FlushCache(), Step(1), Idle()],
    "priorities": [Submit(0, 20, 30, priority=1), Submit(1, 20, 30, priority=1), Submit(2, 20, 30, priority=1),
                   Step(3), Submit(3, 10, 4, priority=9), Submit(4, 10, 4, priority=0), Step(3), Idle()],
}


# sglang-swa-chunkcache deadlocks on every prompt over two chunks: corpus finding 11 (sglang#36458)
@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("preset", [p for p in SGLANG_PRESETS if p != "sglang-swa-chunkcache"])
@pytest.mark.parametrize("name", list(SEQUENCES))
def test_event_sequence_runs_clean(name, preset, core):
    ex = execute(cfg(preset, core), SEQUENCES[name])
    assert ex.findings == [], [f.message for f in ex.findings]


def test_sequences_take_the_paths_they_name():
    def ran(ops, **kw):
        findings, run = run_ops(cfg(**kw), ops)
        assert findings == []
        return run.target

    t = ran(SEQUENCES["shared prefix, whole pages"], preset="sglang-paged")
    assert t.tree_cache.evictable_size() >= 32  # both prompts' pages were published and shared
    t = ran(SEQUENCES["memory pressure retracts"])
    assert t.retractions == 1 and t.reach()["retractions"] == 1  # printed beside a clean run as reached:
    assert "retracted 1 request(s)" in t.retraction() and "stopped: forced by memory pressure" in t.retraction()
    t = ran(SEQUENCES["flush idle, and refused while busy"])
    assert t.flushed() == 1  # the second flush came while busy: refused
    t = ran(SEQUENCES["health check idle, then busy"])
    assert [r for r in t.submitted if r.startswith("HEALTH_CHECK_")] == ["HEALTH_CHECK_0"]
    t = ran(SEQUENCES["prompt longer than the chunk size"][:3], preset="sglang-chunked")
    assert t.chunked_req is not None and t.chunked_req.extend_end == 32  # two 16-token chunks so far
    assert t.tree_cache.protected_size() == 16  # the first chunk, stashed into the tree and locked
    # a small pool and optimistic admission: decode runs out and SGLang's retract_decode picks victims
    t = ran([Submit(i, 30, 30) for i in range(6)] + [Idle()], num_slots=160, new_token_ratio=0.0)
    assert t.retractions >= 1
    assert any(w in t.retraction() for w in ("stopped: check_decode_mem passes", "stopped: one request left"))
    t = ran(SEQUENCES["pause retract, flush while paused, continue"])
    assert t.retractions == 2 and t.flushed() == 1 and t.submitted == ["r0", "r1", "r2"]
    t = ran(SEQUENCES["flush waits for idle, or times out"][:4])
    assert t.flushed() == 1 and t.flush_wrapper._pending is None  # the first waited until r0 finished
    t = ran(SEQUENCES["flush waits for idle, or times out"][:-1])
    assert t.flushed() == 1 and t.flush_wrapper._pending is None and t.running  # the second timed out
    t = ran(SEQUENCES["idle resumes a paused engine"])
    assert not t.paused and t.retractions == 1 and t.is_idle()


def record_releases(t) -> dict:
    """rid -> (output tokens, finish reason type, its message, its HTTP status, prompt tokens) at each
    ``release_kv_cache``."""
    out = {}
    release = t._release

    def wrapper(req, checkpoint):
        r = req.finished_reason
        out[req.rid] = (len(req.output_ids), type(r).__name__, getattr(r, "message", None),
                        getattr(r, "status_code", None), len(req.origin_input_ids))
        return release(req, checkpoint)

    t._release = wrapper
    return out


@pytest.mark.parametrize("core", CORES)
def test_pause_in_place_freezes_the_scheduler_and_holds_new_requests(core):
    findings, run = run_ops(cfg(core=core), [Submit(0, 20, 8), Step(2)])
    t = run.target
    free, out = t.allocator.available_size(), len(t.running[0].output_ids)
    for op in [PauseGeneration(1), Step(3), Submit(1, 9, 3), HealthCheck(), Abort(0), Step(2)]:
        assert run.apply(op) == []
    assert t.allocator.available_size() == free and len(t.running[0].output_ids) == out  # nothing ran
    assert t.running[0].to_finish is not None  # the abort reached the scheduler; it ends at the next result
    assert [kind for kind, _ in t.held] == ["submit", "health_check"] and t.submitted == ["r0"]
    assert run.apply(ContinueGeneration()) == [] and t.held is None and t.submitted == ["r0", "r1"]
    assert run.apply(Idle()) == [] and set(t.finished) >= {"r0", "r1"}
    run.close()


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("preset", ["sglang", "sglang-overlap", "sglang-chunked"])
def test_pause_retract_releases_everything_in_flight_so_flush_succeeds(preset, core):
    findings, run = run_ops(cfg(preset, core), [Submit(0, 40, 8), Submit(1, 12, 6), Step(2)])
    t = run.target
    assert t.allocator.available_size() < t.allocator.size
    inflight = {r.rid for r in t._inflight()}  # chunked: r0 between chunks, r1 still waiting
    assert inflight >= {"r0"}
    assert run.apply(PauseGeneration(2)) == []
    assert t.running == [] and t.chunked_req is None and len(t.waiting) == 2 and t.retractions == len(inflight)
    assert all(not r.kv.holds_kv and r.lock is None for r in t.waiting)
    assert t.allocator.available_size() + t.tree_cache.evictable_size() == t.allocator.size
    assert t.tree_cache.protected_size() == 0
    assert run.apply(FlushCache()) == [] and t.flushed() == 1  # waiting requests do not count while paused
    assert t.allocator.available_size() == t.allocator.size
    out = record_releases(t)
    for op in [ContinueGeneration(), Idle()]:
        assert run.apply(op) == []
    assert {rid: v[0] for rid, v in out.items()} == {"r0": 8, "r1": 6}  # re-prefilled, then finished
    run.close()


@pytest.mark.parametrize("core", CORES)
def test_flush_while_paused_in_place_is_refused(core):
    findings, run = run_ops(cfg(core=core), [Submit(0, 20, 8), Step(2), PauseGeneration(1), FlushCache()])
    assert findings == [] and run.target.flushed() == 0  # the running batch still holds its KV
    run.close()


@pytest.mark.parametrize("core", CORES)
def test_a_held_submit_keeps_the_prompt_its_client_sent(core):
    """The client builds an ``extends`` prompt when it sends it: r0's text then (10 prompt + 2 output
    tokens), not at delivery after continue, when r0 has long been aborted."""
    ops = [Submit(0, 10, 8), Step(2), PauseGeneration(0), Submit(1, 3, 2, extends=0), Step(3), ContinueGeneration()]
    findings, run = run_ops(cfg(core=core), ops)
    assert findings == [] and [(r.rid, len(r.origin_input_ids)) for r in run.target.waiting] == [("r1", 15)]
    run.close()


@pytest.mark.parametrize("core", CORES)
def test_pause_abort_mode_aborts_everything_and_runs_what_came_after_continue(core):
    findings, run = run_ops(cfg(core=core), [Submit(0, 20, 8), Submit(1, 5, 4), Step(2)])
    t = run.target
    out = record_releases(t)
    for op in [PauseGeneration(0), Submit(3, 4, 2), Step(2)]:
        assert run.apply(op) == []
    assert t.submitted == ["r0", "r1"] and not t.scheduler_paused  # the scheduler runs; the tokenizer holds
    assert {rid: v[1] for rid, v in out.items()} == {"r0": "FINISH_ABORT", "r1": "FINISH_ABORT"}
    assert run.apply(Idle()) == []
    assert out["r2"][:2] == (2, "FINISH_LENGTH")
    run.close()


@pytest.mark.parametrize("core", CORES)
def test_ignore_eos_runs_to_max_new_tokens(core):
    findings, run = run_ops(cfg(core=core), [])
    out = record_releases(run.target)
    for op in SEQUENCES["ignore_eos runs past EOS"]:
        assert run.apply(op) == []
    assert out["r0"][:2] == (10, "FINISH_LENGTH") and out["r1"][:2] == (2, "FINISH_MATCHED_TOKEN")
    run.close()


@pytest.mark.parametrize("core", CORES)
def test_a_higher_priority_request_preempts_a_running_one(core):
    findings, run = run_ops(cfg("sglang-priority", core), SEQUENCES["priorities"][:5])
    t = run.target
    assert findings == [] and t.retractions == 0 and [r.rid for r in t.running] == ["r0", "r1", "r2"]
    for op in SEQUENCES["priorities"][5:7]:
        assert run.apply(op) == []
    # priority 9 preempted one priority-1 request (preempt_to_schedule -> release_req); priority 0 waits
    assert t.retractions == 1 and "r3" in [r.rid for r in t.running]
    assert sorted((r.rid, r.priority) for r in t.waiting)[-1] == ("r4", 0)
    preempted = [r for r in t.waiting if r.priority == 1]
    assert len(preempted) == 1 and not preempted[0].kv.holds_kv and preempted[0].output_ids
    assert run.apply(Idle()) == []
    run.close()


@pytest.mark.parametrize("core", CORES)
def test_a_full_queue_aborts_the_least_preferred_request(core):
    findings, run = run_ops(cfg("sglang-priority", core), [Submit(i, 20, 30, priority=i % 3) for i in range(9)])
    t = run.target
    assert findings == [] and len(t.waiting) == 4  # max_queued_requests
    assert sorted(t.finished) == ["r0", "r3", "r4", "r6", "r7"]  # priorities 0, 0, 1, 0, 1
    assert run.apply(Idle()) == []
    run.close()


@pytest.mark.parametrize("core", CORES)
def test_preempted_requests_rejoin_the_queue_after_the_admitted_ones_leave_it(core):
    """``_get_new_batch_prefill_raw`` takes the admitted requests out of the waiting queue, then re-queues
    the preempted ones: with room for them, the queue limit (4) aborts none of them."""
    ops = [Submit(i, 20, 30, priority=0) for i in range(3)] + [Step(2)]
    ops += [Submit(3 + i, 10, 4, priority=9) for i in range(4)] + [Step(1)]
    findings, run = run_ops(cfg("sglang-priority", core), ops)
    t = run.target
    assert findings == [] and t.retractions == 3 and t.finished == set()
    assert [r.rid for r in t.running] == ["r3", "r4", "r5"]
    assert sorted(r.rid for r in t.waiting) == ["r0", "r1", "r2", "r6"]
    assert run.apply(Idle()) == []
    run.close()


@pytest.mark.parametrize("core", CORES)
def test_the_running_timeout_counts_from_the_first_admission(core):
    """``forward_entry_time`` is set once: a prompt chunked 8 tokens at a time (a new admission each
    chunk) is still aborted 3 steps after its first chunk, through ``process_pending_chunked_abort``."""
    c = cfg("sglang-priority", core, chunked_prefill_size=8, request_running_timeout_steps=3)
    findings, run = run_ops(c, [Submit(0, 60, 4), Step(6)])
    t = run.target
    assert findings == [] and t.finished == {"r0"} and t.chunked_req is None  # 60 tokens need 8 chunks
    assert run.apply(Idle()) == [] and t.allocator.available_size() + t.tree_cache.evictable_size() == t.allocator.size
    run.close()


@pytest.mark.parametrize("core", CORES)
def test_a_turn_create_req_rejects_still_goes_through_the_grammar_queue(core):
    """Only a gone session or a bad length skip the grammar in ``handle_generate_request``: a turn
    ``create_req`` rejected (a turn in flight) carries ``to_finish`` and waits for its grammar too."""
    ops = [OpenSession(), Submit(0, 10, 4, session=0), Submit(1, 5, 3, session=0, grammar=3)]
    findings, run = run_ops(cfg("sglang-session", core), ops)
    t = run.target
    assert findings == [] and [r.rid for r in t.waiting] == ["r0"]
    assert [(r.rid, r.to_finish is not None) for r in t.grammar_manager.grammar_queue] == [("r1", True)]
    assert run.apply(Idle()) == []
    run.close()


@pytest.mark.parametrize("core", CORES)
def test_timeout_aborts_carry_a_503_and_release_normally(core):
    findings, run = run_ops(cfg("sglang-priority", core), [])
    t = run.target
    out = record_releases(t)
    for op in [Submit(i, 20, 40) for i in range(4)] + [Step(14)]:
        assert run.apply(op) == []
    assert "r3" in t.finished and "r3" not in out  # waited 13 steps: aborted in the queue, it held nothing
    assert run.apply(Idle()) == []
    assert {v[2:4] for v in out.values()} == {("Request running timeout reached.", 503)}
    assert all(v[0] < 40 for v in out.values()) and len(out) == 3
    run.close()


@pytest.mark.parametrize("core", CORES)
def test_grammar_queue_holds_requests_until_their_grammar_compiles_and_an_abort_there_costs_one_prefill(core):
    """SGLang's own ``GrammarManager`` (over kvaudit's step-clock grammar backend): a request with a
    grammar waits in the grammar queue, holding nothing, until its compile ends; the server is not idle
    meanwhile (flush refused). An abort there (``abort_requests``: ``set_finish_with_abort`` replaces the
    prompt by one token and drops the grammar) lets it leave at the next poll; it runs one cheap prefill
    and is released, as SGLang's comment says."""
    findings, run = run_ops(cfg(core=core), [])
    t = run.target
    out = record_releases(t)
    for op in SEQUENCES["grammar queue, with an abort in it"][:4]:
        assert run.apply(op) == []
    gm = t.grammar_manager
    assert [r.rid for r in gm.grammar_queue] == ["r0", "r1"] and [r.rid for r in t.running] == ["r2"]
    assert all(not r.kv.holds_kv for r in gm.grammar_queue) and t.live_rids() == ["r0", "r1", "r2"]
    assert t.describe_busy().startswith("waiting=0 running=1 grammar=2 ")  # a hang's line counts them
    assert run.apply(Abort(1)) == [] and gm.grammar_queue[1].to_finish is not None
    assert run.apply(FlushCache()) == [] and t.flushed() == 0  # the grammar queue is not idle
    assert run.apply(Step(1)) == [] and gm.grammar_queue == []  # r0 compiled at step 3; r1 left, aborted
    assert out["r1"][:2] == (1, "FINISH_ABORT")  # its one-token prefill ran and released it
    assert run.apply(Idle()) == []
    assert out["r0"][:2] == (4, "FINISH_LENGTH") and out["r2"][:2] == (3, "FINISH_LENGTH")
    run.close()


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("core", CORES)
def test_mixed_chunk_decodes_running_requests_inside_prefill_batches(core, overlap):
    """``--enable-mixed-chunk``: while r1's 40-token prompt is prefilled in 16-token chunks, the running
    r0 decodes inside those prefill batches (``mix_with_running``: ``decoding_reqs``), is not
    checkpointed there, and an abort reaching it in a mixed batch ends it like any other."""
    findings, run = run_ops(cfg("sglang-mixed", core, enable_overlap=overlap), [Submit(0, 20, 30), Step(3)])
    t = run.target
    r0 = t.running[0]
    out = len(r0.output_ids)
    batches = []
    process = t._process

    def spy(kind, reqs, chunked=None, decoding=()):
        batches.append((kind, [r.rid for r in reqs], [r.rid for r in decoding]))
        return process(kind, reqs, chunked, decoding)

    t._process = spy
    for op in [Submit(1, 40, 4), Step(3)]:
        assert run.apply(op) == []
    mixed = [b for b in batches if b[0] == "extend" and b[2] == ["r0"]]
    assert len(mixed) >= 2 and all(b[1] == ["r1", "r0"] for b in mixed)
    assert len(r0.output_ids) >= out + 2  # it decoded while r1 prefilled
    assert r0.prefix_len <= 20 + 1  # a decode row of a mixed batch is not checkpointed
    assert run.apply(Abort(0)) == [] and r0.to_finish is not None
    out = record_releases(t)
    assert run.apply(Idle()) == []
    assert out["r0"][1] == "FINISH_ABORT" and out["r1"][:2] == (4, "FINISH_LENGTH")
    run.close()


SESSION_EDITS = [OpenSession(), Submit(0, 10, 3, session=0), Idle(), Submit(1, 5, 3, session=0), Idle(),
                 Submit(2, 4, 2, session=0, parent=0, replace=1), Idle(),
                 Submit(3, 4, 2, session=0, parent=0, drop_previous_output=1), Idle(),
                 Submit(4, 4, 2, session=0, parent=1, offset=6), Idle()]


@pytest.mark.parametrize("core", CORES)
def test_streaming_sessions_reject_every_session_edit(core):
    findings, run = run_ops(cfg("sglang-session", core), [])
    out = record_releases(run.target)
    for op in SESSION_EDITS:
        assert run.apply(op) == []
    assert {rid: v[2] for rid, v in out.items() if v[1] == "FINISH_ABORT"} == {
        "r2": "Streaming sessions do not support replace.",
        "r3": "Streaming sessions do not support drop_previous_output.",
        "r4": "Streaming sessions do not support offset."}
    run.close()


@pytest.mark.parametrize("core", CORES)
def test_non_streaming_session_turns_branch_from_the_turn_they_name(core):
    """``SessionParams.rid`` (``parent``) picks the branch point: no parent, no history; ``replace``
    continues from the parent's context; ``drop_previous_output`` leaves its output out; ``offset``
    cuts its context there. Prompt lengths: r0 10 (+3 out), r1 5 (+3), r2 13+4, r3 10+4, r4 6+4."""
    findings, run = run_ops(cfg("sglang-session", core, session_streaming=False), [])
    out = record_releases(run.target)
    for op in SESSION_EDITS:
        assert run.apply(op) == []
    assert {rid: v[1] for rid, v in out.items()} == {f"r{i}": "FINISH_LENGTH" for i in range(5)}
    assert {rid: v[4] for rid, v in out.items()} == {"r0": 10, "r1": 5, "r2": 17, "r3": 14, "r4": 10}
    run.close()


@pytest.mark.parametrize("streaming", [True, False], ids=["streaming", "non-streaming"])
def test_reach_counts_the_turns_sent_into_a_session(streaming):
    """The session presets exist for session turns, but reach() counted none: `kvaudit fuzz --target sglang
    --preset sglang-session-nonstreaming` ended with a `reached:` line of retractions, evictions and result
    batches only (the pre-0.5.23 target's counted `session_turns`). A turn sent into an open session counts;
    a plain request, and a turn sent once its session closed (handled as a plain request), do not."""
    ops = [OpenSession(), Submit(0, 12, 3, session=0), Idle(), Submit(1, 5, 3, session=0), Idle(), Submit(2, 6, 2),
           Idle(), CloseSession(0), Submit(3, 4, 2, session=0), Idle()]
    findings, run = run_ops(cfg("sglang-session", session_streaming=streaming), ops)
    assert findings == [] and run.target.reach()["session_turns"] == 2, run.target.reach()
    run.close()


@pytest.mark.parametrize("core", CORES)
def test_session_turns_close_idle_and_deferred(core):
    c = cfg("sglang-session", core)
    # append after the previous turn finished, then close idle: the slot's KV is released at once
    findings, run = run_ops(c, [OpenSession(), Submit(0, 12, 3, session=0), Idle(), Submit(1, 5, 3, session=0),
                                Idle()])
    t = run.target
    assert findings == [] and len(t._slots()) == 1
    run.apply(CloseSession(0))
    assert run.findings == [] and t._slots() == []
    run.close()
    # close while the turn runs: deferred until the turn finishes (SessionController.maybe_reap)
    findings, run = run_ops(c, [OpenSession(), Submit(0, 12, 9, session=0), Step(2), CloseSession(0)])
    t = run.target
    assert findings == [] and len(t._slots()) == 1 and t.running
    run.apply(Idle())
    assert run.findings == [] and t._slots() == []
    run.close()
    # an aborted turn hands the record back and is released like any request
    ex = execute(c, [OpenSession(), Submit(0, 12, 3, session=0), Idle(), Submit(1, 5, 9, session=0), Step(2),
                     Abort(0), Idle(), Submit(2, 4, 2, session=0), Idle(), CloseSession(0), Idle()])
    assert ex.findings == []


@pytest.mark.parametrize("core", CORES)
def test_non_streaming_session_keeps_history_in_the_tree(core):
    """A non-streaming session (OpenSessionReqInput(streaming=False)): each turn's history is a
    SessionReqNode and its KV goes through the radix cache, no SessionSlot."""
    findings, run = run_ops(cfg("sglang-session", core, session_streaming=False),
                            [OpenSession(), Submit(0, 12, 3, session=0), Idle(), Submit(1, 5, 3, session=0), Idle()])
    t = run.target
    session = t.session_controller.get("s0")
    assert findings == [] and not session.streaming and len(session.req_nodes) == 2 and t._slots() == []
    assert t.tree_cache.evictable_size() >= 12 + 3 + 5  # both turns' text cached in the tree
    run.apply(CloseSession(0))
    run.apply(Idle())
    assert run.findings == []
    run.close()


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("streaming", [True, False])
def test_session_timeout_reaps_the_session_and_a_later_turn_is_refused(core, streaming):
    """A session idle past its timeout (3 s: three steps) is closed by maybe_reap, its slot released; a
    turn sent to it afterwards is a plain request aborted at intake (handle_generate_request: "session
    id ... does not exist"). A streaming turn still running when the timeout passes defers the close
    (close_on_finish) until it finishes."""
    c = cfg("sglang-session", core, session_streaming=streaming, session_timeout_steps=3)
    findings, run = run_ops(c, [OpenSession(), Submit(0, 12, 9, session=0), Step(5)])
    t = run.target
    # timed out mid-turn: a streaming session's close is deferred (close_on_finish) while the turn runs on
    # its record; a non-streaming one closes at once (the running turn owns its KV itself)
    assert findings == [] and [r.rid for r in t.running] == ["r0"]
    session = t.session_controller.get("s0")
    assert session.close_on_finish if streaming else session is None
    run.apply(Idle())
    assert findings == [] and "s0" not in t.session_controller  # reaped once idle past the timeout
    assert t._slots() == []
    run.apply(Submit(1, 5, 3, session=0))
    late = t.waiting[-1]
    assert late.session is None and "does not exist" in late.to_finish.message
    run.apply(Idle())
    assert run.findings == []
    assert t.allocator.available_size() + t.tree_cache.evictable_size() == t.allocator.size
    run.close()


# -- Appendix A hazards ---------------------------------------------------------------------------------
@pytest.mark.parametrize("core", CORES)
def test_hazard_a1_rejected_turn_clears_inflight_then_a_third_turn_shares_the_record(core):
    """A.1: a turn rejected because one is in flight reaches matching, where find_active_slot calls
    Session.abort_req() and clears _inflight; a third turn is then accepted and borrows the record the
    running turn is extending. Both decode on one ReqKvInfo, each at its own sequence length: the row's
    entries are overwritten and kv_allocated_len counts positions nobody filled (slot 0, the padding)."""
    ops = [OpenSession(), Submit(0, 1, 5, session=0), Step(1), Submit(0, 1, 1, session=0), Step(1),
           Submit(0, 4, 7, session=0), Idle()]
    findings, run = run_ops(cfg("sglang-session", core), ops)
    t = run.target
    shared = [r for r in t.running if r.kv is t._slots()[0][1].kv]
    run.close()
    assert len(shared) == 2  # two running requests on the session's one record
    f = findings[0]
    assert (f.kind, f.pool) == ("aliasing", "token_to_kv_pool") and "reserved unit 0" in f.message
    assert f.alloc_sites[0].function == "alloc_token_slots"


@pytest.mark.parametrize("core", CORES)
def test_hazard_a1_rejected_turn_in_the_first_turns_batch_crashes_take(core):
    """A.1, no slot yet: the rejected turn's own 1-token allocation goes through StreamingSession.take in
    the same prefill batch as the first turn, and take() asserts: the scheduler would crash."""
    ex = execute(cfg("sglang-session", core), [OpenSession(), Submit(0, 1, 1, session=0),
                                               Submit(0, 1, 1, session=0), Idle()])
    assert [f.kind for f in ex.findings] == ["crash"]
    assert "already has a slot" in ex.findings[0].message
    assert ex.findings[0].alloc_sites[0].function == "take"


@pytest.mark.parametrize("core", CORES)
def test_hazard_a2_retracted_turn_keeps_the_record_and_a_new_turn_shares_it(core):
    """A.2: retract_decode -> release_kv_cache -> try_cache_finished_req keeps the retracted turn's
    record in the slot and clears _inflight; a new turn is accepted while the retracted one is queued,
    and both run on one record: KV leaks."""
    ops = [Submit(1, 8, 20), Step(3), OpenSession(), Submit(0, 12, 20, session=0), Step(2), MemoryPressure(),
           Step(1), Submit(0, 4, 3, session=0), Step(1), Idle()]
    findings, run = run_ops(cfg("sglang-session", core), ops)
    assert run.target.retractions == 1
    run.close()
    assert ("leak", "token_to_kv_pool") in kinds(findings)


@pytest.mark.parametrize("core", CORES)
def test_hazard_a6_overlap_allocates_decode_for_a_finished_request_and_release_frees_it(core, monkeypatch):
    """A.6, overlap one-step lag: a request that samples EOS in batch N still gets a decode slot in
    batch N+1 (its result is not in yet), one slot more than without overlap; release_kv_cache counts
    it in owned_kv_len and frees or caches it with the rest. An abort whose request's result is queued
    ends the request there. Both clean."""
    from kvaudit.targets.sglang.boot import load

    common = load().common  # SGLang's mem_cache/common.py (imported behind the stubs)
    seen = []
    real = common._release_overallocated_kv_indices

    def spy(req, owned, allocated, tree_cache):
        seen.append((owned, allocated))
        return real(req, owned, allocated, tree_cache)

    monkeypatch.setattr(common, "_release_overallocated_kv_indices", spy)
    ops = [Submit(0, 20, 8, stop_at=2), Submit(1, 9, 8), Idle()]
    ex = execute(cfg("sglang-overlap", core), ops)
    assert ex.findings == []
    overlap_first = seen[0]
    seen.clear()
    assert execute(cfg("sglang-overlap", core, enable_overlap=False), ops).findings == []
    plain_first = seen[0]
    assert overlap_first[1] == plain_first[1] + 1  # the lag's decode slot for the EOS position
    assert overlap_first[0] <= overlap_first[1]
    # an abort that lands while the request's batch is in flight (its result queued)
    ex = execute(cfg("sglang-overlap", core), [Submit(0, 20, 8), Step(1), Abort(0), Step(1), Abort(None), Idle()])
    assert ex.findings == []


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("core", CORES)
def test_hazard_a6_chunked_abort_while_its_chunk_is_in_flight(core, overlap, monkeypatch):
    """A.6, chunked: abort_request only marks the chunked request; process_pending_chunked_abort tears
    it down at the top of the next step (prepare_abort, release_kv_cache(checkpoint=False)). Under
    overlap its last chunk is still in flight then: that chunk's result comes in after the release and
    only counts down inflight_middle_chunks. Clean; the stashed first chunk stays in the tree."""
    from kvaudit.targets.sglang.boot import load

    common = load().common
    real, seen = common.release_kv_cache, []
    findings, run = run_ops(cfg("sglang-chunked", core, enable_overlap=overlap), [Submit(0, 60, 8), Step(2)])
    t = run.target
    req = t.chunked_req
    assert findings == [] and req is not None and req.extend_end == 32

    def spy(r, cache, *, checkpoint):
        seen.append((r.rid, checkpoint, t._last is not None and t._last[2] is r, r.inflight_middle_chunks))
        return real(r, cache, checkpoint=checkpoint)

    monkeypatch.setattr(common, "release_kv_cache", spy)
    run.apply(Abort(0))
    assert t._pending_chunked_abort is req and req.kv.holds_kv  # only marked: torn down at the next step
    run.apply(Step(1))
    assert seen == [("r0", False, overlap, int(overlap))]  # released with its chunk in flight (overlap)
    assert t.chunked_req is None and req.finished() and not req.kv.holds_kv
    assert req.inflight_middle_chunks == 0 and list(req.output_ids) == []  # the result drained, sampled nothing
    run.apply(Idle())
    assert run.findings == []
    assert t.allocator.available_size() + t.tree_cache.evictable_size() == t.allocator.size
    assert t.tree_cache.evictable_size() == 16  # the stashed first chunk
    run.close()


@pytest.mark.parametrize("core", CORES)
def test_overlap_keeps_a_request_finished_at_its_prefill_result_out_of_the_session_guard(core):
    """Under overlap a request that finishes at its prefill result stays in the running list until a
    decode filters it; with sessions on, the driver's guard for a running turn whose record was
    released must not take that finished, released request for one (it froze the engine: a false
    liveness finding, found by a breaker pass)."""
    ex = execute(cfg("sglang-overlap", core, enable_streaming_session=True),
                 [Submit(0, 8, 1), Step(1), Submit(1, 8, 4), Idle()])
    assert ex.findings == []


@pytest.mark.parametrize("core", CORES)
def test_chunked_request_stays_out_of_the_running_batch_between_chunks(core):
    """get_next_batch_to_run excludes the chunked request from the last batch's merge (overlap): it
    joins the running batch only after its last chunk."""
    findings, run = run_ops(cfg("sglang-chunked", core), [Submit(0, 60, 4)])
    t = run.target
    chunks = []
    while t.chunked_req is not None or not chunks:
        run.apply(Step(1))
        chunks.append(t.chunked_req is not None)
        if t.chunked_req is not None:
            assert all(r is not t.chunked_req for r in t.running)
    assert chunks.count(True) == 3  # 60 tokens in 16-token chunks: three middle chunks, then the last
    run.apply(Step(1))
    assert [r.rid for r in t.running] == ["r0"]
    run.apply(Idle())
    assert run.findings == []
    run.close()


def test_hazard_a5_identity_inside_a_free_group_sees_missing_slots():
    """A.5: inside a free group (result processing) SGLang's identity is short by the frees not yet
    applied; kvaudit records group frees at free_group_end and checks only at step boundaries."""
    findings, run = run_ops(cfg(), [Submit(0, 20, 2), Step(2), Submit(0, 24, 8), Step(3)])
    t = run.target
    req = t.running[0]
    t.allocator.free_group_begin()
    t.S.common.release_kv_cache(req, t.tree_cache, checkpoint=False)
    t.running.remove(req)
    t.finished.add(req.rid)
    inside = t.engine_check()
    t.allocator.free_group_end()
    after = t.engine_check()
    assert findings == []
    assert inside and "!= total" in inside[0]
    assert after == []
    run.apply(Idle())
    assert run.findings == []
    run.close()


def test_hazard_a7_flush_drops_session_kv_and_the_next_turn_reprefills():
    """A.7: flush_cache is allowed with a session holding KV (idle ignores sessions): the tree reset
    drops the slot, and the next turn prefills its whole history again. Memory stays consistent."""
    findings, run = run_ops(cfg("sglang-session"), [OpenSession(), Submit(0, 8, 2, session=0), Idle(),
                                                    FlushCache(), Step(1)])
    t = run.target
    assert findings == [] and t.flushed() == 1 and t._slots() == []
    run.apply(Submit(0, 4, 2, session=0))
    run.apply(Idle())
    assert run.findings == []
    (sid, slot), = t._slots()
    assert slot.kv.cache_protected_len == 14  # 8 prompt + 2 output + 4 new: all prefilled again
    run.close()


# -- corpora/sglang: every finding kept there still reproduces -------------------------------------------
CORPUS = os.path.join(os.path.dirname(__file__), "..", "corpora", "sglang")


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("name", sorted(n for n in os.listdir(CORPUS) if n.endswith(".json")))
def test_every_sglang_finding_reproduces(name, core):
    config, program, recorded, _ = replay.load(os.path.join(CORPUS, name))
    assert config.target == "sglang"
    ex = execute(config.replace(tree_core=core), program)
    assert recorded[0].signature in ex.signatures
    assert ex.ops_run == len(program)  # minimized: the finding comes at the last op


def test_every_sglang_finding_has_a_written_analysis():
    notes = open(os.path.join(CORPUS, "README.md")).read()
    names = sorted(n for n in os.listdir(CORPUS) if n.endswith(".json"))
    assert names
    for name in names:
        assert f"`{name}`" in notes, name


# -- CLI -------------------------------------------------------------------------------------------------
def test_cli_fuzz_finds_an_injected_leak_and_replays_it(tmp_path):
    out = tmp_path / "out"
    r = invoke("fuzz", "--target", "sglang", "--preset", "sglang-paged", "--tree-core", "python", "--bug",
               "skip-release", "--max-time", "30", "--seed", "1", "--out", str(out))
    assert r.exit_code == 1, r.output
    assert "leak" in r.stdout
    files = list(out.glob("*.json"))
    assert len(files) == 1
    doc = json.loads(files[0].read_text())
    assert doc["config"]["target"] == "sglang" and doc["config"]["tree_core"] == "python"
    assert "sglang/srt" in json.dumps(doc["findings"][0]["alloc_sites"])
    r = invoke("replay", str(files[0]), "--check-determinism")
    assert r.exit_code == 1, r.output


def test_cli_replays_a_corpus_file_with_the_other_tree_core(tmp_path):
    path = os.path.join(CORPUS, "uaf-deferred-close-after-rejected-turn.json")
    r = invoke("replay", path, "--tree-core", "python")
    assert r.exit_code == 1, r.output
    assert "use-after-free" in r.stdout
    bad = invoke("replay", os.path.join(os.path.dirname(__file__), "..", "corpora", "regressions",
                                        "session-tail-not-trimmed.json"), "--tree-core", "python")
    assert bad.exit_code == 2 and "--tree-core applies to replay files of --target sglang only" in bad.stderr


def test_report_header_names_the_tree_core_and_what_differs_from_the_preset():
    from kvaudit.reports.report import header

    plain = cfg("sglang-pd-decode", "python")
    assert header(plain) == ("kvaudit report: target sglang, preset sglang-pd-decode, python tree core, bugs: none, "
                             "page_size 4")
    small = cfg("sglang-pd-decode", "rust", num_slots=32, page_size=1)
    assert "preset sglang-pd-decode (modified: num_slots=32, page_size=1), rust tree core" in header(small)


@pytest.mark.parametrize("preset", ["sglang", "sglang-pd-decode"])
def test_an_abort_matches_rids_by_prefix_as_sglang_does(preset):
    """abort_request matches req.rid.startswith(rid): aborting r1 also ends r10 and r11, wherever they
    are (waiting or running); the others are untouched. Clean."""
    findings, run = run_ops(cfg(preset), [Submit(i % 3, 10, 20) for i in range(12)] + [Step(2)])
    t = run.target
    reqs = {r.rid: r for r in t._active()}
    assert findings == [] and {"r1", "r10", "r11"} <= set(reqs)
    run.apply(Abort(t.live_rids().index("r1")))
    run.apply(Idle())
    aborted = sorted(rid for rid, r in reqs.items() if type(r.finished_reason).__name__ == "FINISH_ABORT"
                     or r.rid in t.finished and len(r.output_ids) < 20)
    assert aborted == ["r1", "r10", "r11"]
    assert run.findings == []
    run.close()


def test_a_run_on_real_sglang_has_no_vllm_import_noise_on_stderr(tmp_path):
    """SGLang imports vLLM, whose CPU-only platform probe logged 'Failed to import from vllm._C' on
    every run's stderr; kvaudit quiets that one logger (a level the user set stays)."""
    import subprocess

    from cli_helpers import kvaudit_script, plain_env

    r = subprocess.run([kvaudit_script(), "fuzz", "--target", "sglang", "--max-time", "0.5", "--out", str(tmp_path)],
                       capture_output=True, text=True, env=plain_env(), timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stderr.startswith("kvaudit fuzz: target sglang") and "vllm._C" not in r.stderr, r.stderr
    # start-up (the import: seconds) is said, and not taken from the search budget (issue 34)
    assert re.search(r"^start-up \S+ \(imports, the first engine; not counted\): searching for 0\.5s$", r.stderr,
                     re.M), r.stderr
    assert re.search(r"^no findings: [1-9]\d* executions", r.stdout, re.M), r.stdout


def test_a_crash_traceback_shows_engine_frames_with_portable_paths():
    """A crash's stored traceback keeps the engine's frames and the driver's (it plays the scheduler),
    not kvaudit's runner or hooks, whose line numbers move with kvaudit's code, and no machine's
    site-packages path: the replay file's text changes only when the engine's code does."""
    import re as re_

    path = os.path.join(os.path.dirname(__file__), "..", "corpora", "sglang",
                        "crash-take-rejected-turn-in-first-batch.json")
    config, program, _, _ = replay.load(path)
    (crash,) = [f for f in execute(config, program).findings if f.kind == "crash"]
    files = re_.findall(r'File "([^"]+)", line \d+', crash.traceback)
    assert files and files[-1] == "sglang/srt/session/streaming_session.py", files
    assert not any(os.path.isabs(f) or f.startswith("kvaudit/audit/") for f in files), files
    assert any(f.startswith("kvaudit/targets/sglang/") for f in files)  # the driver's frames stay
    assert crash.traceback.rstrip().endswith("AssertionError: session_id='s0' already has a slot")


@pytest.mark.parametrize("preset, tree", [("sglang", True), ("sglang-hisparse", False), ("sglang-pd-decode", False),
                                          ("sglang-swa-chunkcache", False)])
def test_evictions_for_alloc_are_counted_only_with_a_tree(preset, tree):
    """With the radix cache off (sglang-hisparse, sglang-pd-decode, sglang-swa-chunkcache) nothing is ever
    evictable, yet every clean run printed `evictions_for_alloc=0` and `not reached: evictions_for_alloc (... not
    searched)`, a path no search could take there. The counter is given only with a tree."""
    with AuditedRun(SGLANG_PRESETS[preset].config()) as run:
        assert run.apply(Submit(0, 8, 2)) == [] and run.apply(Idle()) == []
        assert bool(run.target.tree_cache.disable) is not tree
        assert ("evictions_for_alloc" in run.target.reach()) is tree, run.target.reach()


@pytest.mark.parametrize("preset", ["sglang-evict-tlru", "sglang-evict-priority", "sglang-evict-slru"])
def test_an_eviction_policy_reaches_sglangs_tree_and_its_allocations_evict(preset):
    """--radix-eviction-policy(-config) is what SGLang's tree runs with (the Python core's strategy object,
    and the published ServerArgs both cores read), and the preset's small pool makes allocations evict part
    of the tree, where the policy picks: seeded random programs reach evictions_for_alloc, audited clean."""
    import random

    from kvaudit.program import random_program

    config = SGLANG_PRESETS[preset].config(tree_core="python")
    run = AuditedRun(config)
    try:
        from sglang.srt.runtime_context import get_memory  # after the target's boot installed its stubs

        strategy = run.target.tree_cache.tree_core.eviction_strategy
        assert type(strategy).__name__.lower() == config.radix_eviction_policy + "strategy"
        assert get_memory().radix_eviction_policy == config.radix_eviction_policy
        rng = random.Random(1)
        for _ in range(12):
            program = random_program(rng, 24, features=config.program_features)
            for op in program:
                assert not run.apply(op), run.findings
            if run.target.reach()["evictions_for_alloc"]:
                break
            run.close()
            run = AuditedRun(config)
        assert run.target.reach()["evictions_for_alloc"] > 0
    finally:
        run.close()


def test_sglang_0_5_23_never_checkpoints_an_unresolved_dllm_block():
    """Why #35270 (the radix tree owning two nodes for one dLLM block's pages, which kills the scheduler at
    idle) is unreachable in 0.5.23 (corpora/sglang/README.md): its trigger is a checkpoint of the in-flight
    denoise block, whose ids change every step. 0.5.23's SchedulerDllmMixin.finish_dllm_forward returns before
    stash_chunked_request while a first-done-first-out block is unresolved (dllm_incomplete_ids), and
    stashes (checkpoints) once it is resolved. SGLang's own method, bound to a stand-in scheduler: a release
    that drops the guard fails here."""
    from array import array
    from types import SimpleNamespace

    from kvaudit.targets.sglang.boot import load

    load()
    from sglang.srt.dllm.mixin.scheduler import SchedulerDllmMixin

    stashed = []
    for fdfo in (True, False):
        sched = SimpleNamespace(dllm_config=SimpleNamespace(first_done_first_out_mode=fdfo,
                                                            requires_separate_context_encoding=False),
                                stash_chunked_request=stashed.append)
        for incomplete in (array("q", [5, 6, 7, 8]), array("q")):
            req = SimpleNamespace(rid=(fdfo, len(incomplete)), dllm_incomplete_ids=incomplete,
                                  is_dllm_prefill=lambda: False)
            SchedulerDllmMixin.finish_dllm_forward(sched, req)
    assert [r.rid for r in stashed] == [(True, 0), (False, 4), (False, 0)]


def test_a_clean_priority_fuzz_run_counts_its_priority_preemptions(tmp_path):
    """sglang-priority exists to reach preempt_to_schedule: its preemptions were only inside ``retractions``
    (with decode retractions), so a run that never preempted read the same. A preset without priority
    scheduling does not name the path."""
    counts = {}
    for preset in ("sglang-priority", "sglang"):
        r = invoke("fuzz", "--target", "sglang", "--preset", preset, "--fuzzer", "random", "--max-time", "2",
                   "--seed", "1", "--out", str(tmp_path))
        assert r.exit_code == 0, r.output
        counts[preset] = reached(r.stdout)
    assert 0 < counts["sglang-priority"]["priority_preemptions"] <= counts["sglang-priority"]["retractions"], counts
    assert "priority_preemptions" not in counts["sglang"], counts


def _sglang_reach(preset: str, ops) -> dict[str, int]:
    with AuditedRun(SGLANG_PRESETS[preset].config()) as run:
        for op in ops:
            assert run.apply(op) == [], run.findings
        return run.target.reach()


@pytest.mark.parametrize("preset, path, reaches, cannot", [
    # 40 tokens in 16-token chunks park as chunked_req twice; 8 tokens fit one chunk
    ("sglang-chunked", "chunks_parked", [Submit(0, 40, 2), Idle()], [Submit(0, 8, 2), Idle()]),
    # a request decoding when a second one's prefill runs; one request alone never mixes
    ("sglang-mixed", "mixed_batches", [Submit(0, 8, 8), Step(2), Submit(1, 8, 2), Idle()], [Submit(0, 8, 8), Idle()]),
    # the lagged result finishes the request; one aborted while waiting never ran in a batch
    ("sglang-overlap", "deferred_finishes", [Submit(0, 8, 3), Idle()], [Submit(0, 8, 3), Abort(0), Idle()]),
    # sglang-evict-priority runs 3 at most: a fourth request with a priority past the threshold (10) over the
    # running ones' (none given) preempts; one with none waits
    ("sglang-evict-priority", "priority_preemptions",
     [Submit(i, 8, 12) for i in range(3)] + [Step(2), Submit(3, 8, 2, priority=9), Idle()],
     [Submit(i, 8, 12) for i in range(3)] + [Step(2), Submit(3, 8, 2), Idle()]),
], ids=["chunked", "mixed", "overlap", "evict-priority"])
def test_a_scheduling_path_is_counted_where_a_program_takes_it_and_not_where_it_cannot(preset, path, reaches, cannot):
    """SGLang's chunked prefill, mixed chunk and overlap scheduling had no counter: a clean `kvaudit fuzz --preset
    sglang-mixed` printed `reached: aborts_processed=..., retractions=..., sglang_result_batches=...` whether or not
    a request ever parked between chunks, decoded inside a prefill batch or was finished by a lagged result. Each
    is counted now: 0 on a program that cannot take the path, more on one that does. sglang-evict-priority ran 8
    requests, so no random program of 500 met a full batch and preempted (priority_preemptions=0); it runs 3 now."""
    assert _sglang_reach(preset, cannot)[path] == 0
    assert _sglang_reach(preset, reaches)[path] > 0


def test_pd_prefill_chunks_are_counted_by_its_own_counter_only():
    """PD prefill sends its chunks through its own processor (prefill_chunks_sent): chunks_parked stayed 0 there,
    a path no search could take."""
    counts = _sglang_reach("sglang-pd-prefill-chunked", [Submit(0, 40, 2), Idle()])
    assert "chunks_parked" not in counts and "prefill_chunks_sent" in counts, counts
