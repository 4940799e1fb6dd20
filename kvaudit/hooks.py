"""Hooks: wrap a target's pool methods from the outside and keep a ledger of every alloc and free.

The engine is not modified: the wrappers are instance attributes that shadow the class methods.
Each event records the pool, the units (pages or rows), the op index, the scheduler step and an
interned call site (the stack from the first frame outside the allocator and kvaudit).

Double frees are caught at free time, from per-unit state (O(units) torch ops, no Python loop
over slots). An allocation that hands out a unit the ledger holds as allocated is *aliasing*.
Frees inside an allocator free group are recorded when the group ends, with their own sites.
"""

from __future__ import annotations

import inspect
import os
import sys
from dataclasses import dataclass

import torch

import kvaudit
from kvaudit.findings import Finding, Site
from kvaudit.targets.base import PoolSpec

_KVAUDIT_DIR = os.path.dirname(os.path.abspath(kvaudit.__file__))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
STACK_DEPTH = 8


@dataclass
class Event:
    id: int
    kind: str  # "alloc" | "free"
    pool: str
    units: torch.Tensor  # [n] int64, on the CPU
    op_index: int
    step: int
    site: int


class PoolLedger:
    """Per-unit state of one pool: allocated flag, last alloc and free event, current owner id."""

    def __init__(self, spec: PoolSpec):
        n = spec.num_units + 1
        self.spec = spec
        self.allocated = torch.zeros(n, dtype=torch.bool)
        self.last_alloc = torch.full((n,), -1, dtype=torch.int64)
        self.last_free = torch.full((n,), -1, dtype=torch.int64)
        self.owner = torch.zeros(n, dtype=torch.int64)  # id into Auditor.owner_names; 0 = nobody


class Auditor:
    """Installs the hooks on ``target``'s pools and keeps the ledger.

    ``op_index`` and ``step`` are set by the runner before each op / step. ``pending`` collects
    findings raised inside hooks (double free, aliasing at alloc) until the runner takes them.
    """

    def __init__(self, target):
        self.target = target
        self.ledgers = {spec.name: PoolLedger(spec) for spec in target.pools()}
        self.events: list[Event] = []
        self.owner_changes: list[tuple[int, int, str, torch.Tensor, torch.Tensor]] = []
        self.owner_names = ["-"]
        self._owner_ids = {"-": 0}
        self.op_index = -1
        self.step = 0
        self.pending: list[Finding] = []
        self._sites: dict[tuple, int] = {}
        self._site_frames: list[tuple] = []
        self._framework_code: dict = {}
        self._skip_files = {_KVAUDIT_DIR}
        self._undo: list[tuple[object, str]] = []
        for spec in target.pools():
            self._skip_files.add(os.path.abspath(inspect.getfile(type(spec.obj))))
            self._install(spec)

    # -- sites ------------------------------------------------------------------------------
    def _is_framework(self, code) -> bool:
        hit = self._framework_code.get(code)
        if hit is None:
            fn = os.path.abspath(code.co_filename)
            hit = fn in self._skip_files or fn.startswith(_KVAUDIT_DIR) or fn.startswith(_TORCH_DIR)
            self._framework_code[code] = hit
        return hit

    def capture_site(self) -> int:
        """Intern the current stack, from the first frame outside the allocator and kvaudit."""
        f = sys._getframe(2)
        while f is not None and self._is_framework(f.f_code):
            f = f.f_back
        frames = []
        while f is not None and len(frames) < STACK_DEPTH and not self._is_framework(f.f_code):
            frames.append((f.f_code, f.f_lineno))
            f = f.f_back
        key = tuple(frames)
        sid = self._sites.get(key)
        if sid is None:
            sid = self._sites[key] = len(self._site_frames)
            self._site_frames.append(key)
        return sid

    def site(self, sid: int) -> list[Site]:
        """The stack of site ``sid``, innermost first."""
        if sid < 0:
            return []
        return [Site(code.co_filename, line, code.co_name) for code, line in self._site_frames[sid]]

    def owner_id(self, name: str) -> int:
        oid = self._owner_ids.get(name)
        if oid is None:
            oid = self._owner_ids[name] = len(self.owner_names)
            self.owner_names.append(name)
        return oid

    # -- recording --------------------------------------------------------------------------
    def _event(self, kind: str, pool: str, units: torch.Tensor, sid: int) -> Event:
        ev = Event(len(self.events), kind, pool, units, self.op_index, self.step, sid)
        self.events.append(ev)
        return ev

    def on_alloc(self, pool: str, units: torch.Tensor, sid: int, expected_new: int | None = None) -> None:
        led = self.ledgers[pool]
        fresh = units[~led.allocated[units]]
        if expected_new is None:
            expected_new = units.numel()
        if fresh.numel() < expected_new or (units == 0).any():
            taken = units[led.allocated[units]] if fresh.numel() < expected_new else units[units == 0]
            self.pending.append(self._unit_finding(
                "aliasing", pool, taken, f"allocator handed out {taken.numel()} unit(s) already allocated",
                alloc_sid=sid))
        ev = self._event("alloc", pool, fresh, sid)
        led.allocated[fresh] = True
        led.last_alloc[fresh] = ev.id

    def on_free(self, pool: str, units: torch.Tensor, sid: int) -> None:
        led = self.ledgers[pool]
        uniq, counts = torch.unique(units, return_counts=True)
        bad = uniq[(~led.allocated[uniq]) | (counts > 1)]
        ev = self._event("free", pool, uniq, sid)
        if bad.numel():
            f = self._unit_finding("double-free", pool, bad, f"{bad.numel()} unit(s) freed while already free")
            f.free_sites = self.site(sid)
            prev = int(led.last_free[bad[0]])
            f.prev_free_sites = self.site(self.events[prev].site) if prev >= 0 else []
            self.pending.append(f)
        led.allocated[uniq] = False
        led.last_free[uniq] = ev.id

    # -- findings ---------------------------------------------------------------------------
    def _unit_finding(self, kind: str, pool: str, units: torch.Tensor, message: str,
                      alloc_sid: int | None = None) -> Finding:
        led = self.ledgers[pool]
        spec = led.spec
        units = units.sort().values
        if alloc_sid is None:
            ev = int(led.last_alloc[units[0]])
            alloc_sid = self.events[ev].site if ev >= 0 else -1
        if spec.kind == "rows":
            unit, slots = "row", units.tolist()
        else:
            unit = "page" if spec.page_size > 1 else "slot"
            offs = torch.arange(spec.page_size)
            slots = (units[:, None] * spec.page_size + offs).reshape(-1).tolist()
        return Finding(kind=kind, pool=pool, message=message, unit=unit, slots=slots, num_units=units.numel(),
                       alloc_sites=self.site(alloc_sid), owner_history=self.history(pool, int(units[0])),
                       op_index=self.op_index, step=self.step)

    def history(self, pool: str, unit: int):
        """Alloc, owner changes and free of ``unit``, in order, as :class:`OwnerChange` records."""
        from kvaudit.findings import OwnerChange

        out = []
        for ev in self.events:
            if ev.pool == pool and bool((ev.units == unit).any()):
                site = self.site(ev.site)
                out.append(OwnerChange(ev.op_index, ev.step, "-", f"{ev.kind} at {site[0].short() if site else '?'}"))
        for op_index, step, p, units, owners in self.owner_changes:
            if p == pool:
                hit = (units == unit).nonzero()
                if hit.numel():
                    out.append(OwnerChange(op_index, step, self.owner_names[int(owners[hit[0, 0]])], "owner"))
        out.sort(key=lambda o: (o.step, o.op_index, o.event != "owner"))
        return out

    # -- installation -----------------------------------------------------------------------
    def _wrap(self, obj, name: str, wrapper) -> None:
        self._undo.append((obj, name))
        setattr(obj, name, wrapper)

    def _install(self, spec: PoolSpec) -> None:
        obj, pool, ps = spec.obj, spec.name, spec.page_size

        if spec.kind == "rows":
            orig_alloc, orig_free = obj.alloc, obj.free

            def alloc_rows(n, *a, **k):
                out = orig_alloc(n, *a, **k)
                if out:
                    self.on_alloc(pool, torch.tensor(out, dtype=torch.int64), self.capture_site())
                return out

            def free_rows(rows, *a, **k):
                orig_free(rows, *a, **k)
                self.on_free(pool, torch.tensor([rows] if isinstance(rows, int) else list(rows),
                                                dtype=torch.int64), self.capture_site())

            self._wrap(obj, "alloc", alloc_rows)
            self._wrap(obj, "free", free_rows)
            return

        def to_units(idx: torch.Tensor) -> torch.Tensor:
            idx = idx.detach().to("cpu", torch.int64)
            return idx if ps == 1 else torch.unique(idx // ps)

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
                    self.on_alloc(pool, to_units(out), self.capture_site(),
                                  expected_new=(before - obj.available_size()) // ps)
                return out

            self._wrap(obj, name, alloc_wrapper)

        orig_free = obj.free
        group: list[tuple[torch.Tensor, int]] = []

        def free_wrapper(idx, *a, **k):
            if depth[0] or idx.numel() == 0:
                return orig_free(idx, *a, **k)
            if not getattr(obj, "is_not_in_free_group", True):
                group.append((to_units(idx), self.capture_site()))
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
                for units, sid in pend:
                    self.on_free(pool, units, sid)

            self._wrap(obj, "free_group_end", group_end_wrapper)

    def uninstall(self) -> None:
        for obj, name in reversed(self._undo):
            try:
                delattr(obj, name)
            except AttributeError:
                pass
        self._undo.clear()
