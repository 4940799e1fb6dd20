#!/usr/bin/env python3
"""Where the searches' full audit spends its time: cProfile of the sparse audit against the bare engine.

    python benchmarks/profile_sparse.py [--preset default] [--programs 200] [--length 20] [--rounds 3]

Runs the same seeded programs as benchmarks/throughput.py (model none) in two modes, ``bare`` and
``audit-sparse`` (the searches' schedule, :func:`kvaudit.search.schedule.search_run`'s flags), each under
cProfile with the process CPU clock, the modes taking turns for ``--rounds`` rounds; the round with the
least profiled time per mode is kept. Each kvaudit function's time is its own plus that of the library and
built-in calls it makes directly; they are summed per part of the audit (``PARTS``) and the bare run's
(the runner and the target's driver run there too) is subtracted. Prints per part: calls of its entry
points, profiled seconds, microseconds per call and its share of the audit's extra time. cProfile inflates
small Python calls: the shares, not the seconds, are what it is read for.
"""

from __future__ import annotations

import argparse
import cProfile
import collections
import pstats
import random
import time

import torch

from kvaudit.program import random_program
from kvaudit.search import schedule
from kvaudit.search.bench import run_programs
from kvaudit.targets.eut.presets import get_preset

# part -> (name patterns "file.py:function" or "/folder/" of the kvaudit functions it holds, its entry points)
PARTS = {
    "site capture": (["hooks.py:capture_site", "hooks.py:_intern", "hooks.py:_code_info", "hooks.py:_lean_site"],
                     ["capture_site"]),
    "lock events": (["hooks.py:_lock_event", "observer.py:inc_wrapper", "observer.py:dec_wrapper", "locks.py:"],
                    ["inc_wrapper", "dec_wrapper"]),
    "pool wrappers": (["wrappers.py:"], ["alloc_wrapper", "free_wrapper", "group_end_wrapper", "alloc_rows",
                                         "free_rows", "clear_wrapper"]),
    "ledger (on_alloc, on_free)": (["ledger.py:"], ["on_alloc", "on_free"]),
    "shadow tags": (["observer.py:batch_wrapper", "shadow.py:", "observer.py:transfer_wrapper",
                     "observer.py:check_read", "observer.py:forward_wrapper"], ["batch_wrapper"]),
    "insert check": (["base.py:insert_wrapper", "observer.py:measure"], ["insert_wrapper"]),
    "full oracle scans": (["/oracles/", "observer.py:", "base.py:records_roots", "base.py:slot_pages",
                           "base.py:kv_length_problems", "base.py:check_target", "engine_check.py:", "memstate.py:",
                           "deltas.py:", "target.py:progress", "target.py:units_of_rows", "target.py:quiescence",
                           "target.py:flushed", "target.py:metrics_check", "target.py:stalled", "target.py:live_rids"],
                          ["check"]),
    "runner per step and op": (["runner.py:", "hooks.py:step", "hooks.py:op_index", "target.py:is_idle",
                                "target.py:wrapper"], ["_step"]),
    "per program (install, uninstall)": (["hooks.py:__init__", "observer.py:install", "base.py:install",
                                          "wrappers.py:uninstall", "wrappers.py:_wrap", "hooks.py:_class_file"],
                                         ["__init__"]),
}


def _is_kvaudit(f) -> bool:
    return "/kvaudit/" in f[0]


def _part(f) -> str:
    name = f"{f[0]}:{f[2]}"
    return next((p for p, (pats, _) in PARTS.items() if any(x in name for x in pats)), "other kvaudit")


def parts(stats: dict) -> tuple[collections.Counter, collections.Counter]:
    """(seconds, entry-point calls) per part of one profile's ``pstats`` table."""
    secs, calls = collections.Counter(), collections.Counter()
    for f, (_, nc, tt, _, callers) in stats.items():
        if _is_kvaudit(f):
            secs[_part(f)] += tt
            part = _part(f)
            if part != "other kvaudit" and f[2] in PARTS[part][1]:
                calls[part] += nc
        elif f[0] == "~" or "site-packages" in f[0] or "/lib/python3" in f[0]:
            for c, (_, _, _, ct) in callers.items():  # a library call's time goes to its kvaudit caller
                if _is_kvaudit(c):
                    secs[_part(c)] += ct
    return secs, calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="default")
    ap.add_argument("--programs", type=int, default=200)
    ap.add_argument("--length", type=int, default=20)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rng = random.Random(args.seed)
    programs = [random_program(rng, args.length) for _ in range(args.programs)]
    config = get_preset(args.preset).config(model="none")
    run_programs(config, programs[:5], True, True, True, True)  # warm-up
    modes = {"bare": (False, False, False, False, 1), "audit-sparse": (True, True, False, True, schedule.CHECK_EVERY)}
    best: dict[str, pstats.Stats] = {}
    for _ in range(args.rounds):
        for mode, flags in modes.items():
            prof = cProfile.Profile(time.process_time)
            prof.runcall(run_programs, config, programs, *flags)
            st = pstats.Stats(prof)
            if mode not in best or st.total_tt < best[mode].total_tt:
                best[mode] = st
    (bare, _), (sparse, calls) = parts(best["bare"].stats), parts(best["audit-sparse"].stats)
    extra = best["audit-sparse"].total_tt - best["bare"].total_tt
    print(f"profiled (process CPU): bare {best['bare'].total_tt:.3f} s, audit-sparse "
          f"{best['audit-sparse'].total_tt:.3f} s, extra {extra:.3f} s")
    print(f"{'part':34} {'calls':>8} {'s':>7} {'us/call':>8} {'share':>6}")
    for part, s in sorted(((p, sparse[p] - bare.get(p, 0.0)) for p in sparse), key=lambda x: -x[1]):
        n = calls.get(part, 0)
        print(f"{part:34} {n:8d} {s:7.3f} {s / n * 1e6 if n else float('nan'):8.2f} {s / extra:6.1%}")


if __name__ == "__main__":
    main()
