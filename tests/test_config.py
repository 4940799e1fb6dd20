"""kvaudit/config.py: what every target's config shares. A config error names the value a user wrote in
JSON or TOML as JSON spells it (``got true`` / ``got null``), not as Python prints it (``got True``)."""

import json
import os
import re

import pytest

from cli_helpers import invoke, one_error_line
from kvaudit.config import json_value
from kvaudit.targets import config_from_dict, config_to_dict


@pytest.mark.parametrize("config, said", [
    ({"target": "sglang", "fake_bootstrap_every": True}, "fake_bootstrap_every must be null or a positive integer, got true"),
    ({"target": "sglang", "enable_overlap": None}, "enable_overlap must be true or false, got null"),
    ({"target": "sglang", "tree_core": "go"}, 'got "go"'),
    ({"target": "vllm", "async_scheduling": None}, "async_scheduling must be true or false, got null"),
    ({"target": "vllm", "block_size": False}, "got false"),
    ({"target": "eut", "enable_overlap": None}, "enable_overlap must be true or false, got null"),
    ({"target": "eut", "num_slots": True}, "num_slots must be an integer, got true"),
    ({"target": "vllm", "kv_connector": 5}, 'kv_connector must be one of null, "NixlConnector"'),
    ({"target": "sglang", "disaggregation_mode": None}, 'must be "null", "decode" or "prefill" (strings'),
    ({"target": "eut", "disaggregation_mode": "x"}, 'disaggregation_mode must be null or "decode", got "x"'),
    ({"target": "eut", "model": "big"}, 'model must be "tiny" or "none", got "big"'),
], ids=["sglang-true", "sglang-null", "sglang-string", "vllm-null", "vllm-false", "eut-null", "eut-true",
        "vllm-choices", "sglang-null-string", "eut-choices", "eut-model"])
def test_a_config_error_spells_the_value_as_json(config, said):
    with pytest.raises(ValueError) as e:
        config_from_dict(config)
    assert said in str(e.value)
    assert "True" not in str(e.value) and "None" not in str(e.value) and "False" not in str(e.value)


@pytest.mark.parametrize("config, said", [({"target": None}, "config.target must be a string, got null"),
                                          ([1, True], "config must be an object, got [1, true]")])
def test_a_config_s_target_and_shape_are_spelled_as_json(config, said):
    with pytest.raises(ValueError, match=re.escape(said)):
        config_from_dict(config)


def test_json_value_falls_back_to_repr_for_what_json_cannot_hold():
    assert [json_value(v) for v in (True, None, 3, "x", [1, None])] == ["true", "null", "3", '"x"', "[1, null]"]
    assert json_value({1, 2}) == repr({1, 2})


def test_json_value_spells_what_json_cannot_as_toml_does():
    """A TOML date said ``got datetime.date(2024, 1, 1)`` and nan ``NaN`` (json.dumps' word, not JSON's)."""
    import datetime

    values = (datetime.date(2024, 1, 1), datetime.datetime(2024, 1, 1, 7, 32), datetime.time(7, 32),
              float("nan"), float("inf"), -float("inf"), ["a", float("nan")], ("rows", "rows"))
    assert [json_value(v) for v in values] == ["2024-01-01", "2024-01-01T07:32:00", "07:32:00", "nan", "inf", "-inf",
                                               '["a", nan]', '["rows", "rows"]']


def test_json_value_cuts_a_long_spelling_inside_its_quotes():
    """``json_value(x)[:60]`` cut off a long string's closing quote; the limit cuts its inside instead and
    never splits an escape."""
    assert json_value("x" * 500, 20) == '"' + "x" * 15 + '..."'
    assert json_value('a"' * 50, 12) == r'"a\"a\"a..."'
    assert json_value("\u00e9" * 9, 16) == r'"\u00e9..."'
    assert json_value([1] * 100, 12) == "[1, 1, 1,..."
    assert json_value("short", 8) == '"short"' and json_value(True, 8) == "true"
    assert all(len(json_value(v, 30)) <= 30 for v in ("x" * 99, 'a"' * 99, [None] * 99, {"k": "v" * 99}))


def test_replay_of_a_config_with_a_bad_value_exits_2_naming_it_as_json(tmp_path):
    path = tmp_path / "in.json"
    path.write_text(json.dumps({"format": "kvaudit.replay/1", "program": [],
                                "config": {"target": "sglang", "fake_bootstrap_every": True}}))
    result = invoke("replay", str(path))
    assert result.exit_code == 2, result.output
    assert one_error_line(result).endswith("fake_bootstrap_every must be null or a positive integer, got true")


@pytest.mark.parametrize("config, said", [
    ({"target": "eut", "bugs": True}, "bugs must be a list of bug names, got true"),
    ({"target": "vllm", "bugs": "skip-free"}, 'bugs must be a list of fault names, got "skip-free"'),
    ({"target": "eut", "bogus_key": 1}, 'unknown config key "bogus_key"'),
    ({"target": "sglang", "num_slots": 3}, "num_slots must hold at least 4 pages of page_size=1 tokens and at most "
                                           "1048576 tokens, got 3"),
], ids=["bugs-true", "bugs-string", "unknown-key", "num-slots"])
def test_config_messages_name_the_value_as_json(config, said):
    """Stop 49's note: ``bugs must be a list of bug names`` said nothing of the value, ``unknown config key
    'bogus_key'`` quoted it as Python does, ``num_slots=3 must hold ...`` put the value first."""
    with pytest.raises(ValueError) as e:
        config_from_dict(config)
    assert said in str(e.value) and "'" not in str(e.value).split(";")[0]


def test_a_config_of_another_target_is_named_as_such(tmp_path):
    # a replay file whose "target" was changed by hand read 'unknown config key "chunked_prefill_size"',
    # naming neither cause (tester, stop 55)
    from kvaudit.targets.eut.presets import get_preset

    d = config_to_dict(get_preset("default").config())
    d["target"] = "vllm"
    with pytest.raises(ValueError) as e:
        config_from_dict(d)
    assert str(e.value).endswith('the config\'s keys are those of target eut, its "target" says "vllm"'), str(e.value)
    with pytest.raises(ValueError) as e:  # a key no kind has: as before
        config_from_dict({"target": "vllm", "bogus_key": 1})
    assert str(e.value) == 'unknown config key "bogus_key"'


@pytest.mark.parametrize("args, said", [
    (["fuzz", "--preset", "nope"], 'unknown preset "nope"; valid presets: '),
    (["fuzz", "--target", "sglang", "--preset", "nope"], 'unknown preset "nope" for --target sglang; valid presets: '),
    (["fuzz", "--target", "nope"], 'unknown target "nope" (valid: '),
    (["ci", "--presets", "default,nope"], 'unknown preset "nope" (valid: '),
])
def test_unknown_names_are_quoted_as_json_strings(args, said):
    result = invoke(*args)
    assert result.exit_code == 2, result.output
    assert said in one_error_line(result)


@pytest.mark.parametrize("change, said", [
    (lambda d: d["config"].update(preset="nope"), 'bad config: unknown preset "nope" (valid: '),
    (lambda d: d["findings"][0].update(slots=True), "slots: want a list, got true"),
    (lambda d: d["findings"][0].update(slots=[1, -2]), "slots: want a list of integers >= 0, got [1, -2]"),
    (lambda d: d["findings"][0].update(unit="bytes"), 'unit: want one of "slot", "page", "row", "block", got "bytes"'),
    (lambda d: d["findings"][0].update(op_index="3"), 'op_index: want an integer >= -1, got "3"'),
    (lambda d: d["findings"][0].update(bogus=1), 'unknown field "bogus"'),
    (lambda d: d["findings"][0]["alloc_sites"][0].update(line=None), "alloc_sites[0].line: want an integer >= 0, "
                                                                     "got null"),
    # stop 61's note: --seed takes 0 or more, and the vLLM and SGLang targets' config seeds too; these were taken
    (lambda d: d.update(seed=-3), "bad seed: want an integer >= 0 (--seed), got -3"),
    (lambda d: d["config"].update(seed=-3), "bad config: seed must be in [0, 9223372036854775807], got -3"),
], ids=["preset", "slots-true", "slots-negative", "unit", "op-index", "unknown-field", "site-line", "seed-negative",
        "config-seed-negative"])
def test_replay_messages_name_the_value_as_json(tmp_path, change, said):
    """The findings section said ``slots: want list, not True`` (Python's type name and repr)."""
    doc = json.load(open(os.path.join(os.path.dirname(__file__), "data", "report", "hisparse-prebuilt-skip-finish.json")))
    change(doc)
    path = tmp_path / "in.json"
    path.write_text(json.dumps(doc))
    result = invoke("report", str(path))
    assert result.exit_code == 2, result.output
    assert said in one_error_line(result)


def test_json_value_spells_a_dicts_keys_and_values_each():
    """A target's accounting() keyed by an undeclared pool was shown whole as Python's repr,
    ``{'other': Accounting(...)}`` (tester t54): the keys are JSON, a value JSON cannot hold its repr."""
    class Obj:
        def __repr__(self):
            return "Obj()"

    assert json_value({"other": Obj(), "n": [1, None]}) == '{"other": Obj(), "n": [1, null]}'
    assert json_value({"a": 1, "b": True}) == '{"a": 1, "b": true}'


def test_shown_path_escapes_what_is_not_utf8_or_not_printable_and_keeps_the_rest():
    from kvaudit.config import shown_path

    assert shown_path(os.fsdecode(b"camp\xff/x.json")) == "camp\\xff/x.json"
    assert shown_path(b"a\xfe") == "a\\xfe" and shown_path("new\nline") == "new\\nline"
    assert shown_path("\ud800x") == "\\ud800x"  # (a surrogate os.fsdecode never makes)
    assert shown_path("d/é ok.json") == "d/é ok.json"


@pytest.mark.parametrize("config, said", [
    ({"num_slots": 1 << 22, "enable_hicache": True, "hicache_ratio": 16},
     "num_slots x hicache_ratio (the host pool, tokens) must be at most 4194304, got 4194304 x 16"),
    ({"num_slots": 1 << 21, "enable_hisparse": True, "disable_radix_cache": True, "hisparse_host_ratio": 4},
     "num_slots x hisparse_host_ratio (the host pool, tokens) must be at most 4194304, got 2097152 x 4"),
    ({"max_req_rows": 4096, "context_len": 1 << 15},
     "max_req_rows x context_len (the request-row table, entries) must be at most 16777216, got 4096 x 32768"),
    ({"disaggregation_mode": "decode", "disable_radix_cache": True, "max_req_rows": 4096, "pd_pre_alloc_rows": 4096,
      "context_len": 4096},
     "(max_req_rows + pd_pre_alloc_rows) x context_len (the request-row table, entries) must be at most 16777216, "
     "got 8192 x 4096"),
    ({"model": "tiny", "context_len": (1 << 12) + 1},
     'context_len must be at most 4096 with model "tiny" (its attention scores, heads x context_len x context_len '
     'floats), got 4097'),
], ids=["hicache", "hisparse", "rows", "pd-rows", "tiny-model"])
def test_a_built_in_engine_config_whose_tables_take_gbs_is_refused(config, said):
    """th64: every field in its range, yet the engine's start built 16 GiB of host K and V (hicache_ratio 16 over
    4194304 slots: an out-of-memory crash, exit 70) or a 1-2 GiB request-row table. Refused when the config is
    read, before any engine is built; the presets and every recorded file stay well inside."""
    with pytest.raises(ValueError) as e:
        config_from_dict({"target": "eut", **config})
    assert str(e.value) == said
    config_from_dict({"target": "eut", **config, "num_slots": 1 << 10, "context_len": 1 << 10})  # (these pass)


@pytest.mark.parametrize("on, ratio", [({"enable_hicache": True}, "hicache_ratio"),
                                       ({"enable_hisparse": True, "disable_radix_cache": True}, "hisparse_host_ratio")])
def test_a_host_pool_is_bounded_by_the_whole_pages_the_engine_allocates(on, ratio):
    """The host pool's bound multiplied num_slots, but the engine sizes a host pool from the device pool's whole
    pages (EngineConfig.total_tokens x the ratio, engine_under_test/scheduler.py): 262159 slots of 16-token pages
    are 262144 tokens, 4194304 host slots at ratio 16, the bound itself, yet the config was refused."""
    from engine_under_test.scheduler import Scheduler

    config = {"target": "eut", **on, "page_size": 16, ratio: 16}
    small = config_from_dict({**config, "num_slots": 16 * 4 + 15, "model": "none"})  # (what the engine builds)
    pool = Scheduler(small).hicache_host_pool if ratio == "hicache_ratio" else \
        Scheduler(small).hisparse_coordinator.host_pool
    assert pool.size == small.total_tokens * 16 == 64 * 16
    fits = config_from_dict({**config, "num_slots": (1 << 18) + 15})
    assert fits.total_tokens * getattr(fits, ratio) == 1 << 22  # (what the engine's host pool holds)
    with pytest.raises(ValueError) as e:
        config_from_dict({**config, "num_slots": (1 << 18) + 16 + 5})
    assert str(e.value) == (f"num_slots x {ratio} (the host pool, tokens) must be at most 4194304, got "
                            f"262160 (num_slots 262165 in whole pages of 16) x 16")


def test_a_replay_file_whose_tiny_model_takes_gbs_is_refused_in_one_line(tmp_path):
    """ts64: `--model tiny` builds heads x n x n attention scores for a prefill of n tokens: a replay file's config at
    context_len 32768 (every field in its range) allocated about 8 GiB per forward. Refused when the file is read
    (exit 2, one line), as the engine's other tables are; the same file at the bound replays."""
    here = os.path.dirname(os.path.abspath(__file__))
    doc = json.load(open(os.path.join(here, "..", "corpora", "regressions", "retract-unaligned-page.json")))
    for context, code in ((1 << 15, 2), (1 << 12, 0)):
        path = tmp_path / f"tiny-{context}.json"
        path.write_text(json.dumps({**doc, "config": {**doc["config"], "model": "tiny", "context_len": context}}))
        r = invoke("replay", str(path))
        if code == 2:
            assert r.exit_code == 2, r.output
            assert 'context_len must be at most 4096 with model "tiny"' in one_error_line(r), r.output
        else:
            assert r.exit_code in (0, 1), r.output  # (a tiny model may change the tokens, so the finding)
