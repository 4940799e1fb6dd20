"""The injected faults of the vLLM target (``--bug``, :data:`~kvaudit.targets.vllm.config.FAULTS`), as wrappers
on the ``KVCacheManager``'s and ``BlockPool``'s *instances* (never vLLM's classes or code).

Kept apart from the drivers: kvaudit's own frames are never sites, so a fault's free is located at the
vLLM function (scheduler level) or the driver method (manager level) that called the wrapped method.
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


def inject_scheduler(scheduler, faults: set[str], waiting_for_remote_kvs) -> None:
    """Wrap ``scheduler.finish_requests`` (the instance's) for the scheduler-level names in ``faults``:
    ``refinish-held-request`` finishes the first aborted request whose free the KV connector delayed once
    more through ``Scheduler._free_request`` (what 0.15.1's ``update_from_output`` did when the aborted
    request's in-flight step came back, #33377: a second ``request_finished``);
    ``free-under-inflight-load`` frees, right after the first abort that catches a request in
    ``waiting_for_remote_kvs`` (vLLM's ``RequestStatus.WAITING_FOR_REMOTE_KVS``) with its free delayed,
    that request's blocks at once through ``Scheduler._free_blocks``, as vLLM 0.15.1 did (#32255);
    ``keep-computed-on-preempt`` wraps ``_preempt_request`` to put back the first preempted request's
    ``num_computed_tokens`` after its blocks are freed."""
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
    if "free-under-inflight-load" not in faults:
        return
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
                   if r in scheduler.requests and scheduler.requests[r].status == waiting_for_remote_kvs]
        out = finish(ids, finished_status, *a, **k)
        for request in loading:
            if "free-under-inflight-load" in faults and scheduler.requests.get(request.request_id) is request:
                faults.discard("free-under-inflight-load")
                freed.add(request.request_id)
                scheduler._free_blocks(request)
        return out

    scheduler.finish_requests = finish_freeing_loads
