"""``kvaudit ci``: the nightly and per-PR job.

1. Every replay file in the regression corpus must still reproduce its recorded finding with its
   bug switches on, identically in each of 3 runs (the ledger digest and findings compared), and
   be clean with the switches off (the fix holds, and the program raises no false alarm).
2. A time-boxed fuzz of the clean engine over every preset (the budget split evenly), each
   finding confirmed and minimized; with a corpus directory the search resumes per preset and
   findings already there are known, not new.
3. JUnit (one suite for the regressions, one for the fuzz) and SARIF (the fuzz's findings).

The job fails (exit 1) on a regression that no longer reproduces, is not deterministic or is not
clean without its switch, on a regression file that cannot be read (a JUnit error; the job goes
on with the rest), and on any new finding.
"""

from __future__ import annotations

import glob
import os
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from typing import Callable

from engine_under_test import PRESETS, get_preset
from kvaudit import replay
from kvaudit.findings import Finding
from kvaudit.fuzz import CONFIRM_RUNS, FuzzStats
from kvaudit.junit import failure_text, xml_text
from kvaudit.runner import execute


@dataclass
class RegressionCheck:
    """One regression file: what it must show, and what it showed."""

    name: str
    path: str
    signature: str
    reproduced: bool = False
    deterministic: bool = False
    clean_without_switch: bool = False
    problem: str = ""
    seconds: float = 0.0
    malformed: bool = False  # not a readable replay file: ``problem`` says why

    @property
    def ok(self) -> bool:
        return self.reproduced and self.deterministic and self.clean_without_switch


@dataclass
class FuzzRun:
    preset: str
    seconds: float
    executions: int
    new: list[tuple[list, list[Finding], str]] = field(default_factory=list)  # (program, findings, replay file)
    known: list[str] = field(default_factory=list)
    interrupted: bool = False  # Ctrl-C or SIGTERM cut the campaign short (what it found is in ``new``)


@dataclass
class CiResult:
    regressions: list[RegressionCheck] = field(default_factory=list)
    fuzz: list[FuzzRun] = field(default_factory=list)
    interrupted: bool = False

    @property
    def failed(self) -> bool:
        return any(not r.ok for r in self.regressions) or any(run.new for run in self.fuzz)

    def new_findings(self) -> list[Finding]:
        return [f for run in self.fuzz for _, findings, _ in run.new for f in findings]


def check_regression(path: str, runs: int = CONFIRM_RUNS) -> RegressionCheck:
    """Replay ``path`` ``runs`` times with its switches on and once with them off. A file that is
    not a readable replay file is a failed check (``malformed``), not an exception."""
    t0 = time.monotonic()
    name = os.path.splitext(os.path.basename(path))[0]
    try:
        config, program, recorded, _ = replay.load(path)
    except replay.ReplayFormatError as e:
        return RegressionCheck(name, path, "", problem=f"malformed: {e}", malformed=True,
                               seconds=time.monotonic() - t0)
    check = RegressionCheck(name, path, recorded[0].signature if recorded else "")
    if not recorded:
        check.problem = "records no finding"
        return check
    execs = [execute(config, program, full_stacks=False) for _ in range(runs)]
    check.reproduced = check.signature in execs[0].signatures
    keys = {(ex.digest, tuple(ex.signatures), tuple(tuple(f.slots) for f in ex.findings)) for ex in execs}
    check.deterministic = len(keys) == 1
    off = execute(config.replace(bugs=frozenset()), program, full_stacks=False)
    check.clean_without_switch = not off.findings
    problems = []
    if not check.reproduced:
        problems.append(f"no longer reproduces {check.signature} (got: {', '.join(execs[0].signatures) or 'nothing'})")
    if not check.deterministic:
        problems.append(f"{len(keys)} different outcomes in {runs} runs")
    if not check.clean_without_switch:
        problems.append(f"not clean without {', '.join(sorted(config.bugs)) or 'its switches'}: "
                        f"{', '.join(off.signatures)}")
    check.problem = "; ".join(problems)
    check.seconds = time.monotonic() - t0
    return check


def regression_files(directory: str) -> list[str]:
    return sorted(glob.glob(os.path.join(directory, "*.json")))


def fuzz_preset(preset: str, budget: float, seed: int, fuzzer: str, corpus: str | None, out_dir: str,
                suppress_path: str | None = None, on_progress: Callable[[FuzzStats], None] | None = None) -> FuzzRun:
    """Fuzz the clean engine of ``preset`` for ``budget`` seconds as a campaign (it goes on past
    each finding). With ``corpus``, over ``corpus/<preset>``: resumable, findings already there are
    known, not new. Without, over a fresh temporary corpus; new findings' replay files are copied to
    ``out_dir``. An interrupted campaign (Ctrl-C, SIGTERM) returns what it found, ``interrupted`` set."""
    from kvaudit.campaign import run_campaign

    config = get_preset(preset).config()
    run = FuzzRun(preset, budget, 0)
    with tempfile.TemporaryDirectory(prefix=f"kvaudit-ci-{preset}-") as tmp:
        where = os.path.join(corpus, preset) if corpus is not None else tmp
        result = run_campaign(config, fuzzer, budget, seed, 1, where, suppress_path, on_progress=on_progress)
        run.executions = result.stats.executions
        run.known = sorted(result.known)
        for sig, path in sorted(result.new.items()):
            _, program, findings, doc = replay.load(path)
            if corpus is None:
                path = replay.write_atomic(os.path.join(out_dir, os.path.basename(path)), doc)
            run.new.append((program, findings, path))
    run.interrupted = result.interrupted
    return run


def junit(result: CiResult) -> str:
    """Two suites: ``kvaudit.regressions`` (a case per regression file) and ``kvaudit.fuzz`` (a
    passing case per clean preset, a failing case per new finding signature)."""
    root = ET.Element("testsuites", name="kvaudit ci")
    reg = ET.SubElement(root, "testsuite", name="kvaudit.regressions")
    for r in result.regressions:
        case = ET.SubElement(reg, "testcase", classname="kvaudit.regressions", name=xml_text(r.name),
                             time=f"{r.seconds:.2f}")
        if r.malformed:  # the case could not run: an error, not a failure
            ET.SubElement(case, "error", message=xml_text(r.problem), type="malformed").text = xml_text(
                f"{r.path}\n{r.problem}\n")
        elif not r.ok:
            fail = ET.SubElement(case, "failure", message=xml_text(r.problem), type="regression")
            fail.text = xml_text(f"{r.path}\nsignature: {r.signature}\n{r.problem}\n")
    fz = ET.SubElement(root, "testsuite", name="kvaudit.fuzz")
    for run in result.fuzz:
        if not run.new:
            ET.SubElement(fz, "testcase", classname=f"kvaudit.fuzz.{run.preset}", name=f"{run.preset}: no findings",
                          time=f"{run.seconds:.2f}")
        for program, findings, path in run.new:
            f = findings[0]
            case = ET.SubElement(fz, "testcase", classname=f"kvaudit.fuzz.{run.preset}", name=xml_text(f.signature),
                                 time="0")
            fail = ET.SubElement(case, "failure", message=xml_text(f.summary()), type=xml_text(f.kind))
            fail.text = xml_text(f"replay file: {path}\n" + failure_text(f))
    total_t = tot_f = tot_e = 0
    for suite in (reg, fz):
        cases = suite.findall("testcase")
        fails = sum(1 for c in cases if c.find("failure") is not None)
        errors = sum(1 for c in cases if c.find("error") is not None)
        suite.set("tests", str(len(cases)))
        suite.set("failures", str(fails))
        suite.set("errors", str(errors))
        suite.set("skipped", "0")
        total_t += len(cases)
        tot_f += fails
        tot_e += errors
    root.set("tests", str(total_t))
    root.set("failures", str(tot_f))
    root.set("errors", str(tot_e))
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def presets_arg(value: str) -> list[str]:
    """``all`` or a comma-separated list of preset names; raises ValueError naming a bad one."""
    if value == "all":
        return list(PRESETS)
    names = [v.strip() for v in value.split(",") if v.strip()]
    bad = [n for n in names if n not in PRESETS]
    if bad or not names:
        raise ValueError(f"unknown preset {bad[0] if bad else value!r} (valid: {', '.join(PRESETS)}, or all)")
    return names
