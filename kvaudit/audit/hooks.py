"""Hooks: wrap a target's pool methods from the outside and keep a ledger of every alloc and free.

The engine is not modified: the wrappers are instance attributes that shadow the class methods.
Each event records the pool, the units (pages or rows), the op index, the scheduler step and an
interned call site (the stack from the first frame outside the allocator and kvaudit).

Double frees are caught at free time, from per-unit state (vectorized numpy index ops on the
host, no Python loop over slots; numpy beats torch by several times on arrays this small). An allocation that hands out a unit the ledger holds as allocated is *aliasing*.
Frees inside an allocator free group are recorded when the group ends, with their own sites.
"""

from __future__ import annotations

import hashlib
import inspect
import linecache
import os
import sys
from dataclasses import dataclass

import numpy as np
import torch

import kvaudit
from kvaudit.audit.findings import Finding, OwnerChange, Site, portable_path
from kvaudit.audit.locks import LockLedger
from kvaudit.audit.shadow import ShadowKV
from kvaudit.targets.base import PoolSpec

_KVAUDIT_DIR = os.path.dirname(os.path.abspath(kvaudit.__file__))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
STACK_DEPTH = 4
SMALL_EVENT = 64  # events up to this many units take the scalar fast path (numpy call overhead dominates)
_STOP, _READ = 1, 2  # owner lookup per code object (see Auditor._code_info)
OWNER_FRAMES = 3  # innermost engine frames searched for the owner of an allocation


@dataclass(slots=True)
class Event:
    id: int
    kind: str  # "alloc" | "free"
    pool: str
    units: list[int]  # the units (pages or rows), an owned copy
    op_index: int
    step: int
    site: int


def _as_list(units) -> list[int]:
    return units.tolist() if hasattr(units, "tolist") else list(units)


def _mark(flags: bytearray, last: np.ndarray, units: list[int], value: int, event_id: int) -> None:
    for x in units:
        flags[x] = value
        last[x] = event_id


class PoolLedger:
    """Per-unit state of one pool: allocated flag, last alloc and free event, current owner id; for a
    ``"blocks"`` pool also ``refs`` (``[n] int64`` reference counts; allocated means a count above 0)."""

    def __init__(self, spec: PoolSpec):
        n = spec.num_units + 1
        self.spec = spec
        self.flags = bytearray(n)  # allocated flags; ``allocated`` is a numpy view of the same bytes
        self.allocated = np.frombuffer(self.flags, dtype=bool)
        self.last_alloc = np.full(n, -1, dtype=np.int64)
        self.last_free = np.full(n, -1, dtype=np.int64)
        self.owner = np.zeros(n, dtype=np.int64)  # id into Auditor.owner_names; 0 = nobody
        self.allocated[0] = True  # reserved padding unit: any alloc of it trips the aliasing check
        self.refs = np.zeros(n, dtype=np.int64) if spec.kind == "blocks" else None


def _is_install_closure(qualname: str) -> bool:
    """Whether ``qualname`` names a function defined inside a target's ``install_*`` method
    (``MyTarget.install_pool.<locals>.grouped.<locals>.wrapper``)."""
    head, sep, _ = qualname.partition(".<locals>.")
    return bool(sep) and head.rpartition(".")[2].startswith("install_")


class Auditor:
    """Installs the hooks on ``target``'s pools and keeps the ledger.

    ``full_stacks=False`` records only the innermost engine frame of each site, with no owner
    hint: the fuzzers search in this mode and re-run a finding with full stacks to report it
    (execution is deterministic, so the second run sees the same events). Signatures use only the
    innermost frame, so they are the same in both modes.

    ``op_index`` and ``step`` are set by the runner before each op / step. ``pending`` collects
    findings raised inside hooks (double free, aliasing at alloc) until the runner takes them.
    """

    def __init__(self, target, full_stacks: bool = True, shadow: bool = True):
        self.target = target
        self.full_stacks = full_stacks
        self.ledgers = {spec.name: PoolLedger(spec) for spec in target.pools()}
        self.events: list[Event] = []
        self.owner_changes: list[tuple[int, int, str, np.ndarray, np.ndarray]] = []
        self.owner_names = ["-"]
        self._owner_ids = {"-": 0}
        self.locks = LockLedger(target.lock_holders)
        self._op_index, self._step = -1, 0
        self.pending: list[Finding] = []
        self.checked_upto = 0  # events before this index were seen by the last full oracle check
        self.owner_where: dict[int, str] = {}  # owner id -> Root.where at the last full check
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
        # a pool's own code is framework: its whole file, or, for a pool class that shares a big module
        # with engine code (the target's ``framework_classes``), only that class's methods
        by_class = tuple(target.framework_classes())
        self._skip_classes = {(os.path.abspath(inspect.getfile(c)), c.__name__) for c in by_class}
        self._skip_files = {_KVAUDIT_DIR} | {os.path.abspath(inspect.getfile(type(s.obj))) for s in target.pools()
                                             if not isinstance(s.obj, by_class)}
        self._skip_files |= {os.path.abspath(f) for f in target.framework_files()}
        # files of the target that play the engine's part (a driver): sites, though under kvaudit/
        self._engine_files = frozenset(os.path.abspath(f) for f in target.engine_files())
        self._info = Auditor._code_info_caches.setdefault(
            (frozenset(self._skip_files), frozenset(self._skip_classes), self._engine_files, self._hint_vars,
             self._stop_vars), {})
        for spec in target.pools():
            target.install_pool(spec, self, self._wrap)  # default: install_standard(spec)
        # (node id, +1/-1, site, op, step, lock): lock is "device" (inc/dec_lock_ref) or "host" (host pins)
        self.lock_events: list[tuple[int, int, int, int, int, str]] = []
        target.install_lock_ledger(self._wrap, self._lock_event)
        target.install_insert_check(self._wrap, self._over_insert)
        self.shadow: ShadowKV | None = None
        kv = target.kv_pools() if shadow else {}
        if kv:
            self.shadow = ShadowKV(kv)
            target.install_shadow(self.shadow, self._wrap, self._stale_kv)

    # -- op / step clock ---------------------------------------------------------------------
    # Set by the runner before each op and step, and ``step`` again (to the same value) after each,
    # when it checks: that re-setting closes the lock ledger's interval, so its holders are read
    # between ops and steps, when the engine's state is whole. Lock events since the last snapshot
    # (e.g. a test's own, between ops) close it at the next setting of either.
    @property
    def op_index(self) -> int:
        return self._op_index

    @op_index.setter
    def op_index(self, value: int) -> None:
        if self.locks.dirty:
            self.locks.snapshot(self._op_index, self._step)
        self._op_index = value

    @property
    def step(self) -> int:
        return self._step

    @step.setter
    def step(self, value: int) -> None:
        if self.locks.dirty or (value == self._step and self.locks.busy()):
            self.locks.snapshot(self._op_index, self._step)
        self._step = value

    def lock_snapshot(self) -> None:
        """Pair the lock events so far with the holders live now (the idle check calls this)."""
        self.locks.snapshot(self._op_index, self._step)

    # -- sites ------------------------------------------------------------------------------
    # Per code object: (is framework, look for owner). Keyed by id(code): hashing a code object
    # hashes its bytecode, which costs more than the rest of the capture.
    _code_info_caches: dict[tuple, dict[int, tuple[bool, int]]] = {}
    _codes: dict[int, object] = {}  # keeps every seen code object alive, so its id stays unique

    def _code_info(self, code) -> tuple[bool, int]:
        """``(is framework, owner lookup)``: lookup is 0 (nothing to see), ``STOP`` (a batch-level
        function: no single owner) or ``READ`` (read the owner from the frame's locals)."""
        fn = os.path.abspath(code.co_filename)
        fw = ((fn in self._skip_files or fn.startswith(_KVAUDIT_DIR) or fn.startswith(_TORCH_DIR)
               or (fn, code.co_qualname.split(".")[0]) in self._skip_classes) and fn not in self._engine_files
              # a hook a target's install_* method defines (a driver file among engine_files wraps
              # the engine's methods there): the wrapper is not a site, its caller is
              or _is_install_closure(code.co_qualname))
        names = code.co_varnames
        look = (_STOP if any(v in names for v in self._stop_vars)
                else _READ if any(v in names for v in self._hint_vars) else 0)
        info = self._info[id(code)] = (fw, look)
        Auditor._codes[id(code)] = code
        return info

    def capture_site(self) -> int:
        """Intern the current stack, from the first frame outside the allocator and kvaudit, with the
        owner the target names from the innermost frames' locals (``owner_hint``), if any.

        Locals are read only in frames whose code has one of the target's ``owner_hint_vars``.
        """
        f = sys._getframe(2)
        if not self.full_stacks:  # the innermost engine frame only: enough for the signature
            # keyed by the frame's instruction offset (f_lasti): the line number is computed only
            # the first time an instruction is seen
            sites = self._lasti_sites
            while f is not None:
                key = (id(f.f_code), f.f_lasti)
                sid = sites.get(key)
                if sid is None:
                    code = f.f_code
                    if (self._info.get(id(code)) or self._code_info(code))[0]:
                        sid = sites[key] = -2  # a framework frame: look further out
                    else:
                        line = f.f_lineno
                        sid = self._line_sites.get((id(code), line))
                        if sid is None:
                            sid = self._line_sites[id(code), line] = self._intern((((id(code), line),), None))
                        sites[key] = sid
                if sid != -2:
                    return sid
                f = f.f_back
            return self._intern(((), None))
        cache, miss = self._info, self._code_info
        frames, owner, looking, depth = [], None, OWNER_FRAMES, 0
        while f is not None and depth < STACK_DEPTH:
            code = f.f_code
            fw, look = cache.get(id(code)) or miss(code)
            if fw:
                if depth:
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

    def _intern(self, key: tuple) -> int:
        """The site id of ``key`` (frames, owner), a new one if it was never seen."""
        sid = self._sites.get(key)
        if sid is None:
            sid = self._sites[key] = len(self._site_frames)
            self._site_frames.append(key)
        return sid

    def site(self, sid: int) -> list[Site]:
        """The stack of site ``sid``, innermost first."""
        if sid < 0:
            return []
        codes = Auditor._codes
        return [Site(portable_path(codes[c].co_filename), line, codes[c].co_name,
                     linecache.getline(codes[c].co_filename, line).strip())
                for c, line in self._site_frames[sid][0]]

    def site_keys(self) -> set[tuple[str, int]]:
        """``(file, line)`` of the innermost engine frame of every site recorded so far: the engine
        code this run reached, for coverage counts across runs and worker processes."""
        codes = Auditor._codes
        return {(codes[frames[0][0]].co_filename, frames[0][1]) for frames, _ in self._site_frames if frames}

    def digest(self) -> str:
        """SHA-256 of the ledger so far: every alloc and free (kind, pool, units, op, step, innermost
        site as its function and line within it, so that moving a function unchanged keeps the digest)
        and every lock event (node, delta, op, step). Two runs of one program on a
        deterministic engine give the same digest (``kvaudit replay --check-determinism``)."""
        h = hashlib.sha256()
        codes = Auditor._codes
        for ev in self.events:
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

    # -- recording --------------------------------------------------------------------------
    def _event(self, kind: str, pool: str, units: list[int], sid: int) -> Event:
        ev = Event(len(self.events), kind, pool, units, self.op_index, self.step, sid)
        self.events.append(ev)
        return ev

    def on_alloc(self, pool: str, units, sid: int, expected_new: int | tuple | None = None) -> None:
        """Record an allocation of ``units`` (a list or ``[n] int64`` array). Units the ledger already
        holds as allocated are continuations (a partly filled page) unless fewer than
        ``expected_new`` fresh units came out of the pool: then the allocator handed one out twice.
        ``expected_new`` may be ``(allocator, available_size() before)``, counted only when needed."""
        led = self.ledgers[pool]
        ul, flags = _as_list(units), led.flags
        if led.refs is not None:  # a reference-counted pool: a fresh block starts at count 1
            held = [u for u in ul if flags[u]]
            if held or len(set(ul)) != len(ul):
                taken = np.unique(np.asarray(held or [u for u in ul if ul.count(u) > 1], dtype=np.int64))
                self.pending.append(self._unit_finding(
                    "aliasing", pool, taken, f"allocator handed out {taken.size} block(s) already referenced "
                    "(or the reserved block 0)", alloc_sid=sid))
            fresh = np.unique(np.asarray([u for u in ul if not flags[u]], dtype=np.int64))
            if fresh.size:
                led.refs[fresh] = 1
                _mark(flags, led.last_alloc, fresh.tolist(), 1, self._event("alloc", pool, fresh.tolist(), sid).id)
            return
        if len(ul) <= SMALL_EVENT and not any(map(flags.__getitem__, ul)):
            # fast path (the common case): every unit is fresh. Python scalar ops beat numpy here.
            _mark(flags, led.last_alloc, ul, 1, self._event("alloc", pool, ul, sid).id)
            return
        units = np.asarray(ul, dtype=np.int64)
        held = led.allocated[units]  # unit 0 always reads as held (see PoolLedger)
        fresh = units
        if held.any():
            fresh = units[~held]
            if isinstance(expected_new, tuple):  # (allocator, its available size before): count now
                expected_new = (expected_new[1] - expected_new[0].available_size()) // led.spec.page_size
            if expected_new is None:
                expected_new = units.size
            if fresh.size < expected_new or not units.all():
                taken = units[held] if fresh.size < expected_new else units[units == 0]
                self.pending.append(self._unit_finding(
                    "aliasing", pool, taken, f"allocator handed out {taken.size} unit(s) already allocated "
                    "(or the reserved unit 0)", alloc_sid=sid))
        ev = self._event("alloc", pool, fresh.tolist(), sid)
        led.allocated[fresh] = True
        led.last_alloc[fresh] = ev.id

    def on_ref(self, pool: str, units, sid: int) -> None:
        """Record one more reference to each of ``units`` (a list or array; a unit named twice gains
        two) in a ``"blocks"`` pool: a prefix hit sharing a block (vLLM's ``BlockPool.touch``). A
        block at count 0 (cached but free) comes back to life: recorded as its allocation."""
        led = self.ledgers[pool]
        u = np.asarray(_as_list(units), dtype=np.int64)
        revived = np.unique(u[led.refs[u] == 0])
        revived = revived[revived > 0]
        np.add.at(led.refs, u, 1)
        if revived.size:
            ev = self._event("alloc", pool, revived.tolist(), sid)
            led.allocated[revived] = True
            led.last_alloc[revived] = ev.id

    def _unref(self, pool: str, units: list[int], sid: int) -> None:
        """``on_free`` for a ``"blocks"`` pool: one reference fewer per unit named (vLLM's
        ``BlockPool.free_blocks``). A count taken below 0, or a decrement of block 0, is a double free;
        a block whose count reaches 0 is freed (its free event)."""
        led = self.ledgers[pool]
        u = np.asarray(units, dtype=np.int64)
        np.subtract.at(led.refs, u, 1)
        bad = np.unique(u[(led.refs[u] < 0) | (u == 0)])
        zero = np.unique(u[led.refs[u] == 0])
        zero = zero[led.allocated[zero] & (zero > 0)]
        if bad.size:
            led.refs[bad] = np.maximum(led.refs[bad], 0)
            self.pending.append(self._double_free(pool, bad, sid))
        if zero.size:
            ev = self._event("free", pool, zero.tolist(), sid)
            led.allocated[zero] = False
            led.last_free[zero] = ev.id
        led.allocated[0] = True

    def on_free(self, pool: str, units, sid: int) -> None:
        """Record a free of ``units`` (a list or array); a unit already free, or listed twice, is a
        double free. In a ``"blocks"`` pool, a decrement of each unit's count (:meth:`_unref`)."""
        led = self.ledgers[pool]
        ul, flags = _as_list(units), led.flags
        if led.refs is not None:
            return self._unref(pool, ul, sid)
        if (len(ul) <= SMALL_EVENT and all(map(flags.__getitem__, ul)) and 0 not in ul
                and len(set(ul)) == len(ul)):
            # fast path: every unit allocated, and named once
            _mark(flags, led.last_free, ul, 0, self._event("free", pool, ul, sid).id)
            return
        units = np.asarray(ul, dtype=np.int64)
        bad = units[~led.allocated[units]]
        if not units.all():  # freeing the reserved unit 0 is always wrong
            bad = np.union1d(bad, [0])
        if units.size > 1:
            srt = np.sort(units)
            dup = srt[1:][srt[1:] == srt[:-1]]
            if dup.size:
                bad = np.union1d(bad, dup)
        ev = self._event("free", pool, ul, sid)
        if bad.size:
            self.pending.append(self._double_free(pool, np.unique(bad), sid))
        led.allocated[units] = False
        led.last_free[units] = ev.id
        led.allocated[0] = True

    def _double_free(self, pool: str, bad: np.ndarray, sid: int) -> Finding:
        """A second free of ``bad`` (``[n] int64`` units) at site ``sid``. When a live owner still
        references the units now, the first free came too early and this free is that owner's own
        release: a ``use-after-free`` named by the first free (the one to fix), so one premature-free
        bug gets one signature whether or not an oracle scan ran between the two frees. Otherwise a
        ``double-free``, with both free sites."""
        prev = int(self.ledgers[pool].last_free[bad[0]])
        prev_sites = self.site(self.events[prev].site) if prev >= 0 else []
        again = self.site(sid)
        # the same line freeing twice is a double free whoever still maps the units
        users = ([] if prev < 0 or prev_sites[:1] == again[:1] else
                 self._group_users if self._group_users is not None else self._users(pool, bad))
        if users:
            f = self._unit_finding("use-after-free", pool, bad,
                                   f"{bad.size} unit(s) freed while {', '.join(users[:3])} still referenced them; "
                                   "its release freed them again")
            f.free_sites, f.read_sites, f.used_by = prev_sites, again, users
            return f
        f = self._unit_finding("double-free", pool, bad, f"{bad.size} unit(s) freed while already free")
        f.free_sites, f.prev_free_sites = again, prev_sites
        return f

    def _users(self, pool: str, units: np.ndarray) -> list[str]:
        """Owners that reference ``units`` of ``pool`` right now: the target's roots, and the owner (at
        the last check) of each allocated row that maps them -- a request leaving the scheduler's
        structures to be released is in no root, yet its record still names the units.
        Read from inside a free: a target whose records are mid-update may fail to list them, which
        reads as none."""
        users: set[str] = set()
        try:
            roots = self.target.roots()  # aborting requests too: their release is a use of what they map
            users.update(r.owner for r in roots if r.pool == pool and np.isin(r.units, units).any())
            rows_led = self.ledgers.get("req_to_token_pool")
            of_rows = self.target.units_of_rows
            if rows_led is not None and pool != "req_to_token_pool" and of_rows(units[:0]) is not None:
                live = rows_led.allocated.copy()
                live[0] = False
                for row in np.flatnonzero(live & (rows_led.owner > 0)):
                    if np.isin(units, of_rows(np.array([row])).get(pool, units[:0])).any():
                        users.add(self.owner_names[int(rows_led.owner[row])])
        except Exception:  # noqa: BLE001 -- a half-updated record: no claim either way
            pass
        return sorted(users)

    def _lock_event(self, node_id: int, delta: int, lock: str = "device") -> None:
        """A lock event from the target's ledger wrappers: ``delta`` +1 (inc) or -1 (dec) on tree node
        ``node_id``; ``lock`` is ``"device"`` (``inc/dec_lock_ref``) or ``"host"`` (host pins)."""
        sid = self.capture_site()
        self.lock_events.append((node_id, delta, sid, self._op_index, self._step, lock))
        (self.locks.inc if delta > 0 else self.locks.dec)(lock, node_id, sid, self._op_index, self._step,
                                                         self._lock_hint())

    def _lock_hint(self) -> str | None:
        """The owner the innermost engine frames work for (``owner_hint`` on their locals, as for
        allocations), read in fast mode too: lock events are few, and the ledger pairs by it."""
        f, looked = sys._getframe(3), 0
        while f is not None and looked < OWNER_FRAMES:
            fw, look = self._info.get(id(f.f_code)) or self._code_info(f.f_code)
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
        """The tree is caching ``inserted`` tokens of ``owner``'s KV, more than its ``kv_committed_len``
        ``committed``: the positions past it (``slots``, ``[n]`` token slots) hold no KV of this prefix,
        and the next request sharing it reads them (``accounting-drift``, located at the insert)."""
        pool = "token_to_kv_pool"
        s = np.asarray(slots.cpu() if hasattr(slots, "cpu") else slots, dtype=np.int64).reshape(-1)
        ps = self.ledgers[pool].spec.page_size
        f = self._unit_finding(
            "accounting-drift", pool, np.unique(s // ps) if s.size else np.zeros(1, np.int64),
            f"the tree caches {inserted} tokens of {owner} but its kv_committed_len={committed}: "
            f"{inserted - committed} cached position(s) past its committed KV", alloc_sid=self.capture_site())
        f.slots = s.tolist()
        self.pending.append(f)

    def _stale_kv(self, pool: str, slots: np.ndarray, message: str) -> None:
        """A KV read whose shadow tags do not match the reader's prefix (see :mod:`kvaudit.audit.shadow`)."""
        led = self.ledgers[pool]
        ps = led.spec.page_size
        f = self._unit_finding("stale-kv", pool, np.unique(slots // ps), message)
        f.slots = sorted(set(slots.tolist()))
        f.read_sites = self.site(self.capture_site())
        # the cause, for the signature: content written for another prefix in a slot freed and
        # reused under the reader is a premature free (that free is the site); never-written
        # content was handed to the reader unwritten (the allocation is the site)
        slots = np.asarray(slots, dtype=np.int64)
        written = slots[self.shadow.tags[pool][slots] != 0] if self.shadow is not None else slots[:0]
        if written.size:
            ev = int(led.last_free[written[0] // ps])
            f.check = "freed" if ev >= 0 else "overwritten"
            if ev >= 0:
                f.free_sites = self.site(self.events[ev].site)
        else:
            f.check = "unwritten"
        self.pending.append(f)

    # -- findings ---------------------------------------------------------------------------
    def _unit_finding(self, kind: str, pool: str, units: np.ndarray, message: str,
                      alloc_sid: int | None = None) -> Finding:
        led = self.ledgers[pool]
        spec = led.spec
        units = np.sort(units)
        if alloc_sid is None:
            ev = int(led.last_alloc[units[0]])
            alloc_sid = self.events[ev].site if ev >= 0 else -1
        if spec.kind == "rows":
            unit, slots = "row", units.tolist()
        else:
            unit = "page" if spec.page_size > 1 else "slot"
            slots = (units[:, None] * spec.page_size + np.arange(spec.page_size)).reshape(-1).tolist()
        return Finding(kind=kind, pool=pool, message=message, unit=unit, slots=slots, num_units=int(units.size),
                       alloc_sites=self.site(alloc_sid), owner_history=self.history(pool, int(units[0])),
                       op_index=self.op_index, step=self.step)

    def history(self, pool: str, unit: int):
        """Alloc, owner changes and free of ``unit``, in order, as :class:`OwnerChange` records."""
        out = []
        for ev in self.events:
            if ev.pool == pool and unit in ev.units:
                site = self.site(ev.site)
                who = self.site_owner(ev.site)
                out.append(OwnerChange(ev.op_index, ev.step, who or "-",
                                       f"{ev.kind} at {site[0].short() if site else '?'}"
                                       + (f" for {who}" if who else "")))
        for op_index, step, p, units, owners in self.owner_changes:
            if p == pool:
                hit = np.flatnonzero(units == unit)
                if hit.size:
                    out.append(OwnerChange(op_index, step, self.owner_names[int(owners[hit[0]])], "owner"))
        # owners are read at the end of a step, after its allocs and frees (a stable sort keeps
        # the events in ledger order)
        out.sort(key=lambda o: (o.step, o.op_index, o.event == "owner"))
        return out

    # -- installation -----------------------------------------------------------------------
    def _wrap(self, obj, name: str, wrapper) -> None:
        self._undo.append((obj, name))
        setattr(obj, name, wrapper)

    def wrap_clear(self, spec: PoolSpec) -> None:
        """Wrap ``spec.obj.clear()`` (flush_cache), if it has one: it returns every unit at once, so it
        is recorded as one free of all units the ledger holds, and a flush under a live owner shows
        as use-after-free."""
        obj, pool = spec.obj, spec.name
        orig_clear = getattr(obj, "clear", None)
        if orig_clear is None:
            return

        def clear_wrapper(*a, **k):
            orig_clear(*a, **k)
            held = np.flatnonzero(self.ledgers[pool].allocated)
            held = held[held > 0]
            if held.size:
                self.on_free(pool, held, self.capture_site())

        self._wrap(obj, "clear", clear_wrapper)

    def wrap_rows(self, spec: PoolSpec, alloc: str = "alloc", free: str = "free") -> None:
        """Wrap a row pool's ``alloc(n) -> list[int] | None`` and ``free(rows)`` (an int or a list),
        named ``alloc``/``free`` on the pool object."""
        obj, pool = spec.obj, spec.name
        orig_alloc, orig_free = getattr(obj, alloc), getattr(obj, free)

        def alloc_rows(n, *a, **k):
            out = orig_alloc(n, *a, **k)
            if out:
                self.on_alloc(pool, list(out), self.capture_site())
            return out

        def free_rows(rows, *a, **k):
            orig_free(rows, *a, **k)
            rows = [rows] if isinstance(rows, int) else list(rows)
            if rows:
                self.on_free(pool, rows, self.capture_site())

        self._wrap(obj, alloc, alloc_rows)
        self._wrap(obj, free, free_rows)

    def wrap_blocks(self, spec: PoolSpec, ids, alloc: str | None = None, ref: str | None = None,
                    unref: str | None = None) -> None:
        """Wrap a ``"blocks"`` pool's methods named ``alloc`` (returns the new blocks, each at count 1),
        ``ref`` (first argument: blocks gaining a reference) and ``unref`` (first argument: blocks
        losing one); ``ids(blocks)`` turns what they take or return into a list of block ids (ints).
        Modelled on vLLM v1's ``BlockPool.get_new_blocks``/``touch``/``free_blocks``."""
        obj, pool = spec.obj, spec.name

        def wrapped(name, record, result: bool):
            orig = getattr(obj, name)

            def wrapper(*a, **k):
                if not result and a:  # the blocks may come as an iterator (reversed(...)): read them once
                    a = (list(a[0]),) + a[1:]
                elif not result and k:
                    key = next(iter(k))
                    k = {**k, key: list(k[key])}
                out = orig(*a, **k)
                units = ids(out if result else a[0] if a else next(iter(k.values())))
                if units:
                    record(pool, units, self.capture_site())
                return out

            self._wrap(obj, name, wrapper)

        for name, record, result in ((alloc, self.on_alloc, True), (ref, self.on_ref, False),
                                     (unref, self.on_free, False)):
            if name is not None:
                wrapped(name, record, result)

    def install_standard(self, spec: PoolSpec) -> None:
        """Wrap ``spec``'s pool by its kind's standard API (:class:`PoolSpec`): the default of
        :meth:`kvaudit.targets.base.Target.install_pool`. Raises ``ValueError`` for a ``"blocks"``
        pool, which has no standard API (the target calls :meth:`wrap_blocks`)."""
        if spec.kind == "blocks":
            raise ValueError(f"pool {spec.name!r} of kind 'blocks': install_pool must call wrap_blocks")
        obj, pool, ps = spec.obj, spec.name, spec.page_size
        self.wrap_clear(spec)
        if spec.kind == "rows":
            self.wrap_rows(spec)
            return

        def to_units(idx: torch.Tensor) -> list[int]:
            """Token slots -> the units they touch: slots when ``page_size`` is 1, else sorted pages."""
            if ps == 1:
                return idx.tolist()
            if idx.numel() <= SMALL_EVENT * ps:
                return sorted({x // ps for x in idx.tolist()})
            return torch.unique(idx // ps).tolist()

        depth = [0]  # only the outermost call records: alloc_extend may call alloc internally

        for name in ("alloc", "alloc_extend", "alloc_decode"):
            orig = getattr(obj, name, None)
            if orig is None:
                continue

            def alloc_wrapper(*a, _orig=orig, **k):
                if depth[0]:
                    return _orig(*a, **k)
                before = obj.available_size()
                depth[0] += 1
                try:
                    out = _orig(*a, **k)
                finally:
                    depth[0] -= 1
                if out is not None and out.numel():
                    self.on_alloc(pool, to_units(out), self.capture_site(), expected_new=(obj, before))
                return out

            self._wrap(obj, name, alloc_wrapper)

        orig_free = obj.free
        group: list[tuple[list[int], int]] = []

        def free_wrapper(idx, *a, **k):
            if depth[0] or idx.numel() == 0:
                return orig_free(idx, *a, **k)
            if not getattr(obj, "is_not_in_free_group", True):
                units = to_units(idx)
                # a unit already free is a double free, recorded at the group's end: who still maps
                # it is read now, while the records are as they were at this call
                flags = self.ledgers[pool].flags
                users = None
                if not all(map(flags.__getitem__, units)):  # (on_free's fast test: rarely false)
                    users = self._users(pool, np.asarray([u for u in units if not flags[u]], dtype=np.int64))
                group.append((units, self.capture_site(), users))
                return orig_free(idx, *a, **k)
            depth[0] += 1
            try:
                orig_free(idx, *a, **k)
            finally:
                depth[0] -= 1
            self.on_free(pool, to_units(idx), self.capture_site())

        self._wrap(obj, "free", free_wrapper)
        orig_end = getattr(obj, "free_group_end", None)
        if orig_end is not None:
            def group_end_wrapper(*a, **k):
                depth[0] += 1
                try:
                    orig_end(*a, **k)
                finally:
                    depth[0] -= 1
                pend = list(group)
                group.clear()
                # A paged allocator frees unique(pages) of the whole group once, so a page named
                # by two frees of one group is freed once. With page_size 1 the slots go back
                # as they are (duplicates included), so each free is checked on its own.
                seen: set[int] = set()
                for units, sid, users in pend:
                    ul = [u for u in units if u not in seen] if ps > 1 and seen else units
                    if ps > 1:
                        seen.update(ul)
                    if ul:
                        self._group_users = users
                        try:
                            self.on_free(pool, ul, sid)
                        finally:
                            self._group_users = None

            self._wrap(obj, "free_group_end", group_end_wrapper)

    def uninstall(self) -> None:
        for obj, name in reversed(self._undo):
            try:
                delattr(obj, name)
            except AttributeError:
                pass
        self._undo.clear()
