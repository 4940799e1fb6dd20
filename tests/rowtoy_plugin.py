"""A plugin target written the way a newcomer writes one (tests/test_plugin_path.py): a row-pool
engine whose allocator returns numpy arrays and frees single rows as ``np.int64`` scalars, a config
with no ``target`` field, bugs as plain strings and no ``describe_busy``. Importing it registers the
kind ``rowtoy``; the engine shares this module with its target (``framework_classes``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvaudit.config import ConfigBase, Preset
from kvaudit.program import Abort, Submit
from kvaudit.targets.base import Accounting, PoolSpec, Root, Target
from kvaudit.targets.registry import TargetKind, register


class RowPool:
    """Rows 1..size-1; ``alloc(n)`` returns an ``[n] int64`` array (None when short)."""

    def __init__(self, size: int):
        self.free_rows = np.arange(1, size, dtype=np.int64)

    def alloc(self, n: int):
        if n > self.free_rows.size:
            return None
        out, self.free_rows = self.free_rows[:n], self.free_rows[n:]
        return out

    def free(self, rows) -> None:
        self.free_rows = np.concatenate([self.free_rows, np.atleast_1d(np.asarray(rows, dtype=np.int64))])


class Req:
    def __init__(self, rid: str, prompt_len: int, max_new: int):
        self.rid, self.prompt_len, self.max_new, self.out = rid, prompt_len, max_new, 0
        self.rows = np.zeros(0, dtype=np.int64)


class RowToyEngine:
    """Admits a request when its whole length fits, one row per token; ``stuck`` (bug): a request
    never finishes."""

    def __init__(self, size: int, bugs=()):
        self.pool, self.bugs, self.waiting, self.running = RowPool(size), set(bugs), [], []

    def release(self, r: Req) -> None:
        if r.rows.size:
            self.pool.free(r.rows[-1])  # a single row: an np.int64 scalar
            if r.rows.size > 1:
                self.pool.free(r.rows[:-1])
        r.rows = np.zeros(0, dtype=np.int64)

    def abort(self, r: Req) -> None:
        for q in (self.waiting, self.running):
            if r in q:
                q.remove(r)
        if "abort-leak" not in self.bugs:
            self.release(r)

    def step(self) -> None:
        while self.waiting and self.pool.free_rows.size >= self.waiting[0].prompt_len + self.waiting[0].max_new \
                + sum(r.max_new - r.out for r in self.running):
            r = self.waiting.pop(0)
            r.rows = self.pool.alloc(r.prompt_len)
            self.running.append(r)
        for r in list(self.running):
            if "stuck" in self.bugs:
                continue
            r.rows = np.concatenate([r.rows, self.pool.alloc(1)])
            r.out += 1
            if r.out >= r.max_new:
                self.running.remove(r)
                self.release(r)


@dataclass(frozen=True)
class RowToyConfig(ConfigBase):
    size: int = 48
    bugs: frozenset = field(default_factory=frozenset)
    preset: str = "custom"

    def __post_init__(self):
        object.__setattr__(self, "bugs", frozenset(self.bugs))

    page_size = 1

    @property
    def num_slots(self) -> int:
        return self.size - 1

    @property
    def context_len(self) -> int:
        return self.size // 3


class RowToyTarget(Target):
    def __init__(self, config: RowToyConfig):
        self.config, self.engine, self.reqs, self.n = config, RowToyEngine(config.size, config.bugs), {}, 0

    def pools(self):
        return [PoolSpec("rows", self.engine.pool, "rows", 1, self.config.size - 1)]

    def framework_classes(self):
        return [RowPool]

    def apply(self, op) -> None:
        if isinstance(op, Submit):
            self.n += 1
            r = Req(f"r{self.n}", max(1, min(op.prompt_len, self.config.context_len)),
                    max(1, min(op.max_new_tokens, self.config.context_len)))
            self.engine.waiting.append(r)
        elif isinstance(op, Abort):
            live = self.engine.waiting + self.engine.running
            if live:
                for r in (live if op.handle is None else [live[op.handle % len(live)]]):
                    self.engine.abort(r)

    def step(self) -> None:
        self.engine.step()
        self.steps += 1

    def is_idle(self) -> bool:
        return not (self.engine.waiting or self.engine.running)

    def roots(self, aborting=True):
        return [Root("rows", f"req:{r.rid}", r.rows) for r in self.engine.running]

    def accounting(self):
        return {"rows": Accounting(available=int(self.engine.pool.free_rows.size), evictable=0, protected=0,
                                   session_held=0, total=self.config.size - 1)}

    def engine_check(self):
        return []


PRESETS = {"rowtoy": Preset("rowtoy", "48 rows", {}, config_class=RowToyConfig),
           "rowtoy-leaky": Preset("rowtoy-leaky", "48 rows, abort leaks", {"bugs": {"abort-leak"}},
                                  config_class=RowToyConfig)}

KIND = register(TargetKind(
    name="rowtoy", summary="a row-pool toy (tests/rowtoy_plugin.py)", config_class=RowToyConfig,
    presets=lambda: PRESETS, make=RowToyTarget, default_preset="rowtoy",
    bugs=lambda: {"abort-leak": "abort drops a request without freeing its rows",
                  "stuck": "a running request never finishes"}))
