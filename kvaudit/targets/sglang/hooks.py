"""The observer's hooks: wrappers on the allocator, request-pool and tree-cache *instances* (never the
classes) that feed kvaudit's ledger every alloc, free, lock-ref change and tree insert."""

from __future__ import annotations

import traceback

import numpy as np
import torch

from kvaudit.targets.base import PoolSpec, Target, wrap_insert
from kvaudit.targets.sglang import compat
from kvaudit.targets.sglang.rowwrites import RowWrites


def host_units(slots: torch.Tensor, page_size: int) -> np.ndarray:
    """Host slots (``[n]`` int64, tokens) as ledger units: host page + 1 (unit 0 is every pool's padding)."""
    s = slots.to(torch.int64).cpu().numpy()
    s = s[s >= 0]
    return np.unique(s // page_size) + 1


def host_free_units(host_pool, page_size: int) -> np.ndarray:
    """A host pool's free list (``free_slots`` and pending ``release_slots``) as units, one per free page."""
    slots = host_pool.free_slots
    if host_pool.release_slots:
        slots = torch.cat([slots, *host_pool.release_slots])
    slots = slots[slots % page_size == 0]
    return (slots // page_size + 1).cpu().numpy()


def install_free_set(auditor, wrap, pool: str, obj, name: str, taking: bool, read, changed) -> None:
    """Wrap ``obj.<name>`` of an allocator the ledger reads by its free set: ``changed(before, after)`` of
    ``read()`` around the call are the units (a list) it took (``taking``) or gave back. (An ``install_``
    function: its wrapper is a hook, never a site.)"""
    orig = getattr(obj, name)

    def wrapper(*a, **k):
        before = read()
        out = orig(*a, **k)
        units = changed(before, read())
        if units:
            (auditor.on_alloc if taking else auditor.on_free)(pool, units, auditor.capture_site())
        return out

    wrap(obj, name, wrapper)


class SglangHooks(Target):
    """The ``install_*`` hooks; they read ``self.tree_cache`` and keep ``self.lock_net`` (node id -> incs - decs)."""

    def install_pool(self, spec: PoolSpec, auditor, wrap) -> None:
        """Rows at ``alloc_rows``/``free_rows``, row writes at ``write`` (:meth:`_install_row_writes`); KV at
        ``alloc``/``free`` (page 1) or as the pages that left the free set and at ``_release_page_ids``
        (paged); ``clear()`` as a free of everything; host pools at :meth:`_install_host_pool`."""
        if spec.kind == "host":
            return self._install_host_pool(spec, auditor, wrap)
        auditor.wrap_clear(spec)
        if spec.kind == "rows":
            auditor.wrap_rows(spec, alloc="alloc_rows", free="free_rows")
            return self._install_row_writes(spec, auditor, wrap)
        obj = spec.obj
        paged = spec.page_size > 1 or hasattr(obj, "_release_page_ids")  # (a paged one may be page 1)
        version = self.S.version
        self.install_kv(spec, auditor, wrap, paged, lambda: obj.free_group is not None,
                        census=lambda: compat.free_pages(obj, version),
                        page_ids=compat.has("free-page-ids", version))

    def _install_row_writes(self, spec: PoolSpec, auditor, wrap) -> None:
        """``ReqToTokenPool.write`` records where it puts KV units (:class:`RowWrites`, read by :meth:`lost_by`;
        the spec feature's :func:`assign_rows` records its own writes)."""
        if "token_to_kv_pool" not in auditor.ledgers or not hasattr(spec.obj, "write"):
            return
        self.row_writes = rec = RowWrites(auditor, "token_to_kv_pool", self.config.page_size, self._session_rows)
        write = spec.obj.write

        def write_wrapper(indices, values, *a, **k):
            if type(indices) is tuple and len(indices) == 2 and torch.is_tensor(values) and values.numel():
                rec.put(indices[0], values)
            return write(indices, values, *a, **k)

        wrap(spec.obj, "write", write_wrapper)

    def _session_rows(self) -> list[int]:
        """The rows the live session records hold."""
        return [s.kv.req_pool_idx for _, s in self._slots() if s.kv.holds_kv]

    def lost_by(self, pool: str, units) -> list[str] | None:
        """Where the last row write put each of ``units`` (:meth:`RowWrites.lost_by`); None for a pool it
        does not record."""
        rec = getattr(self, "row_writes", None)
        return rec.lost_by(units) if rec is not None and pool == rec.pool else None

    def crash_by(self, exc: BaseException) -> str:
        """``req:requeued`` when the request the innermost engine frame works on (its ``req`` local) is one
        optimistic prefill released and requeued (``optimistic_release_and_requeue``): its retry raised, not
        a request's first run; else ``""``."""
        frames = [fr for fr, _ in traceback.walk_tb(exc.__traceback__)]
        rid = next((r.rid for fr in reversed(frames) if hasattr(r := fr.f_locals.get("req"), "rid")), None)
        return "req:requeued" if isinstance(rid, str) and rid in getattr(self, "requeued", ()) else ""

    @staticmethod
    def install_kv(spec: PoolSpec, auditor, wrap, paged: bool, in_group, census=None, page_ids=True) -> None:
        """A KV allocator's wrappers, and its ``free_group_end``: frees inside a free group are recorded when
        they reach the free list, each with the site of its own call (a paged ``free()`` deduplicates
        pages over the group; ``free_page_ids`` does not). ``census``: the free pages (``[n]`` int64 tensor) of a
        paged allocator, ``compat.free_pages``; ``page_ids``: whether a grouped segment free goes through
        ``free_page_ids`` (change ``free-page-ids``) or, before, ``free_segment`` queues page representatives."""
        obj, pending, ending = spec.obj, [], [False]
        if paged:
            SglangHooks.install_paged_kv(spec, auditor, wrap, pending, ending, in_group, census, page_ids)
        else:
            SglangHooks.install_token_kv(spec, auditor, wrap, pending, ending, in_group)
        group_end = obj.free_group_end

        def group_end_wrapper():
            ending[0] = True
            try:
                group_end()
            finally:
                ending[0] = False
            items = list(pending)
            pending.clear()
            seen: set[int] = set()
            for units, sid, dedup in items:
                if dedup:
                    units = [u for u in units if u not in seen]
                    seen.update(units)
                if units:
                    auditor.on_free(spec.name, units, sid)

        wrap(obj, "free_group_end", group_end_wrapper)

    @staticmethod
    def install_token_kv(spec: PoolSpec, auditor, wrap, pending: list, ending: list, in_group) -> None:
        obj, pool, capture = spec.obj, spec.name, auditor.capture_site
        alloc, free = obj.alloc, obj.free

        def alloc_wrapper(n):
            out = alloc(n)
            if out is not None and out.numel():
                auditor.on_alloc(pool, out.tolist(), capture())
            return out

        def free_wrapper(idx):
            grouped = in_group()
            if grouped and not ending[0] and idx.numel():
                pending.append((idx.tolist(), capture(), False))
            free(idx)
            if not grouped and not ending[0] and idx.numel():
                auditor.on_free(pool, idx.tolist(), capture())

        wrap(obj, "alloc", alloc_wrapper)
        wrap(obj, "free", free_wrapper)

    @staticmethod
    def install_paged_kv(spec: PoolSpec, auditor, wrap, pending: list, ending: list, in_group, census,
                         page_ids: bool) -> None:
        obj, pool, ps, capture = spec.obj, spec.name, spec.page_size, auditor.capture_site

        def grouped(name, to_units, dedup):
            orig = getattr(obj, name)

            def wrapper(idx, *a, **k):
                if in_group() and not ending[0] and idx.numel():
                    pending.append((to_units(idx), capture(), dedup))
                return orig(idx, *a, **k)

            wrap(obj, name, wrapper)

        def paged(name):
            orig = getattr(obj, name)

            def alloc_wrapper(*a, **k):
                before = census().cpu().numpy()
                out = orig(*a, **k)
                if out is not None:
                    taken = np.setdiff1d(before, census().cpu().numpy())
                    if taken.size:
                        auditor.on_alloc(pool, taken.tolist(), capture())
                return out
            return alloc_wrapper

        for name in ("alloc", "alloc_extend", "alloc_decode"):
            wrap(obj, name, paged(name))
        grouped("free", lambda idx: torch.unique(idx // ps).tolist(), True)
        if page_ids:
            grouped("free_page_ids", lambda ids: ids.tolist(), False)
        else:  # 0.5.19: a grouped free_segment queues one representative per page (the pages of its slots)
            grouped("free_segment", lambda idx: torch.unique(idx // ps).tolist(), False)
        release = obj._release_page_ids

        def release_wrapper(*page_ids):
            release(*page_ids)
            units = torch.cat([p.reshape(-1) for p in page_ids]).tolist() if page_ids else []
            if units and not ending[0]:
                auditor.on_free(pool, units, capture())

        wrap(obj, "_release_page_ids", release_wrapper)

    def _install_host_pool(self, spec: PoolSpec, auditor, wrap, live: set | None = None) -> None:
        """A ``HostKVCache``: ``alloc``/``free``/``clear`` in host units; ``live``, if given, mirrors the units
        held."""
        obj, pool, ps = spec.obj, spec.name, spec.page_size
        capture = auditor.capture_site
        auditor.wrap_clear(spec)
        alloc, free = obj.alloc, obj.free
        live = set() if live is None else live

        def alloc_wrapper(need_size, *a, **k):
            out = alloc(need_size, *a, **k)
            if out is not None and out.numel():
                units = host_units(out, ps).tolist()
                live.update(units)
                auditor.on_alloc(pool, units, capture())
            return out

        def free_wrapper(indices, *a, **k):
            out = free(indices, *a, **k)
            if indices.numel():
                units = host_units(indices, ps).tolist()
                live.difference_update(units)
                auditor.on_free(pool, units, capture())
            return out

        wrap(obj, "alloc", alloc_wrapper)
        wrap(obj, "free", free_wrapper)
        cleared = getattr(obj, "clear", None)  # auditor.wrap_clear's wrapper
        if cleared is not None:
            def clear_wrapper(*a, **k):
                live.clear()
                return cleared(*a, **k)

            wrap(obj, "clear", clear_wrapper)

    def install_lock_ledger(self, wrap, record) -> None:
        """Report every ``inc_lock_ref``/``dec_lock_ref`` of the tree to ``record(node_id, delta)``."""
        self.install_lock_counter(wrap, record, self.tree_cache, "inc_lock_ref", "dec_lock_ref", self.lock_net)

    @staticmethod
    def install_lock_counter(wrap, record, cache, inc_name: str, dec_name: str, net: dict, *extra) -> None:
        """Wrap ``cache``'s lock pair: each call counts in ``net`` (node id -> incs - decs) and goes to
        ``record(node_id, +1 or -1, *extra)``."""
        inc, dec = getattr(cache, inc_name), getattr(cache, dec_name)

        def inc_wrapper(node_id, *a, **k):
            out = inc(node_id, *a, **k)
            net[node_id] = net.get(node_id, 0) + 1
            record(node_id, +1, *extra)
            return out

        def dec_wrapper(node_id, *a, **k):
            out = dec(node_id, *a, **k)
            net[node_id] = net.get(node_id, 0) - 1
            record(node_id, -1, *extra)
            return out

        wrap(cache, inc_name, inc_wrapper)
        wrap(cache, dec_name, dec_wrapper)

    def install_insert_check(self, wrap, report) -> None:
        """Check every ``UnifiedRadixCache.insert(params)``: the tree takes ``min(len(key), len(value))``
        tokens of the request being cached, which must not exceed its ``kv_committed_len``."""

        def measure(req, params, *a, **k):
            value = params.value
            inserted = min(len(params.key), int(value.numel())) if value is not None else 0
            return f"req:{req.rid}", inserted, req.kv.kv_committed_len, value

        wrap_insert(wrap, self.tree_cache, "insert", measure, report)
