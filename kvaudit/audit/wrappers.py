"""The wrappers: instance attributes that shadow a target's pool methods and record each call in
the ledger; ``uninstall`` removes them. Design notes: docs/internals/audit.md.
"""

from __future__ import annotations

import numpy as np
import torch

from kvaudit.audit.ledger import SMALL_EVENT
from kvaudit.targets.base import PoolSpec


def row_ids(rows, what: str = "rows") -> np.ndarray:
    """Row ids as an ``[n] int64`` numpy array: ``rows`` is None (no rows), an int (Python, numpy or
    torch scalar), or a sequence or array of ints (a torch tensor on any device; flattened). Raises
    ``TypeError`` (``what`` begins the message) for anything else, floats and bools included."""
    if rows is None:
        return np.zeros(0, dtype=np.int64)
    if isinstance(rows, torch.Tensor):
        rows = rows.detach().cpu().numpy()
    try:
        arr = np.asarray(rows)
    except (TypeError, ValueError) as e:  # ragged nesting, an object numpy cannot read
        raise TypeError(f"{what} {type(rows).__name__}, not row ids (a sequence or array of ints): {e}") from None
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{what} {type(rows).__name__} of {arr.dtype}, not row ids (a sequence or array of ints)")
    return arr.astype(np.int64, copy=False).reshape(-1)


_INT = frozenset({int})


def _row_list(rows, what: str) -> list[int]:
    # row_ids(rows) as a list: a Python int or a list of them (what the engine's row pools pass) without numpy
    # (each item's type read in C: map, not a generator)
    if type(rows) is int:
        return [rows]
    if type(rows) is list and _INT.issuperset(map(type, rows)):
        return rows[:]  # (the ledger keeps it: not the engine's list)
    return row_ids(rows, what).tolist()


def _units(idx: torch.Tensor, ps: int) -> list[int]:
    if ps == 1:
        return idx.tolist()
    if idx.numel() <= SMALL_EVENT * ps:
        return sorted({x // ps for x in idx.tolist()})
    return torch.unique(idx // ps).tolist()


class PoolWrappers:
    """The installing half of :class:`kvaudit.audit.hooks.Auditor`."""

    def _wrap(self, obj, name: str, wrapper) -> None:
        self._undo.append((obj, name))
        setattr(obj, name, wrapper)

    def wrap_clear(self, spec: PoolSpec) -> None:
        """Wrap ``spec.obj.clear()`` (flush_cache), if it has one, as one free of every unit held."""
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
        """Wrap a row pool's ``alloc(n)`` and ``free(rows)`` (SGLang's ``ReqToTokenPool``,
        ``srt/mem_cache/memory_pool.py``). Rows are read by :func:`row_ids` (an iterator given to ``free``
        is read into a list, which the engine gets); rows that are not integers raise ``TypeError``."""
        obj, pool = spec.obj, spec.name
        orig_alloc, orig_free = getattr(obj, alloc), getattr(obj, free)
        returned, given = f"{pool}.{alloc}() returned", f"{pool}.{free}() was given"  # (once, not per call)
        led = self.ledgers[pool]
        flags, last, last_free, own = led.flags, led.last_alloc, led.last_free, self.__dict__

        def alloc_rows(n, *a, **k):
            out = orig_alloc(n, *a, **k)
            rows = _row_list(out, returned)
            if rows:  # (on_alloc's fast path inline, as in _wrap_kv_allocs: the list is _row_list's own)
                if len(rows) <= SMALL_EVENT and not any(map(flags.__getitem__, rows)):
                    self._mark("alloc", pool, rows, self.capture_site(), led, last, 1)
                else:
                    self.on_alloc(pool, rows, self.capture_site())
            return out

        def free_rows(rows, *a, **k):
            if hasattr(rows, "__next__"):  # an iterator (a generator): read it once, for both
                rows = list(rows)
            orig_free(rows, *a, **k)
            ids = _row_list(rows, given)
            if not ids:
                return
            # on_free's fast path inline (every row allocated, each named once), unless the instance replaced
            # on_free (a full run keeping the freed slots' shadow tags: Auditor._keep_tags_at_free)
            if ("on_free" not in own and len(ids) <= SMALL_EVENT and all(map(flags.__getitem__, ids)) and 0 not in ids
                    and len(set(ids)) == len(ids)):
                self._mark("free", pool, ids, self.capture_site(), led, last_free, 0)
            else:
                self.on_free(pool, ids, self.capture_site())

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
        self.wrap_clear(spec)
        if spec.kind == "rows":
            self.wrap_rows(spec)
            return
        depth = [0]  # only the outermost call records: alloc_extend may call alloc internally
        self._wrap_kv_allocs(spec, depth)
        self._wrap_kv_free(spec, depth)

    def _wrap_kv_allocs(self, spec: PoolSpec, depth: list[int]) -> None:
        obj, pool, ps = spec.obj, spec.name, spec.page_size
        led = self.ledgers[pool]
        flags, last = led.flags, led.last_alloc
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
                    ul = out.tolist() if ps == 1 else _units(out, ps)  # (_units inline on a page of one token)
                    # NOTE: on_alloc's fast path inline (every unit fresh; the list is the wrapper's own): the
                    # common case pays no on_alloc call, pool look-up or copy
                    if len(ul) <= SMALL_EVENT and not any(map(flags.__getitem__, ul)):
                        self._mark("alloc", pool, ul, self.capture_site(), led, last, 1)
                    else:
                        self.on_alloc(pool, ul, self.capture_site(), expected_new=(obj, before))
                return out

            self._wrap(obj, name, alloc_wrapper)

    def _wrap_kv_free(self, spec: PoolSpec, depth: list[int]) -> None:
        obj, pool, ps = spec.obj, spec.name, spec.page_size
        orig_free = obj.free
        group: list[tuple[list[int], int, list[str] | None]] = []

        def free_wrapper(idx, *a, **k):
            if depth[0] or idx.numel() == 0:
                return orig_free(idx, *a, **k)
            if not getattr(obj, "is_not_in_free_group", True):
                units = _units(idx, ps)
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
            self.on_free(pool, idx.tolist() if ps == 1 else _units(idx, ps), self.capture_site())

        self._wrap(obj, "free", free_wrapper)
        orig_end = getattr(obj, "free_group_end", None)
        if orig_end is not None:
            def group_end_wrapper(*a, **k):
                depth[0] += 1
                try:
                    orig_end(*a, **k)
                finally:
                    depth[0] -= 1
                if group:  # (most steps free nothing in their group)
                    pend = list(group)
                    group.clear()
                    self._free_group(pool, ps, pend)

            self._wrap(obj, "free_group_end", group_end_wrapper)

    def _free_group(self, pool: str, ps: int, pend: list[tuple[list[int], int, list[str] | None]]) -> None:
        # NOTE: a paged allocator frees unique(pages) of the whole group once; with page_size 1 the
        # slots go back as they are (duplicates included), so each free is checked on its own
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

    def uninstall(self) -> None:
        for obj, name in reversed(self._undo):
            try:
                delattr(obj, name)
            except AttributeError:
                pass
        self._undo.clear()
