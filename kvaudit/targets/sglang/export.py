"""What ``kvaudit export`` needs of SGLang 0.5.23 (:data:`EXPORT`, the ``sglang`` kind's ``export``
field): the HTTP table, the server launch, the engine's part of a client script and of an issue
text, the curl lines. The routes and fields were read from SGLang 0.5.23's installed sources
(docs/internals/sglang.md, "Export")."""

from __future__ import annotations

import json
import shlex
from types import SimpleNamespace

from kvaudit.targets.export_api import (ApiCall, ClientParts, EngineApi, EngineExport, IssueParts, launch_line,
                                        planted_faults)
from kvaudit.targets.sglang.config import FAULTS

STRICT_IDLE_CHECK = "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE=1"  # the idle memory check raises, not warns
FAKE_BOOTSTRAP_HOST = "2.2.2.2"  # sglang/srt/disaggregation/utils.py's: a request with it skips the radix insert
# MODEL in the launch lines: any model whose vocabulary has the token ids 2..127 (every real one does)

API = EngineApi(
    engine="SGLang", version="0.5.23",
    sources=("sglang/srt/entrypoints/http_server.py", "sglang/srt/managers/io_struct.py",
             "sglang/srt/managers/tokenizer_manager.py", "sglang/srt/observability/metrics_collector.py"),
    calls={
        "submit": ApiCall("POST", "/generate",
                          "input_ids, rid, sampling_params (max_new_tokens, temperature 0, ignore_eos), "
                          "session_params (id, rid, offset, replace, drop_previous_output) for a session turn; "
                          "consecutive submits of one scheduler step with the same session_params: one "
                          "batched request (lists)", True,
                          "a submit that must still be running when a later message arrives gets a longer "
                          "output (--hold-tokens); a stop_at (EOS sampled at that length) becomes "
                          "max_new_tokens; an extends prefix resends the base prompt only (its output is the "
                          "model's)"),
        "health_check": ApiCall("GET", "/health_generate", "(none)", True),
        "abort": ApiCall("POST", "/abort_request", "rid (matched by prefix, as the scheduler does), or "
                                                   "abort_all", True),
        "flush_cache": ApiCall("POST", "/flush_cache", "query timeout (seconds; the program's steps)", True,
                               "a deferred flush waits seconds, not scheduler steps"),
        "open_session": ApiCall("POST", "/open_session", "capacity_of_str_len, session_id, streaming, "
                                                         "timeout", True),
        "close_session": ApiCall("POST", "/close_session", "session_id", True),
        "memory_pressure": ApiCall(None, None, "(no API)", False,
                                   "a client cannot shrink free memory: launch the server with "
                                   "SGLANG_TEST_RETRACT=1 (decode retracts every "
                                   "SGLANG_TEST_RETRACT_INTERVAL steps), and/or a small --max-total-tokens"),
        "pause_generation": ApiCall("POST", "/pause_generation", "mode (abort | in_place | retract)", True),
        "continue_generation": ApiCall("POST", "/continue_generation", "(none)", True),
        "transfer_fail": ApiCall(None, None, "(no API)", False,
                                 "a failed KV transfer needs the prefill server or the wire to fail: stop the "
                                 "prefill server while the request is transferring"),
        "step": ApiCall(None, None, "(wait)", False,
                        "a client cannot run the scheduler n iterations: it waits --step-delay seconds a "
                        "step"),
        "idle": ApiCall("GET", "/metrics", "(wait for every request, then poll)", True,
                        "waits until every request answered and no request runs or queues"),
    },
    metrics=("sglang:kv_available_tokens", "sglang:kv_evictable_tokens", "sglang:kv_used_tokens",
             "sglang:num_used_tokens", "sglang:num_running_reqs", "sglang:num_queue_reqs",
             "sglang:num_streaming_sessions", "sglang:streaming_session_held_tokens",
             "sglang:num_decode_prealloc_queue_reqs", "sglang:num_retracted_reqs"),
    metrics_flag="--enable-metrics",
)

def flag_line(config) -> tuple[list[str], list[str], list[str]]:
    """The SGLang 0.5.23 launch for a replay ``config`` (an :class:`kvaudit.targets.sglang.config.SglangConfig`):
    ``(flags, env, unmapped)`` -- server flags (``--max-total-tokens`` for ``num_slots``, ...; always
    ``--enable-metrics``), environment variables, and config fields no flag sets (said in the report).
    Flag names from ``sglang/srt/arg_groups/fields/*.py``."""
    c = config
    flags = ["--enable-metrics", f"--max-total-tokens {c.num_slots}", f"--page-size {c.page_size}",
             f"--max-running-requests {c.max_running_requests}", f"--context-length {c.context_len}"]
    env: list[str] = []
    unmapped = [f"max_req_rows={c.max_req_rows} (the request-row pool; SGLang sizes it from "
                f"--max-running-requests)",
                f"new_token_ratio={c.new_token_ratio} (admission's decode reserve; SGLang adapts it at run time)",
                f"tree_core={c.tree_core} (the radix tree core; rust is SGLang's default)"]
    if c.enable_streaming_session:
        flags.append("--enable-streaming-session")
    if not c.enable_overlap:
        flags.append("--disable-overlap-schedule")
    flags.append("--chunked-prefill-size -1" if c.chunked_prefill_size is None
                 else f"--chunked-prefill-size {c.chunked_prefill_size}")
    if c.enable_mixed_chunk:
        flags.append("--enable-mixed-chunk")
    if c.disaggregation_mode == "decode":
        flags += ["--disaggregation-mode decode", f"--num-reserved-decode-tokens {c.num_reserved_decode_tokens}"]
        flags += ["--disaggregation-decode-enable-radix-cache"] if c.decode_radix_cache else []
    if c.disaggregation_mode == "prefill":
        flags.append("--disaggregation-mode prefill")
    if c.enable_hisparse:
        unmapped.append(f"num_slots={c.num_slots} is HiSparse's physical device pool here (the logical pool is "
                        f"{c.hisparse_host_to_device_ratio}x); which of the two --max-total-tokens sizes under "
                        "HiSparse was not checked")
        flags += ["--enable-hisparse", "--disable-radix-cache",
                  "--hisparse-config '{\"device_buffer_size\": %d, \"host_to_device_ratio\": %d}'"
                  % (c.hisparse_device_buffer_size, c.hisparse_host_to_device_ratio)]
    if c.sliding_window_size is not None:  # SWA hybrid: the window is the model's, not a flag
        flags.append(f"--swa-full-tokens-ratio {c.swa_full_tokens_ratio:g}")
        flags += ["--disable-radix-cache"] if c.swa_chunk_cache else []
        env.append(f"SGLANG_SWA_EVICTION_INTERVAL={c.swa_eviction_interval}")
        unmapped.append(f"sliding_window_size={c.sliding_window_size} (the model's sliding window: use a hybrid-SWA "
                        "model, whose window is far larger; scale the prompts to it)")
    if c.enable_hierarchical_cache:
        flags += ["--enable-hierarchical-cache", f"--hicache-ratio {c.hicache_ratio:g}",
                  f"--hicache-write-policy {c.hicache_write_policy}"]
    if c.enable_priority_scheduling:
        flags.append("--enable-priority-scheduling")
        if c.schedule_low_priority_values_first:
            flags.append("--schedule-low-priority-values-first")
    if c.max_queued_requests is not None:
        flags.append(f"--max-queued-requests {c.max_queued_requests}")
    if c.optimistic_prefill_attempts:
        flags.append(f"--optimistic-prefill-attempts {c.optimistic_prefill_attempts}")
    if c.speculative_algorithm is not None:  # spec v2, SGLang 0.5.23's only speculative path
        algo = c.speculative_algorithm.upper()
        flags += [f"--speculative-algorithm {algo}", f"--speculative-num-draft-tokens {c.speculative_num_draft_tokens}"]
        if algo == "NGRAM":  # SGLang takes n-gram's topk from the BFS breadth (10 by default) and derives its steps
            flags.append(f"--speculative-ngram-max-bfs-breadth {c.speculative_eagle_topk}")
        else:
            flags += ["--speculative-draft-model-path DRAFT_MODEL", f"--speculative-num-steps {c.speculative_num_steps}",
                      f"--speculative-eagle-topk {c.speculative_eagle_topk}"]
    more, pd = _policy_flags(c), _pd_flags(c)
    return flags + more[0] + pd[0], env + more[1] + pd[1], unmapped + more[2] + pd[2]


def _pd_flags(c) -> tuple[list[str], list[str], list[str]]:
    # flag_line's part for PD disaggregation's timeouts (environment variables, sglang/srt/environ.py; seconds:
    # kvaudit's PD clock advances one second a step) and the stand-ins kvaudit plays where a server has a
    # prefill or decode peer, a wire, or CUDA copies, whose timing no flag sets
    flags: list[str] = []
    env: list[str] = []
    unmapped: list[str] = []
    if c.need_sort != (c.disaggregation_mode in ("decode", "prefill")):  # (kv_cache_configurator.py derives it)
        unmapped.append(f"need_sort={str(c.need_sort).lower()} (the allocator's sorted frees; SGLang sorts them in a "
                        "PD server only)")
    if c.disaggregation_mode == "decode":
        # the driver verifies every landed transfer's KV checksum (pd.py's server args), as a server launched with
        # this flag does (sglang/srt/arg_groups/fields/disagg.py: on both servers)
        flags.append("--disaggregation-enable-kv-checksum")
        env.append(f"SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE={int(c.deferred_kv_release)}")
        if c.deferred_kv_release:
            env.append(f"SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT={c.deferred_release_timeout_steps}")
        acked = "never, so only the deferred-release deadline frees it" if c.abort_ack_steps is None else \
            f"{c.abort_ack_steps} steps later"
        unmapped.append(f"transfer_latency_steps={c.transfer_latency_steps}, abort_ack_steps={c.abort_ack_steps} "
                        "(kvaudit plays the prefill server and the wire: a transfer lands that many steps after its "
                        f"metadata is sent, and prefill acknowledges an aborted transfer's drain {acked}; on a server "
                        "both are the prefill server's and the network's)")
        if c.kv_checksum_mismatch_every is not None:
            env.append(f"SGLANG_TEST_DISAGG_KV_CHECKSUM_MISMATCH_PROB={1 / c.kv_checksum_mismatch_every:g}")
            unmapped.append(f"kv_checksum_mismatch_every={c.kv_checksum_mismatch_every} (kvaudit's wire corrupts "
                            "every Nth landed transfer; SGLang's test-only injector flips a request's digest with "
                            "probability 1/N instead; launch the prefill server with --disaggregation-enable-kv-checksum "
                            "too)")
    if c.disaggregation_mode == "prefill":
        env += [f"SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT={c.bootstrap_timeout_steps}",
                f"SGLANG_DISAGGREGATION_WAITING_TIMEOUT={c.waiting_timeout_steps}"]
        lost = "" if c.bootstrap_lost_every is None else \
            f", every {c.bootstrap_lost_every}th request's never (bootstrap_lost_every)"
        reads = "; a chunk already on the wire is read to its end after its transfer failed " \
            "(prefill_reads_after_failure)" if c.prefill_reads_after_failure else ""
        unmapped.append(f"bootstrap_steps={c.bootstrap_steps}, transfer_latency_steps={c.transfer_latency_steps} "
                        f"(kvaudit plays the decode server and the wire: a request's decode side bootstraps that many "
                        f"steps after it arrives{lost}, and a transfer lands transfer_latency_steps after it is "
                        f"sent{reads}; on a server these are the decode server's and the network's)")
    if c.fake_bootstrap_every is not None:  # (io_struct.py's GenerateReqInput.bootstrap_host; disaggregation/utils.py)
        unmapped.append(f"fake_bootstrap_every={c.fake_bootstrap_every} (every Nth request, r<n> with n % N == N - 1, "
                        f"not a session turn, carries bootstrap_host {FAKE_BOOTSTRAP_HOST}, SGLang's "
                        "FAKE_BOOTSTRAP_HOST: a client's field, which the script and the curl lines send)")
    if c.enable_hisparse and c.hisparse_staging_steps:
        unmapped.append(f"hisparse_staging_steps={c.hisparse_staging_steps} (kvaudit's staging copy stays in flight "
                        "that many steps; on a server it takes what the CUDA copy takes)")
    if c.enable_hierarchical_cache:
        unmapped.append(f"hicache_ack_steps={c.hicache_ack_steps} (kvaudit's host-tier copies are acknowledged that "
                        "many steps after submission; on a server they take what the copy takes)")
    return flags, env, unmapped


def _policy_flags(c) -> tuple[list[str], list[str], list[str]]:
    # flag_line's part for the tree's eviction policy, HiCache's L3 tier, Mamba and the scheduler's timeouts
    flags: list[str] = []
    env: list[str] = []
    unmapped: list[str] = []
    if c.radix_eviction_policy != "lru":
        flags.append(f"--radix-eviction-policy {c.radix_eviction_policy}")
    if c.radix_eviction_policy_config is not None:
        flags.append(f"--radix-eviction-policy-config {shlex.quote(c.radix_eviction_policy_config)}")
    if c.enable_priority_scheduling and c.priority_scheduling_preemption_threshold != 10:  # (SGLang's default)
        flags.append(f"--priority-scheduling-preemption-threshold {c.priority_scheduling_preemption_threshold}")
    for var, steps in (("SGLANG_REQ_WAITING_TIMEOUT", c.request_waiting_timeout_steps),
                       ("SGLANG_REQ_RUNNING_TIMEOUT", c.request_running_timeout_steps)):
        if steps is not None:  # seconds: kvaudit's clock advances one second a step
            env.append(f"{var}={steps}")
    if c.strict_mem_check_during_busy:  # (sglang/srt/environ.py; the busy check SGLang 0.5.10-0.5.11 ran only so)
        env.append("SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY=1")
    if c.enable_hierarchical_cache and c.hicache_storage_backend is not None:
        extra = {"prefetch_threshold": c.hicache_storage_prefetch_threshold,  # as hicache_l3.py configures it
                 "prefetch_timeout_base": c.hicache_storage_prefetch_timeout_steps, "prefetch_timeout_per_ki_token": 0}
        flags += [f"--hicache-storage-backend {c.hicache_storage_backend}",
                  f"--hicache-storage-prefetch-policy {c.hicache_storage_prefetch_policy}",
                  f"--hicache-storage-backend-extra-config {shlex.quote(json.dumps(extra))}"]
        unmapped.append(f"hicache_storage_ack_steps={c.hicache_storage_ack_steps} (kvaudit's stand-in of the storage "
                        "threads runs each storage operation that many steps after it is queued)")
        if c.hicache_storage_fail_every is not None:
            unmapped.append(f"hicache_storage_fail_every={c.hicache_storage_fail_every} (kvaudit's backend fails every "
                            "Nth storage read or write whole: a server needs a storage backend that fails)")
    if c.enable_mamba:  # the strategy kvaudit drives: SGLang's auto picks by overlap, paging and the backend
        flags += [f"--max-mamba-cache-size {c.max_mamba_cache_size}", "--mamba-radix-cache-strategy "
                  + ("extra_buffer" if c.mamba_extra_buffer else "no_buffer")]
        unmapped.append(f"mamba_chunk_size={c.mamba_chunk_size} (the model's: use a hybrid SSM model, e.g. a Mamba "
                        "or GDN hybrid, whose chunk size is far larger; scale the prompts to it)")
    return flags, env, unmapped


# -- the client script's part --------------------------------------------------------------------------

SGLANG_API = r'''
    # -- the server's API (SGLang 0.5.23) --------------------------------------------------------------
    def open_session(self, name, streaming, timeout=None, label=""):
        body = {"capacity_of_str_len": 1000, "session_id": self.tag + name, "streaming": streaming}
        if timeout is not None:
            body["timeout"] = timeout * self.step_delay  # the program's steps, as seconds
        self.send(label or "open_session " + name, "POST", "/open_session", body)

    def close_session(self, name, label=""):
        self.send(label or "close_session " + name, "POST", "/close_session", {"session_id": self.tag + name})

    def generate(self, items, session_params=None, label=""):
        """items: (rid, input_ids, max_new_tokens, hold); one item is a plain request, several a batch
        (lists), all sharing ``session_params``; a request fake_bootstrap() names (not a session turn) carries
        bootstrap_host."""
        # SGLang refuses (400) input + max_new_tokens past --context-length: a hold is capped to fit it
        params = [{"max_new_tokens": max(m, min(m + (self.hold_tokens if hold else 0), MAX_MODEL_LEN - len(x))),
                   "temperature": 0.0, "ignore_eos": True} for _, x, m, hold in items]
        rids = [self.tag + rid for rid, _, _, _ in items]
        ids = [list(x) for _, x, _, _ in items]
        body = {"input_ids": ids[0], "rid": rids[0], "sampling_params": params[0]} if len(items) == 1 else \
            {"input_ids": ids, "rid": rids, "sampling_params": params}
        if session_params is not None:
            sp = dict(session_params, id=self.tag + session_params["id"])
            if "rid" in sp:
                sp["rid"] = self.tag + sp["rid"]
            body["session_params"] = sp
        hosts = [FAKE_BOOTSTRAP_HOST if session_params is None and fake_bootstrap(rid) else None
                 for rid, _, _, _ in items]
        if any(hosts):
            body["bootstrap_host"] = hosts[0] if len(items) == 1 else hosts
        self.send(label or "generate " + ",".join(r for r, _, _, _ in items), "POST", "/generate", body,
                  background=True)

    def abort(self, rid, label=""):
        body = {"abort_all": True} if rid is None else {"rid": self.tag + rid}
        self.send(label or "abort", "POST", "/abort_request", body)

    def flush_cache(self, timeout=0, label=""):
        return self.send(label or "flush_cache", "POST", "/flush_cache?timeout=%g" % (timeout * self.step_delay))

    def health(self, label=""):
        self.send(label or "health_generate", "GET", "/health_generate", background=True)

    def pause(self, mode, label=""):
        self.send(label or "pause_generation", "POST", "/pause_generation", {"mode": mode})

    def resume(self, label=""):
        self.send(label or "continue_generation", "POST", "/continue_generation", {})

    def at_rest(self):
        """SGLang refreshes its idle /metrics at most every 30 s: poll until no KV is in use."""
        return self.settle()
'''

SGLANG_FUNCS = r'''

def engine_args(ap):
    ap.add_argument("--metrics-url", default=None,
                    help="where to read /metrics (default: --url; behind a PD router: the decode server)")


def fake_bootstrap(rid):
    """Whether the program's request rid (r<n>) carried SGLang's FAKE_BOOTSTRAP_HOST where kvaudit found this:
    every FAKE_BOOTSTRAP_EVERY-th, n % N == N - 1 (its config's fake_bootstrap_every; None: none)."""
    n = FAKE_BOOTSTRAP_EVERY
    return n is not None and rid[:1] == "r" and rid[1:].isdigit() and int(rid[1:]) % n == n - 1


def server_line(c):
    status, text = c.request("GET", "/server_info")
    if status == 200:
        try:
            info = json.loads(text)
            print("server: version=%s %s" % (info.get("version"), " ".join(
                "%s=%s" % (k, info.get(k)) for k in SERVER_KEYS if k in info)))
        except ValueError:
            pass


def pool_findings(before, after, flushed):
    """What the gauges say once every session is closed and the cache flushed, with nothing running."""
    seen = []
    if before is not None and after is not None:
        lost = before.get("sglang:kv_available_tokens", 0) - after.get("sglang:kv_available_tokens", 0)
        if lost > 0:
            seen.append("kv_available_tokens is %g below its value before the program" % lost)
        if after.get("sglang:kv_used_tokens", 0) > 0:
            seen.append("kv_used_tokens=%g with no request and no session" % after["sglang:kv_used_tokens"])
    if flushed is not None and flushed[0] != 200:
        seen.append("flush_cache refused with nothing running: %s" % flushed[1].strip()[:120])
    return seen
'''

def _model(config) -> str:
    # the model the launch needs (IssueParts.model): HiSparse's DSA model, a hybrid-SWA or hybrid SSM model, else any
    if config.enable_hisparse:
        return "a DSA model, as said above"
    if config.sliding_window_size is not None:
        return "a hybrid-SWA model, as said above"
    if config.enable_mamba:
        return "a hybrid SSM model, as said above"
    return "any model"


def launch_env(config, program, finding_kind: str, env: list[str]) -> list[str]:
    """``env`` with ``SGLANG_TEST_RETRACT=1`` first when the program applies memory pressure (decode then
    retracts periodically), and :data:`STRICT_IDLE_CHECK` last unless the finding is a crash or a hang or
    HiSparse is on (its idle check is off under HiSparse)."""
    if any(op.kind == "memory_pressure" for op in program):
        env = ["SGLANG_TEST_RETRACT=1"] + env
    if finding_kind not in ("crash", "hang") and not config.enable_hisparse:
        env = env + [STRICT_IDLE_CHECK]
    return env


def _launch_notes(config, env: list[str]) -> list[str]:
    out = []
    if any(e.startswith("SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE=") for e in env):
        out.append("- `SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE=1` makes SGLang's own idle memory check raise "
                   "instead of log: a leak it sees then stops the server (without it, look for \"memory leak "
                   "detected\" in the server log).")
    if any(e.startswith("SGLANG_TEST_RETRACT=") for e in env):
        out.append("- `SGLANG_TEST_RETRACT=1` makes decode retract periodically: the program's memory pressure, "
                   "which a client cannot create.")
    return out


def _server_notes(config) -> list[str]:
    out = []
    if config.enable_hisparse:
        out.append("- HiSparse runs on DSA (DeepSeek Sparse Attention) models only: use one for `--model-path`.")
    if config.disaggregation_mode == "decode":
        out.append("- This is a PD decode server: it needs a prefill server and a router in front "
                   "(`--disaggregation-mode prefill` on the other side); send the client's requests to the router (`--url`) and read the decode server's counters "
                   "(`--metrics-url`).")
    if config.disaggregation_mode == "prefill":
        out.append("- This is a PD prefill server: it needs a decode server and a router in front "
                   "(`--disaggregation-mode decode` on the other side); send the client's requests to the router "
                   "(`--url`) and read the prefill server's counters (`--metrics-url`).")
    return out


# the finding pools (``Finding.pool``) the client script's gauges (kv_available_tokens, kv_used_tokens) do
# not count -> the pool in words, and what a maintainer can do instead; token_to_kv_pool is counted
UNSEEN_POOLS = {
    "hisparse_device_pool": "HiSparse's device buffer slots (hisparse_device_pool), which SGLang's /metrics does "
                            "not report and whose memory check is off under HiSparse: count the coordinator's free "
                            "device slots in the server process before and after the program, or run "
                            "`kvaudit replay` on the replay file, which does",
    "hisparse_host_pool": "HiSparse's host pool (hisparse_host_pool), which SGLang's /metrics does not report: count "
                          "its free slots in the server process before and after the program, or run `kvaudit "
                          "replay` on the replay file, which does",
    "req_to_token_pool": "the request rows (req_to_token_pool), which SGLang's /metrics does not report: compare "
                         "the scheduler's free rows in the server process before and after the program, or run "
                         "`kvaudit replay` on the replay file",
    "swa_token_to_kv_pool": "the sliding-window pool (swa_token_to_kv_pool), which /metrics reports as "
                            "sglang:swa_available_tokens / swa_used_tokens but this script does not compare: read "
                            "them from /metrics before and after by hand",
    "mamba_pool": "the Mamba state pool (mamba_pool), which /metrics reports as sglang:mamba_available_tokens / "
                  "mamba_used_tokens but this script does not compare: read them from /metrics before and after "
                  "by hand",
    "hicache_host_pool": "the hierarchical cache's host pool (hicache_host_pool), which /metrics reports as "
                         "sglang:hicache_host_used_tokens but this script does not compare: read it from /metrics "
                         "before and after by hand",
}


def unseen_pool(pool: str) -> str | None:
    """:attr:`EngineExport.unseen_pool` for SGLang: None for the token pool the script compares."""
    if pool == "token_to_kv_pool":
        return None
    return UNSEEN_POOLS.get(pool, f"{pool}, which this script's /metrics gauges do not count: run `kvaudit replay` "
                                  "on the replay file")


def curl_lines(plan, url: str) -> list[str]:
    """The calls of ``plan`` (a :class:`kvaudit.export.plan.Plan` that a client runs one call at a time)
    as ``curl`` commands against ``url``."""
    def post(route: str, body: dict) -> str:
        return f"curl -s {url}/{route} -H 'Content-Type: application/json' -d '{json.dumps(body)}'"

    out = []
    for c in plan.calls:
        a = c.args
        if c.kind == "open_session":
            body = {"capacity_of_str_len": 1000, "session_id": a["session"], "streaming": a["streaming"]}
            if a["timeout"] is not None:  # (seconds: the program's steps, as the flush_cache line counts them)
                body["timeout"] = a["timeout"]
            out.append(post("open_session", body))
        elif c.kind == "generate":
            items = a["items"]
            params = [{"max_new_tokens": i.max_new_tokens, "temperature": 0.0, "ignore_eos": True} for i in items]
            body = {"input_ids": [i.input_ids for i in items], "rid": [i.rid for i in items],
                    "sampling_params": params} if len(items) > 1 else \
                {"input_ids": items[0].input_ids, "rid": items[0].rid, "sampling_params": params[0]}
            if a["session_params"] is not None:
                body["session_params"] = a["session_params"]
            hosts = [_fake_host(plan.config, i.rid) if a["session_params"] is None else None for i in items]
            if any(hosts):
                body["bootstrap_host"] = hosts if len(items) > 1 else hosts[0]
            out.append(post("generate", body))
        elif c.kind == "close_session":
            out.append(post("close_session", {"session_id": a["session"]}))
        elif c.kind == "abort":
            out.append(post("abort_request", {"abort_all": True} if a["rid"] is None else {"rid": a["rid"]}))
        elif c.kind == "flush_cache":
            out.append(f"curl -s -X POST '{url}/flush_cache?timeout={a['timeout']}'")
        elif c.kind == "pause":
            out.append(post("pause_generation", {"mode": a["mode"]}))
        elif c.kind == "continue":
            out.append(post("continue_generation", {}))
        elif c.kind in ("wait", "idle"):
            out.append(f"curl -s {url}/health   # then: is the server still up?")
    return out


def _fake_host(config, rid: str) -> str | None:
    """SGLang's ``FAKE_BOOTSTRAP_HOST`` (``disaggregation/utils.py``) for a request (not a session turn) the driver
    sent with it (``fake_bootstrap_every``: ``SglangIntake.fake_bootstrap``), else None."""
    if config is None or config.fake_bootstrap_every is None:
        return None
    from kvaudit.targets.sglang.intake import SglangIntake  # (its rule, on the config alone)
    return FAKE_BOOTSTRAP_HOST if SglangIntake.fake_bootstrap(SimpleNamespace(config=config), rid) else None


def _client_consts(config) -> tuple[str, ...]:
    # the script's constants for fake_bootstrap(): the same rule as the driver's (SglangIntake.fake_bootstrap)
    return (f"FAKE_BOOTSTRAP_EVERY = {config.fake_bootstrap_every!r}  # fake_bootstrap_every: every Nth request "
            "carries bootstrap_host", f"FAKE_BOOTSTRAP_HOST = {FAKE_BOOTSTRAP_HOST!r}  # SGLang's, "
            "disaggregation/utils.py: Req skips the radix insert")


def trace_views(target):
    """``(live, answered, sessions)`` of a built SGLang-style target (its intake's ``live_rids()`` and
    ``sessions``; no request stays answered with blocks held), or None when it has no intake."""
    if not all(hasattr(target, a) for a in ("live_rids", "sessions", "submitted")):
        return None
    return (lambda: tuple(target.live_rids())), (lambda: ()), (lambda: tuple(target.sessions))


EXPORT = EngineExport(
    api=API, package="sglang",
    client=ClientParts(
        api=SGLANG_API, funcs=SGLANG_FUNCS, url="http://127.0.0.1:30000", settle=35.0,
        busy=("sglang:num_running_reqs", "sglang:num_queue_reqs"), settle_gauge="sglang:kv_used_tokens",
        settle_why="SGLang refreshes its idle /metrics at most every 30 s (35 s: that and a margin)",
        metrics_hint="launch the server with --enable-metrics",
        server_keys="SERVER_KEYS = ['enable_streaming_session', 'page_size', 'max_total_tokens', "
                    "'disable_overlap_schedule', 'chunked_prefill_size', 'enable_hisparse', "
                    "'disaggregation_mode']"),
    issue=IssueParts(
        environment=lambda c: f"page size {c.page_size}, {c.num_slots}-token KV pool.",
        exact="The client reproduces the program exactly: every op maps to one HTTP call and nothing depends on "
              "timing; submits of one scheduler step go in one batched `/generate` (SGLang queues a batch's items "
              "in one scheduler iteration).",
        approximates=" or force memory pressure", driver="scheduler",
        seen_how="(allocators, radix cache, sessions, batch preparation) on CPU, through its driver, "
                 "which plays the scheduler loop in SGLang's call order with a stand-in model",
        launch_notes=_launch_notes, server_notes=_server_notes,
        model=_model),
    launch=launch_line("python -m sglang.launch_server --model-path MODEL", flag_line), launch_env=launch_env,
    expected_pool="the pool does not come back (after closing every session and flushing, kv_available_tokens "
                  "is below its value before the program, or kv_used_tokens > 0), or the server fails",
    batch_submits=True, deferred_flush=True, curl=curl_lines, trace_views=trace_views, planted=planted_faults(FAULTS),
    unseen_pool=unseen_pool, client_sizes=lambda c: (None, c.context_len), client_consts=_client_consts,
)
