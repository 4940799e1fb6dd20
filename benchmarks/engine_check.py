#!/usr/bin/env python3
"""Would the engine's own SGLang-style check have caught each zoo bug? And when, next to kvaudit?

    python benchmarks/engine_check.py [--corpus corpora/regressions] [--markdown]

For every regression file it replays the minimized program twice with the bug switched on:
once under kvaudit (the step of its first finding), and once on the bare engine running
``check_memory()`` after every scheduler step, as SGLang does: the busy identity, or the idle one
when the engine is idle. SGLang only raises at idle (the busy check is opt-in and only logs), so the
table gives the first failing idle check and the first failing check of any kind.
"""

from __future__ import annotations

import argparse
import glob
import os

from kvaudit import replay
from kvaudit.targets import registry
from kvaudit.audit.runner import execute


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", default=os.path.join(os.path.dirname(__file__), "..", "corpora", "regressions"))
    args = ap.parse_args()
    rows = []
    for path in sorted(glob.glob(os.path.join(args.corpus, "*.json"))):
        config, program, _, _ = replay.load(path)
        ex = execute(config, program)
        kv = ex.findings[0] if ex.findings else None
        idle_step, any_step = registry.get("eut").engine_check(config, program)
        name = os.path.basename(path)[:-5]
        rows.append((name, kv.kind if kv else "-", kv.step if kv else None, idle_step, any_step))
    print("| bug | kvaudit finding | kvaudit step | engine idle check fails at step | engine busy/idle check fails at step |")
    print("|---|---|---|---|---|")
    for name, kind, kstep, istep, astep in rows:
        def fmt(x):
            return "never" if x is None else str(x)
        print(f"| `{name}` | {kind} | {fmt(kstep)} | {fmt(istep)} | {fmt(astep)} |")


if __name__ == "__main__":
    main()
