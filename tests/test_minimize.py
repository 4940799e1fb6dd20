"""Tests for kvaudit.search.minimize: ddmin on pure predicates, then whole-program minimization."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvaudit.targets.eut.presets import get_preset
from kvaudit.search.minimize import ddmin, minimize, reproduces, simplify_round
from kvaudit.program import Abort, HealthCheck, Idle, MemoryPressure, Step, Submit
from kvaudit.audit.runner import execute

BUG = "hisparse-prebuilt-skip-finish"


def counting(pred):
    calls = []

    def fails(xs):
        calls.append(list(xs))
        return pred(xs)

    return fails, calls


# -- ddmin on pure predicates ----------------------------------------------------------------------

def test_ddmin_finds_the_two_needed_elements():
    fails, calls = counting(lambda xs: 3 in xs and 7 in xs)
    assert ddmin(list(range(10)), fails) == [3, 7]
    assert len(calls) < 60


def test_ddmin_result_is_one_minimal():
    pred = lambda xs: sum(xs) >= 10 and 0 in xs  # noqa: E731  (not monotone in a simple way)
    out = ddmin([5, 0, 1, 4, 2, 6, 3], pred)
    assert pred(out)
    for i in range(len(out)):
        assert not pred(out[:i] + out[i + 1:]), f"dropping {out[i]} still fails: {out} is not 1-minimal"


def test_ddmin_keeps_order_and_single_element():
    assert ddmin(list("abcdefgh"), lambda xs: "f" in xs) == ["f"]
    assert ddmin(["x"], lambda xs: True) == ["x"]


def test_ddmin_keeps_a_list_where_every_element_is_needed():
    xs = [1, 2, 3, 4, 5]
    assert ddmin(xs, lambda ys: ys == [1, 2, 3, 4, 5] or set(ys) >= set(xs)) == xs


@given(st.lists(st.integers(0, 30), min_size=1, max_size=25, unique=True), st.data())
def test_ddmin_returns_exactly_the_needed_subset(xs, data):
    needed = data.draw(st.lists(st.sampled_from(xs), min_size=1, max_size=4, unique=True))
    out = ddmin(list(xs), lambda ys: set(needed) <= set(ys))
    assert out == [x for x in xs if x in needed]


def simplify_args(ops, fails):
    """:func:`simplify_round` until a round changes nothing (as :func:`minimize`'s fixpoint applies it)."""
    while (simpler := simplify_round(ops, fails)) != ops:
        ops = simpler
    return ops


def test_simplify_args_pulls_arguments_toward_simple_values():
    ops = [Submit(family=3, prompt_len=20, max_new_tokens=9, stop_at=4), Step(4), Abort(5)]
    out = simplify_args(ops, lambda p: any(isinstance(o, Submit) for o in p))
    sub = out[0]
    assert (sub.family, sub.stop_at) == (0, None)
    assert sub.prompt_len <= 1
    assert out[1:] == [Step(1), Abort(0)]


def test_simplify_args_keeps_what_the_predicate_needs():
    ops = [Submit(family=2, prompt_len=20, max_new_tokens=9), Step(4)]
    out = simplify_args(ops, lambda p: p[0].prompt_len >= 10 and p[1].n >= 2)
    assert out[0].prompt_len == 10 and out[1].n == 2


def test_simplify_args_lowers_an_argument_by_one_where_its_half_loses_the_finding():
    """The failure needs prompt_len >= 15, a 3-step step and a flush waiting 2 steps: their floors and halves
    lose it, one less each time keeps it, so the result is the local minimum (it kept 20, 4 and 6 before)."""
    from kvaudit.program import FlushCache

    ops = [Submit(family=0, prompt_len=20, max_new_tokens=1), Step(4), FlushCache(timeout=6)]
    out = simplify_args(ops, lambda p: p[0].prompt_len >= 15 and p[1].n >= 3 and p[2].timeout >= 2)
    assert out == [Submit(family=0, prompt_len=15, max_new_tokens=1), Step(3), FlushCache(timeout=2)]


def test_simplify_args_respects_the_floors():
    out = simplify_args([Submit(family=3, prompt_len=20, max_new_tokens=9, stop_at=4)], lambda p: True)
    assert out == [Submit(0, 1, 1, None)]


# -- minimize on the engine ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def buggy_config():
    return get_preset("pd-decode-hisparse").config(bugs={BUG})


LONG_PROGRAM = [
    Submit(0, 12, 5), Step(2), Submit(1, 8, 3, 2), Step(1), Abort(0), Step(3), Submit(2, 20, 6), Step(2),
    Idle(), Submit(3, 5, 4), Abort(None), Step(1), Idle(), HealthCheck(), Step(2), Submit(1, 9, 2), Step(4),
    Submit(0, 30, 7), Step(3), Idle(),
]


def test_minimize_shrinks_the_hisparse_health_check_leak(buggy_config):
    ex = execute(buggy_config, LONG_PROGRAM)
    assert ex.findings, "the long program should reach the leak"
    sig = ex.signatures[0]
    assert sig.startswith("leak/hisparse_")

    small = minimize(buggy_config, LONG_PROGRAM, sig)

    assert 1 <= len(small) <= 4
    assert any(isinstance(op, HealthCheck) for op in small)
    assert reproduces(buggy_config, small, sig)
    assert sig in execute(buggy_config, small).signatures
    fixed = buggy_config.replace(bugs=frozenset())
    assert execute(fixed, small).findings == [], "without the bug the minimized program is clean"


def test_minimize_is_deterministic(buggy_config):
    sig = execute(buggy_config, LONG_PROGRAM).signatures[0]
    assert minimize(buggy_config, LONG_PROGRAM, sig) == minimize(buggy_config, LONG_PROGRAM, sig)


def test_minimize_rejects_a_program_that_does_not_reproduce(buggy_config):
    clean = [Submit(0, 6, 3), Step(2), Idle()]
    with pytest.raises(ValueError, match="does not reproduce"):
        minimize(buggy_config, clean, "leak/hisparse_device/admit_request_direct@hisparse.py/process_batch_result_prebuilt@scheduler_disagg_decode_mixin.py")


def test_minimize_rejects_a_signature_the_program_does_not_yield(buggy_config):
    sig = execute(buggy_config, LONG_PROGRAM).signatures[0]
    with pytest.raises(ValueError):
        minimize(buggy_config, LONG_PROGRAM, sig.replace("leak/", "double-free/"))
    with pytest.raises(ValueError):
        minimize(buggy_config.replace(bugs=frozenset()), LONG_PROGRAM, sig)


def test_minimize_of_empty_program_raises(buggy_config):
    with pytest.raises(ValueError):
        minimize(buggy_config, [], "leak/hisparse_device/admit_request_direct@hisparse.py/process_batch_result_prebuilt@scheduler_disagg_decode_mixin.py")


def test_adjacent_steps_are_folded_when_the_program_still_fails():
    from kvaudit.search.minimize import merge_steps
    from kvaudit.program import Idle, Step, Submit

    def fails(ops):  # fails while at least 3 scheduler steps run before the idle
        return sum(op.n for op in ops if isinstance(op, Step)) >= 3 and isinstance(ops[-1], Idle)

    ops = [Submit(), Step(1), Step(1), Step(2), Idle()]
    assert merge_steps(ops, fails) == [Submit(), Step(4), Idle()]
    assert merge_steps([Submit(), Step(1), Idle()], fails) == [Submit(), Step(1), Idle()]


def test_no_op_arguments_are_dropped_on_a_preset_without_sessions():
    """``session=1`` means nothing on the retract preset (no streaming sessions, no open session):
    the minimized program has no session argument left, even when every other argument of its
    submits needs simplifying too (the halving rounds used to run out before reaching it)."""
    config = get_preset("retract").config(bugs={"retract-unaligned-page"})
    assert not config.enable_streaming_session
    program = [MemoryPressure(), Submit(3, 9, 8, 5, session=1), Submit(2, 7, 9, 6, session=1), Idle()]
    sig = execute(config, program).signatures[0]
    small = minimize(config, program, sig)
    assert sig in execute(config, small).signatures
    submits = [op for op in small if isinstance(op, Submit)]
    assert submits and all(op.session is None for op in submits), small


def test_reset_defaults_keeps_an_argument_the_failure_needs():
    from kvaudit.search.minimize import reset_defaults

    ops = [Submit(0, 4, 4, session=2, priority=3), Submit(0, 4, 4, session=1)]
    out = reset_defaults(ops, lambda p: p[0].priority == 3)
    assert out == [Submit(0, 4, 4, priority=3), Submit(0, 4, 4)]


def test_minimized_programs_keep_no_argument_a_simpler_value_would_do_and_minimize_again_is_a_no_op():
    """The corpus fuzzer's program for evictable-size-uses-key-len (seed 1): minimizing it kept
    ``stop_at=11`` beside ``max_new_tokens=11`` (the argument rounds ran out halving prompt_len first),
    and `kvaudit minimize` of the result removed it. Every simpler value of every argument left must
    lose the finding, and a second minimize returns the program unchanged."""
    from kvaudit.program import Abort, CloseSession
    from kvaudit.search.minimize import _simpler

    config = get_preset("paged").config(bugs={"evictable-size-uses-key-len"})
    program = [Step(1), Submit(1, 64, 8), Abort(0), Idle(), CloseSession(2), Idle(), Submit(1, 41, 1, 11),
               Submit(6, 93, 1), Abort(3), CloseSession(2), Submit(6, 72, 11, 11, ignore_eos=1), Idle()]
    sig = "accounting-drift/token_to_kv_pool/counter:evictable"
    small = minimize(config, program, sig)
    assert reproduces(config, small, sig)
    for i, op in enumerate(small):
        for simpler in _simpler(op):
            assert not reproduces(config, small[:i] + [simpler] + small[i + 1:], sig), (small, simpler)
    assert minimize(config, small, sig) == small


def test_a_session_handle_is_lowered_to_the_one_open_session():
    """``session=3`` with one open session names session 0 (handles pick modulo the open ones): the minimized
    program says ``session=0`` (it used to keep 3, whose only simpler form, None, loses the finding)."""
    from kvaudit.program import OpenSession

    config = get_preset("streaming-session").config(bugs={"session-tail-not-trimmed"})
    program = [OpenSession(), Submit(0, 1, 3, 1, session=3), Idle()]
    sig = execute(config, program).signatures[0]
    small = minimize(config, program, sig)
    assert [op.session for op in small if isinstance(op, Submit)] == [0], small


# -- a watchdog hang: candidates under a shorter step limit ------------------------------------------

HANG_PROGRAM = [Submit(0, 8, 4), HealthCheck(), Step(1), Submit(1, 4, 2), Step(1), HealthCheck(), Step(1), Step(2),
                Idle()]


def _stuck_engine(monkeypatch, slow: float):
    """The eut's scheduler step never returns from its 5th forward (until the watchdog's StepTimeout), and in
    every run but the first sleeps ``slow`` s at its 4th; the user's step limit 1.2 s, the probe's 0.2 s (the
    watchdog's least). Returns the step limit of every run."""
    import time

    from engine_under_test.scheduler import Scheduler
    from kvaudit.audit import runner
    from kvaudit.search import minimize as minimize_mod

    step = Scheduler.step

    def stuck(self):
        if self.forward_ct == 3 and len(limits) > 1:
            time.sleep(slow)
        while self.forward_ct >= 4:
            time.sleep(0.01)
        return step(self)

    limits = []
    monkeypatch.setattr(Scheduler, "step", stuck)
    monkeypatch.setattr(runner, "_step_timeout", 1.2)
    monkeypatch.setattr(minimize_mod, "HANG_PROBE", 0.2, raising=False)  # (absent before: the limits tell)

    def spy(*args, **kwargs):
        limits.append(kwargs.get("step_limit"))
        return execute(*args, **kwargs)

    monkeypatch.setattr(minimize_mod, "execute", spy)
    return limits


def test_a_watchdog_hangs_candidates_run_under_the_probes_limit_and_its_result_under_the_users(monkeypatch):
    """Every candidate that reproduces a watchdog hang used to wait the user's whole step limit (10 s by
    default): they run under the probe's, and the result once more under the user's."""
    from kvaudit.audit.runner import is_watchdog_hang

    limits = _stuck_engine(monkeypatch, slow=0.0)
    hang = execute(get_preset("default").config(), HANG_PROGRAM, full_stacks=False).findings[0]
    assert is_watchdog_hang(hang)
    limits.clear()
    small = minimize(get_preset("default").config(), HANG_PROGRAM, hang.signature)
    assert limits[0] is None and limits[-1] is None, limits  # the input and the result: the user's limit
    assert set(limits[1:-1]) == {0.2}, limits
    assert reproduces(get_preset("default").config(), small, hang.signature)


def test_a_slow_step_the_probe_took_for_the_hang_sends_minimization_back_to_the_users_limit(monkeypatch):
    """A 0.5 s step the input's run did not take (under the user's 1.2 s) is a hang at the same frame under the
    probe's 0.2 s: the probe's result does not hang under the user's limit, and minimization starts again
    there; its result reproduces."""
    limits = _stuck_engine(monkeypatch, slow=0.5)
    config = get_preset("default").config()
    sig = execute(config, HANG_PROGRAM, full_stacks=False).signatures[0]
    limits.clear()
    small = minimize(config, HANG_PROGRAM, sig)
    probed = limits.index(0.2)
    assert limits[-1] is None and None in limits[probed:-1], limits  # candidates again under the user's limit
    assert reproduces(config, small, sig), small


def test_ctrl_c_at_the_recheck_under_the_users_limit_writes_the_input_where_the_probes_result_does_not_reproduce(
        tmp_path, monkeypatch):
    """tb66: Ctrl-C while a watchdog hang's candidates ran under the probe's limit (here: at the re-check of its
    result) wrote nothing ("... did not reproduce ...: nothing written", exit 130) where that result only hung
    because the probe cut a slow step short, though the input reproduced. The last program that reproduced under
    the user's limit (here the input) is written instead."""
    from cli_helpers import invoke

    from kvaudit import replay
    from kvaudit.search import minimize as minimize_mod

    limits = _stuck_engine(monkeypatch, slow=0.5)
    config = get_preset("default").config()
    findings = execute(config, HANG_PROGRAM, full_stacks=False).findings
    spied = minimize_mod.execute

    def ctrl_c_at_the_recheck(*args, **kwargs):
        if kwargs.get("step_limit") is None and 0.2 in limits:  # the first run under the user's after the probe's
            raise KeyboardInterrupt
        return spied(*args, **kwargs)

    monkeypatch.setattr(minimize_mod, "execute", ctrl_c_at_the_recheck)
    src, out = str(tmp_path / "hang.json"), tmp_path / "hang.min.json"
    replay.write_atomic(src, replay.to_doc(config, HANG_PROGRAM, findings))
    limits.clear()
    r = invoke("minimize", src, "-o", str(out))
    assert r.exit_code == 130, r.output
    assert out.exists(), r.stderr
    _, small, written, doc = replay.load(str(out))
    assert small == HANG_PROGRAM and written[0].signature == findings[0].signature, r.stderr
    assert doc["minimized"] is False


def _hang_minimized(monkeypatch, slow: float, on_run=None):
    """(the run limits of minimizing HANG_PROGRAM on :func:`_stuck_engine`, its signature, its result)."""
    limits = _stuck_engine(monkeypatch, slow=slow)
    config = get_preset("default").config()
    sig = execute(config, HANG_PROGRAM, full_stacks=False).signatures[0]
    limits.clear()
    small = minimize(config, HANG_PROGRAM, sig, on_run=on_run and (lambda runs, n: on_run(runs, len(limits))))
    return limits, sig, small


@pytest.mark.parametrize("slow", [0.0, 0.5], ids=["recheck-reproduces", "recheck-fails-and-restarts"])
def test_the_recheck_under_the_users_limit_is_a_run(monkeypatch, slow):
    """tb66: the re-check of a watchdog hang's result under the user's limit was not reported to ``on_run``:
    it is a run (an ``on_run`` follows it), and where it fails the restart under the user's limit counts on
    (its cleared cache made ``runs`` start again from 1)."""
    reported = []
    limits, _, small = _hang_minimized(monkeypatch, slow, on_run=lambda runs, ran: reported.append((runs, ran)))
    assert limits[-1] is None and 0.2 in limits and small != HANG_PROGRAM, limits
    at_the_recheck = limits.index(None, 1) + 1  # the runs up to the re-check's (the first None after the input)
    assert at_the_recheck in [ran for _, ran in reported], (reported, limits)  # an on_run after it
    assert [runs for runs, _ in reported] == list(range(1, len(reported) + 1)), reported


def test_the_recheck_under_the_users_limit_does_not_start_past_until(monkeypatch):
    """tb66: the re-check of a watchdog hang's result under the user's limit started past ``until``. It does
    not: OutOfTime carries the program last checked under the user's limit (the input)."""
    import time as real_time
    from types import SimpleNamespace

    from kvaudit.search import minimize as minimize_mod
    from kvaudit.search.minimize import OutOfTime

    limits, sig, small = _hang_minimized(monkeypatch, 0.0)
    assert limits[-1] is None and 0.2 in limits and small != HANG_PROGRAM, limits
    config, probes = get_preset("default").config(), len(limits) - 1  # the runs before the re-check
    limits.clear()
    clock = SimpleNamespace(monotonic=lambda: real_time.monotonic() + (1e6 if len(limits) >= probes else 0.0))
    monkeypatch.setattr(minimize_mod, "time", clock)
    with pytest.raises(OutOfTime) as caught:
        minimize(config, HANG_PROGRAM, sig, until=real_time.monotonic() + 1e5)
    assert len(limits) == probes and caught.value.smallest == HANG_PROGRAM, limits
