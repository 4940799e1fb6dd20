"""The history suite (issue 21): the catalogue, release overlays, the worker, ``kvaudit bench --suite
history``. The end-to-end run (a vLLM 0.23.0 and 0.24.0 overlay installed from the package index) is
marked slow."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from cli_helpers import cut_first_removal, invoke, one_error_line
from kvaudit.history import catalogue, releases, suite, worker
from kvaudit.history.catalogue import BUGS, UNREACHED, HistoryBug, all_bugs, rediscoveries
from kvaudit.history.trial import HistoryTrial
from kvaudit.targets import registry
from kvaudit.targets.sglang import catalogue as sglang_catalogue
from kvaudit.targets.vllm import catalogue as vllm_catalogue

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# -- the catalogue -------------------------------------------------------------------------------------
@pytest.mark.parametrize("bug", list(BUGS.values()), ids=list(BUGS))
def test_each_entry_is_well_formed_and_its_config_builds(bug):
    assert bug.engine in releases.ENGINES and bug.id.startswith(bug.engine + "-")
    assert bug.sources and all("#" in s for s in bug.sources)
    assert bug.clean_because in ("fix", "refactor") and bug.fixed and bug.fixed != bug.buggy
    assert bug.replay_blocked == "" or len(bug.replay_blocked) > 20
    from packaging.version import Version
    assert Version(bug.fixed) > Version(bug.buggy)
    kind = registry.get(bug.engine)
    if bug.preset not in kind.presets():  # a preset listed only where the installed release has its feature
        from kvaudit.targets.vllm.config import VLLM_PRESETS
        assert bug.engine == "vllm" and bug.preset in VLLM_PRESETS
        config = VLLM_PRESETS[bug.preset].config(**bug.config)
    else:
        config = catalogue.target_config(bug)  # the overrides are fields of the kind's config, with valid values
    assert config.preset == bug.preset and all(getattr(config, k) == v for k, v in bug.config.items())
    assert bug.reach and bug.title


def test_ids_are_unique_and_no_bug_is_both_in_and_left_out():
    ids = [b.id for b in vllm_catalogue.BUGS + sglang_catalogue.BUGS]
    assert len(ids) == len(set(ids))
    assert not {u.id for u in UNREACHED} & set(ids)
    assert all(u.reason for u in UNREACHED)


def test_the_rediscoveries_are_the_sglang_corpus_with_its_signatures():
    from kvaudit.data import data_path
    files = sorted(f for f in os.listdir(data_path("corpora/sglang")) if f.endswith(".json"))
    found = rediscoveries()
    assert [b.replay_file for b in found] == [f"corpora/sglang/{f}" for f in files]
    for b in found:
        with open(data_path(b.replay_file)) as f:
            doc = json.load(f)
        assert b.signature == doc["findings"][0]["signature"] and b.fixed is None and b.buggy == "0.5.23"
    assert set(all_bugs()) == set(BUGS) | {b.id for b in found}


def _finding(kind, signature, check=""):
    return SimpleNamespace(kind=kind, signature=signature, check=check)


def test_a_finding_is_the_bug_only_by_kind_check_and_signature():
    b = HistoryBug(id="vllm-1", engine="vllm", title="t", sources=("x#1",), buggy="0.23.0", fixed="0.24.0",
                   clean_because="fix", preset="vllm", finding="use-after-free", check="inflight-write")
    sig = "use-after-free/block_pool/schedule@scheduler.py/_free_blocks@scheduler.py/check:inflight-write"
    assert b.matches(_finding("use-after-free", sig, "inflight-write"))
    assert not b.matches(_finding("use-after-free", sig.rsplit("/", 1)[0], ""))  # the ledger's, not the check
    assert not b.matches(_finding("leak", sig, "inflight-write"))
    narrow = HistoryBug(**{**b.__dict__, "check": "", "signature": "_free_blocks@"})
    assert narrow.matches(_finding("use-after-free", sig)) and not narrow.matches(_finding("use-after-free", "x"))
    exact = rediscoveries()[0]
    assert exact.matches(_finding("other", exact.signature))
    assert not exact.matches(_finding(exact.finding, exact.signature + "/from:session"))


def test_other_findings_are_suppressed_and_noted_the_bugs_kept():
    bug = BUGS["vllm-45357"]
    mine = _finding("use-after-free", "use-after-free/block_pool/a@x.py/b@y.py/check:inflight-write", "inflight-write")
    other = _finding("leak", "leak/block_pool/a@x.py")
    sup = worker.NotThisBug(bug)
    suppressed = []
    assert sup.sift([other, mine], suppressed) == [mine]
    assert suppressed == [other] and sup.others == {other.signature} and not sup.needs_full_stacks


# -- release overlays ----------------------------------------------------------------------------------
def test_the_base_version_needs_no_overlay_and_an_overlay_goes_first(monkeypatch, tmp_path):
    monkeypatch.setenv(releases.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(releases, "base_version", lambda engine: "9.9.9")
    assert releases.ensure("vllm", "9.9.9") is None
    (tmp_path / "vllm-1.0.0").mkdir()
    assert releases.ensure("vllm", "1.0.0") == tmp_path / "vllm-1.0.0"  # cached: no pip
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    env = releases.env("vllm", "1.0.0", tmp_path / "vllm-1.0.0")
    assert env["PYTHONPATH"].split(os.pathsep) == [str(tmp_path / "vllm-1.0.0"), "/elsewhere"]
    with pytest.raises(releases.ReleaseError, match='unknown engine "tgi"'):
        releases.ensure("tgi", "1.0")


def test_a_failed_install_leaves_nothing_that_looks_complete(monkeypatch, tmp_path):
    monkeypatch.setenv(releases.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(releases, "base_version", lambda engine: None)
    calls = []

    def pip(cmd, **kw):
        calls.append(cmd)
        target = cmd[cmd.index("--target") + 1]
        open(os.path.join(target, "half-written"), "w").close()
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found for vllm==0.0.1\n")

    monkeypatch.setattr(releases.subprocess, "run", pip)
    with pytest.raises(releases.ReleaseError, match=r"could not install vllm 0.0.1: ERROR: No matching distribution"):
        releases.ensure("vllm", "0.0.1")
    assert "--no-deps" in calls[0] and "vllm==0.0.1" in calls[0]
    assert os.listdir(tmp_path) == []


def test_an_overlay_installs_the_pins_its_kind_gives_for_that_release(monkeypatch, tmp_path):
    """The pins come from the kind's history entry (``TargetKind.history``), not from a table in history/."""
    monkeypatch.setenv(releases.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(releases, "base_version", lambda engine: None)
    calls = []
    monkeypatch.setattr(releases.subprocess, "run", lambda cmd, **kw: calls.append(cmd) or
                        subprocess.CompletedProcess(cmd, 1, "", "ERROR: offline\n"))
    for engine, version in (("vllm", "0.15.1"), ("sglang", "0.5.11"), ("vllm", "0.23.0")):
        with pytest.raises(releases.ReleaseError):
            releases.ensure(engine, version)
    assert set(vllm_catalogue.PINS["0.15.1"]) <= set(calls[0]) and "mistral_common==1.9.0" in calls[0]
    assert set(sglang_catalogue.PINS["0.5.11"]) <= set(calls[1]) and "transformers==5.6.0" in calls[1]
    assert calls[2][-1] == "vllm==0.23.0"  # no pins: the release alone


def test_an_interrupted_install_leaves_nothing_in_the_cache(monkeypatch, tmp_path):
    """Ctrl-C (or SIGTERM, which the CLI turns into one) during pip left its .vllm-<version>-XXXX folder."""
    monkeypatch.setenv(releases.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(releases, "base_version", lambda engine: None)

    def pip(cmd, **kw):
        open(os.path.join(cmd[cmd.index("--target") + 1], "half-written"), "w").close()
        raise KeyboardInterrupt

    monkeypatch.setattr(releases.subprocess, "run", pip)
    with pytest.raises(KeyboardInterrupt):
        releases.ensure("vllm", "0.0.1")
    assert os.listdir(tmp_path) == []


def test_the_suites_stop_kills_a_release_install_in_progress(monkeypatch, tmp_path):
    """Stop 61's note: a second Ctrl-C wrote the history bench's report, but a worker thread still in a release's
    pip install kept the process alive until pip ended. The suite's stop() kills pip as it kills its workers;
    the cache keeps nothing of it, and an install asked after the stop does not start."""
    import sys
    import threading

    monkeypatch.setenv(releases.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(releases, "base_version", lambda engine: None)
    slow_pip = tmp_path / "slow-pip"
    slow_pip.write_text("#!/bin/sh\nsleep 60\n")
    slow_pip.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(slow_pip))  # [sys.executable, "-m", "pip", ...]: sleeps 60 s
    runner, res, raised = suite._Runner(lambda line: None), suite.HistoryResult(settings={}), []

    def install():
        try:
            suite._release(res, "vllm", "0.0.1", runner)
        except suite.SuiteError as e:
            raised.append(str(e))

    t = threading.Thread(target=install)
    t.start()
    deadline = time.monotonic() + 10
    while not runner.procs and time.monotonic() < deadline:
        time.sleep(0.05)
    assert runner.procs, "pip never started"
    runner.stop()
    t.join(10)
    assert not t.is_alive(), "the install outlived the suite's stop"
    assert raised and "could not install vllm 0.0.1" in raised[0]
    assert os.listdir(tmp_path / "cache") == []
    assert runner.tool(["true"]) == (-1, "stopped")


def test_a_release_asked_after_the_suites_stop_is_neither_announced_nor_installed(monkeypatch, tmp_path):
    """Stop 62: with --jobs 2, a Ctrl-C while one job's pip ran let the other job, waiting for the install lock,
    print "installing sglang==... into ..." after the stop (its pip then refused to start)."""
    monkeypatch.setenv(releases.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(releases, "base_version", lambda engine: None)
    events = []
    runner, res = suite._Runner(events.append), suite.HistoryResult(settings={})
    runner.stop()
    with pytest.raises(suite.SuiteError, match="not installed, the suite was stopped"):
        suite._release(res, "vllm", "0.0.1", runner)
    assert events == [] and res.releases == [] and not (tmp_path / "cache").exists()


def test_the_install_command_takes_all_or_pinned_releases(monkeypatch, capsys):
    assert releases.main(["vllm-0.23.0"]) == 2
    assert 'want ENGINE==VERSION or "all", not "vllm-0.23.0"' in capsys.readouterr().err
    assert releases.main([]) == 2
    done = []
    monkeypatch.setattr(releases, "ensure", lambda e, v, on_event: done.append((e, v)))
    assert releases.main(["all"]) == 0
    assert done == releases.catalogue_releases()
    assert ("vllm", "0.23.0") in done and ("vllm", "0.24.0") in done
    assert all(v is not None for _, v in done)


# -- the worker and the suite ------------------------------------------------------------------------
def test_the_worker_refuses_a_release_other_than_the_one_asked(tmp_path, capsys):
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"mode": "replay", "bug": "vllm-45357", "version": "0.0.1", "programs": []}))
    assert worker.main([str(job), str(tmp_path / "out.json")]) == 2
    assert "not 0.0.1" in capsys.readouterr().err


def test_ctrl_c_writes_the_trials_so_far_and_exits_130(monkeypatch, tmp_path):
    """The child's finished trials survive a Ctrl-C that reaches the parent while it waits."""
    done = HistoryTrial("vllm-45357", "random", 1, 5.0, success=True, seconds=0.1, executions=3, min_len=2,
                        first_oracle="use-after-free", signature="use-after-free/x", confirmations=3,
                        program=[{"op": "submit", "family": 0, "prompt_len": 1, "max_new_tokens": 5, "stop_at": 3}])
    monkeypatch.setattr(suite, "_release", lambda res, engine, version, on_event: None)
    stopped = []

    def child(self, job, *a):
        self.stopped.wait(10)  # killed by stop(): returns what its worker wrote so far
        stopped.append(self.stopped.is_set())
        return [done.__dict__]

    def interrupted(futures):
        raise KeyboardInterrupt
        yield

    monkeypatch.setattr(suite._Runner, "child", child)
    monkeypatch.setattr(suite, "as_completed", interrupted)
    md, js = tmp_path / "h.md", tmp_path / "h.json"
    r = invoke("bench", "--suite", "history", "--bugs", "vllm-45357", "--fuzzers", "random", "--trials", "1",
               "--out", str(md), "--json", str(js))
    assert r.exit_code == 130, r.output
    assert stopped == [True]
    doc = json.loads(js.read_text())
    assert doc["interrupted"] and doc["trials"][0]["executions"] == 3
    assert "INTERRUPTED: partial" in md.read_text() and "vllm-45357 (random, seed 1; 3/3 confirmations" in md.read_text()


def test_a_second_ctrl_c_while_waiting_for_a_worker_still_writes_the_report(monkeypatch, tmp_path):
    """Ctrl-C twice (or ``timeout -s INT``, which signals the whole group): the second one, while the parent
    waits for a worker slow to stop, ends the wait; the finished bug's trials are reported, the other bug not
    run, exit 130. (Simulated: the first interrupt in as_completed, the second in the slow bug's result().)"""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    trial = HistoryTrial("vllm-45357", "random", 1, 5.0, success=False, seconds=0.1, executions=3)
    monkeypatch.setattr(suite, "_release", lambda res, engine, version, on_event: None)
    started, release = threading.Event(), threading.Event()

    def child(self, job, *a):
        if job["bug"] == "vllm-45357":
            return [trial.__dict__]
        started.set()
        release.wait(5)  # a worker slow to stop (a release being installed)
        return []

    class Pool(ThreadPoolExecutor):
        def submit(self, fn, *args, **kw):
            fut = super().submit(fn, *args, **kw)
            if args[2] != "vllm-45357":
                def second_interrupt(timeout=None):
                    raise KeyboardInterrupt
                fut.result = second_interrupt
            return fut

    def interrupted(futures):
        first = next(f for f, bid in futures.items() if bid == "vllm-45357")
        first.result(5), started.wait(5)
        raise KeyboardInterrupt
        yield

    monkeypatch.setattr(suite._Runner, "child", child)
    monkeypatch.setattr(suite, "ThreadPoolExecutor", Pool)
    monkeypatch.setattr(suite, "as_completed", interrupted)
    md, js = tmp_path / "h.md", tmp_path / "h.json"
    try:
        r = invoke("bench", "--suite", "history", "--bugs", "vllm-45357,vllm-47282", "--fuzzers", "random",
                   "--trials", "1", "--jobs", "2", "--out", str(md), "--json", str(js))
    finally:
        release.set()
    assert r.exit_code == 130, r.output
    doc = json.loads(js.read_text())
    assert doc["interrupted"] and [t["bug"] for t in doc["trials"]] == ["vllm-45357"]
    assert "not run (interrupted)" in md.read_text()


def test_a_ctrl_c_during_the_fixed_releases_install_keeps_the_trials_found(monkeypatch, tmp_path):
    """A Ctrl-C while the fixed release installs (its trials done on the shipped one): stop() kills pip, whose
    install then fails; the bug's trials stand in the report, found and not replayed, not lost as 'not run'."""
    import threading

    bug = all_bugs()["vllm-45357"]
    done = HistoryTrial("vllm-45357", "random", 1, 5.0, success=True, seconds=0.1, executions=3, min_len=2,
                        first_oracle="use-after-free", signature="use-after-free/x", confirmations=3,
                        program=[{"op": "submit", "family": 0, "prompt_len": 1, "max_new_tokens": 5, "stop_at": 3}])
    installing = threading.Event()

    def release(res, engine, version, runner):
        if version == bug.fixed:  # pip of the fixed release, killed by stop(): its install fails
            installing.set()
            runner.stopped.wait(10)
            raise suite.SuiteError(f"could not install {engine} {version}: killed")
        return None

    def interrupted(futures):
        installing.wait(10)
        raise KeyboardInterrupt
        yield

    monkeypatch.setattr(suite, "_release", release)
    monkeypatch.setattr(suite._Runner, "child", lambda self, job, *a: [done.__dict__])
    monkeypatch.setattr(suite, "as_completed", interrupted)
    md, js = tmp_path / "h.md", tmp_path / "h.json"
    r = invoke("bench", "--suite", "history", "--bugs", "vllm-45357", "--fuzzers", "random", "--trials", "1",
               "--out", str(md), "--json", str(js))
    assert r.exit_code == 130, r.output
    doc = json.loads(js.read_text())
    assert doc["interrupted"] and [t["executions"] for t in doc["trials"]] == [3]
    assert "found; not replayed on the fixed release (interrupted)" in md.read_text()


def test_a_failed_worker_costs_its_bug_only_the_report_lists_it_exit_70(monkeypatch, tmp_path):
    """A worker that dies (here: after one trial of vllm-45357) is listed in the report and the JSON;
    its trial so far and the other bug's trials are kept, the other bug is still replayed."""
    def trial(bug):
        return HistoryTrial(bug, "random", 1, 5.0, success=True, seconds=0.1, executions=3, min_len=2,
                            first_oracle="use-after-free", signature="use-after-free/x", confirmations=3,
                            program=[{"op": "submit", "family": 0, "prompt_len": 1, "max_new_tokens": 5}]).__dict__
    monkeypatch.setattr(suite, "_release", lambda res, engine, version, on_event: None)
    jobs = []

    def child(self, job, engine, version, overlay):
        jobs.append((job["mode"], job["bug"]))
        if job["mode"] == "replay":
            return [{"clean": True, "signatures": []} for _ in job["programs"]]
        if job["bug"] == "vllm-45357":
            raise suite.WorkerFailed("vllm 0.23.0: the worker failed: StepTimeout", [trial(job["bug"])])
        return [trial(job["bug"])]

    monkeypatch.setattr(suite._Runner, "child", child)
    md, js = tmp_path / "h.md", tmp_path / "h.json"
    r = invoke("bench", "--suite", "history", "--bugs", "vllm-45357,vllm-47282", "--fuzzers", "random",
               "--trials", "1", "--out", str(md), "--json", str(js))
    assert r.exit_code == 70, r.output
    assert "1 worker(s) failed" in r.output and "StepTimeout" in r.output
    doc = json.loads(js.read_text())
    assert doc["failures"] == ["vllm-45357: vllm 0.23.0: the worker failed: StepTimeout"]
    assert sorted(t["bug"] for t in doc["trials"]) == ["vllm-45357", "vllm-47282"]
    assert ("replay", "vllm-47282") in jobs and ("replay", "vllm-45357") in jobs  # the kept trial is replayed too
    assert "**Workers that failed**" in md.read_text() and "- vllm-45357: vllm 0.23.0" in md.read_text()


def test_a_step_timeout_escaping_a_trial_is_a_lost_trial_not_a_dead_worker(monkeypatch):
    from kvaudit.audit import runner

    def escaped(*a):
        raise runner.StepTimeout

    monkeypatch.setattr(worker, "search_trial", escaped)
    bug = all_bugs()["vllm-45357"]
    t = worker._contained(bug, None, "random", 1, 5.0)
    assert not t.success and "StepTimeout escaped" in t.note and "escaped" in t.line()
    assert threading_ident_is_disarmed(runner)


def test_the_worker_freezes_the_heap_the_probe_imported_before_its_trials(monkeypatch, tmp_path):
    """What the probe loaded (the engine's modules) is out of the cyclic collector's reach while the trials
    run: a generation-2 collection inside a trial's clock cost ~0.3 s with SGLang 0.5.23 imported
    (performance.md, stop 50). Frozen after the probe (so its imports are), not before."""
    import gc

    seen: dict[str, int] = {}

    def probe(config):
        seen["probe"] = gc.get_freeze_count()

    def contained(bug, config, fuzzer, seed, budget):
        seen["trial"] = gc.get_freeze_count()
        return HistoryTrial(bug.id, fuzzer, seed, budget)

    monkeypatch.setattr(worker, "base_version", lambda engine: "0.23.0")
    monkeypatch.setattr(worker, "target_config", lambda bug: None)
    monkeypatch.setattr(registry, "get", lambda engine: SimpleNamespace(probe=probe))
    monkeypatch.setattr(worker, "_contained", contained)
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"mode": "search", "bug": "vllm-45357", "version": "0.23.0", "fuzzers": ["random"],
                               "seeds": [1], "budget": 1.0}))
    gc.unfreeze()
    try:
        assert worker.main([str(job), str(tmp_path / "out.json")]) == 0
    finally:
        gc.unfreeze()
    assert seen["probe"] == 0 and seen["trial"] > 0


def threading_ident_is_disarmed(runner) -> bool:
    import threading

    tid = threading.get_ident()
    return tid not in runner._WATCHDOG._armed and tid not in runner._WATCHDOG._resend


def test_a_worker_that_refuses_its_release_still_stops_the_suite(monkeypatch, tmp_path):
    """Exit 2 of a worker is its own one-line refusal (the wrong release imported): the environment is
    wrong for every bug of that release, so the suite stops with it (exit 69), as before."""
    monkeypatch.setattr(suite, "_release", lambda res, engine, version, on_event: None)

    def child(self, job, engine, version, overlay):
        raise suite.SuiteError(f"{engine} {version}: imports vllm 0.33.0, not {version}")

    monkeypatch.setattr(suite._Runner, "child", child)
    r = invoke("bench", "--suite", "history", "--bugs", "vllm-45357", "--fuzzers", "random", "--trials", "1",
               "--out", str(tmp_path / "h.md"), "--json", str(tmp_path / "h.json"))
    assert r.exit_code == 69, r.output
    assert "imports vllm 0.33.0" in r.output.strip().splitlines()[-1] and "Traceback" not in r.output


def test_a_release_cache_under_a_file_is_one_line_and_exit_69(monkeypatch, tmp_path):
    """Tester 61b: KVAUDIT_RELEASE_CACHE=/some/file/x ended `bench --suite history` with 'internal error:
    NotADirectoryError' (exit 70); the release cannot be installed there: one line naming the cache, exit 69."""
    (tmp_path / "file").write_text("")
    monkeypatch.setenv(releases.CACHE_ENV, str(tmp_path / "file" / "x"))
    monkeypatch.setattr(releases, "base_version", lambda engine: None)  # (every release needs an overlay)
    monkeypatch.setattr(releases.subprocess, "run", lambda *a, **k: pytest.fail("pip ran"))
    r = invoke("bench", "--suite", "history", "--bugs", "vllm-45357", "--fuzzers", "random", "--trials", "1",
               "--out", str(tmp_path / "h.md"), "--json", str(tmp_path / "h.json"))
    assert r.exit_code == 69, r.output
    line = r.stderr.strip().splitlines()[-1]  # (after the suite's header line)
    assert line.startswith("kvaudit: error: could not install vllm ") and "the release cache" in line and str(tmp_path / "file" / "x") in line and "Not a directory" in line, line
    assert "Traceback" not in r.output and "internal error" not in r.output


def test_a_release_cache_whose_name_is_too_long_is_one_line_and_exit_69(monkeypatch, tmp_path):
    """Tester 61c: a cache path with a 300-character name was 'internal error: OSError: [Errno 36] File name
    too long' (the check for an installed overlay ran before the guarded part)."""
    monkeypatch.setenv(releases.CACHE_ENV, str(tmp_path / ("x" * 300)))
    monkeypatch.setattr(releases, "base_version", lambda engine: None)
    monkeypatch.setattr(releases.subprocess, "run", lambda *a, **k: pytest.fail("pip ran"))
    r = invoke("bench", "--suite", "history", "--bugs", "vllm-45357", "--fuzzers", "random", "--trials", "1",
               "--out", str(tmp_path / "h.md"), "--json", str(tmp_path / "h.json"))
    assert r.exit_code == 69 and "File name too long" in r.stderr.strip().splitlines()[-1], r.output + r.stderr


@pytest.mark.parametrize("args, message", [
    (["--bugs", "vllm-1"], '--bugs: unknown history bug "vllm-1"'),
    (["--fuzzers", "afl"], '--fuzzers: unknown fuzzer "afl"'),
    (["--fuzzers", "random,atheris"], "--fuzzers: atheris instruments the built-in engine only"),
])
def test_bad_input_is_one_line_exit_2(args, message, tmp_path):
    r = invoke("bench", "--suite", "history", *args, "--out", str(tmp_path / "a.md"), "--json", str(tmp_path / "a.json"))
    assert r.exit_code == 2 and message in one_error_line(r)


def test_list_names_every_bug_with_its_releases():
    r = invoke("bench", "--suite", "history", "--list")
    assert r.exit_code == 0
    for b in all_bugs().values():
        assert any(line.startswith(b.id + " ") and b.buggy in line for line in r.output.splitlines())
    # one column for the engine, the longest id included (one id ran into it)
    assert len({line.index(f" {b.engine} ") for b in all_bugs().values() for line in r.output.splitlines()
                if line.startswith(b.id + " ")}) == 1


def test_list_takes_bugs_as_a_run_does():
    # --bugs with --list listed every bug and exited 0 on a name the suite lacks (tester, stop 55)
    ids = sorted(all_bugs())[:2]
    r = invoke("bench", "--suite", "history", "--list", "--bugs", ",".join(ids))
    assert r.exit_code == 0 and [line.split()[0] for line in r.output.splitlines()] == ids
    r = invoke("bench", "--suite", "history", "--list", "--bugs", "nope")
    assert r.exit_code == 2 and '--bugs: unknown history bug "nope"' in one_error_line(r)
    r = invoke("bench", "--list", "--bugs", "nope")
    assert r.exit_code == 2 and '--bugs: unknown bug "nope"' in one_error_line(r)


@pytest.mark.slow
@pytest.mark.vllm
def test_end_to_end_vllm_45357_found_in_0_23_0_and_clean_in_0_24_0(tmp_path):
    """Installs (or reuses, from the release cache) vLLM 0.23.0 and 0.24.0 overlays, about 0.6 GB each."""
    md, js = tmp_path / "h.md", tmp_path / "h.json"
    r = subprocess.run([sys.executable, "-m", "kvaudit", "bench", "--suite", "history", "--bugs", "vllm-45357",
                        "--fuzzers", "random", "--trials", "1", "--budget", "30", "--out", str(md), "--json", str(js)],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(js.read_text())
    (t,) = doc["trials"]
    assert t["success"] and t["confirmations"] == 3 and t["fixed_clean"] is True
    assert t["signature"].endswith("check:inflight-write")
    assert {(x["engine"], x["version"]) for x in doc["releases"]} == {("vllm", "0.23.0"), ("vllm", "0.24.0")}
    assert "1/1 bug(s) rediscovered" in r.stdout


def test_the_report_says_what_each_bug_is_a_rediscovery_too():
    """A run of only SGLang 0.5.23 rediscoveries left "What each bug is, and how a real server reaches it"
    empty (the tester, stop 49): a rediscovery names its corpus file and the README with its triage."""
    bid = rediscoveries()[0].id
    res = suite.HistoryResult(settings={"suite": "history", "bugs": [bid], "fuzzers": ["random"], "trials": 1,
                                        "budget": 1.0, "jobs": 1, "cpu_count": 2, "started": "2026-12-05 09:00:00"})
    text = suite.markdown(res)
    section = text.split("## What each bug is, and how a real server reaches it", 1)[1].split("\n## ", 1)[0]
    assert f"- **{bid}**: kvaudit's own finding (" in section
    # how a real server reaches it (tester 60b: every rediscovery row pointed at the whole README), and where
    assert "Reached: a streaming-session turn sent while the previous one decodes (rejected)" in section
    assert "(corpora/sglang/README.md#finding-2)" in section


def test_every_rediscovery_says_how_a_server_reaches_it_and_its_readme_section_exists():
    """Each SGLang 0.5.23 rediscovery's reach comes from its analysis (corpora/sglang/notes.toml) with an
    anchor of corpora/sglang/README.md that the README has."""
    readme = open(os.path.join(ROOT, "corpora", "sglang", "README.md")).read()
    bugs = rediscoveries()
    assert len(bugs) == len(glob.glob(os.path.join(ROOT, "corpora", "sglang", "*.json")))
    for b in bugs:
        assert b.reach and "(corpora/sglang/README.md#finding-" in b.reach, b.id
        anchor = b.reach.rsplit("#", 1)[1].rstrip(")")
        assert f'id="{anchor}"' in readme or f"{{#{anchor}}}" in readme, (b.id, anchor)


def test_the_reports_command_names_the_bugs_it_ran_when_not_all():
    """The zoo's "Generated by" named --bugs; the history suite's dropped it, so it did not reproduce the run."""
    bid = rediscoveries()[0].id
    res = suite.HistoryResult(settings={"suite": "history", "bugs": [bid], "fuzzers": ["random"], "trials": 1,
                                        "budget": 1.0, "jobs": 1, "cpu_count": 2, "started": "2026-12-05 09:00:00"})
    assert f"--fuzzers random --jobs 1 --bugs {bid}` on 2026-12-05" in suite.markdown(res)
    res.settings["bugs"] = list(suite.all_bugs())
    assert "--jobs 1` on 2026-12-05" in suite.markdown(res)


def test_an_interrupted_suites_report_says_which_bugs_did_not_run():
    """Interrupted before its second bug, the report said `rediscovered: no` for it, `bugs found 1/2`, and
    named benchmarks-history.json as the raw data whatever --json was."""
    a, b = rediscoveries()[0].id, rediscoveries()[1].id
    res = suite.HistoryResult(settings={"suite": "history", "bugs": [a, b], "fuzzers": ["random"], "trials": 1,
                                        "budget": 1.0, "jobs": 1, "cpu_count": 2, "started": "2026-12-05 09:00:00"},
                              interrupted=True)
    res.trials = [suite.HistoryTrial(a, "random", 1, 1.0, success=True, seconds=0.5, executions=3, min_len=3,
                                     signature="s", program=[])]
    text = suite.markdown(res, "h.json")
    assert f"| {b} |" in text and "| not run (interrupted) |" in text
    assert "| bugs found (at least once) | 1/1 (1 bug(s) not run: interrupted) |" in text
    assert "`benchmarks-history.json` has" not in text and "(`h.json` has every trial's)" in text


def test_an_interrupted_suites_headline_counts_a_fuzzers_trials_not_run_apart_not_as_missed():
    """Tester 61b: --fuzzers random,hypothesis interrupted before any hypothesis trial: the headline said
    hypothesis `0/2` and listed both bugs as 'random finds and this fuzzer misses' (the zoo: '0/0 (N not run)')."""
    a, b = rediscoveries()[0].id, rediscoveries()[1].id
    res = suite.HistoryResult(settings={"suite": "history", "bugs": [a, b], "fuzzers": ["random", "hypothesis"],
                                        "trials": 1, "budget": 1.0, "jobs": 2, "cpu_count": 2,
                                        "started": "2026-12-05 09:00:00"}, interrupted=True)
    res.trials = [suite.HistoryTrial(bug, "random", 1, 1.0, success=True, seconds=0.5, executions=3, min_len=3,
                                     signature="s", program=[]) for bug in (a, b)]
    text = suite.markdown(res, "h.json")
    assert "| bugs found (at least once) | 2/2 | 0/0 (2 bug(s) not run: interrupted) |" in text, text
    assert "| bugs random finds and this fuzzer misses (target: none) | - | none (2 bug(s) not run: interrupted) |" \
        in text, text
    res.trials.append(suite.HistoryTrial(a, "hypothesis", 1, 1.0, success=False, seconds=1.0, executions=9,
                                         min_len=0, signature="", program=[]))
    text = suite.markdown(res, "h.json")
    assert "| bugs found (at least once) | 2/2 | 0/1 (1 bug(s) not run: interrupted) |" in text, text
    assert f"| - | {a} (1 bug(s) not run: interrupted) |" in text, text


@pytest.mark.parametrize("replays", [(None, None), (False, None), (True, None)], ids=str)
def test_a_program_not_replayed_on_the_fixed_release_is_not_called_not_clean(replays):
    """Interrupted before the fixed release's replays, the Bugs table said "found; NOT clean on the fixed
    release (0/2 programs clean)" beside the JSON's fixed_clean null and "on 0.24.0: not replayed" (the tester):
    only the programs replayed there are counted, and with none the row says not replayed."""
    bid = next(b.id for b in suite.all_bugs().values() if b.fixed and not b.replay_blocked)
    res = suite.HistoryResult(settings={"suite": "history", "bugs": [bid], "fuzzers": ["random"], "trials": 2,
                                        "budget": 1.0, "jobs": 1, "cpu_count": 2, "started": "2026-12-05 09:00:00"},
                              interrupted=True)
    res.trials = [suite.HistoryTrial(bid, "random", seed, 1.0, success=True, seconds=0.5, executions=3, min_len=3,
                                     signature="s", program=[], confirmations=3, fixed_clean=clean)
                  for seed, clean in enumerate(replays, 1)]
    row = next(line for line in suite.markdown(res).splitlines() if line.startswith(f"| {bid} |"))
    verdict = row.split(" | ")[4]
    assert verdict == {(None, None): "found; not replayed on the fixed release (interrupted)",
                       (False, None): "found; NOT clean on the fixed release (0/1 programs clean; 1 not replayed)",
                       (True, None): "yes (1/1 programs clean; 1 not replayed)"}[replays], row


def test_a_workers_temp_files_live_in_its_job_dir_which_the_parent_removes(monkeypatch, tmp_path):
    """An interrupted `bench --suite history` left a kvaudit-history-* dir in the temp dir: the parent
    stops a worker with SIGKILL, so the worker's own TemporaryDirectory was never removed."""
    seen = {}

    class Proc:
        stderr = iter(())

        def __init__(self, argv, env, **k):
            seen["tmp"] = env["TMPDIR"]
            os.mkdir(os.path.join(env["TMPDIR"], "kvaudit-history-x"))  # the trial's dir, when it was killed
            runner.stopped.set()  # the Ctrl-C reaching the parent meanwhile

        def wait(self):
            return -9  # SIGKILL

    monkeypatch.setattr(suite.subprocess, "Popen", Proc)
    monkeypatch.setattr(suite.releases, "env", lambda *a: {})
    runner = suite._Runner(lambda line: None)
    assert runner.child({}, "sglang", "0.5.23", None) == []  # stopped: the results so far (none)
    assert os.path.basename(seen["tmp"]).startswith("kvaudit-history-job-") and not os.path.exists(seen["tmp"])


def test_a_fuzzer_that_cannot_search_the_bugs_engine_is_named_as_json():
    """``fuzzer 'atheris' cannot search a sglang engine``: the name in Python's quotes."""
    bug = BUGS["sglang-22882"]
    from kvaudit.search import fuzzers

    assert not fuzzers.get("atheris").takes("sglang")
    config = registry.get("sglang").preset("sglang").config()
    with pytest.raises(ValueError, match='^fuzzer "atheris" cannot search a sglang engine$'):
        worker.search_trial(bug, config, "atheris", 0, 1.0)


def test_a_trials_work_directory_is_removed_when_an_interrupt_cuts_its_removal(monkeypatch, tmp_path):
    """A second Ctrl-C while the trial's temporary directory was being removed left it half there
    (TemporaryDirectory): the worker's trials and the suite's job directories use kvaudit.atomic.scratch_dir,
    which finishes the removal, then lets the interrupt go on."""
    import dataclasses
    import tempfile

    from kvaudit.search import fuzzers

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    work = []

    def search(config, seconds, seed, stats, run):
        work.append(run.out_dir)
        os.makedirs(os.path.join(run.out_dir, "corpus"))
        raise KeyboardInterrupt

    monkeypatch.setattr(fuzzers, "_FUZZERS", {**fuzzers._FUZZERS,
                                              "random": dataclasses.replace(fuzzers._FUZZERS["random"], search=search)})
    cut_first_removal(monkeypatch)
    bug = next(iter(all_bugs().values()))
    with pytest.raises(KeyboardInterrupt):
        worker.search_trial(bug, registry.get("eut").preset("default").config(), "random", 0, 1.0)
    assert work and work[0].startswith(str(tmp_path)) and os.listdir(tmp_path) == []


FAKE_WORKER = """
import os, sys, time
print("kvaudit history: sglang-22273 random seed 1: found", file=sys.stderr, flush=True)
print("kvaudit history: sglang-22273 random seed 2: found", file=sys.stderr, flush=True)
time.sleep(1.5)  # its next trial
from kvaudit.atomic import write_text_atomic
write_text_atomic(sys.argv[2], '{"results": []}')  # (as the worker writes out.json: a missing dir is made)
"""


def test_a_closed_output_pipe_stops_the_worker_before_its_job_dir_is_removed(monkeypatch, tmp_path):
    """`bench --suite history ... 2>&1 | head -1` left a kvaudit-history-job-* dir in the temp dir: printing
    the worker's next line raised BrokenPipeError, the parent removed the job dir and left with the worker
    still running, which made the dir again for its next out.json."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    real_popen, procs = subprocess.Popen, []

    def popen(argv, **kwargs):  # a real child in the worker's place, under the env the suite gave it
        procs.append(real_popen([sys.executable, "-c", FAKE_WORKER, *argv[-2:]],
                                **{**kwargs, "env": {**os.environ, **kwargs["env"]}}))
        return procs[-1]

    def on_event(line):  # the console's print to a pipe `head` has closed
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(suite.subprocess, "Popen", popen)
    monkeypatch.setattr(suite.releases, "env", lambda *a: {"PYTHONPATH": os.pathsep.join(sys.path)})
    with pytest.raises(BrokenPipeError):
        suite._Runner(on_event).child({}, "sglang", "0.5.10.post1", None)
    procs[0].wait(timeout=30)  # (without the fix: it goes on, and writes its out.json)
    assert os.listdir(tmp_path) == []


def test_an_error_in_one_job_stops_the_others_workers(monkeypatch):
    """With --jobs 2, a closed pipe met by one job left the other's worker searching on (the suite
    waited for it to finish) until its own next line: the suite stops every worker on any error."""
    import threading

    monkeypatch.setattr(suite, "_release", lambda res, engine, version, on_event: None)
    stopped, searching = [], threading.Event()

    def child(self, job, *a):
        if job["bug"] == "vllm-45357":
            searching.wait(10)
            raise BrokenPipeError(32, "Broken pipe")
        searching.set()
        stopped.append(self.stopped.wait(10))  # killed by stop(), as a Ctrl-C does
        return []

    monkeypatch.setattr(suite._Runner, "child", child)
    with pytest.raises(BrokenPipeError):
        suite.run(["vllm-45357", "vllm-47282"], ["random"], 1, 1.0, on_event=lambda line: None, jobs=2)
    assert stopped == [True]
