#!/usr/bin/env python3
"""Mutation testing of engine_under_test's release paths: what the default search and the oracles miss.

    python benchmarks/mutants.py [--max-time 30] [--seed 1] [--only NAME ...] [--json FILE] [--list]

The bug zoo is the bugs we know. Each mutant below is one small edit of a memory path of
``engine_under_test`` (a dropped free, unlock or release; a free one slot too many or too early; an
off-by-one in a page or prefix length; a free and a tree insert swapped; a session or transfer record
not cleared on abort), on the path of one feature. For each, the engine package is copied to a temporary
directory, the edit is applied there (the checkout is never touched; an edit whose text does not occur
exactly once is an error), and ``kvaudit fuzz --preset P --max-time T --seed S`` (the default fuzzer,
random-96) runs with that copy first on ``PYTHONPATH``. A first row runs the unmutated copy on the
default preset, as a control: it must be clean.

Prints one markdown row per mutant: found or not, the first finding's signature, executions and
search seconds to the first hit, and the run's ``reached:`` / ``not reached`` lines (the target's path
counters, docs/guides/fuzzing.md), which say whether a survivor's path was searched at all (for the paths
no counter names, benchmarks/mutants_reach.py counts them). Why a
survivor survived (its path never reached, an oracle that cannot see it, an equivalent mutant) is the
reader's judgement: docs/internals/mutants.md records it for one run. Bounded: each run is cut at
``--max-time`` + 120 s (start-up and triage); 35 mutants at 30 s took 9 minutes (a survivor takes the whole
budget, a mutant found takes 4-15 s), at most about 20 if every one survived. Not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutant:
    name: str
    preset: str
    file: str  # under engine_under_test/
    old: str  # must occur exactly once in the file
    new: str
    what: str


def _drop(name, preset, file, line, what, before="", after=""):
    """A mutant that replaces ``line`` by ``pass`` (so a block it was alone in stays valid), where ``before``
    precedes and ``after`` follows it."""
    indent = line[: len(line) - len(line.lstrip())]
    return Mutant(name, preset, file, before + line + "\n" + after, before + indent + "pass\n" + after, what)


REL = "scheduler.py"
FREE_SPAN = "self.token_to_kv_pool_allocator.free(self.row_slots(kv, kv.cache_protected_len, kv.kv_allocated_len))"

MUTANTS = [
    # completion: release_kv_cache, the single release entry point
    _drop("release-no-free", "default", REL, "        " + FREE_SPAN,
          "release_kv_cache frees no private span", after="        if req.lock is not None:"),
    _drop("release-no-unlock", "default", REL, "            self.tree_cache.dec_lock_ref(req.lock)",
          "release_kv_cache drops the lock without dec_lock_ref", before="        if req.lock is not None:\n"),
    _drop("release-keeps-row", "default", REL, "        self.req_to_token_pool.free(kv.req_pool_idx)",
          "release_kv_cache never frees the request's row", after="        kv.mark_kv_released()"),
    Mutant("release-one-too-many", "default", REL, "kv.cache_protected_len, kv.kv_allocated_len))",
           "kv.cache_protected_len, kv.kv_allocated_len + 1))", "release frees one row position past the allocation"),
    Mutant("release-one-short", "default", REL, "kv.cache_protected_len, kv.kv_allocated_len))",
           "kv.cache_protected_len + 1, kv.kv_allocated_len))", "release skips the first private slot"),
    Mutant("release-free-before-insert", "default", REL,
           "        if checkpoint:\n            self.checkpoint_kv_cache(req, up_to=req.owned_kv_len())\n        "
           + FREE_SPAN + "\n",
           "        " + FREE_SPAN + "\n        if checkpoint:\n"
           "            self.checkpoint_kv_cache(req, up_to=req.owned_kv_len())\n",
           "release frees the private span before the tree insert (order swapped)"),
    # the radix tree
    _drop("evict-no-free", "retract", "radix_cache.py", "            self.allocator.free(node.value)",
          "tree eviction deletes a leaf without freeing its slots", after="            self.evictable_size_ -= len(node.key)\n"
          "            del node.parent"),
    _drop("insert-dup-not-freed", "default", "scheduler_release_mixin.py",
          "            self.token_to_kv_pool_allocator.free(table[row, start:already].clone())",
          "checkpoint keeps the request's copy of a prefix the tree already held",
          before="        if already > start:\n"),
    Mutant("checkpoint-ceil-page", "paged", "scheduler_release_mixin.py",
           "        n = up_to // self.page_size * self.page_size\n",
           "        n = -(-up_to // self.page_size) * self.page_size\n",
           "checkpoint publishes a partial last page (ceil instead of floor)"),
    Mutant("flush-keeps-allocator", "default", "scheduler_input_mixin.py",
           "        self.req_to_token_pool.clear()\n        self.token_to_kv_pool_allocator.clear()\n",
           "        self.req_to_token_pool.clear()\n", "flush_cache drops the tree but never clears the KV allocator"),
    # abort
    Mutant("abort-running-ignored", "default", REL,
           "            req.to_finish = FinishReason.ABORT  # released by the next result processing\n",
           "            pass\n", "an abort of a running request is dropped (it runs to its end)"),
    # retract
    _drop("retract-requeue-lost", "retract", "scheduler_decode_mixin.py", "        self.waiting_queue[:0] = retracted",
          "retracted requests are released but never queued again"),
    _drop("pause-retract-no-release", "default", "scheduler_input_mixin.py", "            self.release_req(req)",
          "a retract pause re-queues requests without releasing them", before="        for req in reqs:\n"),
    # chunked prefill
    Mutant("chunked-abort-emit-only", "chunked", "scheduler_prefill_mixin.py",
           "            chunked.finished_reason = FinishReason.ABORT\n            self._release_finished(chunked, checkpoint=False)\n"
           "        elif", "            chunked.finished_reason = FinishReason.ABORT\n            self._emit(chunked)\n        elif",
           "the recorded abort of a parked chunked request emits it without a release"),
    Mutant("chunked-no-stash", "chunked", "scheduler_prefill_mixin.py", "            self.checkpoint_kv_cache(chunked)\n",
           "            pass\n", "chunks computed so far are not published to the tree between chunks"),
    # overlap
    Mutant("overlap-cache-allocated", "overlap", REL, "self.checkpoint_kv_cache(req, up_to=req.owned_kv_len())",
           "self.checkpoint_kv_cache(req, up_to=req.kv.kv_allocated_len)",
           "release publishes the overlap extra slot (allocated, never written) into the tree"),
    Mutant("overlap-lag-off-by-one", "overlap", REL,
           "len(r.output_ids) + len(r.future_ids) < r.max_new_tokens]",
           "len(r.output_ids) + len(r.future_ids) <= r.max_new_tokens]",
           "overlap decodes a request one step past its length finish"),
    # PD decode
    Mutant("pd-transfer-abort-no-release", "pd-decode", REL,
           "            self._release_finished(req, checkpoint=False)  # emits the output\n",
           "            self._emit(req)\n", "an abort during the KV transfer drops the pre-allocated row and KV"),
    Mutant("pd-failed-transfer-no-release", "pd-decode", "scheduler_disagg_decode_mixin.py",
           "            self.disagg_transfer_queue.remove(req)\n            req.finished_reason = FinishReason.ABORT\n"
           "            self._release_finished(req, checkpoint=False)\n",
           "            self.disagg_transfer_queue.remove(req)\n            req.finished_reason = FinishReason.ABORT\n"
           "            self._emit(req)\n", "a failed transfer is aborted without releasing its pre-allocation"),
    _drop("pd-failed-rid-kept", "pd-decode", "scheduler_disagg_decode_mixin.py",
          "                self.failed_transfers.discard(req.rid)",
          "the failed-transfer record is not cleared when its request is aborted at the prebuilt step"),
    _drop("pd-radix-prealloc-lock-kept", "pd-decode-radix", "scheduler_disagg_decode_mixin.py",
          "                    tree.dec_lock_ref(match.last_node)",
          "pre-allocation that does not fit keeps the prefix lock it took", before="                if match is not None:\n"),
    # HiSparse
    Mutant("hisparse-host-not-freed", "hisparse", "hisparse.py",
           "(self.hisparse_attn_allocator, self.req_prefill_physical),\n                           "
           "(self.host_pool, self.req_to_host_pool)):",
           "(self.hisparse_attn_allocator, self.req_prefill_physical)):",
           "request_finished frees the device buffer but not the host slots"),
    _drop("hisparse-buffer-trim-not-freed", "hisparse", "hisparse.py",
          "        self.hisparse_attn_allocator.free(torch.cat((phys[:start], phys[end:])))",
          "alloc_device_buffer keeps no reference to the prefill slots it trims, nor frees them"),
    _drop("hisparse-retract-skipped", "hisparse", "scheduler_decode_mixin.py",
          "            self.hisparse_coordinator.retract_req(req)", "retraction skips HiSparse's retract_req",
          before="        if self.hisparse_coordinator is not None:\n"),
    Mutant("hisparse-staging-abort-skipped", "hisparse", REL,
           "            hs.abort_staging_request(req)  # HiSparse staging: the host backup is still in flight\n", "",
           "an abort of a staging request skips abort_staging_request"),
    # streaming sessions
    _drop("session-close-no-free", "streaming-session", "session.py",
          "        sched.token_to_kv_pool_allocator.free(sched.row_slots(kv, kv.cache_protected_len, kv.kv_allocated_len))",
          "a session close frees the row but not the record's KV"),
    Mutant("session-stale-tail-off-by-one", "streaming-session", "session.py",
           "start = max(self.sched.ceil_page(prefix), kv.cache_protected_len)",
           "start = max(self.sched.ceil_page(prefix) + 1, kv.cache_protected_len)",
           "a new turn frees its record's stale tail from one position too late"),
    Mutant("session-abort-keeps-turn", "streaming-session", REL,
           "            self._end_session_turn(req)\n            if req.load_back",
           "            if req.load_back", "an abort of a waiting turn leaves its session marked in flight"),
    _drop("session-take-keeps-lock", "streaming-session", "session.py", "        req.lock = None",
          "the slot takes the turn's tree lock but the turn keeps it too",
          before="        s.slot = req.borrowed_slot = SessionSlot(req.kv, req.lock)\n"),
    # HiCache
    _drop("hicache-ack-no-unlock", "hicache", "hicache.py", "                self.dec_lock_ref(node)",
          "a write-through ack never unlocks its node", after="                del self.ongoing_write_through[nid]"),
    _drop("hicache-demote-no-free", "hicache", "hicache.py", "            self.allocator.free(node.value)",
          "demotion to host drops the device slots without freeing them",
          after="            self.evictable_size_ -= len(node.key)\n            node.value = None"),
    _drop("hicache-host-evict-no-free", "hicache", "hicache.py", "            self.host_pool.free(node.host_value)",
          "host eviction deletes a node without freeing its host slots", after="            del node.parent"),
    _drop("hicache-loadback-pin-kept", "hicache", "hicache.py", "        self._pin_host(rec.node, -1)",
          "a released load-back keeps its host pins", after="        del self.ongoing_load_back"),
    # priority scheduling
    _drop("priority-preempted-lost", "priority", "scheduler_prefill_mixin.py", "            self._add_request_to_queue(req)",
          "preempted requests are released but never queued again", before="        for req in preempted:\n"),
    _drop("priority-preempt-no-release", "priority", "scheduler_prefill_mixin.py", "            self.release_req(r)",
          "preemption drops victims from the running batch without releasing them", before="        for r in victims:\n"),
]


def apply(mutant: Mutant | None, dest: Path) -> None:
    """Copy ``engine_under_test`` to ``dest`` and apply ``mutant`` there. Raises ValueError when its
    text does not occur exactly once."""
    shutil.copytree(ROOT / "engine_under_test", dest / "engine_under_test",
                    ignore=shutil.ignore_patterns("__pycache__"))
    if mutant is None:
        return
    path = dest / "engine_under_test" / mutant.file
    text = path.read_text()
    if text.count(mutant.old) != 1:
        raise ValueError(f"{mutant.name}: its text occurs {text.count(mutant.old)} times in {mutant.file}")
    path.write_text(text.replace(mutant.old, mutant.new))


def run(mutant: Mutant | None, preset: str, max_time: float, seed: int, kvaudit: Path = ROOT) -> dict:
    """Fuzz one mutant with the kvaudit of checkout ``kvaudit``; returns its row (found, signature, first
    hit, reach lines)."""
    with tempfile.TemporaryDirectory(prefix="kvaudit-mutant-") as tmp:
        tmp = Path(tmp)
        apply(mutant, tmp)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp), str(kvaudit), os.environ.get("PYTHONPATH", "")]))
        report = tmp / "report.json"
        cmd = [sys.executable, "-m", "kvaudit", "fuzz", "--preset", preset, "--max-time", str(max_time),
               "--seed", str(seed), "--out", str(tmp / "out"), "--json", str(report)]
        t0 = time.monotonic()
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=max_time + 120, cwd=tmp)
            out, rc = proc.stdout + proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as e:
            out, rc = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""), "timeout"
        data = json.loads(report.read_text()) if report.exists() else {}
    sigs = [f["signature"] for f in data.get("findings", [])]
    reach = [ln.strip() for ln in out.splitlines() if ln.startswith(("reached:", "not reached"))]
    return {"mutant": mutant.name if mutant else "(none: control)", "preset": preset,
            "what": mutant.what if mutant else "the unmutated engine", "rc": rc, "found": bool(sigs),
            "signature": sigs[0] if sigs else None, "executions": data.get("executions"),
            "first_hit_executions": data.get("first_hit_executions"),
            "first_hit_seconds": data.get("first_hit_seconds"), "reach": reach, "wall": round(time.monotonic() - t0, 1),
            "error": None if rc in (0, 1) and data else out.strip().splitlines()[-1:]}


def row(r: dict) -> str:
    hit = (f"{r['first_hit_executions']} exec, {r['first_hit_seconds']} s" if r["found"]
           else f"no ({r['executions']} exec)")
    sig = f"`{r['signature']}`" if r["signature"] else ("; ".join(r["reach"]) or f"rc {r['rc']}: {r['error']}")
    return f"| `{r['mutant']}` | `{r['preset']}` | {'found' if r['found'] else '**not found**'} | {hit} | {sig} |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-time", type=float, default=30, help="search seconds per mutant (default 30)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--only", action="append", help="only this mutant (repeatable)")
    ap.add_argument("--no-control", action="store_true", help="skip the unmutated control run")
    ap.add_argument("--json", help="also write the rows to this file (JSON lines)")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    ap.add_argument("--kvaudit", type=Path, default=ROOT,
                    help="the checkout whose kvaudit fuzzes (default: this one; another compares before and after a fix)")
    args = ap.parse_args()
    chosen = [m for m in MUTANTS if not args.only or m.name in args.only]
    if args.list or (args.only and not chosen):
        for m in MUTANTS:
            print(f"{m.name:32} {m.preset:18} {m.file:32} {m.what}")
        sys.exit(0 if args.list else 2)
    for m in chosen:  # every edit applies before anything runs
        with tempfile.TemporaryDirectory() as tmp:
            apply(m, Path(tmp))
    print("| mutant | preset | found? | first hit | signature, or the run's reach lines |")
    print("|---|---|---|---|---|")
    runs = ([] if args.no_control else [(None, "default")]) + [(m, m.preset) for m in chosen]
    for mutant, preset in runs:
        r = run(mutant, preset, args.max_time, args.seed, args.kvaudit.resolve())
        print(row(r), flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
