"""kvaudit export for vLLM replay files (issue 23): every corpora/vllm/*.json (planted faults) and
corpora/vllm/history/*.json (vLLM's own bugs in old releases) exports its report and client script
(in-process, once per session, into a temporary directory: the exports are generated, not committed);
each script, run as a subprocess against a stand-in of vLLM's OpenAI-compatible server that streams
tokens and notices when a client closes a stream, sends the program's submits in order with their
parameters, and aborts exactly the streams the program aborts by closing their connections. One export
is kept as the golden one (tests/data/export/vllm/): the tests that need no vLLM run its script, and a
test checks that ``kvaudit export`` still writes it byte for byte."""

import glob
import json
import os
import select
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from cli_helpers import export_all, export_edited, invoke, one_error_line
from release_helpers import child_env
from kvaudit import replay
from kvaudit.export.http_api import apis
from kvaudit.export.issue import SECTIONS
from kvaudit.program.schema import prompt_tokens
from kvaudit.targets.vllm.export import vllm_flag_line

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = sorted(glob.glob(os.path.join(ROOT, "corpora", "vllm", "*.json")) +
               glob.glob(os.path.join(ROOT, "corpora", "vllm", "history", "*.json")))
NAMES = [os.path.relpath(f, os.path.join(ROOT, "corpora", "vllm"))[:-5] for f in FILES]
GOLDEN_NAME = "fault-skip-free"
GOLDEN = os.path.join(ROOT, "tests", "data", "export", "vllm", GOLDEN_NAME)  # + .issue.md / .client.py
PER_TOKEN = 0.01  # seconds the stand-in takes per streamed token
HOLD = 30  # --hold-tokens in these runs: a held request streams for ~0.3 s on the stand-in


def _die(server) -> None:
    """Stop ``server`` as a crashed process stops: no more answers, and new connections refused."""
    server.shutdown()
    server.server_close()


class VllmStandIn:
    """An HTTP server that answers vLLM 0.33.0's routes the scripts use and records each request as a
    dict: ``seq, method, path, body, t0`` (arrived), ``t1`` (answered or given up), ``chunks`` (tokens
    streamed), ``disconnected`` (the client closed the stream before [DONE]). ``usage``: the
    kv_cache_usage_perc /metrics reports once a completion came (0: a healthy pool); ``refuse``:
    /reset_prefix_cache answers success=false once a completion came; ``die_at_completion``: the server
    goes away at the first completion (a crash)."""

    def __init__(self):
        self.log, self.lock = [], threading.Lock()
        self.usage, self.refuse, self.die_at_completion = 0.0, False, False
        stand = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"  # a stream ends when the server closes it

            def log_message(self, *a):
                pass

            def _reply(self, status, ctype, out):
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def _gone(self):
                """The client closed its end (EOF readable on the socket)."""
                r, _, _ = select.select([self.connection], [], [], 0)
                if not r:
                    return False
                try:
                    return self.connection.recv(1, socket.MSG_PEEK) == b""
                except OSError:
                    return True

            def _serve(self, method):
                n = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(n) if n else b""
                body = json.loads(raw) if raw else None
                rec = {"seq": None, "method": method, "path": self.path, "body": body, "t0": time.monotonic(),
                       "t1": None, "chunks": 0, "disconnected": False}
                with stand.lock:
                    rec["seq"] = len(stand.log)
                    stand.log.append(rec)
                    came = any(r["path"] == "/v1/completions" for r in stand.log)
                path = self.path.split("?")[0]
                if path == "/v1/completions" and stand.die_at_completion:
                    # gone as a crashed process is: connections refused (a socket left listening made
                    # every later request wait out the client's --timeout: 36 s in all)
                    threading.Thread(target=_die, args=(stand.server,), daemon=True).start()
                    self.connection.close()
                    return
                if path == "/v1/completions" and body.get("stream"):
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.end_headers()
                    try:
                        for i in range(body["max_tokens"]):
                            time.sleep(PER_TOKEN)
                            if self._gone():
                                rec["disconnected"] = True
                                break
                            last = i == body["max_tokens"] - 1
                            chunk = {"id": "cmpl-" + body["request_id"], "choices": [
                                {"index": 0, "text": "x", "finish_reason": "length" if last else None}]}
                            self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                            self.wfile.flush()
                            rec["chunks"] += 1
                        else:
                            self.wfile.write(b"data: [DONE]\n\n")
                            self.wfile.flush()
                    except OSError:
                        rec["disconnected"] = True
                    rec["t1"] = time.monotonic()
                    return
                status, ctype, out = 200, "application/json", b"{}"
                if path == "/v1/completions":  # a prefill instance's non-streaming answer
                    out = json.dumps({"id": "cmpl-" + body["request_id"], "choices": [{"text": "x"}],
                                      "kv_transfer_params": {"do_remote_prefill": True, "remote_engine_id": "p",
                                                             "remote_block_ids": [[1]]}}).encode()
                elif path == "/metrics":
                    ctype = "text/plain"
                    usage = stand.usage if came else 0.0
                    out = (f"# HELP x\nvllm:kv_cache_usage_perc{{engine=\"0\",model_name=\"m\"}} {usage}\n"
                           "vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 0.0\n"
                           "vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 0.0\n"
                           "vllm:prefix_cache_queries_total{engine=\"0\",model_name=\"m\"} 7.0\n").encode()
                elif path == "/version":
                    out = b'{"version": "0.33.0"}'
                elif path == "/v1/models":
                    out = b'{"object": "list", "data": [{"id": "stand-in-model"}]}'
                elif path == "/reset_prefix_cache":
                    out = json.dumps({"success": not (stand.refuse and came)}).encode()
                elif path != "/health":
                    status, out = 404, b'{"detail": "Not Found"}'
                self._reply(status, ctype, out)
                rec["t1"] = time.monotonic()

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
    """Every corpora/vllm/**.json exported once (resolved on vLLM: use it from tests marked ``vllm``):
    name -> the path of its export less the suffix (``+ ".issue.md"``, ``+ ".client.py"``)."""
    return export_all(FILES, os.path.join(ROOT, "corpora", "vllm"), tmp_path_factory.mktemp("vllm-exports"))


@pytest.fixture
def stand_in():
    s = VllmStandIn()
    yield s
    s.close()


def run_client(script, url, *extra):
    return subprocess.run([sys.executable, script, "--url", url, "--step-delay", "0.05", "--gap", "0.05",
                           "--hold-tokens", str(HOLD), "--timeout", "20", "--settle", "0.5", *extra],
                          capture_output=True, text=True, timeout=120)


def program_calls(log):
    """The program's requests: after the script's baseline (its first /reset_prefix_cache and the gauge
    refresh after it) and before its cleanup reset, less its polling of /metrics and /health."""
    resets = [r["seq"] for r in log if r["path"].startswith("/reset_prefix_cache")]
    return [r for r in log if resets[0] < r["seq"] < resets[-1] and r["path"] not in ("/metrics", "/health")
            and "refresh" not in ((r["body"] or {}).get("request_id") or "")]


def expected_submits(path):
    """Per submit of the program, worked out here from the replay file alone (not from kvaudit.export):
    (prompt token ids, max_tokens) with the vLLM target's clamps (prompt context_len // 2, output
    context_len // 4, cut at stop_at where EOS is sampled)."""
    config, program, _, _ = replay.load(path)
    out = []
    for op in program:
        if op.kind == "submit":
            ids = prompt_tokens(op.family, max(1, min(op.prompt_len, config.max_model_len // 2)), config.vocab_size)
            m = max(1, min(op.max_new_tokens, config.max_model_len // 4))
            if op.stop_at is not None and not op.ignore_eos:
                m = min(m, op.stop_at)
            out.append((ids, m))
    return out


@pytest.mark.vllm
@pytest.mark.parametrize("name", NAMES)
def test_each_vllm_file_exports_its_report_and_client(name, exported):
    base = exported[name]
    config = replay.load(os.path.join(ROOT, "corpora", "vllm", name + ".json"))[0]
    issue = open(base + ".issue.md").read()
    for section in SECTIONS:
        assert f"\n{section}\n" in issue, f"{name}.issue.md lacks {section}"
    assert "vllm serve MODEL" in issue and "VLLM_SERVER_DEV_MODE=1" in issue
    assert f"python3 {os.path.basename(name)}.client.py --url" in issue
    client = open(base + ".client.py").read()
    assert "import kvaudit" not in client and "from kvaudit" not in client
    assert compile(client, name, "exec")
    planted = bool(config.bugs)
    head = issue.split("## Environment")[0]
    assert ("This is a planted fault, not a bug of vLLM" in head) == planted
    assert issue.startswith("# [planted fault, not a vLLM bug]") == planted
    assert ("PLANTED FAULT, NOT A BUG OF VLLM" in client.split('"""')[1]) == planted


def _healthy_result(name: str) -> tuple[int, str]:
    """What a file's client says against a healthy server: NOT REPRODUCED (exit 0), or for a stale KV read,
    whose symptom is a wrong answer the script does not judge, or a program with a streaming-input session,
    which no client sends as written, NOT CHECKED (exit 3)."""
    from kvaudit.targets.vllm.export import unsent

    config, program, findings, _ = replay.load(os.path.join(ROOT, "corpora", "vllm", name + ".json"))
    blind = findings[0].kind == "stale-kv" or unsent(config, program) is not None
    return (3, "NOT CHECKED") if blind else (0, "NOT REPRODUCED")


@pytest.mark.vllm
@pytest.mark.parametrize("name", NAMES)
def test_a_vllm_client_streams_the_submits_in_order_and_aborts_by_disconnecting(name, stand_in, exported):
    done = run_client(exported[name] + ".client.py", stand_in.url)
    healthy = _healthy_result(name)  # a healthy stand-in: nothing reproduced (a stale read: not checked)
    assert done.returncode == healthy[0], done.stdout + done.stderr
    assert f"RESULT: {healthy[1]}" in done.stdout
    calls = program_calls(stand_in.log)
    src = os.path.join(ROOT, "corpora", "vllm", name + ".json")
    config, program, _, _ = replay.load(src)
    want_paths = []
    for op in program:
        if op.kind == "submit":
            want_paths.append("/v1/completions")
        elif op.kind == "flush_cache":
            want_paths.append("/reset_prefix_cache")
    streams = [c for c in calls if c["path"] == "/v1/completions" and c["body"]["stream"]]
    assert [c["path"].split("?")[0] for c in calls if c["path"] != "/v1/completions" or c["body"]["stream"]] \
        == want_paths
    want = expected_submits(src)
    assert len(streams) == len(want)
    for c, (ids, m) in zip(streams, want):
        b = c["body"]
        assert b["prompt"] == ids and b["stream"] is True and b["ignore_eos"] is True and b["temperature"] == 0
        assert b["max_tokens"] in (m, m + HOLD) and b["min_tokens"] == b["max_tokens"]
        assert b["model"] == "stand-in-model"  # the first of /v1/models
    assert len({c["body"]["request_id"] for c in streams}) == len(streams)
    # the aborts: abort(handle=None) closes every stream still open when it comes; nothing else is closed
    aborts = [i for i, op in enumerate(program) if op.kind == "abort"]
    if not aborts:
        assert not any(c["disconnected"] for c in stand_in.log)
    for c in streams:
        assert c["disconnected"] == (c["chunks"] < c["body"]["max_tokens"]), c
    if aborts and all(program[i].handle is None for i in aborts):
        assert any(c["disconnected"] for c in streams), "the program aborts a running request: a stream is closed"


def _write_program(tmp_path, ops, preset_file="fault-skip-free.json", **config):
    doc = json.load(open(os.path.join(ROOT, "corpora", "vllm", preset_file)))
    doc["config"].update(bugs=[], **config)
    doc["program"] = ops
    doc["findings"] = []
    path = tmp_path / "p.json"
    path.write_text(json.dumps(doc))
    return str(path)


@pytest.mark.vllm
def test_an_abort_by_handle_closes_the_stream_the_program_picks_and_no_other(stand_in, tmp_path):
    """abort(handle=1) with two requests running picks the second (the Scheduler's requests in arrival
    order, resolved on the target): its stream is closed while it still streams; the first runs to
    [DONE]; the third, submitted after the abort, is untouched."""
    sub = {"op": "submit", "family": 0, "prompt_len": 4, "max_new_tokens": 20}
    src = _write_program(tmp_path, [sub, dict(sub, family=1), {"op": "step", "n": 2}, {"op": "abort", "handle": 1},
                                    dict(sub, family=2), {"op": "idle"}])
    r = invoke("export", src, "--client", str(tmp_path / "c.py"), "--issue", str(tmp_path / "c.md"))
    assert r.exit_code == 0, r.output
    text = (tmp_path / "c.py").read_text()
    assert "c.abort('req-000002', label='op 3')" in text
    done = run_client(str(tmp_path / "c.py"), stand_in.url)
    assert done.returncode == 0, done.stdout + done.stderr
    streams = [c for c in program_calls(stand_in.log) if c["path"] == "/v1/completions"]
    assert [c["body"]["prompt"][:4] == prompt_tokens(f, 4) for c, f in zip(streams, (0, 1, 2))] == [True] * 3
    assert [c["disconnected"] for c in streams] == [False, True, False]
    assert streams[1]["chunks"] < streams[1]["body"]["max_tokens"]
    issue = (tmp_path / "c.md").read_text()
    assert "close the connection of req-000002's stream" in issue
    assert "planted fault" not in issue  # no --bug: a finding in vLLM as shipped would be filed


def test_a_vllm_client_says_reproduced_when_blocks_stay_held(stand_in):
    """A memory finding: with nothing running, kv_cache_usage_perc > 0 (2 of 63 blocks), exit 1."""
    stand_in.usage = 2 / 63
    done = run_client(GOLDEN + ".client.py", stand_in.url)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "about 2 of 63 blocks held" in done.stdout and "RESULT: REPRODUCED" in done.stdout
    last = max(r["seq"] for r in stand_in.log if r["path"] == "/reset_prefix_cache")
    assert any(r["path"] == "/v1/completions" and r["seq"] > last for r in stand_in.log)  # the gauge refresh


def test_a_vllm_client_says_reproduced_when_the_prefix_cache_reset_is_refused(stand_in):
    stand_in.refuse = True
    done = run_client(GOLDEN + ".client.py", stand_in.url)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "reset_prefix_cache refused" in done.stdout


def test_a_vllm_client_says_reproduced_when_the_server_dies(stand_in):
    stand_in.die_at_completion = True
    done = run_client(GOLDEN + ".client.py", stand_in.url, "--timeout", "3")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "no longer answers" in done.stdout


def test_a_vllm_client_without_a_server_or_with_bad_arguments_is_one_line_exit_2():
    script = GOLDEN + ".client.py"
    # a URL that is not one exited 1 (REPRODUCED) with urllib's traceback
    for args in (["--url", "http://127.0.0.1:9", "--timeout", "2"], ["--timeout", "0"], ["--url", "notaurl"],
                 ["--prefill-url", "127.0.0.1:8100"]):
        done = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert "Traceback" not in done.stderr


@pytest.mark.vllm
def test_the_golden_vllm_export_is_what_export_writes_today(exported):
    """The one committed export (tests/data/export/vllm/) is byte for byte what ``kvaudit export`` writes
    (the other files' exports are checked by what their scripts send, above)."""
    base = exported[GOLDEN_NAME]
    assert open(base + ".issue.md").read() == open(GOLDEN + ".issue.md").read(), \
        f"regenerate: kvaudit export corpora/vllm/{GOLDEN_NAME}.json --issue {GOLDEN}.issue.md --client ..."
    assert open(base + ".client.py").read() == open(GOLDEN + ".client.py").read()


@pytest.mark.vllm
def test_every_completion_a_vllm_client_sends_is_one_vllm_0_33_0_accepts(stand_in, exported):
    """The bodies, checked with vLLM's own request model (CompletionRequest): a prompt of token ids,
    max_tokens, min_tokens, ignore_eos, stream, request_id, kv_transfer_params."""
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    for name in NAMES:
        assert run_client(exported[name] + ".client.py", stand_in.url).returncode == _healthy_result(name)[0]
    bodies = [r["body"] for r in stand_in.log if r["path"] == "/v1/completions"]
    assert bodies
    for body in bodies:
        req = CompletionRequest(**body)
        assert req.prompt == body["prompt"] and req.max_tokens == body["max_tokens"]
        params = req.to_sampling_params(req.max_tokens, {})
        assert params.ignore_eos and params.min_tokens == params.max_tokens == body["max_tokens"]


def test_the_api_table_names_every_op_for_vllm_with_the_version_checked():
    from kvaudit.program import OPS
    api = apis()["vllm"]
    assert api.version == "0.33.0" and set(api.calls) == set(OPS)
    assert {c.path for c in api.calls.values() if c.path} == {"/v1/completions", "/health", "/reset_prefix_cache",
                                                             "/metrics"}
    assert not api.calls["abort"].exact or "disconnect" in api.calls["abort"].note
    assert not api.calls["step"].exact and not api.calls["memory_pressure"].exact
    assert "vllm/v1/engine/async_llm.py" in api.sources  # where the abort on disconnect was read


def test_the_vllm_launch_line_follows_the_config():
    from kvaudit.targets.vllm.config import VLLM_PRESETS
    flags, env, unmapped = vllm_flag_line(VLLM_PRESETS["vllm-async"].config())
    assert "--async-scheduling" in flags and "--num-gpu-blocks-override 64" in flags and "--block-size 16" in flags
    assert "--enable-prefix-caching" in flags and env == ["VLLM_SERVER_DEV_MODE=1"]
    flags = vllm_flag_line(VLLM_PRESETS["vllm-small"].config())[0]
    assert "--no-async-scheduling" in flags and "--max-model-len 60" in flags and "--block-size 4" in flags
    assert not any(f.startswith("--scheduling-policy") for f in flags)
    flags, _, unmapped = vllm_flag_line(VLLM_PRESETS["vllm-priority-async"].config())
    assert "--scheduling-policy priority" in flags and any("priorities" in u for u in unmapped)
    flags, _, unmapped = vllm_flag_line(VLLM_PRESETS["vllm-kv-connector-swa"].config())
    kv = next(f for f in flags if f.startswith("--kv-transfer-config"))
    assert json.loads(kv.split(" ", 1)[1].strip("'")) == {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
    assert any(u.startswith("sliding_window=32") for u in unmapped)
    assert any(u.startswith("level=manager") for u in vllm_flag_line(VLLM_PRESETS["vllm-manager"].config())[2])
    # the CPU-offload connector is launched eager, with its CPU budget to set (it was launched with none: vLLM's
    # default budget and lazy offload, another schedule of stores than the one kvaudit drove)
    flags, _, unmapped = vllm_flag_line(VLLM_PRESETS["vllm-cpu-offload-swa"].config())
    kv = next(f for f in flags if f.startswith("--kv-transfer-config"))
    assert json.loads(kv.split(" ", 1)[1].strip("'").replace("CPU_BYTES", "6144")) == {
        "kv_connector": "SimpleCPUOffloadConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use": 6144, "lazy_offload": False}}
    assert any(u.startswith("num_cpu_blocks=6 ") and "set CPU_BYTES to 6 blocks' worth" in u for u in unmapped)
    assert any(u.startswith("wake_for_transfers=true") and ">= 0.30.0 does so itself for this connector" in u
               for u in unmapped)
    assert any(u.startswith("wake_for_transfers=true") and ">= 0.22.0 does so itself" in u
               for u in vllm_flag_line(VLLM_PRESETS["vllm-kv-load"].config())[2])


@pytest.mark.parametrize("preset,spec,mamba", [
    ("vllm-spec", {"method": "ngram", "num_speculative_tokens": 4}, None),
    ("vllm-spec-eagle", {"method": "eagle", "num_speculative_tokens": 4, "model": "DRAFT_MODEL"}, None),
    ("vllm-mamba", None, ["--mamba-cache-mode align", "--prefix-match-unit 4"]),
    ("vllm-mamba-spec", {"method": "ngram", "num_speculative_tokens": 4}, ["--mamba-cache-mode align"])])
def test_the_vllm_launch_line_sets_speculative_decoding_and_the_mamba_cache(preset, spec, mamba):
    """Tester te65: a vllm-spec* or vllm-mamba* finding's launch line had no --speculative-config (a server
    launched as the issue said decodes without drafts: no rejected draft blocks to leak) and no Mamba cache
    mode, nor a word that the model must have Mamba layers."""
    from kvaudit.targets.vllm.config import VLLM_PRESETS
    flags, _, unmapped = vllm_flag_line(VLLM_PRESETS[preset].config())
    given = [json.loads(f.split(" ", 1)[1].strip("'")) for f in flags if f.startswith("--speculative-config ")]
    assert given == ([spec] if spec else []), flags
    assert all(f in flags for f in mamba or []) and any(u.startswith("mamba=true") for u in unmapped) == bool(mamba)


def test_vllm_export_bad_input_is_one_line_exit_2(tmp_path):
    good = os.path.join(ROOT, "corpora", "vllm", "fault-skip-free.json")
    for args in (("export", good, "--client", str(tmp_path)), ("export", good, "--issue", good),
                 ("export", good)):
        r = invoke(*args)
        assert r.exit_code == 2, (args, r.output)
        one_error_line(r)


@pytest.mark.releases
@pytest.mark.parametrize("name", [n for n in NAMES if n.startswith("history/")])
def test_a_history_reproducer_replays_on_the_release_that_ships_the_bug(name, exported):
    """corpora/vllm/history/<bug id>.json finds its bug (kvaudit/history/catalogue.py) on the buggy release,
    in a child process with that release's overlay first on the path; its report names that release."""
    from kvaudit.history.catalogue import BUGS
    bug = BUGS[os.path.basename(name)]
    env = child_env("vllm", bug.buggy, ROOT)
    path = os.path.join(ROOT, "corpora", "vllm", name + ".json")
    code = ("import json; from kvaudit import replay; from kvaudit.audit.runner import execute; import vllm; "
            f"assert vllm.__version__ == {bug.buggy!r}, vllm.__version__; "
            f"config, program = replay.load({path!r})[:2]; "
            "print(json.dumps(sorted({f.signature for f in execute(config, program, full_stacks=False).findings})))")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    found = json.loads(r.stdout.strip().splitlines()[-1])
    recorded = [f.signature for f in replay.load(path)[2]]
    assert recorded and set(recorded) <= set(found), (recorded, found)
    assert any(s.startswith(bug.finding + "/") and (not bug.check or s.endswith("check:" + bug.check)) for s in found)
    issue = open(exported[name] + ".issue.md").read()
    assert f"`pip install vllm=={bug.buggy}`" in issue and f"fixed in {bug.fixed}" in issue
    # its replay line names the release it needs (on the base release it replays clean)
    assert (f"`python -m kvaudit.history.releases vllm=={bug.buggy}` installs it as an overlay, then "
            f"`PYTHONPATH=~/.cache/kvaudit/releases/vllm-{bug.buggy} kvaudit replay corpora/vllm/{name}.json`") in issue


def test_a_stale_kv_clients_result_is_not_checked_rather_than_not_reproduced(stand_in, tmp_path):
    """A stale KV read changes a request's answer, not the pool: the script looked for blocks not coming back
    and, finding none, printed NOT REPRODUCED (exit 0), and the issue's Expected named a pool line."""
    src = os.path.join(ROOT, "corpora", "vllm", "findings", "nixl-swa-window-block-skipped.json")
    r = invoke("export", src, "--issue", str(tmp_path / "s.md"), "--client", str(tmp_path / "s.py"), "--no-resolve")
    assert r.exit_code == 0, r.output + r.stderr
    issue = (tmp_path / "s.md").read_text()
    # (its note's server line: a wrong answer, not the pool line a leak's client checks)
    expected = next(line for line in issue.splitlines() if "Expected: " in line)
    assert "the first generated token attends to one key read from the null block" in expected, expected
    assert "kv_cache_usage_perc" not in expected, expected
    assert "`NOT CHECKED` (exit 3)" in issue
    done = run_client(str(tmp_path / "s.py"), stand_in.url)
    assert done.returncode == 3, done.stdout + done.stderr
    assert "RESULT: NOT CHECKED" in done.stdout and "NOT REPRODUCED" not in done.stdout
    # a planted stale read: the banner and the docstring promise what the script prints, not NOT REPRODUCED
    planted = os.path.join(ROOT, "corpora", "vllm", "fault-keep-computed-on-preempt.json")
    r = invoke("export", planted, "--issue", str(tmp_path / "p.md"), "--client", str(tmp_path / "p.py"), "--no-resolve")
    assert r.exit_code == 0, r.output + r.stderr
    assert "expected to print `RESULT: NOT CHECKED` against a real server" in (tmp_path / "p.md").read_text()
    assert "RESULT: NOT CHECKED (exit 3" in (tmp_path / "p.py").read_text().split('"""')[1]


def test_a_finding_with_no_recorded_analysis_says_it_is_not_triaged(tmp_path, monkeypatch):
    """findings/nixl-swa-window-block-skipped.json had no note: its issue said "(no analysis recorded)" yet
    "How sure we are" claimed it as vLLM's like a triaged one; a finding in a real engine is a claim about
    that engine, so the report says it is not yet shown to be vLLM's. (Its note is recorded since: taken out
    here, it stands for a finding not yet triaged.)"""
    from kvaudit.history import notes

    src = os.path.join(ROOT, "corpora", "vllm", "findings", "nixl-swa-window-block-skipped.json")
    real = notes.notes_of
    monkeypatch.setattr(notes, "notes_of", lambda kind: {**real(kind), "notes": {
        k: v for k, v in real(kind).get("notes", {}).items() if not k.startswith("stale-kv/block_pool/")}})
    r = invoke("export", src, "--issue", str(tmp_path / "s.md"), "--no-resolve")
    assert r.exit_code == 0, r.output + r.stderr
    sure = (tmp_path / "s.md").read_text().split("## How sure we are")[1]
    assert "- Not triaged: no analysis of this signature is recorded (`corpora/vllm/notes.toml`)" in sure
    monkeypatch.undo()
    r = invoke("export", src, "--issue", str(tmp_path / "n.md"), "--no-resolve")  # its note: triaged
    assert r.exit_code == 0 and "Not triaged" not in (tmp_path / "n.md").read_text(), r.output + r.stderr
    own = os.path.join(ROOT, "corpora", "vllm", "own", "vllm-46283.json")  # triaged: no such line
    r = invoke("export", own, "--issue", str(tmp_path / "o.md"), "--no-resolve")
    assert r.exit_code == 0 and "Not triaged" not in (tmp_path / "o.md").read_text(), r.output + r.stderr


def test_a_streaming_session_clients_result_is_not_checked_rather_than_not_reproduced(stand_in, tmp_path):
    """On a streaming_sessions preset the script sends a session's chunks as separate plain requests, which
    cannot add up past max_model_len: against a healthy server it printed NOT REPRODUCED (exit 0) for a bug
    vLLM 0.33.0 has (tester 60b). Now NOT CHECKED (exit 3) with a NOTE, and the issue and export say so."""
    src = os.path.join(ROOT, "corpora", "vllm", "open", "session-past-max-model-len.json")
    r = invoke("export", src, "--issue", str(tmp_path / "s.md"), "--client", str(tmp_path / "s.py"), "--no-resolve")
    assert r.exit_code == 0, r.output + r.stderr
    assert "ends NOT CHECKED (exit 3), never NOT REPRODUCED: the program's streaming-input sessions" in r.stderr
    issue = (tmp_path / "s.md").read_text()
    assert "or else `NOT CHECKED` (exit 3): the program's streaming-input sessions" in issue
    done = run_client(str(tmp_path / "s.py"), stand_in.url)
    assert done.returncode == 3, done.stdout + done.stderr
    assert "NOTE: not sent: the program's streaming-input sessions" in done.stdout
    assert "RESULT: NOT CHECKED (the program was not sent as written" in done.stdout
    assert "NOT REPRODUCED" not in done.stdout.split("RESULT:")[1]
    # a program without a session on the same preset is sent as before
    from kvaudit.targets.vllm.export import unsent
    config, program = replay.load(src)[:2]
    assert unsent(config, [op for op in program if "session" not in op.kind]) is None
    assert unsent(config.replace(streaming_sessions=False), program) is None


@pytest.mark.parametrize("recorded", ["0.15.1", "0.33.0"])
def test_a_known_fixed_bug_found_again_is_exported_as_that_bug(tmp_path, recorded):
    """A vllm-45357 finding recorded on its 0.23.0 overlay, outside corpora/vllm/history/, exported with no
    analysis and no word that 0.24.0 fixed it (the tester): a maintainer could file a duplicate of a fixed bug.
    The catalogued bug its first finding is, on that bug's last buggy release with its preset, is named with its
    fix; recorded on another release it is not (a new bug there, as far as kvaudit knows)."""
    doc = json.load(open(os.path.join(ROOT, "corpora", "vllm", "history", "vllm-33377.json")))
    doc["engine_version"] = recorded
    src = tmp_path / "found-again.json"
    src.write_text(json.dumps(doc))
    r = invoke("export", str(src), "--issue", str(tmp_path / "i.md"), "--no-resolve")
    assert r.exit_code == 0, r.output
    issue = (tmp_path / "i.md").read_text()
    assert ("Fixed upstream in vLLM 0.16.0 (vllm-project/vllm#33377); upgrade." in issue) == (recorded == "0.15.1")



@pytest.mark.parametrize("names", [True, False], ids=["names-its-release", "names-none"])
def test_a_history_bug_s_replay_line_says_whether_the_file_names_its_release(tmp_path, names):
    """tg63: the issue of corpora/vllm/history/vllm-33377.json (``"engine_version": "0.15.1"``) said "Replay on
    vLLM 0.15.1 (the file does not name the release; ...)": it does, and a reader believed the file."""
    doc = json.load(open(os.path.join(ROOT, "corpora", "vllm", "history", "vllm-33377.json")))
    assert doc["engine_version"] == "0.15.1"
    if not names:
        del doc["engine_version"]
    src = tmp_path / "history" / "vllm-33377.json"
    src.parent.mkdir()
    src.write_text(json.dumps(doc))
    r = invoke("export", str(src), "--issue", str(tmp_path / "i.md"), "--no-resolve")
    assert r.exit_code == 0, r.output
    line = next(ln for ln in (tmp_path / "i.md").read_text().splitlines() if ln.startswith("- Replay on "))
    assert line.startswith("- Replay on vLLM 0.15.1 (" + ("the release the file was recorded on; on 0.16.0 it replays "
                                                        "clean)" if names else "the file does not name the release; "
                                                        "on 0.16.0 it replays clean)")), line


def _export_with_message(tmp_path, message: str, name: str) -> tuple[str, str]:
    """(client script, issue) of ``kvaudit export`` over fault-skip-free.json with its first finding's message
    ``message``, the file saved as ``name``; the export must exit 0."""
    def edit(doc):
        doc["findings"][0]["message"] = message

    return export_edited(tmp_path, os.path.join(ROOT, "corpora", "vllm", "fault-skip-free.json"), edit, name)


def test_a_message_with_quotes_backslashes_or_control_characters_exports_a_client_that_compiles(tmp_path):
    """tg63: the client's docstring opens with the title, which (without an analysis) quotes the finding's
    message: a message holding ``\"\"\"`` or a backslash (``\\x`` with no hex after it, ``\\N``) made a script
    that does not compile, and an escape sequence or a NUL went raw into the script and the issue."""
    import warnings

    script, issue = _export_with_message(tmp_path, 'held """ \\x \\N{ \\ \x1b[2J \x00 end"', 'odd "q" \\.json')
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (an invalid escape such as "\." warns, a later Python refuses it)
        code = compile(script, "c.py", "exec")
    shown = 'held """ \\x \\N{ \\ \\x1b[2J \\x00 end"'
    assert shown in code.co_consts[0]  # the docstring reads as the message, its controls escaped
    assert shown in issue
    for text in (script, issue):
        assert "\x1b" not in text and "\x00" not in text


def test_a_message_of_several_lines_gives_the_issue_a_one_line_title(tmp_path):
    """tg63: a crash's message is the exception's (``AssertionError: ...`` with the lines an assertion message
    spans): the issue's ``# title`` took its first line only and the rest fell into the body as loose text."""
    script, issue = _export_with_message(tmp_path, "blocks held\n  by req-1\r\n\tafter free", "multi.json")
    first = issue.splitlines()[0]
    assert first.startswith("# [planted fault, not a vLLM bug] leak in block_pool at ") and \
        first.endswith(": blocks held by req-1 after free"), first
    assert first[2:] in script.splitlines()[1]


def test_an_op_the_client_ignores_is_said_to_send_nothing_once(tmp_path):
    """tg63: an open_session on a vLLM preset read "nothing sent for `open_session()` (nothing sent: on a ...)" in the
    issue, and "# nothing to send: nothing sent: ..." in the script."""
    doc = json.load(open(os.path.join(ROOT, "corpora", "vllm", "fault-skip-free.json")))
    doc["program"][1:1] = [{"op": "open_session"}, {"op": "close_session", "handle": 0}]
    src = tmp_path / "sessions.json"
    src.write_text(json.dumps(doc))
    r = invoke("export", str(src), "--issue", str(tmp_path / "i.md"), "--client", str(tmp_path / "c.py"),
               "--no-resolve")
    assert r.exit_code == 0, r.output
    issue, script = (tmp_path / "i.md").read_text(), (tmp_path / "c.py").read_text()
    assert "- op 1: nothing sent for `open_session()` (on a streaming_sessions preset" in issue
    assert "- op 2: nothing sent for `close_session(handle=0)` (on a streaming_sessions preset" in issue
    assert "nothing sent: " not in issue and "nothing sent: " not in script


@pytest.mark.parametrize("flush_running", [True, False])
def test_a_flush_that_resets_running_requests_is_sent_so(stand_in, tmp_path, flush_running):
    """``flush_running`` (the history row vllm-49860's): the program's flush is vLLM's
    ``reset_prefix_cache(reset_running_requests=True)``, which a dev-mode server takes as the query
    ``?reset_running_requests=true`` (vllm/entrypoints/serve/dev/cache/api_router.py). The script sent a plain
    ``/reset_prefix_cache`` whatever the config said: a server kept its running requests. The script's own
    flushes (before and after the program) stay plain."""
    def edit(doc):
        doc["config"]["flush_running"] = flush_running
        doc["program"].insert(1, {"op": "flush_cache", "timeout": 0})
    script = export_edited(tmp_path, os.path.join(ROOT, "corpora", "vllm", GOLDEN_NAME + ".json"), edit)[0]
    (tmp_path / "c.py").write_text(script)
    done = run_client(str(tmp_path / "c.py"), stand_in.url)
    assert done.returncode in (0, 1, 3), done.stdout[-2000:] + done.stderr[-2000:]
    resets = [r["path"] for r in stand_in.log if r["path"].startswith("/reset_prefix_cache")]
    assert len(resets) >= 3, resets  # the script's before, the program's, the script's cleanup
    program = "/reset_prefix_cache?reset_running_requests=true" if flush_running else "/reset_prefix_cache"
    assert resets[0] == resets[-1] == "/reset_prefix_cache" and program in resets[1:-1], resets
