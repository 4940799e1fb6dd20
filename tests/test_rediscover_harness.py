"""benchmarks/rediscover_sglang.py as issue 38's guided-vs-random harness uses it: planted-bug cases, ops and
CPU to the first hit, and the corpus fuzzer equal to random at 16..96 ops within its warm-up."""

import importlib.util
import os

import pytest

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def harness():
    spec = importlib.util.spec_from_file_location("rediscover_sglang",
                                                  os.path.join(HERE, "benchmarks", "rediscover_sglang.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_planted_spec_switches_the_bug_on_and_overrides_fields(harness):
    name, config, wanted = harness.planted("eut:hicache:hicache-abort-loadback-leak:num_slots=256")
    assert name == "eut hicache hicache-abort-loadback-leak num_slots=256"
    assert config.bugs == frozenset(["hicache-abort-loadback-leak"]) and config.num_slots == 256
    assert wanted.wants("leak/anything")
    with pytest.raises(ValueError, match="TARGET:PRESET:BUG"):
        harness.planted("eut:hicache")


def test_corpus_is_random_96_within_its_warmup_and_ops_are_counted(harness, capsys):
    _, config, wanted = harness.planted("eut:hicache:hicache-abort-loadback-leak")
    rows = {}
    for fuzzer in ("random-96", "corpus", "random"):
        t = harness.trial(fuzzer, config, wanted, seed=1, budget=30, max_executions=200)
        assert t["hit"], t
        rows[fuzzer] = t
    # the same program at the same execution: the corpus fuzzer's first WARMUP programs are random's at 16..96
    assert rows["corpus"]["executions"] == rows["random-96"]["executions"]
    assert rows["corpus"]["ops"] == rows["random-96"]["ops"]
    for t in rows.values():  # every op of every program before the hit's (16..96 or 4..24 ops each), then its own
        least = 4 if t["fuzzer"] == "random" else 16
        assert t["ops"] >= least * (t["executions"] - 1) + 1 and t["cpu"] >= 0
    harness.print_table({("case", f): [dict(t, case="case")] for f, t in rows.items()}, ["random-96", "corpus"])
    out = capsys.readouterr().out
    assert f"| case | 1/1 | {rows['random-96']['executions']} / {rows['random-96']['ops']} / " in out
    assert "corpus: geomean random-96/corpus (> 1: corpus needs less): executions 1.0 (1 cases)" in out
