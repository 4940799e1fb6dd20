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
from dataclasses import dataclass, field


class KvauditFailure(AssertionError):
    """Findings in a test: the message lists each one as kvaudit's JUnit failure text does."""


@dataclass
class Result:
    """What a fuzz or replay found. ``program``: the ops of the first failing program (a fuzz stops at
    its first finding) or of the replay; ``executions``: programs run."""

    findings: list = field(default_factory=list)
    program: list = field(default_factory=list)
    executions: int = 0
    config: object = None

    @property
    def signatures(self) -> list[str]:
        return sorted({f.signature for f in self.findings})

    def render(self) -> str:
        """Plain lines: the header, the program, then each finding with its sites."""
        from kvaudit.reports.junit import failure_text
        from kvaudit.program import format_program
        from kvaudit.reports.report import header

        out = [header(self.config) if self.config is not None else "kvaudit",
               f"{len(self.findings)} finding(s) after {self.executions} execution(s); program:",
               format_program(self.program)]
        for f in self.findings:
            out += ["", failure_text(f)]
        return "\n".join(out)

    def assert_clean(self) -> None:
        """Raises :class:`KvauditFailure` with :meth:`render` when anything was found."""
        if self.findings:
            raise KvauditFailure(self.render())


def fuzz(config, max_time: float = 5.0, seed: int = 0, fuzzer: str = "random") -> Result:
    """Fuzz ``config``'s target for at most ``max_time`` seconds with ``fuzzer`` (``random``,
    ``hypothesis`` or ``corpus``); stops at the first finding, which is re-run with full stacks for the report.
    Raises ``ValueError`` for an unknown fuzzer."""
    from kvaudit.search.fuzz import FuzzStats, hypothesis_search, random_search
    from kvaudit.audit.runner import execute

    from kvaudit.search.corpus_fuzz import corpus_search

    searches = {"random": random_search, "hypothesis": hypothesis_search, "corpus": corpus_search}
    if fuzzer not in searches:
        raise ValueError(f"unknown fuzzer {fuzzer!r} (valid: {', '.join(searches)})")
    stats = FuzzStats()
    hit = searches[fuzzer](config, max_time, seed, stats)
    if hit is None:
        return Result([], [], stats.executions, config)
    program, _ = hit
    return Result(execute(config, program).findings, program, stats.executions, config)


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
