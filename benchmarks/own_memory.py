#!/usr/bin/env python3
"""kvaudit's own memory over a long search: does it grow with executions?

    python benchmarks/own_memory.py [--preset default] [--fuzzer random-96] [--seconds 300] [--every 30]
        [--corpus DIR] [--tracemalloc N] [--seed 1]
    python benchmarks/own_memory.py --workers 2 [--preset default] [--seconds 300] [--every 30]

In process (the default): the start-up ``kvaudit fuzz`` does (the first engine, the fuzzer's warm-up,
``fuzzers.settle_heap()``), then one search of ``--seconds`` on the clean engine (no bug), sampling every
``--every`` seconds: executions, RSS (MB), the objects the collector tracks after a full collection
(``len(gc.get_objects())``, the frozen start-up heap not counted), the interpreter's allocated blocks
(``sys.getallocatedblocks()``: untracked objects too, strings, ints, tuples of ints), the types that grew most
since the first sample and, for the corpus fuzzer, its features and programs. ``--corpus DIR``: a one-worker
campaign in DIR (the corpus fuzzer keeps its programs there).
``--tracemalloc N``: trace allocations from the first sample and print the N source lines that grew most
(slows the search several times).

``--workers N``: a campaign of N worker processes (``kvaudit fuzz --workers N --corpus TMP``) as a child
process; samples the RSS of the parent and of each worker (kvaudit's objects cannot be counted from outside).
"""

from __future__ import annotations

import argparse
import gc
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_mb(pid: int | str = "self") -> float:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * PAGE / 1e6


def children(pid: int) -> list[int]:
    kids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        kids.append(int(d))
            except (OSError, ValueError, IndexError):
                pass
    return kids


def types() -> Counter:
    return Counter(type(o).__name__ for o in gc.get_objects())


def in_process(args) -> None:
    from kvaudit.audit import runner
    from kvaudit.search import fuzzers
    from kvaudit.search.fuzz import FuzzStats
    from kvaudit.targets.eut.presets import get_preset

    config = get_preset(args.preset).config()
    runner.warm_up(config)
    fuzzers.get(args.fuzzer).warm_up()
    frozen = fuzzers.settle_heap()
    first: list = []
    snap: list = []
    last = [0.0]

    def sample(stats: FuzzStats, force: bool = False) -> None:
        if not force and time.monotonic() - last[0] < args.every:
            return
        gc.collect()
        kinds = types()
        n = sum(kinds.values())
        if not first:
            first.append(kinds)
            if args.tracemalloc:
                import tracemalloc

                tracemalloc.start(8)
                snap.append(tracemalloc.take_snapshot())
        grew = (kinds - first[0]).most_common(6)
        print(f"{stats.elapsed:7.0f}s executions={stats.executions:7d} rss={rss_mb():7.1f} MB objects={n:8d} "
              f"blocks={sys.getallocatedblocks():8d}  "
              f"grew since first: {', '.join(f'{k}+{v}' for k, v in grew) or '-'}"
              + (f"  ({stats.coverage})" if stats.coverage else ""), flush=True)
        last[0] = time.monotonic()

    print(f"preset {args.preset}, fuzzer {args.fuzzer}, {args.seconds:.0f} s; start-up objects frozen: {frozen}",
          flush=True)
    stats = FuzzStats()
    sample(stats, force=True)
    if args.corpus:
        from kvaudit.search.campaign import run_campaign

        result = run_campaign(config, args.fuzzer, args.seconds, args.seed, 1, args.corpus,
                              on_progress=lambda s: sample(s))
        stats = result.stats
    else:
        found = fuzzers.get(args.fuzzer).search(config, args.seconds, args.seed, stats,
                                                fuzzers.Search(on_progress=sample))
        if found is not None:
            print("a finding on the clean engine:", [f.signature for f in found[1]])
    sample(stats, force=True)
    if snap:
        import tracemalloc

        for d in tracemalloc.take_snapshot().compare_to(snap[0], "traceback")[:args.tracemalloc]:
            print(f"{d.size_diff / 1e3:+9.1f} KB {d.count_diff:+7d} blocks  " + " <- ".join(
                f"{os.path.basename(fr.filename)}:{fr.lineno}" for fr in d.traceback))


def campaign(args) -> None:
    corpus = args.corpus or tempfile.mkdtemp(prefix="kvaudit-own-memory-")
    cmd = [sys.executable, "-m", "kvaudit", "fuzz", "--preset", args.preset, "--workers", str(args.workers),
           "--corpus", corpus, "--max-time", str(args.seconds), "--seed", str(args.seed)]
    print(" ".join(cmd), flush=True)
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    t0 = time.monotonic()
    while p.poll() is None:
        try:
            kids = sorted(children(p.pid))
            workers = [f"{rss_mb(k):7.1f}" for k in kids]
            print(f"{time.monotonic() - t0:7.0f}s parent rss={rss_mb(p.pid):7.1f} MB  workers rss (MB): "
                  f"{' '.join(workers) or '-'}", flush=True)
        except OSError:
            pass
        try:
            p.wait(timeout=args.every)
        except subprocess.TimeoutExpired:
            pass
    print(f"exit {p.returncode}; corpus {corpus}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="default")
    ap.add_argument("--fuzzer", default="random-96")
    ap.add_argument("--seconds", type=float, default=300.0)
    ap.add_argument("--every", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--corpus", default=None)
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--tracemalloc", type=int, default=0)
    args = ap.parse_args()
    if args.workers > 1:
        campaign(args)
    else:
        in_process(args)


if __name__ == "__main__":
    main()
