"""Hooks: wrap a target's pool methods from the outside and keep a ledger of every alloc and free,
each with the op index, the scheduler step and an interned call site, which this module captures.

Design notes (wrappers, sites, fast mode): docs/internals/audit.md.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import linecache
import os
import sys
from operator import attrgetter

import numpy as np
import torch

from kvaudit.audit.findings import KVAUDIT_DIR, Finding, Site, portable_path
from kvaudit.audit.ledger import Event, Ledger, PoolLedger
from kvaudit.audit.locks import LockLedger
from kvaudit.audit.shadow import ShadowKV
from kvaudit.audit.wrappers import PoolWrappers
from kvaudit.config import json_value
from kvaudit.targets.registry import TargetDefinitionError, kind_name

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))


@functools.cache  # (an engine is built per program: inspect.getfile walks the class's module)
def _class_file(cls: type) -> str:
    return os.path.abspath(inspect.getfile(cls))


def _pool_code(target) -> tuple[set[str], set[tuple[str, str]]]:
    """The pools' own code, framework to a stack walk: (files, (file, class name) pairs). A pool class's
    whole file, or, for one that shares a big module with engine code (the target's ``framework_classes``),
    only that class's methods; so too for a pool class defined in the target's own file (a one-file
    plugin), whose engine and target frames are then sites."""
    by_class = tuple(target.framework_classes())
    try:
        own_file = _class_file(type(target))
    except TypeError:  # (a class of no file: one defined in ``python -c``)
        own_file = None
    pool_classes = {type(s.obj) for s in target.pools() if not isinstance(s.obj, by_class)}
    classes = {(_class_file(c), c.__name__) for c in by_class}
    classes |= {(own_file, c.__name__) for c in pool_classes if _class_file(c) == own_file}
    return {KVAUDIT_DIR} | ({_class_file(c) for c in pool_classes} - {own_file}), classes


STACK_DEPTH = 4
_STOP, _READ = 1, 2  # owner lookup per code object (see Auditor._code_info)
OWNER_FRAMES = 3  # innermost engine frames searched for the owner of an allocation
# per slot, the contents (shadow tags) its latest frees took that a stale read's cause is looked for among: the
# last one and three before it (a read of content freed under its reader, rewritten and freed again needs two)
FREED_CONTENTS = 4


_PASS_THROUGH: set[int] = set()  # id() of the code of pass_through() wrappers (their functions keep it alive)


def pass_through(fn):
    """Mark ``fn``, a target's wrapper that runs inside the engine's call chain (an engine method it wraps calls
    engine code back: ``_evict_lru`` calling its ``release``), as a frame a whole stack's walk goes on past: any
    other framework frame above an engine frame ends the engine's part of the stack. Returns ``fn``."""
    _PASS_THROUGH.add(id(fn.__code__))
    return fn


def _is_install_closure(qualname: str) -> bool:
    # a function defined inside a target's install_* method (MyTarget.install_pool.<locals>.wrapper)
    head, sep, _ = qualname.partition(".<locals>.")
    return bool(sep) and head.rpartition(".")[2].startswith("install_")


def _no_site() -> int:
    return -1  # a lean run's capture_site where it collects no site keys (no frame read)


class Auditor(Ledger, PoolWrappers):
    """Installs the hooks on ``target``'s pools and keeps the ledger. ``full_stacks=False`` (the
    fuzzers' fast mode) records only the innermost engine frame of each site, with no owner hint;
    signatures are the same in both modes. ``op_index`` and ``step`` are set by the runner;
    ``pending`` collects findings raised inside hooks until the runner takes them."""

    def __init__(self, target, full_stacks: bool = True, shadow: bool = True, lean: bool = False,
                 site_keys: bool = True):
        self.target = target
        self.full_stacks = full_stacks
        # lean (a search run whose hits a per-step replay reports): no sites and no lock-event records, only
        # what detects (the ledger's flags and events, the shadow tags, the checks) and the site keys; lean
        # and not site_keys: no site keys either (a search's program that does not collect them: site_keys())
        self.lean = lean and not full_stacks
        self.lock_count = 0  # lock events so far (lean or not)
        self._lean_keys: set[tuple[int, int]] = set()  # lean: the frame keys site_keys reports
        if self.lean:
            # (before the wrappers are installed: they bind it)
            self.capture_site = self._lean_site if site_keys else _no_site
        self.ledgers = {spec.name: PoolLedger(spec) for spec in target.pools()}
        self.events: list[Event] = []
        self.owner_changes: list[tuple[int, int, str, np.ndarray, np.ndarray]] = []
        self.owner_names = ["-"]
        self._owner_ids = {"-": 0}
        self.locks = LockLedger(target.lock_holders)
        # False (a sparse search run: its report comes from a per-step replay): lock events are recorded,
        # never paired with holders; the lock-balance oracle's detection reads the target, not the pairing
        self.pair_locks = True
        self._op_index, self._step = -1, 0
        self.pending: list[Finding] = []
        self.checked_upto = 0  # events before this index were seen by the last full oracle check
        self.owner_where: dict[int, str] = {}  # owner id -> Root.where at the last full check
        self.roots_at_check: dict[str, list] = {}  # pool -> the target's roots at the last full check
        # the incremental per-step check's kept state (kvaudit.audit.oracles.incremental; made at the first
        # check), and paranoid mode: the full sweep beside it at every step, any difference an error
        self.bookkeeping = None
        self.paranoid = False
        # pool -> unit -> (its allocation event, (site id, where) it lost its last owner at): see oracles
        self.lost_memo: dict[str, dict[int, tuple[int, tuple[int, str]]]] = {}
        # while a free group's frees are recorded: the users of already-free units, read at the call
        self._group_users: list[str] | None = None
        self._sites: dict[tuple, int] = {}
        self._line_sites: dict[tuple[int, int], int] = {}  # (id(code), line) -> site id, fast mode
        self._lasti_sites: dict[tuple[int, int], int] = {}  # (id(code), f_lasti) -> site id, fast mode
        self._site_frames: list[tuple] = []
        self._undo: list[tuple[object, str]] = []
        self._owner_hint = target.owner_hint
        self._hint_vars = tuple(target.owner_hint_vars)
        self._stop_vars = tuple(target.owner_stop_vars)
        self._skip_files, self._skip_classes = _pool_code(target)
        self._skip_files |= {os.path.abspath(f) for f in target.framework_files()}
        # files of the target that play the engine's part (a driver): sites, though under kvaudit/
        self._engine_files = frozenset(os.path.abspath(f) for f in target.engine_files())
        # the release entry point and the plumbing below it: a free's path is the first frame above them
        self._entries = frozenset(target.release_entries)
        # the functions that grow a request's own KV: a signature names them by that role
        self._kv_allocs = frozenset(target.request_kv_allocs)
        key = (frozenset(self._skip_files), frozenset(self._skip_classes), self._engine_files, self._hint_vars,
               self._stop_vars, self._entries, self._kv_allocs)
        self._info = Auditor._code_info_caches.setdefault(key, {})
        # lean: (id(code), f_lasti) -> line (see _lean_site), kept for the process beside _info (what a key
        # maps to depends only on _info's answers): a search's programs meet the same engine lines, and each
        # new run would otherwise compute their line numbers again (18 per program on eut ``default``)
        self._lean_lines = Auditor._lean_lines_caches.setdefault(key, {})
        for spec in target.pools():
            target.install_pool(spec, self, self._wrap)  # default: install_standard(spec)
        # (node id, +1/-1, site, op, step, lock): lock is "device" (inc/dec_lock_ref) or "host" (host pins)
        self.lock_events: list[tuple[int, int, int, int, int, str]] = []
        # lean and no site keys: a lock event is only counted (the sparse schedule's marks read the count)
        target.install_lock_ledger(self._wrap, self._lock_event if not self.lean or site_keys else self._count_lock)
        target.install_insert_check(self._wrap, self._over_insert)
        self.shadow: ShadowKV | None = None
        self.tags_at_free: dict[str, np.ndarray] = {}  # pool -> [slots] int64 (_keep_tags_at_free)
        kv = target.kv_pools() if shadow else {}
        if kv:
            self.shadow = ShadowKV(kv)
            self._shadow_by = f"target {kind_name(target)}: {type(target).__name__}.install_shadow"
            target.install_shadow(self.shadow, self._wrap, self._stale_kv)
            if not self.lean:
                self._keep_tags_at_free()

    # NOTE: setting ``step`` again to the same value (when the runner checks) closes the lock ledger's
    # interval, so holders are read between ops and steps, when the engine's state is whole. With
    # ``pair_locks`` False both setters only store the value: the runner (after every step) and the ledger's
    # events then use ``_op_index`` and ``_step`` directly, without a property call
    @property
    def op_index(self) -> int:
        return self._op_index

    @op_index.setter
    def op_index(self, value: int) -> None:
        if self.locks.dirty and self.pair_locks:
            self.locks.snapshot(self._op_index, self._step)
        self._op_index = value

    @property
    def step(self) -> int:
        return self._step

    @step.setter
    def step(self, value: int) -> None:
        if self.pair_locks and (self.locks.dirty or (value == self._step and self.locks.busy())):
            self.locks.snapshot(self._op_index, self._step)
        self._step = value

    def lock_snapshot(self) -> None:
        """Pair the lock events so far with the holders live now."""
        self.locks.snapshot(self._op_index, self._step)

    # NOTE: keyed by id(code): hashing a code object hashes its bytecode, which costs more than the capture
    _code_info_caches: dict[tuple, dict[int, tuple[bool, int, bool, bool]]] = {}
    _lean_lines_caches: dict[tuple, dict[tuple[int, int], int]] = {}  # the same key -> _lean_lines
    _codes: dict[int, object] = {}  # keeps every seen code object alive, so its id stays unique

    def _code_info(self, code) -> tuple[bool, int, bool, bool]:
        # (is framework, owner lookup: 0, _STOP (batch-level: no single owner) or _READ (from the frame's
        # locals), is one of the target's release_entries, is one of its request_kv_allocs)
        fn = os.path.abspath(code.co_filename)
        fw = ((fn in self._skip_files or fn.startswith(KVAUDIT_DIR) or fn.startswith(_TORCH_DIR)
               or (fn, code.co_qualname.split(".")[0]) in self._skip_classes) and fn not in self._engine_files
              # a hook a target's install_* method defines (a driver file among engine_files wraps
              # the engine's methods there): the wrapper is not a site, its caller is
              or _is_install_closure(code.co_qualname))
        names = code.co_varnames
        look = (_STOP if any(v in names for v in self._stop_vars)
                else _READ if any(v in names for v in self._hint_vars) else 0)
        entry, kv = (not fw and (code.co_name in declared or f"{code.co_name}@{os.path.basename(fn)}" in declared)
                     for declared in (self._entries, self._kv_allocs))
        info = self._info[id(code)] = (fw, look, entry, kv)
        Auditor._codes[id(code)] = code
        return info

    def capture_site(self) -> int:
        """Intern the current stack (its site id), from the first frame outside the allocator and
        kvaudit up to the first frame above the target's ``release_entries``, with the owner the target
        names from the innermost frames' locals (``owner_hint``), if any."""
        f = sys._getframe(2)
        if not self.full_stacks:  # the innermost engine frame only (and the path's): enough for the signature
            # keyed by the frame's instruction offset (f_lasti): the line number is computed only
            # the first time an instruction is seen
            sites, lead = self._lasti_sites, ()  # lead: the release entry frames met first
            while f is not None:
                key = (id(f.f_code), f.f_lasti)
                sid = sites.get(key)
                if sid is None:
                    code = f.f_code
                    fw, _, entry, _ = self._info.get(id(code)) or self._code_info(code)
                    if fw:  # a framework frame: look further out (-4: a pass_through wrapper, also past entries)
                        sid = sites[key] = -4 if id(code) in _PASS_THROUGH else -2
                    elif entry:
                        sid = sites[key] = -3  # a release entry: its caller names the path
                    else:
                        line = f.f_lineno
                        sid = self._line_sites.get((id(code), line))
                        if sid is None:
                            sid = self._line_sites[id(code), line] = self._intern((((id(code), line),), None))
                        sites[key] = sid
                if sid == -3:
                    lead += ((id(f.f_code), f.f_lineno),)
                elif sid >= 0:
                    return self._intern((lead + self._site_frames[sid][0], None)) if lead else sid
                elif sid == -2 and lead:
                    break  # back in the framework above the entry frames: the engine's part ends
                f = f.f_back
            return self._intern((lead, None))
        cache, miss = self._info, self._code_info
        frames, owner, looking, depth, entry = [], None, OWNER_FRAMES, 0, False
        while f is not None and (depth < STACK_DEPTH or entry):  # (past the depth up to the path's frame)
            code = f.f_code
            fw, look, entry, _ = cache.get(id(code)) or miss(code)
            if fw:
                if depth and id(code) not in _PASS_THROUGH:
                    break  # back in the framework (the runner): the engine's part of the stack ends
            else:
                if looking and look:
                    owner = "" if look == _STOP else self._owner_hint(f.f_locals)
                    looking = 0 if owner is not None else looking
                looking = looking and looking - 1
                frames.append((id(code), f.f_lineno))
                depth += 1
            f = f.f_back
        return self._intern((tuple(frames), owner or None))

    def _lean_site(self) -> int:
        """Lean mode's :meth:`capture_site`: no site (-1). Only the frames whose lines the fast mode's sites
        would start with are kept (the first frame outside the framework; past a release entry, also its
        caller), as frame keys for :meth:`site_keys`."""
        # NOTE: two tight loops (12,904 walks per 200 programs on eut default, each 1 to 4 frames): the
        # framework frames first (a target's wrapper), then, past a release entry, the entry frames
        f, lines = sys._getframe(2), self._lean_lines
        while f is not None:
            key = (id(f.f_code), f.f_lasti)
            line = lines.get(key)
            if line is None:
                line = self._lean_line(f, key)
            if line:
                break
            f = f.f_back
        else:
            return -1
        self._lean_keys.add(key)
        if line > 0:
            return -1
        f = f.f_back  # a release entry: its caller names the path (the entry frames above it are skipped)
        while f is not None:
            key = (id(f.f_code), f.f_lasti)
            line = lines.get(key)
            if line is None:
                line = self._lean_line(f, key)
            if line >= 0:
                if line:
                    self._lean_keys.add(key)
                return -1  # the caller, or back in the framework above the entry frames
            f = f.f_back
        return -1

    def uninstall(self) -> None:
        """Remove every wrapper (:meth:`~kvaudit.audit.wrappers.PoolWrappers.uninstall`), and lean mode's
        ``capture_site`` and a full run's ``on_free`` (:meth:`_keep_tags_at_free`) kept on the instance: bound
        methods of itself, reference cycles that would leave the closed run's ledger to the cycle collector
        (measured: docs/internals/performance.md, stop 56). Mutates."""
        super().uninstall()
        self.__dict__.pop("capture_site", None)
        self.__dict__.pop("on_free", None)
        if self.shadow is not None:
            self.shadow.__dict__.pop("copy", None)

    def _lean_line(self, f, key: tuple[int, int]) -> int:
        # a frame key's entry in _lean_lines, made once per process: 0 for a framework frame, else its line,
        # negated for a release entry
        code = f.f_code
        fw, _, entry, _ = self._info.get(id(code)) or self._code_info(code)
        line = self._lean_lines[key] = 0 if fw else -f.f_lineno if entry else f.f_lineno
        return line

    def _intern(self, key: tuple) -> int:
        sid = self._sites.get(key)
        if sid is None:
            sid = self._sites[key] = len(self._site_frames)
            self._site_frames.append(key)
        return sid

    def site(self, sid: int) -> list[Site]:
        """The stack of site ``sid``, innermost first."""
        if sid < 0:
            return []
        codes, info = Auditor._codes, self._info
        return [Site(portable_path(codes[c].co_filename), line, codes[c].co_name,
                     linecache.getline(codes[c].co_filename, line).strip(),
                     *(info.get(c) or self._code_info(codes[c]))[2:])  # entry, request_kv
                for c, line in self._site_frames[sid][0]]

    def site_keys(self) -> set[tuple[str, int]]:
        """``(file, line)`` of the innermost engine frame of every site so far (the engine code reached)."""
        codes = Auditor._codes
        return ({(codes[frames[0][0]].co_filename, frames[0][1]) for frames, _ in self._site_frames if frames}
                | {(codes[k[0]].co_filename, abs(self._lean_lines[k])) for k in self._lean_keys})

    def digest(self) -> str:
        """SHA-256 of the ledger so far (allocs, frees and lock events; what it hashes:
        docs/internals/audit.md): equal for two runs of one program on a deterministic engine, one whose
        allocs and frees are the same per pool, in the same order, at the same op and step."""
        h = hashlib.sha256()
        codes = Auditor._codes
        # NOTE: pool by pool (a stable sort), so one engine call's frees of several pools may interleave in any
        # order: SGLang 0.5.23's rust tree core frees an eviction's FULL and SWA (or Mamba) parts in the order
        # of a Rust map that changes from run to run (rust_tree_core/adapter.py, _fill_evict_result)
        for ev in sorted(self.events, key=attrgetter("pool")):
            frames = self._site_frames[ev.site][0] if ev.site >= 0 else ()
            code = codes[frames[0][0]] if frames else None  # the line counted from the function's first:
            where = f"{code.co_name}:{frames[0][1] - code.co_firstlineno}" if frames else "?"  # moving code keeps it
            h.update(f"{ev.kind} {ev.pool} {ev.units} {ev.op_index} {ev.step} {where}\n".encode())
        renumber: dict[int, int] = {}  # node ids come from a process-wide counter: number them by first use
        for node, delta, _sid, op, step, lock in self.lock_events:
            h.update(f"{'lock' if lock == 'device' else lock + '-lock'} {renumber.setdefault(node, len(renumber))} "
                     f"{delta} {op} {step}\n".encode())
        return h.hexdigest()

    def site_owner(self, sid: int) -> str | None:
        """The owner the target recognised in the allocating frames (e.g. ``req:<rid>``), if any."""
        return self._site_frames[sid][1] if sid >= 0 else None

    def owner_id(self, name: str) -> int:
        oid = self._owner_ids.get(name)
        if oid is None:
            oid = self._owner_ids[name] = len(self.owner_names)
            self.owner_names.append(name)
        return oid

    def _count_lock(self, node_id: int, delta: int, lock: str = "device") -> None:
        self.lock_count += 1  # (a lean run that collects no site keys: the lock event's whole record)

    def _lock_event(self, node_id: int, delta: int, lock: str = "device") -> None:
        self.lock_count += 1
        sid = self.capture_site()
        if self.lean:
            return  # the lock-balance oracle detects from the target; only a report reads the events
        self.lock_events.append((node_id, delta, sid, self._op_index, self._step, lock))
        if self.pair_locks:
            (self.locks.inc if delta > 0 else self.locks.dec)(lock, node_id, sid, self._op_index, self._step,
                                                             self._lock_hint())

    def _lock_hint(self) -> str | None:
        # NOTE: read in fast mode too: lock events are few, and the lock ledger pairs by it
        f, looked = sys._getframe(3), 0
        while f is not None and looked < OWNER_FRAMES:
            fw, look, _, _ = self._info.get(id(f.f_code)) or self._code_info(f.f_code)
            if not fw:
                if look == _STOP:
                    return None
                if look == _READ:
                    hint = self._owner_hint(f.f_locals)
                    if hint is not None:
                        return hint
                looked += 1
            f = f.f_back
        return None

    def _over_insert(self, owner: str, inserted: int, committed: int, slots) -> None:
        # the tree caches more of owner's KV than its kv_committed_len: the positions past it (slots)
        # hold no KV of this prefix, and the next request sharing it reads them
        pool = "token_to_kv_pool"
        s = np.asarray(slots.cpu() if hasattr(slots, "cpu") else slots, dtype=np.int64).reshape(-1)
        ps = self.ledgers[pool].spec.page_size
        f = self._unit_finding(
            "accounting-drift", pool, np.unique(s // ps) if s.size else np.zeros(1, np.int64),
            f"the tree caches {inserted} tokens of {owner} but its kv_committed_len={committed}: "
            f"{inserted - committed} cached position(s) past its committed KV", alloc_sid=self.capture_site())
        f.slots = s.tolist()
        self.pending.append(f)

    def _keep_tags_at_free(self) -> None:
        # each slot's shadow tag when its unit was last freed, per pool (not counted blocks): not in a lean run
        # (a copy per free; only a report reads it, to tell a stale read's cause: _stale_kv)
        self.tags_at_free = {p: np.zeros_like(t) for p, t in self.shadow.tags.items()
                             if p in self.ledgers and self.ledgers[p].refs is None}
        # pool -> ([slots, FREED_CONTENTS] tags, the same shape of free event ids + 1, 0 none): per slot the contents
        # its latest frees took, newest first, each with the latest free that took it (_freed_what_was_wanted);
        # bounded by the pool (a list of every free's tags grew with the run: 3.4 MB over a 12,000-op replay).
        # NOTE: zeros, never filled: the OS hands the pages out as the frees touch them (a 1M-slot pool's -1 fill
        # cost every Auditor 32 MiB resident and ~40 ms)
        self.freed_contents = {p: (np.zeros((t.size, FREED_CONTENTS), np.int64),
                                   np.zeros((t.size, FREED_CONTENTS), np.int64)) for p, t in self.tags_at_free.items()}
        # a copy of unwritten content (never written, or _unwritten) into each slot since its last free: the tag it
        # put there and the allocation (event id + 1, 0 for none) that handed the content out unwritten. A copy
        # carries a slot's tag; this, that no allocation wrote it (a demote to host and the load-back)
        self.carried = {p: (np.zeros_like(t), np.zeros_like(t)) for p, t in self.tags_at_free.items()}
        self.on_free = self._on_free_keeping_tags  # (the wrappers read self.on_free at each call)
        self.shadow.copy = self._copy_keeping_unwritten  # (the target reads shadow.copy at each call)

    def _on_free_keeping_tags(self, pool: str, units, sid: int) -> None:
        # on_free, keeping the shadow tags the freed units' slots held (tags_at_free)
        kept = self.tags_at_free.get(pool)
        if kept is not None:
            ps = self.ledgers[pool].spec.page_size
            u = np.asarray(units, dtype=np.int64).reshape(-1)
            s = (u[:, None] * ps + np.arange(ps)).reshape(-1) if ps > 1 else u
            s = s[(s >= 0) & (s < kept.size)]
            kept[s] = self.shadow.tags[pool][s]
            self.carried[pool][1][s] = 0
            self._keep_freed_contents(pool, s, kept[s], len(self.events))  # (the id Ledger.on_free gives its event)
        Ledger.on_free(self, pool, units, sid)

    def _keep_freed_contents(self, pool: str, slots: np.ndarray, tags: np.ndarray, eid: int) -> None:
        # free ``eid`` took ``tags`` from ``slots``: each slot's newest entry; a slot whose last free took the same
        # content (not rewritten since) has that entry's free renewed instead, the older contents kept
        contents, frees = self.freed_contents[pool]
        slots, first = np.unique(slots, return_index=True)
        tags = tags[first]
        moved = slots[(frees[slots, 0] == 0) | (contents[slots, 0] != tags)]
        contents[moved, 1:], frees[moved, 1:] = contents[moved, :-1], frees[moved, :-1]
        contents[slots, 0], frees[slots, 0] = tags, eid + 1

    def _carried(self, pool: str, slots: np.ndarray) -> np.ndarray:
        # [n] bool: which of ``slots`` hold a copy of unwritten content, as the copy left them (self.carried)
        tags, origin = self.carried[pool]
        return (origin[slots] > 0) & (tags[slots] == self.shadow.tags[pool][slots])

    def _unwritten(self, pool: str, slots: np.ndarray) -> np.ndarray:
        # [n] bool: which of ``slots`` (written: tag not 0) hold content no allocation wrote -- allocated since the
        # last free and still holding that free's tag, or a copy of unwritten content (_carried)
        led, tags = self.ledgers[pool], self.shadow.tags[pool][slots]
        u = slots // led.spec.page_size
        return self._carried(pool, slots) | (led.allocated[u] & (led.last_alloc[u] > led.last_free[u])
                                             & (led.last_free[u] >= 0) & (tags == self.tags_at_free[pool][slots]))

    def _copy_keeping_unwritten(self, dst_pool: str, dst, src_pool: str, src) -> None:
        # shadow.copy (the target's calls), carrying the source slots' unwritten content as such (self.carried)
        d, s = ShadowKV._idx(dst), ShadowKV._idx(src)
        if dst_pool in self.carried:
            handed = np.zeros(s.size, dtype=np.int64)  # the allocation that handed out each source's content, + 1
            if src_pool in self.carried:
                led, carried = self.ledgers[src_pool], self._carried(src_pool, s)
                u = s // led.spec.page_size
                # (a live slot never written is unwritten too: its allocation is the one that handed it out)
                never = self.shadow.tags[src_pool][s] == 0
                old = carried | (led.allocated[u] & (never | self._unwritten(src_pool, s)))
                handed = np.where(old, np.where(carried, self.carried[src_pool][1][s], led.last_alloc[u] + 1), 0)
            tags, origin = self.carried[dst_pool]
            tags[d], origin[d] = self.shadow.tags[src_pool][s], handed
        ShadowKV.copy(self.shadow, dst_pool, d, src_pool, s)

    def _freed_what_was_wanted(self, pool: str, slots: np.ndarray, wanted: np.ndarray) -> int:
        # the latest free (event id) of ``pool`` at which one of ``slots`` held the tag its reader wanted there
        # (``wanted``, one per slot), -1 for none: that free took the reader's content (looked for among each
        # slot's last FREED_CONTENTS contents)
        contents, frees = self.freed_contents[pool]
        took = np.where(contents[slots] == wanted[:, None], frees[slots], 0)
        return int(took.max()) - 1 if took.size else -1

    def _stale_kv(self, pool: str, slots, message: str, expected=None) -> None:
        # report(pool, slots, message[, expected]), called by the target's install_shadow: slots any integer
        # array-like; expected (optional) the tags the reader wanted there, one per slot
        slots = np.asarray(slots.cpu() if isinstance(slots, torch.Tensor) else slots).ravel()
        n = self.shadow.tags[pool].size if pool in self.shadow.tags else 0
        if not (n and slots.size and slots.dtype.kind in "iu" and 0 <= slots.min() and slots.max() < n):
            raise TargetDefinitionError(f"{self._shadow_by}'s report(pool, slots, message) takes a pool of kv_pools() "
                                        f"({', '.join(self.shadow.tags)}) and the token slots read wrong, integers "
                                        f"in [0, its size), got {json_value(pool)} and {json_value(slots.tolist(), 80)}")
        if expected is not None and np.size(expected) != slots.size:
            raise TargetDefinitionError(f"{self._shadow_by}'s report(pool, slots, message, expected) takes one tag "
                                        f"per slot in expected, got {np.size(expected)} for {slots.size} slots")
        slots = slots.astype(np.int64, copy=False)
        led = self.ledgers[pool]
        ps = led.spec.page_size
        f = self._unit_finding("stale-kv", pool, np.unique(slots // ps), message)
        if f.unit != "block":  # (a pool counted in blocks lists whole blocks; the message names the positions)
            f.slots = sorted(set(slots.tolist()))
        f.read_sites = self.site(self.capture_site())
        # the cause, for the signature (docs/internals/audit.md, shadow KV tags)
        has = self.shadow.tags[pool][slots] != 0 if self.shadow is not None else np.zeros(slots.size, dtype=bool)
        written = slots[has]
        kept, ev = self.tags_at_free.get(pool), -1
        if kept is not None and written.size:
            # a slot allocated since its last free that still holds the tag it held at that free was not
            # written by that allocation: the free did not make the mismatch, the content is older than it
            # (an unwritten slot handed on, e.g. an aborted request's decode slot cached in the tree) -- unless
            # an earlier free took the content the reader wanted (it was rewritten and freed again since)
            fresh = self._unwritten(pool, written)
            if fresh.any() and expected is not None:
                wanted = np.asarray(expected, dtype=np.int64).ravel()[has]
                ev = self._freed_what_was_wanted(pool, written[fresh], wanted[fresh])
            written = written[~fresh]
        if written.size or ev >= 0:
            ev = int(led.last_free[written[0] // ps]) if written.size else ev
            f.check = "freed" if ev >= 0 else "overwritten"
            if ev >= 0:
                f.free_sites = self.site(self.events[ev].site)
        else:
            f.check = "unwritten"
            if kept is not None:  # a copy of unwritten content: named by the allocation that handed it out
                first = slots[slots // ps == slots.min() // ps]  # (the unit _unit_finding named)
                first = first[self._carried(pool, first)]
                if first.size:
                    f.alloc_sites = self.site(self.events[int(self.carried[pool][1][first[0]]) - 1].site)
        self.pending.append(f)
