"""vLLM's rows of the history catalogue (:mod:`kvaudit.history.catalogue`): its known KV-lifecycle bugs, each
with its last buggy and first clean release, and those not rediscovered (``../shared/reference/history-facts.md``)."""

from __future__ import annotations

from kvaudit.targets.catalogue import HistoryBug, Unreached

BUGS: tuple[HistoryBug, ...] = (
    HistoryBug(
        id="vllm-45357", engine="vllm",
        title="blocks freed while an in-flight async step still writes them, then reused as a KV load's target",
        sources=("vllm-project/vllm#45357",), buggy="0.23.0", fixed="0.24.0", clean_because="fix",
        preset="vllm-kv-connector", finding="use-after-free", check="inflight-write",
        reach="a decode instance (NixlConnector, kv_both or kv_consumer) with async scheduling, the default: "
              "a request that finishes (EOS) or is aborted while the next batch, which scheduled it again, "
              "runs; its blocks go back to the pool and a new request's remote KV load can land in them "
              "before that batch's writes"),
    HistoryBug(
        id="vllm-47282", engine="vllm",
        title="a sliding window's out-of-window blocks freed on the optimistic num_computed_tokens while an "
              "in-flight async step still reads them",
        sources=("vllm-project/vllm#47282", "vllm-project/vllm#47728"), buggy="0.25.0", fixed="0.26.0",
        clean_because="fix", preset="vllm-kv-connector-swa", finding="use-after-free", check="inflight-read",
        reach="a decode instance of a sliding-window model (hybrid KV-cache manager, a GPU) with a KV-consumer "
              "connector and async scheduling: remove_skipped_blocks runs with num_computed_tokens already "
              "advanced past the step in flight (at the next schedule, or at finish in _connector_finished), "
              "so blocks that step's attention window still reads go back to the pool, where a remote KV "
              "load can overwrite them mid-read"),
    HistoryBug(
        id="vllm-42571", engine="vllm",
        title="eager SimpleCPUOffloadConnector with a sliding window: one request's store lists a GPU block "
              "twice, and when the store completes after the request let go, free_blocks queues it twice",
        sources=("vllm-project/vllm#42571", "vllm-project/vllm#42615", "vllm-project/vllm#42903"),
        buggy="0.23.0", fixed="0.24.0", clean_because="refactor",
        preset="vllm-cpu-offload-swa", finding="double-free", check="queued-twice",
        reach="a sliding-window model with vLLM's SimpleCPUOffloadConnector in eager mode (its default): a "
              "request's pending store keeps the id of a block the window dropped; the same request is given "
              "that block back (its full-attention group shares the pool) while a small or busy CPU tier holds "
              "the store back, so one store event lists the block twice and takes two references; at the "
              "store's completion, after the request finished, <= 0.23.0's BlockPool.free_blocks queues it "
              "twice (a corrupt free list, then an assertion in the free queue). The fix PRs are still open: "
              "0.24.0's rewritten free_blocks queues a block once, and 0.33.0 still lists the duplicate (two "
              "CPU copies of one block, the pool whole)"),
    HistoryBug(
        id="vllm-43433", engine="vllm",
        title="once only finished requests whose KV connector delays their free are left, the engine stops "
              "stepping: their blocks stay allocated until another request arrives",
        sources=("vllm-project/vllm#43433",), buggy="0.21.0", fixed="0.22.0", clean_because="fix",
        preset="vllm-kv-connector", config={"async_scheduling": False}, finding="hang",
        reach="a prefill instance (NixlConnector, do_remote_decode) or any connector that delays frees: the "
              "last request finishes while its KV is being sent; Scheduler.has_finished_requests says no work is "
              "left, the engine core stops calling step(), the connector's finished_sending is never taken, and "
              "the blocks stay held until the next client request (0.22.0 counts such requests as work). "
              "Synchronous scheduling here, so that 0.22.0 (before #45357's fix) has nothing else to report"),
    HistoryBug(
        id="vllm-32255", engine="vllm",
        title="a request aborted while its remote KV load is in flight has its blocks freed at once; the "
              "load still writes them",
        sources=("vllm-project/vllm#32255",), buggy="0.15.1", fixed="0.16.0", clean_because="fix",
        preset="vllm-kv-load", finding="use-after-free", check="inflight-load",
        reach="a decode instance (NixlConnector, kv_both or kv_consumer): a client disconnects while its "
              "request waits for the prefill instance's KV (WAITING_FOR_REMOTE_KVS); 0.15.1's "
              "finish_requests frees the blocks the NIXL read is writing, and the next request can get them"),
    HistoryBug(
        id="vllm-33377", engine="vllm",
        title="with async scheduling, a request already finished (aborted, or stopped) whose KV connector holds "
              "its blocks is finished again when its in-flight step's output comes back: request_finished "
              "twice, two sends, a double free",
        sources=("vllm-project/vllm#33377",), buggy="0.15.1", fixed="0.16.0", clean_because="fix",
        preset="vllm-kv-save", finding="double-free", check="finished-once",
        reach="async scheduling (the default) with a KV connector that saves asynchronously and delays the free "
              "of finished requests, aborted ones included (LMCache, OffloadingConnector with a store in "
              "flight): a client aborts while the request's step is in flight; 0.15.1's update_from_output "
              "processes its token, finds it stopped and frees it again; the second finished_sending then "
              "trips an assertion and kills EngineCore"),
    HistoryBug(
        id="vllm-49684", engine="vllm",
        title="the routed-experts block-id snapshot (Scheduler._re_block_ids) keeps an entry for every "
              "request aborted before its step produced a token",
        sources=("vllm-project/vllm#49684",), buggy="0.30.0", fixed="0.31.0", clean_because="refactor",
        replay_blocked="0.31.0 moves the routed experts behind Model Runner V2, whose config needs Triton: "
                       "vLLM refuses the preset's config on CPU",
        preset="vllm-moe-experts", finding="leak", check="dead-table:_re_block_ids",
        reach="a mixture-of-experts model served with enable_return_routed_experts and async scheduling: each "
              "client abort of a request whose step is in flight leaves its entry for good (the server's "
              "memory grows with aborts). Fixed in 0.31.0 by a refactor (an aux-output connector behind "
              "Model Runner V2), which needs Triton: the fixed twin is not built on CPU, so the program is "
              "not replayed there"),
    HistoryBug(
        id="vllm-49860", engine="vllm",
        title="with async scheduling and speculative decoding, reset_prefix_cache(reset_running_requests=True) "
              "sets a request's stale-frame discard count to its output placeholders (tokens, not frames): "
              "its real frames are dropped after it resumes, and then it is never scheduled again",
        sources=("vllm-project/vllm#49860", "vllm-project/vllm#46066", "vllm-project/vllm#48245"),
        buggy="0.26.0", fixed="0.27.0", clean_because="refactor",
        preset="vllm-spec-async", config={"flush_running": True}, finding="hang",
        reach="a dev-mode server's POST /reset_prefix_cache?reset_running_requests=true, or an RLHF weight "
              "sync (sleep or pause with the cache cleared), while a speculative-decoding request runs under "
              "async scheduling: async_tokens_to_discard is set to num_output_placeholders (1 + the drafts of "
              "the step in flight) but drains one frame per output, so the resumed request's own outputs are "
              "dropped while their placeholders stay; once it is one token from max_tokens the scheduler's "
              "guard for an output in flight skips it with nothing in flight: the request never finishes and "
              "holds its blocks. #49860 (closed) named the inflated placeholders; 0.27.0's rework of stale "
              "outputs (#48245: num_stale_output_tokens, async_tokens_to_discard gone) removed the path"),
    HistoryBug(
        id="vllm-52693", engine="vllm",
        title="a streaming session whose turn stops with its next step in flight is stopped again by that "
              "step's output: queued twice (scheduled twice, then schedule() raises), or from 0.27.0 taken out "
              "of every queue (its next input chunk is never scheduled and its KV stays held)",
        sources=("vllm-project/vllm#52693", "vllm-project/vllm#52765"), buggy="0.30.0", fixed="0.31.0",
        clean_because="fix", preset="vllm-sessions-async", finding="hang", check="waiting:waiting",
        reach="AsyncLLM.generate with a streaming input (the realtime API) under async scheduling: a turn ends "
              "(stop string, max_tokens) while the next step is in flight; that step's token comes back, "
              "update_from_output stops the WAITING_FOR_STREAMING_REQ session a second time and, as a stopped "
              "non-running request, removes it from the waiting queues (0.27.0-0.30.0; 0.21.0-0.26.0 leave a "
              "duplicate entry, and the next chunk is scheduled twice: RuntimeError 'Invalid request status: "
              "RUNNING' kills EngineCore). The next chunk sets it WAITING in no queue: the engine core counts "
              "no work, the client waits for good and the session's blocks stay held. 0.31.0's "
              "_handle_stopped_request drops the finished turn's in-flight output (the merged PR was not "
              "identified; #52765, open, describes both causes)"),
    HistoryBug(
        id="vllm-46951", engine="vllm",
        title="under MultiConnector, OffloadingConnector does not record the blocks allocated for another "
              "connector's load, so a NIXL load may be given a block an older offload store still reads",
        sources=("vllm-project/vllm#46951", "vllm-project/vllm#46960", "vllm-project/vllm#47046"),
        buggy="0.32.0", fixed="0.33.0", clean_because="fix", preset="vllm-multi-connector",
        finding="use-after-free", check="inflight-store",
        reach="a decode instance with MultiConnector over NixlConnector and OffloadingConnector under GPU-block "
              "pressure: a request finishes with its offload store in flight, and the next remote-prefill request "
              "is allocated its blocks; MultiConnector hands the offloading side num_external_tokens 0, where "
              "update_state_after_alloc returns before recording them, so the store is not flushed and the NIXL "
              "read overwrites what it copies (the CPU tier keeps KV under a hash it does not match). The early "
              "return ships in 0.21.0 to 0.32.0 (read; the job-based connector is driven from 0.30.0); 0.33.0 "
              "records every allocated block first, the change both open PRs propose"),
    HistoryBug(
        id="vllm-kv-fail-full-hit", engine="vllm",
        title="a remote KV load counted failed for a block another request already marked for recompute keeps "
              "its whole prompt computed, and the full-hit step back (recompute the last token) is skipped on the "
              "failed path: schedule() asserts num_new_tokens > 0 and EngineCore dies",
        sources=("vllm-project/vllm#26813", "vllm-project/vllm#34616"), buggy="0.30.0", fixed="0.31.0",
        clean_because="refactor", preset="vllm-kv-fail", finding="crash",
        signature="AssertionError@schedule@scheduler.py",
        reach="a decode instance with kv_load_failure_policy recompute and a KV connector that loads some blocks "
              "synchronously beside NIXL's async loads (MultiConnector with an OffloadingConnector): two requests "
              "waiting for remote KV share a prefix-cached block and an output reports it invalid; "
              "_update_requests_with_invalid_blocks marks it for the first, so the second is affected but keeps "
              "num_computed_tokens (its whole prompt); _update_waiting_for_remote_kv's failed branch does not step "
              "back one token as the success branch does, and the waiting loop's assert num_new_tokens > 0 kills "
              "EngineCore. The driver's memory_pressure reports the cached block as such a connector would (NIXL "
              "alone reports a failed read's own blocks only). Crashes on 0.24.0 to 0.30.0; 0.31.0 steps back on "
              "both branches (moved with its sliding-window replay change). No public issue or PR names it"),
)

UNREACHED: tuple[Unreached, ...] = (
    Unreached("vllm-44237", "vllm", ("vllm-project/vllm#44237",), "0.23.0 -> 0.24.0 (refactor)",
              "the PR was closed unmerged; the trigger (the single-block collision branch of the map's pop) "
              "is unclear"),
    Unreached("vllm-48245", "vllm", ("vllm-project/vllm#48245", "vllm-project/vllm#47900"), "0.26.0 -> 0.27.0",
              "an EngineCore assertion (num_output_placeholders underflow) when KV pressure preempts a request "
              "with an output in flight, fixed in 0.27.0. With one batch in flight (UniProcExecutor's "
              "max_concurrent_batches 2, what the target drives) the kept placeholders drain exactly when the "
              "stale frame returns (1 + drafts - rejected - accepted - 1 = 0) and the request cannot resume "
              "before it: it needs a second batch in flight (pipeline parallelism). vllm-spec-small on 0.26.0, "
              "random, 60 s, seed 11: 9,304 programs, 7,077 preemptions with drafts in flight, nothing"),
    Unreached("vllm-46066", "vllm", ("vllm-project/vllm#46066",), "0.24.0 -> 0.25.0",
              "reset_prefix_cache(reset_running_requests=True) with speculative decoding under async scheduling: "
              "a stale frame's rejections drive num_output_placeholders below 0, silently (the assertion is "
              "skipped while discards are pending), fixed in 0.25.0. No memory invariant breaks: on 0.24.0 "
              "(vllm-spec-async, flush_running, random, 2 x 60 s) only vllm-49860's hang shows, as on 0.25.0"),
    Unreached("vllm-49674", "vllm", ("vllm-project/vllm#49674", "vllm-project/vllm#49675"), "0.24.0 and later",
              "a progress defect (preemption cascades that free nothing while #45357's frees are deferred), not "
              "a broken memory invariant: kvaudit's oracles check memory and hangs, not throughput"),
)

# what a release's overlay installs beside it (--no-deps): vLLM 0.15/0.16 import mistral_common (and its
# tokenizer stack) from the structured-output manager the Scheduler takes; the base (0.33.0's closure) lacks these
PINS: dict[str, tuple[str, ...]] = {v: ("mistral_common==1.9.0", "pydantic-extra-types==2.11.1", "pycountry==26.2.16",
                                        "tiktoken==0.14.0", "diskcache==5.6.3") for v in ("0.15.1", "0.16.0")}
