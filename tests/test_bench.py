"""The benchmark's statistics and report (kvaudit/search/bench.py); one tiny end-to-end run."""

import math
import os
import subprocess
import sys

import pytest
from cli_helpers import invoke, one_error_line

from kvaudit.search import bench
from kvaudit.search.bench import Trial, a12, geomean_exec_ratio, mann_whitney_p, summarize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a12_is_the_probability_of_larger_with_ties_half():
    assert a12([1, 2], [3, 4]) == 0.0
    assert a12([3, 4], [1, 2]) == 1.0
    assert a12([1, 2], [1, 2]) == 0.5
    assert a12([2], [1, 2, 3]) == pytest.approx(0.5)
    assert math.isnan(a12([], [1]))


def test_mann_whitney_separates_clearly_different_samples():
    assert mann_whitney_p([1, 2, 3, 4, 5], [10, 11, 12, 13, 14]) < 0.05
    assert mann_whitney_p([1, 2, 3, 4, 5], [1, 2, 3, 4, 5]) > 0.5
    assert math.isnan(mann_whitney_p([60.0] * 3, [60.0] * 3))  # every trial failed on both sides
    assert math.isnan(mann_whitney_p([0.5], [0.8]))  # one trial each: p would be 1 whatever the times


def _t(bug, fuzzer, seed, seconds, execs, ok=True):
    return Trial(bug, fuzzer, seed, 60.0, success=ok, seconds=seconds if ok else None,
                 executions=execs if ok else None, min_len=3 if ok else None, first_oracle="leak" if ok else None,
                 expected_kind="leak", engine_idle_check=True if ok else None)


def test_summary_medians_censoring_and_the_geometric_mean():
    trials = [_t("a", "hypothesis", s, 1.0 * s, 10 * s) for s in (1, 2, 3)]
    trials += [_t("a", "random", s, 5.0 * s, 100 * s) for s in (1, 2, 3)]
    trials += [_t("b", "hypothesis", 1, 2.0, 20), _t("b", "hypothesis", 2, 0, 0, ok=False),
               _t("b", "hypothesis", 3, 0, 0, ok=False)]
    trials += [_t("b", "random", s, 1.0, 40) for s in (1, 2, 3)]
    cells = {(c.bug, c.fuzzer): c for c in summarize(trials)}
    a = cells[("a", "hypothesis")]
    assert a.successes == 3 and a.median_time == 2.0 and a.median_execs == 20.0
    assert a.a12_vs_random < 0.5  # faster than random
    b = cells[("b", "hypothesis")]
    assert b.successes == 1 and b.median_time is None  # 2 of 3 failed: the median is not reached
    assert b.a12_vs_random > 0.5  # the failures count as the budget: slower than random
    g, n = geomean_exec_ratio(list(cells.values()), "hypothesis")
    assert n == 1 and g == pytest.approx(10.0)  # only bug a has both medians: 200 / 20


def test_markdown_shows_the_targets_and_misses():
    trials = [_t("hisparse-prebuilt-skip-finish", f, s, 1.0, 5) for f in ("hypothesis", "random") for s in (1, 2)]
    res = bench.BenchResult(trials=trials, false_positives=[{"fuzzer": "hypothesis", "seconds": 5, "executions": 9,
                                                             "findings": []}],
                            settings={"bugs": ["hisparse-prebuilt-skip-finish"], "fuzzers": ["hypothesis", "random"],
                                      "trials": 2, "budget": 60.0, "cpu_count": 2, "started": "now"})
    md = bench.markdown(res, raw="zoo.json")
    assert "--fuzzers hypothesis,random" in md and "Raw data: `zoo.json`" in md  # the command and file it was
    assert "| bugs found (at least once) | 1/1 | 1/1 |" in md
    assert "1.00x fewer (1 bug)" in md  # same medians: a ratio of 1, shown, not hidden
    assert "0 in 9 programs" in md


def test_an_interrupted_runs_headline_counts_the_bugs_that_ran():
    """Interrupted after 8 of 14 bugs, the headline said `bugs found (at least once) 8/14`: the 6 not run
    counted as missed."""
    trials = [_t("hisparse-prebuilt-skip-finish", "random", 1, 1.0, 5)]
    res = bench.BenchResult(trials=trials, interrupted=True,
                            settings={"bugs": ["hisparse-prebuilt-skip-finish", "overlap-abort-double-free"],
                                      "fuzzers": ["random"], "trials": 1, "budget": 60.0, "cpu_count": 2,
                                      "started": "now"})
    md = bench.markdown(res)
    assert "| bugs found (at least once) | 1/1 (1 not run: interrupted) |" in md
    assert "--bugs hisparse-prebuilt-skip-finish,overlap-abort-double-free " in md and "INTERRUPTED: partial" in md


@pytest.mark.slow
def test_bench_runs_end_to_end_on_one_bug(tmp_path):
    md, js = tmp_path / "b.md", tmp_path / "b.json"
    result = invoke("bench", "--trials", "1", "--budget", "20", "--fuzzers", "hypothesis,random",
                    "--bugs", "prefill-finish-leaks-row", "--fp-seconds", "2", "--overhead-presets", "none",
                    "--out", str(md), "--json", str(js))
    assert result.exit_code == 0, result.output
    text = md.read_text()
    assert "Raw data: `b.json`" in text
    assert "| prefill-finish-leaks-row | leak | hypothesis | 1/1 |" in text
    assert "| prefill-finish-leaks-row | leak | random | 1/1 |" in text


def test_bench_rejects_unknown_fuzzers_and_bugs():
    r = invoke("bench", "--fuzzers", "afl")
    assert r.exit_code == 2 and "afl" in one_error_line(r)
    r = invoke("bench", "--bugs", "nope")
    assert r.exit_code == 2 and "nope" in one_error_line(r)


def test_bench_writes_into_the_current_directory_unless_told(tmp_path, monkeypatch):
    """It wrote docs/benchmarks.md and .json of whatever checkout it ran in, overwriting the committed ones."""
    trials = [_t("prefill-finish-leaks-row", "random", 1, 1.0, 5)]
    res = bench.BenchResult(trials=trials, false_positives=[], settings={
        "bugs": ["prefill-finish-leaks-row"], "fuzzers": ["random"], "trials": 1, "budget": 1.0, "cpu_count": 2,
        "started": "now"})
    monkeypatch.setattr(bench, "run", lambda *a, **k: res)
    (tmp_path / "docs").mkdir()
    monkeypatch.chdir(tmp_path)
    r = invoke("bench", "--trials", "1", "--budget", "1", "--fuzzers", "random", "--bugs", "prefill-finish-leaks-row",
               "--overhead-presets", "none")
    assert r.exit_code == 0, r.output + r.stderr
    assert sorted(os.listdir(tmp_path)) == ["benchmarks.json", "benchmarks.md", "docs"]
    assert os.listdir(tmp_path / "docs") == []
    assert "Raw data: `benchmarks.json`" in (tmp_path / "benchmarks.md").read_text()
    assert "current directory" in invoke("bench", "--help").output


def test_bench_leaves_no_hypothesis_directory_in_the_current_directory(tmp_path):
    # the hypothesis fuzzer's trials left .hypothesis/constants/ in the user's current directory (tester, stop 55)
    # (a process of its own: in pytest, Hypothesis's home is the plugin's)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    r = subprocess.run([sys.executable, "-m", "kvaudit", "bench", "--trials", "1", "--budget", "1", "--fuzzers",
                        "hypothesis", "--bugs", "prefill-finish-leaks-row", "--fp-seconds", "0.5",
                        "--overhead-presets", "none"], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert sorted(os.listdir(tmp_path)) == ["benchmarks.json", "benchmarks.md"]


@pytest.mark.parametrize("suite", ["zoo", "history"])
def test_an_unwritable_report_names_its_own_flag(tmp_path, suite):
    """`bench --out FILE/b.md` (the parent a file) said `--html FILE/b.md: cannot write ...`: a flag bench
    does not have."""
    (tmp_path / "f").write_text("x")
    r = invoke("bench", "--suite", suite, "--bugs", "sglang-22273" if suite == "history" else "hisparse-prebuilt-skip-finish",
               "--trials", "1", "--out", str(tmp_path / "f" / "b.md"), "--json", str(tmp_path / "b.json"))
    assert r.exit_code == 2 and one_error_line(r).startswith(f"kvaudit: error: --out {tmp_path / 'f' / 'b.md'}: "), r.output


def test_a_hit_past_the_budget_is_a_miss_not_a_success(monkeypatch):
    """--fuzzers atheris --budget 0.1 'found' bugs at 3.1-4.6 s (the child's start-up is counted and
    libFuzzer takes whole seconds) and counted them as successes under a header saying 'at most 0.1 s
    each'. A fake search whose first hit lands past the budget: a miss, with its time in the note; the
    same hit inside the budget is a success."""
    from types import SimpleNamespace

    from kvaudit.program import Idle, Submit

    def fake(when):
        def search(fuzzer, config, budget, seed, stats, work_dir, **kw):
            stats.executions, stats.first_hit = 3, (3, when)
            return [Submit(prompt_len=4, max_new_tokens=2), Idle()], [SimpleNamespace(signature="leak/x")]
        return search

    monkeypatch.setattr(bench, "triage", lambda config, program, finding: None)
    monkeypatch.setattr(bench, "search", fake(3.7))
    late = bench.run_trial("prefill-finish-leaks-row", "atheris", 1, 0.1)
    assert not late.success and late.note == "found after 3.7 s, past the 0.1 s budget: counted as not found"
    monkeypatch.setattr(bench, "search", fake(0.05))
    on_time = bench.run_trial("prefill-finish-leaks-row", "atheris", 1, 0.1)
    assert on_time.note.endswith("did not reproduce 3/3")  # it went on to triage: inside the budget
