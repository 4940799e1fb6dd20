"""Shared checks for tests that plant a fault in an engine and fuzz until kvaudit reports it."""

from __future__ import annotations

import json
import random

from cli_helpers import invoke

from kvaudit import replay
from kvaudit.program import Idle, random_program
from kvaudit.audit.runner import Execution, execute


def first_finding_within(config, programs: int = 200, seed: str = "wrong-term") -> Execution:
    """The first of ``programs`` seeded random programs (41 ops, prompts up to 40 tokens) that yields
    a finding on ``config``; fails the test when none does."""
    rng = random.Random(seed)
    runs = (execute(config, random_program(rng, 41, max_prompt=40)) for _ in range(programs))
    ex = next((ex for ex in runs if ex.findings), None)
    assert ex is not None, f"the planted fault went unnoticed for {programs} random programs"
    return ex


def assert_names_both_tree_counters(f) -> None:
    """``f`` is the accounting drift of a leaf misbooked between the tree's evictable and protected
    counters, naming each counter beside its recount."""
    assert (f.kind, f.pool) == ("accounting-drift", "token_to_kv_pool"), f.summary()
    assert "tree counter evictable=" in f.message and "its nodes with lock_ref 0 hold" in f.message
    assert "tree counter protected=" in f.message and "its nodes with lock_ref > 0 hold" in f.message


def fuzz_fault(tmp_path, target: str, preset: str, bug: str, max_time: str = "60"):
    """``kvaudit fuzz --fuzzer random --seed 1`` with ``bug`` planted: asserts it exits 1 (a finding) and
    writes one reproducer; returns ``(doc, path)``, the reproducer's JSON and its file."""
    out = tmp_path / "out"
    r = invoke("fuzz", "--target", target, "--preset", preset, "--bug", bug, "--fuzzer", "random",
               "--max-time", max_time, "--seed", "1", "--out", str(out))
    assert r.exit_code == 1, r.output
    (path,) = out.glob("*.json")
    return json.loads(path.read_text()), path


def minimized_fault_program(path, max_ops: int):
    """The reproducer at ``path``: asserts its program has at most ``max_ops`` ops, finds something with
    its fault and nothing without it; returns ``(config, program)``."""
    config, program = replay.load(str(path))[:2]
    assert len(program) <= max_ops, program
    assert execute(config, list(program) + [Idle()], full_stacks=False).findings
    clean = config.replace(bugs=frozenset())
    assert execute(clean, list(program) + [Idle()], full_stacks=False).findings == []
    return config, program

