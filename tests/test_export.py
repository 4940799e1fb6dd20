"""kvaudit export (issue 23): every corpora/sglang/*.json exports an issue report and a client script
(in-process, once per session, into a temporary directory: the exports are generated, not committed);
each script, run as a subprocess against a small stand-in HTTP server that records every request, sends
the program's calls in order, batched as the program delivers them, with its parameters. One export is
kept as the golden one (tests/data/export/sglang/): the tests that need no SGLang run its script, and
a test checks that ``kvaudit export`` still writes it byte for byte."""

import glob
import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from cli_helpers import export_all, export_edited, invoke, one_error_line
from kvaudit import replay
from kvaudit.export.http_api import apis
from kvaudit.export.issue import SECTIONS
from kvaudit.program.schema import pick, prompt_tokens

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = sorted(glob.glob(os.path.join(ROOT, "corpora", "sglang", "*.json")))
NAMES = [os.path.basename(f)[:-5] for f in FILES]
GOLDEN_NAME = "crash-take-rejected-turn-in-first-batch"
GOLDEN = os.path.join(ROOT, "tests", "data", "export", "sglang", GOLDEN_NAME)  # + .issue.md / .client.py
PER_TOKEN = 0.01  # seconds the stand-in takes per output token of a /generate
# leaks in a pool /metrics does not report: their scripts end NOT CHECKED (exit 3) against a healthy server
UNSEEN_LEAKS = ("leak-a3-hisparse-buffer-padded-at-finish", "leak-a3b-hisparse-buffer-padded-at-finish-released")
HOLD = 30  # --hold-tokens in these runs: a held request lasts ~0.3 s on the stand-in


def _die(server) -> None:
    """Stop ``server`` as a crashed process stops: no more answers, and new connections refused."""
    server.shutdown()
    server.server_close()


class StandIn:
    """An HTTP server that answers SGLang's endpoints and records each request: ``(seq, method, path,
    body, t_arrived, t_answered)``. A /generate answers after PER_TOKEN s per output token (the largest
    of its items), like a server decoding; /metrics reports a full, idle pool (less ``leak`` tokens once a
    /generate came)."""

    def __init__(self):
        self.log, self.lock = [], threading.Lock()
        self.leak = 0  # tokens /metrics shows in use for ever once a /generate came (a leaking server)
        stand = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _serve(self, method):
                n = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(n) if n else b""
                body = json.loads(raw) if raw else None
                with stand.lock:
                    rec = [len(stand.log), method, self.path, body, time.monotonic(), None]
                    stand.log.append(rec)
                status, ctype, out = 200, "application/json", b"{}"
                path = self.path.split("?")[0]
                if path == "/generate":
                    params = body["sampling_params"]
                    params = params if isinstance(params, list) else [params]
                    time.sleep(PER_TOKEN * max(p["max_new_tokens"] for p in params))
                    rids = body["rid"] if isinstance(body["rid"], list) else [body["rid"]]
                    docs = [{"text": "", "meta_info": {"id": r, "finish_reason": {"type": "length"}}} for r in rids]
                    out = json.dumps(docs if isinstance(body["rid"], list) else docs[0]).encode()
                elif path == "/open_session":
                    out = json.dumps(body["session_id"]).encode()
                elif path == "/metrics":
                    ctype = "text/plain"
                    lost = stand.leak if any(r[2] == "/generate" for r in stand.log) else 0
                    out = (f"# HELP x\nsglang:kv_available_tokens{{tp_rank=\"0\"}} {512 - lost}.0\n"
                           f"sglang:kv_used_tokens{{tp_rank=\"0\"}} {lost}.0\nsglang:num_running_reqs 0.0\n"
                           "sglang:num_queue_reqs 0.0\n").encode()
                elif path == "/server_info":
                    out = json.dumps({"version": "0.5.23", "enable_streaming_session": True}).encode()
                elif path == "/flush_cache":
                    ctype, out = "text/plain", b"Cache flushed.\n"
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)
                rec[5] = time.monotonic()

            def do_GET(self):
                self._serve("GET")

            def do_POST(self):
                self._serve("POST")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="session")
def exported(tmp_path_factory):
    """Every corpora/sglang/*.json exported once (resolved on SGLang: use it from tests marked ``sglang``):
    name -> the path of its export less the suffix (``+ ".issue.md"``, ``+ ".client.py"``)."""
    return export_all(FILES, os.path.join(ROOT, "corpora", "sglang"), tmp_path_factory.mktemp("sglang-exports"))


@pytest.fixture
def stand_in():
    s = StandIn()
    yield s
    s.close()


def run_client(script, url, *extra):
    return subprocess.run([sys.executable, script, "--url", url, "--step-delay", "0.05", "--gap", "0.05",
                           "--hold-tokens", str(HOLD), "--timeout", "20", *extra],
                          capture_output=True, text=True, timeout=120)


def step_delay_for(name) -> float:
    """--step-delay for ``name``'s client: 0.05 s, or, where a ``step(n)`` of the program waits longer than a held
    request lasts on the stand-in (HOLD tokens more, PER_TOKEN each; finding 15's step(28), its 24-step transfers),
    short enough that the longest wait is half of that: a hold is capped by the context, so it cannot grow instead."""
    _, program, _, _ = replay.load(os.path.join(ROOT, "corpora", "sglang", name + ".json"))
    steps = max((op.n for op in program if op.kind == "step"), default=0)
    return 0.05 if steps * 0.05 <= HOLD * PER_TOKEN else HOLD * PER_TOKEN / (2 * steps)


def program_calls(log):
    """The recorded requests between the script's first flush (its baseline) and its last (cleanup),
    less its polling of /metrics and /health: the program's calls, then the cleanup's session closes."""
    flushes = [r[0] for r in log if r[2].startswith("/flush_cache")]
    return [r for r in log if flushes[0] < r[0] < flushes[-1] and r[2] not in ("/metrics", "/health")]


def expected_calls(path):
    """The calls the program asks for, worked out here from the replay file's program alone (not from
    kvaudit.export): (path, fields) per call; consecutive submits of one intake with one session are one
    /generate whose fields list every request."""
    config, program, findings, _ = replay.load(path)
    if findings and findings[0].kind == "crash":  # nothing runs after the op the engine raised at
        program = program[:findings[0].op_index + 1]
    out, sessions, opened, last = [], [], 0, None
    for op in program:
        if op.kind == "submit":
            sid = pick(op.session, sessions)
            ids = prompt_tokens(op.family, max(1, min(op.prompt_len, config.context_len // 2)), config.vocab_size)
            max_new = max(1, min(op.max_new_tokens, config.context_len // 4))
            if op.stop_at is not None:
                max_new = min(max_new, op.stop_at)
            key = (sid, bool(op.replace), op.offset, bool(op.drop_previous_output), op.parent)
            if last is not None and last[0] == key:
                last[1]["items"].append((ids, max_new))
            else:
                last = (key, {"session": sid, "replace": bool(op.replace), "items": [(ids, max_new)]})
                out.append(("/generate", last[1]))
            continue
        last = None
        if op.kind == "open_session":
            sid = f"s{opened}"
            opened += 1
            sessions.append(sid)
            out.append(("/open_session", {"session": sid, "streaming": config.session_streaming}))
        elif op.kind == "close_session":
            out.append(("/close_session", {"session": sessions.pop(op.handle % len(sessions))}))
        elif op.kind == "abort":
            out.append(("/abort_request", {"all": op.handle is None}))
        elif op.kind == "flush_cache":
            out.append(("/flush_cache", {}))
        elif op.kind == "health_check":
            out.append(("/health_generate", {}))
        elif op.kind == "pause_generation":
            out.append(("/pause_generation", {}))
        elif op.kind == "continue_generation":
            out.append(("/continue_generation", {}))
    return out


@pytest.mark.sglang
@pytest.mark.parametrize("name", NAMES)
def test_each_finding_exports_its_report_and_client(name, exported):
    base = exported[name]
    issue = open(base + ".issue.md").read()
    for section in SECTIONS:
        assert f"\n{section}\n" in issue, f"{name}.issue.md lacks {section}"
    assert issue.startswith("# ") and "python -m sglang.launch_server" in issue
    assert f"python3 {name}.client.py --url" in issue
    client = open(base + ".client.py").read()
    assert "import kvaudit" not in client and "from kvaudit" not in client
    assert compile(client, name, "exec")


@pytest.mark.sglang
@pytest.mark.parametrize("name", NAMES)
def test_a_client_sends_the_program_in_order_batched_with_its_parameters(name, stand_in, exported):
    base = exported[name]
    done = run_client(base + ".client.py", stand_in.url, "--step-delay", str(step_delay_for(name)))
    if name in UNSEEN_LEAKS:  # a leak in a pool /metrics does not report: not judged (the next test)
        assert done.returncode == 3 and "RESULT: NOT CHECKED" in done.stdout, done.stdout + done.stderr
    else:
        assert done.returncode == 0, done.stdout + done.stderr  # a healthy stand-in: nothing reproduced
        assert "RESULT: NOT REPRODUCED" in done.stdout
    recorded = program_calls(stand_in.log)
    want = expected_calls(os.path.join(ROOT, "corpora", "sglang", name + ".json"))
    calls, cleanup = recorded[:len(want)], recorded[len(want):]
    assert [c[2].split("?")[0] for c in calls] == [w[0] for w in want]
    assert all(c[2] == "/close_session" for c in cleanup)  # the script closes what the program left open
    tag = None
    opened = {}
    rids = []
    for (seq, method, path, body, t0, t1), (wpath, w) in zip(calls, want):
        if wpath == "/open_session":
            assert body["streaming"] == w["streaming"] and body["capacity_of_str_len"] > 0
            tag = tag or body["session_id"][:-len(w["session"])]
            assert body["session_id"] == tag + w["session"]
            opened[w["session"]] = body["session_id"]
        elif wpath == "/close_session":
            assert body == {"session_id": opened[w["session"]]}
        elif wpath == "/generate":
            items = w["items"]
            batched = isinstance(body["input_ids"][0], list)
            assert batched == (len(items) > 1)
            ids = body["input_ids"] if batched else [body["input_ids"]]
            params = body["sampling_params"] if batched else [body["sampling_params"]]
            assert ids == [i for i, _ in items]
            for p, (_, m) in zip(params, items):  # the program's length, or that plus the hold
                assert p["max_new_tokens"] in (m, m + HOLD) and p["temperature"] == 0 and p["ignore_eos"] is True
            got = body["rid"] if batched else [body["rid"]]
            assert len(set(got)) == len(got) and not set(got) & set(rids)
            rids += got
            sp = body.get("session_params")
            assert (sp is None) == (w["session"] is None)
            if sp is not None:
                assert sp["id"] == opened[w["session"]] and bool(sp.get("replace")) == w["replace"]
        elif wpath == "/abort_request":
            assert ("abort_all" in body) == w["all"]
            assert w["all"] or body["rid"] in rids  # names a request sent before it
    # a request held so that a later message finds it running is still being answered when it arrives
    for k, (seq, method, path, body, t0, t1) in enumerate(calls):
        if path != "/generate":
            continue
        params = body["sampling_params"] if isinstance(body["sampling_params"], list) else [body["sampling_params"]]
        later = [c for c in calls[k + 1:] if c[2] != "/generate" or c[4] > t0]
        if any(p["max_new_tokens"] > HOLD for p in params) and later:
            assert later[0][4] < t1, f"{name}: the held request answered before the next call arrived"


def test_the_take_crash_is_one_batched_generate_of_two_turns_of_one_streaming_session(stand_in):
    base = GOLDEN
    assert run_client(base + ".client.py", stand_in.url).returncode == 0
    calls = program_calls(stand_in.log)
    assert [c[2] for c in calls] == ["/open_session", "/generate", "/close_session"]  # (the cleanup closes s0)
    sid = calls[0][3]["session_id"]
    assert calls[0][3]["streaming"] is True
    gen = calls[1][3]
    assert gen["input_ids"] == [[7], [7]] and gen["session_params"] == {"id": sid}
    assert [p["max_new_tokens"] for p in gen["sampling_params"]] == [1, 1]
    issue = open(base + ".issue.md").read()
    assert "--enable-streaming-session" in issue and "StreamingSession.take" in issue.splitlines()[0]
    assert "sglang/srt/session/streaming_session.py:215 in take" in issue
    assert "reproduces the program exactly" in issue
    curl = [line for line in issue.splitlines() if line.startswith("curl -s") and "/generate" in line]
    assert len(curl) == 1 and '"input_ids": [[7], [7]]' in curl[0] and '"session_params": {"id": "s0"}' in curl[0]


@pytest.mark.sglang
def test_the_abort_names_the_turn_the_program_aborts(stand_in, exported):
    """abort(handle=0) picks the first live request: turn 1 (r0), not the rejected turn 2 (resolved on the
    target; a static count would have named the same here, so also check the text says which)."""
    base = exported["crash-a1-checkpoint-into-tree-after-abort"]
    assert run_client(base + ".client.py", stand_in.url).returncode == 0
    calls = program_calls(stand_in.log)
    first_turn = next(c for c in calls if c[2] == "/generate")[3]["rid"]
    abort = next(c for c in calls if c[2] == "/abort_request")[3]
    assert abort == {"rid": first_turn}


@pytest.mark.parametrize("name", UNSEEN_LEAKS)
def test_a_leak_in_a_pool_metrics_does_not_report_is_not_checked(stand_in, name, tmp_path):
    """The tester's HiSparse leak: its script printed `nothing abnormal`, NOT REPRODUCED, exit 0, against a
    healthy stand-in, although the slot it loses is in HiSparse's device buffer, which /metrics does not report.
    Now NOT CHECKED, exit 3, with a NOTE naming the pool and what to do instead; the issue says so."""
    src = os.path.join(ROOT, "corpora", "sglang", name + ".json")
    script, issue = tmp_path / "a3.py", tmp_path / "a3.md"
    assert invoke("export", src, "--issue", str(issue), "--client", str(script), "--no-resolve").exit_code == 0
    done = run_client(str(script), stand_in.url, "--settle", "1")
    assert done.returncode == 3, done.stdout[-3000:] + done.stderr
    assert "RESULT: NOT CHECKED" in done.stdout and "REPRODUCED" not in done.stdout.split("RESULT:")[1]
    assert "NOTE: the finding's pool is not in /metrics: HiSparse's device buffer slots (hisparse_device_pool)" \
        in done.stdout and "kvaudit replay" in done.stdout
    text = issue.read_text()
    assert "which this script cannot see" in text and "`NOT CHECKED` (exit 3)" in text
    assert "NOT REPRODUCED" not in text.split("## Reproduce with a client")[1].split("## kvaudit report")[0]
    assert "(any model;" not in text and "(a DSA model, as said above;" in text


def test_a_fresh_hisparse_finding_without_a_note_is_not_checked_either(tmp_path):
    """A HiSparse leak kvaudit finds anew has no note: its Expected line was the generic kv_available_tokens
    one, which cannot show a hisparse_device_pool leak."""
    src = os.path.join(ROOT, "corpora", "sglang", UNSEEN_LEAKS[0] + ".json")
    doc = json.load(open(src))
    for f in doc["findings"]:
        f["signature"] = "leak/hisparse_device_pool/a-site-no-note-names"
    fresh = tmp_path / "fresh.json"
    fresh.write_text(json.dumps(doc))
    assert invoke("export", str(fresh), "--issue", str(tmp_path / "f.md"), "--client", str(tmp_path / "f.py"),
                  "--no-resolve").exit_code == 0
    for out in ("f.md", "f.py"):
        text = (tmp_path / out).read_text()
        assert "kv_available_tokens is below" not in text and "hisparse_device_pool" in text, out
        assert "NOT CHECKED (exit 3)" in text, out


def test_a_clients_help_gives_the_launch_the_results_and_the_exit_codes():
    """`--help` showed the options alone: the launch line, the RESULT lines and exit codes were only in the
    docstring; --settle's default did not say why it is 35 s on SGLang (10 s on vLLM)."""
    done = subprocess.run([sys.executable, GOLDEN + ".client.py", "--help"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    for want in ("python -m sglang.launch_server", "REPRODUCED      exit 1", "NOT REPRODUCED  exit 0",
                 "NOT CHECKED     exit 3", "exit 2", "refreshes its idle /metrics at most every 30 s"):
        assert want in " ".join(done.stdout.split()) or want in done.stdout, want


def test_a_client_says_reproduced_when_the_server_stops_answering(stand_in, tmp_path):
    """The crash case: a server that dies at the batched /generate is reported, exit 1."""
    base = GOLDEN
    original = stand_in.server.RequestHandlerClass._serve

    def dying(self, method):
        if self.path == "/generate":
            # a dead server refuses connections (its listening socket is closed too): a socket left
            # listening made every later request wait out the client's --timeout (21 s in all)
            threading.Thread(target=_die, args=(stand_in.server,), daemon=True).start()
            self.connection.close()
            return
        original(self, method)

    stand_in.server.RequestHandlerClass._serve = dying
    done = run_client(base + ".client.py", stand_in.url, "--timeout", "3")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "RESULT: REPRODUCED" in done.stdout and "no longer answers" in done.stdout


def _answering(stand_in, answer):
    """Make the stand-in answer ``answer(self, method, path)`` (True: it answered) before its own handling."""
    original = stand_in.server.RequestHandlerClass._serve

    def serve(self, method):
        if not answer(self, method, self.path.split("?")[0]):
            original(self, method)

    stand_in.server.RequestHandlerClass._serve = serve


def _reply(handler, status: int, body: str) -> bool:
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body.encode())
    return True


@pytest.mark.parametrize("case", ["501 to every POST", "400 to the program's calls", "slower than --timeout",
                                  "no /metrics"])
def test_a_client_whose_calls_were_not_served_says_not_checked(stand_in, case, tmp_path):
    """The tester's stand-ins: a server that answers /health but 501 to every POST made the client say
    REPRODUCED (a 5xx was a failure); one launched without streaming sessions (SGLang's 400 on /open_session and
    /generate) NOT REPRODUCED; a /generate slower than --timeout, with /health still answering, REPRODUCED. The
    program did not run as written in any of them: RESULT: NOT CHECKED, exit 3, the refusals named. A memory
    finding's script against a server whose /metrics does not answer said NOT REPRODUCED without comparing the
    pool (the second tester): NOT CHECKED too."""
    if case == "501 to every POST":
        _answering(stand_in, lambda h, method, path: method == "POST" and _reply(h, 501, '{"detail": "no"}'))
    elif case == "400 to the program's calls":
        _answering(stand_in, lambda h, method, path: path in ("/generate", "/open_session") and _reply(
            h, 400, '{"error": {"message": "session is not enabled"}}'))
    elif case == "no /metrics":  # (a memory finding's script: the leak is judged from the pool gauges alone)
        _answering(stand_in, lambda h, method, path: path == "/metrics" and _reply(h, 404, '{"detail": "no"}'))
    else:
        _answering(stand_in, lambda h, method, path: path == "/generate" and time.sleep(3))
    script = GOLDEN + ".client.py"
    if case == "no /metrics":
        script = str(tmp_path / "leak.client.py")
        src = os.path.join(ROOT, "corpora", "sglang", "uaf-deferred-close-after-rejected-turn.json")
        assert invoke("export", src, "--client", script, "--no-resolve").exit_code == 0
    done = run_client(script, stand_in.url, "--timeout", "1.5", "--settle", "0")
    assert done.returncode == 3, done.stdout[-3000:] + done.stderr
    assert "RESULT: NOT CHECKED" in done.stdout and "REPRODUCED" not in done.stdout.split("RESULT:")[1]
    if case == "slower than --timeout":
        assert "still answers GET /health" in done.stdout
    elif case == "no /metrics":
        assert "/metrics did not answer, so the pool was not compared" in done.stdout
    else:
        assert "NOTE: the server refused" in done.stdout and ("HTTP 501" if "501" in case else "HTTP 400") in done.stdout


def test_a_client_given_an_empty_url_is_one_line_exit_2():
    done = subprocess.run([sys.executable, GOLDEN + ".client.py", "--url", ""], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr, \
        done.stderr


def test_the_issue_names_the_replay_file_without_local_directories(tmp_path, monkeypatch):
    """`kvaudit export /abs/path/corpora/...` put the exporter's own directories in the issue text, which goes
    to a public tracker: below the current directory the path is relative, elsewhere the file's name."""
    src = os.path.join(ROOT, "corpora", "sglang", GOLDEN_NAME + ".json")
    for cwd, shown in ((ROOT, f"corpora/sglang/{GOLDEN_NAME}.json"), (tmp_path, f"{GOLDEN_NAME}.json")):
        monkeypatch.chdir(cwd)
        r = invoke("export", src, "--issue", str(tmp_path / "i.md"), "--no-resolve")
        assert r.exit_code == 0, r.output
        issue = (tmp_path / "i.md").read_text()
        assert f"kvaudit replay {shown}`" in issue and str(tmp_path) not in issue and ROOT not in issue


def test_a_client_without_a_server_is_one_line_exit_2(tmp_path):
    base = GOLDEN
    for args in (["--url", "http://127.0.0.1:9", "--timeout", "2"], ["--url", "notaurl"],
                 ["--metrics-url", "localhost:30000"]):  # not URLs: exit 1 (REPRODUCED) with a traceback before
        done = subprocess.run([sys.executable, base + ".client.py", *args], capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr


@pytest.mark.sglang
def test_the_golden_export_is_what_export_writes_today(exported):
    """The one committed export (tests/data/export/sglang/) is byte for byte what ``kvaudit export`` writes
    (the other files' exports are checked by what their scripts send, above)."""
    base = exported[GOLDEN_NAME]
    assert open(base + ".issue.md").read() == open(GOLDEN + ".issue.md").read(), \
        f"regenerate: kvaudit export corpora/sglang/{GOLDEN_NAME}.json --issue {GOLDEN}.issue.md --client ..."
    assert open(base + ".client.py").read() == open(GOLDEN + ".client.py").read()


def test_export_bad_input_is_one_line_exit_2(tmp_path):
    good = FILES[0]
    cases = [
        ("export", str(tmp_path / "missing.json"), "--issue", str(tmp_path / "o.md")),
        ("export", good),  # nothing asked for
        ("export", good, "--issue", good),  # would overwrite the input
        ("export", good, "--client", str(tmp_path)),  # a directory
        ("export", good, "--bogus", "x"),
        ("export", os.path.join(ROOT, "corpora", "regressions", sorted(os.listdir(
            os.path.join(ROOT, "corpora", "regressions")))[0]), "--issue", str(tmp_path / "o.md")),  # not SGLang
    ]
    (tmp_path / "bad.json").write_text("{not json")
    cases.append(("export", str(tmp_path / "bad.json"), "--client", str(tmp_path / "o.py")))
    for args in cases:
        r = invoke(*args)
        assert r.exit_code == 2, (args, r.output)
        line = one_error_line(r)
        if "regressions" in args[1]:  # the built-in engine has no server: its name spelled as JSON
            assert 'target "eut" has no server to export to (the issue and the client reproduce on a real ' in line, line
    assert not (tmp_path / "o.md").exists() and not (tmp_path / "o.py").exists()


def test_the_api_table_names_every_op_for_sglang_with_the_version_checked():
    from kvaudit.program import OPS
    api = apis()["sglang"]
    assert api.version == "0.5.23" and set(api.calls) == set(OPS)
    assert {c.path for c in api.calls.values() if c.path} >= {
        "/generate", "/open_session", "/close_session", "/abort_request", "/flush_cache", "/pause_generation",
        "/continue_generation", "/health_generate"}


@pytest.mark.sglang
def test_the_deferred_close_arrives_while_the_turn_still_runs(stand_in, exported):
    """uaf: close_session must find turn 2 in flight (the program's deferred close): the script holds the
    batch, so the stand-in is still answering it when the close arrives."""
    base = exported["uaf-deferred-close-after-rejected-turn"]
    assert run_client(base + ".client.py", stand_in.url).returncode == 0
    calls = program_calls(stand_in.log)
    batch = [c for c in calls if c[2] == "/generate"][1]
    close = next(c for c in calls if c[2] == "/close_session")
    assert len(batch[3]["input_ids"]) == 2 and batch[4] < close[4] < batch[5]


@pytest.mark.sglang
def test_every_request_a_client_sends_is_one_sglang_0_5_23_accepts(stand_in, exported):
    """The bodies, checked with SGLang's own request types: /generate by its JSON contract
    (GenerateRequest.from_json_value) and GenerateReqInput's normalization (a batch of n items, each
    carrying the request's session_params), the session, abort and pause bodies by their dataclasses."""
    from kvaudit.targets.sglang import boot
    boot.load()
    from sglang.api.v1.api_types import GenerateRequest
    from sglang.srt.managers.io_struct import (AbortReq, CloseSessionReqInput, GenerateReqInput, OpenSessionReqInput,
                                               PauseGenerationReqInput)
    types = {"/open_session": OpenSessionReqInput, "/close_session": CloseSessionReqInput, "/abort_request": AbortReq,
             "/pause_generation": PauseGenerationReqInput}
    for name in NAMES:
        want = 3 if name in UNSEEN_LEAKS else 0  # (a leak /metrics cannot show: NOT CHECKED)
        assert run_client(exported[name] + ".client.py", stand_in.url).returncode == want
    seen = set()
    for seq, method, path, body, t0, t1 in stand_in.log:
        path = path.split("?")[0]
        seen.add(path)
        if path == "/generate":
            GenerateRequest.from_json_value(body)  # raises JsonContractError on a body the server refuses (400)
            req = GenerateReqInput(**body)
            req.normalize_batch_and_arguments()
            n = len(body["rid"]) if isinstance(body["rid"], list) else 1
            assert req.batch_size == n and req.is_single == (n == 1)
            if n > 1:
                assert [req[i].rid for i in range(n)] == body["rid"]
                assert all(req[i].session_params == body.get("session_params") for i in range(n))
        elif path in types:
            types[path](**body)
    assert {"/generate", "/open_session", "/close_session", "/abort_request", "/flush_cache"} <= seen


def test_without_the_target_handles_are_resolved_statically(tmp_path):
    """--no-resolve: the program is not run; sessions and requests are named by the intake's own rule (every
    submitted request counted live), and no request is held (no trace says which must still run)."""
    src = os.path.join(ROOT, "corpora", "sglang", "crash-a1-checkpoint-into-tree-after-abort.json")
    r = invoke("export", src, "--client", str(tmp_path / "c.py"), "--issue", str(tmp_path / "c.md"), "--no-resolve")
    assert r.exit_code == 0, r.output
    assert "handles resolved statically" in r.output
    text = (tmp_path / "c.py").read_text()
    assert "c.abort('r0', label='op 6')" in text
    assert ", True)," not in text  # nothing held
    assert "## How sure we are" in (tmp_path / "c.md").read_text()


@pytest.mark.parametrize("kind,name", [("sglang", "crash-session-replace-without-rid"),
                                       ("sglang", "hang-pd-prealloc-never-fits"), ("vllm", "own/vllm-46283")])
def test_the_issue_says_how_a_server_gets_there_where_the_driver_differs_and_how_sure_we_are(tmp_path, kind, name):
    """A finding in a real engine is a claim about that engine: its issue text carries the analysis's own
    lines (corpora/<kind>/notes.toml): how a server reaches it from client requests (in "What happens"),
    and where kvaudit's driver could differ on its path and how sure the analysis is (in "How sure we are"),
    not only the lines every export has. Before, the notes' ``reach`` was printed by the history suite only."""
    from kvaudit.history.notes import note_for
    src = os.path.join(ROOT, "corpora", kind, name + ".json")
    config, _, findings, _ = replay.load(src)
    note = note_for(kind, [f.signature for f in findings], config.preset)
    assert note is not None and note.reach and note.driver and note.sure
    r = invoke("export", src, "--issue", str(tmp_path / "i.md"), "--no-resolve")
    assert r.exit_code == 0, r.output
    issue = (tmp_path / "i.md").read_text()
    happens = issue.split("## What happens\n")[1].split("\n## ")[0]
    sure = issue.split("## How sure we are\n")[1]
    assert f"How a server gets there from client requests: {note.reach}." in happens
    assert f"- {note.sure[:1].upper()}{note.sure[1:]}.\n" in sure
    assert f"- Where kvaudit's driver could differ from a server on this path: {note.driver}.\n" in sure


@pytest.mark.sglang
def test_a_held_request_fits_the_context_length_the_launch_line_gives(stand_in, tmp_path):
    """SGLang's tokenizer refuses (HTTP 400) a /generate whose input plus max_new_tokens passes the server's
    context length (TokenizerManager's total-token check; --allow-auto-truncate is off by default). A held
    request asks for --hold-tokens more, capped so that it still fits the launch line's --context-length
    (as vLLM's client caps at max_model_len); before, finding 10's held first turn asked for 257 tokens
    against --context-length 96, was refused, and the replacing turn found no history to crash on."""
    import re
    src = os.path.join(ROOT, "corpora", "sglang", "crash-session-replace-without-rid.json")
    r = invoke("export", src, "--client", str(tmp_path / "c.py"), "--issue", str(tmp_path / "c.md"))
    assert r.exit_code == 0, r.output
    context = int(re.search(r"--context-length (\d+)", (tmp_path / "c.md").read_text()).group(1))
    subprocess.run([sys.executable, str(tmp_path / "c.py"), "--url", stand_in.url, "--step-delay", "0.05",
                    "--timeout", "20"], capture_output=True, text=True, timeout=120)  # the default --hold-tokens
    items = []
    for _, _, path, body, _, _ in stand_in.log:
        if path == "/generate":
            ids, params = body["input_ids"], body["sampling_params"]
            items += list(zip(ids, params)) if isinstance(ids[0], list) else [(ids, params)]
    assert len(items) == 2
    held = items[0][1]["max_new_tokens"]
    assert held > 1  # still held (the program's own max_new_tokens is 1) ...
    assert all(len(ids) + p["max_new_tokens"] <= context for ids, p in items), (context, items)  # ... and accepted


@pytest.mark.sglang
@pytest.mark.parametrize("name,want", [
    ("aliasing-spec-row-overflow-ngram-deep", {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 16,
                                               "speculative_ngram_max_bfs_breadth": 1}),
    ("crash-pd-prefill-requeued-first-turn-prefix-shrank", {"optimistic_prefill_attempts": 2})])
def test_the_launch_line_sets_what_the_finding_needs_as_sglang_parses_it(tmp_path, name, want):
    """The launch line, parsed by SGLang 0.5.23's own argument parser, sets the server arguments the finding
    needs: finding 14 needs n-gram speculative decoding (its 16-token verify at breadth 1, as the preset
    drives it), finding 13 optimistic prefill. Before, neither flag was in the line: a server launched as
    the issue says runs without speculative decoding or optimistic prefill and cannot show either."""
    import argparse
    import re
    import shlex
    from kvaudit.targets.sglang import boot
    boot.load()
    from sglang.srt.server_args import ServerArgs
    src = os.path.join(ROOT, "corpora", "sglang", name + ".json")
    r = invoke("export", src, "--issue", str(tmp_path / "i.md"), "--no-resolve")
    assert r.exit_code == 0, r.output
    line = re.search(r"python -m sglang.launch_server (.*)", (tmp_path / "i.md").read_text()).group(1)
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = vars(parser.parse_args(shlex.split(line)))
    assert {k: args[k] for k in want} == want, line


@pytest.mark.sglang
@pytest.mark.parametrize("preset,want,env", [
    ("sglang-evict-tlru", {"radix_eviction_policy": "tlru",
                           "radix_eviction_policy_config": {"threshold": 32, "next_prompt_estimate": 8}}, []),
    ("sglang-evict-slru", {"radix_eviction_policy": "slru", "radix_eviction_policy_config": {"protected_threshold": 2}},
     []),
    ("sglang-evict-priority", {"radix_eviction_policy": "priority", "enable_priority_scheduling": True}, []),
    ("sglang-priority", {"priority_scheduling_preemption_threshold": 1, "max_queued_requests": 4},
     ["SGLANG_REQ_WAITING_TIMEOUT=12", "SGLANG_REQ_RUNNING_TIMEOUT=24"]),
    ("sglang-hicache-l3", {"hicache_storage_backend": "file", "hicache_storage_prefetch_policy": "wait_complete"}, []),
    ("sglang-hicache-l3-timeout", {"hicache_storage_backend": "file", "hicache_storage_prefetch_policy": "timeout"},
     []),
    ("sglang-mamba-small", {"max_mamba_cache_size": 9, "mamba_radix_cache_strategy": "no_buffer"}, []),
    ("sglang-mamba-mixed", {"max_mamba_cache_size": 24, "mamba_radix_cache_strategy": "extra_buffer"}, []),
    ("sglang-pd-decode-radix", {"disaggregation_mode": "decode", "disaggregation_decode_enable_radix_cache": True,
                                "disaggregation_enable_kv_checksum": True}, []),
    # (tq68: the driver verifies every landed transfer's KV checksum, pd.py's server args; the line left it off)
    ("sglang-pd-decode", {"disaggregation_mode": "decode", "disaggregation_enable_kv_checksum": True}, [])])
def test_the_launch_line_sets_the_presets_cache_policy_as_sglang_parses_it(tmp_path, preset, want, env):
    """Tester te65: the launch line left out what these presets change in the server's behaviour: the tree's
    eviction policy (a server launched as the issue says evicts by LRU), priority preemption's threshold and
    the waiting / running timeouts (sglang-priority: SGLang's default 10 and no timeouts), HiCache's L3 tier
    (no --hicache-storage-backend: no storage at all; and SGLang's default prefetch policy is timeout, not
    the preset's wait_complete), Mamba's pool size and cache strategy. Parsed by SGLang 0.5.23's parser."""
    import argparse
    import re
    import shlex
    from kvaudit.targets import config_to_dict, registry
    from kvaudit.targets.sglang import boot
    boot.load()
    from sglang.srt.server_args import ServerArgs
    config = config_to_dict(registry.get("sglang").preset(preset).config())
    src = os.path.join(ROOT, "corpora", "sglang", "crash-session-replace-without-rid.json")
    _, issue = export_edited(tmp_path, src, lambda doc: doc.update(config=config))
    found = re.search(r"^(.*)python -m sglang.launch_server (.*)$", issue, re.M)
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = vars(parser.parse_args(shlex.split(found.group(2))))
    for k in ("radix_eviction_policy_config", "hicache_storage_backend_extra_config"):
        if isinstance(args.get(k), str):
            args[k] = json.loads(args[k])
    assert {k: args[k] for k in want} == want, found.group(0)
    assert all(e in found.group(1).split() for e in env), found.group(0)


@pytest.mark.parametrize("bug", ["skip-release", "lock-leak"])
def test_a_finding_of_a_planted_sglang_fault_is_exported_as_one_not_as_an_sglang_bug(tmp_path, bug):
    """A replay file recorded with ``--bug`` (an injected fault): the issue's title and banner and the client's
    docstring say it is planted, naming the fault as ``kvaudit bugs`` describes it (the SGLang export said
    "Found by kvaudit ... in SGLang 0.5.23" with no word of the fault, the tester's defect 1)."""
    doc = json.load(open(os.path.join(ROOT, "corpora", "sglang", "crash-a1-checkpoint-into-tree-after-abort.json")))
    doc["config"]["bugs"] = [bug]
    src = tmp_path / "planted.json"
    src.write_text(json.dumps(doc))
    r = invoke("export", str(src), "--client", str(tmp_path / "c.py"), "--issue", str(tmp_path / "c.md"),
               "--no-resolve")
    assert r.exit_code == 0, r.output
    issue = (tmp_path / "c.md").read_text()
    assert issue.startswith("# [planted fault, not a SGLang bug]"), issue[:200]
    assert "This is a planted fault, not a bug of SGLang" in issue.split("## Environment")[0]
    assert f"--bug {bug}: " in issue
    assert "PLANTED FAULT, NOT A BUG OF SGLANG" in (tmp_path / "c.py").read_text().split('"""')[1]


@pytest.mark.parametrize("change", ["planted", "another preset", "none"])
def test_a_coarse_signatures_analysis_goes_only_with_its_own_finding(tmp_path, change):
    """`leak/token_to_kv_pool/request-kv` says little on its own: its analysis (a retracted session turn) was
    attached to a --bug skip-release leak on preset sglang (the second tester), and to any request-kv leak.
    It is keyed with its preset now, and a planted fault gets no engine bug's analysis."""
    doc = json.load(open(os.path.join(ROOT, "corpora", "sglang", "leak-a2-retracted-turn-finishes-session.json")))
    if change == "planted":
        doc["config"]["bugs"] = ["skip-release"]
    elif change == "another preset":
        doc["config"]["preset"] = "sglang"
    src = tmp_path / "f.json"
    src.write_text(json.dumps(doc))
    r = invoke("export", str(src), "--issue", str(tmp_path / "i.md"), "--no-resolve")
    assert r.exit_code == 0, r.output
    issue = (tmp_path / "i.md").read_text()
    assert ("a retracted streaming-session turn counts as finished" in issue) == (change == "none"), issue[:300]


@pytest.mark.parametrize("recorded", ["0.5.10.post1", "0.5.23", None])
def test_a_file_recorded_on_another_release_is_exported_as_that_release(tmp_path, recorded):
    """A replay file's ``engine_version`` other than the release the HTTP table was read on (0.5.23) is the
    release the issue and the client name, with how to replay on it; the file's own release, or none, is
    0.5.23 as before (the tester: a 0.5.22 file's issue said "Found ... in SGLang 0.5.23")."""
    def edit(doc):
        doc.pop("engine_version", None)
        if recorded is not None:
            doc["engine_version"] = recorded

    src = tmp_path / "f.json"
    client, issue = export_edited(tmp_path, os.path.join(ROOT, "corpora", "sglang",
                                                         "crash-a1-checkpoint-into-tree-after-abort.json"), edit)
    on = recorded or "0.5.23"
    assert f"Found by kvaudit (a memory auditor for KV-cache schedulers) in SGLang {on}" in issue
    assert f"`pip install sglang=={on}`" in issue
    assert f"against a real SGLang {on}" in client
    if on != "0.5.23":
        assert "in SGLang 0.5.10.post1, the release the replay file was recorded on" in issue
        assert ("- Replay on SGLang 0.5.10.post1 (the release the file was recorded on): `python -m "
                "kvaudit.history.releases sglang==0.5.10.post1` installs it as an overlay") in issue
        assert "0.5.10.post1 (the release the replay file was recorded on) server" in client
        assert "0.5.23" not in issue.split("## Environment")[0]
    else:
        assert f"- Replay: `kvaudit replay {os.path.basename(src)}`." in issue  # (not below the test's directory)


@pytest.mark.sglang
def test_a_client_says_reproduced_when_the_pool_does_not_come_back(stand_in, exported):
    """A memory finding: the pool counters after closing the sessions and flushing are short of those
    before the program (the idle gauges are polled for --settle seconds first), exit 1."""
    stand_in.leak = 5
    base = exported["uaf-deferred-close-after-rejected-turn"]
    done = run_client(base + ".client.py", stand_in.url, "--settle", "1.5")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "kv_available_tokens is 5 below" in done.stdout and "kv_used_tokens=5" in done.stdout
    assert "RESULT: REPRODUCED" in done.stdout
    last_flush = max(r[0] for r in stand_in.log if r[2].startswith("/flush_cache"))
    polls = [r for r in stand_in.log if r[2] == "/metrics" and r[0] > last_flush]
    assert polls[-1][4] - polls[0][4] >= 1.0  # it waited for the gauges to settle before concluding


def test_every_sglang_corpus_finding_has_its_note_from_the_corpus_notes_file():
    """The analyses are data beside the corpus (corpora/sglang/notes.toml): each finding of the corpus has
    one, with its README section; a shared part is expanded; a kind without a notes file has none."""
    from kvaudit.export.notes import note_for, notes_of
    for path in sorted(glob.glob(os.path.join(ROOT, "corpora", "sglang", "*.json"))):
        config, _, findings, _ = replay.load(path)
        note = note_for("sglang", [f.signature for f in findings], config.preset)
        assert note is not None and note.title and note.why and note.server and note.readme, path
        assert note.reach and note.driver and note.sure, path  # a finding in SGLang is a claim about SGLang
        assert "{" not in note.why + note.fix, path
    assert "Streaming session already has an active request" in note_for(
        "sglang", ["aliasing/token_to_kv_pool/request-kv"], "sglang-session").why
    assert note_for("eut", ["leak/token_to_kv_pool/request-kv"]) is None and notes_of("eut") == {}


def test_a_long_finding_message_is_cut_at_a_word_in_the_title():
    """The title took message[:80], cut mid-word with no mark: '... from 15 to 15 (group 1, block(s) 0) from'."""
    from kvaudit.audit.findings import Finding, Site
    from kvaudit.export.issue import title_of

    msg = ("req:req-000001 read KV of 1 position(s) from 15 to 15 (group 1, block(s) 0) from a block freed and "
           "reused under it")
    f = Finding(kind="stale-kv", pool="block_pool", message=msg, read_sites=[Site("vllm/a.py", 3, "schedule")])
    title = title_of([f], None)
    assert title == ("stale-kv in block_pool at schedule: req:req-000001 read KV of 1 position(s) from 15 to 15 "
                     "(group 1, block(s) 0)..."), title
    f.message = "short"
    assert title_of([f], None) == "stale-kv in block_pool at schedule: short"
    f.message = "a " + "y" * 100  # one long token: cut inside it, not down to "a..."
    assert title_of([f], None) == "stale-kv in block_pool at schedule: a " + "y" * 75 + "..."


def test_an_unresolved_export_does_not_call_a_client_exact_that_may_need_a_held_request(tmp_path):
    """With --no-resolve (or no SGLang installed) the plan cannot tell that r1 must still be decoding when
    close_session arrives, so it held nothing and still said 'client: exact': against a real server r1
    would likely finish first and the script print NOT REPRODUCED. Untraced, a message after a request
    makes the client approximate, and the issue says why."""
    src = os.path.join(ROOT, "corpora", "sglang", "uaf-deferred-close-after-rejected-turn.json")
    r = invoke("export", src, "--issue", str(tmp_path / "u.md"), "--client", str(tmp_path / "u.py"), "--no-resolve")
    assert r.exit_code == 0, r.output + r.stderr
    assert "client: approximate" in r.output + r.stderr
    assert "handles not resolved on the target (--no-resolve, or the engine not installed)" in (
        tmp_path / "u.md").read_text()


@pytest.mark.parametrize("engine,name,model", [
    ("vllm", "findings/nixl-swa-window-block-skipped", "(a model with a 32-token sliding window beside full attention"),
    ("sglang", "liveness-swa-36458-chunked-prefill-pins-swa-pool", "(a hybrid-SWA model, as said above;")])
def test_a_sliding_window_finding_is_not_launched_on_any_model(tmp_path, engine, name, model):
    """Tester 61b: a sliding-window finding's Reproduce step said "Launch the server as above (any model; ...)",
    against its own environment bullet: the window is the model's, so the launch names that kind of model."""
    src = os.path.join(ROOT, "corpora", engine, name + ".json")
    issue = tmp_path / "swa.md"
    assert invoke("export", src, "--issue", str(issue), "--client", str(tmp_path / "swa.py"),
                  "--no-resolve").exit_code == 0
    text = issue.read_text()
    assert "(any model;" not in text and "Launch the server as above " + model in text


def test_fuzz_says_when_kvaudit_ships_an_analysis_of_the_finding():
    """A fuzz run on a real engine that re-finds a finding kvaudit already analysed (corpora/<kind>/notes.toml)
    says so on one line, naming the README section and the export command; a finding with no analysis (the
    built-in engine's zoo) gets no such line."""
    from kvaudit.app.fuzz import shipped_analysis

    config, _, findings, _ = replay.load(os.path.join(ROOT, "corpora", "sglang",
                                                      "leak-a3-hisparse-buffer-padded-at-finish.json"))
    line = shipped_analysis(config, findings, "/tmp/a b.json")
    assert line.startswith("known: kvaudit ships an analysis of leak/hisparse_device_pool/")
    assert "(corpora/sglang/README.md, finding 7): HiSparse device-buffer slot leak" in line
    assert line.endswith("kvaudit export --issue ISSUE.md '/tmp/a b.json' writes it as an issue text")
    assert "\n" not in line
    config, _, findings, _ = replay.load(os.path.join(ROOT, "corpora", "regressions",
                                                      sorted(os.listdir(os.path.join(ROOT, "corpora", "regressions")))[0]))
    assert shipped_analysis(config, findings, "x.json") == ""


def test_a_campaign_says_when_kvaudit_ships_an_analysis_of_a_new_finding(tmp_path):
    """Stop 63: a single fuzz run re-finding an analysed finding printed the `known:` line, a campaign (`fuzz
    --corpus`, `--workers`) reporting the same finding's file printed none. Now the same line, before its report."""
    import io
    import shutil

    from rich.console import Console

    from kvaudit.app.fuzz import _campaign_cases, shipped_analysis
    from kvaudit.search.campaign import CampaignResult

    src = os.path.join(ROOT, "corpora", "sglang", "leak-a3-hisparse-buffer-padded-at-finish.json")
    path = str(tmp_path / "found.json")
    shutil.copy(src, path)
    config, _, findings, _ = replay.load(path)
    console, err = (Console(file=io.StringIO(), width=100_000) for _ in range(2))
    _campaign_cases(CampaignResult(new={findings[0].signature: path}), config, console, err)
    out = console.file.getvalue().splitlines()
    known = shipped_analysis(config, findings, path)
    assert known.startswith("known: ") and out.count(known) == 1, out[:5]
    assert out.index(known) < next(i for i, line in enumerate(out) if "==ERROR: kvaudit:" in line)


def test_a_campaign_s_known_line_names_only_the_findings_it_reports_new(tmp_path):
    """A campaign's new file whose program also raised a signature the campaign counts as known (and does not
    report again) printed `known: kvaudit ships an analysis of` that known signature; ci names only the new
    ones. Now the campaign does as ci: the line is about a finding it reports, or there is none."""
    import io
    import shutil

    from rich.console import Console

    from kvaudit.app.fuzz import _campaign_cases
    from kvaudit.history.notes import note_for
    from kvaudit.search.campaign import CampaignResult

    path = str(tmp_path / "found.json")
    shutil.copy(os.path.join(ROOT, "corpora", "sglang", "aliasing-a1-rejected-turn-clears-inflight.json"), path)
    config, _, findings, _ = replay.load(path)
    analysed = [f.signature for f in findings if note_for("sglang", [f.signature], config.preset)]
    new = [f.signature for f in findings if f.signature not in analysed]
    assert analysed and new
    for reported, known, line in ((new, analysed, False), (analysed, new, True)):
        console, err = (Console(file=io.StringIO(), width=100_000) for _ in range(2))
        result = CampaignResult(new=dict.fromkeys(reported, path), known=dict.fromkeys(known, "corpus/k.json"))
        _campaign_cases(result, config, console, err)
        out = console.file.getvalue()
        assert ("known: kvaudit ships an analysis of " in out) is line, (reported, out[:300])


def test_ci_says_when_kvaudit_ships_an_analysis_of_a_new_finding(tmp_path, monkeypatch):
    """The same for `kvaudit ci`'s campaigns (a job over a real engine re-finding an analysed finding said
    nothing of it): its report of the new file starts with the `known:` line. The campaign and the engine's
    presence are stood in for: the job's own code prints."""
    import shutil

    import kvaudit.app.configs as configs
    from kvaudit.app.fuzz import shipped_analysis
    from kvaudit.search import campaign

    src = os.path.join(ROOT, "corpora", "sglang", "leak-a3-hisparse-buffer-padded-at-finish.json")
    config, _, findings, _ = replay.load(src)

    def found_it(config, fuzzer, budget, seed, workers, corpus, *a, **k):
        path = os.path.join(campaign.findings_dir(corpus), "found.json")
        os.makedirs(os.path.dirname(path))
        shutil.copy(src, path)
        return campaign.CampaignResult(new={findings[0].signature: path})

    monkeypatch.setattr(campaign, "run_campaign", found_it)
    monkeypatch.setattr(configs, "require_target", lambda config: None)
    (tmp_path / "regs").mkdir()
    r = invoke("ci", "--target", "sglang", "--presets", config.preset, "--max-time", "10", "--regressions",
               str(tmp_path / "regs"), "--out", str(tmp_path / "out"))
    assert r.exit_code == 1, r.output
    known = shipped_analysis(config, findings, str(tmp_path / "out" / "found.json"))
    out = r.stdout.splitlines()
    assert known.startswith("known: ") and out.count(known) == 1, r.stdout[:2000]
    assert out.index(known) < next(i for i, line in enumerate(out) if "==ERROR: kvaudit:" in line)


def test_the_issues_replay_command_quotes_a_file_name_for_the_shell(tmp_path):
    """Tester te65: a replay file named with a space and a quote (`x y's.json`) got `kvaudit replay x y's.json`
    in the issue's "How sure we are", not one argument once pasted. The name is quoted for a POSIX shell now."""
    src = os.path.join(ROOT, "corpora", "sglang", "crash-session-replace-without-rid.json")
    _, issue = export_edited(tmp_path, src, lambda doc: None, name="x y's.json")
    replay_line = next(x for x in issue.splitlines() if x.startswith("- Replay: "))
    assert "`kvaudit replay 'x y'\"'\"'s.json'`" in replay_line, replay_line


def _environment(issue: str) -> str:
    """The issue's Environment section (the launch line, its environment and what no flag sets)."""
    return issue.split("## Environment")[1].split("\n## ")[0]


_PD_DECODE = "hang-pd-prealloc-never-fits"
_PD_PREFILL = "uaf-pd-prefill-failed-transfer-frees-source-page"
_HISPARSE = "leak-a3-hisparse-buffer-padded-at-finish"
_SESSION = "crash-session-replace-without-rid"


@pytest.mark.parametrize("name,preset,field,value", [
    (_PD_DECODE, None, "deferred_kv_release", False), (_PD_DECODE, None, "deferred_release_timeout_steps", 9),
    (_PD_DECODE, None, "transfer_latency_steps", 3), (_PD_DECODE, None, "abort_ack_steps", None),
    (_PD_DECODE, None, "kv_checksum_mismatch_every", 4), (_PD_DECODE, None, "need_sort", False),
    (_PD_PREFILL, None, "bootstrap_steps", 3), (_PD_PREFILL, None, "bootstrap_lost_every", None),
    (_PD_PREFILL, None, "prefill_reads_after_failure", False), (_PD_PREFILL, None, "transfer_latency_steps", 5),
    (_PD_PREFILL, None, "bootstrap_timeout_steps", 20), (_HISPARSE, None, "hisparse_staging_steps", 3),
    (_SESSION, "sglang-hicache", "hicache_ack_steps", 3), (_SESSION, None, "strict_mem_check_during_busy", True),
    (_SESSION, None, "fake_bootstrap_every", 3)])
def test_a_setting_the_driver_ran_with_is_in_the_launch_or_said_to_be_unset(tmp_path, name, preset, field, value):
    """Stop 65 left these out of the export without a word: a server launched as the issue said ran with SGLang's
    own deferred-release timeout (30 s, not the preset's 6), its own checksum injector off, and no reader learnt
    that kvaudit played the prefill/decode peer, the wire or a copy's timing. Each, changed, changes the issue's
    Environment section: set on the launch line (an environment variable or a flag), or named as not set."""
    from kvaudit.targets import config_to_dict, registry

    def with_value(v):
        def edit(doc):
            if preset is not None:
                doc["config"] = config_to_dict(registry.get("sglang").preset(preset).config())
            doc["config"][field] = v
        return _environment(export_edited(tmp_path, os.path.join(ROOT, "corpora", "sglang", name + ".json"),
                                          edit)[1])

    config = registry.get("sglang").preset(preset).config() if preset is not None else \
        replay.load(os.path.join(ROOT, "corpora", "sglang", name + ".json"))[0]
    before, after = with_value(getattr(config, field)), with_value(value)
    assert before != after, (field, after)
    assert field in before + after or "SGLANG_" in after, (field, after)


@pytest.mark.sglang
def test_the_pd_decode_launch_sets_sglangs_own_deferred_release_and_checksum_settings(tmp_path):
    """The environment variables of the PD decode launch are SGLang 0.5.23's (sglang/srt/environ.py), read by
    SGLang's own parser as the preset set them (the timeout in seconds: kvaudit's PD clock runs one second a
    step), and the checksum flag is SGLang's (sglang/srt/arg_groups/fields/disagg.py)."""
    import argparse
    import re
    import shlex
    from kvaudit.targets.sglang import boot
    boot.load()
    from sglang.srt.environ import envs
    from sglang.srt.server_args import ServerArgs

    def edit(doc):
        doc["config"].update(deferred_release_timeout_steps=9, kv_checksum_mismatch_every=4)
    issue = export_edited(tmp_path, os.path.join(ROOT, "corpora", "sglang", _PD_DECODE + ".json"), edit)[1]
    found = re.search(r"^(.*)python -m sglang.launch_server (.*)$", issue, re.M)
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    assert vars(parser.parse_args(shlex.split(found.group(2))))["disaggregation_enable_kv_checksum"] is True
    env = dict(e.split("=", 1) for e in found.group(1).split())
    want = {"SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE": True,
            "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT": 9.0,
            "SGLANG_TEST_DISAGG_KV_CHECKSUM_MISMATCH_PROB": 0.25}
    old = {k: os.environ.get(k) for k in want}
    try:
        os.environ.update({k: env[k] for k in want})
        assert {k: getattr(envs, k).get() for k in want} == want, env
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def test_a_session_timeout_is_in_the_curl_line_as_in_the_script(tmp_path):
    """The client script opens a session with the preset's ``timeout`` (OpenSessionReqInput.timeout,
    sglang/srt/managers/io_struct.py); the issue's curl line for the same call left it out."""
    def edit(doc):
        doc["config"]["session_timeout_steps"] = 7
    src = os.path.join(ROOT, "corpora", "sglang", GOLDEN_NAME + ".json")  # (its plan is exact: it has curl lines)
    script, issue = export_edited(tmp_path, src, edit)
    assert "timeout=7" in script
    opens = [ln for ln in issue.splitlines() if ln.startswith("curl") and "/open_session" in ln]
    assert opens and all('"timeout": 7' in ln for ln in opens), opens


@pytest.mark.parametrize("batched", [True, False])
def test_the_fake_bootstrap_host_the_driver_sent_is_in_the_script_and_the_curl_line(tmp_path, stand_in, batched):
    """``fake_bootstrap_every`` (every Nth client request carries SGLang's FAKE_BOOTSTRAP_HOST: the history row
    sglang-36855) was only named in the issue's Environment as not sent: the script's and the curl line's /generate
    bodies left it out, so a server ran other requests than the driver did. Both send it now, for the requests the
    driver built with it (r<n>, n % N == N - 1; not a session turn), in a batch as a list."""
    from kvaudit.program import Idle, Step, Submit, program_to_json

    ops = [Submit(0, 8, 1), Submit(1, 8, 1), Submit(2, 8, 1), Idle()] if batched else \
        [Submit(0, 8, 1), Step(1), Submit(1, 8, 1), Step(1), Submit(2, 8, 1), Idle()]

    def edit(doc):
        doc["config"].update(fake_bootstrap_every=2, preset="sglang")
        doc["program"], doc["findings"] = program_to_json(ops), []
    script, issue = export_edited(tmp_path, os.path.join(ROOT, "corpora", "sglang", GOLDEN_NAME + ".json"), edit)
    assert "FAKE_BOOTSTRAP_EVERY = 2 " in script
    run_client(str(tmp_path / "c.py"), stand_in.url)
    sent = [(body["rid"], body.get("bootstrap_host")) for _, _, path, body, _, _ in program_calls(stand_in.log)
            if path == "/generate"]
    tag = sent[0][0][0].split("r0")[0] if batched else sent[0][0].split("r0")[0]  # (the script's run tag)
    want = [([tag + r for r in ("r0", "r1", "r2")], [None, "2.2.2.2", None])] if batched else \
        [(tag + "r0", None), (tag + "r1", "2.2.2.2"), (tag + "r2", None)]
    assert sent == want, sent
    curl = [ln for ln in issue.splitlines() if ln.startswith("curl -s") and "/generate" in ln]
    if batched:  # (an exact plan of one call at a time: the issue has curl lines)
        assert len(curl) == 1 and '"bootstrap_host": [null, "2.2.2.2", null]' in curl[0], curl
    assert "fake_bootstrap_every=2 (every Nth request" in _environment(issue)


def test_the_issue_shortens_a_long_finding_message_at_a_word(tmp_path):
    # "kvaudit reports: aliasing in token_to_kv_pool (... (or another owner's writes displac), leak ...": the
    # first line of a message was cut at 160 characters, mid-word, in an issue meant for upstream
    src = os.path.join(ROOT, "corpora", "sglang", "aliasing-a1-rejected-turn-clears-inflight.json")

    def edit(doc):
        doc["findings"][0]["message"] = "the reserved unit " + "padding " * 30 + "end"

    _, issue = export_edited(tmp_path, src, edit)
    line = next(x for x in issue.splitlines() if x.startswith("kvaudit reports: "))
    said = line.split(" (", 1)[1].split("), ", 1)[0]
    assert said.endswith("...") and len(said) <= 160, line
    assert set(said[len("the reserved unit "):-len("...")].split()) == {"padding"}, line  # whole words only
