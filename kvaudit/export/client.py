"""``kvaudit export --client``: a standalone script (standard library only, no kvaudit import) that
drives a real server through its HTTP API in the program's order (:mod:`kvaudit.export.plan`) and
says what a maintainer should see: the crash (the server stops answering, or 5xx), the hang (a
request that never answers), or the pool gauges of ``/metrics`` before and after.

The script is assembled from parts: the shared runtime (:data:`CORE`: the HTTP client that records
every answer, waits, the ``/metrics`` reader, :data:`MAIN`: the run and its verdict) and one part per
engine (:data:`ENGINE_PARTS`: the API methods of ``Client`` for that engine's routes, its extra
arguments, the server line and the pool check). What differs per finding is a header (launch
command, expectations, the approximations) and one ``program(c)`` function with one call per op or
batch, each commented with the ops it stands for. SGLang 0.5.23 and vLLM 0.33.0
(:data:`kvaudit.export.http_api.HTTP_API`).
"""

from __future__ import annotations

import json

from kvaudit.export.http_api import api_for
from kvaudit.export.plan import Call, Plan

EXPECT_OF_KIND = {"crash": "crash", "hang": "hang"}  # any other kind: pool gauges ("memory")

IMPORTS = r'''
import argparse
import json
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
'''

CORE = r'''
class Client:
    """A thin HTTP client that records every answer: ``failures`` (no answer, connection lost, 5xx)."""

    def __init__(self, args):
        self.url = args.url.rstrip("/")
        self.settle_s = args.settle
        self.metrics_url = (getattr(args, "metrics_url", None) or args.url).rstrip("/")
        self.timeout, self.step_delay, self.gap = args.timeout, args.step_delay, args.gap
        self.hold_tokens = args.hold_tokens
        self.args = args
        self.tag = "kvaudit-%s-" % uuid.uuid4().hex[:6]  # a fresh prefix per run: rerunning never collides
        self.failures, self.pending = [], []
        self.lock = threading.Lock()

    def say(self, line):
        with self.lock:
            print(line, flush=True)

    def request(self, method, path, body=None, timeout=None, base=None):
        """(status, text); status None when there was no HTTP answer (refused, reset, timed out)."""
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if data is not None else {}
        req = urllib.request.Request((base or self.url) + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.timeout) as r:
                return r.status, r.read().decode("utf-8", "replace")
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode("utf-8", "replace")
        except (urllib.error.URLError, OSError) as e:
            return None, str(getattr(e, "reason", e))

    def send(self, label, method, path, body=None, background=False):
        """Send one call; in the background for calls that last as long as a request runs."""
        self.say("-> %s: %s %s %s" % (label, method, path, "" if body is None else json.dumps(body)))

        def go():
            status, text = self.request(method, path, body)
            self.answer(label, status, text)
            return status, text

        if background:
            t = threading.Thread(target=go, daemon=True)
            t.start()
            self.pending.append((label, t))
            time.sleep(self.gap)  # so the next call reaches the server after this one
            return None
        out = go()
        time.sleep(self.gap)
        return out

    def answer(self, label, status, text):
        if status is None or status >= 500:
            self.failures.append("%s: %s" % (label, "no answer (%s)" % text if status is None else
                                              "HTTP %d %s" % (status, text[:200])))
        shown = text
        try:  # a /generate answer: one line per request with its finish reason
            doc = json.loads(text)
            docs = doc if isinstance(doc, list) else [doc]
            if all(isinstance(d, dict) and "meta_info" in d for d in docs):
                shown = "; ".join("%s finish=%s" % (d["meta_info"].get("id", "?"), json.dumps(
                    d["meta_info"].get("finish_reason"))) for d in docs)
        except ValueError:
            pass
        self.say("<- %s: %s %s" % (label, status if status is not None else "NO ANSWER", shown.strip()[:300]))
'''

CORE_TAIL = r'''
    def wait(self, steps, label=""):
        """A client cannot run n scheduler iterations: it waits --step-delay seconds a step."""
        self.say("   %s: wait %.2f s (stands for %d scheduler step(s))" % (label or "step", steps * self.step_delay,
                                                                         steps))
        time.sleep(steps * self.step_delay)

    def no_api(self, what, how, label=""):
        self.say("   %s: %s has no HTTP call: %s" % (label, what, how))

    def ignored(self, what, why, label=""):
        self.say("   %s: %s: nothing to send (%s)" % (label, what, why))

    def idle(self, label=""):
        """Wait for every request sent so far to answer (--timeout), then for no request to run or queue."""
        self.say("   %s: wait until every request has answered and none runs" % (label or "idle"))
        deadline = time.time() + self.timeout
        for name, t in self.pending:
            t.join(max(0.0, deadline - time.time()))
        hung = [name for name, t in self.pending if t.is_alive()]
        self.pending = [(n, t) for n, t in self.pending if t.is_alive()]
        for name in hung:
            self.say("   %s: %s has not answered after %g s" % (label or "idle", name, self.timeout))
        while time.time() < deadline:
            c = self.counters()
            if c is None or sum(c.get(k, 0) for k in BUSY) == 0:
                break
            time.sleep(0.2)
        return hung

    def counters(self):
        """The pool gauges of /metrics (summed over labels), or None when /metrics does not answer."""
        status, text = self.request("GET", "/metrics", base=self.metrics_url)
        if status != 200:
            return None
        out = {}
        for line in text.splitlines():
            if line.startswith("#") or not line.strip():
                continue
            name = line.split("{")[0].split(" ")[0]
            if name in METRICS:
                try:
                    out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
                except ValueError:
                    pass
        return out

    def settle(self):
        """The gauges once the pool is at rest: poll (up to --settle seconds) until no KV is in use
        (the gauges of an idle server may lag: see SETTLE_WHY)."""
        deadline = time.time() + self.settle_s
        c = self.counters()
        while c is not None and c.get(SETTLE_GAUGE, 0) > 0 and time.time() < deadline:
            time.sleep(1.0)
            c = self.counters()
        return c

    def alive(self):
        status, _ = self.request("GET", "/health", timeout=min(self.timeout, 10.0))
        return status == 200
'''

MAIN = r'''

def show(title, counters):
    if counters is None:
        print("%s: /metrics unavailable (%s)" % (title, METRICS_HINT))
    else:
        print("%s: %s" % (title, " ".join("%s=%g" % (k.split(":", 1)[1], counters[k]) for k in METRICS
                                           if k in counters)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default=DEFAULT_URL, help="the server (default: %(default)s)")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for any answer (default: 60)")
    ap.add_argument("--step-delay", type=float, default=0.5,
                    help="seconds that stand for one scheduler step of the program (default: 0.5)")
    ap.add_argument("--gap", type=float, default=0.05,
                    help="seconds between two calls, so they arrive in the program's order (default: 0.05)")
    ap.add_argument("--hold-tokens", type=int, default=HOLD_TOKENS,
                    help="extra output tokens for a request that must still run when a later call arrives "
                         "(default: %(default)s)")
    ap.add_argument("--settle", type=float, default=SETTLE_S,
                    help="seconds to wait for the idle /metrics to show the pool at rest (default: %(default)s)")
    engine_args(ap)
    args = ap.parse_args(argv)
    if args.timeout <= 0 or min(args.step_delay, args.gap, args.hold_tokens, args.settle) < 0:
        print("error: --timeout must be > 0 and the other numbers >= 0", file=sys.stderr)
        return 2
    for flag in ("url", "metrics_url", "prefill_url"):
        value = getattr(args, flag, None)
        parts = urllib.parse.urlsplit(value or "http://-")
        if parts.scheme not in ("http", "https") or not parts.netloc:
            print("error: --%s %s: want a server URL such as %s" % (flag.replace("_", "-"), value, DEFAULT_URL),
                  file=sys.stderr)
            return 2
    c = Client(args)
    if not c.alive():
        print("error: no server answers GET %s/health (launch it first: see the top of this file)" % c.url,
              file=sys.stderr)
        return 2
    server_line(c)
    for line in APPROXIMATIONS:
        print("NOTE (approximation): " + line)
    c.flush_cache(label="flush_cache (before: a full pool to compare with)")
    before = c.at_rest()
    show("counters before", before)
    program(c)
    hung = c.idle(label="end of program")
    during = c.counters()
    show("counters after the program", during)
    for name in OPEN_AT_END:
        c.close_session(name, label="cleanup: close_session " + name)
    hung += c.idle(label="cleanup")
    flushed = c.flush_cache(label="cleanup: flush_cache")
    after = c.at_rest()
    show("counters after the cleanup (sessions closed, cache flushed)", after)
    up = c.alive()
    print("EXPECTED: " + EXPECTED)
    seen = []
    if not up:
        seen.append("the server no longer answers GET /health")
    seen += ["call failed: " + f for f in c.failures]
    if hung:
        seen.append("no answer from: " + ", ".join(hung))
    if up:
        seen += pool_findings(before, after, flushed)
    print("OBSERVED: " + ("; ".join(seen) if seen else "nothing abnormal"))
    reproduced = bool(seen) if EXPECT != "hang" else bool(hung)
    print("RESULT: " + ("REPRODUCED" if reproduced else "NOT REPRODUCED") +
          ("" if reproduced or EXACT else " (this script only approximates the program: see the NOTE lines; "
                                         "try a smaller --step-delay or larger --hold-tokens)"))
    return 1 if reproduced else 0


if __name__ == "__main__":
    sys.exit(main())
'''

# -- SGLang 0.5.23 ---------------------------------------------------------------------------------------

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
        (lists), all sharing ``session_params``."""
        params = [{"max_new_tokens": m + (self.hold_tokens if hold else 0), "temperature": 0.0, "ignore_eos": True}
                  for _, _, m, hold in items]
        rids = [self.tag + rid for rid, _, _, _ in items]
        ids = [list(x) for _, x, _, _ in items]
        body = {"input_ids": ids[0], "rid": rids[0], "sampling_params": params[0]} if len(items) == 1 else \
            {"input_ids": ids, "rid": rids, "sampling_params": params}
        if session_params is not None:
            sp = dict(session_params, id=self.tag + session_params["id"])
            if "rid" in sp:
                sp["rid"] = self.tag + sp["rid"]
            body["session_params"] = sp
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

# -- vLLM 0.33.0 -----------------------------------------------------------------------------------------

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

    def flush_cache(self, timeout=0, label=""):
        """POST /reset_prefix_cache (VLLM_SERVER_DEV_MODE=1): {"success": false} while blocks are held."""
        return self.send(label or "reset_prefix_cache", "POST", "/reset_prefix_cache")

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

ENGINE_PARTS = {
    "sglang": {"imports": "", "consts": [], "api": SGLANG_API, "funcs": SGLANG_FUNCS, "url": "http://127.0.0.1:30000",
               "settle": 35.0, "init": "",
               "busy": ["sglang:num_running_reqs", "sglang:num_queue_reqs"], "settle_gauge": "sglang:kv_used_tokens",
               "settle_why": "SGLang refreshes its idle /metrics at most every 30 s",
               "metrics_hint": "launch the server with --enable-metrics",
               "server_keys": "SERVER_KEYS = ['enable_streaming_session', 'page_size', 'max_total_tokens', "
                              "'disable_overlap_schedule', 'chunked_prefill_size', 'enable_hisparse', "
                              "'disaggregation_mode']"},
    "vllm": {"imports": VLLM_IMPORTS, "api": VLLM_API, "funcs": VLLM_FUNCS, "url": "http://127.0.0.1:8000",
             "settle": 10.0, "init": "        self.streams, self.model = {}, args.model\n",
             "consts": ["LEASE_WAIT = 40.0  # s: NIXL's default kv_lease_duration (30 s) and a margin"],
             "busy": ["vllm:num_requests_running", "vllm:num_requests_waiting"],
             "settle_gauge": "vllm:kv_cache_usage_perc",
             "settle_why": "vLLM publishes the gauges after an engine step",
             "metrics_hint": "vLLM serves /metrics unless launched with --disable-log-stats",
             "server_keys": ""},
}


def _py(value) -> str:
    """A Python literal for JSON-like ``value`` (``None``/``True``/``False`` spelled as Python)."""
    return repr(value)


def _call_line(c: Call, plan: Plan) -> list[str]:
    ops = c.ops
    comment = [f"    # op {i}: {plan.op_lines[i]}" for i in ops]
    label = f"op {ops[0]}" if len(ops) == 1 else f"ops {ops[0]}-{ops[-1]}"
    a = c.args
    if c.kind == "generate" and plan.engine == "vllm":
        (it,) = a["items"]
        comment += [f"    # {it.rid}: {n}" for n in it.notes]
        return comment + [f"    c.submit({it.rid!r}, {it.input_ids!r}, {it.max_new_tokens}, {it.hold!r}, "
                          f"remote={it.remote!r}, label={label!r})"]
    if c.kind == "generate":
        items = a["items"]
        if len(items) > 1:
            comment.append(f"    # -> ONE batched /generate: the program delivers these {len(items)} submits at one "
                           "intake, so they reach the scheduler in one message and are admitted together")
        for it in items:
            comment += [f"    # {it.rid}: {n}" for n in it.notes]
        body = ",\n".join(f"        ({it.rid!r}, {it.input_ids!r}, {it.max_new_tokens}, {it.hold!r})" for it in items)
        return comment + [f"    c.generate([\n{body},\n    ], session_params={_py(a['session_params'])}, "
                          f"label={label!r})"]
    if c.kind == "open_session":
        return comment + [f"    c.open_session({a['session']!r}, streaming={a['streaming']!r}, timeout={a['timeout']!r}, "
                          f"label={label!r})"]
    if c.kind == "close_session":
        return comment + [f"    c.close_session({a['session']!r}, label={label!r})"]
    if c.kind == "abort":
        return comment + [f"    c.abort({a['rid']!r}, label={label!r})"]
    if c.kind == "flush_cache":
        return comment + [f"    c.flush_cache({a['timeout']}, label={label!r})"]
    if c.kind == "health":
        return comment + [f"    c.health(label={label!r})"]
    if c.kind == "pause":
        return comment + [f"    c.pause({a['mode']!r}, label={label!r})"]
    if c.kind == "continue":
        return comment + [f"    c.resume(label={label!r})"]
    if c.kind == "wait":
        note = [] if c.exact else ["    # (approximate: a client cannot run the scheduler step by step)"]
        return comment + note + [f"    c.wait({a['steps']}, label={label!r})"]
    if c.kind == "idle":
        return comment + [f"    c.idle(label={label!r})"]
    if c.kind == "ignored":
        return comment + [f"    # nothing to send: {c.note}",
                          f"    c.ignored({a['op']!r}, {c.note!r}, label={label!r})"]
    if c.kind == "no_api":
        return comment + [f"    # NOT FORCED BY A CLIENT: {c.note}",
                          f"    c.no_api({a['op']!r}, {c.note!r}, label={label!r})"]
    raise ValueError(f"unknown call kind {c.kind!r}")


def expected_line(kind: str, server: str, engine: str = "sglang") -> str:
    """What a maintainer should see, for the finding ``kind``, in one line."""
    pool = ("the pool does not come back (after closing every session and flushing, kv_available_tokens "
            "is below its value before the program, or kv_used_tokens > 0), or the server fails") \
        if engine == "sglang" else \
        ("the pool does not come back (with every stream ended and nothing running, kv_cache_usage_perc > 0 or "
         "/reset_prefix_cache answers success=false), or the server fails")
    return {"crash": "the server stops answering (the scheduler raised)",
            "hang": "a request never answers while the pool has room"}.get(kind, pool) + \
        (f" -- {server}" if server else "")


def render_client(plan: Plan, *, title: str, source: str, launch: str, kind: str, server: str,
                  env: list[str], hold_tokens: int = 256, planted: str | None = None,
                  pool_blocks: int | None = None, max_model_len: int | None = None,
                  release: str | None = None) -> str:
    """The script's text for ``plan`` (its engine: ``plan.engine``): ``title`` (the report's title),
    ``source`` (the replay file), ``launch`` (the server command), ``kind`` (the first finding's kind),
    ``server`` (what a server shows), ``env`` (environment variables the launch needs), ``planted`` (the
    injected fault's description when the finding is kvaudit's own planted fault, else None),
    ``pool_blocks`` (vLLM: the pool's usable blocks, for the usage gauge in blocks), ``max_model_len``
    (vLLM: tokens, prompt + output; a held request's output is cut to fit), ``release`` (the engine
    release that ships the bug, when it is not the one the routes were read on). Raises ``KeyError``
    for an engine with no HTTP table."""
    api = api_for(plan.engine)
    part = ENGINE_PARTS[plan.engine]
    expect = EXPECT_OF_KIND.get(kind, "memory")
    approx = plan.approximations
    how = "exactly" if plan.exact else "approximately (see the NOTE lines it prints)"
    expected = expected_line(kind, server, plan.engine)
    doc = [f'"""{title}', ""]
    if planted is not None:
        doc += ["PLANTED FAULT, NOT A BUG OF " + api.engine.upper() + ": kvaudit injected it into " + api.engine +
                "'s own objects", f"to test itself ({planted}).",
                f"An unmodified {api.engine} server does not have it: against one, this script should print",
                "RESULT: NOT REPRODUCED. It shows what `kvaudit export` makes of a finding.", ""]
    version = api.version if release is None else f"{release} (the release that ships the bug)"
    doc += [f"Reproduces kvaudit's finding in {source} against a real {api.engine} {version} server, "
            f"through its HTTP API only ({how}).", "",
            "1. Launch the server:", "", f"       {' '.join(env + [launch])}", "",
            f"2. Run:  python3 THIS_FILE --url {part['url']}", "",
            f"Expected: {expected}.",
            "Exit code: 1 the symptom was seen (REPRODUCED), 0 it was not, 2 no server or bad arguments.",
            "Standard library only; generated by `kvaudit export` (do not edit: regenerate).", '"""']
    consts = [f"EXPECT = {expect!r}", f"EXPECTED = {expected!r}", f"EXACT = {plan.exact!r}",
              f"HOLD_TOKENS = {hold_tokens}", f"OPEN_AT_END = {plan.open_at_end!r}",
              f"METRICS = {list(api.metrics)!r}", f"BUSY = {part['busy']!r}",
              f"SETTLE_GAUGE = {part['settle_gauge']!r}", f"SETTLE_WHY = {part['settle_why']!r}",
              f"SETTLE_S = {part['settle']!r}", f"METRICS_HINT = {part['metrics_hint']!r}",
              f"DEFAULT_URL = {part['url']!r}"]
    if part["server_keys"]:
        consts.append(part["server_keys"])
    consts += part["consts"]
    if pool_blocks is not None:
        consts.append(f"POOL_BLOCKS = {pool_blocks}")
    if max_model_len is not None:
        consts.append(f"MAX_MODEL_LEN = {max_model_len}")
    consts.append("APPROXIMATIONS = [" + "".join(f"\n    {a!r}," for a in approx) + ("\n]" if approx else "]"))
    body = ["", "", "def program(c):", '    """The program, one call per op (a batch for submits of one intake)."""']
    for call in plan.calls:
        body += _call_line(call, plan)
    if not plan.calls:
        body.append("    pass")
    core = CORE.replace("        self.lock = threading.Lock()\n",
                        "        self.lock = threading.Lock()\n" + part["init"])
    return ("#!/usr/bin/env python3\n" + "\n".join(doc) + "\n" + IMPORTS + part["imports"] + "\n\n" +
            "\n".join(consts) + "\n\n" + core + part["api"] + CORE_TAIL + "\n" + "\n".join(body) + "\n" +
            part["funcs"] + MAIN)


def curl_lines(plan: Plan, url: str = "http://127.0.0.1:30000") -> list[str]:
    """The plan as ``curl`` commands when a client runs it exactly with one call at a time: no held
    request and no wait before a later call; [] otherwise (the script is the reproducer then), and for
    vLLM (an abort is a closed stream, which a curl line does not show)."""
    if plan.engine != "sglang" or not plan.exact or any(c.kind in ("wait", "idle") for c in plan.calls[:-1]) or \
            any(c.kind in ("health", "no_api") for c in plan.calls):
        return []
    out = []
    for c in plan.calls:
        a = c.args
        if c.kind == "open_session":
            body = {"capacity_of_str_len": 1000, "session_id": a["session"], "streaming": a["streaming"]}
            out.append(f"curl -s {url}/open_session -H 'Content-Type: application/json' -d '{json.dumps(body)}'")
        elif c.kind == "generate":
            items = a["items"]
            params = [{"max_new_tokens": i.max_new_tokens, "temperature": 0.0, "ignore_eos": True} for i in items]
            body = {"input_ids": [i.input_ids for i in items], "rid": [i.rid for i in items],
                    "sampling_params": params} if len(items) > 1 else \
                {"input_ids": items[0].input_ids, "rid": items[0].rid, "sampling_params": params[0]}
            if a["session_params"] is not None:
                body["session_params"] = a["session_params"]
            out.append(f"curl -s {url}/generate -H 'Content-Type: application/json' -d '{json.dumps(body)}'")
        elif c.kind == "close_session":
            out.append(f"curl -s {url}/close_session -H 'Content-Type: application/json' "
                       f"-d '{json.dumps({'session_id': a['session']})}'")
        elif c.kind == "abort":
            body = {"abort_all": True} if a["rid"] is None else {"rid": a["rid"]}
            out.append(f"curl -s {url}/abort_request -H 'Content-Type: application/json' -d '{json.dumps(body)}'")
        elif c.kind == "flush_cache":
            out.append(f"curl -s -X POST '{url}/flush_cache?timeout={a['timeout']}'")
        elif c.kind == "pause":
            out.append(f"curl -s {url}/pause_generation -H 'Content-Type: application/json' "
                       f"-d '{json.dumps({'mode': a['mode']})}'")
        elif c.kind == "continue":
            out.append(f"curl -s {url}/continue_generation -H 'Content-Type: application/json' -d '{{}}'")
        elif c.kind in ("wait", "idle"):
            out.append(f"curl -s {url}/health   # then: is the server still up?")
    return out
