"""The history suite's child process: one engine release imported (its overlay first on ``PYTHONPATH``),
one job run, the results written as JSON. ``python -m kvaudit.history.worker JOB.json OUT.json``.

Jobs (``JOB.json``):

* ``{"mode": "search", "bug": ID, "version": V, "fuzzers": [...], "seeds": [...], "budget": SECONDS}``:
  for each fuzzer and seed, search the bug's config until a finding that *is* the bug
  (:meth:`HistoryBug.matches`; every other finding is suppressed, :class:`NotThisBug`, so that the
  program goes on past it), then confirm it 3 of 3 times and minimize it under the same suppressions
  (:func:`kvaudit.search.fuzz.triage`). Executions and seconds are to the first detection of the bug,
  before triage.
* ``{"mode": "replay", "bug": ID, "version": V, "programs": [[op dict, ...], ...]}``: run each program
  from a fresh engine, then drain it to idle; clean when nothing is found.

``OUT.json`` is rewritten atomically after every trial (the parent reads what is there when
interrupted). A progress line per trial goes to stderr. Exit 0; 2 when the release is not the one asked
for or the target cannot be built (one line on stderr).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback
from dataclasses import asdict

from kvaudit.history.catalogue import all_bugs, target_config
from kvaudit.history.trial import HistoryTrial


def _engine_version(engine: str) -> str:
    from kvaudit.history.releases import base_version
    return base_version(engine) or "?"


def _write(path: str, doc: dict) -> None:
    from kvaudit.replay import write_atomic
    write_atomic(path, doc)


class NotThisBug:
    """Suppressions (the interface :class:`kvaudit.audit.suppress.SuppressionSet` offers the runner) that
    cover every finding but ``bug``'s: a program goes on past other bugs, as a campaign's suppression
    file lets it, so that a later finding of the bug in the same program still counts. The signatures
    passed over are collected in ``others``."""

    needs_full_stacks = False

    def __init__(self, bug):
        self.bug = bug
        self.others: set[str] = set()

    def sift(self, findings: list, suppressed: list) -> list:
        kept = []
        for f in findings:
            if self.bug.matches(f):
                kept.append(f)
            else:
                self.others.add(f.signature)
                suppressed.append(f)
        return kept


def search_trial(bug, config, fuzzer: str, seed: int, budget: float) -> HistoryTrial:
    """One trial (see the module docstring)."""
    from kvaudit.program import program_to_json
    from kvaudit.search.fuzz import FuzzStats, triage

    trial = HistoryTrial(bug.id, fuzzer, seed, budget, expected_kind=bug.finding)
    stats = FuzzStats()
    others = NotThisBug(bug)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvaudit-history-") as work:
        found = _search(fuzzer, config, budget, seed, stats, work, others)
        trial.others = sorted(others.others)
        hits = [f for f in (found[1] if found else ()) if bug.matches(f)]
        if not hits:
            trial.note = "not found within the budget"
        else:
            executions, seconds = stats.first_hit or (stats.executions, time.monotonic() - t0)
            crash = triage(config, found[0], hits[0], suppressions=NotThisBug(bug))
            if crash is None:
                trial.note = f"{hits[0].signature} did not reproduce 3/3"
            else:
                trial.success = True
                trial.seconds, trial.executions = seconds, executions
                trial.min_len = len(crash.program)
                trial.first_oracle = crash.finding.kind
                trial.signature = crash.finding.signature
                trial.confirmations = crash.confirmations
                trial.program = program_to_json(crash.program)
    trial.wall = time.monotonic() - t0
    return trial


def _contained(bug, config, fuzzer: str, seed: int, budget: float) -> HistoryTrial:
    """:func:`search_trial`, with a watchdog interrupt that escaped the runner's guard (a kvaudit bug,
    seen once in a long suite run and not reproduced) turned into a failed trial whose note says so,
    so the bug's other trials still run; the watchdog is disarmed, so nothing is pending for the next."""
    from kvaudit.audit import runner

    t0 = time.monotonic()
    try:
        return search_trial(bug, config, fuzzer, seed, budget)
    except runner.StepTimeout:
        runner._WATCHDOG.disarm()
        where = traceback.extract_tb(sys.exc_info()[2])[-1]
        trial = HistoryTrial(bug.id, fuzzer, seed, budget, expected_kind=bug.finding,
                             note=f"kvaudit error: a StepTimeout escaped at {os.path.basename(where.filename)}:"
                                  f"{where.lineno} in {where.name} (the trial is lost, not failed)")
        trial.wall = time.monotonic() - t0
        return trial


def _search(fuzzer, config, budget, seed, stats, work, suppressions):
    """The fuzzer's search (:mod:`kvaudit.search.fuzzers`) with ``suppressions``, returning at the first
    finding they leave; ``work``: a directory it may keep work files in. A fuzzer that cannot search
    the config's kind is refused by the command (``bench --suite history``) before a worker starts."""
    from kvaudit.search import fuzzers
    from kvaudit.targets import registry

    kind = fuzzers.get(fuzzer)
    if not kind.takes(registry.kind_of(config).name):
        raise ValueError(f"fuzzer {fuzzer!r} cannot search a {registry.kind_of(config).name} engine")
    return kind.search(config, budget, seed, stats, fuzzers.Search(suppressions=suppressions, out_dir=work))


def replay_program(config, ops: list) -> dict:
    """``ops`` (op dicts) from a fresh engine, then drained to idle: ``{"clean", "signatures"}``."""
    from kvaudit.audit.runner import execute
    from kvaudit.program import Idle, program_from_json

    program = program_from_json(ops) + [Idle()]
    ex = execute(config, program, full_stacks=False)
    return {"clean": not ex.findings, "signatures": sorted({f.signature for f in ex.findings})}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    job_path, out_path = argv
    with open(job_path) as f:
        job = json.load(f)
    bug = all_bugs()[job["bug"]]
    version = _engine_version(bug.engine)
    if version != job["version"]:
        print(f"kvaudit history: {bug.engine} {version} is what imports here, not {job['version']}", file=sys.stderr)
        return 2
    from kvaudit.targets import registry

    try:
        config = target_config(bug)
        registry.get(bug.engine).probe(config)
    except (registry.TargetUnavailable, ValueError) as e:
        print(f"kvaudit history: {bug.id} cannot run on {bug.engine} {version}: {e}", file=sys.stderr)
        return 2
    out: dict = {"version": version, "mode": job["mode"], "results": []}
    if job["mode"] == "search":
        for fuzzer in job["fuzzers"]:
            for seed in job["seeds"]:
                t = _contained(bug, config, fuzzer, seed, job["budget"])
                out["results"].append(asdict(t))
                _write(out_path, out)
                print(f"kvaudit history: {t.line()}", file=sys.stderr, flush=True)
    else:
        for ops in job["programs"]:
            out["results"].append(replay_program(config, ops))
            _write(out_path, out)
    _write(out_path, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
