"""The one table of how each program op reaches a real server over HTTP, per engine.

``HTTP_API[engine]`` is an :class:`EngineApi`: the release the calls were checked against, the
engine's files they were read from, and per op kind an :class:`ApiCall` -- the HTTP method and path,
the JSON body's fields, and whether a client reproduces the op exactly (``exact``) or only
approximately (``note`` says how). The client script generator (:mod:`kvaudit.export.client`) and
the issue report (:mod:`kvaudit.export.issue`) read nothing else about the engine's API.

SGLang 0.5.23, read from its installed sources (facts only): ``srt/entrypoints/http_server.py``
(routes), ``srt/managers/io_struct.py`` (``GenerateReqInput``: ``input_ids`` one list or a list of
lists, ``rid`` and ``sampling_params`` a value or a list, one ``session_params`` dict applied to
every item of a batch; ``OpenSessionReqInput``: ``capacity_of_str_len``, ``session_id``,
``streaming``, ``timeout``; ``CloseSessionReqInput.session_id``; ``AbortReq``: ``rid``,
``abort_all``; ``PauseGenerationReqInput.mode``), ``srt/managers/tokenizer_manager.py``
(``_handle_batch_request``: a batch of pre-tokenized inputs is sent to the scheduler as one message,
``_send_batch_request``, so its items are queued in the same scheduler iteration) and
``srt/observability/metrics_collector.py`` (the ``/metrics`` gauges, with ``--enable-metrics``).

vLLM 0.33.0, read from its installed sources (facts only): ``entrypoints/openai/api_server.py`` and
``entrypoints/launchers/api_server/routers.py`` (which routers a server mounts; the dev routers,
``/reset_prefix_cache``, ``/pause``, ``/resume``, ``/abort_requests``, only with
``VLLM_SERVER_DEV_MODE=1``), ``entrypoints/openai/completion/{api_router,protocol,serving}.py``
(``/v1/completions``: ``prompt`` a list of token ids, ``max_tokens``, ``min_tokens``, ``temperature``,
``ignore_eos``, ``stream``, ``request_id`` -- the engine's id is ``cmpl-<request_id>-<i>`` --,
``kv_transfer_params``), ``entrypoints/serve/utils/api_utils.py`` (``with_cancellation``: a client
disconnect cancels the handler) and ``v1/engine/async_llm.py`` (``AsyncLLM.generate``: a cancelled or
closed stream aborts its request, ``abort`` -> ``EngineCore`` -> ``Scheduler.finish_requests(...,
FINISHED_ABORTED)``, the call kvaudit's driver makes), ``entrypoints/serve/dev/cache/api_router.py``
(``/reset_prefix_cache``: query ``reset_running_requests``, ``reset_external``, both false by default,
answers ``{"success": bool}``), ``entrypoints/rl/online/api_router.py`` (``/pause`` with query
``mode`` abort | wait | keep, ``/resume``), ``entrypoints/serve/instrumentator/health.py`` (``/health``,
503 once the engine is dead) and ``v1/metrics/loggers.py`` (the gauges; ``vllm:kv_cache_usage_perc``
is ``BlockPool.get_usage()``, ``1 - free / (num_gpu_blocks - 1)``, cached blocks nobody holds counted
free).
"""

from __future__ import annotations

from typing import NamedTuple


class ApiCall(NamedTuple):
    """How one op kind is sent: ``method`` and ``path`` (``None``: no HTTP call), ``body`` (the JSON
    fields set, in words), ``exact`` (a client reproduces the op as the program means it) and
    ``note`` (what a client cannot force, and the approximation the script makes)."""

    method: str | None
    path: str | None
    body: str
    exact: bool
    note: str = ""


class EngineApi(NamedTuple):
    """One engine's table: ``version`` checked, ``sources`` read, ``calls`` per op kind, ``metrics``
    (the gauges the client prints before and after, with the flag that enables them)."""

    engine: str
    version: str
    sources: tuple[str, ...]
    calls: dict[str, ApiCall]
    metrics: tuple[str, ...]
    metrics_flag: str


HTTP_API: dict[str, EngineApi] = {
    "sglang": EngineApi(
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
    ),
    "vllm": EngineApi(
        engine="vLLM", version="0.33.0",
        sources=("vllm/entrypoints/openai/api_server.py", "vllm/entrypoints/launchers/api_server/routers.py",
                 "vllm/entrypoints/openai/completion/api_router.py", "vllm/entrypoints/openai/completion/protocol.py",
                 "vllm/entrypoints/openai/completion/serving.py", "vllm/entrypoints/serve/utils/api_utils.py",
                 "vllm/v1/engine/async_llm.py", "vllm/entrypoints/serve/dev/cache/api_router.py",
                 "vllm/entrypoints/rl/online/api_router.py", "vllm/entrypoints/serve/instrumentator/health.py",
                 "vllm/v1/metrics/loggers.py"),
        calls={
            "submit": ApiCall("POST", "/v1/completions",
                              "model, prompt (token ids), max_tokens, min_tokens (= max_tokens), temperature 0, "
                              "ignore_eos, stream true, request_id; kv_transfer_params where the KV-connector "
                              "preset gives the request some; one streaming request per submit, kept open in a "
                              "thread", True,
                              "a submit that must still be running when a later call arrives gets a longer "
                              "output (--hold-tokens); a stop_at (EOS sampled at that length) becomes max_tokens; "
                              "an extends prefix resends the base prompt only (its output is the model's); "
                              "submits of one scheduler step are sent back to back, and vLLM's engine core takes "
                              "every queued request before its next step, but a client cannot promise they land "
                              "in one step"),
            "health_check": ApiCall("GET", "/health", "(none)", True,
                                    "the vLLM target ignores a health check (no scheduler path); /health only asks "
                                    "the engine core whether it is alive"),
            "abort": ApiCall(None, None, "(close the submit's connection)", True,
                             "vLLM aborts a request whose client disconnects (with_cancellation, AsyncLLM.generate "
                             "-> abort -> Scheduler.finish_requests(FINISHED_ABORTED)); abort(handle=None) closes "
                             "every open stream; a request that has already answered (its blocks held by a KV "
                             "connector's send) has no connection left to close"),
            "flush_cache": ApiCall("POST", "/reset_prefix_cache", "(no body; reset_running_requests and "
                                                                  "reset_external false, as the target calls it)",
                                   True, "needs VLLM_SERVER_DEV_MODE=1; a deferred flush (timeout) does not exist "
                                         "in vLLM and is sent at once"),
            "open_session": ApiCall(None, None, "(none)", True,
                                    "vLLM has no kvaudit-style session (CompletionRequest.session_id is a routing "
                                    "label); the vLLM target ignores the op, so the script sends nothing"),
            "close_session": ApiCall(None, None, "(none)", True,
                                     "as open_session: ignored by the target, nothing sent"),
            "memory_pressure": ApiCall(None, None, "(no API)", False,
                                       "the target evicts every cached block nobody holds "
                                       "(KVCacheManager.evict_blocks, as Scheduler._handle_invalid_blocks does for "
                                       "blocks a KV connector reports invalid); a client cannot: a later large "
                                       "prompt of another family evicts some of them"),
            "pause_generation": ApiCall(None, None, "(none)", True,
                                        "POST /pause?mode=abort|wait|keep exists (VLLM_SERVER_DEV_MODE=1) but the "
                                        "vLLM target ignores the op (it does not drive set_pause_state), so the "
                                        "script sends nothing"),
            "continue_generation": ApiCall(None, None, "(none)", True,
                                           "POST /resume exists (VLLM_SERVER_DEV_MODE=1); ignored by the target, "
                                           "nothing sent"),
            "transfer_fail": ApiCall(None, None, "(none)", True,
                                     "the vLLM target's KV connector stand-in never fails a transfer: ignored, "
                                     "nothing sent"),
            "step": ApiCall(None, None, "(wait)", False,
                            "a client cannot run the engine core n iterations: it waits --step-delay seconds a "
                            "step (with async scheduling a step in flight, which the program may race, is not "
                            "visible to a client either)"),
            "idle": ApiCall("GET", "/metrics", "(wait for every stream to end, then poll)", True,
                            "waits until every stream ended and no request runs or waits"),
        },
        metrics=("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:num_preemptions_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"),
        metrics_flag="",
    ),
}


# older vLLM releases whose own sources were read for the routes and fields the client uses (the same as
# 0.33.0's there): the files, relative to the package
VLLM_ROUTES_ALSO_CHECKED: dict[str, tuple[str, ...]] = {
    "0.15.1": ("vllm/entrypoints/openai/completion/api_router.py", "vllm/entrypoints/openai/completion/protocol.py",
               "vllm/entrypoints/serve/cache/api_router.py", "vllm/entrypoints/serve/instrumentator/health.py",
               "vllm/v1/engine/async_llm.py", "vllm/v1/metrics/loggers.py", "vllm/engine/arg_utils.py",
               "vllm/distributed/kv_transfer/kv_connector/v1/offloading_connector.py"),
}


def api_for(target: str) -> EngineApi:
    """The table of ``target`` (a replay config's ``target``). Raises ``KeyError`` for an engine with
    no HTTP mapping (the built-in engine has no server)."""
    return HTTP_API[target]


def launch_line(config) -> tuple[str, list[str], list[str]]:
    """The server launch for a replay ``config`` of any engine with a table: ``(command, env,
    unmapped)`` (see :func:`flag_line` and :func:`vllm_flag_line`). Raises ``KeyError`` for a target
    with no HTTP table."""
    if config.target == "vllm":
        flags, env, unmapped = vllm_flag_line(config)
        return " ".join(["vllm serve MODEL"] + flags), env, unmapped
    api_for(config.target)
    flags, env, unmapped = flag_line(config)
    return " ".join(["python -m sglang.launch_server --model-path MODEL"] + flags), env, unmapped


def vllm_flag_line(config) -> tuple[list[str], list[str], list[str]]:
    """The vLLM 0.33.0 launch for a :class:`kvaudit.targets.vllm.config.VllmConfig`: ``(flags, env,
    unmapped)`` -- ``vllm serve`` flags (``--num-gpu-blocks-override`` for ``num_gpu_blocks``, the
    null block included as vLLM counts it; ``--block-size``, ``--max-num-seqs``,
    ``--max-num-batched-tokens``, ``--max-model-len``, ``--[no-]enable-prefix-caching``,
    ``--[no-]enable-chunked-prefill``, ``--[no-]async-scheduling``, ``--kv-transfer-config``, kvaudit's
    save connector as vLLM's ``OffloadingConnector``, ``SimpleCPUOffloadConnector`` eager with a
    ``CPU_BYTES`` placeholder for its CPU budget),
    environment variables (``VLLM_SERVER_DEV_MODE=1`` for ``/reset_prefix_cache``), and config fields
    no flag sets. Flag names from ``vllm/engine/arg_utils.py`` (``EngineArgs.add_cli_args``; a
    ``bool | None`` field gets ``--x`` / ``--no-x``)."""
    c = config

    def onoff(flag: str, on: bool) -> str:
        return f"--{flag}" if on else f"--no-{flag}"

    flags = [f"--block-size {c.block_size}", f"--num-gpu-blocks-override {c.num_gpu_blocks}",
             f"--max-num-seqs {c.max_num_seqs}", f"--max-num-batched-tokens {c.max_num_batched_tokens}",
             f"--max-model-len {c.max_model_len}", onoff("enable-prefix-caching", c.enable_prefix_caching),
             onoff("enable-chunked-prefill", c.enable_chunked_prefill), onoff("async-scheduling", c.async_scheduling)]
    env = ["VLLM_SERVER_DEV_MODE=1"]
    unmapped = [f"vocab_size={c.vocab_size} (the synthetic sampler's; any model's vocabulary holds the prompts' "
                "token ids 2..127)", f"seed={c.seed} (the target's sampler is a hash of request id and position, "
                "not a model's)"]
    if c.level == "manager":
        unmapped.append("level=manager (kvaudit drove the KVCacheManager alone, playing the scheduler's calls; a "
                        "server runs the whole Scheduler)")
    if c.sliding_window is not None:
        unmapped.append(f"sliding_window={c.sliding_window} (a property of the model: serve a model with a "
                        f"{c.sliding_window}-token sliding window beside full attention, e.g. a Gemma or "
                        "Mistral-style hybrid)")
    if c.kv_connector == "KvauditAsyncSaveConnector":  # kvaudit's stand-in for an offloading connector
        flags.append("--kv-transfer-config '{\"kv_connector\": \"OffloadingConnector\", \"kv_role\": \"%s\", "
                     "\"kv_connector_extra_config\": {\"cpu_bytes_to_use\": 1073741824}}'" % c.kv_role)
    elif c.kv_connector == "SimpleCPUOffloadConnector":  # eager, as the target builds it (boot.kv_connector_extra_config)
        flags.append("--kv-transfer-config '{\"kv_connector\": \"SimpleCPUOffloadConnector\", \"kv_role\": \"%s\", "
                     "\"kv_connector_extra_config\": {\"cpu_bytes_to_use\": CPU_BYTES, \"lazy_offload\": false}}'"
                     % c.kv_role)
        unmapped.append(f"num_cpu_blocks={c.num_cpu_blocks} (the CPU pool kvaudit's connector had; on a server it "
                        "holds cpu_bytes_to_use / (the model's KV bytes per block, all layers) blocks: set CPU_BYTES "
                        f"to {c.num_cpu_blocks} blocks' worth, so that the CPU pool evicts as it did here)")
    elif c.kv_connector is not None:
        flags.append("--kv-transfer-config '{\"kv_connector\": \"%s\", \"kv_role\": \"%s\"}'"
                     % (c.kv_connector, c.kv_role))
    if c.kv_connector is not None:
        unmapped.append(f"kv_transfer_latency_steps={c.kv_transfer_latency_steps} (kvaudit's worker stand-in "
                        "completes each transfer 1 to that many steps after it starts; a real transfer takes "
                        "what the wire takes)")
        if c.kv_connector == "KvauditAsyncSaveConnector":
            unmapped.append("kv_connector=KvauditAsyncSaveConnector is kvaudit's own scheduler-side connector "
                            "(kvaudit/targets/vllm/save_connector.py), standing for an offloading connector with "
                            "a store in flight: the launch names vLLM's OffloadingConnector, whose request_finished "
                            "delays the free while a store is in flight (cpu_bytes_to_use as "
                            "vllm/v1/kv_offload reads it; 1 GiB here)")
    if c.wake_for_transfers and c.kv_connector == "SimpleCPUOffloadConnector":
        # 0.20.0-0.29.0 define has_pending_transfers, which nothing calls; the Scheduler asks the connector's
        # has_pending_push_work (0.28.0 on), which this connector defines from 0.30.0
        unmapped.append("wake_for_transfers=true (kvaudit steps the engine while a store is outstanding; vLLM "
                        ">= 0.30.0 does so itself for this connector, earlier releases stop stepping and hold the "
                        "store's blocks until the next request)")
    elif c.wake_for_transfers:
        unmapped.append("wake_for_transfers=true (kvaudit steps the engine while only sends are outstanding; "
                        "vLLM >= 0.22.0 does so itself)")
    if c.return_routed_experts:
        flags.append("--enable-return-routed-experts")
        unmapped.append("return_routed_experts needs a mixture-of-experts model and vLLM 0.22.0 to 0.30.0")
    return flags, env, unmapped


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
    if c.enable_hisparse:
        unmapped.append(f"num_slots={c.num_slots} is HiSparse's physical device pool here (the logical pool is "
                        f"{c.hisparse_host_to_device_ratio}x); which of the two --max-total-tokens sizes under "
                        "HiSparse was not checked")
        flags += ["--enable-hisparse", "--disable-radix-cache",
                  "--hisparse-config '{\"device_buffer_size\": %d, \"host_to_device_ratio\": %d}'"
                  % (c.hisparse_device_buffer_size, c.hisparse_host_to_device_ratio)]
    if c.enable_hierarchical_cache:
        flags += ["--enable-hierarchical-cache", f"--hicache-ratio {c.hicache_ratio:g}",
                  f"--hicache-write-policy {c.hicache_write_policy}"]
    if c.enable_priority_scheduling:
        flags.append("--enable-priority-scheduling")
        if c.schedule_low_priority_values_first:
            flags.append("--schedule-low-priority-values-first")
    if c.max_queued_requests is not None:
        flags.append(f"--max-queued-requests {c.max_queued_requests}")
    return flags, env, unmapped
