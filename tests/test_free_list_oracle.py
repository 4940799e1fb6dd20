"""The free-list oracle (``replay_free_list``) after its clean-case shortcut (docs/internals/performance.md,
stop 51): every list that is not exactly the free units, each once, is still a finding, and the shortcut's
guards (the count, a negative entry, an entry past the pool) each have a case that only they catch."""

from __future__ import annotations

import types

import numpy as np
import pytest

from kvaudit.audit.oracles.identity import replay_free_list

AUDITOR = types.SimpleNamespace(op_index=3, step=7)


def _check(allocated: np.ndarray, free) -> list:
    led = types.SimpleNamespace(allocated=allocated)
    return replay_free_list(AUDITOR, "token_to_kv_pool", led, np.asarray(free, dtype=np.int64))


def _exact(allocated: np.ndarray, free: list[int]) -> bool:
    """Clean: the list's entries inside the pool are every free unit once (the oracle's meaning, in Python:
    an entry outside ``[0, n)`` is passed over)."""
    n = allocated.size
    return sorted(u for u in free if 0 <= u < n) == [u for u in range(n) if not allocated[u]]


@pytest.fixture
def pool() -> np.ndarray:
    allocated = np.zeros(9, dtype=bool)
    allocated[[0, 1, 2, 5]] = True  # unit 0 is the reserved one: always allocated
    return allocated  # free: 3, 4, 6, 7, 8


def test_the_free_units_in_any_order_are_clean(pool):
    assert _check(pool, [8, 3, 7, 4, 6]) == []
    full = np.ones(9, dtype=bool)
    assert _check(full, []) == []


@pytest.mark.parametrize("free, what", [
    ([3, 4, 6, 7, 7], "8 missing and 7 listed twice: as many entries as free units"),
    ([3, 4, 6, 7, -1], "-1 for the free unit 8: numpy would read it as the last unit"),
    ([3, 4, 6, 7, 9], "an entry past the pool for the free unit 8"),
    ([3, 4, 6, 7, 5], "the allocated unit 5 for the free unit 8"),
    ([3, 4, 6, 7], "8 missing"),
    ([3, 4, 6, 7, 8, 5], "the allocated unit 5 listed too"),
    ([3, 4, 6, 7, 8, 8], "8 listed twice"),
    ([], "nothing listed"),
])
def test_every_wrong_list_is_a_finding(pool, free, what):
    found = _check(pool, free)
    assert [f.check for f in found] == ["free_list"], what
    assert (found[0].op_index, found[0].step) == (3, 7)


def test_the_verdict_is_the_exact_one_on_random_lists():
    rng = np.random.default_rng(51)
    for _ in range(2000):
        n = int(rng.integers(1, 12))
        allocated = rng.random(n) < 0.5
        allocated[0] = True
        free = [int(u) for u in np.flatnonzero(~allocated)]
        kind = rng.integers(4)
        if kind == 1 and free:  # one entry replaced by any value in [-n, 2n)
            free[int(rng.integers(len(free)))] = int(rng.integers(-n, 2 * n))
        elif kind == 2 and free:  # one entry dropped or doubled
            i = int(rng.integers(len(free)))
            free = free[:i] + free[i + 1:] if rng.random() < 0.5 else free + [free[i]]
        elif kind == 3:  # one more entry, any value
            free.append(int(rng.integers(-n, 2 * n)))
        rng.shuffle(free)
        assert (_check(allocated, free) == []) == _exact(allocated, free), (allocated.tolist(), free)
