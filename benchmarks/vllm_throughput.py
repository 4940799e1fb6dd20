#!/usr/bin/env python3
"""Throughput of the real-vLLM target (``--target vllm``): programs/s per preset.

    python benchmarks/vllm_throughput.py [--programs N] [--length L] [--repeat K] [--preset P ...] [--profile]
    python benchmarks/vllm_throughput.py --opcodes [--top N] [--preset P ...]

For each preset the same seeded random programs (with the capabilities the preset has) run in four
modes: "bare" (vLLM driven, no hooks), "hooks" (the ledger: every ``get_new_blocks``/``touch``/
``free_blocks`` recorded) and "audit" (hooks plus the per-step oracles: reachability, the accounting
identity, the free-list replay and vLLM's own invariants: ref counts, free queue, hash map, events; and
the shadow KV content tags, checked on every read a step implies) after every step; "audit-sparse" is the
same on the searches' schedule (``kvaudit.search.schedule.CHECK_EVERY`` steps between full checks, and a
check after every step while the target is transient: ``Target.transient``), the fuzzers' mode. One core
(``torch.set_num_threads(1)``), process CPU time, best of ``--repeat`` rounds with the modes taking turns.
The import of vLLM and one target's build are printed apart (paid once per process and once per program).
``--profile``: instead, cProfile the audit mode once per preset and print where a check goes (:data:`PARTS`:
cumulative seconds, calls and microseconds a call of each part, against the whole run's profiled seconds).
``--opcodes``: instead, count the Python bytecodes of the bare and audit-sparse modes per preset (one run each,
benchmarks/bytecodes.py: the same numbers whatever the machine's load) and with ``--top N`` the N functions
the audit adds most to.
"""

from __future__ import annotations

import argparse
import random

import torch

import bytecodes
from kvaudit.program import random_program
from kvaudit.program.schema import max_prompt
from kvaudit.search.bench import best_times, build_ms, run_programs
from kvaudit.search.schedule import CHECK_EVERY
from kvaudit.targets.vllm.config import VLLM_PRESETS

MODES = (("bare", False, False, False), ("hooks", True, False, False), ("audit", True, True, True),
         ("audit-sparse", True, True, True, CHECK_EVERY))
# (what, file suffix, function): the parts of an audited run the profile reports, cumulative (a part
# called inside another counts in both)
PARTS = (
    ("building the target (vLLM's config and scheduler)", "vllm/target.py", "__init__"),
    ("vLLM: Scheduler.schedule (hooks inside included)", "sched/scheduler.py", "schedule"),
    ("vLLM: Scheduler.update_from_output (hooks inside included)", "sched/scheduler.py", "update_from_output"),
    ("hooks: the ledger's block-pool wrappers (get_new_blocks/touch/free_blocks)", "audit/wrappers.py", "wrapper"),
    ("hooks: the ledger's free of a last reference (Ledger._unref)", "audit/ledger.py", "_unref"),
    ("hooks: ... of which the roots read at each such free (Ledger._users)", "audit/ledger.py", "_users"),
    ("hooks: site capture (Auditor.capture_site)", "audit/hooks.py", "capture_site"),
    ("hooks: the observer's free_blocks wrapper (unref sites, queued twice)", "vllm/observer.py", "free_wrapper"),
    ("hooks: the observer's copy-on-write wrapper (allocate_new_blocks)", "vllm/observer.py", "allocate_wrapper"),
    ("shadow KV tags, per step (VllmSchedulerTarget._shadow_step)", "vllm/target.py", "_shadow_step"),
    ("release checks (vLLM compat.has: a Version parse per call)", "targets/compat.py", "release_has"),
    ("the full check (oracles.check)", "oracles/__init__.py", "check"),
    ("  roots() (holders rebuilt: every table, copy, deferred free)", "vllm/observer.py", "roots"),
    ("  core: mark and sweep (_sweep)", "oracles/__init__.py", "_sweep"),
    ("  core: identity and free-list replay", "oracles/identity.py", "replay_free_list"),
    ("  core: leaks", "oracles/leaks.py", "leaks"),
    ("  the target's invariants (invariant_findings, all)", "vllm/target.py", "invariant_findings"),
    ("    the observer's holders again (_holders, from every caller)", "vllm/observer.py", "_holders"),
    ("    ref counts against holders (_check_ref_counts)", "vllm/observer.py", "_check_ref_counts"),
    ("    free queue walk (_check_free_queue)", "vllm/observer.py", "_check_free_queue"),
    ("    hash map both ways (_check_hash_map)", "vllm/observer.py", "_check_hash_map"),
    ("    requests' hash chains (_check_requests)", "vllm/observer.py", "_check_requests"),
    ("    ledger shadow and KV events replayed (_check_shadow_and_events)", "vllm/observer.py",
     "_check_shadow_and_events"),
    ("    dead tables at idle (_dead_table_findings)", "vllm/target.py", "_dead_table_findings"),
    ("    in-flight steps (_inflight_findings)", "vllm/target.py", "_inflight_findings"),
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--programs", type=int, default=100)
    ap.add_argument("--length", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--preset", action="append", choices=list(VLLM_PRESETS),
                    help="only this preset (repeatable; default: all)")
    ap.add_argument("--profile", action="store_true", help="profile the audit mode instead (PARTS)")
    bytecodes.add_arguments(ap)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from kvaudit.targets.vllm.boot import load
    v = load()
    print(f"import of vLLM {v.version}'s v1 scheduler and KV-cache manager: {v.import_s:.2f} s")
    if args.profile:
        return _profile(args)
    if args.opcodes:
        for name, config, progs in _presets(args):
            bytecodes.compare(name, config, progs, MODES[0], MODES[3], args.top)
        return
    print(f"{args.programs} programs of {args.length} ops, best of {args.repeat}, one core\n")
    print("| preset | bare programs/s | hooks programs/s | audit programs/s | audit-sparse programs/s | "
          "audit / bare time | audit-sparse / bare time | build ms |")
    print("|---|---|---|---|---|---|---|---|")
    for name, config, progs in _presets(args):
        ms = build_ms(config)
        best, _ = best_times(config, progs, MODES, args.repeat)
        rate = {m: args.programs / s for m, s in best.items()}
        print(f"| {name} | {rate['bare']:.0f} | {rate['hooks']:.0f} | {rate['audit']:.0f} | "
              f"{rate['audit-sparse']:.0f} | {best['audit'] / best['bare']:.2f}x | {best['audit-sparse'] / best['bare']:.2f}x | {ms:.1f} |",
              flush=True)



def _presets(args):
    """(name, config, the seeded random programs) of each preset asked for."""
    from kvaudit.targets import program_features
    for name, preset in VLLM_PRESETS.items():
        if args.preset and name not in args.preset:
            continue
        config = preset.config()
        rng = random.Random(args.seed)
        features = program_features(config)
        yield name, config, [random_program(rng, args.length, max_prompt=max_prompt(config.context_len),
                                            features=features) for _ in range(args.programs)]


def _profile(args) -> None:
    """cProfile of the audit mode (a check after every step) over each preset's programs: :data:`PARTS`."""
    import cProfile
    import pstats

    for name, config, progs in _presets(args):
        run_programs(config, progs[:5], True, True, False, True)  # (first builds, imports)
        prof = cProfile.Profile()
        prof.enable()
        run_programs(config, progs, True, True, False, True)
        prof.disable()
        st = pstats.Stats(prof)
        stats, total = st.stats, st.total_tt
        print(f"\n{name}: audit mode, {len(progs)} programs, {total:.2f} s profiled\n")
        print("| part | seconds | share | calls | us a call |")
        print("|---|---:|---:|---:|---:|")
        for what, suffix, fn in PARTS:
            hits = [v for (file, _, func), v in stats.items() if func == fn and file.endswith(suffix)]
            calls, secs = sum(v[1] for v in hits), sum(v[3] for v in hits)
            if calls:
                print(f"| {what} | {secs:.3f} | {100 * secs / total:.1f}% | {calls} | {1e6 * secs / calls:.0f} |")


if __name__ == "__main__":
    main()
