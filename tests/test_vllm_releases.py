"""vLLM releases as overlays (``kvaudit.history.releases``): each known reproducer replayed in its own
process per release (one process imports one vLLM), found on the release that ships the bug and clean
on the one that fixed it; and the oracle each bug needs, on this environment's vLLM through the injected
fault that puts the bug back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from release_helpers import child_env

from kvaudit.history.catalogue import BUGS

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data" / "vllm_releases"


def _replay(version: str, name: str) -> list[str]:
    """The signatures ``kvaudit replay`` finds for ``name`` under vLLM ``version`` (a child process)."""
    env = child_env("vllm", version, ROOT)
    code = ("import json, sys; from kvaudit import replay; from kvaudit.audit.runner import execute; "
            "from kvaudit.program import Idle; import vllm; "
            f"assert vllm.__version__ == {version!r}, vllm.__version__; "
            f"config, program = replay.load({str(DATA / name)!r})[:2]; "
            "ex = execute(config, list(program) + [Idle()], full_stacks=False); "
            "print(json.dumps(sorted({f.signature for f in ex.findings})))")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.releases
@pytest.mark.parametrize("bug_id", ["vllm-32255", "vllm-33377", "vllm-42571", "vllm-43433", "vllm-45357",
                                    "vllm-47282", "vllm-46951"])
def test_known_reproducer_is_found_on_the_buggy_release_and_clean_on_the_fixed(bug_id):
    bug, name = BUGS[bug_id], f"{bug_id}.json"
    found = _replay(bug.buggy, name)
    assert any(s.startswith(bug.finding + "/") and (not bug.check or s.endswith(f"check:{bug.check}"))
               for s in found), found
    assert _replay(bug.fixed, name) == []


@pytest.mark.releases
def test_a_request_reset_with_drafts_in_flight_never_finishes_before_0_27_0():
    """vLLM #49860's path (catalogue row vllm-49860): reset_prefix_cache(reset_running_requests=True) with a
    speculative step in flight sets a discard count of 1 + drafts frames; the resumed request's own frames
    are dropped and it is never scheduled again. The search reports it idle (``hang``); replayed with the
    drain appended, the progress check names it first (``liveness``): the same stuck request."""
    bug = BUGS["vllm-49860"]
    assert json.loads((DATA / "vllm-49860.json").read_text())["config"]["flush_running"] is True
    assert set(_replay(bug.buggy, "vllm-49860.json")) & {"hang/-/idle/running:decode",
                                                         "liveness/-/progress/running:holds-kv"}
    assert _replay(bug.fixed, "vllm-49860.json") == []


@pytest.mark.releases
def test_a_session_stopped_with_a_step_in_flight_is_lost_before_0_31_0():
    """vLLM #52693 (catalogue row vllm-52693): a session's turn stops with its next step in flight; that step's
    output stops it again. 0.30.0 (and 0.27.0 on) take it out of every queue, so its next chunk is never
    scheduled (an idle engine holding it: ``hang``); 0.26.0 (and 0.21.0 on) queue it twice and schedule()
    raises; 0.31.0 drops the finished turn's in-flight output."""
    bug = BUGS["vllm-52693"]
    assert _replay(bug.buggy, "vllm-52693.json") == ["hang/-/idle/waiting:waiting"]
    assert _replay("0.26.0", "vllm-52693.json") == ["crash/-/RuntimeError@schedule@scheduler.py"]
    assert _replay(bug.fixed, "vllm-52693.json") == []


@pytest.mark.releases
def test_a_failed_load_sharing_a_marked_block_crashes_schedule_before_0_31_0():
    """Catalogue row vllm-kv-fail-full-hit: a remote load counted failed for a shared block another request
    marked first keeps its whole prompt computed; 0.30.0's failed branch does not step back one token and
    schedule() asserts; 0.31.0 steps back on both branches."""
    bug = BUGS["vllm-kv-fail-full-hit"]
    assert _replay(bug.buggy, "vllm-kv-fail-full-hit.json") == ["crash/-/AssertionError@schedule@scheduler.py"]
    assert _replay(bug.fixed, "vllm-kv-fail-full-hit.json") == []


@pytest.mark.releases
def test_an_idle_engine_holds_a_cpu_offload_store_before_0_30_0():
    """Not a catalogued bug (no public issue or PR names it; corpora/vllm/README.md): vLLM 0.20.0 to 0.29.0's
    SimpleCPUOffloadConnector defines has_pending_transfers, which nothing calls, so when the last request
    finishes with a store in flight the engine stops stepping and the store's GPU blocks stay held. From
    0.30.0 the connector answers the Scheduler's has_pending_push_work. The reproducer (one request, then
    idle, wake_for_transfers off; minimized on 0.29.0) hangs idle on 0.23.0 and 0.26.0, not on 0.30.0."""
    name = "cpu-offload-idle-store.json"
    assert json.loads((DATA / name).read_text())["config"]["wake_for_transfers"] is False
    for buggy in ("0.23.0", "0.26.0"):
        assert _replay(buggy, name) == ["hang/-/idle/connector:sending"], buggy  # the store never completes
    assert _replay("0.30.0", name) == []


@pytest.mark.releases
def test_routed_experts_side_table_is_found_on_0_30_0():
    """vLLM #49684 on the release that ships it. Its fixed twin (0.31.0) moved the feature behind Model
    Runner V2, which needs Triton: the target refuses to build it there, so only the buggy side runs."""
    bug = BUGS["vllm-49684"]
    assert _replay(bug.buggy, "vllm-49684.json") == [
        "leak/block_pool/schedule@scheduler.py/check:dead-table:_re_block_ids"]


@pytest.mark.vllm
def test_a_dead_entry_in_a_scheduler_table_is_found_once_idle():
    """The dead-table check on this environment's vLLM: a drained run is clean; a request id planted in
    one of the Scheduler's own tables (``deferred_loads``, a dict vLLM 0.33.0 keys by request id) after
    the request is gone is a finding naming the table."""
    from kvaudit.audit import oracles
    from kvaudit.audit.runner import AuditedRun
    from kvaudit.program import Abort, Idle, Step, Submit
    from kvaudit.targets import registry
    from kvaudit.targets.vllm.boot import VllmUnavailable, load
    try:
        load()
    except VllmUnavailable as e:
        pytest.skip(str(e))
    run = AuditedRun(registry.get("vllm").preset("vllm-async").config())
    for op in [Submit(0, 8, 4, ignore_eos=1), Step(1), Abort(None), Idle()]:
        assert run.apply(op) == []
    s = run.target.scheduler
    table = getattr(s, "deferred_loads", None)
    if not isinstance(table, dict):
        pytest.skip(f"vLLM {load().version}'s Scheduler has no deferred_loads dict")
    table["req-000001"] = (0, 0, 0, 0)
    found = [f for f in oracles.check(run.auditor, run.target) if f.signature.endswith("dead-table:deferred_loads")]
    assert found and "req:req-000001" in found[0].message, [f.signature for f in found]


@pytest.mark.vllm
def test_inflight_load_oracle_sees_the_fault_that_puts_32255_back():
    from kvaudit.audit.runner import execute
    from kvaudit.program import Idle, program_from_json
    from kvaudit.targets import registry
    from kvaudit.targets.vllm.boot import VllmUnavailable, load
    try:
        load()
    except VllmUnavailable as e:
        pytest.skip(str(e))
    program = program_from_json(json.loads((DATA / "vllm-32255.json").read_text())["program"]) + [Idle()]
    preset = registry.get("vllm").preset("vllm-kv-load")
    faulty = execute(preset.config(bugs=frozenset({"free-under-inflight-load"})), program, full_stacks=False)
    assert [f.signature for f in faulty.findings if f.signature.endswith("check:inflight-load")], \
        [f.signature for f in faulty.findings]
    assert execute(preset.config(), program, full_stacks=False).findings == []
