"""The target protocol: everything kvaudit knows about an engine comes through one of these.

A target names its pools (objects whose alloc/free methods the hooks wrap), runs program ops,
and reports its *roots*: for each pool, which units each live owner references. Units are pages
for KV pools (``page_size`` tokens each) and rows for request pools.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np


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
    """

    pool: str
    owner: str
    units: np.ndarray
    private: bool = True
    role: str = "req"


@dataclass
class Accounting:
    """The engine's own counters for one pool, in tokens (rows for a row pool)."""

    available: int
    evictable: int
    protected: int
    session_held: int
    total: int


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
    #   lock_balance() -> [(node, slots, lock_ref, holders)]   mismatched tree locks;
    #   describe_busy() -> str                    what keeps the engine from idling (hang reports).


def kv_length_problems(reqs) -> list[str]:
    """SGLang invariant 6 for each live request ``reqs`` (objects with ``rid`` and ``kv``, a
    ``ReqKvInfo``): ``0 <= kv_committed_len <= kv_allocated_len``; one line per violation."""
    return [f"[req_to_token_pool] req:{r.rid} kv_committed_len={r.kv.kv_committed_len} > "
            f"kv_allocated_len={r.kv.kv_allocated_len}"
            for r in reqs if not 0 <= r.kv.kv_committed_len <= r.kv.kv_allocated_len]
