"""Audit your own engine from a test (directly or through the ``kvaudit`` pytest fixture): a
time-boxed fuzz, a replay, or a regression corpus, the findings as plain text in the failure.
Example: docs/internals/app.md; writing the target: docs/writing-a-target.md."""

from __future__ import annotations

import contextlib
import glob
import os
import time
from dataclasses import dataclass, field

from kvaudit.config import json_value
from kvaudit.constants import DEFAULT_FUZZER, check_seconds, check_step_timeout


class KvauditFailure(AssertionError):
    """Findings in a test: the message lists each one as kvaudit's JUnit failure text does; ``summary``: one
    line (the first finding's summary, the pytest plugin's short test summary)."""

    def __init__(self, message: str, summary: str | None = None):
        super().__init__(message)
        self.summary = message.split("\n", 1)[0] if summary is None else summary


@dataclass
class Result:
    """What a fuzz or replay found. ``program``: the first failing program (minimized) or the replay's;
    ``original_length``: its ops before minimizing (0: not minimized); ``flaky``: signatures passed over."""

    findings: list = field(default_factory=list)
    program: list = field(default_factory=list)
    executions: int = 0
    config: object = None
    original_length: int = 0
    flaky: list = field(default_factory=list)

    @property
    def signatures(self) -> list[str]:
        return sorted({f.signature for f in self.findings})

    def render(self) -> str:
        from kvaudit.reports.junit import failure_text
        from kvaudit.program import format_program
        from kvaudit.reports.report import header

        title = (f"minimized program ({self.original_length} -> {len(self.program)} ops)"
                 if self.original_length else "program")
        out = [header(self.config) if self.config is not None else "kvaudit",
               f"{len(self.findings)} finding(s) after {self.executions} execution(s); {title}:",
               format_program(self.program)]
        for f in self.findings:
            out += ["", failure_text(f)]
        return "\n".join(out)

    def assert_clean(self) -> None:
        """Raises :class:`KvauditFailure` with :meth:`render` when anything was found, and when no program
        ran (a budget that ended first: nothing was checked, as ``kvaudit fuzz`` exits 5)."""
        if self.findings:
            from kvaudit.reports.sarif import current_summary

            more = len(self.findings) - 1
            raise KvauditFailure(self.render(), f"kvaudit: {current_summary(self.findings[0])}"
                                                + (f" (and {more} more finding(s))" if more else ""))
        if self.executions == 0:
            raise KvauditFailure("kvaudit: nothing searched: the budget ended before one program ran; give it more "
                                 "time (max_time, --kvaudit-time)")


def fuzz(config, max_time: float = 5.0, seed: int = 0, fuzzer: str = DEFAULT_FUZZER,
         step_timeout: float | None = None) -> Result:
    """Fuzz ``config``'s target for ``max_time`` seconds (minimizing comes after) and triage its first
    finding as ``kvaudit fuzz`` does; a flaky one is passed over. ``step_timeout``: the watchdog's limit on
    one engine step (seconds, at least ``WATCHDOG_IDLE_POLL``), for this call only; by default ``kvaudit
    fuzz``'s for ``max_time`` (:func:`kvaudit.audit.runner.fuzz_step_timeout`). Raises ``ValueError`` for an
    unknown or out-of-process fuzzer (atheris), a ``max_time`` that is not a finite number > 0, a ``step_timeout``
    below that least, and either past a year (``MAX_SECONDS``, as ``--max-time`` and ``--step-timeout``)."""
    from kvaudit.audit import runner
    from kvaudit.search import fuzzers

    try:
        check_seconds(max_time)  # (as --max-time)
    except ValueError as e:
        raise ValueError(f"max_time {e}") from None
    if step_timeout is not None:
        try:
            check_step_timeout(step_timeout)  # (as --step-timeout)
        except ValueError as e:
            raise ValueError(f"step_timeout {e}") from None
    valid = [n for n, k in fuzzers.kinds().items() if k.in_process]
    if fuzzer not in valid:
        raise ValueError(f"unknown fuzzer {json_value(fuzzer, 60)} (valid: {', '.join(valid)})")
    before = runner.step_timeout()  # (the process's: a later test's runs keep it)
    runner.set_step_timeout(runner.fuzz_step_timeout(max_time) if step_timeout is None else step_timeout)
    try:
        with _hypothesis_home_in_scratch():
            return _fuzz(config, max_time, seed, fuzzers.get(fuzzer))
    finally:
        runner.set_step_timeout(before)


@contextlib.contextmanager
def _hypothesis_home_in_scratch():
    """Hypothesis's files (the hypothesis fuzzer's constants cache) in a directory removed after, not in the
    test's working directory (as ``kvaudit fuzz`` puts them in its own); the caller's home put back."""
    from hypothesis import configuration

    from kvaudit.atomic import scratch_dir

    home = configuration.storage_directory(intent_to_write=False)
    home = getattr(home, "home_directory", home)  # (hypothesis < 6.155: the home itself, a Path)
    with scratch_dir("kvaudit-testing-") as scratch:
        configuration.set_hypothesis_home_dir(os.path.join(scratch, ".hypothesis"))
        try:
            yield
        finally:
            configuration.set_hypothesis_home_dir(home)


def _fuzz(config, max_time: float, seed: int, kind) -> Result:
    from kvaudit.search import fuzzers
    from kvaudit.search.fuzz import FuzzStats, retry_seed, triage

    stats, flaky = FuzzStats(), []
    kept: dict = {}  # what the fuzzer keeps (the corpus fuzzer's corpus): past a flaky finding, the search goes on from it
    deadline = time.monotonic() + max_time
    while not flaky or time.monotonic() < deadline:
        hit = kind.search(config, max(0.0, deadline - time.monotonic()), retry_seed(seed, len(flaky)), stats,
                          fuzzers.Search(known=frozenset(flaky), kept=kept))
        if hit is None:
            break
        program, findings = hit
        first = next(f for f in findings if f.signature not in flaky)
        crash = triage(config, program, first)
        if crash is not None:
            minimized = crash.original_length if crash.runs > 1 else 0  # a watchdog hang is not minimized
            return Result(crash.findings, crash.program, stats.executions, config, minimized, flaky)
        flaky.append(first.signature)
    return Result([], [], stats.executions, config, flaky=flaky)


def replay(path: str) -> Result:
    """Replay a replay file once. Raises :class:`kvaudit.replay.ReplayFormatError` for a malformed file."""
    from kvaudit import replay as replay_file
    from kvaudit.audit.runner import execute

    config, program, _, _ = replay_file.load(path)
    return Result(execute(config, program).findings, program, 1, config)


def corpus(directory: str) -> list[str]:
    """The replay files of a regression corpus directory, sorted (for ``pytest.mark.parametrize``)."""
    return sorted(glob.glob(os.path.join(directory, "*.json")))
