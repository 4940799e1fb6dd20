#!/usr/bin/env python3
"""Time to bug on the zoo under the per-step audit (K=1) and the searches' sparse schedule, side by side.

    python benchmarks/sparse_schedule.py [--k 1,16] [--fuzzer corpus] [--seeds 1,2,3] [--budget 60]

For every zoo bug, seed and K (``kvaudit.search.schedule.CHECK_EVERY``), one ``kvaudit bench`` trial
(:func:`kvaudit.search.bench.run_trial`: a search with the same seed, then triage of its hit); the Ks take
turns per (bug, seed) so that a slow phase of a shared machine falls on both. Prints executions to the
first hit, seconds to it (wall clock, the search's own clock) and the first finding's signature per K,
then per K: bugs found, and the geometric means of executions and seconds over the bugs every K found.
"""

from __future__ import annotations

import argparse
import math
import statistics

import torch

from kvaudit.search import bench, schedule


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k", default=f"1,{schedule.CHECK_EVERY}", help="the schedules, comma separated")
    ap.add_argument("--fuzzer", default="corpus")
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--budget", type=float, default=60.0, help="seconds per trial")
    ap.add_argument("--bugs", default="", help="comma separated (default: the whole zoo)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    ks, seeds = [int(k) for k in args.k.split(",")], [int(s) for s in args.seeds.split(",")]
    bugs = args.bugs.split(",") if args.bugs else sorted(bench._eut().bugs())
    print(f"fuzzer={args.fuzzer} seeds={args.seeds} budget={args.budget:g}s ks={args.k}")
    print(f"{'bug':30} {'seed':>4} " + " ".join(f"{'K=' + str(k) + ' execs':>11} {'s':>6}" for k in ks) + "  same")
    rows: dict[tuple[str, int], dict[int, bench.Trial]] = {}
    for bug in bugs:
        for seed in seeds:
            got = rows[bug, seed] = {}
            for k in ks:
                schedule.CHECK_EVERY = k
                got[k] = bench.run_trial(bug, args.fuzzer, seed, args.budget)
            cells = " ".join(f"{t.executions or '-':>11} {t.seconds or math.nan:6.2f}" for t in got.values())
            same = len({(t.success, t.executions) for t in got.values()}) == 1
            print(f"{bug:30} {seed:4} {cells}  {'yes' if same else 'no'}"
                  + "".join(f"  [K={k}: {t.note}]" for k, t in got.items() if t.note), flush=True)
    _summary(rows, bugs, seeds, ks)


def _summary(rows, bugs, seeds, ks) -> None:
    print(f"\n{'K':>6} {'bugs found':>10} {'trials found':>12} {'geomean execs':>14} {'geomean s':>10}")
    both = [b for b in bugs if all(statistics.median([rows[b, s][k].executions or math.inf for s in seeds])
                                   < math.inf for k in ks)]
    for k in ks:
        found = sum(any(rows[b, s][k].success for s in seeds) for b in bugs)
        trials = sum(rows[b, s][k].success for b in bugs for s in seeds)
        med_e = [statistics.median([rows[b, s][k].executions or math.inf for s in seeds]) for b in both]
        med_s = [statistics.median([rows[b, s][k].seconds or math.inf for s in seeds]) for b in both]
        gm = (lambda v: math.exp(sum(map(math.log, v)) / len(v)) if v else math.nan)
        print(f"{k:6} {found:>6}/{len(bugs):<3} {trials:>8}/{len(bugs) * len(seeds):<3} {gm(med_e):14.1f} "
              f"{gm(med_s):10.2f}   (medians per bug over the seeds; geomeans over the {len(both)} bugs all K found)")


if __name__ == "__main__":
    main()
