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
    given) is a substring of its signature. ``reach``: how a real server gets there from client requests."""

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

    def matches(self, finding) -> bool:
        """Whether ``finding`` (:class:`kvaudit.audit.findings.Finding`) is this bug."""
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
        sources=("vllm-project/vllm#49684",), buggy="0.30.0", fixed=None, clean_because="refactor",
        preset="vllm-moe-experts", finding="leak", check="dead-table:_re_block_ids",
        reach="a mixture-of-experts model served with enable_return_routed_experts and async scheduling: each "
              "client abort of a request whose step is in flight leaves its entry for good (the server's "
              "memory grows with aborts). Fixed in 0.31.0 by a refactor (an aux-output connector behind "
              "Model Runner V2), which needs Triton: the fixed twin is not built on CPU, so fixed is None "
              "here and the program is not replayed there"),
)

SGLANG: tuple[HistoryBug, ...] = ()

BUGS: dict[str, HistoryBug] = {b.id: b for b in VLLM + SGLANG}

UNREACHED: tuple[Unreached, ...] = (
    Unreached("vllm-42571", "vllm", ("vllm-project/vllm#42571", "vllm-project/vllm#42615"), "all, to 0.33.0",
              "no fixing release (the fix PRs are open), and the target does not drive the simple CPU-offload "
              "connector with sliding-window attention"),
    Unreached("vllm-44237", "vllm", ("vllm-project/vllm#44237",), "0.23.0 -> 0.24.0 (refactor)",
              "the PR was closed unmerged; the trigger (the single-block collision branch of the map's pop) "
              "is unclear"),
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
