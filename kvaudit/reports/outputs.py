"""Report files: ``--html``, ``--sarif``, ``--junit`` and ``--json``, shared by ``kvaudit fuzz``,
``replay`` and ``report``; every renderer draws from the same :class:`ReportData`, and each file is
written atomically. Design notes: docs/internals/reports.md.
"""

from __future__ import annotations

import errno
import json
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvaudit.config import TargetConfig
from kvaudit import replay
from kvaudit.audit.findings import Finding, report_order
from kvaudit.program import Op
from kvaudit.reports.ci_outputs import INTERRUPTED, invocation, reach_lines

NOTHING_SEARCHED = "nothing searched: the search budget ended before the first program ran"

FORMATS = ("html", "sarif", "junit", "json")


def disk_full(error: OSError) -> bool:
    """True for the errors of a full disk or an exhausted quota (ENOSPC, EDQUOT)."""
    return error.errno in (errno.ENOSPC, errno.EDQUOT)


class WriteError(OSError):
    """A report file could not be written: ``filename`` is its path, ``also`` the other files that failed after
    it, ``written`` the files written, which are kept (a failed one leaves no part behind)."""

    def __init__(self, error: OSError, path: str, written: list[str], also: list[str] | tuple = ()):
        super().__init__(error.errno, error.strerror or str(error), path)
        self.written, self.also = written, tuple(also)


@dataclass
class Outputs:
    """The report files asked for (None: not wanted)."""

    html: str | None = None
    sarif: str | None = None
    junit: str | None = None
    json: str | None = None

    def wanted(self) -> bool:
        return any(getattr(self, f) for f in FORMATS)


@dataclass
class Case:
    """One program and the findings it yields, with its occupancy timeline (None: not recorded)."""

    program: list[Op]
    findings: list[Finding]
    timeline: dict | None = None
    program_title: str = "minimized program"
    doc_extra: dict = field(default_factory=dict)  # replay-file keys kept in the JSON (seed, ...)
    config: TargetConfig | None = None  # when it differs from the report's (kvaudit ci: one per preset)


@dataclass
class ReportData:
    """What every renderer draws from: one engine config and its cases (a campaign's: one per signature)."""

    config: TargetConfig
    cases: list[Case]
    suppressed: dict[str, int]  # distinct suppressed signatures per kind
    extra: dict  # run facts (seed, executions, ...), shown in the HTML header and kept in the JSON
    suppressions: object | None = None  # a live SuppressionSet, for the HTML's rules table
    ran: tuple = ()  # every config the job ran (kvaudit ci: one per preset), for the HTML's header; (): ``config``
    # a campaign's SARIF (as kvaudit ci's): the known findings still open, results beside the new ones, each
    # result's baselineState "unchanged" for a signature in ``known``, else "new"; None: no baseline (not a campaign)
    known_open: list[Finding] | None = None
    known: frozenset[str] = frozenset()

    @classmethod
    def single(cls, config: TargetConfig, program: list[Op], findings: list[Finding], suppressed: dict[str, int],
               extra: dict, timeline: dict | None = None, program_title: str = "minimized program",
               suppressions=None) -> "ReportData":
        return cls(config, [Case(program, findings, timeline, program_title)], suppressed, extra, suppressions)

    @property
    def recorded(self) -> dict[str, str]:
        """A signature -> the engine release its finding was recorded on (a case's ``engine_version``; the
        first case naming the signature wins, as in every renderer's one section per signature)."""
        return {f.signature: c.doc_extra["engine_version"] for c in reversed(self.cases)
                if c.doc_extra.get("engine_version") for f in c.findings}

    @property
    def findings(self) -> list[Finding]:
        """Every case's findings, each case's in :func:`~kvaudit.audit.findings.report_order` (the JSON file
        keeps the case's own order: see :meth:`doc`)."""
        return [f for c in self.cases for f in report_order(c.findings)]

    def doc(self) -> dict:
        """The JSON file: one case's replay file (with ``timeline``, ``suppressed`` and the run facts), or
        a ``kvaudit.report/1`` document whose ``cases`` are such replay files."""
        docs = [replay.to_doc(c.config or self.config, c.program, c.findings, **c.doc_extra,
                              **({"timeline": c.timeline} if c.timeline is not None else {})) for c in self.cases]
        top = {**self.extra, "suppressed": self.suppressed}
        if len(docs) == 1:
            return {**docs[0], **top}
        from kvaudit.targets import config_to_dict
        return {"format": replay.REPORT_FORMAT, "config": config_to_dict(self.config), "cases": docs, **top}


def search_facts(facts: Mapping) -> dict:
    """Of a run's facts or a replay document, those that say which search ran (``fuzzer``, ``seed``: ``--seed``;
    SARIF's run properties, JUnit's), in that order; ``{}`` when it names none."""
    return {k: facts[k] for k in ("fuzzer", "seed") if k in facts}


def _sarif(data: ReportData) -> str:
    from kvaudit.reports.sarif import to_sarif

    unique: dict[str, Finding] = {}  # NOTE: one result per signature: code scanning tracks alerts by it
    for f in data.findings + (data.known_open or []):
        unique.setdefault(f.signature, f)
    baseline = None if data.known_open is None else {s: "unchanged" if s in data.known else "new" for s in unique}
    log = to_sarif(list(unique.values()), data.config, baseline, recorded=data.recorded)
    names = _preset_names(data)
    if names != [data.config.preset]:  # a job over several presets (ci's --json read again): none stands for it
        props = log["runs"][0].setdefault("properties", {})
        for key in ("preset", "engineConfig", "bugs", "model", "page_size"):  # (the first preset's)
            props.pop(key, None)
        props["presets"] = names
    search = search_facts(data.extra)
    if search:  # which search ran: the fuzzer's name and its --seed (the engine config's seed is engineConfig's)
        log["runs"][0].setdefault("properties", {})["search"] = search
    if data.extra.get("reached"):  # what the programs reached (Target.reach() summed): a clean run's scope
        log["runs"][0].setdefault("properties", {})["reached"] = data.extra["reached"]
    short = not_all_checked(data)
    if short is not None:  # its results are what ran before the stop: not a clean run's verdict
        log["runs"][0]["invocations"] = [invocation(short[1])]
    return json.dumps(log, indent=2) + "\n"


def _junit(data: ReportData) -> str:
    from kvaudit.reports.junit import to_junit

    names = _preset_names(data)
    return to_junit(data.findings, data.config, clean_case=f"kvaudit {_presets(data, names)}: no findings",
                    recorded=data.recorded, seconds=data.extra.get("seconds", 0.0),
                    found_after=data.extra.get("first_hit_seconds"), search=search_facts(data.extra),
                    skipped=not_all_checked(data), notes=reach_notes(data),
                    presets=None if names == [data.config.preset] else names,
                    failed=data.extra.get("regressions_failed"))


def _preset_names(data: ReportData) -> list[str]:
    """The presets a job ran, in run order: ``ran``'s; else (``kvaudit ci``'s ``--json`` read again by ``kvaudit
    report``) those its ``reached`` counts or its cases with findings name; else, but for a ``ci`` job (which then replayed its
    regressions only: none), ``config``'s."""
    names = list(dict.fromkeys(c.preset for c in data.ran)) or list(dict.fromkeys(
        [p for p, _ in _reached(data) if p] + [c.config.preset for c in data.cases if c.config is not None and c.findings]))
    return names or ([] if data.extra.get("job") == "kvaudit ci" else [data.config.preset])


def _presets(data: ReportData, names: list[str]) -> str:
    """The presets a clean JUnit case names (:func:`_preset_names`), as the HTML's header does; ``ci`` for a ``ci``
    job that fuzzed none."""
    return ", ".join(names) or "ci"


def _reached(data: ReportData) -> list[tuple[str, list[str]]]:
    """``(preset, reached: lines)`` (:func:`~kvaudit.reports.ci_outputs.reach_lines`) of the run's counts: a fuzz
    run's or a campaign's (``extra["reached"]``: path -> count; preset ``""``), or ``kvaudit ci``'s, one per preset
    (preset -> path -> count)."""
    reached = data.extra.get("reached") or {}
    searched = bool(data.extra.get("executions"))
    if all(isinstance(v, Mapping) for v in reached.values()):
        return [(preset, reach_lines(r, searched)) for preset, r in reached.items()]
    return [("", reach_lines(reached, searched))]


def reach_notes(data: ReportData) -> list[str]:
    """JUnit's ``<system-out>`` lines of the clean case (and ``kvaudit report``'s console beside a clean run):
    :func:`_reached`'s, each ci preset's named first."""
    return [f"{preset}: {line}" if preset else line for preset, lines in _reached(data) for line in lines]


def _reach_html(data: ReportData) -> str:
    """The HTML header's ``reached`` fact: ``name=count, ...; not reached: ...``, ci's presets apart (`` / ``)."""
    return " / ".join((f"{preset}: " if preset else "") + "; ".join(lines).removeprefix("reached: ")
                      for preset, lines in _reached(data) if lines)


def not_all_checked(data: ReportData) -> tuple[str, str] | None:
    """``(name, message)`` of a run that did not check all it was asked to (a search Ctrl-C or SIGTERM cut short,
    or whose budget ended before its first program), for its JUnit's skipped case and SARIF's invocation."""
    if data.extra.get("interrupted"):
        ran = f" after {data.extra['executions']} executions" if "executions" in data.extra else ""
        return "interrupted", INTERRUPTED.replace(":", f"{ran}:", 1)
    if data.extra.get("executions") == 0 and not data.findings and "replayed" not in data.extra:
        return "nothing searched", NOTHING_SEARCHED
    return None


def _html(data: ReportData) -> str:
    from kvaudit.reports.html_report import render_html

    return render_html(data.config, data.cases, suppressed=data.suppressed, suppressions=data.suppressions,
                       extra={k: ", ".join(v) if k == "nothing_searched" else _reach_html(data)
                              if k == "reached" else len(v) if k == "known" else v for k, v in data.extra.items()
                              if isinstance(v, (str, int, float))
                              or k in ("nothing_searched", "reached", "known")},  # (ci's presets; known: a count)
                       recorded=data.recorded, ran=data.ran)


_RENDER = {"json": lambda data: replay.doc_text(data.doc()), "sarif": _sarif, "junit": _junit, "html": _html}


def write(outputs: Outputs, data: ReportData) -> list[str]:
    """Write every file ``outputs`` names, in :data:`_RENDER`'s order, each it can (a full disk under one need
    not be under another); returns the paths written. Raises :class:`WriteError` (an OSError) naming the first
    file that failed (the others that failed in ``also``), with every file written in ``written``, which stay."""
    written: list[str] = []
    failed: list[tuple[OSError, str]] = []
    for fmt, render in _RENDER.items():
        path = getattr(outputs, fmt)
        if path:
            try:
                written.append(replay.write_text_atomic(path, render(data)))
            except OSError as e:
                failed.append((e, path))
    if failed:
        raise WriteError(*failed[0], written, also=[path for _, path in failed[1:]])
    return written
