"""The runner's watchdog (a step that never returns is a hang finding naming where it is stuck),
its deadline (idle() stops at the budget without a false finding), and the engine's verdict once
drained to idle (issue 16, items 6 and 7)."""

import io
import time

import pytest
from rich.console import Console

from kvaudit.targets.eut.presets import get_preset
from engine_under_test.scheduler import Scheduler
from kvaudit import replay
from kvaudit.audit import oracles, runner
from kvaudit.program import Idle, Step, Submit
from kvaudit.reports.report import print_report
from kvaudit.audit.runner import AuditedRun, execute

SPIN_S = 30.0  # "forever" for a test: the old code, with no watchdog, returns after this and fails


def _spin_forever():
    end = time.monotonic() + SPIN_S
    while time.monotonic() < end:
        time.sleep(0.05)


@pytest.fixture
def hangs_after(monkeypatch):
    """Plant a fault from the test: the engine's step sleeps "forever" from its ``n``-th call on."""
    def plant(n: int):
        original = Scheduler.step

        def step(self):
            if self.forward_ct >= n:
                _spin_forever()
            return original(self)
        monkeypatch.setattr(Scheduler, "step", step)
    return plant


PROGRAM = [Submit(0, 8, 4), Step(2), Idle()]


def test_a_step_that_never_returns_is_a_hang_naming_the_stuck_frame(hangs_after):
    hangs_after(3)
    config = get_preset("default").config()
    t0 = time.monotonic()
    with AuditedRun(config, step_limit=0.5) as run:
        for op in PROGRAM:
            if run.apply(op):
                break
        assert run.apply(Idle()) == []  # nothing more runs on an interrupted engine
    assert time.monotonic() - t0 < 20  # (load-proof margin; without the watchdog: 60 s)
    (f,) = run.findings
    assert f.kind == "hang" and runner.is_watchdog_hang(f)
    assert f.alloc_sites[0].function == "_spin_forever"
    assert f.alloc_sites[0].file.endswith("test_runner_watchdog.py")
    assert "time.sleep(0.05)" in f.alloc_sites[0].source
    assert [s.function for s in f.alloc_sites[:2]] == ["_spin_forever", "step"]
    assert "stuck in test_runner_watchdog.py" in f.message and "0.5s" in f.message


def test_the_hang_replays_and_reports_the_stuck_frame(hangs_after, tmp_path):
    hangs_after(3)
    config = get_preset("default").config()
    runner.set_step_timeout(0.5)
    try:
        ex = execute(config, PROGRAM, drain=True)
    finally:
        runner.set_step_timeout(runner.DEFAULT_STEP_TIMEOUT)
    (f,) = ex.findings
    # a stuck step is named by its frame: another stuck step is another hang, not the idle() one
    assert f.signature == "hang/-/stuck:_spin_forever@test_runner_watchdog.py"
    assert f.alloc_sites[0].function == "_spin_forever"
    assert f.engine_check_at_idle == ["not drained: an engine step hung (the watchdog interrupted it)"]
    path = replay.write_atomic(str(tmp_path / "hang.json"), replay.to_doc(config, PROGRAM, ex.findings))
    _, _, (back,), _ = replay.load(path)
    assert back.alloc_sites == f.alloc_sites
    buf = io.StringIO()
    print_report(Console(file=buf, width=160, color_system=None), config, PROGRAM, [back])
    text = buf.getvalue()
    assert "stuck at:" in text and "#0 _spin_forever" in text and "allocated at:" not in text


def test_a_fast_engine_never_trips_the_watchdog():
    config = get_preset("default").config()
    with AuditedRun(config, step_limit=5.0) as run:
        for op in [Submit(0, 30, 8), Submit(1, 20, 8), Step(3), Idle()]:
            assert run.apply(op) == []
    assert not run.out_of_time


def test_idle_stops_at_the_deadline_without_a_false_hang(monkeypatch):
    """An idle() that would run MAX_IDLE_STEPS slow steps stops when the budget runs out: no
    finding, ``out_of_time`` set, every later op a no-op."""
    original = Scheduler.step

    def slow_step(self):
        time.sleep(0.02)  # 2,000 steps: 40 s
        return original(self)
    monkeypatch.setattr(Scheduler, "step", slow_step)
    monkeypatch.setattr(oracles, "ORACLES", [o._replace(run=lambda run: pytest.fail("a false hang"))
                                             if o.stage == "idle" else o for o in oracles.ORACLES])
    config = get_preset("default").config()
    t0 = time.monotonic()
    with AuditedRun(config, deadline=time.monotonic() + 1.0) as run:
        run.target.is_idle = lambda: False  # never drains
        assert run.apply(Submit(0, 8, 4)) == []
        assert run.apply(Idle()) == []
        assert run.out_of_time
        assert run.apply(Step(1)) == [] and run.target.steps < 100
    assert time.monotonic() - t0 < 10  # (load-proof margin; past its deadline the idle() ran 40 s)
    assert run.findings == []


def test_the_engine_verdict_once_drained_is_recorded_and_printed():
    """prefill-finish-leaks-row: the engine's check says ok when kvaudit detects the leak, and fails
    once the program is drained to idle (the row is still out); session-borrow-double-count is the
    other way round (the busy check double counts, the idle one balances)."""
    config, program, _, _ = replay.load("corpora/regressions/prefill-finish-leaks-row.json")
    (f,) = execute(config, program, drain=True).findings
    assert f.engine_check == ["engine check_memory(): ok"]
    assert f.engine_check_at_idle and "[req_to_token_pool]" in f.engine_check_at_idle[0]
    buf = io.StringIO()
    print_report(Console(file=buf, width=240, color_system=None), config, program, [f])
    lines = buf.getvalue().splitlines()
    assert any("engine check_memory(): ok" in line for line in lines)
    idle = [line for line in lines if "engine check_memory() once drained to idle: " in line]
    assert len(idle) == 1 and idle[0].endswith(  # off a terminal too, the line says which check failed
        "drained to idle: FAILED: [req_to_token_pool] available=15 + evictable=0 + protected=0 + session_held=0 + "
        "uncached=0 = 15 != total=16")

    config, program, _, _ = replay.load("corpora/regressions/session-borrow-double-count.json")
    f = execute(config, program, drain=True).findings[0]
    assert "session_held=1 + uncached=1 = 513 != total=512" in f.engine_check[0]
    assert f.engine_check_at_idle == ["engine check_memory(): ok"]
    assert execute(config, program).findings[0].engine_check_at_idle == []  # only when asked


def test_a_crash_while_draining_is_recorded(monkeypatch):
    config, program, _, _ = replay.load("corpora/regressions/prefill-finish-leaks-row.json")
    with AuditedRun(config) as run:
        for op in program:
            if run.apply(op):
                break

        def boom(self):
            raise RuntimeError("boom in step")
        monkeypatch.setattr(Scheduler, "step", boom)
        assert run.drain_verdict() == ["crashed while draining: RuntimeError: boom in step"]


def test_a_crash_disarms_the_watchdog(monkeypatch):
    """An engine step that raises is a crash finding, and the watchdog armed for that step is disarmed
    with it: no StepTimeout lands, a step limit later, in whatever the thread runs next (a history-suite
    worker died of that: 'kvaudit.audit.runner.StepTimeout' in the middle of its triage)."""
    def boom(self):
        raise RuntimeError("boom in step")
    monkeypatch.setattr(Scheduler, "step", boom)
    with AuditedRun(get_preset("default").config(), step_limit=0.3) as run:
        (f,) = run.apply(Step(1))
    assert f.kind == "crash" and "boom in step" in f.message
    assert f.alloc_sites[0].function == "boom"
    time.sleep(0.8)  # past the limit: with the watchdog still armed, StepTimeout lands in this sleep
    assert runner._WATCHDOG._armed == {}


def test_engine_check_at_idle_round_trips_and_is_validated():
    from kvaudit.audit.findings import Finding

    f = Finding(kind="leak", pool="p", message="m", engine_check_at_idle=["x"])
    assert Finding.from_dict(f.to_dict()).engine_check_at_idle == ["x"]
    with pytest.raises(ValueError, match="engine_check_at_idle"):
        Finding.from_dict({**f.to_dict(), "engine_check_at_idle": "ok"})


def test_a_step_timeout_swallowed_by_a_library_is_raised_again(monkeypatch, capsys):
    """The watchdog's StepTimeout can land where Python swallows it: a gc callback (Hypothesis
    installs one) prints 'Exception ignored in ... StepTimeout' and the step runs on. Seen at a
    budget's end in a clean sweep. It is raised again until the call ends, and the swallowed one
    leaves nothing in the log."""
    import sys

    swallowed = []

    def step(self):
        end = time.monotonic() + SPIN_S
        while time.monotonic() < end:
            try:
                time.sleep(0.01)
            except runner.StepTimeout:  # a library that eats exceptions, the first time only
                if swallowed:
                    raise
                swallowed.append(1)
                sys.unraisablehook(type("U", (), {"exc_type": runner.StepTimeout, "exc_value": runner.StepTimeout(),
                                                  "exc_traceback": None, "err_msg": None, "object": None})())
    monkeypatch.setattr(Scheduler, "step", step)
    t0 = time.monotonic()
    with AuditedRun(get_preset("default").config(), step_limit=0.5) as run:
        found = run.apply(Submit(0, 8, 4)) or run.apply(Step(1))
    assert swallowed and time.monotonic() - t0 < 10  # (without a second StepTimeout: SPIN_S)
    assert [f.kind for f in found] == ["hang"]
    assert "StepTimeout" not in capsys.readouterr().err


def test_an_interrupt_swallowed_by_a_gc_callback_leaves_no_traceback(capsys, monkeypatch):
    """A campaign worker's SIGTERM handler raises KeyboardInterrupt; landing in Hypothesis's gc
    callback it printed 'Exception ignored ... Traceback ... KeyboardInterrupt' in a CI log (seen in
    .ci/run). Once INTERRUPTED is set (the next op stops on it) it is left out; before, it is not."""
    import sys

    import gc

    monkeypatch.setattr(sys, "unraisablehook", sys.__unraisablehook__)
    runner.quiet_unraisable()

    def interrupted_in_gc(phase, info):  # the signal handler's KeyboardInterrupt, inside a gc callback
        if phase == "start":
            raise KeyboardInterrupt

    gc.callbacks.append(interrupted_in_gc)
    try:
        runner.INTERRUPTED.set()
        gc.collect()
        assert "KeyboardInterrupt" not in capsys.readouterr().err
        runner.INTERRUPTED.clear()
        gc.collect()  # not interrupted by kvaudit: someone else's problem, shown
        assert "KeyboardInterrupt" in capsys.readouterr().err
    finally:
        gc.callbacks.remove(interrupted_in_gc)
        runner.INTERRUPTED.clear()


def test_a_step_timeout_sent_again_while_the_interrupted_call_is_released_is_caught(monkeypatch):
    """The StepTimeout that interrupted a call holds the call's frames in its traceback. A --model tiny
    step over a 4M-slot pool held GBs of tensors, whose release, as the runner's handler let go of the
    StepTimeout, outlasted the watchdog's resend (RESEND_S): the resent one landed on the way back into the
    try, and `kvaudit replay` ended in a traceback (exit 1) with the watchdog still armed. Here the frame's
    object has the watchdog send again as it is released, while the watchdog is still armed for this thread
    (from C, as the watchdog's own send: nothing in between lets it land early)."""
    import ctypes
    import functools
    import threading

    tid = threading.get_ident()

    class Resend:  # its finalizer is the watchdog's send itself: no Python code runs in it
        __del__ = functools.partial(ctypes.pythonapi.PyThreadState_SetAsyncExc, ctypes.c_ulong(tid),
                                    ctypes.py_object(runner.StepTimeout))

    class Held:
        def __del__(self):
            if tid in runner._WATCHDOG._resend:  # still armed: it may send again now
                self.resend = Resend()  # (released with this object, after this method returned)

    def step(self):
        frame_holds = Held()  # noqa: F841 (released with the StepTimeout's traceback)
        _spin_forever()
    monkeypatch.setattr(Scheduler, "step", step)
    escaped = None
    try:
        with AuditedRun(get_preset("default").config(), step_limit=0.3) as run:
            found = run.apply(Step(1))
    except runner.StepTimeout as e:
        escaped = e
    finally:
        while runner._WATCHDOG._armed or runner._WATCHDOG._resend:  # (the old code left it armed)
            try:
                runner._WATCHDOG.disarm()
            except runner.StepTimeout:
                pass
    assert escaped is None, "a StepTimeout escaped the runner"
    assert [runner.is_watchdog_hang(f) for f in found] == [True]


def test_the_pytest_fixtures_fuzz_finds_a_hang_within_a_short_budget(hangs_after):
    """kvaudit.testing.fuzz (the pytest fixture's) kept the process's 10 s step limit whatever its budget: a step
    stuck for ever in a 3 s fuzz was cut short by the budget's end, no finding, and the test of an engine that hangs
    passed. It takes `kvaudit fuzz`'s limit for its budget now (1 s here), for that call only."""
    from kvaudit import testing

    hangs_after(3)
    result = testing.fuzz(get_preset("default").config(), max_time=3)
    assert [f.kind for f in result.findings] == ["hang"]
    assert result.signatures == ["hang/-/stuck:_spin_forever@test_runner_watchdog.py"]
    assert runner.step_timeout() == runner.DEFAULT_STEP_TIMEOUT  # (put back: the next test's runs keep it)
    for bad in (0.01, float("inf"), float("nan")):  # (refused as --step-timeout refuses them)
        with pytest.raises(ValueError, match="^step_timeout must be "):
            testing.fuzz(get_preset("default").config(), max_time=3, step_timeout=bad)


@pytest.mark.parametrize("bad", ["0.01", "1e-300", "inf", "nan", "1e300", "31536000.5"])
def test_the_pytest_fixtures_step_timeout_is_refused_in_the_words_of_step_timeout(bad):
    """kvaudit.testing.fuzz checked its step_timeout with a predicate of its own beside --step-timeout's, in other
    words ('step_timeout must be a finite number of seconds >= 0.2, got 0.01' against 'must be at least 0.2
    seconds (how often the watchdog looks for a step that started: ...), got 0.01'): one check
    (kvaudit.constants.check_step_timeout), one reason, whichever door the value came in by."""
    from cli_helpers import invoke, one_error_line

    from kvaudit import testing

    line = one_error_line(invoke("fuzz", "--max-time", "1", "--step-timeout", bad))
    cli = line.removeprefix("kvaudit: error: Invalid value for '--step-timeout': ").rsplit(" (see '", 1)[0]
    with pytest.raises(ValueError) as e:
        testing.fuzz(get_preset("default").config(), max_time=3, step_timeout=float(bad))
    assert str(e.value) == f"step_timeout {cli}"


@pytest.mark.parametrize("argument", ["step_timeout", "max_time"])
def test_the_pytest_fixtures_seconds_past_a_floats_range_are_a_value_error(argument):
    """Tester 66: kvaudit.testing.fuzz(step_timeout=10**400) raised OverflowError (max_time=10**400 too), not the
    ValueError its docstring names; 1e300 was taken where --step-timeout and --max-time stop at a year."""
    from kvaudit import testing

    for bad in (10**400, 1e300):
        with pytest.raises(ValueError, match=f"^{argument} must be at most 31536000 seconds \\(365d\\), got "):
            testing.fuzz(get_preset("default").config(), **{"max_time": 3, argument: bad})


def test_ci_finds_a_hang_within_a_presets_short_share(hangs_after, tmp_path):
    """ci kept the 10 s step limit whatever a preset's share of --max-time (its default 60 s over 13 presets: 4.6 s
    each): a step stuck for ever was cut short by the share's end, no finding, and the job over an engine that hangs
    passed ('fuzz default (4.0s, 1 executions)  clean'). Its search takes fuzz's limit for the share now (1 s);
    --step-timeout given is kept."""
    from cli_helpers import invoke

    hangs_after(3)
    (tmp_path / "reg").mkdir()
    try:
        r = invoke("ci", "--presets", "default", "--max-time", "4", "--regressions", str(tmp_path / "reg"),
                   "--out", str(tmp_path / "out"))
    finally:
        runner.set_step_timeout(runner.DEFAULT_STEP_TIMEOUT)  # (the process's: the next test's runs keep it)
    assert r.exit_code == 1, r.output
    assert "NEW hang/-/stuck:_spin_forever@test_runner_watchdog.py" in r.stdout, r.stdout
