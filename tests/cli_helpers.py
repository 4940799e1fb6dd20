"""Helpers shared by the CLI tests (test_cli.py, test_suppress.py)."""

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
