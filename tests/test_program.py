"""Tests for kvaudit.program: the op model, its JSON form and its printed form."""

import json
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvaudit.program import (FEATURES, OP_TYPES, Abort, CloseSession, ContinueGeneration, FlushCache, HealthCheck, Idle,
                             MemoryPressure, OpenSession, PauseGeneration, ProgramError, Step, Submit, TransferFail, format_op, format_program, op_from_dict, op_to_dict, program_from_json, program_to_json,
                             prompt_tokens, random_program)

EVERY_KIND = [
    Submit(family=2, prompt_len=9, max_new_tokens=5, stop_at=3),
    Submit(),
    Submit(family=1, prompt_len=3, session=2, extends=5),
    Submit(family=3, priority=7, ignore_eos=1),
    Submit(priority=0, grammar=2),
    Submit(session=1, parent=0, replace=1, drop_previous_output=1, offset=5),
    HealthCheck(),
    Abort(handle=3),
    Abort(handle=None),
    FlushCache(),
    FlushCache(timeout=4),
    OpenSession(),
    CloseSession(handle=1),
    MemoryPressure(),
    PauseGeneration(mode=2),
    PauseGeneration(),
    ContinueGeneration(),
    TransferFail(handle=2),
    TransferFail(handle=None),
    Step(n=4),
    Idle(),
]

ops_strategy = st.one_of(
    st.builds(Submit, st.integers(0, 50), st.integers(0, 200), st.integers(0, 200), st.none() | st.integers(0, 200),
              st.none() | st.integers(0, 9), st.none() | st.integers(0, 9), st.none() | st.integers(0, 9),
              st.integers(0, 1), st.none() | st.integers(0, 9), st.none() | st.integers(0, 9), st.integers(0, 1),
              st.integers(0, 1), st.none() | st.integers(0, 50)),
    st.builds(FlushCache, st.integers(0, 20)),
    st.builds(PauseGeneration, st.integers(0, 2)),
    st.just(ContinueGeneration()),
    st.just(OpenSession()),
    st.builds(CloseSession, st.integers(0, 9)),
    st.just(MemoryPressure()),
    st.just(HealthCheck()),
    st.builds(Abort, st.none() | st.integers(0, 50)),
    st.builds(TransferFail, st.none() | st.integers(0, 50)),
    st.builds(Step, st.integers(0, 50)),
    st.just(Idle()),
)


# -- JSON round trip -------------------------------------------------------------------------------

def test_every_op_kind_is_covered():
    assert {op.kind for op in EVERY_KIND} == set(OP_TYPES)


@pytest.mark.parametrize("op", EVERY_KIND, ids=format_op)
def test_op_round_trips_through_json_text(op):
    d = json.loads(json.dumps(op_to_dict(op)))
    assert d["op"] == op.kind
    back = op_from_dict(d)
    assert back == op and type(back) is type(op)


def test_program_round_trips_through_json_text():
    text = json.dumps(program_to_json(EVERY_KIND))
    assert program_from_json(json.loads(text)) == EVERY_KIND


@given(st.lists(ops_strategy, max_size=20))
def test_any_program_round_trips(ops):
    assert program_from_json(json.loads(json.dumps(program_to_json(ops)))) == ops


def test_ops_are_written_with_all_their_arguments():
    assert op_to_dict(Submit(1, 2, 3, None)) == {"op": "submit", "family": 1, "prompt_len": 2,
                                                 "max_new_tokens": 3, "stop_at": None, "session": None,
                                                 "extends": None}
    assert op_to_dict(CloseSession(2)) == {"op": "close_session", "handle": 2}
    assert op_to_dict(HealthCheck()) == {"op": "health_check"}
    assert op_to_dict(Abort(None)) == {"op": "abort", "handle": None}
    assert op_to_dict(Step(2)) == {"op": "step", "n": 2}
    assert op_to_dict(Idle()) == {"op": "idle"}


def test_arguments_added_later_are_written_only_when_set():
    """A program written before priority/ignore_eos existed serializes and prints as it did."""
    assert set(op_to_dict(Submit())) == {"op", "family", "prompt_len", "max_new_tokens", "stop_at", "session", "extends"}
    assert op_to_dict(FlushCache()) == {"op": "flush_cache"} and op_to_dict(FlushCache(3)) == {"op": "flush_cache",
                                                                                               "timeout": 3}
    assert op_to_dict(Submit(priority=0, ignore_eos=1))["priority"] == 0
    assert op_to_dict(Submit(ignore_eos=1))["ignore_eos"] == 1
    assert op_to_dict(PauseGeneration(1)) == {"op": "pause_generation", "mode": 1}
    assert op_from_dict({"op": "submit", "priority": None}) == Submit()


@pytest.mark.parametrize("d, match", [
    ({"op": "pause_generation", "mode": 3}, r'"mode" .* \[0, 2\]'),
    ({"op": "submit", "ignore_eos": 2}, r'"ignore_eos" .* \[0, 1\]'),
    ({"op": "continue_generation", "mode": 1}, 'no argument "mode"'),
])
def test_narrow_arguments_are_checked(d, match):
    with pytest.raises(ProgramError, match=match):
        op_from_dict(d)


def test_missing_arguments_take_the_defaults():
    assert op_from_dict({"op": "submit"}) == Submit()
    assert op_from_dict({"op": "step"}) == Step(1)
    assert op_from_dict({"op": "abort"}) == Abort(0)


# -- printing --------------------------------------------------------------------------------------

def test_format_op_is_readable():
    assert format_op(Submit(1, 8, 4, None)) == "submit(family=1, prompt_len=8, max_new_tokens=4)"
    assert format_op(Submit(1, 8, 4, 2)) == "submit(family=1, prompt_len=8, max_new_tokens=4, stop_at=2)"
    assert format_op(HealthCheck()) == "health_check()"
    assert format_op(Abort(None)) == "abort(handle=None)"
    assert format_op(Abort(2)) == "abort(handle=2)"
    assert format_op(Step(3)) == "step(n=3)"
    assert format_op(Idle()) == "idle()"
    assert format_op(Submit(1, 8, 4, priority=0)) == "submit(family=1, prompt_len=8, max_new_tokens=4, priority=0)"
    assert format_op(Submit(1, 8, 4, ignore_eos=1)) == "submit(family=1, prompt_len=8, max_new_tokens=4, ignore_eos=1)"
    assert format_op(PauseGeneration(2)) == "pause_generation(mode=2)"
    assert format_op(ContinueGeneration()) == "continue_generation()"


def test_format_program_numbers_one_op_per_line_from_zero():
    lines = format_program(EVERY_KIND).splitlines()
    assert len(lines) == len(EVERY_KIND)
    for i, (line, op) in enumerate(zip(lines, EVERY_KIND)):
        index, text = line.split(None, 1)
        assert int(index) == i
        assert text == format_op(op)


def test_format_program_of_nothing_is_empty():
    assert format_program([]) == ""


# -- malformed input -------------------------------------------------------------------------------

@pytest.mark.parametrize("data", [
    {"op": "submit"},  # an op, not a list
    "submit",
    None,
    42,
], ids=["dict", "str", "null", "int"])
def test_program_must_be_a_list(data):
    with pytest.raises(ProgramError, match="list"):
        program_from_json(data)


@pytest.mark.parametrize("bad, reason", [
    ({"op": "fork"}, "unknown op"),
    ({"op": None}, "unknown op"),
    ({"family": 1}, '"op" key'),
    (["submit"], '"op" key'),
    ("idle", '"op" key'),
    ({"op": "submit", "prompt_len": "8"}, "integer"),
    ({"op": "submit", "prompt_len": 8.0}, "integer"),
    ({"op": "submit", "prompt_len": True}, "integer"),
    ({"op": "step", "n": [1]}, "integer"),
    ({"op": "submit", "prompt_len": -1}, r"in \[0, 10000\]"),
    ({"op": "submit", "stop_at": -2}, r"in \[0, 10000\]"),
    ({"op": "abort", "handle": -1}, r"in \[0, 10000\]"),
    ({"op": "step", "n": -3}, r"in \[0, 10000\]"),
    ({"op": "step", "n": 10 ** 12}, r"in \[0, 10000\]"),  # would never return
    ({"op": "submit", "prompt_len": None}, "null"),
    ({"op": "step", "n": None}, "null"),
    ({"op": "step", "count": 2}, "no argument"),
    ({"op": "idle", "n": 1}, "no argument"),
])
def test_malformed_op_is_rejected_with_one_line(bad, reason):
    with pytest.raises(ProgramError, match=reason) as e:
        program_from_json([{"op": "idle"}, bad])
    assert "\n" not in str(e.value)


def test_program_error_is_a_value_error():
    assert issubclass(ProgramError, ValueError)


def test_nullable_arguments_accept_null():
    assert op_from_dict({"op": "submit", "stop_at": None}).stop_at is None
    assert op_from_dict({"op": "abort", "handle": None}) == Abort(None)


# -- prompts ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", [0, 1, 3, 17])
def test_prompts_of_one_family_share_their_prefix(family):
    long = prompt_tokens(family, 40)
    assert len(long) == 40
    for n in (1, 5, 16, 39):
        assert prompt_tokens(family, n) == long[:n]


def test_prompts_of_different_families_differ_from_the_first_token():
    firsts = {prompt_tokens(f, 8)[0] for f in range(4)}
    assert len(firsts) == 4
    assert prompt_tokens(0, 8) != prompt_tokens(1, 8)


@pytest.mark.parametrize("vocab", [8, 128, 1000])
def test_prompt_ids_stay_inside_the_vocabulary_and_avoid_pad_and_eos(vocab):
    for f in range(5):
        toks = prompt_tokens(f, 64, vocab)
        assert all(2 <= t < vocab for t in toks)


def test_prompt_of_length_zero_is_empty():
    assert prompt_tokens(0, 0) == []


@pytest.mark.parametrize("op_value", [["submit"], {"kind": "submit"}], ids=["list", "dict"])
def test_unhashable_op_name_is_a_program_error(op_value):
    with pytest.raises(ProgramError, match="unknown op"):
        program_from_json([{"op": op_value}])


# -- the random generator ------------------------------------------------------------------------

def _drawn(features, n=60):
    rng = random.Random(7)
    ops = [op for _ in range(n) for op in random_program(rng, 24, 40, features)]
    subs = [op for op in ops if isinstance(op, Submit)]
    return ops, subs


def test_random_programs_draw_target_features_only_when_asked():
    ops, subs = _drawn(frozenset())
    assert {op.kind for op in ops} >= {"pause_generation", "continue_generation"}  # every target has them
    assert any(s.ignore_eos for s in subs)  # likewise (only with a stop_at)
    assert all(s.priority is None and s.grammar is None and s.parent is None and not s.replace for s in subs)
    assert all(op.timeout == 0 for op in ops if isinstance(op, FlushCache))
    ops, subs = _drawn(frozenset(FEATURES))
    assert any(s.priority is not None for s in subs) and any(s.grammar is not None for s in subs)
    assert any(s.parent is not None and s.session is not None for s in subs)
    assert all(s.parent is None for s in subs if s.session is None)  # session params only on turns
    assert any(op.timeout for op in ops if isinstance(op, FlushCache))
    assert all(not s.ignore_eos for s in subs if s.stop_at is None)


def test_random_programs_make_every_session_edit_a_target_accepts():
    """An edited turn always named a parent, so 'replace' with no parent (SGLang 0.5.23 crashed on
    it: corpora/sglang/crash-session-replace-without-rid.json) was never generated by --fuzzer random
    (0 in 100,000 programs). Each edit now comes with and without a parent."""
    _, subs = _drawn(frozenset({"session_params"}), n=300)
    edited = [s for s in subs if s.replace or s.drop_previous_output or s.offset is not None]
    for name in ("replace", "drop_previous_output", "offset"):
        mine = [s for s in edited if (s.offset is not None if name == "offset" else getattr(s, name))]
        assert any(s.parent is None for s in mine) and any(s.parent is not None for s in mine), name
