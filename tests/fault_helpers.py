"""Shared checks for tests that plant a fault in an engine and fuzz until kvaudit reports it."""

from __future__ import annotations

import random

from kvaudit.program import random_program
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
