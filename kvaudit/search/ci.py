"""``kvaudit ci``, the nightly and per-PR job: every regression file still reproduces (3 runs, identical)
and is clean without its bug switches; a time-boxed fuzz campaign per preset; JUnit and SARIF of what is
still open. Design notes (what fails the job): docs/internals/search.md.
"""

from __future__ import annotations

import glob
import os
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from typing import Callable

from kvaudit.targets import registry
from kvaudit import replay
from kvaudit.atomic import scratch_dir
from kvaudit.config import device_unavailable
from kvaudit.audit.findings import Finding
from kvaudit.search.fuzz import CONFIRM_RUNS, FuzzStats
from kvaudit.reports import ci_outputs
from kvaudit.reports.junit import failure_text, xml_text
from kvaudit.reports.sarif import current_summary
from kvaudit.audit.runner import execute

# a preset's JUnit case and the SARIF's invocation when its share ran no program (exit 5)
NOTHING_SEARCHED = "nothing searched: the preset's share of --max-time ended before one program ran"


@dataclass
class RegressionCheck:
    """One regression file: what it must show, and what it showed (``problem``: why not, in words)."""

    name: str
    path: str
    signature: str
    reproduced: bool = False
    deterministic: bool = False
    clean_without_switch: bool = False
    problem: str = ""
    seconds: float = 0.0
    malformed: bool = False  # could not run as a replay file (unreadable, a plugin not loaded, nothing recorded)
    error: str = "malformed"  # then which: the JUnit error's type and the problem's first word

    @property
    def ok(self) -> bool:
        return self.reproduced and self.deterministic and self.clean_without_switch


@dataclass
class FuzzRun:
    preset: str
    seconds: float  # the share of --max-time; an interrupted run: the seconds it ran
    executions: int
    # one per replay file: (program, its findings of new signatures, the file in --out); a file holds every
    # finding its program raised, so two new signatures can share one
    new: list[tuple[list, list[Finding], str]] = field(default_factory=list)
    known: list[str] = field(default_factory=list)
    known_open: list[Finding] = field(default_factory=list)  # known findings that still reproduce
    interrupted: bool = False  # Ctrl-C or SIGTERM cut the campaign short (what it found is in ``new``)
    suppression_usage: list = field(default_factory=list)  # the workers' SuppressionSet.usage()
    reached: dict[str, int] = field(default_factory=dict)  # Target.reach() summed over the programs run
    found_after: dict[str, float] = field(default_factory=dict)  # new signature -> seconds of search until it landed
    not_written: OSError | None = None  # the campaign's file not written on a full disk (CampaignResult.not_written)
    unwritten: dict[str, str] = field(default_factory=dict)  # signature -> its replay file, found but not written

    def new_signatures(self) -> dict[str, tuple[Finding, str]]:
        """Signature -> (its first finding, its replay file), in signature order."""
        first: dict[str, tuple[Finding, str]] = {}
        for _, findings, path in self.new:
            for f in findings:
                first.setdefault(f.signature, (f, path))
        return dict(sorted(first.items()))

    @property
    def nothing_searched(self) -> bool:
        """The preset's share ended before one program ran (not interrupted, nothing found): no pass."""
        return self.executions == 0 and not self.new and not self.interrupted


@dataclass
class CiResult:
    regressions: list[RegressionCheck] = field(default_factory=list)
    fuzz: list[FuzzRun] = field(default_factory=list)
    interrupted: bool = False
    presets: list[str] = field(default_factory=list)  # the presets the job was to fuzz, in run order
    files: list[str] = field(default_factory=list)  # the regression files it was to replay, in order
    replaying: str | None = None  # the file whose replay began last (an interrupt there cut it short)

    @property
    def not_replayed(self) -> list[str]:
        """The files of :attr:`files` with no result: :attr:`replaying` cut short, or never started."""
        checked = {r.path for r in self.regressions}
        return [p for p in self.files if p not in checked]

    def not_replayed_why(self, path: str) -> str:
        """Why ``path`` (of :attr:`not_replayed`) has no result, in words (the job's table and JUnit)."""
        return "interrupted while it was replayed" if path == self.replaying else self.not_run

    @property
    def not_started(self) -> list[str]:
        """The presets of :attr:`presets` whose fuzzing never started (an interrupt, a full disk before them)."""
        fuzzed = {run.preset for run in self.fuzz}
        return [p for p in self.presets if p not in fuzzed]

    @property
    def not_run(self) -> str:
        """Why a regression file or a preset never started, in words (the job's table and JUnit)."""
        return "not run: " + ("interrupted before it started" if self.interrupted else
                              "the disk was full (a preset before it could not write its finding)")

    @property
    def failed(self) -> bool:
        return any(not r.ok for r in self.regressions) or any(run.new or run.unwritten for run in self.fuzz)

    def new_findings(self) -> list[Finding]:
        return [f for run in self.fuzz for _, findings, _ in run.new for f in findings]

    @property
    def nothing_searched(self) -> list[str]:
        """The presets whose share of the budget ended before one program ran (exit 5), in run order."""
        return [run.preset for run in self.fuzz if run.nothing_searched]


def check_regression(path: str, runs: int = CONFIRM_RUNS) -> RegressionCheck:
    """Replay ``path`` ``runs`` times with its switches on and once with them off. An unreadable file, or one
    whose target cannot run here, is a failed check, not an exception."""
    t0 = time.monotonic()
    name = os.path.splitext(os.path.basename(path))[0]
    try:
        if os.path.exists(path) and not (os.path.isfile(path) or os.path.isdir(path)):  # (a folder: load says so)
            raise replay.ReplayFormatError(f"{path} is not a regular file (a FIFO's reader waits for a writer for ever)")
        config, program, recorded, _ = replay.load(path)
    except replay.ReplayFormatError as e:  # (a plugin's file or a start-up interrupt's --json is not broken)
        error = ("unavailable" if isinstance(e, replay.TargetNotLoadedError) else
                 "nothing-recorded" if isinstance(e, replay.NothingRecordedError) else "malformed")
        return RegressionCheck(name, path, "", problem=f"{error}: {e}", malformed=True, error=error,
                               seconds=time.monotonic() - t0)
    check = RegressionCheck(name, path, recorded[0].signature if recorded else "")
    try:  # a real engine's file where that engine is missing, a CUDA file without CUDA: a failed check, in one line
        registry.kind_of(config).probe(config)
        why = device_unavailable(config.device)
        if why is not None:
            raise registry.TargetUnavailable(why)
    except (registry.TargetUnavailable, registry.UnknownTargetError) as e:
        check.problem = f"cannot run here: {e}"
        check.seconds = time.monotonic() - t0
        return check
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
                suppress_path: str | None = None, on_progress: Callable[[FuzzStats], None] | None = None,
                target: str = "eut", db: str | None = None, campaign: str = "default",
                taken: frozenset[str] = frozenset()) -> FuzzRun:
    """Fuzz the clean engine of ``preset`` for ``budget`` seconds as a campaign: over ``corpus/<preset>``
    (resumable), else over a temporary corpus; the new replay files are copied to ``out_dir`` (named as
    :func:`kvaudit.replay.home` says: another file of the name, a note or another kind's, is kept), a name in
    ``taken`` (another preset of the job wrote it: the same signature found there) as
    ``<name>.<preset>.json``, so each preset keeps its own reproducer. ``db``: a
    Redis URL; the campaign is ``<campaign>/<preset>`` across every host (CI shard) that names it. An
    interrupted campaign (Ctrl-C, SIGTERM) returns what it found, ``interrupted`` set."""
    from kvaudit.search.campaign import run_campaign

    config = registry.get(target).preset(preset).config()
    run = FuzzRun(preset, budget, 0)
    t0, landed = time.monotonic(), {}
    with scratch_dir(f"kvaudit-ci-{preset}-") as tmp:
        where = os.path.join(corpus, preset) if corpus is not None else tmp
        result = run_campaign(config, fuzzer, budget, seed, 1, where, suppress_path, on_progress=on_progress,
                              on_finding=lambda sig, _: landed.setdefault(sig, time.monotonic()),
                              db=db, campaign=f"{campaign}/{preset}")
        # (confirmed and minimized by then: the search's clock starts when its first engine is built)
        run.found_after = {sig: max(0.0, at - result.stats.started) for sig, at in landed.items()}
        run.executions = result.stats.executions
        run.reached = dict(result.stats.reached)
        run.suppression_usage = list(result.suppression_usage.values())
        run.not_written, run.unwritten = result.not_written, dict(result.unwritten)
        run.known = sorted({**result.known, **result.fleet})
        by_file: dict[str, set[str]] = {}
        for sig, path in result.new.items():
            by_file.setdefault(path, set()).add(sig)
        for path, sigs in sorted(by_file.items()):  # (the corpus keeps its copy; --out is what a job uploads)
            _, program, findings, doc = replay.load(path)
            # (a file of its name that is not its kind's replay file of that signature is left as it is)
            sig = next(f.signature for f in findings if f.signature in sigs)
            dest, _ = replay.home(out_dir, sig, target, name=os.path.basename(path))
            if dest in taken:  # (its <name>.<preset>.json as home says too: a note of that name is kept)
                stem = os.path.basename(dest)[:-len(".json")]
                dest, _ = replay.home(out_dir, sig, target, name=f"{stem}.{preset}.json")
            try:
                path = replay.write_atomic(dest, doc)
            except OSError as e:  # --out's disk full: found but not written, as a campaign's own; still reported
                if e.filename is None:
                    e.filename = dest
                run.not_written, path = run.not_written or e, dest
                run.unwritten.update({sig: dest for sig in sorted(sigs)})
            run.new.append((program, [f for f in findings if f.signature in sigs], path))
        if not result.interrupted:  # (in the scratch corpus's life: another shard's files are pulled into it)
            run.known_open = still_open({**result.fleet, **result.known}, suppress_path, run.suppression_usage)
    run.interrupted = result.interrupted
    if result.interrupted:  # no time for replays: its SARIF lists what was found
        run.seconds = min(budget, time.monotonic() - t0)
    return run


def still_open(known: dict[str, str], suppress_path: str | None = None, usage: list | None = None) -> list[Finding]:
    """The known findings (signature -> corpus file; another CI shard's, pulled from ``--db``, too) not fixed
    yet: each file is replayed once, and its recorded findings whose signatures come back are returned as
    recorded (so their SARIF locations are the file's). Files that no longer load are left out. ``usage``: each
    replay's suppression usage (:meth:`~kvaudit.audit.suppress.SuppressionSet.usage`) is appended to it."""
    from kvaudit.audit.suppress import SuppressionSet

    sset = SuppressionSet.load(suppress_path) if suppress_path else None
    by_file: dict[str, set[str]] = {}
    for sig, path in known.items():
        by_file.setdefault(path, set()).add(sig)
    out: list[Finding] = []
    for path, sigs in sorted(by_file.items()):
        try:
            config, program, recorded, _ = replay.load(path)
        except replay.ReplayFormatError:
            continue
        rules = sset.fresh() if sset else None
        now = set(execute(config, program, suppressions=rules).signatures)
        if rules is not None and usage is not None:  # (a rule that left a known finding out is in use)
            usage.append(rules.usage())
        out += [f for f in recorded if f.signature in sigs & now]
    return out


def sarif(result: CiResult, config, ran: tuple = ()) -> dict:
    """The SARIF log of every open finding of the fuzz, one result per signature in signature order:
    ``baselineState`` ``"unchanged"`` for a signature some preset's corpus knew, else ``"new"``;
    ``properties.preset``: the first preset (in run order) that has it. An interrupted job's run, or one with a
    preset that searched nothing, has an unsuccessful ``invocation``. The run's properties are ``config``'s; with
    ``ran`` (the configs of the presets fuzzed) naming several presets, the job's (:func:`_presets_properties`)."""
    from kvaudit.reports.sarif import to_sarif

    first: dict[str, tuple[Finding, str]] = {}
    for run in result.fuzz:
        for f in run.known_open + [f for _, findings, _ in run.new for f in findings]:
            first.setdefault(f.signature, (f, run.preset))
    known = {sig for run in result.fuzz for sig in run.known}
    sigs = sorted(first)
    log = to_sarif([first[s][0] for s in sigs], config,
                   baseline={s: "unchanged" if s in known else "new" for s in sigs})
    for s, r in zip(sigs, log["runs"][0]["results"]):
        r["properties"]["preset"] = first[s][1]
    if len({c.preset for c in ran}) > 1:
        _presets_properties(log["runs"][0]["properties"], ran)
    if reached := reached_by_preset(result):  # what each preset's programs reached (Target.reach() summed): a clean preset's scope
        log["runs"][0]["properties"]["reached"] = reached
    lost = sorted({sig for run in result.fuzz for sig in run.unwritten})
    if result.interrupted:  # its results are what ran: say the run did not complete
        log["runs"][0]["invocations"] = [ci_outputs.invocation(ci_outputs.INTERRUPTED)]
    elif idle := result.nothing_searched:  # (exit 5) a preset checked nothing: not a clean run
        log["runs"][0]["invocations"] = [ci_outputs.invocation(
            f"{NOTHING_SEARCHED} (in {len(idle)} of {len(result.fuzz)} preset(s): {', '.join(idle)})")]
    elif lost:  # a full disk: what a worker found but could not write has no result here (nothing to locate)
        log["runs"][0]["invocations"] = [ci_outputs.invocation(
            f"{len(lost)} new signature(s) found but not written (disk full): {', '.join(lost)}")]
    return log


def reached_by_preset(result: CiResult) -> dict[str, dict[str, int]]:
    """Preset -> what its programs reached (``Target.reach()`` summed, path -> count), for each preset that ran a
    program and whose target counts paths: the SARIF's run property ``reached``, the HTML's and JSON's."""
    return {run.preset: dict(sorted(run.reached.items())) for run in result.fuzz if run.reached and run.executions}


def _presets_properties(props: dict, ran: tuple) -> None:
    """A job over several presets: ``props`` (the first preset's run properties) made the job's: ``presets``
    lists them in run order, ``bugs`` is every bug any of them switches on, ``engineConfigs`` maps each to its
    config; ``model`` and ``page_size`` stay where every preset has the same, and ``preset`` and ``engineConfig``
    go (each result's ``properties.preset`` names its own)."""
    by_preset = {c.preset: c for c in ran}
    configs = {p: c.to_dict() for p, c in by_preset.items()}
    for key in ("preset", "engineConfig", "bugs", "model", "page_size"):
        props.pop(key, None)
    # (read from the configs: vLLM's page_size is its block_size, a property to_dict() leaves out)
    values = {k: [getattr(c, k, None) for c in by_preset.values()] for k in ("model", "page_size")}
    props.update({"presets": list(configs), "bugs": sorted({b for d in configs.values() for b in d.get("bugs", [])}),
                  **{k: v[0] for k, v in values.items() if v.count(v[0]) == len(v)}, "engineConfigs": configs})


def junit(result: CiResult) -> str:
    """Two suites: ``kvaudit.regressions`` (a case per regression file, skipped for one of
    :attr:`CiResult.not_replayed`) and ``kvaudit.fuzz`` (per preset, a
    case ``PRESET: no new findings`` that passes, listing the known ones still open, or is skipped as
    ``PRESET: nothing searched``, ``PRESET: interrupted`` or, for a preset of :attr:`CiResult.presets` that never
    started, ``PRESET: not run``; a failing case per new signature; a skipped case ``interrupted`` when the job
    was stopped)."""
    root, reg, fz = ci_outputs.suites()
    for r in result.regressions:
        case = ET.SubElement(reg, "testcase", classname="kvaudit.regressions", name=xml_text(r.name),
                             time=f"{r.seconds:.2f}")
        if r.malformed:  # the case could not run: an error, not a failure
            ET.SubElement(case, "error", message=xml_text(r.problem), type=r.error).text = xml_text(
                f"{r.path}\n{r.problem}\n")
        elif not r.ok:
            fail = ET.SubElement(case, "failure", message=xml_text(r.problem), type="regression")
            fail.text = xml_text(f"{r.path}\nsignature: {r.signature}\n{r.problem}\n")
    for path in result.not_replayed:  # what never ran to its end is not a pass: a skipped case each, as the table's
        case = ET.SubElement(reg, "testcase", classname="kvaudit.regressions",
                             name=xml_text(os.path.splitext(os.path.basename(path))[0]), time="0.00")
        ET.SubElement(case, "skipped", message=xml_text(result.not_replayed_why(path)))
    for run in result.fuzz:
        if not run.new and not run.unwritten:  # known findings (the corpus's, still open) pass: listed, not hidden
            what = ("nothing searched" if run.nothing_searched else "interrupted" if run.interrupted else
                    "no new findings")  # (the first two are skipped: not a pass)
            case = ET.SubElement(fz, "testcase", classname=f"kvaudit.fuzz.{run.preset}",
                                 name=f"{run.preset}: {what}", time=f"{run.seconds:.2f}")
            still = sorted({f.signature for f in run.known_open})
            notes = ([f"{len(still)} known finding(s) still open: " + ", ".join(still)] if still else []) + (
                ["interrupted before its budget was spent"] if run.interrupted else []) + ci_outputs.reach_lines(
                run.reached, bool(run.executions))
            if run.nothing_searched:  # nothing was checked: not a pass
                ET.SubElement(case, "skipped", message=NOTHING_SEARCHED)
            elif run.interrupted:  # its share was cut short: what ran found nothing new, which is not a pass
                ET.SubElement(case, "skipped", message="interrupted before the preset's share of --max-time ended")
            if notes:  # (after <skipped>: JUnit's schema orders a case's children skipped, ..., system-out)
                ET.SubElement(case, "system-out").text = xml_text("\n".join(notes) + "\n")
        for f, path in run.new_signatures().values():  # a case per new signature
            case = ET.SubElement(fz, "testcase", classname=f"kvaudit.fuzz.{run.preset}", name=xml_text(f.signature),
                                 time=f"{run.found_after.get(f.signature, run.seconds):.2f}")
            fail = ET.SubElement(case, "failure", message=xml_text(current_summary(f)), type=xml_text(f.kind))
            lost = " (NOT WRITTEN: disk full)" if f.signature in run.unwritten else ""
            fail.text = xml_text(f"replay file: {path}{lost}\n" + failure_text(f))
        reported = set(run.new_signatures())
        for sig, path in sorted(run.unwritten.items()):  # a worker's finding a full disk refused: still a failure
            if sig not in reported:
                case = ET.SubElement(fz, "testcase", classname=f"kvaudit.fuzz.{run.preset}", name=xml_text(sig),
                                     time=f"{run.seconds:.2f}")
                ET.SubElement(case, "failure", message="found but not written (disk full)",
                              type=xml_text(sig.split("/", 1)[0])).text = xml_text(f"replay file not written: {path}\n")
    for preset in result.not_started:  # what never ran is not a pass: a skipped case each, as the table's row
        add = ET.SubElement(fz, "testcase", classname=f"kvaudit.fuzz.{preset}", name=f"{preset}: not run", time="0.00")
        ET.SubElement(add, "skipped", message=xml_text(result.not_run))
    if result.interrupted:
        ci_outputs.add_skipped(fz)
    return ci_outputs.document(root)

