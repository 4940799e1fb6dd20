"""Tests for kvaudit.audit.kinds (the finding kinds' table) and the oracles' registry: a kind added as
one row reaches every writer with no other edit, and every kind an oracle can raise has a row."""

import io
import os
import re

import numpy as np
from rich.console import Console

from kvaudit.audit import kinds, oracles
from kvaudit.audit.findings import Finding, Site
from kvaudit.reports.junit import to_junit
from kvaudit.reports.report import finding_renderable
from kvaudit.reports.sarif import to_sarif
from kvaudit.targets.eut.presets import get_preset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROBE = kinds.FindingKind(
    "probe-kind", 3, "ProbeRule", "A probe kind's short description", "A probe kind's full description.",
    "warning", ("probe",),
    lambda f, what, site: f"Probe headline: {what} in pool {f.pool}",
    signature=lambda f: f"probed:{kinds.where(f.read_sites)}",
    console=lambda f: [("stack", "probed at:", f.read_sites), ("text", "probe fact line", "")],
    labels=(("read_sites", "probed at"),),
    facts=lambda f: ["probe junit fact"],
    props=lambda f: {"probe": True})


def _probe_finding() -> Finding:
    site = Site("engine_under_test/scheduler.py", 1, "probe_fn")
    return Finding(kind="probe-kind", pool="token_to_kv_pool", message="m", slots=[3], num_units=1,
                   read_sites=[site], op_index=0, step=1)


def test_a_kind_added_as_one_row_reaches_the_report_sarif_and_junit(monkeypatch):
    monkeypatch.setitem(kinds.BY_NAME, PROBE.name, PROBE)
    f = _probe_finding()
    assert f.summary() == "Probe headline: 1 slot in pool token_to_kv_pool"
    assert f.signature == "probe-kind/token_to_kv_pool/probed:probe_fn@scheduler.py"

    out = Console(file=io.StringIO(), width=200, color_system=None)
    out.print(finding_renderable(f, None, plain=True), soft_wrap=True)
    text = out.file.getvalue()
    assert "==ERROR: kvaudit: Probe headline: 1 slot in pool token_to_kv_pool" in text
    assert "probed at:" in text and "probe_fn" in text and "probe fact line" in text

    run = to_sarif([f])["runs"][0]
    rule = next(r for r in run["tool"]["driver"]["rules"] if r["id"] == "probe-kind")
    assert rule["name"] == "ProbeRule" and rule["shortDescription"]["text"] == PROBE.short
    assert rule["defaultConfiguration"]["level"] == "warning" and "probe" in rule["properties"]["tags"]
    result = run["results"][0]
    assert result["ruleId"] == "probe-kind" and result["level"] == "warning"
    assert result["message"]["text"].startswith("Probe headline")
    assert result["stacks"][0]["message"]["text"] == "probed at" and result["properties"]["probe"] is True

    xml = to_junit([f])
    assert 'message="Probe headline: 1 slot in pool token_to_kv_pool"' in xml
    assert "probe junit fact" in xml and "probed at:" in xml


def test_a_kind_with_no_row_still_renders_with_a_generic_one():
    f = Finding(kind="unheard-of", pool="p", message="m")
    assert f.summary() == "unheard-of in pool p: m"
    assert f.signature == "unheard-of/p/?"
    rule = to_sarif([f])["runs"][0]["tool"]["driver"]["rules"][-1]
    assert (rule["id"], rule["name"]) == ("unheard-of", "UnheardOf")


def _emitted_literals() -> set[str]:
    """Finding kinds named as literals where findings are made, in kvaudit/ and examples/."""
    pattern = re.compile(r'(?:kind="|Finding\(\s*"|_unit_finding\(\s*"|group_by_site\(\w+, ")([a-z-]+)"')
    found = set()
    for top in ("kvaudit", "examples"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            for name in files:
                if name.endswith(".py"):
                    with open(os.path.join(dirpath, name), encoding="utf-8") as fh:
                        found.update(pattern.findall(fh.read()))
    return found


def test_every_kind_an_oracle_can_emit_has_a_row():
    for oracle in oracles.ORACLES:
        assert set(oracle.emits) <= set(kinds.KINDS), oracle.name
    literals = _emitted_literals()
    assert len(literals) >= 8, literals  # the scan sees the oracles, the hooks and the runner
    assert literals <= set(kinds.KINDS), literals - set(kinds.KINDS)
    assert {k for o in oracles.ORACLES for k in o.emits} | literals == set(kinds.KINDS)


def test_an_oracle_left_out_of_the_list_does_not_run(monkeypatch):
    run_cfg = get_preset("default").config()
    from kvaudit.audit.runner import AuditedRun
    run = AuditedRun(run_cfg)
    try:
        run.target.engine.token_to_kv_pool_allocator.alloc(3)  # nobody holds these: a leak
        assert [f.kind for f in oracles.check(run.auditor, run.target)] == ["leak"]
        monkeypatch.setattr(oracles, "ORACLES", [o for o in oracles.ORACLES if o.name != "leaks"])
        found = oracles.check(run.auditor, run.target)
        assert "leak" not in [f.kind for f in found]
    finally:
        run.auditor.uninstall()


def test_the_runners_step_rows_judge_only_a_run_with_oracles(monkeypatch):
    """A ``"step"`` row (liveness) is asked after the steps of a run with oracles only: a bare run
    (``audit=False``) or a ledger-only one (``run_oracles=False``) calls neither its condition nor the
    stage (a throughput baseline pays nothing for the oracles' schedule)."""
    from kvaudit.audit.runner import AuditedRun
    from kvaudit.program import Step, Submit

    asked = []
    probe = oracles.Oracle("probe", "step", lambda run: asked.append(run) is None, lambda run: [], ())
    monkeypatch.setattr(oracles, "ORACLES", oracles.ORACLES + [probe])
    config = get_preset("default").config()
    for audit, run_oracles in ((False, False), (True, False), (True, True)):
        with AuditedRun(config, audit=audit, run_oracles=run_oracles, full_stacks=False) as run:
            assert run.apply(Submit(0, 8, 4)) == [] and run.apply(Step(3)) == []
        assert len(asked) == (3 if run_oracles else 0), (audit, run_oracles)


def test_oracle_conditions_scan_only_runs_only_what_a_mid_step_scan_may():
    s = oracles.Scan(None, None, idle=False, scan_only=True, by_pool={}, acc={}, free_lists={}, recounts={})
    p = oracles.PoolScan("pool", type("L", (), {"allocated": np.ones(4, dtype=bool)})(), np.ones(4, dtype=bool),
                         [np.arange(2)], [], [])
    ran = [o.name for o in oracles.ORACLES
           if (o.when(s, p) if o.stage == "pool" else o.stage == "engine" and o.when(s))]
    assert ran == ["leaks"]  # (use-after-free runs only when a referenced unit is free)
    s.scan_only, s.idle = False, True
    ran = [o.name for o in oracles.ORACLES
           if (o.when(s, p) if o.stage == "pool" else o.stage == "engine" and o.when(s))]
    assert ran == ["aliasing", "leaks", "target", "engine-check", "lock-balance"]


def test_a_double_free_with_no_free_site_says_so_in_its_headline_and_detail():
    """vLLM's ``finished-once`` check (a second ``request_finished``, no free the ledger saw) read
    "Double free of 1 block in pool block_pool, freed again at ?"."""
    free = Site("vllm/v1/core/sched/scheduler.py", 1700, "_free_request")
    bare = Finding(kind="double-free", pool="block_pool", message="m", unit="block", slots=[1], num_units=1)
    assert bare.summary() == "Double free of 1 block in pool block_pool, freed again at a site not recorded"
    assert "?" not in bare.summary()
    buf = io.StringIO()
    Console(file=buf, width=120, color_system=None).print(finding_renderable(bare, None, plain=True))
    assert re.search(r"freed again at:\n\s+\(no stack recorded\)", buf.getvalue()), buf.getvalue()
    seen = Finding(kind="double-free", pool="block_pool", message="m", unit="block", slots=[1], num_units=1,
                   free_sites=[free])
    assert seen.summary().endswith("freed again at scheduler.py:1700 in _free_request")
