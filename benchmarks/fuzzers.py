#!/usr/bin/env python3
"""Fuzzer throughput: programs/s for each fuzzer on one core, and the scaling from 1 to 2 workers.

    python benchmarks/fuzzers.py [--preset NAME] [--seconds S] [--fuzzers hypothesis,random,atheris]

Each measurement is a campaign (``kvaudit.search.campaign.run_campaign``) over a fresh corpus on the clean
engine (no bug switched on, so no time goes to triage): executions and ops over the wall time of
the search. With 2 workers, hypothesis and random run two worker processes; atheris runs
libFuzzer with -fork=2. Worker start-up (a spawned Python importing torch, a few seconds) is part
of the wall time, as it is for a user: use --seconds well above it.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from kvaudit.targets.eut.presets import get_preset
from kvaudit.search.fuzzers import BUILTIN_FUZZERS as FUZZERS
from kvaudit.search.campaign import run_campaign


def measure(preset: str, fuzzer: str, workers: int, seconds: float, seed: int) -> tuple[float, float, int]:
    config = get_preset(preset).config()
    with tempfile.TemporaryDirectory(prefix="kvaudit-bench-") as corpus:
        t0 = time.monotonic()
        result = run_campaign(config, fuzzer, seconds, seed, workers, corpus)
        wall = time.monotonic() - t0
    return result.stats.executions / wall, result.stats.ops / wall, result.stats.executions


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="default")
    ap.add_argument("--seconds", type=float, default=30.0, help="budget per measurement")
    ap.add_argument("--fuzzers", default=",".join(FUZZERS))
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"preset={args.preset} seconds={args.seconds:g} torch={torch.__version__} (clean engine, fresh corpus)")
    print(f"{'fuzzer':11} {'workers':>7} {'programs/s':>11} {'ops/s':>9} {'programs':>9} {'scaling':>8}")
    for fuzzer in args.fuzzers.split(","):
        base = None
        for workers in (1, 2):
            rate, ops, n = measure(args.preset, fuzzer, workers, args.seconds, args.seed)
            base = base or rate
            print(f"{fuzzer:11} {workers:7} {rate:11.1f} {ops:9.0f} {n:9} {rate / base:7.2f}x", flush=True)


if __name__ == "__main__":
    main()
