"""Python bytecodes a run executes, per function: the benchmarks' ``--opcodes`` measure
(benchmarks/audit_parts.py, vllm_throughput.py, sglang_throughput.py).

A count is the same whatever the machine's load (``sys.settrace`` with ``f_trace_opcodes``: one trace event a
bytecode), so a cut to the audit's own Python shows here without the run-to-run noise of a shared machine's CPU
time. It misses what a bytecode calls in C (numpy, torch, dict and set operations): a count ranks Python work,
the CPU time still decides.
"""

from __future__ import annotations

import collections
import os
import sys


def count(run, *args, **kwargs) -> collections.Counter:
    """Bytecodes executed per code object while ``run(*args, **kwargs)`` runs (its result is dropped)."""
    counts: collections.Counter = collections.Counter()

    def local(frame, event, arg):
        if event == "opcode":
            counts[frame.f_code] += 1
        return local

    def trace(frame, event, arg):
        frame.f_trace_opcodes = True
        return local

    sys.settrace(trace)
    try:
        run(*args, **kwargs)
    finally:
        sys.settrace(None)
    return counts


def name(code) -> str:
    """``path:qualname`` of a code object, the path relative to the working directory."""
    return f"{os.path.relpath(code.co_filename)}:{code.co_qualname}"


def added(more: collections.Counter, less: collections.Counter) -> collections.Counter:
    """Per function (:func:`name`: code objects of one name summed), ``more``'s bytecodes less ``less``'s."""
    out: collections.Counter = collections.Counter()
    for code, n in more.items():
        out[name(code)] += n
    for code, n in less.items():
        out[name(code)] -= n
    return out


def print_top(audited: collections.Counter, bare: collections.Counter, top: int) -> None:
    """The ``top`` functions whose bytecodes the searches' full audit (``audited``) adds most over ``bare``."""
    more = added(audited, bare)
    print(f"\nthe {top} functions the searches' full audit adds most bytecodes to "
          f"(of {sum(audited.values()) - sum(bare.values()):,} added):")
    for where, n in more.most_common(top):
        print(f"{n:12,} {where}")


def add_arguments(ap) -> None:
    """``--opcodes`` and ``--top N`` on a benchmark's ``argparse`` parser."""
    ap.add_argument("--opcodes", action="store_true", help="count each mode's Python bytecodes instead of timing")
    ap.add_argument("--top", type=int, default=30, help="with --opcodes: the functions the audit adds most to")


def compare(label: str, config, programs: list, bare: tuple, audited: tuple, top: int) -> None:
    """Count ``programs`` run bare and audited (rows of :func:`kvaudit.search.bench.best_times`' modes:
    ``(name, audit, oracles, shadow[, check_every])``, fast stacks) after a warm-up of five programs in each,
    print both totals and their ratio, and with ``top`` the functions the audit adds most to."""
    from kvaudit.search.bench import run_programs

    for _, audit, oracles, shadow, *every in (bare, audited):  # warm-up (imports, the process's caches)
        run_programs(config, programs[:5], audit, oracles, False, shadow, *every)
    got = [count(run_programs, config, programs, audit, oracles, False, shadow, *every)
           for _, audit, oracles, shadow, *every in (bare, audited)]
    b, a = (sum(c.values()) for c in got)
    print(f"{label}: {bare[0]} {b:,} bytecodes, {audited[0]} {a:,} ({a / b:.3f}x bare)", flush=True)
    if top:
        print_top(got[1], got[0], top)
