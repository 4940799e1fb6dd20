"""The built-in engine's own memory check run bare (kvaudit/targets/eut/engine_check.py), reached through
the eut kind's registry entry as ``kvaudit bench`` and benchmarks/engine_check.py reach it."""

import os

from kvaudit import replay
from kvaudit.targets import registry

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(name):
    config, program, _, _ = replay.load(os.path.join(ROOT, "corpora", "regressions", name))
    return config, program


def test_the_engines_idle_check_fails_where_the_zoo_bug_is_on_and_never_with_it_off():
    config, program = _load("chunked-abort-ignored.json")
    check = registry.get("eut").engine_check
    assert check(config, program) == (2, 2)
    assert check(config.replace(bugs=frozenset()), program) == (None, None)


def test_a_bug_only_the_busy_check_sees_has_no_idle_step():
    config, program = _load("session-borrow-double-count.json")
    assert registry.get("eut").engine_check(config, program) == (None, 1)


def test_a_bug_the_engines_checks_never_see():
    config, program = _load("aborted-kv-inserted.json")
    assert registry.get("eut").engine_check(config, program) == (None, None)
