"""The search's budget and counts (issue 16, item 6): Hypothesis's shrinking stops at --max-time,
"found after N executions" is the first hit, and an engine step that never returns ends the run
within the budget as a hang finding naming the stuck frame."""

import json
import os
import re
import time

import pytest

from kvaudit.targets.eut.presets import get_preset
from engine_under_test.scheduler import Scheduler
from kvaudit.search import fuzz, schedule
from kvaudit.audit import runner
from kvaudit.search.fuzz import FuzzStats, hypothesis_search
from kvaudit.audit.runner import execute

from cli_helpers import ROOT, invoke

BUG, PRESET, SEED = "session-borrow-double-count", "streaming-session", 1  # found in about 1 s, long to shrink


def _config():
    return get_preset(PRESET).config(bugs=frozenset([BUG]))


class _ClockJumpsAtFirstHit:
    """``time`` for kvaudit.search.fuzz whose clock jumps past any budget once ``stats`` saw its first hit:
    the budget is spent the moment the finding is made, deterministically."""

    def __init__(self, stats):
        self.stats = stats

    def monotonic(self):
        return time.monotonic() + (1e6 if self.stats.first_hit is not None else 0.0)


@pytest.fixture(autouse=True)
def _default_step_timeout():
    yield
    runner.set_step_timeout(runner.DEFAULT_STEP_TIMEOUT)  # the CLI's --step-timeout sets it process-wide


def test_shrinking_stops_when_the_budget_is_spent(monkeypatch):
    stats = FuzzStats()
    monkeypatch.setattr(fuzz, "time", _ClockJumpsAtFirstHit(stats))
    after_hit = []

    class CountingRun(schedule.AuditedRun):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            if stats.first_hit is not None:
                after_hit.append(self)
    monkeypatch.setattr(schedule, "AuditedRun", CountingRun)
    found = hypothesis_search(_config(), 60, SEED, stats)
    assert found is not None
    program, findings = found
    assert len(after_hit) <= 2  # unbounded, Hypothesis reruns it about 350 times
    assert findings[0].signature in execute(_config(), program, full_stacks=False).signatures  # a valid program


def test_a_search_with_a_finding_returns_within_its_budget(monkeypatch):
    """Past the deadline no new case starts but the one in flight (counted, not timed: a wall-clock
    margin failed under load; unbounded, the shrink runs about 350 more cases)."""
    budget = 3.0
    stats = FuzzStats()
    started = []

    class TimedRun(schedule.AuditedRun):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            started.append(time.monotonic())
    monkeypatch.setattr(schedule, "AuditedRun", TimedRun)
    t0 = time.monotonic()
    found = hypothesis_search(_config(), budget, SEED, stats)
    assert sum(t > t0 + budget for t in started) <= 2
    if found is not None:
        assert found[1][0].signature in execute(_config(), found[0], full_stacks=False).signatures


def test_a_clean_hypothesis_search_ends_its_batch_at_the_budget(monkeypatch):
    """Past the deadline with nothing found, the batch's remaining cases ran as no-ops, each building an
    engine: a 3 s --budget ended after about 4 s. A fake clock for kvaudit.search.fuzz, moved 0.1 s by
    each engine built (real time stays behind it: the engine's own deadline never cuts a program)."""
    import types

    clock = [time.monotonic()]
    monkeypatch.setattr(fuzz, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))

    class SlowBuild(schedule.AuditedRun):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            clock[0] += 0.1
    monkeypatch.setattr(schedule, "AuditedRun", SlowBuild)
    deadline = clock[0] + 1.0
    stats = FuzzStats()
    assert hypothesis_search(get_preset("default").config(), 1.0, SEED, stats) is None
    assert stats.executions > 0 and clock[0] - deadline <= 0.35, clock[0] - deadline  # unbounded: about 9 s


def test_a_flaky_hypothesis_batch_does_not_end_the_search(monkeypatch):
    """Hypothesis raised FlakyStrategyDefinition once at a budget's end on sglang-session, and the
    search died with exit 70 (an internal error). A flaky batch is dropped; the search goes on to its
    budget."""
    from hypothesis.errors import FlakyStrategyDefinition

    real, calls = fuzz.run_state_machine_as_test, []

    def flaky_first(machine, settings):
        calls.append(machine)
        if len(calls) == 1:
            raise FlakyStrategyDefinition("Inconsistent data generation! (planted)")
        return real(machine, settings=settings)

    monkeypatch.setattr(fuzz, "run_state_machine_as_test", flaky_first)
    clean = get_preset("default").config()
    assert hypothesis_search(clean, 1.5, SEED, FuzzStats(), batch_examples=5) is None
    assert len(calls) >= 2  # the search ran the next batch


@pytest.mark.slow
def test_executions_count_to_the_first_hit_and_shrinks_apart():
    stats = FuzzStats()
    found = hypothesis_search(_config(), 60, SEED, stats)
    assert found is not None and stats.first_hit is not None
    assert stats.executions == stats.first_hit[0]  # shrink reruns are not search executions
    assert stats.shrink_executions > 0


@pytest.mark.slow
def test_fuzz_reports_the_first_hit_not_the_shrink_executions(tmp_path):
    stats = FuzzStats()
    hypothesis_search(_config(), 60, SEED, stats)
    first = stats.first_hit[0]
    res = invoke("fuzz", "--preset", PRESET, "--bug", BUG, "--fuzzer", "hypothesis", "--seed", str(SEED),
                 "--max-time", "60", "--out", str(tmp_path), "--json", str(tmp_path / "run.json"))
    assert res.exit_code == 1, res.output
    m = re.search(r"found after (\d+) executions? in [\d.]+s \(search: (\d+) executions, then (\d+) shrinking",
                  res.stdout)
    assert m, res.stdout
    assert int(m.group(1)) == first and int(m.group(2)) == first and int(m.group(3)) > 0
    extra = json.loads((tmp_path / "run.json").read_text())
    assert extra.get("first_hit_executions", extra.get("extra", {}).get("first_hit_executions")) == first \
        or f'"first_hit_executions": {first}' in (tmp_path / "run.json").read_text()


def test_one_execution_is_said_in_the_singular(tmp_path):
    """The README's main job finds its bug in the first program: it said "(search: 1 executions"."""
    res = invoke("fuzz", "--preset", "pd-decode-hisparse", "--bug", "hisparse-prebuilt-skip-finish", "--seed", "1",
                 "--max-time", "60", "--out", str(tmp_path))
    assert res.exit_code == 1, res.output
    assert "found after 1 execution in " in res.stdout and "(search: 1 execution, " in res.stdout, res.stdout


def test_a_flaky_finding_does_not_end_the_search(tmp_path, monkeypatch):
    """A finding that does not replay is dropped and the search goes on past its signature, with the
    rest of the budget (it used to end the run: exit 0, "no findings", most of the budget unused)."""
    real, dropped = fuzz.triage, []

    def first_is_flaky(config, program, finding, **k):
        if not dropped:
            dropped.append(finding.signature)
            return None
        return real(config, program, finding, **k)

    monkeypatch.setattr(fuzz, "triage", first_is_flaky)
    res = invoke("fuzz", "--preset", "pd-decode-hisparse", "--bug", "hisparse-prebuilt-skip-finish",
                 "--fuzzer", "random", "--seed", "1", "--max-time", "60", "--out", str(tmp_path))
    assert res.exit_code == 1, res.output
    assert f"a finding ({dropped[0]}) did not replay 3 of 3 times" in res.stderr
    doc = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert doc["findings"][0]["signature"] != dropped[0]  # the search went on past the flaky signature


def test_a_finding_that_confirms_then_does_not_replay_while_minimizing_is_flaky(monkeypatch):
    """vLLM 0.16.0's connector hang (``fuzz --target vllm --bug free-under-inflight-step --preset
    vllm-kv-connector-small --max-time 2``, stop 50's exit 70): replayed 3 of 3, then not in minimize's first
    run, whose ValueError left the run as "internal error" (5 of 20 runs under load). It is flaky: triage
    returns None and the search goes on past it (test_a_flaky_finding_does_not_end_the_search)."""
    from kvaudit.search import minimize

    config = get_preset("pd-decode-hisparse").config(bugs=frozenset({"hisparse-prebuilt-skip-finish"}))
    program, findings = fuzz.random_search(config, 60, 1, FuzzStats())
    assert fuzz.confirm(config, program, findings[0].signature) == 3
    monkeypatch.setattr(minimize, "reproduces", lambda *a, **k: False)  # the 4th replay differs
    assert fuzz.triage(config, program, findings[0]) is None


@pytest.mark.parametrize("caller", ["cli", "pytest"])
def test_the_search_past_a_flaky_finding_keeps_its_corpus(tmp_path, monkeypatch, caller):
    """Every round after a flaky finding started from an empty corpus (`--step-timeout 0.0001`: every
    hang flaky, coverage fell from 254 features and 29 programs to 98/6, the `done` line said 66/3):
    now each round goes on from the last one's corpus, and the coverage the status shows never falls.
    The same in :func:`kvaudit.testing.fuzz` (the pytest fixture's search)."""
    from kvaudit import testing
    from kvaudit.search import corpus_fuzz

    real, rounds = corpus_fuzz.corpus_search, []

    def recording(*a, corpus=None, **k):
        rounds.append([corpus, len(corpus.features) if corpus is not None else 0])
        try:
            return real(*a, corpus=corpus, **k)
        finally:
            rounds[-1].append(len(corpus.features) if corpus is not None else 0)

    monkeypatch.setattr(corpus_fuzz, "corpus_search", recording)
    monkeypatch.setattr(fuzz, "triage", lambda *a, **k: None)  # every finding is flaky
    bug = ["--preset", "overlap", "--bug", "aborted-kv-inserted"]  # found after about 24 programs
    if caller == "cli":
        res = invoke("fuzz", *bug, "--fuzzer", "corpus", "--seed", "1", "--max-time", "3", "--out", str(tmp_path))
        assert res.exit_code == 0, res.output
        flaky = res.stderr.count("did not replay")
        shown = [int(n) for n in re.findall(r"coverage=(\d+)", res.stderr)]
        assert shown and shown == sorted(shown) and shown[-1] == rounds[-1][2], res.stderr
    else:
        result = testing.fuzz(get_preset("overlap").config(bugs={"aborted-kv-inserted"}), max_time=3, seed=1,
                              fuzzer="corpus")
        assert not result.findings
        flaky = len(result.flaky)
    assert flaky == len(rounds) - 1 >= 1, rounds  # a round past each
    assert rounds[0][0] is not None and all(r[0] is rounds[0][0] for r in rounds)  # one corpus
    assert all(nxt[1] == prev[2] > 0 for prev, nxt in zip(rounds, rounds[1:])), [r[1:] for r in rounds]


def _spin_forever():
    end = time.monotonic() + 60  # "forever" for a test: without a watchdog the run ends after this
    while time.monotonic() < end:
        time.sleep(0.05)


@pytest.mark.slow
def test_fuzz_on_an_engine_whose_step_sleeps_forever_ends_in_budget_with_a_hang(monkeypatch, tmp_path):
    original = Scheduler.step

    def step(self):
        if self.forward_ct >= 4:
            _spin_forever()
        return original(self)
    monkeypatch.setattr(Scheduler, "step", step)
    t0 = time.monotonic()
    res = invoke("fuzz", "--max-time", "10", "--step-timeout", "2", "--seed", "1", "--out", str(tmp_path))
    wall = time.monotonic() - t0
    assert res.exit_code == 1, res.output
    assert wall < 20, wall  # (a margin for a loaded machine; without the watchdog: 60 s or more)
    assert "Hang: engine step did not return within 2s (watchdog); stuck in test_fuzz_budget.py" in res.stdout
    assert "#0 _spin_forever" in res.stdout
    assert "reproduced 1/1" in res.stdout
    (path,) = tmp_path.glob("*.json")
    doc = json.loads(path.read_text())
    f = doc["findings"][0]
    assert f["kind"] == "hang" and f["alloc_sites"][0]["function"] == "_spin_forever"


@pytest.mark.slow
def test_bench_counts_executions_to_the_first_hit():
    """A bench trial's executions and seconds are the search's first hit, not its total with the
    shrink reruns (bench already read ``first_hit``; this keeps it so)."""
    from kvaudit.search import bench

    stats = FuzzStats()
    hypothesis_search(_config(), 60, SEED, stats)
    trial = bench.run_trial(BUG, "hypothesis", SEED, 60)
    assert trial.success, trial.note
    assert trial.executions == stats.first_hit[0] and stats.shrink_executions > 0
    assert trial.seconds < trial.wall


@pytest.mark.parametrize("value", ["0", "-1", "inf", "x"])
def test_a_bad_step_timeout_is_a_one_line_usage_error(value):
    from cli_helpers import one_error_line

    res = invoke("fuzz", "--max-time", "1", "--step-timeout", value)
    assert res.exit_code == 2
    assert "--step-timeout" in one_error_line(res)


@pytest.mark.parametrize("command", ["fuzz", "replay", "ci", "minimize"])
def test_a_step_timeout_below_the_watchdogs_poll_is_refused(command, tmp_path):
    """`--step-timeout 1e-300` was accepted, though the watchdog looks for a step that started only every 0.2 s
    while none is armed (a shorter limit let a step run about 0.2 s, or made every step a hang): one line, exit 2,
    naming the least it keeps; that least passes the option's check (the missing file is what is refused)."""
    from cli_helpers import one_error_line

    from kvaudit.constants import WATCHDOG_IDLE_POLL

    missing = [str(tmp_path / "none.json")] if command in ("replay", "minimize") else []
    for value in ("1e-300", "0.1"):
        res = invoke(command, *missing, "--step-timeout", value)
        line = one_error_line(res)
        assert res.exit_code == 2 and "--step-timeout" in line and f"at least {WATCHDOG_IDLE_POLL:g} seconds" in line
    if missing:
        res = invoke(command, *missing, "--step-timeout", f"{WATCHDOG_IDLE_POLL:g}")
        assert res.exit_code == 2 and "--step-timeout" not in one_error_line(res)


def test_fuzz_step_timeout_defaults_to_a_fraction_of_the_budget(tmp_path):
    res = invoke("fuzz", "--max-time", "0.5", "--out", str(tmp_path))
    assert res.exit_code == 0 and "step timeout 1s" in res.stderr
    res = invoke("fuzz", "--max-time", "0.5", "--step-timeout", "3", "--out", str(tmp_path))
    assert res.exit_code == 0 and "step timeout 3s" in res.stderr
    assert "--step-timeout" in invoke("replay", "--help").stdout and "--step-timeout" in invoke("ci", "--help").stdout



def test_a_command_puts_the_callers_step_limit_back_when_it_returns(tmp_path):
    """`kvaudit ci` (and fuzz) set the process-wide step limit for their search (1 s for a 1 s budget), and
    --step-timeout set it for every command, and left it set after they returned: an in-process caller (a test,
    the pytest fixture's replay) ran its next engine steps under the last command's limit. Each puts back the
    caller's when it returns."""
    (tmp_path / "regs").mkdir()
    runner.set_step_timeout(7.0)  # (the caller's own, not the default)
    for args in (["ci", "--max-time", "1", "--presets", "default", "--regressions", str(tmp_path / "regs")],
                 ["fuzz", "--max-time", "1"], ["fuzz", "--max-time", "1", "--step-timeout", "3"]):
        res = invoke(*args, "--out", str(tmp_path / "out"))
        assert res.exit_code == 0, res.output + res.stderr
        assert runner.step_timeout() == 7.0, args


def test_a_command_line_refused_after_step_timeout_puts_the_callers_step_limit_back():
    """--step-timeout's callback set the process-wide limit as the command line was read and put the caller's back
    when the command's context closed; a later option refused (--max-time -1, --seed -4) ended the reading before
    that context was ever closed, so an in-process caller was left under the refused command's limit (3.0)."""
    runner.set_step_timeout(7.0)
    for args in (["fuzz", "--step-timeout", "3", "--max-time", "-1"], ["fuzz", "--step-timeout", "3", "--seed", "-4"],
                 ["replay", "--step-timeout", "3", "--html"]):
        res = invoke(*args)
        assert res.exit_code == 2, res.output + res.stderr
        assert runner.step_timeout() == 7.0, args


def test_paranoid_is_the_commands_own_and_the_callers_environment_is_put_back(monkeypatch):
    """--paranoid set KVAUDIT_PARANOID=1 in the process's environment (for a campaign's workers) and left it
    there: an in-process caller (a test, the pytest fixture's runs) ran every later engine run paranoid, a
    disagreement there raising. The caller's value is put back when the command returns, or is refused."""
    from kvaudit.audit import oracles

    monkeypatch.delenv("KVAUDIT_PARANOID", raising=False)
    src = f"{ROOT}/corpora/regressions/session-close-while-running.json"
    for args, code in ((["replay", src, "--paranoid"], 1), (["replay", "--paranoid", src, "--html"], 2)):
        res = invoke(*args)
        assert res.exit_code == code, res.output + res.stderr
        assert oracles.paranoid_default() is False, args
    monkeypatch.setenv("KVAUDIT_PARANOID", "0")
    assert invoke("replay", src, "--paranoid").exit_code == 1 and os.environ["KVAUDIT_PARANOID"] == "0"

# -- --max-time is search time (issue 34) -----------------------------------------------------------------

def _slow_first_engine(monkeypatch, seconds=0.8):
    """Building the first engine takes ``seconds`` (a real engine's first build, its imports)."""
    real = runner.warm_up

    def slow(config):
        time.sleep(seconds)
        real(config)
    monkeypatch.setattr(runner, "warm_up", slow)


@pytest.mark.parametrize("campaign", [False, True], ids=["single", "campaign"])
def test_building_the_first_engine_is_not_search_time(monkeypatch, tmp_path, campaign):
    """A first engine that takes longer than the whole budget still leaves the budget to the search
    (it counted from the process start: --max-time 20 on SGLang searched 1.3 s, or nothing)."""
    _slow_first_engine(monkeypatch)
    res = invoke("fuzz", "--fuzzer", "random", "--max-time", "0.5", "--out", str(tmp_path),
                 *(["--corpus", str(tmp_path / "c")] if campaign else []))
    assert res.exit_code == 0, res.output
    m = re.search(r"^(?:no findings|campaign done): (\d+) executions, \d+ ops in ([\d.]+)s", res.stdout, re.M)
    assert m and int(m.group(1)) > 0 and float(m.group(2)) >= 0.5, res.stdout


def test_a_campaign_worker_starts_its_clock_once_its_engine_is_built(monkeypatch, tmp_path):
    from kvaudit.search.campaign import run_campaign

    _slow_first_engine(monkeypatch)
    t0 = time.monotonic()
    result = run_campaign(get_preset("default").config(), "random", 0.5, 0, 1, str(tmp_path))
    assert result.stats.executions > 0
    assert result.stats.started >= t0 + 0.8  # the parent's clock too: its figures are the search's
    assert json.loads((tmp_path / "campaign.json").read_text())["runs"][-1]["executions"] > 0


@pytest.mark.parametrize("extra", [[], ["--corpus", "CORPUS"]], ids=["single", "campaign"])
def test_a_run_that_searched_nothing_says_so_and_exits_5(tmp_path, extra):
    """A budget that ends before the first program runs is not a clean run (it exited 0 'no findings')."""
    extra = [str(tmp_path / "c") if a == "CORPUS" else a for a in extra]
    res = invoke("fuzz", "--fuzzer", "random", "--max-time", "1e-9", "--out", str(tmp_path),
                 "--json", str(tmp_path / "run.json"), "--junit", str(tmp_path / "run.xml"),
                 "--sarif", str(tmp_path / "run.sarif"), "--html", str(tmp_path / "run.html"), *extra)
    assert res.exit_code == 5, res.output
    # tester 61c C6: its HTML was titled '..., clean' and said 'No findings.'
    page = (tmp_path / "run.html").read_text()
    assert ", nothing searched</title>" in page and "Nothing searched:" in page, page[:2000]
    assert "No findings." not in page and ", clean</title>" not in page
    # its JUnit and SARIF do not read as a clean run (tester 60c: a passing "no findings" case, no invocation)
    xml = (tmp_path / "run.xml").read_text()
    assert 'name="nothing searched"' in xml and 'skipped="1"' in xml and "no findings" not in xml, xml
    (inv,) = json.loads((tmp_path / "run.sarif").read_text())["runs"][0]["invocations"]
    assert inv["executionSuccessful"] is False and "nothing searched" in json.dumps(inv)
    lines = [line for line in res.stderr.splitlines() if line.startswith("kvaudit: ")]
    assert lines == ["kvaudit: nothing searched: the 1e-09s search budget ended before the first program ran; "
                     "raise --max-time"], res.stderr
    assert "SUMMARY: kvaudit: no findings" not in res.stdout and "no findings:" not in res.stdout
    # stdout still ends with its SUMMARY: line (tester 60a: a single search printed nothing on stdout)
    assert res.stdout.strip().splitlines()[-1] == ("SUMMARY: kvaudit: nothing searched (the budget ended before "
                                                   "the first program ran)."), res.stdout
    assert json.loads((tmp_path / "run.json").read_text())["executions"] == 0


def test_ci_with_a_preset_that_searched_nothing_exits_5_and_its_junit_case_is_skipped(tmp_path):
    empty = tmp_path / "regs"
    empty.mkdir()
    res = invoke("ci", "--presets", "default", "--fuzzer", "random", "--max-time", "1e-9", "--regressions",
                 str(empty), "--out", str(tmp_path / "o"), "--junit", str(tmp_path / "ci.xml"))
    assert res.exit_code == 5, res.output
    assert "kvaudit: nothing searched in 1 of 1 preset(s) (default)" in res.stderr
    xml = (tmp_path / "ci.xml").read_text()
    assert 'skipped="1"' in xml and "nothing searched" in xml


def test_ci_that_searched_nothing_says_so_in_its_summary_junit_and_sarif(tmp_path):
    """Tester 61b: exit 5, yet 'SUMMARY: kvaudit: no new findings.' and 'passed: 0/0 ...'; the JUnit cases were
    named 'default: no new findings' (skipped) and the SARIF's invocation said nothing. As fuzz --max-time 1e-9."""
    empty = tmp_path / "regs"
    empty.mkdir()
    res = invoke("ci", "--presets", "default,chunked", "--fuzzer", "random", "--max-time", "2e-9", "--regressions",
                 str(empty), "--out", str(tmp_path / "o"), "--junit", str(tmp_path / "ci.xml"),
                 "--sarif", str(tmp_path / "ci.sarif"), "--html", str(tmp_path / "cn.html"),
                 "--json", str(tmp_path / "cn.json"))
    assert res.exit_code == 5, res.output
    # tester 61c C6: its HTML read '..., clean' / 'No findings.'; its JSON did not say nothing was searched
    page = (tmp_path / "cn.html").read_text()
    assert "<title>kvaudit report: default, chunked, nothing searched</title>" in page, page[:2000]
    assert "Nothing searched in default, chunked:" in page and "No findings." not in page
    doc = json.loads((tmp_path / "cn.json").read_text())
    assert doc["nothing_searched"] == ["default", "chunked"] and doc["executions"] == 0, doc
    lines = res.stdout.strip().splitlines()
    assert lines[-2] == ("SUMMARY: kvaudit: nothing searched (the budget ended before the first program ran)."), lines
    assert lines[-1].startswith("NOTHING SEARCHED in 2 of 2 preset(s) (default, chunked): 0/0 regressions ok"), lines
    assert "no new findings" not in res.stdout and "passed" not in res.stdout, res.stdout
    xml = (tmp_path / "ci.xml").read_text()
    assert 'name="default: nothing searched"' in xml and 'name="chunked: nothing searched"' in xml, xml
    assert 'skipped="2"' in xml and "no new findings" not in xml, xml
    (inv,) = json.loads((tmp_path / "ci.sarif").read_text())["runs"][0]["invocations"]
    assert inv["executionSuccessful"] is False and "nothing searched" in json.dumps(inv), inv


def test_ci_json_gives_the_executions_of_its_search_as_fuzz_json_does(tmp_path):
    """Stop 61's note: a CI dashboard read ``nothing_searched`` from ``kvaudit ci --json`` but no executions
    count beside it (``fuzz --json`` has one). The presets' sum; none for --max-time 0, which searches nothing
    (so its HTML still reads clean, not nothing searched)."""
    empty = tmp_path / "regs"
    empty.mkdir()
    res = invoke("ci", "--presets", "default", "--fuzzer", "random", "--max-time", "0.5", "--regressions",
                 str(empty), "--out", str(tmp_path / "o"), "--json", str(tmp_path / "ci.json"))
    assert res.exit_code == 0, res.output
    ran = int(re.search(r"fuzz default: (\d+) executions", res.stderr).group(1))
    doc = json.loads((tmp_path / "ci.json").read_text())
    assert doc["executions"] == ran > 0 and "nothing_searched" not in doc, (doc, res.stderr)
    regs = tmp_path / "one"
    regs.mkdir()
    (regs / "a.json").write_text(open(f"{ROOT}/corpora/regressions/session-close-while-running.json").read())
    res = invoke("ci", "--max-time", "0", "--regressions", str(regs), "--json", str(tmp_path / "r.json"),
                 "--html", str(tmp_path / "r.html"))
    assert res.exit_code == 0, res.output
    assert "executions" not in json.loads((tmp_path / "r.json").read_text())
    assert ", clean</title>" in (tmp_path / "r.html").read_text()


def test_ci_where_one_preset_of_two_searched_nothing_says_which_in_its_summary_and_verdict():
    """The partial case of the above: the preset that ran is not hidden, the one that did not is named."""
    from rich.console import Console

    from kvaudit.app.ci import _print_verdict
    from kvaudit.search import ci as search_ci

    result = search_ci.CiResult(fuzz=[search_ci.FuzzRun("default", 1.0, 40), search_ci.FuzzRun("chunked", 1e-9, 0)])
    console = Console(record=True, width=300)
    _print_verdict(console, result, None, [])
    assert console.export_text().splitlines() == [
        "SUMMARY: kvaudit: nothing searched in 1 of 2 preset(s) (chunked): its share ended before the first program "
        "ran; no new findings in the rest.", "NOTHING SEARCHED in 1 of 2 preset(s) (chunked): 0/0 regressions ok, "
        "0 new finding(s)"]


def test_the_html_of_a_ci_where_one_preset_of_two_searched_nothing_names_it():
    from kvaudit.reports.html_report import render_html
    from kvaudit.reports.outputs import Case

    ran = (get_preset("default").config(), get_preset("chunked").config())
    page = " ".join(render_html(ran[0], [Case([], [])], extra={"job": "kvaudit ci", "nothing_searched": "chunked"},
                                ran=ran).split())
    assert "default, chunked, nothing searched</title>" in page
    assert ("Nothing searched in chunked: the budget ended before the first program ran; no findings in the other "
            "presets.") in page


def test_hypothesis_first_run_set_up_is_paid_before_the_search_clock():
    """Hypothesis's first run in a process registers numpy's PRNG with a full gc.collect() (0.45 s with a
    test suite's objects alive): paid inside the budget, a 0.5 s search after tests/test_frames.py ran
    no program. warm_up_hypothesis pays it in start-up: the search then collects nothing."""
    import subprocess
    import sys

    code = (
        "import gc, numpy\n"
        "from kvaudit.targets.eut.presets import get_preset\n"
        "from kvaudit.search.fuzz import FuzzStats, hypothesis_search, warm_up_hypothesis\n"
        "import sys\n"
        "if sys.argv[1] == 'warm': warm_up_hypothesis()\n"
        "calls = []\n"
        "real = gc.collect\n"
        "gc.collect = lambda *a: calls.append(1) or real(*a)\n"
        "stats = FuzzStats()\n"
        "hypothesis_search(get_preset('default').config(), 30.0, 0, stats, max_executions=3)\n"
        "print(len(calls), stats.executions)\n"
    )
    got = {}
    for mode in ("warm", "cold"):
        ran = subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True, timeout=120)
        assert ran.returncode == 0, ran.stderr[-2000:]
        got[mode] = [int(x) for x in ran.stdout.split()[-2:]]
    assert got["cold"][0] >= 1  # the cost is real without the warm-up (else this test proves nothing)
    assert got["warm"] == [0, 3], got
