"""An op is one row of the schema (kvaudit.program.schema.OPS): a probe op added there, plus the built-in
engine's application of it, is drawn by the Hypothesis machine with no other file changed -- its rule,
its swarm group, its op type, its byte decoding and its minimizer's simplifications come from the row;
the export, which needs the engine to say how, refuses it by name."""

from __future__ import annotations

import dataclasses
import json
import os
import random

import pytest

from cli_helpers import invoke, one_error_line
from kvaudit.program import Idle, Submit, make_op
from kvaudit.program.bytes_program import program_from_bytes, program_to_bytes
from kvaudit.program.ops import op_from_dict, op_to_dict, op_type
from kvaudit.program.schema import OPS, Arg, OpSpec, swarm_groups
from kvaudit.search.fuzz import FuzzStats, hypothesis_search
from kvaudit.search.minimize import _simpler
from kvaudit.targets.eut.presets import get_preset
from kvaudit.targets.eut.target import EutTarget

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROBE = OpSpec("probe", args=(Arg("n", 0, 0, 3),))


@pytest.fixture
def probe(monkeypatch):
    """The probe op in the schema (last, a swarm group of its own) and applied by the built-in engine's
    target as a no-op that is counted: the list of ops it applied."""
    monkeypatch.setitem(OPS, "probe", PROBE)
    applied = []
    real = EutTarget.apply

    def apply(self, op):
        if op.kind == "probe":
            applied.append(op)
        else:
            real(self, op)

    monkeypatch.setattr(EutTarget, "apply", apply)
    return applied


def test_a_probe_op_in_the_schema_gets_a_hypothesis_rule_that_fires(probe):
    assert "probe" in swarm_groups()  # its own swarm group: a case may draw it or leave it out
    hypothesis_search(get_preset("default").config(), max_time=60, seed_value=1, stats=FuzzStats(),
                      max_executions=40, swarm=True)
    assert probe, "the probe op's rule never fired"
    assert len({op.n for op in probe}) > 1 and {op.n for op in probe} <= {0, 1, 2, 3}  # drawn from the row's range


def test_a_probe_op_is_a_type_a_json_op_a_byte_record_and_simplifies(probe):
    op = make_op("probe", {"n": 3}, frozenset(), 32)
    assert op.kind == "probe" and op.n == 3 and op_type("probe") is type(op)
    assert op_from_dict(op_to_dict(op)) == op
    # its low end, half its value, then one less (kvaudit.search.minimize._below)
    assert _simpler(op) == [dataclasses.replace(op, n=c) for c in (0, 1, 2)]
    config = get_preset("default").config()
    program = [Submit(0, 4, 2), op, Idle()]
    assert program_from_bytes(program_to_bytes(program, config), config) == program
    rng = random.Random(0)
    drawn = {program_from_bytes(bytes([0xF2] + [rng.randrange(256) for _ in range(60)]), config)[0].kind
             for _ in range(400)}
    assert "probe" in drawn  # version 2 opcodes index the schema's kinds


def test_the_export_refuses_an_op_it_has_no_mapping_for_by_name(probe, tmp_path):
    """How an op becomes HTTP calls is the engine's to say: an op with no mapping is a one-line error
    that names it (it was left out of the client script without a word)."""
    doc = json.load(open(os.path.join(ROOT, "corpora", "sglang", "crash-a1-checkpoint-into-tree-after-abort.json")))
    doc["program"].insert(1, {"op": "probe", "n": 1})
    (tmp_path / "probe.json").write_text(json.dumps(doc))
    r = invoke("export", str(tmp_path / "probe.json"), "--client", str(tmp_path / "c.py"), "--no-resolve")
    assert r.exit_code == 2, r.output
    assert "op 1 (probe)" in one_error_line(r)
    assert not (tmp_path / "c.py").exists()


def test_the_existing_swarm_groups_keep_their_order():
    """Hypothesis draws a case's swarm from this tuple: its order is part of what a seed means."""
    assert swarm_groups()[:7] == ("submit", "health_check", "abort", "flush_cache", "memory_pressure", "sessions",
                                  "pause")
    assert {k: s.swarm for k, s in OPS.items() if s.swarm != k} == {
        "open_session": "sessions", "close_session": "sessions", "pause_generation": "pause",
        "continue_generation": "pause", "transfer_fail": "abort", "step": None, "idle": None}
