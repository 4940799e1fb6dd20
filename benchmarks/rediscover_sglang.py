#!/usr/bin/env python3
"""Executions-to-bug for rediscovering the SGLang 0.5.23 findings of ``corpora/sglang/`` from scratch.

    python benchmarks/rediscover_sglang.py [--fuzzers random,hypothesis] [--seeds 3] [--budget 60]
        [--max-executions N] [--files GLOB ...] [--vllm-45357] [--history IDS]
        [--planted TARGET:PRESET:BUG[:KEY=VALUE,...] ...] [--json out.json]

For each replay file in ``corpora/sglang/*.json`` its ``config`` (target, preset, overrides; no bug
switched on: these are bugs of the installed SGLang 0.5.23 itself) is searched by each fuzzer with
seeds 1..N, ``--budget`` seconds each, no seed programs. A trial's hit is the first finding whose
signature equals the file's recorded one; any other finding is not a hit, and the search goes on past
it (:class:`kvaudit.search.fuzz.OnlySignature` as the search's ``known``: such a finding ends its
program, as a campaign's known findings do). ``--vllm-45357`` adds vLLM #45357 (the
``vllm-kv-connector`` preset, a finding whose signature contains ``check:inflight-write``); run it
with ``PYTHONPATH=~/.cache/kvaudit/releases/vllm-0.23.0:$PWD``. ``--history sglang-21875`` adds
history-suite bugs (run with the shipping release's overlay first on ``PYTHONPATH``), searched with
every other finding suppressed and matched by ``HistoryBug.matches``, as the history worker does
(without its triage). ``--planted eut:retract:retract-unaligned-page:num_slots=512`` adds a planted bug
(a zoo bug or a target's fault, switched on in that preset, with config fields overridden): any finding
is a hit, since the presets' clean engines find nothing. Fuzzers: ``random``, ``hypothesis``, ``corpus``, atheris, and the corpus
fuzzer's named variants (:data:`VARIANTS`, docs/search/README.md "Search variants").

Per case and fuzzer: successes/trials, median executions, ops and process CPU seconds to the first hit over the
successful trials (``-`` when half or more failed: a censored median), and the geometric mean over
the cases both fuzzers find of median executions(random) / median executions(fuzzer) (> 1: fewer
executions than random). Each config runs one empty program first (imports, first-run set-up) outside
the trials' budgets. Executions, not seconds, are the figure to compare: the machine is shared.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import statistics
import sys
import time

from kvaudit.audit.runner import execute
from kvaudit.program import Idle
from kvaudit.replay import load
from kvaudit.search.fuzz import FuzzStats, OnlySignature


class _HistoryWanted:
    """A history-suite bug as a trial's target: the history worker's match (``HistoryBug.matches``)
    and its suppressions (every other finding suppressed: the program goes on past it)."""

    def __init__(self, bug):
        self.bug = bug

    def wants_finding(self, f) -> bool:
        return self.bug.matches(f)

    def suppressions(self):
        from kvaudit.history.worker import NotThisBug

        return NotThisBug(self.bug)


def planted(spec: str) -> tuple[str, object, OnlySignature]:
    """``TARGET:PRESET:BUG[:KEY=VALUE,...]`` as a case: the preset's config with ``BUG`` switched on and the
    fields overridden (integer values), any finding wanted. Raises ``ValueError`` on a malformed spec."""
    from kvaudit.targets import registry

    parts = spec.split(":")
    if len(parts) not in (3, 4):
        raise ValueError(f"--planted {spec!r}: want TARGET:PRESET:BUG[:KEY=VALUE,...]")
    changes = dict(kv.split("=", 1) for kv in parts[3].split(",")) if len(parts) == 4 else {}
    config = registry.get(parts[0]).preset(parts[1]).config(bugs=frozenset([parts[2]]),
                                                            **{k: int(v) for k, v in changes.items()})
    return spec.replace(":", " "), config, OnlySignature("", substring=True)


def cases(files: list[str], vllm: bool, history: list[str] = (), plants: list[str] = ()) \
        -> list[tuple[str, object, object]]:
    out = [planted(spec) for spec in plants]
    for bid in history:
        from kvaudit.history.catalogue import all_bugs, target_config

        bug = all_bugs()[bid]
        out.append((bid, target_config(bug), _HistoryWanted(bug)))
    for path in files:
        config, _program, findings, _doc = load(path)
        out.append((os.path.basename(path)[:-5], config, OnlySignature(findings[0].signature)))
    if vllm:
        from kvaudit.targets import registry

        config = registry.get("vllm").preset("vllm-kv-connector").config()
        out.append(("vllm-45357-inflight-write", config, OnlySignature("check:inflight-write", substring=True)))
    return out


# corpus fuzzer variants measured against random (docs/search/README.md, "Search variants"):
# corpus_search's arguments. The variants of its feature set and schedule measured there (corpus-trans,
# -rare, -ext, -aswarm, -ctx, -keep, -lines) earned no place and left corpus_search after 877df24; run
# them at that commit.
VARIANTS = {
    "corpus-w16": dict(warmup=16),
    "corpus-states": dict(),  # features: abstract states and sites only (the default)
    "corpus-states-f50": dict(fresh_share=0.5),  # more fresh programs after the warmup
    "corpus-48": dict(min_ops=8, max_ops=48),  # longer programs (warmup and fresh: random-48's lengths)
    "corpus-96": dict(min_ops=16, max_ops=96),
    "corpus-96-f70": dict(min_ops=16, max_ops=96, fresh_share=0.7),
    "corpus-96-f100": dict(min_ops=16, max_ops=96, fresh_share=1.0),  # no mutation: random-96 keeping a corpus
}


# random baseline variants: random_search's arguments (program lengths)
RANDOM_VARIANTS = {
    "random-48": dict(min_ops=8, max_ops=48),
    "random-96": dict(min_ops=16, max_ops=96),
    "random-192": dict(min_ops=32, max_ops=192),
}


def trial(fuzzer: str, config, wanted: OnlySignature, seed: int, budget: float,
          max_executions: int | None = None) -> dict:
    from kvaudit.search.bench import search

    stats = FuzzStats()
    t0, c0 = time.monotonic(), time.process_time()
    if isinstance(wanted, _HistoryWanted):  # as kvaudit.history.worker searches (no triage here)
        from kvaudit.search.corpus_fuzz import corpus_search
        from kvaudit.search.fuzz import random_search

        kw = dict(suppressions=wanted.suppressions(), max_executions=max_executions)
        if fuzzer == "random" or fuzzer in RANDOM_VARIANTS:
            found = random_search(config, budget, seed, stats, **kw, **RANDOM_VARIANTS.get(fuzzer, {}))
        else:
            found = corpus_search(config, budget, seed, stats, **kw, **VARIANTS.get(fuzzer, {}))
        hit = found is not None and any(wanted.wants_finding(f) for f in found[1])
        return _result(fuzzer, seed, hit, stats, t0, c0)
    if fuzzer in VARIANTS:
        from kvaudit.search.corpus_fuzz import corpus_search

        found = corpus_search(config, budget, seed, stats, known=wanted, max_executions=max_executions,
                              **VARIANTS[fuzzer])
    elif fuzzer in RANDOM_VARIANTS:
        from kvaudit.search.fuzz import random_search

        found = random_search(config, budget, seed, stats, known=wanted, max_executions=max_executions,
                              **RANDOM_VARIANTS[fuzzer])
    else:
        found = search(fuzzer, config, budget, seed, stats, work_dir="/tmp", known=wanted,
                       max_executions=max_executions)
    hit = found is not None and any(wanted.wants(f.signature) for f in found[1])
    return _result(fuzzer, seed, hit, stats, t0, c0)


def _result(fuzzer: str, seed: int, hit: bool, stats: FuzzStats, t0: float, c0: float) -> dict:
    """A trial's JSON line. The searches here return at their first hit, so ``ops`` and ``cpu`` (process CPU
    seconds: the load of a shared machine moves them less than wall seconds) are to the hit, as are
    ``executions`` and ``seconds``; on a miss, the whole search's."""
    execs, secs = stats.first_hit if hit and stats.first_hit else (stats.executions, time.monotonic() - t0)
    return {"fuzzer": fuzzer, "seed": seed, "hit": hit, "executions": execs, "seconds": round(secs, 2),
            "ops": stats.ops, "cpu": round(time.process_time() - c0, 2), "total_executions": stats.executions}


def median(v):
    return statistics.median(v) if v else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fuzzers", default="random,hypothesis")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--first-seed", type=int, default=1)
    ap.add_argument("--budget", type=float, default=60.0, help="seconds per trial")
    ap.add_argument("--max-executions", type=int, default=None,
                    help="programs per trial (a budget the shared machine's load does not change)")
    ap.add_argument("--files", nargs="*", default=None, help="replay files (default corpora/sglang/*.json)")
    ap.add_argument("--no-sglang", action="store_true", help="leave out the SGLang corpus")
    ap.add_argument("--vllm-45357", action="store_true")
    ap.add_argument("--history", default="", metavar="IDS",
                    help="history-suite bugs too (comma-separated ids; run with the shipping release's overlay "
                         "first on PYTHONPATH), searched and matched as the history worker does")
    ap.add_argument("--json", default=None, help="append each trial as a JSON line here")
    ap.add_argument("--table", nargs="+", default=None, metavar="JSONL",
                    help="print the table of trials recorded by --json (several files merge) and exit")
    ap.add_argument("--planted", action="append", default=[], metavar="TARGET:PRESET:BUG[:KEY=VALUE,...]",
                    help="a planted bug as a case (repeatable): e.g. eut:retract:retract-unaligned-page:num_slots=512")
    args = ap.parse_args(argv)
    if args.table:
        rows: dict[tuple[str, str], list[dict]] = {}
        for path in args.table:
            with open(path, encoding="utf-8") as fh:
                for line in fh:
                    t = json.loads(line)
                    rows.setdefault((t["case"], t["fuzzer"]), []).append(t)
        fuzzers = list(dict.fromkeys(f for _, f in rows))
        fuzzers = ["random"] + [f for f in fuzzers if f != "random"] if "random" in fuzzers else fuzzers
        print_table(rows, fuzzers)
        return 0
    files = [] if args.no_sglang else sorted(args.files or glob.glob("corpora/sglang/*.json"))
    history = [b for b in args.history.split(",") if b]
    fuzzers = args.fuzzers.split(",")
    rows: dict[tuple[str, str], list[dict]] = {}
    for name, config, wanted in cases(files, args.vllm_45357, history, args.planted):
        execute(config, [Idle()])  # imports and first-run set-up outside the trials' budgets
        for seed in range(args.first_seed, args.first_seed + args.seeds):  # the fuzzers side by side, seed by seed
            for fuzzer in fuzzers:
                t = trial(fuzzer, config, wanted, seed, args.budget, args.max_executions)
                t["case"] = name
                rows.setdefault((name, fuzzer), []).append(t)
                print(json.dumps(t), flush=True)
                if args.json:
                    with open(args.json, "a", encoding="utf-8") as fh:
                        fh.write(json.dumps(t) + "\n")
    print_table(rows, fuzzers)
    return 0


def print_table(rows, fuzzers) -> None:
    """Per case, each fuzzer's hits and median executions, ops and CPU seconds [wall seconds] to the first hit
    (``-``: half or more missed); then each fuzzer's geometric means against the baseline (``random``, or
    the first fuzzer without it) over the cases both find (older JSON lines without ops or CPU: ``?``)."""
    names = sorted(dict.fromkeys(n for n, _ in rows))
    base = "random" if "random" in fuzzers else fuzzers[0]
    med: dict[tuple[str, str, str], float | None] = {}
    print("\n| case | " + " | ".join(f"{f} hits | {f} median execs / ops / CPU s [wall s]" for f in fuzzers) + " |")
    print("|---|" + "---|---|" * len(fuzzers))
    for n in names:
        cells = []
        for f in fuzzers:
            ts = rows.get((n, f), [])
            ok = [t for t in ts if t["hit"]]
            reached = len(ok) * 2 > len(ts)
            for key in ("executions", "ops", "cpu", "seconds"):
                vals = [t[key] for t in ok if key in t]
                med[(n, f, key)] = median(vals) if reached and len(vals) == len(ok) else None
            m = {k: med[(n, f, k)] for k in ("executions", "ops", "cpu", "seconds")}
            text = "-" if m["executions"] is None else (
                f"{m['executions']:g} / " + ("?" if m["ops"] is None else f"{m['ops']:g}") + " / "
                + ("?" if m["cpu"] is None else f"{m['cpu']:.1f}") + f" [{m['seconds']:.1f}]")
            cells.append(f"{len(ok)}/{len(ts)} | {text}")
        print(f"| {n} | " + " | ".join(cells) + " |")
    for f in fuzzers:
        if f == base:
            continue
        out = []
        for key in ("executions", "ops", "cpu"):
            ratios = [med[(n, base, key)] / med[(n, f, key)] for n in names
                      if med.get((n, base, key)) and med.get((n, f, key))]
            g = math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else None
            out.append(f"{key} {g and round(g, 3)} ({len(ratios)} cases)")
        missed = [n for n in names if med.get((n, base, "executions")) and not med.get((n, f, "executions"))]
        print(f"\n{f}: geomean {base}/{f} (> 1: {f} needs less): " + ", ".join(out)
              + f"; {base} finds but {f} does not (median): {missed}")

if __name__ == "__main__":
    sys.exit(main())
