"""Helpers shared by the CLI tests (test_cli.py, test_suppress.py, test_report.py)."""

import os
import shutil
import sys

from click.testing import CliRunner

from kvaudit.cli import main


def invoke(*args, env=None):
    """Run ``kvaudit ARGS`` in-process; returns click's Result (stdout and stderr apart)."""
    return CliRunner().invoke(main, list(args), env=env)


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
