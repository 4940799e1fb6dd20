"""SGLang's legacy driver family (kvaudit/targets/sglang/legacy.py) on the releases of the history suite's
SGLang bugs: each catalogue entry's known program -- the minimized program ``kvaudit fuzz --fuzzer random``
found on the buggy release -- finds the bug there and replays clean on the fixing release.

One process imports one SGLang, so the releases run in child processes with their overlay first on
``PYTHONPATH``; a test whose overlay is missing skips with the install command. The tests without an
overlay check the version adapters, the probe's message and the catalogue's entries against the presets.
"""

import json
import os
import subprocess
import sys

import pytest
from release_helpers import child_env

from kvaudit.targets import config_from_dict
from kvaudit.targets.sglang import catalogue
from kvaudit.targets.sglang import compat
from kvaudit.targets.sglang.config import SGLANG_PRESETS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "tests", "data", "sglang_history")
BUGS = {b.id: b for b in catalogue.BUGS}

# the child: replay one file with the installed SGLang, then print the version and each finding, and
# whether the catalogue's entry matches one of them
CHILD = """
import json, sys
from kvaudit import replay
from kvaudit.audit.runner import execute
from kvaudit.history.catalogue import BUGS
from kvaudit.targets.sglang.boot import installed_version
config, program, _, _ = replay.load(sys.argv[1])
ex = execute(config, program)
print(json.dumps({"version": installed_version(), "match": any(BUGS[sys.argv[2]].matches(f) for f in ex.findings),
                  "findings": [[f.kind, f.signature] for f in ex.findings]}))
"""


def run_child(args: list[str], version: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = child_env("sglang", version, ROOT)
    env.pop("SGLANG_USE_CPU_ENGINE", None)
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout)


def replayed(bug_id: str, version: str) -> dict:
    r = run_child(["-c", CHILD, os.path.join(DATA, f"{bug_id}.json"), bug_id], version)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.releases
@pytest.mark.parametrize("bug_id", sorted(BUGS))
def test_the_known_program_finds_the_bug_on_the_release_that_shipped_it(bug_id):
    bug = BUGS[bug_id]
    out = replayed(bug_id, bug.buggy)
    assert out["version"] == bug.buggy  # the overlay, not the base's SGLang, was imported
    assert out["match"], f"{bug_id} not found on {bug.buggy}: {out['findings']}"


@pytest.mark.releases
@pytest.mark.parametrize("bug_id", sorted(BUGS))
def test_the_known_program_is_clean_on_the_fixing_release(bug_id):
    bug = BUGS[bug_id]
    out = replayed(bug_id, bug.fixed)
    assert out["version"] == bug.fixed
    assert out["findings"] == [], f"{bug_id}'s program is not clean on {bug.fixed}: {out['findings']}"


@pytest.mark.parametrize("bug_id", sorted(BUGS))
def test_a_known_program_runs_the_catalogue_entrys_preset_and_config(bug_id):
    """The history runner fuzzes ``preset`` + ``config``: the shipped program must be one such run's (read as
    a replay reads it: a field added since the file was written takes its default)."""
    bug = BUGS[bug_id]
    recorded = config_from_dict(json.load(open(os.path.join(DATA, f"{bug_id}.json")))["config"]).to_dict()
    want = SGLANG_PRESETS[bug.preset].config().to_dict() | bug.config
    assert {k: v for k, v in recorded.items() if k != "seed"} == {k: v for k, v in want.items() if k != "seed"}
    assert bug.buggy in compat.LEGACY and bug.fixed in compat.LEGACY


@pytest.mark.releases
def test_a_mode_the_legacy_family_does_not_drive_is_refused_in_one_line(tmp_path):
    r = run_child(["-m", "kvaudit", "fuzz", "--target", "sglang", "--preset", "sglang-pd-decode", "--fuzzer", "random",
                   "--max-time", "5", "--out", str(tmp_path)], "0.5.10.post1")
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.strip() and "vllm._C" not in ln]
    assert len(lines) == 1 and "cache_finished_req era" in lines[0] and "PD disaggregation" in lines[0], lines
    assert "Traceback" not in r.stderr


def test_the_version_adapters_name_the_release_that_made_each_change():
    assert compat.family("0.5.10.post1") == compat.family("0.5.11") == "legacy"
    assert compat.family("0.5.23") == "current" and compat.family("0.5.15.post1") is None
    for change in compat.CHANGES:
        assert not compat.has(change, "0.5.10.post1") and compat.has(change, "0.5.11")
    with pytest.raises(KeyError):
        compat.has("no-such-change", "0.5.11")


def test_the_probe_names_every_supported_release(monkeypatch):
    from kvaudit.targets.sglang import boot

    monkeypatch.setattr(boot, "installed_version", lambda: "0.5.9")
    with pytest.raises(boot.SglangUnavailable) as e:
        boot.probe_version()
    msg = str(e.value)
    assert "\n" not in msg and all(v in msg for v in compat.LEGACY + compat.CURRENT)
