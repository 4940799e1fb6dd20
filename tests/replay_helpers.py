"""Shared by the tests of the sparse schedule's localizing replay (kvaudit.audit.runner.AuditedRun._replay):
suppressions that cover every finding, and counters of what the replays build and apply."""

from __future__ import annotations

from kvaudit.audit.runner import AuditedRun


class CoverAll:
    """Suppressions that cover every finding (the interface the runner asks of a SuppressionSet)."""

    needs_full_stacks = False

    def sift(self, findings, suppressed):
        suppressed.extend(findings)
        return []


def count_replays(monkeypatch):
    """Counts, from now on: per-step engines built (``built[0]``), ops applied to them (``applied[0]``), and
    the program's length at each localization (``asked``). Returns ``(built, applied, asked)``, all lists."""
    built, applied, asked = [0], [0], []
    init, apply, localize = AuditedRun.__init__, AuditedRun.apply, AuditedRun._replay

    def counted_init(self, *a, **k):
        init(self, *a, **k)
        built[0] += self.check_every == 1

    def counted_apply(self, op):
        applied[0] += self.check_every == 1
        return apply(self, op)

    monkeypatch.setattr(AuditedRun, "__init__", counted_init)
    monkeypatch.setattr(AuditedRun, "apply", counted_apply)
    monkeypatch.setattr(AuditedRun, "_replay", lambda self: asked.append(len(self.program)) or localize(self))
    return built, applied, asked
