"""The vLLM releases the target drives, and the API changes between them that it adapts to.

Each change is named after the first release with the newer API (:func:`has`; the older path otherwise).
The releases were read (``pip install --no-deps --target``, grep, ``inspect.signature``); each in :data:`TESTED`
passes ``tests/test_vllm_releases.py`` installed. Facts: ``../shared/reference/history-facts.md``.
"""

from __future__ import annotations

from packaging.version import Version

from kvaudit.targets.compat import Change, release_has

MIN_VERSION = "0.15.1"
MAX_VERSION = "0.33.0"
# the releases driven; 0.17.0 to 0.19.0 were read for the changes below but never run (refused: they
# also import diskcache, which the base lacks)
TESTED = ("0.15.1", "0.16.0", "0.20.0", "0.21.0", "0.22.0", "0.22.1", "0.23.0", "0.24.0", "0.25.0", "0.26.0",
          "0.27.0", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0")


CHANGES: dict[str, Change] = {c.name: c for c in (
    Change("is-prefill-chunk", "0.16.0",
           "Request.is_prefill_chunk, set by Scheduler._update_after_schedule; before, a step is a partial "
           "prefill when the request's num_computed_tokens after it is below num_tokens (what the model "
           "runner tests to discard the sampled token)"),
    Change("request-eos-from-sampling", "0.17.0",
           "Request(...) takes no eos_token_id (it reads SamplingParams.eos_token_id) and "
           "SamplingParams.update_from_generation_config's second argument is eos_token_id; before, a "
           "required Request argument after pooling_params, and model_eos_token_id"),
    Change("kv-event-group", "0.20.0",
           "BlockStored / BlockRemoved carry group_idx; before, a KV-cache event names hashes only (the "
           "observer's event shadow then keys by hash alone)"),
    Change("scheduler-block-size", "0.23.0",
           "KVCacheManager(..., scheduler_block_size, hash_block_size); before, hash_block_size alone"),
    Change("config-max-concurrent-batches", "0.23.0",
           "VllmConfig.max_concurrent_batches; before, the executor's property (UniProcExecutor: 2 with "
           "async scheduling, else 1)"),
    Change("hash-helpers", "0.24.0",
           "BlockPool._insert_block_hash / _remove_cached_block_hashes and cached_block_hashes_by_block "
           "(a block cached under several hashes); before, cache_full_blocks and _maybe_evict_cached_block "
           "call the map's insert / pop directly"),
    Change("deferred-frees", "0.24.0",
           "Scheduler.deferred_frees and defer_block_free: with async scheduling and a KV consumer, a "
           "finished request's blocks wait for the in-flight step (the fix of vLLM #45357)"),
    Change("computed-blocks-triple", "0.26.0",
           "KVCacheManager.get_computed_blocks returns (blocks, hits, ...) instead of (blocks, hits)"),
    Change("pending-cow", "0.26.0", "single-type managers' _pending_cow_copies (copy-on-write pairs)"),
    Change("routed-experts-aux-output", "0.31.0",
           "returning routed experts moves from ModelConfig.enable_return_routed_experts (and the Scheduler's "
           "_re_block_ids side table) to an aux-output connector behind Model Runner V2, which needs Triton: "
           "not buildable on CPU here"),
    Change("simple-cpu-offload", "0.19.0",
           "SimpleCPUOffloadConnector (vllm/v1/simple_kv_offload/); absent before"),
    Change("ngram-gpu", "0.21.0",
           "the ngram_gpu speculative method, the one model-free method VllmConfig accepts with async "
           "scheduling before async-ngram (read in 0.21.0; absent in 0.16.0; 0.20.0 not read, taken as absent)"),
    Change("async-ngram", "0.33.0",
           "VllmConfig accepts async scheduling with the ngram method (read in 0.33.0; 0.30.0 refuses it; "
           "0.31.0 and 0.32.0 not read: ngram_gpu there, which they accept)"),
    Change("hash-lookahead", "0.33.0",
           "VllmConfig.num_hash_lookahead_tokens, passed by EngineCore to get_request_block_hasher (EAGLE: each "
           "block's hash covers the next token instead of dropping the hit's last block; read in 0.33.0, "
           "absent in 0.30.0; 0.31.0 and 0.32.0 not read)"),
    Change("failed-recving", "0.30.0",
           "KVConnectorOutput.failed_recving (a failed receive by request id, Scheduler._handle_failed_recving); "
           "before (0.26.0 read; 0.27.0-0.29.0 not), a failed load is its invalid_block_ids alone"),
    Change("nixl-push", "0.24.0", "NixlPushConnector (push mode: the prefill side writes; driven on 0.24.0, "
                                  "0.26.0, 0.30.0 and 0.33.0); absent before"),
    Change("offloading-jobs", "0.30.0", "OffloadingConnector's job-based scheduler side (TransferJob, jobs_to_flush, "
           "completed_jobs; request_finished never delays a free, as from 0.21.0), LMCacheMPConnector, and "
           "MultiConnector over them, driven on 0.30.0 and 0.33.0 (0.21.0-0.29.0 not driven)"),
    Change("mamba-align-cow", "0.33.0",
           "Mamba align mode with fine-grained hash hits (CacheConfig.prefix_match_unit), copy-on-write of a "
           "partial hit's block retained behind Scheduler._free_cow_retained_blocks's fence; driven on 0.33.0 "
           "only (0.26.0 and 0.30.0 have prefix_match_unit and that fence too, not run)"),
    Change("nixl-awaiting-kvs", "0.30.0",
           "NixlConnector's ReqMeta.awaiting_kvs; before, a read with no local block is notify-only"),
)}


def in_range(version: str) -> bool:
    """Whether the target drives ``version``: within ``MIN_VERSION..MAX_VERSION``, not between 0.16.0 and 0.20.0."""
    try:
        v = Version(version)
    except Exception:
        return False
    gap = Version("0.16.0") < v < Version("0.20.0")
    return Version(MIN_VERSION) <= v <= Version(MAX_VERSION) and not gap


def has(change: str, version: str) -> bool:
    """Whether release ``version`` has the newer API of ``change`` (a key of :data:`CHANGES`; else KeyError)."""
    return release_has(CHANGES, change, version)


def routed_experts_supported(version: str | None) -> bool:
    """Whether release ``version`` has ``ModelConfig.enable_return_routed_experts`` (0.22.0, read in the
    wheel, up to "routed-experts-aux-output")."""
    try:
        return Version("0.22.0") <= Version(version or "") and not has("routed-experts-aux-output", version)
    except Exception:
        return False


def spec_method(version: str | None, async_scheduling: bool) -> str | None:
    """The model-free speculative method release ``version`` builds with (``"ngram"``, or ``"ngram_gpu"``
    under async scheduling before "async-ngram"); None where it has none for async scheduling."""
    try:
        if not async_scheduling or has("async-ngram", version):
            return "ngram"
        return "ngram_gpu" if has("ngram-gpu", version) else None
    except Exception:
        return None


def range_text() -> str:
    return f"{MIN_VERSION}, 0.16.0 and 0.20.0 to {MAX_VERSION}"
