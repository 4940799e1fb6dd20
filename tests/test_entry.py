"""Start-up and exit of the ``kvaudit`` command (issue 17, item 8): `--help` imports neither torch
nor Hypothesis nor rich, `fuzz --max-time` is search time (start-up is paid before its clock starts,
issue 34), and a finished command does not wait for torch's teardown. Asserts on what is imported and run, never on timings."""

import json
import os
import re
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from kvaudit import entry

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REGRESSION = os.path.join(ROOT, "corpora", "regressions", "chunked-abort-ignored.json")
HEAVY = re.compile(r"^(torch|hypothesis|rich|numpy|scipy|matplotlib|engine_under_test\.(memory|scheduler|model))(\.|$)")


def _python(*args, **kw):
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
                          **kw)


@pytest.mark.parametrize("args", [["--help"], ["fuzz", "--help"], ["ci", "--help"], ["replay", "--help"],
                                  ["--version"]], ids=" ".join)
def test_help_imports_neither_torch_nor_hypothesis_nor_rich(args):
    r = _python("-X", "importtime", "-m", "kvaudit", *args)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip()
    imported = [m.group(1).strip() for m in re.finditer(r"^import time:\s+\d+ \|\s+\d+ \| (.+)$", r.stderr, re.M)]
    assert "kvaudit.cli" in imported  # the -X importtime lines are what this test reads
    heavy = sorted({name for name in imported if HEAVY.match(name)})
    assert not heavy, f"`kvaudit {' '.join(args)}` imports {heavy[:10]}"


@pytest.mark.parametrize("args", [["fuzz", "--max-tme", "3"], ["fuzz", "--max-time"], ["fuzz", "--max-time", "-1"],
                                  ["ci", "--bogus"], ["replay"], ["bench", "--budget", "x"],
                                  ["fuzz", "--target", "nope"]], ids=" ".join)
def test_bad_input_is_refused_before_the_engine_is_imported(args):
    """A mistyped flag on a command that runs the engine is a one-line usage error (exit 2) from click's
    parse, which the entry point asks for before it imports torch, Hypothesis and the engine (the mistyped
    ``fuzz --max-tme 3`` took 1.4 s, all of it imports)."""
    r = _python("-X", "importtime", "-m", "kvaudit", *args)
    assert r.returncode == 2, r.stderr[-2000:]
    errors = [line for line in r.stderr.splitlines() if not line.startswith("import time:")]
    assert len(errors) == 1 and errors[0].startswith("kvaudit: error: "), errors
    imported = [m.group(1).strip() for m in re.finditer(r"^import time:\s+\d+ \|\s+\d+ \| (.+)$", r.stderr, re.M)]
    assert "kvaudit.cli" in imported
    heavy = sorted({name for name in imported if HEAVY.match(name)})
    assert not heavy, f"`kvaudit {' '.join(args)}` imports {heavy[:10]}"


@pytest.mark.parametrize("args", [["fuzz", "--step-timeout", "2", "--max-time", "-1"],
                                  ["replay", "--step-timeout", "2"]], ids=" ".join)
def test_an_option_that_sets_process_state_is_checked_without_the_engine(args):
    """``--step-timeout``'s callback sets the runner's watchdog (which imports torch): while the entry
    point only checks the command line it checks the value and imports nothing (a bad value after it was
    refused from 1,196 modules in 2-7 s)."""
    r = _python("-X", "importtime", "-m", "kvaudit", *args)
    assert r.returncode == 2, r.stderr[-2000:]
    imported = [m.group(1).strip() for m in re.finditer(r"^import time:\s+\d+ \|\s+\d+ \| (.+)$", r.stderr, re.M)]
    assert "kvaudit.cli" in imported
    heavy = sorted({name for name in imported if HEAVY.match(name)})
    assert not heavy, f"`kvaudit {' '.join(args)}` imports {heavy[:10]}"


def test_a_good_command_line_parses_with_deprecations_as_errors():
    """Under ``-W error::DeprecationWarning`` the check read click's deprecated ``protected_args``, failed, and
    said no to every good command line: the entry point then skipped the engine's set-up (torch on one
    thread) and fuzzing ran 10-20x slower. What is not click's own refusal is a yes."""
    code = ("import warnings; warnings.simplefilter('error', DeprecationWarning)\n"
            "from kvaudit.cli import parses\n"
            "print(parses(['fuzz', '--max-time', '3']), parses(['fuzz', '--max-tme', '3']))\n")
    r = _python("-c", code)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["True", "False"], r.stdout


def test_a_good_command_line_parses():
    """The check the entry point makes says yes to what the command accepts (and runs none of it)."""
    from kvaudit.cli import parses

    assert parses(["fuzz", "--max-time", "3", "--fuzzer", "random"]) and parses(["replay", "x.json"])
    assert not parses(["fuzz", "--max-tme", "3"]) and not parses(["--version"]) and not parses(["nope"])


def test_start_up_is_not_part_of_the_search_budget(tmp_path):
    """A process that took 100 s to start still searches its whole --max-time (issue 34: --max-time 20
    on SGLang searched 1.3 s, or nothing under load); the run's first lines say what start-up took."""
    from kvaudit.cli import main

    result = CliRunner().invoke(main, ["fuzz", "--fuzzer", "random", "--max-time", "1", "--out", str(tmp_path)],
                                obj={"process_start": time.monotonic() - 100.0})
    assert result.exit_code == 0, result.output
    assert re.search(r"^start-up 1m4\ds \(imports, the first engine; not counted\): searching for 1\.0s$",
                     result.stderr, re.M), result.stderr
    m = re.search(r"^no findings: (\d+) executions, \d+ ops in ([\d.]+)s", result.stdout, re.M)
    assert m and int(m.group(1)) > 0 and float(m.group(2)) >= 1.0, result.stdout


def test_the_budget_starts_its_clock_after_start_up():
    from kvaudit.app.budget import Budget

    b = Budget.for_command(10.0, {"process_start": time.monotonic() - 3.0})
    assert 3.0 <= b.startup() < 4.0
    assert 9.5 < b.deadline() - time.monotonic() <= 10.0  # the whole budget, from now
    inproc = Budget.for_command(10.0, None)  # click's test runner: no process start handed down
    assert inproc.process_start is None and inproc.startup() < 1.0


def test_the_entry_point_hands_the_process_start_to_the_cli(monkeypatch):
    """One value passed down (click's obj), no process-wide global read by the commands."""
    seen = []
    import kvaudit.cli

    monkeypatch.setattr(kvaudit.cli, "main", lambda **kw: seen.append(kw) or sys.exit(0))
    monkeypatch.setattr(entry, "_exit", lambda e, **k: None)  # it would os._exit this test process
    monkeypatch.setattr(sys, "argv", ["kvaudit", "--version"])
    t = time.monotonic()
    with pytest.raises(SystemExit):
        entry.main()
    assert len(seen) == 1 and t <= seen[0]["obj"]["process_start"] <= time.monotonic()
    assert not hasattr(entry, "STARTED")


def test_a_signal_landing_as_soon_as_the_guard_is_installed_exits_130(monkeypatch, capsys):
    """The newcomer's README test run: test_ci_interrupted_during_its_imports sent SIGTERM the moment the
    guard's handler was in; it ran before the guard's ``try`` (while the second handler was installed), so the
    KeyboardInterrupt escaped with a traceback and the process died of SIGINT (-2), not 130."""
    import signal

    import kvaudit.cli

    real, saved = signal.signal, {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    fired = []

    def landing_at_once(sig, handler):
        old = real(sig, handler)
        if sig == signal.SIGTERM and callable(handler) and handler not in saved.values() and not fired:
            fired.append(sig)
            handler(sig, None)  # the signal, delivered right after its handler is in (once)
        return old

    monkeypatch.setattr(kvaudit.cli, "main", lambda **kw: sys.exit(0))
    monkeypatch.setattr(entry, "_exit", lambda e, **k: None)
    monkeypatch.setattr(sys, "argv", ["kvaudit", "--version"])
    monkeypatch.setattr(signal, "signal", landing_at_once)
    code = None
    try:
        entry.main()
    except SystemExit as e:
        code = e.code
    except KeyboardInterrupt:
        code = "KeyboardInterrupt escaped the guard"
    finally:
        for s, h in saved.items():
            real(s, h)
    assert code == 130 and capsys.readouterr().err == "kvaudit: interrupted\n", code


def test_a_finished_command_skips_teardown_but_runs_atexit_and_flushes():
    """After `replay` (torch imported), the process leaves by os._exit: objects alive at the end are
    not finalized (that teardown is what took seconds), atexit handlers still run, every line of
    the report reaches the pipe and the exit status is the command's (1: a finding)."""
    code = ("import atexit, sys\n"
            "class Teardown:\n    def __del__(self):\n        print('module teardown ran', flush=True)\n"
            "sys.modules['__main__'].keep = Teardown()\n"
            "atexit.register(lambda: print('atexit ran', flush=True))\n"
            f"sys.argv = ['kvaudit', 'replay', {REGRESSION!r}]\n"
            "from kvaudit.entry import main\nmain()\n")
    r = _python("-c", code)
    assert r.returncode == 1, r.stderr[-2000:]
    assert "atexit ran" in r.stdout
    assert "module teardown ran" not in r.stdout
    assert r.stdout.rstrip().splitlines()[-2].startswith("recorded signature(s) reproduced: yes"), r.stdout[-500:]


@pytest.mark.parametrize("command, signals", [("replay", 1), ("minimize", 1), ("replay", 2)])
def test_a_signal_after_the_command_is_done_leaves_with_its_code_and_no_traceback(tmp_path, command, signals):
    """Ctrl-C as a run ends (its reports written, the atexit handlers running: torch's among them) printed
    "Exception ignored in atexit callback" and a traceback ending in the entry point's handler (tester 63).
    The run's code is decided by then: one signal is let pass (the handlers go on: temporary directories), a
    second leaves at once. The atexit handler below signals its own process, which runs the handler before
    its next line."""
    code = ("import atexit, os, signal, sys\n"
            f"def late():\n    for _ in range({signals}):\n        os.kill(os.getpid(), signal.SIGINT)\n"
            "    print('the handlers went on', file=sys.stderr)\n"
            "atexit.register(late)\n"
            f"sys.argv = ['kvaudit', {command!r}, {REGRESSION!r}, *(['-o', {str(tmp_path / 'm.json')!r}] "
            f"if {command!r} == 'minimize' else [])]\n"
            "from kvaudit.entry import main\nmain()\n")
    r = _python("-c", code)
    assert r.returncode == (1 if command == "replay" else 0), r.stderr[-2000:]
    assert "Traceback" not in r.stderr and "Exception ignored" not in r.stderr, r.stderr[-2000:]
    assert ("the handlers went on" in r.stderr) is (signals == 1), r.stderr[-2000:]
    assert "SUMMARY: kvaudit: " in r.stdout, r.stdout[-500:]  # (flushed before the handlers)


@pytest.mark.parametrize("where", ["after-torch", "before-torch"])
def test_a_second_signal_while_a_start_up_interrupt_exits_keeps_its_code(tmp_path, where):
    """Ctrl-C twice, or SIGTERM twice, while a real engine loads: the first printed `kvaudit: interrupted`, then
    the interpreter's teardown of what was (half-)imported took the second with a traceback, or with the default
    action once Python had put it back (exit -2, -15: the signal matrix, tester 63). Now the start-up interrupt
    leaves as a finished command does (`_exit`), torch imported or not yet: the second signal ends it with 130.
    Below, start-up sends the first signal to its own process (at its last step, or in its first import) and an
    atexit handler two more (no sleep)."""
    (tmp_path / "ti63_cut_import.py").write_text("import os, signal\nos.kill(os.getpid(), signal.SIGTERM)\n")
    cut = ("def interrupted_here():\n    os.kill(os.getpid(), signal.SIGTERM)\n    print('not reached either')\n"
           "e.one_torch_thread = interrupted_here\n" if where == "after-torch" else
           f"sys.path.insert(0, {str(tmp_path)!r})\ne._HEAVY_MODULES = ('ti63_cut_import',)\n")
    code = ("import atexit, os, signal, sys\n"
            "import kvaudit.entry as e\n"
            "def late():\n    for _ in range(2):\n        os.kill(os.getpid(), signal.SIGTERM)\n"
            "    print('not reached', file=sys.stderr)\n"
            "atexit.register(late)\n" + cut +
            f"sys.argv = ['kvaudit', 'replay', {REGRESSION!r}]\n"
            "e.main()\n")
    r = _python("-c", code)
    assert r.returncode == 130, r.stderr[-2000:]
    assert r.stderr == "kvaudit: interrupted\n" and r.stdout == "", r.stderr[-2000:]


def test_a_signal_in_the_teardown_of_a_command_without_torch_is_no_kill():
    """`campaign status --watch` stopped by Ctrl-C twice died of the second (-2; SIGTERM: -15) in the signal
    matrix (tester 63): a command without torch exits normally, and Python's teardown puts the default action
    back for a signal with a handler. Now both are ignored there (the run's code is decided). Below, an atexit
    handler sends SIGINT to its own process, and an object torn down with the modules SIGTERM; each then prints."""
    code = ("import atexit, os, signal, sys\n"
            "class Teardown:\n    def __del__(self):\n        os.kill(os.getpid(), signal.SIGTERM)\n"
            "        print('teardown went on', flush=True)\n"
            "sys.modules['__main__'].keep = Teardown()\n"
            "def late():\n    os.kill(os.getpid(), signal.SIGINT)\n    print('the handlers went on', flush=True)\n"
            "atexit.register(late)\n"
            "sys.argv = ['kvaudit', 'presets']\nfrom kvaudit.entry import main\nmain()\n")
    r = _python("-c", code)
    assert r.returncode == 0, r.stdout[-500:] + r.stderr[-2000:]
    assert r.stderr == "", r.stderr[-2000:]
    assert "the handlers went on\nteardown went on" in r.stdout, r.stdout[-500:]


def test_a_command_that_imported_no_torch_exits_normally():
    code = ("import sys\n"
            "class Teardown:\n    def __del__(self):\n        print('module teardown ran', flush=True)\n"
            "sys.modules['__main__'].keep = Teardown()\n"
            "sys.argv = ['kvaudit', 'presets']\nfrom kvaudit.entry import main\nmain()\n")
    r = _python("-c", code)
    assert r.returncode == 0 and "module teardown ran" in r.stdout, r.stdout[-500:] + r.stderr[-500:]


def test_an_engine_command_runs_torch_on_one_thread_unless_the_user_chose(monkeypatch):
    """``fuzz --model tiny`` ran at 1.8 programs/s on torch's default two threads with the other core
    busy, 107 on one: the console script sets one thread for the commands that run an engine, and
    leaves a number the user gave in OMP_NUM_THREADS alone."""
    code = ("import sys, kvaudit.cli\n"
            "def fake(**kw):\n    import torch; print('threads', torch.get_num_threads()); sys.exit(0)\n"
            "kvaudit.cli.main, kvaudit.cli.parses = fake, lambda args: True\n"
            f"sys.argv = ['kvaudit', 'replay', {REGRESSION!r}]\n"
            "import torch; torch.set_num_threads(2)\n"
            "from kvaudit.entry import main\nmain()\n")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**env, "PYTHONPATH": ROOT}, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and "threads 1" in r.stdout, r.stdout + r.stderr[-2000:]
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**env, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "2"},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "threads 2" in r.stdout, r.stdout + r.stderr[-2000:]


def _closed_early(args, cwd):
    """Run ``kvaudit ARGS`` with its stdout a pipe whose reader has already left (``| head -0``; every write
    meets EPIPE, whatever the timing): ``(returncode, stderr)``."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    read, write = os.pipe()
    os.close(read)
    try:
        r = subprocess.run([sys.executable, "-m", "kvaudit", *args], cwd=cwd, env=env, stdout=write,
                           stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write)
    return r.returncode, r.stderr


@pytest.mark.parametrize("args", [["bugs"], ["presets"]], ids=" ".join)
def test_a_reader_that_leaves_early_changes_no_exit_code(args, tmp_path):
    """`kvaudit bugs | head -0`: exit 0 as documented, nothing on stderr (click's own handling of the broken
    pipe exited 1, silently)."""
    code, err = _closed_early(args, tmp_path)
    assert (code, err) == (0, ""), err[-1000:]


def test_a_reader_that_leaves_early_still_gets_the_reports_written(tmp_path):
    """`kvaudit replay F --junit j.xml | head -0`: the JUnit file is written and the exit status is the
    replay's (1: the finding reproduced); it was exit 1 with no file."""
    code, err = _closed_early(["replay", REGRESSION, "--junit", str(tmp_path / "j.xml")], tmp_path)
    assert code == 1 and "Traceback" not in err, err[-1000:]
    assert "<testsuite" in (tmp_path / "j.xml").read_text()


def _clean_replay(tmp_path) -> str:
    # REGRESSION's program with its bug switched off: a replay that exits 0
    doc = json.load(open(REGRESSION))
    doc["config"]["bugs"] = []
    doc.pop("findings", None)
    path = tmp_path / "clean.json"
    path.write_text(json.dumps(doc))
    return str(path)


@pytest.mark.parametrize("closed", ["stdout", "stderr"])
def test_a_closed_stdout_or_stderr_changes_no_exit_code(closed, tmp_path):
    """Tester 61a: `kvaudit replay clean.json >&-` exited 1 (the finding code) with `'NoneType' object has no
    attribute 'flush'` (Python sets a closed descriptor's stream to None); bad input exited 1, not 2."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    redirect = ">&- 2>/dev/null" if closed == "stdout" else "2>&- >/dev/null"

    def code(replay: str) -> int:
        # the shell closes the descriptor before Python starts, as `>&-` does (sys.stdout is then None)
        return subprocess.run(["sh", "-c", f'exec "$0" -m kvaudit replay "$1" {redirect}', sys.executable, replay],
                              cwd=tmp_path, env=env, timeout=120).returncode

    assert (code(_clean_replay(tmp_path)), code(str(tmp_path / "missing.json"))) == (0, 2)


@pytest.mark.parametrize("args", [["bugs"], ["report", REGRESSION]], ids=" ".join)
def test_stdout_on_a_full_disk_is_one_line_exit_74(args, tmp_path):
    """Tester 61a: `kvaudit report F > /dev/full` was `internal error: OSError: [Errno 28]`, exit 70; the docs
    say 74 for a full disk. The rest of the output is dropped, the reports asked for are written."""
    html = tmp_path / "r.html"
    with open("/dev/full", "w") as full:
        r = subprocess.run([sys.executable, "-m", "kvaudit", *args] + (["--html", str(html)] if args[0] == "report"
                                                                       else []),
                           cwd=tmp_path, env={**os.environ, "PYTHONPATH": ROOT}, stdout=full, stderr=subprocess.PIPE,
                           text=True, timeout=120)
    assert r.returncode == 74, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1] == (
        "kvaudit: disk full: cannot write <stdout> (No space left on device); the rest of its output was dropped")
    assert "Traceback" not in r.stderr and "internal error" not in r.stderr
    assert args[0] == "bugs" or "<html" in html.read_text()


@pytest.mark.parametrize("columns", ["abc", "80.5", "-3", "0"])
def test_a_columns_that_is_not_a_positive_number_is_ignored_off_a_terminal(columns, tmp_path):
    """Tester 61a: `COLUMNS=abc kvaudit bugs > file` was `internal error: ValueError`, exit 70."""
    r = subprocess.run([sys.executable, "-m", "kvaudit", "bugs"], cwd=tmp_path, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": ROOT, "COLUMNS": columns}, timeout=120)
    assert r.returncode == 0 and "bug zoo:" in r.stdout and not r.stderr, r.stderr[-2000:]


@pytest.mark.parametrize("command", ["fuzz", "ci"])
def test_a_negative_seed_is_refused(command):
    """Tester 61a: `--seed -1` searched exactly as `--seed 1` (Python's random takes the seed's absolute value)."""
    r = _python("-m", "kvaudit", command, "--seed", "-1", "--max-time", "0")
    assert r.returncode == 2 and "'--seed': -1 is not in the range x>=0" in r.stderr, r.stderr[-2000:]


@pytest.mark.parametrize("redirect, code", [
    (">/dev/full 2>&-", 74),  # tester 61c: the disk-full line met a closed stderr: exit 1
    ("2>/dev/full", 0),  # a full stderr: nothing can say so, the command's own code
    ("1</dev/null", 0),  # stdout opened read-only (EBADF): internal error 70 before
    ("2</dev/null >/dev/null", 0),
])
def test_odd_standard_streams_keep_the_exit_code_or_end_74_on_a_full_stdout(redirect, code, tmp_path):
    """Tester 61c's streams: each as a shell sets it up before Python starts."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    for args in (["presets", "--target", "eut"], ["replay", _clean_replay(tmp_path), "--json", str(tmp_path / "r.json")]):
        r = subprocess.run(["sh", "-c", f'exec "$0" -m kvaudit "$@" {redirect}', sys.executable, *args], cwd=tmp_path,
                           env=env, timeout=120, stdout=subprocess.DEVNULL if "1<" in redirect else None)
        assert r.returncode == code, (args, r.returncode)


@pytest.mark.parametrize("columns", ["\u00b2", "\u0663", "9" * 5000], ids=["superscript", "arabic", "5000-digits"])
def test_a_columns_of_non_ascii_digits_is_ignored(columns, tmp_path):
    """Tester 61c: `COLUMNS=²` was internal error 70 (rich reads it with int() after str.isdigit()). th64: so
    was a COLUMNS of 5,000 digits ('Exceeds the limit (4300 digits) for integer string conversion')."""
    for env_name in ("COLUMNS", "LINES"):
        r = subprocess.run([sys.executable, "-m", "kvaudit", "presets", "--target", "eut"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=120,
                           env={**os.environ, "PYTHONPATH": ROOT, env_name: columns})
        assert r.returncode == 0 and "presets:" in r.stdout and not r.stderr, r.stderr[-2000:]


@pytest.mark.parametrize("args, engine", [
    (["fuzz", "--out", "--help"], True),  # click reads --help as --out's directory: the job runs
    (["minimize", "f.json", "-o", "-h"], True),  # -o's value
    (["fuzz", "--help"], False), (["fuzz", "--out", "d", "-h"], False), (["replay", "--update", "--help"], False),
    (["ci", "--max-time=--help", "--help"], False),
], ids=lambda v: " ".join(v) if isinstance(v, list) else str(v))
def test_the_entry_point_reads_help_as_click_does(monkeypatch, args, engine):
    """ts64: the entry point took any ``-h``/``--help`` in the line for help, so ``fuzz --out --help`` (a job: click
    reads ``--help`` as --out's value) skipped the start-up guard and the parse check before the engine's
    imports. It reads the line as the start-up reports do (kvaudit.app.interrupts); the engine's set-up is seen
    through the parse check it asks for first (refused here, so nothing is imported)."""
    import kvaudit.cli

    checked = []
    monkeypatch.setattr(kvaudit.cli, "parses", lambda a: checked.append(list(a)) and False)
    monkeypatch.setattr(kvaudit.cli, "main", lambda **kw: sys.exit(0))
    monkeypatch.setattr(entry, "_exit", lambda e, **k: None)
    monkeypatch.setattr(sys, "argv", ["kvaudit", *args])
    with pytest.raises(SystemExit):
        entry.main()
    assert checked == ([args] if engine else [])


def test_the_entry_points_flags_are_the_commands_own():
    """The options that take no value, per command the entry point reads before click (kvaudit.app.interrupts
    ``_FLAGS``), are click's flags of that command, and every short option but -h takes one value."""
    import click

    from kvaudit.app.interrupts import _FLAGS
    from kvaudit.cli import main

    assert set(_FLAGS) == set(entry.HEAVY)
    for name in entry.HEAVY:
        params = [p for p in main.commands[name].params if isinstance(p, click.Option)]
        flags = {o for p in params if p.is_flag or p.count or p._flag_needs_value for o in p.opts + p.secondary_opts}
        assert flags == set(_FLAGS[name]), name
        assert all(len(o) > 2 or p.nargs == 1 for p in params for o in p.opts if not o.startswith("--")), name
