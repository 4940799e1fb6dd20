#!/usr/bin/env python3
"""Executions per second of a campaign with 1, 2 and 4 workers, directory-only and through a local Redis
(``kvaudit fuzz --db``), side by side: the cost of the fleet's sharing per execution.

    python benchmarks/fleet_scaling.py [--seconds 20] [--workers 1,2,4] [--fuzzer corpus] [--preset streaming-session]
        [--json out.json]

Starts its own ``redis-server`` on a free loopback port (Debian's package; none: exits 2). Each run is
a campaign (:func:`kvaudit.search.campaign.run_campaign`) over a fresh temporary corpus on the clean
engine (no bug: no triage), for ``--seconds`` each; exec/s is the workers' executions over the run's
wall time (worker start-up included, the same for both). Runs alternate directory / Redis per worker
count. On a machine with fewer cores than workers the workers share cores (say so with the figures).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--workers", default="1,2,4")
    ap.add_argument("--fuzzer", default="corpus")
    ap.add_argument("--preset", default="streaming-session")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    binary = shutil.which("redis-server")
    if binary is None:
        print("no redis-server here: apt-get install redis-server", file=sys.stderr)
        return 2
    from kvaudit.search.campaign import run_campaign
    from kvaudit.targets.eut.presets import get_preset

    config = get_preset(args.preset).config()
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvaudit-fleet-") as tmp:
        port = free_port()
        server = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                                   "no", "--dir", tmp], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            time.sleep(0.5)
            url = f"redis://127.0.0.1:{port}/0"
            for n in [int(x) for x in args.workers.split(",")]:
                for mode in ("directory", "redis"):
                    corpus = tempfile.mkdtemp(dir=tmp)
                    t0 = time.monotonic()
                    result = run_campaign(config, args.fuzzer, args.seconds, 1, n, corpus,
                                          db=url if mode == "redis" else None, campaign=f"scale-{n}")
                    wall = time.monotonic() - t0
                    rate = result.stats.executions / wall
                    rows.append({"workers": n, "mode": mode, "executions": result.stats.executions,
                                 "seconds": round(wall, 1), "exec_per_s": round(rate, 1)})
                    print(f"{n} worker(s), {mode:9s}: {result.stats.executions:6d} executions in {wall:5.1f}s = "
                          f"{rate:7.1f} exec/s", flush=True)
        finally:
            server.terminate()
            server.wait()
    print("\n| workers | directory exec/s | Redis exec/s | Redis vs directory |")
    print("|---|---|---|---|")
    for n in sorted({r["workers"] for r in rows}):
        d = next(r for r in rows if r["workers"] == n and r["mode"] == "directory")
        r = next(r for r in rows if r["workers"] == n and r["mode"] == "redis")
        print(f"| {n} | {d['exec_per_s']} | {r['exec_per_s']} | {100 * (r['exec_per_s'] / d['exec_per_s'] - 1):+.1f}% |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"cpus": os.cpu_count(), "fuzzer": args.fuzzer, "preset": args.preset,
                       "seconds": args.seconds, "rows": rows}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
