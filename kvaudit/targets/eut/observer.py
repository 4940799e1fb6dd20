"""The observing half of the built-in engine's target: what kvaudit reads from ``engine_under_test``
(roots, accounting, locks, recounts) and the wrappers it installs on it (KV shadow, lock ledger,
tree insert check). :class:`kvaudit.targets.eut.target.EutTarget` adds the driving half.

Roots are read from the scheduler's own structures, the way SGLang's invariant checker finds
owners (``_requests_owning_rows``): live requests in the running batch, the last batch, the
waiting queue and the PD transfer queue; the radix tree's nodes; and, for HiSparse, the buffer
and host slots of *live* requests' rows. State the coordinator still keeps for a row that no
live request holds is, by construction, unreachable.
"""

from __future__ import annotations

import os
import sys
from functools import partial
from itertools import compress, repeat
from operator import and_, attrgetter, is_not, or_, truth

import numpy as np
import torch

from kvaudit.audit.hooks import pass_through
from kvaudit.targets.eut.deltas import EutDeltas
from kvaudit.targets.eut.evictions import Evictions
from kvaudit.targets.eut.tenants import Tenants
from kvaudit.targets.eut.tree_edits import TreeEdits
from kvaudit.targets.base import (Accounting, IdleRoots, LockImbalance, Recount, Root, Target, records_roots,
                                  slot_pages, wrap_insert)


#: the tree recount counts tree edits (TreeEdits) from a walk of this many nodes; a smaller tree walks at
#: every check
RECOUNT_EDITS_FROM = 256
#: Target.checking() reads the live requests once from this many requests running or waiting
OWNERS_ONCE_FROM = 64
# (a tree node's fields, read at every check over every node by map() in C, not by a Python loop)
_KEY, _VALUE, _LOCK_REF, _HOST_VALUE, _HOST_REF = map(attrgetter, ("key", "value", "lock_ref", "host_value", "host_ref"))
_HELD = partial(is_not, None)  # _HELD(x): x is not None


@pass_through  # (between engine frames: a release's stack goes on to the intake that took the abort)
def _taking_abort(handle, taken: list[int], outs: list, rid, abort_all) -> None:
    """The engine's ``handle_abort`` in an audited run (bound by ``partial``): first appends to ``taken`` how many
    outputs the engine had emitted when it took the abort. The k-th abort taken is the k-th the client sent
    (``abort_named``), so :meth:`EutTarget.progress` tells, at idle, the requests it named that were still
    unanswered then (one finished by a message taken ahead of the abort is not hit)."""
    taken.append(len(outs))
    return handle(rid, abort_all)


class EutObserver(Target):
    """Reads ``self.engine`` (a ``Scheduler``), ``self.config`` and the driving half's request
    records (``submitted``, ``aborted``, ``sessions``, ``_pools``); mutates nothing of the engine
    except through the wrappers its ``install_*`` methods add."""

    lock_holders_exact = True  # lock_holders() reads every lock receipt the engine keeps
    evictions: Evictions | None = None  # the token pool's tree evictions (freed_by), once installed
    released_by: dict[str, str] | None = None  # rid -> the path of its last release (dropped_by), once installed
    tenants: Tenants | None = None  # how far each row's tenant wrote it (units_of_tenants), once installed

    # -- KV content (shadow tags) ------------------------------------------------------------
    def kv_pools(self) -> dict[str, int]:
        """Every pool whose slots hold KV content, with its size in token slots."""
        return {spec.name: (spec.num_units + 1) * spec.page_size for spec in self._pools if spec.kind == "kv"}

    def install_shadow(self, shadow, wrap, report) -> None:
        """Report the engine's KV writes, copies and reads to ``shadow`` (:class:`kvaudit.audit.shadow.ShadowKV`)
        by wrapping, with ``wrap(obj, name, fn)``, the functions that move KV: the forward, the PD
        transfer, and the HiSparse/HiCache device<->host copies. A read whose tags do not match the
        reader's prefix calls ``report(pool, slots, message)``. A transfer's and the tiers'
        copies: :meth:`_shadow_copies`."""
        eng = self.engine
        hs = eng.hisparse_coordinator
        table = eng.req_to_token_pool.req_to_token
        main = "token_to_kv_pool"
        kv_pool = "hisparse_device" if hs is not None else main  # where the forward writes
        forward = eng._forward
        rows = table.numpy() if table.device.type == "cpu" else None  # a view: no copy per read
        main_tags = shadow.tags[main]
        run_batch, request_tags = eng.run_batch, shadow.request_tags

        def check_read(req, pool: str, idx: np.ndarray, want: np.ndarray, pos: np.ndarray | None = None) -> None:
            """``req`` reads slots ``idx`` for positions ``pos`` (default ``0..n-1``) with prefix tags ``want``."""
            hit = shadow.read(pool, idx, want)
            if hit is not None:
                bad, what = hit
                at = bad if pos is None else pos[bad]
                report(pool, idx[bad], f"req:{req.rid} read KV of positions {_ranges(at)} from slots {what}", want[bad])

        def forward_wrapper(req, start, end, write_loc):
            """HiSparse (a per-request physical context) or a KV table on the GPU: one forward at a time."""
            tags = request_tags(req, req.origin_input_ids, req.output_ids, req.future_ids)
            if start and hs is None:
                check_read(req, main, shadow._idx(table[req.kv.req_pool_idx, :start]), tags[:start])
            elif start:
                if req.hisparse_admitted:
                    slots, pos = hs.physical_context(req)
                else:
                    slots, pos = hs.prefill_context(req.kv.req_pool_idx, end)
                keep = pos < start
                pos = shadow._idx(pos[keep])
                check_read(req, "hisparse_device", shadow._idx(slots[keep]), tags[pos], pos)
            out = forward(req, start, end, write_loc)
            shadow.write(kv_pool, write_loc, tags[start:end])
            return out

        def batch_wrapper(batch):
            """The common case (no HiSparse, KV on the CPU) checked a batch at a time: every row's
            reads before the forward, its writes after."""
            mode = batch.forward_mode
            if mode == "decode":
                # NOTE: most rows of a run: one token each, its slot out_cache_loc's entry of the row (and a
                # row marked to_finish computes nothing: None)
                written = []
                for req in batch.reqs:
                    kv = req.kv
                    start = kv.kv_committed_len - 1
                    tags = request_tags(req, req.origin_input_ids, req.output_ids, req.future_ids)
                    if req.to_finish is not None:
                        written.append(None)
                        continue
                    if start:
                        idx = rows[kv.req_pool_idx, :start]
                        if main_tags.take(idx).tobytes() != tags[:start].tobytes():  # shadow.read's fast path
                            check_read(req, main, idx, tags[:start])
                    written.append(tags[start])
                out = run_batch(batch)
                for slot, tag in zip(batch.out_cache_loc.tolist(), written):
                    if tag is not None:
                        main_tags[slot] = tag
                return out
            if mode == "prebuilt":
                return run_batch(batch)
            spans = []
            extend = mode == "extend"
            for req in batch.reqs:
                prefill_row = extend and id(req) not in batch.decode_ids
                if prefill_row:
                    start, end = req.prefix_len, req.extend_end
                else:
                    end = req.kv.kv_committed_len
                    start = end - 1
                tags = request_tags(req, req.origin_input_ids, req.output_ids, req.future_ids)
                computed = prefill_row or req.to_finish is None  # an aborting decode row computes nothing
                spans.append((req, start, end, tags, computed))
                if start and computed:
                    idx, want = rows[req.kv.req_pool_idx, :start], tags[:start]
                    if main_tags.take(idx).tobytes() != want.tobytes():  # shadow.read's fast path, inlined
                        check_read(req, main, idx, want)
            out = run_batch(batch)
            # tolist, not numpy(): a numpy view of each batch's fresh tensor costs more than the list
            loc, off = batch.out_cache_loc.tolist(), 0
            for req, start, end, tags, computed in spans:
                if computed:  # (see Scheduler.run_batch)
                    if end - start == 1:
                        main_tags[loc[off]] = tags[start]
                    else:
                        main_tags[loc[off : off + end - start]] = tags[start:end]
                off += end - start
            return out

        if hs is None and rows is not None:
            wrap(eng, "run_batch", batch_wrapper)
        else:
            wrap(eng, "_forward", forward_wrapper)
        self._shadow_copies(shadow, wrap)

    def _shadow_copies(self, shadow, wrap) -> None:
        """The KV that lands without a forward, for :meth:`install_shadow`: a PD transfer's
        (``_commit_transfer_to_req``), HiSparse's device<->host ``backup``/``_load`` and HiCache's
        ``_copy`` between the device pool and the host pool (both directions)."""
        eng, main = self.engine, "token_to_kv_pool"
        hs, tree = eng.hisparse_coordinator, eng.tree_cache
        table, transfer = eng.req_to_token_pool.req_to_token, eng._commit_transfer_to_req
        request_tags = shadow.request_tags

        def transfer_wrapper(req):
            n, p = req.kv.kv_committed_len, req.kv.cache_protected_len  # KV of [p, n) lands now; [0, p) is the tree's
            tags = request_tags(req, req.origin_input_ids, req.output_ids)[:n]
            if hs is not None:
                shadow.write("hisparse_host", hs.req_to_host_pool[req.kv.req_pool_idx][:n], tags)
            else:
                shadow.write(main, table[req.kv.req_pool_idx, p:n], tags[p:])
            return transfer(req)

        wrap(eng, "_commit_transfer_to_req", transfer_wrapper)
        if hs is not None:
            backup, load = hs.backup, hs._load
            wrap(hs, "backup", lambda dev, host: (shadow.copy("hisparse_host", host, "hisparse_device", dev),
                                                  backup(dev, host))[1])
            wrap(hs, "_load", lambda dev, host: (shadow.copy("hisparse_device", dev, "hisparse_host", host),
                                                 load(dev, host))[1])
        if eng.hicache_host_pool is not None:
            tree_copy = tree._copy

            def hicache_copy(dst, dst_idx, src, src_idx):
                if dst is tree.host_pool:
                    shadow.copy("hicache_host", dst_idx, main, src_idx)
                else:
                    shadow.copy(main, dst_idx, "hicache_host", src_idx)
                return tree_copy(dst, dst_idx, src, src_idx)

            wrap(tree, "_copy", hicache_copy)

    # -- observing --------------------------------------------------------------------------
    owner_hint_vars = ("req",)  # only frames of functions with such a local are inspected
    owner_stop_vars = ("reqs", "batch")  # a function over a whole batch: ``req`` is a loop variable
    # every finish, abort, transfer failure and retraction releases through these: a free's path is
    # their caller (process_batch_result, handle_abort, release_req, ...)
    release_entries = ("release_kv_cache@scheduler.py", "_release_finished@scheduler_release_mixin.py")
    # a request's row and prefill slots (alloc_for_extend) and its decode slots (update_running_batch, the
    # engine's alloc_for_decode): one role in a signature. The PD pre-allocation (_pre_alloc), a load-back
    # (load_back) and HiSparse's buffers and host slots keep their function
    request_kv_allocs = ("alloc_for_extend@scheduler.py", "update_running_batch@scheduler.py")

    @staticmethod
    def owner_hint(frame_locals: dict) -> str | None:
        """Name the request an allocating engine frame works for (its local ``req``), or None."""
        rid = getattr(frame_locals.get("req"), "rid", None)
        return f"req:{rid}" if isinstance(rid, str) else None

    def roots(self, aborting: bool = True) -> list[Root]:
        """Every reference into the pools. ``aborting=False`` leaves out requests already marked to
        finish with an abort (their in-flight result is about to release them)."""
        eng, ps = self.engine, self.config.page_size
        out: list[Root] = []
        hs = eng.hisparse_coordinator

        def pages(slots: torch.Tensor) -> np.ndarray:
            return slot_pages(slots, ps)

        sc = eng.session_controller
        slots = [] if sc is None else sc.slots()
        # (kv, owner, role, where) of every record, read from req_to_token in one gather (records_roots)
        records = [(slot.kv, f"session:{sid}", "session", "session") for sid, slot in slots]
        if sc is not None:
            units = [(sid, self.session_records.unit_of.get(id(s.slot))) for sid, s in sc.sessions.items()]
            out += [Root("session_records", f"session:{sid}", np.array([u], dtype=np.int64), role="session")
                    for sid, u in units if u is not None]
        held = {id(slot.kv) for _, slot in slots}
        reqs = self._owners()
        places = self._places() if reqs else {}
        for req in reqs:
            if not aborting and req.to_finish is not None:
                continue
            kv, owner = req.kv, f"req:{req.rid}"
            if id(kv) not in held:  # a turn on its session's record: the session root covers it
                records.append((kv, owner, "req", places.get(id(req), "")))
            if hs is not None:
                row = kv.req_pool_idx
                for pool, held_slots in (("hisparse_device", hs.req_to_device_buffer.get(row)),
                                         ("hisparse_device", hs.req_prefill_physical.get(row)),
                                         ("hisparse_host", hs.req_to_host_pool.get(row))):
                    if held_slots is not None:
                        out.append(Root(pool, owner, pages(held_slots)))
        out += records_roots(eng.req_to_token_pool.req_to_token, records, ps)
        nodes = self._tree_nodes()
        values = list(filter(_HELD, map(_VALUE, nodes)))
        if values:
            out.append(Root("token_to_kv_pool", "tree", pages(torch.cat(values)), role="tree"))
        host = list(filter(_HELD, map(_HOST_VALUE, nodes))) if eng.hicache_host_pool is not None else ()
        if host:
            out.append(Root("hicache_host", "tree", pages(torch.cat(host)), role="tree"))
        return out

    def idle_roots(self) -> IdleRoots | None:
        """:meth:`roots` when no structure holds a request (those ``requests_owning_rows()`` reads) and
        there is no session controller or HiCache host tier (whose records, write-throughs and load-backs
        hold units and locks at idle): the tree's nodes alone, with ``locked`` set when a node's
        ``lock_ref`` is not 0 (with no holder left, what :meth:`lock_balance` names). None otherwise."""
        eng = self.engine
        # (the structures requests_owning_rows() reads: a request in any of them, holding KV or not, leaves it
        # to the full check)
        if (eng.session_controller is not None or eng.hicache_host_pool is not None or eng.last_batch is not None
                or any(eng.live_request_groups())):
            return None
        if self._in_check:  # (no request anywhere: the check's other readers of _owners() need not ask the engine)
            self._owners_memo = []
        nodes = self._tree_nodes()
        values = list(filter(_HELD, map(_VALUE, nodes)))
        units = {"token_to_kv_pool": slot_pages(torch.cat(values), self.config.page_size)} if values else {}
        return IdleRoots("tree", units, not eng.tree_cache.disable and any(map(_LOCK_REF, nodes)))

    def ownership_deltas(self, exact: bool = True):
        """How the roots changed since the previous call (:class:`kvaudit.targets.eut.deltas.EutDeltas`);
        None for a configuration it does not cover (pages over one token, HiSparse, a table off the CPU).
        ``exact=False``: ``req_to_token`` compared only on the rows whose records' protected prefix moved
        or whose allocation shrank (see EutDeltas)."""
        kept = self.__dict__.get("_ownership")
        if kept is None:
            kept = self._ownership = EutDeltas(self)
        return kept.deltas(exact)

    def checking(self):
        """Within one check the engine's ``requests_owning_rows()`` is read once for the observer's own
        readers (the roots, the metrics, the lock holders: :meth:`_owners`). With :data:`OWNERS_ONCE_FROM`
        requests or more running or waiting, every caller (the deltas, the engine's own ``check_memory`` too)
        gets a copy of that read (:class:`_OwnersOnce`; below, the walk is cheaper than shadowing the engine's
        method). The engine is not stepped inside a check, so the list is the same one."""
        eng = self.engine
        return _CheckScope(self, eng if len(eng.running_batch) + len(eng.waiting_queue) >= OWNERS_ONCE_FROM else None)

    _in_check = False  # inside a check (_CheckScope)
    _nodes_memo: list | None = None  # inside a check: the tree's nodes, walked once
    _owners_memo: list | None = None  # inside a check: the live requests, read once

    def _owners(self) -> list:
        """The engine's ``requests_owning_rows()``. Inside a check (:meth:`checking`) the observer's readers
        (the roots, the metrics, the lock holders) share one read: the engine does not move within a check
        (its own ``check_memory`` reads them itself: shadowed only from :data:`OWNERS_ONCE_FROM`)."""
        memo = self._owners_memo
        if memo is None:
            memo = self.engine.requests_owning_rows()
            if self._in_check:
                self._owners_memo = memo
        return memo

    def _tree_nodes(self) -> list:
        """The radix tree's nodes, parents before children (``RadixCache.nodes()``). Inside a check
        (:meth:`checking`) the first caller walks the tree and the others (the roots, the recount, the
        lock balance) get the same list: the engine does not move within a check."""
        memo = self._nodes_memo
        if memo is not None:
            return memo
        nodes = list(self.engine.tree_cache.nodes())
        if self._in_check:
            self._nodes_memo = nodes
        return nodes

    def _places(self) -> dict[int, str]:
        """``id(req)`` -> the scheduler structure that holds it (``Root.where``); the most specific one
        wins (a chunked request is in the last batch too, a decoding one in the running batch)."""
        eng = self.engine
        hs = eng.hisparse_coordinator
        groups = (("last_batch", eng.last_batch.reqs if eng.last_batch else ()), ("running", eng.running_batch),
                  ("waiting", eng.waiting_queue), ("transfer", eng.disagg_transfer_queue),
                  ("staging", hs.staging_reqs() if hs is not None else ()),
                  ("chunked", (eng.chunked_req,) if eng.chunked_req else ()))
        out: dict[int, str] = {}
        # NOTE: least specific first, each group overwriting; a big group in one C-level update (this runs
        # at every check, over every live request), a small one in a loop (cheaper than the zip's objects)
        for name, group in groups:
            if len(group) > 16:
                out.update(zip(map(id, group), repeat(name)))
            else:
                for r in group:
                    out[id(r)] = name
        return out

    def lock_holders(self) -> list[tuple[str, str, int]]:
        """Every live lock receipt as ``(lock, holder, node id)``: requests' ``req.lock`` and session
        slots' ``slot.lock`` (device), HiCache write-throughs until their ack (device), and load-backs
        (device lock and host pin on the same node) until released, named by the request that started
        them, also once an abort left them to be released at their ack (``orphan_load_backs``)."""
        return [(lock, name, node.id) for lock, name, node in self._holders()]

    def _holders(self) -> list[tuple[str, str, object]]:
        """:meth:`lock_holders` with the tree nodes themselves."""
        eng = self.engine
        tree = eng.tree_cache
        if tree.disable:
            return []
        out = [("device", f"req:{r.rid}", r.lock) for r in self._owners() if r.lock is not None]
        if eng.session_controller is not None:
            out += [("device", f"session:{sid}", slot.lock) for sid, slot in eng.session_controller.slots()
                    if slot.lock is not None]
        if eng.hicache_host_pool is not None:
            out += [("device", f"hicache write-through of node {node.id}", node)
                    for node, _ in tree.ongoing_write_through.values()]
            names = self._load_back_names
            for r in eng.waiting_queue:
                if r.load_back is not None and id(r.load_back) not in names:
                    names[id(r.load_back)] = (r.load_back, f"hicache load-back for req:{r.rid}")
            recs = [r.load_back for r in eng.waiting_queue if r.load_back is not None] + list(eng.orphan_load_backs)
            for rec in recs:
                name = names.get(id(rec), (None, f"hicache load-back of node {rec.node.id}"))[1]
                out += [("device", name, rec.node), ("host", name, rec.node)]
            if names:
                live = {id(rec) for rec in tree.ongoing_load_back.values()}
                for key in [k for k in names if k not in live]:
                    del names[key]
        return out

    def lock_balance(self) -> list[LockImbalance]:
        """Tree nodes whose ``lock_ref`` (device) or ``host_ref`` (HiCache host pins) differs from the
        live holders whose path covers them (SGLang invariant: ``lock_ref`` equals the number of live
        receipts whose anchor path covers the node). Holders: :meth:`lock_holders`. The device entries
        name ``token_to_kv_pool`` slots, the host ones ``hicache_host`` slots (a host pin covers the
        pinned node and its ancestors, as ``HiRadixCache._pin_host`` walks them)."""
        tree = self.engine.tree_cache
        if tree.disable:
            return []
        want: dict[tuple[str, int], int] = {}
        for lock, _, node in self._holders():
            while node is not None and node is not tree.root_node:
                want[lock, id(node)] = want.get((lock, id(node)), 0) + 1
                node = node.parent
        host = self.engine.hicache_host_pool is not None
        out = []
        for n in self._tree_nodes():
            if n.lock_ref != want.get(("device", id(n)), 0):
                out.append(LockImbalance(f"node {n.id} ({len(n.key)} tokens)",
                                         (n.value if n.value is not None else n.host_value).cpu().numpy(), n.lock_ref,
                                         want.get(("device", id(n)), 0), {n.id} | {d.id for d in tree.nodes(n)}))
            if host and n.host_ref != want.get(("host", id(n)), 0):
                slots = n.host_value if n.host_value is not None else torch.zeros(1, dtype=torch.int64)
                out.append(LockImbalance(f"host pin on node {n.id} ({len(n.key)} tokens)", slots.cpu().numpy(),
                                         n.host_ref, want.get(("host", id(n)), 0),
                                         {n.id} | {d.id for d in tree.nodes(n)}, "host", "hicache_host"))
        return out

    def install_pool(self, spec, auditor, wrap) -> None:
        """The standard wrappers; for the token pool, the tree's evictions are recorded too (:meth:`freed_by`),
        and for the row pool each request's last release (:meth:`dropped_by`) and how far each row's tenant
        wrote it (:meth:`units_of_tenants`), but in a search's lean run: what it finds is reported by its
        per-step replay, which records them."""
        super().install_pool(spec, auditor, wrap)
        tree = self.engine.tree_cache
        if spec.name == "token_to_kv_pool" and not tree.disable and not auditor.lean:
            self.evictions = Evictions(auditor, spec.name, spec.page_size)
            self.evictions.install(tree, wrap)
        if spec.name == "req_to_token_pool":
            self.released_by = None if auditor.lean else self._record_releases(wrap)
            # (lean too: what it records is a finding's detection; one append per abort taken, nothing per step)
            self.abort_taken = taken = []
            wrap(self.engine, "handle_abort", partial(_taking_abort, self.engine.handle_abort, taken,
                                                      self.engine.finished_outputs))
            self.tenants = None if auditor.lean else Tenants(auditor, spec.name)
            if self.tenants is not None:
                self.tenants.install(self.engine, wrap)

    #: the plumbing between a request's release and the path that chose it: the release entries and a
    #: retraction's release (retract_decode, a priority preemption and a retract pause share release_req)
    _RELEASE_PLUMBING = frozenset({"release_kv_cache", "_release_finished", "release_req"})

    def _record_releases(self, wrap) -> dict[str, str]:
        """Wrap the engine's ``release_kv_cache``, so that each request's last release is recorded by its
        path (``function@file``, the first frame above :attr:`_RELEASE_PLUMBING`), for :meth:`dropped_by`.
        A walk of a few frames per release: installed only where a run is not lean (a search's sparse run,
        whose hits its per-step replay reports). Returns the record, ``{rid: path}``."""
        eng, plumbing, record = self.engine, self._RELEASE_PLUMBING, {}
        release = eng.release_kv_cache

        @pass_through  # (between engine frames: a free's stack goes on to the path that chose the release)
        def release_wrapper(req, *args, **kwargs):
            out = release(req, *args, **kwargs)
            f = sys._getframe(1)
            while f.f_back is not None and f.f_code.co_name in plumbing:
                f = f.f_back
            record[req.rid] = f"{f.f_code.co_name}@{os.path.basename(f.f_code.co_filename)}"
            return out

        wrap(eng, "release_kv_cache", release_wrapper)
        return record

    def dropped_by(self, rid: str) -> str | None:
        """The path of ``rid``'s last release (``retract_decode@scheduler_decode_mixin.py``: a retraction;
        ``preempt_to_schedule@scheduler_prefill_mixin.py``: a priority preemption; ``process_batch_result@scheduler.py``:
        a finish), ``""`` for a request never released; None where releases are not recorded (a lean run)."""
        return None if self.released_by is None else self.released_by.get(rid, "")

    def units_of_tenants(self, rows) -> dict[str, np.ndarray] | None:
        """:meth:`units_of_rows` of the positions each row's tenant wrote (:class:`Tenants`); None where they are
        not recorded (a lean run)."""
        rows = np.asarray(rows, dtype=np.int64)
        return None if self.tenants is None else self.units_of_rows(rows, self.tenants.lengths(rows))

    def freed_by(self, pool: str, units, frees) -> list[str] | None:
        """``unlocked`` for each of ``units`` that ``frees`` freed by evicting a tree node no lock receipt
        covered (:class:`Evictions`), else ``""``; None for a pool whose evictions are not recorded."""
        rec = self.evictions
        return rec.freed_by(units, frees) if rec is not None and pool == rec.pool else None

    def freed_under_reader(self, pool: str, units, frees) -> list[bool] | None:
        """True for each of ``units`` that ``frees`` freed by evicting a tree node a lock receipt covered
        (:class:`Evictions`: the lock call's reader still read it); None for a pool whose evictions are not
        recorded."""
        rec = self.evictions
        return rec.under_lock(units, frees) if rec is not None and pool == rec.pool else None

    def install_lock_ledger(self, wrap, record) -> None:
        """Report every ``inc_lock_ref``/``dec_lock_ref`` of the tree to ``record(node_id, delta)``, and
        with HiCache every host pin (``_pin_host(node, delta)``) to ``record(node_id, delta, "host")``."""
        tree = self.engine.tree_cache
        if tree.disable:
            return
        inc, dec = tree.inc_lock_ref, tree.dec_lock_ref

        # a node of None is the engine's own bug: let the engine's call fail where it would unhooked
        def inc_wrapper(node):
            if node is not None:
                record(node.id, +1)
            return inc(node)

        def dec_wrapper(node):
            if node is not None:
                record(node.id, -1)
            return dec(node)

        wrap(tree, "inc_lock_ref", inc_wrapper)
        wrap(tree, "dec_lock_ref", dec_wrapper)
        pin = getattr(tree, "_pin_host", None)
        if pin is not None:
            def pin_wrapper(node, delta):
                if node is not None and node is not tree.root_node:
                    record(node.id, delta, "host")
                return pin(node, delta)

            wrap(tree, "_pin_host", pin_wrapper)

    def _track_retraction(self) -> None:
        """Record what each ``retract_decode`` did (``last_retraction``), read from outside the call:
        requests retracted, tokens freed, and why it stopped (SGLang ``retract_decode``'s loop ends when
        one decode step fits, at the last request, or aborts that one when even it does not fit)."""
        eng = self.engine
        retract = eng.retract_decode

        def retract_wrapper(reqs, force=False):
            before = eng.token_to_kv_pool_allocator.available_size() + eng.tree_cache.evictable_size()
            keep = retract(reqs, force=force)
            after = eng.token_to_kv_pool_allocator.available_size() + eng.tree_cache.evictable_size()
            gone = [r for r in reqs if r not in keep]
            aborted = [r for r in gone if r.finished()]
            why = ("forced by memory pressure (all but one)" if force else
                   "even the last request did not fit: aborted it" if aborted else
                   "one decode step fits" if eng._decode_fits(keep) else "only one request left")
            self.last_retraction = (f"step {self.steps}: retracted {len(gone) - len(aborted)} request(s)"
                                    + (f", aborted {len(aborted)}" if aborted else "")
                                    + f", freed {after - before} tokens (available + evictable); "
                                    f"stopped: {why}; {len(keep)} kept")
            return keep

        eng.retract_decode = retract_wrapper

    def retraction(self) -> str:
        return self.last_retraction or ""

    def install_insert_check(self, wrap, report) -> None:
        """Check every ``RadixCache.insert(key, value)``: the tree takes ``min(len(key), value.numel())``
        tokens of the request being cached (the caller's local ``req``, as in ``checkpoint_kv_cache_into_tree``),
        which must not exceed its ``kv_committed_len``; else ``report(owner, inserted, committed, slots)``
        with the slots (``[n] int64``) of the positions past ``kv_committed_len``."""
        tree = self.engine.tree_cache
        if tree.disable:
            return

        def measure(req, key, value, *a, **k):
            inserted, committed = min(len(key), int(value.numel())), req.kv.kv_committed_len
            return f"req:{req.rid}", inserted, committed, value

        wrap_insert(wrap, tree, "insert", measure, report)

    def recount(self) -> dict[str, dict[str, Recount]]:
        """The tree's terms recounted from its nodes (SGLang's definition, ``RadixCache.check_integrity``):
        ``evictable`` = tokens of device-resident nodes with ``lock_ref == 0``, ``protected`` = those with
        ``lock_ref > 0``; with HiCache, the host pool's ``protected`` = host copies of device-resident or
        pinned (``host_ref > 0``) nodes and ``evictable`` = the other host copies. One walk of the tree,
        made again only after a call that can change a node (:class:`kvaudit.targets.eut.tree_edits.TreeEdits`):
        until then the last walk's counts are the nodes' counts (the engine's counters are read fresh by
        the oracle that compares them)."""
        tree = self.engine.tree_cache
        if tree.disable:
            return {}
        edits = self.__dict__.get("_tree_edits")
        if edits is not None and edits.tree is not tree:
            edits = self._tree_edits = None
        key = None if edits is None else edits.key()
        last = self.__dict__.get("_recounted")
        if key is not None and last is not None and last[0] == key:
            return last[1]
        out, nodes = self._walk_recount(self._tree_nodes())
        if edits is None and nodes >= RECOUNT_EDITS_FROM:
            # NOTE: a small tree walks at every check: its walk costs less than the counting wrappers
            # on the tree's methods (about 6% of the audit's time on the default preset)
            edits = self._tree_edits = TreeEdits(tree)
            key = edits.key()  # (installs them: a change from here on is counted)
        self._recounted = (key, out)
        return out

    def _walk_recount(self, tree_nodes: list) -> tuple[dict[str, dict[str, Recount]], int]:
        # (the recount, the nodes walked). NOTE: runs at every check: each node's fields are read by map() and
        # the tokens summed by compress() in C, not in a Python loop over the nodes
        keys = list(map(len, map(_KEY, tree_nodes)))  # tokens per node
        device = list(map(_HELD, map(_VALUE, tree_nodes)))  # device-resident
        pr = sum(compress(keys, map(and_, device, map(truth, map(_LOCK_REF, tree_nodes)))))
        ev = sum(compress(keys, device)) - pr
        out = {"token_to_kv_pool": {"evictable": Recount(ev, "tree", "its nodes with lock_ref 0"),
                                    "protected": Recount(pr, "tree", "its nodes with lock_ref > 0")}}
        if self.engine.hicache_host_pool is not None:
            host = list(map(_HELD, map(_HOST_VALUE, tree_nodes)))  # with a host copy
            pinned = map(or_, device, map(truth, map(_HOST_REF, tree_nodes)))  # device-resident or pinned
            hpr = sum(compress(keys, map(and_, host, pinned)))
            hev = sum(compress(keys, host)) - hpr
            out["hicache_host"] = {
                "evictable": Recount(hev, "host tree", "host copies of unpinned host-only nodes"),
                "protected": Recount(hpr, "host tree", "host copies of device-resident or pinned nodes")}
        return out, len(tree_nodes)

    def _closing(self) -> list[str]:
        """Sessions the client closed that the engine still keeps (a close is deferred while a turn of
        the session runs, and completed at the intake after it ends)."""
        sc = self.engine.session_controller
        if sc is None or len(sc.sessions) <= len(self.sessions):  # (asked after every step: no set built)
            return []
        return [sid for sid in sc.sessions if sid not in self.sessions]

    def describe_busy(self) -> str:
        eng = self.engine
        closing = self._closing()
        return (f"waiting={len(eng.waiting_queue)} running={len(eng.running_batch)} "
                f"prealloc={len(eng.disagg_prealloc_queue)} transfer={len(eng.disagg_transfer_queue)} "
                f"available={eng.token_to_kv_pool_allocator.available_size()} "
                f"evictable={eng.tree_cache.evictable_size()} protected={eng.tree_cache.protected_size()}"
                + (f"; session {closing[0]} closed by the client, its close never completed" if closing else ""))

    def stuck(self) -> str:
        """The first busy structure, from the end of the pipeline back (running, chunked, HiSparse
        staging, HiCache copies, waiting, PD transfer, PD prealloc, rebootstrap), and what its head
        waits for: ``hicache:load-back`` (a load-back never acked, for a waiting request or orphaned by
        an abort: its lock may be what keeps the waiting head out) or ``hicache:write-through``;
        ``waiting:rows``, else ``waiting:memory-locked`` (tree locks hold tokens while nothing runs) or
        ``waiting:memory``; ``transfer:kv-transfer`` (not landed) or ``transfer:hisparse-buffer``;
        ``prealloc:rows`` or ``prealloc:memory``; ``session:close-deferred`` (a session the client closed
        that the idle engine still keeps: its record and KV with it)."""
        eng = self.engine
        tree = eng.tree_cache
        locked = "memory-locked" if tree.protected_size() else "memory"
        rows = eng.req_to_token_pool.available_size() == 0
        hs = eng.hisparse_coordinator
        if eng.running_batch or eng.last_batch is not None:
            return "running:decode"
        if eng.chunked_req is not None:
            return "chunked:prefill"
        if hs is not None and hs.has_ongoing_staging():
            return "staging:host-backup"
        if eng._hicache_in_flight():
            loading = any(not tree.load_back_ready(r) for r in tree.ongoing_load_back.values())
            return "hicache:" + ("load-back" if loading else "write-through")
        if eng.waiting_queue:
            return "waiting:" + ("rows" if rows else locked)
        if eng.disagg_transfer_queue:
            landed = eng.forward_ct >= eng.disagg_transfer_queue[0].transfer_ready_step
            return "transfer:" + ("hisparse-buffer" if landed else "kv-transfer")
        if eng.disagg_prealloc_queue:
            return "prealloc:" + ("rows" if rows else locked)
        if eng.held_rebootstrap_reqs:
            return "rebootstrap:paused"
        return "session:close-deferred" if self._closing() else ""

    def accounting(self) -> dict[str, Accounting]:
        eng = self.engine
        a = eng.token_to_kv_pool_allocator
        tree = eng.tree_cache
        acc = {"token_to_kv_pool": Accounting(a.available_size(), tree.evictable_size(), tree.protected_size(),
                                              eng.session_held_tokens(), a.size)}
        rp = eng.req_to_token_pool
        session_rows = 0 if eng.session_controller is None else len(eng.session_controller.slots())
        acc["req_to_token_pool"] = Accounting(rp.available_size(), 0, 0, session_rows, rp.size + rp.pre_alloc_size)
        if eng.hicache_host_pool is not None:
            hp = eng.hicache_host_pool
            acc["hicache_host"] = Accounting(hp.available_size(), tree.host_evictable_size(),
                                             tree.host_protected_size(), 0, hp.size)
        hs = eng.hisparse_coordinator
        if hs is not None:
            for name, pool in (("hisparse_device", hs.hisparse_attn_allocator), ("hisparse_host", hs.host_pool)):
                acc[name] = Accounting(pool.available_size(), 0, 0, 0, pool.size)
        return acc

    def engine_check(self) -> list[str]:
        """The engine's failing ``check_memory()`` identities, each as the sum that fails
        (``[pool] available=255 + evictable=0 + ... = 255 != total=256``, as the SGLang target writes it)."""
        return [f"[{c.pool}] available={c.available} + evictable={c.evictable} + protected={c.protected} + "
                f"session_held={c.session_held} + uncached={c.uncached} = "
                f"{c.available + c.evictable + c.protected + c.session_held + c.uncached} != total={c.total}"
                for c in self.engine.check_memory() if not c.ok]


class _CheckScope:
    """:meth:`EutObserver.checking`: the tree's node list and the live requests kept for the check
    (``_tree_nodes``, ``_owners``), and with ``eng`` (many live requests) the engine's method shadowed to
    read them once (:class:`_OwnersOnce`); all dropped on exit."""

    __slots__ = ("obs", "owners", "prev")

    def __init__(self, obs, eng):
        self.obs, self.owners = obs, None if eng is None else _OwnersOnce(eng)

    def __enter__(self) -> None:
        obs = self.obs
        self.prev = (obs._in_check, obs._nodes_memo, obs._owners_memo)  # (an outer check's)
        obs._in_check, obs._nodes_memo, obs._owners_memo = True, None, None
        if self.owners is not None:
            self.owners.__enter__()

    def __exit__(self, *exc) -> None:
        if self.owners is not None:
            self.owners.__exit__(*exc)
        self.obs._in_check, self.obs._nodes_memo, self.obs._owners_memo = self.prev


class _OwnersOnce:
    """:meth:`EutObserver.checking`: shadows the engine's bound ``requests_owning_rows`` with an instance
    attribute that calls it once, and takes the attribute away (or puts a previous one back) on exit."""

    __slots__ = ("eng", "prev", "real", "got")

    def __init__(self, eng):
        self.eng = eng

    def __enter__(self) -> None:
        eng = self.eng
        self.prev = eng.__dict__.get("requests_owning_rows")  # a test's or an outer check's
        self.real, self.got = eng.requests_owning_rows, None
        eng.requests_owning_rows = self.once

    def once(self) -> list:
        if self.got is None:
            self.got = self.real()
        return list(self.got)

    def __exit__(self, *exc) -> None:
        if self.prev is None:
            self.eng.__dict__.pop("requests_owning_rows", None)
        else:
            self.eng.requests_owning_rows = self.prev


def _ranges(pos) -> str:
    """``[3, 4, 5, 9]`` -> ``"3-5, 9"`` (at most four ranges)."""
    pos = sorted(int(p) for p in pos)
    out, start = [], pos[0]
    for a, b in zip(pos, pos[1:] + [None]):
        if b != a + 1:
            out.append(f"{start}" if start == a else f"{start}-{a}")
            start = b
    return ", ".join(out[:4]) + (", ..." if len(out) > 4 else "")
