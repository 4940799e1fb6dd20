"""kvaudit's pytest plugin (``pytest11`` entry point ``kvaudit``): the ``kvaudit`` fixture is
:mod:`kvaudit.testing` with every fuzz's ``max_time`` scaled by ``--kvaudit-time``; a
:class:`kvaudit.testing.KvauditFailure` shows as its plain report. Imports nothing heavy."""

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


def pytest_exception_interact(node, call, report):
    if call.excinfo is not None and isinstance(call.excinfo.value, testing.KvauditFailure):
        report.longrepr = str(call.excinfo.value)
