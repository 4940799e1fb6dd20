#!/usr/bin/env python3
"""Throughput of the real-vLLM target (``--target vllm``): programs/s per preset.

    python benchmarks/vllm_throughput.py [--programs N] [--length L] [--repeat K] [--preset P ...]

For each preset the same seeded random programs (with the capabilities the preset has) run in three
modes: "bare" (vLLM driven, no hooks), "hooks" (the ledger: every ``get_new_blocks``/``touch``/
``free_blocks`` recorded) and "audit" (hooks plus the per-step oracles: reachability, the accounting
identity, the free-list replay and vLLM's own invariants: ref counts, free queue, hash map, events; and
the shadow KV content tags, checked on every read a step implies), the fuzzers' mode. One core
(``torch.set_num_threads(1)``), process CPU time, best of ``--repeat`` rounds with the modes taking turns.
The import of vLLM and one target's build are printed apart (paid once per process and once per program).
"""

from __future__ import annotations

import argparse
import random

import torch

from kvaudit.program import random_program
from kvaudit.program.schema import max_prompt
from kvaudit.search.bench import best_times, build_ms
from kvaudit.targets.vllm.config import VLLM_PRESETS

MODES = (("bare", False, False, False), ("hooks", True, False, False), ("audit", True, True, True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--programs", type=int, default=100)
    ap.add_argument("--length", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--preset", action="append", choices=list(VLLM_PRESETS),
                    help="only this preset (repeatable; default: all)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from kvaudit.targets import program_features
    from kvaudit.targets.vllm.boot import load
    v = load()
    print(f"import of vLLM {v.version}'s v1 scheduler and KV-cache manager: {v.import_s:.2f} s")
    print(f"{args.programs} programs of {args.length} ops, best of {args.repeat}, one core\n")
    print("| preset | bare programs/s | hooks programs/s | audit programs/s | audit ops/s | audit / bare time | "
          "build ms |")
    print("|---|---|---|---|---|---|---|")
    for name, preset in VLLM_PRESETS.items():
        if args.preset and name not in args.preset:
            continue
        config = preset.config()
        rng = random.Random(args.seed)
        features = program_features(config)
        progs = [random_program(rng, args.length, max_prompt=max_prompt(config.context_len), features=features)
                 for _ in range(args.programs)]
        ms = build_ms(config)
        best, ops = best_times(config, progs, MODES, args.repeat)
        rate = {m: args.programs / s for m, s in best.items()}
        print(f"| {name} | {rate['bare']:.0f} | {rate['hooks']:.0f} | {rate['audit']:.0f} | "
              f"{ops / best['audit']:.0f} | {best['audit'] / best['bare']:.2f}x | {ms:.1f} |", flush=True)


if __name__ == "__main__":
    main()
