"""Tests for kvaudit.audit.memstate: an out-of-memory crash reports who held the memory at that moment."""

import re

import pytest
from rich.console import Console

from kvaudit.targets.eut.presets import get_preset
from kvaudit.audit.findings import Finding
from kvaudit.program import Idle, Step, Submit
from kvaudit.reports.report import finding_renderable
from kvaudit.audit.runner import AuditedRun


def _render(f) -> str:
    console = Console(width=200, record=True, file=open("/dev/null", "w"))
    console.print(finding_renderable(f, None))
    return console.export_text()


def test_a_prefill_out_of_memory_names_the_terms_the_largest_holder_and_the_orphan_lock():
    """Eviction that frees nothing (a planted fault) while admission counts evictable tokens: the
    engine raises "Prefill out of memory". A lock nobody holds pins another prefix."""
    run = AuditedRun(get_preset("default").config(num_slots=128))
    eng = run.target.engine
    tree = eng.tree_cache
    for op in [Submit(family=0, prompt_len=30, max_new_tokens=2), Idle(),
               Submit(family=1, prompt_len=50, max_new_tokens=2), Idle()]:
        assert run.apply(op) == []
    pinned = max((n for n in tree.nodes() if n is not tree.root_node), key=lambda n: len(n.key))
    tree.inc_lock_ref(pinned)  # taken here, held by nobody
    tree.evict = lambda num_tokens: 0
    assert run.apply(Submit(family=2, prompt_len=60, max_new_tokens=1)) == []
    (f,) = run.apply(Step(1))
    assert f.kind == "crash" and "Prefill out of memory" in f.message
    a = eng.token_to_kv_pool_allocator
    terms = next(x for x in f.memory_state if x.startswith("token_to_kv_pool:"))
    assert (f"available={a.available_size()} evictable={tree.evictable_size()} protected={tree.protected_size()} "
            "session_held=0 uncached=0") in terms
    assert any(x.startswith(f"largest holders of token_to_kv_pool: tree {tree.total_size()} tokens")
               for x in f.memory_state)
    orphan = next(x for x in f.memory_state if x.startswith("locked with no live holder"))
    assert f"{len(pinned.key)} tokens on node {pinned.id}" in orphan
    assert "test_a_prefill_out_of_memory_names_the_terms" in orphan  # where the lock was taken
    text = _render(f)
    assert "memory at the crash:" in text and "largest holders of token_to_kv_pool" in text
    back = Finding.from_dict(f.to_dict())
    assert back.memory_state == f.memory_state
    from kvaudit.reports.junit import failure_text
    from kvaudit.reports.sarif import to_sarif
    assert to_sarif([f])["runs"][0]["results"][0]["properties"]["memory_state"] == f.memory_state
    assert "memory at the crash:\n    token_to_kv_pool: available=" in failure_text(f)


def test_a_decode_out_of_memory_says_what_retraction_freed_and_why_it_stopped():
    run = AuditedRun(get_preset("retract").config())
    eng = run.target.engine
    eng.tree_cache.evict = lambda num_tokens: 0  # retraction counts on evictable tokens it cannot get
    for i in range(4):
        assert run.apply(Submit(family=i, prompt_len=20, max_new_tokens=60)) == []
    (f,) = run.apply(Step(300))
    assert f.kind == "crash" and "Decode out of memory" in f.message
    assert eng.num_retractions >= 1
    (line,) = [x for x in f.memory_state if x.startswith("last retraction:")]
    assert "retracted 1 request(s)" in line and "stopped: one decode step fits" in line
    holders = next(x for x in f.memory_state if x.startswith("largest holders of token_to_kv_pool:"))
    assert "req:req-000000" in holders


def test_other_crashes_carry_no_memory_state(monkeypatch):
    run = AuditedRun(get_preset("default").config())

    def boom():
        raise RuntimeError("something else")

    monkeypatch.setattr(run.target.engine, "get_next_batch_to_run", boom)
    assert run.apply(Submit(family=0, prompt_len=8)) == []
    (f,) = run.apply(Step(1))
    assert f.kind == "crash" and f.memory_state == []
    assert "memory at the crash" not in _render(f)


def test_memory_state_in_a_replay_file_is_read_and_checked():
    d = {"kind": "crash", "pool": "-", "message": "x"}
    assert Finding.from_dict({**d, "memory_state": ["a", "b"]}).memory_state == ["a", "b"]
    with pytest.raises(ValueError, match=re.escape("memory_state: want a list of strings, got [3]")):
        Finding.from_dict({**d, "memory_state": [3]})
