"""vLLM 0.33.0's OffloadingConnector, LMCacheMPConnector and MultiConnector on the vLLM target (presets
``vllm-offload*``, ``vllm-lmcache-mp``, ``vllm-multi-connector``): the planted fault ``skip-offload-flush``
is found (check ``inflight-store``), minimized and clean without it; the CPU tier's KV-cache events check
(``kv-events:cpu``) sees a lost event; LMCacheMPConnector holds the blocks of every finished request, one
with no block too, until the worker reports it. Skipped where vLLM is not installed."""

import pytest

from kvaudit.audit.runner import AuditedRun, execute
from kvaudit.program import Abort, Idle, Step, Submit
from kvaudit.targets.vllm.config import VLLM_PRESETS

pytestmark = pytest.mark.vllm


def test_a_dropped_offload_flush_is_found_minimized_and_clean_without_the_fault():
    from kvaudit.testing import fuzz
    config = VLLM_PRESETS["vllm-offload-small"].config(bugs=frozenset({"skip-offload-flush"}))
    result = fuzz(config, max_time=10, seed=11, fuzzer="random")
    assert len(result.signatures) == 1 and result.signatures[0].endswith("check:inflight-store")
    assert 0 < len(result.program) < result.original_length
    assert execute(config.replace(bugs=frozenset()), result.program).signatures == []


def test_the_cpu_tiers_events_match_what_it_holds_and_a_lost_event_is_seen():
    with AuditedRun(VLLM_PRESETS["vllm-offload"].config()) as run:
        for op in [Submit(family=0, prompt_len=40, max_new_tokens=3), Submit(family=1, prompt_len=50,
                                                                            max_new_tokens=2), Idle()]:
            assert run.apply(op) == []
        target = run.target
        assert target.reach()["offload_stores"] > 0 and target.cpu_events
        assert not [f for f in target.invariant_findings() if f.check == "kv-events:cpu"]
        target.cpu_events.pop(next(iter(target.cpu_events)))  # a BlockStored never published
        assert [f.check for f in target.invariant_findings()] == ["kv-events:cpu"]


def test_lmcache_mp_holds_every_finished_requests_blocks_until_reported_even_with_none():
    with AuditedRun(VLLM_PRESETS["vllm-lmcache-mp"].config()) as run:
        s = run.target.scheduler
        assert run.apply(Submit(family=0, prompt_len=20, max_new_tokens=2)) == []
        assert run.apply(Abort(handle=0)) == []  # aborted before any schedule: no block
        assert "req-000001" in s.requests and run.target.reach()["connector_held_frees"] == 1
        for op in [Submit(family=1, prompt_len=30, max_new_tokens=3), Step(n=1), Idle()]:
            assert run.apply(op) == []
        assert not s.requests and run.target.reach()["connector_held_frees"] == 2


def test_multi_connector_drives_nixl_and_offloading_together():
    program = [Submit(family=i, prompt_len=12, max_new_tokens=3) for i in range(4)] + [Idle()]
    with AuditedRun(VLLM_PRESETS["vllm-multi-connector"].config()) as run:
        for op in program:
            assert run.apply(op) == []
        reached = run.target.reach()
    assert reached["offload_stores"] > 0 and reached["connector_held_frees"] > 0


@pytest.mark.releases
def test_vllm_46951_a_nixl_load_reusing_a_block_an_older_store_reads_is_found_on_0_30_0_clean_on_0_33_0():
    """vLLM #46951 (open upstream; PRs #46960/#47046): under MultiConnector, OffloadingConnector's
    update_state_after_alloc returned before recording the blocks allocated for another connector's load
    (num_external_tokens 0), so a NIXL load given a block that an older offload store still reads was not
    fenced (jobs_to_flush). No fault: found on 0.30.0, the first release whose connector is driven (the
    catalogue row searches 0.32.0, the last that ships the early return), clean on 0.33.0, which records every allocation first. tests/data/vllm_releases/vllm-46951.json."""
    from test_vllm_releases import DATA, _replay

    from kvaudit import replay
    signature = "use-after-free/block_pool/schedule@scheduler.py/_free_request_blocks@scheduler.py/check:inflight-store"
    assert _replay("0.30.0", "vllm-46951.json") == [signature]
    config, program = replay.load(str(DATA / "vllm-46951.json"))[:2]
    assert execute(config, program).signatures == []
