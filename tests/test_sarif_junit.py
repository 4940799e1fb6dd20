"""SARIF and JUnit output: schema-valid, one rule per kind, one test case per signature."""

import copy
import dataclasses
import glob
import json
import os
import re
import xml.etree.ElementTree as ET

import jsonschema
import pytest

from engine_under_test import EngineConfig
from kvaudit import replay
from kvaudit.audit.findings import KINDS, Finding, Site, source_path
from kvaudit.reports.junit import to_junit
from kvaudit.audit.frames import recorded_release
from kvaudit.reports.sarif import FINGERPRINT_KEY, SRCROOT, engine_base_id, engine_path, finding_stacks, primary_stack, to_sarif
from kvaudit.targets import registry
from kvaudit.targets.sglang.boot import installed_version
from cli_helpers import invoke

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCHEMA_PATH = os.path.join(ROOT, "tests", "data", "sarif-schema-2.1.0.json")
REGRESSIONS = sorted(glob.glob(os.path.join(ROOT, "corpora", "regressions", "*.json")))
# recorded report cases (tests/data/report): a double free is there, the zoo now names none
RECORDED = REGRESSIONS + sorted(glob.glob(os.path.join(ROOT, "tests", "data", "report", "*.json")))
MEMORY_SAFETY = ("leak", "use-after-free", "double-free", "aliasing", "stale-kv")


@pytest.fixture(scope="module")
def validator():
    with open(SCHEMA_PATH) as fh:
        schema = json.load(fh)
    cls = jsonschema.validators.validator_for(schema)  # the schema says draft-04
    cls.check_schema(schema)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def _errors(validator, log: dict) -> list[str]:
    # through JSON, as an uploaded file would be: tuples, non-str keys and NaN would not survive
    doc = json.loads(json.dumps(log, allow_nan=False))
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]


def _load(path: str):
    config, _, findings, _ = replay.load(path)
    return config, findings


def _by_kind(kind: str) -> tuple[EngineConfig, Finding]:
    for path in RECORDED:
        config, findings = _load(path)
        for f in findings:
            if f.kind == kind:
                return config, f
    pytest.fail(f"no {kind} finding in corpora/regressions or tests/data/report")


def _physical(loc: dict) -> tuple[str, int]:
    phys = loc["physicalLocation"]
    return phys["artifactLocation"]["uri"], phys["region"]["startLine"]


def _uris(obj) -> list[dict]:
    """Every artifactLocation object anywhere in ``obj``."""
    if isinstance(obj, dict):
        found = [obj["artifactLocation"]] if "artifactLocation" in obj else []
        return found + [a for v in obj.values() for a in _uris(v)]
    if isinstance(obj, list):
        return [a for v in obj for a in _uris(v)]
    return []


def test_corpus_is_there():
    assert len(REGRESSIONS) >= 10
    kinds = {f.kind for p in RECORDED for f in _load(p)[1]}
    assert {"leak", "double-free", "stale-kv", "accounting-drift", "use-after-free"} <= kinds


# ----------------------------------------------------------------------------- SARIF

@pytest.mark.parametrize("path", REGRESSIONS, ids=lambda p: os.path.basename(p)[:-5])
def test_sarif_for_each_regression_is_schema_valid_and_code_scanning_ready(validator, path):
    config, findings = _load(path)
    assert findings, f"{path} records no findings"
    log = to_sarif(findings, config)
    assert _errors(validator, log) == []

    assert log["version"] == "2.1.0" and log["$schema"] == "https://json.schemastore.org/sarif-2.1.0.json"
    (run,) = log["runs"]
    assert run["tool"]["driver"]["name"] == "kvaudit"
    assert run["properties"]["preset"] == config.preset
    assert run["properties"]["bugs"] == sorted(config.bugs)
    rules = run["tool"]["driver"]["rules"]
    assert len(run["results"]) == len(findings)
    for f, r in zip(findings, run["results"]):
        assert r["ruleId"] == f.kind and rules[r["ruleIndex"]]["id"] == f.kind
        assert r["partialFingerprints"] == {FINGERPRINT_KEY: f.signature}
        assert r["message"]["text"].split("\n")[0].replace("\\[", "[").replace("\\]", "]") == f.summary()
        assert r["level"] == rules[r["ruleIndex"]]["defaultConfiguration"]["level"]
        # code scanning needs a location with a file and a 1-based line in the repository
        assert len(r["locations"]) == 1
        uri, line = _physical(r["locations"][0])
        assert line >= 1
        assert r["locations"][0]["physicalLocation"]["artifactLocation"]["uriBaseId"] == SRCROOT
        assert os.path.isfile(source_path(uri)), uri
        with open(source_path(uri)) as fh:
            assert line <= len(fh.readlines())
        for art in _uris(r):
            assert not art["uri"].startswith("/") and "\\" not in art["uri"], art
            assert art.get("uriBaseId") == SRCROOT, art
        # properties carry the finding's data
        props = r["properties"]
        assert (props["pool"], props["op_index"], props["step"]) == (f.pool, f.op_index, f.step)
        word, ids = f.listed()
        assert props.get(word) == (ids[:64] or None) and props.get(f"{word}Total") == (len(ids) or None)
        assert props["num_units"] == f.num_units and props.get("unit") == (f.unit if ids or f.num_units else None)
        assert props["engine_check"] == f.engine_check
        # every embedded link [text](id) names a related location of this result
        ids = {loc["id"] for loc in r.get("relatedLocations", [])}
        links = [int(m) for m in re.findall(r"(?<!\\)\[[^\]]*\]\((\d+)\)", r["message"]["text"])]
        assert set(links) <= ids
        # stacks hold every recorded frame, innermost first
        stacks = [f.alloc_sites, f.free_sites, f.prev_free_sites, f.read_sites, f.lost_sites]
        assert sorted(len(s["frames"]) for s in r.get("stacks", [])) == sorted(len(s) for s in stacks if s)


def test_sarif_reads_the_engines_source_once(monkeypatch):
    """to_sarif asked the target kind where its engine's source lies twice (itself, then engine_of)."""
    from kvaudit.reports import sarif

    calls = []
    real = sarif.engine_source
    monkeypatch.setattr(sarif, "engine_source", lambda target: calls.append(target) or real(target))
    config, findings = _load(os.path.join(ROOT, "corpora", "regressions", "chunked-abort-ignored.json"))
    assert len(to_sarif(findings, config)["runs"][0]["results"]) == len(findings)
    assert calls == ["eut"]


def test_sarif_of_no_findings_is_valid(validator):
    log = to_sarif([])
    assert _errors(validator, log) == []
    (run,) = log["runs"]
    assert run["results"] == [] and "properties" not in run
    assert [r["id"] for r in run["tool"]["driver"]["rules"]] == list(KINDS)


def test_an_interrupted_ci_log_says_its_run_did_not_complete(validator):
    """kvaudit ci interrupted (in its job, or in start-up before it began): a log with no or some results
    that must not read as a clean run's: an unsuccessful invocation, schema-valid."""
    from kvaudit.reports.ci_outputs import interrupted_sarif
    from kvaudit.search import ci

    for log in (interrupted_sarif(), ci.sarif(ci.CiResult(interrupted=True), None)):
        assert _errors(validator, log) == []
        (run,) = log["runs"]
        assert run["results"] == [] and run["invocations"][0]["executionSuccessful"] is False
    assert "invocations" not in ci.sarif(ci.CiResult(), None)["runs"][0]


def test_a_ci_sarif_over_several_presets_describes_them_all(tmp_path, validator):
    """`ci --presets default,chunked --sarif`: the run's properties said `"preset": "default"` and gave default's
    bugs and `engineConfig` only, though the results came from every preset (each result's `properties.preset`)."""
    from kvaudit.search import ci

    out = tmp_path / "ci.sarif"
    r = invoke("ci", "--presets", "default,chunked", "--max-time", "1", "--regressions", str(tmp_path),
               "--out", str(tmp_path / "out"), "--sarif", str(out))
    assert r.exit_code == 0, r.output + r.stderr
    log = json.load(open(out))
    assert _errors(validator, log) == []
    props = log["runs"][0]["properties"]
    kind = registry.get("eut")
    default, chunked = (kind.preset(p).config() for p in ("default", "chunked"))
    assert props["presets"] == ["default", "chunked"] and "preset" not in props and "engineConfig" not in props
    assert props["engineConfigs"] == {"default": default.to_dict(), "chunked": chunked.to_dict()}
    assert props["bugs"] == [] and props["model"] == default.model
    # the results are as they were: one per signature, each naming its own preset
    c1, f1 = _load(os.path.join(ROOT, "corpora", "regressions", "chunked-abort-ignored.json"))
    c2, f2 = _load(os.path.join(ROOT, "corpora", "regressions", "session-close-while-running.json"))
    result = ci.CiResult(fuzz=[ci.FuzzRun(c1.preset, 1.0, 1, new=[([], f1, "a.json")]),
                               ci.FuzzRun(c2.preset, 1.0, 1, new=[([], f2, "b.json")])])
    both, first = ci.sarif(result, c1, (c1, c2)), ci.sarif(result, c1)
    assert both["runs"][0]["results"] == first["runs"][0]["results"]
    assert {r["properties"]["preset"] for r in both["runs"][0]["results"]} == {c1.preset, c2.preset}
    assert both["runs"][0]["properties"]["bugs"] == sorted(set(c1.bugs) | set(c2.bugs))
    assert ci.sarif(result, c1, (c1,)) == first  # one preset: the preset's properties, as before


def test_a_sarif_run_s_page_size_is_its_configs_also_where_to_dict_has_none(validator):
    """vLLM's page size is its ``block_size`` (a property ``to_dict()`` leaves out): the run's properties said
    ``"page_size": null`` for one vLLM preset, and ``ci --target vllm --presets vllm,vllm-small`` (16 and 4
    tokens) kept ``"page_size": null`` as the one page size every preset has. Now a preset's own, and none
    for presets whose page sizes differ."""
    from kvaudit.search import ci

    kind = registry.get("vllm")
    big, big_async, small = (kind.preset(p).config() for p in ("vllm", "vllm-async", "vllm-small"))
    assert (big.page_size, big_async.page_size, small.page_size) == (16, 16, 4)
    assert to_sarif([], small)["runs"][0]["properties"]["page_size"] == 4
    for ran, want in (((big, small), "absent"), ((big, big_async), 16)):
        log = ci.sarif(ci.CiResult(fuzz=[ci.FuzzRun(c.preset, 1.0, 1) for c in ran]), ran[0], ran)
        assert _errors(validator, log) == []
        assert log["runs"][0]["properties"].get("page_size", "absent") == want, ran


def test_an_interrupted_fuzz_run_s_sarif_says_its_run_did_not_complete(validator, tmp_path, monkeypatch):
    """`fuzz` interrupted (a campaign here, stopped after its workers started): the SARIF had no `invocations`,
    so a clean-looking log with no results read as a clean run's (first tester, stop 55; the docs promised it
    for `ci` only). Now an unsuccessful invocation with the interruption as its notification, schema-valid;
    a finished run's log has none."""
    from cli_helpers import invoke

    from kvaudit.search import campaign

    def stopped(spec, emit):
        emit(("ready", spec.index))
        emit(("progress", spec.index, 7, 70, [], [], None, {}, None))
        raise KeyboardInterrupt

    monkeypatch.setattr(campaign, "_search_loop", stopped)
    out = tmp_path / "r.sarif"
    r = invoke("fuzz", "--fuzzer", "random", "--max-time", "5", "--corpus", str(tmp_path / "c"), "--sarif", str(out))
    assert r.exit_code == 130, r.output
    log = json.loads(out.read_text())
    assert _errors(validator, log) == []
    (run,) = log["runs"]
    (inv,) = run["invocations"]
    assert inv["executionSuccessful"] is False and run["results"] == []
    (note,) = inv["toolExecutionNotifications"]
    assert note["message"]["text"].startswith("interrupted (Ctrl-C or SIGTERM) after 7 executions:"), note

    def finished(spec, emit):
        emit(("ready", spec.index))
        emit(("progress", spec.index, 7, 70, [], [], None, {}, None))
        emit(("done", spec.index))

    monkeypatch.setattr(campaign, "_search_loop", finished)
    r = invoke("fuzz", "--fuzzer", "random", "--max-time", "5", "--corpus", str(tmp_path / "d"), "--sarif", str(out))
    assert r.exit_code == 0, r.output
    assert "invocations" not in json.loads(out.read_text())["runs"][0]


def test_the_validator_rejects_a_broken_log(validator):
    """The schema check must be able to fail: a bad level, a missing message, a bad line."""
    config, f = _by_kind("leak")
    good = to_sarif([f], config)
    for breakage in ("level", "message", "line", "version"):
        bad = copy.deepcopy(good)
        r = bad["runs"][0]["results"][0]
        if breakage == "level":
            r["level"] = "fatal"
        elif breakage == "message":
            del r["message"]
        elif breakage == "line":
            r["locations"][0]["physicalLocation"]["region"]["startLine"] = 0
        else:
            bad["version"] = "2.0.0"
        assert _errors(validator, bad), breakage


def test_one_rule_per_kind_and_rule_index_points_at_it():
    findings = [f for p in REGRESSIONS for f in _load(p)[1]]
    run = to_sarif(findings)["runs"][0]
    rules = run["tool"]["driver"]["rules"]
    assert [r["id"] for r in rules] == list(KINDS)
    assert len({r["name"] for r in rules}) == len(KINDS)
    for r in rules:
        assert re.fullmatch(r"[A-Z][A-Za-z]*", r["name"]), r["name"]
        assert r["shortDescription"]["text"] and r["fullDescription"]["text"]
        assert r["help"]["text"] and r["help"]["markdown"]
        assert "kvaudit" in r["properties"]["tags"]
        if r["id"] in MEMORY_SAFETY or r["id"] == "crash":
            assert r["defaultConfiguration"]["level"] == "error", r["id"]
    for f, res in zip(findings, run["results"]):
        assert rules[res["ruleIndex"]]["id"] == res["ruleId"] == f.kind
    # the rule table does not depend on which findings a run had
    assert to_sarif(findings[:1])["runs"][0]["tool"]["driver"]["rules"] == rules


def test_a_leaks_lost_release_is_linked_at_the_path_its_signature_names():
    """(Tester 62: the link read "its last owner let go of it at release_kv_cache (scheduler.py:395)", the
    row free of the plumbing every release path shares, where the signature names ``release_req``.)"""
    config, _, findings, _ = replay.load(os.path.join(ROOT, "corpora", "regressions", "retract-unaligned-page.json"))
    (f,) = findings
    assert f.signature.endswith("/release_req@scheduler_decode_mixin.py") and f.lost_sites[0].entry
    (r,) = to_sarif([f], config)["runs"][0]["results"]
    text = r["message"]["text"]
    assert re.search(r"let go of it at \[release_req\]\(\d+\) \(scheduler_decode_mixin\.py:\d+ in release_req\)",
                     text), text
    assert "[release_kv_cache]" not in text


def test_double_free_is_located_at_its_second_free():
    config, f = _by_kind("double-free")
    assert f.free_sites and f.alloc_sites and f.free_sites[0] != f.alloc_sites[0]
    (r,) = to_sarif([f], config)["runs"][0]["results"]
    from kvaudit.audit.frames import resolve
    now = lambda s: resolve(s).line  # noqa: E731 -- frames recorded before the code moved are re-located
    assert _physical(r["locations"][0]) == (f.free_sites[0].file, now(f.free_sites[0]))
    related = {(loc["physicalLocation"]["artifactLocation"]["uri"], loc["physicalLocation"]["region"]["startLine"]):
               loc["id"] for loc in r["relatedLocations"]}
    prev, alloc = f.prev_free_sites[0], f.alloc_sites[0]
    assert (prev.file, now(prev)) in related and (alloc.file, now(alloc)) in related
    # the message links the earlier free
    assert f"[{prev.function}]({related[(prev.file, now(prev))]})" in r["message"]["text"]
    assert [s["message"]["text"] for s in r["stacks"]][:2] == ["freed again at", "previously freed at"]


def test_leak_is_located_at_its_allocation():
    config, f = _by_kind("leak")
    (r,) = to_sarif([f], config)["runs"][0]["results"]
    assert _physical(r["locations"][0]) == (f.alloc_sites[0].file, f.alloc_sites[0].line)
    assert r["partialFingerprints"][FINGERPRINT_KEY] == f.signature
    assert "properties" in r and "locationIsFallback" not in r["properties"]


def _current(function: str, text: str) -> tuple[int, str]:
    """The line number and stripped text of the first line of engine_under_test/scheduler.py's ``function``
    that contains ``text`` (so that the tests below follow the engine's edits)."""
    import inspect

    from engine_under_test.scheduler import Scheduler
    lines, first = inspect.getsourcelines(getattr(Scheduler, function))
    return next((first + i, line.strip()) for i, line in enumerate(lines) if text in line)


def test_recorded_source_line_becomes_the_region_snippet(validator):
    if "source" not in {fld.name for fld in dataclasses.fields(Site)}:
        pytest.skip("Site records no source line in this tree")
    line, text = _current("alloc_for_extend", "alloc_extend(")
    # recorded 40 lines off: the region is where the recorded text is now, the snippet the recorded text
    site = Site("engine_under_test/scheduler.py", line + 40, "alloc_for_extend", source=text)
    step, _ = _current("step", "def step")
    f = Finding(kind="leak", pool="token_to_kv_pool", message="unreachable", slots=[3], num_units=1,
                alloc_sites=[site, Site("engine_under_test/scheduler.py", step, "step")])
    log = to_sarif([f])
    assert _errors(validator, log) == []
    (r,) = log["runs"][0]["results"]
    region = r["locations"][0]["physicalLocation"]["region"]
    assert region == {"startLine": line, "snippet": {"text": text}}
    assert text in ET.fromstring(to_junit([f])).find(".//failure").text


def test_a_moved_frame_is_named_at_its_current_line_in_every_summary(tmp_path):
    """A frame recorded 40 lines off (the code moved since): SARIF's message named its current line, as the frame
    lines of every report do, but the console's ERROR line, the JUnit failure message (fuzz's and ci's) and the
    HTML's "First:" still named the recorded one (tr64)."""
    import io

    from rich.console import Console

    from kvaudit.reports.html_report import render_html
    from kvaudit.reports.outputs import Case
    from kvaudit.reports.report import finding_renderable
    from kvaudit.search import ci

    line, text = _current("alloc_for_extend", "alloc_extend(")
    site = Site("engine_under_test/scheduler.py", line + 40, "alloc_for_extend", source=text)
    f = Finding(kind="leak", pool="token_to_kv_pool", message="unreachable", slots=[3], num_units=1,
                alloc_sites=[site], op_index=0, step=1)
    now, then = f"scheduler.py:{line} in alloc_for_extend", f"scheduler.py:{line + 40} in alloc_for_extend"
    assert then in f.summary()
    (r,) = to_sarif([f])["runs"][0]["results"]
    assert now in r["message"]["text"] and then not in r["message"]["text"]  # (as it was)
    buf = io.StringIO()
    Console(file=buf, width=200, color_system=None).print(finding_renderable(f, None, plain=True), soft_wrap=True)
    error = next(ln for ln in buf.getvalue().splitlines() if ln.startswith("==ERROR: kvaudit: "))
    failures = [ET.fromstring(to_junit([f])).find(".//failure"),
                ET.fromstring(ci.junit(ci.CiResult(fuzz=[ci.FuzzRun("default", 1.0, 1, new=[([], [f], "a.json")])])))
                .find(".//failure")]
    first = re.search(r"First: ([^<]*)</p>", render_html(EngineConfig(), [Case([], [f])]))[1]
    for said in [error, first] + [x.get("message") for x in failures] + [x.text for x in failures]:
        assert now in said and then not in said, said


def test_a_stale_frame_is_not_the_location_a_current_one_is():
    """A frame whose function is gone from the current source (a file recorded on older code) would point at
    whatever that line holds now: the location is the next current frame (the tester, stop 49)."""
    step, _ = _current("step", "def step")
    gone = Site("engine_under_test/scheduler.py", step, "no_such_function", source="x = 1")
    here = Site("engine_under_test/scheduler.py", step, "step")
    f = Finding(kind="leak", pool="token_to_kv_pool", message="unreachable", slots=[3], num_units=1,
                alloc_sites=[gone, here])
    (r,) = to_sarif([f])["runs"][0]["results"]
    assert r["locations"][0]["logicalLocations"][0]["name"] == "step"
    assert "locationIsFallback" not in r["properties"]


def test_the_location_is_labelled_by_the_stack_it_comes_from():
    """A double free whose second free has no addressable frame is shown at the first free: the label says
    so (it said 'freed again at' over the first free's frame), and the second free's frames are preferred
    over every other stack's when they are addressable (the tester, stop 49)."""
    step, _ = _current("step", "def step")
    first = Site("engine_under_test/scheduler.py", step, "step")
    f = Finding(kind="double-free", pool="token_to_kv_pool", message="freed twice", slots=[3], num_units=1,
                free_sites=[Site("<string>", 1, "somewhere")], prev_free_sites=[first])
    (r,) = to_sarif([f])["runs"][0]["results"]
    assert r["locations"][0]["message"]["text"] == "previously freed at step"
    again = Site("engine_under_test/scheduler.py", step, "step")
    f = dataclasses.replace(f, free_sites=[Site("<string>", 1, "somewhere"), again])
    (r,) = to_sarif([f])["runs"][0]["results"]
    assert r["locations"][0]["message"]["text"] == "freed again at step"


def test_stale_kv_without_alloc_site_is_located_where_it_was_read(validator):
    config, f = _by_kind("stale-kv")
    f = dataclasses.replace(f, alloc_sites=[])
    log = to_sarif([f], config)
    assert _errors(validator, log) == []
    (r,) = log["runs"][0]["results"]
    assert _physical(r["locations"][0]) == (f.read_sites[0].file, f.read_sites[0].line)


def test_finding_without_any_site_still_has_a_repo_location(validator):
    config, f = _by_kind("accounting-drift")
    assert not (f.alloc_sites or f.free_sites or f.read_sites)
    hang = Finding(kind="hang", pool="-", message="engine not idle after 2000 steps of idle(): 1 waiting",
                   op_index=3, step=2003)
    log = to_sarif([f, hang], config)
    assert _errors(validator, log) == []
    for r in log["runs"][0]["results"]:
        uri, line = _physical(r["locations"][0])
        assert uri.startswith("engine_under_test/") and line >= 1
        assert os.path.isfile(source_path(uri))
        assert r["properties"]["locationIsFallback"] is True
        assert "(No source frame recorded: shown at " in r["message"]["text"]


def test_crash_frames_outside_the_repo_stay_out_of_code_scanning_locations(validator):
    """A crash's innermost frames can be in a library (absolute path) or a pseudo-file: the
    location is the innermost frame in the repository; stacks keep the others as file:// URIs."""
    step, _ = _current("step", "def step")
    frames = [Site("/usr/lib/python3.11/json/decoder.py", 355, "raw_decode"), Site("<string>", 1, "<module>"),
              Site("engine_under_test/scheduler.py", step, "step"), Site("engine_under_test/scheduler.py", 0, "run")]
    crash = Finding(kind="crash", pool="-", message="ValueError: [bad] value", alloc_sites=frames,
                    op_index=2, step=1, traceback="Traceback (most recent call last):\n...")
    log = to_sarif([crash])
    assert _errors(validator, log) == []
    (r,) = log["runs"][0]["results"]
    assert _physical(r["locations"][0]) == ("engine_under_test/scheduler.py", step)
    uris = [fr["location"].get("physicalLocation", {}).get("artifactLocation", {}).get("uri")
            for fr in r["stacks"][0]["frames"]]
    assert uris == ["file:///usr/lib/python3.11/json/decoder.py", None, "engine_under_test/scheduler.py",
                    "engine_under_test/scheduler.py"]
    assert "region" not in r["stacks"][0]["frames"][3]["location"]["physicalLocation"]  # line 0: unknown
    assert all(not loc["physicalLocation"]["artifactLocation"]["uri"].startswith("file:")
               for loc in r["relatedLocations"])
    # literal brackets in free text are escaped, so they are not read as embedded links
    assert "\\[bad\\]" in r["message"]["text"]


def test_a_user_engine_outside_kvaudit_is_located_relative_to_the_current_directory(validator, tmp_path,
                                                                                    monkeypatch):
    """A plugin target's engine lies outside kvaudit's directory, so its frames are recorded absolute. They
    were never a result's location: a leak with its allocation in the user's engine.py was anchored at line 1
    of the plugin's config file, with a stale-frame note. Run from the user's repository, they are
    repo-relative now; from elsewhere, the fallback as before; an installed package under it stays out."""
    engine = tmp_path / "myeng" / "engine.py"
    engine.parent.mkdir()
    engine.write_text("class Engine:\n    def step(self):\n        got = self.pool.alloc(4)\n")
    site = Site(str(engine), 3, "step", source="got = self.pool.alloc(4)")
    lib = Site(str(tmp_path / "venv" / "lib" / "site-packages" / "numpy" / "core.py"), 7, "alloc")
    leak = Finding(kind="leak", pool="slots", message="unreachable", slots=[3], num_units=1, alloc_sites=[lib, site])
    monkeypatch.chdir(tmp_path)
    log = to_sarif([leak])
    assert _errors(validator, log) == []
    (r,) = log["runs"][0]["results"]
    loc = r["locations"][0]
    assert loc["physicalLocation"]["artifactLocation"] == {"uri": "myeng/engine.py", "uriBaseId": SRCROOT}
    assert loc["physicalLocation"]["region"]["startLine"] == 3 and "properties" not in loc
    assert "locationIsFallback" not in r["properties"]
    assert r["stacks"][0]["frames"][0]["location"]["physicalLocation"]["artifactLocation"]["uri"].startswith("file://")
    monkeypatch.chdir(ROOT)
    (r,) = to_sarif([leak])["runs"][0]["results"]
    assert r["properties"]["locationIsFallback"] is True
    # (frames were recorded: the message said "No source frame recorded", tester t54)
    assert "(No recorded frame is a file of this checkout (run kvaudit from the repository root): shown at " in \
        r["message"]["text"] and "No source frame recorded" not in r["message"]["text"], r["message"]["text"]


def test_a_plugin_package_in_the_users_repository_is_located_relative_to_it(validator, tmp_path, monkeypatch):
    """A plugin that is a package on sys.path (PYTHONPATH, or the current directory) has its frames recorded
    package-relative (toysched/engine.py), so they read as an installed package's: every result was placed
    at the plugin's config class with locationIsFallback. Under the current directory it is the user's
    code: %SRCROOT%-relative, at the recorded line; from elsewhere, the fallback as before."""
    engine = tmp_path / "toysched" / "engine.py"
    engine.parent.mkdir()
    (engine.parent / "__init__.py").write_text("")
    engine.write_text("class Engine:\n    def step(self):\n        got = self.pool.alloc(4)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    site = Site("toysched/engine.py", 3, "step", source="got = self.pool.alloc(4)")
    leak = Finding(kind="leak", pool="slots", message="unreachable", slots=[3], num_units=1, alloc_sites=[site])
    monkeypatch.chdir(tmp_path)
    log = to_sarif([leak])
    assert _errors(validator, log) == []
    (r,) = log["runs"][0]["results"]
    loc = r["locations"][0]["physicalLocation"]
    assert loc["artifactLocation"] == {"uri": "toysched/engine.py", "uriBaseId": SRCROOT}
    assert loc["region"]["startLine"] == 3 and "locationIsFallback" not in r["properties"]
    monkeypatch.chdir(ROOT)
    (r,) = to_sarif([leak])["runs"][0]["results"]
    assert r["properties"]["locationIsFallback"] is True
    # (frames were recorded: the message said "No source frame recorded", tester t54)
    assert "(No recorded frame is a file of this checkout (run kvaudit from the repository root): shown at " in \
        r["message"]["text"] and "No source frame recorded" not in r["message"]["text"], r["message"]["text"]


def test_a_kind_without_an_anchor_falls_back_to_its_config_class_statement(validator):
    """A finding with no usable frame, of a target kind that registers no anchor, is shown at its config
    class. It was shown at line 1 of that file, which resolve() then flagged as a stale frame."""
    import inspect

    from kvaudit.targets import registry
    from kvaudit.config import ConfigBase, Preset

    @dataclasses.dataclass(frozen=True)
    class NoAnchorConfig(ConfigBase):
        bugs: frozenset = dataclasses.field(default_factory=frozenset)
        preset: str = "custom"
        target: str = "noanchor"

    registry.register(registry.TargetKind(
        "noanchor", "a kind with no anchor", NoAnchorConfig, make=lambda c: None,
        presets=lambda: {"noanchor": Preset("noanchor", "one", {}, NoAnchorConfig)}, default_preset="noanchor"))
    try:
        hang = Finding(kind="hang", pool="-", message="engine not idle", op_index=1, step=3)
        log = to_sarif([hang], NoAnchorConfig())
    finally:
        registry._KINDS.pop("noanchor")
    assert _errors(validator, log) == []
    (r,) = log["runs"][0]["results"]
    loc = r["locations"][0]
    assert _physical(loc) == ("tests/test_sarif_junit.py", inspect.getsourcelines(NoAnchorConfig)[1])
    assert "properties" not in loc and r["properties"]["locationIsFallback"] is True



# a plugin's config class, in a module of its own (the plugin tests below write it outside the current directory)
_FAR_CONFIG = ("import dataclasses\nfrom kvaudit.config import ConfigBase\n\n\n@dataclasses.dataclass(frozen=True)\n"
               "class FarConfig(ConfigBase):\n    bugs: frozenset = dataclasses.field(default_factory=frozenset)\n"
               "    preset: str = 'custom'\n    target: str = '{kind}'\n")


def _far_results(validator, monkeypatch, cls, kind: str, where, alloc_sites: list) -> list[dict]:
    """The SARIF results, a leak allocated at ``alloc_sites`` and a hang (no frame), of the plugin kind ``kind``
    (config class ``cls``, registered for the call) run from the directory ``where``."""
    from kvaudit.config import Preset

    registry.register(registry.TargetKind(
        kind, "a plugin outside the current directory", cls, make=lambda c: None,
        presets=lambda: {kind: Preset(kind, "one", {}, cls)}, default_preset=kind))
    leak = Finding(kind="leak", pool="rows", message="unreachable", slots=[3], num_units=1, unit="row",
                   alloc_sites=alloc_sites)
    hang = Finding(kind="hang", pool="-", message="engine not idle", op_index=1, step=3)
    monkeypatch.chdir(where)
    try:
        log = to_sarif([leak, hang], cls())
    finally:
        registry._KINDS.pop(kind)
    assert _errors(validator, log) == []
    return log["runs"][0]["results"]

def test_a_plugin_run_from_outside_its_folder_is_located_at_the_findings_own_line(validator, tmp_path,
                                                                                  monkeypatch):
    """A plugin's engine and target module both outside the current directory (t54's toy plugin run from
    another directory): code scanning can show neither its frames nor its config class. The result was
    anchored at the config class, not the line the finding names, and said that class was "where the engine
    keeps the state". Now it is at the finding's own frame (the user's code before a library's) by its path,
    flagged, and says why code scanning cannot show it; a finding with no frame at all is still at the config
    class, called that."""
    import inspect
    import sys
    from urllib.parse import quote

    plug, elsewhere = tmp_path / "plug", tmp_path / "elsewhere"
    plug.mkdir()
    elsewhere.mkdir()
    engine = plug / "engine.py"
    engine.write_text("class Engine:\n    def step(self):\n        got = self.pool.alloc(4)\n")
    (plug / "farplug_target.py").write_text(_FAR_CONFIG.format(kind="farplug"))
    monkeypatch.syspath_prepend(str(plug))
    monkeypatch.delitem(sys.modules, "farplug_target", raising=False)
    import farplug_target
    monkeypatch.setitem(sys.modules, "farplug_target", farplug_target)  # (taken out again afterwards)
    cls = farplug_target.FarConfig
    lib = Site(str(tmp_path / "venv" / "lib" / "site-packages" / "numpy" / "core.py"), 7, "alloc")
    site = Site(str(engine), 3, "step", source="got = self.pool.alloc(4)")
    r, h = _far_results(validator, monkeypatch, cls, "farplug", elsewhere, [lib, site])
    loc = r["locations"][0]
    assert _physical(loc) == ("file://" + quote(str(engine)), 3)
    assert loc["message"]["text"] == "allocated at step"
    assert r["properties"]["locationOutsideCheckout"] is True and "locationIsFallback" not in r["properties"]
    text = r["message"]["text"]
    assert f"cannot show this result in the repository: it is located at its own frame, {engine}:3" in text, text
    assert "FarConfig" not in text and "where the engine keeps the state" not in text
    # no frame at all: the config class, said to be one
    assert _physical(h["locations"][0]) == ("file://" + quote(str(plug / "farplug_target.py")),
                                           inspect.getsourcelines(cls)[1])
    # ... and flagged as outside the checkout too, with the same advice (second tester, stop 55)
    assert h["properties"]["locationIsFallback"] is True and h["properties"]["locationOutsideCheckout"] is True
    assert "shown at FarConfig, the target kind's config class" in h["message"]["text"], h["message"]["text"]
    assert "not a file under the current directory, so code scanning cannot show this result" in h["message"]["text"]



def test_a_plugin_package_run_from_outside_its_folder_names_the_path_it_is_located_by(validator, tmp_path,
                                                                                      monkeypatch):
    """A plugin package on sys.path (its frames recorded package-relative, toysched/engine.py) run from outside
    its folder: the result was located at file:///.../toysched/engine.py, but its message said "it is located
    at its own frame, toysched/engine.py:3, by that path" (a path that does not resolve from where it ran),
    and a frameless finding's "(That is toysched/far_target.py, not a file under the current directory ...)".
    Both now name the absolute path the location's URI holds."""
    import inspect
    import sys
    from urllib.parse import unquote

    pkg, elsewhere = tmp_path / "plug" / "toysched", tmp_path / "elsewhere"
    pkg.mkdir(parents=True)
    elsewhere.mkdir()
    (pkg / "__init__.py").write_text("")
    engine = pkg / "engine.py"
    engine.write_text("class Engine:\n    def step(self):\n        got = self.pool.alloc(4)\n")
    (pkg / "far_target.py").write_text(_FAR_CONFIG.format(kind="farpkg"))
    monkeypatch.syspath_prepend(str(pkg.parent))
    for name in ("toysched", "toysched.far_target"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    from toysched import far_target
    for name in ("toysched", "toysched.far_target"):
        monkeypatch.setitem(sys.modules, name, sys.modules[name])  # (taken out again afterwards)
    cls = far_target.FarConfig
    site = Site("toysched/engine.py", 3, "step", source="got = self.pool.alloc(4)")
    r, h = _far_results(validator, monkeypatch, cls, "farpkg", elsewhere, [site])
    uri, line = _physical(r["locations"][0])
    assert os.path.samefile(unquote(uri.removeprefix("file://")), engine) and line == 3
    assert r["properties"]["locationOutsideCheckout"] is True
    text = r["message"]["text"]
    assert f"it is located at its own frame, {unquote(uri.removeprefix('file://'))}:3, by that path" in text, text
    uri, line = _physical(h["locations"][0])
    assert os.path.samefile(unquote(uri.removeprefix("file://")), pkg / "far_target.py")
    assert line == inspect.getsourcelines(cls)[1]
    assert f"(That is {unquote(uri.removeprefix('file://'))}, not a file under" in h["message"]["text"], \
        h["message"]["text"]

# ----------------------------------------------------------------------------- SARIF: real SGLang's frames

SGLANG_FILES = sorted(glob.glob(os.path.join(ROOT, "corpora", "sglang", "*.json")))


@pytest.mark.parametrize("path", SGLANG_FILES, ids=lambda p: os.path.basename(p)[:-5])
def test_sglang_findings_are_anchored_at_sglang_s_own_frame_relative_to_its_package(validator, path):
    """SGLang's frames are recorded from its package (``sglang/srt/...``; files older than 2026-12 as the
    recording machine's absolute paths, which this reads alike): a result is anchored
    at the innermost SGLang frame (not kvaudit's driver), as a path under the package
    (``%SGLANG_ROOT%``), with the SGLang version; no file:// path of the recording machine is left."""
    config, findings = _load(path)
    log = to_sarif(findings, config)
    assert _errors(validator, log) == []
    (run,) = log["runs"]
    version = installed_version()  # None without SGLang: the log then claims no version
    assert run["properties"]["engine"] == "sglang" and run["properties"].get("engineVersion") == version
    assert "%SGLANG_ROOT%" in run["originalUriBaseIds"]
    text = json.dumps(log)
    assert "file://" not in text and "/site-packages/" not in text
    for f, r in zip(findings, run["results"]):
        assert (r["properties"]["engine"], r["properties"].get("engineVersion")) == ("sglang", version)
        stacks = [s for _, s in finding_stacks(f)]
        ours = [s for st in stacks for s in st
                if s.file.startswith("sglang/") or ("/sglang/" in s.file and os.path.isabs(s.file))]
        art = r["locations"][0]["physicalLocation"]["artifactLocation"]
        if not ours:  # nothing of SGLang recorded (a hang): anchored on kvaudit's driver, in the repo
            assert art["uriBaseId"] == SRCROOT and r["properties"].get("locationIsFallback")
            continue
        primary = next((s for s in getattr(f, primary_stack(f)) if s in ours), ours[0])
        uri = primary.file[primary.file.rindex("/sglang/") + 1:] if os.path.isabs(primary.file) else primary.file
        assert art == {"uri": uri, "uriBaseId": "%SGLANG_ROOT%"}
        assert art["uri"].startswith("sglang/srt/")
        assert r["locations"][0]["physicalLocation"]["region"]["startLine"] == primary.line
        for a in _uris(r):  # every frame: in the repository or under SGLang's package
            assert a.get("uriBaseId") in (SRCROOT, "%SGLANG_ROOT%") and not a["uri"].startswith("/"), a


@pytest.mark.parametrize("name, package, release", [("sglang_history/sglang-22862", "sglang", "0.5.10.post1"),
                                                     ("vllm_releases/vllm-33377", "vllm", "0.15.1")])
@pytest.mark.parametrize("overlay", ["present", "absent"])
def test_frames_recorded_on_a_release_overlay_claim_no_line_of_the_installed_release(
        validator, tmp_path, name, package, release, overlay):
    """Old fixtures hold a release overlay's absolute paths (``~/.cache/kvaudit/releases/sglang-0.5.10.post1/
    sglang/srt/...``). Their SARIF named ``sglang/srt/mem_cache/common.py`` under ``%SGLANG_ROOT%`` (the
    installed package) at the recorded line: a line of another release's file. Now the frame keeps its
    package path, with its release and recorded line as properties and no region; the result is anchored
    at a frame whose line is this checkout's."""
    with open(os.path.join(ROOT, "tests", "data", f"{name}.json")) as fh:
        text = fh.read()
    assert f"/.cache/kvaudit/releases/{package}-{release}/{package}/" in text
    if overlay == "absent":  # read on a machine without the overlay (another home directory)
        text = re.sub(r'"/[^"]*/\.cache/kvaudit/releases/', '"/home/nobody/.cache/kvaudit/releases/', text)
    path = tmp_path / "in.json"
    path.write_text(text)
    config, findings = _load(str(path))
    log = to_sarif(findings, config)
    assert _errors(validator, log) == []
    for f, r in zip(findings, log["runs"][0]["results"]):
        recorded = {s.line for _, st in finding_stacks(f) for s in st if recorded_release(s.file, package) == release}
        assert recorded
        locs = r["locations"] + r.get("relatedLocations", []) + [fr["location"] for st in r.get("stacks", [])
                                                                 for fr in st["frames"]]
        theirs = [loc for loc in locs if loc.get("physicalLocation", {}).get("artifactLocation", {}).get(
            "uri", "").startswith(f"{package}/")]
        assert theirs and all("region" not in loc["physicalLocation"] for loc in theirs)
        assert {loc["properties"]["recordedOn"] for loc in theirs} == {f"{package} {release}"}
        assert {loc["properties"]["recordedLine"] for loc in theirs} <= recorded
        assert "region" in r["locations"][0]["physicalLocation"]  # a line of this checkout's
        assert r["properties"]["recordedOn"] == f"{package} {release}"
        assert f"Recorded on {package} {release}, not the {package} installed here" in r["message"]["text"]


@pytest.mark.parametrize("name, package, release", [
    ("sglang/leak-a3-hisparse-buffer-padded-at-finish", "sglang", "0.5.10.post1"),
    ("vllm/fault-skip-free", "vllm", "0.15.1")])
def test_a_file_recorded_on_another_release_claims_no_line_of_the_installed_one(validator, tmp_path, name, package,
                                                                               release):
    """A file recorded today on a release overlay holds package-relative frames (``sglang/srt/...``): only its
    ``engine_version`` says which release their lines are of. ``kvaudit report --sarif`` claimed the installed
    release's lines for them; now, where the recorded release is another, its engine frames have no region
    and the result says where it was recorded, as for an overlay's absolute paths; the same file recorded on
    the installed release keeps its regions."""
    doc = json.load(open(os.path.join(ROOT, "corpora", f"{name}.json")))
    ours = [s for f in doc["findings"] for st in ("alloc_sites", "free_sites") for s in f.get(st) or []
            if s["file"].startswith(f"{package}/")]
    assert ours  # package-relative frames, as recorded since 2026-12

    def engine_locations(version):
        doc["engine_version"] = version
        src, out = tmp_path / f"{version}.json", tmp_path / f"{version}.sarif"
        src.write_text(json.dumps(doc))
        r = invoke("report", str(src), "--sarif", str(out))
        assert r.exit_code == 0, r.output
        log = json.loads(out.read_text())
        assert _errors(validator, log) == []
        (result, *_) = log["runs"][0]["results"]
        locs = result["locations"] + result.get("relatedLocations", []) + [
            fr["location"] for st in result.get("stacks", []) for fr in st["frames"]]
        return result, [loc for loc in locs if loc.get("physicalLocation", {}).get("artifactLocation", {}).get(
            "uriBaseId") == engine_base_id(package)]

    result, theirs = engine_locations(release)
    assert theirs and all("region" not in loc["physicalLocation"] for loc in theirs)
    assert {loc["properties"]["recordedOn"] for loc in theirs} == {f"{package} {release}"}
    assert result["properties"]["recordedOn"] == f"{package} {release}"
    assert f"Recorded on {package} {release}, not the {package} installed here" in result["message"]["text"]
    installed = registry.get(package).engine_source().version
    if installed is None:
        pytest.skip(f"{package} is not installed here: no release to compare with")
    result, theirs = engine_locations(installed)
    assert theirs and all("region" in loc["physicalLocation"] for loc in theirs)
    assert "recordedOn" not in result["properties"]


def test_recorded_release_reads_the_overlay_directory_only():
    assert recorded_release("/root/.cache/kvaudit/releases/sglang-0.5.22/sglang/srt/a.py", "sglang") == "0.5.22"
    assert recorded_release("/x/releases/vllm-0.15.1/vllm/v1/core/sched/scheduler.py", "vllm") == "0.15.1"
    assert recorded_release("/opt/venv/lib/python3.11/site-packages/sglang/srt/a.py", "sglang") is None
    assert recorded_release("sglang/srt/a.py", "sglang") is None
    assert recorded_release("/x/releases/sglang-0.5.22/sglang/srt/a.py", "vllm") is None


def test_engine_path_takes_the_last_package_directory_and_nothing_in_the_repository():
    assert engine_path("/opt/venv/lib/python3.11/site-packages/sglang/srt/a.py", "sglang") == "sglang/srt/a.py"
    assert engine_path("/home/u/sglang/python/sglang/srt/a.py", "sglang") == "sglang/srt/a.py"  # a checkout
    assert engine_path("C:\\py\\Lib\\site-packages\\sglang\\srt\\a.py", "sglang") == "sglang/srt/a.py"
    assert engine_path("kvaudit/targets/sglang/target.py", "sglang") is None  # kvaudit's driver
    assert engine_path("sglang/srt/a.py", "sglang") == "sglang/srt/a.py"  # as recorded since 2026-12
    assert engine_path("/usr/lib/python3.11/json/decoder.py", "sglang") is None
    assert engine_path("<string>", "sglang") is None


def test_a_finding_of_no_units_names_no_unit_and_lists_none():
    """A vLLM hang (pool "-", no units) said ``unit: "slot"`` (the recorded default, not vLLM's blocks) and
    ``slots: []``; a leak still names its unit and lists its units."""
    config, _, findings, _ = replay.load(os.path.join(ROOT, "corpora", "vllm", "fault-lose-failed-load.json"))
    hang = next(f for f in findings if f.kind == "hang")
    assert (hang.pool, hang.slots, hang.num_units, hang.unit) == ("-", [], 0, "slot")
    props = to_sarif([hang], config)["runs"][0]["results"][0]["properties"]
    assert not {"unit", "slots", "slotsTotal", "blocks", "blocksTotal"} & set(props) and props["num_units"] == 0
    config, _, findings, _ = replay.load(os.path.join(ROOT, "corpora", "vllm", "fault-skip-free.json"))
    props = to_sarif(findings[:1], config)["runs"][0]["results"][0]["properties"]
    assert props["unit"] == "block" and props["blocks"] and props["blocksTotal"] == len(props["blocks"])


def test_a_built_in_engine_log_names_no_installed_engine():
    config, f = _by_kind("leak")
    (run,) = to_sarif([f], config)["runs"]
    assert "originalUriBaseIds" not in run and "engine" not in run["properties"]
    assert "engine" not in run["results"][0]["properties"]


def test_baseline_states_are_written_per_signature_and_checked():
    config, f = _by_kind("leak")
    _, g = _by_kind("double-free")
    results = to_sarif([f, g], config, baseline={f.signature: "unchanged", g.signature: "new"})["runs"][0]["results"]
    assert [r["baselineState"] for r in results] == ["unchanged", "new"]
    assert "baselineState" not in to_sarif([f], config)["runs"][0]["results"][0]
    with pytest.raises(ValueError, match='^baselineState "absent" '):  # (was 'absent', in Python's quotes)
        to_sarif([f], config, baseline={f.signature: "absent"})


# ----------------------------------------------------------------------------- SARIF from kvaudit ci

def _leak_a_lock(tree, req):  # the planted, unfixed bug: a lock nobody holds, at every finish
    tree.inc_lock_ref(tree.match_prefix(req.origin_input_ids).last_node)


def _plant_lock_leak(monkeypatch):
    from engine_under_test.scheduler import Scheduler
    orig = Scheduler.release_kv_cache

    def release_kv_cache(self, req, checkpoint):
        orig(self, req, checkpoint)
        if checkpoint and not req.is_health_check and not self.tree_cache.disable:
            _leak_a_lock(self.tree_cache, req)

    monkeypatch.setattr(Scheduler, "release_kv_cache", release_kv_cache)


@pytest.mark.slow
def test_ci_sarif_lists_an_unfixed_bug_every_night_with_the_same_fingerprint_and_location(
        tmp_path, monkeypatch, validator):
    """Nightly ``kvaudit ci`` over one corpus: the first night finds the planted bug (new), the second
    knows it (the job passes) and must still list it, identically but for ``baselineState``, or code
    scanning closes its alert; once the bug is fixed, the next night lists nothing (the alert closes)."""
    from cli_helpers import invoke

    regressions = tmp_path / "regressions"
    regressions.mkdir()

    def night(n: int, budget: str):
        out = tmp_path / f"night{n}.sarif"
        result = invoke("ci", "--max-time", budget, "--presets", "default", "--fuzzer", "random",
                        "--regressions", str(regressions), "--corpus", str(tmp_path / "corpus"),
                        "--out", str(tmp_path / "out"), "--sarif", str(out), "--junit", str(tmp_path / f"night{n}.xml"))
        log = json.load(open(out))
        assert _errors(validator, log) == []
        return result, {r["partialFingerprints"][FINGERPRINT_KEY]: r for r in log["runs"][0]["results"]}

    _plant_lock_leak(monkeypatch)
    first, night1 = night(1, "10")
    assert first.exit_code == 1, first.output  # a new finding fails the job
    second, night2 = night(2, "3")
    assert second.exit_code == 0, second.output  # known: the job passes...
    assert night1 and set(night2) == set(night1)  # ...and the SARIF still lists it, same fingerprint
    # the table and the JUnit say so too (they said "clean" and "default: no findings")
    assert f"no new findings; {len(night1)} known still open" in second.output, second.output
    (case,) = ET.parse(tmp_path / "night2.xml").getroot().iter("testcase")
    assert case.get("name") == "default: no new findings" and case.find("failure") is None
    assert case.find("system-out").text.startswith(f"{len(night1)} known finding(s) still open: ")
    ours = [sig for sig in night1 if sig.endswith(f"inc:_leak_a_lock@{os.path.basename(__file__)}")]
    assert len(ours) == 1, list(night1)
    for sig in night1:
        r1, r2 = night1[sig], night2[sig]
        assert (r1["baselineState"], r2["baselineState"]) == ("new", "unchanged")
        assert {k: v for k, v in r1.items() if k != "baselineState"} == \
               {k: v for k, v in r2.items() if k != "baselineState"}  # same location, message, stacks
    uri, line = _physical(night1[ours[0]]["locations"][0])
    assert (uri, line) == ("tests/test_sarif_junit.py", _leak_a_lock.__code__.co_firstlineno + 1)
    assert night1[ours[0]]["properties"]["preset"] == "default"

    monkeypatch.undo()  # the bug is fixed
    third, night3 = night(3, "3")
    assert third.exit_code == 0 and night3 == {}, third.output
    assert "clean" in third.output and "known still open" not in third.output


@pytest.mark.slow
def test_a_ci_shard_without_a_corpus_lists_the_finding_another_shard_found(tmp_path, monkeypatch, validator,
                                                                           redis_server):
    """`kvaudit ci --db` without --corpus (the fuzzing guide's matrix job): a shard that knew a finding another
    shard had triaged said "clean" and its SARIF had no result, since the known file was replayed after its
    scratch corpus was gone (tester 60a). Now the row says it is known and open, and the SARIF lists it."""
    from cli_helpers import invoke

    regressions = tmp_path / "regressions"
    regressions.mkdir()

    def shard(n: int, budget: str):
        out = tmp_path / f"shard{n}.sarif"
        result = invoke("ci", "--max-time", budget, "--presets", "default", "--fuzzer", "random", "--seed", str(n),
                        "--regressions", str(regressions), "--db", redis_server.url, "--campaign", "nightly",
                        "--out", str(tmp_path / f"out{n}"), "--sarif", str(out))
        log = json.load(open(out))
        assert _errors(validator, log) == []
        return result, {r["partialFingerprints"][FINGERPRINT_KEY]: r for r in log["runs"][0]["results"]}

    _plant_lock_leak(monkeypatch)
    first, found = shard(1, "10")
    assert first.exit_code == 1 and found, first.output
    second, known = shard(2, "3")
    assert second.exit_code == 0, second.output  # triaged by the first shard: not this one's to fail
    assert f"{len(found)} known still open" in second.output, second.output
    assert set(known) == set(found) and all(r["baselineState"] == "unchanged" for r in known.values())


# ----------------------------------------------------------------------------- JUnit

def _suite(xml: str) -> ET.Element:
    root = ET.fromstring(xml)
    assert root.tag == "testsuites"
    (suite,) = root.findall("testsuite")
    for key in ("tests", "failures", "errors"):
        assert root.get(key) == suite.get(key)
    assert suite.get("errors") == "0" and suite.get("skipped") == "0" and suite.get("time") is not None
    return suite


def test_junit_one_testcase_per_distinct_signature():
    config, findings = _load(os.path.join(ROOT, "corpora", "regressions", "chunked-abort-ignored.json"))
    a, b = findings[:2]
    assert a.signature != b.signature
    again = dataclasses.replace(a, slots=[7, 8], num_units=2, op_index=a.op_index + 1)
    assert again.signature == a.signature
    suite = _suite(to_junit([a, b, again], config, suite_name="kvaudit-chunked", clean_case="clean"))
    assert suite.get("name") == "kvaudit-chunked"
    assert (suite.get("tests"), suite.get("failures")) == ("2", "2")
    cases = suite.findall("testcase")
    assert [c.get("name") for c in cases] == [a.signature, b.signature]
    assert [c.get("classname") for c in cases] == [f"kvaudit.{a.kind}", f"kvaudit.{b.kind}"]
    first = cases[0].find("failure")
    assert first.get("type") == a.kind and first.get("message") == a.summary()
    assert "2 times" in first.text and "2 times" not in cases[1].find("failure").text
    s = a.alloc_sites[0]
    assert f"{s.file}:{s.line} in {s.function}" in first.text
    assert a.engine_check[0] in first.text
    props = {p.get("name"): p.get("value") for p in suite.find("properties")}
    assert props["preset"] == config.preset and props["bugs"] == ",".join(sorted(config.bugs))


def test_junit_sarif_and_the_pytest_fixture_word_the_lifecycle_and_the_engine_check_as_the_console_does():
    """The JUnit text (which the pytest fixture shows) said 'op 3 step 2: owned by -' where the console said
    'req:... no longer holds it; no owner since', and left out 'never freed'; a failing engine check was
    numbers only, failing by colour alone."""
    from kvaudit.reports.junit import failure_text
    from kvaudit.reports.report import lifecycle_table

    config, findings = _load(os.path.join(ROOT, "corpora", "regressions", "retract-unaligned-page.json"))
    f = findings[0]
    table = lifecycle_table(f, plain=True)
    console = [(op, step, event.plain) for op, step, event in zip(*(c.cells for c in table.columns))]
    events = [line.strip() for line in failure_text(f).split("lifecycle of the first unit:\n", 1)[1].splitlines()
              if line.startswith("    ")]
    assert events == [f"op {op} step {step}: {e}" if op else e for op, step, e in console]
    assert any(re.fullmatch(r"op \d+ step \d+: req:\S+ no longer holds it; no owner since", e) for e in events)
    assert events[-1].startswith("never freed; last owner: req:") and not any("owned by -" in e for e in events)
    assert to_sarif([f], config)["runs"][0]["results"][0]["properties"]["lifecycle"] == events
    assert f"engine check_memory(): FAILED: {f.engine_check[0]}" in failure_text(f)
    assert " != total=" in f.engine_check[0]


def test_junit_properties_spell_a_config_value_as_json():
    """The suite's properties read ``False`` and (a list's) ``None`` as Python spells them, and a None as an
    empty string; every other message spells values as JSON."""
    from kvaudit.targets import registry

    config = registry.get("eut").preset("default").config()
    props = {p.get("name"): p.get("value") for p in _suite(to_junit([], config)).find("properties")}
    d = config.to_dict()
    assert d["enable_overlap"] is False and d["chunked_prefill_size"] is None
    assert (props["enable_overlap"], props["chunked_prefill_size"]) == ("false", "null")
    assert props["preset"] == "default" and props["bugs"] == ""  # strings as they are
    assert all(props[k] == json.dumps(v) for k, v in d.items() if not isinstance(v, str) and k != "bugs")


def test_junit_clean_run():
    suite = _suite(to_junit([], clean_case="kvaudit fuzz (overlap)"))
    (case,) = suite.findall("testcase")
    assert case.get("name") == "kvaudit fuzz (overlap)"
    assert case.find("failure") is None and case.find("error") is None
    assert (suite.get("tests"), suite.get("failures")) == ("1", "0")
    assert _suite(to_junit([])).findall("testcase") == []


def test_junit_cases_take_the_runs_seconds_and_a_finding_the_seconds_to_its_hit():
    """Every case said time="0"; kvaudit fuzz --junit now gives the run's seconds, and a finding's case the
    seconds the search took to hit it (the report's first_hit_seconds)."""
    from kvaudit.reports.outputs import ReportData, _junit

    config, findings = _load(os.path.join(ROOT, "corpora", "regressions", "chunked-abort-ignored.json"))
    assert _suite(to_junit([], clean_case="clean", seconds=7.25)).find("testcase").get("time") == "7.25"
    times = [c.get("time") for c in _suite(to_junit(findings[:2], seconds=7.25, found_after=1.5)).findall("testcase")]
    assert times == ["1.50", "1.50"]
    data = ReportData.single(config, [], findings[:1], {}, {"seconds": 9.0, "first_hit_seconds": 3.4})
    assert _suite(_junit(data)).find("testcase").get("time") == "3.40"
    data = ReportData.single(config, [], [], {}, {"seconds": 9.0})
    assert _suite(_junit(data)).find("testcase").get("time") == "9.00"
    # the suite and the file say the run's seconds too (they said time="0")
    root = ET.fromstring(to_junit([], clean_case="clean", seconds=7.25))
    assert root.get("time") == "7.25" and root.find("testsuite").get("time") == "7.25"


def test_junit_strips_characters_xml_cannot_carry():
    f = Finding(kind="crash", pool="-", message="ValueError: bad \x01byte\x0b <&> \"q\" \ud800end",
                alloc_sites=[Site("engine_under_test/scheduler.py", 264, "step")], op_index=0, step=0,
                traceback="Traceback\x00 (most recent call last)\n")
    xml = to_junit([f])
    suite = _suite(xml)
    failure = suite.find("testcase/failure")
    assert failure.get("message") == "Engine crash: ValueError: bad byte <&> \"q\" end"
    assert "bad byte <&>" in failure.text and "Traceback (most recent call last)" in failure.text
    assert not re.search("[\x00-\x08\x0b\x0c\x0e-\x1f]", failure.text)
    xml.encode("utf-8")  # no lone surrogate left


def test_junit_and_sarif_say_what_the_target_says_of_a_use_after_frees_free():
    """A use-after-free whose signature ends with what the target says of its free (``/unlocked``:
    Target.freed_by) says it in JUnit's failure text and SARIF's properties too, as the console does; both
    left it out before (tg65)."""
    f = Finding(kind="use-after-free", pool="token_to_kv_pool", message="referenced by a live owner but free",
                slots=[1, 2], num_units=2, lost_by="unlocked",
                alloc_sites=[Site("engine_under_test/scheduler.py", 286, "alloc_for_extend")],
                free_sites=[Site("engine_under_test/radix_cache.py", 223, "release")])
    assert f.signature.endswith("/release@radix_cache.py/unlocked"), f.signature
    failure = ET.fromstring(to_junit([f])).find(".//failure").text
    assert "what the target says of that free: unlocked" in failure, failure
    assert to_sarif([f])["runs"][0]["results"][0]["properties"]["freed_by"] == "unlocked"
    plain = dataclasses.replace(f, lost_by="")
    assert "what the target says" not in ET.fromstring(to_junit([plain])).find(".//failure").text
    assert "freed_by" not in to_sarif([plain])["runs"][0]["results"][0]["properties"]


# Jenkins' JUnit schema (junit-10.xsd, quoted in pytest's record_xml_attribute docs): a testcase's children in order
JUNIT_CASE_ORDER = ("skipped", "error", "failure", "system-out", "system-err")


def test_ci_junit_cases_keep_the_schemas_child_order():
    """kvaudit ci's case of a preset interrupted (or that searched nothing) put its <system-out> (the reach lines,
    'interrupted before its budget was spent') before its <skipped>: Jenkins' schema takes a testcase's children
    as skipped, error, failure, system-out, system-err, in that order, and refused the file."""
    from kvaudit.search import ci

    runs = [ci.FuzzRun("default", 1.0, 40, interrupted=True, reached={"aborts": 3, "retractions": 0}),
            ci.FuzzRun("chunked", 1.0, 0, reached={"aborts": 0}),
            ci.FuzzRun("retract", 1.0, 0, interrupted=True, known_open=[]),
            ci.FuzzRun("paged", 1.0, 9, reached={"aborts": 1})]
    root = ET.fromstring(ci.junit(ci.CiResult(fuzz=runs, interrupted=True)))
    cases = list(root.iter("testcase"))
    assert {c.get("name") for c in cases if c.find("skipped") is not None and c.find("system-out") is not None} == {
        "default: interrupted", "chunked: nothing searched", "retract: interrupted"}  # (a skipped case with lines)
    for case in cases:
        tags = [child.tag for child in case]
        assert tags == sorted(tags, key=JUNIT_CASE_ORDER.index), (case.get("name"), tags)
