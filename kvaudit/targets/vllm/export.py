"""What ``kvaudit export`` needs of vLLM 0.33.0 (:data:`EXPORT`, handed over by the ``vllm`` kind's
``export`` field): the HTTP table, the ``vllm serve`` launch, the engine's part of a client script and
of an issue text, the P/D transfer rule and the injected faults' descriptions.

The routes and fields were read from vLLM 0.33.0's installed sources (``API.sources``; facts only): the dev
routers (``/reset_prefix_cache``, ``/pause``, ``/resume``) are mounted only with ``VLLM_SERVER_DEV_MODE=1``;
the engine's id of a ``/v1/completions`` request is ``cmpl-<request_id>-<i>``; a client disconnect cancels the
handler (``with_cancellation``) and ``AsyncLLM.generate`` aborts the request (``Scheduler.finish_requests(...,
FINISHED_ABORTED)``, the driver's call); ``/reset_prefix_cache`` answers ``{"success": bool}``; ``/health`` is
503 once the engine is dead; ``vllm:kv_cache_usage_perc`` is ``BlockPool.get_usage()``, ``1 - free /
(num_gpu_blocks - 1)``, cached blocks nobody holds counted free.
"""

from __future__ import annotations

import json

from kvaudit.targets.export_api import (ApiCall, ClientParts, EngineApi, EngineExport, IssueParts, launch_line,
                                        planted_faults)
from kvaudit.targets.vllm.boot import mamba_cache_mode
from kvaudit.targets.vllm.config import FAULTS, NIXL

API = EngineApi(
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
        "flush_cache": ApiCall("POST", "/reset_prefix_cache", "(no body; query reset_running_requests=true "
                                                              "where the config's flush_running is, reset_external "
                                                              "false, as the target calls it)",
                               True, "needs VLLM_SERVER_DEV_MODE=1; a deferred flush (timeout) does not exist "
                                     "in vLLM and is sent at once"),
        "open_session": ApiCall(None, None, "(none)", True,
                                "on a streaming_sessions preset the target opens a vLLM streaming-"
                                "input session (its chunks resumable requests, as AsyncLLM takes an input stream), "
                                "whose chunks the script sends as plain requests; elsewhere the target ignores the "
                                "op (CompletionRequest.session_id is only a routing label)"),
        "close_session": ApiCall(None, None, "(none)", True,
                                 "on a streaming_sessions preset the target ends the session's input "
                                 "(a final, non-resumable request); elsewhere ignored"),
        "memory_pressure": ApiCall(None, None, "(no API)", False,
                                   "the target evicts every cached block nobody holds "
                                   "(KVCacheManager.evict_blocks, as Scheduler._handle_invalid_blocks does for "
                                   "blocks a KV connector reports invalid; on vllm-kv-fail* it also reports "
                                   "the cached blocks running requests hold invalid); a client cannot: a later "
                                   "large prompt of another family evicts some of them"),
        "pause_generation": ApiCall(None, None, "(none)", True,
                                    "POST /pause?mode=abort|wait|keep exists (VLLM_SERVER_DEV_MODE=1) but the "
                                    "vLLM target ignores the op (it does not drive set_pause_state), so the "
                                    "script sends nothing"),
        "continue_generation": ApiCall(None, None, "(none)", True,
                                       "POST /resume exists (VLLM_SERVER_DEV_MODE=1); ignored by the target, "
                                       "nothing sent"),
        "transfer_fail": ApiCall(None, None, "(no API)", False,
                                 "a failed KV transfer needs the prefill server or the wire to fail: stop the "
                                 "--prefill-url server while the request loads; the script sends nothing"),
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
)

# older vLLM releases whose own sources were read for the routes and fields the client uses (the same as
# 0.33.0's there): the files, relative to the package
ROUTES_ALSO_CHECKED: dict[str, tuple[str, ...]] = {
    "0.15.1": ("vllm/entrypoints/openai/completion/api_router.py", "vllm/entrypoints/openai/completion/protocol.py",
               "vllm/entrypoints/serve/cache/api_router.py", "vllm/entrypoints/serve/instrumentator/health.py",
               "vllm/v1/engine/async_llm.py", "vllm/v1/metrics/loggers.py", "vllm/engine/arg_utils.py",
               "vllm/distributed/kv_transfer/kv_connector/v1/offloading_connector.py"),
}


def vllm_flag_line(config) -> tuple[list[str], list[str], list[str]]:
    """The vLLM 0.33.0 launch for a :class:`kvaudit.targets.vllm.config.VllmConfig`: ``(flags, env, unmapped)``,
    ``vllm serve`` flags (``vllm/engine/arg_utils.py``), environment variables, the fields no flag sets."""
    c = config
    flags = [f"--block-size {c.block_size}", f"--num-gpu-blocks-override {c.num_gpu_blocks}",
             f"--max-num-seqs {c.max_num_seqs}", f"--max-num-batched-tokens {c.max_num_batched_tokens}",
             f"--max-model-len {c.max_model_len}"]
    flags += [("--" if on else "--no-") + flag for flag, on in (("enable-prefix-caching", c.enable_prefix_caching), (
        "enable-chunked-prefill", c.enable_chunked_prefill), ("async-scheduling", c.async_scheduling))]
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
    if c.kv_connector is not None:
        kv = {"kv_connector": c.kv_connector, "kv_role": c.kv_role}
        if c.kv_connector == "KvauditAsyncSaveConnector":  # kvaudit's stand-in for an offloading connector
            kv.update(kv_connector="OffloadingConnector", kv_connector_extra_config={"cpu_bytes_to_use": 1 << 30})
        elif c.kv_connector == "SimpleCPUOffloadConnector":  # eager, as boot.kv_connector_extra_config builds it
            kv["kv_connector_extra_config"] = {"cpu_bytes_to_use": "CPU_BYTES", "lazy_offload": False}
            unmapped.append(f"num_cpu_blocks={c.num_cpu_blocks} (the CPU pool kvaudit's connector had; on a server it "
                            "holds cpu_bytes_to_use / (the model's KV bytes per block, all layers) blocks: set "
                            f"CPU_BYTES to {c.num_cpu_blocks} blocks' worth, so that the CPU pool evicts as it did "
                            "here)")
        elif c.kv_load_failure_policy is not None:
            kv["kv_load_failure_policy"] = c.kv_load_failure_policy
        flags.append("--kv-transfer-config '%s'" % json.dumps(kv).replace('"CPU_BYTES"', "CPU_BYTES"))
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
    if c.scheduling_policy != "fcfs":
        flags.append(f"--scheduling-policy {c.scheduling_policy}")
        unmapped.append("the submits' priorities (the script sends each request with vLLM's default priority, 0)")
    if c.num_spec_tokens:  # (the driver plays the drafter: an eagle method needs a draft model on a server)
        spec = {"method": c.spec_method, "num_speculative_tokens": c.num_spec_tokens}
        spec.update({"model": "DRAFT_MODEL"} if c.spec_method == "eagle" else {})
        flags.append("--speculative-config '%s'" % json.dumps(spec))
    if c.mamba:
        flags.append(f"--mamba-cache-mode {mamba_cache_mode(c)}")
        flags += [] if c.prefix_match_unit is None else [f"--prefix-match-unit {c.prefix_match_unit}"]
        unmapped.append("mamba=true (a property of the model: serve a hybrid model with Mamba layers beside full "
                        "attention, e.g. a Granite-4.0-H or Nemotron-H model)")
    if c.return_routed_experts:
        flags.append("--enable-return-routed-experts")
        unmapped.append("return_routed_experts needs a mixture-of-experts model and vLLM 0.22.0 to 0.30.0")
    return flags, env, unmapped


# -- the client script's part --------------------------------------------------------------------------

VLLM_IMPORTS = r'''import http.client
import socket
'''

VLLM_API = r'''
    # -- the server's API (vLLM 0.33.0, OpenAI-compatible; dev routes with VLLM_SERVER_DEV_MODE=1) ------
    def submit(self, rid, input_ids, max_tokens, hold, remote=None, label=""):
        """One streaming POST /v1/completions, read in a thread so that the request stays open until it
        ends or abort() closes its connection. ``remote``: "prefill" (its prompt's KV is read from the
        --prefill-url server first, as a P/D proxy does), "decode" (a decode instance reads its KV when
        it ends: do_remote_decode), or None."""
        n = max_tokens + (self.hold_tokens if hold else 0)
        n = max(max_tokens, min(n, MAX_MODEL_LEN - len(input_ids)))  # vLLM refuses prompt + output > max_model_len
        label = label or "submit " + rid
        body = {"prompt": list(input_ids), "max_tokens": n, "min_tokens": n, "temperature": 0.0,
                "ignore_eos": True, "stream": True, "request_id": self.tag + rid}
        if self.model:
            body["model"] = self.model
        if remote == "decode":
            body["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False}
            if self.settle_s < LEASE_WAIT:
                self.say("   %s: do_remote_decode: NIXL holds its blocks until a decode instance reads them or "
                         "their lease (kv_lease_duration, 30 s by default) ends: the final check waits up to %g s"
                         % (label, LEASE_WAIT))
                self.settle_s = LEASE_WAIT
        elif remote == "prefill" and self.args.prefill_url:
            pre = dict(body, max_tokens=1, min_tokens=1, stream=False, request_id=self.tag + rid + "-prefill",
                       kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False})
            self.say("-> %s (prefill instance): POST %s/v1/completions %s" % (label, self.args.prefill_url,
                                                                           json.dumps(pre)))
            status, text = self.request("POST", "/v1/completions", pre, base=self.args.prefill_url.rstrip("/"))
            self.answer(label + " (prefill instance)", status, text)
            try:
                params = json.loads(text).get("kv_transfer_params")
            except (ValueError, AttributeError):
                params = None
            if params:
                body["kv_transfer_params"] = params
        elif remote == "prefill":
            self.say("   %s: no --prefill-url: sent as a plain request (its prompt's KV is computed here, not "
                     "read from a prefill instance)" % label)
        self.say("-> %s: POST /v1/completions %s" % (label, json.dumps(body)))
        stream = {"conn": None, "closed": False, "ended": False}
        self.streams[rid] = stream
        t = threading.Thread(target=self._stream, args=(label, body, stream), daemon=True)
        t.start()
        self.pending.append((label, t))
        time.sleep(self.gap)  # so the next call reaches the server after this one

    def _stream(self, label, body, stream):
        """Read the server-sent events of one completion until [DONE], or until abort() closes it."""
        u = urllib.parse.urlsplit(self.url)
        conn = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=self.timeout)
        stream["conn"] = conn
        tokens, finish, done = 0, None, False
        try:
            conn.request("POST", "/v1/completions", json.dumps(body).encode(),
                         {"Content-Type": "application/json", "Accept": "text/event-stream"})
            r = conn.getresponse()
            if r.status != 200:
                self.answer(label, r.status, r.read().decode("utf-8", "replace"))
                return
            while not stream["closed"]:
                line = r.readline()
                if not line:
                    break
                line = line.decode("utf-8", "replace").strip()
                if line == "data: [DONE]":
                    done = True
                    break
                if line.startswith("data: "):
                    try:
                        choice = json.loads(line[6:])["choices"][0]
                    except (ValueError, KeyError, IndexError, TypeError):
                        continue
                    tokens += 1
                    finish = choice.get("finish_reason") or finish
        except (OSError, http.client.HTTPException) as e:
            if not stream["closed"]:
                self.answer(label, None, "connection lost after %d chunk(s): %s" % (tokens, e))
                return
        finally:
            stream["ended"] = True
            conn.close()
        if stream["closed"]:
            self.say("<- %s: closed by the client after %d chunk(s) (the abort)" % (label, tokens))
        elif not done:
            self.answer(label, None, "the stream ended without [DONE] after %d chunk(s)" % tokens)
        else:
            self.say("<- %s: 200 %d chunk(s) finish=%s" % (label, tokens, finish))

    def abort(self, rid, label=""):
        """vLLM aborts a request whose client disconnects (AsyncLLM.generate is cancelled and calls
        abort): close the connection of ``rid``, or of every open stream for None."""
        names = [r for r, s in self.streams.items() if not (s["closed"] or s["ended"])] if rid is None else [rid]
        self.say("-> %s: close the connection of %s" % (label or "abort", ", ".join(names) or "(no open stream)"))
        for name in names:
            stream = self.streams.get(name)
            if stream is None:
                continue
            stream["closed"] = True
            conn = stream["conn"]
            sock = getattr(conn, "sock", None)
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)  # the server sees the disconnect now
                except OSError:
                    pass
        time.sleep(self.gap)

    def flush_cache(self, timeout=None, label=""):
        """POST /reset_prefix_cache (VLLM_SERVER_DEV_MODE=1): {"success": false} while blocks are held.
        ``timeout``: the program's flush ops pass theirs (vLLM has no deferred flush: sent at once) and, with
        RESET_RUNNING, preempt the running requests as the program did; the script's own flushes pass none."""
        query = "?reset_running_requests=true" if RESET_RUNNING and timeout is not None else ""
        return self.send(label or "reset_prefix_cache", "POST", "/reset_prefix_cache" + query)

    def health(self, label=""):
        self.send(label or "health", "GET", "/health")

    def at_rest(self):
        """vLLM publishes its gauges after each engine step, and an idle engine does not step (an abort of
        the last request leaves the gauges as they were): one 1-token request makes it step, then poll."""
        n = len(self.streams)
        self.submit("refresh%d" % n, [2], 1, False, label="refresh the gauges")
        self.idle(label="refresh the gauges")
        return self.settle()
'''

VLLM_FUNCS = r'''

def engine_args(ap):
    ap.add_argument("--model", default=None,
                    help="the served model's name (default: the first of GET /v1/models)")
    ap.add_argument("--prefill-url", default=None,
                    help="a prefill server (kv_producer) for the requests the program reads remote KV for")


def server_line(c):
    status, text = c.request("GET", "/version")
    version = None
    if status == 200:
        try:
            version = json.loads(text).get("version")
        except (ValueError, AttributeError):
            pass
    if not c.model:
        status, text = c.request("GET", "/v1/models")
        try:
            c.model = json.loads(text)["data"][0]["id"] if status == 200 else None
        except (ValueError, KeyError, IndexError, TypeError):
            c.model = None
    print("server: version=%s model=%s" % (version, c.model))


def pool_findings(before, after, flushed):
    """What the gauges say with nothing running, every stream ended and the prefix cache reset."""
    seen = []
    if after is not None:
        usage = after.get("vllm:kv_cache_usage_perc", 0)
        if usage > 0:
            seen.append("kv_cache_usage_perc=%g with no request running (about %d of %d blocks held)"
                        % (usage, round(usage * POOL_BLOCKS), POOL_BLOCKS))
    if flushed is not None and flushed[0] == 200:
        try:
            ok = json.loads(flushed[1]).get("success", True)
        except (ValueError, AttributeError):
            ok = True
        if not ok:
            seen.append("reset_prefix_cache refused (success=false) with no request running: blocks are held")
    elif flushed is not None and flushed[0] == 404:
        print("NOTE: /reset_prefix_cache is not served: launch with VLLM_SERVER_DEV_MODE=1 to check it")
    return seen
'''

def remote_of(config, n: int) -> str | None:
    """Which side of a P/D pair the ``n``-th submit (from 0) is on (:func:`kvaudit.targets.vllm.connector.
    transfer_params`): ``"prefill"``, ``"decode"``, or None (also for any connector but NIXL's)."""
    if config.kv_connector not in NIXL:
        return None
    from kvaudit.targets.vllm.connector import transfer_params
    params = transfer_params(n + 1, "r", 1, config.block_size) or {}
    return "prefill" if params.get("do_remote_prefill") else "decode" if params.get("do_remote_decode") else None


def _server_notes(config) -> list[str]:
    out = ["- `VLLM_SERVER_DEV_MODE=1` mounts `/reset_prefix_cache` (the program's `flush_cache`, and the "
           "script's check that no block is held at the end)."]
    if config.kv_connector in NIXL:
        out.append("- With NIXL: requests the program reads remote KV for need a prefill server (`--kv-transfer-config`"
                   " with `\"kv_role\": \"kv_producer\"`) passed as `--prefill-url`; without it they are sent as "
                   "plain requests.")
    if config.streaming_sessions:
        out.append("- Streaming-input sessions (`AsyncLLM.generate` with an input stream, as the realtime API uses) "
                   "are not sent: this script sends each session's chunks as separate plain requests, so a "
                   "finding that needs a session does not reproduce through it.")
    return out


def unsent(config, program) -> str | None:
    """:attr:`EngineExport.unsent` for vLLM: on a ``streaming_sessions`` preset, a program that opens a session
    (a streaming-input request, ``AsyncLLM.generate`` with an input stream) cannot be sent over HTTP: the
    script sends its chunks as separate plain requests, which is not the program; None otherwise."""
    if not config.streaming_sessions or not any(op.kind == "open_session" for op in program):
        return None
    return ("the program's streaming-input sessions (AsyncLLM.generate with an input stream, as the realtime API "
            "uses) have no HTTP request here: the script sends each session's chunks as separate plain requests, "
            "which is not the program; replay the file with kvaudit instead")


def unseen_pool(pool: str) -> str | None:
    """:attr:`EngineExport.unseen_pool` for vLLM: None for the BlockPool (``kv_cache_usage_perc`` counts
    every group's blocks, sliding-window and Mamba ones included); any other pool is not counted."""
    if pool == "block_pool":
        return None
    return f"{pool}, which vLLM's kv_cache_usage_perc does not count: run `kvaudit replay` on the replay file"


def _call_text(c) -> str | None:
    whose = "every open stream" if c.args.get("rid") is None else f"{c.args['rid']}'s stream"
    return f"close the connection of {whose} (vLLM aborts on disconnect)" if c.kind == "abort" else None


def trace_views(target):
    """``(live, answered, sessions)`` of a built vLLM target: ``known()`` (its aborts pick from it), those
    finished with blocks held (a KV connector's send), no sessions."""
    return ((lambda: tuple(target.known())),
            (lambda: tuple(rid for rid, (_, status) in target.known().items() if status.startswith("finished"))),
            (lambda: ()))


EXPORT = EngineExport(
    api=API, package="vllm",
    client=ClientParts(
        api=VLLM_API, funcs=VLLM_FUNCS, url="http://127.0.0.1:8000", settle=10.0,
        busy=("vllm:num_requests_running", "vllm:num_requests_waiting"), settle_gauge="vllm:kv_cache_usage_perc",
        settle_why="vLLM publishes the gauges after an engine step, and the script makes one (a 1-token request) "
                   "before it reads them: 10 s is a margin, not a refresh period",
        metrics_hint="vLLM serves /metrics unless launched with --disable-log-stats",
        imports=VLLM_IMPORTS, init="        self.streams, self.model = {}, args.model\n",
        consts=("LEASE_WAIT = 40.0  # s: NIXL's default kv_lease_duration (30 s) and a margin",)),
    issue=IssueParts(
        environment=lambda c: (f"block size {c.block_size}, {c.num_gpu_blocks} blocks (the null "
                               f"block included), level {c.level}."),
        exact="The client reproduces the program's calls one to one: each submit is one streaming "
              "`/v1/completions` (kept open in a thread), an abort closes that stream's connection (vLLM aborts a "
              "request whose client disconnects: `with_cancellation` in `vllm/entrypoints/serve/utils/api_utils.py`,"
              " `AsyncLLM.generate` in `vllm/v1/engine/async_llm.py`), and nothing waits on step timing.",
        approximates=", see a step in flight, or drive a KV transfer", driver="engine core",
        seen_how="(Scheduler or AsyncScheduler, KVCacheManager, BlockPool, prefix-cache map) on CPU, through its "
                 "driver, which calls them as vLLM's engine core does with synthetic model outputs",
        server_notes=_server_notes, call_text=_call_text,
        program_note="; `abort(handle=None)` aborts every request the Scheduler holds",
        model=lambda c: "any model" if c.sliding_window is None else
        f"a model with a {c.sliding_window}-token sliding window beside full attention, as said above"),
    launch=launch_line("vllm serve MODEL", vllm_flag_line), planted=planted_faults(FAULTS),
    client_sizes=lambda c: (c.num_gpu_blocks - 1, c.max_model_len),
    client_consts=lambda c: (f"RESET_RUNNING = {c.flush_running!r}  # flush_running: a flush resets running requests",),
    expected_pool="the pool does not come back (with every stream ended and nothing running, kv_cache_usage_perc > 0 "
                  "or /reset_prefix_cache answers success=false), or the server fails",
    same_step_note="sent --gap seconds after the previous submit of the same scheduler step: vLLM's engine core "
                   "takes every queued request before its next step, but a client cannot promise that both land in "
                   "one step",
    ignored_ops=("open_session", "close_session", "pause_generation", "continue_generation", "transfer_fail"),
    remote_of=remote_of,
    remote_notes={
        "prefill": "the KV-connector preset reads this prompt's KV from a remote prefill instance "
                   "(do_remote_prefill): the script does so with --prefill-url (a second server, kv_producer), "
                   "else sends a plain request",
        "decode": "the KV-connector preset has a remote decode instance read this request's KV when it ends "
                  "(do_remote_decode): its blocks are held until then (on a server with no decode instance, "
                  "until NIXL's abort timeout)"},
    routes_also_checked=ROUTES_ALSO_CHECKED, trace_views=trace_views, unseen_pool=unseen_pool, unsent=unsent,
)
