"""The registry of fuzzers (kvaudit/search/fuzzers.py): a fuzzer a plugin module registers runs
under ``kvaudit fuzz --fuzzer NAME`` with no other file touched (tests/toyfuzzer_plugin.py); the
built-ins are listed in ``--help``; a name no fuzzer has is one line listing the valid ones."""

import json
import sys

import pytest

from cli_helpers import invoke, one_error_line
from kvaudit.search import fuzzers

PLUGIN = "toyfuzzer_plugin"


@pytest.fixture
def toy(monkeypatch, fresh_registry):
    """``KVAUDIT_PLUGINS=toyfuzzer_plugin``, imported afresh when a registry is first read."""
    monkeypatch.setenv("KVAUDIT_PLUGINS", PLUGIN)
    monkeypatch.delitem(sys.modules, PLUGIN, raising=False)
    yield
    sys.modules.pop(PLUGIN, None)


def test_a_plugin_fuzzer_finds_a_zoo_bug_under_kvaudit_fuzz(toy, tmp_path):
    out = tmp_path / "out"
    r = invoke("fuzz", "--fuzzer", "toy", "--max-time", "1", "--preset", "mixed-chunk",
               "--bug", "prefill-finish-leaks-row", "--out", str(out))
    assert r.exit_code == 1, r.output + r.stderr
    assert r.stderr.startswith("kvaudit fuzz: toy, preset mixed-chunk")
    (path,) = (out).glob("*.json")
    doc = json.loads(path.read_text())
    assert doc["fuzzer"] == "toy" and doc["findings"][0]["kind"] == "leak", doc["findings"][0]
    assert r.stdout.strip().splitlines()[-1].startswith("SUMMARY: kvaudit: 1 finding(s) (1 leak)")
    assert "registered no target kind" not in r.stderr  # it registered a fuzzer


def test_a_plugin_fuzzer_reports_a_clean_engine_clean(toy, tmp_path):
    r = invoke("fuzz", "--fuzzer", "toy", "--max-time", "1", "--preset", "mixed-chunk", "--out", str(tmp_path / "o"))
    assert r.exit_code == 0, r.output + r.stderr
    assert "no findings:" in r.stdout and not (tmp_path / "o").exists()


def test_a_plugin_fuzzer_that_cannot_run_a_campaign_is_refused_before_the_engine(toy, tmp_path):
    r = invoke("fuzz", "--fuzzer", "toy", "--max-time", "1", "--corpus", str(tmp_path / "c"))
    assert r.exit_code == 2, r.output
    assert "--fuzzer toy cannot run a campaign" in one_error_line(r)


def test_an_unknown_fuzzer_is_one_line_listing_the_valid_ones(toy):
    r = invoke("fuzz", "--fuzzer", "afl", "--max-time", "1")
    assert r.exit_code == 2, r.output
    line = one_error_line(r)
    assert "'afl' is not one of 'hypothesis', 'atheris', 'random', 'random-96', 'corpus', 'toy'" in line, line  # (click's)


def test_an_unknown_fuzzer_by_name_is_spelled_as_json():
    """fuzzers.get and kvaudit.testing.fuzz said ``unknown fuzzer 'afl'``."""
    from kvaudit import testing
    from kvaudit.targets.eut.presets import get_preset
    with pytest.raises(fuzzers.UnknownFuzzerError, match='^unknown fuzzer "afl" \\(valid: hypothesis, '):
        fuzzers.get("afl")
    with pytest.raises(ValueError, match='^unknown fuzzer "afl" \\(valid: hypothesis, '):
        testing.fuzz(get_preset("default").config(), max_time=1, fuzzer="afl")


def test_the_built_ins_are_listed_in_help():
    out = invoke("fuzz", "--help").stdout
    for name in fuzzers.BUILTIN_FUZZERS:
        assert f"{name}: {fuzzers.kinds()[name].summary.split()[0]}" in " ".join(out.split()), name
    assert "[hypothesis|atheris|random|random-96|corpus]" in out


def test_a_fuzzer_that_takes_some_targets_names_the_others():
    """atheris searches the built-in engine only: the error names the fuzzers that take the target."""
    kind = fuzzers.get("atheris")
    assert kind.takes("eut") and not kind.takes("vllm")
    assert fuzzers.alternatives("vllm", "atheris") == ["corpus", "hypothesis", "random", "random-96"]


@pytest.mark.parametrize("bad, why", [
    (dict(name="a b"), 'letters, digits.*got "a b"$'), (dict(summary="two\nlines"), r'one line of text, got "two\\nlines"$'),
    (dict(search=None), "search must be callable, got null$")])
def test_register_refuses_a_kind_that_breaks_the_interface(bad, why, monkeypatch):
    monkeypatch.setattr(fuzzers, "_FUZZERS", dict(fuzzers._FUZZERS))
    fields = dict(name="x", summary="one line", search=lambda *a: None) | bad
    with pytest.raises(fuzzers.FuzzerDefinitionError, match=why):
        fuzzers.register(fuzzers.FuzzerKind(**fields))


def _raises(config, seconds, seed, stats, run):
    stats.executions += 1
    raise ValueError("fuzzer bug")


def _empty(config, seconds, seed, stats, run):
    stats.executions += 1
    return [], []


def _ints(config, seconds, seed, stats, run):
    stats.executions += 1
    return [1, 2], [3]  # its findings were dropped as flaky, exit 0 "no findings"


def _exits(config, seconds, seed, stats, run):
    raise SystemExit(3)


def _oserror(config, seconds, seed, stats, run):
    open("/nonexistent/kvaudit-seeds")


def _gives_up(config, seconds, seed, stats, run):
    return None


@pytest.mark.parametrize("search, message", [
    (_raises, "fuzzer broken: its search raised ValueError: fuzzer bug"),
    (_empty, "fuzzer broken: its search must return None or (program, findings): a non-empty list of "
             "kvaudit.program ops and a non-empty list of Finding, got a tuple of (empty list, empty list)"),
    (_ints, "fuzzer broken: its search must return None or (program, findings): a non-empty list of "
            "kvaudit.program ops and a non-empty list of Finding, got a tuple of (list of int, list of int)"),
    (_exits, "fuzzer broken: its search raised SystemExit: 3"),
    (_oserror, "fuzzer broken: its search raised FileNotFoundError: [Errno 2] No such file or directory: "
               "'/nonexistent/kvaudit-seeds'"),
    (_gives_up, "fuzzer broken: its search returned None after 0.0 s of its 2.0 s budget with no program counted in "
                "stats.executions")], ids=["raises", "empty", "ints", "exits", "oserror", "gives-up"])
def test_a_plugin_fuzzers_mistake_is_one_line_naming_it_exit_2(search, message, monkeypatch, tmp_path):
    """A plugin fuzzer that raised was 'internal error: ValueError: fuzzer bug' (exit 70) with no name; one
    returning ([], []) 'internal error: StopIteration:'; one returning None at once 'the 2.0s search budget
    ended before the first program ran'. Each is now the plugin's mistake, named, exit 2."""
    monkeypatch.setattr(fuzzers, "_FUZZERS", dict(fuzzers._FUZZERS))
    fuzzers.register(fuzzers.FuzzerKind("broken", "a plugin with one mistake", search, campaign=False))
    r = invoke("fuzz", "--fuzzer", "broken", "--max-time", "2", "--out", str(tmp_path / "o"))
    assert r.exit_code == 2, r.output + r.stderr
    assert r.stderr.strip().splitlines()[-1] == f"kvaudit: error: {message}"
    assert fuzzers.get("random").search is fuzzers._FUZZERS["random"].search  # the built-ins are not wrapped


def test_a_hypothesis_search_leaves_one_state_machine_class_however_many_batches_it_ran():
    """Hypothesis keeps every state machine class it ran, with its rules and their strategies, for good
    (``RuleBasedStateMachine._setup_state_per_class``): a search that built a class per batch of 100 programs
    grew by ~370 objects a batch, without end (benchmarks/own_memory.py --fuzzer hypothesis). Counts, not time."""
    import gc

    from hypothesis import seed
    from hypothesis.stateful import RuleBasedStateMachine

    from kvaudit.search.fuzz import FuzzStats, hypothesis_search
    from kvaudit.targets.eut.presets import get_preset

    def machines() -> set:
        gc.collect()
        return {c for c in RuleBasedStateMachine.__subclasses__() if c.__module__ == "kvaudit.search.fuzz"}

    before, stats = machines(), FuzzStats()
    assert hypothesis_search(get_preset("default").config(), 1e9, 1, stats, batch_examples=3, max_steps=4,
                             max_executions=12) is None
    assert stats.executions == 12  # four batches at least
    assert len(machines() - before) == 1  # (a class per batch: 4 or more)

    def depth(cls) -> int:  # the settings @seed leaves on a class: re-applied per batch, not chained
        s, n = vars(cls).get("_hypothesis_internal_use_settings"), 0
        while s is not None:
            s, n = getattr(s, "_fallback", None), n + 1
        return n

    assert depth((machines() - before).pop()) == depth(seed(0)(type("Fresh", (), {})))


@pytest.mark.vllm
def test_after_start_up_full_collections_keep_up_with_the_programs_targets():
    """A tester's vllm-manager campaign grew ~3 KB a program, linearly: each program's target leaves
    reference cycles that only a full collection frees, and with vLLM and torch imported (~650,000 objects in
    the oldest generation) Python ran none for thousands of programs. After :func:`fuzzers.settle_heap` (the
    start-up's objects frozen) full collections come within 2,000 programs and the objects the collector
    tracks stay bounded. Counts, not time."""
    import gc

    from kvaudit.search.corpus_fuzz import corpus_search
    from kvaudit.search.fuzz import FuzzStats
    from kvaudit.targets import registry

    config = registry.get("vllm").preset("vllm-manager").config()
    corpus_search(config, 1e9, 0, FuzzStats(), max_executions=50)  # start-up: the engine imported and built
    try:
        assert fuzzers.settle_heap() > 100_000
        before, tracked = gc.get_stats()[2]["collections"], len(gc.get_objects())
        corpus_search(config, 1e9, 1, FuzzStats(), max_executions=2000, warmup=0)
        # (without the freeze: no full collection and +37,000 tracked objects; with it: 9 and +6,400)
        assert gc.get_stats()[2]["collections"] > before
        assert len(gc.get_objects()) - tracked < 15_000
    finally:
        gc.unfreeze()


@pytest.mark.parametrize("bug", [None, "chunked-abort-ignored"])
def test_random_96_draws_the_corpus_fuzzers_first_programs(bug):
    """``random-96`` (the default of a search that stops at its first finding) is the corpus fuzzer's
    warm-up: for a seed, the same programs (the same ops in all, on the clean engine), and the same
    program found at the same execution; what the corpus fuzzer adds starts after its 1,024th
    execution (docs/search/README.md)."""
    from kvaudit.search.fuzz import FuzzStats
    from kvaudit.targets import registry

    eut = registry.get("eut")
    config = eut.preset(eut.bugs()[bug].preset).config(bugs=frozenset([bug])) if bug else eut.preset("default").config()
    got = {}
    for name in ("random-96", "corpus", "random"):
        stats = FuzzStats()
        found = fuzzers.get(name).search(config, 60, 3, stats, fuzzers.Search(max_executions=30))
        assert (found is None) == (bug is None), f"{name}: {bug} not found in 30 executions"
        got[name] = (found and found[0], stats.executions, stats.ops)
    assert got["random-96"] == got["corpus"]
    if bug is None:  # 30 programs of 16-96 ops against random's own 4-24
        assert got["random"][2] < got["random-96"][2] and got["random-96"][2] >= 30 * 16


@pytest.mark.parametrize("fuzzer, noted", [("random-96", True), ("random", True), ("corpus", False), (None, False)])
def test_a_campaign_of_a_fuzzer_that_keeps_no_programs_says_a_rerun_resumes_only_its_findings(fuzzer, noted, tmp_path):
    """`--corpus DIR --fuzzer random-96` kept no programs and said nothing, and its rerun under the same --seed
    ran the same programs again (tester 59); kvaudit ci with such a fuzzer the same. A single search keeps
    nothing anyway: no note."""
    chosen = ["--fuzzer", fuzzer] if fuzzer else []
    r = invoke("fuzz", "--preset", "chunked", "--max-time", "0.5", "--corpus", str(tmp_path / "c"), *chosen)
    assert r.exit_code in (0, 5), r.output + r.stderr
    note = "keeps no programs: a rerun of this campaign resumes its findings only and, with the same --seed, runs"
    assert (note in " ".join(r.stderr.split())) == noted, r.stderr
    if noted:  # the fuzzers named instead resume and take the target (atheris: the built-in engine only)
        assert "(vary --seed, or use --fuzzer atheris or corpus)" in " ".join(r.stderr.split()), r.stderr
    if fuzzer:
        single = invoke("fuzz", "--preset", "chunked", "--max-time", "0.5", "--out", str(tmp_path / "o"), *chosen)
        assert "keeps no programs" not in single.stderr, single.stderr
        ci = invoke("ci", "--presets", "chunked", "--max-time", "0.5", "--out", str(tmp_path / "ci"), *chosen)
        assert ("keeps no programs" in ci.stderr) == noted, ci.stderr


def test_the_keeps_no_programs_note_names_only_fuzzers_that_take_the_target(capsys):
    """On a plugin's target the note offered atheris, which searches the built-in engine only (tester 59b)."""
    from rich.console import Console

    from kvaudit.app.configs import note_campaign_keeps_nothing

    err = Console(stderr=True, width=400)
    note_campaign_keeps_nothing("random-96", "minivllm", err)
    note_campaign_keeps_nothing("random-96", "eut", err)
    note_campaign_keeps_nothing("corpus", "eut", err)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2, lines
    assert lines[0].endswith("(vary --seed, or use --fuzzer corpus)") and "atheris" not in lines[0], lines
    assert lines[1].endswith("(vary --seed, or use --fuzzer atheris or corpus)"), lines
