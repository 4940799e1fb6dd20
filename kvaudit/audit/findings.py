"""Findings: plain data, rendered elsewhere.

A finding's *signature* is what deduplicates it, in the manner of syzkaller's crash titles: a
promise that two findings with one signature are one bug. It is the kind, the pool and up to two
code sites (each the innermost frame outside the allocator and kvaudit, ``function@file``). The
release that lost a leaked unit (or let a lock's holder go) is named by its *path* instead: the first
frame above the release plumbing every path shares (the target's ``release_entries``, e.g.
``release_kv_cache``), i.e. the caller that chose to finish, abort, retract or close (``Site.entry``,
:func:`_path`). An allocation in a function that grows a request's own KV (the target's
``request_kv_allocs``: its prefill and its decode allocation) is named by that role, ``request-kv``
(``Site.request_kv``, :func:`_allocated`), since which of them allocated a lost unit depends on the
program, not on the bug:

=================  =====================================================================
kind               sites
=================  =====================================================================
leak               allocated at (or ``request-kv``); where the unit lost its last owner: the path
                   of the release that forgot it (``lost_sites``), else the place the owner was
                   dropped from (``from:waiting``, ``lost_from``)
use-after-free     allocated at (or ``request-kv``); where it was freed while an owner still used
                   it (a unit freed under a request reading it, handed on and freed again by its
                   next holder before the next check: the first of those frees)
double-free        freed first at; freed again at
lock-imbalance     the unmatched ``inc_lock_ref`` (``inc:``), then its holder's kind when not a
                   request (``holder:session``, ``holder:hicache-write-through``) and the path of
                   the release that let the holder go without it (its device lock released, its
                   host pin kept); or the unmatched ``dec_lock_ref`` (``dec:``); when incs and
                   decs pair up per node, the live holder's lock that walked another path
                   (``walk:``, with the holder's kind)
stale-kv           content written for another prefix in a slot freed under its reader: that free
                   (``freed:``); else allocated at (or ``request-kv``), and ``unwritten`` (never
                   written) or ``overwritten`` (written for another prefix, no free recorded)
crash              the exception type; the raising frame
accounting-drift   the check that failed: ``identity``, ``counter:evictable,protected`` (a term
                   against its recount), ``free_list``, ``engine_check``; or the tree insert that
                   cached past ``kv_committed_len`` (``insert:function@file``)
hang               the frame a step was stuck in (``stuck:function@file``, the watchdog), else
                   ``idle`` and what the target says is stuck (``Target.stuck()``, e.g.
                   ``idle/prealloc:memory``, ``idle/transfer:kv-transfer``)
liveness           ``progress`` and where the request sits and what it is (``Root.where``, e.g.
                   ``progress/transfer:holds-kv``, ``progress/waiting:aborted``)
=================  =====================================================================

A finding from a target's own invariant (``Target.invariant_findings``) with a ``check`` adds it as a
last part (``check:ref_cnt``, ``check:orphan-table``), so that two invariants broken at one site stay
two bugs; its accounting drift is ``accounting-drift/<pool>/<check>`` as above.

No part names a request id or a count, and line numbers are left out, so a signature survives edits
elsewhere in a file and one cause reads the same in every program. A leak from a fault *inside* the
shared release plumbing shows once per path that reaches it (a release that forgets a page on every
path): the paths tell two faults in two callers apart, which the plumbing's own frame cannot. A
premature free (use-after-free, double free) keeps its innermost frame: the free there is often
another owner's correct release, whose path says nothing about the cause.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field

from kvaudit.audit import kinds as _kinds

KINDS, NO_SITE_KINDS = _kinds.KINDS, _kinds.NO_SITE_KINDS  # the finding kinds' one table


# the directory holding the kvaudit package, and the built-in engine and the examples beside it
_SOURCE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def portable_path(path: str) -> str:
    """``path`` relative to the directory holding the kvaudit package when it lies inside it
    (so replay files do not carry one machine's checkout path), else unchanged."""
    ap = os.path.abspath(path)
    return os.path.relpath(ap, _SOURCE_ROOT) if ap.startswith(_SOURCE_ROOT + os.sep) else path


def source_path(path: str) -> str:
    """The readable file behind a :func:`portable_path`."""
    return path if os.path.isabs(path) else os.path.join(_SOURCE_ROOT, path)


@dataclass(frozen=True)
class Site:
    """A stack frame: ``file`` (see :func:`portable_path`), ``line`` (1-based), ``function`` and the
    line's ``source`` text, kept so that a report renders the same on another checkout; ``entry``
    marks a frame of the target's shared release plumbing (``Target.release_entries``), which a
    signature looks past to the frame that chose the release path; ``request_kv`` a function that
    grows a request's own KV (``Target.request_kv_allocs``: prefill and decode), which a signature
    names by that role (``request-kv``) as an allocation site."""

    file: str
    line: int
    function: str
    source: str = field(default="", compare=False)  # the line's text when recorded ("" if unknown)
    entry: bool = field(default=False, compare=False)  # one of the target's release entries
    request_kv: bool = field(default=False, compare=False)  # one of the target's request_kv_allocs

    def short(self) -> str:
        return f"{os.path.basename(self.file)}:{self.line} in {self.function}"


@dataclass
class OwnerChange:
    """From ``op_index``/``step`` on, the units were held by ``owner`` (``"-"`` = nobody)."""

    op_index: int
    step: int
    owner: str
    event: str = ""


@dataclass
class Finding:
    kind: str
    pool: str
    message: str
    # "slot" (tokens), "page", "row" or "block" (a "blocks" pool's unit: reference-counted blocks, vLLM's)
    unit: str = "slot"
    slots: list[int] = field(default_factory=list)  # token slots (whole pages or blocks), or rows for a row pool
    num_units: int = 0  # pages or blocks (== slots when page_size is 1) or rows
    alloc_sites: list[Site] = field(default_factory=list)  # innermost first
    free_sites: list[Site] = field(default_factory=list)
    prev_free_sites: list[Site] = field(default_factory=list)  # double free: the earlier free
    read_sites: list[Site] = field(default_factory=list)  # stale KV: where read; use-after-free: where used
    # leak: where the unit lost its last owner (the release that let go of the owner's other units,
    # or the op that dropped it); empty when it had none at any check
    lost_sites: list[Site] = field(default_factory=list)
    lost_from: str = ""  # leak: where the target last held the unit's owner (Root.where), if it said
    # accounting-drift: which check failed (identity, counter:<terms>, free_list, engine_check); "" = identity.
    # stale-kv: the cause (freed, unwritten, overwritten); lock-imbalance: "walk" (incs and decs pair up);
    # hang: what is stuck (Target.stuck(), e.g. "prealloc:memory"); liveness: where the request that made
    # no progress sits and what it is ("transfer:holds-kv", "waiting:aborted"; Root.where, "-" if unsaid)
    check: str = ""
    # lock-imbalance: the kind of the blamed lock's holder when not a request (kvaudit.audit.locks.holder_kind:
    # "session", "hicache-write-through", ...); "" for a request, or when no holder was ever seen with it
    holder: str = ""
    used_by: list[str] = field(default_factory=list)  # use-after-free: owners still referencing the units
    indirect: bool = False  # leak reachable only from a leaked owner (LeakSanitizer's indirect leak)
    owner_history: list[OwnerChange] = field(default_factory=list)
    op_index: int = -1
    step: int = -1
    engine_check: list[str] = field(default_factory=list)  # the engine's own check_memory() lines
    traceback: str | None = None
    # crash on out-of-memory: who held the memory at that moment (identity terms, largest holders,
    # locks with no live holder, the last retraction), one plain line each (kvaudit.audit.memstate)
    memory_state: list[str] = field(default_factory=list)
    # the engine's check_memory() lines once the program was drained to idle after the finding
    # (an engine's idle check fires then); [] when not recorded (see kvaudit.audit.runner.execute's drain)
    engine_check_at_idle: list[str] = field(default_factory=list)

    @property
    def signature(self) -> str:
        """``kind/pool/site[/site]`` (see the module doc; each kind's parts are its row's ``signature`` in
        :mod:`kvaudit.audit.kinds`); stable across programs for one root cause."""
        return f"{self.kind}/{self.pool}/{_kinds.lookup(self.kind).signature(self)}"

    def to_dict(self) -> dict:
        d = asdict(self)
        if not d["engine_check_at_idle"]:
            del d["engine_check_at_idle"]  # not recorded: files written without a drain stay as they were
        if not d["holder"]:
            del d["holder"]  # (only a lock-imbalance names one)
        for key in _SITE_LISTS:  # a site's flags only where set (most frames are neither)
            for site in d[key]:
                for flag in ("entry", "request_kv"):
                    if not site[flag]:
                        del site[flag]
        d["signature"] = self.signature
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Finding":
        """A finding from its JSON form. Raises ``ValueError`` naming the first field whose type or
        value is wrong (replay files are user input)."""
        d = {k: v for k, v in d.items() if k != "signature"}
        unknown = sorted(set(d) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"unknown field {unknown[0]!r}")
        for key in ("kind", "pool", "message"):
            _want(d, key, str)
        _want(d, "unit", str, choices=("slot", "page", "row", "block"))
        _want(d, "slots", list, item=int)
        _want(d, "num_units", int)
        _want(d, "indirect", bool)
        _want(d, "op_index", int, low=-1)
        _want(d, "step", int, low=-1)
        _want(d, "engine_check", list, item=str)
        _want(d, "memory_state", list, item=str)
        _want(d, "engine_check_at_idle", list, item=str)
        if d.get("traceback") is not None:
            _want(d, "traceback", str)
        if d.get("unit") in ("page", "block") and d.get("slots") and not d.get("num_units"):
            raise ValueError(f"num_units must be positive for {d['unit']}s")
        _want(d, "used_by", list, item=str)
        _want(d, "lost_from", str)
        _want(d, "check", str)
        _want(d, "holder", str)
        for key in _SITE_LISTS:
            _want(d, key, list, item=dict)
            sites = []
            for i, site in enumerate(d.get(key, [])):
                where = f"{key}[{i}]"
                if set(site) - _SITE_FIELDS:
                    raise ValueError(f"{where}: unknown field {sorted(set(site) - _SITE_FIELDS)[0]!r}")
                for f, t in (("file", str), ("line", int), ("function", str), ("source", str), ("entry", bool),
                             ("request_kv", bool)):
                    _want(site, f, t, where=where, required=f in ("file", "line", "function"))
                sites.append(Site(**site))
            d[key] = sites
        _want(d, "owner_history", list, item=dict)
        history = []
        for i, o in enumerate(d.get("owner_history", [])):
            where = f"owner_history[{i}]"
            for f, t in (("op_index", int), ("step", int), ("owner", str), ("event", str)):
                _want(o, f, t, where=where, required=f != "event")
            history.append(OwnerChange(**o))
        d["owner_history"] = history
        return cls(**d)

    def listed(self) -> tuple[str, list[int]]:
        """What a report lists of the units: ``("rows", row ids)``, ``("blocks", block ids)`` (a
        ``"blocks"`` pool counts in blocks, as vLLM does), else ``("slots", token slots)``."""
        if self.unit == "block" and self.num_units and self.slots:
            per = max(1, len(self.slots) // self.num_units)  # the slots list whole blocks
            return "blocks", [s // per for s in self.slots[::per]]
        return ("rows" if self.unit == "row" else "slots"), list(self.slots)

    def summary(self) -> str:
        """One line in LeakSanitizer's manner: the kind's ``headline`` (:mod:`kvaudit.audit.kinds`)."""
        def many(k: int, word: str) -> str:
            return f"{k} {word}" + ("" if k == 1 else "s")

        n = len(self.slots)
        what = (many(self.num_units, "row") if self.unit == "row" else many(self.num_units, "block")
                if self.unit == "block" else
                f"{many(n, 'slot')} ({many(self.num_units, 'page')})" if self.unit == "page" else many(n, "slot"))
        site = self.alloc_sites[0].short() if self.alloc_sites else "unknown site"
        return _kinds.lookup(self.kind).headline(self, what, site)


_SITE_LISTS = ("alloc_sites", "free_sites", "prev_free_sites", "read_sites", "lost_sites")
_SITE_FIELDS = {"file", "line", "function", "source", "entry", "request_kv"}


_where, _allocated, _path = _kinds.where, _kinds.allocated, _kinds.release_path  # (how a signature names sites)


def _want(d: dict, key: str, typ: type, item: type | None = None, low: int = 0, choices: tuple = (),
          where: str = "", required: bool = False) -> None:
    """Check ``d[key]`` (when present, or when ``required``): of type ``typ`` (bools are not ints),
    ints at least ``low``, one of ``choices``, list items of type ``item``. Raises ValueError."""
    name = f"{where}.{key}" if where else key
    if key not in d:
        if required:
            raise ValueError(f"{name}: missing")
        return
    v = d[key]

    def ok(x, t) -> bool:
        if t is int:
            return isinstance(x, int) and not isinstance(x, bool) and x >= low
        return isinstance(x, t)

    if not ok(v, typ):
        raise ValueError(f"{name}: want {'a non-negative ' if typ is int and low == 0 else ''}"
                         f"{typ.__name__}, not {v!r:.40}")
    if choices and v not in choices:
        raise ValueError(f"{name}: want one of {', '.join(choices)}, not {v!r:.40}")
    if item is not None and not all(ok(x, item) for x in v):
        raise ValueError(f"{name}: want a list of {item.__name__}s")
