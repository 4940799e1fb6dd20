"""The injected faults of the vLLM target (``--bug``, :data:`~kvaudit.targets.vllm.config.FAULTS`), as wrappers
on vLLM's *instances* (never its classes or code). Apart from the drivers: kvaudit's frames are never sites, so
a fault's free is located at the vLLM function (or manager-level driver method) that called the wrapped one.
"""

from __future__ import annotations


def inject(manager, faults: set[str]) -> None:
    """Wrap ``manager.free`` and ``manager.block_pool._insert_block_hash`` for the names in ``faults``
    (a set the wrappers empty: each fault fires once, on its first chance)."""
    pool = manager.block_pool
    if faults & {"skip-free", "double-free-shared-prefix"}:
        free = manager.free

        def free_with_faults(request):
            if "skip-free" in faults and request.is_finished():
                faults.discard("skip-free")
                for mgr in manager.coordinator.single_type_managers:  # the table goes, the refs stay
                    mgr.req_to_blocks.pop(request.request_id, None)
                    mgr.num_cached_block.pop(request.request_id, None)
                return None
            blocks = [b for g in manager.coordinator.single_type_managers
                      for b in g.req_to_blocks.get(request.request_id, ()) if not b.is_null]
            out = free(request)
            shared = [b for b in blocks if b.ref_cnt > 0]
            if "double-free-shared-prefix" in faults and shared:
                faults.discard("double-free-shared-prefix")
                pool.free_blocks(shared)
            return out

        manager.free = free_with_faults
    if "drop-hash-entry" in faults:
        # vLLM >= 0.24.0 inserts through the pool's helper; 0.23.0 through the map's own insert
        owner = pool if hasattr(pool, "_insert_block_hash") else pool.cached_block_hash_to_block
        name = "_insert_block_hash" if owner is pool else "insert"
        insert = getattr(owner, name)

        def insert_dropping(block_hash, block, *a, **k):
            out = insert(block_hash, block, *a, **k)
            if "drop-hash-entry" in faults and block.block_hash == block_hash:
                faults.discard("drop-hash-entry")
                pool.cached_block_hash_to_block.pop(block_hash, block.block_id)
            return out

        setattr(owner, name, insert_dropping)


def inject_scheduler(scheduler, faults: set[str], status) -> None:
    """Wrap the ``scheduler`` instance's methods for the scheduler-level names in ``faults`` (each as
    :data:`~kvaudit.targets.vllm.config.FAULTS` describes it, at the method named there: ``add_request``,
    ``finish_requests``, ``update_from_output``, ``_preempt_request``, ``_free_cow_retained_blocks``, the
    coordinator's ``remove_skipped_blocks``). ``status``: vLLM's ``RequestStatus``."""
    if "close-waiting-session-keeps-blocks" in faults:
        add, manager = scheduler.add_request, scheduler.kv_cache_manager

        def add_keeping_blocks(request, *a, **k):  # the end of a session waiting for input: its table dropped
            session = scheduler.requests.get(request.request_id)
            if (session is not None and not request.resumable and session.status == status.WAITING_FOR_STREAMING_REQ
                    and "close-waiting-session-keeps-blocks" in faults):
                faults.discard("close-waiting-session-keeps-blocks")
                for mgr in manager.coordinator.single_type_managers:
                    mgr.req_to_blocks.pop(request.request_id, None)
                    mgr.num_cached_block.pop(request.request_id, None)
            return add(request, *a, **k)

        scheduler.add_request = add_keeping_blocks
    if "refinish-held-request" in faults:
        finish_once = scheduler.finish_requests

        def finish_twice(request_ids, finished_status, *a, **k):
            ids = (request_ids,) if isinstance(request_ids, str) else list(request_ids)
            out = finish_once(ids, finished_status, *a, **k)
            for rid in ids:  # still known after its finish: its free is delayed (a KV send in flight)
                request = scheduler.requests.get(rid)
                if "refinish-held-request" in faults and request is not None and request.is_finished():
                    faults.discard("refinish-held-request")
                    scheduler._free_request(request)
            return out

        scheduler.finish_requests = finish_twice
    if "leak-rejected-draft-blocks" in faults:
        _leak_rejected_draft_blocks(scheduler, faults)
    if "keep-computed-on-preempt" in faults:
        preempt = scheduler._preempt_request

        def preempt_keeping_computed(request, *a, **k):
            computed = request.num_computed_tokens
            out = preempt(request, *a, **k)
            if "keep-computed-on-preempt" in faults and computed:
                faults.discard("keep-computed-on-preempt")
                request.num_computed_tokens = computed
            return out

        scheduler._preempt_request = preempt_keeping_computed
    if "free-cow-source-before-copy" in faults:  # for the whole run: the fence dropped
        pool = scheduler.kv_cache_manager.block_pool
        scheduler._free_cow_retained_blocks = lambda blocks, fence_seq: pool.free_blocks(blocks)
    if "free-under-inflight-load" in faults:
        _free_under_inflight_load(scheduler, faults, status)
    if "free-window-under-inflight-step" in faults:  # for the whole run: the count before #47728
        coordinator = scheduler.kv_cache_manager.coordinator
        remove = coordinator.remove_skipped_blocks
        coordinator.remove_skipped_blocks = lambda rid, computed, *a, **k: remove(
            rid, computed if rid not in scheduler.requests else scheduler.requests[rid].num_computed_tokens, *a, **k)


def _free_under_inflight_load(scheduler, faults: set[str], status) -> None:
    """``free-under-inflight-load`` (see :func:`inject_scheduler`): the first abort of a request in
    ``WAITING_FOR_REMOTE_KVS`` frees its blocks at once (``Scheduler._free_blocks``), and the load's later
    ``finished_recving`` for it is dropped, as vLLM 0.15.1 did (#32255)."""
    finish, xfer = scheduler.finish_requests, scheduler._update_from_kv_xfer_finished
    freed: set[str] = set()

    def xfer_ignoring_freed(output, *a, **k):  # 0.15.1 only records a finished_recving id
        if output.finished_recving and freed & set(output.finished_recving):
            output.finished_recving = set(output.finished_recving) - freed
        return xfer(output, *a, **k)

    scheduler._update_from_kv_xfer_finished = xfer_ignoring_freed

    def finish_freeing_loads(request_ids, finished_status, *a, **k):
        ids = (request_ids,) if isinstance(request_ids, str) else list(request_ids)
        loading = [scheduler.requests[r] for r in ids
                   if r in scheduler.requests and scheduler.requests[r].status == status.WAITING_FOR_REMOTE_KVS]
        out = finish(ids, finished_status, *a, **k)
        for request in loading:
            if "free-under-inflight-load" in faults and scheduler.requests.get(request.request_id) is request:
                faults.discard("free-under-inflight-load")
                freed.add(request.request_id)
                scheduler._free_blocks(request)
        return out

    scheduler.finish_requests = finish_freeing_loads


def free_preempted_at_once(scheduler) -> None:
    """The fault ``free-preempted-under-inflight-step`` on a Scheduler with deferred frees (vLLM >= 0.24.0):
    its ``_free_request_blocks`` frees a request being preempted (not finished) at once through
    ``KVCacheManager.free``, and (vLLM >= 0.30.0, #49675) its ``_request_blocks_can_be_freed`` lets such a
    request be a victim even while its step is in flight. Finished requests keep vLLM's fence."""
    free, free_now = scheduler._free_request_blocks, scheduler.kv_cache_manager.free
    scheduler._free_request_blocks = lambda r: free(r) if r.is_finished() else free_now(r)
    if hasattr(scheduler, "_request_blocks_can_be_freed"):  # the victim's fence of #49675
        can_free = scheduler._request_blocks_can_be_freed
        scheduler._request_blocks_can_be_freed = lambda r: not r.is_finished() or can_free(r)


def _leak_rejected_draft_blocks(scheduler, faults: set[str]) -> None:
    """Wrap ``scheduler.update_from_output``: after the first step whose rejected drafts left a request
    with blocks wholly past its rolled-back ``num_computed_tokens`` (allocated for draft positions only),
    drop them from its table in every group, ref counts kept: blocks of rejected speculative tokens that
    nothing frees (the class of SGLang's draft over-allocation leaks, sgl-project/sglang#13826, #19518)."""
    update, managers = scheduler.update_from_output, scheduler.kv_cache_manager.coordinator.single_type_managers

    def update_leaking(out, *a, **k):
        result = update(out, *a, **k)
        for rid in out.scheduled_spec_decode_tokens:
            request = scheduler.requests.get(rid)
            if "leak-rejected-draft-blocks" not in faults or request is None or request.is_finished():
                continue
            for mgr in managers:
                table, keep = mgr.req_to_blocks.get(rid, []), -(-request.num_computed_tokens // mgr.block_size)
                if len(table) > keep:
                    faults.discard("leak-rejected-draft-blocks")
                    del table[keep:]
        return result

    scheduler.update_from_output = update_leaking
