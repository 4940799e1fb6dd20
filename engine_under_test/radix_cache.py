"""Radix prefix cache over token ids, with lock references.

Modelled on SGLang 0.5.x ``srt/mem_cache/radix_cache.py`` (``RadixCache``, ``TreeNode``): keys are
token ids, values are KV slot indices (``[n] int64``); with ``page_size > 1`` keys and values are
page-aligned, so a request's partial last page always stays private to it. A node with
``lock_ref > 0`` (or below one) is *protected*; the other tree tokens are *evictable*.

A node whose ``value`` is None is *host-only* (its KV lives only in ``host_value``, see
:mod:`engine_under_test.hicache`); the base tree never makes one, but its match, insert, split and
integrity paths accept them. The device counters count only device-resident nodes.
"""

from __future__ import annotations

import heapq
import itertools
from typing import NamedTuple

import torch

from engine_under_test.memory import INDEX_DTYPE, PoolIntegrityError, TokenToKVPoolAllocator


class TreeNode:
    def __init__(self, node_id: int, parent: "TreeNode | None" = None):
        self.id = node_id  # from its tree's counter: the same program numbers its nodes the same in any run
        self.parent = parent
        self.children: dict[tuple, TreeNode] = {}
        self.key: tuple[int, ...] = ()
        self.value: torch.Tensor | None = None
        self.lock_ref = 0
        self.last_access_time = 0
        self.host_value: torch.Tensor | None = None  # [len(key)] int64 host slots (HiCache backup)
        self.host_ref = 0  # pins host_value against evict_host (HiCache load-back in flight)
        self.hit_count = 0  # inserts that passed this node (HiCache write-through threshold)

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, len={len(self.key)}, lock_ref={self.lock_ref})"


class MatchResult(NamedTuple):
    device_indices: torch.Tensor  # [matched_len] int64
    last_node: TreeNode  # deepest matched device-resident node (root if none)
    host_hit_length: int = 0  # tokens matched on host-only nodes beyond last_node (page-aligned)
    host_node: TreeNode | None = None  # deepest matched host-only node, None if none


def _head(t: torch.Tensor | None, n: int) -> torch.Tensor | None:
    return None if t is None else t[:n]


def _tail(t: torch.Tensor | None, n: int) -> torch.Tensor | None:
    return None if t is None else t[n:]


class RadixCache:
    """Prefix tree of KV slots. ``disable=True`` keeps the interface but caches nothing."""

    def __init__(self, allocator: TokenToKVPoolAllocator, page_size: int = 1, disable: bool = False,
                 bugs: frozenset[str] = frozenset()):
        self.allocator = allocator
        self.page_size = page_size
        self.disable = disable
        self.bugs = bugs
        self.device = allocator.device
        self._node_ids = itertools.count()  # NOTE: per tree, not per process (SGLang's is a class counter)
        self.reset()

    def reset(self) -> None:
        """Drop every node (SGLang ``reset``; the caller clears the allocator)."""
        self.root_node = TreeNode(next(self._node_ids))
        self.root_node.lock_ref = 1
        self.evictable_size_ = 0
        self.protected_size_ = 0
        self._clock = 0

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _child_key(self, key) -> tuple:
        return tuple(key[: self.page_size])

    def _match_len(self, a, b) -> int:
        n = 0
        for x, y in zip(a, b):
            if x != y:
                break
            n += 1
        return n // self.page_size * self.page_size

    def _empty(self) -> torch.Tensor:
        return torch.empty(0, dtype=INDEX_DTYPE, device=self.device)

    # -- lookup / insert ------------------------------------------------------------------
    def match_prefix(self, key: list[int]) -> MatchResult:
        """Longest cached page-aligned prefix of ``key``. May split a node; does not lock.

        ``device_indices``/``last_node`` cover the device-resident prefix; host-only nodes matched
        beyond it are reported as ``host_hit_length`` tokens ending at ``host_node``.
        """
        if self.disable:
            return MatchResult(self._empty(), self.root_node)
        key = key[: len(key) // self.page_size * self.page_size]
        node = dev_node = self.root_node
        values, host_len, now = [], 0, self._tick()
        while key and self._child_key(key) in node.children:
            child = node.children[self._child_key(key)]
            child.last_access_time = now
            n = self._match_len(child.key, key)
            split = n < len(child.key)
            if split:
                child = self._split_node(child, n)
            if child.value is None:  # host-only; its descendants are host-only too
                host_len += n
            else:
                values.append(child.value)
                dev_node = child
            node, key = child, key[n:]
            if split:
                break
        return MatchResult(torch.cat(values) if values else self._empty(), dev_node, host_len,
                           node if host_len else None)

    def insert(self, key: list[int], value: torch.Tensor) -> int:
        """Insert ``key`` -> ``value`` (``[m] int64``, ``m`` page-aligned, ``m <= len(key)``).

        ``key`` may be longer than ``value`` (a request's whole committed token list); it is cut to
        ``value.numel()`` tokens. A host-only node on the path adopts the caller's slots for its span.
        Returns the length of the device-resident prefix that was already cached: the caller owns
        the duplicate slots ``value[:returned]`` and must free the ones the tree did not take.
        """
        if self.disable:
            return 0
        untruncated = len(key)
        key = list(key[: value.numel()])
        value, cut = value[: len(key)], len(key)
        node, done, now, path = self.root_node, 0, self._tick(), []
        while key and self._child_key(key) in node.children:
            child = node.children[self._child_key(key)]
            child.last_access_time = now
            n = self._match_len(child.key, key)
            node = self._split_node(child, n) if n < len(child.key) else child
            if node.value is None:  # host-only (lock_ref 0, and so is all below): adopt the caller's slots
                node.value = value[:n].clone()
                self.evictable_size_ += n
            else:
                done += n
            key, value = key[n:], value[n:]
            path.append(node)
        if key:
            leaf = TreeNode(next(self._node_ids), node)
            leaf.key, leaf.value, leaf.last_access_time = tuple(key), value.clone(), now
            node.children[self._child_key(key)] = leaf
            if "evictable-size-uses-key-len" in self.bugs:
                # BUG (sglang PR #10637): evictable size was updated with the key length instead of
                # the value length
                self.evictable_size_ += len(key) + untruncated - cut  # the leaf's untruncated key
            else:
                self.evictable_size_ += len(key)
            path.append(leaf)
        for n in path:
            n.hit_count += 1
        self._inserted(path)
        return done

    def _inserted(self, path: list[TreeNode]) -> None:
        """Hook: ``path`` is every node the last insert walked or created, root side first."""

    def _split_node(self, child: TreeNode, n: int) -> TreeNode:
        """Cut ``child`` after ``n`` tokens; returns the new parent holding the first ``n``."""
        new = TreeNode(next(self._node_ids), child.parent)
        new.key, new.value, new.host_value = child.key[:n], _head(child.value, n), _head(child.host_value, n)
        new.lock_ref, new.host_ref, new.hit_count = child.lock_ref, child.host_ref, child.hit_count
        new.last_access_time = child.last_access_time
        new.children = {self._child_key(child.key[n:]): child}
        child.parent.children[self._child_key(new.key)] = new
        child.key, child.parent = child.key[n:], new
        child.value, child.host_value = _tail(child.value, n), _tail(child.host_value, n)
        return new

    # -- locks ----------------------------------------------------------------------------
    def _lock_start(self, node: TreeNode) -> TreeNode:
        if "radix-lock-skips-matched-node" in self.bugs and node is not self.root_node:
            # BUG (mini-sglang PR #52): locking started at the matched node's parent, so the node
            # a request reads stayed evictable and memory pressure could free it under the request.
            return node.parent
        return node

    def inc_lock_ref(self, node: TreeNode) -> None:
        """Lock the path root..node; a node going 0 -> 1 moves its tokens evictable -> protected."""
        if self.disable:
            return
        node = self._lock_start(node)
        while node is not self.root_node:
            if node.lock_ref == 0:
                self.evictable_size_ -= len(node.key)
                self.protected_size_ += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        if self.disable:
            return
        node = self._lock_start(node)
        while node is not self.root_node:
            if node.lock_ref == 1:
                self.evictable_size_ += len(node.key)
                self.protected_size_ -= len(node.key)
            node.lock_ref -= 1
            node = node.parent

    # -- eviction -------------------------------------------------------------------------
    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` evictable tokens, least recently used leaves first.

        Returns the number of tokens freed (may be less if not enough are evictable).
        """
        if self.disable:
            return 0

        def release(node: TreeNode) -> None:
            self.allocator.free(node.value)
            self.evictable_size_ -= len(node.key)
            del node.parent.children[self._child_key(node.key)]

        return self._evict_lru(num_tokens, lambda n: n is not self.root_node and not n.children and n.lock_ref == 0,
                               release)

    def _evict_lru(self, num_tokens: int, candidate, release) -> int:
        """Release ``candidate`` nodes, least recently used first, until ``num_tokens`` tokens are
        freed; a parent that becomes a candidate joins the queue. ``release(node)`` frees one node.
        Returns the tokens freed (fewer if the candidates run out)."""
        if num_tokens <= 0:
            return 0
        heap = [(n.last_access_time, n.id, n) for n in self.nodes() if candidate(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            release(node)
            freed += len(node.key)
            if candidate(node.parent):
                heapq.heappush(heap, (node.parent.last_access_time, node.parent.id, node.parent))
        return freed

    def evictable_size(self) -> int:
        return self.evictable_size_

    def protected_size(self) -> int:
        return self.protected_size_

    # -- walking --------------------------------------------------------------------------
    def nodes(self, start: TreeNode | None = None):
        """Every node below ``start`` (default: the root), parents before children."""
        stack = list((start or self.root_node).children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def total_size(self) -> int:
        """Device-resident tree tokens (host-only nodes are not counted)."""
        return sum(len(n.key) for n in self.nodes() if n.value is not None)

    def check_integrity(self) -> None:
        """Recount evictable/protected from the device-resident nodes; raise :class:`PoolIntegrityError`
        on a mismatch or on a node with a negative lock, a misaligned key, a value of the wrong
        length, or no KV anywhere (neither ``value`` nor ``host_value``)."""
        dev = [n for n in self.nodes() if n.value is not None]
        ev = sum(len(n.key) for n in dev if n.lock_ref == 0)
        pr = sum(len(n.key) for n in dev if n.lock_ref > 0)
        if (ev, pr) != (self.evictable_size_, self.protected_size_):
            raise PoolIntegrityError(
                f"[radix] counters evictable={self.evictable_size_} protected={self.protected_size_}"
                f" but nodes hold evictable={ev} protected={pr}")
        for n in self.nodes():
            held = n.value if n.value is not None else n.host_value
            if n.lock_ref < 0 or held is None or held.numel() != len(n.key) or len(n.key) % self.page_size:
                raise PoolIntegrityError(f"[radix] bad node {n!r}")
