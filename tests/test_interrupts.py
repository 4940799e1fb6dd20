"""Dying gracefully: SIGTERM (``timeout``, Kubernetes, the Actions runner) takes Ctrl-C's path in
``kvaudit fuzz`` (single run and campaigns), the minimize phase inside it and ``kvaudit minimize``:
what was found is written, then the reports, with Ctrl-C's exit code. A full disk is one line and
exit 74, keeping what was written.

The signal tests drive the installed console script in a subprocess and wait on its output lines,
never on a fixed time. To be *inside* minimization when the signal lands, whatever the machine's
speed, a ``sitecustomize`` planted by the test holds the minimizer open after its first ddmin
pass, at its first round of argument simplification (it prints a line, then sleeps until a signal ends the sleep): everything else is the real code."""

import errno
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings

import pytest
from cli_helpers import invoke, kvaudit_script, plain_env

from kvaudit import replay
from kvaudit.program import FlushCache, Step, Submit
from kvaudit.audit.runner import INTERRUPTED, execute
from kvaudit.search.fuzz import FuzzStats, SearchInterrupted, hypothesis_search
from kvaudit.targets.eut.presets import get_preset

HERE = os.path.dirname(__file__)
REGRESSIONS = os.path.join(HERE, "..", "corpora", "regressions")
BUG = "hisparse-prebuilt-skip-finish"  # found in a handful of executions
HISPARSE = ["--preset", "pd-decode-hisparse", "--bug", BUG]
LIMIT_S = 120  # the most any wait below may take on a loaded machine (a limit, not a sleep)

HOLD_MINIMIZER = '''
import sys
import time

import kvaudit.search.minimize as m


def held(ops, fails, *a, **k):
    print(f"TEST-HOLD: minimizer held at {len(ops)} ops", file=sys.stderr, flush=True)
    while True:
        time.sleep(3600)  # a signal's KeyboardInterrupt ends it


m.simplify_round = held
'''

HOLD_START_UP = '''
import sys
import time

import kvaudit.app.configs as c


def held(*a, **k):  # where a real engine is imported: seconds of start-up
    from kvaudit.audit.runner import INTERRUPTED

    print("TEST-HOLD: start-up held", file=sys.stderr, flush=True)
    # a signal's KeyboardInterrupt ends it; one that landed in a finalizer (a gc pass) is swallowed as unraisable,
    # and INTERRUPTED, which the signal set, stops the wait as it stops the product's next op
    while not INTERRUPTED.is_set():
        time.sleep(0.05)
    raise KeyboardInterrupt


c.select_config = held  # kvaudit fuzz (the CLI builds the config first)
c.require_target = held  # kvaudit ci
'''


class Running:
    """The console script running ``args``: stdout to a file, stderr read line by line on a thread."""

    def __init__(self, tmp_path, args, hold_minimizer=False, hold=None):
        env = plain_env()
        env["PYTHONFAULTHANDLER"] = "1"  # (a process that does not end: SIGABRT prints every thread's stack)
        if hold_minimizer or hold:
            hold_dir = tmp_path / "hold"
            hold_dir.mkdir()
            (hold_dir / "sitecustomize.py").write_text(hold or HOLD_MINIMIZER)
            hold = hold_dir
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(hold), env.get("PYTHONPATH")) if p)
        self.stdout_path = tmp_path / "stdout.txt"
        self._stdout = open(self.stdout_path, "w")
        self.proc = subprocess.Popen([kvaudit_script(), *args], stdout=self._stdout, stderr=subprocess.PIPE,
                                     text=True, env=env)
        self.lines: list[str] = []
        self._new: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stderr:
            self._new.put(line)
        self._new.put(None)

    def wait_for(self, text: str) -> str:
        """The first stderr line containing ``text``; fails if the process ends or LIMIT_S passes first."""
        for line in self.lines:
            if text in line:
                return line
        while True:
            line = self._new.get(timeout=LIMIT_S)
            assert line is not None, f"exited {self.proc.wait()} before {text!r}:\n{''.join(self.lines)}"
            self.lines.append(line)
            if text in line:
                return line

    def finish(self, sig) -> tuple[int, str, str]:
        """Send ``sig``; (exit code, stdout, stderr) once the process is done. A process still running after
        LIMIT_S fails the test with its threads' stacks (SIGABRT: faulthandler), so a rare hang says where."""
        self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout=LIMIT_S)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGABRT)
            try:
                self.proc.wait(timeout=30)
                while (line := self._new.get(timeout=30)) is not None:
                    self.lines.append(line)
            except (subprocess.TimeoutExpired, queue.Empty):
                pass
            pytest.fail(f"not exited {LIMIT_S} s after {signal.Signals(sig).name}; its stderr, with the stacks "
                        f"at SIGABRT:\n{''.join(self.lines)[-6000:]}")
        while (line := self._new.get(timeout=LIMIT_S)) is not None:
            self.lines.append(line)
        self._stdout.close()
        return code, self.stdout_path.read_text(), "".join(self.lines)


@pytest.fixture
def launch(tmp_path):
    """``launch(args, hold_minimizer=False, hold=None)`` starts the console script (``hold``: the
    source of a ``sitecustomize`` to plant, as :data:`HOLD_START_UP`); any still running at the end of
    the test (a failed wait) is killed."""
    started: list[Running] = []

    def start(args, hold_minimizer=False, hold=None) -> Running:
        started.append(Running(tmp_path, args, hold_minimizer, hold))
        return started[-1]

    yield start
    for run in started:
        if run.proc.poll() is None:
            run.proc.kill()
            run.proc.wait()


def replay_files(directory):
    return sorted(os.path.join(directory, p) for p in os.listdir(directory) if p.endswith(".json"))


def assert_reports(tmp_path, signature, interrupted=True):
    """The --json and --junit files name ``signature``; the JSON says it was interrupted."""
    doc = json.load(open(tmp_path / "r.json"))
    cases = doc.get("cases") or [doc]
    assert signature in {f["signature"] for c in cases for f in c["findings"]}
    assert doc.get("interrupted", False) is interrupted
    xml = open(tmp_path / "r.xml").read()
    assert 'failures="0"' not in xml and signature in xml


# -- SIGTERM in kvaudit fuzz ---------------------------------------------------------------------------

REPLAY_HELD = ("import sys, time\nimport kvaudit.app.replay as r\n\n\ndef held(*a, **k):\n"
               "    print('TEST-HOLD: replay held', file=sys.stderr, flush=True)\n    while True:\n"
               "        time.sleep(3600)\n\n\nr._check_determinism = held\n")  # (after the first run: past start-up)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_during_kvaudit_replay_exits_130_in_one_line(tmp_path, launch, sig):
    """SIGTERM killed `kvaudit replay` outright once past start-up (exit -15, no line; Ctrl-C: 130): the commands
    that do not take the signals themselves keep SIGTERM as Ctrl-C (tester 60a)."""
    run = launch(["replay", os.path.join(REGRESSIONS, f"{BUG}.json"), "--check-determinism",
                  "--junit", str(tmp_path / "r.xml")], hold=REPLAY_HELD)
    run.wait_for("TEST-HOLD: replay held")
    code, _, err = run.finish(sig)
    assert code == 130, err[-2000:]
    assert err.rstrip().endswith("kvaudit: interrupted") and "Traceback" not in err, err[-2000:]
    assert not (tmp_path / "r.xml").exists()  # no report written (tester 60c: a JUnit of the first run, then 130)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_kvaudit_replay_takes_a_signal_it_was_started_ignoring(tmp_path, launch, sig):
    """A script's background job (`kvaudit replay F &`) starts with SIGINT ignored: the entry point put that
    back once past start-up, so Ctrl-C (`kill -INT`) left `replay` running (the flaky [2] above: its pytest was
    itself such a job, tester 63), while start-up, `fuzz` and `ci` took it. Now every phase takes it."""
    previous = signal.signal(sig, signal.SIG_IGN)  # what the child inherits (across exec, as from a shell)
    try:
        run = launch(["replay", os.path.join(REGRESSIONS, f"{BUG}.json"), "--check-determinism"], hold=REPLAY_HELD)
    finally:
        signal.signal(sig, previous)
    run.wait_for("TEST-HOLD: replay held")
    code, _, err = run.finish(sig)
    assert code == 130, err[-2000:]
    assert err.endswith("kvaudit: interrupted\n") and "Traceback" not in err, err[-2000:]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_while_minimizing_writes_the_finding_unminimized_and_the_reports(tmp_path, launch, sig):
    out = tmp_path / "out"
    run = launch(["fuzz", *HISPARSE, "--fuzzer", "random", "--seed", "1", "--max-time", "60",
                  "--out", str(out), "--json", str(tmp_path / "r.json"), "--junit", str(tmp_path / "r.xml")],
                 hold_minimizer=True)
    run.wait_for("] minimizing:")  # the progress line of the phase
    run.wait_for("TEST-HOLD")
    code, stdout, stderr = run.finish(sig)
    assert code == 1, stderr  # Ctrl-C's code with a finding, for either signal
    assert "Traceback" not in stderr and "interrupted while minimizing" in stderr
    (path,) = replay_files(out)
    config, program, findings, doc = replay.load(path)
    # confirmed 3/3 before the minimizer began (it said "interrupted before confirmation")
    assert doc["minimized"] is False and doc["confirmations"] == "3/3"
    assert findings[0].signature in execute(config, program).signatures  # a working reproducer
    assert_reports(tmp_path, findings[0].signature)
    assert "program (unminimized)" in stdout


def test_sigterm_during_the_search_exits_130_with_the_reports(tmp_path, launch):
    run = launch(["fuzz", "--preset", "default", "--fuzzer", "random", "--max-time", "600",
                  "--out", str(tmp_path / "out"), "--json", str(tmp_path / "r.json"),
                  "--junit", str(tmp_path / "r.xml")])
    run.wait_for("] fuzzing:")
    code, stdout, stderr = run.finish(signal.SIGTERM)
    assert code == 130, stderr  # Ctrl-C's code with nothing found
    assert "Traceback" not in stderr and "no finding" in stderr
    assert stdout.strip().splitlines()[-1] == "SUMMARY: kvaudit: no findings (interrupted)."  # the last line
    assert json.load(open(tmp_path / "r.json"))["interrupted"] is True
    xml = open(tmp_path / "r.xml").read()
    assert 'failures="0"' in xml
    # not a pass: a skipped case says it was cut short, no "no findings" case (tester 60a: green on a dashboard)
    assert 'name="interrupted"' in xml and '<skipped message="interrupted (Ctrl-C or SIGTERM) after ' in xml, xml
    assert "no findings" not in xml and 'skipped="1"' in xml, xml


def test_sigterm_during_a_campaigns_search_keeps_its_findings_and_writes_the_reports(tmp_path, launch):
    corpus = tmp_path / "corpus"
    run = launch(["fuzz", *HISPARSE, "--fuzzer", "random", "--max-time", "600", "--corpus", str(corpus),
                  "--json", str(tmp_path / "r.json"), "--junit", str(tmp_path / "r.xml")])
    line = run.wait_for("new finding: ")  # confirmed, minimized and written; the search goes on
    code, stdout, stderr = run.finish(signal.SIGTERM)
    assert code == 1, stderr  # a new finding, as after Ctrl-C
    assert "Traceback" not in stderr and "interrupted:" in stdout
    sig, path = line.split("new finding: ")[1].strip().split(" -> ")
    _, _, findings, doc = replay.load(path)
    assert findings[0].signature == sig and doc["minimized"] is True
    assert_reports(tmp_path, sig)


@pytest.mark.slow
def test_sigterm_while_campaign_workers_minimize_keeps_their_finding(tmp_path, launch):
    """Two worker processes, both holding a finding in minimization: the parent's SIGTERM stops them
    (it sends them SIGTERM), each writes its finding unminimized, and the parent reports it."""
    corpus = tmp_path / "corpus"
    run = launch(["fuzz", *HISPARSE, "--fuzzer", "random", "--max-time", "600", "--workers", "2",
                  "--corpus", str(corpus), "--json", str(tmp_path / "r.json"),
                  "--junit", str(tmp_path / "r.xml")], hold_minimizer=True)
    run.wait_for("TEST-HOLD")  # a worker's stderr
    code, stdout, stderr = run.finish(signal.SIGTERM)
    assert code == 1, stderr
    assert "Traceback" not in stderr
    (path,) = replay_files(corpus / "findings")
    config, program, findings, doc = replay.load(path)
    assert doc["minimized"] is False
    assert findings[0].signature in execute(config, program).signatures
    assert f"new finding: {findings[0].signature}" in stderr
    assert_reports(tmp_path, findings[0].signature)


# -- an interrupt while Hypothesis shrinks --------------------------------------------------------------

SHRINK_BUG = ["--preset", "streaming-session", "--bug", "session-borrow-double-count"]  # found in ~1 s, long to shrink


class InterruptAtFirstHit(FuzzStats):
    """Search counts whose first hit sets the interrupt flag, as Ctrl-C's handler does: the next op
    (the first of Hypothesis's shrink cases) stops with a KeyboardInterrupt."""

    def hit(self):
        super().hit()
        INTERRUPTED.set()


def test_an_interrupt_while_hypothesis_shrinks_carries_the_failing_program():
    config = get_preset("streaming-session").config(bugs=frozenset(["session-borrow-double-count"]))
    stats = InterruptAtFirstHit()
    try:
        with pytest.raises(SearchInterrupted) as caught:
            hypothesis_search(config, 60, 1, stats)
    finally:
        INTERRUPTED.clear()
    program, findings = caught.value.found
    assert stats.first_hit is not None and findings
    assert findings[0].signature in execute(config, program).signatures  # a working reproducer, unminimized


def test_the_example_database_keeps_the_failure_an_interrupt_cut_short(tmp_path):
    """A campaign's Hypothesis database (DIR/hypothesis/) holds the case as it failed, before any
    shrinking: a rerun replays it first (a single run keeps no database: its replay file is the record)."""
    config = get_preset("streaming-session").config(bugs=frozenset(["session-borrow-double-count"]))
    try:
        with pytest.raises(SearchInterrupted):
            hypothesis_search(config, 60, 1, InterruptAtFirstHit(), database=str(tmp_path))
    finally:
        INTERRUPTED.clear()
    assert any(files for _, _, files in os.walk(tmp_path))
    stats = FuzzStats()
    assert hypothesis_search(config, 60, 2, stats, database=str(tmp_path)) is not None
    assert stats.first_hit[0] == 1


@pytest.mark.parametrize("campaign", [False, True], ids=["single", "campaign"])
def test_fuzz_interrupted_while_hypothesis_shrinks_writes_the_finding(tmp_path, monkeypatch, campaign):
    """README: `fuzz` exits 1 with a finding when interrupted, one not yet minimized written unminimized
    (the first hit was 1,676 executions into a run; the interrupt while Hypothesis shrank it exited 130,
    'no finding', nothing written)."""
    from kvaudit.search import campaign as campaigns, fuzz

    monkeypatch.setattr(fuzz, "FuzzStats", InterruptAtFirstHit)
    monkeypatch.setattr(campaigns, "FuzzStats", InterruptAtFirstHit)
    out = tmp_path / "out"
    r = invoke("fuzz", *SHRINK_BUG, "--fuzzer", "hypothesis", "--seed", "1", "--max-time", "60",
               *(["--corpus"] if campaign else ["--out"]), str(out),
               "--json", str(tmp_path / "r.json"), "--junit", str(tmp_path / "r.xml"))
    assert r.exit_code == 1, r.output
    assert "Traceback" not in r.output and "no finding" not in r.output
    (path,) = replay_files(out / "findings" if campaign else out)
    config, program, findings, doc = replay.load(path)
    assert doc["minimized"] is False and doc["confirmations"] == "interrupted before confirmation"
    assert findings[0].signature in execute(config, program).signatures
    assert_reports(tmp_path, findings[0].signature)
    if not campaign:
        assert "interrupted while Hypothesis shrank it" in r.stderr and "program (unminimized)" in r.stdout


# -- kvaudit minimize keeps its progress -----------------------------------------------------------------

def padded_program():
    """The HiSparse regression with ops around it that minimization removes: (config, ops, findings)."""
    config, program, findings, _ = replay.load(os.path.join(REGRESSIONS, f"{BUG}.json"))
    return config, [Step(2), FlushCache()] + program + [Submit(2, 9, 3), Step(1)], findings


def test_minimize_interrupted_carries_the_smallest_program_so_far(monkeypatch):
    from kvaudit.search import minimize as m
    from kvaudit.search.minimize import Interrupted, minimize

    config, padded, findings = padded_program()
    sig = findings[0].signature
    runs = []
    real = m.reproduces

    def interrupted_after_a_reduction(config, ops, signature, suppressions=None):
        if any(failed and len(ops) < len(padded) for ops, failed in runs):  # after the first reduction
            raise KeyboardInterrupt
        runs.append((list(ops), real(config, ops, signature, suppressions)))
        return runs[-1][1]

    monkeypatch.setattr(m, "reproduces", interrupted_after_a_reduction)
    with pytest.raises(Interrupted) as caught:
        minimize(config, padded, sig)
    smallest = caught.value.smallest
    assert smallest is not None and len(smallest) < len(padded)
    assert sig in execute(config, smallest).signatures
    assert len(smallest) == min(len(ops) for ops, failed in runs if failed)


def test_minimize_interrupted_before_the_first_run_has_nothing(monkeypatch):
    from kvaudit.search import minimize as m
    from kvaudit.search.minimize import Interrupted, minimize

    config, program, findings, _ = replay.load(os.path.join(REGRESSIONS, f"{BUG}.json"))
    monkeypatch.setattr(m, "reproduces", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(Interrupted) as caught:
        minimize(config, program, findings[0].signature)
    assert caught.value.smallest is None


@pytest.mark.parametrize("how", ["interrupted before the first run", "does not reproduce"])
def test_a_minimize_that_writes_nothing_still_ends_stdout_with_its_summary_line(tmp_path, monkeypatch, how):
    """reports.md: the SUMMARY: line is the last line minimize prints, an interrupted run's too; a minimize that
    wrote nothing printed none (the tester)."""
    src = str(tmp_path / "f.json")
    config, program, findings, _ = replay.load(os.path.join(REGRESSIONS, f"{BUG}.json"))
    if how == "does not reproduce":
        config = config.replace(bugs=frozenset())
    else:
        import kvaudit.app.minimize as app_minimize
        monkeypatch.setattr(app_minimize, "minimize", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    replay.write_atomic(src, replay.to_doc(config, program, findings))
    r = invoke("minimize", src, "-o", str(tmp_path / "out.json"))
    assert r.exit_code == (130 if how.startswith("interrupted") else 4), r.output
    want = "SUMMARY: kvaudit: no findings (interrupted)." if how.startswith("interrupted") else \
        "SUMMARY: kvaudit: no findings."
    assert r.stdout.rstrip().splitlines()[-1] == want, r.stdout[-500:]
    assert not (tmp_path / "out.json").exists()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_during_kvaudit_minimize_writes_the_smallest_program_so_far(tmp_path, launch, sig):
    config, padded, findings = padded_program()
    src, signature = str(tmp_path / "padded.json"), findings[0].signature
    replay.write_atomic(src, replay.to_doc(config, padded, findings))
    run = launch(["minimize", src], hold_minimizer=True)
    held = run.wait_for("TEST-HOLD")
    code, stdout, stderr = run.finish(sig)
    assert code == 130, stderr
    assert "Traceback" not in stderr and "the smallest program so far" in stderr
    config, small, findings, doc = replay.load(str(tmp_path / "padded.min.json"))
    assert len(small) < len(padded) and f"held at {len(small)} ops" in held
    assert findings[0].signature == signature and signature in execute(config, small).signatures
    assert doc["minimized"] is False and doc["minimized_from"] == src


def test_the_replay_after_a_signal_during_kvaudit_minimize_shows_its_progress(tmp_path, launch):
    """Tester tm65: Ctrl-C at 40 s into minimizing a 3,004-op program was followed by 15 s of silence (the
    smallest program so far, still 3,004 ops, replayed before it is written; a second Ctrl-C is ignored then).
    That replay shows its progress as `replay` does (every line here: the interval is 0)."""
    config, padded, findings = padded_program()
    src = str(tmp_path / "padded.json")
    replay.write_atomic(src, replay.to_doc(config, padded, findings))
    every_line = "\nimport kvaudit.app.progress as p\np.PROGRESS_INTERVAL = 0.0\n"
    run = launch(["minimize", src], hold=HOLD_MINIMIZER + every_line)
    run.wait_for("TEST-HOLD")
    code, stdout, stderr = run.finish(signal.SIGINT)
    assert code == 130 and "Traceback" not in stderr, stderr
    (small, _, _), = [(int(n), int(t), d) for n, t, d in re.findall(
        r"^\[\s*[\d.]+s\] replaying the smallest program so far: ops=(\d+)/(\d+) steps=\d+ ops/s=\d+ (done)$",
        stderr, flags=re.M)]
    assert small == len(replay.load(str(tmp_path / "padded.min.json"))[1]) < len(padded), stderr


# -- a full disk ---------------------------------------------------------------------------------------

def full_disk_for(monkeypatch, *suffixes):
    """fsync of a file whose name ends with one of ``suffixes`` fails as on a full disk (ENOSPC), as
    a delayed write does when the disk fills: the atomic writer's temporary file keeps the suffix."""
    real = os.fsync

    def fsync(fd):
        name = os.readlink(f"/proc/self/fd/{fd}")
        if name.endswith(suffixes):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)


def leftovers(directory):
    return [n for n in os.listdir(directory) if n.startswith(".tmp-")]


def test_a_full_disk_while_writing_a_report_is_one_line_and_keeps_what_was_written(tmp_path, monkeypatch):
    full_disk_for(monkeypatch, ".sarif")
    out = tmp_path / "out"
    r = invoke("fuzz", *HISPARSE, "--fuzzer", "random", "--seed", "1", "--max-time", "60", "--out", str(out),
               "--json", str(tmp_path / "r.json"), "--sarif", str(tmp_path / "r.sarif"),
               "--html", str(tmp_path / "r.html"))
    assert r.exit_code == 74, r.output
    (line,) = r.stderr.strip().splitlines()[-1:]
    assert line.startswith("kvaudit: error: disk full: cannot write report ") and str(tmp_path / "r.sarif") in line
    assert "Traceback" not in r.output
    (path,) = replay_files(out)
    _, _, findings, _ = replay.load(path)  # the finding, whole
    assert path in line and str(tmp_path / "r.json") in line  # named as kept
    assert json.load(open(tmp_path / "r.json"))["findings"][0]["signature"] == findings[0].signature
    assert not (tmp_path / "r.sarif").exists() and not leftovers(tmp_path) and not leftovers(out)
    assert "<html" in (tmp_path / "r.html").read_text() and str(tmp_path / "r.html") in line  # (after the SARIF)


def test_a_full_disk_for_the_finding_still_prints_its_report(tmp_path, monkeypatch):
    full_disk_for(monkeypatch, ".json")
    out = tmp_path / "out"
    r = invoke("fuzz", *HISPARSE, "--fuzzer", "random", "--seed", "1", "--max-time", "60", "--out", str(out))
    assert r.exit_code == 74, r.output
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith(f"kvaudit: error: disk full: cannot write {out}") and "No space left" in line
    assert "Traceback" not in r.output and "SUMMARY: kvaudit:" in r.stdout  # the finding is in the log
    assert not replay_files(out) and not leftovers(out)


def ci_over_one_regression(tmp_path, *flags):
    """``kvaudit ci --max-time 0`` over one regression file (tmp_path/regs/a.json), with ``flags``."""
    regs = tmp_path / "regs"
    regs.mkdir()
    shutil.copy(os.path.join(REGRESSIONS, "prefill-finish-leaks-row.json"), regs / "a.json")
    return invoke("ci", "--max-time", "0", "--regressions", str(regs), *flags)


def test_a_full_disk_in_kvaudit_ci_is_one_line(tmp_path, monkeypatch):
    full_disk_for(monkeypatch, ".xml")
    r = ci_over_one_regression(tmp_path, "--junit", str(tmp_path / "ci.xml"))
    assert r.exit_code == 74, r.output
    assert r.stderr.strip().splitlines()[-1].startswith(f"kvaudit: error: disk full: cannot write {tmp_path}")
    assert not (tmp_path / "ci.xml").exists() and not leftovers(tmp_path)


def test_a_full_disk_for_the_finding_still_writes_the_reports_asked_for(tmp_path, monkeypatch):
    """The replay file's disk is full, the JUnit's need not be (another disk): it was not written ("nothing else
    was written"); now it is, and the error names it as kept (the tester)."""
    full_disk_for(monkeypatch, ".json")
    out = tmp_path / "out"
    r = invoke("fuzz", *HISPARSE, "--fuzzer", "random", "--seed", "1", "--max-time", "60", "--out", str(out),
               "--junit", str(tmp_path / "j.xml"))
    assert r.exit_code == 74, r.output
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith(f"kvaudit: error: disk full: cannot write {out}") and "nothing else" not in line
    assert f"kept what was written: {tmp_path / 'j.xml'}" in line
    assert "<failure" in (tmp_path / "j.xml").read_text()


def test_a_full_disk_names_every_file_it_refused(tmp_path, monkeypatch):
    """The replay file, the --json and the --html all on the full disk: the line named the replay file only (and,
    with the replay file written, the first report only: tester 56); now each, and the JUnit kept."""
    full_disk_for(monkeypatch, ".json", ".html")
    out = tmp_path / "out"
    r = invoke("fuzz", *HISPARSE, "--fuzzer", "random", "--seed", "1", "--max-time", "60", "--out", str(out),
               "--json", str(tmp_path / "r.json"), "--html", str(tmp_path / "r.html"), "--junit", str(tmp_path / "j.xml"))
    assert r.exit_code == 74, r.output
    line = r.stderr.strip().splitlines()[-1]
    refused, kept = line.split("; kept what was written: ")
    assert refused.startswith(f"kvaudit: error: disk full: cannot write {out}") and "No space left" in refused
    assert str(tmp_path / "r.json") in refused and str(tmp_path / "r.html") in refused, line
    assert kept == str(tmp_path / "j.xml") and "<failure" in (tmp_path / "j.xml").read_text()
    full_disk_for(monkeypatch, ".sarif")  # (and still .json, .html: the reports' own list, in order)
    r = invoke("fuzz", *HISPARSE, "--fuzzer", "random", "--seed", "1", "--max-time", "60", "--out", str(out),
               "--sarif", str(tmp_path / "r.sarif"), "--html", str(tmp_path / "r.html"))
    assert r.exit_code == 74, r.output
    line = r.stderr.strip().splitlines()[-1]
    assert f".json, report {tmp_path / 'r.sarif'}, {tmp_path / 'r.html'} (No space left" in line, line


def test_a_full_disk_for_cis_sarif_keeps_its_verdict_lines_and_its_junit(tmp_path, monkeypatch):
    """ci's SARIF on a full disk: exit 74 with no SUMMARY: or passed/FAILED line on stdout (the tester); now
    the job's lines, then the JUnit (written after it), then the one-line error."""
    full_disk_for(monkeypatch, ".sarif")
    r = ci_over_one_regression(tmp_path, "--sarif", str(tmp_path / "ci.sarif"),
                               "--junit", str(tmp_path / "ci.xml"), "--html", str(tmp_path / "ci.html"))
    assert r.exit_code == 74, r.output
    last = r.stdout.strip().splitlines()[-2:]
    assert last[0].startswith("SUMMARY: kvaudit:") and last[1].startswith("passed: 1/1 regressions ok"), last
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith(f"kvaudit: error: disk full: cannot write {tmp_path / 'ci.sarif'}"), line
    assert str(tmp_path / "ci.xml") in line and "<testsuite" in (tmp_path / "ci.xml").read_text()
    assert str(tmp_path / "ci.html") in line and (tmp_path / "ci.html").exists()  # (written after the SARIF)


def test_a_full_disk_in_ci_names_every_report_it_refused(tmp_path, monkeypatch):
    full_disk_for(monkeypatch, ".sarif", ".html")
    r = ci_over_one_regression(tmp_path, "--sarif", str(tmp_path / "ci.sarif"),
                               "--junit", str(tmp_path / "ci.xml"), "--html", str(tmp_path / "ci.html"))
    assert r.exit_code == 74, r.output
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith(f"kvaudit: error: disk full: cannot write {tmp_path / 'ci.sarif'}, report "
                           f"{tmp_path / 'ci.html'} (No space left"), line
    assert line.endswith(f"kept what was written: {tmp_path / 'ci.xml'}") and not (tmp_path / "ci.html").exists()


def test_a_campaign_s_full_disk_line_names_its_run_record_and_every_report_refused(tmp_path, monkeypatch):
    """tester2 56: a campaign's line named the first file refused only (ci named them all)."""
    real = os.replace

    def replace(tmp, path):  # (the atomic writer's last step)
        if path.endswith(("campaign.json", "r.json", "s.sarif")):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(tmp, path)

    monkeypatch.setattr(os, "replace", replace)
    corpus = tmp_path / "C"
    r = invoke("fuzz", "--preset", "default", "--fuzzer", "random", "--seed", "1", "--max-time", "1", "--corpus",
               str(corpus), "--json", str(tmp_path / "r.json"), "--sarif", str(tmp_path / "s.sarif"),
               "--junit", str(tmp_path / "j.xml"))
    assert r.exit_code == 74, r.output
    line = r.stderr.strip().splitlines()[-1]
    refused, kept = line.split("; kept what was written: ")
    assert refused.startswith(f"kvaudit: error: disk full: cannot write {corpus / 'campaign.json'}, "), line
    assert str(tmp_path / "r.json") in refused and str(tmp_path / "s.sarif") in refused, line
    assert kept.endswith(str(tmp_path / "j.xml")), line


def test_a_campaign_whose_corpus_disk_is_full_still_reports_its_run(tmp_path, monkeypatch):
    """The corpus's disk full at the run record (corpus/campaign.json): the campaign searched on, then exited 74
    with no JUnit, no SUMMARY: line and the error naming the corpus directory (the tester). Now the run's lines
    and its reports come first, then the error naming the file."""
    real = os.replace

    def replace(tmp, path):  # (the atomic writer's last step: a full disk there names no file)
        if path.endswith("campaign.json"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(tmp, path)

    monkeypatch.setattr(os, "replace", replace)
    corpus = tmp_path / "C"
    r = invoke("fuzz", "--preset", "default", "--fuzzer", "random", "--seed", "1", "--max-time", "1", "--corpus",
               str(corpus), "--junit", str(tmp_path / "j.xml"))
    assert r.exit_code == 74, r.output
    assert r.stdout.strip().splitlines()[-1].startswith("SUMMARY: kvaudit:"), r.stdout[-500:]
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith(f"kvaudit: error: disk full: cannot write {corpus / 'campaign.json'}"), line
    assert str(tmp_path / "j.xml") in line and "<testsuite" in (tmp_path / "j.xml").read_text()


def _a_worker_fills_the_disk(monkeypatch, corpus):
    """Stand-in for a campaign's workers (campaign._run_workers): worker 0 lands a finding, then worker 1's
    next replay file meets a full disk, in the message a real worker sends (campaign.error_message). Returns
    (the finding's file, the file not written)."""
    from kvaudit.search import campaign

    src = os.path.join(REGRESSIONS, f"{BUG}.json")
    signatures = list(dict.fromkeys(f.signature for f in replay.load(src)[2]))
    landed, full = str(corpus / "findings" / "a.json"), str(corpus / "findings" / "b.json")

    def workers(specs, handle):
        assert len(specs) == 2
        shutil.copy(src, landed)
        # (a worker announces each signature its file records: CampaignWorker.triage_and_write)
        for msg in [("ready", 0), ("ready", 1), *[("finding", 0, s, landed) for s in signatures],
                    campaign.error_message(1, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), full)), ("done", 1)]:
            handle(msg)
        raise AssertionError("the campaign went on past a worker's full disk")

    monkeypatch.setattr(campaign, "_run_workers", workers)
    return landed, full


def test_a_campaign_workers_full_disk_is_one_line_after_the_findings_it_kept(tmp_path, monkeypatch):
    """A campaign worker whose disk filled: the parent raised the worker's error out of the campaign, so what
    it had found was not reported, no report or run record was written, and the line named the error twice:
    "(worker 1: OSError: [Errno 28] No space left on device: '...')" (tester). Now the campaign stops there, its
    findings are reported and its reports written, then one line names the file, "No space left" and the
    worker: exit 74."""
    corpus = tmp_path / "C"
    landed, full = _a_worker_fills_the_disk(monkeypatch, corpus)
    r = invoke("fuzz", *HISPARSE, "--fuzzer", "random", "--max-time", "5", "--workers", "2", "--corpus", str(corpus),
               "--junit", str(tmp_path / "j.xml"))
    assert r.exit_code == 74, r.output
    line = r.stderr.strip().splitlines()[-1]
    assert line == (f"kvaudit: error: disk full: cannot write {full} (No space left on device, in worker 1); kept "
                    f"what was written: {landed}, {tmp_path / 'j.xml'}"), line
    assert "Traceback" not in r.output and "<failure" in (tmp_path / "j.xml").read_text()
    assert r.stdout.strip().splitlines()[-1].startswith("SUMMARY: kvaudit: 2 finding(s)"), r.stdout[-500:]
    (run,) = json.load(open(corpus / "campaign.json"))["runs"]
    assert run["new"] == sorted(f.signature for f in replay.load(landed)[2])


def test_a_finding_a_full_disk_kept_off_the_corpus_is_in_the_summary_and_json_as_not_written(tmp_path, monkeypatch):
    """A campaign worker found, confirmed and minimized a finding, then met a full disk writing its file: exit 74
    and the line named the file, but the summary said "no new findings" and --json had no trace of it (tester,
    stop 55). Now the summary, the table and --json name its signature as found but not written."""
    from kvaudit.search import campaign

    real = replay.write_atomic

    def write_atomic(path, doc):
        if os.sep + "findings" + os.sep in path:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        return real(path, doc)

    monkeypatch.setattr(campaign.replay, "write_atomic", write_atomic)
    corpus = tmp_path / "C"
    r = invoke("fuzz", *HISPARSE, "--fuzzer", "random", "--seed", "1", "--max-time", "10", "--corpus", str(corpus),
               "--json", str(tmp_path / "r.json"))
    assert r.exit_code == 74, r.output
    summary = r.stdout.strip().splitlines()[-1]
    # (the bug's program raises two signatures: its device buffer's and its host slots')
    assert summary.startswith("SUMMARY: kvaudit: 2 new signature(s) found but not written (disk full): "), summary
    sigs = summary.split("(disk full): ")[1].rstrip(".").split(", ")
    assert "no new findings" not in r.stdout and r.stdout.count("not written (disk full)") == 1 + 2  # + table rows
    doc = json.load(open(tmp_path / "r.json"))
    assert sorted(doc["not_written"]) == sigs and all(p.startswith(str(corpus / "findings"))
                                                      for p in doc["not_written"].values()), doc
    assert r.stderr.strip().splitlines()[-1].startswith(f"kvaudit: error: disk full: cannot write {corpus}"), r.stderr


def test_a_full_disk_behind_cis_out_is_one_line_after_the_jobs_verdict_and_keeps_the_junit(tmp_path, monkeypatch):
    """The campaign wrote its finding; the copy to --out met a full disk: an internal error (exit 70), no SUMMARY:
    or FAILED line and no JUnit (tester 60a). Now the job's lines, the JUnit, then the one line naming the file."""
    from kvaudit.search import campaign
    from kvaudit.search import ci as search_ci

    src = os.path.join(REGRESSIONS, f"{BUG}.json")
    signature = replay.load(src)[2][0].signature

    def search_loop(spec, emit):  # the campaign finds the bug and writes its file (in ci's scratch corpus)
        landed = os.path.join(spec.corpus, "findings", "a.json")
        os.makedirs(os.path.dirname(landed), exist_ok=True)
        shutil.copy(src, landed)
        for msg in [("ready", 0), ("finding", 0, signature, landed)]:
            emit(msg)

    monkeypatch.setattr(campaign, "_search_loop", search_loop)
    out = tmp_path / "o"
    real = search_ci.replay.write_atomic

    def write_atomic(path, doc):
        if path.startswith(str(out)):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(path, doc)

    monkeypatch.setattr(search_ci.replay, "write_atomic", write_atomic)
    regs = tmp_path / "regs"
    regs.mkdir()
    r = invoke("ci", "--presets", "default", "--fuzzer", "random", "--max-time", "5", "--regressions", str(regs),
               "--out", str(out), "--junit", str(tmp_path / "ci.xml"), "--sarif", str(tmp_path / "ci.sarif"),
               "--json", str(tmp_path / "ci.json"))
    assert r.exit_code == 74, r.output
    last = r.stdout.strip().splitlines()[-2:]
    assert last[0].startswith("SUMMARY: kvaudit:") and "found but not written (disk full)" in last[0], last
    assert last[1].startswith("FAILED: 0/0 regressions ok") and "found but not written (disk full)" in last[1], last
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith(f"kvaudit: error: disk full: cannot write {out}"), line
    assert str(tmp_path / "ci.xml") in line and str(out) not in line.split("kept what was written: ")[1]
    # every report names the finding, none reads as a pass (tester 60c: green JUnit, SARIF and JSON, a "clean" row)
    xml = (tmp_path / "ci.xml").read_text()
    import re
    assert re.search(r'<testsuites [^>]*failures="[1-9]', xml) and f'name="{signature}"' in xml, xml
    assert "NOT WRITTEN: disk full" in xml, xml
    sarif = json.load(open(tmp_path / "ci.sarif"))
    assert signature in {r["partialFingerprints"]["kvauditSignature/v1"] for r in sarif["runs"][0]["results"]}
    doc = json.load(open(tmp_path / "ci.json"))
    assert signature in doc["not_written"] and signature in json.dumps(doc.get("cases", doc)), doc.keys()
    assert "clean" not in r.stdout.split("kvaudit ci", 1)[1], r.stdout


def test_a_ci_campaigns_full_disk_is_one_line_after_the_jobs_verdict(tmp_path, monkeypatch):
    """The same in `kvaudit ci`, whose campaigns run one driver in-process: an internal error (exit 70) before;
    now the job's lines, then the one line, and the next preset is not searched (its findings could not be
    written either)."""
    from kvaudit.search import campaign

    src = os.path.join(REGRESSIONS, f"{BUG}.json")
    signatures = list(dict.fromkeys(f.signature for f in replay.load(src)[2]))
    corpus = tmp_path / "corpus"
    landed, full = str(corpus / "default" / "findings" / "a.json"), str(corpus / "default" / "findings" / "b.json")

    def search_loop(spec, emit):
        shutil.copy(src, landed)
        for msg in [("ready", 0), *[("finding", 0, s, landed) for s in signatures]]:  # (one a signature, as a worker)
            emit(msg)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), full)

    monkeypatch.setattr(campaign, "_search_loop", search_loop)
    regs = tmp_path / "regs"
    regs.mkdir()
    r = invoke("ci", "--presets", "default,mixed-chunk", "--fuzzer", "random", "--max-time", "10", "--regressions",
               str(regs), "--corpus", str(corpus), "--out", str(tmp_path / "o"))
    assert r.exit_code == 74, r.output
    assert r.stdout.strip().splitlines()[-1].startswith("FAILED: 0/0 regressions ok, 2 new finding(s)"), r.stdout
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith(f"kvaudit: error: disk full: cannot write {full} (No space left on device); kept"), line
    assert "fuzz mixed-chunk" not in r.stderr


def test_a_ci_campaigns_finding_a_full_disk_kept_off_the_corpus_is_in_its_summary_and_verdict(tmp_path, monkeypatch):
    """stop 56: `fuzz` named a finding found but not written (disk full) in its SUMMARY: line; `ci` said "no new
    findings" and "passed"-style counts of 0 for it. Now both lines name it, and the job fails."""
    from kvaudit.search import campaign

    signature = replay.load(os.path.join(REGRESSIONS, f"{BUG}.json"))[2][0].signature
    corpus = tmp_path / "corpus"
    full = str(corpus / "default" / "findings" / "b.json")

    def search_loop(spec, emit):
        for msg in [("ready", 0), ("unwritten", 0, [signature], full)]:
            emit(msg)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), full)

    monkeypatch.setattr(campaign, "_search_loop", search_loop)
    regs = tmp_path / "regs"
    regs.mkdir()
    r = invoke("ci", "--presets", "default", "--fuzzer", "random", "--max-time", "10", "--regressions", str(regs),
               "--corpus", str(corpus), "--out", str(tmp_path / "o"))
    assert r.exit_code == 74, r.output
    summary, verdict = r.stdout.strip().splitlines()[-2:]
    assert summary == f"SUMMARY: kvaudit: 1 new signature(s) found but not written (disk full): {signature}.", summary
    assert verdict == "FAILED: 0/0 regressions ok, 0 new finding(s), 1 found but not written (disk full)", verdict


WORKER_ENDS_THEN_SIGTERM = """
import os, signal, sys
from kvaudit.search import campaign

class Queue:
    def __init__(self):
        self.got = []

    def put(self, msg):
        self.got.append(msg)

q = Queue()
campaign._worker_main(campaign._Spec(0, {"target": "nope"}, "random", 0, 1.0, sys.argv[1], None, 1, 0), q)
print([msg[0] for msg in q.got], flush=True)
os.kill(os.getpid(), signal.SIGTERM)  # the parent stopping the other workers, as the queue flushes at exit
print("exited quietly", flush=True)
"""


def test_a_worker_that_said_its_end_takes_the_parents_sigterm_quietly(tmp_path):
    """On a full tmpfs, the worker whose replay file was not written reported it and ended; the parent then
    stopped the other worker with SIGTERM, which reached the first in its exit (the queue's flush) and printed
    "Process SpawnProcess-1: Traceback ... KeyboardInterrupt" into the log, every time. A worker that has said
    its end ("error", then "done") ignores SIGTERM."""
    env = {**plain_env(), "PYTHONPATH": os.path.dirname(os.path.abspath(HERE))}
    r = subprocess.run([sys.executable, "-c", WORKER_ENDS_THEN_SIGTERM, str(tmp_path)], env=env, capture_output=True,
                       text=True, timeout=LIMIT_S)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stdout.splitlines() == ["['error', 'done']", "exited quietly"]


def test_other_write_errors_stay_input_errors(tmp_path, monkeypatch):
    def fsync(fd):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "fsync", fsync)
    src = os.path.join(REGRESSIONS, f"{BUG}.json")
    r = invoke("report", src, "--sarif", str(tmp_path / "r.sarif"))
    assert r.exit_code == 2 and "cannot write report" in r.stderr and "disk full" not in r.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_during_kvaudit_bench_writes_the_trials_that_finished(tmp_path, launch, monkeypatch, sig):
    """SIGTERM took the default action (exit 143, no report, a kvaudit-bench-* directory left in the temp
    dir); Ctrl-C exited 130 with no report, though --help promised the report so far."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    run = launch(["bench", "--trials", "3", "--budget", "30", "--bugs", BUG, "--fuzzers", "random",
                  "--fp-seconds", "30", "--overhead-presets", "none", "--out", str(tmp_path / "b.md"),
                  "--json", str(tmp_path / "b.json")])
    run.wait_for("seed 1:")  # one trial finished; the next is searching
    code, stdout, stderr = run.finish(sig)
    assert code == 130 and "Traceback" not in stderr, stderr
    doc = json.load(open(tmp_path / "b.json"))
    assert doc["interrupted"] is True and [t["seed"] for t in doc["trials"]][:1] == [1]
    md = (tmp_path / "b.md").read_text()
    assert "INTERRUPTED: partial" in md and f"--bugs {BUG} " in md
    assert os.listdir(tmp) == []


# -- SIGTERM in start-up ---------------------------------------------------------------------------------

def test_sigterm_while_the_target_loads_exits_130_with_one_line(tmp_path, launch):
    """SIGTERM in the seconds a real engine's import takes (where a CI ``timeout`` lands) took the
    default action, a bare 143; now it is Ctrl-C's path: one line and 130 (nothing ran, no report)."""
    run = launch(["fuzz", "--max-time", "60", "--out", str(tmp_path / "out")], hold=HOLD_START_UP)
    run.wait_for("TEST-HOLD: start-up held")
    code, out, err = run.finish(signal.SIGTERM)
    assert code == 130, err
    assert err.strip().splitlines()[-1] == "kvaudit: interrupted" and "Traceback" not in err
    assert out.splitlines() == ["SUMMARY: kvaudit: no findings (interrupted)."]  # (stop 63: none)


def test_ci_interrupted_while_the_target_loads_writes_its_junit(tmp_path, launch):
    """kvaudit ci writes its JUnit for what ran, also when nothing did: a skipped 'interrupted' case."""
    empty = tmp_path / "regs"
    empty.mkdir()
    run = launch(["ci", "--max-time", "60", "--presets", "default", "--regressions", str(empty),
                  "--out", str(tmp_path / "out"), "--junit", str(tmp_path / "ci.xml")], hold=HOLD_START_UP)
    run.wait_for("TEST-HOLD: start-up held")
    code, out, err = run.finish(signal.SIGTERM)
    assert code == 130, err
    assert "(interrupted)" in out
    xml = (tmp_path / "ci.xml").read_text()
    assert 'name="interrupted"' in xml and "<skipped" in xml and 'failures="0"' in xml


def signal_caught(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler for ``sig`` (Linux: /proc/PID/status, SigCgt)."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            mask = next(line for line in fh if line.startswith("SigCgt:")).split()[1]
    except (OSError, StopIteration):
        return False
    return bool(int(mask, 16) >> (sig - 1) & 1)


def interrupted_at_start_up(args: list[str], sig) -> tuple[int, str, str]:
    """``kvaudit ARGS`` sent ``sig`` as soon as the entry point's guard is in (it catches SIGTERM, which Python
    alone does not; it installs SIGINT's handler first), whatever the load: (exit code, stdout, stderr)."""
    proc = subprocess.Popen([kvaudit_script(), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=plain_env())
    try:
        deadline = time.monotonic() + LIMIT_S
        while not signal_caught(proc.pid, signal.SIGTERM):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.001)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=LIMIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, out, err


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads /proc to see the guard installed")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_ci_interrupted_during_its_imports_writes_its_junit_and_sarif(tmp_path, sig):
    """A signal in the first second (the entry point importing the engine and the search) exited 130 with
    'kvaudit: interrupted' and wrote no --junit; from about 1.6 s on it did. The signal is sent as soon
    as the entry point's guard is installed (it catches SIGTERM; Python alone does not), whatever the load."""
    junit, sarif = tmp_path / "ci.xml", tmp_path / "ci.sarif"
    returncode, out, err = interrupted_at_start_up(["ci", "--max-time", "60", "--out", str(tmp_path / "out"),
                                                    f"--junit={junit}", "--sarif", str(sarif)], sig)
    assert returncode == 130, err
    assert err.strip().splitlines()[-1] == "kvaudit: interrupted" and "Traceback" not in err
    assert out.splitlines() == ["SUMMARY: kvaudit: no new findings (interrupted).",  # (stop 63: none)
                                "INTERRUPTED: 0/0 regressions ok, 0 new finding(s)"]
    assert "kvaudit ci:" not in err  # stopped before the job began: start-up's own path wrote the files
    xml = junit.read_text()
    assert 'name="interrupted"' in xml and "<skipped" in xml and 'failures="0"' in xml and "start-up" in xml
    (run,) = json.loads(sarif.read_text())["runs"]
    assert run["results"] == [] and run["invocations"][0]["executionSuccessful"] is False
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")]


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads /proc to see the guard installed")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_kvaudit_bench_interrupted_during_its_imports_writes_a_report_saying_no_trial_ran(tmp_path, sig):
    """tr69: a signal in `kvaudit bench`'s start-up (before its `kvaudit bench:` line) wrote no report, only
    `kvaudit: interrupted` (130), though later ones write the trials that finished. Its report says no trial ran."""
    md, raw = tmp_path / "b.md", tmp_path / "b.json"
    returncode, out, err = interrupted_at_start_up(["bench", "--trials", "1", "--bugs", BUG, "--out", str(md),
                                                    "--json", str(raw)], sig)
    assert returncode == 130 and "Traceback" not in err, err
    assert err.strip().splitlines()[-2:] == [f"reports written, each saying nothing was checked (interrupted "
                                             f"during start-up): {md}, {raw}", "kvaudit: interrupted"], err
    assert out == "" and "kvaudit bench:" not in err
    doc = json.loads(raw.read_text())
    assert doc["format"] == "kvaudit.bench/1" and doc["interrupted"] is True and doc["trials"] == [], doc
    assert "INTERRUPTED during start-up" in md.read_text() and "Raw data: `b.json`" in md.read_text()


@pytest.mark.parametrize("suite", ["zoo", "history"])
def test_kvaudit_bench_interrupted_before_its_job_began_writes_its_default_report_but_not_for_list(
        tmp_path, monkeypatch, suite):
    """tr69: the same between the command line and the benchmark (the default --fuzzers looked up): the
    suite's report, where bench writes it unless told (the current directory); `--list` writes none."""
    import kvaudit.app.bench as job

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(job, "default_fuzzers", interrupted)
    monkeypatch.chdir(tmp_path)
    r = invoke("bench", "--suite", suite)
    assert r.exit_code == 130 and r.stdout == "", r.output
    md, raw = ("benchmarks.md", "benchmarks.json") if suite == "zoo" else ("benchmarks-history.md",
                                                                           "benchmarks-history.json")
    assert sorted(os.listdir(tmp_path)) == sorted([md, raw]), r.output
    doc = json.loads((tmp_path / raw).read_text())
    assert doc["format"] == f"kvaudit.{'bench' if suite == 'zoo' else 'bench-history'}/1" and doc["interrupted"]
    for name in (md, raw):
        os.unlink(name)
    monkeypatch.setattr(job, "list_zoo", interrupted)
    monkeypatch.setattr(job, "run_history", interrupted)
    r = invoke("bench", "--suite", suite, "--list")
    assert r.exit_code == 130 and os.listdir(tmp_path) == [], r.output


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads /proc to see the guard installed")
def test_a_campaign_interrupted_during_its_imports_writes_its_json_sarif_and_junit(tmp_path):
    """Ctrl-C in the first seconds of `fuzz --workers 2` (the entry point importing the engine; under load
    4-5 s) exited 130 with 'kvaudit: interrupted' and wrote none of the reports asked for (tester, stop 55;
    the single-process run the same). Now they say nothing was checked. SIGINT at its default in the child:
    the guard catches it whatever this process inherited."""
    paths = {k: tmp_path / f"r.{k}" for k in ("json", "sarif", "xml", "html")}
    returncode, out, err = interrupted_at_start_up(["fuzz", "--max-time", "60", "--workers", "2", "--no-seeds",
                                                    "--corpus", str(tmp_path / "c"), "--json", str(paths["json"]),
                                                    "--sarif", str(paths["sarif"]), f"--junit={paths['xml']}",
                                                    "--html", str(paths["html"])], signal.SIGINT)
    assert returncode == 130, err
    assert err.strip().splitlines()[-1] == "kvaudit: interrupted" and "Traceback" not in err
    assert out.splitlines() == ["SUMMARY: kvaudit: no new findings (interrupted)."]  # (stop 63: none)
    doc = json.loads(paths["json"].read_text())
    assert doc["interrupted"] is True and doc["executions"] == 0 and doc["findings"] == []
    (run,) = json.loads(paths["sarif"].read_text())["runs"]
    assert run["results"] == [] and run["invocations"][0]["executionSuccessful"] is False
    assert 'name="interrupted"' in paths["xml"].read_text()
    assert "nothing was checked" in paths["html"].read_text()


def test_the_start_up_interrupts_line_shows_a_newline_or_non_utf8_name_escaped(tmp_path, capsys):
    """Stop 62: the start-up interrupt's one line wrote each report's name raw: a newline in it split the line (a
    byte that is not UTF-8 went out as a lone surrogate). Escaped, as a run's ``reports written:`` shows it."""
    from kvaudit.app.interrupts import write_startup_reports

    doc = os.fsdecode(bytes(tmp_path) + b"/s\xff\n.json")
    assert write_startup_reports(["fuzz", "--json", doc]) == [doc]
    assert capsys.readouterr().err == (f"reports written, each saying nothing was checked (interrupted during "
                                       f"start-up): {tmp_path}/s\\xff\\n.json\n")


def test_the_json_of_a_run_interrupted_at_start_up_reports_as_nothing_checked(tmp_path, capsys):
    """`kvaudit report` on the --json a start-up interrupt wrote said 'missing key "config"' (exit 2), as if the
    file were broken: it says in one line that the run checked nothing (exit 5, as a search that ran nothing),
    and writes no report. The --html asked for at start-up is a page that says the same."""
    from kvaudit.app.interrupts import write_startup_reports

    doc, page = str(tmp_path / "s.json"), str(tmp_path / "s.html")
    assert write_startup_reports(["fuzz", "--json", doc, "--html", page]) == [doc, page]
    # (stop 61's note: it printed "JSON written: ..." and "HTML written: ...", where a run says "reports written")
    assert capsys.readouterr().err == (f"reports written, each saying nothing was checked (interrupted during "
                                       f"start-up): {doc}, {page}\n")
    assert "nothing was checked" in open(page).read() and "<!DOCTYPE html>" in open(page).read()
    r = invoke("report", doc, "--html", str(tmp_path / "r.html"))
    assert r.exit_code == 5, r.output
    assert r.stderr.splitlines() == [f"kvaudit: error: {doc}: nothing recorded: the run was interrupted (Ctrl-C or "
                                     "SIGTERM) during start-up, before it checked anything (no config, no program)"]
    assert not (tmp_path / "r.html").exists()
    r = invoke("replay", doc)
    assert r.exit_code == 5 and "interrupted (Ctrl-C or SIGTERM) during start-up" in r.stderr, r.output
    r = invoke("export", doc, "--issue", str(tmp_path / "i.md"))  # (was exit 2, as if the file were broken)
    assert r.exit_code == 5 and "interrupted (Ctrl-C or SIGTERM) during start-up" in r.stderr, r.output
    assert not (tmp_path / "i.md").exists()


def test_ci_interrupted_before_its_job_began_in_process_writes_its_junit(tmp_path, monkeypatch):
    """The same between the command line and the job's own interrupt handling (checking its options)."""
    import kvaudit.app.configs as configs

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(configs, "check_fuzzer", interrupted)
    r = invoke("ci", "--max-time", "60", "--junit", str(tmp_path / "ci.xml"), "--sarif", str(tmp_path / "ci.sarif"))
    assert r.exit_code == 130, r.output
    assert r.stderr.strip().splitlines()[-1] == "kvaudit: interrupted"
    assert 'name="interrupted"' in (tmp_path / "ci.xml").read_text()
    assert json.loads((tmp_path / "ci.sarif").read_text())["runs"][0]["invocations"][0]["executionSuccessful"] is False


def test_ci_interrupted_before_its_job_began_writes_its_json_too(tmp_path, monkeypatch):
    """Stop 62: `ci --json` was not written when interrupted before the job began (its JUnit, SARIF and HTML
    were: the start-up reports took ci for a command without --json). Now the same file as fuzz's, with ci's
    "job", which `kvaudit report` reads as nothing recorded (exit 5), not as a broken file."""
    import kvaudit.app.configs as configs

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(configs, "check_fuzzer", interrupted)
    doc = tmp_path / "ci.json"
    r = invoke("ci", "--max-time", "60", "--json", str(doc), "--junit", str(tmp_path / "ci.xml"))
    assert r.exit_code == 130, r.output
    assert r.stderr.splitlines() == [f"reports written, each saying nothing was checked (interrupted during "
                                     f"start-up): {doc}, {tmp_path / 'ci.xml'}", "kvaudit: interrupted"]
    written = json.loads(doc.read_text())
    assert written["interrupted"] is True and written["executions"] == 0 and written["job"] == "kvaudit ci"
    r = invoke("report", str(doc))
    assert r.exit_code == 5 and "nothing recorded" in r.stderr, r.output


@pytest.mark.parametrize("args, campaign", [(["fuzz"], False), (["fuzz", "--corpus", "C"], True),
                                            (["fuzz", "--workers=2"], True), (["fuzz", "--db", "redis://h/0"], True),
                                            (["ci"], True)], ids=["fuzz", "corpus", "workers", "db", "ci"])
def test_a_run_interrupted_before_its_job_began_ends_stdout_with_its_summary_line(tmp_path, monkeypatch, args,
                                                                                   campaign):
    """Stop 63: interrupted during start-up, `fuzz` and `ci` printed no `SUMMARY:` line (stdout empty), though
    reports.md says an interrupted run ends with one; now the line the job prints when interrupted with nothing
    found (a campaign's and ci's `no new findings`), and ci's `INTERRUPTED` verdict line after it."""
    from kvaudit.app.budget import Budget
    from kvaudit.reports.report import new_findings_line, summary_line

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(Budget, "for_command", interrupted)
    r = invoke(*args, "--max-time", "60", "--out", str(tmp_path / "out"))
    assert r.exit_code == 130, r.output
    want = [new_findings_line([], interrupted=True) if campaign else summary_line([], interrupted=True)]
    if args == ["ci"]:
        want.append("INTERRUPTED: 0/0 regressions ok, 0 new finding(s)")  # as the job's own, interrupted at once
    assert r.stdout.splitlines() == want
    assert r.stderr.splitlines() == ["kvaudit: interrupted"]


def test_fuzz_interrupted_before_its_search_began_writes_fuzz_s_junit(tmp_path):
    """`kvaudit fuzz --junit` stopped during start-up wrote ci's JUnit: testsuites "kvaudit ci", an empty
    "kvaudit.regressions" suite and a "kvaudit.fuzz" suite, where every other fuzz JUnit (clean, a finding,
    interrupted later) has the one suite "kvaudit": a dashboard saw another suite, and a regression suite
    fuzz never has. Now fuzz's own document, its skipped case the one a later interrupt gives."""
    import xml.etree.ElementTree as ET

    from kvaudit.app.interrupts import write_startup_reports
    from kvaudit.reports import ci_outputs
    from kvaudit.reports.junit import to_junit

    fuzz, job = str(tmp_path / "fuzz.xml"), str(tmp_path / "ci.xml")
    assert write_startup_reports(["fuzz", "--junit", fuzz]) == [fuzz]
    assert write_startup_reports(["ci", "--junit", job]) == [job]
    text = open(fuzz).read()
    assert text == to_junit([], suite_name="kvaudit", skipped=("interrupted", ci_outputs.NOTHING_RAN)), text
    root = ET.fromstring(text.split("\n", 1)[1])
    assert root.get("name") == "kvaudit" and [s.get("name") for s in root] == ["kvaudit"], text
    assert [s.get("name") for s in ET.fromstring(open(job).read().split("\n", 1)[1])] == [
        "kvaudit.regressions", "kvaudit.fuzz"]  # (ci's: as before)


def test_the_start_up_reports_read_the_command_line_as_click_does(tmp_path):
    from kvaudit.app.interrupts import startup_report_paths as ci_report_paths, write_startup_reports
    from kvaudit.reports import ci_outputs
    from kvaudit.search import ci

    assert ci_report_paths(["ci", "--junit", "a.xml", "--out", "--sarif", "--sarif=b.sarif"]) == \
        {"junit": "a.xml", "sarif": "b.sarif"}  # --out's value is '--sarif'; the last --sarif wins
    assert ci_report_paths(["ci", "--", "--junit", "a.xml"]) == {}
    assert ci_report_paths(["ci", "--help", "--junit", "a"]) == {}
    assert ci_report_paths(["bench", "--json", "a.json"]) == {"out": "benchmarks.md", "json": "a.json"}  # (tr69)
    assert ci_report_paths(["bench", "--json", "a.json", "--list"]) == {}
    assert ci_report_paths(["ci", "--json", "a.json"]) == {"json": "a.json"}
    assert ci_report_paths(["ci", "--html", "a.html"]) == {"html": "a.html"}
    # fuzz's flags take no value: the report after one is still read
    assert ci_report_paths(["fuzz", "--no-seeds", "--json", "a.json", "--paranoid", "--sarif", "b"]) == \
        {"json": "a.json", "sarif": "b"}
    # the same document the job writes when interrupted, but for the reason
    assert ci_outputs.interrupted_junit() == ci.junit(ci.CiResult(interrupted=True)).replace(
        ci_outputs.INTERRUPTED, ci_outputs.NOTHING_RAN)
    (tmp_path / "d").mkdir()
    same = str(tmp_path / "x.xml")
    assert write_startup_reports(["ci", "--junit", same, "--sarif", same]) == []  # the job refuses those
    assert write_startup_reports(["ci", "--junit", str(tmp_path / "d"), "--sarif", "/dev/null"]) == []
    assert os.path.isdir(tmp_path / "d") and os.path.exists("/dev/null") and not os.path.isfile("/dev/null")


def test_the_start_up_summary_reads_workers_and_help_as_click_does():
    """Tester, stop 64: ``fuzz --workers +2`` (click reads 2: a campaign) interrupted in start-up ended with a single
    run's ``no findings`` (the value was read with str.isdigit), and ``fuzz --out --help --json r.json`` (click
    reads ``--help`` as --out's directory, and the job runs) wrote no report and no SUMMARY: line (any ``--help``
    in the line counted). The campaign test is click's own parse of the same line, as the job decides it."""
    from kvaudit.app.interrupts import startup_report_paths, startup_summary
    from kvaudit.cli import CHECK_ONLY, main

    for extra in (["--workers", "+2"], ["--workers", " 3"], ["--workers=2"], ["--workers", "1"], [],
                  ["--corpus="], ["--db", "--corpus"], ["--out", "--help"], ["--workers", "1_0"]):
        argv = ["fuzz", *extra]
        with main.make_context("kvaudit", list(argv), obj={CHECK_ONLY: True}) as ctx, warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # (click 8.2+: protected_args, as cli.parses)
            name, command, rest = main.resolve_command(ctx, [*getattr(ctx, "protected_args", ()), *ctx.args])
            params = command.make_context(name, rest, parent=ctx).params
        campaign = params["corpus_dir"] is not None or params["workers"] > 1 or params["db_url"] is not None
        want = "SUMMARY: kvaudit: no new findings (interrupted)." if campaign else \
            "SUMMARY: kvaudit: no findings (interrupted)."
        assert startup_summary(argv) == [want], argv
    assert startup_report_paths(["fuzz", "--out", "--help", "--json", "r.json"]) == {"json": "r.json"}
    assert startup_summary(["fuzz", "--json", "r.json", "--help"]) == startup_summary(["ci", "-h"]) == []


# -- kvaudit ci ------------------------------------------------------------------------------------------

def test_ci_interrupted_in_a_fuzz_campaign_still_reports_what_it_found(tmp_path, monkeypatch):
    """A campaign cut short by Ctrl-C or SIGTERM returns what it found: ci reports it and fails."""
    from kvaudit.search import campaign

    src = os.path.join(REGRESSIONS, f"{BUG}.json")
    _, _, findings, _ = replay.load(src)

    def interrupted_campaign(config, fuzzer, budget, seed, workers, corpus, *a, **k):
        path = os.path.join(campaign.findings_dir(corpus), os.path.basename(src))
        os.makedirs(os.path.dirname(path))
        shutil.copy(src, path)
        return campaign.CampaignResult(new={findings[0].signature: path}, interrupted=True)

    monkeypatch.setattr(campaign, "run_campaign", interrupted_campaign)
    empty = tmp_path / "regs"
    empty.mkdir()
    r = invoke("ci", "--max-time", "10", "--presets", "default,chunked", "--regressions", str(empty),
               "--out", str(tmp_path / "out"), "--junit", str(tmp_path / "ci.xml"))
    assert r.exit_code == 1, r.output  # a new finding, as after Ctrl-C
    assert "(interrupted)" in r.stdout and "fuzz chunked" not in r.stderr  # stopped after the first preset
    assert findings[0].signature in open(tmp_path / "ci.xml").read()
    assert os.listdir(tmp_path / "out") == [os.path.basename(src)]


def test_ci_interrupted_in_a_clean_fuzz_does_not_call_it_clean(tmp_path, monkeypatch):
    """An interrupted preset printed 'fuzz default: 0 executions, clean', and its row said clean."""
    from kvaudit.search import campaign

    monkeypatch.setattr(campaign, "run_campaign", lambda *a, **k: campaign.CampaignResult(interrupted=True))
    empty = tmp_path / "regs"
    empty.mkdir()
    r = invoke("ci", "--max-time", "10", "--presets", "default,chunked", "--regressions", str(empty),
               "--out", str(tmp_path / "out"))
    assert r.exit_code == 130, r.output
    assert "fuzz default: 0 executions, interrupted before its share ended" in r.stderr
    row = next(line for line in r.stdout.splitlines() if line.startswith("  fuzz default"))
    assert "(interrupted)" in row and "interrupted before its share ended" in row and "clean" not in row
    assert not (tmp_path / "out").exists()  # nothing was written there



def _three_regression_files(tmp_path):
    """``tmp_path/regs`` holding a.json, b.json and c.json, each a shipped regression file."""
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "corpora", "regressions",
                       "session-close-while-running.json")
    regs = tmp_path / "regs"
    regs.mkdir()
    for name in ("a.json", "b.json", "c.json"):
        shutil.copy(src, regs / name)
    return regs


def test_ci_interrupted_names_the_regressions_and_presets_it_never_started(tmp_path, monkeypatch):
    """After Ctrl-C the job's table left out the regression files not replayed yet and the presets not fuzzed
    yet: a CI log's reader saw rows for what ran and could not tell the rest had been planned. Each has its
    row, 'not run: interrupted before it started'; the file whose replay the interrupt cut short is 'interrupted
    while it was replayed' (it was labelled as never started)."""
    from kvaudit.search import campaign, ci

    regs = _three_regression_files(tmp_path)
    check = ci.check_regression

    def first_only(path, *a, **k):
        if path.endswith("b.json"):
            check(path, *a, **k)  # (replayed, then cut short before its result)
            raise KeyboardInterrupt
        return check(path, *a, **k)

    monkeypatch.setattr(ci, "check_regression", first_only)
    r = invoke("ci", "--max-time", "10", "--presets", "default,chunked", "--regressions", str(regs),
               "--out", str(tmp_path / "out"))
    assert r.exit_code == 130, r.output
    rows = {line.split()[1]: line for line in r.stdout.splitlines()
            if line.startswith(("  regression ", "  fuzz "))}
    assert "ok" in rows["a"] and "not run" not in rows["a"], r.stdout
    assert rows["b"].split(None, 2)[2] == "interrupted while it was replayed", r.stdout
    for name in ("c", "default", "chunked"):
        assert "not run: interrupted before it started" in rows[name], r.stdout

    monkeypatch.setattr(ci, "check_regression", check)
    monkeypatch.setattr(campaign, "run_campaign", lambda *a, **k: campaign.CampaignResult(interrupted=True))
    (regs / "b.json").unlink()
    r = invoke("ci", "--max-time", "10", "--presets", "default,chunked", "--regressions", str(regs),
               "--out", str(tmp_path / "out"))
    assert r.exit_code == 130, r.output
    rows = {line.split()[1]: line for line in r.stdout.splitlines() if line.startswith(("  regression ", "  fuzz "))}
    assert "interrupted before its share ended" in rows["default"] and "not run" not in rows["default"]
    assert "not run: interrupted before it started" in rows["chunked"], r.stdout

def test_ci_interrupted_gives_each_regression_file_without_a_result_a_skipped_junit_case(tmp_path, monkeypatch):
    """The table named the regression files the interrupt kept from a result ('regression b  interrupted while
    it was replayed', 'regression c  not run: interrupted before it started'), but the JUnit had a case for a
    alone: a dashboard counted one regression where the job had three. Each has a skipped case, in the table's
    words."""
    import xml.etree.ElementTree as ET

    from kvaudit.search import ci

    regs = _three_regression_files(tmp_path)
    check = ci.check_regression

    def first_only(path, *a, **k):
        if path.endswith("b.json"):
            raise KeyboardInterrupt
        return check(path, *a, **k)

    monkeypatch.setattr(ci, "check_regression", first_only)
    r = invoke("ci", "--max-time", "0", "--regressions", str(regs), "--junit", str(tmp_path / "ci.xml"))
    assert r.exit_code == 130, r.output
    cases = {c.get("name"): c for c in ET.parse(tmp_path / "ci.xml").getroot().iter("testcase")}
    assert list(cases) == ["a", "b", "c", "interrupted"]
    assert list(cases["a"]) == []
    assert [(c.tag, c.get("message")) for c in cases["b"]] == [("skipped", "interrupted while it was replayed")]
    assert [(c.tag, c.get("message")) for c in cases["c"]] == [("skipped", "not run: interrupted before it started")]


def test_ci_interrupted_gives_each_preset_it_never_started_a_skipped_junit_case(tmp_path, monkeypatch):
    """The table named a preset the interrupt kept from starting ('fuzz chunked  not run: interrupted before it
    started'), but the JUnit had no case for it: a dashboard counted one preset where the job was to fuzz two.
    Each has a skipped case 'PRESET: not run', in the table's words."""
    import xml.etree.ElementTree as ET

    from kvaudit.search import campaign

    monkeypatch.setattr(campaign, "run_campaign", lambda *a, **k: campaign.CampaignResult(interrupted=True))
    r = invoke("ci", "--max-time", "10", "--presets", "default,chunked,retract", "--regressions", str(tmp_path),
               "--out", str(tmp_path / "out"), "--junit", str(tmp_path / "ci.xml"))
    assert r.exit_code == 130, r.output
    cases = {c.get("name"): c for c in ET.parse(tmp_path / "ci.xml").getroot().iter("testcase")}
    assert list(cases) == ["default: interrupted", "chunked: not run", "retract: not run", "interrupted"]
    for name in ("chunked", "retract"):
        case = cases[f"{name}: not run"]
        assert case.get("classname") == f"kvaudit.fuzz.{name}"
        assert [(c.tag, c.get("message")) for c in case] == [("skipped", "not run: interrupted before it started")]


def test_ci_interrupted_in_a_clean_fuzz_has_no_passing_case_and_its_html_and_json_say_interrupted(tmp_path,
                                                                                                 monkeypatch):
    """Tester 61b: an interrupted ci wrote a passing 'default: no new findings' JUnit case beside the skipped
    'interrupted' one, a verdict line 'passed: ... (interrupted)', an HTML page that said 'clean' and 'No findings.', and a --json with no 'interrupted'."""
    from kvaudit.search import campaign

    monkeypatch.setattr(campaign, "run_campaign", lambda *a, **k: campaign.CampaignResult(interrupted=True))
    empty = tmp_path / "regs"
    empty.mkdir()
    r = invoke("ci", "--max-time", "10", "--presets", "default,chunked", "--regressions", str(empty),
               "--out", str(tmp_path / "out"), "--junit", str(tmp_path / "ci.xml"), "--html", str(tmp_path / "ci.html"),
               "--json", str(tmp_path / "ci.json"))
    assert r.exit_code == 130, r.output
    assert r.stdout.strip().splitlines()[-1] == "INTERRUPTED: 0/0 regressions ok, 0 new finding(s)", r.stdout
    import xml.etree.ElementTree as ET

    cases = list(ET.parse(tmp_path / "ci.xml").getroot().iter("testcase"))
    assert [c.get("name") for c in cases] == ["default: interrupted", "chunked: not run", "interrupted"]
    assert all(c.find("skipped") is not None for c in cases), (tmp_path / "ci.xml").read_text()
    assert "no new findings" not in (tmp_path / "ci.xml").read_text()
    page = (tmp_path / "ci.html").read_text()
    assert "Interrupted: no findings in the part that ran." in page and "No findings." not in page
    assert ", clean</title>" not in page and ", interrupted</title>" in page
    assert json.loads((tmp_path / "ci.json").read_text())["interrupted"] is True


# -- Ctrl-C typed on a terminal ------------------------------------------------------------------------

HOLD_IMPORTS = '''
import sys
import time

import kvaudit.entry as e


def held(*a, **k):  # inside the entry point's guard, after the engine's imports
    print("TEST-HOLD: imports held", file=sys.stderr, flush=True)
    while True:
        time.sleep(3600)


e.one_torch_thread = held
'''


def ctrl_c_on_a_terminal(tmp_path, args, hold: str, text) -> tuple[int, str]:
    """Run the console script on a pseudo-terminal (its controlling terminal, as in a shell); once ``text`` (a
    string, or a compiled pattern) is shown, type Ctrl-C there: the terminal echoes ``^C`` and sends SIGINT. (exit code, everything shown)."""
    import pty
    import select

    hold_dir = tmp_path / "hold"
    hold_dir.mkdir()
    (hold_dir / "sitecustomize.py").write_text(hold)
    env = plain_env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(hold_dir), env.get("PYTHONPATH")) if p)
    script = kvaudit_script()
    pid, fd = pty.fork()
    if pid == 0:  # (the child only execs)
        os.execve(script, [script, *args], env)
    shown, typed, deadline = b"", False, time.monotonic() + LIMIT_S
    try:
        while time.monotonic() < deadline:  # a limit, not a sleep: select returns as soon as output comes
            if select.select([fd], [], [], 1)[0]:
                try:
                    chunk = os.read(fd, 65536)
                except OSError:  # EIO: the child is gone and the terminal closed
                    break
                if not chunk:
                    break
                shown += chunk
            if not typed and (text.search(shown.decode(errors="replace")) if isinstance(text, re.Pattern)
                              else text.encode() in shown):
                os.write(fd, b"\x03")
                typed = True
    finally:
        if time.monotonic() >= deadline:
            os.kill(pid, signal.SIGKILL)
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        os.close(fd)
    assert typed, shown.decode(errors="replace")[-2000:]
    return code, shown.decode(errors="replace")


@pytest.mark.parametrize("args, hold, text", [
    (["replay", os.path.join(REGRESSIONS, f"{BUG}.json")], HOLD_IMPORTS, "TEST-HOLD: imports held"),
    (["replay", os.path.join(REGRESSIONS, f"{BUG}.json"), "--check-determinism"], REPLAY_HELD, "TEST-HOLD: replay"),
    (["fuzz", "--max-time", "60", "--out", "OUT"], HOLD_START_UP, "TEST-HOLD: start-up held"),
], ids=["entry-guard", "replay", "fuzz"])
def test_ctrl_c_on_a_terminal_leaves_its_echoed_caret_c_on_a_line_of_its_own(tmp_path, args, hold, text):
    """The terminal echoes ``^C`` with no newline: stop 62 showed ``^Ckvaudit: interrupted`` (tester 63). Each
    handler kvaudit installs (the entry point's guard, Ctrl-C's after start-up, the commands' own) ends that line."""
    args = [str(tmp_path / "out") if a == "OUT" else a for a in args]
    code, shown = ctrl_c_on_a_terminal(tmp_path, args, hold, text)
    assert code == 130, shown[-2000:]
    assert "^C\r\n" in shown and "kvaudit: interrupted\r\n" in shown, repr(shown[-500:])
    assert "\r\nkvaudit: interrupted\r\n" in shown and "Traceback" not in shown, repr(shown[-500:])


def _screen(shown: str) -> list[str]:
    """The lines a terminal shows after ``shown`` (what rich's live display writes: CR, LF, cursor up, erase
    line; other escape codes dropped)."""
    lines, row, col = [""], 0, 0
    for m in re.finditer(r"\x1b\[[0-9;?]*[A-Za-z]|\r|\n|[^\x1b\r\n]", shown):
        t = m.group()
        if t == "\r":
            col = 0
        elif t == "\n":
            row += 1
            lines += [""] * (row + 1 - len(lines))
        elif t.endswith("A") and t.startswith("\x1b["):
            row = max(0, row - int(t[2:-1] or 1))
        elif t == "\x1b[2K":
            lines[row] = ""
        elif not t.startswith("\x1b"):
            lines[row] = lines[row].ljust(col)[:col] + t + lines[row][col + 1:]
            col += 1
    return [line.rstrip() for line in lines]


def test_ctrl_c_under_fuzz_s_live_status_leaves_no_stale_status_line(tmp_path):
    """tm63: ending the echoed ^C's line moved the cursor one line below fuzz's live status, whose next redraw
    and removal then started a line low: its first line ('kvaudit fuzz: fuzzing ━━━ 6.1s/30s') stayed on the
    screen above the run's last lines. The live display's redraw clears the ^C's line itself."""
    code, shown = ctrl_c_on_a_terminal(tmp_path, ["fuzz", "--max-time", "60", "--out", str(tmp_path / "out")],
                                       "", re.compile(r"[1-9]\.\ds/1m00s"))  # (searching a second or more)
    assert code == 130, shown[-2000:]
    screen = [line for line in _screen(shown) if line]
    assert not any("kvaudit fuzz: fuzzing" in line for line in screen), "\n".join(screen)
    assert screen[-1] == "SUMMARY: kvaudit: no findings (interrupted).", "\n".join(screen)
