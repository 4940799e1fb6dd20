"""The history suite's child process: one engine release imported (its overlay first on ``PYTHONPATH``),
one job run, the results written as JSON. ``python -m kvaudit.history.worker JOB.json OUT.json``.

Jobs (``JOB.json``):

* ``{"mode": "search", "bug": ID, "version": V, "fuzzers": [...], "seeds": [...], "budget": SECONDS}``:
  for each fuzzer and seed, search the bug's config until a finding that *is* the bug
  (:meth:`HistoryBug.matches`; other findings are noted and searched past, as ``known`` signatures),
  then confirm it 3 of 3 times and minimize it (:func:`kvaudit.search.fuzz.triage`). Executions and
  seconds are to the first detection of the bug, before triage.
* ``{"mode": "replay", "bug": ID, "version": V, "programs": [[op dict, ...], ...]}``: run each program
  from a fresh engine, then drain it to idle; clean when nothing is found.

``OUT.json`` is rewritten atomically after every trial (the parent reads what is there when
interrupted). A progress line per trial goes to stderr. Exit 0; 2 when the release is not the one asked
for or the target cannot be built (one line on stderr).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from dataclasses import asdict

from kvaudit.history.catalogue import all_bugs
from kvaudit.history.trial import HistoryTrial


def _engine_version(engine: str) -> str:
    from kvaudit.history.releases import base_version
    return base_version(engine) or "?"


def _write(path: str, doc: dict) -> None:
    from kvaudit.replay import write_atomic
    write_atomic(path, doc)


def search_trial(bug, config, fuzzer: str, seed: int, budget: float) -> HistoryTrial:
    """One trial (see the module docstring)."""
    from kvaudit.program import program_to_json
    from kvaudit.search.bench import search
    from kvaudit.search.fuzz import FuzzStats, triage

    trial = HistoryTrial(bug.id, fuzzer, seed, budget, expected_kind=bug.finding)
    stats = FuzzStats()
    t0 = time.monotonic()
    known: set[str] = set()
    with tempfile.TemporaryDirectory(prefix="kvaudit-history-") as work:
        while True:
            left = budget - (time.monotonic() - t0)
            if left <= 0:
                trial.note = "not found within the budget"
                break
            stats.first_hit = None
            found = _search(search, fuzzer, config, left, seed + len(known) * 1000, stats, work, frozenset(known))
            if found is None:
                trial.note = "not found within the budget"
                break
            program, findings = found
            hits = [f for f in findings if bug.matches(f)]
            if not hits:  # another finding: noted, then searched past
                new = sorted({f.signature for f in findings} - known)
                trial.others.extend(new)
                known.update(f.signature for f in findings)
                continue
            executions, seconds = stats.first_hit or (stats.executions, time.monotonic() - t0)
            crash = triage(config, program, hits[0])
            if crash is None:
                trial.note = f"{hits[0].signature} did not reproduce 3/3"
                break
            trial.success = True
            trial.seconds, trial.executions = seconds, executions
            trial.min_len = len(crash.program)
            trial.first_oracle = crash.finding.kind
            trial.signature = crash.finding.signature
            trial.confirmations = crash.confirmations
            trial.program = program_to_json(crash.program)
            break
    trial.wall = time.monotonic() - t0
    return trial


def _search(search, fuzzer, config, left, seed, stats, work, known):
    """``bench.search`` with ``known`` signatures searched past (random and Hypothesis take them; the
    other fuzzers stop at any finding, which the caller notes and searches past)."""
    from kvaudit.search.fuzz import hypothesis_search, random_search

    if fuzzer == "random":
        return random_search(config, left, seed, stats, known=known)
    if fuzzer == "hypothesis":
        return hypothesis_search(config, left, seed, stats, known=known)
    return search(fuzzer, config, left, seed, stats, work)


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
        config = bug.target_config()
        registry.get(bug.engine).probe(config)
    except (registry.TargetUnavailable, ValueError) as e:
        print(f"kvaudit history: {bug.id} cannot run on {bug.engine} {version}: {e}", file=sys.stderr)
        return 2
    out: dict = {"version": version, "mode": job["mode"], "results": []}
    if job["mode"] == "search":
        for fuzzer in job["fuzzers"]:
            for seed in job["seeds"]:
                t = search_trial(bug, config, fuzzer, seed, job["budget"])
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
