"""The rows of the history suite's catalogue (:mod:`kvaudit.history.catalogue`): a known public bug of an
engine's releases (:class:`HistoryBug`) and one the suite does not rediscover (:class:`Unreached`). Each
target kind keeps its engine's rows (``kvaudit/targets/<kind>/catalogue.py``) and hands them to the
suite through its registry entry (``TargetKind.history``); the suite names no engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class HistoryBug:
    """One known bug. ``buggy``: the last release with the bug (the suite searches there); ``fixed``: the
    first release without it (the minimized program must replay clean there), None for a bug still in
    the newest release (a rediscovery: searched, never replayed elsewhere). ``clean_because``: "fix" (the
    fixing PR is in ``fixed``) or "refactor" (the path is gone). ``preset`` and ``config``: the target's
    preset and its overrides. A finding is this bug when its kind is ``finding``, its ``check`` (a
    target invariant, signature suffix ``check:<name>``) matches when given, and ``signature`` (when
    given) is a substring of its signature (a rediscovery, with ``replay_file``: equal to it).
    ``replay_blocked``: why the fixing release cannot run the program on this kind of machine (the bug
    then counts as found, not rediscovered). ``reach``: how a real server gets there from client requests."""

    id: str
    engine: str
    title: str
    sources: tuple[str, ...]
    buggy: str
    fixed: str | None
    clean_because: str
    preset: str
    finding: str
    config: dict = field(default_factory=dict)
    check: str = ""
    signature: str = ""
    reach: str = ""

    replay_file: str = ""  # a rediscovery's config is its corpus file's (relative to the data root)
    replay_blocked: str = ""  # why the fixing release cannot run the program here (then it is not replayed)

    def matches(self, finding) -> bool:
        """Whether ``finding`` (:class:`kvaudit.audit.findings.Finding`) is this bug."""
        if self.replay_file:  # a rediscovery: exactly the recorded signature
            return finding.signature == self.signature
        return (finding.kind == self.finding and (not self.check or getattr(finding, "check", "") == self.check)
                and self.signature in finding.signature)


@dataclass(frozen=True)
class Unreached:
    """A known bug the suite does not rediscover, and why (path not driven, needs a GPU, ...)."""

    id: str
    engine: str
    sources: tuple[str, ...]
    releases: str
    reason: str
