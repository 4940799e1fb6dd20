"""Engine facts of issue 18, divergences 1-5: admission, intake, prefill eviction, the last
retraction and the next chunk, each as SGLang 0.5.23 computes it (``managers/schedule_policy.py``
``PrefillAdder``, ``mem_cache/prefill_budget.py``, ``Scheduler.init_req_max_new_tokens``,
``mem_cache/allocation.py``, ``ScheduleBatch.retract_decode``).

A "tenant" below is a block of slots the test takes straight from the allocator: memory that
something outside the running batch holds (a session, another server's pin), planted from the test.
"""

import pytest

from engine_under_test import FinishReason, Scheduler

from kvaudit.targets.eut.presets import get_preset
from test_engine_paths import assert_clean_idle, outputs


def _engine(preset="default", **kw):
    return Scheduler(get_preset(preset).config(**kw))


def _prompt(first, n):
    return [first + i for i in range(n)]


# -- 1. admission -----------------------------------------------------------------------------------

def test_admission_charges_the_running_requests_no_page_and_the_new_one_one_page():
    """64 slots, A (10 + 10) running: rem_total = 54 free - 9 of A's remaining output = 45, and B
    needs 22 + 21 + 1 page = 44 < 45, so SGLang admits B next to A. The old rule (B's 2 pages of
    slack plus a page for A) made B wait for A."""
    eng = _engine(num_slots=64)
    eng.add_request(_prompt(2, 10), 10)
    eng.step()  # A's prefill
    b = eng.add_request(_prompt(40, 22), 21)
    eng.step()
    assert not eng.waiting_queue, "B waits although SGLang's PrefillAdder admits it"
    assert b not in outputs(eng)
    assert_clean_idle(eng)
    assert outputs(eng)[b].reason == FinishReason.LENGTH


def test_admission_at_ratio_zero_still_budgets_the_new_requests_own_output():
    """At new_token_ratio 0 only the running requests' output is discounted: B (20 + 30) needs 51
    tokens of the 44 A leaves free, so it waits until A is done (the old rule admitted it at once)."""
    eng = _engine(num_slots=64, new_token_ratio=0.0)
    a = eng.add_request(_prompt(2, 20), 5)
    eng.step()
    b = eng.add_request(_prompt(40, 20), 30)
    while eng.recv_queue or eng.waiting_queue:  # B is admitted in the first round after A has finished
        eng.step()
    assert a in outputs(eng), "B was admitted before A finished"
    assert_clean_idle(eng)
    assert outputs(eng)[b].reason == FinishReason.LENGTH and len(outputs(eng)[b].output_ids) == 30


# -- 2. intake ------------------------------------------------------------------------------------

@pytest.mark.parametrize("prompt_len, max_new, reason, n_out", [
    (50, 20, FinishReason.LENGTH, 12),  # trimmed to 63 - 50 - 1 = 12 (max_req_len = min(127, 63))
    (57, 6, FinishReason.LENGTH, 5),    # trimmed to 5; the old estimate (57 + 6 + 2 > 64) aborted it
    (58, 1, FinishReason.ABORT, 1),     # 58 >= max_req_input_len = 63 - 5: rejected on input length
])
def test_intake_rejects_only_on_input_length_and_trims_max_new_tokens(prompt_len, max_new, reason, n_out):
    eng = _engine(num_slots=64)
    rid = eng.add_request(_prompt(2, prompt_len), max_new)
    assert_clean_idle(eng)
    out = outputs(eng)[rid]
    assert (out.reason, len(out.output_ids)) == (reason, n_out)


def test_a_rejected_request_runs_its_one_token_prefill():
    """set_finish_with_abort: the rejected request is queued and prefilled with one token."""
    eng = _engine(num_slots=64)
    rid = eng.add_request(_prompt(2, 60), 2)
    eng.step()  # intake + the 1-token prefill
    (req,) = eng.last_batch.reqs
    assert (req.rid, req.origin_input_ids, req.extend_end) == (rid, [2], 1)


# -- 3. prefill eviction at page size 1 ---------------------------------------------------------------

def test_prefill_at_page_size_one_evicts_exactly_the_shortfall():
    """Six cached 5-token prompts (30 evictable, 34 free); C's 44-token prefill is 10 short, so
    SGLang's alloc_token_slots evicts two leaves. The old estimate (one page more per request)
    evicted a third, losing a cache hit."""
    eng = _engine(num_slots=64)
    for i in range(6):
        eng.add_request(_prompt(2 + 10 * i, 5), 1)
    eng.run_until_idle()
    tree, alloc = eng.tree_cache, eng.token_to_kv_pool_allocator
    assert (tree.evictable_size(), alloc.available_size()) == (30, 34)
    eng.add_request(_prompt(80, 44), 2)
    eng.step()
    assert tree.evictable_size() == 20
    assert_clean_idle(eng)


# -- 4. the last decoding request aborted by retraction ------------------------------------------------

def test_retraction_that_aborts_the_last_request_returns_no_batch():
    """Page 4: the only running request needs a fresh page and a tenant holds every free one.
    retract_decode aborts it; the old loop then called alloc_decode([]) and raised IndexError."""
    eng = _engine("retract")
    alloc = eng.token_to_kv_pool_allocator
    rid = eng.add_request(_prompt(2, 8), 20)
    eng.step()  # prefill: 8 tokens, the next position starts a page
    tenant = alloc.alloc(alloc.available_size())
    assert eng.step() is False  # no batch ran
    assert outputs(eng)[rid].reason == FinishReason.ABORT and not eng.running_batch
    alloc.free(tenant)
    assert_clean_idle(eng)


# -- 5. the next chunk of a parked chunked request ------------------------------------------------------

def test_next_chunk_is_bounded_by_what_memory_is_left_and_waits_at_zero():
    """Chunk 8: A's first chunk parks it. A tenant leaves 4 free slots: the next chunk is
    min(8, rem_total) = 4 (the old code took 8 and raised 'Prefill out of memory'); with nothing
    left it waits; once the tenant goes it runs to the end."""
    eng = _engine("chunked", chunked_prefill_size=8, num_slots=64)
    alloc = eng.token_to_kv_pool_allocator
    rid = eng.add_request(_prompt(2, 30), 1)
    eng.step()
    a = eng.chunked_req
    assert a is not None and a.kv.kv_committed_len == 8
    tenant = alloc.alloc(alloc.available_size() - 4)
    eng.step()
    assert a.kv.kv_committed_len == 12 and eng.chunked_req is a
    eng.step()  # nothing left: it waits, holding what it has
    assert a.kv.kv_committed_len == 12 and eng.chunked_req is a
    alloc.free(tenant)
    assert_clean_idle(eng)
    assert outputs(eng)[rid].reason == FinishReason.LENGTH


def test_mixed_chunk_program_whose_decodes_shrink_memory_between_chunks_does_not_crash():
    """A fuzzed program: with mixed chunk at ratio 0 the running rows decode while a prompt is
    chunked, so memory shrinks between its chunks (the old code raised 'Prefill out of memory')."""
    eng = _engine("mixed-chunk", num_slots=64, chunked_prefill_size=8, new_token_ratio=0.0)
    for n, max_new in ((36, 15), (30, 13), (22, 39), (7, 39)):  # prompts share their prefixes
        eng.add_request(_prompt(2, n), max_new)
    assert_clean_idle(eng)
    assert len(eng.finished_outputs) == 4
