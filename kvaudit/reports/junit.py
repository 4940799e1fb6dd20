"""JUnit XML output (the "Ant JUnit" dialect CI dashboards read): one failing test case per distinct
finding signature, so the same bug keeps the same test name across runs.
Design notes: docs/internals/reports.md.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from typing import Mapping

from kvaudit.config import json_value
from kvaudit.audit.findings import Finding, Site
from kvaudit.audit.frames import RecordedEngine, resolve
from kvaudit.audit.kinds import lookup
from kvaudit.reports.ci_outputs import add_skipped, document
from kvaudit.reports.sarif import current_summary, engine_of, engine_verdict, finding_stacks, lifecycle

# NOTE: what XML 1.0 allows nowhere, even as a character reference
_ILLEGAL_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")


def xml_text(text: object) -> str:
    """``str(text)`` without the characters XML 1.0 cannot carry (ElementTree escapes the rest)."""
    return _ILLEGAL_XML.sub("", str(text))


def _frame(s: Site, depth: int, engine: RecordedEngine | None) -> str:
    fr = resolve(s, engine)  # the line's text, checked against the current source (unless another release's)
    return (f"    #{depth} {s.file}:{fr.line} in {s.function}" + (f"\n        {fr.source}" if fr.source else "")
            + (f"\n        ({fr.note})" if fr.note else ""))


def failure_text(f: Finding, count: int = 1, engine: RecordedEngine | None = None) -> str:
    """The body of a finding's ``<failure>``: summary, signature, units, every stack (innermost first),
    lifecycle and the engine's verdict. ``count``: how many findings share the signature; ``engine``: the
    engine its frames are of (:func:`~kvaudit.audit.frames.resolve`)."""
    lines = [current_summary(f, engine), f"signature: {f.signature}"]
    if count > 1:
        lines.append(f"found {count} times with this signature (details of the first)")
    lines.append(f"kind: {f.kind}, pool: {f.pool}")
    if f.op_index >= 0 or f.step >= 0:
        lines.append(f"detected after op #{f.op_index} at scheduler step {f.step}: {f.message}")
    else:
        lines.append(f"message: {f.message}")
    if f.slots:
        word, ids = f.listed()
        shown = ", ".join(map(str, ids[:64])) + (f", ... ({len(ids)} in all)" if len(ids) > 64 else "")
        lines.append(f"{word}: [{shown}] ({f.num_units} {f.unit}{'' if f.num_units == 1 else 's'})")
    lines.extend(lookup(f.kind).facts(f))  # (a leak: direct or indirect)
    for label, frames in finding_stacks(f):
        lines.append(f"{label}:")
        lines.extend(_frame(s, i, engine) for i, s in enumerate(frames))
    if f.owner_history:
        lines.append("lifecycle of the first unit:")
        lines.extend("    " + line for line in lifecycle(f))
    if f.engine_check:
        lines.append(engine_verdict(f))
    if f.memory_state:
        lines.append("memory at the crash:")
        lines.extend("    " + line for line in f.memory_state)
    if f.traceback:
        lines.append(f.traceback.rstrip())
    return "\n".join(lines) + "\n"


def to_junit(findings: list[Finding], config=None, suite_name: str = "kvaudit",
             clean_case: str | None = None, recorded: Mapping[str, str] | None = None, seconds: float = 0.0,
             found_after: float | None = None, search: Mapping | None = None,
             skipped: tuple[str, str] | None = None, notes: list[str] | tuple = (),
             presets: list[str] | None = None, failed: str | None = None) -> str:
    """JUnit XML text for ``findings``: one failing case per signature (classname ``kvaudit.<kind>``,
    name the signature); with none, a passing ``clean_case`` when named. ``failed``: a job's failure no finding
    holds (``kvaudit ci``'s regression files, its ``--json``'s ``regressions_failed``), a failing case ``regression
    files`` in place of the passing one. ``config``'s fields (a target
    kind's config) become the suite's ``<properties>`` (a string as it is, any other value as JSON spells
    it); ``recorded``: a signature -> the engine release its finding was recorded on
    (:func:`~kvaudit.reports.sarif.engine_of`). A case's ``time``: ``seconds`` (the run's), for a finding
    ``found_after`` (the seconds the search took to hit it) when known; the suite's, ``seconds``. ``search``:
    which search ran (``fuzzer``, ``seed``: ``--seed``), the first properties, named ``search_fuzzer`` and
    ``search_seed`` (the config's own ``seed`` is the engine's). ``skipped``: ``(name, message)`` of a skipped
    case for a run that did not check all it was asked to (``interrupted``: Ctrl-C or SIGTERM cut it short;
    ``nothing searched``: its budget ended before one program ran), which then has no passing ``clean_case``.
    ``notes``: the clean case's ``<system-out>`` lines (what the programs reached: a clean run's scope), or the
    skipped case's (what the programs that ran reached). ``presets``: the presets a job over several (``kvaudit
    ci``'s) ran, named in one ``presets`` property (comma-separated; empty for a ci job that fuzzed none) in place
    of ``config``'s fields, which are one preset's."""
    on = engine_of(config, recorded)
    groups: dict[str, list[Finding]] = {}
    for f in findings:
        groups.setdefault(f.signature, []).append(f)
    cases: list[ET.Element] = []
    for signature, group in groups.items():
        first = group[0]
        case = ET.Element("testcase", classname=xml_text(f"kvaudit.{first.kind}"), name=xml_text(signature),
                          time=f"{seconds if found_after is None else found_after:.2f}")
        failure = ET.SubElement(case, "failure", message=xml_text(current_summary(first, on(first))),
                                type=xml_text(first.kind))
        failure.text = xml_text(failure_text(first, len(group), on(first)))
        cases.append(case)
    if failed:
        case = ET.Element("testcase", classname="kvaudit.regressions", name="regression files", time="0")
        ET.SubElement(case, "failure", message=xml_text(f"FAILED: {failed}"), type="regression")
        cases.append(case)
    if skipped is None and not findings and not failed and clean_case:
        cases.append(ET.Element("testcase", classname="kvaudit", name=xml_text(clean_case), time=f"{seconds:.2f}"))
        if notes:
            ET.SubElement(cases[-1], "system-out").text = xml_text("\n".join(notes) + "\n")

    counts = dict.fromkeys(("tests", "failures", "errors"), "0")  # (placed here; document() counts the cases)
    root = ET.Element("testsuites", name=xml_text(suite_name), **counts, time=f"{seconds:.2f}")
    suite = ET.SubElement(root, "testsuite", name=xml_text(suite_name), **counts, skipped="0", time=f"{seconds:.2f}")
    if config is not None or search or presets is not None:
        props = ET.SubElement(suite, "properties")
        for key, v in (search or {}).items():
            ET.SubElement(props, "property", name=xml_text(f"search_{key}"), value=xml_text(str(v)))
    if presets is not None:
        ET.SubElement(props, "property", name="presets", value=xml_text(",".join(presets)))
    elif config is not None:
        d = config.to_dict()
        d["bugs"] = ",".join(sorted(d.get("bugs", [])))
        head = ("preset", "bugs", "model", "page_size")
        for key in [k for k in head if k in d] + sorted(k for k in d if k not in head):
            v = d[key]  # NOTE: a string as it is; any other value spelled as JSON (false, null, [1, 2])
            ET.SubElement(props, "property", name=xml_text(key), value=xml_text(v if isinstance(v, str) else
                                                                                json_value(v)))
    suite.extend(cases)
    if skipped is not None:  # what did not run is not a pass
        add_skipped(suite, skipped[1], name=skipped[0])
        if notes:  # what the programs that ran reached (after <skipped>: JUnit's schema orders a case's children)
            ET.SubElement(suite[-1], "system-out").text = xml_text("\n".join(notes) + "\n")
    return document(root)
