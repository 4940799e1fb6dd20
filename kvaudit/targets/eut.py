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
from kvaudit.program import Abort, FlushCache, HealthCheck, Op, Submit, prompt_tokens
from kvaudit.targets.base import Accounting, PoolSpec, Root


class EutTarget:
    name = "eut"

    def __init__(self, config: EngineConfig):
        self.config = config
        self.engine = Scheduler(config)
        self.steps = 0
        self.submitted: list[str] = []  # rids in submission order (handles index the live ones)
        self._finished: set[str] = set()
        self._seen_outputs = 0
        s = self.engine
        self._pools = [
            PoolSpec("token_to_kv_pool", s.token_to_kv_pool_allocator, "kv", config.page_size,
                     s.token_to_kv_pool_allocator.num_pages),
            PoolSpec("req_to_token_pool", s.req_to_token_pool, "rows", 1,
                     s.req_to_token_pool.size + s.req_to_token_pool.pre_alloc_size),
        ]
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
            self.submitted.append(eng.add_request(prompt_tokens(op.family, plen, cfg.vocab_size), max_new, stop))
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

        for req in eng.requests_owning_rows():
            kv, owner = req.kv, f"req:{req.rid}"
            row = table[kv.req_pool_idx, : kv.kv_allocated_len]
            out.append(Root("req_to_token_pool", owner, np.array([kv.req_pool_idx], dtype=np.int64)))
            out.append(Root("token_to_kv_pool", owner, pages(row[kv.cache_protected_len:])))
            if kv.cache_protected_len:
                out.append(Root("token_to_kv_pool", owner, pages(row[: kv.cache_protected_len]), private=False))
            if hs is not None:
                buf = hs.req_to_device_buffer.get(kv.req_pool_idx)
                if buf is not None:
                    out.append(Root("hisparse_device", owner, pages(buf)))
                host = hs.req_to_host_pool.get(kv.req_pool_idx)
                if host is not None:
                    out.append(Root("hisparse_host", owner, pages(host)))
        values = [n.value for n in eng.tree_cache.nodes()]
        if values:
            out.append(Root("token_to_kv_pool", "tree", pages(torch.cat(values)), role="tree"))
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
        for req in eng.requests_owning_rows():
            node = req.lock
            while node is not None and node is not tree.root_node:
                want[id(node)] = want.get(id(node), 0) + 1
                node = node.parent
        return [(f"node {n.id} ({len(n.key)} tokens)", n.value.cpu().numpy(), n.lock_ref, want.get(id(n), 0))
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
        acc = {"token_to_kv_pool": Accounting(a.available_size(), eng.tree_cache.evictable_size(),
                                              eng.tree_cache.protected_size(), 0, a.size)}
        rp = eng.req_to_token_pool
        acc["req_to_token_pool"] = Accounting(rp.available_size(), 0, 0, 0, rp.size + rp.pre_alloc_size)
        hs = eng.hisparse_coordinator
        if hs is not None:
            for name, pool in (("hisparse_device", hs.hisparse_attn_allocator), ("hisparse_host", hs.host_pool)):
                acc[name] = Accounting(pool.available_size(), 0, 0, 0, pool.size)
        return acc

    def engine_check(self) -> list[str]:
        return [c.message() for c in self.engine.check_memory() if not c.ok]
