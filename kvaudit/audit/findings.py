"""Findings: plain data, rendered elsewhere; a finding's signature deduplicates it.

Design notes (signatures per kind): docs/internals/audit.md.
"""

from __future__ import annotations

import functools
import os
import sys
from dataclasses import asdict, dataclass, field

from kvaudit.audit import kinds as _kinds
from kvaudit.config import json_value

KINDS = _kinds.KINDS  # the finding kinds' one table


# the directory holding the kvaudit package, and the built-in engine and the examples beside it
_SOURCE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KVAUDIT_DIR = os.path.join(_SOURCE_ROOT, "kvaudit")  # kvaudit's own files: never an engine frame


def portable_path(path: str) -> str:
    """``path`` as a replay file records it, the same on every machine: relative to the directory holding
    the kvaudit package when it lies inside it; a module of an installed package (a package directory
    under a ``sys.path`` root: site-packages, a release overlay) relative to that root, from its package
    (``vllm/v1/core/sched/scheduler.py``); another machine's site-packages path (a file recorded before
    2026-12) from its package too; else unchanged."""
    return _portable(path, tuple(sys.path))


@functools.lru_cache(maxsize=4096)
def _portable(path: str, syspath: tuple[str, ...]) -> str:
    ap = os.path.abspath(path)
    ours = ap.startswith(_SOURCE_ROOT + os.sep)
    roots = [r for r in map(os.path.abspath, filter(os.path.isabs, syspath)) if ap.startswith(r + os.sep)]
    # a root inside the checkout (a .venv's site-packages there) is nearer than the checkout
    for root in sorted((r for r in roots if not ours or len(r) > len(_SOURCE_ROOT)), key=len, reverse=True):
        rel = os.path.relpath(ap, root)
        top = rel.split(os.sep, 1)[0]
        if os.sep in rel and os.path.isfile(os.path.join(root, top, "__init__.py")):
            return rel.replace(os.sep, "/")
    if ours:
        return os.path.relpath(ap, _SOURCE_ROOT)
    return _foreign_package_path(path) or path


def _foreign_package_path(path: str) -> str | None:
    """The part of an absolute ``path`` after its last ``site-packages``/``dist-packages`` directory."""
    p = path.replace("\\", "/")
    i = max(p.rfind("/site-packages/"), p.rfind("/dist-packages/"))
    return p[p.index("/", i + 1) + 1:] if i >= 0 and os.path.isabs(path) else None


def installed(path: str) -> bool:
    """Whether a recorded relative ``path`` is an installed package's file (:func:`portable_path`), not
    this checkout's: none here, one under a ``sys.path`` root."""
    return bool(path) and not os.path.isabs(path) and source_path(path) != os.path.join(_SOURCE_ROOT, path)


def source_path(path: str) -> str:
    """The readable file behind a :func:`portable_path`: a repo-relative path in this checkout, a package's
    in the ``sys.path`` root that holds it (in import order), another machine's site-packages path (an old
    file) as the package installed here; a path found nowhere as it was (repo-relative: in this checkout)."""
    if os.path.isabs(path):
        if os.path.exists(path) or _foreign_package_path(path) is None:
            return path
        path = _foreign_package_path(path)
        here = None
    else:
        here = os.path.join(_SOURCE_ROOT, path)
        if not path or os.path.exists(here):
            return here
    for root in filter(os.path.isabs, sys.path):
        candidate = os.path.join(root, path)
        if os.path.isfile(candidate):
            return candidate
    return here or path


@dataclass(frozen=True)
class Site:
    """A stack frame; ``source`` is kept so that a report renders the same on another checkout."""

    file: str
    line: int  # 1-based
    function: str
    source: str = field(default="", compare=False)  # the line's text when recorded ("" if unknown)
    entry: bool = field(default=False, compare=False)  # Target.release_entries: a signature looks past it
    request_kv: bool = field(default=False, compare=False)  # Target.request_kv_allocs: named "request-kv"

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
    # leak: the release where the unit lost its last owner; empty when it had none at any check
    lost_sites: list[Site] = field(default_factory=list)
    lost_from: str = ""  # leak: where the target last held the unit's owner (Root.where), if it said
    # leak of a unit no owner held and no release named: what lost it, as the target says (Target.lost_by);
    # use-after-free: what the target says of the premature free (Target.freed_by)
    lost_by: str = ""
    # accounting-drift: the check that failed; stale-kv: the cause; lock-imbalance: "walk"; hang: what is
    # stuck; liveness: where the request sits and what it is; crash: what the target says of the request it
    # raised on (Target.crash_by) (docs/internals/audit.md, the signature table)
    check: str = ""
    # lock-imbalance: the blamed lock's holder's kind (locks.holder_kind); "" for a request or none seen
    holder: str = ""
    used_by: list[str] = field(default_factory=list)  # use-after-free: owners still referencing the units
    indirect: bool = False  # leak reachable only from a leaked owner (LeakSanitizer's indirect leak)
    owner_history: list[OwnerChange] = field(default_factory=list)
    op_index: int = -1
    step: int = -1
    engine_check: list[str] = field(default_factory=list)  # the engine's own check_memory() lines
    traceback: str | None = None
    # crash on out-of-memory: who held the memory at that moment (kvaudit.audit.memstate)
    memory_state: list[str] = field(default_factory=list)
    # the engine's check_memory() once drained to idle after the finding; [] when not recorded (execute's drain)
    engine_check_at_idle: list[str] = field(default_factory=list)

    @property
    def signature(self) -> str:
        """``kind/pool/site[/site]`` (the kind's row in :mod:`kvaudit.audit.kinds`); stable across
        programs for one root cause."""
        return f"{self.kind}/{self.pool}/{_kinds.lookup(self.kind).signature(self)}"

    def to_dict(self) -> dict:
        d = asdict(self)
        if not d["engine_check_at_idle"]:
            del d["engine_check_at_idle"]  # not recorded: files written without a drain stay as they were
        for key in ("holder", "lost_by"):  # (only a lock-imbalance names a holder; few leaks a lost_by)
            if not d[key]:
                del d[key]
        for key in _kinds.STACK_ORDER:  # a site's flags only where set (most frames are neither)
            for site in d[key]:
                for flag in ("entry", "request_kv"):
                    if not site[flag]:
                        del site[flag]
        d["signature"] = self.signature
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Finding":
        """A finding from its JSON form. Raises ``ValueError`` naming the first field whose type or
        value is wrong (replay files are user input), a kind outside :data:`KINDS` included."""
        d = {k: v for k, v in d.items() if k != "signature"}
        unknown = sorted(set(d) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"unknown field {json_value(unknown[0])}")
        if d.get("traceback") is None:
            d.pop("traceback", None)
        for key, typ, item, low in _FIELD_TYPES:
            _want(d, key, typ, item=item, low=low, choices=_UNITS if key == "unit" else ())
        if "kind" in d and d["kind"] not in KINDS:  # (no run yields one; a suppression file refuses the name too)
            raise ValueError(f"unknown kind {json_value(d['kind'], 60)} (valid: {', '.join(KINDS)})")
        if d.get("unit") in ("page", "block") and d.get("slots") and not d.get("num_units"):
            raise ValueError(f"num_units must be positive for {d['unit']}s")
        for key in _kinds.STACK_ORDER:
            d[key] = _records(d, key, Site, _SITE_TYPES, required=3)
        d["owner_history"] = _records(d, "owner_history", OwnerChange, _OWNER_TYPES, required=3)
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


def report_order(findings: list[Finding]) -> list[Finding]:
    """``findings`` as reports list them: by when they were detected (op, then scheduler step), then by
    signature, so that two findings of one op are listed alike by every command that reports them (a fuzz's
    triage puts the finding it chased first; a replay, the order the checks met them). A replay file keeps
    its own order: its first finding is the one ``minimize`` and ``ci`` follow."""
    return sorted(findings, key=lambda f: (f.op_index, f.step, f.signature))


_UNITS = ("slot", "page", "row", "block")
# (field, type, item type, least int) in the order from_dict checks them
_FIELD_TYPES = (("kind", str, None, 0), ("pool", str, None, 0), ("message", str, None, 0), ("unit", str, None, 0),
                ("slots", list, int, 0), ("num_units", int, None, 0), ("indirect", bool, None, 0),
                ("op_index", int, None, -1), ("step", int, None, -1), ("engine_check", list, str, 0),
                ("memory_state", list, str, 0), ("engine_check_at_idle", list, str, 0), ("traceback", str, None, 0),
                ("used_by", list, str, 0), ("lost_from", str, None, 0), ("lost_by", str, None, 0),
                ("check", str, None, 0),
                ("holder", str, None, 0))
_SITE_TYPES = (("file", str), ("line", int), ("function", str), ("source", str), ("entry", bool), ("request_kv", bool))
_OWNER_TYPES = (("op_index", int), ("step", int), ("owner", str), ("event", str))


def _records(d: dict, key: str, cls: type, types: tuple, required: int) -> list:
    """``d[key]``, a list of dicts, as ``cls`` records, each field checked (the first ``required`` must
    be there). Raises ValueError."""
    _want(d, key, list, item=dict)
    out = []
    for i, rec in enumerate(d.get(key, [])):
        where = f"{key}[{i}]"
        unknown = sorted(set(rec) - {f for f, _ in types})
        if unknown:
            raise ValueError(f"{where}: unknown field {json_value(unknown[0])}")
        for j, (f, t) in enumerate(types):
            _want(rec, f, t, where=where, required=j < required)
        out.append(cls(**rec))
    return out


_JSON_TYPES = {str: "a string", list: "a list", dict: "an object", bool: "true or false"}


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

    def what(t) -> str:  # spelled as JSON names it
        return f"an integer >= {low}" if t is int else _JSON_TYPES[t]

    if not ok(v, typ):
        raise ValueError(f"{name}: want {what(typ)}, got {json_value(v, 40)}")
    if choices and v not in choices:
        raise ValueError(f"{name}: want one of {', '.join(map(json_value, choices))}, got {json_value(v, 40)}")
    if item is not None and not all(ok(x, item) for x in v):
        items = f"integers >= {low}" if item is int else what(item).split()[-1] + "s"  # (strings, objects)
        raise ValueError(f"{name}: want a list of {items}, got {json_value(v, 40)}")
