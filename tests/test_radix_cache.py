"""Tests for engine_under_test.radix_cache: match/insert, splitting, locks, eviction, integrity."""

import pytest
import torch

from engine_under_test.memory import PoolIntegrityError, TokenToKVPoolAllocator
from engine_under_test.radix_cache import RadixCache


@pytest.fixture
def make_tree():
    def make(size=64, page_size=1, disable=False):
        alloc = TokenToKVPoolAllocator(size, page_size)
        return RadixCache(alloc, page_size, disable=disable), alloc
    return make


def put(tree, alloc, key):
    """Insert ``key`` with fresh slots the way the scheduler does; free the duplicates. Returns the
    value stored for ``key`` (tree slots for the cached part, fresh slots after it) and the cached length."""
    value = alloc.alloc(len(key))
    already = tree.insert(key, value)
    if already:
        alloc.free(value[:already])
    return tree.match_prefix(key).device_indices, already


def check_counters(tree):
    tree.check_integrity()
    assert tree.evictable_size() + tree.protected_size() == tree.total_size()


# -- match / insert ------------------------------------------------------------------------------

def test_empty_tree_matches_nothing(make_tree):
    tree, _ = make_tree()
    m = tree.match_prefix([1, 2, 3])
    assert m.device_indices.numel() == 0
    assert m.last_node is tree.root_node


def test_insert_returns_already_cached_length(make_tree):
    tree, alloc = make_tree()
    _, already = put(tree, alloc, [1, 2, 3])
    assert already == 0
    _, already = put(tree, alloc, [1, 2, 3])
    assert already == 3
    _, already = put(tree, alloc, [1, 2, 3, 4, 5])
    assert already == 3
    _, already = put(tree, alloc, [1, 2, 9])
    assert already == 2
    assert tree.total_size() == 3 + 2 + 1
    assert tree.evictable_size() == 6
    assert alloc.available_size() == 64 - 6  # duplicates were given back
    check_counters(tree)


def test_match_returns_inserted_values(make_tree):
    tree, alloc = make_tree()
    value = alloc.alloc(4)
    tree.insert([1, 2, 3, 4], value)
    m = tree.match_prefix([1, 2, 3, 4, 5, 6])
    assert m.device_indices.tolist() == value.tolist()
    assert m.last_node.key == (1, 2, 3, 4)
    assert tree.match_prefix([2, 3]).device_indices.numel() == 0


def test_match_inside_a_node_splits_it(make_tree):
    tree, alloc = make_tree()
    value = alloc.alloc(4)
    tree.insert([1, 2, 3, 4], value)
    m = tree.match_prefix([1, 2, 9])
    assert m.device_indices.tolist() == value[:2].tolist()
    assert m.last_node.key == (1, 2)
    (child,) = m.last_node.children.values()
    assert child.key == (3, 4) and child.value.tolist() == value[2:].tolist()
    assert child.parent is m.last_node and m.last_node.parent is tree.root_node
    assert tree.total_size() == 4
    check_counters(tree)


def test_insert_diverging_key_splits_and_adds_a_leaf(make_tree):
    tree, alloc = make_tree()
    put(tree, alloc, [1, 2, 3, 4])
    _, already = put(tree, alloc, [1, 2, 5, 6])
    assert already == 2
    (mid,) = tree.root_node.children.values()
    assert mid.key == (1, 2)
    assert sorted(c.key for c in mid.children.values()) == [(3, 4), (5, 6)]
    assert tree.match_prefix([1, 2, 5, 6]).device_indices.numel() == 4
    check_counters(tree)


def test_insert_a_prefix_of_a_cached_key_splits(make_tree):
    tree, alloc = make_tree()
    put(tree, alloc, [1, 2, 3, 4])
    _, already = put(tree, alloc, [1, 2])
    assert already == 2
    assert tree.total_size() == 4
    check_counters(tree)


def test_node_ids_are_numbered_per_tree_so_a_replay_names_the_same_nodes(make_tree):
    # (tester 61a A9: ids came from one process-wide counter, so `fuzz` reported "node 986" where `replay`
    # of its file said "node 3")
    ids = []
    for _ in range(2):
        tree, alloc = make_tree()
        put(tree, alloc, [1, 2, 3, 4])
        put(tree, alloc, [1, 2, 9])  # splits [1, 2, 3, 4]: a new parent and a leaf
        ids.append(sorted(n.id for n in tree.nodes()))
    assert ids[0] == ids[1] == [1, 2, 3]  # (the root is 0)


# -- pages ---------------------------------------------------------------------------------------

def test_page_aligned_match(make_tree):
    tree, alloc = make_tree(page_size=4)
    value = alloc.alloc(8)
    tree.insert(list(range(10, 18)), value)
    assert tree.match_prefix(list(range(10, 17))).device_indices.numel() == 4  # 7 tokens -> 1 page
    assert tree.match_prefix(list(range(10, 18))).device_indices.tolist() == value.tolist()
    diverge_mid_page = [10, 11, 12, 13, 14, 15, 99, 98]
    assert tree.match_prefix(diverge_mid_page).device_indices.tolist() == value[:4].tolist()
    assert tree.match_prefix([10, 11, 12]).device_indices.numel() == 0
    check_counters(tree)


def test_page_aligned_insert_splits_on_page_boundary(make_tree):
    tree, alloc = make_tree(page_size=4)
    put(tree, alloc, list(range(10, 18)))
    _, already = put(tree, alloc, [10, 11, 12, 13, 14, 15, 99, 98])
    assert already == 4
    assert all(len(n.key) % 4 == 0 for n in tree.nodes())
    assert tree.total_size() == 12
    assert alloc.available_size() == 64 - 12
    check_counters(tree)


def test_page_keys_differing_in_first_page_are_siblings(make_tree):
    tree, alloc = make_tree(page_size=4)
    put(tree, alloc, [1, 2, 3, 4])
    _, already = put(tree, alloc, [1, 2, 3, 5])
    assert already == 0
    assert len(tree.root_node.children) == 2
    check_counters(tree)


# -- locks ---------------------------------------------------------------------------------------

def test_lock_moves_path_to_protected_and_back(make_tree):
    tree, alloc = make_tree()
    put(tree, alloc, [1, 2, 3, 4])
    put(tree, alloc, [1, 2, 5])
    node = tree.match_prefix([1, 2, 3, 4]).last_node
    assert tree.evictable_size() == 5 and tree.protected_size() == 0
    tree.inc_lock_ref(node)
    assert (tree.evictable_size(), tree.protected_size()) == (1, 4)  # (1,2) and (3,4); (5) stays evictable
    check_counters(tree)
    tree.inc_lock_ref(node)  # second lock: nothing moves
    assert (tree.evictable_size(), tree.protected_size()) == (1, 4)
    tree.dec_lock_ref(node)
    assert (tree.evictable_size(), tree.protected_size()) == (1, 4)
    tree.dec_lock_ref(node)
    assert (tree.evictable_size(), tree.protected_size()) == (5, 0)
    assert tree.root_node.lock_ref == 1
    check_counters(tree)


def test_sibling_locks_share_the_parent(make_tree):
    tree, alloc = make_tree()
    put(tree, alloc, [1, 2, 3])
    put(tree, alloc, [1, 2, 4])
    a = tree.match_prefix([1, 2, 3]).last_node
    b = tree.match_prefix([1, 2, 4]).last_node
    tree.inc_lock_ref(a)
    tree.inc_lock_ref(b)
    assert a.parent.lock_ref == 2
    tree.dec_lock_ref(a)
    assert (tree.evictable_size(), tree.protected_size()) == (1, 3)
    check_counters(tree)


def test_splitting_a_locked_node_keeps_counters(make_tree):
    tree, alloc = make_tree()
    put(tree, alloc, [1, 2, 3, 4])
    leaf = tree.match_prefix([1, 2, 3, 4]).last_node
    tree.inc_lock_ref(leaf)
    tree.match_prefix([1, 2, 9])  # splits the locked node
    assert leaf.parent is not tree.root_node and leaf.parent.lock_ref == 1
    check_counters(tree)
    tree.dec_lock_ref(leaf)
    assert (tree.evictable_size(), tree.protected_size()) == (4, 0)
    check_counters(tree)


# -- eviction ------------------------------------------------------------------------------------

def test_evict_frees_only_unlocked_leaves(make_tree):
    tree, alloc = make_tree()
    put(tree, alloc, [1, 2, 3, 4])
    put(tree, alloc, [1, 2, 5, 6, 7])
    put(tree, alloc, [8, 9])
    locked = tree.match_prefix([1, 2, 3, 4]).last_node
    tree.inc_lock_ref(locked)
    before = alloc.available_size()
    freed = tree.evict(100)
    assert freed == 5  # (5, 6, 7) and (8, 9)
    assert alloc.available_size() == before + 5
    assert tree.evictable_size() == 0 and tree.protected_size() == 4
    assert tree.match_prefix([1, 2, 3, 4]).device_indices.numel() == 4
    assert tree.match_prefix([8, 9]).device_indices.numel() == 0
    check_counters(tree)
    alloc.check_integrity()


def test_evict_removes_a_parent_once_its_children_are_gone(make_tree):
    tree, alloc = make_tree()
    put(tree, alloc, [1, 2, 3])
    put(tree, alloc, [1, 2, 4])
    assert tree.evict(3) == 4
    assert tree.total_size() == 0 and not tree.root_node.children
    assert alloc.available_size() == 64


def test_evict_least_recently_used_first(make_tree):
    tree, alloc = make_tree()
    put(tree, alloc, [1, 2])
    put(tree, alloc, [3, 4])
    tree.match_prefix([1, 2])  # touch the older one
    assert tree.evict(1) == 2
    assert tree.match_prefix([1, 2]).device_indices.numel() == 2
    assert tree.match_prefix([3, 4]).device_indices.numel() == 0


def test_evict_nothing(make_tree):
    tree, alloc = make_tree()
    put(tree, alloc, [1, 2])
    assert tree.evict(0) == 0
    tree.inc_lock_ref(tree.match_prefix([1, 2]).last_node)
    assert tree.evict(10) == 0
    assert alloc.available_size() == 62


def test_evict_page_size_4_returns_pages(make_tree):
    tree, alloc = make_tree(size=32, page_size=4)
    put(tree, alloc, list(range(10, 18)))
    assert alloc.available_size() == 24
    assert tree.evict(1) == 8
    assert alloc.available_size() == 32
    alloc.check_integrity()


# -- disabled tree and integrity -----------------------------------------------------------------

def test_disabled_tree_caches_nothing(make_tree):
    tree, alloc = make_tree(disable=True)
    value = alloc.alloc(3)
    assert tree.insert([1, 2, 3], value) == 0
    m = tree.match_prefix([1, 2, 3])
    assert m.device_indices.numel() == 0 and m.last_node is tree.root_node
    tree.inc_lock_ref(m.last_node)
    tree.dec_lock_ref(m.last_node)
    assert tree.evict(10) == 0
    assert (tree.evictable_size(), tree.protected_size(), tree.total_size()) == (0, 0, 0)
    assert alloc.available_size() == 61  # the tree never took or freed the slots


def test_check_integrity_catches_corrupted_counter(make_tree):
    tree, alloc = make_tree()
    put(tree, alloc, [1, 2, 3])
    tree.check_integrity()
    tree.evictable_size_ += 1
    with pytest.raises(PoolIntegrityError, match="evictable"):
        tree.check_integrity()


def test_check_integrity_catches_lock_without_counter_move(make_tree):
    tree, alloc = make_tree()
    put(tree, alloc, [1, 2, 3])
    tree.match_prefix([1, 2, 3]).last_node.lock_ref = 1  # locked behind the counters' back
    with pytest.raises(PoolIntegrityError):
        tree.check_integrity()


def test_check_integrity_catches_bad_node_value(make_tree):
    tree, alloc = make_tree()
    put(tree, alloc, [1, 2, 3])
    node = tree.match_prefix([1, 2, 3]).last_node
    node.value = torch.tensor([5, 6])
    with pytest.raises(PoolIntegrityError, match="bad node"):
        tree.check_integrity()


def test_reset_drops_every_node(make_tree):
    tree, alloc = make_tree()
    put(tree, alloc, [1, 2, 3])
    tree.reset()
    assert tree.total_size() == 0 and tree.evictable_size() == 0
    assert tree.match_prefix([1, 2, 3]).device_indices.numel() == 0


# -- key longer than value (zoo switch evictable-size-uses-key-len, sglang PR #10637) --------------

@pytest.mark.parametrize("bugs, drift", [(frozenset(), 0), (frozenset({"evictable-size-uses-key-len"}), 2)],
                         ids=["clean", "bug"])
def test_insert_cuts_a_long_key_to_the_value(bugs, drift):
    alloc = TokenToKVPoolAllocator(32, 4)
    tree = RadixCache(alloc, 4, bugs=bugs)
    value = alloc.alloc(8)
    assert tree.insert(list(range(10)), value) == 0  # 10 committed tokens, 2 whole pages of slots
    (node,) = tree.root_node.children.values()
    assert node.key == tuple(range(8)) and node.value.tolist() == value.tolist()
    assert tree.total_size() == 8 and tree.evictable_size() == 8 + drift
    if drift:
        with pytest.raises(PoolIntegrityError, match="evictable=10 protected=0 but nodes hold evictable=8"):
            tree.check_integrity()
    else:
        check_counters(tree)
    assert tree.evict(100) == 8
    assert alloc.available_size() == 32  # memory itself is intact either way
    assert tree.evictable_size() == drift  # the counter drift outlives the nodes
    if not drift:
        check_counters(tree)


def test_insert_long_key_into_a_cached_prefix():
    alloc = TokenToKVPoolAllocator(32, 4)
    tree = RadixCache(alloc, 4)
    tree.insert(list(range(8)), alloc.alloc(8))
    value = alloc.alloc(12)
    assert tree.insert(list(range(14)), value) == 8
    alloc.free(value[:8])
    assert tree.match_prefix(list(range(14))).device_indices.numel() == 12
    assert alloc.available_size() == 32 - 12
    check_counters(tree)
