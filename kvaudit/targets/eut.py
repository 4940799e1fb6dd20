"""The target for ``engine_under_test``.

Roots are read from the scheduler's own structures, the way SGLang's invariant checker finds
owners (``_requests_owning_rows``): live requests in the running batch, the last batch, the
waiting queue and the PD transfer queue; the radix tree's nodes; and, for HiSparse, the buffer
and host slots of *live* requests' rows. State the coordinator still keeps for a row that no
live request holds is, by construction, unreachable.
"""

from __future__ import annotations

import numpy as np
import torch

from engine_under_test import EngineConfig, Scheduler
from kvaudit.program import (Abort, CloseSession, FlushCache, HealthCheck, MemoryPressure, Op, OpenSession, Submit,
                             prompt_tokens)
from kvaudit.targets.base import Accounting, PoolSpec, Root


class EutTarget:
    name = "eut"

    def __init__(self, config: EngineConfig):
        self.config = config
        self.engine = Scheduler(config)
        self.steps = 0
        self.submitted: list[str] = []  # rids in submission order (handles index the live ones)
        self.prompts: dict[str, list[int]] = {}
        self.sessions: list[str] = []  # open session ids, in opening order
        self._finished: set[str] = set()
        self._seen_outputs = 0
        s = self.engine
        self._pools = [
            PoolSpec("token_to_kv_pool", s.token_to_kv_pool_allocator, "kv", config.page_size,
                     s.token_to_kv_pool_allocator.num_pages),
            PoolSpec("req_to_token_pool", s.req_to_token_pool, "rows", 1,
                     s.req_to_token_pool.size + s.req_to_token_pool.pre_alloc_size),
        ]
        if s.hicache_host_pool is not None:
            hp = s.hicache_host_pool
            self._pools.append(PoolSpec("hicache_host", hp, "kv", config.page_size, hp.num_pages))
        hs = s.hisparse_coordinator
        if hs is not None:
            self._pools += [
                PoolSpec("hisparse_device", hs.hisparse_attn_allocator, "kv", config.page_size,
                         hs.hisparse_attn_allocator.num_pages),
                PoolSpec("hisparse_host", hs.host_pool, "kv", config.page_size, hs.host_pool.num_pages),
            ]

    # -- driving ----------------------------------------------------------------------------
    def pools(self) -> list[PoolSpec]:
        return self._pools

    def live_rids(self) -> list[str]:
        outs = self.engine.finished_outputs
        for o in outs[self._seen_outputs:]:
            self._finished.add(o.rid)
        self._seen_outputs = len(outs)
        return [r for r in self.submitted if r not in self._finished]

    def apply(self, op: Op) -> None:
        cfg, eng = self.config, self.engine
        if isinstance(op, Submit):
            max_new = max(1, min(op.max_new_tokens, cfg.context_len // 2))
            plen = max(1, min(op.prompt_len, cfg.context_len - max_new))
            stop = None if op.stop_at is None else max(1, op.stop_at)
            prompt = prompt_tokens(op.family, plen, cfg.vocab_size)
            if op.extends is not None and self.submitted:
                prompt = (self._text(self.submitted[op.extends % len(self.submitted)]) + prompt)[: cfg.context_len - max_new]
            sid = self.sessions[op.session % len(self.sessions)] if op.session is not None and self.sessions else None
            rid = eng.add_request(prompt, max_new, stop, session_id=sid)
            self.submitted.append(rid)
            self.prompts[rid] = prompt
        elif isinstance(op, OpenSession):
            if cfg.enable_streaming_session:
                self.sessions.append(eng.open_session())
        elif isinstance(op, CloseSession):
            if self.sessions:
                eng.close_session(self.sessions.pop(op.handle % len(self.sessions)))
        elif isinstance(op, MemoryPressure):
            eng.memory_pressure()
        elif isinstance(op, HealthCheck):
            eng.health_check()
        elif isinstance(op, FlushCache):
            eng.request_flush_cache()
        elif isinstance(op, Abort):
            if op.handle is None:
                eng.abort_request(abort_all=True)
            else:
                live = self.live_rids()
                if live:
                    eng.abort_request(live[op.handle % len(live)])
        else:
            raise TypeError(f"op {op!r} does not go through apply()")

    def _text(self, rid: str) -> list[int]:
        """The prompt and output so far of submitted request ``rid`` (a session turn: its own input)."""
        eng = self.engine
        live = [r for r in eng.running_batch + eng.waiting_queue + (eng.last_batch.reqs if eng.last_batch else [])
                if r.rid == rid]
        if live:
            return live[0].fill_ids
        out = next((o.output_ids for o in eng.finished_outputs if o.rid == rid), [])
        return self.prompts[rid] + out

    def step(self) -> None:
        self.steps += 1
        self.engine.step()

    def is_idle(self) -> bool:
        return self.engine.is_fully_idle() and not self.engine.recv_queue

    # -- observing --------------------------------------------------------------------------
    owner_hint_vars = ("req",)  # only frames of functions with such a local are inspected
    owner_stop_vars = ("reqs", "batch")  # a function over a whole batch: ``req`` is a loop variable

    @staticmethod
    def owner_hint(frame_locals: dict) -> str | None:
        """Name the request an allocating engine frame works for (its local ``req``), or None."""
        rid = getattr(frame_locals.get("req"), "rid", None)
        return f"req:{rid}" if isinstance(rid, str) else None

    def roots(self) -> list[Root]:
        eng, ps = self.engine, self.config.page_size
        table = eng.req_to_token_pool.req_to_token
        out: list[Root] = []
        hs = eng.hisparse_coordinator

        def pages(slots: torch.Tensor) -> np.ndarray:
            slots = slots.cpu().numpy()
            return slots if ps == 1 else np.unique(slots // ps)

        def record(kv, owner: str, role: str) -> None:
            row = table[kv.req_pool_idx, : kv.kv_allocated_len]
            out.append(Root("req_to_token_pool", owner, np.array([kv.req_pool_idx], dtype=np.int64), role=role))
            out.append(Root("token_to_kv_pool", owner, pages(row[kv.cache_protected_len:]), role=role))
            if kv.cache_protected_len:
                out.append(Root("token_to_kv_pool", owner, pages(row[: kv.cache_protected_len]), private=False,
                                role=role))

        sc = eng.session_controller
        slots = [] if sc is None else sc.slots()
        for sid, slot in slots:
            record(slot.kv, f"session:{sid}", "session")
        held = {id(slot.kv) for _, slot in slots}
        for req in eng.requests_owning_rows():
            kv, owner = req.kv, f"req:{req.rid}"
            if id(kv) not in held:  # a turn on its session's record: the session root covers it
                record(kv, owner, "req")
            if hs is not None:
                row = kv.req_pool_idx
                for pool, held_slots in (("hisparse_device", hs.req_to_device_buffer.get(row)),
                                         ("hisparse_device", hs.req_prefill_physical.get(row)),
                                         ("hisparse_host", hs.req_to_host_pool.get(row))):
                    if held_slots is not None:
                        out.append(Root(pool, owner, pages(held_slots)))
        nodes = list(eng.tree_cache.nodes())
        values = [n.value for n in nodes if n.value is not None]
        if values:
            out.append(Root("token_to_kv_pool", "tree", pages(torch.cat(values)), role="tree"))
        host = [n.host_value for n in nodes if n.host_value is not None]
        if host and eng.hicache_host_pool is not None:
            out.append(Root("hicache_host", "tree", pages(torch.cat(host)), role="tree"))
        return out

    def lock_balance(self) -> list[tuple[str, np.ndarray, int, int]]:
        """Tree nodes whose ``lock_ref`` differs from the live lock holders whose path covers them.

        Returns ``(node, slots, lock_ref, holders)`` per mismatch (SGLang invariant: ``lock_ref``
        equals the number of live receipts whose anchor path covers the node). Holders are the live
        requests' ``lock`` nodes; this engine has no other lock holders yet.
        """
        eng = self.engine
        tree = eng.tree_cache
        if tree.disable:
            return []
        want: dict[int, int] = {}
        holders = [r.lock for r in eng.requests_owning_rows()]
        if eng.session_controller is not None:
            holders += [slot.lock for _, slot in eng.session_controller.slots()]
        if eng.hicache_host_pool is not None:  # in-flight copies hold locks until their ack
            holders += [node for node, _ in tree.ongoing_write_through.values()]
            holders += [r.load_back.node for r in eng.waiting_queue if r.load_back is not None]
            holders += [rec.node for rec in eng.orphan_load_backs]
        for node in holders:
            while node is not None and node is not tree.root_node:
                want[id(node)] = want.get(id(node), 0) + 1
                node = node.parent
        return [(f"node {n.id} ({len(n.key)} tokens)",
                 (n.value if n.value is not None else n.host_value).cpu().numpy(), n.lock_ref, want.get(id(n), 0))
                for n in tree.nodes() if n.lock_ref != want.get(id(n), 0)]

    def describe_busy(self) -> str:
        eng = self.engine
        return (f"waiting={len(eng.waiting_queue)} running={len(eng.running_batch)} "
                f"prealloc={len(eng.disagg_prealloc_queue)} transfer={len(eng.disagg_transfer_queue)} "
                f"available={eng.token_to_kv_pool_allocator.available_size()} "
                f"evictable={eng.tree_cache.evictable_size()} protected={eng.tree_cache.protected_size()}")

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
        return [c.message() for c in self.engine.check_memory() if not c.ok]
