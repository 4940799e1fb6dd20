"""kvaudit's pytest plugin (``pytest11`` entry point ``kvaudit``): the ``kvaudit`` fixture is
:mod:`kvaudit.testing` with every fuzz's ``max_time`` scaled by ``--kvaudit-time``; a
:class:`kvaudit.testing.KvauditFailure` shows as its plain report, its first finding's summary in the short
test summary. Imports nothing heavy."""

from __future__ import annotations

import argparse
import math

import pytest

from kvaudit import testing  # light: it imports the search and the engine when called


def _scale(text: str) -> float:
    """``--kvaudit-time``: a finite number > 0 (0, a negative or nan left every fuzz no budget: a leaking
    engine's test passed, having searched nothing); else pytest's usage error, exit 4."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def pytest_addoption(parser):
    parser.addoption("--kvaudit-time", type=_scale, default=1.0, metavar="SCALE",
                     help="kvaudit: multiply every fuzz's max_time by SCALE, a number > 0 (nightly runs give more).")


class _Kvaudit:
    replay, corpus = staticmethod(testing.replay), staticmethod(testing.corpus)

    def __init__(self, scale: float):
        self.scale = scale

    def fuzz(self, config, max_time: float = 5.0, **kw):
        return testing.fuzz(config, max_time=max_time * self.scale, **kw)


@pytest.fixture
def kvaudit(request):
    """Fuzz, replay or walk a corpus from a test (see :mod:`kvaudit.testing`)."""
    return _Kvaudit(request.config.getoption("--kvaudit-time"))


class _Crash:
    def __init__(self, message: str):
        self.message = message


class _Plain:
    """A :class:`kvaudit.testing.KvauditFailure`'s report as pytest shows it: the plain report (the failure's
    section, JUnit's text) and one line (``reprcrash.message``: the short test summary, JUnit's message)."""

    def __init__(self, failure: testing.KvauditFailure):
        self.text, self.reprcrash = str(failure), _Crash(failure.summary)

    def toterminal(self, out) -> None:
        out.line(self.text)

    def __str__(self) -> str:
        return self.text


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    # NOTE: here, not in pytest_exception_interact: that runs after the report is logged (JUnit, xdist, the
    # short summary's line had the traceback, or on CI the whole report again)
    outcome = yield
    report = outcome.get_result()
    if report.failed and call.excinfo is not None and isinstance(call.excinfo.value, testing.KvauditFailure):
        report.longrepr = _Plain(call.excinfo.value)
