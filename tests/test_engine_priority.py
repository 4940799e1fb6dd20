"""Engine facts of issue 18's priority path: SGLang 0.5.23's ``--enable-priority-scheduling``
(``SchedulePolicy._sort_by_priority_and_fcfs``, ``PrefillAdder.preempt_to_schedule`` in
``managers/schedule_policy.py``) and ``--max-queued-requests`` (``Scheduler._abort_on_queued_limit``)."""

import pytest

from engine_under_test import FinishReason, Scheduler

from kvaudit.targets.eut.presets import get_preset
from kvaudit.targets import program_features
from test_engine_paths import assert_clean_idle, outputs


def _engine(**kw):
    return Scheduler(get_preset("priority").config(**kw))


def _prompt(first, n):
    return [first + i for i in range(n)]


def _order(eng):
    return [o.rid for o in eng.finished_outputs]


@pytest.mark.parametrize("low_first, expected", [(False, ["c", "e", "b", "d"]), (True, ["b", "e", "c", "d"])])
def test_waiting_requests_are_admitted_by_priority_then_arrival(low_first, expected):
    """One running slot, no preemption (threshold 100): B (priority 1), C (5), E (3) and D (none: the
    least preferred either way) wait behind A and are admitted by priority, larger first unless
    schedule_low_priority_values_first; the old engine admitted them first come, first served."""
    eng = _engine(max_running_requests=1, priority_scheduling_preemption_threshold=100,
                  schedule_low_priority_values_first=low_first)
    a = eng.add_request(_prompt(2, 8), 6, priority=0)
    eng.step()
    rids = {"b": eng.add_request(_prompt(20, 8), 3, priority=1),
            "c": eng.add_request(_prompt(40, 8), 3, priority=5),
            "e": eng.add_request(_prompt(80, 8), 3, priority=3),
            "d": eng.add_request(_prompt(60, 8), 3)}
    assert_clean_idle(eng)
    assert _order(eng) == [a] + [rids[k] for k in expected]
    assert eng.num_retractions == 0


def test_a_higher_priority_request_preempts_a_running_one_which_finishes_later_with_the_same_tokens():
    """A (priority 0) decodes alone (max 1 running); B (priority 5, gap 5 > threshold 1) preempts it:
    A's row and private KV go back as in a retraction (nothing of A's is held, the busy identity
    holds), A waits again, B runs; A is then prefilled again and its output is the one it has
    when it runs alone (tiny model: real KV)."""
    def run(with_b):
        eng = _engine(max_running_requests=1, model="tiny")
        a = eng.add_request(_prompt(2, 12), 10, priority=0)
        for _ in range(4):
            eng.step()
        assert eng.running_batch and eng.running_batch[0].rid == a
        b = None
        if with_b:
            victim = eng.running_batch[0]
            b = eng.add_request(_prompt(50, 6), 4, priority=5)
            eng.step()
            assert eng.num_retractions == 1 and victim in eng.waiting_queue
            assert not victim.kv.holds_kv and victim.lock is None and victim.kv.kv_committed_len == 0
            assert [r.rid for r in eng.last_batch.reqs] == [b]
            # nothing is A's any more: B alone owns a row and the only tree lock; A's prompt is evictable
            (new,) = eng.requests_owning_rows()
            assert new.rid == b and eng.tree_cache.protected_size() == new.kv.cache_protected_len
            assert eng.tree_cache.evictable_size() >= 12
            assert all(c.ok for c in eng.check_memory(idle=False))
            eng.check_integrity()
        assert_clean_idle(eng)
        return eng, a, b

    alone, a0, _ = run(False)
    eng, a, b = run(True)
    assert _order(eng) == [b, a]
    assert outputs(eng)[a].reason == FinishReason.LENGTH
    assert outputs(eng)[a].output_ids == outputs(alone)[a0].output_ids


@pytest.mark.parametrize("gap, threshold", [(5, 10), (1, 1)])
def test_no_preemption_within_the_priority_gap_threshold(gap, threshold):
    """A running request is preempted only by a priority more than the threshold above its own
    (SGLang's default threshold is 10)."""
    eng = _engine(max_running_requests=1, priority_scheduling_preemption_threshold=threshold)
    a = eng.add_request(_prompt(2, 12), 10, priority=0)
    for _ in range(3):
        eng.step()
    b = eng.add_request(_prompt(50, 6), 4, priority=gap)
    assert_clean_idle(eng)
    assert eng.num_retractions == 0 and _order(eng) == [a, b]


def test_no_preemption_when_the_victims_output_reserve_cannot_cover_the_newcomer():
    """64 slots: A (20 + 10) leaves rem_total = 64 - 21 - 9 = 34; B (40 + 20) needs 60 - 34 = 26 more,
    more than A's remaining output (9) frees from the budget: nobody is preempted."""
    eng = _engine(max_running_requests=1, num_slots=64)
    a = eng.add_request(_prompt(2, 20), 10, priority=0)
    eng.step()
    b = eng.add_request(_prompt(30, 40), 20, priority=9)
    eng.step()
    assert eng.num_retractions == 0 and eng.running_batch[0].rid == a
    assert_clean_idle(eng)
    assert _order(eng) == [a, b]


def test_queue_limit_aborts_the_newcomer_without_priority_scheduling():
    eng = Scheduler(get_preset("default").config(max_running_requests=1, max_queued_requests=2))
    a = eng.add_request(_prompt(2, 8), 6)
    eng.step()
    b, c = eng.add_request(_prompt(20, 8), 2), eng.add_request(_prompt(40, 8), 2)
    d = eng.add_request(_prompt(60, 8), 2, priority=9)  # ignored without priority scheduling
    eng.step()
    assert [r.rid for r in eng.waiting_queue] == [b, c]
    assert outputs(eng)[d].reason == FinishReason.ABORT and outputs(eng)[d].output_ids == []
    assert_clean_idle(eng)
    assert _order(eng) == [d, a, b, c]


def test_queue_limit_with_priority_aborts_the_least_preferred_waiting_request_for_a_better_newcomer():
    """Two waiting places: D (priority 9) displaces the newest of the lowest (C, priority 1 after B);
    E (priority 1) is no better than the worst waiting one (B, 1) and is itself aborted."""
    eng = _engine(max_running_requests=1, max_queued_requests=2, priority_scheduling_preemption_threshold=100)
    a = eng.add_request(_prompt(2, 8), 6, priority=0)
    eng.step()
    b, c = eng.add_request(_prompt(20, 8), 2, priority=1), eng.add_request(_prompt(40, 8), 2, priority=1)
    d = eng.add_request(_prompt(60, 8), 2, priority=9)
    e = eng.add_request(_prompt(80, 8), 2, priority=1)
    eng.step()
    assert outputs(eng)[c].reason == FinishReason.ABORT and outputs(eng)[e].reason == FinishReason.ABORT
    assert_clean_idle(eng)
    assert _order(eng) == [c, e, a, d, b]


def test_priority_preset_draws_priorities_and_rejects_pd_decode():
    assert "priority" in program_features(get_preset("priority").config())
    assert "priority" not in program_features(get_preset("default").config())
    with pytest.raises(ValueError, match="aggregated serving"):
        get_preset("pd-decode").config(enable_priority_scheduling=True)
