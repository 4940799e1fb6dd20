"""The target protocol: everything kvaudit knows about an engine comes through one of these.

A target names its pools (objects whose alloc/free methods the hooks wrap), runs program ops,
and reports its *roots*: for each pool, which units each live owner references. Units are pages
for KV pools (``page_size`` tokens each) and rows for request pools.
"""

from __future__ import annotations

import sys
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable, NamedTuple

import numpy as np
import torch

from kvaudit.config import json_value


#: the pool kinds kvaudit knows (:class:`PoolSpec`), with the API the default ``install_pool`` wraps
#: (``None``: none; the target's own ``install_pool`` wraps the pool)
POOL_KINDS = {"kv": ("free", "available_size"), "rows": ("alloc", "free"), "blocks": None}


@dataclass(frozen=True)
class PoolSpec:
    """A pool the hooks wrap. ``kind`` is ``"kv"`` (token slots, allocator API
    ``alloc``/``alloc_extend``/``alloc_decode``/``free``/``free_group_*`` and ``available_size``),
    ``"rows"`` (``alloc(n) -> list[int]``/``free(rows)``) or ``"blocks"`` (reference-counted pages of
    ``page_size`` tokens, vLLM's ``BlockPool``: the target wraps them with
    ``Auditor.wrap_blocks``; a double free is a count taken below zero); a kind of the target's own
    (SGLang's host pool) only with its own ``install_pool``. ``num_units`` excludes the reserved unit 0.
    :func:`check_target` checks what a target declares."""

    name: str
    obj: object
    kind: str
    page_size: int
    num_units: int


@dataclass
class Root:
    """``owner`` references ``units`` (``[n] int64`` numpy array of pages or rows) of ``pool``.

    ``private`` marks exclusive ownership (the aliasing check counts these); ``role`` is ``"req"``
    for live requests (their private units are SGLang's ``uncached``) or ``"tree"`` for the cache.
    ``where`` (optional) names the place the engine holds the owner in (``waiting``, ``running``,
    ``chunked``, ``transfer``, ...): a leak whose owner was dropped without a release is told apart
    by the place it was dropped from (its signature's second part).
    """

    pool: str
    owner: str
    units: np.ndarray
    private: bool = True
    role: str = "req"
    where: str = ""


@dataclass
class Accounting:
    """The engine's own counters for one pool, in tokens: units times the pool's ``page_size``, for every
    pool kind (kvaudit's ``uncached`` and ``referenced`` terms count so; a row pool of ``page_size`` 1
    counts rows)."""

    available: int
    evictable: int
    protected: int
    session_held: int
    total: int


class IdleRoots(NamedTuple):
    """The roots at idle when they are the cache's alone (:meth:`Target.idle_roots`): ``owner`` (a
    :class:`Root`'s owner, private, role ``"tree"``) references ``units`` (pool -> ``[n] int64`` units; a
    pool left out: none) and no other root exists; ``locked``: whether :meth:`Target.lock_balance` would
    name a node now."""

    owner: str
    units: dict
    locked: bool


class LockImbalance(NamedTuple):
    """A tree node whose lock count differs from its live holders (``lock_balance()``).

    ``slots``: ``[n] int64`` token slots of ``pool`` the lock covers; ``lock_ref``: the count the
    engine (or the ledger) holds; ``holders``: the live holders on it; ``ids``: the node and its
    descendants (a lock covers the path), matched against the lock-ref ledger's events, or None when
    the ledger records none for it; ``lock``: ``"device"`` (``inc/dec_lock_ref``) or ``"host"``
    (host pins, on the host pool ``pool``)."""

    node: str
    slots: np.ndarray
    lock_ref: int
    holders: int
    ids: set | None
    lock: str = "device"
    pool: str = "token_to_kv_pool"


class TargetFinding(NamedTuple):
    """A finding a target reports itself (:meth:`Target.invariant_findings`): ``kind`` is one of
    :data:`kvaudit.audit.findings.KINDS` (``leak``, ``double-free``, ``use-after-free``, ``aliasing``,
    ``accounting-drift``, ...), ``units`` the ``[n] int64`` units of ``pool`` it concerns (their last
    allocation is its site), ``check`` (optional) names the invariant in the signature, ``free_sites``
    (optional) the site ids (``Auditor.capture_site``; -1 for none) of the frees that broke it, oldest
    first: a ``double-free``'s previous and last free, which its signature names as the ledger's does;
    ``used_by`` (optional, a ``use-after-free``'s) who still uses the units, in the target's words (``a step in
    flight that writes it for req:r1``): the headline and the report name it, as they name a live owner;
    ``lost_by`` (optional, a ``leak``'s) what lost the reference the target finds no holder for, in the words
    :meth:`Target.lost_by` gives the leak oracle (``from:running``: a holder dropped whole): with no ``check``,
    the signature is the one the leak oracle gives the same loss of a block no one else held (one bug, one
    signature)."""

    kind: str
    pool: str
    units: np.ndarray
    message: str
    check: str = ""
    free_sites: tuple = ()
    used_by: tuple = ()
    lost_by: str = ""


class Recount(NamedTuple):
    """One accounting term recomputed from the structure it describes, for the drift oracle.

    ``tokens``: the term (tokens; rows for a row pool) as counted from the structure; ``counter``:
    whose counter the engine keeps for it (``"tree"``, ``"host tree"``); ``source``: what was counted,
    phrased to follow "but" (``"its nodes with lock_ref 0"``).
    """

    tokens: int
    counter: str
    source: str


#: what an ownership delta entry is (:class:`OwnershipDeltas`): a shared reference (a request's tree-owned
#: prefix), or a private one of a live request (``uncached``), of a session (``session_held``) or of another
#: owner (the tree)
SHARED, PRIVATE_REQ, PRIVATE_SESSION, PRIVATE_OTHER = 0, 1, 2, 3


class OwnershipDeltas(NamedTuple):
    """How ownership changed since the target's previous :meth:`Target.ownership_deltas` call, as the
    roots would show it: per pool, ``(owner, units, sign, kind)``, four ``[k]`` numpy arrays (``owner``
    int64 indexes into ``owners``; ``units`` int64; ``sign`` int64, +1 a root gained the unit, -1 lost it;
    ``kind`` int8, :data:`SHARED` .. :data:`PRIVATE_OTHER`). Entries count like the roots' units: a unit
    two roots reference is two entries. ``where``: every live owner's place (``Root.where``), by name,
    for the owners whose roots name one."""

    owners: list
    pools: dict
    where: dict


_NO_SCOPE = nullcontext()

#: the default identity: SGLang's (``srt/mem_cache/.../invariant_checker.py``)
DEFAULT_IDENTITY = ("available", "evictable", "protected", "session_held", "uncached")


class ReadOnce:
    """What one full check reads twice (a target's holders, free list, counts), read once: ``keep(name, mark,
    value)`` stores ``value`` and returns it, ``take(name, mark, make)`` returns it once if stored under the
    same ``mark`` (the target's state mark: its steps and ledger events; a check only reads), else ``make()``."""

    def __init__(self):
        self._kept: dict = {}

    def keep(self, name: str, mark, value):
        self._kept[name] = (mark, value)
        return value

    def take(self, name: str, mark, make: Callable):
        got = self._kept.pop(name, None)
        return got[1] if got is not None and got[0] == mark else make()


class Target:
    """The base of every target: the required methods raise ``NotImplementedError``, and every optional
    capability is a method with a documented no-op default, so kvaudit calls each one directly (no
    probing). A subclass overrides what its engine models. "Reads" below means the method must not
    change the engine's state (the oracles call it after every step); "mutates" means it does.

    Attributes: ``config`` (the target's config, a :class:`kvaudit.config.ConfigBase`), ``steps``
    (scheduler iterations so far), ``name`` (the registered target kind, :mod:`kvaudit.targets.registry`).
    """

    name = "?"
    config: object
    steps: int = 0
    #: locals that make an allocating frame worth reading (:meth:`owner_hint`), and locals that mark a
    #: batch-level frame with no single owner (a loop variable named like the hint is not its owner)
    owner_hint_vars: tuple[str, ...] = ()
    owner_stop_vars: tuple[str, ...] = ()
    #: the functions every release path shares (``"name"``, or ``"name@file"`` by the file's basename):
    #: the release entry point (SGLang's ``release_kv_cache``) and the plumbing between it and the
    #: allocator. A free's *path*, which signatures name, is the first frame above them: the caller
    #: that chose the release (finish, abort, retract, session close, ...); default none: the
    #: innermost frame (see :mod:`kvaudit.audit.findings`)
    release_entries: tuple[str, ...] = ()
    #: the functions that grow a request's own KV, its row and the slots it prefills and decodes into
    #: (``"name"`` or ``"name@file"``, as above; the innermost frame outside the allocator: SGLang's
    #: ``alloc_token_slots`` and the paged pair under ``alloc_for_extend``/``alloc_for_decode``). A
    #: signature names an allocation there by that one role, ``request-kv``, so that one bug whose units
    #: a program allocated in prefill and another in decode is one signature; allocations elsewhere (a
    #: PD pre-allocation, a HiSparse buffer, a host tier) keep their function. Default none: every
    #: allocation by its function (right for an engine that grows a request's KV in one function)
    request_kv_allocs: tuple[str, ...] = ()
    #: whether :meth:`lock_holders` names every holder of a tree lock at every step boundary (no lock is
    #: ever taken ahead of its holder's record): a lock whose holder the ledger saw leave unreleased is then
    #: reported when it happens, not at the next idle. Default False (SGLang's tree takes some ahead)
    lock_holders_exact: bool = False

    # -- required ---------------------------------------------------------------------------------
    def pools(self) -> list[PoolSpec]:
        """The pools the hooks wrap (reads)."""
        raise NotImplementedError

    def apply(self, op) -> None:
        """Deliver a non-advancing op (submit, health check, abort, ...) to the engine (mutates)."""
        raise NotImplementedError

    def step(self) -> None:
        """One scheduler iteration (mutates; increments ``steps``)."""
        raise NotImplementedError

    def is_idle(self) -> bool:
        """Nothing queued, running or in flight (reads)."""
        raise NotImplementedError

    def roots(self, aborting: bool = True) -> list[Root]:
        """Every live owner's units, per pool (reads). ``aborting=False`` leaves out requests being
        aborted (their in-flight result releases them next): the mid-step scan after intake."""
        raise NotImplementedError

    def users_of(self, pool: str, units) -> list[str] | None:
        """The owners of :meth:`roots` that reference any of ``units`` (``[n] int64`` of ``pool``), for a
        target that can tell without building every root (the ledger asks at every free of a last
        reference); None (default): the ledger reads :meth:`roots` (reads)."""
        return None

    def accounting(self) -> dict[str, Accounting]:
        """The engine's own counters per pool, for the accounting identity (reads)."""
        raise NotImplementedError

    def engine_check(self) -> list[str]:
        """The engine's own verdict: its failing identity lines, ``[]`` when it passes (reads)."""
        raise NotImplementedError

    # -- hooks: how kvaudit attaches (each runs once, when the auditor is built; mutates wrappers) ---
    def install_pool(self, spec: PoolSpec, auditor, wrap) -> None:
        """Wrap ``spec``'s alloc/free. Default: the standard wrappers of ``spec.kind``
        (``auditor.install_standard(spec)``); a target whose allocator API differs wraps its own with
        ``wrap(obj, name, fn)`` and the auditor's ``on_alloc``/``on_free``/``wrap_rows``/``wrap_clear``."""
        auditor.install_standard(spec)

    def install_lock_ledger(self, wrap, record) -> None:
        """Wrap the tree's lock inc/dec so that each calls ``record(node id, +1|-1, lock="device"|"host")``.
        Default: no locks recorded (the lock-ref ledger stays empty)."""

    def install_insert_check(self, wrap, report) -> None:
        """Wrap the tree's insert: ``report(owner, inserted, committed, slots)`` when a request's insert
        caches more than it committed (tokens). Default: not checked."""

    def kv_pools(self) -> dict:
        """The pools whose KV content the stale-KV shadow covers, ``{declared pool: its size in token
        slots}`` (an int, at least ``(num_units + 1) * page_size``: slot ``unit * page_size + offset``);
        ``{}`` (default): no shadow (reads)."""
        return {}

    def install_shadow(self, shadow, wrap, report) -> None:
        """Wrap KV writes and reads for the stale-KV shadow (called only when :meth:`kv_pools` is not
        empty): tell ``shadow`` (:class:`kvaudit.audit.shadow.ShadowKV`) each write of token slots
        (``shadow.write(pool, slots, tags)``, the tags of the writer's prefixes from
        ``shadow.request_tags(request, prompt, output)``), check each read (``shadow.read(pool, slots,
        tags)``) and call ``report(pool, slots, message)`` with the slots a read found wrong (optionally
        ``report(pool, slots, message, expected)``: the tags the reader wanted there, one per slot, which tell a
        slot freed under its reader and rewritten since from one never written: docs/internals/audit.md);
        ``wrap(obj, name, fn)`` replaces an engine method, as for :meth:`install_pool`. Default: nothing."""

    def crash_cause(self) -> TargetFinding | None:
        """After the engine raised: one of the target's own invariants the state now breaks, naming the
        frees behind it (``free_sites``), so that a crash names where its cause began, not only where it
        raised. Default: None (nothing to add)."""
        return None

    def crash_by(self, exc: BaseException) -> str:
        """After the engine raised ``exc``: a fact the target observed about the request it raised on that
        tells two root causes of one raise apart (a crash signature's last part, e.g. the request was a retry
        the engine requeued), ``""`` for none. Default: ``""`` (the signature is the raise alone)."""
        return ""

    def on_intake(self, callback) -> None:
        """Call ``callback()`` right after the engine takes its queued messages, before it schedules
        (the mid-step use-after-free scan). Default: never called."""

    # -- where sites start -------------------------------------------------------------------------
    def owner_hint(self, frame_locals: dict) -> str | None:
        """The owner (``req:<rid>``) an allocating frame works for, from its locals (reads); default None."""
        return None

    def framework_files(self) -> list[str]:
        """Allocator-internal files: a site's innermost frame is the first frame outside these."""
        return []

    def framework_classes(self) -> list[type]:
        """Pool classes sharing a module with engine code: only their methods are skipped."""
        return []

    def engine_files(self) -> list[str]:
        """Files under kvaudit/ that play the engine's part (a driver): their frames are sites."""
        return []

    # -- optional oracle inputs (all read) -----------------------------------------------------------
    def units_of_rows(self, rows) -> dict | None:
        """``{pool: [n] int64 units}`` that request rows ``rows`` (``[m] int64``) map; None (default):
        the target has no row table (leaks are not split direct/indirect through rows)."""
        return None

    def units_of_tenants(self, rows) -> dict | None:
        """:meth:`units_of_rows` of only the entries that each row's current tenant wrote (for a row freed and
        not allocated again, its last tenant's): a row keeps its earlier tenants' entries past its tenant's
        length, which the leak oracle must not take for the tenant's when it names where a leaked row's units
        lost their owner. None (default): not recorded (the oracle reads every entry)."""
        return None

    def lost_by(self, pool: str, units) -> list[str] | None:
        """Per unit of ``units`` (``[n] int64`` of ``pool``, leaked: no owner held them at the previous check
        and no release since names them) what lost it, as the target recorded it (a leak signature's second
        part: one value per root cause, e.g. where a row write put it), ``""`` for nothing recorded; None
        (default): the target records nothing."""
        return None

    def freed_by(self, pool: str, units, frees) -> list[str] | None:
        """Per unit of ``units`` (``[n] int64`` of ``pool``, used after a premature free) what the target
        recorded of the free ``frees`` (``[n] int64`` event ids) that freed it: a use-after-free signature's
        last part, telling two causes of one free path apart (the built-in engine: ``unlocked``, a tree
        eviction of a node no lock receipt covered), ``""`` for nothing recorded; None (default): the
        target records nothing."""
        return None

    def freed_under_reader(self, pool: str, units, frees) -> list[bool] | None:
        """Per unit of ``units`` (``[n] int64`` of ``pool``, free now, allocated again and freed again since the
        previous check) whether the target recorded its free ``frees`` (``[n] int64`` event ids, its first
        since that check) as one under a reader that still held it (the built-in engine: a tree eviction of a
        node a lock receipt covered): that free, not the later one, is then the use-after-free's premature
        free. None (default): the target records nothing."""
        return None

    def dropped_by(self, rid: str) -> str | None:
        """For request ``rid``, which :meth:`progress` calls :data:`LOST`, what last handled it, as the target
        recorded it (a lost request's signature's last part, one value per path that drops requests, e.g. the
        function that released it last: a retraction, a preemption), ``""`` for nothing recorded; None
        (default): the target records nothing."""
        return None

    def free_lists(self) -> dict:
        """``{pool: [n] int64}``: the engine's free lists, checked against the event log; default none."""
        return {}

    def recount(self) -> dict:
        """``{pool: {term: Recount}}``: accounting terms recounted from the structures they describe
        (tree nodes, host copies), compared with the engine's counters; default none."""
        return {}

    def identity_terms(self, pool: str) -> tuple[str, ...]:
        """The terms of ``pool``'s accounting identity, which must add up to its ``Accounting.total``.
        Engine counters: ``available``, ``evictable``, ``protected`` (fields of :class:`Accounting`);
        kvaudit's own counts from the roots (never the engine's): ``session_held`` (units session
        roots hold privately), ``uncached`` (units live requests hold privately) and ``referenced``
        (units any root references, shared ones once). Default: SGLang's identity (its
        ``invariant_checker.py``), :data:`DEFAULT_IDENTITY`. An engine whose cached-but-free blocks count
        as free (vLLM's ``BlockPool``) states ``("available", "referenced")``."""
        return DEFAULT_IDENTITY

    def invariant_findings(self) -> list[TargetFinding]:
        """Violations of the engine's own invariants the target detects itself, of any finding kind
        (:class:`TargetFinding`), checked after every step with the oracles; default none."""
        return []

    def transient(self) -> bool:
        """Whether the engine is now in a state that one of the target's checks reads only while it lasts,
        a step or so (a step in flight that still writes blocks a free may have released): a search's sparse
        schedule (:class:`kvaudit.audit.runner.AuditedRun`, ``check_every``) checks fully after every step
        while it holds. Default False: every check of the target sees a state that persists until a later
        check, or turns into a finding the hooks raise as it happens (reads)."""
        return False

    def metrics_check(self) -> list[str]:
        """Failing lines of the engine's exported metrics (read after ``engine_check``); default none."""
        return []

    def lock_balance(self) -> list[LockImbalance]:
        """Tree nodes whose lock count differs from their live holders (device and host); default none."""
        return []

    def idle_roots(self) -> IdleRoots | None:
        """At idle, the roots when the only owner left is the cache (no request, session or other record
        holds a unit), read cheaply, so that the idle check compares them with the ledger in a few numpy
        calls instead of the full mark and sweep (:mod:`kvaudit.audit.oracles.idle`); it must describe
        exactly what :meth:`roots` and :meth:`lock_balance` would give. Reads. None (default, or a state it
        does not cover): the full check runs."""
        return None

    def lock_holders(self) -> list[tuple[str, str, int]] | None:
        """Every live lock receipt as ``(lock, holder, node id)`` (``"req:7"``), paired with the lock
        ledger's incs (:mod:`kvaudit.audit.locks`); None (default): the target names no holders."""
        return None

    def retraction(self) -> str | None:
        """What the last decode retraction freed and why it stopped, for an out-of-memory report;
        ``""``: none this run; None (default): the target does not model retraction."""
        return None

    def ownership_deltas(self, exact: bool = True) -> OwnershipDeltas | None:
        """How ownership changed since the previous call (mutates only the target's own bookkeeping), for
        the incremental per-step check (:mod:`kvaudit.audit.oracles.incremental`): a row grew or shrank, a
        prefix moved to the tree, a node was split, evicted or freed, a record was dropped. The core calls
        it at every check that is not the intake scan, so that two calls bracket one check interval. None
        (default, or for a configuration the target does not cover): no deltas, the full sweep runs.
        ``exact=False``: the target may look only where the engine's own code writes in a step (a write
        into a part of a record the step did not change, a stray one, may go unseen); the core asks for
        ``exact=True`` wherever the full sweep rebuilds its state (at idle, at the first check, after an
        anomaly or a finding, in paranoid mode), so such a write is found by that sweep."""
        return None

    def checking(self):
        """A context manager the core holds around one check (:func:`kvaudit.audit.oracles.check`): the
        engine is not stepped inside it, so a target may read once what several of its reads share (the
        live requests, say). Default: nothing (a shared ``nullcontext``)."""
        return _NO_SCOPE

    # -- optional liveness inputs (all read) ---------------------------------------------------------
    @property
    def paused(self) -> bool:
        """A pause is in force: ``idle()`` sends continue_generation first. Default False."""
        return False

    def stalled(self) -> bool:
        """Only waiting requests are left and something legitimately keeps them out (not a hang)."""
        return False

    def progress(self) -> dict[str, int]:
        """Per live request, a number that grows while it makes progress (the liveness oracle);
        :data:`LOST` for one the engine holds nowhere, never answered, and :data:`ABORT_IGNORED` for one
        answered otherwise after the engine took its abort while it was unanswered (each reported at once);
        ``{}`` (default): not checked."""
        return {}

    def flushed(self) -> int:
        """How many flush_cache requests have succeeded so far; default 0 (never checked)."""
        return 0

    def quiescence(self) -> list[tuple[str, str]]:
        """``(pool, problem)`` per violation of "every pool is full" right after a successful flush."""
        return []

    def describe_busy(self) -> str:
        """What keeps the engine from idling, for a hang report; default ``""``."""
        return ""

    def reach(self) -> dict[str, int]:
        """How often this run reached each path worth counting, by name (``{"preemptions": 3}``):
        cumulative counts since the target was built, summed over a search's programs and printed
        beside a clean run, so that a path no program reaches shows as 0 (reads). Default ``{}``."""
        return {}

    def stuck(self) -> str:
        """What keeps the engine from idling, as a hang's signature names it: ``"<where>:<why>"``, the
        structure that holds the stuck work and what that work waits for (``"prealloc:memory"``,
        ``"transfer:kv-transfer"``), with no request id or count, so that one cause reads the same
        in every program (reads). Default ``""``: not said (the hang is then ``hang/-/idle``)."""
        return ""

    def close(self) -> None:
        """The run is over: release outside resources (files, directories). Mutates; default nothing."""


REQUIRED = ("pools", "apply", "step", "is_idle", "roots", "accounting", "engine_check")
_checked: set = set()  # target classes whose reads, and (once=True) pools' shapes, passed check_target


def check_target(target, kind: str, once: bool = False) -> None:
    """That ``target`` (just built by the kind called ``kind``) keeps the target API, so a mistake in
    the target's own code is named as one instead of surfacing as an engine crash: a :class:`Target`
    that overrides every method of :data:`REQUIRED`; ``pools()`` a list of :class:`PoolSpec` with
    distinct names, positive ``page_size`` and ``num_units``, a kind of :data:`POOL_KINDS` whose API the
    pool object has when the default ``install_pool`` wraps it (``"blocks"`` and a kind of the target's
    own need its own); on the fresh engine, ``roots()`` a list of :class:`Root` of declared pools with
    ``[n]`` integer numpy ``units``, ``accounting()`` a dict of declared pool -> :class:`Accounting`,
    ``engine_check()`` a list of strings and ``kv_pools()`` a dict of declared pool -> its size in token
    slots (the reads once per target class). ``once`` (the built-in kinds,
    whose tests check them): the pools too only once per target class and pools' shape (names, kinds,
    sizes, the pool objects' types), not for every target built. Raises
    :class:`kvaudit.targets.registry.TargetDefinitionError`, one line naming ``kind`` and the problem."""
    from kvaudit.targets.registry import TargetDefinitionError

    cls = type(target)

    def bad(msg: str):
        raise TargetDefinitionError(f"target {kind}: {msg}")

    def bad_pool(spec, msg: str):  # (the pool's name spelled only for the error: this runs once per target built)
        bad(f"pool {json_value(spec.name)}{msg}")

    if not isinstance(target, Target):
        bad(f"make(config) returned a {cls.__name__}, not a kvaudit.targets.base.Target (subclass it)")
    # (a class that passed once keeps its methods: a built-in kind's every build skips the 14 lookups)
    missing = [] if cls in _checked else [m for m in REQUIRED if getattr(cls, m) is getattr(Target, m)]
    if missing:
        bad(f"{cls.__name__} does not define {', '.join(m + '()' for m in missing)}, required of every target "
            "(kvaudit/targets/base.py Target)")
    specs = target.pools()
    if not isinstance(specs, (list, tuple)) or not all(isinstance(s, PoolSpec) for s in specs):
        bad(f"{cls.__name__}.pools() must return a list of PoolSpec, got {json_value(specs, 80)}")
    shape = (cls, tuple((s.name, s.kind, s.page_size, s.num_units, type(s.obj)) for s in specs)) if once else None
    if shape in _checked:
        return
    names = [s.name for s in specs]
    if len(set(names)) != len(names) or not all(isinstance(n, str) and n for n in names):
        bad(f"{cls.__name__}.pools() must name each pool once with a non-empty string, got {json_value(names, 80)}")
    own_install = cls.install_pool is not Target.install_pool
    for s in specs:
        if not all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) and x >= 1
                   for x in (s.page_size, s.num_units)):
            bad_pool(s, f": page_size and num_units must be positive integers, got {json_value(s.page_size)} and {json_value(s.num_units)}")
        if s.kind not in POOL_KINDS and not own_install:
            bad_pool(s, f" declares kind {json_value(s.kind)}; the pool kinds are {', '.join(POOL_KINDS)} (a kind of the "
                "target's own needs its own install_pool)")
        api = POOL_KINDS.get(s.kind)
        if own_install:
            continue
        if api is None:
            bad_pool(s, f" is a {json_value(s.kind)} pool, which has no standard wrapping: {cls.__name__}.install_pool must "
                "call auditor.wrap_blocks(spec, ids, alloc=..., ref=..., unref=...)")
        lacking = [m for m in api if not callable(getattr(s.obj, m, None))]
        if s.kind == "kv" and not any(callable(getattr(s.obj, m, None)) for m in ("alloc", "alloc_extend",
                                                                                   "alloc_decode")):
            lacking.insert(0, "alloc")
        if lacking:
            bad_pool(s, f" declares kind {json_value(s.kind)}, but its {type(s.obj).__name__} has no {', '.join(lacking)}() "
                f"(a {json_value(s.kind)} pool's API: {', '.join(api)}" + (", alloc" if s.kind == "kv" else "")
                + "); declare the kind it is, or wrap it in install_pool")
    if cls not in _checked:
        _check_reads(target, cls, specs, bad)
    if once:
        _checked.add(shape)


def _check_reads(target, cls: type, specs, bad) -> None:
    # check_target's reads of the fresh engine (once per target class)
    names = [s.name for s in specs]
    roots, acc, verdict = target.roots(), target.accounting(), target.engine_check()
    if not isinstance(roots, (list, tuple)) or not all(isinstance(r, Root) for r in roots):
        bad(f"{cls.__name__}.roots() must return a list of Root, got {json_value(roots, 80)}")
    for r in roots:
        if r.pool not in names:
            bad(f"{cls.__name__}.roots(): a root of {r.owner} names pool {json_value(r.pool)}, which pools() does not declare")
        wrong = _units_problem(cls.__name__, r)
        if wrong:
            bad(wrong)
    if not isinstance(acc, dict) or not all(p in names and isinstance(a, Accounting) for p, a in acc.items()):
        bad(f"{cls.__name__}.accounting() must return {{declared pool: Accounting}}, got {json_value(acc, 80)}")
    if not isinstance(verdict, list) or not all(isinstance(x, str) for x in verdict):
        bad(f"{cls.__name__}.engine_check() must return a list of strings, got {json_value(verdict, 80)}")
    wrong = _kv_pools_problem(target, specs)
    if wrong:
        bad(wrong)
    _checked.add(cls)


def _kv_pools_problem(target, specs) -> str | None:
    # kv_pools() not {declared pool: int token slots, enough for its units}: what is wrong; None when nothing
    slots = {s.name: (s.num_units + 1) * s.page_size for s in specs}
    kv = target.kv_pools()
    if isinstance(kv, dict) and all(p in slots and _int(n) and n >= slots[p] for p, n in kv.items()):
        return None
    return (f"{type(target).__name__}.kv_pools() must return {{declared pool: its size in token slots, an int >= "
            f"(num_units + 1) * page_size}}, got {json_value(kv, 80)}")


LOST = -2  # Target.progress(): a request sent, never answered, that the engine holds nowhere
#: Target.progress(): a request the engine took an abort for while it was unanswered, then answered with
#: another reason (the abort ignored: it ran on to its end)
ABORT_IGNORED = -3

#: every term an identity may name (:meth:`Target.identity_terms`)
IDENTITY_TERMS = ("available", "evictable", "protected", "session_held", "uncached", "referenced")


def _int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _int_units(u) -> bool:
    return isinstance(u, np.ndarray) and u.ndim == 1 and u.dtype.kind in "iu"


def _read_rules(pools: dict) -> dict:
    """A plugin target's reads past ``roots()`` that :func:`check_reads_always` checks at every call: method ->
    (does the value keep the API?, what the method must return). ``pools``: the declared pools' names -> their
    ``num_units``."""
    def by_pool(v, fits):
        return isinstance(v, dict) and all(p in pools and fits(x) for p, x in v.items())

    def units_by_pool(v):  # (the oracles index each pool's ledger by them: 0, a row table's empty entry, too)
        return v is None or isinstance(v, dict) and all(
            p in pools and _int_units(u) and (not u.size or 0 <= u.min() and u.max() <= pools[p]) for p, u in v.items())

    def by_name(v):
        return isinstance(v, dict) and all(isinstance(k, str) and _int(x) for k, x in v.items())

    def per_unit_text(v):
        return v is None or isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v)

    def finding(t):  # (units: any integer array-like, or none: the oracle reads them with np.asarray)
        if not (isinstance(t, TargetFinding) and t.pool in pools and isinstance(t.lost_by, str)):
            return False
        try:
            units = np.asarray(t.units)
        except (TypeError, ValueError):  # (a ragged list)
            return False
        return units.size == 0 or units.dtype.kind in "iu"

    return {
        "is_idle": (lambda v: isinstance(v, (bool, np.bool_)), "a bool"),
        "accounting": (lambda v: by_pool(v, lambda a: isinstance(a, Accounting)), "{declared pool: Accounting}"),
        "engine_check": (lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v), "a list of strings"),
        "free_lists": (lambda v: by_pool(v, _int_units), "{declared pool: [n] integer numpy array}"),
        "identity_terms": (lambda v: isinstance(v, (tuple, list)) and bool(v) and all(t in IDENTITY_TERMS for t in v),
                           f"a tuple of {', '.join(IDENTITY_TERMS)}"),
        "invariant_findings": (lambda v: isinstance(v, list) and all(finding(t) for t in v),
                               "a list of TargetFinding of declared pools with integer units and a string lost_by"),
        "progress": (by_name, "{request: int}"),
        "reach": (by_name, "{name: int}"),
        "describe_busy": (lambda v: isinstance(v, str), "a string"),
        "stuck": (lambda v: isinstance(v, str), "a string"),
        "crash_by": (lambda v: isinstance(v, str), "a string"),  # (the finding's check: a replay file reads a string)
        "lost_by": (per_unit_text, "None or a list of strings (one per unit)"),  # (a signature's part, as crash_by)
        "freed_by": (per_unit_text, "None or a list of strings (one per unit)"),
        "dropped_by": (lambda v: v is None or isinstance(v, str), "a string or None"),  # (the check's last part)
        "units_of_rows": (units_by_pool, "None or {declared pool: [n] integer numpy array of units in [0, num_units]}"),
        "units_of_tenants": (units_by_pool,
                             "None or {declared pool: [n] integer numpy array of units in [0, num_units]}"),
    }


def check_reads_always(target, kind: str) -> None:
    """For a kind that is not built in (a plugin): check every read the run makes, not only the fresh
    engine's (which holds no request, so :func:`check_target` sees empty roots and the first counters):
    ``kv_pools()`` of this build's pools (checked once per target class by :func:`check_target`), each
    ``roots()`` a list of :class:`Root` with ``[n]`` integer numpy ``units`` in ``[1, num_units]`` of
    its declared pool (0 is reserved), and each of :func:`_read_rules`' methods the class overrides (a
    default keeps the API) what its rule says. A mistake met mid-run raises
    :class:`kvaudit.targets.registry.TargetDefinitionError` naming ``kind``, the method and the value,
    instead of an ``AttributeError`` in an oracle reported as the engine's crash (or, for ``is_idle()``
    returning None, a hang of an idle engine); so does a :data:`LABELS` method that raises, naming it and the
    exception. Replaces the instance's methods (the built-in kinds, checked by their tests, skip the cost)."""
    from kvaudit.targets.registry import TargetDefinitionError

    specs = target.pools()
    sizes = {s.name: int(s.num_units) for s in specs}
    cls = type(target)
    wrong = _kv_pools_problem(target, specs)  # (per build: a config may size its pools otherwise)
    if wrong:
        raise TargetDefinitionError(f"target {kind}: {wrong}")
    name, read = cls.__name__, target.roots

    def roots(*args, **kwargs):
        got = read(*args, **kwargs)
        if not isinstance(got, (list, tuple)) or not all(isinstance(r, Root) for r in got):
            raise TargetDefinitionError(f"target {kind}: {name}.roots() must return a list of Root, got {json_value(got, 80)}")
        for r in got:
            wrong = _units_problem(name, r, sizes.get(r.pool))
            if wrong:
                raise TargetDefinitionError(f"target {kind}: {wrong}")
        return got

    def checked(method: str, fits, what: str):
        call = getattr(target, method)

        def read_checked(*args):
            got = call(*args)
            if not fits(got):
                spelled = ", ".join(json_value(a, 80) for a in args)  # (crash_by's: an exception, its message long)
                raise TargetDefinitionError(f"target {kind}: {name}.{method}({spelled}) must return {what}, "
                                            f"got {json_value(got, 80)}")
            return got
        return read_checked

    def owned(method: str):  # a raise in a method that only labels a finding is the target's, not the engine's
        call = getattr(target, method)

        def labelled(*args):
            try:
                return call(*args)
            except TargetDefinitionError:
                raise
            except Exception as e:  # noqa: BLE001 -- the plugin's own code
                raise TargetDefinitionError(f"target {kind}: {name}.{method} raised {type(e).__name__}: "
                                            f"{' '.join(str(e).split())} (KVAUDIT_DEBUG=1 shows its traceback)") from e
        return labelled

    target.roots = roots
    for method, (fits, what) in _read_rules(sizes).items():
        if getattr(cls, method) is not getattr(Target, method):
            setattr(target, method, checked(method, fits, what))
    for method in LABELS:
        if getattr(cls, method) is not getattr(Target, method):
            setattr(target, method, owned(method))


#: the optional methods that only label a finding (its signature's part): one that raises loses the finding, so
#: :func:`check_reads_always` makes the raise the target's one line (exit 2), not the engine's crash or kvaudit's
LABELS = ("crash_by", "lost_by", "freed_by", "freed_under_reader", "dropped_by")


def _units_problem(cls_name: str, root: Root, top: int | None = None) -> str | None:
    """What is wrong with ``root.units`` (of a target of class ``cls_name``): not a ``[n]`` integer numpy
    array, or, with ``top`` (the pool's ``num_units``), a unit outside ``[1, top]``; None when nothing."""
    u = root.units
    if not (isinstance(u, np.ndarray) and u.ndim == 1 and u.dtype.kind in "iu"):
        return (f"{cls_name}.roots(): {root.owner}'s units must be a [n] integer numpy array, got {type(u).__name__}"
                + (f" of {u.dtype}, shape {u.shape}" if isinstance(u, np.ndarray) else ""))
    if top is not None and u.size and (u.min() < 1 or u.max() > top):
        return (f"{cls_name}.roots(): {root.owner}'s units of pool {json_value(root.pool)} must be in [1, {top}] "
                f"(unit 0 is reserved; {top} its num_units), got {int(u.min())} to {int(u.max())}")
    return None


def kv_length_problems(reqs) -> list[str]:
    """SGLang invariant 6 for each live request ``reqs`` (objects with ``rid`` and ``kv``, a
    ``ReqKvInfo``): ``0 <= kv_committed_len <= kv_allocated_len``; one line per violation."""
    return [f"[req_to_token_pool] req:{r.rid} kv_committed_len={r.kv.kv_committed_len} > "
            f"kv_allocated_len={r.kv.kv_allocated_len}"
            for r in reqs if not 0 <= r.kv.kv_committed_len <= r.kv.kv_allocated_len]


def slot_pages(slots: torch.Tensor, page_size: int) -> np.ndarray:
    """Token slots (``[n]`` int tensor, any device) as units: the slots themselves with page size 1,
    else the sorted distinct pages (``[m] int64``)."""
    if page_size == 1 and slots.dtype == torch.int64 and slots.device.type == "cpu":
        return slots.numpy()  # NOTE: what the line below gives (a view), without its two no-op calls (~4 us)
    s = slots.to(torch.int64).cpu().numpy()
    return s if page_size == 1 else np.unique(s // page_size)


def record_roots(table: torch.Tensor, kv, owner: str, role: str, page_size: int, where: str = "") -> list[Root]:
    """The roots of one KV record (``ReqKvInfo``: ``req_pool_idx``, ``cache_protected_len``,
    ``kv_allocated_len``) in ``req_to_token`` ``table``: its row, its own KV
    ``[cache_protected_len, kv_allocated_len)`` (private) and the tree-owned prefix before it (shared)."""
    return records_roots(table, [(kv, owner, role, where)], page_size)


def records_roots(table: torch.Tensor, records: list[tuple], page_size: int, row_base: int = 0) -> list[Root]:
    """:func:`record_roots` of every ``(kv, owner, role, where)`` of ``records``, in their order, from one
    gather of their rows of ``table`` (``[rows, context] int`` tensor on any device). Each root's units
    are its own (a view of the gathered copy, never of the live table); row ``r``'s unit is ``r + row_base``."""
    if not records:
        return []
    kvs = [r[0] for r in records]
    idx = np.array([kv.req_pool_idx for kv in kvs], dtype=np.int64)
    alloc = [kv.kv_allocated_len for kv in kvs]
    if table.device.type == "cpu":  # NOTE: numpy's gather costs a fraction of torch's indexing per row
        rows = table.numpy()[idx, :max(alloc)].astype(np.int64, copy=False)
    else:
        rows = table[torch.from_numpy(idx).to(table.device), :max(alloc)].to(torch.int64).cpu().numpy()
    if page_size > 1:
        rows = rows // page_size  # (np.unique below: each root's sorted distinct pages)
    out, units = [], idx + row_base if row_base else idx
    for i, (kv, owner, role, where) in enumerate(records):
        protected, row = kv.cache_protected_len, rows[i, : alloc[i]]
        own, shared = row[protected:], row[:protected]
        if page_size > 1:
            own, shared = np.unique(own), np.unique(shared)
        out += [Root("req_to_token_pool", owner, units[i:i + 1], role=role, where=where),
                Root("token_to_kv_pool", owner, own, role=role, where=where)]
        if protected:
            out.append(Root("token_to_kv_pool", owner, shared, private=False, role=role))
    return out


def span_units(table: np.ndarray, rows: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> tuple:
    """The entries of ``table`` (``[rows, cols]`` numpy) in ``[starts[i], ends[i])`` of row ``rows[i]``
    (``[m] int64`` each; empty spans allowed), in span order, in one gather. Returns ``(units, rows, cols,
    span)``: ``[k] int64`` each, ``span`` the index of each entry's span."""
    lengths = np.maximum(ends - starts, 0)
    span = np.repeat(np.arange(lengths.size), lengths)
    cols = np.arange(span.size) - np.repeat(np.cumsum(lengths) - lengths, lengths) + starts[span]
    r = rows[span]
    return table[r, cols].astype(np.int64, copy=False), r, cols, span


def wrap_insert(wrap, tree, name: str, measure: Callable, report: Callable, depth: int = 4) -> None:
    """Wrap ``tree.<name>`` (the tree's insert) with ``wrap(obj, name, fn)`` so that each call is checked
    before it runs: the request being cached is the nearest caller (up to ``depth`` frames out) with a
    local ``req`` that holds a KV record; ``measure(req, *args, **kwargs)`` returns ``(owner, inserted,
    committed, value)`` (``value``: the inserted slots, ``[n]`` int64 tensor) and, when ``inserted >
    committed``, ``report(owner, inserted, committed, value[committed:inserted])`` is called. An insert with no
    such caller (a warm-up, a test) is not checked. Lives here, outside any engine file, so that the
    insert's site starts at the engine's caller."""
    insert = getattr(tree, name)

    def insert_wrapper(*a, **k):
        f, req = sys._getframe(1), None
        for _ in range(depth):
            if f is None:
                break
            req = f.f_locals.get("req")
            if getattr(getattr(req, "kv", None), "kv_committed_len", None) is not None:
                break
            req, f = None, f.f_back
        if req is not None:
            owner, inserted, committed, value = measure(req, *a, **k)
            if inserted > committed:
                report(owner, inserted, committed, value[committed:inserted])
        return insert(*a, **k)

    wrap(tree, name, insert_wrapper)
