"""benchmarks/bytecodes.py, the benchmarks' shared ``--opcodes`` counter: counts that follow the work done, and
the functions an audited run adds, code objects of one name summed."""

import collections
import importlib.util
import os

import pytest

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def bc():
    spec = importlib.util.spec_from_file_location("bytecodes", os.path.join(HERE, "benchmarks", "bytecodes.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _loop(n: int) -> int:
    total = 0
    for i in range(n):
        total += i
    return total


def _twice(n: int) -> None:
    _loop(n)
    _loop(n)


def test_a_count_grows_with_the_work_and_repeats_exactly(bc):
    small, big = bc.count(_loop, 10), bc.count(_loop, 110)
    assert [c.co_name for c in small] == ["_loop"]
    # the same run counts the same; 100 iterations more add the same bytecodes for each iteration
    assert bc.count(_loop, 10) == small
    per = (sum(big.values()) - sum(small.values())) / 100
    assert per == int(per) and per > 2
    assert sum(bc.count(_loop, 210).values()) - sum(big.values()) == 100 * per


def test_added_sums_the_code_objects_of_one_name_and_subtracts_the_bare_run(bc):
    bare, audited = bc.count(_loop, 10), bc.count(_twice, 10)
    more = bc.added(audited, bare)
    loop = sum(bare.values())
    assert more[bc.name(_loop.__code__)] == loop  # twice less once
    assert more[bc.name(_twice.__code__)] == audited[_twice.__code__] > 0
    assert sum(more.values()) == sum(audited.values()) - loop
    # two code objects of one name (two lambdas in one function) count as one function
    got = bc.count(_two_lambdas)
    lambdas = [(c, n) for c, n in got.items() if c.co_name == "<lambda>"]
    assert len(lambdas) == 2
    assert bc.added(got, collections.Counter())[bc.name(lambdas[0][0])] == sum(n for _, n in lambdas)


def _two_lambdas() -> int:
    return (lambda: 1)() + (lambda: 2)()
