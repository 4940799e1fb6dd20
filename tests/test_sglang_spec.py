"""Speculative decoding (spec v2) in the real-SGLang target (kvaudit/targets/sglang/spec.py): SGLang 0.5.23's
eagle_prepare_for_decode / alloc_for_spec_decode reserve each decode step's draft KV, its own result processor
commits the stand-in verify's accepted runs, release_kv_cache frees the reserved-but-uncommitted tail.

* the spec presets boot and run clean, with every path counter above 0;
* the spec-draft-kv oracle fires on a hand-made uncommitted reservation (a tail freed under its row, a tail
  lost at release) and stays quiet on clean runs;
* the planted fault spec-leak-rejected-draft is found and minimized, and refused off the spec presets.

Skipped where SGLang 0.5.23 is not installed.
"""

import pytest

from kvaudit.audit.runner import AuditedRun
from kvaudit.program import Idle, OpenSession, Submit
from kvaudit.targets.sglang.config import SGLANG_PRESETS, SglangConfig
from sglang_helpers import run_ops

pytestmark = pytest.mark.sglang

SPEC_PRESETS = ["sglang-spec-eagle", "sglang-spec-eagle-paged", "sglang-spec-ngram", "sglang-spec-overlap",
                "sglang-spec-retract", "sglang-spec-session", "sglang-spec-swa", "sglang-spec-mamba"]
# each crossing's own counters, which its workload must reach too
CROSSING = {"sglang-spec-retract": ("retractions",), "sglang-spec-swa": ("swa_window_evictions",),
            "sglang-spec-mamba": ("mamba_tree_hits",), "sglang-spec-session": ("spec_session_tails",)}
COUNTERS = ("spec_steps", "draft_tokens_accepted", "draft_tokens_rejected", "spec_slots_reserved",
            "spec_tail_releases", "spec_tail_slots")


def cfg(preset="sglang-spec-eagle", **kw):
    return SGLANG_PRESETS[preset].config(**kw)


def workload(preset, n=6):
    """Six requests of three families (prefix hits), long enough to decode several spec steps; on the session
    preset three streaming sessions of two turns each, then a request outside them."""
    if preset != "sglang-spec-session":
        return [Submit(family=i % 3, prompt_len=6 + 3 * i, max_new_tokens=9 + 2 * i) for i in range(n)] + [Idle()]
    ops = [OpenSession() for _ in range(3)]
    for turn in range(2):
        ops += [Submit(family=s, prompt_len=5 + s, max_new_tokens=7 + 3 * s, session=s) for s in range(3)] + [Idle()]
    return ops + [Submit(family=3, prompt_len=8, max_new_tokens=12), Idle()]  # and one request outside them


# -- config ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw, text", [
    ({"speculative_algorithm": "medusa"}, "speculative_algorithm must be"),
    ({"speculative_eagle_topk": 2}, "speculative_eagle_topk must be 1"),
    ({"speculative_num_draft_tokens": 6}, "num_steps \\+ 1"),
    ({"speculative_num_steps": 0}, "speculative_num_steps must be"),
    ({"chunked_prefill_size": 16, "enable_mixed_chunk": True}, "disables enable_mixed_chunk"),
    ({"enable_hierarchical_cache": True}, "without enable_hierarchical_cache"),
])
def test_incompatible_spec_settings_are_refused(kw, text):
    with pytest.raises(ValueError, match=text):
        cfg(**kw)


def test_the_spec_fault_needs_a_spec_preset():
    with pytest.raises(ValueError, match="sglang-spec presets only"):
        SglangConfig(bugs=frozenset({"spec-leak-rejected-draft"}))
    assert cfg(bugs=frozenset({"spec-leak-rejected-draft"})).bugs


# -- the presets run clean, every counter reached ---------------------------------------------------
@pytest.mark.parametrize("preset", SPEC_PRESETS)
def test_a_spec_preset_runs_clean_and_reaches_its_path(preset):
    findings, run = run_ops(cfg(preset), workload(preset))
    try:
        t = run.target
        assert type(t.features[-1]).__name__ == "SpecDecode"
        assert findings == [], findings
        reached = t.reach()
        assert all(reached[c] > 0 for c in COUNTERS + CROSSING.get(preset, ())), reached
        assert t.engine_check() == []
        if preset != "sglang-spec-session":  # (a session's record keeps its KV until it closes)
            # every request finished; the pool is whole again (tree-held KV evictable)
            acc = t.accounting()["token_to_kv_pool"]
            assert acc.available + acc.evictable == acc.total and acc.protected == 0
    finally:
        run.close()


# the tree an EAGLE server builds: kv_cache_builder passes CacheInitParams(is_eagle=spec_algorithm.is_eagle()),
# and the tree core drops it beside a Mamba component
EAGLE_TREE = {"sglang-spec-eagle": True, "sglang-spec-eagle-paged": True, "sglang-spec-overlap": True,
              "sglang-spec-retract": True, "sglang-spec-session": True, "sglang-spec-swa": True,
              "sglang-spec-mamba": False, "sglang-spec-ngram": False, "sglang": False}


@pytest.mark.parametrize("preset", sorted(EAGLE_TREE))
def test_an_eagle_preset_builds_the_tree_an_eagle_server_does(preset):
    """The eagle presets' tree keys nodes by token pairs (bigram keys), as on an EAGLE server; an n-gram
    server's, a plain one's and a Mamba hybrid's do not. A finished request of 8 + 6 tokens leaves 13 slots
    in a raw-key tree (the last token has no KV), one fewer in a bigram one (the last pair needs two tokens)."""
    with AuditedRun(cfg(preset)) as run:
        t = run.target
        assert t.tree_cache.tree_core.is_eagle is EAGLE_TREE[preset]
        if preset in ("sglang", "sglang-spec-eagle"):
            run.apply(Submit(family=0, prompt_len=8, max_new_tokens=6))
            run.apply(Idle())
            assert run.findings == []
            assert t.tree_cache.evictable_size() == (12 if EAGLE_TREE[preset] else 13)


@pytest.mark.parametrize("preset", ["sglang-spec-eagle", "sglang-spec-mamba"])
def test_the_python_tree_core_gets_the_same_keys(preset):
    with AuditedRun(cfg(preset, tree_core="python")) as run:
        core = run.target.tree_cache.tree_core
        assert type(core).__name__ == "UnifiedTreeCore" and core.is_eagle is EAGLE_TREE[preset]


def test_a_decode_step_reserves_past_the_committed_kv_and_the_verify_commits_a_run():
    """One request: after its first spec step the row holds committed + the double-buffered reserve, and
    the processor committed 1..4 tokens (the accepted drafts and the bonus)."""
    with AuditedRun(cfg()) as run:
        run.apply(Submit(family=0, prompt_len=8, max_new_tokens=40))
        t = run.target
        while not t.feature("spec").steps:
            t.step()
        (req,) = t.running
        # prefill committed 8; the verify committed accept_len more; the reserve reached committed-then + 8
        assert 8 < req.kv.kv_committed_len <= 8 + 4
        assert req.kv.kv_allocated_len == 8 + 8
        assert len(req.output_ids) == 1 + req.kv.kv_committed_len - 8
        assert t.invariant_findings() == []


# -- the oracle on hand-made reservations -----------------------------------------------------------
def _running_spec_target(run):
    run.apply(Submit(family=0, prompt_len=8, max_new_tokens=40))
    t = run.target
    while not t.feature("spec").steps:
        t.step()
    (req,) = t.running
    return t, req


def test_the_oracle_sees_a_reserved_tail_freed_under_its_row():
    import torch
    with AuditedRun(cfg()) as run:
        t, req = _running_spec_target(run)
        kv = req.kv
        tail = t.req_to_token_pool.req_to_token[kv.req_pool_idx, kv.kv_committed_len:kv.kv_allocated_len]
        t.allocator.free(tail.to(torch.int64))  # the row still reserves them
        (f,) = t.invariant_findings()
        assert (f.kind, f.check) == ("use-after-free", "spec-draft-kv") and f.units.size == tail.numel()
        assert f"request {req.rid}'s {tail.numel()} reserved draft" in f.message


def _abort_and_release(bugs):
    """A running spec request aborted, stepped until its release ran; returns the findings of the oracle and
    the request's rid, reserved tail and the step."""
    with AuditedRun(cfg(bugs=bugs)) as run:
        t, req = _running_spec_target(run)
        n = req.kv.kv_allocated_len - req.kv.kv_committed_len
        assert n > 0
        t._abort(req.rid)
        while req.kv.holds_kv:
            t.step()
        return [f for f in t.invariant_findings() if f.check == "spec-draft-kv"], req.rid, n, t.steps


def test_the_oracle_sees_a_reserved_tail_lost_at_release():
    """An abort's release whose tail free is lost (the planted fault drops _release_overallocated_kv_indices'
    free once) is a spec-draft-kv leak naming the request, the slots and the step; without it, nothing."""
    assert _abort_and_release(frozenset())[0] == []
    leaks, rid, n, step = _abort_and_release(frozenset({"spec-leak-rejected-draft"}))
    assert len(leaks) == 1 and leaks[0].kind == "leak" and leaks[0].units.size == n
    assert f"request {rid}'s {n} reserved-but-uncommitted draft slot(s)" in leaks[0].message
    assert f"(step {step})" in leaks[0].message


# -- the fault ---------------------------------------------------------------------------------------
def test_fuzz_finds_and_minimizes_the_leaked_rejected_draft(tmp_path):
    from fault_helpers import fuzz_fault, minimized_fault_program
    doc, path = fuzz_fault(tmp_path, "sglang", "sglang-spec-eagle", "spec-leak-rejected-draft", max_time="20")
    sigs = [f["signature"] for f in doc["findings"]]
    assert any(s.startswith("leak/token_to_kv_pool/") for s in sigs), sigs
    minimized_fault_program(path, max_ops=4)


def test_the_spec_fault_is_refused_with_a_clear_error_off_the_spec_presets(tmp_path):
    from cli_helpers import invoke
    r = invoke("fuzz", "--target", "sglang", "--preset", "sglang", "--bug", "spec-leak-rejected-draft",
               "--max-time", "5", "--out", str(tmp_path))
    assert r.exit_code == 2 and "sglang-spec presets only" in r.output, r.output


# -- finding 14: the reservation outgrows the row ----------------------------------------------------------
DEEP = [Submit(family=0, prompt_len=16, max_new_tokens=8), Submit(family=1, prompt_len=16, max_new_tokens=8),
        Submit(family=2, prompt_len=4, max_new_tokens=8), Idle()]


def test_a_deep_verify_near_the_context_end_writes_past_the_row(monkeypatch):
    """sglang-spec-ngram-deep (16-token verify, context 32): a request near its context end reserves
    committed + 32 into a row of 32 + 20; the spilled write is seen (spec-row-width, then the leak of the
    slots it displaced), and rows as wide as the reserve run the same program clean."""
    from kvaudit.audit.runner import execute
    from kvaudit.targets.sglang import boot
    from kvaudit.targets.sglang.target import SglangTarget

    config = cfg("sglang-spec-ngram-deep", seed=3)
    t = SglangTarget(config)
    width = t.req_to_token_pool.req_to_token.shape[1]
    assert width == 32 + 4 + 16  # SGLang's own headroom: 4 + speculative_num_draft_tokens at page 1
    for op in DEEP[:2]:
        t.apply(op)
    seen = []
    for _ in range(6):
        t.step()
        seen += [f for f in t.invariant_findings() if f.check == "spec-row-width"]
        if seen:
            break
    assert seen and seen[0].kind == "aliasing" and "past its req_to_token row (52 wide" in seen[0].message
    t.close()
    assert {f.kind for f in execute(config, DEEP, full_stacks=False).findings} == {"aliasing", "leak"}
    own = boot.row_width
    monkeypatch.setattr(boot, "row_width", lambda c: own(c) + 32)
    assert execute(config, DEEP, full_stacks=False).findings == []
