"""Speculative decoding on vLLM's scheduler side (issue 36): ``num_spec_tokens`` built as vLLM's ngram
``SpeculativeConfig``, the driver's drafter and rejection sampler (sync: ``update_draft_token_ids``; async:
the AsyncScheduler's placeholders), the path counters, and the planted fault ``leak-rejected-draft-blocks``
found, minimized and clean without the fault. Skipped where vLLM is not installed."""

from __future__ import annotations

import pytest

from fault_helpers import fuzz_fault, minimized_fault_program
from kvaudit.audit.runner import AuditedRun, execute
from kvaudit.program import Idle, Step, Submit
from kvaudit.targets import registry

pytestmark = pytest.mark.vllm


def cfg(preset, **kw):
    return registry.get("vllm").preset(preset).config(**kw)


@pytest.mark.parametrize("bad", [-1, 9, True])
def test_num_spec_tokens_is_validated(bad):
    with pytest.raises(ValueError, match="num_spec_tokens"):
        cfg("vllm", num_spec_tokens=bad)
    with pytest.raises(ValueError, match="num_spec_tokens needs level scheduler"):
        cfg("vllm-manager", num_spec_tokens=2)
    with pytest.raises(ValueError, match="spec_method"):
        cfg("vllm-spec", spec_method="medusa")


@pytest.mark.parametrize("preset", ["vllm-spec", "vllm-spec-async", "vllm-spec-kv-connector", "vllm-spec-eagle"])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_drafts_are_verified_rolled_back_and_completions_end_at_stop_at(preset, prefix_caching):
    """Two requests of one family (the second hits the first's prefix when caching is on): drafts are
    scheduled, some accepted, some rejected (``num_computed_tokens`` rolled back), and each completion is
    the synthetic sampler's tokens with EOS at ``stop_at``, whatever the scheduling."""
    config = cfg(preset, enable_prefix_caching=prefix_caching)
    with AuditedRun(config, full_stacks=False) as run:
        t = run.target
        assert t.vllm_config.speculative_config.num_speculative_tokens == 4
        eagle = config.spec_method == "eagle"
        assert t.scheduler.num_lookahead_tokens == (4 if eagle else 0)
        assert t.hash_lookahead == int(eagle and prefix_caching)  # 0.33.0: as EngineCore builds its hasher
        assert (t.reach()["accepted_draft_tokens"], t.reach()["rejected_draft_tokens"]) == (0, 0)
        requests, drafted = {}, 0
        for op in [Submit(0, 40, 12, stop_at=11), Step(1), Submit(0, 40, 12, ignore_eos=1, stop_at=3)]:
            assert run.apply(op) == []
        for _ in range(40):
            requests.update(t.scheduler.requests)
            drafted += sum(len(r.spec_token_ids) for r in t.scheduler.running)
            assert run.apply(Step(1)) == []
            if not config.async_scheduling:  # rejected drafts rolled back: all but the last token computed
                assert all(r.num_computed_tokens == r.num_tokens - 1 for r in t.scheduler.running
                           if r.num_output_tokens)
        assert run.apply(Idle()) == [] and t.is_idle()
    reach = t.reach()
    assert drafted and reach["accepted_draft_tokens"] > 0 and reach["rejected_draft_tokens"] > 0
    r1, r2 = (requests[f"req-00000{i}"] for i in (1, 2))
    assert list(r1.output_token_ids) == [t.token(r1.request_id, i) for i in range(11)] and r1.output_token_ids[-1] == t.eos
    assert len(r2.output_token_ids) == 12 and t.eos in r2.output_token_ids  # ignore_eos: on to max_tokens


def test_planted_rejected_draft_leak_is_found_minimized_and_clean_without_the_fault(tmp_path):
    doc, path = fuzz_fault(tmp_path, "vllm", "vllm-spec", "leak-rejected-draft-blocks", max_time="60")
    assert doc["findings"][0]["signature"] == "leak/block_pool/schedule@scheduler.py/table:cut"
    minimized_fault_program(path, max_ops=4)  # minimized: a request or two decoding with drafts


@pytest.mark.parametrize("preset", ["vllm-spec", "vllm-mamba-spec"])
def test_accepted_drafts_of_a_request_that_stops_are_tagged_before_another_reads_them(preset):
    """vLLM caches the blocks of a step's accepted drafts in ``update_from_output``; a request that stops
    there has no next step, which is where the shadow tagged draft positions, so a request extending its
    text read them as never written (found on vllm-mamba-spec, minimized; vllm-spec alike)."""
    program = [Submit(0, 10, 10, stop_at=7), Step(4), Submit(0, 1, 1, extends=3), Idle()]
    ex = execute(cfg(preset), program, full_stacks=False)
    assert ex.findings == [] and ex.ops_run == len(program)
