"""PD prefill with optimistic prefill and streaming sessions (presets ``sglang-pd-prefill-optimistic`` and
``sglang-pd-prefill-session``): a request prefilled before decode bootstrapped parks in the inflight queue and,
when the rows run out with requests waiting, yields them back (SGLang's ``optimistic_release_and_requeue``);
a streaming session's turns run on the prefill server (issue 37, the history candidate of the PD prefill
requeue: corpora/sglang/README.md, "PD prefill: optimistic requeue and streaming sessions").
"""

import pytest

from kvaudit.audit.runner import AuditedRun, execute
from kvaudit.program import Idle, OpenSession, Step, Submit
from kvaudit.targets.sglang.config import SGLANG_PRESETS

pytestmark = pytest.mark.sglang

# four rows: a session turn and three plain requests park in the inflight queue (decode bootstraps in 4
# steps), a fifth waits, so each parked request yields its row in turn
FILL = [Submit(0, 1, 1), Submit(0, 1, 1), Submit(0, 1, 1)]


def cfg(preset="sglang-pd-prefill-optimistic", **kw):
    return SGLANG_PRESETS[preset].config(**kw)


def pre(target):
    return target.feature("pd-prefill")


def test_a_parked_optimistic_request_yields_its_row_to_a_waiting_one_and_everything_comes_back():
    with AuditedRun(cfg()) as run:
        t = run.target
        assert run.apply(Submit(0, 6, 1)) == [] and run.apply(Step(1)) == []
        # prefilled before its decode bootstrapped: parked in the inflight queue, still pending bootstrap
        parked = pre(t).sched.disagg_prefill_inflight_queue
        assert [r.rid for r in parked] == ["r0"] and parked[0].pending_bootstrap
        for op in FILL + [Submit(0, 1, 1), Idle()]:
            assert run.apply(op) == []
        reach = t.reach()
        assert reach["prefill_optimistic_requeues"] > 0
        assert reach["prefill_transfers_done"] == 5
        assert t.allocator.available_size() + t.tree_cache.evictable_size() == t.allocator.size
        assert t.req_to_token_pool.available_size() == t._row_count()


def test_without_optimistic_prefill_a_request_waits_for_its_bootstrap_and_nothing_is_requeued():
    with AuditedRun(cfg(optimistic_prefill_attempts=0)) as run:
        t = run.target
        assert run.apply(Submit(0, 6, 1)) == [] and run.apply(Step(1)) == []
        assert [r.rid for r in pre(t).bootstrap_queue.queue] == ["r0"]
        assert run.apply(Idle()) == [] and pre(t).counts["prefill_optimistic_requeues"] == 0
        assert "prefill_optimistic_requeues" not in t.reach()  # reach leaves out a path the config turns off


def test_streaming_session_turns_run_on_a_prefill_server_on_the_sessions_record():
    with AuditedRun(cfg("sglang-pd-prefill-session")) as run:
        t = run.target
        for op in [OpenSession(), Submit(0, 6, 1, session=0), Idle(), Submit(0, 3, 1, session=0), Idle()]:
            assert run.apply(op) == []
        [session] = t.session_controller.sessions.values()
        [slot] = t.tree_cache.session.slots.values()
        assert not session._inflight and slot.kv.holds_kv  # the record stays in the slot between turns
        assert t.reach()["prefill_session_turns"] == 2 and t.reach()["prefill_transfers_done"] == 2
        [turn] = [n.req for n in session.req_nodes.values()]
        assert turn.bootstrap_host == "10.0.0.2" and len(turn.origin_input_ids) == 6 + 1 + 3


def session_run():
    """The session preset (two rows): a turn and a plain request park, a second plain one waits."""
    return AuditedRun(cfg("sglang-pd-prefill-session"))


def test_a_requeued_session_turn_is_no_longer_in_flight_for_its_session():
    """What the history candidate says 0.5.22 does and 0.5.23 fixed: 0.5.23 clears the mark too (the
    release's ``StreamingSession.try_cache_finished_req`` calls ``Session.finish_req`` for the unfinished,
    requeued turn), so a second turn is accepted while the first waits to re-prefill."""
    with session_run() as run:
        t = run.target
        for op in [OpenSession(), Submit(0, 5, 1, session=0), Submit(0, 1, 1), Submit(0, 1, 1)]:
            assert run.apply(op) == []
        [session] = t.session_controller.sessions.values()
        for _ in range(3):
            if pre(t).counts["prefill_session_turns_requeued"]:
                break
            assert run.apply(Step(1)) == []
        assert pre(t).counts["prefill_session_turns_requeued"] == 1
        turn = next(r for r in t.waiting if r.session is session)
        assert not turn.finished() and not session._inflight
        assert [n.req for n in session.req_nodes.values()] == [turn]  # the unfinished turn is the last one


def test_a_requeued_first_turn_with_a_page_aligned_prompt_crashes_sglang_at_its_rematch():
    """corpora/sglang/crash-pd-prefill-requeued-first-turn-prefix-shrank.json: the first turn published its
    whole 36-token prompt (page 4) into its slot, the requeue keeps it, and the re-prefill's key is 35 tokens."""
    program = [OpenSession(), Submit(0, 36, 1, session=0), Submit(0, 1, 1), Submit(0, 1, 1), Idle()]
    found = execute(cfg("sglang-pd-prefill-session"), program).findings
    assert [f.signature for f in found] == ["crash/-/AssertionError@try_match_prefix@streaming_session.py/req:requeued"]
    assert "prefix shrank: prefix_len=35 < slot.kv.cache_protected_len=36" in found[0].message
    # one token more: the published prompt ends on the page below the key's end, and the same run is clean
    program[1] = Submit(0, 37, 1, session=0)
    assert execute(cfg("sglang-pd-prefill-session"), program).findings == []
    # a 1-token first turn: nothing published, but the retry's key is empty and the match frees the whole
    # record under the row the slot keeps (the same root cause, another assertion)
    program[1] = Submit(0, 1, 1, session=0)
    assert sorted(execute(cfg("sglang-pd-prefill-session"), program).signatures) == [
        "crash/-/AssertionError@alloc@memory_pool.py"]


def test_the_two_root_causes_of_the_try_match_prefix_assertion_have_two_signatures():
    """corpora/sglang/README.md findings 5 (a rejected turn clears ``_inflight``: the third turn shares the
    running first turn's record) and 13 (optimistic prefill requeued the first turn: its retry) raise the same
    assertion; the target's ``crash_by`` names the requeued retry, so each file replays to its own signature."""
    import os

    from kvaudit import replay

    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "corpora", "sglang")
    raised = "crash/-/AssertionError@try_match_prefix@streaming_session.py"
    for name, signature in (("crash-a1-try-match-prefix-prefix-shrank.json", raised),
                            ("crash-pd-prefill-requeued-first-turn-prefix-shrank.json", raised + "/req:requeued")):
        config, program, recorded, _ = replay.load(os.path.join(root, name))
        assert [f.signature for f in recorded] == [signature]
        assert sorted(execute(config, program).signatures) == [signature]


# the child (SGLang 0.5.22 as an overlay): the corpus crash's signature, and the requeued turn's session state
CHILD = """
import json
from kvaudit import replay
from kvaudit.audit.runner import AuditedRun, execute
from kvaudit.program import OpenSession, Step, Submit
from kvaudit.targets.sglang.boot import installed_version
from kvaudit.targets.sglang.config import SGLANG_PRESETS
config, program, _, _ = replay.load("corpora/sglang/crash-pd-prefill-requeued-first-turn-prefix-shrank.json")
crash = sorted(execute(config, program).signatures)
with AuditedRun(SGLANG_PRESETS["sglang-pd-prefill-session"].config()) as run:
    t = run.target
    for op in [OpenSession(), Submit(0, 5, 1, session=0)] + [Submit(0, 1, 1)] * 2:
        assert run.apply(op) == []
    counts = t.feature("pd-prefill").counts
    while not counts["prefill_session_turns_requeued"] and t.steps < 4:
        assert run.apply(Step(1)) == []
    [session] = t.session_controller.sessions.values()
    turn = [r for r in t.waiting if r.session is session]
    state = [counts["prefill_session_turns_requeued"], len(turn), session._inflight]
print(json.dumps({"version": installed_version(), "crash": crash, "requeued": state}))
"""


@pytest.mark.releases
def test_0_5_22_clears_the_in_flight_mark_and_crashes_as_0_5_23_does():
    """The history candidate (0.5.22's requeue calls ``_release_aborted_request``, so ``Session.abort_req``):
    not a history row, both releases end the requeue in ``finish_req`` and reach the same crash."""
    import json
    import os
    import subprocess
    import sys

    from release_helpers import child_env

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, cwd=root, timeout=300,
                       env=child_env("sglang", "0.5.22", root))
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out == {"version": "0.5.22",
                   "crash": ["crash/-/AssertionError@try_match_prefix@streaming_session.py/req:requeued"],
                   "requeued": [1, 1, False]}
