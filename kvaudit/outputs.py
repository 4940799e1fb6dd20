"""Report files: ``--html``, ``--sarif``, ``--junit`` and ``--json``, shared by ``kvaudit fuzz``,
``kvaudit replay`` and ``kvaudit report``.

Every renderer takes the same plain data (config, program, findings, the occupancy timeline and
suppression counts); each file is written atomically. The JSON file is a replay file with the
timeline added, so ``kvaudit report`` and ``kvaudit replay`` read it back.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable

from engine_under_test import EngineConfig
from kvaudit import replay
from kvaudit.findings import Finding
from kvaudit.program import Op

FORMATS = ("html", "sarif", "junit", "json")


@dataclass
class Outputs:
    """The report files asked for (None: not wanted)."""

    html: str | None = None
    sarif: str | None = None
    junit: str | None = None
    json: str | None = None

    def wanted(self) -> bool:
        return any(getattr(self, f) for f in FORMATS)

    def paths(self) -> list[str]:
        return [p for p in (getattr(self, f) for f in FORMATS) if p]


@dataclass
class ReportData:
    """What every renderer draws from. ``timeline`` is computed on demand (it replays ``program``)."""

    config: EngineConfig
    program: list[Op]
    findings: list[Finding]
    suppressed: dict[str, int]  # distinct suppressed signatures per kind
    extra: dict  # run facts kept in the JSON (seed, executions, confirmations, ...)
    timeline: dict | None = None
    program_title: str = "minimized program"
    suppressions: object | None = None  # a live SuppressionSet, for the HTML's rules table

    def ensure_timeline(self, note: Callable[[str], None] | None = None) -> dict | None:
        if self.timeline is None and self.program:
            from kvaudit import timeline

            if note:
                note(f"recording pool occupancy: replaying the {len(self.program)}-op program")
            self.timeline = timeline.record(self.config, self.program,
                                            suppressions=self.suppressions.fresh() if self.suppressions else None)
        return self.timeline

    def doc(self) -> dict:
        extra = dict(self.extra)
        extra["suppressed"] = self.suppressed
        if self.timeline is not None:
            extra["timeline"] = self.timeline
        return replay.to_doc(self.config, self.program, self.findings, **extra)


def write(outputs: Outputs, data: ReportData, note: Callable[[str], None] | None = None) -> list[str]:
    """Write every file ``outputs`` names; returns the paths written. Raises OSError."""
    written = []
    if outputs.html or outputs.json:
        data.ensure_timeline(note)
    if outputs.json:
        written.append(replay.write_atomic(outputs.json, data.doc()))
    if outputs.sarif:
        from kvaudit.sarif import to_sarif

        written.append(replay.write_text_atomic(outputs.sarif, json.dumps(to_sarif(data.findings, data.config),
                                                                            indent=2) + "\n"))
    if outputs.junit:
        from kvaudit.junit import to_junit

        clean = f"kvaudit {data.config.preset}: no findings"
        written.append(replay.write_text_atomic(outputs.junit, to_junit(data.findings, data.config,
                                                                         clean_case=clean)))
    if outputs.html:
        from kvaudit.html_report import render_html

        html = render_html(data.config, data.program, data.findings, data.timeline, suppressed=data.suppressed,
                           suppressions=data.suppressions, program_title=data.program_title,
                           extra={k: v for k, v in data.extra.items() if isinstance(v, (str, int, float))})
        written.append(replay.write_text_atomic(outputs.html, html))
    return written
