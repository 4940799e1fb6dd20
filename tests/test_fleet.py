"""Campaigns across hosts through one real Redis (kvaudit.search.hub, ``kvaudit fuzz --db``,
``kvaudit campaign status|pull``): claims, orphans, outages, malformed entries, and three "hosts"
(processes with their own working directories) that report each signature once."""

import json
import os
import re
import signal
import subprocess
import time

import pytest
from cli_helpers import invoke, kvaudit_script, one_error_line, plain_env

from kvaudit import replay
from kvaudit.program import Idle, Submit
from kvaudit.search import hub as hubs
from kvaudit.targets.eut.presets import get_preset

HISPARSE = ["--preset", "pd-decode-hisparse", "--bug", "hisparse-prebuilt-skip-finish"]


def _doc(sig="leak/x"):
    from kvaudit.audit.findings import Finding

    config = get_preset("pd-decode-hisparse").config()
    f = Finding(kind="leak", pool="token_to_kv_pool", slots=[1], message="m", op_index=0, step=1)
    return replay.to_doc(config, [Submit(), Idle()], [f], minimized=False, note=sig)


def _hub(server, name="w", ttl=30.0, campaign="t"):
    return hubs.Hub(hubs.connect(server.url), campaign, name, ttl=ttl)


def test_one_worker_claims_a_signature_the_others_count_duplicates_and_a_registered_file_makes_it_known(redis_server,
                                                                                                        tmp_path):
    a, b = _hub(redis_server, "a"), _hub(redis_server, "b")
    assert a.claim(["leak/x"], _doc()) == ["leak/x"]
    assert a.claim(["leak/x"], _doc()) == ["leak/x"]  # its own claim
    assert b.claim(["leak/x"], _doc()) == []
    assert a.register(["leak/x", "leak/y"], json.dumps(_doc())) == ["leak/x", "leak/y"]
    assert b.known() == {"leak/x", "leak/y"}
    assert b.claim(["leak/y"], _doc("leak/y")) == []  # secondary signatures of a file are known too
    status = hubs.campaign_status(redis_server.client(), "t")
    assert status["findings"] == ["leak/x"] and status["pending"] == [] and status["duplicates"] == {"leak/x": 1,
                                                                                                      "leak/y": 1}
    assert a._claims == set() and not redis_server.client().exists("kvaudit:t:claim:leak/x")  # registered: released
    pulled = b.pull_findings(str(tmp_path / "pulled"))
    assert [os.path.basename(p) for p in pulled] == [replay.file_name("leak/x")]
    assert json.load(open(pulled[0])) == _doc()


def test_a_program_s_signatures_are_claimed_together_so_racing_workers_never_split_one_bug(redis_server):
    """A claim per signature (SET NX, one after the other) let two workers that found one bug's two
    signatures at once, in another order, each take one of them and each write a file."""
    import random
    import threading

    sigs = [f"leak/{c}" for c in "xyz"]
    for attempt in range(20):
        hubs_ = [_hub(redis_server, f"w{i}", campaign=f"race{attempt}") for i in range(8)]
        start, got = threading.Barrier(len(hubs_)), {}

        def claim(h):
            mine = random.sample(sigs, len(sigs))
            start.wait()
            got[h.worker] = h.claim(mine, _doc())

        threads = [threading.Thread(target=claim, args=(h,)) for h in hubs_]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        winners = [w for w, mine in got.items() if mine]
        assert len(winners) == 1 and sorted(got[winners[0]]) == sigs, got
        dup = hubs.campaign_status(redis_server.client(), f"race{attempt}")["duplicates"]
        assert dup == {s: 7 for s in sigs}


def test_the_first_file_registered_reports_the_bug_and_a_later_one_with_nothing_new_is_not_written(redis_server):
    """Two workers whose programs raised one bug's two signatures in two subsets each claimed one; each
    minimized program raises both: the first file registered reports both, the other nothing."""
    a, b, c = _hub(redis_server, "a"), _hub(redis_server, "b"), _hub(redis_server, "c")
    assert a.claim(["leak/x"], _doc()) == ["leak/x"] and b.claim(["leak/y"], _doc()) == ["leak/y"]
    assert b.register(["leak/y", "leak/x"], "b's file") == ["leak/y", "leak/x"]  # a still triages x: b's file has it
    assert a.register(["leak/x", "leak/y"], "a's file") == []  # write nothing: b's file reports both
    assert c.register(["leak/z", "leak/x"], "c's file") == ["leak/z"]  # a new one too: reported, x as b's
    r = redis_server.client()
    assert {k.decode(): v.decode() for k, v in r.hgetall("kvaudit:t:findings").items()} == {
        "leak/y": "b's file", "leak/z": "c's file"}
    status = hubs.campaign_status(r, "t")
    assert status["pending"] == [] and status["duplicates"] == {"leak/x": 1}  # a triaged x in vain
    assert not r.keys("kvaudit:t:claim:*") and a._claims == b._claims == set()


def test_a_released_claim_is_an_orphan_any_worker_triages(redis_server):
    """A signature claimed with a program whose minimized form no longer raises it goes back to the fleet."""
    a, b = _hub(redis_server, "a"), _hub(redis_server, "b")
    assert a.claim(["leak/x", "leak/y"], _doc()) == ["leak/x", "leak/y"]
    assert b.orphans() == []
    a.register(["leak/x"], "a's file")
    a.release(["leak/x", "leak/y"])
    assert [s for s, _ in b.orphans()] == ["leak/y"] and a._claims == set()
    assert b.claim(["leak/y"], _doc()) == ["leak/y"]
    a.release(["leak/y"])  # not a's any more: b's claim stays
    assert redis_server.client().get("kvaudit:t:claim:leak/y") == b"b"


def test_a_claim_whose_worker_stops_heartbeating_expires_and_another_worker_reclaims_it(redis_server):
    a, b = _hub(redis_server, "a", ttl=1), _hub(redis_server, "b", ttl=1)
    assert a.claim(["leak/x"], _doc()) == ["leak/x"]
    assert b.orphans() == []  # claimed and alive
    a.start()
    time.sleep(1.6)  # the heartbeat renews the claim past its ttl
    assert b.orphans() == []
    a._stop.set()  # the worker dies (kill -9: no release)
    a._thread.join()
    time.sleep(1.6)
    orphans = b.orphans()
    assert [s for s, _ in orphans] == ["leak/x"] and orphans[0][1]["program"]
    assert b.claim(["leak/x"], orphans[0][1]) == ["leak/x"]


def test_a_dead_worker_s_bug_is_triaged_by_a_worker_that_met_it_while_it_was_held(redis_server, tmp_path):
    """A worker that found a signature already claimed took it as known, so it never re-claimed it when
    the claimant died (in a fleet of two, nobody did); the orphan's two signatures are one file."""
    from kvaudit.search import campaign
    from kvaudit.targets import config_to_dict

    src = os.path.join(os.path.dirname(__file__), "..", "corpora", "regressions", "hisparse-prebuilt-skip-finish.json")
    config, program, findings, _ = replay.load(src)
    sigs = sorted({f.signature for f in findings})
    dead, b = _hub(redis_server, "dead"), _hub(redis_server, "b")
    assert dead.claim(sigs, replay.to_doc(config, program, findings, minimized=False)) == sigs
    assert b.claim(sigs, _doc()) == []  # b meets them while they are held: known to it, as a duplicate
    r = redis_server.client()
    r.delete(*[f"kvaudit:t:claim:{s}" for s in sigs])  # the claimant died: its claims expired
    corpus, emitted = tmp_path / "c", []
    (corpus / "findings").mkdir(parents=True)
    spec = campaign._Spec(0, config_to_dict(config), "random", 0, 60.0, str(corpus), None, 1, 0)
    worker = campaign._Worker(spec, emitted.append, config, hub=b, known=sigs)
    worker.sync()
    assert sorted(m[2] for m in emitted if m[0] == "finding") == sigs, emitted
    assert len(os.listdir(corpus / "findings")) == 1 and r.hlen("kvaudit:t:findings") == 1
    assert hubs.campaign_status(r, "t")["pending"] == [] and worker.counts["new"] == 2


def test_malformed_entries_in_redis_are_skipped_with_a_warning(redis_server, tmp_path):
    r = redis_server.client()
    r.hset("kvaudit:t:findings", "leak/bad", "{not json")
    r.hset("kvaudit:t:findings", "leak/worse", json.dumps({"format": "kvaudit.replay/1", "config": 3}))
    r.hset("kvaudit:t:findings", "leak/x", json.dumps(_doc()))
    r.rpush("kvaudit:t:programs", "[1, 2", json.dumps({"name": "p", "program": [{"op": "launch"}]}),
            json.dumps({"name": "q", "program": [{"op": "submit"}, {"op": "idle"}]}))
    h = _hub(redis_server)
    pulled = h.pull_findings(str(tmp_path / "f"))
    assert [os.path.basename(p) for p in pulled] == [replay.file_name("leak/x")]
    assert len(h.warnings) == 2 and all("malformed finding" in w for w in h.warnings)
    from kvaudit.search.corpus_fuzz import CorpusStore

    store = CorpusStore(str(tmp_path / "programs"), mirror=h)
    assert store.load_new() == [[Submit(), Idle()]]
    assert store.skipped == ["redis:p"]  # valid JSON, not a program
    assert len(h.warnings) == 3 and "malformed corpus program" in h.warnings[-1]


def test_a_finding_of_an_unknown_kind_in_redis_is_skipped_with_one_warning(redis_server, tmp_path):
    """The kind check moved into Finding.from_dict: a hub's loader still skips such an entry with one line."""
    doc = _doc()
    doc["findings"][0]["kind"] = "bogus"
    redis_server.client().hset("kvaudit:t:findings", "leak/bogus", json.dumps(doc))
    h = _hub(redis_server)
    assert h.pull_findings(str(tmp_path / "f")) == []
    (line,) = h.warnings
    assert "skipped a malformed finding in Redis (leak/bogus)" in line and 'unknown kind "bogus"' in line
    assert "\n" not in line


def test_the_campaign_name_is_printed_as_typed_in_the_fuzz_banner_the_pull_line_and_the_status(redis_server,
                                                                                                   tmp_path):
    """The lines named the campaign in Python's quotes ('t'), then as JSON (non-ASCII escaped: "caf\\u00e9");
    a name is one word (no whitespace or control character), printed as typed, rich markup included."""
    name = "café-[b]ü"
    r = redis_server.client()
    r.hset(f"kvaudit:{name}:findings", "leak/x", json.dumps(_doc()))
    r.sadd(f"kvaudit:{name}:workers", "host/1/0")  # (pull refuses a campaign no worker joined)
    pull = invoke(*["campaign", "pull", "--db", redis_server.url, "--campaign", name, str(tmp_path / "pulled")])
    assert pull.exit_code == 0 and f"pulled campaign {name}: 1 new replay file(s)" in pull.output, pull.output
    run = invoke(*["fuzz", *HISPARSE, "--fuzzer", "random", "--db", redis_server.url, "--campaign", name,
                   "--max-time", "1", "--corpus", str(tmp_path / "c")])
    assert f"shared as {name} through {redis_server.url}" in run.output, run.output
    lines = invoke(*["campaign", "status", "--db", redis_server.url, "--campaign", name]).output.splitlines()
    assert lines and all(line.startswith(f"campaign {name}: ") for line in lines), lines


@pytest.mark.parametrize("full_at", ["a replay file", "a corpus program"])
def test_a_pull_onto_a_full_disk_says_so_and_names_the_file(redis_server, tmp_path, monkeypatch, full_at):
    """On a full disk the pull said "Redis went away during the pull" (exit 69; the disk's OSError was caught as
    Redis's), or, with only the programs unwritable, "3 new corpus program(s)" with exit 0 (the tester): exit 74,
    naming the file not written and what was kept."""
    import errno

    r = redis_server.client()
    r.sadd("kvaudit:t:workers", "host/1/0")
    for sig in ("leak/x", "leak/y"):
        r.hset("kvaudit:t:findings", sig, json.dumps(_doc(sig)))
    h = _hub(redis_server)
    for i, ops in enumerate(([{"op": "idle"}], [{"op": "submit"}, {"op": "idle"}], [{"op": "flush_cache"}])):
        h.share_program(f"p{i}.json", ops)
    h.flush_programs()
    real = os.replace
    full = "findings" if full_at == "a replay file" else "programs"

    def replace(tmp, path):  # (the atomic writer's last step: a full disk there names no file)
        folder = os.path.dirname(path)
        if os.sep + full + os.sep in path and any(not n.name.startswith(".tmp-") for n in os.scandir(folder)):
            raise OSError(errno.ENOSPC, "No space left on device")  # the 2nd file on
        return real(tmp, path)

    monkeypatch.setattr(os, "replace", replace)
    pull = invoke(*["campaign", "pull", "--db", redis_server.url, "--campaign", "t", str(tmp_path / "d")])
    assert pull.exit_code == 74, pull.output
    line = one_error_line(pull)
    assert line.startswith(f"kvaudit: error: disk full: cannot write {tmp_path / 'd' / full}{os.sep}"), line
    assert "Redis" not in line and "kept what was written" in line
    if full_at == "a corpus program":
        assert "2 of 3 corpus program(s) not written" not in line and "1 of 3 corpus program(s) in" in line


def test_a_pull_whose_redis_goes_away_midway_exits_69_in_one_line(redis_server, tmp_path, monkeypatch):
    """docs/reference/exit-codes.md gives `campaign pull` 69 for Redis unreachable; Redis going away after the
    replay files were pulled (the corpus programs not read) is 69 too, in one line, not a partial pull's exit 0."""
    r = redis_server.client()
    r.sadd("kvaudit:t:workers", "host/1/0")
    r.hset("kvaudit:t:findings", "leak/x", json.dumps(_doc("leak/x")))
    real = hubs.Hub.pull_findings

    def then_redis_stops(self, *a, **k):
        got = real(self, *a, **k)
        redis_server.stop()
        return got

    monkeypatch.setattr(hubs.Hub, "pull_findings", then_redis_stops)
    pull = invoke(*["campaign", "pull", "--db", redis_server.url, "--campaign", "t", str(tmp_path / "d")])
    assert pull.exit_code == 69, pull.output
    assert one_error_line(pull) == f"kvaudit: error: --db {redis_server.url}: Redis went away during the pull"


def test_a_workers_first_heartbeat_names_its_fuzzer(redis_server, tmp_path, monkeypatch):
    """`campaign status` showed `fuzzer=- executions=0` for a live worker until its second heartbeat, ttl/3 s on
    (the tester): the worker's fields were set after start() had sent the first."""
    from kvaudit.search import hub as hubs

    first = []
    real = hubs.Hub.start

    def start(self):
        first.append(dict(self._beat))
        return real(self)

    monkeypatch.setattr(hubs.Hub, "start", start)
    r = invoke(*["fuzz", *HISPARSE, "--fuzzer", "random", "--db", redis_server.url, "--campaign", "beat",
                 "--max-time", "1", "--corpus", str(tmp_path / "c")])
    assert r.exit_code in (0, 1), r.output
    assert first and first[0].get("fuzzer") == "random" and "host" in first[0], first


def test_writes_made_while_redis_is_away_are_uploaded_when_it_returns(redis_server, tmp_path):
    h = _hub(redis_server)
    assert h.claim(["leak/x"], _doc()) == ["leak/x"]
    redis_server.stop()
    assert h.claim(["leak/y"], _doc()) == ["leak/y"]  # offline: the host's own
    assert h.register(["leak/x"], json.dumps(_doc())) is None  # offline: queued, no exception
    h.share_program("p.json", [{"op": "idle"}])
    h.flush_programs()
    assert not h.online and h.known() == set()
    redis_server.start()
    time.sleep(hubs.RETRY_EVERY + 0.1)
    assert h.known() == {"leak/x"} and h.online
    r = redis_server.client()
    assert r.hexists("kvaudit:t:findings", "leak/x") and r.llen("kvaudit:t:programs") == 1


def _stop_when(monkeypatch, predicate):
    """fuzz's campaign stopped as Ctrl-C stops it once ``predicate(stats)`` holds (asked each time a
    worker reports), instead of by a fixed budget that start-up under load may eat."""
    import kvaudit.search.campaign as campaign

    real = campaign.run_campaign

    def run(*a, on_progress, **k):
        def progress(stats):
            on_progress(stats)
            if predicate(stats):
                raise KeyboardInterrupt

        return real(*a, on_progress=progress, **k)

    monkeypatch.setattr(campaign, "run_campaign", run)


@pytest.mark.parametrize("workers,db", [(2, True), pytest.param(4, True, marks=pytest.mark.slow),
                                        pytest.param(2, False, marks=pytest.mark.slow)],
                         ids=["2-workers", "4-workers", "2-local"])  # (on 2 cores, 4 workers' start-up alone is 20 s)
def test_workers_that_all_find_one_bug_with_two_signatures_report_it_once(workers, db, redis_server, tmp_path,
                                                                          monkeypatch):
    """The bug raises two signatures in one program (the HiSparse device buffer and host pool): two workers
    that found it each claimed one, each wrote a file holding both, "4 finding(s) in 2 signature(s)"."""
    r, campaign = redis_server.client(), f"once-{workers}"

    def every_worker_searched_past_the_bug(stats):  # (found it, or learnt it from the fleet meanwhile)
        st = hubs.campaign_status(r, campaign)
        beats = [b for b in st["workers"].values() if b]
        return (len(beats) == workers and len(st["known"]) == 2 and not st["pending"]
                and all(b.get("executions", 0) >= 100 for b in beats))

    landed = []

    def found_and_searched_on(stats):  # (no Redis to ask: 200 more executions once both signatures landed)
        if stats.findings >= 2 and not landed:
            landed.append(stats.executions)
        return bool(landed) and stats.executions >= landed[0] + 200

    _stop_when(monkeypatch, every_worker_searched_past_the_bug if db else found_and_searched_on)
    monkeypatch.setenv("KVAUDIT_FLEET_TTL", "3")  # heartbeats every second
    corpus = tmp_path / "c"
    res = invoke("fuzz", *HISPARSE, "--fuzzer", "random", "--workers", str(workers), "--max-time", "120",
                 "--corpus", str(corpus),
                 *(["--db", redis_server.url, "--campaign", campaign] if db else []))
    assert res.exit_code == 1, res.output
    status = hubs.campaign_status(r, campaign)
    assert "interrupted:" in res.output, (status, res.output[-3000:])  # stopped by the event, not the budget
    (path,) = (corpus / "findings").iterdir()  # one file
    recorded = [f.signature for f in replay.load(str(path))[2]]
    assert len(recorded) == len(set(recorded)) == 2, recorded  # its findings once
    assert sorted(re.findall(r"new finding: (\S+)", res.stderr)) == sorted(recorded), res.stderr
    summary = [line for line in res.output.splitlines() if line.startswith("SUMMARY:")]
    assert summary[-1].startswith("SUMMARY: kvaudit: 2 finding(s) (2 leak) in 2 signature(s);"), summary
    if db:
        assert status["known"] == sorted(recorded) and r.hlen(f"kvaudit:{campaign}:findings") == 1
        assert all(b["state"] == "exited" for b in status["workers"].values()), status


def test_fuzz_db_errors_are_one_line(redis_server, tmp_path):
    bad = invoke(*["fuzz", *HISPARSE, "--db", "http://example", "--max-time", "2", "--out", str(tmp_path / "o")])
    assert bad.exit_code == 2 and "want a Redis URL" in bad.output
    down = invoke(*["fuzz", *HISPARSE, "--db", "redis://127.0.0.1:1/0", "--max-time", "2", "--out", str(tmp_path / "o")])
    assert down.exit_code == 69 and "Traceback" not in down.output
    assert '--db "redis://127.0.0.1:1/0": cannot reach Redis' in down.output, down.output  # the URL as JSON
    # bad input, not an unreachable Redis (a non-numeric port exited 69)
    port = invoke(*["fuzz", *HISPARSE, "--db", "redis://:pw@127.0.0.1:abc/0", "--max-time", "2",
                    "--out", str(tmp_path / "o")])
    assert port.exit_code == 2 and "Port could not be cast" in one_error_line(port) and "pw" not in port.output
    index = invoke(*["campaign", "status", "--db", redis_server.url.replace("/0", "/99999")])
    assert index.exit_code == 2 and "DB index is out of range" in one_error_line(index)


@pytest.mark.parametrize("url, why", [
    ("redis://127.0.0.1:6399/0?foo=bar", 'unknown option "foo"; the options are db, '),
    ("redis://127.0.0.1:6399/0?ssl_ca_certs=/x.pem", 'unknown option "ssl_ca_certs" (a TLS option: use rediss://)'),
    ("redis://127.0.0.1:6399/0?db=1&db=2", 'option "db" is given twice'),
    ("redis://127.0.0.1:6399/0?client_name=", 'option "client_name" has no value'),
    ("redis://127.0.0.1:6399/abc", 'the database index "abc" is not a number'),
    ("redis://127.0.0.1:6399/-1", 'the database index "-1" is not a number'),
    ("redis://127.0.0.1:6399?db=x", 'the database index "x" is not a number'),
    ("redis://127.0.0.1:0/0", "port 0 is not a port"),
    ("redis://127.0.0.1:70000/0", "Port out of range"),
    ("unix://", "a unix:// URL names the socket's path"),
])
@pytest.mark.parametrize("command", [["campaign", "status"], ["fuzz", *HISPARSE, "--max-time", "1"]])
def test_a_bad_redis_url_is_one_line_exit_2_without_a_server(command, url, why, tmp_path):
    """?foo=bar was an internal error (exit 70: redis-py's TypeError at the first command) and /abc was
    database 0 (exit 0 with Redis up, 69 with it down): both are the URL's fault, whatever the server's state.
    No server listens on these ports: the URL is refused before any connection."""
    r = invoke(*command, "--db", url, "--out", str(tmp_path / "o")) if command[0] == "fuzz" else \
        invoke(*command, "--db", url)
    assert r.exit_code == 2, r.output
    line = one_error_line(r)
    assert line.startswith(f"kvaudit: error: --db {json.dumps(url)}: ") and why in line, line
    assert not (tmp_path / "o").exists()


def test_the_redis_urls_kvaudit_takes_pass_the_check():
    for url in ("redis://127.0.0.1:6379/0", "redis://:pw@host:6379/15", "redis://host", "redis://host/",
                "rediss://:pw@127.0.0.1:6380/0?ssl_ca_certs=/ca.pem&ssl_cert_reqs=required",
                "redis://127.0.0.1:6379?db=3&socket_timeout=2&client_name=kvaudit", "unix:///run/redis.sock?db=1"):
        hubs.check_url(url)


def test_an_unusable_campaign_name_is_refused_in_one_line(tmp_path):
    """--campaign '' was accepted (every key became kvaudit::...)."""
    for args in (["fuzz", *HISPARSE, "--max-time", "1", "--out", str(tmp_path)],
                 ["ci", "--max-time", "1", "--out", str(tmp_path)],
                 ["campaign", "status", "--db", "redis://127.0.0.1:1/0"]):
        for name, why in (("", "needs a name"), ("night ly", 'name (it has " ")'),
                          ("a\x1b[31m", 'control characters in a campaign name (it has "\\u001b")'),
                          ("x" * 201, "at most 200")):
            r = invoke(*args, "--campaign", name)
            assert r.exit_code == 2 and why in one_error_line(r), (args, name, r.output)
    assert hubs.check_campaign_name("nightly/pd-decode") == "nightly/pd-decode"  # ci's NAME/<preset>


def test_a_worker_that_stops_says_exited_at_once_and_a_killed_one_ages_out_to_gone(redis_server):
    """Exited workers showed `alive` until their heartbeat expired (30 s)."""
    stopped, killed = _hub(redis_server, "host/1/0", ttl=1).start(), _hub(redis_server, "host/2/0", ttl=1).start()
    stopped.stop()
    killed._stop.set()  # kill -9: no last heartbeat
    killed._thread.join()
    r = redis_server.client()
    workers = hubs.campaign_status(r, "t")["workers"]
    assert workers["host/1/0"]["state"] == "exited" and workers["host/2/0"]["state"] == "alive"
    assert r.ttl("kvaudit:t:worker:host/1/0") == -1  # for good: it does not turn into "gone"
    assert _wait(lambda: hubs.campaign_status(r, "t")["workers"]["host/2/0"] is None, 5)
    lines = invoke(*["campaign", "status", "--db", redis_server.url, "--campaign", "t"]).output.splitlines()
    assert any("worker=host/1/0 state=exited fuzzer=" in line for line in lines), lines
    assert "campaign t: worker=host/2/0 state=gone" in lines, lines


def test_status_of_a_campaign_no_worker_ever_joined_is_one_line_naming_the_ones_there(redis_server):
    """A typo in --campaign printed an empty campaign's zeros with exit 0."""
    redis_server.client().sadd("kvaudit:nightly/default:workers", "host/1/0")
    typo = invoke(*["campaign", "status", "--db", redis_server.url, "--campaign", "nightly/defualt"])
    assert typo.exit_code == 2, typo.output
    assert one_error_line(typo).startswith('kvaudit: error: --campaign "nightly/defualt": no worker ever joined it in "redis://')
    assert 'campaigns there: "nightly/default"' in typo.output
    assert invoke(*["campaign", "status", "--db", redis_server.url, "--campaign", "nightly/defualt", "--json"]
                  ).exit_code == 2
    ok = invoke(*["campaign", "status", "--db", redis_server.url, "--campaign", "nightly/default"])
    assert ok.exit_code == 0 and "state=gone" in ok.output, ok.output


def test_pull_of_a_campaign_no_worker_ever_joined_is_refused_as_status_refuses_it(redis_server, tmp_path):
    """`campaign pull --campaign typo` pulled 0 files with exit 0 (and made DIR/findings/) where status refused."""
    redis_server.client().sadd("kvaudit:nightly/default:workers", "host/1/0")
    typo = invoke(*["campaign", "pull", "--db", redis_server.url, "--campaign", "nightly/defualt", str(tmp_path / "d")])
    assert typo.exit_code == 2, typo.output
    assert one_error_line(typo).startswith('kvaudit: error: --campaign "nightly/defualt": no worker ever joined it in "redis://')
    assert 'campaigns there: "nightly/default"' in typo.output and not (tmp_path / "d").exists()
    ok = invoke(*["campaign", "pull", "--db", redis_server.url, "--campaign", "nightly/default", str(tmp_path / "d")])
    assert ok.exit_code == 0 and "pulled campaign nightly/default: 0 new replay file(s)" in ok.output, ok.output


@pytest.mark.slow  # an end-to-end campaign of several processes: 10-15 s
def test_three_hosts_report_each_signature_once_and_pull_brings_both_files(redis_server, tmp_path):
    """Three processes, each in its own working directory with its own corpus, share only the URL."""
    procs = []
    for i in range(3):
        home = tmp_path / f"host{i}"
        home.mkdir()
        env = {**plain_env(), "KVAUDIT_FLEET_TTL": "5"}
        procs.append(subprocess.Popen(
            [kvaudit_script(), "fuzz", *HISPARSE, "--fuzzer", "random", "--max-time", "300", "--seed", str(i + 1),
             "--db", redis_server.url, "--campaign", "three", "--corpus", "corpus"],
            cwd=home, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    r = redis_server.client()

    def triaged_and_every_host_searching():  # two signatures (one file may hold both), nothing in triage
        status = hubs.campaign_status(r, "three")
        beats = [b for b in status["workers"].values() if b]
        return (len(status["known"]) >= 2 and not status["pending"] and len(beats) == 3
                and all(b.get("executions", 0) > 0 for b in beats))

    done, outs = _stop_at(triaged_and_every_host_searching, procs)
    new = [re.findall(r"new finding: (\S+)", err) for _, err in outs]
    reported = [s for n in new for s in n]
    status = hubs.campaign_status(r, "three")
    assert done, (status, [e[-2000:] for _, e in outs])
    assert sorted(reported) == sorted(set(reported)), new  # each signature reported once across the hosts
    assert set(reported) == set(status["known"]), (new, status)
    assert len(status["workers"]) == 3 and status["pending"] == []
    pull = invoke(*["campaign", "pull", "--db", redis_server.url, "--campaign", "three", str(tmp_path / "pulled")])
    assert pull.exit_code == 0, pull.output
    files = sorted((tmp_path / "pulled" / "findings").iterdir())
    assert {f.signature for p in files for f in replay.load(str(p))[2]} == set(status["known"])
    for f in files:
        r = invoke(*["replay", str(f)])
        assert r.exit_code == 1, r.output  # the finding reproduces
    table = invoke(*["campaign", "status", "--db", redis_server.url, "--campaign", "three"])
    assert table.exit_code == 0 and table.output.count("state=exited") == 3, table.output  # all stopped cleanly
    assert "findings=" in table.output.splitlines()[-1] and "\x1b" not in table.output  # plain lines in a log


SLOW_TRIAGE = '''
import os, time
import kvaudit.search.campaign as _c
_triage = _c.triage
def triage(*a, **k):
    open(os.environ["KVAUDIT_TEST_TRIAGE_MARK"], "w").close()
    time.sleep(float(os.environ["KVAUDIT_TEST_TRIAGE_SLEEP"]))
    return _triage(*a, **k)
_c.triage = triage
'''


def _host(tmp_path, name, url, args, sleep=None, ttl="2"):
    """A kvaudit fuzz --db process in its own working directory (a "host"); ``sleep``: its triage
    first sleeps that many seconds (a sitecustomize on its PYTHONPATH), after touching ``mark``."""
    home = tmp_path / name
    home.mkdir()
    env = {**plain_env(), "KVAUDIT_FLEET_TTL": ttl}
    mark = home / "triaging"
    if sleep is not None:
        (home / "site").mkdir()
        (home / "site" / "sitecustomize.py").write_text(SLOW_TRIAGE)
        env.update(PYTHONPATH=str(home / "site") + os.pathsep + env.get("PYTHONPATH", ""),
                   KVAUDIT_TEST_TRIAGE_MARK=str(mark), KVAUDIT_TEST_TRIAGE_SLEEP=str(sleep))
    proc = subprocess.Popen([kvaudit_script(), "fuzz", *args, "--db", url, "--campaign", "faults", "--corpus", "corpus"],
                            cwd=home, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    return proc, mark, home


def _wait(predicate, timeout):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def _stop_at(event, procs, timeout=240):
    """Wait for ``event()`` (a state of the campaign in Redis), then stop ``procs`` as Ctrl-C stops them
    (SIGTERM: what they found is reported, exit 1 with a new finding); returns whether the event came
    and their (stdout, stderr). A fixed ``--max-time`` made them fail under load (the TLS test's 6 s went
    to start-up when the budget counted it; a loaded machine's pace bounds no budget either)."""
    came = _wait(lambda: event() or any(p.poll() is not None for p in procs), timeout) and event()
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    return came, [p.communicate(timeout=120) for p in procs]


def test_a_host_killed_mid_triage_has_its_signature_reclaimed_and_reported_by_another(redis_server, tmp_path):
    a, mark, _ = _host(tmp_path, "a", redis_server.url, [*HISPARSE, "--fuzzer", "random", "--max-time", "60"],
                       sleep=60)
    r = redis_server.client()
    assert _wait(lambda: mark.exists() and r.hlen("kvaudit:faults:pending") > 0, 60), a.stderr.read() if a.poll() else ""
    claimed = {k.decode() for k in r.hkeys("kvaudit:faults:pending")}
    os.killpg(a.pid, signal.SIGKILL)  # kill -9 of the whole host mid-triage
    a.wait()
    # host b fuzzes a clean preset: it cannot find the bug itself; it re-claims the dead host's
    b, _, _ = _host(tmp_path, "b", redis_server.url, ["--preset", "default", "--fuzzer", "random", "--max-time", "300"])

    def reclaimed():
        status = hubs.campaign_status(r, "faults")
        return claimed <= set(status["known"]) and not status["pending"]

    done, [(_, err)] = _stop_at(reclaimed, [b])
    reported = set(re.findall(r"new finding: (\S+)", err))
    assert done and claimed <= reported, err[-3000:]
    status = hubs.campaign_status(r, "faults")
    assert claimed <= set(status["known"]) and status["pending"] == []
    gone = [w for w, beat in status["workers"].items() if beat is None]
    assert len(gone) == 1 and f"/{a.pid}/" in gone[0], status["workers"]  # the dead host shows as gone
    table = invoke(*["campaign", "status", "--db", redis_server.url, "--campaign", "faults"])
    assert table.exit_code == 0 and "gone" in table.output, table.output


def test_a_worker_that_loses_redis_says_so_and_at_its_end_what_it_could_not_send(redis_server):
    """tester 56: Redis killed mid-campaign, and the summary read like a fully shared run."""
    a = _hub(redis_server, "a")
    assert a.register(["leak/x"], json.dumps(_doc())) == ["leak/x"] and not a.warnings
    redis_server.stop()
    assert a.register(["leak/y"], json.dumps(_doc())) is None  # offline: queued
    assert len(a.warnings) == 1 and a.warnings[0].startswith("Redis unreachable from "), a.warnings
    a.register(["leak/z"], json.dumps(_doc()))
    assert len(a.warnings) == 1  # (once per outage)
    a.stop()
    assert a.warnings[1].startswith("Redis still unreachable at the end: ") and "not sent" in a.warnings[1]


@pytest.mark.slow  # an end-to-end campaign of several processes: 10-15 s
def test_redis_stopped_for_10_s_mid_campaign_loses_no_finding(redis_server, tmp_path):
    a, mark, home = _host(tmp_path, "a", redis_server.url, [*HISPARSE, "--fuzzer", "random", "--max-time", "300"],
                          sleep=1, ttl="3")
    assert _wait(lambda: mark.exists(), 120)
    redis_server.stop()  # mid-triage: the upload happens while Redis is away
    time.sleep(10)
    redis_server.start()  # no persistence: an empty Redis comes back
    r = redis_server.client()
    done, [(_, err)] = _stop_at(lambda: r.exists("kvaudit:faults:known"), [a])  # the queued upload
    assert done and a.returncode == 1, err[-3000:]
    reported = set(re.findall(r"new finding: (\S+)", err))
    local = {f.signature for p in (home / "corpus" / "findings").iterdir() for f in replay.load(str(p))[2]}
    assert reported and reported <= local  # each host keeps its local files
    uploaded = {k.decode() for k in r.smembers("kvaudit:faults:known")}
    assert reported <= uploaded, (reported, uploaded)  # and uploads them after reconnecting
    assert re.search(r"warning: Redis unreachable from \S+ \(\w+\): worker \d+ searched on alone", err), err[-3000:]


def test_a_malformed_entry_planted_in_redis_is_rejected_with_a_warning_and_the_campaign_goes_on(redis_server, tmp_path):
    r = redis_server.client()
    r.hset("kvaudit:faults:findings", "leak/planted", "{not json")
    r.rpush("kvaudit:faults:programs", "not a program")
    a, _, _ = _host(tmp_path, "a", redis_server.url, [*HISPARSE, "--fuzzer", "corpus", "--max-time", "300"])
    done, [(_, err)] = _stop_at(lambda: r.scard("kvaudit:faults:known") and not r.hlen("kvaudit:faults:pending"), [a])
    assert done and a.returncode == 1, err[-3000:]  # it found the bug all the same
    assert "warning: skipped a malformed finding in Redis (leak/planted)" in err
    assert "warning: skipped a malformed corpus program in Redis" in err
    assert "Traceback" not in err


@pytest.mark.slow  # an end-to-end campaign of several processes: 10-15 s
def test_ci_shards_share_each_presets_campaign(redis_server, tmp_path):
    """Two `kvaudit ci --db` shards (a matrix job's) fuzz the same clean preset: both join its campaign
    ``nightly/<preset>`` in Redis; an unreachable Redis is one line and exit 69."""
    env = {**plain_env(), "KVAUDIT_FLEET_TTL": "3"}
    url = redis_server.url
    shards = []
    for i in range(2):  # at once, as a matrix job's shards run
        home = tmp_path / f"shard{i}"
        home.mkdir()
        shards.append(subprocess.Popen(
            [kvaudit_script(), "ci", "--presets", "pd-decode-hisparse", "--max-time", "8", "--seed", str(i),
             "--regressions", str(home), "--db", url, "--campaign", "nightly", "--out", "out"],
            cwd=home, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [(s.communicate(timeout=300)[1], s.returncode) for s in shards]
    # the clean preset: neither shard finds anything; both ran their campaign in Redis under nightly/<preset>
    assert all(rc == 0 for _, rc in outs), [err[-2000:] for err, _ in outs]
    status = hubs.campaign_status(redis_server.client(), "nightly/pd-decode-hisparse")
    assert len(status["workers"]) == 2
    bad = subprocess.run([kvaudit_script(), "ci", "--presets", "pd-decode-hisparse", "--max-time", "1",
                          "--regressions", str(tmp_path), "--db", "redis://127.0.0.1:1/0"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 69 and "cannot reach Redis" in bad.stderr and "Traceback" not in bad.stderr


def test_libfuzzer_corpora_sync_both_ways_and_bad_names_from_redis_are_refused(redis_server, tmp_path):
    a, b = _hub(redis_server, "a"), _hub(redis_server, "b")
    da, db = tmp_path / "a", tmp_path / "b"
    da.mkdir()
    (da / "0123abcd").write_bytes(b"\x00\x01program")
    (da / ".hidden").write_bytes(b"x")  # libFuzzer's temporaries stay local
    assert a.sync_dir("atheris", str(da)) == (1, 0)
    r = redis_server.client()
    r.hset("kvaudit:t:atheris", "../escape", b"x")
    r.hset("kvaudit:t:atheris", "ffee", b"\xff")
    assert b.sync_dir("atheris", str(db)) == (0, 2)
    assert sorted(p.name for p in db.iterdir()) == ["0123abcd", "ffee"]
    assert (db / "0123abcd").read_bytes() == b"\x00\x01program"
    assert not (tmp_path / "escape").exists() and any("bad name" in w for w in b.warnings)
    assert a.sync_dir("atheris", str(da)) == (0, 1)  # b's download is a's too


def test_a_password_and_tls_url_works_and_a_wrong_password_is_one_masked_line(tmp_path):
    from redis_helpers import RedisServer

    d = tmp_path / "redis"
    d.mkdir()
    server = RedisServer(str(d), password="s3cret-pw", tls=True).start()
    try:
        assert server.url.startswith("rediss://:s3cret-pw@")
        run = subprocess.Popen([kvaudit_script(), "fuzz", *HISPARSE, "--fuzzer", "random", "--max-time", "300",
                                "--db", server.url, "--campaign", "tls", "--corpus", str(tmp_path / "c")],
                               env=plain_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        r = server.client()
        done, [(out, err)] = _stop_at(lambda: r.exists("kvaudit:tls:known") and not r.exists("kvaudit:tls:pending"),
                                      [run])
        assert done and run.returncode == 1, err[-2000:]
        assert "s3cret-pw" not in out + err  # the banner names the URL masked
        wrong = server.url.replace("s3cret-pw", "wrong-pw")
        bad = invoke(*["fuzz", *HISPARSE, "--db", wrong, "--max-time", "2", "--out", str(tmp_path / "o")])
        assert bad.exit_code == 69 and "wrong-pw" not in bad.output, bad.output
        assert re.search(r"kvaudit: error: --db \"rediss://:\*\*\*@127\.0\.0\.1:\d+/0[^\"\s]*\": (authentication failed|cannot reach)",
                         bad.output), bad.output
    finally:
        server.stop()


def test_the_example_database_is_local_and_redis_and_survives_an_outage(redis_server, tmp_path):
    h = _hub(redis_server)
    db = h.example_database(str(tmp_path / "hypothesis"))
    db.save(b"k", b"v1")
    other = _hub(redis_server, "b").example_database(str(tmp_path / "elsewhere"))
    assert set(other.fetch(b"k")) == {b"v1"}  # another host sees it through Redis
    redis_server.stop()
    db.save(b"k", b"v2")  # Redis away: the local database keeps it, the Redis save is queued
    assert set(db.fetch(b"k")) == {b"v1", b"v2"}
    redis_server.start()
    time.sleep(hubs.RETRY_EVERY + 0.1)
    h.known()  # any call reconnects and redoes the queued writes
    assert set(other.fetch(b"k")) == {b"v2"}  # (the restarted Redis kept nothing: no persistence)


def test_a_host_that_met_a_held_signature_in_its_last_round_ends_with_its_file(redis_server, tmp_path, monkeypatch):
    """The workers pull the fleet's files between rounds only: a signature met while another host held it,
    and registered by that host after this one's last round, ended without its file here and was counted
    nowhere ('0 new, 0 known', tester stop 55). The campaign's end pulls it, as the fleet's."""
    from kvaudit.search import campaign

    src = os.path.join(os.path.dirname(__file__), "..", "corpora", "regressions", "hisparse-prebuilt-skip-finish.json")
    config, program, findings, _ = replay.load(src)
    sigs = sorted({f.signature for f in findings})
    other = _hub(redis_server, "a", campaign="end")
    assert other.claim(sigs, replay.to_doc(config, program, findings, minimized=False)) == sigs

    def last_round(spec, emit):  # this host meets them while held; the other host registers its file after
        emit(("ready", spec.index))
        for s in sigs:
            emit(("duplicate", spec.index, s))
        with open(src, encoding="utf-8") as fh:
            assert other.register(sigs, fh.read()) is not None
        emit(("done", spec.index))

    monkeypatch.setattr(campaign, "_search_loop", last_round)
    corpus = tmp_path / "c"
    result = campaign.run_campaign(config, "random", 5.0, 0, 1, str(corpus), db=redis_server.url, campaign="end")
    files = os.listdir(corpus / "findings")
    assert len(files) == 1 and sorted(result.fleet) == sigs, (files, result.fleet)
    assert not result.new and all(result.duplicates[s] == 1 for s in sigs)
    # the host's summary counts them (it read '0 new, 0 known signature(s)')
    redis_server.client().delete("kvaudit:end:findings", "kvaudit:end:known")
    assert other.claim(sigs, replay.to_doc(config, program, findings, minimized=False)) == sigs
    r = invoke("fuzz", *HISPARSE, "--fuzzer", "random", "--max-time", "5", "--corpus", str(tmp_path / "c2"),
               "--db", redis_server.url, "--campaign", "end", "--json", str(tmp_path / "r.json"))
    assert f"0 new, 0 known signature(s), {len(sigs)} found by another host" in r.output, r.output + r.stderr
    # and --json says so too (it had neither key nor signatures: tester, stop 55)
    doc = json.load(open(tmp_path / "r.json"))
    assert sorted(doc["found_by_another_host"]) == sigs, doc.keys()
    assert all(p.startswith(str(tmp_path / "c2" / "findings")) for p in doc["found_by_another_host"].values())


def test_status_shows_a_workers_figures_of_two_seconds_ago_not_of_its_last_claim_renewal(redis_server):
    """`campaign status` read mid-run showed a worker's figures of up to ttl/3 s ago (10 s at the default ttl):
    the heartbeat that carries them was sent only as often as the claims need renewing (first tester, stop 55).
    Now every BEAT_EVERY s (2)."""
    from kvaudit.search import hub as hubs

    w = _hub(redis_server, "w", campaign="fresh").start()
    try:
        w.beat(executions=5, ops=50)
        time.sleep(getattr(hubs, "BEAT_EVERY", 2.0) + 0.8)  # (getattr: the test ran before it)
        beat = hubs.campaign_status(redis_server.client(), "fresh")["workers"]["w"]
    finally:
        w.stop()
    assert beat["executions"] == 5 and beat["ops"] == 50, beat


def test_a_pull_never_skips_a_fleet_file_for_another_target_kinds_file_of_its_name(redis_server, tmp_path):
    """tester 61c C2: SGLang's replay file under the name of an eut finding in DIR/findings/ made the pull skip
    the fleet's file (the path existed), and `fuzz --corpus DIR` then never knew the finding. It is pulled beside
    it as <name>.2.json now, once; the other kind's file and a note of the next name are left as they are."""
    from kvaudit.search.campaign import known_signatures

    here = os.path.dirname(__file__)
    eut = os.path.join(here, "..", "corpora", "regressions", "hisparse-prebuilt-skip-finish.json")
    sglang = os.path.join(here, "..", "corpora", "sglang", "aliasing-a1-rejected-turn-clears-inflight.json")
    config, program, findings, doc = replay.load(eut)
    sig = findings[0].signature
    r = redis_server.client()
    r.hset("kvaudit:k:findings", sig, json.dumps(doc))
    r.sadd("kvaudit:k:workers", "host/1/0")
    found = tmp_path / "B" / "findings"
    found.mkdir(parents=True)
    name = replay.file_name(sig)[:-len(".json")]
    (found / f"{name}.json").write_bytes(open(sglang, "rb").read())
    (found / f"{name}.2.json").write_text("my notes")
    pull = invoke(*["campaign", "pull", "--db", redis_server.url, "--campaign", "k", str(tmp_path / "B")])
    assert pull.exit_code == 0 and "pulled campaign k: 1 new replay file(s)" in pull.output, pull.output
    # (stop 61's note: it said "(3 in DIR/findings)", counting the files the campaign skips)
    assert (f"(1 in {found}; 2 other file(s) there, not counted: another target kind's or not replay files)"
            in pull.output), pull.output
    assert json.load(open(found / f"{name}.3.json")) == doc
    assert (found / f"{name}.json").read_bytes() == open(sglang, "rb").read()
    assert (found / f"{name}.2.json").read_text() == "my notes"
    assert known_signatures(str(tmp_path / "B"), target="eut")[sig] == str(found / f"{name}.3.json")
    again = invoke(*["campaign", "pull", "--db", redis_server.url, "--campaign", "k", str(tmp_path / "B")])
    assert again.exit_code == 0 and "pulled campaign k: 0 new replay file(s) (1 in" in again.output, again.output


def test_a_workers_later_pulls_read_no_fleet_file_it_already_has_an_other_kinds_included(redis_server, tmp_path):
    """stop 62's note: each round's pull (campaign.pull_files) fetched and parsed again every fleet file the worker's
    kind does not record (another kind's, already pulled beside it): one HGET per such file per round. A worker's
    hub reads each fleet file once; the campaign's start pulls only what its kind lacks, as the rounds do."""
    from kvaudit.search.campaign import pull_files

    here = os.path.join(os.path.dirname(__file__), "..", "corpora")
    r = redis_server.client()
    for path in (os.path.join(here, "regressions", "hisparse-prebuilt-skip-finish.json"),
                 os.path.join(here, "sglang", "aliasing-a1-rejected-turn-clears-inflight.json")):
        _, _, findings, doc = replay.load(path)
        r.hset("kvaudit:t:findings", findings[0].signature, json.dumps(doc))
    hub = _hub(redis_server)
    first = pull_files(hub, str(tmp_path / "C"), "eut")
    assert len(os.listdir(tmp_path / "C" / "findings")) == 2 and first, first
    r.config_resetstat()
    assert pull_files(hub, str(tmp_path / "C"), "eut") == []
    assert r.info("commandstats").get("cmdstat_hget", {}).get("calls", 0) == 0  # (2 files, 1 HGET each round before)


def test_a_campaigns_start_pulls_only_the_fleet_files_its_kind_lacks(redis_server, tmp_path, monkeypatch):
    """The start's pull fetched every fleet file at each start, the ones DIR/findings/ holds included."""
    from kvaudit.search import campaign

    path = os.path.join(os.path.dirname(__file__), "..", "corpora", "regressions", "hisparse-prebuilt-skip-finish.json")
    config, _, findings, doc = replay.load(path)
    r = redis_server.client()
    r.hset("kvaudit:t:findings", findings[0].signature, json.dumps(doc))
    (tmp_path / "C" / "findings").mkdir(parents=True)
    replay.write_atomic(str(tmp_path / "C" / "findings" / "mine.json"), doc)
    monkeypatch.setattr(campaign, "_search_loop", lambda spec, handle: None)  # (the start's pull only)
    r.config_resetstat()
    result = campaign.run_campaign(config, "random", 1, 0, 1, str(tmp_path / "C"), db=redis_server.url, campaign="t")
    assert findings[0].signature in result.known and os.listdir(tmp_path / "C" / "findings") == ["mine.json"]
    assert r.info("commandstats").get("cmdstat_hget", {}).get("calls", 0) == 0  # (1 before)


def test_a_pull_writes_no_second_copy_of_a_finding_the_folder_holds_under_another_name(redis_server, tmp_path):
    """`campaign pull` looked for the fleet's file under its own name only: a finding kept as DIR/findings/mine.json
    was pulled again beside it, and a campaign over DIR then held two files for one bug."""
    path = os.path.join(os.path.dirname(__file__), "..", "corpora", "regressions", "hisparse-prebuilt-skip-finish.json")
    _, _, findings, doc = replay.load(path)
    r = redis_server.client()
    r.hset("kvaudit:k:findings", findings[0].signature, json.dumps(doc))
    r.sadd("kvaudit:k:workers", "host/1/0")
    (tmp_path / "B" / "findings").mkdir(parents=True)
    replay.write_atomic(str(tmp_path / "B" / "findings" / "mine.json"), doc)
    pull = invoke(*["campaign", "pull", "--db", redis_server.url, "--campaign", "k", str(tmp_path / "B")])
    assert pull.exit_code == 0 and "pulled campaign k: 0 new replay file(s) (1 in" in pull.output, pull.output
    assert os.listdir(tmp_path / "B" / "findings") == ["mine.json"]


@pytest.mark.parametrize("ttl", ["abc", "nan", "inf", "1e308", "0", "-5"])
def test_a_bad_fleet_ttl_is_refused_before_redis_is_reached(monkeypatch, tmp_path, ttl):
    """th64: KVAUDIT_FLEET_TTL=abc (nan, inf, 1e308) was read once the engine was built: 'kvaudit: internal
    error: ValueError: could not convert string to float' (exit 70; 1e308: Redis refused the expiry); 0 and -5
    were taken. Now one line, exit 2, before --db's Redis (unreachable here: 69 else) is reached."""
    monkeypatch.setenv("KVAUDIT_FLEET_TTL", ttl)
    for args in (["fuzz", *HISPARSE, "--max-time", "2", "--out", str(tmp_path / "o")],
                 ["ci", "--max-time", "2", "--presets", "default", "--out", str(tmp_path / "o")]):
        res = invoke(*args, "--db", "redis://127.0.0.1:1/0")
        assert res.exit_code == 2, res.output
        assert one_error_line(res).endswith(f"KVAUDIT_FLEET_TTL={json.dumps(ttl)}: want a number of seconds > 0 and "
                                            "at most 86400")
    with pytest.raises(ValueError, match="^KVAUDIT_FLEET_TTL="):
        hubs.fleet_ttl()
    monkeypatch.setenv(hubs.TTL_ENV, " 2.5 ")
    assert hubs.fleet_ttl() == 2.5
    monkeypatch.delenv(hubs.TTL_ENV)
    assert hubs.fleet_ttl() == hubs.DEFAULT_TTL


def test_a_campaign_without_db_ignores_the_fleet_ttl_it_does_not_use(monkeypatch, tmp_path):
    """tb64: with no --db a campaign (--corpus) read KVAUDIT_FLEET_TTL all the same, and a bad one was 'kvaudit:
    internal error: ValueError: KVAUDIT_FLEET_TTL="abc": ...' (exit 70) though no claim or heartbeat is kept."""
    monkeypatch.setenv("KVAUDIT_FLEET_TTL", "abc")
    res = invoke("fuzz", "--max-time", "1", "--corpus", str(tmp_path / "c"), "--out", str(tmp_path / "o"))
    assert res.exit_code == 0, res.output
