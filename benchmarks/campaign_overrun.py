#!/usr/bin/env python3
"""How far past its budget a campaign's workers search when every finding is suppressed, the hang included
(the minivllm plugin's ``minivllm-tight`` with ``abort-leak``: the leaked blocks keep a request waiting, so
``idle()`` never drains; stop 56 measured 1.5-2.3 s past a 5 s budget).

    python benchmarks/campaign_overrun.py [--max-time 5] [--workers 2] [--fuzzer corpus] [--seed 2]

Run from the checkout to measure (its ``examples/`` and ``kvaudit/``). Prints the wall time (the workers'
spawn and imports included: start-up, not search time) and, per worker, the seconds from its "ready" message
(first engine built: the budget's clock starts) to its "done" message, minus the budget. Start the
checkouts to compare together, on the same machine: the figures are wall seconds and move with the load."""

import argparse
import os
import sys
import tempfile
import time

SUPPRESS = ('[[suppress]]\nkind = "leak"\npool = "block_pool"\nreason = "known"\n'
            '[[suppress]]\nkind = "hang"\nreason = "known"\n')


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-time", type=float, default=5.0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--fuzzer", default="corpus")
    ap.add_argument("--seed", type=int, default=2)
    args = ap.parse_args()
    sys.path.insert(0, os.getcwd())
    os.environ["KVAUDIT_PLUGINS"] = "examples.minivllm.target"  # (the workers import it too)
    import examples.minivllm.target  # noqa: F401
    from kvaudit.app.configs import select_config
    from kvaudit.search import campaign

    work = tempfile.mkdtemp(prefix="campaign-overrun-")
    sup = os.path.join(work, "suppress.toml")
    with open(sup, "w") as f:
        f.write(SUPPRESS)
    config = select_config("minivllm-tight", ("abort-leak",), "none", "cpu", None, "minivllm")
    marks: dict[str, dict[int, float]] = {}
    run_workers = campaign._run_workers

    def timed(specs, handle):
        def each(msg):
            if msg[0] in ("ready", "done"):
                marks.setdefault(msg[0], {})[msg[1]] = time.monotonic()
            return handle(msg)
        return run_workers(specs, each)

    campaign._run_workers = timed  # (one worker searches in this process: use --workers 2 or more)
    started = time.monotonic()
    result = campaign.run_campaign(config, args.fuzzer, args.max_time, args.seed, args.workers,
                                   os.path.join(work, "corpus"), sup)
    wall = time.monotonic() - started
    over = {i: round(marks["done"][i] - t - args.max_time, 2) for i, t in sorted(marks.get("ready", {}).items())}
    print(f"{args.fuzzer}, --max-time {args.max_time:g}, {args.workers} workers: wall {wall:.2f} s; per worker, "
          f"ready to done minus the budget: {over} s; new {sorted(result.new)}, {result.stats.executions} executions")


if __name__ == "__main__":
    main()
