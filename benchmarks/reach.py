#!/usr/bin/env python3
"""What each preset reaches: the target's path counters (``Target.reach``) over random programs.

    python benchmarks/reach.py --target vllm [--programs 40] [--seed 1] [--preset P ...] [--json FILE]
    python benchmarks/reach.py --history sglang-22882   # a history row's config (its release's overlay first)

For each preset of ``--target``, ``--programs`` seeded random programs (4 to 24 ops, the preset's
capabilities, as ``kvaudit fuzz --fuzzer random`` draws them) run under full audit, each up to its first
finding, as the fuzzers run them (:func:`kvaudit.search.fuzz.run_program`). Prints one row per preset:
programs, programs with a finding, and every counter the target keeps (preemptions, failed transfers,
...), summed. A counter at 0 names a path no program of that preset reached: a clean run there says
nothing about it.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from kvaudit.program import random_program
from kvaudit.program.schema import max_prompt
from kvaudit.search.fuzz import FuzzStats, run_program
from kvaudit.targets import program_features, registry


def reach(config, programs: int, seed: int) -> tuple[FuzzStats, int]:
    """``programs`` random programs of ``config`` from ``seed``: the stats (``reached`` summed) and how
    many programs produced a finding."""
    rng, stats, hits = random.Random(seed), FuzzStats(), 0
    for _ in range(programs):
        program = random_program(rng, rng.randint(4, 24), max_prompt=max_prompt(config.context_len),
                                 features=program_features(config))
        stats.executions += 1
        hits += bool(run_program(config, program, stats, None, time.monotonic() + 3600)[1])
    return stats, hits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="eut")
    ap.add_argument("--programs", type=int, default=40)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--preset", action="append", help="only this preset (repeatable; default: all)")
    ap.add_argument("--json", help="also write the rows to this file")
    ap.add_argument("--history", action="append", help="a history row's config instead of presets (repeatable; "
                    "run with the release's overlay first on PYTHONPATH)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    kind = registry.get(args.target)
    rows = []
    if args.history:
        from kvaudit.history.catalogue import all_bugs, target_config
        configs = [(bug, target_config(all_bugs()[bug])) for bug in args.history]
    else:
        configs = [(name, kind.preset(name).config()) for name in kind.presets()
                   if not args.preset or name in args.preset]
    for name, config in configs:
        stats, hits = reach(config, args.programs, args.seed)
        rows.append({"preset": name, "programs": stats.executions, "with_finding": hits,
                     "seconds": round(stats.elapsed, 1), **dict(sorted(stats.reached.items()))})
        counters = ", ".join(f"{k}={v}" for k, v in sorted(stats.reached.items())) or "(no counters)"
        print(f"{name}: {stats.executions} programs ({hits} with a finding) in {stats.elapsed:.1f}s: {counters}",
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
