#!/usr/bin/env python3
"""Throughput of the real-SGLang target (``--target sglang``): programs/s per preset and tree core.

    python benchmarks/sglang_throughput.py [--programs N] [--length L] [--repeat K] [--preset P ...]
    python benchmarks/sglang_throughput.py --opcodes [--top N] [--preset P ...]

For each real-target preset and both tree cores, the same seeded random programs (with the
arguments the preset gives meaning to: ``config.program_features``) run in three modes: "bare" (SGLang driven, no hooks), "hooks" (the ledger: every alloc, free and
lock event recorded) and "audit" (hooks plus the per-step oracles: reachability, the accounting
identity, the free-list replay check, lock balance at idle) after every step; "audit-sparse" is the same
oracles on the searches' schedule (``kvaudit.search.schedule.CHECK_EVERY``: every K steps, at idle and at
the program's end), the fuzzers' mode. One core
(torch.set_num_threads(1)), process CPU time, best of --repeat rounds with the modes taking turns.
Import and build costs are printed apart (they are paid once per process and once per program;
"build ms" is one target's construction: SGLang's objects for the preset and the driver).
``--opcodes``: instead, count the Python bytecodes of the bare and audit-sparse modes per preset and tree core
(one run each, benchmarks/bytecodes.py: the same numbers whatever the machine's load) and with ``--top N`` the
N functions the audit adds most to.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

import bytecodes
from kvaudit.search.bench import best_times, build_ms
from kvaudit.search.schedule import CHECK_EVERY
from kvaudit.program import random_program
from kvaudit.targets.sglang.config import SGLANG_PRESETS

MODES = (("bare", False, False, False), ("hooks", True, False, False), ("audit", True, True, False),
         ("audit-sparse", True, True, False, CHECK_EVERY))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--programs", type=int, default=100)
    ap.add_argument("--length", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--preset", action="append", choices=list(SGLANG_PRESETS),
                    help="only this preset (repeatable; default: all)")
    bytecodes.add_arguments(ap)
    args = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    from kvaudit.targets.sglang.boot import load
    load()
    print(f"import of SGLang's memory manager: {time.perf_counter() - t0:.2f} s")
    if not args.opcodes:
        print(f"{args.programs} programs of {args.length} ops, best of {args.repeat}, one core\n")
        print("| preset | tree core | bare programs/s | hooks programs/s | audit programs/s | audit ops/s | "
              "audit / bare time | audit-sparse / bare time | build ms |")
        print("|---|---|---|---|---|---|---|---|---|")
    for name, preset in SGLANG_PRESETS.items():
        if args.preset and name not in args.preset:
            continue
        rng = random.Random(args.seed)
        features = preset.config().program_features
        progs = [random_program(rng, args.length, max_prompt=40, features=features) for _ in range(args.programs)]
        for core in ("rust", "python"):
            config = preset.config(tree_core=core)
            if args.opcodes:
                bytecodes.compare(f"{name} ({core})", config, progs, MODES[0], MODES[3], args.top)
                continue
            ms = build_ms(config)  # the preset's objects and driver (a mode builds more than the pools)
            best, ops = best_times(config, progs, MODES, args.repeat)
            rate = {m: args.programs / s for m, s in best.items()}
            print(f"| {name} | {core} | {rate['bare']:.0f} | {rate['hooks']:.0f} | {rate['audit']:.0f} | "
                  f"{ops / best['audit']:.0f} | {best['audit'] / best['bare']:.2f}x | "
                  f"{best['audit-sparse'] / best['bare']:.2f}x | {ms:.1f} |", flush=True)


if __name__ == "__main__":
    main()
