"""The SGLang releases the target drives, in two eras, and the API changes between them: **current**
(0.5.19 to 0.5.23: ``ReqKvInfo``, the tree-cache factory; 0.5.22 and 0.5.23 also
``release_kv_cache(req, cache, *, checkpoint)``, tree locks ``lock``/``unlock(handle)``,
``StreamingSession.take``; 0.5.19 to 0.5.21 differ by the Change rows since 0.5.20, 0.5.21 and 0.5.22 and drive
fewer presets, :data:`OLDER_CURRENT`) and **legacy** (the ``cache_finished_req`` era, 0.5.10.post1 and 0.5.11: KV fields on ``Req``,
``release_kv_cache(req, cache, is_insert)``, a hand-built ``RadixCache`` and ``SessionAwareCache``).
Each change is named after the first release with the newer API (facts: ``../shared/reference/history-facts.md``)."""

from __future__ import annotations

from packaging.version import InvalidVersion, Version

from kvaudit.targets.compat import Change, release_has

CURRENT = ("0.5.19", "0.5.20", "0.5.21", "0.5.22", "0.5.23")
# 0.5.19 to 0.5.21 join the current family through the Change rows below (release_kv_cache's is_insert,
# Req.prefix_indices/extend_range, the lock on req.last_node, the abort's cache handle ...) for the plain and
# PD-prefill presets (kind.older_refusal); 0.5.12-0.5.18 are neither family: refused with :func:`refusal`
# (0.5.18's ReqKvInfo keeps only kv_allocated_len and swa_evicted_seqlen, the row, committed and protected
# lengths are Req's; its ReqToTokenPool has no alloc_rows/free_rows; its allocators' free group is
# is_not_in_free_group)
BETWEEN = ("0.5.12", "0.5.18")
OLDER_CURRENT = ("0.5.19", "0.5.20", "0.5.21")  # current-family releases before 0.5.22's session/tree-lock API
LEGACY = ("0.5.10.post1", "0.5.11")  # 0.5.10 itself has the same API; only these two are tested


CHANGES: dict[str, Change] = {c.name: c for c in (
    Change("session-package", "0.5.11",
           "sessions move to sglang.srt.session (session_controller; the cache wrapper SessionAwareCache is "
           "renamed StreamingSession in streaming_session); before, managers.session_controller and "
           "mem_cache.session_aware_cache"),
    Change("session-held-active", "0.5.11",
           "SessionAwareCache.session_held_tokens(active_pool_idxs): a slot whose row a running turn borrowed "
           "is counted once, as the turn's uncached KV (the fix of SGLang #22213/#22753); before, no argument"),
    Change("row-zero-padding", "0.5.11",
           "ReqToTokenPool reserves row 0 (rows 1..size, a size + 1 table); before, every row 0..size-1 is "
           "usable"),
    Change("session-close-deferral", "0.5.11",
           "Session.close_on_finish: closing a session while its turn runs is deferred to maybe_reap, and a "
           "closing session takes no new turn (the fix of SGLang #21875); before, the slot is released at once"),
    Change("free-pages-census", "0.5.20",
           "allocator.get_all_free_pages() (free_pages with the pending release_pages); before (0.5.18/0.5.19), "
           "no such method: the two tensors are read directly"),
    Change("parallel-override-permanently", "0.5.20",
           "ParallelContext.override_permanently(**widths) (a group lent for the process, e.g. attn_tp_group); "
           "before (0.5.19), only the scoped override(**fields)"),
    Change("sampling-mask-arg", "0.5.20",
           "Scheduler passes MetadataBuffers(max_sampling_mask_tokens=server_args.sampling_mask_max_tokens); before "
           "(0.5.19), no such ServerArgs field: MetadataBuffers reads SGLANG_DISAGGREGATION_SAMPLING_MASK_MAX_TOKENS"),
    Change("free-page-ids", "0.5.20",
           "PagedTokenToKVPoolAllocator.free_page_ids(page_ids), which a grouped free_segment queues through; "
           "before (0.5.19), free_segment inside a free group queues page representatives "
           "(free_page_reps_group) that free_group_end releases"),
    Change("swa-allocator-rows", "0.5.20",
           "SWATokenToKVPoolAllocator(..., req_to_token_pool=None) (the request pool sizes an SWA ring); before "
           "(0.5.18/0.5.19), no such argument"),
    Change("cache-request-handle", "0.5.20",
           "Scheduler._release_aborted_request: tree_cache.finish(req.cache_request_handle, CacheRequestOutcome."
           "ABORT) for every aborted request; before (0.5.18/0.5.19), no handle and no outcome enum: "
           "tree_cache.release_aborted_request(rid) only with HiCache storage (its prefetch events), nothing else"),
    Change("eviction-policy-config", "0.5.20",
           "--radix-eviction-policy-config and CacheInitParams.eviction_policy_config (the policy's keyword "
           "arguments); before (0.5.18/0.5.19), neither: every policy is built with its defaults"),
    Change("tree-core-param", "0.5.21",
           "CacheInitParams.tree_core_backend picks UnifiedRadixCache's tree core (python or rust); before "
           "(0.5.20), the environment variable SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND"),
    Change("alloc-max-new-tokens", "0.5.21",
           "Scheduler.init_req_max_new_tokens asks the allocator (max_new_tokens_for_memory, None: the prompt "
           "cannot fit); before (0.5.20), it clips to total - ceil_page(input) - page - 1 itself"),
    Change("rank-override-permanent", "0.5.21",
           "ParallelContext.override_permanently(tp_rank=..., pp_rank=...) answers the ranks for the process; "
           "before (0.5.20), ranks read the live process groups unless the scoped override(...) sets them"),
    Change("publish-ranks", "0.5.21",
           "runtime_context.publish(server_args, role=..., ranks=SpawnRanks(...)); before (0.5.20), no ranks"),
    Change("kv-checksum", "0.5.21",
           "PD KV checksums: MetadataBuffers(..., kv_checksum_enabled) and --disaggregation-enable-kv-checksum; "
           "before (0.5.20), neither"),
    Change("prefill-waiting-abort", "0.5.21",
           "an aborted waiting request on a prefill server goes through the mixin's "
           "release_aborted_prefill_waiting_req (sender aborted, metadata slot and KV released); before (0.5.20), "
           "Scheduler.abort_request's own branch frees the metadata slot and aborts only a bootstrapping sender"),
    Change("chunk-cache-gone", "0.5.22",
           "TreeCacheBuildContext has no effective_chunked_prefill_size, and ChunkCache (mem_cache/chunk_cache.py) "
           "is gone; before (0.5.21), the factory builds a ChunkCache when the radix cache is off and chunking on"),
    Change("platform-triton-check", "0.5.22",
           "utils.support_triton asks current_platform whether triton runs (a CPU build: no), so alloc_for_extend "
           "writes req_to_token with torch; before, only the attention backend decides: torch_native is published"),
    Change("req-prefix-len", "0.5.22",
           "Req.prefix_len and Req.extend_end (ints; the match adopted by common.match_kv_cache) and "
           "common.checkpoint_kv_cache for the chunked request; before (0.5.20/0.5.21), Req.prefix_indices (a "
           "tensor) and Req.extend_range (a Range), and common.maybe_cache_unfinished_req(req, tree, chunked=True)"),
    Change("release-checkpoint", "0.5.22",
           "release_kv_cache(req, tree_cache, *, checkpoint) and the tree's checkpoint/lock/unlock(handle); "
           "before, release_kv_cache(req, tree_cache, is_insert=True) and insert_req/cache_unfinished_req/unpin"),
    Change("fake-sender-args", "0.5.22",
           "FakeKVSender(mgr, bootstrap_addr, bootstrap_room); before, also dest_tp_ranks and pp_rank "
           "(PrefillBootstrapQueue.create_sender passes the destination ranks)"),
    Change("flush-send-output", "0.5.23",
           "SchedulerFlushWrapper(flush_cache, is_fully_idle, send_output): a deferred flush answers through "
           "a send_output callable; before (0.5.22), through ipc_channels.send_to_tokenizer.send_output"),
    Change("mamba-track-position", "0.5.23",
           "ScheduleBatch._mamba_radix_cache_v2_req_prepare_for_extend returns the ping-pong position "
           "(track_position) and prepare_for_extend gathers the slot ids from the pool's mapping; before "
           "(0.5.22), the slot id itself (track_index)"),
    Change("kv-checksum-signature", "0.5.23",
           "PD KV checksum: prefill digests only the pages past the prefix decode holds and writes (digest, "
           "layout signature) to MetadataBuffers (set_kv_checksum(req, digest, signature)); decode verifies "
           "once; before (0.5.22), one digest of the whole prompt from page 0, verified at every join"),
)}


def family(version: str) -> str | None:
    """``"current"``, ``"legacy"`` or None (a release this target does not drive)."""
    if version in CURRENT:
        return "current"
    if version in LEGACY:
        return "legacy"
    return None


def supported() -> str:
    """The supported releases, by family, for the probe's one-line error."""
    return f"{', '.join(LEGACY)} (cache_finished_req era) and {', '.join(CURRENT)}"


def refusal(version: str) -> str:
    """The one-line reason ``version`` (not driven) is refused, for the probe's error."""
    head = f"SGLang {version} is installed, but --target sglang drives only {supported()}"
    try:
        between = Version(BETWEEN[0]) <= Version(version) <= Version(BETWEEN[1])
    except InvalidVersion:
        between = False
    if between:
        return (head + f": {version} is between the two eras (ReqKvInfo takes the request's row and lengths "
                "only in 0.5.19; neither driver family's API is checked against it)")
    return head + ": its scheduler-level API changes between versions"


def has(change: str, version: str) -> bool:
    """Whether release ``version`` has the newer API of ``change`` (a key of :data:`CHANGES`; KeyError otherwise)."""
    return release_has(CHANGES, change, version)


def req_span(req, version: str) -> tuple[int, int]:
    """``(prefix_len, extend_end)`` of a ``Req``'s next extend on release ``version``: ``req.prefix_len`` /
    ``req.extend_end``, or before change ``req-prefix-len`` ``len(req.prefix_indices)`` / ``req.extend_range.end``."""
    if has("req-prefix-len", version):
        return req.prefix_len, req.extend_end
    return len(req.prefix_indices), req.extend_range.end


def release_kv(S, req, tree_cache, checkpoint: bool) -> None:
    """SGLang's ``common.release_kv_cache`` (``S``: the loaded symbols, with ``version``) with the flag named
    as the release names it: ``checkpoint=`` keyword-only, or before change ``release-checkpoint`` the
    positional ``is_insert``."""
    if has("release-checkpoint", S.version):
        S.common.release_kv_cache(req, tree_cache, checkpoint=checkpoint)
    else:
        S.common.release_kv_cache(req, tree_cache, checkpoint)


def free_pages(allocator, version: str):
    """``[n]`` int64, the free pages (or page-1 slots) of a token or paged allocator with those pending in
    ``release_pages``: ``get_all_free_pages()``, or before change ``free-pages-census`` the same two tensors
    concatenated (``BaseTokenToKVPoolAllocator.free_pages`` / ``release_pages``)."""
    if has("free-pages-census", version):
        return allocator.get_all_free_pages()
    import torch

    release = allocator.release_pages
    if release is None or len(release) == 0:
        return allocator.free_pages
    return torch.cat((allocator.free_pages, release))
