"""HiSparseCoordinator in aggregated mode: prefill slots, staging, device-buffer admission, retraction."""

from types import SimpleNamespace

import pytest
import torch

from engine_under_test.hisparse import HiSparseCoordinator
from engine_under_test.memory import HostKVPool, MHATokenToKVPool, PoolIntegrityError, TokenToKVPoolAllocator
from engine_under_test.req import ReqKvInfo

LAYERS, HEADS, DIM = 2, 2, 3
PHYSICAL, HOST, BUFFER = 64, 128, 8


def align(n, ps):
    return -(-n // ps) * ps


@pytest.fixture
def hs(page_size):
    physical = TokenToKVPoolAllocator(PHYSICAL, page_size, "cpu", "hisparse_device")
    host = HostKVPool(HOST, page_size, LAYERS, HEADS, DIM, "hisparse_host")
    coord = HiSparseCoordinator(physical, host, BUFFER, page_size, copy_kv=True)
    coord.kv_pool = MHATokenToKVPool((physical.num_pages + 1) * page_size, LAYERS, HEADS, DIM)
    return coord


def make_req(row, n):
    return SimpleNamespace(rid=f"r{row}", kv=ReqKvInfo(req_pool_idx=row, kv_committed_len=n, kv_allocated_len=n),
                           hisparse_admitted=False, hisparse_staging=False)


def kv_value(row, pos):
    """A K value unique to (row, position), per layer/head/dim."""
    base = torch.arange(LAYERS * HEADS * DIM, dtype=torch.float32).reshape(LAYERS, 1, HEADS, DIM)
    return base + 1000.0 * row + 10.0 * pos.reshape(1, -1, 1, 1).float()


def prefill(hs, row, n):
    """alloc_prefill + the model's K/V writes; returns (req, slots)."""
    slots = hs.alloc_prefill(row, n)
    assert slots is not None and slots.dtype == torch.int64 and slots.shape == (n,)
    pos = torch.arange(n)
    hs.kv_pool.k_buffer[:, slots] = kv_value(row, pos)
    hs.kv_pool.v_buffer[:, slots] = -kv_value(row, pos)
    return make_req(row, n), slots


def staged(hs, row, n, now=0, latency=2):
    req, slots = prefill(hs, row, n)
    assert hs.admit_request_into_staging(req, now, latency)
    return req, slots


def assert_accounting(hs, rows):
    dev, host = hs.hisparse_attn_allocator, hs.host_pool
    assert dev.available_size() + sum(hs.device_size(r) for r in rows) == dev.size
    assert host.available_size() + sum(hs.host_size(r) for r in rows) == host.size
    hs.check_integrity(set(rows))


def assert_empty(hs):
    assert_accounting(hs, [])
    assert not (hs.req_to_device_buffer or hs.req_device_buffer_pos or hs.req_to_host_pool
                or hs.req_prefill_physical or hs.ack_staging_queue)


def test_prefill_alloc_staging_and_readiness(hs, page_size):
    req, slots = prefill(hs, 1, 10)
    assert hs.device_size(1) == align(10, page_size) and hs.buffer_size(1) == 0
    ctx, pos = hs.prefill_context(1, 10)
    assert torch.equal(ctx, slots) and torch.equal(pos, torch.arange(10))
    with pytest.raises(ValueError):
        hs.prefill_context(1, align(10, page_size) + 1)
    assert_accounting(hs, [1])

    assert hs.admit_request_into_staging(req, now=5, latency=3)
    assert req.hisparse_staging and not req.hisparse_admitted
    assert hs.host_size(1) == align(10, page_size)
    assert hs.has_ongoing_staging() and hs.staging_reqs() == [req]
    assert_accounting(hs, [1])

    assert hs.collect_ready_reqs(7) == [] and req.hisparse_staging and hs.staging_reqs() == [req]
    assert hs.collect_ready_reqs(8) == [req]
    assert not req.hisparse_staging and req.hisparse_admitted
    assert not hs.has_ongoing_staging() and hs.staging_reqs() == [] and 1 not in hs.req_prefill_physical
    assert_accounting(hs, [1])


def test_ready_requests_come_out_in_queue_order(hs):
    a, _ = staged(hs, 1, 5, now=0, latency=2)
    b, _ = staged(hs, 2, 6, now=1, latency=2)
    assert hs.collect_ready_reqs(2) == [a]
    assert hs.collect_ready_reqs(3) == [b]
    assert_accounting(hs, [1, 2])


@pytest.mark.parametrize("n", [3, 8, 10, 13, 21])
def test_buffer_keeps_the_most_recent_positions_and_frees_the_surplus(hs, page_size, n):
    req, slots = staged(hs, 1, n)
    free_before = hs.hisparse_attn_allocator.available_size()
    assert hs.collect_ready_reqs(10) == [req]
    cap = min(align(n, page_size), BUFFER)
    assert hs.buffer_size(1) == hs.device_size(1) == cap
    assert hs.hisparse_attn_allocator.available_size() == free_before + align(n, page_size) - cap
    buf, pos = hs.req_to_device_buffer[1], hs.req_device_buffer_pos[1]
    held = pos[pos >= 0]
    k = held.numel()
    assert k >= min(n, cap) - (page_size - 1)  # whole pages: at most a partial page short
    assert sorted(held.tolist()) == list(range(n - k, n))  # the most recent positions
    assert torch.equal(buf[pos >= 0], slots[held])  # each kept slot still holds its position's KV
    ctx, ctx_pos = hs.physical_context(req)
    assert torch.equal(ctx_pos, torch.arange(n - k, n)) and torch.equal(ctx, slots[n - k : n])
    assert_accounting(hs, [1])


def test_an_empty_request_gets_one_page(hs, page_size):
    req = make_req(1, 0)
    assert hs.alloc_prefill(1, 0).numel() == 0
    assert hs.admit_request_into_staging(req, 0, 0) and hs.host_size(1) == 0
    assert hs.collect_ready_reqs(0) == [req]
    assert hs.buffer_size(1) == page_size and bool((hs.req_device_buffer_pos[1] < 0).all())
    assert_accounting(hs, [1])


def test_host_copy_round_trips_kv_and_decode_continues(hs, page_size):
    n = 11
    req, slots = staged(hs, 3, n)
    host = hs.req_to_host_pool[3][:n]
    pos = torch.arange(n)
    assert torch.equal(hs.host_pool.k_buffer[:, host], kv_value(3, pos))
    assert torch.equal(hs.host_pool.v_buffer[:, host], -kv_value(3, pos))
    hs.collect_ready_reqs(5)
    ctx, ctx_pos = hs.physical_context(req)
    assert torch.equal(hs.kv_pool.k_buffer[:, ctx], hs.host_pool.k_buffer[:, hs.req_to_host_pool[3][ctx_pos]])
    dev_loc, host_loc = hs.map_last_loc_to_buffer(req, n)  # the first decode token after staging
    assert int(dev_loc) in hs.req_to_device_buffer[3].tolist()
    assert int(host_loc) == int(hs.req_to_host_pool[3][n])
    assert_accounting(hs, [3])


def test_short_pools_take_nothing(hs, page_size):
    assert hs.alloc_prefill(1, PHYSICAL + 1) is None and 1 not in hs.req_prefill_physical
    req, _ = prefill(hs, 1, 12)
    taken = hs.host_pool.alloc(HOST - page_size)
    assert not hs.admit_request_into_staging(req, 0, 1)
    assert not req.hisparse_staging and 1 not in hs.req_to_host_pool and not hs.has_ongoing_staging()
    hs.host_pool.free(taken)
    assert_accounting(hs, [1])


def test_alloc_prefill_grows_by_chunks(hs, page_size):
    first = hs.alloc_prefill(1, 5)
    second = hs.alloc_prefill(1, 11)
    assert torch.equal(second[:5], first) and hs.device_size(1) == align(11, page_size)
    assert_accounting(hs, [1])


def test_abort_staging_request_returns_every_slot(hs):
    req, _ = staged(hs, 1, 13)
    other, _ = staged(hs, 2, 4)
    hs.abort_staging_request(req)
    assert not req.hisparse_staging and not req.hisparse_admitted and hs.staging_reqs() == [other]
    hs.abort_staging_request(other)
    assert_empty(hs)


def test_retract_req_in_staging_and_after_admission(hs):
    first, _ = staged(hs, 1, 9)
    admitted, _ = staged(hs, 2, 17)
    assert hs.collect_ready_reqs(2) == [first, admitted]
    late, _ = staged(hs, 3, 6, now=2)
    hs.retract_req(late)
    assert hs.staging_reqs() == [] and not late.hisparse_staging
    assert_accounting(hs, [1, 2])
    hs.retract_req(admitted)
    assert not admitted.hisparse_admitted
    hs.retract_req(first)
    assert_empty(hs)


def test_request_finished_after_prefill_only_frees_the_prefill_slots(hs):
    req, _ = prefill(hs, 1, 7)  # max_new_tokens=1: finished in its prefill, never staged
    hs.request_finished(req)
    assert hs.device_size(1) == 0
    assert_empty(hs)
    req, _ = staged(hs, 2, 7)  # finished (aborted) while staging
    hs.request_finished(req)
    assert not req.hisparse_staging and not hs.has_ongoing_staging()
    assert_empty(hs)


def test_clear_resets_the_new_state(hs):
    staged(hs, 1, 5)
    prefill(hs, 2, 3)
    hs.clear()
    assert not hs.req_prefill_physical and not hs.ack_staging_queue and not hs.req_to_host_pool


def test_check_integrity_catches_a_duplicate_slot(hs):
    staged(hs, 1, 9)
    hs.collect_ready_reqs(5)
    hs.req_prefill_physical[2] = hs.req_to_device_buffer[1][:1].clone()
    with pytest.raises(PoolIntegrityError, match="duplicate"):
        hs.check_integrity({1, 2})


def test_check_integrity_catches_state_of_a_dead_row(hs):
    req, _ = prefill(hs, 4, 6)
    hs.check_integrity({4})
    with pytest.raises(PoolIntegrityError, match=r"req_prefill_physical.*\[4\]"):
        hs.check_integrity({1})


def test_check_integrity_catches_freed_and_mismatched_state(hs):
    req, _ = staged(hs, 1, 9)
    hs.host_pool.free(hs.req_to_host_pool[1])  # freed behind the coordinator's back
    with pytest.raises(PoolIntegrityError, match="free list"):
        hs.check_integrity({1})
    hs.host_pool.clear()
    hs.req_to_host_pool.pop(1)
    with pytest.raises(PoolIntegrityError, match="staging"):
        hs.check_integrity({1})
    hs.ack_staging_queue.clear()
    hs.req_to_host_pool[1] = hs.host_pool.alloc(hs.page_size)
    hs.req_to_device_buffer[1] = hs.req_prefill_physical.pop(1)
    hs.req_device_buffer_pos[1] = torch.arange(3)
    with pytest.raises(PoolIntegrityError, match="positions"):
        hs.check_integrity({1})
