#!/usr/bin/env python3
"""Throughput before and after a change, side by side in one run: the modes of
benchmarks/throughput.py on the same programs, for this checkout and for a git revision.

    python benchmarks/throughput_compare.py --before REV [--preset NAME] [--programs N] [--length L] [--rounds K]

The programs are drawn once (this checkout's generator, seeded) and written in the replay format
both versions read (``kvaudit.program/1``), so both run exactly the same ops. ``REV`` is checked out
into a temporary git worktree. Each round runs one measuring process per version, alternating, so
a slow phase of a shared machine falls on both; each process times every mode once (process CPU
time, one thread) and the table keeps the best of the rounds. ``after/before`` above 1.05 means a
slowdown beyond 5%.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = ("bare", "ledger", "hooks", "hooks-full", "audit", "audit-full")

# Runs inside each version's checkout: the timing loop of benchmarks/throughput.py, one pass per mode.
MEASURE = r"""
import json, sys, torch
torch.set_num_threads(1)
try:  # (the presets moved from the engine to kvaudit in issue 19)
    from kvaudit.targets.eut.presets import get_preset
except ImportError:
    from engine_under_test import get_preset
from kvaudit.program import program_from_json
try:
    from kvaudit.search.bench import run_programs
except ImportError:
    from kvaudit.bench import run_programs
progs_file, preset, model = sys.argv[1:4]
programs = [program_from_json(p) for p in json.load(open(progs_file))]
config = get_preset(preset).config(model=model)
run_programs(config, programs[:5], True, True, True, True)  # warm-up
flags = {"bare": (False, False, False, False), "ledger": (True, False, False, False),
         "hooks": (True, False, False, True), "hooks-full": (True, False, True, True),
         "audit": (True, True, False, True), "audit-full": (True, True, True, True)}
print(json.dumps({m: run_programs(config, programs, *f)[0] for m, f in flags.items()}))
"""


def measure(root: str, progs: str, preset: str, model: str) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": root}
    out = subprocess.run([sys.executable, "-c", MEASURE, progs, preset, model], cwd=root, env=env,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True, help="git revision to compare against (e.g. a commit before the change)")
    ap.add_argument("--preset", default="pd-decode-hisparse")
    ap.add_argument("--model", default="none", choices=("none", "tiny"))
    ap.add_argument("--programs", type=int, default=200)
    ap.add_argument("--length", type=int, default=10)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    sys.path.insert(0, ROOT)
    from kvaudit.program import program_to_json, random_program

    rng = random.Random(args.seed)
    programs = [program_to_json(random_program(rng, args.length)) for _ in range(args.programs)]
    with tempfile.TemporaryDirectory(prefix="kvaudit-compare-") as tmp:
        progs = os.path.join(tmp, "programs.json")
        json.dump(programs, open(progs, "w"))
        before = os.path.join(tmp, "before")
        subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", "-q", before, args.before], check=True)
        try:
            best: dict[str, dict[str, float]] = {"before": {}, "after": {}}
            for _ in range(args.rounds):
                for name, root in (("before", before), ("after", ROOT)):
                    for mode, secs in measure(root, progs, args.preset, args.model).items():
                        best[name][mode] = min(best[name].get(mode, secs), secs)
        finally:
            subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", before], check=False)
    print(f"preset={args.preset} model={args.model} programs={args.programs} length={args.length} "
          f"seed={args.seed} rounds={args.rounds} before={args.before}")
    print(f"{'mode':12} {'before prog/s':>14} {'after prog/s':>13} {'after/before time':>18}")
    for mode in MODES:
        b, a = best["before"][mode], best["after"][mode]
        print(f"{mode:12} {args.programs / b:14.1f} {args.programs / a:13.1f} {a / b:17.3f}x")


if __name__ == "__main__":
    main()
