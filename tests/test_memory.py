"""Tests for engine_under_test.memory: the paged KV allocator, request rows and KV tensors."""

import pytest
import torch

from engine_under_test.memory import (HostKVPool, MHATokenToKVPool, PoolIntegrityError, ReqToTokenPool,
                                      TokenToKVPoolAllocator)


def pages_of(idx: torch.Tensor, page_size: int) -> list[int]:
    return sorted(set((idx // page_size).tolist()))


@pytest.fixture
def make_alloc():
    return lambda size=16, page_size=1: TokenToKVPoolAllocator(size, page_size)


# -- TokenToKVPoolAllocator: construction and alloc ----------------------------------------------

@pytest.mark.parametrize("page_size", [1, 4])
def test_fresh_allocator_is_full(make_alloc, page_size):
    a = make_alloc(16, page_size)
    assert a.size == 16
    assert a.num_pages == 16 // page_size
    assert a.available_size() == 16
    a.check_integrity()


def test_size_rounds_down_to_whole_pages(make_alloc):
    a = make_alloc(18, 4)
    assert (a.size, a.num_pages, a.available_size()) == (16, 4, 16)


@pytest.mark.parametrize("page_size", [1, 4])
def test_alloc_everything_never_hands_out_page_zero(make_alloc, page_size):
    a = make_alloc(16, page_size)
    idx = a.alloc(16)
    assert idx.dtype == torch.int64 and idx.numel() == 16
    assert torch.unique(idx).numel() == 16
    assert int(idx.min()) >= page_size  # page 0 holds tokens [0, page_size)
    assert int(idx.max()) < (a.num_pages + 1) * page_size
    assert pages_of(idx, page_size) == list(range(1, a.num_pages + 1))
    assert a.available_size() == 0
    assert a.alloc(page_size) is None


def test_alloc_returns_whole_pages_in_token_order(make_alloc):
    a = make_alloc(16, 4)
    idx = a.alloc(8)
    p0, p1 = int(idx[0]) // 4, int(idx[4]) // 4
    assert idx.tolist() == [p0 * 4 + i for i in range(4)] + [p1 * 4 + i for i in range(4)]
    assert a.available_size() == 8


def test_alloc_rejects_unaligned_size(make_alloc):
    a = make_alloc(16, 4)
    with pytest.raises(ValueError):
        a.alloc(3)
    assert a.available_size() == 16


@pytest.mark.parametrize("page_size", [1, 4])
def test_alloc_when_short_returns_none_and_takes_nothing(make_alloc, page_size):
    a = make_alloc(16, page_size)
    a.alloc(8)
    assert a.alloc(12) is None
    assert a.available_size() == 8


def test_alloc_extend_page_size_1(make_alloc):
    a = make_alloc(16, 1)
    out = a.alloc_extend([0, 2], [3, 5], torch.tensor([-1, 7]))
    assert out.numel() == 6
    assert torch.unique(out).numel() == 6
    assert a.available_size() == 10


def test_alloc_extend_fills_partial_last_page_first(make_alloc):
    a = make_alloc(32, 4)
    first = a.alloc(4)  # positions [0, 2) use first[0:2]; the page has room for 2 more
    out = a.alloc_extend([2], [7], first[1:2])
    assert out.numel() == 5
    assert out[:2].tolist() == first[2:4].tolist()
    fresh = int(out[2]) // 4
    assert out[2:].tolist() == [fresh * 4, fresh * 4 + 1, fresh * 4 + 2]
    assert a.available_size() == 32 - 8  # one new page only


def test_alloc_extend_counts_new_pages_per_request(make_alloc):
    a = make_alloc(32, 4)
    page = a.alloc(4)
    # req 0: [0, 5) -> 2 fresh pages; req 1: prefix 4 (full page), [4, 6) -> 1 fresh page
    out = a.alloc_extend([0, 4], [5, 6], torch.tensor([-1, int(page[3])]))
    assert out.numel() == 7
    assert a.available_size() == 32 - 4 - 3 * 4
    assert int(out[0]) % 4 == 0 and int(out[5]) % 4 == 0
    assert set(pages_of(out, 4)).isdisjoint(pages_of(page, 4))


def test_alloc_extend_when_short_takes_nothing(make_alloc):
    a = make_alloc(8, 4)
    assert a.alloc_extend([0], [9], torch.tensor([-1])) is None
    assert a.available_size() == 8


def test_alloc_decode_page_size_1(make_alloc):
    a = make_alloc(16, 1)
    out = a.alloc_decode([3, 9], torch.tensor([5, 6]))
    assert out.numel() == 2 and a.available_size() == 14


def test_alloc_decode_takes_a_page_only_at_a_page_start(make_alloc):
    a = make_alloc(32, 4)
    full, half = a.alloc(4), a.alloc(4)
    # req 0 holds 4 tokens (page full) -> new page; req 1 holds 2 tokens -> next slot in its page
    out = a.alloc_decode([5, 3], torch.tensor([int(full[3]), int(half[1])]))
    assert int(out[0]) % 4 == 0 and int(out[0]) // 4 not in pages_of(torch.cat((full, half)), 4)
    assert int(out[1]) == int(half[2])
    assert a.available_size() == 32 - 12


def test_alloc_decode_when_short_returns_none(make_alloc):
    a = make_alloc(8, 4)
    x = a.alloc(8)
    assert a.alloc_decode([5], torch.tensor([int(x[3])])) is None


# -- free, free groups, integrity ---------------------------------------------------------------

@pytest.mark.parametrize("page_size", [1, 4])
def test_free_round_trip(make_alloc, page_size):
    a = make_alloc(16, page_size)
    a.free(a.alloc(16))
    assert a.available_size() == 16
    a.check_integrity()
    assert a.alloc(16).numel() == 16


def test_free_returns_every_page_a_token_touches(make_alloc):
    a = make_alloc(16, 4)
    idx = a.alloc(8)
    a.free(idx[1:2])  # one token of the first page
    assert a.available_size() == 12
    a.free(idx[4:6])  # two tokens of the second page: still one page
    assert a.available_size() == 16
    a.check_integrity()


def test_free_empty_is_a_no_op(make_alloc):
    a = make_alloc(16, 4)
    a.free(torch.empty(0, dtype=torch.int64))
    assert a.available_size() == 16


@pytest.mark.parametrize("page_size", [1, 4])
def test_free_group_defers_frees_until_end(make_alloc, page_size):
    a = make_alloc(16, page_size)
    x, y = a.alloc(2 * page_size), a.alloc(page_size)
    a.free_group_begin()
    a.free(x)
    a.free(y)
    assert a.available_size() == 16 - x.numel() - y.numel()
    a.free_group_end()
    assert a.available_size() == 16
    a.check_integrity()


def test_free_groups_do_not_nest(make_alloc):
    a = make_alloc()
    a.free_group_begin()
    with pytest.raises(RuntimeError):
        a.free_group_begin()
    a.free_group_end()
    a.free_group_begin()  # usable again after end
    a.free_group_end()


def test_check_integrity_detects_hand_made_duplicate_page(make_alloc):
    a = make_alloc(16, 4)
    a.check_integrity()
    a.free_pages = torch.cat((a.free_pages, a.free_pages[:1]))
    with pytest.raises(PoolIntegrityError, match="duplicate"):
        a.check_integrity()


def test_check_integrity_detects_a_double_free(make_alloc):
    a = make_alloc(16, 1)
    x = a.alloc(2)
    a.free(x)
    a.free(x)
    assert a.available_size() == 18  # not detected by free itself
    with pytest.raises(PoolIntegrityError):
        a.check_integrity()


@pytest.mark.parametrize("bad_page", [0, 5])
def test_check_integrity_detects_out_of_range_page(make_alloc, bad_page):
    a = make_alloc(16, 4)
    a.alloc(4)
    a.free_pages = torch.cat((a.free_pages, torch.tensor([bad_page])))
    with pytest.raises(PoolIntegrityError):
        a.check_integrity()


def test_clear_returns_everything(make_alloc):
    a = make_alloc(16, 4)
    a.alloc(12)
    a.clear()
    assert a.available_size() == 16
    a.check_integrity()


# -- ReqToTokenPool ------------------------------------------------------------------------------

def test_req_pool_reserves_row_zero_and_runs_out():
    p = ReqToTokenPool(4, 8)
    assert p.available_size() == 4 and p.pre_alloc_size == 0
    rows = p.alloc(4)
    assert sorted(rows) == [1, 2, 3, 4]
    assert p.alloc(1) is None
    assert p.available_size() == 0


def test_req_pool_free_takes_int_or_list():
    p = ReqToTokenPool(4, 8)
    rows = p.alloc(3)
    p.free(rows[0])
    p.free(rows[1:])
    assert p.available_size() == 4
    p.check_integrity()


def test_req_pool_pre_alloc_rows():
    p = ReqToTokenPool(4, 8, pre_alloc_size=2)
    assert p.available_size() == 6
    assert p.req_to_token.shape == (7, 8)
    assert sorted(p.alloc(6)) == [1, 2, 3, 4, 5, 6]
    assert p.alloc(1) is None


def test_req_pool_write_fills_positions():
    p = ReqToTokenPool(2, 8)
    (row,) = p.alloc(1)
    p.write(row, 2, torch.tensor([11, 12, 13]))
    assert p.req_to_token[row].tolist() == [0, 0, 11, 12, 13, 0, 0, 0]
    assert p.req_to_token[0].sum() == 0


def test_req_pool_check_integrity_detects_duplicate_row():
    p = ReqToTokenPool(4, 8)
    (row,) = p.alloc(1)
    p.free(row)
    p.free(row)
    with pytest.raises(PoolIntegrityError):
        p.check_integrity()


def test_req_pool_check_integrity_detects_row_zero():
    p = ReqToTokenPool(4, 8)
    p.free(0)
    with pytest.raises(PoolIntegrityError):
        p.check_integrity()


# -- KV tensors ----------------------------------------------------------------------------------

def test_mha_pool_set_get_round_trip():
    pool = MHATokenToKVPool(num_slots=10, num_layers=2, num_heads=2, head_dim=4)
    assert pool.k_buffer.shape == (2, 10, 2, 4)
    loc = torch.tensor([3, 7])
    k, v = torch.randn(2, 2, 4), torch.randn(2, 2, 4)
    pool.set_kv(1, loc, k, v)
    gk, gv = pool.get_kv(1, loc)
    assert torch.equal(gk, k) and torch.equal(gv, v)
    assert pool.k_buffer[0].abs().sum() == 0  # other layer untouched
    others = torch.tensor([i for i in range(10) if i not in (3, 7)])
    assert pool.get_kv(1, others)[0].abs().sum() == 0


def test_host_pool_allocates_pages_and_stores_kv():
    host = HostKVPool(16, 4, num_layers=1, num_heads=2, head_dim=4)
    loc = host.alloc(4)
    assert loc is not None and int(loc.min()) >= 4
    k = torch.randn(4, 2, 4)
    host.set_kv(0, loc, k, -k)
    gk, gv = host.get_kv(0, loc)
    assert torch.equal(gk, k) and torch.equal(gv, -k)
