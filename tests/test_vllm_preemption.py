"""Preemption on the vLLM target (issue 36): the ``preemptions`` / ``preemptions_in_flight`` counters,
priority scheduling (``scheduling_policy``), and the preemption presets. The fault
``free-preempted-under-inflight-step`` is found by tests/test_vllm.py's fuzz test and its minimized
reproducer is replayed (clean without the fault) by tests/test_vllm_corpus.py."""

from __future__ import annotations

import pytest

from kvaudit.audit.runner import AuditedRun
from kvaudit.program import Step, Submit
from kvaudit.targets import program_features, registry
from kvaudit.targets.vllm.config import VllmConfig


def cfg(preset, **kw):
    return registry.get("vllm").preset(preset).config(**kw)


def test_scheduling_policy_is_validated_and_priority_is_drawn_only_under_it():
    with pytest.raises(ValueError, match="scheduling_policy"):
        VllmConfig(scheduling_policy="lifo")
    with pytest.raises(ValueError, match="needs level scheduler"):
        cfg("vllm-manager", scheduling_policy="priority")
    assert program_features(cfg("vllm-priority")) == program_features(cfg("vllm-priority-async")) == {"priority"}
    assert program_features(cfg("vllm-small")) == frozenset()


# Two requests that cannot both decode to the end in 15 blocks of 4 tokens: the older one has the larger
# priority value (runs last under the priority policy)
OLD_LOW_NEW_HIGH = [Submit(0, 24, 12, ignore_eos=1, priority=5), Submit(1, 24, 12, ignore_eos=1, priority=0),
                    Step(10), Step(10)]


@pytest.mark.vllm
@pytest.mark.parametrize("preset, victim, in_flight", [
    ("vllm-small", "req-000002", 0),  # FCFS: the newest running request
    ("vllm-async-small", "req-000002", 1),  # the same, while the batch in flight schedules it
    ("vllm-priority", "req-000001", 0),  # priority: the largest (priority, arrival_time)
    ("vllm-priority-async", "req-000001", 1),
])
def test_the_victim_follows_the_policy_and_the_counters_say_whether_a_step_was_in_flight(preset, victim, in_flight):
    with AuditedRun(cfg(preset), full_stacks=False) as run:
        preempted, priorities = set(), {}
        for op in OLD_LOW_NEW_HIGH:
            assert run.apply(op) == []
            for rid, request in run.target.scheduler.requests.items():
                priorities[rid] = request.priority
                if request.num_preemptions:
                    preempted.add(rid)
        assert preempted == {victim}
        assert priorities == ({"req-000001": 5, "req-000002": 0} if "priority" in preset
                              else {"req-000001": 0, "req-000002": 0})
        reach = run.target.reach()
        assert (reach["preemptions"], reach["preemptions_in_flight"]) == (1, in_flight)


@pytest.mark.vllm
def test_the_kv_consumers_fence_keeps_a_victim_in_flight_unless_the_fault_frees_it():
    """vllm-kv-connector-small: vLLM 0.33.0 does not preempt a request its step in flight still writes
    (#49675); the fault does, and the in-flight-write check sees the block reallocated under that step."""
    program = [Submit(0, 1, 1), Submit(1, 45, 4), Submit(0, 1, 5), Submit(0, 13, 1), Step(5)]
    with AuditedRun(cfg("vllm-kv-connector-small"), full_stacks=False) as run:
        assert [f for op in program for f in run.apply(op)] == []
        assert run.target.reach()["preemptions_in_flight"] == 0
    with AuditedRun(cfg("vllm-kv-connector-small", bugs=frozenset({"free-preempted-under-inflight-step"})),
                    full_stacks=False) as run:
        found = [f for op in program for f in run.apply(op)]
        assert [(f.kind, f.check) for f in found][:1] == [("use-after-free", "inflight-write")]
        assert run.target.reach()["preemptions_in_flight"] >= 1
