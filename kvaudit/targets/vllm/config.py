"""Configuration, presets and injected faults of the real-vLLM target (``kvaudit fuzz --target vllm``).
Imports neither vLLM nor torch: the CLI validates flags and replay files with it where vLLM is not installed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from kvaudit.config import ConfigBase, Preset, json_value

# Faults the target injects through its wrappers of vLLM's own objects, to show the oracles see them on
# vLLM's code. Each fires once, on its first chance. (kind, description)
FAULTS: dict[str, tuple[str, str]] = {
    "skip-free": ("leak", "the first KVCacheManager.free(request) of a finished or aborted request is skipped: the "
        "request leaves the scheduler, its block table and ref counts stay"),
    "double-free-shared-prefix": ("use-after-free", "right after the first KVCacheManager.free(request) that leaves "
        "some of the request's blocks still referenced (a prefix another request shares), those shared blocks are "
        "freed once more through BlockPool.free_blocks: their ref_cnt reaches 0 while the other request still holds "
        "them, so the pool can hand them out again (vLLM notices nothing)"),
    "free-under-inflight-step": ("use-after-free", "vLLM #45357 put back (it shipped in 0.23.0): the Scheduler's "
        "defer_block_free is off, so with async scheduling and a KV consumer a finished, aborted or preempted "
        "request's blocks go back to the pool while a step in flight still writes them (vLLM >= 0.24.0; on 0.23.0 "
        "this is vLLM's own behaviour; scheduler level)"),
    "free-window-under-inflight-step": ("use-after-free", "vLLM #47282 put back (it shipped until 0.25.0): the "
        "coordinator's remove_skipped_blocks is given the request's num_computed_tokens, which async scheduling has "
        "advanced past the step in flight, instead of the processed count, so a sliding window's blocks that step "
        "still reads are freed (vLLM >= 0.26.0, a sliding-window preset; scheduler level)"),
    "free-under-inflight-load": ("use-after-free", "vLLM #32255 put back (it shipped in 0.15.1): the first abort of "
        "a request waiting for its remote KV (WAITING_FOR_REMOTE_KVS) frees its blocks at once instead of when the "
        "load reports finished_recving, while the KV connector's read still writes them (vLLM >= 0.16.0 with a KV "
        "connector; scheduler level)"),
    "refinish-held-request": ("double-free", "vLLM #33377 put back (it shipped in 0.15.1): the first abort of a "
        "request whose blocks the KV connector holds (a save in flight) finishes it a second time "
        "(Scheduler._free_request), so the connector's request_finished runs twice and a second save of the same "
        "blocks starts (scheduler level, with a KV connector that delays frees: vllm-kv-save)"),
    "free-preempted-under-inflight-step": (
        "use-after-free", "vLLM #49674's setting (a KV consumer, async scheduling): a request preempted while a "
        "step in flight still writes its blocks is freed at once, past the deferred-free fence (as a fix of "
        "#49674's zero-progress preemptions that reclaimed the fenced victim would), so the preempting request can "
        "be given blocks that step still writes (vLLM >= 0.24.0; for the whole run; scheduler level: "
        "vllm-kv-connector-small)"),
    "leak-rejected-draft-blocks": ("leak", "the first time a step's rejected draft tokens leave a request holding "
        "blocks wholly past its rolled-back num_computed_tokens, those blocks are dropped from its table with their "
        "ref_cnt kept: blocks allocated for rejected speculative tokens never freed (the class of SGLang's draft "
        "over-allocation leaks, sglang #13826 and #19518; scheduler level, num_spec_tokens > 0)"),
    "lose-failed-load": ("hang", "vLLM #50719 put back in the NIXL stand-in (a Mooncake worker shipped it until "
        "#50984): the first failed KV load is only logged, never reported (no finished_recving, no "
        "invalid_block_ids), so its request stays in WAITING_FOR_REMOTE_KVS holding its blocks, or, aborted "
        "meanwhile, holds them for good (the symptom of #46283); presets with kv_load_failure_policy"),
    "keep-computed-on-preempt": ("stale-kv", "the first preempted request keeps its num_computed_tokens while "
        "Scheduler._preempt_request frees its blocks: it resumes without a prefix-cache lookup on fresh blocks "
        "never written for its prefix, and its next step reads them (scheduler level; vllm-small preempts)"),
    "drop-hash-entry": ("accounting-drift", "the first BlockPool._insert_block_hash(...) that caches a block loses "
        "its prefix-cache map entry: the block carries a hash the map does not hold"),
    "skip-offload-flush": ("use-after-free", "the first jobs_to_flush of OffloadingConnector's metadata that names "
        "a store started in an earlier step is dropped: that store still reads GPU blocks the step reallocates and "
        "writes (the fence of offloading/scheduler.py's _block_id_to_pending_jobs lost; vllm-offload*)"),
    "close-waiting-session-keeps-blocks": ("leak", "the first close of a streaming session waiting for its next "
        "input (WAITING_FOR_STREAMING_REQ: Scheduler.add_request of the final, non-resumable request, which "
        "finishes it as aborted) drops the session's block tables but not its blocks' references "
        "(streaming_sessions presets)"),
    "free-cow-source-before-copy": ("use-after-free", "the Scheduler's _free_cow_retained_blocks ignores its fence: "
        "the endpoints of a partial cache hit's copy-on-write (source and destination block) go back to the pool "
        "when the step that runs the copy is scheduled, not when it has run, so with a KV consumer and async "
        "scheduling a load may overwrite the source before the copy reads it (for the whole run; scheduler level: "
        "vllm-mamba-async)"),
}

# The faults that put back a bug vLLM shipped: its history-catalogue id (kvaudit/targets/vllm/catalogue.py, which
# names the first release with the fix). On an older release the bug is vLLM's own, and a finding need not
# come from the fault (kind.notes says so on the run's first lines).
FAULT_BUGS: dict[str, str] = {
    "free-under-inflight-step": "vllm-45357",
    "free-window-under-inflight-step": "vllm-47282",
    "free-under-inflight-load": "vllm-32255",
    "refinish-held-request": "vllm-33377",
}


def fault_fixed_in(fault: str) -> str | None:
    """The first vLLM release with the fix of the bug ``fault`` puts back (:data:`FAULT_BUGS`), else None."""
    from kvaudit.targets.vllm.catalogue import BUGS
    bug = FAULT_BUGS.get(fault)
    return {b.id: b for b in BUGS}[bug].fixed if bug is not None else None


LEVELS = ("scheduler", "manager")
# KV connectors the target builds on the scheduler side (vLLM's registered names); the worker side is the
# driver's stand-in (kvaudit/targets/vllm/connector.py)
KV_CONNECTORS = ("NixlConnector", "KvauditAsyncSaveConnector",  # the second: kvaudit/targets/vllm/save_connector.py
                 "SimpleCPUOffloadConnector",  # vLLM >= 0.20.0 (the target's range); eager mode
                 "NixlPushConnector",  # vLLM >= 0.24.0: NIXL in push mode (the prefill side writes)
                 "OffloadingConnector", "LMCacheMPConnector",  # vLLM >= 0.30.0 (compat "offloading-jobs")
                 "MultiConnector")  # NixlConnector + OffloadingConnector, in that order
NIXL = ("NixlConnector", "NixlPushConnector")
OFFLOADING = ("OffloadingConnector", "MultiConnector")  # the connectors with an OffloadingConnector in them
KV_ROLES = ("kv_both", "kv_producer")  # vLLM's KVTransferConfig.kv_role values the driver builds
SCHEDULING_POLICIES = ("fcfs", "priority")  # vLLM's SchedulerConfig.policy (every release driven has both)
SPEC_METHODS = ("ngram", "eagle")  # vLLM's SpeculativeConfig methods the driver builds
KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")  # vLLM's KVTransferConfig.kv_load_failure_policy (0.15.1 on)


@dataclass(frozen=True)
class VllmConfig(ConfigBase):
    """How vLLM's v1 KV-cache stack is built and driven.

    ``level``: ``scheduler`` drives ``vllm.v1.core.sched.Scheduler`` (``AsyncScheduler`` with ``async_scheduling``,
    one batch in flight) with synthetic model outputs; ``manager`` the ``KVCacheManager`` alone, the driver
    playing the scheduler's calls. ``num_gpu_blocks``: the pool, block 0 (vLLM's null block) included, of
    ``block_size`` tokens. ``sliding_window`` (tokens): a sliding-window group beside full attention
    (``HybridKVCacheCoordinator``), one ``BlockPool`` shared. ``max_num_seqs``, ``max_num_batched_tokens``,
    ``max_model_len``, ``enable_chunked_prefill``, ``enable_prefix_caching``: vLLM's engine arguments.
    ``scheduling_policy``: ``SchedulerConfig.policy``; under ``priority`` a submit's ``priority`` is
    ``Request.priority`` (lower first) and the victim is the running request of the largest ``(priority,
    arrival_time)`` (``Scheduler.schedule``). ``bugs``: injected faults (:data:`FAULTS`). ``vocab_size``: the
    synthetic sampler's vocabulary; its last token is EOS.

    ``kv_connector``: a connector of vLLM's by registered name, built by the Scheduler with ``kv_role``
    (``kv_producer`` is no KV consumer: no in-flight-write check); its worker side a stand-in (:mod:`kvaudit.
    targets.vllm.connector`) that completes a transfer 1 to ``kv_transfer_latency_steps`` steps on.
    ``num_cpu_blocks``: the CPU tier's blocks: ``SimpleCPUOffloadConnector``'s own ``BlockPool`` (block 0 its
    null block; eager mode, vLLM's default and #42571's), or an ``OffloadingConnector``'s one-block chunks (LRU).
    ``return_routed_experts``: vLLM's ``enable_return_routed_experts`` (0.22.0 to 0.30.0; 4 experts, 2 a token).
    ``wake_for_transfers``: with only finished requests whose KV is being sent left, step anyway (vLLM before
    0.22.0, #43433, stops: a hang; this lets a search reach other bugs past it).
    ``num_spec_tokens``: draft tokens per step (0: off), ``SpeculativeConfig`` with ``spec_method`` (``ngram``,
    or ``eagle``: a stub draft model, lookahead slots); the driver plays the drafter and the rejection sampler.
    ``kv_load_failure_policy``: vLLM's ``KVTransferConfig`` field; ``None``: vLLM's default (``recompute`` in
    0.15.1/0.16.0, then ``fail``) and no transfer fails; set (NIXL, one group), programs draw ``transfer_fail``.
    ``mamba``: a Mamba group (``MambaSpec``, one state block per ``block_size`` tokens) beside full attention,
    ``mamba_cache_mode`` ``align`` with prefix caching, else ``none``; ``prefix_match_unit``: ``CacheConfig``'s
    tokens per block hash (a divisor of ``block_size`` below it): a hit may end inside a block, which the
    request copies (copy-on-write; vLLM 0.33.0).
    ``streaming_sessions``: programs open streaming-input sessions (resumable requests, vLLM #28973).
    ``flush_running``: ``flush_cache`` is ``reset_prefix_cache(reset_running_requests=True)`` (a dev-mode server's
    query, an RLHF weight sync): running requests are preempted and resumed; off, vLLM's default.
    """

    level: str = "scheduler"
    num_gpu_blocks: int = 64
    block_size: int = 16
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 128
    max_model_len: int = 512
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    async_scheduling: bool = False
    sliding_window: int | None = None
    vocab_size: int = 128
    kv_connector: str | None = None
    kv_transfer_latency_steps: int = 3
    wake_for_transfers: bool = False
    kv_role: str = "kv_both"
    num_cpu_blocks: int = 8
    return_routed_experts: bool = False
    scheduling_policy: str = "fcfs"
    num_spec_tokens: int = 0
    spec_method: str = "ngram"
    kv_load_failure_policy: str | None = None
    streaming_sessions: bool = False
    mamba: bool = False
    prefix_match_unit: int | None = None
    flush_running: bool = False
    bugs: frozenset[str] = field(default_factory=frozenset)
    seed: int = 0
    preset: str = "custom"
    target: str = "vllm"

    BUGS_NOUN = "fault names"

    @property
    def page_size(self) -> int:
        return self.block_size

    @property
    def hash_block_size(self) -> int:
        """The tokens each prefix-cache block hash covers (vLLM's ``hash_block_size``)."""
        return self.prefix_match_unit or self.block_size

    @property
    def num_slots(self) -> int:
        """Tokens in the pool, the null block excluded (what the generators size prompts by)."""
        return (self.num_gpu_blocks - 1) * self.block_size

    @property
    def context_len(self) -> int:
        return self.max_model_len

    def blocks_per_request(self) -> int:
        """The most blocks one request of ``max_model_len`` tokens may hold, every group: what vLLM's start-up
        check (``kv_cache_utils.check_enough_kv_cache_memory``, each spec's ``max_memory_usage_bytes``) needs.
        A window's: ``SlidingWindowSpec.max_admission_blocks_per_request``, with ``max_num_batched_tokens`` in
        flight per concurrent batch; Mamba's: ``MambaSpec.max_memory_usage_bytes``."""
        n = math.ceil(self.max_model_len / self.block_size)
        if self.sliding_window is not None:
            in_flight = (2 if self.async_scheduling else 1) * self.max_num_batched_tokens
            n += math.ceil(min(self.sliding_window - 1 + in_flight, self.max_model_len) / self.block_size) + 1
        return n + (1 + self.enable_prefix_caching + self.num_spec_tokens) * self.mamba

    def __post_init__(self) -> None:
        """Raises ValueError (one line) on the first of :meth:`_refusals`."""
        why = next((why for refused, why in self._refusals() if refused), None)
        if why is not None:
            raise ValueError(why)
        self._freeze_faults(FAULTS, "vllm")

    def _refusals(self):
        """``(refused, why)`` in order: a field outside its row (:data:`RANGES`, :data:`CHOICES`, a ``bool``), a
        field the manager level cannot run (:data:`SCHEDULER_ONLY`), a combination vLLM refuses."""
        for f in fields(self):
            v, (lo, hi) = getattr(self, f.name), RANGES.get(f.name, (None, None))
            yield f.type == "bool" and not isinstance(v, bool), f"{f.name} must be true or false, got {json_value(v)}"
            yield (lo is not None and (not isinstance(v, int) or isinstance(v, bool) or v < lo or hi and v > hi),
                   f"{f.name} must be an integer in [{lo}, {hi or 'inf'}], got {json_value(v)}")
            yield (f.name in CHOICES and v not in CHOICES[f.name],
                   f"{f.name} must be one of {', '.join(map(json_value, CHOICES.get(f.name, ())))}, got {json_value(v)}")
            yield f.name in SCHEDULER_ONLY and v != f.default and self.level != "scheduler", \
                f"{f.name} needs level scheduler"
        c, w, u = self, self.sliding_window, self.prefix_match_unit
        yield (c.max_num_batched_tokens < c.block_size or c.max_model_len < 2 * c.block_size,
               "max_num_batched_tokens must be at least block_size, max_model_len 2 * block_size")
        yield (c.max_num_batched_tokens < c.max_num_seqs, f"max_num_batched_tokens ({c.max_num_batched_tokens}) must "
               f"be at least max_num_seqs ({c.max_num_seqs}) (vLLM's SchedulerConfig rule)")
        yield (not c.enable_chunked_prefill and c.max_num_batched_tokens < c.max_model_len, "without chunked prefill, "
               "max_num_batched_tokens must be at least max_model_len (vLLM's SchedulerConfig rule)")
        yield (w is not None and (not isinstance(w, int) or isinstance(w, bool) or not 1 <= w < c.max_model_len),
               f"sliding_window must be null or an integer in [1, max_model_len), got {json_value(w)}")
        yield (c.blocks_per_request() > c.num_gpu_blocks - 1, f"a request of max_model_len={c.max_model_len} tokens "
               f"may need {c.blocks_per_request()} blocks, more than the pool's {c.num_gpu_blocks - 1}: vLLM refuses "
               "to start so (check_enough_kv_cache_memory); lower max_model_len")
        yield (u is not None and (not c.mamba or u not in CHOICES["block_size"] or u >= c.block_size),
               f"prefix_match_unit must be null or, with mamba, a power of two below block_size, got {json_value(u)}")
        yield (c.mamba and w is not None,
               "mamba and sliding_window together are not built (one group beside full attention)")
        yield (c.kv_connector == "SimpleCPUOffloadConnector" and not c.enable_prefix_caching,
               "SimpleCPUOffloadConnector needs enable_prefix_caching (vLLM turns the offload off without it)")
        yield (c.kv_load_failure_policy is not None and (c.kv_connector not in NIXL or w is not None),
               "kv_load_failure_policy needs a NIXL kv_connector and no sliding_window")
        yield not isinstance(c.preset, str), f"preset must be a string, got {json_value(c.preset)}"


# the rows __post_init__ checks: an integer field's range (None: no upper end), a field's values, the fields
# whose value other than the default needs level scheduler (the Scheduler owns them)
RANGES = {"num_gpu_blocks": (4, 1 << 16), "block_size": (1, 128), "max_num_seqs": (1, 256),
          "max_num_batched_tokens": (1, 1 << 16), "max_model_len": (1, 1 << 16), "vocab_size": (4, 1 << 16),
          "seed": (0, None), "kv_transfer_latency_steps": (1, 64), "num_cpu_blocks": (2, 1 << 16),
          "num_spec_tokens": (0, 8)}
CHOICES = {"target": ("vllm",), "level": LEVELS, "block_size": tuple(1 << i for i in range(8)),
           "kv_connector": (None, *KV_CONNECTORS), "kv_role": KV_ROLES, "scheduling_policy": SCHEDULING_POLICIES,
           "spec_method": SPEC_METHODS, "kv_load_failure_policy": (None, *KV_LOAD_FAILURE_POLICIES)}
SCHEDULER_ONLY = ("async_scheduling", "streaming_sessions", "mamba", "kv_connector", "num_spec_tokens",
                  "scheduling_policy")


VLLM_PRESETS: dict[str, Preset] = {}


def _preset(name: str, description: str, base: str | None = None, **overrides) -> None:
    """Add a row to :data:`VLLM_PRESETS`: ``overrides`` on those of preset ``base`` (None: the defaults)."""
    inherited = VLLM_PRESETS[base].overrides if base else {}
    VLLM_PRESETS[name] = Preset(name, description, {**inherited, **overrides}, config_class=VllmConfig)


SMALL = dict(num_gpu_blocks=16, block_size=4, max_num_batched_tokens=32, max_model_len=60)  # vllm-small's pool
NIXL_ASYNC = dict(async_scheduling=True, kv_connector="NixlConnector")  # vllm-kv-connector

_preset("vllm", "the Scheduler: 64 blocks of 16, prefix caching, chunked prefill (128-token budget), 8 sequences")
_preset("vllm-async", "the AsyncScheduler with one batch in flight (vLLM's default scheduling)", async_scheduling=True)
_preset("vllm-small", "the Scheduler on 16 blocks of 4 tokens: decode runs out and preempts by itself", **SMALL)
_preset("vllm-async-small", "vllm-small on the AsyncScheduler: decode runs out with a batch in flight, so requests "
        "are preempted while a step still writes their blocks", "vllm-small", async_scheduling=True)
_preset("vllm-priority", "vllm-small with priority scheduling: a submit's priority orders the queue and names the "
        "victim (the running request of the largest priority value)", "vllm-small", scheduling_policy="priority")
_preset("vllm-priority-async", "vllm-priority on the AsyncScheduler (preemption by priority with a step in flight)",
        "vllm-priority", async_scheduling=True)
_preset("vllm-hybrid", "the Scheduler over full attention + a 32-token sliding window (HybridKVCacheCoordinator), 96 "
        "blocks shared", num_gpu_blocks=96, sliding_window=32)
_preset("vllm-manager", "the KVCacheManager alone, driven at manager level (fast): 24 blocks of 4 tokens, preemption "
        "by recompute", level="manager", num_gpu_blocks=24, block_size=4, max_num_batched_tokens=64, max_model_len=92)
_preset("vllm-kv-connector", "the AsyncScheduler with vLLM's NixlConnector (scheduler side; the worker side a "
        "stand-in): some requests wait for remote KV, finished ones are held while their KV is sent, transfers "
        "complete 1-3 steps later", **NIXL_ASYNC)
_preset("vllm-kv-connector-small", "vllm-kv-connector on vllm-small's pool: the KV consumer fences the frees of a "
        "step in flight (deferred_frees), so a victim that step still writes is not preempted (vLLM #49674)",
        "vllm-kv-connector", **SMALL)
_preset("vllm-kv-connector-swa", "vllm-kv-connector over full attention + a 32-token sliding window (96 blocks "
        "shared), as a decode instance of a sliding-window model runs it on a GPU (the hybrid manager; vLLM turns it "
        "off on CPU)", "vllm-kv-connector", sliding_window=32, num_gpu_blocks=96)
_preset("vllm-kv-load", "the Scheduler (one batch in flight) with vLLM's NixlConnector as vllm-kv-connector, stepping "
        "on while sends are outstanding (wake_for_transfers): remote KV loads and aborts during them, without vLLM "
        "#45357's async-step window", kv_connector="NixlConnector", wake_for_transfers=True)
_preset("vllm-kv-fail", "vllm-kv-connector whose transfers may fail (transfer_fail: a read reports its blocks "
        "invalid, a send ends as on lease expiry; memory_pressure reports running requests' cached blocks invalid), "
        "kv_load_failure_policy recompute", "vllm-kv-connector", kv_load_failure_policy="recompute")
_preset("vllm-kv-fail-abort", "vllm-kv-load whose transfers may fail as in vllm-kv-fail, kv_load_failure_policy fail "
        "(the requests hit end with FINISHED_ERROR)", "vllm-kv-load", kv_load_failure_policy="fail")
_preset("vllm-kv-push-fail", "vllm-kv-fail with vLLM's NixlPushConnector (vLLM >= 0.24.0): the prefill side writes a "
        "decode request's KV; a failed push is never written, so never reported", "vllm-kv-fail",
        kv_connector="NixlPushConnector")
_preset("vllm-kv-save", "the AsyncScheduler with kvaudit's save connector (KvauditAsyncSaveConnector, kv_producer): "
        "every finished request, aborted ones too, holds its blocks until its KV is saved, 1-3 steps later (the "
        "OffloadingConnector of 0.15.1/0.16.0 with a store in flight; from 0.21.0 it never delays a free: "
        "vllm-offload models it)", async_scheduling=True, kv_connector="KvauditAsyncSaveConnector",
        kv_role="kv_producer", wake_for_transfers=True)
_preset("vllm-cpu-offload-swa", "the Scheduler (one batch in flight) with vLLM's SimpleCPUOffloadConnector in eager "
        "mode (scheduler side real, worker side a stand-in) over full attention + an 8-token sliding window, 48 GPU "
        "blocks of 4 tokens, a 16-token step budget and 6 CPU blocks, stores and loads completing 1-12 steps later, "
        "in order (the setting of vLLM #42571: the window slides every few tokens and a small CPU tier holds back its "
        "stores); stepping on while a store is outstanding (wake_for_transfers: before 0.30.0 the connector reports "
        "no pending push work, so an idle engine stops stepping)", kv_connector="SimpleCPUOffloadConnector",
        block_size=4, sliding_window=8, num_gpu_blocks=48, max_model_len=128, max_num_batched_tokens=16,
        num_cpu_blocks=6, kv_transfer_latency_steps=12, wake_for_transfers=True)
_preset("vllm-cpu-offload-swa-async", "vllm-cpu-offload-swa on the AsyncScheduler (vLLM's default scheduling; before "
        "0.24.0 vLLM #45357 is found first there)", "vllm-cpu-offload-swa", async_scheduling=True)
_preset("vllm-offload", "the AsyncScheduler with vLLM's OffloadingConnector (scheduler side real, worker a stand-in) "
        "and a 64-chunk CPU tier: computed blocks are stored, CPU hits loaded, stores finish 1-3 steps later (vLLM >= "
        "0.30.0)", async_scheduling=True, kv_connector="OffloadingConnector", num_cpu_blocks=64)
_preset("vllm-offload-small", "vllm-offload on vllm-small's 16 blocks of 4 with a 6-chunk CPU tier and stores "
        "finishing 1-12 steps later: blocks a store still reads are reallocated (jobs_to_flush) and the CPU tier "
        "evicts", "vllm-offload", **SMALL, num_cpu_blocks=6, kv_transfer_latency_steps=12)
_preset("vllm-lmcache-mp", "the AsyncScheduler with vLLM's LMCacheMPConnector (its lmcache client a stand-in whose "
        "server holds nothing): every finished request holds its blocks until the worker reports it stored, 1-3 steps "
        "later (vLLM >= 0.30.0)", async_scheduling=True, kv_connector="LMCacheMPConnector")
_preset("vllm-multi-connector", "the AsyncScheduler with vLLM's MultiConnector over NixlConnector (as "
        "vllm-kv-connector) and OffloadingConnector on vllm-offload-small's pool and tier: NIXL loads reuse blocks "
        "older stores read (vLLM #46951)", "vllm-offload-small", kv_connector="MultiConnector")
_preset("vllm-moe-experts", "the AsyncScheduler over a mixture-of-experts stub model returning routed experts (vLLM "
        "0.22.0 to 0.30.0's enable_return_routed_experts)", async_scheduling=True, return_routed_experts=True)
_preset("vllm-spec", "the Scheduler with speculative decoding (ngram, 4 draft tokens a step): each step accepts a "
        "random prefix of the drafts and rolls back the rest", num_spec_tokens=4)
_preset("vllm-spec-async", "vllm-spec on the AsyncScheduler: draft placeholders, rejections rolled back with a step "
        "in flight", "vllm-spec", async_scheduling=True)
_preset("vllm-spec-kv-connector", "vllm-spec-async with vLLM's NixlConnector (as vllm-kv-connector) and prefix caching",
        "vllm-spec-async", kv_connector="NixlConnector")
_preset("vllm-spec-eagle", "vllm-spec-async with an EAGLE drafter (a stub draft model): 4 lookahead slots a step; "
        "block hashes cover the next token (0.33.0; before, a hit drops its last block)", "vllm-spec-async",
        spec_method="eagle")
_preset("vllm-spec-small", "vllm-spec-async on vllm-small's 16 blocks of 4 tokens: requests are preempted with drafts "
        "scheduled and a step in flight", "vllm-spec-async", **SMALL)
_preset("vllm-sessions", "the Scheduler with streaming-input sessions (resumable requests): a session's next input "
        "chunk resumes it, a stopped session holds its KV while it waits for one", streaming_sessions=True)
_preset("vllm-sessions-async", "vllm-sessions on the AsyncScheduler (a turn stops with a step in flight)",
        "vllm-sessions", async_scheduling=True)
_preset("vllm-sessions-nocache", "vllm-sessions-async with prefix caching off (a session's blocks are its own)",
        "vllm-sessions-async", enable_prefix_caching=False)
_preset("vllm-mamba", "the Scheduler over full attention + a Mamba group (MambaManager, mamba_cache_mode align), 96 "
        "blocks of 16 shared, block hashes every 4 tokens: a cache hit inside a block copies that block "
        "(copy-on-write)", mamba=True, prefix_match_unit=4, num_gpu_blocks=96)
_preset("vllm-mamba-async", "vllm-mamba on the AsyncScheduler with vLLM's NixlConnector (a KV consumer, as "
        "vllm-kv-connector): a copy-on-write's blocks are freed behind the fence of the step that runs the copy "
        "(deferred_frees)", "vllm-mamba", **NIXL_ASYNC)
_preset("vllm-mamba-small", "vllm-mamba on the AsyncScheduler on 20 blocks of 4 tokens (hashes every 2): Mamba "
        "requests are preempted with a step in flight", "vllm-mamba", prefix_match_unit=2, async_scheduling=True,
        num_gpu_blocks=20, block_size=4, max_num_batched_tokens=32, max_model_len=60)
_preset("vllm-mamba-spec", "vllm-mamba with speculative decoding (ngram, 4 draft tokens a step): a request holds 4 "
        "speculative state blocks besides its running one (num_speculative_blocks)", "vllm-mamba", num_spec_tokens=4)
_preset("vllm-mamba-spec-async", "vllm-mamba-async with speculative decoding (ngram, 4 draft tokens a step): a KV "
        "consumer's loads, copy-on-write fences and 4 speculative state blocks a request, drafts rolled back with a "
        "step in flight (vLLM #54392's setting, short of its drafter and transfer engine)", "vllm-mamba-async",
        num_spec_tokens=4)
_preset("vllm-mamba-spec-small", "vllm-mamba-small with speculative decoding (ngram, 4 draft tokens a step) and "
        "max_model_len 40 (at most 16 blocks a request, of the pool's 19; at 60, 21: refused): Mamba requests "
        "holding speculative state blocks are preempted with drafts scheduled and a step in flight",
        "vllm-mamba-small", num_spec_tokens=4, max_model_len=40)
_preset("vllm-mamba-cpu-offload", "vllm-cpu-offload-swa with a Mamba group instead of the window (hashes every 2 "
        "tokens): the connector stores the boundary states the Mamba manager offers (boundary_state_offloads) to its "
        "CPU tier", "vllm-cpu-offload-swa", sliding_window=None, mamba=True, prefix_match_unit=2)
