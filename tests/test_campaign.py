"""Fuzzers and campaigns: the random baseline, swarm testing, resumable campaigns (kill -9,
Ctrl-C), determinism checks, ``kvaudit minimize`` and ``kvaudit ci``."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
from cli_helpers import hypothesis_home, invoke, kvaudit_script, one_error_line, plain_env, reached

from kvaudit.targets.eut.presets import PRESETS, get_preset
from kvaudit import replay
from kvaudit.search.campaign import known_signatures, run_campaign
from kvaudit.program.schema import swarm_groups
from kvaudit.search.fuzz import FuzzStats, hypothesis_search, random_search
from kvaudit.program import FlushCache, Step, Submit
from kvaudit.audit.runner import AuditedRun, execute

HERE = os.path.dirname(__file__)
REGRESSIONS = os.path.join(HERE, "..", "corpora", "regressions")
HISPARSE = ["--preset", "pd-decode-hisparse", "--bug", "hisparse-prebuilt-skip-finish"]


def hisparse_config():
    return get_preset("pd-decode-hisparse").config(bugs=frozenset(["hisparse-prebuilt-skip-finish"]))


def test_the_example_database_keeps_a_failure_until_its_finding_is_known(tmp_path):
    # README, "Campaigns": a failing program is saved and replays first in the next round; once
    # its signature is known it replays clean and Hypothesis drops it.
    db = tmp_path / "hypothesis"
    first = hypothesis_search(hisparse_config(), 20, 1, FuzzStats(), database=str(db))
    assert first is not None
    saved = {k: len(v) for k, v in ((k, list(db.glob(k + "/*"))) for k in os.listdir(db))}
    assert sum(saved.values()) > 0
    stats = FuzzStats()
    again = hypothesis_search(hisparse_config(), 20, 2, stats, database=str(db))  # nothing known: replays
    assert again is not None and stats.first_hit is not None and stats.first_hit[0] <= 2
    known = frozenset(f.signature for f in first[1] + again[1])
    hypothesis_search(hisparse_config(), 3, 3, FuzzStats(), database=str(db), known=known)
    assert sum(len(list(db.glob(k + "/*"))) for k in saved) < sum(saved.values())


# -- the random baseline and swarm testing ---------------------------------------------------------

def test_random_search_finds_the_hisparse_bug_and_is_seeded():
    a = random_search(hisparse_config(), 30, 1, FuzzStats())
    b = random_search(hisparse_config(), 30, 1, FuzzStats())
    assert a is not None and a[1][0].signature.startswith("leak/hisparse_")
    assert a[0] == b[0]  # the same seed, the same program
    assert random_search(get_preset("pd-decode-hisparse").config(), 2, 1, FuzzStats()) is None


def test_random_search_skips_known_signatures():
    first = random_search(hisparse_config(), 30, 1, FuzzStats())
    known = frozenset(f.signature for f in first[1])
    again = random_search(hisparse_config(), 3, 1, FuzzStats(), known=known)
    assert again is None or not set(again[1][0].signature) & known


def test_swarm_cases_use_different_subsets_of_op_kinds(monkeypatch):
    kinds_per_run: dict[int, set] = {}
    real_apply = AuditedRun.apply

    def spy(self, op):
        kinds_per_run.setdefault(id(self), set()).add("sessions" if op.kind in ("open_session", "close_session")
                                                       else op.kind)
        return real_apply(self, op)

    monkeypatch.setattr(AuditedRun, "apply", spy)
    # one batch of 80 cases, not a time budget: a 3 s search ran too few cases under load
    from hypothesis import HealthCheck, Phase, Verbosity, seed, settings
    from hypothesis.stateful import run_state_machine_as_test

    from kvaudit.search.fuzz import _machine, _Recorder

    rec = _Recorder(FuzzStats(), deadline=time.monotonic() + 3600)
    machine = seed(5)(_machine(get_preset("streaming-session").config(), rec, max_prompt=40))
    run_state_machine_as_test(machine, settings=settings(
        max_examples=80, stateful_step_count=16, deadline=None, database=None, phases=[Phase.generate],
        suppress_health_check=list(HealthCheck), verbosity=Verbosity.quiet))
    used = [k & set(swarm_groups()) for k in kinds_per_run.values()]
    assert len(used) > 50
    assert any("submit" not in u for u in used) and any("submit" in u for u in used)
    assert len({frozenset(u) for u in used}) > 5  # many different mixes, not one fixed one


def test_a_case_that_fails_mid_program_is_recorded_as_it_ran():
    """A finding raised by a step op ends the case: teardown's closing idle() must not run after it
    (it did, and a second finding there replaced the first, with a program that replays differently:
    reported as flaky)."""
    from kvaudit.search.fuzz import _machine, _Recorder

    config, program, _, _ = replay.load(os.path.join(REGRESSIONS, "session-close-while-running.json"))
    program = program[:-1] + [Step(50)]
    rec = _Recorder(FuzzStats(), deadline=time.monotonic() + 60)
    case = _machine(config, rec, max_prompt=32)()
    with pytest.raises(Exception, match="use-after-free"):
        for op in program:
            case._do(op)
    case.teardown()
    ops, findings = rec.last_failure
    assert ops == program
    assert findings[0].signature in execute(config, ops).signatures


# -- campaigns -------------------------------------------------------------------------------------

@pytest.mark.slow
def test_campaign_resumes_and_does_not_report_known_findings_again(tmp_path):
    corpus = str(tmp_path / "c")
    first = run_campaign(hisparse_config(), "random", 6, 1, 1, corpus)
    assert first.new and all(s.startswith("leak/hisparse_") for s in first.new)
    for sig, path in first.new.items():
        _, program, findings, doc = replay.load(path)
        assert sig in {f.signature for f in findings} and doc["minimized"] and doc["confirmations"] == "3/3"
    second = run_campaign(hisparse_config(), "random", 4, 2, 1, corpus)
    # every signature a saved file records is known, its secondary findings' too
    recorded = {f.signature for path in first.new.values() for f in replay.load(path)[2]}
    assert set(first.new) == set(second.known) == recorded  # a secondary finding is new when it lands
    assert not set(second.new) & recorded
    runs = json.load(open(os.path.join(corpus, "campaign.json")))["runs"]
    assert [sorted(r["new"]) for r in runs][0] == sorted(first.new) and len(runs) == 2


def test_unreadable_campaign_files_are_named_and_the_run_record_is_moved_aside_not_overwritten(tmp_path):
    """tester 56: a garbage file in DIR/findings/ was skipped with no word, and a garbage DIR/campaign.json was
    replaced by a new record (its history gone)."""
    corpus = tmp_path / "c"
    (corpus / "findings").mkdir(parents=True)
    (corpus / "findings" / "junk.json").write_text("{not json")
    (corpus / "campaign.json").write_text("\x00garbage")
    (corpus / "campaign.json.unreadable").write_text("an older one")
    r = invoke("fuzz", "--preset", "default", "--fuzzer", "random", "--seed", "1", "--corpus", str(corpus),
               "--max-time", "1")
    assert r.exit_code in (0, 1), r.output
    assert f"warning: 1 file(s) in {corpus / 'findings'} are not replay files, skipped: junk.json" in r.stderr
    assert f"{corpus / 'campaign.json'} was not a run record" in r.stderr and "campaign.json.unreadable-1" in r.stderr
    assert (corpus / "campaign.json.unreadable-1").read_text() == "\x00garbage"
    assert (corpus / "campaign.json.unreadable").read_text() == "an older one"
    assert len(json.load(open(corpus / "campaign.json"))["runs"]) == 1
    assert (corpus / "findings" / "junk.json").read_text() == "{not json"


SGLANG_FILE = os.path.join(HERE, "..", "corpora", "sglang", "aliasing-a1-rejected-turn-clears-inflight.json")


def test_another_target_kinds_replay_files_and_stray_entries_are_named_and_not_known(tmp_path):
    """tester 61b: SGLang's replay files in an eut campaign's DIR/findings/ made their signatures (which name
    engine parts eut shares, leak/token_to_kv_pool/...) known, hiding eut's own findings of them; a stray file
    or directory there was skipped with no word. Both are named now; kvaudit's own temporaries are not."""
    corpus = tmp_path / "c"
    found = corpus / "findings"
    (found / "old").mkdir(parents=True)
    shutil.copy(SGLANG_FILE, found)
    shutil.copy(os.path.join(REGRESSIONS, "hisparse-prebuilt-skip-finish.json"), found)
    (found / "notes.txt").write_text("mine")
    (found / ".tmp-abc123.json").write_text("{half a fi")  # an atomic write cut short: kvaudit's own
    r = invoke("fuzz", "--preset", "default", "--fuzzer", "random", "--seed", "1", "--corpus", str(corpus),
               "--max-time", "1")
    assert r.exit_code in (0, 1), r.output
    err = " ".join(r.stderr.split())
    assert f"warning: 2 file(s) in {found} are not replay files, skipped: notes.txt, old" in err, err
    assert (f"warning: 1 replay file(s) in {found} are another target kind's, not this campaign's (eut): their "
            f"signatures are not known here, skipped: {os.path.basename(SGLANG_FILE)} (sglang)") in err, err
    assert f"resuming: 2 signature(s) recorded in 1 file(s) in {found} are known" in err, err
    sglang_sigs = {f.signature for f in replay.load(SGLANG_FILE)[2]}
    run = json.load(open(corpus / "campaign.json"))["runs"][0]
    assert len(run["known"]) == 2 and not sglang_sigs & set(run["known"]), run
    assert (found / os.path.basename(SGLANG_FILE)).read_bytes() == open(SGLANG_FILE, "rb").read()


def test_a_finding_is_never_written_over_another_target_kinds_file_of_its_name(tmp_path):
    """Skipped as another kind's, a replay file under the name of one of this campaign's signatures (copied in
    from that kind's corpus) was written over when the campaign found that signature."""
    from kvaudit.search.campaign import _register_and_write, findings_dir

    config, program, findings, _ = replay.load(os.path.join(REGRESSIONS, "hisparse-prebuilt-skip-finish.json"))
    doc = replay.to_doc(config, program, findings, minimized=False)
    corpus = str(tmp_path / "c")
    name = replay.file_name(findings[0].signature)
    os.makedirs(findings_dir(corpus))
    shutil.copy(SGLANG_FILE, os.path.join(findings_dir(corpus), name))
    new, path = _register_and_write(corpus, findings_dir(corpus), None, doc)
    assert sorted(new) == sorted({f.signature for f in findings})
    assert os.path.basename(path) == name[:-len(".json")] + ".2.json"
    assert open(os.path.join(findings_dir(corpus), name), "rb").read() == open(SGLANG_FILE, "rb").read()
    assert set(known_signatures(corpus, target="eut")) == set(new)
    assert _register_and_write(corpus, findings_dir(corpus), None, doc) == ([], "")  # known now


def test_a_campaign_never_writes_over_a_file_of_its_name_that_is_not_a_replay_file(tmp_path):
    """tester 61c C5: a note under a finding's name in findings/ was warned 'skipped', then written over."""
    from kvaudit.search.campaign import _register_and_write, findings_dir

    config, program, findings, _ = replay.load(os.path.join(REGRESSIONS, "hisparse-prebuilt-skip-finish.json"))
    corpus = str(tmp_path / "c")
    os.makedirs(findings_dir(corpus))
    name = replay.file_name(findings[0].signature)
    with open(os.path.join(findings_dir(corpus), name), "w") as f:
        f.write("my notes")
    _, path = _register_and_write(corpus, findings_dir(corpus), None,
                                  replay.to_doc(config, program, findings, minimized=False))
    assert os.path.basename(path) == name[:-len(".json")] + ".2.json"
    assert open(os.path.join(findings_dir(corpus), name)).read() == "my notes"


def test_fuzz_out_replaces_only_its_own_kinds_replay_file_of_the_signature(tmp_path):
    """tester 61c C5: plain `fuzz --out DIR` (every kind's default is kvaudit-out) wrote over another kind's
    replay file, or a note, of the finding's name. It takes <name>.<n>.json beside them; a file of its own
    kind and signature is replaced in place, as before."""
    from kvaudit.app.files import write_finding

    config, program, findings, _ = replay.load(os.path.join(REGRESSIONS, "hisparse-prebuilt-skip-finish.json"))
    out = tmp_path / "kvaudit-out"
    out.mkdir()
    name = replay.file_name(findings[0].signature)[:-len(".json")]
    shutil.copy(SGLANG_FILE, out / f"{name}.json")
    (out / f"{name}.2.json").write_text("my notes")
    path = write_finding(str(out), config, program, findings, minimized=False)
    assert os.path.basename(path) == f"{name}.3.json" and replay.load(path)[2][0].signature == findings[0].signature
    assert (out / f"{name}.json").read_bytes() == open(SGLANG_FILE, "rb").read()
    assert (out / f"{name}.2.json").read_text() == "my notes"
    assert write_finding(str(out), config, program, findings, minimized=True) == path  # its own: replaced
    assert json.load(open(path))["minimized"] is True and len(os.listdir(out)) == 3


def test_ci_does_not_count_another_target_kinds_files_as_known_still_open(tmp_path):
    """tester 61b: `ci --corpus` listed the SGLang files in an eut preset's DIR/<preset>/findings/ as 'known still
    open' (replayed on SGLang) and the SARIF placed them at SGLang's files."""
    corpus = tmp_path / "c"
    (corpus / "default" / "findings").mkdir(parents=True)
    shutil.copy(SGLANG_FILE, corpus / "default" / "findings")
    empty = tmp_path / "regs"
    empty.mkdir()
    r = invoke("ci", "--max-time", "1", "--presets", "default", "--regressions", str(empty), "--corpus",
               str(corpus), "--out", str(tmp_path / "o"), "--sarif", str(tmp_path / "s.sarif"))
    assert r.exit_code in (0, 5), r.output
    out = " ".join(r.output.split())
    assert "known still open" not in out and ", 1 known" not in out, out
    assert f"skipped: {os.path.basename(SGLANG_FILE)} (sglang)" in out, out
    assert json.load(open(tmp_path / "s.sarif"))["runs"][0]["results"] == []


def test_ci_counts_a_suppression_that_leaves_out_a_known_finding_still_open(tmp_path):
    """tester tf63: `ci --corpus --suppress` replays the corpus's known findings under the rules, and one a rule
    left out was gone from the SARIF and the "known still open" count, yet the rules table said the rule matched
    nothing ("1 suppression(s) matched nothing"): a rule in use, flagged for deletion."""
    corpus = tmp_path / "c"
    (corpus / "retract" / "findings").mkdir(parents=True)
    shutil.copy(os.path.join(REGRESSIONS, "retract-unaligned-page.json"), corpus / "retract" / "findings")
    (tmp_path / "s.toml").write_text('[[suppress]]\nkind = "leak"\nreason = "known"\n')
    empty = tmp_path / "regs"
    empty.mkdir()
    r = invoke("ci", "--max-time", "1", "--presets", "retract", "--regressions", str(empty), "--corpus", str(corpus),
               "--suppress", str(tmp_path / "s.toml"), "--sarif", str(tmp_path / "s.sarif"))
    assert r.exit_code == 0, r.output
    assert json.load(open(tmp_path / "s.sarif"))["runs"][0]["results"] == []  # left out of the open ones
    assert "matched nothing" not in r.output, r.output
    assert re.search(r"1 +leak +\(any\) +\(any\) +known +1 +[1-9]", r.output), r.output

@pytest.mark.skipif(not os.path.isdir("/sys/fs"), reason="wants a directory nobody can write in, root included")
def test_ci_refuses_a_corpus_it_cannot_write_in_before_it_searches(tmp_path):
    """tester tf63: `ci --corpus DIR` on a read-only mount searched its whole budget, printed `passed`, then ended
    with exit 2 when it wrote DIR/<preset>/campaign.json; `fuzz --corpus DIR` refuses that DIR at once."""
    empty = tmp_path / "regs"
    empty.mkdir()
    r = invoke("ci", "--max-time", "1", "--presets", "default", "--regressions", str(empty), "--corpus", "/sys/fs",
               "--out", str(tmp_path / "o"))
    assert r.exit_code == 2 and "passed" not in r.output and "fuzz default" not in r.output, r.output
    assert one_error_line(r).startswith("kvaudit: error: --corpus /sys/fs: cannot write in /sys/fs"), r.output

def test_ci_with_max_time_0_refuses_an_out_or_corpus_it_cannot_write_in_but_not_its_default_out(tmp_path,
                                                                                                 monkeypatch):
    """tr69: `ci --max-time 0` took an --out or --corpus it could not write in (exit 0), which the same job with a
    budget refuses (exit 2): a nightly's flags passed the quick run and failed the real one. Refused alike now;
    the default --out, never written without a budget, may be unwritable (a read-only checkout)."""
    regs = tmp_path / "regs"
    regs.mkdir()
    shutil.copy(os.path.join(REGRESSIONS, "overlap-abort-double-free.json"), regs)
    for flag in ("--out", "--corpus"):
        r = invoke("ci", "--max-time", "0", "--regressions", str(regs), flag, "/sys/fs/kvaudit-x")
        assert r.exit_code == 2 and "passed" not in r.output, r.output
        line = one_error_line(r)
        assert line.startswith(f"kvaudit: error: {flag} /sys/fs/kvaudit-x: cannot write in /sys/fs"), line
    monkeypatch.chdir("/sys/fs")
    r = invoke("ci", "--max-time", "0", "--regressions", str(regs))
    assert r.exit_code == 0 and "passed: 1/1 regressions ok" in r.stdout, r.output


def test_a_signature_another_process_sharing_the_corpus_wrote_meanwhile_is_known(tmp_path, monkeypatch):
    """tester 61b: of two `fuzz --corpus DIR` sharing DIR, the slower confirmed and minimized the signatures the
    other wrote meanwhile, then said '0 new, 0 known signature(s)' and recorded neither."""
    from kvaudit.search import campaign

    src = os.path.join(REGRESSIONS, "hisparse-prebuilt-skip-finish.json")
    sigs = sorted({f.signature for f in replay.load(src)[2]})
    corpus = tmp_path / "c"

    def lost_the_race(spec, emit):  # the other process's file lands first; this one's write finds it there
        emit(("ready", spec.index))
        shutil.copy(src, corpus / "findings" / replay.file_name(sigs[0]))
        for s in sigs:
            emit(("duplicate", spec.index, s))
        emit(("done", spec.index))

    monkeypatch.setattr(campaign, "_search_loop", lost_the_race)
    result = campaign.run_campaign(hisparse_config(), "random", 5.0, 0, 1, str(corpus))
    assert not result.new and sorted(result.known) == sigs, (result.new, result.known)
    run = json.load(open(corpus / "campaign.json"))["runs"][0]
    assert run["new"] == [] and run["known"] == sigs


def test_a_file_another_process_wrote_for_a_signature_this_run_never_met_is_known_not_new(tmp_path, monkeypatch):
    """stop 61's note (B9's other half): of two runs sharing DIR, a file the other wrote for a signature this run
    never met was counted new at this run's end sweep (and recorded as this run's in campaign.json)."""
    from kvaudit.search import campaign

    src = os.path.join(REGRESSIONS, "hisparse-prebuilt-skip-finish.json")
    sigs = sorted({f.signature for f in replay.load(src)[2]})
    corpus = tmp_path / "c"

    def other_run_wrote(spec, emit):  # this run meets nothing; the other run's file lands meanwhile
        emit(("ready", spec.index))
        shutil.copy(src, corpus / "findings" / replay.file_name(sigs[0]))
        emit(("done", spec.index))

    monkeypatch.setattr(campaign, "_search_loop", other_run_wrote)
    result = campaign.run_campaign(hisparse_config(), "random", 5.0, 0, 1, str(corpus))
    assert not result.new and sorted(result.known) == sigs, (result.new, result.known)
    assert json.load(open(corpus / "campaign.json"))["runs"][0]["new"] == []


def test_the_findings_news_stopped_workers_left_in_the_queue_is_handled():
    """What lets the end sweep count an unannounced file as another process's: a worker stopped in triage writes
    its finding and says so after the parent stopped reading; that news is read after the workers stop. So is a
    worker's last progress (the programs it ran since the one before: an interrupted campaign undercounted its
    executions, 23 in its table and --json where `campaign status` showed its workers' 11 + 18); a done is not."""
    import multiprocessing as mp
    from kvaudit.search import campaign

    q = mp.get_context("spawn").Queue()
    for msg in [("progress", 0, 5, 50), ("finding", 0, "leak/x", "/d/x.json"), ("done", 0), ("duplicate", 1, "leak/y")]:
        q.put(msg)
    time.sleep(0.2)  # (the queue's feeder thread)
    seen = []
    campaign._drain(q, seen.append)
    assert seen == [("progress", 0, 5, 50), ("finding", 0, "leak/x", "/d/x.json"), ("duplicate", 1, "leak/y")]


def test_the_run_record_keeps_the_users_keys_and_sets_aside_entries_that_are_not_runs(tmp_path):
    """stop 56: a campaign.json whose "runs" held entries that are not run records kept them in "runs" on every
    rewrite, and a top-level key of the user's was dropped. The key stays; the junk is left out of "runs", with
    a warning, and the file as it was is copied aside first (nothing of the user's is lost)."""
    from kvaudit.search.campaign import _append_run_record

    path = tmp_path / "campaign.json"
    run = {"started": "2026-12-01T00:00:00Z", "executions": 3}
    before = json.dumps({"format": "kvaudit.campaign/1", "owner": "team-kv", "runs": [run, 42, "junk", {"x": 1}]})
    path.write_text(before)
    warnings = []
    assert _append_run_record(str(tmp_path), {"started": "2026-12-02T00:00:00Z"}, warnings) is None
    doc = json.loads(path.read_text())
    assert doc["owner"] == "team-kv" and doc["format"] == "kvaudit.campaign/1"
    assert doc["runs"] == [run, {"started": "2026-12-02T00:00:00Z"}]
    assert warnings == [f"{path}: 3 of its 4 runs are not run records (the first: 42): left out, the file as it was "
                        f"copied to {path}.unreadable"]
    assert (tmp_path / "campaign.json.unreadable").read_text() == before
    warnings.clear()  # a clean file: no warning, nothing set aside
    assert _append_run_record(str(tmp_path), {"started": "2026-12-03T00:00:00Z"}, warnings) is None
    assert not warnings and len(json.loads(path.read_text())["runs"]) == 3 and not os.path.exists(f"{path}.unreadable-1")


def test_a_run_record_saved_with_a_byte_order_mark_is_added_to_not_set_aside(tmp_path):
    """Stop 63's BOM: a DIR/campaign.json an editor saved with a UTF-8 BOM was "not a run record", moved aside
    and a new one started without its runs; it is read as it is now (and written back without the mark)."""
    from kvaudit.search.campaign import _append_run_record

    path, run = tmp_path / "campaign.json", {"started": "2026-12-01T00:00:00Z"}
    path.write_bytes("\ufeff".encode() + json.dumps({"format": "kvaudit.campaign/1", "owner": "ü", "runs": [run]},
                                                       ensure_ascii=False).encode())
    warnings = []
    assert _append_run_record(str(tmp_path), {"started": "2026-12-02T00:00:00Z"}, warnings) is None
    assert warnings == [] and not os.path.exists(f"{path}.unreadable")
    doc = json.loads(path.read_bytes().decode("utf-8"))
    assert doc["owner"] == "ü" and doc["runs"] == [run, {"started": "2026-12-02T00:00:00Z"}]


def test_a_run_record_whose_runs_is_not_a_list_keeps_the_users_other_keys(tmp_path):
    """tester 57: {"runs": {...}, "owner": ...} was moved aside whole and the new file lost "owner"; a top-level
    array was called "runs is not a list". The keys stay, the runs value is copied aside with the file; a file
    with no runs at all is a record to add to."""
    from kvaudit.search.campaign import _append_run_record

    path, new = tmp_path / "campaign.json", {"started": "2026-12-02T00:00:00Z"}
    before = json.dumps({"format": "kvaudit.campaign/1", "runs": {"a": 1}, "owner": "me"})
    path.write_text(before)
    warnings = []
    assert _append_run_record(str(tmp_path), new, warnings) is None
    assert json.loads(path.read_text()) == {"format": "kvaudit.campaign/1", "runs": [new], "owner": "me"}
    assert warnings == [f"{path}: its runs is a JSON dict, not a list of run records: left out, the file as it was "
                        f"copied to {path}.unreadable"]
    assert (tmp_path / "campaign.json.unreadable").read_text() == before
    path.write_text('{"owner": "me"}')
    warnings.clear()
    assert _append_run_record(str(tmp_path), new, warnings) is None and not warnings
    assert json.loads(path.read_text()) == {"owner": "me", "format": "kvaudit.campaign/1", "runs": [new]}
    path.write_text("[1, 2]")
    assert _append_run_record(str(tmp_path), new, warnings) is None
    assert "(ValueError: a JSON list, not an object)" in warnings[0]
    assert (tmp_path / "campaign.json.unreadable-1").read_text() == "[1, 2]"


def test_a_workers_plugin_mistake_is_raised_again_as_the_same_usage_error():
    """tester 57c: a plugin target whose step() does not count its steps, under --workers 2, was 'internal error:
    RuntimeError: worker 0: TargetDefinitionError: ...' (exit 70) where one process says the line (exit 2)."""
    from kvaudit.search.campaign import CampaignResult, _Tally, error_message
    from kvaudit.search.fuzzers import FuzzerDefinitionError
    from kvaudit.targets.registry import TargetDefinitionError

    tally = _Tally(CampaignResult(), lambda s: None, None)
    tally(("ready", 1))
    for cls in (TargetDefinitionError, FuzzerDefinitionError):
        with pytest.raises(cls) as e:
            tally(error_message(1, cls("target x: X.step() left self.steps at 0")))
        assert str(e.value) == "target x: X.step() left self.steps at 0"
    with pytest.raises(RuntimeError, match=r"^worker 1: ValueError: other$"):  # anything else: kvaudit's own
        tally(error_message(1, ValueError("other")))


def test_the_progress_line_says_which_worker_is_confirming_or_minimizing_which_finding():
    """stop 55/56: while a worker triaged (seconds, a hang's replays 1.4 s each) no progress line came, and the run
    looked stuck; the workers now say each triage phase, and the campaign's phase names it until that worker's
    next progress, finding or flaky message."""
    from kvaudit.search.campaign import CampaignResult, _Tally

    seen = []
    result = CampaignResult()
    tally = _Tally(result, lambda s: seen.append(s.phase), None)
    tally(("ready", 1))
    tally(("phase", 1, "confirming", "leak/x"))
    tally(("phase", 2, "minimizing", "hang/y"))
    assert seen[-1] == "fuzzing; worker 1 confirming leak/x; worker 2 minimizing hang/y"
    tally(("phase", 1, "minimizing", "leak/x"))
    assert seen[-1] == "fuzzing; worker 1 minimizing leak/x; worker 2 minimizing hang/y"
    tally(("finding", 1, "leak/x", "/c/findings/x.json"))
    assert seen[-1] == "fuzzing; worker 2 minimizing hang/y" and result.new == {"leak/x": "/c/findings/x.json"}
    tally(("flaky", 2, "hang/y"))
    assert seen[-1] == "fuzzing"


@pytest.mark.parametrize("known", [False, True])
def test_a_file_with_two_new_signatures_is_reported_once_and_summed_over_new_ones(known, tmp_path, monkeypatch):
    """One program raised two new signatures, both landing in one file: the campaign printed that file's
    report once per signature, and the SUMMARY summed over the prints (8 findings in 4 signatures for 2
    new). A finding of a known signature in a new finding's file is not counted either."""
    import kvaudit.search.campaign as campaign

    path = os.path.join(os.path.dirname(__file__), "..", "corpora", "regressions", "session-close-while-running.json")
    sigs = sorted({f.signature for f in replay.load(path)[2]})
    assert len(sigs) == 2

    def fake_run(*a, **k):
        return campaign.CampaignResult(new={s: path for s in sigs[known:]}, known={s: path for s in sigs[:known]},
                                       stats=FuzzStats(executions=3, ops=9))

    monkeypatch.setattr(campaign, "run_campaign", fake_run)
    r = invoke("fuzz", "--corpus", str(tmp_path / "c"), "--max-time", "1")
    assert r.exit_code == 1, r.output
    lines = r.output.splitlines()
    assert sum(ln.startswith("SUMMARY:") for ln in lines) == 1, r.output  # the campaign's: the file's has none
    want = ("SUMMARY: kvaudit: 1 finding(s) (1 use-after-free) in 1 signature(s)" if known else
            "SUMMARY: kvaudit: 2 finding(s) (2 use-after-free) in 2 signature(s)")
    assert lines[-1].startswith(want), lines[-1]
    assert lines[-1].endswith("; 1 known signature(s) not reported again.") == known


@pytest.mark.parametrize("elsewhere", [False, True])
def test_ci_summary_counts_its_known_signatures_as_a_campaigns_does(tmp_path, monkeypatch, elsewhere):
    """ci's SUMMARY line said "no new findings." where a campaign's over the same corpus says "; N known
    signature(s) not reported again": it counts the distinct known signatures of every preset now (one both
    presets know counts once), leaving out one another preset reported as new."""
    import kvaudit.search.campaign as campaign
    import kvaudit.search.ci as search_ci

    path = os.path.join(os.path.dirname(__file__), "..", "corpora", "regressions", "session-close-while-running.json")
    sig = sorted({f.signature for f in replay.load(path)[2]})[0]

    def fake_run(config, *a, **k):
        new = elsewhere and config.preset == "chunked"
        return campaign.CampaignResult(new={sig: path} if new else {}, known={} if new else {sig: path},
                                       stats=FuzzStats(executions=3, ops=9))

    monkeypatch.setattr(campaign, "run_campaign", fake_run)
    monkeypatch.setattr(search_ci, "still_open", lambda *a, **k: [])  # (no replay of the known file)
    (tmp_path / "reg").mkdir()
    r = invoke("ci", "--presets", "default,chunked", "--max-time", "2", "--regressions", str(tmp_path / "reg"),
               "--out", str(tmp_path / "out"))
    assert r.exit_code == (1 if elsewhere else 0), r.output
    (line,) = summary_lines(r.stdout)
    if elsewhere:  # (reported as new by chunked: not "not reported again")
        assert line.startswith("SUMMARY: kvaudit: 1 finding(s) (1 use-after-free)") and "known" not in line, line
    else:
        assert line == "SUMMARY: kvaudit: no new findings; 1 known signature(s) not reported again.", line


@pytest.mark.parametrize("job", ["fuzz", "ci"])
def test_kvaudit_report_of_a_run_with_known_findings_only_counts_them_as_the_run_did(tmp_path, monkeypatch, job):
    """A campaign's or ci's run with known findings only closed "no new findings; 2 known signature(s) not reported
    again", but its --json did not record them: `kvaudit report` of it (a CI reader's view) closed "no findings.",
    and its HTML said "No findings." The --json records the known signatures; report and HTML count them."""
    import kvaudit.search.campaign as campaign
    import kvaudit.search.ci as search_ci

    path = os.path.join(os.path.dirname(__file__), "..", "corpora", "regressions", "session-close-while-running.json")
    sigs = sorted({f.signature for f in replay.load(path)[2]})
    monkeypatch.setattr(campaign, "run_campaign", lambda *a, **k: campaign.CampaignResult(
        known={s: path for s in sigs}, stats=FuzzStats(executions=3, ops=9)))
    monkeypatch.setattr(search_ci, "still_open", lambda *a, **k: [])  # (no replay of the known file)
    (tmp_path / "reg").mkdir()
    args = (["fuzz", "--corpus", str(tmp_path / "c")] if job == "fuzz" else
            ["ci", "--presets", "default", "--regressions", str(tmp_path / "reg"), "--out", str(tmp_path / "o")])
    r = invoke(*args, "--max-time", "1", "--json", str(tmp_path / "r.json"), "--html", str(tmp_path / "r.html"))
    assert r.exit_code == 0, r.output
    line = "SUMMARY: kvaudit: no new findings; 2 known signature(s) not reported again."
    assert summary_lines(r.stdout) == [line], r.stdout
    assert json.loads((tmp_path / "r.json").read_text())["known"] == sigs
    assert "No new findings; 2 known signature(s) not reported again." in (tmp_path / "r.html").read_text()
    rep = invoke("report", str(tmp_path / "r.json"), "--html", str(tmp_path / "again.html"))
    assert rep.exit_code == 0, rep.output
    assert summary_lines(rep.stdout) == [line], rep.stdout
    assert "No new findings; 2 known signature(s) not reported again." in (tmp_path / "again.html").read_text()


def test_ci_summary_does_not_count_a_suppressed_known_signature_as_known_too(tmp_path):
    """ci --corpus C --suppress S, S covering the known findings C's file records: the preset's row said clean and
    the SUMMARY 'no new findings; 2 suppressed signature(s); 2 known signature(s) not reported again.', the same
    two signatures counted twice (its replay met them suppressed). Counted once now, as suppressed."""
    path = os.path.join(os.path.dirname(__file__), "..", "corpora", "regressions", "chunked-abort-ignored.json")
    os.makedirs(tmp_path / "corpus" / "chunked" / "findings")
    shutil.copy(path, tmp_path / "corpus" / "chunked" / "findings")
    (tmp_path / "s.toml").write_text('[[suppress]]\nkind = "leak"\nreason = "known"\n')
    (tmp_path / "reg").mkdir()
    r = invoke("ci", "--presets", "chunked", "--max-time", "0.5", "--regressions", str(tmp_path / "reg"),
               "--corpus", str(tmp_path / "corpus"), "--suppress", str(tmp_path / "s.toml"), "--out", str(tmp_path / "o"))
    assert r.exit_code == 0, r.output
    assert "fuzz chunked (" in r.stdout and "executions)  clean" in r.stdout, r.stdout
    assert summary_lines(r.stdout) == ["SUMMARY: kvaudit: no new findings; 2 suppressed signature(s)."], r.stdout


def summary_lines(output: str) -> list[str]:
    return [ln for ln in output.splitlines() if ln.startswith("SUMMARY:")]


def test_a_run_that_reports_several_files_prints_one_summary_line_over_them_all(tmp_path, monkeypatch):
    """Each new file's report ended with its own SUMMARY: line and the campaign added one more, so
    `grep '^SUMMARY:'` gave 3 lines with different counts for 2 files. Also `kvaudit report` of the
    campaign's JSON report (2 cases) and `kvaudit replay` of a file with 2 findings: one line each."""
    import kvaudit.search.campaign as campaign

    files = [os.path.join(REGRESSIONS, n) for n in ("prefill-finish-leaks-row.json", "session-close-while-running.json")]
    new = {f.signature: path for path in files for f in replay.load(path)[2]}
    assert len(new) == 3
    monkeypatch.setattr(campaign, "run_campaign", lambda *a, **k: campaign.CampaignResult(
        new=new, stats=FuzzStats(executions=3, ops=9)))
    r = invoke("fuzz", "--corpus", str(tmp_path / "c"), "--max-time", "1", "--json", str(tmp_path / "r.json"))
    assert r.exit_code == 1, r.output
    assert r.output.count("==ERROR: kvaudit:") == 3  # every section keeps its findings
    assert summary_lines(r.output) == [r.stdout.splitlines()[-1]], r.output  # one line, the last
    assert summary_lines(r.output)[0].startswith("SUMMARY: kvaudit: 3 finding(s) (1 leak, 2 use-after-free) in 3 ")
    rep = invoke("report", str(tmp_path / "r.json"))
    assert rep.exit_code == 0 and rep.output.count("==ERROR: kvaudit:") == 3, rep.output
    assert summary_lines(rep.output) == [summary_lines(r.output)[0]]
    rp = invoke("replay", files[1])
    assert rp.output.count("==ERROR: kvaudit:") == 2 and len(summary_lines(rp.output)) == 1, rp.output


def test_ci_prints_one_summary_line_over_its_new_findings(tmp_path, monkeypatch):
    from kvaudit.search import ci

    def found(path):
        _, program, findings, _ = replay.load(path)
        return program, findings, path

    files = [os.path.join(REGRESSIONS, n) for n in ("prefill-finish-leaks-row.json", "chunked-abort-ignored.json")]
    monkeypatch.setattr(ci, "fuzz_preset", lambda preset, *a, **k: ci.FuzzRun(
        preset, 1.0, 5, new=[found(files[preset == "chunked"])]))
    empty = tmp_path / "regs"
    empty.mkdir()
    r = invoke("ci", "--max-time", "2", "--presets", "default,chunked", "--regressions", str(empty),
               "--out", str(tmp_path / "o"))
    assert r.exit_code == 1, r.output
    n = sum(len(replay.load(path)[2]) for path in files)
    assert n == 3 and r.output.count("==ERROR: kvaudit:") == n
    assert summary_lines(r.output) == [f"SUMMARY: kvaudit: {n} finding(s) ({n} leak) in {n} signature(s); 32 distinct slot(s), "
                                       "2 distinct row(s) involved."], r.output


def test_ci_names_each_new_signature_once_when_one_file_holds_two_and_uploads_it_from_out(tmp_path, monkeypatch):
    """A program that raised two new signatures is one file: `ci` loaded it once per signature, so the
    NEW row, the JUnit and the reports listed its first finding twice and never named the second; with
    --corpus the file stayed in the corpus, never in --out (what the PR gate uploads). The fuzz line
    also says what the programs reached."""
    import xml.etree.ElementTree as ET

    import kvaudit.search.campaign as campaign

    path = os.path.join(REGRESSIONS, "session-close-while-running.json")
    sigs = sorted({f.signature for f in replay.load(path)[2]})
    assert len(sigs) == 2
    stats = FuzzStats(executions=3, ops=9)
    stats.reached.update({"session_turns": 4})
    monkeypatch.setattr(campaign, "run_campaign", lambda *a, **k: campaign.CampaignResult(
        new={s: path for s in sigs}, stats=stats))
    empty = tmp_path / "regs"
    empty.mkdir()
    r = invoke("ci", "--max-time", "1", "--presets", "default", "--regressions", str(empty), "--corpus",
               str(tmp_path / "c"), "--out", str(tmp_path / "o"), "--junit", str(tmp_path / "j.xml"))
    assert r.exit_code == 1, r.output
    assert "fuzz default: 3 executions, 2 NEW finding(s); reached: session_turns=4" in r.output, r.output
    assert r.output.count("==ERROR: kvaudit:") == 2, r.output  # the file's report, once
    out = str(tmp_path / "o" / os.path.basename(path))
    assert os.path.exists(out) and all(f"NEW {s} -> " in " ".join(r.output.split()) for s in sigs), r.output
    cases = ET.parse(tmp_path / "j.xml").getroot().findall(".//testcase[failure]")
    assert sorted(c.get("name") for c in cases) == sigs
    assert all(f"replay file: {out}" in c.find("failure").text for c in cases)
    assert "FAILED: 0/0 regressions ok, 2 new finding(s)" in r.output


def test_an_interrupted_ci_share_reports_the_seconds_it_ran_not_its_share(tmp_path, monkeypatch):
    """Interrupted 10 s into a 30 s share, the row said `(30.0s, ...) (interrupted)` and the JUnit time 30.00."""
    import kvaudit.search.campaign as campaign
    from kvaudit.search import ci

    monkeypatch.setattr(campaign, "run_campaign", lambda *a, **k: campaign.CampaignResult(
        stats=FuzzStats(executions=3, ops=9), interrupted=True))
    run = ci.fuzz_preset("default", 30.0, 1, "random", None, str(tmp_path / "o"))
    assert run.interrupted and run.seconds < 30.0
    monkeypatch.setattr(campaign, "run_campaign", lambda *a, **k: campaign.CampaignResult(
        stats=FuzzStats(executions=3, ops=9)))
    assert ci.fuzz_preset("default", 30.0, 1, "random", None, str(tmp_path / "o")).seconds == 30.0


def _a_ci_campaign_finds(tmp_path, monkeypatch, regression: str) -> tuple[str, str]:
    """Stand-in for ci's campaigns: each finds ``regression``'s first signature, its file named as a campaign names
    it. Returns (that signature, the file name's stem)."""
    import kvaudit.search.campaign as campaign

    src = os.path.join(REGRESSIONS, regression)
    sig = replay.load(src)[2][0].signature
    found = str(tmp_path / replay.file_name(sig))  # (the campaign's own file: named for its signature)
    shutil.copy(src, found)
    monkeypatch.setattr(campaign, "run_campaign", lambda *a, **k: campaign.CampaignResult(
        new={sig: found}, stats=FuzzStats(executions=3, ops=9)))
    return sig, replay.file_name(sig)[:-len(".json")]


def test_ci_out_never_writes_a_new_finding_over_another_file_of_its_name(tmp_path, monkeypatch):
    """Stop 61's note: `ci --out` copied a new finding's replay file over a file of its name there (a user's note,
    another kind's replay file). It takes the next free name (kvaudit.replay.home); its own kind's file of that
    signature (a former job's) is replaced."""
    from kvaudit.search import ci

    _, name = _a_ci_campaign_finds(tmp_path, monkeypatch, "session-close-while-running.json")
    out = tmp_path / "o"
    out.mkdir()
    (out / f"{name}.json").write_text("my notes")
    for _ in range(2):
        run = ci.fuzz_preset("default", 1.0, 1, "random", None, str(out))
        assert [path for _, _, path in run.new] == [str(out / f"{name}.2.json")]
    assert (out / f"{name}.json").read_text() == "my notes"
    assert sorted(os.listdir(out)) == [f"{name}.2.json", f"{name}.json"]


def test_ci_out_never_writes_the_second_presets_copy_over_a_note_of_its_name(tmp_path, monkeypatch):
    """Stop 62: a signature two presets of one job found is kept twice, the second copy as ``<name>.<preset>.json``;
    that name was written over whatever held it (a note). It goes where kvaudit.replay.home says too."""
    from kvaudit.search import ci

    sig, name = _a_ci_campaign_finds(tmp_path, monkeypatch, "session-close-while-running.json")
    out = tmp_path / "o"
    out.mkdir()
    (out / f"{name}.retract.json").write_text("my notes")
    first = ci.fuzz_preset("default", 1.0, 1, "random", None, str(out))
    taken = frozenset(path for _, _, path in first.new)
    second = ci.fuzz_preset("retract", 1.0, 1, "random", None, str(out), taken=taken)
    assert [path for _, _, path in second.new] == [str(out / f"{name}.retract.2.json")]
    assert (out / f"{name}.retract.json").read_text() == "my notes"
    assert replay.load(str(out / f"{name}.retract.2.json"))[2][0].signature == sig


def test_a_campaigns_lines_show_a_non_utf8_path_escaped_on_one_line(tmp_path):
    """Stop 61's note: a corpus folder's or suppressions file's name that is not UTF-8 reached the campaign's lines
    and the suppressions header as lone surrogates: written raw on a lenient stream, internal error 70 on a strict
    one (a UTF-8 locale's standard output). Shown escaped now, as ``\\xff``; the replay files' rows too."""
    from rich.console import Console

    from kvaudit.app.fuzz import _campaign_table
    from kvaudit.search.campaign import CampaignResult

    corpus, rules = os.fsdecode(bytes(tmp_path) + b"/camp\xff"), os.fsdecode(bytes(tmp_path) + b"/sup\xfe.toml")
    with open(rules, "w") as fh:
        fh.write('[[suppress]]\nkind = "leak"\n')
    r = invoke("fuzz", "--max-time", "0.3", "--fuzzer", "random", "--corpus", corpus, "--suppress", rules)
    assert r.exit_code == 0, r.output
    assert not re.search("[\udc80-\udcff]", r.output), r.output
    assert f"; corpus {tmp_path}/camp\\xff\n" in r.stdout, r.stdout
    assert f"suppressions used ({tmp_path}/sup\\xfe.toml):" in r.stdout, r.stdout
    assert f"campaign in {tmp_path}/camp\\xff, " in r.stderr and f"suppressions {tmp_path}/sup\\xfe.toml (1 rule" \
        in r.stderr, r.stderr
    console = Console(record=True, width=300, force_terminal=True)
    console.print(_campaign_table(CampaignResult(new={"leak/x": os.path.join(corpus, "findings", "leak_x.json")})))
    assert f"{tmp_path}/camp\\xff/findings/leak_x.json" in console.export_text(), console.export_text()


def test_a_findings_lines_show_a_non_utf8_or_newline_path_escaped_and_its_replay_command_still_pastes(tmp_path):
    """Stop 62: the lines naming a finding's file (``new finding:``, ``resuming:``, ``replay file:``, ``reports
    written:``) still wrote the path raw: a newline split the line, and a byte that is not UTF-8 was internal error
    70 on a strict UTF-8 stream. Shown escaped now; ``kvaudit replay $'...'`` names the file itself."""
    corpus = os.fsdecode(bytes(tmp_path) + b"/c\xff\nd")
    bug = ("--preset", "retract", "--bug", "retract-unaligned-page", "--max-time", "3", "--seed", "1")
    for first in (True, False):  # the second resumes: its file is known
        r = invoke("fuzz", *bug, "--corpus", corpus, "--workers", "2", "--json", os.path.join(corpus, "r.json"))
        assert r.exit_code == int(first), r.output
        assert not re.search("[\udc80-\udcff]", r.output), r.output
        assert first <= (f"new finding: leak/token_to_kv_pool/request-kv/release_req@scheduler_decode_mixin.py -> "
                         f"{tmp_path}/c\\xff\\nd/findings/" in r.stderr), r.stderr
        for line in r.output.splitlines():
            assert line.startswith(("new finding: ", "resuming: ", "reports written: ")) <= ("c\\xff\\nd" in line), line
    assert f"resuming: 1 signature(s) recorded in 1 file(s) in {tmp_path}/c\\xff\\nd/findings" in r.stderr, r.stderr
    assert f"reports written: {tmp_path}/c\\xff\\nd/r.json" in r.stderr, r.stderr
    r = invoke("fuzz", *bug, "--out", corpus)
    assert r.exit_code == 1, r.output
    assert not re.search("[\udc80-\udcff]", r.output), r.output
    line = next(x for x in r.stdout.splitlines() if x.startswith("replay file: "))
    path, hint = re.fullmatch(r"replay file: (\S+) +\(kvaudit replay (\S+)\)", line).groups()
    assert path.startswith(f"{tmp_path}/c\\xff\\nd/") and hint.startswith(f"$'{tmp_path}/c\\xff\\x0ad/")
    out = subprocess.run(["bash", "-c", f"printf %s {hint}"], capture_output=True).stdout
    assert os.path.exists(os.fsdecode(out)), out


def test_known_signatures_remembers_every_finding_of_every_file(tmp_path):
    """A file whose program yields a leak of the device buffer and of the host pool: both are known,
    so a program that yields the known pair again is not a new crash (it stopped the search again
    and again when only the first was remembered)."""
    corpus = tmp_path / "c"
    (corpus / "findings").mkdir(parents=True)
    src = os.path.join(REGRESSIONS, "hisparse-prebuilt-skip-finish.json")
    shutil.copy(src, corpus / "findings" / "x.json")
    sigs = {f.signature for f in replay.load(src)[2]}
    assert len(sigs) >= 2
    assert set(known_signatures(str(corpus))) == sigs


def test_workers_writing_one_bug_s_file_at_once_write_one_file_whichever_primary_they_minimized(tmp_path):
    """Two workers of one host that triaged one bug from its two signatures (one each) each wrote a file
    holding both: the check and the write are one step under the corpus's lock now."""
    import threading

    from kvaudit.search.campaign import _register_and_write

    config, program, findings, _ = replay.load(os.path.join(REGRESSIONS, "hisparse-prebuilt-skip-finish.json"))
    assert len({f.signature for f in findings}) == 2
    for attempt in range(5):
        corpus = tmp_path / f"c{attempt}"
        (corpus / "findings").mkdir(parents=True)
        docs = [replay.to_doc(config, program, findings[i % 2:] + findings[:i % 2]) for i in range(6)]
        start, got = threading.Barrier(len(docs)), []

        def write(doc):
            start.wait()
            got.append(_register_and_write(str(corpus), str(corpus / "findings"), None, doc))

        threads = [threading.Thread(target=write, args=(d,)) for d in docs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        written = [(new, path) for new, path in got if new]
        assert len(written) == 1 and sorted(written[0][0]) == sorted({f.signature for f in findings}), got
        assert os.listdir(corpus / "findings") == [os.path.basename(written[0][1])]


def _leak_lock_a(tree, req):  # three lock leaks at three sites: three bugs
    tree.inc_lock_ref(tree.match_prefix(req.origin_input_ids).last_node)


def _leak_lock_b(tree, req):
    tree.inc_lock_ref(tree.match_prefix(req.origin_input_ids).last_node)


def _leak_lock_c(tree, req):
    tree.inc_lock_ref(tree.match_prefix(req.origin_input_ids).last_node)


def _plant_lock_leaks(monkeypatch, leaks):
    """After a finished request's release, take a lock nobody holds at the site ``leaks`` names by
    its prompt length modulo 3 (so each program meets some, not all)."""
    from engine_under_test.scheduler import Scheduler
    orig = Scheduler.release_kv_cache

    def release_kv_cache(self, req, checkpoint):
        orig(self, req, checkpoint)
        leak = leaks[len(req.origin_input_ids) % 3]
        if leak is not None and checkpoint and not req.is_health_check and not self.tree_cache.disable:
            leak(self.tree_cache, req)

    monkeypatch.setattr(Scheduler, "release_kv_cache", release_kv_cache)


@pytest.mark.slow
def test_two_lock_leaks_are_two_new_findings_and_a_resumed_campaign_reports_a_third(tmp_path, monkeypatch):
    """Lock leaks taken at different sites have different signatures (the unmatched inc_lock_ref's
    frame): before, every lock imbalance was lock-imbalance/token_to_kv_pool/lock_ref, and a campaign
    reported the first and took every later one as known."""
    corpus = str(tmp_path / "c")
    config = get_preset("default").config()
    _plant_lock_leaks(monkeypatch, (_leak_lock_a, _leak_lock_b, None))
    first = run_campaign(config, "random", 12, 1, 1, corpus)
    assert all(s.startswith("lock-imbalance/") for s in first.new)
    assert {s.rsplit("inc:", 1)[-1] for s in first.new} == {"_leak_lock_a@test_campaign.py",
                                                            "_leak_lock_b@test_campaign.py"}
    _plant_lock_leaks(monkeypatch, (_leak_lock_a, _leak_lock_b, _leak_lock_c))
    second = run_campaign(config, "random", 12, 2, 1, corpus)
    assert set(second.new) == {"lock-imbalance/token_to_kv_pool/inc:_leak_lock_c@test_campaign.py"}


def _wait_for(predicate, timeout: float, proc=None):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        if proc is not None and proc.poll() is not None:
            return predicate()
        time.sleep(0.2)
    return False


def _workers_of(corpus: str) -> list[int]:
    out = subprocess.run(["pgrep", "-f", "multiprocessing.spawn"], capture_output=True, text=True).stdout.split()
    alive = []
    for pid in map(int, out):
        try:
            env = open(f"/proc/{pid}/environ", "rb").read()
        except OSError:
            continue
        if corpus.encode() in env:
            alive.append(pid)
    return alive


@pytest.mark.slow
def test_kill_9_keeps_written_findings_and_a_rerun_resumes(tmp_path):
    corpus = str(tmp_path / "corpus")
    env = {**plain_env(), "KVAUDIT_TEST_CORPUS": corpus}  # marks this test's worker processes
    proc = subprocess.Popen([kvaudit_script(), "fuzz", *HISPARSE, "--fuzzer", "random", "--max-time", "120",
                             "--seed", "1", "--workers", "2", "--corpus", corpus],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    found = lambda: known_signatures(corpus)  # noqa: E731
    try:
        assert _wait_for(found, 90, proc), "no finding within 90 s"
    finally:
        proc.kill()  # kill -9: no handler runs
        proc.wait()
    before = found()
    for sig, path in before.items():  # whole, loadable replay files
        _, _, findings, _ = replay.load(path)
        assert sig in {f.signature for f in findings}
    assert not [n for n in os.listdir(os.path.join(corpus, "findings")) if n.startswith(".tmp-")]
    assert _wait_for(lambda: not _workers_of(corpus), 10), "workers outlived their parent"
    rerun = subprocess.run([kvaudit_script(), "fuzz", *HISPARSE, "--fuzzer", "random", "--max-time", "5",
                            "--seed", "2", "--corpus", corpus], capture_output=True, text=True, env=plain_env(),
                           timeout=120)
    assert rerun.returncode in (0, 1), rerun.stderr
    assert f"resuming: {len(before)} signature(s)" in rerun.stderr
    last = json.load(open(os.path.join(corpus, "campaign.json")))["runs"][-1]
    for sig in before:
        assert f"new finding: {sig}" not in rerun.stderr  # known, not new
        assert sig in last["known"] and sig not in last["new"]
    assert f"{len(before)} known signature(s)" in rerun.stdout


@pytest.mark.slow
def test_ctrl_c_stops_a_campaign_with_its_summary_and_report(tmp_path):
    corpus, report = str(tmp_path / "corpus"), str(tmp_path / "r.json")
    proc = subprocess.Popen([kvaudit_script(), "fuzz", "--preset", "default", "--max-time", "120", "--workers", "2",
                             "--corpus", corpus, "--json", report, "--junit", str(tmp_path / "r.xml")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=plain_env())
    # the signal goes once the workers ran programs (a progress line counts them), not after a fixed
    # sleep: under load the workers were still importing when it came
    err_lines = []
    for line in proc.stderr:
        err_lines.append(line)
        if re.search(r"executions=[1-9]", line):
            break
    else:
        pytest.fail("the campaign ended without counting an execution: " + "".join(err_lines)[-2000:])
    proc.send_signal(signal.SIGINT)
    out, rest = proc.communicate(timeout=60)
    err = "".join(err_lines) + rest
    assert proc.returncode == 130, err
    assert "interrupted:" in out and "executions" in out
    assert "Traceback" not in err
    doc = json.load(open(report))
    assert doc["interrupted"] is True and doc["executions"] > 0
    assert 'failures="0"' in open(tmp_path / "r.xml").read()


# -- determinism, minimize ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(os.listdir(REGRESSIONS)))
def test_every_regression_file_replays_identically_3_times(name):
    result = invoke("replay", os.path.join(REGRESSIONS, name), "--check-determinism", "--runs", "3")
    assert result.exit_code == 1, result.output  # findings, and deterministic (3 would say otherwise)
    assert "deterministic: 3 identical runs" in result.stdout
    # off a terminal the table's columns are named (a bare column of step counts was unexplained)
    table = result.stdout.split("determinism: 3 runs:\n", 1)[1].splitlines()
    assert table[0] == "  run  ledger digest  scheduler steps  signatures" and table[1].startswith("  1  ")


def test_check_determinism_catches_a_nondeterministic_engine(monkeypatch):
    import itertools

    from kvaudit.audit import hooks

    counter = itertools.count()
    real = hooks.Auditor.digest
    monkeypatch.setattr(hooks.Auditor, "digest", lambda self: real(self) + str(next(counter)))
    result = invoke("replay", os.path.join(REGRESSIONS, "prefill-finish-leaks-row.json"), "--check-determinism",
                    env={"COLUMNS": "20"})
    assert result.exit_code == 3 and "NOT deterministic" in result.stdout
    # off a terminal the verdict is one line whatever COLUMNS says (tester 60a: folded at 20 columns)
    assert "NOT deterministic: the runs differ\n" in result.stdout, result.stdout[-300:]


def _hash_prefix(seed: int) -> str:
    """``hash('kvaudit')`` under ``PYTHONHASHSEED=seed``, as the digest's prefix below shows it."""
    return subprocess.run([sys.executable, "-c", "print(format(hash('kvaudit') & 0xffffffff, '08x'))"],
                          env={**os.environ, "PYTHONHASHSEED": str(seed)}, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_check_determinism_runs_the_third_run_in_a_fresh_process_under_another_hash_seed(tmp_path):
    """--check-determinism ran every run in its own process, so under one hash seed: an outcome that follows
    PYTHONHASHSEED (a set of str iterated, td68's vLLM aborts) passed. A digest made to follow the hash of a
    str (a sitecustomize the fresh processes import too) now differs in run 3, run under PYTHONHASHSEED=1."""
    (tmp_path / "sitecustomize.py").write_text(
        "import kvaudit.audit.hooks as h\n\nreal = h.Auditor.digest\n"
        "h.Auditor.digest = lambda self: format(hash('kvaudit') & 0xffffffff, '08x') + real(self)\n")
    env = {**os.environ, "PYTHONHASHSEED": "7",
           "PYTHONPATH": os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)}
    file = os.path.join(REGRESSIONS, "prefill-finish-leaks-row.json")
    r = subprocess.run([sys.executable, "-m", "kvaudit", "replay", file, "--check-determinism", "--runs", "3"], env=env,
                       capture_output=True, text=True, timeout=900)
    rows = r.stdout.split("determinism: 3 runs:\n", 1)[-1].splitlines()[1:4]
    assert [row.split()[:2] for row in rows] == [["1", f"{_hash_prefix(7)}{rows[0].split()[1][8:]}"],
                                                ["2", rows[0].split()[1]], ["3", "(PYTHONHASHSEED=1)"]], r.stdout
    assert rows[2].split()[2] == _hash_prefix(1) + rows[0].split()[1][8:]  # the same ledger, another seed
    assert r.returncode == 3 and "NOT deterministic: the runs differ" in r.stdout, r.stderr[-2000:]


def test_the_fresh_process_run_keeps_the_suppressions(tmp_path):
    """Run 3 runs in a fresh process: the --suppress rules go with it (as data), so it too runs past the
    suppressed leak to the program's end (3 scheduler steps, not 1) and agrees with runs 1 and 2."""
    rules = tmp_path / "s.toml"
    rules.write_text('[[suppress]]\nkind = "leak"\nreason = "known"\n')
    result = invoke("replay", os.path.join(REGRESSIONS, "prefill-finish-leaks-row.json"), "--check-determinism",
                    "--suppress", str(rules))
    rows = result.stdout.split("determinism: 3 runs:\n", 1)[-1].splitlines()[1:4]
    assert rows[2].split()[1].startswith("(PYTHONHASHSEED="), result.output
    assert [row.split()[-2:] for row in rows] == [["3", "none"]] * 3  # (unsuppressed, the leak stops it at step 1)
    assert result.exit_code == 0 and "deterministic: 3 identical runs" in result.stdout, result.output


def test_minimize_shrinks_a_padded_program_and_keeps_the_signature(tmp_path):
    config, program, findings, doc = replay.load(os.path.join(REGRESSIONS, "hisparse-prebuilt-skip-finish.json"))
    padded = [Step(2), FlushCache()] + program + [Submit(2, 9, 3), Step(1)]
    src = tmp_path / "padded.json"
    replay.write_atomic(str(src), replay.to_doc(config, padded, findings))
    result = invoke("minimize", str(src))
    assert result.exit_code == 0, result.output
    out = str(tmp_path / "padded.min.json")
    _, small, got, _ = replay.load(out)
    assert len(small) < len(padded) and got[0].signature == findings[0].signature
    assert findings[0].signature in execute(config, small).signatures


def test_minimize_says_when_the_finding_does_not_reproduce(tmp_path):
    config, program, findings, _ = replay.load(os.path.join(REGRESSIONS, "hisparse-prebuilt-skip-finish.json"))
    src = tmp_path / "fixed.json"
    fixed = get_preset(config.preset).config()  # the switch off: the bug is fixed
    replay.write_atomic(str(src), replay.to_doc(fixed, program, findings))
    result = invoke("minimize", str(src))
    assert result.exit_code == 4 and "does not reproduce" in result.stderr
    assert not (tmp_path / "fixed.min.json").exists()


def test_minimize_names_its_own_flag_for_an_unwritable_output(tmp_path):
    src = os.path.join(REGRESSIONS, "hisparse-prebuilt-skip-finish.json")
    (tmp_path / "a-file").write_text("")
    result = invoke("minimize", src, "-o", str(tmp_path / "a-file" / "x.json"))  # its parent is no directory
    line = one_error_line(result)
    assert result.exit_code == 2 and line.startswith("kvaudit: error: --output ") and "--json" not in line


def test_minimize_of_a_signature_the_file_does_not_record_lists_the_ones_it_does():
    """It ran the minimizer and said only "does not reproduce" (exit 4)."""
    src = os.path.join(REGRESSIONS, "overlap-abort-double-free.json")
    recorded = list(dict.fromkeys(f.signature for f in replay.load(src)[2]))
    assert len(recorded) == 2
    result = invoke("minimize", src, "--signature", "leak/nope")
    assert result.exit_code == 2
    assert one_error_line(result) == (f"kvaudit: error: --signature leak/nope: {src} records no finding of it; its "
                                      f"signature(s): {', '.join(recorded)}")


def test_minimize_of_a_file_with_no_program_says_so_rather_than_asking_for_a_signature(tmp_path):
    """A `kvaudit ci` job's --json (no program, no finding) was told "records no finding: name one with
    --signature", and with one ran the minimizer over 0 ops: "leak/x does not reproduce", exit 4."""
    r = invoke("ci", "--max-time", "0", "--json", str(tmp_path / "ci.json"), "--out", str(tmp_path / "out"))
    assert r.exit_code == 0, r.output
    for extra in ([], ["--signature", "leak/x"]):
        result = invoke("minimize", str(tmp_path / "ci.json"), *extra)
        assert result.exit_code == 2, result.output
        assert one_error_line(result) == f"kvaudit: error: {tmp_path / 'ci.json'} records no program: nothing to minimize"


# -- kvaudit ci ----------------------------------------------------------------------------------------

def test_ci_replays_regressions_and_fails_on_a_broken_one(tmp_path):
    regs = tmp_path / "regs"
    regs.mkdir()
    for name in ("prefill-finish-leaks-row.json", "overlap-abort-double-free.json"):
        shutil.copy(os.path.join(REGRESSIONS, name), regs / name)
    ok = invoke("ci", "--max-time", "0", "--regressions", str(regs), "--junit", str(tmp_path / "ok.xml"))
    assert ok.exit_code == 0, ok.output
    assert 'tests="2" failures="0"' in open(tmp_path / "ok.xml").read()
    config, program, findings, _ = replay.load(str(regs / "prefill-finish-leaks-row.json"))
    replay.write_atomic(str(regs / "prefill-finish-leaks-row.json"),
                        replay.to_doc(config, program[:1], findings))  # no idle: the leak is never seen
    bad = invoke("ci", "--max-time", "0", "--regressions", str(regs), "--junit", str(tmp_path / "bad.xml"))
    assert bad.exit_code == 1
    xml = open(tmp_path / "bad.xml").read()
    assert 'failures="1"' in xml and "no longer reproduces" in xml


def test_ci_fails_a_malformed_regression_file_and_goes_on_with_the_rest(tmp_path):
    regs = tmp_path / "regs"
    regs.mkdir()
    for name in ("overlap-abort-double-free.json", "prefill-finish-leaks-row.json"):
        shutil.copy(os.path.join(REGRESSIONS, name), regs / name)
    (regs / "broken.json").write_text('{"format": "kvaudit.replay/1", "program": [')  # cut short
    result = invoke("ci", "--max-time", "0", "--regressions", str(regs), "--junit", str(tmp_path / "ci.xml"),
                    "--sarif", str(tmp_path / "ci.sarif"), "--json", str(tmp_path / "ci.json"))
    assert result.exit_code == 1, result.output  # as for a failing case, not 2
    assert "Traceback" not in result.output
    assert "regression broken: FAILED: malformed:" in result.stderr
    assert "regression overlap-abort-double-free: ok" in result.stderr  # the ones after it still ran
    assert "regression prefill-finish-leaks-row: ok" in result.stderr
    import xml.etree.ElementTree as ET

    suite = ET.parse(tmp_path / "ci.xml").getroot().find("testsuite[@name='kvaudit.regressions']")
    assert (suite.get("tests"), suite.get("errors"), suite.get("failures")) == ("3", "1", "0")
    (broken,) = [c for c in suite.findall("testcase") if c.find("error") is not None]
    assert broken.get("name") == "broken" and "broken.json" in broken.find("error").text
    assert json.load(open(tmp_path / "ci.sarif"))["runs"] and json.load(open(tmp_path / "ci.json"))
    # one line names every report, as fuzz's (it printed `JUnit written:`, `SARIF written:`, `reports written:`)
    written = [line for line in result.stderr.splitlines() if "written" in line]
    assert written == [f"reports written: {tmp_path / 'ci.xml'}, {tmp_path / 'ci.sarif'}, {tmp_path / 'ci.json'}"], \
        result.stderr


@pytest.mark.slow
def test_ci_fuzzes_every_preset_and_writes_reports(tmp_path):
    result = invoke("ci", "--max-time", "11", "--regressions", REGRESSIONS, "--out", str(tmp_path / "o"),
                    "--junit", str(tmp_path / "ci.xml"), "--sarif", str(tmp_path / "ci.sarif"))
    assert result.exit_code == 0, result.output
    xml = open(tmp_path / "ci.xml").read()
    assert xml.count('classname="kvaudit.regressions"') == len(os.listdir(REGRESSIONS))
    assert xml.count("no new findings") == len(PRESETS)  # every built-in preset, clean
    assert json.load(open(tmp_path / "ci.sarif"))["runs"][0]["results"] == []


def test_ci_gives_a_new_findings_junit_case_the_seconds_its_search_took_to_land_it(tmp_path, monkeypatch):
    """A new signature's case said time="0" where every other case gives its seconds. A fake clock: the
    search started at 100 s, the first signature landed at 110 s, the second at 112.5 s."""
    import types
    import xml.etree.ElementTree as ET

    import kvaudit.search.campaign as campaign
    import kvaudit.search.ci as ci

    path = os.path.join(REGRESSIONS, "session-close-while-running.json")
    sigs = sorted({f.signature for f in replay.load(path)[2]})
    clock = [110.0]
    monkeypatch.setattr(ci, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))

    def found_two(*a, on_finding, **k):
        stats = FuzzStats(executions=3, ops=9)
        stats.started = 100.0
        on_finding(sigs[0], path)
        clock[0] = 112.5
        on_finding(sigs[1], path)
        return campaign.CampaignResult(new={s: path for s in sigs}, stats=stats)

    monkeypatch.setattr(campaign, "run_campaign", found_two)
    empty = tmp_path / "regs"
    empty.mkdir()
    r = invoke("ci", "--max-time", "30", "--presets", "default", "--regressions", str(empty), "--out",
               str(tmp_path / "o"), "--junit", str(tmp_path / "j.xml"))
    assert r.exit_code == 1, r.output
    cases = ET.parse(tmp_path / "j.xml").getroot().findall(".//testcase[failure]")
    assert {c.get("name"): c.get("time") for c in cases} == {sigs[0]: "10.00", sigs[1]: "12.50"}


def test_ci_max_time_0_replays_the_regressions_only_and_makes_no_directory(tmp_path):
    """--max-time 0 ("replay the regressions only") printed 'fuzz corpus over 13 preset(s), 0.0s of search
    each' and made an empty kvaudit-ci-out/, where Hypothesis's home then pointed for the rest of the
    process (a test suite's own Hypothesis tests wrote kvaudit-ci-out/.hypothesis/ into the checkout)."""
    home = hypothesis_home()
    regs = tmp_path / "regs"
    regs.mkdir()
    shutil.copy(os.path.join(REGRESSIONS, "prefill-finish-leaks-row.json"), regs / "a.json")
    r = invoke("ci", "--max-time", "0", "--regressions", str(regs), "--out", str(tmp_path / "out"))
    assert r.exit_code == 0, r.output
    header = r.stderr.splitlines()[0]
    assert header.startswith(f"kvaudit ci: 1 regression file(s) in {regs}; no fuzz (--max-time 0: the regressions "
                             "only); start-up "), header
    assert "fuzz" not in r.stdout and not (tmp_path / "out").exists()
    assert hypothesis_home() == home


def test_fuzz_puts_hypothesis_s_home_back_for_an_in_process_caller(tmp_path):
    home = hypothesis_home()
    r = invoke("fuzz", "--fuzzer", "hypothesis", "--max-time", "1", "--out", str(tmp_path / "out"))
    assert r.exit_code == 0, r.output
    assert hypothesis_home() == home != tmp_path / "out" / ".hypothesis"


def test_a_refused_fuzz_or_ci_makes_no_directory(tmp_path):
    """A refused run made its --out directory (fuzz --preset nope left an empty kvaudit-out/ behind)."""
    for args in (["fuzz", "--preset", "nope"], ["ci", "--presets", "nope", "--max-time", "1"]):
        r = invoke(*args, "--out", str(tmp_path / "out"))
        assert r.exit_code == 2 and "nope" in one_error_line(r), r.output
        assert not (tmp_path / "out").exists()
    (tmp_path / "file").write_text("")
    for args in (["fuzz", "--max-time", "1"], ["ci", "--max-time", "1"]):  # checked before the run, made at a write
        r = invoke(*args, "--out", str(tmp_path / "file" / "out"))
        assert r.exit_code == 2 and one_error_line(r) == (f"kvaudit: error: --out {tmp_path / 'file' / 'out'}: cannot "
                                                          f"write in {tmp_path / 'file'} (not a directory)")


def test_a_name_too_long_for_the_file_system_is_refused_before_the_run(tmp_path):
    """Stop 62: a --corpus whose name is over the file system's 255 bytes passed the checks (they tried a file in
    the folder above) and the campaign died after its start-up as internal error 70; a --json of such a name was
    refused only once the search was over. Both are bad input now, one line, exit 2, before any engine is built."""
    long = "L" * 300
    for args in (["fuzz", "--corpus", str(tmp_path / long)], ["fuzz", "--out", str(tmp_path / "a" / long / "b")],
                 ["fuzz", "--json", str(tmp_path / f"{long}.json")],
                 ["ci", "--html", str(tmp_path / f"{long}.html")]):
        r = invoke(*args, "--max-time", "1")
        assert r.exit_code == 2, r.output
        assert re.search(r": a name of 30[05] bytes \(L{40}\.\.\.\): the file system of .* takes 255 at most$",
                         one_error_line(r)), r.output
        assert "start-up" not in r.output, r.output
    assert os.listdir(tmp_path) == []


def test_ci_bad_presets_is_one_line():
    result = invoke("ci", "--presets", "default,nope")
    assert result.exit_code == 2 and "nope" in one_error_line(result)


def test_ci_s_first_line_names_the_engine_and_its_release_as_fuzz_does(tmp_path, monkeypatch):
    """`fuzz` says `target vllm 0.33.0 (Scheduler)`; `ci`'s log said nothing of the engine or its release."""
    import dataclasses

    from kvaudit.targets import registry

    real_get = registry.get
    eut = dataclasses.replace(real_get("eut"), describe=lambda config: f"target eut 9.9 ({config.preset})")
    monkeypatch.setattr(registry, "get", lambda name: eut if name == "eut" else real_get(name))
    regs = tmp_path / "regs"
    regs.mkdir()
    shutil.copy(os.path.join(REGRESSIONS, "prefill-finish-leaks-row.json"), regs)
    r = invoke("ci", "--max-time", "0", "--regressions", str(regs), "--out", str(tmp_path / "out"))
    assert r.exit_code == 0, r.output
    assert r.stderr.splitlines()[0].startswith("kvaudit ci: target eut 9.9 (default); 1 regression file(s)"), r.stderr


def test_a_preset_list_takes_default_as_the_kind_s_default_and_refuses_an_empty_name():
    """`fuzz --target sglang --preset default` runs SGLang's default preset but `ci --target sglang --presets
    default` refused it; `--presets 'default,,chunked'` was taken silently while `--presets ''` was refused."""
    from kvaudit.app.configs import presets_arg
    from kvaudit.app.errors import InputError

    from kvaudit.targets import registry

    sglang = registry.get("sglang")
    assert presets_arg("--presets", "default", "sglang") == [sglang.default_preset]
    assert presets_arg("--presets", "default,chunked") == ["default", "chunked"]
    with pytest.raises(InputError, match='^--presets: unknown preset "all" in a list \\("all,default"\\): "all" '
                                         'stands alone'):
        presets_arg("--presets", "all,default")
    for value in ("default,,chunked", "", "default,"):
        with pytest.raises(InputError, match='^--presets: unknown preset "" '):
            presets_arg("--presets", value)


def test_ci_fuzzes_a_preset_named_twice_once(tmp_path, monkeypatch):
    """``ci --presets default,default`` fuzzed default twice: the list keeps the first of each name."""
    from kvaudit.search import ci
    fuzzed = []
    monkeypatch.setattr(ci, "fuzz_preset", lambda preset, *a, **k: fuzzed.append(preset) or ci.FuzzRun(preset, 1.0, 5))
    empty = tmp_path / "regs"
    empty.mkdir()
    r = invoke("ci", "--max-time", "2", "--presets", "default,chunked, default,chunked", "--regressions", str(empty),
               "--out", str(tmp_path / "o"))
    assert r.exit_code == 0, r.output
    assert fuzzed == ["default", "chunked"]


@pytest.mark.parametrize("args, option", [(["ci", "--presets", "default,sglang-session"], "--presets"),
                                          (["bench", "--overhead-presets", "sglang-session"], "--overhead-presets")])
def test_a_preset_of_another_target_in_a_list_says_which_target(args, option):
    """``fuzz --preset sglang-session`` says to add --target sglang; ``ci --presets sglang-session`` did not.
    (An SGLang preset: the kind lists every one with or without SGLang installed; vLLM's lists only what the
    installed release drives, none of its gated presets on a bare machine.)"""
    r = invoke(*args, "--max-time", "1") if args[0] == "ci" else invoke(*args)
    assert r.exit_code == 2, r.output
    line = one_error_line(r)
    assert line.startswith(f'kvaudit: error: {option}: unknown preset "sglang-session" (valid: default, '), line
    assert line.endswith(' or all) ("sglang-session" is a preset of --target sglang: add --target sglang)'), line


@pytest.mark.slow
def test_atheris_with_fork_2_from_the_cli_finds_the_hisparse_bug(tmp_path):
    corpus = tmp_path / "c"
    result = invoke("fuzz", *HISPARSE, "--fuzzer", "atheris", "--workers", "2", "--no-seeds", "--seed", "1",
                    "--max-time", "30", "--corpus", str(corpus))
    assert result.exit_code == 1, result.output
    found = known_signatures(str(corpus))
    assert any(s.startswith("leak/hisparse_") for s in found)
    assert "coverage=" in result.stderr and "edges" in result.stderr  # libFuzzer's edge coverage shown


def test_a_corpus_campaign_keeps_its_programs_in_the_corpus_folder_and_a_rerun_keeps_them(tmp_path):
    corpus = str(tmp_path / "c")
    run_campaign(hisparse_config(), "corpus", 4, 1, 1, corpus)
    programs = os.path.join(corpus, "programs")
    first = set(os.listdir(programs))
    assert first and all(n.endswith(".json") for n in first)
    for name in first:
        doc = json.load(open(os.path.join(programs, name)))
        assert doc["format"] == "kvaudit.program/1" and doc["program"][-1] == {"op": "idle"}
    run_campaign(hisparse_config(), "corpus", 3, 2, 1, corpus)
    assert first <= set(os.listdir(programs))  # nothing lost; the rerun adds what it reaches anew


def test_an_interrupt_during_a_findings_registration_waits_for_its_write_and_announcement():
    """A SIGTERM between the fleet's registration and this host's write left the bug known in Redis, the
    file unwritten and the run exiting 130 (tests/test_fleet.py, under load): the block finishes first."""
    import signal

    from kvaudit.audit.runner import INTERRUPTED
    from kvaudit.search.campaign import _held_interrupts

    def raising(signum, frame):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, raising)
    steps = []
    try:
        with pytest.raises(KeyboardInterrupt):
            with _held_interrupts():
                steps.append("registered")
                os.kill(os.getpid(), signal.SIGTERM)  # delivered at the next bytecode: held
                steps.append("written")
        assert steps == ["registered", "written"]
        assert INTERRUPTED.is_set()
        assert signal.getsignal(signal.SIGTERM) is raising  # the caller's handler is back
        with _held_interrupts():  # no signal: nothing raised
            steps.append("again")
        assert steps[-1] == "again"
    finally:
        signal.signal(signal.SIGTERM, old)
        INTERRUPTED.clear()


@pytest.mark.parametrize("fuzzer", ["hypothesis", "random"])
def test_every_search_counts_what_its_programs_reached(fuzzer, tmp_path, monkeypatch):
    """The random and corpus searches summed Target.reach() for the clean run's `reached:` line; the
    Hypothesis search did not, so a clean `--fuzzer hypothesis` run said nothing of the paths it reached."""
    from kvaudit.targets.eut.target import EutTarget

    monkeypatch.setattr(EutTarget, "reach", lambda self: {"probe_paths": 1})
    r = invoke("fuzz", "--fuzzer", fuzzer, "--max-time", "2", "--out", str(tmp_path / "o"))
    assert r.exit_code == 0, r.output
    assert re.search(r"^reached: probe_paths=[1-9]", r.stdout, re.M), r.stdout


@pytest.mark.parametrize("preset, paths", [("streaming-session", ("session_turns", "retractions")),
                                           ("pd-decode", ("failed_transfers", "aborts"))])
def test_a_clean_built_in_engine_run_says_what_its_programs_reached(preset, paths, tmp_path):
    """The built-in engine's target counted nothing: its clean runs had no `reached:` line."""
    r = invoke("fuzz", "--preset", preset, "--fuzzer", "random", "--max-time", "2", "--out", str(tmp_path / "o"))
    assert r.exit_code == 0, r.output
    counts = reached(r.stdout)
    assert counts[paths[0]] > 0 and paths[1] in counts, counts


def test_a_path_no_program_reached_is_named_as_not_searched(tmp_path, monkeypatch):
    """sglang-paged's clean run said ``evictions_for_alloc=0`` inside its ``reached:`` line with nothing to set
    it apart: a path at 0 was not searched, and the run now says so on a line of its own."""
    from kvaudit.targets.eut.target import EutTarget

    monkeypatch.setattr(EutTarget, "reach", lambda self: {"probe_paths": 1, "evictions": 0, "aborts": 0})
    r = invoke("fuzz", "--fuzzer", "random", "--max-time", "2", "--out", str(tmp_path / "o"))
    assert r.exit_code == 0, r.output
    assert reached(r.stdout)["evictions"] == 0
    assert re.search(r"^not reached: aborts, evictions \(no program of the [1-9]\d* took these paths: not searched\)$",
                     r.stdout, re.M), r.stdout
    monkeypatch.setattr(EutTarget, "reach", lambda self: {"probe_paths": 1})
    r = invoke("fuzz", "--fuzzer", "random", "--max-time", "1", "--out", str(tmp_path / "p"))
    assert r.exit_code == 0 and "not reached" not in r.stdout, r.output


def test_an_interrupted_clean_run_still_says_what_it_reached(tmp_path, monkeypatch):
    from kvaudit.audit.runner import INTERRUPTED
    from kvaudit.search import fuzz
    from kvaudit.targets.eut.target import EutTarget

    monkeypatch.setattr(EutTarget, "reach", lambda self: {"probe_paths": 1})
    real, runs = fuzz.run_program, []

    def interrupted_third(*a, **k):
        runs.append(1)
        if len(runs) == 3:
            INTERRUPTED.set()  # as the SIGINT handler does
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(fuzz, "run_program", interrupted_third)
    r = invoke("fuzz", "--fuzzer", "random", "--max-time", "30", "--out", str(tmp_path / "o"))
    assert r.exit_code == 130, r.output
    assert "reached: probe_paths=2" in r.stdout, r.stdout


def test_a_clean_ci_preset_line_names_a_path_no_program_reached(tmp_path, monkeypatch):
    """`kvaudit fuzz` names a path at 0 on a `not reached:` line of its own (not searched); `kvaudit ci`'s preset
    line only listed it inside `reached:` (`fuzz retract: 12 executions, clean; reached: ..., oom_retractions=0,
    ...`), where a clean night read as if the path had been searched."""
    from kvaudit.targets.eut.target import EutTarget

    monkeypatch.setattr(EutTarget, "reach", lambda self: {"probe_paths": 1, "evictions": 0, "aborts": 0})
    empty = tmp_path / "regs"
    empty.mkdir()
    r = invoke("ci", "--max-time", "2", "--presets", "default", "--fuzzer", "random", "--regressions", str(empty),
               "--out", str(tmp_path / "o"))
    assert r.exit_code == 0, r.output
    assert re.search(r"^fuzz default: [1-9]\d* executions, clean; reached: aborts=0, evictions=0, probe_paths=[1-9]\d*; "
                     r"not reached: aborts, evictions \(not searched\)$", r.stderr, re.M), r.output
    monkeypatch.setattr(EutTarget, "reach", lambda self: {"probe_paths": 1})
    r = invoke("ci", "--max-time", "1", "--presets", "default", "--fuzzer", "random", "--regressions", str(empty),
               "--out", str(tmp_path / "p"))
    assert r.exit_code == 0 and "not reached" not in r.output, r.output


def test_a_campaign_sums_its_workers_path_counters_keeping_a_path_at_zero():
    """Each worker's progress carries its Target.reach() sums; the parent's stats hold their total, and a
    counter every worker has at 0 stays, at 0 (the clean run's ``reached:`` line names the path not reached)."""
    from kvaudit.search.campaign import CampaignResult, _Tally

    result = CampaignResult()
    tally = _Tally(result, None, None)
    tally(("progress", 0, 10, 100, [], [], None, {"preemptions": 3, "failed_transfers": 0}, None))
    tally(("progress", 1, 5, 50, [], [], None, {"preemptions": 1, "failed_transfers": 0}, [(2, ["s1"])]))
    tally(("progress", 0, 12, 120, [], [], None, {"preemptions": 4, "failed_transfers": 0}, None))  # worker 0 again
    assert dict(result.stats.reached) == {"preemptions": 5, "failed_transfers": 0}
    assert result.stats.executions == 17
    assert result.suppression_usage == {1: [(2, ["s1"])]}  # (a worker with a suppression file sends its rules' usage)


def test_ci_that_would_check_nothing_is_a_usage_error(tmp_path):
    """`ci --max-time 0 --regressions <empty dir>` printed 'passed: 0/0 regressions ok' and exited 0: a CI job
    with a wrong regressions path went green having checked nothing. With a fuzz budget an empty directory
    still means "fuzz only"."""
    from cli_helpers import one_error_line

    empty = tmp_path / "regs"
    empty.mkdir()
    r = invoke("ci", "--max-time", "0", "--regressions", str(empty))
    assert r.exit_code == 2, r.output + r.stderr
    assert one_error_line(r) == (f"kvaudit: error: --regressions {empty}: no replay file (*.json) in it, and "
                                 "--max-time 0 fuzzes nothing: the job would check nothing")
    r = invoke("ci", "--max-time", "0.5", "--regressions", str(empty), "--out", str(tmp_path / "o"))
    assert r.exit_code == 0 and "0/0 regressions ok" in r.output, r.output + r.stderr


def test_ci_keeps_each_presets_reproducer_when_two_presets_find_one_signature(tmp_path, monkeypatch):
    """Two presets finding the same new signature wrote one --out file: the second preset's copy replaced
    the first's, and both JUnit cases (and timelines) named the survivor, a program of the other config."""
    import xml.etree.ElementTree as ET

    import kvaudit.search.campaign as campaign

    path = os.path.join(REGRESSIONS, "session-close-while-running.json")
    sigs = sorted({f.signature for f in replay.load(path)[2]})
    monkeypatch.setattr(campaign, "run_campaign", lambda config, *a, **k: campaign.CampaignResult(
        new={s: path for s in sigs}, stats=FuzzStats(executions=3, ops=9)))
    empty = tmp_path / "regs"
    empty.mkdir()
    r = invoke("ci", "--max-time", "2", "--presets", "default,chunked", "--regressions", str(empty),
               "--out", str(tmp_path / "o"), "--junit", str(tmp_path / "j.xml"))
    assert r.exit_code == 1, r.output
    name = os.path.basename(path)
    first, second = tmp_path / "o" / name, tmp_path / "o" / name.replace(".json", ".chunked.json")
    assert sorted(os.listdir(tmp_path / "o")) == sorted([first.name, second.name]), os.listdir(tmp_path / "o")
    cases = ET.parse(tmp_path / "j.xml").getroot().findall(".//testcase[failure]")
    named = sorted((c.get("classname"), c.find("failure").text.split("replay file: ")[1].split()[0]) for c in cases)
    assert {f for _, f in named} == {str(first), str(second)}, named


def _report_sigint(q):
    q.put(signal.getsignal(signal.SIGINT) == signal.SIG_IGN)


def test_a_worker_starts_with_sigint_ignored_and_the_parent_keeps_its_handler():
    # a terminal's Ctrl-C reaches every process of the group: a worker still importing must not take it
    # (multiprocessing's traceback from its import torch, tester stop 55); the parent's handler is back after
    import multiprocessing as mp

    from kvaudit.search.campaign import sigint_ignored_at_birth

    ctx = mp.get_context("spawn")
    outer = signal.signal(signal.SIGINT, signal.default_int_handler)  # a terminal's (a background job ignores it)
    try:
        got = []
        for ignored in (True, False):
            q = ctx.Queue()
            p = ctx.Process(target=_report_sigint, args=(q,))
            if ignored:
                with sigint_ignored_at_birth():
                    p.start()
            else:
                p.start()
            got.append(q.get(timeout=60))
            p.join(timeout=30)
        assert got == [True, False]  # (without the block a spawned Python installs its own SIGINT handler)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, outer)


def test_minimize_stops_at_its_until_with_the_smallest_program_that_reproduced(monkeypatch):
    """A campaign's minimization had no clock: a finding whose replay costs seconds (an idle() hang) kept a
    campaign running long past its budget. Replays here take 0.05 s; the bug is op 7 of 40."""
    from kvaudit.search import minimize as mz

    def reproduces(config, ops, signature, suppressions=None):
        time.sleep(0.05)
        return any(op.n == 7 for op in ops if isinstance(op, Step))

    monkeypatch.setattr(mz, "reproduces", reproduces)
    program = [Step(n=i) for i in range(1, 41)]
    started = time.monotonic()
    with pytest.raises(mz.OutOfTime) as e:
        mz.minimize(None, program, "leak/x/y", until=started + 0.3)
    assert time.monotonic() - started < 0.3 + 0.2
    assert Step(n=7) in e.value.smallest and len(e.value.smallest) < len(program)
    assert mz.minimize(None, program, "leak/x/y") == [Step(n=7)]  # no until: to the end


def test_minimize_and_replay_update_show_a_non_utf8_or_newline_file_name_escaped(tmp_path):
    """Stop 62: ``minimize``'s ``written to PATH`` and ``replay --update``'s ``PATH: outcome`` wrote a replay
    file's name raw: a newline split the line, and a byte that is not UTF-8 was internal error 70 on a strict
    UTF-8 stream (after the file was written). Shown escaped, as the campaign's lines show it."""
    src = os.path.join(REGRESSIONS, "session-close-while-running.json")
    name = os.fsdecode(bytes(tmp_path) + b"/r\xff\nz.json")
    shutil.copy(src, name)
    for args, line in ((("minimize", name), f"written to {tmp_path}/r\\xff\\nz.min.json"),
                       (("replay", "--update", name), f"{tmp_path}/r\\xff\\nz.json: ")):
        r = invoke(*args)
        assert r.exit_code == 0, r.output
        assert not re.search("[\udc80-\udcff]", r.output), r.output
        assert line in r.output, r.output


def test_draining_the_stopped_workers_news_never_waits_on_a_message_a_killed_worker_cut_short():
    """Stop 62: _drain (40b1908) reads the queue after the workers stopped; a worker SIGKILLed while its queue
    thread wrote a message over the pipe's atomic size into a full pipe (the parent had stopped reading) leaves
    part of it, and reading that blocked for ever: a Ctrl-C that never ended. The whole messages before it are
    still handled; the cut one ends the drain."""
    import multiprocessing as mp
    import pickle
    import struct
    import threading

    from kvaudit.search import campaign

    q = mp.get_context("spawn").Queue()
    news = ("finding", 0, "leak/x", "/c/findings/leak_x.json")
    for _ in range(2):  # (as put() does for each)
        q._sem.acquire()
    q._writer.send_bytes(pickle.dumps(news))
    q._writer._send(struct.pack("!i", 100_000) + b"x" * 5000)  # the header and the first 5000 of 100000 bytes
    handled = []
    t = threading.Thread(target=campaign._drain, args=(q, handled.append), daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "the drain waits for the rest of a message no worker will send"
    assert handled == [news]


def test_a_replay_files_home_skips_a_fifo_folder_or_dangling_link_of_its_name(tmp_path):
    """Stop 62: replay.home (where fuzz --out, a campaign's pull, ci --out and the atheris harness put a finding's
    file) read any entry of the finding's name to see whether it was a replay file: a FIFO of that name made it
    wait for ever for a writer (fuzz --out DIR hung, deaf to SIGTERM). Only a regular file is read; any other
    entry is something else, left as it is: the next free name is taken."""
    import threading

    sig = "leak/token_to_kv_pool/request-kv/release_req@x.py"
    stem = replay.file_name(sig)[:-len(".json")]
    os.mkfifo(tmp_path / f"{stem}.json")
    (tmp_path / f"{stem}.2.json").mkdir()
    os.symlink(tmp_path / "nowhere", tmp_path / f"{stem}.3.json")
    got = []
    t = threading.Thread(target=lambda: got.append(replay.home(str(tmp_path), sig, "eut")), daemon=True)
    t.start()
    t.join(10)
    if t.is_alive():  # (let the blocked open go)
        os.close(os.open(tmp_path / f"{stem}.json", os.O_WRONLY | os.O_NONBLOCK))
    assert got == [(str(tmp_path / f"{stem}.4.json"), False)]
    from kvaudit.search import campaign  # a campaign's corpus: read at its start, and at its end

    (tmp_path / "findings").mkdir()
    os.mkfifo(tmp_path / "findings" / "a.json")
    t = threading.Thread(target=lambda: got.append(campaign.skipped_lines(str(tmp_path), "eut")), daemon=True)
    t.start()
    t.join(10)
    if t.is_alive():
        os.close(os.open(tmp_path / "findings" / "a.json", os.O_WRONLY | os.O_NONBLOCK))
    assert got[1:] == [({}, [f"1 file(s) in {tmp_path}/findings are not replay files, skipped: a.json"])]


@pytest.mark.slow
def test_a_worker_killed_mid_run_is_named_at_the_end(tmp_path):
    """tester tf63: a worker SIGKILLed mid-run (the OOM killer) went unsaid: the run ended as "2 worker(s)", clean,
    having searched with one. The end names it and how it ended; the exit code is the search's own."""
    corpus = str(tmp_path / "corpus")
    env = {**plain_env(), "KVAUDIT_TEST_CORPUS": corpus}  # marks this test's worker processes
    proc = subprocess.Popen([kvaudit_script(), "fuzz", "--preset", "retract", "--fuzzer", "random", "--max-time", "8",
                             "--workers", "2", "--corpus", corpus], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    try:
        assert _wait_for(lambda: len(_workers_of(corpus)) == 2, 60, proc), "no two workers within 60 s"
        time.sleep(1)
        os.kill(max(_workers_of(corpus)), signal.SIGKILL)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, (out, err)
    assert re.search(r"warning: worker [01] ended by SIGKILL mid-run: the campaign searched on with 1 of 2 workers",
                     err), err


def test_a_fifo_among_the_regression_files_is_malformed_not_a_wait_for_ever(tmp_path):
    """th64: kvaudit ci --regressions DIR with a FIFO DIR/x.json never ended (opening it to read waits for a
    writer; killed by timeout 60). It is a malformed regression file now, and the job goes on."""
    from cli_helpers import freed_if_it_waits
    from kvaudit.search import ci

    fifo = str(tmp_path / "x.json")
    os.mkfifo(fifo)
    with freed_if_it_waits(fifo) as rescued:  # (the old code waited in open())
        check = ci.check_regression(fifo)
    assert not rescued, "check_regression waited on the FIFO"
    assert check.malformed and check.problem == f"malformed: {fifo} is not a regular file (a FIFO's reader waits " \
                                               "for a writer for ever)"


def test_a_campaign_rerun_keeps_the_known_findings_still_open_in_its_sarif(tmp_path):
    """ts64: `fuzz --corpus DIR --sarif S` left the findings the corpus already knew out of the SARIF (0 results):
    uploaded to code scanning, such a log closes alerts that are still open. As `kvaudit ci`, the known ones whose
    corpus file still reproduces them are results, `"unchanged"`, at the same fingerprint."""
    from kvaudit.reports.sarif import to_sarif

    corpus = tmp_path / "c"
    (corpus / "findings").mkdir(parents=True)
    src = os.path.join(REGRESSIONS, "retract-unaligned-page.json")
    shutil.copy(src, corpus / "findings")
    config, _, recorded, _ = replay.load(src)
    sarif = tmp_path / "s.sarif"
    r = invoke("fuzz", "--preset", "retract", "--corpus", str(corpus), "--max-time", "1", "--out",
               str(tmp_path / "o"), "--sarif", str(sarif))
    assert r.exit_code in (0, 1), r.output
    results = json.load(open(sarif))["runs"][0]["results"]
    known = {f.signature for f in recorded}
    old = {r_["partialFingerprints"]["kvauditSignature/v1"]: r_ for r_ in results}
    assert known <= set(old), r.output
    assert {old[s]["baselineState"] for s in known} == {"unchanged"}
    assert {r_["baselineState"] for s, r_ in old.items() if s not in known} <= {"new"}
    # the result a SARIF of the corpus file's findings has (location, fingerprints), but for its baselineState
    want = {r_["partialFingerprints"]["kvauditSignature/v1"]: r_ for r_ in to_sarif(recorded, config)["runs"][0]["results"]}
    assert {s: {k: v for k, v in old[s].items() if k != "baselineState"} for s in known} == {s: want[s] for s in known}


def test_ci_gives_each_new_files_replay_command_with_the_suppressions(tmp_path, monkeypatch):
    """Tester te65: `ci --suppress RULES` named each new file (`NEW sig -> file`) with no replay command, and the
    `kvaudit replay FILE` a user typed lacked the rules (the replay then stops at a finding they hid), unlike
    fuzz's `replay file:` line. Each new file gets that line now, with `--suppress RULES`."""
    import shlex

    import kvaudit.search.campaign as campaign

    path = os.path.join(REGRESSIONS, "session-close-while-running.json")
    sigs = sorted({f.signature for f in replay.load(path)[2]})
    monkeypatch.setattr(campaign, "run_campaign", lambda *a, **k: campaign.CampaignResult(
        new={s: path for s in sigs}, stats=FuzzStats(executions=3, ops=9)))
    rules = tmp_path / "a rule's.toml"
    rules.write_text('[[suppress]]\nkind = "lock-imbalance"\nreason = "hidden"\n')
    (tmp_path / "regs").mkdir()
    r = invoke("ci", "--max-time", "1", "--presets", "default", "--regressions", str(tmp_path / "regs"),
               "--out", str(tmp_path / "o"), "--suppress", str(rules))
    assert r.exit_code == 1, r.output
    out = str(tmp_path / "o" / os.path.basename(path))
    assert f"replay file: {out}   (kvaudit replay {out} --suppress {shlex.quote(str(rules))})" in r.stdout, r.stdout


def test_an_interrupted_campaign_counts_the_programs_run_since_its_worker_s_last_progress(tmp_path, monkeypatch):
    """A worker's progress reaches its parent at most every PROGRESS_EVERY seconds, and an interrupt (Ctrl-C,
    SIGTERM) ended its search with no last one: `fuzz --db ... --workers 2` stopped after 4 s said 47
    executions in its table and --json while `campaign status` showed its two workers' 25 + 28, and one stopped
    in its first second said 0 executions."""
    from kvaudit.search import campaign, fuzzers

    def five_then_ctrl_c(config, seconds, seed, stats, run):
        for _ in range(5):
            stats.executions += 1
            stats.ops += 2
            run.on_progress(stats)
        raise KeyboardInterrupt

    monkeypatch.setattr(campaign, "PROGRESS_EVERY", 3600.0)
    monkeypatch.setitem(fuzzers._FUZZERS, "five", fuzzers.FuzzerKind("five", "five programs, then Ctrl-C",
                                                                        five_then_ctrl_c))
    result = campaign.run_campaign(hisparse_config(), "five", 30.0, 0, 1, str(tmp_path / "c"))
    assert result.interrupted
    assert (result.stats.executions, result.stats.ops) == (5, 10)
    assert json.load(open(tmp_path / "c" / "campaign.json"))["runs"][0]["executions"] == 5
