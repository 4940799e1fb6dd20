"""Helpers shared by the CLI tests (test_cli.py, test_suppress.py, test_report.py, test_export*.py)."""

import contextlib
import json
import os
import shutil
import sys
import threading

from click.testing import CliRunner

from kvaudit.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def invoke(*args, env=None):
    """Run ``kvaudit ARGS`` in-process; returns click's Result (stdout and stderr apart)."""
    return CliRunner().invoke(main, list(args), env=env)


def export_edited(tmp_path, src: str, edit, name: str = "f.json") -> tuple[str, str]:
    """(client script, issue) of ``kvaudit export --no-resolve`` over the replay file ``src`` as ``edit(doc)``
    changed it, saved as ``tmp_path / name``; the export must exit 0."""
    with open(src) as f:
        doc = json.load(f)
    edit(doc)
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    r = invoke("export", str(path), "--issue", str(tmp_path / "i.md"), "--client", str(tmp_path / "c.py"),
               "--no-resolve")
    assert r.exit_code == 0, r.output
    return (tmp_path / "c.py").read_text(), (tmp_path / "i.md").read_text()


def export_all(files, under, out, root=ROOT):
    """Run ``kvaudit export FILE --issue --client`` in-process for each replay file, into the directory
    ``out`` (the exports are generated on demand: only one golden export per engine is committed, under
    tests/data/export/). Returns {name: base}: ``name`` is the file's path under ``under`` (its engine's
    corpus folder) less ``.json`` (``history/vllm-33377``), ``base + ".issue.md"`` / ``+ ".client.py"`` its export.
    The report names the file by its path in the checkout (``corpora/...``), as a user's command from the
    checkout's root writes it. Fails the test on an export that exits non-zero."""
    done = {}
    for path in files:
        name = os.path.relpath(path, under)[:-5]
        base = os.path.join(str(out), name)
        os.makedirs(os.path.dirname(base), exist_ok=True)
        r = invoke("export", path, "--issue", base + ".issue.md", "--client", base + ".client.py")
        assert r.exit_code == 0, (path, r.output)
        with open(base + ".issue.md") as f:
            issue = f.read()
        with open(base + ".issue.md", "w") as f:
            f.write(issue.replace(path, os.path.relpath(path, root)))
        done[name] = base
    return done


def reached(stdout: str) -> dict[str, int]:
    """The path counters of a clean run's ``reached: name=count, ...`` line (fails if it printed none)."""
    line = next((ln for ln in stdout.splitlines() if ln.startswith("reached: ")), None)
    assert line is not None, stdout
    return {k: int(v) for k, v in (kv.split("=") for kv in line[len("reached: "):].split(", "))}


def one_error_line(result):
    """The single stderr line of a failed command (fails if there are more, or a traceback)."""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.output
    assert lines[0].startswith("kvaudit: error: "), lines[0]
    return lines[0]


def kvaudit_script():
    """The installed ``kvaudit`` console script (for tests where the process boundary matters)."""
    path = shutil.which("kvaudit", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    assert path, "the kvaudit console script is not installed (pip install -e .[dev])"
    return path


def plain_env():
    """The environment of a user's shell with a colour terminal type, minus anything forcing colour."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("FORCE_COLOR", "CLICOLOR_FORCE", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "COLUMNS", "NO_COLOR")}
    env["TERM"] = "xterm-256color"
    return env


def cut_first_removal(monkeypatch) -> list:
    """``shutil.rmtree`` raising KeyboardInterrupt on its first call (a second Ctrl-C while a temporary
    directory is being removed), then removing as usual; returns the paths it was asked to remove."""
    import shutil

    real, removals = shutil.rmtree, []

    def cut_once(path, *a, **k):
        removals.append(path)
        if len(removals) == 1:
            raise KeyboardInterrupt
        return real(path, *a, **k)

    monkeypatch.setattr(shutil, "rmtree", cut_once)
    return removals


@contextlib.contextmanager
def freed_if_it_waits(fifo: str, after: float = 10.0):
    """Around code that must not open the FIFO ``fifo`` to read: still running ``after`` seconds on, a writer
    opens it (a reader waiting in open() goes on, and the test fails instead of hanging). Yields a list that
    holds 1 once that happened."""
    rescued, done = [], threading.Event()

    def rescue():
        if not done.wait(after):
            rescued.append(1)
            os.close(os.open(fifo, os.O_WRONLY))
    threading.Thread(target=rescue, daemon=True).start()
    try:
        yield rescued
    finally:
        done.set()


def hypothesis_home():
    """Hypothesis's home directory now (its ``storage_directory()``; before Hypothesis 6.155 that is the home
    itself, after it a path whose ``home_directory`` is)."""
    from hypothesis.configuration import storage_directory

    home = storage_directory(intent_to_write=False)
    return getattr(home, "home_directory", home)
