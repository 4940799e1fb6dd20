"""Tests for engine_under_test.hicache: write-through/back, demotion, host eviction, load-back, integrity."""

import pytest
import torch

from engine_under_test.hicache import HiRadixCache
from engine_under_test.memory import HostKVPool, MHATokenToKVPool, PoolIntegrityError, TokenToKVPoolAllocator

LAYERS, HEADS, DIM = 2, 1, 2


@pytest.fixture(params=[1, 4], ids=["ps1", "ps4"])
def ps(request):
    return request.param


def make(ps, dev_pages=8, host_pages=16, policy="write_through", ack=2):
    alloc = TokenToKVPoolAllocator(dev_pages * ps, ps)
    host = HostKVPool(host_pages * ps, ps, LAYERS, HEADS, DIM)
    kv = MHATokenToKVPool((dev_pages + 1) * ps, LAYERS, HEADS, DIM)
    return HiRadixCache(alloc, ps, host, write_policy=policy, ack_latency=ack, kv_pool=kv), alloc, host, kv


def toks(start, pages, ps):
    return list(range(start, start + pages * ps))


def put(tree, key):
    """Insert ``key`` with fresh device slots whose K is the token id; free the duplicates like the scheduler."""
    value = tree.allocator.alloc(len(key))
    tree.kv_pool.k_buffer[:, value] = torch.tensor(key, dtype=torch.float)[None, :, None, None]
    already = tree.insert(key, value)
    if already:
        tree.allocator.free(value[:already])
    return value, already


def check(tree, held_by_reqs=0):
    """Integrity plus both identities (device: nothing outside the tree unless ``held_by_reqs``)."""
    tree.check_integrity()
    a, h = tree.allocator, tree.host_pool
    assert a.available_size() + tree.evictable_size() + tree.protected_size() + held_by_reqs == a.size
    assert h.available_size() + tree.host_evictable_size() + tree.host_protected_size() == h.size
    assert tree.host_evictable_size() + tree.host_protected_size() == tree.host_size()


def settle(tree):
    tree.check_hicache_events(tree.now + tree.ack_latency)
    assert not tree.ongoing_write_through


# -- write-through -------------------------------------------------------------------------------

def test_write_through_backs_up_and_locks_until_ack(ps):
    tree, alloc, host, kv = make(ps, ack=2)
    tree.check_hicache_events(5)
    key = toks(10, 2, ps)
    value, _ = put(tree, key)
    (node,) = tree.root_node.children.values()
    assert node.host_value is not None and node.host_value.numel() == 2 * ps
    assert torch.equal(host.k_buffer[:, node.host_value], kv.k_buffer[:, value])  # copied D->H
    assert node.lock_ref == 1 and (tree.evictable_size(), tree.protected_size()) == (0, 2 * ps)
    assert tree.has_inflight() and tree.ongoing_write_through[node.id][1] == 7
    assert tree.evict(100) == 0  # locked until the ack
    check(tree)
    tree.check_hicache_events(6)
    assert node.lock_ref == 1
    tree.check_hicache_events(7)
    assert node.lock_ref == 0 and not tree.has_inflight()
    assert (tree.evictable_size(), tree.protected_size()) == (2 * ps, 0)
    assert host.available_size() == host.size - 2 * ps
    check(tree)


def test_write_through_backs_up_only_nodes_without_a_host_copy(ps):
    tree, alloc, host, _ = make(ps)
    put(tree, toks(0, 2, ps))
    settle(tree)
    put(tree, toks(0, 3, ps))  # the cached part already has a host copy
    assert list(tree.ongoing_write_through.values())[0][0].key == tuple(toks(2 * ps, 1, ps))
    assert host.size - host.available_size() == 3 * ps
    settle(tree)
    check(tree)


# -- demotion and match --------------------------------------------------------------------------

def test_eviction_demotes_to_host_only_and_frees_device(ps):
    tree, alloc, host, _ = make(ps)
    put(tree, toks(0, 3, ps))
    settle(tree)
    (node,) = tree.root_node.children.values()
    host_slots = node.host_value.clone()
    assert tree.evict(1) == 3 * ps
    assert node.value is None and torch.equal(node.host_value, host_slots)
    assert tree.root_node.children == {tree._child_key(node.key): node}  # kept, host-only
    assert alloc.available_size() == alloc.size and tree.evictable_size() == 0
    assert tree.total_size() == 0 and tree.host_size() == tree.host_evictable_size() == 3 * ps
    check(tree)


def test_match_reports_host_hit_length(ps):
    tree, _, _, _ = make(ps)
    put(tree, toks(0, 2, ps))
    settle(tree)
    put(tree, toks(0, 4, ps))
    settle(tree)
    tree.evict(2 * ps)  # demotes the tail (pages 2..3)
    m = tree.match_prefix(toks(0, 4, ps) + [999])
    assert m.device_indices.numel() == 2 * ps and m.last_node.key == tuple(toks(0, 2, ps))
    assert m.host_hit_length == 2 * ps and m.host_node.value is None
    m = tree.match_prefix(toks(0, 3, ps))  # stops inside the host-only node: split to the boundary
    assert m.host_hit_length == ps and len(m.host_node.key) == ps
    assert m.host_node.host_value.numel() == ps and m.host_node.parent is m.last_node
    assert tree.match_prefix(toks(0, 1, ps)).host_node is None
    check(tree)


# -- load-back -----------------------------------------------------------------------------------

def test_load_back_copies_and_locks_until_release(ps):
    tree, alloc, host, kv = make(ps)
    key = toks(100, 3, ps)
    put(tree, key)
    settle(tree)
    tree.evict(100)
    kv.k_buffer.zero_()  # the device copy is gone for good
    m = tree.match_prefix(key)
    rec = tree.load_back(m.host_node)
    assert rec.num_tokens == 3 * ps and rec.node is m.host_node and rec.ready_step == tree.now + 2
    node = rec.node
    assert node.value.numel() == 3 * ps and alloc.available_size() == alloc.size - 3 * ps
    assert kv.k_buffer[0, node.value, 0, 0].tolist() == [float(t) for t in key]  # H->D round trip
    assert torch.equal(kv.k_buffer[:, node.value], host.k_buffer[:, node.host_value])
    assert node.lock_ref == 1 and node.host_ref == 1 and tree.protected_size() == 3 * ps
    assert tree.host_protected_size() == 3 * ps and tree.host_evictable_size() == 0
    assert tree.match_prefix(key).device_indices.tolist() == node.value.tolist()
    assert tree.evict(100) == 0 and tree.evict_host(100) == 0 and tree.has_inflight()
    check(tree)
    assert not tree.load_back_ready(rec)
    tree.check_hicache_events(tree.now + 2)
    assert tree.load_back_ready(rec) and node.lock_ref == 1  # the ack does not release it
    tree.release_load_back(rec)
    assert node.lock_ref == 0 and node.host_ref == 0 and not tree.has_inflight()
    assert tree.evictable_size() == 3 * ps
    check(tree)
    with pytest.raises(RuntimeError, match="twice"):
        tree.release_load_back(rec)
    check(tree)


def test_load_back_loads_the_whole_host_path_under_a_device_prefix(ps):
    tree, alloc, _, _ = make(ps)
    put(tree, toks(0, 1, ps))
    put(tree, toks(0, 2, ps))
    put(tree, toks(0, 3, ps))
    settle(tree)
    tree.evict(2 * ps)  # pages 1 and 2 go host-only, page 0 stays
    m = tree.match_prefix(toks(0, 3, ps))
    assert m.device_indices.numel() == ps and m.host_hit_length == 2 * ps
    rec = tree.load_back(m.host_node)
    assert rec.num_tokens == 2 * ps
    assert tree.match_prefix(toks(0, 3, ps)).device_indices.numel() == 3 * ps
    assert m.last_node.host_ref == 1 and m.last_node.lock_ref == 1
    check(tree)
    tree.release_load_back(rec)
    check(tree)


def test_load_back_evicts_others_but_not_its_path_and_fails_cleanly(ps):
    tree, alloc, host, _ = make(ps, dev_pages=4)
    put(tree, toks(0, 1, ps))
    put(tree, toks(0, 3, ps))
    settle(tree)
    tree.evict(2 * ps)  # (0) on device, (1, 2) host-only
    other, _ = put(tree, toks(500, 2, ps))
    settle(tree)
    hn = tree.match_prefix(toks(0, 3, ps)).host_node
    rec = tree.load_back(hn)  # 1 page free, needs 2: evicts the other branch, not page 0
    assert rec is not None and tree.match_prefix(toks(500, 2, ps)).device_indices.numel() == 0
    assert tree.match_prefix(toks(0, 3, ps)).device_indices.numel() == 3 * ps
    check(tree)
    tree.release_load_back(rec)
    # now nothing fits: lock the loaded path, demote it partly, fill the device from outside
    tree.evict(2 * ps)
    tree.inc_lock_ref(tree.match_prefix(toks(0, 1, ps)).last_node)
    held = alloc.alloc(alloc.available_size() - ps)
    hn = tree.match_prefix(toks(0, 3, ps)).host_node
    snapshot = (alloc.available_size(), host.available_size(), tree.evictable_size(), tree.protected_size())
    assert tree.load_back(hn) is None
    assert snapshot == (alloc.available_size(), host.available_size(), tree.evictable_size(), tree.protected_size())
    assert hn.value is None and hn.host_ref == 0 and not tree.ongoing_load_back
    check(tree, held_by_reqs=held.numel())


def test_load_back_pins_its_host_path_against_write_back_eviction(ps):
    tree, alloc, host, kv = make(ps, dev_pages=2, host_pages=2, policy="write_back")
    a = toks(40, 1, ps)
    put(tree, a)
    tree.evict(100)  # a: host-only, 1 of 2 host pages used
    put(tree, toks(80, 2, ps))  # b fills the device, no host copy (write-back)
    kv.k_buffer.zero_()
    rec = tree.load_back(tree.match_prefix(a).host_node)
    # evicting b needs 2 host pages; the only host leaf is a, pinned: b is dropped instead
    assert rec is not None and not tree.match_prefix(toks(80, 2, ps)).device_indices.numel()
    assert tree.match_prefix(a).device_indices.tolist() == rec.node.value.tolist()
    assert kv.k_buffer[0, rec.node.value, 0, 0].tolist() == [float(t) for t in a]
    check(tree)
    tree.release_load_back(rec)
    check(tree)


def test_load_back_of_a_device_node_raises(ps):
    tree, _, _, _ = make(ps)
    put(tree, toks(0, 1, ps))
    with pytest.raises(ValueError):
        tree.load_back(tree.match_prefix(toks(0, 1, ps)).last_node)


# -- host eviction -------------------------------------------------------------------------------

def test_evict_host_frees_only_unpinned_host_only_leaves(ps):
    tree, alloc, host, _ = make(ps)
    put(tree, toks(0, 2, ps))
    put(tree, toks(100, 2, ps))
    put(tree, toks(200, 2, ps))
    settle(tree)
    tree.evict(4 * ps)  # (0..) and (100..) demoted: least recently used first
    assert tree.match_prefix(toks(200, 2, ps)).device_indices.numel() == 2 * ps  # still on device
    rec = tree.load_back(tree.match_prefix(toks(0, 2, ps)).host_node)  # pinned
    # only the (100..) leaf is host-only and unpinned; the loaded one and the device one stay
    assert tree.host_evictable_size() == 2 * ps
    assert tree.evict_host(100) == 2 * ps
    assert tree.match_prefix(toks(100, 2, ps)).host_hit_length == 0
    assert tree.host_size() == 4 * ps and host.available_size() == host.size - 4 * ps
    check(tree)
    tree.release_load_back(rec)
    assert tree.evict_host(100) == 0  # both remaining host copies back device nodes
    check(tree)


def test_evict_host_cascades_to_host_only_parents(ps):
    tree, _, host, _ = make(ps)
    put(tree, toks(0, 1, ps))
    put(tree, toks(0, 2, ps))
    settle(tree)
    tree.evict(100)
    assert tree.host_size() == 2 * ps and tree.evict_host(ps) == ps
    assert tree.host_size() == ps
    assert tree.evict_host(ps) == ps and not tree.root_node.children
    assert host.available_size() == host.size
    check(tree)


def test_host_pool_short_triggers_evict_host(ps):
    tree, alloc, host, _ = make(ps, host_pages=3)
    put(tree, toks(0, 2, ps))
    settle(tree)
    tree.evict(100)  # (0..) host-only, 1 host page left
    put(tree, toks(100, 2, ps))  # needs 2 host pages: evicts the old host-only leaf
    (node,) = tree.root_node.children.values()
    assert node.key == tuple(toks(100, 2, ps)) and node.host_value is not None
    assert tree.host_size() == 2 * ps
    check(tree)


def test_host_pool_too_small_skips_the_backup(ps):
    tree, alloc, host, _ = make(ps, host_pages=1)
    put(tree, toks(0, 2, ps))
    (node,) = tree.root_node.children.values()
    assert node.host_value is None and node.lock_ref == 0 and not tree.has_inflight()
    assert tree.evict(100) == 2 * ps and not tree.root_node.children  # write-through drops it
    check(tree)


def test_write_through_eviction_of_an_uncopied_node_drops_its_host_only_children(ps):
    tree, alloc, host, _ = make(ps)
    put(tree, toks(0, 1, ps))
    put(tree, toks(0, 2, ps))
    settle(tree)
    assert tree.evict(ps) == ps  # demotes the child
    parent = tree.root_node.children[tree._child_key(toks(0, 1, ps))]
    host.free(parent.host_value)  # pretend the parent's backup was skipped
    parent.host_value = None
    check(tree)
    assert tree.evict(ps) == ps  # drops the parent and the host-only child under it
    assert not tree.root_node.children and host.available_size() == host.size
    check(tree)


# -- write-back ----------------------------------------------------------------------------------

def test_write_back_backs_up_at_eviction(ps):
    tree, alloc, host, kv = make(ps, policy="write_back")
    key = toks(7, 2, ps)
    value, _ = put(tree, key)
    (node,) = tree.root_node.children.values()
    assert node.host_value is None and not tree.has_inflight() and node.lock_ref == 0
    assert tree.evict(1) == 2 * ps
    assert node.value is None and node.host_value is not None and node.lock_ref == 0
    assert host.k_buffer[0, node.host_value, 0, 0].tolist() == [float(t) for t in key]
    assert not tree.has_inflight()
    check(tree)


def test_write_back_without_host_room_drops(ps):
    tree, alloc, host, _ = make(ps, host_pages=1, policy="write_back")
    put(tree, toks(0, 2, ps))
    assert tree.evict(1) == 2 * ps and not tree.root_node.children
    assert host.available_size() == host.size
    check(tree)


# -- insert over host-only -----------------------------------------------------------------------

def test_insert_over_host_only_node_adopts_the_callers_slots(ps):
    tree, alloc, host, _ = make(ps)
    put(tree, toks(0, 1, ps))
    put(tree, toks(0, 3, ps))
    settle(tree)
    tree.evict(2 * ps)  # (0) device, (1, 2) host-only
    free_before = alloc.available_size()
    value = alloc.alloc(4 * ps)
    already = tree.insert(toks(0, 4, ps) + [12345], value)  # key longer than value
    assert already == ps  # only the device-resident page is a duplicate
    alloc.free(value[:already])
    m = tree.match_prefix(toks(0, 4, ps))
    assert m.device_indices.tolist()[ps:] == value[ps:].tolist() and m.host_hit_length == 0
    assert alloc.available_size() == free_before - 3 * ps
    # the new tail page is in write-through: its lock covers the whole path, adopted pages included
    assert tree.evictable_size() == 0 and tree.protected_size() == 4 * ps
    settle(tree)
    assert tree.evictable_size() == 4 * ps and tree.host_size() == 4 * ps
    check(tree)


# -- integrity, reset ----------------------------------------------------------------------------

def test_check_integrity_catches_a_duplicate_host_slot(ps):
    tree, _, _, _ = make(ps)
    put(tree, toks(0, 1, ps))
    put(tree, toks(100, 1, ps))
    settle(tree)
    tree.check_integrity()
    a, b = tree.root_node.children.values()
    b.host_value = a.host_value.clone()
    with pytest.raises(PoolIntegrityError, match="duplicate"):
        tree.check_integrity()


def test_check_integrity_catches_a_host_slot_in_the_free_list(ps):
    tree, _, host, _ = make(ps)
    put(tree, toks(0, 1, ps))
    settle(tree)
    host.free(next(iter(tree.root_node.children.values())).host_value)
    with pytest.raises(PoolIntegrityError, match="free list"):
        tree.check_integrity()


def test_check_integrity_catches_a_locked_host_only_node(ps):
    tree, _, _, _ = make(ps)
    put(tree, toks(0, 1, ps))
    settle(tree)
    tree.evict(100)
    next(iter(tree.root_node.children.values())).lock_ref = 1
    with pytest.raises(PoolIntegrityError, match="host-only"):
        tree.check_integrity()


def test_reset_clears_inflight_records(ps):
    tree, _, _, _ = make(ps)
    put(tree, toks(0, 1, ps))
    assert tree.has_inflight()
    settle(tree)
    tree.evict(100)
    rec = tree.load_back(tree.match_prefix(toks(0, 1, ps)).host_node)
    tree.reset()
    assert not tree.has_inflight() and not tree.root_node.children and tree.host_size() == 0
    with pytest.raises(RuntimeError, match="not in flight"):
        tree.release_load_back(rec)  # a stale record must not touch the new tree's counters
    assert (tree.evictable_size(), tree.protected_size()) == (0, 0)


def test_bad_arguments():
    alloc = TokenToKVPoolAllocator(16, 4)
    with pytest.raises(ValueError):
        HiRadixCache(alloc, 4, HostKVPool(16, 4, 1, 1, 1), write_policy="write_around")
    with pytest.raises(ValueError):
        HiRadixCache(alloc, 4, HostKVPool(16, 8, 1, 1, 1))
