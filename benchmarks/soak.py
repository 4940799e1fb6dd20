#!/usr/bin/env python3
"""Random soak of the engine alone: every preset, no bug switched on, the engine's own checks
(``check_memory()`` and ``check_integrity()``) after every scheduler step.

    python benchmarks/soak.py [--programs 2000] [--length 20] [--preset NAME|all] [--seed 1]

Exits 1 and prints the failing program if any check fails. kvaudit is used only to generate the
programs (kvaudit.program.random_program) and to drive them (the eut target); no hooks run.
"""

from __future__ import annotations

import argparse
import random
import sys
import time

from kvaudit.targets.eut.presets import PRESETS, get_preset
from kvaudit.program import ContinueGeneration, Idle, Step, format_program, random_program
from kvaudit.targets import program_features
from kvaudit.targets.eut import EutTarget

MAX_IDLE_STEPS = 2000


def soak(preset: str, programs: int, length: int, seed: int) -> tuple[int, int]:
    rng = random.Random(seed)
    steps = 0
    features = program_features(get_preset(preset).config())  # transfer_fail on PD decode
    for i in range(programs):
        prog = random_program(rng, length, max_prompt=96, features=features)
        target = EutTarget(get_preset(preset).config())
        eng = target.engine
        try:
            for op in prog:
                if isinstance(op, Idle) and target.paused:  # as the runner: idle() ends a pause first
                    target.apply(ContinueGeneration())
                if isinstance(op, (Step, Idle)):
                    for _ in range(op.n if isinstance(op, Step) else MAX_IDLE_STEPS):
                        idle = target.is_idle()
                        target.step()
                        bad = [c.message() for c in eng.check_memory() if not c.ok]
                        if bad:
                            raise AssertionError("; ".join(bad))
                        eng.check_integrity()
                        if isinstance(op, Idle) and idle:
                            break
                    else:
                        if isinstance(op, Idle):
                            raise AssertionError("idle() did not reach idle")
                else:
                    target.apply(op)
        except Exception as e:  # a failed check or an engine crash
            print(f"{preset}: program {i} failed: {type(e).__name__}: {e}\n{format_program(prog)}")
            sys.exit(1)
        steps += target.steps
    return programs, steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--programs", type=int, default=2000)
    ap.add_argument("--length", type=int, default=20)
    ap.add_argument("--preset", default="all")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    presets = list(PRESETS) if args.preset == "all" else [args.preset]
    for p in presets:
        t0 = time.perf_counter()
        n, steps = soak(p, args.programs, args.length, args.seed)
        print(f"{p:19} programs={n} steps={steps} clean in {time.perf_counter() - t0:.1f}s", flush=True)


if __name__ == "__main__":
    main()
