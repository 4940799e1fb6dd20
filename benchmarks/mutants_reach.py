#!/usr/bin/env python3
"""Whether random programs reach the lines benchmarks/mutants.py's survivors mutate.

    python benchmarks/mutants_reach.py [--programs 200] [--seed 1] [PRESET ...]

The target's path counters (``reached:``) do not name every path a mutant edits (the overlap overshoot,
a parked chunk's stash, a session turn aborted while waiting), so this wraps the unmutated engine's
methods at class level and counts, over ``--programs`` seeded random programs per preset (as
benchmarks/reach.py runs them, under full audit), how often the state a survivor's edit changes
occurs. A count above 0 means the survivor's path was searched: it survived because the mutant is
equivalent or because no oracle sees its effect (docs/internals/mutants.md).
"""

from __future__ import annotations

import argparse
import collections

import torch

from engine_under_test.scheduler import Scheduler
from engine_under_test.session import SessionController
from kvaudit.targets.eut.presets import get_preset
from reach import reach

COUNTS: collections.Counter = collections.Counter()


def before(cls, name: str, count) -> None:
    """Wrap ``cls.name`` so that ``count(self, *args)`` runs before it: a dict of mutant -> occurrences."""
    fn = getattr(cls, name)

    def wrapped(self, *a, **k):
        COUNTS.update(count(self, *a, **k))
        return fn(self, *a, **k)

    setattr(cls, name, wrapped)


def _release(self, req, checkpoint):
    return {"overlap-cache-allocated": int(checkpoint and req.owned_kv_len() != req.kv.kv_allocated_len)}


def _checkpoint(self, req, up_to=None):
    return {"chunked-no-stash": int(req is self.chunked_req and up_to is None and not self._pending_chunked_abort)}


def _decode(self):
    at_max = [r for r in self.running_batch if not r.finished()
              and len(r.output_ids) + len(r.future_ids) == r.max_new_tokens]
    return {"overlap-lag-off-by-one": len(at_max) if self.config.enable_overlap else 0}


def _abort(self, rid, abort_all):
    def hit(r):
        return abort_all or (rid is not None and r.rid.startswith(rid))
    flight = list(self.running_batch) + (self.last_batch.reqs if self.last_batch else [])
    hs = self.hisparse_coordinator
    return {"abort-running-ignored": sum(hit(r) and not r.finished() and r is not self.chunked_req and r.kv.holds_kv
                                         for r in flight),
            "session-abort-keeps-turn": sum(hit(r) and r.session is not None for r in self.waiting_queue),
            "hisparse-staging-abort-skipped": sum(map(hit, hs.staging_reqs())) if hs is not None else 0}


def _take(self, req):
    s = req.session
    fresh = s is not None and req.borrowed_slot is None and not (s.slot is not None and s.slot.kv.holds_kv)
    return {"session-take-keeps-lock": int(fresh and req.lock is not None)}


def _prebuilt(self):
    room = min(self.req_to_token_pool.size, self.config.max_running_requests) - \
        sum(not r.finished() for r in self.running_batch)
    return {"pd-failed-rid-kept": sum(r.rid in self.failed_transfers for r in self.waiting_queue[:max(room, 0)])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--programs", type=int, default=200)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("presets", nargs="*", default=["default", "chunked", "overlap", "pd-decode", "hisparse",
                                                   "streaming-session"])
    args = ap.parse_args()
    torch.set_num_threads(1)
    before(Scheduler, "release_kv_cache", _release)
    before(Scheduler, "checkpoint_kv_cache", _checkpoint)
    before(Scheduler, "update_running_batch", _decode)
    before(Scheduler, "handle_abort", _abort)
    before(Scheduler, "get_next_disagg_decode_batch_to_run", _prebuilt)
    before(SessionController, "take", _take)
    for preset in args.presets:
        COUNTS.clear()
        _, hits = reach(get_preset(preset).config(), args.programs, args.seed)
        print(f"{preset}: " + ", ".join(f"{k}={v}" for k, v in sorted(COUNTS.items()) if v) + f" (findings: {hits})")


if __name__ == "__main__":
    main()
