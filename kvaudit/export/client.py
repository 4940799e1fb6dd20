"""``kvaudit export --client``: a standalone script (standard library only, no kvaudit import) that
drives a real server through its HTTP API in the program's order (:mod:`kvaudit.export.plan`) and
says what a maintainer should see: the crash (the server stops answering, or 5xx), the hang (a
request that never answers), or the pool gauges of ``/metrics`` before and after.

The script is assembled from parts: the shared runtime (:data:`CORE`: the HTTP client that records
every answer, waits, the ``/metrics`` reader, :data:`MAIN`: the run and its verdict) and one part per
engine, which its target kind hands over (:class:`kvaudit.targets.export_api.ClientParts`: the API
methods of ``Client`` for that engine's routes, its extra arguments, the server line and the pool
check). What differs per finding is a header (launch
command, expectations, the approximations) and one ``program(c)`` function with one call per op or
batch, each commented with the ops it stands for (the engines: :func:`kvaudit.export.http_api.apis`).
"""

from __future__ import annotations

from kvaudit.export.http_api import export_for
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

def _py(value) -> str:
    """A Python literal for JSON-like ``value`` (``None``/``True``/``False`` spelled as Python)."""
    return repr(value)


def _call_line(c: Call, plan: Plan) -> list[str]:
    ops = c.ops
    comment = [f"    # op {i}: {plan.op_lines[i]}" for i in ops]
    label = f"op {ops[0]}" if len(ops) == 1 else f"ops {ops[0]}-{ops[-1]}"
    a = c.args
    if c.kind == "generate" and not export_for(plan.engine).batch_submits:  # one streaming request per submit
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


def expected_line(kind: str, server: str, engine: str) -> str:
    """What a maintainer should see, for the finding ``kind`` on ``engine`` (a kind's name), in one line.
    Raises ``KeyError`` for an engine with no HTTP table."""
    pool = export_for(engine).expected_pool
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
    ex = export_for(plan.engine)
    api, part = ex.api, ex.client
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
            f"2. Run:  python3 THIS_FILE --url {part.url}", "",
            f"Expected: {expected}.",
            "Exit code: 1 the symptom was seen (REPRODUCED), 0 it was not, 2 no server or bad arguments.",
            "Standard library only; generated by `kvaudit export` (do not edit: regenerate).", '"""']
    consts = [f"EXPECT = {expect!r}", f"EXPECTED = {expected!r}", f"EXACT = {plan.exact!r}",
              f"HOLD_TOKENS = {hold_tokens}", f"OPEN_AT_END = {plan.open_at_end!r}",
              f"METRICS = {list(api.metrics)!r}", f"BUSY = {list(part.busy)!r}",
              f"SETTLE_GAUGE = {part.settle_gauge!r}", f"SETTLE_WHY = {part.settle_why!r}",
              f"SETTLE_S = {part.settle!r}", f"METRICS_HINT = {part.metrics_hint!r}",
              f"DEFAULT_URL = {part.url!r}"]
    if part.server_keys:
        consts.append(part.server_keys)
    consts += list(part.consts)
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
                        "        self.lock = threading.Lock()\n" + part.init)
    return ("#!/usr/bin/env python3\n" + "\n".join(doc) + "\n" + IMPORTS + part.imports + "\n\n" +
            "\n".join(consts) + "\n\n" + core + part.api + CORE_TAIL + "\n" + "\n".join(body) + "\n" +
            part.funcs + MAIN)


def curl_lines(plan: Plan, url: str | None = None) -> list[str]:
    """The plan as ``curl`` commands (against ``url``, default the engine's) when a client runs it exactly
    with one call at a time: no held request and no wait before a later call; [] otherwise (the script
    is the reproducer then), and for an engine whose kind gives no curl lines (vLLM's: an abort is a
    closed stream, which a curl line does not show)."""
    ex = export_for(plan.engine)
    if ex.curl is None or not plan.exact or any(c.kind in ("wait", "idle") for c in plan.calls[:-1]) or \
            any(c.kind in ("health", "no_api") for c in plan.calls):
        return []
    return ex.curl(plan, url or ex.client.url)
