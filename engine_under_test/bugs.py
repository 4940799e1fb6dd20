"""The bug zoo: real KV-lifecycle bugs that can be switched back on by name.

Each switch re-creates the faulty *behaviour* of a bug that shipped in a public serving engine
and was fixed there; the faulty branch lives at the spot it concerns and names its source.
See ``shared/reference/bug-zoo.md``.
"""

from __future__ import annotations

from dataclasses import dataclass


class UnknownBugError(ValueError):
    """Raised for a bug name that is not in :data:`BUGS`."""

    def __init__(self, name: str):
        super().__init__(f"unknown bug {name!r}; valid bugs: {', '.join(BUGS)}")
        self.name = name


@dataclass(frozen=True)
class BugInfo:
    name: str
    source: str
    preset: str
    finding: str
    description: str


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
        ),
        BugInfo(
            "pd-abort-after-transfer-leak",
            "sglang PR #9817 (family #8352, #17483)",
            "pd-decode",
            "leak",
            "an abort of a PD request whose KV has been transferred and that waits to join the running "
            "batch removes it from the waiting queue without releasing its row and KV",
        ),
        BugInfo(
            "chunked-abort-ignored",
            "sglang-jax PR #984",
            "chunked",
            "leak",
            "an abort (or abort-all) of a request parked between prefill chunks drops it from scheduling "
            "without releasing it: its row and KV leak and it never finishes",
        ),
        BugInfo(
            "retract-unaligned-page",
            "sglang PR #4977",
            "retract",
            "leak",
            "a request retracted on decode OOM frees a range whose end is floored to a page boundary, "
            "skipping the partly filled last page it owns: one page leaks per retraction",
        ),
        BugInfo(
            "prefill-finish-leaks-row",
            "sglang PR #10871",
            "mixed-chunk",
            "leak",
            "with mixed chunk, a request that finishes in its first prefill (max_new_tokens=1) has only "
            "that step's token slots freed: its req_to_token row leaks",
        ),
        BugInfo(
            "radix-lock-skips-matched-node",
            "mini-sglang PR #52",
            "retract",
            "use-after-free",
            "locking a matched prefix starts at the node's parent, so the node a request reads stays "
            "evictable; memory pressure evicts it while the request still uses its slots",
        ),
    ]
}
