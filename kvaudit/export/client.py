"""``kvaudit export --client``: a standalone script (standard library only, no kvaudit import) that
drives a real SGLang server through its HTTP API in the program's order (:mod:`kvaudit.export.plan`)
and says what a maintainer should see: the crash (the server stops answering, or 5xx), the hang (a
request that never answers), or the pool counters of ``/metrics`` before and after.

The script's fixed part (:data:`RUNTIME`) is the same for every finding; what differs is a header
(launch command, expectations, the approximations) and one ``program(c)`` function with one call per
op or batch, each commented with the ops it stands for.
"""

from __future__ import annotations

import json

from kvaudit.export.http_api import api_for
from kvaudit.export.plan import Call, Plan

EXPECT_OF_KIND = {"crash": "crash", "hang": "hang"}  # any other kind: pool counters ("memory")

RUNTIME = r'''
import argparse
import json
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid


class Client:
    """A thin HTTP client that records every answer: ``failures`` (no answer, connection lost, 5xx)."""

    def __init__(self, url, timeout, step_delay, gap, hold_tokens, metrics_url=None, settle=35.0):
        self.url = url.rstrip("/")
        self.settle_s = settle
        self.metrics_url = (metrics_url or url).rstrip("/")
        self.timeout, self.step_delay, self.gap, self.hold_tokens = timeout, step_delay, gap, hold_tokens
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

    def wait(self, steps, label=""):
        """A client cannot run n scheduler iterations: it waits --step-delay seconds a step."""
        self.say("   %s: wait %.2f s (stands for %d scheduler step(s))" % (label or "step", steps * self.step_delay,
                                                                         steps))
        time.sleep(steps * self.step_delay)

    def no_api(self, what, how, label=""):
        self.say("   %s: %s has no HTTP call: %s" % (label, what, how))

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
            if c is None or (c.get("sglang:num_running_reqs", 0) + c.get("sglang:num_queue_reqs", 0)) == 0:
                break
            time.sleep(0.2)
        return hung

    def counters(self):
        """The pool gauges of /metrics (summed over labels), or None without --enable-metrics."""
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
        """The gauges once the pool is at rest: SGLang refreshes its idle /metrics at most every 30 s, so
        poll (up to --settle seconds) until no KV is in use."""
        deadline = time.time() + self.settle_s
        c = self.counters()
        while c is not None and c.get("sglang:kv_used_tokens", 0) > 0 and time.time() < deadline:
            time.sleep(1.0)
            c = self.counters()
        return c

    def alive(self):
        status, _ = self.request("GET", "/health", timeout=min(self.timeout, 10.0))
        return status == 200


def show(title, counters):
    if counters is None:
        print("%s: /metrics unavailable (launch the server with --enable-metrics)" % title)
    else:
        print("%s: %s" % (title, " ".join("%s=%g" % (k.split(":", 1)[1], counters[k]) for k in METRICS
                                           if k in counters)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:30000", help="the server (default: %(default)s)")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for any answer (default: 60)")
    ap.add_argument("--step-delay", type=float, default=0.5,
                    help="seconds that stand for one scheduler step of the program (default: 0.5)")
    ap.add_argument("--gap", type=float, default=0.05,
                    help="seconds between two calls, so they arrive in the program's order (default: 0.05)")
    ap.add_argument("--hold-tokens", type=int, default=HOLD_TOKENS,
                    help="extra output tokens for a request that must still run when a later call arrives "
                         "(default: %(default)s)")
    ap.add_argument("--metrics-url", default=None,
                    help="where to read /metrics (default: --url; behind a PD router: the decode server)")
    ap.add_argument("--settle", type=float, default=35.0,
                    help="seconds to wait for the idle /metrics to refresh after a flush (default: 35)")
    args = ap.parse_args(argv)
    if args.timeout <= 0 or min(args.step_delay, args.gap, args.hold_tokens, args.settle) < 0:
        print("error: --timeout must be > 0 and the other numbers >= 0", file=sys.stderr)
        return 2
    c = Client(args.url, args.timeout, args.step_delay, args.gap, args.hold_tokens, args.metrics_url, args.settle)
    if not c.alive():
        print("error: no server answers GET %s/health (launch it first: see the top of this file)" % c.url,
              file=sys.stderr)
        return 2
    status, text = c.request("GET", "/server_info")
    if status == 200:
        try:
            info = json.loads(text)
            print("server: version=%s %s" % (info.get("version"), " ".join(
                "%s=%s" % (k, info.get(k)) for k in SERVER_KEYS if k in info)))
        except ValueError:
            pass
    for line in APPROXIMATIONS:
        print("NOTE (approximation): " + line)
    c.flush_cache(label="flush_cache (before: a full pool to compare with)")
    before = c.settle()
    show("counters before", before)
    program(c)
    hung = c.idle(label="end of program")
    during = c.counters()
    show("counters after the program", during)
    for name in OPEN_AT_END:
        c.close_session(name, label="cleanup: close_session " + name)
    hung += c.idle(label="cleanup")
    flushed = c.flush_cache(label="cleanup: flush_cache")
    after = c.settle()
    show("counters after closing the sessions and flushing", after)
    up = c.alive()
    print("EXPECTED: " + EXPECTED)
    seen = []
    if not up:
        seen.append("the server no longer answers GET /health")
    seen += ["call failed: " + f for f in c.failures]
    if hung:
        seen.append("no answer from: " + ", ".join(hung))
    if before is not None and after is not None and up:
        lost = before.get("sglang:kv_available_tokens", 0) - after.get("sglang:kv_available_tokens", 0)
        if lost > 0:
            seen.append("kv_available_tokens is %g below its value before the program" % lost)
        if after.get("sglang:kv_used_tokens", 0) > 0:
            seen.append("kv_used_tokens=%g with no request and no session" % after["sglang:kv_used_tokens"])
    if flushed is not None and flushed[0] != 200 and up:
        seen.append("flush_cache refused with nothing running: %s" % flushed[1].strip()[:120])
    print("OBSERVED: " + ("; ".join(seen) if seen else "nothing abnormal"))
    reproduced = bool(seen) if EXPECT != "hang" else bool(hung)
    print("RESULT: " + ("REPRODUCED" if reproduced else "NOT REPRODUCED") +
          ("" if reproduced or EXACT else " (this script only approximates the program: see the NOTE lines; "
                                         "try a smaller --step-delay or larger --hold-tokens)"))
    return 1 if reproduced else 0


if __name__ == "__main__":
    sys.exit(main())
'''


def _py(value) -> str:
    """A Python literal for JSON-like ``value`` (``None``/``True``/``False`` spelled as Python)."""
    return repr(value)


def _call_line(c: Call, plan: Plan) -> list[str]:
    ops = c.ops
    comment = [f"    # op {i}: {plan.op_lines[i]}" for i in ops]
    label = f"op {ops[0]}" if len(ops) == 1 else f"ops {ops[0]}-{ops[-1]}"
    a = c.args
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
    if c.kind == "no_api":
        return comment + [f"    # NOT FORCED BY A CLIENT: {c.note}",
                          f"    c.no_api({a['op']!r}, {c.note!r}, label={label!r})"]
    raise ValueError(f"unknown call kind {c.kind!r}")


def expected_line(kind: str, server: str) -> str:
    """What a maintainer should see, for the finding ``kind``, in one line."""
    return {"crash": "the server stops answering (the scheduler raised)",
            "hang": "a request never answers while the pool has room"}.get(
        kind, "the pool does not come back (after closing every session and flushing, kv_available_tokens "
              "is below its value before the program, or kv_used_tokens > 0), or the server fails") + (f" -- {server}" if server else "")


def render_client(plan: Plan, *, title: str, source: str, launch: str, kind: str, server: str,
                  env: list[str], hold_tokens: int = 256) -> str:
    """The script's text for ``plan``: ``title`` (the report's title), ``source`` (the replay file),
    ``launch`` (the server command), ``kind`` (the first finding's kind), ``server`` (what a server
    shows), ``env`` (environment variables the launch needs)."""
    api = api_for("sglang")
    expect = EXPECT_OF_KIND.get(kind, "memory")
    approx = plan.approximations
    how = "exactly" if plan.exact else "approximately (see the NOTE lines it prints)"
    doc = [f'"""{title}', "",
           f"Reproduces kvaudit's finding in {source} against a real {api.engine} {api.version} server, "
           f"through its HTTP API only ({how}).", "",
           "1. Launch the server:", "", f"       {' '.join(env + [launch])}", "",
           "2. Run:  python3 THIS_FILE --url http://127.0.0.1:30000", "",
           f"Expected: {expected_line(kind, server)}.",
           "Exit code: 1 the symptom was seen (REPRODUCED), 0 it was not, 2 no server or bad arguments.",
           "Standard library only; generated by `kvaudit export` (do not edit: regenerate).", '"""']
    consts = [f"EXPECT = {expect!r}", f"EXPECTED = {expected_line(kind, server)!r}", f"EXACT = {plan.exact!r}",
              f"HOLD_TOKENS = {hold_tokens}", f"OPEN_AT_END = {plan.open_at_end!r}",
              f"METRICS = {list(api.metrics)!r}",
              "SERVER_KEYS = ['enable_streaming_session', 'page_size', 'max_total_tokens', 'disable_overlap_schedule', "
              "'chunked_prefill_size', 'enable_hisparse', 'disaggregation_mode']",
              "APPROXIMATIONS = [" + "".join(f"\n    {a!r}," for a in approx) + ("\n]" if approx else "]")]
    body = ["", "", "def program(c):", '    """The program, one call per op (a batch for submits of one intake)."""']
    for call in plan.calls:
        body += _call_line(call, plan)
    if not plan.calls:
        body.append("    pass")
    return _assemble(doc, consts, body)


def _assemble(doc: list[str], consts: list[str], body: list[str]) -> str:
    head, tail = RUNTIME.split("\n\nclass Client:", 1)
    main_at = tail.index("\n\ndef show(")
    return ("#!/usr/bin/env python3\n" + "\n".join(doc) + "\n" + head + "\n\n" + "\n".join(consts) +
            "\n\n\nclass Client:" + tail[:main_at] + "\n" + "\n".join(body) + "\n" + tail[main_at:])


def curl_lines(plan: Plan, url: str = "http://127.0.0.1:30000") -> list[str]:
    """The plan as ``curl`` commands when a client runs it exactly with one call at a time: no held
    request and no wait before a later call; [] otherwise (the script is the reproducer then)."""
    if not plan.exact or any(c.kind in ("wait", "idle") for c in plan.calls[:-1]) or \
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
