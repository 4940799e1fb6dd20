"""A vLLM-style KV-cache memory manager in miniature: reference-counted blocks, a prefix hash map,
an LRU free queue where cached-but-free blocks count as free, and preemption by recompute.

Layers as in vLLM v1: ``Scheduler`` -> ``KVCacheManager`` -> ``BlockPool`` -> ``KVCacheBlock``
(facts from ``vllm/v1/core/sched/scheduler.py``, ``kv_cache_manager.py``, ``block_pool.py`` and
``kv_cache_utils.py``; the code is this repository's own). There is no model: the token sampled at a
position is a hash of the request id and the position, so outputs are deterministic and survive
preemption. This is "a user's own scheduler": it never imports kvaudit.
"""

from __future__ import annotations

import hashlib
import zlib
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

import numpy as np

BUGS = ("preempt-double-free", "abort-leak")
VOCAB_SIZE = 1000


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class MiniVllmConfig:
    """Sizes in blocks and tokens. Block 0 is the null block, so ``num_gpu_blocks - 1`` are usable.
    ``bugs`` switches on planted bugs by name (see :data:`BUGS`). Raises ValueError on bad values."""

    num_gpu_blocks: int = 32
    block_size: int = 4
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 32
    enable_prefix_caching: bool = True
    bugs: frozenset = frozenset()

    def __post_init__(self):
        object.__setattr__(self, "bugs", frozenset(self.bugs))
        unknown = sorted(self.bugs - set(BUGS))
        if unknown:
            raise ValueError(f"unknown bug names {unknown}; known: {list(BUGS)}")
        if self.num_gpu_blocks < 2:
            raise ValueError(f"num_gpu_blocks must be >= 2 (block 0 is reserved), got {self.num_gpu_blocks}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def hash_block_tokens(parent_hash: int, token_ids: Sequence[int]) -> int:
    """Hash of one full block, chained on its parent's hash (0 for the first block), so equal hashes
    mean equal prefixes (as ``kv_cache_utils.hash_block_tokens``). Returns a 63-bit int."""
    digest = hashlib.sha256(parent_hash.to_bytes(8, "little")
                            + np.asarray(token_ids, dtype=np.int64).tobytes()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def sample_token(request_id: str, position: int) -> int:
    """The stand-in for a model: the token at ``position`` of ``request_id``, in [0, VOCAB_SIZE)."""
    return zlib.crc32(f"{request_id}:{position}".encode()) % VOCAB_SIZE


class RequestStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_ABORTED = "finished_aborted"


class Request:
    """One request. ``num_computed_tokens`` counts tokens whose KV is in its blocks; ``block_hashes``
    holds the chained hash of every full block of ``all_token_ids`` (kept up to date on append)."""

    def __init__(self, request_id: str, prompt_token_ids: Sequence[int], max_tokens: int, block_size: int):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.max_tokens = max_tokens
        self.block_size = block_size
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.block_hashes: list[int] = []
        self._update_block_hashes()

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def append_output_token_id(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self._update_block_hashes()

    def _update_block_hashes(self) -> None:
        tokens, bs = self.all_token_ids, self.block_size
        while (len(self.block_hashes) + 1) * bs <= len(tokens):
            start = len(self.block_hashes) * bs
            parent = self.block_hashes[-1] if self.block_hashes else 0
            self.block_hashes.append(hash_block_tokens(parent, tokens[start:start + bs]))


class KVCacheBlock:
    """Metadata of one block. ``ref_cnt`` lives in the pool's array (one int64 per block), so the
    pool can hand out every count at once; ``block_hash`` is set while the block is cached."""

    __slots__ = ("block_id", "block_hash", "_ref_cnts")

    def __init__(self, block_id: int, ref_cnts: np.ndarray):
        self.block_id = block_id
        self.block_hash: int | None = None
        self._ref_cnts = ref_cnts

    @property
    def ref_cnt(self) -> int:
        return int(self._ref_cnts[self.block_id])

    @ref_cnt.setter
    def ref_cnt(self, value: int) -> None:
        self._ref_cnts[self.block_id] = value

    def __repr__(self) -> str:
        return f"KVCacheBlock(block_id={self.block_id}, ref_cnt={self.ref_cnt}, block_hash={self.block_hash})"


class BlockPool:
    """``num_gpu_blocks`` blocks; block 0 is the null block, never in the free queue and its count
    not kept (as vLLM's ``null_block``). The free queue (an OrderedDict: O(1) pop from the head and
    removal from the middle, where vLLM threads a doubly linked list through the blocks) holds every
    block with ref_cnt 0 in eviction order; a cached block stays in the hash map while it waits there
    and loses its hash only when ``get_new_blocks`` hands it out again."""

    def __init__(self, num_gpu_blocks: int):
        self.num_gpu_blocks = num_gpu_blocks
        self._ref_cnts = np.zeros(num_gpu_blocks, dtype=np.int64)
        self.blocks = [KVCacheBlock(i, self._ref_cnts) for i in range(num_gpu_blocks)]
        self.null_block = self.blocks[0]
        self.free_block_queue: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks[1:])
        self.cached_block_hash_to_block: dict[int, KVCacheBlock] = {}

    def get_num_free_blocks(self) -> int:
        """Blocks with ref_cnt 0, cached-but-free ones included."""
        return len(self.free_block_queue)

    def get_cached_block(self, block_hash: int) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop ``num_blocks`` from the head of the free queue, evict their hashes, set ref_cnt 1.
        Raises ValueError when too few are free. vLLM asserts here that the count was 0; this pool
        does not check, so a double free stays silent until the counts are read."""
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"cannot get {num_blocks} blocks, {self.get_num_free_blocks()} free")
        blocks = [self.free_block_queue.popitem(last=False)[1] for _ in range(num_blocks)]
        for block in blocks:
            self._maybe_evict_cached_block(block)
            block.ref_cnt = 1
        return blocks

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached_block_hash_to_block.get(block.block_hash) is block:
                del self.cached_block_hash_to_block[block.block_hash]
            block.block_hash = None

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """A prefix hit: +1 on each block, taking a cached-but-free one out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_block_queue[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """-1 on each block; those reaching 0 go to the queue's tail in the order given (first
        given, first evicted). Nothing checks for a second decrement (vLLM's does not either)."""
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0 and block is not self.null_block:
                self.free_block_queue[block.block_id] = block

    def cache_full_blocks(self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[int],
                          num_cached_blocks: int, num_full_blocks: int) -> None:
        """Give ``blocks[num_cached_blocks:num_full_blocks]`` their hashes and map them. A hash that is
        already mapped keeps its first block; the newer block stays unhashed (a simplification: vLLM
        keeps duplicates side by side)."""
        for i in range(num_cached_blocks, num_full_blocks):
            block, block_hash = blocks[i], block_hashes[i]
            if block.block_hash is None and block_hash not in self.cached_block_hash_to_block:
                block.block_hash = block_hash
                self.cached_block_hash_to_block[block_hash] = block

    def ref_counts(self) -> np.ndarray:
        """``[num_gpu_blocks] int64``, a copy; entry 0 (the null block) is always 0."""
        return self._ref_cnts.copy()

    def free_block_ids(self) -> np.ndarray:
        """``[num_free] int64`` block ids of the free queue, head (next evicted) first."""
        return np.fromiter(self.free_block_queue.keys(), dtype=np.int64, count=len(self.free_block_queue))


class KVCacheManager:
    """A request's blocks (``req_to_blocks``) on top of the pool: prefix hits, slot allocation, free."""

    def __init__(self, config: MiniVllmConfig):
        self.block_size = config.block_size
        self.enable_caching = config.enable_prefix_caching
        self.block_pool = BlockPool(config.num_gpu_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_block: dict[str, int] = {}

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest run of cached full blocks matching the request's prefix, and its length in
        tokens. The last token is always left to compute (its logits are needed). Mutates nothing."""
        if not self.enable_caching:
            return [], 0
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:(request.num_tokens - 1) // self.block_size]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Sequence[KVCacheBlock] = ()) -> list[KVCacheBlock] | None:
        """Blocks for ``num_new_tokens`` more tokens after the computed ones and the prefix hits
        ``new_computed_blocks``. Returns the new blocks, or None (changing nothing) when too few are
        free; hits waiting in the free queue do not count as free for this request."""
        if num_new_tokens <= 0:
            raise ValueError(f"num_new_tokens must be > 0, got {num_new_tokens}")
        rid, bs = request.request_id, self.block_size
        num_held = len(self.req_to_blocks.get(rid, ()))
        num_computed_tokens = request.num_computed_tokens + len(new_computed_blocks) * bs
        num_required = cdiv(num_computed_tokens + num_new_tokens, bs)
        num_new_blocks = max(num_required - num_held - len(new_computed_blocks), 0)
        num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks > self.block_pool.get_num_free_blocks() - num_evictable_hits:
            return None
        self.block_pool.touch(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        req_blocks = self.req_to_blocks.setdefault(rid, [])
        req_blocks.extend(new_computed_blocks)
        req_blocks.extend(new_blocks)
        if self.enable_caching:
            num_full = min(num_computed_tokens + num_new_tokens, request.num_tokens) // bs
            self.block_pool.cache_full_blocks(req_blocks, request.block_hashes,
                                              self.num_cached_block.get(rid, 0), num_full)
            self.num_cached_block[rid] = num_full
        return new_blocks

    def free(self, request: Request) -> None:
        """Free the request's blocks tail first, so its last blocks are evicted first."""
        self.num_cached_block.pop(request.request_id, None)
        self.block_pool.free_blocks(reversed(self.req_to_blocks.pop(request.request_id, [])))


class SchedulerOutput(NamedTuple):
    num_scheduled_tokens: dict[str, int]
    preempted_req_ids: list[str]
    finished_req_ids: list[str]


class Scheduler:
    """Continuous batching over one token budget per step: running requests first (preempting the
    last-admitted running request by recompute when blocks run out), then waiting requests with
    their prefix hits, unless this step preempted. ``requests`` holds every unfinished request."""

    def __init__(self, config: MiniVllmConfig | None = None):
        self.config = config or MiniVllmConfig()
        self.kv_cache_manager = KVCacheManager(self.config)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], max_tokens: int) -> None:
        """Queue a request. Raises ValueError on a duplicate id, an empty prompt, max_tokens < 1, or a
        request that could never fit in the pool alone."""
        if request_id in self.requests:
            raise ValueError(f"request {request_id!r} already exists")
        if not prompt_token_ids or max_tokens < 1:
            raise ValueError("a request needs a prompt and max_tokens >= 1")
        need = cdiv(len(prompt_token_ids) + max_tokens, self.config.block_size)
        if need > self.config.num_gpu_blocks - 1:
            raise ValueError(f"request needs {need} blocks, the pool has {self.config.num_gpu_blocks - 1}")
        request = Request(request_id, prompt_token_ids, max_tokens, self.config.block_size)
        self.requests[request_id] = request
        self.waiting.append(request)

    def abort_request(self, request_id: str) -> None:
        """End a waiting or running request and free its blocks; an unknown id is ignored."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        (self.running if request.status == RequestStatus.RUNNING else self.waiting).remove(request)
        request.status = RequestStatus.FINISHED_ABORTED
        if "abort-leak" not in self.config.bugs:
            self.kv_cache_manager.free(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> SchedulerOutput:
        """Schedule one batch, "run" it (append a sampled token to each request whose tokens are all
        computed) and finish requests at ``max_tokens``, freeing their blocks."""
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, int] = {}
        preempted: list[str] = []
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new_tokens = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._allocate_or_preempt(request, num_new_tokens, preempted):
                break
            scheduled[request.request_id] = num_new_tokens
            budget -= num_new_tokens
            i += 1
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            hits, num_hit_tokens = self.kv_cache_manager.get_computed_blocks(request)
            num_new_tokens = min(request.num_tokens - num_hit_tokens, budget)
            if self.kv_cache_manager.allocate_slots(request, num_new_tokens, hits) is None:
                break
            self.waiting.popleft()
            request.num_computed_tokens = num_hit_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled[request.request_id] = num_new_tokens
            budget -= num_new_tokens
        return SchedulerOutput(scheduled, preempted, self._update_from_output(scheduled))

    def _allocate_or_preempt(self, request: Request, num_new_tokens: int, preempted: list[str]) -> bool:
        while self.kv_cache_manager.allocate_slots(request, num_new_tokens) is None:
            victim = self.running.pop()
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        blocks = self.kv_cache_manager.req_to_blocks.get(request.request_id, [])
        self.kv_cache_manager.free(request)
        if "preempt-double-free" in self.config.bugs:
            self.kv_cache_manager.block_pool.free_blocks(reversed(blocks))
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.waiting.appendleft(request)

    def _update_from_output(self, scheduled: dict[str, int]) -> list[str]:
        finished = []
        for request in [r for r in self.running if r.request_id in scheduled]:
            request.num_computed_tokens += scheduled[request.request_id]
            if request.num_computed_tokens < request.num_tokens:
                continue  # a chunked prefill goes on next step
            request.append_output_token_id(sample_token(request.request_id, request.num_tokens))
            if len(request.output_token_ids) >= request.max_tokens:
                self.running.remove(request)
                request.status = RequestStatus.FINISHED_STOPPED
                self.kv_cache_manager.free(request)
                del self.requests[request.request_id]
                finished.append(request.request_id)
        return finished
