#!/usr/bin/env python3
"""How long one full audit takes on a big engine: reachability, accounting and lock balance over a
1,048,576-slot KV pool with 1,000 live requests (and the radix tree their shared prefixes build).

    python benchmarks/audit_scale.py [--slots 1048576] [--requests 1000] [--prompt 800] [--repeat 5]

Runs on one core (torch.set_num_threads(1)). Builds the state through the real scheduler with the
hooks installed (model "none"), then times ``oracles.check`` at idle=True (every oracle, lock
balance included) and reports the best and median of ``--repeat`` runs (wall clock, target: <= 100 ms;
and process CPU time); then
``--repeat`` busy steps: a decode step of every request, and the per-step check after it (process CPU
time; target: < 5 ms).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvaudit.targets.eut.presets import EutConfig
from kvaudit.audit import oracles
from kvaudit.audit.hooks import Auditor
from kvaudit.program import prompt_tokens
from kvaudit.targets.eut import EutTarget


def build(slots: int, requests: int, prompt: int, max_new: int) -> tuple[EutTarget, Auditor]:
    cfg = EutConfig(num_slots=slots, max_req_rows=requests, max_running_requests=requests,
                       context_len=prompt + max_new + 8, vocab_size=1024, preset="audit-scale")
    target = EutTarget(cfg)
    auditor = Auditor(target, full_stacks=False)
    eng = target.engine
    for i in range(requests):
        # 16 families share a 64-token prefix (real shared tree nodes); the rest is the request's own
        head = prompt_tokens(i % 16, min(64, prompt), cfg.vocab_size)
        toks = head + [2 + (i * 131 + k * 17 + (k * k) % 7) % (cfg.vocab_size - 2) for k in range(prompt - len(head))]
        eng.add_request(toks, max_new)
    while len(eng.running_batch) < requests:
        target.step()
    target.step()  # one decode step for everyone
    return target, auditor


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--slots", type=int, default=1 << 20)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--prompt", type=int, default=800)
    ap.add_argument("--max-new", type=int, default=100)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    target, auditor = build(args.slots, args.requests, args.prompt, args.max_new)
    eng = target.engine
    used = eng.token_to_kv_pool_allocator.size - eng.token_to_kv_pool_allocator.available_size()
    print(f"state built in {time.perf_counter() - t0:.1f}s: pool={eng.token_to_kv_pool_allocator.size} slots, "
          f"live requests={len(eng.requests_owning_rows())}, slots in use={used}, "
          f"tree={eng.tree_cache.total_size()} tokens, protected={eng.tree_cache.protected_size()}")
    times, cpu = [], []
    for _ in range(args.repeat):
        t, c = time.perf_counter(), time.process_time()
        found = oracles.check(auditor, target, idle=True)
        times.append((time.perf_counter() - t) * 1000)
        cpu.append((time.process_time() - c) * 1000)
        assert not found, [f.summary() for f in found]
    print(f"full audit (reachability + accounting + lock balance): best {min(times):.1f} ms, "
          f"median {statistics.median(times):.1f} ms over {args.repeat} runs (target <= 100 ms); "
          f"process CPU best {min(cpu):.1f} ms, median {statistics.median(cpu):.1f} ms")
    t = time.perf_counter()
    roots = target.roots()
    print(f"  of which target.roots(): {(time.perf_counter() - t) * 1000:.1f} ms ({len(roots)} roots)")
    busy_steps(target, auditor, args.repeat)


def busy_steps(target: EutTarget, auditor: Auditor, repeat: int) -> None:
    """The per-step check as a run makes it: one decode step of every live request (not timed), then
    ``oracles.check(idle=False)`` (timed in process CPU time), ``repeat`` times."""
    times = []
    for _ in range(repeat):
        target.step()
        auditor.step = target.steps
        t = time.process_time()
        found = oracles.check(auditor, target, idle=False)
        times.append((time.process_time() - t) * 1000)
        assert not found, [f.summary() for f in found]
    print(f"one busy step's check (after a decode step of every request, process CPU): best {min(times):.2f} ms, "
          f"median {statistics.median(times):.2f} ms over {repeat} steps (target < 5 ms)")


if __name__ == "__main__":
    main()
