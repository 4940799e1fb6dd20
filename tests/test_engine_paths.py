"""Engine-level tests of the paths the newer zoo switches live on: overlap scheduling, streaming
sessions, HiCache, HiSparse staging, health checks in every preset and memory pressure; and
pause/continue generation, driven as program ops through the kvaudit target (which plays SGLang's
tokenizer: it holds new requests while paused).

Every zoo test runs one hand-written op sequence twice, with its switch on and off: on, the fault
is an engine fact (a duplicate in a free list, a slot nothing references, a negative counter, a
lock with no holder); off, the same ops leave every identity and integrity check clean.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from engine_under_test import BUGS, FinishReason, PoolIntegrityError, Scheduler

from kvaudit.targets.eut.presets import PRESETS, get_preset
from kvaudit.program import (PAUSE_MODES, Abort, ContinueGeneration, FlushCache, HealthCheck, Idle, MemoryPressure,
                             PauseGeneration, Step, Submit)
from kvaudit.audit.runner import LIVENESS_STEPS, AuditedRun, execute

EOS = 1


# -- helpers -------------------------------------------------------------------------------------

def make(preset: str, bugs=(), **changes) -> Scheduler:
    return Scheduler(get_preset(preset).config(bugs=frozenset(bugs), **changes))


def on_off(name: str):
    """Parametrize ``bugs`` over the switch off and on."""
    return pytest.mark.parametrize("bugs", [frozenset(), frozenset({name})], ids=["off", "on"])


def outputs(s):
    """``{rid: FinishedOutput}``; fails if any rid finished more than once."""
    rids = [o.rid for o in s.finished_outputs]
    assert len(rids) == len(set(rids)), f"a request finished twice: {rids}"
    return {o.rid: o for o in s.finished_outputs}


def integrity_error(s) -> str | None:
    try:
        s.check_integrity()
    except PoolIntegrityError as e:
        return str(e)
    return None


def token_check(s, idle=None):
    return next(c for c in s.check_memory(idle=idle) if c.pool == "token_to_kv_pool")


def free_pages(s) -> list[int]:
    return s.token_to_kv_pool_allocator.free_pages.tolist()


def referenced_pages(s) -> set[int]:
    """Device pages some structure references: a tree node, a live request's row ``[0, allocated)``
    or a session slot's row ``[0, allocated)``."""
    alloc, table = s.token_to_kv_pool_allocator, s.req_to_token_pool.req_to_token
    held = [n.value for n in s.tree_cache.nodes() if n.value is not None]
    held += [table[r.kv.req_pool_idx, : r.kv.kv_allocated_len] for r in s.requests_owning_rows()]
    if s.session_controller is not None:
        held += [table[slot.kv.req_pool_idx, : slot.kv.kv_allocated_len] for _, slot in s.session_controller.slots()]
    if not held:
        return set()
    return set((torch.cat(held) // alloc.page_size).tolist())


def unreferenced_pages(s) -> set[int]:
    """Device pages that are neither free nor referenced by anything: leaked."""
    alloc = s.token_to_kv_pool_allocator
    return set(range(1, alloc.num_pages + 1)) - set(free_pages(s)) - referenced_pages(s)


def all_pools(s):
    """``(name, pool)`` for every allocator-like pool of the engine."""
    pools = [("token_to_kv_pool", s.token_to_kv_pool_allocator)]
    if s.hicache_host_pool is not None:
        pools.append(("hicache_host", s.hicache_host_pool))
    hs = s.hisparse_coordinator
    if hs is not None:
        pools += [("hisparse_device", hs.hisparse_attn_allocator), ("hisparse_host", hs.host_pool)]
    return pools


def snapshot(s):
    """Every free list and tree counter, exactly (for twin-engine comparisons)."""
    snap = {name: pool.free_pages.tolist() for name, pool in all_pools(s)}
    snap["rows"] = list(s.req_to_token_pool.free_slots)
    snap["tree"] = (s.tree_cache.evictable_size(), s.tree_cache.protected_size())
    return snap


def assert_pools_full(s):
    for name, pool in all_pools(s):
        assert pool.available_size() == pool.size, name
        pool.check_integrity()
    rp = s.req_to_token_pool
    assert rp.available_size() == rp.size + rp.pre_alloc_size


def assert_clean_idle(s, protected=0):
    """Run to idle: every identity holds, integrity passes, nothing is locked but ``protected``."""
    s.run_until_idle()
    assert s.is_fully_idle()
    bad = [c.message() for c in s.check_memory() if not c.ok]
    assert not bad, bad
    assert s.last_idle_check is not None and all(c.ok for c in s.last_idle_check)
    s.check_integrity()
    assert token_check(s).protected == protected
    assert unreferenced_pages(s) == set()


def flush_and_assert_full(s):
    s.request_flush_cache()
    s.run_until_idle()
    assert s.flush_results[-1] is True
    assert_pools_full(s)


def the_req(s, rid):
    """The live Req ``rid`` (running, in the last batch, waiting or staging)."""
    groups = [s.running_batch, s.last_batch.reqs if s.last_batch else [], s.waiting_queue]
    if s.hisparse_coordinator is not None:
        groups.append(s.hisparse_coordinator.staging_reqs())
    return next(r for g in groups for r in g if r.rid == rid)


def count_frees(s):
    """Wrap the token allocator's and the row pool's ``free``; returns ``(slot_counter, row_counter)``.

    Inside a free group ``free`` only records (``free_group_end`` calls it again to apply), so only
    applied frees are counted."""
    slots, rows = Counter(), Counter()
    alloc, rp = s.token_to_kv_pool_allocator, s.req_to_token_pool
    free_slots, free_rows = alloc.free, rp.free

    def counted_free(index):
        if alloc.is_not_in_free_group:
            slots.update(index.tolist())
        free_slots(index)

    def counted_row_free(r):
        rows.update([r] if isinstance(r, int) else list(r))
        free_rows(r)

    alloc.free, rp.free = counted_free, counted_row_free
    return slots, rows


# == A. the zoo switches, on and off =============================================================

@on_off("overlap-abort-double-free")
def test_zoo_overlap_abort_double_free(bugs):
    """An abort that lands while the request's batch is in flight: with the switch the abort frees
    the KV and the row at once and the delayed result frees them again (duplicates in both free
    lists); without it the result processing releases the request exactly once."""
    s = make("overlap", bugs)
    rid = s.add_request([5, 6, 7, 8], 4)
    s.step()
    req = the_req(s, rid)
    row = req.kv.req_pool_idx
    assert req in s.last_batch.reqs and req.future_ids and not req.output_ids  # in flight
    s.abort_request(rid)
    s.step()
    assert req.finished_reason == FinishReason.ABORT
    rows = s.req_to_token_pool.free_slots
    pages = free_pages(s)
    if bugs:
        assert rows.count(row) == 2
        assert len(pages) > len(set(pages))
        assert s.token_to_kv_pool_allocator.available_size() > s.token_to_kv_pool_allocator.size
        with pytest.raises(PoolIntegrityError):
            s.check_integrity()
    else:
        assert rows.count(row) == 1 and len(pages) == len(set(pages))
        s.check_integrity()
        assert_clean_idle(s)
        assert_pools_full(s)  # nothing was cached: an aborted request is not inserted
        flush_and_assert_full(s)


@on_off("aborted-kv-inserted")
def test_zoo_aborted_kv_inserted(bugs):
    """Request A decodes, is aborted and ends. Its last decode slot was allocated but, being
    aborted, its forward never wrote the KV there. With the switch A is cached like a finished
    request: the tree covers A's whole committed length, including that never-written slot (its
    K is still all zeros). Without it the tree holds only what A's prefill checkpoint published."""
    s = make("overlap", bugs, model="tiny")
    prompt = [5, 6, 7, 8]
    rid = s.add_request(prompt, 10)
    for _ in range(4):
        s.step()
    req = the_req(s, rid)
    assert len(req.output_ids) == 3 and not req.finished()  # decoding
    checkpointed = s.tree_cache.protected_size()
    assert checkpointed == len(prompt) + 1  # the prefill checkpoint (overlap: one decode slot ahead)
    s.abort_request(rid)
    while not req.finished():
        s.step()
    assert req.finished_reason == FinishReason.ABORT
    committed = req.kv.kv_committed_len
    assert committed == len(prompt) + len(req.output_ids)  # the last position's forward was skipped
    s.run_until_idle()
    tree = s.tree_cache
    k = s.kv_pool.k_buffer
    tree_slots = torch.cat([n.value for n in tree.nodes()])
    written = k[:, tree_slots].abs().flatten(start_dim=2).sum(dim=(0, 2)) > 0  # per slot
    if bugs:
        assert tree.evictable_size() == tree.total_size() == committed
        assert not bool(written[-1]), "the tree's last slot should hold never-written KV"
        assert bool(written[:-1].all())
        assert tree.match_prefix(req.fill_ids).device_indices.numel() == committed
    else:
        assert tree.evictable_size() == tree.total_size() == checkpointed
        assert bool(written.all())
        assert_clean_idle(s)
        flush_and_assert_full(s)


@on_off("evictable-size-uses-key-len")
def test_zoo_evictable_size_uses_key_len(bugs):
    """A 20-token prompt with 16-token pages: the tree holds one page. With the switch the
    evictable counter grew by the unaligned key length (20) instead of the value length (16): the
    recount differs and the idle identity over-counts; memory itself is intact."""
    s = make("paged", bugs)
    s.add_request(list(range(2, 22)), 3)
    s.run_until_idle()
    tree, alloc = s.tree_cache, s.token_to_kv_pool_allocator
    assert tree.total_size() == 16
    assert alloc.available_size() == alloc.size - 16
    assert unreferenced_pages(s) == set()  # memory is intact either way
    recount = sum(len(n.key) for n in tree.nodes() if n.value is not None and n.lock_ref == 0)
    assert recount == 16
    if bugs:
        assert tree.evictable_size() == 20 != recount
        with pytest.raises(PoolIntegrityError):
            tree.check_integrity()
        assert not token_check(s).ok
    else:
        assert tree.evictable_size() == recount
        assert_clean_idle(s)
        flush_and_assert_full(s)


@on_off("session-close-while-running")
def test_zoo_session_close_while_running(bugs):
    """Close a session while its turn decodes. With the switch the slot is released at once: the
    turn's row and its private slots are in the free lists while the turn still uses them; when
    the turn ends its row is freed again and the freed slots are cached into the tree (free and
    referenced at once). Without it the close waits for the turn."""
    s = make("streaming-session", bugs)
    sid = s.open_session("s")
    rid = s.add_request([5, 6, 7, 8], 6, session_id=sid)
    for _ in range(3):
        s.step()
    req = the_req(s, rid)
    assert req.kv.kv_allocated_len > req.kv.cache_protected_len  # private decode slots exist
    s.close_session(sid)
    s.step()
    assert not req.finished()
    row, kv = req.kv.req_pool_idx, req.kv
    private = s.req_to_token_pool.req_to_token[row, kv.cache_protected_len : kv.kv_allocated_len - 1].tolist()
    assert private  # the slots the close saw (the newest one was allocated after it)
    if bugs:
        assert row in s.req_to_token_pool.free_slots  # the running turn's row is free
        assert set(private) <= set(free_pages(s))  # slots the turn reads are free
        assert "s" not in s.session_controller.sessions
        s.run_until_idle()
        assert s.req_to_token_pool.free_slots.count(row) == 2  # the row is freed twice
        # the turn's release cached its row into the tree, freed slots included: still in use
        assert set(private) <= set(free_pages(s)) & referenced_pages(s)
        with pytest.raises(PoolIntegrityError):
            s.check_integrity()
    else:
        assert row not in s.req_to_token_pool.free_slots
        assert not set(private) & set(free_pages(s))
        assert "s" in s.session_controller.sessions
        s.check_integrity()
        assert_clean_idle(s)
        assert "s" not in s.session_controller.sessions
        flush_and_assert_full(s)


@on_off("session-tail-not-trimmed")
def test_zoo_session_tail_not_trimmed(bugs):
    """A turn that stops (stop_at=2) gets one extra overlap decode slot after its stop token. With
    the switch the record goes to the session without freeing that tail: after the close, the slot
    is in no free list, no tree node and no row. Without it the tail is trimmed."""
    s = make("streaming-session", bugs)
    sid = s.open_session("s")
    prompt = [5, 6, 7, 8]
    rid = s.add_request(prompt, 8, stop_at=2, session_id=sid)
    s.step()
    req = the_req(s, rid)
    decode_slots = []
    while not req.finished():
        s.step()
        b = s.last_batch
        if b is not None and b.forward_mode == "decode" and req in b.reqs:
            decode_slots.append(int(b.out_cache_loc[b.reqs.index(req)]))
    assert req.finished_reason == FinishReason.STOP and req.output_ids[-1] == EOS
    owned = len(prompt) + req.finished_len
    assert len(decode_slots) == 2  # positions 4 (kept) and 5 (after the stop: the overshoot)
    extra = decode_slots[-1]
    s.run_until_idle()
    slot = s.session_controller.sessions["s"].slot
    assert slot.kv.kv_allocated_len == slot.kv.kv_committed_len == owned
    s.close_session(sid)
    s.run_until_idle()
    alloc, tree = s.token_to_kv_pool_allocator, s.tree_cache
    if bugs:
        assert unreferenced_pages(s) == {extra}
        assert alloc.available_size() + tree.evictable_size() + tree.protected_size() == alloc.size - 1
        assert not token_check(s).ok
    else:
        assert extra in free_pages(s)
        assert_clean_idle(s)
        flush_and_assert_full(s)


@on_off("session-abort-borrows-slot")
def test_zoo_session_abort_borrows_slot(bugs):
    """Turn 1 (20 + 6 tokens) completes; turn 2 (history 26 + 30 + 10 > 64) is pre-aborted at
    intake. With the switch it still borrows the session record and writes committed=1 back:
    session_held goes negative and turn 1's private slots leak after the close. Without it the
    pre-aborted turn runs on a row of its own and the session is untouched."""
    s = make("streaming-session", bugs)
    assert s.config.context_len == 64
    sid = s.open_session("s")
    s.add_request(list(range(2, 22)), 6, session_id=sid)
    s.run_until_idle()
    slot = s.session_controller.sessions["s"].slot
    row = slot.kv.req_pool_idx
    table = s.req_to_token_pool.req_to_token
    turn1_private = table[row, slot.kv.cache_protected_len : slot.kv.kv_allocated_len].tolist()
    assert turn1_private and s.session_held_tokens() == len(turn1_private)
    rid2 = s.add_request(list(range(30, 60)), 10, session_id=sid)
    s.run_until_idle()
    assert outputs(s)[rid2].reason == FinishReason.ABORT
    if bugs:
        assert slot.kv.kv_committed_len == 1
        assert s.session_held_tokens() < 0
        assert token_check(s).session_held < 0
    else:
        assert slot.kv.kv_committed_len == slot.kv.kv_allocated_len == 20 + 6 - 1
        assert s.session_held_tokens() == len(turn1_private)
        assert table[row, slot.kv.cache_protected_len : slot.kv.kv_allocated_len].tolist() == turn1_private
        assert_clean_idle(s, protected=s.tree_cache.protected_size())
    s.close_session(sid)
    s.run_until_idle()
    if bugs:
        leaked = unreferenced_pages(s)
        assert set(turn1_private) <= leaked
        assert not token_check(s).ok
    else:
        assert set(turn1_private) <= set(free_pages(s))
        assert_clean_idle(s)
        flush_and_assert_full(s)


@on_off("session-borrow-double-count")
def test_zoo_session_borrow_double_count(bugs):
    """A first turn runs on its session's record. With the switch the busy identity counts that
    record as session_held *and* as the turn's uncached KV and reports a leak, while integrity
    passes and every allocated slot is referenced. Without it the identity holds."""
    s = make("streaming-session", bugs)
    sid = s.open_session("s")
    rid = s.add_request([5, 6, 7, 8], 6, session_id=sid)
    s.step()
    req = the_req(s, rid)
    assert req.borrowed_slot is not None and req.kv is req.session.slot.kv
    alloc = s.token_to_kv_pool_allocator
    c = token_check(s, idle=False)
    assert c.session_held == 4
    s.check_integrity()  # memory is intact...
    assert unreferenced_pages(s) == set()
    assert alloc.available_size() + len(referenced_pages(s)) == alloc.size
    if bugs:
        assert c.uncached == 4 and not c.ok  # ...but the identity double counts
        assert c.available + c.evictable + c.protected + c.session_held + c.uncached == alloc.size + 4
    else:
        assert c.uncached == 0 and c.ok
        while not s.is_fully_idle():
            s.step()
            assert token_check(s).ok
        s.close_session(sid)
        assert_clean_idle(s)
        flush_and_assert_full(s)


def _demote_prefix(s, prefix):
    """Cache ``prefix`` through a request, then evict it to host with memory pressure."""
    s.add_request(prefix + [40], 3)
    s.run_until_idle()
    s.memory_pressure()
    s.step()
    tree = s.tree_cache
    m = tree.match_prefix(prefix)
    assert m.device_indices.numel() == 0 and m.host_hit_length == len(prefix)  # host-only now
    assert s.token_to_kv_pool_allocator.available_size() == s.token_to_kv_pool_allocator.size


@on_off("hicache-abort-loadback-leak")
def test_zoo_hicache_abort_loadback_leak(bugs):
    """A request sharing a host-only prefix starts its load-back and is aborted before the ack.
    With the switch the load-back record is dropped unreleased: at idle the loaded node keeps
    lock_ref 1 (protected tokens with no request) and its host copy stays pinned. Without it the
    orphaned load-back is released at its ack."""
    s = make("hicache", bugs)
    assert s.config.host_ack_latency_steps == 2
    prefix = list(range(2, 34))
    _demote_prefix(s, prefix)
    rid = s.add_request(prefix + [50, 51], 3)
    s.step()
    req = the_req(s, rid)
    rec = req.load_back
    assert rec is not None and not s.tree_cache.load_back_ready(rec)
    node = rec.node
    assert node.lock_ref == 1 and node.host_ref == 1 and s.tree_cache.protected_size() == len(prefix)
    s.abort_request(rid)
    s.step()
    assert outputs(s)[rid].reason == FinishReason.ABORT
    assert not s.tree_cache.load_back_ready(rec)  # the abort came before the ack
    s.run_until_idle()
    tree = s.tree_cache
    assert not s.requests_owning_rows() and not s.waiting_queue
    if bugs:
        assert node.lock_ref == 1 and node.host_ref == 1
        assert tree.protected_size() == len(prefix) and token_check(s).protected == len(prefix)
        assert not rec.released
    else:
        assert node.lock_ref == 0 and node.host_ref == 0 and rec.released
        assert tree.protected_size() == 0 and tree.evictable_size() == len(prefix)
        assert_clean_idle(s)
        flush_and_assert_full(s)


# == B. overlap scheduling really lags ===========================================================

def test_overlap_result_is_processed_one_step_later():
    """With overlap, the token sampled by a batch waits in ``future_ids`` until the next step, which
    has already launched the next decode batch (and allocated its slot) before processing it."""
    s = make("overlap")
    prompt = [5, 6, 7, 8]
    rid = s.add_request(prompt, 4)
    s.step()
    req = the_req(s, rid)
    assert len(req.future_ids) == 1 and req.output_ids == []
    assert req.kv.kv_allocated_len == len(prompt)
    first = req.future_ids[0]
    s.step()
    assert req.output_ids == [first]  # processed now...
    assert s.last_batch.forward_mode == "decode" and s.last_batch.reqs == [req]
    assert req.kv.kv_allocated_len == len(prompt) + 1  # ...after the next slot was allocated
    assert len(req.future_ids) == 1  # and the new batch's token waits in turn
    slot = int(s.last_batch.out_cache_loc[0])
    assert s.req_to_token_pool.req_to_token[req.kv.req_pool_idx, len(prompt)] == slot
    assert slot not in free_pages(s)
    s.run_until_idle()
    assert len(outputs(s)[rid].output_ids) == 4


def test_overlap_gives_a_stopped_request_one_extra_slot_and_releases_it():
    """A request whose stop token was sampled is scheduled for one more decode step (the result is
    not processed yet); the extra slot is released with it and ends up back in the free list."""
    s = make("overlap")
    prompt = [5, 6, 7, 8]
    rid = s.add_request(prompt, 8, stop_at=2)
    s.step()
    s.step()
    req = the_req(s, rid)
    assert req.output_ids and not req.finished() and len(req.future_ids) == 1  # the stop is in flight
    s.step()
    assert req.finished_reason == FinishReason.STOP and req.output_ids[-1] == EOS
    b = s.last_batch
    assert b.forward_mode == "decode" and req in b.reqs  # scheduled although it has stopped
    extra = int(b.out_cache_loc[b.reqs.index(req)])
    assert len(prompt) + req.finished_len == len(prompt) + 1  # owned: the stop token is not kept
    assert extra in free_pages(s)  # released with the request
    assert not req.kv.holds_kv
    assert_clean_idle(s)
    assert s.tree_cache.total_size() == len(prompt) + 1
    assert extra not in referenced_pages(s)
    flush_and_assert_full(s)


# == C. streaming sessions =======================================================================

def test_session_close_during_a_turn_is_deferred_and_frees_once():
    """A close while a turn is in flight is deferred (the session stays open) and the turn's KV is
    freed exactly once, after the turn: no slot or row is freed twice, every slot the turn
    allocated is freed once or held by the tree, and the pools are full after a flush."""
    s = make("streaming-session")
    slot_frees, row_frees = count_frees(s)
    sid = s.open_session("s")
    rid = s.add_request([5, 6, 7, 8], 6, session_id=sid)
    turn_slots = set()
    s.step()
    req = the_req(s, rid)
    row = req.kv.req_pool_idx
    table = s.req_to_token_pool.req_to_token
    for _ in range(2):
        s.step()
        turn_slots |= set(table[row, : req.kv.kv_allocated_len].tolist())
    s.close_session(sid)
    s.step()
    assert "s" in s.session_controller.sessions
    assert s.session_controller.sessions["s"].close_on_finish
    assert s.metrics()["num_streaming_sessions"] == 1
    assert not slot_frees and not row_frees  # nothing freed yet
    while req.kv.holds_kv:
        turn_slots |= set(table[row, : req.kv.kv_allocated_len].tolist())
        s.step()
    assert outputs(s)[rid].reason == FinishReason.LENGTH
    s.run_until_idle()
    assert "s" not in s.session_controller.sessions
    assert s.metrics() == {"num_streaming_sessions": 0, "streaming_session_held_tokens": 0}
    assert max(slot_frees.values()) == 1 and row_frees == Counter({row: 1})
    tree_slots = set(torch.cat([n.value for n in s.tree_cache.nodes()]).tolist())
    assert not tree_slots & set(slot_frees)
    assert turn_slots == tree_slots | set(slot_frees)
    assert_clean_idle(s)
    flush_and_assert_full(s)


def test_session_second_turn_in_flight_is_rejected_and_the_first_is_unaffected():
    """While a turn is in flight a second turn of the same session is rejected (it finishes with
    an abort after a one-token prefill); the first turn's output and the session's record are
    exactly those of a run without the second turn."""
    def run(second: bool):
        s = make("streaming-session")
        sid = s.open_session("s")
        a = s.add_request([5, 6, 7, 8], 5, session_id=sid)
        s.step()
        b = s.add_request([9, 10], 3, session_id=sid) if second else None
        s.run_until_idle()
        slot = s.session_controller.sessions["s"].slot
        # The session's KV: its record's lengths, and the tokens it holds (tree lock + private).
        held = s.tree_cache.protected_size() + s.session_held_tokens()
        return s, a, b, (slot.kv.kv_committed_len, slot.kv.kv_allocated_len, held)

    ref, a_ref, _, rec_ref = run(False)
    s, a, b, rec = run(True)
    out = outputs(s)
    assert out[b].reason == FinishReason.ABORT and len(out[b].output_ids) == 1
    assert out[a].reason == FinishReason.LENGTH
    assert out[a].output_ids == outputs(ref)[a_ref].output_ids
    assert rec == rec_ref
    assert s.session_controller.sessions["s"].last_req.rid == a
    assert_clean_idle(s, protected=s.tree_cache.protected_size())
    s.close_session("s")
    assert_clean_idle(s)
    flush_and_assert_full(s)


def test_session_turn_continues_on_the_previous_record():
    """Turn 2 borrows turn 1's record: it is admitted with the record's committed length as its
    prefix (no re-prefill of the history) on the same row, and the streaming metric equals the
    session_held term of the identity throughout."""
    s = make("streaming-session")
    seen, orig = [], s.alloc_for_extend

    def spy(batch):
        seen.extend((r.rid, r.prefix_len, r.extend_end, r.kv.req_pool_idx) for r in batch.reqs)
        orig(batch)

    s.alloc_for_extend = spy
    sid = s.open_session("s")
    p1, p2 = [5, 6, 7, 8], [20, 21, 22]
    r1 = s.add_request(p1, 4, session_id=sid)
    s.run_until_idle()
    out1 = outputs(s)[r1].output_ids
    slot = s.session_controller.sessions["s"].slot
    row = slot.kv.req_pool_idx
    assert slot.kv.kv_committed_len == len(p1) + len(out1) - 1  # the last token's KV is never computed
    rows_before = s.req_to_token_pool.available_size()
    r2 = s.add_request(p2, 3, session_id=sid)
    s.step()
    (_, prefix, end, row2), = [e for e in seen if e[0] == r2]
    assert prefix == len(p1) + len(out1) - 1 > 0
    assert end == len(p1) + len(out1) + len(p2)
    assert row2 == row and s.req_to_token_pool.available_size() == rows_before
    while not s.is_fully_idle():
        assert s.metrics()["streaming_session_held_tokens"] == token_check(s, idle=False).session_held
        assert token_check(s, idle=False).ok
        s.step()
    s.run_until_idle()
    assert outputs(s)[r2].reason == FinishReason.LENGTH
    assert s.metrics() == {"num_streaming_sessions": 1,
                           "streaming_session_held_tokens": token_check(s).session_held}
    assert token_check(s).session_held == slot.kv.kv_allocated_len - slot.kv.cache_protected_len > 0
    s.close_session(sid)
    assert_clean_idle(s)
    flush_and_assert_full(s)


def tree_slots_in_free_list(s) -> list[int]:
    """Device slots a tree node references that are also in the free list (use-after-free)."""
    free = set(free_pages(s))
    return sorted(x for n in s.tree_cache.nodes() if n.value is not None for x in n.value.tolist() if x in free)


def _retract_first_turn(s, sid):
    """A plain request keeps decoding while the session's first turn (20 tokens) is checkpointed
    into the tree, then memory pressure retracts the turn (the fewest outputs) to the waiting queue.
    Returns the turn's Req."""
    s.add_request([50, 51, 52, 53, 54], 20)
    s.step()
    s.step()
    s.open_session(sid)
    rid = s.add_request(list(range(2, 22)), 6, session_id=sid)
    s.step()
    s.step()
    turn = the_req(s, rid)
    assert turn.kv.cache_protected_len == turn.kv.kv_committed_len == 21  # prompt + the in-flight slot
    s.memory_pressure()
    s.step()
    assert s.num_retractions == 1 and turn in s.waiting_queue
    slot = s.session_controller.sessions[sid].slot
    assert (slot.kv.kv_committed_len, slot.kv.cache_protected_len) == (21, 21)
    return turn


def test_session_turn_retracted_after_its_checkpoint_resumes_without_freeing_tree_slots():
    """Overlap + retraction of a session's first turn: the record's committed length (21: prompt
    + the in-flight slot) exceeds the resumed key length (20). Resuming must not free row[20:21],
    which the tree holds under the session's lock, and the fresh slot written at position 20 must
    be freed at the end (regression: both went wrong before ``SessionController._prefix``)."""
    s = make("streaming-session")
    turn = _retract_first_turn(s, "s")
    s.step()  # re-admitted on the session's record
    assert turn.kv.holds_kv and turn.borrowed_slot is not None
    assert tree_slots_in_free_list(s) == []
    s.run_until_idle()
    s.close_session("s")
    assert_clean_idle(s)
    assert tree_slots_in_free_list(s) == []


def test_session_turn_aborted_after_retraction_leaves_no_record_for_the_next_turn():
    """A retracted first turn waits with its record parked in the session slot; an abort there ends
    the turn and, like any aborted turn, destroys the slot. The next turn, with unrelated tokens,
    must compute everything (prefix 0) instead of reading the aborted turn's KV as its own, and
    no tree slot is freed (regression: the record used to stay in the slot)."""
    s = make("streaming-session")
    seen, orig = [], s.alloc_for_extend

    def spy(batch):
        seen.extend((r.rid, r.prefix_len) for r in batch.reqs)
        orig(batch)

    s.alloc_for_extend = spy
    turn = _retract_first_turn(s, "s")
    s.abort_request(turn.rid)
    s.step()
    assert outputs(s)[turn.rid].reason == FinishReason.ABORT
    assert s.session_controller.sessions["s"].history() == []
    new = list(range(70, 90))  # no token in common with the aborted turn
    rid = s.add_request(new, 4, session_id="s")
    s.step()
    assert [p for r, p in seen if r == rid] == [0]  # nothing of this turn was ever computed
    assert tree_slots_in_free_list(s) == []
    s.check_integrity()
    s.run_until_idle()
    s.close_session("s")
    assert_clean_idle(s)


# == D. health checks in every preset ============================================================

def _spy_takes(s):
    """Record the pages the main token allocator hands out and the rows the row pool hands out."""
    pages, rows, prealloc = [], [], []
    alloc, rp = s.token_to_kv_pool_allocator, s.req_to_token_pool
    take, row_alloc, pre = alloc._take_pages, rp.alloc, s._pre_alloc

    def spy_take(k):
        got = take(k)
        if got is not None:
            pages.extend(got.tolist())
        return got

    def spy_rows(n):
        got = row_alloc(n)
        if got is not None:
            rows.extend(got)
        return got

    def spy_pre(req, fill_len):
        prealloc.append((req.rid, fill_len))
        pre(req, fill_len)

    alloc._take_pages, rp.alloc, s._pre_alloc = spy_take, spy_rows, spy_pre
    return pages, rows, prealloc


@pytest.mark.parametrize("preset", list(PRESETS))
def test_health_check_while_idle_takes_one_row_and_one_page(preset):
    """An idle health check runs as a one-token request: exactly one row and one page are taken
    (PD decode: through pre-allocation, with a fake transfer) and given back; the only thing left
    is the tree's copy of the token where the radix cache keeps whole 1-token pages."""
    s = make(preset)
    before = {name: pool.available_size() for name, pool in all_pools(s)}
    rows_before = s.req_to_token_pool.available_size()
    pages, rows, prealloc = _spy_takes(s)
    rid = s.health_check()
    s.run_until_idle()
    out = outputs(s)[rid]
    assert out.reason == FinishReason.LENGTH and len(out.output_ids) == 1
    assert s.health_check_acks == 1
    assert len(rows) == 1 and len(pages) == 1
    assert prealloc == ([(rid, 1)] if s.config.is_pd_decode else [])
    assert s.req_to_token_pool.available_size() == rows_before
    tree = s.tree_cache
    cached = 1 if (s.page_size == 1 and not tree.disable) else 0
    assert tree.total_size() == tree.evictable_size() == cached
    alloc = s.token_to_kv_pool_allocator
    assert alloc.available_size() == before["token_to_kv_pool"] - cached
    assert (pages[0] in free_pages(s)) == (cached == 0)
    for name, pool in all_pools(s)[1:]:
        if name == "hicache_host":  # write-through keeps a host copy of what the tree holds
            assert pool.available_size() == before[name] - tree.host_size() and tree.host_size() == cached
        else:
            assert pool.available_size() == before[name], name
    assert_clean_idle(s)
    flush_and_assert_full(s)


@pytest.mark.parametrize("preset", list(PRESETS))
def test_health_check_while_busy_allocates_nothing_and_is_acked(preset):
    """A health check that arrives while a request runs touches no memory: a twin engine without
    it has identical free lists after every step; the check is acknowledged and never runs."""
    plain, probed = make(preset), make(preset)
    for s in (plain, probed):
        s.add_request(list(range(5, 15)), 6)
        s.step()
        assert not s.is_fully_idle()
    taken = {id(s): _spy_takes(s) for s in (plain, probed)}
    rid = probed.health_check()
    assert snapshot(probed) == snapshot(plain)
    plain.step()
    probed.step()
    assert snapshot(probed) == snapshot(plain)
    assert probed.health_check_acks == 1
    while not plain.is_fully_idle():
        plain.step()
        probed.step()
        assert snapshot(probed) == snapshot(plain)
    probed.run_until_idle()
    plain.run_until_idle()
    assert snapshot(probed) == snapshot(plain)
    # the same pages and rows were handed out, in the same order, with and without the check
    assert taken[id(probed)] == taken[id(plain)]
    assert rid not in outputs(probed) and all(r != rid for r, _ in taken[id(probed)][2])
    assert probed.health_check_acks == 1 and plain.health_check_acks == 0
    assert_clean_idle(probed, protected=0)


# == E. memory pressure ==========================================================================

AGGREGATED = [p for p in PRESETS if not PRESETS[p].config().is_pd_decode]


@pytest.mark.parametrize("preset", AGGREGATED)
def test_memory_pressure_retracts_all_but_one_and_outputs_are_unchanged(preset):
    """Three running requests, then memory pressure: the tree is evicted (HiCache: demoted to host)
    and the next decode retracts two of them; all three still finish with the tokens of a run
    without pressure."""
    warm = list(range(60, 92))  # 32 tokens: whole pages in every preset

    def run(pressure: bool):
        s = make(preset)
        s.add_request(warm, 2)  # cached, unlocked: what pressure evicts
        s.run_until_idle()
        rids = [s.add_request([10 + i, 11 + i, 12 + i, 13 + i, 14 + i], 12) for i in range(3)]
        for _ in range(3):
            s.step()
        assert len(s.running_batch) == 3
        n = s.num_retractions
        if pressure:
            s.memory_pressure()
        s.step()
        retracted = s.num_retractions - n
        m = s.tree_cache.match_prefix(warm)
        s.run_until_idle()
        out = outputs(s)
        return s, retracted, m, [(out[r].reason, out[r].output_ids) for r in rids]

    _, zero, m_plain, plain = run(False)
    s, two, m, pressed = run(True)
    assert zero == 0 and two == 2
    assert pressed == plain and all(reason == FinishReason.LENGTH for reason, _ in pressed)
    if not s.tree_cache.disable:
        assert m_plain.device_indices.numel() == len(warm)
        assert m.device_indices.numel() == 0  # evicted from the device
        if s.hicache_host_pool is not None:
            assert m.host_hit_length == len(warm) and m.host_node.value is None
            assert s.tree_cache.host_size() > 0
    assert_clean_idle(s, protected=s.tree_cache.protected_size())
    flush_and_assert_full(s)


# == F. HiSparse, aggregated =====================================================================

def test_hisparse_prefill_staging_then_running_with_a_device_buffer():
    """prefill -> staging (host backup in flight, not running) -> after host_ack_latency_steps the
    request joins the running batch with its device buffer; prefill slots beyond it are freed."""
    s = make("hisparse")
    hs = s.hisparse_coordinator
    lat = s.config.host_ack_latency_steps
    prompt = list(range(2, 22))
    rid = s.add_request(prompt, 6)
    s.step()
    req = the_req(s, rid)
    row = req.kv.req_pool_idx
    assert req.hisparse_staging and req not in s.running_batch and hs.staging_reqs() == [req]
    assert hs.buffer_size(row) == 0 and hs.device_size(row) == len(prompt)
    assert hs.host_size(row) == len(prompt)
    staged_at = s.forward_ct
    while req.hisparse_staging:
        assert req not in s.running_batch
        s.step()
    assert s.forward_ct == staged_at + lat
    assert req in s.running_batch and req.hisparse_admitted
    assert hs.buffer_size(row) == hs.device_size(row) == hs.device_buffer_size
    dev = hs.hisparse_attn_allocator
    assert dev.available_size() == dev.size - hs.device_buffer_size
    s.check_integrity()
    assert all(c.ok for c in s.check_memory())
    s.run_until_idle()
    assert outputs(s)[rid].reason == FinishReason.LENGTH
    assert_clean_idle(s)
    assert_pools_full(s)


def test_hisparse_request_collected_the_step_after_its_prefill_joins_decode_once():
    """With a zero-latency host ack the staged request is collected in the very step after its
    prefill, while that prefill is still the last batch: it must join the running batch once."""
    s = make("hisparse", host_ack_latency_steps=0)
    rid = s.add_request(list(range(2, 22)), 6)
    s.step()
    s.step()
    assert [r.rid for r in s.running_batch] == [rid]
    s.run_until_idle()
    assert (outputs(s)[rid].reason, len(outputs(s)[rid].output_ids)) == (FinishReason.LENGTH, 6)
    assert_clean_idle(s)
    assert_pools_full(s)


def test_hisparse_abort_while_staging_returns_every_slot():
    """An abort while the request is staging returns every slot of all three pools."""
    s = make("hisparse")
    hs = s.hisparse_coordinator
    rid = s.add_request(list(range(2, 22)), 6)
    s.step()
    req = the_req(s, rid)
    assert req.hisparse_staging
    for name, pool in all_pools(s):
        assert pool.available_size() < pool.size, name
    s.abort_request(rid)
    s.step()
    assert outputs(s)[rid].reason == FinishReason.ABORT
    assert not hs.staging_reqs() and not req.kv.holds_kv and not req.hisparse_staging
    assert_pools_full(s)
    assert not (hs.req_to_host_pool or hs.req_to_device_buffer or hs.req_prefill_physical)
    assert_clean_idle(s)
    assert_pools_full(s)


# == G. pause_generation / continue_generation through the target ===============================

ABORT, IN_PLACE, RETRACT = (PAUSE_MODES.index(m) for m in ("abort", "in_place", "retract"))

PAUSE_PROGRAMS = {
    "in_place": [Submit(0, 20, 8), Submit(1, 40, 6, stop_at=2, ignore_eos=1), Step(2), PauseGeneration(IN_PLACE),
                 Step(5), Submit(2, 10, 4), HealthCheck(), FlushCache(), Abort(0), Step(3), ContinueGeneration(),
                 Step(3), Idle()],
    "retract": [Submit(0, 20, 8), Submit(1, 50, 6, priority=3), Step(2), PauseGeneration(RETRACT), Step(2),
                FlushCache(), Step(1), Submit(0, 12, 3), Abort(0), Step(2), ContinueGeneration(), Idle(), FlushCache(),
                Idle()],
    "abort": [Submit(0, 20, 8), Submit(1, 40, 6), Step(2), PauseGeneration(ABORT), Submit(2, 10, 4, stop_at=1, ignore_eos=1),
              HealthCheck(), Step(4), ContinueGeneration(), Idle()],
    "idle resumes": [Submit(0, 20, 8), Step(1), PauseGeneration(RETRACT), Submit(3, 9, 3), Idle(), FlushCache(), Idle()],
    "stacked": [Submit(0, 50, 8), Submit(2, 30, 8), Step(1), PauseGeneration(IN_PLACE), Abort(None),
                PauseGeneration(RETRACT), PauseGeneration(ABORT), FlushCache(), Step(2), ContinueGeneration(),
                ContinueGeneration(), Submit(1, 5, 2), Idle()],
    # aborted, then retracted with its abort still recorded: its re-prefill (chunked) is computed, so
    # the chunk checkpointed into the tree holds its KV (a breaker's stale-kv false finding)
    "abort then retract": [Submit(3, 21, 11), Submit(3, 12, 9, stop_at=3), Step(3), Abort(None),
                           PauseGeneration(RETRACT), Submit(3, 20, 9, stop_at=5), FlushCache(), Idle()],
}


@pytest.mark.parametrize("name", PAUSE_PROGRAMS)
@pytest.mark.parametrize("preset", sorted({"default", "overlap", "chunked"} | {b.preset for b in BUGS.values()}))
def test_programs_mixing_pause_modes_are_clean(preset, name):
    program = PAUSE_PROGRAMS[name]
    ex = execute(get_preset(preset).config(), program)
    assert ex.findings == [], [f.summary() for f in ex.findings]
    assert ex.ops_run == len(program) and ex.steps > 0


@pytest.mark.parametrize("preset", ["default", "overlap", "chunked", "streaming-session"])
def test_target_retract_pause_lets_a_flush_succeed_with_requests_waiting(preset):
    with AuditedRun(get_preset(preset).config()) as run:
        t = run.target
        for op in [Submit(0, 20, 8), Submit(1, 50, 6), Step(2), PauseGeneration(RETRACT), Submit(2, 9, 3), Step(1)]:
            assert run.apply(op) == []
        assert t.paused and t.engine.paused and len(t.engine.waiting_queue) == 2 and len(t.held) == 1
        assert run.apply(FlushCache()) == [] and run.apply(Step(1)) == []
        assert t.flushed() == 1  # the quiescence oracle checked every pool full at that intake
        assert run.apply(Idle()) == []  # resumes first: the two re-prefill, the held submit runs
        out = outputs(t.engine)
        assert len(out) == 3 and all(o.reason == FinishReason.LENGTH for o in out.values())


def test_target_abort_mode_ends_every_request_while_new_ones_are_held_until_continue():
    with AuditedRun(get_preset("default").config()) as run:
        t = run.target
        for op in [Submit(0, 20, 30), Submit(1, 12, 30), Step(2)]:
            assert run.apply(op) == []
        live = t.live_rids()
        assert len(live) == 2
        for op in [PauseGeneration(ABORT), Submit(2, 9, 3, stop_at=1, ignore_eos=1), HealthCheck(), Step(3)]:
            assert run.apply(op) == []
        assert t.paused and not t.engine.paused  # the tokenizer holds; the scheduler keeps running
        out = outputs(t.engine)
        assert [out[r].reason for r in live] == [FinishReason.ABORT] * 2
        assert t.submitted == live and [h is None for h in t.held] == [False, True]
        assert t.engine.is_fully_idle()
        acks = t.engine.health_check_acks
        assert run.apply(ContinueGeneration()) == [] and not t.paused and not t.held
        assert run.apply(ContinueGeneration()) == [] and len(t.engine.recv_queue) == 3  # not paused: a no-op
        assert run.apply(Idle()) == []
        new = outputs(t.engine)[t.submitted[2]]
        assert (new.reason, len(new.output_ids), new.output_ids[0]) == (FinishReason.LENGTH, 3, EOS)  # ignore_eos
        assert t.engine.health_check_acks == acks + 1


def test_target_in_place_pause_outlasts_the_liveness_window_without_a_finding():
    with AuditedRun(get_preset("default").config()) as run:
        t = run.target
        for op in [Submit(0, 20, 8), Step(2), PauseGeneration(IN_PLACE), Abort(0)]:
            assert run.apply(op) == []
        frozen = t.engine.token_to_kv_pool_allocator.available_size()
        for _ in range(LIVENESS_STEPS // 4 + 5):
            assert run.apply(Step(4)) == []
        assert t.progress() == {} and t.engine.token_to_kv_pool_allocator.available_size() == frozen
        assert run.apply(ContinueGeneration()) == [] and t.progress() != {}
        assert run.apply(Idle()) == []
        assert outputs(t.engine)[t.submitted[0]].reason == FinishReason.ABORT


# == reach: each preset counts the path it exists for ===========================================

@pytest.mark.parametrize("preset, path, cls, method, n", [
    ("hicache", "hicache_backups", "HiRadixCache", "_backup", lambda out, *a: int(out)),
    ("hicache", "hicache_load_backs", "HiRadixCache", "load_back", lambda out, *a: int(out is not None)),
    ("hisparse", "hisparse_staged", "HiSparseCoordinator", "collect_ready_reqs", lambda out, *a: len(out)),
    ("pd-decode-hisparse", "transfers_landed", "Scheduler", "_commit_transfer_to_req", lambda out, *a: int(out)),
    ("priority", "priority_preemptions", "Scheduler", "preempt_to_schedule", lambda out, *a: len(out)),
    ("retract", "oom_retractions", "Scheduler", "retract_decode",
     lambda keep, reqs, force=False: 0 if force else sum(r not in keep and not r.finished() for r in reqs)),
], ids=["hicache-backups", "hicache-load-backs", "hisparse", "pd-decode-hisparse", "priority", "retract"])
def test_a_clean_run_counts_the_path_its_preset_exists_for(monkeypatch, preset, path, cls, method, n):
    """The built-in engine's reach() counted retractions, aborts and flushes, and only session turns and failed
    transfers of the paths its presets exist for: `kvaudit fuzz --preset hicache` printed `reached: aborts=1635,
    flushes=170, retractions=264` with nothing on HiCache's backups and load-backs (hisparse: staging; PD decode:
    transfers landed; priority: preemptions; retract: decode out of memory, beside the memory pressure ops'
    forced retractions). Each path is now counted, and the count matches the engine's own calls, counted here
    on the class (4 seeded random programs of 96 ops, as the searches draw them)."""
    import random
    import time

    from engine_under_test.hicache import HiRadixCache
    from engine_under_test.hisparse import HiSparseCoordinator
    from kvaudit.program import random_program
    from kvaudit.program.schema import max_prompt
    from kvaudit.search.fuzz import FuzzStats, run_program
    from kvaudit.targets import program_features

    owner = {"HiRadixCache": HiRadixCache, "HiSparseCoordinator": HiSparseCoordinator, "Scheduler": Scheduler}[cls]
    real, calls = getattr(owner, method), []

    def counted(self, *a, **k):
        out = real(self, *a, **k)
        calls.append(n(out, *a, *k.values()))
        return out

    monkeypatch.setattr(owner, method, counted)
    config, rng, stats = get_preset(preset).config(), random.Random(0), FuzzStats()
    for _ in range(4):
        program = random_program(rng, 96, max_prompt=max_prompt(config.context_len), features=program_features(config))
        stats.executions += 1
        assert not run_program(config, program, stats, None, time.monotonic() + 3600)[1]
    assert stats.reached[path] == sum(calls) > 0, dict(stats.reached)


def _reach_of(preset: str, ops) -> dict[str, int]:
    with AuditedRun(get_preset(preset).config()) as run:
        for op in ops:
            assert run.apply(op) == []
        return run.target.reach()


@pytest.mark.parametrize("preset, path, reaches, cannot", [
    # a second prompt of the same family matches the first's cached prefix; another family's cannot
    ("default", "prefix_hits", [Submit(0, 20, 2), Idle(), Submit(0, 20, 2), Idle()],
     [Submit(0, 20, 2), Idle(), Submit(1, 20, 2), Idle()]),
    # 80 tokens in 32-token chunks park as chunked_req twice; 20 tokens fit one chunk
    ("chunked", "chunks_parked", [Submit(0, 80, 2), Idle()], [Submit(0, 20, 2), Idle()]),
    # a request decoding when a second one's prefill runs; one request alone never mixes
    ("mixed-chunk", "mixed_batches", [Submit(0, 10, 8), Step(2), Submit(1, 10, 2), Idle()], [Submit(0, 10, 8), Idle()]),
    # the lagged result finishes the request; one aborted while waiting never ran in a batch
    ("overlap", "deferred_finishes", [Submit(0, 10, 3), Idle()], [Submit(0, 10, 3), Abort(0), Idle()]),
    # 128 slots: a second 90-token prompt evicts the first's cached 92 tokens; two of 20 fit beside each other
    # (memory pressure evicts the whole tree, for no allocation)
    ("retract", "evictions_for_alloc", [Submit(0, 90, 2), Idle(), Submit(1, 90, 2), Idle()],
     [Submit(0, 20, 2), Idle(), MemoryPressure(), Idle(), Submit(1, 20, 2), Idle()]),
], ids=["prefix-hits", "chunked", "mixed", "overlap", "evictions"])
def test_a_path_is_counted_where_a_program_takes_it_and_not_where_it_cannot(preset, path, reaches, cannot):
    """The built-in engine's reach() said nothing of the scheduling paths its presets exist for: a clean
    `kvaudit fuzz --preset chunked` printed `reached: aborts=..., flushes=..., retractions=...` whether or not a
    prompt ever parked between chunks (and likewise mixed batches, overlap's lagged results, prefix hits and the
    evictions an allocation makes). Each is counted now: 0 on a program that cannot take the path, more on one
    that does."""
    assert _reach_of(preset, cannot)[path] == 0
    assert _reach_of(preset, reaches)[path] > 0


@pytest.mark.parametrize("preset, absent", [
    ("default", {"chunks_parked", "mixed_batches", "deferred_finishes"}),
    ("chunked", {"mixed_batches", "deferred_finishes"}),
    ("pd-decode", {"prefix_hits", "evictions_for_alloc", "chunks_parked"}),
    ("hisparse", {"prefix_hits", "evictions_for_alloc"}),
])
def test_a_path_the_config_has_no_feature_for_is_not_counted(preset, absent):
    """A counter of a feature the config lacks (chunks without chunked prefill, the tree's paths with the tree
    off) would print as `not reached: ... (not searched)`, as if more search could reach it."""
    assert not absent & set(_reach_of(preset, [Submit(0, 20, 2), Idle()]))


def test_pd_decode_counts_the_prefix_hits_of_its_pre_allocation(monkeypatch):
    """PD decode with the decode-side tree pre-allocates on a locked prefix match (only the suffix is
    transferred): prefix_hits counts those pre-allocations, as many as the engine's own calls with a match."""
    import random
    import time

    from kvaudit.program import random_program
    from kvaudit.program.schema import max_prompt
    from kvaudit.search.fuzz import FuzzStats, run_program
    from kvaudit.targets import program_features

    real, hits = Scheduler._pre_alloc, []

    def counted(self, req, fill_len):
        hits.append(req.prefix_indices is not None and req.prefix_indices.numel() > 0)
        return real(self, req, fill_len)

    monkeypatch.setattr(Scheduler, "_pre_alloc", counted)
    config, rng, stats = get_preset("pd-decode-radix").config(), random.Random(0), FuzzStats()
    for _ in range(4):
        program = random_program(rng, 96, max_prompt=max_prompt(config.context_len), features=program_features(config))
        stats.executions += 1
        assert not run_program(config, program, stats, None, time.monotonic() + 3600)[1]
    assert stats.reached["prefix_hits"] == sum(hits) > 0 and not all(hits), dict(stats.reached)
