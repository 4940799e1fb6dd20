"""corpora/vllm: every replay file kept there reproduces its recorded finding on vLLM 0.33.0, replays
deterministically, and is written up in corpora/vllm/README.md."""

import os

import pytest

from kvaudit import replay
from kvaudit.audit.runner import execute

CORPUS = os.path.join(os.path.dirname(__file__), "..", "corpora", "vllm")
NAMES = sorted(n for n in os.listdir(CORPUS) if n.endswith(".json"))
# vLLM's own findings on 0.33.0: not regressions (ci wants a file clean without its switches), kept apart
OWN = sorted(os.path.join("own", n) for n in os.listdir(os.path.join(CORPUS, "own")) if n.endswith(".json"))


@pytest.mark.vllm
@pytest.mark.parametrize("name", NAMES + OWN)
def test_every_vllm_corpus_file_reproduces_its_finding_twice_alike(name):
    config, program, recorded, _ = replay.load(os.path.join(CORPUS, name))
    assert config.target == "vllm"
    first, second = execute(config, program), execute(config, program)
    assert recorded[0].signature in first.signatures
    assert first.ops_run == len(program)  # minimized: the finding comes at the last op
    assert (first.digest, sorted(first.signatures)) == (second.digest, sorted(second.signatures))


@pytest.mark.vllm
@pytest.mark.parametrize("name", [n for n in NAMES if n.startswith("fault-")])
def test_an_injected_faults_file_is_clean_without_the_fault(name):
    """The finding is the fault's: the same program on vLLM as shipped finds nothing (own/: vLLM's own)."""
    config, program, _, _ = replay.load(os.path.join(CORPUS, name))
    assert config.bugs
    assert execute(config.replace(bugs=frozenset()), program).signatures == []


@pytest.mark.vllm
@pytest.mark.parametrize("name", sorted(os.listdir(os.path.join(CORPUS, "findings"))))
def test_each_finding_of_vllms_own_reproduces_minimized_twice_alike(name):
    """corpora/vllm/findings/: vLLM 0.33.0's own findings, no fault on (outside the ci regressions, which
    must be clean without their faults)."""
    config, program, recorded, _ = replay.load(os.path.join(CORPUS, "findings", name))
    assert config.target == "vllm" and not config.bugs
    first, second = execute(config, program), execute(config, program)
    assert recorded[0].signature in first.signatures and first.ops_run == len(program)
    assert (first.digest, sorted(first.signatures)) == (second.digest, sorted(second.signatures))
    assert f"`findings/{name}`" in open(os.path.join(CORPUS, "README.md")).read()


def test_every_vllm_corpus_file_has_a_written_analysis():
    notes = open(os.path.join(CORPUS, "README.md")).read()
    assert NAMES and OWN
    for name in NAMES + OWN:
        assert f"`{name}`" in notes, name


@pytest.mark.vllm
def test_replay_update_keeps_the_engines_verdict_after_the_drain(tmp_path):
    """A file written by fuzz records vLLM's own arithmetic once drained to idle (here: a negative
    ref_cnt); --update re-recorded it without the drain and lost that line."""
    import json
    import shutil

    from cli_helpers import invoke

    path = tmp_path / "f.json"
    shutil.copy(os.path.join(CORPUS, "fault-double-free-shared-prefix.json"), path)
    before = json.loads(path.read_text())["findings"][0]["engine_check_at_idle"]
    assert before and "negative ref_cnt" in before[0]
    result = invoke("replay", "--update", str(path))
    assert result.exit_code == 0, result.output
    assert json.loads(path.read_text())["findings"][0]["engine_check_at_idle"] == before


def test_a_vllm_hash_map_finding_is_not_said_to_be_cached_into_a_tree():
    """vLLM has no radix tree: a target invariant's drift names the block's allocation, as any finding."""
    from cli_helpers import invoke

    result = invoke("report", os.path.join(CORPUS, "fault-drop-hash-entry.json"))
    assert result.exit_code == 0, result.output
    assert "cached into the tree" not in result.stdout and "allocated at:" in result.stdout


def _key(findings) -> list[tuple[str, int, int]]:
    return [(f.signature, f.op_index, f.step) for f in findings]


@pytest.mark.vllm
@pytest.mark.parametrize("name", NAMES)
def test_every_vllm_corpus_file_on_the_search_schedule_reports_the_per_step_run(name):
    """A search's sparse schedule (kvaudit.search.schedule.search_run: a full check every K steps, and
    after every step while the target is transient: a step in flight under vLLM's guard, an idle engine)
    reports what the per-step audit does: signature, first op and step (the in-flight use-after-frees too)."""
    from kvaudit.search.schedule import search_run

    config, program, _, _ = replay.load(os.path.join(CORPUS, name))
    want = _key(execute(config, program, full_stacks=False).findings)
    with search_run(config) as run:
        for op in program:
            if run.apply(op):
                break
        else:
            run.finish()
    assert run.check_every > 1
    assert want and _key(run.findings) == want


@pytest.mark.vllm
@pytest.mark.parametrize("preset, sparse", [("vllm", True), ("vllm-kv-connector", False)])
def test_a_sparse_vllm_run_checks_every_step_only_while_a_guarded_step_is_in_flight(preset, sparse, monkeypatch):
    """The synchronous Scheduler has no step in flight between steps: its busy steps go unchecked between
    the sparse checks. The AsyncScheduler with a KV consumer (vLLM's guard) has one in flight at each busy
    step, and each is checked."""
    from kvaudit.audit import runner
    from kvaudit.program import Step, Submit
    from kvaudit.targets import registry

    config = registry.get("vllm").preset(preset).config()
    calls = []
    real = runner.oracles.check
    # what each full check met: a step in flight, or an idle engine
    monkeypatch.setattr(runner.oracles, "check",
                        lambda *a, **k: calls.append(bool(a[1].batch_queue) or a[1].is_idle()) or real(*a, **k))
    with runner.AuditedRun(config, full_stacks=False, check_every=10**6) as run:
        for op in [Submit(0, 40, 12, ignore_eos=1), Submit(1, 24, 10, ignore_eos=1), Step(30)]:
            assert run.apply(op) == []
        busy = run.target.steps
    assert busy >= 10
    assert (len(calls) < 3) if sparse else (len(calls) >= busy // 2 and all(calls))


@pytest.mark.vllm
def test_an_old_file_with_another_machines_site_packages_paths_reads_as_vllms_own_here(tmp_path):
    """Files recorded before 2026-12 carry the recording machine's absolute paths: they still load, and
    their frames print from vLLM's package, checked against the vLLM installed here."""
    import json

    from cli_helpers import invoke

    doc = json.load(open(os.path.join(CORPUS, "fault-free-under-inflight-step.json")))
    site = doc["findings"][0]["free_sites"][0]
    site["file"] = "/elsewhere/lib/python3.11/site-packages/" + site["file"].split("site-packages/")[-1]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(doc))
    result = invoke("report", str(path))
    assert result.exit_code == 0, result.output
    frame = result.output.split("freed (too early) at:")[1].splitlines()[1:3]
    assert frame[0].split()[-1] == f"vllm/v1/core/sched/scheduler.py:{site['line']}", frame
    assert frame[1].strip() == site["source"] and "/elsewhere/" not in result.output, frame


def test_every_vllm_file_counts_the_block_pool_in_blocks():
    """vLLM's pool unit is a block. Files recorded before the pool was declared in blocks said "unit": "page"
    ("Double free of 16 slots (1 page)", "16 distinct slot(s)") where a replay today says "1 block"."""
    import glob
    import json
    root = os.path.join(os.path.dirname(__file__), "..")
    paths = glob.glob(os.path.join(CORPUS, "**", "*.json"), recursive=True) + \
        glob.glob(os.path.join(root, "tests", "data", "vllm_releases", "*.json"))
    units = {}
    for path in paths:
        with open(path) as f:
            doc = json.load(f)
        for finding in doc.get("findings", []) if isinstance(doc, dict) else []:
            if finding.get("pool") == "block_pool" and finding.get("slots"):
                units.setdefault(finding.get("unit"), []).append(os.path.relpath(path, root))
    assert set(units) == {"block"}, {u: p for u, p in units.items() if u != "block"}
