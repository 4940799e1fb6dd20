"""Reports: the console report (snapshots at a fixed width), the occupancy timeline, the HTML page,
``kvaudit report`` and the report flags of ``fuzz``/``replay``, and plain progress off a terminal.

The snapshot inputs are report JSON files in tests/data/report/ (written by ``kvaudit replay
corpora/regressions/<bug>.json --json ...``): plain data with each site's source line embedded, so
the snapshots do not move when engine code moves (frames are rendered as recorded there;
tests/test_frames.py checks them against the current source). Each snapshot exists twice: as a
terminal shows it (panels) and as a CI log gets it (plain lines). Regenerate with ``pytest --snapshot-update``
after a deliberate change to the console layout, and read the diff.
"""

import dataclasses
import io
import json
import os
import re
import subprocess

import pytest
from cli_helpers import invoke, kvaudit_script, one_error_line, plain_env
from rich.console import Console

from kvaudit import replay

from kvaudit.reports import timeline
from kvaudit.audit.findings import Finding
from kvaudit.reports.html_report import render_html
from kvaudit.reports.outputs import Case
from kvaudit.audit.frames import Frame
from kvaudit.reports.report import is_plain, print_report, summary_line, summary_rows
from kvaudit.reports.timeline import SERIES

DATA = os.path.join(os.path.dirname(__file__), "data", "report")
REGRESSIONS = os.path.join(os.path.dirname(__file__), "..", "corpora", "regressions")
SNAPSHOT_CASES = {  # kind -> a report file whose first finding is of that kind
    "leak": "hisparse-prebuilt-skip-finish",
    "double-free": "overlap-abort-double-free",
    "use-after-free": "radix-lock-skips-matched-node",
    "stale-kv": "aborted-kv-inserted",
    "accounting-drift": "session-borrow-double-count",
}


def render(config, program, findings, width=100, terminal=True, **kw) -> str:
    """The console report as a terminal shows it (rich, no colour codes), or with ``terminal=False``
    as a CI log gets it (plain lines)."""
    buf = io.StringIO()
    print_report(Console(file=buf, width=width, color_system=None, highlight=False, force_terminal=terminal),
                 config, program, findings, **kw)
    return buf.getvalue()


@pytest.fixture
def as_recorded(monkeypatch):
    """Frames rendered as recorded, not checked against the current source (tests/test_frames.py
    does that), so that the snapshots do not move when engine code moves."""
    for where in ("report", "sarif"):  # (the frame lines, and the ERROR line naming one: sarif.current_summary)
        monkeypatch.setattr(f"kvaudit.reports.{where}.resolve", lambda s, engine=None: Frame(s.line, s.source))


@pytest.mark.parametrize("kind", list(SNAPSHOT_CASES))
def test_console_report_snapshot(kind, snapshot, as_recorded):
    config, program, findings, _ = replay.load(os.path.join(DATA, SNAPSHOT_CASES[kind] + ".json"))
    assert findings[0].kind == kind
    text = render(config, program, findings)
    assert text == snapshot
    # what a reader needs is there, whatever the layout: the LeakSanitizer-style line, the stack
    # with its source line, the program and the engine's own verdict
    f = findings[0]
    assert "==ERROR: kvaudit: " + f.summary()[:60] in text.replace("\n│ ", " ")
    for site in f.alloc_sites + f.free_sites + f.read_sites:
        assert f"{site.function}  {site.file}:{site.line}" in text and site.source[:40] in text
    assert "engine check_memory():" in text and "summary" in text
    assert text.splitlines()[-1].startswith("SUMMARY: kvaudit: ")


@pytest.mark.parametrize("kind", list(SNAPSHOT_CASES))
def test_plain_report_snapshot(kind, snapshot, as_recorded):
    """Off a terminal (a CI log): no box frames, no control codes, each finding's ``==ERROR:
    kvaudit:`` line whole at column 0, and the closing ``SUMMARY: kvaudit:`` line."""
    config, program, findings, _ = replay.load(os.path.join(DATA, SNAPSHOT_CASES[kind] + ".json"))
    text = render(config, program, findings, terminal=False)
    assert text == snapshot
    lines = text.splitlines()
    assert [line for line in lines if line.startswith("==ERROR: kvaudit: ")] == \
        [f"==ERROR: kvaudit: {f.summary()}" for f in findings]
    assert not re.search("[\x1b╭╰│┃━]", text)
    assert lines[-1].startswith("SUMMARY: kvaudit: ") and lines[-1] == summary_line(findings)


def test_summary_line_counts_findings_kinds_signatures_and_units():
    config, program, findings, _ = replay.load(os.path.join(DATA, "overlap-abort-double-free.json"))
    assert summary_line(findings) == ("SUMMARY: kvaudit: 2 finding(s) (2 double-free) in 2 signature(s); "
                                      "1 distinct slot(s), 1 distinct row(s) involved.")
    assert summary_line(findings + findings[:1], {"leak": 2}) == (
        "SUMMARY: kvaudit: 3 finding(s) (3 double-free) in 2 signature(s); 1 distinct slot(s), 1 distinct row(s) "
        "involved; 2 suppressed signature(s).")  # the repeated finding's row counted once
    assert summary_line([], {"leak": 2}) == "SUMMARY: kvaudit: no findings; 2 suppressed signature(s)."
    assert summary_line([]) == "SUMMARY: kvaudit: no findings."


@pytest.mark.parametrize("name", ["hisparse-prebuilt-skip-finish", "overlap-abort-double-free"])
def test_two_findings_of_one_op_are_listed_alike_whatever_order_they_came_in(name, as_recorded):
    """``kvaudit fuzz`` passes its triaged findings with the one it chased first, ``kvaudit replay`` in the
    order the checks met them: every report lists them by op, step, then signature."""
    from kvaudit.reports.outputs import ReportData

    config, program, findings, _ = replay.load(os.path.join(DATA, f"{name}.json"))
    assert len(findings) == 2 and findings[0].op_index == findings[1].op_index
    listed = sorted(findings, key=lambda f: f.signature)
    for order in (findings, findings[::-1]):
        text = render(config, program, order, terminal=False)
        errors = [line for line in text.splitlines() if line.startswith("==ERROR: kvaudit: ")]
        assert errors == [f"==ERROR: kvaudit: {f.summary()}" for f in listed]
        data = ReportData.single(config, program, order, {}, {})
        assert [f.signature for f in data.findings] == [f.signature for f in listed]
        assert data.doc()["findings"][0]["pool"] == order[0].pool  # the replay file keeps the chased one first
        page = render_html(config, [Case(program, order)])
        assert page.index(listed[0].signature) < page.index(listed[1].signature)


def test_summary_line_counts_a_unit_once_per_pool_and_run():
    """The same slots leaked under two signatures (two findings) are one set of slots; the same ids in
    another pool, or in another program run (a campaign's other case), are other memory."""
    _, _, findings, _ = replay.load(os.path.join(DATA, "overlap-abort-double-free.json"))
    a = dataclasses.replace(findings[0], kind="leak", pool="token_to_kv_pool", unit="slot", slots=[4, 5, 6],
                            num_units=3)
    b = dataclasses.replace(a, slots=[5, 6, 7], num_units=3)
    other_pool = dataclasses.replace(a, pool="hisparse_device")
    assert summary_line([a, b]).endswith("; 4 distinct slot(s) involved.")
    assert summary_line([a, b, other_pool]).endswith("; 7 distinct slot(s) involved.")
    assert summary_line([a, b], runs=[[a], [b]]).endswith("; 6 distinct slot(s) involved.")


@pytest.mark.parametrize("env, plain", [({}, False), ({"NO_COLOR": "1"}, True), ({"TERM": "dumb"}, True)],
                         ids=["colour-terminal", "no-color", "dumb"])
def test_a_terminal_gets_plain_lines_with_no_color_or_term_dumb(monkeypatch, env, plain):
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setenv("TERM", "xterm-256color")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    console = Console(file=io.StringIO(), force_terminal=True)
    assert is_plain(console) is plain
    config, program, findings, _ = replay.load(os.path.join(DATA, "overlap-abort-double-free.json"))
    print_report(console, config, program, findings)
    text = console.file.getvalue()
    assert ("\x1b" not in text) is plain
    text = re.sub("\x1b\\[[0-9;]*m", "", text)
    assert ("\n==ERROR: kvaudit: " in text) is plain and ("╭─ finding 1" in text) is not plain
    assert text.splitlines()[-1].startswith("SUMMARY: kvaudit: 2 finding(s)")


def test_report_cli_through_a_pipe_prints_greppable_lines():
    result = invoke("report", os.path.join(REGRESSIONS, "session-close-while-running.json"))
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert len([line for line in lines if line.startswith("==ERROR: kvaudit: ")]) == 2
    assert lines[-1].startswith("SUMMARY: kvaudit: 2 finding(s) (2 use-after-free)")
    assert not re.search("[\x1b╭╰│]", result.stdout)


def test_a_stale_frame_is_flagged_in_the_report(tmp_path):
    """A frame recorded before the code moved: its line now lies outside its function, so the
    report says so instead of printing that line's text as the frame's."""
    doc = json.load(open(os.path.join(REGRESSIONS, "overlap-abort-double-free.json")))
    site = doc["findings"][0]["free_sites"][0]
    assert site["function"] == "handle_abort"
    site.update(line=1, source="")
    path = tmp_path / "stale.json"
    path.write_text(json.dumps(doc))
    text = invoke("report", str(path)).stdout
    assert "    #0 handle_abort  engine_under_test/scheduler.py:1\n" in text
    assert "(stale: line 1 is outside handle_abort in the current source; the file changed since this " \
           "was recorded)" in text


def test_snapshot_inputs_carry_their_source_lines():
    for name in SNAPSHOT_CASES.values():
        _, _, findings, _ = replay.load(os.path.join(DATA, name + ".json"))
        sites = [s for f in findings for s in f.alloc_sites + f.free_sites + f.read_sites]
        assert all(s.source for s in sites), name
        assert sites or findings[0].kind == "accounting-drift"  # drift is about counters: no site


def test_a_blocks_pool_finding_is_told_in_blocks_in_every_format():
    """vLLM's pool unit is a block: its findings said "Direct leak of 16 slots (1 page)"."""
    from kvaudit.audit.findings import OwnerChange, Site
    from kvaudit.export.issue import _finding
    from kvaudit.reports.junit import failure_text
    from kvaudit.reports.report import lifecycle_table
    from kvaudit.reports.sarif import _units_line

    site = Site("vllm/v1/core/sched/scheduler.py", 1435, "schedule")
    f = Finding(kind="leak", pool="block_pool", message="allocated, unreachable from every root", unit="block",
                slots=list(range(16, 32)) + list(range(48, 64)), num_units=2, alloc_sites=[site], op_index=1, step=2,
                owner_history=[OwnerChange(1, 2, "req:1", "alloc")])
    assert f.summary().startswith("Direct leak of 2 blocks in pool block_pool")
    assert f.listed() == ("blocks", [1, 3])
    buf = io.StringIO()
    Console(file=buf, width=120, color_system=None).print(lifecycle_table(f, plain=True))
    assert "lifecycle of block 1" in buf.getvalue()
    assert summary_line([f]).endswith("; 2 distinct block(s) involved.")
    assert "blocks: [1, 3] (2 blocks)" in failure_text(f)
    assert _units_line(f) == "Blocks: 1, 3."
    from kvaudit.reports.sarif import to_sarif
    from kvaudit.targets.vllm.config import VllmConfig
    props = to_sarif([f], VllmConfig())["runs"][0]["results"][0]["properties"]
    assert (props["blocks"], props["blocksTotal"], props["unit"]) == ([1, 3], 2, "block")  # not token "slots"
    assert "slots" not in props and "slotsTotal" not in props
    assert "- 2 block(s): 1, 3" in _finding(f, "vllm")
    page = Finding(kind="leak", pool="token_to_kv_pool", message="m", unit="page", slots=[4, 5], num_units=1)
    assert "2 slots (1 page)" in page.summary() and page.listed() == ("slots", [4, 5])  # a page pool's: unchanged
    assert Finding.from_dict(json.loads(json.dumps(f.to_dict()))) == f  # a replay file keeps the unit


def test_leak_lifecycle_shows_alloc_owner_end_and_never_freed():
    config, program, _, _ = replay.load(os.path.join(REGRESSIONS, "retract-unaligned-page.json"))
    from kvaudit.audit.runner import execute

    f = execute(config, program).findings[0]
    text = render(config, program, [f], width=140)
    life = text[text.index("lifecycle of page"):text.index("minimized program")]
    rows = [line for line in life.splitlines() if re.search(r"│\s+\S", line)]
    alloc = next(i for i, r in enumerate(rows) if "alloc at" in r)
    owned = next(i for i, r in enumerate(rows) if "owned by req:" in r)
    gone = next(i for i, r in enumerate(rows) if "no longer holds it" in r)
    assert alloc < owned < gone
    assert "never freed; last owner: req:" in rows[-1]


def test_summary_counts_distinct_signatures_suppressed_and_duplicates():
    a = Finding(kind="leak", pool="p", message="m")
    b = Finding(kind="leak", pool="q", message="m")
    rows = summary_rows([a, a, b], suppressed={"double-free": 2})
    assert rows == [{"kind": "leak", "findings": 2, "suppressed": 0, "deduplicated": 1},  # in KINDS order
                    {"kind": "double-free", "findings": 0, "suppressed": 2, "deduplicated": 0}]


# -- the occupancy timeline ------------------------------------------------------------------------

def test_timeline_of_a_leak_shows_the_leaked_slot_from_the_detection_step_on():
    config, program, _, _ = replay.load(os.path.join(REGRESSIONS, "hisparse-prebuilt-skip-finish.json"))
    t = timeline.record(config, program)
    assert t["detected"]["kind"] == "leak" and t["detected"]["pool"] == "hisparse_device"
    leaked = t["pools"]["hisparse_device"]["series"]["leaked"]
    at = t["steps"].index(t["detected"]["step"])
    assert leaked[0] == 0 and all(x == 1 for x in leaked[at:])
    assert len(t["steps"]) > at + 1  # the aftermath after the program is recorded too
    assert t["program_end_step"] == t["detected"]["step"]


def test_timeline_terms_add_up_to_the_total_when_nothing_is_wrong():
    from kvaudit.program import Abort, Idle, Step, Submit
    from kvaudit.targets.eut.presets import get_preset

    config = get_preset("default").config()
    program = [Submit(0, 40, 6), Submit(1, 30, 8), Step(3), Abort(0), Submit(0, 50, 4, extends=1), Idle()]
    t = timeline.record(config, program)
    assert t["detected"] is None
    used = False
    for pool, p in t["pools"].items():
        for i in range(len(t["steps"])):
            terms = [p["series"][k][i] for k in SERIES]
            assert sum(terms) == p["total"], (pool, t["steps"][i], dict(zip(SERIES, terms)))
            assert p["series"]["leaked"][i] == 0
            used |= p["series"]["uncached"][i] > 0 and p["series"]["evictable"][i] + p["series"]["protected"][i] > 0
    assert used  # the program really had requests and cached prefixes at once


def test_a_series_a_bug_drives_negative_is_a_valid_timeline_and_plots(tmp_path):
    """session-abort-borrows-slot's symptom is session_held < 0: the file fuzz writes must be one
    `kvaudit report` reads back (it was refused as 'bad timeline'), and the plot shows it below 0."""
    from kvaudit.reports.html_report import occupancy_svg

    with open(os.path.join(REGRESSIONS, "session-abort-borrows-slot.json")) as fh:
        doc = json.load(fh)
    doc["program"] = [{"op": "open_session"},  # what `kvaudit fuzz --seed 1` found and wrote
                      {"op": "submit", "family": 0, "prompt_len": 10, "max_new_tokens": 11, "session": 3},
                      {"op": "idle"},
                      {"op": "submit", "family": 0, "prompt_len": 40, "max_new_tokens": 1, "session": 1},
                      {"op": "step", "n": 1}]
    config, program, findings, _ = replay.parse_doc(doc, "test")
    t = timeline.record(config, program)
    assert min(min(p["series"]["session_held"]) for p in t["pools"].values()) < 0
    assert timeline.is_valid(t)
    assert "<svg" in occupancy_svg(t, findings[0])
    bad = {**t, "steps": [-1] + t["steps"][1:]}
    assert not timeline.is_valid(bad)  # steps stay non-negative
    path = tmp_path / "f.json"
    replay.write_atomic(str(path), replay.to_doc(config, program, findings, timeline=t))
    r = invoke("report", str(path), "--html", str(tmp_path / "f.html"))
    assert r.exit_code == 0, r.output
    assert "<svg" in (tmp_path / "f.html").read_text()


def test_triage_records_the_timeline_of_the_confirmed_program():
    """The confirming replay records the plot's data, so that writing the report runs no engine."""
    from kvaudit.search.fuzz import triage

    config, program, findings, _ = replay.load(os.path.join(REGRESSIONS, "hisparse-prebuilt-skip-finish.json"))
    crash = triage(config, program, findings[0])
    assert crash is not None and crash.runs == crash.confirmations == 3
    assert timeline.is_valid(crash.timeline)
    assert crash.timeline == timeline.record(config, crash.program)  # the program as written, deterministic
    assert crash.timeline["detected"]["kind"] == crash.finding.kind == "leak"


# -- HTML ------------------------------------------------------------------------------------------

def test_html_is_self_contained_and_has_the_plot_and_sections():
    config, program, findings, doc = replay.load(os.path.join(DATA, "hisparse-prebuilt-skip-finish.json"))
    page = render_html(config, [Case(program, findings, doc["timeline"])])
    assert "http://" not in page and "https://" not in page
    assert not re.search(r"""(src|href)\s*=\s*["'](?!#)""", page)  # no external file either
    assert page.count("<svg") == len(findings)  # one plot per finding
    assert "hisparse_device: 256 tokens, 1 leaked at peak" in page
    assert "leak detected (op #1, step 1)" in page
    for f in findings:
        assert f.signature in page
    assert "health_check()" in page and "engine check_memory()" in page


def test_html_without_findings_says_so():
    config, _, _, _ = replay.load(os.path.join(DATA, "hisparse-prebuilt-skip-finish.json"))
    page = render_html(config, [Case([], [])])
    assert "No findings." in page and "<svg" not in page


def test_html_header_names_the_finding_s_preset_and_a_job_s_presets(tmp_path):
    """ci's HTML header named its first preset and that preset's bugs ('preset default · bugs: none') over
    a finding of another preset, and a clean ci over 13 presets was titled 'kvaudit report: default, clean'."""
    from kvaudit.targets.eut.presets import get_preset

    config, program, findings, _ = replay.load(os.path.join(REGRESSIONS, "session-close-while-running.json"))
    page = render_html(get_preset("default").config(), [Case(program, findings, config=config)])
    assert "<title>kvaudit report: streaming-session, 2 finding(s)</title>" in page
    assert "preset <b>streaming-session</b> &middot; bugs: session-close-while-running &middot;" in page
    r = invoke("ci", "--presets", "default,chunked", "--max-time", "1", "--regressions", str(tmp_path),
               "--html", str(tmp_path / "ci.html"), "--out", str(tmp_path / "out"))
    assert r.exit_code == 0, r.output + r.stderr
    page = (tmp_path / "ci.html").read_text()
    assert "<title>kvaudit report: default, chunked, clean</title>" in page
    assert "presets <b>default, chunked</b> &middot; bugs: none &middot;" in page


def test_ci_html_of_a_job_failed_by_its_regressions_alone_says_failed(tmp_path):
    """A job whose only failure was a regression file (exit 1, 'FAILED: 0/1 regressions ok') wrote an HTML page
    titled 'kvaudit report: default, clean' that said 'No findings.': it covered the new findings only."""
    reg = tmp_path / "reg"
    reg.mkdir()
    (reg / "broken.json").write_text("{}")
    r = invoke("ci", "--max-time", "0", "--regressions", str(reg), "--html", str(tmp_path / "ci.html"),
               "--json", str(tmp_path / "ci.json"), "--out", str(tmp_path / "out"))
    assert r.exit_code == 1 and r.stdout.splitlines()[-1].startswith("FAILED: 0/1 regressions ok"), r.output
    page = (tmp_path / "ci.html").read_text()
    assert "<title>kvaudit report: default, FAILED</title>" in page
    assert re.search(r'<p class="verdict bad">FAILED: 1 of 1 regression file\(s\): broken \(malformed: ', page)
    assert "No findings." not in page and "verdict good" not in page
    assert page.count("broken (malformed: ") == 1, page  # (the verdict says it; the header line did too)
    assert json.load(open(tmp_path / "ci.json"))["regressions_failed"].startswith("1 of 1 regression file(s): broken")



def test_report_of_a_ci_json_failed_by_its_regressions_says_failed_on_the_console(tmp_path):
    """docs/guides/reports.md: `kvaudit report` of a run's --json closes as that run did. A job that ended
    'FAILED: 0/1 regressions ok' rendered, from its --json, an HTML page titled FAILED but a console that closed
    'SUMMARY: kvaudit: no findings.' with nothing after it, and a JUnit of one passing case; now the file's
    failure is the console's last line and a failing case. A value that is not a string is a bad file, exit 2."""
    reg = tmp_path / "reg"
    reg.mkdir()
    (reg / "broken.json").write_text("{}")
    r = invoke("ci", "--max-time", "0", "--regressions", str(reg), "--json", str(tmp_path / "ci.json"),
               "--out", str(tmp_path / "out"))
    assert r.exit_code == 1, r.output
    r = invoke("report", str(tmp_path / "ci.json"), "--junit", str(tmp_path / "r.xml"))
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines[-2] == "SUMMARY: kvaudit: no findings.", lines
    assert lines[-1].startswith("FAILED: 1 of 1 regression file(s): broken (malformed: "), lines
    # and its JUnit: a failing case, not the passing "no findings" one (a dashboard showed the job green)
    junit = (tmp_path / "r.xml").read_text()
    assert '<testsuites name="kvaudit" tests="1" failures="1" errors="0"' in junit, junit
    assert re.search(r'<testcase classname="kvaudit.regressions" name="regression files" time="0">\s*<failure '
                     r'message="FAILED: 1 of 1 regression file\(s\): broken \(malformed: ', junit), junit
    doc = json.load(open(tmp_path / "ci.json"))
    doc["regressions_failed"] = ["broken"]
    (tmp_path / "bad.json").write_text(json.dumps(doc))
    r = invoke("report", str(tmp_path / "bad.json"))
    assert r.exit_code == 2 and 'bad "regressions_failed": want a string' in r.stderr, r.output



def test_html_counts_findings_as_the_summary_line_does():
    """A job whose two presets found one signature (kvaudit ci: each preset's reproducer kept) printed
    'SUMMARY: kvaudit: 2 finding(s) (2 leak) in 1 signature(s)' and its --json held both, but the HTML was titled
    '..., 1 finding(s)' and said '1 finding(s). First: ...': it counted its sections, one per signature."""
    config, program, findings, _ = replay.load(os.path.join(REGRESSIONS, "retract-unaligned-page.json"))
    other = dataclasses.replace(config, preset="retract-2")
    cases = [Case(program, findings, config=config), Case(program, findings, config=other)]
    page = render_html(config, cases)
    line = summary_line([f for c in cases for f in c.findings], runs=[c.findings for c in cases])
    assert line.startswith("SUMMARY: kvaudit: 2 finding(s) (2 leak) in 1 signature(s);"), line
    assert "<title>kvaudit report: retract, retract-2, 2 finding(s) in 1 signature(s)</title>" in page
    assert re.search(r'<p class="verdict bad">2 finding\(s\) in 1 signature\(s\)\. First: Direct leak', page)
    assert page.count('<section id="finding-') == 1 and "reported 2 times (deduplicated)" in page
    one = render_html(config, cases[:1])  # one report of each signature: as before
    assert "<title>kvaudit report: retract, 1 finding(s)</title>" in one
    assert '<p class="verdict bad">1 finding(s). First: ' in one

# -- kvaudit report / replay / fuzz output flags ----------------------------------------------------

def test_report_writes_every_format_and_its_json_reads_back(tmp_path):
    src = os.path.join(REGRESSIONS, "session-close-while-running.json")
    out = {fmt: str(tmp_path / f"r.{fmt}") for fmt in ("html", "sarif", "junit", "json")}
    result = invoke("report", src, *[a for fmt, p in out.items() for a in (f"--{fmt}", p)])
    assert result.exit_code == 0, result.output
    assert "Use-after-free of" in result.stdout
    assert "replaying" not in result.stderr  # the corpus file has no timeline: its report gets no plot
    for p in out.values():
        assert os.path.getsize(p) > 0
    sarif = json.load(open(out["sarif"]))
    recorded = replay.load(src)[2]
    assert [r["ruleId"] for r in sarif["runs"][0]["results"]] == [f.kind for f in recorded]
    assert recorded[0].kind == "use-after-free"
    assert "<testcase" in open(out["junit"]).read()
    config, program, findings, doc = replay.load(out["json"])
    assert [f.signature for f in findings] == [f.signature for f in recorded] and "timeline" not in doc
    assert findings[0].signature.startswith("use-after-free/")
    # a report of the report: the same findings again
    again = invoke("report", out["json"], "--json", str(tmp_path / "again.json"))
    assert again.exit_code == 0, again.output
    assert [f.to_dict() for f in replay.load(str(tmp_path / "again.json"))[2]] == [f.to_dict() for f in findings]



@pytest.fixture
def no_engine(monkeypatch):
    """Any engine run (a :class:`kvaudit.audit.runner.AuditedRun`) fails the test."""
    from kvaudit.audit.runner import AuditedRun

    def ran(*a, **k):
        raise AssertionError("an engine ran while writing a report")

    monkeypatch.setattr(AuditedRun, "__init__", ran)


def test_writing_a_report_never_runs_an_engine(tmp_path, no_engine):
    with_timeline = os.path.join(DATA, "hisparse-prebuilt-skip-finish.json")
    assert replay.load(with_timeline)[3]["timeline"]
    r = invoke("report", with_timeline, "--html", str(tmp_path / "a.html"), "--json", str(tmp_path / "a.json"))
    assert r.exit_code == 0, r.output
    assert "<svg" in open(tmp_path / "a.html").read()  # the plot, from the file's timeline
    assert replay.load(str(tmp_path / "a.json"))[3]["timeline"] == replay.load(with_timeline)[3]["timeline"]
    old = os.path.join(REGRESSIONS, "session-close-while-running.json")  # recorded before timelines were kept
    assert "timeline" not in replay.load(old)[3]
    r = invoke("report", old, "--html", str(tmp_path / "b.html"), "--json", str(tmp_path / "b.json"))
    assert r.exit_code == 0, r.output
    page = open(tmp_path / "b.html").read()
    assert "<svg" not in page and "No occupancy timeline was recorded" in page
    assert "timeline" not in json.load(open(tmp_path / "b.json"))

def test_replay_takes_the_report_flags(tmp_path):
    src = os.path.join(REGRESSIONS, "overlap-abort-double-free.json")
    result = invoke("replay", src, "--sarif", str(tmp_path / "r.sarif"), "--junit", str(tmp_path / "r.xml"))
    assert result.exit_code == 1
    results = json.load(open(tmp_path / "r.sarif"))["runs"][0]["results"]
    assert results and all(r["ruleId"] == "use-after-free" for r in results)


@pytest.mark.slow
def test_fuzz_writes_reports_for_a_finding_and_for_a_clean_run(tmp_path):
    bug = ["fuzz", "--preset", "pd-decode-hisparse", "--bug", "hisparse-prebuilt-skip-finish", "--seed", "1",
           "--max-time", "60", "--out", str(tmp_path / "o")]
    result = invoke(*bug, "--html", str(tmp_path / "f.html"), "--json", str(tmp_path / "f.json"))
    assert result.exit_code == 1, result.output
    page = open(tmp_path / "f.html").read()
    assert "<svg" in page and "leak/hisparse_device/" in page
    (replay_file,) = [p for p in os.listdir(tmp_path / "o") if p.endswith(".json")]
    assert "timeline" in json.load(open(tmp_path / "o" / replay_file))  # the replay file keeps the plot data
    # which search ran (the default depends on the kind of run: tester 59): the JSON as the replay file says it
    assert json.load(open(tmp_path / "f.json"))["fuzzer"] == "random-96" == json.load(open(tmp_path / "o" / replay_file))["fuzzer"]
    assert "random-96" in page
    clean = invoke("fuzz", "--preset", "default", "--max-time", "2", "--out", str(tmp_path / "o2"), "--seed", "7",
                   "--junit", str(tmp_path / "c.xml"), "--sarif", str(tmp_path / "c.sarif"))
    assert clean.exit_code == 0, clean.output
    junit = open(tmp_path / "c.xml").read()
    assert 'failures="0"' in junit
    assert '<property name="search_fuzzer" value="random-96" />' in junit
    assert '<property name="search_seed" value="7" />' in junit
    run = json.load(open(tmp_path / "c.sarif"))["runs"][0]
    assert run["results"] == [] and run["properties"]["search"] == {"fuzzer": "random-96", "seed": 7}


def test_report_flags_are_checked_before_anything_runs(tmp_path):
    src = os.path.join(REGRESSIONS, "overlap-abort-double-free.json")
    r = invoke("report", src, "--html", str(tmp_path))
    assert r.exit_code == 2 and "is a directory" in one_error_line(r)
    r = invoke("fuzz", "--max-time", "30", "--html", str(tmp_path / "x"), "--json", str(tmp_path / "x"))
    assert r.exit_code == 2 and "both name" in one_error_line(r)
    blocker = tmp_path / "file"
    blocker.write_text("")
    r = invoke("report", src, "--sarif", str(blocker / "sub" / "r.sarif"))
    assert r.exit_code == 2 and "cannot write" in one_error_line(r)


def test_a_missing_directory_of_a_report_path_is_created_where_the_path_names_it(tmp_path, monkeypatch):
    """``--junit /nonexistent-dir/x.xml`` created /nonexistent-dir (the directory named: at the root
    because the path is), but ``link/../missing/x.xml`` created ``missing`` beside the link (abspath
    folded ``link/..`` lexically) and then failed to write where the system resolved the file."""
    src = os.path.join(REGRESSIONS, "overlap-abort-double-free.json")
    far = tmp_path / "far" / "deep"
    far.mkdir(parents=True)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    (cwd / "link").symlink_to(far)
    monkeypatch.chdir(cwd)
    paths = {"html": "rel/a/r.html", "sarif": "link/../m1/r.sarif", "junit": str(tmp_path / "abs" / "r.xml"),
             "json": "link/../m2/sub/r.json"}
    r = invoke("report", src, *[a for fmt, p in paths.items() for a in (f"--{fmt}", p)])
    assert r.exit_code == 0, r.output + r.stderr
    for p in paths.values():
        assert os.path.isfile(p), p
    assert (cwd / "rel" / "a" / "r.html").is_file() and (tmp_path / "abs" / "r.xml").is_file()
    assert (tmp_path / "far" / "m1" / "r.sarif").is_file() and (tmp_path / "far" / "m2" / "sub" / "r.json").is_file()
    assert sorted(os.listdir(cwd)) == ["link", "rel"]  # nothing created anywhere else
    r = invoke("minimize", src, "-o", "link/../m3/min.json", "--signature", "nope")  # checked before it runs
    assert r.exit_code == 2 and not os.path.exists(tmp_path / "far" / "m3") and sorted(os.listdir(cwd)) == ["link", "rel"]


@pytest.mark.parametrize("doc_change, message", [
    (lambda d: d.update(timeline={"steps": [0, 1], "ops": [0], "pools": {}}), "bad timeline"),
    (lambda d: d.update(suppressed=["leak"]), 'bad "suppressed"'),
    (lambda d: d.update(format="other"), "not a kvaudit replay file"),
    # the run facts the report files are made of (a --json's): these ended as 'kvaudit: internal error' (exit 70)
    (lambda d: d.update(reached="aborts=3"), 'bad "reached"'),
    (lambda d: d.update(reached={"aborts": 3, "default": {"aborts": 1}}), 'bad "reached"'),
    (lambda d: d.update(reached={"default": {"aborts": "3"}}), 'bad "reached"'),
    (lambda d: d.update(nothing_searched=5), 'bad "nothing_searched"'),
    (lambda d: d.update(seconds="4.0"), 'bad "seconds"'),
])
def test_report_of_a_malformed_file_is_one_line(tmp_path, doc_change, message):
    doc = json.load(open(os.path.join(DATA, "hisparse-prebuilt-skip-finish.json")))
    doc_change(doc)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    outs = {f"--{fmt}": str(tmp_path / f"r.{fmt}") for fmt in ("html", "sarif", "junit", "json")}
    r = invoke("report", str(bad), *[a for kv in outs.items() for a in kv])
    assert r.exit_code == 2 and message in one_error_line(r)
    assert not any(os.path.exists(p) for p in outs.values())


# -- progress off a terminal -------------------------------------------------------------------------

@pytest.mark.slow
def test_fuzz_piped_to_a_file_prints_plain_progress_lines(tmp_path):
    log = tmp_path / "fuzz.log"
    with open(log, "w") as fh:
        # --max-time is search time (start-up is not counted): 11 s gives lines after the first program, 5 s
        # later, 5 s after that and at the end
        proc = subprocess.run([kvaudit_script(), "fuzz", "--preset", "default", "--max-time", "11", "--seed", "3",
                               "--out", str(tmp_path / "o")], stdout=fh, stderr=subprocess.STDOUT,
                              env=plain_env(), timeout=120)
    assert proc.returncode == 0
    text = log.read_text()
    assert "\x1b" not in text and "\r" not in text
    lines = re.findall(r"^\[\s*[\d.]+s\] (\w+): executions=(\d+) exec/s=[\d.]+ ops=\d+ findings=0 suppressed=0 "
                       r"sites=\d+(?: coverage=\S+)? remaining=[\d.]+s$", text, flags=re.M)
    assert len(lines) >= 3, text  # from the first program run, every 5 s, at the end
    assert lines[0][0] == "fuzzing" and int(lines[0][1]) > 0 and lines[-1][0] == "done" and int(lines[-1][1]) > 0


# -- hardening (from a breaker pass) ------------------------------------------------------------------

def test_report_paths_never_overwrite_the_input_a_device_or_each_other(tmp_path):
    src = tmp_path / "in.json"
    src.write_text(open(os.path.join(DATA, "hisparse-prebuilt-skip-finish.json")).read())
    r = invoke("report", str(src), "--html", str(src))
    assert r.exit_code == 2 and "is the input file" in one_error_line(r)
    r = invoke("replay", str(src), "--json", str(tmp_path / "." / "in.json"))
    assert r.exit_code == 2 and "is the input file" in one_error_line(r)
    r = invoke("report", str(src), "--html", str(tmp_path / "a.html"), "--sarif", str(tmp_path / "x" / ".." / "a.html"))
    assert r.exit_code == 2 and "both name" in one_error_line(r)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    r = invoke("report", str(src), "--junit", str(fifo))
    assert r.exit_code == 2 and "not a regular file" in one_error_line(r)
    r = invoke("report", str(src), "--html", "")
    assert r.exit_code == 2 and one_error_line(r).endswith('--html: want a file name, not ""')
    assert json.load(open(src))["format"] == replay.FORMAT  # untouched


@pytest.mark.parametrize("args", [
    ("report", "{src}", "--html", "{out}"), ("replay", "{src}", "--sarif", "{out}"),
    ("minimize", "{src}", "-o", "{out}"), ("export", "{src}", "--issue", "{out}"), ("fuzz", "--json", "{out}", "--max-time", "1"),
    ("bench", "--out", "{out}", "--trials", "1")])
@pytest.mark.parametrize("existing", [True, False])
def test_an_output_path_ending_in_a_slash_is_refused_not_written_as_a_file(tmp_path, args, existing):
    # (tester 61a A2: `--html results/` replaced the user's file `results`, or made a file `newdir`)
    src = tmp_path / "in.json"
    src.write_text(open(os.path.join(DATA, "hisparse-prebuilt-skip-finish.json")).read())
    out = tmp_path / "results"
    if existing:
        out.write_text("MY NOTES")
    r = invoke(*(a.format(src=src, out=f"{out}{os.sep}") for a in args))
    assert r.exit_code == 2 and one_error_line(r).endswith(f"{out}{os.sep}: names a directory (want a file name)"), \
        r.output
    assert (out.read_text() == "MY NOTES") if existing else not os.path.lexists(out)


def test_a_report_path_that_is_a_link_writes_the_file_it_names_and_an_fd_link_is_refused(tmp_path):
    # (tester 56: the rename replaced the link itself: --sarif /dev/stdout, as root, made /dev/stdout a file)
    src = tmp_path / "in.json"
    src.write_text(open(os.path.join(DATA, "hisparse-prebuilt-skip-finish.json")).read())
    (tmp_path / "reports").mkdir()
    (tmp_path / "reports" / "real.sarif").write_text("old")
    os.symlink("reports/real.sarif", tmp_path / "latest.sarif")
    os.symlink("reports/new.sarif", tmp_path / "dangling.sarif")
    r = invoke("report", str(src), "--sarif", str(tmp_path / "latest.sarif"), "--html", str(tmp_path / "dangling.sarif"))
    assert r.exit_code == 0, r.output
    assert os.path.islink(tmp_path / "latest.sarif") and os.path.islink(tmp_path / "dangling.sarif")
    assert json.load(open(tmp_path / "reports" / "real.sarif"))["version"] == "2.1.0"
    assert "<html" in (tmp_path / "reports" / "new.sarif").read_text().lower()
    os.symlink("/proc/self/fd/1", tmp_path / "mystdout")
    for path in (str(tmp_path / "mystdout"), "/dev/stdout"):
        r = invoke("report", str(src), "--sarif", path)
        assert r.exit_code == 2 and "is a file descriptor's link, not a file" in one_error_line(r), r.output
    assert os.path.islink(tmp_path / "mystdout") and os.path.islink("/dev/stdout")


@pytest.mark.slow
def test_ctrl_c_while_minimizing_still_writes_the_reports(tmp_path, monkeypatch):
    from kvaudit.search import fuzz
    from kvaudit.audit.runner import INTERRUPTED

    def interrupted_triage(*a, **k):
        INTERRUPTED.set()  # as the SIGINT handler does
        raise KeyboardInterrupt

    monkeypatch.setattr(fuzz, "triage", interrupted_triage)  # the fuzz command imports it when it runs
    html, js = tmp_path / "r.html", tmp_path / "r.json"
    r = invoke("fuzz", "--preset", "pd-decode-hisparse", "--bug", "hisparse-prebuilt-skip-finish", "--seed", "1",
               "--max-time", "60", "--out", str(tmp_path / "o"), "--html", str(html), "--json", str(js))
    assert r.exit_code == 1, r.output
    assert "interrupted while confirming it" in r.stderr  # (triage's first phase)
    assert "<svg" in html.read_text() and json.load(open(js))["interrupted"] is True


@pytest.mark.parametrize("field, value", [
    ("engine_check", [1, 2]), ("kind", 7), ("message", None), ("op_index", "3"), ("step", 1.5),
    ("slots", "abc"), ("pool", [1]), ("unit", "bytes"), ("indirect", "yes"), ("num_units", -1),
    ("alloc_sites", [{"file": 3, "line": 1, "function": "f"}]), ("alloc_sites", [{"file": "a.py", "line": "1",
                                                                                  "function": "f"}]),
    ("owner_history", [{"op_index": "x", "step": 1, "owner": "a"}]), ("traceback", 5),
])
def test_findings_with_wrong_types_are_input_errors(tmp_path, field, value):
    doc = json.load(open(os.path.join(DATA, "hisparse-prebuilt-skip-finish.json")))
    doc["findings"][0][field] = value
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    for cmd in ("report", "replay"):
        r = invoke(cmd, str(bad), "--sarif", str(tmp_path / "o.sarif"))
        assert r.exit_code == 2 and field in one_error_line(r), (cmd, r.output)


@pytest.mark.parametrize("key, value", [("fuzzer", None), ("fuzzer", ""), ("fuzzer", 3), ("seed", "x"),
                                        ("seed", True), ("seed", 1.5)])
def test_a_replay_files_search_facts_of_wrong_types_are_input_errors(tmp_path, key, value):
    """`"fuzzer": null` reached SARIF and JUnit as 'None' (tester 59b): the file is refused, one line, exit 2."""
    doc = json.load(open(os.path.join(DATA, "hisparse-prebuilt-skip-finish.json")))
    doc[key] = value
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    r = invoke("report", str(bad), "--sarif", str(tmp_path / "o.sarif"))
    assert r.exit_code == 2 and f"bad {key}: want " in one_error_line(r), r.output
    del doc[key]  # absent (a file from before: none has "fuzzer") is fine
    bad.write_text(json.dumps(doc))
    assert invoke("report", str(bad)).exit_code == 0


def test_minimize_and_replay_keep_the_search_that_found_the_program(tmp_path):
    """`kvaudit minimize` wrote a file without the input's fuzzer and seed, and `replay --json/--sarif` named no
    search although the file records one (tester 59b)."""
    doc = json.load(open(os.path.join(REGRESSIONS, "prefill-finish-leaks-row.json")))
    doc.update(fuzzer="random-96", seed=4)
    src = tmp_path / "found.json"
    src.write_text(json.dumps(doc))
    r = invoke("minimize", str(src), "-o", str(tmp_path / "min.json"))
    assert r.exit_code == 0, r.output + r.stderr
    small = json.load(open(tmp_path / "min.json"))
    assert (small["fuzzer"], small["seed"], small["minimized_from"]) == ("random-96", 4, str(src))
    r = invoke("replay", str(src), "--json", str(tmp_path / "r.json"), "--sarif", str(tmp_path / "r.sarif"))
    assert r.exit_code == 1, r.output + r.stderr
    assert {k: json.load(open(tmp_path / "r.json"))[k] for k in ("fuzzer", "seed")} == {"fuzzer": "random-96", "seed": 4}
    assert json.load(open(tmp_path / "r.sarif"))["runs"][0]["properties"]["search"] == {"fuzzer": "random-96", "seed": 4}


def test_lone_surrogates_and_huge_integers_are_input_errors(tmp_path):
    text = open(os.path.join(DATA, "hisparse-prebuilt-skip-finish.json")).read()
    bad = tmp_path / "bad.json"
    bad.write_text(text.replace('"allocated, unreachable', '"\\ud800allocated, unreachable', 1))
    r = invoke("report", str(bad))
    assert r.exit_code == 2 and 'surrogate ("\\ud800allocated, unreachable' in one_error_line(r), r.output  # as JSON
    bad.write_text(text.replace('"step": 1', '"step": 1' + "0" * 5000, 1))
    r = invoke("report", str(bad))
    assert r.exit_code == 2 and "not a kvaudit replay file (a number of more than 4300 digits)" in one_error_line(r)
    assert "set_int_max_str_digits" not in r.output


def test_timelines_are_thinned_to_a_bounded_size(monkeypatch):
    from kvaudit.targets.eut.presets import get_preset
    from kvaudit.program import Idle, Step, Submit

    monkeypatch.setattr(timeline, "MAX_POINTS", 12)
    monkeypatch.setattr(timeline, "MAX_SAMPLED_STEPS", 40)
    t = timeline.record(get_preset("default").config(), [Submit(0, 20, 12), Step(30), Step(30), Idle()])
    assert len(t["steps"]) <= 12 and t["steps"][0] == 0
    assert t["truncated_after_step"] == t["steps"][-1] <= 41
    assert all(len(v) == len(t["steps"]) for p in t["pools"].values() for v in p["series"].values())


def test_a_multi_case_report_keeps_each_case_config(tmp_path):
    a = json.load(open(os.path.join(DATA, "hisparse-prebuilt-skip-finish.json")))
    b = json.load(open(os.path.join(DATA, "session-borrow-double-count.json")))
    b.pop("timeline")  # a case recorded before timelines were kept
    multi = tmp_path / "multi.json"
    multi.write_text(json.dumps({"format": replay.REPORT_FORMAT, "config": a["config"], "cases": [a, b]}))
    out = tmp_path / "out.json"
    r = invoke("report", str(multi), "--json", str(out), "--sarif", str(tmp_path / "o.sarif"))
    assert r.exit_code == 0, r.output
    doc = json.load(open(out))
    assert [c["config"]["preset"] for c in doc["cases"]] == ["pd-decode-hisparse", "streaming-session"]
    assert doc["cases"][0]["timeline"] == a["timeline"]  # each case keeps its own, as recorded
    assert "hisparse_device" in doc["cases"][0]["timeline"]["pools"] and "timeline" not in doc["cases"][1]


def test_duplicate_signatures_are_one_section_and_one_sarif_result(tmp_path):
    config, program, findings, doc = replay.load(os.path.join(DATA, "hisparse-prebuilt-skip-finish.json"))
    twice = tmp_path / "twice.json"
    replay.write_atomic(str(twice), replay.to_doc(config, program, [findings[0], findings[0]],
                                                  timeline=doc.get("timeline")))
    r = invoke("report", str(twice), "--html", str(tmp_path / "t.html"), "--sarif", str(tmp_path / "t.sarif"))
    assert r.exit_code == 0, r.output
    page = open(tmp_path / "t.html").read()
    assert page.count("<svg") == 1 and "reported 2 times (deduplicated)" in page
    assert len(json.load(open(tmp_path / "t.sarif"))["runs"][0]["results"]) == 1


def test_a_tree_insert_past_kv_committed_len_shows_the_insert_stack(monkeypatch):
    """Issue 16 item 8: the report locates the over-insert at the insert, not at an allocation."""
    from engine_under_test import Scheduler
    from kvaudit.targets.eut.presets import get_preset
    from kvaudit.program import Idle, Submit
    from kvaudit.audit.runner import execute
    checkpoint = Scheduler.checkpoint_kv_cache_into_tree
    monkeypatch.setattr(Scheduler, "checkpoint_kv_cache_into_tree",
                        lambda self, req, up_to: checkpoint(self, req, up_to + 1))
    config, program = get_preset("default").config(), [Submit(0, 12, 3), Idle()]
    f = execute(config, program).findings[0]
    text = render(config, program, [f], width=160)
    assert "kv_committed_len=12" in text and "allocated at:" not in text
    assert "cached into the tree at:" in text and "checkpoint_kv_cache_into_tree" in text
    assert "tree.insert(req.fill_ids[:up_to]" in text


def test_a_replay_file_names_the_engine_release_it_was_recorded_on(tmp_path, monkeypatch):
    """An engine's frames are recorded package-relative (``sglang/srt/...``): the file says which release
    they are of (``engine_version``, from the target kind), e.g. a history overlay's 0.5.10.post1. A file of
    the built-in engine, whose frames are the checkout's, names none."""
    from kvaudit.targets import registry
    from kvaudit.targets.sglang import boot

    monkeypatch.setattr(boot, "installed_version", lambda: "0.5.10.post1")  # an overlay in front of sys.path
    sglang = registry.get("sglang").preset("sglang").config()
    assert replay.to_doc(sglang, [], [])["engine_version"] == "0.5.10.post1"
    assert replay.to_doc(sglang, [], [], engine_version=None).get("engine_version", "absent") == "absent"
    assert "engine_version" not in replay.to_doc(registry.get("eut").preset("default").config(), [], [])


@pytest.mark.parametrize("version, warned", [(None, False), ("0.5.23", False), ("0.5.10.post1", True)])
def test_a_file_of_another_release_says_so_before_its_report(tmp_path, monkeypatch, version, warned):
    """``kvaudit report`` (and replay, minimize, through load_replay) of a file recorded on another release
    than the installed one warns on stderr whose lines its frames are and how to run it there (the tester:
    nothing but SARIF said so; a replay on the installed release said only "reproduced: no")."""
    from kvaudit.targets.sglang import boot

    monkeypatch.setattr(boot, "installed_version", lambda: "0.5.23")
    monkeypatch.delenv("KVAUDIT_RELEASE_CACHE", raising=False)  # (the hint names the cache in use)
    doc = json.load(open(os.path.join(os.path.dirname(__file__), "..", "corpora", "sglang",
                                      "leak-a3-hisparse-buffer-padded-at-finish.json")))
    if version is not None:
        doc["engine_version"] = version
    src = tmp_path / "in.json"
    src.write_text(json.dumps(doc))
    r = invoke("report", str(src))
    assert r.exit_code == 0, r.output
    line = (f"warning: {src} was recorded on sglang 0.5.10.post1, not the installed 0.5.23: its engine frames' "
            "lines are 0.5.10.post1's, and a run here can differ (on 0.5.10.post1: python -m "
            "kvaudit.history.releases sglang==0.5.10.post1, then PYTHONPATH=~/.cache/kvaudit/releases/"
            "sglang-0.5.10.post1)")
    assert (line in r.stderr.splitlines()) is warned, r.stderr
    assert "was recorded on" not in r.stdout


def test_the_other_release_hint_names_the_release_cache_in_use(tmp_path, monkeypatch):
    """With ``$KVAUDIT_RELEASE_CACHE`` set, ``python -m kvaudit.history.releases`` installs there: the hint's
    ``PYTHONPATH`` named ``~/.cache/kvaudit/releases`` all the same, where no overlay is."""
    from kvaudit.targets.sglang import boot

    monkeypatch.setattr(boot, "installed_version", lambda: "0.5.23")
    monkeypatch.setenv("KVAUDIT_RELEASE_CACHE", str(tmp_path / "cache"))
    doc = json.load(open(os.path.join(os.path.dirname(__file__), "..", "corpora", "sglang",
                                      "leak-a3-hisparse-buffer-padded-at-finish.json")))
    doc["engine_version"] = "0.5.10.post1"
    src = tmp_path / "in.json"
    src.write_text(json.dumps(doc))
    r = invoke("report", str(src))
    assert r.exit_code == 0, r.output
    assert f"then PYTHONPATH={tmp_path / 'cache' / 'sglang-0.5.10.post1'})" in r.stderr, r.stderr


def test_a_report_keeps_the_recorded_release_and_never_stamps_the_installed_one(tmp_path, monkeypatch):
    from kvaudit.targets.sglang import boot

    monkeypatch.setattr(boot, "installed_version", lambda: "0.5.23")
    doc = json.load(open(os.path.join(os.path.dirname(__file__), "..", "corpora", "sglang",
                                      "leak-a3-hisparse-buffer-padded-at-finish.json")))
    assert "engine_version" not in doc  # recorded before files named it: its release is unknown
    for version in (None, "0.5.10.post1"):
        if version is not None:
            doc["engine_version"] = version
        src, out = tmp_path / "in.json", tmp_path / "out.json"
        src.write_text(json.dumps(doc))
        r = invoke("report", str(src), "--json", str(out))
        assert r.exit_code == 0, r.output
        assert json.loads(out.read_text()).get("engine_version") == version


@pytest.mark.parametrize("value", [5, "", ["0.5.23"], False])
def test_a_bad_engine_version_is_a_one_line_input_error(tmp_path, value):
    doc = json.load(open(os.path.join(DATA, "hisparse-prebuilt-skip-finish.json")))
    doc["engine_version"] = value
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    r = invoke("report", str(bad))
    assert r.exit_code == 2
    assert f"bad engine_version: want the engine's release as a string, got {json.dumps(value)}" in one_error_line(r)


def test_a_finding_of_an_unknown_kind_is_a_one_line_input_error(tmp_path):
    """``kvaudit report`` rendered a finding of kind "bogus" (no run yields one; a suppression file refuses
    the name too)."""
    doc = json.load(open(os.path.join(DATA, "hisparse-prebuilt-skip-finish.json")))
    doc["findings"][0]["kind"] = "bogus"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    for cmd in ("report", "replay", "minimize"):
        r = invoke(cmd, str(bad))
        assert r.exit_code == 2, (cmd, r.output)
        assert 'bad findings: unknown kind "bogus" (valid: leak, use-after-free, ' in one_error_line(r)


def test_a_long_unknown_kind_is_cut_inside_its_quotes(tmp_path):
    """A kind of 500 x's was cut to 60 characters with its closing quote (``unknown kind "xxx…x (valid:``)."""
    doc = json.load(open(os.path.join(DATA, "hisparse-prebuilt-skip-finish.json")))
    doc["findings"][0]["kind"] = "x" * 500
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    r = invoke("report", str(bad))
    assert r.exit_code == 2, r.output
    assert 'bad findings: unknown kind "' + "x" * 55 + '..." (valid: leak, ' in one_error_line(r)


@pytest.mark.parametrize("version, other", [("0.5.10.post1", True), ("0.5.23", False)])
def test_every_report_names_the_release_of_another_releases_frames(tmp_path, monkeypatch, version, other):
    """Only SARIF knew a file's engine frames were another release's: the console report, JUnit and HTML
    checked them against the installed package ("moved: recorded as line 1034; the file changed since", at
    the installed file's line). Now each shows the recorded file:line with its release named; a file of the
    installed release is still checked against it."""
    import importlib.util

    from kvaudit.targets.sglang import boot

    if not other and importlib.util.find_spec("sglang") is None:
        pytest.skip("checking a frame against the installed file needs SGLang installed")
    monkeypatch.setattr(boot, "installed_version", lambda: "0.5.23")
    doc = json.load(open(os.path.join(os.path.dirname(__file__), "..", "corpora", "sglang",
                                      "leak-a3-hisparse-buffer-padded-at-finish.json")))
    site = doc["findings"][0]["alloc_sites"][0]
    assert site["file"].startswith("sglang/")
    site["line"] += 3  # that release's line: the text three lines lower than the installed file's
    doc["engine_version"] = version
    src, junit, html = tmp_path / "in.json", tmp_path / "out.xml", tmp_path / "out.html"
    src.write_text(json.dumps(doc))
    r = invoke("report", str(src), "--junit", str(junit), "--html", str(html))
    assert r.exit_code == 0, r.output
    at = f"{site['file']}:{site['line']}"
    note = f"(sglang {version}'s line, as recorded: not checked against the installed sglang 0.5.23)"
    moved = f"moved: recorded as line {site['line']}"
    texts = {"console": r.stdout, "junit": junit.read_text(), "html": html.read_text().replace("&#x27;", "'")}
    for name, text in texts.items():
        assert (note in text) is other, name
        assert (moved in text) is not other, name
    assert at in r.stdout and at in texts["junit"] if other else at not in r.stdout


@pytest.mark.parametrize("program_ends_idle", [True, False])
def test_a_timeline_of_a_target_whose_is_idle_raises_ends_at_its_crash(program_ends_idle, monkeypatch, fresh_registry):
    """The search recorded is_idle() raising as the engine's crash, then the triage's timeline called it
    again, unguarded, in its aftermath: `kvaudit: internal error: TypeError`, exit 70, no replay file
    written (fuzz and ci alike; tester t54, defect 2)."""
    import rowtoy_plugin  # (registers the kind "rowtoy" when first imported)

    from kvaudit.program import Idle, Step, Submit
    from kvaudit.reports import timeline

    registry = fresh_registry
    if "rowtoy" not in registry.kinds():  # (test_suppress imported it first, into a registry it restored)
        registry.register(rowtoy_plugin.KIND)

    def boom(self):
        raise TypeError("idle boom")

    monkeypatch.setattr(rowtoy_plugin.RowToyTarget, "is_idle", boom)
    config = registry.get("rowtoy").preset("rowtoy").config()
    program = [Submit(prompt_len=4, max_new_tokens=2), Step(1)] + ([Idle()] if program_ends_idle else [])
    found = []
    t = timeline.record(config, program, findings=found)
    assert timeline.is_valid(t), t
    if program_ends_idle:
        assert [f.kind for f in found] == ["crash"], found


@pytest.mark.parametrize("terminal", [False, True], ids=["log", "terminal"])
def test_control_characters_a_replay_file_holds_are_shown_escaped_not_sent_to_the_terminal(tmp_path, terminal):
    """tg63: a reproducer from a colleague whose message or frame holds ``\\u001b[2J`` (clear the screen) or a
    NUL: ``kvaudit report`` printed them raw, so the file drove the reader's terminal. They are shown as
    ``\\x1b``; the file's own data (its --json) keeps them as written, and rich's styles still reach a terminal."""
    doc = json.load(open(os.path.join(REGRESSIONS, "aborted-kv-inserted.json")))
    doc["findings"][0]["message"] = "req:x \x1b[2J cleared \x00 nul \x9b csi [bold]kept[/]"
    doc["findings"][0]["alloc_sites"][0]["source"] = "x = 1  \x1b]0;title"
    src = tmp_path / "odd.json"
    src.write_text(json.dumps(doc))
    env = {"FORCE_COLOR": "1", "COLUMNS": "300"} if terminal else {"NO_COLOR": "1", "FORCE_COLOR": None}
    r = invoke("report", str(src), "--json", str(tmp_path / "out.json"), env=env)
    assert r.exit_code == 0, r.output
    assert ("\x1b[" in r.stdout) == terminal  # (rich's own styles)
    shown = re.sub(r"\x1b\[[0-9;]*m", "", r.stdout)  # (less rich's styles: a terminal splits the source line)
    assert "req:x \\x1b[2J cleared \\x00 nul \\x9b csi [bold]kept[/]" in shown
    assert "x = 1  \\x1b]0;title" in shown
    assert "\x1b" not in shown and "\x00" not in shown and "\x9b" not in shown
    assert json.load(open(tmp_path / "out.json"))["findings"][0]["message"] == doc["findings"][0]["message"]


def test_report_of_an_interrupted_runs_json_says_interrupted_as_the_run_did(tmp_path):
    # `fuzz --json` of a run stopped by Ctrl-C with nothing found closes "no findings (interrupted).", and one whose
    # budget ended before its first program "nothing searched"; `kvaudit report` of either printed "no findings."
    # while the HTML, SARIF and JUnit it wrote said interrupted or nothing searched
    with open(os.path.join(REGRESSIONS, "session-close-while-running.json")) as f:
        doc = json.load(f)
    doc.update(program=[], findings=[], executions=105, interrupted=True)
    path = tmp_path / "int.json"
    path.write_text(json.dumps(doc))
    r = invoke("report", str(path))
    assert r.exit_code == 0, r.output
    assert r.stdout.splitlines()[-1] == "SUMMARY: kvaudit: no findings (interrupted).", r.stdout
    doc["interrupted"] = False  # a run that ended on its budget: clean
    path.write_text(json.dumps(doc))
    r = invoke("report", str(path))
    assert r.exit_code == 0 and r.stdout.splitlines()[-1] == "SUMMARY: kvaudit: no findings.", r.output
    doc.update(executions=0, interrupted=False)  # a budget that ended before the first program (fuzz's exit 5)
    path.write_text(json.dumps(doc))
    r = invoke("report", str(path), "--html", str(tmp_path / "r.html"))
    assert r.exit_code == 0, r.output
    assert r.stdout.splitlines()[-1] == ("SUMMARY: kvaudit: nothing searched (the budget ended before the first "
                                         "program ran)."), r.stdout
    assert "nothing searched" in (tmp_path / "r.html").read_text()  # (as the page it wrote says)
