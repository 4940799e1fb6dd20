"""Tests for the ``kvaudit`` command line: click's CliRunner for most cases, the installed console
script (a real subprocess) where the process boundary matters (exit status through a pipe, no ANSI)."""

import re
import glob
import json
import shlex
import shutil
import os
import subprocess
import sys

import pytest
from cli_helpers import ROOT, invoke, kvaudit_script, one_error_line, plain_env

from engine_under_test import BUGS

from kvaudit.targets.eut.presets import PRESETS
from kvaudit.replay import FORMAT

BUG = "hisparse-prebuilt-skip-finish"
FUZZ_BUG = ["fuzz", "--preset", "pd-decode-hisparse", "--bug", BUG, "--max-time", "60", "--seed", "1"]


def replay_files(directory):
    return sorted(p for p in os.listdir(directory) if p.endswith(".json"))


# -- fuzz finds the zoo bug ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fuzz_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("fuzz-out")
    result = invoke(*FUZZ_BUG, "--out", str(out))
    return result, out


@pytest.fixture(scope="module")
def replay_doc(fuzz_run):
    result, out = fuzz_run
    files = replay_files(out)
    assert len(files) == 1, (files, result.output)
    path = out / files[0]
    return path, json.loads(path.read_text())


@pytest.mark.slow
def test_fuzz_with_the_zoo_bug_exits_1_and_writes_one_replay_file(fuzz_run):
    result, out = fuzz_run
    assert result.exit_code == 1, result.output
    # Hypothesis's home (its constants cache) lives under --out by design; nothing else but the replay
    assert sorted(set(os.listdir(out)) - {".hypothesis"}) == replay_files(out), "no temporary files left behind"
    assert len(replay_files(out)) == 1
    assert "replay file:" in result.stdout


@pytest.mark.slow
def test_replay_file_has_the_documented_shape(replay_doc):
    path, doc = replay_doc
    assert {"format", "config", "program", "findings"} <= set(doc)
    assert doc["format"] == FORMAT
    assert doc["config"]["preset"] == "pd-decode-hisparse"
    assert doc["config"]["bugs"] == [BUG]
    assert doc["findings"], "a replay file of a finding lists it"
    for f in doc["findings"]:
        assert {"kind", "pool", "signature", "alloc_sites"} <= set(f)
        assert isinstance(f["signature"], str) and f["signature"].startswith(f"{f['kind']}/{f['pool']}/")
        assert f["alloc_sites"], f
        for site in f["alloc_sites"]:
            assert isinstance(site["file"], str) and isinstance(site["line"], int) and site["line"] > 0
            assert isinstance(site["function"], str) and site["function"]


@pytest.mark.slow
def test_primary_finding_is_the_hisparse_leak_with_a_tiny_health_check_program(replay_doc):
    path, doc = replay_doc
    primary = doc["findings"][0]
    assert primary["kind"] == "leak"
    assert primary["pool"] in ("hisparse_device", "hisparse_host")
    assert primary["alloc_sites"][0]["file"].endswith(os.path.join("engine_under_test", "hisparse.py"))
    program = doc["program"]
    assert 1 <= len(program) <= 4
    assert {"op": "health_check"} in program
    assert path.name.startswith("leak_hisparse_")


@pytest.mark.slow
def test_fuzz_report_names_the_signature(fuzz_run, replay_doc):
    result, _ = fuzz_run
    _, doc = replay_doc
    assert doc["findings"][0]["signature"] in result.stdout
    assert "minimized" in result.stdout


@pytest.mark.slow
def test_replay_reproduces_the_recorded_signature(replay_doc):
    path, doc = replay_doc
    result = invoke("replay", str(path))
    assert result.exit_code == 1, result.output
    assert doc["findings"][0]["signature"] in result.stdout
    assert "reproduced: yes" in result.stdout


@pytest.mark.slow
def test_replay_prints_the_messages_fuzz_printed(tmp_path):
    # (tester 61a A9: a process-wide radix node counter made fuzz say "host pin on node 986" and replay "node 3";
    # here replay runs in the same process after fuzz, as its counter would have run on)
    r = invoke("fuzz", "--preset", "hicache", "--bug", "hicache-abort-loadback-leak", "--seed", "1", "--max-time",
               "60", "--out", str(tmp_path))
    assert r.exit_code == 1, r.output
    (path,) = replay_files(tmp_path)
    again = invoke("replay", str(tmp_path / path))
    assert again.exit_code == 1, again.output

    def errors(out):
        return [line for line in out.splitlines() if line.startswith("==ERROR:")]
    assert errors(r.stdout) and errors(again.stdout) == errors(r.stdout)
    assert "node" in errors(r.stdout)[0]


@pytest.mark.slow
def test_replay_with_the_bug_switched_off_is_clean(replay_doc, tmp_path):
    _, doc = replay_doc
    doc = dict(doc, config=dict(doc["config"], bugs=[]))
    path = tmp_path / "fixed.json"
    path.write_text(json.dumps(doc))
    result = invoke("replay", str(path))
    assert result.exit_code == 0, result.output
    assert doc["findings"][0]["signature"] not in result.stdout.split("recorded signature")[0]
    assert "reproduced: no" in result.stdout


@pytest.mark.slow
def test_fuzz_without_a_bug_exits_0_and_writes_nothing(tmp_path):
    out = tmp_path / "out"
    result = invoke("fuzz", "--preset", "pd-decode-hisparse", "--max-time", "3", "--seed", "1", "--out", str(out))
    assert result.exit_code == 0, result.output
    assert "no findings" in result.stdout
    assert not out.exists() or replay_files(out) == []


@pytest.mark.slow
def test_fuzz_through_a_pipe_has_no_ansi_codes_and_keeps_exit_status(tmp_path):
    cmd = shlex.join([kvaudit_script(), *FUZZ_BUG, "--out", str(tmp_path / "out")])
    proc = subprocess.run(["bash", "-c", f"set -o pipefail; {cmd} | cat"], capture_output=True, text=True,
                          env=plain_env(), timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "\x1b[" not in proc.stdout
    assert "\x1b[" not in proc.stderr
    assert "signature: leak/hisparse_" in proc.stdout
    assert len(replay_files(tmp_path / "out")) == 1


# -- input errors: exit 2, one line on stderr ------------------------------------------------------

def test_unknown_preset_is_one_line_naming_the_valid_presets():
    result = invoke("fuzz", "--preset", "nope", "--max-time", "1")
    assert result.exit_code == 2
    line = one_error_line(result)
    assert "nope" in line
    for name in PRESETS:
        assert name in line
    assert result.stdout == ""


@pytest.mark.slow
def test_unknown_preset_through_the_installed_script():
    proc = subprocess.run([kvaudit_script(), "fuzz", "--preset", "nope"], capture_output=True, text=True,
                          env=plain_env(), timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "valid presets" in lines[0] and "pd-decode-hisparse" in lines[0]
    assert proc.stdout == ""


def test_unknown_bug_is_one_line_naming_the_valid_bugs():
    result = invoke("fuzz", "--bug", "nope", "--max-time", "1")
    assert result.exit_code == 2
    line = one_error_line(result)
    assert "nope" in line and BUG in line


def test_bad_page_size_for_the_preset_is_a_usage_error():
    result = invoke("fuzz", "--preset", "pd-decode-hisparse", "--page-size", "3", "--max-time", "1")
    assert result.exit_code == 2
    assert "page_size" in one_error_line(result)


def test_page_size_s_range_in_help_is_the_engine_s():
    """--help showed [x>=1], and 512 was 'bad configuration: page_size must be in [1, 256]'."""
    from engine_under_test.config import _INT_RANGES

    lo, hi = _INT_RANGES["page_size"]
    assert f"[{lo}<=x<={hi}]" in invoke("fuzz", "--help").stdout
    result = invoke("fuzz", "--page-size", str(hi + 1), "--max-time", "1")
    assert result.exit_code == 2 and f"{hi + 1} is not in the range {lo}<=x<={hi}" in one_error_line(result)


def test_page_size_for_a_kind_without_one_is_a_usage_error_not_a_crash():
    """vLLM's config has a block size, no page_size field: the flag was an internal error (exit 70)."""
    result = invoke("fuzz", "--target", "vllm", "--page-size", "8", "--max-time", "1")
    assert result.exit_code == 2, result.output
    assert "--page-size does not apply to --target vllm" in one_error_line(result)


def test_device_for_a_kind_that_computes_no_kv_is_a_usage_error(monkeypatch):
    """On a machine with a GPU, --device cuda was dropped without a word for --target vllm."""
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as if a CUDA device were here
    result = invoke("fuzz", "--target", "vllm", "--device", "cuda", "--max-time", "1")
    assert result.exit_code == 2, result.output
    assert "--device cuda does not apply to --target vllm" in one_error_line(result)


@pytest.mark.parametrize("args", [
    ["fuzz", "--frob"],
    ["--frob"],
    ["replay"],
    ["fuzz", "--max-time", "0"],
    ["fuzz", "--max-time", "soon"],
    ["fuzz", "--page-size", "0"],
    ["fuzz", "--model", "huge"],
    ["frobnicate"],
], ids=["fuzz-flag", "group-flag", "replay-no-file", "zero-time", "text-time", "zero-page", "bad-model", "no-command"])
def test_usage_errors_exit_2_with_one_line(args):
    result = invoke(*args)
    assert result.exit_code == 2, result.output
    one_error_line(result)


def _value_options():
    """(command path, option) for every option of every command that takes a value (a flag, or an option
    whose value may be left out, takes none)."""
    import click

    from kvaudit.cli import main

    out = []

    def walk(cmd, path):
        for p in cmd.params:
            if isinstance(p, click.Option) and not (p.is_flag or p.count or p._flag_needs_value):
                out.append((path, max(p.opts, key=len)))
        for name, sub in sorted(getattr(cmd, "commands", {}).items()):
            walk(sub, (*path, name))

    walk(main, ())
    return out


@pytest.mark.parametrize("path, option", _value_options(), ids=lambda v: " ".join(v) if isinstance(v, tuple) else v)
def test_an_option_with_no_value_names_the_commands_help_as_other_usage_errors_do(path, option):
    """`kvaudit fuzz --max-time` (nothing after it): click's parser raises it with no context, so the line
    lacked the (see '... --help') suffix that every other usage error has (tester)."""
    r = invoke(*path, option)
    assert r.exit_code == 2, r.output
    line = one_error_line(r)
    assert f"Option '{option}' requires an argument." in line, line
    assert line.endswith(f" {' '.join(path)} --help')"), line
    other = invoke(*path, "--frob")  # (the suffix every other usage error has)
    assert one_error_line(other).endswith(f" {' '.join(path)} --help')")


def test_a_one_value_option_given_twice_says_only_the_last_counts(tmp_path):
    """`kvaudit report F --json a.json --json b.json` wrote b.json alone and said nothing of a.json (click
    keeps an option's last value); a line of warning now says so, once through the console script (whose
    entry point parses the command line a first time, to refuse bad input before it imports the engine)."""
    good = os.path.join(REGRESSIONS, "overlap-abort-double-free.json")
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    r = invoke("report", good, "--json", str(a), "--json", str(b))
    assert r.exit_code == 0, r.output
    assert "warning: --json given 2 times; only the last one counts" in r.stderr.splitlines(), r.stderr
    assert b.exists() and not a.exists()
    once = invoke("report", good, "--json", str(a), "--sarif", str(tmp_path / "s.sarif"))
    assert once.exit_code == 0 and "warning" not in once.stderr, once.stderr
    both = invoke("report", good, "--json", str(a), "--json", str(b), "--sarif", str(tmp_path / "1"),
                  "--sarif", str(tmp_path / "2"), "--sarif", str(tmp_path / "3"))
    assert [line for line in both.stderr.splitlines() if line.startswith("warning: ")] == [
        "warning: --json given 2 times; only the last one counts",
        "warning: --sarif given 3 times; only the last one counts"], both.stderr
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, "-m", "kvaudit", "minimize", good, "-o", str(tmp_path / "m.json"),
                           "--output", str(tmp_path / "n.json"), "--signature", "nope"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines()[0] == "warning: -o/--output given 2 times; only the last one counts", proc.stderr
    assert proc.stderr.count("warning: ") == 1, proc.stderr


def _write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


@pytest.mark.parametrize("content, why", [
    ('{"a": 1}', "not a kvaudit replay file"),
    ("[1, 2, 3]", "not a kvaudit replay file"),
    ('"kvaudit.replay/1"', "not a kvaudit replay file"),
    ('{"format": "kvaudit.replay/0", "config": {}, "program": []}',
     'replay format "kvaudit.replay/0" is not supported by this kvaudit (it reads "kvaudit.replay/1")'),
    ('{"format": "kvaudit.replay/9", "config": {}, "program": []}',
     'replay format "kvaudit.replay/9" is not supported by this kvaudit (it reads "kvaudit.replay/1")'),
    ("this is not json\n", "not JSON"),
    ("", "not JSON: the file is empty"),
    ("  \n", "not JSON: the file is empty"),
    # (tg63: a file cut short by a copy, a disk or an editor: say so, beside the line)
    ('{"format": "kvaudit.replay/1", "config": {"seed": 0},\n "program": [{"op": "idle"}, {"op": "st',
     "not JSON: Unterminated string starting at: line 2 column 37 (char 90) (the file ends there: cut short?)"),
    ('{"format": "kvaudit.replay/1", "config": {"seed": 0},\n "program": [{"op": "idle"}, \n',
     "not JSON: Expecting value: line 3 column 1 (char 84) (the file ends there: cut short?)"),
    ('{"format": "kvaudit.replay/1", "program": []}', 'missing key "config"'),
    ('{"format": "kvaudit.replay/1", "config": {}}', 'missing key "program"'),
    ('{"format": "kvaudit.replay/1", "config": {"nope": 1}, "program": []}', "bad config"),
    ('{"format": "kvaudit.replay/1", "config": [], "program": []}', "bad config"),
    ('{"format": "kvaudit.replay/1", "config": {"bugs": ["nope"]}, "program": []}', 'bad config: unknown bug "nope"'),
    ('{"format": "kvaudit.replay/1", "config": {}, "program": [{"op": "fork"}]}', 'bad program: op #0: unknown op "fork"; valid ops: submit'),
    # (tg63: which op of a long program, as the report numbers them)
    ('{"format": "kvaudit.replay/1", "config": {}, "program": [{"op": "idle"}, {"op": "step", "n": 1}, '
     '{"op": "submit", "prompt_len": 99999}]}', 'bad program: op #2: argument "prompt_len" of op "submit" must be in'),
    ('{"format": "kvaudit.replay/1", "config": {}, "program": {"op": "idle"}}', "bad program"),
    # (tg63: a hand edit that adds "bugs": [] above the old line replayed the old bugs, the last one winning)
    ('{"format": "kvaudit.replay/1", "config": {"bugs": [], "seed": 0, "bugs": ["chunked-abort-ignored"]}, '
     '"program": []}', 'key "bugs" appears twice in one object'),
    ('{"format": "kvaudit.replay/1", "config": {}, "program": [{"op": "submit", "prompt_len": -3}]}',
     'argument "prompt_len" of op "submit" must be in [0, 10000], got -3'),
    ('{"format": "kvaudit.replay/1", "config": {}, "program": [{"op": "submit", "prompt_len": "x"}]}',
     'argument "prompt_len" of op "submit" must be an integer or null, got "x"'),
    ('{"format": "kvaudit.replay/1", "config": {}, "program": [], "findings": [{"kind": "leak"}]}', "bad findings"),
    ('{"format": "kvaudit.replay/1", "config": {}, "program": [], "findings": "x"}', "bad findings"),
    # (tg63: which of the findings holds the hand-added key)
    ('{"format": "kvaudit.replay/1", "config": {}, "program": [], "findings": [{"kind": "leak", "pool": "p", '
     '"message": "m"}, {"kind": "leak", "pool": "p", "message": "m", "note": "triaged"}]}',
     'bad findings: unknown field "note" (finding #1)'),
    # (tm63: a hand edit's "Findings" was another key, kept and never read: the recorded findings went unread)
    ('{"format": "kvaudit.replay/1", "config": {}, "program": [], "Findings": [{"kind": "leak", "pool": "p", '
     '"message": "m"}]}', 'key "Findings" is not one kvaudit reads: keys are lower case ("findings")'),
    ('{"format": "kvaudit.replay/1", "config": {}, "Program": []}',
     'key "Program" is not one kvaudit reads: keys are lower case ("program")'),
    # (tester 61a: Python's own hint, "use sys.set_int_max_str_digits() to increase the limit", was the message)
    ('{"format": "kvaudit.replay/1", "config": {"seed": ' + "9" * 5000 + '}, "program": []}',
     "not a kvaudit replay file (a number of more than 4300 digits)"),
], ids=["object", "list", "string", "old-format", "newer-format", "text", "empty", "blank", "truncated", "truncated-between", "no-config", "no-program", "config-key",
        "config-list", "config-bug", "unknown-op", "arg-range-at-op-2", "program-object", "duplicate-key", "arg-range", "arg-type", "finding-fields", "findings-string", "finding-field-at-1",
        "findings-case", "program-case", "huge-number"])
def test_replay_of_a_non_replay_file_exits_2_with_one_line(tmp_path, content, why):
    """A name the file holds is spelled as JSON spells it (it said ``unknown bug 'nope'``, ``missing key 'program'``)."""
    result = invoke("replay", _write(tmp_path, "in.json", content))
    assert result.exit_code == 2, result.output
    assert why in one_error_line(result)
    assert result.stdout == ""


@pytest.mark.parametrize("command", ["report", "replay", "export"])
def test_another_kvaudit_file_given_as_a_replay_file_is_named_for_what_it_is(tmp_path, command):
    """tr69: a bench report, a campaign's campaign.json or a corpus program was "not a kvaudit replay file (want
    "format": "kvaudit.replay/1")", not saying what it is, nor where the findings are. Named now, one line, exit 2.
    (The bench files are the committed ones `kvaudit bench` wrote; the campaign's formats are its writers'.)"""
    from kvaudit.program import FORMAT as PROGRAM_FORMAT
    from kvaudit.search.campaign import CAMPAIGN_FORMAT

    (tmp_path / "C" / "programs").mkdir(parents=True)
    record, program = tmp_path / "C" / "campaign.json", tmp_path / "C" / "programs" / "0c1b.json"
    record.write_text(json.dumps({"format": CAMPAIGN_FORMAT, "runs": []}))
    program.write_text(json.dumps({"format": PROGRAM_FORMAT, "program": [{"op": "idle"}]}))
    findings = tmp_path / "C" / "findings"
    for path, said in (
            (os.path.join(ROOT, "docs", "benchmarks.json"),
             "is a kvaudit bench report, not a replay file: it holds trial statistics, no program or finding; its "
             "Markdown (bench --out, benchmarks.md by default) is the one to read"),
            (os.path.join(ROOT, "docs", "benchmarks-history.json"),
             "is a kvaudit bench --suite history report, not a replay file: it holds trial statistics, no replay "
             "file; its Markdown (bench --out, benchmarks-history.md by default) is the one to read"),
            (str(record), f"is a campaign's run record, not a replay file: the campaign's findings are the replay "
                          f"files in {findings}"),
            (str(program), "is a campaign's corpus program (ops only: no config, no finding), not a replay file: the "
                           f"campaign's findings are the replay files in {findings}")):
        result = invoke(command, path, *(["--issue", str(tmp_path / "i.md")] if command == "export" else []))
        assert result.exit_code == 2, result.output
        assert one_error_line(result) == f"kvaudit: error: {path} {said}"


def test_a_replay_file_saved_with_a_byte_order_mark_or_crlf_line_ends_reads_as_written(tmp_path):
    """tg63: a replay file saved by a Windows editor (UTF-8 with a BOM, CRLF) was refused, ``is not JSON:
    Unexpected UTF-8 BOM (decode using utf-8-sig)``: the text is the same file's; JSON allows a reader to skip
    the mark. A non-ASCII text in it (a note) is read as UTF-8 whatever the locale."""
    text = open(os.path.join(REGRESSIONS, "overlap-abort-double-free.json"), encoding="utf-8").read()
    doc = json.loads(text)
    doc["note"] = "vérifié"
    path = tmp_path / "bom.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(doc, indent=2, ensure_ascii=False).replace("\n", "\r\n").encode())
    result = invoke("report", str(path))
    assert result.exit_code == 0, result.output
    from kvaudit import replay
    assert replay.load(str(path))[3]["note"] == "vérifié"


def test_replay_of_a_missing_file_exits_2(tmp_path):
    result = invoke("replay", str(tmp_path / "absent.json"))
    assert result.exit_code == 2
    assert "absent.json" in one_error_line(result)


def test_replay_of_a_directory_exits_2(tmp_path):
    result = invoke("replay", str(tmp_path))
    assert result.exit_code == 2
    one_error_line(result)


def test_replay_of_binary_exits_2(tmp_path):
    p = tmp_path / "bin.json"
    p.write_bytes(b"\xff\xfe\x00garbage")
    result = invoke("replay", str(p))
    assert result.exit_code == 2
    one_error_line(result)


def test_replay_with_an_unhashable_op_exits_2(tmp_path):
    doc = {"format": FORMAT, "config": {}, "program": [{"op": ["submit"]}]}
    result = invoke("replay", _write(tmp_path, "in.json", json.dumps(doc)))
    assert result.exit_code == 2, result.output
    one_error_line(result)


def test_replay_of_a_hand_written_clean_program_exits_0(tmp_path):
    doc = {"format": FORMAT, "config": {"preset": "default"},
           "program": [{"op": "submit", "prompt_len": 5, "max_new_tokens": 3}, {"op": "idle"}]}
    result = invoke("replay", _write(tmp_path, "in.json", json.dumps(doc)))
    assert result.exit_code == 0, result.output
    assert "none" in result.stdout


def test_replay_of_a_hand_written_leaking_program_exits_1(tmp_path):
    doc = {"format": FORMAT,
           "config": {"preset": "pd-decode-hisparse", "disaggregation_mode": "decode", "enable_hisparse": True,
                      "disable_radix_cache": True, "num_slots": 256, "bugs": [BUG]},
           "program": [{"op": "health_check"}, {"op": "idle"}]}
    result = invoke("replay", _write(tmp_path, "in.json", json.dumps(doc)))
    assert result.exit_code == 1, result.output
    assert "leak/hisparse_" in result.stdout


# -- listings --------------------------------------------------------------------------------------

def test_presets_lists_every_preset():
    result = invoke("presets", env={"COLUMNS": "200"})
    assert result.exit_code == 0
    for p in PRESETS.values():
        assert p.name in result.stdout
        assert p.description[:30] in result.stdout


def test_bugs_lists_every_bug_on_a_wide_console():
    result = invoke("bugs", env={"COLUMNS": "200"})
    assert result.exit_code == 0
    for b in BUGS.values():
        assert b.name in result.stdout
        assert b.source in result.stdout


def test_presets_names_survive_an_80_column_pipe():
    result = invoke("presets", env={"COLUMNS": "80"})
    assert result.exit_code == 0
    for name in PRESETS:
        assert name in result.stdout


def test_bug_names_survive_an_80_column_pipe():
    result = invoke("bugs", env={"COLUMNS": "80"})
    assert result.exit_code == 0
    for name in BUGS:
        assert name in result.stdout


def test_listings_off_a_terminal_are_plain_lines_and_take_a_target():
    """Piped, 'presets' and 'bugs' printed box-drawn tables, and could not be narrowed to one target."""
    import re

    from kvaudit.targets.sglang.config import FAULTS as SGLANG_FAULTS

    for command in ("presets", "bugs"):
        out = invoke(command, env={"COLUMNS": "80"}).stdout
        assert not re.search("[\u2500-\u257f]", out), out[:400]  # no box-drawing characters
    lines = invoke("presets", "--target", "eut").stdout.splitlines()
    assert lines[0] == "presets:" and len(lines) == 1 + len(PRESETS)
    assert all(ln.startswith(f"  {name}  ") for ln, name in zip(lines[1:], PRESETS))
    out = invoke("bugs", "--target", "sglang").stdout
    assert out.startswith("injected faults (--target sglang):") and all(f"  {n}  " in out for n in SGLANG_FAULTS)
    assert not any(b in out for b in BUGS)
    assert "finding: the first that `kvaudit fuzz" in invoke("bugs", "--target", "eut").stdout  # the caption
    bad = invoke("presets", "--target", "nope")
    assert bad.exit_code == 2 and 'unknown target "nope"' in one_error_line(bad)


def test_version_and_help_exit_0():
    assert invoke("--version").exit_code == 0
    result = invoke("--help")
    assert result.exit_code == 0
    for command in ("fuzz", "replay", "presets", "bugs"):
        assert command in result.stdout


@pytest.mark.slow
@pytest.mark.parametrize("budget", ["0.05", "0.13", "0.17", "0.25"])
def test_a_budget_that_ends_mid_shrink_is_not_an_internal_error(tmp_path, budget):
    # The deadline used to turn ops into no-ops while Hypothesis replayed a failing case,
    # which made the failure look flaky and crashed the CLI with exit 70.
    res = invoke("fuzz", "--preset", "pd-decode-hisparse", "--bug", "hisparse-prebuilt-skip-finish",
                 "--max-time", budget, "--out", str(tmp_path))
    assert res.exit_code in (0, 1), res.output


@pytest.mark.parametrize("change", [
    {"device": 5}, {"num_slots": 256.5}, {"num_slots": 10 ** 9}, {"num_slots": None},
    {"hisparse_host_ratio": -1}, {"hisparse_host_ratio": 0}, {"vocab_size": 2},
    {"hisparse_device_buffer_size": -16}, {"enable_hisparse": "yes"}, {"transfer_latency_steps": -1},
    {"pd_pre_alloc_rows": -1},
], ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_replay_with_a_corrupted_config_value_exits_2(tmp_path, change):
    doc = {"format": "kvaudit.replay/1", "config": {"preset": "pd-decode-hisparse", "disaggregation_mode": "decode",
                                                    "enable_hisparse": True, **change},
           "program": [{"op": "health_check"}, {"op": "idle"}]}
    result = invoke("replay", _write(tmp_path, "in.json", json.dumps(doc)))
    assert result.exit_code == 2, result.output
    assert "bad config" in one_error_line(result)


def test_replay_on_a_cuda_device_without_one_exits_2(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    doc = {"format": "kvaudit.replay/1", "config": {"device": "cuda"}, "program": [{"op": "idle"}]}
    result = invoke("replay", _write(tmp_path, "in.json", json.dumps(doc)))
    assert result.exit_code == 2
    assert "no CUDA device" in one_error_line(result)


@pytest.mark.parametrize("command", ["replay", "minimize", "report"])
def test_a_libfuzzer_crash_input_given_as_a_replay_file_names_the_replay_file_to_use(tmp_path, command):
    """``kvaudit replay crash-<sha1>`` (the file libFuzzer names on a crash) said only 'is not JSON'."""
    import hashlib

    data = bytes([0xF2, 0, 0xFF, 0x81, 7])
    sha1 = hashlib.sha1(data).hexdigest()
    path = tmp_path / f"crash-{sha1}"
    path.write_bytes(data)
    result = invoke(command, str(path))
    assert result.exit_code == 2
    line = one_error_line(result)
    assert "is a libFuzzer input (bytes), not a replay file" in line and f"input_sha1 is {sha1}" in line


def test_ci_with_a_cuda_regression_file_without_a_cuda_device_fails_that_check(tmp_path):
    """A regression file recorded with --device cuda, checked by ci on a CPU-only machine, was an internal error
    (exit 70: torch's 'Torch not compiled with CUDA enabled'), with no JUnit: now a failed check that says why,
    as a real engine's file where that engine is missing."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    (tmp_path / "reg").mkdir()
    regression = sorted(glob.glob(os.path.join(ROOT, "corpora", "regressions", "*.json")))[0]
    with open(regression, encoding="utf-8") as fh:
        doc = json.load(fh)
    doc["config"]["device"] = "cuda"
    _write(tmp_path / "reg", "gpu.json", json.dumps(doc))
    junit = tmp_path / "ci.xml"
    result = invoke("ci", "--max-time", "0", "--regressions", str(tmp_path / "reg"), "--out", str(tmp_path / "o"),
                    "--junit", str(junit))
    assert result.exit_code == 1, result.output
    assert "internal error" not in result.output
    assert "0/1 regressions ok" in result.output
    assert "cannot run here: device cuda: no CUDA device is available here" in result.output
    assert "no CUDA device" in junit.read_text()


@pytest.mark.parametrize("command", ["fuzz", "ci"])
@pytest.mark.parametrize("value, words", [
    ("nan", "must be a finite number of seconds, got nan"), ("inf", "must be a finite number of seconds, got inf"),
    ("-inf", "must be a finite number of seconds, got -inf"), ("-5", "must be a number of seconds >"), ("-5", ", got -5 (see"),
    ("1e308", "must be at most 31536000 seconds (365d), got 1e+308"),
    # (one second over the limit read "got 3.1536e+07", as if it were the limit)
    ("31536001", "must be at most 31536000 seconds (365d), got 31536001;"), ("-0.25", ", got -0.25 (see")])
def test_an_absurd_budget_exits_2_in_one_line(command, value, words):
    """--max-time 1e308 printed a 300-digit 'remaining'; nan, inf and negatives are refused alike, the value
    spelled as a config error spells it ('got nan', as JSON has no nan: TOML's word)."""
    result = invoke(command, "--max-time", value)
    assert result.exit_code == 2
    assert words in one_error_line(result)


def test_absurd_step_timeouts_and_bench_budgets_exit_2():
    for args in (["fuzz", "--step-timeout", "1e308"], ["fuzz", "--step-timeout", "-1"],
                 ["bench", "--budget", "inf"], ["bench", "--fp-seconds", "nan"]):
        result = invoke(*args)
        assert result.exit_code == 2, args
        assert "seconds" in one_error_line(result)


def test_durations_read_as_a_person_reads_them():
    from kvaudit.app.budget import duration

    assert [duration(s) for s in (1e-9, 0.44, 42.4, 725, 12000, 183600, 31536000)] == [
        "1e-09s", "0.4s", "42s", "12m05s", "3h20m", "2d03h", "365d"]


def _refused_in_a_fresh_process(cases, cwd):
    """Run ``kvaudit ARGS`` for each ``(setup, args)`` of ``cases`` in one fresh Python process (this
    one may have imported the engines already), ``setup`` first (a statement, or ""); returns
    ``[(exit code, the engines in sys.modules after it)]`` and the process's stderr lines that are errors."""
    import sys

    code = ("import json, sys\nfrom kvaudit.cli import main\nout = []\n"
            f"for setup, args in {cases!r}:\n"
            "    exec(setup)\n"
            "    try:\n        main(args)\n    except SystemExit as e:\n"
            "        out.append((e.code, sorted({m.split('.')[0] for m in sys.modules} & {'vllm', 'sglang'})))\n"
            "print(json.dumps(out))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=cwd,
                       env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))})
    assert r.stdout.strip(), r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1]), [
        line for line in r.stderr.splitlines() if line.startswith("kvaudit: error: ")]


def test_incompatible_options_are_refused_before_an_engine_is_imported(tmp_path):
    """--fuzzer atheris --target vllm was refused after 24 s of importing vLLM: every check that needs
    no engine now runs before the target's probe imports one: each refusal leaves neither vllm nor
    sglang in sys.modules."""
    cases = [["fuzz", "--fuzzer", "atheris", "--target", "vllm"],
             ["fuzz", "--fuzzer", "atheris", "--target", "sglang", "--preset", "sglang-hisparse"],
             ["fuzz", "--target", "vllm", "--suppress", str(tmp_path / "absent.toml")],
             ["fuzz", "--target", "sglang", "--db", "http://not-redis"],
             ["fuzz", "--target", "vllm", "--out", "/proc/kvaudit-cannot-write"],
             ["ci", "--target", "vllm", "--fuzzer", "atheris"],
             ["ci", "--target", "sglang", "--presets", "nope"]]
    got, errors = _refused_in_a_fresh_process([("", args + ["--max-time", "1"]) for args in cases], tmp_path)
    assert got == [[2, []]] * len(cases), (got, errors)
    assert len(errors) == len(cases), errors
    assert "--fuzzer atheris instruments the built-in engine only" in errors[0] and "--target vllm" in errors[0]


def test_a_config_the_installed_release_cannot_drive_is_refused_before_its_import(tmp_path):
    """The release is read from the engine's metadata (here: said to be an older one): vLLM's CPU-offload
    connector before 0.19.0 and HiSparse on SGLang's legacy family are refused in one line, unimported."""
    vllm_016 = "from kvaudit.targets.vllm import boot; boot.installed_version = lambda: '0.16.0'"
    sglang_0511 = "from kvaudit.targets.sglang import boot; boot.installed_version = lambda: '0.5.11'"
    got, errors = _refused_in_a_fresh_process([
        (vllm_016, ["fuzz", "--target", "vllm", "--preset", "vllm-cpu-offload-swa", "--max-time", "1"]),
        (sglang_0511, ["fuzz", "--target", "sglang", "--preset", "sglang-hisparse", "--max-time", "1"])], tmp_path)
    assert got == [[69, []], [69, []]], (got, errors)  # (a release this host lacks: 69, as a missing engine)
    assert "SimpleCPUOffloadConnector needs vLLM >= 0.19.0, not 0.16.0" in errors[0]
    assert "(the cache_finished_req era) is driven with core pools" in errors[1] and "HiSparse" in errors[1]


def test_a_missing_engine_exits_69_as_a_missing_atheris_or_redis_py_does(tmp_path):
    """``fuzz --target sglang`` without SGLang exited 2 (bad input), ``--fuzzer atheris`` without atheris and
    ``--db`` without redis-py 69 (EX_UNAVAILABLE): what this host lacks is 69 in every command, its one line
    giving the install command; an unknown preset is still the user's input (2). Each before an import."""
    none = ("from kvaudit.targets.sglang import boot as s; s.installed_version = lambda: None\n"
            "from kvaudit.targets.vllm import boot as v; v.installed_version = lambda: None")
    sg = os.path.join(ROOT, "corpora", "sglang", "hang-pd-prealloc-never-fits.json")
    vl = sorted(glob.glob(os.path.join(ROOT, "corpora", "vllm", "*.json")))[0]
    cases = [["fuzz", "--target", "sglang", "--max-time", "1", "--out", str(tmp_path / "o")],
             ["fuzz", "--target", "vllm", "--preset", "default", "--max-time", "1", "--out", str(tmp_path / "o")],
             ["ci", "--target", "sglang", "--max-time", "1", "--out", str(tmp_path / "o")],
             ["ci", "--target", "vllm", "--presets", "default", "--max-time", "1", "--out", str(tmp_path / "o")],
             ["replay", sg], ["minimize", vl, "-o", str(tmp_path / "m.json")],
             ["fuzz", "--target", "sglang", "--preset", "nope", "--max-time", "1"]]
    got, errors = _refused_in_a_fresh_process([(none, args) for args in cases], tmp_path)
    assert got == [[69, []]] * (len(cases) - 1) + [[2, []]], (got, errors)
    assert len(errors) == len(cases), errors
    assert all("is not installed" in e or "none is installed" in e for e in errors[:-1]), errors
    assert all("requirements/sglang-cpu.txt" in e for e in errors[0:6:2]), errors
    assert all("requirements/vllm-cpu.txt" in e for e in errors[1:6:2]), errors


def test_minimize_checks_its_output_before_importing_the_engine(tmp_path):
    path = tmp_path / "v.json"
    path.write_text(json.dumps({"format": FORMAT, "config": {"target": "vllm", "preset": "vllm"},
                                "program": [{"op": "idle"}], "findings": []}))
    got, errors = _refused_in_a_fresh_process([("", ["minimize", str(path)])], tmp_path)
    assert got == [[2, []]] and "records no finding" in errors[0], (got, errors)


def test_minimize_refuses_an_empty_output_name_as_every_output_flag_does(tmp_path):
    """`kvaudit minimize F -o ""` (an unset variable in a script) ran and wrote F.min.json beside F, exit 0:
    the empty name fell back to the default, where --json "", --issue "" and the others refuse it."""
    good = tmp_path / "good.json"
    good.write_text(open(os.path.join(REGRESSIONS, "overlap-abort-double-free.json")).read())
    r = invoke("minimize", str(good), "-o", "")
    assert r.exit_code == 2, r.output
    assert one_error_line(r) == 'kvaudit: error: --output: want a file name, not ""'
    assert sorted(os.listdir(tmp_path)) == ["good.json"]


def test_minimize_of_a_pipe_without_o_says_to_pass_o(tmp_path):
    """Tester 66: `kvaudit minimize <(cat F)` said '--output /dev/fd/63.min.json: cannot write in /proc/N/fd: No
    such file or directory': the default output is named after FILE, and a pipe's path names no folder to write
    in. Now one line says FILE is not a regular file's path and to pass -o (exit 2); with -o it runs."""
    text = open(os.path.join(REGRESSIONS, "overlap-abort-double-free.json"), "rb").read()
    opened = []

    def pipe_path() -> str:
        read, write = os.pipe()
        opened.append(read)
        os.write(write, text)  # (it fits the pipe's buffer)
        os.close(write)
        return f"/dev/fd/{read}"

    path = pipe_path()
    r = invoke("minimize", path)
    assert r.exit_code == 2, r.output
    assert one_error_line(r) == (f"kvaudit: error: {path}: not a regular file's path (a pipe or a device): the "
                                 "default output is named after FILE; pass -o OUT")
    r = invoke("minimize", pipe_path(), "-o", str(tmp_path / "small.json"))
    assert r.exit_code == 0, r.output
    assert os.listdir(tmp_path) == ["small.json"]
    for fd in opened:
        os.close(fd)


@pytest.mark.parametrize("suite", ["zoo", "history"])
@pytest.mark.parametrize("option", ["--out", "--json"])
def test_bench_refuses_an_empty_report_name_instead_of_writing_the_default(suite, option, tmp_path, monkeypatch):
    """`kvaudit bench --out ""` ran the whole benchmark and wrote benchmarks.md in the current directory, exit
    0 (the empty name fell back to the default); now it is refused as any empty output name is."""
    monkeypatch.chdir(tmp_path)
    r = invoke("bench", "--suite", suite, "--trials", "1", "--budget", "0.5", "--bugs", "all", option, "")
    assert r.exit_code == 2, r.output
    assert one_error_line(r) == f'kvaudit: error: {option}: want a file name, not ""'
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("args, flag", [
    (["fuzz", "--max-time", "1", "--out", ""], "--out"),
    (["fuzz", "--max-time", "1", "--corpus", ""], "--corpus"),
    (["ci", "--max-time", "1", "--presets", "default", "--out", ""], "--out"),
    (["ci", "--max-time", "1", "--presets", "default", "--corpus", ""], "--corpus"),
    (["campaign", "pull", "--db", "redis://127.0.0.1:1/0", ""], "DIRECTORY"),
], ids=["fuzz-out", "fuzz-corpus", "ci-out", "ci-corpus", "campaign-pull"])
def test_an_empty_directory_name_is_refused_not_taken_for_the_current_directory(args, flag, tmp_path, monkeypatch):
    """tx66: `kvaudit fuzz --out ""` (an unset variable in a script) searched and wrote its findings into the
    current directory, `--corpus ""` a whole campaign (campaign.json, programs/, findings/) there, exit 0, as
    did `ci --out ""`; `campaign pull --db URL ""` would have pulled into it. Each is refused now, before any
    engine or Redis is reached, as an empty file name is."""
    monkeypatch.chdir(tmp_path)
    r = invoke(*args)
    assert r.exit_code == 2, r.output
    assert one_error_line(r) == f'kvaudit: error: {flag}: want a directory name, not ""'
    assert os.listdir(tmp_path) == []


def test_no_arguments_prints_the_help_and_exits_0():
    result = invoke()
    assert result.exit_code == 0
    assert "Commands:" in result.stdout and "fuzz" in result.stdout


def test_a_bug_outside_its_preset_is_warned_about(tmp_path):
    result = invoke("fuzz", "--preset", "default", "--bug", "hisparse-prebuilt-skip-finish", "--max-time", "0.5",
                    "--out", str(tmp_path))
    assert result.exit_code == 0
    assert "warning: bug hisparse-prebuilt-skip-finish is reached through preset pd-decode-hisparse" in result.stderr


def test_fuzz_keeps_hypothesis_files_out_of_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = invoke("fuzz", "--fuzzer", "hypothesis", "--max-time", "2", "--out", "found")
    assert result.exit_code == 0, result.output
    assert sorted(os.listdir(tmp_path)) in ([], ["found"])  # (found/ is made when something is written there)


def test_a_page_size_is_only_tied_to_the_hisparse_buffer_when_hisparse_is_on(tmp_path):
    result = invoke("fuzz", "--preset", "default", "--page-size", "32", "--max-time", "0.5",
                    "--out", str(tmp_path / "out"))
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("edit, words", [
    (lambda d: d["config"].update(preset="nope"), 'unknown preset "nope"'),
    (lambda d: d.update(findings="x"), "bad findings: want a list"),
    (lambda d: d.update(findings=[{"kind": "bogus"}]), "bad findings: want a list"),
])
def test_a_replay_file_with_bad_fields_is_one_line(tmp_path, edit, words):
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "corpora", "regressions",
                       f"{BUG}.json")
    doc = json.load(open(src))
    edit(doc)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    result = invoke("replay", str(path))
    assert result.exit_code == 2
    assert words in one_error_line(result)


def test_an_interrupt_swallowed_by_a_callback_still_stops_the_next_op():
    """The CLI's SIGINT handler also sets runner.INTERRUPTED: the next op raises KeyboardInterrupt
    even if the first one was swallowed (Python ignores exceptions raised in gc callbacks)."""
    from kvaudit.targets.eut.presets import get_preset
    from kvaudit.program import Submit
    from kvaudit.audit.runner import INTERRUPTED, AuditedRun

    with AuditedRun(get_preset("default").config()) as run:
        assert run.apply(Submit()) == []
        INTERRUPTED.set()
        try:
            with pytest.raises(KeyboardInterrupt):
                run.apply(Submit())
        finally:
            INTERRUPTED.clear()


def _handles_sigterm(pid: int) -> bool:
    """Whether process ``pid`` has a SIGTERM handler (Linux: the SigCgt mask in /proc/PID/status)."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            caught = next(int(line.split()[1], 16) for line in fh if line.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return False
    return bool(caught >> (15 - 1) & 1)


def test_an_interrupt_inside_a_command_is_one_line_with_no_blank_line_above(monkeypatch, capsys):
    """A Ctrl-C while a command imports its engine (``fuzz --target vllm`` at 2.5 s) printed an empty line,
    click's, then ``kvaudit: interrupted``: two lines in a log where one is documented."""
    from kvaudit import cli
    from kvaudit.app import report

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(report, "run", interrupted)
    with pytest.raises(SystemExit) as e:
        cli.main(args=["report", "whatever.json"])
    assert e.value.code == 130 and capsys.readouterr().err == "kvaudit: interrupted\n"


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_an_interrupt_at_start_up_is_one_line_and_exit_130(tmp_path, sig):
    """SIGINT or SIGTERM while torch is still being imported: one line, exit 130, no traceback (the
    console script imports the CLI inside a handler; SIGTERM exited 143 with nothing said). The
    signal goes once the entry point's handler is in place (Python installs none for SIGTERM by
    itself), not after a fixed sleep that under load fell inside the interpreter's own start-up."""
    import signal
    import time

    if not os.path.exists("/proc/self/status"):
        pytest.skip("needs /proc to see when the handler is installed")
    proc = subprocess.Popen([kvaudit_script(), "fuzz", "--max-time", "30", "--out", str(tmp_path / "o")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=plain_env())
    end = time.monotonic() + 60
    while not _handles_sigterm(proc.pid) and proc.poll() is None and time.monotonic() < end:
        time.sleep(0.01)
    proc.send_signal(getattr(signal, sig))
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and err.strip().splitlines()[-1] == "kvaudit: interrupted"  # in start-up


# -- replay --update: keeping a corpus fresh ---------------------------------------------------------

REGRESSIONS = os.path.join(os.path.dirname(__file__), "..", "corpora", "regressions")


def _stale_copy(tmp_path, name):
    """A shipped replay file as if recorded before the code moved: other line numbers, no source
    text, plus a key of its own that --update must keep."""
    doc = json.load(open(os.path.join(REGRESSIONS, name)))
    for f in doc["findings"]:
        for key in ("alloc_sites", "free_sites", "prev_free_sites", "read_sites"):
            for site in f[key]:
                site["line"] = max(1, site["line"] - 100)  # some frames sit above line 100
                site.pop("source", None)
    doc["note"] = "kept"
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return path, doc


def test_replay_update_rerecords_stacks_and_keeps_the_rest(tmp_path):
    fresh = json.load(open(os.path.join(REGRESSIONS, "overlap-abort-double-free.json")))
    a, doc = _stale_copy(tmp_path, "overlap-abort-double-free.json")
    b, _ = _stale_copy(tmp_path, "retract-unaligned-page.json")
    result = invoke("replay", "--update", str(a), str(b))
    assert result.exit_code == 0, result.output
    assert result.stdout.count(": updated: ") == 2
    new = json.loads(a.read_text())
    assert new["findings"] == fresh["findings"]  # the shipped file is fresh: the same stacks, with source text
    assert all(s["source"] for f in new["findings"] for s in f["alloc_sites"] + f["free_sites"])
    assert {k: v for k, v in new.items() if k != "findings"} == {k: v for k, v in doc.items() if k != "findings"}
    again = invoke("replay", "--update", str(a))
    assert again.exit_code == 0 and again.stdout.strip().endswith(": unchanged")
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-")] == []


def test_replay_update_records_the_release_it_re_recorded_on(tmp_path, monkeypatch):
    """Re-recorded findings hold the installed release's frames: the file then names that release. A file
    whose findings stay as they were keeps what it had (the shipped corpus is not rewritten for it)."""
    from kvaudit import replay

    monkeypatch.setattr(replay, "engine_version", lambda config: "9.9")
    stale, _ = _stale_copy(tmp_path, "overlap-abort-double-free.json")
    fresh = tmp_path / "fresh.json"
    fresh.write_text(open(os.path.join(REGRESSIONS, "overlap-abort-double-free.json")).read())
    old = json.loads(fresh.read_text())
    old["engine_version"] = "1.0"
    other = tmp_path / "other.json"
    other.write_text(json.dumps(old))
    result = invoke("replay", "--update", str(stale), str(fresh), str(other))
    assert result.exit_code == 0, result.output
    assert json.loads(stale.read_text())["engine_version"] == "9.9"
    assert list(json.loads(stale.read_text()))[:3] == ["format", "config", "engine_version"]  # where to_doc puts it
    assert fresh.read_text() == open(os.path.join(REGRESSIONS, "overlap-abort-double-free.json")).read()
    assert json.loads(other.read_text())["engine_version"] == "9.9"  # the same frames, now of 9.9


def test_replay_update_says_when_the_signature_the_file_records_changes(tmp_path):
    """tg63: a file whose recorded ``signature`` text differs from the one its findings now make (written by an
    older kvaudit, or edited by hand) was rewritten with the new signature and the line said only ``updated: 1
    finding(s) re-recorded``: the signature a CI or a suppression names changed without a word."""
    path, doc = _stale_copy(tmp_path, "overlap-abort-double-free.json")
    now = [f["signature"] for f in doc["findings"]]
    doc["findings"][0]["signature"] = "use-after-free/old/signature"
    path.write_text(json.dumps(doc))
    result = invoke("replay", "--update", str(path))
    assert result.exit_code == 0, result.output
    was = ", ".join(["use-after-free/old/signature"] + now[1:])
    assert f"(signatures were {was}; now {', '.join(now)})" in result.stdout
    assert [f["signature"] for f in json.loads(path.read_text())["findings"]] == now


def test_replay_update_keeps_the_file_s_permissions(tmp_path):
    """tg63: a reproducer kept private (chmod 600) came back 644 from --update, the new file made with the
    umask's mode; a report written over an existing file keeps that file's permissions."""
    path, _ = _stale_copy(tmp_path, "overlap-abort-double-free.json")
    path.chmod(0o600)
    result = invoke("replay", "--update", str(path))
    assert result.exit_code == 0 and ": updated: " in result.stdout, result.output
    assert path.stat().st_mode & 0o777 == 0o600


def test_replay_update_leaves_a_file_that_no_longer_reproduces(tmp_path):
    path, doc = _stale_copy(tmp_path, "overlap-abort-double-free.json")
    doc["config"]["bugs"] = []  # the bug switched off: the program is clean
    path.write_text(json.dumps(doc))
    result = invoke("replay", "--update", str(path))
    assert result.exit_code == 4
    assert "not updated: its recorded finding(s) no longer reproduce" in result.stdout
    assert json.loads(path.read_text()) == doc


def test_replay_update_refuses_a_file_whose_finding_changed_kind(tmp_path):
    """Other bugs switched on under a recorded use-after-free: the program now yields something else.
    Re-recording would silently turn a reproducer into another bug's (a breaker saw exit 0 here)."""
    path, doc = _stale_copy(tmp_path, "session-close-while-running.json")
    doc["config"]["bugs"] = ["session-close-while-running", "session-borrow-double-count"]
    path.write_text(json.dumps(doc))
    result = invoke("replay", "--update", str(path))
    assert result.exit_code == 4, result.output
    assert "not updated: it recorded a use-after-free and now yields accounting-drift" in result.stdout
    assert json.loads(path.read_text()) == doc


def test_replay_update_goes_on_past_a_file_it_cannot_read_and_names_each(tmp_path):
    """Stop 63: `replay --update` over several files stopped at the first it could not read (exit 2), leaving the
    files after it as they were. Each such file is named in one line now, the others re-recorded, and the exit
    code is the first such file's (2 here; 5 the --json of a run interrupted at start-up)."""
    broken, cut = tmp_path / "broken.json", tmp_path / "cut.json"
    broken.write_text("{not json")
    cut.write_text(json.dumps({"format": "kvaudit.replay/1", "program": [], "findings": [], "executions": 0,
                               "interrupted": True}))
    a, _ = _stale_copy(tmp_path, "overlap-abort-double-free.json")
    b, _ = _stale_copy(tmp_path, "retract-unaligned-page.json")
    result = invoke("replay", "--update", str(a), str(broken), str(b), str(cut))
    assert result.exit_code == 2, result.output
    assert result.stdout.count(": updated: ") == 2 and str(b) in result.stdout, result.stdout
    errors = result.stderr.strip().splitlines()
    assert len(errors) == 2 and "Traceback" not in result.output, result.stderr
    assert errors[0].startswith(f"kvaudit: error: {broken} is not JSON: ")
    assert errors[1].startswith(f"kvaudit: error: {cut}: nothing recorded: ")
    assert broken.read_text() == "{not json"
    again = invoke("replay", "--update", str(cut), str(a))
    assert again.exit_code == 5 and again.stdout.strip().endswith(": unchanged"), again.output


def test_replay_of_a_clean_run_s_json_says_nothing_recorded_and_exits_5(tmp_path):
    """tr69: the --json of a fuzz, campaign or ci run that found nothing new (a config, no program, no finding)
    replayed 0 ops and exited 0, clean, having checked nothing (`--update`: "unchanged", 0). It is nothing recorded
    now, exit 5, as the --json of a run interrupted at start-up; the file is left as it was. (minimize keeps its own
    2, "records no program": tests/test_campaign.py.)"""
    doc = {"format": FORMAT, "config": {"preset": "default"}, "program": [], "findings": [], "fuzzer": "random-96",
           "seed": 1, "executions": 38, "ops": 2210, "seconds": 2.0, "suppressed": {}}
    path = _write(tmp_path, "clean.json", json.dumps(doc))
    for args in ([], ["--check-determinism"], ["--update"]):
        result = invoke("replay", *args, path)
        assert result.exit_code == 5, (args, result.output)
        assert one_error_line(result) == (f"kvaudit: error: {path}: nothing recorded: no program and no finding to "
                                          "replay (the --json of a run that found nothing new; a finding's replay "
                                          "file is what replays)")
        assert result.stdout == ""
    assert json.loads(open(path).read()) == doc


@pytest.mark.parametrize("errno_name", ["EACCES", "ENOSPC"])
def test_replay_update_past_a_file_it_cannot_write(tmp_path, monkeypatch, errno_name):
    """tx66: `replay --update a b c` where a cannot be rewritten (its directory read-only to the user) stopped
    there, leaving c as it was though it could be written; and where a full disk refused c, the error said
    'nothing else was written' though a and b had been. Now a file it may not write is one error line and the
    rest go on (exit 2, as a file it cannot read); a full disk still stops the run (74), naming the files kept."""
    import errno as errnos
    from kvaudit import replay as replay_mod
    files = [_stale_copy(tmp_path, name)[0] for name in
             ("overlap-abort-double-free.json", "retract-unaligned-page.json", "aborted-kv-inserted.json")]
    bad = files[0] if errno_name == "EACCES" else files[2]
    before = bad.read_text()
    real = replay_mod.rerecord

    def rerecord(file, *args, **kwargs):
        if file == str(bad):
            code = getattr(errnos, errno_name)
            raise OSError(code, os.strerror(code), file)
        return real(file, *args, **kwargs)

    monkeypatch.setattr(replay_mod, "rerecord", rerecord)
    result = invoke("replay", "--update", *map(str, files))
    assert bad.read_text() == before
    errors = result.stderr.strip().splitlines()
    assert len(errors) == 1 and "Traceback" not in result.output, result.stderr
    if errno_name == "EACCES":
        assert result.exit_code == 2, result.output
        assert errors[0] == f"kvaudit: error: cannot write {bad}: Permission denied"
        assert result.stdout.count(": updated: ") == 2 and str(files[2]) in result.stdout, result.stdout
    else:
        assert result.exit_code == 74, result.output
        assert errors[0] == (f"kvaudit: error: disk full: cannot write {bad} (No space left on device); kept what "
                             f"was written: {files[0]}, {files[1]}")


@pytest.mark.parametrize("args", [
    ["a.json", "b.json"],
    ["--update", "--json", "out.json", "a.json"],
    ["--update", "--check-determinism", "a.json"],
], ids=["two-files-without-update", "update-with-report-flag", "update-with-determinism"])
def test_replay_update_usage_errors(tmp_path, args):
    for name in ("a.json", "b.json"):
        (tmp_path / name).write_text(open(os.path.join(REGRESSIONS, "overlap-abort-double-free.json")).read())
    result = invoke("replay", *[str(tmp_path / a) if a.endswith(".json") else a for a in args])
    assert result.exit_code == 2, result.output
    one_error_line(result)


def test_replay_update_refuses_a_file_descriptor_s_link_before_replaying_any(tmp_path):
    """tester2 56: `cat f | kvaudit replay --update /dev/stdin` read the pipe twice (exit 70), and
    `--update /dev/fd/3 3<f` rewrote the file behind the descriptor though report paths refuse such links."""
    good = tmp_path / "a.json"
    good.write_text(open(os.path.join(REGRESSIONS, "overlap-abort-double-free.json")).read())
    before = good.read_text()
    os.symlink("/proc/self/fd/0", tmp_path / "in.json")
    result = invoke("replay", "--update", str(good), str(tmp_path / "in.json"))
    assert result.exit_code == 2, result.output
    assert "is a file descriptor's link, not a file: --update rewrites files in place" in one_error_line(result)
    assert good.read_text() == before  # (refused before the first was replayed)


@pytest.mark.parametrize("flags, warning", [
    (["--campaign", "nightly"], "warning: --campaign nightly names a campaign shared through --db"),
    (["--no-seeds"], "warning: --no-seeds applies to --fuzzer atheris"),
    (["--seeds"], "warning: --seeds applies to --fuzzer atheris"),  # (tester 66: no warning)
])
def test_a_flag_that_does_nothing_here_is_a_warning(flags, warning, tmp_path):
    r = invoke("fuzz", *flags, "--fuzzer", "random", "--max-time", "0.5", "--out", str(tmp_path))
    assert r.exit_code == 0, r.output
    assert warning in r.stderr


def test_ci_campaign_without_db_is_a_warning(tmp_path):
    empty = tmp_path / "regs"
    empty.mkdir()
    r = invoke("ci", "--campaign", "nightly", "--max-time", "1", "--presets", "default", "--regressions", str(empty),
               "--junit", str(tmp_path / "ci.xml"), "--out", str(tmp_path / "out"))
    assert r.exit_code == 0, r.output
    assert "warning: --campaign nightly names a campaign shared through --db; without --db it is ignored" in r.stderr


@pytest.mark.parametrize("args, option", [(["ci", "--max-time", "0", "--presets", "default,nope"], "--presets"),
                                          (["bench", "--overhead-presets", "nope"], "--overhead-presets"),
                                          (["ci", "--max-time", "0", "--presets", " , "], "--presets")])
def test_a_bad_preset_list_names_its_option_the_bad_name_and_the_valid_ones(args, option):
    """``ci --presets`` and ``bench --overhead-presets`` read their lists with one helper: exit 2, one line."""
    result = invoke(*args)
    assert result.exit_code == 2
    bad = '" , "' if "," in args[-1] and "nope" not in args[-1] else '"nope"'
    assert one_error_line(result) == (f"kvaudit: error: {option}: unknown preset {bad} "
                                      f"(valid: {', '.join(PRESETS)}, or all)")


@pytest.mark.parametrize("args, warning", [
    (["bench", "--suite", "history", "--fp-seconds", "3", "--list"], "--fp-seconds applies to --suite zoo"),
    (["bench", "--suite", "history", "--overhead-presets", "none", "--list"], "--overhead-presets applies to --suite zoo"),
    (["bench", "--jobs", "2", "--list"], "--jobs applies to --suite history"),
    (["bench", "--fuzzers", "bogus", "--list"], "--fuzzers applies to a benchmark run, not --list"),  # (tester 59)
    (["bench", "--suite", "history", "--trials", "2", "--list"], "--trials applies to a benchmark run, not --list"),
    (["bench", "--suite", "history", "--jobs", "2", "--list"], "--jobs applies to a benchmark run, not --list"),
    (["bench", "--json", "x.json", "--list"], "--json applies to a benchmark run, not --list"),  # (tester 59b)
    (["replay", "--runs", "5", os.path.join(REGRESSIONS, "prefill-finish-leaks-row.json")],
     "--runs applies to --check-determinism")])
def test_an_option_the_command_ignores_here_is_a_warning(args, warning):
    """These were silently ignored (exit 0, no word), unlike fuzz's --no-seeds with --fuzzer random."""
    r = invoke(*args)
    assert r.exit_code in (0, 1), r.output + r.stderr
    assert f"warning: {warning}; here it is ignored" in r.stderr.splitlines()
    quiet = invoke(*[a for a in args if a not in ("--fp-seconds", "3", "--overhead-presets", "none", "--jobs", "2",
                                                  "--runs", "5", "--fuzzers", "bogus", "--trials", "--json",
                                                  "x.json")])
    assert "warning:" not in quiet.stderr


@pytest.mark.parametrize("args, message", [
    (["bench", "--fuzzers", "", "--trials", "1", "--budget", "0.1"], '--fuzzers: unknown fuzzer ""'),
    (["campaign", "status", "--db", "redis://localhost:1/0", "--watch", "nan"], "must be a finite number of seconds, got nan")])
def test_an_empty_fuzzer_list_and_a_nan_watch_are_refused(args, message):
    """`bench --fuzzers ''` ran every fuzzer (five minutes); `--watch nan` passed the range check."""
    r = invoke(*args)
    assert r.exit_code == 2, r.output + r.stderr
    assert message in one_error_line(r)


@pytest.mark.parametrize("broken, said", [
    (None, "--db needs redis-py: pip install redis"),
    ("import kvaudit_tw67_no_such_module\n", "--db: redis-py is installed but cannot be imported here: "
                                            "ModuleNotFoundError: No module named 'kvaudit_tw67_no_such_module'")])
def test_a_redis_py_that_fails_to_import_says_what_failed(tmp_path, monkeypatch, broken, said):
    """A redis-py whose own import failed (a module it needs missing) said '--db needs redis-py: pip install redis',
    to a user who had it installed: the line names what failed; still one line, exit 69 (unavailable)."""
    for name in [m for m in sys.modules if m == "redis" or m.startswith("redis.")]:
        monkeypatch.delitem(sys.modules, name)
    if broken is None:
        monkeypatch.setitem(sys.modules, "redis", None)  # (import redis: ModuleNotFoundError, name 'redis')
    else:
        (tmp_path / "redis").mkdir()
        (tmp_path / "redis" / "__init__.py").write_text(broken)
        monkeypatch.syspath_prepend(str(tmp_path))
    r = invoke("campaign", "status", "--db", "redis://localhost:1/0")
    assert r.exit_code == 69, r.output + r.stderr
    assert one_error_line(r).startswith(f"kvaudit: error: {said}")


def test_a_fuzzer_or_bug_named_twice_runs_once_with_a_warning(tmp_path):
    """`bench --fuzzers random,random` ran random once without a word (the tester read it as accepted twice):
    a name given twice is kept once, as every name list keeps its first, and the warning says so."""
    r = invoke("bench", "--fuzzers", "random,random", "--bugs", "hisparse-prebuilt-skip-finish,hisparse-prebuilt-skip-finish",
               "--trials", "1", "--budget", "0.2", "--fp-seconds", "0", "--overhead-presets", "none",
               "--out", str(tmp_path / "b.md"), "--json", str(tmp_path / "b.json"))
    assert r.exit_code == 0, r.output + r.stderr
    assert r.stderr.splitlines()[:3] == ['warning: --fuzzers names "random" more than once; each runs once',
                                         'warning: --bugs names "hisparse-prebuilt-skip-finish" more than once; each runs once',
                                         "kvaudit bench: 1 bug(s) x 1 fuzzer(s) x 1 trial(s), budget 0.2s each"]
    assert json.loads((tmp_path / "b.json").read_text())["settings"]["fuzzers"] == ["random"]
    quiet = invoke("bench", "--fuzzers", "random", "--bugs", "nope")
    assert "warning:" not in quiet.stderr


@pytest.mark.parametrize("command, theirs, ours", [
    ("fuzz", "--jobs", "--workers"), ("fuzz", "--max-total-time", "--max-time"), ("ci", "--max-tme", "--max-time"),
])
def test_an_other_fuzzers_option_name_suggests_kvaudits(command, theirs, ours):
    """libFuzzer's -jobs is kvaudit's --workers: click suggested only what is spelled alike (--db, --json)."""
    r = invoke(command, theirs, "2")
    assert r.exit_code == 2, r.output
    # (click 8.4 quotes the names, 8.2-8.3 do not: "No such option: --jobs Did you mean --workers?")
    assert re.search(f"No such option:? '?{theirs}'?\\.? Did you mean '?{ours}'?\\?", one_error_line(r)), one_error_line(r)


def test_an_other_fuzzers_option_is_not_suggested_where_the_command_lacks_it():
    r = invoke("replay", "--jobs", "2", "x.json")
    assert r.exit_code == 2, r.output
    line = one_error_line(r)
    assert re.search("No such option:? '?--jobs'?", line) and "--workers" not in line, line


@pytest.mark.parametrize("args, shown", [
    (("fuzz", "--fuzzer", "x'y'z"), "x'y'z"), (("fuzz", "--bug", "x'y'z"), '"x\'y\'z"'),
    (("ci", "--suppress", "/no/o'k'", "--max-time", "1"), "/no/o'k'")])
def test_a_value_with_apostrophes_is_shown_as_given(args, shown):
    """Rewriting click's quotes in the finished message also rewrote kvaudit's own: --bug "x'y'z" read
    `unknown bug "x"y"z"`, a suppression path /no/o'k' read /no/o"k" (tester)."""
    r = invoke(*args)
    assert r.exit_code == 2, r.output
    assert shown in one_error_line(r), one_error_line(r)


def test_a_narrow_columns_does_not_fold_or_cut_plain_output_to_a_pipe(tmp_path):
    """COLUMNS=40 off a terminal cut the summary table's headers ('| findin… |'), folded a lifecycle row
    and a program's ops, and folded ci's last line ('... 1 new' / 'finding(s)')."""
    env = {"COLUMNS": "40", "NO_COLOR": "1", "CI": "true"}
    out = invoke("report", os.path.join(ROOT, "corpora/regressions/session-close-while-running.json"), env=env).stdout
    assert "…" not in out, out
    assert "| kind           | findings | suppressed | deduplicated |" in out, out
    assert " 2     1  owned by session:session-000000\n" in out, out
    assert "1  submit(family=0, prompt_len=1, max_new_tokens=1, session=0)\n" in out, out
    regressions = tmp_path / "regressions"
    regressions.mkdir()
    shutil.copy(os.path.join(ROOT, "corpora/regressions/session-close-while-running.json"), regressions)
    r = invoke("ci", "--max-time", "0", "--regressions", str(regressions), "--out", str(tmp_path / "out"), env=env)
    assert r.exit_code == 0, r.output + r.stderr
    assert r.stdout.splitlines()[-1] == "passed: 1/1 regressions ok, 0 new finding(s)", r.stdout


def test_ci_with_max_time_0_replays_the_regressions_without_reaching_db(tmp_path):
    """Tester 61b: `ci --max-time 0 --db redis://localhost:1/0` exited 69 (Redis unreachable), though only the
    campaigns use --db and --max-time 0 runs none (exit-codes.md: 69 'with a fuzzing budget'). A URL that is no
    Redis URL is still refused (2)."""
    regressions = tmp_path / "regressions"
    regressions.mkdir()
    shutil.copy(os.path.join(ROOT, "corpora/regressions/session-close-while-running.json"), regressions)
    r = invoke("ci", "--max-time", "0", "--regressions", str(regressions), "--db", "redis://127.0.0.1:1/0",
               "--out", str(tmp_path / "out"))
    assert r.exit_code == 0, r.output + r.stderr
    assert r.stdout.splitlines()[-1] == "passed: 1/1 regressions ok, 0 new finding(s)", r.stdout
    bad = invoke("ci", "--max-time", "0", "--regressions", str(regressions), "--db", "http://x/0")
    assert bad.exit_code == 2 and "want a Redis URL" in bad.stderr, bad.output + bad.stderr
    # (tester 61c: a Redis URL redis-py cannot parse was accepted with --max-time 0; with a budget it exits 2)
    for url, why in (("redis://h:notaport", "Port could not be cast"), ("redis://localhost:99999/0", "Port out of range"),
                     ("redis://localhost/abc", 'the database index "abc" is not a number')):
        bad = invoke("ci", "--max-time", "0", "--regressions", str(regressions), "--db", url)
        assert bad.exit_code == 2 and why in bad.stderr, bad.output + bad.stderr


def test_ci_regressions_given_a_file_says_it_is_a_file_not_no_such_directory(tmp_path):
    """--regressions takes a folder (docs/guides/ci.md): a replay file given there, with or without a trailing
    slash, is refused in one line that says it is a file (exit 2), not as a folder that does not exist."""
    path = os.path.join(ROOT, "corpora", "regressions", "session-close-while-running.json")
    for given in (path, path + os.sep):
        r = invoke("ci", "--max-time", "0", "--regressions", given, "--out", str(tmp_path / "o"))
        line = one_error_line(r)
        assert r.exit_code == 2 and "a file" in line and "no such directory" not in line, line
    missing = invoke("ci", "--max-time", "0", "--regressions", str(tmp_path / "none"))
    assert missing.exit_code == 2 and ": no such directory" in one_error_line(missing)


def test_ci_regressions_given_a_file_is_one_wording_with_or_without_its_slash(tmp_path):
    """A replay file given as --regressions got click's words, "Directory '...' is a file.", and the same file
    with a trailing slash kvaudit's, 'a file, not a folder: it takes a folder of replay files (*.json)': one
    check (kvaudit's), refused as the command line is read, for either spelling."""
    path = os.path.join(ROOT, "corpora", "regressions", "session-close-while-running.json")
    lines = []
    for given in (path, path + os.sep):
        r = invoke("ci", "--max-time", "0", "--regressions", given, "--out", str(tmp_path / "o"))
        assert r.exit_code == 2
        lines.append(one_error_line(r).replace(given, "PATH"))
    assert lines[0] == lines[1], lines
    assert "Directory" not in lines[0] and "PATH: a file, not a folder: it takes a folder of replay files" in lines[0]


@pytest.mark.parametrize("args, flag", [(["fuzz", "--max-time", "1"], "--out"), (["fuzz", "--max-time", "1"], "--corpus"),
                                        (["ci", "--max-time", "1"], "--out"), (["ci", "--max-time", "1"], "--corpus"),
                                        (["ci", "--max-time", "0"], "--out")])
def test_an_output_folder_given_a_file_is_one_wording_with_or_without_its_slash(tmp_path, args, flag):
    """Tester 66: fuzz/ci --out FILE and --corpus FILE got click's words ("Directory 'X' is a file."), FILE/ kvaudit's
    ('--out X/: not a directory'); ci --max-time 0 refused FILE and took FILE/. One check, one wording, exit 2."""
    path = tmp_path / "file"
    path.write_text("kept")
    regressions = ["--regressions", os.path.join(ROOT, "corpora", "regressions")] if args[0] == "ci" else []
    lines = []
    for given in (str(path), str(path) + os.sep):
        r = invoke(*args, *regressions, flag, given)
        assert r.exit_code == 2, r.output
        lines.append(one_error_line(r).replace(given, "PATH"))
    assert lines[0] == lines[1], lines
    assert "Directory" not in lines[0] and "PATH: not a directory" in lines[0], lines
    assert path.read_text() == "kept"


def test_ci_over_a_kind_without_regressions_says_so_in_words(tmp_path, fresh_registry):
    """It said 'kvaudit ci: 0 regression file(s) in (none for this target)'."""
    import rowtoy_plugin  # (registers the kind "rowtoy", which ships no regressions, when first imported)

    if "rowtoy" not in fresh_registry.kinds():  # (test_suppress imported it first, into a registry it restored)
        fresh_registry.register(rowtoy_plugin.KIND)

    r = invoke("ci", "--target", "rowtoy", "--presets", "rowtoy", "--max-time", "1", "--out", str(tmp_path / "out"))
    assert r.exit_code == 0, r.output + r.stderr
    first = r.stderr.splitlines()[0]
    assert first.startswith("kvaudit ci: no regression files (none for this target); fuzz "), first


@pytest.mark.parametrize("command", ["replay", "minimize"])
def test_a_replay_file_whose_engine_is_missing_says_the_file_chose_the_target(monkeypatch, tmp_path, command):
    """``kvaudit replay F`` of an SGLang file without SGLang said only ``--target sglang needs SGLang ...``: a flag
    the user never gave. The line names the file that chose the target first (tg63)."""
    from kvaudit.targets import registry

    def missing(config):
        raise registry.TargetUnavailable("--target sglang needs SGLang, which is not installed")

    real = registry.kind_of
    monkeypatch.setattr(registry, "kind_of", lambda config: type("K", (), {"probe": staticmethod(missing),
                                                                           "name": real(config).name})())
    path = os.path.join(ROOT, "corpora", "sglang", "hang-pd-prealloc-never-fits.json")
    extra = ["-o", str(tmp_path / "m.json")] if command == "minimize" else []
    r = invoke(command, path, *extra)
    assert r.exit_code == 69, r.output  # (what this host lacks: 69, as a missing atheris or redis-py)
    assert one_error_line(r) == (f"kvaudit: error: {path} was recorded on --target sglang: --target sglang needs "
                                 "SGLang, which is not installed"), r.output
