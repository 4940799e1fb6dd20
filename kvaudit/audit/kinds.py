"""Finding kinds: one self-describing table. Adding a kind is one row here (and the oracle or hook
that raises it); every writer (the console report, SARIF, JUnit, the signature, the oracles' sort)
looks its kind up here (:func:`lookup`) and branches on no kind's name. A row's fields are
:class:`FindingKind`'s (docs/architecture.md); each kind's signature parts: docs/internals/audit.md's
signature table. A kind no row describes (a plugin target's own) still renders:
:func:`lookup` gives it a generic row.
"""

from __future__ import annotations

import os
import re
from typing import Any, Callable, NamedTuple

# ----------------------------------------------------------------------------- naming sites


def where(sites: list) -> str:
    """``function@file`` of the innermost frame of ``sites`` (``?`` when there is none)."""
    return f"{sites[0].function}@{os.path.basename(sites[0].file)}" if sites else "?"


def allocated(sites: list) -> str:
    """An allocation site's signature part: ``request-kv`` when its innermost frame grows a request's
    own KV (``Site.request_kv``: prefill or decode, whichever the program reached first), else
    :func:`where`."""
    return "request-kv" if sites and sites[0].request_kv else where(sites)


def release_path(sites: list) -> str:
    """``function@file`` of the release path of a free's ``sites``: the first frame that is not one
    of the target's release entries (``Site.entry``), i.e. the caller that chose the release; the
    outermost entry frame when every frame is one; ``?`` when there is none."""
    return where([next((s for s in sites if not s.entry), sites[-1])] if sites else [])


# ----------------------------------------------------------------------------- signatures


def _checked(f, parts: list[str]) -> str:
    """``parts`` joined, then ``check:<check>`` when a target's own invariant names one (a ref count,
    an orphan table: one bug per check)."""
    return "/".join(parts + [f"check:{f.check}"] * bool(f.check))


def _sig_sites(f) -> str:
    """The allocation site (aliasing, and any kind no row describes)."""
    return _checked(f, [allocated(f.alloc_sites)])


def _sig_leak(f) -> str:
    """Allocated at; the path of the release that lost the unit, else where its owner was dropped from, else
    (no owner had it) what the target says lost it."""
    parts = [allocated(f.alloc_sites)] + [release_path(f.lost_sites)] * bool(f.lost_sites)
    if not f.lost_sites and f.lost_from:
        parts.append(f"from:{f.lost_from}")  # dropped without a release: from where
    elif not f.lost_sites and f.lost_by:
        parts.append(f.lost_by)  # no owner, no release: the target's fact (a row write's place)
    return _checked(f, parts)


def _sig_use_after_free(f) -> str:
    """Allocated at; the path of the premature free (its caller above the release plumbing, as a leak's);
    then what the target says of that free (``Target.freed_by``, e.g. ``unlocked``), when it says."""
    return _checked(f, [allocated(f.alloc_sites)] + [release_path(f.free_sites)] * bool(f.free_sites)
                    + [f.lost_by] * bool(f.lost_by))


def _sig_double_free(f) -> str:
    """Freed first at; freed again at: each free's path (a target's release plumbing names no bug)."""
    return _checked(f, [release_path(f.prev_free_sites)] + [release_path(f.free_sites)] * bool(f.free_sites))


def _sig_stale_kv(f) -> str:
    if f.check == "freed" and f.free_sites:
        return f"freed:{release_path(f.free_sites)}"
    if f.check:
        return f"{allocated(f.alloc_sites)}/{f.check}"
    return _sig_sites(f)


def _sig_lock_imbalance(f) -> str:
    held = [f"holder:{f.holder}"] if f.holder else []
    if f.check == "walk":
        return "/".join(["walk:" + (f"inc:{where(f.alloc_sites)}" if f.alloc_sites else
                                    f"dec:{where(f.free_sites)}")] + held)
    if f.alloc_sites:  # the open inc, whose holder, and the release that let that holder go
        return "/".join([f"inc:{where(f.alloc_sites)}"] + held + [release_path(f.lost_sites)] * bool(f.lost_sites))
    return f"dec:{where(f.free_sites)}" if f.free_sites else "lock_ref"


def _sig_accounting_drift(f) -> str:
    if f.check:  # (a target's own invariant names its check)
        return f.check
    return f"insert:{where(f.alloc_sites)}" if f.alloc_sites else "identity"  # a tree insert past kv_committed_len


def _sig_hang(f) -> str:
    if f.alloc_sites:  # the watchdog's: the frame the step was stuck in
        return f"stuck:{where(f.alloc_sites)}"
    return "idle" + f"/{f.check}" * bool(f.check)  # what is stuck where (Target.stuck())


def _sig_liveness(f) -> str:
    return "progress" + f"/{f.check}" * bool(f.check)  # where the request sits (Root.where)


def _sig_crash(f) -> str:  # the raise; then what the target says of the request it raised on (Target.crash_by)
    return f"{f.message.split(':', 1)[0]}@{where(f.alloc_sites)}" + f"/{f.check}" * bool(f.check)


# ----------------------------------------------------------------------------- console sections


def _read(f) -> list:
    return [("stack", "read at:", f.read_sites)] if f.read_sites else []


def _alloc(f) -> list:
    return [("stack", "allocated at:", f.alloc_sites)] if f.alloc_sites else []


def _memory(f) -> list:
    if not f.memory_state:
        return []
    return [("text", "memory at the crash:", "bold")] + [("text", f"  {line}", "") for line in f.memory_state]


def _con_sites(f) -> list:
    return _read(f) + _alloc(f)


def _con_stale_kv(f) -> list:
    """Where the read was, then the free behind it when the slots were freed under their owner (the frees
    a ``freed:`` signature names), then the allocation."""
    freed = [("stack", "freed at:", f.free_sites)] if f.free_sites else []
    return _read(f) + freed + _alloc(f)


def _con_double_free(f) -> list:
    return [("stack", "freed again at:", f.free_sites), ("stack", "previously freed at:", f.prev_free_sites)] + \
        _con_sites(f)


def _freed_by(f) -> list[str]:
    # a use-after-free's line for what the target says of the premature free (Target.freed_by): console, JUnit
    return [f"what the target says of that free: {f.lost_by}"] * bool(f.lost_by)


def _con_use_after_free(f) -> list:
    out = []
    if f.free_sites or f.used_by:  # (files recorded before 2026-12 have neither)
        out += [("stack", "freed (too early) at:", f.free_sites),
                ("text", f"still used by: {', '.join(f.used_by) or 'a live owner'}", "")]
        out += [("text", line, "") for line in _freed_by(f)]
        out += [("stack", "used after the free at:", f.read_sites)] if f.read_sites else []
    return out + _alloc(f)


def _con_leak(f) -> list:
    out = _con_sites(f)
    if f.lost_sites:
        out.append(("stack", "its last owner let go of it at (a release that left it out):", f.lost_sites))
    elif f.lost_from:
        out.append(("text", f"its last owner was dropped from: {f.lost_from} (no release freed anything of it)", ""))
    elif f.lost_by:
        out.append(("text", f"no owner held it, no release named it; what lost it (the target's record): {f.lost_by}",
                    ""))
    return out


def _con_lock_imbalance(f) -> list:
    return _read(f) + [("stack", "unreleased lock taken at:", f.alloc_sites)] * bool(f.alloc_sites) + \
        [("stack", "unmatched release at:", f.free_sites)] * bool(f.free_sites)


def _con_accounting_drift(f) -> list:
    if f.alloc_sites and not f.check:  # a tree insert past kv_committed_len
        return _read(f) + [("stack", "cached into the tree at:", f.alloc_sites)]
    return _con_sites(f)


def _con_hang(f) -> list:
    return _read(f) + ([("stack", "stuck at:", f.alloc_sites)] + _memory(f) if f.alloc_sites else [])


def _con_crash(f) -> list:
    freed = [("stack", "the state it met began at (last free):", f.free_sites)] if f.free_sites else []
    said = [("text", f"the target says of the request it raised on: {f.check}", "")] if f.check else []
    return _read(f) + [("stack", "raised at:", f.alloc_sites)] + said + freed + _memory(f)


# ----------------------------------------------------------------------------- the table

# what SARIF and JUnit call each recorded stack, unless a kind's ``labels`` say otherwise
STACK_LABELS = {"alloc_sites": "allocated at", "free_sites": "freed at", "prev_free_sites": "previously freed at",
                "read_sites": "read at", "lost_sites": "its last owner let go of it at"}
STACK_ORDER = tuple(STACK_LABELS)  # every stack a Finding records (its site lists), in reading order


class FindingKind(NamedTuple):
    name: str
    rank: int  # sort order within one check: root causes first
    rule: str  # SARIF rule name
    short: str
    full: str
    level: str  # SARIF level: "error" (memory safety) | "warning" (accounting drift, liveness, hang)
    tags: tuple[str, ...]
    headline: Callable[[Any, str, str], str]  # (finding, units, first allocation site) -> summary line
    signature: Callable[[Any], str] = _sig_sites  # the signature's parts after kind/pool/
    console: Callable[[Any], list] = _con_sites  # the console report's sections
    labels: tuple[tuple[str, str], ...] = ()  # stack field -> SARIF/JUnit label, over STACK_LABELS
    stacks: tuple[str, ...] = STACK_ORDER  # the stacks' reading order (SARIF, JUnit)
    primary: tuple[str, ...] = ("alloc_sites", "read_sites")  # which stack anchors a SARIF result, first tried
    precision: str = "very-high"  # SARIF rule precision
    facts: Callable[[Any], list[str]] = lambda f: []  # extra JUnit failure lines
    props: Callable[[Any], dict] = lambda f: {}  # extra SARIF result properties
    lifecycle_end: Callable[[Any], tuple[str, str] | None] = lambda f: None  # last timeline line, style
    allocates: bool = True  # alloc_sites are where the units were allocated
    # what the exported client watches for: "crash" | "hang" | "memory" (the pool gauges) | "output" (a wrong
    # answer: the script cannot judge it and says so, exit 3)
    expect: str = "memory"
    symptom: str = ""  # what a maintainer sees on a server ("": the engine's pool line)

    def stack_label(self, key: str) -> str:
        return dict(self.labels).get(key, STACK_LABELS[key])


def _leak_end(f) -> tuple[str, str]:
    last = next((o.owner for o in reversed(f.owner_history) if o.owner != "-"), None)
    return f"never freed; last owner: {last or 'none seen'}", "bold red"


def _read_at(f) -> str:
    return f.read_sites[0].short() if f.read_sites else "?"


TABLE: tuple[FindingKind, ...] = (
    FindingKind(
        "leak", 4, "Leak",
        "KV-cache memory leaked: allocated units that no live owner references",
        "Token slots, pages, blocks or request rows were allocated from a KV-cache pool and are no longer "
        "reachable from any of the engine's roots (live requests, session slots, the radix tree, "
        "in-flight copies), yet were never freed. An indirect leak is reachable only from another "
        "leaked unit, as in LeakSanitizer. Each leak shrinks the pool for good, until the engine "
        "stalls or rejects requests.",
        "error", ("memory-safety", "leak"),
        lambda f, what, site: (f"{'Indirect' if f.indirect else 'Direct'} leak of {what} in pool {f.pool}, "
                               f"allocated at {site}"),
        signature=_sig_leak, console=_con_leak,
        facts=lambda f: ["indirect leak (reachable only from a leaked owner)" if f.indirect else "direct leak"],
        props=lambda f: {"indirect": f.indirect}, lifecycle_end=_leak_end),
    FindingKind(
        "use-after-free", 0, "UseAfterFree",
        "A live owner references KV-cache units that the pool holds as free",
        "A live request, session slot or radix-tree node references units that have already been "
        "returned to the pool. The allocator can hand them to another request, whose KV then "
        "overwrites the first one's, or the first one's writes corrupt the second's.",
        "error", ("memory-safety", "use-after-free"),
        lambda f, what, site: (f"Use-after-free of {what} in pool {f.pool}, " + (
            f"freed at {f.free_sites[0].short()} while still used by {', '.join(f.used_by[:3]) or 'a live owner'}; "
            if f.free_sites else "") + f"allocated at {site}"),
        signature=_sig_use_after_free, console=_con_use_after_free,
        labels=(("free_sites", "freed (too early) at"), ("read_sites", "used after the free at")),
        stacks=("free_sites", "read_sites", "alloc_sites"), primary=("free_sites", "alloc_sites"),
        facts=_freed_by,
        props=lambda f: {"freed_by": f.lost_by} if f.lost_by else {}),
    FindingKind(
        "double-free", 1, "DoubleFree",
        "KV-cache units freed while already free",
        "Units were returned to their pool while they were already free. The free list then holds "
        "them twice, so two requests can later be given the same slots, and the pool's available "
        "count exceeds its size.",
        "error", ("memory-safety", "double-free"),
        lambda f, what, site: (f"Double free of {what} in pool {f.pool}, freed again at "
                                  f"{f.free_sites[0].short() if f.free_sites else 'a site not recorded'}"),
        signature=_sig_double_free, console=_con_double_free, labels=(("free_sites", "freed again at"),),
        stacks=("free_sites", "prev_free_sites", "alloc_sites", "read_sites"), primary=("free_sites", "alloc_sites")),
    FindingKind(
        "aliasing", 3, "Aliasing",
        "KV-cache units privately owned by two owners at once",
        "The same units are held privately (not shared through the radix tree) by two owners, so one "
        "owner's writes or free corrupt the other's KV.",
        "error", ("memory-safety", "aliasing"),
        lambda f, what, site: f"Aliasing: {what} in pool {f.pool} privately owned twice, allocated at {site}"),
    FindingKind(
        "stale-kv", 2, "StaleKv",
        "A request read KV written for another prefix, or never written",
        "A request attended to KV-cache slots whose content was written for a different token prefix, "
        "or was never written at all: the model silently computes with wrong keys and values. Found "
        "by kvaudit's shadow content tags, checked on every KV read.",
        "error", ("memory-safety", "correctness", "stale-kv"),
        lambda f, what, site: f"Stale KV: {what} in pool {f.pool} read at {_read_at(f)}: {f.message}",
        signature=_sig_stale_kv, console=_con_stale_kv,
        stacks=("read_sites", "alloc_sites", "free_sites", "prev_free_sites"), expect="output",
        symptom="a request's answer differs from the same prompt's alone (it attended to another prefix's KV); "
                "the pool gauges do not show it"),
    FindingKind(
        "accounting-drift", 6, "AccountingDrift",
        "A pool's accounting identity or counters disagree with its memory",
        "The target's accounting identity (by default available + evictable + protected + "
        "session_held + uncached == total), one of the engine's counters, or the engine's own "
        "check_memory() fails while every allocated unit is reachable: memory is intact, but the "
        "numbers the scheduler admits and evicts by are wrong (or the check itself is).",
        "warning", ("correctness", "accounting"),
        lambda f, what, site: f"Accounting drift in pool {f.pool}: {f.message}",
        signature=_sig_accounting_drift, console=_con_accounting_drift, precision="high"),
    FindingKind(
        "lock-imbalance", 5, "LockImbalance",
        "A radix-tree node's lock_ref does not match its live holders",
        "At idle, a radix-tree node's lock_ref differs from the number of live holders (requests, "
        "session slots, in-flight HiCache copies). A leaked lock keeps its tokens protected, and so "
        "unevictable, forever, while the accounting identity still balances.",
        "error", ("memory-safety", "leak", "lock-ref"),
        lambda f, what, site: f"Lock-ref imbalance on {what} of pool {f.pool}: {f.message}",
        signature=_sig_lock_imbalance, console=_con_lock_imbalance,
        labels=(("alloc_sites", "unreleased lock taken at"), ("free_sites", "unmatched release at"))),
    FindingKind(
        "liveness", 7, "Liveness",
        "A request holding KV, or aborted, made no progress; or one was lost, or its abort ignored",
        "A request that holds KV memory, or that was aborted, made no progress for the liveness "
        "budget of scheduler steps: a parked request nobody schedules, or an abort that never ends "
        "its request, keeps its memory forever. Or a request was lost: the engine went idle with "
        "it never answered and held nowhere (a retraction that dropped it instead of queueing it). Or the engine "
        "took an abort of an unanswered request and answered it with another reason (the abort ignored).",
        "warning", ("liveness",),
        lambda f, what, site: f"Liveness: {f.message}",
        signature=_sig_liveness),
    FindingKind(
        "hang", 8, "Hang",
        "The engine never became idle",
        "idle() did not reach quiescence within its step budget: work stays queued with no way to "
        "finish it. (A wait for memory that open sessions hold is not reported: a serving engine waits too.)",
        "warning", ("liveness", "hang"),
        lambda f, what, site: f"Hang: {f.message}",
        signature=_sig_hang, console=_con_hang, allocates=False,
        expect="hang", symptom="a request never answers while the pool has room"),
    FindingKind(
        "crash", 9, "Crash",
        "The engine raised an exception",
        "The engine raised an exception while running the program; the finding carries the exception "
        "and its traceback.",
        "error", ("crash",),
        lambda f, what, site: f"Engine crash: {f.message}",
        signature=_sig_crash, console=_con_crash, labels=(("alloc_sites", "raised at"),), allocates=False,
        expect="crash", symptom="the server stops answering (the scheduler raised)"),
    FindingKind(
        "unmatchable-prefix", 10, "UnmatchablePrefix",
        "A key the radix tree took over is one its own prefix match refuses",
        "A key was inserted into the radix tree in a state the engine's own prefix match refuses (for "
        "example a sliding-window key that does not end with a whole window of live KV): the match the "
        "inserting request makes after the insert stops short, so the request and the tree both count "
        "the KV behind it as theirs (kept twice, or freed under the tree at release).",
        "error", ("memory-safety", "correctness"),
        lambda f, what, site: f"Unmatchable prefix: {what} in pool {f.pool}: {f.message}"),
)

BY_NAME: dict[str, FindingKind] = {k.name: k for k in TABLE}
KINDS = tuple(k.name for k in TABLE)  # in report order


def lookup(kind: str) -> FindingKind:
    """The row of ``kind``; for a kind no row describes (a plugin target's own), a generic one: ranked
    after every known kind, its SARIF rule named from the kind, its headline ``<kind> in pool <pool>:
    <message>``, its signature the allocation site."""
    row = BY_NAME.get(kind)
    if row is not None:
        return row
    return FindingKind(
        kind, len(BY_NAME), "".join(w.capitalize() for w in re.split(r"[^A-Za-z0-9]+", kind) if w) or "Finding",
        f"kvaudit finding: {kind}", f"A kvaudit finding of kind {kind}.", "error", (),
        lambda f, what, site: f"{f.kind} in pool {f.pool}: {f.message}")
