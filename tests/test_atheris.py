"""atheris (libFuzzer) support: the byte decoder, the harness, the driver."""

from __future__ import annotations

import glob
import hashlib
import json
import os
import random
import subprocess
import sys
import time
from collections import Counter

import pytest

from kvaudit.targets.eut.presets import PRESETS, get_preset
from kvaudit import replay
from kvaudit.search.atheris_fuzz import HARNESS, SEEDS_DIR, _Monitor, atheris_search, harness_command, harness_env
from kvaudit.program.bytes_program import V2_MAGIC, max_len, program_from_bytes, program_to_bytes
from kvaudit.search.seeds import write_seeds
from kvaudit.program.bytes_v1 import RECORD, max_prompt, op_kinds
from kvaudit.search.fuzz import FuzzStats
from kvaudit.program import (Abort, CloseSession, Idle, MemoryPressure, OpenSession, Step, Submit, program_from_json,
                             program_to_json)
from kvaudit.audit.runner import execute

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REGRESSIONS = sorted(glob.glob(os.path.join(ROOT, "corpora", "regressions", "*.json")))
HISPARSE_BUG = "hisparse-prebuilt-skip-finish"


def _random_inputs(n: int = 300, seed: int = 20240611):
    """Version 1 inputs (a first byte of V2_MAGIC is moved off it)."""
    rng = random.Random(seed)
    for _ in range(n):
        data = bytes(rng.randrange(256) for _ in range(rng.choice([0, 1, 5, 6, 7, 13, 30, 60, 144, 200])))
        yield bytes([data[0] ^ 1]) + data[1:] if data[:1] == bytes([V2_MAGIC]) else data


def _check_op(op, config):
    mp = max_prompt(config)
    if isinstance(op, Submit):
        assert 0 <= op.family <= 7 and 1 <= op.max_new_tokens <= 12
        assert op.stop_at is None or 1 <= op.stop_at <= 12
        assert op.session is None or op.extends is None
        if op.session is not None:
            assert config.enable_streaming_session and 0 <= op.session <= 3 and 1 <= op.prompt_len <= 48
        elif op.extends is not None:
            assert not config.disable_radix_cache and 0 <= op.extends <= 7 and 1 <= op.prompt_len <= 16
        else:
            assert 1 <= op.prompt_len <= mp
    elif isinstance(op, Abort):
        assert op.handle is None or 0 <= op.handle <= 7
    elif isinstance(op, Step):
        assert 1 <= op.n <= 4
    elif isinstance(op, CloseSession):
        assert config.enable_streaming_session and 0 <= op.handle <= 3
    elif isinstance(op, OpenSession):
        assert config.enable_streaming_session
    elif isinstance(op, MemoryPressure):
        assert not config.disable_radix_cache


# --- the byte decoder -----------------------------------------------------------------------------

@pytest.mark.parametrize("preset", list(PRESETS))
def test_any_bytes_decode_to_a_valid_program(preset):
    config = get_preset(preset).config()
    for data in _random_inputs():
        program = program_from_bytes(data, config)
        assert program == program_from_bytes(data, config)  # deterministic
        assert isinstance(program[-1], Idle)
        records = min(-(-len(data) // RECORD), 24)
        if len(program) == records + 1:  # an idle was appended: the last decoded op was not one
            assert records == 0 or not isinstance(program[-2], Idle)
        else:
            assert len(program) == records >= 1
        for op in program:
            _check_op(op, config)
        assert program_from_json(json.loads(json.dumps(program_to_json(program)))) == program
        for version in (1, 2):
            assert program_from_bytes(program_to_bytes(program, config, version), config) == program


def test_empty_and_short_inputs():
    config = get_preset("default").config()
    assert program_from_bytes(b"", config) == [Idle()]
    assert program_from_bytes(b"\x00", config) == [Submit(0, 1, 1, None), Idle()]
    kinds = op_kinds(config)
    assert program_from_bytes(bytes([kinds.index("health_check")]), config)[0].kind == "health_check"
    assert program_from_bytes(bytes([kinds.index("idle")]), config) == [Idle()]  # no second idle
    long = bytes([kinds.index("step"), 3] + [0] * 4) * 100
    assert program_from_bytes(long, config) == [Step(4)] * 24 + [Idle()]
    assert len(program_from_bytes(long, config, max_ops=5)) == 6


def test_one_byte_changes_one_op():
    config = get_preset("streaming-session").config()
    rng = random.Random(7)
    for _ in range(200):
        data = bytearray(rng.randrange(256) for _ in range(RECORD * 10))
        before = program_from_bytes(bytes(data), config)[:10]
        pos = rng.randrange(len(data))
        data[pos] = rng.randrange(256)
        after = program_from_bytes(bytes(data), config)[:10]
        assert [i for i in range(10) if before[i] != after[i]] in ([], [pos // RECORD])


def test_ops_follow_the_config():
    def kinds_seen(preset):
        config = get_preset(preset).config()
        seen = set()
        for data in _random_inputs(400, seed=3):
            for op in program_from_bytes(data, config):
                seen.add(op.kind + ("_turn" if getattr(op, "session", None) is not None else "")
                         + ("_ext" if getattr(op, "extends", None) is not None else ""))
        return seen

    default, pd, sessions = kinds_seen("default"), kinds_seen("pd-decode"), kinds_seen("streaming-session")
    assert not default & {"open_session", "close_session", "submit_turn"}
    assert {"memory_pressure", "submit_ext", "health_check", "abort", "flush_cache", "step", "idle"} <= default
    assert not pd & {"open_session", "close_session", "submit_turn", "memory_pressure", "submit_ext"}
    assert {"open_session", "close_session", "submit_turn", "memory_pressure", "submit_ext"} <= sessions
    for version in (1, 2):
        with pytest.raises(ValueError):
            program_to_bytes([OpenSession()], get_preset("default").config(), version)
        with pytest.raises(ValueError):
            program_to_bytes([Submit(prompt_len=97)], get_preset("default").config(), version)
        with pytest.raises(ValueError):
            program_to_bytes([MemoryPressure()], get_preset("pd-decode").config(), version)


@pytest.mark.parametrize("path", REGRESSIONS, ids=lambda p: os.path.basename(p)[:-5])
def test_regression_programs_round_trip(path):
    config, program, _, _ = replay.load(path)
    want = program if isinstance(program[-1], Idle) else program + [Idle()]
    fuzz_config = get_preset(config.preset).config(bugs=config.bugs)  # what the fuzzer decodes with
    for version in (1, 2):
        assert program_from_bytes(program_to_bytes(program, config, version), config) == want
        assert program_from_bytes(program_to_bytes(program, config, version), fuzz_config) == want


def test_seed_corpora_are_current(tmp_path):
    """corpora/seeds is what `python -m kvaudit.search.seeds --write-seeds` writes today."""
    write_seeds(str(tmp_path), os.path.join(ROOT, "corpora", "regressions"))
    for preset in PRESETS:
        want = sorted(p.name for p in (tmp_path / preset).iterdir())
        assert want and sorted(os.listdir(os.path.join(SEEDS_DIR, preset))) == want, preset
        for name in want:
            with open(os.path.join(SEEDS_DIR, preset, name), "rb") as fh:
                assert fh.read() == (tmp_path / preset / name).read_bytes()


# --- the harness ----------------------------------------------------------------------------------

def _hisparse_config():
    return get_preset("pd-decode-hisparse").config(bugs=frozenset([HISPARSE_BUG]))


def _run_harness(args, config, tmp_path, known=None, timeout=120):
    env = harness_env(config, str(tmp_path / "findings"), known_path=known)
    return subprocess.run([HARNESS, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)


def test_harness_is_an_executable_script():
    assert os.access(HARNESS, os.X_OK)
    with open(HARNESS) as fh:
        assert fh.readline() == "#!/usr/bin/env python3\n"


def test_harness_runs_clean_on_default(tmp_path):
    (tmp_path / "corpus").mkdir()
    r = _run_harness(["-runs=50", "-seed=3", str(tmp_path / "corpus")], get_preset("default").config(), tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Done 50 runs" in r.stderr
    assert "INFO: Instrumenting engine_under_test.scheduler" in r.stderr
    assert not os.listdir(tmp_path / "findings") if (tmp_path / "findings").exists() else True


@pytest.mark.slow
def test_harness_crash_writes_a_replay_file(tmp_path):
    config = _hisparse_config()
    data = bytes([op_kinds(config).index("health_check")])
    (tmp_path / "input").write_bytes(data)
    r = _run_harness([str(tmp_path / "input")], config, tmp_path)
    assert r.returncode != 0
    # atheris prints the Python exception on stdout, libFuzzer its report on stderr
    assert "KvauditFinding: leak/hisparse_device/admit_request_direct@hisparse.py/process_batch_result_prebuilt@scheduler_disagg_decode_mixin.py" in r.stdout + r.stderr
    assert "ERROR: libFuzzer: fuzz target exited" in r.stderr
    files = os.listdir(tmp_path / "findings")
    assert files == [replay.file_name("leak/hisparse_device/admit_request_direct@hisparse.py/"
                                      "process_batch_result_prebuilt@scheduler_disagg_decode_mixin.py")]
    loaded_config, program, findings, doc = replay.load(str(tmp_path / "findings" / files[0]))
    assert loaded_config == config and doc["fuzzer"] == "atheris"
    assert doc["input_sha1"] == hashlib.sha1(data).hexdigest()
    assert [op.kind for op in program] == ["health_check", "idle"]
    assert findings[0].signature in execute(config, program).signatures

    known = tmp_path / "known.txt"
    # the op leaks the device buffer and the host slots: two signatures, both known now
    assert {f.signature for f in findings} >= {"leak/hisparse_device/admit_request_direct@hisparse.py/process_batch_result_prebuilt@scheduler_disagg_decode_mixin.py",
                                               "leak/hisparse_host/alloc_host@hisparse.py/process_batch_result_prebuilt@scheduler_disagg_decode_mixin.py"}
    known.write_text("".join(f"{f.signature}\n" for f in findings))
    os.unlink(tmp_path / "findings" / files[0])
    r = _run_harness([str(tmp_path / "input")], config, tmp_path, known=str(known))
    assert r.returncode == 0, r.stderr[-3000:]
    assert not os.listdir(tmp_path / "findings")


def test_the_harness_never_writes_over_another_file_of_its_findings_name(monkeypatch, tmp_path):
    """Stop 61's note: the harness wrote ``file_name(sig)`` in its findings folder over whatever was there (a
    user's note, another kind's replay file). It takes the next free name (kvaudit.replay.home) now, and
    replaces only its own kind's file of that signature (when the new reproducer is smaller)."""
    from kvaudit.search import atheris_harness as h

    config = _hisparse_config()
    for name, value in (("CONFIG", config), ("KNOWN", frozenset()), ("SUPPRESSIONS", None),
                        ("FINDINGS_DIR", str(tmp_path)), ("STATS_DIR", None), ("MAX_OPS", 24)):
        monkeypatch.setattr(h, name, value)
    sig = ("leak/hisparse_device/admit_request_direct@hisparse.py/"
           "process_batch_result_prebuilt@scheduler_disagg_decode_mixin.py")
    name = replay.file_name(sig)[:-len(".json")]
    (tmp_path / f"{name}.json").write_text("my notes")
    data = bytes([op_kinds(config).index("health_check")])
    for _ in range(2):  # (the second: its own file of that signature, kept as it is; no third file)
        with pytest.raises(h.KvauditFinding, match=sig):
            h.TestOneInput(data)
    assert (tmp_path / f"{name}.json").read_text() == "my notes"
    assert sorted(os.listdir(tmp_path)) == [f"{name}.2.json", f"{name}.json"]
    assert replay.load(str(tmp_path / f"{name}.2.json"))[2][0].signature == sig


def test_the_harness_counts_what_its_programs_reached_and_the_driver_sums_it(monkeypatch, tmp_path):
    """tz69: ``kvaudit fuzz --fuzzer atheris`` ended a clean run with no ``reached:`` line (every other
    fuzzer prints one): the harness counted executions and ops only. Its stats file now keeps
    ``Target.reach()`` summed over its programs, and the driver sums the files (one per -fork job)."""
    from kvaudit.search import atheris_harness as h
    from kvaudit.search.atheris_fuzz import _read_stats

    config = get_preset("default").config()
    stats_dir = tmp_path / "stats"
    stats_dir.mkdir()
    for name, value in (("CONFIG", config), ("KNOWN", frozenset()), ("SUPPRESSIONS", None),
                        ("FINDINGS_DIR", str(tmp_path / "findings")), ("STATS_DIR", str(stats_dir)), ("MAX_OPS", 24),
                        ("_counts", {"executions": 0, "ops": 0}), ("_suppressed", set()), ("_reached", Counter()),
                        ("_last_write", [0.0])):
        monkeypatch.setattr(h, name, value, raising=False)
    program = [Submit(family=0, prompt_len=8, max_new_tokens=4), Abort(handle=0), Idle()]
    h.TestOneInput(program_to_bytes(program, config))
    h._write_stats(force=True)
    doc = json.loads(next(stats_dir.iterdir()).read_text())
    assert doc["executions"] == 1 and doc.get("reached", {}).get("aborts", 0) >= 1, doc
    assert {"aborts", "flushes", "retractions"} <= set(doc["reached"])  # (every counter the preset keeps, 0s too)
    (stats_dir / "other-job.json").write_text(json.dumps({"executions": 2, "ops": 5, "reached": {"aborts": 3}}))
    executions, ops, _, reached = _read_stats(str(stats_dir))
    assert executions == 3 and reached["aborts"] == doc["reached"]["aborts"] + 3


# --- the driver -----------------------------------------------------------------------------------

def test_libfuzzer_status_lines():
    mon = _Monitor.__new__(_Monitor)
    mon.executions = mon.coverage = 0
    mon.parse("#2\tINITED cov: 126 ft: 126 corp: 1/1b exec/s: 0 rss: 251Mb")
    mon.parse("#4096\tpulse  cov: 396 ft: 876 corp: 13/35b lim: 4 exec/s: 410 rss: 259Mb")
    assert (mon.executions, mon.coverage) == (4096, 396)
    mon.parse("#5000: cov: 0 ft: 0 corp: 0 exec/s 558 oom/timeout/crash: 0/0/0 time: 7s job: 1 dft_time: 0")
    assert (mon.executions, mon.coverage) == (5000, 396)  # -fork's first line, before any merge
    mon.parse("#6000: cov: 455 ft: 1319 corp: 38 exec/s 406 oom/timeout/crash: 0/0/0 time: 18s job: 3")
    assert (mon.executions, mon.coverage) == (6000, 455)
    mon.parse("stat::number_of_executed_units: 7000")
    assert mon.executions == 7000
    mon.parse("#7001\tDONE   cov: 460 ft: 1319 corp: 38/1kb lim: 4 exec/s: 400 rss: 259Mb")
    assert (mon.executions, mon.coverage) == (7001, 460)


def test_harness_command():
    cmd = harness_command("/c", "/s", 9.2, 0, "/w", workers=3)
    assert cmd[:3] == [HARNESS, "/c", "/s"]
    assert {"-max_total_time=10", "-fork=3", "-ignore_crashes=0", "-artifact_prefix=/w/crashes/",
            "-print_final_stats=1", f"-max_len={max_len(24)}", "-len_control=0"} <= set(cmd)
    assert not any(a == "-seed=0" for a in cmd)  # 0 is "random" to libFuzzer
    assert not any(a.startswith("-fork") for a in harness_command("/c", None, 5, 1, "/w"))


def _find_hisparse(tmp_path, workers):
    config = _hisparse_config()
    stats, seen = FuzzStats(), []
    t0 = time.monotonic()
    # no seed corpus: the seeds hold this very reproducer, and the point is that atheris finds it
    found = atheris_search(config, max_time=60, seed=1, stats=stats, on_progress=seen.append, workers=workers,
                           work_dir=str(tmp_path / "work"), use_seeds=False)
    elapsed = time.monotonic() - t0
    assert found is not None, open(tmp_path / "work" / "libfuzzer.log").read()[-3000:]
    program, findings = found
    assert findings[0].signature.startswith("leak/hisparse_")
    assert elapsed < 60 and stats.executions > 0 and stats.ops > 0 and stats.coverage.endswith(" edges")
    assert seen and seen[-1] is stats
    files = glob.glob(str(tmp_path / "work" / "findings" / "*.json"))
    assert files
    loaded_config, loaded_program, loaded_findings, _ = replay.load(files[0])
    assert loaded_config == config and loaded_program == program
    assert findings[0].signature in execute(loaded_config, loaded_program).signatures
    assert glob.glob(str(tmp_path / "work" / "crashes" / "crash-*"))
    print(f"workers={workers}: found {findings[0].signature} in {elapsed:.1f}s, {stats.executions} executions")


@pytest.mark.slow
def test_atheris_finds_the_hisparse_bug(tmp_path):
    _find_hisparse(tmp_path, workers=1)


@pytest.mark.slow
def test_atheris_fork_finds_the_hisparse_bug(tmp_path):
    _find_hisparse(tmp_path, workers=2)


@pytest.mark.slow
def test_atheris_clean_run_and_known_signatures(tmp_path):
    """A known signature is not a finding: the search goes on and ends clean (or finds another)."""
    config = _hisparse_config()
    stats = FuzzStats()
    known = {"leak/hisparse_device/admit_request_direct@hisparse.py/process_batch_result_prebuilt@scheduler_disagg_decode_mixin.py",
             "leak/hisparse_host/alloc_host@hisparse.py/process_batch_result_prebuilt@scheduler_disagg_decode_mixin.py"}
    found = atheris_search(config, max_time=4, seed=2, stats=stats, known=known, work_dir=str(tmp_path / "w"))
    assert found is None or found[1][0].signature not in known
    assert stats.executions > 10
    config, stats = get_preset("default").config(), FuzzStats()
    assert atheris_search(config, max_time=3, seed=2, stats=stats, work_dir=str(tmp_path / "d")) is None
    # what the programs reached, as every fuzzer counts it (a counter at 0 included: "not reached")
    assert {"aborts", "evictions_for_alloc", "flushes", "retractions"} <= set(stats.reached), stats.reached


_LATE_ARTIFACT = r"""
import os, shutil, sys, time
# a -fork parent: the job's replay file first, its crash input only when the parent copies it
shutil.copy(sys.argv[1], os.path.join(os.environ["KVAUDIT_FINDINGS_DIR"], "found.json"))
time.sleep(3.5)
open(os.path.join("crashes", "crash-0123abcd"), "wb").write(b"input")
time.sleep(120)  # then its other jobs run on until stopped
"""


def test_the_search_stops_once_the_crash_input_is_written_not_after_a_fixed_wait(tmp_path, monkeypatch):
    """libFuzzer was stopped a fixed 2 s after the replay file appeared, which under load came before
    the -fork parent had copied the crash input: the input was lost now and then. The stop waits for
    the artifact (a stand-in harness writes it 3.5 s late)."""
    from kvaudit.search import atheris_fuzz

    regression = os.path.join(os.path.dirname(__file__), "..", "corpora", "regressions",
                              "hisparse-prebuilt-skip-finish.json")
    monkeypatch.setattr(atheris_fuzz, "harness_command",
                        lambda *a, **k: [sys.executable, "-c", _LATE_ARTIFACT, os.path.abspath(regression)])
    config, _, _, _ = replay.load(regression)
    t0 = time.monotonic()
    found = atheris_search(config, max_time=60, seed=1, stats=FuzzStats(), work_dir=str(tmp_path / "w"),
                           use_seeds=False)
    assert found is not None
    assert os.listdir(tmp_path / "w" / "crashes") == ["crash-0123abcd"]
    assert time.monotonic() - t0 < 30  # stopped at the artifact, not at the budget


def test_a_bad_max_ops_is_one_line_spelled_as_json(monkeypatch, capsys):
    """``KVAUDIT_MAX_OPS must be an integer, got 'x'``: the value in Python's quotes."""
    from kvaudit.search import atheris_harness

    monkeypatch.delenv("KVAUDIT_CONFIG", raising=False)
    monkeypatch.delenv("KVAUDIT_KNOWN", raising=False)
    monkeypatch.delenv("KVAUDIT_SUPPRESS", raising=False)
    monkeypatch.setenv("KVAUDIT_MAX_OPS", "x")
    for name in ("CONFIG", "KNOWN", "SUPPRESSIONS", "FINDINGS_DIR", "STATS_DIR", "MAX_OPS"):  # _setup sets them
        monkeypatch.setattr(atheris_harness, name, getattr(atheris_harness, name))
    with pytest.raises(SystemExit) as e:
        atheris_harness._setup()
    assert e.value.code == 2
    assert capsys.readouterr().err == 'fuzz_engine.py: KVAUDIT_MAX_OPS must be an integer, got "x"\n'
    # th64: 0 and -5 were taken, and every input decoded to the final idle() alone (a session that fuzzed nothing)
    for value in ("0", "-5"):
        monkeypatch.setenv("KVAUDIT_MAX_OPS", value)
        with pytest.raises(SystemExit) as e:
            atheris_harness._setup()
        assert e.value.code == 2
        assert capsys.readouterr().err == f"fuzz_engine.py: KVAUDIT_MAX_OPS must be at least 1, got {value}\n"


def test_a_cuda_config_without_a_cuda_device_is_one_line_exit_2(monkeypatch, capsys):
    """``KVAUDIT_CONFIG='{"device": "cuda"}'`` on a CPU-only machine: every input raised torch's 'Torch not
    compiled with CUDA enabled', so the very first (empty) input was written as a crash file, exit 77."""
    import torch

    from kvaudit.search import atheris_harness

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    monkeypatch.setenv("KVAUDIT_CONFIG", '{"device": "cuda"}')
    monkeypatch.delenv("KVAUDIT_BUGS", raising=False)
    with pytest.raises(SystemExit) as e:
        atheris_harness._config()
    assert e.value.code == 2
    assert capsys.readouterr().err == (f"fuzz_engine.py: KVAUDIT_CONFIG: device cuda: no CUDA device is available "
                                       f"here (torch {torch.__version__})\n")


def test_a_run_without_work_dir_leaves_no_directory_when_an_interrupt_cuts_its_removal(monkeypatch, tmp_path):
    # a second Ctrl-C while the temporary work directory is being removed: the removal is finished, then the
    # interrupt goes on (kvaudit.atomic.scratch_dir); the run's own rmtree(ignore_errors=True) left it half there
    import tempfile

    from cli_helpers import cut_first_removal
    from kvaudit.search import atheris_fuzz

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    work = []

    def search(config, max_time, seed, stats, on_progress, corpus_dir, workers, suppressions_path, known, work_dir,
               *rest):
        work.append(work_dir)
        os.makedirs(os.path.join(work_dir, "corpus"))
        raise KeyboardInterrupt

    monkeypatch.setattr(atheris_fuzz, "_search", search)
    cut_first_removal(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        atheris_search(None, 1.0, 0, FuzzStats())
    assert work and work[0].startswith(str(tmp_path)) and os.listdir(tmp_path) == []


def test_the_harness_readme_gives_the_max_len_and_file_name_a_run_uses():
    """harnesses/README.md passed ``-max_len=144`` (24 records of layout 1, 6 bytes) 'as atheris_search does',
    but new inputs are layout 2, 14-byte records: atheris_search passes 337, and 144 bytes hold 10 ops; and it
    replayed a file name the HiSparse leak's signature does not make."""
    import re

    with open(os.path.join(ROOT, "harnesses", "README.md"), encoding="utf-8") as fh:
        text = fh.read()
    lens = set(re.findall(r"-max_len=(\d+)", text))
    assert lens == {str(max_len(24))}, lens
    _, _, recorded, _ = replay.load(os.path.join(ROOT, "corpora", "regressions", "hisparse-prebuilt-skip-finish.json"))
    expected = recorded[0].signature
    assert f"kvaudit-findings/{replay.file_name(expected)}" in text
