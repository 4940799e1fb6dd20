"""PD decode with the decode-side radix cache (issue 18, missing path; SGLang 0.5.23
``--disaggregation-decode-enable-radix-cache``, ``srt/disaggregation/decode.py``
``DecodePreallocQueue.pop_preallocated`` / ``_match_prefix_and_lock`` / ``_pre_alloc``): the prompt's
cached prefix is matched and locked at pre-allocation, only the unmatched suffix is transferred,
pre-allocation evicts the tree when it needs room, and the lock is dropped however the request ends.
HiCache on a PD decode server is rejected at config validation."""

from __future__ import annotations

import json

import pytest

from engine_under_test import EngineConfig, FinishReason, Scheduler

from kvaudit.targets.eut.presets import get_preset
from kvaudit.program import Idle, Step, Submit, TransferFail, prompt_tokens
from kvaudit.audit.runner import AuditedRun

from cli_helpers import invoke, one_error_line
from test_engine_paths import assert_pools_full
from test_scheduler import assert_busy_identity, assert_clean_at_idle, outputs

PROMPT = list(range(2, 34))  # 32 tokens


def _engine(**kw) -> Scheduler:
    return Scheduler(get_preset("pd-decode-radix").config(**kw))


def _tree_slots(s, tokens):
    """The slots the tree holds for the cached prefix of ``tokens``."""
    return s.tree_cache.match_prefix(tokens).device_indices


def _prefix_locked(s, tokens) -> bool:
    return s.tree_cache.match_prefix(tokens).last_node.lock_ref > 0


def _locked(s) -> list:
    return [n for n in s.tree_cache.nodes() if n.lock_ref > 0 and n is not s.tree_cache.root_node]


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_prefix_hit_is_locked_and_only_the_suffix_is_transferred(page_size):
    s = _engine(page_size=page_size, transfer_latency_steps=2)
    a = s.add_request(PROMPT, 3)
    s.run_until_idle()
    cached = _tree_slots(s, PROMPT[:16]).clone()
    assert cached.numel() == 16
    free = s.token_to_kv_pool_allocator.available_size()
    b = s.add_request(PROMPT[:16] + list(range(40, 52)), 3)  # 28 tokens, 16 of them cached
    s.step()
    req = s.disagg_transfer_queue[0]
    assert req.rid == b and req.kv.cache_protected_len == 16
    row = s.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
    assert row[:16].tolist() == cached.tolist()  # the row points at the tree's slots
    assert free - s.token_to_kv_pool_allocator.available_size() == s.ceil_page(28) - 16  # the suffix only
    assert s.tree_cache.protected_size() == 16 and req.lock is not None
    assert_busy_identity(s)
    s.run_until_idle()
    assert_clean_at_idle(s)
    assert outputs(s)[a].reason == outputs(s)[b].reason == FinishReason.LENGTH


def test_the_tiny_model_decodes_the_same_with_and_without_the_decode_tree():
    """The suffix-only transfer attends over the tree's prefix KV: outputs match the tree-off server."""
    prompts = [PROMPT, PROMPT[:20] + [90, 91, 92], PROMPT[:8] + [70] * 9]

    def run(radix: bool):
        tree = dict(disaggregation_decode_enable_radix_cache=True, disable_radix_cache=False) if radix else \
            dict(disaggregation_decode_enable_radix_cache=False, disable_radix_cache=True)
        s = _engine(model="tiny", **tree)
        for p in prompts:
            s.add_request(p, 6)
            s.run_until_idle()
        return [o.output_ids for o in s.finished_outputs], s.tree_cache.evictable_size()

    with_tree, cached = run(True)
    assert cached > 0
    assert with_tree == run(False)[0]


def test_prealloc_evicts_unlocked_tree_nodes_instead_of_hanging():
    s = _engine(num_slots=64, max_running_requests=1)
    rids = []
    for k in range(6):  # six distinct 24-token prompts: 150+ tokens through a 64-slot pool
        rids.append(s.add_request(list(range(100 + 30 * k, 124 + 30 * k)), 2))
        s.run_until_idle(max_steps=200)
        alloc = s.token_to_kv_pool_allocator
        assert s.tree_cache.evictable_size() > 0
        assert alloc.available_size() + s.tree_cache.evictable_size() == alloc.size
    assert all(outputs(s)[r].reason == FinishReason.LENGTH for r in rids)
    assert_clean_at_idle(s)


def test_pre_allocation_evicts_only_the_shortfall_and_never_the_matched_prefix():
    s = _engine(num_slots=64, max_running_requests=1)
    s.add_request(PROMPT, 2)  # 32 prompt + 2 output tokens cached
    s.run_until_idle()
    s.add_request(list(range(60, 80)), 2)  # 20 more: the pool is now almost all tree
    s.run_until_idle()
    assert s.token_to_kv_pool_allocator.available_size() < 20
    kept = _tree_slots(s, PROMPT[:24]).clone()
    b = s.add_request(PROMPT[:24] + list(range(90, 110)), 2)  # 44 tokens, 24 cached
    s.step()
    req = next(r for r in s.disagg_transfer_queue + s.waiting_queue if r.rid == b)
    assert req.kv.cache_protected_len == 24
    assert s.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :24].tolist() == kept.tolist()
    s.run_until_idle()
    assert outputs(s)[b].reason == FinishReason.LENGTH
    assert_clean_at_idle(s)


def _transferring_hit(**kw):
    """An engine whose second request holds a locked prefix hit and is still transferring."""
    s = _engine(transfer_latency_steps=3, **kw)
    s.add_request(PROMPT, 2)
    s.run_until_idle()
    b = s.add_request(PROMPT[:16] + [77, 78, 79, 80], 4)
    s.step()
    assert [r.rid for r in s.disagg_transfer_queue] == [b] and _locked(s)
    return s, b


@pytest.mark.parametrize("end", ["finish", "abort", "transfer_fail"])
def test_the_lock_is_released_however_a_transferring_request_ends(end):
    s, b = _transferring_hit()
    if end == "abort":
        s.abort_request(b)
    elif end == "transfer_fail":
        s.report_transfer_failure(b)
    s.step()
    if end != "finish":
        assert outputs(s)[b].reason == FinishReason.ABORT
        assert not _locked(s) and s.tree_cache.protected_size() == 0  # at once, not at idle
    s.run_until_idle()
    assert not _locked(s)
    assert outputs(s)[b].reason == (FinishReason.LENGTH if end == "finish" else FinishReason.ABORT)
    assert_clean_at_idle(s)
    assert s.flush_cache()
    assert_pools_full(s)


@pytest.mark.parametrize("end", ["abort", "transfer_fail"])
def test_the_lock_is_released_when_a_request_waiting_to_join_ends(end):
    s = _engine(max_running_requests=1)
    s.add_request(PROMPT, 2)
    s.run_until_idle()
    a = s.add_request(list(range(60, 70)), 8)
    b = s.add_request(PROMPT[:16] + [77, 78], 8)
    for _ in range(3):
        s.step()
    assert [r.rid for r in s.running_batch] == [a] and [r.rid for r in s.waiting_queue] == [b]
    assert s.waiting_queue[0].lock is not None
    s.abort_request(b) if end == "abort" else s.report_transfer_failure(b)
    while b not in outputs(s):
        s.step()
    assert outputs(s)[b].reason == FinishReason.ABORT
    assert not _prefix_locked(s, PROMPT[:16])
    assert ([r.rid for r in s.running_batch] == [a]) == (end == "abort")  # a failed transfer is found at join
    s.run_until_idle()
    assert not _locked(s)
    assert_clean_at_idle(s)


def test_a_request_that_does_not_fit_drops_its_lock_and_waits():
    s = _engine(num_slots=64, max_running_requests=2)
    s.add_request(PROMPT, 2)
    s.run_until_idle()
    a = s.add_request(list(range(60, 80)), 40)  # reserves most of the pool for its output
    s.step()
    b = s.add_request(PROMPT[:16] + list(range(90, 110)), 20)
    s.step()
    assert [r.rid for r in s.disagg_prealloc_queue] == [b]
    assert all(r.rid == a for r in s.running_batch + s.waiting_queue + s.disagg_transfer_queue)
    assert not _prefix_locked(s, PROMPT[:16])  # b's match was let go
    assert_busy_identity(s)
    s.run_until_idle()
    assert outputs(s)[b].reason == FinishReason.LENGTH
    assert_clean_at_idle(s)


def test_transfer_fail_with_the_tree_is_audited_clean():
    cfg = get_preset("pd-decode-radix").config(max_running_requests=1, transfer_latency_steps=2, model="tiny")
    program = [Submit(0, 24, 3), Idle(), Submit(0, 30, 6), Step(1), Submit(0, 28, 6), Step(2), TransferFail(None),
               Submit(0, 26, 4), Idle()]
    with AuditedRun(cfg) as run:
        for op in program:
            assert run.apply(op) == [], op


# -- configuration --------------------------------------------------------------------------------

@pytest.mark.parametrize("change, words", [
    (dict(disaggregation_mode="decode", disable_radix_cache=False), "needs disaggregation_decode_enable_radix_cache"),
    (dict(disaggregation_decode_enable_radix_cache=True), "needs disaggregation_mode='decode'"),
    (dict(disaggregation_mode="decode", disable_radix_cache=True, disaggregation_decode_enable_radix_cache=True),
     "disable_radix_cache=false"),
    (dict(disaggregation_mode="decode", disaggregation_decode_enable_radix_cache=True, enable_hicache=True),
     "enable_hicache on a PD decode server"),
], ids=["tree-without-flag", "flag-without-pd", "flag-with-tree-off", "hicache-on-pd-decode"])
def test_inconsistent_decode_tree_configs_are_rejected(change, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(")):
        EngineConfig(**change)


def test_cli_reports_a_pd_decode_config_with_the_tree_but_no_flag_as_one_usage_line(tmp_path):
    doc = {"format": "kvaudit.replay/1", "config": {"disaggregation_mode": "decode", "disable_radix_cache": False},
           "program": [{"op": "idle"}]}
    path = tmp_path / "in.json"
    path.write_text(json.dumps(doc))
    result = invoke("replay", str(path))
    assert result.exit_code == 2, result.output
    assert "disaggregation_decode_enable_radix_cache" in one_error_line(result)


def test_a_decode_tree_prefix_that_points_at_other_kv_is_reported_as_stale():
    """A fault planted in the test: pre-allocation points a family-0 hit at family 1's cached slots.
    The target records only the transferred suffix as written, so the first decode read finds the
    other prompt's KV under the matched prefix."""
    cfg = get_preset("pd-decode-radix").config(max_running_requests=1)
    other = prompt_tokens(1, 24, cfg.vocab_size)
    with AuditedRun(cfg) as run:
        for op in [Submit(0, 24, 2), Idle(), Submit(1, 24, 2), Idle()]:
            assert run.apply(op) == []
        eng = run.target.engine
        pre_alloc = eng._pre_alloc

        def wrong_prefix(req, fill_len):
            if req.prefix_indices is not None:
                req.prefix_indices = eng.tree_cache.match_prefix(other[: req.prefix_indices.numel()]).device_indices
            return pre_alloc(req, fill_len)

        eng._pre_alloc = wrong_prefix
        found = [f for op in [Submit(0, 30, 4), Idle()] for f in run.apply(op)]
    assert "stale-kv" in {f.kind for f in found}, [f.kind for f in found]
