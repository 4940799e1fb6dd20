"""Finding kinds: one self-describing table. Adding a kind is one row here (and the oracle or hook
that raises it): the kind's name (as ``Finding.kind``, suppression rules and reports spell it), its
rank (findings of one check are sorted root causes first: a use-after-free before the leak it leaves
behind), what a site-less signature names (kinds about counters or progress, not one allocation),
and its SARIF rule (name, short and full description, level, tags). Memory-safety kinds are errors;
accounting drift (memory intact, the counters wrong, sometimes the checker itself), liveness and
hang (judged against step budgets) are warnings.
"""

from __future__ import annotations

from typing import NamedTuple


class FindingKind(NamedTuple):
    name: str
    rank: int  # sort order within one check: root causes first
    no_site: str | None  # the signature's third part for a kind with no allocation site
    rule: str  # SARIF rule name
    short: str
    full: str
    level: str  # SARIF level: "error" | "warning"
    tags: tuple[str, ...]


TABLE: tuple[FindingKind, ...] = (
    FindingKind(
        "leak", 4, None, "Leak",
        "KV-cache memory leaked: allocated units that no live owner references",
        "Token slots, pages, blocks or request rows were allocated from a KV-cache pool and are no longer "
        "reachable from any of the engine's roots (live requests, session slots, the radix tree, "
        "in-flight copies), yet were never freed. An indirect leak is reachable only from another "
        "leaked unit, as in LeakSanitizer. Each leak shrinks the pool for good, until the engine "
        "stalls or rejects requests.",
        "error", ("memory-safety", "leak")),
    FindingKind(
        "use-after-free", 0, None, "UseAfterFree",
        "A live owner references KV-cache units that the pool holds as free",
        "A live request, session slot or radix-tree node references units that have already been "
        "returned to the pool. The allocator can hand them to another request, whose KV then "
        "overwrites the first one's, or the first one's writes corrupt the second's.",
        "error", ("memory-safety", "use-after-free")),
    FindingKind(
        "double-free", 1, None, "DoubleFree",
        "KV-cache units freed while already free",
        "Units were returned to their pool while they were already free. The free list then holds "
        "them twice, so two requests can later be given the same slots, and the pool's available "
        "count exceeds its size.",
        "error", ("memory-safety", "double-free")),
    FindingKind(
        "aliasing", 3, None, "Aliasing",
        "KV-cache units privately owned by two owners at once",
        "The same units are held privately (not shared through the radix tree) by two owners, so one "
        "owner's writes or free corrupt the other's KV.",
        "error", ("memory-safety", "aliasing")),
    FindingKind(
        "stale-kv", 2, None, "StaleKv",
        "A request read KV written for another prefix, or never written",
        "A request attended to KV-cache slots whose content was written for a different token prefix, "
        "or was never written at all: the model silently computes with wrong keys and values. Found "
        "by kvaudit's shadow content tags, checked on every KV read.",
        "error", ("memory-safety", "correctness", "stale-kv")),
    FindingKind(
        "accounting-drift", 6, "identity", "AccountingDrift",
        "A pool's accounting identity or counters disagree with its memory",
        "The target's accounting identity (by default available + evictable + protected + "
        "session_held + uncached == total), one of the engine's counters, or the engine's own "
        "check_memory() fails while every allocated unit is reachable: memory is intact, but the "
        "numbers the scheduler admits and evicts by are wrong (or the check itself is).",
        "warning", ("correctness", "accounting")),
    FindingKind(
        "lock-imbalance", 5, None, "LockImbalance",
        "A radix-tree node's lock_ref does not match its live holders",
        "At idle, a radix-tree node's lock_ref differs from the number of live holders (requests, "
        "session slots, in-flight HiCache copies). A leaked lock keeps its tokens protected, and so "
        "unevictable, forever, while the accounting identity still balances.",
        "error", ("memory-safety", "leak", "lock-ref")),
    FindingKind(
        "liveness", 7, "progress", "Liveness",
        "A request holding KV, or aborted, made no progress",
        "A request that holds KV memory, or that was aborted, made no progress for the liveness "
        "budget of scheduler steps: a parked request nobody schedules, or an abort that never ends "
        "its request, keeps its memory forever.",
        "warning", ("liveness",)),
    FindingKind(
        "hang", 8, "idle", "Hang",
        "The engine never became idle",
        "idle() did not reach quiescence within its step budget: work stays queued with no way to "
        "finish it. (A wait for memory that open sessions hold is not reported: a serving engine waits too.)",
        "warning", ("liveness", "hang")),
    FindingKind(
        "crash", 9, None, "Crash",
        "The engine raised an exception",
        "The engine raised an exception while running the program; the finding carries the exception "
        "and its traceback.",
        "error", ("crash",)),
)

BY_NAME: dict[str, FindingKind] = {k.name: k for k in TABLE}
KINDS = tuple(k.name for k in TABLE)  # in report order
ORDER = tuple(sorted(KINDS, key=lambda n: BY_NAME[n].rank))  # root causes first
NO_SITE_KINDS = {k.name: k.no_site for k in TABLE if k.no_site}
