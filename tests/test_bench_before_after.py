"""benchmarks/bench_before_after.py (issue 38's time to bug before and after): its arguments, the catalogues'
split, the medians with failed trials counted as never, and the table's ratios and geometric means."""

import importlib.util
import math
import os

import pytest

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def ba():
    spec = importlib.util.spec_from_file_location("bench_before_after",
                                                  os.path.join(HERE, "benchmarks", "bench_before_after.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _trial(bug, side, seed, execs=None, secs=None, cpu=None):
    return {"bug": bug, "side": side, "seed": seed, "success": execs is not None, "executions": execs,
            "seconds": secs, "cpu_to_hit": cpu}


def test_arguments_default_to_the_history_suite_and_refuse_one_checkout_twice(ba, tmp_path):
    args = ba.parse_args(["--before", str(tmp_path)])
    assert (args.suite, args.fuzzer, args.seeds, args.budget) == ("history", "corpus", 3, 20.0)
    assert args.after == HERE and args.before == str(tmp_path)
    with pytest.raises(SystemExit):
        ba.parse_args(["--before", HERE, "--after", HERE])
    with pytest.raises(SystemExit):
        ba.parse_args(["--before", str(tmp_path), "--seeds", "0"])
    with pytest.raises(SystemExit):
        ba.parse_args(["--before", str(tmp_path), "--after-check-every", "0"])
    assert ba.parse_args(["--before", str(tmp_path), "--after-check-every", "1"]).after_check_every == 1


def test_bugs_only_one_catalogue_has_are_split_off(ba):
    before = [{"id": "a", "version": "1"}, {"id": "b", "version": "1"}, {"id": "gone", "version": "1"}]
    after = [{"id": "new", "version": "2"}, {"id": "b", "version": "1"}, {"id": "a", "version": "9"}]
    both, only_before, only_after = ba.catalogues(before, after)
    assert both == ["b"]  # "a" moved to another release: not the same trial
    assert only_before == ["a", "gone"] and only_after == ["new", "a"]


def test_medians_count_a_failed_trial_as_never(ba):
    assert ba._median([1.0, None, 3.0]) == 3.0
    assert ba._median([1.0, None, None]) is None
    assert ba._median([2.0, 4.0]) == 3.0
    assert ba._median([]) is None


def test_the_table_gives_per_bug_ratios_and_the_geometric_means(ba):
    trials = [_trial("x", "before", s, 10, 2.0, 1.0) for s in (1, 2, 3)]
    trials += [_trial("x", "after", s, 10, 1.0, 0.5) for s in (1, 2, 3)]
    trials += [_trial("y", "before", 1, 4, 1.0, 1.0), _trial("y", "before", 2, 4, 1.0, 1.0),
               _trial("y", "before", 3)]
    trials += [_trial("y", "after", s, 4, 2.0, 2.0) for s in (1, 2, 3)]
    trials += [_trial("z", "before", 1, 5, 1.0, 1.0), _trial("z", "after", 1)]
    rows = ba.compare(trials, ["x", "y", "z"])
    assert rows[1]["before"]["hits"] == 2 and rows[1]["before"]["trials"] == 3
    assert rows[2]["after"]["seconds"] is None
    g, n = ba.geomean_ratio(rows, "seconds")
    assert n == 2 and math.isclose(g, 1.0)  # 0.5x and 2x
    g, n = ba.geomean_ratio(rows, "cpu_to_hit")
    assert n == 2 and math.isclose(g, 1.0)
    text = "\n".join(ba.table(rows))
    assert "| x | 3/3 | 3/3 | 10 | 10 | 2.00 | 1.00 | 0.50x | 1.00 | 0.50 | 0.50x |" in text
    assert "| z | 1/1 | 0/1 | 5 | - | 1.00 | - | - |" in text
    assert "above before: y, z (of them not reached after: z)" in text


def test_the_table_of_a_partial_json_file_shows_the_bugs_it_holds(ba, tmp_path, capsys):
    import json

    doc = {"suite": "history", "fuzzer": "corpus", "seeds": [1], "budget": 20, "bugs": ["x", "not-run"],
           "before": {"rev": "aaa"}, "after": {"rev": "bbb"},
           "trials": [_trial("x", "before", 1, 3, 1.0, 0.5), _trial("x", "after", 1, 3, 1.5, 0.5)]}
    (tmp_path / "run.json").write_text(json.dumps(doc))
    assert ba.print_table(str(tmp_path / "run.json")) == 0
    out = capsys.readouterr().out
    assert "1 of 2 bugs run" in out and "| x | 1/1 | 1/1 | 3 | 3 | 1.00 | 1.50 | 1.50x | 0.50 | 0.50 | 1.00x |" in out
    assert "not-run" not in out


def test_repeats_take_turns_between_the_sides_and_keep_each_trials_minimum(ba):
    # a fake child: executions fixed per seed, the seconds a function of the run, as a machine's load makes them
    order = []
    cpu = {("before", 0): 0.9, ("after", 0): 0.5, ("after", 1): 0.7, ("before", 1): 0.4,
           ("before", 2): 0.6, ("after", 2): 0.8}

    def run_side(side, r):
        order.append((side, r))
        return [{"seed": s, "success": True, "executions": 10 * s, "signature": "sig", "seconds": 2 * cpu[side, r] * s,
                 "cpu_to_hit": cpu[side, r] * s, "cpu": cpu[side, r] * s + 1} for s in (1, 2)]

    trials = ba.run_bug("x", 0, 3, run_side)
    assert order == [("before", 0), ("after", 0), ("after", 1), ("before", 1), ("before", 2), ("after", 2)]
    got = {(t["side"], t["seed"]): t for t in trials}
    assert {k: (t["cpu_to_hit"], t["seconds"], t["cpu"], t["executions"]) for k, t in got.items()} == {
        ("before", 1): (0.4, 0.8, 1.4, 10), ("before", 2): (0.8, 1.6, 1.8, 20),
        ("after", 1): (0.5, 1.0, 1.5, 10), ("after", 2): (1.0, 2.0, 2.0, 20)}
    assert [r["cpu_to_hit"] for r in got["after", 1]["repeats"]] == [0.5, 0.7, 0.8]  # in the order they ran
    assert all(t["bug"] == "x" for t in trials)
    order.clear()
    ba.run_bug("y", 1, 2, run_side)  # the next bug starts with the other side
    assert order == [("after", 0), ("before", 0), ("before", 1), ("after", 1)]


def test_one_repeat_keeps_the_trials_as_they_came(ba):
    def run_side(side, r):
        return [{"seed": 1, "success": True, "executions": 3, "seconds": 1.0, "cpu_to_hit": 0.5, "cpu": 0.6}]

    trials = ba.run_bug("x", 0, 1, run_side)
    assert [(t["side"], t["cpu_to_hit"]) for t in trials] == [("before", 0.5), ("after", 0.5)]
    assert "repeats" not in trials[0]


def test_a_repeat_that_missed_counts_as_never_and_one_that_hit_elsewhere_stops_the_run(ba):
    hit = {"bug": "x", "side": "after", "seed": 4, "success": True, "executions": 106, "signature": "s",
           "seconds": 30.0, "cpu_to_hit": 22.0, "cpu": 23.0}
    missed = {"bug": "x", "side": "after", "seed": 4, "success": False, "executions": 0, "signature": None,
              "seconds": None, "cpu_to_hit": None, "cpu": 40.0}
    t = ba.combine_repeats([missed, hit])
    assert t["success"] and (t["executions"], t["cpu_to_hit"], t["cpu"]) == (106, 22.0, 23.0)
    assert [r["success"] for r in t["repeats"]] == [False, True]
    assert not ba.combine_repeats([missed, missed])["success"]
    with pytest.raises(ba.RepeatMismatch, match="after seed 4: the repeats disagree"):
        ba.combine_repeats([hit, dict(hit, executions=107, cpu_to_hit=1.0)])
    with pytest.raises(ba.RepeatMismatch):
        ba.combine_repeats([hit, dict(hit, signature="other")])


def test_the_repeats_are_positive_and_named_in_the_table_header(ba, tmp_path, capsys):
    import json

    assert ba.parse_args(["--before", str(tmp_path)]).repeat == 1
    with pytest.raises(SystemExit):
        ba.parse_args(["--before", str(tmp_path), "--repeat", "0"])
    doc = {"suite": "history", "fuzzer": "corpus", "seeds": [1], "budget": 20, "bugs": ["x"], "repeat": 3,
           "before": {"rev": "aaa"}, "after": {"rev": "bbb"},
           "trials": [_trial("x", "before", 1, 3, 1.0, 0.5), _trial("x", "after", 1, 3, 1.5, 0.5)]}
    (tmp_path / "run.json").write_text(json.dumps(doc))
    ba.print_table(str(tmp_path / "run.json"))
    assert "the minimum of 3 runs per trial" in capsys.readouterr().out


def test_pycache_gives_the_children_a_bytecode_cache_even_where_the_environment_writes_none(ba, monkeypatch, tmp_path):
    # PYTHONDONTWRITEBYTECODE put the compilation of the vLLM target's source into vllm-49684's first trial
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    monkeypatch.delenv("PYTHONPYCACHEPREFIX", raising=False)
    plain = ba.child_env("/root", "/overlay")
    assert plain["PYTHONPATH"] == os.pathsep.join(["/overlay", "/root"]) and plain["PYTHONDONTWRITEBYTECODE"] == "1"
    assert "PYTHONPYCACHEPREFIX" not in plain
    cached = ba.child_env("/root", None, str(tmp_path / "pyc"))
    assert "PYTHONDONTWRITEBYTECODE" not in cached and cached["PYTHONPYCACHEPREFIX"] == str(tmp_path / "pyc")
    assert ba.parse_args(["--before", str(tmp_path), "--pycache", "d"]).pycache == "d"


def test_the_after_may_run_another_fuzzer_and_the_header_names_both(ba, tmp_path, capsys):
    """Issue 38 measures time to bug with each checkout's default fuzzer: corpus before, random-96 after."""
    import json

    assert ba.parse_args(["--before", str(tmp_path)]).after_fuzzer == "corpus"  # the same unless told
    args = ba.parse_args(["--before", str(tmp_path), "--fuzzer", "corpus", "--after-fuzzer", "random-96"])
    assert (args.fuzzer, args.after_fuzzer) == ("corpus", "random-96")
    doc = {"suite": "history", "fuzzer": "corpus", "after_fuzzer": "random-96", "seeds": [1], "budget": 20,
           "bugs": ["x"], "before": {"rev": "aaa"}, "after": {"rev": "bbb"},
           "trials": [_trial("x", "before", 1, 3, 1.0, 0.5), _trial("x", "after", 1, 3, 1.5, 0.5)]}
    (tmp_path / "run.json").write_text(json.dumps(doc))
    ba.print_table(str(tmp_path / "run.json"))
    assert "history, fuzzer corpus (before) / random-96 (after), seeds [1]" in capsys.readouterr().out


@pytest.mark.parametrize("flags, side", [(["--after-fuzzer", "random96"], "after"),
                                         (["--fuzzer", "random-96"], "before")])
def test_a_fuzzer_a_checkout_lacks_is_refused_before_any_trial(ba, tmp_path, monkeypatch, capsys, flags, side):
    """It failed with a child's traceback after the first bug's trials ran (tester 59)."""
    ran = []

    def child(root, args, overlay, pycache):
        ran.append(args[0])
        has = ["corpus", "random"] + (["random-96"] if root != str(tmp_path) else [])  # the before predates it
        return {"bugs": [{"id": "x"}], "fuzzers": has}

    monkeypatch.setattr(ba, "_child", child)
    monkeypatch.setattr(ba, "_rev", lambda root: "rev")
    with pytest.raises(SystemExit) as e:
        ba.main(["--before", str(tmp_path), "--suite", "zoo", "--bugs", "x", *flags])
    assert e.value.code == 2 and ran == ["list", "list"]  # no "run"
    line = capsys.readouterr().err.strip()
    assert line.startswith(f"bench_before_after: {flags[0]} {flags[1]}: the {side} (") and "\n" not in line, line
