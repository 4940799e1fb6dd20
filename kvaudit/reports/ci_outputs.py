"""The parts of ``kvaudit ci``'s JUnit and SARIF that hold no finding, and both files whole (and the HTML
page) for a job stopped before it began. Standard library only (the entry point writes them while the rest is still
being imported). Design notes: docs/internals/reports.md."""

from __future__ import annotations

import html
import xml.etree.ElementTree as ET

import kvaudit

SARIF_SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"
SARIF_VERSION = "2.1.0"
INTERRUPTED = "interrupted (Ctrl-C or SIGTERM): the job stopped before it was done"
NOTHING_RAN = "interrupted (Ctrl-C or SIGTERM) during start-up: nothing was checked"


def reached_text(reached) -> str:
    """``name=count, ...`` of ``reached`` (``Target.reach()`` summed), sorted by name."""
    return ", ".join(f"{k}={v}" for k, v in sorted(reached.items()))


def not_reached(reached) -> list[str]:
    """The paths of ``reached`` (``Target.reach()`` summed) at 0, sorted: no program took them (not searched)."""
    return sorted(k for k, v in reached.items() if not v)


def reach_lines(reached, searched: bool = True) -> list[str]:
    """What a clean run's report files say beside it (the console's ``reached:`` lines): ``reached: name=count,
    ...`` and, where some path is at 0 and a program ran (``searched``), ``not reached: name, ... (not
    searched)``; ``[]`` where the target counts no path."""
    if not reached:
        return []
    zero = not_reached(reached)
    return [f"reached: {reached_text(reached)}"] + ([f"not reached: {', '.join(zero)} (not searched)"]
                                                   if zero and searched else [])


def suites() -> tuple[ET.Element, ET.Element, ET.Element]:
    """The JUnit root and its two empty suites, ``kvaudit.regressions`` and ``kvaudit.fuzz``."""
    root = ET.Element("testsuites", name="kvaudit ci")
    return root, ET.SubElement(root, "testsuite", name="kvaudit.regressions"), ET.SubElement(
        root, "testsuite", name="kvaudit.fuzz")


def add_skipped(suite: ET.Element, message: str = INTERRUPTED, name: str = "interrupted") -> None:
    """A skipped case ``name`` (``interrupted``, ``nothing searched``): what did not run is not a pass."""
    case = ET.SubElement(suite, "testcase", classname="kvaudit.fuzz", name=name, time="0")
    ET.SubElement(case, "skipped", message=message)


def document(root: ET.Element) -> str:
    """The JUnit text of ``root``, every suite's and the root's counts taken from the cases."""
    totals = [0, 0, 0]
    for suite in root.findall("testsuite"):
        cases = suite.findall("testcase")
        counts = [len(cases)] + [sum(1 for c in cases if c.find(tag) is not None) for tag in ("failure", "error")]
        for name, n in zip(("tests", "failures", "errors"), counts):
            suite.set(name, str(n))
        suite.set("skipped", str(sum(1 for c in cases if c.find("skipped") is not None)))
        totals = [t + n for t, n in zip(totals, counts)]
    for name, n in zip(("tests", "failures", "errors"), totals):
        root.set(name, str(n))
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def interrupted_junit(command: str = "ci") -> str:
    """The JUnit of a job stopped before it began: no regression case, the skipped ``interrupted`` case; for
    ``fuzz``, in fuzz's one suite ``kvaudit`` (as :func:`kvaudit.reports.junit.to_junit` writes it)."""
    if command == "fuzz":
        zero = {"tests": "0", "failures": "0", "errors": "0"}
        root = ET.Element("testsuites", name="kvaudit", **zero, time="0.00")
        fuzz = ET.SubElement(root, "testsuite", name="kvaudit", **zero, skipped="0", time="0.00")
    else:
        root, _, fuzz = suites()
    add_skipped(fuzz, NOTHING_RAN)
    return document(root)


def interrupted_html() -> str:
    """The ``--html`` of a job stopped before it began: a self-contained page that says nothing was checked
    (no program, findings or occupancy plot: nothing ran to draw)."""
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>kvaudit: interrupted</title>"
            f"</head>\n<body>\n<h1>kvaudit: interrupted</h1>\n<p>{html.escape(NOTHING_RAN)}.</p>\n"
            f"<p>kvaudit {html.escape(kvaudit.__version__)}</p>\n</body></html>\n")


def invocation(message: str) -> dict:
    """A SARIF ``invocation`` that did not complete, ``message`` its reason."""
    return {"executionSuccessful": False,
            "toolExecutionNotifications": [{"level": "warning", "message": {"text": message}}]}


def sarif_log(rules: list[dict], results: list[dict], **run) -> dict:
    """A SARIF log of one kvaudit run with ``rules`` and ``results`` (``run``: the run's other fields)."""
    driver = {"name": "kvaudit", "version": kvaudit.__version__, "semanticVersion": kvaudit.__version__,
              "rules": rules}
    return {"$schema": SARIF_SCHEMA, "version": SARIF_VERSION,
            "runs": [{"tool": {"driver": driver}, "results": results, **run}]}


def interrupted_sarif() -> dict:
    """The SARIF log of a job stopped before it began: no rules, no results, and the unsuccessful
    invocation that says nothing was checked (else it would read as a clean run's)."""
    return sarif_log([], [], invocations=[invocation(NOTHING_RAN)])
