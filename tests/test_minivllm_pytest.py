"""Audit your own engine from pytest (issue 19): the minivllm example, fuzzed for a few seconds
through the kvaudit plugin's fixture. Its planted bugs must fail with a readable finding, found and
minimized as ``kvaudit fuzz`` finds and minimizes them."""

import glob
import inspect
import json
import os

import pytest
from cli_helpers import hypothesis_home, invoke

from examples.minivllm.target import PRESETS
from kvaudit import testing
from kvaudit.constants import CAMPAIGN_FUZZER, DEFAULT_FUZZER
from kvaudit.testing import KvauditFailure

TIGHT = PRESETS["minivllm-tight"]


def test_the_engine_is_clean_for_a_few_seconds(kvaudit):
    kvaudit.fuzz(TIGHT.config(), max_time=3).assert_clean()


@pytest.mark.parametrize("bug, kind", [("preempt-double-free", "double-free"), ("abort-leak", "leak")])
def test_a_planted_bug_fails_with_a_readable_finding(kvaudit, bug, kind):
    result = kvaudit.fuzz(TIGHT.config(bugs={bug}), max_time=10)
    with pytest.raises(KvauditFailure) as failure:
        result.assert_clean()
    report = str(failure.value)
    assert result.findings[0].kind == kind
    assert f"signature: {kind}/block_pool/" in report
    assert "examples/minivllm/engine.py" in report  # the engine's own line, not kvaudit's


def test_the_fixture_fuzzes_with_the_clis_default_fuzzer(tmp_path):
    """It fuzzed with random while the CLI's default was corpus. The fixture's search is a single one
    (it stops at the first finding): the CLI's default for that, not a campaign's."""
    from kvaudit.app.fuzz import check_options
    from kvaudit.cli import fuzz as fuzz_cmd

    assert inspect.signature(testing.fuzz).parameters["fuzzer"].default == DEFAULT_FUZZER
    assert next(p.default for p in fuzz_cmd.params if p.name == "fuzzer") is None  # resolved by check_options
    single = check_options(target="eut", fuzzer=None, out_dir=str(tmp_path / "o"), corpus_dir=None, workers=1,
                           db=None, suppress_file=None)
    assert single.fuzzer == DEFAULT_FUZZER != CAMPAIGN_FUZZER and not single.campaign
    for corpus_dir, workers in ((str(tmp_path / "c"), 1), (None, 2)):  # a campaign keeps its programs: corpus
        campaign = check_options(target="eut", fuzzer=None, out_dir=str(tmp_path / "o"), corpus_dir=corpus_dir,
                                 workers=workers, db=None, suppress_file=None)
        assert campaign.fuzzer == CAMPAIGN_FUZZER and campaign.campaign
    chosen = check_options(target="eut", fuzzer="random", out_dir=str(tmp_path / "o"), corpus_dir=str(tmp_path / "c"),
                           workers=1, db=None, suppress_file=None)
    assert chosen.fuzzer == "random"  # --fuzzer given: kept, campaign or not


def test_a_failing_test_shows_the_program_the_cli_minimized(kvaudit, tmp_path, monkeypatch):
    """The fixture did not minimize: a failing test showed 15 ops where the CLI showed 4."""
    monkeypatch.setenv("KVAUDIT_PLUGINS", "examples.minivllm.target")
    r = invoke("fuzz", "--target", "minivllm", "--preset", "minivllm-tight", "--bug", "abort-leak", "--max-time", "10",
               "--out", str(tmp_path))
    assert r.exit_code == 1, r.output + r.stderr
    (path,) = glob.glob(str(tmp_path / "*.json"))
    cli = json.load(open(path))
    assert cli["minimized"] is True
    result = kvaudit.fuzz(TIGHT.config(bugs={"abort-leak"}), max_time=10)  # the same fuzzer and seed (0)
    assert result.signatures[0] == cli["findings"][0]["signature"]
    assert len(result.program) == len(cli["program"]) < result.original_length
    assert f"minimized program ({result.original_length} -> {len(cli['program'])} ops):" in result.render()


def _doc_snippets() -> dict[str, list[str]]:
    """The Python code blocks of the README and every docs page: code -> where it is written."""
    import os
    import re

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out: dict[str, list[str]] = {}
    docs = sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(os.path.join(root, "docs"))
                  for f in fs if f.endswith(".md"))
    assert os.path.join("docs", "writing-a-target.md") in docs
    for name in ("README.md", *docs):
        text = open(os.path.join(root, name)).read()
        for m in re.finditer(r"```python\n(.*?)```", text, re.S):
            out.setdefault(m.group(1), []).append(f"{name}:{text[:m.start()].count(chr(10)) + 1}")
    return out


@pytest.mark.parametrize("code", list(_doc_snippets()), ids=[" ".join(w) for w in _doc_snippets().values()])
def test_every_python_snippet_of_the_docs_runs_as_written(code, kvaudit):
    """The README's snippet lacked its import of PRESETS: copied as written, it failed with NameError."""
    namespace: dict = {}
    exec(compile(code, "<snippet>", "exec"), namespace)
    tests = [f for name, f in namespace.items() if name.startswith("test_") and callable(f)]
    assert tests
    for test in tests:
        assert list(inspect.signature(test).parameters) == ["kvaudit"]
        test(kvaudit)


@pytest.mark.parametrize("scale", ["0", "-1", "nan"])
def test_a_time_scale_that_leaves_no_budget_is_a_usage_error(tmp_path, scale):
    """``--kvaudit-time 0`` (or -1, nan) turned every fixture fuzz into no search at all, and a test of a
    leaking engine passed: now pytest's usage error (exit 4), in one line naming the option."""
    import os
    import subprocess
    import sys

    from cli_helpers import ROOT

    (tmp_path / "test_x.py").write_text("def test_x(kvaudit):\n    pass\n")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:kvaudit",
                        "-p", "kvaudit.pytest_plugin",
                        "--kvaudit-time", scale, str(tmp_path)], capture_output=True, text=True, cwd=tmp_path,
                       env=dict(os.environ, PYTHONPATH=ROOT))  # (installed or not: this checkout's plugin)
    assert r.returncode == 4, r.stdout + r.stderr
    assert f"argument --kvaudit-time: must be a finite number > 0, got {scale}" in r.stderr


def test_a_failure_is_one_line_in_the_short_summary_and_plain_in_junit(tmp_path):
    """The plugin swapped in the plain report in pytest_exception_interact, after the report was logged: JUnit's
    failure held the whole report as its message and a traceback of E-lines as its text, the short test summary
    named only the report's header (``kvaudit report: preset ...``), and on CI (``CI`` set) repeated the whole
    report. Now: the first finding's summary there, the plain report once."""
    import os
    import subprocess
    import sys
    import xml.etree.ElementTree as ET

    from cli_helpers import ROOT

    path = os.path.join(ROOT, "corpora", "regressions", "chunked-abort-ignored.json")
    (tmp_path / "test_x.py").write_text(f"def test_x(kvaudit):\n    kvaudit.replay({path!r}).assert_clean()\n")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:kvaudit",
                        "-p", "kvaudit.pytest_plugin", "--junitxml", str(tmp_path / "j.xml"), str(tmp_path)],
                       capture_output=True, text=True, cwd=tmp_path, env=dict(os.environ, PYTHONPATH=ROOT, CI="1"))
    assert r.returncode == 1, r.stdout + r.stderr
    one = ("kvaudit: Direct leak of 1 row in pool req_to_token_pool, allocated at scheduler.py:273 in alloc_for_extend "
           "(and 1 more finding(s))")
    summary = r.stdout.split("short test summary info")[1].splitlines()
    assert summary[1] == f"FAILED test_x.py::test_x - {one}" and "failed" in summary[2], r.stdout
    assert r.stdout.count("kvaudit report: preset chunked") == 1
    (failure,) = ET.parse(tmp_path / "j.xml").iter("failure")
    assert failure.get("message") == one
    assert failure.text.startswith("kvaudit report: preset chunked") and "\nE " not in failure.text


def test_a_hypothesis_fuzz_leaves_no_files_in_the_working_directory(tmp_path):
    """testing.fuzz(..., fuzzer="hypothesis") left .hypothesis/constants/ in the test's working directory, which
    `kvaudit fuzz` never does (its files go to its own directory); a caller's Hypothesis home is kept."""
    from hypothesis import configuration

    before = hypothesis_home()
    configuration.set_hypothesis_home_dir(tmp_path / ".hypothesis")  # (the default: the working directory's)
    try:
        result = testing.fuzz(TIGHT.config(), max_time=1, fuzzer="hypothesis")
        assert hypothesis_home() == tmp_path / ".hypothesis"
    finally:
        configuration.set_hypothesis_home_dir(before)
    assert result.executions > 0
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("max_time", [0, -1.0, float("nan"), "5", None, True, -10**400])
def test_a_fuzz_without_a_budget_is_refused(max_time):
    with pytest.raises(ValueError, match="^max_time must be a (finite )?number of seconds"):
        testing.fuzz(TIGHT.config(bugs={"abort-leak"}), max_time=max_time)


@pytest.mark.parametrize("bad", ["0", "-5", "nan", "-inf", "1e300"])
def test_the_pytest_fixtures_max_time_is_refused_in_the_words_of_max_time(bad):
    """kvaudit.testing.fuzz checked max_time with a predicate of its own, a twin of --max-time's (app.budget, which
    kvaudit.testing, below app, cannot import), in other words ('max_time must be a finite number of seconds > 0, got
    -5' against 'must be a number of seconds > 0, got -5'): one check (kvaudit.constants.check_seconds)."""
    from cli_helpers import one_error_line

    line = one_error_line(invoke("fuzz", "--max-time", bad))
    cli = line.removeprefix("kvaudit: error: Invalid value for '--max-time': ").rsplit(" (see '", 1)[0]
    with pytest.raises(ValueError) as e:
        testing.fuzz(TIGHT.config(), max_time=float(bad))
    assert str(e.value) == f"max_time {cli}"


def test_a_fuzz_that_ran_no_program_does_not_pass():
    """A budget that ended before one program ran passed ``assert_clean`` having checked nothing (the CLI
    says 'nothing searched' and exits 5)."""
    result = testing.Result(executions=0, config=TIGHT.config())
    with pytest.raises(KvauditFailure, match="nothing searched"):
        result.assert_clean()
