"""HiCache: a host-memory tier under the radix tree (write-through / write-back, demote, load-back).

Modelled on SGLang 0.5.23 ``srt/mem_cache/unified_radix_cache.py`` (``init_hicache``,
``_execute_and_commit_kv_backup``, ``writing_check``, ``load_back``, ``evict_host``,
``check_hicache_events``) and ``srt/managers/cache_controller.py`` (``HiCacheController.write/load``).
Transfers are modelled as immediate copies whose *ack* arrives ``ack_latency`` scheduler steps later;
until then the node stays locked, as in SGLang.

A node is *device-resident* (``value`` holds ``[len(key)] int64`` device slots), possibly with a host
copy (``host_value``, ``[len(key)] int64`` host slots), or *host-only* (``value is None``). Host-only
nodes have only host-only descendants and ``lock_ref == 0``. All sizes are in tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine_under_test.memory import HostKVPool, MHATokenToKVPool, PoolIntegrityError, TokenToKVPoolAllocator
from engine_under_test.radix_cache import RadixCache, TreeNode

WRITE_POLICIES = ("write_through", "write_back")


@dataclass
class LoadBack:
    """An in-flight host->device load of ``num_tokens`` tokens ending at ``node`` (SGLang
    ``ongoing_load_back`` entry). ``node`` is device-locked and its path host-pinned until released."""
    node: TreeNode
    num_tokens: int
    ready_step: int
    released: bool = False


class HiRadixCache(RadixCache):
    """Radix cache with a host tier (SGLang ``UnifiedRadixCache`` with HiCache enabled).

    ``host_pool`` must be page-aligned like the device (``page_size % host_pool.page_size == 0``,
    else ``ValueError``). With ``kv_pool`` given, backups copy K/V device->host and load-backs
    host->device (``[layer, slot, heads, dim]`` buffers); without it only slot bookkeeping runs.
    """

    def __init__(self, allocator: TokenToKVPoolAllocator, page_size: int, host_pool: HostKVPool,
                 write_policy: str = "write_through", ack_latency: int = 2, bugs: frozenset[str] = frozenset(),
                 kv_pool: MHATokenToKVPool | None = None):
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"write_policy must be one of {WRITE_POLICIES}, got {write_policy!r}")
        if page_size % host_pool.page_size:
            raise ValueError(f"page_size={page_size} is not a multiple of host page_size={host_pool.page_size}")
        self.host_pool, self.kv_pool = host_pool, kv_pool
        self.write_policy, self.ack_latency = write_policy, ack_latency
        self.write_through_threshold = 1  # SGLang: 1 for write_through (2 for the selective policy)
        self.now = 0
        super().__init__(allocator, page_size, bugs=bugs)

    def reset(self) -> None:
        """Drop every node and in-flight record (the caller clears the device and host pools)."""
        super().reset()
        self.ongoing_write_through: dict[int, tuple[TreeNode, int]] = {}  # node.id -> (node, ack step)
        self.ongoing_load_back: dict[int, LoadBack] = {}  # node.id -> record

    # -- clock / events -----------------------------------------------------------------------------
    def check_hicache_events(self, now: int) -> None:
        """Advance the clock to scheduler step ``now``; ack (unlock) every write-through due by then."""
        self.now = now
        for nid, (node, ready) in list(self.ongoing_write_through.items()):
            if ready <= now:
                self.dec_lock_ref(node)
                del self.ongoing_write_through[nid]

    def has_inflight(self) -> bool:
        return bool(self.ongoing_write_through or self.ongoing_load_back)

    # -- transfers ----------------------------------------------------------------------------------
    def _copy(self, dst, dst_idx: torch.Tensor, src, src_idx: torch.Tensor) -> None:
        """Copy K and V of every layer from ``src[:, src_idx]`` to ``dst[:, dst_idx]`` (one index op each)."""
        if self.kv_pool is None:
            return
        for name in ("k_buffer", "v_buffer"):
            d, s = getattr(dst, name), getattr(src, name)
            d[:, dst_idx.to(d.device)] = s[:, src_idx.to(s.device)].to(d.device)

    def _backup(self, node: TreeNode, lock: bool) -> bool:
        """Give device node ``node`` a host copy; evict host leaves first if short. False if no room.

        ``lock``: write-through; the node stays locked until its ack at ``now + ack_latency``.
        """
        n = len(node.key)
        if n > self.host_pool.available_size():
            self.evict_host(n - self.host_pool.available_size())
        host = self.host_pool.alloc(n)
        if host is None:
            return False
        self._copy(self.host_pool, host, self.kv_pool, node.value)
        node.host_value = host
        if lock:
            self.inc_lock_ref(node)
            self.ongoing_write_through[node.id] = (node, self.now + self.ack_latency)
        return True

    def _inserted(self, path: list[TreeNode]) -> None:
        """Write-through: back up every node on the inserted path that has no host copy yet."""
        if self.write_policy != "write_through":
            return
        for node in path:
            if node.host_value is None and node.hit_count >= self.write_through_threshold:
                self._backup(node, lock=True)

    # -- device eviction ----------------------------------------------------------------------------
    def _device_leaf(self, node: TreeNode) -> bool:
        return (node is not self.root_node and node.value is not None and node.lock_ref == 0
                and all(c.value is None for c in node.children.values()))

    def _drop(self, node: TreeNode) -> None:
        """Delete ``node`` and its (host-only) subtree, freeing their host slots."""
        held = [n.host_value for n in (node, *self.nodes(node)) if n.host_value is not None]
        if held:
            self.host_pool.free(torch.cat(held))
        del node.parent.children[self._child_key(node.key)]

    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` device tokens from unlocked device leaves, LRU first.

        A leaf with a host copy is demoted to host-only; write_back first backs an uncopied leaf up
        (dropped if the host has no room); write_through drops an uncopied leaf. Returns tokens freed.
        """
        def demote(node: TreeNode) -> None:
            if node.host_value is None and self.write_policy == "write_back":
                self._backup(node, lock=False)
            self.allocator.free(node.value)
            self.evictable_size_ -= len(node.key)
            node.value = None
            if node.host_value is None:
                self._drop(node)

        return self._evict_lru(num_tokens, self._device_leaf, demote)

    # -- host eviction ------------------------------------------------------------------------------
    def _host_leaf(self, node: TreeNode) -> bool:
        return node is not self.root_node and node.value is None and not node.children and node.host_ref == 0

    def evict_host(self, num_tokens: int) -> int:
        """Free the host slots of at least ``num_tokens`` tokens of unpinned host-only leaves (LRU),
        deleting those nodes. Returns host tokens freed."""
        def drop(node: TreeNode) -> None:
            self.host_pool.free(node.host_value)
            del node.parent.children[self._child_key(node.key)]

        return self._evict_lru(num_tokens, self._host_leaf, drop)

    # -- load-back ----------------------------------------------------------------------------------
    def _pin_host(self, node: TreeNode, delta: int) -> None:
        while node is not self.root_node:
            node.host_ref += delta
            node = node.parent

    def load_back(self, host_node: TreeNode) -> LoadBack | None:
        """Bring the host-only nodes between the deepest device ancestor and ``host_node`` back to
        the device (one ``allocator.alloc``, evicting other device leaves if short).

        On success ``host_node`` is device-locked and its path host-pinned until
        :meth:`release_load_back`. Returns None, changing nothing, if the device has no room.
        Raises ``ValueError`` if ``host_node`` is not host-only.
        """
        if host_node is None or host_node.value is not None:
            raise ValueError(f"load_back needs a host-only node, got {host_node!r}")
        path, anc = [], host_node
        while anc is not self.root_node and anc.value is None:
            path.append(anc)
            anc = anc.parent
        path.reverse()
        num = sum(len(n.key) for n in path)
        self._pin_host(host_node, +1)  # keep the host copies through eviction's write-back
        self.inc_lock_ref(anc)  # keep the device ancestor through eviction
        if num > self.allocator.available_size():
            self.evict(num - self.allocator.available_size())
        dev = self.allocator.alloc(num)
        self.dec_lock_ref(anc)
        if dev is None:
            self._pin_host(host_node, -1)
            return None
        self._copy(self.kv_pool, dev, self.host_pool, torch.cat([n.host_value for n in path]))
        off = 0
        for n in path:
            n.value = dev[off : off + len(n.key)]
            off += len(n.key)
            self.evictable_size_ += len(n.key)
        self.inc_lock_ref(host_node)
        rec = LoadBack(host_node, num, self.now + self.ack_latency)
        self.ongoing_load_back[host_node.id] = rec
        return rec

    def load_back_ready(self, rec: LoadBack) -> bool:
        return self.now >= rec.ready_step

    def release_load_back(self, rec: LoadBack) -> None:
        """Drop the device lock and host pins of ``rec``. Raises ``RuntimeError`` on a second release
        or for a record that is not in flight (e.g. dropped by :meth:`reset`)."""
        if rec.released or self.ongoing_load_back.get(rec.node.id) is not rec:
            raise RuntimeError(f"load-back of {rec.node!r} released twice or not in flight")
        rec.released = True
        self.dec_lock_ref(rec.node)
        self._pin_host(rec.node, -1)
        del self.ongoing_load_back[rec.node.id]

    # -- host accounting ----------------------------------------------------------------------------
    def _host_nodes(self):
        return [n for n in self.nodes() if n.host_value is not None]

    def host_size(self) -> int:
        """Host tokens held by tree nodes."""
        return sum(len(n.key) for n in self._host_nodes())

    def host_protected_size(self) -> int:
        """Host tokens evict_host may not free now: pinned (``host_ref > 0``) or device-resident nodes."""
        return sum(len(n.key) for n in self._host_nodes() if n.host_ref > 0 or n.value is not None)

    def host_evictable_size(self) -> int:
        return self.host_size() - self.host_protected_size()

    def check_integrity(self) -> None:
        """Base device checks, then: host copies have key length; host-only nodes are unlocked with
        host-only children; ``host_ref >= 0``; no host slot is held twice or also free.
        Raises :class:`PoolIntegrityError`."""
        super().check_integrity()
        for n in self.nodes():
            if n.host_value is not None and n.host_value.numel() != len(n.key):
                raise PoolIntegrityError(f"[hicache] {n!r} host_value {n.host_value.numel()} != key {len(n.key)}")
            if n.host_ref < 0:
                raise PoolIntegrityError(f"[hicache] {n!r} host_ref={n.host_ref}")
            if n.value is None and (n.lock_ref or any(c.value is not None for c in n.children.values())):
                raise PoolIntegrityError(f"[hicache] host-only {n!r} is locked or has a device child")
        held = [n.host_value for n in self._host_nodes()]
        if not held:
            return
        held = torch.cat(held)
        dup = held.numel() - torch.unique(held).numel()
        free = int(torch.isin(held // self.host_pool.page_size, self.host_pool.free_pages).sum())
        if dup or free:
            raise PoolIntegrityError(f"[hicache] {held.numel()} host slots held by nodes: {dup} duplicate, "
                                     f"{free} also in the host free list")
