#!/usr/bin/env python3
"""What each part of the searches' full audit costs, measured by turning it off, and why the engine's own
lines run slower beside the audit.

    python benchmarks/audit_parts.py [--preset default] [--programs 200] [--length 20] [--repeat 5]
    python benchmarks/audit_parts.py --engine-lines [--repeat 5]
    python benchmarks/audit_parts.py --opcodes [--top 30]

The default prints, for the seeded programs of benchmarks/throughput.py (model none, one thread, process CPU
time, best of ``--repeat`` with the modes taking turns), the time of the bare engine, of the searches' full
audit (``audit-sparse``: :func:`kvaudit.search.schedule.search_run`'s flags) and of that audit with one part
left out: the site keys (lean mode's ``Auditor._lean_site`` answering -1 at once: the corpus fuzzer's
features, no detection), the shadow KV tags, the full oracle scans; and the ledger and pool wrappers alone
(no site keys, no shadow, no scans). A part's cost is the full audit's time less the time without it, in
units of the bare run's.

``--engine-lines`` times the engine's own ``Scheduler._last_loc`` (four torch calls and a list; no hook runs
inside it) in the bare engine three ways, taking turns: as is; with work beside it after every step that
touches memory (numpy compares over eight 4,096-unit arrays and a walk of a 3,000-entry dict, about what a
check reads); with a bare Python loop of about the same count after every step (no memory touched). The
garbage collector is off, so its pauses do not land in the timed lines. Prints microseconds per call.

``--opcodes`` counts instead of timing: the Python bytecodes each mode executes (``sys.settrace`` with
``f_trace_opcodes``, one run per mode), the same numbers whatever the machine's load, and with ``--top N``
the N functions whose counts the searches' full audit adds most over the bare engine (the audit's own code,
and the engine's functions its checks call). Most of the audit's cost is interpreter work (callgrind: 72% of
the instructions it adds are libpython's; docs/internals/performance.md, stop 50), so a cut shows here
first, without the 0.2x run-to-run noise of a shared machine's CPU time.
"""

from __future__ import annotations

import argparse
import collections
import gc
import random
import time

import numpy as np
import torch

import bytecodes
from kvaudit.audit import hooks
from kvaudit.program import random_program
from kvaudit.search.bench import run_programs
from kvaudit.search.schedule import CHECK_EVERY
from kvaudit.targets.eut.presets import get_preset

# name: (run_programs flags: audit, oracles, full stacks, shadow, check_every, lean), site keys kept
MODES = {
    "bare": ((False, False, False, False, 1), True),
    "audit-sparse": ((True, True, False, True, CHECK_EVERY, True), True),
    "without site keys": ((True, True, False, True, CHECK_EVERY, True), False),
    "without shadow tags": ((True, True, False, False, CHECK_EVERY, True), True),
    "without full scans": ((True, False, False, True, CHECK_EVERY, True), True),
    "ledger and wrappers only": ((True, False, False, False, CHECK_EVERY, True), False),
}


def _no_site(self) -> int:
    return -1


def parts(config, programs: list, repeat: int) -> None:
    lean_site = hooks.Auditor._lean_site
    run_programs(config, programs[:5], True, True, False, True, CHECK_EVERY)  # warm-up
    best: dict[str, float] = {}
    try:
        for _ in range(repeat):
            for mode, (flags, sites) in MODES.items():
                hooks.Auditor._lean_site = lean_site if sites else _no_site
                best[mode] = min(best.get(mode, float("inf")), run_programs(config, programs, *flags)[0])
    finally:
        hooks.Auditor._lean_site = lean_site
    base, full = best["bare"], best["audit-sparse"]
    print(f"{'mode':26} {'s':>7} {'x bare':>7} {'part costs':>11}")
    for mode, secs in best.items():
        part = f"{(full - secs) / base:+10.2f}x" if mode not in ("bare", "audit-sparse") else ""
        print(f"{mode:26} {secs:7.3f} {secs / base:6.2f}x {part:>11}")


def opcodes(config, programs: list, top: int) -> None:
    lean_site = hooks.Auditor._lean_site
    run_programs(config, programs[:5], True, True, False, True, CHECK_EVERY)  # warm-up (the process's caches)
    run_programs(config, programs[:5], False, False, False, False, 1)
    got: dict[str, collections.Counter] = {}
    try:
        for mode, (flags, sites) in MODES.items():
            hooks.Auditor._lean_site = lean_site if sites else _no_site
            got[mode] = bytecodes.count(run_programs, config, programs, *flags)
    finally:
        hooks.Auditor._lean_site = lean_site
    total = {mode: sum(c.values()) for mode, c in got.items()}
    base, full = total["bare"], total["audit-sparse"]
    print(f"{'mode':26} {'bytecodes':>12} {'x bare':>7} {'part costs':>11}")
    for mode, n in total.items():
        part = f"{(full - n) / base:+10.3f}x" if mode not in ("bare", "audit-sparse") else ""
        print(f"{mode:26} {n:12,} {n / base:6.3f}x {part:>11}")
    if top:
        bytecodes.print_top(got["audit-sparse"], got["bare"], top)


def engine_lines(config, programs: list, repeat: int) -> None:
    import engine_under_test.scheduler as scheduler
    from kvaudit.targets.eut.target import EutTarget

    spent = [0.0, 0]
    last_loc, step = scheduler.Scheduler._last_loc, EutTarget.step

    def timed_last_loc(self, *a):
        t = time.perf_counter()
        try:
            return last_loc(self, *a)
        finally:
            spent[0] += time.perf_counter() - t
            spent[1] += 1

    arrays = [np.zeros(4096, dtype=np.int64) for _ in range(8)]
    table = {i: str(i) for i in range(3000)}
    beside = ["none"]

    def step_with_work(self) -> None:
        step(self)
        if beside[0] == "memory":
            for a in arrays:
                (a != arrays[0]).nonzero()
            sum(len(v) for v in table.values())
        elif beside[0] == "loop":
            for _ in range(3000):
                pass

    scheduler.Scheduler._last_loc, EutTarget.step = timed_last_loc, step_with_work
    gc.disable()
    best: dict[str, float] = {}
    try:
        for _ in range(repeat):
            for work in ("none", "memory", "loop"):
                beside[0], spent[:] = work, [0.0, 0]
                run_programs(config, programs, False, False, False, False, 1)
                best[work] = min(best.get(work, float("inf")), spent[0] * 1e6 / max(1, spent[1]))
    finally:
        gc.enable()
        scheduler.Scheduler._last_loc, EutTarget.step = last_loc, step
    for work, us in best.items():
        print(f"_last_loc, work beside it: {work:7} {us:7.1f} us per call ({us / best['none']:.2f}x)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="default")
    ap.add_argument("--programs", type=int, default=200)
    ap.add_argument("--length", type=int, default=20)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--engine-lines", action="store_true", help="time the engine's own lines beside other work")
    bytecodes.add_arguments(ap)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rng = random.Random(args.seed)
    programs = [random_program(rng, args.length) for _ in range(args.programs)]
    config = get_preset(args.preset).config(model="none")
    if args.opcodes:
        opcodes(config, programs, args.top)
    else:
        (engine_lines if args.engine_lines else parts)(config, programs, args.repeat)


if __name__ == "__main__":
    main()
