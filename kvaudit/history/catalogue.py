"""The history suite's catalogue: known public KV-lifecycle bugs of SGLang and vLLM, each with the last
release that ships it and the first that does not, and what kvaudit needs to find it there
(``kvaudit bench --suite history``; the method is :mod:`kvaudit.history.suite`).

Facts (which release ships which bug, what changed in the fixing release) are from the releases' own
code and the public trackers, collected in ``../shared/reference/history-facts.md``; each entry says
whether the fixing release is clean because of the fix or because the path was refactored away.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class HistoryBug:
    """One known bug. ``buggy``: the last release with the bug (the suite searches there); ``fixed``: the
    first release without it (the minimized program must replay clean there), None for a bug still in
    the newest release (a rediscovery: searched, never replayed elsewhere). ``clean_because``: "fix" (the
    fixing PR is in ``fixed``) or "refactor" (the path is gone). ``preset`` and ``config``: the target's
    preset and its overrides. A finding is this bug when its kind is ``finding``, its ``check`` (a
    target invariant, signature suffix ``check:<name>``) matches when given, and ``signature`` (when
    given) is a substring of its signature (a rediscovery, with ``replay_file``: equal to it).
    ``replay_blocked``: why the fixing release cannot run the program on this kind of machine (the bug
    then counts as found, not rediscovered). ``reach``: how a real server gets there from client requests."""

    id: str
    engine: str
    title: str
    sources: tuple[str, ...]
    buggy: str
    fixed: str | None
    clean_because: str
    preset: str
    finding: str
    config: dict = field(default_factory=dict)
    check: str = ""
    signature: str = ""
    reach: str = ""

    replay_file: str = ""  # a rediscovery's config is its corpus file's (relative to the data root)
    replay_blocked: str = ""  # why the fixing release cannot run the program here (then it is not replayed)

    def target_config(self):
        """The target config the suite searches (``ValueError`` for a bad override)."""
        if self.replay_file:
            from kvaudit import replay
            from kvaudit.data import data_path
            return replay.load(data_path(self.replay_file))[0]
        from kvaudit.targets import registry
        return registry.get(self.engine).preset(self.preset).config(**self.config)

    def matches(self, finding) -> bool:
        """Whether ``finding`` (:class:`kvaudit.audit.findings.Finding`) is this bug."""
        if self.replay_file:  # a rediscovery: exactly the recorded signature
            return finding.signature == self.signature
        return (finding.kind == self.finding and (not self.check or getattr(finding, "check", "") == self.check)
                and self.signature in finding.signature)


@dataclass(frozen=True)
class Unreached:
    """A known bug the suite does not rediscover, and why (path not driven, needs a GPU, ...)."""

    id: str
    engine: str
    sources: tuple[str, ...]
    releases: str
    reason: str


VLLM: tuple[HistoryBug, ...] = (
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
)

SGLANG: tuple[HistoryBug, ...] = (
    # the three run on kvaudit's legacy driver family (kvaudit/targets/sglang/legacy.py); its Python
    # RadixCache is the era's only tree, so the tree_core override only keeps the reports honest
    HistoryBug(
        id="sglang-22273", engine="sglang",
        title="a streaming-session turn aborted before it runs is still treated as a session turn: it borrows the "
              "slot, overwrites its row and saves a 1-token KV back (the history is lost, session_held goes "
              "negative), or, queued beside the session's first turn, becomes the slot that turn then overwrites",
        sources=("sgl-project/sglang#22273",), buggy="0.5.10.post1", fixed="0.5.11", clean_because="fix",
        preset="sglang-session", config={"tree_core": "python"}, finding="leak",
        signature="/from:session",
        reach="a streaming session whose next turn is rejected at intake (its history no longer fits the context, "
              "or it asks for replace / offset / drop_previous_output): set_finish_with_abort leaves it queued "
              "with to_finish, match_prefix restores the slot into it, alloc_for_extend overwrites the row and "
              "cache_finished_req saves kv_committed_len=1 into the slot; the history's KV is unreachable"),
    HistoryBug(
        id="sglang-21875", engine="sglang",
        title="closing a streaming session while its turn decodes releases the slot's row and KV under the running "
              "turn (use-after-free), which then fails at finish on the slot's virtual node",
        sources=("sgl-project/sglang#21875",), buggy="0.5.10.post1", fixed="0.5.11", clean_because="fix",
        preset="sglang-session", config={"tree_core": "python"}, finding="use-after-free",
        signature="use-after-free/req_to_token_pool/request-kv/_close@session_controller.py",
        reach="a client closes a streaming session (/close_session) while that session's latest turn is still "
              "decoding: SessionController._close detaches the turn and release_session frees the row and KV "
              "the turn was restored into; the next decode writes into freed slots"),
    HistoryBug(
        id="sglang-22213", engine="sglang",
        title="the busy memory check counts a streaming session's borrowed KV twice (session_held and the running "
              "turn's uncached): a false 'Mem Leak Detected' while memory is intact",
        sources=("sgl-project/sglang#22213", "sgl-project/sglang#22753"), buggy="0.5.10.post1", fixed="0.5.11",
        clean_because="fix", preset="sglang-session", config={"tree_core": "python", "strict_mem_check_during_busy": True},
        finding="accounting-drift",
        signature="accounting-drift/token_to_kv_pool/engine_check",
        reach="a server run with SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY (the streaming-session CI does): any "
              "second turn of a streaming session that decodes while its slot lends it the KV; the assertion "
              "in self_check_during_busy stops the scheduler"),
)

BUGS: dict[str, HistoryBug] = {b.id: b for b in VLLM + SGLANG}


def rediscoveries() -> tuple[HistoryBug, ...]:
    """The findings kvaudit made in SGLang 0.5.23 (``corpora/sglang/*.json``) as bugs to rediscover from
    scratch: the file's config, its first finding's exact signature; no fixing release."""
    import json
    import os

    from kvaudit.data import data_path

    root = data_path("corpora/sglang")
    out = []
    for name in sorted(os.listdir(root)):
        if not name.endswith(".json"):
            continue
        with open(os.path.join(root, name)) as f:
            doc = json.load(f)
        first = doc["findings"][0]
        out.append(HistoryBug(
            id=f"sglang-0.5.23/{name[:-5]}", engine="sglang", title=f"kvaudit's own finding ({name})",
            sources=(f"corpora/sglang/{name}",), buggy="0.5.23", fixed=None, clean_because="",
            preset=doc["config"].get("preset", ""), finding=first["kind"], signature=first["signature"],
            replay_file=f"corpora/sglang/{name}"))
    return tuple(out)


def all_bugs() -> dict[str, HistoryBug]:
    """The catalogue's bugs and the SGLang 0.5.23 rediscoveries, by id."""
    return {**BUGS, **{b.id: b for b in rediscoveries()}}

UNREACHED: tuple[Unreached, ...] = (
    Unreached("vllm-44237", "vllm", ("vllm-project/vllm#44237",), "0.23.0 -> 0.24.0 (refactor)",
              "the PR was closed unmerged; the trigger (the single-block collision branch of the map's pop) "
              "is unclear"),
    Unreached("vllm-48245", "vllm", ("vllm-project/vllm#48245", "vllm-project/vllm#47900"), "fixed 2026-07-10",
              "an EngineCore assertion (num_output_placeholders underflow) when KV pressure preempts a request "
              "with an output in flight; it shows with speculative decoding or pipeline parallelism, which the "
              "target does not drive (15 s of random programs per seed, 3 seeds, async scheduling on the small "
              "pool: nothing on 0.25.0)"),
    Unreached("vllm-46066", "vllm", ("vllm-project/vllm#46066",), "fixed 2026-06-18",
              "reset_prefix_cache(reset_running_requests=True) with speculative decoding: the target drives "
              "neither"),
    Unreached("vllm-49674", "vllm", ("vllm-project/vllm#49674", "vllm-project/vllm#49675"), "0.24.0 and later",
              "a progress defect (preemption cascades that free nothing while #45357's frees are deferred), not "
              "a broken memory invariant: kvaudit's oracles check memory and hangs, not throughput"),
    Unreached("sglang-28374", "sglang", ("sgl-project/sglang#28374",), "all, to 0.5.23",
              "the PR was closed unmerged: no fixing release"),
    Unreached("sglang-10871", "sglang", ("sgl-project/sglang#10871",), "0.5.2-0.5.5",
              "the PR was closed 'DO NOT MERGE' and the path was refactored away in 0.5.5.post3: no "
              "confirmed bug/fix pair"),
    Unreached("sglang-9817", "sglang", ("sgl-project/sglang#9817",), "0.5.1 -> 0.5.2",
              "SGLang 0.5.1's API needs a third driver family (no release_kv_cache, no sessions)"),
    Unreached("sglang-9874", "sglang", ("sgl-project/sglang#9874",), "0.5.1 -> 0.5.2",
              "0.5.1's HiCache controller creates torch.cuda.Stream() at construction: needs a GPU or CUDA "
              "shims, and the 0.5.1 driver family"),
)
