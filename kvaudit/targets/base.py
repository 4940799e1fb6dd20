"""The target protocol: everything kvaudit knows about an engine comes through one of these.

A target names its pools (objects whose alloc/free methods the hooks wrap), runs program ops,
and reports its *roots*: for each pool, which units each live owner references. Units are pages
for KV pools (``page_size`` tokens each) and rows for request pools.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable, NamedTuple, Protocol

import numpy as np
import torch


@dataclass(frozen=True)
class PoolSpec:
    """A pool the hooks wrap. ``kind`` is ``"kv"`` (token slots, allocator API
    ``alloc``/``alloc_extend``/``alloc_decode``/``free``/``free_group_*``) or ``"rows"``
    (``alloc(n) -> list[int]``/``free(rows)``). ``num_units`` excludes the reserved unit 0."""

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
    """The engine's own counters for one pool, in tokens (rows for a row pool)."""

    available: int
    evictable: int
    protected: int
    session_held: int
    total: int


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


class Recount(NamedTuple):
    """One accounting term recomputed from the structure it describes, for the drift oracle.

    ``tokens``: the term (tokens; rows for a row pool) as counted from the structure; ``counter``:
    whose counter the engine keeps for it (``"tree"``, ``"host tree"``); ``source``: what was counted,
    phrased to follow "but" (``"its nodes with lock_ref 0"``).
    """

    tokens: int
    counter: str
    source: str


class Target(Protocol):
    config: object
    steps: int

    def pools(self) -> list[PoolSpec]: ...

    def apply(self, op) -> None:
        """Deliver a non-advancing op (submit, health check, abort) to the engine."""

    def step(self) -> None:
        """One scheduler iteration."""

    def is_idle(self) -> bool: ...

    def roots(self) -> list[Root]: ...

    def accounting(self) -> dict[str, Accounting]: ...

    def engine_check(self) -> list[str]:
        """The engine's own verdict (failing identity lines), for the report."""

    # Optional, used when present:
    #   owner_hint(frame_locals) -> str | None   name the owner an allocating frame works for;
    #   owner_hint_vars / owner_stop_vars         locals that make a frame worth reading / a
    #                                             batch-level frame with no single owner;
    #   lock_balance() -> [LockImbalance]         mismatched tree locks (device and host);
    #   lock_holders() -> [(lock, holder, node id)]  every live lock receipt, named ("req:7",
    #                                             "hicache load-back for req:7"): the lock-ref ledger
    #                                             pairs incs with them (kvaudit.locks);
    #   describe_busy() -> str                    what keeps the engine from idling (hang reports);
    #   install_pool(spec, auditor, wrap)          wrap a pool whose API differs from the PoolSpec kinds'
    #                                             (the auditor's wrap_rows/wrap_clear/on_alloc/on_free);
    #   framework_files() / engine_files()         allocator-internal files no site starts in / files
    #                                             under kvaudit/ that play the engine (a driver);
    #   free_lists() -> {pool: [n] int64}          the engine's free lists, checked against the event log;
    #   recount() -> {pool: {term: Recount}}       accounting terms (``evictable``, ``protected``, fields of
    #                                             :class:`Accounting`) recounted from the structure they
    #                                             describe (tree nodes and their lock refs, host copies),
    #                                             compared with the engine's counters after every check;
    #   install_insert_check(wrap, report)         wrap the tree's insert: for each request KV inserted,
    #                                             ``report(owner, inserted, committed)`` (tokens), so that
    #                                             the tree never caches more of a request than it committed;
    #   paused -> bool                            a pause is in force: idle() sends continue_generation first;
    #   close()                                   the run is over: release outside resources (files);
    #   on_intake(callback), quiescence(), flushed(), progress(), stalled(), metrics_check(),
    #   retraction() -> str | None                what the last decode retraction freed and why it
    #                                             stopped (an out-of-memory crash report shows it);
    #   units_of_rows(rows), install_lock_ledger(wrap, record) (record(node id, +1/-1, lock="device"|"host")),
    #   install_shadow(shadow, wrap, report).


def kv_length_problems(reqs) -> list[str]:
    """SGLang invariant 6 for each live request ``reqs`` (objects with ``rid`` and ``kv``, a
    ``ReqKvInfo``): ``0 <= kv_committed_len <= kv_allocated_len``; one line per violation."""
    return [f"[req_to_token_pool] req:{r.rid} kv_committed_len={r.kv.kv_committed_len} > "
            f"kv_allocated_len={r.kv.kv_allocated_len}"
            for r in reqs if not 0 <= r.kv.kv_committed_len <= r.kv.kv_allocated_len]


def slot_pages(slots: torch.Tensor, page_size: int) -> np.ndarray:
    """Token slots (``[n]`` int tensor, any device) as units: the slots themselves with page size 1,
    else the sorted distinct pages (``[m] int64``)."""
    s = slots.to(torch.int64).cpu().numpy()
    return s if page_size == 1 else np.unique(s // page_size)


def record_roots(table: torch.Tensor, kv, owner: str, role: str, page_size: int, where: str = "") -> list[Root]:
    """The roots of one KV record (``ReqKvInfo``: ``req_pool_idx``, ``cache_protected_len``,
    ``kv_allocated_len``) in ``req_to_token`` ``table``: its row, its own KV
    ``[cache_protected_len, kv_allocated_len)`` (private) and the tree-owned prefix before it (shared)."""
    row = table[kv.req_pool_idx, : kv.kv_allocated_len]
    out = [Root("req_to_token_pool", owner, np.array([kv.req_pool_idx], dtype=np.int64), role=role, where=where),
           Root("token_to_kv_pool", owner, slot_pages(row[kv.cache_protected_len:], page_size), role=role,
                where=where)]
    if kv.cache_protected_len:
        out.append(Root("token_to_kv_pool", owner, slot_pages(row[: kv.cache_protected_len], page_size),
                        private=False, role=role))
    return out


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
