"""Start-up and exit of the ``kvaudit`` command (issue 17, item 8): `--help` imports neither torch
nor Hypothesis nor rich, `fuzz --max-time` counts from the process start, and a finished command
does not wait for torch's teardown. Asserts on what is imported and run, never on timings."""

import os
import re
import subprocess
import sys
import time

import pytest
from cli_helpers import invoke

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


def test_the_budget_counts_from_the_process_start(monkeypatch):
    from kvaudit.app.fuzz import budget_left

    monkeypatch.setattr(entry, "STARTED", None)
    assert budget_left(10.0) == 10.0  # in-process (no console script): the whole budget
    monkeypatch.setattr(entry, "STARTED", time.monotonic() - 3.0)
    assert 6.0 < budget_left(10.0) <= 7.0
    assert budget_left(2.0) == 0.0  # start-up spent it all


def test_fuzz_searches_only_what_start_up_left_of_the_budget(monkeypatch, tmp_path):
    """A process that took 100 s to start has nothing left of --max-time 5: no program runs."""
    monkeypatch.setattr(entry, "STARTED", time.monotonic() - 100.0)
    result = invoke("fuzz", "--fuzzer", "random", "--max-time", "5", "--out", str(tmp_path))
    assert result.exit_code == 0, result.output
    assert "no findings: 0 executions" in result.stdout


def test_entry_point_sets_the_start_time_before_importing_the_cli():
    r = _python("-c", "import sys, time\nsys.argv = ['kvaudit', '--version']\nimport kvaudit.entry as e\n"
                      "t = time.monotonic()\ntry:\n    e.main()\nexcept SystemExit:\n    pass\n"
                      "print(e.STARTED is not None and e.STARTED >= t)")
    assert r.stdout.strip().splitlines()[-1] == "True", r.stdout + r.stderr


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


def test_a_command_that_imported_no_torch_exits_normally():
    code = ("import sys\n"
            "class Teardown:\n    def __del__(self):\n        print('module teardown ran', flush=True)\n"
            "sys.modules['__main__'].keep = Teardown()\n"
            "sys.argv = ['kvaudit', 'presets']\nfrom kvaudit.entry import main\nmain()\n")
    r = _python("-c", code)
    assert r.returncode == 0 and "module teardown ran" in r.stdout, r.stdout[-500:] + r.stderr[-500:]
