"""SGLang's driver families (the legacy one, kvaudit/targets/sglang/legacy.py, and the current one) on the
releases of the history suite's SGLang bugs: each catalogue entry's known program -- the minimized program
``kvaudit fuzz --fuzzer random`` found on the buggy release -- finds the bug there and replays clean on the
fixing release.

One process imports one SGLang, so the releases run in child processes with their overlay first on
``PYTHONPATH``; a test whose overlay is missing skips with the install command. The tests without an
overlay check the version adapters, the probe's message and the catalogue's entries against the presets.
"""

import json
import os
import subprocess
import sys

import pytest
from cli_helpers import reached
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


SWA_FILE = os.path.join(ROOT, "corpora", "sglang", "liveness-swa-36458-chunked-prefill-pins-swa-pool.json")


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
    # both releases of a row are driven by one family (the legacy one, or the current one's 0.5.22 -> 0.5.23)
    assert compat.family(bug.buggy) == compat.family(bug.fixed) is not None


# the child: the history search of sglang-22213 at seeds 4 and 5, per step (K=1) and on the sparse schedule
SPARSE_CHILD = """
import json
from kvaudit.history.catalogue import all_bugs, target_config
from kvaudit.history.worker import search_trial
from kvaudit.search import schedule
bug, sparse = all_bugs()["sglang-22213"], schedule.CHECK_EVERY
config, out = target_config(bug), {}
for k in (1, sparse):
    schedule.CHECK_EVERY = k
    out[k] = [(t.success, t.executions) for t in (search_trial(bug, config, "corpus", s, 60.0) for s in (4, 5))]
print(json.dumps([out[1], out[sparse]]))
"""


@pytest.mark.releases
def test_the_sparse_schedule_meets_the_busy_checks_double_count_where_a_per_step_run_does():
    """sglang-22213's false 'Mem Leak Detected' shows only while a session's turn runs on the slot's row (the
    busy check counts it twice): the legacy target calls that state transient, so the search checks after
    every step meanwhile and hits at the per-step run's execution (seeds 4 and 5 took 29 and 7 executions
    against 5 and 3 without)."""
    r = run_child(["-c", SPARSE_CHILD], "0.5.10.post1")
    assert r.returncode == 0, r.stderr[-2000:]
    per_step, sparse = json.loads(r.stdout.strip().splitlines()[-1])
    assert all(ok for ok, _ in per_step) and sparse == per_step, (per_step, sparse)


@pytest.mark.releases
def test_a_mode_the_legacy_family_does_not_drive_is_refused_in_one_line(tmp_path):
    r = run_child(["-m", "kvaudit", "fuzz", "--target", "sglang", "--preset", "sglang-pd-decode", "--fuzzer", "random",
                   "--max-time", "5", "--out", str(tmp_path)], "0.5.10.post1")
    assert r.returncode == 69, r.stderr[-2000:]  # (a release this host lacks)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip() and "vllm._C" not in ln]
    assert len(lines) == 1 and "cache_finished_req era" in lines[0] and "PD disaggregation" in lines[0], lines
    assert "Traceback" not in r.stderr


@pytest.mark.releases
def test_a_clean_legacy_fuzz_run_says_what_its_programs_reached(tmp_path):
    """The legacy family's plain target had no reach(): a clean run on 0.5.11 printed no ``reached:`` line."""
    r = run_child(["-m", "kvaudit", "fuzz", "--target", "sglang", "--preset", "sglang-session", "--fuzzer", "random",
                   "--max-time", "2", "--seed", "1", "--out", str(tmp_path)], "0.5.11")
    assert r.returncode == 0, r.stderr[-2000:]
    counts = reached(r.stdout)
    assert counts["session_turns"] > 0 and "retractions" in counts, counts
    assert "kvaudit fuzz: target sglang 0.5.11 (cache_finished_req era, no tree core), random" in r.stderr  # (rust ...)


def test_the_banner_and_the_report_header_name_a_tree_core_in_the_current_era_only(monkeypatch):
    """On 0.5.11 the banner said "(rust tree core)": that era drives its RadixCache (ChunkCache for PD
    decode), with no tree core, whatever --tree-core says."""
    from kvaudit.targets import registry
    from kvaudit.targets.sglang import boot

    kind, config = registry.get("sglang"), SGLANG_PRESETS["sglang"].config()
    for version, core in (("0.5.11", "cache_finished_req era, no tree core"), ("0.5.23", "rust tree core")):
        monkeypatch.setattr(boot, "installed_version", lambda: version)
        assert kind.describe(config) == f"target sglang {version} ({core})"
        assert f"preset sglang, {core}, bugs: none" in kind.header(config)


def test_the_target_help_names_every_release_the_kind_drives():
    """--target's help left out 0.5.19, which the history suite runs (sglang-36855's buggy release)."""
    from kvaudit.targets import registry

    summary = registry.get("sglang").summary
    assert all(v in summary for v in compat.LEGACY + compat.CURRENT), summary


@pytest.mark.releases
def test_a_replay_the_installed_release_cannot_drive_names_the_releases_that_can(tmp_path):
    """A preset's refusal named the releases that drive it; a replay file's (the probe's) did not."""
    r = run_child(["-m", "kvaudit", "replay", SWA_FILE], "0.5.11")
    assert r.returncode == 69, r.stderr[-2000:]  # (a release this host lacks: 69)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip() and "vllm._C" not in ln]
    assert len(lines) == 1 and lines[0].endswith("SWA (driven on SGLang 0.5.22, 0.5.23; installed 0.5.11)"), lines


def test_the_probes_refusal_names_the_releases_that_drive_the_config(monkeypatch):
    from kvaudit import replay
    from kvaudit.targets.registry import TargetUnavailable
    from kvaudit.targets.sglang import boot, kind

    monkeypatch.setattr(boot, "installed_version", lambda: "0.5.11")
    config = replay.load(SWA_FILE)[0]
    for build in (kind._probe, kind._make):
        with pytest.raises((TargetUnavailable, boot.SglangUnavailable)) as e:
            build(config)
        assert str(e.value).endswith("(driven on SGLang 0.5.22, 0.5.23; installed 0.5.11)"), e.value


def test_the_version_adapters_name_the_release_that_made_each_change():
    assert compat.family("0.5.10.post1") == compat.family("0.5.11") == "legacy"
    assert compat.family("0.5.22") == compat.family("0.5.23") == "current"
    assert compat.family("0.5.19") == compat.family("0.5.20") == compat.family("0.5.21") == "current"
    assert compat.family("0.5.15.post1") is None and compat.family("0.5.18") is None
    driven = compat.LEGACY + compat.CURRENT
    for change in compat.CHANGES.values():
        # each change is named after a driven release, and the driven release before it lacks it
        at = driven.index(change.release)
        assert at > 0 and compat.has(change.name, change.release), change
        assert not compat.has(change.name, driven[at - 1]), change
    assert not compat.has("flush-send-output", "0.5.22") and compat.has("flush-send-output", "0.5.23")
    assert not compat.has("mamba-track-position", "0.5.22") and compat.has("mamba-track-position", "0.5.23")
    assert not compat.has("release-checkpoint", "0.5.21") and compat.has("release-checkpoint", "0.5.22")
    assert not compat.has("publish-ranks", "0.5.20") and compat.has("publish-ranks", "0.5.21")
    assert not compat.has("cache-request-handle", "0.5.19") and compat.has("cache-request-handle", "0.5.20")
    with pytest.raises(KeyError):
        compat.has("no-such-change", "0.5.11")


def test_the_free_page_census_of_0_5_19_reads_the_pending_release_pages_too():
    """Before change ``free-pages-census`` (0.5.19) no ``get_all_free_pages``: the census is ``free_pages`` and the
    pending ``release_pages`` (a PD allocator's frees wait there until ``merge_and_sort_free``), in that order."""
    import torch

    class Paged:  # 0.5.19's PagedTokenToKVPoolAllocator's two free tensors, no census method
        free_pages = torch.tensor([3, 4])
        release_pages = torch.tensor([7])

    assert compat.free_pages(Paged(), "0.5.19").tolist() == [3, 4, 7]
    Paged.release_pages = torch.empty(0, dtype=torch.int64)
    assert compat.free_pages(Paged(), "0.5.19").tolist() == [3, 4]

    class Census(Paged):
        def get_all_free_pages(self):
            return torch.tensor([9])

    assert compat.free_pages(Census(), "0.5.20").tolist() == [9]


def test_the_probe_names_every_supported_release(monkeypatch):
    from kvaudit.targets.sglang import boot

    monkeypatch.setattr(boot, "installed_version", lambda: "0.5.9")
    with pytest.raises(boot.SglangUnavailable) as e:
        boot.probe_version()
    msg = str(e.value)
    assert "\n" not in msg and all(v in msg for v in compat.LEGACY + compat.CURRENT)


def test_a_release_between_the_eras_is_refused_in_one_line_that_says_why(monkeypatch):
    from kvaudit.targets.sglang import boot

    for version, why in (("0.5.18", "between the two eras"), ("0.5.12", "between the two eras"),
                         ("0.5.9", "scheduler-level API changes")):
        monkeypatch.setattr(boot, "installed_version", lambda v=version: v)
        with pytest.raises(boot.SglangUnavailable) as e:
            boot.probe_version()
        assert "\n" not in str(e.value) and why in str(e.value) and version in str(e.value)


# the child: random programs of each preset, from a fresh engine each, on the installed SGLang; prints
# the version, each preset's findings and how many deferred flushes SchedulerFlushWrapper answered
CLEAN_CHILD = """
import json, random, sys
from kvaudit.audit.runner import AuditedRun
from kvaudit.program.generate import random_program
from kvaudit.targets.sglang.boot import installed_version
from kvaudit.targets.sglang.config import SGLANG_PRESETS
out = {"version": installed_version(), "findings": {}, "flush_replies": 0}
for preset in sys.argv[1].split(","):
    config = SGLANG_PRESETS[preset].config()
    rng = random.Random(1)
    found = []
    for _ in range(int(sys.argv[2])):
        with AuditedRun(config) as run:
            wrapper = getattr(run.target, "flush_wrapper", None)
            if wrapper is not None:  # count the replies a deferred flush sends through the version's sink
                sink = getattr(wrapper, "_send_output", None)
                if sink is not None:
                    def counted(*a, _sink=sink):
                        out["flush_replies"] += 1
                        return _sink(*a)
                    wrapper._send_output = counted
                else:
                    sink = wrapper._ipc_channels.send_to_tokenizer.send_output
                    def counted(*a, _sink=sink):
                        out["flush_replies"] += 1
                        return _sink(*a)
                    wrapper._ipc_channels.send_to_tokenizer.send_output = counted
            for op in random_program(rng, 40, features=config.program_features):
                if run.apply(op):
                    break
            found += [[f.kind, f.signature] for f in run.findings]
    out["findings"][preset] = found
print(json.dumps(out))
"""
CURRENT_ERA_PRESETS = ("sglang", "sglang-paged", "sglang-overlap", "sglang-chunked", "sglang-session", "sglang-hicache",
                       "sglang-pd-decode", "sglang-hisparse")


@pytest.mark.releases
@pytest.mark.parametrize("version", [v for v in compat.CURRENT if v != "0.5.23" and v not in compat.OLDER_CURRENT])
def test_the_current_era_presets_run_clean_on_an_older_current_release(version):
    """0.5.22 is driven by the 0.5.23 driver (compat.CURRENT): random programs of every preset it had find
    nothing but SGLang 0.5.23's own findings (corpora/sglang: bugs 0.5.22 ships too) and the history rows
    this release ships (sglang-39500), never a crash in the driver, and a deferred flush_cache is answered
    through that release's reply path (ipc_channels)."""
    from kvaudit.history.catalogue import rediscoveries

    known = {b.signature for b in rediscoveries()}
    shipped = [b for b in catalogue.BUGS if b.buggy == version]  # a check's name ends its signature
    r = run_child(["-c", CLEAN_CHILD, ",".join(CURRENT_ERA_PRESETS), "6"], version, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["version"] == version
    assert set(out["findings"]) == set(CURRENT_ERA_PRESETS)
    unknown = {p: [f for f in found if f[1] not in known and not any(
        f[0] == b.finding and b.signature in f[1] and f[1].endswith("/" + b.check) for b in shipped)]
        for p, found in out["findings"].items()}
    assert unknown == {p: [] for p in CURRENT_ERA_PRESETS}, unknown
    assert out["flush_replies"] > 0  # the programs reached a deferred flush, answered without error


# 0.5.19 to 0.5.21: the current family through compat's Change rows, on the paths kind.older_refusal lets through
OLDER_CURRENT_PRESETS = ("sglang", "sglang-paged", "sglang-priority", "sglang-pd-prefill", "sglang-pd-prefill-chunked",
                         "sglang-pd-prefill-optimistic")


@pytest.mark.releases
@pytest.mark.parametrize("version", compat.OLDER_CURRENT)
def test_the_plain_and_pd_prefill_presets_run_clean_on_0_5_19_to_0_5_21(version):
    """Random programs of the plain and PD-prefill presets find nothing on 0.5.19 to 0.5.21 (the same programs as
    on 0.5.22: a driver mistake in a Change row's branch shows as a crash or a leak here)."""
    r = run_child(["-c", CLEAN_CHILD, ",".join(OLDER_CURRENT_PRESETS), "6"], version, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["version"] == version
    assert out["findings"] == {p: [] for p in OLDER_CURRENT_PRESETS}, out["findings"]


@pytest.mark.releases
@pytest.mark.parametrize("version", compat.OLDER_CURRENT)
def test_a_mode_an_older_current_release_does_not_drive_is_refused_in_one_line(version, tmp_path):
    r = run_child(["-m", "kvaudit", "fuzz", "--target", "sglang", "--preset", "sglang-session", "--fuzzer", "random",
                   "--max-time", "5", "--out", str(tmp_path)], version)
    assert r.returncode == 69, r.stderr[-2000:]  # (a release this host lacks)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip() and "vllm._C" not in ln]
    assert len(lines) == 1 and version in lines[0] and "sessions" in lines[0], lines


# the child: health checks (FAKE_BOOTSTRAP_HOST: SGLang's own FakeKVSender, not kvaudit's) on a prefill server,
# beside a prompt they share nothing with and one whose prefix is cached; prints the findings and the checks done
HEALTH_CHILD = """
import json
from kvaudit.audit.runner import AuditedRun
from kvaudit.program import HealthCheck, Idle, Submit
from kvaudit.targets.sglang.boot import installed_version
from kvaudit.targets.sglang.config import SGLANG_PRESETS
config = SGLANG_PRESETS["sglang-pd-prefill"].config()
program = [Submit(0, 9, 2), Idle(), HealthCheck(), Submit(0, 9, 2), HealthCheck(), HealthCheck(), Idle()]
with AuditedRun(config) as run:
    for op in program:
        if run.apply(op):
            break
    done = sorted(r for r in run.target.finished if r.startswith("HEALTH_CHECK_"))
    print(json.dumps({"version": installed_version(), "findings": [[f.kind, f.signature] for f in run.findings],
                      "health_checks_done": len(done), "live": sorted(run.target.live_rids())}))
"""


@pytest.mark.releases
def test_a_health_check_on_0_5_20s_prefill_server_concludes_through_sglangs_fake_sender():
    """sglang#28652's stuck FakeKVSender (no zero-page last send before 0.5.21) needs a last chunk with no page
    to send; a FAKE_BOOTSTRAP_HOST request's decode prefix is always 0 (BaseKVSender.pop_decode_prefix_len), so
    its last chunk always carries a page and 0.5.20 concludes it (catalogue UNREACHED sglang-28652)."""
    out = json.loads(run_child(["-c", HEALTH_CHILD], "0.5.20").stdout.strip().splitlines()[-1])
    assert out["version"] == "0.5.20"
    assert out["findings"] == [] and out["live"] == []
    assert out["health_checks_done"] == 3


@pytest.mark.releases
@pytest.mark.parametrize("version,grouped,unreachable", [("0.5.18", True, 9), ("0.5.18", False, 0),
                                                         ("0.5.19", True, 0)])
def test_sglang_36081_on_sglangs_own_tree_and_allocator(version, grouped, unreachable):
    """sglang#36081 (issue 37's SWA candidate, 0.5.18 -> 0.5.19), by hand on SGLang's own objects (kvaudit's SWA
    feature does not run on these releases yet): two requests of one family checkpointed in one prefill batch's
    free group. On 0.5.18 A's grouped window free resolves at free_group_end, after B's insert re-pointed A's
    tombstoned full slots at B's SWA slots (RecoverSWAWithLockedFull): 9 SWA slots end up in use and mapped by
    nothing; without the group (the control), and on 0.5.19 (free_swa resolves at enqueue), none."""
    args = [os.path.join(ROOT, "tests", "sglang_36081_child.py"), *([] if grouped else ["ungrouped"])]
    r = run_child(args, version)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["version"] == version
    assert out["unreachable"] == unreachable and out["swa_used"] - out["swa_mapped"] == unreachable, out
    assert out["mapped_but_free"] == 0, out


@pytest.mark.releases
def test_presets_on_a_legacy_overlay_lists_only_what_it_drives():
    """``kvaudit presets --target sglang`` with SGLang 0.5.11's overlay first listed every preset."""
    r = run_child(["-m", "kvaudit", "presets", "--target", "sglang"], "0.5.11")
    assert r.returncode == 0, r.stderr[-2000:]
    listed = {line.split()[0] for line in r.stdout.splitlines()[1:] if line.startswith("  ")}
    assert listed == {"sglang", "sglang-session", "sglang-session-nonstreaming"}, r.stdout
