"""kvaudit.program.schema: one table the ops, every generator and the byte decoder read.

The reach tests draw programs from each generator (random, the Hypothesis rules, the version 2
byte decoder) and check pairwise coverage: for every op the schema defines for a target's reach,
every argument takes each of its value classes (default / None / another value), and every pair of
arguments takes every combination of classes the schema allows together (``replace`` with and
without a ``parent``, a priority on a session turn, ...).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import random
import time

import pytest

from kvaudit.targets.eut.presets import get_preset
from kvaudit.search import fuzz, schedule
from kvaudit.program import OP_TYPES, Submit, random_program
from kvaudit.program.bytes_program import V2_MAGIC, program_from_bytes, program_to_bytes, version_of
from kvaudit.program.schema import (CAPABILITIES, FEATURES, OPS, kinds, pick, resolve, resolve_submit)

ALL = frozenset(FEATURES) | frozenset(CAPABILITIES)
DATA = os.path.join(os.path.dirname(__file__), "data", "bytes_v1_programs.json")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_ops_are_the_schema():
    assert set(OP_TYPES) == set(OPS)
    for kind, cls in OP_TYPES.items():
        fields = dataclasses.fields(cls)
        assert [f.name for f in fields] == [a.name for a in OPS[kind].args], kind
        assert [f.default for f in fields] == [a.default for a in OPS[kind].args], kind


def test_resolve_applies_requires_and_caps():
    values = {a.name: a.unset for a in OPS["submit"].args} | {"prompt_len": 40, "ignore_eos": 1, "replace": 1,
                                                               "priority": 3}
    out = resolve("submit", values, ALL, 40)
    assert (out["prompt_len"], out["ignore_eos"], out["replace"], out["priority"]) == (40, 0, 0, 3)
    out = resolve("submit", values | {"extends": 2, "stop_at": 5, "session": 1}, ALL, 40)
    assert 1 <= out["prompt_len"] <= 16 and out["ignore_eos"] == 1 and out["replace"] == 1
    assert resolve("submit", values | {"session": 0}, frozenset(), 40)["session"] is None  # no sessions modelled
    assert resolve("submit", values, frozenset(), 40)["priority"] is None


# -- pairwise reach ---------------------------------------------------------------------------------

def _cls(arg, v) -> str:
    return "default" if v == arg.default else "none" if v is None else "set"


def _classes(arg, reach) -> set:
    if arg.gate is not None and arg.gate not in reach:
        return {"default"}
    out = {"default", "set"}
    if arg.nullable and arg.default is not None:
        out.add("none")
    return out


def _pair_classes(arg, reach) -> set:
    """An argument always drawn (``p == 1``) is a value of its range: any value pairs with the others."""
    return _classes(arg, reach) - ({"default"} if arg.p >= 1.0 else set())


def _allowed(spec, a, ca, b, cb) -> bool:
    """Whether classes ``ca`` of ``a`` and ``cb`` of ``b`` can hold together (``requires``)."""
    for x, cx, y, cy in ((a, ca, b, cb), (b, cb, a, ca)):
        if x.requires == y.name and cx != _cls(x, x.unset) and cy == _cls(y, y.unset):
            return False
    return True


def _wanted(reach) -> set:
    want = set()
    for kind in kinds(reach):
        spec = OPS[kind]
        want.add((kind,))
        for a in spec.args:
            want |= {(kind, a.name, c) for c in _classes(a, reach)}
        for a, b in itertools.combinations(spec.args, 2):
            want |= {(kind, a.name, ca, b.name, cb) for ca in _pair_classes(a, reach) for cb in _pair_classes(b, reach)
                     if _allowed(spec, a, ca, b, cb)}
    return want


def _seen(ops) -> set:
    seen = set()
    for op in ops:
        args = OPS[op.kind].args
        seen.add((op.kind,))
        seen |= {(op.kind, a.name, _cls(a, getattr(op, a.name))) for a in args}
        seen |= {(op.kind, a.name, _cls(a, getattr(op, a.name)), b.name, _cls(b, getattr(op, b.name)))
                 for a, b in itertools.combinations(args, 2)}
    return seen


def _missing(ops, reach) -> list:
    return sorted(_wanted(reach) - _seen(ops), key=str)[:12]


def test_random_programs_reach_every_op_and_argument_pair():
    rng = random.Random(1)
    ops = [op for _ in range(400) for op in random_program(rng, 24, 40, frozenset(FEATURES))]
    assert not _missing(ops, ALL)


def test_version_2_bytes_reach_every_op_and_argument_pair(monkeypatch):
    config = get_preset("streaming-session").config()
    monkeypatch.setattr("kvaudit.program.bytes_program.reach", lambda config: ALL)
    rng = random.Random(2)
    ops = [op for _ in range(600)
           for op in program_from_bytes(bytes([V2_MAGIC]) + rng.randbytes(14 * 24), config)]
    assert not _missing(ops, ALL)


class _NullRun:
    """AuditedRun for generator tests: records the ops, runs no engine."""

    def __init__(self, *a, **kw):
        self.out_of_time, self.suppressed = False, []
        self.auditor = type("A", (), {"site_keys": staticmethod(set)})()
        self.target = type("T", (), {"reach": staticmethod(dict)})()  # (AuditedRun.target: its counts)

    def apply(self, op):
        _NullRun.ops.append(op)
        return []

    def finish(self):
        return []

    def close(self):
        pass


def test_hypothesis_rules_reach_every_op_and_argument_pair(monkeypatch):
    from hypothesis import HealthCheck, Phase, Verbosity, seed, settings
    from hypothesis.stateful import run_state_machine_as_test

    _NullRun.ops = []
    monkeypatch.setattr(schedule, "AuditedRun", _NullRun)
    monkeypatch.setattr(fuzz, "program_reach", lambda config: ALL)
    rec = fuzz._Recorder(fuzz.FuzzStats(), deadline=time.monotonic() + 3600)
    machine = seed(3)(fuzz._machine(get_preset("streaming-session").config(), rec, max_prompt=40, swarm=False))
    run_state_machine_as_test(machine, settings=settings(
        max_examples=300, stateful_step_count=24, deadline=None, database=None, phases=[Phase.generate],
        suppress_health_check=list(HealthCheck), verbosity=Verbosity.quiet))
    assert not _missing(_NullRun.ops, ALL)


@pytest.mark.parametrize("preset", ["default", "pd-decode", "streaming-session", "priority"])
def test_generators_keep_to_the_target(preset, monkeypatch):
    """What a target does not model is never drawn: no session ops without sessions, no priority
    without priority scheduling (the reach tests above show the rest is)."""
    from kvaudit.program.schema import reach

    config = get_preset(preset).config()
    r = reach(config)
    rng = random.Random(4)
    ops = [op for _ in range(150) for op in program_from_bytes(bytes([V2_MAGIC]) + rng.randbytes(14 * 24), config)]
    assert {op.kind for op in ops} == set(kinds(r))
    for op in ops:
        for a in OPS[op.kind].args:
            if a.gate is not None and a.gate not in r:
                assert getattr(op, a.name) == a.unset, (preset, op)


# -- the byte decoder's versions ---------------------------------------------------------------------

def test_version_1_decoding_is_unchanged():
    """The programs of every shipped v1 seed and of fixed random inputs, as the decoder wrote them
    before version 2 (recorded from that code into tests/data/bytes_v1_programs.json)."""
    from kvaudit.targets.eut.presets import PRESETS
    from kvaudit.program import program_to_json

    want = json.load(open(DATA))
    inputs = [bytes.fromhex(h) for h in want["inputs"]]
    assert all(version_of(d) == 1 for d in inputs)
    for preset in PRESETS:
        config = get_preset(preset).config()
        assert [program_to_json(program_from_bytes(d, config)) for d in inputs] == want["random"][preset], preset
    assert len(want["seeds"]) == 78
    for rel, rec in want["seeds"].items():
        data = open(os.path.join(ROOT, rel), "rb").read()
        preset = os.path.basename(os.path.dirname(rel))
        assert version_of(data) == 1 and hashlib.sha1(data).hexdigest() == rec["sha1"], rel
        assert program_to_json(program_from_bytes(data, get_preset(preset).config())) == rec["program"], rel


def test_version_2_round_trips_what_version_1_cannot_write():
    from kvaudit.program import ContinueGeneration, FlushCache, Idle, OpenSession, PauseGeneration

    config = get_preset("streaming-session").config()
    program = [OpenSession(), Submit(3, 9, 5, stop_at=2, session=0, extends=1, ignore_eos=1), Idle(),
               PauseGeneration(2), FlushCache(), ContinueGeneration(), Idle()]
    with pytest.raises(ValueError):
        program_to_bytes(program, config, 1)
    data = program_to_bytes(program, config)
    assert data[0] == V2_MAGIC and program_from_bytes(data, config) == program
    with pytest.raises(ValueError, match="priority"):  # the built-in engine's preset has no priority scheduling
        program_to_bytes([Submit(priority=1)], config)


def test_version_2_one_byte_changes_one_op():
    config = get_preset("streaming-session").config()
    rng = random.Random(7)
    for _ in range(200):
        data = bytearray([V2_MAGIC]) + bytearray(rng.randbytes(14 * 10))
        before = program_from_bytes(bytes(data), config)[:10]
        pos = rng.randrange(1, len(data))
        data[pos] = rng.randrange(256)
        after = program_from_bytes(bytes(data), config)[:10]
        assert [i for i in range(10) if before[i] != after[i]] in ([], [(pos - 1) // 14])


# -- building a request ------------------------------------------------------------------------------

def test_resolve_submit_builds_the_prompt_the_targets_build():
    texts = {"a": [5, 6, 7], "b": list(range(2, 40))}
    op = Submit(2, 30, 9, extends=3, session=1)
    eut = resolve_submit(op, 128, max_new_cap=64 // 2, prompt_cap=lambda mn: 64 - mn, submitted=["a", "b"],
                         text_of=texts.get, sessions=["s0", "s1", "s2"])
    assert eut.max_new_tokens == 9 and eut.session == "s1" and eut.stop_at is None
    from kvaudit.program import prompt_tokens
    assert eut.input_ids == (texts["b"] + prompt_tokens(2, 30))[:55]
    sgl = resolve_submit(Submit(1, 50, 30), 128, max_new_cap=64 // 4, prompt_cap=64 // 2)
    assert sgl.max_new_tokens == 16 and sgl.input_ids == prompt_tokens(1, 32) and sgl.session is None
    assert pick(None, [1]) is None and pick(5, []) is None and pick(5, [1, 2]) == 2
