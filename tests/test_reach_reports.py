"""A clean run's report files say what its programs reached, as its console does.

`kvaudit fuzz --preset retract --junit/--sarif/--html/--json` printed `reached: aborts=..., oom_retractions=0, ...`
and `not reached: oom_retractions (...: not searched)` on the console, but none of the four files said it: a CI
job that reads only the JUnit or the SARIF saw a clean run with nothing about the paths it never took. Now the
JSON and the SARIF's run properties keep ``reached`` (path -> count), the JUnit's clean case carries the console's
lines in ``<system-out>``, and the HTML's header says them; for ``kvaudit ci``, per preset."""

import json
import xml.etree.ElementTree as ET
from dataclasses import dataclass

import rowtoy_plugin  # (registers the kind "rowtoy" in this process)
from cli_helpers import invoke

from kvaudit.config import Preset
from kvaudit.targets import registry


def _files(tmp_path) -> list[str]:
    return ["--junit", str(tmp_path / "r.xml"), "--sarif", str(tmp_path / "r.sarif"), "--html", str(tmp_path / "r.html"),
            "--json", str(tmp_path / "r.json")]


def _console_lines(output: str) -> list[str]:
    """The console's ``reached:`` and ``not reached:`` lines, the latter as the files shorten it."""
    out = []
    for line in output.splitlines():
        if line.startswith("reached: "):
            out.append(line)
        elif line.startswith("not reached: "):
            out.append(line.split(" (")[0] + " (not searched)")
    return out


def test_a_clean_fuzz_runs_report_files_say_what_it_reached(tmp_path):
    r = invoke("fuzz", "--preset", "retract", "--fuzzer", "random", "--max-time", "2", "--out", str(tmp_path / "o"),
               *_files(tmp_path))
    assert r.exit_code == 0, r.output + r.stderr
    lines = _console_lines(r.output)
    assert lines and lines[0].startswith("reached: ") and "oom_retractions=" in lines[0], r.output
    reached = json.load(open(tmp_path / "r.json"))["reached"]
    assert lines[0] == "reached: " + ", ".join(f"{k}={v}" for k, v in sorted(reached.items()))
    assert json.load(open(tmp_path / "r.sarif"))["runs"][0]["properties"]["reached"] == reached
    (case,) = ET.parse(tmp_path / "r.xml").getroot().iter("testcase")
    assert case.find("failure") is None and case.find("system-out").text.splitlines() == lines
    assert "reached: " + "; ".join(lines).removeprefix("reached: ") in (tmp_path / "r.html").read_text()


def test_a_clean_campaigns_report_files_say_what_it_reached(tmp_path):
    r = invoke("fuzz", "--preset", "retract", "--fuzzer", "random", "--max-time", "2", "--corpus", str(tmp_path / "c"),
               *_files(tmp_path))
    assert r.exit_code == 0, r.output + r.stderr
    lines = _console_lines(r.output)
    assert lines, r.output
    reached = json.load(open(tmp_path / "r.json"))["reached"]
    assert json.load(open(tmp_path / "r.sarif"))["runs"][0]["properties"]["reached"] == reached
    (case,) = ET.parse(tmp_path / "r.xml").getroot().iter("testcase")
    assert case.find("system-out").text.splitlines() == lines


def test_a_clean_ci_jobs_report_files_say_what_each_preset_reached(tmp_path):
    r = invoke("ci", "--presets", "default,retract", "--fuzzer", "random", "--max-time", "2", "--regressions",
               str(tmp_path), "--out", str(tmp_path / "o"), *_files(tmp_path))
    assert r.exit_code == 0, r.output + r.stderr
    reached = json.load(open(tmp_path / "r.json"))["reached"]
    assert set(reached) == {"default", "retract"} and "oom_retractions" in reached["retract"]
    assert json.load(open(tmp_path / "r.sarif"))["runs"][0]["properties"]["reached"] == reached
    cases = {c.get("classname"): c for c in ET.parse(tmp_path / "r.xml").getroot().iter("testcase")}
    for preset, counts in reached.items():
        line = next(x for x in r.stderr.splitlines() if x.startswith(f"fuzz {preset}: "))  # the console's
        assert "reached: " + ", ".join(f"{k}={v}" for k, v in counts.items()) in line
        out = cases[f"kvaudit.fuzz.{preset}"].find("system-out").text.splitlines()
        assert out[0] == "reached: " + ", ".join(f"{k}={v}" for k, v in counts.items())
    html = (tmp_path / "r.html").read_text()
    assert all(f"{preset}: " + ", ".join(f"{k}={v}" for k, v in c.items()) in html for preset, c in reached.items())


@dataclass(frozen=True)
class _BracketConfig(rowtoy_plugin.RowToyConfig):
    preset: str = "brackets"


class _BracketReach(rowtoy_plugin.RowToyTarget):
    """rowtoy's target counting paths whose names hold square brackets (any string names a path)."""

    def reach(self):
        return {"evict[lru]": self.steps, "hits[/]": 0, "tier[bold]": 1}


def test_the_consoles_reach_lines_keep_a_paths_name_as_the_report_files_do(tmp_path):
    """The console printed the reach lines as rich markup: a plugin's path named ``evict[lru]`` was printed
    ``evict=...`` (``[lru]`` taken for a style, ``[/]`` for a closing tag), while the JUnit, SARIF and JSON kept
    the name: the console and the report files, said to carry the same lines, named different paths."""
    registry.register(registry.TargetKind(
        "brackets", "rowtoy's engine counting paths named with brackets", _BracketConfig,
        presets=lambda: {"brackets": Preset("brackets", "brackets", {}, _BracketConfig)}, make=_BracketReach,
        default_preset="brackets"))
    (tmp_path / "regs").mkdir()
    try:
        fuzz = invoke("fuzz", "--target", "brackets", "--fuzzer", "random", "--max-time", "1", "--out",
                      str(tmp_path / "o"), *_files(tmp_path))
        ci = invoke("ci", "--target", "brackets", "--presets", "brackets", "--fuzzer", "random", "--max-time", "1",
                    "--regressions", str(tmp_path / "regs"), "--out", str(tmp_path / "o"), "--junit",
                    str(tmp_path / "ci.xml"))
    finally:
        registry._KINDS.pop("brackets")
    assert fuzz.exit_code == 0, fuzz.output + fuzz.stderr
    lines = _console_lines(fuzz.output)
    assert lines[0].startswith("reached: evict[lru]=") and lines[1] == "not reached: hits[/] (not searched)", lines
    (case,) = ET.parse(tmp_path / "r.xml").getroot().iter("testcase")
    assert case.find("system-out").text.splitlines() == lines
    assert ci.exit_code == 0, ci.output + ci.stderr
    line = next(x for x in ci.stderr.splitlines() if x.startswith("fuzz brackets: "))
    out = next(ET.parse(tmp_path / "ci.xml").getroot().iter("system-out")).text.splitlines()
    assert f"; {out[0]}; {out[1]}" in line, line


def test_an_interrupted_fuzz_runs_junit_says_what_it_reached(tmp_path, monkeypatch):
    """Interrupted, `kvaudit fuzz` printed its reach lines and its JSON and SARIF kept them, but its JUnit's
    skipped case had none (the lines went with the clean case only), where ci's interrupted preset case has them:
    the skipped case carries the console's lines in its <system-out>, after <skipped>."""
    from kvaudit.search import fuzz

    run, calls = fuzz.run_program, []

    def stopped_after_20(*a, **k):
        calls.append(1)
        if len(calls) > 20:
            raise KeyboardInterrupt
        return run(*a, **k)

    monkeypatch.setattr(fuzz, "run_program", stopped_after_20)
    r = invoke("fuzz", "--preset", "retract", "--fuzzer", "random", "--max-time", "30", "--out", str(tmp_path / "o"),
               *_files(tmp_path))
    assert r.exit_code == 130, r.output + r.stderr
    lines = _console_lines(r.output)
    assert lines and lines[0].startswith("reached: "), r.output
    (case,) = ET.parse(tmp_path / "r.xml").getroot().iter("testcase")
    assert [child.tag for child in case] == ["skipped", "system-out"]
    assert case.find("system-out").text.splitlines() == lines


def _ci_json(tmp_path, budget: str = "1") -> str:
    """The --json of `ci --presets default,retract` (random, ``budget`` seconds; with 0, the shipped regressions
    replayed only): its path."""
    import os

    regressions = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "corpora", "regressions")
    r = invoke("ci", "--presets", "default,retract", "--fuzzer", "random", "--max-time", budget, "--regressions",
               str(tmp_path) if budget != "0" else regressions, "--out", str(tmp_path / "o"),
               "--json", str(tmp_path / "ci.json"))
    assert r.exit_code == 0, r.output + r.stderr
    return str(tmp_path / "ci.json")


def test_report_of_a_ci_jobs_json_names_its_presets_in_the_clean_junit_case(tmp_path):
    """Tester 66: `kvaudit report` of a `ci --presets default,retract --json` named its one clean JUnit case
    'kvaudit default: no findings' (the first preset's config), where the job ran both; a job that replayed its
    regressions only (--max-time 0) named no preset it ran. Named as the HTML's header names them now."""
    for budget, name in (("1", "kvaudit default, retract: no findings"), ("0", "kvaudit ci: no findings")):
        _ci_json(tmp_path, budget)
        r = invoke("report", str(tmp_path / "ci.json"), "--junit", str(tmp_path / "again.xml"))
        assert r.exit_code == 0, r.output + r.stderr
        names = [c.get("name") for c in ET.parse(tmp_path / "again.xml").getroot().iter("testcase")]
        assert names == [name]
    r = invoke("fuzz", "--preset", "retract", "--fuzzer", "random", "--max-time", "0.5", "--out", str(tmp_path / "o"),
               "--json", str(tmp_path / "fuzz.json"))
    assert r.exit_code == 0, r.output + r.stderr
    r = invoke("report", str(tmp_path / "fuzz.json"), "--junit", str(tmp_path / "again.xml"))
    assert [c.get("name") for c in ET.parse(tmp_path / "again.xml").getroot().iter("testcase")] == [
        "kvaudit retract: no findings"]


def test_report_of_a_ci_jobs_json_names_every_preset_in_the_junit_properties(tmp_path):
    """`kvaudit report --junit` of a `ci --presets default,retract --json` named the first preset alone in its
    suite's properties (preset=default, and default's config fields: num_slots, enable_*, ...) where the job ran
    both: one ``presets`` property names them all now, in run order, and no preset's fields stand for the job's;
    a ci job that fuzzed none (--max-time 0) names none; a fuzz run's keeps its preset and config."""
    def properties(report: str) -> dict[str, str]:
        r = invoke("report", report, "--junit", str(tmp_path / "again.xml"))
        assert r.exit_code == 0, r.output + r.stderr
        return {p.get("name"): p.get("value") for p in ET.parse(tmp_path / "again.xml").getroot().iter("property")}

    for budget, presets in (("1", "default,retract"), ("0", "")):
        _ci_json(tmp_path, budget)
        assert properties(str(tmp_path / "ci.json")) == {"presets": presets}
    r = invoke("fuzz", "--preset", "retract", "--fuzzer", "random", "--max-time", "0.5", "--out", str(tmp_path / "o"),
               "--json", str(tmp_path / "fuzz.json"))
    assert r.exit_code == 0, r.output + r.stderr
    props = properties(str(tmp_path / "fuzz.json"))
    assert props["preset"] == "retract" and "presets" not in props and "num_slots" in props


def test_report_of_a_ci_jobs_json_names_every_preset_in_the_sarif_run_properties(tmp_path):
    """`kvaudit report --sarif` of a `ci --presets default,retract --json` gave the run the first preset's
    properties (preset default, its bugs, model, page_size and engineConfig) where ci's own SARIF names the job's
    presets: ``presets`` lists every preset fuzzed, and no one preset's config stands for the job's."""
    r = invoke("report", _ci_json(tmp_path), "--sarif", str(tmp_path / "again.sarif"))
    assert r.exit_code == 0, r.output + r.stderr
    props = json.loads((tmp_path / "again.sarif").read_text())["runs"][0]["properties"]
    assert props["presets"] == ["default", "retract"], props
    assert not {"preset", "engineConfig", "bugs", "model", "page_size"} & set(props), props


def test_report_of_a_clean_runs_json_prints_what_it_reached_as_its_junit_says_it(tmp_path):
    """tz69: `kvaudit report` of a clean `fuzz --json` (or a `ci --json`) printed the summary and `SUMMARY: kvaudit:
    no findings.` with no `reached:` line, though the JUnit it wrote from the same file carried the lines (and the
    run's own console had printed them): a clean run re-read said nothing of what it searched. It prints the
    JUnit's lines now, before the closing `SUMMARY:` line."""
    r = invoke("fuzz", "--preset", "retract", "--fuzzer", "random", "--max-time", "1", "--out", str(tmp_path / "o"),
               "--json", str(tmp_path / "o" / "fuzz.json"))  # (not in tmp_path: _ci_json's regressions folder)
    assert r.exit_code == 0, r.output + r.stderr
    for report in (str(tmp_path / "o" / "fuzz.json"), _ci_json(tmp_path)):
        r = invoke("report", report, "--junit", str(tmp_path / "again.xml"))
        assert r.exit_code == 0, r.output + r.stderr
        junit = [line for case in ET.parse(tmp_path / "again.xml").getroot().iter("testcase")
                 for line in (case.find("system-out").text or "").splitlines()]
        assert junit and "reached: " in junit[0], junit
        printed = [line for line in r.output.splitlines() if "reached: " in line]
        assert printed == junit, r.output
        out = r.output.splitlines()
        assert out.index(printed[-1]) < max(i for i, line in enumerate(out) if line.startswith("SUMMARY: "))
