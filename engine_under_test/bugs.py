"""The bug zoo: real KV-lifecycle bugs that can be switched back on by name.

Each switch re-creates the faulty *behaviour* of a bug that shipped in a public serving engine
and was fixed there; the faulty branch lives at the spot it concerns and names its source.
See ``shared/reference/bug-zoo.md``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass


class UnknownBugError(ValueError):
    """Raised for a bug name that is not in :data:`BUGS`."""

    def __init__(self, name: str):
        super().__init__(f"unknown bug {json.dumps(name)}; valid bugs: {', '.join(BUGS)}")
        self.name = name


@dataclass(frozen=True)
class BugInfo:
    name: str
    source: str
    preset: str
    finding: str  # the finding kind kvaudit must report
    description: str
    min_ops: int = 0  # length of the shortest known reproducer (bug-zoo.md's "min")


BUGS: dict[str, BugInfo] = {
    b.name: b
    for b in [
        BugInfo(
            "hisparse-prebuilt-skip-finish",
            "sglang PR #22882",
            "pd-decode-hisparse",
            "leak",
            "a request that finishes in the PD prebuilt step (a health check, max_new_tokens=1) is "
            "released without HiSparseCoordinator.request_finished: its device buffer and host slots leak",
            min_ops=3,
        ),
        BugInfo(
            "pd-abort-after-transfer-leak",
            "sglang PR #9817 (family #8352, #17483)",
            "pd-decode",
            "leak",
            "an abort of a PD request whose KV has been transferred and that waits to join the running "
            "batch removes it from the waiting queue without releasing its row and KV",
            min_ops=4,
        ),
        BugInfo(
            "chunked-abort-ignored",
            "sglang-jax PR #984",
            "chunked",
            "leak",
            "an abort (or abort-all) of a request parked between prefill chunks drops it from scheduling "
            "without releasing it: its row and KV leak and it never finishes",
            min_ops=4,
        ),
        BugInfo(
            "retract-unaligned-page",
            "sglang PR #4977",
            "retract",
            "leak",
            "a request retracted on decode OOM frees from its prompt's end padded up to a page, skipping "
            "the page that holds an unaligned prompt end: one page leaks per such retraction",
            min_ops=5,
        ),
        BugInfo(
            "prefill-finish-leaks-row",
            "sglang PR #10871",
            "mixed-chunk",
            "leak",
            "with mixed chunk, a request that finishes in its first prefill (max_new_tokens=1) has only "
            "that step's token slots freed: its req_to_token row leaks",
            min_ops=3,
        ),
        BugInfo(
            "radix-lock-skips-matched-node",
            "mini-sglang PR #52",
            "retract",
            "use-after-free",
            "locking a matched prefix starts at the node's parent, so the node a request reads stays "
            "evictable; memory pressure evicts it while the request still uses its slots",
            min_ops=5,
        ),
        BugInfo(
            "overlap-abort-double-free",
            "mini-sglang PR #111",
            "overlap",
            # reported as a use-after-free named by the abort's free (the request in flight still maps the
            # units when its delayed result frees them again): until 2026-12, a double free named by the second
            "use-after-free",
            "with overlap scheduling, an abort frees the KV and row of a request whose batch is still in "
            "flight; the delayed result then finishes the request and frees them again",
            min_ops=4,
        ),
        BugInfo(
            "aborted-kv-inserted",
            "sglang PR #28374",
            "overlap",
            "stale-kv",
            "a request aborted part-way is cached into the radix tree like a finished one, including the "
            "positions its skipped last forward never wrote; a later request sharing the prefix reads them",
            min_ops=5,
        ),
        BugInfo(
            "evictable-size-uses-key-len",
            "sglang PR #10637",
            "paged",
            "accounting-drift",
            "the tree's evictable counter grows by the unaligned key length instead of the page-aligned "
            "value length when a leaf is added: the counters drift while memory is intact",
            min_ops=4,
        ),
        BugInfo(
            "session-close-while-running",
            "sglang PR #21875 (race)",
            "streaming-session",
            "use-after-free",
            "closing a streaming session frees its slot at once although a turn still runs on the borrowed "
            "record: the turn's row points at free slots, and they are freed again when the turn ends",
            min_ops=5,
        ),
        BugInfo(
            "session-tail-not-trimmed",
            "sglang PR #21875 (tail leak)",
            "streaming-session",
            "leak",
            "a turn that finishes with allocated > owned (the overlap extra slot after a stop) hands its "
            "record to the session without freeing the over-allocated tail: the tail slots leak",
            min_ops=5,
        ),
        BugInfo(
            "session-abort-borrows-slot",
            "sglang PR #22273",
            "streaming-session",
            "leak",
            "a session turn rejected at intake for exceeding the context still borrows the session record, "
            "overwrites its row and writes committed=1 back: the earlier turns' KV leaks, session_held < 0",
            min_ops=6,
        ),
        BugInfo(
            "session-borrow-double-count",
            "sglang PRs #22213, #22753",
            "streaming-session",
            "accounting-drift",
            "the busy check counts a turn running on a borrowed session record both as session_held and "
            "as the turn's uncached KV: the identity reports a leak while memory is intact",
            min_ops=3,
        ),
        BugInfo(
            "hicache-abort-loadback-leak",
            "sglang PR #9874 (same class as #9927, #15439)",
            "hicache",
            "lock-imbalance",
            "a waiting request aborted while its host load-back is in flight drops the load-back record "
            "without releasing it: the loaded nodes stay locked (protected) and their host copies pinned",
            min_ops=5,
        ),
    ]
}
