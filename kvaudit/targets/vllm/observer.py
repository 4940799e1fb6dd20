"""What kvaudit reads from vLLM's v1 KV-cache stack, shared by the Scheduler- and manager-level drivers.

* **Hooks.** The ``BlockPool`` *instance*'s ``get_new_blocks`` (an allocation), ``touch`` (a reference
  more: a prefix hit), ``free_blocks`` (a reference fewer) feed kvaudit's reference-counted ledger
  (``Auditor.wrap_blocks``); ``_insert_block_hash`` and ``_remove_cached_block_hashes`` (the prefix-cache
  map) are logged with their sites; ``take_events`` is teed so that vLLM's own KV-cache events
  (``BlockStored``/``BlockRemoved``/``AllBlocksCleared``) are replayed into a shadow of the map.
* **Roots.** Each non-null block of each group's ``req_to_blocks[rid]`` for every request the scheduler
  still knows (``Scheduler.requests``: waiting, running, preempted, finished-but-held), each pending
  copy-on-write pair (``_pending_cow_copies``), each deferred free (``Scheduler.deferred_frees``) and
  each GPU block a KV connector's scheduler side holds for a transfer in flight (``connector_holders``).
  A block two holders reference is shared (not private to either).
* **Invariants** (:meth:`VllmObserver.invariant_findings`): ref counts equal root references; on the
  free queue iff the count is 0; a well-formed free list of ``num_free_blocks``; the null block never
  freed, queued or hashed; the hash map and the blocks' hashes agree both ways; a request's cached
  blocks carry its own hash chain; ``num_computed_tokens`` within the allocated blocks; the ledger's
  counts equal vLLM's (no change outside the pool's API); the replayed events equal the map. vLLM has
  no checker of its own (its tests read ``ref_cnt`` and the free queue by hand).

Private names read here are those of vLLM 0.15.1, 0.16.0 and 0.20.0 to 0.33.0 (where they changed: :mod:`.compat`):
``cached_block_hash_to_block._cache``, ``cached_block_hashes_by_block``, the free queue's
``fake_free_list_head``/``_tail``, each single-type manager's ``req_to_blocks``/``num_cached_block``/
``_pending_cow_copies``, ``Scheduler.deferred_frees``.
"""

from __future__ import annotations

import functools
import sys
from collections import Counter
from itertools import filterfalse
from operator import attrgetter

import numpy as np

from kvaudit.targets.base import Accounting, PoolSpec, ReadOnce, Root, TargetFinding

POOL = "block_pool"
# a KVCacheBlock's fields, read in C (map over the pool's blocks)
_BLOCK_HASH, _BLOCK_ID, _REF_CNT = attrgetter("block_hash"), attrgetter("block_id"), attrgetter("ref_cnt")
_IS_NULL = attrgetter("is_null")
TABLE_FRAMES = 3  # frames above a get_new_blocks/touch call searched for the manager and request it serves


def after_call(obj, name: str, hook, wrap=setattr) -> None:
    """Wrap the *instance*'s ``obj.name`` (through ``wrap(obj, name, fn)``): ``hook(result, *args, **kwargs)``
    runs after each call, whose result goes on unchanged."""
    fn = getattr(obj, name)

    def call(*a, **k):
        out = fn(*a, **k)
        hook(out, *a, **k)
        return out

    wrap(obj, name, call)


def count(into: Counter, keys, delta: int) -> None:
    """Add ``delta`` to ``into[key]`` for each of ``keys``; a key that reaches 0 goes."""
    for key in keys:
        into[key] += delta
        if not into[key]:
            del into[key]


def _adder(out: list):
    """``add(kind, units, message, check, free_sites=(), lost_by="")``: a :class:`TargetFinding` of the pool into
    ``out``."""
    return lambda kind, units, message, check, free_sites=(), lost_by="": out.append(TargetFinding(
        kind, POOL, np.asarray(units, dtype=np.int64), message, check=check, free_sites=free_sites, lost_by=lost_by))


@functools.cache
def status_names(statuses) -> dict:
    """vLLM's ``RequestStatus`` (``statuses``) -> each status's name in lower case, the place a request sits as
    the targets' ``known()`` names it (an enum's ``name`` is a Python property: read once a process)."""
    return {s: s.name.lower() for s in statuses}


def _dropped_from(where: str) -> str:
    """What a block table dropped whole says of its blocks (``lost_by``'s words): ``from:<where>``, the place its
    request sat (:meth:`VllmObserver._settle_tables`), or ``table:lost`` when none is known (``where`` empty)."""
    return f"from:{where}" if where else "table:lost"


def block_ids(blocks) -> list[int]:
    """Ids of ``blocks`` (vLLM ``KVCacheBlock``), the null block left out (vLLM never counts it). (Read in C: the
    ledger's wrappers and the table records call it on every block a call takes or frees.)"""
    return list(map(_BLOCK_ID, filterfalse(_IS_NULL, blocks)))


class VllmObserver:
    """Mixed into a vLLM target; needs ``self.config`` (:class:`~kvaudit.targets.vllm.config.VllmConfig`),
    ``self.manager`` (the ``KVCacheManager``), ``self.V`` (:func:`~kvaudit.targets.vllm.boot.load`),
    ``self.known()`` (request id -> ``(Request, where)`` for every request the scheduler knows, ``where``
    naming its queue; ``self.requests``, the same ids to their ``Request``) and ``self.deferred()`` (the
    block lists of deferred frees)."""

    owner_hint_vars = ("request",)
    owner_stop_vars = ()

    def _init_observer(self) -> None:
        self.pool = self.manager.block_pool
        self.groups = self.manager.coordinator.single_type_managers
        n = self.config.num_gpu_blocks
        self._pools = [PoolSpec(POOL, self.pool, "blocks", self.config.block_size, n - 1)]
        # (step, "insert"|"remove", block id, hash, site id: Auditor.site(id) is its stack)
        self.hash_log: list[tuple[int, str, int, bytes, int]] = []
        self.event_map: Counter = Counter()  # (external hash, group) -> blocks, from vLLM's KV-cache events
        self._event_keys: dict = {}  # a map key -> its (external hash, group), as an event names it
        self._auditor = None
        self.block_tables: list | None = None  # per block, its latest table (_wrap_tables; None: unaudited)
        self._reads = ReadOnce()  # the holders, free queue and counts one check reads twice otherwise
        self._unsettled: list[tuple[str, list, list[int]]] = []  # (request id, table, blocks) since the last settle
        # (table, where its request sat) of each settled record since the look before the latest (_dropped_with)
        self._placed: list[tuple[list, str]] = []
        self._placed_cut = 0  # where the latest look's records begin in _placed
        self._looks: tuple = ((), [], [])  # (mark, holders) of the latest roots() look, and the holders before it
        # the scheduler's call in update_from_output; the events still go on
        after_call(self.manager, "take_events", lambda events, *_, **__: self._replay_events(events, self.event_map))

    # -- hooks -------------------------------------------------------------------------------------
    def pools(self) -> list[PoolSpec]:
        return self._pools

    def install_pool(self, spec, auditor, wrap) -> None:
        """``get_new_blocks``/``touch``/``free_blocks`` into the ledger; the map's insert and removal
        logged (``hash_log``) with the step and the site."""
        self._auditor = auditor
        auditor.wrap_blocks(spec, block_ids, alloc="get_new_blocks", ref="touch", unref="free_blocks")
        pool = self.pool
        # each block's previous and last unref site (Auditor.capture_site ids; -1: none): what a ref_cnt
        # found below its holders names as the two frees
        self.unref_sites = np.full((self.config.num_gpu_blocks, 2), -1, dtype=np.int64)
        free = pool.free_blocks

        queue = pool.free_block_queue
        self.queued_twice: list[TargetFinding] = []

        def free_wrapper(blocks, *a, **k):
            blocks = list(blocks)  # may be an iterator (reversed(...)): read once
            ids = block_ids(blocks)
            if not ids:
                return free(blocks, *a, **k)
            once, sites, site = set(ids), self.unref_sites, auditor.capture_site()
            for b in once:  # (a few blocks a call: item by item beats numpy's fancy indexing)
                sites[b, 0] = sites[b, 1]
                sites[b, 1] = site
            before = queue.num_free_blocks
            out = free(blocks, *a, **k)
            if len(ids) > len(once):
                self._check_queued_once(np.asarray(ids, dtype=np.int64), queue.num_free_blocks - before)
            return out

        wrap(pool, "free_blocks", free_wrapper)
        self._wrap_tables(auditor, wrap)
        if self.V.has("pending-cow"):
            for mgr in self.groups:
                self._wrap_cow_refs(mgr, auditor, wrap)
        if self.V.has("hash-helpers"):
            self._wrap_hash_helpers(auditor, wrap)
        else:
            self._wrap_hash_map(auditor)

    def _wrap_tables(self, auditor, wrap) -> None:
        """Record, per block, the block table its latest ``get_new_blocks`` or ``touch`` took it for: the list
        ``req_to_blocks[request_id]`` of the single-type manager that called (the nearest of
        :data:`TABLE_FRAMES` frames with a ``self`` that has ``req_to_blocks`` and a str ``request_id``), and
        ``len(auditor.events)`` after the call (read by :meth:`lost_by`), and where the request sits once the
        ``schedule()`` that called is done (its status, as :meth:`known` names it: :meth:`_settle_tables`, which
        the target's step calls after ``schedule()``). Only calls that take blocks pay the frame walk (a few per
        request, not one per step)."""
        n = self.config.num_gpu_blocks
        self.block_tables = [None] * n
        self.block_table_at = np.full(n, -1, dtype=np.int64)
        self.block_where = np.full(n, "", dtype=object)  # (object: a settle writes a request's blocks at once)

        tables_of, at_of, unsettled, events = self.block_tables, self.block_table_at, self._unsettled, auditor.events
        for name in ("get_new_blocks", "touch"):
            fn = getattr(self.pool, name)

            def call(*a, _fn=fn, _new=name == "get_new_blocks", **k):
                out = _fn(*a, **k)
                blocks = out if _new else a[0] if a else k.get("blocks")
                if not blocks or not isinstance(blocks, (list, tuple)):
                    return out
                f = sys._getframe(1)  # (the caller, then up)
                for _ in range(TABLE_FRAMES):
                    if f is None:
                        break
                    names = f.f_locals
                    rid, tables = names.get("request_id"), getattr(names.get("self"), "req_to_blocks", None)
                    if isinstance(rid, str) and tables is not None:
                        table, ids = tables.get(rid), block_ids(blocks)
                        for b in ids:
                            tables_of[b] = table
                        at_of[ids] = len(events)
                        unsettled.append((rid, table, ids))
                        break
                    f = f.f_back
                return out

            wrap(self.pool, name, call)

    def _settle_tables(self) -> None:
        """Where (a request's status, lower case) each request that took blocks since the last call sits now,
        for those blocks: called by the target's step right after ``schedule()`` (when a request took blocks),
        the queue a check would have seen it in (``running``; a load in flight: ``waiting_for_remote_kvs``). Each
        table goes into ``_placed`` with that place, even one a later ``touch`` displaced as its blocks' latest
        (:meth:`_dropped_with`)."""
        where, requests, block_where = status_names(self.V.RequestStatus), self.requests, self.block_where
        placed = self._placed
        for rid, table, ids in self._unsettled:
            request = requests.get(rid)
            place = "" if request is None else where[request.status]
            block_where[ids] = place
            placed.append((table, place))
        self._unsettled.clear()

    def lost_by(self, pool: str, units) -> list[str] | None:
        """Per leaked block of ``units`` (``[n] int64``; no holder at the previous check, no free named it),
        what its latest block table (:meth:`_wrap_tables`) says: when that table still lists it (the table went
        out of reach whole: dropped, or kept for a request the scheduler no longer knows), ``from:<where>``, the
        place its request sat (:meth:`_settle_tables`; ``table:lost`` if none is known): the words the core gives
        an owner a check saw dropped with nothing freed (``Root.where``), as a request dropped in the step that
        gave it the block is the same bug; ``table:cut`` when the table no longer lists it (cut off its table
        with no free); ``""`` when no table was recorded since the block's latest allocation. A ``from:`` table
        released through the pool (a preempted request's, whose prefix only a dropped table still holds) lost
        nothing: the table :meth:`_dropped_with` finds dropped with its references names it, when there is
        one. None for another pool, or unaudited."""
        tables = self.block_tables
        if pool != POOL or tables is None:
            return None
        self._settle_tables()  # (a level with no schedule(): where the request sits now)
        u = np.asarray(units, dtype=np.int64)
        fresh = self.block_table_at[u] > self._auditor.ledgers[POOL].last_alloc[u]
        out = []
        for b, ok in zip(u.tolist(), fresh.tolist()):
            table = tables[b] if ok else None
            where = _dropped_from(self.block_where[b])
            out.append("" if table is None else where if b in block_ids(table) else "table:cut")
        if any(x and x != "table:cut" for x in out):
            dropped = self._dropped_with(u, self._ref_counts(), self._holders(self.known())[1])
            out = [d if d and x and x != "table:cut" else x for x, d in zip(out, dropped)]
        return out

    def _wrap_cow_refs(self, mgr, auditor, wrap) -> None:
        """Wrap ``mgr.allocate_new_blocks``: a copy-on-write it queues (``_pending_cow_copies``: a partial
        cache hit's block, or a running request's partial tail) takes a reference on an endpoint by
        ``ref_cnt += 1``, outside the pool's API (``_apply_cow``; ``MambaManager.allocate_new_blocks``):
        the ledger counts it (a ref at that site), for the endpoints whose count runs one above it."""
        allocate = mgr.allocate_new_blocks

        def allocate_wrapper(*a, **k):
            n = len(mgr._pending_cow_copies)
            out = allocate(*a, **k)
            pairs = mgr._pending_cow_copies[n:]
            if pairs:
                ids = np.array(block_ids(b for pair in pairs for b in pair), dtype=np.int64)
                led = auditor.ledgers[POOL].refs
                above = ids[self._ref_counts()[ids] == led[ids] + 1]
                if above.size:
                    auditor.on_ref(POOL, above.tolist(), auditor.capture_site())
            return out

        wrap(mgr, "allocate_new_blocks", allocate_wrapper)

    def free_sites(self, b: int) -> tuple[int, ...]:
        """Block ``b``'s previous and last unref sites (``Auditor.capture_site`` ids, -1: none): a finding's
        ``free_sites``, the frees that may have broken an invariant of ``b``; ``()`` when not audited."""
        return tuple(int(x) for x in self.unref_sites[b]) if self._auditor is not None else ()

    def _check_queued_once(self, ids: np.ndarray, grown: int) -> None:
        """One ``free_blocks`` call that listed a block more than once (``ids``, ``[n] int64``): each block
        whose last reference it dropped joins the free queue once, so the queue grows by the number of
        distinct listed blocks now at ``ref_cnt`` 0. More is a block queued twice, a double free inside
        the free list (vLLM <= 0.23.0's ``free_blocks`` decrements every listed entry, then queues every
        entry whose count ended at 0; vLLM #42571, eager ``SimpleCPUOffloadConnector`` + sliding window).
        Recorded in ``queued_twice`` (reported by :meth:`invariant_findings`)."""
        uniq, counts = np.unique(ids, return_counts=True)
        zero = self._ref_counts()[uniq] == 0
        if grown <= int(zero.sum()):
            return
        twice = uniq[zero & (counts > 1)]
        b = int(twice[0]) if twice.size else int(uniq[0])
        self.queued_twice.append(TargetFinding(
            "double-free", POOL, twice if twice.size else uniq[:1],
            f"one BlockPool.free_blocks call listed block {b} {int(counts[uniq == b][0])} times and its last "
            f"reference went: the free queue grew by {grown} for {int(zero.sum())} block(s) freed (block {b} "
            "queued twice)", check="queued-twice",
            free_sites=self.free_sites(b)))

    def _log_hashes(self, what: str, block_id: int, hashes, auditor) -> None:
        step, sid = self.steps, auditor.capture_site()
        self.hash_log += [(step, what, block_id, h, sid) for h in hashes]

    def _log_insert(self, owner, name: str, auditor, wrap=setattr) -> None:
        """Log each ``owner.name(block_hash, block, ...)`` (the pool's insert helper or the map's own insert)."""
        log = self.hash_log
        after_call(owner, name, lambda _, h, block, *a, **k: log.append(
            (self.steps, "insert", block.block_id, h, auditor.capture_site())), wrap)

    def _wrap_hash_helpers(self, auditor, wrap) -> None:
        """vLLM >= 0.24.0 (``compat`` "hash-helpers"): the pool's own insert and removal helpers."""
        self._log_insert(self.pool, "_insert_block_hash", auditor, wrap)
        after_call(self.pool, "_remove_cached_block_hashes", lambda out, block, *a, **k: out and self._log_hashes(
            "remove", block.block_id, out, auditor), wrap)

    def _wrap_hash_map(self, auditor) -> None:
        """vLLM 0.23.0: ``cache_full_blocks`` and ``_maybe_evict_cached_block`` call the map's own
        ``insert`` / ``pop``; ``reset_prefix_cache`` replaces the map, so the new one is wrapped again."""
        pool = self.pool

        def wrap_map(m):
            self._log_insert(m, "insert", auditor)
            after_call(m, "pop", lambda out, h, block_id, *a, **k: out is not None and self._log_hashes(
                "remove", block_id, [h], auditor))

        wrap_map(pool.cached_block_hash_to_block)
        after_call(pool, "reset_prefix_cache", lambda out, *a, **k: out and wrap_map(pool.cached_block_hash_to_block))

    def _extra_hashes(self, block_id: int) -> tuple:
        """The other hashes block ``block_id`` is cached under (``cached_block_hashes_by_block``, vLLM
        >= 0.24.0; none before)."""
        return tuple(getattr(self.pool, "cached_block_hashes_by_block", {}).get(block_id, ()))

    def framework_files(self) -> list[str]:
        """vLLM's allocator stack (pool, free queue, coordinator, managers): a site is its caller, the
        scheduler's function (``scheduler.py``), or the manager-level driver's."""
        return [m.__file__ for m in self.V.modules]

    @staticmethod
    def owner_hint(frame_locals: dict) -> str | None:
        r = frame_locals.get("request")
        rid = getattr(r, "request_id", None)
        return f"req:{rid}" if isinstance(rid, str) else None

    # -- KV-cache events ---------------------------------------------------------------------------
    def _replay_events(self, events, into: Counter) -> None:
        """Apply vLLM's KV-cache ``events`` to ``into``, a map (external hash, group) -> blocks."""
        V = self.V
        grouped = V.has("kv-event-group")  # before vLLM 0.20.0 an event names no group: keyed by hash alone
        for ev in events:
            if isinstance(ev, (V.BlockStored, V.BlockRemoved)):
                count(into, [(h, ev.group_idx if grouped else None) for h in ev.block_hashes],
                      -1 if isinstance(ev, V.BlockRemoved) else 1)
            elif isinstance(ev, V.AllBlocksCleared):
                into.clear()

    def _replayed(self) -> Counter:
        """The map the events give: those taken so far plus those still queued in the pool (read, not
        taken: the scheduler takes them at the end of ``update_from_output``)."""
        if not self.pool.kv_event_queue:
            return self.event_map  # (read only: none queued, no copy)
        out = Counter(self.event_map)
        self._replay_events(self.pool.kv_event_queue, out)
        return out

    def _map_entries(self) -> list[tuple[bytes, object]]:
        """``(key, block)`` for every entry of vLLM's prefix-cache map (a key may map several blocks)."""
        return [(key, b) for key, val in self.pool.cached_block_hash_to_block._cache.items()
                for b in (val.values() if isinstance(val, dict) else (val,))]

    # -- roots -------------------------------------------------------------------------------------
    def _holders(self, known: dict) -> tuple[list[tuple[str, str, np.ndarray]], np.ndarray]:
        """``(owner, where, [n] int64 block ids)`` for every holder of references -- each ``known``
        request's table in each group, each pending copy-on-write pair, each deferred free -- and the
        references they hold per block, ``[num_gpu_blocks] int64``."""
        out = []
        for g, mgr in enumerate(self.groups):
            tables = mgr.req_to_blocks
            for rid, (_, where) in known.items():
                blocks = tables.get(rid)
                if blocks:
                    out.append((f"req:{rid}", where, np.array(block_ids(blocks), dtype=np.int64)))
            out += self._cow_holders(g, mgr)
        out += self._other_holders()
        held = np.concatenate([units for _, _, units in out]) if out else np.zeros(0, dtype=np.int64)
        return out, np.bincount(held, minlength=self.config.num_gpu_blocks).astype(np.int64)

    def _cow_holders(self, g: int, mgr) -> list[tuple[str, str, np.ndarray]]:
        """:meth:`_holders` of group ``g``'s (``mgr``'s) pending copy-on-write pairs."""
        return [(f"cow:{g}.{i}", "cow", np.array(block_ids(pair), dtype=np.int64))
                for i, pair in enumerate(mgr._pending_cow_copies if self.V.has("pending-cow") else ())]

    def _other_holders(self) -> list[tuple[str, str, np.ndarray]]:
        """:meth:`_holders` of each deferred free, then :meth:`connector_holders`."""
        return [(f"deferred:{i}", "deferred", np.array(block_ids(blocks), dtype=np.int64))
                for i, blocks in enumerate(self.deferred())] + self.connector_holders()

    def copy_findings(self, copies) -> list[TargetFinding]:
        """Each endpoint of a copy-on-write a step in flight still runs (``copies``: vLLM's
        ``KVCacheBlockCopy(src_block_id, dst_block_id)`` of the ``SchedulerOutput`` s not yet processed)
        holds a reference: vLLM retains both until that step has run (``Scheduler._free_cow_retained_blocks``
        parks them behind its fence when a KV consumer may load into a freed block unordered against the
        step). One freed (``ref_cnt`` 0) is a use-after-free: a load may overwrite the source before the copy
        reads it, or the destination after (check ``cow-inflight``). The caller passes only the copies that
        vLLM's own condition guards."""
        ids = np.array(copies, dtype=np.int64).reshape(-1)
        freed = ids[self._ref_counts()[ids] == 0] if ids.size else ids
        if not freed.size:
            return []
        b = int(freed[0])
        end = "source" if b in {int(c[0]) for c in copies} else "destination"
        return [TargetFinding("use-after-free", POOL, np.unique(freed),
                              f"block {b}, the {end} of a copy-on-write a step in flight still runs, was freed "
                              "before that step ran (ref_cnt=0)", check="cow-inflight", free_sites=self.free_sites(b),
                              used_by=(f"the copy-on-write of a step in flight, as its {end}",))]

    def connector_holders(self) -> list[tuple[str, str, np.ndarray]]:
        """``(owner, where, [n] int64 block ids)`` for each reference a KV connector's scheduler side holds
        on GPU blocks itself (a transfer in flight), one per id listed: none by default."""
        return []

    def transient(self) -> bool:
        """A step in flight under ``guard_inflight`` (the only state the in-flight write, read and copy
        checks find anything in), or an idle engine whose ledger moved since the last such answer (the
        dead-table check runs only at idle). Why nothing else: docs/internals/performance.md."""
        if getattr(self, "guard_inflight", False) and self.batch_queue:
            return True
        mark = len(self._auditor.events) if self._auditor is not None else 0
        if mark == getattr(self, "_idle_mark", None) or not self.is_idle():
            return False
        self._idle_mark = mark
        return True

    def _ref_counts(self) -> np.ndarray:
        """vLLM's ``ref_cnt`` of every block, ``[num_gpu_blocks] int64``."""
        return np.fromiter(map(_REF_CNT, self.pool.blocks), dtype=np.int64, count=len(self.pool.blocks))

    def users_of(self, pool: str, units) -> list[str]:
        """The owners of :meth:`roots` that list any of ``units``, the tables read as they are (every holder
        built as an array costs ten times more; the ledger asks at every free of a last reference)."""
        want = set(units.tolist())
        out = {f"req:{rid}" for mgr in self.groups for rid in self.requests  # (the keys of known())
               if not want.isdisjoint(map(_BLOCK_ID, mgr.req_to_blocks.get(rid, ())))}
        others = [h for g, mgr in enumerate(self.groups) for h in self._cow_holders(g, mgr)] + self._other_holders()
        return sorted(out | {o for o, _, ids in others if want.intersection(ids.tolist())})

    def _mark(self) -> tuple:
        return (self.steps, *((len(self._auditor.events), self._auditor.op_index) if self._auditor else ()))

    def roots(self, aborting: bool = True) -> list[Root]:
        holders, refs = self._holders(self.known())
        mark = self._mark()
        self._reads.keep("refs", mark, refs)
        if mark != self._looks[0]:  # (kept for _dropped_with: who held what at the look before, what took since)
            self._looks = (mark, holders, self._looks[1])
            del self._placed[:self._placed_cut]
            self._placed_cut = len(self._placed)
        out = []
        for owner, where, units in holders:
            shared = refs[units] > 1
            out.append(Root(POOL, owner, units[~shared], where=where))
            if shared.any():
                out.append(Root(POOL, owner, units[shared], private=False, where=where))
        return out

    def identity_terms(self, pool: str) -> tuple[str, ...]:
        return ("available", "referenced")  # vLLM: cached-but-free blocks are free

    def accounting(self) -> dict[str, Accounting]:
        bs = self.config.block_size
        return {POOL: Accounting(available=self.pool.get_num_free_blocks() * bs, evictable=0, protected=0,
                                 session_held=0, total=(self.config.num_gpu_blocks - 1) * bs)}

    def _free_queue(self) -> tuple[list[int], str]:
        """The free queue's block ids, head to tail, and what is wrong with its links (``""``: nothing).
        Bounded by the pool size: a cycle or a broken back-link stops the walk."""
        q = self.pool.free_block_queue
        head, tail = q.fake_free_list_head, q.fake_free_list_tail
        ids, prev, cur = [], head, head.next_free_block
        for _ in range(len(self.pool.blocks) + 1):
            if cur is None:
                return ids, f"the free list breaks after {len(ids)} block(s) (a next link is None)"
            if cur is tail:
                return ids, "" if tail.prev_free_block is prev else "the tail's back link is wrong"
            if cur.prev_free_block is not prev:
                return ids, f"block {cur.block_id}'s back link does not point at its predecessor"
            ids.append(cur.block_id)
            prev, cur = cur, cur.next_free_block
        return ids, "the free list has a cycle"

    def free_lists(self) -> dict[str, np.ndarray]:
        ids, _ = self._reads.keep("queue", self._mark(), self._free_queue())
        return {POOL: np.array(ids, dtype=np.int64)}

    # -- invariants --------------------------------------------------------------------------------
    def invariant_findings(self) -> list[TargetFinding]:
        counts = self._reads.keep("counts", self._mark(), self._ref_counts())
        known = self.known()
        out: list[TargetFinding] = list(getattr(self, "queued_twice", [])[:1])
        add = _adder(out)
        self._check_ref_counts(counts, self._reads.take("refs", self._mark(), lambda: self._holders(known)[1]), add)
        self._check_free_queue(counts, add)
        entries = self._map_entries()
        self._check_hash_map(entries, add)
        self._check_requests(known, add)
        self._check_shadow_and_events(counts, entries, add)
        return out

    def crash_cause(self) -> TargetFinding | None:
        """The free-queue and ref-count checks on the state a crash left: the first finding that names a
        free (``free_sites``), or None (none does, or the state cannot be read)."""
        out: list[TargetFinding] = []
        add = _adder(out)
        try:
            counts = self._ref_counts()
            self._check_free_queue(counts, add)
            self._check_ref_counts(counts, self._holders(self.known())[1], add)
        except Exception:  # (the crash may have left links or tables half changed)
            return None
        return next((t for t in out if any(s >= 0 for s in t.free_sites)), None)

    def _check_ref_counts(self, counts, refs, add) -> None:
        """``counts`` (each block's ``ref_cnt``, :meth:`_ref_counts`) equal ``refs`` (its references from roots,
        :meth:`_holders`); each finding through ``add(kind, units, message, check, free_sites)``. Counts at 0
        with holders are the use-after-free oracle's when the pool's own calls freed the block (the ledger has
        it free); counts with no holder at all are the leak oracle's."""
        n = self.config.num_gpu_blocks
        if (counts[1:] == refs[1:]).all():  # the usual answer: no count off its holders' (refs are never < 0)
            return
        over = ((counts > refs) & (refs > 0))[1:].nonzero()[0] + 1  # (the null block left out)
        if over.size:
            self._settle_tables()  # (where each table's request sat, as lost_by reads it)
            lost = np.array(self._dropped_with(over, counts, refs), dtype=object)
            for where in sorted(set(lost.tolist())):  # one finding per place a table was dropped from, then the rest
                mine = over[lost == where]
                b = int(mine[0])
                add("leak", mine, f"block {b} has ref_cnt={counts[b]} but {refs[b]} holder(s): a reference was "
                                  "taken and never dropped" + (where and f" (a block table no request holds lists "
                                  f"it, dropped {where} with its references)"), "" if where else "ref_cnt",
                    lost_by=where)
        ledgered = self._auditor.ledgers[POOL].allocated if self._auditor is not None else np.zeros(n, dtype=bool)
        under = ((counts < refs) & ((counts > 0) | ledgered))[1:].nonzero()[0] + 1  # at 0 behind the ledger's back too
        if under.size:
            b = int(under[0])
            sites = self.free_sites(b)
            add("double-free", under, f"block {b} has ref_cnt={counts[b]} but {refs[b]} holder(s): a reference "
                                      "was dropped twice", "ref_cnt", sites)
        if (counts[1:] < 0).any():
            bad = (counts < 0).nonzero()[0]
            add("double-free", bad, f"block {int(bad[0])} has ref_cnt={counts[bad[0]]}", "ref_cnt")

    def _dropped_with(self, over: np.ndarray, counts: np.ndarray, refs: np.ndarray) -> list[str]:
        """Per block of ``over`` (``[n] int64``, each counted above its holders' references: ``counts``, ``refs``)
        what :meth:`lost_by` says of a block of the table that took the reference no holder accounts for
        (``from:<where>``), ``""`` when no table is known: a recorded table (:meth:`_wrap_tables`) that lists the
        block and that no request the scheduler knows holds, whose own blocks (those it took last since their
        allocation) each still carry a reference no holder accounts for; else a request the look before this
        one (:meth:`roots`) saw hold the block, gone since, each of whose blocks then still carries one (its
        place then, as the core names an owner dropped since the previous check: its blocks may all have been
        taken by another request since, a prefix hit); else a table settled since that look (``_placed``), no
        request holds it and each of its blocks still carries one (its place after the call that gave it blocks:
        a request admitted and finished between two looks whose every block another request took by a prefix
        hit, so none of them names it as its latest table). Either way the table went whole with its references, as
        the leak oracle's ``from:`` leak of a block only it held (a table released through the pool dropped
        them; a reference taken outside any table is none's). The caller settles the tables first
        (:meth:`_settle_tables`)."""
        tables = self.block_tables
        if tables is None or self._auditor is None:
            return [""] * over.size
        held = {id(mgr.req_to_blocks.get(rid)) for mgr in self.groups for rid in self.requests}
        took: dict[int, list[int]] = {}  # id(table) -> the blocks it took last, since their allocation
        fresh = (self.block_table_at > self._auditor.ledgers[POOL].last_alloc).nonzero()[0]
        for c in fresh.tolist():
            if tables[c] is not None and id(tables[c]) not in held:
                took.setdefault(id(tables[c]), []).append(c)
        dropped = []
        for cs in took.values():
            if all(counts[c] > refs[c] for c in cs):
                dropped.append((set(block_ids(tables[cs[0]])), _dropped_from(self.block_where[cs[0]])))
        gone: dict[str, tuple[str, list]] = {}  # a holder the look before saw, no request now: (where, its blocks)
        for owner, where, ids in self._looks[2]:
            if owner.startswith("req:") and owner[4:] not in self.requests:
                gone.setdefault(owner, (where, []))[1].extend(ids.tolist())
        dropped += [(set(ids), _dropped_from(where)) for where, ids in gone.values()
                    if all(counts[c] > refs[c] for c in ids)]
        named = set()  # a table recorded since the look before, none of its blocks' latest any more (a prefix hit)
        for table, where in self._placed:
            if id(table) not in held and id(table) not in named:
                named.add(id(table))
                ids = block_ids(table)
                if ids and all(counts[c] > refs[c] for c in ids):
                    dropped.append((set(ids), _dropped_from(where)))
        return [next((w for ids, w in dropped if b in ids), "") for b in over.tolist()]

    def _check_free_queue(self, counts, add) -> None:
        """``free_block_queue`` is well formed, holds exactly the blocks at count 0 (``counts``), never the null
        block; each finding (through ``add``) names the last frees of its block (a free is where a block joins
        the queue)."""
        n = self.config.num_gpu_blocks
        queued, problem = self._reads.take("queue", self._mark(), self._free_queue)
        if problem:
            add("accounting-drift", queued[-1:] or [0], f"free_block_queue: {problem}", "free-queue",
                self.free_sites(queued[-1]) if queued else ())
        q = np.array(queued, dtype=np.int64)
        if q.size != self.pool.get_num_free_blocks():
            add("accounting-drift", q[:1], f"free_block_queue holds {q.size} block(s) but num_free_blocks="
                                           f"{self.pool.get_num_free_blocks()}", "free-queue")
        on_queue = np.zeros(n, dtype=bool)
        on_queue[q] = True
        null = self.pool.null_block.block_id
        wrong = (on_queue != (counts == 0)).nonzero()[0]
        wrong = wrong[wrong != null]
        if wrong.size:
            b = int(wrong[0])
            add("accounting-drift", wrong, f"block {b} has ref_cnt={counts[b]} but is "
                                           f"{'on' if on_queue[b] else 'off'} the free queue", "free-queue",
                self.free_sites(b))
        if on_queue[null] or self.pool.null_block.block_hash is not None:
            add("accounting-drift", [max(null, 1)], "the null block is on the free queue or hashed", "null-block")

    def _check_hash_map(self, entries, add) -> None:
        """The prefix-cache map (``entries``, :meth:`_map_entries`) and the blocks' hashes agree both ways."""
        null = self.pool.null_block.block_id
        seen = {(key, b.block_id) for key, b in entries}  # all of them first: a block found missing is missing
        for key, b in entries:
            if b.block_id == null:
                add("accounting-drift", [1], "the null block is in the prefix-cache map", "null-block")
            elif b.block_hash != key and key not in self._extra_hashes(b.block_id):
                add("accounting-drift", [b.block_id], f"the prefix-cache map holds block {b.block_id} under a hash "
                                                      "the block does not carry", "hash-map")
                break
        # each block's own hash, then its other ones (a hashed null block is the null-block check's finding,
        # said once); the first block in the pool's order that carries one the map does not hold
        blocks = self.pool.blocks
        extra = getattr(self.pool, "cached_block_hashes_by_block", {})
        bad = {b.block_id for b, h in zip(blocks, map(_BLOCK_HASH, blocks)) if h is not None
               and (h, b.block_id) not in seen and not b.is_null}
        bad.update(i for i, keys in extra.items() if any(k is not None and (k, i) not in seen for k in keys))
        b = next((b for b in blocks if b.block_id in bad and not b.is_null), None) if bad else None
        if b is not None:
            add("accounting-drift", [b.block_id], f"block {b.block_id} carries a hash the prefix-cache map does "
                                                  "not hold", "hash-map")

    def _check_requests(self, known, add) -> None:
        """Each live request's (``known``) cached blocks carry its own hash chain, its ``num_computed_tokens``
        is within its blocks; no empty table of a request the scheduler no longer knows."""
        hbs = self.config.hash_block_size
        for rid, (req, _) in known.items():
            for g, mgr in enumerate(self.groups):
                blocks = mgr.req_to_blocks.get(rid, ())
                ncached = mgr.num_cached_block.get(rid, 0)
                for i in range(min(ncached, len(blocks))):
                    b, end = blocks[i], (i + 1) * mgr.block_size  # its hash: the request's at its last hash unit
                    n = getattr(b, "block_hash_num_tokens", None)  # fewer tokens: a partial block (vLLM 0.26.0 on)
                    unit = (n if n and end - mgr.block_size < n <= end else end) // hbs - 1
                    if b.is_null or b.block_hash is None or unit >= len(req.block_hashes):
                        continue
                    if self.V.kv_cache_utils.get_block_hash(b.block_hash) != req.block_hashes[unit]:
                        add("stale-kv", [b.block_id], f"req:{rid}'s cached block {i} (block {b.block_id}, group {g}) "
                                                      "carries another prefix's hash", "hash-chain")
                        break
            blocks = self.groups[0].req_to_blocks.get(rid, ())
            if blocks and req.num_computed_tokens > len(blocks) * self.config.block_size:
                add("accounting-drift", block_ids(blocks[-1:]) or [1],
                    f"req:{rid} num_computed_tokens={req.num_computed_tokens} points past its {len(blocks)} "
                    "block(s)", "num_computed_tokens")
        # orphan tables: a table of a request the scheduler no longer knows (its blocks are the leak
        # oracle's; an empty one is a dangling entry)
        for mgr in self.groups:
            for rid, blocks in mgr.req_to_blocks.items():
                if rid not in known and not block_ids(blocks):
                    add("leak", [1], f"an empty block table for req:{rid}, which the scheduler no longer knows",
                        "orphan-table")
                    break

    def _check_shadow_and_events(self, counts, entries, add) -> None:
        """No change outside the pool's API (the ledger's counts are ``counts``), and vLLM's KV events replayed
        equal the map (``entries``)."""
        if self._auditor is not None:
            led = self._auditor.ledgers[POOL].refs
            drift = (led[1:] != np.maximum(counts[1:], 0)).nonzero()[0] + 1
            if drift.size:
                b = int(drift[0])
                add("accounting-drift", drift, f"block {b}: ref_cnt={counts[b]} but the pool's own calls account for "
                                               f"{led[b]} (changed outside BlockPool's API)", "ref-shadow")
        replayed, named = self._replayed(), self._event_keys
        u, grouped = self.V.kv_cache_utils, self.V.has("kv-event-group")
        keys = [key for key, _ in entries]
        for key in set(keys).difference(named):  # (converted once per key, the new ones found in C: vLLM's
            named[key] = (u.maybe_convert_block_hash(u.get_block_hash(key)),  # conversion reads an env var a call)
                          u.get_group_id(key) if grouped else None)
        real = Counter(map(named.__getitem__, keys))
        # (neither holds a zero count: equal as dicts is equal as Counters, and a dict compares in C)
        if not dict.__eq__(real, replayed) and real != replayed:
            diff = (real - replayed) or (replayed - real)
            add("accounting-drift", [1], f"vLLM's KV-cache events replayed give a prefix-cache map of "
                                         f"{sum(replayed.values())} entries, the real map has "
                                         f"{sum(real.values())} ({len(diff)} differ)", "kv-events")

    def engine_check(self) -> list[str]:
        """vLLM has no checker; its own arithmetic (``reset_prefix_cache``'s "all freed" test): free blocks
        plus blocks in use plus the null block make the pool, and no ``ref_cnt`` is negative. The null
        block's own count is left out: vLLM never reads it, and some releases' ``free_blocks`` decrement it
        below zero."""
        counts = self._reads.take("counts", self._mark(), self._ref_counts)[1:]
        free = self.pool.get_num_free_blocks()
        used = int(np.count_nonzero(counts > 0))
        if (counts < 0).any() or free + used + 1 != self.config.num_gpu_blocks:
            return [f"[{POOL}] free={free} + used={used} + 1 null != {self.config.num_gpu_blocks}"
                    + (" (a negative ref_cnt)" if (counts < 0).any() else "")]
        return []
