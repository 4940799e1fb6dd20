"""Audit your own engine from a test: a time-boxed fuzz, a replay, or a regression corpus, with the
findings rendered as plain text in the test failure.

Used directly or through the pytest plugin (:mod:`kvaudit.pytest_plugin`, the ``kvaudit`` fixture)::

    from kvaudit.testing import fuzz
    result = fuzz(config, max_time=5)      # config: any registered target kind's config
    result.assert_clean()                  # AssertionError with every finding, readable

See ``docs/writing-a-target.md`` for writing the target the config belongs to.
"""

from __future__ import annotations

import glob
import os
import time
from dataclasses import dataclass, field

from kvaudit.constants import DEFAULT_FUZZER


class KvauditFailure(AssertionError):
    """Findings in a test: the message lists each one as kvaudit's JUnit failure text does."""


@dataclass
class Result:
    """What a fuzz or replay found. ``program``: the ops of the first failing program (a fuzz stops at
    its first finding, minimized as ``kvaudit fuzz`` minimizes it) or of the replay; ``executions``:
    programs the search ran; ``original_length``: the failing program's ops before minimizing (0: not
    minimized); ``flaky``: signatures a fuzz met that did not replay 3 of 3 times (passed over)."""

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
        """Plain lines: the header, the program, then each finding with its sites."""
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
        """Raises :class:`KvauditFailure` with :meth:`render` when anything was found."""
        if self.findings:
            raise KvauditFailure(self.render())


def fuzz(config, max_time: float = 5.0, seed: int = 0, fuzzer: str = DEFAULT_FUZZER) -> Result:
    """Fuzz ``config``'s target for at most ``max_time`` seconds with ``fuzzer`` (``corpus``, the
    default of ``kvaudit fuzz`` too, ``hypothesis`` or ``random``) and triage its first finding as
    ``kvaudit fuzz`` does (:func:`kvaudit.search.fuzz.triage`): confirmed 3 of 3 times, minimized,
    re-run with full stacks for the report; one that does not replay is passed over (``flaky``) and
    the search goes on within the budget. Minimizing comes after the budget. Raises ``ValueError`` for
    an unknown fuzzer (atheris instruments the built-in engine in a process of its own: not here)."""
    from kvaudit.search import fuzzers
    from kvaudit.search.fuzz import FuzzStats, retry_seed, triage

    valid = [n for n, k in fuzzers.kinds().items() if k.in_process]
    if fuzzer not in valid:
        raise ValueError(f"unknown fuzzer {fuzzer!r} (valid: {', '.join(valid)})")
    kind = fuzzers.get(fuzzer)
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
    """Replay one replay file (``kvaudit replay``'s format) once, with full stacks. Raises
    :class:`kvaudit.replay.ReplayFormatError` for a malformed file."""
    from kvaudit import replay as replay_file
    from kvaudit.audit.runner import execute

    config, program, _, _ = replay_file.load(path)
    return Result(execute(config, program).findings, program, 1, config)


def corpus(directory: str) -> list[str]:
    """The replay files of a regression corpus directory, sorted (for ``pytest.mark.parametrize``)."""
    return sorted(glob.glob(os.path.join(directory, "*.json")))
