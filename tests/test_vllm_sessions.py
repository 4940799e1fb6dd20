"""Streaming-input sessions on the vLLM target (``streaming_sessions``, the ``vllm-sessions`` presets): a
session's chunks drive one resumable ``Request`` of vLLM 0.33.0's Scheduler / AsyncScheduler; a session
waiting for input holds its KV and is no hang; a closed or aborted one gives every block back; the
planted fault ``close-waiting-session-keeps-blocks`` is found and minimized, and the same program is
clean without it; vLLM's own session-past-max_model_len bug (corpora/vllm/open) reproduces."""

import os

import pytest

from kvaudit import replay
from kvaudit.audit.runner import AuditedRun, execute
from kvaudit.program import Abort, CloseSession, Idle, OpenSession, Step, Submit
from kvaudit.search.minimize import minimize
from kvaudit.targets.vllm.config import VLLM_PRESETS

pytestmark = pytest.mark.vllm

PRESETS = ["vllm-sessions", "vllm-sessions-async"]
RID = "req-000001"


def run_of(preset, **changes):
    return AuditedRun(VLLM_PRESETS[preset].config(**changes))


def play(run, ops):
    for op in ops:
        assert run.apply(op) == [], [f.summary() for f in run.findings]


def free_blocks(run):
    return run.target.manager.block_pool.get_num_free_blocks()


@pytest.mark.parametrize("preset", PRESETS)
def test_a_sessions_next_chunk_resumes_its_request_and_the_driver_follows_vllms_rewrite(preset):
    """Turn 1 (20-token prompt, 4 tokens out) stops and waits; turn 2's 10 tokens join the prompt with
    turn 1's outputs but its last; turn 3, sent while turn 2 runs, is queued and taken in at its stop."""
    with run_of(preset) as run:
        t = run.target
        assert t.reach()["session_turns"] == 0
        play(run, [OpenSession(), Submit(1, 20, 4, session=0), Idle()])
        request = t.scheduler.requests[RID]
        assert request.status.name == "WAITING_FOR_STREAMING_REQ" and t.is_idle() and t.stalled()
        turn1 = list(request.all_token_ids)
        play(run, [Submit(2, 10, 3, stop_at=2, session=0), Step(1), Submit(3, 5, 3, session=0), Idle()])
        assert t.submitted == [RID] and t.reach()["session_turns"] == 2
        assert request.all_token_ids[:23] == turn1[:23] and request.num_prompt_tokens == 23 + 10 + 1 + 5
        assert t.texts[RID] == list(request.all_token_ids) and request.num_tokens == 39 + 3
        play(run, [CloseSession(0), Idle()])
        assert not t.scheduler.requests and free_blocks(run) == t.config.num_gpu_blocks - 1


@pytest.mark.parametrize("preset", PRESETS)
def test_closing_or_aborting_a_running_session_frees_everything(preset):
    with run_of(preset) as run:
        t = run.target
        play(run, [OpenSession(), OpenSession(), Submit(0, 30, 8, session=0), Submit(0, 30, 8, session=1),
                   Step(1), CloseSession(0), Abort(1), Step(2)])
        assert len(t.scheduler.requests) == 1  # the closed one finishes at its turn's stop
        play(run, [Idle()])
        assert not t.scheduler.requests and free_blocks(run) == t.config.num_gpu_blocks - 1
        play(run, [Submit(0, 4, 2, session=1), CloseSession(0), Idle()])  # a finished session: nothing sent
        assert t.submitted == ["req-000001", "req-000002"]


def test_a_request_kept_out_by_a_session_waiting_for_input_is_a_stall_not_a_hang():
    """Two sessions (32-token prompts, the cap) hold 2 x 5 of 12 blocks while they wait; a third request cannot
    be admitted until one closes: vLLM waits for the client too. Idle gives up quietly; the close lets it run."""
    with run_of("vllm-sessions", num_gpu_blocks=13, block_size=8, max_model_len=64, max_num_batched_tokens=64,
                enable_chunked_prefill=False) as run:
        t = run.target
        play(run, [OpenSession(), OpenSession(), Submit(0, 40, 4, session=0), Submit(1, 40, 4, session=1), Idle(),
                   Submit(2, 40, 4), Idle()])
        assert t.stalled() and not t.is_idle() and t.stuck() == "waiting:waiting"
        play(run, [CloseSession(0), Idle()])
        assert t.is_idle() and "req-000003" not in t.scheduler.requests


PROGRAM = [OpenSession(), OpenSession(), Submit(0, 12, 3, session=0), Submit(1, 6, 2), Step(2),
           Submit(0, 9, 2, session=1), Step(1), Submit(2, 5, 3, session=0), Abort(1), Idle(), CloseSession(1),
           Step(1), CloseSession(0), Idle()]


def test_the_planted_fault_is_found_minimized_and_the_program_is_clean_without_it():
    with run_of("vllm-sessions") as run:
        play(run, PROGRAM)  # clean without the fault
    with run_of("vllm-sessions", bugs=frozenset({"close-waiting-session-keeps-blocks"})) as run:
        found = [f for op in PROGRAM for f in run.apply(op)]
    (f,) = found
    assert f.kind == "leak" and f.signature.endswith("/from:waiting_for_streaming_req")
    small = minimize(VLLM_PRESETS["vllm-sessions"].config(bugs=frozenset({"close-waiting-session-keeps-blocks"})),
                     PROGRAM, f.signature)
    kinds = [op.kind for op in small]
    assert len(small) == 5 and kinds[:2] == ["open_session", "submit"] and kinds[3:] == ["close_session", "idle"]


OPEN = os.path.join(os.path.dirname(__file__), "..", "corpora", "vllm", "open")


@pytest.mark.parametrize("name", sorted(n for n in os.listdir(OPEN) if n.endswith(".json")))
def test_vllm_0_33_0s_own_session_past_max_model_len_reproduces(name):
    """corpora/vllm/open: a session whose chunks add up past max_model_len (vLLM #42489's cause), with no
    fault: each file's finding at its last op."""
    config, program, recorded, _ = replay.load(os.path.join(OPEN, name))
    assert not config.bugs and config.streaming_sessions
    ex = execute(config, program)
    assert recorded[0].signature in ex.signatures and ex.ops_run == len(program)
