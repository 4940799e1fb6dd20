"""Configuration and presets of the real-SGLang target (``kvaudit fuzz --target sglang``). Imports
no SGLang: the CLI validates flags and replay files with it where SGLang is not installed."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from kvaudit.config import ConfigBase, Preset, json_value
from kvaudit.targets.sglang import compat

# Faults the target can inject through its wrappers, to show the oracles see them on SGLang's own
# code (issue 8's "must show"). Each fires once, on the first chance it gets.
FAULTS: dict[str, tuple[str, str]] = {
    "skip-release": ("leak", "the first finished request's release_kv_cache(...) call is skipped: its row, its "
                             "private KV and its tree lock stay allocated with no owner"),
    "double-free": ("double-free", "right after the first finished request's release_kv_cache, its private KV "
                                   "slots are freed once more through the allocator (SGLang 0.5.23 accepts this "
                                   "silently outside SGLANG_DEBUG_MEMORY_POOL)"),
    "lock-leak": ("lock-imbalance", "the first tree unlock(lock) with a real lock is dropped: the node stays "
                                    "protected forever"),
    "hisparse-skip-finish": ("leak", "HiSparse only: the first finished request's HiSparseCoordinator."
                                     "request_finished(req) is skipped, its release_kv_cache still runs (the memory "
                                     "model's hazard A.3): its device buffer and host slots stay allocated"),
    "prefill-skip-failed-release": ("leak", "PD prefill only: the first handle_inflight_transfer_failure (an inflight "
                                            "transfer that failed or was aborted) skips its release_kv_cache: the "
                                            "request leaves the inflight queue still holding its row and its KV"),
    "decode-token-after-abort": ("use-after-free", "inside SGLang's own process_batch_result_decode (its "
                                                   "_handle_finish_state_updated_req): the first request finished by "
                                                   "an abort gets its token committed once more after its "
                                                   "release_kv_cache, the abort processed (the output-after-abort "
                                                   "check)"),
    "decode-skip-release": ("leak", "inside SGLang's own process_batch_result_decode (its "
                                    "_handle_finish_state_updated_req): the first request that finishes there loses "
                                    "its release_kv_cache call: its row, private KV and tree lock stay allocated"),
    "swa-skip-window-free": ("leak", "SWA hybrid only: the first sliding-window eviction of a running request "
                                     "(UnifiedRadixCache.evict_sliding_windows) advances its SWA cursor but skips the "
                                     "free of the slots that left the window: they stay allocated with no owner"),
    "mamba-leak-on-release": ("leak", "Mamba only: the first free_mamba_cache(req) (the tree's "
                                      "cleanup_after_caching_req under release_kv_cache, on finish, abort or "
                                      "retraction) clears the request's mamba_pool_idx without giving the slot back "
                                      "to the MambaSlotAllocator"),
    "mamba-free-donated": ("use-after-free", "Mamba only: right after the first finished request donates its "
                                             "mamba slot to the tree (cleanup_after_caching_req after the insert "
                                             "in release_kv_cache), the slot is also freed to the "
                                             "MambaSlotAllocator while the tree node still holds it"),
    "spec-leak-rejected-draft": ("leak", "speculative decoding only: at the first release of a request that holds "
                                         "reserved-but-uncommitted draft KV (rejected draft tokens' slots past "
                                         "kv_committed_len), release_kv_cache's _release_overallocated_kv_indices "
                                         "skips its free: those slots stay allocated with no owner"),
}

# The faults planted on one mode's code: (they, whether a config runs the mode, where they are for)
MODE_FAULTS = (
    ({"hisparse-skip-finish"}, lambda c: c.enable_hisparse,
     "--preset sglang-hisparse only (it needs HiSparse: enable_hisparse)"),
    ({"prefill-skip-failed-release"}, lambda c: c.disaggregation_mode == "prefill",
     "the sglang-pd-prefill presets only (it needs the PD prefill server: disaggregation_mode prefill)"),
    ({"swa-skip-window-free"}, lambda c: c.sliding_window_size is not None,
     "the SWA presets only (--preset sglang-swa...: it needs sliding_window_size)"),
    ({"mamba-leak-on-release", "mamba-free-donated"}, lambda c: c.enable_mamba,
     "the sglang-mamba presets only (it needs mamba state: enable_mamba)"),
    ({"spec-leak-rejected-draft"}, lambda c: c.speculative_algorithm is not None,
     "the sglang-spec presets only (it needs speculative decoding: speculative_algorithm)"),
)
# --speculative-algorithm values driven (spec v2: SGLang 0.5.23's only speculative path)
SPECULATIVE_ALGORITHMS = ("eagle", "ngram")
# SGLang 0.5.23 kv_cache_configurator.MAMBA_CACHE_SIZE_MAX_RUNNING_REQUESTS_RATIO: mamba slots per running request
MAMBA_SLOTS_PER_REQUEST = 3
# SGLang's default --mamba-track-interval: a decode step snapshots a tracked state at its multiples (not driven)
MAMBA_TRACK_INTERVAL = 256

TREE_CORES = ("rust", "python")
# --radix-eviction-policy (sglang/srt/arg_groups/choices.py RADIX_EVICTION_POLICY_CHOICES): which evictable leaf
# the tree gives up first when an allocation evicts part of it (sglang/srt/mem_cache/evict_policy.py)
RADIX_EVICTION_POLICIES = ("lru", "lfu", "slru", "priority", "tlru")
HICACHE_WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
HICACHE_STORAGE_BACKENDS = ("file",)
# "timeout" (SGLang's default) ends a prefetch at a deadline of prefetch_timeout_base seconds (+ a per-page share,
# 0 here), read from sglang.srt.utils.poll_timer's clock: the step clock, one second a scheduler step
HICACHE_PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")


@dataclass(frozen=True)
class SglangConfig(ConfigBase):
    """How the real SGLang memory manager is built and driven (both eras; the legacy one drives a
    subset). Sizes are in tokens, timeouts and delays in scheduler steps (SGLang's clock advances one
    second a step). The fields, by mode, are described in docs/internals/sglang.md ("Configuration").

    Raises ``ValueError`` for inconsistent values, :class:`kvaudit.config.UnknownFaultError` for an
    unknown fault."""

    num_slots: int = 512
    page_size: int = 1
    need_sort: bool = False
    tree_core: str = "rust"
    radix_eviction_policy: str = "lru"  # --radix-eviction-policy (RADIX_EVICTION_POLICIES)
    radix_eviction_policy_config: str | None = None  # --radix-eviction-policy-config: a JSON object, or None
    max_running_requests: int = 8
    max_req_rows: int = 16
    context_len: int = 128
    new_token_ratio: float = 0.5
    enable_streaming_session: bool = False
    enable_overlap: bool = False  # event_loop_overlap: a batch's result is processed one step later
    session_streaming: bool = True  # sessions open as streaming (SessionSlot KV) or not (radix-cache history)
    session_timeout_steps: int | None = None  # OpenSessionReqInput.timeout, one second a step; None: none
    chunked_prefill_size: int | None = None  # tokens per prefill batch (PrefillAdder's chunk budget); None = off
    enable_mixed_chunk: bool = False  # decode rows ride in prefill batches (needs chunked_prefill_size)
    disaggregation_mode: str = "null"  # "decode": the PD decode server's queues (kvaudit/targets/sglang/pd.py)
    enable_hisparse: bool = False  # HiSparse's two-level allocator and coordinator (kvaudit/targets/sglang/hisparse.py)
    # PD decode only: the transfer network kvaudit plays (in scheduler steps) and SGLang's decode reserve
    transfer_latency_steps: int = 1  # steps from send_metadata to the KV landing
    abort_ack_steps: int | None = 2  # steps from an abort notification to prefill's drain ack; None: never acked
    deferred_kv_release: bool = True  # SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE: else released at once
    deferred_release_timeout_steps: int = 6  # SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT, 1 s a step
    num_reserved_decode_tokens: int = 8  # SGLang's --num-reserved-decode-tokens (512 by default, for real pools)
    kv_checksum_mismatch_every: int | None = None  # every Nth landed transfer arrives corrupted; None: none
    # --disaggregation-decode-enable-radix-cache: decode matches a request's prompt against its own radix cache
    # before pre-allocation (prefill sends the rest) and caches what it decoded; its requests carry a real
    # bootstrap host (a fake one skips the insert), with kvaudit's transfer stand-in behind a non-fake backend name
    decode_radix_cache: bool = False
    # PD prefill only (kvaudit/targets/sglang/pd_prefill.py): the decode peer kvaudit plays, in scheduler steps
    bootstrap_steps: int = 1  # steps from a request's arrival to decode's bootstrap (its destinations known)
    bootstrap_lost_every: int | None = None  # every Nth request's decode never bootstraps; None: none
    bootstrap_timeout_steps: int = 16  # SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT, one second a step
    waiting_timeout_steps: int = 16  # SGLANG_DISAGGREGATION_WAITING_TIMEOUT: bootstrapped, no KV sent yet
    prefill_reads_after_failure: bool = False  # a chunk on the wire is read to its end after its room failed
    # --optimistic-prefill-attempts: forward passes a request may run before decode bootstrapped (0: it waits)
    optimistic_prefill_attempts: int = 0
    # every Nth client request carries bootstrap_host FAKE_BOOTSTRAP_HOST ("2.2.2.2": a fake-prefill benchmark
    # client, or any client that sets the field): SGLang's Req skips its radix-cache insert; None: none
    fake_bootstrap_every: int | None = None
    # HiSparse only
    hisparse_device_buffer_size: int = 32  # tokens per request's device buffer (HiSparseCoordinator device_buffer_size)
    hisparse_host_to_device_ratio: int = 2  # logical (and host) pool size over the physical device pool
    hisparse_staging_steps: int = 0  # steps a staging copy stays in flight (collect_ready_reqs waits for it)
    # HiCache (kvaudit/targets/sglang/hicache.py): SGLang's --enable-hierarchical-cache
    enable_hierarchical_cache: bool = False
    hicache_write_policy: str = "write_through"  # --hicache-write-policy
    hicache_ratio: float = 2.0  # --hicache-ratio: host pool size over the device pool
    hicache_ack_steps: int = 1  # steps from a D->H / H->D submission to the poll that sees its ack
    hicache_storage_backend: str | None = None  # --hicache-storage-backend: None (host tier only) or "file"
    hicache_storage_ack_steps: int = 1  # steps a storage operation waits in its queue for the storage worker
    hicache_storage_prefetch_policy: str = "wait_complete"  # --hicache-storage-prefetch-policy
    hicache_storage_prefetch_threshold: int = 8  # tokens: shorter prefetches and storage hits are not fetched
    hicache_storage_prefetch_timeout_steps: int = 2  # the timeout policy's prefetch_timeout_base, one second a step
    hicache_storage_fail_every: int | None = None  # every Nth storage read or write fails whole (a backend down)
    # SWA hybrid (kvaudit/targets/sglang/swa.py): sliding-window layers beside full attention; None: not hybrid
    sliding_window_size: int | None = None  # tokens (the model's sliding_window); SWA pool: SWATokenToKVPoolAllocator
    swa_full_tokens_ratio: float = 0.5  # --swa-full-tokens-ratio: SWA pool size over the full pool
    swa_eviction_interval: int = 4  # SGLANG_SWA_EVICTION_INTERVAL (128 by default, for real windows)
    swa_chunk_cache: bool = False  # --disable-radix-cache on an SWA model (the chunk cache of #36458)
    # scheduling policy and timeout aborts (see the class docstring)
    enable_priority_scheduling: bool = False
    schedule_low_priority_values_first: bool = False
    priority_scheduling_preemption_threshold: int = 10  # SGLang's default
    max_queued_requests: int | None = None
    request_waiting_timeout_steps: int | None = None
    request_running_timeout_steps: int | None = None
    # SGLang 0.5.10-0.5.11 (kvaudit/targets/sglang/legacy.py): SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY, the busy
    # memory check its engine check runs after each batch (the idle check always runs); 0.5.23's is always on
    strict_mem_check_during_busy: bool = False
    # Mamba / hybrid linear attention (kvaudit/targets/sglang/mamba.py): a hybrid SSM model's state slots
    enable_mamba: bool = False
    max_mamba_cache_size: int = 24  # --max-mamba-cache-size: slots of the MambaPool (slot 0 is padding)
    mamba_chunk_size: int = 8  # the model's mamba_chunk_size: the grid a tree state's depth lands on
    # --mamba-radix-cache-strategy extra_buffer: each request also holds ping-pong track slots the forward
    # snapshots its state into at chunk boundaries, and a checkpoint donates the tracked slot to the tree
    mamba_extra_buffer: bool = False
    # speculative decoding, spec v2 (kvaudit/targets/sglang/spec.py): None, "eagle" or "ngram" (SPECULATIVE_ALGORITHMS)
    speculative_algorithm: str | None = None
    speculative_num_steps: int = 3  # --speculative-num-steps (ngram: num_draft_tokens // topk, as SGLang resolves it)
    speculative_eagle_topk: int = 1  # --speculative-eagle-topk (only 1 is driven)
    speculative_num_draft_tokens: int = 4  # --speculative-num-draft-tokens: the verify's tokens per request
    vocab_size: int = 128
    device: str = "cpu"
    bugs: frozenset[str] = field(default_factory=frozenset)
    seed: int = 0
    preset: str = "custom"
    target: str = "sglang"

    BUGS_NOUN = "fault names"

    # what the generators and reports read from any config
    model = "none"

    @property
    def program_features(self) -> frozenset[str]:
        """Program arguments this target gives meaning to, so the generators draw them
        (:data:`kvaudit.program.FEATURES`)."""
        out = {"flush_timeout"}
        if self.disaggregation_mode in ("decode", "prefill"):
            out.add("transfer_fail")
        if self.enable_streaming_session:
            out.add("session_params")
        if self.enable_priority_scheduling:
            out.add("priority")
        if self.disaggregation_mode == "null":
            out.add("grammar")
        return frozenset(out)

    @property
    def disable_radix_cache(self) -> bool:
        """HiSparse runs without the radix cache (SGLang's ``validate_hisparse``); an SWA chunk cache too."""
        return self.enable_hisparse or self.swa_chunk_cache

    def __post_init__(self) -> None:
        for name in ("num_slots", "page_size", "max_running_requests", "max_req_rows", "context_len", "vocab_size",
                     "seed", "transfer_latency_steps", "deferred_release_timeout_steps", "num_reserved_decode_tokens",
                     "priority_scheduling_preemption_threshold"):
            self._check_int(name, 0)
        for f in fields(self):  # every bool field
            if f.type == "bool" and not isinstance(getattr(self, f.name), bool):
                raise ValueError(f"{f.name} must be true or false, got {json_value(getattr(self, f.name))}")
        if self.target != "sglang":
            raise ValueError(f'target must be "sglang", got {json_value(self.target)}')
        self._check_choice("tree_core", TREE_CORES)
        self._check_eviction_policy()
        if self.page_size < 1 or self.num_slots < 4 * self.page_size or self.num_slots > 1 << 20:
            raise ValueError(f"num_slots must hold at least 4 pages of page_size={self.page_size} tokens "
                             f"and at most 1048576 tokens, got {json_value(self.num_slots)}")
        if not 4 <= self.context_len <= 4096 or not 4 <= self.vocab_size <= 1 << 16:
            raise ValueError("context_len must be in [4, 4096] and vocab_size in [4, 65536]")
        if not 1 <= self.max_running_requests <= 256 or not 1 <= self.max_req_rows <= 1024:
            raise ValueError("max_running_requests must be in [1, 256] and max_req_rows in [1, 1024]")
        if self.disaggregation_mode not in ("null", "decode", "prefill"):
            raise ValueError('disaggregation_mode must be "null", "decode" or "prefill" (strings, as SGLang\'s '
                             f"--disaggregation-mode), got {json_value(self.disaggregation_mode)}")
        for name in ("session_timeout_steps", "max_queued_requests", "request_waiting_timeout_steps",
                     "request_running_timeout_steps", "kv_checksum_mismatch_every", "fake_bootstrap_every"):
            self._check_int(name, 1, null=True)
        self._check_int("abort_ack_steps", 0, null=True)
        if self.kv_checksum_mismatch_every is not None and self.disaggregation_mode != "decode":
            raise ValueError("kv_checksum_mismatch_every corrupts PD transfers: it needs disaggregation_mode decode "
                             "(preset sglang-pd-decode)")
        if self.decode_radix_cache and (self.disaggregation_mode != "decode" or self.enable_hisparse):
            raise ValueError("decode_radix_cache needs disaggregation_mode decode and no enable_hisparse (SGLang's "
                             "handle_pd_disaggregation refuses --disaggregation-decode-enable-radix-cache with HiSparse)")
        if self.disaggregation_mode == "decode":
            # (enable_hisparse: the direct-to-host path, driven on the legacy era only: kind._probe)
            clash = [n for n in ("enable_streaming_session", "enable_overlap",
                                 "enable_priority_scheduling", "max_queued_requests", "request_waiting_timeout_steps",
                                 "request_running_timeout_steps", "fake_bootstrap_every") if getattr(self, n)]
            if clash or self.chunked_prefill_size is not None:
                raise ValueError("disaggregation_mode decode is driven without "
                                 f"{', '.join(clash) or 'chunked_prefill_size'} in this version")
        c = self.chunked_prefill_size
        if c is not None and (not isinstance(c, int) or isinstance(c, bool) or not self.page_size <= c <= 65536):
            raise ValueError(f"chunked_prefill_size must be null or an integer in [page_size={self.page_size}, 65536], "
                             f"got {json_value(c)}")
        if self.enable_mixed_chunk and (c is None or self.enable_hisparse):
            raise ValueError("enable_mixed_chunk needs chunked_prefill_size (SGLang's is_mixed_chunk) and is not "
                             "driven with enable_hisparse")
        r = self.new_token_ratio
        if not isinstance(r, (int, float)) or isinstance(r, bool) or not 0 <= r <= 1:
            raise ValueError(f"new_token_ratio must be a number in [0, 1], got {json_value(r)}")
        if not isinstance(self.device, str) or self.device.split(":")[0] not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {json_value(self.device)}")
        if not isinstance(self.preset, str):
            raise ValueError(f"preset must be a string, got {json_value(self.preset)}")
        self._freeze_faults(FAULTS, "sglang")
        for faults, on, where in MODE_FAULTS:
            if self.bugs & faults and not on(self):
                raise ValueError(f"fault {sorted(self.bugs & faults)[0]} is for {where}")
        self._check_hisparse()
        self._check_hicache()
        self._check_prefill()
        self._check_swa()
        self._check_mamba()
        self._check_spec()

    def _check_int(self, name: str, lo: int, hi: int | None = None, null: bool = False) -> None:
        """Raises ValueError (one line) unless field ``name`` is an integer in ``[lo, hi]`` (None allowed when
        ``null``). Without ``hi``, ``lo`` is 0 (a non-negative integer) or 1 (a positive one)."""
        v = getattr(self, name)
        ok = isinstance(v, int) and not isinstance(v, bool) and lo <= v and (hi is None or v <= hi)
        if ok or (v is None and null):
            return
        what = f"an integer in [{lo}, {hi}]" if hi is not None else ("a positive integer" if lo == 1
                                                                      else "a non-negative integer")
        raise ValueError(f"{name} must be {'null or ' if null else ''}{what}, got {json_value(v)}")

    def _check_choice(self, name: str, choices: tuple, null: bool = False) -> None:
        """Raises ValueError (one line) unless field ``name`` is one of ``choices`` (None allowed when ``null``)."""
        v = getattr(self, name)
        if v not in choices and not (v is None and null):
            raise ValueError(f"{name} must be {'null or ' if null else ''}one of {', '.join(choices)}, "
                             f"got {json_value(v)}")

    def _check_prefill(self) -> None:
        for name in ("bootstrap_steps", "bootstrap_timeout_steps", "waiting_timeout_steps"):
            self._check_int(name, 1, 4096)
        self._check_int("bootstrap_lost_every", 1, null=True)
        self._check_int("optimistic_prefill_attempts", 0, 64)
        n = self.bootstrap_lost_every
        o = self.optimistic_prefill_attempts
        if self.disaggregation_mode != "prefill":
            if o:
                raise ValueError("optimistic_prefill_attempts lets a prefill server run a request before decode "
                                 "bootstrapped: it needs disaggregation_mode prefill")
            if self.prefill_reads_after_failure:
                raise ValueError("prefill_reads_after_failure models a prefill server's transfer worker: it needs "
                                 "disaggregation_mode prefill")
            if n is not None:
                raise ValueError("bootstrap_lost_every plays the decode peer of a prefill server: it needs "
                                 "disaggregation_mode prefill")
            return
        unplanted = sorted(self.bugs & {"skip-release", "double-free", "decode-token-after-abort", "decode-skip-release"})
        if unplanted:  # the shared driver's release and SGLang's decode result processing: a prefill server runs neither
            raise ValueError(f"fault {unplanted[0]} is not planted on the PD prefill path (its releases are "
                             "SGLang's own handlers'): use prefill-skip-failed-release")
        # (streaming sessions: SGLang's server args refuse none with PD prefill; non-streaming ones are not driven)
        if self.enable_streaming_session and not self.session_streaming:
            raise ValueError("disaggregation_mode prefill drives streaming sessions only (session_streaming true)")
        clash = [n for n in ("enable_overlap", "enable_hisparse", "enable_mixed_chunk",
                             "enable_priority_scheduling", "max_queued_requests", "request_waiting_timeout_steps",
                             "request_running_timeout_steps", "enable_hierarchical_cache") if getattr(self, n)]
        if clash:
            raise ValueError(f"disaggregation_mode prefill is driven without {clash[0]} in this version "
                             "(event_loop_normal_disagg_prefill only)")

    @property
    def radix_eviction_policy_kwargs(self) -> dict | None:
        """``radix_eviction_policy_config`` parsed: the policy's keyword arguments (checked in ``__post_init__``)."""
        import json
        text = self.radix_eviction_policy_config
        return None if text is None else json.loads(text)

    def _check_eviction_policy(self) -> None:
        self._check_choice("radix_eviction_policy", RADIX_EVICTION_POLICIES)
        text = self.radix_eviction_policy_config
        if text is not None:
            import json
            try:
                ok = isinstance(json.loads(text), dict)
            except (TypeError, ValueError):
                ok = False
            if not ok:
                raise ValueError(f"radix_eviction_policy_config must be a JSON object, got {json_value(text)}")

    @property
    def swa_num_slots(self) -> int:
        """The SWA pool (``swa_max_total_num_tokens``): ``swa_full_tokens_ratio`` of ``num_slots``, whole pages."""
        ps = self.page_size
        return int(self.num_slots * self.swa_full_tokens_ratio) // ps * ps

    def _driven_alone(self, feature: str, *also: str) -> None:
        """``feature`` (SWA, Mamba, speculative decoding) is driven without HiSparse, HiCache or PD
        disaggregation, nor ``also`` (other clashes, by name): raises ValueError naming the first that is on."""
        clash = [n for n in ("enable_hisparse", "enable_hierarchical_cache") if getattr(self, n)]
        if self.disaggregation_mode != "null":
            clash.append(f"disaggregation_mode {self.disaggregation_mode}")
        clash += also
        if clash:
            raise ValueError(f"{feature} is driven without {clash[0]} in this version")

    def _check_swa(self) -> None:
        w = self.sliding_window_size
        if w is None:
            if self.swa_chunk_cache:
                raise ValueError("swa_chunk_cache needs sliding_window_size (an SWA hybrid model)")
            return
        if not isinstance(w, int) or isinstance(w, bool) or not 1 <= w < self.context_len:
            raise ValueError(f"sliding_window_size must be null or an integer in [1, context_len), got {json_value(w)}")
        r = self.swa_full_tokens_ratio
        if not isinstance(r, (int, float)) or isinstance(r, bool) or not 0 < r <= 1:
            raise ValueError(f"swa_full_tokens_ratio must be a number in (0, 1], got {json_value(r)}")
        self._check_int("swa_eviction_interval", 1, 1024)
        if self.swa_num_slots < 4 * self.page_size:
            raise ValueError(f"the SWA pool ({self.swa_num_slots} tokens: swa_full_tokens_ratio x num_slots) must "
                             f"hold at least 4 pages of {self.page_size}")
        self._driven_alone("sliding_window_size (SWA hybrid)")
        if self.swa_chunk_cache and self.enable_streaming_session:
            raise ValueError("swa_chunk_cache (radix cache off) cannot run with streaming sessions (they keep their KV "
                             "in the radix cache)")

    @property
    def mamba_slots_per_request(self) -> int:
        """``kv_cache_configurator._calculate_mamba_ratio``: 3, plus the ping-pong track slots under the
        extra buffer (``get_mamba_tracking_slots``: 2 under overlap, else 1)."""
        return MAMBA_SLOTS_PER_REQUEST + ((2 if self.enable_overlap else 1) if self.mamba_extra_buffer else 0)

    def _check_mamba(self) -> None:
        if not self.enable_mamba:
            if self.mamba_extra_buffer:
                raise ValueError("mamba_extra_buffer needs enable_mamba (a hybrid SSM model's mamba state)")
            return
        for name in ("max_mamba_cache_size", "mamba_chunk_size"):
            self._check_int(name, 1, 4096)
        if self.page_size != 1:
            raise ValueError("enable_mamba needs page_size 1 (SGLang's MambaComponent without the extra buffer; "
                             "the extra buffer is driven at page 1 only in this version)")
        if self.mamba_extra_buffer and self.context_len >= MAMBA_TRACK_INTERVAL:
            raise ValueError(f"mamba_extra_buffer needs context_len below {MAMBA_TRACK_INTERVAL} (the track interval: "
                             "decode-step track snapshots are not driven in this version)")
        per = self.mamba_slots_per_request
        if self.max_mamba_cache_size < per * self.max_running_requests:
            raise ValueError(f"max_mamba_cache_size={self.max_mamba_cache_size} must be at least "
                             f"{per} x max_running_requests={self.max_running_requests}: SGLang caps "
                             f"max_running_requests to max_mamba_cache_size // {per} (kv_cache_configurator's "
                             "_calculate_mamba_ratio with the radix cache on"
                             + (", the extra buffer's track slots included)" if self.mamba_extra_buffer else
                                ", no extra buffer)"))
        swa = ["sliding_window_size (SWA hybrid)"] if self.sliding_window_size is not None else []
        self._driven_alone("enable_mamba", *swa)

    def _check_spec(self) -> None:
        a = self.speculative_algorithm
        if a is None:
            return
        self._check_choice("speculative_algorithm", SPECULATIVE_ALGORITHMS, null=True)
        for name in ("speculative_num_steps", "speculative_num_draft_tokens"):
            self._check_int(name, 1, 16)
        if self.speculative_eagle_topk != 1:
            raise ValueError(f"speculative_eagle_topk must be 1 (the tree drafts of topk > 1 are not driven), "
                             f"got {json_value(self.speculative_eagle_topk)}")
        if a == "eagle" and self.speculative_num_draft_tokens != self.speculative_num_steps + 1:
            # SGLang's _handle_eagle_family: with topk 1, num_draft_tokens is num_steps + 1
            raise ValueError("speculative_num_draft_tokens must be speculative_num_steps + 1 for eagle with topk 1 "
                             f"(got {self.speculative_num_draft_tokens} and {self.speculative_num_steps})")
        if self.enable_mixed_chunk:  # SGLang's speculative hook turns --enable-mixed-chunk off
            raise ValueError("speculative decoding disables enable_mixed_chunk (SGLang's speculative_hook resolves "
                             "enable_mixed_chunk=False)")
        self._driven_alone("speculative_algorithm")

    def _check_hicache(self) -> None:
        self._check_choice("hicache_write_policy", HICACHE_WRITE_POLICIES)
        r = self.hicache_ratio
        if not isinstance(r, (int, float)) or isinstance(r, bool) or not 1 < r <= 8:
            raise ValueError(f"hicache_ratio must be a number in (1, 8], got {json_value(r)}")
        for name, top in (("hicache_ack_steps", 64), ("hicache_storage_ack_steps", 64),
                          ("hicache_storage_prefetch_threshold", 65536), ("hicache_storage_prefetch_timeout_steps", 64)):
            self._check_int(name, 1, top)
        self._check_hicache_storage()
        if not self.enable_hierarchical_cache:
            return
        clash = [n for n in ("enable_hisparse", "enable_streaming_session", "enable_overlap") if getattr(self, n)]
        if self.disaggregation_mode != "null":
            clash.append(f"disaggregation_mode {self.disaggregation_mode}")
        if clash:
            raise ValueError(f"enable_hierarchical_cache is driven without {clash[0]} in this version")

    def _check_hicache_storage(self) -> None:
        self._check_choice("hicache_storage_backend", HICACHE_STORAGE_BACKENDS, null=True)
        b = self.hicache_storage_backend
        f = self.hicache_storage_fail_every
        if f is not None and (not isinstance(f, int) or isinstance(f, bool) or f < 1 or b is None):
            raise ValueError(f"hicache_storage_fail_every must be null or a positive integer, with a "
                             f"hicache_storage_backend, got {json_value(f)}")
        if b is not None and not self.enable_hierarchical_cache:
            raise ValueError("hicache_storage_backend needs enable_hierarchical_cache (SGLang's L3 tier sits under "
                             "the host tier)")
        self._check_choice("hicache_storage_prefetch_policy", HICACHE_PREFETCH_POLICIES)

    def _check_hisparse(self) -> None:
        for name in ("hisparse_device_buffer_size", "hisparse_host_to_device_ratio", "hisparse_staging_steps"):
            self._check_int(name, 0)
        if not self.enable_hisparse:
            return
        if self.enable_streaming_session:
            raise ValueError("enable_hisparse cannot run with enable_streaming_session: HiSparse requires the radix "
                             "cache off, streaming sessions keep their KV in it")
        if self.enable_overlap:
            raise ValueError("enable_hisparse with enable_overlap is not driven by this target yet (normal event "
                             "loop only)")
        d, ps = self.hisparse_device_buffer_size, self.page_size
        if d < ps or d % ps or d + ps > self.num_slots:
            raise ValueError(f"hisparse_device_buffer_size={d} must be a positive multiple of page_size={ps} with "
                             f"one more page below num_slots={self.num_slots}")
        if not 1 <= self.hisparse_host_to_device_ratio <= 8 or self.hisparse_staging_steps > 64:
            raise ValueError("hisparse_host_to_device_ratio must be in [1, 8] and hisparse_staging_steps in [0, 64]")


def legacy_refusal(config) -> str | None:
    """Why the legacy family cannot drive ``config`` (one line), or None. PD decode is driven with
    HiSparse only, by :mod:`~kvaudit.targets.sglang.legacy_pd` (:func:`legacy_pd_refusal` checks the rest). Here, not in
    :mod:`~kvaudit.targets.sglang.legacy`, so that the kind lists and refuses presets without torch."""
    pd = config.disaggregation_mode == "decode"
    if pd and config.enable_hisparse:
        return None
    off = [name for name, on in (
        ("PD disaggregation", config.disaggregation_mode != "null"),
        ("HiSparse", config.enable_hisparse),
        ("HiCache", config.enable_hierarchical_cache), ("overlap scheduling", config.enable_overlap),
        ("chunked prefill", config.chunked_prefill_size is not None), ("mixed chunks", config.enable_mixed_chunk),
        ("priority scheduling", config.enable_priority_scheduling),
        ("a queue limit", config.max_queued_requests is not None),
        ("timeout aborts", config.request_waiting_timeout_steps is not None
         or config.request_running_timeout_steps is not None),
        ("page_size > 1", config.page_size != 1), ("injected faults", bool(config.bugs)),
        ("fake bootstrap hosts", config.fake_bootstrap_every is not None),
        ("a radix eviction policy other than lru", config.radix_eviction_policy != "lru"),
        ("SWA", config.sliding_window_size is not None), ("Mamba", config.enable_mamba),
        ("speculative decoding", config.speculative_algorithm is not None)) if on]
    if off:
        return (f"SGLang {compat.LEGACY[0]}-{compat.LEGACY[-1]} (the cache_finished_req era) is driven with core "
                f"pools, the radix cache and sessions (and PD decode with HiSparse), not {', '.join(off)}")
    return None


def legacy_pd_refusal(config) -> str | None:
    """Why the legacy era's PD decode with HiSparse (:mod:`~kvaudit.targets.sglang.legacy_pd`) cannot
    drive ``config`` (a PD decode + HiSparse one), or None."""
    off = [name for name, on in (
        ("page_size != 64", config.page_size != 64), ("injected faults", bool(config.bugs)),
        ("a KV checksum mismatch", config.kv_checksum_mismatch_every is not None),
        ("hisparse_staging_steps", config.hisparse_staging_steps != 0),
        ("transfer latency", config.transfer_latency_steps != 0)) if on]
    if off:
        return (f"SGLang {compat.LEGACY[0]}-{compat.LEGACY[-1]} PD decode with HiSparse is driven with page 64 "
                f"(NSA pages), SGLang's own fake transfer backend and no faults, not {', '.join(off)}")
    return None


SGLANG_PRESETS: dict[str, Preset] = {}


def _preset(name: str, description: str, overrides: dict, base: str | None = None) -> None:
    """Add a row to :data:`SGLANG_PRESETS`: ``overrides`` on those of preset ``base`` (None: the defaults)."""
    inherited = SGLANG_PRESETS[base].overrides if base else {}
    SGLANG_PRESETS[name] = Preset(name, description, {**inherited, **overrides}, config_class=SglangConfig)


_preset("sglang", "SGLang's UnifiedRadixCache over TokenToKVPoolAllocator, page 1, 512 slots", {})
_preset("sglang-paged", "PagedTokenToKVPoolAllocator with 16-token pages, 1024 slots",
        {"page_size": 16, "num_slots": 1024})
_preset("sglang-pd", "need_sort=True (the allocator flag of PD disaggregation), page 4, 256 slots",
        {"need_sort": True, "page_size": 4, "num_slots": 256})
_preset("sglang-session", "streaming sessions (StreamingSession, SessionController), page 1",
        {"enable_streaming_session": True, "context_len": 96})
_preset("sglang-session-nonstreaming", "non-streaming sessions (history through the radix cache; turns "
                                       "branch, replace, drop output or splice with SessionParams), page 1",
        {"enable_streaming_session": True, "session_streaming": False, "context_len": 96})
_preset("sglang-overlap", "overlap scheduling (event_loop_overlap): each batch's result is processed "
                          "one step after the next batch is allocated; page 4",
        {"enable_overlap": True, "page_size": 4})
_preset("sglang-pd-decode", "PD disaggregation, decode side: DecodePreallocQueue, DecodeTransferQueue "
                            "(deferred releases), prebuilt batches, DecodeReqToTokenPool; tree off; page 4",
        {"disaggregation_mode": "decode", "need_sort": True, "page_size": 4, "num_slots": 256})
_preset("sglang-pd-decode-radix", "sglang-pd-decode with the decode radix cache on "
                                  "(--disaggregation-decode-enable-radix-cache: a request's prompt is matched "
                                  "against decode's own tree before pre-allocation, prefill sends the rest, "
                                  "finished requests are cached; requests carry a real bootstrap host); page 4",
        {"decode_radix_cache": True}, "sglang-pd-decode")
_preset("sglang-pd-prefill", "PD disaggregation, prefill side: PrefillBootstrapQueue, the inflight queue "
                             "(process_disagg_prefill_inflight_queue) and a decode peer whose bootstrap "
                             "takes 1 step, every 7th never comes (16-step bootstrap timeout), transfers "
                             "land 2 steps after the last chunk; a bootstrapped request waiting 6 steps "
                             "for memory times out (waiting timeout); 128 slots, page 4",
        {"disaggregation_mode": "prefill", "need_sort": True, "page_size": 4, "num_slots": 128,
         "transfer_latency_steps": 2, "bootstrap_lost_every": 7, "waiting_timeout_steps": 6})
_preset("sglang-pd-prefill-chunked", "PD prefill with chunked prefill (16-token chunks sent as they are "
                                     "computed, process_prefill_chunk), a tight KV pool (128 slots), "
                                     "bootstrap in 3 steps, every 5th never; 8-step waiting and bootstrap "
                                     "timeouts; page 4",
        {"chunked_prefill_size": 16, "bootstrap_steps": 3, "bootstrap_lost_every": 5, "bootstrap_timeout_steps": 8,
         "waiting_timeout_steps": 8}, "sglang-pd-prefill")
_preset("sglang-pd-prefill-reads", "sglang-pd-prefill whose transfer worker reads a chunk's source pages "
                                   "until it lands even after its room failed (a chunk inside its sync "
                                   "call is finished, as mooncake's transfer_worker does: sglang#38961)",
        {"prefill_reads_after_failure": True}, "sglang-pd-prefill")
_preset("sglang-pd-prefill-optimistic", "PD prefill with optimistic prefill (2 attempts: a request runs "
                                        "before decode bootstrapped, sits in the inflight queue, and yields "
                                        "its row back to the waiting queue when rows run out: "
                                        "optimistic_release_and_requeue); bootstrap in 4 steps, 4 rows, "
                                        "128 slots, page 4",
        {"max_req_rows": 4, "bootstrap_steps": 4, "waiting_timeout_steps": 8, "optimistic_prefill_attempts": 2},
        "sglang-pd-prefill")
_preset("sglang-pd-prefill-session", "sglang-pd-prefill-optimistic with streaming sessions: a session "
                                     "turn runs on a prefill server (its record in the session slot from "
                                     "transfer to transfer) and may be requeued; 2 rows (more "
                                     "requeues), 6-step waiting timeout",
        {"max_req_rows": 2, "waiting_timeout_steps": 6, "enable_streaming_session": True, "context_len": 96},
        "sglang-pd-prefill-optimistic")
_preset("sglang-chunked", "chunked prefill (PrefillAdder chunks of 16 tokens, chunked_req) under overlap "
                          "scheduling, page 4",
        {"chunked_prefill_size": 16, "enable_overlap": True, "page_size": 4})
_preset("sglang-hisparse", "HiSparse (MiniMaxSparseKVPool, HiSparseTokenToKVPoolAllocator, "
                           "HiSparseCoordinator) with the radix cache off: 256 device slots, 512 logical, "
                           "32-token device buffers, page 1; staging copies in flight for one step",
        {"enable_hisparse": True, "num_slots": 256, "hisparse_staging_steps": 1})
_preset("sglang-hicache", "HiCache host tier (UnifiedRadixCache.init_hicache, HybridCacheController, "
                          "MHATokenToKVPoolHost): 128 device slots, host pool 2x, write_through, page 4; "
                          "each write-through / load-back ack one step after submission; no L3 storage; "
                          "the host pool's leak check needs --tree-core python",
        {"enable_hierarchical_cache": True, "num_slots": 128, "page_size": 4})
_preset("sglang-hicache-l3", "HiCache with the L3 storage tier (--hicache-storage-backend file: HiCacheFile "
                             "in a temporary directory per run): 128 device slots, host pool 1.25x (host "
                             "eviction is reached, and storage with it), write_through, page 4; "
                             "write-through acks back host copies up to storage, a queued request prefetches "
                             "what storage holds beyond its device and host match (wait_complete, 8-token "
                             "threshold); storage operations run on a step-driven stand-in of the storage "
                             "threads one step after they are queued; the host pool's leak check needs "
                             "--tree-core python",
        {"hicache_ratio": 1.25, "hicache_storage_backend": "file"}, "sglang-hicache")
_preset("sglang-mixed", "mixed-style chunked prefill (--enable-mixed-chunk: running requests decode inside "
                        "prefill batches, mix_with_running) with 16-token chunks under overlap scheduling, "
                        "page 1",
        {"chunked_prefill_size": 16, "enable_mixed_chunk": True, "enable_overlap": True})
_preset("sglang-priority", "priority scheduling with preemption (SchedulePolicy, preempt_to_schedule), "
                           "at most 4 queued requests and 3 running, waiting / running timeout aborts after "
                           "12 / 24 steps, page 1",
        {"enable_priority_scheduling": True, "priority_scheduling_preemption_threshold": 1,
         "max_running_requests": 3, "max_queued_requests": 4, "request_waiting_timeout_steps": 12,
         "request_running_timeout_steps": 24})
_preset("sglang-evict-tlru", "--radix-eviction-policy tlru (Tail-Optimized LRU: a conversation's tail past its "
                             "TTFT budget goes first; threshold 32, next_prompt_estimate 8 tokens) over "
                             "non-streaming sessions, 128 slots: allocations evict part of the tree, page 1",
        {"radix_eviction_policy": "tlru", "num_slots": 128,
         "radix_eviction_policy_config": '{"threshold": 32, "next_prompt_estimate": 8}',
         "enable_streaming_session": True, "session_streaming": False, "context_len": 96})
_preset("sglang-evict-priority", "--radix-eviction-policy priority (lower-priority requests' prefixes go "
                                 "first) with priority scheduling, 128 slots: allocations evict part of the "
                                 "tree; 3 running, so that a higher-priority request preempts; page 1",
        {"radix_eviction_policy": "priority", "enable_priority_scheduling": True, "num_slots": 128,
         "max_running_requests": 3})
_preset("sglang-evict-slru", "--radix-eviction-policy slru (segmented LRU, protected from 2 hits), 128 slots: "
                             "allocations evict part of the tree, page 4",
        {"radix_eviction_policy": "slru", "radix_eviction_policy_config": '{"protected_threshold": 2}',
         "num_slots": 128, "page_size": 4})
_preset("sglang-hicache-l3-timeout", "sglang-hicache-l3 with SGLang's default prefetch policy, timeout: a "
                                     "queued request waits for its storage prefetch at most 2 steps (the "
                                     "step clock as prefetch_timeout_base), then is admitted with what has "
                                     "landed; each storage operation takes 3 steps, so deadlines expire",
        {"hicache_storage_ack_steps": 3, "hicache_storage_prefetch_policy": "timeout"}, "sglang-hicache-l3")
_preset("sglang-hicache-l3-fail", "sglang-hicache-l3 over a failing storage backend: every third storage "
                                  "read or write fails whole (batch_get answers no page, batch_set False), "
                                  "so backups stop short and prefetches load nothing",
        {"hicache_storage_fail_every": 3}, "sglang-hicache-l3")
_preset("sglang-swa", "SWA hybrid (SWAKVPool, SWATokenToKVPoolAllocator, UnifiedRadixCache with its SWA "
                      "component): an 8-token sliding window, 256 full slots and 128 SWA slots, window "
                      "eviction every 4 tokens, page 1",
        {"sliding_window_size": 8, "num_slots": 256})
_preset("sglang-swa-chunked", "SWA hybrid with chunked prefill (16-token chunks) under overlap scheduling: "
                              "an 8-token window, 256 full and 128 SWA slots, page 4",
        {"page_size": 4, "chunked_prefill_size": 16, "enable_overlap": True}, "sglang-swa")
_preset("sglang-swa-small", "SWA hybrid with pools small enough that decode retracts: an 8-token window, "
                            "128 full and 48 SWA slots, 16-token chunks (a prompt longer than the SWA pool "
                            "is admitted in smaller chunks), at most 6 running, page 1",
        {"sliding_window_size": 8, "num_slots": 128, "swa_full_tokens_ratio": 0.375,
         "chunked_prefill_size": 16, "max_running_requests": 6, "new_token_ratio": 0.2})
_preset("sglang-swa-paged", "SWA hybrid with a page larger than the window: a 6-token window, 16-token "
                            "pages, 512 full and 256 SWA slots",
        {"sliding_window_size": 6, "page_size": 16})
_preset("sglang-swa-unaligned", "SWA hybrid with a window whole pages do not cover, and one past it not "
                                "either (window + 1 = 3 mod the page): a 6-token window, 4-token pages, "
                                "256 full and 128 SWA slots",
        {"sliding_window_size": 6, "page_size": 4}, "sglang-swa")
_preset("sglang-swa-chunkcache", "SWA hybrid with the radix cache off (SGLang's chunk cache for SWA: "
                                 "--disable-radix-cache), 16-token chunks under overlap scheduling, an "
                                 "8-token window, 128 full slots and an SWA pool of 24, under two chunks "
                                 "(the setting of sglang#36458), page 4",
        {"sliding_window_size": 8, "num_slots": 128, "swa_full_tokens_ratio": 0.1875, "page_size": 4,
         "swa_chunk_cache": True, "chunked_prefill_size": 16, "enable_overlap": True})
_preset("sglang-swa-session", "SWA hybrid with streaming sessions (a session's record keeps its SWA window "
                              "across turns): an 8-token window, 256 full and 128 SWA slots, page 1",
        {"enable_streaming_session": True, "context_len": 96}, "sglang-swa")
_preset("sglang-mamba", "hybrid SSM model (Mamba / GDN linear attention): HybridReqToTokenPool with a "
                        "24-slot MambaPool (3 per running request, as SGLang sizes it), HybridLinearKVPool, "
                        "UnifiedRadixCache with its mamba component (copy-on-write at a prefix hit, states "
                        "copied into the tree at each chunk and donated at finish), 32-token chunks, page 1",
        {"enable_mamba": True, "chunked_prefill_size": 32})
_preset("sglang-mamba-small", "hybrid SSM with small pools: 9 mamba slots (the least SGLang sizes for 3 "
                              "running requests), 96 KV slots, 16-token chunks (mamba eviction from the tree "
                              "and decode retraction happen), page 1",
        {"enable_mamba": True, "max_mamba_cache_size": 9, "max_running_requests": 3, "num_slots": 96,
         "context_len": 64, "chunked_prefill_size": 16})
_preset("sglang-mamba-overlap", "hybrid SSM under overlap scheduling (event_loop_overlap: a finished "
                                "request stays in the last batch after its state went to the tree), "
                                "8-token chunks, 12 mamba slots, 4 running requests, page 1",
        {"enable_mamba": True, "max_mamba_cache_size": 12, "max_running_requests": 4,
         "chunked_prefill_size": 8, "enable_overlap": True})
_preset("sglang-mamba-mixed", "hybrid SSM with the extra buffer (--mamba-radix-cache-strategy "
                              "extra_buffer: ping-pong track slots, a checkpoint donates the tracked state) "
                              "and --enable-mixed-chunk (running requests decode inside prefill batches), "
                              "16-token chunks, 8-token mamba chunks, 24 mamba slots, page 1",
        {"mamba_extra_buffer": True, "enable_mixed_chunk": True, "max_running_requests": 4,
         "chunked_prefill_size": 16}, "sglang-mamba")
_preset("sglang-mamba-session", "hybrid SSM with streaming sessions (a session record keeps its mamba "
                                "slot between turns: session_held_mamba_slots; StreamingSession frees it "
                                "at close), 24 mamba slots, 32-token chunks, page 1",
        {"enable_streaming_session": True, "context_len": 96}, "sglang-mamba")
_preset("sglang-spec-eagle", "speculative decoding, spec v2 EAGLE (3 draft steps, topk 1, 4-token verify): "
                             "each decode step reserves committed + 8 slots (eagle_prepare_for_decode, "
                             "alloc_for_spec_decode), a stand-in verify accepts 0-3 drafts a request, "
                             "SGLang's processor commits the run; 256 slots, page 1",
        {"speculative_algorithm": "eagle", "num_slots": 256})
_preset("sglang-spec-eagle-paged", "sglang-spec-eagle with 4-token pages (the reservation is page-aligned; "
                                   "the tail freed at release starts at the page after the owned KV), "
                                   "256 slots",
        {"page_size": 4}, "sglang-spec-eagle")
_preset("sglang-spec-ngram", "speculative decoding, spec v2 n-gram (no draft KV: 6-token verify, 6 steps, "
                             "topk 1): each decode step reserves committed + 12 slots, the stand-in accepts "
                             "0-5 drafts; 256 slots, page 1",
        {"speculative_algorithm": "ngram", "speculative_num_steps": 6, "speculative_num_draft_tokens": 6,
         "num_slots": 256})
_preset("sglang-spec-ngram-deep", "spec v2 n-gram with a verify as deep as a quarter of a short context "
                                  "(16 draft tokens, 16 steps, context 32): the double-buffered reserve "
                                  "(2 x 16) outgrows the req_to_token row's headroom (4 + 16) for a "
                                  "request near its context end; 256 slots, page 1",
        {"speculative_num_steps": 16, "speculative_num_draft_tokens": 16, "context_len": 32}, "sglang-spec-ngram")
_preset("sglang-spec-overlap", "sglang-spec-eagle under overlap scheduling (spec v2's default loop: a "
                               "verify's result is committed after the next step reserved from the lagging "
                               "kv_committed_len, the double-buffered reserve), page 4, 256 slots",
        {"page_size": 4, "enable_overlap": True}, "sglang-spec-eagle")
_preset("sglang-spec-retract", "sglang-spec-eagle with a pool small enough that decode retracts "
                               "(check_decode_mem with the spec-v2 estimate, retract_decode releasing "
                               "reserved tails): 64 slots, page 1",
        {"num_slots": 64, "new_token_ratio": 0.2}, "sglang-spec-eagle")
_preset("sglang-spec-session", "sglang-spec-eagle with streaming sessions (a turn's reserved draft tail "
                               "on the session's record: the spec-tail leak of sglang#22862), page 1",
        {"enable_streaming_session": True, "context_len": 96}, "sglang-spec-eagle")
_preset("sglang-spec-swa", "sglang-spec-eagle on an SWA hybrid (eagle_prepare_for_decode's maybe_evict_swa "
                           "before each reservation; the tail freed in both pools): an 8-token window, 256 "
                           "full and 128 SWA slots, page 1",
        {"sliding_window_size": 8}, "sglang-spec-eagle")
_preset("sglang-spec-mamba", "sglang-spec-eagle on a hybrid SSM model (mamba slots beside the draft "
                             "reservation; no extra buffer), 24 mamba slots, 32-token chunks, page 1",
        {"speculative_algorithm": "eagle"}, "sglang-mamba")
