#!/usr/bin/env python3
"""Throughput of program execution: programs/s and ops/s, bare engine vs hooks vs full audit.

    python benchmarks/throughput.py [--programs N] [--length L] [--preset NAME|all] [--repeat K]

Runs on one core (torch.set_num_threads(1)); each mode reports the best of --repeat runs of the
process's CPU time. The modes take turns (round-robin, --repeat rounds), so that a slow phase of a
shared machine does not fall on one mode only.
Modes: "bare" is the engine alone; "ledger" adds the hooks' ledger (every alloc/free recorded
with the innermost engine frame, double free checked); "hooks" adds the shadow KV content tags
(stale-KV reads), the fuzzers' search mode; "hooks-full" records full stacks and owners, as a
replay for a report does; "audit" and "audit-full" add the per-step oracles (reachability,
accounting, liveness); "audit-sparse" is the fuzzers' full audit: the same oracles on the searches'
sparse schedule (every ``kvaudit.search.schedule.CHECK_EVERY`` steps, before an op that ends a state,
and at the program's end; a hit replayed per step), with the searches' lean hooks (no call sites, no
lock-event records; the site keys in the programs a search collects them in,
``kvaudit.search.schedule.site_keys_due``). The same seeded programs run in every mode.
"""

from __future__ import annotations

import argparse
import random

import torch

from kvaudit.targets.eut.presets import PRESETS, get_preset
from kvaudit.program import random_program
from kvaudit.search.bench import run_programs
from kvaudit.search.schedule import CHECK_EVERY


MODES = (  # name, hooks installed, oracles, full stacks, shadow KV tags, steps between full checks
    ("bare", False, False, False, False, 1),
    ("ledger", True, False, False, False, 1),
    ("hooks", True, False, False, True, 1),
    ("hooks-full", True, False, True, True, 1),
    ("audit", True, True, False, True, 1),
    ("audit-full", True, True, True, True, 1),
    ("audit-sparse", True, True, False, True, CHECK_EVERY),
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--programs", type=int, default=200)
    ap.add_argument("--length", type=int, default=10)
    ap.add_argument("--preset", default="pd-decode-hisparse", help="a preset name, or 'all'")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=3, help="best of this many runs per mode")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rng = random.Random(args.seed)
    programs = [random_program(rng, args.length) for _ in range(args.programs)]
    print(f"programs={args.programs} length={args.length} seed={args.seed} torch={torch.__version__} threads=1")
    print(f"{'preset':19} {'model':6} {'mode':12} {'programs/s':>11} {'ops/s':>9} {'steps/s':>9} {'cost':>6}")
    presets = list(PRESETS) if args.preset == "all" else [args.preset]
    for preset, model in ((p, m) for p in presets for m in ("none", "tiny")):
        config = get_preset(preset).config(model=model)
        run_programs(config, programs[:5], True, True, True, True)  # warm-up
        best: dict[str, tuple[float, int, int]] = {}
        for _ in range(args.repeat):
            for mode, *flags in MODES:
                got = run_programs(config, programs, *flags)
                best[mode] = min(best.get(mode, got), got)
        base = best["bare"][0]
        for mode, *_ in MODES:
            secs, ops, steps = best[mode]
            print(f"{preset:19} {model:6} {mode:12} {len(programs) / secs:11.1f} {ops / secs:9.0f} {steps / secs:9.0f} "
                  f"{secs / base:5.2f}x")


if __name__ == "__main__":
    main()
