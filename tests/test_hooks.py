"""Tests for kvaudit.audit.hooks: the wrappers on the engine's pools and the alloc/free ledger."""

import os

import numpy as np
import pytest
import torch

from engine_under_test import ReqToTokenPool, TokenToKVPoolAllocator

from kvaudit.targets.eut.presets import get_preset
from kvaudit.audit.hooks import Auditor
from kvaudit.audit.ledger import MARK_LOOP
from kvaudit.program import Submit
from kvaudit.targets.eut import EutTarget


@pytest.fixture
def make_audited():
    """``make_audited(preset="default", **config_changes) -> (target, auditor)``; uninstalls after the test."""
    made = []

    def make(preset="default", **kw):
        target = EutTarget(get_preset(preset).config(**kw))
        auditor = Auditor(target)
        made.append(auditor)
        return target, auditor

    yield make
    for auditor in made:
        auditor.uninstall()


def events(auditor, kind=None, pool=None):
    return [e for e in auditor.events if (kind is None or e.kind == kind) and (pool is None or e.pool == pool)]


def ids(units):
    """Units of an event, root or ledger index (numpy or torch) as a sorted list of ints."""
    return sorted(int(u) for u in np.asarray(units).reshape(-1).tolist())


def held(led):
    """Units the ledger holds as allocated, excluding the reserved unit 0."""
    return [u for u in np.flatnonzero(np.asarray(led.allocated)).tolist() if u != 0]


def functions(auditor, ev):
    return [s.function for s in auditor.site(ev.site)]


def run_steps(target, auditor, n, first_op=0):
    for _ in range(n):
        auditor.step = target.steps + 1
        target.step()


def in_engine(site, name):
    return os.path.join("engine_under_test", name) in site.file


# -- recording through the engine ------------------------------------------------------------------

def test_prefill_records_row_and_slots_with_op_step_and_engine_site(make_audited, page_size):
    target, auditor = make_audited("default", page_size=page_size)
    auditor.op_index = 7
    target.apply(Submit(family=0, prompt_len=10, max_new_tokens=3))
    auditor.step = 1
    target.step()

    rows = events(auditor, "alloc", "req_to_token_pool")
    kv = events(auditor, "alloc", "token_to_kv_pool")
    assert len(rows) == 1 and len(kv) == 1, "one prefill: exactly one row and one slot allocation"
    row_ev, kv_ev = rows[0], kv[0]
    req = target.engine.last_batch.reqs[0]
    assert ids(row_ev.units) == [req.kv.req_pool_idx]
    slots = target.engine.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :10]
    assert ids(kv_ev.units) == sorted(set((slots // page_size).tolist()))
    assert len(ids(kv_ev.units)) == -(-10 // page_size)  # whole pages
    for ev in (row_ev, kv_ev):
        assert (ev.op_index, ev.step) == (7, 1)
        site = auditor.site(ev.site)
        assert site[0].function == "alloc_for_extend" and in_engine(site[0], "scheduler.py")
        assert site[0].request_kv and not any(s.request_kv for s in site[1:])  # the target's request_kv_allocs
        assert "step" in functions(auditor, ev)
        assert not any(s.file.endswith("memory.py") for s in site), "allocator frames are skipped"
        assert not any(f"{os.sep}kvaudit{os.sep}" in s.file for s in site), "kvaudit frames are skipped"
    led = auditor.ledgers["token_to_kv_pool"]
    assert held(led) == ids(kv_ev.units)
    assert (np.asarray(led.last_alloc)[ids(kv_ev.units)] == kv_ev.id).all()


def test_pd_decode_records_pre_alloc_site(make_audited, page_size):
    target, auditor = make_audited("pd-decode", page_size=page_size)
    target.apply(Submit(family=1, prompt_len=9, max_new_tokens=2))
    run_steps(target, auditor, 1)
    kv = events(auditor, "alloc", "token_to_kv_pool")
    assert len(kv) == 1
    assert auditor.site(kv[0].site)[0].function == "_pre_alloc"
    assert not auditor.site(kv[0].site)[0].request_kv  # a PD pre-allocation keeps its function in a signature
    assert len(ids(kv[0].units)) == -(-9 // page_size)
    assert auditor.site_owner(kv[0].site) == f"req:{target.submitted[0]}"


def test_batch_allocation_is_not_attributed_to_one_request(make_audited):
    """A decode step allocates for the whole batch: no single request owns that allocation."""
    target, auditor = make_audited("pd-decode", page_size=1, max_running_requests=4)
    target.apply(Submit(family=0, prompt_len=4, max_new_tokens=6))
    target.apply(Submit(family=1, prompt_len=5, max_new_tokens=6))
    run_steps(target, auditor, 4)
    decode = [e for e in events(auditor, "alloc", "token_to_kv_pool")
              if auditor.site(e.site)[0].function == "update_running_batch"]
    two = [e for e in decode if len(ids(e.units)) == 2]
    assert two, "expected a decode step over both requests"
    assert all(auditor.site(e.site)[0].request_kv for e in decode)  # decode grows the request's KV too
    assert all(auditor.site_owner(e.site) is None for e in two)


def test_hisparse_pools_are_recorded_with_their_own_sites(make_audited, page_size):
    target, auditor = make_audited("pd-decode-hisparse", page_size=page_size)
    target.apply(Submit(family=0, prompt_len=6, max_new_tokens=4))
    run_steps(target, auditor, 2)
    host = events(auditor, "alloc", "hisparse_host")
    dev = events(auditor, "alloc", "hisparse_device")
    assert host and dev
    assert auditor.site(host[0].site)[0].function == "alloc_host"
    assert in_engine(auditor.site(host[0].site)[0], "hisparse.py")
    assert auditor.site(dev[0].site)[0].function == "admit_request_direct"
    assert len(ids(host[0].units)) == -(-6 // page_size)


def test_finishing_request_frees_everything_it_allocated(make_audited, page_size):
    target, auditor = make_audited("pd-decode", page_size=page_size)
    target.apply(Submit(family=0, prompt_len=10, max_new_tokens=3))
    run_steps(target, auditor, 6)
    assert target.is_idle()
    for pool in ("token_to_kv_pool", "req_to_token_pool"):
        allocated = sorted({u for e in events(auditor, "alloc", pool) for u in ids(e.units)})
        frees = events(auditor, "free", pool)
        assert len(frees) == 1, f"{pool}: one release, recorded once"
        assert ids(frees[0].units) == allocated
        assert auditor.site(frees[0].site)[0].function == "release_kv_cache"
        assert held(auditor.ledgers[pool]) == []
    assert auditor.pending == []


def test_free_inside_engine_free_group_keeps_its_release_site(make_audited, page_size):
    """The decode finish is released inside process_batch_result's free group."""
    target, auditor = make_audited("pd-decode", page_size=page_size)
    target.apply(Submit(family=0, prompt_len=5, max_new_tokens=2))
    run_steps(target, auditor, 6)
    (free,) = events(auditor, "free", "token_to_kv_pool")
    fns = functions(auditor, free)
    assert fns[0] == "release_kv_cache"
    assert "process_batch_result" in fns
    assert "free_group_end" not in fns


def test_nested_alloc_extend_to_alloc_records_once(make_audited):
    """With page_size 1, alloc_extend calls self.alloc, which is the wrapper too."""
    target, auditor = make_audited("default", page_size=1)
    a = target.engine.token_to_kv_pool_allocator
    out = a.alloc_extend([0, 0], [3, 4], torch.tensor([-1, -1]))
    assert out.numel() == 7
    kv = events(auditor, "alloc", "token_to_kv_pool")
    assert len(kv) == 1
    assert ids(kv[0].units) == sorted(out.tolist())
    assert auditor.site(kv[0].site)[0].function == "test_nested_alloc_extend_to_alloc_records_once"
    assert auditor.pending == []


@pytest.mark.parametrize("n", [3, MARK_LOOP + 9])
def test_an_alloc_and_free_mark_every_unit_with_their_event_whatever_their_size(make_audited, n):
    """A fast path's event marks its units one by one up to MARK_LOOP units and with numpy past it: the same
    flags and last alloc and free events either way, the units around them untouched."""
    target, auditor = make_audited("default", page_size=1)
    a, led = target.engine.token_to_kv_pool_allocator, auditor.ledgers["token_to_kv_pool"]
    before = a.alloc(2)
    out = a.alloc(n)
    ev = events(auditor, "alloc", "token_to_kv_pool")[-1]
    assert ids(ev.units) == ids(out) and held(led) == ids(before) + ids(out)
    assert led.last_alloc[out.numpy()].tolist() == [ev.id] * n
    a.free(out)
    free = events(auditor, "free", "token_to_kv_pool")[-1]
    assert ids(free.units) == ids(out) and held(led) == ids(before)
    assert led.last_free[out.numpy()].tolist() == [free.id] * n
    assert led.last_alloc[before.numpy()].tolist() == [0, 0] and led.last_free[before.numpy()].tolist() == [-1, -1]
    assert auditor.pending == []


# -- free groups -----------------------------------------------------------------------------------

def _end_group(allocator):
    allocator.free_group_end()


def test_frees_in_a_free_group_are_recorded_at_group_end_with_their_own_site(make_audited, page_size):
    target, auditor = make_audited("default", page_size=page_size)
    a = target.engine.token_to_kv_pool_allocator
    first, second = a.alloc(2 * page_size), a.alloc(page_size)
    a.free_group_begin()
    a.free(first)
    a.free(second)
    assert events(auditor, "free") == [], "nothing is recorded while the group is open"
    assert len(held(auditor.ledgers["token_to_kv_pool"])) == 3
    _end_group(a)
    frees = events(auditor, "free", "token_to_kv_pool")
    assert [len(ids(f.units)) for f in frees] == [2, 1], "one event per free call, in order"
    for f in frees:
        assert auditor.site(f.site)[0].function == \
            "test_frees_in_a_free_group_are_recorded_at_group_end_with_their_own_site"
    assert auditor.site(frees[0].site)[0].line != auditor.site(frees[1].site)[0].line
    assert held(auditor.ledgers["token_to_kv_pool"]) == []
    assert auditor.pending == []
    a.check_integrity()


def test_empty_free_group_records_nothing(make_audited):
    target, auditor = make_audited("default")
    a = target.engine.token_to_kv_pool_allocator
    a.free_group_begin()
    _end_group(a)
    assert events(auditor, "free") == []


# -- double free and aliasing at allocation -------------------------------------------------------

def _first_free(allocator, idx):
    allocator.free(idx)


def _second_free(allocator, idx):
    allocator.free(idx)


def test_double_free_of_kv_slots_is_a_pending_finding_with_both_sites(make_audited, page_size):
    target, auditor = make_audited("default", page_size=page_size)
    a = target.engine.token_to_kv_pool_allocator
    auditor.op_index, auditor.step = 4, 9
    idx = a.alloc(2 * page_size)
    _first_free(a, idx)
    assert auditor.pending == []
    _second_free(a, idx)
    assert len(auditor.pending) == 1
    f = auditor.pending[0]
    assert f.kind == "double-free" and f.pool == "token_to_kv_pool"
    assert f.num_units == 2 and f.message == "2 units freed while already free"
    assert sorted(f.slots) == sorted(idx.tolist())
    assert f.unit == ("slot" if page_size == 1 else "page")
    assert f.free_sites[0].function == "_second_free"
    assert f.prev_free_sites[0].function == "_first_free"
    assert f.alloc_sites[0].function == "test_double_free_of_kv_slots_is_a_pending_finding_with_both_sites"
    assert (f.op_index, f.step) == (4, 9)
    # both frees: two double frees that share one first (legitimate) free are two bugs
    assert f.signature == "double-free/token_to_kv_pool/_first_free@test_hooks.py/_second_free@test_hooks.py"


@pytest.mark.parametrize("lean", [False, True])
def test_a_row_freed_once_and_again_in_a_lean_run_as_in_a_full_one(lean):
    """A lean run's row free takes on_free's fast path in the wrapper (a full run's on_free keeps shadow tags):
    the same event and flags, and a second free of the row still a double free."""
    target = EutTarget(get_preset("default").config())
    auditor = Auditor(target, full_stacks=not lean, lean=lean)
    try:
        rp, led = target.engine.req_to_token_pool, auditor.ledgers["req_to_token_pool"]
        (row,) = rp.alloc(1)
        rp.free([row])
        free = events(auditor, "free", "req_to_token_pool")[-1]
        assert (free.units, held(led), led.last_free[row]) == ([row], [], free.id)
        assert auditor.pending == []
        rp.free([row])
        assert [(f.kind, f.slots) for f in auditor.pending] == [("double-free", [row])]
    finally:
        auditor.uninstall()


def test_duplicate_index_in_one_free_is_a_double_free(make_audited):
    target, auditor = make_audited("default", page_size=1)
    a = target.engine.token_to_kv_pool_allocator
    idx = a.alloc(3)
    a.free(torch.cat((idx, idx[:1])))
    assert [f.kind for f in auditor.pending] == ["double-free"]
    assert auditor.pending[0].slots == [int(idx[0])]
    assert auditor.pending[0].message == "1 unit freed while already free"  # (it said "1 unit(s)")


def test_double_free_of_a_row_is_a_pending_finding(make_audited):
    target, auditor = make_audited("default")
    rp = target.engine.req_to_token_pool
    (row,) = rp.alloc(1)
    _first_free(rp, row)
    _second_free(rp, [row])
    (f,) = auditor.pending
    assert (f.kind, f.pool, f.unit, f.slots) == ("double-free", "req_to_token_pool", "row", [row])
    assert f.free_sites[0].function == "_second_free"
    assert f.prev_free_sites[0].function == "_first_free"


def test_allocator_handing_out_an_allocated_page_is_aliasing(make_audited, page_size):
    target, auditor = make_audited("default", page_size=page_size)
    a = target.engine.token_to_kv_pool_allocator
    held = a.alloc(page_size)
    page = held // page_size if page_size > 1 else held
    a.free_pages = torch.cat((page[:1], a.free_pages))  # corrupt the free list behind the hooks
    a.alloc(page_size)
    (f,) = auditor.pending
    assert f.kind == "aliasing" and f.pool == "token_to_kv_pool"
    assert f.num_units == 1


# -- uninstall -------------------------------------------------------------------------------------

def test_uninstall_restores_the_class_methods_and_stops_recording(page_size):
    target = EutTarget(get_preset("pd-decode-hisparse").config(page_size=page_size))
    auditor = Auditor(target)
    specs = target.pools()
    assert {s.name for s in specs} == {"token_to_kv_pool", "req_to_token_pool", "hisparse_device", "hisparse_host"}
    for s in specs:
        assert "alloc" in vars(s.obj) and "free" in vars(s.obj)
    auditor.uninstall()
    for s in specs:
        cls = type(s.obj)
        for name in ("alloc", "alloc_extend", "alloc_decode", "free", "free_group_end"):
            assert name not in vars(s.obj), f"{s.name}.{name} still shadowed"
            if hasattr(cls, name):
                assert getattr(s.obj, name).__func__ is getattr(cls, name)
    n = len(auditor.events)
    idx = target.engine.token_to_kv_pool_allocator.alloc(page_size)
    target.engine.token_to_kv_pool_allocator.free(idx)
    target.engine.token_to_kv_pool_allocator.free(idx)
    assert len(auditor.events) == n and auditor.pending == []


def test_uninstall_twice_is_harmless():
    target = EutTarget(get_preset("default").config())
    auditor = Auditor(target)
    auditor.uninstall()
    auditor.uninstall()
    assert "alloc" not in vars(target.engine.token_to_kv_pool_allocator)


def test_hooks_do_not_touch_other_instances(make_audited):
    target, auditor = make_audited("default")
    other = TokenToKVPoolAllocator(16, 1)
    rows = ReqToTokenPool(4, 8)
    assert "alloc" not in vars(other) and "alloc" not in vars(rows)
    other.free(other.alloc(2))
    assert auditor.events == []


def test_one_page_freed_in_parts_within_a_free_group_is_not_a_double_free(make_audited):
    target, auditor = make_audited("default", page_size=4)
    a = target.engine.token_to_kv_pool_allocator
    idx = a.alloc(8)  # two pages
    a.free_group_begin()
    a.free(idx[:2])  # first half of page 1
    a.free(idx[2:])  # second half of page 1, and page 2
    _end_group(a)
    a.check_integrity()  # the engine's free list holds each page once: no double free happened
    assert a.available_size() == a.size
    assert auditor.pending == []
    assert held(auditor.ledgers["token_to_kv_pool"]) == []


def test_a_slot_freed_twice_within_a_free_group_at_page_size_1_is_a_double_free(make_audited):
    """With page_size 1 the allocator returns a group's slots as they are, duplicates included."""
    target, auditor = make_audited("default", page_size=1)
    a = target.engine.token_to_kv_pool_allocator
    idx = a.alloc(3)
    a.free_group_begin()
    a.free(idx)
    a.free(idx[:1])
    _end_group(a)
    assert a.free_pages.numel() - a.free_pages.unique().numel() == 1  # the engine really did it
    (f,) = auditor.pending
    assert f.kind == "double-free" and f.slots == [int(idx[0])]
    assert f.prev_free_sites and f.free_sites


def test_one_page_freed_in_parts_outside_a_group_is_a_double_free(make_audited):
    """Outside a group the allocator really frees the page twice (it lands twice in the free list)."""
    target, auditor = make_audited("default", page_size=4)
    a = target.engine.token_to_kv_pool_allocator
    idx = a.alloc(4)
    a.free(idx[:2])
    a.free(idx[2:])
    assert a.free_pages.numel() - a.free_pages.unique().numel() == 1
    assert [f.kind for f in auditor.pending] == ["double-free"]


def test_freeing_the_reserved_slot_zero_is_reported_at_free_time(make_audited):
    target, auditor = make_audited("default", page_size=1)
    target.engine.token_to_kv_pool_allocator.free(torch.tensor([0]))
    (f,) = auditor.pending
    assert f.kind == "double-free" and f.slots == [0]
    assert f.free_sites[0].function == "test_freeing_the_reserved_slot_zero_is_reported_at_free_time"


class _Driver:
    """A target-like driver living in an engine file (as kvaudit/targets/sglang/target.py does)."""

    def install_pool(self, auditor):
        def inner():  # a hook over an allocator method, which records the call's site
            return auditor.capture_site()

        def wrapper():  # a hook over the engine method that calls it (free_page_ids -> free)
            return inner()
        return wrapper


def _driver_frees(hook):  # the driver's own call site: the site a report should name
    return hook()


def test_a_hook_defined_in_a_targets_install_method_is_not_a_site(make_audited, monkeypatch):
    """SGLang's driver file is an engine file (its frames play SGLang's scheduler), and its grouped-free
    hook, a closure in ``install_pool``, was taken as the free's site: a known leak came back as new
    under ``.../wrapper@sglang_target.py`` (one hook calling the engine method another hook
wraps). The hooks' caller is the site."""
    monkeypatch.setattr(EutTarget, "engine_files", lambda self: [os.path.abspath(__file__)], raising=False)
    target, auditor = make_audited()
    for full in (True, False):
        auditor.full_stacks = full
        site = auditor.site(_driver_frees(_Driver().install_pool(auditor)))
        assert site and site[0].function == "_driver_frees", [s.function for s in site]


# -- the ledger digest ------------------------------------------------------------------------------

def _take_row(rows):
    return rows.alloc(1)


def _take_slots(allocator):
    return allocator.alloc(2)


def _digest_of(make_audited, rows_first: bool, frees=(0, 1), step=1):
    target, auditor = make_audited("default", page_size=1)
    rows, kv = target.engine.req_to_token_pool, target.engine.token_to_kv_pool_allocator
    auditor.op_index, auditor.step = 0, 1
    takes = [lambda: _take_row(rows), lambda: _take_slots(kv)]
    for take in takes if rows_first else takes[::-1]:
        take()
    a, b = _take_slots(kv), _take_slots(kv)
    auditor.step = step
    for i in frees:
        _first_free(kv, (a, b)[i])
    return auditor.digest()


def test_the_digest_keeps_each_pools_order_but_not_the_interleaving_of_pools_within_one_step(make_audited):
    """SGLang 0.5.23's rust tree core frees an eviction's FULL and SWA parts in an order that changes from run to
    run; the digest means "the same allocs and frees per pool, in the same order, at the same op and step"."""
    same = _digest_of(make_audited, rows_first=True)
    assert _digest_of(make_audited, rows_first=False) == same  # a row and slots in one step, either order
    assert _digest_of(make_audited, rows_first=True, frees=(1, 0)) != same  # one pool's frees in another order
    assert _digest_of(make_audited, rows_first=True, step=2) != same  # at another step
