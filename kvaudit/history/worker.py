"""The history suite's child process: one engine release imported (its overlay first on ``PYTHONPATH``),
one job run, the results written as JSON. ``python -m kvaudit.history.worker JOB.json OUT.json``.

The jobs and their output: docs/internals/history.md#the-worker.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback
from dataclasses import asdict

from kvaudit.atomic import scratch_dir
from kvaudit.audit import runner
from kvaudit.config import json_value
from kvaudit.history.catalogue import all_bugs, target_config
from kvaudit.history.releases import base_version
from kvaudit.history.trial import HistoryTrial
from kvaudit.program import Idle, program_from_json, program_to_json
from kvaudit.replay import write_atomic
from kvaudit.search import fuzzers
from kvaudit.search.fuzz import FuzzStats, triage
from kvaudit.targets import registry


class NotThisBug:
    """Suppressions (the interface :class:`kvaudit.audit.suppress.SuppressionSet` offers the runner) that
    cover every finding but ``bug``'s, so that a program goes on past other bugs and a later finding of
    the bug in it still counts. The signatures passed over are collected in ``others``."""

    needs_full_stacks = False

    def __init__(self, bug):
        self.bug = bug
        self.others: set[str] = set()

    def sift(self, findings: list, suppressed: list) -> list:
        if not findings:  # (asked after every step of a per-step run, a localizing replay's)
            return []
        others = [f for f in findings if not self.bug.matches(f)]
        self.others.update(f.signature for f in others)
        suppressed.extend(others)
        return [f for f in findings if self.bug.matches(f)]


def search_trial(bug, config, fuzzer: str, seed: int, budget: float) -> HistoryTrial:
    """One trial: ``fuzzer`` searches ``config`` for ``budget`` seconds with ``seed`` until a finding that
    is ``bug``, then triages it (confirmed 3/3, minimized) under the same suppressions. Raises
    ``ValueError`` for a fuzzer that cannot search the config's kind."""
    kind, target = fuzzers.get(fuzzer), registry.kind_of(config).name
    if not kind.takes(target):
        raise ValueError(f"fuzzer {json_value(fuzzer)} cannot search a {target} engine")
    trial = HistoryTrial(bug.id, fuzzer, seed, budget, expected_kind=bug.finding)
    stats = FuzzStats()
    others = NotThisBug(bug)
    t0 = time.monotonic()
    with scratch_dir("kvaudit-history-") as work:
        found = kind.search(config, budget, seed, stats, fuzzers.Search(suppressions=others, out_dir=work))
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
                trial.succeeded(crash, executions, seconds)
                trial.signature = crash.finding.signature
                trial.confirmations = crash.confirmations
                trial.program = program_to_json(crash.program)
    trial.wall = time.monotonic() - t0
    return trial


def _contained(bug, config, fuzzer: str, seed: int, budget: float) -> HistoryTrial:
    # NOTE: a watchdog interrupt that escaped the runner's guard (a kvaudit bug, seen once in a long suite
    # run) is a lost trial, not a dead worker; the watchdog is disarmed so nothing is pending for the next
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


def freeze_heap() -> None:
    """Move everything the process holds now (the engine's modules, imported by the probe: torch, the
    engine, transformers) out of the cyclic collector's reach (``gc.freeze``), so that a full
    collection during a trial scans what the trials allocated, not those (docs/internals/history.md;
    measured: docs/internals/performance.md, stop 50)."""
    gc.freeze()


def replay_program(config, ops: list) -> dict:
    """``ops`` (op dicts) from a fresh engine, then drained to idle: ``{"clean", "signatures"}``."""
    ex = runner.execute(config, program_from_json(ops) + [Idle()], full_stacks=False)
    return {"clean": not ex.findings, "signatures": sorted({f.signature for f in ex.findings})}


def main(argv: list[str] | None = None) -> int:
    """Run the job of ``JOB.json`` into ``OUT.json``: exit 0; 2 with one line on stderr when the release
    is not the one asked for or the target cannot be built."""
    job_path, out_path = sys.argv[1:] if argv is None else argv
    with open(job_path) as f:
        job = json.load(f)
    bug = all_bugs()[job["bug"]]
    version = base_version(bug.engine) or "?"
    if version != job["version"]:
        print(f"kvaudit history: {bug.engine} {version} is what imports here, not {job['version']}", file=sys.stderr)
        return 2
    try:
        config = target_config(bug)
        registry.get(bug.engine).probe(config)
    except (registry.TargetUnavailable, ValueError) as e:
        print(f"kvaudit history: {bug.id} cannot run on {bug.engine} {version}: {e}", file=sys.stderr)
        return 2
    freeze_heap()
    out: dict = {"version": version, "mode": job["mode"], "results": []}
    if job["mode"] == "search":
        for fuzzer in job["fuzzers"]:
            for seed in job["seeds"]:
                t = _contained(bug, config, fuzzer, seed, job["budget"])
                out["results"].append(asdict(t))
                write_atomic(out_path, out)
                print(f"kvaudit history: {t.line()}", file=sys.stderr, flush=True)
    else:
        for ops in job["programs"]:
            out["results"].append(replay_program(config, ops))
            write_atomic(out_path, out)
    write_atomic(out_path, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
