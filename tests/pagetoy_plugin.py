"""A paged toy scheduler and its target, written from docs/writing-a-target.md, with the stale-KV shadow
(``kv_pools``/``install_shadow``). Importing it registers the kind ``pagetoy``.

Pages of ``page_size`` token slots (page 0 reserved); a request holds its page table ``pages``; a decode
reads every earlier position (``_attend``) and writes the new token's (``_write``). Planted bugs:
``abort-leak`` (an abort of a running request forgets its pages) and ``early-free`` (a request's pages go
back to the pool one step before its last decode reads them: a prefill admitted that step overwrites them).
``PRESETS["pagetoy-roots"]`` is the same target without the shadow (ownership only)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from kvaudit.config import ConfigBase, Preset
from kvaudit.program import Abort, Submit, prompt_tokens
from kvaudit.targets.base import Accounting, PoolSpec, Root, Target
from kvaudit.targets.registry import TargetKind, register

POOL = "pages"


class PagePool:
    def __init__(self, num_pages: int):
        self.free_pages = deque(range(1, num_pages))

    def alloc(self, n: int):
        return [self.free_pages.popleft() for _ in range(n)] if n <= len(self.free_pages) else None

    def free(self, pages):
        self.free_pages.extend(int(p) for p in pages)


class Req:
    def __init__(self, rid, prompt, max_new):
        self.rid, self.prompt, self.max_new, self.out, self.pages = rid, list(prompt), max_new, [], []
        self.freed_early: set[int] = set()

    @property
    def length(self):
        return len(self.prompt) + len(self.out)


class PageScheduler:
    def __init__(self, num_pages, page_size, max_running, bugs=()):
        self.pool, self.num_pages, self.page_size = PagePool(num_pages), num_pages, page_size
        self.max_running, self.bugs = max_running, frozenset(bugs)
        self.kv = {}  # (page, offset) -> (rid, position): the content the model would attend to
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []

    def pages_for(self, tokens):
        return -(-tokens // self.page_size)

    def abort(self, rid):
        for req in [r for r in self.waiting if r.rid == rid]:
            self.waiting.remove(req)
        for req in [r for r in self.running if r.rid == rid]:
            self.running.remove(req)
            if "abort-leak" not in self.bugs:
                self._release(req)

    def _release(self, req):
        self.pool.free([p for p in req.pages if p not in req.freed_early])
        req.pages, req.freed_early = [], set()

    def _write(self, req, pos):
        self.kv[req.pages[pos // self.page_size], pos % self.page_size] = (req.rid, pos)

    def _attend(self, req, pos):
        return sum(self.kv.get((req.pages[p // self.page_size], p % self.page_size)) != (req.rid, p)
                   for p in range(pos))

    def step(self):
        while self.waiting and len(self.running) < self.max_running:
            pages = self.pool.alloc(self.pages_for(self.waiting[0].length + 1))
            if pages is None:
                break
            req = self.waiting.popleft()
            req.pages = pages
            for pos in range(req.length):  # prefill
                self._write(req, pos)
            self.running.append(req)
        for req in list(self.running):
            if req not in self.running:
                continue  # preempted this step
            pos = req.length
            while self.pages_for(pos + 1) > len(req.pages) and req in self.running:
                page = self.pool.alloc(1)
                if page is None:  # preempt the newest (recompute)
                    victim = self.running.pop()
                    self._release(victim)
                    self.waiting.appendleft(victim)
                else:
                    req.pages += page
            if req not in self.running:
                continue
            self._attend(req, pos)
            req.out.append((pos * 31 + len(req.rid)) % 997)
            self._write(req, pos)  # the new token's KV
            if len(req.out) >= req.max_new:
                self.running.remove(req)
                self._release(req)
            elif len(req.out) == req.max_new - 1 and "early-free" in self.bugs:
                self.pool.free(req.pages)  # (planted) its last decode still reads them
                req.freed_early = set(req.pages)


@dataclass(frozen=True)
class PageToyConfig(ConfigBase):
    num_pages: int = 16
    page_size: int = 4
    max_running: int = 4
    shadow: bool = True
    bugs: frozenset = field(default_factory=frozenset)
    preset: str = "custom"
    target: str = "pagetoy"

    def __post_init__(self):
        object.__setattr__(self, "bugs", frozenset(self.bugs))

    @property
    def num_slots(self):
        return self.num_pages * self.page_size

    @property
    def context_len(self):
        return (self.num_pages - 1) * self.page_size


class PageToyTarget(Target):
    def __init__(self, config: PageToyConfig):
        self.config, self.steps, self.n = config, 0, 0
        self.engine = PageScheduler(config.num_pages, config.page_size, config.max_running, config.bugs)

    def pools(self):
        return [PoolSpec(POOL, self.engine.pool, "rows", self.config.page_size, self.config.num_pages - 1)]

    def framework_classes(self):
        return [PagePool]

    def apply(self, op):
        if isinstance(op, Submit):
            self.n += 1
            new = max(1, op.max_new_tokens)
            prompt = prompt_tokens(op.family, max(1, min(op.prompt_len, self.config.context_len - new)))
            self.engine.waiting.append(Req(f"r{self.n}", prompt, new))
        elif isinstance(op, Abort):
            live = [r.rid for r in (*self.engine.waiting, *self.engine.running)]
            for rid in (live if op.handle is None or not live else [live[op.handle % len(live)]]):
                self.engine.abort(rid)

    def step(self):
        self.engine.step()
        self.steps += 1

    def is_idle(self):
        return not (self.engine.waiting or self.engine.running)

    def roots(self, aborting=True):
        return [Root(POOL, f"req:{r.rid}", np.array(r.pages, dtype=np.int64), where="running")
                for r in self.engine.running]

    def accounting(self):  # in tokens: pages times page_size
        ps = self.config.page_size
        return {POOL: Accounting(available=len(self.engine.pool.free_pages) * ps, evictable=0, protected=0,
                                 session_held=0, total=(self.config.num_pages - 1) * ps)}

    def engine_check(self):
        held = len(self.engine.pool.free_pages) + sum(len(r.pages) for r in self.engine.running)
        return [] if held == self.config.num_pages - 1 else [f"[{POOL}] free + held = {held}"]

    def describe_busy(self):
        return f"{len(self.engine.waiting)} waiting, {len(self.engine.running)} running"

    # -- reads: the stale-KV shadow (docs/writing-a-target.md, "Reads: stale KV") --
    def kv_pools(self):
        return {"pages": self.config.num_pages * self.config.page_size} if self.config.shadow else {}

    def install_shadow(self, shadow, wrap, report):
        eng, ps = self.engine, self.config.page_size
        tags = lambda req: shadow.request_tags(req, req.prompt, req.out)  # noqa: E731
        slots = lambda req, n: np.array([req.pages[p // ps] * ps + p % ps for p in range(n)], dtype=np.int64)  # noqa: E731
        write, attend = eng._write, eng._attend

        def tagged_write(req, pos):
            write(req, pos)
            shadow.write("pages", slots(req, pos + 1)[pos:], tags(req)[pos:pos + 1])

        def checked_attend(req, pos):
            idx = slots(req, pos)
            bad = shadow.read("pages", idx, tags(req)[:pos])
            if bad is not None:
                report("pages", idx[bad[0]], f"req:{req.rid} reads KV {bad[1]}")
            return attend(req, pos)

        wrap(eng, "_write", tagged_write)
        wrap(eng, "_attend", checked_attend)


PRESETS = {p.name: p for p in [
    Preset("pagetoy", "16 pages of 4 tokens, 4 running, the stale-KV shadow on", {}, config_class=PageToyConfig),
    Preset("pagetoy-tight", "8 pages of 4 tokens: decode preempts", {"num_pages": 8}, config_class=PageToyConfig),
    Preset("pagetoy-roots", "pagetoy-tight without the shadow (ownership only)", {"num_pages": 8, "shadow": False},
           config_class=PageToyConfig),
]}

KIND = register(TargetKind(
    name="pagetoy", summary="a paged toy with a stale-KV shadow (tests/pagetoy_plugin.py)",
    config_class=PageToyConfig, presets=lambda: PRESETS, make=PageToyTarget, default_preset="pagetoy",
    bugs=lambda: {"abort-leak": "an abort of a running request forgets its pages",
                  "early-free": "a request's pages are freed one step before its last decode reads them"}))
