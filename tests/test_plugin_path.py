"""The "audit your own engine" path as a newcomer walks it (docs/writing-a-target.md): a plugin kind
(``tests/rowtoy_plugin.py``: a config with no ``target`` field, a rows pool returning numpy arrays,
bugs as plain strings, no ``describe_busy``) fuzzed, replayed and reported from the command line."""

import glob
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from cli_helpers import invoke, one_error_line

from kvaudit import replay
from kvaudit.audit.hooks import Auditor
from kvaudit.audit.runner import execute
from kvaudit.program import Abort, Idle, Step, Submit
from kvaudit.targets import registry

registry.kinds()  # the built-ins register first, as in a command's run
import rowtoy_plugin  # noqa: E402  (registers the kind "rowtoy" in this process)

PLUGIN = "rowtoy_plugin"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def plugin(monkeypatch):
    monkeypatch.setenv("KVAUDIT_PLUGINS", PLUGIN)  # what a user sets


# -- 4. the rows-pool wrapper takes any sequence or array of ints ----------------------------------

class TorchRows:
    """A rows pool on torch: ``alloc`` returns an int32 tensor, ``free`` takes a tensor or a 0-d one."""

    def __init__(self, size):
        self.free_rows = list(range(1, size))

    def alloc(self, n):
        out, self.free_rows = self.free_rows[:n], self.free_rows[n:]
        return torch.tensor(out, dtype=torch.int32)

    def free(self, rows):
        self.free_rows += torch.as_tensor(rows).reshape(-1).tolist()


@pytest.mark.parametrize("engine_pool", ["numpy", "torch"])
def test_the_rows_wrapper_records_arrays_and_integer_scalars(engine_pool):
    target = rowtoy_plugin.RowToyTarget(rowtoy_plugin.RowToyConfig(size=16))
    if engine_pool == "torch":
        target.engine.pool = TorchRows(16)
    pool = target.engine.pool
    auditor = Auditor(target)
    try:
        held = auditor.ledgers["rows"].allocated  # (the reserved row 0 reads as held)
        rows = pool.alloc(5)
        got = np.asarray(rows.tolist(), dtype=np.int64)
        assert held[got].all() and held[1:].sum() == 5
        pool.free(rows[0])  # one row: an np.int64 / 0-d tensor scalar
        assert not held[got[0]] and held[1:].sum() == 4
        pool.free(rows[1:3])
        pool.free(int(r) for r in got[3:])  # a generator: the engine and the ledger both see every row
        assert held[1:].sum() == 0
        assert sorted(pool.free_rows.tolist() if engine_pool == "numpy" else pool.free_rows) == list(range(1, 16))
        with pytest.raises(TypeError, match=r"rows.free\(\) was given ndarray of float64, not row ids"):
            pool.free(np.array([1.0]))
    finally:
        auditor.uninstall()


def test_an_engine_returning_numpy_rows_runs_clean_and_its_leak_is_a_leak():
    """The wrapper crashed on ``if out:`` of an array (reported as the engine's crash)."""
    program = [Submit(prompt_len=4, max_new_tokens=3), Step(n=2), Idle()]
    clean = execute(rowtoy_plugin.PRESETS["rowtoy"].config(), program)
    assert clean.findings == []
    leaky = execute(rowtoy_plugin.PRESETS["rowtoy"].config(bugs={"abort-leak"}),
                    [Submit(prompt_len=4, max_new_tokens=3), Step(n=1), Abort(handle=0), Idle()])
    assert [f.kind for f in leaky.findings] == ["leak"], [f.message for f in leaky.findings]
    assert leaky.findings[0].pool == "rows"


def test_a_one_file_plugin_without_framework_classes_names_its_engine_frame_not_the_runner_s_caller(monkeypatch):
    """A plugin whose pool class shares the target's file (a newcomer's one-file toy) had that whole file
    skipped as the pool's: with no ``framework_classes``, the walk went past kvaudit to whatever ran it,
    and the leak's site was click's ``core.py in invoke`` (here: this test's frame)."""
    monkeypatch.setattr(rowtoy_plugin.RowToyTarget, "framework_classes", lambda self: [])
    leaky = execute(rowtoy_plugin.PRESETS["rowtoy"].config(bugs={"abort-leak"}),
                    [Submit(prompt_len=4, max_new_tokens=3), Step(n=1), Abort(handle=0), Idle()])
    (leak,) = leaky.findings
    site = leak.alloc_sites[0]
    assert (os.path.basename(site.file), site.source) == ("rowtoy_plugin.py", "r.rows = self.pool.alloc(r.prompt_len)")
    assert leak.signature == "leak/rows/step@rowtoy_plugin.py"


# -- 1. replay files name their kind -----------------------------------------------------------------

def found(out_dir):
    (path,) = glob.glob(os.path.join(str(out_dir), "*.json"))
    return path


def test_a_plugin_replay_file_names_its_kind_and_replays(tmp_path):
    """The file had no config.target (the config class has no such field), so 'replay FILE' read it
    as an eut config: 'bad config: unknown config key "size"', exit 2."""
    r = invoke("fuzz", "--target", "rowtoy", "--bug", "abort-leak", "--fuzzer", "random", "--max-time", "20",
               "--seed", "1", "--out", str(tmp_path))
    assert r.exit_code == 1, r.output
    path = found(tmp_path)
    assert f"(KVAUDIT_PLUGINS={PLUGIN} kvaudit replay {path})" in r.output  # the hint, runnable as printed
    doc = json.load(open(path))
    assert doc["config"]["target"] == "rowtoy" and doc["config"]["bugs"] == ["abort-leak"]
    r = invoke("replay", path)
    assert r.exit_code == 1, r.output + r.stderr
    assert "leak" in r.output


@pytest.mark.parametrize("command", [["report"], ["replay"], ["minimize"], ["export", "--issue", "i.md"]],
                         ids=lambda c: c[0])
def test_a_plugin_replay_file_without_its_plugin_says_how_to_load_it(tmp_path, command):
    """Read in a shell without KVAUDIT_PLUGINS, a plugin kind's file was 'bad config: unknown target', exit 2,
    as if the file were broken: one line naming the kind and how to load a plugin, and exit 69 (what this
    host lacks, as for atheris), whatever the command."""
    path = tmp_path / "rowtoy.json"
    config = registry.get("rowtoy").preset("rowtoy-leaky").config()
    replay.write_atomic(str(path), replay.to_doc(config, [Submit()], []))
    env = {k: v for k, v in os.environ.items() if k != "KVAUDIT_PLUGINS"} | {"PYTHONPATH": ROOT}
    r = subprocess.run([sys.executable, "-m", "kvaudit", command[0], str(path), *command[1:]], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 69, r.stdout + r.stderr
    assert r.stderr.splitlines() == [f'kvaudit: error: {path}: unknown target "rowtoy" (valid: eut, sglang, vllm; a '
                                     'target from a plugin needs KVAUDIT_PLUGINS=<module> or an installed '
                                     '"kvaudit.targets" entry point)'], r.stderr
    assert not (tmp_path / "i.md").exists()


def test_ci_labels_a_plugin_replay_file_without_its_plugin_unavailable_not_malformed(tmp_path):
    """tester 57: in `kvaudit ci`'s JUnit such a file was an error of type "malformed" and its line said
    "FAILED: malformed: ...": the file is fine, the plugin is missing. Still a failed check (exit 1)."""
    regs = tmp_path / "regs"
    regs.mkdir()
    config = registry.get("rowtoy").preset("rowtoy-leaky").config()
    replay.write_atomic(str(regs / "rowtoy.json"), replay.to_doc(config, [Submit()], []))
    env = {k: v for k, v in os.environ.items() if k != "KVAUDIT_PLUGINS"} | {"PYTHONPATH": ROOT}
    r = subprocess.run([sys.executable, "-m", "kvaudit", "ci", "--max-time", "0", "--regressions", str(regs),
                        "--junit", "ci.xml"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    assert 'regression rowtoy: FAILED: unavailable: ' in r.stderr and "malformed" not in r.stderr, r.stderr
    xml = (tmp_path / "ci.xml").read_text()
    assert 'type="unavailable"' in xml and 'type="malformed"' not in xml


def test_every_kind_writes_its_name_and_reads_it_back():
    from kvaudit.targets import config_from_dict, config_to_dict
    for name, kind in registry.kinds().items():
        config = kind.preset("default").config()
        doc = replay.to_doc(config, [Submit()], [])
        assert doc["config"]["target"] == name
        assert config_from_dict(json.loads(json.dumps(doc["config"]))) == config, name
        assert config_to_dict(config) == doc["config"]


REPLAY_FILES = sorted(p for pat in ("corpora/**/*.json", "tests/data/**/*.json")
                      for p in glob.glob(os.path.join(ROOT, pat), recursive=True)
                      if '"kvaudit.replay/1"' in open(p).read())


def test_existing_replay_files_load_as_before_and_round_trip():
    """Files written before (19 with no config.target: eut) load as they did, and writing their
    config back names the kind they were read as."""
    from kvaudit.targets import config_from_dict
    assert len(REPLAY_FILES) > 20
    untargeted = 0
    for path in REPLAY_FILES:
        doc = json.load(open(path))
        try:
            config = replay.load(path)[0]
        except replay.ReplayFormatError as e:  # a preset of another release (the vLLM overlays'): read there
            assert re.search(r'bad config: preset "[^"]+": .*vLLM .*, not ', str(e)), e
            continue
        untargeted += "target" not in doc["config"]
        expect = doc["config"].get("target", "eut")
        assert registry.kind_of(config).name == expect, path
        written = replay.to_doc(config, [], [])["config"]
        assert written["target"] == expect, path
        assert {k: written[k] for k in doc["config"]} == doc["config"], path  # (newer fields: at their defaults)
        assert config_from_dict(written) == config, path
    assert untargeted


def test_a_plugin_campaign_hands_its_config_to_the_search(tmp_path):
    """A campaign (--corpus) passes the config to its search loop as a replay file's config object."""
    r = invoke("fuzz", "--target", "rowtoy", "--preset", "rowtoy", "--fuzzer", "random", "--max-time", "3",
               "--corpus", str(tmp_path / "camp"))
    assert r.exit_code == 0, r.output + r.stderr
    assert "unknown config key" not in r.output + r.stderr


# -- the console script, as a user runs it: plugins from the current directory ----------------------------

def test_the_installed_console_script_loads_a_plugin_module_from_the_current_directory(tmp_path):
    """``KVAUDIT_PLUGINS=examples.minivllm.target kvaudit fuzz --target minivllm`` exited 2 from the
    checkout ("No module named 'examples'"): the console script, unlike ``python -m kvaudit``, does not
    put the current directory on sys.path, and the in-process tests never noticed."""
    import subprocess
    import sys

    from cli_helpers import kvaudit_script, plain_env

    (tmp_path / "cwd_rowtoy.py").write_text(open(os.path.join(ROOT, "tests", "rowtoy_plugin.py")).read()
                                            .replace('name="rowtoy"', 'name="cwdrowtoy"'))
    # the code under test and nothing else: not the current directory, not tests/ (an empty entry would be it)
    env = {**plain_env(), "PYTHONPATH": ROOT, "KVAUDIT_PLUGINS": "cwd_rowtoy"}
    where = subprocess.run([sys.executable, "-c", "import kvaudit; print(kvaudit.__file__)"], env=env,
                           cwd=tmp_path, capture_output=True, text=True, check=True).stdout.strip()
    assert where == os.path.join(ROOT, "kvaudit", "__init__.py")
    r = subprocess.run([kvaudit_script(), "fuzz", "--target", "cwdrowtoy", "--preset", "rowtoy-leaky", "--fuzzer",
                        "random", "--max-time", "20", "--seed", "1", "--out", "out"], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr
    assert "cannot import" not in r.stderr
    doc = json.load(open(found(tmp_path / "out")))
    assert doc["config"]["target"] == "cwdrowtoy" and doc["findings"][0]["pool"] == "rows"
    # the replay hint runs as printed, in a shell without KVAUDIT_PLUGINS ('kvaudit replay FILE' alone: exit 69,
    # 'unknown target "cwdrowtoy"')
    (hint,) = [line.split("   (", 1)[1][:-1] for line in r.stdout.splitlines() if line.startswith("replay file: ")]
    assert hint.startswith("KVAUDIT_PLUGINS=cwd_rowtoy kvaudit replay "), hint
    env.pop("KVAUDIT_PLUGINS")
    env["PATH"] = os.path.dirname(kvaudit_script()) + os.pathsep + env.get("PATH", "")
    again = subprocess.run(["sh", "-c", hint], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert again.returncode == 1 and "Direct leak" in again.stdout, again.stderr


# -- 2, 3. --bug adds to the preset's bugs; unknown names are refused for every kind --------------------

def test_fuzz_keeps_the_presets_bugs_and_bug_adds_to_them(tmp_path):
    """fuzz --preset rowtoy-leaky printed "bugs: none" and ran clean (ci kept the preset's bugs)."""
    r = invoke("fuzz", "--target", "rowtoy", "--preset", "rowtoy-leaky", "--fuzzer", "random", "--max-time", "20",
               "--seed", "1", "--out", str(tmp_path / "a"))
    assert "preset rowtoy-leaky, bugs: abort-leak," in r.stderr
    assert r.exit_code == 1, r.output + r.stderr
    assert json.load(open(found(tmp_path / "a")))["config"]["bugs"] == ["abort-leak"]
    from kvaudit.app.configs import select_config
    config = select_config("rowtoy-leaky", ("stuck",), "none", "cpu", None, "rowtoy")
    assert config.bugs == {"abort-leak", "stuck"} and config.preset == "rowtoy-leaky"
    assert select_config("rowtoy", (), "none", "cpu", None, "rowtoy").bugs == set()


@pytest.mark.parametrize("target, line", [
    ("rowtoy", 'unknown bug "nonexistent" for --target rowtoy; valid bugs: abort-leak, stuck'),
    ("eut", 'unknown bug "nonexistent"; valid bugs: '),
    ("vllm", 'unknown fault "nonexistent" for --target vllm; valid faults: '),
])
def test_an_unknown_bug_is_one_line_exit_2_for_every_kind(tmp_path, target, line):
    """--target rowtoy --bug nonexistent ran a clean fuzz (exit 0)."""
    r = invoke("fuzz", "--target", target, "--bug", "nonexistent", "--max-time", "1", "--out", str(tmp_path))
    assert r.exit_code == 2, r.output + r.stderr
    assert line in one_error_line(r)


# -- 5. a hang of a target without describe_busy ---------------------------------------------------------

def test_a_hang_without_describe_busy_does_not_end_in_a_bare_colon():
    ex = execute(rowtoy_plugin.PRESETS["rowtoy"].config(bugs={"stuck"}), [Submit(prompt_len=2, max_new_tokens=2),
                                                                         Idle()])
    (hang,) = ex.findings
    assert hang.kind == "hang"
    assert hang.message == "engine not idle after 2000 steps of idle() (the target's describe_busy() names nothing)"


def test_the_writing_a_target_page_names_every_kind_field_and_the_config_needs():
    """The page left out ``summary`` (required), ``capabilities`` (its example uses it), ``num_slots``
    (ConfigBase's docstring requires it), ``framework_classes`` and ``describe_busy``."""
    import dataclasses

    page = open(os.path.join(ROOT, "docs", "writing-a-target.md")).read()
    missing = [f.name for f in dataclasses.fields(registry.TargetKind) if f"`{f.name}" not in page]
    assert missing == [], missing
    for name in ("num_slots", "context_len", "framework_classes", "describe_busy", "SimpleNamespace(finding="):
        assert f"`{name}" in page, name


# -- reports of a plugin's findings: the kind, not a 'target' field, decides -----------------------

def test_a_report_of_several_cases_names_the_plugins_kind_and_loads_back(tmp_path):
    """The top-level config of a several-case report was ``config.to_dict()``: read back as eut."""
    from kvaudit.reports.outputs import Case, ReportData

    config = rowtoy_plugin.PRESETS["rowtoy"].config(bugs={"abort-leak"})
    program = [Submit(prompt_len=4, max_new_tokens=3), Step(n=1), Abort(handle=0), Idle()]
    leaky = execute(config, program)
    data = ReportData(config, [Case(program, leaky.findings), Case([Idle()], [])], {}, {})
    path = tmp_path / "report.json"
    path.write_text(json.dumps(data.doc()))
    top, cases, _ = replay.load_cases(str(path))
    assert top == config and [c[0] for c in cases] == [config, config]


def test_sarif_anchors_a_plugins_frameless_finding_at_its_own_config_class():
    """A finding with no frame (a hang) of a kind with no anchor was anchored in the built-in engine
    (``engine_under_test/scheduler.py``): to_sarif took the kind from a ``target`` field this config
    does not have."""
    import inspect

    from kvaudit.audit.findings import Finding
    from kvaudit.reports.sarif import to_sarif

    hang = Finding(kind="hang", pool="-", message="engine not idle", op_index=1, step=3)
    (r,) = to_sarif([hang], rowtoy_plugin.PRESETS["rowtoy"].config())["runs"][0]["results"]
    phys = r["locations"][0]["physicalLocation"]
    assert phys["artifactLocation"]["uri"] == "tests/rowtoy_plugin.py"
    assert phys["region"]["startLine"] == inspect.getsourcelines(rowtoy_plugin.RowToyConfig)[1]
