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

vLLM 0.33.0 (stretch; the client generator does not emit vLLM scripts yet): the OpenAI-compatible
``/v1/completions`` takes a prompt as token ids, and a request is aborted when its client
disconnects (there is no abort endpoint).
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
        sources=("vllm/entrypoints/openai/api_server.py",),
        calls={
            "submit": ApiCall("POST", "/v1/completions", "model, prompt (token ids), max_tokens, temperature 0, "
                                                         "ignore_eos", True),
            "abort": ApiCall(None, None, "(disconnect)", True, "close the submit's connection: vLLM aborts it"),
            "step": ApiCall(None, None, "(wait)", False, "waits --step-delay seconds a step"),
            "idle": ApiCall("GET", "/metrics", "(wait, then poll)", True),
        },
        metrics=("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting"),
        metrics_flag="",
    ),
}


def api_for(target: str) -> EngineApi:
    """The table of ``target`` (a replay config's ``target``). Raises ``KeyError`` for an engine with
    no HTTP mapping (the built-in engine has no server)."""
    return HTTP_API[target]


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
